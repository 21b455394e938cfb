"""This node's prefill speed for its model: timed at start-up, re-measured on demand, fed to the planner.

Whether a KV handoff beats recomputing depends on how fast the receiver prefills (common/plan/breakeven).
That speed is a property of the node (device, threads, load), not of the model, so each node measures it:
one warm-up, then one prefill at each of a few context lengths, and a least-squares fit of
t(N) = a + bN + cN^2 (c >= 0). A prefix's KV does not depend on what follows, so computing tokens [i, j)
given the cache of [0, i) costs about t(j) - t(i) (``PrefillCurve.chunk_seconds``). One decode step after
the longest prefill gives the per-token decode time. On the default model this takes a few seconds.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from pfec.common.model.kvcache import prefill
from pfec.common.model.loading import ModelRuntime, check_length
from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.prefill import PrefillCurve, fit_prefill_curve

DEFAULT_LENGTHS: Final = (128, 512, 1024)
WARM_UP_TOKENS: Final = 64


@dataclass(frozen=True, slots=True)
class PrefillSpeed:
    """A node's measured prefill curve, the points behind it and the conditions they were taken in."""

    curve: PrefillCurve
    points: tuple[tuple[int, float], ...]  # (tokens, seconds) as measured
    decode_s: float  # one decode step after the longest prefill (fastest of the repeats)
    threads: int  # torch intra-op threads during the measurement
    device: str
    model_id: str

    def seconds(self, n_tokens: float) -> float:
        """Predicted seconds to prefill ``n_tokens``."""
        return self.curve.seconds(n_tokens)

    def chunk_seconds(self, start: float, stop: float) -> float:
        """Predicted seconds to compute tokens [start, stop) given the cache of [0, start)."""
        return self.curve.chunk_seconds(start, stop)

    def tokens_per_second(self, n_tokens: int = 1024) -> float:
        """Average prefill throughput at ``n_tokens`` (the daemons' ``pfec_prefill_tokens_per_second``)."""
        return self.curve.tokens_per_second(n_tokens)

    def receiver_model(self) -> ReceiverModel:
        """The planner's view of this node as a receiver."""
        return ReceiverModel(self.curve, self.decode_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "curve": self.curve.to_dict(), "points": [list(p) for p in self.points],
            "decode_s": self.decode_s, "threads": self.threads, "device": self.device,
            "model_id": self.model_id, "tokens_per_second_1024": self.tokens_per_second(1024),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillSpeed:
        """Parse ``to_dict`` output; missing keys or bad numbers are refused with a reason."""
        try:
            coef = data["curve"]
            curve = PrefillCurve(float(coef["a"]), float(coef["b"]), float(coef["c"]))
            points = tuple((int(n), float(t)) for n, t in data["points"])
            decode_s = float(data["decode_s"])
            threads, device, model_id = int(data["threads"]), str(data["device"]), str(data["model_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a prefill speed record: {exc}") from None
        if not math.isfinite(decode_s) or decode_s < 0:
            raise ValueError(f"decode_s must be finite and >= 0, got {decode_s!r}")
        return cls(curve, points, decode_s, threads, device, model_id)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run with ``threads`` torch intra-op threads (None: as set), restoring the previous count after."""
    before = torch.get_num_threads()
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"torch threads must be positive, got {threads!r}")
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _sync(runtime: ModelRuntime) -> None:
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)


def _token_ids(runtime: ModelRuntime, n_tokens: int, seed: int) -> list[int]:
    """Fixed pseudo-random ids (prefill time does not depend on which tokens), avoiding the lowest ids."""
    vocab = int(runtime.model.config.vocab_size)
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(min(3, vocab - 1), vocab, size=n_tokens)]


def _timed_prefill(runtime: ModelRuntime, ids: list[int]) -> tuple[float, Any]:
    _sync(runtime)
    started = time.perf_counter()
    cache, _ = prefill(runtime, ids)
    _sync(runtime)
    return time.perf_counter() - started, cache


def _timed_decode(runtime: ModelRuntime, cache: Any, position: int) -> float:
    """One decode step (one new token over ``cache``), as the first token of an answer costs."""
    ids = torch.tensor([[5]], device=runtime.device)
    positions = torch.tensor([[position]], device=runtime.device)
    _sync(runtime)
    started = time.perf_counter()
    with torch.inference_mode():
        runtime.model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
    _sync(runtime)
    return time.perf_counter() - started


def measure_prefill_speed(runtime: ModelRuntime, lengths: Sequence[int] = DEFAULT_LENGTHS,
                          threads: int | None = None, repeats: int = 1, seed: int = 0) -> PrefillSpeed:
    """Time this node's prefill at ``lengths`` (after one warm-up) and fit the planner's curve.

    ``threads`` sets torch's intra-op threads for the measurement only (None: keep the process's
    setting; set it explicitly when processes share cores). Each length keeps the fastest of ``repeats``
    runs (a stray stall otherwise lands in the fit). Lengths must be distinct, positive and fit the
    model's context; at least two are needed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    wanted = sorted({int(n) for n in lengths})
    if len(wanted) < 2 or wanted[0] <= 0:
        raise ValueError(f"need at least 2 distinct positive context lengths, got {list(lengths)!r}")
    check_length(runtime, wanted[-1], 1)
    with torch_threads(threads) as used:
        _timed_prefill(runtime, _token_ids(runtime, min(WARM_UP_TOKENS, wanted[0]), seed))
        points: list[tuple[int, float]] = []
        cache: Any = None
        for n in wanted:
            ids = _token_ids(runtime, n, seed + n)
            runs = [_timed_prefill(runtime, ids) for _ in range(repeats)]
            points.append((n, min(seconds for seconds, _ in runs)))
            cache = runs[-1][1]
        decode_s = min(_timed_decode(runtime, cache, wanted[-1] + i) for i in range(repeats))
    return PrefillSpeed(fit_prefill_curve(points), tuple(points), decode_s, used, str(runtime.device),
                        runtime.model_id)
