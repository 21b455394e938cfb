"""The open-loop tail's arithmetic, the loss prior's plumbing (config, simulator) and the sender daemon's
per-receiver loss history. The session-level behaviour is in tests/test_sessions.py."""

from __future__ import annotations

import math

import pytest

from pfec.common.node.config_models import SenderFecConfig
from pfec.common.sched.open_loop_tail import (
    BURST_PRIOR,
    CLOSED_LOOP_RTTS,
    DEFAULT_LOSS_PRIOR,
    FEEDBACK_RTTS,
    HANDSHAKE_RTTS,
    MARGIN_SDS,
    PRIOR_WEIGHT,
    OpenLoopTail,
    tail_rate,
)
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.handoff import SimConfig
from pfec.sender.paths import PathLossPriors
from pfec.sender.transport.session import SenderConfig


def test_tail_rate_covers_the_expected_losses_plus_a_burst_margin() -> None:
    assert tail_rate(0.0, 1.0, 64) == 0.0
    p, b, w = 0.1, 2.0, 64
    assert tail_rate(p, b, w) == pytest.approx((p + MARGIN_SDS * math.sqrt(p * 3 / w)) / (1 - p))
    assert tail_rate(p, b, w) > tail_rate(p, 1.0, w) > p / (1 - p)  # burstier: more margin
    assert tail_rate(p, 1.0, 4 * w) < tail_rate(p, 1.0, w)  # a longer window averages more
    assert tail_rate(0.9, 1.0, 64) == tail_rate(0.5, 1.0, 64)  # clamped


def test_tail_begins_when_feedback_cannot_return_and_uses_the_prior_until_acks_say_more() -> None:
    tail = OpenLoopTail(True, 0.1, rtt_prior=0.2, window=64)
    assert not tail.update(time_left=0.31, rtt_estimate=0.0)
    tail.on_source()
    assert tail.credit == 0.0  # before the tail: the closed loop's business
    assert tail.update(time_left=0.29, rtt_estimate=0.0)  # under 1.5 x the prior's 200 ms
    assert tail.update(time_left=1.0, rtt_estimate=0.0)  # once in, it stays in
    for _ in range(10):
        tail.on_source()
    # Before an ACK measures the loss runs, the rate assumes runs of BURST_PRIOR (a bursty link's).
    assert tail.credit == pytest.approx(10 * tail_rate(0.1, BURST_PRIOR, 64))
    assert tail.take() and tail.credit == pytest.approx(10 * tail_rate(0.1, BURST_PRIOR, 64) - 1)
    # ACK counters pull the loss from the prior towards what they measured.
    tail.on_ack(lost=100, seen=1000, burst=2.0)
    assert tail.loss == pytest.approx((100 + 0.1 * PRIOR_WEIGHT) / (1000 + PRIOR_WEIGHT))
    assert (tail.lost, tail.seen) == (100, 1000)
    tail.on_ack(lost=50, seen=500, burst=2.0)  # a reordered older ACK: the counters stay
    assert (tail.lost, tail.seen) == (100, 1000)
    measured = OpenLoopTail(True, 0.1, rtt_prior=0.2, window=64)
    assert not measured.update(time_left=0.29, rtt_estimate=0.1)  # an RTT sample overrides the prior
    assert measured.update(time_left=0.149, rtt_estimate=0.1)
    assert FEEDBACK_RTTS == 1.5
    off = OpenLoopTail(False, 0.1, rtt_prior=0.2, window=64)
    assert not off.update(time_left=0.0, rtt_estimate=0.0)


