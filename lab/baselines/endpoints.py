"""The endpoint processes of the reliable-transport baselines (``reliable``): kernel TCP and QUIC.

QUIC runs on one of ``QUIC_STACKS`` (the parameter ``stack``): qh3 (aioquic's fork with a native packet
core) or aioquic (pure Python); both expose aioquic's module layout and asyncio API, so one set of glue
drives either. Each role runs as ``python -m pfec.lab.baselines.endpoints ROLE JSON`` (stdlib imports only,
the QUIC stack for the QUIC roles), so the emulator, the sender and the receiver do not share one
interpreter lock. Each QUIC endpoint warms its stack up with one in-memory handshake before its ready
line (``_warm_up``: the one-time set-up is not the handoff's). A role reads
its parameters from the JSON argument, prints one JSON "ready" line, and then one JSON result line; a
sender waits for a "go" line on stdin between the two. Every line carries the process's CPU time so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import math
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "AFTER_DEADLINE_S",
    "QUIC_DATAGRAM",
    "QUIC_STACKS",
    "READY_TIMEOUT_S",
    "ROLES",
    "QuicApi",
    "quic_api",
]

QUIC_DATAGRAM: Final = 1400  # bytes; wire.MAX_DATAGRAM, the simulator's datagram size
READY_TIMEOUT_S: Final = 30.0
AFTER_DEADLINE_S: Final = 1.0  # how long the receiver keeps reading after the deadline (rate metering)
_CHUNK: Final = 1 << 18
_SOCKET_BUFFER: Final = 8 << 20
QUIC_STACKS: Final = ("qh3", "aioquic")  # import names; the first is the default
_WARM_UP_ROUNDS: Final = 8  # client/server flights of the in-memory warm-up handshake


def _emit(obj: dict[str, Any]) -> None:
    # The endpoint's CPU so far: tells a CPU-bound transport (aioquic) from a link-bound one.
    sys.stdout.write(json.dumps({**obj, "cpu_s": time.process_time()}) + "\n")
    sys.stdout.flush()


def _check_prefix(buf: bytearray, n: int, payload_path: str) -> bool:
    """The bytes received are the payload's first ``n`` bytes (the stream really carried the handoff)."""
    with open(payload_path, "rb") as f:
        return f.read(n) == bytes(memoryview(buf)[:n])


# --------------------------------------------------------------------------- kernel TCP


def _tcp_receiver(p: dict[str, Any]) -> None:
    total = int(p["total"])
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((p["host"], int(p["port"])))
    lsock.listen(1)
    lsock.settimeout(READY_TIMEOUT_S)
    _emit({"ready": True, "port": lsock.getsockname()[1]})
    conn, _ = lsock.accept()
    accepted = time.monotonic()
    buf = bytearray(total)
    view = memoryview(buf)
    trace: list[list[float]] = []
    got = 0
    give_up = accepted + float(p["deadline_s"]) + AFTER_DEADLINE_S
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
    if p.get("congestion_control"):  # the driver checked the kernel offers it; root in the namespace
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, str(p["congestion_control"]).encode())
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
    _emit({"t0": t0, "connected": connected, "ended": time.monotonic(), "sent": sent,
           "congestion_control": congestion})


# --------------------------------------------------------------------------- QUIC (qh3 or aioquic)
# The stack is imported inside the QUIC roles (deferred: the TCP roles must not pay for it). The endpoints
# run on the stdlib loop: on uvloop (whose loop.time() is a coarser cached clock, see emulator_link) a
# lossless direct aioquic run delivered 1.5 MB instead of 17 MB by the deadline.


def _stack(p: dict[str, Any]) -> str:
    stack = str(p.get("stack", QUIC_STACKS[0]))
    if stack not in QUIC_STACKS:
        raise SystemExit(f"unknown QUIC stack {stack!r}: use one of {', '.join(QUIC_STACKS)}")
    return stack


@dataclass(frozen=True)
class QuicApi:
    """The parts of a stack the endpoints use (both stacks keep aioquic's names and module layout)."""

    configuration: Any  # QuicConfiguration
    connection: Any  # QuicConnection
    protocol: Any  # asyncio QuicConnectionProtocol
    server: Any  # asyncio QuicServer
    events: Any  # the quic.events module


