"""Reliable-transport baselines: the handoff over real kernel TCP and real QUIC (aioquic), emulated link.

The payload is the simulator's (``common.sim.prepare``): the same fragments, block utilities, deadline and
bytes. The fragments go out as ONE in-order byte stream in utility order (best blocks first) — the best case
for an in-order reliable stream, since whatever prefix arrives by the deadline holds the most useful blocks.

* ``tcp``: a kernel TCP connection between two network namespaces joined by the TUN front end of
  ``common.emulator`` (root only). The kernel's default congestion control is used; the sender reads the one
  its socket actually got (``TCP_CONGESTION``). Emulated sizes are whole IP packets.
* ``quic``: an aioquic client and server on loopback through the emulator's ``UdpRelay`` (relay mode, no
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
inside the in-order byte prefix received by t0 + D (utilities sum to 1, as in ``common.sim``).

Endpoints run as subprocesses (``python -m common.reliable ROLE JSON``; light imports) so that the emulator,
sender and receiver do not share one interpreter lock; the emulator runs in the calling process on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

if TYPE_CHECKING:
    from pfec.lab.emulator import EmulatorConfig
    from pfec.lab.sim import Handoff, SimConfig

__all__ = [
    "PROTOCOLS",
    "PrefixScore",
    "ReliableRun",
    "run_reliable",
    "score_prefix",
]

Proto = Literal["tcp", "quic"]
PROTOCOLS: Final = ("tcp", "quic")
QUIC_DATAGRAM: Final = 1400  # bytes; wire.MAX_DATAGRAM, the simulator's datagram size
_REPO_ROOT: Final = Path(__file__).resolve().parent.parent
_READY_TIMEOUT_S: Final = 30.0
_AFTER_DEADLINE_S: Final = 1.0  # how long the receiver keeps reading after the deadline (rate metering)
_CHUNK: Final = 1 << 18
_LINE_LIMIT: Final = 64 << 20  # the receiver's result line holds one [time, bytes] row per read


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class PrefixScore:
    utility: float  # sum of U_b over blocks entirely inside the prefix (utilities sum to 1)
    fragments: int  # whole fragments inside the prefix
    blocks: int


def score_prefix(handoff: Handoff, prefix_bytes: int) -> PrefixScore:
    """Score an in-order prefix of the utility-ordered stream as ``common.sim`` scores decoded symbols."""
    if prefix_bytes < 0:
        raise ValueError(f"prefix_bytes must be >= 0, got {prefix_bytes!r}")
    plan = handoff.plan
    queue = handoff.queue("utility")
    whole = min(prefix_bytes // plan.symbol_size, len(queue))
    got = np.zeros(plan.n_fragments, dtype=np.int8)
    got[queue[:whole]] = 1
    complete = np.minimum.reduceat(got, plan.first_fragment[:-1]).astype(bool)
    return PrefixScore(float(handoff.block_utility[complete].sum()), int(whole), int(complete.sum()))


def stream_bytes(handoff: Handoff) -> bytes:
    """The byte stream both transports carry: the fragments in utility order, back to back."""
    handoff.queue("utility")
    return handoff.ordered_payload["utility"].tobytes()


def bytes_by(trace: list[list[float]], instant: float) -> int:
    """In-order bytes received by ``instant`` from a receiver trace of [time, cumulative bytes] rows."""
    got = 0
    for t, cum in trace:
        if t > instant:
            break
        got = int(cum)
    return got


# --------------------------------------------------------------------------- endpoint processes
# Each role reads its parameters from argv[2] (JSON), prints one JSON "ready" line, and one JSON result line.


def _emit(obj: dict[str, Any]) -> None:
    # The endpoint's CPU so far: tells a CPU-bound transport (aioquic) from a link-bound one.
    sys.stdout.write(json.dumps({**obj, "cpu_s": time.process_time()}) + "\n")
    sys.stdout.flush()


def _check_prefix(buf: bytearray, n: int, payload_path: str) -> bool:
    """The bytes received are the payload's first ``n`` bytes (the stream really carried the handoff)."""
    with open(payload_path, "rb") as f:
        return f.read(n) == bytes(memoryview(buf)[:n])


