"""`pfec bench fairness`: is a handoff a good neighbour on a shared bottleneck, and does it keep its share?

Two network namespaces joined by the TUN emulator (``lab/emulator/netns.py``, root) form one bottleneck:
``link_mbps`` each way, ``rtt_ms`` round trip, a drop-tail queue of ``queue_ms`` at the link's rate and no
random loss (every drop is the queue's: congestion, not the channel). Every endpoint is its own process in
its namespace: ``pfec receiver serve`` in B, ``pfec sender serve`` (``link.rate_control = path``, told the
link's rate) in A, and for the kernel TCP neighbour ``tcp_bulk``'s sink in B and bulk sender in A
(``TCP_CONGESTION`` set). This process runs only the emulator (niceness raised) and the control clients.
Scenarios:

- ``cubic`` / ``bbr``: the TCP bulk flow starts, runs alone for ``warmup_s``, then one handoff (synthetic
  KV of ``tokens``, scheme heuristic, repair until the deadline, ``deadline_ms``: more bytes than the link
  carries by then, so the handoff is active for its whole deadline) shares the bottleneck; the TCP flow
  keeps running for ``tail_s`` after the handoff ends.
- ``two-handoffs``: two sender daemons (two processes) start one handoff each at the same moment to one
  receiver daemon.

The emulator counts, per 100 ms bin, the bytes each flow gets through the bottleneck (``flows.FlowMeter``:
flows by transport and source port: the handoffs are the forward UDP flows, each sender session's own
ephemeral socket; TCP the busiest forward TCP flow) and the queueing delay. A flow's share is its bytes
over the link's capacity in the whole bins of the handoff's active period (its first to last data packet;
for two handoffs the overlap of both). Targets (issue 21): against CUBIC and against BBR each side keeps
>= 1/4 of the bottleneck; two concurrent handoffs each get >= 35%. Every run is quoted; nothing is best-of.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from pfec.common.node.control import ControlClient
from pfec.common.node.eventloop import run_event_loop
from pfec.lab.emulator.flows import FlowMeter
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.emulator.netns import NetnsSpec, TunBridge, setup_namespaces, teardown_namespaces
from pfec.lab.processes import raise_priority
from pfec.lab.reporting.figures import pyplot, save_figure
from pfec.lab.reporting.machine import machine_info

__all__ = ["SCENARIOS", "FairnessConfig", "run_fairness_bench", "write_fairness_bench"]

SCENARIOS: Final = ("cubic", "bbr", "two-handoffs")
TCP_SHARE_TARGET: Final = 0.25
TWO_HANDOFF_TARGET: Final = 0.35
PSK: Final = bytes(range(32))
RECEIVER_PORT: Final = 7400
PACKET_BYTES: Final = 1500  # sizing the queue in packets (the TUN's MTU)
_READY_S: Final = 60.0  # daemon start-up (numba kernels load) and endpoint ready lines
_SLACK_S: Final = 30.0  # a handoff's report may come this long after its deadline
_REPORT_KEYS: Final = ("session_id", "state", "outcome", "recovered_utility", "start", "n_source",
                       "stream_bytes", "deadline_ms", "rate_mbps", "path_rate", "error")
# The package's parent folder, for the children's PYTHONPATH (a worktree's code, not an installed copy).
_PACKAGE_PARENT: Final = Path(__file__).absolute().parents[3]


@dataclass(frozen=True)
class FairnessConfig:
    link_mbps: float = 100.0
    rtt_ms: float = 20.0
    queue_ms: float = 100.0
    bin_ms: float = 100.0
    tokens: int = 4096
    deadline_ms: float = 6000.0
    warmup_s: float = 3.0
    tail_s: float = 1.0

    def __post_init__(self) -> None:
        checks = {"link_mbps": (1.0, 1000.0), "rtt_ms": (0.0, 1000.0), "queue_ms": (1.0, 2000.0),
                  "bin_ms": (10.0, 1000.0), "deadline_ms": (200.0, 60_000.0), "warmup_s": (0.0, 60.0),
                  "tail_s": (0.0, 60.0)}
        for name, (low, high) in checks.items():
            v = getattr(self, name)
            if not (math.isfinite(v) and low <= v <= high):
                raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {v!r}")
        if not 16 <= self.tokens <= 8192:
            raise ValueError(f"tokens must be in 16..8192 (max_context_tokens), got {self.tokens!r}")

    @property
    def queue_packets(self) -> int:
        return max(8, round(self.link_mbps * 1e6 / 8 * self.queue_ms / 1000 / PACKET_BYTES))


# --------------------------------------------------------------------------- processes


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(_PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def _cpu_s(pid: int) -> float | None:
    """A live process's user + system CPU so far (``ip netns exec`` execs, so the pid is the child's)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, IndexError, ValueError):
        return None


