"""The receiver session's states and what moves it between them, as one table (sans-IO, data only).

Theory of operation
-------------------
A session is in exactly one ``ReceiverState``; no flag beside it says where it stands. Whatever can
happen to it is an ``Input``: a message from the sender, a call of the application, a timer, or the early
arm of the deadline. ``ReceiverSession`` first turns what happened into one input, reading its data: an
OFFER part that completes the OFFER is ``OFFER_WHOLE``, a DONE that contradicts what arrived ``BAD_DONE``,
a RESULT timer with its tries spent ``RESULT_GIVE_UP``. The early arm is the check, after each input
that may have made the session ready, of whether it could start before its deadline: ``READY``,
``MISSING`` or ``SPLIT_MISSING``. A split (the application computes the context's front) is the
handoff's kind, set by the application, not a state: it picks which of those the check yields. So are
the OFFER parts held once decoding has closed: they only decide whether a late last part is announced.

``TRANSITIONS[input][state]`` then gives the next state and the ``Action`` the session runs;
``ReceiverSession._fire`` is the one place where the state changes. Every (input, state) pair has its own
entry: ``Action.NOTHING`` where the input changes nothing, ``Action.IMPOSSIBLE`` where the session never
produces it (a timer that state never arms: entering a state disarms them, see ``ARMABLE``).
``check_table`` proves every pair is there, once.

Room for fan-out: a receiver that is one member of a group stream (the agent-graphs issue) adds its
states (joining the group, a member, left) to ``ReceiverState``, its inputs (JOIN, LEAVE) to ``Input``,
and rows for each new pair here; ``check_table`` fails until every new pair is decided.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from pfec.common.events import TableEnum

__all__ = [
    "ARMABLE", "DECODING", "STREAM_OPEN", "TIMER_INPUTS", "TRANSITIONS", "Action", "Input", "ReceiverState",
    "Row", "Timer", "check_table",
]


class ReceiverState(TableEnum):
    OFFER_PARTIAL = "offer_partial"  # decoding; OFFER parts missing: it cannot start before its deadline
    RECEIVING = "receiving"  # decoding, the OFFER whole: it starts at its deadline, or once ready
    DONE_OFFER_PARTIAL = "done_offer_partial"  # decoding; the sender's DONE came before the OFFER was whole
    SENDER_DONE = "sender_done"  # the OFFER whole, the sender's DONE: only a split waits here, for its front
    DEADLINE = "deadline"  # decoding closed (``DeadlineReached`` is out): the application rebuilds
    RESULT_SENT = "result_sent"  # the RESULT repeats until the sender's CLOSE
    CLOSED = "closed"


class Input(TableEnum):
    """What can happen to a session (what each carries to its action in brackets)."""

    # From the sender, once authenticated.
    DATA = "data"  # a SOURCE or REPAIR [the message]
    OFFER_PART = "offer_part"  # an OFFER part not held yet, the OFFER still partial after it [the part]
    OFFER_WHOLE = "offer_whole"  # the last missing OFFER part [the part]
    OFFER_REPEAT = "offer_repeat"  # a part held already
    OFFER_MISMATCH = "offer_mismatch"  # a part of another attempt, or past its part count [drop reason]
    DONE = "done"  # the sender's completion signal, consistent with what arrived
    BAD_DONE = "bad_done"  # a DONE that contradicts what arrived [drop reason]
    CLOSE = "close"  # [the message]
    UNEXPECTED = "unexpected"  # any other message type [drop reason]
    # From the application.
    PLAN = "plan"  # ``set_split`` with the split's token ends
    COMPUTED = "computed"  # ``set_computed`` with more tokens than before [tokens]
    RESULT = "result"  # ``send_result`` [the application's blob]
    REFUSE = "refuse"  # ``refuse`` [(code, text)]
    # Timers.
    DEADLINE = "deadline"
    ACK_TIMER = "ack_timer"  # ``ack_delay_s`` after the first unacknowledged data datagram
    RESULT_RETRY = "result_retry"  # the RESULT timer, tries left
    RESULT_GIVE_UP = "result_give_up"  # the RESULT timer, ``result_retries`` spent (a vanished sender)
    # The deadline's early arm.
    READY = "ready"  # everything still needed is decoded (a split: or computed here)
    MISSING = "missing"  # not a split: source symbols still missing
    SPLIT_MISSING = "split_missing"  # a split: its front, or symbols it still needs, missing


class Action(TableEnum):
    NOTHING = "nothing"
    IMPOSSIBLE = "impossible"  # raises: the session never produces this input in this state
    DECODE = "decode"  # into the decoder, the ACK's bookkeeping, then the early arm
    COUNT_LATE = "count_late"  # data after decoding closed: counted, not decoded
    HOLD_OFFER_PART = "hold_offer_part"
    ANNOUNCE_OFFER = "announce_offer"  # hold the last part, emit ``OfferReceived``, then the early arm
    DROP = "drop"  # a ``DatagramDropped`` with the input's reason
    CHECK_EARLY = "check_early"  # the early arm
    RECORD_COMPUTED = "record_computed"  # the computed tokens: an ACK reports them now, then the early arm
    START_AT_DEADLINE = "start_at_deadline"  # ``DeadlineReached`` (start: deadline)
    START_READY = "start_ready"  # ``DeadlineReached`` (start: ready)
    START_SENDER_DONE = "start_sender_done"  # ``DeadlineReached`` (start: sender-done)
    SEND_ACK = "send_ack"
    SEND_RESULT = "send_result"  # the RESULT's datagrams, its retry timer armed
    RESEND_RESULT = "resend_result"
    CLOSE = "close"  # the sender's CLOSE: ``SessionClosed`` with its reason
    GIVE_UP = "give_up"  # ``SessionClosed``: no CLOSE came after the RESULT
    REFUSE = "refuse"  # a REFUSE, then ``SessionClosed``
    SEND_REFUSE = "send_refuse"  # a REFUSE only (the session closed already)


class Timer(TableEnum):
    """A session's timers, in the order they fire when due together (the deadline first: its ACK
    disarms the ACK timer)."""

    DEADLINE = "deadline"
    ACK = "ack"
    RESULT = "result"


#: The inputs each timer fires.
TIMER_INPUTS: Final[Mapping[Timer, tuple[Input, ...]]] = {
    Timer.DEADLINE: (Input.DEADLINE,),
    Timer.ACK: (Input.ACK_TIMER,),
    Timer.RESULT: (Input.RESULT_RETRY, Input.RESULT_GIVE_UP),
}


@dataclass(frozen=True, slots=True)
class Row:
    next_state: ReceiverState
    action: Action


_S = ReceiverState
_A = Action
#: The states that still decode (the deadline armed); in the first two the sender may still send more.
STREAM_OPEN: Final = frozenset({_S.OFFER_PARTIAL, _S.RECEIVING})
DECODING: Final = STREAM_OPEN | {_S.DONE_OFFER_PARTIAL, _S.SENDER_DONE}
_CLOSED_DECODING: Final = frozenset({_S.DEADLINE, _S.RESULT_SENT, _S.CLOSED})
_DECODING_OFFER_PARTIAL: Final = frozenset({_S.OFFER_PARTIAL, _S.DONE_OFFER_PARTIAL})
_OFFER_WHOLE: Final = DECODING - _DECODING_OFFER_PARTIAL
_MAY_LACK_PARTS: Final = _DECODING_OFFER_PARTIAL | _CLOSED_DECODING  # the deadline may come before the OFFER
_OPEN: Final = frozenset(_S) - {_S.CLOSED}
_NOT_RESULT_SENT: Final = frozenset(_S) - {_S.RESULT_SENT}
_STAY: Final = None  # the next state is the current one


def _rows(*groups: tuple[Iterable[ReceiverState], ReceiverState | None, Action]
          ) -> dict[ReceiverState, Row]:
    """One input's entries: each group of states goes to its next state (``_STAY``: itself)."""
    rows: dict[ReceiverState, Row] = {}
    for states, next_state, action in groups:
        for state in states:
            if state in rows:
                raise ValueError(f"two entries for {state}")
            rows[state] = Row(state if next_state is None else next_state, action)
    return rows


