"""A receiver's statement of its own prefill speed, as its ACCEPT carries it (sans-IO, pure arithmetic).

The receiver measures its prefill curve (``common/model/speed.py``) and states it in integer units, four
u32 fields of the ACCEPT (:mod:`pfec.common.wire.messages`); the sender believes a statement only if it
describes a working node, and its planner (:mod:`.breakeven`) then predicts with it. Between
measurements, ``RecentPrefills`` refits the curve over the measurement and the receiver's recent prefill
calls, timed as they ran: its speed under its present load (a split's front, slowed by the stream it
meets, shapes the curve but does not set its level), stated from then on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Final

from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.prefill import PrefillCurve, fit_prefill_calls

# What a stated curve may claim: no per-token cost (b = c = 0) or a first token later than this at 1k tokens
# is not a measurement of a working node.
MAX_STATED_PREFILL_S: Final = 600.0
MAX_STATED_DECODE_S: Final = 10.0


def stated_fields(curve: PrefillCurve, decode_s: float) -> tuple[int, int, int, int]:
    """A measured curve in the ACCEPT's integer units: (a us, b ns/token, c ps/token^2, decode us), each
    clamped to a u32 (a slower node states the largest value, which ``stated_receiver`` refuses)."""
    def u32(x: float) -> int:
        return min(0xFFFF_FFFF, max(0, round(x)))

    return u32(curve.a * 1e6), u32(curve.b * 1e9), u32(curve.c * 1e12), u32(decode_s * 1e6)


def stated_receiver(a_us: int, b_ns: int, c_ps: int, decode_us: int) -> ReceiverModel | None:
    """The receiver model an ACCEPT states, or None when it states none (all 0); ValueError when what it
    states is not a plausible measurement (no per-token cost, or absurdly slow)."""
    if a_us == b_ns == c_ps == decode_us == 0:
        return None
    curve = PrefillCurve(a_us * 1e-6, b_ns * 1e-9, c_ps * 1e-12)
    decode_s = decode_us * 1e-6
    if curve.b == 0 and curve.c == 0:
        raise ValueError("a stated prefill curve without a per-token cost")
    if curve.seconds(1024) > MAX_STATED_PREFILL_S or decode_s > MAX_STATED_DECODE_S:
        raise ValueError(f"a stated prefill of {curve.seconds(1024):.0f} s for 1024 tokens, decode "
                         f"{decode_s:.1f} s: not a working node")
    return ReceiverModel(curve, decode_s)


RECENT_CALLS: Final = 64  # timed forward calls of unloaded prefills kept beside the start-up measurement
RECENT_FRONTS: Final = 8  # split fronts kept for the curve's shape (each deflated by its own slowdown)
MAX_CALL_S: Final = 600.0  # a call timed longer than this says more about the timer than about the node


def front_slowdown(curve: PrefillCurve, calls: Sequence[tuple[int, int, float]]) -> float | None:
    """How much slower ``calls`` ran than ``curve`` predicts for them (their seconds over the curve's);
    None without a predicted cost."""
    predicted = sum(curve.chunk_seconds(start, stop) for start, stop, _ in calls)
    return sum(seconds for *_, seconds in calls) / predicted if predicted > 0 else None


class RecentPrefills:
    """The curve this node states: its prefill speed under its present load, but without a handoff's own
    stream. Refitted over the start-up measurement and the recent unloaded prefill calls (a local
    prefill's front, timed as it ran, beside whatever else shares the node); a split's front shares the
    receiver's CPU with the stream it meets (the receive path, decoding), so its chunks run slower by a
    factor that depends on the stream. Such a front
    still says how the cost grows with the cache before each chunk (attention's quadratic cost at long
    contexts, which the start-up lengths barely show): each one enters the fit deflated by its own
    slowdown against the unloaded fit, so it shapes the curve without slowing it. The sender learns the
    slowdown per path from the RESULT's ``front_s`` (``sender/peers.py``)."""

    def __init__(self, curve: PrefillCurve, decode_s: float,
                 points: Sequence[tuple[int, float]] = ()) -> None:
        self.curve = curve
        self.decode_s = decode_s
        self._initial = curve
        self._measured = [(0, int(n), float(t)) for n, t in points]
        self._unloaded: deque[tuple[int, int, float]] = deque(maxlen=RECENT_CALLS)
        self._fronts: deque[tuple[tuple[int, int, float], ...]] = deque(maxlen=RECENT_FRONTS)
        self.timed = 0  # calls folded in

    def observe(self, calls: Iterable[tuple[int, int, float]], loaded: bool = False) -> int:
        """Timed calls, each (start, stop, seconds): tokens [start, stop) computed over a cache of [0,
        start); ``loaded``: one split front's, run beside its stream. Implausible timings are ignored; the
        curve is refitted once over what was kept. Returns the calls taken."""
        taken = [(int(start), int(stop), float(seconds)) for start, stop, seconds in calls
                 if 0 <= start < stop and math.isfinite(seconds) and 0 < seconds <= MAX_CALL_S]
        if not taken:
            return 0
        if loaded:
            self._fronts.append(tuple(taken))
        else:
            self._unloaded.extend(taken)
        self.timed += len(taken)
        self.curve = self._refit()
        return len(taken)

    def _refit(self) -> PrefillCurve:
        anchor = [*self._measured, *self._unloaded]
        # Two distinct calls pin a line at least; without them the curve stated at start-up anchors it.
        base = fit_prefill_calls(anchor) if len({(s, e) for s, e, _ in anchor}) >= 2 else self._initial
        # Each front's slowdown is timed where the unloaded fit stands on measurements (up to its longest
        # call): beyond, the fit's own extrapolation would set the level the front is deflated to.
        reach = max((e for _, e, _ in anchor), default=0)
        deflated = []
        for front in self._fronts:
            inside = [call for call in front if call[1] <= reach]
            slowdown = front_slowdown(base, inside or front)
            if slowdown is not None:
                deflated += [(start, stop, seconds / slowdown) for start, stop, seconds in front]
        if not deflated:
            return base
        return fit_prefill_calls([*anchor, *deflated])

    def stated(self) -> tuple[int, int, int, int]:
        """The ACCEPT's fields for the curve as refitted and the measured decode step."""
        return stated_fields(self.curve, self.decode_s)
