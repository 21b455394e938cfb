"""The receiver's handoffs: what each session means to this node, from its OFFER to its RESULT. The daemon
(``receiver/daemon.py``) owns the socket and the timers and hands every endpoint event to ``Handoffs``.

- An OFFER's application blob (``OfferApp.decode``) is checked against the configured maximum context and
  the model's before any plan is built. Its profile is a NAME resolved in this node's profile directory
  off the loop (``ProfileStore``); an unknown or unusable one is refused with a REFUSE naming it.
- A quantised OFFER (``OfferApp.precision``) names its scheme, mix, layout, fidelity table and a digest of
  its piece plan: once the profile is known the plan is recomputed here and the session refused with the
  reason when the scheme is not this node's, the table is unknown here or the digest differs.
- A split's front is prefilled in the model worker, chunk by chunk, each chunk's end reported in the ACKs.
- ``DeadlineReached`` (at the deadline, or as soon as everything planned is decoded: start when ready)
  hands the decoded symbols to the worker (``rebuild.reconstruct``: file, rebuild, generate); its RESULT
  goes back through ``session.send_result`` and says which of the two started it.
- Every session ends: ``reap`` answers one still without a RESULT at its deadline plus
  ``limits.session_grace_s`` with an error RESULT, and closes (REFUSE) one still open after its RESULT
  retries too, whatever the sender or the model worker does.
- Results are kept (last ``RESULTS_KEPT``) for the control API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pfec.common.events import Event
from pfec.common.node.config import LimitsConfig
from pfec.common.node.profiles import ProfileStore
from pfec.common.node.udp import PeerAddress
from pfec.common.node.worker import ModelWorker, WorkerBusy
from pfec.common.plan.breakeven import LIVE_REBUILD_EVERY_S
from pfec.common.plan.handoff import ModelIdentity, OfferApp, ResultApp, pack_bits
from pfec.common.plan.stream import symbol_token_ends
from pfec.common.plan.utility import ProfileError, UtilityProfile
from pfec.common.wire.messages import RefuseCode
from pfec.receiver.admission import check_offer_app, check_stream, is_local
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
    ReceiverSession,
    SessionClosed,
)

if TYPE_CHECKING:
    from pfec.common.model.kvcache import LiveRebuild
    from pfec.common.model.llm import ModelRuntime

log = logging.getLogger("pfec.receiver")
RESULTS_KEPT = 256
# How long a split's front waits for the loop to place its next chunk (``meet``) before it runs the planned
# one: the loop answers between datagram batches (well under a millisecond here).
MEET_WAIT_S = 0.05
# How often a quantised stream's newly decoded symbols are handed to the model worker, which places their
# blocks into the cache while the stream goes on (``LiveRebuild``): what is left at the deadline is what
# arrived in the last period, the blocks' masks and the question.
LIVE_EVERY_S = LIVE_REBUILD_EVERY_S  # the planner's assumption (``breakeven``)
_REAPED = "receiver reaped the session after its deadline and grace"


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
    live: LiveRebuild | None = None  # a quantised stream's cache, built while it arrives
    live_seen: np.ndarray | None = None  # the decoder's symbols already handed to ``live``
    live_job: bool = False  # a placement job is queued or running in the worker


def _record(sid: int, /, **fields: Any) -> dict[str, Any]:
    """One entry of the results the control API lists."""
    return {"session_id": f"{sid:016x}", "finished_at": time.time(), **fields}


def _outcome(info: SessionInfo | None, reason: str) -> str:
    """The ``pfec_receiver_sessions_total`` outcome of a closed session, from its CLOSE reason."""
    if info is not None and info.state == "refused":
        return "failed"
    if reason.startswith("sender closed (DONE)"):
        return "done"
    if reason.startswith("sender closed"):
        return "cancelled"
    return "timeout" if "sender gone" in reason else "failed"


class Handoffs:
    """Every session's application state (OFFER, profile, front, rebuild, RESULT) and the jobs it runs.

    Runs on the event loop; ``service`` is the daemon's (drain events, send, re-arm the timer), called after
    a job's result changed a session. Nothing here touches the socket."""

    def __init__(
        self,
        endpoint: ReceiverEndpoint,
        identity: ModelIdentity,
        runtime: ModelRuntime | None,
        *,
        worker: ModelWorker,
        metrics: ReceiverMetrics,
        limits: LimitsConfig,
        profiles: ProfileStore,
        max_tokens: int,
        default_mode: str,
        peers: Mapping[int, PeerAddress],
        late_s: deque[float],
        clock: Callable[[], float],
        service: Callable[[float], None],
        prefill_timed: Callable[[Sequence[tuple[int, int, float]], bool], None] | None = None,
        keep: Callable[[int, OfferApp, Reconstructed], bool] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.runtime = runtime
        self.worker = worker
        self.metrics = metrics
        self.limits = limits
        self.profiles = profiles
        self.max_tokens = max_tokens
        self.default_mode = default_mode
        self.peers = peers  # the daemon's reply address of each session (pending handshakes too)
        self.late_s = late_s  # each deadline's start lateness (the daemon's stats)
        self.clock = clock
        self.service = service
        # told each front's timed chunks and whether a stream ran beside them (the daemon's stated speed)
        self.prefill_timed = prefill_timed
        self.keep = keep  # stores a conversation's rebuilt context (worker thread; the OpenAI face's store)
        self.sessions: dict[int, SessionInfo] = {}
        self.results: deque[dict[str, Any]] = deque(maxlen=RESULTS_KEPT)
        self.jobs: set[asyncio.Future[Reconstructed]] = set()
        # Profile files are read in a thread of their own: a slow file system never delays the model.
        self._profile_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pfec-profile")
        self._profile_jobs: set[asyncio.Future[UtilityProfile]] = set()
        self._front_jobs: set[asyncio.Future[int]] = set()

    async def close(self) -> None:
        """Let running rebuilds finish (bounded), drop pending profile reads."""
        for job in list(self.jobs):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(job), 30)
        self._profile_executor.shutdown(wait=False, cancel_futures=True)

    def on_event(self, event: Event, now: float) -> None:
        if isinstance(event, OfferReceived):
            self._on_offer(event, now)
        elif isinstance(event, DeadlineReached):
            self._on_deadline(event, now)
        elif isinstance(event, SessionClosed):
            self._on_closed(event)

    # ------------------------------------------------------------------ OFFER: application data, profile
    def _on_offer(self, event: OfferReceived, now: float) -> None:
        session = self.endpoint.sessions.get(event.session_id)
        if session is None:
            return
        info = SessionInfo(event.session_id, self.peers.get(event.session_id), now, session.deadline)
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
            job = asyncio.get_running_loop().run_in_executor(self._profile_executor, self.profiles.load,
                                                             app.profile, n_layers)
            self._profile_jobs.add(job)
            job.add_done_callback(lambda fut: self._on_profile(event.session_id, app.profile, fut))

    def _start_front(self, info: SessionInfo, app: OfferApp, session: ReceiverSession, now: float) -> bool:
        """Prefill the front in the worker, chunk by chunk, each chunk's end reported in the ACKs; False
        when the session was refused (the worker is full)."""
        split = app.split
        loop = asyncio.get_running_loop()
        assert split is not None and self.runtime is not None
        sid = info.session_id
        if app.precision is None and not is_local(app):  # native fragments: their token ends are the plan's
            ends = self.identity.plan(app.n_tokens).fragment_token_end
            session.set_split(ends, app.n_tokens, 0, now)  # the front streams too, after the back
        else:  # a quantised split's stream plan waits for the profile (``_check_stream``)
            session.set_split(None, app.n_tokens, split.meeting_token, now)
        front = Front(split.context_ids, split.meeting_token)

        def progress(tokens: int) -> None:  # worker thread
            loop.call_soon_threadsafe(self._on_front_progress, sid, tokens)

        def meet(done: int, end: int, pace: float) -> int:  # worker thread: the loop owns the session
            answer: Future[int] = Future()
            try:
                loop.call_soon_threadsafe(self._front_meeting, sid, done, end, pace, answer)
                return answer.result(timeout=MEET_WAIT_S)
            except (RuntimeError, TimeoutError):  # the loop closed, or is too busy to ask: as planned
                return end

        if not is_local(app):
            front.meet = meet

        try:
            job = self.worker.submit(compute_front, self.runtime, front, progress)
        except WorkerBusy as exc:
            info.state = "refused"
            session.refuse(RefuseCode.OVERLOADED, f"receiver busy: {exc}")
            return False
        info.front = front
        self._front_jobs.add(job)
        job.add_done_callback(self._front_jobs.discard)
        if self.prefill_timed is not None:
            told, loaded = self.prefill_timed, not is_local(app)
            job.add_done_callback(lambda _job: told(front.timed, loaded))
        return True

    def _front_meeting(self, sid: int, done: int, end: int, pace: float, answer: Future[int]) -> None:
        """Where the front's next chunk meets this session's stream (``ReceiverSession.front_chunk_end``)."""
        session = self.endpoint.sessions.get(sid)
        meets = end
        if session is not None and not session.closed:
            with contextlib.suppress(ValueError):  # a chunk the session cannot place: as planned
                meets = session.front_chunk_end(done, end, pace, self.clock())
        answer.set_result(meets)

    def _on_front_progress(self, sid: int, tokens: int) -> None:
        session = self.endpoint.sessions.get(sid)
        if session is None or session.closed or not session.decoding:
            return
        now = self.clock()
        session.set_computed(tokens, now)
        self.service(now)

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
                    self.service(self.clock())
            return
        reason = str(exc) if isinstance(exc, ProfileError) else f"profile {name!r}: cannot be loaded"
        if not isinstance(exc, ProfileError):
            log.error("session %016x: profile %r failed to load: %r", sid, name, exc)
        session = self.endpoint.sessions.get(sid)
        if info is None or session is None or session.closed or info.state != "receiving":
            return
        info.state = "refused"
        session.refuse(RefuseCode.BAD_PARAMETERS, reason)
        self.service(self.clock())

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
        if app.split is not None and session is not None and session.decoding:
            # The stream carries the front too, after the back (``stream_plan``'s ``front_after``): no
            # token is the front's alone, so the session starts once what is not computed has arrived.
            session.set_split(symbol_token_ends(stream.plan), app.n_tokens, 0, self.clock())
        self._start_live(info, stream)
        return False

    # ------------------------------------------------------------------ rebuild while the stream arrives
    def _start_live(self, info: SessionInfo, stream: StreamPlan) -> None:
        """A quantised stream to rebuild here: its cache is built while it arrives (``LiveRebuild``)."""
        app = info.app
        if self.runtime is None or app is None or not (app.generate or app.prefix is not None):
            return
        from pfec.common.model.kvcache import LiveRebuild  # deferred: torch (a model is loaded here)

        live = info.live = LiveRebuild(self.runtime, stream.plan)
        front = info.front
        if front is not None:  # the worker is the front's: between its chunks it places what arrived and
            # what it computed

            def between() -> None:
                live.drain()
                live.place_computed(front.cache, front.tokens)

            front.between = between
        asyncio.get_running_loop().call_later(LIVE_EVERY_S, self._live_tick, info.session_id)

    def _live_tick(self, sid: int) -> None:
        """Every ``LIVE_EVERY_S`` while the session decodes: copy the symbols decoded since the last tick
        off the decoder (the loop owns it) to the session's ``LiveRebuild``, and have the worker place them
        when it is idle (a split's front places them between its chunks)."""
        info = self.sessions.get(sid)
        session = self.endpoint.sessions.get(sid)
        live = None if info is None else info.live
        if info is None or live is None or session is None or not session.decoding:
            return
        if info.state != "receiving" or live.failed is not None:
            return
        decoder = session.decoder
        if info.live_seen is None:
            info.live_seen = np.zeros(len(decoder.have), dtype=np.bool_)
        new = np.flatnonzero(decoder.have & ~info.live_seen)
        if new.size:
            info.live_seen[new] = True
            live.offer(decoder.store[new])
        if live.inbox and not info.live_job and self.worker.pending == 0:
            try:
                job = self.worker.submit(live.drain)
            except WorkerBusy:
                job = None
            if job is not None:
                info.live_job = True
                job.add_done_callback(lambda _job: setattr(info, "live_job", False))
        asyncio.get_running_loop().call_later(LIVE_EVERY_S, self._live_tick, sid)

    # ------------------------------------------------------------------ deadline: rebuild, generate, RESULT
    def _on_deadline(self, event: DeadlineReached, now: float) -> None:
        info = self.sessions.get(event.session_id)
        late = now - event.started_at
        self.late_s.append(late)
        self.metrics.deadline_started(late)
        stats = event.stats
        self.metrics.decoder_stall(stats.stall_time_s, stats.stalls)
        self.metrics.symbols_decoded(len(event.decoded_esis))
        self.metrics.redundant_repairs(stats.redundant_repairs)
        if info is None or info.app is None:  # the OFFER's application part never completed
            self._result_without_rebuild(event, late, "the OFFER's application data never arrived complete")
            return
        info.state = "generating"
        at = AtDeadline.of(event, late)
        front = info.front
        if front is not None:
            front.stop.set()  # the front job ends after its chunk; the rebuild runs next in the same worker
        # Filing, scoring, rebuild and generation all run in the worker: the loop keeps serving datagrams.
        try:
            job = self.worker.submit(self._rebuild, event.session_id, info.app, info.profile,
                                     event.decoded_esis, event.store, info.stream, front, info.live,
                                     force=front is not None or info.live_job)
        except WorkerBusy as exc:
            self._result_without_rebuild(event, late, f"receiver busy: {exc}")
            return
        self.jobs.add(job)
        job.add_done_callback(lambda fut: self._on_generated(event.session_id, at, fut))

    def _rebuild(self, sid: int, app: OfferApp, profile: UtilityProfile | None, decoded: np.ndarray,
                 store: np.ndarray, stream: StreamPlan | None, front: Front | None,
                 live: LiveRebuild | None = None) -> Reconstructed:
        """Worker thread: ``reconstruct`` (and answer), then the context goes to the prefix cache store."""
        done = reconstruct(self.runtime, self.identity, app, profile, decoded, store, stream, front, live)
        if done.kv is not None and self.keep is not None:
            done.kept = self.keep(sid, app, done)
        done.kv = None  # the store holds it (or refused it): the session's record does not
        return done

    def _result_without_rebuild(self, event: DeadlineReached, late: float, error: str) -> None:
        """Answer with an error RESULT so the session still ends (RESULT, then CLOSE or retries)."""
        sid = event.session_id
        session = self.endpoint.sessions.get(sid)
        if session is None:
            return
        if sid not in self.sessions:
            self.sessions[sid] = SessionInfo(sid, self.peers.get(sid), self.clock(), event.stats.deadline_at)
        info = self.sessions[sid]
        info.state = "result_sent"
        result = error_result(AtDeadline.of(event, late), self.default_mode, error)
        info.result = _record(sid, error=error)
        self.results.append(info.result)
        session.send_result(result.encode(), self.clock())

    def _on_generated(self, sid: int, at: AtDeadline, fut: asyncio.Future[Reconstructed]) -> None:
        self.jobs.discard(fut)
        now = self.clock()
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
        ttft = self._ttft(info, at, done)
        if ttft is not None:
            self.metrics.ttft(ttft)
        split = info.app.split if info.app else None
        local = info.app is not None and is_local(info.app)
        mode = "handoff" if split is None else ("local" if local else "split")
        result = result_of(done, at, ttft, info.app.mode if info.app else self.default_mode, mode, info.front,
                           at.reached_at - info.opened_at)
        record = _record(sid, **result.__dict__)
        record.pop("blocks_bitmap", None)
        if info.app is not None and info.app.prefix is not None:
            record["prefix_kept"] = done.kept
        if done.held is not None:  # how much of the context this node lacks, and on which hop it was lost
            record["missing"] = done.held.missing()
        info.result = record
        info.state = "result_sent"
        self.results.append(record)
        session = self.endpoint.sessions.get(sid)
        if session is not None:
            session.send_result(result.encode(), now)
        self.service(now)

    @staticmethod
    def _ttft(info: SessionInfo, at: AtDeadline, done: Reconstructed) -> float | None:
        """OFFER arrival -> first token, or None without one."""
        split = info.app.split if info.app else None
        if split is not None and done.rebuilt.first_token_at is not None:
            # As the worker saw it: the front's last chunk, the join and rebuild (or the rest of a local
            # prefill) and the forward are all inside.
            return done.rebuilt.first_token_at - info.opened_at
        if done.rebuilt.generation_ttft_s is not None:
            # The wait for the deadline (or for the last symbol, when ready first), start lateness, rebuild,
            # forward.
            return (at.reached_at + at.late_s + done.rebuilt.generation_ttft_s) - info.opened_at
        return None

    # ------------------------------------------------------------------ every session ends
    def reap(self, now: float, sweep_s: float) -> bool:
        """One sweep (every ``sweep_s``): a session past its deadline plus the grace without a RESULT gets
        an error RESULT (then CLOSE or RESULT retries end it); one still open after that too is closed with
        a REFUSE. True when it changed a session."""
        grace = self.limits.session_grace_s
        cfg = self.endpoint.config
        retries_s = cfg.result_retries * cfg.result_retry_s + sweep_s
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
                session.refuse(RefuseCode.OTHER, _REAPED)
                reaped = True
        return reaped

    def _give_up(self, sid: int, session: ReceiverSession, now: float) -> None:
        """The deadline plus grace passed without a RESULT (a stuck worker, an OFFER never complete)."""
        info = self.sessions.get(sid)
        if info is None:
            info = self.sessions[sid] = SessionInfo(sid, self.peers.get(sid), now, session.deadline)
        if session.decoding:  # its deadline never fired (cannot happen; be sure)
            session.refuse(RefuseCode.OTHER, _REAPED)
            return
        error = (f"receiver gave up: no result {self.limits.session_grace_s:g} s after the deadline "
                 "(limits.session_grace_s)")
        info.state = "result_sent"
        info.result = _record(sid, error=error)
        self.results.append(info.result)
        mode = info.app.mode if info.app else self.default_mode
        n_source = session.offer.n_source
        session.send_result(ResultApp(None, 0, 0, session.decoder.decoded_count, n_source,
                                      pack_bits(np.zeros(0, bool)), None, None, 0.0, None, mode,
                                      error=error).encode(), now)

    def _on_closed(self, event: SessionClosed) -> None:
        info = self.sessions.pop(event.session_id, None)
        if info is not None and info.front is not None:
            info.front.stop.set()
        reason = event.reason
        if info is None and reason.startswith("refused"):  # refused before it existed
            self.metrics.session_refused()
            self.results.append(_record(event.session_id, error=reason))
            return
        self.metrics.session_finished(_outcome(info, reason))
        if info is None or info.result is None:
            self.results.append(_record(event.session_id, error=reason))
