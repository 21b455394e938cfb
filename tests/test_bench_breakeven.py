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
        "100": {"handoff:native": 1024, "handoff:auto": 2048, "split:auto": None, "auto": None}}


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
    with pytest.raises(ValueError, match="--rate-control"):
        BreakevenConfig(rate_control="bbr")


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


def test_auto_is_held_against_the_measured_fastest_of_its_cell() -> None:
    """Auto's TTFT over the cell's fastest measured alternative (local prefill included), and whether it
    ran that alternative's plan; a run that hit the deadline or failed is no alternative."""
    from pfec.lab.bench.breakeven import auto_against_fastest

    def row(n: int, mode: str, ttft: float | None, start: str = "ready", **extra: Any) -> dict[str, Any]:
        return {**_run(n, 100, mode, ttft), "state": "done" if ttft else "failed", "start": start, **extra}

    native = {"handoff_mode": "handoff", "precision": "native", "meeting_token_planned": None}
    split = {"handoff_mode": "split", "precision": "int8", "meeting_token_planned": 256}
    local = {"512": {"ttft_s": 2.0}, "1024": {"ttft_s": 4.0}, "2048": {"ttft_s": 1.0}}
    runs = [
        row(512, "handoff:native", 1.0, **native), row(512, "split:auto", 0.5, start="deadline", **split),
        row(512, "auto", 1.04, planner_choice="handoff:native", **native),
        row(1024, "handoff:native", 3.0, **native), row(1024, "split:auto", 1.5, **split),
        row(1024, "auto", 1.8, planner_choice="split:int8", **split),  # the same plan, a slower run
        row(2048, "handoff:native", 3.0, **native),
        row(2048, "auto", 3.2, planner_choice="handoff:native", **native),  # local was fastest
    ]
    out = auto_against_fastest(runs, local)
    first, second, third = out["cells"]
    assert first["fastest"] == "handoff:native" and first["ratio"] == 1.04 and first["within"]
    assert first["ran"] == "handoff:native" and first["same_plan"]
    assert second["fastest"] == "split:auto" and second["ratio"] == 1.2 and not second["within"]
    assert second["same_plan"]
    assert third["fastest"] == "local" and not third["same_plan"]
    assert (out["within"], out["same_plan"], out["of"]) == (1, 2, 3)


def test_auto_is_also_held_against_the_fastest_option_its_rule_may_run() -> None:
    """A stream is admitted only when it kept the floor and beat local prefill by the planner's margin as
    measured: a split 10% faster than local is not, so auto's local run is held against local; one 30%
    faster is, and a stream below the floor (int4) never is."""
    from pfec.common.plan.breakeven import LOCAL_MARGIN
    from pfec.lab.bench.breakeven import auto_against_fastest

    assert pytest.approx(0.2) == LOCAL_MARGIN  # the figures below sit either side of it

    def row(n: int, mode: str, ttft: float, **extra: Any) -> dict[str, Any]:
        return {**_run(n, 20, mode, ttft), "state": "done", "start": "ready", **extra}

    split = {"handoff_mode": "split", "precision": "int8", "meeting_token_planned": 256}
    int4 = {"handoff_mode": "handoff", "precision": "int4", "meeting_token_planned": None}
    local_run = {"handoff_mode": "local", "precision": None, "meeting_token_planned": None}
    local = {"512": {"ttft_s": 2.0}, "1024": {"ttft_s": 4.0}}
    runs = [
        row(512, "split:auto", 1.8, **split), row(512, "auto", 2.05, planner_choice="local", **local_run),
        row(1024, "split:auto", 2.8, **split), row(1024, "handoff:auto", 1.0, **int4),
        row(1024, "auto", 2.9, planner_choice="split:int8", **split),
    ]
    first, second = auto_against_fastest(runs, local)["cells"]
    assert first["fastest"] == "split:auto" and not first["within"]  # charged for the margin
    assert first["fastest_admitted"] == "local" and first["ratio_to_admitted"] == 1.025
    assert first["within_admitted"]
    assert second["fastest"] == "handoff:auto"  # int4: faster, below the floor
    assert second["fastest_admitted"] == "split:auto" and second["within_admitted"]
