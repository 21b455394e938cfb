"""Reliable-transport baselines: the handoff over real kernel TCP and real QUIC (qh3), emulated link.

The payload is the simulator's (``pfec.lab.sim.handoff.prepare``): the same fragments, block utilities,
deadline and bytes. The fragments go out as ONE in-order byte stream, in one of two orders
(``RELIABLE_SCHEMES``):

* ``tcp`` / ``quic``: the cache's natural (layer-major) order, as the paper's TCP/QUIC baselines send it;
* ``priority-tcp`` / ``priority-quic``: utility order (best blocks first), ours: the best case for an
  in-order reliable stream, since whatever prefix arrives by the deadline holds the most useful blocks.

* TCP: a kernel TCP connection between two network namespaces joined by the emulator's TUN front end
  (``emulator_netns.TunBridge``, root only). The congestion control is the kernel's default unless
  ``congestion_control`` names one the kernel offers (``cubic``, ``bbr``: see
  ``available_congestion_controls``); the sender reads the one its socket actually got (``TCP_CONGESTION``).
  Emulated sizes are whole IP packets.
* QUIC: a client and server of one QUIC stack (``QUIC_STACKS``: qh3 by default, an aioquic fork with a
  native packet core that keeps up with a 100 Mbit/s link here; aioquic, pure Python, on request) on
  loopback through the emulator's ``UdpRelay`` (relay mode, no privileges), one bidirectional stream, a CA
  and server certificate made at run time (the client verifies it). The stack's own congestion control
  (neither offers BBR); ``max_datagram_size`` 1400 B, the simulator's datagram size, no path-MTU probing.
  Emulated sizes are UDP payloads (as in the simulator's slot model).

The link: ``rate_mbps`` per direction, one-way delay RTT/2 each way, the config's loss model on the forward
direction with the simulator's seed convention (``realization_rng(seed, r, "forward")``: the k-th packet
crossing the forward link is lost when the simulator's k-th data datagram would be); the reverse direction
is lossless unless ``config.reverse_loss`` is set. With ``config.rate_trace`` the forward rate follows the
trace behind its drop-tail bottleneck (``config.queue_bytes``), as in the simulator. Each realization gets
a fresh emulator (and, for TCP, fresh namespaces, so no cached TCP metrics carry over between realizations).

Deadline clock: t0 is the instant the client starts the connection (TCP: ``connect()``, which sends the SYN;
QUIC: the first Initial packet) — the simulator's "first transmission". The handshake is paid INSIDE the
budget, as a real handoff would. Both endpoints run on this host and stamp events with CLOCK_MONOTONIC
(shared by all network namespaces), so the receiver's byte arrivals are compared with t0 + D directly. The
receiver stamps each read in user space, so scheduling delay of the receiver process counts against the
transport (a conservative bias). Recovered utility = sum of U_b over blocks whose every fragment lies
inside the in-order byte prefix received by t0 + D (utilities sum to 1, as in ``pfec.lab.sim.simulate``).

The endpoints are subprocesses (``endpoints``, light imports; one run of a pair: ``runs``) so that the
emulator, sender and receiver do not share one interpreter lock; the emulator runs in the calling process on
uvloop. This module is the driver: it prepares the payload, runs each realization through a fresh emulator,
scores the in-order prefix and summarises the runs like ``lab.sim.simulate.report``. Runs whose handshake
stalled (longer than ``HANDSHAKE_STALL_MS``, the initial retransmission timeout of a lost SYN or Initial,
or never done by the deadline) stay in every mean and are listed under ``outliers``, with the median
beside the mean.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np

from pfec.common.node.eventloop import run_event_loop
from pfec.lab.baselines.endpoints import QUIC_STACKS
from pfec.lab.baselines.runs import (
    DEFAULT_QUEUE_PACKETS,
    emulator_config,
    len_payload,
    quic_run,
    run_certificates,
    tcp_run,
)
from pfec.lab.emulator.netns import netns_available
from pfec.lab.reporting.stats import mean_ci95_fields
from pfec.lab.sim.rate_trace import RateTrace, queue_limit_bytes
from pfec.lab.sim.simulate import Handoff, SimConfig, prepare, report

__all__ = [
    "DEFAULT_QUIC_STACK",
    "HANDSHAKE_STALL_MS",
    "PROTOCOLS",
    "QUIC_STACKS",
    "RELIABLE_SCHEMES",
    "PrefixScore",
    "ReliableRun",
    "ReliableScheme",
    "available_congestion_controls",
    "netns_available",  # whether the TCP runs can make their namespaces here (lab/emulator/netns.py)
    "run_reliable",
    "score_prefix",
]

Proto = Literal["tcp", "quic"]
StreamOrder = Literal["natural", "utility"]
PROTOCOLS: Final = ("tcp", "quic")
# A handshake slower than this lost its SYN (Linux's initial RTO, RFC 6298 (2.1): 1 s) or its QUIC Initial
# (RFC 9002's first PTO from a 333 ms initial RTT is about 1 s): a stall, reported as an outlier.
HANDSHAKE_STALL_MS: Final = 1000.0
DEFAULT_QUIC_STACK: Final = QUIC_STACKS[0]
_CONGESTION_FILE: Final = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")


@dataclass(frozen=True)
class ReliableScheme:
    """A real-transport baseline: the protocol, the stream's order, and what it stands for."""

    name: str
    protocol: Proto
    order: StreamOrder
    paper_baseline: bool
    definition: str  # QUIC: says "{stack}", the QUIC stack a run names (``describe``)

    def describe(self, quic_stack: str = "") -> str:
        """The definition, naming the QUIC stack (``DEFAULT_QUIC_STACK`` when not given)."""
        return self.definition.format(stack=quic_stack or DEFAULT_QUIC_STACK)

    @property
    def queue_order(self) -> str:
        """The name ``lab.sim.handoff.Handoff.queue`` knows this order by (natural order is its ``fifo``)."""
        return "fifo" if self.order == "natural" else "utility"


