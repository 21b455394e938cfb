"""The eval's task stage on the real default model: answers from each scheme's delivered cache, scored; the
same rows whether the prompts run in one process or are spread over a spawned pool."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pfec.common.model import llm
from pfec.lab.eval.config import EvalConfig
from pfec.lab.eval.task import task_scores

pytestmark = pytest.mark.slow


def test_task_scores_are_the_same_in_one_process_and_in_a_pool() -> None:
    cfg = replace(EvalConfig(), task_prompts=2, context_tokens=300, max_new_tokens=8, jobs=1)
    schemes = [("priority", "priority"), ("heuristic", "heuristic")]
    seen: list[tuple[int, int]] = []
    one = task_scores(cfg, schemes, (0.6,), progress=lambda _stage, done, total: seen.append((done, total)))
    pooled = task_scores(replace(cfg, jobs=2), schemes, (0.6,))
    assert seen[-1] == (4, 4)  # prompts x rhos x schemes
    assert one["rows"] == pooled["rows"] and one["full_kv"] == pooled["full_kv"]
    assert len(one["rows"]) == 2 * 2 * 2  # prompts x schemes x (mask, zero)
    assert pooled["inputs"]["processes"] == 2
    by_key = {(r["prompt"], r["scheme"], r["mode"]): r for r in one["rows"]}
    schemes_run = ("priority", "heuristic")
    assert set(by_key) == {(p, s, m) for p in (0, 1) for s in schemes_run for m in ("mask", "zero")}
    assert all(0.0 <= r["recovered_utility"] <= 1.0 for r in one["rows"])
    summary = {(e["scheme"], e["mode"]) for e in one["summary"]}
    assert ("heuristic", "mask") in summary and ("priority", "zero") in summary


def test_a_later_stage_loads_the_prompts_prefilled_caches(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = replace(EvalConfig(), task_prompts=1, context_tokens=300, max_new_tokens=8, jobs=1)
    schemes = [("priority", "priority")]
    first = task_scores(cfg, schemes, (0.6,), prefill_store=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1 and not list(tmp_path.glob("*.tmp"))
    real = llm.prefill

    def no_context_prefill(runtime: llm.ModelRuntime, ids: Any, *args: Any) -> Any:
        assert len(ids) < 100, "the prompt's context was prefilled again"  # warm-up prompts are short
        return real(runtime, ids, *args)

    monkeypatch.setattr(llm, "prefill", no_context_prefill)
    again = task_scores(cfg, schemes, (0.6,), prefill_store=tmp_path)
    assert again["rows"] == first["rows"] and again["full_kv"] == first["full_kv"]
