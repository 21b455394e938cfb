"""The sender session's states and what moves it between them, as one table (h11's ``_state.py``).

The lifecycle
-------------
- ``start(now)`` queues the OFFER (the receiver's time budget, never a timestamp; the sender's fresh R_s)
  and streams at once (EARLY_STREAMING): a first flight of at most ``first_flight`` data datagrams (about
  one bandwidth-delay product) follows the OFFER under the sender's early key without waiting a round
  trip, because the deadline counts from the first transmission. Then the session waits for the
  receiver's ACCEPT (its R_r, and the R_s it authenticates), repeating the OFFER every ``offer_retry_s``;
  the ACCEPT gives the session keys (:mod:`pfec.common.wire.seal`) and streaming goes on under them
  (STREAMING). Without an ACCEPT by ``start + handshake_timeout_s`` the session fails and queues a CLOSE.
  Right after the ACCEPT the session sends the OFFER's last part again under the session key: the
  receiver establishes the session on it even when no data is left to send.
- Once it will send nothing more the receiver could use (every source out, and all decoded, its repair
  cap spent, or no closed-loop repair in its scheme) it stops (DRAINING) and sends a DONE (the completion
  signal, :mod:`.completion`), on which the receiver starts generating rather than at its deadline.
- With no slot left before the deadline it stops sending data (DRAINING, or EARLY_DRAINING while the
  ACCEPT is still awaited) and waits for the RESULT, answered with CLOSE (DONE); none by ``deadline +
  result_wait_s``: it fails with a reason. Giving up (no ACCEPT, no RESULT, ``cancel``) it queues a CLOSE
  for the receiver first.

Theory of operation
-------------------
A session is in one ``Phase``. What can happen to it is a trigger: an ``Event`` (a call, a message from
the receiver, what a decision epoch finds) or a ``Timer`` coming due. ``TRANSITIONS`` names, for every
phase and every trigger, what follows:

- ``Move(to, action)``: the session runs ``action`` (one of its methods); unless the action returns False
  (its input dropped, or a RESULT still incomplete) the session is then in ``to``;
- ``Stay(action)``: the action runs in place; what it finds may be an event of its own (an ACK showing
  a split's receiver lacks nothing raises FINISHED);
- ``IGNORED``: nothing happens; ``INVALID``: the caller's mistake (RuntimeError).

The session changes phase nowhere else and never tests a phase by name: it reads the rows and each
phase's traits (the state callers see, whether it sends data, whether it awaits the ACCEPT). A timer is
armed exactly in the phases whose row for it is not ``IGNORED``; ``handle_timer`` fires the armed ones
that are due, in ``Timer`` order. Before the ACCEPT the sender holds no session keys, so the receiver's
ACK, RESULT and CLOSE (sealed under them) cannot reach it: those rows are ``IGNORED``.

Room to grow: the fan-out states (one stream to several receivers) are new ``Phase`` members with their
traits and a block of rows each, and a new trigger is a new entry in every block; no session branch
changes. A test (tests/test_sender_states.py) walks every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypeAlias

from pfec.common.events import TableEnum
from pfec.sender.transport.session_types import SenderState


class Phase(TableEnum):
    """Where a sender session stands: a ``SenderState`` callers see, refined where the ACCEPT matters."""

    # (label, the state callers see, sends data, awaits the ACCEPT)
    IDLE = ("idle", SenderState.IDLE, False, False)
    EARLY_STREAMING = ("early_streaming", SenderState.STREAMING, True, True)  # the first flight, early key
    STREAMING = ("streaming", SenderState.STREAMING, True, False)
    EARLY_DRAINING = ("early_draining", SenderState.DRAINING, False, True)  # stopped with no ACCEPT yet
    DRAINING = ("draining", SenderState.DRAINING, False, False)  # stopped; waits for the RESULT
    DONE = ("done", SenderState.DONE, False, False)
    FAILED = ("failed", SenderState.FAILED, False, False)

    def __init__(self, label: str, public: SenderState, sends: bool, awaits_accept: bool) -> None:
        self.label = label
        self.public = public  # what ``SenderSession.state`` says (daemons, metrics and tests read it)
        self.sends = sends  # the pacer's calls may send data (the decision epochs run)
        self.awaits_accept = awaits_accept  # no session keys yet: data stops at the first flight


class Event(TableEnum):
    """What happens to a session: a call, a message from the receiver, what a decision epoch finds."""

    START = "start()"
    ACCEPT = "ACCEPT"
    REFUSE = "REFUSE"
    ACK = "ACK"
    RESULT = "RESULT"  # one part; the move goes through with the part that completes it
    CLOSE = "CLOSE"
    CANCEL = "cancel()"
    NO_SLOT_LEFT = "no slot left"  # a decision epoch finds no slot before the send deadline
    PATH_BROKEN = "path broken"  # a decision epoch finds the rate controller's circuit breaker tripped
    FINISHED = "finished"  # nothing more the receiver could use (a DoneReason: :mod:`.completion`)


class Timer(TableEnum):
    """The session's timers, in the order ``handle_timer`` fires those due (one may disarm the next)."""

    OFFER_REPEAT = "offer repeat"  # a multi-part OFFER again after the ACCEPT (:mod:`.offer`)
    OFFER_RETRY = "offer retry"  # the OFFER again until the ACCEPT
    HANDSHAKE = "handshake timeout"  # no ACCEPT by start + handshake_timeout_s
    SEND_DEADLINE = "send deadline"  # the last datagram must leave by the deadline less the one-way delay
    PROBE = "probe timeout"  # feedback that does not come (:mod:`.probe`)
    DONE_REPEAT = "done repeat"  # the DONE again a round trip later (:mod:`.completion`)
    RESULT_WAIT = "result wait"  # no RESULT by the deadline plus result_wait_s


