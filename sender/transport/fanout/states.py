"""The fan-out group session's phases and what moves them, as tables (the shape of :mod:`..states`).

Two tables: the group's own phase (``GROUP``: IDLE -> STREAMING -> DRAINING) and each member's
(``MEMBER``: JOINED -> ACTIVE -> COMPLETE, or DROPPED from JOINED or ACTIVE). A row is ``Move(to,
action)`` (the action runs; unless it returns False the phase is then ``to``) or ``IGNORED``. The group
session changes a phase nowhere else and never tests one by name: it reads the traits (whether the group
sends data; whether a member steers the window and the repairs). tests/test_fanout_group.py walks every
entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypeAlias

from pfec.common.events import TableEnum


class GroupPhase(TableEnum):
    # (label, sends data)
    IDLE = ("idle", False)
    STREAMING = ("streaming", True)
    DRAINING = ("draining", False)  # nothing more to send: the DONE went to the group

    def __init__(self, label: str, sends: bool) -> None:
        self.label = label
        self.sends = sends


class GroupEvent(TableEnum):
    START = "start()"
    FINISHED = "finished"  # every source out and no steering member lacks anything (or the repair cap spent)
    NO_SLOT_LEFT = "no slot left"  # the send deadline passed


class MemberPhase(TableEnum):
    # (label, steers: its ACKs move the window and its deficit counts for the repairs)
    JOINED = ("joined", True)  # in the group, no ACK yet
    ACTIVE = ("active", True)
    COMPLETE = ("complete", False)  # it decoded every source symbol
    DROPPED = ("dropped", False)  # it could not keep up: served alone, or told to compute locally

    def __init__(self, label: str, steers: bool) -> None:
        self.label = label
        self.steers = steers


class MemberEvent(TableEnum):
    ACK = "ACK"
    COMPLETE = "complete"  # an ACK says it holds every source symbol
    LAGGING = "lagging"  # its loss, or its holes beyond its decoder span, would hold the group back
    SILENT = "silent"  # no ACK for ack_timeout_s while data flows


@dataclass(frozen=True, slots=True)
class Move:
    to: GroupPhase | MemberPhase
    action: str  # a GroupSession method (now, member or None, the input) -> whether the move goes through


@dataclass(frozen=True, slots=True)
class Ignored:
    pass


Row: TypeAlias = Move | Ignored
IGNORED: Final = Ignored()

GROUP: Final[dict[GroupPhase, dict[GroupEvent, Row]]] = {
    GroupPhase.IDLE: {
        GroupEvent.START: Move(GroupPhase.STREAMING, "_begin"),
        GroupEvent.FINISHED: IGNORED,
        GroupEvent.NO_SLOT_LEFT: IGNORED,
    },
    GroupPhase.STREAMING: {
        GroupEvent.START: IGNORED,
        GroupEvent.FINISHED: Move(GroupPhase.DRAINING, "_finish"),  # a DONE to the group
        GroupEvent.NO_SLOT_LEFT: Move(GroupPhase.DRAINING, "_stop"),
    },
    GroupPhase.DRAINING: {
        GroupEvent.START: IGNORED,
        GroupEvent.FINISHED: IGNORED,
        GroupEvent.NO_SLOT_LEFT: IGNORED,
    },
}

_ENDED: Final[dict[MemberEvent, Row]] = {event: IGNORED for event in MemberEvent}
MEMBER: Final[dict[MemberPhase, dict[MemberEvent, Row]]] = {
    MemberPhase.JOINED: {
        MemberEvent.ACK: Move(MemberPhase.ACTIVE, "_member_ack"),  # an implausible ACK is dropped: no move
        MemberEvent.COMPLETE: Move(MemberPhase.COMPLETE, "_member_complete"),
        MemberEvent.LAGGING: Move(MemberPhase.DROPPED, "_member_drop"),
        MemberEvent.SILENT: Move(MemberPhase.DROPPED, "_member_drop"),
    },
    MemberPhase.ACTIVE: {
        MemberEvent.ACK: Move(MemberPhase.ACTIVE, "_member_ack"),
        MemberEvent.COMPLETE: Move(MemberPhase.COMPLETE, "_member_complete"),
        MemberEvent.LAGGING: Move(MemberPhase.DROPPED, "_member_drop"),
        MemberEvent.SILENT: Move(MemberPhase.DROPPED, "_member_drop"),
    },
    MemberPhase.COMPLETE: _ENDED,  # it needs nothing more; the sender awaits its RESULT elsewhere
    MemberPhase.DROPPED: _ENDED,  # its ACKs no longer steer the group
}
