"""Slot simulator: the real sender/receiver sessions and codec over a paced, lossy link in simulated time.

Nothing sleeps. A forward link of ``rate_mbps`` serialises one datagram at a time (a datagram of L bytes
holds the link for 8L/C seconds) and delivers it ``fwd_owd_s`` later unless the loss model erases it;
ACKs and RESULTs come back over a reverse link with its own delay; the reverse path is lossless unless
``reverse_loss`` is set (``pfec sim`` leaves it lossless; ``pfec eval`` sets the cell's loss model on both
directions, the paper-like choice, see ``lab/eval/config.py``).

Paired realizations: the forward loss sequence is drawn once per (seed, realization) and indexed by the
data datagram's position in the stream (k-th SOURCE/REPAIR sent), so every scheme meets the same erasure
pattern; control datagrams (OFFER, CLOSE) and ACKs draw from their own streams of the same seed.

Deadline: D = T_ow + rho * T_ser, T_ser = S_KV / C, where S_KV is the KV cache size in bytes (paper V-A).
The sessions are assembled by ``sender/transport/transfer.py``, the same code the sender daemon uses, so the
budget, slot, repair budget and OFFER parameters cannot drift apart between the simulator and a node.
Recovered utility = sum of U_b over blocks whose every fragment was decoded by the receiver's deadline,
divided by sum U_b (the utilities sum to 1). With a quantised ``precision`` (``common/plan/stream.py``) the
handoff sends the piece plan's symbols instead, and a block counts at the level its arrived pieces reach:
recovered utility = sum U_b x fidelity(level_b) (``recovered_block_utility`` is the plain share of blocks
usable at any level). The deadline stays that of the native cache: precision buys time inside it.
The handoff itself (``SimConfig``, ``Handoff``, ``prepare``) is ``lab/sim/handoff.py``, re-exported here;
the event loop in simulated time is ``lab/sim/engine.py``; ``mode`` split / local (the receiver prefills the
front, or all, of the context itself) is modelled in ``lab/sim/split.py``.

Reference schemes run outside the sessions on the same forward realization (``REFERENCE_SCHEMES``): the
ARQ models of ``lab/sim/arq.py`` (``ARQ_SCHEMES``) -- ``arq``, the paper's baseline (natural order, ACKs
over the reverse path meeting the reverse loss realization drawn here, reordering threshold or RTO),
``priority-arq`` (the same in utility order, ours) and ``arq-ideal`` (utility order, lossless instant
feedback: idealised feedback, not an upper bound of the realistic ARQ's outcome) -- and ``oracle`` (the
clairvoyant bound, lab/sim/oracle.py). The oracle is computed for every realization even when not asked for:
every scheme's ``efficiency`` is its recovered utility / the oracle's on the same realization. On a
trace-driven link, ``known-rate`` and ``known-rate-unbounded`` run our session paced by an idealised
pacer that is told the trace's rate (lab/sim/known_rate.py): references, not senders.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pfec.common.codec.gf256 import njit_cached
from pfec.common.events import CpuMeter
from pfec.common.plan.deadline import WHOLE_DEADLINE
from pfec.common.sched.policies import SCHEMES, Scheme, get_scheme
from pfec.common.wire.messages import HEADER_SIZE, NONCE_SIZE, OFFER_FIXED_SIZE, SOURCE_ID_SIZE, TAG_SIZE
from pfec.lab.reporting.stats import mean_ci95_fields
from pfec.lab.sim.arq import ARQ_SCHEMES, simulate_arq_scheme
from pfec.lab.sim.channel import LossModel, realization_rng
from pfec.lab.sim.engine import DeadlineScore, SimLink, SimLinks, SimRun
from pfec.lab.sim.handoff import Handoff, SimConfig, complete_blocks, prepare
from pfec.lab.sim.known_rate import KNOWN_RATE_DEFINITIONS, KNOWN_RATE_SCHEMES, known_rate_pacer
from pfec.lab.sim.oracle import DataTiming, oracle_delivered, trace_data_slots
from pfec.lab.sim.path_link import forward_bottleneck, path_fields, path_rate, queue_fields, sender_budget
from pfec.lab.sim.rate_trace import queue_limit_bytes
from pfec.lab.sim.split import (
    FrontPrefill,
    SplitCredit,
    computed_blocks,
    local_start_s,
    split_credit,
    split_fields,
    split_inputs,
)
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverStats
from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.repair_plan import warm_up
from pfec.sender.transport.transfer import SenderSetup, SendQueue, assemble_sender

__all__ = [
    "REFERENCE_SCHEMES", "Handoff", "RunResult", "SimConfig", "complete_blocks", "data_timing",
    "forward_losses", "prepare", "report", "reverse_losses", "run_arq", "run_once", "run_oracle",
    "run_scheme", "simulate", "simulate_runs",
]

SIM_PSK = bytes(range(32))
SIM_FINGERPRINT = b"pfec-sim".ljust(32, b"\0")
# ``<scheme>@deadline``: a session scheme with the whole deadline as its repair budget (the daemons'
# default), beside the same scheme at the cell's budget (the paper's fixed 15% by default).
WHOLE_DEADLINE_VARIANT = "@" + WHOLE_DEADLINE
REFERENCE_SCHEMES = {  # run outside the sessions, or with an idealised pacer: see the module docstring
    **{name: scheme.definition for name, scheme in ARQ_SCHEMES.items()},
    "oracle": "clairvoyant bound: knows the losses, sends sources in utility order only in arriving slots",
    **KNOWN_RATE_DEFINITIONS,
}



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
    decoded_ids: npt.NDArray[np.int64] | None = None  # session schemes: queue entries decoded by the start
    start_s: float | None = None  # session schemes: when the receiver started generating (ready or deadline)
    computed_tokens: int = 0  # split / local: context tokens the receiver computed itself
    sources_dropped: int = 0  # split: unsent sources the sender dropped (the receiver computed them)
    # A bottlenecked link (lab/sim/path_link.py): datagrams its queue took and dropped; the sender's
    # PathRate at the end (its estimate, its forecast, congestion events; None under a fixed rate).
    queue_received: int = 0
    queue_dropped: int = 0
    queue_delay_ms_p95: float | None = None  # the bottleneck's queueing delay, P95 over the run's datagrams
    rate_end: dict[str, float] | None = None


def _links(handoff: Handoff, realization: int, controller: PathRate | None = None) -> SimLinks:
    """The three directions of one realization; each draws its losses from its own stream of the seed.
    The forward ones pace at the told rate, or at ``controller``'s."""
    cfg = handoff.config
    slot = handoff.slot_s
    ctl_lost = cfg.loss.realize(64, slot, realization_rng(cfg.seed, realization, "control"))
    bottleneck = forward_bottleneck(cfg)  # one queue for data and control: one physical link
    pace = cfg.told_rate_bps
    return SimLinks(
        SimLink(pace, cfg.owd_s, forward_losses(handoff, realization), bottleneck, controller),
        SimLink(pace, cfg.owd_s, ctl_lost, bottleneck, controller),
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


def run_once(handoff: Handoff, scheme: Scheme, realization: int, verify: bool = True,
             controller: PathRate | None = None) -> RunResult:
    """One scheme on one realization. ``controller``: under ``rate_control = path``, the controller to run
    instead of a fresh one (a bench records its calls)."""
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
        loss_prior=cfg.sender_loss_prior,
    )
    if cfg.mode == "local":
        return _local_result(handoff, scheme, realization)
    budget = sender_budget(handoff)
    rate = path_rate(handoff, budget) if controller is None or cfg.rate_control != "path" else controller
    sender = assemble_sender(session_id, send, budget, setup, cpu, rate)
    endpoint = ReceiverEndpoint(
        SIM_PSK,
        SIM_FINGERPRINT,
        ReceiverConfig(ack_every=cfg.ack_every),
        authenticate=cfg.authenticate,
        cpu=cpu,
        random_bytes=seeded_random_bytes(cfg.seed, realization, "receiver"),
    )
    front = None
    if cfg.mode == "split":
        assert send.token_ends is not None
        front = FrontPrefill(endpoint, cfg.receiver, cfg.tokens, handoff.meeting_token,
                             handoff.index_token_ends(scheme.order))
    run = SimRun(sender, endpoint, _links(handoff, realization, rate),
                 lambda event: _score(handoff, send, scheme.order, event, verify, endpoint), front)
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
        decoded_ids=score.decoded_ids,
        start_s=None if np.isnan(score.at) else score.at,
        computed_tokens=score.computed_tokens,
        sources_dropped=run.sender.sources_dropped,
        **path_fields(run.links.data),
    )