class _Child:
    """One child process in a namespace: a daemon (``pfec ... serve``) or a ``tcp_bulk`` role."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log  # its stderr (a file: a pipe nobody drains would block a chatty daemon)

    @classmethod
    async def start(cls, name: str, ns: str, log_dir: Path, *args: str) -> _Child:
        log = log_dir / f"{name}.log"
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", ns, sys.executable, *args, env=_env(),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=err,
            )  # fmt: skip
        return cls(name, proc, log)

    async def line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with contextlib.suppress(TimeoutError):
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if raw:
                parsed: dict[str, Any] = json.loads(raw)
                return parsed
        raise RuntimeError(f"{self.name} gave no output line: {await self._stderr_tail()}")

    async def _stderr_tail(self) -> str:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 2)
        try:
            return self.log.read_bytes()[-2000:].decode(errors="replace") or "(no stderr)"
        except OSError as exc:
            return f"(stderr unreadable: {exc})"

    async def stop(self) -> float | None:
        """Terminate (SIGTERM, then SIGKILL); its CPU seconds just before."""
        cpu = _cpu_s(self.proc.pid)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        return cpu


def _write_configs(tmp: Path, spec: NetnsSpec, cfg: FairnessConfig, senders: int) -> list[Path]:
    """The receiver's config, then one per sender daemon (control sockets beside them in ``tmp``)."""
    psk = tmp / "psk"
    psk.write_text(PSK.hex() + "\n")
    psk.chmod(0o600)
    common = f'[security]\npsk_file = "{psk}"\n[metrics]\nenabled = false\n[model]\npath = "synthetic"\n'
    paths = [tmp / "receiver.toml"]
    paths[0].write_text(f'[udp]\nhost = "{spec.addr_b}"\nport = {RECEIVER_PORT}\n'
                        f'[control]\nsocket = "{tmp / "receiver.sock"}"\n' + common)
    link = (f'[link]\nrate_mbps = {cfg.link_mbps:g}\nowd_ms = {cfg.rtt_ms / 2:g}\nrate_control = "path"\n'
            '[fec]\nscheme = "heuristic"\nrepair_budget = "deadline"\n')
    for i in range(senders):
        path = tmp / f"sender{i + 1}.toml"
        path.write_text(f'[control]\nsocket = "{tmp / f"sender{i + 1}.sock"}"\n' + link + common)
        paths.append(path)
    return paths


async def _wait_for(paths: list[Path]) -> None:
    end = time.monotonic() + _READY_S
    while not all(p.exists() for p in paths):
        if time.monotonic() > end:
            raise RuntimeError(f"daemons not listening after {_READY_S:g} s: {[str(p) for p in paths]}")
        await asyncio.sleep(0.05)


async def _handoff(sock: Path, spec: NetnsSpec, cfg: FairnessConfig) -> dict[str, Any]:
    client = ControlClient(sock)
    body = {"receiver": f"{spec.addr_b}:{RECEIVER_PORT}", "synthetic_tokens": cfg.tokens,
            "deadline_ms": cfg.deadline_ms, "generate": False, "repair_budget": "deadline"}
    status, created = await client.request("POST", "/handoffs", body)
    if status != 202:
        raise RuntimeError(f"POST /handoffs: {status} {created}")
    wait = cfg.deadline_ms / 1000 + _SLACK_S
    _, report = await client.request("GET", f"/handoffs/{created['id']}?wait={wait:g}")
    return {k: report[k] for k in _REPORT_KEYS if k in report}


