"""The receiver session's transition table, entry by entry, against real sessions under fake time.

``expected`` below states what each (state, input) pair must do, written apart from the table. For every
pair, a real session (a real sender's handshake with a real endpoint, time moved by hand) is driven into
the state, the input is delivered through the session's public API, and the transitions it went through
(each ``_fire``, recorded) and what the actions did (datagrams, events, counters, timers) are compared with
``expected``. An IMPOSSIBLE pair is checked to be unreachable and to raise.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from pfec.common.events import DatagramDropped
from pfec.common.sched.policies import SourceOnly
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import (
    Accept,
    Close,
    CloseCode,
    Done,
    DoneReason,
    KeyPhase,
    Message,
    MsgType,
    RefuseCode,
    Role,
    Source,
    max_app_chunk,
)
from pfec.common.wire.seal import PacketProtector
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import (
    DeadlineReached,
    OfferReceived,
    ReceiverConfig,
    ReceiverSession,
    ReceiverState,
    SessionClosed,
)
from pfec.receiver.session_states import TRANSITIONS, Action, Input, Row, Timer, check_table
from pfec.sender.transport.session import SenderConfig, SenderSession

PSK = b"k" * 32
FP = b"f" * 32
SID = 0x5EED
SYMBOL = 64
N = 8  # source symbols; stream index i (in each symbol's first 4 bytes) ends at token 16 (i + 1)
TOKENS = 16 * N
ENDS = 16 * (np.arange(N, dtype=np.int64) + 1)
SYMBOLS = np.random.default_rng(0).integers(0, 256, size=(N, SYMBOL), dtype=np.uint8)
SYMBOLS[:, :4] = np.arange(N, dtype=">u4").view(np.uint8).reshape(-1, 4)
CHUNK = max_app_chunk(MsgType.OFFER)
BLOB = bytes(i % 251 for i in range(2 * CHUNK + 10))  # an OFFER of three parts
RESULT_BLOB = b'{"ok": true}'
CONFIG = ReceiverConfig(ack_every=64, result_retries=2)

S, In, A = ReceiverState, Input, Action
OFFER_PARTIAL, RECEIVING, DONE_OFFER_PARTIAL, SENDER_DONE = (
    S.OFFER_PARTIAL, S.RECEIVING, S.DONE_OFFER_PARTIAL, S.SENDER_DONE)
DEADLINE, RESULT_SENT, CLOSED = S.DEADLINE, S.RESULT_SENT, S.CLOSED
DECODING = {OFFER_PARTIAL, RECEIVING, DONE_OFFER_PARTIAL, SENDER_DONE}
EARLY = {In.READY, In.MISSING, In.SPLIT_MISSING}
ENDS_IN_EARLY_ARM = {A.CHECK_EARLY, A.DECODE, A.ANNOUNCE_OFFER, A.RECORD_COMPUTED}
TIMER_OF = {In.DEADLINE: Timer.DEADLINE, In.ACK_TIMER: Timer.ACK, In.RESULT_RETRY: Timer.RESULT,
            In.RESULT_GIVE_UP: Timer.RESULT}
DROP_REASON = {In.OFFER_MISMATCH: "offer_mismatch", In.BAD_DONE: "bad_done", In.UNEXPECTED: "unexpected_type"}


def expected(state: ReceiverState, inp: Input) -> tuple[ReceiverState, Action]:
    """What each pair must do (the module docs of ``session`` and ``session_states`` in rules)."""
    decoding = state in DECODING
    offer_whole = state in (RECEIVING, SENDER_DONE)  # the states where the OFFER is known to be whole
    stay = state
    if inp is In.DATA:  # decoded while decoding is open, counted late after
        return stay, A.DECODE if decoding else A.COUNT_LATE
    if inp is In.OFFER_PART:
        return stay, A.IMPOSSIBLE if offer_whole else A.HOLD_OFFER_PART
    if inp is In.OFFER_WHOLE:  # announced in any state; decoding moves on to its OFFER-whole twin
        return (stay, A.IMPOSSIBLE) if offer_whole else (
            {OFFER_PARTIAL: RECEIVING, DONE_OFFER_PARTIAL: SENDER_DONE}.get(state, state), A.ANNOUNCE_OFFER)
    if inp is In.OFFER_REPEAT or inp is In.SPLIT_MISSING:
        return stay, A.NOTHING
    if inp in (In.OFFER_MISMATCH, In.UNEXPECTED):
        return stay, A.DROP
    if inp is In.DONE:  # remembered as a state while decoding; with the OFFER whole it may start at once
        return {OFFER_PARTIAL: (DONE_OFFER_PARTIAL, A.NOTHING), RECEIVING: (SENDER_DONE, A.CHECK_EARLY)}.get(
            state, (stay, A.NOTHING))
    if inp is In.BAD_DONE:
        return stay, A.DROP if decoding else A.NOTHING
    if inp is In.CLOSE:
        return (stay, A.NOTHING) if state is CLOSED else (CLOSED, A.CLOSE)
    if inp is In.PLAN:
        return stay, A.CHECK_EARLY if decoding else A.NOTHING
    if inp is In.COMPUTED:
        return stay, A.RECORD_COMPUTED if decoding else A.NOTHING
    if inp is In.RESULT:
        return (stay, A.NOTHING) if state is CLOSED else (RESULT_SENT, A.SEND_RESULT)
    if inp is In.REFUSE:
        return (stay, A.SEND_REFUSE) if state is CLOSED else (CLOSED, A.REFUSE)
    if inp is In.DEADLINE:
        return (DEADLINE, A.START_AT_DEADLINE) if decoding else (stay, A.IMPOSSIBLE)
    if inp is In.ACK_TIMER:
        return stay, A.SEND_ACK if decoding or state is RESULT_SENT else A.IMPOSSIBLE
    if inp is In.RESULT_RETRY:
        return stay, A.RESEND_RESULT if state is RESULT_SENT else A.IMPOSSIBLE
    if inp is In.RESULT_GIVE_UP:
        return (CLOSED, A.GIVE_UP) if state is RESULT_SENT else (stay, A.IMPOSSIBLE)
    if inp is In.READY:  # no start without the whole OFFER, nor once decoding closed
        return (DEADLINE, A.START_READY) if offer_whole else (stay, A.NOTHING)
    assert inp is In.MISSING
    return (DEADLINE, A.START_SENDER_DONE) if state is SENDER_DONE else (stay, A.NOTHING)


PAIRS = [(state, inp) for state in ReceiverState for inp in Input]
REACHABLE = [p for p in PAIRS if expected(*p)[1] is not A.IMPOSSIBLE]
UNREACHABLE = [p for p in PAIRS if expected(*p)[1] is A.IMPOSSIBLE]


def _id(pair: tuple[ReceiverState, Input]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


# ------------------------------------------------------------------------------------------ the rig


@dataclass
class Rig:
    session: ReceiverSession
    now: float
    pn: int = 100
    chain: list[tuple[ReceiverState, Input, int]] = field(default_factory=list)  # (state, input, unacked)

    def send(self, message: Message) -> None:
        self.pn += 1
        self.session.handle_message(self.pn, message, self.now)

    def part(self, index: int) -> Message:
        return replace(self.session.offer, part_index=index, app=BLOB[index * CHUNK:(index + 1) * CHUNK])

    def done(self) -> Done:  # consistent with what arrived: every source, its last data packet before it
        return Done(N, self.session.stats.received["repair"], self.pn, DoneReason.NO_REPAIR)

    def missing(self) -> list[int]:
        return sorted(set(range(N)) - set(self.session.decoder.decoded_esis().tolist()))

    def fire_timer(self, which: Timer) -> None:
        due = self.session.timer(which)
        assert due is not None, which
        self.now = max(self.now, due)
        self.session.handle_timer(self.now)

    def drain(self) -> tuple[list[Any], list[MsgType]]:
        events = list(iter(self.session.next_event, None))
        return events, [peek_header(d).type for d in self.session.datagrams_to_send()]

    def record(self) -> None:
        """Record every ``_fire`` from now on: (state before, input, unacknowledged data datagrams)."""
        session, real = self.session, self.session._fire

        def spy(inp: Input, now: float, arg: object = None) -> None:
            self.chain.append((session.state, inp, session._unacked))
            real(inp, now, arg)

        session._fire = spy  # type: ignore[method-assign]


def open_rig(missing_parts: int) -> Rig:
    """A real handshake in fake time: only OFFER part 0 and the first session-key SOURCE reach the
    endpoint; then parts 1 and 2 are handed to the session unless ``missing_parts`` withholds them."""
    protector = PacketProtector(PSK, SID, Role.SENDER, SYMBOL, random_bytes=random.Random(1).randbytes)
    sender = SenderSession(SID, SenderConfig(budget_s=0.3, slot_s=1e-4, owd_s=0.005, repair_budget=0,
                                             fingerprint=FP, window_cap=4, app_blob=BLOB, result_wait_s=0.5,
                                             first_flight=4), SYMBOLS, SourceOnly(), protector)
    endpoint = ReceiverEndpoint(PSK, FP, CONFIG, random_bytes=random.Random(2).randbytes)
    sender.start(0.0)
    now, offers = 0.0, 0
    while SID not in endpoint.sessions:
        assert now < 0.1, "no handshake"
        while (datagram := sender.next_datagram(now)) is not None:
            header = peek_header(datagram)
            if header.phase is KeyPhase.HANDSHAKE:
                offers += 1
                if offers == 1:
                    endpoint.receive_datagram(datagram, now)
            elif header.phase is KeyPhase.SESSION and header.type is MsgType.SOURCE:
                endpoint.receive_datagram(datagram, now)
                break
        for _sid, reply in endpoint.datagrams_to_send():
            sender.receive_datagram(reply, now)
        now += 1e-4
    rig = Rig(endpoint.sessions[SID], now)
    assert rig.session.offer.part_count == 3 and rig.session.decoder.decoded_count == 1
    for index in range(1, 3 - missing_parts):
        rig.send(rig.part(index))
    return rig


def reach(state: ReceiverState, missing_parts: int | None = None, split: bool = False, decoded: int = 1,
          early_result: bool = False, retried: bool = False) -> Rig:
    """A session in ``state``: with OFFER parts missing (OFFER_PARTIAL, DONE_OFFER_PARTIAL: two by
    default), a split plan (SENDER_DONE always: only a split stays there), ``decoded`` sources, the RESULT
    sent before the deadline, or its timer fired once."""
    if missing_parts is None:
        missing_parts = 2 if state in (OFFER_PARTIAL, DONE_OFFER_PARTIAL) else 0
    rig = open_rig(missing_parts)
    session = rig.session
    if split or state is SENDER_DONE:
        session.set_split(ENDS, TOKENS, 0, rig.now)
    for esi in rig.missing()[: decoded - session.decoder.decoded_count]:
        rig.send(Source(esi, SYMBOLS[esi]))
    if state in (DONE_OFFER_PARTIAL, SENDER_DONE):
        rig.send(rig.done())
    if state in (DEADLINE, RESULT_SENT) and not early_result:
        rig.fire_timer(Timer.DEADLINE)
    if state is RESULT_SENT:
        session.send_result(RESULT_BLOB, rig.now)
        if retried:
            rig.fire_timer(Timer.RESULT)
    if state is CLOSED:
        rig.send(Close(CloseCode.DONE, "bye"))
    assert session.state is state, (session.state, state)
    rig.drain()
    return rig


def _timer(which: Timer) -> Callable[[Rig], None]:
    return lambda rig: rig.fire_timer(which)


def _send(make: Callable[[Rig], Message]) -> Callable[[Rig], None]:
    return lambda rig: rig.send(make(rig))


DELIVER: dict[Input, Callable[[Rig], None]] = {
    In.DATA: _send(lambda rig: Source((rig.missing() or [0])[0], SYMBOLS[(rig.missing() or [0])[0]])),
    In.OFFER_PART: _send(lambda rig: rig.part(1)),
    In.OFFER_WHOLE: _send(lambda rig: rig.part(2)),
    In.OFFER_REPEAT: _send(lambda rig: rig.part(0)),
    In.OFFER_MISMATCH: _send(lambda rig: replace(rig.session.offer, n_source=N + 1)),
    In.DONE: _send(lambda rig: rig.done()),
    In.BAD_DONE: _send(lambda rig: replace(rig.done(), sources_sent=N + 1)),
    In.CLOSE: _send(lambda rig: Close(CloseCode.DONE, "bye")),
    In.UNEXPECTED: _send(lambda rig: Accept(4, N)),
    In.PLAN: lambda rig: rig.session.set_split(ENDS, TOKENS, 0, rig.now),
    In.COMPUTED: lambda rig: rig.session.set_computed(16, rig.now),
    In.RESULT: lambda rig: rig.session.send_result(RESULT_BLOB, rig.now),
    In.REFUSE: lambda rig: rig.session.refuse(RefuseCode.OTHER, "no room"),
    **{inp: _timer(timer) for inp, timer in TIMER_OF.items()},
}


def scenario(state: ReceiverState, inp: Input) -> tuple[Rig, Callable[[Rig], None]]:
    """A session and a public input whose transitions include (``state``, ``inp``). The early arm has no
    input of its own: a datagram (or, once decoding closed, the OFFER's last part) sets it off."""
    kw: dict[str, Any] = {
        "missing_parts": {In.OFFER_PART: 2, In.OFFER_WHOLE: 1}.get(inp),
        "split": inp in (In.COMPUTED, In.SPLIT_MISSING),
        "early_result": inp is In.ACK_TIMER and state is RESULT_SENT,
        "retried": inp is In.RESULT_GIVE_UP,
    }
    if inp not in EARLY:
        return reach(state, **kw), DELIVER[inp]
    if state not in DECODING:
        kw["missing_parts"], kw["decoded"] = 1, N if inp is In.READY else 1
        return reach(state, **kw), DELIVER[In.OFFER_WHOLE]
    if state is SENDER_DONE and inp is In.MISSING:  # not a split: it leaves SENDER_DONE as it enters
        return reach(RECEIVING), DELIVER[In.DONE]
    kw["decoded"] = N - 1 if inp is In.READY else 1
    return reach(state, **kw), DELIVER[In.DATA]


# ------------------------------------------------------------------------------------------ effects


@dataclass
class Effects:
    datagrams: Counter[MsgType] = field(default_factory=Counter)
    events: list[tuple[str, object]] = field(default_factory=list)
    late: int = 0
    decoded_inputs: int = 0


def expected_effects(chain: list[tuple[ReceiverState, Input, int]]) -> Effects:
    """What the actions along ``chain`` must have done, from ``expected``'s action of each step."""
    out = Effects()
    for state, inp, unacked in chain:
        action = expected(state, inp)[1]
        if action is A.DECODE:
            out.decoded_inputs += 1
        elif action is A.COUNT_LATE:
            out.late += 1
        elif action is A.ANNOUNCE_OFFER:
            out.events.append(("offer", BLOB))
        elif action is A.DROP:
            out.events.append(("dropped", DROP_REASON[inp]))
        elif action in (A.SEND_ACK, A.RECORD_COMPUTED):
            out.datagrams[MsgType.ACK] += 1
        elif action in (A.START_AT_DEADLINE, A.START_READY, A.START_SENDER_DONE):
            out.datagrams[MsgType.ACK] += unacked > 0  # what was not acknowledged yet goes out first
            start = {A.START_AT_DEADLINE: "deadline", A.START_READY: "ready"}.get(action, "sender-done")
            out.events.append(("start", start))
        elif action in (A.SEND_RESULT, A.RESEND_RESULT):
            out.datagrams[MsgType.RESULT] += 1
        elif action in (A.REFUSE, A.SEND_REFUSE):
            out.datagrams[MsgType.REFUSE] += 1
        if action in (A.CLOSE, A.GIVE_UP, A.REFUSE):
            prefix = {A.CLOSE: "sender closed", A.GIVE_UP: "no CLOSE"}.get(action, "refused")
            out.events.append(("closed", prefix))
    return out


def seen_effects(rig: Rig, before: tuple[int, int], events: list[Any], types: list[MsgType]) -> Effects:
    out = Effects(Counter(types))
    for event in events:
        if isinstance(event, OfferReceived):
            out.events.append(("offer", event.app_blob))
        elif isinstance(event, DatagramDropped):
            out.events.append(("dropped", event.reason))
        elif isinstance(event, DeadlineReached):
            out.events.append(("start", event.start))
        else:
            assert isinstance(event, SessionClosed)
            prefix = next(p for p in ("sender closed", "no CLOSE", "refused") if event.reason.startswith(p))
            out.events.append(("closed", prefix))
    stats = rig.session.stats
    out.late = stats.late - before[0]
    out.decoded_inputs = stats.received["source"] + stats.received["repair"] - before[1]
    return out


# ------------------------------------------------------------------------------------------ the tests


def test_the_table_has_one_entry_per_pair_and_each_is_the_expected_one() -> None:
    check_table()
    wrong = {_id(p): (TRANSITIONS[p[1]][p[0]], Row(*expected(*p))) for p in PAIRS
             if TRANSITIONS[p[1]][p[0]] != Row(*expected(*p))}
    assert not wrong
    assert set(ReceiverSession._ACTIONS) == set(Action) - {Action.NOTHING, Action.IMPOSSIBLE}


def test_a_table_missing_a_pair_is_refused() -> None:
    short = {inp: dict(rows) for inp, rows in TRANSITIONS.items()}
    del short[In.DONE][RECEIVING]
    with pytest.raises(ValueError, match=r"DONE has no entry for \['receiving'\]"):
        check_table(short)
    with pytest.raises(ValueError, match="no entries"):
        check_table({inp: rows for inp, rows in TRANSITIONS.items() if inp is not In.PLAN})


@pytest.mark.parametrize("pair", REACHABLE, ids=_id)
def test_each_entry_moves_a_real_session_and_does_its_action(pair: tuple[ReceiverState, Input]) -> None:
    state, inp = pair
    rig, deliver = scenario(state, inp)
    rig.record()
    before = (rig.session.stats.late,
              rig.session.stats.received["source"] + rig.session.stats.received["repair"])
    deliver(rig)
    chain = rig.chain
    assert (state, inp) in [(s, i) for s, i, _ in chain], chain
    # Each step's next state is the state the following step (fired by its action) starts from.
    # The actions that end in the deadline's early arm fire one of its inputs next.
    for (s, i, _), (next_from, next_input, _u) in itertools.pairwise([*chain, (None, None, 0)]):
        if next_from is not None:
            assert expected(s, i)[0] is next_from, (s, i, next_from)
        assert (next_input in EARLY) == (expected(s, i)[1] in ENDS_IN_EARLY_ARM), (s, i, next_input)
    assert rig.session.state is expected(*chain[-1][:2])[0]
    events, types = rig.drain()
    assert seen_effects(rig, before, events, types) == expected_effects(chain)
    actions = {expected(s, i)[1] for s, i, _ in chain}
    session = rig.session
    if A.RECORD_COMPUTED in actions:
        assert session.computed_tokens == 16
    if actions & {A.SEND_RESULT, A.RESEND_RESULT}:
        assert session.timer(Timer.RESULT) == pytest.approx(rig.now + CONFIG.result_retry_s)
    if actions & {A.START_AT_DEADLINE, A.START_READY, A.START_SENDER_DONE}:
        assert session.deadline_timer() is None and session.timer(Timer.ACK) is None
    if session.closed:
        assert session.get_timer() is None


@pytest.mark.parametrize("pair", UNREACHABLE, ids=_id)
def test_an_impossible_entry_is_never_produced_and_raises(pair: tuple[ReceiverState, Input]) -> None:
    state, inp = pair
    if inp in TIMER_OF:  # a timer never armed in this state
        variants: list[dict[str, Any]] = [{}, {"early_result": True}] if state is RESULT_SENT else [{}]
        for kw in variants:
            rig = reach(state, **kw)
            assert rig.session.timer(TIMER_OF[inp]) is None, kw
    else:  # an OFFER part while the OFFER is whole: every part is a repeat
        assert inp in (In.OFFER_PART, In.OFFER_WHOLE)
        rig = reach(state)
        rig.record()
        for index in range(3):
            rig.send(rig.part(index))
        assert [i for _s, i, _u in rig.chain] == [In.OFFER_REPEAT] * 3
    with pytest.raises(RuntimeError, match=f"no {inp.name} in state {state.name}"):
        rig.session._fire(inp, rig.now)
    assert rig.session.state is state
