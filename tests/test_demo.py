"""`pfec demo` with the real default model: receiver, relay and sender processes, needle QA, a real answer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.bench.breakeven import MODES


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
    # A whole-cache handoff (at 600 tokens auto's planner may choose local prefill: nothing would stream).
    res = CliRunner().invoke(app, ["demo", "--json", "--tokens", "600", "--no-compare-sim",
                                   "--mode", "handoff"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("recovered_utility", "ttft_s", "deadline_s", "answer", "full_kv_answer", "source_sent",
                "repair_sent", "bytes_sent", "native_bytes", "precision_mix", "planner_choice",
                "local_prefill_ttft_s", "local_prefill_whole_machine_ttft_s", "cpus", "ttft_vs_local"):
        assert key in out, key
    report = out["report"]
    assert report["outcome"] == "done", report
    assert 0.3 < out["recovered_utility"] <= 1.0, out
    assert out["source_sent"] > 0 and report["n_tokens"] >= 600
    assert isinstance(out["answer"], str) and out["full_kv_answer"], out
    # TTFT counts from the OFFER: the wait for the last symbol (or the deadline), rebuild, first forward.
    assert out["start"] in ("ready", "sender-done", "deadline") and out["ttft_s"] > 0, out
    if out["start"] == "deadline":
        assert out["ttft_s"] > 0.5 * out["deadline_s"], out
    # precision auto: the planner's mix for this link; the default model's quantised stream is smaller than
    # its cache
    assert out["precision"] in ("native", "int8", "int8-int4") and out["planner_choice"], out
    if out["precision"] != "native":
        assert out["stream_bytes"] < out["native_bytes"], out
    assert out["local_prefill_ttft_s"] > 0 and len(out["local_prefill_runs_s"]) == 2, out
    assert out["local_prefill_whole_machine_ttft_s"] > 0, out
    assert len(out["local_prefill_whole_machine_runs_s"]) == 2, out
    assert out["ttft_vs_local"] == round(out["ttft_s"] / out["local_prefill_ttft_s"], 4), out
    # the receiver timed its local prefill on its own CPUs; the sender, with them restored, on all of them
    where = out["local_prefill_measured_on"]
    _check_cpus(out["cpus"], where["receiver"])
    every = sorted(os.sched_getaffinity(0))
    assert where["whole_machine"] == {"cpus": every, "torch_threads": len(every)}, where
    assert report["deadline_late_ms"] < 100, report
    # each predicted part beside what it took, planned from the receiver's own measurements
    parts = out["predicted_vs_measured"]
    for part in ("ready_s", "rebuild_s", "question_s", "decode_s", "ttft_s"):
        assert parts[part]["predicted"] > 0 and parts[part]["measured"] > 0, (part, parts)
    assert out["receiver_defaulted"] == [], out["receiver_defaulted"]


def _check_cpus(cpus: dict[str, Any], timed_on: dict[str, Any]) -> None:
    """The nodes' CPU sets as stated (disjoint where 2+ CPUs exist) and where local prefill was timed."""
    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        assert cpus["pinned"] is False and cpus["why"], cpus
        assert timed_on["cpus"] == every, timed_on
        return
    assert cpus["pinned"] is True and cpus["relay"] == cpus["sender"], cpus
    assert not set(cpus["receiver"]) & set(cpus["sender"]), cpus
    assert sorted(cpus["receiver"] + cpus["sender"]) == every, cpus
    assert timed_on == {"cpus": cpus["receiver"], "torch_threads": len(cpus["receiver"])}, timed_on