# --------------------------------------------------------------------------- one scenario


async def _scenario_run(name: str, cfg: FairnessConfig, spec: NetnsSpec, tmp: Path) -> dict[str, Any]:
    senders = 2 if name == "two-handoffs" else 1
    configs = _write_configs(tmp, spec, cfg, senders)
    owd = cfg.rtt_ms / 2000
    link = EmulatorConfig(DirectionSpec(cfg.link_mbps * 1e6, owd, None, queue_packets=cfg.queue_packets),
                          DirectionSpec(cfg.link_mbps * 1e6, owd))
    span_s = cfg.warmup_s + cfg.deadline_ms / 1000 + cfg.tail_s + _SLACK_S
    bins = math.ceil(span_s / (cfg.bin_ms / 1000))
    meter = FlowMeter(time.monotonic(), cfg.bin_ms / 1000, bins, owd)
    children: list[_Child] = []
    cpu: dict[str, float | None] = {}
    tcp: dict[str, Any] = {}
    async with TunBridge(link, spec, forward_tap=meter.record) as bridge:
        try:
            children.append(await _Child.start("receiver", spec.ns_b, tmp, "-m", "pfec.cli.app", "receiver",
                                               "serve", "--config", str(configs[0])))
            for i, path in enumerate(configs[1:]):
                children.append(await _Child.start(f"sender{i + 1}", spec.ns_a, tmp, "-m", "pfec.cli.app",
                                                   "sender", "serve", "--config", str(path)))
            await _wait_for([tmp / "receiver.sock", *(tmp / f"sender{i + 1}.sock" for i in range(senders))])
            meter.origin = time.monotonic()
            cpu0, wall0 = time.process_time(), meter.origin
            if name in ("cubic", "bbr"):
                await _start_tcp(name, cfg, spec, tmp, children, span_s)
                await asyncio.sleep(cfg.warmup_s)
            submitted = time.monotonic() - meter.origin
            socks = [tmp / f"sender{i + 1}.sock" for i in range(senders)]
            done = asyncio.Event()
            peers_task = asyncio.create_task(_session_ports(tmp / "receiver.sock", done))
            reports = await asyncio.gather(*(_handoff(s, spec, cfg) for s in socks))
            done.set()
            ports = await peers_task
            await asyncio.sleep(cfg.tail_s)
            emulator = _emulator_cpu(cpu0, wall0, bridge.stats())
        finally:
            for child in reversed(children):
                if child.name == "tcp-bulk" and child.proc.returncode is None:
                    tcp.update(await _stop_bulk(child))
                cpu[child.name] = await child.stop()
    for report in reports:  # which flow is whose: the receiver saw each session's source port
        report["source_port"] = ports.get(str(report.get("session_id")))
    return _summarise(name, cfg, meter, list(reports), submitted, {**emulator, "children_cpu_s": cpu}, tcp)


async def _session_ports(sock: Path, done: asyncio.Event) -> dict[str, int]:
    """Session id -> the sender's UDP source port, from the receiver's live sessions (polled until the
    handoffs are ``done``: a session leaves the list when it ends)."""
    ports: dict[str, int] = {}
    client = ControlClient(sock)
    while not done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.2)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            _, body = await client.request("GET", "/sessions")
            for view in body["sessions"]:
                if view.get("peer"):
                    ports[str(view["session_id"])] = int(str(view["peer"]).rsplit(":", 1)[1])
    return ports


