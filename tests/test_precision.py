"""Progressive precision plans (sans-IO): piece sizes, packing into symbols, symbol -> pieces, ordering."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry
from pfec.common.plan.precision import (
    FidelityTable,
    Level,
    PieceKind,
    PieceLayout,
    PiecePlan,
    full_plan,
    ladder,
    pack_stream,
    parse_level,
    unpack_stream,
    usable_levels,
    value_order,
)

LADDER = ladder(Level.INT2, Level.NATIVE)


def _random_pieces(layout: PieceLayout, seed: int = 0) -> dict[PieceKind, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for kind in PieceKind:
        shape = (layout.n_blocks, layout.piece_size(kind, layout.block_tokens))
        rows = rng.integers(0, 256, shape, dtype=np.uint8)
        sizes = layout.piece_sizes(kind)
        rows[np.arange(rows.shape[1])[None, :] >= sizes[:, None]] = 0  # tail rows: only their piece bytes
        out[kind] = rows
    return out


def _shuffled_plan(layout: PieceLayout, symbol_size: int, seed: int = 0) -> PiecePlan:
    """Every block's full ladder, blocks interleaved at random but each ladder in order."""
    rng = np.random.default_rng(seed)
    blocks = np.repeat(np.arange(layout.n_blocks), len(LADDER))
    rng.shuffle(blocks)
    step = np.zeros(layout.n_blocks, dtype=np.int64)
    kinds = []
    for b in blocks:
        kinds.append(int(LADDER[step[b]]))
        step[b] += 1
    return PiecePlan(layout, blocks, np.array(kinds), symbol_size)


# --- sizes -------------------------------------------------------------------------------------------------


def test_default_block_sizes() -> None:
    layout = PieceLayout(DEFAULT_GEOMETRY, 1800)
    full = {k: layout.piece_size(k, 16) for k in PieceKind}
    # 3 heads x 16 tokens x 128 elements; scales: 3 x 64 key channels + 3 x 16 x 2 value groups, fp16 pairs.
    meta = 4 * (3 * 64 + 3 * 16 * 2)
    assert full[PieceKind.NATIVE] == 12_288
    assert full[PieceKind.BASE2] == meta + 6144 // 4
    assert full[PieceKind.BASE4] == meta + 6144 // 2
    assert full[PieceKind.BASE8] == meta + 6144
    assert full[PieceKind.REFINE4] == 6144 // 4 and full[PieceKind.REFINE8] == 6144 // 2


@pytest.mark.parametrize("geometry",
                         [DEFAULT_GEOMETRY, KVGeometry(2, 1, 7, "fp16"), KVGeometry(3, 4, 80, "fp32")])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_refinements_carry_no_scales(geometry: KVGeometry, tokens: int) -> None:
    """Climbing int2 -> int4 -> int8 costs exactly what a block sent at int8 at once costs (even counts)."""
    layout = PieceLayout(geometry, 40)
    elements = tokens * layout.elements_per_token
    two = layout.piece_size(PieceKind.BASE2, tokens) + layout.piece_size(PieceKind.REFINE4, tokens)
    assert layout.piece_size(PieceKind.BASE4, tokens) <= two <= layout.piece_size(PieceKind.BASE4, tokens) + 1
    if elements % 4 == 0:
        total = two + layout.piece_size(PieceKind.REFINE8, tokens)
        assert total == layout.piece_size(PieceKind.BASE8, tokens)
    assert layout.piece_size(PieceKind.NATIVE, tokens) == elements * geometry.dtype_bytes


def test_tail_block_sizes_and_bytes_per_token() -> None:
    layout = PieceLayout(DEFAULT_GEOMETRY, 37)
    sizes = layout.piece_sizes(PieceKind.NATIVE)
    assert sizes.reshape(30, 3)[:, 2].tolist() == [5 * 3 * 128 * 2] * 30
    assert sizes.sum() == layout.native_bytes() == 37 * 23_040
    assert layout.bytes_per_token([PieceKind.NATIVE]) == 23_040


def test_value_group_must_divide_head_dim() -> None:
    assert PieceLayout(KVGeometry(1, 1, 80), 4).value_group == 80
    assert PieceLayout(KVGeometry(1, 1, 128), 4).value_group == 32
    with pytest.raises(ValueError, match="divisor"):
        PieceLayout(KVGeometry(1, 1, 64), 4, value_group=48)


