"""`pfec eval`, `eval-render` and `eval-trace`: the paper's experiments on this code (lab/eval/evaluate.py).

The evaluation modules pull numba, and the task stage torch: they are imported inside the commands, so
`pfec --help` stays fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from pfec.cli.shared import fail, parse_floats, parse_names
from pfec.lab.reporting.progress import StageProgress, progress_lines

OutDirOpt = Annotated[Path, typer.Option(help="CSV + JSON go here.")]
FiguresDirOpt = Annotated[Path, typer.Option(help="Figures go here (eval_*.png).")]
ResultsMdOpt = Annotated[
    str, typer.Option(help="RESULTS file whose generated section is replaced ('none': skip).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the whole result as one JSON object.")]
OUT_DIR = Path("docs/results")
FIGURES_DIR = Path("docs/figures")
RESULTS_MD = "docs/RESULTS.md"


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[StageProgress]:
    """One rich progress bar per stage on stderr; ``update(stage, done, total)``."""
    from rich.console import Console  # deferred: rich (keeps `pfec --help` fast)
    from rich.progress import (  # deferred: rich
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def eval_cmd(
    realizations: Annotated[
        int | None, typer.Option(help="Paired loss realizations per cell [10; small 2].")
    ] = None,
    headline_realizations: Annotated[
        int | None, typer.Option(help="Realizations of the headline cell (main, rho 0.8) [64; small 2].")
    ] = None,
    rhos: Annotated[
        str | None, typer.Option(help="Deadlines rho of the utility sweep [0.6,0.8,1.0,1.2; small 0.8].")
    ] = None,
    configs: Annotated[
        str | None,
        typer.Option(
            help="Loss configs: main,milder,burstier,trace and/or NAME=SPEC (e.g. cap=trace:PATH) "
            "(default: all four)."
        ),
    ] = None,
    schemes: Annotated[
        str | None, typer.Option(help="Schemes (default: every known one; unregistered ones are reported).")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="Profile JSON, or 'synthetic' "
            "(default: profiles/smollm2-135m-instruct.json; small: synthetic)."
        ),
    ] = None,
    tokens: Annotated[int | None, typer.Option(help="Context tokens of the sweep [1536; small 384].")] = None,
    task_prompts: Annotated[
        int | None,
        typer.Option(
            help="Needle-QA prompts for the task score (loads the default model; 0 skips) [32; small 0]."
        ),
    ] = None,
    task_rhos: Annotated[str | None, typer.Option(help="Deadlines of the task score [0.6,0.8,1.0].")] = None,
    task_schemes: Annotated[
        str | None, typer.Option(help="Schemes of the task score "
                                 "(default: udp,priority,heuristic,priorityfec).")
    ] = None,
    overhead_realizations: Annotated[
        int | None, typer.Option(help="Realizations per overhead row (0 skips) [3; small 1].")
    ] = None,
    reliable_realizations: Annotated[
        int | None,
        typer.Option(
            help="Real tcp/quic handoffs per row and cell of the main config (real time, slow; 0 skips) "
            "[20; small 2]."
        ),
    ] = None,
    reliable_rhos: Annotated[
        str | None, typer.Option(help="Deadlines rho of the real tcp/quic runs [0.8; small 0.8].")
    ] = None,
    congestion: Annotated[
        str | None, typer.Option(help="Kernel TCP congestion controls, one tcp row each "
                                 "(default: cubic,bbr).")
    ] = None,
    grid_realizations: Annotated[
        int | None,
        typer.Option(help="Realizations per RTT x context x rho grid cell (0 skips) [6; small 2]."),
    ] = None,
    scheduler_realizations: Annotated[
        int | None,
        typer.Option(help="Paired runs per held-out condition of the DDQN-vs-heuristic stage (0 skips) "
                     "[50; small 2]."),
    ] = None,
    grid_rtts: Annotated[
        str | None, typer.Option(help="RTTs (ms) of the grid [5,20,50,100,200; small 20,200].")
    ] = None,
    grid_tokens: Annotated[
        str | None, typer.Option(help="Context tokens of the grid [192,384,1536,4096; small 192].")
    ] = None,
    grid_rhos: Annotated[
        str | None, typer.Option(help="Deadlines rho of the grid [0.6,0.8,1.0; small 0.8].")
    ] = None,
    grid_schemes: Annotated[
        str | None, typer.Option(help="Schemes of the grid (default: priorityfec,priority-arq,arq,oracle).")
    ] = None,
    precision_prompts: Annotated[
        int | None,
        typer.Option(help="Needle-QA prompts of the precision fidelity stage (loads the default model; "
                     "0 skips) [32; small 0]."),
    ] = None,
    precision_rhos: Annotated[
        str | None,
        typer.Option(help="Deadlines rho (of the native cache) of the fidelity stage [0.3,0.5,0.8,1.0]."),
    ] = None,
    precision_variants: Annotated[
        str | None,
        typer.Option(help="Variants of the fidelity stage, with native (the reference) "
                     "(default: native,int8,int8-int4,int4,int2,auto,split)."),
    ] = None,
    trace_files: Annotated[
        str | None,
        typer.Option(help="Mahimahi rate traces for the trace cells, comma-separated, or 'none' (default: "
                     "every file in $PFEC_TRACES_DIR, else in ../shared/traces beside the checkout; "
                     "small: none)."),
    ] = None,
    trace_realizations: Annotated[
        int | None, typer.Option(help="Realizations (each from its own start in the trace) per trace cell "
                                 "(0 skips) [6; small 6].")
    ] = None,
    jobs: Annotated[int, typer.Option(help="Worker processes for the utility sweep.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the loss realizations and the workload.")] = 1,
    small: Annotated[
        bool, typer.Option("--small", help="CI size: 2 realizations, rho 0.8, main, synthetic, no model.")
    ] = False,
    out_dir: OutDirOpt = OUT_DIR,
    figures_dir: FiguresDirOpt = FIGURES_DIR,
    results_md: ResultsMdOpt = RESULTS_MD,
    as_json: JsonOpt = False,
) -> None:
    """The paper's experiments on this code: utility, task score, ablation, overhead -> docs/RESULTS.md."""
    # first statement, so locals() holds only the options
    given = {k: v for k, v in locals().items() if v is not None and k not in ("small", "as_json", "jobs")}
    from pfec.lab.eval.config import SMALL, EvalConfig, default_trace_files, parse_configs  # deferred: numba
    from pfec.lab.eval.evaluate import run_eval  # deferred: numba

    overrides = {"jobs": jobs, "seed": seed, "command": _command_line(small, given), **_config_fields(given)}
    if trace_files is None and not small:
        overrides["trace_files"] = default_trace_files()
    try:
        if configs is not None:
            overrides["configs"] = parse_configs(configs)
        cfg = replace(SMALL if small else EvalConfig(), **overrides)
        if sys.stderr.isatty():
            with _progress_bar(enabled=True) as progress:
                result = run_eval(cfg, progress)
        else:  # a log (nohup, CI, systemd): plain lines a reader can follow
            result = run_eval(cfg, progress_lines(sys.stderr))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_and_print(result, out_dir, figures_dir, results_md, as_json)


