"""The receiver's endpoint, sans-IO: every session of one receiver behind one socket.

- Demultiplexing: each datagram's cleartext header is parsed once, here; the session it names opens
  the rest with that header (:meth:`PacketProtector.open_peeked`), so nothing is parsed or decrypted
  twice on the receive path.
- Handshake: an OFFER for an unknown session id is opened with a protector that does not know the
  symbol size yet (only the OFFER tells it), then admitted (fingerprint, capacity, parameters, the
  application's own check) or refused with a REFUSE sealed by that same protector.
- Early data: datagrams that arrive before their session's OFFER are held (bounded per session id and
  in number of session ids) with their parsed headers and replayed when the OFFER comes; data for a
  recently closed session is counted, never buffered.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from pfec.common.events import CpuMeter, DatagramDropped, earliest
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import Header, MsgType, Offer, ParseError, Refuse, RefuseCode, Role, clip_text
from pfec.common.wire.seal import PacketProtector
from pfec.receiver.session import ReceiverConfig, ReceiverEvent, ReceiverSession, SessionClosed

__all__ = ["Admission", "ReceiverEndpoint"]

#: The application's own admission check: ``(session id, offer)`` -> a refusal, or None to admit.
Admission = Callable[[int, Offer], tuple[RefuseCode, str] | None]


class ReceiverEndpoint:
    """All sessions of one receiver: dispatch by session id, admission, early data, bounded memory."""

    def __init__(
        self,
        psk: bytes,
        fingerprint: bytes,
        config: ReceiverConfig | None = None,
        admit: Admission | None = None,
        authenticate: bool = True,
        cpu: CpuMeter | None = None,
    ) -> None:
        self.psk = psk
        self.fingerprint = fingerprint
        self.config = config or ReceiverConfig()
        self.admit = admit
        self.authenticate = authenticate
        self.cpu = cpu
        self.sessions: dict[int, ReceiverSession] = {}
        self.drops: dict[str, int] = {}
        self._pending: OrderedDict[int, list[tuple[Header, bytes]]] = OrderedDict()
        self._closed: OrderedDict[int, None] = OrderedDict()
        self._events: deque[ReceiverEvent] = deque()
        self._refusals: list[tuple[int, bytes]] = []  # REFUSEs for sessions that never existed

    def receive_datagram(self, data: bytes, now: float) -> Header | None:
        """Take one datagram. Returns its header (parsed here, once) so that the caller can see its type
        and session id without parsing it again, or None when the header itself was malformed (counted)."""
        try:
            header = peek_header(data)
        except ParseError as exc:
            self._drop(exc.reason)
            return None
        sid = header.session_id
        session = self.sessions.get(sid)
        if session is not None:
            self._deliver(session, header, data, now)
        elif sid in self._closed:
            self._drop("closed_session")
        elif header.type == MsgType.OFFER:
            self._open_session(header, data, now)
        else:
            self._buffer_early(header, data)
        return header

    def datagrams_to_send(self) -> list[tuple[int, bytes]]:
        out = self._refusals
        self._refusals = []
        closed = False
        for sid, session in self.sessions.items():
            if session.has_output:
                out.extend((sid, d) for d in session.datagrams_to_send())
            closed |= session.closed
        if closed:
            self._reap()
        return out

    def next_event(self) -> ReceiverEvent | None:
        if not self._events:
            for session in self.sessions.values():
                while (event := session.next_event()) is not None:
                    if isinstance(event, DatagramDropped):
                        self._drop(event.reason)
                    else:
                        self._events.append(event)
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        return earliest(*(session.get_timer() for session in self.sessions.values()))

    def handle_timer(self, now: float) -> None:
        for session in self.sessions.values():
            timer = session.get_timer()
            if timer is not None and now >= timer:
                session.handle_timer(now)

    # ------------------------------------------------------------------ internals
    def _deliver(self, session: ReceiverSession, header: Header, data: bytes, now: float) -> None:
        try:
            message = session.protector.open_peeked(header, data)
        except ParseError as exc:
            self._drop(exc.reason)
            return
        session.handle_message(header.packet_number, message, now)

    def _open_session(self, header: Header, data: bytes, now: float) -> None:
        sid = header.session_id
        # OFFER bodies do not depend on the symbol size, which only the OFFER tells: the session's own
        # protector opens it (its replay window starts with it), then learns the size for the data.
        protector = PacketProtector(self.psk, sid, Role.RECEIVER, None, authenticate=self.authenticate)
        try:
            offer = protector.open_peeked(header, data)
            if not isinstance(offer, Offer):
                raise ParseError("bad_type")
        except ParseError as exc:
            self._drop(exc.reason)
            return
        protector.set_symbol_size(offer.symbol_size)  # in range: the OFFER parser checked it
        refusal = self._check_offer(sid, offer)
        if refusal is not None:
            self._refuse(protector, sid, *refusal)
            return
        session = ReceiverSession(sid, protector, offer, header.packet_number, now, self.config, self.cpu)
        self.sessions[sid] = session
        for early_header, early in self._pending.pop(sid, []):
            self._deliver(session, early_header, early, now)

    def _check_offer(self, sid: int, offer: Offer) -> tuple[RefuseCode, str] | None:
        if offer.fingerprint != self.fingerprint:
            return (
                RefuseCode.FINGERPRINT_MISMATCH,
                f"sender model fingerprint {offer.fingerprint.hex()[:16]} differs from this receiver's "
                f"{self.fingerprint.hex()[:16]}: both nodes must serve the same model and KV layout",
            )
        if len(self.sessions) >= self.config.max_sessions:
            return (RefuseCode.OVERLOADED, f"receiver already holds {len(self.sessions)} sessions")
        need = offer.n_source * offer.symbol_size
        if need > self.config.max_session_bytes:
            return (
                RefuseCode.OVERLOADED,
                f"handoff needs {need} bytes, above this receiver's max_session_bytes "
                f"{self.config.max_session_bytes}",
            )
        if offer.n_source == 0 or offer.window_cap == 0 or offer.window_cap > 4095:
            return (
                RefuseCode.BAD_PARAMETERS,
                f"n_source {offer.n_source} and window_cap {offer.window_cap} must be positive, "
                "window_cap <= 4095",
            )
        if self.admit is not None:
            return self.admit(sid, offer)
        return None

    def _refuse(self, protector: PacketProtector, sid: int, code: RefuseCode, text: str) -> None:
        self._remember_closed(sid)
        self._pending.pop(sid, None)
        self._events.append(SessionClosed(sid, f"refused: {text}"))
        self._refusals.append((sid, protector.seal(Refuse(code, clip_text(text)))))

    def _buffer_early(self, header: Header, data: bytes) -> None:
        cfg = self.config
        sid = header.session_id
        queue = self._pending.get(sid)
        if queue is None:
            if len(self._pending) >= cfg.pending_sessions:
                _old, dropped = self._pending.popitem(last=False)
                self._drop("early_evicted", len(dropped))
            queue = self._pending[sid] = []
        if len(queue) >= cfg.pending_datagrams:
            self._drop("early_overflow")
            return
        queue.append((header, bytes(data)))

    def _reap(self) -> None:
        for sid in [sid for sid, s in self.sessions.items() if s.closed]:
            del self.sessions[sid]
            self._remember_closed(sid)

    def _remember_closed(self, sid: int) -> None:
        self._closed[sid] = None
        while len(self._closed) > self.config.closed_memory:
            self._closed.popitem(last=False)

    def _drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + count
