"""Grid search of FlEC-RT's parameters on paired realizations (how the shipped defaults were chosen).

    python -m common.flec_tune --realizations 4 --json

Runs the real sessions (common/sim.py) for every parameter combination on the same forward loss
realizations of a tuning seed kept apart from the evaluation seed, and ranks the combinations by mean
recovered utility (ties: fewer repairs).
"""

from __future__ import annotations

import itertools
import json
import sys
from functools import partial
from typing import Annotated, Any

import typer

from pfec.common.plan.deadline import DEFAULT_RHO
from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile
from pfec.common.sched.flec import FlecRT
from pfec.common.sched.policies import Scheme
from pfec.lab.channel import parse_loss_spec
from pfec.lab.sim import SimConfig, mean_ci95, prepare, run_once

GRID: dict[str, tuple[float, ...]] = {
    "burst_weight": (0.0, 1.0, 3.0),
    "fill": (0.5, 0.75, 1.0),
    "deadline_rtts": (1.5, 3.0),
    "inflate": (1.0,),
}

app = typer.Typer(add_completion=False)


def tune(
    config: SimConfig, realizations: int, grid: dict[str, tuple[float, ...]], progress: Any = None
) -> list[dict[str, Any]]:
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


def _values(name: str, given: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in given.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} takes comma-separated numbers, got {given!r}") from None


@app.command()
def main(
    realizations: Annotated[int, typer.Option(help="Paired realizations per combination.")] = 4,
    seed: Annotated[int, typer.Option(help="Tuning seed (keep it apart from the evaluation seed 1).")] = 101,
    rho: Annotated[float, typer.Option(help="Deadline as (D - T_ow) / T_ser.")] = DEFAULT_RHO,
    loss: Annotated[str, typer.Option(help="Loss spec.")] = "ge:0.001,0.5,0.02,0.1",
    burst_weight: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    fill: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    deadline_rtts: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    inflate: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    from pfec.cli.app import _progress

    if realizations < 1:
        raise typer.BadParameter(f"--realizations must be >= 1, got {realizations}")
    try:
        grid = dict(GRID)
        options = {
            "burst_weight": burst_weight, "fill": fill, "deadline_rtts": deadline_rtts, "inflate": inflate,
        }  # fmt: skip
        for name, given in options.items():
            if given is not None:
                grid[name] = _values(name, given)
        for values in itertools.product(*grid.values()):
            FlecRT(**dict(zip(grid, values, strict=True)))  # rejects a bad value before any run
        config = SimConfig(
            loss=parse_loss_spec(loss), rho=rho, profile=UtilityProfile.load(SHIPPED_PROFILE), seed=seed
        )
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    rows = tune(config, realizations, grid, _progress("flec-rt tuning"))
    if as_json:
        typer.echo(json.dumps({"loss": loss, "rho": rho, "seed": seed, "realizations": realizations,
                               "ranking": rows}, indent=2))  # fmt: skip
        return
    for row in rows:
        sys.stdout.write(
            f"burst_weight {row['burst_weight']:>4} fill {row['fill']:>5} "
            f"deadline_rtts {row['deadline_rtts']:>4}  utility {row['utility_mean']:.4f}  "
            f"repairs {row['repair_sent_mean']:.0f}\n"
        )


if __name__ == "__main__":
    app()
