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
                "repair_sent"):
        assert key in out, key
    report = out["report"]
    assert report["outcome"] == "done", report
    assert 0.3 < out["recovered_utility"] <= 1.0, out
    assert out["source_sent"] > 0 and report["n_tokens"] >= 600
    assert isinstance(out["answer"], str) and out["full_kv_answer"], out
    # TTFT counts from the OFFER: the wait for the deadline, then rebuild and the first forward pass.
    assert out["ttft_s"] > 0.5 * out["deadline_s"], out
    assert report["deadline_late_ms"] < 100, report


def test_demo_rejects_a_bad_value_with_exit_2() -> None:
    res = CliRunner().invoke(app, ["demo", "--rho", "-1"])
    assert res.exit_code == 2 and "--rho" in res.output, res.output