# EvalConfig fields that take an option's value as typed.
_PLAIN_OPTIONS = ("realizations", "headline_realizations", "profile", "tokens", "task_prompts",
                  "overhead_realizations", "reliable_realizations", "grid_realizations", "precision_prompts",
                  "scheduler_realizations", "trace_realizations")


def _config_fields(given: dict[str, Any]) -> dict[str, Any]:
    """EvalConfig fields from the options given: numbers as typed, lists parsed (a bad one exits 2)."""
    fields = {key: given[key] for key in _PLAIN_OPTIONS if key in given}
    for key in ("rhos", "task_rhos", "reliable_rhos", "grid_rhos", "precision_rhos"):
        if key in given:
            fields[key] = tuple(parse_floats(given[key], key.replace("_", "-"), "0.6,0.8,1.0"))
    if "grid_rtts" in given:
        fields["grid_rtts_ms"] = tuple(parse_floats(given["grid_rtts"], "grid-rtts", "5,20,50,100,200"))
    if "grid_tokens" in given:
        tokens = parse_floats(given["grid_tokens"], "grid-tokens", "192,384,1536,4096")
        if any(t != int(t) for t in tokens):
            raise fail(f"--grid-tokens {given['grid_tokens']!r}: whole token counts, e.g. 192,384,1536,4096")
        fields["grid_tokens"] = tuple(int(t) for t in tokens)
    for key in ("schemes", "task_schemes", "congestion", "grid_schemes", "precision_variants"):
        if key in given:
            fields[key] = tuple(parse_names(given[key]))
    if "trace_files" in given:
        text = given["trace_files"].strip()
        files = () if text.lower() == "none" else tuple(parse_names(text))
        absent = [f for f in files if not Path(f).is_file()]
        if absent:
            raise fail(f"--trace-files: {', '.join(absent)} is not a file")
        fields["trace_files"] = files
    profile = given.get("profile")
    if profile not in (None, "synthetic") and not Path(str(profile)).is_file():
        raise fail(f"--profile {profile!r} is not a file; give a profile JSON or 'synthetic'")
    return fields


