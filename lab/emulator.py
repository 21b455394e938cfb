"""`pfec emulate`: a user-space link emulator (rate, one-way delay, seeded loss) for real UDP traffic.

Per direction (forward = towards the receiver, reverse = back) a datagram goes through:

1. **Queue admission** (drop-tail): at most ``queue_packets`` datagrams may be in the link at once
   (waiting or being serialised); the rest are dropped and counted as ``queue_dropped``.
2. **Serialisation** at ``rate_bps`` in virtual time: ``finish = max(now, next_free) + 8 L / C``. A rate of
   0 means unlimited (no serialisation time, no queue).
3. **Loss** on the wire: the k-th datagram serialised in this direction is lost when ``lost[k]`` of the
   direction's loss realization is True (``common.channel`` models; generator
   ``realization_rng(seed, realization, "forward" | "reverse")``, the streams the simulator uses, so a
   seeded run drops the same datagram indices as the simulator's slot model). A lost datagram still used
   its link time, as on a real wire. The realization is drawn in chunks of ``LOSS_CHUNK`` datagrams
   (Bernoulli and GE prefixes are exact; a GE chain restarts from its stationary law every chunk).
   Trace replay maps datagram k to trace time ``k * slot_s``, ``slot_s`` = one 1,400-byte datagram's
   serialisation time.
4. **Delay**: delivered at ``finish + owd_s`` through ``loop.call_at`` on one FIFO timer per direction
   (order is preserved). Event-loop timers have ~1 ms granularity, so deliveries come in up-to-1-ms
   batches; rate and delay are exact on average.

Size L is the UDP payload in relay mode (as in the simulator's slot model) and the whole IP packet in
netns mode.

Front ends:

* ``UdpRelay`` (no privileges): listens for the sender on ``listen``, forwards to ``forward_to`` from a
  socket connected to it, and relays the replies to the sender's last address.
* ``TunBridge`` (root): two network namespaces (``setup_namespaces``), one TUN device in each (created
  inside the namespace with ``setns(2)`` via ctypes from a helper thread), addressed 10.77.0.1/30 and
  10.77.0.2/30; IP packets read from one TUN are written to the other through the pipeline, so daemons
  started with ``ip netns exec pfec-a|pfec-b`` talk real IP/UDP. Only the namespaces this module created
  are touched; nothing is routed to other networks.

The pipeline (``LinkDirection``) is sans-IO: it takes ``now`` and a size and returns the delivery time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Final, Literal, TypeVar

import numpy as np
import typer

from pfec.lab.channel import LossModel, parse_loss_spec, realization_rng

__all__ = [
    "LOSS_CHUNK",
    "DirectionSpec",
    "DirectionStats",
    "EmulatorConfig",
    "LinkDirection",
    "NetnsSpec",
    "TunBridge",
    "UdpRelay",
    "emulate_cmd",
    "netns_available",
    "parse_loss",
    "run_event_loop",
    "setup_namespaces",
    "teardown_namespaces",
]

LOSS_CHUNK: Final = 1 << 16
NOMINAL_DATAGRAM: Final = 1400  # bytes; sets the trace-replay slot (wire.MAX_DATAGRAM)
_EARLY_S: Final = 0.0005  # deliver up to half a timer tick early rather than spin on the clock
_READ_BATCH: Final = 256  # TUN packets read per readiness callback (fairness between directions)
_RCVBUF: Final = 8 << 20
T = TypeVar("T")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DirectionSpec:
    """One direction of the emulated link."""

    rate_bps: float = 100e6  # 0: unlimited
    owd_s: float = 0.010
    loss: LossModel | None = None  # None: lossless
    queue_packets: int = 1000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_bps) and self.rate_bps >= 0):
            raise ValueError(f"rate_bps must be >= 0 (0 = unlimited), got {self.rate_bps!r}")
        if not (math.isfinite(self.owd_s) and 0 <= self.owd_s <= 60):
            raise ValueError(f"owd_s must be in [0, 60] seconds, got {self.owd_s!r}")
        if (
            isinstance(self.queue_packets, bool)
            or not isinstance(self.queue_packets, int)
            or self.queue_packets < 1
        ):
            raise ValueError(f"queue_packets must be an int >= 1, got {self.queue_packets!r}")
        if self.loss is not None and not isinstance(self.loss, LossModel):
            raise ValueError(f"loss must be a common.channel loss model or None, got {self.loss!r}")


@dataclass(frozen=True)
class EmulatorConfig:
    forward: DirectionSpec = field(default_factory=DirectionSpec)
    reverse: DirectionSpec = field(default_factory=DirectionSpec)
    seed: int = 1
    realization: int = 0


def parse_loss(spec: str) -> LossModel | None:
    """``none`` | ``bernoulli:P`` | ``ge:EG,EB,PGB,PBG`` | ``trace:PATH``; ``none`` and p=0 give None."""
    if spec.strip().lower() in ("none", "0", ""):
        return None
    return parse_loss_spec(spec)


# --------------------------------------------------------------------------- sans-IO pipeline


@dataclass
class DirectionStats:
    received: int = 0  # datagrams offered to this direction
    delivered: int = 0  # datagrams handed to the far side
    lost: int = 0  # dropped by the loss model
    queue_dropped: int = 0  # drop-tail
    send_errors: int = 0  # the far side's socket/TUN refused the write
    bytes_in: int = 0
    bytes_out: int = 0
    max_queue: int = 0  # most datagrams in the link at once


class LinkDirection:
    """Rate queue + loss + delay for one direction; pure computation over a caller-supplied clock."""

    def __init__(self, spec: DirectionSpec, rng: np.random.Generator) -> None:
        self.spec = spec
        self.stats = DirectionStats()
        self._rng = rng
        self._s_per_byte = 8.0 / spec.rate_bps if spec.rate_bps > 0 else 0.0
        rate = spec.rate_bps if spec.rate_bps > 0 else 1e9
        self._slot_s = NOMINAL_DATAGRAM * 8.0 / rate
        self._next_free = -math.inf
        self._in_link: deque[float] = deque()  # finish times of datagrams admitted and not yet serialised
        self._index = 0  # datagrams serialised so far (the loss realization's index)
        self._lost: list[bool] = []
        self._lost_base = 0
        if spec.loss is not None:
            self._refill()

    def _refill(self) -> None:
        assert self.spec.loss is not None
        self._lost_base += len(self._lost)
        self._lost = self.spec.loss.realize(LOSS_CHUNK, self._slot_s, self._rng).tolist()

    def offer(self, now: float, size: int) -> float | None:
        """A datagram of ``size`` bytes arrives at ``now``: its delivery time, or None when dropped."""
        st = self.stats
        st.received += 1
        st.bytes_in += size
        in_link = self._in_link
        if self._s_per_byte:
            while in_link and in_link[0] <= now:
                in_link.popleft()
            if len(in_link) >= self.spec.queue_packets:
                st.queue_dropped += 1
                return None
            start = now if now > self._next_free else self._next_free
            finish = start + size * self._s_per_byte
            self._next_free = finish
            in_link.append(finish)
            if len(in_link) > st.max_queue:
                st.max_queue = len(in_link)
        else:
            finish = now
        k = self._index
        self._index = k + 1
        if self.spec.loss is not None:
            i = k - self._lost_base
            if i >= len(self._lost):
                self._refill()
                i = k - self._lost_base
            if self._lost[i]:
                st.lost += 1
                return None
        return finish + self.spec.owd_s


def _directions(config: EmulatorConfig) -> tuple[LinkDirection, LinkDirection]:
    fwd = LinkDirection(config.forward, realization_rng(config.seed, config.realization, "forward"))
    rev = LinkDirection(config.reverse, realization_rng(config.seed, config.realization, "reverse"))
    return fwd, rev


class _Delivery:
    """FIFO of (deliver_at, payload) for one direction, drained by a single re-armed loop timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, link: LinkDirection, send: Callable[[bytes], bool]):
        self._loop = loop
        self._link = link
        self._send = send  # returns False when the write failed
        self._queue: deque[tuple[float, bytes]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def push(self, deliver_at: float, data: bytes) -> None:
        self._queue.append((deliver_at, data))
        if self._timer is None:
            self._arm(time.monotonic())

    def _arm(self, now: float) -> None:
        # call_later from the precise clock: uvloop's loop.time() is a coarser, cached copy.
        self._timer = self._loop.call_later(max(0.0, self._queue[0][0] - now), self._fire)

    def _fire(self) -> None:
        self._timer = None
        q = self._queue
        st = self._link.stats
        now = time.monotonic()
        horizon = now + _EARLY_S
        send = self._send
        while q and q[0][0] <= horizon:
            _, data = q.popleft()
            if send(data):
                st.delivered += 1
                st.bytes_out += len(data)
            else:
                st.send_errors += 1
        if q:
            self._arm(now)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)


