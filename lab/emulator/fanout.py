"""The emulator's fan-out front end: one sender, one shared uplink, then one branch per receiver.

It plays an edge site's multicast for a sender with several receivers (issue 37): one copy in, one copy
out per receiver. Forward, a datagram crosses the **uplink** once (``EmulatorConfig.forward``: rate,
drop-tail queue or a rate trace, as ``link``), then each receiver's **branch** (its own one-way delay and
seeded loss, no rate of its own). Reverse, a receiver's datagram crosses its branch's reverse delay and
loss and the shared reverse uplink (``EmulatorConfig.reverse``), computed uplink first: with ACK-sized
datagrams the order does not matter, and the shared queue sees its arrivals in time order.

Addresses. The relay listens for the sender on two kinds of socket:

- the **group port** (``listen``): what arrives there goes to every receiver, the site's multicast group;
  a fan-out stream's destination is this address;
- one **receiver port** per receiver (``listen`` port + 1 + i, or ephemeral when ``listen`` has port 0):
  what arrives there goes to receiver i only; a sender addresses receiver i's unicast handshake, ACK path
  and any unicast session there.

Each receiver has its own socket connected to it, so receiver i sees every copy, group or unicast, coming
from one relay address and answers there; its datagrams go back to the sender from receiver port i. The
sender therefore tells its receivers apart by source address, exactly as without the relay. A receiver's
datagrams go to the last sender address seen on its receiver port, else on the group port.

Loss streams are seeded per branch (``realization_rng(seed, realization, "forward-i")`` and
``"reverse-i"``), so two receivers never share an erasure pattern; the uplink keeps the ``forward`` and
``reverse`` streams (lossless unless its spec has a loss). Counters: ``stats()`` gives the uplink's two
directions (delivered there means left the bottleneck) and each receiver's.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Final

from pfec.common.node.udp import set_buffers
from pfec.lab.emulator.link import DeliveryQueue, DirectionSpec, EmulatorConfig, LinkDirection, LinkFront
from pfec.lab.emulator.relay import _RCVBUF, _family, _Proto
from pfec.lab.sim.channel import LossModel, realization_rng

__all__ = ["MAX_RECEIVERS", "Branch", "FanoutRelay", "branch_directions"]

MAX_RECEIVERS: Final = 8  # as POST /handoffs' receivers


@dataclass(frozen=True)
class Branch:
    """One receiver's own path after the uplink: its address, one-way delay and losses."""

    address: tuple[str, int]
    owd_s: float = 0.010
    loss: LossModel | None = None
    reverse_loss: LossModel | None = None

    def __post_init__(self) -> None:
        DirectionSpec(rate_bps=0, owd_s=self.owd_s, loss=self.loss)  # the same checks as one link's
        DirectionSpec(rate_bps=0, owd_s=self.owd_s, loss=self.reverse_loss)


def branch_directions(config: EmulatorConfig, branches: Sequence[Branch]
                      ) -> list[tuple[LinkDirection, LinkDirection]]:
    """(forward, reverse) of each branch: no rate, its delay, its loss on its own seeded stream."""
    out = []
    for i, b in enumerate(branches):
        fwd = LinkDirection(DirectionSpec(rate_bps=0, owd_s=b.owd_s, loss=b.loss),
                            realization_rng(config.seed, config.realization, f"forward-{i}"))
        rev = LinkDirection(DirectionSpec(rate_bps=0, owd_s=b.owd_s, loss=b.reverse_loss),
                            realization_rng(config.seed, config.realization, f"reverse-{i}"))
        out.append((fwd, rev))
    return out


