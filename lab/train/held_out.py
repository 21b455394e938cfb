"""Held-out comparison of the learned scheduler (``priorityfec``: utility order + DDQN) with the deficit
heuristic (``heuristic``: utility order + ``DeficitHeuristic``), on conditions declared before training.

``HELDOUT_CONDITIONS`` and ``HELDOUT_SEED`` were fixed before the committed training run and are never
drawn by it: every condition has a context size (320 tokens) outside the training set, most have a further
parameter outside the training ranges (RTT 300 ms, rho 0.25, 90% bad-state loss with 67-slot bursts,
400 Mbit/s, ...; ``outside_support`` lists them, ``tests/test_sched_eval.py`` checks it), all use the
shipped measured utility profile (training uses synthetic ones) and their loss realizations come from
``HELDOUT_SEED``, which ``TrainConfig`` refuses as a training seed.

Paired realizations: both schemes meet the same erasure pattern (``lab/sim/`` draws it from the seed and
realization index). The measure is the paired difference DDQN - heuristic of recovered utility, in points
(1 point = 0.01 of the total utility), with a 95% Student-t interval per condition and pooled over all
pairs. While the DDQN plays, the heuristic's action on the same state is computed too, so the report gives
the share of decisions where the two differ.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile
from pfec.common.sched.actions import Action, SchedulerView
from pfec.common.sched.policies import DeficitHeuristic, Policy, Scheme, get_scheme
from pfec.lab.reporting.stats import mean_ci95
from pfec.lab.sim.channel import GilbertElliott
from pfec.lab.sim.simulate import SimConfig, prepare, run_once
from pfec.lab.train.episodes import EpisodeRanges, outside_support

HELDOUT_SEED = 7_310_513  # the loss realizations' seed; training refuses it
EVAL_PATH = Path(__file__).resolve().parents[2] / "docs" / "training" / "heldout_eval.json"
NEVER_WORSE_POINTS = -0.5  # "never worse" needs the CI's lower end above this


@dataclass(frozen=True)
class HeldoutCondition:
    name: str
    tokens: int
    rate_mbps: float
    rtt_ms: float
    rho: float
    ge: tuple[float, float, float, float]  # eps_g, eps_b, p_gb, p_bg

    @property
    def loss(self) -> GilbertElliott:
        return GilbertElliott(*self.ge)

    def sim_config(self, profile: UtilityProfile) -> SimConfig:
        return SimConfig(loss=self.loss, rate_mbps=self.rate_mbps, rtt_ms=self.rtt_ms, rho=self.rho,
                         tokens=self.tokens, profile=profile, seed=HELDOUT_SEED)

    def outside(self, ranges: EpisodeRanges) -> list[str]:
        return outside_support(ranges, self.tokens, self.rate_mbps, self.rtt_ms, self.rho, self.loss)


# Declared before training; do not tune. Long RTT, short deadline and long bursts are the conditions the
# issue names; the last one differs from training only in context size and link rate.
HELDOUT_CONDITIONS: tuple[HeldoutCondition, ...] = (
    HeldoutCondition("long-rtt", 320, 100.0, 300.0, 0.8, (0.001, 0.5, 0.02, 0.1)),
    HeldoutCondition("short-deadline", 320, 100.0, 20.0, 0.25, (0.001, 0.5, 0.02, 0.1)),
    HeldoutCondition("long-bursts", 320, 50.0, 40.0, 0.9, (0.002, 0.9, 0.01, 0.015)),
    HeldoutCondition("fast-link", 320, 400.0, 100.0, 0.7, (0.003, 0.6, 0.03, 0.1)),
    HeldoutCondition("frequent-bursts", 320, 75.0, 150.0, 0.5, (0.004, 0.7, 0.06, 0.2)),
    HeldoutCondition("in-range-combo", 320, 150.0, 60.0, 0.6, (0.002, 0.45, 0.03, 0.08)),
)


class _DisagreementProbe:
    """Plays the DDQN's action and counts the states where the heuristic would have chosen otherwise."""

    name = "ddqn-probe"
    sends_repairs = True
    open_loop = False

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.heuristic = DeficitHeuristic()
        self.decisions = 0
        self.differ = 0

    def decide(self, view: SchedulerView) -> Action:
        action = self.inner.decide(view)
        self.decisions += 1
        self.differ += int(action != self.heuristic.decide(view))
        return action

    def reset(self) -> None:
        self.inner.reset()


