"""The one place a sender session is assembled: plan + send order + scheme policy + codec + sealing, with
the time budget from ``common/plan/deadline.py``.

The sender daemon (``SenderDaemon``) and the simulator (``lab/sim/``) both build their sessions here, so
what the simulator measures is what the daemon sends: same deadline and slot arithmetic, same repair
budget rounding, same OFFER parameters. Sans-IO like the session itself: no clock is read here (the caller
passes a ``CpuMeter`` built on its own clock, or none).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pfec.common.events import CpuMeter
from pfec.common.plan.deadline import (
    AUTO_WINDOW,
    budget_seconds,
    repair_cap,
    resolve_window_cap,
    rho_of,
    serialisation_s,
    slot_seconds,
)
from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.sched.open_loop_tail import DEFAULT_LOSS_PRIOR
from pfec.common.sched.policies import Scheme
from pfec.common.wire.messages import Role
from pfec.common.wire.seal import PacketProtector, RandomBytes, keyring_for
from pfec.sender.transport.rate import FixedRate, RateController
from pfec.sender.transport.session import MAX_SPAN, SenderConfig, SenderSession, SourceInfo, SplitInfo
from pfec.sender.transport.session_types import OFFER_RETRY_S


@dataclass(frozen=True)
class LinkBudget:
    """A handoff's time on its link: serialisation time T_ser, the deadline D (from the first datagram)
    and the slot (link time of one full-size data datagram)."""

    rate_bps: float
    owd_s: float
    t_ser_s: float
    deadline_s: float
    slot_s: float

    @classmethod
    def for_plan(cls, plan: BlockPlan, rate_bps: float, owd_s: float, rho: float | None = None,
                 deadline_ms: float | None = None) -> LinkBudget:
        """The budget of ``plan``'s KV at ``rate_bps``: exactly one of ``rho`` and ``deadline_ms``."""
        t_ser = serialisation_s(plan.kv_bytes, rate_bps)
        deadline = budget_seconds(t_ser, owd_s, rho, deadline_ms)
        return cls(rate_bps, owd_s, t_ser, deadline, slot_seconds(plan.symbol_size, rate_bps))

    @property
    def rho(self) -> float:
        """The rho this deadline stands for, (D - T_ow) / T_ser."""
        return rho_of(self.deadline_s, self.owd_s, self.t_ser_s)


@dataclass(frozen=True)
class SendQueue:
    """What one handoff sends: every fragment of ``plan`` in send order, with the blocks' utilities.

    A progressive-precision stream (``common/plan/stream.py``) sends its own symbols instead of the plan's
    fragments: ``queue`` is then its stream indices and ``block_of_symbol`` the block each symbol serves.
    """

    plan: BlockPlan
    queue: npt.NDArray[np.int64]  # fragment ids (or stream indices) in send order
    symbols: npt.NDArray[np.uint8]  # [n_source, symbol size], row i = the symbol of queue[i]
    block_utility: npt.NDArray[np.float64]  # per block id
    block_of_symbol: npt.NDArray[np.int64] | None = None  # a stream's block per symbol, in send order
    # A split handoff (the receiver computes the front): each symbol's token end, in send order
    # (``stream.symbol_token_ends``); the session stops sending what the receiver has computed.
    token_ends: npt.NDArray[np.int64] | None = None

    @property
    def n_source(self) -> int:
        return len(self.queue)

    def blocks_in_send_order(self) -> npt.NDArray[np.int64]:
        """The block id of every source symbol, in send order."""
        if self.block_of_symbol is not None:
            return self.block_of_symbol
        return self.plan.fragment_block[self.queue]


@dataclass(frozen=True)
class SenderSetup:
    """The sender's knobs for one session (the daemon's configuration, or a simulation's)."""

    scheme: Scheme
    repair_budget: float | None  # B_rep as a fraction of the source symbols; None: the whole deadline
    window_cap: int  # the coding window cap K; deadline.AUTO_WINDOW (0): sized from the path at OFFER time
    fingerprint: bytes
    psk: bytes
    result_wait_s: float  # how long to wait for the RESULT after the deadline
    target_nonzeros: int | None = 8
    app_blob: bytes = b""  # the OFFER's application part
    authenticate: bool = True  # AEAD on every datagram (the simulator may turn it off for speed)
    random_bytes: RandomBytes = os.urandom  # R_s and handshake nonces (the simulator passes a seeded one)
    loss_prior: float = DEFAULT_LOSS_PRIOR  # the path's loss before ACKs measure it (SenderConfig.loss_prior)