Trigger: TypeAlias = Event | Timer


@dataclass(frozen=True, slots=True)
class Move:
    to: Phase
    action: str  # a SenderSession method (now, the trigger's input) -> whether the move goes through


@dataclass(frozen=True, slots=True)
class Stay:
    action: str


@dataclass(frozen=True, slots=True)
class Ignored:
    pass


@dataclass(frozen=True, slots=True)
class Invalid:
    pass


Row: TypeAlias = Move | Stay | Ignored | Invalid
IGNORED: Final = Ignored()
INVALID: Final = Invalid()

_FAIL_ON_REFUSE, _FAIL_ON_CANCEL = Move(Phase.FAILED, "_refused"), Move(Phase.FAILED, "_cancelled")
_ENDED: dict[Trigger, Row] = {  # DONE and FAILED alike: a late ACCEPT is checked, all else ignored
    Event.START: INVALID,
    Event.ACCEPT: Stay("_check_accept"),  # with the keys set, one naming another R_r is dropped
    Event.REFUSE: IGNORED,
    Event.ACK: IGNORED,
    Event.RESULT: IGNORED,
    Event.CLOSE: IGNORED,
    Event.CANCEL: IGNORED,
    Event.NO_SLOT_LEFT: IGNORED,
    Event.PATH_BROKEN: IGNORED,
    Event.FINISHED: IGNORED,
    Timer.OFFER_REPEAT: IGNORED,
    Timer.OFFER_RETRY: IGNORED,
    Timer.HANDSHAKE: IGNORED,
    Timer.SEND_DEADLINE: IGNORED,
    Timer.PROBE: IGNORED,
    Timer.DONE_REPEAT: IGNORED,
    Timer.RESULT_WAIT: IGNORED,
}