class FanoutRelay(LinkFront):
    """The group port, one receiver port per receiver, one socket per receiver; see the module docstring.

    ``async with FanoutRelay(cfg, ("127.0.0.1", 0), branches) as relay:`` then stream to
    ``relay.listen_address`` and address receiver i at ``relay.receiver_addresses[i]``. ``cfg.forward`` and
    ``cfg.reverse`` are the uplink's; give them owd 0 for the branches' delays alone.
    """

    def __init__(
        self,
        config: EmulatorConfig,
        listen: tuple[str, int],
        branches: Sequence[Branch],
        *,
        socket_buffer_bytes: int = _RCVBUF,
    ) -> None:
        if not 1 <= len(branches) <= MAX_RECEIVERS:
            raise ValueError(f"a fan-out relay has 1..{MAX_RECEIVERS} receivers, got {len(branches)}")
        if len({b.address for b in branches}) != len(branches):
            raise ValueError("a receiver appears twice among the fan-out relay's --forward-to")
        super().__init__(config)
        self.listen = listen
        self.branches = tuple(branches)
        self.paths = branch_directions(config, self.branches)
        self.no_peer = 0  # receivers' datagrams that arrived before the sender had sent anything
        self._bufsize = socket_buffer_bytes
        self._group: asyncio.DatagramTransport | None = None
        self._fronts: list[asyncio.DatagramTransport] = []
        self._ups: list[asyncio.DatagramTransport] = []
        self._protos: list[_Proto] = []
        self._fwd_qs: list[DeliveryQueue] = []
        self._rev_qs: list[DeliveryQueue] = []
        self._group_peer: Any = None
        self._peers: list[Any] = [None] * len(self.branches)

    @property
    def listen_address(self) -> tuple[str, int]:
        """The group port: a fan-out stream's destination."""
        if self._group is None:
            raise RuntimeError("relay not started; use 'async with FanoutRelay(...)' or await start()")
        host, port = self._group.get_extra_info("sockname")[:2]
        return str(host), int(port)

    @property
    def receiver_addresses(self) -> list[tuple[str, int]]:
        """Receiver i's port on the relay: where the sender addresses receiver i."""
        out = []
        for t in self._fronts:
            host, port = t.get_extra_info("sockname")[:2]
            out.append((str(host), int(port)))
        return out

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        socks = self._open_sockets()
        n = len(self.branches)
        try:
            await self._endpoint(socks[0], partial(self._from_sender, receiver=None))
            for i in range(n):
                front = await self._endpoint(socks[1 + i], partial(self._from_sender, receiver=i))
                self._fronts.append(front)
                self._ups.append(await self._endpoint(socks[1 + n + i], partial(self._from_receiver, i)))
                fwd, rev = self.paths[i]
                self._fwd_qs.append(DeliveryQueue(loop, fwd, partial(self._send_up, i)))
                self._rev_qs.append(DeliveryQueue(loop, rev, partial(self._send_down, i)))
        except BaseException:
            await self.close()
            raise

    async def _endpoint(self, sock: socket.socket, on_datagram: Callable[[bytes, Any], None]
                        ) -> asyncio.DatagramTransport:
        transport, proto = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Proto(on_datagram), sock=sock)
        self._protos.append(proto)
        if self._group is None:
            self._group = transport
        return transport

    def _open_sockets(self) -> list[socket.socket]:
        """[group, receiver port 0..n-1, socket connected to receiver 0..n-1], non-blocking, large buffers."""
        host, port = self.listen
        fronts = [(host, 0 if port == 0 else port + 1 + i) for i in range(len(self.branches))]
        socks: list[socket.socket] = []
        try:
            for bind_to in (self.listen, *fronts):
                s = socket.socket(_family(host), socket.SOCK_DGRAM)
                socks.append(s)
                set_buffers(s, self._bufsize, self._bufsize)
                s.setblocking(False)
                s.bind(bind_to)
            for b in self.branches:
                s = socket.socket(_family(b.address[0]), socket.SOCK_DGRAM)
                socks.append(s)
                set_buffers(s, self._bufsize, self._bufsize)
                s.setblocking(False)
                s.connect(b.address)
        except OSError as exc:
            for s in socks:
                s.close()
            raise OSError(exc.errno, f"fan-out relay: cannot bind {self.listen} (and the receiver ports "
                                     f"after it) / reach the receivers: {exc}") from exc
        return socks

    def _from_sender(self, data: bytes, addr: Any, *, receiver: int | None) -> None:
        """Group (``receiver`` None): across the uplink once, then to every branch; else to one branch."""
        if receiver is None:
            self._group_peer = addr
        else:
            self._peers[receiver] = addr
        at = self.forward.offer(time.monotonic(), len(data))
        if at is None:
            return
        up = self.forward.stats
        up.delivered += 1
        up.bytes_out += len(data)
        targets = range(len(self.branches)) if receiver is None else (receiver,)
        for i in targets:
            arrive = self.paths[i][0].offer(at, len(data))
            if arrive is not None:
                self._fwd_qs[i].push(arrive, data)

    def _from_receiver(self, i: int, data: bytes, _addr: Any) -> None:
        if self._peers[i] is None and self._group_peer is None:
            self.no_peer += 1
            return
        at = self.reverse.offer(time.monotonic(), len(data))
        if at is None:
            return
        up = self.reverse.stats
        up.delivered += 1
        up.bytes_out += len(data)
        arrive = self.paths[i][1].offer(at, len(data))
        if arrive is not None:
            self._rev_qs[i].push(arrive, data)

    def _send_up(self, i: int, data: bytes) -> bool:
        self._ups[i].sendto(data)
        return True

    def _send_down(self, i: int, data: bytes) -> bool:
        peer = self._peers[i] if self._peers[i] is not None else self._group_peer
        self._fronts[i].sendto(data, peer)
        return True

    def in_flight(self) -> int:
        """Datagrams admitted and not yet delivered (every branch, both directions)."""
        return sum(len(q) for q in (*self._fwd_qs, *self._rev_qs))

    async def close(self) -> None:
        for q in (*self._fwd_qs, *self._rev_qs):
            q.close()
        for t in (self._group, *self._fronts, *self._ups):
            if t is not None:
                t.close()
        self._group = None
        self._fronts, self._ups, self._fwd_qs, self._rev_qs = [], [], [], []

    def stats(self) -> dict[str, Any]:
        addresses = self.receiver_addresses if self._fronts else [None] * len(self.branches)
        receivers = []
        for b, (fwd, rev), front in zip(self.branches, self.paths, addresses, strict=True):
            receivers.append({
                "address": f"{b.address[0]}:{b.address[1]}",
                "relay_port": None if front is None else front[1],
                "owd_ms": round(b.owd_s * 1000, 3),
                "forward": asdict(fwd.snapshot()),
                "reverse": asdict(rev.snapshot()),
            })
        errors = sum(p.errors for p in self._protos)
        return {"uplink": super().stats(), "receivers": receivers, "no_peer": self.no_peer,
                "socket_errors": errors}
