"""Trace-driven link rate: Mahimahi traces (parsing, looping, scale) and the drop-tail bottleneck queue."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pfec.lab.sim.rate_trace import (
    OPPORTUNITY_BYTES,
    TraceError,
    TraceQueue,
    load_rate_trace,
    markov_trace,
    parse_rate_trace,
    queue_limit_bytes,
    rotated,
    step_trace,
)


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        (["1", "x2", "3"], r"t\.up:2: 'x2' is not a whole number of ms"),
        (["1", "-2"], r"t\.up:2: '-2' is negative"),
        (["1", "2.5"], r"t\.up:2: '2\.5' is not a whole number"),
        (["1", "5", "4"], r"t\.up:3: 4 ms comes before the line above it \(5 ms\)"),
        (["1", "", "2"], r"t\.up:2: '' is not a whole number"),
        ([], r"t\.up: the trace is empty"),
        (["0", "0"], r"t\.up: every opportunity is at 0 ms"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_file_and_line(lines: list[str], reason: str) -> None:
    with pytest.raises(TraceError, match=reason):
        parse_rate_trace(lines, "t.up")


@pytest.mark.parametrize("scale", [0, -1, float("nan"), float("inf")])
def test_a_rate_scale_of_zero_or_less_is_refused(scale: float) -> None:
    with pytest.raises(TraceError, match="rate-scale"):
        parse_rate_trace(["1", "2"], "t.up", scale)


def test_a_trace_file_is_read_and_an_unreadable_one_named(tmp_path: Path) -> None:
    path = tmp_path / "link.up"
    path.write_text("1\n1\n3\n4\n")
    trace = load_rate_trace(path, scale=2)
    assert trace.opportunities_ms.tolist() == [1, 1, 3, 4] and trace.period_ms == 4
    assert trace.mean_rate_bps == pytest.approx(4 * 2 * OPPORTUNITY_BYTES * 8 / 0.004)
    with pytest.raises(TraceError, match=r"missing\.up: cannot read"):
        load_rate_trace(tmp_path / "missing.up")
    (tmp_path / "bad.up").write_text("1\n2\nthree\n")
    with pytest.raises(TraceError, match=r"bad\.up:3"):
        load_rate_trace(tmp_path / "bad.up")


def test_the_trace_loops_with_its_last_line_as_the_period() -> None:
    trace = parse_rate_trace(["2", "5", "10"], "t")
    assert [trace.opportunity_s(i) for i in range(6)] == pytest.approx(
        [0.002, 0.005, 0.010, 0.012, 0.015, 0.020])
    assert trace.first_at_or_after(0.0) == 0
    assert trace.first_at_or_after(0.006) == 2
    assert trace.first_at_or_after(0.0101) == 3  # past the last line: the next pass's first
    assert trace.first_at_or_after(0.0155) == 5


def test_the_queue_delivers_at_the_trace_rate_and_drops_at_its_tail() -> None:
    """One opportunity per ms (12 Mbit/s): 1,500-byte datagrams sent all at once leave 1 ms apart until
    the queue (10 of them) is full; the rest are dropped."""
    trace = parse_rate_trace([str(ms) for ms in range(1, 1001)], "1 per ms")
    assert trace.mean_rate_bps == pytest.approx(12e6)
    queue = TraceQueue(trace, limit_bytes=10 * 1500)
    departures = [queue.send(0.0, 1500) for _ in range(15)]
    assert departures[:10] == pytest.approx([0.001 * (i + 1) for i in range(10)])
    assert departures[10:] == [None] * 5 and queue.dropped == 5 and queue.delivered == 10
    # Once the first has left, there is room for one more, behind the queue.
    assert queue.send(0.0015, 1500) == pytest.approx(0.011)


def test_an_opportunity_carries_two_small_datagrams_and_is_lost_when_none_waits() -> None:
    trace = parse_rate_trace(["1", "2", "3", "4"], "t")
    queue = TraceQueue(trace, limit_bytes=100_000)
    assert queue.send(0.0, 700) == pytest.approx(0.001)
    assert queue.send(0.0, 700) == pytest.approx(0.001)  # the rest of the same opportunity
    assert queue.send(0.0, 700) == pytest.approx(0.002)  # 100 B left there, 600 from the next
    # Idle from 0.002 to 0.0035: opportunity 3 went unused; the next datagram takes opportunity 4.
    assert queue.send(0.0035, 1000) == pytest.approx(0.004)
    # 500 B left at 4 ms, 1500 at 5 ms (the second pass), 1000 of 6 ms's
    assert queue.send(0.0035, 3000) == pytest.approx(0.006)


def test_a_scaled_trace_carries_k_datagrams_per_line() -> None:
    trace = parse_rate_trace(["1", "2"], "t", scale=4)
    queue = TraceQueue(trace, limit_bytes=100_000)
    assert [queue.send(0.0, 1500) for _ in range(5)] == pytest.approx([0.001] * 4 + [0.002])


def test_made_traces_hold_their_rates() -> None:
    steps = step_trace([24.0, 6.0], seconds_each=2.0)
    rates = steps.rates_bps(1.0) / 1e6
    assert rates.tolist() == pytest.approx([24.0, 24.0, 6.0, 6.0], rel=0.01)
    chain = markov_trace([5.0, 50.0], mean_hold_s=0.5, seconds=20.0, seed=3)
    per_window = chain.rates_bps(0.1) / 1e6
    assert np.any(np.abs(per_window - 5.0) < 0.5) and np.any(np.abs(per_window - 50.0) < 1.0)  # both states
    assert 10 < chain.mean_rate_bps / 1e6 < 45
    assert markov_trace([5.0, 50.0], 0.5, 20.0, seed=3).opportunities_ms.tolist() == \
        chain.opportunities_ms.tolist()  # seeded


def test_a_saturating_sender_gets_the_trace_rate_through_a_step() -> None:
    """Datagrams offered at 60 Mbit/s through a 24 -> 6 Mbit/s step: what leaves follows the trace (the
    queue drops the excess), and the queueing delay stays within the queue's depth."""
    trace = step_trace([24.0, 6.0], seconds_each=1.0)
    limit = queue_limit_bytes(trace, queue_ms=50.0)
    queue = TraceQueue(trace, limit)
    size, gap = 1500, 1500 * 8 / 60e6
    left = [(t, queue.send(t, size)) for t in np.arange(0.0, 2.0, gap)]
    out = np.asarray([d for _, d in left if d is not None])
    first = np.count_nonzero(out < 1.0) * size * 8 / 1e6
    second = np.count_nonzero((out >= 1.0) & (out < 2.0)) * size * 8 / 1e6
    assert first == pytest.approx(24.0, rel=0.03) and second == pytest.approx(6.0, rel=0.05)
    delays = [d - t for t, d in left if d is not None]
    assert max(delays) < limit * 8 / 6e6 + 0.002  # the depth drained at the slowest rate
    assert queue.dropped > 0


