"""`pfec bench rate-control`: does the told rate still decide a handoff's outcome? (issue: measure the path)

Real daemons over the real relay emulator (``lab/emulator/relay.py``), two nodes on one machine as the demo
runs them (``PathBenchNodes``: the receiver in its own process on its own CPUs, the sender here and the
relay in a process of its own on the others): synthetic KV of the default model's plan (``tokens``), scheme
heuristic, the whole deadline as the repair budget, a fixed ``deadline_ms``, the paper's main
Gilbert-Elliott loss forward, ``rtt_ms``, and a drop-tail queue of ``QUEUE_MS`` at the link's rate. Per link
rate and seed: the reference (``fixed`` pacing at the link's own rate, the paper's setting told the truth),
the same paced at each wrong told rate (``fixed``: open loop), and ``link.rate_control = path`` told each
rate (the truth included). Each row gives the recovered utility, its ratio to the reference of the same
seed, the queue's drop share of what it received and its queueing-delay P95. Targets (issue 21): path rows
>= 0.93x the reference, queue drops <= 3%. Then the lossy-link rows (:mod:`.lossy_links`): 10-25% channel
loss, told the truth. Every run is quoted; nothing is best-of.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from pfec.common.model.runtime import SYNTHETIC_MODEL
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.lab.emulator.link import EmulatorConfig
from pfec.lab.pathbench.lossy_links import (
    GE_BAD_LOSS,
    GE_GOOD_LOSS,
    GE_LEAVE_BAD,
    LossyRows,
    lossy_lines,
    lossy_link,
    lossy_targets,
    run_lossy_rows,
)
from pfec.lab.processes import Child, node_cpu_sets, pinned
from pfec.lab.reporting.machine import machine_info
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

QUEUE_MS: Final = 100.0
DEFAULT_LOSSY: Final = LossyRows()
DATAGRAM_BYTES: Final = 1300  # for sizing the relay's queue in datagrams
MAIN_LOSS: Final = "ge:0.001,0.5,0.02,0.1"
PSK: Final = bytes(range(32))
UTILITY_TARGET: Final = 0.93
DROP_TARGET: Final = 0.03
NODES_DESCRIPTION: Final = ("the receiver in its own process on its CPUs; the sender, and the relay in a "
                            "process of its own, on the others")


class PathBenchNodes:
    """The two nodes of a path bench on one machine (``lab/processes.py``): a receiver daemon (synthetic KV)
    in its own process on the receiver's CPUs, started once and kept, as a node is; per handoff a sender
    daemon in this process and the relay emulator in a process of its own, both on the sender's CPUs. In one
    process and event loop the three would share one GIL and one loop's timers: how often the receiver's
    loop woke would decide how finely the relay and the pacer ran."""

    def __init__(self) -> None:
        self.cpus = node_cpu_sets()
        self._receiver = Child("receiver", cpus=self.cpus.pin("receiver"), model=SYNTHETIC_MODEL, psk=PSK)
        try:
            self._address = tuple(self._receiver.wait_ready())
        except BaseException:
            self._receiver.kill()
            raise

    def __enter__(self) -> PathBenchNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._receiver.stop()

    def handoff(self, link: EmulatorConfig, told_mbps: float, control: str, tokens: int,
                deadline_ms: float | None, rho: float | None = None,
                ) -> tuple[dict[str, Any], dict[str, Any], dict[str, float] | None]:
        """One synthetic-KV handoff (scheme heuristic, repairs until the deadline: ``deadline_ms``, or
        ``rho`` serialisation times at the told rate) from a sender daemon told ``told_mbps`` through a
        relay emulating ``link``: (the sender's report, the relay's forward counters, what the path
        controller saw sent: data bytes and the span from the first data datagram to the last; None under
        fixed pacing)."""
        relay = Child("relay", cpus=self.cpus.pin("relay"), forward_to=self._address, link=link)
        try:
            host, port = relay.wait_ready()
            with pinned(self.cpus.pin("sender")):
                report, sent = run_event_loop(_send((host, port), link.forward.owd_s, told_mbps, control,
                                                    tokens, deadline_ms, rho))
        finally:
            stats = relay.stop()
        if "forward" not in stats:
            raise RuntimeError(f"the relay process ended without its counters: {stats.get('error')}")
        return report, stats["forward"], sent


async def _send(relay: tuple[str, int], owd_s: float, told_mbps: float, control: str, tokens: int,
                deadline_ms: float | None, rho: float | None,
                ) -> tuple[dict[str, Any], dict[str, float] | None]:
    tx = SenderDaemon(synthetic_identity(DEFAULT_GEOMETRY), PSK, rate_mbps=told_mbps, owd_ms=owd_s * 1000,
                      scheme="heuristic", rate_control=control)
    try:
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=tokens), relay, rho=rho,
                                  deadline_ms=deadline_ms, generate=False))
        await asyncio.wait_for(h.done.wait(), 60 + (deadline_ms or 10_000) / 1000)
        report = h.view()
        rate = tx.links.controller(str(report.get("receiver_address")))
        sent = None
        if rate is not None and rate.sending_since is not None:  # a fresh daemon: all of it is this handoff's
            sent = {"bytes": float(rate.bytes_sent), "span_s": rate.last_sent_at - rate.sending_since}
        return report, sent
    finally:
        await tx.close()


def handoff_row(report: dict[str, Any], forward: dict[str, Any]) -> dict[str, Any]:
    """What a bench row keeps of one relayed handoff."""
    path = report.get("path_rate") or {}
    return {
        "outcome": report.get("outcome"),
        "recovered_utility": report.get("recovered_utility"),
        "start": report.get("start"),
        "queue_drop_share": forward["queue_dropped"] / max(1, forward["received"]),
        "queue_delay_ms_p95": forward["queue_delay_ms_p95"],
        "estimate_mbps": path.get("estimate_mbps"),
        "congestion_events": path.get("congestion_events"),
    }


def _handoff(
    nodes: PathBenchNodes,
    link_mbps: float,
    told_mbps: float,
    control: str,
    seed: int,
    tokens: int,
    deadline_ms: float,
    rtt_ms: float,
) -> dict[str, Any]:
    link = lossy_link(link_mbps, MAIN_LOSS, rtt_ms, queue_packets(link_mbps), seed)
    report, forward, _ = nodes.handoff(link, told_mbps, control, tokens, deadline_ms)
    return {"link_mbps": link_mbps, "told_mbps": told_mbps, "control": control, "seed": seed,
            **handoff_row(report, forward)}


def queue_packets(link_mbps: float) -> int:
    """The relay's drop-tail queue: ``QUEUE_MS`` at the link's rate, in datagrams."""
    return max(8, round(link_mbps * 1e6 / 8 * QUEUE_MS / 1000 / DATAGRAM_BYTES))


def run_rate_control_bench(
    links: Sequence[float],
    factors: Sequence[float],
    seeds: int,
    tokens: int,
    deadline_ms: float,
    rtt_ms: float,
    progress: Callable[[int, int], None] | None = None,
    lossy: LossyRows | None = DEFAULT_LOSSY,
    told_rows: bool = True,
) -> dict[str, Any]:
    """Every told-rate cell once per seed (see the module doc), then the lossy rows (``lossy``, None: none;
    :mod:`.lossy_links`); rows in the order run."""
    cells = [(link, link, "fixed") for link in links]
    cells += [(link, link * f, "fixed") for link in links for f in factors if f != 1]
    cells += [(link, link * f, "path") for link in links for f in sorted({1.0, *factors})]
    if not told_rows:
        cells = []
    rows: list[dict[str, Any]] = []
    lossy_rows: list[dict[str, Any]] = []
    total = len(cells) * seeds + (0 if lossy is None else 2 * len(lossy.cells()) * lossy.seeds)

    def step() -> None:
        if progress is not None:
            progress(len(rows) + len(lossy_rows) + 1, total)

    with PathBenchNodes() as nodes:
        for seed in range(1, seeds + 1):
            for link, told, control in cells:
                step()
                rows.append(_handoff(nodes, link, told, control, seed, tokens, deadline_ms, rtt_ms))
        if lossy is not None:
            lossy_rows = run_lossy_rows(nodes, lossy, tokens, rtt_ms, queue_packets, handoff_row, step)
    reference = {
        (r["link_mbps"], r["seed"]): r["recovered_utility"] or 0.0
        for r in rows
        if r["control"] == "fixed" and r["told_mbps"] == r["link_mbps"]
    }
    for r in rows:
        ref = reference[(r["link_mbps"], r["seed"])]
        r["utility_vs_told_truth"] = (r["recovered_utility"] or 0.0) / ref if ref else None
    path_rows = [r for r in rows if r["control"] == "path"]
    result: dict[str, Any] = {
        "machine": machine_info(),
        "inputs": {
            "links_mbps": list(links),
            "told_factors": list(factors),
            "seeds": seeds,
            "tokens": tokens,
            "deadline_ms": deadline_ms,
            "rtt_ms": rtt_ms,
            "loss": MAIN_LOSS,
            "queue_ms": QUEUE_MS,
            "scheme": "heuristic",
            "repair_budget": "deadline",
            "processes": NODES_DESCRIPTION,
        },
        "cpus": nodes.cpus.to_json(),
        "rows": rows,
        "targets": {
            "path_utility_vs_told_truth_min": min(((r["utility_vs_told_truth"] or 0.0) for r in path_rows),
                                                  default=None),
            "path_queue_drop_share_max": max((r["queue_drop_share"] for r in path_rows), default=None),
            "utility_target": UTILITY_TARGET,
            "drop_target": DROP_TARGET,
        },
    }
    if lossy is not None:
        result["lossy_inputs"] = {
            "links_mbps": list(lossy.links_mbps), "loss_percents": list(lossy.percents),
            "rhos": list(lossy.rhos), "kinds": list(lossy.kinds), "seeds": lossy.seeds, "tokens": tokens,
            "rtt_ms": rtt_ms, "queue_ms": QUEUE_MS, "ge_good_loss": GE_GOOD_LOSS, "ge_bad_loss": GE_BAD_LOSS,
            "ge_leave_bad": GE_LEAVE_BAD, "told": "the link's rate",
        }
        result["lossy_rows"] = lossy_rows
        result["lossy_targets"] = lossy_targets(lossy_rows)
    return result


def write_rate_control_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rate_control.json").write_text(json.dumps(result, indent=2) + "\n")
    inp, t = result["inputs"], result["targets"]
    lines = [
        "# Told rate against measured rate (`pfec bench rate-control`)",
        "",
        f"Real daemons through the relay emulator ({inp['processes']}; {result['machine'].get('cpu', '')}): "
        f"synthetic KV, {inp['tokens']} tokens, deadline {inp['deadline_ms']:g} ms, "
        f"RTT {inp['rtt_ms']:g} ms, "
        f"loss {inp['loss']}, drop-tail queue {inp['queue_ms']:g} ms; scheme {inp['scheme']}, repairs until "
        "the deadline. Reference: fixed pacing told the link's own rate.",
        "",
        "| link Mbit/s | told Mbit/s | control | seed | utility | vs reference | queue drops "
        "| queue delay p95 ms | estimate Mbit/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = r["utility_vs_told_truth"]
        lines.append(
            f"| {r['link_mbps']:g} | {r['told_mbps']:g} | {r['control']} | {r['seed']} | "
            f"{(r['recovered_utility'] or 0):.3f} | {'-' if ratio is None else f'{ratio:.3f}'} | "
            f"{r['queue_drop_share']:.1%} | {r['queue_delay_ms_p95'] or 0:.1f} | "
            f"{'-' if r['estimate_mbps'] is None else r['estimate_mbps']} |"
        )
    if t["path_utility_vs_told_truth_min"] is not None:
        lines += [
            "",
            f"Path rows: lowest utility vs reference {t['path_utility_vs_told_truth_min']:.3f} "
            f"(target >= {t['utility_target']}), highest queue drop share "
            f"{t['path_queue_drop_share_max']:.1%} (target <= {t['drop_target']:.0%}).",
        ]
    lines += ["", *lossy_lines(result)]
    (out_dir / "rate_control.md").write_text("\n".join(lines))