TRANSITIONS: Final[dict[Phase, dict[Trigger, Row]]] = {
    Phase.IDLE: {
        Event.START: Move(Phase.EARLY_STREAMING, "_begin"),  # the OFFER and the first flight go at once
        Event.ACCEPT: IGNORED,  # no OFFER is out yet
        Event.REFUSE: _FAIL_ON_REFUSE,
        Event.ACK: IGNORED,  # no session keys (see the module doc)
        Event.RESULT: IGNORED,
        Event.CLOSE: IGNORED,
        Event.CANCEL: _FAIL_ON_CANCEL,
        Event.NO_SLOT_LEFT: IGNORED,  # no decision epochs before start()
        Event.PATH_BROKEN: IGNORED,
        Event.FINISHED: IGNORED,
        Timer.OFFER_REPEAT: IGNORED,
        Timer.OFFER_RETRY: IGNORED,
        Timer.HANDSHAKE: IGNORED,
        Timer.SEND_DEADLINE: IGNORED,
        Timer.PROBE: IGNORED,
        Timer.DONE_REPEAT: IGNORED,
        Timer.RESULT_WAIT: IGNORED,
    },
    Phase.EARLY_STREAMING: {
        Event.START: INVALID,
        Event.ACCEPT: Move(Phase.STREAMING, "_take_accept"),  # a mismatched one is dropped: no move
        Event.REFUSE: _FAIL_ON_REFUSE,
        Event.ACK: IGNORED,  # no session keys
        Event.RESULT: IGNORED,
        Event.CLOSE: IGNORED,
        Event.CANCEL: _FAIL_ON_CANCEL,
        Event.NO_SLOT_LEFT: Move(Phase.EARLY_DRAINING, "_stop_sending"),
        Event.PATH_BROKEN: Move(Phase.EARLY_DRAINING, "_path_broken"),
        Event.FINISHED: IGNORED,  # a DONE needs the session keys: the sender is done only after the ACCEPT
        Timer.OFFER_REPEAT: IGNORED,  # repeats start at the ACCEPT
        Timer.OFFER_RETRY: Stay("_retry_offer"),
        Timer.HANDSHAKE: Move(Phase.FAILED, "_handshake_timeout"),
        Timer.SEND_DEADLINE: Move(Phase.EARLY_DRAINING, "_stop_sending"),
        Timer.PROBE: IGNORED,  # probing needs feedback, which needs the ACCEPT
        Timer.DONE_REPEAT: IGNORED,
        Timer.RESULT_WAIT: IGNORED,
    },
    Phase.STREAMING: {
        Event.START: INVALID,
        Event.ACCEPT: Stay("_check_accept"),
        Event.REFUSE: _FAIL_ON_REFUSE,
        Event.ACK: Stay("_take_ack"),  # may raise FINISHED (a split's receiver lacks nothing)
        Event.RESULT: Move(Phase.DONE, "_take_result"),
        Event.CLOSE: Move(Phase.FAILED, "_closed"),
        Event.CANCEL: _FAIL_ON_CANCEL,
        Event.NO_SLOT_LEFT: Move(Phase.DRAINING, "_stop_sending"),
        Event.PATH_BROKEN: Move(Phase.DRAINING, "_path_broken"),
        Event.FINISHED: Move(Phase.DRAINING, "_finish"),  # stop, and say so with a DONE
        Timer.OFFER_REPEAT: Stay("_repeat_offer"),
        Timer.OFFER_RETRY: IGNORED,  # the ACCEPT disarmed it
        Timer.HANDSHAKE: IGNORED,
        Timer.SEND_DEADLINE: Move(Phase.DRAINING, "_stop_sending"),
        Timer.PROBE: Stay("_probe"),
        Timer.DONE_REPEAT: IGNORED,  # no DONE while sending
        Timer.RESULT_WAIT: IGNORED,  # armed when sending stops
    },
    Phase.EARLY_DRAINING: {
        Event.START: INVALID,
        Event.ACCEPT: Move(Phase.DRAINING, "_take_accept"),
        Event.REFUSE: _FAIL_ON_REFUSE,
        Event.ACK: IGNORED,  # no session keys
        Event.RESULT: IGNORED,
        Event.CLOSE: IGNORED,
        Event.CANCEL: _FAIL_ON_CANCEL,
        Event.NO_SLOT_LEFT: IGNORED,  # sending stopped: no decision epochs
        Event.PATH_BROKEN: IGNORED,
        Event.FINISHED: IGNORED,
        Timer.OFFER_REPEAT: IGNORED,
        Timer.OFFER_RETRY: IGNORED,  # stopping disarmed it
        Timer.HANDSHAKE: Move(Phase.FAILED, "_handshake_timeout"),
        Timer.SEND_DEADLINE: IGNORED,
        Timer.PROBE: IGNORED,
        Timer.DONE_REPEAT: IGNORED,  # a DONE needs the session keys: none went
        Timer.RESULT_WAIT: Move(Phase.FAILED, "_result_timeout"),
    },
    Phase.DRAINING: {
        Event.START: INVALID,
        Event.ACCEPT: Stay("_check_accept"),
        Event.REFUSE: _FAIL_ON_REFUSE,
        Event.ACK: Stay("_take_ack"),
        Event.RESULT: Move(Phase.DONE, "_take_result"),
        Event.CLOSE: Move(Phase.FAILED, "_closed"),
        Event.CANCEL: _FAIL_ON_CANCEL,
        Event.NO_SLOT_LEFT: IGNORED,
        Event.PATH_BROKEN: IGNORED,
        Event.FINISHED: IGNORED,  # already stopped
        Timer.OFFER_REPEAT: Stay("_repeat_offer"),  # the receiver needs the OFFER's data until it starts
        Timer.OFFER_RETRY: IGNORED,
        Timer.HANDSHAKE: IGNORED,
        Timer.SEND_DEADLINE: IGNORED,
        Timer.PROBE: IGNORED,
        Timer.DONE_REPEAT: Stay("_repeat_done"),
        Timer.RESULT_WAIT: Move(Phase.FAILED, "_result_timeout"),
    },
    Phase.DONE: _ENDED,
    Phase.FAILED: _ENDED,
}

INITIAL: Final = Phase.IDLE


def acts(phase: Phase, trigger: Trigger) -> bool:
    """Whether ``trigger`` does anything in ``phase`` (its row is not ``IGNORED``)."""
    return TRANSITIONS[phase][trigger] is not IGNORED

# The timers each phase arms, in firing order: the rows for them that are not IGNORED.
ARMED: Final[dict[Phase, tuple[Timer, ...]]] = {
    phase: tuple(timer for timer in Timer if acts(phase, timer)) for phase in TRANSITIONS
}
