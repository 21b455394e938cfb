"""Fan-out, multicast (issue 37 item 3): one coded stream, sealed once, to a group destination.

``POST /handoffs`` with ``receivers`` and ``fanout: multicast`` runs here, after the one preparation
(:mod:`pfec.sender.fanout`): a fresh group ticket (:mod:`pfec.common.wire.group`), a unicast session per
member (:class:`pfec.sender.transport.fanout.member.MemberLink`: the OFFER carries the ticket, its ACKs
and RESULT come back under the member's own keys), and one
:class:`pfec.sender.transport.fanout.group.GroupSession` whose datagrams go once each to the group
destination: an IPv4 multicast group (the kernel replicates), or an address that plays the site's
multicast (a relay that copies each datagram to every member).

Every datagram of the group, and of a dropped member's unicast fallback, paces on one transmit clock of
the uplink (``LinkClock``, shared with the daemon's other handoffs at that rate): the group's rate is what
the uplink carries, never one stream per member. The group waits for every member's ACCEPT (at most
``JOIN_WAIT_FRACTION`` of the deadline) before its first datagram. A member the group drops (its loss
above ``GroupConfig.max_member_loss``, or silent) gets a CLOSE, then its own unicast handoff over the same
prepared symbols for the time left, or, with less than ``MIN_UNICAST_S`` left, nothing: its report entry
says ``compute_locally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

from pfec.common.node.metrics import TYPE_BYTE_LABELS
from pfec.common.node.multicast import group_key, send_socket
from pfec.common.plan.deadline import repair_cap, repair_fraction
from pfec.common.plan.handoff import ResultApp
from pfec.common.sched.policies import Scheme
from pfec.common.wire.frames import peek_header
from pfec.common.wire.group import GroupTicket, group_sealer
from pfec.common.wire.messages import ParseError, Role
from pfec.common.wire.seal import PacketProtector, keyring_for
from pfec.sender.handoffs import Handoff, receiver_fields, result_report
from pfec.sender.kv import Prepared
from pfec.sender.transport.fanout.group import GroupConfig, GroupDone, GroupSession, MemberDropped
from pfec.sender.transport.fanout.member import MemberLink
from pfec.sender.transport.session_types import SenderConfig
from pfec.sender.transport.transfer import LinkBudget, decoder_span_for, first_flight

__all__ = ["MIN_UNICAST_S", "GroupRun"]

log = logging.getLogger("pfec.sender")
clock = time.monotonic
GROUP_WINDOW = 64  # widest repair window of the group (dense over the needy members' union)
JOIN_WAIT_FRACTION = 0.25  # of the deadline: the group starts without a member that has not accepted
MIN_UNICAST_S = 0.02  # a dropped member's fallback needs at least this much of the deadline left
TICK_S = 0.002  # the driver's longest sleep (ACK processing wakes it sooner)
MAX_BACKLOG_S = 0.005  # missed link time a late wake-up may catch up on (as sender/pacer.py)
MAX_PER_WAKE = 256


@dataclass
class Fallback:
    """A dropped member's own unicast handoff (or why it has none)."""

    reason: str
    handoff: Handoff | None = None
    transfer: Any = None
    task: asyncio.Task[None] | None = None


