"""Quantise a KV cache into progressive-precision pieces, and dequantise whatever pieces of it arrived.

Why torch here: the sender quantises the whole cache where it was computed (GPU or CPU) and the receiver
dequantises into its compute dtype, so both directions are whole-tensor ops over all blocks at once, never
a Python loop per block: a handful of calls per block size class (full blocks, the last partial block)
and per route (base level -> reached level). The scheme, piece kinds and byte layout are defined in
``common/plan/precision.py``; this module only does the arithmetic.

Every level approximates the cache cast to the geometry's dtype (``native``), the bytes a native handoff
would send, so more pieces never mean a larger error against what the receiver would otherwise have had.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE
from pfec.common.plan.precision import (
    BASE_OF_LEVEL,
    CODE_BITS,
    QUANTISED_LEVELS,
    REFINE_TO,
    Level,
    PieceBytes,
    PieceKind,
    PieceLayout,
    PiecePlan,
    pack_stream,
    unpack_stream,
)

NATIVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP16_MAX = 65504.0
Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]


# --- Shapes and buffers -----------------------------------------------------------------------------------


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor; on the CPU backed by numpy memory, which numpy asks the kernel to back with
    transparent huge pages (torch does not): first touch of a fresh 40 MB buffer cost ~25 ms in 4 KiB pages
    here and ~5-9 ms in huge pages, as much as a whole quantisation pass."""
    if device.type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.empty(n, dtype=np.uint8)).view(dtype).view(tuple(shape))


@dataclass(frozen=True)
class _SizeClass:
    """Token blocks of one length: ``count`` blocks of ``tokens`` tokens from token block ``first_tb``."""

    first_tb: int
    count: int
    tokens: int
    block_tokens: int

    @property
    def start(self) -> int:
        return self.first_tb * self.block_tokens

    @property
    def stop(self) -> int:
        return self.start + self.count * self.tokens


def _size_classes(layout: PieceLayout) -> list[_SizeClass]:
    """Full blocks, then the last partial block (each handled by one batch of whole-tensor ops)."""
    classes = []
    if layout.n_full_token_blocks:
        classes.append(_SizeClass(0, layout.n_full_token_blocks, layout.block_tokens, layout.block_tokens))
    if layout.tail_tokens:
        classes.append(_SizeClass(layout.n_full_token_blocks, 1, layout.tail_tokens, layout.block_tokens))
    return classes


def _class_rows(rows: torch.Tensor, layout: PieceLayout, cls: _SizeClass, size: int) -> torch.Tensor:
    """A piece array [n_blocks, full size] -> the class's pieces as a view [L, count, size]."""
    per_layer = rows.view(layout.geometry.n_layers, layout.n_token_blocks, rows.shape[1])
    return per_layer[:, cls.first_tb : cls.first_tb + cls.count, :size]


def _token_blocks(x: torch.Tensor, cls: _SizeClass) -> torch.Tensor:
    """[L, H, T, C] -> the class's tokens as a view [L, H, count, tokens, C]."""
    return x[:, :, cls.start : cls.stop].unflatten(2, (cls.count, cls.tokens))


def _check_layers(layers: Layers, layout: PieceLayout) -> None:
    g = layout.geometry
    if len(layers) != g.n_layers:
        raise ValueError(f"cache has {len(layers)} layers, the layout {g.n_layers}")
    want = (1, g.n_kv_heads, g.head_dim)
    for i, (k, v) in enumerate(layers):
        for t in (k, v):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want or t.shape[2] < layout.n_tokens:
                raise ValueError(
                    f"layer {i} tensor has shape {tuple(t.shape)}, the layout needs [1, {g.n_kv_heads}, "
                    f">= {layout.n_tokens}, {g.head_dim}]"
                )
            if not t.is_floating_point():
                raise ValueError(f"layer {i} tensor has dtype {t.dtype}, a KV cache is floating point")


