"""A receiver's statement of its own prefill speed, as its ACCEPT carries it (sans-IO, pure arithmetic).

The receiver measures its prefill curve (``common/model/speed.py``) and states it in integer units, four
u32 fields of the ACCEPT (:mod:`pfec.common.wire.messages`); the sender believes a statement only if it
describes a working node, and its planner (:mod:`.breakeven`) then predicts with it. Between
measurements, ``RecentPrefills`` refits the curve over the measurement and the receiver's recent prefill
calls (a split's front chunks, a local prefill's), timed as they ran: its speed under its present load,
stated from then on.
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


RECENT_CALLS: Final = 64  # timed forward calls kept beside the start-up measurement
MAX_CALL_S: Final = 600.0  # a call timed longer than this says more about the timer than about the node


class RecentPrefills:
    """The curve this node states: refitted over its start-up measurement and its recent prefill calls
    (a split's front chunks, a local prefill's), timed as they ran, beside whatever stream or job shared
    the node with them: its speed under its present load (``fit_prefill_calls``). The start-up points
    (prefills from empty at a few lengths) keep the fit anchored; the recent calls, at the lengths and
    positions real handoffs need, correct it, attention's quadratic cost at long contexts included."""

    def __init__(self, curve: PrefillCurve, decode_s: float,
                 points: Sequence[tuple[int, float]] = ()) -> None:
        self.curve = curve
        self.decode_s = decode_s
        self._measured = [(0, int(n), float(t)) for n, t in points]
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=RECENT_CALLS)
        self.timed = 0  # calls folded in

    def observe(self, calls: Iterable[tuple[int, int, float]]) -> int:
        """Timed calls, each (start, stop, seconds): tokens [start, stop) computed over a cache of [0,
        start). Implausible timings are ignored; the curve is refitted once over what was kept. Returns
        the calls taken."""
        taken = 0
        for start, stop, seconds in calls:
            if 0 <= start < stop and math.isfinite(seconds) and 0 < seconds <= MAX_CALL_S:
                self._recent.append((int(start), int(stop), float(seconds)))
                taken += 1
        self.timed += taken
        kept = [*self._measured, *self._recent]
        if taken and len({(s, e) for s, e, _ in kept}) >= 2:  # two distinct calls pin a line at least
            self.curve = fit_prefill_calls(kept)
        return taken

    def stated(self) -> tuple[int, int, int, int]:
        """The ACCEPT's fields for the curve as refitted and the measured decode step."""
        return stated_fields(self.curve, self.decode_s)
