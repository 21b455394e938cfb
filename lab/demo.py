"""`pfec demo`: one real handoff on this machine, next to the sender's own full-KV answer.

Three processes (two cores are not enough to run the receiver's decoder, the link emulator and the paced
sender in one Python thread at 100 Mbit/s): a receiver daemon, the UDP relay emulating the link
(rate, delay, Gilbert-Elliott loss) and, in this process, the sender daemon (the helper processes are in
``processes``). The receiver and sender each load the model (in parallel). The workload is a seeded
needle-QA question over real essays. The recovered utility is put next to `pfec sim` on the same link,
deadline, scheme and context length.

Two nodes on one machine: the receiver runs on its own CPU set, the sender and the relay on the other
(``processes.node_cpu_sets``; ``cpus`` in the result). Local prefill, the receiver's alternative, is timed
by the receiver on its CPUs after the handoff (``local_prefill_ttft_s``, what ``ttft_vs_local`` divides
by); the sender then times it again with the whole machine (``local_prefill_whole_machine_ttft_s``, the
figure of a receiver that had every core).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from pfec.common.codec.fec import warm_up
from pfec.common.model import llm
from pfec.common.model.runtime import load_runtime, usable_cpus
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_RHO, DEFAULT_RTT_MS
from pfec.common.plan.handoff import load_profile, synthetic_identity
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.common.plan.mode_choice import HANDOFF_MODES
from pfec.common.plan.stream import AUTO, PRECISION_CHOICES
from pfec.common.sched.policies import SCHEMES
from pfec.lab.kv.workloads import QAExample, best_f1, contains_answer, needle_qa
from pfec.lab.processes import (
    LOOPBACK_PSK,
    Child,
    CpuQuota,
    NodeCpus,
    local_prefill_ttft,
    node_cpu_sets,
    pinned,
    raise_priority,
    relay_link,
)
from pfec.lab.reporting.text import format_handoff_report
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.simulate import SimConfig, simulate
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

__all__ = ["DemoConfig", "format_demo", "run_demo", "start_receiver", "summarise_runs"]


def _log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DemoConfig:
    scheme: str = "heuristic"
    rho: float = DEFAULT_RHO
    loss: str = "ge:0.001,0.5,0.02,0.1"
    rate_mbps: float = DEFAULT_RATE_MBPS
    rtt_ms: float = DEFAULT_RTT_MS
    tokens: int = 1500
    seed: int = 1
    reconstruction: str = "mask"
    compare_sim: bool = True
    sim_realizations: int = 10
    model: str = "default"
    precision: str = AUTO
    mode: str = AUTO  # auto (the planner's), handoff, split or local
    receiver_cpu_quota: float | None = None  # CPUs the receiver may use (``processes.CpuQuota``); None: all

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"--scheme {self.scheme!r}: choose one of {', '.join(SCHEMES)}")
        if not 0 < self.rho <= 100:
            raise ValueError(f"--rho {self.rho!r}: must be in (0, 100]")
        if self.rate_mbps <= 0:
            raise ValueError(f"--rate-mbps {self.rate_mbps!r}: must be positive")
        if self.rtt_ms < 0:
            raise ValueError(f"--rtt-ms {self.rtt_ms!r}: must be >= 0")
        if not 100 <= self.tokens <= 8000:
            raise ValueError(f"--tokens {self.tokens!r}: must be in 100..8000")
        if self.reconstruction not in ("mask", "zero"):
            raise ValueError(f"--reconstruction {self.reconstruction!r}: use mask or zero")
        if self.loss.strip().lower() not in ("none", "0"):
            parse_loss_spec(self.loss)
        if self.precision not in PRECISION_CHOICES:
            raise ValueError(f"--precision {self.precision!r}: choose one of {', '.join(PRECISION_CHOICES)}")
        if self.mode not in HANDOFF_MODES:
            raise ValueError(f"--mode {self.mode!r}: choose one of {', '.join(HANDOFF_MODES)}")
        quota = self.receiver_cpu_quota
        if quota is not None and not (math.isfinite(quota) and 0.01 <= quota <= 64):
            raise ValueError(f"--receiver-cpu-quota {quota!r}: CPUs in 0.01..64 (0.5: half a CPU)")


def start_receiver(model: str, log: Callable[[str], None], cpus: tuple[int, ...] | None = None,
                   cpu_quota: float | None = None) -> Child:
    """The receiver daemon's process of a real-model run on this machine (the demo, the break-even bench),
    on ``cpus`` (None: this process's), after this process's own set-up: tokenizers single-threaded, the
    packet paths ahead of other work, the embedded model converted once here rather than in two processes
    at once. ``cpu_quota``: the CPUs' worth of time it may use (``CpuQuota``, from before it measures its
    speed), a slower node on this machine."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise_priority()
    if model == "default":
        llm.default_model_dir()
    quota = None if cpu_quota is None else CpuQuota(cpu_quota, f"pfec-receiver-{os.getpid()}")
    log("starting the receiver (loads the model)"
        + ("" if quota is None else f" under a CPU quota of {quota.share:g} CPUs") + " ...")
    try:
        return Child("receiver", cpus=cpus, cpu_quota=quota, model=model, psk=LOOPBACK_PSK)
    except BaseException:
        if quota is not None:
            quota.close()
        raise


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    started = time.perf_counter()
    cpus = node_cpu_sets()
    _log(f"CPUs: receiver {list(cpus.receiver)}, sender and relay {list(cpus.sender)}"
         + ("" if cpus.pinned else f" (not pinned: {cpus.why})"))
    receiver = start_receiver(cfg.model, _log, cpus.pin("receiver"), cfg.receiver_cpu_quota)
    relay: Child | None = None
    try:
        result = run_event_loop(_sender_side(cfg, receiver, cpus, started))
        relay = result.pop("_relay")
    finally:
        rx_stats = receiver.stop()
        relay_stats = relay.stop() if relay is not None else {}
    result["receiver_drops"] = rx_stats.get("drops")
    result["link"] = {k: relay_stats.get(k) for k in ("forward", "reverse")}
    if cfg.compare_sim:
        _log(f"running `pfec sim` on the same link ({cfg.sim_realizations} realizations) ...")
        result["sim"] = _sim_compare(cfg, result)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    return result


