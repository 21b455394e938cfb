"""The simulator's engine: a sender session and a receiver endpoint joined by paced, lossy links in
simulated time (nothing sleeps).

A link serialises one datagram at a time (L bytes hold it for 8L/C seconds) and delivers it ``owd_s``
later unless its pre-drawn loss realization erases it. With a ``bottleneck`` (a trace-driven link,
:mod:`.rate_trace`, or a fixed-rate one the sender paces into at a rate of its own, :mod:`.path_link`),
C is the sender's pacing rate (its ``PathRate``'s, if it has one) and the datagram then waits in the
drop-tail queue: it arrives ``owd_s`` after leaving it, or is dropped when the queue is full. ``SimRun.drive``
advances ``now`` to the next thing that happens (the link frees up for the sender, a datagram arrives, a
session timer fires) and lets both sides react in a fixed order, so every run is reproducible. What the
handoff means (its payload, its score at the deadline) is the caller's: ``lab/sim/simulate.py``.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pfec.common.wire.messages import TYPE_MASK
from pfec.lab.sim.rate_trace import TraceQueue
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, OfferReceived, ReceiverStats
from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.session import Failed, SenderSession

_DATA_TYPES = (1, 2)  # wire type (the type byte's low six bits) of SOURCE and REPAIR


class SimLink:
    """One direction: serialisation queue + delay + loss from a pre-drawn realization."""

    def __init__(self, rate_bps: float, owd_s: float, lost: npt.NDArray[np.bool_] | None,
                 bottleneck: TraceQueue | None = None, controller: PathRate | None = None) -> None:
        self.rate_bps = rate_bps
        self.controller = controller  # paces at its rate instead of rate_bps (the sender's PathRate)
        self.owd_s = owd_s
        self.lost = lost
        self.bottleneck = bottleneck  # shared by the directions that share the physical link
        self.index = 0
        self.free_at = 0.0
        self.dropped = 0

    def transmit(self, size: int, now: float) -> tuple[float, float | None]:
        """Return (time the link is free again, arrival time or None when erased or queue-dropped)."""
        start = max(now, self.free_at)
        rate = self.rate_bps if self.controller is None else self.controller.pacing_bps
        self.free_at = start + size * 8 / rate
        left = self.free_at
        if self.bottleneck is not None:
            departure = self.bottleneck.send(self.free_at, size)
            if departure is None:  # drop-tail: the loss realization meets only what the queue admits
                self.dropped += 1
                return self.free_at, None
            left = departure
        lost = False
        if self.lost is not None:
            lost = bool(self.lost[self.index % len(self.lost)])
            self.index += 1
        if lost:
            self.dropped += 1
            return self.free_at, None
        return self.free_at, left + self.owd_s


@dataclass
class SimLinks:
    """The three directions of one realization. ``ctl`` carries OFFER/CLOSE on the data link's timeline
    (one physical link: control waits for data too) but draws its losses from its own stream."""

    data: SimLink
    ctl: SimLink
    rev: SimLink


@dataclass(frozen=True)
class DeadlineScore:
    """The receiver's state at its deadline, scored."""

    complete: npt.NDArray[np.bool_]  # per block id: every fragment decoded
    utility: float
    blocks: int
    decoded: int
    redundant: int
    stats: ReceiverStats
    decoded_ids: npt.NDArray[np.int64] | None = None  # queue entries (fragment ids / stream indices) decoded
    computed_tokens: int = 0  # a split: context tokens [0, c) the receiver computed itself
    at: float = math.nan  # when the receiver stopped decoding (ready, or its deadline)


class ReceiverApp(Protocol):
    """What the receiver's application does besides decoding (a split's front prefill): its own timer, and
    the OFFER that starts it. ``SimRun`` without one runs a plain whole-cache handoff."""

    def on_offer(self, event: OfferReceived, now: float) -> None: ...

    def get_timer(self) -> float | None: ...

    def handle_timer(self, now: float) -> None: ...