async def _start_tcp(congestion: str, cfg: FairnessConfig, spec: NetnsSpec, tmp: Path,
                     children: list[_Child], span_s: float) -> None:
    params = {"host": spec.addr_b, "port": 0, "duration_s": span_s}
    sink = await _Child.start("tcp-sink", spec.ns_b, tmp, "-m", "pfec.lab.pathbench.tcp_bulk", "sink",
                              json.dumps(params))
    children.append(sink)
    ready = await sink.line(_READY_S)
    bulk_params = {**params, "port": ready["port"], "congestion_control": congestion}
    children.append(await _Child.start("tcp-bulk", spec.ns_a, tmp, "-m", "pfec.lab.pathbench.tcp_bulk",
                                       "bulk", json.dumps(bulk_params)))


async def _stop_bulk(bulk: _Child) -> dict[str, Any]:
    """SIGINT ends the bulk sender's loop; it reports what it sent and the congestion control it ran."""
    with contextlib.suppress(ProcessLookupError):
        bulk.proc.send_signal(2)
    try:
        return await bulk.line(10)
    except RuntimeError as exc:
        return {"error": str(exc)}


def _emulator_cpu(cpu0: float, wall0: float, stats: dict[str, Any]) -> dict[str, Any]:
    cpu_s = time.process_time() - cpu0
    wall_s = time.monotonic() - wall0
    packets = stats["forward"]["received"] + stats["reverse"]["received"]
    return {"emulator_cpu_s": round(cpu_s, 3), "elapsed_s": round(wall_s, 3),
            "emulator_cpu_share": round(cpu_s / wall_s, 3) if wall_s > 0 else None,
            "emulator_us_per_packet": round(cpu_s / packets * 1e6, 2) if packets else None,
            "link": stats}


# --------------------------------------------------------------------------- analysis


def _labels(name: str, meter: FlowMeter, reports: list[dict[str, Any]]) -> dict[str, str]:
    """Flow label -> the meter's flow key: handoff-i is sender daemon i's session (by the source port the
    receiver saw; failing that, the busiest UDP flows in the order their data began), TCP the busiest
    TCP flow. A missing flow maps to a key no packet has (its bytes are 0)."""

    def busiest(proto: str, n: int) -> list[str]:
        keys = sorted((k for k in meter.flows if k.startswith(proto)),
                      key=lambda k: -meter.flows[k].delivered_bytes)[:n]
        keys.sort(key=lambda k: meter.flows[k].first_data_s)
        return keys + [f"{proto}missing-{i}" for i in range(n - len(keys))]

    handoffs = busiest("udp:", len(reports))
    if all(r.get("source_port") for r in reports):
        handoffs = [f"udp:{r['source_port']}" for r in reports]
    if name == "two-handoffs":
        return {f"handoff-{i + 1}": key for i, key in enumerate(handoffs)}
    return {"handoff": handoffs[0], f"tcp-{name}": busiest("tcp:", 1)[0]}


def _window(name: str, labels: dict[str, str], meter: FlowMeter) -> tuple[int, int] | None:
    """Whole bins of the handoffs' active period (both handoffs' overlap), or None when none fits."""
    periods = [meter.active_s(key) for label, key in labels.items() if label.startswith("handoff")]
    if any(p is None for p in periods):
        return None
    first = max(p[0] for p in periods if p is not None)
    last = min(p[1] for p in periods if p is not None)
    bin_s = meter.bin_s
    start, end = math.ceil(first / bin_s), math.floor(last / bin_s)
    return (start, end) if end > start else None