# --------------------------------------------------------------------------- UDP relay


def _tune_socket(sock: socket.socket, rcvbuf: int) -> None:
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):  # SO_RCVBUFFORCE / SO_SNDBUFFORCE
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, rcvbuf)  # root: beyond net.core.*mem_max
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, opt, rcvbuf)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Proto(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, Any], None]) -> None:
        self.on_datagram = on_datagram
        self.errors = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:  # ICMP port unreachable etc.
        self.errors += 1


class UdpRelay:
    """Relay between one sender (``listen``) and one receiver (``forward_to``) through the emulated link.

    ``async with UdpRelay(cfg, ("127.0.0.1", 0), ("127.0.0.1", 7400)) as relay:`` then point the sender
    at ``relay.listen_address``. ``relay.forward.stats`` / ``relay.reverse.stats`` count everything.
    """

    def __init__(
        self,
        config: EmulatorConfig,
        listen: tuple[str, int],
        forward_to: tuple[str, int],
        *,
        socket_buffer_bytes: int = _RCVBUF,
    ) -> None:
        self.config = config
        self.listen = listen
        self.forward_to = forward_to
        self.forward, self.reverse = _directions(config)
        self.no_peer = 0  # replies that arrived before any sender did
        self._bufsize = socket_buffer_bytes
        self._down: asyncio.DatagramTransport | None = None
        self._up: asyncio.DatagramTransport | None = None
        self._peer: Any = None
        self._down_proto: _Proto | None = None
        self._up_proto: _Proto | None = None
        self._fwd_q: _Delivery | None = None
        self._rev_q: _Delivery | None = None

    @property
    def listen_address(self) -> tuple[str, int]:
        if self._down is None:
            raise RuntimeError("relay not started; use 'async with UdpRelay(...)' or await start()")
        host, port = self._down.get_extra_info("sockname")[:2]
        return str(host), int(port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        down_sock = socket.socket(_family(self.listen[0]), socket.SOCK_DGRAM)
        up_sock = socket.socket(_family(self.forward_to[0]), socket.SOCK_DGRAM)
        try:
            for s in (down_sock, up_sock):
                _tune_socket(s, self._bufsize)
                s.setblocking(False)
            down_sock.bind(self.listen)
            up_sock.connect(self.forward_to)
        except OSError as exc:
            down_sock.close()
            up_sock.close()
            raise OSError(
                exc.errno, f"relay: cannot bind {self.listen} / reach {self.forward_to}: {exc}"
            ) from exc
        down, self._down_proto = await loop.create_datagram_endpoint(
            lambda: _Proto(self._from_sender), sock=down_sock
        )
        up, self._up_proto = await loop.create_datagram_endpoint(
            lambda: _Proto(self._from_receiver), sock=up_sock
        )
        self._down, self._up = down, up
        self._fwd_q = _Delivery(loop, self.forward, self._send_up)
        self._rev_q = _Delivery(loop, self.reverse, self._send_down)

    def _send_up(self, data: bytes) -> bool:
        assert self._up is not None
        self._up.sendto(data)
        return True

    def _send_down(self, data: bytes) -> bool:
        assert self._down is not None
        self._down.sendto(data, self._peer)
        return True

    def _from_sender(self, data: bytes, addr: Any) -> None:
        self._peer = addr
        at = self.forward.offer(time.monotonic(), len(data))
        if at is not None:
            assert self._fwd_q is not None
            self._fwd_q.push(at, data)

    def _from_receiver(self, data: bytes, _addr: Any) -> None:
        if self._peer is None:
            self.no_peer += 1
            return
        at = self.reverse.offer(time.monotonic(), len(data))
        if at is not None:
            assert self._rev_q is not None
            self._rev_q.push(at, data)

    def in_flight(self) -> int:
        """Datagrams admitted and not yet delivered (both directions)."""
        return sum(len(q) for q in (self._fwd_q, self._rev_q) if q is not None)

    async def close(self) -> None:
        for q in (self._fwd_q, self._rev_q):
            if q is not None:
                q.close()
        for t in (self._down, self._up):
            if t is not None:
                t.close()
        self._down = self._up = None

    async def __aenter__(self) -> UdpRelay:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        # socket_errors: errors the kernel reported on either socket (ICMP port unreachable while the
        # receiver is not listening yet, ENOBUFS, ...); those datagrams are gone.
        errors = sum(p.errors for p in (self._down_proto, self._up_proto) if p is not None)
        return {
            "forward": asdict(self.forward.stats),
            "reverse": asdict(self.reverse.stats),
            "no_peer": self.no_peer,
            "socket_errors": errors,
        }


# --------------------------------------------------------------------------- network namespaces + TUN

_CLONE_NEWNET: Final = 0x40000000
_TUNSETIFF: Final = 0x400454CA
_IFF_TUN: Final = 0x0001
_IFF_NO_PI: Final = 0x1000
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,15}")


