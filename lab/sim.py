"""Slot simulator: the real sender/receiver sessions and codec over a paced, lossy link in simulated time.

Nothing sleeps. A forward link of ``rate_mbps`` serialises one datagram at a time (a datagram of L bytes
holds the link for 8L/C seconds) and delivers it ``fwd_owd_s`` later unless the loss model erases it;
ACKs and RESULTs come back over a reverse link with its own delay (lossless unless ``reverse_loss``).

Paired realizations: the forward loss sequence is drawn once per (seed, realization) and indexed by the
data datagram's position in the stream (k-th SOURCE/REPAIR sent), so every scheme meets the same erasure
pattern; control datagrams (OFFER, CLOSE) and ACKs draw from their own streams of the same seed.

Deadline: D = T_ow + rho * T_ser, T_ser = S_KV / C, where S_KV is the KV cache size in bytes (paper V-A).
Recovered utility = sum of U_b over blocks whose every fragment was decoded by the receiver's deadline,
divided by sum U_b (the utilities sum to 1).

Two reference schemes run outside the sessions on the same forward realization: ``arq`` (idealised
selective-repeat retransmission, an upper bound for TCP/QUIC, common/arq_sim.py) and ``oracle`` (the
clairvoyant bound, common/oracle.py). The oracle is computed for every realization even when not asked
for: every scheme's ``efficiency`` is its recovered utility / the oracle's on the same realization.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.events import CpuMeter
from pfec.common.plan.deadline import (
    DEFAULT_RATE_MBPS,
    DEFAULT_REPAIR_BUDGET,
    DEFAULT_RHO,
    DEFAULT_RTT_MS,
    budget_seconds,
    rho_of,
    serialisation_s,
    slot_seconds,
)
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, BlockPlan, KVGeometry, fitted_symbol_size
from pfec.common.plan.utility import (
    UtilityProfile,
    fifo_order,
    synthetic_profile,
    utility_order,
)
from pfec.common.sched.policies import SCHEMES, Scheme, get_scheme
from pfec.common.wire.frames import (
    DEFAULT_SYMBOL_SIZE,
    HEADER_SIZE,
    OFFER_FIXED_SIZE,
    SOURCE_ID_SIZE,
    TAG_SIZE,
    PacketProtector,
    Role,
)
from pfec.lab.arq_sim import ARQ_NOTE, simulate_arq
from pfec.lab.channel import LossModel, realization_rng
from pfec.lab.oracle import DataTiming, oracle_delivered
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverEndpoint, ReceiverStats
from pfec.sender.repair_plan import warm_up
from pfec.sender.session import (
    Failed,
    ResultReceived,
    SenderConfig,
    SenderSession,
    SourceInfo,
)

SIM_PSK = bytes(range(32))
SIM_FINGERPRINT = b"pfec-sim".ljust(32, b"\0")
REFERENCE_SCHEMES = {  # run outside the sessions, see the module docstring
    "arq": ARQ_NOTE,
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
    t_ser_s: float
    deadline_s: float
    slot_s: float
    queues: dict[str, npt.NDArray[np.int64]] = field(default_factory=dict)
    ordered_payload: dict[str, npt.NDArray[np.uint8]] = field(default_factory=dict)

    @property
    def rho(self) -> float:
        return rho_of(self.deadline_s, self.config.owd_s, self.t_ser_s)

    def queue(self, order: str) -> npt.NDArray[np.int64]:
        if order not in self.queues:
            blocks = (
                utility_order(self.block_utility) if order == "utility" else fifo_order(self.plan.n_blocks)
            )
            self.queues[order] = self.plan.fragment_queue(blocks)
            self.ordered_payload[order] = np.ascontiguousarray(self.payload[self.queues[order]])
        return self.queues[order]


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
    t_ser = serialisation_s(plan.kv_bytes, config.rate_bps)
    deadline = budget_seconds(t_ser, config.owd_s, config.rho, config.deadline_ms)
    slot = slot_seconds(symbol, config.rate_bps)
    return Handoff(config, plan, utilities, payload, t_ser, deadline, slot)


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
    # Per block id: every fragment decoded (arq: delivered in order) by the deadline.
    recovered_blocks: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))


class _Link:
    """One direction: serialisation queue + delay + loss from a pre-drawn realization."""

    def __init__(self, rate_bps: float, owd_s: float, lost: npt.NDArray[np.bool_] | None) -> None:
        self.rate_bps = rate_bps
        self.owd_s = owd_s
        self.lost = lost
        self.index = 0
        self.free_at = 0.0
        self.dropped = 0

    def transmit(self, size: int, now: float) -> tuple[float, float | None]:
        """Return (time the link is free again, arrival time or None when erased)."""
        start = max(now, self.free_at)
        self.free_at = start + size * 8 / self.rate_bps
        lost = False
        if self.lost is not None:
            lost = bool(self.lost[self.index % len(self.lost)])
            self.index += 1
        if lost:
            self.dropped += 1
            return self.free_at, None
        return self.free_at, self.free_at + self.owd_s


_DATA_TYPES = (1, 2)  # wire type byte of SOURCE and REPAIR


def run_once(handoff: Handoff, scheme: Scheme, realization: int, verify: bool = True) -> RunResult:
    cfg = handoff.config
    queue = handoff.queue(scheme.order)
    symbols = handoff.ordered_payload[scheme.order]
    n_source = len(queue)
    max_data = int(handoff.deadline_s / handoff.slot_s) + 64
    fwd_lost = forward_losses(handoff, realization)
    ctl_lost = cfg.loss.realize(64, handoff.slot_s, realization_rng(cfg.seed, realization, "control"))
    rev_lost = (
        cfg.reverse_loss.realize(max_data, handoff.slot_s, realization_rng(cfg.seed, realization, "reverse"))
        if cfg.reverse_loss is not None
        else None
    )
    data_link = _Link(cfg.rate_bps, cfg.owd_s, fwd_lost)
    ctl_link = _Link(cfg.rate_bps, cfg.owd_s, ctl_lost)  # shares data_link's timeline, see below
    rev_link = _Link(cfg.rate_bps, cfg.owd_s, rev_lost)

    cpu = CpuMeter(time.perf_counter_ns)
    session_id = (cfg.seed << 32 | realization) & 0xFFFFFFFFFFFFFFFF
    sender = SenderSession(
        session_id,
        SenderConfig(
            budget_s=handoff.deadline_s,
            slot_s=handoff.slot_s,
            owd_s=cfg.owd_s,
            repair_budget=round(cfg.repair_budget * n_source),
            fingerprint=SIM_FINGERPRINT,
            window_cap=cfg.window_cap,
            target_nonzeros=cfg.target_nonzeros,
            rate_bps=cfg.rate_bps,
            result_wait_s=0.5 + 4 * cfg.owd_s,
        ),
        symbols,
        scheme.make_policy(),
        PacketProtector(SIM_PSK, session_id, Role.SENDER, symbols.shape[1], authenticate=cfg.authenticate),
        SourceInfo(handoff.plan.fragment_block[queue], handoff.block_utility),
        cpu,
    )
    endpoint = ReceiverEndpoint(
        SIM_PSK,
        SIM_FINGERPRINT,
        ReceiverConfig(ack_every=cfg.ack_every),
        authenticate=cfg.authenticate,
        cpu=cpu,
    )

    wall0 = time.perf_counter()
    heap: list[tuple[float, int, bool, bytes]] = []  # (time, seq, to_receiver, datagram)
    seq = 0
    now = 0.0
    outcome: dict[str, Any] = {}
    sender.start(now)
    sender_ready = True
    while True:
        if sender_ready and now >= data_link.free_at:
            datagram = sender.next_datagram(now)
            if datagram is None:
                sender_ready = False
            else:
                link = data_link if datagram[1] in _DATA_TYPES else ctl_link
                ctl_link.free_at = data_link.free_at  # one physical link: control waits for data too
                free_at, arrival = link.transmit(len(datagram), now)
                data_link.free_at = ctl_link.free_at = free_at
                if arrival is not None:
                    heapq.heappush(heap, (arrival, seq, True, datagram))
                    seq += 1
                continue
        candidates = [data_link.free_at if sender_ready else math.inf]
        if heap:
            candidates.append(heap[0][0])
        for timer in (sender.get_timer(), endpoint.get_timer()):
            if timer is not None:
                candidates.append(timer)
        t_next = min(candidates)
        if t_next == math.inf:
            break
        now = max(now, t_next)
        while heap and heap[0][0] <= now:
            _t, _s, to_receiver, datagram = heapq.heappop(heap)
            if to_receiver:
                endpoint.receive_datagram(datagram, now)
            else:
                sender.receive_datagram(datagram, now)
                sender_ready = True
        timer = sender.get_timer()
        if timer is not None and timer <= now:
            sender.handle_timer(now)
            sender_ready = True
        timer = endpoint.get_timer()
        if timer is not None and timer <= now:
            endpoint.handle_timer(now)
        while (event := endpoint.next_event()) is not None:
            if isinstance(event, DeadlineReached):
                outcome["deadline"] = _score(handoff, queue, symbols, event, verify)
                session = endpoint.sessions[event.session_id]
                session.send_result(json.dumps({"decoded": len(event.decoded_esis)}).encode(), now)
        for _sid, datagram in endpoint.datagrams_to_send():
            _free, arrival = rev_link.transmit(len(datagram), now)
            if arrival is not None:
                heapq.heappush(heap, (arrival, seq, False, datagram))
                seq += 1
        while (sev := sender.next_event()) is not None:
            if isinstance(sev, Failed):
                outcome["failure"] = sev.reason
            elif isinstance(sev, ResultReceived):
                outcome["result"] = sev.decoded_count
    wall = time.perf_counter() - wall0

    score = outcome.get("deadline")
    if score is None and "failure" in outcome and session_id not in endpoint.sessions:
        # Every copy of the OFFER was lost (a long bad spell on the control packets' channel): the receiver
        # never knew the handoff, nothing was decoded; the sender reported it. A failed handoff, utility 0.
        score = {
            "utility": 0.0,
            "decoded": 0,
            "blocks": 0,
            "redundant": 0,
            "complete": np.zeros(handoff.plan.n_blocks, dtype=np.bool_),
            "stats": ReceiverStats(),
        }
        outcome["failure"] = f"the receiver never got the OFFER: {outcome['failure']}"
    if score is None:
        raise RuntimeError(f"simulation ended without the receiver's deadline ({outcome})")
    stats = score["stats"]
    return RunResult(
        scheme=scheme.name,
        realization=realization,
        recovered_utility=score["utility"],
        recovered_symbol_fraction=score["decoded"] / n_source,
        blocks_recovered=score["blocks"],
        source_sent=sender.datagrams_sent["source"],
        repair_sent=sender.datagrams_sent["repair"],
        control_sent=sender.datagrams_sent["control"],
        forward_lost=data_link.dropped,
        decoded_symbols=score["decoded"],
        redundant_repairs=score["redundant"],
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
        wall_s=wall,
        failure=outcome.get("failure"),
        recovered_blocks=score["complete"],
    )


def forward_losses(handoff: Handoff, realization: int) -> npt.NDArray[np.bool_]:
    """The forward erasure pattern of one realization, indexed by data datagram position (every scheme's)."""
    cfg = handoff.config
    max_data = int(handoff.deadline_s / handoff.slot_s) + 64
    return cfg.loss.realize(max_data, handoff.slot_s, realization_rng(cfg.seed, realization, "forward"))


def data_timing(handoff: Handoff) -> DataTiming:
    """SOURCE datagram timing after the first OFFER (no app blob in the simulator), as the sessions send."""
    cfg = handoff.config
    offer_bytes = HEADER_SIZE + OFFER_FIXED_SIZE + TAG_SIZE
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
    handoff: Handoff, name: str, realization: int, complete: npt.NDArray[np.bool_], delivered: int, **kw: int
) -> RunResult:
    n_source = handoff.plan.n_fragments
    return RunResult(
        scheme=name,
        realization=realization,
        recovered_utility=float(handoff.block_utility[complete].sum()),
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
        acks=0,
        decisions=0,
        cpu_ns={"encode": 0, "decode": 0, "feedback": 0, "policy": 0},
        wall_s=kw.get("wall_ns", 0) / 1e9,
        recovered_blocks=complete,
    )


