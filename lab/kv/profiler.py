"""Utility profiler (paper III-A): KV-zeroing sensitivity per layer group and per relative position bin.

For each profiling prompt (needle-QA over the *profile* half of the essays) the sender-side cache of the
context is computed once. Scored tokens are the question (with the chat tail) followed by the model's own
full-KV greedy answer; their next-token distributions under the intact cache are the reference. Each
perturbation zeroes K and V of one layer group (all positions), one relative-position bin (all layers),
or one (group, bin) cell, and only the scored tokens are re-run against that cache: exactly what a
receiver missing those blocks would compute. The score is the mean KL(full || perturbed) over the answer
positions, averaged over prompts and normalised within the model. Attention runs through SDPA (q = the
few scored tokens), so no T x T matrix is built and the profiler reaches the model's full context.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from pfec.common.model import llm
from pfec.common.plan.utility import UtilityProfile
from pfec.lab.kv.workloads import needle_qa
from pfec.lab.reporting.figures import pyplot, save_figure


def _log(message: str) -> None:
    print(f"[pfec profile] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ScoredPrompt:
    """A context and the tokens whose predictions are scored after it."""

    context_ids: tuple[int, ...]
    score_ids: tuple[int, ...]  # question tokens + the full-KV answer
    n_question: int  # predictions from index n_question - 1 on are the answer's


def scored_prompt(runtime: llm.ModelRuntime, prompt: llm.HandoffPrompt, answer_tokens: int) -> ScoredPrompt:
    """Attach the model's own full-KV greedy answer (``answer_tokens`` long at most) to a prompt."""
    answer = llm.local_answer(runtime, prompt, answer_tokens).token_ids
    return ScoredPrompt(prompt.context_ids, prompt.question_ids + answer, len(prompt.question_ids))


def needle_prompts(runtime: llm.ModelRuntime, n: int, context_tokens: int, seed: int,
                   split: str, answer_tokens: int) -> list[ScoredPrompt]:
    """Scored needle-QA prompts over one half of the essays (``profile`` or ``eval``)."""
    count = partial(llm.count_tokens, runtime)
    examples = needle_qa(n, context_tokens, seed=seed, split=split, count_tokens=count)  # type: ignore[arg-type]
    out = []
    for i, ex in enumerate(examples):
        out.append(scored_prompt(runtime, llm.chat_prompt(runtime, ex.context, ex.question), answer_tokens))
        _log(f"{split} prompt {i + 1}/{n}: {len(out[-1].context_ids)} context tokens")
    return out


