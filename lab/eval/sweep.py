"""`pfec eval` stage 1: recovered utility of every scheme per (loss config, rho) cell, paired realizations,
and the RTT x context x rho grid.

The simulator pairs realizations by seed + realization index, so every scheme of a cell meets the same
forward (and reverse) erasures; cells x realizations are spread over worker processes. The real tcp/quic
baselines (``reliable_sweep``: each RELIABLE_SCHEMES name, TCP once per congestion control) are added to the
cells of ``cfg.reliable_configs`` at ``cfg.reliable_rhos`` afterwards, in real time. ``grid_sweep`` runs
``cfg.grid_schemes`` over RTT x context x rho (main config, native precision) plus priorityfec with the
break-even planner's precision (``--precision auto``), scored by credited utility.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.common.plan.mode_choice import choose_mix, handoff_deadline_s
from pfec.common.plan.stream import AUTO, NATIVE
from pfec.common.plan.utility import UtilityProfile
from pfec.common.sched.policies import SCHEMES
from pfec.lab.baselines.reliable import run_reliable
from pfec.lab.eval.config import GRID_AUTO, EvalConfig
from pfec.lab.reporting.progress import StageProgress
from pfec.lab.reporting.stats import mean_ci95, mean_ci95_fields
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.simulate import Handoff, RunResult, SimConfig, forward_losses, prepare, report, run_scheme
from pfec.sender.transport.repair_plan import warm_up

__all__ = ["check_pairing", "grid_sweep", "reliable_sweep", "run_realizations", "utility_sweep"]

CellKey = Hashable  # unique within one `pfec eval` run: ("sweep", i), ("grid", i), ...
_WORKER_HANDOFF: dict[CellKey, Handoff] = {}
SweepTask = tuple[CellKey, SimConfig, tuple[str, ...], int]  # (cell, its sim config, schemes, realization)


def _handoff(cell: CellKey, config: SimConfig) -> Handoff:
    if cell not in _WORKER_HANDOFF:
        _WORKER_HANDOFF.clear()  # one cell's payload (tens of MB) per process at a time
        _WORKER_HANDOFF[cell] = prepare(config)
    return _WORKER_HANDOFF[cell]


def _run_realization(task: SweepTask) -> tuple[CellKey, list[RunResult | str]]:
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
    fn: Callable[[SweepTask], tuple[CellKey, list[RunResult | str]]],
    jobs: int,
    on_done: Callable[[], None],
) -> list[tuple[CellKey, list[RunResult | str]]]:
    if jobs == 1 or len(tasks) == 1:
        warm_up()
        results = []
        for task in tasks:
            results.append(fn(task))
            on_done()
        return results
    # spawn, not fork: a forked worker inherits the parent's threads (asyncio executors, tqdm's monitor) and
    # signal handlers mid-state; one that ignores SIGTERM outlives Pool.terminate() and hangs the join.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(jobs, len(tasks)), initializer=warm_up) as pool:
        results = []
        for result in pool.imap_unordered(fn, tasks):
            results.append(result)
            on_done()
    return results


def run_realizations(tasks: list[SweepTask], jobs: int, stage: str, progress: StageProgress | None = None,
                     ) -> list[tuple[CellKey, list[RunResult | str]]]:
    """Every task's schemes on its realization, over ``jobs`` worker processes, ticking ``stage``."""
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(stage, done[0], len(tasks))

    return _map(tasks, _run_realization, jobs, tick)


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
    tasks: list[SweepTask] = [
        (("sweep", i), sim, names, r)
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
    for key, results in _map(tasks, _run_realization, cfg.jobs, tick):
        cell = key[1]  # type: ignore[index]
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
        if name not in SCHEMES:  # arq/oracle count their losses their own way (lab/sim/simulate.py)
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
    """The real-transport rows (``cfg.reliable_rows``: tcp per congestion control, quic; both orders) through
    lab/baselines/, added to the cells of ``cfg.reliable_configs`` at ``cfg.reliable_rhos`` under their row
    label (``tcp/cubic``, ``priority-quic``...). Realization r meets the simulator's forward realization r,
    so efficiency is paired with the cell's oracle; stalled runs stay in every mean and are listed."""
    if not protocols or cfg.reliable_realizations == 0:
        return
    profile = cfg.load_profile()
    rows = cfg.reliable_rows(protocols)
    chosen = [c for c in cells if c["config"] in cfg.reliable_configs
              and any(math.isclose(c["rho"], r) for r in cfg.reliable_rhos)]  # fmt: skip
    total, done = len(chosen) * len(rows) * cfg.reliable_realizations, 0
    for cell in chosen:
        spec = dict(cfg.configs)[cell["config"]]
        sim = cfg.sim_config(parse_loss_spec(spec), cell["rho"], profile)
        for row in rows:
            base = done

            def tick(k: int, _n: int, base: int = base) -> None:
                if progress is not None:
                    progress("tcp/quic (real time)", base + k, total)

            try:
                out = run_reliable(row.scheme, sim, cfg.reliable_realizations, tick, row.congestion)
                res = out["schemes"][row.scheme]
            except Exception as exc:  # e.g. no root for kernel TCP, or a congestion control not offered
                cell["errors"][row.label] = f"{row.label}: {type(exc).__name__}: {exc}"
                continue
            finally:
                done = base + cfg.reliable_realizations
            res["scheme"], res["congestion"] = row.scheme, row.congestion
            res["n"] = len(res["runs"])
            res["recovered_utility_runs"] = [r["utility"] for r in res["runs"]]
            _reliable_efficiency(res, cell)
            cell["schemes"][row.label] = res


def _reliable_efficiency(res: dict[str, Any], cell: dict[str, Any]) -> None:
    """Efficiency of a real-transport row: paired with the oracle on the same realization when the cell's
    oracle ran that realization, else the ratio of means (said in ``efficiency_kind``)."""
    oracle = cell["schemes"].get("oracle", {})
    bound = oracle.get("recovered_utility_runs") or []
    ratios = [r["utility"] / bound[r["realization"]] for r in res["runs"]
              if r["realization"] < len(bound) and bound[r["realization"]] > 0]  # fmt: skip
    if ratios and len(ratios) == len(res["runs"]):
        mean, ci = mean_ci95(ratios)
        res["efficiency_mean"], res["efficiency_ci95"], res["efficiency_kind"] = mean, list(ci), "paired"
    elif oracle.get("recovered_utility_mean"):
        res["efficiency_mean"] = res["recovered_utility_mean"] / oracle["recovered_utility_mean"]
        res["efficiency_ci95"], res["efficiency_kind"] = None, "ratio of means"
    else:
        res["efficiency_mean"], res["efficiency_ci95"], res["efficiency_kind"] = None, None, "no oracle"


# --------------------------------------------------------------------------- RTT x context x rho grid


def grid_cells(cfg: EvalConfig) -> list[dict[str, Any]]:
    """The grid's cells, largest first (the longest tasks start first): RTT, tokens, rho, and the mix that
    ``--precision auto`` picks for that handoff (the break-even planner, ``mode_choice.choose_mix``)."""
    cells = []
    for tokens in sorted(cfg.grid_tokens, reverse=True):
        for rtt in cfg.grid_rtts_ms:
            for rho in cfg.grid_rhos:
                rate_bps = cfg.rate_mbps * 1e6
                deadline_s = handoff_deadline_s(tokens, DEFAULT_GEOMETRY, rate_bps, rtt / 2000, rho)
                mix, planner = choose_mix(AUTO, tokens, DEFAULT_GEOMETRY, rate_bps, rtt / 1000,
                                          deadline_s=deadline_s)
                cells.append({"rtt_ms": rtt, "tokens": tokens, "rho": rho, "auto_precision": mix,
                              "planner": planner})  # fmt: skip
    return cells


def grid_sweep(
    cfg: EvalConfig, available: Sequence[str], progress: StageProgress | None = None
) -> dict[str, Any]:
    """``cfg.grid_schemes`` (those available) on every grid cell, main config, native precision, plus the
    ``priorityfec@auto`` row (the planner's precision; utility credited at the level each block reached)."""
    schemes = tuple(s for s in cfg.grid_schemes if s in available)
    out: dict[str, Any] = {"schemes": list(schemes), "cells": []}
    if cfg.grid_realizations == 0 or not schemes:
        out["skipped"] = "--grid-realizations 0" if cfg.grid_realizations == 0 else "no grid scheme available"
        return out
    profile = cfg.load_profile()
    loss = parse_loss_spec(cfg.main_loss_spec())
    cells = grid_cells(cfg)
    auto = cfg.grid_auto and "priorityfec" in available
    tasks: list[SweepTask] = []
    for i, c in enumerate(cells):
        sim = cfg.sim_config(loss, c["rho"], profile, rtt_ms=c["rtt_ms"], tokens=c["tokens"])
        tasks += [(("grid", i), sim, schemes, r) for r in range(cfg.grid_realizations)]
        if auto and c["auto_precision"] != NATIVE:  # native: the native row is that row
            sim_auto = cfg.sim_config(loss, c["rho"], profile, rtt_ms=c["rtt_ms"], tokens=c["tokens"],
                                      precision=c["auto_precision"])  # fmt: skip
            tasks += [(("grid-auto", i), sim_auto, ("priorityfec",), r) for r in range(cfg.grid_realizations)]
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress("RTT x context x rho grid", done[0], len(tasks))

    runs: dict[CellKey, dict[str, list[RunResult]]] = {}
    errors: dict[str, str] = {}
    for key, results in _map(tasks, _run_realization, cfg.jobs, tick):
        names = schemes if key[0] == "grid" else ("priorityfec",)  # type: ignore[index]
        for name, res in zip(names, results, strict=True):
            if isinstance(res, str):
                errors.setdefault(name, res)
            else:
                runs.setdefault(key, {}).setdefault(name, []).append(res)
    for i, c in enumerate(cells):
        native = {n: sorted(v, key=lambda r: r.realization) for n, v in runs.get(("grid", i), {}).items()}
        c["schemes"] = {name: _grid_entry(results, native.get("oracle")) for name, results in native.items()}
        if auto:
            rows = runs.get(("grid-auto", i), {}).get("priorityfec") if c["auto_precision"] != NATIVE else (
                native.get("priorityfec"))
            if rows:
                c["schemes"][GRID_AUTO] = _grid_entry(sorted(rows, key=lambda r: r.realization),
                                                      native.get("oracle"), credited=True)  # fmt: skip
        c["lead_over_priority_arq"] = _paired_points(native, "priorityfec", "priority-arq")
        c["lead_over_arq"] = _paired_points(native, "priorityfec", "arq")
    out["cells"] = cells
    out["errors"] = errors
    out["realizations"] = cfg.grid_realizations
    return out


def _grid_entry(results: list[RunResult], oracle: list[RunResult] | None, credited: bool = False,
                ) -> dict[str, Any]:
    """Utility and efficiency (share of the native oracle on the same realization) of one grid row."""
    entry: dict[str, Any] = {
        **mean_ci95_fields("recovered_utility", [r.recovered_utility for r in results]),
        "recovered_utility_runs": [r.recovered_utility for r in results],
        "n": len(results),
    }
    if credited:  # quantised precision: utility is credited at each block's level; also the plain share
        entry["utility_kind"] = "credited at precision"
        entry.update(mean_ci95_fields("recovered_block_utility",
                                      [r.block_utility if r.block_utility is not None else r.recovered_utility
                                       for r in results]))  # fmt: skip
    bound = {r.realization: r.recovered_utility for r in oracle or []}
    ratios = [r.recovered_utility / bound[r.realization] for r in results if bound.get(r.realization, 0) > 0]
    if ratios:
        entry.update(mean_ci95_fields("efficiency", ratios))
    else:
        entry["efficiency_mean"], entry["efficiency_ci95"] = None, None
    return entry


def _paired_points(runs: dict[str, list[RunResult]], a: str, b: str) -> dict[str, Any] | None:
    """utility(a) - utility(b) in points, paired by realization: mean and 95% CI."""
    if a not in runs or b not in runs:
        return None
    rb = {r.realization: r.recovered_utility for r in runs[b]}
    diffs = [100 * (r.recovered_utility - rb[r.realization]) for r in runs[a] if r.realization in rb]
    if not diffs:
        return None
    mean, ci = mean_ci95(diffs)
    return {"mean": mean, "ci95": list(ci), "n": len(diffs)}
