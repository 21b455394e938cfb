"""The emulated link itself: per-direction rate queue, seeded loss and delay, and the timed delivery queue.

Per direction (forward = towards the receiver, reverse = back) a datagram goes through:

1. **Queue admission** (drop-tail): at most ``queue_packets`` datagrams may be in the link at once
   (waiting or being serialised); the rest are dropped and counted as ``queue_dropped``.
2. **Serialisation** at ``rate_bps`` in virtual time: ``finish = max(now, next_free) + 8 L / C``. A rate of
   0 means unlimited (no serialisation time, no queue). With a ``rate_trace`` (Mahimahi format,
   :mod:`pfec.lab.sim.rate_trace`) steps 1-2 are the trace's drop-tail bottleneck instead, sized in
   bytes (``queue_bytes``, else ``DEFAULT_QUEUE_MS`` at the trace's mean rate), its clock starting with
   the direction's first datagram. Either way each datagram's time from arrival to leaving the
   bottleneck is sampled for the queueing-delay percentiles (``queue_delay_ms_p50/p95/p99``).
3. **Loss** on the wire: the k-th datagram serialised in this direction is lost when ``lost[k]`` of the
   direction's loss realization is True (``pfec.lab.sim.channel`` models; generator
   ``realization_rng(seed, realization, "forward" | "reverse")``, the streams the simulator uses, so a
   seeded run drops the same datagram indices as the simulator's slot model). A lost datagram still used
   its link time, as on a real wire. The realization is drawn in chunks of ``LOSS_CHUNK`` datagrams
   (Bernoulli and GE prefixes are exact; a GE chain restarts from its stationary law every chunk).
   Trace replay maps datagram k to trace time ``k * slot_s``, ``slot_s`` = one 1,400-byte datagram's
   serialisation time.
4. **Delay**: delivered at ``finish + owd_s`` through ``loop.call_at`` on one FIFO timer per direction
   (order is preserved). Event-loop timers have ~1 ms granularity, so deliveries come in up-to-1-ms
   batches; rate and delay are exact on average.

The pipeline (``LinkDirection``) is sans-IO: it takes ``now`` and a size and returns the delivery time.
``DeliveryQueue`` is the asyncio half that hands datagrams over at those times; ``LinkFront`` is what the
two front ends (``emulator_relay.UdpRelay``, ``emulator_netns.TunBridge``) share.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, Final, Self

import numpy as np

from pfec.lab.sim.channel import LossModel, parse_loss_spec, realization_rng
from pfec.lab.sim.rate_trace import RateTrace, TraceQueue, queue_limit_bytes

__all__ = [
    "LOSS_CHUNK",
    "DeliveryQueue",
    "DirectionSpec",
    "DirectionStats",
    "EmulatorConfig",
    "LinkDirection",
    "LinkFront",
    "link_directions",
    "parse_loss",
]

LOSS_CHUNK: Final = 1 << 16
NOMINAL_DATAGRAM: Final = 1400  # bytes; sets the trace-replay slot (wire.MAX_DATAGRAM)
_EARLY_S: Final = 0.0005  # deliver up to half a timer tick early rather than spin on the clock


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DirectionSpec:
    """One direction of the emulated link."""

    rate_bps: float = 100e6  # 0: unlimited
    owd_s: float = 0.010
    loss: LossModel | None = None  # None: lossless
    queue_packets: int = 1000
    rate_trace: RateTrace | None = None  # the rate follows this trace (rate_bps and queue_packets unused)
    queue_bytes: int | None = None  # the trace's bottleneck depth (None: DEFAULT_QUEUE_MS at its mean rate)

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
            raise ValueError(f"loss must be a pfec.lab.sim.channel loss model or None, got {self.loss!r}")
        if self.queue_bytes is not None and (not isinstance(self.queue_bytes, int) or self.queue_bytes < 1):
            raise ValueError(f"queue_bytes must be an int >= 1 or None, got {self.queue_bytes!r}")


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
    queue_delay_ms_p50: float | None = None  # arrival -> leaving the bottleneck (``LinkDirection.snapshot``)
    queue_delay_ms_p95: float | None = None
    queue_delay_ms_p99: float | None = None


DELAY_SAMPLES: Final = 1 << 18  # queueing delays kept per direction (then a uniform reservoir)


class LinkDirection:
    """Rate queue + loss + delay for one direction; pure computation over a caller-supplied clock."""

    def __init__(self, spec: DirectionSpec, rng: np.random.Generator) -> None:
        self.spec = spec
        self.stats = DirectionStats()
        self._rng = rng
        trace = spec.rate_trace
        self._trace = None if trace is None else TraceQueue(trace, queue_limit_bytes(trace, None,
                                                                                      spec.queue_bytes))
        self._trace_origin: float | None = None  # the first datagram's arrival: the trace's time 0
        self._delays = np.empty(DELAY_SAMPLES, dtype=np.float32)  # s, arrival -> leaving the bottleneck
        self._delays_seen = 0
        self._reservoir = np.random.default_rng(0)  # not the loss stream: seeded runs drop the same indices
        self._s_per_byte = 8.0 / spec.rate_bps if spec.rate_bps > 0 and trace is None else 0.0
        rate = trace.mean_rate_bps if trace is not None else spec.rate_bps if spec.rate_bps > 0 else 1e9
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
        if self._trace is not None:
            origin = self._trace_origin
            if origin is None:
                origin = self._trace_origin = now
            left = self._trace.send(now - origin, size)
            if left is None:
                st.queue_dropped += 1
                return None
            finish = origin + left
            self._sample_delay(finish - now)
        elif self._s_per_byte:
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
            self._sample_delay(finish - now)
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

    def _sample_delay(self, delay_s: float) -> None:
        """Keep a queueing delay: every one until ``DELAY_SAMPLES``, then a uniform reservoir."""
        seen = self._delays_seen
        self._delays_seen = seen + 1
        if seen < DELAY_SAMPLES:
            self._delays[seen] = delay_s
        else:
            slot = int(self._reservoir.integers(seen + 1))
            if slot < DELAY_SAMPLES:
                self._delays[slot] = delay_s

    def snapshot(self) -> DirectionStats:
        """The counters, with the queueing-delay percentiles so far (None before any datagram)."""
        st = self.stats
        kept = self._delays[: min(self._delays_seen, DELAY_SAMPLES)]
        if kept.size:
            p50, p95, p99 = np.percentile(kept, (50, 95, 99)) * 1000
            st.queue_delay_ms_p50, st.queue_delay_ms_p95, st.queue_delay_ms_p99 = (
                round(float(p50), 3), round(float(p95), 3), round(float(p99), 3))
        return st


def link_directions(config: EmulatorConfig) -> tuple[LinkDirection, LinkDirection]:
    """(forward, reverse) pipelines on the config's seeded loss streams."""
    fwd = LinkDirection(config.forward, realization_rng(config.seed, config.realization, "forward"))
    rev = LinkDirection(config.reverse, realization_rng(config.seed, config.realization, "reverse"))
    return fwd, rev


# --------------------------------------------------------------------------- timed delivery


class DeliveryQueue:
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


class LinkFront:
    """What both front ends share: the two link directions, ``async with`` start/close, the counters."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.forward, self.reverse = link_directions(config)

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        return {"forward": asdict(self.forward.snapshot()), "reverse": asdict(self.reverse.snapshot())}
