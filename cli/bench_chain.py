"""`pfec bench chain`: a conversation handed along three nodes with both roles, whole and with a lossy
first hop (docs/benchmarks/chain.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pfec.cli.lab import ResultJsonOpt, _write_bench
from pfec.cli.shared import DOCS_BENCH, fail
from pfec.lab.reporting.progress import progress_line


def bench_chain_cmd(
    context_tokens: Annotated[int, typer.Option(min=64, help="The conversation's context, tokens.")] = 1500,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of every request.")] = 8,
    rate_mbps: Annotated[float, typer.Option(help="Each handoff's pacing rate (loopback UDP).")] = 100.0,
    loss: Annotated[float, typer.Option(help="The partial chain's loss on A -> B (no repairs).")] = 0.05,
    seed: Annotated[int, typer.Option(help="The needle-QA conversation and the loss pattern.")] = 0,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where chain.json and .md go.")] = DOCS_BENCH,
) -> None:
    """A -> B -> C on the default model: C's cached_tokens and TTFT against prefilling the grown
    conversation, and with A -> B lossy, whether C masks exactly what B lacked."""
    from pfec.lab.bench.chain import run_chain_bench, write_chain_bench  # deferred: torch, daemons

    try:
        result = run_chain_bench(context_tokens, max_tokens, rate_mbps, loss, seed,
                                 progress=progress_line("bench chain"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_chain_bench, out_dir, "chain.md", as_json)