MIN_FIRST_FLIGHT = 64
MAX_FIRST_FLIGHT = 2048  # = ReceiverConfig.early_datagrams: what a receiver holds before the handshake


HANDSHAKE_RETRIES_COVERED = 3  # lost OFFER or ACCEPT rounds the first flight keeps the link busy through


def first_flight(budget: LinkBudget) -> int:
    """Data datagrams sent before the ACCEPT: the handshake's round trip and HANDSHAKE_RETRIES_COVERED
    OFFER repeats, so a lost OFFER or ACCEPT does not leave the link idle (one round trip alone idled
    it 0.05-0.15 s whenever a loss burst met the handshake: 3 of 8 realizations of the main cell, up to
    2 points of utility each), at least MIN_FIRST_FLIGHT, at most what a receiver holds early
    (MAX_FIRST_FLIGHT). A receiver that never answers costs the link this first flight and no more."""
    handshake_s = 2 * budget.owd_s + HANDSHAKE_RETRIES_COVERED * OFFER_RETRY_S
    packets = math.ceil(handshake_s / budget.slot_s) + 16  # + the OFFER's own time and the receiver's
    return min(MAX_FIRST_FLIGHT, max(MIN_FIRST_FLIGHT, packets))


SPAN_SLACK = 32  # symbols per round trip on top of the path: the receiver's ACK interval, a repair burst


def decoder_span_for(budget: LinkBudget, window_cap: int, n_source: int) -> int:
    """The decoder span to ask the receiver for (the OFFER's ``span``): how far past its decoded prefix
    repairs must still reach. A loss is reported about a round trip after it was sent and its repair lands
    half a round trip later, while sources keep arriving; a lost repair costs one more round trip. So two
    bandwidth-delay products in packets (plus the ACK interval and a burst each) and the coding window,
    at most what an RFC 8681 window can address (MAX_SPAN) and no more than the handoff's source symbols.
    The receiver grants at least its own default (512) and at most what its allocation bounds allow; its
    ACCEPT carries the span granted, which the sender's repair planner then uses."""
    bdp = math.ceil(2 * budget.owd_s / budget.slot_s)
    want = 2 * (bdp + SPAN_SLACK) + window_cap
    return max(window_cap, min(MAX_SPAN, n_source, want))


def assemble_sender(session_id: int, send: SendQueue, budget: LinkBudget, setup: SenderSetup,
                    cpu: CpuMeter | None = None, rate: RateController | None = None) -> SenderSession:
    """A ready-to-start ``SenderSession`` for ``send`` within ``budget``.

    ``rate``: the session's rate controller (``rate.py``), e.g. one shared by every handoff on the same path;
    None: a ``FixedRate`` at the budget's slot, the configured link rate."""
    plan = send.plan
    window_cap = resolve_window_cap(setup.window_cap, budget.owd_s, budget.slot_s)
    config = SenderConfig(
        budget_s=budget.deadline_s,
        slot_s=budget.slot_s,
        owd_s=budget.owd_s,
        repair_budget=repair_cap(setup.repair_budget, send.n_source, budget.deadline_s, budget.slot_s),
        fingerprint=setup.fingerprint,
        window_cap=window_cap,
        window_cap_strict=setup.window_cap != AUTO_WINDOW,
        target_nonzeros=setup.target_nonzeros,
        app_blob=setup.app_blob,
        rate_bps=budget.rate_bps,
        result_wait_s=setup.result_wait_s,
        first_flight=first_flight(budget),
        decoder_span=decoder_span_for(budget, window_cap, send.n_source),
        loss_prior=setup.loss_prior,
        fill_idle=setup.repair_budget is None,
    )
    protector = PacketProtector(keyring_for(bytes(setup.psk), setup.authenticate), session_id, Role.SENDER,
                                plan.symbol_size, random_bytes=setup.random_bytes)
    source_info = SourceInfo(send.blocks_in_send_order(), send.block_utility)
    split = None if send.token_ends is None else SplitInfo(send.token_ends, plan.n_tokens)
    if rate is None:
        rate = FixedRate(config.slot_s)
    return SenderSession(session_id, config, send.symbols, setup.scheme.make_policy(), protector, source_info,
                         cpu, split, rate)
