"""`pfec eval`: the paper's experiments (V-B..V-F) reproduced on this code base.

Stages, each a function of an ``EvalConfig``:

1. ``utility_sweep``: recovered utility of every scheme on paired loss realizations (the simulator pairs
   them by seed + realization index) for each (loss config, rho) cell; cells x realizations are spread
   over worker processes. Schemes that are not registered (or fail to build) are listed as missing.
2. ``task_scores``: needle-QA F1 of the answer generated from the partial KV cache each scheme delivers
   (its recovered block set on one realization per prompt), mask and zero receivers.
3. ``ablation``: priority / rl-fec / priority-fixed / priorityfec rows picked from stages 1 and 2.
4. ``overhead``: CPU per 1000 transmitted packets by component and the scheduler's decision latency.

``write_outputs`` turns the result into CSV + JSON (docs/results/), figures (docs/figures/eval_*.png) and
the generated section of docs/RESULTS.md between ``RESULTS_BEGIN`` and ``RESULTS_END``.
"""

from __future__ import annotations

import csv
import hashlib
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.plan.utility import UtilityProfile, synthetic_profile
from pfec.common.sched.actions import Action, SchedulerView
from pfec.common.sched.policies import SCHEMES, Policy, Scheme, get_scheme
from pfec.lab.channel import GilbertElliott, LossModel, parse_loss_spec, realization_rng, write_trace
from pfec.lab.sim import (
    REFERENCE_SCHEMES,
    Handoff,
    RunResult,
    SimConfig,
    forward_losses,
    mean_ci95,
    prepare,
    report,
    run_once,
    run_scheme,
)

REPO = Path(__file__).resolve().parent.parent
SHIPPED_PROFILE = REPO / "profiles" / "smollm2-135m-instruct.json"
EXAMPLE_TRACE = REPO / "profiles" / "example-loss.trace"

NAMED_CONFIGS: dict[str, str] = {
    "main": "ge:0.001,0.5,0.02,0.1",
    "milder": "ge:0.001,0.3,0.01,0.2",
    "burstier": "ge:0.001,0.5,0.01,0.05",
    "trace": f"trace:{EXAMPLE_TRACE}",
}
SWEEP_RHOS = (0.6, 0.8, 1.0, 1.2)
ALL_SCHEMES = (
    "udp",
    "tcp",
    "quic",
    "priority",
    "uniform-fec",
    "priority-fixed",
    "flec-rt",
    "arq",
    "rl-fec",
    "heuristic",
    "priorityfec",
    "oracle",
)
RELIABLE = ("tcp", "quic")  # real transport runs (common/reliable.py), not slot-simulator schemes
TASK_SCHEMES = ("udp", "priority", "heuristic", "priorityfec")
ABLATION_SCHEMES = ("priority", "rl-fec", "priority-fixed", "priorityfec")
ABLATION_RHOS = (0.8, 1.0)
FALLBACK = {"priorityfec": "heuristic"}  # stands in (and says so) while the DDQN is absent
MODES = ("mask", "zero")
RESULTS_BEGIN = "<!-- BEGIN pfec eval (generated: rerun `pfec eval` to replace this part) -->"
RESULTS_END = "<!-- END pfec eval -->"
PAPER = {"utility_rho08": 0.991, "best_baseline_rho08": 0.823, "gain_points": 16.8}

Progress = Callable[[str, int, int], None]  # (stage, done, total)


HEADLINE = ("main", 0.8)  # the headline cell: main GE config, rho 0.8


