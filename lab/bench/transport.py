"""`pfec bench transport`: the daemons' transport alone, over loopback, without link emulation.

A receiver daemon runs in a child process (its own core), the sender daemon in this one; synthetic KV
(random symbols in the default model's plan, synthetic profile: no model is loaded), FEC and AEAD on,
scheme ``heuristic``. Handoffs run back to back with a deadline (``deadline_ms``) long enough for the
whole context, so how fast it streams is the transport's business:

* ``goodput_mbps``: decoded KV bytes (source symbols x symbol size) per second of streaming, summed over
  handoffs (streaming = from the sender's start to its last data datagram);
* ``pps``: data datagrams sent per second of streaming;
* CPU per packet on each side: process CPU time (all threads) over datagrams sent (sender) / received
  (receiver), and the sessions' own codec/feedback/policy share;
* ``deadline_late_ms_p50/p99``: when the receiver's deadline callback actually ran minus the deadline.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pfec.common.codec.fec import warm_up
from pfec.common.model.runtime import load_runtime
from pfec.common.node.eventloop import run_event_loop
from pfec.lab.processes import LOOPBACK_PSK, Child, raise_priority
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput


def run_transport_bench(handoffs: int = 30, tokens: int = 384, rate_mbps: float = 1000.0,
                        deadline_ms: float = 1000.0, profile_sender: bool = False) -> dict[str, Any]:
    if handoffs < 1:
        raise ValueError(f"--handoffs {handoffs!r}: must be >= 1")
    if not 16 <= tokens <= 32768:
        raise ValueError(f"--tokens {tokens!r}: must be in 16..32768")
    if rate_mbps <= 0:
        raise ValueError(f"--rate-mbps {rate_mbps!r}: must be positive")
    if not 10 <= deadline_ms <= 60_000:
        raise ValueError(f"--deadline-ms {deadline_ms!r}: must be in 10..60000")
    load_before = os.getloadavg()[0]
    receiver = Child("receiver", model="synthetic", psk=LOOPBACK_PSK)
    try:
        address = tuple(receiver.wait_ready())
        sender = run_event_loop(
            _sender_side(address, handoffs, tokens, rate_mbps, deadline_ms, profile_sender)
        )
    finally:
        rx = receiver.stop()
    if "error" in rx:
        raise RuntimeError(f"receiver process: {rx['error']}")
    result = _summarise(sender, rx, handoffs, tokens, rate_mbps)
    # Other work on the machine takes cores from both daemons: report how busy it was.
    result["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    return result


def loopback_sender(rate_mbps: float) -> SenderDaemon:
    """The benchmarks' sender daemon: synthetic KV of the default model's plan, scheme heuristic, 1 ms
    one-way delay (loopback), the loopback key; its codec warmed up."""
    warm_up()
    _, identity = load_runtime("synthetic")
    return SenderDaemon(identity, LOOPBACK_PSK, rate_mbps=rate_mbps, owd_ms=1.0, scheme="heuristic",
                        result_wait_s=2.0, rate_control="fixed")  # the bench's offered rate, on loopback


async def run_handoffs(daemon: SenderDaemon, address: tuple[str, int], handoffs: int, tokens: int, *,
                       deadline_ms: float | None, rho: float | None = None) -> list[dict[str, Any]]:
    """``handoffs`` synthetic handoffs of ``tokens`` to ``address``, back to back; their reports."""
    reports = []
    for _ in range(handoffs):
        h = daemon.submit(HandoffSpec(ContextInput(synthetic_tokens=tokens), address, deadline_ms=deadline_ms,
                                      rho=rho, generate=False))
        await h.done.wait()
        reports.append(h.view())
        await asyncio.sleep(0.01)
    return reports


async def _sender_side(address: tuple[str, int], handoffs: int, tokens: int, rate_mbps: float,
                       deadline_ms: float, profile_sender: bool) -> dict[str, Any]:
    daemon = loopback_sender(rate_mbps)
    profiler = None
    if profile_sender:
        profiler = cProfile.Profile()
        profiler.enable()
    raise_priority()  # as the receiver child does: neither side should queue behind unrelated work
    cpu0, wall0 = time.process_time(), time.perf_counter()
    reports = await run_handoffs(daemon, address, handoffs, tokens, deadline_ms=deadline_ms)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if profiler is not None:
        profiler.disable()
        # stderr: stdout carries the command's result (`--json`)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    await daemon.close()
    return {"reports": reports, "process_cpu_s": cpu, "wall_s": wall, "deadline_ms": deadline_ms}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


def _summarise(sender: dict[str, Any], rx: dict[str, Any], handoffs: int, tokens: int,
               rate_mbps: float) -> dict[str, Any]:
    reports = sender["reports"]
    done = [r for r in reports if r.get("outcome") == "done"]
    data_sent = sum(r.get("source_sent", 0) + r.get("repair_sent", 0) for r in reports)
    all_sent = data_sent + sum(r.get("control_sent", 0) for r in reports)
    decoded = sum(r.get("decoded_symbols", 0) or 0 for r in done)
    symbol = reports[0].get("symbol_size", 0) if reports else 0
    # Streaming time per handoff: from start to the last data datagram = deadline - owd - slack.
    stream_s = sum(max(1e-9, (r["deadline_ms"] - 1.0 - r.get("deadline_slack_ms", 0.0)) / 1000) for r in done)
    late_ms = [x * 1000 for x in rx.get("deadline_late_s", [])]
    rx_received = rx.get("datagrams_received", 0)
    return {
        "inputs": {"handoffs": handoffs, "tokens": tokens, "rate_mbps": rate_mbps, "scheme": "heuristic",
                   "authenticate": True, "deadline_ms": round(sender["deadline_ms"], 3),
                   "symbol_size": symbol, "n_source": reports[0].get("n_source") if reports else None},
        "handoffs_done": len(done),
        "failures": [r.get("failure") for r in reports if r.get("outcome") != "done"][:5],
        "goodput_mbps": decoded * symbol * 8 / stream_s / 1e6 if stream_s else 0.0,
        "pps": data_sent / stream_s if stream_s else 0.0,
        "recovered_symbol_fraction": decoded / max(1, sum(r.get("n_source", 0) for r in done)),
        "sender_cpu_us_per_packet": sender["process_cpu_s"] / max(1, all_sent) * 1e6,
        "receiver_cpu_us_per_packet": rx.get("process_cpu_s", 0.0) / max(1, rx_received) * 1e6,
        "receiver_codec_us_per_packet": rx.get("codec_cpu_ns", 0) / max(1, rx_received) / 1e3,
        "sender_session_us_per_packet": {
            k: sum(r.get("session_cpu_ms", {}).get(k, 0.0) for r in reports) * 1e3 / max(1, all_sent)
            for k in ("encode", "feedback", "policy")
        },
        "sender_cpu_utilisation": sender["process_cpu_s"] / sender["wall_s"],
        "receiver_datagrams": rx_received,
        "receiver_drops": rx.get("drops", {}),
        "deadline_late_ms_p50": percentile(late_ms, 50),
        "deadline_late_ms_p99": percentile(late_ms, 99),
        "deadline_late_ms_max": max(late_ms) if late_ms else None,
        "targets": {"goodput_mbps": 500, "deadline_late_ms_p99": 5},
    }


def write_transport_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "transport.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result.get("machine", {})
    inp = result["inputs"]

    def f(key: str, fmt: str = ".1f") -> str:
        v = result.get(key)
        return "-" if v is None else format(v, fmt)

    lines = [
        "# Transport benchmark (`pfec bench transport`)",
        "",
        f"Sender and receiver daemons over loopback, no emulation, AEAD + FEC on, scheme {inp['scheme']}, "
        f"{inp['handoffs']} handoffs of {inp['tokens']} synthetic tokens ({inp['n_source']} symbols of "
        f"{inp['symbol_size']} B), pacing at {inp['rate_mbps']:g} Mbit/s. Machine: {m.get('cpu', '?')}, "
        f"{m.get('cores', '?')} cores, Python {m.get('python', '?')}; 1-minute load average "
        f"{result.get('load_average_1m', {}).get('before', float('nan')):.1f} before the run.",
        "",
        "| metric | value | target |",
        "|---|---|---|",
        f"| goodput | {f('goodput_mbps')} Mbit/s | >= 500 Mbit/s |",
        f"| data datagrams | {f('pps', ',.0f')} /s | |",
        f"| sender CPU per packet | {f('sender_cpu_us_per_packet')} us | |",
        f"| receiver CPU per packet | {f('receiver_cpu_us_per_packet')} us "
        f"(codec {f('receiver_codec_us_per_packet')} us) | |",
        f"| deadline start lateness p50 / p99 | {f('deadline_late_ms_p50', '.2f')} / "
        f"{f('deadline_late_ms_p99', '.2f')} ms | p99 <= 5 ms |",
        f"| handoffs done | {result['handoffs_done']} / {inp['handoffs']} | |",
        "",
    ]
    sess = result.get("sender_session_us_per_packet", {})
    sender_session = sum(sess.values())
    lines += [
        "Where a packet's CPU goes (us): sender "
        f"{f('sender_cpu_us_per_packet')} = session {sender_session:.1f} (ACK processing "
        f"{sess.get('feedback', 0):.1f}, scheduler {sess.get('policy', 0):.1f}, repair encode "
        f"{sess.get('encode', 0):.1f}) + AEAD seal, UDP sends (GSO batches of each pacer wake-up), metrics, "
        "pacing and per-handoff preparation; "
        f"receiver {f('receiver_cpu_us_per_packet')} = decoder + ACKs {f('receiver_codec_us_per_packet')} "
        "+ AEAD open, header parsing, recvmsg (GRO batches), metrics and the adapter. Both are single Python "
        "threads, "
        "so the rate one side sustains is about 1e6 / (its us per packet) datagrams per second when it has "
        "a core to itself.",
        "",
    ]
    if result.get("notes"):
        lines += [str(result["notes"]), ""]
    (out_dir / "transport.md").write_text("\n".join(lines))
