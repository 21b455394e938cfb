"""`pfec bench fanout`: the same context to N receivers through the fan-out relay (issue 37's figure).

Real daemons on one machine: N receiver daemons (``lab/processes.Child``) on the receiver's CPUs, the
sender daemon in this process and the fan-out relay (``pfec emulate`` with a ``--forward-to`` per
receiver, ``lab/emulator/fanout.py``) in a process of its own, both on the sender's CPUs. The uplink is
``rate_mbps``; receiver i's branch has its own bursty loss (Gilbert-Elliott of mean ``losses[i]``: bad
spells of ``1 / GE_LEAVE_BAD`` datagrams losing ``GE_BAD_LOSS``) and the path's one-way delay. The deadline
is ``rho`` times one stream's serialisation at ``rate_mbps``.

Per seed, each on a fresh relay with the same seed (so receiver i meets the same loss pattern each time):

- ``solo``: one handoff to receiver i alone (its relay port), for each i: its utility, TTFT and the
  uplink bytes of one handoff;
- ``unicast``: ``POST /handoffs`` with ``receivers`` (the relay's receiver ports): one preparation, a
  session per receiver on one uplink clock;
- ``multicast``: one group stream to the relay's group port (the sender's configured group), each
  member's handshake, ACKs and RESULT through its own relay port.

The uplink bytes are the relay's (``uplink.forward.bytes_in``: every datagram the sender put on the
uplink, handshakes included). Beside them the simulator's figure (``lab/sim/fanout.py``): coded and
unicast fan-out against each receiver's solo and oracle on the same losses.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

from pfec.common.model.runtime import SYNTHETIC_MODEL, load_runtime
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.lab.processes import LOOPBACK_PSK, Child, NodeCpus, node_cpu_sets, pinned
from pfec.lab.sim.channel import parse_loss_spec
from pfec.lab.sim.fanout import FanoutConfig, simulate_fanout
from pfec.lab.sim.handoff import SimConfig
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

__all__ = ["FanoutBench", "bursty_loss", "run_fanout_bench", "write_fanout_bench"]

GE_GOOD_LOSS: Final = 0.001
GE_BAD_LOSS: Final = 0.5
GE_LEAVE_BAD: Final = 0.1  # bad spells of 10 datagrams on average
TARGETS: Final = {"multicast_uplink_vs_solo_max": 1.3, "utility_vs_solo_min": 0.97, "ttft_vs_solo_max": 1.15,
                  "sim_coded_utility_vs_solo_min": 0.97}


def bursty_loss(mean: float) -> str:
    """A Gilbert-Elliott spec of long-run loss ``mean``: the good state's length sets it."""
    if not GE_GOOD_LOSS < mean < GE_BAD_LOSS:
        raise ValueError(f"a bursty loss share must be in ({GE_GOOD_LOSS}, {GE_BAD_LOSS}), got {mean!r}")
    enter_bad = (GE_LEAVE_BAD * mean - GE_LEAVE_BAD * GE_GOOD_LOSS) / (GE_BAD_LOSS - mean)
    return f"ge:{GE_GOOD_LOSS},{GE_BAD_LOSS},{enter_bad:.6f},{GE_LEAVE_BAD}"


@dataclass(frozen=True)
class FanoutBench:
    losses: tuple[float, ...] = (0.02, 0.08, 0.15)  # one per receiver
    rate_mbps: float = 100.0
    rtt_ms: float = 20.0
    rho: float = 0.8
    tokens: int = 1500
    model: str = "default"  # "synthetic": synthetic KV, no generation (no TTFT)
    seeds: int = 3
    sim_realizations: int = 10
    scheme: str = "heuristic"

    def __post_init__(self) -> None:
        if not 1 <= len(self.losses) <= 8:
            raise ValueError(f"give 1..8 receivers' losses, got {len(self.losses)}")
        for p in self.losses:
            bursty_loss(p)
        if self.seeds < 1 or self.sim_realizations < 1 or self.tokens < 16:
            raise ValueError("seeds and sim_realizations must be >= 1, tokens >= 16")

    @property
    def loss_specs(self) -> list[str]:
        return [bursty_loss(p) for p in self.losses]