def _ddqn(weights: str | None) -> Policy:
    from pfec.common.sched.ddqn import DDQNPolicy, load_weights  # deferred: numba kernels

    return DDQNPolicy(None if weights is None else load_weights(weights))


def _run_condition(cond: HeldoutCondition, realizations: int, weights: str | None) -> dict[str, Any]:
    """Paired runs of one condition: per-realization utilities and the decision disagreement."""
    handoff = prepare(cond.sim_config(UtilityProfile.load(SHIPPED_PROFILE)))
    probe = _DisagreementProbe(_ddqn(weights))
    learned = Scheme("priorityfec", get_scheme("priorityfec").order, lambda: probe, "DDQN (probed)")
    heuristic = get_scheme("heuristic")
    ddqn_u, heur_u = [], []
    for r in range(realizations):
        ddqn_u.append(run_once(handoff, learned, r, verify=False).recovered_utility)
        heur_u.append(run_once(handoff, heuristic, r, verify=False).recovered_utility)
    return {"ddqn": ddqn_u, "heuristic": heur_u, "decisions": probe.decisions, "differ": probe.differ}


def paired_summary(ddqn: Sequence[float], heuristic: Sequence[float]) -> dict[str, Any]:
    """Mean paired difference DDQN - heuristic in points with its 95% t interval, and both means."""
    if len(ddqn) != len(heuristic) or not ddqn:
        raise ValueError(f"paired samples need equal, non-zero lengths, got {len(ddqn)} and {len(heuristic)}")
    diff = 100.0 * (np.asarray(ddqn, dtype=np.float64) - np.asarray(heuristic, dtype=np.float64))
    mean, (low, high) = mean_ci95(list(diff))
    return {"n": len(diff), "diff_points_mean": mean, "diff_points_ci95": [low, high],
            "ddqn_utility_mean": float(np.mean(ddqn)), "heuristic_utility_mean": float(np.mean(heuristic)),
            "ddqn_better": int((diff > 0).sum()), "heuristic_better": int((diff < 0).sum())}


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Which scheme wins by the paired CI, the daemons' default that follows, and the never-worse test."""
    low, high = summary["diff_points_ci95"]
    winner = "priorityfec" if low > 0 else ("heuristic" if high < 0 else "tie")
    return {"winner": winner, "default_scheme": "priorityfec" if winner == "priorityfec" else "heuristic",
            "never_worse": bool(low > NEVER_WORSE_POINTS)}


