"""The sender's handoff jobs: the validated request (``HandoffSpec``), the job record the control API
reports (``Handoff``), and the report's sections as the job goes (its plan and budget, what went on the
wire, the receiver's RESULT)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

from pfec.common.node.udp import Destination
from pfec.common.plan.deadline import DEFAULT_RHO
from pfec.common.plan.handoff import ResultApp, recovered_utility, unpack_bits
from pfec.sender.kv import ContextInput, Prepared
from pfec.sender.session import SenderSession
from pfec.sender.transfer import LinkBudget

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
    repair_budget: float | None = None
    destination: Destination | None = None  # ``receiver`` resolved and checked (else the daemon does it)


@dataclass
class Handoff:
    id: str
    spec: HandoffSpec
    created_at: float  # wall clock (time.time) for the report
    state: HandoffState = "preparing"
    report: dict[str, Any] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    prepared: Prepared | None = None

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
        "n_source": plan.n_fragments,
        "symbol_size": plan.symbol_size,
        "kv_bytes": plan.kv_bytes,
        "rate_mbps": budget.rate_bps / 1e6,
        "t_ser_ms": round(budget.t_ser_s * 1000, 3),
        "deadline_ms": round(budget.deadline_s * 1000, 3),
        "rho": round(budget.rho, 4),
        "prefill_s": round(prepared.prefill_s, 4),
    }


def wire_report(session: SenderSession, bytes_sent: int, socket_errors: int) -> dict[str, Any]:
    """What the session put on the wire and what it dropped."""
    sent = session.datagrams_sent
    report: dict[str, Any] = {
        "source_sent": sent["source"],
        "repair_sent": sent["repair"],
        "control_sent": sent["control"],
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
    })
    return report, utility
