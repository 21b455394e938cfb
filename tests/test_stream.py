"""The progressive-precision stream of a handoff (common/plan/stream.py) and its ends: mixes -> piece plans
both nodes recompute, the OFFER's precision part and its bounds, the refusals, the score of what arrived,
the torch side (quantise into stream symbols, file them back, dequantise), the planner's mix and the
sender's bytes by level."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import torch

from pfec.common.model import kvcache, quant
from pfec.common.plan.breakeven import LOCAL_MARGIN
from pfec.common.plan.handoff import OfferApp, ResultApp, SplitOffer, synthetic_identity
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry
from pfec.common.plan.mode_choice import AUTO_MODES_UNSTATED, aligned_meeting_token, choose_mix, choose_mode
from pfec.common.plan.precision import (
    SCHEME,
    Level,
    PieceKind,
    PieceLayout,
    ladder,
    value_order,
)
from pfec.common.plan.stream import (
    PrecisionOffer,
    check_offer,
    default_fidelity,
    fidelity_named,
    file_by_stream_index,
    plan_digest,
    score_stream,
    shipped_fidelity,
    stream_plan,
    symbol_token_ends,
)
from pfec.common.plan.utility import synthetic_profile
from pfec.sender.handoffs import sent_bytes_by_level
from pfec.sender.kv import PrecisionRequest, prepare_synthetic

GEOM = KVGeometry(n_layers=3, n_kv_heads=2, head_dim=32, dtype="bf16")
PAYLOAD = 500


def _layout(n_tokens: int = 70) -> PieceLayout:
    return PieceLayout(GEOM, n_tokens)


def _utility(layout: PieceLayout, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).random(layout.n_blocks)
    return u / u.sum()


def _offer_json(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"scheme": SCHEME, "mix": "int8", "block_tokens": 16, "value_group": 32,
                            "fidelity": "default", "plan": "0123456789abcdef"}
    data.update(over)
    return data


# --- value order with per-block tops ---------------------------------------------------------------------


def test_value_order_cut_at_each_blocks_top_keeps_the_order_of_the_pieces_kept() -> None:
    layout = _layout()
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    kinds = ladder(Level.INT2, Level.INT8)
    full_b, full_k = value_order(layout, util, table, kinds)
    tops = np.where(np.arange(layout.n_blocks) % 2 == 0, Level.INT8, Level.INT4)
    cut_b, cut_k = value_order(layout, util, table, kinds, tops)
    dropped = (full_k == PieceKind.REFINE8) & (tops[full_b] == Level.INT4)
    assert np.array_equal(cut_b, full_b[~dropped]) and np.array_equal(cut_k, full_k[~dropped])
    assert not ((cut_k == PieceKind.REFINE8) & (tops[cut_b] == Level.INT4)).any()
    with pytest.raises(ValueError, match="block tops"):
        value_order(layout, util, table, kinds, np.full(layout.n_blocks, Level.NATIVE))


# --- mixes, plans, digests ------------------------------------------------------------------------------


def test_mixes_reach_their_levels_and_int8_int4_gives_int8_to_the_top_half() -> None:
    layout = _layout()
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    for mix, level in (("int8", Level.INT8), ("int4", Level.INT4), ("int2", Level.INT2)):
        plan = stream_plan(layout, mix, util, table, PAYLOAD)
        assert (plan.planned_levels() == level).all(), mix
    mixed = stream_plan(layout, "int8-int4", util, table, PAYLOAD).planned_levels()
    top_half = np.argsort(-util, kind="stable")[: -(-layout.n_blocks // 2)]
    assert (mixed[top_half] == Level.INT8).all() and int((mixed == Level.INT8).sum()) == len(top_half)
    assert ((mixed == Level.INT8) | (mixed == Level.INT4)).all()
    fifo = stream_plan(layout, "int8", util, table, PAYLOAD, "fifo")
    assert np.array_equal(fifo.blocks[::3], np.arange(layout.n_blocks))
    with pytest.raises(ValueError, match="native mix"):
        stream_plan(layout, "native", util, table, PAYLOAD)
    with pytest.raises(ValueError, match="not one of"):
        stream_plan(layout, "int3", util, table, PAYLOAD)


def test_the_plan_is_recomputed_identically_and_its_digest_changes_with_any_input() -> None:
    layout = _layout()
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    plan = stream_plan(layout, "int8", util, table, PAYLOAD)
    digest = plan_digest(plan, "int8", "default")
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert plan_digest(stream_plan(layout, "int8", util.copy(), table, PAYLOAD), "int8", "default") == digest
    others = [
        plan_digest(stream_plan(layout, "int8", _utility(layout, 1), table, PAYLOAD), "int8", "default"),
        plan_digest(stream_plan(layout, "int4", util, table, PAYLOAD), "int4", "default"),
        plan_digest(stream_plan(layout, "int8", util, table, PAYLOAD + 2), "int8", "default"),
        plan_digest(plan, "int8", "shipped"),
    ]
    # int2 plans are all BASE2 pieces: only the block order tells two profiles apart.
    int2 = [plan_digest(stream_plan(layout, "int2", _utility(layout, seed), table, PAYLOAD), "int2",
                        "default") for seed in (0, 1)]
    assert int2[0] != int2[1]
    assert digest not in others and len(set(others)) == len(others)


def test_check_offer_recomputes_the_plan_or_refuses_with_the_reason() -> None:
    layout = _layout()
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    plan = stream_plan(layout, "int8-int4", util, table, PAYLOAD)
    offer = PrecisionOffer(SCHEME, "int8-int4", 16, layout.value_group, "default",
                           plan_digest(plan, "int8-int4", "default"))
    got = check_offer(offer, layout, util, table, PAYLOAD, plan.n_symbols, "utility", SCHEME)
    assert np.array_equal(got.blocks, plan.blocks) and np.array_equal(got.kinds, plan.kinds)
    cases = [
        ((offer, layout, util, table, PAYLOAD, plan.n_symbols, "utility", None), "quantises with None"),
        ((offer, layout, util, table, PAYLOAD, plan.n_symbols, "utility", "other/1"), "quantises with"),
        ((offer, PieceLayout(GEOM, 70, block_tokens=8), util[:0].tolist() or _utility(
            PieceLayout(GEOM, 70, block_tokens=8)), table, PAYLOAD, plan.n_symbols, "utility", SCHEME),
         "blocks of 16 tokens"),
        ((offer, layout, _utility(layout, 5), table, PAYLOAD, plan.n_symbols, "utility", SCHEME),
         "does not match the plan recomputed here"),
        ((offer, layout, util, table, PAYLOAD, plan.n_symbols, "fifo", SCHEME), "does not match"),
        ((offer, layout, util, table, PAYLOAD, plan.n_symbols + 1, "utility", SCHEME), "the sender offers"),
    ]
    for args, reason in cases:
        with pytest.raises(ValueError, match=reason):
            check_offer(*args)  # type: ignore[arg-type]


def test_a_split_plan_is_the_back_of_every_layer_in_the_same_order_and_names_each_symbols_stake() -> None:
    """Split (issue 13 item 1): the back's token blocks [2, 5) in all 3 layers, nothing of the front, in the
    whole plan's order; each symbol's token end is that of the last token block it carries; the receiver
    recomputes the same plan only with the same first block."""
    layout = _layout()  # 70 tokens: 5 token blocks x 3 layers
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    whole = stream_plan(layout, "int8-int4", util, table, PAYLOAD)
    back = stream_plan(layout, "int8-int4", util, table, PAYLOAD, first_block=2)
    token_block = back.blocks % layout.n_token_blocks
    assert (token_block >= 2).all()
    assert set(back.blocks.tolist()) == {b for b in range(layout.n_blocks) if b % layout.n_token_blocks >= 2}
    keep = whole.blocks % layout.n_token_blocks >= 2
    assert np.array_equal(back.blocks, whole.blocks[keep]) and np.array_equal(back.kinds, whole.kinds[keep])
    ends = symbol_token_ends(back)
    for sym in range(back.n_symbols):
        want = max(min((int(back.blocks[p]) % layout.n_token_blocks + 1) * 16, 70)
                   for p in back.symbol_pieces(sym))
        assert ends[sym] == want
    assert set(ends.tolist()) <= {48, 64, 70} and 70 in ends.tolist()
    digest = plan_digest(back, "int8-int4", "default")
    assert digest != plan_digest(whole, "int8-int4", "default")
    offer = PrecisionOffer(SCHEME, "int8-int4", 16, layout.value_group, "default", digest)
    got = check_offer(offer, layout, util, table, PAYLOAD, back.n_symbols, "utility", SCHEME, 2)
    assert np.array_equal(got.blocks, back.blocks)
    with pytest.raises(ValueError, match="does not match"):
        check_offer(offer, layout, util, table, PAYLOAD, back.n_symbols, "utility", SCHEME, 1)
    with pytest.raises(ValueError, match="first token block"):
        stream_plan(layout, "int8", util, table, PAYLOAD, first_block=5)


def test_a_split_stream_with_the_front_after_carries_the_back_first_then_the_front_backwards() -> None:
    """``front_after``: the back's plan unchanged at the head, then every front block, nearest the meeting
    point first (what a slow receiver prefill reaches last); only that rule recomputes the same plan."""
    layout = _layout()  # 70 tokens: 5 token blocks x 3 layers
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    back = stream_plan(layout, "int8-int4", util, table, PAYLOAD, first_block=3)
    both = stream_plan(layout, "int8-int4", util, table, PAYLOAD, first_block=3, front_after=True)
    n_back = len(back.blocks)
    assert np.array_equal(both.blocks[:n_back], back.blocks)
    assert np.array_equal(both.kinds[:n_back], back.kinds)
    assert set(both.blocks.tolist()) == set(range(layout.n_blocks))
    front_blocks = both.blocks[n_back:] % layout.n_token_blocks
    assert (front_blocks < 3).all() and (np.diff(front_blocks) <= 0).all() and front_blocks[0] == 2
    ends = symbol_token_ends(both)
    assert ends[-1] == 16 and (np.diff(ends[back.n_symbols + 1:]) <= 0).all()
    digest = plan_digest(both, "int8-int4", "default")
    offer = PrecisionOffer(SCHEME, "int8-int4", 16, layout.value_group, "default", digest)
    got = check_offer(offer, layout, util, table, PAYLOAD, both.n_symbols, "utility", SCHEME, 3,
                      front_after=True)
    assert np.array_equal(got.blocks, both.blocks)
    with pytest.raises(ValueError, match=r"does not match|symbols here"):
        check_offer(offer, layout, util, table, PAYLOAD, both.n_symbols, "utility", SCHEME, 3)


def test_the_offer_split_part_is_typed_and_bounded() -> None:
    offer = PrecisionOffer.from_json(_offer_json())
    split = SplitOffer(32, tuple(range(40)))
    app = OfferApp(40, (1, 2), precision=offer, split=split)
    assert OfferApp.decode(app.encode()) == app
    local = OfferApp(40, (1,), split=SplitOffer(40, tuple(range(40))))
    assert OfferApp.decode(local.encode()) == local
    base = json.loads(app.encode())
    cases = [
        ({"m": 33, "ids": list(range(40))}, "multiple of 16"),
        ({"m": 48, "ids": list(range(40))}, "multiple of 16"),
        ({"m": -16, "ids": list(range(40))}, "multiple of 16"),
        ({"m": True, "ids": list(range(40))}, "multiple of 16"),
        ({"m": 32, "ids": list(range(39))}, "40 token ids"),
        ({"m": 32, "ids": list(range(41))}, "40 token ids"),
        ({"m": 32, "ids": [*range(39), -1]}, "token ids in"),
        ({"m": 32, "ids": [*range(39), 2**40]}, "token ids in"),
        ({"m": 32, "ids": [*range(39), 1.0]}, "token ids in"),
        ({"m": 32}, "m and ids"),
        ({"m": 32, "ids": [], "x": 1}, "m and ids"),
        ({"m": 40, "ids": list(range(40))}, "local prefill"),  # local with a precision part
    ]
    for split_json, reason in cases:
        with pytest.raises(ValueError, match=reason):
            OfferApp.decode(json.dumps({**base, "split": split_json}).encode())
    no_precision = {k: v for k, v in base.items() if k != "precision"}  # a native split: fragments
    native = OfferApp.decode(json.dumps(no_precision).encode())
    assert native.precision is None and native.split is not None and native.split.meeting_token < 40


def test_result_split_fields_are_checked() -> None:
    base = ResultApp(1.0, 1, 1, 1, 1, "", None, None, 0.0, None, "mask", handoff_mode="split",
                     computed_tokens=512, blocks_computed=32, blocks_received=80, front_s=2.5)
    assert ResultApp.decode(base.encode()) == base
    for field, value in (("handoff_mode", "both"), ("computed_tokens", -1), ("blocks_computed", 2**40),
                         ("blocks_received", "3"), ("front_s", -1.0), ("front_s", 1e9), ("front_s", "2"),
                         ("front_s", float("nan"))):
        data = json.loads(base.encode())
        data[field] = value
        with pytest.raises(ValueError, match=field):
            ResultApp.decode(json.dumps(data).encode())


def test_the_planner_picks_the_mode_and_a_block_aligned_meeting_point() -> None:
    # No split before the receiver stated its speed (AUTO_MODES_UNSTATED); fidelity first: the most faithful
    # whole-cache level that beats local prefill by the margin (native does not: 42 MB at 100 Mbit/s), the
    # floor int8.
    held = choose_mode("auto", "auto", 1800, DEFAULT_GEOMETRY, 100e6, 0.02, auto_modes=AUTO_MODES_UNSTATED)
    assert held.mode == "handoff" and held.mix == "int8" and held.view["choice"] == "handoff:int8", held
    # On a slow link no whole-cache stream beats local prefill by the margin.
    slow = choose_mode("auto", "auto", 512, DEFAULT_GEOMETRY, 20e6, 0.02, auto_modes=AUTO_MODES_UNSTATED)
    assert slow.view["choice"] == "local" and slow.mode == "local" and slow.mix is None, slow
    assert slow.meeting_token == 512 and slow.view["predicted_ttft_s"] == slow.view["local_ttft_s"]
    # With the split allowed and no deadline: its most faithful level, native, which auto streams as int8
    # (the front shares the receiver's CPU with the stream: a native back missed the demo's deadline).
    auto = choose_mode("auto", "auto", 1800, DEFAULT_GEOMETRY, 100e6, 0.02)  # AUTO_MODES: split allowed
    assert auto.mode == "split" and auto.mix == "int8" and auto.view["choice"] == "split:native"
    assert auto.view["used"] == "split:int8"
    assert auto.meeting_token is not None and auto.meeting_token % 16 == 0 and 0 < auto.meeting_token < 1800
    assert auto.view["predicted_ttft_s"] < (1 - LOCAL_MARGIN) * auto.view["local_ttft_s"]
    whole = choose_mode("handoff", "auto", 1800, DEFAULT_GEOMETRY, 100e6, 0.02)
    assert whole.mode == "handoff" and whole.meeting_token is None
    assert whole.view["used"].startswith("handoff:")
    local = choose_mode("local", "auto", 1800, DEFAULT_GEOMETRY, 100e6, 0.02)
    assert local.mode == "local" and local.mix is None and local.meeting_token == 1800
    assert choose_mode("auto", "auto", 1800, DEFAULT_GEOMETRY, 100e6, 0.02, auto_modes=("handoff",)).mode == \
        "handoff"
    assert choose_mode("split", "int4", 1800, DEFAULT_GEOMETRY, 100e6, 0.02).mix == "int4"
    assert choose_mode("split", "native", 1800, DEFAULT_GEOMETRY, 100e6, 0.02).mix == "native"
    with pytest.raises(ValueError, match="mode 'both'"):
        choose_mode("both", "auto", 1800, DEFAULT_GEOMETRY, 100e6, 0.02)
    assert aligned_meeting_token(700.5, 1800, 16) == 688 and aligned_meeting_token(5000, 1800, 16) == 1792


# --- the OFFER's precision part ---------------------------------------------------------------------------


@pytest.mark.parametrize(("over", "reason"), [
    ({"mix": "native"}, "mix"), ({"mix": "int16"}, "mix"), ({"mix": 8}, "mix"),
    ({"scheme": ""}, "scheme"), ({"scheme": "x" * 65}, "scheme"), ({"scheme": 1}, "scheme"),
    ({"block_tokens": True}, "block_tokens"), ({"block_tokens": 0}, "block_tokens"),
    ({"value_group": 1 << 17}, "value_group"), ({"value_group": 2.0}, "value_group"),
    ({"fidelity": "mine"}, "fidelity"), ({"plan": "0123"}, "plan"), ({"plan": "0123456789ABCDEF"}, "plan"),
    ({"extra": 1}, "unknown field"),
])
def test_the_offer_precision_part_is_typed_and_bounded(over: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        PrecisionOffer.from_json(_offer_json(**over))
    blob = json.dumps({"v": 1, "n_tokens": 10, "question_ids": [], "mode": "mask",
                       "precision": _offer_json(**over)}).encode()
    with pytest.raises(ValueError, match="OFFER precision"):
        OfferApp.decode(blob)


def test_a_native_offer_blob_is_byte_for_byte_as_before_and_a_quantised_one_round_trips() -> None:
    app = OfferApp(5, (1, 2), profile="shipped", model_id="m")
    assert app.encode() == (b'{"n_tokens":5,"question_ids":[1,2],"mode":"mask","profile":"shipped",'
                            b'"order":"utility","max_new_tokens":24,"model_id":"m","generate":true,"v":1}')
    offer = PrecisionOffer.from_json(_offer_json())
    quantised = OfferApp(5, (1, 2), precision=offer)
    assert OfferApp.decode(quantised.encode()) == quantised
    assert OfferApp.decode(app.encode()) == app


def test_the_fingerprint_names_the_quantisation_scheme() -> None:
    import dataclasses

    ident = synthetic_identity(GEOM)
    assert ident.quant_scheme == SCHEME
    assert dataclasses.replace(ident, quant_scheme=None).fingerprint() != ident.fingerprint()
    assert dataclasses.replace(ident, quant_scheme="other/2").fingerprint() != ident.fingerprint()


def test_result_precision_fields_are_checked() -> None:
    base = ResultApp(1.0, 1, 1, 1, 1, "", None, None, 0.0, None, "mask", start="ready", precision="int8",
                     precision_utility=0.9, levels={"int8": 1})
    assert ResultApp.decode(base.encode()) == base
    # Every start a receiver reports is taken: the sender's DONE started it too (its RESULT was refused,
    # failing the handoff, until pfec bench breakeven met one).
    for start in ("ready", "sender-done", "deadline"):
        data = json.loads(base.encode())
        data["start"] = start
        assert ResultApp.decode(json.dumps(data).encode()).start == start
    for field, value, reason in (("start", "soon", "start"), ("levels", {"int8": "1"}, "levels"),
                                 ("levels", {f"l{i}": 1 for i in range(9)}, "levels"),
                                 ("precision_utility", "x", "precision_utility")):
        data = json.loads(base.encode())
        data[field] = value
        with pytest.raises(ValueError, match=reason):
            ResultApp.decode(json.dumps(data).encode())


# --- fidelity tables ----------------------------------------------------------------------------------------


def test_the_shipped_fidelity_table_is_the_default_models_and_only_its() -> None:
    table = shipped_fidelity(30, "8fc8cf26a02053d7")
    assert table is not None and table.scheme == SCHEME and table.source.get("prompts") == 4
    values = table.level_values()
    assert (values[:, Level.INT2] <= values[:, Level.INT4]).all()
    assert (values[:, Level.INT4] <= values[:, Level.INT8]).all()
    assert shipped_fidelity(30, "0000000000000000") is None
    assert shipped_fidelity(12, None) is None
    with pytest.raises(ValueError, match="no measured table"):
        fidelity_named("shipped", 12, None)
    with pytest.raises(ValueError, match="unknown"):
        fidelity_named("mine", 30, None)


# --- what arrived -------------------------------------------------------------------------------------------


def test_score_credits_each_block_at_the_level_its_pieces_reach() -> None:
    layout = _layout()
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    plan = stream_plan(layout, "int8", util, table, PAYLOAD)
    everything = score_stream(plan, np.ones(plan.n_symbols, dtype=bool), util, table)
    assert (everything.levels == Level.INT8).all()
    assert everything.block_utility == pytest.approx(1.0)
    assert everything.precision_utility == pytest.approx(1.0)  # the default table's int8 is 1.0
    half = np.zeros(plan.n_symbols, dtype=bool)
    half[: plan.n_symbols // 2] = True
    part = score_stream(plan, half, util, table)
    fid = table.block_fidelity(layout)
    expect = float((util * fid[np.arange(layout.n_blocks), part.levels]).sum())
    assert part.precision_utility == pytest.approx(expect)
    assert 0 < part.precision_utility < part.block_utility <= 1.0
    assert part.level_counts()["int2"] > 0 and sum(part.level_counts().values()) == layout.n_blocks
    nothing = score_stream(plan, np.zeros(plan.n_symbols, dtype=bool), util, table)
    assert nothing.block_utility == nothing.precision_utility == 0.0


def test_stream_symbols_file_back_by_index_and_dequantise_at_the_level_that_arrived() -> None:
    """Quantise a cache into stream symbols, deliver them shuffled, drop the REFINE8 pieces of some blocks:
    those blocks rebuild exactly as an int4 round trip, the rest exactly as int8."""
    layout = _layout()
    util = _utility(layout)
    table = default_fidelity(GEOM.n_layers)
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 70, 32, generator=gen), torch.randn(1, 2, 70, 32, generator=gen))
              for _ in range(GEOM.n_layers)]
    plan = stream_plan(layout, "int8", util, table, PAYLOAD)
    symbols = kvcache.stream_symbols(layers, plan)
    assert symbols.shape == (plan.n_symbols, 4 + PAYLOAD)
    order = np.random.default_rng(1).permutation(plan.n_symbols)
    lost = np.zeros(plan.n_symbols, dtype=bool)
    refine8 = np.flatnonzero(plan.kinds == PieceKind.REFINE8)[:3]
    for piece in refine8:
        lost[plan.piece_first_symbol[piece] : plan.piece_last_symbol[piece] + 1] = True
    keep = order[~lost[order]]
    ids = (symbols[keep, :4].astype(np.int64) * [1 << 24, 1 << 16, 1 << 8, 1]).sum(axis=1)
    store, have = file_by_stream_index(plan, np.r_[ids, [plan.n_symbols + 5]],
                                       np.r_[symbols[keep, 4:], np.zeros((1, PAYLOAD), np.uint8)])
    assert np.array_equal(have, ~lost)
    levels, bases = plan.usable(have)
    assert (levels[plan.blocks[refine8]] == Level.INT4).all()
    kv = kvcache.dequantise_stream(plan, store, levels, bases)
    assert len(set(levels.tolist())) >= 3 and (levels == Level.INT8).sum() > layout.n_blocks // 2, levels
    trips = {lvl: quant.roundtrip(layers, layout, lvl) for lvl in (Level.INT2, Level.INT4, Level.INT8)}
    for block in range(layout.n_blocks):
        layer = layout.block_layer(block)
        lo, hi = layout.block_token_range(block)
        if levels[block] == Level.NONE:  # a lost symbol also held a piece of this block's base
            assert not kv.keys[layer][..., lo:hi, :].any() and not kv.available[layer, :, lo:hi].any()
            continue
        want = trips[Level(int(levels[block]))]
        assert torch.equal(kv.keys[layer][..., lo:hi, :], want.keys[layer][..., lo:hi, :]), block
        assert torch.equal(kv.values[layer][..., lo:hi, :], want.values[layer][..., lo:hi, :]), block
    with pytest.raises(ValueError, match="payloads"):
        file_by_stream_index(plan, ids, symbols[keep])


# --- the planner's mix, and the sender's side ---------------------------------------------------------------


def test_auto_takes_the_planners_mix_and_a_local_choice_still_streams_a_floor_keeping_one() -> None:
    mix, view = choose_mix("auto", 1500, DEFAULT_GEOMETRY, 100e6, 0.02)
    assert view["used"] == f"handoff:{mix}" and mix in ("native", "int8", "int8-int4")
    assert view["predicted_ttft_s"] < view["local_ttft_s"]
    slow_mix, slow = choose_mix("auto", 200, DEFAULT_GEOMETRY, 1e6, 0.2)  # 1 Mbit/s: recompute wins
    assert slow["choice"] == "local" and slow_mix in ("native", "int8", "int8-int4"), slow
    assert choose_mix("int2", 200, DEFAULT_GEOMETRY, 1e6, 0.2)[0] == "int2"
    with pytest.raises(ValueError, match="not one of"):
        choose_mix("int3", 200, DEFAULT_GEOMETRY, 1e6, 0.2)


def test_synthetic_quantised_prepare_and_bytes_sent_by_level() -> None:
    ident = synthetic_identity(GEOM)
    profile = synthetic_profile(GEOM.n_layers)
    native = prepare_synthetic(ident, 300, "utility", profile, "synthetic", 1)
    assert native.stream is None and native.n_source == native.plan.n_fragments
    assert sent_bytes_by_level(native, 10**6) == {"native": native.plan.kv_bytes}
    auto = prepare_synthetic(ident, 300, "utility", profile, "synthetic", 1,
                             precision=PrecisionRequest("auto"))
    assert auto.stream is None  # random bytes: auto means native
    prepared = prepare_synthetic(ident, 300, "utility", profile, "synthetic", 1,
                                 precision=PrecisionRequest("int4"))
    assert prepared.stream is not None and prepared.precision == "int4"
    stream = prepared.stream.plan
    assert prepared.n_source == stream.n_symbols < native.n_source
    ids = (prepared.symbols[:, :4].astype(np.int64) * [1 << 24, 1 << 16, 1 << 8, 1]).sum(axis=1)
    assert np.array_equal(ids, np.arange(stream.n_symbols))
    everything = sent_bytes_by_level(prepared, stream.n_symbols)
    assert sum(everything.values()) == stream.total_bytes and set(everything) == {"int2", "int4"}
    first = sent_bytes_by_level(prepared, 3)
    assert sum(first.values()) == 3 * stream.symbol_size


# --- any causal LM ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "transfer", "hidden", "heads", "kv_heads", "layers"), [
    ("llama", "fp32", 64, 4, 2, 3),  # head dim 16: one value group per head row
    ("qwen2", "fp16", 96, 4, 2, 2),  # head dim 24
    ("llama", "bf16", 128, 2, 1, 1),  # head dim 64: groups of 32 channels, one layer
])
def test_any_causal_lm_hands_off_a_quantised_stream(arch: str, transfer: str, hidden: int, heads: int,
                                                    kv_heads: int, layers: int) -> None:
    """Tiny models of other dtypes, head dims and layer counts: quantise -> stream -> rebuild -> generate;
    every element within half an int8 bin of the cache in the transfer dtype."""
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from pfec.common.model import llm
    from pfec.common.model.runtime import runtime_identity
    from pfec.sender.kv import plan_stream

    torch.manual_seed(0)
    common = {"vocab_size": 64, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "max_position_embeddings": 256}
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    rt = llm.runtime_from_model(model, None, f"tiny-{arch}", Path("."), "0" * 64, transfer)
    identity = runtime_identity(rt)
    ids = [int(x) for x in np.random.default_rng(0).integers(3, 64, size=45)]
    cache, _ = llm.prefill(rt, ids)
    utilities = synthetic_profile(layers).block_utilities(identity.plan(len(ids)))
    stream = plan_stream(identity, len(ids), "int8", utilities, "utility")
    symbols = llm.serialise_stream(rt, cache, stream.plan)
    have = np.ones(stream.plan.n_symbols, dtype=bool)
    levels, bases = stream.plan.usable(have)
    assert (levels == Level.INT8).all()
    kv = llm.rebuild_from_stream(rt, stream.plan, np.ascontiguousarray(symbols[:, 4:]), levels, bases)
    native = quant.NATIVE_DTYPES[transfer]
    for i, (k, v) in enumerate(llm.cache_layers(cache)):
        for got, ref in ((kv.keys[i], k), (kv.values[i], v)):
            ref = ref[:, :, : len(ids)].to(native).float()
            span = float(ref.max() - ref.min())
            assert float((got.float() - ref).abs().max()) <= span / 256, (i, transfer)
    assert len(llm.generate(rt, kv, [5, 6], 3).token_ids) >= 1
