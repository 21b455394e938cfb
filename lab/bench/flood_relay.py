"""The flood of `pfec bench flood` (:mod:`pfec.lab.bench.flood`): a UDP relay that captures a real handoff and
replays it (``CaptureRelay``), the pool of forged, junk and replayed datagrams (``flood_pool``), and the
flooder process that sends it at a receiver (``Flooder``), plus the receiver endpoint's own CPU per forged
datagram (``endpoint_rejection_us``).

``CaptureRelay`` is also what tests/security/test_security_replay_sockets.py uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import socket
import time
import timeit
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any, Final

from pfec.common.node.udp import set_buffers
from pfec.common.wire.frames import pack_header, peek_header
from pfec.common.wire.messages import HEADER_SIZE, WIRE_VERSION, KeyPhase, MsgType, ParseError
from pfec.lab.processes import LOOPBACK_PSK
from pfec.receiver.endpoint import ReceiverEndpoint

__all__ = ["MIX", "POOL_SIZE", "CaptureRelay", "Flooder", "endpoint_rejection_us", "flood_pool"]

POOL_SIZE: Final = 4096
MIX: Final = {"forged_offer": 0.4, "forged_early": 0.1, "junk_random": 0.1, "junk_truncated": 0.1,
              "junk_version": 0.1, "replay": 0.2}
_MAX_BURST_S: Final = 0.005  # the flooder catches up at most this much lost time at once


# --------------------------------------------------------------------------- capture and replay


class _Side(asyncio.DatagramProtocol):
    def __init__(self, relay: CaptureRelay, from_sender: bool) -> None:
        self.relay = relay
        self.from_sender = from_sender

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.from_sender:
            self.relay._from_sender(data, addr)
        else:
            self.relay._from_receiver(data)

    def error_received(self, exc: Exception) -> None:  # ICMP port unreachable while a receiver restarts
        self.relay.errors += 1


class CaptureRelay:
    """A UDP relay between one sender (``listen_address``) and one receiver (``forward_to``) that records
    every datagram the sender sent (``captured``) and everything the receiver sent back (``replies``),
    with byte counts both ways. ``inject`` sends a datagram at the receiver from the relay's own
    receiver-side socket (a replay): the receiver answers that socket, so its replies are counted here
    too (and forwarded to the sender only while ``forward_replies``). ``reply_delay_s`` holds each reply
    that long before it goes on to the sender: a path with a round trip, so the sender's first flight goes
    out under its early key before the ACCEPT can reach it (on bare loopback the ACCEPT may win the race
    against the first paced slot)."""

    def __init__(self, forward_to: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 reply_delay_s: float = 0.0) -> None:
        if reply_delay_s < 0:
            raise ValueError(f"reply_delay_s must be >= 0, got {reply_delay_s!r}")
        self.forward_to = forward_to
        self.listen = listen
        self.reply_delay_s = reply_delay_s
        self.captured: list[bytes] = []
        self.replies: list[bytes] = []
        self.bytes_to_receiver = 0
        self.bytes_from_receiver = 0
        self.forward_replies = True
        self.errors = 0
        self._peer: Any = None
        self._down: asyncio.DatagramTransport | None = None
        self._up: asyncio.DatagramTransport | None = None

    async def __aenter__(self) -> CaptureRelay:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.close()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.forward_to[0] else socket.AF_INET
        up_sock = socket.socket(family, socket.SOCK_DGRAM)
        set_buffers(up_sock, 8 << 20, 8 << 20)
        up_sock.setblocking(False)
        up_sock.connect(self.forward_to)
        self._up, _ = await loop.create_datagram_endpoint(lambda: _Side(self, False), sock=up_sock)
        self._down, _ = await loop.create_datagram_endpoint(lambda: _Side(self, True), local_addr=self.listen)

    @property
    def listen_address(self) -> tuple[str, int]:
        assert self._down is not None, "relay not started"
        host, port = self._down.get_extra_info("sockname")[:2]
        return str(host), int(port)

    def _from_sender(self, data: bytes, addr: Any) -> None:
        self._peer = addr
        self.captured.append(data)
        self.inject(data)

    def _from_receiver(self, data: bytes) -> None:
        self.replies.append(data)
        self.bytes_from_receiver += len(data)
        if not self.forward_replies or self._peer is None:
            return
        if self.reply_delay_s > 0:
            asyncio.get_running_loop().call_later(self.reply_delay_s, self._to_sender, data, self._peer)
        else:
            self._to_sender(data, self._peer)

    def _to_sender(self, data: bytes, peer: Any) -> None:
        if self._down is not None:  # closed meanwhile: the reply is lost, as on a link that went down
            self._down.sendto(data, peer)

    def inject(self, data: bytes) -> None:
        """Send ``data`` to the receiver from the relay's receiver-side socket (counted)."""
        assert self._up is not None, "relay not started"
        self.bytes_to_receiver += len(data)
        self._up.sendto(data)

    def reset_counts(self) -> None:
        """Start counting afresh (the capture is kept)."""
        self.replies = []
        self.bytes_to_receiver = self.bytes_from_receiver = 0

    def close(self) -> None:
        for transport in (self._down, self._up):
            if transport is not None:
                transport.close()
        self._down = self._up = None


# --------------------------------------------------------------------------- the flood


def _is_handshake_offer(datagram: bytes) -> bool:
    try:
        header = peek_header(datagram)
    except ParseError:
        return False
    return header.phase is KeyPhase.HANDSHAKE and header.type is MsgType.OFFER


