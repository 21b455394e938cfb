"""Trace-driven link rate (sans-IO): Mahimahi delivery-opportunity traces and the drop-tail bottleneck
queue the simulator and the emulator put them behind.

A trace (the format of Mahimahi's ``mm-link`` and of ``../shared/traces/``) has one line per delivery
opportunity of one 1,500-byte packet, the line's number its time in ms from the start; a time repeats when
several packets may leave in the same millisecond. The trace loops when it ends: its period is the last
line's time, so the next pass's first opportunity comes that much after the first pass's. Scaled by K,
every line carries K x 1,500 bytes: a link K times faster with the same shape.

``TraceQueue`` is the bottleneck: datagrams wait first in, first out, and each opportunity carries up to
its bytes (a datagram larger than what an opportunity has left takes the rest of it and as many of the
next as it needs; what an opportunity leaves over goes to the next datagram in the queue, and is lost
when none waits, as on a cellular link whose scheduler grants the air time whether or not it is used).
The queue is drop-tail, sized in bytes (``queue_limit_bytes`` turns milliseconds at the trace's mean rate
into bytes): a datagram that would not fit is dropped.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_QUEUE_MS",
    "OPPORTUNITY_BYTES",
    "RateTrace",
    "TraceError",
    "TraceQueue",
    "constant_trace",
    "load_rate_trace",
    "markov_trace",
    "parse_rate_trace",
    "queue_limit_bytes",
    "rotated",
    "step_trace",
]

OPPORTUNITY_BYTES: Final = 1500  # one Mahimahi delivery opportunity
DEFAULT_QUEUE_MS: Final = 100.0  # the bottleneck's default depth, at the trace's mean rate
MAX_TRACE_FILE_BYTES: Final = 64 << 20  # a trace file larger than this is refused before it is read
MAX_TRACE_LINES: Final = 10_000_000


class TraceError(ValueError):
    """A trace file or line that is not a Mahimahi trace: the message names the file and the line."""


@dataclass(frozen=True)
class RateTrace:
    """One period of delivery opportunities (ms, non-decreasing), looped; ``scale`` opportunities'
    worth of bytes per line."""

    opportunities_ms: npt.NDArray[np.int64]
    period_ms: int
    scale: float
    name: str

    def __post_init__(self) -> None:
        times = self.opportunities_ms
        if times.ndim != 1 or times.size == 0:
            raise TraceError(f"{self.name}: no delivery opportunities")
        if int(times[0]) < 0 or np.any(np.diff(times) < 0):
            raise TraceError(f"{self.name}: opportunities must be non-negative and non-decreasing")
        if self.period_ms != int(times[-1]) or self.period_ms <= 0:
            raise TraceError(f"{self.name}: the period is the last opportunity's time and must be > 0 ms")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise TraceError(f"{self.name}: rate scale must be a number > 0, got {self.scale!r}")

    @property
    def bytes_per_opportunity(self) -> float:
        return OPPORTUNITY_BYTES * self.scale

    @property
    def mean_rate_bps(self) -> float:
        """The rate the trace delivers on average over its period."""
        return self.opportunities_ms.size * self.bytes_per_opportunity * 8 / (self.period_ms / 1000)

    def opportunity_s(self, index: int) -> float:
        """The time of opportunity ``index`` (0: the first of the first period), in s."""
        cycle, within = divmod(index, self.opportunities_ms.size)
        return (cycle * self.period_ms + int(self.opportunities_ms[within])) / 1000

    def first_at_or_after(self, t_s: float) -> int:
        """The index of the first opportunity at or after ``t_s`` (>= 0)."""
        t_ms = max(0.0, t_s) * 1000
        cycle = int(t_ms // self.period_ms)
        within = t_ms - cycle * self.period_ms
        index = int(np.searchsorted(self.opportunities_ms, within, side="left"))
        if index == self.opportunities_ms.size:
            cycle, index = cycle + 1, 0
        return cycle * self.opportunities_ms.size + index

    def rates_bps(self, window_s: float = 1.0) -> npt.NDArray[np.float64]:
        """The rate delivered in each whole ``window_s`` of one period."""
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window must be > 0 s, got {window_s!r}")
        edges = np.arange(0.0, self.period_ms / 1000 + 1e-12, window_s) * 1000
        counts = np.histogram(self.opportunities_ms, bins=edges)[0] if edges.size > 1 else np.zeros(0)
        return counts * self.bytes_per_opportunity * 8 / window_s


def parse_rate_trace(lines: Iterable[str], name: str, scale: float = 1.0) -> RateTrace:
    """A trace from its lines; TraceError naming ``name`` and the line for a line that is not a whole,
    non-negative number of ms, a time before the line above it, no lines, or a last time of 0."""
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise TraceError(f"--rate-scale must be a number > 0, got {scale!r}")
    times: list[int] = []
    for number, raw in enumerate(lines, start=1):
        if number > MAX_TRACE_LINES:
            raise TraceError(f"{name}: more than {MAX_TRACE_LINES} lines")
        text = raw.strip()
        if not text.isdigit():  # also refuses signs, decimals and blank lines
            what = "negative" if text.startswith("-") and text[1:].isdigit() else "not a whole number of ms"
            raise TraceError(f"{name}:{number}: {text[:40]!r} is {what}")
        value = int(text)
        if times and value < times[-1]:
            raise TraceError(f"{name}:{number}: {value} ms comes before the line above it ({times[-1]} ms)")
        times.append(value)
    if not times:
        raise TraceError(f"{name}: the trace is empty")
    if times[-1] == 0:
        raise TraceError(f"{name}: every opportunity is at 0 ms (the trace needs a period > 0)")
    return RateTrace(np.asarray(times, dtype=np.int64), times[-1], float(scale), name)


def load_rate_trace(path: str | Path, scale: float = 1.0) -> RateTrace:
    """The trace in the file at ``path`` (a path the operator gave; nothing from the network names one)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_TRACE_FILE_BYTES:
            raise TraceError(f"{path}: {size} bytes, above the {MAX_TRACE_FILE_BYTES} a trace may have")
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc})") from None
    return parse_rate_trace(text.splitlines(), str(path), scale)


