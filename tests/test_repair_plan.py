"""The compiled repair planner against a plain-Python statement of the same rules.

The reference below is the planner as first written (lists, no kernels); the compiled one must pick the
same regions, windows and densities and report the same needs for any hole map and in-flight set.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pfec.common.codec.fec import density_for
from pfec.sender.transport.repair_plan import PROACTIVE, REPAIR_HITS_MARGIN, RepairPlanner


class ReferencePlanner:
    def __init__(self, cap: int, span: int, target: int | None, fixed_dt: int | None) -> None:
        self.cap, self.span, self.target, self.fixed_dt = cap, span, target, fixed_dt
        self.prefix = 0
        self.unknowns = 0
        self.regions: list[list[float]] = []  # first, end, holes, need, sent
        self.proactive_sent = 0

    def on_ack(
        self, prefix: int, holes: list[int], deficit: int, next_esi: int, in_flight: list[tuple[int, int]],
        seen: list[tuple[int, int]] = (),  # type: ignore[assignment]
    ) -> None:
        self.prefix = prefix
        holes = [h for h in holes if h < next_esi]
        self.unknowns = len(holes)
        share = deficit / len(holes) if holes else 0.0
        self.regions = []
        i = 0
        while i < len(holes):
            j = i
            while j < len(holes) and holes[j] < holes[i] + self.cap:
                j += 1
            self.regions.append([holes[i], holes[j - 1] + 1, j - i, (j - i) * share, 0.0])
            i = j
        if self.regions and deficit > 0:  # what each region lacks: holes minus the seen repairs reaching it
            for r in self.regions:
                r[3] = r[2]
            for first, end in seen:
                reached = [r for r in self.regions if end > prefix and first < r[1] and r[0] < end]
                if reached:
                    max(reached, key=lambda r: r[3])[3] -= 1  # max() keeps the first of equals
            lacking = sum(max(0.0, r[3]) for r in self.regions)
            for r in self.regions:
                if lacking > 0:
                    r[3] = min(r[2], max(0.0, r[3]) * deficit / lacking)
                else:
                    r[3] = r[2] * deficit / sum(q[2] for q in self.regions)
        self.proactive_sent = 0
        for first, end in in_flight:
            reached = [r for r in self.regions if first < r[1] and r[0] < end]
            if reached:
                max(reached, key=lambda r: r[3] - r[4])[4] += 1
            else:
                self.proactive_sent += 1

    def dt(self, count: int, holes: int) -> int:
        if self.fixed_dt is not None:
            return self.fixed_dt
        target = self.target if self.target is not None else count
        if holes <= 2:
            return density_for(max(1, count), target)
        hits = math.log(max(1, holes)) + REPAIR_HITS_MARGIN
        return density_for(max(1, count), max(target, math.ceil(count * min(1.0, hits / max(1, holes)))))

    def plan(self, next_esi: int, loss: float, proactive: bool) -> tuple[int, int, int, int, float, float]:
        arrive = 1 - loss
        best, best_rem, total = -1, 0.0, 0.0
        for r, (_f, _e, _h, need, sent) in enumerate(self.regions):
            rem = need - arrive * sent
            total += max(0.0, rem)
            if rem > best_rem:
                best, best_rem = r, rem
        if best >= 0 and (not proactive or best_rem >= 0.5):
            first, end, holes = (int(v) for v in self.regions[best][:3])
            count, dt, hit_holes = end - first, self.dt(end - first, holes), self.unknowns
        else:
            best = PROACTIVE
            hi = min(next_esi, self.prefix + self.span)
            first = max(self.prefix, hi - self.cap)
            count = max(0, hi - first)
            hit_holes = max(1, math.ceil(loss * count))
            dt = self.dt(count, hit_holes)
        eff = 0.0
        if count > 0 and hit_holes > 0:
            eff = 1 - (1 - (self.dt(count, hit_holes) + 1) / 16) ** hit_holes
        return best, first, count, dt, total, eff


def _pack(holes: list[int], prefix: int) -> tuple[bytes, int]:
    if not holes:
        return b"", 0
    bits = holes[-1] - prefix + 1
    packed = bytearray((bits + 7) // 8)
    for h in holes:
        i = h - prefix
        packed[i >> 3] |= 0x80 >> (i & 7)
    return bytes(packed), bits


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.integers(0, 5000),
    offsets=st.sets(st.integers(0, 511), max_size=120),
    deficit=st.integers(0, 140),
    beyond=st.integers(-50, 600),
    windows=st.lists(st.tuples(st.integers(-40, 560), st.integers(1, 64)), max_size=20),
    seen=st.lists(st.tuples(st.integers(-80, 560), st.integers(1, 64)), max_size=20),
    old=st.integers(0, 5),
    sends=st.lists(st.integers(-1, 30), max_size=30),
    loss=st.floats(0.0, 0.6),
    proactive=st.booleans(),
    target=st.sampled_from([8, 4, None]),
    fixed_dt=st.sampled_from([None, None, 3]),
)
def test_compiled_planner_matches_reference(
    prefix: int,
    offsets: set[int],
    deficit: int,
    beyond: int,
    windows: list[tuple[int, int]],
    seen: list[tuple[int, int]],
    old: int,
    sends: list[int],
    loss: float,
    proactive: bool,
    target: int | None,
    fixed_dt: int | None,
) -> None:
    cap, span = 64, 512
    holes = sorted(prefix + o for o in offsets)
    next_esi = prefix + max(0, beyond)
    in_flight = [(prefix + a, prefix + a + n) for a, n in windows]
    seen_windows = [(max(0, prefix + a), max(0, prefix + a) + n) for a, n in seen]
    packed, bits = _pack(holes, prefix)
    ref = ReferencePlanner(cap, span, target, fixed_dt)
    ref.on_ack(prefix, holes, deficit, next_esi, in_flight, seen_windows[old:])
    planner = RepairPlanner(cap, span, target, fixed_dt)
    # Rows: the repairs the ACK has seen (the first ``old`` sent before the horizon), then those in flight.
    rows = np.array(seen_windows + in_flight, dtype=np.int64).reshape(-1, 2)
    times = np.arange(len(rows), dtype=np.float64)
    planner.on_ack(prefix, packed, bits, deficit, next_esi, rows, len(seen), None, times, float(old))
    assert planner.unknowns == ref.unknowns
    twin = RepairPlanner(cap, span, target, fixed_dt)  # hole map as another buffer than bytes
    twin.on_ack(
        prefix, bytearray(packed), bits, deficit, next_esi, rows, len(seen), None, times, float(old)
    )  # type: ignore[arg-type]
    assert (twin.unknowns, twin.regions) == (planner.unknowns, planner.regions)
    assert twin.plan(next_esi, loss, proactive) == planner.plan(next_esi, loss, proactive)
    assert planner.regions == len(ref.regions)
    for region in sends:  # repairs sent since the ACK move the needs
        got, want = planner.plan(next_esi, loss, proactive), ref.plan(next_esi, loss, proactive)
        assert tuple(got[:4]) == want[:4]
        assert got.reactive_need == pytest.approx(want[4], abs=1e-9)
        assert got.effectiveness == pytest.approx(want[5], abs=1e-12)
        r = region if region < len(ref.regions) else PROACTIVE
        planner.sent(r)
        if r == PROACTIVE:
            ref.proactive_sent += 1
        else:
            ref.regions[r][4] += 1
    assert planner.proactive_need(next_esi, prefix, loss) == pytest.approx(
        max(
            0.0,
            loss * max(0, min(next_esi, prefix + span) - max(prefix, next_esi - cap))
            - (1 - loss) * ref.proactive_sent,
        )
    )


def test_planner_rejects_bad_inputs() -> None:
    planner = RepairPlanner(8, 16)
    with pytest.raises(ValueError, match="cannot hold"):
        planner.on_ack(0, b"\xff", 9, 1, 16, np.zeros((0, 2), np.int64))
    with pytest.raises(ValueError, match="C-contiguous"):
        planner.on_ack(0, b"\xff", 8, 1, 16, np.zeros((4, 4), np.int64)[:, :2])
    with pytest.raises(ValueError, match="outside"):
        planner.on_ack(0, b"\xff", 8, 1, 16, np.zeros((2, 2), np.int64), 1, 3)
    with pytest.raises(ValueError, match="window_cap"):
        RepairPlanner(8, 4)


def test_an_open_loop_repair_reaches_back_to_the_first_symbol_asked_for() -> None:
    """plan_newest over [max(prefix, first, hi - width), hi), hi = min(next, prefix + span): the whole
    open-loop tail when its first symbol is in reach; the newest window_cap symbols when a stalled
    receiver's span ends before it (a window there would be empty), and by default."""
    planner = RepairPlanner(8, 64)
    assert (planner.plan_newest(100, 0.1, 4095).first, planner.plan_newest(100, 0.1, 4095).nss) == (92, 8)
    p = planner.plan_newest(100, 0.1, 4095, first=30, width=64)
    assert (p.first, p.nss) == (36, 64)  # as wide as asked: from 100 - 64
    p = planner.plan_newest(100, 0.1, 4095, first=50, width=64)
    assert (p.first, p.nss) == (50, 50)  # from the first symbol asked for
    planner.on_ack(10, b"\x01", 1, 1, 100, np.zeros((0, 2), np.int64))  # prefix 10, hole at 10
    p = planner.plan_newest(100, 0.1, 30, first=50, width=64)  # the span ends at 40, before 50
    assert (p.first, p.nss) == (32, 8)