_PAPER = "the paper's {} baseline: {} carrying the cache in its natural (layer-major) order"
_OURS = "not the paper's (ours, stronger): {} carrying the cache in utility order"
RELIABLE_SCHEMES: Final[dict[str, ReliableScheme]] = {
    "tcp": ReliableScheme("tcp", "tcp", "natural", True, _PAPER.format("TCP", "kernel TCP")),
    "quic": ReliableScheme("quic", "quic", "natural", True, _PAPER.format("QUIC", "QUIC ({stack})")),
    "priority-tcp": ReliableScheme("priority-tcp", "tcp", "utility", False, _OURS.format("kernel TCP")),
    "priority-quic": ReliableScheme("priority-quic", "quic", "utility", False,
                                    _OURS.format("QUIC ({stack})")),
}


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class PrefixScore:
    utility: float  # sum of U_b over blocks entirely inside the prefix (utilities sum to 1)
    fragments: int  # whole fragments inside the prefix
    blocks: int


def _queue_name(order: StreamOrder) -> str:
    if order not in ("natural", "utility"):
        raise ValueError(f"stream order {order!r}: use 'natural' or 'utility'")
    return "fifo" if order == "natural" else "utility"


def score_prefix(handoff: Handoff, prefix_bytes: int, order: StreamOrder = "utility") -> PrefixScore:
    """Score an in-order prefix of the stream in ``order`` as ``lab.sim.simulate`` scores decoded symbols."""
    if prefix_bytes < 0:
        raise ValueError(f"prefix_bytes must be >= 0, got {prefix_bytes!r}")
    plan = handoff.plan
    queue = handoff.queue(_queue_name(order))
    whole = min(prefix_bytes // plan.symbol_size, len(queue))
    got = np.zeros(plan.n_fragments, dtype=np.int8)
    got[queue[:whole]] = 1
    complete = np.minimum.reduceat(got, plan.first_fragment[:-1]).astype(bool)
    return PrefixScore(float(handoff.block_utility[complete].sum()), int(whole), int(complete.sum()))


def stream_bytes(handoff: Handoff, order: StreamOrder = "utility") -> bytes:
    """The byte stream both transports carry: the fragments in ``order``, back to back."""
    name = _queue_name(order)
    handoff.queue(name)
    return handoff.ordered_payload[name].tobytes()


def bytes_by(trace: list[list[float]], instant: float) -> int:
    """In-order bytes received by ``instant`` from a receiver trace of [time, cumulative bytes] rows."""
    got = 0
    for t, cum in trace:
        if t > instant:
            break
        got = int(cum)
    return got


# --------------------------------------------------------------------------- orchestration


@dataclass
class ReliableRun:
    realization: int
    in_order_bytes: int  # by the deadline
    utility: float
    fragments: int
    blocks: int
    handshake_ms: float  # t0 -> connection usable at the sender
    completion_ms: float | None  # t0 -> last byte, when the whole stream arrived (even after the deadline)
    link_rate_achieved_mbps: float
    forward_packets: int
    forward_lost: int
    forward_queue_dropped: int
    sender_cpu_s: float  # endpoint process CPU over its whole life (includes reading the payload file)
    receiver_cpu_s: float
    emulator_cpu_s: float
    congestion_control: str
    intact: bool  # the bytes received equal the payload's prefix
    sender_state: dict[str, float]  # QUIC: the stack's final congestion window and smoothed RTT (, losses)
    sender_cpu_share: float  # the sender's CPU from "go" to its end over that span: ~1 means CPU-bound

    @property
    def stall(self) -> str | None:
        """Why this run is an outlier (a stalled handshake), or None."""
        if not math.isfinite(self.handshake_ms):  # never connected
            return "no connection by the deadline (handshake lost)"
        if self.handshake_ms > HANDSHAKE_STALL_MS:
            return f"handshake {self.handshake_ms:.0f} ms > {HANDSHAKE_STALL_MS:.0f} ms (lost SYN or Initial)"
        return None


def _summarise(
    handoff: Handoff,
    order: StreamOrder,
    realization: int,
    sent: dict[str, Any],
    received: dict[str, Any],
    stats: dict[str, Any],
    cpu_s: float,
) -> ReliableRun:
    trace: list[list[float]] = received["trace"]
    t0 = float(sent["t0"])
    prefix = bytes_by(trace, t0 + handoff.deadline_s)
    score = score_prefix(handoff, prefix, order)
    fwd = stats["forward"]
    complete = received["bytes"] == len_payload(handoff)
    return ReliableRun(
        realization=realization,
        in_order_bytes=prefix,
        utility=score.utility,
        fragments=score.fragments,
        blocks=score.blocks,
        handshake_ms=(float(sent["connected"]) - t0) * 1000,
        completion_ms=(trace[-1][0] - t0) * 1000 if complete and trace else None,
        link_rate_achieved_mbps=_link_rate(trace, fwd),
        forward_packets=int(fwd["received"]),
        forward_lost=int(fwd["lost"]),
        forward_queue_dropped=int(fwd["queue_dropped"]),
        sender_cpu_s=float(sent["cpu_s"]),
        receiver_cpu_s=float(received["cpu_s"]),
        emulator_cpu_s=cpu_s,
        congestion_control=str(sent["congestion_control"]),
        intact=bool(received["intact"]),
        sender_state={k: float(sent[k]) for k in _SENDER_STATE if k in sent},
        sender_cpu_share=_cpu_share(sent),
    )


_SENDER_STATE: Final = ("cwnd_bytes", "srtt_ms", "lost_packets", "ptos")


def _cpu_share(sent: dict[str, Any]) -> float:
    """The sender's CPU from "go" (``ready_cpu_s``) to its result line, over t0 -> that line's instant."""
    span = float(sent.get("ended", math.nan)) - float(sent["t0"])
    cpu = float(sent["cpu_s"]) - float(sent.get("ready_cpu_s", 0.0))
    return cpu / span if span > 0 else math.nan


def _link_rate(trace: list[list[float]], fwd: dict[str, Any]) -> float:
    """Forward link occupancy while data flowed: emulated bytes (delivered + lost) over the receive span.

    Without loss and with a sender that always has data queued this should equal the configured rate; a
    lower value means the transport left the link idle or the user-space emulator could not keep up.
    """
    if len(trace) < 2 or not fwd["delivered"]:
        return 0.0
    span = trace[-1][0] - trace[0][0]
    wire = fwd["bytes_out"] * (fwd["delivered"] + fwd["lost"]) / fwd["delivered"]
    return float(wire * 8 / span / 1e6) if span > 0 else 0.0


def available_congestion_controls() -> tuple[str, ...]:
    """The TCP congestion controls this kernel offers (empty when it does not say)."""
    try:
        return tuple(_CONGESTION_FILE.read_text().split())
    except OSError:
        return ()


def _check_scheme(name: str, congestion_control: str | None) -> ReliableScheme:
    if name not in RELIABLE_SCHEMES:
        raise ValueError(f"protocol {name!r}: use 'tcp' or 'quic' ({', '.join(RELIABLE_SCHEMES)})")
    scheme = RELIABLE_SCHEMES[name]
    if scheme.protocol == "tcp":
        ok, why = netns_available()
        if not ok:
            raise OSError(f"the tcp baseline runs kernel TCP between two network namespaces: {why}")
        offered = available_congestion_controls()
        if congestion_control is not None and congestion_control not in offered:
            raise ValueError(f"congestion control {congestion_control!r} is not offered by this kernel "
                             f"(available: {', '.join(offered) or 'unknown'})")  # fmt: skip
    elif congestion_control is not None:
        raise ValueError(f"congestion_control applies to kernel TCP only, not to {name!r} (QUIC: its stack's "
                         "own)")
    return scheme


def run_reliable(
    protocol: str,
    config: SimConfig,
    realizations: int,
    progress: Callable[[int, int], None] | None = None,
    congestion_control: str | None = None,
    quic_stack: str = DEFAULT_QUIC_STACK,
    queue_packets: int = DEFAULT_QUEUE_PACKETS,
    traces: Sequence[RateTrace] | None = None,
) -> dict[str, Any]:
    """Carry the simulator's payload over real TCP or QUIC ``realizations`` times; a simulate()-like report.

    ``protocol`` is a ``RELIABLE_SCHEMES`` name (tcp, quic: natural order; priority-tcp, priority-quic:
    utility order); the report's scheme key is that name. ``congestion_control`` (TCP only): one of
    ``available_congestion_controls()``, else the kernel's default. ``quic_stack`` (QUIC only): one of
    ``QUIC_STACKS``. The emulated link is ``config``'s: ``rate_mbps`` each way behind drop-tail queues of
    ``queue_packets`` datagrams, or with ``config.rate_trace`` a forward bottleneck following the trace
    (``config.queue_bytes`` deep) and the reverse at ``rate_mbps``; the deadline is ``config``'s (rho of the
    serialisation time at ``rate_mbps``). ``traces``: realization r's forward trace instead (one per
    realization; the eval's trace cells meet a trace from a start of its own per realization).
    Raises ValueError for a bad protocol, count, congestion control or stack, OSError when TCP cannot create
    namespaces (not root).
    """
    scheme = _check_scheme(protocol, congestion_control)
    if quic_stack not in QUIC_STACKS:
        raise ValueError(f"QUIC stack {quic_stack!r}: use one of {', '.join(QUIC_STACKS)}")
    proto = scheme.protocol
    if isinstance(realizations, bool) or not isinstance(realizations, int) or realizations < 1:
        raise ValueError(f"realizations must be an int >= 1, got {realizations!r}")
    if traces is not None and len(traces) != realizations:
        raise ValueError(f"give one trace per realization ({len(traces)} for {realizations} realizations)")
    emulator_config(config, 0, queue_packets)  # a bad queue depth fails here, before any run
    handoff = prepare(config)
    runs: list[ReliableRun] = []
    with tempfile.TemporaryDirectory(prefix="pfec-reliable-") as tmp:
        payload_path = os.path.join(tmp, "payload.bin")
        Path(payload_path).write_bytes(stream_bytes(handoff, scheme.order))
        os.chmod(tmp, 0o755)  # the namespaced endpoints run as the same user; keep it readable anyway
        certs = run_certificates(tmp) if proto == "quic" else ("", "", "")
        for r in range(realizations):
            cpu0 = time.process_time()
            run_config = config if traces is None else dataclasses.replace(config, rate_trace=traces[r])
            link = emulator_config(run_config, r, queue_packets)
            once = (
                tcp_run(handoff, payload_path, link, congestion_control)
                if proto == "tcp"
                else quic_run(handoff, payload_path, link, certs, quic_stack)
            )
            sent, received, stats = run_event_loop(once)
            cpu_s = time.process_time() - cpu0
            runs.append(_summarise(handoff, scheme.order, r, sent, received, stats, cpu_s))
            if progress is not None:
                progress(r + 1, realizations)
    out = report(handoff, {})
    out["inputs"]["realizations"] = realizations
    out["schemes"][scheme.name] = _aggregate(handoff, scheme, runs, quic_stack if proto == "quic" else "")
    return out


def _nanmean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _aggregate(
    handoff: Handoff, scheme: ReliableScheme, runs: list[ReliableRun], quic_stack: str = ""
) -> dict[str, Any]:
    n_source = handoff.plan.n_fragments
    proto = scheme.protocol
    completions = [r.completion_ms for r in runs if r.completion_ms is not None]
    handshakes = [r.handshake_ms for r in runs if math.isfinite(r.handshake_ms)]
    outliers = [
        {"realization": r.realization, "why": r.stall, "handshake_ms": r.handshake_ms, "utility": r.utility}
        for r in runs
        if r.stall is not None
    ]
    return {
        **mean_ci95_fields("recovered_utility", [r.utility for r in runs]),
        "recovered_utility_median": float(np.median([r.utility for r in runs])),
        "recovered_utility_runs": [r.utility for r in runs],
        **mean_ci95_fields("recovered_symbol_fraction", [r.fragments / n_source for r in runs]),
        "blocks_recovered_mean": float(np.mean([r.blocks for r in runs])),
        "in_order_bytes_mean": float(np.mean([r.in_order_bytes for r in runs])),
        "payload_bytes": len_payload(handoff),
        "forward_lost_mean": float(np.mean([r.forward_lost for r in runs])),
        "forward_packets_mean": float(np.mean([r.forward_packets for r in runs])),
        "handshake_ms_mean": float(np.mean(handshakes)) if handshakes else None,
        "handshake_ms_max": float(np.max(handshakes)) if handshakes else None,
        "outliers": outliers,  # kept in every mean above; listed so a stall is seen, not hidden
        "outlier_runs": len(outliers),
        "completed_runs": len(completions),
        "completion_ms_mean": float(np.mean(completions)) if completions else None,
        "link_rate_achieved_mbps": float(np.mean([r.link_rate_achieved_mbps for r in runs])),
        "link_rate_mbps": handoff.config.rate_mbps,
        "rate_trace": _trace_fields(handoff.config),
        "emulator_cpu_s_mean": float(np.mean([r.emulator_cpu_s for r in runs])),
        "sender_cpu_s_mean": float(np.mean([r.sender_cpu_s for r in runs])),
        "sender_cpu_share_mean": _nanmean([r.sender_cpu_share for r in runs]),
        "receiver_cpu_s_mean": _nanmean([r.receiver_cpu_s for r in runs]),
        "forward_queue_dropped_mean": float(np.mean([r.forward_queue_dropped for r in runs])),
        "realizations": len(runs),
        "congestion_control": sorted({r.congestion_control for r in runs}),
        "emulator_mode": "netns" if proto == "tcp" else "relay",
        "emulated_size": "IP packet" if proto == "tcp" else "UDP payload",
        "stream_order": scheme.order,
        "definition": scheme.describe(quic_stack),
        "quic_stack": quic_stack or None,
        "paper_baseline": scheme.paper_baseline,
        "deadline_clock": "from the client's connect() (handshake inside the budget)",
        "payload_intact": all(r.intact for r in runs),
        "runs": [r.__dict__ for r in runs],
    }


def _trace_fields(config: SimConfig) -> dict[str, Any] | None:
    """The forward link's rate trace (None: fixed at ``rate_mbps``): name, scale, mean rate, queue depth."""
    trace = config.rate_trace
    if trace is None:
        return None
    return {"name": trace.name, "scale": trace.scale, "mean_rate_mbps": round(trace.mean_rate_bps / 1e6, 3),
            "queue_bytes": queue_limit_bytes(trace, None, config.queue_bytes)}
