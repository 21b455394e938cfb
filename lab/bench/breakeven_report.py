"""Break-even report: where a KV handoff starts to beat recomputing, as the planner predicts it.

For each model preset (the default model with its speed measured on this machine, and a 7B GQA geometry
with a stated, assumed GPU speed) and link rates of 20, 100 and 1000 Mbit/s, it writes the crossover
points (the context length from which each handoff mode beats local prefill, and every switch of the
planner's choice) to docs/results/breakeven.json, and draws predicted TTFT against context length
(0.5k-8k tokens) for local prefill, native handoff, int8/int4 handoff and split, with the choice marked.
Everything here is predicted by common/plan/breakeven.py, not measured end to end; `pfec bench breakeven`
measures the default model's curves and draws them with ``plot_measured``.

    python -m pfec.lab.bench.breakeven_report [--rtt-ms 20] [--loss 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from pfec.common.plan.breakeven import (
    DEFAULT_FLOOR,
    DEFAULT_TIE_TOLERANCE,
    LinkModel,
    Mode,
    plan_handoff,
)
from pfec.common.plan.breakeven_scan import PRESETS, ModelPreset, beats_local_from, choice_switches
from pfec.common.plan.deadline import DEFAULT_RTT_MS
from pfec.lab.reporting.figures import pyplot, save_figure

RATES_MBPS: Final = (20.0, 100.0, 1000.0)
CHART_LENGTHS: Final = tuple(range(512, 8192 + 1, 64))
# Crossovers to the 16-token block, from 256 tokens: the default model's stored curve was measured at
# 256-4096 tokens and its fixed term overstates shorter prefills.
SCAN_LENGTHS: Final = tuple(range(256, 8192 + 1, 16))
TABLE_LENGTHS: Final = (512, 1024, 2048, 4096, 8192)
CURVES: Final[tuple[tuple[Mode, str | None], ...]] = (
    ("local", None), ("handoff", "native"), ("handoff", DEFAULT_FLOOR), ("split", DEFAULT_FLOOR),
)
OUT_JSON: Final = Path("docs/results/breakeven.json")
OUT_PNG: Final = Path("docs/figures/breakeven.png")


def _link(rate_mbps: float, rtt_ms: float, loss: float) -> LinkModel:
    return LinkModel(rate_mbps * 1e6, rtt_ms / 1000.0, loss)


def crossovers(preset: ModelPreset, link: LinkModel) -> dict[str, Any]:
    """Lengths from which each non-local curve beats local prefill, and the choice's switch points."""
    beats = {f"{mode}:{precision}": beats_local_from(SCAN_LENGTHS, preset.geometry, link, preset.receiver,
                                                       mode, precision)
             for mode, precision in CURVES if precision is not None}
    switches = choice_switches(SCAN_LENGTHS, preset.geometry, link, preset.receiver)
    return {"beats_local_from_tokens": beats,
            "choice_switches": [{"n_tokens": s.n_tokens, "from": s.before, "to": s.after} for s in switches]}


