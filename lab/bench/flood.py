"""`pfec bench flood`: legitimate handoffs while a flood of datagrams without the key hits the receiver
(issue 12: cheap rejection).

The set-up is ``pfec bench transport``'s (``bench.transport``): a receiver daemon in a child process
(``processes.Child``), the sender daemon in this one, synthetic KV of the default model's plan, AEAD and
FEC on, scheme heuristic, over loopback. A third process, the flooder, sends datagrams at the receiver's
UDP port at ``rate`` per second from a pool built in :mod:`.flood_relay` (with the relay and the flooder):

* forged OFFERs (40%): the layout of a real OFFER (header, nonce, body, tag) with a random session id,
  packet number, nonce, ciphertext and tag: an attacker without the key;
* forged early data (10%): SOURCE datagrams of the early phase for random session ids (the receiver holds
  a bounded number of them, raw, in case their OFFER is late);
* junk (30%): random bytes, truncated headers, a captured datagram with another wire version;
* replays (20%): datagrams captured verbatim from a real handoff (``CaptureRelay``) to the same receiver.

Phases: an idle interval (the receiver's idle CPU), a flood of forged OFFERs alone and of the mix alone
(the receiver's CPU per rejected datagram: process CPU over the interval, idle share removed, over the
datagrams it received), then ``handoffs`` pairs of handoffs, one without and one with the mixed flood,
interleaved so that the two conditions see the same machine. Each handoff's deadline lateness (when the
receiver's deadline processing ran minus the deadline, from its RESULT: the metric bench transport
reports), recovered utility and symbol fraction; per condition the receiver's CPU, the flood rate sent and
received, and the receiver's drop counters by reason (snapshots of the receiver child). Targets (issue 12):
lateness p99 <= 5 ms with the flood, and its mean utility within the no-flood run's noise (twice the
standard deviation of one no-flood handoff; the paired difference's 95% interval is reported beside it).
The receiver endpoint's own CPU per forged OFFER (sans-IO, in this process) is reported too.

``CaptureRelay`` (:mod:`.flood_relay`: a plain UDP relay that records what the sender sent and can replay it
from its own socket, counting bytes both ways) is also what tests/security/test_security_replay_sockets.py
uses.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Final

import numpy as np

from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_RHO
from pfec.lab.bench.flood_relay import (
    MIX,
    POOL_SIZE,
    CaptureRelay,
    Flooder,
    endpoint_rejection_us,
    flood_pool,
)
from pfec.lab.bench.transport import loopback_sender, percentile, run_handoffs
from pfec.lab.processes import LOOPBACK_PSK, Child, raise_priority
from pfec.lab.reporting.stats import mean_ci95
from pfec.sender.daemon import SenderDaemon

__all__ = ["CaptureRelay", "flood_pool", "run_flood_bench", "write_flood_bench"]

IDLE_S: Final = 1.0
FLOOD_ONLY_S: Final = 3.0
SETTLE_S: Final = 0.3  # the flood reaches its rate before a handoff starts / the last one's tail is over
TARGET_LATE_P99_MS: Final = 5.0


# --------------------------------------------------------------------------- the benchmark


def run_flood_bench(rate: float = 25_000, handoffs: int = 10, tokens: int = 384,
                    rate_mbps: float = DEFAULT_RATE_MBPS, rho: float = DEFAULT_RHO,
                    seed: int = 0) -> dict[str, Any]:
    if not 1 <= rate <= 1_000_000:
        raise ValueError(f"--rate {rate!r}: must be in 1..1000000 datagrams/s")
    if not 2 <= handoffs <= 200:
        raise ValueError(f"--handoffs {handoffs!r}: must be in 2..200")
    if not 16 <= tokens <= 32768:
        raise ValueError(f"--tokens {tokens!r}: must be in 16..32768")
    if rate_mbps <= 0 or not 0 < rho <= 10:
        raise ValueError(f"--rate-mbps {rate_mbps!r} must be positive and --rho {rho!r} in (0, 10]")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    receiver = Child("receiver", model="synthetic", psk=LOOPBACK_PSK)
    try:
        address = tuple(receiver.wait_ready())
        result = run_event_loop(_bench(receiver, address, rate, handoffs, tokens, rate_mbps, rho, seed))
    finally:
        rx = receiver.stop()
    if "error" in rx:
        raise RuntimeError(f"receiver process: {rx['error']}")
    result["receiver_drops_total"] = rx.get("drops", {})
    result["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


async def _snapshot(receiver: Child) -> dict[str, Any]:
    return await asyncio.get_running_loop().run_in_executor(None, receiver.snapshot)


async def _phase(flooder: Flooder, name: str) -> dict[str, Any]:
    return await asyncio.get_running_loop().run_in_executor(None, flooder.phase, name)


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What the receiver did between snapshots ``a`` and ``b``."""
    drops = {k: v - a["drops"].get(k, 0) for k, v in b["drops"].items() if v != a["drops"].get(k, 0)}
    return {"cpu_s": b["process_cpu_s"] - a["process_cpu_s"], "wall_s": b["monotonic_s"] - a["monotonic_s"],
            "received": b["datagrams_received"] - a["datagrams_received"], "drops": drops}