def _tcp_receiver(p: dict[str, Any]) -> None:
    total = int(p["total"])
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((p["host"], int(p["port"])))
    lsock.listen(1)
    lsock.settimeout(_READY_TIMEOUT_S)
    _emit({"ready": True, "port": lsock.getsockname()[1]})
    conn, _ = lsock.accept()
    accepted = time.monotonic()
    buf = bytearray(total)
    view = memoryview(buf)
    trace: list[list[float]] = []
    got = 0
    give_up = accepted + float(p["deadline_s"]) + _AFTER_DEADLINE_S
    conn.settimeout(0.5)
    with contextlib.suppress(OSError):  # reset by the sender at its deadline, or idle past give_up
        while got < total and time.monotonic() < give_up:
            try:
                n = conn.recv_into(view[got:], total - got)
            except TimeoutError:
                continue
            if n == 0:
                break
            got += n
            trace.append([time.monotonic(), got])
    conn.close()
    lsock.close()
    intact = _check_prefix(buf, got, p["payload"])
    _emit({"accepted": accepted, "trace": trace, "bytes": got, "intact": intact})


def _tcp_sender(p: dict[str, Any]) -> None:
    payload = Path(p["payload"]).read_bytes()
    view = memoryview(payload)
    deadline_s = float(p["deadline_s"])
    _emit({"ready": True})
    sys.stdin.readline()  # "go"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    congestion = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()
    sent = 0
    connected = math.nan
    t0 = time.monotonic()
    end = t0 + deadline_s
    with contextlib.suppress(OSError):  # timeouts at the deadline, or the receiver gone
        sock.settimeout(deadline_s)
        sock.connect((p["host"], int(p["port"])))
        connected = time.monotonic()
        while sent < len(payload) and time.monotonic() < end:
            sock.settimeout(max(1e-3, end - time.monotonic()))
            sent += sock.send(view[sent : sent + _CHUNK])
        if sent == len(payload):
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(max(1e-3, end - time.monotonic()))
            sock.recv(1)  # the receiver closes once it holds everything
    # Abort (RST): a handoff does not keep sending after its deadline.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + bytes(4))
    sock.close()
    _emit({"t0": t0, "connected": connected, "sent": sent, "congestion_control": congestion})


def _quic_configuration(is_client: bool, p: dict[str, Any]) -> Any:
    from aioquic.quic.configuration import QuicConfiguration

    cfg = QuicConfiguration(is_client=is_client, max_datagram_size=QUIC_DATAGRAM)
    # Flow control well above the bandwidth-delay product, so only congestion control limits the stream.
    cfg.max_data = cfg.max_stream_data = 16 << 20
    if is_client:
        cfg.server_name = "localhost"
        cfg.load_verify_locations(cafile=p["cert"])
    else:
        cfg.load_cert_chain(p["cert"], p["key"])
    return cfg


# aioquic endpoints run on the stdlib loop: on uvloop (whose loop.time() is a coarser cached clock, see
# common.emulator) a lossless direct run delivered 1.5 MB instead of 17 MB by the deadline.
def _quic_receiver(p: dict[str, Any]) -> None:
    asyncio.run(_quic_receiver_main(p))


async def _quic_receiver_main(p: dict[str, Any]) -> None:
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.asyncio.server import QuicServer
    from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, StreamDataReceived

    total = int(p["total"])
    buf = bytearray(total)
    trace: list[list[float]] = []
    marks: dict[str, float] = {}
    done = asyncio.Event()

    class Receiver(QuicConnectionProtocol):
        def quic_event_received(self, event: Any) -> None:
            now = time.monotonic()
            if isinstance(event, HandshakeCompleted):
                marks["handshake"] = now
            elif isinstance(event, StreamDataReceived):  # aioquic hands stream data over in order
                got = int(trace[-1][1]) if trace else 0
                buf[got : got + len(event.data)] = event.data
                trace.append([now, got + len(event.data)])
                if event.end_stream:
                    self._quic.send_stream_data(event.stream_id, b"ok", end_stream=True)
                    self.transmit()
                    done.set()
            elif isinstance(event, ConnectionTerminated):
                done.set()

    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((p["host"], int(p["port"])))
    cfg = _quic_configuration(False, p)
    transport, _ = await loop.create_datagram_endpoint(
        lambda: QuicServer(configuration=cfg, create_protocol=Receiver), sock=sock
    )
    _emit({"ready": True, "port": sock.getsockname()[1]})
    # The sender closes the connection at its deadline, or after our "ok" once everything arrived.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), _READY_TIMEOUT_S + float(p["deadline_s"]) + _AFTER_DEADLINE_S)
    await asyncio.sleep(0.05)  # let the "ok" leave before the endpoint goes
    transport.close()
    got = int(trace[-1][1]) if trace else 0
    _emit(
        {
            "accepted": marks.get("handshake", math.nan),
            "trace": trace,
            "bytes": got,
            "intact": _check_prefix(buf, got, p["payload"]),
        }
    )