class GroupRun:
    """One multicast fan-out on the wire: the group socket, the members' sessions, the pacing loop.
    ``host``: the sender daemon (``sender.fanout.FanoutHost``); ``link``: the uplink's transmit clock."""

    def __init__(self, host: Any, handoff: Handoff, prepared: Prepared, scheme: Scheme, profile: str,
                 destinations: list[Any], group: str, budget: LinkBudget, link: Any,
                 interface: str | None = None, ttl: int = 1) -> None:
        self.host, self.handoff, self.prepared = host, handoff, prepared
        self.scheme, self.profile, self.destinations = scheme, profile, destinations
        self.group = group
        self.group_addr = group_key(group)
        self.budget = budget
        self.link = link
        self.interface, self.ttl = interface, ttl
        spec = handoff.spec
        self.ticket = GroupTicket.fresh(secrets.randbits(63) | 1)
        symbol_size = prepared.plan.symbol_size
        fraction = host.repair_budget if spec.repair_budget is None else repair_fraction(spec.repair_budget)
        n_source = len(prepared.queue)
        self.repair_budget = repair_cap(fraction, n_source, budget.deadline_s, budget.slot_s)
        self.sealer = group_sealer(self.ticket, symbol_size)
        _app, blob = host._offer_blob(spec, prepared, scheme, profile, self.ticket)
        self.member_config = SenderConfig(
            budget_s=budget.deadline_s, slot_s=budget.slot_s, owd_s=budget.owd_s, repair_budget=0,
            fingerprint=host.fingerprint, window_cap=GROUP_WINDOW, app_blob=blob, rate_bps=budget.rate_bps,
            result_wait_s=host.result_wait_s + (30.0 if _app.generate else 0.0),
            first_flight=first_flight(budget), decoder_span=decoder_span_for(budget, GROUP_WINDOW, n_source),
            handshake_timeout_s=min(3.0, max(budget.deadline_s, 0.05)),
        )
        self.session: GroupSession | None = None
        self.members: list[MemberLink] = []
        self.by_sid: dict[int, MemberLink] = {}
        self.fallbacks: dict[int, Fallback] = {}
        self.sock: socket.socket | None = None
        self.bytes_sent = 0  # every byte this run put on the uplink (group and unicast), not the fallbacks
        self.group_bytes = 0
        self.socket_errors = 0
        self._wake = asyncio.Event()
        self.started_at: float | None = None
        self.deadline = 0.0
        self.done_reason: str | None = None

    # ------------------------------------------------------------------ the run
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.sock = send_socket(self.group, self.interface, self.ttl, self.host.sndbuf)
        loop.add_reader(self.sock.fileno(), self._on_readable)
        try:
            await self._run(loop)
        finally:
            loop.remove_reader(self.sock.fileno())
            self._flush_members()
            await asyncio.sleep(0.05)  # the CLOSEs leave, late datagrams are absorbed
            self.sock.close()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        prepared, budget = self.prepared, self.budget
        group = GroupSession(self.sealer, prepared.symbols, GroupConfig(
            budget_s=budget.deadline_s, owd_s=budget.owd_s, repair_budget=self.repair_budget,
            window_cap=GROUP_WINDOW), [f"{d.address}" for d in self.destinations])
        self.session = group
        now = clock()
        self.deadline = now + budget.deadline_s
        keyring = keyring_for(bytes(self.host.psk), True)
        for i, _destination in enumerate(self.destinations):
            sid = secrets.randbits(64) or 1
            protector = PacketProtector(keyring, sid, Role.SENDER, prepared.plan.symbol_size)
            member = MemberLink(i, sid, self.member_config, group.encoder, protector)
            member.start(now, self.deadline, budget.slot_s)
            self.members.append(member)
            self.by_sid[sid] = member
        self.handoff.state = "streaming"
        join_by = now + JOIN_WAIT_FRACTION * budget.deadline_s
        while True:
            now = clock()
            self._timers(now)
            joined = all(m.state != "offered" for m in self.members)
            if self.started_at is None and (joined or now >= join_by):
                self._start_group(now)
            self._flush_members()
            if self.started_at is not None:
                self._pump(now)
            self._events(now)
            if self._finished():
                break
            await self._sleep(loop, now)
        fallbacks = [f.task for f in self.fallbacks.values() if f.task is not None]
        if fallbacks:
            await asyncio.gather(*fallbacks, return_exceptions=True)

    def _start_group(self, now: float) -> None:
        group = self.session
        assert group is not None
        self.started_at = now
        left = self.deadline - now
        if left <= self.budget.owd_s:
            for m in self.members:
                m.close("no time left for the group stream")
            self.done_reason = "no time left"
            return
        group.config = replace(group.config, budget_s=left)
        group.start(now)
        for m in self.members:
            if m.state != "accepted":  # refused, or no ACCEPT yet: the group goes without it
                group.drop_member(m.index, m.failure or "no ACCEPT before the group started", now)
        self.link.next_send = max(self.link.next_send, now)

    def _pump(self, now: float) -> None:
        group, link, sock = self.session, self.link, self.sock
        assert group is not None and sock is not None
        if link.next_send < now - MAX_BACKLOG_S:
            link.next_send = now - MAX_BACKLOG_S
        sent = sources = source_bytes = repairs = repair_bytes = 0
        while link.next_send <= now and sent < MAX_PER_WAKE:
            datagram = group.next_datagram(now)
            if datagram is None:
                break
            if self._send(datagram, self.group_addr):
                kind = TYPE_BYTE_LABELS.get(datagram[1])
                if kind == "source":
                    sources += 1
                    source_bytes += len(datagram)
                elif kind == "repair":
                    repairs += 1
                    repair_bytes += len(datagram)
                else:  # the group's DONE: rare
                    self._count(datagram)
            self.group_bytes += len(datagram)
            link.next_send += len(datagram) * 8 / link.pacing_bps
            sent += 1
        # The node's datagram counters, once per wake-up as the pacer counts a unicast session's: a dashboard
        # sees a multicast handoff too.
        if sources:
            self.host.metrics.datagrams_sent("source", sources, source_bytes)
        if repairs:
            self.host.metrics.datagrams_sent("repair", repairs, repair_bytes)

    def _send(self, datagram: bytes, address: Any) -> bool:
        """Whether the socket took the datagram (a full buffer or an ICMP error: the FEC and the retries
        cover it, and it counts in ``socket_errors``)."""
        assert self.sock is not None
        try:
            self.sock.sendto(datagram, address)
        except OSError:
            self.socket_errors += 1
            return False
        self.bytes_sent += len(datagram)
        return True

    def _count(self, datagram: bytes) -> None:
        """One datagram the socket took, by its type byte (ours: always a whole header)."""
        self.host.metrics.datagrams_sent(TYPE_BYTE_LABELS.get(datagram[1], "source"), 1, len(datagram))

    def _flush_members(self) -> None:
        for member, destination in zip(self.members, self.destinations, strict=True):
            for datagram in member.datagrams_to_send():  # handshakes, CLOSEs: a few per member
                if self._send(datagram, destination.sockaddr):
                    self._count(datagram)

    def _on_readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        for _ in range(64):
            try:
                data, _addr = sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.socket_errors += 1
                continue
            try:
                sid = peek_header(data).session_id
            except ParseError:
                continue
            member = self.by_sid.get(sid)
            if member is None:
                continue
            ack = member.receive(data, clock())
            if ack is not None and self.session is not None and self.started_at is not None:
                self.session.on_ack(member.index, ack, clock())
        self._wake.set()

    def _timers(self, now: float) -> None:
        for m in self.members:
            due = m.get_timer()
            if due is not None and now >= due:
                m.handle_timer(now)
        group = self.session
        if group is not None and self.started_at is not None:
            due = group.get_timer()
            if due is not None and now >= due:
                group.handle_timer(now)

    def _events(self, now: float) -> None:
        group = self.session
        if group is None:
            return
        while (event := group.next_event()) is not None:
            if isinstance(event, MemberDropped):
                self._drop(event.member, event.reason, now)
            elif isinstance(event, GroupDone):
                self.done_reason = event.reason
                self.handoff.state = "draining"
                for m in self.members:
                    m.stopped(now)

    def _drop(self, index: int, reason: str, now: float) -> None:
        """The group dropped member ``index``: CLOSE its group session; its own unicast handoff for the
        time left, or none (it computes locally)."""
        member = self.members[index]
        if index in self.fallbacks or member.state == "done":
            return
        member.close(f"dropped from the group: {reason}")
        left = self.deadline - now
        fallback = self.fallbacks[index] = Fallback(reason)
        if left < MIN_UNICAST_S + 2 * self.budget.owd_s or self.host.shutting_down:
            return
        host, spec = self.host, self.handoff.spec
        destination = self.destinations[index]
        child_spec = replace(spec, receiver=spec.receivers[index], destination=destination, receivers=(),
                             fanout="unicast", deadline_ms=1000 * left, rho=None)
        child = Handoff(f"{self.handoff.id}.{index}", child_spec, time.time())
        child.prepared = self.prepared
        try:
            transfer = host._make_transfer(child, self.prepared, self.scheme, self.profile, destination,
                                           self.link)
        except ValueError as exc:
            log.info("handoff %s: no unicast fallback for receiver %d: %s", self.handoff.id, index, exc)
            return
        fallback.handoff, fallback.transfer = child, transfer
        fallback.task = asyncio.get_running_loop().create_task(host._stream(child, transfer, destination))
        fallback.task.add_done_callback(lambda _t: self._wake.set())

    def _finished(self) -> bool:
        # Every member's session ended (its fallback, if any, is awaited after the loop).
        return not any(m.state in ("offered", "accepted") for m in self.members)

    async def _sleep(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        due = now + TICK_S
        group = self.session
        if self.started_at is not None and group is not None and group.phase.sends:
            due = min(due, max(self.link.next_send, now + 0.0005))
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, due - now))

    def cancel(self, reason: str) -> None:
        for m in self.members:
            m.close(reason)
        for f in self.fallbacks.values():
            if f.transfer is not None:
                f.transfer.cancel(reason)
        self._flush_members()

    # ------------------------------------------------------------------ the report
    def entries(self) -> tuple[list[dict[str, Any]], list[float]]:
        """Per receiver: its outcome and what its RESULT said (or its fallback's); the utilities."""
        entries, utilities = [], []
        for i, member in enumerate(self.members):
            receiver = self.handoff.spec.receivers[i]
            entry: dict[str, Any] = {"receiver": f"{receiver[0]}:{receiver[1]}", "carried": "group",
                                     "session_id": f"{member.session_id:016x}",
                                     "unicast_bytes": None, "failure": member.failure}
            fallback = self.fallbacks.get(i)
            if fallback is not None:
                entry["dropped"] = fallback.reason
                if fallback.handoff is None:
                    entry.update(outcome="compute_locally", carried="none")
                    entries.append(entry)
                    continue
                utility = self.host._report_transfer(fallback.handoff, fallback.transfer, self.prepared)
                report = fallback.handoff.report
                entry.update(receiver_fields(report), outcome=fallback.transfer.outcome, carried="unicast",
                             session_id=report.get("session_id"),
                             unicast_bytes=fallback.transfer.bytes_sent, failure=report.get("failure"))
                if utility is not None:
                    utilities.append(utility)
                entries.append(entry)
                continue
            entry["outcome"] = "done" if member.state == "done" else "failed"
            if member.result is not None:
                try:
                    result = ResultApp.decode(member.result)
                except ValueError as exc:
                    entry.update(outcome="failed", failure=str(exc))
                else:
                    section, utility = result_report(result, self.prepared)
                    entry.update(receiver_fields(section))
                    if result.error:
                        entry.update(outcome="failed", failure=f"receiver failed: {result.error}")
                    elif utility is not None:
                        utilities.append(utility)
            entries.append(entry)
        return entries, utilities

    def fallback_bytes(self) -> int:
        return sum(f.transfer.bytes_sent for f in self.fallbacks.values() if f.transfer is not None)

