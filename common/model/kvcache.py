"""The KV cache as the transport sees it: prefill a context, cut its cache into symbols, rebuild it.

Serialised KV is host bytes [layers, KV heads, tokens, K|V] in the transfer dtype; on a GPU it is
quantised and packed there and crosses to the host once, through the device's pinned staging buffer. A
rebuilt cache keeps its full length whatever was lost, so the question is fed at its original positions:
``mask`` mode hides unavailable (layer, KV head, token) rows from attention (``attention.pfec_sdpa``),
``zero`` mode is the paper's zero-fill of missing bytes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache

from pfec.common.model.attention import Observation, observing
from pfec.common.model.loading import ModelRuntime, check_length
from pfec.common.model.quant import (
    DequantisedKV,
    Layers,
    checked_levels,
    dequantise,
    pieces_on,
    place,
    quantise,
    quantise_tensors,
)
from pfec.common.model.staging import pack_stream_tensor, to_device, to_host, unpack_stream_tensor
from pfec.common.plan.kvlayout import (
    FRAGMENT_ID_SIZE,
    BlockPlan,
    assemble_rows,
    decode_fragment_ids,
    fragment_symbols,
)
from pfec.common.plan.precision import PieceKind, PiecePlan, pack_stream, unpack_stream

ReconstructionMode = Literal["mask", "zero"]
# The cache type as node code names it (under TYPE_CHECKING: only common/model imports transformers).
KVCache: TypeAlias = DynamicCache


# --- Prefill, serialise ----------------------------------------------------------------------------------


def prefill(runtime: ModelRuntime, context_ids: Sequence[int],
            observe_window: int = 0) -> tuple[DynamicCache, Observation | None]:
    """Run the context once; returns its cache (and, with observe_window > 0, per-request attention mass)."""
    check_length(runtime, len(context_ids))
    ids = torch.tensor([list(context_ids)], device=runtime.device)
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        obs = stack.enter_context(observing(observe_window)) if observe_window > 0 else None
        cache = DynamicCache(config=runtime.model.config)
        runtime.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, obs


class ChunkStopped(Exception):
    """A chunk's prefill stopped between two layers (its ``stop`` was set); the cache is as before it."""


def prefill_chunk(runtime: ModelRuntime, cache: DynamicCache | None, chunk_ids: Sequence[int],
                  stop: threading.Event | None = None) -> DynamicCache:
    """Extend ``cache`` (the KV of context tokens [0, i); None: i = 0) with ``chunk_ids`` = tokens [i, j).

    Exact: a causal prefix's KV does not depend on what follows, so prefilling [0, N) chunk by chunk gives
    the one-pass cache (to the float rounding of a different matmul split). The receiver of a split handoff
    computes the front this way, reporting progress after every chunk. Returns the (same) cache.

    With ``stop``, the chunk checks it before every decoder layer: a session that becomes ready mid-chunk
    (its stream arrived) starts without waiting for the rest of a chunk it no longer needs. Then the layers
    already extended are cut back to [0, i) and ``ChunkStopped`` is raised.
    """
    start = 0 if cache is None else int(cache.get_seq_length())
    if not chunk_ids:
        if cache is None:
            raise ValueError("an empty first chunk: nothing to prefill")
        return cache
    check_length(runtime, start + len(chunk_ids))
    ids = torch.tensor([list(chunk_ids)], device=runtime.device)
    positions = torch.arange(start, start + len(chunk_ids), device=runtime.device)[None]
    with torch.inference_mode(), _stoppable(runtime, stop):
        if cache is None:
            cache = DynamicCache(config=runtime.model.config)
        try:
            runtime.model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True,
                          logits_to_keep=1)
        except ChunkStopped:
            _cut_back(cache, start)
            raise
    return cache


