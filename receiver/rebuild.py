"""What the receiver does at a session's deadline (or as soon as everything planned is decoded), off the
event loop: file the decoded symbols by fragment id (or stream index), score them, rebuild the partial KV
cache (mask or zero-fill; a quantised stream dequantised at the best level each block reached), generate;
and the RESULT that reports it to the sender.

``reconstruct`` runs in the daemon's single worker thread; torch is imported only there (a receiver
without a model, for transport benchmarks, never loads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pfec.common.plan.handoff import (
    ModelIdentity,
    OfferApp,
    ResultApp,
    file_by_fragment,
    pack_bits,
    recovered_utility,
)
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE, decode_fragment_ids
from pfec.common.plan.precision import FidelityTable, Level, PiecePlan
from pfec.common.plan.stream import NATIVE, file_by_stream_index, score_stream
from pfec.common.plan.utility import UtilityProfile
from pfec.receiver.session import DeadlineReached, ReceiverStats

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime


@dataclass
class Rebuilt:
    """The model's part: the answer and its timings, or the error that stopped it."""

    answer: str | None
    generation_ttft_s: float | None
    rebuild_s: float | None
    error: str | None = None


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
    ready: bool = False  # everything planned was decoded before the deadline
    reached_at: float = 0.0  # when the session stopped decoding (its deadline, or when ready)

    @property
    def start(self) -> str:
        return "ready" if self.ready else "deadline"

    @classmethod
    def of(cls, event: DeadlineReached, late_s: float) -> AtDeadline:
        reached = event.at if event.ready else event.stats.deadline_at
        return cls(late_s, len(event.decoded_esis), len(event.have), event.stats, event.ready, reached)


def reconstruct(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                profile: UtilityProfile | None, decoded_esis: npt.NDArray[np.int64],
                store: npt.NDArray[np.uint8], stream: StreamPlan | None = None) -> Reconstructed:
    """Worker thread: file the decoded symbols by fragment id, score them, rebuild the cache, generate."""
    if app.precision is not None:
        if stream is None or profile is None:
            raise ValueError("the OFFER's precision plan was never checked here (its profile did not load)")
        return _reconstruct_stream(runtime, identity, app, profile, decoded_esis, store, stream)
    plan = identity.plan(app.n_tokens)
    received = file_by_fragment(plan, decoded_esis, store)
    utility = None
    complete = received.complete_blocks
    levels = {Level.NATIVE.label: int(complete.sum()), Level.NONE.label: int((~complete).sum())}
    if profile is not None:
        utility = recovered_utility(profile.block_utilities(plan), complete)
    if not app.generate or runtime is None:
        return Reconstructed(complete, utility, Rebuilt(None, None, None), NATIVE, utility, levels)
    from pfec.common.model import llm  # deferred: torch

    kv = llm.rebuild_from_symbols(runtime, plan, received.store, received.have, app.mode)
    gen = llm.generate(runtime, kv, app.question_ids, app.max_new_tokens)
    return Reconstructed(complete, utility, Rebuilt(gen.text, gen.ttft_s, kv.rebuild_s), NATIVE, utility,
                         levels)


def _reconstruct_stream(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                        profile: UtilityProfile, decoded_esis: npt.NDArray[np.int64],
                        store: npt.NDArray[np.uint8], stream: StreamPlan) -> Reconstructed:
    """File by stream index -> complete pieces -> each block's level -> dequantise -> rebuild -> generate."""
    plan = stream.plan
    rows = store[decoded_esis] if len(decoded_esis) else store[:0]
    ids = decode_fragment_ids(rows) if len(rows) else np.zeros(0, dtype=np.int64)
    filed, have = file_by_stream_index(plan, ids, np.ascontiguousarray(rows[:, FRAGMENT_ID_SIZE:]))
    utilities = profile.block_utilities(identity.plan(app.n_tokens))
    score = score_stream(plan, have, utilities, stream.fidelity)
    done = Reconstructed(score.usable, score.block_utility, Rebuilt(None, None, None), stream.mix,
                         score.precision_utility, score.level_counts())
    if not app.generate or runtime is None:
        return done
    from pfec.common.model import llm  # deferred: torch

    kv = llm.rebuild_from_stream(runtime, plan, filed, score.levels, score.bases, app.mode)
    gen = llm.generate(runtime, kv, app.question_ids, app.max_new_tokens)
    done.rebuilt = Rebuilt(gen.text, gen.ttft_s, kv.rebuild_s)
    return done


def result_of(done: Reconstructed, at: AtDeadline, ttft_s: float | None, mode: str) -> ResultApp:
    """The RESULT for a finished (or failed) reconstruction."""
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
    )


def error_result(at: AtDeadline, mode: str, error: str) -> ResultApp:
    """A RESULT that reports ``error`` and nothing rebuilt (the session still ends: RESULT, then CLOSE)."""
    return ResultApp(None, 0, 0, at.decoded, at.n_source, pack_bits(np.zeros(0, bool)), None, None,
                     at.late_s * 1000, None, mode, error=error, start=at.start)
