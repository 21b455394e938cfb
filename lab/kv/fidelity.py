"""Answer fidelity per precision (issue 13, item 3): what each quantised level keeps, whole cache and per
layer group, measured on needle-QA prompts against the full cache.

Why: the stream orders pieces by value per byte, and "value" must mean answer fidelity. For each prompt
the full-KV greedy answer (``answer_tokens`` long) is the reference; its next-token distributions under
the full cache are compared (teacher-forced) with those under

* every block at level L (``quant.roundtrip``): mean KL(full || L), top-1 agreement, and whether the
  greedy answer is token-for-token the full-KV answer;
* only one layer group at level L, the rest native: KL per (group, level);
* that layer group dropped (what the receiver does with missing blocks today, ``mask`` mode): KL per group.

The fidelity of a level for a group is ``1 - KL(group at L) / KL(group dropped)``, clipped to [0, 1]: the
share of the damage of losing the group that sending it at L avoids (native = 1, missing = 0). The table
is a ``precision.FidelityTable``; the utility profile will carry it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from pfec.common.model import llm, quant
from pfec.common.plan.precision import QUANTISED_LEVELS, SCHEME, FidelityTable, Level, PieceLayout
from pfec.lab.kv.profiler import ScoredPrompt, answer_log_probs, even_groups, mean_kl
from pfec.lab.kv.workloads import needle_qa

LEVELS: tuple[Level, ...] = (*QUANTISED_LEVELS, Level.NATIVE)


def _log(message: str) -> None:
    print(f"[pfec fidelity] {message}", file=sys.stderr, flush=True)


def _agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference.argmax(-1) == other.argmax(-1)).float().mean())


def _mixed(full: llm.PartialKV, lowered: quant.DequantisedKV, group: tuple[int, int]) -> llm.PartialKV:
    """The full cache with the layers of ``group`` taken from ``lowered``."""
    lo, hi = group
    keys = [lowered.keys[i] if lo <= i < hi else k for i, k in enumerate(full.keys)]
    values = [lowered.values[i] if lo <= i < hi else v for i, v in enumerate(full.values)]
    return llm.PartialKV(keys, values, None, full.n_context, "mask")


def _prompt_scores(runtime: llm.ModelRuntime, prompt: llm.HandoffPrompt, groups: Sequence[tuple[int, int]],
                   answer_tokens: int) -> dict[str, Any]:
    """Every measurement of one prompt."""
    cache, _ = llm.prefill(runtime, prompt.context_ids)
    n = len(prompt.context_ids)
    full = llm.partial_from_cache(cache, None, "mask")
    answer = llm.generate(runtime, full, prompt.question_ids, answer_tokens)
    n_question = len(prompt.question_ids)
    scored = ScoredPrompt(prompt.context_ids, prompt.question_ids + answer.token_ids, n_question)
    reference = answer_log_probs(runtime, full, scored)
    layers = [(k[:, :, :n], v[:, :, :n]) for k, v in llm.cache_layers(cache)]
    layout = PieceLayout(runtime.geometry, n)
    out: dict[str, Any] = {"context_tokens": n, "answer": answer.text, "levels": {}, "dropped_kl": []}
    for level in LEVELS:
        lowered = quant.roundtrip(layers, layout, level, runtime.compute_dtype)
        kv = llm.PartialKV(lowered.keys, lowered.values, None, n, "mask")
        probs = answer_log_probs(runtime, kv, scored)
        greedy = llm.generate(runtime, kv, prompt.question_ids, answer_tokens)
        out["levels"][level.label] = {
            "kl": mean_kl(reference, probs), "agreement": _agreement(reference, probs),
            "same_answer": greedy.token_ids == answer.token_ids,
            "group_kl": [mean_kl(reference, answer_log_probs(runtime, _mixed(full, lowered, g), scored))
                         for g in groups],
        }
    g_ = runtime.geometry
    for lo, hi in groups:
        available = torch.ones(g_.n_layers, g_.n_kv_heads, n, dtype=torch.bool, device=runtime.device)
        available[lo:hi] = False
        dropped = llm.partial_from_cache(cache, available, "mask", n)
        out["dropped_kl"].append(mean_kl(reference, answer_log_probs(runtime, dropped, scored)))
    return out


def fidelity_table(per_prompt: Sequence[dict[str, Any]], groups: Sequence[tuple[int, int]], n_layers: int,
                   runtime: llm.ModelRuntime, source: dict[str, Any]) -> FidelityTable:
    """Per (group, level): 1 - mean KL(group at L) / mean KL(group dropped), clipped to [0, 1]."""
    dropped = np.mean([p["dropped_kl"] for p in per_prompt], axis=0)
    rows = []
    for gi in range(len(groups)):
        row = []
        for level in QUANTISED_LEVELS:
            kl = float(np.mean([p["levels"][level.label]["group_kl"][gi] for p in per_prompt]))
            row.append(float(np.clip(1.0 - kl / dropped[gi], 0.0, 1.0)) if dropped[gi] > 0 else 1.0)
        rows.append(tuple(row))
    return FidelityTable(n_layers=n_layers, layer_groups=tuple(groups), levels=QUANTISED_LEVELS,
                         fidelity=tuple(rows), scheme=SCHEME, model_id=runtime.model_id,
                         fingerprint=runtime.fingerprint.model_digest, source=source)


def measure_fidelity(runtime: llm.ModelRuntime, n_prompts: int = 4, context_tokens: int = 1750, seed: int = 0,
                     n_groups: int = 5, answer_tokens: int = 24,
                     progress: Callable[[str], None] = _log) -> dict[str, Any]:
    """Fidelity of every level over ``n_prompts`` needle-QA prompts (held-out essays, varied depths)."""
    if n_prompts < 1 or answer_tokens < 1:
        raise ValueError(f"n_prompts and answer_tokens must be >= 1, got {n_prompts} and {answer_tokens}")
    started = time.perf_counter()
    groups = even_groups(runtime.geometry.n_layers, n_groups)
    count = partial(llm.count_tokens, runtime)
    examples = needle_qa(n_prompts, context_tokens, seed=seed, split="eval", count_tokens=count)
    per_prompt = []
    for i, ex in enumerate(examples):
        prompt = llm.chat_prompt(runtime, ex.context, ex.question)
        scores = _prompt_scores(runtime, prompt, groups, answer_tokens)
        scores.update(id=ex.meta.get("id"), depth=ex.meta.get("depth"), kind=ex.meta.get("kind"),
                      essays=ex.meta.get("essays"))
        per_prompt.append(scores)
        progress(f"prompt {i + 1}/{n_prompts} ({time.perf_counter() - started:.0f} s)")
    whole = {}
    for level in LEVELS:
        cells = [p["levels"][level.label] for p in per_prompt]
        whole[level.label] = {
            "mean_kl": float(np.mean([c["kl"] for c in cells])),
            "agreement": float(np.mean([c["agreement"] for c in cells])),
            "same_answer": int(sum(c["same_answer"] for c in cells)), "n": len(cells),
            "group_mean_kl": np.mean([c["group_kl"] for c in cells], axis=0).tolist(),
        }
    source = {
        "kind": "teacher-forced KL vs full KV, one layer group lowered at a time",
        "metric": "1 - KL(group at level) / KL(group dropped, mask mode), clipped to [0, 1]",
        "prompts": n_prompts, "context_tokens": context_tokens, "seed": seed, "essays": "eval",
        "answer_tokens": answer_tokens, "seconds": round(time.perf_counter() - started, 1),
    }
    table = fidelity_table(per_prompt, groups, runtime.geometry.n_layers, runtime, source)
    return {
        "table": table.to_json(),
        "whole_cache": whole,
        "dropped_group_mean_kl": np.mean([p["dropped_kl"] for p in per_prompt], axis=0).tolist(),
        "layer_groups": [list(g) for g in groups],
        "per_prompt": per_prompt,
        "inputs": {"model": runtime.model_id, "compute_dtype": str(runtime.compute_dtype), **source},
    }