async def _sender_side(cfg: DemoConfig, receiver: Child, cpus: NodeCpus, started: float) -> dict[str, Any]:
    """The handoff and the receiver's local prefill with this process on the sender's CPUs; then local
    prefill again here on the whole machine (this process's CPUs and torch threads restored)."""
    loop = asyncio.get_running_loop()
    with pinned(cpus.pin("sender")):
        runtime, example, inputs, report, relay = await _handoff(cfg, receiver, cpus, started)
        _log("timing a local prefill of the same prompt on the receiver's CPUs (its alternative) ...")
        local = await loop.run_in_executor(None, receiver.local_prefill, inputs)
    _log("timing it again in the sender on the whole machine (for comparison) ...")
    whole = await loop.run_in_executor(None, local_prefill_ttft, runtime, inputs, 2, usable_cpus())
    return {**_result(cfg, example, report, local, whole, cpus), "_relay": relay}


async def _handoff(cfg: DemoConfig, receiver: Child, cpus: NodeCpus, started: float,
                   ) -> tuple[llm.ModelRuntime, QAExample, ContextInput, dict[str, Any], Child]:
    """Load the model here, start the relay, run the handoff: (runtime, example, inputs, report, relay)."""
    loop = asyncio.get_running_loop()
    warm_up()
    _log("loading the model in the sender ...")
    runtime, identity = await loop.run_in_executor(None, load_runtime, cfg.model)
    rx_addr = await loop.run_in_executor(None, receiver.wait_ready)
    relay = Child("relay", cpus=cpus.pin("relay"), forward_to=tuple(rx_addr),
                  link=relay_link(cfg.rate_mbps * 1e6, cfg.rtt_ms / 2000, cfg.loss, cfg.seed))
    relay_addr = await loop.run_in_executor(None, relay.wait_ready)
    if runtime is None:
        raise ValueError(f"model {cfg.model!r}: the demo needs a real model (it asks a question)")
    example = needle_qa(1, cfg.tokens, seed=cfg.seed, count_tokens=partial(llm.count_tokens, runtime))[0]
    daemon = SenderDaemon(identity, LOOPBACK_PSK, runtime=runtime, rate_mbps=cfg.rate_mbps,
                          owd_ms=cfg.rtt_ms / 2, scheme=cfg.scheme)
    _log(f"ready after {time.perf_counter() - started:.1f} s; prefill + handoff over the emulated link "
         f"({cfg.rate_mbps:g} Mbit/s, RTT {cfg.rtt_ms:g} ms, loss {cfg.loss}) ...")
    spec = HandoffSpec(
        ContextInput(context=example.context, question=example.question),
        tuple(relay_addr), rho=cfg.rho, scheme=cfg.scheme, mode=cfg.reconstruction,  # type: ignore[arg-type]
        full_kv_answer=True, precision=cfg.precision, handoff_mode=cfg.mode,
    )
    handoff = daemon.submit(spec)
    await handoff.done.wait()
    await daemon.close()
    return runtime, example, spec.inputs, handoff.view(), relay


