"""A receiver's statement of its own speed, as its ACCEPT carries it (sans-IO, pure arithmetic).

The receiver measures what the planner predicts of it (``common/model/speed.py``: its prefill curve, the
first decode step, the rebuild per token at each precision, the question's masked forward; and the
receive path's CPU per datagram, ``receiver/node_speed.py``) and states it in integer units, thirteen u32
fields of the ACCEPT (``Statement``; :mod:`pfec.common.wire.messages`). The sender plans with each number
that describes a working node and with a conservative default for each one missing or absurd, named in
the model's ``defaulted`` (``stated_receiver``). Between measurements, ``RecentPrefills`` refits the curve
over the measurement and the receiver's recent prefill calls, timed as they ran: its speed under its
present load (a split's front, slowed by the stream it meets, shapes the curve but does not set its
level), stated from then on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np

from pfec.common.plan.breakeven import (
    DEFAULT_MODEL_DECODE_S,
    DEFAULT_MODEL_PREFILL,
    MEASURED_REBUILD_LEVELS,
    ReceiverModel,
)
from pfec.common.plan.prefill import PrefillCurve, fit_prefill_calls
from pfec.common.wire.messages import Accept

# What a stated curve may claim: no per-token cost (b = c = 0) or a first token later than this at 1k tokens
# is not a measurement of a working node.
MAX_STATED_PREFILL_S: Final = 600.0
MAX_STATED_DECODE_S: Final = 10.0
#: Bounds on the other stated numbers: past them a statement is absurd, and planned with the defaults.
MAX_STATED_REBUILD_S_PER_TOKEN: Final = 1e-3  # 8 s to rebuild 8k tokens
MAX_STATED_QUESTION_S: Final = 60.0  # a 64-token question over 8k cached tokens
MAX_STATED_DATAGRAM_S: Final = 0.01  # 10 ms of CPU per datagram: 100 datagrams a second
#: The receive path's CPU per datagram assumed where a receiver states none (or an absurd one): about twice
#: what the default demo's receiver measured on a 2-core AMD EPYC VM, so a split's front is not promised a
#: core it will share.
DEFAULT_DATAGRAM_S: Final = 60e-6
_U32: Final = 0xFFFF_FFFF


class Statement(NamedTuple):
    """A node's measured speed in the ACCEPT's integer units (its fields after ``receiver_random``, in
    order; 0: not measured). See ``stated_fields`` and ``stated_receiver``."""

    prefill_a_us: int = 0
    prefill_b_ns: int = 0
    prefill_c_ps: int = 0
    decode_us: int = 0
    rebuild_native_ns: int = 0  # per context token, every layer
    rebuild_int8_ns: int = 0
    rebuild_int4_ns: int = 0
    rebuild_int2_ns: int = 0
    question_a_us: int = 0  # the question's masked forward over a cache: fixed,
    question_ns_per_token: int = 0  # per question token,
    question_ps_per_cached: int = 0  # per cached token
    decode_ps_per_cached: int = 0  # the first decode step's growth per cached token
    datagram_ns: int = 0  # the receive path's CPU per datagram


def statement_of(accept: Accept) -> Statement:
    """The statement an ACCEPT carries."""
    return Statement._make(getattr(accept, name) for name in Statement._fields)


@dataclass(frozen=True, slots=True)
class MeasuredParts:
    """What a node measured of itself beside its prefill curve, in seconds (``ReceiverModel``'s fields of
    the same names). Anything not finite or negative is stated as not measured."""

    rebuild_s_per_token: tuple[float, float, float, float] | None = None
    question_fit: tuple[float, float, float] | None = None
    decode_s_per_token: float = 0.0
    datagram_s: float | None = None


def _nonneg_lstsq(design: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (every set of free columns tried: few columns)."""
    scale = np.maximum(np.abs(design).max(axis=0), 1e-30)
    best: tuple[float, np.ndarray] | None = None
    n = design.shape[1]
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(design[:, cols] / scale[cols], seconds, rcond=None)
        coef = np.zeros(n)
        coef[cols] = sol / scale[cols]
        if (coef < 0).any():
            continue
        residual = float(np.sum((design @ coef - seconds) ** 2))
        if best is None or residual < best[0] - 1e-18:
            best = (residual, coef)
    assert best is not None  # the first column alone (a mean of positive times) is feasible
    return best[1]


def _checked(points: Sequence[tuple[float, ...]], what: str) -> np.ndarray:
    arr = np.asarray(points, dtype=np.float64)
    if (arr.ndim != 2 or len(arr) < 2 or not np.isfinite(arr).all() or (arr < 0).any()
            or (arr[:, -1] <= 0).any()):
        raise ValueError(f"{what}: need 2 or more finite points with positive times, got {points!r}")
    return arr


