"""Slot simulator: the real sender/receiver sessions and codec over a paced, lossy link in simulated time.

Nothing sleeps. A forward link of ``rate_mbps`` serialises one datagram at a time (a datagram of L bytes
holds the link for 8L/C seconds) and delivers it ``fwd_owd_s`` later unless the loss model erases it;
ACKs and RESULTs come back over a reverse link with its own delay; the reverse path is lossless unless
``reverse_loss`` is set (``pfec sim`` leaves it lossless; ``pfec eval`` sets the cell's loss model on both
directions, the paper-like choice, see ``lab/eval_config.py``).

Paired realizations: the forward loss sequence is drawn once per (seed, realization) and indexed by the
data datagram's position in the stream (k-th SOURCE/REPAIR sent), so every scheme meets the same erasure
pattern; control datagrams (OFFER, CLOSE) and ACKs draw from their own streams of the same seed.

Deadline: D = T_ow + rho * T_ser, T_ser = S_KV / C, where S_KV is the KV cache size in bytes (paper V-A).
The sessions are assembled by ``sender/transfer.py``, the same code the sender daemon uses, so the
budget, slot, repair budget and OFFER parameters cannot drift apart between the simulator and a node.
Recovered utility = sum of U_b over blocks whose every fragment was decoded by the receiver's deadline,
divided by sum U_b (the utilities sum to 1). With a quantised ``precision`` (``common/plan/stream.py``) the
handoff sends the piece plan's symbols instead, and a block counts at the level its arrived pieces reach:
recovered utility = sum U_b x fidelity(level_b) (``recovered_block_utility`` is the plain share of blocks
usable at any level). The deadline stays that of the native cache: precision buys time inside it.
The event loop in simulated time is ``lab/sim_engine.py``.

Reference schemes run outside the sessions on the same forward realization (``REFERENCE_SCHEMES``): the
ARQ models of ``lab/arq_sim.py`` (``ARQ_SCHEMES``) -- ``arq``, the paper's baseline (natural order, ACKs
over the reverse path meeting the reverse loss realization drawn here, reordering threshold or RTO),
``priority-arq`` (the same in utility order, ours) and ``arq-ideal`` (utility order, lossless instant
feedback: idealised feedback, not an upper bound of the realistic ARQ's outcome) -- and ``oracle`` (the
clairvoyant bound, lab/oracle.py). The oracle is computed for every realization even when not asked for:
every scheme's ``efficiency`` is its recovered utility / the oracle's on the same realization.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.events import CpuMeter
from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_REPAIR_BUDGET, DEFAULT_RHO, DEFAULT_RTT_MS
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, BlockPlan, KVGeometry, fitted_symbol_size
from pfec.common.plan.precision import FidelityTable, PieceLayout, PiecePlan
from pfec.common.plan.stream import (
    NATIVE,
    check_mix,
    fidelity_name_for,
    fidelity_named,
    score_stream,
    stream_plan,
)
from pfec.common.plan.utility import (
    UtilityProfile,
    fifo_order,
    synthetic_profile,
    utility_order,
)
from pfec.common.sched.policies import SCHEMES, Scheme, get_scheme
from pfec.common.wire.messages import (
    DEFAULT_SYMBOL_SIZE,
    HEADER_SIZE,
    NONCE_SIZE,
    OFFER_FIXED_SIZE,
    SOURCE_ID_SIZE,
    TAG_SIZE,
)
from pfec.lab.arq_sim import ARQ_SCHEMES, simulate_arq_scheme
from pfec.lab.channel import LossModel, realization_rng
from pfec.lab.oracle import DataTiming, oracle_delivered
from pfec.lab.sim_engine import DeadlineScore, SimLink, SimLinks, SimRun
from pfec.lab.stats import mean_ci95_fields
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverStats
from pfec.sender.repair_plan import warm_up
from pfec.sender.transfer import LinkBudget, SenderSetup, SendQueue, assemble_sender

SIM_PSK = bytes(range(32))
SIM_FINGERPRINT = b"pfec-sim".ljust(32, b"\0")
REFERENCE_SCHEMES = {  # run outside the sessions, see the module docstring
    **{name: scheme.definition for name, scheme in ARQ_SCHEMES.items()},
    "oracle": "clairvoyant bound: knows the losses, sends sources in utility order only in arriving slots",
}


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
    repair_budget: float = DEFAULT_REPAIR_BUDGET  # B_rep as a fraction of the source symbols
    window_cap: int = 64
    target_nonzeros: int = 8
    ack_every: int = 16  # as the receiver daemon's default (ReceiverConfig)
    authenticate: bool = False  # AEAD on every datagram (slower; the daemons always authenticate)
    reverse_loss: LossModel | None = None
    profile: UtilityProfile | None = None  # None: synthetic_profile()
    seed: int = 1
    precision: str = NATIVE  # a mix of stream.MIXES (auto is resolved by the caller)

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
        if not 0 <= self.repair_budget <= 10:
            raise ValueError(f"repair_budget is a fraction of the source symbols, got {self.repair_budget!r}")
        check_mix(self.precision)

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

    @property
    def t_ser_s(self) -> float:
        return self.budget.t_ser_s

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
            self.streams[order] = stream_plan(layout, self.config.precision, self.block_utility,
                                              self.fidelity, self.plan.fragment_payload, order)
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
            blocks = (
                utility_order(self.block_utility) if order == "utility" else fifo_order(self.plan.n_blocks)
            )
            self.queues[order] = self.plan.fragment_queue(blocks)
            self.ordered_payload[order] = np.ascontiguousarray(self.payload[self.queues[order]])
        return self.queues[order]

    def send_queue(self, order: str) -> SendQueue:
        """The fragments in ``order`` (``utility`` or ``fifo``) with their symbols, as a sender sends them."""
        queue = self.queue(order)
        stream = self.stream(order)
        blocks = None
        if stream is not None:
            first_piece, _ = stream.symbol_piece_spans()
            blocks = stream.blocks[first_piece].astype(np.int64)
        return SendQueue(self.plan, queue, self.ordered_payload[order], self.block_utility, blocks)

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
    return Handoff(config, plan, utilities, payload, budget, fidelity=fidelity)


@dataclass
class RunResult:
    scheme: str
    realization: int
    recovered_utility: float
    recovered_symbol_fraction: float  # decoded source symbols / all source symbols
    blocks_recovered: int
    source_sent: int
    repair_sent: int
    control_sent: int
    forward_lost: int
    decoded_symbols: int
    redundant_repairs: int
    stalls: int
    stall_time_s: float
    late_datagrams: int
    acks: int
    decisions: int
    cpu_ns: dict[str, int]
    wall_s: float
    failure: str | None = None
    # Per block id: every fragment decoded (ARQ schemes: delivered in order) by the deadline.
    recovered_blocks: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    block_utility: float | None = None  # quantised precision: plain share of blocks usable at any level


def _links(handoff: Handoff, realization: int) -> SimLinks:
    """The three directions of one realization; each draws its losses from its own stream of the seed."""
    cfg = handoff.config
    slot = handoff.slot_s
    ctl_lost = cfg.loss.realize(64, slot, realization_rng(cfg.seed, realization, "control"))
    return SimLinks(
        SimLink(cfg.rate_bps, cfg.owd_s, forward_losses(handoff, realization)),
        SimLink(cfg.rate_bps, cfg.owd_s, ctl_lost),
        SimLink(cfg.rate_bps, cfg.owd_s, reverse_losses(handoff, realization)),
    )


def reverse_losses(handoff: Handoff, realization: int) -> npt.NDArray[np.bool_] | None:
    """The reverse (ACK) path's erasure pattern of one realization (None: lossless), indexed by the k-th
    datagram on the reverse path; the sessions' ACKs and the ARQ models' ACKs meet the same one."""
    cfg = handoff.config
    if cfg.reverse_loss is None:
        return None
    max_data = int(handoff.deadline_s / handoff.slot_s) + 64
    rng = realization_rng(cfg.seed, realization, "reverse")
    return cfg.reverse_loss.realize(max_data, handoff.slot_s, rng)


def seeded_random_bytes(seed: int, realization: int, side: str) -> Callable[[int], bytes]:
    """Reproducible handshake randomness (R_s, R_r, nonces) for one side of one simulated handoff: the
    simulator's results must not depend on os.urandom. Never for real keys: the daemons use os.urandom."""
    return random.Random(f"pfec-sim/{seed}/{realization}/{side}").randbytes


