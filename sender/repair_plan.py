"""Where the next repair symbol's window goes (sans-IO, pure bookkeeping).

The newest ACK carries a map of the receiver's undecoded symbols over its decoder span
[prefix, prefix + span). Holes are grouped greedily into *regions* of at most ``window_cap``
consecutive symbols (RFC 8681 windows are contiguous); each region gets repairs over
[first hole, last hole] only, oldest region first (it blocks the cumulative prefix and, in utility
order, holds the most valuable symbols). Several regions per round trip keep the decoder from falling
behind when the bandwidth-delay product exceeds the window cap.

A region's outstanding need = its share of the reported deficit minus the repairs already sent for it
after that ACK (each arrives with probability 1 - loss). Once every region is covered, a *proactive*
repair protects the newest symbols in flight, [next - window_cap, next), as far as the receiver's
span allows: the expected losses among in-flight sources count towards the deficit estimate.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import numpy.typing as npt

from common import fec
from common.fec import density_for
from common.wire import MAX_HOLE_BITS

# Expected nonzero coefficients on the holes of a region: ln(holes) + REPAIR_HITS_MARGIN. Sparser repairs
# miss holes (2 holes in 64 symbols at 8 nonzeros: one is hit only 23% of the time) and leave the holes'
# submatrix rank-deficient (a random GF(256) n x n matrix with per-entry density d is full rank w.h.p.
# only once d * n exceeds about ln n), so the receiver would see redundant repairs.
REPAIR_HITS_MARGIN = 3.0
PROACTIVE = -1


@numba.njit(cache=True, nogil=True)
def _group_holes(
    packed: npt.NDArray[np.uint8],
    bits: int,
    prefix: int,
    limit: int,
    cap: int,
    in_flight: npt.NDArray[np.int64],
    holes: npt.NDArray[np.int64],
    out: npt.NDArray[np.int64],
    sent: npt.NDArray[np.float64],
) -> tuple[int, int, int]:
    """Unpack the ACK's hole map (ESIs below ``limit`` only) into ``holes``, group them greedily into
    regions of <= cap consecutive ESIs (out[0] first ESI, out[1] one past the last hole, out[2] holes) and
    charge each in-flight repair to the first region its [first, end) window overlaps (sent[r]).
    Returns (holes, regions, repairs overlapping no region)."""
    n_holes = 0
    for i in range(bits):
        if packed[i >> 3] & (0x80 >> (i & 7)):
            esi = prefix + i
            if esi >= limit:
                break
            holes[n_holes] = esi
            n_holes += 1
    holes = holes[:n_holes]
    n = 0
    i = 0
    while i < n_holes:
        first = holes[i]
        j = i
        while j < len(holes) and holes[j] < first + cap:
            j += 1
        out[0, n] = first
        out[1, n] = holes[j - 1] + 1
        out[2, n] = j - i
        sent[n] = 0.0
        n += 1
        i = j
    unassigned = 0
    for k in range(in_flight.shape[0]):
        r_first = in_flight[k, 0]
        r_end = in_flight[k, 1]
        charged = False
        for r in range(n):
            if r_first < out[1, r] and out[0, r] < r_end:
                sent[r] += 1.0
                charged = True
                break
        if not charged:
            unassigned += 1
    return n_holes, n, unassigned


def warm_up() -> None:
    """Compile (or load from numba's cache) the planner kernel and the codec's, before the first ACK:
    a first-use compile stalls the sender for seconds, long enough to miss a deadline."""
    fec.warm_up()
    planner = RepairPlanner(4, 8)
    planner.on_ack(0, b"\xa0", 3, 2, 8, np.zeros((1, 2), dtype=np.int64))


class RepairPlanner:
    def __init__(
        self, window_cap: int, span: int, target_nonzeros: int | None = 8, fixed_dt: int | None = None
    ) -> None:
        if window_cap < 1 or span < window_cap:
            raise ValueError(f"need 1 <= window_cap <= span, got window_cap={window_cap} span={span}")
        self.window_cap = window_cap
        self.span = span
        self.target_nonzeros = target_nonzeros
        self.fixed_dt = fixed_dt
        self.prefix = 0
        # Per region: first ESI, end (past its last hole), holes, deficit share, repairs sent since the ACK.
        self._first: list[int] = []
        self._end: list[int] = []
        self._holes: list[int] = []
        self._need: list[float] = []
        self._sent: list[float] = []
        self._proactive_sent = 0
        self.unknowns = 0
        self._buf = np.zeros((3, MAX_HOLE_BITS), dtype=np.int64)  # regions <= holes in one ACK map
        self._sent_buf = np.zeros(MAX_HOLE_BITS, dtype=np.float64)
        self._hole_buf = np.zeros(MAX_HOLE_BITS, dtype=np.int64)

    def on_ack(
        self,
        prefix: int,
        packed_holes: bytes,
        hole_bits: int,
        deficit: int,
        next_esi: int,
        in_flight: npt.NDArray[np.int64],
    ) -> None:
        """Rebuild regions from an ACK's hole map. ``in_flight`` is an (n, 2) array of the [first, end)
        windows of repairs the ACK had not seen: each still counts against the oldest region it overlaps.
        Holes at or beyond ``next_esi`` (a forged or confused map) are ignored."""
        self.prefix = prefix
        packed = np.frombuffer(packed_holes, dtype=np.uint8)
        unknowns, n, self._proactive_sent = _group_holes(
            packed,
            hole_bits,
            prefix,
            next_esi,
            self.window_cap,
            in_flight,
            self._hole_buf,
            self._buf,
            self._sent_buf,
        )
        self.unknowns = unknowns
        # A handful of regions: plain lists are cheaper than numpy for the per-decision arithmetic.
        self._first = self._buf[0, :n].tolist()
        self._end = self._buf[1, :n].tolist()
        self._holes = self._buf[2, :n].tolist()
        self._sent = self._sent_buf[:n].tolist()
        share = deficit / unknowns if unknowns else 0.0
        self._need = [h * share for h in self._holes]

    def reactive_need(self, loss: float) -> float:
        """Repairs still needed for the reported holes, after those already in flight."""
        arrive = 1.0 - loss
        return sum(max(0.0, need - arrive * sent) for need, sent in zip(self._need, self._sent, strict=True))

    def proactive_need(self, next_esi: int, acked_source_end: int, loss: float) -> float:
        """Expected losses among the newest sources the receiver has not reported on, minus the
        proactive repairs in flight. Only worth paying for when feedback cannot come back in time
        (the session asks only then)."""
        lo = max(acked_source_end, next_esi - self.window_cap, self.prefix)
        hi = min(next_esi, self.prefix + self.span)
        return max(0.0, loss * max(0, hi - lo) - (1.0 - loss) * self._proactive_sent)

    def next_window(self, next_esi: int, loss: float, proactive: bool = False) -> tuple[int, int, int, int]:
        """(first, count, dt, region) of the next repair: the region with the largest outstanding need
        (the oldest on ties), or PROACTIVE over the newest symbols when ``proactive`` and no region needs
        as much. A region starts and ends on a hole, so with one or two holes the encoder is told to
        cover both ends (see ``covers_both_ends``) and the repair can stay sparse."""
        arrive = 1.0 - loss
        best, best_rem = -1, 0.0
        for r, need in enumerate(self._need):
            rem = need - arrive * self._sent[r]
            if rem > best_rem:
                best, best_rem = r, rem
        if best >= 0 and (not proactive or best_rem >= 0.5):
            first = self._first[best]
            count = self._end[best] - first
            return first, count, self._dt(count, self._holes[best]), best
        hi = min(next_esi, self.prefix + self.span)
        first = max(self.prefix, hi - self.window_cap)
        count = max(0, hi - first)
        return first, count, self._dt(count, max(1, math.ceil(loss * count))), PROACTIVE

    def sent(self, region: int) -> None:
        if region == PROACTIVE:
            self._proactive_sent += 1
        else:
            self._sent[region] += 1.0

    def effectiveness(self, count: int, holes: int) -> float:
        """P(a repair over ``count`` symbols has a nonzero coefficient on at least one of ``holes``)."""
        if count <= 0 or holes <= 0:
            return 0.0
        density = (self._dt(count, holes) + 1) / 16
        return 1.0 - (1.0 - density) ** holes

    def covers_both_ends(self, region: int) -> bool:
        """A region of at most two holes: a repair that covers its first and last symbol hits every hole."""
        return region != PROACTIVE and self._holes[region] <= 2

    def _dt(self, count: int, holes: int) -> int:
        if self.fixed_dt is not None:
            return self.fixed_dt
        target = self.target_nonzeros if self.target_nonzeros is not None else count
        if holes <= 2:
            return density_for(max(1, count), target)  # both holes are forced in by key choice
        hits = math.log(max(1, holes)) + REPAIR_HITS_MARGIN
        wanted = max(target, math.ceil(count * min(1.0, hits / max(1, holes))))
        return density_for(max(1, count), wanted)