def test_before_the_first_ack_the_handshake_decides_whether_any_closed_loop_fits() -> None:
    """No ACK yet: the first can only come HANDSHAKE_RTTS after the start. A send window too short for a
    closed-loop cycle after it and the tail's own 1.5 RTT is open loop from the first source; a longer one
    keeps its closed loop until the usual 1.5 RTT before the send deadline."""
    rtt = 0.2
    whole = (HANDSHAKE_RTTS + CLOSED_LOOP_RTTS + FEEDBACK_RTTS) * rtt  # 1.2 s at 200 ms
    short = OpenLoopTail(True, 0.1, rtt_prior=rtt, window=64)
    assert short.update(time_left=whole - 0.01, rtt_estimate=0.0, since_start=0.0)
    long = OpenLoopTail(True, 0.1, rtt_prior=rtt, window=64)
    assert not long.update(time_left=whole + 0.01, rtt_estimate=0.0, since_start=0.0)
    # Later, still without an ACK: what is left after the first ACK shrinks with the time left.
    assert not long.update(time_left=whole - 0.1 + 0.01, rtt_estimate=0.0, since_start=0.1)
    assert long.update(time_left=whole - 0.1 - 0.01, rtt_estimate=0.0, since_start=0.1)
    # Once an ACK has come (since_start None), only the time left for feedback counts.
    after = OpenLoopTail(True, 0.1, rtt_prior=rtt, window=64)
    assert not after.update(time_left=whole - 0.01, rtt_estimate=rtt)
    assert after.update(time_left=FEEDBACK_RTTS * rtt - 0.01, rtt_estimate=rtt)


def test_loss_prior_is_a_checked_config_field_with_a_default() -> None:
    assert SenderFecConfig().loss_prior == DEFAULT_LOSS_PRIOR
    with pytest.raises(ValueError):
        SenderFecConfig(loss_prior=-0.1)
    cfg = dict(budget_s=1.0, slot_s=1e-4, owd_s=0.01, repair_budget=10, fingerprint=b"f" * 32)
    assert SenderConfig(**cfg).loss_prior == DEFAULT_LOSS_PRIOR  # type: ignore[arg-type]
    for bad in (1.0, -0.01, math.nan):
        with pytest.raises(ValueError, match="loss_prior"):
            SenderConfig(**cfg, loss_prior=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        OpenLoopTail(True, 1.0, 0.1, 64)


def test_the_simulated_sender_knows_the_channels_long_run_loss() -> None:
    ge = parse_loss_spec("ge:0.001,0.5,0.02,0.1")
    assert SimConfig(loss=ge).sender_loss_prior == pytest.approx(ge.mean_loss)  # type: ignore[attr-defined]
    assert SimConfig(loss=parse_loss_spec("bernoulli:0.03")).sender_loss_prior == pytest.approx(0.03)
    assert SimConfig(loss=ge, loss_prior=0.2).sender_loss_prior == 0.2
    with pytest.raises(ValueError, match="loss_prior"):
        SimConfig(loss=ge, loss_prior=1.5)


def test_the_daemon_keeps_a_per_receiver_average_of_the_measured_loss() -> None:
    priors = PathLossPriors(default=0.05, capacity=2)
    a, b, c = "10.0.0.1:7000", "10.0.0.2:7000", "[fd00::3]:7000"
    assert priors.prior(a) == 0.05  # never handed off to
    priors.record(a, lost=20, seen=200)  # the first measurement replaces the default
    assert priors.prior(a) == pytest.approx(0.1)
    priors.record(a, lost=0, seen=1000)  # then an average that moves by WEIGHT per handoff
    assert priors.prior(a) == pytest.approx((1 - PathLossPriors.WEIGHT) * 0.1)
    priors.record(b, lost=5, seen=10)  # too few datagrams to say anything
    assert priors.prior(b) == 0.05
    priors.record(b, lost=-1, seen=500)  # nonsense counters are ignored
    priors.record(b, lost=600, seen=500)
    assert priors.prior(b) == 0.05
    priors.record(b, lost=50, seen=500)
    priors.prior(a)  # a used most recently: b goes first
    priors.record(c, lost=10, seen=500)
    assert priors.prior(b) == 0.05 and priors.prior(a) < 0.1 and priors.prior(c) == pytest.approx(0.02)
    with pytest.raises(ValueError):
        PathLossPriors(default=1.0)