def eval_render_cmd(
    result_json: Annotated[
        Path, typer.Argument(help="A result written by `pfec eval` (docs/results/eval.json).")
    ],
    out_dir: OutDirOpt = OUT_DIR,
    figures_dir: FiguresDirOpt = FIGURES_DIR,
    results_md: ResultsMdOpt = RESULTS_MD,
    as_json: JsonOpt = False,
) -> None:
    """Rewrite the CSV, figures and RESULTS section from a saved `pfec eval` result, without rerunning it."""
    try:
        result = json.loads(result_json.read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read {str(result_json)!r} as a `pfec eval` result: {exc}") from None
    if not isinstance(result, dict) or "cells" not in result or "config" not in result:
        raise fail(f"{str(result_json)!r} is not a `pfec eval` result (no 'cells'/'config')")
    _write_and_print(result, out_dir, figures_dir, results_md, as_json)


def _write_and_print(
    result: dict[str, Any], out_dir: Path, figures_dir: Path, results_md: str, as_json: bool
) -> None:
    """Write the CSV, JSON, figures and (unless 'none') the RESULTS section; print the JSON or a summary."""
    from pfec.lab.eval.report import write_outputs  # deferred: numba (keeps `pfec --help` fast)

    md = None if results_md.lower() == "none" else Path(results_md)
    result["outputs"] = write_outputs(result, out_dir, figures_dir, md)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        typer.echo(_summary(result))


def _command_line(small: bool, given: dict[str, Any]) -> str:
    """The command that reproduces this run (options as given; paths as typed), for docs/RESULTS.md."""
    defaults = {"seed": 1, "out_dir": OUT_DIR, "figures_dir": FIGURES_DIR, "results_md": RESULTS_MD}
    words = ["pfec eval"] + (["--small"] if small else [])
    for key, value in given.items():
        if defaults.get(key, object()) != value:
            words.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(words)


def _summary(result: dict[str, Any]) -> str:
    lines = [f"{'config':<10}{'rho':>5}  {'scheme':<16}{'utility':>9}  {'95% CI':<18}{'efficiency':>10}"]
    for cell in result["cells"]:
        for name, s in cell["schemes"].items():
            lo, hi = s.get("recovered_utility_ci95") or (float("nan"), float("nan"))
            eff = s.get("efficiency_mean")
            lines.append(
                f"{cell['config']:<10}{cell['rho']:>5g}  {name:<16}{s['recovered_utility_mean']:>9.2%}  "
                f"[{lo:.2%}, {hi:.2%}]".ljust(60)
                + (f"{eff:>10.2%}" if eff is not None else f"{'n/a':>10}")
            )
    for name, why in result["schemes_missing"].items():
        lines.append(f"missing: {name} ({why})")
    lines += [f"wrote {path}" for path in result["outputs"].values()]
    return "\n".join(lines)


def eval_trace_cmd(
    out: Annotated[Path, typer.Option(help="Trace file to write.")] = Path("profiles/example-loss.trace"),
    seconds: Annotated[float, typer.Option(help="Trace length.")] = 60.0,
    probe_ms: Annotated[float, typer.Option(help="Probe spacing (one loss state per probe).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the GE phases.")] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    """Write the synthetic example loss trace (pfec-loss-trace v1) that `pfec eval`'s trace config replays."""
    from pfec.lab.eval.evaluate import write_example_trace  # deferred: numba (keeps `pfec --help` fast)

    try:
        info = write_example_trace(out, seconds, probe_ms, seed)
    except ValueError as exc:
        raise fail(str(exc)) from None
    typer.echo(
        json.dumps(info, indent=2)
        if as_json
        else f"wrote {info['path']}: {info['entries']} entries, {info['probes']} probes, "
        f"mean loss {info['mean_loss']:.2%}"
    )


def eval_traces_cmd(
    result_json: Annotated[Path, typer.Option(
        "--result", help="The saved `pfec eval` result the trace cells join.")] = OUT_DIR / "eval.json",
    trace_files: Annotated[str | None, typer.Option(
        help="Mahimahi rate traces, comma-separated (default: every file in $PFEC_TRACES_DIR, else in "
        "../shared/traces beside the checkout).")
    ] = None,
    trace_realizations: Annotated[int, typer.Option(min=1, help="Realizations per trace cell.")] = 6,
    reliable_realizations: Annotated[int, typer.Option(
        min=0, help="0 skips the real TCP/QUIC rows of the trace cells (real time); else they run.")] = 1,
    out_dir: OutDirOpt = OUT_DIR,
    figures_dir: FiguresDirOpt = FIGURES_DIR,
    results_md: ResultsMdOpt = RESULTS_MD,
    as_json: JsonOpt = False,
) -> None:
    """Run only `pfec eval`'s trace cells, with a saved result's settings, and add them to it (the rest of
    the result is kept as it was measured; the trace cells carry this command)."""
    from pfec.lab.eval.config import EvalConfig, default_trace_files  # deferred: numba
    from pfec.lab.eval.traces import TRACE_SCHEMES, trace_sweep  # deferred: numba

    try:
        result = json.loads(result_json.read_text())
        saved = result["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise fail(f"cannot read {str(result_json)!r} as a `pfec eval` result: {exc}") from None
    files = default_trace_files() if trace_files is None else tuple(parse_names(trace_files))
    absent = [f for f in files if not Path(f).is_file()]
    if absent or not files:
        raise fail(f"--trace-files: {', '.join(absent) or 'none found'}")
    keep = ("tokens", "rate_mbps", "rtt_ms", "seed", "jobs", "reverse_lossy", "profile")
    fields = {k: saved[k] for k in keep if k in saved}
    if "profile" in fields and fields["profile"] != "synthetic" and not Path(fields["profile"]).is_file():
        fields.pop("profile")  # a result saved in another checkout: this one's shipped profile
    try:
        cfg = EvalConfig(**fields, configs=tuple(tuple(c) for c in saved.get("configs", ())) or
                         EvalConfig().configs, trace_files=files, trace_realizations=trace_realizations,
                         reliable_realizations=reliable_realizations)
        traces = trace_sweep(cfg, list(TRACE_SCHEMES), progress_lines(sys.stderr))
    except ValueError as exc:
        raise fail(str(exc)) from None
    traces["command"] = " ".join(["pfec eval-trace-cells", f"--trace-realizations {trace_realizations}",
                                  f"--reliable-realizations {reliable_realizations}"])
    result["traces"] = traces
    _write_and_print(result, out_dir, figures_dir, results_md, as_json)