def _result(cfg: DemoConfig, example: QAExample, report: dict[str, Any], local: dict[str, Any],
            whole: dict[str, Any], cpus: NodeCpus) -> dict[str, Any]:
    """The demo's JSON: ``local`` is the receiver's local prefill on its CPUs, ``whole`` the sender's on
    the whole machine."""
    gold = list(example.answers)
    ttft = report.get("ttft_s")
    return {
        "inputs": {**asdict(cfg), "question": example.question, "gold_answers": gold,
                   "needle_kind": example.meta.get("kind"), "depth": example.meta.get("depth")},
        "cpus": cpus.to_json(),
        "receiver_cpu_quota": cfg.receiver_cpu_quota,
        "recovered_utility": report.get("recovered_utility"),
        "precision_utility": report.get("precision_utility"),
        "ttft_s": ttft,
        "local_prefill_ttft_s": local["ttft_s"],
        "local_prefill_runs_s": local["runs_s"],
        "load_average_1m": local["load_average_1m"],  # before and after the receiver's local prefill
        "local_prefill_whole_machine_ttft_s": whole["ttft_s"],
        "local_prefill_whole_machine_runs_s": whole["runs_s"],
        "ttft_vs_local": round(ttft / local["ttft_s"], 4) if ttft else None,
        # where each was timed, as the timing thread saw it: its CPUs and torch threads
        "local_prefill_measured_on": {
            "receiver": {k: local.get(k) for k in ("cpus", "torch_threads")},
            "whole_machine": {k: whole.get(k) for k in ("cpus", "torch_threads")}},
        "start": report.get("start"),
        "precision": report.get("precision"),
        "precision_mix": report.get("precision_mix"),
        "planner_choice": report.get("planner_choice"),
        "planner_ttft_s": report.get("planner_ttft_s"),
        "planner": report.get("planner"),
        "mode": report.get("handoff_mode"),
        "predicted_ttft_s": report.get("predicted_ttft_s"),
        "predicted_local_ttft_s": report.get("predicted_local_ttft_s"),
        # each part of the TTFT the planner predicted from the receiver's measurements, beside what it took
        "predicted_vs_measured": report.get("predicted_vs_measured"),
        "receiver_defaulted": (report.get("planner") or {}).get("receiver_defaulted"),
        "meeting_token_planned": report.get("meeting_token_planned"),
        "computed_tokens": report.get("computed_tokens"),
        "blocks_computed": report.get("blocks_computed"),
        "blocks_received": report.get("blocks_received"),
        "bytes_sent": report.get("bytes_sent"),
        "native_bytes": report.get("native_bytes"),
        "stream_bytes": report.get("stream_bytes"),
        "deadline_s": (report["deadline_ms"] / 1000) if "deadline_ms" in report else None,
        "answer": report.get("answer"),
        "full_kv_answer": report.get("full_kv_answer"),
        # the intact cache rounded to the wire's dtype: the answer of a handoff that lost nothing
        "full_kv_wire_answer": report.get("full_kv_wire_answer"),
        "answer_f1": best_f1(report.get("answer") or "", gold),
        "full_kv_answer_f1": best_f1(report.get("full_kv_answer") or "", gold),
        "answer_contains_gold": contains_answer(report.get("answer") or "", gold),
        "full_kv_answer_contains_gold": contains_answer(report.get("full_kv_answer") or "", gold),
        "source_sent": report.get("source_sent"),
        "repair_sent": report.get("repair_sent"),
        "diagnostics": _diagnostics(cfg, report),
        "report": report,
    }


