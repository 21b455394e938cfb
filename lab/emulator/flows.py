"""Per-flow accounting at the emulated bottleneck (sans-IO): whose bytes got through, and when.

``FlowMeter.record`` sees every IP packet one direction of a ``TunBridge`` admits or drops (the bridge's
``forward_tap``), with the time it arrived and the time the link will deliver it (None: dropped). A packet
belongs to a flow named by its transport and source port (``flow_of``): a kernel TCP bulk flow and each
sender daemon's UDP socket are told apart without looking past the IP and transport headers. Per time bin
of ``bin_s`` (from ``origin``, in the caller's clock) the meter keeps:

- the bytes each flow got through the bottleneck, binned by the time they left it (``deliver_at - owd_s``);
- the queueing delay (arrival to leaving the bottleneck) of the packets that arrived in the bin: sum,
  count and maximum, so a bin's mean and worst are exact;
- the packets the drop-tail queue (or the loss model) dropped, by the bin they arrived in.

Bounded whatever the traffic: at most ``MAX_FLOWS`` flows (``OTHER`` included, into which later ones
merge), and ``bins`` bins (a packet past the last bin is only counted in ``late``). A flow's first and
last *data* packet (at least ``DATA_MIN_BYTES``: not a handshake, an ACK or a RESULT) bound its active
period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

__all__ = ["DATA_MIN_BYTES", "MAX_FLOWS", "OTHER", "FlowMeter", "flow_of"]

MAX_FLOWS: Final = 16
DATA_MIN_BYTES: Final = 1000
OTHER: Final = "other"
_PROTOCOLS: Final = {6: "tcp", 17: "udp"}


def flow_of(packet: bytes) -> str:
    """``"tcp:PORT"`` / ``"udp:PORT"`` (source port) for an IPv4 TCP or UDP packet, else ``OTHER``."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return OTHER
    header = (packet[0] & 0x0F) * 4
    name = _PROTOCOLS.get(packet[9])
    if name is None or header < 20 or len(packet) < header + 2:
        return OTHER
    return f"{name}:{int.from_bytes(packet[header:header + 2], 'big')}"


@dataclass
class _Flow:
    bytes_by_bin: np.ndarray  # int64, bytes that left the bottleneck in each bin
    dropped: int = 0
    delivered_bytes: int = 0
    first_data_s: float = math.inf  # leaving time of its first data packet (relative to origin)
    last_data_s: float = -math.inf


class FlowMeter:
    """Bytes per flow per bin through one link direction, the queueing delay and the drops per bin."""

    def __init__(self, origin: float, bin_s: float, bins: int, owd_s: float) -> None:
        if not (math.isfinite(bin_s) and bin_s > 0):
            raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
        if not 1 <= bins <= 1_000_000:
            raise ValueError(f"bins must be in 1..1000000, got {bins!r}")
        self.origin = origin
        self.bin_s = bin_s
        self.bins = bins
        self.owd_s = owd_s
        self.flows: dict[str, _Flow] = {}
        self.delay_sum_s = np.zeros(bins)
        self.delay_max_s = np.zeros(bins)
        self.delay_count = np.zeros(bins, dtype=np.int64)
        self.dropped = np.zeros(bins, dtype=np.int64)
        self.late = 0  # packets outside the bins

    def _flow(self, key: str) -> _Flow:
        flow = self.flows.get(key)
        if flow is None:
            if len(self.flows) >= MAX_FLOWS - 1 and key != OTHER:  # one slot stays OTHER's
                return self._flow(OTHER)
            flow = self.flows[key] = _Flow(np.zeros(self.bins, dtype=np.int64))
        return flow

    def _bin(self, t: float) -> int | None:
        k = math.floor((t - self.origin) / self.bin_s)
        return k if 0 <= k < self.bins else None

    def record(self, now: float, packet: bytes, deliver_at: float | None) -> None:
        """One packet arrived at ``now``; the link delivers it at ``deliver_at`` (None: dropped)."""
        flow = self._flow(flow_of(packet))
        arrived = self._bin(now)
        if deliver_at is None:
            flow.dropped += 1
            if arrived is None:
                self.late += 1
            else:
                self.dropped[arrived] += 1
            return
        left = deliver_at - self.owd_s
        gone = self._bin(left)
        if arrived is None or gone is None:
            self.late += 1
            return
        size = len(packet)
        flow.bytes_by_bin[gone] += size
        flow.delivered_bytes += size
        if size >= DATA_MIN_BYTES:
            at = left - self.origin
            flow.first_data_s = min(flow.first_data_s, at)
            flow.last_data_s = max(flow.last_data_s, at)
        delay = left - now
        self.delay_sum_s[arrived] += delay
        self.delay_count[arrived] += 1
        if delay > self.delay_max_s[arrived]:
            self.delay_max_s[arrived] = delay

    def active_s(self, key: str) -> tuple[float, float] | None:
        """(first, last) data-packet leaving times of a flow, s from origin; None without data packets."""
        flow = self.flows.get(key)
        if flow is None or not math.isfinite(flow.first_data_s):
            return None
        return flow.first_data_s, flow.last_data_s

    def mbps(self, key: str) -> list[float]:
        """A flow's throughput through the bottleneck per bin, Mbit/s."""
        flow = self.flows.get(key)
        if flow is None:
            return [0.0] * self.bins
        return [round(float(b) * 8 / self.bin_s / 1e6, 3) for b in flow.bytes_by_bin]

    def window_bytes(self, key: str, first_bin: int, end_bin: int) -> int:
        flow = self.flows.get(key)
        return 0 if flow is None else int(flow.bytes_by_bin[first_bin:end_bin].sum())

    def queue_delay_ms(self) -> tuple[list[float | None], list[float | None]]:
        """Per bin: the mean and the largest queueing delay of the packets that arrived in it, ms."""
        means: list[float | None] = []
        worst: list[float | None] = []
        for total, n, top in zip(self.delay_sum_s, self.delay_count, self.delay_max_s, strict=True):
            means.append(round(float(total) / int(n) * 1000, 3) if n else None)
            worst.append(round(float(top) * 1000, 3) if n else None)
        return means, worst

    def totals(self) -> dict[str, Any]:
        return {
            key: {"delivered_bytes": f.delivered_bytes, "dropped_packets": f.dropped}
            for key, f in sorted(self.flows.items())
        }
