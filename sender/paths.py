"""What the sender daemon keeps per receiver path between handoffs: the transmit clock each handoff paces
on (with the path's rate controller under ``link.rate_control = path``) and the loss past handoffs there
measured. The receiver's stated speeds and measured RTTs are ``sender/peers.py``'s.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pfec.common.sched.open_loop_tail import DEFAULT_LOSS_PRIOR, MAX_LOSS
from pfec.sender.pacer import LinkClock
from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.transfer import LinkBudget

MAX_PATHS = 256  # receivers whose path controller the daemon keeps


def path_rate_report(rate: PathRate, congestion_at_start: int) -> dict[str, Any]:
    """The path controller as a handoff leaves it (the report's ``path_rate``)."""
    return {
        "estimate_mbps": round(rate.estimate_bps / 1e6, 3),
        "forecast_mbps": round(rate.forecast_bps / 1e6, 3),
        "pacing_mbps": round(rate.pace_bps / 1e6, 3), "phase": rate.phase.value,
        "min_rtt_ms": None if rate.min_rtt == float("inf") else round(rate.min_rtt * 1000, 3),
        "queue_delay_ms": round(rate.queue_delay_s * 1000, 3), "loss_floor": round(rate.loss_floor, 4),
        "congestion_events": rate.congestion_events - congestion_at_start, "rounds": rate.rounds,
    }


class PathLinks:
    """The transmit clocks handoffs pace on: under ``fixed``, one per pacing rate; under ``path``, one per
    receiver with its controller (concurrent handoffs there share its uplink), the oldest receiver's
    forgotten once ``MAX_PATHS`` are kept."""

    def __init__(self, rate_control: str, max_rate_bps: float | None, rtt_prior_s: float) -> None:
        if rate_control not in ("fixed", "path"):
            raise ValueError(f"rate_control must be fixed or path, got {rate_control!r}")
        self.rate_control = rate_control
        self.max_rate_bps = max_rate_bps
        self.rtt_prior_s = rtt_prior_s
        self._fixed: dict[float, LinkClock] = {}
        self._paths: dict[str, LinkClock] = {}

    def link_for(self, address: str, budget: LinkBudget, loss_prior: float) -> LinkClock:
        """The transmit clock a handoff paces on: the configured rate's (fixed), or the receiver's path
        with its controller (path; made on the first handoff there, from the told rate)."""
        if self.rate_control == "fixed":
            return self._fixed.setdefault(budget.rate_bps, LinkClock(budget.rate_bps))
        link = self._paths.get(address)
        if link is None:
            datagram_bytes = round(budget.slot_s * budget.rate_bps / 8)
            rate = PathRate(budget.rate_bps, datagram_bytes, max_bps=self.max_rate_bps, loss_prior=loss_prior,
                            rtt_prior_s=self.rtt_prior_s)
            while len(self._paths) >= MAX_PATHS:  # the oldest receiver's memory goes first
                self._paths.pop(next(iter(self._paths)))
            link = self._paths[address] = LinkClock(budget.rate_bps, controller=rate)
        return link

    def controller(self, address: str) -> PathRate | None:
        """The path controller of ``address`` (path control, once a handoff there made it)."""
        link = self._paths.get(address) if self.rate_control == "path" else None
        return None if link is None else link.controller

    def view(self) -> list[dict[str, Any]]:
        """Each receiver's path controller as it stands (``GET /paths``)."""
        return [{"receiver": address, **path_rate_report(link.controller, 0)}
                for address, link in self._paths.items() if link.controller is not None]


class PathLossPriors:
    """Per receiver address, the loss rate past handoffs there measured (each one's final ACK counters),
    as an exponentially weighted average: the next handoff's loss prior to that address (its open-loop
    tail plans for it before the ACKs say more). Least recently used addresses go past ``capacity``."""

    WEIGHT = 0.3  # the newest handoff's share: a few handoffs follow a change, one bad one moves it less
    MIN_SEEN = 64  # datagrams the final ACK must account for (a coding window) before its rate counts

    def __init__(self, default: float = DEFAULT_LOSS_PRIOR, capacity: int = 256) -> None:
        if not 0.0 <= default < 1.0:
            raise ValueError(f"loss prior must be in [0, 1), got {default!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.default = default
        self.capacity = capacity
        self._rates: OrderedDict[str, float] = OrderedDict()

    def prior(self, address: str) -> float:
        rate = self.measured(address)
        return self.default if rate is None else rate

    def measured(self, address: str) -> float | None:
        """The loss past handoffs to ``address`` measured (None: none did): the planner's, unlike the
        open-loop tail's prior, stays 0 until a handoff measures it."""
        rate = self._rates.get(address)
        if rate is not None:
            self._rates.move_to_end(address)
        return rate

    def record(self, address: str, lost: int, seen: int) -> None:
        """A finished handoff to ``address`` whose final ACK counted ``lost`` of ``seen`` datagrams."""
        if seen < self.MIN_SEEN or not 0 <= lost <= seen:
            return
        measured = min(lost / seen, MAX_LOSS)
        old = self._rates.pop(address, None)
        self._rates[address] = measured if old is None else (1 - self.WEIGHT) * old + self.WEIGHT * measured
        while len(self._rates) > self.capacity:
            self._rates.popitem(last=False)