def _add(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key in ("cpu_s", "wall_s", "received"):
        total[key] = total.get(key, 0) + part[key]
    drops = total.setdefault("drops", {})
    for k, v in part["drops"].items():
        drops[k] = drops.get(k, 0) + v


async def _bench(receiver: Child, address: tuple[str, int], rate: float, handoffs: int, tokens: int,
                 rate_mbps: float, rho: float, seed: int) -> dict[str, Any]:
    sender = loopback_sender(rate_mbps)
    raise_priority()  # as bench transport's sender: the flooder, not the sender, queues behind others
    # 1. A real handoff through the capture relay: the replays and the forged datagrams' templates.
    async with CaptureRelay(address) as relay:
        capture = (await run_handoffs(sender, relay.listen_address, 1, tokens, deadline_ms=None, rho=rho))[0]
    if capture.get("outcome") != "done":
        raise RuntimeError(f"the capture handoff failed: {capture.get('failure')}")
    pools = {kind: flood_pool(relay.captured, kind, seed=seed) for kind in ("forged_offer", "mix")}
    loop = asyncio.get_running_loop()
    flooder = await loop.run_in_executor(None, Flooder, address, pools, rate)
    try:
        out = await _measure(sender, receiver, flooder, address, rate, handoffs, tokens, rho)
    finally:
        await loop.run_in_executor(None, flooder.stop)
        await sender.close()
    out["inputs"].update({"rate_mbps": rate_mbps, "symbol_size": capture.get("symbol_size"),
                          "n_source": capture.get("n_source"), "deadline_ms": capture.get("deadline_ms"),
                          "capture_datagrams": len(relay.captured)})
    return out


async def _measure(sender: SenderDaemon, receiver: Child, flooder: Flooder, address: tuple[str, int],
                   rate: float, handoffs: int, tokens: int, rho: float) -> dict[str, Any]:
    # 2. Idle, then each flood alone: the receiver's CPU per rejected datagram.
    await asyncio.sleep(SETTLE_S)
    s0 = await _snapshot(receiver)
    await asyncio.sleep(IDLE_S)
    s1 = await _snapshot(receiver)
    idle = _delta(s0, s1)
    idle_cpu_rate = idle["cpu_s"] / max(1e-9, idle["wall_s"])
    flood_only: dict[str, Any] = {}
    for kind in ("forged_offer", "mix"):
        await _phase(flooder, kind)
        await asyncio.sleep(SETTLE_S)
        a = await _snapshot(receiver)
        await asyncio.sleep(FLOOD_ONLY_S)
        b = await _snapshot(receiver)
        sent = await _phase(flooder, "idle")
        d = _delta(a, b)
        rejected = sum(d["drops"].values())
        flood_only[kind] = {
            "flood_sent_per_s": sent["sent"] / max(1e-9, sent["seconds"]),
            "received_per_s": d["received"] / max(1e-9, d["wall_s"]),
            "rejected": rejected,
            "receiver_cpu_utilisation": d["cpu_s"] / max(1e-9, d["wall_s"]),
            "receiver_cpu_us_per_datagram": d["cpu_s"] / max(1, d["received"]) * 1e6,
            "receiver_cpu_us_per_datagram_idle_removed":
                max(0.0, d["cpu_s"] - idle_cpu_rate * d["wall_s"]) / max(1, d["received"]) * 1e6,
            "drops": d["drops"],
            "flood_replies": sent["replies"],
            "flood_reply_bytes": sent["reply_bytes"],
        }
        await asyncio.sleep(SETTLE_S)
    # 3. Handoff pairs, interleaved: one without the flood, one with the mixed flood.
    per: dict[str, list[dict[str, Any]]] = {"no_flood": [], "flood": []}
    rx: dict[str, dict[str, Any]] = {"no_flood": {}, "flood": {}}
    flood_counts: dict[str, float] = {"sent": 0, "seconds": 0.0, "replies": 0, "reply_bytes": 0}
    for _ in range(handoffs):
        for condition in ("no_flood", "flood"):
            if condition == "flood":
                await _phase(flooder, "mix")
                await asyncio.sleep(SETTLE_S)
            a = await _snapshot(receiver)
            report = (await run_handoffs(sender, address, 1, tokens, deadline_ms=None, rho=rho))[0]
            b = await _snapshot(receiver)
            if condition == "flood":
                counts = await _phase(flooder, "idle")
                for key in flood_counts:
                    flood_counts[key] += counts[key]
            d = _delta(a, b)
            legit = sum(report.get(k, 0) for k in ("source_sent", "repair_sent", "control_sent"))
            d["flood_received"] = max(0, d["received"] - legit)
            _add(rx[condition], d)
            rx[condition]["flood_received"] = rx[condition].get("flood_received", 0) + d["flood_received"]
            per[condition].append(report)
            await asyncio.sleep(SETTLE_S)
    endpoint_us = endpoint_rejection_us(flooder.pools["forged_offer"])
    return _summarise(per, rx, flood_counts, flood_only, idle_cpu_rate, endpoint_us, rate, handoffs, tokens,
                      rho)


def _condition(reports: list[dict[str, Any]], rx: dict[str, Any]) -> dict[str, Any]:
    done = [r for r in reports if r.get("outcome") == "done"]
    late = [float(r["deadline_late_ms"]) for r in done if r.get("deadline_late_ms") is not None]
    utility = [float(r["recovered_utility"]) for r in done if r.get("recovered_utility") is not None]
    symbols = [(r.get("decoded_symbols") or 0) / max(1, r.get("n_source", 0)) for r in done]
    # Sent by the deadline: tells a sender slowed down (fewer sent) from datagrams lost on the way in.
    sent = [r.get("source_sent", 0) / max(1, r.get("n_source", 0)) for r in done]
    u_mean, u_ci = mean_ci95(utility)
    f_mean, f_ci = mean_ci95(symbols)
    wall = max(1e-9, rx.get("wall_s", 0.0))
    return {
        "handoffs_done": len(done),
        "failures": [r.get("failure") for r in reports if r.get("outcome") != "done"][:5],
        "deadline_late_ms": late,
        "deadline_late_ms_p50": percentile(late, 50),
        "deadline_late_ms_p99": percentile(late, 99),
        "deadline_late_ms_max": max(late) if late else None,
        "recovered_utility": utility,
        "recovered_utility_mean": u_mean,
        "recovered_utility_ci95": list(u_ci),
        "recovered_utility_std": float(np.std(utility, ddof=1)) if len(utility) > 1 else 0.0,
        "recovered_symbol_fraction_mean": f_mean,
        "recovered_symbol_fraction_ci95": list(f_ci),
        "sent_symbol_fraction_mean": float(np.mean(sent)) if sent else None,
        "receiver_cpu_s": rx.get("cpu_s", 0.0),
        "receiver_cpu_utilisation": rx.get("cpu_s", 0.0) / wall,
        "receiver_datagrams_per_s": rx.get("received", 0) / wall,
        "receiver_drops": rx.get("drops", {}),
    }


def _summarise(per: dict[str, list[dict[str, Any]]], rx: dict[str, dict[str, Any]],
               flood_counts: dict[str, float], flood_only: dict[str, Any], idle_cpu_rate: float,
               endpoint_us: float, rate: float, handoffs: int, tokens: int, rho: float) -> dict[str, Any]:
    base, flood = _condition(per["no_flood"], rx["no_flood"]), _condition(per["flood"], rx["flood"])
    # Paired by position (each flood handoff ran right after its no-flood partner).
    diffs = [f - b for b, f in zip(base["recovered_utility"], flood["recovered_utility"], strict=False)]
    d_mean, d_ci = mean_ci95(diffs) if diffs else (float("nan"), (float("nan"), float("nan")))
    flood_wall = max(1e-9, rx["flood"].get("wall_s", 0.0))
    flood["flood_sent_per_s"] = flood_counts["sent"] / max(1e-9, flood_counts["seconds"])
    flood["flood_received_per_s"] = rx["flood"].get("flood_received", 0) / flood_wall
    flood["flood_replies"] = flood_counts["replies"]
    flood["flood_reply_bytes"] = flood_counts["reply_bytes"]
    late_p99 = flood["deadline_late_ms_p99"]
    noise = 2 * base["recovered_utility_std"]
    forged = flood_only["forged_offer"]
    return {
        "inputs": {"flood_rate": rate, "handoffs_per_condition": handoffs, "tokens": tokens, "rho": rho,
                   "scheme": "heuristic", "authenticate": True, "flood_mix": MIX, "pool_size": POOL_SIZE,
                   "flood_only_s": FLOOD_ONLY_S},
        "no_flood": base,
        "flood": flood,
        "utility_difference_mean": d_mean,
        "utility_difference_ci95": list(d_ci),
        "flood_only": flood_only,
        "receiver_idle_cpu_utilisation": idle_cpu_rate,
        "cpu_us_per_rejected_forged_offer": forged["receiver_cpu_us_per_datagram_idle_removed"],
        "endpoint_us_per_forged_offer": endpoint_us,
        "cpu_us_per_rejected_mix_datagram": flood_only["mix"]["receiver_cpu_us_per_datagram_idle_removed"],
        "targets": {
            "flood_rate": rate,
            "deadline_late_ms_p99": TARGET_LATE_P99_MS,
            "flood_rate_met": flood["flood_sent_per_s"] >= 0.99 * rate,  # 1%: the pacer's granularity
            "deadline_late_p99_met": late_p99 is not None and late_p99 <= TARGET_LATE_P99_MS,
            # The no-flood run's noise: its handoffs' spread (2 standard deviations of one handoff's
            # utility); the paired difference's 95% interval says whether a smaller shift is significant.
            "utility_noise": noise,
            "utility_within_noise": bool(diffs) and abs(d_mean) <= noise,
            "utility_difference_significant": bool(diffs) and not d_ci[0] <= 0.0 <= d_ci[1],
        },
    }


def write_flood_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "flood.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result.get("machine", {})
    inp = result["inputs"]
    base, flood, t = result["no_flood"], result["flood"], result["targets"]

    def f(value: Any, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    def ci(c: dict[str, Any], key: str) -> str:
        lo, hi = c[f"{key}_ci95"]
        return f"{f(c[f'{key}_mean'], '.3f')} [{f(lo, '.3f')}, {f(hi, '.3f')}]"

    def yes(ok: bool) -> str:
        return "met" if ok else "**missed**"

    drops = ", ".join(f"{k} {v:,}" for k, v in sorted(flood["receiver_drops"].items(), key=lambda kv: -kv[1]))
    fo = result["flood_only"]
    diff_lo, diff_hi = result["utility_difference_ci95"]
    lines = [
        "# Flood benchmark (`pfec bench flood`)",
        "",
        f"Sender and receiver daemons over loopback as in `pfec bench transport` (synthetic KV, AEAD + FEC, "
        f"scheme {inp['scheme']}), {inp['tokens']} tokens ({inp.get('n_source')} symbols of "
        f"{inp.get('symbol_size')} B) per handoff at {inp.get('rate_mbps', 0):g} Mbit/s, rho {inp['rho']:g} "
        f"(deadline {f(inp.get('deadline_ms'), '.0f')} ms: part of the KV arrives). "
        f"{inp['handoffs_per_condition']} handoffs per condition, interleaved (no flood, flood, ...). "
        f"The flood: a separate process at {inp['flood_rate']:,.0f} datagrams/s at the receiver's UDP port, "
        "40% forged OFFERs, 10% forged early SOURCE, 30% junk (random, truncated, another wire version), "
        f"20% replays of a captured handoff. Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"Python {m.get('python', '?')}; 1-minute load average "
        f"{result.get('load_average_1m', {}).get('before', float('nan')):.1f} before the run.",
        "",
        "| metric | no flood | flood | target |",
        "|---|---|---|---|",
        f"| deadline lateness p50 / p99 (ms) | {f(base['deadline_late_ms_p50'])} / "
        f"{f(base['deadline_late_ms_p99'])} | {f(flood['deadline_late_ms_p50'])} / "
        f"{f(flood['deadline_late_ms_p99'])} | p99 <= {t['deadline_late_ms_p99']:g} ms: "
        f"{yes(t['deadline_late_p99_met'])} |",
        f"| recovered utility, mean [95% CI] | {ci(base, 'recovered_utility')} | "
        f"{ci(flood, 'recovered_utility')} | within noise (+-{f(t['utility_noise'], '.4f')}): "
        f"{yes(t['utility_within_noise'])} |",
        f"| recovered symbol fraction | {ci(base, 'recovered_symbol_fraction')} | "
        f"{ci(flood, 'recovered_symbol_fraction')} | |",
        f"| source symbols sent by the deadline (fraction) | {f(base['sent_symbol_fraction_mean'], '.3f')} | "
        f"{f(flood['sent_symbol_fraction_mean'], '.3f')} | |",
        f"| handoffs done | {base['handoffs_done']} | {flood['handoffs_done']} | |",
        f"| receiver CPU (share of a core) | {f(base['receiver_cpu_utilisation'] * 100, '.0f')}% | "
        f"{f(flood['receiver_cpu_utilisation'] * 100, '.0f')}% | |",
        f"| flood sent / received by the receiver (datagrams/s) | - | "
        f"{f(flood['flood_sent_per_s'], ',.0f')} / {f(flood['flood_received_per_s'], ',.0f')} | "
        f">= {inp['flood_rate']:,.0f} (-1%): {yes(t['flood_rate_met'])} |",
        "",
        f"Utility, flood minus no flood, paired: {f(result['utility_difference_mean'], '+.4f')} "
        f"[{f(diff_lo, '+.4f')}, {f(diff_hi, '+.4f')}] (95% CI; "
        f"{'a significant' if t['utility_difference_significant'] else 'no significant'} shift). The noise "
        "is twice the standard deviation of one no-flood handoff's utility. Lateness percentiles are over "
        "the handoffs of one condition (with 10, the p99 is about the maximum). The flooder shares the "
        "machine with both daemons: on few cores it also takes CPU from the sender (fewer symbols sent by "
        "the deadline), which an attacker on another machine would not.",
        "",
        f"Receiver drops during the flooded handoffs, by reason: {drops or 'none'}. The flood received is "
        "the receiver's datagram count minus what the handoff's sender sent.",
        "",
        "Receiver CPU per rejected datagram, flood alone for "
        f"{inp['flood_only_s']:g} s (process CPU minus its idle share, over the datagrams it received): "
        f"forged OFFERs {f(result['cpu_us_per_rejected_forged_offer'], '.1f')} us "
        f"(at {f(fo['forged_offer']['received_per_s'], ',.0f')} received/s, "
        f"{f(fo['forged_offer']['receiver_cpu_utilisation'] * 100, '.0f')}% of a core), the mix "
        f"{f(result['cpu_us_per_rejected_mix_datagram'], '.1f')} us (at "
        f"{f(fo['mix']['received_per_s'], ',.0f')} received/s). This is the whole receiver process (recvmsg, "
        "event-loop wake-ups, the adapter, metrics); the endpoint alone (header parse, one AES-GCM open, "
        f"the drop counter) takes {f(result['endpoint_us_per_forged_offer'], '.1f')} us per forged OFFER.",
        "",
    ]
    if result.get("notes"):
        lines += [str(result["notes"]), ""]
    (out_dir / "flood.md").write_text("\n".join(lines))