def _is_data(datagram: bytes) -> bool:
    try:
        header = peek_header(datagram)
    except ParseError:
        return False
    return header.type is MsgType.SOURCE


def _forged(rng: random.Random, template: bytes, type_byte: int) -> bytes:
    """``template``'s length and layout under a random session id, packet number and protected part."""
    header = pack_header(WIRE_VERSION, type_byte, rng.getrandbits(64), rng.randrange(1, 1 << 32))
    return header + rng.randbytes(len(template) - HEADER_SIZE)


def flood_pool(captured: Iterable[bytes], kind: str, size: int = POOL_SIZE, seed: int = 0) -> list[bytes]:
    """``size`` flood datagrams: ``kind`` is ``forged_offer`` (forged OFFERs only) or ``mix`` (``MIX``).

    ``captured`` holds a real handoff's sender datagrams: the templates of the forged ones, the replays."""
    captured = list(captured)
    offers = [d for d in captured if _is_handshake_offer(d)]
    data = [d for d in captured if _is_data(d)]
    if not offers or not data:
        raise ValueError("the capture holds no OFFER or no SOURCE datagram")
    rng = random.Random(seed)
    offer_type = int(MsgType.OFFER) | int(KeyPhase.HANDSHAKE)
    early_source = int(MsgType.SOURCE) | int(KeyPhase.EARLY)
    wrong_version = (WIRE_VERSION + 1) & 0xFF

    def one(what: str) -> bytes:
        if what == "forged_offer":
            return _forged(rng, rng.choice(offers), offer_type)
        if what == "forged_early":
            return _forged(rng, rng.choice(data), early_source)
        if what == "junk_random":
            return rng.randbytes(rng.randrange(1, 1400))
        if what == "junk_truncated":
            return rng.choice(captured)[: rng.randrange(1, HEADER_SIZE)]
        if what == "junk_version":
            d = rng.choice(captured)
            return bytes([wrong_version]) + d[1:]
        return rng.choice(captured)  # replay

    if kind == "forged_offer":
        return [one("forged_offer") for _ in range(size)]
    if kind != "mix":
        raise ValueError(f"flood kind {kind!r}: forged_offer or mix")
    kinds = list(MIX)
    weights = [MIX[k] for k in kinds]
    return [one(k) for k in rng.choices(kinds, weights, k=size)]


def _flood_main(conn: Connection, address: tuple[str, int], pools: dict[str, list[bytes]],
                rate: float) -> None:
    """The flooder process: waits for a phase name (a pool, or "idle"), sends that pool round-robin at
    ``rate`` datagrams/s until the next command, and answers each command with the ending phase's counts;
    "stop" ends it."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    set_buffers(sock, 8 << 20, 8 << 20)
    sock.connect(address)
    sock.setblocking(False)
    conn.send(("ready", os.getpid()))
    phase, pool = "idle", None
    t0 = time.perf_counter()
    sent = errors = replies = reply_bytes = k = 0
    burst = max(1, int(rate * _MAX_BURST_S))
    while True:
        if pool is None or conn.poll():
            command = conn.recv()  # blocks while idle
            now = time.perf_counter()
            conn.send(("phase", {"phase": phase, "sent": sent, "send_errors": errors, "seconds": now - t0,
                                 "replies": replies, "reply_bytes": reply_bytes}))
            if command == "stop":
                break
            phase, pool = command, pools.get(command)
            t0 = now
            sent = errors = replies = reply_bytes = 0
            continue
        due = min(burst, int((time.perf_counter() - t0) * rate) - sent)
        n = len(pool)
        for _ in range(due):
            try:
                sock.send(pool[k])
            except OSError:  # ENOBUFS, or ECONNREFUSED from an earlier ICMP error
                errors += 1
            k = (k + 1) % n
        if due > 0:
            sent += due
        while True:  # what the receiver answers (ACCEPTs to replayed OFFERs it forgot)
            try:
                size = len(sock.recv(65535))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                errors += 1
                break
            replies += 1
            reply_bytes += size
        time.sleep(0.0002)
    sock.close()


def endpoint_rejection_us(forged: list[bytes], inputs: int = 20_000) -> float:
    """CPU of the receiver endpoint alone (sans-IO: header parse, one AES-GCM open, the drop counter) per
    forged datagram, best of three passes: the part of the daemon's figure that is the protocol's."""
    endpoint = ReceiverEndpoint(LOOPBACK_PSK, bytes(32))
    n = len(forged)

    def one_pass() -> None:
        for i in range(inputs):
            endpoint.receive_datagram(forged[i % n], 0.0)

    return min(timeit.repeat(one_pass, number=1, repeat=3)) / inputs * 1e6


class Flooder:
    """The flooder process (spawned: its own interpreter and core)."""

    def __init__(self, address: tuple[str, int], pools: dict[str, list[bytes]], rate: float) -> None:
        self.pools = pools
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_flood_main, args=(child, address, pools, rate), daemon=True,
                                   name="pfec-flood")
        self.process.start()
        if not self.conn.poll(120):
            raise RuntimeError("the flood process did not start within 120 s")
        self.conn.recv()

    def phase(self, name: str) -> dict[str, Any]:
        """Switch to ``name`` (a pool, "idle" or "stop"); the counts of the phase that ended."""
        self.conn.send(name)
        if not self.conn.poll(30):
            raise RuntimeError("the flood process does not answer")
        _kind, counts = self.conn.recv()
        return dict(counts)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(RuntimeError, OSError, EOFError):
                self.phase("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
