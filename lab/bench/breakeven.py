"""`pfec bench breakeven`: where a KV handoff starts to beat recomputing, measured end to end.

For each context length (a seeded needle-QA prompt over real essays) and link rate, real handoffs run
through the daemons over the loopback link emulator, as `pfec demo` runs one: a receiver daemon process,
the UDP relay process (rate, delay) and the sender daemon in this process. Three modes per cell: a
handoff at the model's native precision, a handoff at the planner's precision mix (``--precision auto``:
the int8/int4 floor) and a split (the receiver prefills the front while the back streams). Local prefill
of the same prompt (the receiver's alternative) is timed by the receiver's process, with its loaded model
on its own CPUs, between the handoffs of the same run.

The link is loss-free and the deadline loose (a minute, the nodes' limit), so a handoff's TTFT is when
everything planned has arrived or been computed (the receiver starts when ready): the question here is
bytes against compute, not loss (the evaluation's precision stage covers loss). Every row also holds what
the sender's planner predicted for that mode and which mode it would have chosen, so the chart overlays
the choice.

Two nodes on one machine: the receiver runs on its own CPU set, this process (the sender) and the relays
on the other (``processes.node_cpu_sets``; ``cpus`` in the output). Caveat, stated in the output: the two
sets still share the machine's memory bandwidth and caches; where fewer than 2 CPUs can be used, nothing
is pinned and a split's receiver prefill competes with the relay and the sender for CPU.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

from pfec.common.codec.fec import warm_up
from pfec.common.model import llm
from pfec.common.model.runtime import load_runtime
from pfec.common.node.config_models import SenderLimitsConfig
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.breakeven import DEFAULT_PRECISION_LEVELS, LOCAL_MARGIN, beats_local, keeps_floor
from pfec.common.plan.deadline import DEFAULT_RTT_MS
from pfec.lab.bench.breakeven_report import plot_measured
from pfec.lab.demo import start_receiver
from pfec.lab.kv.workloads import needle_qa
from pfec.lab.processes import LOOPBACK_PSK, Child, NodeCpus, node_cpu_sets, pinned, relay_link
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput, prompt_ids

__all__ = ["MODES", "BreakevenConfig", "auto_against_fastest", "measured_crossovers", "run_breakeven_bench"]

#: (label, handoff mode, precision) of each measured handoff; local prefill is timed apart.
MODES: Final = (("handoff:native", "handoff", "native"), ("handoff:auto", "handoff", "auto"),
                ("split:auto", "split", "auto"), ("auto", "auto", "auto"))
#: The share above the measured fastest of a cell (local prefill or any measured mode) within which
#: auto's pick counts as the fastest (the issue's goal for the 20 and 100 Mbit/s cells).
AUTO_WITHIN: Final = 0.05
#: Every handoff's deadline: the longest the nodes accept by default (limits.max_budget_ms, 60 s), so it
#: binds only where a transfer could not finish in a minute anyway (8k native tokens at 20 Mbit/s take
#: ~75 s; local prefill is far quicker there) and TTFT is otherwise "ready". A rho would not do: at
#: 1 Gbit/s rho 4 is about a second, less than this machine's receive path needs for the native cache.
LOOSE_DEADLINE_MS: Final = SenderLimitsConfig().max_budget_ms
MAX_TOKENS: Final = 8000  # the demo's bound (the workload generator's essays and the receiver's limit)
ANSWER_TOKENS: Final = 8  # each handoff's answer: enough to compare, short enough not to dominate


@dataclass(frozen=True)
class BreakevenConfig:
    # 8k would be the next: its needle prompt with the chat template is ~9k tokens, past the default
    # model's 8192 (refused up front).
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    rates_mbps: tuple[float, ...] = (20.0, 100.0, 1000.0)
    rtt_ms: float = DEFAULT_RTT_MS
    model: str = "default"
    seed: int = 1
    local_runs: int = 2  # local prefill is timed this many times per length (the fastest counts)
    # How the sender paces: ``path`` (the daemons' default: it measures each rate's path, whose rate the
    # planner then divides by) or ``fixed`` (each cell's told rate).
    rate_control: str = "path"

    def __post_init__(self) -> None:
        if not self.lengths or any(not 100 <= n <= MAX_TOKENS for n in self.lengths):
            raise ValueError(f"--lengths {self.lengths!r}: each must be in 100..{MAX_TOKENS}")
        if not self.rates_mbps or any(not 0 < r <= 10_000 for r in self.rates_mbps):
            raise ValueError(f"--rates {self.rates_mbps!r}: each must be in (0, 10000] Mbit/s")
        if not 0 <= self.rtt_ms <= 1000:
            raise ValueError(f"--rtt-ms {self.rtt_ms!r}: must be in 0..1000")
        if self.local_runs < 1:
            raise ValueError(f"--local-runs {self.local_runs!r}: must be >= 1")
        if self.rate_control not in ("path", "fixed"):
            raise ValueError(f"--rate-control {self.rate_control!r}: path or fixed")


def _log(message: str) -> None:
    print(f"[bench breakeven] {message}", file=sys.stderr, flush=True)


def run_breakeven_bench(cfg: BreakevenConfig, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Measure every (length, rate, mode) cell and local prefill per length; the JSON-ready result."""
    started = time.perf_counter()
    cpus = node_cpu_sets()
    receiver = start_receiver(cfg.model, log, cpus.pin("receiver"))
    relays: dict[float, Child] = {}
    try:
        with pinned(cpus.pin("sender")):
            result = run_event_loop(_measure(cfg, receiver, relays, cpus, log))
    finally:
        receiver_stats = receiver.stop()
        link = {f"{rate:g}": relay.stop() for rate, relay in relays.items()}
    result["receiver_drops"] = receiver_stats.get("drops")
    result["link"] = {rate: {k: stats.get(k) for k in ("forward", "reverse")} for rate, stats in link.items()}
    result["crossovers"] = measured_crossovers(result["runs"], result["local"])
    result["prediction_error"] = prediction_errors(result["runs"], result["local"])
    result["auto_vs_fastest"] = auto_against_fastest(result["runs"], result["local"])
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