def run_once(handoff: Handoff, scheme: Scheme, realization: int, verify: bool = True) -> RunResult:
    cfg = handoff.config
    send = handoff.send_queue(scheme.order)
    cpu = CpuMeter(time.perf_counter_ns)
    session_id = (cfg.seed << 32 | realization) & 0xFFFFFFFFFFFFFFFF
    setup = SenderSetup(
        scheme=scheme,
        repair_budget=cfg.repair_budget,
        window_cap=cfg.window_cap,
        fingerprint=SIM_FINGERPRINT,
        psk=SIM_PSK,
        result_wait_s=0.5 + 4 * cfg.owd_s,
        target_nonzeros=cfg.target_nonzeros,
        authenticate=cfg.authenticate,
        random_bytes=seeded_random_bytes(cfg.seed, realization, "sender"),
    )
    sender = assemble_sender(session_id, send, handoff.budget, setup, cpu)
    endpoint = ReceiverEndpoint(
        SIM_PSK,
        SIM_FINGERPRINT,
        ReceiverConfig(ack_every=cfg.ack_every),
        authenticate=cfg.authenticate,
        cpu=cpu,
        random_bytes=seeded_random_bytes(cfg.seed, realization, "receiver"),
    )
    run = SimRun(sender, endpoint, _links(handoff, realization),
                 lambda event: _score(handoff, send, scheme.order, event, verify))
    wall0 = time.perf_counter()
    run.drive()
    wall = time.perf_counter() - wall0
    return _run_result(handoff, run, send, scheme, realization, cpu, wall)


