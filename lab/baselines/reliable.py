"""Reliable-transport baselines: the handoff over real kernel TCP and real QUIC (aioquic), emulated link.

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
* QUIC: an aioquic client and server on loopback through the emulator's ``UdpRelay`` (relay mode, no
  privileges), one bidirectional stream, a self-signed certificate made at run time (the client verifies it).
  aioquic's default congestion control; ``max_datagram_size`` 1400 B, the simulator's datagram size.
  Emulated sizes are UDP payloads (as in the simulator's slot model).

The link: ``rate_mbps`` per direction, one-way delay RTT/2 each way, the config's loss model on the forward
direction with the simulator's seed convention (``realization_rng(seed, r, "forward")``: the k-th packet
crossing the forward link is lost when the simulator's k-th data datagram would be); the reverse direction
is lossless unless ``config.reverse_loss`` is set. Each realization gets a fresh emulator (and, for TCP,
fresh namespaces, so no cached TCP metrics carry over between realizations).

Deadline clock: t0 is the instant the client starts the connection (TCP: ``connect()``, which sends the SYN;
QUIC: the first Initial packet) — the simulator's "first transmission". The handshake is paid INSIDE the
budget, as a real handoff would. Both endpoints run on this host and stamp events with CLOCK_MONOTONIC
(shared by all network namespaces), so the receiver's byte arrivals are compared with t0 + D directly. The
receiver stamps each read in user space, so scheduling delay of the receiver process counts against the
transport (a conservative bias). Recovered utility = sum of U_b over blocks whose every fragment lies
inside the in-order byte prefix received by t0 + D (utilities sum to 1, as in ``pfec.lab.sim.simulate``).

The endpoints are subprocesses (``endpoints``, light imports) so that the emulator, sender and
receiver do not share one interpreter lock; the emulator runs in the calling process on uvloop. This module
is the driver: it prepares the payload, runs each realization through a fresh emulator, scores the
in-order prefix and summarises the runs like ``lab.sim.simulate.report``. Runs whose handshake stalled (longer
than ``HANDSHAKE_STALL_MS``, the initial retransmission timeout of a lost SYN or Initial, or never done by
the deadline) stay in every mean and are listed under ``outliers``, with the median beside the mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pfec.common.node.eventloop import run_event_loop
from pfec.lab.baselines.endpoints import AFTER_DEADLINE_S, READY_TIMEOUT_S
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.emulator.netns import (
    NetnsSpec,
    TunBridge,
    netns_available,
    setup_namespaces,
    teardown_namespaces,
)
from pfec.lab.emulator.relay import UdpRelay
from pfec.lab.reporting.stats import mean_ci95_fields
from pfec.lab.sim.simulate import Handoff, SimConfig, prepare, report

__all__ = [
    "HANDSHAKE_STALL_MS",
    "PROTOCOLS",
    "RELIABLE_SCHEMES",
    "PrefixScore",
    "ReliableRun",
    "ReliableScheme",
    "available_congestion_controls",
    "run_reliable",
    "score_prefix",
]

Proto = Literal["tcp", "quic"]
StreamOrder = Literal["natural", "utility"]
PROTOCOLS: Final = ("tcp", "quic")
# A handshake slower than this lost its SYN (Linux's initial RTO, RFC 6298 (2.1): 1 s) or its QUIC Initial
# (RFC 9002's first PTO from a 333 ms initial RTT is about 1 s): a stall, reported as an outlier.
HANDSHAKE_STALL_MS: Final = 1000.0
_CONGESTION_FILE: Final = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")


@dataclass(frozen=True)
class ReliableScheme:
    """A real-transport baseline: the protocol, the stream's order, and what it stands for."""

    name: str
    protocol: Proto
    order: StreamOrder
    paper_baseline: bool
    definition: str

    @property
    def queue_order(self) -> str:
        """The name ``lab.sim.handoff.Handoff.queue`` knows this order by (natural order is its ``fifo``)."""
        return "fifo" if self.order == "natural" else "utility"


_PAPER = "the paper's {} baseline: {} carrying the cache in its natural (layer-major) order"
_OURS = "not the paper's (ours, stronger): {} carrying the cache in utility order"
RELIABLE_SCHEMES: Final[dict[str, ReliableScheme]] = {
    "tcp": ReliableScheme("tcp", "tcp", "natural", True, _PAPER.format("TCP", "kernel TCP")),
    "quic": ReliableScheme("quic", "quic", "natural", True, _PAPER.format("QUIC", "aioquic")),
    "priority-tcp": ReliableScheme("priority-tcp", "tcp", "utility", False, _OURS.format("kernel TCP")),
    "priority-quic": ReliableScheme("priority-quic", "quic", "utility", False, _OURS.format("aioquic")),
}
_REPO_ROOT: Final = Path(__file__).resolve().parents[2]
_LINE_LIMIT: Final = 64 << 20  # the receiver's result line holds one [time, bytes] row per read


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


