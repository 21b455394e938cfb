"""The figures of ``pfec eval`` (matplotlib, Agg): recovered utility vs rho, the RTT x context x rho heat
maps and the task F1; :mod:`pfec.lab.eval.report` writes them with the other outputs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pfec.lab.reporting.figures import pyplot, save_figure


def plot_utility(result: dict[str, Any], path: Path) -> Path:
    """Recovered utility vs rho per scheme with 95% CIs, one panel per loss config; one colour and marker
    per scheme across panels, one legend for all of them."""
    plt = pyplot()
    configs = list(dict.fromkeys(c["config"] for c in result["cells"]))
    everyone = list(dict.fromkeys(name for c in result["cells"] for name in c["schemes"]))
    colours = plt.get_cmap("tab20")
    markers = "osD^vP*Xh<>p"
    style = {name: (colours(k % 20), markers[k % len(markers)]) for k, name in enumerate(everyone)}
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 4.4), squeeze=False, sharey=True)
    for ax, config in zip(axes[0], configs, strict=True):
        cells = sorted((c for c in result["cells"] if c["config"] == config), key=lambda c: c["rho"])
        for k, name in enumerate(everyone):
            pts = [(c["rho"], c["schemes"][name]) for c in cells if name in c["schemes"]]
            if not pts:
                continue
            x = [p[0] + 0.006 * (k - len(everyone) / 2) for p in pts]  # dodge: overlapping error bars
            y = [100 * p[1]["recovered_utility_mean"] for p in pts]
            err = [
                [100 * (p[1]["recovered_utility_mean"] - p[1]["recovered_utility_ci95"][0]) for p in pts],
                [100 * (p[1]["recovered_utility_ci95"][1] - p[1]["recovered_utility_mean"]) for p in pts],
            ]
            colour, marker = style[name]
            ax.errorbar(x, y, yerr=err, marker=marker, color=colour, capsize=3, markersize=4, label=name)
        ax.set_title(f"{config}: {config_spec(result, config)}", fontsize=8)
        ax.set_xlabel("rho = (D - T_ow) / T_ser")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recovered utility (%)")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    ncol = min(len(handles), 7)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return save_figure(fig, path, dpi=130)


def plot_grid(result: dict[str, Any], path: Path, what: str) -> Path:
    """Heat maps over RTT (x) x context tokens (y), one panel per rho: priorityfec's efficiency (share of the
    oracle, %) or its paired lead over priority-arq (points)."""
    plt = pyplot()
    cells = result["grid"]["cells"]
    rhos = sorted({c["rho"] for c in cells})
    rtts = sorted({c["rtt_ms"] for c in cells})
    tokens = sorted({c["tokens"] for c in cells})
    fig, axes = plt.subplots(1, len(rhos), figsize=(3.6 * len(rhos) + 1.2, 3.4), squeeze=False,
                             layout="constrained")
    if what == "efficiency":
        cmap, vmin, vmax, unit = "viridis", 80.0, 100.0, "priorityfec efficiency (% of the oracle)"
    else:
        leads = [abs(c["lead_over_priority_arq"]["mean"]) for c in cells if c.get("lead_over_priority_arq")]
        bound = max([5.0, *leads])
        cmap, vmin, vmax, unit = "RdBu", -bound, bound, "priorityfec - priority-arq (points)"
    image = None
    for ax, rho in zip(axes[0], rhos, strict=True):
        grid = [[math.nan] * len(rtts) for _ in tokens]
        for c in cells:
            if not math.isclose(c["rho"], rho):
                continue
            if what == "efficiency":
                eff = c["schemes"].get("priorityfec", {}).get("efficiency_mean")
                value = math.nan if eff is None else 100 * eff
            else:
                lead = c.get("lead_over_priority_arq")
                value = math.nan if lead is None else lead["mean"]
            grid[tokens.index(c["tokens"])][rtts.index(c["rtt_ms"])] = value
        image = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, origin="lower", aspect="auto")
        for yi, row in enumerate(grid):
            for xi, value in enumerate(row):
                if not math.isnan(value):
                    dark = value < 92 if what == "efficiency" else abs(value) > 0.6 * vmax
                    ax.text(xi, yi, f"{value:.1f}", ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")  # fmt: skip
        ax.set_xticks(range(len(rtts)), [f"{r:g}" for r in rtts])
        ax.set_yticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_xlabel("RTT (ms)")
        ax.set_title(f"rho {rho:.1f}", fontsize=9)
    axes[0][0].set_ylabel("context tokens")
    fig.colorbar(image, ax=list(axes[0]), label=unit, shrink=0.9)
    return save_figure(fig, path, dpi=130)


def plot_task(result: dict[str, Any], path: Path) -> Path:
    """Needle-QA F1 (vs the gold answer) vs rho per scheme, one panel per receiver mode."""
    plt = pyplot()
    summary = result["task"]["summary"]
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 3.6), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes, strict=True):
        rows = [r for r in summary if r["mode"] == mode]
        for name in dict.fromkeys(r["scheme"] for r in rows):
            pts = sorted((r["rho"], r) for r in rows if r["scheme"] == name)
            y = [100 * r["f1_gold"] for _, r in pts]
            err = [
                [100 * (r["f1_gold"] - r["f1_gold_ci95"][0]) for _, r in pts],
                [100 * (r["f1_gold_ci95"][1] - r["f1_gold"]) for _, r in pts],
            ]
            ax.errorbar(
                [p[0] for p in pts], y, yerr=err, marker="o", capsize=3, label=scheme_label(name, pts[0][1])
            )
        ax.axhline(100 * result["task"]["full_kv_f1_gold"], color="gray", ls="--", lw=1, label="full KV")
        ax.set_title(f"{mode} receiver, {result['task']['inputs']['prompts']} prompts", fontsize=9)
        ax.set_xlabel("rho")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("needle-QA F1 vs gold (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=130)


def scheme_label(name: str, row: dict[str, Any]) -> str:
    return name if row.get("runs", name) == name else f"{name} (= {row['runs']})"


def config_spec(result: dict[str, Any], config: str) -> str:
    spec = dict(result["config"]["configs"]).get(config, "?")
    return f"trace:{Path(spec[6:]).name}" if spec.startswith("trace:") else spec