@dataclass(frozen=True)
class NetnsSpec:
    """Two namespaces joined by the emulator; side A is the sender's (forward = A -> B)."""

    ns_a: str = "pfec-a"
    ns_b: str = "pfec-b"
    dev: str = "pfec0"  # TUN name inside each namespace
    addr_a: str = "10.77.0.1"
    addr_b: str = "10.77.0.2"
    prefix: int = 30
    mtu: int = 1500

    def __post_init__(self) -> None:
        for name in ("ns_a", "ns_b", "dev"):
            v = getattr(self, name)
            if not _NAME_RE.fullmatch(v):
                raise ValueError(f"{name} {v!r}: use 1-15 characters of letters, digits, '_', '.', '-'")
        if self.ns_a == self.ns_b:
            raise ValueError(f"ns_a and ns_b must differ, both are {self.ns_a!r}")
        if not 576 <= self.mtu <= 9000:
            raise ValueError(f"mtu must be in 576..9000, got {self.mtu!r}")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _ip_ok(*args: str) -> None:
    proc = _ip(*args)
    if proc.returncode != 0:
        raise OSError(f"'ip {' '.join(args)}' failed: {proc.stderr.strip() or proc.stdout.strip()}")


def netns_available() -> tuple[bool, str]:
    """(True, "") when this process can create namespaces and TUN devices, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) to create network namespaces"
    if not sys.platform.startswith("linux"):
        return False, "network namespaces are Linux-only"
    if not os.path.exists("/dev/net/tun"):
        return False, "/dev/net/tun is missing (modprobe tun, or give the container the device)"
    try:
        proc = _ip("netns", "list")
    except FileNotFoundError:
        return False, "the 'ip' command (iproute2) is not installed"
    if proc.returncode != 0:
        return False, f"'ip netns list' failed: {proc.stderr.strip()}"
    return True, ""


def setup_namespaces(spec: NetnsSpec = NetnsSpec()) -> None:
    """Create both namespaces (loopback up). Refuses to reuse existing ones (they may not be ours)."""
    existing = set(_ip("netns", "list").stdout.split())
    clash = [n for n in (spec.ns_a, spec.ns_b) if n in existing]
    if clash:
        raise OSError(
            f"network namespace(s) {', '.join(clash)} already exist — remove them with "
            f"'ip netns del NAME' if they are stale, or choose other names"
        )
    created: list[str] = []
    try:
        for ns in (spec.ns_a, spec.ns_b):
            _ip_ok("netns", "add", ns)
            created.append(ns)
            _ip_ok("-n", ns, "link", "set", "lo", "up")
    except BaseException:
        for ns in created:
            _ip("netns", "del", ns)
        raise


def teardown_namespaces(spec: NetnsSpec = NetnsSpec()) -> None:
    """Delete both namespaces (missing ones are fine); their TUN devices go with them."""
    for ns in (spec.ns_a, spec.ns_b):
        _ip("netns", "del", ns)


_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _open_tun_in(ns: str, dev: str) -> int:
    """Create TUN ``dev`` inside namespace ``ns``; the fd works from any thread afterwards."""
    result: dict[str, Any] = {}

    def work() -> None:  # setns() switches only this helper thread
        try:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
                fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                result["fd"] = fd
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", dev.encode(), _IFF_TUN | _IFF_NO_PI))
                # No IPv6 on the link: router solicitations would take loss-realization slots.
                v6 = Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6")
                if v6.exists():
                    v6.write_text("1")
            finally:
                _setns(home)
                os.close(target)
                os.close(home)
        except BaseException as exc:
            result["error"] = exc

    t = threading.Thread(target=work, name=f"tun-{ns}")
    t.start()
    t.join()
    if "error" in result:
        if "fd" in result:
            os.close(result["fd"])
        raise OSError(f"cannot create TUN {dev!r} in namespace {ns!r}: {result['error']}")
    return int(result["fd"])


class TunBridge:
    """Pump IP packets between the TUN devices of two namespaces through the emulated link.

    ``setup_namespaces(spec)`` first (and ``teardown_namespaces(spec)`` in a ``finally``); then
    ``async with TunBridge(cfg, spec) as bridge:`` run ``ip netns exec <ns_b> ...`` daemons.
    """

    def __init__(self, config: EmulatorConfig, spec: NetnsSpec = NetnsSpec()) -> None:
        self.config = config
        self.spec = spec
        self.forward, self.reverse = _directions(config)
        self._fds: list[int] = []
        self._queues: list[_Delivery] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.spec
        try:
            fd_a = _open_tun_in(s.ns_a, s.dev)
            self._fds.append(fd_a)
            fd_b = _open_tun_in(s.ns_b, s.dev)
            self._fds.append(fd_b)
            for ns, addr in ((s.ns_a, s.addr_a), (s.ns_b, s.addr_b)):
                _ip_ok("-n", ns, "addr", "add", f"{addr}/{s.prefix}", "dev", s.dev)
                _ip_ok("-n", ns, "link", "set", "dev", s.dev, "mtu", str(s.mtu), "txqueuelen", "4096", "up")
        except BaseException:
            self._close_fds()
            raise
        fwd_q = _Delivery(loop, self.forward, lambda d: self._write(fd_b, d))
        rev_q = _Delivery(loop, self.reverse, lambda d: self._write(fd_a, d))
        self._queues = [fwd_q, rev_q]
        loop.add_reader(fd_a, self._pump, fd_a, self.forward, fwd_q)
        loop.add_reader(fd_b, self._pump, fd_b, self.reverse, rev_q)

    @staticmethod
    def _write(fd: int, data: bytes) -> bool:
        try:
            os.write(fd, data)
            return True
        except OSError:  # EAGAIN (TUN queue full) or the device went away: count, never raise
            return False

    @staticmethod
    def _pump(fd: int, link: LinkDirection, queue: _Delivery) -> None:
        now = time.monotonic()
        for _ in range(_READ_BATCH):
            try:
                pkt = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EIO):
                    return
                raise
            at = link.offer(now, len(pkt))
            if at is not None:
                queue.push(at, pkt)

    def _close_fds(self) -> None:
        loop = None
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
        for fd in self._fds:
            if loop is not None:
                loop.remove_reader(fd)
            os.close(fd)  # a non-persistent TUN disappears with its last fd
        self._fds = []

    async def close(self) -> None:
        for q in self._queues:
            q.close()
        self._queues = []
        self._close_fds()

    async def __aenter__(self) -> TunBridge:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        return {"forward": asdict(self.forward.stats), "reverse": asdict(self.reverse.stats)}


# --------------------------------------------------------------------------- event loop + CLI


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when installed (DESIGN: ~4x the datagram rate of asyncio), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _format_stats(t: float, stats: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> str:
    parts = [f"t={t:7.1f}s"]
    for name in ("forward", "reverse"):
        s = stats[name]
        p = prev[name] if prev else {"delivered": 0, "bytes_out": 0}
        pps = (s["delivered"] - p["delivered"]) / dt if dt > 0 else 0.0
        mbps = (s["bytes_out"] - p["bytes_out"]) * 8 / dt / 1e6 if dt > 0 else 0.0
        parts.append(
            f"{name[:3]}: in {s['received']} out {s['delivered']} lost {s['lost']} qdrop {s['queue_dropped']}"
            f" err {s['send_errors']} ({pps:.0f} pps, {mbps:.2f} Mbit/s)"
        )
    return " | ".join(parts)


async def _run_emulator(
    mode: str,
    config: EmulatorConfig,
    listen: tuple[str, int],
    forward_to: tuple[str, int],
    spec: NetnsSpec,
    stats_interval: float,
    duration: float,
    as_json: bool,
) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    front: UdpRelay | TunBridge = (
        UdpRelay(config, listen, forward_to) if mode == "relay" else TunBridge(config, spec)
    )
    async with front:
        if isinstance(front, UdpRelay):
            host, port = front.listen_address
            typer.echo(
                f"relay listening on {host}:{port}, forwarding to {forward_to[0]}:{forward_to[1]}", err=True
            )
        else:
            typer.echo(
                f"bridging {spec.ns_a} ({spec.addr_a}) <-> {spec.ns_b} ({spec.addr_b}) on {spec.dev}",
                err=True,
            )
        t0 = time.monotonic()
        cpu0 = time.process_time()
        prev: dict[str, Any] | None = None
        last = t0
        while not stop.is_set():
            wait = stats_interval if stats_interval > 0 else 3600.0
            if duration > 0:
                wait = min(wait, max(0.0, t0 + duration - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)
            now = time.monotonic()
            if stats_interval > 0 and not as_json:
                stats = front.stats()
                typer.echo(_format_stats(now - t0, stats, prev, now - last), err=True)
                prev, last = stats, now
            if duration > 0 and now - t0 >= duration:
                break
        stats = front.stats()
        # Process CPU (all threads) over the run: what an emulated datagram costs, cf. DESIGN's ~26 us.
        stats["elapsed_s"] = round(time.monotonic() - t0, 3)
        stats["cpu_s"] = round(time.process_time() - cpu0, 3)
        return stats


def emulate_cmd(
    mode: Annotated[
        str, typer.Option(help="relay: UDP relay (no root); netns: TUN between two namespaces (root).")
    ] = "relay",
    listen: Annotated[str, typer.Option(help="relay: HOST:PORT the sender sends to.")] = "0.0.0.0:7401",
    forward_to: Annotated[str, typer.Option(help="relay: the receiver's HOST:PORT.")] = "127.0.0.1:7400",
    rate_mbps: Annotated[float, typer.Option(help="Link rate, Mbit/s (0 = unlimited).")] = 100.0,
    reverse_rate_mbps: Annotated[
        float | None, typer.Option(help="Reverse link rate, Mbit/s (default: --rate-mbps).")
    ] = None,
    rtt_ms: Annotated[float, typer.Option(help="Round-trip time; each direction delays RTT/2.")] = 20.0,
    owd_ms: Annotated[
        float | None, typer.Option(help="One-way delay per direction (overrides --rtt-ms).")
    ] = None,
    loss: Annotated[
        str, typer.Option(help="Forward loss: none | bernoulli:P | ge:EG,EB,PGB,PBG | trace:PATH.")
    ] = "none",
    reverse_loss: Annotated[str, typer.Option(help="Reverse (ACK path) loss, same forms.")] = "none",
    seed: Annotated[int, typer.Option(help="Seed of the loss realizations (streams forward/reverse).")] = 1,
    realization: Annotated[int, typer.Option(help="Realization index (pairs runs with `pfec sim`).")] = 0,
    queue_packets: Annotated[
        int, typer.Option(help="Drop-tail queue limit per direction, datagrams.")
    ] = 1000,
    stats_interval: Annotated[
        float, typer.Option(help="Seconds between stats lines on stderr (0: none).")
    ] = 1.0,
    duration: Annotated[
        float, typer.Option(help="Stop after this many seconds (0: until SIGINT/SIGTERM).")
    ] = 0.0,
    ns_a: Annotated[str, typer.Option(help="netns: the sender's namespace.")] = "pfec-a",
    ns_b: Annotated[str, typer.Option(help="netns: the receiver's namespace.")] = "pfec-b",
    keep_namespaces: Annotated[
        bool, typer.Option(help="netns: leave the namespaces in place on exit.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the final counters as one JSON object.")
    ] = False,
) -> None:
    """Emulate a rate-limited, delayed, lossy link between a sender and a receiver (common/emulator.py)."""
    from pfec.common.node.config import parse_host_port

    def fail(msg: str) -> typer.Exit:
        typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
        return typer.Exit(2)

    if mode not in ("relay", "netns"):
        raise fail(f"--mode {mode!r}: use 'relay' or 'netns'")
    try:
        owd_s = (owd_ms if owd_ms is not None else rtt_ms / 2.0) / 1000.0
        rev_rate = rate_mbps if reverse_rate_mbps is None else reverse_rate_mbps
        config = EmulatorConfig(
            forward=DirectionSpec(rate_mbps * 1e6, owd_s, parse_loss(loss), queue_packets),
            reverse=DirectionSpec(rev_rate * 1e6, owd_s, parse_loss(reverse_loss), queue_packets),
            seed=seed,
            realization=realization,
        )
        listen_hp = parse_host_port(listen, allow_port_zero=True) if mode == "relay" else ("", 0)
        fwd_hp = parse_host_port(forward_to) if mode == "relay" else ("", 0)
        spec = NetnsSpec(ns_a=ns_a, ns_b=ns_b)
        if seed < 0 or realization < 0:
            raise ValueError(f"--seed and --realization must be >= 0, got {seed} and {realization}")
    except ValueError as exc:
        raise fail(str(exc)) from None
    mode_l: Literal["relay", "netns"] = "relay" if mode == "relay" else "netns"
    created = False
    try:
        if mode_l == "netns":
            ok, why = netns_available()
            if not ok:
                raise fail(f"--mode netns: {why}; use --mode relay instead")
            setup_namespaces(spec)
            created = True
        stats = run_event_loop(
            _run_emulator(mode_l, config, listen_hp, fwd_hp, spec, stats_interval, duration, as_json)
        )
    except OSError as exc:
        raise fail(str(exc)) from None
    finally:
        if created and not keep_namespaces:
            teardown_namespaces(spec)
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
    else:
        for name in ("forward", "reverse"):
            typer.echo(f"{name}: " + ", ".join(f"{k} {v}" for k, v in stats[name].items()), err=True)
        typer.echo(f"cpu {stats['cpu_s']} s over {stats['elapsed_s']} s", err=True)


if __name__ == "__main__":  # `python -m common.emulator ...` until `pfec emulate` is registered
    typer.run(emulate_cmd)