def len_payload(handoff: Handoff) -> int:
    """Bytes of the stream: every fragment, padded to the symbol size."""
    return int(handoff.plan.n_fragments * handoff.plan.symbol_size)


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
    sender_state: dict[str, float]  # QUIC: aioquic's final congestion window and smoothed RTT

    @property
    def stall(self) -> str | None:
        """Why this run is an outlier (a stalled handshake), or None."""
        if not math.isfinite(self.handshake_ms):  # never connected
            return "no connection by the deadline (handshake lost)"
        if self.handshake_ms > HANDSHAKE_STALL_MS:
            return f"handshake {self.handshake_ms:.0f} ms > {HANDSHAKE_STALL_MS:.0f} ms (lost SYN or Initial)"
        return None


class _Endpoint:
    """One endpoint subprocess: a JSON ready line, then a JSON result line on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str) -> None:
        self.proc = proc
        self.role = role

    @classmethod
    async def start(cls, prefix: list[str], role: str, params: dict[str, Any]) -> _Endpoint:
        env = dict(os.environ, PYTHONPATH=str(_REPO_ROOT))
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "pfec.lab.baselines.endpoints", role, json.dumps(params),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=str(_REPO_ROOT), env=env, limit=_LINE_LIMIT,
        )  # fmt: skip
        return cls(proc, role)

    async def line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            raw = b""
        if not raw:
            err = b""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5.0)
            if self.proc.returncode is not None and self.proc.stderr is not None:
                err = await self.proc.stderr.read()
            raise RuntimeError(f"{self.role} endpoint gave no output: {err.decode(errors='replace')[-2000:]}")
        result: dict[str, Any] = json.loads(raw)
        return result

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


async def _exchange(
    receiver_cmd: tuple[list[str], str],
    sender_cmd: tuple[list[str], str],
    params: dict[str, Any],
    front: Callable[[int], Awaitable[dict[str, Any]]],
    deadline_s: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the receiver, point the sender at it (``front`` may remap the address), run, collect."""
    rx = await _Endpoint.start(*receiver_cmd, params)
    tx: _Endpoint | None = None
    try:
        ready = await rx.line(READY_TIMEOUT_S)
        target = await front(int(ready["port"]))
        tx = await _Endpoint.start(*sender_cmd, {**params, **target})
        await tx.line(READY_TIMEOUT_S)
        tx.go()
        limit = deadline_s + AFTER_DEADLINE_S + READY_TIMEOUT_S
        sent = await tx.line(limit)
        if not math.isfinite(float(sent.get("connected", math.nan))):
            # Not connected by the deadline (a lost SYN or Initial, or its answer): the receiver's stream
            # cannot hold a byte, and its accept would only time out. Its CPU is not measured.
            return sent, {"accepted": math.nan, "trace": [], "bytes": 0, "intact": True, "cpu_s": math.nan}
        received = await rx.line(limit)
        return sent, received
    finally:
        for ep in (tx, rx):
            if ep is not None:
                await ep.stop()


def _emulator_config(config: SimConfig, realization: int) -> EmulatorConfig:
    return EmulatorConfig(
        forward=DirectionSpec(config.rate_bps, config.owd_s, config.loss),
        reverse=DirectionSpec(config.rate_bps, config.owd_s, config.reverse_loss),
        seed=config.seed,
        realization=realization,
    )


