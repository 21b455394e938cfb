"""Receiver daemon: a thin asyncio adapter over ``ReceiverEndpoint`` (sans-IO) and ``Handoffs``; rebuild +
generation at each deadline run in a worker thread (``receiver/rebuild.py``).

- One UDP socket (large SO_RCVBUF; SO_RCVBUFFORCE as root) feeds ``endpoint.receive_datagram``; every
  reply goes to the address the session's OFFER came from. The socket is read directly (``add_reader``
  + ``recvmsg``) rather than through a datagram transport, for two reasons: UDP GRO (Linux >= 5.0)
  hands over a sender's GSO batch as one buffer with its segment size in a control message, one system
  call for many datagrams; and each wake-up reads at most ``READ_BATCH`` buffers before yielding, so a
  deadline timer never waits behind a drained socket buffer.
- One loop timer (``loop.call_at`` on the loop's monotonic clock, which is the sessions' ``now``) tracks
  ``endpoint.get_timer()``.
- Every endpoint event goes to ``Handoffs`` (``receiver/handoffs.py``): what each session means to this
  node, from its OFFER (application data, profile, a split's front) to its RESULT (rebuild and generation
  in the model worker at the deadline, or an error RESULT from the reaper, swept every ``REAP_EVERY_S``).
- Bounds before allocation: an OFFER's budget and size are checked in the endpoint's admission
  (``admission.admit``), before its session allocates a decoder.
- A multicast fan-out (issue 37 item 3): a session whose OFFER carries a group ticket joins the group
  in the endpoint (its datagrams come on the group stream, to this socket from a relay, or to a socket
  joined to each ``[udp] multicast_group``: ``start(groups=...)``); its ACKs and RESULT go back unicast.
- Model work (front prefill, rebuild, generation) runs on a ``ModelWorker`` with a bounded queue;
  ``readiness`` (the control API's ``/readyz``) turns red when a job runs past ``limits.worker_stuck_s``.

The control API is ``receiver/control.py``; ``receiver/serve.py`` runs it all (``pfec receiver serve``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pfec.common.codec import fec
from pfec.common.events import CpuMeter
from pfec.common.model.runtime import usable_cpus
from pfec.common.node.config import LimitsConfig
from pfec.common.node.metrics import MSG_TYPE_LABELS, TYPE_BYTE_LABELS, DropExporter
from pfec.common.node.multicast import is_multicast, join_socket
from pfec.common.node.openai.http import OpenAIFace
from pfec.common.node.profiles import ProfileStore
from pfec.common.node.udp import UDP_GRO, PeerAddress, enable_gro, open_udp_socket
from pfec.common.node.worker import ModelWorker
from pfec.common.plan.handoff import ModelIdentity, OfferApp
from pfec.common.plan.receiver_speed import RecentPrefills
from pfec.common.plan.utility import DEFAULT_PROFILE_DIR
from pfec.common.wire.messages import MsgType, Offer, RefuseCode
from pfec.receiver.admission import admit
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.handoffs import Handoffs, SessionInfo
from pfec.receiver.metrics import ReceiverMetrics
from pfec.receiver.node_speed import receive_path_s
from pfec.receiver.rebuild import Reconstructed
from pfec.receiver.session import OfferReceived, ReceiverConfig
from pfec.receiver.session import warm_up as session_warm_up

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime
    from pfec.common.model.speed import PrefillSpeed

log = logging.getLogger("pfec.receiver")
# The sessions' clock: the loop's monotonic clock at full resolution (uvloop's loop.time() has the same
# base but 1 ms steps; timers still fire through loop.call_at).
clock = time.monotonic
# Loop timers have 1 ms steps and may fire up to a step early. A session's deadline is armed TIMER_EARLY_S
# early and the rest polled (it starts generation: a late start costs TTFT); every other timer (ACKs,
# RESULT retries) fires up to TIMER_STEP_S late instead, so the loop never polls for them: on a node with one
# core the poll would take the CPU from the split's front prefill.
TIMER_EARLY_S = 0.0015
TIMER_STEP_S = 0.001
READ_BATCH = 32  # recvmsg calls per readable event before timers get their turn (each can be a GRO batch)
_GRO_CMSG_SPACE = socket.CMSG_SPACE(4)
_RECV_SIZE = 65535
REAP_EVERY_S = 0.5  # the reaper's sweep period (sessions past their deadline plus grace)
SPEED_STALE_S = 600.0  # a stated prefill speed older than this is measured again, once no session runs
_JUNK = 256  # slot of the receive counters for junk (unparseable or unauthentic datagrams)
_RX_LABELS = (*MSG_TYPE_LABELS.items(), (_JUNK, "junk"))


def timer_fires_at(at: float, deadline: float | None) -> float:
    """When the loop timer for the endpoint's next timer ``at`` goes off: ``TIMER_STEP_S`` after it (never
    before it, so it needs no poll), but no later than ``TIMER_EARLY_S`` before the earliest session
    deadline (``deadline``), whose last stretch is polled: an ACK due just before a deadline must not
    make that deadline late."""
    fires = at + TIMER_STEP_S
    return fires if deadline is None else min(fires, deadline - TIMER_EARLY_S)


@dataclass
class ReceiverStatsSnapshot:
    received: int = 0
    bytes_received: int = 0
    deadline_late_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class ReceiverDaemon:
    """All sessions of one receiver node on one UDP socket."""

    def __init__(
        self,
        identity: ModelIdentity,
        psk: bytes,
        *,
        runtime: ModelRuntime | None = None,
        session_config: ReceiverConfig | None = None,
        metrics: ReceiverMetrics | None = None,
        default_mode: str = "mask",
        limits: LimitsConfig | None = None,
        profiles: ProfileStore | None = None,
        worker: ModelWorker | None = None,
        face: OpenAIFace | None = None,
    ) -> None:
        fec.warm_up()  # codec kernels compiled before any datagram, not mid-handoff
        session_warm_up()  # and the split's filing kernel
        self.identity = identity
        self.runtime = runtime  # None: synthetic KV, no generation (transport benchmarks)
        self.fingerprint = identity.fingerprint()
        self.metrics = metrics or ReceiverMetrics(process_metrics=False)
        self.cpu = CpuMeter(time.perf_counter_ns)
        self.limits = limits or LimitsConfig()
        # The largest context an OFFER may carry: the configured bound and the model's own.
        self.max_tokens = self.limits.max_context_tokens
        if runtime is not None:
            self.max_tokens = min(self.max_tokens, int(runtime.max_context))
        self._max_plan = identity.plan(self.max_tokens)
        self.endpoint = ReceiverEndpoint(psk, self.fingerprint, session_config, admit=self._admit,
                                         cpu=self.cpu)
        self.stats = ReceiverStatsSnapshot()
        self._peers: dict[int, PeerAddress] = {}  # session id -> reply address (also pending refusals)
        self._sock: socket.socket | None = None
        self._group_socks: list[socket.socket] = []  # joined to the configured multicast groups
        self._gro = False
        self._rx_count = [0] * 257  # datagrams and bytes per wire type (+ junk), not yet exported
        self._rx_bytes = [0] * 257
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self.timer_polls = 0  # _on_timer calls that came before their timer and polled again
        self._service_pending = False
        # A node with both roles (pfec.node) passes the worker and face they share; close() shuts down only a
        # worker made here.
        self._own_worker = worker is None
        self.worker = worker or ModelWorker("pfec-generate", self.limits.worker_queue,
                                            self.limits.worker_stuck_s)
        # The OpenAI API on the control listeners, and its prefix cache store (handed-off contexts too).
        self.face = face if face is not None or runtime is None else OpenAIFace(
            runtime, self.worker, self.metrics, self.limits)
        self._drops = DropExporter(self.metrics)
        self.handoffs = Handoffs(
            self.endpoint, identity, runtime, worker=self.worker, metrics=self.metrics, limits=self.limits,
            profiles=profiles or ProfileStore(DEFAULT_PROFILE_DIR), max_tokens=self.max_tokens,
            default_mode=default_mode, peers=self._peers, late_s=self.stats.deadline_late_s, clock=clock,
            service=self._service, prefill_timed=self._on_prefill_timed, keep=self._keep_prefix,
        )
        self._reaper: asyncio.TimerHandle | None = None
        self.prefill_speed: PrefillSpeed | None = None  # what its ACCEPTs state (measure_prefill_speed)
        self.recent_prefills: RecentPrefills | None = None  # that speed, refitted over its recent prefills
        self.speed_measured_at: float | None = None
        self._measuring: asyncio.Task[PrefillSpeed | None] | None = None
        self._live_seen: tuple[int, int] = (-1, -1)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str, port: int, rcvbuf: int = 8 << 20, sndbuf: int = 8 << 20,
                    groups: Sequence[str] = (), interface: str | None = None) -> None:
        """Bind the data socket; join each IPv4 multicast group of ``groups`` (``[udp] multicast_group``;
        a unicast entry is a relay's address: its copies come to the data socket) on ``interface``."""
        self._loop = asyncio.get_running_loop()
        sock = open_udp_socket(host, port, rcvbuf, sndbuf)
        self._gro = enable_gro(sock)  # not Linux >= 5.0: one datagram per recvmsg
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._on_readable)
        try:
            for group in groups:
                if is_multicast(group):
                    joined = join_socket(group, interface, rcvbuf)
                    self._group_socks.append(joined)
                    self._loop.add_reader(joined.fileno(), self._on_readable, joined)
        except OSError as exc:
            await self.close()
            raise OSError(exc.errno, f"cannot join multicast group {group} on {interface or 'any'}: "
                          f"{exc.strerror}") from exc
        self._reaper = self._loop.call_later(REAP_EVERY_S, self._reap)

    @property
    def address(self) -> tuple[str, int]:
        assert self._sock is not None, "receiver not started"
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for joined in self._group_socks:
            if self._loop is not None:
                self._loop.remove_reader(joined.fileno())
            joined.close()
        self._group_socks.clear()
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        await self.handoffs.close()
        if self._own_worker:
            self.worker.shutdown()

    # ------------------------------------------------------------------ receive path
    def _on_readable(self, group_sock: socket.socket | None = None) -> None:
        sock = self._sock if group_sock is None else group_sock
        if sock is None:
            return
        for _ in range(READ_BATCH):
            try:
                data, ancillary, _flags, addr = sock.recvmsg(_RECV_SIZE, _GRO_CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. an ICMP error queued on the socket: costs nothing but a log line
                log.debug("UDP receive error: %s", exc)
                continue
            segment = len(data)
            for level, kind, value in ancillary:
                if level == socket.IPPROTO_UDP and kind == UDP_GRO and len(value) >= 4:
                    segment = int.from_bytes(value[:4], sys.byteorder) or segment  # a C int
            if segment >= len(data):
                self._guarded_datagram(data, addr)
            else:  # a GRO batch: equal segments, the last may be shorter
                for offset in range(0, len(data), segment):
                    self._guarded_datagram(data[offset : offset + segment], addr)

    def _guarded_datagram(self, data: bytes, addr: PeerAddress) -> None:
        try:
            self.on_datagram(data, addr)
        except Exception:  # a bug must cost one datagram, not the socket
            log.exception("receive path failed; datagram dropped")
            self.metrics.dropped("other")

    def on_datagram(self, data: bytes, addr: PeerAddress) -> None:
        assert self._loop is not None
        now = clock()
        self.stats.received += 1
        self.stats.bytes_received += len(data)
        drops = self.endpoint.drops
        # Junk counters before, compared by identity after (no arithmetic: no allocation per datagram).
        header_junk, auth_junk, version_junk = drops.get("junk_header"), drops.get("junk_auth"), drops.get(
            "bad_version")
        header = self.endpoint.receive_datagram(data, now)  # the one parse of the header, shared with us
        if header is not None:  # authenticated now: counted by its type
            if header.type is MsgType.OFFER and header.session_id not in self._peers:
                # The OFFER's source: where this session's replies go (pruned with the session).
                self._peers[header.session_id] = addr
            # Counted here, exported once per loop iteration (_deferred_service).
            self._rx_count[header.type] += 1
            self._rx_bytes[header.type] += len(data)
        elif (drops.get("junk_header") is not header_junk or drops.get("junk_auth") is not auth_junk
              or drops.get("bad_version") is not version_junk):
            # Junk (no valid header, or not authentic) counts as junk, never by the type byte it claims;
            # other drops and held early data are in the drop counters by reason.
            self._rx_count[_JUNK] += 1
            self._rx_bytes[_JUNK] += len(data)
        if not self._service_pending:  # once per loop iteration, after every datagram that was ready
            self._service_pending = True
            self._loop.call_soon(self._deferred_service)

    def _deferred_service(self) -> None:
        self._service_pending = False
        self._export_received()
        self._service(clock())

    def _export_received(self) -> None:
        counts, sizes = self._rx_count, self._rx_bytes
        for type_byte, kind in _RX_LABELS:
            if counts[type_byte]:
                self.metrics.datagrams_received(kind, counts[type_byte], sizes[type_byte])
                counts[type_byte] = sizes[type_byte] = 0

    def _service(self, now: float) -> None:
        """Drain events, send what the sessions queued, re-arm the timer."""
        endpoint = self.endpoint
        while (event := endpoint.next_event()) is not None:
            self.handoffs.on_event(event, now)
            if isinstance(event, OfferReceived):
                self._join_group(event.session_id)
        self._flush()
        self._drops.export(self.endpoint.drops)
        self._export_live()
        self._arm_timer()

    def _export_live(self) -> None:
        live = (len(self.endpoint.sessions), self._pending_handshakes())
        if live != self._live_seen:
            self._live_seen = live
            self.metrics.sessions_live(*live)

    def _pending_handshakes(self) -> int:
        return len(self.endpoint.pending_handshakes())

    def _flush(self) -> None:
        sock = self._sock
        out = self.endpoint.datagrams_to_send()
        for sid, datagram in out:
            peer = self._peers.get(sid)
            if peer is None or sock is None:
                self.metrics.dropped("send_failed")
                continue
            try:
                sock.sendto(datagram, peer)
            except OSError:  # including a full send buffer: feedback is repeated, RESULT retried
                self.metrics.dropped("send_failed")
                continue
            kind = TYPE_BYTE_LABELS.get(datagram[1])
            if kind is not None:
                self.metrics.datagram_sent(kind, len(datagram))
        endpoint = self.endpoint
        if len(self._peers) > len(endpoint.sessions):  # keep the reply addresses of pending handshakes too
            for sid in [s for s in self._peers if not endpoint.knows(s)]:
                del self._peers[sid]

    def _join_group(self, sid: int) -> None:
        """A session whose OFFER carried a group ticket joins the group stream (else it is refused)."""
        info = self.handoffs.sessions.get(sid)
        session = self.endpoint.sessions.get(sid)
        if info is None or info.app is None or info.app.group is None or session is None:
            return
        why = self.endpoint.join_group(sid, info.app.group)
        if why is not None:
            info.state = "refused"
            session.refuse(RefuseCode.BAD_PARAMETERS, f"OFFER group: {why}")

    # ------------------------------------------------------------------ timers
    def _arm_timer(self) -> None:
        """One loop timer for the endpoint's next timer (``timer_fires_at``).

        A session's deadline is armed ``TIMER_EARLY_S`` early and the last stretch spent polling I/O with
        ``call_soon``, so it starts within tens of microseconds instead of up to a millisecond late.
        """
        loop = self._loop
        assert loop is not None
        endpoint = self.endpoint
        at = endpoint.get_timer()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = loop.call_at(timer_fires_at(at, endpoint.next_deadline()), self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None
        now = clock()
        at = self._timer_at
        if at is not None and now < at:  # a deadline's last stretch (or a timer that fired a step early)
            self.timer_polls += 1
            self._timer = self._loop.call_soon(self._on_timer)
            return
        self._timer = None
        self._timer_at = None
        self.endpoint.handle_timer(now)
        self._service(now)

    # ------------------------------------------------------------------ admission, reaper
    def _admit(self, _sid: int, offer: Offer) -> tuple[RefuseCode, str] | None:
        """The endpoint's admission check (``admission.admit``)."""
        return admit(offer, self.limits, self._max_plan, self.max_tokens)

    def _reap(self) -> None:
        """Every ``REAP_EVERY_S``: end the sessions past their deadline plus grace (``Handoffs.reap``), and
        measure the prefill speed again when the stated one is stale and no session runs."""
        loop = self._loop
        assert loop is not None
        self._reaper = loop.call_later(REAP_EVERY_S, self._reap)
        now = clock()
        if self.handoffs.reap(now, REAP_EVERY_S):
            self._service(now)
        stale = self.speed_measured_at is not None and now - self.speed_measured_at > SPEED_STALE_S
        if stale and self._measuring is None and not self.endpoint.sessions:
            self._measuring = loop.create_task(self.measure_prefill_speed())

    # ------------------------------------------------------------------ the prefill speed its ACCEPTs state
    async def measure_prefill_speed(self) -> PrefillSpeed | None:
        """Time this node's prefill (in the model worker: after the jobs queued, never inside one) and
        state it in every ACCEPT from now on (``receiver_speed.stated_fields``, refitted over recent prefills
        by ``RecentPrefills``); None without a model."""
        runtime = self.runtime
        if runtime is None:
            return None
        from pfec.common.model.speed import DEFAULT_LENGTHS, measure_prefill_speed  # deferred: torch

        try:
            # The lengths the model's context holds; torch keeps its thread count per thread: the
            # worker's set to this node's CPUs.
            cap = runtime.max_context // 2
            lengths = [n for n in DEFAULT_LENGTHS if n <= cap]
            if len(lengths) < 2:
                lengths = [cap // 4, cap // 2, cap]
            speed = await self.worker.submit(measure_prefill_speed, runtime, lengths, usable_cpus(), 1, 0,
                                             True, force=True)
            # and the rest the planner predicts: the receive path's CPU per datagram (``node_speed``)
            speed = replace(speed, parts=replace(speed.parts, datagram_s=await self.worker.submit(
                receive_path_s, force=True)))
        except ValueError:  # the model's context is shorter than the lengths timed
            return None
        finally:
            self._measuring = None
        # a new measurement
        self.recent_prefills = RecentPrefills(speed.curve, speed.decode_s, speed.points, speed.parts)
        self.endpoint.prefill_statement = self.recent_prefills.stated()
        self.prefill_speed = speed
        self.speed_measured_at = clock()
        self.metrics.prefill_speed(speed.tokens_per_second())
        return speed

    def _keep_prefix(self, sid: int, app: OfferApp, done: Reconstructed) -> bool:
        """Worker thread, after any answer: a handoff's rebuilt context (a conversation's, or a
        question/answer handoff's) becomes a prefix cache entry of its salt, with what it was built from
        (the response's ``pfec.prefix``)."""
        if self.face is None or app.prefix is None or done.kv is None:
            return False
        info: dict[str, Any] = {"handoff_id": f"{sid:016x}", "recovered_utility": done.utility,
                                "precision": done.precision, "precision_utility": done.precision_utility}
        if done.held is not None:  # what a chain hands on from here (sender/kv.py), and what it lacks
            info.update(held=done.held, missing=done.held.missing())
        kept = self.face.keep(app.prefix.salt, app.prefix.context_ids, done.kv, info)
        self._loop_call(self.face.export_metrics)
        return kept

    def _loop_call(self, fn: Callable[[], None]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)

    def _on_prefill_timed(self, timed: Sequence[tuple[int, int, float]], loaded: bool = False) -> None:
        """A front's chunks, timed as they ran (``loaded``: beside the stream they met): the stated speed
        from now on is refitted over them and the measurement (``RecentPrefills``)."""
        recent = self.recent_prefills
        if recent is not None and recent.observe(timed, loaded):
            self.endpoint.prefill_statement = recent.stated()
            self.metrics.prefill_speed(recent.curve.tokens_per_second(1024))

    # ------------------------------------------------------------------ control API (receiver/control.py)
    @property
    def sessions(self) -> dict[int, SessionInfo]:
        """Each session's application state by id (``Handoffs``)."""
        return self.handoffs.sessions

    @property
    def results(self) -> deque[dict[str, Any]]:
        """The last results (``/results``), oldest first."""
        return self.handoffs.results

    def health(self) -> dict[str, Any]:
        """Liveness (``/healthz``): the loop answers."""
        late = np.asarray(self.stats.deadline_late_s, dtype=float)
        return {
            "status": "ok",
            "role": "receiver",
            "model": self.identity.model_id,
            "fingerprint": self.fingerprint.hex()[:16],
            "udp": f"{self.address[0]}:{self.address[1]}",
            "sessions": len(self.endpoint.sessions),
            "pending_handshakes": self._pending_handshakes(),
            "datagrams_received": self.stats.received,
            "drops": dict(self.endpoint.drops),
            "speed_queries_answered": self.endpoint.speed_queries,
            "deadline_late_ms_p99": float(np.percentile(late, 99) * 1000) if len(late) else None,
            "worker": self.worker.view(),
        }

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (``/readyz``): red while the model worker runs a job past ``limits.worker_stuck_s``."""
        return self.worker.readiness("receiver")
