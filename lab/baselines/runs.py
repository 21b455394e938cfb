"""One run of a reliable baseline's endpoint pair (``endpoints``) across the emulated link.

``tcp_run``: kernel TCP between two fresh network namespaces joined by the emulator's TUN bridge (root).
``quic_run``: a QUIC stack (``endpoints.QUIC_STACKS``) on loopback through the emulator's UDP relay, or
straight over loopback (the stack's own ceiling, no emulator). Both start the receiver, point the sender at
it, say "go" and collect the two result lines (each endpoint's CPU at its ready line as ``ready_cpu_s``),
with the emulator's counters. ``run_certificates`` makes the CA and server certificate a QUIC run uses.
The link is the simulator's config's (``emulator_config``): its rate, delay and loss, or its rate trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pfec.lab.baselines.endpoints import AFTER_DEADLINE_S, READY_TIMEOUT_S
from pfec.lab.emulator.link import DirectionSpec, DirectionStats, EmulatorConfig
from pfec.lab.emulator.netns import NetnsSpec, TunBridge, setup_namespaces, teardown_namespaces
from pfec.lab.emulator.relay import UdpRelay
from pfec.lab.sim.simulate import Handoff, SimConfig

__all__ = [
    "DEFAULT_QUEUE_PACKETS",
    "NO_LINK_STATS",
    "emulator_config",
    "len_payload",
    "quic_run",
    "run_certificates",
    "tcp_run",
]

_REPO_ROOT: Final = Path(__file__).resolve().parents[2]
_LINE_LIMIT: Final = 64 << 20  # the receiver's result line holds one [time, bytes] row per read
DEFAULT_QUEUE_PACKETS: Final = DirectionSpec.queue_packets  # the emulator's drop-tail depth, datagrams
NO_LINK_STATS: Final = {"forward": asdict(DirectionStats()), "reverse": asdict(DirectionStats())}


def len_payload(handoff: Handoff) -> int:
    """Bytes of the stream: every fragment, padded to the symbol size."""
    return int(handoff.plan.n_fragments * handoff.plan.symbol_size)


def _endpoint_path() -> str:
    """PYTHONPATH for an endpoint: the caller's own entries (absolute, so that the endpoint imports the same
    ``pfec`` as this process, e.g. a worktree's links ahead of an editable install), then the repo root."""
    given = [str(Path(e).resolve()) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return os.pathsep.join([*given, str(_REPO_ROOT)])


class _Endpoint:
    """One endpoint subprocess: a JSON ready line, then a JSON result line on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str) -> None:
        self.proc = proc
        self.role = role

    @classmethod
    async def start(cls, prefix: list[str], role: str, params: dict[str, Any]) -> _Endpoint:
        env = dict(os.environ, PYTHONPATH=_endpoint_path())
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
        tx_ready = await tx.line(READY_TIMEOUT_S)
        tx.go()
        limit = deadline_s + AFTER_DEADLINE_S + READY_TIMEOUT_S
        sent = {**await tx.line(limit), "ready_cpu_s": tx_ready["cpu_s"]}  # CPU before the transfer
        if not math.isfinite(float(sent.get("connected", math.nan))):
            # Not connected by the deadline (a lost SYN or Initial, or its answer): the receiver's stream
            # cannot hold a byte, and its accept would only time out. Its CPU is not measured.
            return sent, {"accepted": math.nan, "trace": [], "bytes": 0, "intact": True, "cpu_s": math.nan}
        received = {**await rx.line(limit), "ready_cpu_s": ready["cpu_s"]}
        return sent, received
    finally:
        for ep in (tx, rx):
            if ep is not None:
                await ep.stop()


def emulator_config(config: SimConfig, realization: int, queue_packets: int = DEFAULT_QUEUE_PACKETS
                    ) -> EmulatorConfig:
    """The simulator's link in the emulator, realization ``realization`` of its loss: ``rate_mbps`` each way
    behind drop-tail queues of ``queue_packets``, or forward the config's rate trace behind its bottleneck
    of ``config.queue_bytes`` (the emulator's default depth when None)."""
    return EmulatorConfig(
        forward=DirectionSpec(config.rate_bps, config.owd_s, config.loss, queue_packets, config.rate_trace,
                              config.queue_bytes),
        reverse=DirectionSpec(config.rate_bps, config.owd_s, config.reverse_loss, queue_packets),
        seed=config.seed,
        realization=realization,
    )


async def tcp_run(
    handoff: Handoff, payload_path: str, link: EmulatorConfig, congestion_control: str | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One kernel TCP run (``congestion_control``, or the kernel's default) across ``link``, in two fresh
    namespaces: (sender's result, receiver's result, the emulator's counters)."""
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
        async with TunBridge(link, spec) as bridge:

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


async def quic_run(
    handoff: Handoff, payload_path: str, link: EmulatorConfig | None, certs: tuple[str, str, str], stack: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One QUIC run on ``stack`` through the relay emulating ``link``, or (``link`` None) straight over
    loopback, the stack's own ceiling (the counters then count nothing): as ``tcp_run``."""
    params = {
        "stack": stack,
        "host": "127.0.0.1",
        "port": 0,
        "payload": payload_path,
        "total": len_payload(handoff),
        "deadline_s": handoff.deadline_s,
        "ca": certs[0],
        "cert": certs[1],
        "key": certs[2],
    }
    relays: list[UdpRelay] = []

    async def via_relay(port: int) -> dict[str, Any]:
        if link is None:
            return {"port": port}
        relay = UdpRelay(link, ("127.0.0.1", 0), ("127.0.0.1", port))
        await relay.start()
        relays.append(relay)
        host, relay_port = relay.listen_address
        return {"host": host, "port": relay_port}

    try:
        sent, received = await _exchange(
            ([], "quic-receiver"), ([], "quic-sender"), params, via_relay, handoff.deadline_s
        )
        return sent, received, relays[0].stats() if relays else NO_LINK_STATS
    finally:
        for relay in relays:
            await relay.close()


def _certificate(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )  # fmt: skip
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        ).add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def run_certificates(directory: str) -> tuple[str, str, str]:
    """(CA, server certificate, server key) PEM paths: a P-256 CA and a ``localhost`` certificate it signs,
    made for this run only. A CA of its own, not one self-signed certificate: qh3's verifier (as WebPKI)
    refuses a CA certificate used as the server's own ("the server certificate is unacceptable")."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pfec reliable run CA")])
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    paths = tuple(os.path.join(directory, f) for f in ("ca.pem", "cert.pem", "key.pem"))
    pem = serialization.Encoding.PEM
    Path(paths[0]).write_bytes(_certificate(ca_name, ca_key, ca_name, ca_key, True).public_bytes(pem))
    Path(paths[1]).write_bytes(_certificate(name, key, ca_name, ca_key, False).public_bytes(pem))
    Path(paths[2]).write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths[0], paths[1], paths[2]
