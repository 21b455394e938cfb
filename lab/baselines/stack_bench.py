"""`pfec bench quic`: does a QUIC stack keep up with the emulated link? (qh3 against aioquic)

A bulk transfer with the QUIC baseline's own endpoints (``endpoints``, one run: ``runs.quic_run``): the
reliable baseline's payload (the default model's cache of ``tokens`` tokens, natural order) on one stream,
for ``seconds`` from the first Initial or until all of it arrived, on each path of ``BENCH_PATHS`` (the
stacks take turns run by run, so that the machine's load falls on both alike; each run records the load):

* ``relay``: the relay emulator at ``rate_mbps`` each way, RTT ``rtt_ms``, 1,000-datagram drop-tail
  queues, no loss: what the baseline rows' link is without loss;
* ``relay-ge``: the same with the paper's main Gilbert-Elliott loss forward (``MAIN_LOSS``);
* ``loopback``: straight over loopback, no emulator: the stack's own ceiling on this machine.

Per run: goodput = in-order bytes by the end over (the last byte's arrival - handshake done); the wire
rate (emulated bytes, lost included, over the receive span, as ``reliable``'s link_rate_achieved_mbps);
each endpoint's CPU from its ready line to its result line and that CPU over the transfer's span (t0 ->
the endpoint's last event: ~1 means the stack is CPU-bound; the receiver's span ends at its last byte,
its CPU at its result line, so its share leans high); the sender's final congestion window and smoothed
RTT; each endpoint's CPU per MB delivered (the load-independent cost: times the link's rate, the cores
the two endpoints need, ``endpoint_cores_at_link_rate``). A stack keeps up when its lossless relay goodput
is at least ``KEEPS_UP`` of the link's rate. Every run is quoted; nothing is best-of.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

from pfec.common.node.eventloop import run_event_loop
from pfec.lab.baselines.endpoints import QUIC_DATAGRAM, QUIC_STACKS
from pfec.lab.baselines.reliable import bytes_by, stream_bytes
from pfec.lab.baselines.runs import (
    DEFAULT_QUEUE_PACKETS,
    emulator_config,
    len_payload,
    quic_run,
    run_certificates,
)
from pfec.lab.sim.channel import Bernoulli, parse_loss_spec
from pfec.lab.sim.simulate import SimConfig, prepare

__all__ = ["BENCH_PATHS", "KEEPS_UP", "MAIN_LOSS", "format_quic_bench", "run_quic_bench"]

BENCH_PATHS: Final = ("relay", "relay-ge", "loopback")
MAIN_LOSS: Final = "ge:0.001,0.5,0.02,0.1"
KEEPS_UP: Final = 0.9  # lossless relay goodput / link rate


def _run_row(sent: dict[str, Any], received: dict[str, Any], stats: dict[str, Any], deadline_s: float,
             emulator_cpu_s: float, total: int) -> dict[str, Any]:
    """One transfer's figures (module docstring)."""
    t0, connected = float(sent["t0"]), float(sent["connected"])
    trace: list[list[float]] = [row for row in received["trace"] if row[0] <= t0 + deadline_s]
    got = bytes_by(trace, t0 + deadline_s)
    last = trace[-1][0] if trace else math.nan
    fwd = stats["forward"]
    wire = fwd["bytes_out"] * (fwd["delivered"] + fwd["lost"]) / fwd["delivered"] if fwd["delivered"] else 0
    span_rx = last - trace[0][0] if len(trace) > 1 else math.nan
    tx_cpu = float(sent["cpu_s"]) - float(sent["ready_cpu_s"])
    rx_cpu = float(received.get("cpu_s", math.nan)) - float(received.get("ready_cpu_s", math.nan))
    return {
        "handshake_ms": round((connected - t0) * 1000, 2),
        "bytes": got,
        "complete": got == total,
        "goodput_mbps": round(got * 8 / (last - connected) / 1e6, 2) if last > connected else 0.0,
        # None on loopback: no emulator counted the wire
        "wire_rate_mbps": round(wire * 8 / span_rx / 1e6, 2) if span_rx > 0 and wire else None,
        "sender_cpu_s": round(tx_cpu, 3),
        "receiver_cpu_s": round(rx_cpu, 3),
        "sender_cpu_share": round(tx_cpu / (float(sent["ended"]) - t0), 3),
        "sender_cpu_ms_per_mb": round(tx_cpu * 1e3 / (got / 1e6), 2) if got else None,
        "receiver_cpu_ms_per_mb": round(rx_cpu * 1e3 / (got / 1e6), 2) if got else None,
        "receiver_cpu_share": round(rx_cpu / (last - t0), 3) if last > t0 else None,
        "emulator_cpu_s": round(emulator_cpu_s, 3),
        "forward_lost": int(fwd["lost"]),
        "forward_queue_dropped": int(fwd["queue_dropped"]),
        "cwnd_bytes": sent.get("cwnd_bytes"),
        "srtt_ms": None if sent.get("srtt_ms") is None else round(float(sent["srtt_ms"]), 2),
        "stack_lost_packets": sent.get("lost_packets"),
        "stack": sent["congestion_control"],
        "intact": bool(received["intact"]),
    }


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None and math.isfinite(r[key])]
    return round(float(np.mean(values)), 2) if values else None


