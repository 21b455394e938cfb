"""The sender session's inputs and outputs (sans-IO): its config, the states callers see, the events it
emits and the per-ESI application context it may be given (``SourceInfo``; ``SplitInfo`` for a split
handoff).

:mod:`.states` holds the state machine's phases and transitions; :mod:`.session` follows them and
re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import DEFAULT_WINDOW
from pfec.common.events import DatagramDropped, Event
from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.sched.actions import SchedulerView
from pfec.common.sched.open_loop_tail import DEFAULT_LOSS_PRIOR

MAX_SPAN = 4095  # largest RFC 8681 window the decoder could be asked to hold (12-bit NSS)
OFFER_RETRY_S = 0.05  # the OFFER repeats this often until the ACCEPT arrives (sooner: EARLY_OFFER_EVERY)
EARLY_OFFER_EVERY = 128  # data datagrams between OFFERs before the ACCEPT (a receiver holds 256 without one)


@dataclass(frozen=True, slots=True)
class SenderConfig:
    budget_s: float  # D: from start() until the receiver must start decoding
    slot_s: float  # link time of one full-size datagram (pacing unit)
    owd_s: float  # estimated forward one-way delay
    repair_budget: int  # B_rep, repair datagrams at most
    fingerprint: bytes  # 32-byte compatibility hash checked by the receiver
    window_cap: int = DEFAULT_WINDOW
    # A cap the operator configured (fec.window_cap > 0) bounds every repair window; a cap sized from the
    # path (fec.window_cap = 0) lets the open-loop tail's repairs reach over the whole tail, as far as the
    # decoder span granted (SendPath.tail_width, sender/transport/send_path.py).
    window_cap_strict: bool = False
    target_nonzeros: int | None = 8
    fixed_dt: int | None = None
    app_blob: bytes = b""  # application part of the OFFER (split over parts)
    offer_retry_s: float = OFFER_RETRY_S
    result_wait_s: float = 2.0
    rate_bps: float = 0.0  # link rate for the OFFER's own serialisation time (0: ignore)
    first_flight: int = 64  # data datagrams sent before the receiver's ACCEPT (about one BDP)
    handshake_timeout_s: float = 3.0  # no ACCEPT by start + this: fail, CLOSE
    max_result_parts: int = 1024  # RESULT datagrams of one handoff (1024 x 1362 B of application data)
    # The decoder span asked for in the OFFER (symbols past the receiver's prefix that repairs may reach:
    # about two bandwidth-delay products plus the window, ``transfer.decoder_span_for``); 0: the
    # receiver's default. The receiver grants what its bounds allow and says so in the ACCEPT.
    decoder_span: int = 0
    # Loss rate the open-loop tail plans for before the ACKs measure one (common/sched/open_loop_tail.py):
    # the daemon's per-receiver history of past handoffs, or its configured default.
    loss_prior: float = DEFAULT_LOSS_PRIOR
    # The longest the receiver delays an ACK (its ack_delay_s, 2 ms by default, plus scheduling): the
    # probe timeout waits this long beyond the RTT (RFC 9002's max_ack_delay; :mod:`.probe`).
    max_ack_delay_s: float = 0.005
    # The whole deadline is the repair budget (common/plan/deadline.py WHOLE_DEADLINE): a slot that would
    # idle while the receiver lacks symbols carries a repair (``SendPath.take_fill``) instead of waiting a
    # round trip for feedback on the repairs in flight. Off for a fixed budget (the paper's rule).
    fill_idle: bool = False

    def __post_init__(self) -> None:
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s!r}")
        if self.slot_s <= 0:
            raise ValueError(f"slot_s must be positive, got {self.slot_s!r}")
        if self.owd_s < 0:
            raise ValueError(f"owd_s must be >= 0, got {self.owd_s!r}")
        if self.repair_budget < 0:
            raise ValueError(f"repair_budget must be >= 0, got {self.repair_budget!r}")
        if len(self.fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 bytes, got {len(self.fingerprint)}")
        if self.first_flight < 1:
            raise ValueError(f"first_flight must be >= 1, got {self.first_flight!r}")
        if self.handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be positive, got {self.handshake_timeout_s!r}")
        if self.max_result_parts < 1:
            raise ValueError(f"max_result_parts must be >= 1, got {self.max_result_parts!r}")
        if not 0.0 <= self.loss_prior < 1.0:
            raise ValueError(f"loss_prior must be in [0, 1), got {self.loss_prior!r}")
        if not 0.0 <= self.max_ack_delay_s <= 1.0:
            raise ValueError(f"max_ack_delay_s must be in [0, 1] s, got {self.max_ack_delay_s!r}")
        if self.decoder_span != 0 and not self.window_cap <= self.decoder_span <= MAX_SPAN:
            raise ValueError(f"decoder_span must be 0 or window_cap..{MAX_SPAN}, got {self.decoder_span!r}")


class SenderState(Enum):
    """Where a sender session stands, as callers see it; :class:`.states.Phase` refines it."""

    IDLE = "idle"
    STREAMING = "streaming"
    DRAINING = "draining"
    DONE = "done"
    FAILED = "failed"


# Events the sender emits.
@dataclass(frozen=True, slots=True)
class Accepted(Event):
    window_cap: int
    receiver: ReceiverModel | None = None  # its stated prefill speed (None: none stated, or implausible)


@dataclass(frozen=True, slots=True)
class Refused(Event):
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResultReceived(Event):
    decoded_count: int
    app_blob: bytes


@dataclass(frozen=True, slots=True)
class SendingStopped(Event):
    """No transmission slot is left before the deadline."""

    sources_sent: int
    repairs_sent: int


@dataclass(frozen=True, slots=True)
class PathBroken(Event):
    """The rate controller's circuit breaker stopped the stream (the receiver is told it is done)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed(Event):
    reason: str


