"""`pfec bench serving`: a handed-off conversation continued through the OpenAI API, against the same
messages prefilled from nothing (docs/benchmarks/serving.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pfec.cli.lab import ResultJsonOpt, _write_bench
from pfec.cli.shared import DOCS_BENCH, fail
from pfec.lab.reporting.progress import progress_line


def bench_serving_cmd(
    runs: Annotated[int, typer.Option(min=1, help="Conversations (seeds 0..runs-1).")] = 3,
    context_tokens: Annotated[int, typer.Option(min=64, help="Each conversation's context, tokens.")] = 1500,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of every request.")] = 8,
    rate_mbps: Annotated[float, typer.Option(help="The handoff's pacing rate (loopback UDP).")] = 100.0,
    constrained_prompts: Annotated[int, typer.Option(
        min=0, max=20, help="Prompts of each constrained row (tool_choice required, a strict json_schema) "
        "and of the decode-step overhead per grammar library; 0 skips them.")] = 20,
    constrained_max_tokens: Annotated[int, typer.Option(min=8, help="max_tokens of those requests.")] = 128,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where serving.json and .md go.")] = DOCS_BENCH,
) -> None:
    """TTFT of the receiver's first request after a conversation handoff against the same messages with
    nothing stored, and each node's second-turn prefill (real daemons, the default model, the openai
    client). Then constrained decoding: valid forced tool calls, replies validating a strict schema, and
    the decode step's overhead per grammar library (xgrammar where installed)."""
    from pfec.lab.bench.serving import run_serving_bench, write_serving_bench  # deferred: torch, daemons

    try:
        result = run_serving_bench(runs, context_tokens, max_tokens, rate_mbps,
                                   progress=progress_line("bench serving"),
                                   constrained_prompts=constrained_prompts,
                                   constrained_max_tokens=constrained_max_tokens)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_serving_bench, out_dir, "serving.md", as_json)
