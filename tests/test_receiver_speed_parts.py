"""Issue 39 items 1-2: the receiver measures every part the planner predicts, states it in its ACCEPT (and
the speed query's answer), the planner predicts with it, and missing or absurd numbers are planned with
the conservative defaults and named, never a crash."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pfec.common.model import llm, speed
from pfec.common.plan.breakeven import (
    DEFAULT_MODEL_DECODE_S,
    DEFAULT_MODEL_PREFILL,
    LIVE_REBUILD_EVERY_S,
    LinkModel,
    ReceiverModel,
    level_named,
    plan_handoff,
    split_at,
)
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.common.plan.mode_choice import choose_mode
from pfec.common.plan.prefill import PrefillCurve
from pfec.common.plan.receiver_speed import (
    DEFAULT_DATAGRAM_S,
    MeasuredParts,
    RecentPrefills,
    Statement,
    fit_decode,
    fit_question,
    stated_fields,
    stated_receiver,
    statement_of,
)
from pfec.common.wire.encoding import encode_body
from pfec.common.wire.frames import decode_body
from pfec.common.wire.messages import Accept, MsgType
from pfec.receiver.node_speed import time_receive_path

CURVE = PrefillCurve(0.03, 2.5e-3, 8e-7)
PARTS = MeasuredParts(rebuild_s_per_token=(2e-6, 5e-6, 6e-6, 7e-6), question_fit=(0.04, 3e-3, 5e-5),
                      decode_s_per_token=2e-6, datagram_s=25e-6)
LINK = LinkModel(100e6, 0.02)


def _over_the_wire(statement: Statement) -> Statement:
    accept = Accept(16, 10, bytes(16), *statement)
    body = encode_body(accept)
    message = decode_body(MsgType.ACCEPT, body, 1362)
    assert isinstance(message, Accept)
    return statement_of(message)


def test_every_measured_part_travels_in_the_accept_and_reaches_the_planner() -> None:
    stated = _over_the_wire(stated_fields(CURVE, 0.05, PARTS))
    model = stated_receiver(*stated)
    assert model is not None and model.defaulted == ()
    assert model.rebuild_s_per_token == pytest.approx(PARTS.rebuild_s_per_token)
    assert model.question_fit == pytest.approx(PARTS.question_fit)
    assert model.decode_s_per_token == pytest.approx(2e-6) and model.datagram_s == pytest.approx(25e-6)
    # The planner predicts each part from them, not from its constants.
    recv = ReceiverModel(CURVE, 0.05, question_tokens=30, rebuild_s_per_token=model.rebuild_s_per_token,
                         question_fit=model.question_fit, decode_s_per_token=model.decode_s_per_token,
                         datagram_s=model.datagram_s)
    plan = plan_handoff(1500, DEFAULT_GEOMETRY, LINK, recv)
    handoff = plan.option("handoff", "int8")
    # a quantised stream is placed as it arrives: the last placement period's share is left at ready
    ser = handoff.parts["serialisation_s"]
    assert handoff.parts["rebuild_s"] == pytest.approx(1500 * 5e-6 * LIVE_REBUILD_EVERY_S / ser)
    mixed = plan.option("handoff", "int8-int4")
    assert mixed.parts["rebuild_s"] == pytest.approx(
        1500 * 5.5e-6 * LIVE_REBUILD_EVERY_S / mixed.parts["serialisation_s"])
    assert plan.option("handoff", "native").parts["rebuild_s"] == pytest.approx(1500 * 2e-6)  # one-shot
    # a placer slower than the link leaves its backlog
    slow = replace(recv, rebuild_s_per_token=(2e-6, 2e-3, 2e-3, 2e-3))
    slow_handoff = plan_handoff(1500, DEFAULT_GEOMETRY, LINK, slow).option("handoff", "int8")
    assert slow_handoff.parts["rebuild_s"] == pytest.approx(3.0 - slow_handoff.parts["serialisation_s"])
    assert handoff.parts["question_s"] == pytest.approx(0.04 + 30 * 3e-3 + 1500 * 5e-5)
    assert handoff.parts["decode_s"] == pytest.approx(0.05 + 1530 * 2e-6)
    # The front shares its core with the stream: 25 us per datagram at 100 Mbit/s (8,953 datagrams/s).
    share = 25e-6 * 100e6 / 8 / (1362 + 4 + 30)
    assert recv.stream_factor(LINK) == pytest.approx(1 / (1 - share))
    level = level_named("int8")
    beside = split_at(512, 1500, DEFAULT_GEOMETRY, level, LINK, replace(recv, rebuild_s_per_token=None))
    alone = split_at(512, 1500, DEFAULT_GEOMETRY, level, LINK, ReceiverModel(CURVE, 0.05, question_tokens=30))
    assert beside.parts["front_s"] - LINK.owd_s == pytest.approx(
        (alone.parts["front_s"] - LINK.owd_s) / (1 - share))
    loaded = split_at(512, 1500, DEFAULT_GEOMETRY, level, LINK, recv)
    assert loaded.parts["front_s"] > beside.parts["front_s"]  # the blocks placed between its chunks
    # a split rebuilds from its whole stream plan (as measured, the whole context's tokens), placed as it
    # arrives: between the front's chunks, which it lengthens, and in the idle worker after
    whole = 1500 * 5e-6
    assert loaded.parts["rebuild_s"] < whole
    assert loaded.parts["front_s"] + loaded.parts["rebuild_s"] <= beside.parts["front_s"] + whole + 1e-9


def test_a_slower_node_is_planned_slower_without_a_constant_changed() -> None:
    """A receiver that measured itself 2x slower in every part gets a plan 2x slower in every part."""
    fast = stated_receiver(*stated_fields(CURVE, 0.05, PARTS))
    slow_curve = PrefillCurve(2 * CURVE.a, 2 * CURVE.b, 2 * CURVE.c)
    slow_parts = MeasuredParts((4e-6, 10e-6, 12e-6, 14e-6), (0.08, 6e-3, 1e-4), 4e-6, 50e-6)
    slow = stated_receiver(*stated_fields(slow_curve, 0.1, slow_parts))
    assert fast is not None and slow is not None
    a = choose_mode("handoff", "int8", 1500, DEFAULT_GEOMETRY, 100e6, 0.02, fast, question_tokens=30)
    b = choose_mode("handoff", "int8", 1500, DEFAULT_GEOMETRY, 100e6, 0.02, slow, question_tokens=30)
    for part in ("rebuild_s", "question_s", "decode_s"):
        assert b.view["predicted_parts"][part] == pytest.approx(2 * a.view["predicted_parts"][part], rel=1e-3)
    assert b.view["local_ttft_s"] > 1.9 * a.view["local_ttft_s"]
    assert a.view["receiver_defaulted"] == []
    assert a.view["receiver_measured"]["datagram_s"] == pytest.approx(25e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e9, 0.0])
@pytest.mark.parametrize("field", ["rebuild", "question", "datagram", "decode", "curve"])
def test_missing_or_absurd_numbers_are_defaulted_and_named(field: str, bad: float) -> None:
    parts, curve, decode_s = PARTS, CURVE, 0.05
    if field == "rebuild":
        parts = MeasuredParts((2e-6, bad, 6e-6, 7e-6), PARTS.question_fit, 2e-6, 25e-6)
        named = {"rebuild_int8_s_per_token"}
    elif field == "question":
        parts = MeasuredParts(PARTS.rebuild_s_per_token, (bad, bad, bad), 2e-6, 25e-6)
        named = {"question_fit"}
    elif field == "datagram":
        parts = MeasuredParts(PARTS.rebuild_s_per_token, PARTS.question_fit, 2e-6, bad)
        named = {"datagram_s"}
    elif field == "decode":
        decode_s = bad
        named = {"decode_s"}
    else:  # a curve's coefficients are checked where it is built: a bad one states no per-token cost
        curve = PrefillCurve(0.03, 0.0, 0.0) if not (math.isfinite(bad) and bad >= 0) else PrefillCurve(
            0.03, bad, 0.0)
        named = {"prefill"}
    model = stated_receiver(*_over_the_wire(stated_fields(curve, decode_s, parts)))
    assert model is not None
    assert set(model.defaulted) == named, model.defaulted
    if "datagram_s" in named:
        assert model.datagram_s == DEFAULT_DATAGRAM_S
    if "prefill" in named:
        assert model.prefill == DEFAULT_MODEL_PREFILL
    if "decode_s" in named:
        assert model.decode_s == DEFAULT_MODEL_DECODE_S
    if "question_fit" in named:
        assert model.question_fit is None  # the prefill curve's chunk, as before
    if "rebuild_int8_s_per_token" in named:
        assert model.rebuild_s_per_token is None  # the levels' constants
    # planned, never a crash; the planner's view names what was defaulted
    choice = choose_mode("auto", "auto", 1500, DEFAULT_GEOMETRY, 100e6, 0.02, model, question_tokens=30)
    assert set(choice.view["receiver_defaulted"]) == named
    assert math.isfinite(choice.view["predicted_ttft_s"])


def test_the_largest_values_the_wire_carries_are_defaulted() -> None:
    model = stated_receiver(*([0xFFFF_FFFF] * len(Statement._fields)))
    assert model is not None
    assert {"prefill", "decode_s", "decode_s_per_token", "question_fit", "datagram_s",
            "rebuild_native_s_per_token"} <= set(model.defaulted)
    plan_handoff(2000, DEFAULT_GEOMETRY, LINK, model)  # no crash


def test_recent_prefills_state_the_parts_beside_the_refitted_curve() -> None:
    recent = RecentPrefills(CURVE, 0.05, [(128, CURVE.seconds(128)), (512, CURVE.seconds(512))], PARTS)
    assert recent.stated()[4:] == stated_fields(CURVE, 0.05, PARTS)[4:]
    recent.observe([(0, 256, 3 * CURVE.seconds(256))])
    assert recent.stated()[4:] == stated_fields(CURVE, 0.05, PARTS)[4:]  # the parts stay as measured


def test_fits_recover_known_coefficients() -> None:
    truth = (0.02, 1e-3, 4e-5)
    points = [(q, n, truth[0] + truth[1] * q + truth[2] * n) for q in (16, 64) for n in (128, 1024)]
    assert fit_question(points) == pytest.approx(truth, rel=1e-6)
    assert fit_decode([(128, 0.05 + 128 * 2e-6), (1024, 0.05 + 1024 * 2e-6)]) == pytest.approx((0.05, 2e-6))
    with pytest.raises(ValueError):
        fit_question([(16, 128, math.nan), (64, 1024, 0.1)])


@pytest.fixture(scope="module")
def tiny() -> llm.ModelRuntime:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    return llm.runtime_from_model(model, None, "tiny-llama", Path("."), "0" * 64, "fp32")


def test_a_real_tiny_model_measures_every_part(tiny: llm.ModelRuntime) -> None:
    measured = speed.measure_prefill_speed(tiny, (16, 48, 96), threads=1, parts=True)
    parts = measured.parts
    assert parts.rebuild_s_per_token is not None and parts.question_fit is not None
    assert all(0 < x < 1e-2 for x in parts.rebuild_s_per_token)
    assert all(x >= 0 and math.isfinite(x) for x in parts.question_fit) and sum(parts.question_fit) > 0
    assert math.isfinite(parts.decode_s_per_token) and parts.decode_s_per_token >= 0
    model = stated_receiver(*stated_fields(measured.curve, measured.decode_s, parts))
    # every part measured here is stated (the receive path is the daemon's; the tiny model's curve may fit
    # without a per-token cost under load, and is then defaulted)
    assert model is not None and set(model.defaulted) - {"prefill"} == {"datagram_s"}
    again = speed.PrefillSpeed.from_dict(measured.to_dict())
    assert again == measured


def test_a_context_too_short_for_the_question_states_no_parts(tiny: llm.ModelRuntime) -> None:
    measured = speed.measure_prefill_speed(tiny, (16, 150), threads=1, parts=True)
    # 150 + 64 + 2 tokens do not fit 160: one cache length only, so nothing is fitted (stated as 0)
    assert measured.parts == MeasuredParts()
    model = stated_receiver(*stated_fields(measured.curve, measured.decode_s, measured.parts))
    assert model is not None and "question_fit" in model.defaulted


def test_the_receive_path_is_timed_on_this_node() -> None:
    seconds = time_receive_path(n_datagrams=128, batch=32, repeats=1)
    assert 0 < seconds < 0.01
