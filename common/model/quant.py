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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pfec.common.model.staging import to_device, to_host
from pfec.common.plan.precision import (
    BASE_OF_LEVEL,
    CODE_BITS,
    QUANTISED_LEVELS,
    REFINE_TO,
    Level,
    PieceBytes,
    PieceKind,
    PieceLayout,
)

NATIVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP16_MAX = 65504.0
Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]
DevicePieces = Mapping[PieceKind, torch.Tensor]  # PieceBytes as uint8 tensors on the dequantising device


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


def _native_layers(layers: Layers, layout: PieceLayout, which: int) -> list[torch.Tensor]:
    """Keys (which=0) or values (1) per layer [H, n_tokens, D] rounded to the native dtype: views when the
    cache already is native, one copy per layer otherwise."""
    native = NATIVE_DTYPES[layout.geometry.dtype]
    return [pair[which][0, :, : layout.n_tokens].to(native) for pair in layers]


# --- Quantise -----------------------------------------------------------------------------------------------


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """fp16 not above x."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, h.new_full((), -torch.inf)), h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """fp16 not below x."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, h.new_full((), torch.inf)), h)


def _group_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 minimum (rounded down) and step (rounded up) so that [min, min + 256 step] covers [lo, hi]
    (float32); checked by ``_check_groups`` once all groups are made."""
    m = _fp16_down(lo)
    return m, _fp16_up((hi - m.float()) / (1 << CODE_BITS))


def _check_groups(lo: torch.Tensor, hi: torch.Tensor, step: torch.Tensor, what: str) -> None:
    # On the extremes: min and max propagate NaN, and lo <= hi, step >= 0 (isfinite over all was 40x slower).
    low, high = torch.amin(lo), torch.amax(hi)
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise ValueError(f"{what} hold NaN or infinite values: refusing to quantise this cache")
    if bool((low < -FP16_MAX) | (high > FP16_MAX)):
        raise ValueError(f"{what} exceed the fp16 range of the scales (|x| > {FP16_MAX:g}): send them native")
    if not bool(torch.isfinite(torch.amax(step))):
        raise ValueError(f"{what} span more than the fp16 range of the scales: send them native")


class _Coder:
    """8-bit codes of groups reduced along ``dim`` of [count, H, n, ...] blocks (the pieces' order), one
    layer at a time, in a reused float32 buffer small enough to stay in the CPU's cache between passes."""

    def __init__(self, block_shape: tuple[int, ...], dim: int, m: torch.Tensor, step: torch.Tensor) -> None:
        """``m``, ``step``: where the groups' fp16 parameters go, [L, *block_shape with dim reduced to 1]."""
        self.dim, self.m, self.step = dim, m, step
        self.buf = _empty(block_shape, torch.float32, m.device)
        self.lo, self.hi = (_empty(m.shape, torch.float32, m.device) for _ in range(2))

    def codes(self, i: int, src: torch.Tensor) -> torch.Tensor:
        """Layer i's codes (float 0..255, in the buffer); its groups' range and parameters are kept."""
        x = self.buf
        x.copy_(src)
        lo, hi = self.lo[i], self.hi[i]
        torch.amin(x, dim=self.dim, keepdim=True, out=lo)
        torch.amax(x, dim=self.dim, keepdim=True, out=hi)
        m, step = _group_params(lo, hi)
        self.m[i], self.step[i] = m, step
        s = step.float()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros((), device=s.device))
        return x.sub_(m.float()).mul_(inv).clamp_(0.0, float((1 << CODE_BITS) - 1))

    def check(self, what: str) -> None:
        _check_groups(self.lo, self.hi, self.step, what)


def _codes_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """uint8 ``dst`` := float codes ``src`` (0..255), truncated: their floor. On the CPU numpy's cast, which
    here ran 5x faster than torch's float -> uint8 copy (the largest single cost of quantising)."""
    if dst.device.type != "cpu":
        dst.copy_(src)
        return
    with np.errstate(invalid="ignore"):  # NaN codes of a cache that is refused after the pass
        np.copyto(dst.numpy(), src.numpy(), casting="unsafe")


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