def _qh3_api() -> QuicApi:
    from qh3.asyncio.protocol import QuicConnectionProtocol  # deferred: qh3
    from qh3.asyncio.server import QuicServer  # deferred: qh3
    from qh3.quic import events  # deferred: qh3
    from qh3.quic.configuration import QuicConfiguration  # deferred: qh3
    from qh3.quic.connection import QuicConnection  # deferred: qh3

    return QuicApi(QuicConfiguration, QuicConnection, QuicConnectionProtocol, QuicServer, events)


def _aioquic_api() -> QuicApi:
    from aioquic.asyncio.protocol import QuicConnectionProtocol  # deferred: aioquic
    from aioquic.asyncio.server import QuicServer  # deferred: aioquic
    from aioquic.quic import events  # deferred: aioquic
    from aioquic.quic.configuration import QuicConfiguration  # deferred: aioquic
    from aioquic.quic.connection import QuicConnection  # deferred: aioquic

    return QuicApi(QuicConfiguration, QuicConnection, QuicConnectionProtocol, QuicServer, events)


def quic_api(p: dict[str, Any]) -> QuicApi:
    """The stack ``p["stack"]`` names (default ``QUIC_STACKS[0]``), imported now."""
    return _qh3_api() if _stack(p) == "qh3" else _aioquic_api()


def _quic_configuration(is_client: bool, p: dict[str, Any]) -> Any:
    cfg = quic_api(p).configuration(is_client=is_client, max_datagram_size=QUIC_DATAGRAM)
    if hasattr(cfg, "probe_datagram_size"):  # qh3: no path-MTU probing, every datagram stays 1,400 B
        cfg.probe_datagram_size = False
    # Flow control well above the bandwidth-delay product, so only congestion control limits the stream.
    cfg.max_data = cfg.max_stream_data = 16 << 20
    if is_client:
        cfg.server_name = "localhost"
        cfg.load_verify_locations(cafile=p["ca"])
    else:
        cfg.load_cert_chain(p["cert"], p["key"])
    return cfg


def _warm_up(p: dict[str, Any]) -> bool:
    """One in-memory handshake between a client and a server connection of the stack (no socket): pays
    the stack's one-time set-up (qh3: ~36 ms at the first connect()) before the ready line, outside the
    handoff's budget, as a node's long-lived stack would have. Both endpoints run it. True once the
    client saw the handshake complete."""
    api = quic_api(p)
    client = api.connection(configuration=_quic_configuration(True, p))
    server_cfg = _quic_configuration(False, p)
    client_addr, server_addr = ("127.0.0.1", 1), ("127.0.0.1", 2)
    now = time.monotonic()
    client.connect(server_addr, now=now)
    server = None
    for _ in range(_WARM_UP_ROUNDS):
        for data, _addr in client.datagrams_to_send(now=now):
            if server is None:  # a server connection takes the client's first destination CID
                server = api.connection(configuration=server_cfg,
                                        original_destination_connection_id=_initial_dcid(data))
            server.receive_datagram(data, client_addr, now=now)
        if server is not None:
            for data, _addr in server.datagrams_to_send(now=now):
                client.receive_datagram(data, server_addr, now=now)
        while (event := client.next_event()) is not None:
            if isinstance(event, api.events.HandshakeCompleted):
                return True
        now += 0.001
    return False


def _initial_dcid(datagram: bytes) -> bytes:
    """The destination connection ID of a long-header packet (RFC 9000 17.2): after flags and version."""
    length = datagram[5]
    return bytes(datagram[6 : 6 + length])