def run_oracle(handoff: Handoff, realization: int) -> RunResult:
    """The clairvoyant bound on this realization: erased slots stay idle, no repairs, utility order."""
    t0 = time.perf_counter_ns()
    queue = handoff.queue("utility")
    delivered = oracle_delivered(forward_losses(handoff, realization), data_timing(handoff), len(queue))
    complete = complete_blocks(handoff, queue[:delivered])
    wall_ns = time.perf_counter_ns() - t0
    return _reference_result(handoff, "oracle", realization, complete, delivered, wall_ns=wall_ns)


def run_arq(handoff: Handoff, realization: int) -> RunResult:
    """Idealised selective-repeat ARQ on this realization (sources in utility order, in-order delivery).

    ``repair_sent`` counts its retransmissions."""
    t0 = time.perf_counter_ns()
    queue = handoff.queue("utility")
    cfg = handoff.config
    arq = simulate_arq(forward_losses(handoff, realization), data_timing(handoff), 2 * cfg.owd_s, len(queue))
    in_order = arq.delivered(handoff.deadline_s)
    complete = complete_blocks(handoff, queue[in_order])
    wall_ns = time.perf_counter_ns() - t0
    return _reference_result(
        handoff, "arq", realization, complete, int(in_order.sum()),
        source_sent=arq.new_sent, repair_sent=arq.retransmissions, forward_lost=arq.lost, wall_ns=wall_ns,
    )  # fmt: skip


