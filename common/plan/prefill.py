"""A node's prefill speed (sans-IO, pure arithmetic): the curve t(N) = a + bN + cN^2, how a split's front
is cut into forward calls, and least-squares fits of the curve to timed prefills.

The break-even planner (:mod:`.breakeven`) predicts every option from this curve; a node measures it
(``common/model/speed.py``), states it in its ACCEPTs and refits it over its recent prefills
(:mod:`.receiver_speed`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

__all__ = [
    "FRONT_CHUNK_TOKENS",
    "PrefillCurve",
    "finite_nonneg",
    "fit_prefill_calls",
    "fit_prefill_curve",
    "front_chunk_end",
    "meeting_chunk_end",
]


def finite_nonneg(name: str, value: float) -> float:
    """``value`` as a float, refused unless finite and >= 0."""
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


# --- Prefill speed ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillCurve:
    """Seconds to prefill N tokens: t(N) = a + b N + c N^2 (t(0) = 0: nothing to compute)."""

    a: float  # fixed cost per prefill call, s
    b: float  # s per token (weights: linear in N)
    c: float  # s per token^2 (attention: quadratic in N)

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            finite_nonneg(f"PrefillCurve.{name}", getattr(self, name))

    def seconds(self, n_tokens: float) -> float:
        """Predicted seconds to prefill ``n_tokens`` from an empty cache."""
        if n_tokens < 0 or not math.isfinite(n_tokens):
            raise ValueError(f"token count must be finite and >= 0, got {n_tokens!r}")
        if n_tokens == 0:
            return 0.0
        return self.a + self.b * n_tokens + self.c * n_tokens * n_tokens

    def chunk_seconds(self, start: float, stop: float) -> float:
        """Predicted seconds to compute tokens [start, stop) given the cache of [0, start).

        The work is t(stop) - t(start) (b per token, attention c (j^2 - i^2)); the fixed cost ``a`` comes
        once per forward call, so a chunk [i, j) with i > 0 costs a + t(j) - t(i), and [0, j) costs t(j).
        """
        if not 0 <= start <= stop:
            raise ValueError(f"chunk [{start}, {stop}) must satisfy 0 <= start <= stop")
        if start == stop:
            return 0.0
        extra = self.a if start > 0 else 0.0
        return extra + self.seconds(stop) - self.seconds(start)

    def tokens_per_second(self, n_tokens: int) -> float:
        """Average prefill throughput over a context of ``n_tokens``."""
        if n_tokens <= 0:
            raise ValueError(f"token count must be positive, got {n_tokens!r}")
        seconds = self.seconds(n_tokens)
        return math.inf if seconds == 0 else n_tokens / seconds

    def to_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c}


#: Tokens per forward call of a split's front prefill (the receiver daemon's, and the simulator's model of
#: it), each chunk's end reported to the sender (small: finer progress, more per-call overhead). Measured
#: here (default model, 2 threads, 688 tokens, load 1.2): one pass 1.10 s, chunks of 128 tokens 1.55 s, of
#: 256 tokens 1.33 s.
FRONT_CHUNK_TOKENS: Final = 256


def front_chunk_end(done: int, meeting_token: int, n_tokens: int, chunk_tokens: int = FRONT_CHUNK_TOKENS,
                    ) -> int:
    """Where the front's next chunk from token ``done`` ends: ``chunk_tokens`` on, except that the chunk
    that crosses the meeting token ends on it (the session can start there once the back has arrived, so
    tokens past it are computed only while the stream is late), and never past the context."""
    if not 0 <= done < n_tokens or chunk_tokens < 1:
        raise ValueError(f"front chunk from token {done!r} of {n_tokens!r} in chunks of {chunk_tokens!r}")
    end = min(n_tokens, done + chunk_tokens)
    return meeting_token if done < meeting_token < end else end


#: Where a front's chunk may end early (tokens): the symbol token ends' grain (a layout's block tokens).
MEETING_STEP_TOKENS: Final = 16


def meeting_chunk_end(done: int, end: int, seconds_per_token: float, missing_token_ends: np.ndarray,
                      symbols_per_s: float, step: int = MEETING_STEP_TOKENS) -> int:
    """Where a split's front chunk from ``done`` should end, at most ``end``: the first token m (on the
    ``step`` grid, or ``end``) by whose computation the stream is forecast to have delivered every symbol
    still missing past it, so the two sides meet there instead of at the planned meeting token.

    Computing [done, m) is forecast at ``seconds_per_token`` (this front's own pace so far); the stream's
    missing symbols (``missing_token_ends``, sorted: each one's token end) arrive in send order, the back
    then the front from the meeting token down, at ``symbols_per_s`` (what this stream has delivered so far).
    A chunk that ends too early costs only a wait for the stream (the next chunk stops once the session is
    ready); one that ends too late computes what the stream would have brought: one forward call either
    way, so the forecast's crossing, without a margin. ``end`` when the stream cannot meet the chunk."""
    if not 0 <= done < end or step < 1:
        raise ValueError(f"a chunk [{done!r}, {end!r}) in steps of {step!r}")
    if not (seconds_per_token > 0 and symbols_per_s > 0) or not (
            math.isfinite(seconds_per_token) and math.isfinite(symbols_per_s)):
        return end
    candidates = np.append(np.arange(done + step - done % step, end, step, dtype=np.int64), end)
    missing_past = len(missing_token_ends) - np.searchsorted(missing_token_ends, candidates, side="right")
    met = missing_past / symbols_per_s <= (candidates - done) * seconds_per_token
    return int(candidates[int(np.argmax(met))]) if met.any() else end


def fit_prefill_curve(points: Sequence[tuple[int, float]]) -> PrefillCurve:
    """Least-squares t(N) = a + bN + cN^2 with a, b, c >= 0 through measured (N, seconds) points.

    Needs at least two distinct token counts; timings must be finite and positive (``fit_prefill_calls``
    does the fitting).
    """
    if len(points) < 2:
        raise ValueError(f"need at least 2 (tokens, seconds) points to fit prefill speed, got {len(points)}")
    for n, t in points:
        if not isinstance(n, int | np.integer) or n <= 0:
            raise ValueError(f"prefill point token count must be a positive integer, got {n!r}")
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"prefill point time must be finite and > 0 s, got {t!r} for {n} tokens")
    if len({int(n) for n, _ in points}) < 2:
        raise ValueError("prefill points need at least 2 distinct token counts")
    return fit_prefill_calls([(0, int(n), float(t)) for n, t in points])


def fit_prefill_calls(calls: Sequence[tuple[int, int, float]]) -> PrefillCurve:
    """Least squares with a, b, c >= 0 through timed forward calls: (start, stop, seconds) computed tokens
    [start, stop) over a cache of [0, start) (start 0: a prefill from empty). Each call costs
    a + b (stop - start) + c (stop^2 - start^2) (``PrefillCurve.chunk_seconds``), linear in a, b, c, so a
    split's front chunks and the start-up measurement fit one curve.

    Non-negative least squares by trying every set of free coefficients (3 unknowns: 7 sets) and keeping
    the feasible fit with the smallest residual; a negative c (noise on a nearly linear curve) becomes 0.
    ValueError for no call, or a call that is not 0 <= start < stop with a finite positive time.
    """
    if not calls:
        raise ValueError("no timed prefill calls to fit")
    for start, stop, seconds in calls:
        if not 0 <= start < stop or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"a timed call must compute [start, stop) with 0 <= start < stop in a finite "
                             f"positive time, got ({start!r}, {stop!r}, {seconds!r})")
    starts = np.array([float(c[0]) for c in calls])
    stops = np.array([float(c[1]) for c in calls])
    ts = np.array([float(c[2]) for c in calls])
    design = np.stack([np.ones_like(stops), stops - starts, stops * stops - starts * starts], axis=1)
    scale = np.abs(design).max(axis=0)  # condition the columns (N^2 ~ 1e6)
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(design[:, cols] / scale[cols], ts, rcond=None)
        coef = np.zeros(3)
        coef[cols] = sol / scale[cols]
        if (coef < 0).any():
            continue
        residual = float(np.sum((design @ coef - ts) ** 2))
        if best is None or residual < best[0] - 1e-18:
            best = (residual, coef)
    assert best is not None  # mask 1 (a alone = mean of positive times) is always feasible
    a, b, c = (float(x) for x in best[1])
    return PrefillCurve(a, b, c)
