"""What one simulated handoff is, whatever the scheme or the realization: its configuration (``SimConfig``),
and the block plan, utilities, budget, payload and send queues ``prepare`` derives from it (``Handoff``),
with the credit of a set of decoded symbols. The runs themselves are ``lab/sim/simulate.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.deadline import (
    AUTO_WINDOW,
    DEFAULT_RATE_MBPS,
    DEFAULT_REPAIR_BUDGET,
    DEFAULT_RHO,
    DEFAULT_RTT_MS,
    check_window_cap,
    resolve_window_cap,
)
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, BlockPlan, KVGeometry, fitted_symbol_size
from pfec.common.plan.mode_choice import choose_mode
from pfec.common.plan.precision import FidelityTable, PieceLayout, PiecePlan
from pfec.common.plan.stream import (
    NATIVE,
    check_mix,
    fidelity_name_for,
    fidelity_named,
    score_stream,
    split_order,
    stream_plan,
    symbol_token_ends,
)
from pfec.common.plan.utility import UtilityProfile, fifo_order, synthetic_profile, utility_order
from pfec.common.sched.open_loop_tail import DEFAULT_LOSS_PRIOR, MAX_LOSS
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE
from pfec.lab.sim.channel import LossModel
from pfec.lab.sim.rate_trace import RateTrace
from pfec.lab.sim.split import DEFAULT_RECEIVER, check_mode
from pfec.sender.transport.transfer import LinkBudget, SendQueue

__all__ = ["Handoff", "SimConfig", "complete_blocks", "prepare"]


@dataclass(frozen=True)
class SimConfig:
    loss: LossModel
    rate_mbps: float = DEFAULT_RATE_MBPS
    rtt_ms: float = DEFAULT_RTT_MS  # forward and reverse one-way delays are rtt/2 each
    rho: float | None = DEFAULT_RHO  # deadline as (D - T_ow) / T_ser ...
    deadline_ms: float | None = None  # ... or directly in ms (exactly one of the two)
    tokens: int = 1536
    geometry: KVGeometry = DEFAULT_GEOMETRY
    max_symbol_size: int = DEFAULT_SYMBOL_SIZE
    fit_symbols: bool = True  # equal fragments per block (kvlayout.fitted_symbol_size)
    # B_rep as a fraction of the source symbols (the paper's fixed budget by default); None: the whole
    # deadline, as the daemons (common/plan/deadline.py WHOLE_DEADLINE).
    repair_budget: float | None = DEFAULT_REPAIR_BUDGET
    window_cap: int = AUTO_WINDOW  # coding window cap K, as the daemon's fec.window_cap (0: from the path)
    target_nonzeros: int = 8
    ack_every: int = 16  # as the receiver daemon's default (ReceiverConfig)
    authenticate: bool = False  # AEAD on every datagram (slower; the daemons always authenticate)
    reverse_loss: LossModel | None = None
    profile: UtilityProfile | None = None  # None: synthetic_profile()
    seed: int = 1
    precision: str = NATIVE  # a mix of stream.MIXES (auto is resolved by the caller)
    mode: str = "handoff"  # handoff | split | local (lab/sim/split.py; auto is resolved by the caller)
    meeting_token: int | None = None  # split: the receiver computes [0, m) (None: the planner's m)
    receiver: ReceiverModel = DEFAULT_RECEIVER  # the receiver's prefill speed (split, local, TTFT)
    # The sender's loss prior (SenderConfig.loss_prior: what its open-loop tail plans for before the ACKs
    # measure the loss). None: the channel's long-run loss rate, as for a sender that has handed off over
    # this path before (the daemon keeps a per-receiver average of what past handoffs measured).
    loss_prior: float | None = None
    # A trace-driven forward link (Mahimahi, lab/sim/rate_trace.py): the sender paces at ``rate_mbps`` (the
    # rate it is told) into the trace's drop-tail bottleneck of ``queue_bytes`` (None: DEFAULT_QUEUE_MS at
    # the trace's mean rate). None: the link is ``rate_mbps``.
    rate_trace: RateTrace | None = None
    queue_bytes: int | None = None
    # The rate the sender is told (None: ``rate_mbps``) and what it does with it: ``fixed`` paces at it,
    # ``path`` starts a measuring controller from it (lab/sim/path_link.py: told another rate than the
    # link's, or under ``path``, the link is a bottleneck queue at ``rate_mbps``).
    told_rate_mbps: float | None = None
    rate_control: str = "fixed"

    def __post_init__(self) -> None:
        if (self.rho is None) == (self.deadline_ms is None):
            raise ValueError("give exactly one of rho and deadline_ms")
        if self.rho is not None and self.rho <= 0:
            raise ValueError(f"rho must be positive, got {self.rho!r}")
        if self.deadline_ms is not None and self.deadline_ms <= self.rtt_ms / 2:
            raise ValueError(
                f"deadline {self.deadline_ms} ms must exceed the one-way delay {self.rtt_ms / 2} ms"
            )
        if self.rate_mbps <= 0:
            raise ValueError(f"rate_mbps must be positive, got {self.rate_mbps!r}")
        if self.rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {self.rtt_ms!r}")
        if self.repair_budget is not None and not 0 <= self.repair_budget <= 10:
            raise ValueError(f"repair_budget is a fraction of the source symbols, got {self.repair_budget!r}")
        check_mix(self.precision)
        check_mode(self.mode)
        check_window_cap(self.window_cap)
        if self.loss_prior is not None and not 0.0 <= self.loss_prior < 1.0:
            raise ValueError(f"loss_prior must be in [0, 1), got {self.loss_prior!r}")
        if self.meeting_token is not None and not 0 <= self.meeting_token < self.tokens:
            raise ValueError(f"meeting token {self.meeting_token!r} outside the context 0..{self.tokens - 1}")
        if self.rate_control not in ("fixed", "path"):
            raise ValueError(f"rate_control must be fixed or path, got {self.rate_control!r}")
        if self.told_rate_mbps is not None and not self.told_rate_mbps > 0:
            raise ValueError(f"told_rate_mbps must be positive, got {self.told_rate_mbps!r}")
        if self.queue_bytes is not None and not self.bottlenecked:
            raise ValueError("queue_bytes sizes a bottleneck: give rate_trace, told_rate_mbps or "
                             "rate_control='path' too")

    @property
    def bottlenecked(self) -> bool:
        """Whether a queue sits between the sender's pacing and the link (lab/sim/path_link.py)."""
        return (self.rate_trace is not None or self.rate_control == "path"
                or (self.told_rate_mbps is not None and self.told_rate_mbps != self.rate_mbps))

    @property
    def told_rate_bps(self) -> float:
        return (self.rate_mbps if self.told_rate_mbps is None else self.told_rate_mbps) * 1e6

    @property
    def sender_loss_prior(self) -> float:
        """The loss prior the simulated sender gets: ``loss_prior``, or the channel's long-run loss rate
        (every shipped loss model has ``mean_loss``; one without it gets the daemon's default)."""
        if self.loss_prior is not None:
            return self.loss_prior
        mean = getattr(self.loss, "mean_loss", None)
        return min(float(mean), MAX_LOSS) if isinstance(mean, (int, float)) else DEFAULT_LOSS_PRIOR

    @property
    def owd_s(self) -> float:
        return self.rtt_ms / 2000.0

    @property
    def rate_bps(self) -> float:
        return self.rate_mbps * 1e6