def _summarise(name: str, cfg: FairnessConfig, meter: FlowMeter, reports: list[dict[str, Any]],
               submitted_s: float, processes: dict[str, Any], tcp: dict[str, Any]) -> dict[str, Any]:
    labels = _labels(name, meter, reports)
    used = max((int(np.flatnonzero(f.bytes_by_bin).max()) + 1 for f in meter.flows.values()
                if f.bytes_by_bin.any()), default=0)
    means, worst = meter.queue_delay_ms()
    window = _window(name, labels, meter)
    capacity = cfg.link_mbps * 1e6 / 8 * meter.bin_s  # bytes per bin
    shares: dict[str, float] | None = None
    window_out: dict[str, Any] | None = None
    if window is not None:
        start, end = window
        got = {label: meter.window_bytes(key, start, end) for label, key in labels.items()}
        total = sum(f.bytes_by_bin[start:end].sum() for f in meter.flows.values())
        shares = {label: round(b / ((end - start) * capacity), 4) for label, b in got.items()}
        delays = [d for d in means[start:end] if d is not None]
        window_out = {
            "t_s": [round(start * meter.bin_s, 3), round(end * meter.bin_s, 3)],
            "bins": end - start,
            "share_of_delivered": {label: round(b / total, 4) if total else None for label, b in got.items()},
            "link_utilisation": round(float(total) / ((end - start) * capacity), 4),
            "queue_delay_ms_mean_of_bins": round(float(np.mean(delays)), 3) if delays else None,
            "queue_delay_ms_p95_of_bins": round(float(np.percentile(delays, 95)), 3) if delays else None,
            "queue_delay_ms_max": max((w for w in worst[start:end] if w is not None), default=None),
        }
    target = TWO_HANDOFF_TARGET if name == "two-handoffs" else TCP_SHARE_TARGET
    return {
        "scenario": name,
        "flows": labels,
        "handoffs_submitted_s": round(submitted_s, 3),
        "active_s": {label: meter.active_s(key) for label, key in labels.items()},
        "window": window_out,
        "shares_of_link": shares,
        "target_share": target,
        "target_met": shares is not None and min(shares.values()) >= target,
        "handoffs": reports,
        "tcp": tcp or None,
        "processes": processes,
        "flow_totals": meter.totals(),
        "series": {
            "t_s": [round(k * meter.bin_s, 3) for k in range(used)],
            "mbps": {label: meter.mbps(key)[:used] for label, key in labels.items()},
            "queue_delay_ms_mean": means[:used],
            "queue_delay_ms_max": worst[:used],
            "queue_dropped_packets": [int(x) for x in meter.dropped[:used]],
        },
    }


def _scenario(name: str, cfg: FairnessConfig) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    spec = NetnsSpec(ns_a=f"pff-a-{tag}", ns_b=f"pff-b-{tag}")
    setup_namespaces(spec)
    try:
        with tempfile.TemporaryDirectory(prefix="pfec-fair-") as tmp:
            return run_event_loop(_scenario_run(name, cfg, spec, Path(tmp)))
    finally:
        teardown_namespaces(spec)


