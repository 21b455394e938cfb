"""One handoff on the wire: a ``SenderSession`` (sans-IO) driven over its own connected UDP socket, paced
to the link rate, with the session's timer on the event loop.

Pacing follows the link's clock (``LinkClock``, shared by concurrent handoffs: they share the uplink):
a datagram may leave once the link time of the datagrams before it (8L/C each) has passed. Each
wake-up sends every datagram whose slot has come, then sleeps with ``loop.call_at`` until the next slot
but at least ``MIN_SLEEP_S`` (timer granularity is ~1 ms; at 100 Mbit/s a slot is ~100 us, so
per-packet timers would be far too coarse). A late wake-up (a busy loop, a descheduled process) catches
up on missed slots, at most ``MAX_BACKLOG_S`` of them: the average rate stays the link's, as the
simulator assumes, while the queue this can build downstream stays a few milliseconds long. When the
session has nothing to send (it waits for feedback) the pacer idles until an ACK or a session timer
wakes it; idle slots are not saved up.

The datagrams of one wake-up leave together: runs of equal-sized datagrams go out as one UDP GSO send
(``UDP_SEGMENT``, Linux >= 4.18: the kernel cuts the buffer into datagrams), one system call for up to
``GSO_MAX_SEGMENTS`` of them instead of one each, which is most of a datagram's CPU on the send side.
Without GSO (another kernel, an error) each datagram goes through the transport as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pfec.common.events import Event
from pfec.common.node.metrics import JUNK_REASONS, TYPE_BYTE_LABELS, DropExporter
from pfec.common.node.udp import UDP_SEGMENT, Destination, PeerAddress, connect_udp_socket, has_gso
from pfec.common.plan.handoff import ResultApp
from pfec.sender.handoffs import Handoff
from pfec.sender.metrics import SenderMetrics
from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.session import (
    Accepted,
    Failed,
    PathBroken,
    Refused,
    ResultReceived,
    SenderSession,
    SendingStopped,
)

log = logging.getLogger("pfec.sender")
clock = time.monotonic  # the loop's clock base at full resolution (uvloop's loop.time() steps in ms)
MAX_BACKLOG_S = 0.005  # missed link time a late wake-up may catch up on (bounds the queue it builds)
MIN_SLEEP_S = 0.0005
MAX_PER_WAKE = 256  # datagrams per wake-up before yielding to the loop (ACKs must get in)
GSO_MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS
GSO_MAX_BYTES = 65000  # one GSO send is one UDP datagram to the stack: 16-bit length
LINGER_S = 0.1  # keep the socket after the end so the CLOSE leaves and late datagrams are absorbed


def _buffered(transport: asyncio.DatagramTransport) -> int:
    """Bytes the transport still queues (uvloop and asyncio both have it; typeshed lacks it)."""
    size: Callable[[], int] | None = getattr(transport, "get_write_buffer_size", None)
    return size() if size is not None else 0


class _SocketProtocol(asyncio.DatagramProtocol):
    def __init__(self, transfer: PacedTransfer) -> None:
        self.transfer = transfer

    def datagram_received(self, data: bytes, addr: PeerAddress) -> None:
        self.transfer.guarded(self.transfer.on_datagram, data)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable: the receiver is not there (yet)
        self.transfer.socket_errors += 1


@dataclass
class LinkClock:
    """The link's transmit clock, shared by every transfer paced at this rate (one uplink, one budget):
    ``next_send`` is when the link is free for the next datagram. With a ``controller`` (the receiver's
    path measured, ``PathRate``) the rate is the controller's, read for every datagram."""

    rate_bps: float
    next_send: float = 0.0
    controller: PathRate | None = None

    @property
    def pacing_bps(self) -> float:
        return self.rate_bps if self.controller is None else self.controller.pacing_bps