@dataclass
class Handoff:
    """Everything about one handoff that does not depend on the scheme or the realization."""

    config: SimConfig
    plan: BlockPlan
    block_utility: npt.NDArray[np.float64]
    payload: npt.NDArray[np.uint8]  # (n_fragments, S): fragment id + pseudo-random KV bytes
    budget: LinkBudget  # T_ser, deadline and slot, as the sender daemon computes them
    queues: dict[str, npt.NDArray[np.int64]] = field(default_factory=dict)
    ordered_payload: dict[str, npt.NDArray[np.uint8]] = field(default_factory=dict)
    fidelity: FidelityTable | None = None  # a quantised precision's table (None: native)
    streams: dict[str, PiecePlan] = field(default_factory=dict)  # a quantised precision's plan per order
    meeting_token: int = 0  # split: the receiver computes [0, m), blocks m // block_tokens.. stream

    @property
    def t_ser_s(self) -> float:
        return self.budget.t_ser_s

    @property
    def window_cap(self) -> int:
        """The coding window cap the sender uses (the configured one, or the path's)."""
        return resolve_window_cap(self.config.window_cap, self.budget.owd_s, self.budget.slot_s)

    @property
    def deadline_s(self) -> float:
        return self.budget.deadline_s

    @property
    def slot_s(self) -> float:
        return self.budget.slot_s

    @property
    def rho(self) -> float:
        return self.budget.rho

    def stream(self, order: str) -> PiecePlan | None:
        """The piece plan sent in ``order`` (None for native precision)."""
        if self.fidelity is None:
            return None
        if order not in self.streams:
            layout = PieceLayout(self.config.geometry, self.config.tokens, self.plan.block_tokens)
            first_block = self.meeting_token // self.plan.block_tokens
            self.streams[order] = stream_plan(layout, self.config.precision, self.block_utility,
                                              self.fidelity, self.plan.fragment_payload, order,
                                              first_block, front_after=self.is_split)
        return self.streams[order]

    def queue(self, order: str) -> npt.NDArray[np.int64]:
        stream = self.stream(order)
        if stream is not None and order not in self.queues:
            self.queues[order] = np.arange(stream.n_symbols, dtype=np.int64)
            rng = np.random.default_rng([self.config.seed, 0xC0DEC, len(order)])
            payload = rng.integers(0, 256, size=(stream.n_symbols, self.plan.symbol_size), dtype=np.uint8)
            payload[:, :4] = self.queues[order].astype(">u4").view(np.uint8).reshape(-1, 4)
            self.ordered_payload[order] = payload
        if order not in self.queues:
            blocks = np.asarray(
                utility_order(self.block_utility) if order == "utility" else fifo_order(self.plan.n_blocks)
            )
            if self.is_split:  # the daemon's native split: the back's blocks, then the front's after them
                first_block = self.meeting_token // self.plan.block_tokens
                blocks = blocks[split_order(blocks % self.plan.n_token_blocks, first_block, True)]
            self.queues[order] = self.plan.fragment_queue(blocks)
            self.ordered_payload[order] = np.ascontiguousarray(self.payload[self.queues[order]])
        return self.queues[order]

    def send_queue(self, order: str) -> SendQueue:
        """The fragments in ``order`` (``utility`` or ``fifo``) with their symbols, as a sender sends them."""
        queue = self.queue(order)
        stream = self.stream(order)
        blocks = ends = None
        if stream is not None:
            first_piece, _ = stream.symbol_piece_spans()
            blocks = stream.blocks[first_piece].astype(np.int64)
        if self.config.mode == "split":
            ends = self.index_token_ends(order)[queue] if stream is None else symbol_token_ends(stream)
        return SendQueue(self.plan, queue, self.ordered_payload[order], self.block_utility, blocks, ends)

    @property
    def is_split(self) -> bool:
        return self.config.mode == "split"

    def index_token_ends(self, order: str) -> npt.NDArray[np.int64]:
        """The token end of the index each symbol carries (a stream index, or a native fragment id)."""
        stream = self.stream(order)
        return self.plan.fragment_token_end if stream is None else symbol_token_ends(stream)

    def credit(self, order: str, sent_positions: npt.NDArray[np.int64],
               ) -> tuple[npt.NDArray[np.bool_], float, float]:
        """(usable blocks, utility credited at precision, plain block utility) when the symbols at
        ``sent_positions`` of ``order``'s queue are decoded."""
        stream = self.stream(order)
        if stream is None or self.fidelity is None:
            complete = complete_blocks(self, self.queue(order)[sent_positions])
            utility = float(self.block_utility[complete].sum())
            return complete, utility, utility
        have = np.zeros(stream.n_symbols, dtype=np.bool_)
        have[self.queue(order)[sent_positions]] = True
        score = score_stream(stream, have, self.block_utility, self.fidelity)
        total = float(self.block_utility.sum())
        return score.usable, score.precision_utility * total, score.block_utility * total


