"""Where the next repair symbol's window goes (sans-IO, pure bookkeeping).

The newest ACK carries a map of the receiver's undecoded symbols over its decoder span
[prefix, prefix + span). Holes are grouped greedily into *regions* of at most ``window_cap``
consecutive symbols (RFC 8681 windows are contiguous); each region gets repairs over
[first hole, last hole] only, oldest region first (it blocks the cumulative prefix and, in utility
order, holds the most valuable symbols). Several regions per round trip keep the decoder from falling
behind when the bandwidth-delay product exceeds the window cap.

A region's outstanding need = its share of the reported deficit minus the repairs already sent for it
after that ACK (each arrives with probability 1 - loss near the deadline, surely before: ``RESEND_RTTS``).
The share is what the region still lacks: its holes minus the repairs the ACK has seen reach it (they
gave it equations or were lost), scaled to the reported deficit, at most its holes; an even share per hole
sent a region already holding equations repairs it did not need while another waited a round trip.
Once every region is covered, a *proactive* repair protects the newest symbols in flight,
[next - window_cap, next), as far as the receiver's span allows: the expected losses among in-flight
sources count towards the deficit estimate.

Every decision and every ACK go through here, so the region table lives in preallocated arrays and the
arithmetic runs in compiled kernels called through their bound entry points (one call per decision,
one per ACK; numba's per-call type dispatch would cost more than the work).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from pfec.common.codec import fec
from pfec.common.codec.gf256 import entry_point, njit_cached
from pfec.common.wire.messages import MAX_HOLE_BITS

# Expected nonzero coefficients on the holes of a region: ln(holes) + REPAIR_HITS_MARGIN. Sparser repairs
# miss holes (2 holes in 64 symbols at 8 nonzeros: one is hit only 23% of the time) and leave the holes'
# submatrix rank-deficient (a random GF(256) n x n matrix with per-entry density d is full rank w.h.p.
# only once d * n exceeds about ln n), so the receiver would see redundant repairs.
REPAIR_HITS_MARGIN = 3.0
PROACTIVE = -1
# Round trips before the deadline within which a lost repair can no longer be replaced after the ACK that
# reports it (one for the report, one for the replacement, half for the ACK interval): from then on a
# repair in flight counts as arriving with probability 1 - loss, before then as arriving (the session
# passes loss 0), as ARQ resends after a loss rather than before.
RESEND_RTTS = 2.5
# How far back the repairs an ACK has seen count as equations the regions they reach may still hold:
# max(SEEN_RTTS round trips, SEEN_MIN_S). Older ones mostly served holes decoded since, whose windows
# overlap today's regions. Measured (pfec sim, rho 0.8, main GE, 8 realizations; priorityfec's share of
# the oracle): all history 0.9915 at 20 ms RTT but 0.954 at 200 ms; one RTT 0.988 and 0.974; this rule
# 0.9915 and 0.974.
SEEN_RTTS = 1.0
SEEN_MIN_S = 0.1
_MAX_DT = 15

# Region table rows (int64 table / float64 table).
_FIRST, _END, _HOLES = 0, 1, 2
_NEED, _SENT = 0, 1
# The planner's scalars, kept in one int64 array so that a plan is a six-argument call.
# _P_NEWEST_FIRST / _P_NEWEST_WIDTH: where an open-loop repair may start and how wide it may be (plan_newest).
(_P_REGIONS, _P_PREFIX, _P_SPAN, _P_CAP, _P_TARGET, _P_FIXED_DT, _P_UNKNOWNS, _P_NEWEST_FIRST,
 _P_NEWEST_WIDTH) = range(9)


class Plan(NamedTuple):
    """The planner's answer at a decision epoch."""

    region: int  # region the next repair serves, or PROACTIVE
    first: int  # its window: [first, first + nss)
    nss: int
    dt: int  # density threshold for that window
    reactive_need: float  # repairs still needed for the reported holes, after those in flight
    effectiveness: float  # P(the next repair has a nonzero coefficient on a reported hole)


