"""What past handoffs to a receiver measured, for the next one's planner (live numbers, not priors).

Per receiver address: the prefill speed its newest ACCEPT stated (its own measurement, on its own CPUs
and under its load: ``breakeven.stated_receiver`` checked it), and the path's round-trip time as the
newest handoff's ACKs smoothed it. The break-even planner predicts local prefill and the split's front
from the stated speed instead of the stored curve, and every option's handshake and one-way delays from
the measured RTT instead of the configured one-way delay. Least recently used addresses go past
``capacity``; nothing here is a file or comes from anyone but an authenticated receiver.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pfec.common.plan.breakeven import ReceiverModel


@dataclass(frozen=True, slots=True)
class PeerNumbers:
    """The newest measurements of one receiver and its path (None: not measured yet)."""

    receiver: ReceiverModel | None = None
    rtt_s: float | None = None


class PeerMemory:
    """``PeerNumbers`` by receiver address, least recently used dropped past ``capacity``."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._peers: OrderedDict[str, PeerNumbers] = OrderedDict()

    def get(self, address: str) -> PeerNumbers:
        numbers = self._peers.get(address)
        if numbers is None:
            return PeerNumbers()
        self._peers.move_to_end(address)
        return numbers

    def record(self, address: str, receiver: ReceiverModel | None, rtt_s: float) -> None:
        """A finished handoff to ``address``: its ACCEPT's stated speed (None keeps the older one) and its
        smoothed RTT (0: no sample, keeps the older one)."""
        old = self._peers.pop(address, PeerNumbers())
        self._peers[address] = PeerNumbers(receiver or old.receiver, rtt_s if rtt_s > 0 else old.rtt_s)
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)

    def record_query(self, address: str, receiver: ReceiverModel | None, rtt_s: float | None) -> None:
        """A speed query's answer (before any handoff to ``address`` planned on it): its statement, and
        its round trip as the RTT only when no handoff has measured one."""
        old = self._peers.pop(address, PeerNumbers())
        rtt = old.rtt_s if old.rtt_s is not None else rtt_s
        self._peers[address] = PeerNumbers(receiver or old.receiver, rtt if rtt is None or rtt > 0 else None)
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)
