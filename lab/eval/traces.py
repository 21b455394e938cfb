"""`pfec eval` trace cells: the handoff on moving links (issue: measure the path, item 6).

Each trace file of ``cfg.trace_files`` (Mahimahi, e.g. the LTE traces beside the checkout) gives two cells:
scaled to ``cfg.trace_target_mbps`` on average (the rate the sender is told; ``rho`` is against it), and at
its own rate (a few Mbit/s: the same deadline, where local prefill should win). Every cell is the main loss
config behind the trace's drop-tail bottleneck, the senders measuring their path (``rate_control = path``),
``cfg.trace_realizations`` paired realizations: realization r meets the trace from r/R of its period
(``rate_trace.rotated``) and the r-th loss realization, the same for every scheme. The oracle knows the
trace's opportunities and the losses. Per cell: each scheme's utility, its efficiency against the oracle of
the same realization, the bottleneck's drop share, the controller's end state, and the break-even planner's
choice on the rate the controller forecast (what the next handoff to that receiver would plan with).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pfec.common.plan.breakeven import LinkModel, plan_handoff
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.lab.baselines.reliable import netns_available, run_reliable
from pfec.lab.eval.config import EvalConfig
from pfec.lab.eval.sweep import SweepTask, run_realizations
from pfec.lab.reporting.progress import StageProgress
from pfec.lab.reporting.stats import mean_ci95_fields
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.known_rate import KNOWN_RATE_SCHEMES
from pfec.lab.sim.path_link import queue_fields
from pfec.lab.sim.rate_trace import RateTrace, load_rate_trace, rotated
from pfec.lab.sim.simulate import RunResult, SimConfig
from pfec.lab.sim.split import DEFAULT_RECEIVER

__all__ = ["TRACE_SCHEMES", "TraceCell", "trace_cells", "trace_sweep"]

#: Ours with the daemons' repair rule, the same session paced knowing the trace's rate (idealised: with
#: PathRate's bound on what is in flight, and without), and the bound.
TRACE_SCHEMES: Final = ("priorityfec@deadline", "heuristic@deadline", "known-rate", "known-rate-unbounded",
                        "oracle")


@dataclass(frozen=True)
class TraceCell:
    name: str  # e.g. "TMobile-LTE-short.up x7.5"
    path: Path
    scale: float
    rate: str  # "scaled" (to cfg.trace_target_mbps) or "own"


def trace_cells(cfg: EvalConfig) -> list[TraceCell]:
    """Two cells per trace file: scaled to ``cfg.trace_target_mbps`` on average, and at its own rate."""
    out = []
    for file in cfg.trace_files:
        path = Path(file)
        own = load_rate_trace(path)  # TraceError naming the file and line for a bad one
        scale = round(cfg.trace_target_mbps * 1e6 / own.mean_rate_bps, 3)
        out.append(TraceCell(f"{path.name} x{scale:g}", path, scale, "scaled"))
        out.append(TraceCell(f"{path.name} x1", path, 1.0, "own"))
    return out


def _config(cfg: EvalConfig, trace: RateTrace, profile: Any) -> SimConfig:
    loss = parse_loss_spec(cfg.main_loss_spec())
    return SimConfig(loss=loss, rate_mbps=cfg.trace_target_mbps, rtt_ms=cfg.rtt_ms, rho=cfg.trace_rho,
                     tokens=cfg.tokens, reverse_loss=loss if cfg.reverse_lossy else None, profile=profile,
                     seed=cfg.seed, rate_trace=trace, rate_control="path")


def trace_sweep(cfg: EvalConfig, available: Sequence[str], progress: StageProgress | None = None,
                ) -> dict[str, Any]:
    """The trace cells' reports; ``{"skipped": why}`` without trace files or realizations."""
    if not cfg.trace_files:
        return {"skipped": "no trace files (--trace-files PATH,...; e.g. the LTE traces in ../shared/traces)"}
    if cfg.trace_realizations == 0:
        return {"skipped": "--trace-realizations 0"}
    names = tuple(s for s in TRACE_SCHEMES if s in available or s == "oracle" or s in KNOWN_RATE_SCHEMES)
    missing = [s for s in TRACE_SCHEMES if s not in names]
    cells = trace_cells(cfg)
    profile = cfg.load_profile()
    tasks: list[SweepTask] = []
    starts: list[list[RateTrace]] = []  # per cell, realization r's trace: from r/R of its period
    for i, cell in enumerate(cells):
        trace = load_rate_trace(cell.path, cell.scale)
        starts.append([rotated(trace, r * trace.period_ms / 1000 / cfg.trace_realizations)
                       for r in range(cfg.trace_realizations)])
        tasks += [(("trace", i, r), _config(cfg, moved, profile), names, r)
                  for r, moved in enumerate(starts[i])]
    runs: list[dict[str, list[RunResult]]] = [{n: [] for n in names} for _ in cells]
    errors: dict[str, str] = {}
    for key, results in run_realizations(tasks, cfg.jobs, "trace cells", progress):
        cell_index = key[1]  # type: ignore[index]
        for name, res in zip(names, results, strict=True):
            if isinstance(res, str):
                errors.setdefault(name, res)
            else:
                runs[cell_index][name].append(res)
    reports = [_cell_report(cfg, cell, runs[i]) for i, cell in enumerate(cells)]
    for report, traces in zip(reports, starts, strict=True):
        _add_reliable(cfg, report, _config(cfg, traces[0], profile), traces, progress)
    return {"cells": reports, "schemes": list(names), "missing": missing, "errors": errors,
            "realizations": cfg.trace_realizations, "rho": cfg.trace_rho,
            "told_mbps": cfg.trace_target_mbps, "loss": cfg.main_loss_spec()}


