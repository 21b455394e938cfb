"""Transfer plan: model geometry + token count -> equal-size KV blocks and their fragments.

Pure: no torch. A *block* is one layer x ``block_tokens`` consecutive tokens holding K and V of every KV
head. Each block is cut into fragments of ``fragment_payload`` bytes (the transport symbol minus the
protected 4-byte fragment id); the last fragment of a block is zero-padded. Fragment ids are global and
self-describing (block, index within block), so a receiver can place a fragment without knowing the
order the sender chose.

Block id ``b = layer * n_token_blocks + token_block``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

FRAGMENT_ID_SIZE = 4
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one model's KV cache, per token."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVGeometry.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of K (or of V) for one (layer, KV head, token) row."""
        return self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of every layer and KV head for one token."""
        return 2 * self.n_layers * self.n_kv_heads * self.row_bytes


# SmolLM2-135M-Instruct, the embedded default model (DESIGN.md): 23,040 B of KV per token in bf16.
DEFAULT_GEOMETRY = KVGeometry(n_layers=30, n_kv_heads=3, head_dim=64, dtype="bf16")


@dataclass(frozen=True)
class BlockPlan:
    """Blocks and fragments of one handoff. Equal plans on both nodes give equal fragment ids."""

    geometry: KVGeometry
    n_tokens: int
    symbol_size: int
    block_tokens: int = 16
    _first_fragment: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_tokens <= 0:
            raise ValueError(f"BlockPlan.n_tokens must be positive, got {self.n_tokens!r}")
        if self.block_tokens <= 0:
            raise ValueError(f"BlockPlan.block_tokens must be positive, got {self.block_tokens!r}")
        if self.symbol_size <= FRAGMENT_ID_SIZE:
            raise ValueError(
                f"BlockPlan.symbol_size {self.symbol_size} leaves no room for KV after the "
                f"{FRAGMENT_ID_SIZE}-byte fragment id"
            )
        per_block = np.array(
            [-(-self.block_bytes(b) // self.fragment_payload) for b in range(self.n_token_blocks)],
            dtype=np.int64,
        )
        counts = np.tile(per_block, self.geometry.n_layers)
        first = np.zeros(self.n_blocks + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        object.__setattr__(self, "_first_fragment", first)

    @property
    def fragment_payload(self) -> int:
        return self.symbol_size - FRAGMENT_ID_SIZE

    @property
    def n_token_blocks(self) -> int:
        return -(-self.n_tokens // self.block_tokens)

    @property
    def n_blocks(self) -> int:
        return self.geometry.n_layers * self.n_token_blocks

    @property
    def n_fragments(self) -> int:
        return int(self._first_fragment[-1])

    @property
    def kv_bytes(self) -> int:
        return self.n_tokens * self.geometry.bytes_per_token

    def block_layer(self, block: int) -> int:
        return block // self.n_token_blocks

    def block_token_range(self, block: int) -> tuple[int, int]:
        tb = block % self.n_token_blocks
        start = tb * self.block_tokens
        return start, min(start + self.block_tokens, self.n_tokens)

    def block_bytes(self, block: int) -> int:
        start, end = self.block_token_range(block)
        return (end - start) * 2 * self.geometry.n_kv_heads * self.geometry.row_bytes

    def block_fragments(self, block: int) -> range:
        """Global fragment ids of one block."""
        return range(int(self._first_fragment[block]), int(self._first_fragment[block + 1]))

    @cached_property
    def fragment_block(self) -> npt.NDArray[np.int64]:
        """Block id of every fragment id."""
        counts = np.diff(self._first_fragment)
        return np.repeat(np.arange(self.n_blocks, dtype=np.int64), counts)

    @cached_property
    def fragment_token_end(self) -> npt.NDArray[np.int64]:
        """The token end of every fragment id's block (once the receiver has computed the context up to
        it, a split needs nothing in the fragment)."""
        token_block = self.fragment_block % self.n_token_blocks
        return np.minimum((token_block + 1) * self.block_tokens, self.n_tokens)

    @property
    def first_fragment(self) -> npt.NDArray[np.int64]:
        """first_fragment[b] .. first_fragment[b+1]-1 are block b's fragment ids (read-only view)."""
        view = self._first_fragment.view()
        view.flags.writeable = False
        return view

    def fragment_queue(self, block_order: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Fragment ids in send order: every fragment of the first block in ``block_order``, then the next."""
        order = np.asarray(block_order, dtype=np.int64)
        if order.shape != (self.n_blocks,) or not np.array_equal(np.sort(order), np.arange(self.n_blocks)):
            raise ValueError(
                f"block order must be a permutation of the plan's {self.n_blocks} blocks, "
                f"got shape {order.shape}"
            )
        starts = self._first_fragment[order]
        counts = self._first_fragment[order + 1] - starts
        return np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])


def fitted_symbol_size(geometry: KVGeometry, max_symbol_size: int, block_tokens: int = 16) -> int:
    """Smallest symbol size that cuts a full block into as few fragments as ``max_symbol_size`` allows.

    With a fixed 1362-B symbol a 12,288-B block of the default model needs 10 fragments, the last one
    holding 66 B; equal 1,230-B fragments need 10 too but leave only 12 B of padding, and their shorter
    datagrams free link time (96.6% instead of 87.8% KV bytes per wire byte). Payloads stay a whole number
    of elements so no element straddles two fragments.
    """
    payload_max = max_symbol_size - FRAGMENT_ID_SIZE
    if payload_max <= 0:
        raise ValueError(f"max symbol size {max_symbol_size} leaves no room for the fragment id")
    block = block_tokens * 2 * geometry.n_kv_heads * geometry.row_bytes
    count = -(-block // payload_max)
    payload = -(-block // count)
    elem = geometry.dtype_bytes
    payload = -(-payload // elem) * elem
    return payload + FRAGMENT_ID_SIZE


# --- Byte layout of a block ------------------------------------------------------------------------------
#
# Inside block b (layer l, tokens s..e) the bytes are rows ordered (KV head, token); each row is that
# (head, token)'s K vector followed directly by its V vector (2 * row_bytes). Keeping K and V of a row
# adjacent means a lost fragment makes ~payload / (2 * row_bytes) rows unusable, half as many as a
# K-section/V-section layout, where one lost fragment of K and one of V would each spoil different rows.
# The layer tensors this layout cuts are therefore [n_kv_heads, n_tokens, 2 * head_dim] elements, i.e.
# K and V concatenated on the last axis, which llm.py builds with one torch.cat.


def encode_fragment_id(fragment_id: int) -> bytes:
    """The protected 4-byte fragment id that prefixes each symbol (big-endian)."""
    return int(fragment_id).to_bytes(FRAGMENT_ID_SIZE, "big")


def decode_fragment_ids(symbols: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64]:
    """Fragment ids of a [n, symbol_size] array of symbols."""
    head = np.ascontiguousarray(symbols[:, :FRAGMENT_ID_SIZE]).astype(np.int64)
    ids = np.zeros(len(symbols), dtype=np.int64)
    for i in range(FRAGMENT_ID_SIZE):
        ids = (ids << 8) | head[:, i]
    return ids


def _check_layer_rows(plan: BlockPlan, layer_rows: npt.NDArray[np.uint8]) -> None:
    g = plan.geometry
    want = (g.n_layers, g.n_kv_heads, plan.n_tokens, 2 * g.row_bytes)
    if layer_rows.shape != want or layer_rows.dtype != np.uint8:
        raise ValueError(
            f"KV rows have shape {layer_rows.shape} {layer_rows.dtype}, the plan needs {want} uint8 "
            "(layers, KV heads, tokens, K|V bytes)"
        )


def block_bytes_of(plan: BlockPlan, layer_rows: npt.NDArray[np.uint8], block: int) -> npt.NDArray[np.uint8]:
    """The serialised bytes of one block, from all rows [layers, KV heads, tokens, K|V bytes]."""
    start, end = plan.block_token_range(block)
    return np.ascontiguousarray(layer_rows[plan.block_layer(block), :, start:end, :]).reshape(-1)


def fragment_symbols(
    plan: BlockPlan, layer_rows: npt.NDArray[np.uint8], fragment_ids: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint8]:
    """Symbols (4-byte id + payload, last fragment of a block zero-padded) for ``fragment_ids``, in order.

    Returns an array [len(fragment_ids), symbol_size] uint8; row i is the symbol of fragment_ids[i].
    """
    _check_layer_rows(plan, layer_rows)
    ids = np.asarray(fragment_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= plan.n_fragments):
        bad = int(ids[(ids < 0) | (ids >= plan.n_fragments)][0])
        raise ValueError(f"fragment id {bad} is outside the plan's 0..{plan.n_fragments - 1}")
    payload = plan.fragment_payload
    out = np.zeros((len(ids), plan.symbol_size), dtype=np.uint8)
    for i, shift in enumerate(range(8 * (FRAGMENT_ID_SIZE - 1), -1, -8)):
        out[:, i] = (ids >> shift) & 0xFF
    blocks = plan.fragment_block[ids] if ids.size else ids
    cached_block, cached_bytes = -1, np.zeros(0, dtype=np.uint8)
    for row, (fid, block) in enumerate(zip(ids.tolist(), blocks.tolist(), strict=True)):
        if block != cached_block:  # send queues keep a block's fragments together
            cached_block, cached_bytes = block, block_bytes_of(plan, layer_rows, block)
        offset = (fid - int(plan.first_fragment[block])) * payload
        chunk = cached_bytes[offset : offset + payload]
        out[row, FRAGMENT_ID_SIZE : FRAGMENT_ID_SIZE + len(chunk)] = chunk
    return out


def received_mask(plan: BlockPlan, fragment_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Bool [n_fragments] from received fragment ids; an id outside the plan is a clear error."""
    ids = np.asarray(fragment_ids, dtype=np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= plan.n_fragments)]
    if bad.size:
        raise ValueError(
            f"fragment id {int(bad[0])} is not in the plan (0..{plan.n_fragments - 1}): "
            "the fragment map belongs to a different plan (token count, symbol size or geometry)"
        )
    have = np.zeros(plan.n_fragments, dtype=bool)
    have[ids] = True
    return have