def _final_score(handoff: Handoff, run: SimRun) -> tuple[DeadlineScore, str | None]:
    """(the deadline's score, the failure to report); a handoff whose OFFER never arrived scores 0."""
    if run.score is not None:
        return run.score, run.failure
    if run.failure is not None and run.sender.session_id not in run.endpoint.sessions:
        # Every copy of the OFFER was lost (a long bad spell on the control packets' channel): the receiver
        # never knew the handoff, nothing was decoded; the sender reported it. A failed handoff, utility 0.
        none_decoded = np.zeros(handoff.plan.n_blocks, dtype=np.bool_)
        return DeadlineScore(none_decoded, 0.0, 0, 0, 0, ReceiverStats()), (
            f"the receiver never got the OFFER: {run.failure}"
        )
    raise RuntimeError(f"simulation ended without the receiver's deadline (failure: {run.failure})")


def _run_result(handoff: Handoff, run: SimRun, send: SendQueue, scheme: Scheme, realization: int,
                cpu: CpuMeter, wall_s: float) -> RunResult:
    score, failure = _final_score(handoff, run)
    stats = score.stats
    sent = run.sender.datagrams_sent
    return RunResult(
        scheme=scheme.name,
        realization=realization,
        recovered_utility=score.utility,
        recovered_symbol_fraction=score.decoded / len(send.queue),
        blocks_recovered=score.blocks,
        source_sent=sent["source"],
        repair_sent=sent["repair"],
        control_sent=sent["control"],
        forward_lost=run.links.data.dropped,
        decoded_symbols=score.decoded,
        redundant_repairs=score.redundant,
        stalls=stats.stalls,
        stall_time_s=stats.stall_time_s,
        late_datagrams=stats.late,
        acks=stats.acks_sent,
        decisions=cpu.decisions,
        cpu_ns={
            "encode": cpu.encode_ns,
            "decode": cpu.decode_ns,
            "feedback": cpu.feedback_ns,
            "policy": cpu.policy_ns,
        },
        wall_s=wall_s,
        failure=failure,
        recovered_blocks=score.complete,
        block_utility=(None if handoff.fidelity is None
                       else float(handoff.block_utility[score.complete].sum())),
    )


def forward_losses(handoff: Handoff, realization: int) -> npt.NDArray[np.bool_]:
    """The forward erasure pattern of one realization, indexed by data datagram position (every scheme's)."""
    cfg = handoff.config
    max_data = int(handoff.deadline_s / handoff.slot_s) + 64
    return cfg.loss.realize(max_data, handoff.slot_s, realization_rng(cfg.seed, realization, "forward"))


def data_timing(handoff: Handoff) -> DataTiming:
    """SOURCE datagram timing after the first OFFER (no app blob in the simulator), as the sessions send."""
    cfg = handoff.config
    offer_bytes = HEADER_SIZE + NONCE_SIZE + OFFER_FIXED_SIZE + TAG_SIZE
    source_bytes = HEADER_SIZE + SOURCE_ID_SIZE + handoff.plan.symbol_size + TAG_SIZE
    return DataTiming(
        first_send_s=offer_bytes * 8 / cfg.rate_bps,
        datagram_s=source_bytes * 8 / cfg.rate_bps,
        owd_s=cfg.owd_s,
        deadline_s=handoff.deadline_s,
    )


