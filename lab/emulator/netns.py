"""The emulator's privileged front end: two network namespaces joined by TUN devices (root only).

``setup_namespaces`` creates two namespaces; ``TunBridge`` creates one TUN device in each (inside the
namespace with ``setns(2)`` via ctypes from a helper thread), addressed 10.77.0.1/30 and 10.77.0.2/30, and
writes the IP packets read from one TUN to the other through the emulated link (``link``), so
daemons started with ``ip netns exec pfec-a|pfec-b`` talk real IP/UDP or TCP. Sizes are whole IP packets.
Only the namespaces this module created are touched; nothing is routed to other networks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pfec.lab.emulator.link import DeliveryQueue, EmulatorConfig, LinkDirection, LinkFront

__all__ = ["NetnsSpec", "Tap", "TunBridge", "netns_available", "setup_namespaces", "teardown_namespaces"]

_CLONE_NEWNET: Final = 0x40000000
_TUNSETIFF: Final = 0x400454CA
_IFF_TUN: Final = 0x0001
_IFF_NO_PI: Final = 0x1000
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_READ_BATCH: Final = 256  # TUN packets read per readiness callback (fairness between directions)
#: Sees each packet one direction admitted or dropped: (arrival time, IP packet, delivery time or None).
Tap = Callable[[float, bytes, float | None], None]


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


# --------------------------------------------------------------------------- namespaces


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


# --------------------------------------------------------------------------- TUN devices

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


class TunBridge(LinkFront):
    """Pump IP packets between the TUN devices of two namespaces through the emulated link.

    ``setup_namespaces(spec)`` first (and ``teardown_namespaces(spec)`` in a ``finally``); then
    ``async with TunBridge(cfg, spec) as bridge:`` run ``ip netns exec <ns_b> ...`` daemons.
    ``forward_tap(now, packet, deliver_at or None)`` sees every forward packet the link admitted or dropped
    (``flows.FlowMeter.record``: who got how much of the bottleneck).
    """

    def __init__(
        self,
        config: EmulatorConfig,
        spec: NetnsSpec = NetnsSpec(),
        forward_tap: Tap | None = None,
    ) -> None:
        super().__init__(config)
        self.spec = spec
        self._forward_tap = forward_tap
        self._fds: list[int] = []
        self._queues: list[DeliveryQueue] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        fd_a, fd_b = self._open_devices()
        fwd_q = DeliveryQueue(loop, self.forward, lambda d: self._write(fd_b, d))
        rev_q = DeliveryQueue(loop, self.reverse, lambda d: self._write(fd_a, d))
        self._queues = [fwd_q, rev_q]
        loop.add_reader(fd_a, self._pump, fd_a, self.forward, fwd_q, self._forward_tap)
        loop.add_reader(fd_b, self._pump, fd_b, self.reverse, rev_q, None)

    def _open_devices(self) -> tuple[int, int]:
        """Both TUN devices, addressed and up: (side A's fd, side B's fd)."""
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
        return fd_a, fd_b

    @staticmethod
    def _write(fd: int, data: bytes) -> bool:
        try:
            os.write(fd, data)
            return True
        except OSError:  # EAGAIN (TUN queue full) or the device went away: count, never raise
            return False

    @staticmethod
    def _pump(fd: int, link: LinkDirection, queue: DeliveryQueue, tap: Tap | None) -> None:
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
            if tap is not None:
                tap(now, pkt, at)
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