def _sender_state(p: dict[str, Any], connection: Any, cfg: Any) -> dict[str, Any]:
    """The sender's final congestion window, smoothed RTT and the stack's name: why a run was slow."""
    stack = _stack(p)
    name = f"{stack} {importlib.metadata.version(stack)}"
    if stack == "aioquic":  # the recovery state is Python, read once
        recovery = connection._loss
        return {"cwnd_bytes": recovery.congestion_window, "srtt_ms": recovery._rtt_smoothed * 1000,
                "congestion_control": f"{name} {cfg.congestion_control_algorithm}"}  # fmt: skip
    core = connection._core  # qh3: the native core's recovery counters (None before any packet)
    if core is None:
        return {"congestion_control": f"{name} native"}
    srtt = core.smoothed_rtt
    return {"cwnd_bytes": core.congestion_window, "srtt_ms": math.nan if srtt is None else srtt * 1000,
            "lost_packets": core.loss_total, "ptos": core.pto_total,
            "congestion_control": f"{name} native"}  # fmt: skip


def _udp_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    sock.bind((host, port))
    return sock


def _quic_receiver(p: dict[str, Any]) -> None:
    asyncio.run(_quic_receiver_main(p))


async def _quic_receiver_main(p: dict[str, Any]) -> None:
    api = quic_api(p)
    quic_protocol, quic_server = api.protocol, api.server
    handshake_completed, stream_data = api.events.HandshakeCompleted, api.events.StreamDataReceived
    terminated = api.events.ConnectionTerminated

    total = int(p["total"])
    buf = bytearray(total)
    trace: list[list[float]] = []
    marks: dict[str, float] = {}
    done = asyncio.Event()

    class Receiver(quic_protocol):  # type: ignore[misc,valid-type]  # the stack's, chosen at run time
        def quic_event_received(self, event: Any) -> None:
            now = time.monotonic()
            if isinstance(event, handshake_completed):
                marks["handshake"] = now
                asyncio.get_running_loop().call_later(float(p["deadline_s"]) + AFTER_DEADLINE_S, done.set)
            elif isinstance(event, stream_data):  # both stacks hand stream data over in order
                got = int(trace[-1][1]) if trace else 0
                buf[got : got + len(event.data)] = event.data
                trace.append([now, got + len(event.data)])
                if event.end_stream:
                    self._quic.send_stream_data(event.stream_id, b"ok", end_stream=True)
                    self.transmit()
                    done.set()
            elif isinstance(event, terminated):
                done.set()

    loop = asyncio.get_running_loop()
    sock = _udp_socket(p["host"], int(p["port"]))
    cfg = _quic_configuration(False, p)
    transport, _ = await loop.create_datagram_endpoint(
        lambda: quic_server(configuration=cfg, create_protocol=Receiver), sock=sock
    )
    _warm_up(p)
    _emit({"ready": True, "port": sock.getsockname()[1]})
    # The sender closes the connection at its deadline, or after our "ok" once everything arrived. Its
    # CONNECTION_CLOSE can be lost (aioquic does not repeat it unprompted), so the handshake also arms a
    # give-up AFTER_DEADLINE_S past the deadline, as the TCP receiver has (a lost close had left the run
    # idle for ~30 s of real time with nothing more to measure).
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), READY_TIMEOUT_S + float(p["deadline_s"]) + AFTER_DEADLINE_S)
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
    api = quic_api(p)
    payload = Path(p["payload"]).read_bytes()
    deadline_s = float(p["deadline_s"])
    cfg = _quic_configuration(True, p)
    loop = asyncio.get_running_loop()
    sock = _udp_socket("127.0.0.1", 0)
    connection = api.connection(configuration=cfg)
    _, protocol = await loop.create_datagram_endpoint(lambda: api.protocol(connection), sock=sock)
    _warm_up(p)
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
    ended = time.monotonic()
    _emit({**_sender_state(p, connection, cfg), "t0": t0, "connected": connected, "ended": ended,
           "sent": len(payload)})


ROLES: Final[dict[str, Callable[[dict[str, Any]], None]]] = {
    "tcp-receiver": _tcp_receiver,
    "tcp-sender": _tcp_sender,
    "quic-receiver": _quic_receiver,
    "quic-sender": _quic_sender,
}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ROLES:
        sys.exit(f"usage: python -m pfec.lab.baselines.endpoints {{{','.join(ROLES)}}} JSON")
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