@dataclass(frozen=True)
class EvalConfig:
    realizations: int = 20
    headline_realizations: int = 100  # realizations of the HEADLINE cell (the claims are made there)
    rhos: tuple[float, ...] = SWEEP_RHOS
    configs: tuple[tuple[str, str], ...] = tuple(NAMED_CONFIGS.items())  # (name, loss spec)
    schemes: tuple[str, ...] = ALL_SCHEMES
    profile: str = str(SHIPPED_PROFILE)  # a profile JSON path or "synthetic"
    tokens: int = 1536
    rate_mbps: float = 100.0
    rtt_ms: float = 20.0
    seed: int = 1
    jobs: int = 2
    task_prompts: int = 4
    task_rhos: tuple[float, ...] = (0.6, 0.8, 1.0)
    task_schemes: tuple[str, ...] = TASK_SCHEMES
    context_tokens: int = 1500
    max_new_tokens: int = 24
    overhead_realizations: int = 3
    reliable_realizations: int = 5  # tcp/quic run in real time over an emulated link: slow, so fewer
    reliable_configs: tuple[str, ...] = ("main",)  # loss configs whose cells also get real tcp/quic runs
    overhead_rhos: tuple[float, ...] = ABLATION_RHOS
    command: str = "pfec eval"

    def __post_init__(self) -> None:
        if self.realizations < 1:
            raise ValueError(f"--realizations must be >= 1, got {self.realizations}")
        if self.headline_realizations < 1:
            raise ValueError(f"--headline-realizations must be >= 1, got {self.headline_realizations}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if min(self.task_prompts, self.overhead_realizations, self.reliable_realizations) < 0:
            raise ValueError(
                "--task-prompts, --overhead-realizations and --reliable-realizations must be >= 0 "
                "(0 skips that stage)"
            )
        for rho in (*self.rhos, *self.task_rhos, *self.overhead_rhos):
            if not rho > 0:
                raise ValueError(f"rho {rho!r} must be positive (e.g. --rhos 0.6,0.8,1.0,1.2)")
        known = {*ALL_SCHEMES, *SCHEMES, *REFERENCE_SCHEMES}
        unknown = [s for s in (*self.schemes, *self.task_schemes) if s not in known]
        if unknown:
            raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; choose from {', '.join(ALL_SCHEMES)}")
        if not self.configs:
            raise ValueError("--configs is empty; give e.g. main,milder,burstier,trace")

    def realizations_of(self, config_name: str, rho: float) -> int:
        """Paired realizations of one cell: more in the headline cell, where the claims are checked."""
        headline = config_name == HEADLINE[0] and math.isclose(rho, HEADLINE[1])
        return self.headline_realizations if headline else self.realizations

    def load_profile(self, n_layers: int = 30) -> UtilityProfile:
        if self.profile == "synthetic":
            return synthetic_profile(n_layers)
        return UtilityProfile.load(self.profile)

    def sim_config(self, loss: LossModel, rho: float, profile: UtilityProfile) -> SimConfig:
        return SimConfig(
            loss=loss,
            rate_mbps=self.rate_mbps,
            rtt_ms=self.rtt_ms,
            rho=rho,
            tokens=self.tokens,
            profile=profile,
            seed=self.seed,
        )


SMALL = EvalConfig(
    realizations=2,
    headline_realizations=2,
    rhos=(0.8,),
    configs=(("main", NAMED_CONFIGS["main"]),),
    profile="synthetic",
    tokens=384,
    task_prompts=0,
    overhead_realizations=1,
    overhead_rhos=(0.8,),
    reliable_realizations=0,
    command="pfec eval --small",
)


def parse_configs(text: str) -> tuple[tuple[str, str], ...]:
    """``main,trace`` or ``NAME=SPEC`` items (e.g. ``capture=trace:my.trace``) -> (name, spec) pairs."""
    out = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if "=" in item:
            name, spec = item.split("=", 1)
        elif item in NAMED_CONFIGS:
            name, spec = item, NAMED_CONFIGS[item]
        else:
            raise ValueError(
                f"--configs item {item!r} is neither one of {', '.join(NAMED_CONFIGS)} nor "
                "NAME=SPEC (e.g. mine=ge:0.001,0.5,0.02,0.1 or cap=trace:PATH)"
            )
        parse_loss_spec(spec)  # bad spec or unreadable trace: fail now with the channel's message
        out.append((name.strip(), spec.strip()))
    return tuple(out)


# --------------------------------------------------------------------------- scheme availability


def _reliable_runner() -> Callable[..., dict[str, Any]] | None:
    try:
        from pfec.lab import reliable
    except ImportError:
        return None
    runner = getattr(reliable, "run_reliable", None)
    return runner if callable(runner) else None


def scheme_status(names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(available schemes, {missing scheme: why}); nothing is substituted here."""
    available: list[str] = []
    missing: dict[str, str] = {}
    for name in names:
        if name in REFERENCE_SCHEMES:
            available.append(name)
            continue
        if name in RELIABLE:
            if _reliable_runner() is None:
                missing[name] = "common/reliable.py with run_reliable() is not in this tree"
            else:
                available.append(name)
            continue
        if name not in SCHEMES:
            missing[name] = "not registered in common/sched/policies.py SCHEMES"
            continue
        try:
            get_scheme(name).make_policy()
        except Exception as exc:  # e.g. a DDQN whose weights are not trained yet
            missing[name] = f"cannot build its policy: {exc}"
            continue
        available.append(name)
    return available, missing


def stand_in(name: str, available: Sequence[str]) -> str | None:
    """The scheme that runs for ``name``: itself, its documented fallback, or None."""
    if name in available:
        return name
    fallback = FALLBACK.get(name)
    return fallback if fallback in SCHEMES else None


# --------------------------------------------------------------------------- stage 1: utility sweep

_WORKER_HANDOFF: dict[int, Handoff] = {}


def _worker_init() -> None:
    from pfec.sender.repair_plan import warm_up

    warm_up()


def _handoff(cell: int, config: SimConfig) -> Handoff:
    if cell not in _WORKER_HANDOFF:
        _WORKER_HANDOFF.clear()  # one cell's payload (tens of MB) per process at a time
        _WORKER_HANDOFF[cell] = prepare(config)
    return _WORKER_HANDOFF[cell]


def _run_realization(task: tuple[int, SimConfig, tuple[str, ...], int]) -> tuple[int, list[RunResult | str]]:
    """All schemes on one realization of one cell; a scheme that raises yields its error text."""
    cell, config, names, realization = task
    handoff = _handoff(cell, config)
    out: list[RunResult | str] = []
    for name in names:
        try:
            out.append(run_scheme(handoff, name, realization))
        except Exception as exc:  # one broken scheme must not sink an hour-long sweep
            out.append(f"{name}: {type(exc).__name__}: {exc}")
    return cell, out


def _map(tasks: list[Any], fn: Callable[[Any], Any], jobs: int, on_done: Callable[[], None]) -> list[Any]:
    if jobs == 1 or len(tasks) == 1:
        _worker_init()
        results = []
        for task in tasks:
            results.append(fn(task))
            on_done()
        return results
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(jobs, len(tasks)), initializer=_worker_init) as pool:
        results = []
        for result in pool.imap_unordered(fn, tasks):
            results.append(result)
            on_done()
    return results


def _cells(cfg: EvalConfig, profile: UtilityProfile) -> list[tuple[str, float, SimConfig]]:
    return [
        (name, rho, cfg.sim_config(parse_loss_spec(spec), rho, profile))
        for name, spec in cfg.configs
        for rho in cfg.rhos
    ]


def utility_sweep(
    cfg: EvalConfig, sim_schemes: Sequence[str], progress: Progress | None = None
) -> list[dict[str, Any]]:
    """One report per (config, rho) cell, every scheme on the same ``cfg.realizations`` loss realizations."""
    profile = cfg.load_profile()
    cells = _cells(cfg, profile)
    names = tuple(sim_schemes)
    tasks = [
        (i, sim, names, r)
        for i, (name, rho, sim) in enumerate(cells)
        for r in range(cfg.realizations_of(name, rho))
    ]
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress("utility sweep", done[0], len(tasks))

    runs: list[dict[str, list[RunResult]]] = [{n: [] for n in names} for _ in cells]
    errors: dict[str, str] = {}
    for cell, results in _map(tasks, _run_realization, cfg.jobs, tick):
        for name, res in zip(names, results, strict=True):
            if isinstance(res, str):
                errors.setdefault(name, res)
            else:
                runs[cell][name].append(res)
    return [_cell_report(name, rho, sim, runs[i], errors) for i, (name, rho, sim) in enumerate(cells)]


def _cell_report(
    config_name: str, rho: float, sim: SimConfig, runs: dict[str, list[RunResult]], errors: dict[str, str]
) -> dict[str, Any]:
    ok = {name: sorted(results, key=lambda r: r.realization) for name, results in runs.items() if results}
    handoff = prepare(sim)
    out = report(handoff, ok) if ok else {"inputs": {}, "schemes": {}}
    out["config"] = config_name
    out["rho"] = rho
    out["errors"] = {n: e for n, e in errors.items() if n in runs}
    out["pairing"] = check_pairing(handoff, ok)
    _add_efficiency(out, ok)
    for name, results in ok.items():
        out["schemes"][name]["n"] = len(results)
        out["schemes"][name]["recovered_utility_runs"] = [r.recovered_utility for r in results]
        out["schemes"][name]["forward_lost_runs"] = [r.forward_lost for r in results]
        out["schemes"][name]["data_sent_runs"] = [r.source_sent + r.repair_sent for r in results]
    return out


def check_pairing(handoff: Handoff, runs: dict[str, list[RunResult]]) -> dict[str, int]:
    """Every session scheme must have lost exactly the datagrams the shared forward pattern of its realization
    erases among the data datagrams it sent (the pattern is indexed by datagram position, not per scheme)."""
    checked = violations = 0
    patterns: dict[int, npt.NDArray[np.bool_]] = {}
    for name, results in runs.items():
        if name not in SCHEMES:  # arq/oracle count their losses their own way (common/sim.py)
            continue
        for r in results:
            pattern = patterns.setdefault(r.realization, forward_losses(handoff, r.realization))
            sent = r.source_sent + r.repair_sent
            checked += 1
            violations += int(pattern[:sent].sum()) != r.forward_lost
    return {"runs_checked": checked, "violations": violations}


def _add_efficiency(out: dict[str, Any], runs: dict[str, list[RunResult]]) -> None:
    """efficiency = utility / oracle's utility on the same realization (mean of the paired ratios),
    unless the simulator's own report already carries it."""
    oracle = {r.realization: r.recovered_utility for r in runs.get("oracle", [])}
    for name, results in runs.items():
        entry = out["schemes"][name]
        if "efficiency_mean" in entry:
            continue
        ratios = [
            r.recovered_utility / oracle[r.realization] for r in results if oracle.get(r.realization, 0.0) > 0
        ]
        if ratios:
            mean, ci = mean_ci95(ratios)
            entry["efficiency_mean"], entry["efficiency_ci95"] = mean, list(ci)
        else:
            entry["efficiency_mean"], entry["efficiency_ci95"] = None, None


def reliable_sweep(
    cfg: EvalConfig, protocols: Sequence[str], cells: list[dict[str, Any]], progress: Progress | None = None
) -> None:
    """tcp/quic through common/reliable.py, added to each cell's report (efficiency: ratio of means)."""
    runner = _reliable_runner()
    if runner is None or not protocols or cfg.reliable_realizations == 0:
        return
    profile = cfg.load_profile()
    for i, cell in enumerate(cells):
        if cell["config"] not in cfg.reliable_configs:
            continue
        spec = dict(cfg.configs)[cell["config"]]
        sim = cfg.sim_config(parse_loss_spec(spec), cell["rho"], profile)
        for proto in protocols:
            try:
                res = runner(proto, sim, cfg.reliable_realizations, None)["schemes"][proto]
            except Exception as exc:
                cell["errors"][proto] = f"{proto}: {type(exc).__name__}: {exc}"
                continue
            oracle = cell["schemes"].get("oracle", {}).get("recovered_utility_mean")
            res.setdefault("efficiency_mean", res["recovered_utility_mean"] / oracle if oracle else None)
            res.setdefault("efficiency_ci95", None)
            res.setdefault("n", cfg.reliable_realizations)
            cell["schemes"][proto] = res
        if progress is not None:
            progress("tcp/quic", i + 1, len(cells))


# --------------------------------------------------------------------------- stage 4: overhead


class TimedPolicy:
    """Pass-through around a scheme's policy that records each ``decide`` call's wall time (ns)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.sends_repairs = inner.sends_repairs
        self.samples_ns: list[int] = []

    def decide(self, view: SchedulerView) -> Action:
        t0 = time.perf_counter_ns()
        action = self.inner.decide(view)
        self.samples_ns.append(time.perf_counter_ns() - t0)
        return action

    def reset(self) -> None:
        self.inner.reset()

    def __getattr__(self, item: str) -> Any:  # anything else a session may ask the real policy
        return getattr(self.inner, item)


def overhead(
    cfg: EvalConfig, sim_schemes: Sequence[str], progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Main config, ``cfg.overhead_rhos``: CPU ms per 1000 data packets and decide() latency, one process."""
    if cfg.overhead_realizations == 0:
        return []
    from pfec.sender.repair_plan import warm_up

    warm_up()
    profile = cfg.load_profile()
    main_spec = dict(cfg.configs).get("main", NAMED_CONFIGS["main"])
    rows = []
    sim_schemes = [s for s in sim_schemes if s in SCHEMES]  # arq/oracle run no sessions: nothing to time
    total = len(cfg.overhead_rhos) * len(sim_schemes)
    for rho in cfg.overhead_rhos:
        handoff = prepare(cfg.sim_config(parse_loss_spec(main_spec), rho, profile))
        for name in sim_schemes:
            rows.append(_overhead_row(handoff, get_scheme(name), cfg.overhead_realizations, rho))
            if progress is not None:
                progress("overhead", len(rows), total)
    return rows


def _overhead_row(handoff: Handoff, scheme: Scheme, realizations: int, rho: float) -> dict[str, Any]:
    timed: list[TimedPolicy] = []

    def make() -> Policy:
        timed.append(TimedPolicy(scheme.make_policy()))
        return timed[-1]

    wrapped = Scheme(scheme.name, scheme.order, make, scheme.description)
    results = [run_once(handoff, wrapped, r) for r in range(realizations)]
    summary = report(handoff, {scheme.name: results})["schemes"][scheme.name]
    per_1k = summary["cpu_ms_per_1k_packets"]
    samples = np.concatenate([np.asarray(t.samples_ns, dtype=np.float64) for t in timed]) / 1000.0
    decisions = sum(r.decisions for r in results)
    policy_ns = sum(r.cpu_ns["policy"] for r in results)
    slot_us = handoff.slot_s * 1e6
    return {
        "scheme": scheme.name,
        "rho": rho,
        "realizations": realizations,
        "state_feedback_ms": per_1k["feedback"],
        "policy_ms": per_1k["policy"],
        "encode_ms": per_1k["encode"],
        "decode_ms": per_1k["decode"],
        "total_ms": sum(per_1k[k] for k in ("feedback", "policy", "encode", "decode")),
        "decision_path_mean_us": policy_ns / decisions / 1000.0 if decisions else math.nan,
        "decide_mean_us": float(samples.mean()) if samples.size else math.nan,
        "decide_p99_us": float(np.percentile(samples, 99)) if samples.size else math.nan,
        "decide_overrun_pct": float((samples > slot_us).mean() * 100) if samples.size else math.nan,
        "slot_us": slot_us,
        "decisions": decisions,
    }


# --------------------------------------------------------------------------- stage 2: task score


def task_scores(
    cfg: EvalConfig,
    task_schemes: Sequence[tuple[str, str]],
    rhos: Sequence[float],
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Needle-QA F1 of each scheme's delivered partial cache (default model, main GE config).

    ``task_schemes``: (label, scheme that runs). Prompt i uses loss realization i for every scheme.
    """
    if cfg.task_prompts == 0 or not task_schemes:
        return {"skipped": "--task-prompts 0"}
    from pfec.common.model import llm
    from pfec.lab.profiler import check_profile
    from pfec.lab.retention import needle_examples
    from pfec.lab.workloads import first_line

    runtime = llm.load_model("default", device="cpu")
    llm.warm_up(runtime)
    profile = cfg.load_profile(runtime.geometry.n_layers)
    if cfg.profile != "synthetic":
        check_profile(runtime, profile)
    examples = needle_examples(runtime, cfg.task_prompts, cfg.context_tokens, cfg.seed)
    loss = parse_loss_spec(dict(cfg.configs).get("main", NAMED_CONFIGS["main"]))
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
        answers: dict[tuple[str, bytes], dict[str, Any]] = {}  # same delivered set -> same answer
        for rho in rhos:
            sim = replace(
                cfg.sim_config(loss, rho, profile),
                tokens=plan.n_tokens,
                geometry=runtime.geometry,
                max_symbol_size=llm.MAX_SYMBOL_SIZE,
            )
            handoff = prepare(sim)
            if handoff.plan.n_fragments != plan.n_fragments:
                raise RuntimeError("simulator plan differs from the runtime's block plan")
            for label, scheme in task_schemes:
                result = run_scheme(handoff, scheme, i)
                kept = np.flatnonzero(result.recovered_blocks)
                for mode in MODES:
                    key = (mode, hashlib.sha1(kept.tobytes()).digest())
                    if key not in answers:
                        answers[key] = _answer_from_blocks(
                            runtime,
                            cache,
                            plan,
                            kept,
                            mode,
                            prompt.question_ids,
                            cfg.max_new_tokens,
                            example.answers,
                            reference,
                        )
                    rows.append(
                        {
                            "prompt": i,
                            "rho": rho,
                            "scheme": label,
                            "runs": scheme,
                            "mode": mode,
                            "recovered_utility": result.recovered_utility,
                            **answers[key],
                        }
                    )
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


def _score_answer(answer: str, golds: Sequence[str], reference: str) -> dict[str, Any]:
    from pfec.lab.workloads import best_f1, contains_answer, first_line

    line = first_line(answer)
    return {
        "answer": line,
        "f1_gold": best_f1(line, golds),
        "f1_full": best_f1(line, [reference]) if reference else float(not line),
        "correct": contains_answer(line, golds),
    }


def _answer_from_blocks(
    runtime: Any,
    cache: Any,
    plan: Any,
    kept: npt.NDArray[np.int64],
    mode: str,
    question_ids: Sequence[int],
    max_new_tokens: int,
    golds: Sequence[str],
    reference: str,
) -> dict[str, Any]:
    import torch

    from pfec.common.model import llm
    from pfec.lab.retention import blocks_available

    available = torch.from_numpy(blocks_available(plan, kept)).to(runtime.device)
    kv = llm.partial_from_cache(cache, available, mode, plan.n_tokens)  # type: ignore[arg-type]
    out = llm.generate(runtime, kv, question_ids, max_new_tokens)
    return _score_answer(out.text, golds, reference)


def _task_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from pfec.lab.retention import bootstrap_ci95

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


# --------------------------------------------------------------------------- the whole evaluation


def run_eval(cfg: EvalConfig, progress: Progress | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    available, missing = scheme_status(cfg.schemes)
    if cfg.reliable_realizations == 0:
        for name in [s for s in available if s in RELIABLE]:
            available.remove(name)
            missing[name] = "skipped (--reliable-realizations 0)"
    sim_schemes = [s for s in available if s not in RELIABLE]
    cells = utility_sweep(cfg, sim_schemes, progress)
    reliable_sweep(cfg, [s for s in available if s in RELIABLE], cells, progress)
    substitutes = {
        name: FALLBACK[name]
        for name in (*cfg.task_schemes, *ABLATION_SCHEMES)
        if name not in available and stand_in(name, available) not in (None, name)
    }
    task_pairs = _task_pairs(cfg, available)
    task = task_scores(cfg, task_pairs, sorted({*cfg.task_rhos, *ABLATION_RHOS}), progress)
    result: dict[str, Any] = {
        "config": _describe(cfg),
        "schemes_available": available,
        "schemes_missing": missing,
        "substitutes": substitutes,
        "cells": cells,
        "task": task,
        "ablation": ablation(cells, task, available),
        "overhead": overhead(cfg, sim_schemes, progress),
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _task_pairs(cfg: EvalConfig, available: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for name in dict.fromkeys((*cfg.task_schemes, *ABLATION_SCHEMES)):
        runs = stand_in(name, available)
        if runs is not None and runs not in RELIABLE:
            pairs.append((name, runs))
    return pairs


def _describe(cfg: EvalConfig) -> dict[str, Any]:
    out = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    out["configs"] = [list(c) for c in cfg.configs]
    return out


def ablation(
    cells: list[dict[str, Any]], task: dict[str, Any], available: Sequence[str]
) -> list[dict[str, Any]]:
    """Paper V-E rows: main config at rho 0.8 and 1.0, utility from the sweep, F1 from the task stage."""
    rows = []
    task_rows = {(r["scheme"], r["rho"], r["mode"]): r for r in task.get("summary", [])}
    for rho in ABLATION_RHOS:
        cell = next((c for c in cells if c["config"] == "main" and math.isclose(c["rho"], rho)), None)
        for name in ABLATION_SCHEMES:
            runs = stand_in(name, available)
            entry = cell["schemes"].get(runs) if cell is not None and runs is not None else None
            row: dict[str, Any] = {"scheme": name, "rho": rho, "runs": runs}
            if entry is not None:
                row["utility_mean"], row["utility_ci95"] = (
                    entry["recovered_utility_mean"],
                    entry["recovered_utility_ci95"],
                )
            for mode in MODES:
                t = task_rows.get((name, rho, mode))
                row[f"f1_{mode}"] = t["f1_gold"] if t else None
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- example trace


def write_example_trace(
    path: Path, seconds: float = 60.0, probe_ms: float = 1.0, seed: int = 7
) -> dict[str, Any]:
    """A synthetic stand-in for a 1 kHz UDP-ping capture: per-probe loss from three GE phases (main,
    burstier, milder; equal thirds), written as state changes only (the replay holds each state until the
    next entry). Not a measurement: replace it with your own capture (docs/RESULTS.md says how)."""
    if seconds <= 0 or probe_ms <= 0:
        raise ValueError(f"--seconds and --probe-ms must be positive, got {seconds} and {probe_ms}")
    n = int(seconds * 1000 / probe_ms)
    phases = [
        GilbertElliott(*map(float, NAMED_CONFIGS[p].split(":")[1].split(",")))
        for p in ("main", "burstier", "milder")
    ]
    bounds = np.linspace(0, n, len(phases) + 1).astype(int)
    lost = np.concatenate(
        [
            ge.realize(int(b - a), probe_ms / 1000, realization_rng(seed, k, "trace"))
            for k, (ge, a, b) in enumerate(zip(phases, bounds[:-1], bounds[1:], strict=True))
        ]
    )
    keep = np.flatnonzero(np.r_[True, lost[1:] != lost[:-1]])
    keep = np.r_[keep, n - 1] if keep[-1] != n - 1 else keep  # anchor the end so the period is ~seconds
    times = np.round(keep * probe_ms / 1000, 6)
    comment = (
        f"synthetic example (NOT a measurement): {seconds:g} s of 1 probe per {probe_ms:g} ms, GE phases "
        f"main/burstier/milder, seed {seed}\ngenerated by: pfec eval-trace --out {path} --seconds "
        f"{seconds:g} --probe-ms {probe_ms:g} --seed {seed}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, times, lost[keep], comment=comment)
    return {
        "path": str(path),
        "entries": len(keep),
        "probes": n,
        "mean_loss": float(lost.mean()),
        "seconds": seconds,
        "probe_ms": probe_ms,
        "seed": seed,
    }


# --------------------------------------------------------------------------- outputs


def write_outputs(
    result: dict[str, Any], out_dir: Path, figures_dir: Path, results_md: Path | None
) -> dict[str, str]:
    from pfec.lab import evalreport

    out_dir.mkdir(parents=True, exist_ok=True)
    figures_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": str(write_csv(result, out_dir / "eval_utility.csv")),
        "json": str(evalreport.write_json(result, out_dir / "eval.json")),
        "utility_plot": str(evalreport.plot_utility(result, figures_dir / "eval_utility.png")),
    }
    if result["task"].get("summary"):
        paths["task_plot"] = str(evalreport.plot_task(result, figures_dir / "eval_task_f1.png"))
    if results_md is not None:
        section = evalreport.render_section(result, paths, results_md.parent)
        evalreport.update_results_md(results_md, section)
        paths["results_md"] = str(results_md)
    return paths


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


__all__ = [
    "SMALL",
    "EvalConfig",
    "parse_configs",
    "run_eval",
    "scheme_status",
    "write_example_trace",
    "write_outputs",
]
