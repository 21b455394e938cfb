"""Fan-out (issue 37 item 3), unicast: one preparation handed to several receivers.

``POST /handoffs`` with ``receivers`` (1-8, distinct, each allowed like ``receiver``) runs here: one
prefill or store lookup, one quantisation and one precision plan, chosen once for the group (a fan-out
is never split), then a session per receiver. The sessions share the prepared source symbols (each
encoder reads the same array) and one transmit clock for the uplink, with its rate controller: their
pacing adds up to what the uplink carries. Each session has its own keys, ACKs and repairs.

The report says ``fanout: unicast`` and gives, per receiver, its outcome, recovered utility, decoded and
total symbols, start, TTFT, precision and answer, and the uplink's bytes over all sessions.

``fanout: multicast`` shares the preparation and runs :class:`pfec.sender.multicast.GroupRun`: one
stream sealed once under a fresh group key, sent once to the group destination (``group``); the report
then says ``fanout: multicast``, the group's bytes and each receiver's entry (``carried``: group, or
unicast for a member the group dropped, or none: it computes locally).

The plan is the group's: prepared for the receiver on the worst path (highest measured loss, then the
longest RTT), ties to the slowest stated prefill speed, never the first receiver by position.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Protocol

from pfec.common.node.config import parse_host_port
from pfec.common.plan.stream import AUTO
from pfec.common.sched.policies import Scheme
from pfec.sender.handoffs import Handoff, HandoffSpec, plan_report, receiver_fields
from pfec.sender.kv import Prepared
from pfec.sender.metrics import SenderMetrics
from pfec.sender.multicast import GroupRun
from pfec.sender.paths import PathLinks, PathLossPriors
from pfec.sender.peers import PeerMemory
from pfec.sender.transport.fanout.group import MAX_MEMBERS
from pfec.sender.transport.transfer import LinkBudget


class FanoutHost(Protocol):
    """What the fan-out uses of the sender daemon (sender/daemon.py; no import: the daemon imports this)."""

    rate_mbps: float
    owd_s: float
    links: PathLinks
    path_loss: PathLossPriors
    peers: PeerMemory
    multicast_interface: str | None
    multicast_ttl: int
    limits: Any
    metrics: SenderMetrics  # what the multicast carriage sends counts there too

    async def destination(self, spec: HandoffSpec) -> Any: ...
    async def _prepare(self, handoff: Handoff, scheme: Scheme, profile: str,
                       destination: Any) -> Prepared: ...
    def _make_transfer(self, handoff: Handoff, prepared: Prepared, scheme: Scheme, profile: str,
                       destination: Any, link: Any = None) -> Any: ...
    async def _stream(self, handoff: Handoff, transfer: Any, destination: Any) -> None: ...
    def _report_transfer(self, handoff: Handoff, transfer: Any, prepared: Prepared) -> float | None: ...

__all__ = ["MAX_FANOUT", "check_receivers", "planning_index", "run_fanout"]

MAX_FANOUT = MAX_MEMBERS  # receivers of one fan-out


def check_receivers(receivers: list[str]) -> list[str]:
    """The request's ``receivers``: 1-8 HOST:PORT addresses, none twice (ValueError names the entry)."""
    if not 1 <= len(receivers) <= MAX_FANOUT:
        raise ValueError(f"give 1 to {MAX_FANOUT} receivers, got {len(receivers)}")
    seen: dict[tuple[str, int], int] = {}
    for i, text in enumerate(receivers):
        try:
            address = parse_host_port(text)
        except ValueError as exc:
            raise ValueError(f"receivers.{i}: {exc}") from None
        if address in seen:
            raise ValueError(f"receivers.{i}: {text.strip()!r} is receivers.{seen[address]} again "
                             "(each receiver once)")
        seen[address] = i
    return [r.strip() for r in receivers]


def _entry(child: Handoff, outcome: str) -> dict[str, Any]:
    report = child.report
    return {
        "receiver": report.get("receiver"),
        "outcome": outcome,
        "session_id": report.get("session_id"),
        **receiver_fields(report),
        "bytes_sent": report.get("bytes_sent"),
        "source_sent": report.get("source_sent"),
        "repair_sent": report.get("repair_sent"),
        "failure": report.get("failure"),
    }


def planning_index(daemon: FanoutHost, addresses: list[str]) -> int:
    """Which receiver the group's plan is prepared for: the worst path (measured loss, then RTT), ties
    to the slowest stated prefill (seconds for 1024 tokens); unmeasured counts as best."""
    def badness(address: str) -> tuple[float, float, float]:
        peer = daemon.peers.get(address)
        prefill = 0.0 if peer.receiver is None else peer.receiver.prefill.seconds(1024)
        return (daemon.path_loss.measured(address) or 0.0, peer.rtt_s or 0.0, prefill)

    scores = [badness(a) for a in addresses]
    return max(range(len(addresses)), key=lambda i: (scores[i], -i))