def _stacked(layers: Layers, layout: PieceLayout, which: int) -> torch.Tensor:
    """Keys (which=0) or values (1) of all layers as float32 [L, H, T, D], rounded to the native dtype."""
    g = layout.geometry
    native = NATIVE_DTYPES[g.dtype]
    out = _empty((g.n_layers, g.n_kv_heads, layout.n_tokens, g.head_dim), torch.float32, layers[0][0].device)
    for i, pair in enumerate(layers):  # one copy per layer: the cache is a list of layers
        out[i].copy_(pair[which][0, :, : layout.n_tokens].to(native))
    return out


# --- Quantise -----------------------------------------------------------------------------------------------


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """fp16 not above x."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """fp16 not below x."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def _group_params(lo: torch.Tensor, hi: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 minimum (rounded down) and step (rounded up) so that [min, min + 256 step] covers [lo, hi]."""
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise ValueError(f"{what} hold NaN or infinite values: refusing to quantise this cache")
    if bool((lo < -FP16_MAX).any() | (hi > FP16_MAX).any()):
        raise ValueError(f"{what} exceed the fp16 range of the scales (|x| > {FP16_MAX:g}): send them native")
    m = _fp16_down(lo)
    step = _fp16_up((hi - m.float()) / (1 << CODE_BITS))
    if not bool(torch.isfinite(step).all()):
        raise ValueError(f"{what} span more than the fp16 range of the scales: send them native")
    return m, step


def _to_codes_(x: torch.Tensor, dims: tuple[int, ...] | int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn ``x`` in place into its 8-bit codes (still float, 0..255) over groups reduced along ``dims``;
    returns the groups' fp16 (minimum, step), keepdim-shaped."""
    lo, hi = torch.amin(x, dim=dims, keepdim=True), torch.amax(x, dim=dims, keepdim=True)
    m, step = _group_params(lo, hi, what)
    s = step.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros((), device=s.device))
    x.sub_(m.float()).mul_(inv).clamp_(0.0, float((1 << CODE_BITS) - 1))
    return m, step


def _pack_into(out: torch.Tensor, codes: torch.Tensor, kind: PieceKind) -> None:
    """Write ``kind``'s bits of the 8-bit codes [..., E] into ``out`` [..., S], S = ceil(E * bits / 8).

    Planar packing: byte i holds element i in its low bits, element i + S in the next ``bits``, and so
    on, so every step is a whole-tensor op over contiguous runs (packing neighbours into one byte would
    read every other element, which torch does several times slower).
    """
    bits, shift = kind.code_bits, kind.code_shift
    if bits == CODE_BITS:
        out.copy_(codes)
        return
    per, size = 8 // bits, out.shape[-1]
    if size * per > codes.shape[-1]:
        codes = torch.nn.functional.pad(codes, (0, size * per - codes.shape[-1]))
    tmp = _empty(out.shape, torch.uint8, out.device) if per > 1 else out
    for j in range(per):
        dst = out if j == 0 else tmp
        dst.copy_(codes[..., j * size : (j + 1) * size])
        move = shift - bits * j  # the field's bits land at bits * j of the byte
        if move > 0:
            dst >>= move
        elif move < 0:
            dst <<= -move
        dst &= ((1 << bits) - 1) << (bits * j)
        if j:
            out |= tmp


def _meta(parts: Sequence[torch.Tensor], lead: tuple[int, int]) -> torch.Tensor:
    """fp16 group parameters, each [L, count, ...] in piece order, as bytes [L, count, meta bytes]."""
    return torch.cat([p.reshape(*lead, -1) for p in parts], dim=-1).view(torch.uint8)