def even_groups(n_layers: int, n_groups: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, n_layers, min(n_groups, n_layers) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def token_bins(n_tokens: int, edges: Sequence[float]) -> np.ndarray:
    """Bin of every token by relative position (t + 0.5) / T, the rule UtilityProfile uses."""
    rel = (np.arange(n_tokens) + 0.5) / n_tokens
    return np.clip(np.searchsorted(np.asarray(edges), rel, side="right") - 1, 0, len(edges) - 2)


def answer_log_probs(runtime: llm.ModelRuntime, kv: llm.PartialKV, prompt: ScoredPrompt) -> torch.Tensor:
    """Log-probabilities [n_answer, vocab] of the answer predictions."""
    logits = llm.teacher_forced_logits(runtime, kv, prompt.score_ids)
    return torch.log_softmax(logits[prompt.n_question - 1 : -1], dim=-1)


def mean_kl(reference: torch.Tensor, perturbed: torch.Tensor) -> float:
    """Mean over positions of KL(reference || perturbed), both log-probabilities."""
    return float((reference.exp() * (reference - perturbed)).sum(dim=-1).mean())


def perturbation_scores(runtime: llm.ModelRuntime, prompt: ScoredPrompt, groups: Sequence[tuple[int, int]],
                        edges: Sequence[float], cells: bool,
                        mode: llm.ReconstructionMode = "zero") -> dict[str, np.ndarray]:
    """KL of each layer-group, position-bin (and cell) perturbation for one prompt."""
    cache, _ = llm.prefill(runtime, prompt.context_ids)
    n_tokens = len(prompt.context_ids)
    g = runtime.geometry
    full = answer_log_probs(runtime, llm.partial_from_cache(cache, None, mode), prompt)
    bins = torch.from_numpy(token_bins(n_tokens, edges)).to(runtime.device)
    n_bins = len(edges) - 1

    def score(layers: tuple[int, int] | None, pbin: int | None) -> float:
        available = torch.ones(g.n_layers, g.n_kv_heads, n_tokens, dtype=torch.bool, device=runtime.device)
        lo, hi = layers if layers is not None else (0, g.n_layers)
        token_hit = bins == pbin if pbin is not None else torch.ones_like(bins, dtype=torch.bool)
        available[lo:hi, :, token_hit] = False
        kv = llm.partial_from_cache(cache, available, mode, n_tokens)
        return mean_kl(full, answer_log_probs(runtime, kv, prompt))

    out = {
        "layer": np.array([score(grp, None) for grp in groups]),
        "position": np.array([score(None, b) for b in range(n_bins)]),
    }
    if cells:
        out["cell"] = np.array([[score(grp, b) for b in range(n_bins)] for grp in groups])
    return out


def _normalised(values: np.ndarray) -> tuple[float, ...]:
    clipped = np.clip(values, 0.0, None)
    total = clipped.sum()
    shares = clipped / total if total > 0 else np.full_like(clipped, 1 / clipped.size)
    return tuple(float(x) for x in shares)


def profile_model(runtime: llm.ModelRuntime, n_prompts: int = 16, context_tokens: int = 1500, seed: int = 0,
                  n_groups: int = 10, n_bins: int = 10, answer_tokens: int = 16, cells: bool = False,
                  mode: llm.ReconstructionMode = "zero") -> UtilityProfile:
    """Measure the model's utility profile over ``n_prompts`` profiling prompts (progress on stderr).

    Cost per prompt: one prefill, one short greedy answer, then G + P (+ G x P with ``cells``) re-runs of
    the ~30 scored tokens; without cells, block utility is the product of the layer and position scores.
    """
    started = time.perf_counter()
    groups = even_groups(runtime.geometry.n_layers, n_groups)
    edges = tuple(float(x) for x in np.linspace(0.0, 1.0, n_bins + 1))
    prompts = needle_prompts(runtime, n_prompts, context_tokens, seed, "profile", answer_tokens)
    per_prompt: list[dict[str, np.ndarray]] = []
    for i, prompt in enumerate(prompts):
        per_prompt.append(perturbation_scores(runtime, prompt, groups, edges, cells, mode))
        _log(f"perturbed prompt {i + 1}/{len(prompts)} ({time.perf_counter() - started:.0f} s)")
    mean = {key: np.mean([p[key] for p in per_prompt], axis=0) for key in per_prompt[0]}
    sem = {key: np.std([p[key] for p in per_prompt], axis=0, ddof=1) / np.sqrt(len(per_prompt))
           for key in per_prompt[0]} if len(per_prompt) > 1 else {}
    cell_scores = None
    if cells:
        cell_norm = np.asarray(_normalised(mean["cell"].reshape(-1))).reshape(mean["cell"].shape)
        cell_scores = tuple(tuple(float(x) for x in row) for row in cell_norm)
    return UtilityProfile(
        model_id=runtime.model_id,
        n_layers=runtime.geometry.n_layers,
        layer_groups=tuple(groups),
        position_bins=edges,
        layer_scores=_normalised(mean["layer"]),
        position_scores=_normalised(mean["position"]),
        cell_scores=cell_scores,
        fingerprint=runtime.fingerprint.model_digest,
        source={
            "kind": "kv-zeroing" if mode == "zero" else "kv-masking",
            "metric": "mean KL(full || perturbed) over the full-KV answer's next-token predictions",
            "prompts": n_prompts, "context_tokens": context_tokens, "seed": seed, "essays": "profile",
            "answer_tokens": answer_tokens, "perturbation": mode,
            "raw_layer_kl": [float(x) for x in mean["layer"]],
            "raw_position_kl": [float(x) for x in mean["position"]],
            "raw_layer_kl_sem": [float(x) for x in sem.get("layer", [])],
            "raw_position_kl_sem": [float(x) for x in sem.get("position", [])],
            "fingerprint": runtime.fingerprint.to_json(),
            "seconds": round(time.perf_counter() - started, 1),
        },
    )


def check_profile(runtime: llm.ModelRuntime, profile: UtilityProfile) -> None:
    """A profile of another model is a clear error (synthetic profiles are allowed with any model)."""
    if profile.model_id == "synthetic":
        return
    if profile.fingerprint != runtime.fingerprint.model_digest:
        raise ValueError(
            f"utility profile of {profile.model_id!r} (fingerprint {profile.fingerprint!r}) does not match "
            f"the loaded model {runtime.model_id!r} (fingerprint {runtime.fingerprint.model_digest!r}): "
            "run `pfec profile` for this model"
        )


def plot_profile(profile: UtilityProfile, path: str | Path) -> Path:
    """Fig. 2a/2b on our model: normalised sensitivity per layer group and per position bin (+ cells)."""
    plt = pyplot()
    n_panels = 3 if profile.cell_scores is not None else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(4.2 * n_panels, 3.4))
    groups = [f"{lo}-{hi - 1}" for lo, hi in profile.layer_groups]
    axes[0].bar(groups, profile.layer_scores, color="tab:blue")
    axes[0].set_xlabel("layer group")
    axes[0].set_ylabel("normalised sensitivity")
    axes[0].tick_params(axis="x", labelrotation=60, labelsize=7)
    edges = profile.position_bins
    bins = [f"{edges[i]:.1f}" for i in range(len(edges) - 1)]
    axes[1].bar(bins, profile.position_scores, color="tab:orange")
    axes[1].set_xlabel("relative position bin (start)")
    if profile.cell_scores is not None:
        image = axes[2].imshow(np.asarray(profile.cell_scores), aspect="auto", cmap="viridis")
        axes[2].set_xlabel("position bin")
        axes[2].set_ylabel("layer group")
        fig.colorbar(image, ax=axes[2])
    source = profile.source
    size = f"{source.get('prompts', '?')} prompts x {source.get('context_tokens', '?')} tokens"
    fig.suptitle(f"{profile.model_id.split('/')[-1]}: KV-zeroing sensitivity, {size}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=150)