def test_queue_depth_is_stated_in_bytes_or_ms_at_the_mean_rate() -> None:
    trace = parse_rate_trace([str(ms) for ms in range(1, 101)], "12 Mbit/s")
    assert queue_limit_bytes(trace) == 150_000  # 100 ms at 12 Mbit/s
    assert queue_limit_bytes(trace, queue_ms=10) == 15_000
    assert queue_limit_bytes(trace, queue_bytes=4000) == 4000
    with pytest.raises(ValueError, match="> 0"):
        queue_limit_bytes(trace, queue_ms=0)


# --------------------------------------------------------------------------- the simulator on a trace


def test_the_simulator_on_a_trace_as_fast_as_told_matches_the_fixed_rate_link() -> None:
    """A trace that carries exactly the told rate at every millisecond changes nothing a session sees
    beyond a millisecond's granularity; told four times the trace's rate, the bottleneck drops what the
    sender overruns it with (self-inflicted loss) and the utility falls; the trace-aware oracle bounds
    every session scheme on the same realization."""
    from pfec.lab.sim.channel import Bernoulli
    from pfec.lab.sim.simulate import SimConfig, simulate

    base = {"loss": Bernoulli(0.0), "rho": 1.3, "tokens": 256, "rate_mbps": 24.0}
    fixed = simulate(SimConfig(**base), ["heuristic", "oracle"], 1)  # type: ignore[arg-type]
    steady = step_trace([24.0], seconds_each=10.0)
    traced = simulate(SimConfig(**base, rate_trace=steady), ["heuristic", "oracle"], 1)  # type: ignore[arg-type]
    for name in ("heuristic", "oracle"):
        assert traced["schemes"][name]["recovered_utility_mean"] == pytest.approx(
            fixed["schemes"][name]["recovered_utility_mean"], abs=0.02), name
    assert traced["inputs"]["rate_trace"]["mean_rate_mbps"] == pytest.approx(24.0, rel=0.01)
    slow = step_trace([6.0], seconds_each=10.0)
    overrun = simulate(SimConfig(**base, rate_trace=slow), ["heuristic", "oracle"], 2)  # type: ignore[arg-type]
    heuristic = overrun["schemes"]["heuristic"]
    told_right = traced["schemes"]["heuristic"]["recovered_utility_mean"]
    assert heuristic["recovered_utility_mean"] < 0.8 * told_right
    assert heuristic["efficiency_mean"] <= 1.0 + 1e-9  # the oracle knows the trace
    assert overrun["schemes"]["oracle"]["recovered_utility_mean"] >= heuristic["recovered_utility_mean"]