def run_fairness_bench(
    cfg: FairnessConfig,
    scenarios: tuple[str, ...] = SCENARIOS,
    repeats: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Each scenario ``repeats`` times (module doc; the scenarios interleaved, so a busy spell of the
    machine does not fall on one scenario), each run in its own pair of namespaces."""
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if not 1 <= repeats <= 20:
        raise ValueError(f"repeats must be in 1..20, got {repeats!r}")
    raise_priority()
    load_before = list(os.getloadavg())
    rows: list[dict[str, Any]] = []
    for run in range(1, repeats + 1):
        for name in scenarios:
            load = list(os.getloadavg())
            rows.append({"run": run, "load_average_before": load, **_scenario(name, cfg)})
            if progress is not None:
                progress(len(rows), repeats * len(scenarios))
    met = {name: [r["target_met"] for r in rows if r["scenario"] == name] for name in scenarios}
    return {
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
        "inputs": {
            **asdict(cfg),
            "repeats": repeats,
            "queue_packets": cfg.queue_packets,
            "loss": "none (drop-tail queue only)",
            "sender": "pfec sender serve, link.rate_control = path, told link_mbps; scheme heuristic, "
            "repair until the deadline",
            "processes": "emulator + control clients in the bench process; each daemon and TCP endpoint "
            "its own process in its namespace",
        },
        "scenarios": rows,
        "targets": {
            "tcp_neighbour_min_share": TCP_SHARE_TARGET,
            "two_handoffs_min_share": TWO_HANDOFF_TARGET,
            "met": {name: f"{sum(runs)} of {len(runs)} runs" for name, runs in met.items()},
        },
    }


# --------------------------------------------------------------------------- report


def plot_fairness(result: dict[str, Any], path: Path) -> Path:
    """Throughput per flow (top) and queueing delay (bottom) over time, one column per scenario (its first
    run)."""
    plt = pyplot()
    rows = [r for r in result["scenarios"] if r["run"] == 1]
    fig, axes = plt.subplots(2, len(rows), figsize=(5 * len(rows), 6), squeeze=False, sharex="col")
    link = result["inputs"]["link_mbps"]
    for col, r in enumerate(rows):
        top, bottom = axes[0][col], axes[1][col]
        s = r["series"]
        for label, mbps in s["mbps"].items():
            top.plot(s["t_s"], mbps, label=label, linewidth=1)
        top.axhline(link, color="grey", linewidth=0.5, linestyle=":")
        if r["window"] is not None:
            for ax in (top, bottom):
                ax.axvspan(*r["window"]["t_s"], color="grey", alpha=0.12)
        top.set_title(r["scenario"])
        top.set_ylabel("Mbit/s through the bottleneck")
        top.legend(fontsize=8, loc="upper right")
        delays = [math.nan if d is None else d for d in s["queue_delay_ms_mean"]]
        bottom.plot(s["t_s"], delays, color="black", linewidth=1, label="mean per bin")
        bottom.set_ylabel("queueing delay, ms")
        bottom.set_xlabel("time, s (shaded: the handoffs' active period)")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def _md_share(shares: dict[str, float] | None) -> str:
    return "-" if shares is None else ", ".join(f"{k} {v:.1%}" for k, v in shares.items())


def write_fairness_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fairness.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_fairness(result, out_dir / "fairness.png")
    inp, m = result["inputs"], result["machine"]
    lines = [
        "# Fair to the neighbours (`pfec bench fairness`)",
        "",
        f"Network namespaces + TUN emulator ({m.get('cpu', '')}, {m.get('cores', '?')} cores, load average "
        f"before {', '.join(f'{x:.2f}' for x in result['load_average']['before'])}): "
        f"{inp['link_mbps']:g} Mbit/s, RTT "
        f"{inp['rtt_ms']:g} ms, drop-tail queue {inp['queue_ms']:g} ms ({inp['queue_packets']} packets), "
        f"loss {inp['loss']}. Handoffs: {inp['sender']}; synthetic KV, {inp['tokens']} tokens, deadline "
        f"{inp['deadline_ms']:g} ms. Shares are of the link's capacity over the whole "
        f"{inp['bin_ms']:g} ms bins of the handoffs' active period. Every run is listed.",
        "",
        "| scenario | run | load (1 min) | shares of the link | utilisation | queue delay mean/p95/max ms "
        "| utility | start | emulator CPU | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["scenarios"]:
        w = r["window"] or {}
        utilities = ", ".join(f"{h.get('recovered_utility') or 0:.3f}" for h in r["handoffs"])
        starts = ", ".join(str(h.get("start", "-")) for h in r["handoffs"])
        delay = " / ".join("-" if w.get(k) is None else f"{w[k]:.1f}" for k in (
            "queue_delay_ms_mean_of_bins", "queue_delay_ms_p95_of_bins", "queue_delay_ms_max"))
        utilisation = "-" if "link_utilisation" not in w else f"{w['link_utilisation']:.1%}"
        lines.append(
            f"| {r['scenario']} | {r['run']} | {r['load_average_before'][0]:.2f} | "
            f"{_md_share(r['shares_of_link'])} | {utilisation} | {delay} | "
            f"{utilities} | {starts} | {r['processes']['emulator_cpu_share']:.0%} of a core | "
            f">= {r['target_share']:.0%} each: {'met' if r['target_met'] else 'NOT met'} |"
        )
    met = ", ".join(f"{name} {text}" for name, text in result["targets"]["met"].items())
    lines += ["", f"Targets met: {met}.", "",
              "![throughput and queueing delay per scenario (each scenario's first run)](fairness.png)", ""]
    (out_dir / "fairness.md").write_text("\n".join(lines))
