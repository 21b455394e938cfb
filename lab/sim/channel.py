"""Seeded packet-loss models for the slot simulator and the emulated link (sans-IO).

A model realizes a boolean loss vector for ``n_slots`` transmission slots, slot ``i``
being sent at time ``i * slot_s``: ``lost[i]`` is True when that packet is dropped.
All randomness comes from the ``numpy.random.Generator`` passed in, so the same
generator state gives the same losses to every caller (paired comparisons). Use
``realization_rng(seed, realization, stream)`` to get one independent, reproducible
generator per (seed, realization, stream), e.g. streams "forward", "reverse", "control".

Models:

* ``Bernoulli(p)`` -- i.i.d. loss with probability p.
* ``GilbertElliott(eps_g, eps_b, p_gb, p_bg)`` -- two-state Markov chain (Good/Bad). Per
  packet: lose with probability eps of the current state, then move G->B w.p. p_gb or
  B->G w.p. p_bg. The first state is drawn from the stationary distribution
  (P[B] = p_gb / (p_gb + p_bg)). Mean loss = (p_bg*eps_g + p_gb*eps_b)/(p_gb + p_bg).
  Realized from geometric sojourn times in fixed-size chunks, so the result for n slots
  is a prefix of the result for m > n slots from the same generator state.
* ``TraceReplay(times_s, lost, name)`` -- piecewise-constant replay of a recorded trace.

Loss trace text format (``load_trace`` / ``write_trace``), UTF-8::

    # pfec-loss-trace v1          <- mandatory first line, exactly this
    # any further comment lines   <- optional, only before the data
    time_s,lost                   <- optional column-name line
    0.000,0                       <- data: time in seconds (finite float), lost 0 or 1
    0.010,1
    0.012,0

Times are non-decreasing; blank lines are ignored. The state holds from an entry's time
until the next entry's: a packet sent at trace time t takes the ``lost`` value of the
last entry with time <= t (the last one among equal times). The trace repeats with
period ``(t_last - t_first) + mean entry spacing`` (``(t_last - t_first) * N / (N - 1)``
for N entries), so N evenly spaced per-packet records each last one spacing per period;
a single entry (or all entries at one time) is a constant state. A realization of
``n_slots`` needs ``n_slots * slot_s`` seconds; its start offset into the trace is drawn
uniformly from the offsets that fit, or from the whole period (wrapping around) when the
trace is shorter than that.

Loss specs (``parse_loss_spec``): ``bernoulli:P``, ``ge:EG,EB,PGB,PBG``, ``trace:PATH``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "MAIN_GE",
    "TRACE_MAGIC",
    "Bernoulli",
    "GilbertElliott",
    "LossModel",
    "TraceReplay",
    "load_trace",
    "parse_loss_spec",
    "realization_rng",
    "write_trace",
]

TRACE_MAGIC: Final = "# pfec-loss-trace v1"
_COLUMNS: Final = "time_s,lost"
_CHUNK: Final = 1024  # GE sojourns drawn per state per chunk (fixed: keeps prefix property)

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


@runtime_checkable
class LossModel(Protocol):
    def realize(self, n_slots: int, slot_s: float, rng: np.random.Generator) -> BoolArray:
        """bool[n_slots], True = lost; slot i is transmitted at time i * slot_s."""
        ...


def _check_prob(name: str, p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")


def _check_slots(n_slots: int, slot_s: float) -> None:
    if isinstance(n_slots, bool) or not isinstance(n_slots, (int, np.integer)) or n_slots < 0:
        raise ValueError(f"n_slots must be a non-negative int, got {n_slots!r}")
    if not (isinstance(slot_s, (int, float)) and math.isfinite(slot_s) and slot_s > 0):
        raise ValueError(f"slot_s must be a positive finite number, got {slot_s!r}")


@dataclass(frozen=True)
class Bernoulli:
    p: float

    def __post_init__(self) -> None:
        _check_prob("p", self.p)

    @property
    def mean_loss(self) -> float:
        return float(self.p)

    @property
    def mean_burst(self) -> float:
        """Expected length of a run of consecutive losses."""
        return math.inf if self.p >= 1.0 else 1.0 / (1.0 - self.p)

    def realize(self, n_slots: int, slot_s: float, rng: np.random.Generator) -> BoolArray:
        _check_slots(n_slots, slot_s)
        return rng.random(int(n_slots)) < self.p


@dataclass(frozen=True)
class GilbertElliott:
    eps_g: float
    eps_b: float
    p_gb: float
    p_bg: float

    def __post_init__(self) -> None:
        for name in ("eps_g", "eps_b", "p_gb", "p_bg"):
            _check_prob(name, getattr(self, name))
        if self.p_gb + self.p_bg <= 0.0:
            raise ValueError("GilbertElliott needs p_gb + p_bg > 0")

    @property
    def pi_bad(self) -> float:
        """Stationary probability of the Bad state."""
        return self.p_gb / (self.p_gb + self.p_bg)

    @property
    def mean_loss(self) -> float:
        return (self.p_bg * self.eps_g + self.p_gb * self.eps_b) / (self.p_gb + self.p_bg)

    @property
    def mean_good_sojourn(self) -> float:
        return math.inf if self.p_gb == 0 else 1.0 / self.p_gb

    @property
    def mean_bad_sojourn(self) -> float:
        return math.inf if self.p_bg == 0 else 1.0 / self.p_bg

    @property
    def mean_burst(self) -> float:
        """Expected length of a run of consecutive losses (stationary chain).

        = P[loss] / P[no loss at i-1, loss at i].
        """
        pb = self.pi_bad
        pg = 1.0 - pb
        eg, eb = self.eps_g, self.eps_b
        onset = pg * (1.0 - eg) * ((1.0 - self.p_gb) * eg + self.p_gb * eb) + pb * (1.0 - eb) * (
            self.p_bg * eg + (1.0 - self.p_bg) * eb
        )
        loss = self.mean_loss
        if loss == 0.0:
            return 0.0
        return math.inf if onset == 0.0 else loss / onset

    def _sojourns(self, p: float, rng: np.random.Generator, cap: int) -> npt.NDArray[np.int64]:
        if p == 0.0:
            return np.full(_CHUNK, cap, dtype=np.int64)  # absorbing state; no draws
        return np.clip(rng.geometric(p, _CHUNK), 1, cap).astype(np.int64, copy=False)

    def states(self, n_slots: int, rng: np.random.Generator) -> BoolArray:
        """Hidden state per slot (True = Bad), consuming ``rng`` like ``realize`` does."""
        n = int(n_slots)
        bad0 = bool(rng.random() < self.pi_bad)
        cap = max(n, 1)
        runs: list[npt.NDArray[np.int64]] = []
        total = 0
        while total < n:
            g = self._sojourns(self.p_gb, rng, cap)
            b = self._sojourns(self.p_bg, rng, cap)
            chunk = np.empty(2 * _CHUNK, dtype=np.int64)
            first, second = (b, g) if bad0 else (g, b)
            chunk[0::2] = first
            chunk[1::2] = second
            runs.append(chunk)
            total += int(chunk.sum())
        if n == 0:
            return np.zeros(0, dtype=np.bool_)
        lengths = np.concatenate(runs)
        ends = np.cumsum(lengths)
        k = int(np.searchsorted(ends, n))  # first run reaching slot n-1
        lengths = lengths[: k + 1].copy()
        lengths[k] -= int(ends[k]) - n
        labels = np.zeros(k + 1, dtype=np.bool_)
        labels[0 if bad0 else 1 :: 2] = True
        return np.repeat(labels, lengths)

    def realize(self, n_slots: int, slot_s: float, rng: np.random.Generator) -> BoolArray:
        _check_slots(n_slots, slot_s)
        n = int(n_slots)
        # Two sub-streams (state sojourns, per-packet coins) keep the prefix property.
        seeds = rng.integers(0, 2**63, size=2, dtype=np.int64)
        rng_state = np.random.default_rng(int(seeds[0]))
        rng_coin = np.random.default_rng(int(seeds[1]))
        bad = self.states(n, rng_state)
        eps = np.where(bad, self.eps_b, self.eps_g)
        return rng_coin.random(n) < eps


MAIN_GE: Final = GilbertElliott(0.001, 0.50, 0.02, 0.10)


@dataclass(frozen=True, eq=False)
class TraceReplay:
    times_s: FloatArray
    lost: BoolArray
    name: str = "trace"
    period_s: float = field(init=False)

    def __post_init__(self) -> None:
        times = np.array(self.times_s, dtype=np.float64)
        raw_lost = np.asarray(self.lost)
        if times.ndim != 1 or raw_lost.ndim != 1 or times.shape != raw_lost.shape:
            raise ValueError(f"{self.name}: times_s and lost must be 1-D arrays of equal length")
        if times.size == 0:
            raise ValueError(f"{self.name}: empty trace")
        if not np.all(np.isfinite(times)):
            raise ValueError(f"{self.name}: non-finite time")
        if np.any(np.diff(times) < 0):
            i = int(np.argmax(np.diff(times) < 0)) + 1
            raise ValueError(f"{self.name}: times decrease at entry {i} ({times[i - 1]!r} -> {times[i]!r})")
        if raw_lost.dtype != np.bool_ and not np.all((raw_lost == 0) | (raw_lost == 1)):
            raise ValueError(f"{self.name}: lost values must be 0/1 or bool")
        lost = raw_lost.astype(np.bool_)
        times.setflags(write=False)
        lost.setflags(write=False)
        n = times.size
        span = float(times[-1] - times[0])
        period = span * n / (n - 1) if n > 1 else 0.0
        object.__setattr__(self, "times_s", times)
        object.__setattr__(self, "lost", lost)
        object.__setattr__(self, "period_s", period)

    def __repr__(self) -> str:
        return f"TraceReplay(name={self.name!r}, entries={self.times_s.size}, period_s={self.period_s:g})"

    @property
    def mean_loss(self) -> float:
        """Time-weighted loss fraction over one period."""
        if self.period_s <= 0.0:
            return float(self.lost[-1])
        rel = self.times_s - self.times_s[0]
        dur = np.diff(np.append(rel, self.period_s))
        return float(np.sum(dur * self.lost) / self.period_s)

    def realize(self, n_slots: int, slot_s: float, rng: np.random.Generator) -> BoolArray:
        _check_slots(n_slots, slot_s)
        n = int(n_slots)
        u = float(rng.random())  # always drawn, so the stream advances the same way
        period = self.period_s
        if period <= 0.0:
            return np.full(n, bool(self.lost[-1]), dtype=np.bool_)
        need = n * float(slot_s)
        t = np.arange(n, dtype=np.float64) * float(slot_s)
        if need <= period * (1.0 + 1e-9):  # fits (tolerating rounding in the period)
            t += u * max(period - need, 0.0)
        else:
            t += u * period
            np.mod(t, period, out=t)
        rel = self.times_s - self.times_s[0]
        idx = np.searchsorted(rel, t, side="right") - 1
        return self.lost[np.maximum(idx, 0)].copy()


# --------------------------------------------------------------------------- trace files


def load_trace(path: str | os.PathLike[str]) -> TraceReplay:
    """Read a loss trace (format in the module docstring); ValueError names file:line."""
    p = os.fspath(path)
    with open(p, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not lines or lines[0].strip() != TRACE_MAGIC:
        got = lines[0] if lines else ""
        raise ValueError(f"{p}:1: expected first line {TRACE_MAGIC!r}, got {got!r}")
    times: list[float] = []
    lost: list[bool] = []
    in_header = True
    for lineno, raw in enumerate(lines[1:], start=2):
        line = raw.strip()
        if not line:
            continue
        if in_header and line.startswith("#"):
            continue
        if in_header and line.replace(" ", "") == _COLUMNS:
            in_header = False
            continue
        in_header = False
        parts = line.split(",")
        if len(parts) != 2:
            raise ValueError(f"{p}:{lineno}: expected 'time_s,lost', got {raw!r}")
        ts, ls = parts[0].strip(), parts[1].strip()
        try:
            t = float(ts)
        except ValueError:
            raise ValueError(f"{p}:{lineno}: bad time_s {ts!r} (expected a number of seconds)") from None
        if not math.isfinite(t):
            raise ValueError(f"{p}:{lineno}: bad time_s {ts!r} (must be finite)")
        if times and t < times[-1]:
            raise ValueError(f"{p}:{lineno}: time_s {ts!r} is before the previous time {times[-1]!r}")
        if ls not in ("0", "1"):
            raise ValueError(f"{p}:{lineno}: bad lost value {ls!r} (expected 0 or 1)")
        times.append(t)
        lost.append(ls == "1")
    if not times:
        raise ValueError(f"{p}: no data lines")
    return TraceReplay(np.array(times, dtype=np.float64), np.array(lost, dtype=np.bool_), name=p)


def write_trace(
    path: str | os.PathLike[str],
    times_s: npt.ArrayLike,
    lost: npt.ArrayLike,
    *,
    comment: str | None = None,
) -> None:
    """Write a trace that ``load_trace`` reads back exactly (floats via repr)."""
    tr = TraceReplay(np.asarray(times_s, dtype=np.float64), np.asarray(lost), name=os.fspath(path))
    out = [TRACE_MAGIC]
    if comment:
        out.extend("# " + c for c in comment.splitlines())
    out.extend(f"{float(t)!r},{int(x)}" for t, x in zip(tr.times_s.tolist(), tr.lost.tolist(), strict=True))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


# --------------------------------------------------------------------------- specs & seeds


def parse_loss_spec(spec: str) -> LossModel:
    """``bernoulli:P`` | ``ge:EG,EB,PGB,PBG`` | ``trace:PATH`` -> a loss model."""
    forms = "expected 'bernoulli:P', 'ge:EG,EB,PGB,PBG' or 'trace:PATH'"
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"bad loss spec {spec!r}: {forms}")
    kind, _, arg = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "trace":
        path = arg.strip()
        if not path:
            raise ValueError(f"bad loss spec {spec!r}: missing PATH; expected 'trace:PATH'")
        try:
            return load_trace(path)
        except OSError as exc:
            raise ValueError(f"bad loss spec {spec!r}: cannot read trace file: {exc}") from exc
    if kind == "bernoulli":
        form, n_args = "'bernoulli:P' with P in [0, 1]", 1
    elif kind == "ge":
        form, n_args = "'ge:EG,EB,PGB,PBG', each in [0, 1] and PGB+PBG > 0", 4
    else:
        raise ValueError(f"bad loss spec {spec!r}: unknown kind {kind!r}; {forms}")
    fields_ = [a.strip() for a in arg.split(",")]
    if len(fields_) != n_args:
        raise ValueError(f"bad loss spec {spec!r}: got {len(fields_)} value(s); expected {form}")
    values: list[float] = []
    for a in fields_:
        try:
            v = float(a)
        except ValueError:
            raise ValueError(f"bad loss spec {spec!r}: {a!r} is not a number; expected {form}") from None
        if not 0.0 <= v <= 1.0:  # also rejects nan
            raise ValueError(f"bad loss spec {spec!r}: {a!r} is not in [0, 1]; expected {form}")
        values.append(v)
    if kind == "bernoulli":
        return Bernoulli(values[0])
    if values[2] + values[3] <= 0.0:
        raise ValueError(f"bad loss spec {spec!r}: PGB + PBG must be > 0; expected {form}")
    return GilbertElliott(*values)


def _stream_key(stream: str) -> int:
    return int.from_bytes(hashlib.sha256(stream.encode("utf-8")).digest()[:8], "big")


def realization_rng(seed: int, realization: int, stream: str) -> np.random.Generator:
    """Independent, reproducible generator for one (seed, realization, stream).

    Same arguments -> same numbers on every call and machine; different realization or
    stream -> statistically independent streams (SeedSequence spawn keys).
    """
    for name, v in (("seed", seed), ("realization", realization)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if not isinstance(stream, str) or not stream:
        raise ValueError(f"stream must be a non-empty str, got {stream!r}")
    ss = np.random.SeedSequence(entropy=int(seed), spawn_key=(int(realization), _stream_key(stream)))
    return np.random.Generator(np.random.PCG64(ss))