def _local_result(handoff: Handoff, scheme: Scheme, realization: int) -> RunResult:
    """Local prefill: nothing streams, every block is exact once the receiver has computed the context."""
    cfg, n = handoff.config, handoff.plan.n_blocks
    return RunResult(scheme.name, realization, 1.0, 0.0, n, 0, 0, 1, 0, 0, 0, 0, 0.0, 0, 0, 0,
                     {"encode": 0, "decode": 0, "feedback": 0, "policy": 0}, 0.0,
                     recovered_blocks=np.ones(n, dtype=np.bool_), block_utility=1.0,
                     start_s=local_start_s(cfg.receiver, cfg.tokens, cfg.owd_s), computed_tokens=cfg.tokens)


def forward_losses(handoff: Handoff, realization: int) -> npt.NDArray[np.bool_]:
    """The forward erasure pattern of one realization, indexed by data datagram position (every scheme's)."""
    cfg = handoff.config
    max_data = int(handoff.deadline_s / handoff.slot_s) + 64
    return cfg.loss.realize(max_data, handoff.slot_s, realization_rng(cfg.seed, realization, "forward"))


def _source_bytes(handoff: Handoff) -> int:
    return HEADER_SIZE + SOURCE_ID_SIZE + handoff.plan.symbol_size + TAG_SIZE


