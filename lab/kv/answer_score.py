"""Answer scores of the task stage: per prompt, and paired summaries with 95% intervals (pure numpy).

Per answer (``score_answer``): normalised exact match against the gold answers (SQuAD normalisation: lower
case, no punctuation or articles, collapsed white space), gold-contained (a normalised gold answer is a
whole-word span of the normalised answer), token F1 (SQuAD, best over the golds), and agreement with the
full-KV answer (normalised exact match between the two answers: the same answer the whole cache gives).

Summaries (``summarise``): each (scheme, rho, mode) group's means with a percentile bootstrap 95% interval
over prompts, and for every scheme its paired difference to a reference scheme on the same prompts (the
bootstrap resamples prompts, so both schemes' answers to one prompt stay together).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from pfec.lab.kv.workloads import best_f1, contains_answer, first_line, normalize_answer

__all__ = [
    "METRICS",
    "bootstrap_mean_ci95",
    "exact_match",
    "paired_difference",
    "score_answer",
    "short_answer",
    "summarise",
]

METRICS: Final = ("exact_match", "contained", "f1", "agreement")
BOOTSTRAP_RESAMPLES: Final = 10_000


def short_answer(text: str) -> str:
    """What is scored: the generated text's first non-empty line."""
    return first_line(text)


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Normalised exact match against any gold answer (an empty gold matches nothing)."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds if normalize_answer(g))


def score_answer(answer: str, golds: Sequence[str], full_kv_answer: str | None) -> dict[str, Any]:
    """Every metric of one answer; ``full_kv_answer`` None scores the full-KV answer itself (agreement 1)."""
    line = short_answer(answer)
    reference = line if full_kv_answer is None else short_answer(full_kv_answer)
    return {
        "answer": line,
        "exact_match": float(exact_match(line, golds)),
        "contained": float(contains_answer(line, golds)),
        "f1": best_f1(line, golds),
        "agreement": float(normalize_answer(line) == normalize_answer(reference)),
        "words": len(line.split()),
    }


def bootstrap_mean_ci95(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap over the values (prompts); a single value is its own CI."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("no values to summarise")
    mean = float(data.mean())
    if data.size < 2:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(BOOTSTRAP_RESAMPLES, data.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return mean, float(lo), float(hi)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], seed: int = 0) -> dict[str, Any]:
    """Mean of a - b over the prompts both scored, with its paired bootstrap 95% interval."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two schemes share no prompt")
    mean, lo, hi = bootstrap_mean_ci95([a[p] - b[p] for p in shared], seed)
    return {"mean": mean, "ci95": [lo, hi], "n": len(shared)}


def summarise(rows: Sequence[Mapping[str, Any]], reference: str | None = None) -> list[dict[str, Any]]:
    """One entry per (scheme, rho, mode): n, each metric's mean and 95% CI, mean recovered utility, and
    (when ``reference`` names a scheme in the rows) each metric's paired difference to that scheme.

    A row holds ``prompt``, ``scheme``, ``rho``, ``mode``, the ``METRICS`` and ``recovered_utility``.
    """
    groups: dict[tuple[str, float, str], dict[int, Mapping[str, Any]]] = {}
    for row in rows:
        key = (str(row["scheme"]), float(row["rho"]), str(row["mode"]))
        by_prompt = groups.setdefault(key, {})
        if int(row["prompt"]) in by_prompt:
            raise ValueError(f"prompt {row['prompt']} scored twice for {key}")
        by_prompt[int(row["prompt"])] = row
    out = []
    for (scheme, rho, mode), by_prompt in groups.items():
        entry: dict[str, Any] = {"scheme": scheme, "rho": rho, "mode": mode, "n": len(by_prompt)}
        first = next(iter(by_prompt.values()))
        if "runs" in first:
            entry["runs"] = first["runs"]
        for metric in METRICS:
            mean, lo, hi = bootstrap_mean_ci95([r[metric] for r in by_prompt.values()])
            entry[metric] = mean
            entry[f"{metric}_ci95"] = [lo, hi]
        entry["recovered_utility"] = float(np.mean([r["recovered_utility"] for r in by_prompt.values()]))
        ref = groups.get((reference, rho, mode)) if reference is not None else None
        if ref is not None and reference != scheme:
            entry[f"vs_{reference}"] = {
                metric: paired_difference(
                    {p: float(r[metric]) for p, r in by_prompt.items()},
                    {p: float(r[metric]) for p, r in ref.items()},
                )
                for metric in METRICS
            }
        out.append(entry)
    return out
