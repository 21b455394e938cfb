"""`pfec bench rate-control` (the path-measuring benchmarks live apart from cli/lab.py's other benches)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pfec.cli.lab import ResultJsonOpt, RttOpt, TokensOpt, _write_bench
from pfec.cli.shared import DOCS_BENCH, fail
from pfec.common.plan.deadline import DEFAULT_RTT_MS
from pfec.lab.reporting.progress import progress_line


def bench_rate_control_cmd(
    links: Annotated[str, typer.Option(help="Link rates, Mbit/s, comma-separated.")] = "25,50,100",
    factors: Annotated[str, typer.Option(help="Told rate / link rate, comma-separated.")] = "0.25,0.5,2,4",
    seeds: Annotated[int, typer.Option(min=1, help="Loss seeds per cell.")] = 1,
    tokens: TokensOpt = 1536,
    deadline_ms: Annotated[float, typer.Option(help="The handoffs' deadline.")] = 2700.0,
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where rate_control.json and .md go.")] = DOCS_BENCH,
) -> None:
    """Fixed pacing at a told rate against link.rate_control = path, told 0.25-4x the link's rate (real
    daemons through the relay emulator)."""
    from pfec.lab.bench.rate_control import run_rate_control_bench, write_rate_control_bench  # deferred

    try:
        result = run_rate_control_bench([float(x) for x in links.split(",")],
                                        [float(x) for x in factors.split(",")], seeds, tokens, deadline_ms,
                                        rtt_ms, progress=progress_line("bench rate-control"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_rate_control_bench, out_dir, "rate_control.md", as_json)


def bench_traces_cmd(
    trace: Annotated[list[Path], typer.Option(help="A Mahimahi trace (repeat the option for more).")],
    scale: Annotated[list[float], typer.Option(
        help="Each --trace's rate scale K (opportunities per line), in the same order.")],
    offsets: Annotated[int, typer.Option(min=1, help="Starts spread over each trace's period.")] = 3,
    told_mbps: Annotated[float, typer.Option(help="The rate the measuring sender is told.")] = 100.0,
    sim_realizations: Annotated[int, typer.Option(min=1, help="Simulated loss realizations per start.")] = 3,
    tokens: TokensOpt = 1536,
    deadline_ms: Annotated[float, typer.Option(help="The handoffs' deadline.")] = 2700.0,
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where traces.json and .md go.")] = DOCS_BENCH,
) -> None:
    """Real handoffs through the relay emulator on rate traces (link.rate_control = path, and fixed at the
    trace's mean) against the simulated trace oracle of the same starts."""
    from pfec.lab.bench.trace_handoffs import run_trace_bench, write_trace_bench  # deferred

    if len(trace) != len(scale):
        raise fail(f"--scale: give one per --trace ({len(trace)} traces, {len(scale)} scales)")
    try:
        result = run_trace_bench(list(zip(trace, scale, strict=True)), offsets, told_mbps, tokens,
                                 deadline_ms, rtt_ms, sim_realizations,
                                 progress=progress_line("bench traces"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_trace_bench, out_dir, "traces.md", as_json)
