"""`pfec eval`: the --small run's outputs, paired realizations, and honest reporting of missing schemes."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.common.sched import policies
from pfec.lab.eval import evaluate, sweep
from pfec.lab.eval.config import GRID_AUTO, NAMED_CONFIGS, RESULTS_BEGIN, RESULTS_END, SMALL
from pfec.lab.eval.evaluate import run_eval, write_example_trace
from pfec.lab.eval.report import update_results_md
from pfec.lab.eval.sweep import check_pairing
from pfec.lab.reporting.progress import progress_lines
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.simulate import prepare, run_scheme

KV_SECTION = "## KV side: real model\n\nhand-written numbers that must survive\n"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("eval")
    (out / "RESULTS.md").write_text("# Results\n\n## Transport: old table\n\nstale\n\n" + KV_SECTION)
    args = ["eval", "--small", "--json", "--out-dir", str(out), "--figures-dir", str(out / "fig"),
            "--results-md", str(out / "RESULTS.md")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_small_run_writes_csv_plot_and_marked_section(small_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = small_run
    with (out / "eval_utility.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["scheme"] for r in rows} >= {"udp", "priority", "heuristic"}
    assert all(r["config"] == "main" and float(r["rho"]) == 0.8 and r["n"] == "2" for r in rows)
    assert all(0.0 <= float(r["recovered_utility_mean"]) <= 1.0 for r in rows)
    assert (out / "fig" / "eval_utility.png").stat().st_size > 10_000
    text = (out / "RESULTS.md").read_text()
    assert text.count(RESULTS_BEGIN) == 1 and text.count(RESULTS_END) == 1
    assert "stale" not in text and KV_SECTION in text  # old transport table replaced, KV section kept
    generated = text.split(RESULTS_BEGIN)[1].split(RESULTS_END)[0]
    assert "pfec eval --small" in generated and "| heuristic |" in generated
    # The held-out scheduler stage ran (2 paired runs per condition) and its verdict is in the section.
    assert data["scheduler"]["realizations"] == 2 and len(data["scheduler"]["conditions"]) >= 1
    assert "### Learned scheduler" in generated and "DDQN - heuristic" in generated
    assert data["cells"][0]["inputs"]["realizations"] == 2


def test_realizations_are_paired(small_run: tuple[Path, dict[str, Any]]) -> None:
    _out, data = small_run
    cell = data["cells"][0]
    assert cell["pairing"]["runs_checked"] >= 6 and cell["pairing"]["violations"] == 0
    udp, priority = cell["schemes"]["udp"], cell["schemes"]["priority"]
    # Both send only sources in every slot: same datagram count, so the shared pattern costs both the same.
    assert udp["data_sent_runs"] == priority["data_sent_runs"]
    assert udp["forward_lost_runs"] == priority["forward_lost_runs"]
    assert len(set(udp["forward_lost_runs"])) == 2  # the two realizations differ from each other


def test_pairing_check_catches_an_unpaired_run() -> None:
    main = parse_loss_spec(NAMED_CONFIGS["main"])
    sim = SMALL.sim_config(main, 0.8, SMALL.load_profile())
    handoff = prepare(replace(sim, tokens=64))
    runs = {"udp": [run_scheme(handoff, "udp", 0)], "priority": [run_scheme(handoff, "priority", 0)]}
    assert check_pairing(handoff, runs) == {"runs_checked": 2, "violations": 0}
    runs["priority"][0].forward_lost += 1  # as if it had met another realization's losses
    assert check_pairing(handoff, runs)["violations"] == 1


def test_missing_scheme_is_reported_not_invented(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(policies.SCHEMES, "flec-rt")
    monkeypatch.delitem(policies.SCHEMES, "priorityfec", raising=False)
    cfg = replace(SMALL, realizations=1, tokens=64, jobs=1, overhead_realizations=0,
                  schemes=("udp", "heuristic", "flec-rt", "priorityfec"))  # fmt: skip
    result = run_eval(cfg)
    assert "flec-rt" in result["schemes_missing"] and "priorityfec" in result["schemes_missing"]
    assert set(result["cells"][0]["schemes"]) == {"udp", "heuristic"}
    assert result["substitutes"] == {"priorityfec": "heuristic"}  # said out loud, used only in the ablation
    row = next(r for r in result["ablation"] if r["scheme"] == "priorityfec" and r["rho"] == 0.8)
    assert row["runs"] == "heuristic"
    assert row["utility_mean"] == result["cells"][0]["schemes"]["heuristic"]["recovered_utility_mean"]


def test_results_md_rerun_replaces_only_the_marked_part(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nintro\n\n" + KV_SECTION)
    update_results_md(path, f"{RESULTS_BEGIN}\nfirst\n{RESULTS_END}\n")
    update_results_md(path, f"{RESULTS_BEGIN}\nsecond\n{RESULTS_END}\n")
    text = path.read_text()
    assert "second" in text and "first" not in text and "intro" in text and KV_SECTION in text
    assert text.index(RESULTS_END) < text.index("## KV side")


def test_bad_values_name_the_fix() -> None:
    runner = CliRunner()
    bad_rho = runner.invoke(app, ["eval", "--small", "--rhos", "0.8,x", "--results-md", "none"])
    assert bad_rho.exit_code == 2 and "0.8,x" in bad_rho.output
    bad_config = runner.invoke(app, ["eval", "--small", "--configs", "nosuch", "--results-md", "none"])
    assert bad_config.exit_code == 2 and "NAME=SPEC" in bad_config.output


def test_example_trace_is_replayable(tmp_path: Path) -> None:
    info = write_example_trace(tmp_path / "t.trace", seconds=3, probe_ms=1, seed=3)
    model = parse_loss_spec(f"trace:{tmp_path / 't.trace'}")
    assert info["entries"] < info["probes"] and 0.01 < info["mean_loss"] < 0.3
    assert abs(model.mean_loss - info["mean_loss"]) < 0.01  # type: ignore[attr-defined]


def test_render_rewrites_the_docs_from_a_saved_result(
    small_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, _data = small_run
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\n" + KV_SECTION)
    args = ["eval-render", str(out / "eval.json"), "--out-dir", str(tmp_path), "--figures-dir",
            str(tmp_path / "fig"), "--results-md", str(md)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = md.read_text()
    generated = text.split(RESULTS_BEGIN)[1].split(RESULTS_END)[0]
    original = (out / "RESULTS.md").read_text().split(RESULTS_BEGIN)[1].split(RESULTS_END)[0]
    assert generated == original and KV_SECTION in text  # same result, same section
    assert "### Claims checked on this run" in generated
    (tmp_path / "bad.json").write_text("[1, 2]")
    bad = CliRunner().invoke(app, ["eval-render", str(tmp_path / "bad.json"), "--results-md", "none"])
    assert bad.exit_code == 2 and "is not a `pfec eval` result" in bad.output


def test_every_simulated_scheme_reaches_the_task_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple[str, str]]] = []

    def record(cfg: Any, pairs: list[tuple[str, str]], progress: Any, store: Any) -> dict[str, Any]:
        seen.append(pairs)
        return {"skipped": "recorded"}

    monkeypatch.setattr(evaluate, "_task_stage", record)
    cfg = replace(SMALL, realizations=1, tokens=64, jobs=1, overhead_realizations=0,
                  schemes=("udp", "heuristic", "flec-rt", "arq", "oracle"))  # fmt: skip
    result = run_eval(cfg)
    labels = {label for label, _ in seen[0]}
    assert set(result["cells"][0]["schemes"]) <= labels  # every scheme of the sweep is scored
    assert {"udp", "heuristic", "flec-rt", "arq", "oracle", "priorityfec"} <= labels


def test_task_rows_keep_the_reports_fields_and_pair_against_priorityfec() -> None:
    from pfec.lab.eval.task import _score_answer, _task_summary  # deferred: torch (the task stage's module)

    full = _score_answer("1921.", ["1921"], None)
    assert full["agreement"] == 1.0 and full["correct"] and full["f1_gold"] == 1.0 == full["f1_full"]
    rows = []
    for prompt, (ours, theirs) in enumerate([("1921", "1921"), ("1921", "built in 1921"), ("1921", "")]):
        for scheme, text in (("priorityfec", ours), ("udp", theirs)):
            rows.append({"prompt": prompt, "scheme": scheme, "runs": scheme, "rho": 0.8, "mode": "mask",
                         "recovered_utility": 0.5, **_score_answer(text, ["1921"], "1921")})  # fmt: skip
    out = {e["scheme"]: e for e in _task_summary(rows, "priorityfec")}
    udp = out["udp"]
    # "built in 1921" holds the gold answer (correct) but is not it (exact match 0, F1 0.5).
    assert udp["correct"] == 2 and udp["exact_match"] == pytest.approx(1 / 3)
    assert udp["f1_gold"] == pytest.approx(0.5) and len(udp["f1_gold_ci95"]) == 2
    assert udp["agreement"] == pytest.approx(1 / 3) and udp["f1_full"] == pytest.approx(0.5)
    assert udp["vs_priorityfec"]["exact_match"]["mean"] == pytest.approx(-2 / 3)


# ---------------------------------------------------------------------- issue 14: baselines, grid, report


def test_small_run_has_the_grid_its_heat_maps_and_every_baseline_defined(
    small_run: tuple[Path, dict[str, Any]],
) -> None:
    out, data = small_run
    cells = data["grid"]["cells"]
    assert {(c["tokens"], c["rtt_ms"], c["rho"]) for c in cells} == {(192, 20.0, 0.8), (192, 200.0, 0.8)}
    for c in cells:
        assert set(c["schemes"]) == {"priorityfec", "priority-arq", "arq", "oracle", GRID_AUTO}
        pf, parq = c["schemes"]["priorityfec"], c["schemes"]["priority-arq"]
        diffs = [100 * (a - b) for a, b in zip(pf["recovered_utility_runs"], parq["recovered_utility_runs"],
                                                strict=True)]  # fmt: skip
        assert c["lead_over_priority_arq"]["mean"] == pytest.approx(sum(diffs) / len(diffs))
        assert c["schemes"]["oracle"]["efficiency_mean"] == pytest.approx(1.0)
        assert c["schemes"][GRID_AUTO]["utility_kind"] == "credited at precision"
    for name in ("eval_grid_efficiency.png", "eval_grid_lead.png"):
        assert (out / "fig" / name).stat().st_size > 10_000
    with (out / "eval_grid.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2 * 5
    generated = (out / "RESULTS.md").read_text().split(RESULTS_BEGIN)[1].split(RESULTS_END)[0]
    assert "| arq | paper baseline | the paper's ARQ baseline" in generated
    assert "| priority-arq | reference (ours) |" in generated
    assert "| arq-ideal | reference (ours) |" in generated
    assert "### Robustness across RTT and context" in generated and "eval_grid_lead.png" in generated
    for stale in ("RL-FEC", "strongest", "idealised selective-repeat bound", "upper bound", "(1 - 8.4%)"):
        assert stale not in generated, stale
    assert data["config"]["reverse_lossy"] and "on the ACK path too" in generated


def test_small_run_runs_every_real_transport_row_or_says_why(small_run: tuple[Path, dict[str, Any]]) -> None:
    _out, data = small_run
    cell = data["cells"][0]
    rows = ("tcp/cubic", "tcp/bbr", "priority-tcp/cubic", "priority-tcp/bbr", "quic", "priority-quic")
    for row in rows:
        assert (row in cell["schemes"]) != (row in cell["errors"]), row  # ran, or its error is reported
        if row in cell["schemes"]:
            assert cell["schemes"][row]["n"] == 2 and "outliers" in cell["schemes"][row]


def test_reliable_rows_are_labelled_paired_and_failures_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str | None]] = []

    def fake(proto: str, sim: Any, n: int, progress: Any, cc: str | None) -> dict[str, Any]:
        calls.append((proto, cc))
        if proto == "priority-quic":
            raise OSError("no aioquic here")
        runs = [{"realization": r, "utility": 0.5} for r in range(n)]
        return {"schemes": {proto: {"recovered_utility_mean": 0.5, "runs": runs, "outliers": []}}}

    monkeypatch.setattr(sweep, "run_reliable", fake)
    cfg = replace(SMALL, reliable_realizations=2, congestion=("cubic", "bbr"))
    cell: dict[str, Any] = {"config": "main", "rho": 0.8, "errors": {},
                            "schemes": {"oracle": {"recovered_utility_mean": 0.8,
                                                   "recovered_utility_runs": [1.0, 0.5]}}}  # fmt: skip
    sweep.reliable_sweep(cfg, ["tcp", "quic", "priority-quic"], [cell])
    assert calls == [("tcp", "cubic"), ("tcp", "bbr"), ("quic", None), ("priority-quic", None)]
    assert {"tcp/cubic", "tcp/bbr", "quic"} <= set(cell["schemes"]) and "priority-quic" in cell["errors"]
    tcp = cell["schemes"]["tcp/cubic"]
    assert tcp["efficiency_kind"] == "paired" and tcp["efficiency_mean"] == pytest.approx((0.5 + 1.0) / 2)
    assert tcp["congestion"] == "cubic" and tcp["recovered_utility_runs"] == [0.5, 0.5]


def _grid_cell(rho: float, rtt: float, eff: float, lead: float) -> dict[str, Any]:
    return {"rho": rho, "rtt_ms": rtt, "tokens": 192, "schemes": {"priorityfec": {"efficiency_mean": eff}},
            "lead_over_priority_arq": {"mean": lead, "ci95": [lead - 1, lead + 1], "n": 3}}  # fmt: skip


def test_grid_claims_name_the_cells_that_miss_and_lead() -> None:
    from pfec.lab.eval.markdown import _grid_claims

    text = "\n".join(_grid_claims([_grid_cell(0.6, 20, 0.90, 0.0), _grid_cell(0.8, 20, 0.99, -0.2),
                                   _grid_cell(0.8, 200, 0.80, 12.0), _grid_cell(1.0, 100, 0.98, -0.7)]))
    assert "2 of 3 cells; below: 192 tok / 200 ms / rho 0.8 (80.0%)" in text  # rho 0.6 is not held to it
    assert "3 of 4 cells; behind: 192 tok / 100 ms / rho 1.0 (-0.7 pts)" in text
    assert "by >= 5 points: 192 tok / 200 ms / rho 0.8 (+12.0 pts)." in text


def test_never_worse_needs_the_ci_low_end_above_minus_half_a_point() -> None:
    from pfec.lab.eval.markdown import _claims

    def claim(diffs: list[float]) -> str:
        base = [0.9] * len(diffs)
        ours = [b + d for b, d in zip(base, diffs, strict=True)]
        schemes = {"priorityfec": {"n": len(diffs), "recovered_utility_runs": ours},
                   "heuristic": {"n": len(diffs), "recovered_utility_runs": base}}  # fmt: skip
        lines = _claims({"cells": [{"config": "main", "rho": 0.8, "schemes": schemes}]})
        return next(line for line in lines if line.startswith("| DDQN never worse"))

    assert claim([0.0, 0.0, 0.0]).endswith("| yes |")
    # A mean of 0 with a wide interval (its upper end >= 0) is not "never worse".
    assert claim([0.02, -0.02, 0.02, -0.02]).endswith("| **no** |")


def test_progress_for_a_log_is_a_line_per_stage_and_tenth() -> None:
    out = io.StringIO()
    update = progress_lines(out)
    for done in range(0, 101):
        update("utility sweep", done, 100)
    update("grid", 0, 7)
    lines = out.getvalue().splitlines()
    assert len(lines) == 12 and lines[0].endswith("utility sweep: 0/100 (0%)"), lines
    assert lines[-2].endswith("utility sweep: 100/100 (100%)") and lines[-1].endswith("grid: 0/7 (0%)")


def test_the_quic_rows_definitions_name_the_stack_they_ran_on() -> None:
    """The scheme table printed 'QUIC ({stack})': a definition's template, never filled in."""
    from pfec.lab.baselines.reliable import DEFAULT_QUIC_STACK
    from pfec.lab.eval.config import scheme_definitions

    rows = {row["scheme"]: str(row["definition"])
            for row in scheme_definitions(["quic", "priority-quic", "tcp"])}
    named = f"QUIC ({DEFAULT_QUIC_STACK})"
    assert named in rows["quic"] and named in rows["priority-quic"]
    assert not any("{" in text for text in rows.values())
