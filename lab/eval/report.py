"""Outputs of ``pfec eval``: CSV + JSON, figures (matplotlib, Agg) and the generated part of docs/RESULTS.md.

``write_outputs`` writes them all; the section between ``RESULTS_BEGIN`` and ``RESULTS_END`` states the
inputs, what each scheme is (and which are the paper's baselines, from the scheme tables), the utility
tables, the real tcp/quic runs with their outliers, the acceptance claims with paired differences, the RTT x
context x rho grid with its heat maps, the comparison with the paper, the task, ablation and overhead
tables, and how to replay a loss capture. Every number in it comes from the result it renders.

The parts: figures in :mod:`.figures`, the RESULTS.md section in :mod:`.markdown`; the CSV and JSON
writers here.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from pfec.lab.eval.config import GRID_AUTO
from pfec.lab.eval.figures import plot_grid, plot_task, plot_utility
from pfec.lab.eval.markdown import render_section, update_results_md
from pfec.lab.eval.precision_report import write_precision_csv

CSV_FIELDS = (
    "scheme",
    "config",
    "rho",
    "recovered_utility_mean",
    "ci95_low",
    "ci95_high",
    "efficiency_mean",
    "efficiency_ci95_low",
    "efficiency_ci95_high",
    "n",
    "repair_sent_mean",
    "source_sent_mean",
)


def write_outputs(
    result: dict[str, Any], out_dir: Path, figures_dir: Path, results_md: Path | None
) -> dict[str, str]:
    """CSV + JSON into ``out_dir``, figures into ``figures_dir``, and (unless None) the RESULTS section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": str(write_csv(result, out_dir / "eval_utility.csv")),
        "json": str(write_json(result, out_dir / "eval.json")),
        "utility_plot": str(plot_utility(result, figures_dir / "eval_utility.png")),
    }
    if result.get("grid", {}).get("cells"):
        paths["grid_csv"] = str(write_grid_csv(result, out_dir / "eval_grid.csv"))
        paths["grid_efficiency_plot"] = str(plot_grid(result, figures_dir / "eval_grid_efficiency.png",
                                                      "efficiency"))  # fmt: skip
        if any(c.get("lead_over_priority_arq") for c in result["grid"]["cells"]):
            paths["grid_lead_plot"] = str(plot_grid(result, figures_dir / "eval_grid_lead.png", "lead"))
    if result["task"].get("summary"):
        paths["task_plot"] = str(plot_task(result, figures_dir / "eval_task_f1.png"))
    if result.get("precision", {}).get("summary"):
        precision_csv = out_dir / "precision_summary.csv"
        paths["precision_csv"] = str(write_precision_csv(result["precision"], precision_csv))
        paths["precision_json"] = str(write_json(result["precision"], out_dir / "precision.json"))
    if results_md is not None:
        section = render_section(result, paths, results_md.parent)
        update_results_md(results_md, section)
        paths["results_md"] = str(results_md)
    return paths


def write_csv(result: dict[str, Any], path: Path) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for cell in result["cells"]:
            for name, s in cell["schemes"].items():
                ci = s.get("recovered_utility_ci95") or [None, None]
                eff_ci = s.get("efficiency_ci95") or [None, None]
                writer.writerow(
                    {
                        "scheme": name,
                        "config": cell["config"],
                        "rho": cell["rho"],
                        "recovered_utility_mean": s["recovered_utility_mean"],
                        "ci95_low": ci[0],
                        "ci95_high": ci[1],
                        "efficiency_mean": s.get("efficiency_mean"),
                        "efficiency_ci95_low": eff_ci[0],
                        "efficiency_ci95_high": eff_ci[1],
                        "n": s.get("n"),
                        "repair_sent_mean": s.get("repair_sent_mean"),
                        "source_sent_mean": s.get("source_sent_mean"),
                    }
                )
    return path


GRID_FIELDS = ("rtt_ms", "tokens", "rho", "scheme", "precision", "recovered_utility_mean", "ci95_low",
               "ci95_high", "efficiency_mean", "n", "lead_over_priority_arq_points")


def write_grid_csv(result: dict[str, Any], path: Path) -> Path:
    """One row per (grid cell, scheme); the priorityfec row carries its paired lead over priority-arq."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=GRID_FIELDS)
        writer.writeheader()
        for cell in result["grid"]["cells"]:
            lead = cell.get("lead_over_priority_arq")
            for name, s in cell["schemes"].items():
                ci = s.get("recovered_utility_ci95") or [None, None]
                writer.writerow({
                    "rtt_ms": cell["rtt_ms"], "tokens": cell["tokens"], "rho": cell["rho"], "scheme": name,
                    "precision": cell["auto_precision"] if name == GRID_AUTO else "native",
                    "recovered_utility_mean": s["recovered_utility_mean"],
                    "ci95_low": ci[0], "ci95_high": ci[1],
                    "efficiency_mean": s.get("efficiency_mean"), "n": s.get("n"),
                    "lead_over_priority_arq_points": lead["mean"] if lead and name == "priorityfec" else None,
                })  # fmt: skip
    return path


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
