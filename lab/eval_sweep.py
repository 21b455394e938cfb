"""`pfec eval` stage 1: recovered utility of every scheme per (loss config, rho) cell, paired realizations.

The simulator pairs realizations by seed + realization index, so every scheme of a cell meets the same
forward erasures; cells x realizations are spread over worker processes. The real tcp/quic baselines
(``reliable``) are added to the cells of ``cfg.reliable_configs`` afterwards, in real time.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.plan.utility import UtilityProfile
from pfec.common.sched.policies import SCHEMES
from pfec.lab.channel import parse_loss_spec
from pfec.lab.eval_config import EvalConfig
from pfec.lab.progress import StageProgress
from pfec.lab.reliable import run_reliable
from pfec.lab.sim import Handoff, RunResult, SimConfig, forward_losses, prepare, report, run_scheme
from pfec.lab.stats import mean_ci95
from pfec.sender.repair_plan import warm_up

__all__ = ["check_pairing", "reliable_sweep", "utility_sweep"]

_WORKER_HANDOFF: dict[int, Handoff] = {}
SweepTask = tuple[int, SimConfig, tuple[str, ...], int]  # (cell, its simulator config, schemes, realization)


def _handoff(cell: int, config: SimConfig) -> Handoff:
    if cell not in _WORKER_HANDOFF:
        _WORKER_HANDOFF.clear()  # one cell's payload (tens of MB) per process at a time
        _WORKER_HANDOFF[cell] = prepare(config)
    return _WORKER_HANDOFF[cell]


def _run_realization(task: SweepTask) -> tuple[int, list[RunResult | str]]:
    """All schemes on one realization of one cell; a scheme that raises yields its error text."""
    cell, config, names, realization = task
    handoff = _handoff(cell, config)
    out: list[RunResult | str] = []
    for name in names:
        try:
            out.append(run_scheme(handoff, name, realization))
        except Exception as exc:  # one broken scheme must not sink an hour-long sweep
            out.append(f"{name}: {type(exc).__name__}: {exc}")
    return cell, out


def _map(
    tasks: list[SweepTask],
    fn: Callable[[SweepTask], tuple[int, list[RunResult | str]]],
    jobs: int,
    on_done: Callable[[], None],
) -> list[tuple[int, list[RunResult | str]]]:
    if jobs == 1 or len(tasks) == 1:
        warm_up()
        results = []
        for task in tasks:
            results.append(fn(task))
            on_done()
        return results
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(jobs, len(tasks)), initializer=warm_up) as pool:
        results = []
        for result in pool.imap_unordered(fn, tasks):
            results.append(result)
            on_done()
    return results


def _cells(cfg: EvalConfig, profile: UtilityProfile) -> list[tuple[str, float, SimConfig]]:
    return [
        (name, rho, cfg.sim_config(parse_loss_spec(spec), rho, profile))
        for name, spec in cfg.configs
        for rho in cfg.rhos
    ]


def utility_sweep(
    cfg: EvalConfig, sim_schemes: Sequence[str], progress: StageProgress | None = None
) -> list[dict[str, Any]]:
    """One report per (config, rho) cell, every scheme on the same ``cfg.realizations`` loss realizations."""
    profile = cfg.load_profile()
    cells = _cells(cfg, profile)
    names = tuple(sim_schemes)
    tasks = [
        (i, sim, names, r)
        for i, (name, rho, sim) in enumerate(cells)
        for r in range(cfg.realizations_of(name, rho))
    ]
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress("utility sweep", done[0], len(tasks))

    runs: list[dict[str, list[RunResult]]] = [{n: [] for n in names} for _ in cells]
    errors: dict[str, str] = {}
    for cell, results in _map(tasks, _run_realization, cfg.jobs, tick):
        for name, res in zip(names, results, strict=True):
            if isinstance(res, str):
                errors.setdefault(name, res)
            else:
                runs[cell][name].append(res)
    return [_cell_report(name, rho, sim, runs[i], errors) for i, (name, rho, sim) in enumerate(cells)]


def _cell_report(
    config_name: str, rho: float, sim: SimConfig, runs: dict[str, list[RunResult]], errors: dict[str, str]
) -> dict[str, Any]:
    ok = {name: sorted(results, key=lambda r: r.realization) for name, results in runs.items() if results}
    handoff = prepare(sim)
    out = report(handoff, ok) if ok else {"inputs": {}, "schemes": {}}
    out["config"] = config_name
    out["rho"] = rho
    out["errors"] = {n: e for n, e in errors.items() if n in runs}
    out["pairing"] = check_pairing(handoff, ok)
    _add_efficiency(out, ok)
    for name, results in ok.items():
        out["schemes"][name]["n"] = len(results)
        out["schemes"][name]["recovered_utility_runs"] = [r.recovered_utility for r in results]
        out["schemes"][name]["forward_lost_runs"] = [r.forward_lost for r in results]
        out["schemes"][name]["data_sent_runs"] = [r.source_sent + r.repair_sent for r in results]
    return out


def check_pairing(handoff: Handoff, runs: dict[str, list[RunResult]]) -> dict[str, int]:
    """Every session scheme must have lost exactly the datagrams the shared forward pattern of its realization
    erases among the data datagrams it sent (the pattern is indexed by datagram position, not per scheme)."""
    checked = violations = 0
    patterns: dict[int, npt.NDArray[np.bool_]] = {}
    for name, results in runs.items():
        if name not in SCHEMES:  # arq/oracle count their losses their own way (lab/sim.py)
            continue
        for r in results:
            pattern = patterns.setdefault(r.realization, forward_losses(handoff, r.realization))
            sent = r.source_sent + r.repair_sent
            checked += 1
            violations += int(pattern[:sent].sum()) != r.forward_lost
    return {"runs_checked": checked, "violations": violations}


def _add_efficiency(out: dict[str, Any], runs: dict[str, list[RunResult]]) -> None:
    """efficiency = utility / oracle's utility on the same realization (mean of the paired ratios),
    unless the simulator's own report already carries it."""
    oracle = {r.realization: r.recovered_utility for r in runs.get("oracle", [])}
    for name, results in runs.items():
        entry = out["schemes"][name]
        if "efficiency_mean" in entry:
            continue
        ratios = [
            r.recovered_utility / oracle[r.realization] for r in results if oracle.get(r.realization, 0.0) > 0
        ]
        if ratios:
            mean, ci = mean_ci95(ratios)
            entry["efficiency_mean"], entry["efficiency_ci95"] = mean, list(ci)
        else:
            entry["efficiency_mean"], entry["efficiency_ci95"] = None, None