def data_timing(handoff: Handoff) -> DataTiming:
    """SOURCE datagram timing after the first OFFER (no app blob in the simulator), as the sessions send."""
    cfg = handoff.config
    offer_bytes = HEADER_SIZE + NONCE_SIZE + OFFER_FIXED_SIZE + TAG_SIZE
    source_bytes = _source_bytes(handoff)
    return DataTiming(
        first_send_s=offer_bytes * 8 / cfg.rate_bps,
        datagram_s=source_bytes * 8 / cfg.rate_bps,
        owd_s=cfg.owd_s,
        deadline_s=handoff.deadline_s,
    )


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
    timing = data_timing(handoff)
    trace = handoff.config.rate_trace
    slots = None if trace is None else trace_data_slots(trace, timing, _source_bytes(handoff))
    delivered = oracle_delivered(forward_losses(handoff, realization), timing, len(queue), slots)
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


def whole_deadline_base(name: str) -> str | None:
    """The session scheme of a ``<scheme>@deadline`` name (that scheme repairing until done: the whole
    deadline as its repair budget, whatever the cell's), or None for any other name."""
    base = name.removesuffix(WHOLE_DEADLINE_VARIANT)
    return base if base != name and base in SCHEMES else None


def run_scheme(handoff: Handoff, name: str, realization: int, verify: bool = True) -> RunResult:
    """One realization of a session scheme (SCHEMES, or one with the ``@deadline`` variant) or a reference
    scheme (REFERENCE_SCHEMES)."""
    if name == "oracle":
        return run_oracle(handoff, realization)
    if name in ARQ_SCHEMES:
        return run_arq(handoff, realization, name)
    base = "priorityfec" if name in KNOWN_RATE_SCHEMES else whole_deadline_base(name)
    if base is not None:  # same handoff and realization, the whole deadline as the repair budget
        whole = dataclasses.replace(handoff, config=dataclasses.replace(handoff.config, repair_budget=None))
        pacer = known_rate_pacer(whole, name) if name in KNOWN_RATE_SCHEMES else None  # idealised
        return dataclasses.replace(run_once(whole, get_scheme(base), realization, verify=verify,
                                            controller=pacer), scheme=name)
    return run_once(handoff, get_scheme(name), realization, verify=verify)


def check_scheme_names(names: Sequence[str]) -> None:
    for name in names:
        if name not in SCHEMES and name not in REFERENCE_SCHEMES and whole_deadline_base(name) is None:
            known = ", ".join([*SCHEMES, *REFERENCE_SCHEMES])
            raise ValueError(f"unknown scheme {name!r}; choose from {known}")


@njit_cached
def _rows_equal(store: npt.NDArray[np.uint8], store_rows: npt.NDArray[np.int64],
                symbols: npt.NDArray[np.uint8], symbol_rows: npt.NDArray[np.int64]) -> bool:
    """``store[store_rows] == symbols[symbol_rows]`` without copying the rows out (tens of MB per run)."""
    if store.shape[1] != symbols.shape[1] or store_rows.shape[0] != symbol_rows.shape[0]:
        return False
    for k in range(store_rows.shape[0]):
        a, b = store_rows[k], symbol_rows[k]
        for j in range(store.shape[1]):
            if store[a, j] != symbols[b, j]:
                return False
    return True


def _native_split_credit(handoff: Handoff, fragment_ids: npt.NDArray[np.int64], computed_tokens: int,
                         ) -> SplitCredit:
    """Credit of a native split at its start: the computed front and the blocks whose fragments all
    arrived, both exact."""
    plan = handoff.plan
    computed = computed_blocks(plan.n_blocks, plan.n_token_blocks, plan.block_tokens, plan.n_tokens,
                               computed_tokens)
    usable = complete_blocks(handoff, fragment_ids) | computed
    utility = float(handoff.block_utility[usable].sum())
    return SplitCredit(usable, utility, utility, computed)


