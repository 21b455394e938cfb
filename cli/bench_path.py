"""`pfec bench rate-control` and `pfec bench fairness` (the path-measuring benchmarks live apart from
cli/lab.py's other benches)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pfec.cli.lab import ResultJsonOpt, RttOpt, TokensOpt, _write_bench
from pfec.cli.shared import DOCS_BENCH, fail
from pfec.common.plan.deadline import DEFAULT_RTT_MS
from pfec.lab.reporting.progress import progress_line

DeadlineMsOpt = Annotated[float, typer.Option(help="The handoffs' deadline, ms.")]


def bench_rate_control_cmd(
    links: Annotated[str, typer.Option(help="Link rates, Mbit/s, comma-separated.")] = "25,50,100,200",
    factors: Annotated[str, typer.Option(help="Told rate / link rate, comma-separated.")] = "0.25,0.5,2,4",
    seeds: Annotated[int, typer.Option(min=1, help="Loss seeds per cell.")] = 1,
    tokens: TokensOpt = 1536,
    deadline_ms: DeadlineMsOpt = 2700.0,
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    sections: Annotated[str, typer.Option(
        help="Comma-separated: told (the told-rate rows), lossy (the lossy-link rows).")] = "told,lossy",
    loss_links: Annotated[str, typer.Option(help="Lossy rows: link rates, Mbit/s.")] = "50,100",
    loss_percents: Annotated[str, typer.Option(help="Lossy rows: channel loss, %.")] = "10,17,25",
    loss_rhos: Annotated[str, typer.Option(
        help="Lossy rows: each loss's deadline, in serialisation times.")] = "1.3,1.4,1.5",
    loss_kinds: Annotated[str, typer.Option(help="Lossy rows: bernoulli, ge (bursty).")] = "bernoulli,ge",
    loss_seeds: Annotated[int, typer.Option(min=1, help="Lossy rows: seeds per cell.")] = 3,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where rate_control.json and .md go.")] = DOCS_BENCH,
) -> None:
    """Fixed pacing at a told rate against link.rate_control = path, told 0.25-4x the link's rate; then
    10-25% channel loss, told the truth (real daemons through the relay emulator)."""
    from pfec.lab.pathbench.lossy_links import LossyRows  # deferred
    from pfec.lab.pathbench.rate_control import run_rate_control_bench, write_rate_control_bench  # deferred

    try:
        chosen = {name.strip() for name in sections.split(",") if name.strip()}
        if not chosen or not chosen <= {"told", "lossy"}:
            raise ValueError(f"--sections: told and/or lossy, got {sections!r}")
        lossy = None
        if "lossy" in chosen:
            lossy = LossyRows(_floats(loss_links), _floats(loss_percents), _floats(loss_rhos),
                              tuple(k.strip() for k in loss_kinds.split(",") if k.strip()), loss_seeds)
        result = run_rate_control_bench(_floats(links), _floats(factors), seeds, tokens, deadline_ms, rtt_ms,
                                        progress=progress_line("bench rate-control"), lossy=lossy,
                                        told_rows="told" in chosen)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_rate_control_bench, out_dir, "rate_control.md", as_json)


def _floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of numbers (ValueError naming the bad one)."""
    out = []
    for item in text.split(","):
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"not a number: {item.strip()!r} in {text!r}") from None
    return tuple(out)


def bench_traces_cmd(
    trace: Annotated[list[Path], typer.Option(help="A Mahimahi trace (repeat the option for more).")],
    scale: Annotated[list[float], typer.Option(
        help="Each --trace's rate scale K (opportunities per line), in the same order.")],
    offsets: Annotated[int, typer.Option(min=1, help="Starts spread over each trace's period.")] = 3,
    told_mbps: Annotated[float, typer.Option(help="The rate the measuring sender is told.")] = 100.0,
    sim_realizations: Annotated[int, typer.Option(min=1, help="Simulated loss realizations per start.")] = 3,
    tokens: TokensOpt = 1536,
    deadline_ms: DeadlineMsOpt = 2700.0,
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where traces.json and .md go.")] = DOCS_BENCH,
) -> None:
    """Real handoffs through the relay emulator on rate traces (link.rate_control = path, and fixed at the
    trace's mean) against the simulated trace oracle of the same starts."""
    from pfec.lab.pathbench.trace_handoffs import run_trace_bench, write_trace_bench  # deferred

    if len(trace) != len(scale):
        raise fail(f"--scale: give one per --trace ({len(trace)} traces, {len(scale)} scales)")
    try:
        result = run_trace_bench(list(zip(trace, scale, strict=True)), offsets, told_mbps, tokens,
                                 deadline_ms, rtt_ms, sim_realizations,
                                 progress=progress_line("bench traces"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_trace_bench, out_dir, "traces.md", as_json)


def bench_fairness_cmd(
    duration_s: Annotated[float, typer.Option(
        help="Each handoff's deadline, s: how long it shares the bottleneck.")] = 6.0,
    scenarios: Annotated[str, typer.Option(help="Comma-separated: cubic, bbr, two-handoffs.")] =
        "cubic,bbr,two-handoffs",
    link_mbps: Annotated[float, typer.Option(help="The bottleneck's rate, each way.")] = 100.0,
    rtt_ms: RttOpt = 20.0,
    queue_ms: Annotated[float, typer.Option(help="Drop-tail queue depth at the link's rate.")] = 100.0,
    tokens: TokensOpt = 4096,
    warmup_s: Annotated[float, typer.Option(help="The TCP flow runs alone this long first.")] = 3.0,
    repeats: Annotated[int, typer.Option(min=1, max=20, help="Runs of each scenario.")] = 3,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where fairness.json, .md and .png go.")] = DOCS_BENCH,
) -> None:
    """A path-controlled handoff sharing one bottleneck with a kernel TCP bulk flow (CUBIC, then BBR), and
    two handoffs from two sender daemons through one bottleneck (network namespaces and TUN, root)."""
    from pfec.lab.emulator.netns import netns_available  # deferred
    from pfec.lab.pathbench.fairness import (  # deferred
        FairnessConfig,
        run_fairness_bench,
        write_fairness_bench,
    )

    ok, why = netns_available()
    if not ok:
        raise fail(f"pfec bench fairness runs over network namespaces and TUN devices: {why}")
    try:
        cfg = FairnessConfig(link_mbps=link_mbps, rtt_ms=rtt_ms, queue_ms=queue_ms, tokens=tokens,
                             deadline_ms=duration_s * 1000, warmup_s=warmup_s)
        names = tuple(s.strip() for s in scenarios.split(",") if s.strip())
        result = run_fairness_bench(cfg, names, repeats, progress=progress_line("bench fairness"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_fairness_bench, out_dir, "fairness.md", as_json)