def _quic_sender(p: dict[str, Any]) -> None:
    asyncio.run(_quic_sender_main(p))


async def _quic_sender_main(p: dict[str, Any]) -> None:
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.quic.connection import QuicConnection

    payload = Path(p["payload"]).read_bytes()
    deadline_s = float(p["deadline_s"])
    cfg = _quic_configuration(True, p)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    connection = QuicConnection(configuration=cfg)
    _, protocol = await loop.create_datagram_endpoint(lambda: QuicConnectionProtocol(connection), sock=sock)
    _emit({"ready": True})
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    t0 = time.monotonic()
    end = t0 + deadline_s
    connected = math.nan
    with contextlib.suppress(TimeoutError, ConnectionError):
        protocol.connect((p["host"], int(p["port"])))
        await asyncio.wait_for(protocol.wait_connected(), deadline_s)
        connected = time.monotonic()
        reader, writer = await protocol.create_stream()
        writer.write(payload)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), max(1e-3, end - time.monotonic()))
    protocol.close()  # at the deadline, or once the receiver confirmed everything
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(protocol.wait_closed(), 0.2)
    recovery = connection._loss  # aioquic's recovery state, read once: why a run was slow
    _emit(
        {
            "cwnd_bytes": recovery.congestion_window,
            "srtt_ms": recovery._rtt_smoothed * 1000,
            "t0": t0,
            "connected": connected,
            "sent": len(payload),
            "congestion_control": f"aioquic {cfg.congestion_control_algorithm}",
        }
    )


_ROLES: Final[dict[str, Callable[[dict[str, Any]], None]]] = {
    "tcp-receiver": _tcp_receiver,
    "tcp-sender": _tcp_sender,
    "quic-receiver": _quic_receiver,
    "quic-sender": _quic_sender,
}


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


class _Endpoint:
    """One endpoint subprocess: a JSON ready line, then a JSON result line on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str) -> None:
        self.proc = proc
        self.role = role

    @classmethod
    async def start(cls, prefix: list[str], role: str, params: dict[str, Any]) -> _Endpoint:
        env = dict(os.environ, PYTHONPATH=str(_REPO_ROOT))
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "pfec.lab.reliable", role, json.dumps(params),
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
        ready = await rx.line(_READY_TIMEOUT_S)
        target = await front(int(ready["port"]))
        tx = await _Endpoint.start(*sender_cmd, {**params, **target})
        await tx.line(_READY_TIMEOUT_S)
        tx.go()
        limit = deadline_s + _AFTER_DEADLINE_S + _READY_TIMEOUT_S
        sent = await tx.line(limit)
        received = await rx.line(limit)
        return sent, received
    finally:
        for ep in (tx, rx):
            if ep is not None:
                await ep.stop()


def _emulator_config(config: SimConfig, realization: int) -> EmulatorConfig:
    from pfec.lab.emulator import DirectionSpec, EmulatorConfig

    return EmulatorConfig(
        forward=DirectionSpec(config.rate_bps, config.owd_s, config.loss),
        reverse=DirectionSpec(config.rate_bps, config.owd_s, config.reverse_loss),
        seed=config.seed,
        realization=realization,
    )


async def _tcp_once(
    handoff: Handoff, payload_path: str, realization: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from pfec.lab.emulator import NetnsSpec, TunBridge, setup_namespaces, teardown_namespaces

    tag = uuid.uuid4().hex[:6]
    spec = NetnsSpec(ns_a=f"pfr-a-{tag}", ns_b=f"pfr-b-{tag}")
    params = {
        "host": spec.addr_b,
        "port": 0,
        "payload": payload_path,
        "total": len_payload(handoff),
        "deadline_s": handoff.deadline_s,
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
    from pfec.lab.emulator import UdpRelay

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


def len_payload(handoff: Handoff) -> int:
    return int(handoff.plan.n_fragments * handoff.plan.symbol_size)


def _summarise(
    handoff: Handoff,
    realization: int,
    sent: dict[str, Any],
    received: dict[str, Any],
    stats: dict[str, Any],
    cpu_s: float,
) -> ReliableRun:
    trace: list[list[float]] = received["trace"]
    t0 = float(sent["t0"])
    prefix = bytes_by(trace, t0 + handoff.deadline_s)
    score = score_prefix(handoff, prefix)
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
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

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


def _check_protocol(protocol: str) -> Proto:
    if protocol == "tcp":
        from pfec.lab.emulator import netns_available

        ok, why = netns_available()
        if not ok:
            raise OSError(f"the tcp baseline runs kernel TCP between two network namespaces: {why}")
        return "tcp"
    if protocol == "quic":
        return "quic"
    raise ValueError(f"protocol {protocol!r}: use 'tcp' or 'quic'")


def run_reliable(
    protocol: str,
    config: SimConfig,
    realizations: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Carry the simulator's payload over real TCP or QUIC ``realizations`` times; a simulate()-like report.

    Raises ValueError for a bad protocol or count, OSError when ``tcp`` cannot create namespaces (not root).
    """
    from pfec.lab.emulator import run_event_loop
    from pfec.lab.sim import prepare, report

    proto = _check_protocol(protocol)
    if isinstance(realizations, bool) or not isinstance(realizations, int) or realizations < 1:
        raise ValueError(f"realizations must be an int >= 1, got {realizations!r}")
    handoff = prepare(config)
    runs: list[ReliableRun] = []
    with tempfile.TemporaryDirectory(prefix="pfec-reliable-") as tmp:
        payload_path = os.path.join(tmp, "payload.bin")
        Path(payload_path).write_bytes(stream_bytes(handoff))
        os.chmod(tmp, 0o755)  # the namespaced endpoints run as the same user; keep it readable anyway
        cert = _self_signed(tmp) if proto == "quic" else ("", "")
        for r in range(realizations):
            cpu0 = time.process_time()
            once = (
                _tcp_once(handoff, payload_path, r)
                if proto == "tcp"
                else _quic_once(handoff, payload_path, r, cert)
            )
            sent, received, stats = run_event_loop(once)
            runs.append(_summarise(handoff, r, sent, received, stats, time.process_time() - cpu0))
            if progress is not None:
                progress(r + 1, realizations)
    out = report(handoff, {})
    out["inputs"]["realizations"] = realizations
    out["schemes"][proto] = _aggregate(handoff, proto, runs)
    return out


