"""UDP socket set-up shared by both daemons: large buffers, bound and connected sockets, and the Linux
segmentation offloads (GSO on the send side, GRO on the receive side) probed per socket.

Python's ``socket`` module exports none of the Linux constants used here, so they are spelled out.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

SO_RCVBUFFORCE: Final = 33  # Linux: SO_RCVBUF beyond net.core.rmem_max (needs CAP_NET_ADMIN)
SO_SNDBUFFORCE: Final = 32
UDP_SEGMENT: Final = 103  # linux/udp.h: send one buffer, the kernel cuts it into datagrams (GSO)
UDP_GRO: Final = 104  # linux/udp.h: receive a batch of datagrams as one buffer (GRO)

#: A peer's socket address as the socket module gives it: (host, port) for IPv4, (host, port, flowinfo,
#: scope_id) for IPv6.
PeerAddress = tuple[Any, ...]
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
RESOLVE_TIMEOUT_S: Final = 5.0


class DestinationRefused(ValueError):
    """A receiver address the sender will not stream to (or cannot resolve); the message says why."""


@dataclass(frozen=True, slots=True)
class Destination:
    """A receiver address resolved once: what the handoff's socket connects to and its report shows."""

    host: str  # as the client gave it
    port: int
    family: socket.AddressFamily
    sockaddr: PeerAddress

    @property
    def address(self) -> str:
        ip = str(self.sockaddr[0])
        return f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"


def parse_networks(networks: Sequence[str]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(n, strict=False) for n in networks)


def refusal_reason(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why the sender refuses to stream to ``ip`` by default (None: a plain unicast address)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return refusal_reason(ip.ipv4_mapped)
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_link_local:
        return "a link-local address (e.g. a cloud metadata service)"
    if isinstance(ip, ipaddress.IPv4Address) and (ip == ipaddress.IPv4Address("255.255.255.255")
                                                  or ip in ipaddress.IPv4Network("240.0.0.0/4")):
        return "a broadcast or reserved address"
    return None


def check_destination(ip_text: str, allow: Sequence[IPNetwork] = ()) -> None:
    """DestinationRefused unless ``ip_text`` is a unicast address or inside one of the ``allow`` networks."""
    ip = ipaddress.ip_address(ip_text.split("%", 1)[0])  # drop an IPv6 zone index
    why = refusal_reason(ip)
    if why is not None and not any(ip in net for net in allow):
        raise DestinationRefused(
            f"receiver: {ip} is {why}; the sender refuses it unless limits.allow_destinations lists it"
        )


async def resolve_destination(host: str, port: int, allow: Sequence[IPNetwork] = (),
                              timeout_s: float = RESOLVE_TIMEOUT_S) -> Destination:
    """Resolve ``host`` once, off the event loop (the loop's resolver thread), and check the address."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM), timeout_s)
    except (OSError, UnicodeError) as exc:
        raise DestinationRefused(f"receiver: cannot resolve {host!r} ({exc})") from None
    except TimeoutError:
        raise DestinationRefused(f"receiver: resolving {host!r} took over {timeout_s:g} s") from None
    if not infos:
        raise DestinationRefused(f"receiver: {host!r} resolves to no address")
    family, _type, _proto, _canon, sockaddr = infos[0]
    check_destination(str(sockaddr[0]), allow)
    return Destination(host, port, family, tuple(sockaddr))


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