def ttft_rows(preset: ModelPreset, link: LinkModel, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Predicted TTFT of each charted curve and of the choice at ``lengths``."""
    rows = []
    for n in lengths:
        plan = plan_handoff(n, preset.geometry, link, preset.receiver)
        row: dict[str, Any] = {"n_tokens": n}
        for mode, precision in CURVES:
            row[mode if precision is None else f"{mode}:{precision}"] = plan.option(mode, precision).ttft_s
        row["choice"] = plan.choice.label
        row["choice_ttft_s"] = plan.choice.ttft_s
        if plan.choice.meeting_token is not None:
            row["choice_meeting_token"] = plan.choice.meeting_token
        rows.append(row)
    return rows


def report(rtt_ms: float = DEFAULT_RTT_MS, loss: float = 0.0) -> dict[str, Any]:
    """The whole report as JSON-ready data."""
    models = {}
    for name, preset in PRESETS.items():
        per_rate = {}
        for rate in RATES_MBPS:
            link = _link(rate, rtt_ms, loss)
            rows = ttft_rows(preset, link, TABLE_LENGTHS)
            per_rate[f"{rate:g}"] = {**crossovers(preset, link), "ttft_s": rows}
        models[name] = {
            "geometry": repr(preset.geometry), "speed_source": preset.source,
            "prefill": preset.receiver.prefill.to_dict(), "decode_s": preset.receiver.decode_s,
            "rebuild_scale": preset.receiver.rebuild_scale, "rates_mbps": per_rate,
        }
    return {
        "what": "predicted by the planner (common/plan/breakeven.py), not measured end to end",
        "link": {"rtt_ms": rtt_ms, "loss": loss, "handshake_rtts": 1.0, "rates_mbps": list(RATES_MBPS)},
        "floor": DEFAULT_FLOOR, "tie_tolerance": DEFAULT_TIE_TOLERANCE,
        "scan_tokens": [SCAN_LENGTHS[0], SCAN_LENGTHS[-1], 16], "models": models,
    }


def plot(rtt_ms: float, loss: float, path: Path) -> Path:
    """Predicted TTFT vs context length, one panel per (model, rate), the planner's choice overlaid."""
    plt = pyplot()
    fig, axes = plt.subplots(len(PRESETS), len(RATES_MBPS), figsize=(13, 7.5), squeeze=False)
    styles = {"local": "k-", "handoff:native": "C3--", f"handoff:{DEFAULT_FLOOR}": "C0-.",
              f"split:{DEFAULT_FLOOR}": "C2-"}
    for row, (name, preset) in enumerate(PRESETS.items()):
        for col, rate in enumerate(RATES_MBPS):
            ax = axes[row][col]
            rows = ttft_rows(preset, _link(rate, rtt_ms, loss), CHART_LENGTHS)
            xs = [r["n_tokens"] / 1000 for r in rows]
            for key, style in styles.items():
                ax.plot(xs, [r[key] for r in rows], style, lw=1.3, label=key)
            ax.plot(xs, [r["choice_ttft_s"] for r in rows], color="gold", lw=6, alpha=0.45, zorder=0,
                    label="planner's choice")
            ax.annotate(f"choice: {rows[0]['choice']}", (xs[0], rows[0]["choice_ttft_s"]), fontsize=6,
                        xytext=(2, -10), textcoords="offset points")
            for r_prev, r in itertools.pairwise(rows):
                if r["choice"] != r_prev["choice"]:
                    ax.axvline(r["n_tokens"] / 1000, color="grey", ls=":", lw=0.8)
                    ax.annotate(f"-> {r['choice']}", (r["n_tokens"] / 1000, r["choice_ttft_s"]), fontsize=6,
                                xytext=(2, -12), textcoords="offset points")
            ax.set_title(f"{name}, {rate:g} Mbit/s", fontsize=9)
            ax.set_xlabel("context (k tokens)", fontsize=8)
            ax.set_ylabel("predicted TTFT (s, log)", fontsize=8)
            ax.set_yscale("log")
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Predicted by the planner, not measured: TTFT by context length (RTT {rtt_ms:g} ms, "
                 f"loss {loss:g}, floor {DEFAULT_FLOOR}; default model: speed measured here; 7B geometry: "
                 "assumed RTX 4090-class speed)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=130)


_MEASURED_STYLES: Final = {"local": ("k", "o"), "handoff:native": ("C3", "s"), "handoff:auto": ("C0", "^"),
                            "split:auto": ("C2", "D"), "auto": ("C1", "x")}


def _measured_label(choice: str) -> str:
    """The measured curve a planner choice ("split:int8-int4", "handoff:native", "local") falls on."""
    mode, _, precision = choice.partition(":")
    if mode == "local":
        return "local"
    return "handoff:native" if mode == "handoff" and precision == "native" else f"{mode}:auto"


def plot_measured(result: dict[str, Any], path: Path) -> Path:
    """`pfec bench breakeven`'s chart: top row, the default model measured here (markers) with the sender's
    predictions for the same handoffs (dotted) and its choice ringed; bottom row, the 7B GQA geometry
    computed by the planner at its stated speed (lines), its choice shaded, at the same rates."""
    plt = pyplot()
    rates = sorted({row["rate_mbps"] for row in result["runs"]})
    rtt_ms = float(result["config"]["rtt_ms"])
    fig, axes = plt.subplots(2, len(rates), figsize=(4.4 * len(rates), 7.5), squeeze=False)
    lengths = sorted(int(n) for n in result["local"])
    xs = [n / 1000 for n in lengths]
    local = [result["local"][str(n)]["ttft_s"] for n in lengths]
    for col, rate in enumerate(rates):
        ax = axes[0][col]
        rows = [r for r in result["runs"] if r["rate_mbps"] == rate]
        ax.plot(xs, local, "k-o", lw=1.3, ms=4, label="local (measured)")
        for label, (color, marker) in _MEASURED_STYLES.items():
            if label == "local":
                continue
            mine = sorted((r for r in rows if r["mode"] == label), key=lambda r: r["n_tokens"])
            ax.plot([r["n_tokens"] / 1000 for r in mine], [r["ttft_s"] for r in mine], color=color,
                    marker=marker, lw=1.3, ms=4, label=f"{label} (measured)")
            ax.plot([r["n_tokens"] / 1000 for r in mine], [r["predicted_ttft_s"] for r in mine], color=color,
                    ls=":", lw=1.0)
        for n in lengths:
            choice = next((r["planner_choice"] for r in rows
                           if r["n_tokens"] == n and r["planner_choice"]), None)
            if choice is None:
                continue
            chosen = _measured_label(choice)
            y = (result["local"][str(n)]["ttft_s"] if chosen == "local" else
                 next((r["ttft_s"] for r in rows if r["n_tokens"] == n and r["mode"] == chosen), None))
            if isinstance(y, int | float):
                ax.plot([n / 1000], [y], "o", ms=13, mfc="none", mec="gold", mew=2.5, zorder=0)
        ax.set_title(f"default model, measured: {rate:g} Mbit/s", fontsize=9)
        preset = PRESETS["qwen2.5-7b-geometry"]
        computed = ttft_rows(preset, _link(rate, rtt_ms, 0.0), CHART_LENGTHS)
        ax7 = axes[1][col]
        cx = [r["n_tokens"] / 1000 for r in computed]
        for key, style in (("local", "k-"), ("handoff:native", "C3--"), (f"handoff:{DEFAULT_FLOOR}", "C0-."),
                           (f"split:{DEFAULT_FLOOR}", "C2-")):
            ax7.plot(cx, [r[key] for r in computed], style, lw=1.3, label=key)
        ax7.plot(cx, [r["choice_ttft_s"] for r in computed], color="gold", lw=6, alpha=0.45, zorder=0,
                 label="planner's choice")
        ax7.set_title(f"7B GQA geometry, computed: {rate:g} Mbit/s", fontsize=9)
        for a in (ax, ax7):
            a.set_xlabel("context (k tokens)", fontsize=8)
            a.set_ylabel("TTFT (s, log)", fontsize=8)
            a.set_yscale("log")
            a.tick_params(labelsize=7)
    axes[0][0].plot([], [], "o", ms=10, mfc="none", mec="gold", mew=2.5, label="planner's choice")
    axes[0][0].plot([], [], "k:", lw=1.0, label="sender's prediction")
    axes[0][0].legend(fontsize=6)
    axes[1][0].legend(fontsize=6)
    fig.suptitle(f"TTFT by context length: default model measured end to end here (loss-free link, RTT "
                 f"{rtt_ms:g} ms); 7B GQA geometry computed by the planner "
                 f"({PRESETS['qwen2.5-7b-geometry'].source})",
                 fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, default=DEFAULT_RTT_MS)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--json-out", type=Path, default=OUT_JSON)
    parser.add_argument("--png-out", type=Path, default=OUT_PNG)
    args = parser.parse_args(argv)
    data = report(args.rtt_ms, args.loss)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.json_out} and {plot(args.rtt_ms, args.loss, args.png_out)}")


if __name__ == "__main__":  # pragma: no cover
    main()
