"""Grid search of FlEC-RT's parameters on paired realizations (how the shipped defaults were chosen).

    pfec tune flec-rt --realizations 4 --json

Runs the real sessions (lab/sim/simulate.py) for every parameter combination on the same forward loss
realizations of a tuning seed kept apart from the evaluation seed, and ranks the combinations by mean
recovered utility (ties: fewer repairs).
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

from pfec.common.sched.flec import FlecRT
from pfec.common.sched.policies import Scheme
from pfec.lab.reporting.progress import Progress
from pfec.lab.reporting.stats import mean_ci95
from pfec.lab.sim.simulate import SimConfig, prepare, run_once

__all__ = ["GRID", "format_ranking", "tune", "tuning_grid"]

GRID: dict[str, tuple[float, ...]] = {
    "burst_weight": (0.0, 1.0, 3.0),
    "fill": (0.5, 0.75, 1.0),
    "deadline_rtts": (1.5, 3.0),
    "inflate": (1.0,),
}


def tuning_grid(overrides: dict[str, str | None]) -> dict[str, tuple[float, ...]]:
    """``GRID`` with the given parameters replaced by comma-separated values; ValueError for a bad value
    (checked by building every combination's FlecRT before any run)."""
    grid = dict(GRID)
    for name, given in overrides.items():
        if given is not None:
            grid[name] = _values(name, given)
    for values in itertools.product(*grid.values()):
        FlecRT(**dict(zip(grid, values, strict=True)))
    return grid


def _values(name: str, given: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in given.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} takes comma-separated numbers, got {given!r}") from None


def tune(
    config: SimConfig, realizations: int, grid: dict[str, tuple[float, ...]], progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Every combination of ``grid`` on the same ``realizations``, best first."""
    handoff = prepare(config)
    combos = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    rows: list[dict[str, Any]] = []
    for i, params in enumerate(combos):
        scheme = Scheme("flec-rt", "fifo", partial(FlecRT, **params), "tuning candidate")
        runs = [run_once(handoff, scheme, r, verify=False) for r in range(realizations)]
        mean, ci = mean_ci95([r.recovered_utility for r in runs])
        repairs = sum(r.repair_sent for r in runs) / realizations
        rows.append({**params, "utility_mean": mean, "utility_ci95": list(ci), "repair_sent_mean": repairs})
        if progress is not None:
            progress(i + 1, len(combos))
    rows.sort(key=lambda row: (-float(row["utility_mean"]), float(row["repair_sent_mean"])))
    return rows


def format_ranking(rows: list[dict[str, Any]]) -> str:
    """One line per combination, best first."""
    return "\n".join(
        f"burst_weight {row['burst_weight']:>4} fill {row['fill']:>5} "
        f"deadline_rtts {row['deadline_rtts']:>4}  utility {row['utility_mean']:.4f}  "
        f"repairs {row['repair_sent_mean']:.0f}"
        for row in rows
    )
