"""`pfec bench gpu`: a GPU node's model side on a random model of Qwen2.5-7B's geometry, and the planner's
TTFT for it on that GPU against a real handoff's (docs/benchmarks/gpu.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pfec.cli.lab import ResultJsonOpt, _write_bench
from pfec.cli.shared import DOCS_BENCH, fail
from pfec.lab.reporting.progress import progress_line


def bench_gpu_cmd(
    device: Annotated[str, typer.Option(help="cuda, cuda:N, or cpu (the bench's own check: tiny geometry).")]
    = "cuda",
    geometry: Annotated[Literal["auto", "qwen2.5-7b", "tiny"], typer.Option(
        help="Random model geometry; auto: qwen2.5-7b on a GPU, tiny on the CPU.")] = "auto",
    tokens: Annotated[int, typer.Option(min=64, help="Context of the prefill and stream figures, tokens.")]
    = 2048,
    handoff_tokens: Annotated[int, typer.Option(min=64, help="Context of the daemons' handoffs, tokens.")]
    = 1024,
    question_tokens: Annotated[int, typer.Option(min=1, help="Question tokens after the context.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per figure (the fastest is kept).")] = 3,
    rate_mbps: Annotated[float, typer.Option(help="The handoffs' told rate over loopback UDP.")] = 400.0,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where gpu.json and gpu.md go.")] = DOCS_BENCH,
) -> None:
    """Prefill tokens/s, quantise and dequantise GB/s, rebuild and first-token time, and the planner's
    predicted TTFT against real handoffs through both daemons, on a random bf16 model. Exits 2 without
    CUDA (unless --device cpu)."""
    from pfec.lab.bench.gpu import GpuBenchInputs, run_gpu_bench, write_gpu_bench  # deferred: torch

    chosen = geometry if geometry != "auto" else ("tiny" if device == "cpu" else "qwen2.5-7b")
    inputs = GpuBenchInputs(device=device, geometry=chosen, tokens=tokens, question_tokens=question_tokens,
                            repeats=repeats, rate_mbps=rate_mbps, handoff_tokens=handoff_tokens)
    try:
        result = run_gpu_bench(inputs, progress=progress_line("bench gpu"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_gpu_bench, out_dir, "gpu.md", as_json)
