"""The simulated sender's rate and the link it meets (sans-IO): the rate it is told, whether a
controller measures the path (``SimConfig.rate_control``), and the bottleneck queue between them.

- ``fixed`` (the paper's setting): the sender paces at the told rate. Told the link's own rate on a
  fixed-rate link, the link *is* the sender's pacing (no queue: today's simulator, byte for byte).
- Told another rate, or on a trace, or under ``path``, the link is a drop-tail bottleneck
  (:class:`.rate_trace.TraceQueue`, ``DEFAULT_QUEUE_MS`` deep unless sized) at ``rate_mbps`` or on the
  trace, and the sender paces into it: at the told rate (``fixed``), or at the rate a ``PathRate``
  (``sender/transport/path_rate/``) measures, starting from the told rate (``path``).

The deadline stays the link's (``rho`` against ``rate_mbps``): a sender told a wrong rate plans with it,
the receiver's deadline does not move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from pfec.common.plan.deadline import slot_seconds
from pfec.lab.sim.engine import SimLink
from pfec.lab.sim.handoff import Handoff, SimConfig
from pfec.lab.sim.rate_trace import TraceQueue, constant_trace, queue_limit_bytes
from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.transfer import LinkBudget

RATE_CONTROLS = ("fixed", "path")


def forward_bottleneck(cfg: SimConfig) -> TraceQueue | None:
    """The forward link's drop-tail queue (shared by data and control: one physical link), or None
    when the sender's pacing is the link."""
    if cfg.rate_trace is not None:
        return TraceQueue(cfg.rate_trace, queue_limit_bytes(cfg.rate_trace, None, cfg.queue_bytes))
    if cfg.bottlenecked:
        trace = constant_trace(cfg.rate_mbps)
        return TraceQueue(trace, queue_limit_bytes(trace, None, cfg.queue_bytes))
    return None


def sender_budget(handoff: Handoff) -> LinkBudget:
    """The handoff's budget as the sender sees it: the link's deadline, the told rate's slot."""
    cfg, budget = handoff.config, handoff.budget
    told = cfg.told_rate_bps
    if told == budget.rate_bps:
        return budget
    return dataclasses.replace(budget, rate_bps=told, slot_s=slot_seconds(handoff.plan.symbol_size, told))


def path_rate(handoff: Handoff, budget: LinkBudget, kind: type[PathRate] = PathRate) -> PathRate | None:
    """A fresh controller (of ``kind``) for one simulated handoff under ``rate_control="path"`` (None:
    fixed)."""
    cfg = handoff.config
    if cfg.rate_control != "path":
        return None
    datagram_bytes = round(budget.slot_s * budget.rate_bps / 8)
    # The daemon's RTT prior too (twice its configured one-way delay): the first window is sized on it.
    return kind(budget.rate_bps, datagram_bytes, loss_prior=cfg.sender_loss_prior,
                rtt_prior_s=cfg.rtt_ms / 1000)


def path_fields(link: SimLink) -> dict[str, Any]:
    """One run's bottleneck counts and its controller's end state (RunResult fields)."""
    queue, rate = link.bottleneck, link.controller
    out: dict[str, Any] = {}
    if queue is not None:
        out.update(queue_received=queue.delivered + queue.dropped, queue_dropped=queue.dropped)
        if queue.delays_s:
            out["queue_delay_ms_p95"] = float(np.percentile(queue.delays_s, 95)) * 1000
    if rate is not None:
        out["rate_end"] = {"estimate_mbps": rate.estimate_bps / 1e6, "forecast_mbps": rate.forecast_bps / 1e6,
                           "congestion_events": rate.congestion_events, "rounds": rate.rounds}
    return out


def queue_fields(received: list[int], dropped: list[int], ends: list[dict[str, float]],
                 delay_p95s_ms: Sequence[float] = ()) -> dict[str, Any]:
    """A scheme's report fields: the share of what the bottleneck took that it dropped, the median of the
    runs' queueing-delay P95s, and the controller's mean end state."""
    took = sum(received)
    out: dict[str, Any] = {"queue_drop_share": sum(dropped) / took if took else 0.0}
    if delay_p95s_ms:
        out["queue_delay_ms_p95_median"] = float(np.median(delay_p95s_ms))
    if ends:
        out["rate_end"] = {key: float(np.mean([end[key] for end in ends])) for key in ends[0]}
    return out