async def _measure(cfg: BreakevenConfig, receiver: Child, relays: dict[float, Child], cpus: NodeCpus,
                   log: Callable[[str], None]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    # The receiver times its prefill speed before it is ready: this node waits for that before it loads
    # and compiles, so the speed it states is the receiver node's alone, not one shared with a model load.
    rx_addr = tuple(await loop.run_in_executor(None, receiver.wait_ready))
    warm_up()
    runtime, identity = await loop.run_in_executor(None, load_runtime, cfg.model)
    if runtime is None:
        raise ValueError(f"model {cfg.model!r}: the break-even bench needs a real model")
    for rate in cfg.rates_mbps:
        relays[rate] = Child("relay", cpus=cpus.pin("relay"), forward_to=rx_addr,
                             link=relay_link(rate * 1e6, cfg.rtt_ms / 2000, "none", cfg.seed))
    addresses = {rate: tuple(await loop.run_in_executor(None, relay.wait_ready))
                 for rate, relay in relays.items()}
    # Each rate has its relay, so its own address: the sender measures each path apart (its rate under
    # path control; RTT, loss, its receiver's stated speed, its split fronts' slowdown) and predicts from
    # what it measured there.
    daemon = SenderDaemon(identity, LOOPBACK_PSK, runtime=runtime, rate_mbps=cfg.rates_mbps[0],
                          owd_ms=cfg.rtt_ms / 2, rate_control=cfg.rate_control)
    local: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    total = len(cfg.lengths) * len(cfg.rates_mbps) * len(MODES)
    try:
        prompts = {n: _prompt(runtime, n, cfg.seed) for n in cfg.lengths}  # all checked before any run
        # One unrecorded handoff and split per path first: compiled kernels and first-use costs are not a
        # handoff's TTFT, and the first recorded handoff of each kind on each path plans on what an earlier
        # one measured there, as every later one does (a sender new to a receiver plans on priors).
        warm_up_prompt = _prompt(runtime, min(cfg.lengths), cfg.seed + 1)
        for rate in cfg.rates_mbps:
            for mode in ("handoff", "split"):
                await _handoff(daemon, warm_up_prompt, addresses[rate], rate, mode, "auto")
        for n in cfg.lengths:
            inputs = prompts[n]
            log(f"{n} tokens: timing local prefill on the receiver's CPUs ({cfg.local_runs} run(s)) ...")
            local[str(n)] = await loop.run_in_executor(None, _local, receiver, runtime, inputs,
                                                       cfg.local_runs)
            for rate in cfg.rates_mbps:
                for label, mode, precision in MODES:
                    report = await _handoff(daemon, inputs, addresses[rate], rate, mode, precision)
                    runs.append(_row(n, rate, label, report, local[str(n)]))
                    row = runs[-1]
                    log(f"[{len(runs)}/{total}] {n} tokens, {rate:g} Mbit/s, {label}: TTFT "
                        f"{_fmt(row['ttft_s'])} s vs local {local[str(n)]['ttft_s']:.2f} s "
                        f"({time.strftime('%H:%M:%S')})" + (f": {row['error']}" if row["error"] else ""))
    finally:
        await daemon.close()
    return {"config": asdict(cfg), "deadline_ms": LOOSE_DEADLINE_MS, "cpus": cpus.to_json(), "local": local,
            "runs": runs, "caveat": _caveat(cpus)}


def _caveat(cpus: NodeCpus) -> str:
    if cpus.pinned:
        return (f"both nodes share this machine: the receiver runs on CPUs {list(cpus.receiver)}, the sender "
                f"and the link emulator on {list(cpus.sender)}; they still share memory bandwidth and caches")
    return (f"not pinned ({cpus.why}): both nodes and the link emulator share this machine's cores, so a "
            "split's receiver prefill competes with the relay and the sender for CPU")


def _prompt(runtime: llm.ModelRuntime, n_tokens: int, seed: int) -> ContextInput:
    """The needle-QA prompt of about ``n_tokens`` context tokens, refused up front (ValueError naming the
    length) when it and its answer do not fit the model, not after the shorter lengths have run."""
    example = needle_qa(1, n_tokens, seed=seed, count_tokens=partial(llm.count_tokens, runtime))[0]
    inputs = ContextInput(context=example.context, question=example.question)
    context_ids, question_ids = prompt_ids(runtime, inputs)
    try:
        llm.check_length(runtime, len(context_ids), len(question_ids) + ANSWER_TOKENS)
    except ValueError as exc:
        raise ValueError(f"--lengths {n_tokens}: {exc}") from None
    return inputs


def _local(receiver: Child, runtime: llm.ModelRuntime, inputs: ContextInput, runs: int) -> dict[str, Any]:
    """Local prefill's TTFT, timed by the receiver on its CPUs (``processes.local_prefill_ttft``), and the
    prompt's length in tokens."""
    context_ids, question_ids = prompt_ids(runtime, inputs)
    return {**receiver.local_prefill(inputs, runs), "context_tokens": len(context_ids),
            "question_tokens": len(question_ids)}


async def _handoff(daemon: SenderDaemon, inputs: ContextInput, address: tuple[str, int], rate: float,
                   mode: str, precision: str) -> dict[str, Any]:
    spec = HandoffSpec(inputs, address, rho=None, deadline_ms=LOOSE_DEADLINE_MS, rate_mbps=rate,
                       precision=precision, handoff_mode=mode, max_new_tokens=ANSWER_TOKENS)
    handoff = daemon.submit(spec)
    await handoff.done.wait()
    return handoff.view()


def _fmt(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-"


def _row(n: int, rate: float, label: str, report: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
    """One measured handoff: its TTFT next to local prefill's, and what the planner predicted and chose."""
    planner = report.get("planner") or {}
    ttft = report.get("ttft_s")
    timed = isinstance(ttft, int | float) and ttft > 0
    return {
        "n_tokens": n, "rate_mbps": rate, "mode": label, "state": report.get("state"),
        "error": report.get("failure") or report.get("error") or report.get("receiver_error"),
        "ttft_s": ttft, "start": report.get("start"),
        "ttft_vs_local": round(ttft / local["ttft_s"], 4) if isinstance(ttft, int | float) else None,
        # Bytes on the link over the TTFT: below the rate where this machine's CPUs, not the link, bound it.
        "achieved_mbps": (round(report["bytes_sent"] * 8 / ttft / 1e6, 1)
                          if timed and report.get("bytes_sent") else None),
        "predicted_ttft_s": planner.get("predicted_ttft_s"),
        "predicted_local_ttft_s": planner.get("local_ttft_s"),
        "planner_choice": planner.get("choice"), "planner_used": planner.get("used"),
        "handoff_mode": report.get("handoff_mode"),
        "precision": report.get("precision"), "bytes_sent": report.get("bytes_sent"),
        "native_bytes": report.get("native_bytes"),
        "meeting_token_planned": report.get("meeting_token_planned"),
        "computed_tokens": report.get("computed_tokens"), "answer": report.get("answer"),
        # What the prediction came from (measured on this path, or priors) and its terms; the front's
        # timed seconds and its slowdown against the receiver's stated speed (splits).
        "planner_inputs": report.get("planner_inputs"), "predicted_parts": planner.get("predicted_parts"),
        "front_s": report.get("front_s"), "front_slowdown": report.get("front_slowdown"),
        "path_rate": report.get("path_rate"),
    }


def measured_crossovers(runs: Sequence[dict[str, Any]], local: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per rate and mode, the smallest measured length from which the mode's TTFT beat local prefill at
    that and every longer measured length (None: not even at the longest; a failed run never beats)."""
    out: dict[str, dict[str, Any]] = {}
    for rate in sorted({r["rate_mbps"] for r in runs}):
        per_mode: dict[str, Any] = {}
        for label, _, _ in MODES:
            rows = sorted((r for r in runs if r["rate_mbps"] == rate and r["mode"] == label),
                          key=lambda r: r["n_tokens"])
            beats_from = None
            for row in reversed(rows):
                ttft = row["ttft_s"]
                if not isinstance(ttft, int | float) or ttft >= local[str(row["n_tokens"])]["ttft_s"]:
                    break
                beats_from = row["n_tokens"]
            per_mode[label] = beats_from
        out[f"{rate:g}"] = per_mode
    return out


def _relative_error(predicted: object, measured: object) -> float | None:
    if not isinstance(predicted, int | float) or not isinstance(measured, int | float) or measured <= 0:
        return None
    return round((predicted - measured) / measured, 4)


def prediction_errors(runs: Sequence[dict[str, Any]], local: dict[str, Any]) -> dict[str, Any]:
    """Per cell and mode, the planner's TTFT prediction against the measured TTFT ((predicted -
    measured) / measured), local prefill's too, and the median absolute error over every cell (the
    goal: at most 15%). A run that failed or hit the deadline has no error."""
    cells = []
    for row in runs:
        timed = row.get("start") != "deadline" and row.get("state") == "done"
        cells.append({
            "n_tokens": row["n_tokens"], "rate_mbps": row["rate_mbps"], "mode": row["mode"],
            "error": _relative_error(row.get("predicted_ttft_s"), row.get("ttft_s")) if timed else None,
            "local_error": _relative_error(row.get("predicted_local_ttft_s"),
                                           local[str(row["n_tokens"])]["ttft_s"]),
        })
    errors = sorted(abs(c["error"]) for c in cells if c["error"] is not None)
    local_errors = sorted(abs(c["local_error"]) for c in cells if c["local_error"] is not None)

    def median(values: list[float]) -> float | None:
        if not values:
            return None
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    return {"cells": cells, "median_abs_error": median(errors),
            "median_abs_local_error": median(local_errors)}


def _ratio(ttft: object, base: float) -> float | None:
    return round(ttft / base, 4) if isinstance(ttft, int | float) else None


def _plan(row: dict[str, Any]) -> tuple[object, object, object]:
    """What a handoff ran: its mode, precision and meeting token."""
    return row.get("handoff_mode"), row.get("precision"), row.get("meeting_token_planned")


def auto_against_fastest(runs: Sequence[dict[str, Any]], local: dict[str, Any]) -> dict[str, Any]:
    """Per cell, what ``auto`` ran and its TTFT against the measured fastest of the cell (local prefill or
    any other measured mode; a run that failed or hit the deadline is not a candidate), and whether it ran
    that fastest option's very plan (mode, precision, meeting token): one run per cell, so two runs of
    one plan differ by their own spread, which ``ratio`` includes and ``same_plan`` does not."""
    by_cell: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
    for row in runs:
        by_cell.setdefault((row["n_tokens"], row["rate_mbps"]), {})[row["mode"]] = row
    cells = []
    for (n, rate), rows in sorted(by_cell.items()):
        auto = rows.get("auto")
        if auto is None:
            continue
        measured = {"local": local[str(n)]["ttft_s"]}
        measured |= {label: row["ttft_s"] for label, row in rows.items()
                     if label != "auto" and row.get("state") == "done" and row.get("start") != "deadline"
                     and isinstance(row.get("ttft_s"), int | float)}
        fastest = min(measured, key=lambda label: measured[label])
        ttft = auto.get("ttft_s") if auto.get("state") == "done" else None
        ratio = _ratio(ttft, measured[fastest])
        same_plan = (auto.get("handoff_mode") == "local" if fastest == "local"
                     else _plan(auto) == _plan(rows[fastest]))
        admitted = fastest_admitted(measured["local"], {label: rows[label] for label in measured
                                                        if label != "local"})
        to_admitted = _ratio(ttft, measured[admitted])
        cells.append({
            "n_tokens": n, "rate_mbps": rate, "ran": f"{auto.get('handoff_mode')}:{auto.get('precision')}",
            "planner_choice": auto.get("planner_choice"), "ttft_s": ttft,
            "fastest": fastest, "fastest_ttft_s": measured[fastest], "ratio": ratio,
            "within": ratio is not None and ratio <= 1 + AUTO_WITHIN, "same_plan": same_plan,
            "fastest_admitted": admitted, "fastest_admitted_ttft_s": measured[admitted],
            "ratio_to_admitted": to_admitted,
            "within_admitted": to_admitted is not None and to_admitted <= 1 + AUTO_WITHIN,
        })
    return {"within_share": AUTO_WITHIN, "local_margin": LOCAL_MARGIN, "cells": cells, "of": len(cells),
            "within": sum(c["within"] for c in cells), "same_plan": sum(c["same_plan"] for c in cells),
            "within_admitted": sum(c["within_admitted"] for c in cells)}


def fastest_admitted(local_ttft_s: float, rows: dict[str, dict[str, Any]]) -> str:
    """The measured fastest of the options the planner's rule may run (``breakeven.plan_handoff``): a stream
    that keeps the fidelity floor and beat local prefill by ``LOCAL_MARGIN`` as measured; none did: local.
    Auto against it is what the planner's predictions decide; against the plain fastest, auto is also
    charged for the margin it keeps by design."""
    known = {level.name for level in DEFAULT_PRECISION_LEVELS}
    admitted = {label: row["ttft_s"] for label, row in rows.items()
                if row.get("handoff_mode") in ("handoff", "split") and row.get("precision") in known
                and keeps_floor(row["precision"]) and beats_local(row["ttft_s"], local_ttft_s)}
    return min(admitted, key=lambda label: admitted[label]) if admitted else "local"


def write_breakeven_bench(result: dict[str, Any], out_dir: Path) -> None:
    """breakeven.json, breakeven.md (tables) and the chart next to the planner's prediction."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "breakeven.json").write_text(json.dumps(result, indent=2) + "\n")
    figure = plot_measured(result, out_dir / "breakeven.png")
    (out_dir / "breakeven.md").write_text(format_breakeven(result, figure.name))


_PACING: Final = {"path": "the rate it measures on each path (path rate control)",
                  "fixed": "each cell's told rate (fixed rate control)"}


def format_breakeven(result: dict[str, Any], figure: str) -> str:
    m = result.get("machine", {})
    cfg = result["config"]
    lines = [
        "# Break-even benchmark (`pfec bench breakeven`)",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, Python {m.get('python', '?')}. Model "
        f"{cfg['model']}; loss-free emulated link, RTT {cfg['rtt_ms']:g} ms, deadline "
        f"{result['deadline_ms'] / 1000:g} s, the nodes' limit (TTFT is when everything planned arrived or "
        "was computed, except where marked (deadline)). One handoff per cell; local prefill is the "
        f"fastest of {cfg['local_runs']} run(s) by the receiver, on its CPUs, in the same run. The sender "
        f"paces at {_PACING.get(cfg.get('rate_control', 'fixed'), '?')}, measures each rate's path apart "
        "(one handoff and one split per path first, unrecorded) and predicts from what it measured there: "
        "each row's `planner_inputs` in the JSON. "
        f"Caveat: {result['caveat']}. Wall time {result['wall_s']:.0f} s.",
        "",
        f"![measured TTFT by context length and link rate]({figure})",
        "",
        "| tokens | Mbit/s | local s | " + " | ".join(f"{label} s" for label, _, _ in MODES)
        + " | native's link Mbit/s | planner's choice | predicted s ("
        + " / ".join(label for label, _, _ in MODES) + ") |",
        "|---|---|---|" + "---|" * len(MODES) + "---|---|---|",
    ]
    by_cell: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
    for row in result["runs"]:
        by_cell.setdefault((row["n_tokens"], row["rate_mbps"]), {})[row["mode"]] = row
    for (n, rate), rows in sorted(by_cell.items()):
        cells = [_fmt(rows.get(label, {}).get("ttft_s"))
                 + (" (deadline)" if rows.get(label, {}).get("start") == "deadline" else "")
                 for label, _, _ in MODES]
        predicted = " / ".join(_fmt(rows.get(label, {}).get("predicted_ttft_s")) for label, _, _ in MODES)
        choice = next((r["planner_choice"] for r in rows.values() if r.get("planner_choice")), "-")
        achieved = rows.get("handoff:native", {}).get("achieved_mbps")
        lines.append(f"| {n} | {rate:g} | {result['local'][str(n)]['ttft_s']:.2f} | {' | '.join(cells)} "
                     f"| {achieved if achieved is not None else '-'} | {choice} | {predicted} |")
    lines += ["", "The native handoff's link Mbit/s is its bytes over its TTFT: where it falls far below the "
              "rate, this machine's CPUs (the receiver's set, or the sender's and relay's), not the link, "
              "bound it. "
              "(deadline): the receiver started at the deadline, not ready: datagrams were lost where the "
              "receive path could not keep up (socket buffers), more than the repair budget recovered.",
              "", "Measured crossovers: the shortest context from which the mode beat local prefill at that "
              "and every longer measured context (- : not even at the longest).", "",
              "| Mbit/s | " + " | ".join(label for label, _, _ in MODES) + " |",
              "|---|" + "---|" * len(MODES)]
    for rate, per_mode in result["crossovers"].items():
        lines.append(f"| {rate} | " + " | ".join(str(per_mode[label] or "-") for label, _, _ in MODES) + " |")
    errors = result.get("prediction_error")
    if errors:
        def pct(value: object) -> str:
            return f"{value:+.0%}" if isinstance(value, int | float) else "-"

        lines += ["", "Prediction error, (predicted - measured) / measured, per cell and mode, and local "
                  "prefill's; median absolute: "
                  f"{pct(errors['median_abs_error'])} for the handoffs, "
                  f"{pct(errors['median_abs_local_error'])} for local prefill (the goal: at most 15%).", "",
                  "| tokens | Mbit/s | " + " | ".join(label for label, _, _ in MODES) + " | local |",
                  "|---|---|" + "---|" * len(MODES) + "---|"]
        by_cell_error: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
        for cell in errors["cells"]:
            by_cell_error.setdefault((cell["n_tokens"], cell["rate_mbps"]), {})[cell["mode"]] = cell
        for (n, rate), modes in sorted(by_cell_error.items()):
            local_error = next((m["local_error"] for m in modes.values()), None)
            lines.append(f"| {n} | {rate:g} | "
                         + " | ".join(pct(modes.get(label, {}).get("error")) for label, _, _ in MODES)
                         + f" | {pct(local_error)} |")
    versus = result.get("auto_vs_fastest")
    if versus and versus["cells"]:
        share = f"{versus['within_share']:.0%}"
        lines += ["", f"Auto's pick against the measured fastest of its cell: within {share} in "
                  f"{versus['within']} of {versus['of']} cells; the fastest option's very plan (mode, "
                  f"precision, meeting token) in {versus['same_plan']} of {versus['of']} (one run per "
                  "cell: two runs of one plan differ by their own spread).", "",
                  "| tokens | Mbit/s | auto ran | planner's choice | auto s | fastest | ratio | same plan |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in versus["cells"]:
            lines.append(f"| {c['n_tokens']} | {c['rate_mbps']:g} | {c['ran']} "
                         f"| {c['planner_choice'] or '-'} | {_fmt(c['ttft_s'])} "
                         f"| {c['fastest']} ({_fmt(c['fastest_ttft_s'])} s) | {_fmt(c['ratio'])} "
                         f"| {'yes' if c['same_plan'] else 'no'} |")
        if "within_admitted" in versus:
            margin = f"{versus['local_margin']:.0%}"
            lines += ["", "Auto's pick against the measured fastest of the options its rule may run (a "
                      f"stream that keeps the fidelity floor and beat local prefill by {margin} as measured; "
                      f"none did: local prefill): within {share} in {versus['within_admitted']} of "
                      f"{versus['of']} cells. The table above also charges auto for the margin it keeps by "
                      "design.", "",
                      "| tokens | Mbit/s | auto ran | auto s | fastest admitted | ratio |",
                      "|---|---|---|---|---|---|"]
            for c in versus["cells"]:
                lines.append(f"| {c['n_tokens']} | {c['rate_mbps']:g} | {c['ran']} | {_fmt(c['ttft_s'])} "
                             f"| {c['fastest_admitted']} ({_fmt(c['fastest_admitted_ttft_s'])} s) "
                             f"| {_fmt(c['ratio_to_admitted'])} |")
    failed = [r for r in result["runs"] if not isinstance(r["ttft_s"], int | float)]
    if failed:
        lines += ["", f"{len(failed)} handoff(s) gave no TTFT: " + "; ".join(
            f"{r['n_tokens']} tokens {r['rate_mbps']:g} Mbit/s {r['mode']}: {r['state']} {r['error']}"
            for r in failed)]
    lines.append("")
    return "\n".join(lines)
