"""Answer scores of the task stage: per-answer metrics and paired summaries (no model)."""

from __future__ import annotations

from typing import Any

import pytest

from pfec.lab.kv.answer_score import (
    bootstrap_mean_ci95,
    exact_match,
    paired_difference,
    score_answer,
    summarise,
)


def test_each_metric_of_one_answer() -> None:
    s = score_answer("Lisbon.\nand more text", ["lisbon"], "The city is Lisbon")
    assert s["answer"] == "Lisbon." and s["words"] == 1
    assert s["exact_match"] == 1.0 and s["contained"] == 1.0 and s["f1"] == 1.0
    assert s["agreement"] == 0.0  # the full-KV answer said more: not the same answer
    verbose = score_answer("The code is 4817.", ["4817"], "the code is 4817")
    assert verbose["exact_match"] == 0.0 and verbose["contained"] == 1.0
    assert verbose["f1"] == pytest.approx(0.5)  # "code is 4817": P 1/3, R 1 and verbose["agreement"] == 1.0
    wrong = score_answer("48170", ["4817"], None)
    assert (wrong["exact_match"], wrong["contained"], wrong["f1"], wrong["agreement"]) == (0.0, 0.0, 0.0, 1.0)
    assert exact_match("The  Falcon!", ["falcon"]) and not exact_match("", [""])


def test_bootstrap_ci_brackets_the_mean_and_is_seeded() -> None:
    values = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    mean, lo, hi = bootstrap_mean_ci95(values)
    assert mean == pytest.approx(0.625) and 0.2 < lo < mean < hi <= 1.0
    assert bootstrap_mean_ci95(values) == (mean, lo, hi)
    assert bootstrap_mean_ci95([0.5]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_mean_ci95([])


def test_paired_difference_keeps_prompts_together() -> None:
    # Prompt difficulty varies a lot, the difference does not: the paired interval is narrow.
    a = {p: float(p % 2) + 0.1 for p in range(20)}
    b = {p: float(p % 2) for p in range(20)}
    diff = paired_difference(a, b)
    assert diff["n"] == 20 and diff["mean"] == pytest.approx(0.1)
    assert diff["ci95"][0] == pytest.approx(0.1) and diff["ci95"][1] == pytest.approx(0.1)
    assert paired_difference({1: 1.0, 2: 0.0}, {2: 1.0, 3: 1.0})["n"] == 1
    with pytest.raises(ValueError, match="share no prompt"):
        paired_difference({1: 1.0}, {2: 1.0})


def _row(prompt: int, scheme: str, right: bool, mode: str = "mask") -> dict[str, Any]:
    return {"prompt": prompt, "scheme": scheme, "rho": 0.8, "mode": mode, "runs": scheme,
            "exact_match": float(right), "contained": float(right), "f1": float(right),
            "agreement": float(right), "recovered_utility": 0.9 if right else 0.5}  # fmt: skip


def test_summary_per_scheme_rho_mode_with_paired_differences() -> None:
    rows = [_row(p, "ref", True) for p in range(10)]
    rows += [_row(p, "udp", p < 6) for p in range(10)]
    rows += [_row(p, "udp", False, "zero") for p in range(10)]
    out = {(e["scheme"], e["mode"]): e for e in summarise(rows, reference="ref")}
    assert set(out) == {("ref", "mask"), ("udp", "mask"), ("udp", "zero")}
    udp = out[("udp", "mask")]
    assert udp["n"] == 10 and udp["exact_match"] == pytest.approx(0.6)
    assert udp["exact_match_ci95"][0] < 0.6 < udp["exact_match_ci95"][1]
    assert udp["recovered_utility"] == pytest.approx(0.74)
    assert udp["vs_ref"]["contained"]["mean"] == pytest.approx(-0.4) and udp["vs_ref"]["contained"]["n"] == 10
    assert "vs_ref" not in out[("ref", "mask")]  # not against itself
    assert "vs_ref" not in out[("udp", "zero")]  # the reference has no zero-mode rows to pair with
    assert "vs_ref" not in summarise(rows)[0]
    with pytest.raises(ValueError, match="scored twice"):
        summarise([*rows, _row(0, "ref", True)])