def complete_blocks(handoff: Handoff, fragments: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Per block id: whether every one of its fragments is among ``fragments`` (fragment ids)."""
    plan = handoff.plan
    got = np.zeros(plan.n_fragments, dtype=np.int8)
    got[fragments] = 1
    return np.minimum.reduceat(got, plan.first_fragment[:-1]).astype(bool)


def _reference_result(
    handoff: Handoff, name: str, realization: int, sent: npt.NDArray[np.int64], delivered: int,
    order: str = "utility", **kw: int,
) -> RunResult:
    """A reference scheme's result; ``sent`` are the positions of ``order``'s queue delivered in time."""
    n_source = len(handoff.queue(order))
    complete, utility, plain = handoff.credit(order, sent)
    return RunResult(
        scheme=name,
        realization=realization,
        recovered_utility=utility,
        recovered_symbol_fraction=delivered / n_source if n_source else 0.0,
        blocks_recovered=int(complete.sum()),
        source_sent=kw.get("source_sent", delivered),
        repair_sent=kw.get("repair_sent", 0),
        control_sent=1,
        forward_lost=kw.get("forward_lost", 0),
        decoded_symbols=delivered,
        redundant_repairs=0,
        stalls=0,
        stall_time_s=0.0,
        late_datagrams=0,
        acks=kw.get("acks", 0),
        decisions=0,
        cpu_ns={"encode": 0, "decode": 0, "feedback": 0, "policy": 0},
        wall_s=kw.get("wall_ns", 0) / 1e9,
        recovered_blocks=complete,
        block_utility=None if handoff.fidelity is None else plain,
    )


def run_oracle(handoff: Handoff, realization: int) -> RunResult:
    """The clairvoyant bound on this realization: erased slots stay idle, no repairs, utility order."""
    t0 = time.perf_counter_ns()
    queue = handoff.queue("utility")
    delivered = oracle_delivered(forward_losses(handoff, realization), data_timing(handoff), len(queue))
    wall_ns = time.perf_counter_ns() - t0
    return _reference_result(handoff, "oracle", realization, np.arange(delivered), delivered, wall_ns=wall_ns)


def run_arq(handoff: Handoff, realization: int, name: str = "arq") -> RunResult:
    """One ARQ scheme of ``ARQ_SCHEMES`` on this realization: its order's queue, the shared forward
    realization and (realistic models) the reverse realization ``reverse_losses`` draws; in-order delivery.

    ``repair_sent`` counts its retransmissions, ``acks`` the ACKs its receiver sent."""
    t0 = time.perf_counter_ns()
    scheme = ARQ_SCHEMES[name]
    queue = handoff.queue(scheme.queue_order)
    cfg = handoff.config
    lost, lost_reverse = forward_losses(handoff, realization), reverse_losses(handoff, realization)
    arq = simulate_arq_scheme(name, lost, lost_reverse, data_timing(handoff), 2 * cfg.owd_s, len(queue))
    in_order = arq.delivered(handoff.deadline_s)
    wall_ns = time.perf_counter_ns() - t0
    return _reference_result(
        handoff, name, realization, np.flatnonzero(in_order), int(in_order.sum()), scheme.queue_order,
        source_sent=arq.new_sent, repair_sent=arq.retransmissions, forward_lost=arq.lost, wall_ns=wall_ns,
        acks=arq.acks_sent,
    )  # fmt: skip


def run_scheme(handoff: Handoff, name: str, realization: int, verify: bool = True) -> RunResult:
    """One realization of a session scheme (SCHEMES) or a reference scheme (REFERENCE_SCHEMES)."""
    if name == "oracle":
        return run_oracle(handoff, realization)
    if name in ARQ_SCHEMES:
        return run_arq(handoff, realization, name)
    return run_once(handoff, get_scheme(name), realization, verify=verify)


def check_scheme_names(names: Sequence[str]) -> None:
    for name in names:
        if name not in SCHEMES and name not in REFERENCE_SCHEMES:
            known = ", ".join([*SCHEMES, *REFERENCE_SCHEMES])
            raise ValueError(f"unknown scheme {name!r}; choose from {known}")


def _score(handoff: Handoff, send: SendQueue, order: str, event: DeadlineReached,
           verify: bool) -> DeadlineScore:
    decoded = event.decoded_esis
    if verify and len(decoded) and not np.array_equal(event.store[decoded], send.symbols[decoded]):
        raise AssertionError("decoder output differs from the source symbols")
    complete, utility, _plain = handoff.credit(order, decoded)
    return DeadlineScore(
        complete=complete,
        utility=utility,
        blocks=int(complete.sum()),
        decoded=len(decoded),
        redundant=event.stats.redundant_repairs,
        stats=event.stats,
    )


def simulate(
    config: SimConfig,
    scheme_names: Sequence[str],
    realizations: int,
    progress: Callable[[int, int], None] | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Run every scheme on the same ``realizations`` paired loss sequences; return the report dict."""
    handoff, runs = simulate_runs(config, scheme_names, realizations, progress, verify)
    return report(handoff, runs)


def simulate_runs(
    config: SimConfig,
    scheme_names: Sequence[str],
    realizations: int,
    progress: Callable[[int, int], None] | None = None,
    verify: bool = True,
) -> tuple[Handoff, dict[str, list[RunResult]]]:
    """Like ``simulate`` but returns every RunResult (e.g. ``recovered_blocks`` per realization)."""
    check_scheme_names(scheme_names)
    if realizations < 1:
        raise ValueError(f"realizations must be >= 1, got {realizations!r}")
    warm_up()  # compile or load every kernel variant now, not inside the first timed run
    handoff = prepare(config)
    names = list(dict.fromkeys(scheme_names))
    runs: dict[str, list[RunResult]] = {name: [] for name in names}
    total = realizations * len(names)
    done = 0
    for r in range(realizations):
        for name in names:
            runs[name].append(run_scheme(handoff, name, r, verify=verify))
            done += 1
            if progress is not None:
                progress(done, total)
    return handoff, runs


def efficiencies(handoff: Handoff, results: Sequence[RunResult]) -> list[float]:
    """Recovered utility / the oracle's on the same realization (1.0 where the oracle recovers nothing)."""
    out = []
    for r in results:
        bound = run_oracle(handoff, r.realization).recovered_utility
        out.append(r.recovered_utility / bound if bound > 0 else 1.0)
    return out


def report(handoff: Handoff, runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    cfg = handoff.config
    plan = handoff.plan
    out: dict[str, Any] = {
        "inputs": {
            "loss": _describe(cfg.loss),
            "rate_mbps": cfg.rate_mbps,
            "rtt_ms": cfg.rtt_ms,
            "rho": round(handoff.rho, 6),
            "deadline_ms": round(handoff.deadline_s * 1000, 3),
            "tokens": cfg.tokens,
            "geometry": asdict(cfg.geometry),
            "symbol_size": plan.symbol_size,
            "n_source": plan.n_fragments,
            "n_blocks": plan.n_blocks,
            "kv_bytes": plan.kv_bytes,
            "t_ser_ms": round(handoff.t_ser_s * 1000, 3),
            "slots": int((handoff.deadline_s - cfg.owd_s) / handoff.slot_s),
            "repair_budget": cfg.repair_budget,
            "window_cap": cfg.window_cap,
            "authenticate": cfg.authenticate,
            "profile": (cfg.profile.model_id if cfg.profile else "synthetic"),
            "seed": cfg.seed,
            "realizations": max((len(v) for v in runs.values()), default=0),
        },
        "schemes": {},
    }
    if handoff.fidelity is not None:
        stream = handoff.stream("utility")
        assert stream is not None
        out["inputs"].update(precision=cfg.precision, stream_symbols=stream.n_symbols,
                             stream_bytes=stream.total_bytes)
    for name, results in runs.items():
        packets = sum(r.source_sent + r.repair_sent for r in results)
        cpu_total = {k: sum(r.cpu_ns[k] for r in results) for k in ("encode", "decode", "feedback", "policy")}
        out["schemes"][name] = {
            **mean_ci95_fields("recovered_utility", [r.recovered_utility for r in results]),
            **mean_ci95_fields("efficiency", efficiencies(handoff, results)),
            **mean_ci95_fields("recovered_symbol_fraction", [r.recovered_symbol_fraction for r in results]),
            "source_sent_mean": float(np.mean([r.source_sent for r in results])),
            "repair_sent_mean": float(np.mean([r.repair_sent for r in results])),
            "forward_lost_mean": float(np.mean([r.forward_lost for r in results])),
            "blocks_recovered_mean": float(np.mean([r.blocks_recovered for r in results])),
            "stalls_mean": float(np.mean([r.stalls for r in results])),
            "stall_time_ms_mean": float(np.mean([r.stall_time_s for r in results])) * 1000,
            "failures": sum(1 for r in results if r.failure),
            "cpu_ms_per_1k_packets": {
                k: (v / 1e6) / (packets / 1000) if packets else 0.0 for k, v in cpu_total.items()
            },
            "wall_s_mean": float(np.mean([r.wall_s for r in results])),
        }
        if handoff.fidelity is not None:
            out["schemes"][name].update(mean_ci95_fields(
                "recovered_block_utility", [r.block_utility or 0.0 for r in results]))
        if name in REFERENCE_SCHEMES:
            out["schemes"][name]["note"] = REFERENCE_SCHEMES[name]
    return out


def _describe(model: LossModel) -> str:
    return repr(model)
