"""A receiver's membership in one coded fan-out stream, sans-IO: the stream's datagrams into its session.

The member's own unicast session (:class:`pfec.receiver.session.ReceiverSession`, established by its own
handshake) keeps its decoder, ACKs, deadline and RESULT. The stream's datagrams arrive on the group
destination under the stream's group key (:mod:`pfec.common.wire.group`): ``GroupMembership`` opens
them with the member's group opener (its own replay window), hands on only the sender's SOURCE, REPAIR and
DONE, and counts every other datagram by reason: one of another stream (``wrong_session``), under another
key (``auth``), a replay, or any other type under the group key. Nothing a group
datagram says reaches the member's unicast keys or its ACKs' sealing.
"""

from __future__ import annotations

from pfec.common.wire.group import GroupTicket, group_opener, open_group
from pfec.common.wire.handshake import ByteBuffer
from pfec.common.wire.messages import ParseError
from pfec.common.wire.seal import drop_reason
from pfec.receiver.session import ReceiverSession

__all__ = ["GroupMembership"]


class GroupMembership:
    """One member's view of one stream: ``receive(datagram, now)`` for what arrives on the group
    destination. ``session``: the member's established unicast session (its OFFER gives the symbol size)."""

    __slots__ = ("_opener", "drops", "last_drop", "opened", "session", "session_id")

    def __init__(self, ticket: GroupTicket, session: ReceiverSession) -> None:
        self.session = session
        session.follow_group()  # its loss counts in the stream's packet numbers from now
        self.session_id = ticket.session_id
        self._opener = group_opener(ticket, session.offer.symbol_size)
        self.drops: dict[str, int] = {}
        self.last_drop = ""  # the reason of the newest datagram counted in drops
        self.opened = 0

    def receive(self, datagram: ByteBuffer, now: float) -> bool:
        """Whether the datagram opened under this stream's key and went to the session (else counted)."""
        try:
            header, message = open_group(self._opener, datagram)
        except ParseError as exc:
            reason = drop_reason(exc)
            self.drops[reason] = self.drops.get(reason, 0) + 1
            self.last_drop = reason
            return False
        self.opened += 1
        self.session.handle_message(header.packet_number, message, now, group=True)
        return True
