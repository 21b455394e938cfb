"""Fan-out (issue 37 item 3), unicast: one preparation handed to several receivers.

``POST /handoffs`` with ``receivers`` (1-8, distinct, each allowed like ``receiver``) runs here: one
prefill or store lookup, one quantisation and one precision plan, chosen once for the group (a fan-out
is never split), then a session per receiver. The sessions share the prepared source symbols (each
encoder reads the same array) and one transmit clock for the uplink, with its rate controller: their
pacing adds up to what the uplink carries. Each session has its own keys, ACKs and repairs.

The report says ``fanout: unicast`` and gives, per receiver, its outcome, recovered utility, decoded and
total symbols, start, TTFT, precision and answer, and the uplink's bytes over all sessions. The multicast
carriage (one stream sealed once under a group key) is sans-IO only so far (sender/transport/fanout/).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Protocol

from pfec.common.node.config import parse_host_port
from pfec.common.plan.stream import AUTO
from pfec.common.sched.policies import Scheme
from pfec.sender.handoffs import Handoff, HandoffSpec
from pfec.sender.kv import Prepared
from pfec.sender.paths import PathLinks, PathLossPriors
from pfec.sender.transport.fanout.group import MAX_MEMBERS
from pfec.sender.transport.transfer import LinkBudget


class FanoutHost(Protocol):
    """What the fan-out uses of the sender daemon (sender/daemon.py; no import: the daemon imports this)."""

    rate_mbps: float
    owd_s: float
    links: PathLinks
    path_loss: PathLossPriors

    async def destination(self, spec: HandoffSpec) -> Any: ...
    async def _prepare(self, handoff: Handoff, scheme: Scheme, profile: str,
                       destination: Any) -> Prepared: ...
    def _make_transfer(self, handoff: Handoff, prepared: Prepared, scheme: Scheme, profile: str,
                       destination: Any, link: Any = None) -> Any: ...
    async def _stream(self, handoff: Handoff, transfer: Any, destination: Any) -> None: ...
    def _report_transfer(self, handoff: Handoff, transfer: Any, prepared: Prepared) -> float | None: ...

__all__ = ["MAX_FANOUT", "check_receivers", "run_unicast_fanout"]

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
        "recovered_utility": report.get("recovered_utility"),
        "decoded_symbols": report.get("decoded_symbols"),
        "n_source": report.get("n_source"),
        "start": report.get("start"),
        "ttft_s": report.get("ttft_s"),
        "precision": report.get("received_precision") or report.get("precision"),
        "answer": report.get("answer"),
        "bytes_sent": report.get("bytes_sent"),
        "source_sent": report.get("source_sent"),
        "repair_sent": report.get("repair_sent"),
        "failure": report.get("failure"),
    }


async def run_unicast_fanout(daemon: FanoutHost, handoff: Handoff, scheme: Scheme,
                             profile: str) -> tuple[str, float | None]:
    """Prepare once, stream to every receiver at once on one uplink clock, and report per receiver.
    Returns (the outcome: done when every receiver's handoff is, the mean recovered utility)."""
    spec = handoff.spec
    # One plan for the group: never a split (the planner may still choose the precision mix).
    mode = "handoff" if spec.handoff_mode in (AUTO, "split") else spec.handoff_mode
    spec = replace(spec, handoff_mode=mode)
    destinations = [await daemon.destination(replace(spec, receiver=r, destination=None))
                    for r in spec.receivers]
    handoff.spec = spec
    prepared = await daemon._prepare(handoff, scheme, profile, destinations[0])
    handoff.prepared = prepared
    rate_bps = (spec.rate_mbps or daemon.rate_mbps) * 1e6
    budget = LinkBudget.for_plan(prepared.plan, rate_bps, daemon.owd_s, spec.rho, spec.deadline_ms)
    # One transmit clock (and, under path control, one controller) for the uplink every session shares.
    uplink = destinations[0].address
    link = daemon.links.link_for(uplink, budget, daemon.path_loss.prior(uplink))
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
    first = children[0].report
    report = handoff.report
    report.update({key: first[key] for key in (
        "scheme", "n_tokens", "n_blocks", "n_source", "symbol_size", "kv_bytes", "precision", "stream_bytes",
        "precision_mix", "handoff_mode", "rate_mbps", "t_ser_ms", "deadline_ms", "rho", "prefill_s",
        "profile", "mode") if key in first})
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