def _cell(stack: str, path: str, runs: list[dict[str, Any]], rate_mbps: float) -> dict[str, Any]:
    goodput = [r["goodput_mbps"] for r in runs]
    shares = [max(r["sender_cpu_share"], r["receiver_cpu_share"] or 0.0) for r in runs]
    return {
        "stack": stack, "path": path, "stack_version": runs[0]["stack"],
        "goodput_mbps_mean": round(float(np.mean(goodput)), 2),
        "goodput_mbps_min": min(goodput), "goodput_mbps_max": max(goodput),
        "goodput_of_link": None if path == "loopback" else round(float(np.mean(goodput)) / rate_mbps, 3),
        "busiest_endpoint_cpu_share_mean": round(float(np.mean(shares)), 3),
        "sender_cpu_ms_per_mb_mean": _mean_of(runs, "sender_cpu_ms_per_mb"),
        "receiver_cpu_ms_per_mb_mean": _mean_of(runs, "receiver_cpu_ms_per_mb"),
        # Cores the two endpoints would need at the link's rate at that cost per byte (load-independent).
        "endpoint_cores_at_link_rate": round((_mean_of(runs, "sender_cpu_ms_per_mb") or 0)
                                             + (_mean_of(runs, "receiver_cpu_ms_per_mb") or 0), 2)
                                       * rate_mbps / 8 / 1000,
        "completed_runs": sum(r["complete"] for r in runs),
        "runs": runs,
    }  # fmt: skip


def _config(path: str, tokens: int, rate_mbps: float, rtt_ms: float, seconds: float, seed: int) -> SimConfig:
    loss = parse_loss_spec(MAIN_LOSS) if path == "relay-ge" else Bernoulli(0.0)
    return SimConfig(loss=loss, rate_mbps=rate_mbps, rtt_ms=rtt_ms, rho=None, deadline_ms=seconds * 1000,
                     tokens=tokens, seed=seed)  # fmt: skip


def _transfer(stack: str, path: str, r: int, config: SimConfig, payload: str, certs: tuple[str, str, str]
              ) -> dict[str, Any]:
    """Transfer ``r`` of ``stack`` on ``path`` (realization r of the path's loss)."""
    handoff = prepare(config)
    link = None if path == "loopback" else emulator_config(config, r)
    load = os.getloadavg()[0]
    cpu0 = time.process_time()
    sent, received, stats = run_event_loop(quic_run(handoff, payload, link, certs, stack))
    emulator_cpu = time.process_time() - cpu0 if link is not None else 0.0
    row = _run_row(sent, received, stats, handoff.deadline_s, emulator_cpu, len_payload(handoff))
    return {"realization": r, "load_1m_before": round(load, 2), **row}


