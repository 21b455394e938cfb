"""The simulator's split and local modes: the receiver prefills the context's front itself, in simulated time.

Why: a handoff competes with recomputing. In ``split`` the receiver prefills tokens [0, c(t)) in chunks while
the back of the context streams (``stream_plan(..., first_block)``: the meeting token's block on, then the
front after it, as between the daemons; native fragments in the same order); each
chunk's end goes into the receiver session (``set_computed``), its ACKs carry ``computed_tokens`` and the real
``SenderSession`` stops spending bytes on computed blocks, as between the daemons. ``local``: the receiver
prefills everything, nothing streams.

The front's speed is a ``ReceiverModel``'s prefill curve: by default ``breakeven.DEFAULT_MODEL_PREFILL``, the
default model measured on this 2-core machine (2 torch threads, ``common/model/speed.py``; the numbers are
next to the constant), or a node's measured ``PrefillSpeed`` record (``load_receiver_model``). Chunks are the
receiver daemon's (``FRONT_CHUNK_TOKENS``); a chunk [i, j) takes ``PrefillCurve.chunk_seconds(i, j)``. The
front starts when the session is established (the daemon's OFFER handler) and stops when the session starts.

Start when ready: generation starts when every symbol still needed (its blocks not computed) is decoded
(or all of the context is computed), else at the deadline; TTFT = that start (measured from the
sender's start) + one decode step. Utility: computed blocks count as exact (fidelity 1), streamed blocks at
the level their arrived pieces reach. Sans-IO like the sessions: numpy and the plan modules only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pfec.common.plan.breakeven import DEFAULT_MODEL_DECODE_S, DEFAULT_MODEL_PREFILL, ReceiverModel
from pfec.common.plan.precision import FidelityTable, PiecePlan
from pfec.common.plan.prefill import FRONT_CHUNK_TOKENS, PrefillCurve, front_chunk_end
from pfec.common.plan.stream import score_stream
from pfec.lab.reporting.stats import mean_ci95_fields
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import OfferReceived, ReceiverSession

SIM_MODES: Final = ("handoff", "split", "local")
DEFAULT_RECEIVER: Final = ReceiverModel(DEFAULT_MODEL_PREFILL, DEFAULT_MODEL_DECODE_S)
RECEIVER_SOURCE: Final = ("breakeven.DEFAULT_MODEL_PREFILL: SmolLM2-135M-Instruct measured on this 2-core "
                          "CPU, 2 torch threads (common/model/speed.py)")


def check_mode(mode: str) -> str:
    if mode not in SIM_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(SIM_MODES)} (the caller resolves auto)")
    return mode


def load_receiver_model(path: Path) -> ReceiverModel:
    """A node's measured prefill speed (``PrefillSpeed.to_dict`` JSON: ``curve`` {a, b, c}, ``decode_s``)."""
    try:
        data = json.loads(path.read_text())
        coef = data["curve"]
        curve = PrefillCurve(float(coef["a"]), float(coef["b"]), float(coef["c"]))
        return ReceiverModel(curve, float(data["decode_s"]))
    except OSError as exc:
        raise ValueError(f"prefill speed {str(path)!r}: {exc.strerror}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"prefill speed {str(path)!r} is not a PrefillSpeed record: {exc}") from None


def front_schedule(curve: PrefillCurve, n_tokens: int, meeting_token: int | None = None,
                   chunk_tokens: int = FRONT_CHUNK_TOKENS) -> list[tuple[float, int]]:
    """(seconds after the front starts, tokens computed) at the end of each chunk, to the whole context
    (the daemon's chunks: ``front_chunk_end``; a local prefill's meeting token is the context's end)."""
    meeting = n_tokens if meeting_token is None else meeting_token
    out: list[tuple[float, int]] = []
    elapsed, done = 0.0, 0
    while done < n_tokens:
        end = front_chunk_end(done, meeting, n_tokens, chunk_tokens)
        elapsed += curve.chunk_seconds(done, end)
        out.append((elapsed, end))
        done = end
    return out


def local_start_s(receiver: ReceiverModel, n_tokens: int, owd_s: float) -> float:
    """When a local prefill can start generating: the request's one-way trip, then the chunked prefill."""
    return owd_s + front_schedule(receiver.prefill, n_tokens)[-1][0]


class FrontPrefill:
    """The receiver's front prefill in simulated time (``sim_engine.ReceiverApp``): from the session's
    OFFER, chunk by chunk as the daemon's (``front_chunk_end``, each later chunk ending where the session
    forecasts its stream meets it: ``ReceiverSession.front_chunk_end``), each chunk's end reported to the
    session (``set_computed``), until the session starts."""

    def __init__(self, endpoint: ReceiverEndpoint, receiver: ReceiverModel, n_tokens: int, meeting_token: int,
                 token_ends: npt.NDArray[np.int64]) -> None:
        self.endpoint = endpoint
        self.curve = receiver.prefill
        self.n_tokens = n_tokens
        self.meeting_token = meeting_token
        self.token_ends = token_ends  # per index a symbol carries (stream index, or native fragment id)
        self.session_id: int | None = None
        self.done = 0  # tokens computed
        self.chunk: tuple[int, float] | None = None  # the running chunk: its end, when it ends
        self.pace = 0.0  # the newest chunk's seconds per token (0: none computed yet)

    def on_offer(self, event: OfferReceived, now: float) -> None:
        session = self.endpoint.sessions.get(event.session_id)
        if session is None or self.session_id is not None:
            return
        self.session_id = event.session_id
        session.set_split(self.token_ends, self.n_tokens, 0, now)  # the stream carries the front too
        self._next_chunk(session, now)

    def _next_chunk(self, session: ReceiverSession, now: float) -> None:
        done = self.done
        end = front_chunk_end(done, self.meeting_token, self.n_tokens)
        if self.pace > 0:
            end = session.front_chunk_end(done, end, self.pace, now)
        self.chunk = (end, now + self.curve.chunk_seconds(done, end))

    def get_timer(self) -> float | None:
        if self.session_id is None or self.chunk is None:
            return None
        session = self.endpoint.sessions.get(self.session_id)
        if session is None or not session.decoding:
            return None  # the session started (or closed): the daemon stops its front there
        return self.chunk[1]

    def handle_timer(self, now: float) -> None:
        assert self.session_id is not None
        session = self.endpoint.sessions[self.session_id]
        while self.chunk is not None and self.chunk[1] <= now:
            end, _ = self.chunk
            self.pace = self.curve.chunk_seconds(self.done, end) / (end - self.done)
            self.done, self.chunk = end, None
            session.set_computed(end, now)
            if end < self.n_tokens and session.decoding:
                self._next_chunk(session, now)


def computed_blocks(n_blocks: int, n_token_blocks: int, block_tokens: int, n_tokens: int,
                    computed: int) -> npt.NDArray[np.bool_]:
    """Blocks (layer x token block) entirely inside the computed prefix [0, ``computed``)."""
    ends = np.minimum((np.arange(n_blocks) % n_token_blocks + 1) * block_tokens, n_tokens)
    return np.asarray(ends <= computed)


@dataclass(frozen=True)
class SplitCredit:
    usable: npt.NDArray[np.bool_]  # computed, or received at some level
    utility: float  # sum U_b x fidelity (computed blocks: 1)
    block_utility: float  # sum U_b over usable blocks
    computed: npt.NDArray[np.bool_]


def split_credit(stream: PiecePlan, have: npt.NDArray[np.bool_], block_utility: npt.NDArray[np.float64],
                 fidelity: FidelityTable, computed_tokens: int) -> SplitCredit:
    """Credit of a split at its start: the computed front exact, the streamed back at its arrived levels."""
    layout = stream.layout
    score = score_stream(stream, have, block_utility, fidelity)
    computed = computed_blocks(len(score.levels), layout.n_token_blocks, layout.block_tokens, layout.n_tokens,
                               computed_tokens)
    fid = fidelity.block_fidelity(layout)[np.arange(len(score.levels)), score.levels]
    usable = score.usable | computed
    return SplitCredit(usable, float((block_utility * np.where(computed, 1.0, fid)).sum()),
                       float(block_utility[usable].sum()), computed)


def split_inputs(config: Any, meeting_token: int) -> dict[str, Any]:
    """The report's inputs of a split / local simulation (``config``: a ``sim.SimConfig``)."""
    curve = config.receiver.prefill
    return {"mode": config.mode, "meeting_token": meeting_token,
            "receiver": {"prefill": curve.to_dict(), "decode_s": config.receiver.decode_s,
                         "chunk_tokens": FRONT_CHUNK_TOKENS,
                         "source": RECEIVER_SOURCE if config.receiver == DEFAULT_RECEIVER else "given"},
            "local_ttft_ms": round(1000 * (local_start_s(config.receiver, config.tokens, config.owd_s)
                                           + config.receiver.decode_s), 3)}


def split_fields(results: Sequence[Any], decode_s: float) -> dict[str, Any]:
    """Per scheme (``results``: ``sim.RunResult``): TTFT (start + one decode step) and tokens computed."""
    ttft = [(r.start_s + decode_s) * 1000 for r in results if r.start_s is not None]
    return {
        **(mean_ci95_fields("ttft_ms", ttft) if ttft else {}),
        "computed_tokens_mean": float(np.mean([r.computed_tokens for r in results])),
        "sources_dropped_mean": float(np.mean([r.sources_dropped for r in results])),
    }
