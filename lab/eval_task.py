"""`pfec eval` stage 2: needle-QA F1 of the answer each scheme's partial KV cache yields (default model).

Prompt i meets loss realization i under every scheme; the answer is generated from the blocks the scheme
completed by the deadline, with the mask and the zero receiver. This module loads torch and the model, so
``evaluate`` imports it only when the task stage runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache

from pfec.common.model import llm
from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.plan.utility import UtilityProfile
from pfec.lab.channel import LossModel, parse_loss_spec
from pfec.lab.eval_config import MODES, NAMED_CONFIGS, EvalConfig
from pfec.lab.profiler import check_profile
from pfec.lab.progress import StageProgress
from pfec.lab.retention import blocks_available, bootstrap_ci95, needle_examples
from pfec.lab.sim import Handoff, prepare, run_scheme
from pfec.lab.workloads import QAExample, best_f1, contains_answer, first_line

__all__ = ["task_scores"]

AnswerKey = tuple[str, bytes]  # (receiver mode, digest of the delivered block set)


def task_scores(
    cfg: EvalConfig,
    task_schemes: Sequence[tuple[str, str]],
    rhos: Sequence[float],
    progress: StageProgress | None = None,
) -> dict[str, Any]:
    """Needle-QA F1 of each scheme's delivered partial cache (default model, main GE config).

    ``task_schemes``: (label, scheme that runs). Prompt i uses loss realization i for every scheme.
    """
    runtime = llm.load_model("default", device="cpu")
    llm.warm_up(runtime)
    profile = cfg.load_profile(runtime.geometry.n_layers)
    if cfg.profile != "synthetic":
        check_profile(runtime, profile)
    examples = needle_examples(runtime, cfg.task_prompts, cfg.context_tokens, cfg.seed)
    loss = parse_loss_spec(cfg.main_loss_spec())
    rows: list[dict[str, Any]] = []
    full_rows: list[dict[str, Any]] = []
    total = len(examples) * len(rhos) * len(task_schemes)
    for i, example in enumerate(examples):
        prompt = llm.chat_prompt(runtime, example.context, example.question)
        cache, _ = llm.prefill(runtime, prompt.context_ids)
        plan = runtime.plan(len(prompt.context_ids))
        full = llm.generate(
            runtime, llm.partial_from_cache(cache, None, "mask"), prompt.question_ids, cfg.max_new_tokens
        )
        reference = first_line(full.text)
        full_rows.append(_score_answer(full.text, example.answers, reference))
        prompt_run = _PromptRun(cfg, runtime, cache, plan, prompt.question_ids, i, example, reference)
        for rho in rhos:
            handoff = _task_handoff(cfg, loss, rho, profile, runtime, plan)
            for label, scheme in task_schemes:
                rows += prompt_run.rows(handoff, label, scheme, rho)
                if progress is not None:
                    progress("task score", len(rows) // len(MODES), total)
    return {
        "rows": rows,
        "full_kv": full_rows,
        "summary": _task_summary(rows),
        "full_kv_f1_gold": float(np.mean([r["f1_gold"] for r in full_rows])),
        "inputs": {
            "model": runtime.model_id,
            "prompts": len(examples),
            "context_tokens": cfg.context_tokens,
            "loss": NAMED_CONFIGS["main"],
            "rhos": list(rhos),
            "modes": list(MODES),
            "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed,
        },
    }


def _task_handoff(
    cfg: EvalConfig,
    loss: LossModel,
    rho: float,
    profile: UtilityProfile,
    runtime: llm.ModelRuntime,
    plan: BlockPlan,
) -> Handoff:
    """The simulator's handoff of this prompt's context (the model's geometry and block plan)."""
    sim = replace(
        cfg.sim_config(loss, rho, profile),
        tokens=plan.n_tokens,
        geometry=runtime.geometry,
        max_symbol_size=llm.MAX_SYMBOL_SIZE,
    )
    handoff = prepare(sim)
    if handoff.plan.n_fragments != plan.n_fragments:
        raise RuntimeError("simulator plan differs from the runtime's block plan")
    return handoff


class _PromptRun:
    """One prompt's scoring: answers are cached per (mode, delivered block set), as the same blocks give
    the same answer whatever scheme delivered them."""

    def __init__(
        self,
        cfg: EvalConfig,
        runtime: llm.ModelRuntime,
        cache: DynamicCache,
        plan: BlockPlan,
        question_ids: Sequence[int],
        index: int,
        example: QAExample,
        reference: str,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.cache = cache
        self.plan = plan
        self.question_ids = question_ids
        self.index = index  # the prompt's number, and the loss realization it meets
        self.example = example
        self.reference = reference
        self.answers: dict[AnswerKey, dict[str, Any]] = {}

    def rows(self, handoff: Handoff, label: str, scheme: str, rho: float) -> list[dict[str, Any]]:
        """One row per receiver mode for ``scheme`` (reported as ``label``) on this prompt's realization."""
        result = run_scheme(handoff, scheme, self.index)
        kept = np.flatnonzero(result.recovered_blocks)
        out = []
        for mode in MODES:
            key = (mode, hashlib.sha1(kept.tobytes()).digest())
            if key not in self.answers:
                self.answers[key] = self._answer_from_blocks(kept, mode)
            out.append(
                {
                    "prompt": self.index,
                    "rho": rho,
                    "scheme": label,
                    "runs": scheme,
                    "mode": mode,
                    "recovered_utility": result.recovered_utility,
                    **self.answers[key],
                }
            )
        return out

    def _answer_from_blocks(self, kept: npt.NDArray[np.int64], mode: str) -> dict[str, Any]:
        available = torch.from_numpy(blocks_available(self.plan, kept)).to(self.runtime.device)
        kv = llm.partial_from_cache(self.cache, available, mode, self.plan.n_tokens)  # type: ignore[arg-type]
        out = llm.generate(self.runtime, kv, self.question_ids, self.cfg.max_new_tokens)
        return _score_answer(out.text, self.example.answers, self.reference)


def _score_answer(answer: str, golds: Sequence[str], reference: str) -> dict[str, Any]:
    line = first_line(answer)
    return {
        "answer": line,
        "f1_gold": best_f1(line, golds),
        "f1_full": best_f1(line, [reference]) if reference else float(not line),
        "correct": contains_answer(line, golds),
    }


def _task_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scheme"], row["rho"], row["mode"]), []).append(row)
    out = []
    for (scheme, rho, mode), group in groups.items():
        f1 = [r["f1_gold"] for r in group]
        out.append(
            {
                "scheme": scheme,
                "runs": group[0]["runs"],
                "rho": rho,
                "mode": mode,
                "n": len(group),
                "f1_gold": float(np.mean(f1)),
                "f1_gold_ci95": list(bootstrap_ci95(f1)),
                "f1_full": float(np.mean([r["f1_full"] for r in group])),
                "correct": int(sum(r["correct"] for r in group)),
                "recovered_utility": float(np.mean([r["recovered_utility"] for r in group])),
            }
        )
    return out