def _weights_info(weights: str | None) -> dict[str, Any]:
    from pfec.common.sched.ddqn import WEIGHTS_PATH  # deferred: numba kernels

    path = Path(weights) if weights is not None else WEIGHTS_PATH
    info: dict[str, Any] = {"path": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    with np.load(path) as data:
        if "meta" in data:
            meta = json.loads(str(data["meta"]))
            info.update({k: meta.get(k) for k in ("warm_start", "checkpoint_episode", "validation_utility",
                                                   "validation_heuristic", "command", "wall_s")})
    return info


def heldout_comparison(realizations: int = 50, jobs: int = 1, weights: str | None = None,
                       conditions: Sequence[HeldoutCondition] = HELDOUT_CONDITIONS,
                       progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """DDQN vs heuristic on the held-out conditions, ``realizations`` paired runs each."""
    if realizations < 2:
        raise ValueError(f"realizations must be >= 2 for a confidence interval, got {realizations!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    ranges = EpisodeRanges()
    leaking = [c.name for c in conditions if not c.outside(ranges)]
    if leaking:
        raise ValueError(f"held-out conditions {leaking} lie inside the training distribution")
    if jobs == 1:
        runs = []
        for k, cond in enumerate(conditions):
            runs.append(_run_condition(cond, realizations, weights))
            if progress is not None:
                progress(k + 1, len(conditions))
    else:  # spawn, not fork: a forked numba/torch parent is not safe to inherit
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = list(pool.map(_run_condition, conditions, [realizations] * len(conditions),
                                 [weights] * len(conditions)))
    per_condition = []
    for cond, run in zip(conditions, runs, strict=True):
        per_condition.append({**asdict(cond), "outside_training": cond.outside(ranges),
                              **paired_summary(run["ddqn"], run["heuristic"]),
                              "decisions": run["decisions"],
                              "decision_disagreement": run["differ"] / max(1, run["decisions"])})
    pooled = paired_summary([u for run in runs for u in run["ddqn"]],
                            [u for run in runs for u in run["heuristic"]])
    decisions = sum(run["decisions"] for run in runs)
    pooled["decision_disagreement"] = sum(run["differ"] for run in runs) / max(1, decisions)
    return {"seed": HELDOUT_SEED, "realizations": realizations, "profile": SHIPPED_PROFILE.stem,
            "weights": _weights_info(weights), "conditions": per_condition, "pooled": pooled,
            **verdict(pooled)}


def _pts(value: float) -> str:
    return f"{value:+.2f}"


def render_markdown(result: dict[str, Any]) -> str:
    """A short section: who won on the held-out conditions and by how much, then the per-condition table."""
    pooled = result["pooled"]
    low, high = pooled["diff_points_ci95"]
    mean = pooled["diff_points_mean"]
    ci = f"{_pts(mean)} points [{_pts(low)}, {_pts(high)}] (95% CI, n = {pooled['n']} paired runs)"
    if result["winner"] == "priorityfec":
        lead = f"The DDQN (`priorityfec`) beats the deficit heuristic on the held-out conditions: {ci}."
    elif result["winner"] == "heuristic":
        lead = ("The deficit heuristic beats the DDQN (`priorityfec`) on the held-out conditions: "
                f"DDQN - heuristic = {ci}.")
    else:
        lead = (f"Neither scheme wins on the held-out conditions: DDQN - heuristic = {ci}; the interval "
                "contains 0.")
    never = ("The DDQN is never worse by more than half a point (the CI's lower end is above -0.5)."
             if result["never_worse"] else
             "A 'never worse' claim does not hold: the CI's lower end is below -0.5 points.")
    default = (f"The daemons' default scheme is `{result['default_scheme']}`"
               + (" (the DDQN wins by the paired CI)." if result["default_scheme"] == "priorityfec"
                  else " (the DDQN does not win by the paired CI)."))
    share = f"{100 * pooled['decision_disagreement']:.1f}%"
    weights = result["weights"]
    lines = [
        lead, never, default,
        f"The DDQN's action differs from the heuristic's on {share} of its decisions on these conditions "
        f"(weights: {weights.get('warm_start')}; checkpoint at RL episode "
        f"{weights.get('checkpoint_episode')}).",
        "",
        "| condition | tokens | rate Mbit/s | RTT ms | rho | GE (eps_g, eps_b, p_gb, p_bg) | heuristic "
        "| DDQN | DDQN - heuristic, points [95% CI] | differing decisions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["conditions"]:
        lo, hi = c["diff_points_ci95"]
        lines.append(
            f"| {c['name']} | {c['tokens']} | {c['rate_mbps']:g} | {c['rtt_ms']:g} | {c['rho']:g} | "
            f"{', '.join(f'{v:g}' for v in c['ge'])} | {c['heuristic_utility_mean']:.4f} | "
            f"{c['ddqn_utility_mean']:.4f} | {_pts(c['diff_points_mean'])} [{_pts(lo)}, {_pts(hi)}] | "
            f"{100 * c['decision_disagreement']:.1f}% |")
    lines.append(
        f"| pooled | | | | | | {pooled['heuristic_utility_mean']:.4f} | {pooled['ddqn_utility_mean']:.4f} | "
        f"{_pts(mean)} [{_pts(low)}, {_pts(high)}] | {share} |")
    return "\n".join(lines) + "\n"


def write_result(result: dict[str, Any], path: Path = EVAL_PATH) -> None:
    """The JSON and, next to it, the markdown section (``heldout_eval.md``)."""
    path.write_text(json.dumps(result, indent=2) + "\n")
    header = ("# Learned scheduler vs heuristic on held-out conditions\n\n"
              "Written by `pfec train --evaluate` (lab/train/held_out.py); do not edit by hand.\n\n")
    path.with_suffix(".md").write_text(header + render_markdown(result))