def fit_question(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(a, per question token, per cached token) >= 0 through timed question forwards (question tokens,
    cached tokens, seconds): t = a + b q + e N."""
    arr = _checked(points, "question forwards")
    design = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)
    a, b, e = (float(x) for x in _nonneg_lstsq(design, arr[:, 2]))
    return a, b, e


def fit_decode(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per cached token) >= 0 through timed decode steps (cached tokens, seconds)."""
    arr = _checked(points, "decode steps")
    fixed, per_cached = (float(x) for x in _nonneg_lstsq(np.stack([np.ones(len(arr)), arr[:, 0]], axis=1),
                                                          arr[:, 1]))
    return fixed, per_cached


def _unit(value: float | None, scale: float) -> int:
    """``value`` in an integer unit (``value * scale``) as a u32: 0 for a value that is missing, not
    finite or negative; the largest u32 for one that does not fit (refused by ``stated_receiver``)."""
    if value is None or not math.isfinite(value) or value < 0:
        return 0
    return min(_U32, round(value * scale)) if value * scale < _U32 else _U32


def stated_fields(curve: PrefillCurve, decode_s: float, parts: MeasuredParts | None = None) -> Statement:
    """A measured curve, its decode step and (``parts``) the rest of what the node measured, in the
    ACCEPT's integer units (a in us, b in ns/token, c in ps/token^2, decode in us; the rest as
    ``Statement`` names them), each clamped to a u32 (a slower node states the largest value, which
    ``stated_receiver`` refuses)."""
    parts = parts or MeasuredParts()
    rebuild = parts.rebuild_s_per_token or (None, None, None, None)
    question = parts.question_fit or (None, None, None)
    return Statement._make([
        _unit(curve.a, 1e6), _unit(curve.b, 1e9), _unit(curve.c, 1e12), _unit(decode_s, 1e6),
        *(_unit(x, 1e9) for x in rebuild),
        _unit(question[0], 1e6), _unit(question[1], 1e9), _unit(question[2], 1e12),
        _unit(parts.decode_s_per_token, 1e12), _unit(parts.datagram_s, 1e9),
    ])


def _stated_curve(st: Statement, defaulted: list[str]) -> PrefillCurve:
    curve = PrefillCurve(st.prefill_a_us * 1e-6, st.prefill_b_ns * 1e-9, st.prefill_c_ps * 1e-12)
    if (curve.b == 0 and curve.c == 0) or curve.seconds(1024) > MAX_STATED_PREFILL_S:
        defaulted.append("prefill")  # no per-token cost, or absurdly slow
        return DEFAULT_MODEL_PREFILL
    return curve


def _stated_rebuild(st: Statement, defaulted: list[str]) -> tuple[float, float, float, float] | None:
    ns = (st.rebuild_native_ns, st.rebuild_int8_ns, st.rebuild_int4_ns, st.rebuild_int2_ns)
    bad = [f"rebuild_{name}_s_per_token" for name, x in zip(MEASURED_REBUILD_LEVELS, ns, strict=True)
           if not 0 < x * 1e-9 <= MAX_STATED_REBUILD_S_PER_TOKEN]
    if bad:
        defaulted.extend(bad)
        return None
    native, int8, int4, int2 = (x * 1e-9 for x in ns)
    return native, int8, int4, int2


def _stated_question(st: Statement, defaulted: list[str]) -> tuple[float, float, float] | None:
    fit = (st.question_a_us * 1e-6, st.question_ns_per_token * 1e-9, st.question_ps_per_cached * 1e-12)
    if fit == (0.0, 0.0, 0.0) or fit[0] + 64 * fit[1] + 8192 * fit[2] > MAX_STATED_QUESTION_S:
        defaulted.append("question_fit")
        return None
    return fit


def stated_receiver(*fields: int) -> ReceiverModel | None:
    """The receiver model an ACCEPT states (``Statement``'s fields in order, the missing ones 0), or None
    when it states none (all 0). A number that is missing or absurd (no per-token prefill cost, slower
    than the bounds above, 0 where a measurement cannot be 0) is replaced by its conservative default
    (the stored curve, the rebuild constants, the question as a prefill chunk, ``DEFAULT_DATAGRAM_S``)
    and named in the model's ``defaulted``; never raises for what a receiver states."""
    if len(fields) > len(Statement._fields):
        raise TypeError(f"a statement has {len(Statement._fields)} fields, got {len(fields)}")
    st = Statement._make([min(_U32, max(0, int(x))) for x in fields] + [0] * (13 - len(fields)))
    if not any(st):
        return None
    defaulted: list[str] = []
    curve = _stated_curve(st, defaulted)
    decode_s = st.decode_us * 1e-6
    if not 0 < decode_s <= MAX_STATED_DECODE_S:
        defaulted.append("decode_s")
        decode_s = DEFAULT_MODEL_DECODE_S
    decode_per_token = st.decode_ps_per_cached * 1e-12
    if decode_per_token * 8192 > MAX_STATED_DECODE_S:
        defaulted.append("decode_s_per_token")
        decode_per_token = 0.0
    datagram_s = st.datagram_ns * 1e-9
    if not 0 < datagram_s <= MAX_STATED_DATAGRAM_S:
        defaulted.append("datagram_s")
        datagram_s = DEFAULT_DATAGRAM_S
    return ReceiverModel(curve, decode_s, rebuild_s_per_token=_stated_rebuild(st, defaulted),
                         question_fit=_stated_question(st, defaulted), decode_s_per_token=decode_per_token,
                         datagram_s=datagram_s, defaulted=tuple(defaulted))


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
                 points: Sequence[tuple[int, float]] = (), parts: MeasuredParts | None = None) -> None:
        self.curve = curve
        self.decode_s = decode_s
        self.parts = parts or MeasuredParts()  # the rest of what the node measured, stated beside the curve
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

    def stated(self) -> Statement:
        """The ACCEPT's fields for the curve as refitted, the measured decode step and parts."""
        return stated_fields(self.curve, self.decode_s, self.parts)