class _Relay:
    """``pfec emulate`` fanning out to the receivers, in its own process on the sender's CPUs."""

    def __init__(self, cfg: FanoutBench, receivers: Sequence[tuple[str, int]], seed: int,
                 cpus: tuple[int, ...] | None) -> None:
        argv = [sys.executable, "-m", "pfec.cli.app", "emulate", "--listen", "127.0.0.1:0",
                "--rate-mbps", str(cfg.rate_mbps), "--rtt-ms", str(cfg.rtt_ms), "--seed", str(seed),
                "--stats-interval", "0", "--json"]
        for (host, port), loss in zip(receivers, cfg.loss_specs, strict=True):
            argv += ["--forward-to", f"{host}:{port}", "--loss", loss]
        pin = None if cpus is None else partial(os.sched_setaffinity, 0, cpus)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=pin)
        assert self.proc.stderr is not None
        self.group: tuple[str, int] | None = None
        self.ports: list[tuple[str, int]] = []
        end = time.monotonic() + 60
        while len(self.ports) < len(receivers) and time.monotonic() < end:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            words = line.split()
            if line.startswith("fan-out relay: group port"):
                self.group = _host_port(words[-1])
            elif line.strip().startswith("receiver port"):
                self.ports.append(_host_port(words[2]))
        if self.group is None or len(self.ports) != len(receivers):
            self.proc.kill()
            raise RuntimeError(f"the fan-out relay did not start: {self.proc.communicate()[1][-2000:]}")

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=30)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the fan-out relay failed: {err[-2000:]}")
        stats: dict[str, Any] = json.loads(out[out.index("{"):])
        return stats