@contextlib.contextmanager
def _stoppable(runtime: ModelRuntime, stop: threading.Event | None) -> Iterator[None]:
    """Raise ``ChunkStopped`` before any decoder layer runs once ``stop`` is set (no-op without ``stop``, or
    for a model whose layer stack is not found: its chunks then run whole). Only in this thread: a node
    whose sender and receiver share one model object may run another forward meanwhile."""
    layers = _decoder_layers(runtime.model) if stop is not None else None
    if stop is None or layers is None:
        yield
        return
    owner = threading.get_ident()

    def check(_module: torch.nn.Module, _args: object) -> None:
        if stop.is_set() and threading.get_ident() == owner:
            raise ChunkStopped

    handles = [layer.register_forward_pre_hook(check) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers: the ModuleList as long as ``config.num_hidden_layers``."""
    n_layers = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return module
    return None


def _cut_back(cache: DynamicCache, n_tokens: int) -> None:
    """Every layer back to its first ``n_tokens`` (a stopped chunk extended only the layers before it)."""
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and keys.shape[-2] > n_tokens:
            layer.keys = keys[..., :n_tokens, :]
        if isinstance(values, torch.Tensor) and values.shape[-2] > n_tokens:
            layer.values = values[..., :n_tokens, :]


def join_prefix(kv: PartialKV, prefix: DynamicCache, n_prefix: int, copied: int = 0) -> PartialKV:
    """Replace context tokens [0, n_prefix) of a rebuilt cache with a locally computed ``prefix`` (exact),
    marking them available; the received rows after it stay as rebuilt (missing ones masked as before).
    ``copied``: rows [0, copied) already hold the prefix's (``LiveRebuild.place_computed``)."""
    layers = cache_layers(prefix)
    have = int(layers[0][0].shape[2])
    if not 0 <= n_prefix <= min(have, kv.n_context):
        raise ValueError(f"prefix of {n_prefix} tokens: {have} computed, {kv.n_context} in the context")
    if n_prefix == 0:
        return kv
    start = min(max(0, copied), n_prefix)
    for i, (k, v) in enumerate(layers):
        kv.keys[i][:, :, start:n_prefix] = k[:, :, start:n_prefix].to(kv.keys[i].dtype)
        kv.values[i][:, :, start:n_prefix] = v[:, :, start:n_prefix].to(kv.values[i].dtype)
    if kv.row_masks is not None:
        masks = kv.row_masks
        for i, mask in enumerate(masks):
            if mask is not None:
                mask[:, :n_prefix] = True
                if bool(mask.all()):
                    masks[i] = None
    return kv


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [1, n_kv_heads, T, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_rows(runtime: ModelRuntime, cache: DynamicCache,
               n_tokens: int | None = None) -> npt.NDArray[np.uint8]:
    """KV as host bytes [layers, KV heads, tokens, K|V] in the transfer dtype (native little-endian).

    On a GPU the cast happens on the device and the bytes cross once, through its pinned staging buffer.
    """
    if sys.byteorder != "little":
        raise RuntimeError("KV serialisation assumes a little-endian host")
    layers = cache_layers(cache)
    n = layers[0][0].shape[2] if n_tokens is None else n_tokens
    kv = torch.stack([torch.cat([k[0, :, :n], v[0, :, :n]], dim=-1) for k, v in layers])
    kv = kv.to(runtime.transfer_dtype).contiguous().view(torch.uint8)
    if kv.device.type != "cuda":
        return np.asarray(kv.numpy(), dtype=np.uint8)
    out = np.empty(tuple(kv.shape), dtype=np.uint8)
    to_host(kv.view(-1, kv.shape[-1]), out.reshape(-1, kv.shape[-1]))
    return out


def serialise_symbols(runtime: ModelRuntime, cache: DynamicCache, plan: BlockPlan,
                      fragment_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    """Symbols (4-byte fragment id + KV payload) in the order of ``fragment_ids`` (e.g. the send queue)."""
    if plan.geometry != runtime.geometry:
        raise ValueError(f"plan geometry {plan.geometry} is not the model's {runtime.geometry}")
    return fragment_symbols(plan, cache_rows(runtime, cache, plan.n_tokens), fragment_ids)


def stream_symbols(layers: Layers, plan: PiecePlan) -> npt.NDArray[np.uint8]:
    """The plan's symbols with their 4-byte stream index in front: [n_symbols, 4 + plan.symbol_size].

    Row i is stream symbol i (send order = stream order); the index is big-endian, as a native handoff's
    fragment id, so the receiver files a symbol whatever order it decoded it in.
    """
    kinds = [PieceKind(k) for k in np.unique(plan.kinds).tolist()]
    out = np.empty((plan.n_symbols, FRAGMENT_ID_SIZE + plan.symbol_size), dtype=np.uint8)
    out[:, :FRAGMENT_ID_SIZE] = np.arange(plan.n_symbols, dtype=">u4").view(np.uint8).reshape(-1, 4)
    if layers[0][0].device.type == "cuda":  # quantised and packed on the GPU, one trip to the host
        packed = pack_stream_tensor(plan, quantise_tensors(layers, plan.layout, kinds))
        to_host(packed, out[:, FRAGMENT_ID_SIZE:])
    else:
        out[:, FRAGMENT_ID_SIZE:] = pack_stream(plan, quantise(layers, plan.layout, kinds))
    return out


def dequantise_stream(plan: PiecePlan, store: npt.NDArray[np.uint8], levels: npt.ArrayLike,
                      bases: npt.ArrayLike, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DequantisedKV:
    """The cache from a stream's symbol store [n_symbols, plan.symbol_size] at the given block levels
    (``PiecePlan.usable``: only complete pieces are read). A GPU uploads the store once and unpacks it
    there."""
    device = torch.device(device)
    if device.type == "cuda":
        pieces = unpack_stream_tensor(plan, to_device(store, device))
        return dequantise(pieces, plan.layout, levels, bases, dtype, device)
    return dequantise(unpack_stream(plan, store), plan.layout, levels, bases, dtype, device)


def serialise_stream(runtime: ModelRuntime, cache: DynamicCache, plan: PiecePlan) -> npt.NDArray[np.uint8]:
    """A progressive-precision stream's symbols (4-byte stream index + payload), quantised from ``cache``
    where it lies (``stream_symbols``)."""
    if plan.layout.geometry != runtime.geometry:
        raise ValueError(f"piece plan geometry {plan.layout.geometry} is not the model's {runtime.geometry}")
    n = plan.layout.n_tokens
    layers = [(k[:, :, :n], v[:, :, :n]) for k, v in cache_layers(cache)]
    return stream_symbols(layers, plan)


# --- Rebuild ----------------------------------------------------------------------------------------------


@dataclass
class PartialKV:
    """A rebuilt cache and, in mask mode, its per-layer row masks (None where a layer is complete)."""

    keys: list[torch.Tensor]  # [1, Hkv, T, D] per layer, compute dtype, on the model's device
    values: list[torch.Tensor]
    row_masks: list[torch.Tensor | None] | None
    n_context: int
    mode: ReconstructionMode
    rebuild_s: float = 0.0

    def fresh_cache(self) -> DynamicCache:
        """A new DynamicCache over these tensors; decoding appends to it, the tensors stay untouched."""
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.update(k, v, layer)
        return cache

    @property
    def available_fraction(self) -> float:
        if self.row_masks is None:
            return 1.0
        total = have = 0
        for i, mask in enumerate(self.row_masks):
            rows = int(self.keys[i].shape[1]) * self.n_context
            total += rows
            have += rows if mask is None else int(mask.sum())
        return have / total


def rebuild_from_rows(runtime: ModelRuntime, rows: npt.NDArray[np.uint8], available: npt.NDArray[np.bool_],
                      mode: ReconstructionMode = "mask") -> PartialKV:
    """Host bytes [layers, heads, tokens, K|V] + usable rows [layers, heads, tokens] -> PartialKV."""
    if mode not in ("mask", "zero"):
        raise ValueError(f"reconstruction mode {mode!r} is not one of mask, zero")
    started = time.perf_counter()
    g = runtime.geometry
    flat = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1])  # through the pinned buffer on a GPU
    kv = to_device(flat, runtime.device).view(rows.shape).view(runtime.transfer_dtype)
    kv = kv.to(runtime.compute_dtype)
    ok = torch.from_numpy(np.ascontiguousarray(available)).to(runtime.device)
    if mode == "mask":  # masked rows get zero weight, but 0 * NaN is NaN: clear whatever bytes they hold
        kv = torch.where(ok[..., None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    keys = [kv[i, None, :, :, : g.head_dim] for i in range(g.n_layers)]
    values = [kv[i, None, :, :, g.head_dim :] for i in range(g.n_layers)]
    masks = _layer_masks(ok) if mode == "mask" else None
    elapsed = time.perf_counter() - started
    return PartialKV(keys, values, masks, rows.shape[2], mode, elapsed)


def rebuild_from_symbols(runtime: ModelRuntime, plan: BlockPlan, symbols: npt.NDArray[np.uint8],
                         have: npt.NDArray[np.bool_], mode: ReconstructionMode = "mask") -> PartialKV:
    """Decoded symbol store [n_fragments, symbol_size] + have-mask [n_fragments] -> PartialKV."""
    if plan.geometry != runtime.geometry:
        raise ValueError(f"plan geometry {plan.geometry} is not the model's {runtime.geometry}")
    started = time.perf_counter()
    rows, available = assemble_rows(plan, symbols, have)
    kv = rebuild_from_rows(runtime, rows, available, mode)
    kv.rebuild_s = time.perf_counter() - started
    return kv


def rebuild_from_stream(runtime: ModelRuntime, plan: PiecePlan, store: npt.NDArray[np.uint8],
                        levels: npt.NDArray[np.int8], bases: npt.NDArray[np.int8],
                        mode: ReconstructionMode = "mask") -> PartialKV:
    """A stream's symbol store [n_symbols, payload] + each block's usable level -> PartialKV: every block
    at the best level that arrived (dequantised into the compute dtype), blocks with none masked (mask
    mode) or zero (zero mode), as a native rebuild treats missing blocks."""
    if mode not in ("mask", "zero"):
        raise ValueError(f"reconstruction mode {mode!r} is not one of mask, zero")
    if plan.layout.geometry != runtime.geometry:
        raise ValueError(f"piece plan geometry {plan.layout.geometry} is not the model's {runtime.geometry}")
    started = time.perf_counter()
    kv = dequantise_stream(plan, store, levels, bases, runtime.compute_dtype, runtime.device)
    masks = _layer_masks(kv.available) if mode == "mask" else None
    elapsed = time.perf_counter() - started
    return PartialKV(kv.keys, kv.values, masks, plan.layout.n_tokens, mode, elapsed)


class LiveRebuild:
    """A quantised stream's cache, built while the stream arrives: each block is dequantised into the
    final tensors once its pieces complete, and again when a refinement raises its level, so that when
    the session starts only the last blocks, the missing rows' masks and the question remain.

    The event loop hands over the decoded symbols as they come (``offer``: rows of 4-byte stream index +
    payload, copied off the decoder); the model worker places them (``drain``, between a split's front
    chunks or as a job of its own) and builds the cache at the deadline (``finish``) from the levels the
    session scored, equal to what ``rebuild_from_stream`` builds from the same store (each block is
    dequantised on its own: ``quant.place``). Tensors are allocated on the first ``drain``."""

    def __init__(self, runtime: ModelRuntime, plan: PiecePlan) -> None:
        if plan.layout.geometry != runtime.geometry:
            raise ValueError(f"piece plan geometry {plan.layout.geometry} is not the model's "
                             f"{runtime.geometry}")
        self.runtime, self.plan = runtime, plan
        self.inbox: deque[npt.NDArray[np.uint8]] = deque()  # loop -> worker (deque: thread-safe ends)
        self.store = np.zeros((plan.n_symbols, plan.symbol_size), dtype=np.uint8)
        self.have = np.zeros(plan.n_symbols, dtype=np.bool_)
        self.levels = np.zeros(plan.layout.n_blocks, dtype=np.int64)  # as placed
        self.bases = np.zeros(plan.layout.n_blocks, dtype=np.int64)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.placed = 0  # block placements so far (a refined block counts again)
        self.placed_before = 0  # of them, before ``finish``
        self.failed: str | None = None  # a drain refused a block (the deadline's rebuild then runs whole)
        self.computed = 0  # a split's front rows [0, computed) copied in (whole blocks; ``place_computed``)
        self.place_s = 0.0  # worker seconds spent placing before the deadline

    def offer(self, rows: npt.NDArray[np.uint8]) -> None:
        """Event loop: newly decoded symbols [n, 4 + symbol_size] (a copy: the decoder keeps its store)."""
        if rows.ndim != 2 or rows.shape[1] != FRAGMENT_ID_SIZE + self.plan.symbol_size or not len(rows):
            return
        self.inbox.append(rows)

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            g, rt = self.plan.layout.geometry, self.runtime
            shape = (g.n_layers, g.n_kv_heads, self.plan.layout.n_tokens, g.head_dim)
            self.keys = torch.zeros(shape, dtype=rt.compute_dtype, device=rt.device)
            self.values = torch.zeros(shape, dtype=rt.compute_dtype, device=rt.device)
        return self.keys, self.values

    def _place(self, store: npt.NDArray[np.uint8], levels: npt.ArrayLike, bases: npt.ArrayLike) -> int:
        lv, bs = checked_levels(self.plan.layout, levels, bases)
        exact = self._computed_blocks()  # rows computed here: no stream block replaces them
        lv, bs = np.where(exact, 0, lv), np.where(exact, 0, bs)
        changed = (lv != self.levels) | ((bs != self.bases) & (lv > 0))
        if not changed.any():
            return 0
        keys, values = self._tensors()
        pieces = pieces_on(unpack_stream(self.plan, store, changed), keys.device)
        place(pieces, self.plan.layout, lv, bs, keys, values, changed)
        self.levels, self.bases = lv, bs
        self.placed += int(changed.sum())
        return int(changed.sum())

    def _computed_blocks(self) -> npt.NDArray[np.bool_]:
        """Blocks whose every token lies in the computed rows [0, ``computed``)."""
        layout = self.plan.layout
        ends = np.minimum((np.arange(layout.n_blocks) % layout.n_token_blocks + 1) * layout.block_tokens,
                          layout.n_tokens)
        return np.asarray(ends <= self.computed)

    def place_computed(self, cache: DynamicCache | None, tokens: int) -> int:
        """Worker: a split's front computed here up to ``tokens``: its rows of whole blocks not copied yet
        into the cache (exact; a stream block there is no longer placed). Returns the tokens copied."""
        if cache is None or self.failed is not None:
            return 0
        upto = min(tokens, self.plan.layout.n_tokens) // self.plan.layout.block_tokens
        upto *= self.plan.layout.block_tokens
        if upto <= self.computed:
            return 0
        keys, values = self._tensors()
        for i, (k, v) in enumerate(cache_layers(cache)):
            keys[i, :, self.computed : upto] = k[0, :, self.computed : upto].to(keys.dtype)
            values[i, :, self.computed : upto] = v[0, :, self.computed : upto].to(values.dtype)
        copied, self.computed = upto - self.computed, upto
        exact = self._computed_blocks()
        self.levels[exact], self.bases[exact] = 0, 0  # the front's rows, masked until the join
        return copied

    def drain(self) -> int:
        """Worker: file what the loop handed over and place every block whose usable level rose; returns
        the blocks placed. A block refused (a piece with NaN scales) stops the live build (``failed``): the
        deadline's one-shot rebuild refuses it as before."""
        if not self.inbox or self.failed is not None:
            return 0
        try:
            return self._drain()
        except ValueError as exc:
            self.failed = str(exc)
            self.inbox.clear()
            return 0

    def _drain(self) -> int:
        started = time.perf_counter()
        while self.inbox:
            rows = self.inbox.popleft()
            ids = decode_fragment_ids(rows)
            ok = (ids >= 0) & (ids < self.plan.n_symbols)
            self.store[ids[ok]] = rows[ok, FRAGMENT_ID_SIZE:]
            self.have[ids[ok]] = True
        levels, bases = self.plan.usable(self.have)
        placed = self._place(self.store, levels, bases)
        self.place_s += time.perf_counter() - started
        return placed

    def finish(self, store: npt.NDArray[np.uint8], levels: npt.ArrayLike, bases: npt.ArrayLike,
               mode: ReconstructionMode = "mask") -> PartialKV:
        """Worker, at the deadline: the cache at the session's ``levels`` (from its whole ``store``, filed
        by stream index): the blocks not yet placed at their level placed now, those placed but now at
        NONE (a split's computed front, a chain's lost blocks) zeroed, except the front's rows copied in
        (``place_computed``: ``join_prefix(..., copied=computed)`` completes them); the rows' masks."""
        if mode not in ("mask", "zero"):
            raise ValueError(f"reconstruction mode {mode!r} is not one of mask, zero")
        started = time.perf_counter()
        self.inbox.clear()
        self.placed_before = self.placed
        self._place(store, levels, bases)
        keys, values = self._tensors()
        g, layout = self.plan.layout.geometry, self.plan.layout
        have = torch.from_numpy(self.levels.reshape(g.n_layers, layout.n_token_blocks) > 0).to(keys.device)
        available = have.repeat_interleave(layout.block_tokens, dim=1)[:, None, : layout.n_tokens]
        available = available.expand(g.n_layers, g.n_kv_heads, layout.n_tokens)
        masks = _layer_masks(available) if mode == "mask" else None
        layers = range(g.n_layers)
        return PartialKV([keys[i, None] for i in layers], [values[i, None] for i in layers], masks,
                         layout.n_tokens, mode, time.perf_counter() - started)


def _layer_masks(available: torch.Tensor) -> list[torch.Tensor | None]:
    """Per-layer row masks for ``pfec_sdpa`` from usable rows [layers, KV heads, tokens].

    A (layer, KV head) with no usable context row at all is not masked: its rows are zero, i.e. it falls
    back to zero-fill. Masking every context row would leave that head attending only to the question's
    own rows, a distribution the model never saw; zero rows act as a null attention sink instead.
    Measured on the default model (docs/RESULTS.md): with the lowest-utility 20% of blocks lost (whole
    layers), pure masking answered 0/10, zero-fill 3/10.
    """
    attend = available | ~available.any(dim=-1, keepdim=True)
    return [None if bool(attend[i].all()) else attend[i] for i in range(attend.shape[0])]


def partial_from_cache(cache: DynamicCache, available: torch.Tensor | None, mode: ReconstructionMode,
                       n_context: int | None = None) -> PartialKV:
    """A PartialKV straight from a local cache with rows [layers, heads, tokens] dropped (profiling)."""
    layers = cache_layers(cache)
    n = layers[0][0].shape[2] if n_context is None else n_context
    keys, values = [k[:, :, :n] for k, _ in layers], [v[:, :, :n] for _, v in layers]
    masks: list[torch.Tensor | None] | None = None
    if available is not None:
        keys = [k * available[i, None, :, :, None].to(k.dtype) for i, k in enumerate(keys)]
        values = [v * available[i, None, :, :, None].to(v.dtype) for i, v in enumerate(values)]
        if mode == "mask":
            masks = _layer_masks(available)
    return PartialKV(keys, values, masks, n, mode)
