"""The sender session's rate-controller seam (sender/transport/rate.py): what a controller hears, what the
session takes from it, and that the default (FixedRate, the configured slot) is today's behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from pfec.common.sched.policies import get_scheme
from pfec.lab.sim.channel import Bernoulli
from pfec.lab.sim.engine import DeadlineScore, SimRun
from pfec.lab.sim.handoff import Handoff, SimConfig, prepare
from pfec.lab.sim.simulate import SIM_FINGERPRINT, SIM_PSK, _links, seeded_random_bytes
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverStats
from pfec.sender.transport.rate import FixedRate, RateController
from pfec.sender.transport.session import SenderSession
from pfec.sender.transport.transfer import SenderSetup, assemble_sender


class Recorder:
    """A controller that paces like FixedRate (``slot_s``) and writes down every report."""

    def __init__(self, slot_s: float) -> None:
        self.slot_s = self.plan_slot_s = slot_s
        self.delivered: list[int] = []
        self.sent: list[int] = []
        self.acked: list[int] = []
        self.lost: list[int] = []
        self.rtts: list[float] = []
        self.written_off: list[int] = []

    def on_packet_sent(self, now: float, size: int) -> None:
        self.sent.append(size)

    def on_packets_acked(self, now: float, count: int) -> None:
        self.acked.append(count)

    def on_packets_lost(self, now: float, count: int) -> None:
        self.lost.append(count)

    def on_rtt_measurement(self, now: float, rtt: float, sent_at: float) -> None:
        self.rtts.append(rtt)

    def on_packets_delivered(self, now: float, count: int) -> None:
        self.delivered.append(count)

    def breaker(self, now: float) -> str | None:
        return None

    def write_off(self, count: int) -> None:
        self.written_off.append(count)


HANDOFF = SimConfig(loss=Bernoulli(0.05), rtt_ms=20, tokens=192, rho=1.0)


def _sender(handoff: Handoff, session_id: int = 7, rate: RateController | None = None) -> SenderSession:
    setup = SenderSetup(scheme=get_scheme("heuristic"), repair_budget=0.15, window_cap=0,
                        fingerprint=SIM_FINGERPRINT, psk=SIM_PSK, result_wait_s=0.5, authenticate=False,
                        random_bytes=seeded_random_bytes(1, 0, "sender"))
    return assemble_sender(session_id, handoff.send_queue("utility"), handoff.budget, setup, rate=rate)


def _drive(handoff: Handoff, sender: SenderSession) -> None:
    endpoint = ReceiverEndpoint(SIM_PSK, SIM_FINGERPRINT, ReceiverConfig(), authenticate=False,
                                random_bytes=seeded_random_bytes(1, 0, "receiver"))

    def at_deadline(event: DeadlineReached) -> DeadlineScore:
        return DeadlineScore(np.zeros(handoff.plan.n_blocks, dtype=np.bool_), 0.0, 0, 0, 0, ReceiverStats())

    SimRun(sender, endpoint, _links(handoff, 0), at_deadline).drive()


def test_fixed_rate_is_the_configured_slot_and_the_default() -> None:
    assert FixedRate(1e-4).slot_s == 1e-4
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="slot_s"):
            FixedRate(bad)
    handoff = prepare(HANDOFF)
    sender = _sender(handoff)
    assert isinstance(sender.rate, FixedRate) and sender.rate.slot_s == sender.config.slot_s


def test_a_controller_hears_every_send_ack_loss_and_rtt_and_changes_nothing_by_listening() -> None:
    handoff = prepare(HANDOFF)
    recorder = Recorder(handoff.budget.slot_s)
    heard, plain = _sender(handoff, rate=recorder), _sender(handoff)
    _drive(handoff, heard)
    _drive(handoff, plain)
    sent = heard.datagrams_sent["source"] + heard.datagrams_sent["repair"]
    assert heard.view.repairs_sent > 0 and len(recorder.sent) == sent
    assert min(recorder.sent) > handoff.plan.symbol_size  # each datagram carries a whole symbol
    acked = sum(recorder.acked)
    assert 0 < acked <= sent and min(recorder.acked) > 0
    assert acked == heard.inflight.acked_source_end + heard.inflight.repairs_acked
    assert sum(recorder.lost) == heard.measured_loss[0] > 0 and min(recorder.lost) > 0
    # The receiver's counts of data datagrams received: their growth, as each ACK reports it.
    assert 0 < sum(recorder.delivered) == heard.path.received <= sent and min(recorder.delivered) > 0
    # The handshake's round trip (OFFER to ACCEPT) first, then the samples the RTT estimate is smoothed
    # from (none below the path's 20 ms).
    assert len(recorder.rtts) > 1 and min(recorder.rtts) >= 0.02
    smoothed = 0.0
    for rtt in recorder.rtts[1:]:
        smoothed = rtt if smoothed == 0 else 0.875 * smoothed + 0.125 * rtt
    assert heard.view.rtt_estimate == smoothed
    # A controller at the configured slot sends exactly what FixedRate sends.
    assert heard.datagrams_sent == plain.datagrams_sent
    for name in ("src_pn", "src_time", "rep_pn", "rep_time", "rep_window"):
        assert np.array_equal(getattr(heard.inflight, name), getattr(plain.inflight, name)), name


def test_the_session_counts_its_slots_with_the_controllers_slot() -> None:
    handoff = prepare(HANDOFF)
    slot = handoff.budget.slot_s
    usual, slower = _sender(handoff), _sender(handoff, rate=Recorder(2 * slot))
    usual.start(0.0)
    slower.start(0.0)
    send_window = usual.config.budget_s - usual.config.owd_s
    assert usual.view.slots_total == int(send_window / slot)
    assert slower.view.slots_total == int(send_window / (2 * slot)) < usual.view.slots_total


def test_one_controller_serves_two_sessions() -> None:
    handoff = prepare(HANDOFF)
    shared = Recorder(handoff.budget.slot_s)
    first, second = _sender(handoff, 7, shared), _sender(handoff, 8, shared)
    _drive(handoff, first)
    _drive(handoff, second)
    data = [s.datagrams_sent["source"] + s.datagrams_sent["repair"] for s in (first, second)]
    assert len(shared.sent) == sum(data) and all(n > 0 for n in data)


def test_an_ended_session_writes_off_once_what_its_receiver_never_counted() -> None:
    """Done (a RESULT) or failed (cancelled mid-stream), a session tells its controller, once, how many of its
    data datagrams no ACK counted as received or lost: those after its last ACK, which will never be
    counted. A controller shared with the next handoff would otherwise keep them in flight (PathRate held
    that handoff under its in-flight cap until it sat idle for a second)."""
    handoff = prepare(HANDOFF)
    done_rate = Recorder(handoff.budget.slot_s)
    done = _sender(handoff, rate=done_rate)
    _drive(handoff, done)
    assert done.state.name == "DONE"
    sent = done.datagrams_sent["source"] + done.datagrams_sent["repair"]
    # The receiver's loss counter also counts control datagrams lost (an OFFER repeat, a DONE), so the
    # difference can fall below zero: nothing is written off then.
    assert done_rate.written_off == [max(0, sent - done.path.received - done.path.lost)]
    done.cancel("late", 100.0)  # already done: nothing more to write off
    assert len(done_rate.written_off) == 1

    cancelled_rate = Recorder(handoff.budget.slot_s)
    cancelled = _sender(handoff, 8, cancelled_rate)
    cancelled.start(0.0)
    for _ in range(40):  # the first flight leaves; no ACK ever comes back
        if cancelled.next_datagram(0.001) is None:
            break
    cancelled.cancel("shutting down", 0.002)
    flight = cancelled.datagrams_sent["source"] + cancelled.datagrams_sent["repair"]
    assert flight > 0 and cancelled_rate.written_off == [flight]