def test_levels_and_ladders() -> None:
    assert parse_level("INT4") is Level.INT4 and parse_level("native") is Level.NATIVE
    for bad in ("int3", "fp8", "", None, 4):
        with pytest.raises(ValueError, match="precision"):
            parse_level(bad)
    assert ladder(Level.INT2, Level.INT8) == (PieceKind.BASE2, PieceKind.REFINE4, PieceKind.REFINE8)
    assert ladder(Level.INT4, Level.NATIVE) == (PieceKind.BASE4, PieceKind.REFINE8, PieceKind.NATIVE)
    assert ladder(Level.NATIVE, Level.NATIVE) == (PieceKind.NATIVE,)
    with pytest.raises(ValueError):
        ladder(Level.INT8, Level.INT4)


# --- plans, symbols, completeness ------------------------------------------------------------------------


def test_pieces_are_back_to_back_and_only_the_last_symbol_is_padded() -> None:
    layout = PieceLayout(KVGeometry(3, 2, 8, "bf16"), 37)
    plan = _shuffled_plan(layout, 100)
    assert plan.offsets[0] == 0
    assert np.array_equal(plan.offsets[1:], plan.offsets[:-1] + plan.sizes[:-1])
    assert plan.total_bytes == int(layout.size_table()[:, [int(k) for k in LADDER]].sum())
    assert plan.n_symbols == -(-plan.total_bytes // 100)
    assert 0 <= plan.padding_bytes < 100


def test_symbol_to_pieces_matches_brute_force() -> None:
    layout = PieceLayout(KVGeometry(2, 1, 8, "fp16"), 21)
    plan = _shuffled_plan(layout, 37, seed=3)
    lo, hi = plan.symbol_piece_spans()
    for s in range(plan.n_symbols):
        start, end = s * 37, (s + 1) * 37
        brute = [i for i in range(plan.n_pieces)
                 if plan.offsets[i] < end and plan.offsets[i] + plan.sizes[i] > start]
        assert list(plan.symbol_pieces(s)) == brute == list(range(lo[s], hi[s]))
    with pytest.raises(ValueError):
        plan.symbol_pieces(plan.n_symbols)


def test_complete_pieces_and_usable_levels() -> None:
    layout = PieceLayout(KVGeometry(2, 1, 8, "fp16"), 21)
    plan = _shuffled_plan(layout, 29, seed=1)
    rng = np.random.default_rng(0)
    have = rng.random(plan.n_symbols) < 0.7
    complete = plan.complete_pieces(have)
    for i in range(plan.n_pieces):
        first, last = plan.offsets[i] // 29, (plan.offsets[i] + plan.sizes[i] - 1) // 29
        assert complete[i] == have[first : last + 1].all()
    levels, bases = plan.usable(have)
    pieces = plan.block_pieces(complete)
    for b in range(layout.n_blocks):
        got = {PieceKind(k) for k in np.flatnonzero(pieces[b])}
        want = Level.NONE
        if PieceKind.BASE2 in got:
            want = Level.INT2
            if PieceKind.REFINE4 in got:
                want = Level.INT4
                if PieceKind.REFINE8 in got:
                    want = Level.INT8
        if PieceKind.NATIVE in got:
            want = Level.NATIVE
        assert levels[b] == want
        assert bases[b] == (Level.INT2 if Level.NONE < want < Level.NATIVE else Level.NONE)
    assert (plan.planned_levels() == Level.NATIVE).all()


def test_usable_levels_routes() -> None:
    have = np.zeros((6, len(PieceKind)), dtype=bool)
    have[0, [PieceKind.REFINE4, PieceKind.REFINE8]] = True  # refinements alone: nothing usable
    have[1, [PieceKind.BASE2, PieceKind.REFINE8]] = True  # a gap: int2 only
    have[2, [PieceKind.BASE4, PieceKind.REFINE8]] = True
    have[3, PieceKind.BASE8] = True
    have[4, [PieceKind.BASE2, PieceKind.NATIVE]] = True
    levels, bases = usable_levels(have)
    assert levels.tolist() == [Level.NONE, Level.INT2, Level.INT8, Level.INT8, Level.NATIVE, Level.NONE]
    assert bases.tolist() == [Level.NONE, Level.INT2, Level.INT4, Level.INT8, Level.NONE, Level.NONE]


def test_bad_plans_are_refused_with_a_reason() -> None:
    layout = PieceLayout(KVGeometry(2, 1, 8), 20)  # 4 blocks
    ok_blocks = np.array([0, 0, 1])
    ok_kinds = np.array([PieceKind.BASE2, PieceKind.REFINE4, PieceKind.NATIVE])
    PiecePlan(layout, ok_blocks, ok_kinds, 64)
    cases = [
        (ok_blocks, np.array([0, 3, 9]), 64, "unknown kind 9"),
        (np.array([0, 0, 4]), ok_kinds, 64, "outside"),
        (np.array([0, 0, 0]), np.array([0, 3, 3]), 64, "twice"),
        (np.array([0, 1]), np.array([PieceKind.BASE2, PieceKind.REFINE8]), 64, "refinement needs"),
        (np.array([0, 0]), np.array([PieceKind.BASE2, PieceKind.BASE8]), 64, "more than one base"),
        (ok_blocks, ok_kinds, 0, "symbol size"),
        (np.array([], dtype=np.int64), np.array([], dtype=np.int64), 64, "at least one"),
        (np.array([0.5]), np.array([0]), 64, "integer"),
    ]
    for blocks, kinds, symbol, reason in cases:
        with pytest.raises(ValueError, match=reason):
            PiecePlan(layout, blocks, kinds, symbol)


def test_declared_sizes_and_offsets_are_checked() -> None:
    layout = PieceLayout(KVGeometry(2, 1, 8), 20)
    plan = full_plan(layout, ladder(Level.INT2, Level.INT8), 50)
    plan.check_declared(plan.sizes, plan.offsets, plan.n_symbols)
    sizes = plan.sizes.copy()
    sizes[3] += 1
    with pytest.raises(ValueError, match="do not add up"):
        plan.check_declared(sizes)
    offsets = plan.offsets.copy()
    offsets[-1] = plan.total_bytes + 5
    with pytest.raises(ValueError, match="outside the stream"):
        plan.check_declared(plan.sizes, offsets)
    with pytest.raises(ValueError, match="symbols"):
        plan.check_declared(plan.sizes, plan.offsets, plan.n_symbols + 1)
    with pytest.raises(ValueError, match="piece sizes"):
        plan.check_declared(plan.sizes[:-1])


# --- packing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,symbol", [(37, 100), (32, 64), (3, 1000), (21, 1)])
def test_pack_unpack_exact(tokens: int, symbol: int) -> None:
    layout = PieceLayout(KVGeometry(3, 2, 8, "bf16"), tokens)
    pieces = _random_pieces(layout)
    plan = _shuffled_plan(layout, symbol, seed=tokens)
    symbols = pack_stream(plan, pieces)
    assert symbols.shape == (plan.n_symbols, symbol)
    want = np.concatenate([pieces[PieceKind(k)][b, :s] for b, k, s in
                           zip(plan.blocks, plan.kinds, plan.sizes, strict=True)])
    stream = symbols.reshape(-1)
    assert np.array_equal(stream[: plan.total_bytes], want)
    assert not stream[plan.total_bytes :].any()
    back = unpack_stream(plan, symbols)
    assert sorted(back) == sorted(LADDER)
    for kind in LADDER:
        assert np.array_equal(back[kind], pieces[kind]), kind


def test_pack_refuses_malformed_piece_bytes() -> None:
    layout = PieceLayout(KVGeometry(2, 1, 8), 20)
    plan = full_plan(layout, [PieceKind.BASE4], 50)
    with pytest.raises(ValueError, match="BASE4"):
        pack_stream(plan, {})
    with pytest.raises(ValueError, match="BASE4"):
        pack_stream(plan, {PieceKind.BASE4: np.zeros((4, 3), dtype=np.uint8)})
    with pytest.raises(ValueError, match="symbol store"):
        unpack_stream(plan, np.zeros((plan.n_symbols + 1, 50), dtype=np.uint8))


# --- fidelity table and value ordering ----------------------------------------------------------------------


def _table(n_layers: int = 4, rows: tuple[tuple[float, ...], ...] = ((0.2, 0.9, 1.0), (0.5, 0.95, 1.0))
           ) -> FidelityTable:
    return FidelityTable(n_layers, ((0, 2), (2, 4)), (Level.INT2, Level.INT4, Level.INT8), rows)


def test_fidelity_table_json_and_refusals() -> None:
    table = _table()
    again = FidelityTable.from_json(table.to_json())
    assert again == table
    layout = PieceLayout(KVGeometry(4, 1, 8), 40)
    fid = table.block_fidelity(layout)
    assert fid.shape == (layout.n_blocks, 5)
    assert fid[0].tolist() == [0.0, 0.2, 0.9, 1.0, 1.0] and fid[-1].tolist() == [0.0, 0.5, 0.95, 1.0, 1.0]
    bad = table.to_json()
    for field, value, reason in [("levels", ["int2", "int4", "int3"], "precision"),
                                 ("fidelity", [[0.2, 0.9, float("nan")], [0.5, 0.9, 1.0]], "finite"),
                                 ("fidelity", [[0.2, 1.5, 1.0], [0.5, 0.9, 1.0]], r"\[0, 1\]"),
                                 ("layer_groups", [[0, 2], [3, 4]], "tile"),
                                 ("scheme", "other/1", "scheme"),
                                 ("format", "x", "format")]:
        with pytest.raises(ValueError, match=reason):
            FidelityTable.from_json({**bad, field: value})
    with pytest.raises(ValueError, match="layers"):
        table.block_fidelity(PieceLayout(KVGeometry(3, 1, 8), 40))


def test_value_order_keeps_ladders_and_prefers_value_per_byte() -> None:
    layout = PieceLayout(KVGeometry(4, 1, 8), 32)  # 8 blocks
    util = np.array([8, 7, 6, 5, 4, 3, 2, 1], dtype=np.float64)
    kinds = ladder(Level.INT2, Level.NATIVE)
    blocks, order_kinds = value_order(layout, util, _table(), kinds)
    plan = PiecePlan(layout, blocks, order_kinds, 64)  # valid: every ladder complete
    assert plan.n_pieces == 8 * len(kinds)
    for b in range(8):
        seen = [PieceKind(k) for k in order_kinds[blocks == b]]
        assert seen == list(kinds)  # ladder order within each block
    # Each block's ladder split into segments of best value per byte (brute force over prefixes): the
    # stream takes segments in non-increasing value per byte.
    fid = _table().block_fidelity(layout)
    levels = [0] + [k.level for k in kinds]
    prio = {}
    for b in range(8):
        gains = [util[b] * (fid[b, levels[i + 1]] - fid[b, levels[i]]) for i in range(len(kinds))]
        sizes = [layout.piece_size(k, 16) for k in kinds]
        start = 0
        while start < len(kinds):
            ends = range(start + 1, len(kinds) + 1)
            ratio = {end: sum(gains[start:end]) / sum(sizes[start:end]) for end in ends}
            end = max(ratio, key=lambda e: (round(ratio[e], 12), e))
            for i in range(start, end):
                prio[(b, kinds[i])] = ratio[end]
            start = end
    seq = [prio[(b, PieceKind(k))] for b, k in zip(blocks, order_kinds, strict=True)]
    assert all(x >= y - 1e-12 for x, y in itertools.pairwise(seq))
    assert (blocks[0], PieceKind(order_kinds[0])) == (0, PieceKind.BASE2)
    assert PieceKind(order_kinds[-1]) is PieceKind.NATIVE  # native adds nothing over int8 here


def test_value_order_merges_a_cheap_useless_base_with_its_refinement() -> None:
    """A base worth nothing followed by a valuable refinement is judged as one segment, not last."""
    layout = PieceLayout(KVGeometry(2, 1, 8), 16)  # 2 blocks
    table = FidelityTable(2, ((0, 1), (1, 2)), (Level.INT2, Level.INT4, Level.INT8),
                          ((0.0, 1.0, 1.0), (0.3, 0.31, 0.32)))
    blocks, kinds = value_order(layout, np.array([1.0, 1.0]), table, ladder(Level.INT2, Level.INT4))
    # Block 0: 0 then 1.0 over base + refinement; block 1: 0.3 then 0.01. Block 0's pair goes first.
    assert list(zip(blocks.tolist(), kinds.tolist(), strict=True))[:2] == [(0, PieceKind.BASE2),
                                                                        (0, PieceKind.REFINE4)]


def test_value_order_refuses_bad_input() -> None:
    layout = PieceLayout(KVGeometry(4, 1, 8), 32)
    with pytest.raises(ValueError, match="ladder"):
        value_order(layout, np.ones(8), _table(), [PieceKind.REFINE4])
    with pytest.raises(ValueError, match="utility"):
        value_order(layout, np.full(8, np.nan), _table(), ladder(Level.INT2, Level.INT8))
    with pytest.raises(ValueError, match="utility"):
        value_order(layout, np.ones(7), _table(), ladder(Level.INT2, Level.INT8))


def test_every_ladder_is_a_valid_plan() -> None:
    layout = PieceLayout(KVGeometry(2, 1, 8), 20)
    for base, top in itertools.combinations_with_replacement(list(Level)[1:], 2):
        plan = full_plan(layout, ladder(base, top), 33)
        assert (plan.planned_levels() == top).all()
