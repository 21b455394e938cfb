"""The idealised known-rate pacer of the trace cells (lab/sim/known_rate.py) and the queue's delay record."""

from __future__ import annotations

import pytest

from pfec.lab.sim.channel import Bernoulli
from pfec.lab.sim.known_rate import KnownRatePacer
from pfec.lab.sim.rate_trace import TraceQueue, parse_rate_trace, step_trace
from pfec.lab.sim.simulate import SimConfig, prepare, run_scheme

DATAGRAM = 1250  # bytes: 10 kbit


def _pacer(bounded: bool) -> KnownRatePacer:
    trace = step_trace([50.0, 150.0], seconds_each=1.0)
    pacer = KnownRatePacer(trace, 100e6, DATAGRAM, bounded=bounded, rtt_prior_s=0.02)
    pacer.on_packet_sent(0.0, DATAGRAM)
    pacer.on_rtt_measurement(0.02, 0.02, 0.0)  # min RTT 20 ms
    pacer.on_packets_delivered(0.02, 1)
    return pacer


def test_it_paces_at_the_traces_rate_of_a_round_trip_ago() -> None:
    pacer = _pacer(bounded=False)
    assert pacer.pacing_bps == pytest.approx(100e6)  # before two round trips: the told rate
    pacer.on_packet_sent(0.5, DATAGRAM)
    assert pacer.pacing_bps == pytest.approx(50e6, rel=0.02)
    pacer.on_packet_sent(1.015, DATAGRAM)  # the step at 1 s is not a round trip old yet
    assert pacer.pacing_bps == pytest.approx(50e6, rel=0.02)
    pacer.on_packet_sent(1.05, DATAGRAM)
    assert pacer.pacing_bps == pytest.approx(150e6, rel=0.02)


def test_bounded_it_trickles_past_a_round_trip_and_the_extra_in_flight_and_unbounded_it_does_not() -> None:
    bounded, unbounded = _pacer(bounded=True), _pacer(bounded=False)
    for pacer in (bounded, unbounded):
        for i in range(300):  # 50 Mbit/s x 20 ms is 100 datagrams; nothing of these is delivered yet
            pacer.on_packet_sent(0.5 + i * 1e-5, DATAGRAM)
    assert bounded.pacing_bps == pytest.approx(50e6 / 16, rel=0.05)
    assert unbounded.pacing_bps == pytest.approx(50e6, rel=0.02)


def test_in_a_gap_of_the_trace_it_looks_again_within_a_quarter_round_trip() -> None:
    trace = parse_rate_trace(["1", "1000"], "a gap")  # one opportunity, then nothing until 1 s
    pacer = KnownRatePacer(trace, 10e6, DATAGRAM, bounded=False, rtt_prior_s=0.02)
    pacer.on_rtt_measurement(0.02, 0.02, 0.0)
    pacer.on_packet_sent(0.5, DATAGRAM)
    assert pacer.pacing_bps == pytest.approx(8 * DATAGRAM / 0.005)


def test_the_queue_records_each_datagrams_wait() -> None:
    trace = parse_rate_trace([str(ms) for ms in range(1, 11)], "1 per ms")
    queue = TraceQueue(trace, limit_bytes=100_000)
    for _ in range(3):
        queue.send(0.0, 1500)
    assert queue.delays_s == pytest.approx([0.001, 0.002, 0.003])


def test_the_known_rate_schemes_run_on_a_trace_and_are_refused_elsewhere() -> None:
    base = {"loss": Bernoulli(0.0), "rho": 1.2, "tokens": 256, "rate_mbps": 24.0, "rate_control": "path"}
    traced = prepare(SimConfig(**base, rate_trace=step_trace([24.0], 10.0)))  # type: ignore[arg-type]
    oracle = run_scheme(traced, "oracle", 0).recovered_utility
    for name in ("known-rate", "known-rate-unbounded"):
        result = run_scheme(traced, name, 0)
        assert result.scheme == name and 0.5 * oracle < result.recovered_utility <= oracle + 1e-9
        assert result.queue_delay_ms_p95 is not None
    fixed = prepare(SimConfig(**base))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a trace-driven link"):
        run_scheme(fixed, "known-rate", 0)