def queue_limit_bytes(trace: RateTrace, queue_ms: float | None = None, queue_bytes: int | None = None) -> int:
    """The bottleneck's depth: ``queue_bytes``, else ``queue_ms`` (default ``DEFAULT_QUEUE_MS``) at the
    trace's mean rate; at least one opportunity's worth."""
    if queue_bytes is not None:
        if queue_bytes <= 0:
            raise ValueError(f"queue size must be > 0 bytes, got {queue_bytes!r}")
        return int(queue_bytes)
    ms = DEFAULT_QUEUE_MS if queue_ms is None else queue_ms
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"queue depth must be > 0 ms, got {ms!r}")
    return max(math.ceil(trace.bytes_per_opportunity), math.ceil(trace.mean_rate_bps / 8 * ms / 1000))


def rotated(trace: RateTrace, offset_s: float) -> RateTrace:
    """The same looped trace started ``offset_s`` into its period (at the first opportunity there), so
    short handoffs can meet different stretches of one trace; the period and every opportunity are kept."""
    if offset_s % (trace.period_ms / 1000) == 0:
        return trace
    times = trace.opportunities_ms
    at = int(times[trace.first_at_or_after(offset_s % (trace.period_ms / 1000)) % times.size])
    shifted = np.where(times > at, times - at, times - at + trace.period_ms)
    return RateTrace(np.sort(shifted), trace.period_ms, trace.scale, f"{trace.name} from {at / 1000:g} s")


def _trace_from_rates(rates_mbps: npt.NDArray[np.float64], name: str) -> RateTrace:
    """A trace whose millisecond i carries ``rates_mbps[i]``, opportunities spread evenly (the fractional
    rest carried into the next millisecond)."""
    per_ms = np.asarray(rates_mbps, dtype=np.float64) * 1e6 / 8 / 1000 / OPPORTUNITY_BYTES
    if per_ms.size == 0 or not np.all(np.isfinite(per_ms)) or np.any(per_ms < 0):
        raise ValueError("rates must be finite and >= 0 Mbit/s")
    counts = np.diff(np.floor(np.concatenate(([0.0], np.cumsum(per_ms)))).astype(np.int64)).astype(np.int64)
    times = np.repeat(np.arange(1, per_ms.size + 1, dtype=np.int64), counts)
    if times.size == 0 or times[-1] != per_ms.size:  # the period is the last line: end on the last ms
        times = np.append(times, per_ms.size)
    return RateTrace(times, int(per_ms.size), 1.0, name)