async def _tcp_once(
    handoff: Handoff, payload_path: str, realization: int, congestion_control: str | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    tag = uuid.uuid4().hex[:6]
    spec = NetnsSpec(ns_a=f"pfr-a-{tag}", ns_b=f"pfr-b-{tag}")
    params = {
        "host": spec.addr_b,
        "port": 0,
        "payload": payload_path,
        "total": len_payload(handoff),
        "deadline_s": handoff.deadline_s,
        "congestion_control": congestion_control or "",
    }
    setup_namespaces(spec)
    try:
        async with TunBridge(_emulator_config(handoff.config, realization), spec) as bridge:

            async def same_address(port: int) -> dict[str, Any]:
                return {"port": port}

            sent, received = await _exchange(
                (["ip", "netns", "exec", spec.ns_b], "tcp-receiver"),
                (["ip", "netns", "exec", spec.ns_a], "tcp-sender"),
                params, same_address, handoff.deadline_s,
            )  # fmt: skip
            return sent, received, bridge.stats()
    finally:
        teardown_namespaces(spec)


async def _quic_once(
    handoff: Handoff, payload_path: str, realization: int, cert: tuple[str, str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    params = {
        "host": "127.0.0.1",
        "port": 0,
        "payload": payload_path,
        "total": len_payload(handoff),
        "deadline_s": handoff.deadline_s,
        "cert": cert[0],
        "key": cert[1],
    }
    relays: list[UdpRelay] = []

    async def via_relay(port: int) -> dict[str, Any]:
        relay = UdpRelay(_emulator_config(handoff.config, realization), ("127.0.0.1", 0), ("127.0.0.1", port))
        await relay.start()
        relays.append(relay)
        host, relay_port = relay.listen_address
        return {"host": host, "port": relay_port}

    try:
        sent, received = await _exchange(
            ([], "quic-receiver"), ([], "quic-sender"), params, via_relay, handoff.deadline_s
        )
        return sent, received, relays[0].stats()
    finally:
        for relay in relays:
            await relay.close()


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
        sender_state={k: float(sent[k]) for k in ("cwnd_bytes", "srtt_ms") if k in sent},
    )


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


def _self_signed(directory: str) -> tuple[str, str]:
    """A P-256 certificate for ``localhost``, made for this run only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    Path(cert_path).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(key_path).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


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
        raise ValueError(f"congestion_control applies to kernel TCP only, not to {name!r} (aioquic: fixed)")
    return scheme


def run_reliable(
    protocol: str,
    config: SimConfig,
    realizations: int,
    progress: Callable[[int, int], None] | None = None,
    congestion_control: str | None = None,
) -> dict[str, Any]:
    """Carry the simulator's payload over real TCP or QUIC ``realizations`` times; a simulate()-like report.

    ``protocol`` is a ``RELIABLE_SCHEMES`` name (tcp, quic: natural order; priority-tcp, priority-quic:
    utility order); the report's scheme key is that name. ``congestion_control`` (TCP only): one of
    ``available_congestion_controls()``, else the kernel's default.
    Raises ValueError for a bad protocol, count or congestion control, OSError when TCP cannot create
    namespaces (not root).
    """
    scheme = _check_scheme(protocol, congestion_control)
    proto = scheme.protocol
    if isinstance(realizations, bool) or not isinstance(realizations, int) or realizations < 1:
        raise ValueError(f"realizations must be an int >= 1, got {realizations!r}")
    handoff = prepare(config)
    runs: list[ReliableRun] = []
    with tempfile.TemporaryDirectory(prefix="pfec-reliable-") as tmp:
        payload_path = os.path.join(tmp, "payload.bin")
        Path(payload_path).write_bytes(stream_bytes(handoff, scheme.order))
        os.chmod(tmp, 0o755)  # the namespaced endpoints run as the same user; keep it readable anyway
        cert = _self_signed(tmp) if proto == "quic" else ("", "")
        for r in range(realizations):
            cpu0 = time.process_time()
            once = (
                _tcp_once(handoff, payload_path, r, congestion_control)
                if proto == "tcp"
                else _quic_once(handoff, payload_path, r, cert)
            )
            sent, received, stats = run_event_loop(once)
            cpu_s = time.process_time() - cpu0
            runs.append(_summarise(handoff, scheme.order, r, sent, received, stats, cpu_s))
            if progress is not None:
                progress(r + 1, realizations)
    out = report(handoff, {})
    out["inputs"]["realizations"] = realizations
    out["schemes"][scheme.name] = _aggregate(handoff, scheme, runs)
    return out


def _nanmean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _aggregate(handoff: Handoff, scheme: ReliableScheme, runs: list[ReliableRun]) -> dict[str, Any]:
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
        "emulator_cpu_s_mean": float(np.mean([r.emulator_cpu_s for r in runs])),
        "sender_cpu_s_mean": float(np.mean([r.sender_cpu_s for r in runs])),
        "receiver_cpu_s_mean": _nanmean([r.receiver_cpu_s for r in runs]),
        "forward_queue_dropped_mean": float(np.mean([r.forward_queue_dropped for r in runs])),
        "realizations": len(runs),
        "congestion_control": sorted({r.congestion_control for r in runs}),
        "emulator_mode": "netns" if proto == "tcp" else "relay",
        "emulated_size": "IP packet" if proto == "tcp" else "UDP payload",
        "stream_order": scheme.order,
        "definition": scheme.definition,
        "paper_baseline": scheme.paper_baseline,
        "deadline_clock": "from the client's connect() (handshake inside the budget)",
        "payload_intact": all(r.intact for r in runs),
        "runs": [r.__dict__ for r in runs],
    }

