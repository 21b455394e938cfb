"""One member's unicast side of a multicast fan-out, sans-IO: its handshake, ACKs and RESULT.

Each member has its own unicast session (its own session id and keys, from the PSK and both randoms):
the OFFER (whose application data carries the stream's group ticket, so the ticket travels inside this
member's own authenticated handshake) goes until the ACCEPT; the OFFER's last part then goes once under
the session key (the receiver establishes the session on it), again until the member's first ACK shows
the session exists. The member's ACKs and RESULT come back under its keys: ``receive`` opens them and
hands each plausible ACK to the caller for the :class:`pfec.sender.transport.fanout.group.GroupSession`.
The data itself goes on the group stream, never here. A CLOSE ends the member's session (after its
RESULT, or when the group drops it).
"""

from __future__ import annotations

from contextlib import suppress

from pfec.common.codec.fec import Encoder
from pfec.common.wire.messages import Accept, Ack, Close, CloseCode, ParseError, Refuse, Result, clip_text
from pfec.common.wire.seal import PacketProtector, drop_reason
from pfec.sender.transport.completion import ResultParts
from pfec.sender.transport.offer import OfferParts
from pfec.sender.transport.session_types import SenderConfig

__all__ = ["MemberLink"]


class MemberLink:
    """The sender's unicast session with one member: OFFER until ACCEPT, then ACKs in and the RESULT.

    ``state``: offered -> accepted -> done (its RESULT came) or failed (refused, closed, timed out, or
    closed by the sender); ``failure`` says why."""

    def __init__(self, index: int, session_id: int, config: SenderConfig, encoder: Encoder,
                 protector: PacketProtector) -> None:
        self.index = index
        self.session_id = session_id
        self.config = config
        self.protector = protector
        self.offer = OfferParts(config, encoder, protector)
        self.n_source = encoder.n_source
        self.state = "offered"
        self.failure: str | None = None
        self.result: bytes | None = None
        self.accepted_at: float | None = None
        self.span = 0  # the decoder span the ACCEPT granted
        self.heard = False  # an ACK came: the member's session exists
        self.drops: dict[str, int] = {}
        self.datagrams_sent = 0
        self._out: list[bytes] = []
        self._result = ResultParts(config.max_result_parts)
        self._deadline = 0.0
        self._handshake_deadline = 0.0
        self._established_retry: float | None = None
        self._result_timer: float | None = None

    # ------------------------------------------------------------------ API
    def start(self, now: float, deadline: float, slot_s: float) -> None:
        """The OFFER, now, for a stream whose receivers must start by ``deadline``."""
        self._deadline = deadline
        self._handshake_deadline = now + self.config.handshake_timeout_s
        self._out.extend(self.offer.first(deadline, now, slot_s))

    def datagrams_to_send(self) -> list[bytes]:
        out, self._out = self._out, []
        self.datagrams_sent += len(out)
        return out

    def receive(self, data: bytes, now: float) -> Ack | None:
        """One datagram from the member: its ACK when one opened (for the group), else None (the ACCEPT,
        the RESULT, a CLOSE, or a drop counted by reason; never raises for what a peer sends)."""
        try:
            _header, message = self.protector.open(data)
        except ParseError as exc:
            self._drop(drop_reason(exc))
            return None
        if isinstance(message, Accept):
            self._on_accept(message, now)
        elif isinstance(message, Ack):
            if self.state != "accepted":
                self._drop("unexpected_type")
                return None
            self.heard = True
            self._established_retry = None
            return message
        elif isinstance(message, Result):
            self._on_result(message)
        elif isinstance(message, Refuse):
            self._fail(f"receiver refused the handoff ({message.code.name}): {message.text}")
        elif isinstance(message, Close):
            self._fail(f"receiver closed the session ({message.code.name}): {message.text}")
        else:
            self._drop("unexpected_type")
        return None

    def stopped(self, now: float) -> None:
        """The group sends nothing more: the RESULT is due by the deadline plus ``result_wait_s``."""
        if self.state in ("offered", "accepted"):
            self._result_timer = max(now, self._deadline) + self.config.result_wait_s

    def close(self, reason: str, code: CloseCode = CloseCode.CANCELLED) -> None:
        """End the member's session (a CLOSE to it): dropped from the group, or the handoff cancelled."""
        if self.state in ("done", "failed"):
            return
        self._queue_close(code, reason)
        self._fail(reason)

    def get_timer(self) -> float | None:
        if self.state == "offered":
            return min(t for t in (self.offer.retry_at, self._handshake_deadline) if t is not None)
        if self.state != "accepted":
            return None
        timers = (self._established_retry, self.offer.repeat_at, self._result_timer)
        due = [t for t in timers if t is not None]
        return min(due) if due else None

    def handle_timer(self, now: float) -> None:
        if self.state == "offered":
            if now >= self._handshake_deadline:
                waited = self.config.handshake_timeout_s
                self._queue_close(CloseCode.TIMEOUT, "no ACCEPT")
                self._fail(f"no ACCEPT from the receiver within {waited:.3f} s")
            elif self.offer.retry_at is not None and now >= self.offer.retry_at:
                self.offer.retry_at = now + self.config.offer_retry_s
                self._out.extend(self.offer.all(self._deadline, now))
            return
        if self.state != "accepted":
            return
        if self._result_timer is not None and now >= self._result_timer:
            self._queue_close(CloseCode.TIMEOUT, "no RESULT")
            self._fail("no RESULT from the receiver by the deadline plus result_wait_s")
            return
        if self._established_retry is not None and now >= self._established_retry:
            # No ACK yet: the session-key OFFER part (which establishes the member's session) may be lost.
            self._established_retry = now + self.config.offer_retry_s if now < self._deadline else None
            self._out.append(self.offer.part(len(self.offer.parts) - 1, self._deadline, now))
        self._out.extend(self.offer.repeats_due(self._deadline, now))

    # ------------------------------------------------------------------ inside
    def _on_accept(self, accept: Accept, now: float) -> None:
        if self.state != "offered":
            if accept.receiver_random != self.protector.peer_random:
                self._drop("accept_mismatch")
            return
        if accept.n_source != self.n_source or accept.window_cap == 0:
            self._drop("accept_mismatch")
            return
        self.protector.set_peer_random(accept.receiver_random)
        self.state = "accepted"
        self.accepted_at = now
        self.span = accept.window_cap
        self._out.append(self.offer.on_accept(now, self._deadline))
        self._established_retry = now + self.config.offer_retry_s

    def _on_result(self, result: Result) -> None:
        if self.state != "accepted":
            return
        try:
            blob = self._result.add(result)
        except ValueError:
            self._drop("bad_result_part")
            return
        if blob is None:
            return
        self.result = blob
        self.state = "done"
        self._queue_close(CloseCode.DONE, "")

    def _queue_close(self, code: CloseCode, text: str) -> None:
        with suppress(ValueError):  # the packet-number space is spent: the receiver reaps the session itself
            self._out.append(self.protector.seal(Close(code, clip_text(text))))

    def _fail(self, reason: str) -> None:
        if self.state in ("done", "failed"):
            return
        self.state = "failed"
        self.failure = reason

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
