"""The fidelity stage (lab/eval/precision.py): paired summaries, and one small end-to-end run on the model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pfec.lab.eval.config import EvalConfig
from pfec.lab.eval.precision import precision_summary
from pfec.lab.eval.precision_report import precision_claims, precision_section


def _row(prompt: int, variant: str, rho: float, agreement: float, contained: float) -> dict[str, Any]:
    return {"prompt": prompt, "variant": variant, "rho": rho, "mix": variant, "agreement": agreement,
            "contained": contained, "recovered_utility": 1.0}


def test_summary_pairs_each_variant_with_native_on_the_same_prompts() -> None:
    native = [1, 0, 0, 1, 0, 0, 1, 0]
    int8 = [1, 1, 1, 1, 0, 1, 1, 1]
    rows = [_row(p, "native", 0.5, a, a) for p, a in enumerate(native)]
    rows += [_row(p, "int8", 0.5, a, 1.0) for p, a in enumerate(int8)]
    summary = {e["variant"]: e for e in precision_summary(rows, ("native", "int8"), (0.5,))}
    assert "vs_native" not in summary["native"]
    diff = summary["int8"]["vs_native"]["agreement"]
    assert diff["mean"] == pytest.approx(np.mean(int8) - np.mean(native))
    assert diff["n"] == 8 and diff["ci95"][0] > 0  # every paired difference is >= 0, four are 1
    assert summary["int8"]["vs_native"]["contained"]["mean"] == pytest.approx(1 - np.mean(native))
    with pytest.raises(ValueError, match="scored twice"):
        precision_summary([*rows, rows[0]], ("native",), (0.5,))


@pytest.mark.slow
def test_two_prompts_end_to_end_native_at_a_long_deadline_equals_the_full_kv() -> None:
    from pfec.lab.eval.precision import precision_scores  # deferred: torch and the model

    cfg = EvalConfig(context_tokens=600, max_new_tokens=12)
    out = precision_scores(cfg, rhos=(2.0,), variants=("native", "int8", "split"), prompts=2)
    rows = {(r["variant"], r["prompt"]): r for r in out["rows"]}
    assert len(rows) == 6
    for p in range(2):
        native = rows[("native", p)]
        assert native["recovered_utility"] == pytest.approx(1.0)
        assert native["agreement"] == 1.0  # the whole cache arrived: the full-KV answer
        assert native["contained"] == out["full_kv"][p]["contained"]
        assert rows[("int8", p)]["levels"] == {"int8": native["levels"]["native"]}
        assert rows[("split", p)]["mode"] == "split"
    summary = {e["variant"]: e for e in out["summary"]}
    for name in ("int8", "split"):
        for metric in ("agreement", "contained"):
            assert summary[name]["vs_native"][metric]["mean"] == pytest.approx(
                summary[name][metric] - summary["native"][metric])
    assert out["variants"]["split"]["mode"] == "split" and out["timing_s"]["total"] > 0


def _stage(auto_by_rho: dict[float, list[int]], native: list[int]) -> dict[str, Any]:
    rows = []
    for rho, auto in auto_by_rho.items():
        rows += [_row(p, "native", rho, a, a) for p, a in enumerate(native)]
        rows += [_row(p, "auto", rho, a, a) for p, a in enumerate(auto)]
    return {"summary": precision_summary(rows, ("native", "auto"), tuple(auto_by_rho))}


def test_the_auto_sentence_says_only_what_the_intervals_say() -> None:
    native = [0, 0, 1, 0, 0, 1, 0, 0]
    better = [1, 1, 1, 1, 1, 1, 1, 1]
    claims = precision_claims(_stage({0.3: better, 0.5: better, 1.0: native}, native)["summary"])
    assert claims[0].startswith("- equal to the full-KV answer: auto beats native-only at every rho below 1")
    assert "rho 1: no clear difference" in claims[0]
    claims = precision_claims(_stage({0.3: better, 0.5: native}, native)["summary"])
    assert "does not beat native-only at every rho below 1" in claims[0] and "rho 0.5: no clear" in claims[0]
    worse = precision_claims(_stage({0.3: [0] * 8}, [1] * 8)["summary"])
    assert "rho 0.3: worse" in worse[1]


def test_the_results_section_lists_the_rows_worse_than_native() -> None:
    stage = _stage({0.5: [0] * 8}, [1] * 8)
    stage["inputs"] = {"prompts": 8, "prompts_done": 8, "workload": "w", "context_tokens": 1500, "model": "m",
                       "scheme": "priorityfec", "loss": "ge", "rate_mbps": 100.0, "rtt_ms": 20.0,
                       "rho_of": "native", "max_new_tokens": 24}
    stage["variants"] = {"native": {"mix": "native", "mode": "handoff"},
                         "auto": {"mix": "int8", "mode": "handoff"}}
    text = "\n".join(precision_section(stage))
    assert "| auto | auto | 0.5 | 8 | 0.0% | -100.0 [-100.0, -100.0] |" in text
    assert "interval below 0): auto at rho 0.5 (equal to the full-KV answer); auto at rho 0.5 (gold" in text
    assert precision_section({"skipped": "--precision-prompts 0"})[-2] == "Not run: --precision-prompts 0."
    assert "ceiling" not in text  # no full-KV rows: no ceiling sentence
    stage["full_kv"] = [{"prompt": p, "contained": float(p < 6)} for p in range(8)]
    assert ("contains the gold answer in 75.0% of these prompts" in "\n".join(precision_section(stage))
            and "rho 0.5: native-only 100.0%, auto 0.0%" in "\n".join(precision_section(stage)))


def test_precision_options_are_validated() -> None:
    with pytest.raises(ValueError, match="precision-variants native,int9"):
        EvalConfig(precision_variants=("native", "int9"))
    with pytest.raises(ValueError, match="with native"):
        EvalConfig(precision_variants=("int8",))
    with pytest.raises(ValueError, match="precision-prompts must be >= 0"):
        EvalConfig(precision_prompts=-1)
    with pytest.raises(ValueError, match=r"rho -0\.5"):
        EvalConfig(precision_rhos=(-0.5,))
