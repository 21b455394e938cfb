"""Sender daemon: holds the model, prepares each handoff in a worker thread, and drives one ``SenderSession``
(sans-IO) per handoff over its own connected UDP socket, paced to the link rate.

Pacing follows the link's clock (``LinkClock``, shared by concurrent handoffs: they share the uplink):
a datagram may leave once the link time of the datagrams before it (8L/C each) has passed. Each
wake-up sends every datagram whose slot has come, then sleeps with ``loop.call_at`` until the next slot
but at least ``MIN_SLEEP_S`` (timer granularity is ~1 ms; at 100 Mbit/s a slot is ~100 us, so
per-packet timers would be far too coarse). A late wake-up (a busy loop, a descheduled process) catches
up on missed slots, at most ``MAX_BACKLOG_S`` of them: the average rate stays the link's, as the
simulator assumes, while the queue this can build downstream stays a few milliseconds long. When the
session has nothing to send (it waits for feedback) the pacer idles until an ACK or a session timer
wakes it; idle slots are not saved up.

The datagrams of one wake-up leave together: runs of equal-sized datagrams go out as one UDP GSO send
(``UDP_SEGMENT``, Linux >= 4.18: the kernel cuts the buffer into datagrams), one system call for up to
``GSO_MAX_SEGMENTS`` of them instead of one each, which is most of a datagram's CPU on the send side.
Without GSO (another kernel, an error) each datagram goes through the transport as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pfec.common.events import CpuMeter
from pfec.common.plan.deadline import (
    DEFAULT_RATE_MBPS,
    DEFAULT_REPAIR_BUDGET,
    DEFAULT_RHO,
    budget_seconds,
    rho_of,
    serialisation_s,
    slot_seconds,
)
from pfec.common.plan.handoff import (
    ModelIdentity,
    OfferApp,
    ResultApp,
    default_profile_name,
    recovered_utility,
    unpack_bits,
)
from pfec.common.sched.policies import get_scheme
from pfec.common.wire.frames import MsgType, PacketProtector, Role
from pfec.receiver.daemon import set_buffers
from pfec.sender.kv import ContextInput, Prepared, full_kv_answer, prepare_model, prepare_synthetic
from pfec.sender.metrics import SenderMetrics
from pfec.sender.repair_plan import warm_up as transport_warm_up
from pfec.sender.session import (
    Accepted,
    Failed,
    Refused,
    ResultReceived,
    SenderConfig,
    SenderSession,
    SendingStopped,
    SourceInfo,
)

log = logging.getLogger("pfec.sender")
clock = time.monotonic  # the loop's clock base at full resolution (uvloop's loop.time() steps in ms)
MAX_BACKLOG_S = 0.005  # missed link time a late wake-up may catch up on (bounds the queue it builds)
MIN_SLEEP_S = 0.0005
MAX_PER_WAKE = 256  # datagrams per wake-up before yielding to the loop (ACKs must get in)
GSO_MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS
GSO_MAX_BYTES = 65000  # one GSO send is one UDP datagram to the stack: 16-bit length
UDP_SEGMENT = 103  # linux/udp.h; Python's socket module does not export it
LINGER_S = 0.1  # keep the socket after the end so the CLOSE leaves and late datagrams are absorbed
_TYPE_NAMES = {int(t): t.name.lower() for t in MsgType}
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


def _buffered(transport: asyncio.DatagramTransport) -> int:
    """Bytes the transport still queues (uvloop and asyncio both have it; typeshed lacks it)."""
    size: Callable[[], int] | None = getattr(transport, "get_write_buffer_size", None)
    return size() if size is not None else 0


class _SocketProtocol(asyncio.DatagramProtocol):
    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transfer.guarded(self.transfer.on_datagram, data)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable: the receiver is not there (yet)
        self.transfer.socket_errors += 1


@dataclass
class LinkClock:
    """The link's transmit clock, shared by every transfer paced at this rate (one uplink, one budget):
    ``next_send`` is when the link is free for the next datagram."""

    rate_bps: float
    next_send: float = 0.0


class Transfer:
    """One handoff on the wire: session + connected socket + pacer + timer."""

    def __init__(self, daemon: SenderDaemon, handoff: Handoff, session: SenderSession, link: LinkClock,
                 owd_s: float) -> None:
        self.daemon = daemon
        self.handoff = handoff
        self.session = session
        self.link = link
        self.owd_s = owd_s
        self.metrics = daemon.metrics
        self.cpu = session.cpu
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.DatagramTransport | None = None
        self._sock: socket.socket | None = None
        self._gso = False  # the kernel segments batched sends (probed at open)
        self._batch: list[bytes] = []
        self.socket_errors = 0
        self.bytes_sent = 0
        self.last_data_at: float | None = None
        self.stopped_at: float | None = None
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self._pump_handle: asyncio.Handle | None = None
        self._idle = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._drops_seen: dict[str, int] = {}
        self.result: ResultApp | None = None
        self.failure: str | None = None
        self.outcome = "failed"

    async def open(self, addr: tuple[str, int], sndbuf: int) -> None:
        infos = await self.loop.getaddrinfo(addr[0], addr[1], type=socket.SOCK_DGRAM)
        if not infos:
            raise OSError(f"cannot resolve receiver address {addr[0]!r}")
        family, _type, _proto, _canon, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            set_buffers(sock, sndbuf, sndbuf)
            sock.setblocking(False)
            sock.connect(sockaddr)
        except OSError:
            sock.close()
            raise
        self.transport, _ = await self.loop.create_datagram_endpoint(lambda: _SocketProtocol(self), sock=sock)
        self._sock = sock
        try:
            sock.getsockopt(socket.IPPROTO_UDP, UDP_SEGMENT)
            self._gso = True
        except OSError:
            self._gso = False

    def guarded(self, step: Any, *args: Any) -> None:
        """Run one adapter step; a bug in it fails this handoff (reported), never the daemon or the loop."""
        try:
            step(*args)
        except Exception as exc:
            log.exception("handoff %s: internal error", self.handoff.id)
            self.failure = f"internal error: {type(exc).__name__}: {exc}"
            self.outcome = "failed"
            for handle in (self._pump_handle, self._timer):
                if handle is not None:
                    handle.cancel()
            self._pump_handle = self._timer = None
            if not self.finished.done():
                self.finished.set_result(None)

    # ------------------------------------------------------------------ pacing
    def start(self) -> None:
        now = clock()
        self.session.start(now)
        self.link.next_send = max(self.link.next_send, now)
        self._pump()

    def _wake_pump(self) -> None:
        if self._idle and self._pump_handle is None:
            self._idle = False
            self.link.next_send = max(self.link.next_send, clock())  # unused slots are gone
            self._pump_handle = self.loop.call_soon(self.guarded, self._pump)

    def _pump(self) -> None:
        self._pump_handle = None
        transport = self.transport
        if transport is None:
            return
        now = clock()
        link = self.link
        if link.next_send < now - MAX_BACKLOG_S:
            link.next_send = now - MAX_BACKLOG_S
        session = self.session
        cpu = self.cpu
        rate = link.rate_bps
        batch = self._batch
        sent = 0
        while link.next_send <= now and sent < MAX_PER_WAKE:
            decisions = cpu.decisions if cpu is not None else 0
            policy_ns = cpu.policy_ns if cpu is not None else 0
            datagram = session.next_datagram(now)
            if cpu is not None and cpu.decisions != decisions:
                view = session.view
                self.metrics.scheduler_decision((cpu.policy_ns - policy_ns) * 1e-9, view.window_size,
                                                view.deficit_estimate)
            if datagram is None:
                self._idle = True
                break
            batch.append(datagram)
            link.next_send += len(datagram) * 8 / rate
            sent += 1
        if batch:
            self._send_batch(transport, batch, now)
            batch.clear()
        self._service()
        if not self._idle and self._pump_handle is None and self.transport is not None:
            at = max(link.next_send, now + MIN_SLEEP_S) if sent < MAX_PER_WAKE else now
            if at > now:
                self._pump_handle = self.loop.call_at(at, self.guarded, self._pump)
            else:
                self._pump_handle = self.loop.call_soon(self.guarded, self._pump)

    def _send_batch(self, transport: asyncio.DatagramTransport, batch: list[bytes], now: float) -> None:
        """Send a wake-up's datagrams in order: runs of equal size as GSO sends, the rest one by one."""
        i, n = 0, len(batch)
        while i < n:
            size = len(batch[i])
            j = i + 1
            limit = min(n, i + GSO_MAX_SEGMENTS, i + max(1, GSO_MAX_BYTES // size))
            while j < limit and len(batch[j]) == size:
                j += 1
            if j - i > 1 and self._gso and not _buffered(transport):
                sent = self._send_gso(transport, batch, i, j, size)
            else:
                sent = sum(self._send_one(transport, batch[k]) for k in range(i, j))
            if sent:
                self._count_sent(batch[i][1], sent, size * sent, now)
            i = j

    def _send_gso(self, transport: asyncio.DatagramTransport, batch: list[bytes], i: int, j: int,
                  size: int) -> int:
        """Datagrams ``batch[i:j]`` (all ``size`` bytes) in one GSO send; returns how many left."""
        assert self._sock is not None
        try:
            self._sock.sendmsg([b"".join(batch[i:j])],
                               [(socket.IPPROTO_UDP, UDP_SEGMENT, size.to_bytes(2, "little"))])
            return j - i
        except BlockingIOError:  # socket buffer full: the transport queues them, in order
            pass
        except OSError as exc:  # no GSO after all (EIO, EINVAL...): datagram by datagram from now on
            log.info("UDP GSO send failed (%s); sending datagrams one by one", exc)
            self._gso = False
        return sum(self._send_one(transport, batch[k]) for k in range(i, j))

    def _send_one(self, transport: asyncio.DatagramTransport, datagram: bytes) -> int:
        try:
            transport.sendto(datagram)
        except OSError:
            self.metrics.dropped("send_failed")
            return 0
        return 1

    def _count_sent(self, type_byte: int, count: int, nbytes: int, now: float) -> None:
        kind = _TYPE_NAMES.get(type_byte, "source")
        self.metrics.datagrams_sent(kind, count, nbytes)
        self.bytes_sent += nbytes
        if kind in ("source", "repair"):
            self.last_data_at = now

    # ------------------------------------------------------------------ feedback and timers
    def on_datagram(self, data: bytes) -> None:
        now = clock()
        kind = _TYPE_NAMES.get(data[1]) if len(data) > 1 else None
        if kind is not None:
            self.metrics.datagram_received(kind, len(data))
        self.session.receive_datagram(data, now)
        self._wake_pump()
        self._service()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.session.handle_timer(clock())
        self._wake_pump()
        self._service()

    def _service(self) -> None:
        while (event := self.session.next_event()) is not None:
            self._on_event(event)
        self._export_drops()
        at = self.session.get_timer()
        if at != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._timer_at = at
            if at is not None:
                self._timer = self.loop.call_at(at, self.guarded, self._on_timer)

    def _export_drops(self) -> None:
        drops = self.session.drops
        if drops == self._drops_seen:
            return
        for reason, count in drops.items():
            delta = count - self._drops_seen.get(reason, 0)
            if delta:
                self.metrics.dropped(reason, delta)
        self._drops_seen = dict(drops)

    def _on_event(self, event: Any) -> None:
        if isinstance(event, Accepted):
            self.handoff.report["accepted"] = True
        elif isinstance(event, SendingStopped):
            self.stopped_at = clock()
            self.handoff.state = "draining"
        elif isinstance(event, ResultReceived):
            try:
                self.result = ResultApp.decode(event.app_blob)
                if self.result.error:
                    self.failure = f"receiver failed: {self.result.error}"
                else:
                    self.outcome = "done"
            except ValueError as exc:
                self.failure = str(exc)
            self._finish()
        elif isinstance(event, Refused):
            self.outcome = "refused"
        elif isinstance(event, Failed):
            self.failure = event.reason
            self._finish()

    def _finish(self) -> None:
        if self.finished.done():
            return
        self._idle = False
        if self._pump_handle is None:  # send what the session queued last (the CLOSE after a RESULT)
            self._pump_handle = self.loop.call_soon(self.guarded, self._pump)
        self.finished.set_result(None)

    def cancel(self, reason: str) -> None:
        """Give up now: the session queues a CLOSE for the receiver and reports the failure."""
        self.session.cancel(reason, clock())
        self.outcome = "cancelled"
        self._service()

    async def close(self) -> None:
        await asyncio.sleep(LINGER_S)
        for handle in (self._pump_handle, self._timer):
            if handle is not None:
                handle.cancel()
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class SenderDaemon:
    """Handoffs by id; the model (if any) is used from one worker thread."""

    HANDOFFS_KEPT = 256

    def __init__(
        self,
        identity: ModelIdentity,
        psk: bytes,
        *,
        runtime: Any = None,
        rate_mbps: float = DEFAULT_RATE_MBPS,
        owd_ms: float = 10.0,
        scheme: str = "heuristic",
        window_cap: int = 64,
        repair_budget: float = DEFAULT_REPAIR_BUDGET,
        sndbuf: int = 8 << 20,
        metrics: SenderMetrics | None = None,
        result_wait_s: float = 2.0,
    ) -> None:
        get_scheme(scheme)
        transport_warm_up()  # numba kernels compiled before any datagram, not mid-handoff
        self.identity = identity
        self.psk = psk
        self.runtime = runtime
        self.fingerprint = identity.fingerprint()
        self.rate_mbps = rate_mbps
        self.owd_s = owd_ms / 1000.0
        self.scheme = scheme
        self.window_cap = window_cap
        self.repair_budget = repair_budget
        self.sndbuf = sndbuf
        self.result_wait_s = result_wait_s
        self.metrics = metrics or SenderMetrics(process_metrics=False)
        self.handoffs: dict[str, Handoff] = {}
        self.default_profile = default_profile_name(identity)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pfec-prefill")
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self.transfers: set[Transfer] = set()
        self._links: dict[float, LinkClock] = {}  # one transmit clock per pacing rate

    # ------------------------------------------------------------------ API
    def submit(self, spec: HandoffSpec) -> Handoff:
        if spec.scheme is not None:
            get_scheme(spec.scheme)
        handoff = Handoff(f"h{next(self._ids):06d}-{secrets.token_hex(3)}", spec, time.time())
        self.handoffs[handoff.id] = handoff
        while len(self.handoffs) > self.HANDOFFS_KEPT:
            oldest = next(iter(self.handoffs))
            if not self.handoffs[oldest].done.is_set():
                break
            del self.handoffs[oldest]
        task = asyncio.get_running_loop().create_task(self._run(handoff))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handoff

    async def close(self) -> None:
        """Cancel what is in flight: each receiver gets a CLOSE, so it frees the session at once."""
        for transfer in list(self.transfers):
            transfer.cancel("sender shutting down")
        if self.transfers:
            await asyncio.sleep(LINGER_S)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        self._executor.shutdown(wait=False, cancel_futures=True)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "role": "sender",
            "model": self.identity.model_id,
            "fingerprint": self.fingerprint.hex()[:16],
            "active_handoffs": len(self.transfers),
            "handoffs": len(self.handoffs),
        }

    # ------------------------------------------------------------------ one handoff
    async def _run(self, handoff: Handoff) -> None:
        started = clock()
        self.metrics.handoff_started()
        outcome, utility = "failed", None
        try:
            outcome, utility = await self._run_inner(handoff)
        except asyncio.CancelledError:
            handoff.report["failure"] = "cancelled (daemon shutting down)"
            outcome = "cancelled"
            raise
        except Exception as exc:  # a handoff's failure must never take the daemon down
            log.exception("handoff %s failed", handoff.id)
            handoff.report["failure"] = f"{type(exc).__name__}: {exc}"
        finally:
            handoff.state = "done" if outcome == "done" else "failed"
            handoff.report["outcome"] = outcome
            handoff.report["duration_s"] = round(clock() - started, 6)
            self.metrics.handoff_finished(outcome, clock() - started, utility)
            handoff.prepared = None  # free the KV
            handoff.done.set()

    async def _run_inner(self, handoff: Handoff) -> tuple[str, float | None]:
        spec = handoff.spec
        scheme = get_scheme(spec.scheme or self.scheme)
        profile = spec.profile or self.default_profile
        loop = asyncio.get_running_loop()
        if self.runtime is None and spec.inputs.synthetic_tokens is None:
            raise ValueError("this sender runs without a model: give synthetic_tokens")
        if self.runtime is not None and spec.inputs.synthetic_tokens is None:
            prepared = await loop.run_in_executor(
                self._executor, prepare_model, self.runtime, self.identity, spec.inputs, scheme.order,
                profile, spec.full_kv_answer, spec.max_new_tokens,
            )
            self.metrics.prefill_done(prepared.prefill_s)
        else:
            assert spec.inputs.synthetic_tokens is not None
            prepared = await loop.run_in_executor(
                self._executor, prepare_synthetic, self.identity, spec.inputs.synthetic_tokens,
                scheme.order, profile, secrets.randbits(32), spec.inputs.question_ids or (),
            )
        handoff.prepared = prepared
        transfer = self._make_transfer(handoff, prepared, scheme.name, profile)

        self.transfers.add(transfer)
        try:
            await transfer.open(spec.receiver, self.sndbuf)
            handoff.state = "streaming"
            transfer.guarded(transfer.start)
            await transfer.finished
        finally:
            self.transfers.discard(transfer)
            closing = loop.create_task(transfer.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        utility = self._report_transfer(handoff, transfer, prepared)
        if spec.full_kv_answer and self.runtime is not None and prepared.cache is not None:
            handoff.report["full_kv_answer"] = await loop.run_in_executor(
                self._executor, full_kv_answer, self.runtime, prepared, spec.max_new_tokens
            )
        return transfer.outcome, utility

    def _make_transfer(self, handoff: Handoff, prepared: Prepared, scheme_name: str,
                       profile: str) -> Transfer:
        spec = handoff.spec
        plan = prepared.plan
        rate_bps = (spec.rate_mbps or self.rate_mbps) * 1e6
        t_ser = serialisation_s(plan.kv_bytes, rate_bps)
        budget = budget_seconds(t_ser, self.owd_s, spec.rho, spec.deadline_ms)
        n_source = plan.n_fragments
        app = OfferApp(plan.n_tokens, prepared.question_ids, spec.mode, profile,
                       get_scheme(scheme_name).order, spec.max_new_tokens, self.identity.model_id,
                       spec.generate and self.runtime is not None)
        budget_frac = self.repair_budget if spec.repair_budget is None else spec.repair_budget
        config = SenderConfig(
            budget_s=budget,
            slot_s=slot_seconds(plan.symbol_size, rate_bps),
            owd_s=self.owd_s,
            repair_budget=round(budget_frac * n_source),
            fingerprint=self.fingerprint,
            window_cap=self.window_cap,
            app_blob=app.encode(),
            rate_bps=rate_bps,
            result_wait_s=self.result_wait_s + (30.0 if app.generate else 0.0),
        )
        sid = secrets.randbits(64)
        session = SenderSession(
            sid, config, prepared.symbols, get_scheme(scheme_name).make_policy(),
            PacketProtector(self.psk, sid, Role.SENDER, plan.symbol_size),
            SourceInfo(plan.fragment_block[prepared.queue], prepared.block_utility),
            CpuMeter(time.perf_counter_ns),
        )
        handoff.report.update({
            "scheme": scheme_name,
            "receiver": f"{spec.receiver[0]}:{spec.receiver[1]}",
            "session_id": f"{sid:016x}",
            "mode": spec.mode,
            "profile": profile,
            "n_tokens": plan.n_tokens,
            "n_blocks": plan.n_blocks,
            "n_source": n_source,
            "symbol_size": plan.symbol_size,
            "kv_bytes": plan.kv_bytes,
            "rate_mbps": rate_bps / 1e6,
            "t_ser_ms": round(t_ser * 1000, 3),
            "deadline_ms": round(budget * 1000, 3),
            "rho": round(rho_of(budget, self.owd_s, t_ser), 4),
            "prefill_s": round(prepared.prefill_s, 4),
        })
        link = self._links.setdefault(rate_bps, LinkClock(rate_bps))
        return Transfer(self, handoff, session, link, self.owd_s)

    def _report_transfer(self, handoff: Handoff, transfer: Transfer, prepared: Prepared) -> float | None:
        session = transfer.session
        report = handoff.report
        sent = session.datagrams_sent
        report.update({
            "source_sent": sent["source"],
            "repair_sent": sent["repair"],
            "control_sent": sent["control"],
            "bytes_sent": transfer.bytes_sent,
            "socket_errors": transfer.socket_errors,
            "drops": dict(session.drops),
            "decisions": session.cpu.decisions if session.cpu else None,
        })
        if session.cpu is not None:
            cpu = session.cpu
            report["session_cpu_ms"] = {"encode": cpu.encode_ns / 1e6, "feedback": cpu.feedback_ns / 1e6,
                                        "policy": cpu.policy_ns / 1e6}
        send_deadline = session.deadline - self.owd_s
        if transfer.last_data_at is not None:
            report["deadline_slack_ms"] = round((send_deadline - transfer.last_data_at) * 1000, 3)
        if transfer.failure is not None:
            report["failure"] = transfer.failure
        result = transfer.result
        if result is None:
            return None
        try:
            complete = unpack_bits(result.blocks_bitmap, prepared.plan.n_blocks)
            utility: float | None = recovered_utility(prepared.block_utility, complete)
        except ValueError as exc:  # the receiver failed before scoring (its error is the failure)
            utility = None
            report.setdefault("failure", f"receiver sent no usable block map: {exc}")
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
        return utility


# --------------------------------------------------------------------------- `pfec sender serve`


async def serve(config: Any, psk: bytes, token: str | None = None,
                ready: Callable[[SenderDaemon], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run a sender from a ``SenderDaemonConfig`` until SIGINT/SIGTERM (or ``stop``)."""
    from pfec.common.codec.fec import warm_up
    from pfec.common.node.control import ControlServer, sender_routes
    from pfec.common.plan.handoff import load_runtime
    from pfec.receiver.daemon import wait_for_signal

    warm_up()
    runtime, identity = await asyncio.get_running_loop().run_in_executor(
        None, load_runtime, config.model.path, config.model.device, config.model.cache_dir
    )
    daemon = SenderDaemon(
        identity, psk, runtime=runtime, rate_mbps=config.link.rate_mbps, owd_ms=config.link.owd_ms,
        scheme=config.fec.scheme, window_cap=config.fec.window_cap, repair_budget=config.fec.repair_budget,
        sndbuf=config.udp.sndbuf_bytes, metrics=SenderMetrics(),
    )
    control = ControlServer(sender_routes(daemon))
    await control.start(config.control.socket, config.control.tcp_address, token)
    metrics_runner = None
    if config.metrics.enabled:
        metrics_runner = await daemon.metrics.serve(config.metrics.host, config.metrics.port)
    log.info("sender ready: model %s, fingerprint %s", identity.model_id, daemon.fingerprint.hex()[:16])
    if ready is not None:
        ready(daemon)
    try:
        await wait_for_signal(stop)
    finally:
        await control.close()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await daemon.close()
