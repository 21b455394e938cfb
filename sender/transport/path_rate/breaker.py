"""The circuit breaker (RFC 8084): when to give the path up. Tripped stays tripped.

Once the path has delivered, the breaker trips when nothing more is delivered for ``BREAKER_SILENCE_S``
(or four smoothed RTTs, if longer) while the sender kept sending ``BREAKER_MIN_SENT`` datagrams. It also
trips when the rounds of the last ``BREAKER_WINDOW_S`` lost at least ``BREAKER_LOSS`` of what they sent.
The session then stops with the breaker's reason.
"""

from __future__ import annotations

from collections import deque
from typing import Final

BREAKER_SILENCE_S: Final = 1.0
BREAKER_MIN_SENT: Final = 64  # datagrams sent into the silence before it can trip the breaker
BREAKER_WINDOW_S: Final = 1.0
BREAKER_LOSS: Final = 0.95
BREAKER_MIN_PACKETS: Final = 256  # datagrams the loss window must hold before it can trip the breaker


class CircuitBreaker:
    """The reason the path was given up (None while it delivers), and the rounds' recent loss."""

    __slots__ = ("_recent_loss", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self._recent_loss: deque[tuple[float, int, int]] = deque()  # (round end, lost, delivered)

    def on_round(self, now: float, lost: int, delivered: int) -> None:
        window = self._recent_loss
        window.append((now, lost, delivered))
        while window and now - window[0][0] > BREAKER_WINDOW_S:
            window.popleft()
        total_lost = sum(entry[1] for entry in window)
        total = total_lost + sum(entry[2] for entry in window)
        if self.reason is None and total >= BREAKER_MIN_PACKETS and total_lost >= BREAKER_LOSS * total:
            self.reason = (f"circuit breaker: {total_lost} of {total} datagrams lost in the last "
                           f"{BREAKER_WINDOW_S:.1f} s")

    def check(self, now: float, last_delivery_at: float | None, sent_since_delivery: int,
              srtt: float) -> str | None:
        """The reason (sticky), tripping on a silence of the path that lasts while the sender sends."""
        if self.reason is None and last_delivery_at is not None:
            silence = now - last_delivery_at
            if silence > max(BREAKER_SILENCE_S, 4 * srtt) and sent_since_delivery >= BREAKER_MIN_SENT:
                self.reason = (f"circuit breaker: nothing delivered for {silence:.2f} s while "
                               f"{sent_since_delivery} datagrams were sent")
        return self.reason

    def restart(self) -> None:
        """A new handoff after an idle spell: a path given up may deliver again."""
        self.reason = None
        self._recent_loss.clear()