def test_demo_rejects_a_bad_value_with_exit_2() -> None:
    res = CliRunner().invoke(app, ["demo", "--rho", "-1"])
    assert res.exit_code == 2 and "--rho" in res.output, res.output
    res = CliRunner().invoke(app, ["demo", "--receiver-cpu-quota", "0"])
    assert res.exit_code == 2 and "--receiver-cpu-quota" in res.output, res.output


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
    native, auto, split, auto_mode = out["runs"]
    # auto: fidelity first; under the loose deadline the most faithful level that beats local prefill by
    # the margin (native or the int8 floor); a quantised stream travels fewer bytes.
    assert auto["precision"] in ("native", "int8"), auto
    if auto["precision"] != "native":
        assert auto["bytes_sent"] < native["bytes_sent"], (auto, native)
    assert "prediction_error" in out and len(out["prediction_error"]["cells"]) == len(MODES)
    # The stream carries the front after the back: the receiver may start before its front reaches the
    # meeting point; what it did not compute arrived.
    assert 0 <= split["computed_tokens"] <= split["n_tokens"], split
    # auto mode (local, handoff or split: the warm-up split stated the receiver's speed, so split may win)
    # is held against the cell's fastest measured option.
    versus = out["auto_vs_fastest"]
    assert versus["of"] == 1 and versus["cells"][0]["ran"].split(":")[0] in ("local", "handoff", "split")
    assert versus["cells"][0]["ttft_s"] == auto_mode["ttft_s"], (versus, auto_mode)
    assert out["local"]["200"]["ttft_s"] > 0 and out["local"]["200"]["context_tokens"] >= 200
    _check_cpus(out["cpus"], {k: out["local"]["200"][k] for k in ("cpus", "torch_threads")})
    assert set(out["crossovers"]["200"]) == {label for label, _, _ in MODES}
    for name in ("breakeven.json", "breakeven.md", "breakeven.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "| 200 | 200 |" in (tmp_path / "breakeven.md").read_text()


def test_the_demo_warns_of_a_starved_sender_only_when_its_receiver_waited_for_the_deadline() -> None:
    """A session that started ready (a split streams only the back; what was in flight arrives after the
    start) used little of the link by design: no warning. At the deadline with sources unsent: a warning."""
    from pfec.lab.demo import DemoConfig, _diagnostics

    report = {"deadline_ms": 7000.0, "bytes_sent": 10_000_000, "source_sent": 7000, "n_source": 15000,
              "receiver_stats": {"late": 300}, "start": "ready"}
    cfg = DemoConfig(rate_mbps=30.0, rtt_ms=30.0)
    assert _diagnostics(cfg, report)["warnings"] == []
    warnings = _diagnostics(cfg, {**report, "start": "deadline"})["warnings"]
    assert len(warnings) == 2 and "short of CPU" in warnings[0] and "300 datagrams" in warnings[1]


def test_demo_runs_are_summarised_per_receiver_quota() -> None:
    """``summarise_runs`` (scripts/demo-figures.sh): medians per quota of TTFT over local prefill and of
    each part's measured over predicted, and whether the answers equalled the full-KV answer."""
    from pfec.lab.demo import summarise_runs

    def run(quota: float | None, ratio: float, rebuild: float, same: bool) -> dict[str, Any]:
        return {"receiver_cpu_quota": quota, "ttft_vs_local": ratio, "answer": "a",
                "full_kv_answer": "a" if same else "b", "mode": "split", "precision": "int8",
                "predicted_vs_measured": {"rebuild_s": {"predicted": 0.1, "measured": 0.1 * rebuild,
                                                        "measured_over_predicted": rebuild}}}

    out = summarise_runs([run(None, 0.3, 1.0, True), run(None, 0.5, 3.0, True), run(None, 0.4, 2.0, True),
                          run(0.5, 0.6, 1.2, False)])
    assert out["none"]["runs"] == 3 and out["none"]["ttft_vs_local_median"] == 0.4
    assert out["none"]["measured_over_predicted_median"] == {"rebuild_s": 2.0}
    assert out["none"]["answers_equal_full_kv"] == [True, True, True]
    assert out["0.5"]["answers_equal_full_kv"] == [False] and out["0.5"]["ttft_vs_local_median"] == 0.6
