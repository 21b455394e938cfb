"""`pfec bench breakeven`: measured TTFT of local prefill, native and auto handoffs and split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.bench_breakeven import MODES, BreakevenConfig, measured_crossovers


def _default_model_available() -> tuple[bool, str]:
    try:
        from pfec.common.model import llm  # deferred: torch, only to see whether the model is there

        llm.default_model_dir()
    except (ImportError, ValueError) as exc:
        return False, str(exc)
    return True, ""


_OK, _WHY = _default_model_available()


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


@pytest.mark.skipif(not _OK, reason=f"default model unavailable: {_WHY}")
def test_bench_breakeven_measures_every_mode_with_the_default_model(tmp_path: Path) -> None:
    """One short context at one rate: every mode's handoff runs through the daemons and starts when ready
    (the loose deadline never binds), next to local prefill measured in the same run; files written."""
    res = CliRunner().invoke(app, ["bench", "breakeven", "--lengths", "200", "--rates", "200",
                                   "--local-runs", "1", "--out-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [r["mode"] for r in out["runs"]] == [label for label, _, _ in MODES]
    for row in out["runs"]:
        assert row["state"] == "done" and row["start"] == "ready", row
        assert row["ttft_s"] > 0 and row["predicted_ttft_s"] > 0 and row["answer"], row
    native, auto, split = out["runs"]
    assert auto["bytes_sent"] < native["bytes_sent"], (auto, native)  # int8/int4 travels fewer bytes
    assert split["computed_tokens"] >= split["meeting_token_planned"], split
    assert out["local"]["200"]["ttft_s"] > 0 and out["local"]["200"]["context_tokens"] >= 200
    assert set(out["crossovers"]["200"]) == {label for label, _, _ in MODES}
    for name in ("breakeven.json", "breakeven.md", "breakeven.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "| 200 | 200 |" in (tmp_path / "breakeven.md").read_text()
