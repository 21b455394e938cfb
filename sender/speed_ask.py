"""The speed query on the wire (``transport/speed_query.py`` is the sans-IO part): one connected UDP socket,
the tries on the loop's timer, the first valid answer or the last try's timeout ends it."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from pfec.common.node.udp import Destination, PeerAddress, connect_udp_socket
from pfec.sender.transport.speed_query import SpeedAnswer, SpeedQuery

clock = time.monotonic
SOCKET_BUFFER = 1 << 16


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, query: SpeedQuery, answered: asyncio.Event) -> None:
        self.query = query
        self.answered = answered

    def datagram_received(self, data: bytes, addr: PeerAddress) -> None:
        self.query.receive(data, clock())
        if self.query.answer is not None:
            self.answered.set()

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable: the next try, or the timeout
        pass


async def ask_speed(destination: Destination, psk: bytes, fingerprint: bytes, expected_rtt_s: float,
                    *, authenticate: bool = True) -> SpeedAnswer:
    """Ask the receiver at ``destination`` its prefill speed; never raises for what the network does."""
    loop = asyncio.get_running_loop()
    query = SpeedQuery(psk, fingerprint, secrets.randbits(64), clock(), expected_rtt_s,
                       authenticate=authenticate)
    answered = asyncio.Event()
    sock = connect_udp_socket(destination.family, destination.sockaddr, SOCKET_BUFFER, SOCKET_BUFFER)
    transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(query, answered), sock=sock)
    try:
        while query.answer is None:
            now = clock()
            datagram = query.datagram(now)
            if datagram is not None:
                with contextlib.suppress(OSError):
                    transport.sendto(datagram)
            query.expire(now)
            wake = query.timer
            if wake is None:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(answered.wait(), max(0.0, wake - clock()))
    finally:
        transport.close()
    assert query.answer is not None
    return query.answer
