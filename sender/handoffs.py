"""The sender's handoff jobs: the validated request (``HandoffSpec``), the job record the control API
reports (``Handoff``), and the report's sections as the job goes (its plan and budget, what went on the
wire, the receiver's RESULT)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pfec.common.node.udp import Destination
from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.deadline import DEFAULT_RHO, RepairBudget
from pfec.common.plan.handoff import ResultApp, recovered_utility, unpack_bits
from pfec.common.plan.precision import PieceKind
from pfec.common.plan.stream import AUTO
from pfec.sender.kv import ContextInput, Prepared
from pfec.sender.transport.session import SenderSession
from pfec.sender.transport.transfer import LinkBudget

HandoffState = Literal["preparing", "streaming", "draining", "done", "failed"]


@dataclass(frozen=True)
class HandoffSpec:
    """A validated handoff request (the control API builds it from its JSON model)."""

    inputs: ContextInput
    receiver: tuple[str, int]
    deadline_ms: float | None = None
    rho: float | None = DEFAULT_RHO
    scheme: str | None = None
    mode: Literal["mask", "zero"] = "mask"
    rate_mbps: float | None = None
    max_new_tokens: int = 24
    full_kv_answer: bool = False
    profile: str | None = None
    generate: bool = True
    repair_budget: RepairBudget | None = None  # None: the daemon's (fec.repair_budget)
    destination: Destination | None = None  # ``receiver`` resolved and checked (else the daemon does it)
    precision: str = AUTO  # auto (the planner's mix; native for synthetic KV) or a mix of stream.MIXES
    handoff_mode: str = AUTO  # auto (the planner's), handoff, split or local (mode_choice.HANDOFF_MODES)
    receivers: tuple[tuple[str, int], ...] = ()  # a fan-out's receivers (``receiver`` is the first); () none
    fanout: str = "unicast"  # how a fan-out is carried (sender/fanout.py)
    group: str | None = None  # a multicast fan-out's group destination IP:PORT (checked against the config)


@dataclass
class Handoff:
    id: str
    spec: HandoffSpec
    created_at: float  # wall clock (time.time) for the report
    state: HandoffState = "preparing"
    report: dict[str, Any] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    prepared: Prepared | None = None
    stated_receiver: ReceiverModel | None = None  # the prefill speed the receiver's ACCEPT stated

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, **self.report}


def plan_report(spec: HandoffSpec, prepared: Prepared, budget: LinkBudget, scheme: str, session_id: int,
                profile: str, destination: Destination) -> dict[str, Any]:
    """The report's first section: what is sent, to whom (as asked and the address used), within which
    budget."""
    plan = prepared.plan
    return {
        "scheme": scheme,
        "receiver": f"{spec.receiver[0]}:{spec.receiver[1]}",
        "receiver_address": destination.address,
        "session_id": f"{session_id:016x}",
        "mode": spec.mode,
        "profile": profile,
        "n_tokens": plan.n_tokens,
        "n_blocks": plan.n_blocks,
        "n_source": prepared.n_source,
        "symbol_size": plan.symbol_size,
        "kv_bytes": plan.kv_bytes,
        **precision_report(prepared),
        "rate_mbps": budget.rate_bps / 1e6,
        "t_ser_ms": round(budget.t_ser_s * 1000, 3),
        "deadline_ms": round(budget.deadline_s * 1000, 3),
        "rho": round(budget.rho, 4),
        "prefill_s": round(prepared.prefill_s, 4),
    }


def precision_report(prepared: Prepared) -> dict[str, Any]:
    """What the stream carries: the mix, its bytes next to the native cache's, the planner's prediction."""
    stream = prepared.stream
    planner = prepared.planner
    out: dict[str, Any] = {
        "precision": prepared.precision,
        "native_bytes": prepared.plan.kv_bytes,
        "stream_bytes": prepared.plan.kv_bytes if stream is None else stream.plan.total_bytes,
        "precision_mix": {"native": prepared.plan.n_blocks} if stream is None else stream.summary(),
        "planner": planner,
        "planner_ttft_s": None if planner is None else round(float(planner["predicted_ttft_s"]), 6),
        "planner_choice": None if planner is None else planner["choice"],
        "handoff_mode": prepared.handoff_mode,
        "meeting_token_planned": None if prepared.split is None else prepared.split.meeting_token,
        "predicted_ttft_s": None if planner is None else round(float(planner["predicted_ttft_s"]), 6),
        "predicted_local_ttft_s": None if planner is None else round(float(planner["local_ttft_s"]), 6),
    }
    if stream is not None:
        out["quantise_s"] = round(stream.quantise_s, 6)
    return out


def sent_bytes_by_level(prepared: Prepared, source_sent: int) -> dict[str, int]:
    """KV bytes of the first ``source_sent`` source symbols (sources go out in order), by precision level
    of the pieces they carry (``native`` for fragments; repairs not counted)."""
    stream = prepared.stream
    if stream is None:
        plan = prepared.plan
        return {"native": min(plan.kv_bytes, max(0, source_sent) * plan.fragment_payload)}
    pieces = stream.plan
    limit = min(pieces.total_bytes, max(0, source_sent) * pieces.symbol_size)
    inside = np.clip(limit - pieces.offsets, 0, pieces.sizes)
    out: dict[str, int] = {}
    for kind in np.unique(pieces.kinds).tolist():
        label = PieceKind(kind).level.label
        out[label] = out.get(label, 0) + int(inside[pieces.kinds == kind].sum())
    return out


def wire_report(session: SenderSession, bytes_sent: int, socket_errors: int) -> dict[str, Any]:
    """What the session put on the wire and what it dropped."""
    sent = session.datagrams_sent
    report: dict[str, Any] = {
        "source_sent": sent["source"],
        "repair_sent": sent["repair"],
        "control_sent": sent["control"],
        "repair_cap": session.config.repair_budget,  # repairs it could have sent (budget or deadline)
        "probes_sent": session.probe.sent,  # repairs sent on a probe timeout (transport/probe.py)
        "bytes_sent": bytes_sent,
        "socket_errors": socket_errors,
        "drops": dict(session.drops),
        "decisions": session.cpu.decisions if session.cpu else None,
    }
    if session.cpu is not None:
        cpu = session.cpu
        report["session_cpu_ms"] = {"encode": cpu.encode_ns / 1e6, "feedback": cpu.feedback_ns / 1e6,
                                    "policy": cpu.policy_ns / 1e6}
    return report


def receiver_fields(report: dict[str, Any]) -> dict[str, Any]:
    """What a fan-out's per-receiver entry keeps of one receiver's report (or its RESULT's section)."""
    return {
        "recovered_utility": report.get("recovered_utility"),
        "decoded_symbols": report.get("decoded_symbols"),
        "n_source": report.get("n_source"),
        "start": report.get("start"),
        "ttft_s": report.get("ttft_s"),
        "precision": report.get("received_precision") or report.get("precision"),
        "answer": report.get("answer"),
    }


def result_report(result: ResultApp, prepared: Prepared) -> tuple[dict[str, Any], float | None]:
    """(the RESULT's section of the report, the recovered utility scored here from its block map).

    The utility is None when the receiver failed before scoring; the section then holds a ``failure``."""
    report: dict[str, Any] = {}
    try:
        complete = unpack_bits(result.blocks_bitmap, prepared.plan.n_blocks)
        utility: float | None = recovered_utility(prepared.block_utility, complete)
    except ValueError as exc:  # the receiver failed before scoring (its error is the failure)
        utility = None
        report["failure"] = f"receiver sent no usable block map: {exc}"
    report.update({
        "recovered_utility": utility,
        "receiver_recovered_utility": result.recovered_utility,
        "blocks_recovered": result.blocks_recovered,
        "decoded_symbols": result.decoded_symbols,
        "ttft_s": result.ttft_s,
        "generation_ttft_s": result.generation_ttft_s,
        "deadline_late_ms": result.deadline_late_ms,
        "answer": result.answer,
        "reconstruction": result.mode,
        "rebuild_s": result.rebuild_s,
        "receiver_error": result.error,
        "receiver_stats": result.stats,
        "start": result.start,
        "received_precision": result.precision,
        "precision_utility": result.precision_utility,
        "levels": result.levels,
        "receiver_mode": result.handoff_mode,
        "computed_tokens": result.computed_tokens,
        "front_s": result.front_s,
        "blocks_computed": result.blocks_computed,
        "blocks_received": result.blocks_received,
        "predicted_vs_measured": parts_report(prepared.planner, result),
    })
    return report, utility


def _pair(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    ratio = None
    if predicted is not None and measured is not None and predicted > 0:
        ratio = round(measured / predicted, 3)
    return {"predicted": None if predicted is None else round(predicted, 4),
            "measured": None if measured is None else round(measured, 4), "measured_over_predicted": ratio}


def parts_report(planner: dict[str, Any] | None, result: ResultApp) -> dict[str, Any] | None:
    """Each part of the TTFT the planner predicted beside what it took on the receiver (its RESULT), all
    counted from the OFFER's arrival (the one-way delay before it taken out of the prediction): ``ready_s``
    until decoding closed, ``front_s`` (a split's front computed, or a local prefill's), ``rebuild_s``
    (join included), ``question_s`` (the question's forward to the first token), ``decode_s`` (a decode
    step; the planner's TTFT counts one after the question's forward) and ``ttft_s``. None without a
    prediction."""
    parts = (planner or {}).get("predicted_parts")
    if not parts:
        return None
    owd = float(planner.get("owd_s", 0.0)) if planner else 0.0
    ttft = float(planner["predicted_ttft_s"]) if planner and "predicted_ttft_s" in planner else None
    out: dict[str, Any] = {}
    if "serialisation_s" in parts:  # the whole cache streams
        out["ready_s"] = _pair(parts.get("handshake_s", 0.0) + parts["serialisation_s"], result.stream_s)
    elif "front_s" in parts:  # a split
        out["ready_s"] = _pair(max(parts["front_s"], parts.get("back_s", 0.0)) - owd, result.stream_s)
        out["front_s"] = _pair(parts["front_s"] - owd, result.front_s)
    elif "prefill_s" in parts:  # local prefill
        out["front_s"] = _pair(parts["prefill_s"], result.front_s)
    if "rebuild_s" in parts:
        out["rebuild_s"] = _pair(parts["rebuild_s"] + parts.get("join_s", 0.0), result.rebuild_s)
    if "question_s" in parts:
        out["question_s"] = _pair(parts["question_s"], result.question_s)
    out["decode_s"] = _pair(parts.get("decode_s"), result.decode_step_s)
    out["ttft_s"] = _pair(None if ttft is None else ttft - owd, result.ttft_s)
    return out