def _quantise_class(keys: torch.Tensor, values: torch.Tensor, layout: PieceLayout, cls: _SizeClass,
                    dest: dict[PieceKind, torch.Tensor]) -> None:
    """Quantised pieces of one size class into ``dest`` views [L, count, size]; keys/values are float32
    [L, H, T, D] (modified in place: they end as codes)."""
    g = layout.geometry
    h, n, d, group = g.n_kv_heads, cls.tokens, g.head_dim, layout.value_group
    lead = (g.n_layers, cls.count)
    k = _token_blocks(keys, cls)  # [L, H, count, n, D]: groups per channel over the block's tokens
    k_m, k_s = _to_codes_(k, 3, "keys")
    v = _token_blocks(values, cls).unflatten(-1, (d // group, group))  # groups of channels per token
    v_m, v_s = _to_codes_(v, -1, "values")
    codes = _empty((*lead, 2, h, n, d), torch.uint8, keys.device)
    codes[:, :, 0].copy_(k.permute(0, 2, 1, 3, 4))  # float -> uint8 truncates: floor of 0..255
    codes[:, :, 1].copy_(v.flatten(-2).permute(0, 2, 1, 3, 4))
    flat = codes.view(*lead, -1)
    # Piece order of the parameters: K min [H, D], K step [H, D], V min [H, n, D/G], V step [H, n, D/G].
    k_parts = [t.squeeze(3).permute(0, 2, 1, 3) for t in (k_m, k_s)]
    v_parts = [t.squeeze(-1).permute(0, 2, 1, 3, 4) for t in (v_m, v_s)]
    meta = _meta([*k_parts, *v_parts], lead)
    for kind, out in dest.items():
        if kind is PieceKind.NATIVE:
            continue
        if kind.is_base:
            out[..., : meta.shape[-1]].copy_(meta)
            out = out[..., meta.shape[-1] :]
        _pack_into(out, flat, kind)


def _native_into(dest: torch.Tensor, layers: Layers, layout: PieceLayout, cls: _SizeClass) -> None:
    """Native pieces [L, count, bytes] of one size class: kvlayout's block bytes (head, token, K|V)."""
    g = layout.geometry
    native = NATIVE_DTYPES[g.dtype]
    blocks = dest.view(native).view(g.n_layers, cls.count, g.n_kv_heads, cls.tokens, 2 * g.head_dim)
    for i, (k, v) in enumerate(layers):  # one copy per layer
        for part, src in ((blocks[i, ..., : g.head_dim], k), (blocks[i, ..., g.head_dim :], v)):
            tokens = src[0, :, cls.start : cls.stop].unflatten(1, (cls.count, cls.tokens))
            part.copy_(tokens.permute(1, 0, 2, 3))


def quantise(layers: Layers, layout: PieceLayout,
             kinds: Collection[PieceKind]) -> dict[PieceKind, npt.NDArray[np.uint8]]:
    """Bytes of ``kinds`` for every block of the cache: ``{kind: [n_blocks, full-block piece size]}``.

    ``layers`` are the cache's (keys, values) per layer, [1, KV heads, >= n_tokens, head dim], any float
    dtype, on any device; the result is host memory, laid out as ``precision.PieceBytes``.
    NaN/inf in the cache or values beyond fp16 scales are a ValueError (send such a cache native).
    """
    _check_layers(layers, layout)
    kinds = [PieceKind(k) for k in dict.fromkeys(kinds)]
    device = layers[0][0].device
    out = {k: _empty((layout.n_blocks, layout.piece_size(k, layout.block_tokens)), torch.uint8, device)
           for k in kinds}
    if layout.tail_tokens:  # the tail block's shorter pieces leave the end of their rows unwritten
        for rows in out.values():
            rows.view(layout.geometry.n_layers, layout.n_token_blocks, -1)[:, -1].zero_()
    quantised = [k for k in kinds if k is not PieceKind.NATIVE]
    keys = _stacked(layers, layout, 0) if quantised else None
    values = _stacked(layers, layout, 1) if quantised else None
    for cls in _size_classes(layout):
        dest = {k: _class_rows(out[k], layout, cls, layout.piece_size(k, cls.tokens)) for k in kinds}
        if PieceKind.NATIVE in dest:
            _native_into(dest[PieceKind.NATIVE], layers, layout, cls)
        if keys is not None and values is not None:
            _quantise_class(keys, values, layout, cls, dest)
    return {k: t.cpu().numpy() for k, t in out.items()}


# --- Dequantise ---------------------------------------------------------------------------------------------


@dataclass
class DequantisedKV:
    """Keys and values per layer [1, KV heads, n_tokens, head dim] at each block's best arrived level."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    levels: npt.NDArray[np.int8]  # Level per block
    available: torch.Tensor  # bool [layers, KV heads, tokens]: rows of blocks with a usable level


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """[..., S] planar-packed bytes -> [..., n] fields of ``bits`` (the inverse of ``_pack_into``)."""
    if bits == CODE_BITS:
        return packed[..., :n]
    per, size = 8 // bits, packed.shape[-1]
    out = _empty((*packed.shape[:-1], size * per), torch.uint8, packed.device)
    for j in range(per):
        part = out[..., j * size : (j + 1) * size]
        part.copy_(packed)
        if j:
            part >>= bits * j
        part &= (1 << bits) - 1
    return out[..., :n]


class _Batch:
    """The blocks one route dequantises: all of a size class (views, no gather) or a subset (gathered)."""

    def __init__(self, layout: PieceLayout, cls: _SizeClass, pick: npt.NDArray[np.int64] | None,
                 device: torch.device) -> None:
        self.layout, self.cls, self.device = layout, cls, device
        g = layout.geometry
        ids = np.arange(g.n_layers * cls.count)
        self.pick = pick  # indices into the class's [L * count] blocks, None for all
        chosen = ids if pick is None else pick
        self.layer, self.tb = np.divmod(chosen, cls.count)
        self.blocks = self.layer * layout.n_token_blocks + cls.first_tb + self.tb
        self.lead: tuple[int, ...] = (g.n_layers, cls.count) if pick is None else (len(pick),)

    def piece(self, pieces: PieceBytes, kind: PieceKind, start: int, stop: int) -> torch.Tensor:
        rows = pieces.get(kind)
        want = (self.layout.n_blocks, self.layout.piece_size(kind, self.layout.block_tokens))
        if rows is None or rows.dtype != np.uint8 or rows.shape != want:
            raise ValueError(f"{kind.name} pieces are needed and missing or malformed")
        if self.pick is None:
            full = _class_rows(torch.from_numpy(rows), self.layout, self.cls, stop)[..., start:]
            return full.to(self.device)
        return torch.from_numpy(np.ascontiguousarray(rows[self.blocks, start:stop])).to(self.device)

    def write(self, dest: torch.Tensor, x: torch.Tensor) -> None:
        """x [*lead, H, n, D] into dest [L, H, T, D] at the batch's blocks."""
        view = _token_blocks(dest, self.cls).permute(0, 2, 1, 3, 4)  # [L, count, H, n, D]
        if self.pick is None:
            view.copy_(x)
        else:
            view[torch.from_numpy(self.layer), torch.from_numpy(self.tb)] = x.to(dest.dtype)

    def refuse(self, bad: torch.Tensor, what: str) -> None:
        """ValueError naming the first block where ``bad`` [*lead] holds."""
        if bool(bad.any()):
            first = int(torch.nonzero(bad.reshape(-1))[0, 0])
            raise ValueError(f"block {int(self.blocks[first])}: {what}; refusing it")


def _params(batch: _Batch, meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A base piece's (K min, K step, V min, V step) as float32 broadcastable to [*lead, H, n, D(/G, G)]."""
    g, n = batch.layout.geometry, batch.cls.tokens
    h, d, groups = g.n_kv_heads, g.head_dim, g.head_dim // batch.layout.value_group
    halfs = meta.contiguous().view(torch.float16).float()
    k_m, k_s, v_m, v_s = torch.split(halfs, [h * d, h * d, h * n * groups, h * n * groups], dim=-1)
    ok = torch.isfinite(halfs).all(dim=-1) & (k_s >= 0).all(dim=-1) & (v_s >= 0).all(dim=-1)
    batch.refuse(~ok, "its base piece carries a NaN, infinite or negative scale")
    lead = batch.lead
    return (k_m.reshape(*lead, h, 1, d), k_s.reshape(*lead, h, 1, d),
            v_m.reshape(*lead, h, n, groups, 1), v_s.reshape(*lead, h, n, groups, 1))


def _dequantise_route(batch: _Batch, pieces: PieceBytes, base: Level, level: Level,
                      keys: torch.Tensor, values: torch.Tensor) -> None:
    """The batch's blocks from their base at ``base`` and refinements up to ``level`` into keys/values."""
    layout, n = batch.layout, batch.cls.tokens
    g = layout.geometry
    h, d, group = g.n_kv_heads, g.head_dim, layout.value_group
    elements = n * layout.elements_per_token
    base_kind = BASE_OF_LEVEL[base]
    meta_n = layout.meta_bytes(n)
    k_m, k_s, v_m, v_s = _params(batch, batch.piece(pieces, base_kind, 0, meta_n))
    q = _unpack(batch.piece(pieces, base_kind, meta_n, layout.piece_size(base_kind, n)), base.bits, elements)
    for lvl in QUANTISED_LEVELS:
        if base < lvl <= level:
            ref = REFINE_TO[lvl]
            part = batch.piece(pieces, ref, 0, layout.piece_size(ref, n))
            q <<= ref.code_bits
            q |= _unpack(part, ref.code_bits, elements)
    # Middle of the level's bin: m + (q * 2^(8-b) + 2^(7-b)) * s.
    unit = float(1 << (CODE_BITS - level.bits))
    x = _empty((*batch.lead, 2, h, n, d), torch.float32, batch.device)
    x.copy_(q.reshape(x.shape))
    xk, xv = x.select(-4, 0), x.select(-4, 1).unflatten(-1, (d // group, group))
    torch.addcmul(k_m + k_s * (unit / 2), xk, k_s * unit, out=xk)
    torch.addcmul(v_m + v_s * (unit / 2), xv, v_s * unit, out=xv)
    batch.write(keys, xk)
    batch.write(values, xv.flatten(-2))


def _native_route(batch: _Batch, pieces: PieceBytes, keys: torch.Tensor, values: torch.Tensor) -> None:
    layout, n = batch.layout, batch.cls.tokens
    g = layout.geometry
    raw = batch.piece(pieces, PieceKind.NATIVE, 0, layout.piece_size(PieceKind.NATIVE, n))
    x = raw.contiguous().view(NATIVE_DTYPES[g.dtype]).view(*batch.lead, g.n_kv_heads, n, 2 * g.head_dim)
    # max/min propagate NaN and show infinities, without a mask as large as the cache.
    flat = x.flatten(-3)
    finite = torch.isfinite(torch.amax(flat, dim=-1)) & torch.isfinite(torch.amin(flat, dim=-1))
    batch.refuse(~finite, "its native piece holds NaN or infinite values")
    batch.write(keys, x[..., : g.head_dim])
    batch.write(values, x[..., g.head_dim :])


def dequantise(pieces: PieceBytes, layout: PieceLayout, levels: npt.ArrayLike, bases: npt.ArrayLike,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> DequantisedKV:
    """Tensors of the whole cache from each block's pieces, at the ``levels`` (and ``bases``) given.

    ``levels``/``bases`` [n_blocks] come from ``PiecePlan.usable`` (or ``precision.usable_levels``):
    a block at NONE stays zero and unavailable; at NATIVE its native piece is used; otherwise its base
    piece at ``bases[b]`` and the refinements up to ``levels[b]``. ``dtype``: the receiver's compute dtype.
    """
    g = layout.geometry
    device = torch.device(device)
    lv = np.asarray(levels, dtype=np.int64)
    bs = np.asarray(bases, dtype=np.int64)
    if lv.shape != (layout.n_blocks,) or bs.shape != lv.shape:
        raise ValueError(f"levels and bases must be [{layout.n_blocks}], got {lv.shape} and {bs.shape}")
    if lv.min() < Level.NONE or lv.max() > Level.NATIVE:
        raise ValueError(f"levels must be Level values 0..{int(Level.NATIVE)}")
    quant = (lv > Level.NONE) & (lv < Level.NATIVE)
    if (quant & ((bs < Level.INT2) | (bs > lv))).any():
        raise ValueError("a quantised block needs a base level between int2 and its level")
    shape = (g.n_layers, g.n_kv_heads, layout.n_tokens, g.head_dim)
    keys, values = _empty(shape, dtype, device), _empty(shape, dtype, device)
    if (lv == Level.NONE).any():
        keys.zero_()
        values.zero_()
    for cls in _size_classes(layout):
        ids = _class_blocks(layout, cls)
        route_base = np.where(lv[ids] == Level.NATIVE, Level.NONE, bs[ids])
        routes = np.unique(np.stack([route_base, lv[ids]], axis=1)[lv[ids] > Level.NONE], axis=0)
        for base, level in routes.tolist():
            pick = np.flatnonzero((lv[ids] == level) & (route_base == base))
            batch = _Batch(layout, cls, None if pick.size == ids.size else pick, device)
            if level == Level.NATIVE:
                _native_route(batch, pieces, keys, values)
            else:
                _dequantise_route(batch, pieces, Level(base), Level(level), keys, values)
    have = torch.from_numpy(lv.reshape(g.n_layers, layout.n_token_blocks) > Level.NONE).to(device)
    available = have.repeat_interleave(layout.block_tokens, dim=1)[:, None, : layout.n_tokens]
    available = available.expand(g.n_layers, g.n_kv_heads, layout.n_tokens)
    layer_range = range(g.n_layers)
    return DequantisedKV([keys[i, None] for i in layer_range], [values[i, None] for i in layer_range],
                         lv.astype(np.int8), available)


def _class_blocks(layout: PieceLayout, cls: _SizeClass) -> npt.NDArray[np.int64]:
    """Block ids of a size class, layer-major: [n_layers * count]."""
    layers = np.arange(layout.geometry.n_layers, dtype=np.int64)[:, None] * layout.n_token_blocks
    return (layers + cls.first_tb + np.arange(cls.count, dtype=np.int64)[None, :]).reshape(-1)


def roundtrip(layers: Layers, layout: PieceLayout, level: Level, dtype: torch.dtype = torch.float32,
              ) -> DequantisedKV:
    """The cache as the receiver would rebuild it with every block at ``level`` (profiling and tests)."""
    level = Level(level)
    if level is Level.NONE:
        raise ValueError("roundtrip needs a level above none")
    kind = PieceKind.NATIVE if level is Level.NATIVE else BASE_OF_LEVEL[level]
    pieces = quantise(layers, layout, [kind])
    levels = np.full(layout.n_blocks, level, dtype=np.int8)
    bases = np.full(layout.n_blocks, 0 if level is Level.NATIVE else level, dtype=np.int8)
    return dequantise(pieces, layout, levels, bases, dtype, layers[0][0].device)


# --- A handoff's stream -------------------------------------------------------------------------------------


def stream_symbols(layers: Layers, plan: PiecePlan) -> npt.NDArray[np.uint8]:
    """The plan's symbols with their 4-byte stream index in front: [n_symbols, 4 + plan.symbol_size].

    Row i is stream symbol i (send order = stream order); the index is big-endian, as a native handoff's
    fragment id, so the receiver files a symbol whatever order it decoded it in.
    """
    kinds = [PieceKind(k) for k in np.unique(plan.kinds).tolist()]
    stream = pack_stream(plan, quantise(layers, plan.layout, kinds))
    out = np.empty((plan.n_symbols, FRAGMENT_ID_SIZE + plan.symbol_size), dtype=np.uint8)
    out[:, :FRAGMENT_ID_SIZE] = np.arange(plan.n_symbols, dtype=">u4").view(np.uint8).reshape(-1, 4)
    out[:, FRAGMENT_ID_SIZE:] = stream
    return out


def dequantise_stream(plan: PiecePlan, store: npt.NDArray[np.uint8], levels: npt.ArrayLike,
                      bases: npt.ArrayLike, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DequantisedKV:
    """The cache from a stream's symbol store [n_symbols, plan.symbol_size] at the given block levels
    (``PiecePlan.usable``: only complete pieces are read)."""
    return dequantise(unpack_stream(plan, store), plan.layout, levels, bases, dtype, device)