def run_quic_bench(
    stacks: tuple[str, ...] = QUIC_STACKS,
    runs: int = 3,
    tokens: int = 1536,
    rate_mbps: float = 100.0,
    rtt_ms: float = 20.0,
    seconds: float = 6.0,
    seed: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Each stack on each of ``BENCH_PATHS``, ``runs`` transfers each (realization r of the loss)."""
    bad = [s for s in stacks if s not in QUIC_STACKS]
    if bad or not stacks:
        raise ValueError(f"stacks {list(stacks)!r}: use some of {', '.join(QUIC_STACKS)}")
    if runs < 1 or not 0.5 <= seconds <= 60 or rate_mbps <= 0:
        raise ValueError(f"runs >= 1, seconds in [0.5, 60] and rate_mbps > 0, got {runs}, {seconds}, "
                         f"{rate_mbps}")
    load_before = os.getloadavg()
    total, done = len(stacks) * len(BENCH_PATHS) * runs, 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    configs = {path: _config(path, tokens, rate_mbps, rtt_ms, seconds, seed) for path in BENCH_PATHS}
    done_runs: dict[tuple[str, str], list[dict[str, Any]]] = {(s, p): [] for s in stacks for p in BENCH_PATHS}
    with tempfile.TemporaryDirectory(prefix="pfec-bench-quic-") as tmp:
        payload = os.path.join(tmp, "payload.bin")
        Path(payload).write_bytes(stream_bytes(prepare(configs["relay"]), "natural"))
        certs = run_certificates(tmp)
        for r in range(runs):  # stacks interleaved run by run: the machine's load falls on both alike
            for stack in stacks:
                for path in BENCH_PATHS:
                    done_runs[stack, path].append(_transfer(stack, path, r, configs[path], payload, certs))
                    tick()
    cells = [_cell(s, p, done_runs[s, p], rate_mbps) for s in stacks for p in BENCH_PATHS]
    keeps_up = {c["stack"]: c["goodput_of_link"] >= KEEPS_UP for c in cells if c["path"] == "relay"}
    payload_bytes = len_payload(prepare(configs["relay"]))
    inputs = {"stacks": list(stacks), "runs": runs, "tokens": tokens, "rate_mbps": rate_mbps,
              "rtt_ms": rtt_ms, "seconds": seconds, "seed": seed, "loss_ge": MAIN_LOSS,
              "payload_bytes": payload_bytes, "queue_packets": DEFAULT_QUEUE_PACKETS,
              "datagram_bytes": QUIC_DATAGRAM}  # fmt: skip
    load_after = os.getloadavg()
    return {
        "inputs": inputs,
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in load_after]},
        "keeps_up": keeps_up,
        "keeps_up_threshold": KEEPS_UP,
        "cells": cells,
    }


def format_quic_bench(result: dict[str, Any]) -> str:
    """The Markdown page of a ``run_quic_bench`` result (``result["machine"]`` stamped by the caller)."""
    inp, load = result["inputs"], result["load_average"]
    lines = [
        "# QUIC stacks on the emulated link (`pfec bench quic`)",
        "",
        f"Bulk transfer of {inp['payload_bytes']:,} B (the default model's KV of {inp['tokens']} tokens) on "
        f"one stream, {inp['seconds']:g} s at most, {inp['runs']} runs per cell, with the QUIC baseline's "
        f"endpoints; relay: {inp['rate_mbps']:g} Mbit/s each way, RTT {inp['rtt_ms']:g} ms, "
        f"{inp['queue_packets']}-datagram drop-tail queues; relay-ge adds {inp['loss_ge']} forward; "
        f"loopback: no emulator. Machine: {result.get('machine', {}).get('cpu', '?')}, "
        f"{result.get('machine', {}).get('cores', '?')} cores; load average {load['before']} before, "
        f"{load['after']} after.",
        "",
        "| stack | path | goodput Mbit/s mean [min, max] | of the link | busiest endpoint CPU share | "
        "CPU ms/MB sender / receiver | cores at the link rate | complete | final cwnd B | srtt ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        cwnd = [r["cwnd_bytes"] for r in c["runs"] if r["cwnd_bytes"] is not None]
        srtt = [r["srtt_ms"] for r in c["runs"] if r["srtt_ms"] is not None]
        share = "-" if c["goodput_of_link"] is None else f"{c['goodput_of_link']:.0%}"
        lines.append(
            f"| {c['stack_version']} | {c['path']} | {c['goodput_mbps_mean']:.1f} "
            f"[{c['goodput_mbps_min']:.1f}, {c['goodput_mbps_max']:.1f}] | {share} | "
            f"{c['busiest_endpoint_cpu_share_mean']:.2f} | {c['sender_cpu_ms_per_mb_mean']} / "
            f"{c['receiver_cpu_ms_per_mb_mean']} | {c['endpoint_cores_at_link_rate']:.2f} | "
            f"{c['completed_runs']}/{len(c['runs'])} | {' / '.join(f'{w:.0f}' for w in cwnd)} | "
            f"{' / '.join(f'{s:.0f}' for s in srtt)} |"
        )
    verdict = ", ".join(f"{s}: {'yes' if ok else 'no'}" for s, ok in result["keeps_up"].items())
    lines += ["", f"Keeps up (lossless relay goodput >= {result['keeps_up_threshold']:.0%} of the link): "
              f"{verdict}. CPU share: an endpoint's CPU over the transfer's span (~1: CPU-bound; on a "
              "loaded machine a starved process waits with a low share). CPU ms/MB: each endpoint's CPU per "
              "MB delivered; cores at the link rate: what sender and receiver together would need at the "
              "relay's rate at that cost (the emulator's CPU not included).", ""]
    return "\n".join(lines)
