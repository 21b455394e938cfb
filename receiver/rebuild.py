"""What the receiver does at a session's deadline, off the event loop: file the decoded symbols by
fragment id, score them, rebuild the partial KV cache (mask or zero-fill), generate; and the RESULT that
reports it to the sender.

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


@dataclass
class Reconstructed:
    """What the worker thread returns."""

    complete: npt.NDArray[np.bool_] | None  # blocks whose every fragment was decoded (None after a failure)
    utility: float | None
    rebuilt: Rebuilt

    @classmethod
    def failed(cls, exc: Exception) -> Reconstructed:
        return cls(None, None, Rebuilt(None, None, None, f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class AtDeadline:
    """What the session had when its deadline fired (the RESULT reports it)."""

    late_s: float  # the deadline handling started this late (receiver clock)
    decoded: int  # source symbols decoded
    n_source: int
    stats: ReceiverStats

    @classmethod
    def of(cls, event: DeadlineReached, late_s: float) -> AtDeadline:
        return cls(late_s, len(event.decoded_esis), len(event.have), event.stats)


def reconstruct(runtime: ModelRuntime | None, identity: ModelIdentity, app: OfferApp,
                profile: UtilityProfile | None, decoded_esis: npt.NDArray[np.int64],
                store: npt.NDArray[np.uint8]) -> Reconstructed:
    """Worker thread: file the decoded symbols by fragment id, score them, rebuild the cache, generate."""
    plan = identity.plan(app.n_tokens)
    received = file_by_fragment(plan, decoded_esis, store)
    utility = None
    if profile is not None:
        utility = recovered_utility(profile.block_utilities(plan), received.complete_blocks)
    if not app.generate or runtime is None:
        return Reconstructed(received.complete_blocks, utility, Rebuilt(None, None, None))
    from pfec.common.model import llm  # deferred: torch

    kv = llm.rebuild_from_symbols(runtime, plan, received.store, received.have, app.mode)
    gen = llm.generate(runtime, kv, app.question_ids, app.max_new_tokens)
    return Reconstructed(received.complete_blocks, utility, Rebuilt(gen.text, gen.ttft_s, kv.rebuild_s))


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
    )


def error_result(at: AtDeadline, mode: str, error: str) -> ResultApp:
    """A RESULT that reports ``error`` and nothing rebuilt (the session still ends: RESULT, then CLOSE)."""
    return ResultApp(None, 0, 0, at.decoded, at.n_source, pack_bits(np.zeros(0, bool)), None, None,
                     at.late_s * 1000, None, mode, error=error)