TRANSITIONS: Final[Mapping[Input, Mapping[ReceiverState, Row]]] = {
    # ---------------------------------------------------------------- from the sender
    Input.DATA: _rows(
        (DECODING, _STAY, _A.DECODE),
        (_CLOSED_DECODING, _STAY, _A.COUNT_LATE),
    ),
    Input.OFFER_PART: _rows(
        (_MAY_LACK_PARTS, _STAY, _A.HOLD_OFFER_PART),
        (_OFFER_WHOLE, _STAY, _A.IMPOSSIBLE),  # a whole OFFER holds every part: a part is a repeat
    ),
    Input.OFFER_WHOLE: _rows(
        ((_S.OFFER_PARTIAL,), _S.RECEIVING, _A.ANNOUNCE_OFFER),
        ((_S.DONE_OFFER_PARTIAL,), _S.SENDER_DONE, _A.ANNOUNCE_OFFER),
        (_CLOSED_DECODING, _STAY, _A.ANNOUNCE_OFFER),  # the deadline came first: announced all the same
        (_OFFER_WHOLE, _STAY, _A.IMPOSSIBLE),
    ),
    Input.OFFER_REPEAT: _rows((_S, _STAY, _A.NOTHING)),
    Input.OFFER_MISMATCH: _rows((_S, _STAY, _A.DROP)),
    Input.DONE: _rows(
        ((_S.OFFER_PARTIAL,), _S.DONE_OFFER_PARTIAL, _A.NOTHING),  # it starts once the OFFER is whole
        ((_S.RECEIVING,), _S.SENDER_DONE, _A.CHECK_EARLY),  # not a split: it starts at once
        ((_S.DONE_OFFER_PARTIAL, _S.SENDER_DONE), _STAY, _A.NOTHING),  # a repeat
        (_CLOSED_DECODING, _STAY, _A.NOTHING),  # late: it changes nothing
    ),
    Input.BAD_DONE: _rows(
        (DECODING, _STAY, _A.DROP),
        (_CLOSED_DECODING, _STAY, _A.NOTHING),  # not even checked once decoding closed
    ),
    Input.CLOSE: _rows(
        (_OPEN, _S.CLOSED, _A.CLOSE),
        ((_S.CLOSED,), _STAY, _A.NOTHING),
    ),
    Input.UNEXPECTED: _rows((_S, _STAY, _A.DROP)),
    # ---------------------------------------------------------------- from the application
    Input.PLAN: _rows(
        (DECODING, _STAY, _A.CHECK_EARLY),
        (_CLOSED_DECODING, _STAY, _A.NOTHING),  # the plan is kept; nothing can start any more
    ),
    Input.COMPUTED: _rows(
        (DECODING, _STAY, _A.RECORD_COMPUTED),
        (_CLOSED_DECODING, _STAY, _A.NOTHING),
    ),
    Input.RESULT: _rows(
        (_OPEN, _S.RESULT_SENT, _A.SEND_RESULT),  # before the deadline too: the application decides
        ((_S.CLOSED,), _STAY, _A.NOTHING),
    ),
    Input.REFUSE: _rows(
        (_OPEN, _S.CLOSED, _A.REFUSE),
        ((_S.CLOSED,), _STAY, _A.SEND_REFUSE),
    ),
    # ---------------------------------------------------------------- timers
    Input.DEADLINE: _rows(
        (DECODING, _S.DEADLINE, _A.START_AT_DEADLINE),
        (_CLOSED_DECODING, _STAY, _A.IMPOSSIBLE),
    ),
    Input.ACK_TIMER: _rows(
        (DECODING, _STAY, _A.SEND_ACK),
        ((_S.RESULT_SENT,), _STAY, _A.SEND_ACK),  # a RESULT sent before the deadline leaves it armed
        ((_S.DEADLINE, _S.CLOSED), _STAY, _A.IMPOSSIBLE),  # starting sends what is unacknowledged
    ),
    Input.RESULT_RETRY: _rows(
        ((_S.RESULT_SENT,), _STAY, _A.RESEND_RESULT),
        (_NOT_RESULT_SENT, _STAY, _A.IMPOSSIBLE),
    ),
    Input.RESULT_GIVE_UP: _rows(
        ((_S.RESULT_SENT,), _S.CLOSED, _A.GIVE_UP),
        (_NOT_RESULT_SENT, _STAY, _A.IMPOSSIBLE),
    ),
    # ---------------------------------------------------------------- the deadline's early arm
    Input.READY: _rows(
        (_OFFER_WHOLE, _S.DEADLINE, _A.START_READY),
        (_DECODING_OFFER_PARTIAL, _STAY, _A.NOTHING),  # the application cannot start without the OFFER
        (_CLOSED_DECODING, _STAY, _A.NOTHING),
    ),
    Input.MISSING: _rows(
        ((_S.SENDER_DONE,), _S.DEADLINE, _A.START_SENDER_DONE),  # nothing more will come
        ((_S.OFFER_PARTIAL, _S.RECEIVING, _S.DONE_OFFER_PARTIAL), _STAY, _A.NOTHING),
        (_CLOSED_DECODING, _STAY, _A.NOTHING),
    ),
    Input.SPLIT_MISSING: _rows(
        (DECODING, _STAY, _A.NOTHING),  # after a DONE too: the front computes what the stream left missing
        (_CLOSED_DECODING, _STAY, _A.NOTHING),
    ),
}


def check_table(table: Mapping[Input, Mapping[ReceiverState, Row]] = TRANSITIONS) -> None:
    """Raise ValueError unless ``table`` has exactly one entry for every (input, state) pair."""
    for inp in Input:
        rows = table.get(inp)
        if rows is None:
            raise ValueError(f"no entries for {inp}")
        missing = set(ReceiverState) - set(rows)
        if missing:
            raise ValueError(f"{inp} has no entry for {sorted(s.value for s in missing)}")
    if set(table) - set(Input):
        raise ValueError("entries for inputs that do not exist")


check_table()

#: The timers each state may keep armed: those with an input that is not IMPOSSIBLE there.
ARMABLE: Final[Mapping[ReceiverState, frozenset[Timer]]] = {
    state: frozenset(
        timer for timer, inputs in TIMER_INPUTS.items()
        if any(TRANSITIONS[inp][state].action is not Action.IMPOSSIBLE for inp in inputs)
    )
    for state in ReceiverState
}
