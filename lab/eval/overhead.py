"""`pfec eval` stage 4: CPU per 1000 transmitted packets by component, and the scheduler's decide() latency.

Main loss config at ``cfg.overhead_rhos``, one process, after the kernels are warmed up. Only session
schemes are timed (arq and the oracle run no sessions).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pfec.common.sched.actions import Action, SchedulerView
from pfec.common.sched.policies import SCHEMES, Policy, Scheme, get_scheme
from pfec.lab.eval.config import EvalConfig
from pfec.lab.reporting.progress import StageProgress
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.simulate import Handoff, prepare, report, run_once
from pfec.sender.transport.repair_plan import warm_up

__all__ = ["TimedPolicy", "overhead"]


class TimedPolicy:
    """Pass-through around a scheme's policy that records each ``decide`` call's wall time (ns)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.sends_repairs = inner.sends_repairs
        self.samples_ns: list[int] = []

    def decide(self, view: SchedulerView) -> Action:
        t0 = time.perf_counter_ns()
        action = self.inner.decide(view)
        self.samples_ns.append(time.perf_counter_ns() - t0)
        return action

    def reset(self) -> None:
        self.inner.reset()

    def __getattr__(self, item: str) -> Any:  # anything else a session may ask the real policy
        return getattr(self.inner, item)


def overhead(
    cfg: EvalConfig, sim_schemes: Sequence[str], progress: StageProgress | None = None
) -> list[dict[str, Any]]:
    """Main config, ``cfg.overhead_rhos``: CPU ms per 1000 data packets and decide() latency, one process."""
    if cfg.overhead_realizations == 0:
        return []
    warm_up()
    profile = cfg.load_profile()
    main_spec = cfg.main_loss_spec()
    rows = []
    timed_schemes = [s for s in sim_schemes if s in SCHEMES]  # arq/oracle run no sessions: nothing to time
    total = len(cfg.overhead_rhos) * len(timed_schemes)
    for rho in cfg.overhead_rhos:
        handoff = prepare(cfg.sim_config(parse_loss_spec(main_spec), rho, profile))
        for name in timed_schemes:
            rows.append(_overhead_row(handoff, get_scheme(name), cfg.overhead_realizations, rho))
            if progress is not None:
                progress("overhead", len(rows), total)
    return rows


def _overhead_row(handoff: Handoff, scheme: Scheme, realizations: int, rho: float) -> dict[str, Any]:
    timed: list[TimedPolicy] = []

    def make() -> Policy:
        timed.append(TimedPolicy(scheme.make_policy()))
        return timed[-1]

    wrapped = Scheme(scheme.name, scheme.order, make, scheme.description)
    results = [run_once(handoff, wrapped, r) for r in range(realizations)]
    summary = report(handoff, {scheme.name: results})["schemes"][scheme.name]
    per_1k = summary["cpu_ms_per_1k_packets"]
    samples = np.concatenate([np.asarray(t.samples_ns, dtype=np.float64) for t in timed]) / 1000.0
    decisions = sum(r.decisions for r in results)
    policy_ns = sum(r.cpu_ns["policy"] for r in results)
    slot_us = handoff.slot_s * 1e6
    return {
        "scheme": scheme.name,
        "rho": rho,
        "realizations": realizations,
        "state_feedback_ms": per_1k["feedback"],
        "policy_ms": per_1k["policy"],
        "encode_ms": per_1k["encode"],
        "decode_ms": per_1k["decode"],
        "total_ms": sum(per_1k[k] for k in ("feedback", "policy", "encode", "decode")),
        "decision_path_mean_us": policy_ns / decisions / 1000.0 if decisions else math.nan,
        "decide_mean_us": float(samples.mean()) if samples.size else math.nan,
        "decide_p99_us": float(np.percentile(samples, 99)) if samples.size else math.nan,
        "decide_overrun_pct": float((samples > slot_us).mean() * 100) if samples.size else math.nan,
        "slot_us": slot_us,
        "decisions": decisions,
    }