def _quantise_class(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], layout: PieceLayout,
                    cls: _SizeClass, dest: dict[PieceKind, torch.Tensor]) -> None:
    """Quantised pieces of one size class into ``dest`` views [L, count, size]; keys/values are the native
    per-layer tensors [H, T, D].

    Layer by layer, so the float32 temporaries (about 1 MB a layer) stay in the CPU's cache instead of
    costing a trip through memory per pass. A bad cache is refused after the pass, as a whole-cache pass
    would: the same errors, keys before values.
    """
    g = layout.geometry
    h, n, d, group = g.n_kv_heads, cls.tokens, g.head_dim, layout.value_group
    n_layers, count = g.n_layers, cls.count
    lead = (n_layers, count)
    device = keys[0].device
    kinds = [k for k in dest if k is not PieceKind.NATIVE]
    meta_n = layout.meta_bytes(n)
    pieces = {k: dest[k][..., meta_n:] if k.is_base else dest[k] for k in kinds}
    # The codes go straight into the BASE8 piece when one is made, else into a per-layer scratch.
    base8 = pieces.pop(PieceKind.BASE8, None)
    codes_all = None if base8 is None else base8.unflatten(-1, (2, h, n, d))
    scratch = _empty((count, 2, h, n, d), torch.uint8, device)
    # Piece order of the parameters: K min [H, D], K step [H, D], V min [H, n, D/G], V step [H, n, D/G].
    meta = _empty((*lead, meta_n // 2), torch.float16, device)
    k_m, k_s, v_m, v_s = torch.split(meta, [h * d, h * d, h * n * (d // group), h * n * (d // group)], -1)
    k_coder = _Coder((count, h, n, d), 2,  # groups per channel over the block's tokens
                     *(t.unflatten(-1, (h, 1, d)) for t in (k_m, k_s)))
    v_coder = _Coder((count, h, n, d // group, group), -1,  # groups of channels per token
                     *(t.unflatten(-1, (h, n, d // group, 1)) for t in (v_m, v_s)))
    for i in range(n_layers):
        codes = scratch if codes_all is None else codes_all[i]
        k = keys[i][:, cls.start : cls.stop].unflatten(1, (count, n)).transpose(0, 1)
        v = values[i][:, cls.start : cls.stop].unflatten(1, (count, n)).transpose(0, 1)
        _codes_into(codes[:, 0], k_coder.codes(i, k))
        _codes_into(codes[:, 1], v_coder.codes(i, v.unflatten(-1, (d // group, group))).flatten(-2))
        for kind, out in pieces.items():
            _pack_into(out[i], codes.view(count, -1), kind)
    k_coder.check("keys")
    v_coder.check("values")
    for kind in kinds:
        if kind.is_base:
            dest[kind][..., :meta_n].copy_(meta.view(torch.uint8))


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
    dtype, on any device; the result is host memory, laid out as ``precision.PieceBytes`` (from a GPU
    through its pinned staging buffer, ``staging.to_host``; a stream packs on the device instead,
    ``kvcache.stream_symbols``). NaN/inf in the cache or values beyond fp16 scales are a ValueError (send
    such a cache native).
    """
    return {k: to_host(t) for k, t in quantise_tensors(layers, layout, kinds).items()}


def quantise_tensors(layers: Layers, layout: PieceLayout,
                     kinds: Collection[PieceKind]) -> dict[PieceKind, torch.Tensor]:
    """``quantise``'s pieces as uint8 tensors on the cache's device (nothing leaves it)."""
    _check_layers(layers, layout)
    kinds = [PieceKind(k) for k in dict.fromkeys(kinds)]
    device = layers[0][0].device
    out = {k: _empty((layout.n_blocks, layout.piece_size(k, layout.block_tokens)), torch.uint8, device)
           for k in kinds}
    if layout.tail_tokens:  # the tail block's shorter pieces leave the end of their rows unwritten
        for rows in out.values():
            rows.view(layout.geometry.n_layers, layout.n_token_blocks, -1)[:, -1].zero_()
    quantised = [k for k in kinds if k is not PieceKind.NATIVE]
    keys = _native_layers(layers, layout, 0) if quantised else None
    values = _native_layers(layers, layout, 1) if quantised else None
    for cls in _size_classes(layout):
        dest = {k: _class_rows(out[k], layout, cls, layout.piece_size(k, cls.tokens)) for k in kinds}
        if PieceKind.NATIVE in dest:
            _native_into(dest[PieceKind.NATIVE], layers, layout, cls)
        if keys is not None and values is not None:
            _quantise_class(keys, values, layout, cls, dest)
    return out


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

    def piece(self, pieces: DevicePieces, kind: PieceKind, start: int, stop: int) -> torch.Tensor:
        rows = pieces.get(kind)
        want = (self.layout.n_blocks, self.layout.piece_size(kind, self.layout.block_tokens))
        if rows is None or rows.dtype != torch.uint8 or tuple(rows.shape) != want:
            raise ValueError(f"{kind.name} pieces are needed and missing or malformed")
        if self.pick is None:
            return _class_rows(rows, self.layout, self.cls, stop)[..., start:]
        return rows[torch.from_numpy(self.blocks).to(rows.device), start:stop]

    def write(self, dest: torch.Tensor, x: torch.Tensor, part: slice = slice(None)) -> None:
        """x [*lead, H, n, D] (or the ``part`` of the lead's first dimension) into dest [L, H, T, D] at the
        batch's blocks."""
        view = _token_blocks(dest, self.cls).permute(0, 2, 1, 3, 4)  # [L, count, H, n, D]
        if self.pick is None:
            view[part].copy_(x)
        else:
            view[torch.from_numpy(self.layer[part]), torch.from_numpy(self.tb[part])] = x.to(dest.dtype)

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
    # All finite and steps >= 0, on each row's extremes (min and max propagate NaN; isfinite is slow).
    finite = torch.isfinite(torch.amax(halfs, dim=-1)) & torch.isfinite(torch.amin(halfs, dim=-1))
    ok = finite & (torch.amin(k_s, dim=-1) >= 0) & (torch.amin(v_s, dim=-1) >= 0)
    batch.refuse(~ok, "its base piece carries a NaN, infinite or negative scale")
    lead = batch.lead
    return (k_m.reshape(*lead, h, 1, d), k_s.reshape(*lead, h, 1, d),
            v_m.reshape(*lead, h, n, groups, 1), v_s.reshape(*lead, h, n, groups, 1))


def _dequantise_route(batch: _Batch, pieces: DevicePieces, base: Level, level: Level,
                      keys: torch.Tensor, values: torch.Tensor) -> None:
    """The batch's blocks from their base at ``base`` and refinements up to ``level`` into keys/values."""
    layout, n = batch.layout, batch.cls.tokens
    g = layout.geometry
    h, d, group = g.n_kv_heads, g.head_dim, layout.value_group
    elements = n * layout.elements_per_token
    base_kind = BASE_OF_LEVEL[base]
    meta_n = layout.meta_bytes(n)
    k_m, k_s, v_m, v_s = _params(batch, batch.piece(pieces, base_kind, 0, meta_n))
    codes = batch.piece(pieces, base_kind, meta_n, layout.piece_size(base_kind, n))
    refines = [(REFINE_TO[lvl], batch.piece(pieces, REFINE_TO[lvl], 0, layout.piece_size(REFINE_TO[lvl], n)))
               for lvl in QUANTISED_LEVELS if base < lvl <= level]
    # Middle of the level's bin: m + (q * 2^(8-b) + 2^(7-b)) * s.
    unit = float(1 << (CODE_BITS - level.bits))
    k_bias, k_scale = k_m + k_s * (unit / 2), k_s * unit
    v_bias, v_scale = v_m + v_s * (unit / 2), v_s * unit
    # A layer's worth of blocks at a time, so the float32 temporaries stay in the CPU's cache.
    chunk = 1 if batch.pick is None else batch.cls.count  # layers, or blocks of a gathered batch
    buf = _empty((batch.cls.count * elements,), torch.float32, batch.device)
    for first in range(0, batch.lead[0], chunk):
        part = slice(first, first + chunk)
        q = _unpack(codes[part], base.bits, elements)
        for ref, piece in refines:
            q <<= ref.code_bits
            q |= _unpack(piece[part], ref.code_bits, elements)
        x = buf[: q.numel()].view(*q.shape[:-1], 2, h, n, d)
        x.copy_(q.view(x.shape))
        xk, xv = x.select(-4, 0), x.select(-4, 1).unflatten(-1, (d // group, group))
        torch.addcmul(k_bias[part], xk, k_scale[part], out=xk)
        torch.addcmul(v_bias[part], xv, v_scale[part], out=xv)
        batch.write(keys, xk, part)
        batch.write(values, xv.flatten(-2), part)


def _native_route(batch: _Batch, pieces: DevicePieces, keys: torch.Tensor, values: torch.Tensor) -> None:
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


def dequantise(pieces: PieceBytes | DevicePieces, layout: PieceLayout, levels: npt.ArrayLike,
               bases: npt.ArrayLike, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> DequantisedKV:
    """Tensors of the whole cache from each block's pieces, at the ``levels`` (and ``bases``) given.

    ``levels``/``bases`` [n_blocks] come from ``PiecePlan.usable`` (or ``precision.usable_levels``):
    a block at NONE stays zero and unavailable; at NATIVE its native piece is used; otherwise its base
    piece at ``bases[b]`` and the refinements up to ``levels[b]``. ``dtype``: the receiver's compute dtype.
    ``pieces``: host arrays (each uploaded once, through the pinned buffer on a GPU) or uint8 tensors
    already on ``device`` (``staging.unpack_stream_tensor``).
    """
    g = layout.geometry
    device = torch.device(device)
    pieces = pieces_on(pieces, device)
    lv, bs = checked_levels(layout, levels, bases)
    shape = (g.n_layers, g.n_kv_heads, layout.n_tokens, g.head_dim)
    keys, values = _empty(shape, dtype, device), _empty(shape, dtype, device)
    if (lv == Level.NONE).any():
        keys.zero_()
        values.zero_()
    place(pieces, layout, lv, bs, keys, values, None)
    have = torch.from_numpy(lv.reshape(g.n_layers, layout.n_token_blocks) > Level.NONE).to(device)
    available = have.repeat_interleave(layout.block_tokens, dim=1)[:, None, : layout.n_tokens]
    available = available.expand(g.n_layers, g.n_kv_heads, layout.n_tokens)
    layer_range = range(g.n_layers)
    return DequantisedKV([keys[i, None] for i in layer_range], [values[i, None] for i in layer_range],
                         lv.astype(np.int8), available)


def checked_levels(layout: PieceLayout, levels: npt.ArrayLike,
                   bases: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Block levels and bases as ``dequantise`` takes them, or a ValueError naming what is wrong."""
    lv = np.asarray(levels, dtype=np.int64)
    bs = np.asarray(bases, dtype=np.int64)
    if lv.shape != (layout.n_blocks,) or bs.shape != lv.shape:
        raise ValueError(f"levels and bases must be [{layout.n_blocks}], got {lv.shape} and {bs.shape}")
    if lv.min() < Level.NONE or lv.max() > Level.NATIVE:
        raise ValueError(f"levels must be Level values 0..{int(Level.NATIVE)}")
    quant = (lv > Level.NONE) & (lv < Level.NATIVE)
    if (quant & ((bs < Level.INT2) | (bs > lv))).any():
        raise ValueError("a quantised block needs a base level between int2 and its level")
    return lv, bs


def place(pieces: DevicePieces, layout: PieceLayout, lv: npt.NDArray[np.int64], bs: npt.NDArray[np.int64],
           keys: torch.Tensor, values: torch.Tensor, only: npt.NDArray[np.bool_] | None) -> None:
    """Each block of ``only`` (None: every block) at its level into keys/values [L, H, T, D]; a block of
    ``only`` at NONE is zeroed (``only`` None: the caller zeroed the tensors). ``pieces`` on the tensors'
    device; only the chosen blocks' rows are read (``kvcache.LiveRebuild`` places blocks as they arrive)."""
    device = keys.device
    for cls in _size_classes(layout):
        ids = _class_blocks(layout, cls)
        chosen = np.ones(ids.size, dtype=np.bool_) if only is None else only[ids]
        route_base = np.where(lv[ids] == Level.NATIVE, Level.NONE, bs[ids])
        if only is not None and (none := chosen & (lv[ids] == Level.NONE)).any():
            batch = _Batch(layout, cls, np.flatnonzero(none), device)
            zeros = keys.new_zeros((*batch.lead, layout.geometry.n_kv_heads, cls.tokens, keys.shape[-1]))
            batch.write(keys, zeros)
            batch.write(values, zeros)
        live = chosen & (lv[ids] > Level.NONE)
        routes = np.unique(np.stack([route_base, lv[ids]], axis=1)[live], axis=0)
        for base, level in routes.tolist():
            pick = np.flatnonzero((lv[ids] == level) & (route_base == base) & chosen)
            batch = _Batch(layout, cls, None if pick.size == ids.size else pick, device)
            if level == Level.NATIVE:
                _native_route(batch, pieces, keys, values)
            else:
                _dequantise_route(batch, pieces, Level(base), Level(level), keys, values)


def pieces_on(pieces: PieceBytes | DevicePieces, device: torch.device) -> DevicePieces:
    """Each kind's piece rows on ``device`` (``_on_device``)."""
    return {PieceKind(k): _on_device(v, device) for k, v in pieces.items()}


def _on_device(rows: npt.NDArray[np.uint8] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A kind's piece rows as a uint8 tensor on ``device`` (host arrays: a view on the CPU, one upload
    through the pinned buffer on a GPU); malformed rows are left for ``_Batch.piece`` to refuse."""
    if isinstance(rows, torch.Tensor):
        if rows.device == device or rows.dtype != torch.uint8 or rows.dim() != 2:
            return rows
        return to_device(rows.numpy(), device) if rows.device.type == "cpu" else rows.to(device)
    if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2:
        return torch.empty(0)  # not piece rows: refused where the kind is needed
    return to_device(rows, device)


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
