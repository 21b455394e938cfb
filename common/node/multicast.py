"""The multicast fan-out's group destinations (issue 37 item 3): the ``[udp] multicast_group`` setting,
its checks, and the sockets that send to a group or join one.

A group destination is ``IP:PORT``: an IPv4 multicast group (224.0.0.0/4; receivers join it on the
configured interface and the kernel replicates each datagram), or any unicast address, which plays the
site's multicast (a relay that replicates, e.g. ``pfec emulate --mode relay`` with several
``--forward-to``). Literal addresses only: a sender compares a request's group with its configured ones
exactly, and nothing is resolved.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Sequence
from typing import Final

from pfec.common.node.udp import set_buffers

__all__ = ["MAX_GROUPS", "check_group", "check_groups", "group_key", "is_multicast", "join_socket",
           "send_socket"]

MAX_GROUPS: Final = 8  # configured group destinations per node
MAX_TTL: Final = 32


def group_key(text: str) -> tuple[str, int]:
    """``IP:PORT`` as (normalised IP, port): how two spellings of one group compare equal."""
    form = f"{str(text).strip()!r}: a group destination is a literal IP:PORT (e.g. 239.1.2.3:7500, or a " \
        "relay's 127.0.0.1:7401; [v6]:PORT), PORT in 1..65535, no host names"
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError(form)
    stripped = text.strip()
    if stripped.startswith("["):
        host, sep, port_s = stripped[1:].partition("]:")
    else:
        host, sep, port_s = stripped.rpartition(":")
    try:
        ip = ipaddress.ip_address(host)
        port = int(port_s)
    except ValueError:
        raise ValueError(form) from None
    if not sep or not 1 <= port <= 65535 or (ip.version == 6) != stripped.startswith("["):
        raise ValueError(form)
    return str(ip), port


def check_group(text: str) -> str:
    """One group destination, checked (ValueError says why); returned as given, stripped."""
    group_key(text)
    return text.strip()


def check_groups(groups: Sequence[str]) -> list[str]:
    """The configured group destinations: at most ``MAX_GROUPS``, each IP:PORT, none twice."""
    if len(groups) > MAX_GROUPS:
        raise ValueError(f"at most {MAX_GROUPS} group destinations, got {len(groups)}")
    seen: dict[tuple[str, int], int] = {}
    for i, text in enumerate(groups):
        try:
            key = group_key(text)
        except ValueError as exc:
            raise ValueError(f"entry {i}: {exc}") from None
        if key in seen:
            raise ValueError(f"entry {i}: {text.strip()!r} is entry {seen[key]} again")
        seen[key] = i
    return [g.strip() for g in groups]


def is_multicast(text: str) -> bool:
    """Whether the group destination is an IPv4 multicast group (else a unicast address, e.g. a relay)."""
    ip = ipaddress.ip_address(group_key(text)[0])
    return isinstance(ip, ipaddress.IPv4Address) and ip.is_multicast


def send_socket(group: str, interface: str | None, ttl: int, sndbuf: int) -> socket.socket:
    """A non-blocking UDP socket for one fan-out: its group datagrams go to ``group`` (through
    ``interface``, with ``ttl`` hops, looped back to local members when it is a multicast group), and its
    unicast handshakes, ACKs and RESULTs go through it too (the members reply to its address)."""
    host, _port = group_key(group)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        set_buffers(sock, 1 << 20, sndbuf)
        if is_multicast(group):
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, min(max(ttl, 1), MAX_TTL))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
            if interface is not None:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    except OSError:
        sock.close()
        raise
    return sock


def join_socket(group: str, interface: str | None, rcvbuf: int) -> socket.socket:
    """A non-blocking UDP socket bound to an IPv4 multicast group's port, member of the group on
    ``interface`` (an IPv4 address; None: the kernel's choice). OSError when the kernel refuses."""
    host, port = group_key(group)
    if not is_multicast(group):
        raise ValueError(f"{group!r} is not an IPv4 multicast group: nothing to join")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setblocking(False)
        set_buffers(sock, rcvbuf, 1 << 16)
        sock.bind((host, port))  # the group's address: only its datagrams, not every one to the port
        membership = struct.pack("4s4s", socket.inet_aton(host), socket.inet_aton(interface or "0.0.0.0"))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
    except OSError:
        sock.close()
        raise
    return sock