def _check_have(plan: BlockPlan, have: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    have = np.asarray(have)
    if have.dtype != np.bool_ or have.shape != (plan.n_fragments,):
        raise ValueError(
            f"have-mask has shape {have.shape} {have.dtype}, the plan needs ({plan.n_fragments},) bool: "
            "the fragment map is inconsistent with the plan"
        )
    return have


def _row_fragment_span(plan: BlockPlan, block: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """First and last fragment (relative to the block) holding each (head, token) row's K|V bytes."""
    start, end = plan.block_token_range(block)
    n_rows = plan.geometry.n_kv_heads * (end - start)
    span = 2 * plan.geometry.row_bytes
    first_byte = np.arange(n_rows, dtype=np.int64) * span
    return first_byte // plan.fragment_payload, (first_byte + span - 1) // plan.fragment_payload


def row_availability(plan: BlockPlan, have: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Usable rows [layers, KV heads, tokens]: True where every K and V byte of the row arrived."""
    have = _check_have(plan, have)
    g = plan.geometry
    avail = np.zeros((g.n_layers, g.n_kv_heads, plan.n_tokens), dtype=bool)
    # Token blocks of equal length share their row -> fragment map; compute it once per length.
    spans: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}
    missing_prefix = np.concatenate([[0], np.cumsum(~have)])
    for tb in range(plan.n_token_blocks):
        start, end = plan.block_token_range(tb)
        if end - start not in spans:
            spans[end - start] = _row_fragment_span(plan, tb)
        lo, hi = spans[end - start]
        blocks = np.arange(g.n_layers) * plan.n_token_blocks + tb
        base = plan.first_fragment[blocks][:, None]
        # A row is whole iff no fragment in [lo, hi] is missing.
        ok = missing_prefix[base + hi + 1] - missing_prefix[base + lo] == 0
        avail[:, :, start:end] = ok.reshape(g.n_layers, g.n_kv_heads, end - start)
    return avail


def assemble_rows(
    plan: BlockPlan, symbols: npt.NDArray[np.uint8], have: npt.NDArray[np.bool_]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
    """Decoded symbol store -> (rows [layers, heads, tokens, K|V bytes], usable rows [layers, heads, tokens]).

    ``symbols`` is [n_fragments, symbol_size] uint8 indexed by fragment id; only rows where ``have`` is True
    are read, and each must carry its own id in its 4-byte prefix (a mismatch means the store and the
    plan disagree). Bytes of missing fragments are zero, which is exactly the paper's element zero-fill
    (payloads are whole elements, so no element straddles two fragments).
    """
    have = _check_have(plan, have)
    if symbols.dtype != np.uint8 or symbols.shape != (plan.n_fragments, plan.symbol_size):
        raise ValueError(
            f"symbol store has shape {symbols.shape} {symbols.dtype}, the plan needs "
            f"({plan.n_fragments}, {plan.symbol_size}) uint8"
        )
    present = np.flatnonzero(have)
    stored_ids = decode_fragment_ids(symbols[present])
    wrong = present[stored_ids != present]
    if wrong.size:
        fid = int(wrong[0])
        raise ValueError(
            f"symbol store slot {fid} holds fragment id {int(decode_fragment_ids(symbols[[fid]])[0])}: "
            "the store is inconsistent with the plan"
        )
    g = plan.geometry
    data = np.where(have[:, None], symbols[:, FRAGMENT_ID_SIZE:], 0).astype(np.uint8)
    rows = np.zeros((g.n_layers, g.n_kv_heads, plan.n_tokens, 2 * g.row_bytes), dtype=np.uint8)
    for block in range(plan.n_blocks):
        frags = plan.block_fragments(block)
        flat = data[frags.start : frags.stop].reshape(-1)[: plan.block_bytes(block)]
        start, end = plan.block_token_range(block)
        rows[plan.block_layer(block), :, start:end, :] = flat.reshape(g.n_kv_heads, end - start, -1)
    return rows, row_availability(plan, have)