class SimRun:
    """One realization: both sides, the links and the datagrams in flight. ``score`` is what
    ``on_deadline`` made of the receiver's deadline; ``failure`` the sender's last reported failure."""

    def __init__(self, sender: SenderSession, endpoint: ReceiverEndpoint, links: SimLinks,
                 on_deadline: Callable[[DeadlineReached], DeadlineScore],
                 app: ReceiverApp | None = None) -> None:
        self.sender = sender
        self.endpoint = endpoint
        self.links = links
        self.on_deadline = on_deadline
        self.app = app
        self.heap: list[tuple[float, int, bool, bytes]] = []  # (time, seq, to_receiver, datagram)
        self.seq = 0
        self.sender_ready = True
        self.score: DeadlineScore | None = None
        self.failure: str | None = None

    def drive(self) -> None:
        now = 0.0
        self.sender.start(now)
        self.sender_ready = True
        while True:
            if self.sender_ready and now >= self.links.data.free_at and self._send_next(now):
                continue
            t_next = self._next_event_at()
            if t_next == math.inf:
                break
            now = max(now, t_next)
            self._deliver(now)
            self._fire_timers(now)
            self._serve_receiver(now)
            self._serve_sender()

    def _push(self, arrival: float, to_receiver: bool, datagram: bytes) -> None:
        heapq.heappush(self.heap, (arrival, self.seq, to_receiver, datagram))
        self.seq += 1

    def _send_next(self, now: float) -> bool:
        """Put the sender's next datagram on the link; False when it has nothing to send now."""
        datagram = self.sender.next_datagram(now)
        if datagram is None:
            self.sender_ready = False
            return False
        data, ctl = self.links.data, self.links.ctl
        link = data if datagram[1] & TYPE_MASK in _DATA_TYPES else ctl
        ctl.free_at = data.free_at  # one physical link: control waits for data too
        free_at, arrival = link.transmit(len(datagram), now)
        data.free_at = ctl.free_at = free_at
        if arrival is not None:
            self._push(arrival, True, datagram)
        return True

    def _next_event_at(self) -> float:
        # Runs about twice per simulated datagram: plain comparisons, no list.
        at = self.links.data.free_at if self.sender_ready else math.inf
        if self.heap and self.heap[0][0] < at:
            at = self.heap[0][0]
        for timer in (self.sender.get_timer(), self.endpoint.get_timer(),
                      None if self.app is None else self.app.get_timer()):
            if timer is not None and timer < at:
                at = timer
        return at

    def _deliver(self, now: float) -> None:
        heap = self.heap
        while heap and heap[0][0] <= now:
            _t, _s, to_receiver, datagram = heapq.heappop(heap)
            if to_receiver:
                self.endpoint.receive_datagram(datagram, now)
            else:
                self.sender.receive_datagram(datagram, now)
                self.sender_ready = True

    def _fire_timers(self, now: float) -> None:
        timer = self.sender.get_timer()
        if timer is not None and timer <= now:
            self.sender.handle_timer(now)
            self.sender_ready = True
        timer = self.endpoint.get_timer()
        if timer is not None and timer <= now:
            self.endpoint.handle_timer(now)
        if self.app is not None and (timer := self.app.get_timer()) is not None and timer <= now:
            self.app.handle_timer(now)

    def _serve_receiver(self, now: float) -> None:
        """Score the deadline and answer it with a RESULT; feedback goes back over the reverse link."""
        endpoint = self.endpoint
        while (event := endpoint.next_event()) is not None:
            if isinstance(event, OfferReceived) and self.app is not None:
                self.app.on_offer(event, now)
            elif isinstance(event, DeadlineReached):
                self.score = self.on_deadline(event)
                session = endpoint.sessions[event.session_id]
                session.send_result(json.dumps({"decoded": len(event.decoded_esis)}).encode(), now)
        for _sid, datagram in endpoint.datagrams_to_send():
            _free, arrival = self.links.rev.transmit(len(datagram), now)
            if arrival is not None:
                self._push(arrival, False, datagram)

    def _serve_sender(self) -> None:
        while (event := self.sender.next_event()) is not None:
            if isinstance(event, Failed):
                self.failure = event.reason
