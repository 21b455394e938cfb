"""`pfec eval`: the paper's experiments (V-B..V-F) reproduced on this code base.

Stages, each a function of an ``EvalConfig`` (``config``):

1. ``eval_sweep.utility_sweep``: recovered utility of every scheme on paired loss realizations for each
   (loss config, rho) cell; ``eval_sweep.reliable_sweep`` adds the real tcp/quic runs (TCP per congestion
   control, both orders). Schemes that are not registered (or fail to build) are listed as missing.
   ``eval_sweep.grid_sweep``: priorityfec, priority-arq, arq and the oracle over RTT x context x rho (main
   config, native precision) and priorityfec with ``--precision auto``.
2. ``eval_task.task_scores``: needle-QA answers generated from the partial KV cache each scheme delivers
   (its recovered block set on one realization per prompt), mask and zero receivers, every scheme scored.
3. ``ablation``: priority / rl-fec / priority-fixed / priorityfec rows picked from stages 1 and 2.
4. ``eval_overhead.overhead``: CPU per 1000 transmitted packets by component and the scheduler's decision
   latency.
5. ``eval_precision.precision_scores``: needle-QA answers from the cache each precision variant delivers
   (native-only, each fixed mix, the planner's auto mix, split), paired against native-only.
6. ``sched_eval.heldout_comparison``: the DDQN (priorityfec) against the deficit heuristic on the
   held-out conditions declared before training, paired; which one wins decides the daemons' default.

``run_eval`` runs them in order; ``eval_report.write_outputs`` turns the result into CSV + JSON
(docs/results/), figures (docs/figures/eval_*.png) and the generated section of docs/RESULTS.md.
``write_example_trace`` writes the synthetic loss trace that the ``trace`` config replays.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pfec.lab.eval.config import (
    ABLATION_RHOS,
    ABLATION_SCHEMES,
    FALLBACK,
    MODES,
    NAMED_CONFIGS,
    RELIABLE,
    EvalConfig,
    scheme_definitions,
    scheme_status,
    stand_in,
)
from pfec.lab.eval.overhead import overhead
from pfec.lab.eval.sweep import grid_sweep, reliable_sweep, utility_sweep
from pfec.lab.eval.traces import trace_sweep
from pfec.lab.reporting.progress import StageProgress
from pfec.lab.sim.channel import GilbertElliott, realization_rng, write_trace
from pfec.lab.sim.simulate import whole_deadline_base
from pfec.lab.train.held_out import heldout_comparison

__all__ = ["ablation", "run_eval", "write_example_trace"]


def run_eval(cfg: EvalConfig, progress: StageProgress | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    available, missing = scheme_status(cfg.schemes)
    if cfg.reliable_realizations == 0:
        for name in [s for s in available if s in RELIABLE]:
            available.remove(name)
            missing[name] = "skipped (--reliable-realizations 0)"
    sim_schemes = [s for s in available if s not in RELIABLE]
    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    cells = utility_sweep(cfg, sim_schemes, progress)
    stages["utility_sweep"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    grid = grid_sweep(cfg, available, progress)
    stages["grid"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reliable_sweep(cfg, [s for s in available if s in RELIABLE], cells, progress)
    stages["reliable"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    traces = trace_sweep(cfg, available, progress)
    stages["traces"] = time.perf_counter() - t0
    substitutes = {
        name: FALLBACK[name]
        for name in (*cfg.task_schemes, *ABLATION_SCHEMES)
        if name not in available and stand_in(name, available) not in (None, name)
    }
    with tempfile.TemporaryDirectory(prefix="pfec-eval-prefill-") as folder:  # the prompts' caches
        store = Path(folder)
        t0 = time.perf_counter()
        paper_rule = [s for s in sim_schemes if whole_deadline_base(s) is None]  # @deadline: the sweep only
        task = _task_stage(cfg, _task_pairs(cfg, available) + [(s, s) for s in paper_rule], progress, store)
        stages["task"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        precision = _precision_stage(cfg, progress, store)
        stages["precision"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    overhead_rows = overhead(cfg, sim_schemes, progress)
    stages["overhead"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    scheduler = _scheduler_stage(cfg, available, progress)
    stages["scheduler"] = time.perf_counter() - t0
    result: dict[str, Any] = {
        "config": _describe(cfg),
        "schemes_available": available,
        "schemes_missing": missing,
        "definitions": scheme_definitions([*available, *grid["schemes"], *traces.get("schemes", [])],
                                          cfg.congestion),
        "substitutes": substitutes,
        "cells": cells,
        "grid": grid,
        "traces": traces,
        "task": task,
        "ablation": ablation(cells, task, available),
        "overhead": overhead_rows,
        "precision": precision,
        "scheduler": scheduler,
    }
    result["stage_seconds"] = {k: round(v, 1) for k, v in stages.items()}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _task_stage(
    cfg: EvalConfig, task_pairs: list[tuple[str, str]], progress: StageProgress | None, store: Path
) -> dict[str, Any]:
    """Stage 2, which loads the default model; skipped with ``--task-prompts 0``."""
    if cfg.task_prompts == 0 or not task_pairs:
        return {"skipped": "--task-prompts 0"}
    from pfec.lab.eval.task import task_scores  # deferred: torch (only this stage loads the model)

    return task_scores(cfg, task_pairs, sorted({*cfg.task_rhos, *ABLATION_RHOS}), progress, store)


def _precision_stage(cfg: EvalConfig, progress: StageProgress | None, store: Path) -> dict[str, Any]:
    """The fidelity stage (answers per precision variant), which loads the model; ``--precision-prompts 0``
    skips it."""
    if cfg.precision_prompts == 0:
        return {"skipped": "--precision-prompts 0"}
    from pfec.lab.eval.precision import precision_scores  # deferred: torch (loads the model)

    return precision_scores(cfg, cfg.precision_rhos, cfg.precision_variants, progress=progress,
                            prefill_store=store)


def _scheduler_stage(cfg: EvalConfig, available: Sequence[str], progress: StageProgress | None,
                     ) -> dict[str, Any]:
    """DDQN vs heuristic on the held-out conditions (``--scheduler-realizations 0`` skips)."""
    if cfg.scheduler_realizations == 0:
        return {"skipped": "--scheduler-realizations 0"}
    absent = [name for name in ("priorityfec", "heuristic") if name not in available]
    if absent:
        return {"skipped": f"{' and '.join(absent)} not available in this run"}

    def tick(done: int, total: int) -> None:
        if progress is not None:
            progress("held-out scheduler", done, total)

    return heldout_comparison(cfg.scheduler_realizations, cfg.jobs, progress=tick)


def _task_pairs(cfg: EvalConfig, available: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for name in dict.fromkeys((*cfg.task_schemes, *ABLATION_SCHEMES)):
        runs = stand_in(name, available)
        if runs is not None and runs not in RELIABLE:
            pairs.append((name, runs))
    return pairs


def _describe(cfg: EvalConfig) -> dict[str, Any]:
    out = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    out["configs"] = [list(c) for c in cfg.configs]
    return out


def ablation(
    cells: list[dict[str, Any]], task: dict[str, Any], available: Sequence[str]
) -> list[dict[str, Any]]:
    """Paper V-E rows: main config at rho 0.8 and 1.0, utility from the sweep, F1 from the task stage."""
    rows = []
    task_rows = {(r["scheme"], r["rho"], r["mode"]): r for r in task.get("summary", [])}
    for rho in ABLATION_RHOS:
        cell = next((c for c in cells if c["config"] == "main" and math.isclose(c["rho"], rho)), None)
        for name in ABLATION_SCHEMES:
            runs = stand_in(name, available)
            entry = cell["schemes"].get(runs) if cell is not None and runs is not None else None
            row: dict[str, Any] = {"scheme": name, "rho": rho, "runs": runs}
            if entry is not None:
                row["utility_mean"], row["utility_ci95"] = (
                    entry["recovered_utility_mean"],
                    entry["recovered_utility_ci95"],
                )
            for mode in MODES:
                t = task_rows.get((name, rho, mode))
                row[f"f1_{mode}"] = t["f1_gold"] if t else None
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- example trace


def write_example_trace(
    path: Path, seconds: float = 60.0, probe_ms: float = 1.0, seed: int = 7
) -> dict[str, Any]:
    """A synthetic stand-in for a 1 kHz UDP-ping capture: per-probe loss from three GE phases (main,
    burstier, milder; equal thirds), written as state changes only (the replay holds each state until the
    next entry). Not a measurement: replace it with your own capture (docs/RESULTS.md says how)."""
    if seconds <= 0 or probe_ms <= 0:
        raise ValueError(f"--seconds and --probe-ms must be positive, got {seconds} and {probe_ms}")
    n = int(seconds * 1000 / probe_ms)
    phases = [
        GilbertElliott(*map(float, NAMED_CONFIGS[p].split(":")[1].split(",")))
        for p in ("main", "burstier", "milder")
    ]
    bounds = np.linspace(0, n, len(phases) + 1).astype(int)
    lost = np.concatenate(
        [
            ge.realize(int(b - a), probe_ms / 1000, realization_rng(seed, k, "trace"))
            for k, (ge, a, b) in enumerate(zip(phases, bounds[:-1], bounds[1:], strict=True))
        ]
    )
    keep = np.flatnonzero(np.r_[True, lost[1:] != lost[:-1]])
    keep = np.r_[keep, n - 1] if keep[-1] != n - 1 else keep  # anchor the end so the period is ~seconds
    times = np.round(keep * probe_ms / 1000, 6)
    comment = (
        f"synthetic example (NOT a measurement): {seconds:g} s of 1 probe per {probe_ms:g} ms, GE phases "
        f"main/burstier/milder, seed {seed}\ngenerated by: pfec eval-trace --out {path} --seconds "
        f"{seconds:g} --probe-ms {probe_ms:g} --seed {seed}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, times, lost[keep], comment=comment)
    return {
        "path": str(path),
        "entries": len(keep),
        "probes": n,
        "mean_loss": float(lost.mean()),
        "seconds": seconds,
        "probe_ms": probe_ms,
        "seed": seed,
    }
