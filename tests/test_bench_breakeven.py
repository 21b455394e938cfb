"""`pfec bench breakeven`: measured TTFT of local prefill, native and auto handoffs and split."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.bench.breakeven import BreakevenConfig, measured_crossovers


def _run(n: int, rate: float, mode: str, ttft: float | None) -> dict[str, Any]:
    return {"n_tokens": n, "rate_mbps": rate, "mode": mode, "ttft_s": ttft}


def test_crossovers_need_every_longer_context_to_beat_local() -> None:
    local = {"512": {"ttft_s": 1.0}, "1024": {"ttft_s": 2.0}, "2048": {"ttft_s": 5.0}}
    runs = [
        _run(512, 100, "handoff:native", 1.5), _run(1024, 100, "handoff:native", 1.9),
        _run(2048, 100, "handoff:native", 4.0),
        _run(512, 100, "handoff:auto", 0.5), _run(1024, 100, "handoff:auto", 2.5),  # loses at 1024
        _run(2048, 100, "handoff:auto", 2.0),
        _run(512, 100, "split:auto", 0.5), _run(1024, 100, "split:auto", 1.0),
        _run(2048, 100, "split:auto", None),  # a failed run never beats local
    ]
    assert measured_crossovers(runs, local) == {
        "100": {"handoff:native": 1024, "handoff:auto": 2048, "split:auto": None}}


def test_bad_bench_options_are_refused_with_the_option_named() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "breakeven", "--lengths", "50"])
    assert res.exit_code == 2 and "--lengths" in res.output, res.output
    res = runner.invoke(app, ["bench", "breakeven", "--lengths", "512.5"])
    assert res.exit_code == 2 and "whole token counts" in res.output, res.output
    res = runner.invoke(app, ["bench", "breakeven", "--rates", "0"])
    assert res.exit_code == 2 and "--rates" in res.output, res.output
    with pytest.raises(ValueError, match="--local-runs"):
        BreakevenConfig(local_runs=0)


def test_prediction_errors_per_cell_and_their_median() -> None:
    from pfec.lab.bench.breakeven import prediction_errors

    local = {"512": {"ttft_s": 2.0}}
    runs = [
        {"n_tokens": 512, "rate_mbps": 100, "mode": "handoff:native", "ttft_s": 1.0, "predicted_ttft_s": 1.1,
         "predicted_local_ttft_s": 1.5, "state": "done", "start": "ready"},
        {"n_tokens": 512, "rate_mbps": 100, "mode": "handoff:auto", "ttft_s": 2.0, "predicted_ttft_s": 1.0,
         "predicted_local_ttft_s": 1.5, "state": "done", "start": "ready"},
        {"n_tokens": 512, "rate_mbps": 100, "mode": "split:auto", "ttft_s": 3.0, "predicted_ttft_s": 1.0,
         "predicted_local_ttft_s": 1.5, "state": "done", "start": "deadline"},  # hit the deadline: no error
    ]
    out = prediction_errors(runs, local)
    assert [c["error"] for c in out["cells"]] == [0.1, -0.5, None]
    assert out["median_abs_error"] == pytest.approx(0.3)
    assert out["median_abs_local_error"] == pytest.approx(0.25) and out["cells"][0]["local_error"] == -0.25
