"""What the receiver does at a session's deadline (or as soon as everything planned is decoded), off the
event loop: file the decoded symbols by fragment id (or stream index), score them, rebuild the partial KV
cache (mask or zero-fill; a quantised stream dequantised at the best level each block reached), generate;
and the RESULT that reports it to the sender.

``reconstruct`` runs in the daemon's single worker thread; torch is imported only there (a receiver
without a model, for transport benchmarks, never loads it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pfec.common.plan.handoff import (
    BLOCK_TOKENS,
    MAX_RESULT_SECONDS,
    ModelIdentity,
    OfferApp,
    ResultApp,
    file_by_fragment,
    pack_bits,
    recovered_utility,
)
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE, BlockPlan, decode_fragment_ids
from pfec.common.plan.pieces import HeldBlocks, held_after_hop
from pfec.common.plan.precision import FidelityTable, Level, PiecePlan
from pfec.common.plan.prefill import FRONT_CHUNK_TOKENS, front_chunk_end
from pfec.common.plan.stream import NATIVE, file_by_stream_index, score_stream
from pfec.common.plan.utility import UtilityProfile
from pfec.receiver.session import DeadlineReached, ReceiverStats

if TYPE_CHECKING:
    from pfec.common.model.kvcache import KVCache, LiveRebuild, PartialKV
    from pfec.common.model.llm import ModelRuntime


@dataclass
class Rebuilt:
    """The model's part: the answer and its timings, or the error that stopped it."""

    answer: str | None
    generation_ttft_s: float | None
    rebuild_s: float | None
    error: str | None = None
    first_token_at: float | None = None  # the receiver's monotonic clock when the first token was out
    question_s: float | None = None  # the question's forward to the first token (decode buffers included)
    step_s: float | None = None  # the decode step after it




@dataclass
class Front:
    """A split's (or local prefill's) front, computed here in chunks: its cache, how far it has got, and
    the flag that stops it (the session started, or closed). Owned by the worker thread while it runs."""

    context_ids: tuple[int, ...]
    meeting_token: int
    chunk_tokens: int = FRONT_CHUNK_TOKENS
    cache: KVCache | None = None  # of [0, tokens)
    tokens: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    compute_s: float = 0.0
    # Every chunk computed whole: (first token, end, seconds), the receiver's prefill under its present load.
    timed: list[tuple[int, int, float]] = field(default_factory=list)
    # A split's: (done, planned end, seconds per token so far) -> where the stream meets the next chunk
    # (the session's ``front_chunk_end``); None: the planned chunks (a local prefill: nothing streams).
    meet: Callable[[int, int, float], int] | None = None
    # Run between chunks (worker thread): the stream's blocks that completed meanwhile placed into the cache
    # (``LiveRebuild.drain``; the worker is the front's until it ends)
    between: Callable[[], object] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.context_ids)


def compute_front(runtime: ModelRuntime, front: Front, progress: Callable[[int], None]) -> int:
    """Worker thread: prefill the context from its start, chunk by chunk, reporting each chunk's end, until
    all of it is computed or ``front.stop`` is set (checked between chunks). Returns the tokens computed."""
    from pfec.common.model import llm  # deferred: torch

    ids: Sequence[int] = front.context_ids
    started = time.perf_counter()
    while front.tokens < len(ids) and not front.stop.is_set():
        end = front_chunk_end(front.tokens, front.meeting_token, len(ids), front.chunk_tokens)
        if front.between is not None and front.timed:
            front.between()
        if front.meet is not None and front.timed:
            met = front.meet(front.tokens, end, seconds_per_token(front.timed))
            end = min(end, max(front.tokens + 1, met))
        chunk_started = time.perf_counter()
        try:
            front.cache = llm.prefill_chunk(runtime, front.cache, ids[front.tokens : end], stop=front.stop)
        except llm.ChunkStopped:  # the session started mid-chunk: the cache still holds [0, tokens)
            break
        front.timed.append((front.tokens, end, time.perf_counter() - chunk_started))
        front.tokens = end
        progress(end)
    front.compute_s += time.perf_counter() - started
    return front.tokens


