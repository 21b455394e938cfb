"""The emulator's unprivileged front end: a UDP relay between one sender and one receiver.

The relay listens for the sender on ``listen``, forwards to ``forward_to`` from a socket connected to it,
and relays the replies to the sender's last address; both directions cross the emulated link
(``link``). Sizes are UDP payloads, as in the simulator's slot model.

``listen`` may be an IPv4 multicast group: the relay then joins it (on the interface whose address is
``multicast_interface``, else the one the group's route names) and is one receiver's last mile behind a
LAN that replicates the group in the kernel (tests/test_multicast_netns.py); replies go back unicast.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from typing import Any, Final

from pfec.common.node.udp import set_buffers
from pfec.lab.emulator.link import DeliveryQueue, EmulatorConfig, LinkFront

__all__ = ["UdpRelay", "is_multicast_group", "join_group"]

_RCVBUF: Final = 8 << 20


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_multicast_group(host: str) -> bool:
    """Whether ``host`` is an IPv4 multicast group address (224.0.0.0/4)."""
    try:
        return ipaddress.ip_address(host).version == 4 and ipaddress.ip_address(host).is_multicast
    except ValueError:
        return False


def join_group(sock: socket.socket, group: tuple[str, int], interface: str | None = None) -> None:
    """Bind ``sock`` to the group's port (shared with other members) and join the group on the interface
    with address ``interface`` (None: the one the kernel's route for the group names)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(group)
    mreq = socket.inet_aton(group[0]) + socket.inet_aton(interface or "0.0.0.0")
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)


class _Proto(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, Any], None]) -> None:
        self.on_datagram = on_datagram
        self.errors = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:  # ICMP port unreachable etc.
        self.errors += 1


class UdpRelay(LinkFront):
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
        multicast_interface: str | None = None,
    ) -> None:
        super().__init__(config)
        self.listen = listen
        self.forward_to = forward_to
        self.multicast_interface = multicast_interface
        self.no_peer = 0  # replies that arrived before any sender did
        self._bufsize = socket_buffer_bytes
        self._down: asyncio.DatagramTransport | None = None
        self._up: asyncio.DatagramTransport | None = None
        self._peer: Any = None
        self._down_proto: _Proto | None = None
        self._up_proto: _Proto | None = None
        self._fwd_q: DeliveryQueue | None = None
        self._rev_q: DeliveryQueue | None = None

    @property
    def listen_address(self) -> tuple[str, int]:
        if self._down is None:
            raise RuntimeError("relay not started; use 'async with UdpRelay(...)' or await start()")
        host, port = self._down.get_extra_info("sockname")[:2]
        return str(host), int(port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        down_sock, up_sock = self._open_sockets()
        down, self._down_proto = await loop.create_datagram_endpoint(
            lambda: _Proto(self._from_sender), sock=down_sock
        )
        up, self._up_proto = await loop.create_datagram_endpoint(
            lambda: _Proto(self._from_receiver), sock=up_sock
        )
        self._down, self._up = down, up
        self._fwd_q = DeliveryQueue(loop, self.forward, self._send_up)
        self._rev_q = DeliveryQueue(loop, self.reverse, self._send_down)

    def _open_sockets(self) -> tuple[socket.socket, socket.socket]:
        """(bound towards the sender, connected to the receiver), non-blocking with large buffers."""
        down_sock = socket.socket(_family(self.listen[0]), socket.SOCK_DGRAM)
        up_sock = socket.socket(_family(self.forward_to[0]), socket.SOCK_DGRAM)
        try:
            for s in (down_sock, up_sock):
                set_buffers(s, self._bufsize, self._bufsize)
                s.setblocking(False)
            if is_multicast_group(self.listen[0]):
                join_group(down_sock, self.listen, self.multicast_interface)
            else:
                down_sock.bind(self.listen)
            up_sock.connect(self.forward_to)
        except OSError as exc:
            down_sock.close()
            up_sock.close()
            raise OSError(
                exc.errno, f"relay: cannot bind {self.listen} / reach {self.forward_to}: {exc}"
            ) from exc
        return down_sock, up_sock

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

    def stats(self) -> dict[str, Any]:
        # socket_errors: errors the kernel reported on either socket (ICMP port unreachable while the
        # receiver is not listening yet, ENOBUFS, ...); those datagrams are gone.
        errors = sum(p.errors for p in (self._down_proto, self._up_proto) if p is not None)
        return {**super().stats(), "no_peer": self.no_peer, "socket_errors": errors}
