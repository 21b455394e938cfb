"""UDP socket set-up shared by both daemons: large buffers, bound and connected sockets, and the Linux
segmentation offloads (GSO on the send side, GRO on the receive side) probed per socket.

Python's ``socket`` module exports none of the Linux constants used here, so they are spelled out.
"""

from __future__ import annotations

import socket
from typing import Any, Final

SO_RCVBUFFORCE: Final = 33  # Linux: SO_RCVBUF beyond net.core.rmem_max (needs CAP_NET_ADMIN)
SO_SNDBUFFORCE: Final = 32
UDP_SEGMENT: Final = 103  # linux/udp.h: send one buffer, the kernel cuts it into datagrams (GSO)
UDP_GRO: Final = 104  # linux/udp.h: receive a batch of datagrams as one buffer (GRO)

#: A peer's socket address as the socket module gives it: (host, port) for IPv4, (host, port, flowinfo,
#: scope_id) for IPv6.
PeerAddress = tuple[Any, ...]


def set_buffers(sock: socket.socket, rcvbuf: int, sndbuf: int) -> None:
    """Large socket buffers: the FORCE options as root (beyond net.core.rmem_max), else the capped ones."""
    for force, plain, size in ((SO_RCVBUFFORCE, socket.SO_RCVBUF, rcvbuf),
                               (SO_SNDBUFFORCE, socket.SO_SNDBUF, sndbuf)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)
        except OSError:  # EPERM without CAP_NET_ADMIN, or not Linux
            sock.setsockopt(socket.SOL_SOCKET, plain, size)


def open_udp_socket(host: str, port: int, rcvbuf: int, sndbuf: int) -> socket.socket:
    """A bound, non-blocking UDP socket with big buffers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        set_buffers(sock, rcvbuf, sndbuf)
        sock.setblocking(False)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind UDP {host}:{port}: {exc.strerror}") from exc
    return sock


def connect_udp_socket(family: socket.AddressFamily, sockaddr: PeerAddress, rcvbuf: int,
                       sndbuf: int) -> socket.socket:
    """A non-blocking UDP socket with big buffers, connected to ``sockaddr`` (from ``getaddrinfo``)."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        set_buffers(sock, rcvbuf, sndbuf)
        sock.setblocking(False)
        sock.connect(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


def has_gso(sock: socket.socket) -> bool:
    """Whether the kernel segments batched sends on ``sock`` (UDP_SEGMENT, Linux >= 4.18)."""
    try:
        sock.getsockopt(socket.IPPROTO_UDP, UDP_SEGMENT)
    except OSError:
        return False
    return True


def enable_gro(sock: socket.socket) -> bool:
    """Ask for GRO batches on ``sock`` (Linux >= 5.0); False where the kernel does not offer it."""
    try:
        sock.setsockopt(socket.IPPROTO_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True
