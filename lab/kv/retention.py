"""Retention check (paper Fig. 2c) and the receiver-side checks on real handoffs.

* ``retention_check``: on held-out prompts (the *eval* half of the essays, disjoint from profiling), keep
  20/40/60/80% of the KV blocks chosen by the profile's utility, by the per-request attention utility, or
  at random, and measure teacher-forced top-1 agreement with intact-KV execution over the full-KV answer.
* ``roundtrip_check``: every block serialised to symbols and rebuilt; receiver answer vs the sender's own.
* ``reconstruction_table``: needle-QA F1 of ``mask`` vs ``zero`` under random and profile-ranked block loss.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pfec.common.model import llm
from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.plan.utility import UtilityProfile, request_block_utilities, utility_order
from pfec.lab.kv.profiler import ScoredPrompt, check_profile, needle_prompts
from pfec.lab.kv.workloads import QAExample, best_f1, contains_answer, first_line, needle_qa
from pfec.lab.reporting.figures import pyplot, save_figure

OBSERVE_WINDOW = 32


def _log(message: str) -> None:
    print(f"[pfec] {message}", file=sys.stderr, flush=True)


def bootstrap_ci95(values: Sequence[float], seed: int = 0, n_resamples: int = 10_000) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean, resampling prompts."""
    data = np.asarray(values, dtype=np.float64)
    if data.size < 2:
        return float(data.mean()), float(data.mean())
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(n_resamples, data.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def blocks_available(plan: BlockPlan, kept_blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Rows [layers, KV heads, tokens] usable when exactly ``kept_blocks`` arrived whole."""
    g = plan.geometry
    available = np.zeros((g.n_layers, g.n_kv_heads, plan.n_tokens), dtype=bool)
    for block in np.asarray(kept_blocks).tolist():
        start, end = plan.block_token_range(block)
        available[plan.block_layer(block), :, start:end] = True
    return available


def top_blocks(utilities: npt.NDArray[np.float64], fraction: float) -> npt.NDArray[np.int64]:
    """The ``fraction`` of blocks with the highest utility (rounded to the nearest block count)."""
    return utility_order(utilities)[: round(fraction * len(utilities))]


def attention_mass(obs: llm.Observation, n_layers: int) -> npt.NDArray[np.float64]:
    """Observation -> [layers, KV heads, tokens] numpy array."""
    if sorted(obs.mass) != list(range(n_layers)):
        raise ValueError(f"observation covers layers {sorted(obs.mass)}, expected 0..{n_layers - 1}")
    return obs.as_array()


@dataclass
class _PreparedPrompt:
    prompt: ScoredPrompt
    cache: Any
    plan: BlockPlan
    reference_top1: torch.Tensor
    request_utilities: npt.NDArray[np.float64]


def _prepare(runtime: llm.ModelRuntime, prompt: ScoredPrompt) -> _PreparedPrompt:
    cache, obs = llm.prefill(runtime, prompt.context_ids, observe_window=OBSERVE_WINDOW)
    assert obs is not None
    plan = runtime.plan(len(prompt.context_ids))
    full = llm.partial_from_cache(cache, None, "zero")
    logits = llm.teacher_forced_logits(runtime, full, prompt.score_ids)
    reference = logits[prompt.n_question - 1 : -1].argmax(-1)
    request = request_block_utilities(plan, attention_mass(obs, runtime.geometry.n_layers))
    return _PreparedPrompt(prompt, cache, plan, reference, request)


def _agreement(runtime: llm.ModelRuntime, prep: _PreparedPrompt, kept: npt.NDArray[np.int64],
               mode: llm.ReconstructionMode) -> float:
    available = torch.from_numpy(blocks_available(prep.plan, kept)).to(runtime.device)
    kv = llm.partial_from_cache(prep.cache, available, mode, prep.plan.n_tokens)
    logits = llm.teacher_forced_logits(runtime, kv, prep.prompt.score_ids)
    top1 = logits[prep.prompt.n_question - 1 : -1].argmax(-1)
    return float((top1 == prep.reference_top1).float().mean())


def retention_check(runtime: llm.ModelRuntime, profile: UtilityProfile,
                    retentions: Sequence[float] = (0.2, 0.4, 0.6, 0.8), n_prompts: int = 20,
                    context_tokens: int = 1500, seed: int = 1, random_draws: int = 3, answer_tokens: int = 16,
                    mode: llm.ReconstructionMode = "zero") -> dict[str, Any]:
    """Teacher-forced top-1 agreement at each retention: profile-ranked, per-request-ranked, random."""
    check_profile(runtime, profile)
    for r in retentions:
        if not 0.0 < r <= 1.0:
            raise ValueError(f"retention {r!r} must lie in (0, 1]")
    started = time.perf_counter()
    prompts = needle_prompts(runtime, n_prompts, context_tokens, seed, "eval", answer_tokens)
    rng = np.random.default_rng(seed)
    scores: dict[str, dict[float, list[float]]] = {k: {r: [] for r in retentions}
                                                   for k in ("ranked", "random", "request")}
    for i, prompt in enumerate(prompts):
        prep = _prepare(runtime, prompt)
        profile_u = profile.block_utilities(prep.plan)
        for r in retentions:
            scores["ranked"][r].append(_agreement(runtime, prep, top_blocks(profile_u, r), mode))
            by_request = top_blocks(prep.request_utilities, r)
            scores["request"][r].append(_agreement(runtime, prep, by_request, mode))
            draws = [_agreement(runtime, prep, top_blocks(rng.random(prep.plan.n_blocks), r), mode)
                     for _ in range(random_draws)]
            scores["random"][r].append(float(np.mean(draws)))
        _log(f"retention prompt {i + 1}/{len(prompts)} ({time.perf_counter() - started:.0f} s)")
    points = []
    for r in retentions:
        point: dict[str, Any] = {"retention": r}
        for kind, key in (("ranked", "ranked"), ("random", "random"), ("request", "request_ranked")):
            point[key] = float(np.mean(scores[kind][r]))
            point[f"{key}_ci95"] = list(bootstrap_ci95(scores[kind][r], seed=seed))
        points.append(point)
    return {
        "points": points,
        "inputs": {
            "model": runtime.model_id, "fingerprint": runtime.fingerprint.to_json(),
            "profile": {"model_id": profile.model_id, "fingerprint": profile.fingerprint,
                        "source_kind": profile.source.get("kind")},
            "retentions": list(retentions), "prompts": n_prompts, "context_tokens": context_tokens,
            "seed": seed, "essays": "eval (disjoint from the profiling essays)", "random_draws": random_draws,
            "answer_tokens": answer_tokens, "mode": mode, "observe_window": OBSERVE_WINDOW,
            "metric": "teacher-forced top-1 agreement with intact-KV execution over the full-KV answer",
            "ci": "95% percentile bootstrap over prompts",
            "seconds": round(time.perf_counter() - started, 1),
        },
    }


def plot_retention(result: dict[str, Any], path: str | Path) -> Path:
    """Fig. 2c on our model: agreement vs retention with 95% intervals."""
    plt = pyplot()
    points = result["points"]
    x = np.array([p["retention"] for p in points]) * 100
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for key, label, marker in (("ranked", "profile-ranked", "o"), ("request_ranked", "per-request", "s"),
                               ("random", "random", "^")):
        if key not in points[0]:
            continue
        y = np.array([p[key] for p in points]) * 100
        lo = y - np.array([p[f"{key}_ci95"][0] for p in points]) * 100
        hi = np.array([p[f"{key}_ci95"][1] for p in points]) * 100 - y
        ax.errorbar(x, y, yerr=[lo, hi], marker=marker, capsize=3, label=label)
    inputs = result["inputs"]
    ax.set_xlabel("KV retention (%)")
    ax.set_ylabel("top-1 agreement with full KV (%)")
    ax.set_title(f"{inputs['model'].split('/')[-1]}, {inputs['prompts']} held-out prompts, {inputs['mode']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path, dpi=150)


# --- Real handoffs ----------------------------------------------------------------------------------------


def needle_examples(runtime: llm.ModelRuntime, n: int, context_tokens: int, seed: int) -> list[QAExample]:
    """``n`` needle-QA examples over the held-out (``eval``) essays, sized in the model's tokens."""
    count = partial(llm.count_tokens, runtime)
    return needle_qa(n, context_tokens, seed=seed, split="eval", count_tokens=count)


def _score(answer: str, example: QAExample, reference: str) -> dict[str, Any]:
    line = first_line(answer)
    return {"answer": line, "f1_gold": best_f1(line, example.answers),
            "f1_full": best_f1(line, [reference]) if reference else float(not line),
            "correct": contains_answer(line, example.answers)}


def transfer_dtype_error(cache: Any) -> dict[str, float]:
    """Largest |K|, |V| and the relative round-trip error of casting the cache to bf16 and to fp16."""
    layers = llm.cache_layers(cache)
    kv = torch.cat([torch.cat([k.flatten(), v.flatten()]) for k, v in layers]).float()
    out = {"kv_abs_max": float(kv.abs().max())}
    for name in ("bf16", "fp16"):
        cast = kv.to(llm.TORCH_DTYPES[name]).float()
        out[f"{name}_rel_err"] = float((cast - kv).norm() / kv.norm())
        out[f"{name}_non_finite"] = int((~torch.isfinite(cast)).sum())
    return out


def roundtrip_check(runtime: llm.ModelRuntime, examples: Sequence[QAExample], max_new_tokens: int = 24,
                    mode: llm.ReconstructionMode = "mask") -> dict[str, Any]:
    """Every fragment serialised (in plan order) and delivered: receiver answer vs sender's full-KV answer."""
    rows: list[dict[str, Any]] = []
    for i, ex in enumerate(examples):
        prompt = llm.chat_prompt(runtime, ex.context, ex.question)
        cache, _ = llm.prefill(runtime, prompt.context_ids)
        sender = llm.generate(runtime, llm.partial_from_cache(cache, None, mode), prompt.question_ids,
                              max_new_tokens)
        plan = runtime.plan(len(prompt.context_ids))
        symbols = llm.serialise_symbols(runtime, cache, plan, np.arange(plan.n_fragments))
        kv = llm.rebuild_from_symbols(runtime, plan, symbols, np.ones(plan.n_fragments, dtype=bool), mode)
        receiver = llm.generate(runtime, kv, prompt.question_ids, max_new_tokens)
        rows.append({
            "id": ex.meta.get("id", i), "gold": list(ex.answers), "context_tokens": len(prompt.context_ids),
            "sender": sender.text, "receiver": receiver.text, "equal": sender.token_ids == receiver.token_ids,
            "sender_correct": contains_answer(first_line(sender.text), ex.answers),
            "receiver_correct": contains_answer(first_line(receiver.text), ex.answers),
            "ttft_s": receiver.ttft_s, "rebuild_s": kv.rebuild_s, **transfer_dtype_error(cache),
        })
        _log(f"round trip {i + 1}/{len(examples)}: equal={rows[-1]['equal']} "
             f"correct={rows[-1]['receiver_correct']}")
    return {
        "n": len(rows),
        "receiver_equals_sender": sum(r["equal"] for r in rows),
        "sender_correct": sum(r["sender_correct"] for r in rows),
        "receiver_correct": sum(r["receiver_correct"] for r in rows),
        "median_ttft_s": float(np.median([r["ttft_s"] for r in rows])),
        "median_rebuild_s": float(np.median([r["rebuild_s"] for r in rows])),
        "kv_abs_max": float(max(r["kv_abs_max"] for r in rows)),
        "bf16_rel_err_max": float(max(r["bf16_rel_err"] for r in rows)),
        "fp16_rel_err_max": float(max(r["fp16_rel_err"] for r in rows)),
        "rows": rows,
    }


LossPolicy = Callable[[BlockPlan, float, np.random.Generator], npt.NDArray[np.int64]]


def reconstruction_table(runtime: llm.ModelRuntime, profile: UtilityProfile, examples: Sequence[QAExample],
                         losses: Sequence[float] = (0.1, 0.2, 0.4), seed: int = 0,
                         max_new_tokens: int = 24,
                         kinds: Sequence[str] = ("random", "ranked")) -> dict[str, Any]:
    """Needle-QA F1 of mask vs zero with a fraction of blocks lost, at random or lowest-utility first.

    The same lost blocks are used for both modes (paired); ``ranked`` loss drops the blocks a
    utility-ordered sender would send last, i.e. the tail a deadline cuts off.
    """
    check_profile(runtime, profile)
    rng = np.random.default_rng(seed)
    cells: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    full_rows = []
    for i, ex in enumerate(examples):
        prompt = llm.chat_prompt(runtime, ex.context, ex.question)
        cache, _ = llm.prefill(runtime, prompt.context_ids)
        plan = runtime.plan(len(prompt.context_ids))
        full = llm.generate(runtime, llm.partial_from_cache(cache, None, "mask"), prompt.question_ids,
                            max_new_tokens)
        reference = first_line(full.text)
        full_rows.append(_score(full.text, ex, reference))
        order = utility_order(profile.block_utilities(plan))
        for loss in losses:
            n_keep = plan.n_blocks - round(loss * plan.n_blocks)
            kept_by = {"random": rng.permutation(plan.n_blocks)[:n_keep], "ranked": order[:n_keep]}
            for kind in kinds:
                kept = kept_by[kind]
                available = torch.from_numpy(blocks_available(plan, kept)).to(runtime.device)
                modes: tuple[llm.ReconstructionMode, ...] = ("mask", "zero")
                for mode in modes:
                    kv = llm.partial_from_cache(cache, available, mode, plan.n_tokens)
                    out = llm.generate(runtime, kv, prompt.question_ids, max_new_tokens)
                    cells.setdefault((kind, loss, mode), []).append(_score(out.text, ex, reference))
        _log(f"loss table example {i + 1}/{len(examples)}")
    table = []
    for (kind, loss, mode_name), rows in sorted(cells.items()):
        table.append({
            "loss": kind, "lost_fraction": loss, "mode": mode_name,
            "f1_gold": float(np.mean([r["f1_gold"] for r in rows])),
            "f1_gold_ci95": list(bootstrap_ci95([r["f1_gold"] for r in rows], seed)),
            "f1_full": float(np.mean([r["f1_full"] for r in rows])),
            "correct": int(sum(r["correct"] for r in rows)), "n": len(rows),
        })
    return {
        "full_kv": {"f1_gold": float(np.mean([r["f1_gold"] for r in full_rows])),
                    "correct": int(sum(r["correct"] for r in full_rows)), "n": len(full_rows)},
        "table": table,
        "inputs": {"model": runtime.model_id, "profile": profile.model_id, "losses": list(losses),
                   "seed": seed, "kinds": list(kinds),
                   "max_new_tokens": max_new_tokens, "scoring": "first line of the answer, SQuAD token F1"},
    }
