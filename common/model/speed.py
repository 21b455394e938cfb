"""This node's speed for its model: timed at start-up, re-measured on demand, fed to the planner.

Whether a KV handoff beats recomputing depends on how fast the receiver prefills (common/plan/breakeven).
That speed is a property of the node (device, threads, load), not of the model, so each node measures it:
one warm-up, then one prefill at each of a few context lengths, and a least-squares fit of
t(N) = a + bN + cN^2 (c >= 0). A prefix's KV does not depend on what follows, so computing tokens [i, j)
given the cache of [0, i) costs about t(j) - t(i) (``PrefillCurve.chunk_seconds``). One decode step after
the longest prefill gives the per-token decode time. On the default model this takes a few seconds.

Beside the curve (``measure_parts``), every other part the planner predicts of a receiver, timed on the
code the receiver runs: the rebuild of a whole cache per context token at native, int8, int4 and int2
(``rebuild_from_symbols`` / ``rebuild_from_stream``: dequantise and place), and over a cache with a
block of every layer masked (as a partial one is) the question's forward (the decode buffers' copy
included, as ``generate`` runs it) at two question lengths and two cache lengths, and the first decode
step after it. Least-squares fits give ``receiver_speed.MeasuredParts``; the receive path's CPU per
datagram is the receiver daemon's to time (``receiver/node_speed.py``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from pfec.common.model.decode import batch_cache, forward_rows
from pfec.common.model.kvcache import (
    cache_layers,
    cache_rows,
    partial_from_cache,
    prefill,
    rebuild_from_stream,
    rebuild_from_symbols,
    stream_symbols,
)
from pfec.common.model.loading import ModelRuntime, check_length
from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE, BlockPlan, fragment_symbols
from pfec.common.plan.piece_plan import full_plan
from pfec.common.plan.pieces import Level, PieceLayout, ladder
from pfec.common.plan.prefill import PrefillCurve, fit_prefill_curve
from pfec.common.plan.receiver_speed import MeasuredParts, fit_decode, fit_question
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE

DEFAULT_LENGTHS: Final = (128, 512, 1024)
WARM_UP_TOKENS: Final = 64
QUESTION_LENGTHS: Final = (16, 64)  # question tokens timed over each cache
PARTS_REPEATS: Final = 3  # runs of each question forward and decode step timed (the rebuilds: one fewer)
MEASURE_BLOCK_TOKENS: Final = 16  # the handoff's block (``handoff.BLOCK_TOKENS``)


@dataclass(frozen=True, slots=True)
class PrefillSpeed:
    """A node's measured prefill curve, the points behind it and the conditions they were taken in."""

    curve: PrefillCurve
    points: tuple[tuple[int, float], ...]  # (tokens, seconds) as measured
    decode_s: float  # one decode step after the longest prefill (fastest of the repeats)
    threads: int  # torch intra-op threads during the measurement
    device: str
    model_id: str
    parts: MeasuredParts = field(default_factory=MeasuredParts)  # the rest (``measure_parts``)

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
        parts = self.parts
        return ReceiverModel(self.curve, self.decode_s, rebuild_s_per_token=parts.rebuild_s_per_token,
                             question_fit=parts.question_fit, decode_s_per_token=parts.decode_s_per_token,
                             datagram_s=parts.datagram_s)

    def to_dict(self) -> dict[str, Any]:
        parts = self.parts
        return {
            "curve": self.curve.to_dict(), "points": [list(p) for p in self.points],
            "decode_s": self.decode_s, "threads": self.threads, "device": self.device,
            "model_id": self.model_id, "tokens_per_second_1024": self.tokens_per_second(1024),
            "parts": {"rebuild_s_per_token": parts.rebuild_s_per_token, "question_fit": parts.question_fit,
                      "decode_s_per_token": parts.decode_s_per_token, "datagram_s": parts.datagram_s},
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
        return cls(curve, points, decode_s, threads, device, model_id, _parts_of(data.get("parts")))


def _parts_of(data: Any) -> MeasuredParts:
    """``to_dict``'s parts (absent in older records: none measured)."""
    if not isinstance(data, dict):
        return MeasuredParts()
    try:
        rebuild, question = data.get("rebuild_s_per_token"), data.get("question_fit")
        datagram = data.get("datagram_s")
        return MeasuredParts(
            None if rebuild is None else (float(rebuild[0]), float(rebuild[1]), float(rebuild[2]),
                                          float(rebuild[3])),
            None if question is None else (float(question[0]), float(question[1]), float(question[2])),
            float(data.get("decode_s_per_token") or 0.0), None if datagram is None else float(datagram))
    except (IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"not a prefill speed record's parts: {exc}") from None


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
                          threads: int | None = None, repeats: int = 1, seed: int = 0,
                          parts: bool = False) -> PrefillSpeed:
    """Time this node's prefill at ``lengths`` (after one warm-up) and fit the planner's curve.

    ``threads`` sets torch's intra-op threads for the measurement only (None: keep the process's
    setting; set it explicitly when processes share cores). Each length keeps the fastest of ``repeats``
    runs (a stray stall otherwise lands in the fit). Lengths must be distinct, positive and fit the
    model's context; at least two are needed. ``parts``: also time the rest the planner predicts
    (``measure_parts``, over the caches of the shortest and the longest length).
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
        caches: dict[int, Any] = {}
        for n in wanted:
            ids = _token_ids(runtime, n, seed + n)
            runs = [_timed_prefill(runtime, ids) for _ in range(repeats)]
            points.append((n, min(seconds for seconds, _ in runs)))
            cache = runs[-1][1]
            if parts and n in (wanted[0], wanted[-1]):
                caches[n] = cache
        decode_s = min(_timed_decode(runtime, cache, wanted[-1] + i) for i in range(repeats))
        measured = MeasuredParts()
        if parts:
            try:
                measured = measure_parts(runtime, caches, repeats, seed)
            except ValueError:  # a context too short to time the question: stated as not measured
                measured = MeasuredParts()
    return PrefillSpeed(fit_prefill_curve(points), tuple(points), decode_s, used, str(runtime.device),
                        runtime.model_id, measured)


def measure_parts(runtime: ModelRuntime, caches: dict[int, Any], repeats: int = 1,
                  seed: int = 0) -> MeasuredParts:
    """Time the rebuild at each level over the longest of ``caches`` (tokens -> a prefilled cache), and
    the question's masked forward and the first decode step over each (``QUESTION_LENGTHS``, as far as
    the model's context allows), the fastest of ``repeats`` (at least ``PARTS_REPEATS``) each; fitted as
    ``MeasuredParts`` (no ``datagram_s``: the receive path is the daemon's). Needs two cache lengths."""
    if len(caches) < 2:
        raise ValueError(f"measure_parts needs caches of 2 lengths, got {sorted(caches)}")
    longest = max(caches)
    # Fastest of a few runs however many the curve took: single short calls, one stall would set them.
    rebuild = _rebuild_per_token(runtime, caches[longest], longest, max(repeats, PARTS_REPEATS - 1))
    repeats = max(repeats, PARTS_REPEATS)
    question: list[tuple[int, int, float]] = []
    decode: list[tuple[int, float]] = []
    rng = np.random.default_rng(seed)
    for n, cache in sorted(caches.items()):
        kv = _masked(cache, n)
        for q in QUESTION_LENGTHS:
            if n + q + 2 > runtime.max_context:
                continue
            ids = [int(x) for x in rng.integers(3, int(runtime.model.config.vocab_size), size=q)]
            runs = [_timed_question(runtime, kv, ids) for _ in range(repeats)]
            question.append((q, n, min(t for t, _ in runs)))
            decode.append((n, min(t for _, t in runs)))
    if len({n for _, n, _ in question}) < 2 or len({q for q, _, _ in question}) < 2:
        raise ValueError("the model's context holds too few question lengths to time")
    per_cached = fit_decode(decode)
    return MeasuredParts(rebuild, fit_question(question), per_cached[1], None)


def _masked(cache: Any, n_tokens: int) -> Any:
    """The cache as a partial one: its first block of every (layer, KV head) masked."""
    keys = cache_layers(cache)[0][0]
    available = torch.ones((len(cache_layers(cache)), keys.shape[1], n_tokens), dtype=torch.bool)
    available[:, :, :MEASURE_BLOCK_TOKENS] = False
    return partial_from_cache(cache, available.to(keys.device), "mask", n_tokens)


def _timed_question(runtime: ModelRuntime, kv: Any, question_ids: list[int]) -> tuple[float, float]:
    """(the question's forward as ``generate`` runs it, decode buffers included; the decode step after)."""
    n = kv.n_context
    _sync(runtime)
    started = time.perf_counter()
    with torch.inference_mode():
        cache, masks = batch_cache([kv], len(question_ids) + 2)
        logits = forward_rows(runtime, masks, cache, [question_ids], n, last_only=True)
        next_id = int(logits[0, -1].argmax())
        _sync(runtime)
        asked = time.perf_counter()
        forward_rows(runtime, masks, cache, [[next_id]], n + len(question_ids), last_only=True)
        _sync(runtime)
    return asked - started, time.perf_counter() - asked


def _rebuild_per_token(runtime: ModelRuntime, cache: Any, n_tokens: int,
                       repeats: int) -> tuple[float, float, float, float]:
    """Seconds per context token to rebuild ``cache`` whole at native, int8, int4 and int2, as the
    receiver does (native fragments: ``rebuild_from_symbols``; a stream: each block's ladder from its int2
    base, ``rebuild_from_stream``)."""
    geometry = runtime.geometry
    plan = BlockPlan(geometry, n_tokens, DEFAULT_SYMBOL_SIZE, MEASURE_BLOCK_TOKENS)
    ids = np.arange(plan.n_fragments, dtype=np.int64)
    symbols = fragment_symbols(plan, cache_rows(runtime, cache, n_tokens), ids)
    have = np.ones(plan.n_fragments, dtype=np.bool_)
    rebuild_from_symbols(runtime, plan, symbols, have)  # a warm-up: the first call's allocations and kernels
    native = min(_timed(runtime, lambda: rebuild_from_symbols(runtime, plan, symbols, have))
                 for _ in range(repeats))
    layout = PieceLayout(geometry, n_tokens, MEASURE_BLOCK_TOKENS)
    layers = [(k[:, :, :n_tokens], v[:, :, :n_tokens]) for k, v in cache_layers(cache)]
    per_level = []
    for top in (Level.INT8, Level.INT4, Level.INT2):
        pieces = full_plan(layout, ladder(Level.INT2, top), DEFAULT_SYMBOL_SIZE - FRAGMENT_ID_SIZE)
        store = np.ascontiguousarray(stream_symbols(layers, pieces)[:, FRAGMENT_ID_SIZE:])
        levels, bases = pieces.usable(np.ones(pieces.n_symbols, dtype=np.bool_))

        def run(p: Any = pieces, st: Any = store, lv: Any = levels, b: Any = bases) -> None:
            rebuild_from_stream(runtime, p, st, lv, b)

        run()  # a warm-up (the level's unpacking and dequantising kernels)
        per_level.append(min(_timed(runtime, run) for _ in range(repeats)))
    int8, int4, int2 = (t / n_tokens for t in per_level)
    return native / n_tokens, int8, int4, int2


def _timed(runtime: ModelRuntime, run: Any) -> float:
    _sync(runtime)
    started = time.perf_counter()
    run()
    _sync(runtime)
    return time.perf_counter() - started