def _aggregate(handoff: Handoff, proto: Proto, runs: list[ReliableRun]) -> dict[str, Any]:
    from pfec.lab.sim import mean_ci95

    n_source = handoff.plan.n_fragments
    util_mean, util_ci = mean_ci95([r.utility for r in runs])
    sym_mean, sym_ci = mean_ci95([r.fragments / n_source for r in runs])
    completions = [r.completion_ms for r in runs if r.completion_ms is not None]
    return {
        "recovered_utility_mean": util_mean,
        "recovered_utility_ci95": list(util_ci),
        "recovered_symbol_fraction_mean": sym_mean,
        "recovered_symbol_fraction_ci95": list(sym_ci),
        "blocks_recovered_mean": float(np.mean([r.blocks for r in runs])),
        "in_order_bytes_mean": float(np.mean([r.in_order_bytes for r in runs])),
        "payload_bytes": len_payload(handoff),
        "forward_lost_mean": float(np.mean([r.forward_lost for r in runs])),
        "forward_packets_mean": float(np.mean([r.forward_packets for r in runs])),
        "handshake_ms_mean": float(np.mean([r.handshake_ms for r in runs])),
        "completed_runs": len(completions),
        "completion_ms_mean": float(np.mean(completions)) if completions else None,
        "link_rate_achieved_mbps": float(np.mean([r.link_rate_achieved_mbps for r in runs])),
        "link_rate_mbps": handoff.config.rate_mbps,
        "emulator_cpu_s_mean": float(np.mean([r.emulator_cpu_s for r in runs])),
        "sender_cpu_s_mean": float(np.mean([r.sender_cpu_s for r in runs])),
        "receiver_cpu_s_mean": float(np.mean([r.receiver_cpu_s for r in runs])),
        "forward_queue_dropped_mean": float(np.mean([r.forward_queue_dropped for r in runs])),
        "realizations": len(runs),
        "congestion_control": sorted({r.congestion_control for r in runs}),
        "emulator_mode": "netns" if proto == "tcp" else "relay",
        "emulated_size": "IP packet" if proto == "tcp" else "UDP payload",
        "stream_order": "utility (best case for an in-order stream)",
        "deadline_clock": "from the client's connect() (handshake inside the budget)",
        "payload_intact": all(r.intact for r in runs),
        "runs": [r.__dict__ for r in runs],
    }


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in _ROLES:
        sys.exit(f"usage: python -m common.reliable {{{','.join(_ROLES)}}} JSON  (endpoint of run_reliable)")
    _ROLES[sys.argv[1]](json.loads(sys.argv[2]))