def _add_reliable(cfg: EvalConfig, report: dict[str, Any], config: SimConfig, traces: list[RateTrace],
                  progress: StageProgress | None) -> None:
    """Real kernel TCP (BBR) and QUIC on the same trace starts and loss realizations (the emulator draws
    realization r's losses as the simulator does), in the cache's natural order: the paper's baselines.
    Real time; ``--reliable-realizations 0`` skips them, and TCP without namespaces says why."""
    if cfg.reliable_realizations == 0:
        report["reliable_skipped"] = "--reliable-realizations 0"
        return
    oracle = report["schemes"].get("oracle", {}).get("recovered_utility_runs", [])
    ok, why = netns_available()
    rows = [("tcp", "bbr"), ("quic", None)] if ok else [("quic", None)]
    if not ok:
        report["reliable_skipped"] = f"tcp/bbr: {why}"
    for protocol, cc in rows:
        label = protocol if cc is None else f"{protocol}/{cc}"

        def tick(done: int, total: int, label: str = label) -> None:
            if progress is not None:
                progress(f"trace cells, real {label}", done, total)

        res = run_reliable(protocol, config, len(traces), tick, congestion_control=cc, traces=traces)
        entry = res["schemes"][protocol]
        runs = entry.get("recovered_utility_runs") or []
        keep = {k: entry[k] for k in ("recovered_utility_mean", "recovered_utility_ci95", "definition",
                                      "outlier_runs", "quic_stack") if k in entry}
        if runs and len(runs) == len(oracle):
            paired = [(u, o) for u, o in zip(runs, oracle, strict=True) if o]
            keep["efficiency_mean"] = statistics.fmean(u / o for u, o in paired) if paired else None
        keep["recovered_utility_runs"] = [round(u, 4) for u in runs]
        report["schemes"][label] = keep


