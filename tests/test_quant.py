"""Quantise -> pieces -> symbols -> dequantise on small random caches: error bounds, progress, refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pfec.common.model import quant
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.plan.precision import (
    QUANTISED_LEVELS,
    Level,
    PieceKind,
    PieceLayout,
    full_plan,
    ladder,
    pack_stream,
    unpack_stream,
    usable_levels,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LADDER = ladder(Level.INT2, Level.NATIVE)


def _cache(g: KVGeometry, tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32,
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys with per-channel offsets (outlier channels, as real keys have), values around zero."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(g.n_layers):
        offset = torch.randn(1, g.n_kv_heads, 1, g.head_dim, generator=gen) * 4
        k = torch.randn(1, g.n_kv_heads, tokens, g.head_dim, generator=gen) + offset
        v = torch.randn(1, g.n_kv_heads, tokens, g.head_dim, generator=gen) * 0.5
        out.append((k.to(dtype), v.to(dtype)))
    return out


def _native(layers: list[tuple[torch.Tensor, torch.Tensor]], g: KVGeometry, n: int) -> torch.Tensor:
    """Reference [L, H, T, 2D] float64: the cache rounded to the geometry's dtype."""
    rows = [torch.cat([k[0, :, :n], v[0, :, :n]], dim=-1) for k, v in layers]
    return torch.stack(rows).to(DTYPES[g.dtype]).double()


def _got(kv: quant.DequantisedKV) -> torch.Tensor:
    rows = [torch.cat([k[0], v[0]], dim=-1) for k, v in zip(kv.keys, kv.values, strict=True)]
    return torch.stack(rows).double()


