"""The fidelity stage's outputs (``lab/eval/precision.py``): its CSV and its part of docs/RESULTS.md.

Pure formatting of the stage's result (no torch), so the report can render it. The verdicts are computed
from the paired bootstrap 95% intervals of each variant's difference to native-only on the same prompts:
"better" when the interval lies above 0, "worse" when below, "no clear difference" when it holds 0.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

__all__ = ["precision_claims", "precision_section", "verdict", "write_precision_csv"]

REFERENCE: Final = "native"
METRIC_NAMES: Final = {"agreement": "equal to the full-KV answer", "contained": "gold accuracy"}
PRECISION_FIELDS: Final = ("variant", "mix", "rho", "n", "agreement", "agreement_diff", "agreement_diff_low",
                           "agreement_diff_high", "contained", "contained_diff", "contained_diff_low",
                           "contained_diff_high", "recovered_utility")


def verdict(diff: dict[str, Any] | None) -> str:
    """``better`` / ``worse`` / ``no clear difference`` from a paired difference's 95% interval."""
    if diff is None:
        return "n/a"
    low, high = diff["ci95"]
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    return "no clear difference"


def _diff_cells(entry: dict[str, Any], metric: str) -> tuple[Any, Any, Any]:
    d = entry.get(f"vs_{REFERENCE}", {}).get(metric)
    return (None, None, None) if d is None else (d["mean"], d["ci95"][0], d["ci95"][1])


def write_precision_csv(stage: dict[str, Any], path: Path) -> Path:
    """One row per (variant, rho) of the stage's summary."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PRECISION_FIELDS)
        writer.writeheader()
        for e in stage["summary"]:
            row = {k: e.get(k) for k in ("variant", "mix", "rho", "n", "agreement", "contained",
                                         "recovered_utility")}
            for metric in METRIC_NAMES:
                row[f"{metric}_diff"], row[f"{metric}_diff_low"], row[f"{metric}_diff_high"] = (
                    _diff_cells(e, metric))
            writer.writerow(row)
    return path


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _diff(entry: dict[str, Any], metric: str) -> str:
    mean, low, high = _diff_cells(entry, metric)
    if mean is None:
        return "(reference)"
    return f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def precision_claims(summary: Sequence[dict[str, Any]], variant: str = "auto") -> list[str]:
    """Per metric, what ``variant`` vs native-only is at each rho, as the paired intervals say."""
    out = []
    rows = sorted((e for e in summary if e["variant"] == variant), key=lambda e: e["rho"])
    for metric, label in METRIC_NAMES.items():
        parts = [f"rho {e['rho']:g}: {verdict(e.get(f'vs_{REFERENCE}', {}).get(metric))}" for e in rows]
        below = [e for e in rows if e["rho"] < 1.0]
        beats_below = bool(below) and all(
            verdict(e.get(f"vs_{REFERENCE}", {}).get(metric)) == "better" for e in below)
        head = (f"{variant} beats native-only at every rho below 1" if beats_below
                else f"{variant} does not beat native-only at every rho below 1")
        out.append(f"- {label}: {head} ({'; '.join(parts) or 'no rows'}).")
    return out


def gold_ceiling(stage: dict[str, Any], variant: str = "auto") -> list[str]:
    """How far gold accuracy can rise: a delivered cache aims at the full cache's answer, so ``variant``'s
    expected gain over native-only is about the full-KV answers' own gold accuracy minus native-only's."""
    full = [r["contained"] for r in stage.get("full_kv", [])
            if isinstance(r.get("contained"), int | float)]
    if not full:
        return []
    ceiling = float(np.mean(full))
    native = {e["rho"]: e["contained"] for e in stage["summary"] if e["variant"] == REFERENCE}
    mine = {e["rho"]: e["contained"] for e in stage["summary"] if e["variant"] == variant}
    room = "; ".join(f"rho {rho:g}: native-only {_pct(native[rho])}, {variant} {_pct(mine[rho])}"
                     for rho in sorted(native) if rho in mine)
    return [f"- gold accuracy ceiling: a delivered cache aims at the full-KV answer, which contains the gold "
            f"answer in {_pct(ceiling)} of these prompts, so a variant's expected gold-accuracy gain over "
            f"native-only is about that minus native-only's (a lossy cache is sometimes right where the full "
            f"one is not; the bound is on the mean, not each prompt): {room}."]


def precision_section(stage: dict[str, Any]) -> list[str]:
    """The RESULTS.md part: inputs, the table, the claim sentences and the rows worse than native-only."""
    out = ["### Precision fidelity (answers from each precision variant's delivered cache)", ""]
    if "summary" not in stage:
        return [*out, f"Not run: {stage.get('skipped', 'no precision stage')}.", ""]
    inp = stage["inputs"]
    variants = stage.get("variants", {})
    described = ", ".join(
        f"{name} = {v['mix']}" + (f" ({v['mode']})" if v.get("mode") != "handoff" else "")
        for name, v in variants.items())
    timing = stage.get("timing_s", {})
    out += [
        f"{inp['prompts_done']} of {inp['prompts']} needle-QA prompts ({inp['workload']}, "
        f"~{inp['context_tokens']} tokens, model {inp['model']}), {inp['scheme']} over the main GE config "
        f"({inp['loss']}), {inp['rate_mbps']:g} Mbit/s, RTT {inp['rtt_ms']:g} ms; rho relative to "
        f"{inp['rho_of']}. Prompt i meets loss realization i under every variant (paired). Variants: "
        f"{described}. The receiver's cache: pieces that arrived, dequantised at the level they reach; a "
        f"split's computed front exact; missing blocks masked. Greedy answers of at most "
        f"{inp['max_new_tokens']} tokens. Differences are percentage points vs native-only with paired "
        f"bootstrap 95% intervals. Stage time {timing.get('total', 0):.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in timing.items() if k != 'total')}).",
        "",
        "| variant | mix | rho | n | equal to full KV | diff vs native | gold accuracy | diff vs native "
        "| credited utility |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in sorted(stage["summary"], key=lambda e: (e["rho"], list(variants).index(e["variant"])
                                                       if e["variant"] in variants else 0)):
        out.append(f"| {e['variant']} | {e['mix']} | {e['rho']:g} | {e['n']} | {_pct(e['agreement'])} | "
                   f"{_diff(e, 'agreement')} | {_pct(e['contained'])} | {_diff(e, 'contained')} | "
                   f"{_pct(e['recovered_utility'])} |")
    out += ["", *precision_claims(stage["summary"]), *gold_ceiling(stage)]
    worse = [f"{e['variant']} at rho {e['rho']:g} ({METRIC_NAMES[m]})" for e in stage["summary"]
             for m in METRIC_NAMES if verdict(e.get(f"vs_{REFERENCE}", {}).get(m)) == "worse"]
    out += [f"- Rows worse than native-only (interval below 0): {'; '.join(worse) if worse else 'none'}.", "",
            "When a handoff beats recomputing (TTFT of local prefill, native and auto handoffs and split by "
            "context length and link rate) is measured end to end by `pfec bench breakeven` "
            "(docs/benchmarks/breakeven.md, not part of this run); the planner's own predictions, for the "
            "default model and a 7B GQA geometry: `python -m pfec.lab.bench.breakeven_report`.", ""]
    return out
