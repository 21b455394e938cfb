"""The receiver's endpoint, sans-IO: every session of one receiver behind one socket.

- Demultiplexing: each datagram's cleartext header is parsed once, here; the session it names opens
  the rest with that header (:meth:`PacketProtector.open_peeked`), so nothing is parsed or decrypted
  twice on the receive path.
- Handshake (the design is :mod:`pfec.common.wire.seal`'s): an OFFER is opened with the static handshake
  key (one AES-GCM open, no key derivation: a forged one costs microseconds), its fields are bounded
  (``ReceiverConfig``) and admitted or refused with a REFUSE; an admitted one creates a small *pending
  handshake* (bounded in number, oldest dropped first, expiring ``handshake_timeout_s`` after its first
  OFFER) and is answered with an ACCEPT carrying fresh R_r. The ``ReceiverSession`` (deadline, decoder,
  ACKs, rebuild) exists only once a datagram opens under the session key K_s2r, which needs R_r: the
  proof that the sender holds the key and saw this ACCEPT. A replayed OFFER gets at most an ACCEPT.
  The bounds, the span granted and the pending record are :mod:`pfec.receiver.handshake`'s.
- Speed query: an OFFER for zero sources (one part, no application data) asks this node's prefill speed
  before a first handoff is planned; it is answered with an ACCEPT for zero sources that states it, and
  leaves nothing behind but its session id among the closed ones (``speed_queries`` counts the answers).
- Decoder span, per session: the OFFER asks for one (about two bandwidth-delay products plus the coding
  window; 0: no request). The endpoint grants at least ``ReceiverConfig.decoder_span`` (and the window
  cap), at most the request, ``MAX_SPAN`` (the codec's largest window) and the handoff's source count,
  and shrinks it further so that the session's store plus the decoder it implies (a span x span
  coefficient matrix and span payload rows) fit ``max_session_bytes``; a request past ``MAX_SPAN`` is
  refused. The ACCEPT tells the sender the span granted; the session gets it through a per-session copy
  of the config.
- Anti-amplification: until establishment a pending handshake sends at most ``3 x`` the authenticated
  bytes it received (RFC 9000 section 8.1): a repeated OFFER part gets the same ACCEPT bytes again
  within that budget, a REFUSE text is clipped to fit it.
- Early data: datagrams sealed under the sender's early key are opened as soon as their pending
  handshake exists (its keys are derived then, once) and held, bounded, until establishment; those that
  arrive before any OFFER are held raw (bounded per session id and in number of session ids). Data for a
  recently closed session is counted, never buffered; session-key data for an unknown session is dropped.
- Drops are counted by reason in ``drops``, never by a datagram's claimed type. Before authentication:
  ``junk_header`` (unparseable or impossible header, length or phase), ``bad_version`` (a peer on another
  wire version), ``junk_auth`` (the tag does not verify: forged, corrupted, or replayed into keys that
  changed), ``no_session``, ``closed_session``, ``early_overflow``, ``early_evicted``. After it:
  ``replay``, ``too_old``, ``malformed`` (an authentic body out of its domain), ``offer_mismatch`` (an
  OFFER part of another attempt), ``amplification_limit`` (a handshake reply not sent),
  ``handshake_expired`` and ``handshake_evicted`` (pending handshakes given up), and the sessions' own
  (``unexpected_type``, ``fec_*``).
- Fan-out groups (:mod:`pfec.receiver.fanout.member`): a session whose OFFER carried a group ticket
  joins the group (``join_group``): datagrams naming the group's session id open only under that
  stream's key and feed that session (counted ``group_*`` by reason when they do not). At most one group
  per session, and a group id that is a live session id is refused; the group goes with its session.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict, deque
from dataclasses import replace

from pfec.common.events import CpuMeter, DatagramDropped
from pfec.common.plan.receiver_speed import Statement
from pfec.common.wire.frames import peek_header
from pfec.common.wire.group import GroupTicket
from pfec.common.wire.messages import (
    MAX_TEXT,
    NONCE_SIZE,
    OVERHEAD,
    RANDOM_SIZE,
    Accept,
    Close,
    Header,
    KeyPhase,
    Message,
    MsgType,
    Offer,
    ParseError,
    Refuse,
    RefuseCode,
    Role,
    clip_text,
)
from pfec.common.wire.seal import (
    Keyring,
    PacketProtector,
    RandomBytes,
    ReplayError,
    drop_reason,
    open_handshake,
    seal_handshake,
)
from pfec.receiver.fanout.member import GroupMembership
from pfec.receiver.handshake import (
    AMPLIFICATION_FACTOR,
    MAX_HELD_REPEATS,
    MAX_SPAN,
    Admission,
    HandshakeInfo,
    Pending,
    check_offer,
    decoder_bytes,
    grant_span,
)
from pfec.receiver.session import (
    ReceiverConfig,
    ReceiverEvent,
    ReceiverSession,
    SessionClosed,
    decoder_span,
    same_handoff,
)

__all__ = [
    "AMPLIFICATION_FACTOR", "MAX_SPAN", "Admission", "HandshakeInfo", "ReceiverEndpoint",
    "decoder_bytes", "grant_span",
]

_REFUSE_OVERHEAD = OVERHEAD + NONCE_SIZE + 1  # a handshake REFUSE without its text
_HANDSHAKE = KeyPhase.HANDSHAKE


class ReceiverEndpoint:
    """All sessions of one receiver: dispatch by session id, the handshake, early data, bounded memory.

    ``psk`` may be a :class:`Keyring` (built once per PSK). ``random_bytes`` supplies R_r and the
    handshake nonces (os.urandom; the simulator and tests pass a seeded one)."""

    def __init__(
        self,
        psk: bytes | Keyring,
        fingerprint: bytes,
        config: ReceiverConfig | None = None,
        admit: Admission | None = None,
        authenticate: bool = True,
        cpu: CpuMeter | None = None,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        self.keyring = psk if isinstance(psk, Keyring) else Keyring(psk, authenticate=authenticate)
        self.fingerprint = fingerprint
        self.config = config or ReceiverConfig()
        self.admit = admit
        self.authenticate = self.keyring.authenticate
        self.cpu = cpu
        self.random_bytes = random_bytes
        self.sessions: dict[int, ReceiverSession] = {}
        self.groups: dict[int, GroupMembership] = {}  # by the group stream's session id
        self.drops: dict[str, int] = {}
        self.bytes_received = 0  # every datagram given to receive_datagram
        # This node's speed as its ACCEPTs state it (``receiver_speed.Statement``, the ACCEPT's units; all
        # 0: not stated). The daemon sets it from its measurements.
        self.prefill_statement: tuple[int, ...] = Statement()  # receiver_speed.stated_fields
        self.speed_queries = 0  # speed queries answered
        self._handshakes: OrderedDict[int, Pending] = OrderedDict()  # by creation, so by expiry
        self._early: OrderedDict[int, list[tuple[Header, bytes]]] = OrderedDict()  # before any OFFER
        self._closed: OrderedDict[int, None] = OrderedDict()
        self._events: deque[ReceiverEvent] = deque()
        self._replies: list[tuple[int, bytes]] = []  # ACCEPTs and REFUSEs of pending handshakes

    # ------------------------------------------------------------------ public API
    def receive_datagram(self, data: bytes, now: float) -> Header | None:
        """Take one datagram. Returns its header (parsed here, once) when the datagram authenticated now,
        so that the caller can count it by type and see its session id without parsing it again; None
        when it was dropped (counted by reason) or held unopened for a handshake still to come."""
        self.bytes_received += len(data)
        try:
            header = peek_header(data)
        except ParseError as exc:
            self._drop(drop_reason(exc))
            return None
        sid = header.session_id
        if self.groups and (member := self.groups.get(sid)) is not None:
            return header if self._deliver_group(member, data, now) else None
        session = self.sessions.get(sid)
        if header.phase is _HANDSHAKE:
            return self._on_handshake(header, data, session, now)
        if session is not None:
            return header if self._deliver(session, header, data, now) else None
        if sid in self._closed:
            self._drop("closed_session")
            return None
        pending = self._handshakes.get(sid)
        if pending is not None:
            return self._on_pending_data(pending, header, data, now)
        if header.phase is KeyPhase.EARLY:
            self._buffer_early(header, data)
        else:
            self._drop("no_session")
        return None

    def datagrams_to_send(self) -> list[tuple[int, bytes]]:
        out = self._replies
        self._replies = []
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
        # Called after every datagram by the daemon and twice per event by the simulator: a plain loop,
        # no generator. Handshakes are kept by creation, so the first one expires first.
        first: float | None = None
        if self._handshakes:
            first = next(iter(self._handshakes.values())).expires_at
        for session in self.sessions.values():
            timer = session.get_timer()
            if timer is not None and (first is None or timer < first):
                first = timer
        return first

    def next_deadline(self) -> float | None:
        """The earliest deadline of the sessions still receiving: the one timer worth keeping to the
        microsecond (a late start costs TTFT; an ACK or a RESULT retry a millisecond late costs nothing)."""
        first: float | None = None
        for session in self.sessions.values():
            deadline = session.deadline_timer()
            if deadline is not None and (first is None or deadline < first):
                first = deadline
        return first

    def handle_timer(self, now: float) -> None:
        for session in self.sessions.values():
            timer = session.get_timer()
            if timer is not None and now >= timer:
                session.handle_timer(now)
        handshakes = self._handshakes
        while handshakes:
            sid, pending = next(iter(handshakes.items()))
            if now < pending.expires_at:
                break
            del handshakes[sid]
            self._remember_closed(sid)
            self._drop("handshake_expired")

    def pending_handshakes(self) -> list[HandshakeInfo]:
        """Every pending handshake (not yet a session), oldest first."""
        return [p.info(sid) for sid, p in self._handshakes.items()]

    @property
    def early_held(self) -> int:
        """Datagrams held before their session exists (raw before any OFFER, opened for a pending one)."""
        return sum(len(q) for q in self._early.values()) + sum(len(p.held) for p in self._handshakes.values())

    def knows(self, session_id: int) -> bool:
        """Whether ``session_id`` is a live session or a pending handshake (replies may still go to it)."""
        return session_id in self.sessions or session_id in self._handshakes

    # ------------------------------------------------------------------ established sessions
    def _deliver(self, session: ReceiverSession, header: Header, data: bytes, now: float) -> bool:
        try:
            message = session.protector.open_peeked(header, data)
        except ParseError as exc:
            self._drop_open_error(exc)
            return False
        session.handle_message(header.packet_number, message, now)
        return True

    def _deliver_group(self, member: GroupMembership, data: bytes, now: float) -> bool:
        if member.receive(data, now):
            return True
        self._drop(f"group_{member.last_drop}")
        return False

    def join_group(self, session_id: int, ticket: GroupTicket) -> str | None:
        """Session ``session_id`` (established, its OFFER carried ``ticket``) takes the group stream's
        datagrams from now on. None when joined; else why not (nothing changes then)."""
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            return "no such session"
        gid = ticket.session_id
        if gid in self.sessions or gid in self._handshakes or gid in self._closed:
            return "the group's session id is another session's"
        if gid in self.groups:
            return "this group is another session's"
        if any(m.session is session for m in self.groups.values()):
            return "the session is in a group already"
        self.groups[gid] = GroupMembership(ticket, session)
        return None

    # ------------------------------------------------------------------ handshake
    def _on_handshake(self, header: Header, data: bytes, session: ReceiverSession | None,
                      now: float) -> Header | None:
        sid = header.session_id
        if header.type is not MsgType.OFFER:  # the only handshake datagram a sender seals
            self._drop("junk_header")
            return None
        try:  # the static key: no derivation, one AES-GCM open
            offer = open_handshake(self.keyring, Role.RECEIVER, header, data)
        except ParseError as exc:
            self._drop_open_error(exc)
            return None
        assert isinstance(offer, Offer)  # the only type allowed through
        pn = header.packet_number
        if session is not None:  # a late or repeated part of an established session
            if not same_handoff(offer, session.offer):
                self._drop("offer_mismatch")
                return None
            try:
                session.protector.mark_received(pn)
            except ReplayError as exc:
                self._drop(exc.reason)
                return None
            session.handle_message(pn, offer, now)
            return header
        if sid in self._closed:
            self._drop("closed_session")
            return None
        pending = self._handshakes.get(sid)
        if pending is None and offer.n_source == 0:
            self._answer_speed_query(header, offer, len(data))
            return header
        if pending is None:
            self._open_handshake(header, offer, len(data), now)
            return header
        if not same_handoff(offer, pending.offer):
            self._drop("offer_mismatch")
            return None
        pending.bytes_received += len(data)
        if offer.part_index in pending.parts:  # the sender repeats its OFFER: our ACCEPT was lost or is late
            self._reply(pending, sid)
            if pn not in pending.repeats and len(pending.repeats) < MAX_HELD_REPEATS:
                pending.repeats.add(pn)  # counted as received once the session starts (not as a loss)
            return header
        pending.parts[offer.part_index] = pn
        pending.held.append((pn, offer))
        return header

    def _open_handshake(self, header: Header, offer: Offer, size: int, now: float) -> None:
        sid = header.session_id
        refusal = self._check_offer(sid, offer)
        if refusal is not None:
            self._refuse_handshake(header, offer, size, *refusal)
            return
        cfg = self.config
        handshakes = self._handshakes
        if len(handshakes) >= cfg.max_handshakes:
            old, _gone = handshakes.popitem(last=False)
            self._remember_closed(old)
            self._drop("handshake_evicted")
        span = grant_span(offer, cfg)
        session_cfg = cfg if span == cfg.decoder_span else replace(cfg, decoder_span=span)
        r_r = self.random_bytes(RANDOM_SIZE)
        accept = Accept(decoder_span(offer, session_cfg), offer.n_source, r_r, *self.prefill_statement)
        reply = seal_handshake(self.keyring, Role.RECEIVER, accept, sid, 1, self.random_bytes(NONCE_SIZE),
                               offer.sender_random)
        pending = Pending(offer, header.packet_number, session_cfg, now, now + cfg.handshake_timeout_s, r_r,
                           reply, {offer.part_index: header.packet_number}, bytes_received=size)
        handshakes[sid] = pending
        self._reply(pending, sid)
        early = self._early.pop(sid, None)
        if early:
            for early_header, raw in early:
                self._on_pending_data(pending, early_header, raw, now)

    def _answer_speed_query(self, header: Header, offer: Offer, size: int) -> None:
        """An OFFER for zero sources asks this node's prefill speed (``sender/transport/speed_query.py``):
        an ACCEPT for zero sources, window 0, stating it; no session, nothing kept but the closed session id
        (a replay is then dropped as ``closed_session``). The ACCEPT (80 B) is smaller than the query
        (>= 108 B): no amplification."""
        sid = header.session_id
        if offer.fingerprint != self.fingerprint:
            self._refuse_handshake(header, offer, size, RefuseCode.FINGERPRINT_MISMATCH,
                                   f"sender model fingerprint {offer.fingerprint.hex()[:16]} differs from "
                                   f"this receiver's {self.fingerprint.hex()[:16]}")
            return
        if offer.part_count != 1 or offer.app:
            self._refuse_handshake(header, offer, size, RefuseCode.BAD_PARAMETERS,
                                   "a speed query (zero sources) is one OFFER part without application data")
            return
        self._remember_closed(sid)
        self._early.pop(sid, None)
        answer = Accept(0, 0, self.random_bytes(RANDOM_SIZE), *self.prefill_statement)
        self._replies.append((sid, seal_handshake(self.keyring, Role.RECEIVER, answer, sid, 1,
                                                  self.random_bytes(NONCE_SIZE), offer.sender_random)))
        self.speed_queries += 1

    def _reply(self, pending: Pending, sid: int) -> None:
        """Send the pending handshake's ACCEPT (again), within the anti-amplification budget."""
        size = len(pending.reply)
        if pending.bytes_sent + size > AMPLIFICATION_FACTOR * pending.bytes_received:
            self._drop("amplification_limit")
            return
        pending.bytes_sent += size
        self._replies.append((sid, pending.reply))

    def _check_offer(self, sid: int, offer: Offer) -> tuple[RefuseCode, str] | None:
        """Every OFFER field bounded before anything is allocated for it (``handshake.check_offer``)."""
        return check_offer(sid, offer, self.config, self.fingerprint, len(self.sessions), self.admit)

    def _refuse_handshake(self, header: Header, offer: Offer, size: int, code: RefuseCode, text: str) -> None:
        """A REFUSE sealed with the handshake key, its text clipped to the anti-amplification budget."""
        sid = header.session_id
        self._remember_closed(sid)
        self._early.pop(sid, None)
        self._events.append(SessionClosed(sid, f"refused: {text}"))
        room = AMPLIFICATION_FACTOR * size - _REFUSE_OVERHEAD
        if room < 0:
            self._drop("amplification_limit")
            return
        refuse = Refuse(code, clip_text(text, min(room, MAX_TEXT)))
        self._replies.append((sid, seal_handshake(self.keyring, Role.RECEIVER, refuse, sid, 1,
                                                  self.random_bytes(NONCE_SIZE), offer.sender_random)))

    # ------------------------------------------------------------------ pending handshakes: data
    def _pending_protector(self, sid: int, pending: Pending) -> PacketProtector:
        protector = pending.protector
        if protector is None:  # the session keys, derived once per pending handshake
            offer = pending.offer
            protector = pending.protector = PacketProtector(
                self.keyring, sid, Role.RECEIVER, offer.symbol_size, local_random=pending.receiver_random,
                peer_random=offer.sender_random, random_bytes=self.random_bytes, first_pn=2,
            )
        return protector

    def _on_pending_data(self, pending: Pending, header: Header, data: bytes, now: float) -> Header | None:
        """Early data is opened and held; the first datagram under the session key establishes."""
        sid = header.session_id
        protector = self._pending_protector(sid, pending)
        try:
            message = protector.open_peeked(header, data)
        except ParseError as exc:
            self._drop_open_error(exc)
            return None
        pending.bytes_received += len(data)
        pn = header.packet_number
        if header.phase is KeyPhase.SESSION:
            self._establish(sid, pending, pn, message, now)
        elif isinstance(message, Close):
            del self._handshakes[sid]
            self._remember_closed(sid)
            reason = f"sender closed ({message.code.name}) {message.text}".strip()
            self._events.append(SessionClosed(sid, reason))
        elif (len(pending.held) >= self.config.early_datagrams + self.config.max_offer_parts
              or self.early_held >= self.config.early_total):  # fmt: skip
            self._drop("early_overflow")
        else:
            pending.held.append((pn, message))
        return header

    def _establish(self, sid: int, pending: Pending, pn: int, message: Message, now: float) -> None:
        del self._handshakes[sid]
        protector = pending.protector
        assert protector is not None
        if len(self.sessions) >= self.config.max_sessions:
            self._remember_closed(sid)
            text = f"receiver already holds {len(self.sessions)} sessions"
            self._replies.append((sid, protector.seal(Refuse(RefuseCode.OVERLOADED, text))))
            self._events.append(SessionClosed(sid, f"refused: {text}"))
            return
        for part_pn in pending.parts.values():  # handshake datagrams: in the window from now on
            if part_pn != pn:
                with contextlib.suppress(ReplayError):
                    protector.mark_received(part_pn)
        session = ReceiverSession(sid, protector, pending.offer, pending.offer_pn, now, pending.config,
                                  self.cpu, offer_at=pending.created_at)
        self.sessions[sid] = session
        for repeat_pn in pending.repeats:  # repeated OFFERs arrived: counted in order, not as losses
            with contextlib.suppress(ReplayError):
                protector.mark_received(repeat_pn)
                pending.held.append((repeat_pn, pending.offer))
        pending.held.sort(key=lambda held: held[0])
        for held_pn, held in pending.held:
            session.handle_message(held_pn, held, now)
        pending.held.clear()
        session.handle_message(pn, message, now)

    # ------------------------------------------------------------------ bookkeeping
    def _buffer_early(self, header: Header, data: bytes) -> None:
        cfg = self.config
        sid = header.session_id
        queue = self._early.get(sid)
        if queue is None:
            if len(self._early) >= cfg.pending_sessions:
                _old, dropped = self._early.popitem(last=False)
                self._drop("early_evicted", len(dropped))
            queue = self._early[sid] = []
        if len(queue) >= cfg.pending_datagrams or self.early_held >= cfg.early_total:
            self._drop("early_overflow")
            return
        queue.append((header, bytes(data)))

    def _reap(self) -> None:
        for sid in [sid for sid, s in self.sessions.items() if s.closed]:
            del self.sessions[sid]
            self._remember_closed(sid)
        for gid in [gid for gid, m in self.groups.items() if m.session.closed]:
            del self.groups[gid]  # the group's later datagrams: no_session
            self._remember_closed(gid)

    def _remember_closed(self, sid: int) -> None:
        self._closed[sid] = None
        self._early.pop(sid, None)
        while len(self._closed) > self.config.closed_memory:
            self._closed.popitem(last=False)

    def _drop_open_error(self, exc: ParseError) -> None:
        self._drop(drop_reason(exc))

    def _drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + count
