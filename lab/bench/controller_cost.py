"""The rate controller's CPU per 1000 packets (`pfec bench codec`'s ``controller`` row).

The controller's hooks run outside the session's CPU meters (the send path reports each datagram, the
link adapter reads the pacing rate for each), so they are measured apart: a simulated handoff under
``rate_control = path`` (the main cell's link as a 100 Mbit/s bottleneck, told the truth) runs with a
``RecordingPathRate``, which logs every call the session and the link make; the log is then replayed on a
fresh ``PathRate`` in one timed loop, and the same loop over a controller whose methods do nothing is
subtracted (the replay's own dispatch). The figure is that difference per 1000 data packets of the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from pfec.common.plan.deadline import DEFAULT_RHO
from pfec.common.sched.policies import get_scheme
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.handoff import SimConfig, prepare
from pfec.lab.sim.path_link import path_rate, sender_budget
from pfec.lab.sim.simulate import run_once
from pfec.sender.transport.path_rate import PathRate

MAIN_LOSS = "ge:0.001,0.5,0.02,0.1"
REPLAYS = 3  # the least of these (timer noise only adds)
Call = tuple[str, tuple[float, ...]]
HOOKS = ("on_packet_sent", "on_packets_acked", "on_packets_lost", "on_packets_delivered",
         "on_rtt_measurement", "breaker")
READS = ("pacing_bps", "slot_s", "plan_slot_s")


class RecordingPathRate(PathRate):
    """A PathRate that logs each call made on it (hooks with their arguments, reads of its rates)."""

    __slots__ = ("calls",)

    def __init__(self, start_bps: float, datagram_bytes: int, *, max_bps: float | None = None,
                 loss_prior: float = 0.0, rtt_prior_s: float = 0.1) -> None:
        super().__init__(start_bps, datagram_bytes, max_bps=max_bps, loss_prior=loss_prior,
                         rtt_prior_s=rtt_prior_s)
        self.calls: list[Call] = []

    def on_packet_sent(self, now: float, size: int) -> None:
        self.calls.append(("on_packet_sent", (now, size)))
        super().on_packet_sent(now, size)

    def on_packets_acked(self, now: float, count: int) -> None:
        self.calls.append(("on_packets_acked", (now, count)))
        super().on_packets_acked(now, count)

    def on_packets_lost(self, now: float, count: int) -> None:
        self.calls.append(("on_packets_lost", (now, count)))
        super().on_packets_lost(now, count)

    def on_packets_delivered(self, now: float, count: int) -> None:
        self.calls.append(("on_packets_delivered", (now, count)))
        super().on_packets_delivered(now, count)

    def on_rtt_measurement(self, now: float, rtt: float, sent_at: float) -> None:
        self.calls.append(("on_rtt_measurement", (now, rtt, sent_at)))
        super().on_rtt_measurement(now, rtt, sent_at)

    def breaker(self, now: float) -> str | None:
        self.calls.append(("breaker", (now,)))
        return super().breaker(now)

    @property
    def pacing_bps(self) -> float:
        self.calls.append(("pacing_bps", ()))
        return PathRate.pacing_bps.fget(self)  # type: ignore[attr-defined,no-any-return]

    @property
    def slot_s(self) -> float:
        self.calls.append(("slot_s", ()))
        return PathRate.slot_s.fget(self)  # type: ignore[attr-defined,no-any-return]

    @property
    def plan_slot_s(self) -> float:
        self.calls.append(("plan_slot_s", ()))
        return PathRate.plan_slot_s.fget(self)  # type: ignore[attr-defined,no-any-return]


class _Null:
    """The replay's dispatch without a controller behind it."""

    pacing_bps = slot_s = plan_slot_s = 1.0

    def _hook(self, *_args: float) -> None:
        return None

    on_packet_sent = on_packets_acked = on_packets_lost = on_packets_delivered = on_rtt_measurement = _hook
    breaker = _hook


def _replay(target: object, calls: list[Call]) -> int:
    """ns to make ``calls`` on ``target``, hooks bound once (as a session holds its controller)."""
    bound = {name: getattr(target, name) for name in HOOKS}
    cls = type(target)
    getters = {name: getattr(cls, name).fget if isinstance(getattr(cls, name), property) else None
               for name in READS}
    t0 = time.perf_counter_ns()
    for name, args in calls:
        hook = bound.get(name)
        if hook is not None:
            hook(*args)
        else:
            getter = getters[name]
            if getter is not None:
                getter(target)
    return time.perf_counter_ns() - t0


def measure_controller_overhead(realizations: int, progress: Callable[[int, int], None] | None = None,
                                ) -> dict[str, Any]:
    """The controller's CPU per 1000 data packets over ``realizations`` simulated handoffs (median)."""
    if realizations < 1:
        raise ValueError(f"realizations must be >= 1, got {realizations!r}")
    loss = parse_loss_spec(MAIN_LOSS)
    handoff = prepare(SimConfig(loss=loss, rho=DEFAULT_RHO, tokens=1536, told_rate_mbps=100.0,
                                rate_control="path"))
    scheme = get_scheme("heuristic")
    per_run: list[float] = []
    calls_per_packet: list[float] = []
    for r in range(realizations):
        budget = sender_budget(handoff)
        recorder = path_rate(handoff, budget, RecordingPathRate)
        assert isinstance(recorder, RecordingPathRate)
        run = run_once(handoff, scheme, r, controller=recorder)
        packets = run.source_sent + run.repair_sent
        fresh = [path_rate(handoff, budget) for _ in range(REPLAYS)]  # the same start, the same calls
        net = (min(_replay(c, recorder.calls) for c in fresh)
               - min(_replay(_Null(), recorder.calls) for _ in range(REPLAYS)))
        per_run.append(max(0, net) / 1e6 / (packets / 1000))
        calls_per_packet.append(len(recorder.calls) / packets)
        if progress is not None:
            progress(r + 1, realizations)
    return {
        "controller_ms_per_1k_packets": statistics.median(per_run),
        "controller_per_handoff_ms_per_1k_packets": per_run,
        "controller_calls_per_packet": round(statistics.median(calls_per_packet), 2),
        "controller_setup": "PathRate's hooks and rate reads as a simulated handoff made them (main GE, rho "
                            "0.8, heuristic, a 100 Mbit/s bottleneck, told 100), replayed on a fresh "
                            "controller, less the same replay on a no-op one; median over the handoffs",
    }
