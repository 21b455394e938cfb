"""`pfec bench gpu`: the bench's own code on the CPU with the tiny geometry (every figure the GPU run
writes, from the same functions), and its refusal without CUDA."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pfec.cli.app import app


def _finite_positive(x: object) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


def test_the_bench_runs_on_the_cpu_and_writes_every_figure(tmp_path: Path) -> None:
    args = ["bench", "gpu", "--device", "cpu", "--tokens", "128", "--handoff-tokens", "64", "--repeats", "1",
            "--question-tokens", "4", "--rate-mbps", "20", "--json", "--out-dir", str(tmp_path)]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert json.loads(run.output[run.output.index("{"):]) == result
    assert result["inputs"]["geometry"] == "tiny" and result["card"]["device"] == "cpu"
    kv = {"n_layers": 3, "n_kv_heads": 2, "head_dim": 16, "dtype": "bf16", "bytes_per_token": 384}
    assert result["inputs"]["geometry_kv"] == kv
    assert _finite_positive(result["prefill"]["tokens_per_second"])
    assert [n for n, _ in result["prefill"]["points"]] == [32, 64, 128]
    for level in ("int8", "int4"):
        kernel = result["kernels"][level]
        assert all(_finite_positive(kernel[k]) for k in ("quantise_gbps", "dequantise_gbps"))
    streams = result["streams"]
    assert set(streams) == {"native", "int8", "int4"}
    sizes = [streams[p]["stream_bytes"] for p in ("int4", "int8", "native")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    for s in streams.values():
        assert all(_finite_positive(s[k]) for k in ("serialise_s", "rebuild_s", "first_token_s"))
        assert len(s["first_token"]) == 1
    warm, *handoffs = result["handoffs"]
    assert warm["warm_up"] and [h["precision"] for h in handoffs] == ["native", "int8"]
    for h in [warm, *handoffs]:
        assert h["outcome"] == "done" and h["n_tokens"] == 64 and h["recovered_utility"] == pytest.approx(1.0)
        assert _finite_positive(h["planner_ttft_s"]) and _finite_positive(h["ttft_s"])
        assert _finite_positive(h["ttft_measured_over_predicted"])
        assert h["answer"] == h["full_kv_answer"]  # fp32 on the CPU: the handed-off cache answers alike
    assert result["planner_preset"] is None  # no assumed receiver for the tiny geometry
    markdown = (tmp_path / "gpu.md").read_text()
    assert "| int8 | done |" in markdown and "tokens/s at 128 tokens" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the bench runs there")
def test_without_cuda_the_gpu_bench_exits_2_with_the_reason(tmp_path: Path) -> None:
    run = CliRunner().invoke(app, ["bench", "gpu", "--out-dir", str(tmp_path)])
    assert run.exit_code == 2
    assert "no CUDA GPU" in run.output and "--device cpu" in run.output
    assert not (tmp_path / "gpu.json").exists()
