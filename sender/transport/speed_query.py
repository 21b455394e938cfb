"""Ask a receiver its prefill speed before the first handoff to it (sans-IO: time passed in).

The break-even planner predicts local prefill and the split's front from the speed a receiver states in
its ACCEPT (``common/plan/receiver_speed.py``); a sender learns it after its first handoff to that
receiver. The planner decides before that handoff's OFFER, so the first one would plan on the stored
curve of some other machine. A speed query closes that gap with the handshake the protocol already has:
an OFFER for zero sources (one part, no application data), sealed with the handshake key like any OFFER.
The receiver answers with an ACCEPT for zero sources (window 0) that states its speed, and keeps no session
(:mod:`pfec.receiver.endpoint`). The query is repeated if no answer comes, as a lost OFFER is; the first
answer's round trip (to the first send: Karn's rule needs no exception when one try is answered) is the
path's first RTT sample.

What comes back is checked like any ACCEPT: opened with our R_s as associated data, zero sources, a
plausible statement (``stated_receiver``); anything else is dropped and counted, the caller plans on the
stored curve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.receiver_speed import stated_receiver, statement_of
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE, Accept, Offer, ParseError, Refuse, Role
from pfec.common.wire.seal import PacketProtector, RandomBytes, drop_reason, keyring_for

QUERY_TRIES: Final = 3
MIN_RETRY_S: Final = 0.05  # between tries: at least this, or twice the expected round trip


@dataclass(frozen=True, slots=True)
class SpeedAnswer:
    """What a query learnt: the receiver's statement (None: it states none, refused or never answered),
    the round trip of the answer (None: no answer) and, when there is no statement, why."""

    receiver: ReceiverModel | None
    rtt_s: float | None
    why: str = ""


class SpeedQuery:
    """One speed query: ``datagram`` to send now, ``timer`` for the next try, ``receive`` for replies."""

    def __init__(self, psk: bytes, fingerprint: bytes, session_id: int, now: float, expected_rtt_s: float,
                 *, authenticate: bool = True, random_bytes: RandomBytes = os.urandom) -> None:
        self.protector = PacketProtector(keyring_for(bytes(psk), authenticate), session_id, Role.SENDER,
                                         DEFAULT_SYMBOL_SIZE, random_bytes=random_bytes)
        self.fingerprint = fingerprint
        self.retry_s = max(MIN_RETRY_S, 2 * expected_rtt_s)
        self.sent_at: list[float] = []
        self.next_try: float | None = now
        self.answer: SpeedAnswer | None = None
        self.drops: dict[str, int] = {}

    def datagram(self, now: float) -> bytes | None:
        """The OFFER to send at ``now`` (a try is due), or None."""
        if self.answer is not None or self.next_try is None or now < self.next_try:
            return None
        query = Offer(symbol_size=DEFAULT_SYMBOL_SIZE, window_cap=0, n_source=0, budget_us=0,
                      fingerprint=self.fingerprint, sender_random=self.protector.local_random)
        self.sent_at.append(now)
        self.next_try = now + self.retry_s if len(self.sent_at) < QUERY_TRIES else None
        return self.protector.seal(query)

    @property
    def timer(self) -> float | None:
        """When to call ``datagram`` or ``expire`` next (None: answered)."""
        if self.answer is not None:
            return None
        if self.next_try is not None:
            return self.next_try
        return self.sent_at[-1] + self.retry_s if self.sent_at else None

    def expire(self, now: float) -> None:
        """Give up once the last try has had its time."""
        out_of_tries = self.next_try is None and self.sent_at
        if self.answer is None and out_of_tries and now >= self.sent_at[-1] + self.retry_s:
            self.answer = SpeedAnswer(None, None, f"no answer to {len(self.sent_at)} speed queries")

    def receive(self, data: bytes, now: float) -> None:
        """A datagram from the receiver: the answer, or dropped and counted by reason (never raises)."""
        if self.answer is not None:
            return
        try:
            _header, message = self.protector.open(data)
        except ParseError as exc:
            self._drop(drop_reason(exc))
            return
        rtt = now - self.sent_at[0] if len(self.sent_at) == 1 else None
        if isinstance(message, Refuse):  # e.g. another model, or a receiver that predates speed queries
            self.answer = SpeedAnswer(None, rtt, f"refused ({message.code.name}): {message.text}")
            return
        if not isinstance(message, Accept) or message.n_source != 0 or message.window_cap != 0:
            self._drop("not_an_answer")
            return
        try:
            stated = stated_receiver(*statement_of(message))
        except ValueError as exc:
            self._drop("bad_prefill_speed")
            self.answer = SpeedAnswer(None, rtt, f"implausible statement: {exc}")
            return
        self.answer = SpeedAnswer(stated, rtt, "" if stated is not None else "the receiver states no speed")

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