def _host_port(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _context(tokens: int) -> ContextInput:
    """A deterministic prose context of about ``tokens`` tokens and a question about it."""
    rng = random.Random(37)
    words = ("river", "stone", "lamp", "orchard", "copper", "signal", "harbor", "meadow", "engine", "cedar")
    facts = [f"Item {i} is kept in the {rng.choice(words)} room, code {rng.randrange(10_000)}."
             for i in range(max(1, tokens // 14))]
    return ContextInput(context=" ".join(facts), question="Which room keeps item 3, and what is its code?")


async def _handoff(cfg: FanoutBench, identity: Any, runtime: Any, inputs: ContextInput, relay: _Relay,
                   receivers: Sequence[int], fanout: str) -> dict[str, Any]:
    """One handoff from a fresh sender daemon (no path history carried between runs)."""
    assert relay.group is not None
    group = f"{relay.group[0]}:{relay.group[1]}"  # the relay's group port plays the site's multicast
    tx = SenderDaemon(identity, LOOPBACK_PSK, runtime=runtime, rate_mbps=cfg.rate_mbps,
                      owd_ms=cfg.rtt_ms / 2, scheme=cfg.scheme, rate_control="fixed",
                      multicast_groups=[group] if fanout == "multicast" else ())
    try:
        ports = tuple(relay.ports[i] for i in receivers)
        spec = HandoffSpec(inputs, ports[0], rho=cfg.rho, scheme=cfg.scheme,
                           generate=cfg.model != SYNTHETIC_MODEL, receivers=ports if len(ports) > 1 else (),
                           fanout=fanout, group=group if fanout == "multicast" else None)
        h = tx.submit(spec)
        await asyncio.wait_for(h.done.wait(), 600)
        return h.view()
    finally:
        await tx.close()


def _row(report: dict[str, Any], relay: dict[str, Any], receivers: Sequence[int]) -> dict[str, Any]:
    entries = report.get("receivers") or [report]
    uplink = relay["uplink"]
    return {
        "outcome": report.get("outcome"),
        "uplink_bytes": uplink["forward"]["bytes_in"],
        "uplink_datagrams": uplink["forward"]["received"],
        # what each branch delivered (a solo's other branches: nothing) and lost
        "branch_delivered": [r["forward"]["delivered"] for r in relay["receivers"]],
        "branch_lost": [r["forward"]["lost"] for r in relay["receivers"]],
        "receivers": {str(i): {"recovered_utility": e.get("recovered_utility"), "ttft_s": e.get("ttft_s"),
                               "precision": e.get("precision") or e.get("received_precision"),
                               "outcome": e.get("outcome", report.get("outcome")),
                               # multicast: "group", or "unicast"/"none" after a drop, and why
                               "carried": e.get("carried"), "dropped": e.get("dropped"),
                               # when it began generating (ready, sender-done or deadline), and what the
                               # plan streamed (a solo may split; a fan-out never does)
                               "start": e.get("start"), "decoded_symbols": e.get("decoded_symbols"),
                               "plan": (report.get("planner") or {}).get("used")}
                      for i, e in zip(receivers, entries, strict=True)},
    }


def _run_seed(cfg: FanoutBench, seed: int, rx_addrs: Sequence[tuple[str, int]], cpus: NodeCpus,
              node: tuple[Any, Any, ContextInput], log: Callable[[str], None]) -> dict[str, Any]:
    n = len(cfg.losses)
    runs: list[tuple[str, Sequence[int], str]] = [(f"solo.{i}", (i,), "unicast") for i in range(n)]
    runs.append(("unicast", tuple(range(n)), "unicast"))
    runs.append(("multicast", tuple(range(n)), "multicast"))
    out: dict[str, Any] = {"seed": seed}
    for name, receivers, fanout in runs:
        relay = _Relay(cfg, rx_addrs, seed, cpus.pin("relay"))
        try:
            report = run_event_loop(_handoff(cfg, *node[:2], node[2], relay, receivers, fanout))
        finally:
            stats = relay.stop()
        out[name] = _row(report, stats, receivers)
        log(f"seed {seed} {name}: {out[name]['outcome']}, uplink {out[name]['uplink_bytes']} B")
    return out


def run_fanout_bench(cfg: FanoutBench, log: Callable[[str], None] = print) -> dict[str, Any]:
    cpus = node_cpu_sets()
    children = [Child("receiver", cpus=cpus.pin("receiver"), model=cfg.model, psk=LOOPBACK_PSK)
                for _ in cfg.losses]
    rows = []
    try:
        rx_addrs: list[tuple[str, int]] = [tuple(c.wait_ready(600)) for c in children]
        with pinned(cpus.pin("sender")):
            runtime, identity = load_runtime(cfg.model) if cfg.model != SYNTHETIC_MODEL else (
                None, synthetic_identity(DEFAULT_GEOMETRY))
            inputs = ContextInput(synthetic_tokens=cfg.tokens) if runtime is None else _context(cfg.tokens)
            for seed in range(1, cfg.seeds + 1):
                rows.append(_run_seed(cfg, seed, rx_addrs, cpus, (identity, runtime, inputs), log))
    finally:
        for c in children:
            c.stop()
    return {"inputs": {**asdict(cfg), "loss_specs": cfg.loss_specs, "cpus": cpus.to_json()},
            "targets": TARGETS, "rows": rows, "summary": _summary(cfg, rows), "sim": _sim(cfg)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _summary(cfg: FanoutBench, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per seed and receiver: unicast against solo (utility and TTFT); uplink bytes against one solo."""
    out = []
    for row in rows:
        solo_bytes = [row[f"solo.{i}"]["uplink_bytes"] for i in range(len(cfg.losses))]
        one = sum(solo_bytes) / len(solo_bytes)
        entry: dict[str, Any] = {"seed": row["seed"], "solo_uplink_bytes_mean": one,
                                 "unicast_uplink_vs_solo": _ratio(row["unicast"]["uplink_bytes"], one),
                                 "multicast_uplink_vs_solo": _ratio(row["multicast"]["uplink_bytes"], one),
                                 "receivers": []}
        for i in range(len(cfg.losses)):
            solo = row[f"solo.{i}"]["receivers"][str(i)]
            uni = row["unicast"]["receivers"][str(i)]
            multi = row["multicast"]["receivers"][str(i)]
            entry["receivers"].append({
                "loss": cfg.losses[i], "solo_utility": solo["recovered_utility"],
                "unicast_utility_vs_solo": _ratio(uni["recovered_utility"], solo["recovered_utility"]),
                "unicast_ttft_vs_solo": _ratio(uni["ttft_s"], solo["ttft_s"]),
                "multicast_utility_vs_solo": _ratio(multi["recovered_utility"], solo["recovered_utility"]),
                "multicast_ttft_vs_solo": _ratio(multi["ttft_s"], solo["ttft_s"])})
        out.append(entry)
    return {"per_seed": out}


def _sim(cfg: FanoutBench) -> dict[str, Any]:
    """The simulator's figure on the same link and losses (synthetic-profile-free: the shipped profile)."""
    from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile  # deferred: only the figure's

    losses = tuple(parse_loss_spec(s) for s in cfg.loss_specs)
    base = SimConfig(loss=losses[0], rate_mbps=cfg.rate_mbps, rtt_ms=cfg.rtt_ms, rho=cfg.rho,
                     tokens=cfg.tokens, repair_budget=None, profile=UtilityProfile.load(SHIPPED_PROFILE))
    result = simulate_fanout(FanoutConfig(base, losses, cfg.scheme), ("coded", "unicast"),
                             cfg.sim_realizations)
    solo = [r["recovered_utility_mean"] for r in result["schemes"]["solo"]["receivers"]]
    result["coded_vs_solo"] = [_ratio(r["recovered_utility_mean"], s) for r, s
                               in zip(result["schemes"]["coded"]["receivers"], solo, strict=True)]
    result["unicast_vs_solo"] = [_ratio(r["recovered_utility_mean"], s) for r, s
                                 in zip(result["schemes"]["unicast"]["receivers"], solo, strict=True)]
    return result


def write_fanout_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fanout.json").write_text(json.dumps(result, indent=2) + "\n")
    inp = result["inputs"]
    lines = [
        "# Fan-out: one context to several receivers (`pfec bench fanout`)", "",
        f"Real daemons through the fan-out relay ({inp['rate_mbps']:g} Mbit/s uplink, "
        f"RTT {inp['rtt_ms']:g} ms, "
        f"bursty losses {', '.join(f'{p:.0%}' for p in inp['losses'])}), model {inp['model']}, "
        f"{inp['tokens']} tokens, deadline rho {inp['rho']:g} of one stream's serialisation; "
        f"{result['machine'].get('cpu', '')}.", "",
        "| seed | carriage | uplink bytes | vs one solo | " + " | ".join(
            f"r{i} utility (solo) | r{i} TTFT s (solo)" for i in range(len(inp["losses"]))) + " |",
        "|---|---|---|---|" + "---|---|" * len(inp["losses"]),
    ]
    for row, summ in zip(result["rows"], result["summary"]["per_seed"], strict=True):
        for carriage in ("unicast", "multicast"):
            cells = []
            for i in range(len(inp["losses"])):
                got, solo = row[carriage]["receivers"][str(i)], row[f"solo.{i}"]["receivers"][str(i)]
                dropped = f" dropped: {got['dropped']}," if got.get("dropped") else ""
                cells.append(f"{_fmt(got['recovered_utility'])}{dropped} "
                             f"({_fmt(solo['recovered_utility'])}) | "
                             f"{_fmt(got['ttft_s'])} {got.get('start') or ''} "
                             f"({_fmt(solo['ttft_s'])} {solo.get('start') or ''})")
            lines.append(f"| {row['seed']} | {carriage} | {row[carriage]['uplink_bytes']} | "
                         f"{_fmt(summ[f'{carriage}_uplink_vs_solo'])} | " + " | ".join(cells) + " |")
    lines += ["", "Each TTFT says when that receiver began generating: ready (all it needed had arrived), "
              "sender-done, or deadline. A solo handoff is planned for its own link and may split (the "
              "receiver computes the front; `plan` in the JSON); a fan-out streams the whole context at one "
              "plan for the group."]
    sim = result["sim"]
    lines += ["", f"Simulator ({sim['inputs']['realizations']} realizations, same link and losses): "
              "recovered utility per receiver.", "", "| scheme | uplink datagrams | " + " | ".join(
                  f"r{i}" for i in range(len(inp["losses"]))) + " |",
              "|---|---|" + "---|" * len(inp["losses"])]
    for name, row in sim["schemes"].items():
        up = row.get("uplink_datagrams_mean")
        lines.append(f"| {name} | {'-' if up is None else f'{up:.0f}'} | " + " | ".join(
            f"{r['recovered_utility_mean']:.4f}" for r in row["receivers"]) + " |")
    lines += ["", f"Coded vs each solo: {sim['coded_vs_solo']}; unicast vs each solo: "
              f"{sim['unicast_vs_solo']}. Targets: {json.dumps(result['targets'])}.", ""]
    (out_dir / "fanout.md").write_text("\n".join(lines))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
