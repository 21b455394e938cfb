"""`pfec eval`'s trace cells (lab/eval/traces.py) on a trace this test makes: a Markov-modulated rate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.eval.config import SMALL, default_trace_files
from pfec.lab.eval.traces import TRACE_SCHEMES, trace_cells, trace_section, trace_sweep
from pfec.lab.sim.rate_trace import load_rate_trace, markov_trace


def _write(trace_path: Path) -> Path:
    trace = markov_trace([2.0, 8.0, 16.0], mean_hold_s=0.5, seconds=20, seed=3)  # ~9 Mbit/s on average
    trace_path.write_text("\n".join(str(int(t)) for t in trace.opportunities_ms) + "\n")
    return trace_path


def test_each_trace_gives_a_scaled_and_an_own_rate_cell_with_every_scheme_against_the_oracle(
        tmp_path: Path) -> None:
    path = _write(tmp_path / "markov.up")
    cfg = replace(SMALL, trace_files=(str(path),), trace_realizations=2, tokens=768, jobs=1,
                  reliable_realizations=0)
    cells = trace_cells(cfg)
    assert [c.rate for c in cells] == ["scaled", "own"]
    scaled = load_rate_trace(path, cells[0].scale)
    assert abs(scaled.mean_rate_bps / 1e6 - cfg.trace_target_mbps) < 1.0
    result = trace_sweep(cfg, list(TRACE_SCHEMES))
    assert not result["errors"], result["errors"]
    fast, own = result["cells"]
    for cell in (fast, own):
        assert set(cell["schemes"]) == set(TRACE_SCHEMES)
        oracle = cell["schemes"]["oracle"]["recovered_utility_runs"]
        for name in ("priorityfec@deadline", "heuristic@deadline"):
            entry = cell["schemes"][name]
            assert len(entry["recovered_utility_runs"]) == 2
            # Paired with the oracle of the same start and losses: the bound holds run by run.
            assert all(u <= o + 1e-9 for u, o in zip(entry["recovered_utility_runs"], oracle, strict=True))
            assert "rate_end" in entry and 0 <= entry["queue_drop_share"] <= 1
        for name in ("known-rate", "known-rate-unbounded"):  # the idealised references, the same pairing
            entry = cell["schemes"][name]
            assert all(u <= o + 1e-9 for u, o in zip(entry["recovered_utility_runs"], oracle, strict=True))
            assert entry["queue_delay_ms_p95_median"] >= 0
        assert cell["planner"]["choice"]
    # The same deadline on a ~9 Mbit/s link carries a fraction of what ~100 Mbit/s carries.
    oracle_mean = {c["rate"]: c["schemes"]["oracle"]["recovered_utility_mean"] for c in (fast, own)}
    assert oracle_mean["own"] < oracle_mean["scaled"]
    assert own["planner"]["forecast_mbps"] < fast["planner"]["forecast_mbps"]
    text = "\n".join(trace_section(result))
    assert "markov.up x1 |" in text and "Moving links" in text


def test_real_tcp_and_quic_meet_the_same_trace_starts(tmp_path: Path) -> None:
    """The trace cells' real rows: QUIC over the relay (and kernel TCP/BBR where namespaces can be made),
    on realization r's start in the trace, scored against the oracle of the same realization."""
    path = _write(tmp_path / "markov.up")
    cfg = replace(SMALL, trace_files=(str(path),), trace_realizations=1, tokens=192, jobs=1)
    result = trace_sweep(cfg, list(TRACE_SCHEMES))
    for cell in result["cells"]:
        quic = cell["schemes"]["quic"]
        assert len(quic["recovered_utility_runs"]) == 1 and "qh3" in quic["definition"]
        assert 0 <= quic["recovered_utility_mean"] <= 1
        if "reliable_skipped" not in cell:
            assert len(cell["schemes"]["tcp/bbr"]["recovered_utility_runs"]) == 1
        else:
            assert "tcp/bbr" in cell["reliable_skipped"]
    assert "quic (of oracle)" in "\n".join(trace_section(result))


def test_no_trace_files_skips_the_stage_with_the_reason(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert "no trace files" in trace_sweep(SMALL, list(TRACE_SCHEMES))["skipped"]
    assert "Not run" in "\n".join(trace_section({"skipped": "x"}))
    monkeypatch.setenv("PFEC_TRACES_DIR", str(tmp_path))
    _write(tmp_path / "a.up")
    (tmp_path / "README.md").write_text("not a trace")
    assert default_trace_files() == (str(tmp_path / "a.up"),)


def test_a_missing_or_malformed_trace_file_is_refused_with_its_name(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["eval", "--small", "--trace-files", str(tmp_path / "nope.up")])
    assert res.exit_code == 2 and "nope.up is not a file" in res.output
    bad = tmp_path / "bad.up"
    bad.write_text("1\n5\n3\n")
    cfg = replace(SMALL, trace_files=(str(bad),))
    with pytest.raises(ValueError, match=r"bad.up:3"):
        trace_cells(cfg)


def test_eval_trace_cells_adds_the_cells_to_a_saved_result_and_its_section(tmp_path: Path) -> None:
    saved = Path(__file__).resolve().parents[1] / "docs" / "results" / "eval.json"
    result = tmp_path / "eval.json"
    result.write_text(saved.read_text())
    trace = _write(tmp_path / "markov.up")
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    res = CliRunner().invoke(app, [
        "eval-trace-cells", "--result", str(result), "--trace-files", str(trace), "--trace-realizations", "1",
        "--reliable-realizations", "0", "--out-dir", str(tmp_path / "out"), "--figures-dir", str(tmp_path),
        "--results-md", str(md)])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert written["traces"]["command"].startswith("pfec eval-trace-cells")
    assert written["cells"] == json.loads(saved.read_text())["cells"]  # the rest as it was measured
    assert "markov.up x1 |" in md.read_text()