def constant_trace(rate_mbps: float) -> RateTrace:
    """A fixed-rate link as a trace: every millisecond carries ``rate_mbps``' worth of bytes (the
    bottleneck of a fixed-rate link whose sender paces at a rate of its own)."""
    if not (math.isfinite(rate_mbps) and rate_mbps > 0):
        raise ValueError(f"the link rate must be > 0 Mbit/s, got {rate_mbps!r}")
    per_ms_bytes = rate_mbps * 1e6 / 8 / 1000
    return RateTrace(np.ones(1, dtype=np.int64), 1, per_ms_bytes / OPPORTUNITY_BYTES, f"{rate_mbps:g} Mbit/s")


def step_trace(rates_mbps: Iterable[float], seconds_each: float) -> RateTrace:
    """A trace of rate steps: each rate held for ``seconds_each``, then the next (a test link)."""
    rates = np.asarray(list(rates_mbps), dtype=np.float64)
    ms = round(seconds_each * 1000)
    if ms <= 0:
        raise ValueError(f"each step must last >= 1 ms, got {seconds_each!r} s")
    return _trace_from_rates(np.repeat(rates, ms), f"steps {list(rates)} x {seconds_each:g} s")


def markov_trace(rates_mbps: Iterable[float], mean_hold_s: float, seconds: float, seed: int) -> RateTrace:
    """A Markov-modulated rate: a chain over ``rates_mbps`` that holds each state for an exponential time of
    mean ``mean_hold_s`` and then jumps to another state chosen uniformly (a test link)."""
    rates = np.asarray(list(rates_mbps), dtype=np.float64)
    if rates.size < 2 or not (mean_hold_s > 0 and seconds > 0):
        raise ValueError("a Markov trace needs >= 2 rates, a hold > 0 s and a length > 0 s")
    rng = np.random.default_rng(seed)
    total_ms = round(seconds * 1000)
    per_ms = np.empty(total_ms, dtype=np.float64)
    state, at = int(rng.integers(rates.size)), 0
    while at < total_ms:
        hold = max(1, round(rng.exponential(mean_hold_s) * 1000))
        per_ms[at : at + hold] = rates[state]
        at += hold
        state = (state + 1 + int(rng.integers(rates.size - 1))) % rates.size
    return _trace_from_rates(per_ms, f"markov {list(rates)} hold {mean_hold_s:g} s seed {seed}")


class TraceQueue:
    """The drop-tail bottleneck over a trace (sans-IO: ``now`` is passed in, in s on the trace's clock)."""

    __slots__ = ("_credit", "_index", "_queue", "backlog_bytes", "delays_s", "delivered", "dropped",
                 "limit_bytes", "trace")

    def __init__(self, trace: RateTrace, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"queue size must be > 0 bytes, got {limit_bytes!r}")
        self.trace = trace
        self.limit_bytes = limit_bytes
        self._queue: deque[tuple[float, int]] = deque()  # (departure s, bytes) of each datagram queued
        self._index = 0  # the opportunity whose bytes are being used
        self._credit = 0.0  # bytes it has left (0: none taken yet)
        self.backlog_bytes = 0  # bytes queued, not yet departed, as of the newest send
        self.delivered = 0
        self.dropped = 0
        self.delays_s: list[float] = []  # each admitted datagram's wait to its departure (queueing delay)

    def send(self, now: float, size: int) -> float | None:
        """When a datagram of ``size`` bytes entering the queue at ``now`` leaves the bottleneck (its
        last byte's opportunity), or None when the queue has no room for it (dropped)."""
        queue = self._queue
        while queue and queue[0][0] <= now:
            self.backlog_bytes -= queue.popleft()[1]
        if self.backlog_bytes + size > self.limit_bytes:
            self.dropped += 1
            return None
        trace = self.trace
        full = trace.bytes_per_opportunity
        if not queue and (self._credit <= 0 or trace.opportunity_s(self._index) < now):
            self._index = trace.first_at_or_after(now)  # idle: the opportunities before now went unused
            self._credit = full
        need = float(size)
        while need > self._credit:
            need -= self._credit
            self._index += 1
            self._credit = full
        self._credit -= need
        departure = trace.opportunity_s(self._index)
        if self._credit <= 0:  # used up: the next datagram starts on the next opportunity
            self._index += 1
            self._credit = full
        queue.append((departure, size))
        self.backlog_bytes += size
        self.delivered += 1
        self.delays_s.append(departure - now)
        return departure