def reliable_sweep(
    cfg: EvalConfig,
    protocols: Sequence[str],
    cells: list[dict[str, Any]],
    progress: StageProgress | None = None,
) -> None:
    """tcp/quic through lab/reliable.py, added to each cell's report (efficiency: ratio of means)."""
    if not protocols or cfg.reliable_realizations == 0:
        return
    profile = cfg.load_profile()
    for i, cell in enumerate(cells):
        if cell["config"] not in cfg.reliable_configs:
            continue
        spec = dict(cfg.configs)[cell["config"]]
        sim = cfg.sim_config(parse_loss_spec(spec), cell["rho"], profile)
        for proto in protocols:
            try:
                res = run_reliable(proto, sim, cfg.reliable_realizations, None)["schemes"][proto]
            except Exception as exc:
                cell["errors"][proto] = f"{proto}: {type(exc).__name__}: {exc}"
                continue
            oracle = cell["schemes"].get("oracle", {}).get("recovered_utility_mean")
            res.setdefault("efficiency_mean", res["recovered_utility_mean"] / oracle if oracle else None)
            res.setdefault("efficiency_ci95", None)
            res.setdefault("n", cfg.reliable_realizations)
            cell["schemes"][proto] = res
        if progress is not None:
            progress("tcp/quic", i + 1, len(cells))
