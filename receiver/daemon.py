"""Receiver daemon: a thin asyncio adapter over ``ReceiverEndpoint`` (sans-IO); rebuild + generation at
each deadline run in a worker thread (``receiver/rebuild.py``).

- One UDP socket (large SO_RCVBUF; SO_RCVBUFFORCE as root) feeds ``endpoint.receive_datagram``; every
  reply goes to the address the session's OFFER came from. The socket is read directly (``add_reader``
  + ``recvmsg``) rather than through a datagram transport, for two reasons: UDP GRO (Linux >= 5.0)
  hands over a sender's GSO batch as one buffer with its segment size in a control message, one system
  call for many datagrams; and each wake-up reads at most ``READ_BATCH`` buffers before yielding, so a
  deadline timer never waits behind a drained socket buffer.
- One loop timer (``loop.call_at`` on the loop's monotonic clock, which is the sessions' ``now``) tracks
  ``endpoint.get_timer()``.
- ``DeadlineReached`` (at the deadline, or as soon as everything planned is decoded: start when ready)
  hands the decoded symbols to a single worker thread (``rebuild.reconstruct``: file them by fragment id
  or stream index, rebuild the partial cache, generate); its RESULT goes back through
  ``session.send_result`` and says which of the two started it.
- A quantised OFFER (``OfferApp.precision``) names its scheme, mix, layout, fidelity table and a digest of
  its piece plan: once the profile is known the receiver recomputes the plan and refuses the session with
  the reason when the scheme is not its own, the table is unknown here or the digest differs.
- Results are kept (last ``RESULTS_KEPT``) for the control API; sessions are bounded by the endpoint's
  config and reaped by the endpoint (a vanished sender's session closes after its RESULT retries).
- Every session ends: a sweep (``REAP_EVERY_S``) answers a session still without a RESULT at its deadline
  plus ``limits.session_grace_s`` with an error RESULT, and closes (REFUSE) one still open after its
  RESULT retries too, whatever the sender or the model worker does.
- Bounds before allocation: an OFFER's budget and size are checked in the endpoint's admission (before
  its session allocates a decoder); its application blob (``OfferApp.decode``) against the configured
  maximum context and the model's, before any plan is built. The OFFER's profile is a NAME resolved in
  this node's profile directory off the loop (``ProfileStore``); an unknown or unusable one is refused
  with a REFUSE naming it and the reason.
- Model work (rebuild, generation) runs on a ``ModelWorker`` with a bounded queue; ``readiness`` (the
  control API's ``/readyz``) turns red when a job runs past ``limits.worker_stuck_s``.

The control API is ``receiver/control.py``; ``receiver/serve.py`` runs it all (``pfec receiver serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pfec.common.codec import fec
from pfec.common.events import CpuMeter, Event
from pfec.common.node.config import LimitsConfig
from pfec.common.node.metrics import MSG_TYPE_LABELS, TYPE_BYTE_LABELS, DropExporter
from pfec.common.node.profiles import ProfileStore
from pfec.common.node.udp import UDP_GRO, PeerAddress, enable_gro, open_udp_socket
from pfec.common.node.worker import ModelWorker, WorkerBusy
from pfec.common.plan.handoff import (
    ModelIdentity,
    OfferApp,
    ResultApp,
    pack_bits,
)
from pfec.common.plan.stream import symbol_token_ends
from pfec.common.plan.utility import DEFAULT_PROFILE_DIR, ProfileError, UtilityProfile
from pfec.common.wire.messages import MsgType, Offer, RefuseCode
from pfec.receiver.admission import admit, check_offer_app, check_stream
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.metrics import ReceiverMetrics
from pfec.receiver.rebuild import (
    AtDeadline,
    Front,
    Reconstructed,
    StreamPlan,
    compute_front,
    error_result,
    reconstruct,
    result_of,
)
from pfec.receiver.session import (
    DeadlineReached,
    OfferReceived,
    ReceiverConfig,
    ReceiverSession,
    ReceiverState,
    SessionClosed,
)

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

log = logging.getLogger("pfec.receiver")
RESULTS_KEPT = 256
# The sessions' clock: the loop's monotonic clock at full resolution (uvloop's loop.time() has the same
# base but 1 ms steps; timers still fire through loop.call_at).
clock = time.monotonic
TIMER_EARLY_S = 0.0015
READ_BATCH = 32  # recvmsg calls per readable event before timers get their turn (each can be a GRO batch)
_GRO_CMSG_SPACE = socket.CMSG_SPACE(4)
_RECV_SIZE = 65535
REAP_EVERY_S = 0.5  # the reaper's sweep period (sessions past their deadline plus grace)
_JUNK = 256  # slot of the receive counters for junk (unparseable or unauthentic datagrams)
_RX_LABELS = (*MSG_TYPE_LABELS.items(), (_JUNK, "junk"))


@dataclass
class SessionInfo:
    session_id: int
    peer: PeerAddress | None
    opened_at: float
    deadline: float
    app: OfferApp | None = None
    state: str = "receiving"
    result: dict[str, Any] | None = None
    profile: UtilityProfile | None = None  # resolved off the loop after the OFFER (None: not yet, or unknown)
    stream: StreamPlan | None = None  # a quantised OFFER's piece plan, recomputed and checked here
    n_source: int = 0
    symbol_size: int = 0
    front: Front | None = None  # a split's (or local prefill's) front, computed here in chunks


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
    ) -> None:
        fec.warm_up()  # codec kernels compiled before any datagram, not mid-handoff
        self.identity = identity
        self.runtime = runtime  # None: synthetic KV, no generation (transport benchmarks)
        self.fingerprint = identity.fingerprint()
        self.metrics = metrics or ReceiverMetrics(process_metrics=False)
        self.cpu = CpuMeter(time.perf_counter_ns)
        self.limits = limits or LimitsConfig()
        self.profiles = profiles or ProfileStore(DEFAULT_PROFILE_DIR)
        # The largest context an OFFER may carry: the configured bound and the model's own.
        self.max_tokens = self.limits.max_context_tokens
        if runtime is not None:
            self.max_tokens = min(self.max_tokens, int(runtime.max_context))
        self._max_plan = identity.plan(self.max_tokens)
        self.endpoint = ReceiverEndpoint(psk, self.fingerprint, session_config, admit=self._admit,
                                         cpu=self.cpu)
        self.default_mode = default_mode
        self.sessions: dict[int, SessionInfo] = {}
        self.results: deque[dict[str, Any]] = deque(maxlen=RESULTS_KEPT)
        self.stats = ReceiverStatsSnapshot()
        self._peers: dict[int, PeerAddress] = {}  # session id -> reply address (also pending refusals)
        self._sock: socket.socket | None = None
        self._gro = False
        self._rx_count = [0] * 257  # datagrams and bytes per wire type (+ junk), not yet exported
        self._rx_bytes = [0] * 257
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self._service_pending = False
        self.worker = ModelWorker("pfec-generate", self.limits.worker_queue, self.limits.worker_stuck_s)
        # Profile files are read in a thread of their own: a slow file system never delays the model.
        self._profile_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pfec-profile")
        self._drops = DropExporter(self.metrics)
        self._jobs: set[asyncio.Future[Reconstructed]] = set()
        self._profile_jobs: set[asyncio.Future[UtilityProfile]] = set()
        self._front_jobs: set[asyncio.Future[int]] = set()
        self._reaper: asyncio.TimerHandle | None = None
        self._live_seen: tuple[int, int] = (-1, -1)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str, port: int, rcvbuf: int = 8 << 20, sndbuf: int = 8 << 20) -> None:
        self._loop = asyncio.get_running_loop()
        sock = open_udp_socket(host, port, rcvbuf, sndbuf)
        self._gro = enable_gro(sock)  # not Linux >= 5.0: one datagram per recvmsg
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._on_readable)
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
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for job in list(self._jobs):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(job), 30)
        self.worker.shutdown()
        self._profile_executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ receive path
    def _on_readable(self) -> None:
        sock = self._sock
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

    def _guarded_datagram(self, data: bytes, addr: Any) -> None:
        try:
            self.on_datagram(data, addr)
        except Exception:  # a bug must cost one datagram, not the socket
            log.exception("receive path failed; datagram dropped")
            self.metrics.dropped("other")

    def on_datagram(self, data: bytes, addr: Any) -> None:
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
            self._on_event(event, now)
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

    # ------------------------------------------------------------------ timers
    def _arm_timer(self) -> None:
        """One loop timer for the endpoint's next deadline, armed ``TIMER_EARLY_S`` early.

        Loop timers have 1 ms steps (uvloop); the last stretch is spent polling I/O with ``call_soon``
        so a deadline starts within tens of microseconds instead of up to a millisecond late.
        """
        loop = self._loop
        assert loop is not None
        at = self.endpoint.get_timer()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = loop.call_at(at - TIMER_EARLY_S, self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None
        now = clock()
        at = self._timer_at
        if at is not None and now < at:
            self._timer = self._loop.call_soon(self._on_timer)
            return
        self._timer = None
        self._timer_at = None
        self.endpoint.handle_timer(now)
        self._service(now)

    # ------------------------------------------------------------------ events
    def _on_event(self, event: Event, now: float) -> None:
        if isinstance(event, OfferReceived):
            self._on_offer(event, now)
        elif isinstance(event, DeadlineReached):
            self._on_deadline(event, now)
        elif isinstance(event, SessionClosed):
            self._on_closed(event)

    def _admit(self, _sid: int, offer: Offer) -> tuple[RefuseCode, str] | None:
        """The endpoint's admission check (``admission.admit``)."""
        return admit(offer, self.limits, self._max_plan, self.max_tokens)

    def _on_offer(self, event: OfferReceived, now: float) -> None:
        session = self.endpoint.sessions.get(event.session_id)
        if session is None:
            return
        info = SessionInfo(event.session_id, self._peers.get(event.session_id), now, session.deadline)
        self.sessions[event.session_id] = info
        try:
            app = check_offer_app(event.app_blob, event.offer, self.identity, self.runtime, self.max_tokens,
                                  self.limits.max_blob_bytes)
        except ValueError as exc:
            info.state = "refused"
            session.refuse(RefuseCode.BAD_PARAMETERS, str(exc))
            return
        info.app = app
        info.n_source, info.symbol_size = event.offer.n_source, event.offer.symbol_size
        if app.split is not None and not self._start_front(info, app, session, now):
            return
        n_layers = self.identity.geometry.n_layers
        info.profile = self.profiles.cached(app.profile, n_layers)
        if info.profile is not None:
            self._check_stream(info)
        else:  # read the named file off the loop; refuse the session if it is unusable
            loop = self._loop
            assert loop is not None
            job = loop.run_in_executor(self._profile_executor, self.profiles.load, app.profile, n_layers)
            self._profile_jobs.add(job)
            job.add_done_callback(lambda fut: self._on_profile(event.session_id, app.profile, fut))

    def _start_front(self, info: SessionInfo, app: OfferApp, session: ReceiverSession, now: float) -> bool:
        """Prefill the front in the worker, chunk by chunk, each chunk's end reported in the ACKs; False
        when the session was refused (the worker is full)."""
        split = app.split
        loop = self._loop
        assert split is not None and loop is not None and self.runtime is not None
        sid = info.session_id
        session.set_split(None, app.n_tokens, split.meeting_token, now)
        front = Front(split.context_ids, split.meeting_token)

        def progress(tokens: int) -> None:  # worker thread
            loop.call_soon_threadsafe(self._on_front_progress, sid, tokens)

        try:
            job = self.worker.submit(compute_front, self.runtime, front, progress)
        except WorkerBusy as exc:
            info.state = "refused"
            session.refuse(RefuseCode.OVERLOADED, f"receiver busy: {exc}")
            return False
        info.front = front
        self._front_jobs.add(job)
        job.add_done_callback(self._front_jobs.discard)
        return True

    def _on_front_progress(self, sid: int, tokens: int) -> None:
        session = self.endpoint.sessions.get(sid)
        if session is None or session.closed or session.state is not ReceiverState.RECEIVING:
            return
        now = clock()
        session.set_computed(tokens, now)
        self._service(now)

    def _on_profile(self, sid: int, name: str, fut: asyncio.Future[UtilityProfile]) -> None:
        self._profile_jobs.discard(fut)
        if fut.cancelled():
            return
        info = self.sessions.get(sid)
        exc = fut.exception()
        if exc is None:
            if info is not None:
                info.profile = fut.result()
                if self._check_stream(info):
                    self._service(clock())
            return
        reason = str(exc) if isinstance(exc, ProfileError) else f"profile {name!r}: cannot be loaded"
        if not isinstance(exc, ProfileError):
            log.error("session %016x: profile %r failed to load: %r", sid, name, exc)
        session = self.endpoint.sessions.get(sid)
        if info is None or session is None or session.closed or info.state != "receiving":
            return
        info.state = "refused"
        session.refuse(RefuseCode.BAD_PARAMETERS, reason)
        self._service(clock())

    def _check_stream(self, info: SessionInfo) -> bool:
        """A quantised OFFER, once its profile is known: recompute its piece plan, or refuse the session
        with the reason (unknown scheme or fidelity table, another plan). True when it refused."""
        app, profile = info.app, info.profile
        if app is None or app.precision is None or profile is None or info.state != "receiving":
            return False
        try:
            stream = info.stream = check_stream(self.identity, app, profile, info.symbol_size, info.n_source)
        except ValueError as exc:
            session = self.endpoint.sessions.get(info.session_id)
            info.state = "refused"
            if session is not None and not session.closed:
                session.refuse(RefuseCode.BAD_PARAMETERS, str(exc))
            return True
        session = self.endpoint.sessions.get(info.session_id)
        if app.split is not None and session is not None and session.state is ReceiverState.RECEIVING:
            session.set_split(symbol_token_ends(stream.plan), app.n_tokens, app.split.meeting_token, clock())
        return False

    def _on_deadline(self, event: DeadlineReached, now: float) -> None:
        info = self.sessions.get(event.session_id)
        late = now - (event.at if event.ready else event.stats.deadline_at)
        self.stats.deadline_late_s.append(late)
        self.metrics.deadline_started(late)
        stats = event.stats
        self.metrics.decoder_stall(stats.stall_time_s, stats.stalls)
        self.metrics.symbols_decoded(len(event.decoded_esis))
        self.metrics.redundant_repairs(stats.redundant_repairs)
        if info is None or info.app is None:  # the OFFER's application part never completed
            self._result_without_rebuild(event, late, "the OFFER's application data never arrived complete")
            return
        info.state = "generating"
        app = info.app
        at = AtDeadline.of(event, late)
        front = info.front
        if front is not None:
            front.stop.set()  # the front job ends after its chunk; the rebuild runs next in the same worker
        # Filing, scoring, rebuild and generation all run in the worker: the loop keeps serving datagrams.
        try:
            job = self.worker.submit(reconstruct, self.runtime, self.identity, app, info.profile,
                                     event.decoded_esis, event.store, info.stream, front,
                                     force=front is not None)
        except WorkerBusy as exc:
            self._result_without_rebuild(event, late, f"receiver busy: {exc}")
            return
        self._jobs.add(job)
        job.add_done_callback(lambda fut: self._on_generated(event.session_id, at, fut))

    def _reap(self) -> None:
        """Every session ends: one past its deadline plus the grace without a RESULT gets an error RESULT
        (then CLOSE or RESULT retries end it); one still open after that too is closed with a REFUSE."""
        loop = self._loop
        assert loop is not None
        self._reaper = loop.call_later(REAP_EVERY_S, self._reap)
        now = clock()
        grace = self.limits.session_grace_s
        cfg = self.endpoint.config
        retries_s = cfg.result_retries * cfg.result_retry_s + REAP_EVERY_S
        reaped = False
        for sid, session in list(self.endpoint.sessions.items()):
            if session.closed or now < session.deadline + grace:
                continue
            info = self.sessions.get(sid)
            if info is None or (info.result is None and info.state not in ("refused", "result_sent")):
                self._give_up(sid, session, now)
                reaped = True
            elif now >= session.deadline + grace + retries_s:
                log.warning("session %016x: still open %.1f s after its deadline; closing it", sid,
                            now - session.deadline)
                session.refuse(RefuseCode.OTHER, "receiver reaped the session after its deadline and grace")
                reaped = True
        if reaped:
            self._service(now)

    def _give_up(self, sid: int, session: ReceiverSession, now: float) -> None:
        """The deadline plus grace passed without a RESULT (a stuck worker, an OFFER never complete)."""
        info = self.sessions.get(sid)
        if info is None:
            info = self.sessions[sid] = SessionInfo(sid, self._peers.get(sid), now, session.deadline)
        if session.state is ReceiverState.RECEIVING:  # its deadline never fired (cannot happen; be sure)
            session.refuse(RefuseCode.OTHER, "receiver reaped the session after its deadline and grace")
            return
        error = (f"receiver gave up: no result {self.limits.session_grace_s:g} s after the deadline "
                 "(limits.session_grace_s)")
        info.state = "result_sent"
        info.result = {"session_id": f"{sid:016x}", "finished_at": time.time(), "error": error}
        self.results.append(info.result)
        mode = info.app.mode if info.app else self.default_mode
        n_source = session.offer.n_source
        session.send_result(ResultApp(None, 0, 0, session.decoder.decoded_count, n_source,
                                      pack_bits(np.zeros(0, bool)), None, None, 0.0, None, mode,
                                      error=error).encode(), now)

    def _result_without_rebuild(self, event: DeadlineReached, late: float, error: str) -> None:
        """Answer with an error RESULT so the session still ends (RESULT, then CLOSE or retries)."""
        sid = event.session_id
        session = self.endpoint.sessions.get(sid)
        if session is None:
            return
        if sid not in self.sessions:
            self.sessions[sid] = SessionInfo(sid, self._peers.get(sid), clock(), event.stats.deadline_at)
        info = self.sessions[sid]
        info.state = "result_sent"
        result = error_result(AtDeadline.of(event, late), self.default_mode, error)
        info.result = {"session_id": f"{sid:016x}", "finished_at": time.time(), "error": error}
        self.results.append(info.result)
        session.send_result(result.encode(), clock())

    def _on_generated(self, sid: int, at: AtDeadline, fut: asyncio.Future[Reconstructed]) -> None:
        self._jobs.discard(fut)
        now = clock()
        info = self.sessions.get(sid)
        try:
            done = fut.result()
        except Exception as exc:  # filing, rebuild or generation failed: report it, keep serving
            log.exception("session %016x: rebuild/generation failed", sid)
            done = Reconstructed.failed(exc)
        if info is None or info.state != "generating":  # gone, or answered by the reaper meanwhile
            return
        if done.utility is not None:
            self.metrics.recovered_utility(done.utility)
        ttft = None
        split = info.app.split if info.app else None
        if split is not None and done.rebuilt.first_token_at is not None:
            # OFFER arrival -> first token, as the worker saw it: the front's last chunk, the join and
            # rebuild (or the rest of a local prefill) and the forward are all inside.
            ttft = done.rebuilt.first_token_at - info.opened_at
            self.metrics.ttft(ttft)
        elif done.rebuilt.generation_ttft_s is not None:
            # OFFER arrival -> first token: the wait for the deadline (or for the last symbol, when ready
            # first), start lateness, rebuild, forward.
            ttft = (at.reached_at + at.late_s + done.rebuilt.generation_ttft_s) - info.opened_at
            self.metrics.ttft(ttft)
        local = info.app is not None and info.app.precision is None
        mode = "handoff" if split is None else ("local" if local else "split")
        result = result_of(done, at, ttft, info.app.mode if info.app else self.default_mode, mode)
        record = {"session_id": f"{sid:016x}", "finished_at": time.time(), **result.__dict__}
        record.pop("blocks_bitmap", None)
        info.result = record
        info.state = "result_sent"
        self.results.append(record)
        session = self.endpoint.sessions.get(sid)
        if session is not None:
            session.send_result(result.encode(), now)
        self._service(now)

    def _on_closed(self, event: SessionClosed) -> None:
        info = self.sessions.pop(event.session_id, None)
        if info is not None and info.front is not None:
            info.front.stop.set()
        reason = event.reason
        if info is None and reason.startswith("refused"):  # refused before it existed
            self.metrics.session_refused()
            self.results.append(
                {"session_id": f"{event.session_id:016x}", "finished_at": time.time(), "error": reason}
            )
            return
        if info is not None and info.state == "refused":
            outcome = "failed"
        elif reason.startswith("sender closed (DONE)"):
            outcome = "done"
        elif reason.startswith("sender closed"):
            outcome = "cancelled"
        elif "sender gone" in reason:
            outcome = "timeout"
        else:
            outcome = "failed"
        self.metrics.session_finished(outcome)
        if info is None or info.result is None:
            self.results.append(
                {"session_id": f"{event.session_id:016x}", "finished_at": time.time(), "error": reason}
            )

    # ------------------------------------------------------------------ control API views
    def session_views(self) -> list[dict[str, Any]]:
        """Every live session: the endpoint's (whether or not its OFFER completed) and its pending
        handshakes (authentic OFFERs not yet established)."""
        now = clock()
        out = []
        for sid, session in self.endpoint.sessions.items():
            info = self.sessions.get(sid)
            peer = info.peer if info is not None else self._peers.get(sid)
            out.append(
                {
                    "session_id": f"{sid:016x}",
                    "state": info.state if info is not None else "offer_incomplete",
                    "peer": f"{peer[0]}:{peer[1]}" if peer else None,
                    "deadline_in_ms": round((session.deadline - now) * 1000, 3),
                    "decoded_symbols": session.decoder.decoded_count,
                    "n_source": session.offer.n_source,
                    "profile": info.app.profile if info is not None and info.app is not None else None,
                }
            )
        for hs in self.endpoint.pending_handshakes():
            peer = self._peers.get(hs.session_id)
            out.append({"session_id": f"{hs.session_id:016x}", "state": "handshake",
                        "peer": f"{peer[0]}:{peer[1]}" if peer else None,
                        "expires_in_ms": round((hs.expires_at - now) * 1000, 3), "deadline_in_ms": None,
                        "decoded_symbols": None, "n_source": hs.n_source, "profile": None,
                        "offer_parts": f"{hs.parts_received}/{hs.part_count}"})
        return out

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
            "deadline_late_ms_p99": float(np.percentile(late, 99) * 1000) if len(late) else None,
            "worker": self.worker.view(),
        }

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (``/readyz``): red while the model worker runs a job past ``limits.worker_stuck_s``."""
        stuck = self.worker.stuck_for()
        body: dict[str, Any] = {"status": "ready" if stuck is None else "stuck", "role": "receiver",
                                "worker": self.worker.view()}
        if stuck is not None:
            body["error"] = (f"the model worker has run one job for {stuck:.1f} s (limits.worker_stuck_s = "
                             f"{self.worker.stuck_after_s:g})")
        return stuck is None, body