def _cell_report(cfg: EvalConfig, cell: TraceCell, runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    trace = load_rate_trace(cell.path, cell.scale)
    oracle = {r.realization: r.recovered_utility for r in runs.get("oracle", [])}
    schemes: dict[str, Any] = {}
    for name, results in runs.items():
        results = sorted(results, key=lambda r: r.realization)
        if not results:
            continue
        entry: dict[str, Any] = mean_ci95_fields("recovered_utility", [r.recovered_utility for r in results])
        entry["recovered_utility_runs"] = [round(r.recovered_utility, 4) for r in results]
        paired = [(r.recovered_utility, oracle[r.realization]) for r in results if oracle.get(r.realization)]
        if paired and name != "oracle":
            entry["efficiency_mean"] = statistics.fmean(u / o for u, o in paired)
        if name != "oracle":
            p95s = [r.queue_delay_ms_p95 for r in results if r.queue_delay_ms_p95 is not None]
            entry.update(queue_fields([r.queue_received for r in results], [r.queue_dropped for r in results],
                                      [r.rate_end for r in results if r.rate_end is not None], p95s))
        schemes[name] = entry
    out: dict[str, Any] = {"cell": cell.name, "file": cell.path.name, "scale": cell.scale, "rate": cell.rate,
                           "mean_rate_mbps": round(trace.mean_rate_bps / 1e6, 3), "schemes": schemes}
    measured = next((schemes[n]["rate_end"] for n in TRACE_SCHEMES if "rate_end" in schemes.get(n, {})), None)
    if measured is not None:
        out["planner"] = _planner_view(cfg, measured["forecast_mbps"] * 1e6)
    return out


def _planner_view(cfg: EvalConfig, rate_bps: float) -> dict[str, Any]:
    """The break-even planner on the controller's forecast (the stored receiver curve, the cell's RTT)."""
    link = LinkModel(rate_bps, cfg.rtt_ms / 1000)
    plan = plan_handoff(cfg.tokens, DEFAULT_GEOMETRY, link, DEFAULT_RECEIVER)
    handoff = min((o for o in plan.options if o.mode == "handoff" and o.keeps_floor), key=lambda o: o.ttft_s)
    return {"forecast_mbps": round(rate_bps / 1e6, 3), "choice": plan.choice.label,
            "local_ttft_s": round(plan.option("local").ttft_s, 3),
            "fastest_handoff": handoff.label, "fastest_handoff_ttft_s": round(handoff.ttft_s, 3)}


def trace_section(traces: dict[str, Any]) -> list[str]:
    """docs/RESULTS.md's "Moving links" section from ``trace_sweep``'s result."""
    out = ["### Moving links: trace cells", ""]
    if not traces.get("cells"):
        return [*out, f"Not run: {traces.get('skipped', 'not in this run')}.", ""]
    real = [label for label in ("tcp/bbr", "quic") if any(label in c["schemes"] for c in traces["cells"])]
    schemes = [s for s in traces["schemes"] if s != "oracle"] + real
    out += [
        f"The main loss config behind a rate trace's drop-tail bottleneck (100 ms at its mean rate), the "
        f"senders measuring their path (`link.rate_control = path`), told {traces['told_mbps']:g} Mbit/s; "
        f"deadline rho {traces['rho']:g} against that rate; {traces['realizations']} paired realizations "
        "per cell, each from its own start in the trace. `oracle` knows the trace's delivery opportunities "
        "and the losses. The planner column is the break-even planner's choice on the rate the controller "
        "forecast at the end (the stored receiver curve): what the next handoff to that receiver plans with. "
        "`tcp/bbr` (kernel TCP, BBR, over the namespaces) and `quic` (the QUIC stack named in the JSON's "
        "definition) carry the cache in its natural order over the same trace starts and loss realizations "
        "in real time (the paper's baselines); queue drops and the forecast are the first scheme's. "
        "`known-rate` and `known-rate-unbounded` are idealised references, not senders: our session paced "
        "at the trace's own rate of a round trip ago (the freshest an ACK could report), with PathRate's "
        "bound on what is in flight and without one. P95 is the bottleneck's queueing delay (the median "
        "over the realizations of each run's P95; an LTE gap delays whatever waits through it).",
        "",
        "| trace | mean Mbit/s | " + " | ".join(f"{s} (of oracle)" for s in schemes)
        + " | oracle | queue drops | forecast Mbit/s | planner |",
        "|---|---|" + "---|" * len(schemes) + "---|---|---|---|",
    ]
    for cell in traces["cells"]:
        row = [cell["cell"], f"{cell['mean_rate_mbps']:.1f}"]
        for name in schemes:
            entry = cell["schemes"].get(name)
            eff = float("nan") if entry is None else entry.get("efficiency_mean", float("nan"))
            p95 = None if entry is None else entry.get("queue_delay_ms_p95_median")
            delay = "" if p95 is None else f", P95 {p95:.0f} ms"
            row.append("-" if entry is None else f"{entry['recovered_utility_mean']:.3f} ({eff:.1%}{delay})")
        oracle = cell["schemes"].get("oracle", {}).get("recovered_utility_mean")
        ours = cell["schemes"].get(schemes[0], {}) if schemes else {}
        plan = cell.get("planner")
        choice = "-" if plan is None else (
            f"{plan['choice']} (local {plan['local_ttft_s']:.2f} s, {plan['fastest_handoff']} "
            f"{plan['fastest_handoff_ttft_s']:.2f} s)")
        row += ["-" if oracle is None else f"{oracle:.3f}", f"{ours.get('queue_drop_share', 0.0):.1%}",
                "-" if plan is None else f"{plan['forecast_mbps']:.1f}", choice]
        out.append("| " + " | ".join(row) + " |")
    if traces.get("missing"):
        out += ["", f"Not available in this run: {', '.join(traces['missing'])}."]
    return [*out, ""]