def _diagnostics(cfg: DemoConfig, report: dict[str, Any]) -> dict[str, Any]:
    """Did the processes keep up? The simulator's sender uses the whole link until its deadline and its
    receiver sees every datagram in time; a CPU-starved machine shows here first."""
    owd_s = cfg.rtt_ms / 2000
    send_window = report.get("deadline_ms", 0) / 1000 - owd_s
    wire_s = report.get("bytes_sent", 0) * 8 / (cfg.rate_mbps * 1e6)
    link_use = wire_s / send_window if send_window > 0 else 0.0
    late = (report.get("receiver_stats") or {}).get("late")
    out: dict[str, Any] = {"link_use": round(link_use, 3), "late_datagrams": late}
    warnings = []
    # A session that started before its deadline (ready, or its sender done) needed no more of the link, and
    # what was in flight then (about a round trip's worth) arrives late by design: no warning.
    at_deadline = report.get("start") == "deadline"
    if at_deadline and link_use < 0.95 and report.get("source_sent", 0) < report.get("n_source", 0):
        warnings.append(f"the sender used {link_use:.0%} of the link before its deadline (the simulator "
                        "uses ~100%): it was short of CPU")
    if at_deadline and late and late > 0.01 * max(1, report.get("source_sent", 0)):
        warnings.append(f"{late} datagrams reached the receiver after its deadline: it fell behind (CPU)")
    out["warnings"] = warnings
    return out


def _sim_compare(cfg: DemoConfig, result: dict[str, Any]) -> dict[str, Any]:
    report = result["report"]
    n_tokens = report.get("n_tokens")
    if not n_tokens:
        return {"error": "the handoff did not get far enough to compare"}
    if report.get("handoff_mode") == "local":  # the planner chose local prefill: nothing crossed the link
        return {"skipped": "the receiver prefilled locally (the planner's choice): no stream to simulate"}
    profile_name = report.get("profile", "synthetic")
    profile = None if profile_name == "synthetic" else load_profile(synthetic_identity(DEFAULT_GEOMETRY),
                                                                    profile_name)
    sim_cfg = SimConfig(loss=parse_loss_spec(cfg.loss), rate_mbps=cfg.rate_mbps, rtt_ms=cfg.rtt_ms,
                        rho=cfg.rho, tokens=int(n_tokens), profile=profile, seed=cfg.seed,
                        precision=report.get("precision") or "native", repair_budget=None)  # as the daemons
    out = simulate(sim_cfg, [cfg.scheme], cfg.sim_realizations, verify=False)
    s = out["schemes"][cfg.scheme]
    return {
        "recovered_utility_mean": s["recovered_utility_mean"],
        "recovered_utility_ci95": s["recovered_utility_ci95"],
        "source_sent_mean": s["source_sent_mean"],
        "repair_sent_mean": s["repair_sent_mean"],
        "realizations": cfg.sim_realizations,
        "tokens": n_tokens,
        "profile": profile_name,
        "precision": sim_cfg.precision,
    }


def _num(value: object, fmt: str) -> str:
    return "-" if not isinstance(value, int | float) else format(value, fmt)


def _format_cpus(cpus: dict[str, Any]) -> str:
    where = f"receiver on CPUs {cpus.get('receiver')}, sender and relay on {cpus.get('sender')}"
    return f"nodes: {where}" if cpus.get("pinned") else f"nodes: not pinned ({cpus.get('why')})"


def _format_parts(parts: dict[str, Any] | None, defaulted: list[str] | None) -> str:
    """The planner's parts beside what they took (s, predicted/measured), from the OFFER's arrival."""
    if not parts:
        return "predicted vs measured: no prediction"
    cells = [f"{name.removesuffix('_s')} {_num(row.get('predicted'), '.3f')}/"
             f"{_num(row.get('measured'), '.3f')}" for name, row in parts.items()]
    told = f"; defaulted: {', '.join(defaulted)}" if defaulted else ""
    return "predicted/measured s: " + ", ".join(cells) + told