def _group_bound(ref: torch.Tensor, layout: PieceLayout, level: Level) -> torch.Tensor:
    """Per element: half a bin of ``level`` for the element's group (keys: channel over the block's tokens;
    values: ``value_group`` channels of one token), allowing for the fp16 rounding of minimum and step."""
    d, bt, group = layout.geometry.head_dim, layout.block_tokens, layout.value_group
    bound = torch.empty_like(ref)
    for start in range(0, layout.n_tokens, bt):
        blk = ref[:, :, start : start + bt]
        k, v = blk[..., :d], blk[..., d:].unflatten(-1, (d // group, group))
        k_span = (k.amax(2, keepdim=True) - k.amin(2, keepdim=True)) + k.abs().amax(2, keepdim=True) / 512
        v_span = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) + v.abs().amax(-1, keepdim=True) / 512
        half = 2.0 ** (7 - level.bits) / 256 * 1.01
        bound[:, :, start : start + bt, :d] = (k_span * half).expand_as(k)
        bound[:, :, start : start + bt, d:] = (v_span * half).expand_as(v).flatten(-2)
    return bound + 1e-6 * (ref.abs() + 1)


GEOMETRIES = [
    KVGeometry(2, 3, 64, "bf16"),  # the default model's heads
    KVGeometry(3, 1, 7, "fp16"),  # odd head dim: element counts not a multiple of 4
    KVGeometry(2, 2, 80, "fp32"),  # head dim 80: one value group per token row
    KVGeometry(1, 4, 128, "bf16"),
]


@pytest.mark.parametrize("g", GEOMETRIES, ids=lambda g: f"{g.n_kv_heads}x{g.head_dim}-{g.dtype}")
@pytest.mark.parametrize("tokens", [37, 32, 5])
def test_round_trip_error_is_within_half_a_bin(g: KVGeometry, tokens: int) -> None:
    layout = PieceLayout(g, tokens)
    layers = _cache(g, tokens + 3, seed=tokens)  # the cache may be longer than the handed-off context
    ref = _native(layers, g, tokens)
    for level in QUANTISED_LEVELS:
        kv = quant.roundtrip(layers, layout, level)
        err = (_got(kv) - ref).abs()
        bound = _group_bound(ref, layout, level)
        assert (err <= bound).all(), (level, float((err - bound).max()))
        assert err.max() > 0  # really quantised
    assert torch.equal(_got(quant.roundtrip(layers, layout, Level.NATIVE)), ref)


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16", "fp32"])
def test_dtypes_of_cache_native_and_output(cache_dtype: str, out_dtype: str) -> None:
    g = KVGeometry(2, 2, 16, cache_dtype)
    layers = _cache(g, 19, dtype=DTYPES[cache_dtype])
    layout = PieceLayout(g, 19)
    kv = quant.roundtrip(layers, layout, Level.NATIVE, DTYPES[out_dtype])
    assert kv.keys[0].dtype == DTYPES[out_dtype] and kv.keys[0].shape == (1, 2, 19, 16)
    assert torch.equal(kv.keys[1], layers[1][0].to(DTYPES[out_dtype]))
    int8 = quant.roundtrip(layers, layout, Level.INT8, DTYPES[out_dtype])
    err = (_got(int8) - _native(layers, g, 19)).abs().max()
    assert 0 < err < 0.1


def test_refinements_equal_the_same_level_base_and_error_shrinks() -> None:
    g = KVGeometry(2, 3, 64, "bf16")
    layout = PieceLayout(g, 37)
    layers = _cache(g, 37, seed=5)
    ref = _native(layers, g, 37)
    pieces = quant.quantise(layers, layout, [*LADDER, PieceKind.BASE4, PieceKind.BASE8])
    n = layout.n_blocks
    errors = []
    for level in QUANTISED_LEVELS:
        via_ladder = quant.dequantise(pieces, layout, np.full(n, level), np.full(n, Level.INT2))
        direct = quant.dequantise(pieces, layout, np.full(n, level), np.full(n, level))
        assert torch.equal(_got(via_ladder), _got(direct)), level
        errors.append((_got(via_ladder) - ref).abs())
    errors.append((_got(quant.dequantise(pieces, layout, np.full(n, Level.NATIVE), np.zeros(n))) - ref).abs())
    for coarse, fine in itertools.pairwise(errors):
        assert fine.max() <= coarse.max() and fine.square().mean() < coarse.square().mean()
    assert errors[-1].max() == 0


def test_partial_arrival_through_symbols() -> None:
    """Pieces packed into symbols, some symbols lost: each block at the best level its pieces allow."""
    g = KVGeometry(2, 1, 16, "bf16")
    layout = PieceLayout(g, 165)  # 22 blocks
    layers = _cache(g, 165, seed=2)
    ref = _native(layers, g, 165)
    pieces = quant.quantise(layers, layout, LADDER)
    plan = full_plan(layout, LADDER, 97, block_order=np.random.default_rng(0).permutation(layout.n_blocks))
    symbols = pack_stream(plan, pieces)
    have = np.ones(plan.n_symbols, dtype=bool)
    have[::9] = False  # one symbol in nine lost: short pieces often survive, long ones rarely
    store = np.where(have[:, None], symbols, 0).astype(np.uint8)
    levels, bases = plan.usable(have)
    assert len(set(levels.tolist())) >= 4  # a mix of levels
    kv = quant.dequantise(unpack_stream(plan, store), layout, levels, bases)
    full = quant.dequantise(pieces, layout, levels, bases)
    assert torch.equal(_got(kv), _got(full))
    got = _got(kv)
    for b in range(layout.n_blocks):
        layer, (s, e) = layout.block_layer(b), layout.block_token_range(b)
        block_err = (got[layer, :, s:e] - ref[layer, :, s:e]).abs()
        if levels[b] == Level.NONE:
            assert not kv.available[layer, :, s:e].any() and not got[layer, :, s:e].any()
        else:
            assert kv.available[layer, :, s:e].all()
            bound = _group_bound(ref, layout, Level(levels[b]))[layer, :, s:e]
            assert (block_err <= bound).all() if levels[b] < Level.NATIVE else not block_err.any()


def test_constant_groups_and_exact_values() -> None:
    g = KVGeometry(1, 1, 32, "fp32")
    layers = [(torch.full((1, 1, 16, 32), 3.25), torch.zeros(1, 1, 16, 32))]
    kv = quant.roundtrip(layers, PieceLayout(g, 16), Level.INT2)
    assert (kv.keys[0] - 3.25).abs().max() < 1e-6 and kv.values[0].abs().max() < 1e-6


# --- refusals ---------------------------------------------------------------------------------------------


def _pieces(g: KVGeometry, tokens: int = 20) -> tuple[PieceLayout, dict[PieceKind, np.ndarray], np.ndarray]:
    layout = PieceLayout(g, tokens)
    return layout, quant.quantise(_cache(g, tokens), layout, LADDER), np.full(layout.n_blocks, Level.INT8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_received_nan_inf_or_negative_scale_is_refused(bad: float) -> None:
    g = KVGeometry(2, 1, 16, "bf16")
    layout, pieces, levels = _pieces(g)
    base = pieces[PieceKind.BASE2]
    step_at = 2 * 16  # the first key step: after the 16 fp16 key minima
    base[2, step_at : step_at + 2] = np.frombuffer(np.float16(bad).tobytes(), dtype=np.uint8)
    bases = np.full(layout.n_blocks, Level.INT2)
    with pytest.raises(ValueError, match=r"block 2: .*scale"):
        quant.dequantise(pieces, layout, levels, bases)


def test_received_non_finite_native_piece_is_refused() -> None:
    layout, pieces, _ = _pieces(KVGeometry(2, 1, 16, "fp16"))
    pieces[PieceKind.NATIVE][1, :2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)
    levels = np.full(layout.n_blocks, Level.NATIVE)
    with pytest.raises(ValueError, match=r"block 1: .*native"):
        quant.dequantise(pieces, layout, levels, np.zeros_like(levels))


def test_bad_caches_are_refused() -> None:
    g = KVGeometry(2, 1, 16, "fp32")
    layout = PieceLayout(g, 20)
    layers = _cache(g, 20)
    nan = [(k.clone(), v.clone()) for k, v in layers]
    nan[1][1][0, 0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quant.quantise(nan, layout, [PieceKind.BASE4])
    huge = [(k * 1e5, v) for k, v in layers]
    with pytest.raises(ValueError, match="fp16"):
        quant.quantise(huge, layout, [PieceKind.BASE4])
    with pytest.raises(ValueError, match="layers"):
        quant.quantise(layers[:1], layout, [PieceKind.BASE4])
    with pytest.raises(ValueError, match="shape"):
        quant.quantise([(k[:, :, :10], v) for k, v in layers], layout, [PieceKind.BASE4])
    with pytest.raises(ValueError, match="floating"):
        quant.quantise([(k.to(torch.int32), v) for k, v in layers], layout, [PieceKind.BASE4])


def test_bad_levels_and_missing_pieces_are_refused() -> None:
    layout, pieces, levels = _pieces(KVGeometry(2, 1, 16, "bf16"))
    n = layout.n_blocks
    with pytest.raises(ValueError, match="levels"):
        quant.dequantise(pieces, layout, levels[:-1], levels[:-1])
    with pytest.raises(ValueError, match="Level values"):
        quant.dequantise(pieces, layout, np.full(n, 7), np.full(n, 1))
    with pytest.raises(ValueError, match="base level"):
        quant.dequantise(pieces, layout, np.full(n, Level.INT4), np.full(n, Level.INT8))
    with pytest.raises(ValueError, match="BASE8"):
        quant.dequantise(pieces, layout, levels, np.full(n, Level.INT8))  # no BASE8 was made


def test_levels_from_usable_drive_dequantise() -> None:
    layout, pieces, _ = _pieces(KVGeometry(2, 1, 16, "bf16"))
    have = np.zeros((layout.n_blocks, len(PieceKind)), dtype=bool)
    have[:, PieceKind.BASE2] = True
    have[0, PieceKind.REFINE4] = True
    have[1, PieceKind.NATIVE] = True
    levels, bases = usable_levels(have)
    kv = quant.dequantise(pieces, layout, levels, bases)
    assert kv.levels.tolist()[:3] == [Level.INT4, Level.NATIVE, Level.INT2]
    assert kv.available.all()


def test_tail_rows_hold_only_their_piece_bytes() -> None:
    """The tail block's shorter pieces leave zeros, never stale memory, after their bytes."""
    g = KVGeometry(2, 1, 16, "bf16")
    layout = PieceLayout(g, 21)
    pieces = quant.quantise(_cache(g, 21), layout, LADDER)
    for kind in LADDER:
        sizes = layout.piece_sizes(kind)
        rows = pieces[kind]
        tail = sizes < rows.shape[1]
        assert tail.sum() == g.n_layers
        assert not rows[tail][:, sizes[tail][0] :].any(), kind
