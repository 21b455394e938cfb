"""Block byte layout, symbols, availability: pure numpy, no model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pfec.common.plan.kvlayout import (
    DEFAULT_GEOMETRY,
    FRAGMENT_ID_SIZE,
    BlockPlan,
    KVGeometry,
    assemble_rows,
    decode_fragment_ids,
    encode_fragment_id,
    fitted_symbol_size,
    fragment_symbols,
    received_mask,
    row_availability,
)
from pfec.common.plan.utility import handoff_utilities, synthetic_profile, utility_order


def _rows(plan: BlockPlan, seed: int = 0) -> np.ndarray:
    g = plan.geometry
    rng = np.random.default_rng(seed)
    shape = (g.n_layers, g.n_kv_heads, plan.n_tokens, 2 * g.row_bytes)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _store(plan: BlockPlan, rows: np.ndarray) -> np.ndarray:
    return fragment_symbols(plan, rows, np.arange(plan.n_fragments))


def test_default_plan_fits_ten_fragments_per_block() -> None:
    size = fitted_symbol_size(DEFAULT_GEOMETRY, 1362)
    plan = BlockPlan(DEFAULT_GEOMETRY, 1500, size)
    assert size == 1234
    assert len(plan.block_fragments(0)) == 10
    assert plan.block_bytes(0) == 16 * 2 * 3 * 128


def test_fragment_id_round_trip() -> None:
    ids = np.array([0, 1, 255, 256, 70000, 2**32 - 1])
    symbols = np.zeros((len(ids), 8), dtype=np.uint8)
    for i, fid in enumerate(ids):
        symbols[i, :FRAGMENT_ID_SIZE] = np.frombuffer(encode_fragment_id(int(fid)), dtype=np.uint8)
    assert decode_fragment_ids(symbols).tolist() == ids.tolist()


def test_full_delivery_restores_every_byte_and_row() -> None:
    plan = BlockPlan(KVGeometry(3, 2, 8, "bf16"), 37, 64 + FRAGMENT_ID_SIZE)
    rows = _rows(plan)
    got, available = assemble_rows(plan, _store(plan, rows), np.ones(plan.n_fragments, dtype=bool))
    assert np.array_equal(got, rows)
    assert available.all()


def test_symbols_in_queue_order_carry_their_own_ids() -> None:
    plan = BlockPlan(KVGeometry(2, 2, 8), 40, 52)
    order = np.random.default_rng(1).permutation(plan.n_blocks)
    queue = plan.fragment_queue(order)
    symbols = fragment_symbols(plan, _rows(plan), queue)
    assert decode_fragment_ids(symbols).tolist() == queue.tolist()
    # Same bytes as the symbol generated in plan order.
    store = _store(plan, _rows(plan))
    assert np.array_equal(symbols, store[queue])


def test_lost_fragment_spoils_exactly_the_rows_it_touches() -> None:
    g = KVGeometry(2, 2, 8, "bf16")  # row = 16 B of K + 16 B of V = 32 B
    plan = BlockPlan(g, 16, 48 + FRAGMENT_ID_SIZE)  # payload 48 B: rows straddle fragments
    rows = _rows(plan)
    have = np.ones(plan.n_fragments, dtype=bool)
    lost = plan.block_fragments(1).start + 1  # layer 1, bytes 48..95 of the block
    have[lost] = False
    got, available = assemble_rows(plan, _store(plan, rows), have)
    # Rows are (head, token) in order, 32 B each; bytes 48..95 touch rows 1 (32..63) and 2 (64..95).
    expect = np.ones((2, 2, 16), dtype=bool)
    expect[1].reshape(-1)[[1, 2]] = False
    assert np.array_equal(available, expect)
    # Bytes of the lost fragment are zero (the paper's zero-fill), every other byte intact.
    flat_got, flat_rows = got[1].reshape(-1), rows[1].reshape(-1)
    assert not flat_got[48:96].any()
    assert np.array_equal(flat_got[:48], flat_rows[:48]) and np.array_equal(flat_got[96:], flat_rows[96:])


@settings(max_examples=60, deadline=None)
@given(
    n_layers=st.integers(1, 3), n_heads=st.integers(1, 3), head_dim=st.sampled_from([4, 8, 16]),
    n_tokens=st.integers(1, 50), payload_elems=st.integers(3, 40), seed=st.integers(0, 2**16),
)
def test_availability_matches_byte_coverage(n_layers: int, n_heads: int, head_dim: int, n_tokens: int,
                                            payload_elems: int, seed: int) -> None:
    """Property: a row is available iff all its bytes came from received fragments (oracle per byte)."""
    plan = BlockPlan(KVGeometry(n_layers, n_heads, head_dim), n_tokens, 2 * payload_elems + FRAGMENT_ID_SIZE)
    have = np.random.default_rng(seed).random(plan.n_fragments) < 0.7
    available = row_availability(plan, have)
    for block in range(plan.n_blocks):
        start, end = plan.block_token_range(block)
        frags = plan.block_fragments(block)
        byte_ok = np.repeat(have[frags.start : frags.stop], plan.fragment_payload)[: plan.block_bytes(block)]
        oracle = byte_ok.reshape(n_heads, end - start, -1).all(axis=-1)
        assert np.array_equal(available[plan.block_layer(block), :, start:end], oracle)


def test_received_ids_outside_the_plan_are_named() -> None:
    plan = BlockPlan(KVGeometry(2, 1, 8), 20, 36)
    with pytest.raises(ValueError, match=rf"fragment id {plan.n_fragments} is not in the plan"):
        received_mask(plan, [0, plan.n_fragments])
    assert received_mask(plan, [0, 2]).tolist()[:3] == [True, False, True]


def test_inconsistent_have_mask_or_store_is_a_clear_error() -> None:
    plan = BlockPlan(KVGeometry(2, 1, 8), 20, 36)
    store = _store(plan, _rows(plan))
    with pytest.raises(ValueError, match=r"have-mask has shape \(3,\)"):
        assemble_rows(plan, store, np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="symbol store has shape"):
        assemble_rows(plan, store[:, :-1], np.ones(plan.n_fragments, dtype=bool))
    swapped = store.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(ValueError, match="slot 0 holds fragment id 1"):
        assemble_rows(plan, swapped, np.ones(plan.n_fragments, dtype=bool))
    with pytest.raises(ValueError, match="KV rows have shape"):
        fragment_symbols(plan, _rows(plan)[:, :, :5], np.arange(3))


def test_request_and_blended_utilities() -> None:
    plan = BlockPlan(KVGeometry(4, 2, 8), 40, 52)  # 3 token blocks per layer
    mass = np.zeros((4, 2, 40))
    mass[:, :, 35] = 1.0  # every layer looks at token 35 (token block 2)
    mass[0, :, 0] = 3.0  # layer 0 looks mostly at token 0
    profile = synthetic_profile(n_layers=4, n_groups=2, n_bins=4)
    request = handoff_utilities(plan, profile, "request", mass)
    assert request.sum() == pytest.approx(1.0)
    # Layers weigh equally: token block 2 takes all of layers 1-3 (0.25 each), 3/4 of layer 0 goes to block 0.
    assert utility_order(request)[:5].tolist() == [5, 8, 11, 0, 2]
    blend = handoff_utilities(plan, profile, "blend", mass, request_weight=0.5)
    assert np.allclose(blend, 0.5 * request + 0.5 * profile.block_utilities(plan))
    assert np.array_equal(handoff_utilities(plan, profile), profile.block_utilities(plan))
    with pytest.raises(ValueError, match="utility mode 'best'"):
        handoff_utilities(plan, profile, "best", mass)
    with pytest.raises(ValueError, match="needs the prefill's attention mass"):
        handoff_utilities(plan, profile, "request")
    with pytest.raises(ValueError, match=r"attention mass has shape \(4, 2, 39\)"):
        handoff_utilities(plan, profile, "request", mass[:, :, :39])