def run_scheme(handoff: Handoff, name: str, realization: int, verify: bool = True) -> RunResult:
    """One realization of a session scheme (SCHEMES) or a reference scheme (arq, oracle)."""
    if name == "oracle":
        return run_oracle(handoff, realization)
    if name == "arq":
        return run_arq(handoff, realization)
    return run_once(handoff, get_scheme(name), realization, verify=verify)


def check_scheme_names(names: Sequence[str]) -> None:
    for name in names:
        if name not in SCHEMES and name not in REFERENCE_SCHEMES:
            known = ", ".join([*SCHEMES, *REFERENCE_SCHEMES])
            raise ValueError(f"unknown scheme {name!r}; choose from {known}")


def _score(
    handoff: Handoff,
    queue: npt.NDArray[np.int64],
    symbols: npt.NDArray[np.uint8],
    event: DeadlineReached,
    verify: bool,
) -> dict[str, Any]:
    decoded = event.decoded_esis
    if verify and len(decoded) and not np.array_equal(event.store[decoded], symbols[decoded]):
        raise AssertionError("decoder output differs from the source symbols")
    complete = complete_blocks(handoff, queue[decoded])
    return {
        "complete": complete,
        "utility": float(handoff.block_utility[complete].sum()),
        "blocks": int(complete.sum()),
        "decoded": len(decoded),
        "redundant": event.stats.redundant_repairs,
        "stats": event.stats,
    }


