"""What past handoffs to a receiver measured, for the next one's planner (live numbers, not priors).

Per receiver address: the prefill speed its newest ACCEPT stated (its own measurement, on its own CPUs
and under its load, without a handoff's stream: ``breakeven.stated_receiver`` checked it), how much
slower a split's front ran there beside its stream (the RESULT's ``front_s`` over what the stated speed
predicts for the tokens computed: the receive path shares the receiver's CPU, by an amount that depends
on the stream the path carries), and the path's round-trip time as the newest handoff's ACKs smoothed
it. The break-even planner predicts local prefill from the stated speed, the split's front from it times
the front slowdown, and every option's handshake and one-way delays from the measured RTT instead of the
configured one-way delay. Least recently used addresses go past ``capacity``; nothing here is a file or
comes from anyone but an authenticated receiver.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Final

from pfec.common.plan.breakeven import ReceiverModel

#: The newest split's share of the front slowdown: one odd front moves it half way, two follow a change.
SLOWDOWN_WEIGHT: Final = 0.5
#: A front this short (tokens) is one or two forward calls: too few to time a slowdown by.
MIN_FRONT_TOKENS: Final = 128
#: A slowdown outside this range is a timing accident (or a receiver that states a wrong curve), not load.
SLOWDOWN_RANGE: Final = (0.25, 50.0)


@dataclass(frozen=True, slots=True)
class PeerNumbers:
    """The newest measurements of one receiver and its path (None: not measured yet)."""

    receiver: ReceiverModel | None = None
    rtt_s: float | None = None
    front_slowdown: float | None = None
    # The path controller's forecast as the newest whole-cache handoff, and the newest split, left it: where
    # the receiver's CPU bounds the stream, a split's (the front computing beside it) delivers less.
    handoff_rate_bps: float | None = None
    split_rate_bps: float | None = None

    def planner_receiver(self) -> ReceiverModel | None:
        """The stated speed with the path's front slowdown applied to splits (None: none stated): a
        slowdown past splits measured replaces the one the receiver's per-datagram cost predicts."""
        if self.receiver is None or self.front_slowdown is None:
            return self.receiver
        return replace(self.receiver, front_scale=self.front_slowdown, datagram_s=None)


def front_slowdown(receiver: ReceiverModel, computed_tokens: int | None,
                   front_s: float | None) -> float | None:
    """How much slower a split's front of ``computed_tokens`` ran (``front_s``, its timed chunks) than the
    receiver's stated unloaded speed predicts for it; None when the front is too short to tell or the
    ratio is implausible."""
    if computed_tokens is None or front_s is None or computed_tokens < MIN_FRONT_TOKENS or front_s <= 0:
        return None
    predicted = receiver.unloaded_front_s(computed_tokens)
    if predicted <= 0:
        return None
    ratio = front_s / predicted
    low, high = SLOWDOWN_RANGE
    return ratio if low <= ratio <= high else None


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

    def record(self, address: str, receiver: ReceiverModel | None, rtt_s: float,
               slowdown: float | None = None) -> None:
        """A finished handoff to ``address``: its ACCEPT's stated speed (None keeps the older one), its
        smoothed RTT (0: no sample, keeps the older one) and, for a split, its front's slowdown
        (``front_slowdown``; None keeps the older one, a new one is averaged in)."""
        old = self._peers.pop(address, PeerNumbers())
        if slowdown is not None and old.front_slowdown is not None:
            slowdown = (1 - SLOWDOWN_WEIGHT) * old.front_slowdown + SLOWDOWN_WEIGHT * slowdown
        kept = slowdown if slowdown is not None else old.front_slowdown
        self._peers[address] = replace(old, receiver=receiver or old.receiver,
                                       rtt_s=rtt_s if rtt_s > 0 else old.rtt_s, front_slowdown=kept)
        self._trim()

    def record_rate(self, address: str, mode: str, forecast_bps: float) -> None:
        """The path's forecast after a handoff in ``mode`` to ``address`` (a local prefill streams
        nothing: ignored)."""
        if mode not in ("handoff", "split") or not forecast_bps > 0:
            return
        old = self._peers.pop(address, PeerNumbers())
        if mode == "split":
            self._peers[address] = replace(old, split_rate_bps=forecast_bps)
        else:
            self._peers[address] = replace(old, handoff_rate_bps=forecast_bps)
        self._trim()

    def record_query(self, address: str, receiver: ReceiverModel | None, rtt_s: float | None) -> None:
        """A speed query's answer (before any handoff to ``address`` planned on it): its statement, and
        its round trip as the RTT only when no handoff has measured one."""
        old = self._peers.pop(address, PeerNumbers())
        rtt = old.rtt_s if old.rtt_s is not None else rtt_s
        self._peers[address] = replace(old, receiver=receiver or old.receiver,
                                       rtt_s=rtt if rtt is None or rtt > 0 else None)
        self._trim()

    def _trim(self) -> None:
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)