def format_demo(result: dict[str, Any]) -> str:
    inp = result["inputs"]
    lines = [
        f"PriorityFEC demo: needle QA ({result['report'].get('n_tokens')} context tokens), {inp['scheme']}, "
        f"rho {inp['rho']}, {inp['rate_mbps']:g} Mbit/s, RTT {inp['rtt_ms']:g} ms, loss {inp['loss']}",
        f"question: {inp['question']}  (gold: {', '.join(inp['gold_answers'])})",
        "",
        format_handoff_report(result["report"]),
        "",
        f"handoff answer : {result['answer']!r}  (F1 {result['answer_f1']:.2f}, "
        f"contains the gold answer: {result['answer_contains_gold']})",
        f"full-KV answer : {result['full_kv_answer']!r}  (F1 {result['full_kv_answer_f1']:.2f}, "
        f"contains the gold answer: {result['full_kv_answer_contains_gold']})",
        f"full KV at the wire's dtype: {result.get('full_kv_wire_answer')!r}",
        f"precision {result.get('precision')} (planner: {result.get('planner_choice')}, predicted TTFT "
        f"{_num(result.get('planner_ttft_s'), '.3f')} s); {_num(result.get('bytes_sent'), ',.0f')} bytes "
        f"sent for {_num(result.get('native_bytes'), ',.0f')} bytes of native KV",
        f"mode {result.get('mode')}: predicted TTFT {_num(result.get('predicted_ttft_s'), '.3f')} s, local "
        f"{_num(result.get('predicted_local_ttft_s'), '.3f')} s; meeting point planned "
        f"{result.get('meeting_token_planned')}, computed here {result.get('computed_tokens')} tokens",
        f"TTFT {_num(result.get('ttft_s'), '.3f')} s (started at the {result.get('start')}) vs local prefill "
        f"on the receiver's CPUs {_num(result.get('local_prefill_ttft_s'), '.3f')} s: "
        f"{_num(result.get('ttft_vs_local'), '.2f')}x (local prefill on the whole machine, in the sender: "
        f"{_num(result.get('local_prefill_whole_machine_ttft_s'), '.3f')} s)",
        _format_cpus(result.get("cpus") or {})
        + ("" if result.get("receiver_cpu_quota") is None
           else f"; receiver under a CPU quota of {result['receiver_cpu_quota']:g} CPUs"),
        _format_parts(result.get("predicted_vs_measured"), result.get("receiver_defaulted")),
    ]
    sim = result.get("sim")
    if sim and "recovered_utility_mean" in sim:
        lo, hi = sim["recovered_utility_ci95"]
        util = result["recovered_utility"]
        lines.append(
            f"recovered utility: daemons {util:.2%} vs `pfec sim` {sim['recovered_utility_mean']:.2%} "
            f"[{lo:.2%}, {hi:.2%}] over {sim['realizations']} realizations"
            if util is not None else "recovered utility: the handoff failed"
        )
    for warning in result.get("diagnostics", {}).get("warnings", []):
        lines.append(f"warning: {warning}; compare with `pfec sim` on an idle machine or a lower --rate-mbps")
    lines.append(f"demo wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)


def summarise_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 39's figures over demo runs (their ``--json`` results), grouped by the receiver's CPU quota:
    the median TTFT over local prefill, predicted TTFT over measured, each part's measured over predicted
    (``predicted_vs_measured``), whether every answer equalled the full-KV answer, and the planner's
    view of the receiver (what it measured, what was defaulted) per run."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        quota = result.get("receiver_cpu_quota")
        groups.setdefault("none" if quota is None else f"{quota:g}", []).append(result)
    out: dict[str, Any] = {}
    for quota, runs in groups.items():
        parts: dict[str, list[float]] = {}
        for run in runs:
            for name, row in (run.get("predicted_vs_measured") or {}).items():
                if isinstance(row.get("measured_over_predicted"), int | float):
                    parts.setdefault(name, []).append(float(row["measured_over_predicted"]))
        ratios = [r["ttft_vs_local"] for r in runs if isinstance(r.get("ttft_vs_local"), int | float)]
        out[quota] = {
            "runs": len(runs),
            "ttft_vs_local_median": _median(ratios), "ttft_vs_local": ratios,
            "measured_over_predicted_median": {name: _median(v) for name, v in parts.items()},
            "answers_equal_full_kv": [r.get("answer") == r.get("full_kv_answer") for r in runs],
            "modes": [f"{r.get('mode')}:{r.get('precision')}" for r in runs],
            "local_prefill_ttft_s": [r.get("local_prefill_ttft_s") for r in runs],
            "receiver_measured": [((r.get("report") or {}).get("planner") or {}).get("receiver_measured")
                                  for r in runs],
            "receiver_defaulted": [r.get("receiver_defaulted") for r in runs],
            "load_average_1m": [r.get("load_average_1m") for r in runs],
        }
    return out


def _median(values: list[float]) -> float | None:
    return round(float(statistics.median(values)), 4) if values else None