def mean_ci95(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """Mean and a 95% Student-t confidence interval of the mean."""
    arr = np.asarray(values, dtype=np.float64)
    n = len(arr)
    mean = float(arr.mean()) if n else math.nan
    if n < 2:
        return mean, (mean, mean)
    half = _t975(n - 1) * float(arr.std(ddof=1)) / math.sqrt(n)
    return mean, (mean - half, mean + half)


def _t975(dof: int) -> float:
    table = {
        1: 12.706,
        2: 4.303,
        3: 3.182,
        4: 2.776,
        5: 2.571,
        6: 2.447,
        7: 2.365,
        8: 2.306,
        9: 2.262,
        10: 2.228,
        12: 2.179,
        15: 2.131,
        20: 2.086,
        25: 2.060,
        30: 2.042,
        40: 2.021,
        60: 2.000,
        120: 1.980,
    }
    for limit in sorted(table):
        if dof <= limit:
            return table[limit]
    return 1.960


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
    for name, results in runs.items():
        util_mean, util_ci = mean_ci95([r.recovered_utility for r in results])
        sym_mean, sym_ci = mean_ci95([r.recovered_symbol_fraction for r in results])
        packets = sum(r.source_sent + r.repair_sent for r in results)
        cpu_total = {k: sum(r.cpu_ns[k] for r in results) for k in ("encode", "decode", "feedback", "policy")}
        eff_mean, eff_ci = mean_ci95(efficiencies(handoff, results))
        out["schemes"][name] = {
            "recovered_utility_mean": util_mean,
            "recovered_utility_ci95": list(util_ci),
            "efficiency_mean": eff_mean,
            "efficiency_ci95": list(eff_ci),
            "recovered_symbol_fraction_mean": sym_mean,
            "recovered_symbol_fraction_ci95": list(sym_ci),
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
        if name in REFERENCE_SCHEMES:
            out["schemes"][name]["note"] = REFERENCE_SCHEMES[name]
    return out


def _describe(model: LossModel) -> str:
    return repr(model)
