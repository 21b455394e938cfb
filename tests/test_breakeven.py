"""The break-even planner's arithmetic on cases computed by hand (common/plan/breakeven.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from pfec.cli.plan import plan_cmd
from pfec.common.plan.breakeven import (
    DEFAULT_PRECISION_LEVELS,
    LinkModel,
    PrecisionLevel,
    ReceiverModel,
    level_named,
    meeting_point,
    plan_handoff,
    split_at,
)
from pfec.common.plan.breakeven_scan import PRESETS, Switch, beats_local_from, choice_switches
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry
from pfec.common.plan.prefill import PrefillCurve, fit_prefill_curve
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE, OVERHEAD, SOURCE_ID_SIZE

NATIVE = level_named("native")
GQA_7B = KVGeometry(28, 4, 128, "bf16")
# link bytes per KV byte: a 1362-B symbol carries 1358 B of KV and costs 1362 + 4 + 30 B on the link
FRAMING = (DEFAULT_SYMBOL_SIZE + SOURCE_ID_SIZE + OVERHEAD) / (DEFAULT_SYMBOL_SIZE - 4)


def _rate_for(seconds_per_token: float, level: PrecisionLevel = NATIVE) -> float:
    """The link rate at which one token of ``level`` KV takes ``seconds_per_token`` (framing included)."""
    return level.bytes_per_token(DEFAULT_GEOMETRY) * FRAMING * 8 / seconds_per_token


# --- Prefill curve and its fit ----------------------------------------------------------------------------


def test_prefill_curve_predicts_whole_contexts_and_chunks() -> None:
    curve = PrefillCurve(a=0.1, b=0.002, c=1e-6)
    assert curve.seconds(0) == 0.0
    assert curve.seconds(1000) == pytest.approx(0.1 + 2.0 + 1.0)
    # [0, 500) then [500, 1000): the chunk pays its own call overhead and the rest of the work
    assert curve.chunk_seconds(0, 500) == pytest.approx(curve.seconds(500))
    assert curve.chunk_seconds(500, 1000) == pytest.approx(0.1 + 0.002 * 500 + 1e-6 * (1000**2 - 500**2))
    assert curve.chunk_seconds(700, 700) == 0.0
    assert curve.tokens_per_second(1000) == pytest.approx(1000 / 3.1)


@pytest.mark.parametrize("coefs", [(-0.1, 0.0, 0.0), (0.0, math.nan, 0.0), (0.0, 0.0, math.inf)])
def test_prefill_curve_refuses_negative_or_non_finite_coefficients(coefs: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError, match="PrefillCurve"):
        PrefillCurve(*coefs)


def test_chunk_outside_order_is_refused() -> None:
    with pytest.raises(ValueError, match="start <= stop"):
        PrefillCurve(0.0, 1e-3, 0.0).chunk_seconds(10, 5)


def test_fit_recovers_an_exact_quadratic() -> None:
    truth = PrefillCurve(a=0.05, b=1.5e-3, c=4e-7)
    fitted = fit_prefill_curve([(n, truth.seconds(n)) for n in (128, 512, 1024, 2048)])
    assert (fitted.a, fitted.b, fitted.c) == pytest.approx((truth.a, truth.b, truth.c), rel=1e-6)


def test_fit_clamps_a_negative_curvature_to_zero() -> None:
    # concave points (an unconstrained fit gives c < 0): the best c >= 0 fit is linear
    points = [(100, 0.20), (200, 0.41), (300, 0.60)]
    fitted = fit_prefill_curve(points)
    assert fitted.c == 0.0
    assert fitted.a >= 0 and fitted.b > 0
    assert fitted.seconds(300) == pytest.approx(0.60, abs=0.02)


@pytest.mark.parametrize(
    ("points", "reason"),
    [
        ([(128, 0.1)], "at least 2"),
        ([(128, 0.1), (128, 0.2)], "distinct"),
        ([(128, 0.1), (256, math.nan)], "finite"),
        ([(128, 0.1), (256, 0.0)], "finite and > 0"),
        ([(0, 0.1), (256, 0.2)], "positive integer"),
    ],
)
def test_fit_refuses_bad_points(points: list[tuple[int, float]], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        fit_prefill_curve(points)


# --- Bytes per precision ----------------------------------------------------------------------------------


def test_bytes_per_token_are_the_packed_streams_and_scale_with_geometry() -> None:
    """The planner's bytes per token are what a real stream of the mix packs (each block's ladder from its
    int2 base up): issue 13's table of plain quantised caches (int8 11,880 B) under-predicted int8 streams
    by 15%."""
    from pfec.common.plan.pieces import PieceLayout
    from pfec.common.plan.stream import default_fidelity, stream_plan

    n_tokens = 1223
    layout = PieceLayout(DEFAULT_GEOMETRY, n_tokens)
    utility = np.linspace(1.0, 0.1, layout.n_blocks)
    for level in DEFAULT_PRECISION_LEVELS[1:]:
        plan = stream_plan(layout, level.name, utility, default_fidelity(DEFAULT_GEOMETRY.n_layers), 1024)
        packed = plan.total_bytes / n_tokens
        assert level.bytes_per_token(DEFAULT_GEOMETRY) == pytest.approx(packed, rel=0.01), level.name
    assert NATIVE.bytes_per_token(DEFAULT_GEOMETRY) == 23_040
    assert NATIVE.bytes_per_token(GQA_7B) == 57_344  # 2 x 28 x 4 x 128 x 2 B
    int8 = level_named("int8")
    assert int8.bytes_per_token(GQA_7B) == round(int8.bytes_per_token(DEFAULT_GEOMETRY) / 23_040 * 57_344)
    fp32 = KVGeometry(30, 3, 64, "fp32")
    assert NATIVE.bytes_per_token(fp32) == 46_080
    assert int8.bytes_per_token(fp32) == int8.bytes_per_token(DEFAULT_GEOMETRY)  # not the dtype's


# --- Options on hand-computable links ---------------------------------------------------------------------


def test_infinite_rate_and_zero_rtt_leave_only_rebuild_and_decode() -> None:
    receiver = ReceiverModel(PrefillCurve(0.1, 1e-3, 0.0), decode_s=0.05)
    plan = plan_handoff(1000, DEFAULT_GEOMETRY, LinkModel(math.inf, 0.0), receiver)
    native = plan.option("handoff", "native")
    mb = 1000 * 23_040 / 1e6
    assert native.ttft_s == pytest.approx(mb * NATIVE.rebuild_s_per_mb + 0.05)
    assert plan.option("local").ttft_s == pytest.approx(0.1 + 1.0 + 0.05)
    assert plan.choice.mode in ("handoff", "split")
    assert plan.choice.ttft_s < plan.option("local").ttft_s


def test_handoff_is_handshake_plus_owd_plus_serialisation_plus_rebuild() -> None:
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), decode_s=0.07, rebuild_scale=0.0)
    link = LinkModel(rate_bps=8e6, rtt_s=0.040, loss=0.2, handshake_rtts=1.0)  # 1 MB/s
    opt = plan_handoff(100, DEFAULT_GEOMETRY, link, receiver).option("handoff", "int8")
    kv = 100 * 13_680  # the int8 stream: int2 base, its minima and steps, two refinements
    assert opt.kv_bytes == kv
    wire = kv * FRAMING / 0.8  # framing, then 1 / (1 - loss) of FEC
    assert opt.wire_bytes == math.ceil(wire)
    assert opt.ttft_s == pytest.approx(0.040 + 0.020 + wire / 1e6 + 0.07)


def test_a_floor_excludes_lower_precisions_even_when_faster() -> None:
    receiver = ReceiverModel(PrefillCurve(0.5, 5e-3, 0.0), decode_s=0.0, rebuild_scale=0.0)
    link = LinkModel(_rate_for(1e-3), 0.0)  # native: 1 ms per token, int2: ~0.2 ms
    for floor, allowed in [("native", {"native"}), ("int8", {"native", "int8"})]:
        plan = plan_handoff(2000, DEFAULT_GEOMETRY, link, receiver, floor=floor)
        below = {o.precision for o in plan.options if not o.keeps_floor}
        assert below == {lv.name for lv in DEFAULT_PRECISION_LEVELS} - allowed
        assert plan.choice.precision in allowed | {"exact"}
        fastest = min(plan.options, key=lambda o: o.ttft_s)
        assert fastest.precision == "int2" and fastest is not plan.choice


def test_unknown_floor_is_refused_with_the_known_levels() -> None:
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), 0.0)
    with pytest.raises(ValueError, match=r"unknown precision 'int3'.*native, int8"):
        plan_handoff(100, DEFAULT_GEOMETRY, LinkModel(1e8, 0.02), receiver, floor="int3")


# --- The split's meeting point ----------------------------------------------------------------------------


@pytest.mark.parametrize("curve", [PrefillCurve(0.05, 1e-3, 5e-7), PrefillCurve(0.0, 2e-3, 0.0)])
@pytest.mark.parametrize("level", ["native", "int8-int4"])
def test_meeting_point_equalises_front_and_back(curve: PrefillCurve, level: str) -> None:
    receiver = ReceiverModel(curve, decode_s=0.03)
    link = LinkModel(100e6, 0.02, loss=0.05)
    lv = level_named(level)
    n = 3000
    m = meeting_point(n, DEFAULT_GEOMETRY, lv, link, receiver)
    assert 0 < m < n
    per_token = lv.bytes_per_token(DEFAULT_GEOMETRY) * FRAMING / 0.95 * 8 / 100e6  # link seconds per token

    def front_minus_back(tokens: int) -> float:  # the front in chunks of 256, each call paying a
        chunks = [(i, min(i + 256, tokens)) for i in range(0, tokens, 256)]
        front = link.owd_s + sum(curve.seconds(j) - curve.seconds(i) + (curve.a if i else 0.0)
                                 for i, j in chunks)
        return front - (link.handshake_s + link.owd_s + per_token * (n - tokens))

    assert front_minus_back(math.floor(m)) < 0 <= front_minus_back(math.floor(m) + 1)
    # the integer split chosen is no slower than its neighbours
    opt = plan_handoff(n, DEFAULT_GEOMETRY, link, receiver).option("split", level)
    assert opt.meeting_token is not None
    for other in (opt.meeting_token - 1, opt.meeting_token + 1):
        assert opt.ttft_s <= split_at(other, n, DEFAULT_GEOMETRY, lv, link, receiver).ttft_s


def test_meeting_point_clamps_to_the_ends() -> None:
    slow_receiver = ReceiverModel(PrefillCurve(5.0, 1e-2, 0.0), 0.0)  # 5 s just to start a prefill
    assert meeting_point(100, DEFAULT_GEOMETRY, NATIVE, LinkModel(1e9, 0.001), slow_receiver) == 0.0
    fast_receiver = ReceiverModel(PrefillCurve(0.0, 1e-6, 0.0), 0.0)  # 1 us per token vs a slow link
    assert meeting_point(100, DEFAULT_GEOMETRY, NATIVE, LinkModel(1e3, 0.5), fast_receiver) == 100.0


def test_split_at_refuses_a_meeting_point_outside_the_context() -> None:
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), 0.0)
    with pytest.raises(ValueError, match="outside the context"):
        split_at(101, 100, DEFAULT_GEOMETRY, NATIVE, LinkModel(1e8, 0.02), receiver)


# --- The choice switches at the crossover -----------------------------------------------------------------


def test_choice_switches_where_hand_arithmetic_says() -> None:
    # Receiver: 1 ms per token, no fixed cost. Link: handshake 0.1 s, native 0.5 ms per token, no rebuild.
    # Split beats local once the handshake fits in the prefill: N > 0.1 / 1e-3 = 100.
    # A full handoff beats local when 0.1 + 0.5e-3 N < 1e-3 N: N > 200.
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), decode_s=0.05, rebuild_scale=0.0)
    link = LinkModel(_rate_for(5e-4), rtt_s=0.1, handshake_rtts=1.0)
    levels = [NATIVE]
    switches = choice_switches(range(50, 400), DEFAULT_GEOMETRY, link, receiver, levels, floor="native",
                               tie_tolerance=0.0, local_margin=0.0)
    assert switches == [Switch(101, "local", "split:native")]
    # with the default 20% margin, local stays unless 0.1 + (0.1 + N/2000) / 1.5 <= 0.8 (0.1 + N/1000)
    # (owd and decode 0.05 s each; the split's meeting point m = (0.1 + N/2000) / 1.5e-3): N > 185.7, and
    # 187 once the meeting point is a whole token
    margin = choice_switches(range(50, 400), DEFAULT_GEOMETRY, link, receiver, levels, floor="native")
    assert margin == [Switch(187, "local", "split:native")]
    lengths = range(50, 400)
    assert beats_local_from(lengths, DEFAULT_GEOMETRY, link, receiver, "handoff", "native", levels) == 201
    assert beats_local_from(lengths, DEFAULT_GEOMETRY, link, receiver, "split", "native", levels) == 101


def test_near_ties_go_to_the_simpler_mode_then_the_more_faithful_level() -> None:
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), decode_s=0.0, rebuild_scale=0.0)
    link = LinkModel(_rate_for(5e-4), rtt_s=0.0, handshake_rtts=0.0)
    exact = plan_handoff(1000, DEFAULT_GEOMETRY, link, receiver, tie_tolerance=0.0, floor="int8-int4",
                         local_margin=0.0)
    loose = plan_handoff(1000, DEFAULT_GEOMETRY, link, receiver, tie_tolerance=0.5, floor="int8-int4",
                         local_margin=0.0)
    # No deadline: every candidate fits, so the most faithful level that keeps the floor and beats local
    # (native here: nothing rebuilds) at its fastest mode; a loose tie goes to the simpler mode.
    assert exact.choice.label == "split:native"
    assert loose.choice.label == "handoff:native"
    with pytest.raises(ValueError, match="tie tolerance"):
        plan_handoff(1000, DEFAULT_GEOMETRY, link, receiver, tie_tolerance=math.nan)


def test_beats_local_from_is_none_when_the_link_never_wins() -> None:
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-4, 0.0), 0.0, rebuild_scale=0.0)
    link = LinkModel(_rate_for(1e-3), 0.02)
    lengths = range(16, 8192, 16)
    assert beats_local_from(lengths, DEFAULT_GEOMETRY, link, receiver, "handoff", "native") is None


# --- Bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"rate_bps": -1e6, "rtt_s": 0.02}, "link rate must be > 0"),
        ({"rate_bps": 0.0, "rtt_s": 0.02}, "link rate must be > 0"),
        ({"rate_bps": math.nan, "rtt_s": 0.02}, "link rate must be > 0"),
        ({"rate_bps": 1e8, "rtt_s": -0.01}, "RTT must be a finite number"),
        ({"rate_bps": 1e8, "rtt_s": math.inf}, "RTT must be a finite number"),
        ({"rate_bps": 1e8, "rtt_s": 0.02, "loss": 1.0}, r"loss must lie in \[0, 1\)"),
        ({"rate_bps": 1e8, "rtt_s": 0.02, "loss": -0.1}, r"loss must lie in \[0, 1\)"),
        ({"rate_bps": 1e8, "rtt_s": 0.02, "symbol_size": 4}, "symbol size"),
    ],
)
def test_bad_links_are_refused_with_reasons(kwargs: dict[str, float], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        LinkModel(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("n_tokens", [0, -5, 2.5, True])
def test_bad_token_counts_are_refused(n_tokens: object) -> None:
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), 0.0)
    with pytest.raises(ValueError, match="token count must be a positive integer"):
        plan_handoff(n_tokens, DEFAULT_GEOMETRY, LinkModel(1e8, 0.02), receiver)  # type: ignore[arg-type]


def test_bad_receiver_and_levels_are_refused() -> None:
    with pytest.raises(ValueError, match="decode_s"):
        ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), decode_s=math.nan)
    with pytest.raises(ValueError, match="bf16_ratio"):
        PrecisionLevel("int3", -0.3, 0.01, 0.9, 0.0)
    with pytest.raises(ValueError, match="agreement"):
        PrecisionLevel("int3", 0.3, 0.01, 1.5, 0.0)


def test_presets_state_where_their_speed_comes_from() -> None:
    assert PRESETS["default"].geometry == DEFAULT_GEOMETRY
    assert PRESETS["default"].source.startswith("measured")
    gpu = PRESETS["qwen2.5-7b-geometry"]
    assert gpu.geometry == GQA_7B and gpu.source.startswith("assumed")


# --- `pfec plan` ------------------------------------------------------------------------------------------

app = typer.Typer()
app.command("plan")(plan_cmd)
app.command("unused")(lambda: None)  # two commands keep the "plan" name on the command line


def test_plan_command_prints_only_json_with_the_choice() -> None:
    result = CliRunner().invoke(app, ["plan", "--tokens", "1800", "--rate-mbps", "100", "--rtt-ms", "20",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == "default" and data["n_tokens"] == 1800 and data["floor"] == "int8"
    labels = {f"{o['mode']}:{o['precision']}" for o in data["options"]}
    assert {"local:exact", "handoff:native", "handoff:int8-int4", "split:int8-int4"} <= labels
    assert data["choice"]["keeps_floor"] is True
    local = next(o["ttft_s"] for o in data["options"] if o["mode"] == "local")
    assert data["choice"]["mode"] == "local" or data["choice"]["ttft_s"] <= 0.8 * local


def test_plan_command_prints_a_table_for_the_7b_geometry() -> None:
    result = CliRunner().invoke(app, ["plan", "--tokens", "4096", "--model", "qwen2.5-7b-geometry"])
    assert result.exit_code == 0, result.output
    assert "assumed" in result.stdout and "<- choice" in result.stdout


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--tokens", "0"], "token count must be a positive integer"),
        (["--tokens", "100", "--rate-mbps", "-5"], "link rate must be > 0"),
        (["--tokens", "100", "--model", "gpt-9"], "unknown model preset"),
        (["--tokens", "100", "--model", "qwen2.5-7b-geometry", "--measure"], "stated geometry"),
    ],
)
def test_plan_command_refuses_bad_input_with_exit_2(args: list[str], reason: str) -> None:
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert reason in result.output


def test_front_chunks_end_on_the_meeting_token_and_never_past_the_context() -> None:
    """The receiver's front: fixed chunks, but the one crossing the meeting token stops on it (the session
    may start there), and chunks past it continue only while the stream is late."""
    from pfec.common.plan.prefill import front_chunk_end

    def chunks(meeting: int, n: int, size: int = 256) -> list[int]:
        ends, done = [], 0
        while done < n:
            done = front_chunk_end(done, meeting, n, size)
            ends.append(done)
        return ends

    assert chunks(224, 656) == [224, 480, 656]
    assert chunks(512, 656) == [256, 512, 656]  # a meeting token on a chunk boundary changes nothing
    assert chunks(656, 656) == [256, 512, 656]  # local prefill: the meeting token is the context's end
    assert chunks(0, 300) == [256, 300]  # all streamed: the front only bridges a late stream
    for bad in ((656, 224, 656), (-1, 224, 656), (0, 10, 20, 0)):
        with pytest.raises(ValueError, match="front chunk"):
            front_chunk_end(*bad)


def test_a_front_chunk_ends_where_the_stream_is_forecast_to_meet_it() -> None:
    """From 512 toward a planned 768 at 4 ms per token, with the stream delivering 1000 symbols/s: the
    chunk ends at the first token by whose computation everything missing past it has arrived."""
    from pfec.common.plan.prefill import meeting_chunk_end

    # 600 symbols missing: 300 of the back (ends past 768), then 20 per 16 tokens of the front's (512, 768].
    missing = np.sort(np.concatenate([np.full(300, 1024), np.repeat(np.arange(528, 769, 16), 20)]))
    end = meeting_chunk_end(512, 768, 0.004, missing, 1000.0)
    # At m, computing takes (m - 512) * 4 ms; the stream needs (300 + 20 (768 - m) / 16) ms past m.
    assert end == 640 and (640 - 512) * 0.004 >= (300 + 20 * (768 - 640) / 16) / 1000
    assert (624 - 512) * 0.004 < (300 + 20 * (768 - 624) / 16) / 1000  # one step earlier, the stream is late
    assert meeting_chunk_end(512, 768, 0.004, missing, 100.0) == 768  # a slow stream: the planned chunk
    assert meeting_chunk_end(512, 768, 0.004, missing[:0], 1000.0) == 528  # nothing missing: the next step
    assert meeting_chunk_end(500, 768, 0.004, missing, 1e9) == 512  # steps on the grid, not from ``done``
    for pace, rate in ((0.0, 1000.0), (0.004, 0.0), (math.nan, 1000.0), (0.004, math.inf), (-1.0, 1000.0)):
        assert meeting_chunk_end(512, 768, pace, missing, rate) == 768  # no forecast: the planned chunk
    with pytest.raises(ValueError, match="a chunk"):
        meeting_chunk_end(768, 768, 0.004, missing, 1000.0)


def test_fidelity_first_the_most_faithful_stream_that_fits_then_local_unless_beaten_by_the_margin() -> None:
    """Native where its whole cache starts generating by the deadline, int8 (the floor) where only the
    smaller stream fits, the fastest candidate where none fits, local where no stream beats it by 20%."""
    receiver = ReceiverModel(PrefillCurve(0.0, 1e-3, 0.0), decode_s=0.0, rebuild_scale=0.0)
    link = LinkModel(_rate_for(2e-4), rtt_s=0.0, handshake_rtts=0.0)  # native: 0.2 ms per token
    plan = plan_handoff(1000, DEFAULT_GEOMETRY, link, receiver, deadline_s=10.0)
    assert plan.choice.precision == "native" and plan.floor == "int8"
    native = min(o.ttft_s for o in plan.options if o.precision == "native" and o.mode != "local")
    tight = plan_handoff(1000, DEFAULT_GEOMETRY, link, receiver, deadline_s=0.95 * native)
    assert tight.choice.precision == "int8"
    hopeless = plan_handoff(1000, DEFAULT_GEOMETRY, link, receiver, deadline_s=1e-6)
    candidates = [o for o in hopeless.options if o.keeps_floor and o.mode != "local"]
    assert hopeless.choice.ttft_s == min(o.ttft_s for o in candidates)
    # 40 ms per native token: even a split at int8 (20 ms per token streamed, 1 ms computed) comes within
    # 5% of local prefill, inside the margin.
    slow = LinkModel(_rate_for(4e-2), rtt_s=0.0, handshake_rtts=0.0)
    assert plan_handoff(1000, DEFAULT_GEOMETRY, slow, receiver).choice.mode == "local"
    for bad in (-1.0, math.nan, 1.0):
        with pytest.raises(ValueError, match="local margin"):
            plan_handoff(100, DEFAULT_GEOMETRY, link, receiver, local_margin=bad)
    with pytest.raises(ValueError, match="deadline"):
        plan_handoff(100, DEFAULT_GEOMETRY, link, receiver, deadline_s=0.0)


def test_the_stated_speed_is_refitted_over_the_recent_prefill_calls() -> None:
    """A receiver that measured (128, 512, 1024 tokens, from empty) a nearly linear curve, then timed a
    long split front in 256-token chunks whose cost grows with the cache before them (attention), states
    a curve with that quadratic term: its prediction for 4k tokens follows the chunks, not the
    extrapolated measurement. Implausible timings are ignored."""
    from pfec.common.plan.receiver_speed import RecentPrefills, stated_fields

    true = PrefillCurve(0.1, 3e-3, 5e-7)
    points = [(n, true.a + 3.2e-3 * n) for n in (128, 512, 1024)]  # the quadratic hidden at short lengths
    measured = fit_prefill_curve(points)
    recent = RecentPrefills(measured, 0.08, points)
    assert recent.stated() == stated_fields(measured, 0.08)  # nothing timed yet: the measurement
    bad = [(10, 10, 1.0), (0, 256, float("nan")), (0, 256, 0.0), (0, 256, 1e6)]
    assert recent.observe(bad) == 0 and recent.timed == 0 and recent.curve == measured
    chunks = [(start, start + 256, true.chunk_seconds(start, start + 256)) for start in range(0, 4096, 256)]
    assert recent.observe(chunks) == 16
    assert recent.timed == 16 and recent.curve.c > 0
    err_before = abs(measured.seconds(4096) - true.seconds(4096)) / true.seconds(4096)
    err_after = abs(recent.curve.seconds(4096) - true.seconds(4096)) / true.seconds(4096)
    assert err_before > 0.3 and err_after < 0.1, (err_before, err_after)  # measured: 36% -> 7%
    assert recent.stated() == stated_fields(recent.curve, 0.08)


def test_a_split_front_beside_its_stream_shapes_the_stated_speed_but_does_not_slow_it() -> None:
    """A split's front runs beside its stream, here 2.5x slower than the node's unloaded speed, whose
    measurement (short prefills from empty) hides attention's quadratic cost. The stated curve keeps the
    unloaded level (local prefill's prediction) and takes the front's growth with the cache before each
    chunk: its 4k prediction follows the true unloaded curve, not the measurement, nor the slowed chunks."""
    from pfec.common.plan.receiver_speed import RecentPrefills, front_slowdown

    true = PrefillCurve(0.1, 3e-3, 5e-7)
    points = [(n, true.a + 3.2e-3 * n) for n in (128, 512, 1024)]
    measured = fit_prefill_curve(points)
    chunks = [(start, start + 256, 2.5 * true.chunk_seconds(start, start + 256))
              for start in range(0, 4096, 256)]
    assert front_slowdown(true, chunks) == pytest.approx(2.5)
    recent = RecentPrefills(measured, 0.08, points)
    assert recent.observe(chunks, loaded=True) == 16 and recent.timed == 16
    err_before = abs(measured.seconds(4096) - true.seconds(4096)) / true.seconds(4096)
    err_after = abs(recent.curve.seconds(4096) - true.seconds(4096)) / true.seconds(4096)
    assert err_before > 0.3 and err_after < 0.15, (err_before, err_after)
    slowed = RecentPrefills(measured, 0.08, points)
    slowed.observe(chunks)  # the same chunks taken as unloaded: the stated speed is the stream's
    assert slowed.curve.seconds(4096) > 1.25 * true.seconds(4096)
    alone = RecentPrefills(measured, 0.08)  # no measurement points: the stated curve anchors the level
    alone.observe(chunks, loaded=True)
    assert alone.curve.seconds(4096) < 1.5 * measured.seconds(4096)


def test_timed_calls_fit_the_curve_they_were_drawn_from() -> None:
    from pfec.common.plan.prefill import fit_prefill_calls

    true = PrefillCurve(0.12, 2.5e-3, 4e-7)
    calls = [(0, 300, true.seconds(300)), (300, 700, true.chunk_seconds(300, 700)),
             (700, 2000, true.chunk_seconds(700, 2000)), (0, 1500, true.seconds(1500))]
    fit = fit_prefill_calls(calls)
    assert (fit.a, fit.b, fit.c) == pytest.approx((true.a, true.b, true.c), rel=1e-6)
    with pytest.raises(ValueError, match="0 <= start < stop"):
        fit_prefill_calls([(5, 5, 1.0)])
    with pytest.raises(ValueError, match="no timed"):
        fit_prefill_calls([])


def test_a_stated_speed_travels_in_integer_units_and_the_implausible_is_defaulted() -> None:
    from pfec.common.plan.breakeven import DEFAULT_MODEL_DECODE_S, DEFAULT_MODEL_PREFILL
    from pfec.common.plan.receiver_speed import stated_fields, stated_receiver

    measured = PrefillCurve(0.2193, 7.337e-4, 6.525e-7)
    fields = stated_fields(measured, 0.081)
    assert fields[:4] == (219300, 733700, 652500, 81000) and not any(fields[4:])
    model = stated_receiver(*fields)
    assert model is not None
    assert model.prefill.seconds(1500) == pytest.approx(measured.seconds(1500))
    assert model.decode_s == pytest.approx(0.081)
    assert "prefill" not in model.defaulted and "decode_s" not in model.defaulted
    # the parts it did not measure are planned with the defaults, and named
    assert {"rebuild_int8_s_per_token", "question_fit", "datagram_s"} <= set(model.defaulted)
    assert stated_receiver(0, 0, 0, 0) is None  # a receiver that measured nothing states nothing
    no_cost = stated_receiver(1000, 0, 0, 1000)  # no per-token cost: the stored curve, named
    assert no_cost is not None and no_cost.prefill == DEFAULT_MODEL_PREFILL and "prefill" in no_cost.defaulted
    slow = stated_receiver(0, 0xFFFF_FFFF, 0, 1000)  # 4.3 s per token
    assert slow is not None and slow.prefill == DEFAULT_MODEL_PREFILL and "prefill" in slow.defaulted
    stuck = stated_receiver(0, 1000, 0, 0xFFFF_FFFF)  # an hour per decode step
    assert stuck is not None and stuck.decode_s == DEFAULT_MODEL_DECODE_S and "decode_s" in stuck.defaulted
    assert stated_fields(PrefillCurve(1e9, 0.0, 0.0), 1e9)[0] == 0xFFFF_FFFF  # clamped, then defaulted