async def run_fanout(daemon: FanoutHost, handoff: Handoff, scheme: Scheme,
                     profile: str) -> tuple[str, float | None]:
    """Prepare once for the group, then carry it as the spec's ``fanout`` says, and report per receiver.
    Returns (the outcome: done when every receiver's handoff is, the mean recovered utility)."""
    spec = handoff.spec
    # One plan for the group: never a split (the planner may still choose the precision mix).
    mode = "handoff" if spec.handoff_mode in (AUTO, "split") else spec.handoff_mode
    spec = replace(spec, handoff_mode=mode)
    destinations = [await daemon.destination(replace(spec, receiver=r, destination=None))
                    for r in spec.receivers]
    handoff.spec = spec
    planned = planning_index(daemon, [d.address for d in destinations])
    prepared = await daemon._prepare(handoff, scheme, profile, destinations[planned])
    handoff.prepared = prepared
    rate_bps = (spec.rate_mbps or daemon.rate_mbps) * 1e6
    budget = LinkBudget.for_plan(prepared.plan, rate_bps, daemon.owd_s, spec.rho, spec.deadline_ms)
    # One transmit clock (and, under path control, one controller) for the uplink every session shares.
    uplink = destinations[planned].address
    link = daemon.links.link_for(uplink, budget, daemon.path_loss.prior(uplink))
    handoff.report["planned_for"] = f"receivers.{planned}"
    if spec.fanout == "multicast":
        return await _multicast(daemon, handoff, prepared, scheme, profile, destinations, budget, link)
    children = []
    transfers = []
    for i, (receiver, destination) in enumerate(zip(spec.receivers, destinations, strict=True)):
        child = Handoff(f"{handoff.id}.{i}", replace(spec, receiver=receiver, destination=destination,
                                                     receivers=()), time.time())
        child.prepared = prepared
        children.append(child)
        transfers.append(daemon._make_transfer(child, prepared, scheme, profile, destination, link))
    handoff.state = "streaming"
    await asyncio.gather(*(daemon._stream(c, t, d) for c, t, d in zip(children, transfers, destinations,
                                                                         strict=True)))
    utilities = []
    entries = []
    for child, transfer in zip(children, transfers, strict=True):
        utility = daemon._report_transfer(child, transfer, prepared)
        if utility is not None:
            utilities.append(utility)
        entries.append(_entry(child, transfer.outcome))
    report = handoff.report
    report.update(_plan_keys(children[0].report))
    report["fanout"] = "unicast"
    report["receivers"] = entries
    report["uplink_bytes"] = sum(t.bytes_sent for t in transfers)
    report["uplink_datagrams"] = sum(sum(t.session.datagrams_sent.values()) for t in transfers)
    outcomes = [t.outcome for t in transfers]
    outcome = "done" if all(o == "done" for o in outcomes) else "failed"
    if outcome != "done":
        report["failure"] = "; ".join(f"receivers.{i}: {e['failure'] or e['outcome']}"
                                      for i, e in enumerate(entries) if e["outcome"] != "done")
    return outcome, (sum(utilities) / len(utilities) if utilities else None)


_PLAN_KEYS = ("scheme", "n_tokens", "n_blocks", "n_source", "symbol_size", "kv_bytes", "precision",
              "stream_bytes", "precision_mix", "handoff_mode", "rate_mbps", "t_ser_ms", "deadline_ms", "rho",
              "prefill_s", "profile", "mode")


def _plan_keys(report: dict[str, Any]) -> dict[str, Any]:
    return {key: report[key] for key in _PLAN_KEYS if key in report}


async def _multicast(daemon: FanoutHost, handoff: Handoff, prepared: Prepared, scheme: Scheme, profile: str,
                     destinations: list[Any], budget: LinkBudget, link: Any) -> tuple[str, float | None]:
    """One coded stream to the group (sender/multicast.py), and the report per receiver."""
    spec = handoff.spec
    assert spec.group is not None  # the control API resolved it (the request's, or the configured one)
    if budget.deadline_s * 1000 > daemon.limits.max_budget_ms:
        raise ValueError(f"deadline: the handoff's budget of {budget.deadline_s * 1000:.0f} ms is above "
                         f"limits.max_budget_ms ({daemon.limits.max_budget_ms:g} ms)")
    run = GroupRun(daemon, handoff, prepared, scheme, profile, destinations, spec.group, budget, link,
                   daemon.multicast_interface, daemon.multicast_ttl)
    try:
        await run.run()
    except asyncio.CancelledError:
        run.cancel("sender shutting down")
        raise
    # The plan's section, as a unicast handoff's report has it (a session id per member, below).
    report = handoff.report
    report.update(_plan_keys(plan_report(spec, prepared, budget, scheme.name, run.ticket.session_id, profile,
                                         destinations[0])))
    entries, utilities = run.entries()
    group = run.session
    assert group is not None
    report["fanout"] = "multicast"
    report["group"] = {
        "destination": spec.group, "session_id": f"{run.ticket.session_id:016x}",
        "source_sent": group.datagrams_sent["source"], "repair_sent": group.datagrams_sent["repair"],
        "control_sent": group.datagrams_sent["control"], "bytes": run.group_bytes,
        "socket_errors": run.socket_errors,
        "repair_budget": run.repair_budget, "end": run.done_reason, "drops": dict(group.drops),
        "members": [{"phase": m.phase.label, "loss": round(m.loss, 4), "reason": m.reason or None}
                    for m in group.members],
    }
    report["receivers"] = entries
    report["uplink_bytes"] = run.bytes_sent + run.fallback_bytes()
    report["uplink_datagrams"] = (sum(group.datagrams_sent.values())
                                  + sum(m.datagrams_sent for m in run.members))
    outcome = "done" if all(e["outcome"] == "done" for e in entries) else "failed"
    if outcome != "done":
        report["failure"] = "; ".join(f"receivers.{i}: {e.get('failure') or e['outcome']}"
                                      for i, e in enumerate(entries) if e["outcome"] != "done")
    return outcome, (sum(utilities) / len(utilities) if utilities else None)