def test_fixed_rate_reference_models_are_refused_on_a_trace() -> None:
    from pfec.lab.sim.channel import Bernoulli
    from pfec.lab.sim.simulate import SimConfig, simulate

    cfg = SimConfig(loss=Bernoulli(0.0), rho=1.0, tokens=256, rate_trace=step_trace([24.0], 1.0))
    with pytest.raises(ValueError, match="arq model a fixed-rate link"):
        simulate(cfg, ["heuristic", "arq"], 1)


# --------------------------------------------------------------------------- the emulator on a trace


def test_the_emulated_link_follows_the_trace_and_reports_queueing_delay() -> None:
    from pfec.lab.emulator.link import DirectionSpec, LinkDirection

    trace = step_trace([12.0, 3.0], seconds_each=1.0)
    spec = DirectionSpec(owd_s=0.010, rate_trace=trace, queue_bytes=30_000)
    link = LinkDirection(spec, np.random.default_rng(0))
    t0 = 5.0  # the trace's clock starts with the first datagram
    times = t0 + np.arange(0.0, 2.0, 1500 * 8 / 24e6)  # offered at 24 Mbit/s
    arrivals = [link.offer(float(t), 1500) for t in times]
    got = np.asarray([a for a in arrivals if a is not None]) - t0 - 0.010
    assert np.count_nonzero(got < 1.0) * 1500 * 8 / 1e6 == pytest.approx(12.0, rel=0.03)
    assert np.count_nonzero((got >= 1.0) & (got < 2.0)) * 1500 * 8 / 1e6 == pytest.approx(3.0, rel=0.06)
    st = link.snapshot()
    assert st.queue_dropped == arrivals.count(None) > 0
    assert st.queue_delay_ms_p50 is not None and st.queue_delay_ms_p99 is not None
    drain_ms = 30_000 * 8 / 3e6 * 1000  # the whole queue at the slower rate
    assert 0 < st.queue_delay_ms_p50 <= st.queue_delay_ms_p95 <= st.queue_delay_ms_p99 <= drain_ms + 2


def test_emulate_refuses_trace_options_without_a_trace_and_names_a_bad_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pfec.cli.app import app

    runner = CliRunner()
    res = runner.invoke(app, ["emulate", "--rate-scale", "2", "--duration", "0.1"])
    assert res.exit_code != 0 and "--rate-trace" in res.output, res.output
    bad = tmp_path / "bad.up"
    bad.write_text("1\n2\n1\n")
    res = runner.invoke(app, ["emulate", "--rate-trace", str(bad), "--duration", "0.1"])
    assert res.exit_code != 0 and "bad.up:3" in res.output, res.output
    good = tmp_path / "good.up"
    good.write_text("1\n2\n")
    res = runner.invoke(app, ["emulate", "--rate-trace", str(good), "--rate-scale", "0", "--duration", "0.1"])
    assert res.exit_code != 0 and "rate-scale" in res.output, res.output
    res = runner.invoke(app, ["sim", "--rate-trace", str(bad), "--scheme", "heuristic"])
    assert res.exit_code != 0 and "bad.up:3" in res.output, res.output


def test_a_rotated_trace_starts_later_in_the_same_period_and_keeps_every_opportunity() -> None:
    trace = step_trace([10.0, 40.0], 1.0)  # 1 s at 10 Mbit/s, then 1 s at 40
    moved = rotated(trace, 1.0)
    assert moved.period_ms == trace.period_ms and moved.opportunities_ms.size == trace.opportunities_ms.size
    assert moved.mean_rate_bps == pytest.approx(trace.mean_rate_bps)
    first, second = moved.rates_bps(1.0)
    assert first == pytest.approx(40e6, rel=0.02) and second == pytest.approx(10e6, rel=0.02)
    assert rotated(trace, 0.0) is trace and rotated(trace, 2.0) is trace  # a whole period: the same start