@njit_cached
def _density(nss: int, target: int) -> int:
    # fec.density_for, compiled: clamp(ceil(16 * target / nss) - 1, 0, 15)
    if target <= 0:
        return 0
    dt = -(-16 * target // nss) - 1
    return max(0, min(_MAX_DT, dt))


@njit_cached
def _dt_for(count: int, holes: int, target: int, fixed_dt: int) -> int:
    """DT for a repair over ``count`` symbols aimed at ``holes`` of them (target < 0: dense)."""
    if fixed_dt >= 0:
        return fixed_dt
    tgt = count if target < 0 else target
    if holes <= 2:
        return _density(max(1, count), tgt)  # both holes are forced in by key choice
    hits = math.log(max(1, holes)) + REPAIR_HITS_MARGIN
    wanted = max(tgt, math.ceil(count * min(1.0, hits / max(1, holes))))
    return _density(max(1, count), wanted)


@njit_cached
def _group_holes(
    packed: npt.NDArray[np.uint8],
    bits: int,
    prefix: int,
    limit: int,
    cap: int,
    deficit: int,
    repair_windows: npt.NDArray[np.int64],
    in_flight_from: int,
    in_flight_to: int,
    repair_times: npt.NDArray[np.float64],
    seen_since: float,
    unseen_from: int,
    unseen_to: int,
    holes: npt.NDArray[np.int64],
    reg_i: npt.NDArray[np.int64],
    reg_f: npt.NDArray[np.float64],
    fill: bool,
) -> tuple[int, int, int]:
    """Unpack the ACK's hole map (ESIs below ``limit`` only) into ``holes``, then the sources it never
    saw although later packets were acknowledged (``[unseen_from, unseen_to)`` past the map: lost, each
    one equation short, since every equation the receiver holds lies before its seen end); group them
    greedily into regions of <= cap consecutive ESIs (first ESI, one past the last hole, holes), give each
    region its share of the deficit (``_share_by_region``) and charge each in-flight repair (rows
    ``in_flight_from:in_flight_to`` of ``repair_windows``) to the region its [first, end) window overlaps
    that lacks most after the charges so far (its equation serves whichever of them it reaches).
    ``fill``: the shares add up to the deficit however many seen repairs reached the regions (see
    ``_share_by_region``). Returns (holes, regions, repairs overlapping no region)."""
    n_holes = 0
    for i in range(bits):
        if packed[i >> 3] & (0x80 >> (i & 7)):
            esi = prefix + i
            if esi >= limit:
                break
            holes[n_holes] = esi
            n_holes += 1
    for esi in range(max(unseen_from, prefix + bits), min(unseen_to, limit)):
        if n_holes >= len(holes):
            break
        holes[n_holes] = esi
        n_holes += 1
        deficit += 1
    share = deficit / n_holes if n_holes else 0.0
    n = 0
    i = 0
    while i < n_holes:
        first = holes[i]
        j = i
        while j < n_holes and holes[j] < first + cap:
            j += 1
        reg_i[_FIRST, n] = first
        reg_i[_END, n] = holes[j - 1] + 1
        reg_i[_HOLES, n] = j - i
        reg_f[_NEED, n] = (j - i) * share
        reg_f[_SENT, n] = 0.0
        n += 1
        i = j
    if n > 0 and deficit > 0:
        seen_from = _first_at_or_after(repair_times, in_flight_from, seen_since) if len(repair_times) else 0
        _share_by_region(deficit, prefix, repair_windows, seen_from, in_flight_from, n, reg_i, reg_f, fill)
    unassigned = 0
    for k in range(in_flight_from, in_flight_to):
        target = _lacking_most(repair_windows[k, 0], repair_windows[k, 1], n, reg_i, reg_f)
        if target >= 0:
            reg_f[_SENT, target] += 1.0
        else:
            unassigned += 1
    return n_holes, n, unassigned


@njit_cached
def _first_at_or_after(times: npt.NDArray[np.float64], n: int, since: float) -> int:
    """The first of ``times[:n]`` (ascending) at or after ``since`` (n if none): binary search."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if times[mid] < since:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit_cached
def _lacking_most(first: int, end: int, n: int, reg_i: npt.NDArray[np.int64],
                  reg_f: npt.NDArray[np.float64]) -> int:
    """The region a repair over [first, end) reaches that lacks most (need - sent), or -1: its equation
    serves whichever of them it reaches."""
    target = -1
    most = 0.0
    for r in range(n):
        if first < reg_i[_END, r] and reg_i[_FIRST, r] < end:
            lacking = reg_f[_NEED, r] - reg_f[_SENT, r]
            if target < 0 or lacking > most:
                target, most = r, lacking
    return target


@njit_cached
def _share_by_region(deficit: int, prefix: int, repair_windows: npt.NDArray[np.int64], seen_from: int,
                     acked: int, n: int, reg_i: npt.NDArray[np.int64],
                     reg_f: npt.NDArray[np.float64], fill: bool) -> None:
    """Split the reported deficit over the regions by what each still lacks, not evenly per hole: a
    region's holes minus the recent repairs seen (rows ``seen_from:acked``) that reach it, charged to the one
    lacking most, scaled so the shares add up to the deficit (which absorbs the seen repairs that were
    lost), at most its holes. ``fill``: what the caps at its holes left of the deficit goes to the regions
    below their caps, by what they could still lack, so the shares add up to the deficit (a fan-out
    group's: many repairs planned for other members reach each region, and the lost ones would otherwise
    drop out of the deficit)."""
    for r in range(n):
        reg_f[_NEED, r] = float(reg_i[_HOLES, r])
    for k in range(seen_from, acked):
        r_first = repair_windows[k, 0]
        r_end = repair_windows[k, 1]
        if r_end <= prefix:
            continue
        target = _lacking_most(r_first, r_end, n, reg_i, reg_f)
        if target >= 0:
            reg_f[_NEED, target] -= 1.0
    lacking = 0.0
    for r in range(n):
        reg_f[_NEED, r] = max(0.0, reg_f[_NEED, r])
        lacking += reg_f[_NEED, r]
    total_holes = 0
    for r in range(n):
        total_holes += reg_i[_HOLES, r]
    for r in range(n):
        if lacking > 0.0:  # a region never lacks more equations than it has holes
            reg_f[_NEED, r] = min(float(reg_i[_HOLES, r]), reg_f[_NEED, r] * deficit / lacking)
        else:
            reg_f[_NEED, r] = reg_i[_HOLES, r] * deficit / max(1, total_holes)
    if not fill:
        return
    shared = 0.0
    room = 0.0
    for r in range(n):
        shared += reg_f[_NEED, r]
        room += reg_i[_HOLES, r] - reg_f[_NEED, r]
    if deficit > shared and room > 0.0:
        part = min(1.0, (deficit - shared) / room)
        for r in range(n):
            reg_f[_NEED, r] += part * (reg_i[_HOLES, r] - reg_f[_NEED, r])


@njit_cached
def _plan(
    reg_i: npt.NDArray[np.int64],
    reg_f: npt.NDArray[np.float64],
    params: npt.NDArray[np.int64],
    loss: float,
    proactive: bool,
    next_esi: int,
    newest_span: int,
    fill: bool,
) -> tuple[int, int, int, int, float, float]:
    """(region, first, count, dt, reactive need, effectiveness): the region with the largest outstanding
    need (the oldest on ties), or PROACTIVE over the newest symbols when ``proactive`` and no region
    needs as much as half a repair. ``fill``: a slot that would idle while regions are open (every need
    covered by repairs in flight, in expectation): the region with the largest need all the same, however
    small or negative, so spare slots go where a lost repair would hurt most. ``newest_span`` > 0:
    PROACTIVE over the newest symbols whatever the regions, reaching at most that far past the prefix (an
    open-loop repair). ``params`` holds the planner's scalars (``_P_*``)."""
    n = params[_P_REGIONS]
    prefix = params[_P_PREFIX]
    span = params[_P_SPAN]
    cap = params[_P_CAP]
    target = params[_P_TARGET]
    fixed_dt = params[_P_FIXED_DT]
    unknowns = params[_P_UNKNOWNS]
    arrive = 1.0 - loss
    best = -1
    best_rem = -math.inf if fill else 0.0
    need_total = 0.0
    for r in range(n):
        rem = reg_f[_NEED, r] - arrive * reg_f[_SENT, r]
        if rem > 0.0:
            need_total += rem
        if rem > best_rem:
            best = r
            best_rem = rem
    if best >= 0 and newest_span <= 0 and (not proactive or best_rem >= 0.5):
        first = reg_i[_FIRST, best]
        count = reg_i[_END, best] - first
        dt = _dt_for(count, reg_i[_HOLES, best], target, fixed_dt)
        holes = unknowns  # what the receiver reported missing overall
    else:
        best = -1
        hi = min(next_esi, prefix + (newest_span if newest_span > 0 else span))
        first = max(prefix, hi - cap)
        if newest_span > 0 and params[_P_NEWEST_FIRST] < hi:  # open loop: as plan_newest asked, if it
            # can reach its first symbol (a stalled receiver's span may end before it: the newest window)
            first = max(prefix, params[_P_NEWEST_FIRST], hi - params[_P_NEWEST_WIDTH])
        count = max(0, hi - first)
        holes = max(1, math.ceil(loss * count))
        dt = _dt_for(count, holes, target, fixed_dt)
    effectiveness = 0.0
    if count > 0 and holes > 0:
        density = (_dt_for(count, holes, target, fixed_dt) + 1) / 16
        effectiveness = 1.0 - (1.0 - density) ** holes
    return best, first, count, dt, need_total, effectiveness


@njit_cached
def count_upto(sorted_values: npt.NDArray[np.int64], n: int, value: int) -> int:
    """How many of ``sorted_values[:n]`` are <= ``value`` (binary search)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_values[mid] <= value:
            lo = mid + 1
        else:
            hi = mid
    return lo


_bound: dict[str, Callable[..., Any]] = {}


def _kernels() -> dict[str, Callable[..., Any]]:
    """Bind the kernels once per process (compiled now or loaded from numba's cache)."""
    if not _bound:
        reg_i = np.zeros((3, 2), dtype=np.int64)
        reg_f = np.zeros((2, 2), dtype=np.float64)
        ints = np.zeros(2, dtype=np.int64)
        packed = np.frombuffer(b"\0", dtype=np.uint8)  # ACK hole maps arrive as read-only bytes
        in_flight = np.zeros((1, 2), dtype=np.int64)
        _bound["group"] = entry_point(
            _group_holes, packed, 0, 0, 0, 0, 0, in_flight, 0, 0, _NO_TIMES, 0.0, 0, 0, ints, reg_i, reg_f,
            False)
        # ... and as the bytes object the parser made (numba reads it in place: no array per ACK).
        _bound["group_bytes"] = entry_point(
            _group_holes, b"\0", 0, 0, 0, 0, 0, in_flight, 0, 0, _NO_TIMES, 0.0, 0, 0, ints, reg_i, reg_f,
            False)
        _bound["plan"] = entry_point(_plan, reg_i, reg_f, ints, 0.0, False, 0, 0, False)
        _bound["count_upto"] = entry_point(count_upto, ints, 0, 0)
        _bound["lacking_most"] = entry_point(_lacking_most, 0, 0, 0, reg_i, reg_f)
    return _bound


def count_upto_kernel() -> Callable[[npt.NDArray[np.int64], int, int], int]:
    """:func:`count_upto` through its bound entry point (int64 array, int, int)."""
    return _kernels()["count_upto"]


def warm_up() -> None:
    """Compile (or load from numba's cache) the planner kernels and the codec's, before the first ACK:
    a first-use compile stalls the sender for seconds, long enough to miss a deadline."""
    fec.warm_up()
    planner = RepairPlanner(4, 8)
    planner.on_ack(0, b"\xa0", 3, 2, 8, np.zeros((1, 2), dtype=np.int64))
    planner.plan(8, 0.1, True)


class RepairPlanner:
    def __init__(
        self, window_cap: int, span: int, target_nonzeros: int | None = 8, fixed_dt: int | None = None,
        fill_deficit: bool = False,
    ) -> None:
        if window_cap < 1 or span < window_cap:
            raise ValueError(f"need 1 <= window_cap <= span, got window_cap={window_cap} span={span}")
        self.window_cap = window_cap
        self.target_nonzeros = target_nonzeros
        self.fixed_dt = fixed_dt
        self.fill_deficit = fill_deficit  # the regions' shares add up to the deficit (_share_by_region)
        target = -1 if target_nonzeros is None else int(target_nonzeros)  # kernels: -1 = dense
        self._params = np.array(
            [0, 0, span, window_cap, target, -1 if fixed_dt is None else int(fixed_dt), 0, 0, window_cap],
            dtype=np.int64
        )
        self._proactive_sent = 0
        # Region table (regions <= holes in one ACK map): first ESI, end past its last hole, holes;
        # deficit share and repairs sent since the ACK.
        self._reg_i = np.zeros((3, MAX_HOLE_BITS), dtype=np.int64)
        self._reg_f = np.zeros((2, MAX_HOLE_BITS), dtype=np.float64)
        self._hole_buf = np.zeros(MAX_HOLE_BITS, dtype=np.int64)
        kernels = _kernels()
        self._group = kernels["group"]
        self._group_bytes = kernels["group_bytes"]
        self._plan = kernels["plan"]
        self._lacking = kernels["lacking_most"]
        self._checked_windows: npt.NDArray[np.int64] | None = None  # the array on_ack last validated

    @property
    def regions(self) -> int:
        return int(self._params[_P_REGIONS])

    @property
    def prefix(self) -> int:
        """Decoded prefix of the newest ACK."""
        return int(self._params[_P_PREFIX])

    @property
    def unknowns(self) -> int:
        """Undecoded symbols the newest ACK reported within the span."""
        return int(self._params[_P_UNKNOWNS])

    @property
    def span(self) -> int:
        """How far past the receiver's prefix repairs may reach (its decoder span)."""
        return int(self._params[_P_SPAN])

    @span.setter
    def span(self, span: int) -> None:
        if span < self.window_cap:
            raise ValueError(f"span {span} must be at least window_cap {self.window_cap}")
        self._params[_P_SPAN] = span

    def on_ack(
        self,
        prefix: int,
        packed_holes: bytes,
        hole_bits: int,
        deficit: int,
        next_esi: int,
        repair_windows: npt.NDArray[np.int64],
        in_flight_from: int = 0,
        in_flight_to: int | None = None,
        repair_times: npt.NDArray[np.float64] | None = None,
        seen_since: float = -math.inf,
        unseen_from: int = 0,
        unseen_to: int = 0,
    ) -> None:
        """Rebuild regions from an ACK's hole map. Rows ``in_flight_from:in_flight_to`` of
        ``repair_windows`` (a C-contiguous (n, 2) int64 array) are the [first, end) windows of repairs the
        ACK had not seen: each still counts against the region it overlaps that lacks most. Of the repairs
        the ACK has seen, those sent at or after ``seen_since`` (``repair_times``: their send times, same
        rows, ascending) count as equations the regions they reach may still hold (``_share_by_region``).
        Holes at or beyond ``next_esi`` (a forged or confused map) are ignored. Sources in
        ``[unseen_from, unseen_to)`` (the ACK's seen end up to the last source sent before its largest
        packet, within the span: the caller bounds it) count as holes the map could not show: the tail of
        a round lost whole, which the receiver cannot report."""
        windows = repair_windows
        if windows is not self._checked_windows:  # the session passes the same array every time
            if windows.dtype != np.int64 or windows.ndim != 2 or not windows.flags.c_contiguous:
                raise ValueError("repair_windows must be a C-contiguous (n, 2) int64 array")
            self._checked_windows = windows
        stop = len(repair_windows) if in_flight_to is None else in_flight_to
        if not 0 <= in_flight_from <= stop <= len(repair_windows):
            raise ValueError(f"in-flight rows {in_flight_from}:{stop} outside {len(repair_windows)} windows")
        times = _NO_TIMES if repair_times is None else repair_times
        if len(times) and len(times) < in_flight_from:
            raise ValueError(f"{len(times)} repair times for {in_flight_from} repairs seen")
        if hole_bits > 8 * len(packed_holes) or hole_bits > MAX_HOLE_BITS:
            raise ValueError(f"hole map of {len(packed_holes)} bytes cannot hold {hole_bits} bits")
        packed: bytes | npt.NDArray[np.uint8]
        if type(packed_holes) is bytes:
            group, packed = self._group_bytes, packed_holes
        else:
            group = self._group
            packed = np.frombuffer(packed_holes, dtype=np.uint8) if packed_holes else _NO_HOLES
        unknowns, regions, self._proactive_sent = group(
            packed,
            hole_bits,
            prefix,
            next_esi,
            self.window_cap,
            deficit,
            repair_windows,
            in_flight_from,
            stop,
            times,
            seen_since,
            unseen_from,
            unseen_to,
            self._hole_buf,
            self._reg_i,
            self._reg_f,
            self.fill_deficit,
        )
        params = self._params
        params[_P_REGIONS] = regions
        params[_P_PREFIX] = prefix
        params[_P_UNKNOWNS] = unknowns

    def plan(self, next_esi: int, loss: float, proactive: bool = False, fill: bool = False) -> Plan:
        """Where the next repair goes, how much reactive repair is still owed, and how likely the next
        repair is to hit a reported hole. A region starts and ends on a hole, so with one or two holes
        the encoder is told to cover both ends (see ``covers_both_ends``) and the repair stays sparse."""
        # tuple.__new__ wraps the kernel's tuple as a Plan at half the cost of Plan._make (every decision).
        fields = self._plan(self._reg_i, self._reg_f, self._params, loss, proactive, next_esi, 0, fill)
        return tuple.__new__(Plan, fields)

    def plan_newest(self, next_esi: int, loss: float, span: int, first: int = 0, width: int = 0) -> Plan:
        """An open-loop repair: over the newest window of sources whatever the reported holes, at most
        ``span`` past the newest ACK's prefix (the receiver refuses windows beyond its decoder span),
        starting at ``first`` or later and at most ``width`` symbols wide (0: the window cap)."""
        self._params[_P_NEWEST_FIRST] = max(0, first)
        self._params[_P_NEWEST_WIDTH] = width if width > 0 else self.window_cap
        fields = self._plan(self._reg_i, self._reg_f, self._params, loss, True, next_esi, max(1, span), False)
        return tuple.__new__(Plan, fields)

    def reactive_need(self, loss: float) -> float:
        """Repairs still needed for the reported holes, after those already in flight."""
        return self.plan(self.prefix, loss).reactive_need

    def next_window(self, next_esi: int, loss: float, proactive: bool = False) -> tuple[int, int, int, int]:
        """(first, count, dt, region) of the next repair (see :meth:`plan`)."""
        p = self.plan(next_esi, loss, proactive)
        return p.first, p.nss, p.dt, p.region

    def proactive_need(self, next_esi: int, acked_source_end: int, loss: float) -> float:
        """Expected losses among the newest sources the receiver has not reported on, minus the
        proactive repairs in flight. Only worth paying for when feedback cannot come back in time
        (the session asks only then)."""
        lo = max(acked_source_end, next_esi - self.window_cap, self.prefix)
        hi = min(next_esi, self.prefix + self.span)
        return max(0.0, loss * max(0, hi - lo) - (1.0 - loss) * self._proactive_sent)

    def sent(self, region: int) -> None:
        if region == PROACTIVE:
            self._proactive_sent += 1
        else:
            self._reg_f[_SENT, region] += 1.0

    def sent_over(self, first: int, end: int) -> bool:
        """A repair over [first, end) planned elsewhere (a fan-out group's, for another member) was sent:
        charged, as one in flight, to the region it reaches that lacks most. Whether it reached one."""
        region = self._lacking(first, end, int(self._params[_P_REGIONS]), self._reg_i, self._reg_f)
        if region < 0:
            return False
        self._reg_f[_SENT, region] += 1.0
        return True

    def covers_both_ends(self, region: int) -> bool:
        """A region of at most two holes: a repair that covers its first and last symbol hits every hole."""
        return region != PROACTIVE and self._reg_i[_HOLES, region] <= 2


_NO_HOLES = np.frombuffer(b"\0", dtype=np.uint8)
_NO_TIMES = np.zeros(0, dtype=np.float64)