def _score(handoff: Handoff, send: SendQueue, order: str, event: DeadlineReached,
           verify: bool, endpoint: ReceiverEndpoint) -> DeadlineScore:
    decoded = event.decoded_esis
    at = event.started_at
    split = handoff.config.mode == "split"
    # A split sender reorders its unsent symbols as the front grows, so ESIs no longer follow the queue:
    # each decoded symbol is filed by the index it carries (as the receiver daemon does): its stream index,
    # or a native fragment's id, whose row in the queue is found by inverting it.
    stream = handoff.stream(order)
    rows = decoded
    if split:
        rows = np.ascontiguousarray(event.store[decoded, :4]).view(">u4").reshape(-1).astype(np.int64)
        if stream is None:
            queue = handoff.queue(order)
            position = np.empty_like(queue)
            position[queue] = np.arange(len(queue))
            rows = position[rows]
    if verify and not _rows_equal(event.store, decoded, send.symbols, rows):
        raise AssertionError("decoder output differs from the source symbols")
    ids = handoff.queue(order)[rows]
    if split and stream is None:
        computed = endpoint.sessions[event.session_id].computed_tokens
        credit = _native_split_credit(handoff, ids, computed)
        return DeadlineScore(credit.usable, credit.utility, int(credit.usable.sum()), len(decoded),
                             event.stats.redundant_repairs, event.stats, ids, computed, at)
    if split:
        computed = endpoint.sessions[event.session_id].computed_tokens
        fidelity = handoff.fidelity
        assert stream is not None and fidelity is not None
        have = np.zeros(stream.n_symbols, dtype=np.bool_)
        have[ids] = True
        credit = split_credit(stream, have, handoff.block_utility, fidelity, computed)
        return DeadlineScore(credit.usable, credit.utility, int(credit.usable.sum()), len(decoded),
                             event.stats.redundant_repairs, event.stats, ids, computed, at)
    complete, utility, _plain = handoff.credit(order, decoded)
    return DeadlineScore(
        complete=complete,
        utility=utility,
        blocks=int(complete.sum()),
        decoded=len(decoded),
        redundant=event.stats.redundant_repairs,
        stats=event.stats,
        decoded_ids=ids,
        at=at,
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
    reference = [name for name in scheme_names if name in REFERENCE_SCHEMES]
    if config.mode != "handoff" and reference:
        raise ValueError(f"{', '.join(reference)} model a whole-cache handoff, not mode {config.mode}: "
                         "run session schemes only")
    fixed_rate_models = [name for name in reference if name != "oracle"]
    if config.rate_trace is not None and fixed_rate_models:
        raise ValueError(f"{', '.join(fixed_rate_models)} model a fixed-rate link; on a --rate-trace link "
                         "run the session schemes and the oracle")
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
            "rate_trace": None if cfg.rate_trace is None else {
                "name": cfg.rate_trace.name, "scale": cfg.rate_trace.scale,
                "mean_rate_mbps": round(cfg.rate_trace.mean_rate_bps / 1e6, 3),
                "queue_bytes": queue_limit_bytes(cfg.rate_trace, None, cfg.queue_bytes)},
            **({} if not cfg.bottlenecked else {
                "told_rate_mbps": cfg.told_rate_bps / 1e6, "rate_control": cfg.rate_control}),
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
            "window_cap": handoff.window_cap,  # the one used (sized from the path when configured 0)
            "window_cap_config": cfg.window_cap,
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
    if cfg.mode != "handoff":
        out["inputs"].update(split_inputs(cfg, handoff.meeting_token))
    for name, results in runs.items():
        packets = sum(r.source_sent + r.repair_sent for r in results)
        cpu_total = {k: sum(r.cpu_ns[k] for r in results) for k in ("encode", "decode", "feedback", "policy")}
        out["schemes"][name] = {
            **mean_ci95_fields("recovered_utility", [r.recovered_utility for r in results]),
            # The oracle bounds a whole-cache handoff: no efficiency when the receiver computes the front.
            **(mean_ci95_fields("efficiency", efficiencies(handoff, results))
               if cfg.mode == "handoff" else {}),
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
        if cfg.bottlenecked and (name not in REFERENCE_SCHEMES or name in KNOWN_RATE_SCHEMES):
            out["schemes"][name].update(queue_fields(
                [r.queue_received for r in results], [r.queue_dropped for r in results],
                [r.rate_end for r in results if r.rate_end is not None],
                [r.queue_delay_ms_p95 for r in results if r.queue_delay_ms_p95 is not None]))
        if handoff.fidelity is not None:
            out["schemes"][name].update(mean_ci95_fields(
                "recovered_block_utility", [r.block_utility or 0.0 for r in results]))
        if cfg.mode != "handoff" and name not in REFERENCE_SCHEMES:
            out["schemes"][name].update(split_fields(results, cfg.receiver.decode_s))
        if name in REFERENCE_SCHEMES:
            out["schemes"][name]["note"] = REFERENCE_SCHEMES[name]
    return out


def _describe(model: LossModel) -> str:
    return repr(model)