def seconds_per_token(timed: Sequence[tuple[int, int, float]]) -> float:
    """This front's pace: its newest whole chunk's seconds per token (it met the stream's present load)."""
    start, stop, seconds = timed[-1]
    return seconds / (stop - start)


@dataclass(frozen=True)
class StreamPlan:
    """A quantised handoff's piece plan as the receiver recomputed and checked it, with its fidelity."""

    mix: str
    plan: PiecePlan
    fidelity: FidelityTable


@dataclass
class Reconstructed:
    """What the worker thread returns."""

    complete: npt.NDArray[np.bool_] | None  # blocks usable at some level (None after a failure)
    utility: float | None  # share of the utility in usable blocks
    rebuilt: Rebuilt
    precision: str = NATIVE
    precision_utility: float | None = None  # share of utility x fidelity at the level each block arrived
    levels: dict[str, int] | None = None  # blocks per usable level
    computed_tokens: int | None = None  # split / local: the prefix [0, c) computed here
    blocks_computed: int | None = None
    blocks_received: int | None = None
    kv: PartialKV | None = None  # the rebuilt context, kept when the OFFER carries its prefix
    kept: bool = False  # the prefix cache store took it
    held: HeldBlocks | None = None  # what this node holds of the context now (a chain passes it on)
    live: dict[str, Any] | None = None  # a cache built while the stream arrived: what was placed before

    @classmethod
    def failed(cls, exc: Exception) -> Reconstructed:
        return cls(None, None, Rebuilt(None, None, None, f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class AtDeadline:
    """What the session had when it stopped decoding (the RESULT reports it)."""

    late_s: float  # the rebuild started this long after the session stopped decoding (receiver clock)
    decoded: int  # source symbols decoded
    n_source: int
    stats: ReceiverStats
    start: str = "deadline"  # what closed decoding: ready, sender-done (its DONE) or deadline
    reached_at: float = 0.0  # when the session stopped decoding (its deadline, when ready, the DONE)

    @property
    def ready(self) -> bool:
        """Everything planned was decoded before the deadline."""
        return self.start == "ready"

    @classmethod
    def of(cls, event: DeadlineReached, late_s: float) -> AtDeadline:
        return cls(late_s, len(event.decoded_esis), len(event.have), event.stats, event.start,
                   event.started_at)


def reconstruct(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                profile: UtilityProfile | None, decoded_esis: npt.NDArray[np.int64],
                store: npt.NDArray[np.uint8], stream: StreamPlan | None = None,
                front: Front | None = None, live: LiveRebuild | None = None) -> Reconstructed:
    """Worker thread: file the decoded symbols by fragment id, score them, rebuild the cache, generate.

    A split (``front``): the computed prefix [0, c) exactly, the received blocks after it at their best
    level, the rest masked; a local prefill finishes its front first (nothing streamed). ``live``: a
    quantised stream's cache as built while it arrived (only what is left is placed now)."""
    if front is not None and app.split is not None:
        if app.split.meeting_token >= app.n_tokens:
            return _reconstruct_local(runtime, identity, app, profile, front)
        if app.precision is None:
            return _reconstruct_native(runtime, identity, app, profile, decoded_esis, store, front)
        if stream is None or profile is None:
            raise ValueError("the OFFER's precision plan was never checked here (its profile did not load)")
        return _reconstruct_stream(runtime, identity, app, profile, decoded_esis, store, stream, front, live)
    if app.precision is not None:
        if stream is None or profile is None:
            raise ValueError("the OFFER's precision plan was never checked here (its profile did not load)")
        return _reconstruct_stream(runtime, identity, app, profile, decoded_esis, store, stream, live=live)
    return _reconstruct_native(runtime, identity, app, profile, decoded_esis, store)


def _reconstruct_native(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                        profile: UtilityProfile | None, decoded_esis: npt.NDArray[np.int64],
                        store: npt.NDArray[np.uint8], front: Front | None = None) -> Reconstructed:
    """Native fragments filed by id -> complete blocks -> rebuild -> generate (a split: the computed prefix
    joins in front of the received blocks)."""
    plan = identity.plan(app.n_tokens)
    received = file_by_fragment(plan, decoded_esis, store)
    utility = None
    complete = received.complete_blocks
    lost_upstream = _lost_upstream(app, plan)
    if lost_upstream is not None:  # a chain: whatever came for a block lost before the sender is no data
        received.have[np.isin(np.arange(plan.n_fragments), _fragments(plan, lost_upstream))] = False
        complete = complete & ~lost_upstream
    split: dict[str, Any] = {}
    if front is not None:
        computed = _computed_blocks(len(complete), app.n_tokens, front.tokens)
        split = {"computed_tokens": front.tokens, "blocks_computed": int(computed.sum()),
                 "blocks_received": int((complete & ~computed).sum())}
        complete = complete | computed
    levels = {Level.NATIVE.label: int(complete.sum()), Level.NONE.label: int((~complete).sum())}
    if profile is not None:
        utility = recovered_utility(profile.block_utilities(plan), complete)
    done = Reconstructed(complete, utility, Rebuilt(None, None, None), NATIVE, utility, levels, **split,
                         held=_held(app, plan, np.where(complete, Level.NATIVE, Level.NONE)))
    if runtime is None or not (app.generate or app.prefix is not None):
        return done
    from pfec.common.model import llm  # deferred: torch

    started = time.perf_counter()
    kv = llm.rebuild_from_symbols(runtime, plan, received.store, received.have, app.mode)
    if front is None:
        if _keep(done, kv, app):
            return done
        gen = llm.generate(runtime, kv, app.question_ids, app.max_new_tokens)
        done.rebuilt = Rebuilt(gen.text, gen.ttft_s, kv.rebuild_s, question_s=gen.ttft_s - kv.rebuild_s,
                               step_s=gen.step_s)
        return done
    if front.cache is not None:
        kv = llm.join_prefix(kv, front.cache, front.tokens)
    kv.rebuild_s = time.perf_counter() - started
    if not _keep(done, kv, app):
        done.rebuilt = _generate(runtime, kv, app)
    return done


def _computed_blocks(n_blocks: int, n_tokens: int, computed: int) -> npt.NDArray[np.bool_]:
    """Blocks (layer x token block, the piece layout's) entirely inside the computed prefix [0, computed)."""
    n_token_blocks = -(-n_tokens // BLOCK_TOKENS)
    ends = np.minimum((np.arange(n_blocks) % n_token_blocks + 1) * BLOCK_TOKENS, n_tokens)
    return np.asarray(ends <= computed)


def _reconstruct_stream(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                        profile: UtilityProfile, decoded_esis: npt.NDArray[np.int64],
                        store: npt.NDArray[np.uint8], stream: StreamPlan,
                        front: Front | None = None, live: LiveRebuild | None = None) -> Reconstructed:
    """File by stream index -> complete pieces -> each block's level -> dequantise -> rebuild -> generate
    (a split: the computed prefix joins in front of the received blocks)."""
    plan = stream.plan
    rows = store[decoded_esis] if len(decoded_esis) else store[:0]
    ids = decode_fragment_ids(rows) if len(rows) else np.zeros(0, dtype=np.int64)
    filed, have = file_by_stream_index(plan, ids, np.ascontiguousarray(rows[:, FRAGMENT_ID_SIZE:]))
    utilities = profile.block_utilities(identity.plan(app.n_tokens))
    score = score_stream(plan, have, utilities, stream.fidelity)
    usable, block_utility, levels = score.usable, score.block_utility, score.level_counts()
    precision_utility = score.precision_utility
    split: dict[str, Any] = {}
    rebuild_levels = score.levels
    lost_upstream = _lost_upstream(app, identity.plan(app.n_tokens))
    if lost_upstream is not None:  # a chain: a block lost before the sender is masked, whatever came for it
        rebuild_levels = np.where(lost_upstream, Level.NONE, rebuild_levels).astype(np.int8)
        usable = usable & ~lost_upstream
        fid = stream.fidelity.block_fidelity(plan.layout)[np.arange(len(usable)), rebuild_levels]
        total = float(utilities.sum())
        block_utility = float(utilities[usable].sum()) / total if total > 0 else 0.0
        precision_utility = float((utilities * fid * usable).sum()) / total if total > 0 else 0.0
        levels = {lvl.label: int((rebuild_levels == lvl).sum()) for lvl in Level}
    if front is not None:
        computed = _computed_blocks(len(usable), app.n_tokens, front.tokens)
        rebuild_levels = np.where(computed, Level.NONE, score.levels)  # the front's rows replace them
        received = usable & ~computed
        usable = usable | computed
        total = float(utilities.sum())
        block_utility = float(utilities[usable].sum()) / total if total > 0 else 0.0
        fid = stream.fidelity.block_fidelity(plan.layout)[np.arange(len(usable)), score.levels]
        credited = float((utilities * np.where(computed, 1.0, fid)).sum())
        precision_utility = credited / total if total > 0 else 0.0
        levels = {lvl.label: int(((score.levels == lvl) & ~computed).sum()) for lvl in Level}
        levels["computed"] = int(computed.sum())
        split = {"computed_tokens": front.tokens, "blocks_computed": int(computed.sum()),
                 "blocks_received": int(received.sum())}
    done = Reconstructed(usable, block_utility, Rebuilt(None, None, None), stream.mix, precision_utility,
                         levels, **split, held=_held(app, identity.plan(app.n_tokens), np.where(
                             usable & (rebuild_levels == Level.NONE), Level.NATIVE, rebuild_levels)))
    if runtime is None or not (app.generate or app.prefix is not None):
        return done
    from pfec.common.model import llm  # deferred: torch

    started = time.perf_counter()
    copied = 0
    if live is not None and live.failed is None:  # built as the stream arrived: what is left, the masks
        kv = live.finish(filed, rebuild_levels, score.bases, app.mode)
        copied = live.computed
        done.live = {"blocks_placed_before": live.placed_before, "place_s": round(live.place_s, 6),
                     "computed_rows_before": copied}
    else:
        kv = llm.rebuild_from_stream(runtime, plan, filed, rebuild_levels, score.bases, app.mode)
    if front is not None and front.cache is not None:
        kv = llm.join_prefix(kv, front.cache, front.tokens, copied)
    kv.rebuild_s = time.perf_counter() - started
    if not _keep(done, kv, app):
        done.rebuilt = _generate(runtime, kv, app)
    return done


def _keep(done: Reconstructed, kv: PartialKV, app: OfferApp) -> bool:
    """The context (``app.prefix``: a conversation's, or a question/answer handoff's) is kept for the
    node's prefix cache store; True when nothing is to be generated from it here (a conversation handoff
    asks no question). The store takes it after the answer (``_generate`` never writes ``kv``: decoding
    copies it into buffers of its own), so it holds the context's rows only and the TTFT is as before."""
    if app.prefix is not None:
        done.kv = kv
    return not app.generate


def _generate(runtime: ModelRuntime, kv: PartialKV, app: OfferApp) -> Rebuilt:
    from pfec.common.model import llm  # deferred: torch

    began = time.monotonic()
    gen = llm.generate(runtime, kv, app.question_ids, app.max_new_tokens)
    return Rebuilt(gen.text, gen.ttft_s, kv.rebuild_s, first_token_at=began + gen.ttft_s - kv.rebuild_s,
                   question_s=gen.ttft_s - kv.rebuild_s, step_s=gen.step_s)


def _reconstruct_local(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                       profile: UtilityProfile | None, front: Front) -> Reconstructed:
    """A local prefill: finish the front (the deadline may have stopped it early), generate from it."""
    n_blocks = identity.plan(app.n_tokens).n_blocks
    every = np.ones(n_blocks, dtype=np.bool_)
    done = Reconstructed(every, 1.0 if profile is not None else None, Rebuilt(None, None, None), "none", 1.0,
                         {"computed": n_blocks}, computed_tokens=app.n_tokens, blocks_computed=n_blocks,
                         blocks_received=0)
    if runtime is None or not (app.generate or app.prefix is not None):
        return done
    from pfec.common.model import llm  # deferred: torch

    started = time.perf_counter()
    front.stop.clear()
    compute_front(runtime, front, lambda _tokens: None)
    kv = llm.partial_from_cache(front.cache, None, app.mode, app.n_tokens)
    kv.rebuild_s = time.perf_counter() - started
    if not _keep(done, kv, app):
        done.rebuilt = _generate(runtime, kv, app)
    return done


def _seconds(value: float | None) -> float | None:
    """A timing for the RESULT, within what its parser takes."""
    return None if value is None else round(min(MAX_RESULT_SECONDS, max(0.0, value)), 6)


def result_of(done: Reconstructed, at: AtDeadline, ttft_s: float | None, mode: str,
              handoff_mode: str | None = None, front: Front | None = None,
              stream_s: float | None = None) -> ResultApp:
    """The RESULT for a finished (or failed) reconstruction (``stream_s``: the OFFER's arrival to the
    close of decoding)."""
    rebuilt = done.rebuilt
    complete = done.complete if done.complete is not None else np.zeros(0, dtype=bool)
    stats = at.stats
    return ResultApp(
        recovered_utility=done.utility,
        blocks_recovered=int(complete.sum()),
        n_blocks=len(complete),
        decoded_symbols=at.decoded,
        n_source=at.n_source,
        blocks_bitmap=pack_bits(complete),
        ttft_s=ttft_s,
        generation_ttft_s=rebuilt.generation_ttft_s,
        deadline_late_ms=at.late_s * 1000,
        answer=rebuilt.answer,
        mode=mode,
        rebuild_s=rebuilt.rebuild_s,
        error=rebuilt.error,
        stats={
            **({} if done.live is None else {"live_rebuild": done.live}),
            "received": dict(stats.received),
            "lost": stats.lost,
            "late": stats.late,
            "acks_sent": stats.acks_sent,
            "stalls": stats.stalls,
            "redundant_repairs": stats.redundant_repairs,
        },
        start=at.start,
        precision=done.precision,
        precision_utility=done.precision_utility,
        levels=done.levels,
        handoff_mode=handoff_mode,
        computed_tokens=done.computed_tokens,
        blocks_computed=done.blocks_computed,
        blocks_received=done.blocks_received,
        front_s=None if front is None else round(sum(seconds for *_, seconds in front.timed), 6),
        stream_s=_seconds(stream_s),
        question_s=_seconds(rebuilt.question_s),
        decode_step_s=_seconds(rebuilt.step_s),
    )


def error_result(at: AtDeadline, mode: str, error: str) -> ResultApp:
    """A RESULT that reports ``error`` and nothing rebuilt (the session still ends: RESULT, then CLOSE)."""
    return ResultApp(None, 0, 0, at.decoded, at.n_source, pack_bits(np.zeros(0, bool)), None, None,
                     at.late_s * 1000, None, mode, error=error, start=at.start)


# --- a chain: what the OFFER says was lost upstream, what this node holds after its hop ---------------------


def _lost_upstream(app: OfferApp, plan: BlockPlan) -> npt.NDArray[np.bool_] | None:
    """The blocks the OFFER says were lost before its sender (``app.held``), or None (no chain)."""
    return None if app.held is None else app.held.block_levels(plan) == Level.NONE


def _fragments(plan: BlockPlan, blocks: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """The fragment ids of ``blocks``."""
    ids = [f for b in np.flatnonzero(blocks) for f in plan.block_fragments(int(b))]
    return np.asarray(ids, dtype=np.int64)


def _held(app: OfferApp, plan: BlockPlan, levels: npt.NDArray[np.int8]) -> HeldBlocks | None:
    """What this node holds after the hop, for a context it keeps (``app.prefix``): None otherwise.
    ``levels``: each block's level here (a split's computed front: native)."""
    return None if app.prefix is None else held_after_hop(plan, np.asarray(levels, dtype=np.int8), app.held)