SenderEvent = Accepted | Refused | ResultReceived | SendingStopped | PathBroken | Failed | DatagramDropped


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """Per-ESI KV context for the policy's application features (optional)."""

    block_of_esi: npt.NDArray[np.int64]  # block id of every source symbol, in send order
    block_utility: npt.NDArray[np.float64]  # utility of every block id

    UPCOMING_BLOCKS = 8

    def normalised(self) -> npt.NDArray[np.float64]:
        top = float(self.block_utility.max()) if len(self.block_utility) else 0.0
        return self.block_utility / top if top > 0 else np.zeros_like(self.block_utility)

    def per_esi_features(self) -> npt.NDArray[np.float64]:
        """(N, 3): block progress, normalised block utility, mean utility of the next blocks, per ESI.

        Computed once per handoff so a decision only indexes a row.
        """
        blocks = np.asarray(self.block_of_esi, dtype=np.int64)
        n = len(blocks)
        out = np.zeros((n, 3), dtype=np.float64)
        if n == 0:
            return out
        norm = self.normalised()
        # Runs of equal block ids are one block's fragments, contiguous in the queue.
        starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])
        lengths = np.diff(np.r_[starts, n])
        run_of_esi = np.repeat(np.arange(len(starts)), lengths)
        out[:, 0] = (np.arange(n) - starts[run_of_esi]) / lengths[run_of_esi]
        run_utility = norm[blocks[starts]]
        out[:, 1] = run_utility[run_of_esi]
        k = self.UPCOMING_BLOCKS
        padded = np.r_[run_utility, np.zeros(k)]
        csum = np.r_[0.0, np.cumsum(padded)]
        nxt = np.arange(len(starts)) + 1
        upcoming = (csum[nxt + k] - csum[nxt]) / k
        out[:, 2] = upcoming[run_of_esi]
        return out


@dataclass(frozen=True, slots=True)
class SplitInfo:
    """A split handoff's stake of each source symbol: nothing in ESI ``i`` is needed once the receiver has
    computed context tokens [0, ``token_end_of_esi[i]``) itself (send order at the start)."""

    token_end_of_esi: npt.NDArray[np.int64]
    n_tokens: int  # the context: an ACK's computed_tokens beyond it is dropped

    def __post_init__(self) -> None:
        ends = self.token_end_of_esi
        if ends.ndim != 1 or (len(ends) and (int(ends.min()) < 1 or int(ends.max()) > self.n_tokens)):
            raise ValueError(f"split token ends must lie in 1..{self.n_tokens}, one per source symbol")


class UtilityFeatures:
    """The per-ESI (progress, utility, upcoming) rows of ``SourceInfo`` as Python lists (a decision reads
    three floats), written into the scheduler's view for the next source."""

    __slots__ = ("rows",)

    def __init__(self, source_info: SourceInfo) -> None:
        self.rows: list[list[float]] = source_info.per_esi_features().T.tolist()

    def write(self, view: SchedulerView, next_esi: int) -> None:
        progress, utility, upcoming = self.rows
        if next_esi >= len(progress):
            view.block_progress, view.block_utility, view.upcoming_utility = 1.0, 0.0, 0.0
            return
        view.block_progress = progress[next_esi]
        view.block_utility = utility[next_esi]
        view.upcoming_utility = upcoming[next_esi]

    def reorder(self, first: int, order: npt.NDArray[np.int64]) -> None:
        """The unsent symbols from ``first`` were reordered (a split): the rows follow."""
        feats = np.asarray(self.rows)
        feats[:, first:first + len(order)] = feats[:, order]
        self.rows = feats.tolist()