def prepare(config: SimConfig) -> Handoff:
    symbol = (
        fitted_symbol_size(config.geometry, config.max_symbol_size)
        if config.fit_symbols
        else config.max_symbol_size
    )
    plan = BlockPlan(config.geometry, config.tokens, symbol)
    profile = config.profile or synthetic_profile(config.geometry.n_layers)
    utilities = profile.block_utilities(plan)
    rng = np.random.default_rng([config.seed, 0xC0DEC])
    payload = rng.integers(0, 256, size=(plan.n_fragments, symbol), dtype=np.uint8)
    payload[:, :4] = np.arange(plan.n_fragments, dtype=">u4").view(np.uint8).reshape(-1, 4)
    budget = LinkBudget.for_plan(plan, config.rate_bps, config.owd_s, config.rho, config.deadline_ms)
    fidelity = None
    if config.precision != NATIVE:
        n_layers = config.geometry.n_layers
        fidelity = fidelity_named(fidelity_name_for(n_layers, None), n_layers, None)
    meeting = config.tokens if config.mode == "local" else 0
    if config.mode == "split":
        meeting = config.meeting_token if config.meeting_token is not None else choose_mode(
            "split", config.precision, config.tokens, config.geometry, config.rate_bps, 2 * config.owd_s,
            config.receiver, plan.block_tokens).meeting_token or 0
    return Handoff(config, plan, utilities, payload, budget, fidelity=fidelity, meeting_token=meeting)


def complete_blocks(handoff: Handoff, fragments: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Per block id: whether every one of its fragments is among ``fragments`` (fragment ids)."""
    plan = handoff.plan
    got = np.zeros(plan.n_fragments, dtype=np.int8)
    got[fragments] = 1
    return np.minimum.reduceat(got, plan.first_fragment[:-1]).astype(bool)