class PacedTransfer:
    """One handoff on the wire: session + connected socket + pacer + timer."""

    def __init__(self, handoff: Handoff, session: SenderSession, link: LinkClock,
                 metrics: SenderMetrics) -> None:
        self.handoff = handoff
        self.session = session
        self.link = link
        self.congestion_at_start = 0 if link.controller is None else link.controller.congestion_events
        self.metrics = metrics
        self.cpu = session.cpu
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.DatagramTransport | None = None
        self._sock: socket.socket | None = None
        self._gso = False  # the kernel segments batched sends (probed at open)
        self._batch: list[bytes] = []
        self.socket_errors = 0
        self.bytes_sent = 0
        self.last_data_at: float | None = None
        self.stopped_at: float | None = None
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self._pump_handle: asyncio.Handle | None = None
        self._idle = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._drops = DropExporter(metrics)
        self.result: ResultApp | None = None
        self.failure: str | None = None
        self.outcome = "failed"

    async def open(self, destination: Destination, sndbuf: int) -> None:
        """Connect this handoff's socket to ``destination`` (resolved and checked once, by the daemon)."""
        sock = connect_udp_socket(destination.family, destination.sockaddr, sndbuf, sndbuf)
        self.transport, _ = await self.loop.create_datagram_endpoint(lambda: _SocketProtocol(self), sock=sock)
        self._sock = sock
        self._gso = has_gso(sock)

    def guarded(self, step: Callable[..., None], *args: Any) -> None:
        """Run one adapter step; a bug in it fails this handoff (reported), never the daemon or the loop."""
        try:
            step(*args)
        except Exception as exc:
            log.exception("handoff %s: internal error", self.handoff.id)
            self.failure = f"internal error: {type(exc).__name__}: {exc}"
            self.outcome = "failed"
            for handle in (self._pump_handle, self._timer):
                if handle is not None:
                    handle.cancel()
            self._pump_handle = self._timer = None
            self._send_close("sender internal error")
            if not self.finished.done():
                self.finished.set_result(None)

    def _send_close(self, reason: str) -> None:
        """Best effort after an internal error: let the session queue its CLOSE and send it at once."""
        with contextlib.suppress(Exception):
            self.session.cancel(reason, clock())
            self._send_control()

    def _send_control(self) -> None:
        """Send what an ended session queued (its CLOSE: a session that is done or failed sends no data)
        now, not in a pacing slot: a slot can lie far ahead (a trickle pace while the in-flight cap binds,
        an estimate cut to the floor) and the socket closes ``LINGER_S`` after the end."""
        transport = self.transport
        for _ in range(8):
            datagram = self.session.next_datagram(clock())
            if datagram is None or transport is None:
                break
            if self._send_one(transport, datagram):
                self._count_sent(datagram[1], 1, len(datagram), clock())

    # ------------------------------------------------------------------ pacing
    def start(self) -> None:
        now = clock()
        self.session.start(now)
        self.link.next_send = max(self.link.next_send, now)
        self._pump()

    def _wake_pump(self) -> None:
        if self._idle and self._pump_handle is None:
            self._idle = False
            self.link.next_send = max(self.link.next_send, clock())  # unused slots are gone
            self._pump_handle = self.loop.call_soon(self.guarded, self._pump)

    def _pump(self) -> None:
        self._pump_handle = None
        transport = self.transport
        if transport is None:
            return
        now = clock()
        link = self.link
        if link.next_send < now - MAX_BACKLOG_S:
            link.next_send = now - MAX_BACKLOG_S
        sent = self._fill_batch(now)
        if self._batch:
            self._send_batch(transport, self._batch, now)
            self._batch.clear()
        self._service()
        if not self._idle and self._pump_handle is None and self.transport is not None:
            at = max(link.next_send, now + MIN_SLEEP_S) if sent < MAX_PER_WAKE else now
            if at > now:
                self._pump_handle = self.loop.call_at(at, self.guarded, self._pump)
            else:
                self._pump_handle = self.loop.call_soon(self.guarded, self._pump)

    def _fill_batch(self, now: float) -> int:
        """Take every datagram whose link slot has come (at most ``MAX_PER_WAKE``); returns how many."""
        link = self.link
        session = self.session
        cpu = self.cpu
        batch = self._batch
        sent = 0
        while link.next_send <= now and sent < MAX_PER_WAKE:
            decisions = cpu.decisions if cpu is not None else 0
            policy_ns = cpu.policy_ns if cpu is not None else 0
            datagram = session.next_datagram(now)
            if cpu is not None and cpu.decisions != decisions:
                view = session.view
                self.metrics.scheduler_decision((cpu.policy_ns - policy_ns) * 1e-9, view.window_size,
                                                view.deficit_estimate)
            if datagram is None:
                self._idle = True
                break
            batch.append(datagram)
            link.next_send += len(datagram) * 8 / link.pacing_bps
            sent += 1
        return sent

    def _send_batch(self, transport: asyncio.DatagramTransport, batch: list[bytes], now: float) -> None:
        """Send a wake-up's datagrams in order: runs of equal size as GSO sends, the rest one by one."""
        i, n = 0, len(batch)
        while i < n:
            size = len(batch[i])
            j = i + 1
            limit = min(n, i + GSO_MAX_SEGMENTS, i + max(1, GSO_MAX_BYTES // size))
            while j < limit and len(batch[j]) == size:
                j += 1
            if j - i > 1 and self._gso and not _buffered(transport):
                sent = self._send_gso(transport, batch, i, j, size)
            else:
                sent = sum(self._send_one(transport, batch[k]) for k in range(i, j))
            if sent:
                self._count_sent(batch[i][1], sent, size * sent, now)
            i = j

    def _send_gso(self, transport: asyncio.DatagramTransport, batch: list[bytes], i: int, j: int,
                  size: int) -> int:
        """Datagrams ``batch[i:j]`` (all ``size`` bytes) in one GSO send; returns how many left."""
        assert self._sock is not None
        try:
            self._sock.sendmsg([b"".join(batch[i:j])],
                               [(socket.IPPROTO_UDP, UDP_SEGMENT, size.to_bytes(2, "little"))])
            return j - i
        except BlockingIOError:  # socket buffer full: the transport queues them, in order
            pass
        except OSError as exc:  # no GSO after all (EIO, EINVAL...): datagram by datagram from now on
            log.info("UDP GSO send failed (%s); sending datagrams one by one", exc)
            self._gso = False
        return sum(self._send_one(transport, batch[k]) for k in range(i, j))

    def _send_one(self, transport: asyncio.DatagramTransport, datagram: bytes) -> int:
        try:
            transport.sendto(datagram)
        except OSError:
            self.metrics.dropped("send_failed")
            return 0
        return 1

    def _count_sent(self, type_byte: int, count: int, nbytes: int, now: float) -> None:
        kind = TYPE_BYTE_LABELS.get(type_byte, "source")
        self.metrics.datagrams_sent(kind, count, nbytes)
        self.bytes_sent += nbytes
        if kind in ("source", "repair"):
            self.last_data_at = now

    # ------------------------------------------------------------------ feedback and timers
    def on_datagram(self, data: bytes) -> None:
        now = clock()
        drops = self.session.drops
        before = {reason: drops.get(reason) for reason in JUNK_REASONS}
        self.session.receive_datagram(data, now)
        junk = any(drops.get(reason) is not count for reason, count in before.items())
        # Junk (unparseable or not authentic) counts as junk, never by the type byte it claims.
        kind = "junk" if junk or len(data) < 2 else TYPE_BYTE_LABELS.get(data[1], "junk")
        self.metrics.datagram_received(kind, len(data))
        self._wake_pump()
        self._service()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.session.handle_timer(clock())
        self._wake_pump()
        self._service()

    def _service(self) -> None:
        while (event := self.session.next_event()) is not None:
            self._on_event(event)
        self._drops.export(self.session.drops)
        at = self.session.get_timer()
        if at != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._timer_at = at
            if at is not None:
                self._timer = self.loop.call_at(at, self.guarded, self._on_timer)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, Accepted):
            self.handoff.report["accepted"] = True
            self.handoff.stated_receiver = event.receiver
            stated = event.receiver
            self.handoff.report["receiver_stated_prefill"] = (
                None if stated is None else {**stated.prefill.to_dict(), "decode_s": stated.decode_s})
        elif isinstance(event, SendingStopped):
            self.stopped_at = clock()
            self.handoff.state = "draining"
        elif isinstance(event, ResultReceived):
            try:
                self.result = ResultApp.decode(event.app_blob)
                if self.result.error:
                    self.failure = f"receiver failed: {self.result.error}"
                else:
                    self.outcome = "done"
            except ValueError as exc:
                self.failure = str(exc)
            self._finish()
        elif isinstance(event, Refused):
            self.outcome = "refused"
        elif isinstance(event, PathBroken):
            self.handoff.report["circuit_breaker"] = event.reason
            self.metrics.circuit_breaker_tripped()
        elif isinstance(event, Failed):
            self.failure = event.reason
            self._finish()

    def _finish(self) -> None:
        if self.finished.done():
            return
        self._send_control()  # the CLOSE after a RESULT or a failure
        self.finished.set_result(None)

    def cancel(self, reason: str) -> None:
        """Give up now: the session queues a CLOSE for the receiver and reports the failure."""
        self.session.cancel(reason, clock())
        self.outcome = "cancelled"
        self._service()

    async def close(self) -> None:
        await asyncio.sleep(LINGER_S)
        for handle in (self._pump_handle, self._timer):
            if handle is not None:
                handle.cancel()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
