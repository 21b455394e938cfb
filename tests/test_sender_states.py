"""The sender session's state table (sender/transport/states.py), entry by entry, under fake time.

``EXPECTED`` restates what every trigger does in every phase, written apart from the table: a wrong row
fails twice, once against it and once when a real session, driven into the phase and handed the trigger,
ends in another phase or shows another effect.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from pfec.common.sched.policies import DeficitHeuristic, SourceOnly
from pfec.common.wire.frames import peek_header
from pfec.common.wire.handshake import seal_handshake
from pfec.common.wire.keyring import keyring_for
from pfec.common.wire.messages import (
    Accept,
    Ack,
    Close,
    CloseCode,
    DoneReason,
    Message,
    MsgType,
    Refuse,
    RefuseCode,
    Result,
    Role,
)
from pfec.common.wire.seal import PacketProtector
from pfec.sender.transport.probe import PTO_PROBES
from pfec.sender.transport.rate import FixedRate
from pfec.sender.transport.session import (
    CLOCKS,
    Accepted,
    Failed,
    PathBroken,
    Refused,
    ResultReceived,
    SenderConfig,
    SenderSession,
    SenderState,
    SendingStopped,
)
from pfec.sender.transport.states import (
    ARMED,
    INVALID,
    TRANSITIONS,
    Event,
    Ignored,
    Invalid,
    Move,
    Phase,
    Stay,
    Timer,
    Trigger,
)

KEYRING = keyring_for(b"k" * 32)
SID = 0x5157
SYMBOL = 16
N = 40  # sources: all fit in the first flight
R_R = bytes(range(16))  # the receiver's random in its ACCEPT
OTHER_R_R = bytes(range(1, 17))  # a restarted receiver's
SEND_DEADLINE = 1.0 - 0.01  # budget less the one-way delay
BIG_OFFER = b"x" * 4000  # application data that takes several OFFER parts

P = Phase
PHASES = (P.IDLE, P.EARLY_STREAMING, P.STREAMING, P.EARLY_DRAINING, P.DRAINING, P.DONE, P.FAILED)
# Per trigger, in the order of PHASES: "-" ignored; "!" the caller's error; "=" stays, with an effect; a
# phase's name: where it leads.
E, T = Event, Timer
EXPECTED: dict[Trigger, tuple[str, ...]] = {
    E.START: ("EARLY_STREAMING", "!", "!", "!", "!", "!", "!"),
    E.ACCEPT: ("-", "STREAMING", "=", "DRAINING", "=", "=", "="),
    E.REFUSE: ("FAILED", "FAILED", "FAILED", "FAILED", "FAILED", "-", "-"),
    E.ACK: ("-", "-", "=", "-", "=", "-", "-"),
    E.RESULT: ("-", "-", "DONE", "-", "DONE", "-", "-"),
    E.CLOSE: ("-", "-", "FAILED", "-", "FAILED", "-", "-"),
    E.CANCEL: ("FAILED", "FAILED", "FAILED", "FAILED", "FAILED", "-", "-"),
    E.NO_SLOT_LEFT: ("-", "EARLY_DRAINING", "DRAINING", "-", "-", "-", "-"),
    E.PATH_BROKEN: ("-", "EARLY_DRAINING", "DRAINING", "-", "-", "-", "-"),
    E.FINISHED: ("-", "-", "DRAINING", "-", "-", "-", "-"),
    T.OFFER_REPEAT: ("-", "-", "=", "-", "=", "-", "-"),
    T.OFFER_RETRY: ("-", "=", "-", "-", "-", "-", "-"),
    T.HANDSHAKE: ("-", "FAILED", "-", "FAILED", "-", "-", "-"),
    T.SEND_DEADLINE: ("-", "EARLY_DRAINING", "DRAINING", "-", "-", "-", "-"),
    T.PROBE: ("-", "-", "=", "-", "-", "-", "-"),
    T.DONE_REPEAT: ("-", "-", "-", "-", "=", "-", "-"),
    T.RESULT_WAIT: ("-", "-", "-", "FAILED", "FAILED", "-", "-"),
}
CELLS = [(phase, trigger) for trigger in EXPECTED for phase in PHASES]


class Breakable(FixedRate):
    """The configured rate, with a circuit breaker the test trips."""

    def __init__(self, slot_s: float) -> None:
        super().__init__(slot_s)
        self.broken: str | None = None

    def breaker(self, now: float) -> str | None:
        return self.broken


@dataclass
class Rig:
    sender: SenderSession
    rate: Breakable
    receiver: PacketProtector  # seals what the receiver sends under the session keys
    events: list[object] = field(default_factory=list)
    control: list[MsgType] = field(default_factory=list)  # datagrams taken from the queue, by type
    handshake_pn: int = 0  # the last handshake datagram's packet number (0: none yet)

    def events_now(self) -> list[object]:
        while (event := self.sender.next_event()) is not None:
            self.events.append(event)
        return self.events

    def take_control(self) -> list[MsgType]:
        """The control datagrams queued (they go before data), as their types."""
        out = []
        while self.sender._control:
            out.append(peek_header(self.sender._control.popleft()).type)
        return out

    def pump(self, now: float, count: int = 1000) -> None:
        """Up to ``count`` datagrams onto the link at ``now`` (the pacer's calls)."""
        for _ in range(count):
            if self.sender.next_datagram(now) is None:
                return

    def handshake(self, message: Message) -> bytes:
        """A handshake datagram: the first takes packet number 1 (the receiver's session starts at 2), a
        later one the session's next, spent by a datagram never sent (one packet-number space)."""
        pn = 1
        if self.handshake_pn:
            pn = self.receiver.packets_sealed + 1
            self.receiver.seal(Close(CloseCode.DONE))
        self.handshake_pn = pn
        return seal_handshake(KEYRING, Role.RECEIVER, message, SID, pn, bytes(12),
                              self.sender.protector.local_random)

    def deliver(self, message: Message, now: float) -> None:
        """A receiver's message: over the wire when the sender can open it, else past the opening (a
        session-sealed message before the ACCEPT never opens: the row is still checked)."""
        if isinstance(message, Accept | Refuse):
            self.sender.receive_datagram(self.handshake(message), now)
        elif self.sender.accepted:
            self.sender.receive_datagram(self.receiver.seal(message), now)
        else:
            self.sender._handle(message, now)


def make_rig(source_only: bool = False, **overrides: Any) -> Rig:
    settings: dict[str, Any] = dict(budget_s=1.0, slot_s=0.001, owd_s=0.01, repair_budget=16,
                                    fingerprint=b"f" * 32, first_flight=64, result_wait_s=0.5)
    config = SenderConfig(**(settings | overrides))
    rate = Breakable(config.slot_s)
    rows = np.random.default_rng(0).integers(0, 256, size=(N, SYMBOL), dtype=np.uint8)
    policy = SourceOnly() if source_only else DeficitHeuristic()
    protector = PacketProtector(KEYRING, SID, Role.SENDER, SYMBOL, random_bytes=random.Random(1).randbytes)
    sender = SenderSession(SID, config, rows, policy, protector, rate=rate)  # type: ignore[arg-type]
    receiver = PacketProtector(KEYRING, SID, Role.RECEIVER, SYMBOL, local_random=R_R,
                               peer_random=protector.local_random, first_pn=2)
    return Rig(sender, rate, receiver)


# ------------------------------------------------------------------ driving a session into each phase
def accept(rig: Rig, now: float = 0.001) -> None:
    rig.deliver(Accept(16, N, R_R), now)


def streaming(rig: Rig) -> None:
    rig.sender.start(0.0)
    accept(rig)
    rig.pump(0.002, 12)  # the OFFER's last part again, then ten sources


def draining(rig: Rig) -> None:
    streaming(rig)
    rig.sender.handle_timer(SEND_DEADLINE)


def finished(rig: Rig) -> None:
    """DRAINING on the DONE: a source-only stream with every source out (rig made ``source_only``)."""
    streaming(rig)
    rig.pump(0.003)


def early_draining(rig: Rig) -> None:
    rig.sender.start(0.0)
    rig.pump(0.001, 6)
    rig.sender.handle_timer(SEND_DEADLINE)


def done(rig: Rig) -> None:
    streaming(rig)
    rig.deliver(Result(N, 0, 1, b"{}"), 0.01)


def failed(rig: Rig) -> None:
    streaming(rig)
    rig.sender.cancel("gone", 0.01)


DRIVERS: dict[Phase, Callable[[Rig], None]] = {
    P.IDLE: lambda rig: None,
    P.EARLY_STREAMING: lambda rig: rig.sender.start(0.0),
    P.STREAMING: streaming,
    P.EARLY_DRAINING: early_draining,
    P.DRAINING: draining,
    P.DONE: done,
    P.FAILED: failed,
}

# Cells whose trigger needs a session set up apart: (config overrides, source-only policy, driver).
SETUPS: dict[tuple[Phase, Trigger], tuple[dict[str, Any], bool, Callable[[Rig], None] | None]] = {
    (P.STREAMING, E.FINISHED): ({}, True, None),
    (P.EARLY_STREAMING, E.FINISHED): ({}, True, None),
    (P.EARLY_STREAMING, T.HANDSHAKE): ({"handshake_timeout_s": 0.5}, False, None),  # before the send deadline
    (P.EARLY_DRAINING, T.HANDSHAKE): ({"handshake_timeout_s": 1.2}, False, None),  # before the RESULT wait
    (P.STREAMING, T.OFFER_REPEAT): ({"app_blob": BIG_OFFER}, False, None),
    (P.DRAINING, T.OFFER_REPEAT): ({"app_blob": BIG_OFFER}, True, finished),  # before the deadline
    (P.DRAINING, T.DONE_REPEAT): ({}, True, finished),
}


# ------------------------------------------------------------------ delivering each trigger
def deliver(rig: Rig, phase: Phase, trigger: Trigger, now: float) -> None:
    sender = rig.sender
    if isinstance(trigger, Timer):
        due = CLOCKS[trigger](sender)
        if trigger in ARMED[phase]:
            assert due is not None, f"set {trigger} up in {phase}"
            sender.handle_timer(due)
        else:  # not armed in this phase: handle_timer never looks at it; the dispatch must ignore it
            sender._fire(trigger, now)
        return
    if trigger is E.START:
        sender.start(now)
    elif trigger is E.ACCEPT:  # once the keys are set, a restarted receiver's ACCEPT
        rig.deliver(Accept(16, N, OTHER_R_R if sender.accepted else R_R), now)
    elif trigger is E.REFUSE:
        rig.deliver(Refuse(RefuseCode.OVERLOADED, "busy"), now)
    elif trigger is E.ACK:
        sealed = sender.protector.packets_sealed
        rig.deliver(Ack(5, 6, 5, 0, 0, sealed, 0, sealed // 2, 0, 0), now)
    elif trigger is E.RESULT:
        rig.deliver(Result(N, 0, 1, b"{}"), now)
    elif trigger is E.CLOSE:
        rig.deliver(Close(CloseCode.CANCELLED, "bye"), now)
    elif trigger is E.CANCEL:
        sender.cancel("test", now)
    elif not phase.sends:  # a decision epoch's finding: none runs unless the phase sends
        reason: object = {E.PATH_BROKEN: "test", E.FINISHED: DoneReason.NO_REPAIR}.get(trigger)
        sender._fire(trigger, now, reason)
    elif trigger is E.NO_SLOT_LEFT:  # the burst under way goes out, then under one slot is left
        rig.pump(SEND_DEADLINE - 0.0005)
    elif trigger is E.PATH_BROKEN:
        rig.rate.broken = "test"
        rig.pump(now)
    else:  # FINISHED: every source out, a source-only stream has nothing more to send
        rig.pump(now)


# ------------------------------------------------------------------ what each acting row visibly does
def check_effect(rig: Rig, trigger: Trigger, before: Phase, sent: list[MsgType], events: list[object],
                 drops: dict[str, int]) -> None:
    sender = rig.sender
    kinds = [type(event) for event in events if type(event).__name__ != "DatagramDropped"]
    if trigger is E.START:
        assert MsgType.OFFER in sent and sender.get_timer() is not None
    elif trigger is E.ACCEPT and before.awaits_accept:
        assert Accepted in kinds and sender.accepted and MsgType.OFFER in sent
    elif trigger is E.ACCEPT:
        assert drops.get("accept_mismatch") == 1
    elif trigger is E.REFUSE:
        assert kinds == [Refused, Failed]
    elif trigger is E.ACK:
        assert sender.encoder.ack_prefix == 5 and not drops
    elif trigger is E.RESULT:
        assert kinds == [ResultReceived] and MsgType.CLOSE in sent
    elif trigger is E.CLOSE:
        assert kinds == [Failed] and "receiver closed" in events[0].reason  # type: ignore[attr-defined]
    elif trigger is E.CANCEL:
        assert kinds == [Failed] and MsgType.CLOSE in sent
    elif trigger in (E.NO_SLOT_LEFT, T.SEND_DEADLINE):
        assert SendingStopped in kinds
    elif trigger is E.PATH_BROKEN:
        assert kinds[:2] == [PathBroken, SendingStopped]
        assert sender.completion.reason is DoneReason.PATH_BROKEN
    elif trigger is E.FINISHED:
        assert SendingStopped in kinds and MsgType.DONE in sent
        assert sender.completion.reason is DoneReason.NO_REPAIR
    elif trigger in (T.OFFER_RETRY, T.OFFER_REPEAT):
        assert MsgType.OFFER in sent
    elif trigger is T.HANDSHAKE:
        assert kinds == [Failed] and MsgType.CLOSE in sent
        assert "no ACCEPT" in events[-1].reason  # type: ignore[attr-defined]
    elif trigger is T.PROBE:
        assert sender.probe.owed == PTO_PROBES
    elif trigger is T.DONE_REPEAT:
        assert MsgType.DONE in sent
    elif trigger is T.RESULT_WAIT:
        assert kinds == [Failed] and MsgType.CLOSE in sent
        assert "no RESULT" in events[-1].reason  # type: ignore[attr-defined]
    else:
        raise AssertionError(f"no effect check for {trigger}")


# ------------------------------------------------------------------ the tests
def test_the_table_names_every_phase_and_trigger_explicitly() -> None:
    triggers = set(Event) | set(Timer)
    assert set(TRANSITIONS) == set(Phase) == set(PHASES)
    for phase, rows in TRANSITIONS.items():
        assert set(rows) == triggers, (phase, triggers ^ set(rows))
        for trigger, row in rows.items():
            assert isinstance(row, Move | Stay | Ignored | Invalid), (phase, trigger, row)
            if isinstance(row, Move | Stay):
                assert callable(getattr(SenderSession, row.action, None)), row.action
            assert not (isinstance(trigger, Timer) and row is INVALID), (phase, trigger)
    assert set(EXPECTED) == triggers


def test_each_phase_shows_callers_a_sender_state() -> None:
    shown = {phase: phase.public for phase in Phase}
    assert set(shown.values()) == set(SenderState)
    assert shown[P.EARLY_STREAMING] is shown[P.STREAMING] is SenderState.STREAMING
    assert shown[P.EARLY_DRAINING] is shown[P.DRAINING] is SenderState.DRAINING


@pytest.mark.parametrize(("phase", "trigger"), CELLS, ids=[f"{p.name}-{t.name}" for p, t in CELLS])
def test_the_row_says_what_is_expected(phase: Phase, trigger: Trigger) -> None:
    expected = EXPECTED[trigger][PHASES.index(phase)]
    row = TRANSITIONS[phase][trigger]
    said = {Ignored: "-", Invalid: "!", Stay: "="}.get(type(row)) or row.to.name  # type: ignore[union-attr]
    assert said == expected


@pytest.mark.parametrize(("phase", "trigger"), CELLS, ids=[f"{p.name}-{t.name}" for p, t in CELLS])
def test_a_real_session_follows_the_row(phase: Phase, trigger: Trigger) -> None:
    overrides, source_only, driver = SETUPS.get((phase, trigger), ({}, False, None))
    rig = make_rig(source_only, **overrides)
    (driver or DRIVERS[phase])(rig)
    assert rig.sender._phase is phase
    rig.take_control()
    seen = len(rig.events_now())
    drops = dict(rig.sender.drops)
    now = 0.995 if phase.public is SenderState.DRAINING else 0.02  # after the driver's last call
    expected = EXPECTED[trigger][PHASES.index(phase)]
    if expected == "!":
        with pytest.raises(RuntimeError, match="called in state"):
            deliver(rig, phase, trigger, now)
        assert rig.sender._phase is phase
        return
    deliver(rig, phase, trigger, now)
    sent, events = rig.take_control(), rig.events_now()[seen:]
    new_drops = {k: v - drops.get(k, 0) for k, v in rig.sender.drops.items() if v != drops.get(k, 0)}
    if expected == "-":
        assert rig.sender._phase is phase and not sent and not events and not new_drops
        return
    assert rig.sender._phase is (phase if expected == "=" else Phase[expected])
    assert rig.sender.state is rig.sender._phase.public
    check_effect(rig, trigger, phase, sent, events, new_drops)


def test_a_mismatched_accept_moves_nothing() -> None:
    """A guarded move: the ACCEPT for another stream is dropped, and the session keeps waiting."""
    rig = make_rig()
    rig.sender.start(0.0)
    rig.deliver(Accept(16, N + 1, R_R), 0.001)
    assert rig.sender._phase is P.EARLY_STREAMING and rig.sender.drops == {"accept_mismatch": 1}
    assert not rig.sender.accepted


def test_a_result_in_parts_moves_to_done_with_the_last() -> None:
    rig = make_rig()
    streaming(rig)
    rig.deliver(Result(N, 0, 2, b"{"), 0.01)
    assert rig.sender._phase is P.STREAMING
    rig.deliver(Result(N, 1, 2, b"}"), 0.011)
    assert rig.sender._phase is P.DONE
    assert any(isinstance(e, ResultReceived) and e.app_blob == b"{}" for e in rig.events_now())


def test_a_timer_is_armed_exactly_where_its_row_acts() -> None:
    """get_timer reads only the timers the phase arms: an early stream's offer retry, not the probe."""
    rig = make_rig()
    rig.sender.start(0.0)
    assert ARMED[P.EARLY_STREAMING] == (T.OFFER_RETRY, T.HANDSHAKE, T.SEND_DEADLINE)
    assert rig.sender.get_timer() == rig.sender.offer.retry_at
    accept(rig)
    assert T.OFFER_RETRY not in ARMED[P.STREAMING] and rig.sender.offer.retry_at is None
