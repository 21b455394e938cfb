"""`pfec demo` with the real default model: receiver, relay and sender processes, needle QA, a real answer."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app


def _default_model_available() -> tuple[bool, str]:
    try:
        from pfec.common.model import llm  # deferred: torch, only to see whether the model is there

        llm.default_model_dir()
    except (ImportError, ValueError) as exc:
        return False, str(exc)
    return True, ""


_OK, _WHY = _default_model_available()


@pytest.mark.skipif(not _OK, reason=f"default model unavailable: {_WHY}")
def test_demo_json_with_the_default_model() -> None:
    res = CliRunner().invoke(app, ["demo", "--json", "--tokens", "600", "--no-compare-sim"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("recovered_utility", "ttft_s", "deadline_s", "answer", "full_kv_answer", "source_sent",
                "repair_sent", "bytes_sent", "native_bytes", "precision_mix", "planner_choice",
                "local_prefill_ttft_s"):
        assert key in out, key
    report = out["report"]
    assert report["outcome"] == "done", report
    assert 0.3 < out["recovered_utility"] <= 1.0, out
    assert out["source_sent"] > 0 and report["n_tokens"] >= 600
    assert isinstance(out["answer"], str) and out["full_kv_answer"], out
    # TTFT counts from the OFFER: the wait for the last symbol (or the deadline), rebuild, first forward.
    assert out["start"] in ("ready", "deadline") and out["ttft_s"] > 0, out
    if out["start"] == "deadline":
        assert out["ttft_s"] > 0.5 * out["deadline_s"], out
    # auto: the planner's mix for this link; the default model's quantised stream is smaller than its cache
    assert out["precision"] in ("native", "int8", "int8-int4") and out["planner_choice"], out
    if out["precision"] != "native":
        assert out["stream_bytes"] < out["native_bytes"], out
    assert out["local_prefill_ttft_s"] > 0 and len(out["local_prefill_runs_s"]) == 2, out
    assert report["deadline_late_ms"] < 100, report


def test_demo_rejects_a_bad_value_with_exit_2() -> None:
    res = CliRunner().invoke(app, ["demo", "--rho", "-1"])
    assert res.exit_code == 2 and "--rho" in res.output, res.output
