"""Sender daemon: holds the model, prepares each handoff in a worker thread, and streams it with one
``PacedTransfer`` (``sender/pacer.py``) per handoff.

A handoff goes: prepare (prefill or synthetic KV, in the worker) -> assemble the session
(``sender/transport/transfer.py``, as the simulator does) -> stream over its own UDP socket until the RESULT,
a refusal, a failure or a cancel -> report (``sender/handoffs.py``). The control API
(``sender/control.py``) submits handoffs and reads their reports; ``sender/serve.py`` runs it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pfec.common.events import CpuMeter
from pfec.common.node.config import SenderLimitsConfig
from pfec.common.node.multicast import check_groups, group_key
from pfec.common.node.openai.http import OpenAIFace
from pfec.common.node.profiles import ProfileStore
from pfec.common.node.udp import Destination, DestinationRefused, parse_networks, resolve_destination
from pfec.common.node.worker import ModelWorker, WorkerBusy
from pfec.common.plan.deadline import (
    AUTO_WINDOW,
    DEFAULT_RATE_MBPS,
    WHOLE_DEADLINE,
    repair_fraction,
)
from pfec.common.plan.handoff import ModelIdentity, OfferApp, ResultApp, SplitOffer, default_profile_name
from pfec.common.plan.stream import AUTO
from pfec.common.plan.utility import DEFAULT_PROFILE_DIR, ProfileError
from pfec.common.sched.open_loop_tail import DEFAULT_LOSS_PRIOR
from pfec.common.sched.policies import Scheme, get_scheme
from pfec.common.wire.group import GroupTicket
from pfec.common.wire.messages import MsgType, split_app
from pfec.sender.fanout import run_fanout
from pfec.sender.handoffs import (
    Handoff,
    HandoffSpec,
    plan_report,
    result_report,
    sent_bytes_by_level,
    wire_report,
)
from pfec.sender.kv import PrecisionRequest, Prepared, full_kv_answer, prepare_model, prepare_synthetic
from pfec.sender.metrics import SenderMetrics
from pfec.sender.pacer import LINGER_S, LinkClock, PacedTransfer, clock
from pfec.sender.paths import PathLinks, PathLossPriors, path_rate_report
from pfec.sender.peers import PeerMemory, PeerNumbers, front_slowdown
from pfec.sender.speed_ask import ask_speed
from pfec.sender.transport.repair_plan import warm_up as planner_warm_up
from pfec.sender.transport.transfer import LinkBudget, SenderSetup, SendQueue, assemble_sender

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

#: OFFER datagrams a receiver takes by default (``ReceiverConfig.max_offer_parts``): a longer blob is refused
#: here, before anything is sent.
MAX_OFFER_PARTS = 64


def offer_blob(app: OfferApp, prefix_optional: bool) -> tuple[OfferApp, bytes]:
    """The OFFER's application data within the ``MAX_OFFER_PARTS`` datagrams a receiver takes. A
    question/answer handoff's prefix (the context's ids, for the receiver's prefix cache; its answer does
    not need them) is left off when only it breaks the bound; ValueError when the rest does too."""
    blob = app.encode()
    parts = len(split_app(blob, MsgType.OFFER))
    if parts <= MAX_OFFER_PARTS:
        return app, blob
    if prefix_optional and app.prefix is not None:
        return offer_blob(replace(app, prefix=None), prefix_optional=False)
    raise ValueError(f"the OFFER's application data needs {parts} datagrams, above the "
                     f"{MAX_OFFER_PARTS} a receiver takes (a split carries the context's token ids: "
                     "use --mode handoff for this context)")


log = logging.getLogger("pfec.sender")


def _plans(spec: HandoffSpec) -> bool:
    """Whether the break-even planner decides this handoff (it then predicts the receiver's prefill)."""
    return spec.inputs.synthetic_tokens is None and (spec.precision == AUTO or spec.handoff_mode != "handoff")


GENERATION_WAIT_S = 30.0  # extra RESULT wait when the receiver generates an answer before replying


class SenderDaemon:
    """Handoffs by id; the model (if any) is used from one worker thread."""

    HANDOFFS_KEPT = 256

    def __init__(
        self,
        identity: ModelIdentity,
        psk: bytes,
        *,
        runtime: ModelRuntime | None = None,
        rate_mbps: float = DEFAULT_RATE_MBPS,
        owd_ms: float = 10.0,
        scheme: str = "heuristic",
        window_cap: int = AUTO_WINDOW,  # 0: sized from the path per handoff (fec.window_cap)
        repair_budget: float | str = WHOLE_DEADLINE,  # or a cap: a fraction of the source symbols
        sndbuf: int = 8 << 20,
        metrics: SenderMetrics | None = None,
        result_wait_s: float = 2.0,
        limits: SenderLimitsConfig | None = None,
        profiles: ProfileStore | None = None,
        loss_prior: float = DEFAULT_LOSS_PRIOR,
        rate_control: str = "path",
        max_rate_mbps: float | None = None,
        worker: ModelWorker | None = None,
        face: OpenAIFace | None = None,
        multicast_groups: Sequence[str] = (),
        multicast_interface: str | None = None,
        multicast_ttl: int = 1,
    ) -> None:
        get_scheme(scheme)
        planner_warm_up()  # codec and planner kernels compiled before any datagram, not mid-handoff
        self.identity = identity
        self.psk = psk
        self.runtime = runtime
        self.fingerprint = identity.fingerprint()
        self.rate_mbps = rate_mbps
        self.owd_s = owd_ms / 1000.0
        # fixed: one transmit clock per pacing rate; path: one clock and one controller per receiver
        self.links = PathLinks(rate_control, None if max_rate_mbps is None else max_rate_mbps * 1e6,
                               rtt_prior_s=2 * self.owd_s)
        self.rate_control = rate_control
        self.scheme = scheme
        self.window_cap = window_cap
        self.repair_budget = repair_fraction(repair_budget)  # None: the whole deadline
        self.sndbuf = sndbuf
        self.result_wait_s = result_wait_s
        self.path_loss = PathLossPriors(loss_prior)  # loss priors of the receivers handed off to before
        self.peers = PeerMemory()  # their stated prefill speeds and measured RTTs, for the planner
        self.metrics = metrics or SenderMetrics(process_metrics=False)
        self.handoffs: dict[str, Handoff] = {}
        self.default_profile = default_profile_name(identity)
        self.limits = limits or SenderLimitsConfig()
        self.allow = parse_networks(self.limits.allow_destinations)
        # A multicast fan-out goes only to these group destinations (``[udp] multicast_group``; the first is
        # the default), through this interface, with this TTL (sender/multicast.py).
        self.multicast_groups = tuple(check_groups(multicast_groups))
        self.multicast_interface = multicast_interface
        self.multicast_ttl = multicast_ttl
        self.profiles = profiles or ProfileStore(DEFAULT_PROFILE_DIR)
        # Prefill and the full-KV answer: one thread, a bounded queue (POST /handoffs answers 503 when full).
        # A node with both roles (pfec.node) passes the worker and face they share; close() shuts down only
        # a worker made here.
        self._own_worker = worker is None
        self.worker = worker or ModelWorker("pfec-prefill", self.limits.worker_queue,
                                            self.limits.worker_stuck_s)
        # The OpenAI API for the upstream agent; its conversations' caches are what POST /handoffs can name.
        self.face = face if face is not None or runtime is None else OpenAIFace(
            runtime, self.worker, self.metrics, self.limits, max_json_depth=self.limits.max_json_depth)
        self._waiting: set[str] = set()  # handoffs admitted whose prepare job is not submitted yet
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self.transfers: set[PacedTransfer] = set()
        self.shutting_down = False  # set by close(): no transfer starts after it

    # ------------------------------------------------------------------ API
    def submit(self, spec: HandoffSpec) -> Handoff:
        """Start a handoff; WorkerBusy when the model worker's queue is full (nothing is started then)."""
        if spec.scheme is not None:
            get_scheme(spec.scheme)
        if self.worker.pending + len(self._waiting) >= self.worker.queue:
            waiting = self.worker.pending + len(self._waiting)
            raise WorkerBusy(f"the sender has {waiting} handoffs waiting for its model worker "
                             f"(limits.worker_queue = {self.worker.queue}); retry later")
        handoff = Handoff(f"h{next(self._ids):06d}-{secrets.token_hex(3)}", spec, time.time())
        self.handoffs[handoff.id] = handoff
        self._waiting.add(handoff.id)
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
        self.shutting_down = True
        for transfer in list(self.transfers):
            transfer.cancel("sender shutting down")
        if self.transfers:
            await asyncio.sleep(LINGER_S)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._own_worker:
            self.worker.shutdown()

    def health(self) -> dict[str, Any]:
        """Liveness (``/healthz``): the loop answers."""
        return {
            "status": "ok",
            "role": "sender",
            "model": self.identity.model_id,
            "fingerprint": self.fingerprint.hex()[:16],
            "active_handoffs": len(self.transfers),
            "handoffs": len(self.handoffs),
            "worker": self.worker.view(),
        }

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (``/readyz``): red while the model worker runs a job past ``limits.worker_stuck_s``."""
        return self.worker.readiness("sender")

    def multicast_group(self, requested: str | None) -> str:
        """The group destination of a multicast fan-out: the request's (one of the configured groups) or
        the first configured; ValueError says why not (the control API answers 422 naming ``group``)."""
        if not self.multicast_groups:
            raise ValueError("this sender has no multicast group configured ([udp] multicast_group): a "
                             "multicast fan-out needs one")
        if requested is None:
            return self.multicast_groups[0]
        key = group_key(requested)
        for group in self.multicast_groups:
            if group_key(group) == key:
                return group
        raise ValueError(f"{requested.strip()!r} is not one of this sender's multicast groups "
                         f"({', '.join(self.multicast_groups)}; [udp] multicast_group)")

    async def destination(self, spec: HandoffSpec) -> Destination:
        """The spec's receiver resolved once (off the loop) and checked; DestinationRefused otherwise."""
        if spec.destination is not None:
            return spec.destination
        return await resolve_destination(spec.receiver[0], spec.receiver[1], self.allow)

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
        except (DestinationRefused, ProfileError, WorkerBusy) as exc:  # the request's fault: no traceback
            log.warning("handoff %s refused: %s", handoff.id, exc)
            handoff.report["failure"] = str(exc)
        except Exception as exc:  # a handoff's failure must never take the daemon down
            log.exception("handoff %s failed", handoff.id)
            handoff.report["failure"] = f"{type(exc).__name__}: {exc}"
        finally:
            self._waiting.discard(handoff.id)
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
        self._check_bounds(spec)
        if spec.receivers:  # one preparation; a stream per receiver, or one to the group (sender/fanout.py)
            return await run_fanout(self, handoff, scheme, profile)
        destination = await self.destination(spec)
        prepared = await self._prepare(handoff, scheme, profile, destination)
        handoff.prepared = prepared
        transfer = self._make_transfer(handoff, prepared, scheme, profile, destination)
        await self._stream(handoff, transfer, destination)
        self.path_loss.record(destination.address, *transfer.session.measured_loss)
        self.peers.record(destination.address, handoff.stated_receiver, transfer.session.view.rtt_estimate,
                          self._front_slowdown(handoff, transfer.result, destination.address))
        if (rate := transfer.link.controller) is not None and rate.rounds:
            self.peers.record_rate(destination.address, prepared.handoff_mode, rate.forecast_bps)
        utility = self._report_transfer(handoff, transfer, prepared)
        if spec.full_kv_answer and self.runtime is not None and prepared.cache is not None:
            handoff.report["full_kv_answer"] = await self.worker.submit(
                full_kv_answer, self.runtime, prepared, spec.max_new_tokens, force=True
            )
            handoff.report["full_kv_wire_answer"] = await self.worker.submit(
                full_kv_answer, self.runtime, prepared, spec.max_new_tokens, True, force=True
            )
        return transfer.outcome, utility

    def _front_slowdown(self, handoff: Handoff, result: ResultApp | None, address: str) -> float | None:
        """A split's front against the speed its receiver stated (``peers.front_slowdown``), reported;
        None for anything else."""
        stated = handoff.stated_receiver or self.peers.get(address).receiver
        if result is None or result.handoff_mode != "split" or stated is None:
            return None
        slowdown = front_slowdown(stated, result.computed_tokens, result.front_s)
        handoff.report["front_slowdown"] = None if slowdown is None else round(slowdown, 4)
        return slowdown

    def _check_bounds(self, spec: HandoffSpec) -> None:
        """The configured bounds, for specs that did not come through the control API (which 422s)."""
        limits = self.limits
        n = spec.inputs.synthetic_tokens
        if n is not None and not 0 < n <= limits.max_context_tokens:
            raise ValueError(f"synthetic_tokens: {n} is outside 1..{limits.max_context_tokens} "
                             "(limits.max_context_tokens)")
        if spec.deadline_ms is not None and not 0 < spec.deadline_ms <= limits.max_budget_ms:
            raise ValueError(f"deadline_ms: {spec.deadline_ms:g} is outside (0, {limits.max_budget_ms:g}] "
                             "(limits.max_budget_ms)")

    async def _prepare(self, handoff: Handoff, scheme: Scheme, profile: str,
                       destination: Destination) -> Prepared:
        """Prefill the context (or draw synthetic KV) in the worker thread; the loop keeps streaming."""
        spec = handoff.spec
        if spec.inputs.synthetic_tokens is None and self.runtime is None:
            raise ValueError("this sender runs without a model: give synthetic_tokens")
        self._waiting.discard(handoff.id)  # its slot in the queue passes to the job
        address = destination.address
        speed_from = "stated by the receiver after an earlier handoff"
        if self.peers.get(address).receiver is None and _plans(spec):
            speed_from = await self._ask_speed(handoff, destination)
        peer = self.peers.get(address)
        loss = self.path_loss.measured(address)
        plan_rate_bps, rate_from = self._planning_rate(address)
        split_rate = peer.split_rate_bps if plan_rate_bps is not None else None
        handoff.report["planner_inputs"] = {  # what the planner predicts from: measured, or a prior
            "rate_mbps": round((plan_rate_bps or (spec.rate_mbps or self.rate_mbps) * 1e6) / 1e6, 3),
            "rate_from": rate_from,
            "receiver_speed": speed_from if peer.receiver else "stored curve",
            "rtt_ms": round(1000 * (peer.rtt_s if peer.rtt_s is not None else 2 * self.owd_s), 3),
            "rtt_from": "measured" if peer.rtt_s is not None else "configured owd_ms",
            "loss": round(loss or 0.0, 5),
            "loss_from": "measured" if loss is not None else "none measured yet",
            "front_slowdown": None if peer.front_slowdown is None else round(peer.front_slowdown, 4),
            "split_rate_mbps": None if split_rate is None else round(split_rate / 1e6, 3),
        }
        prepared = await self.worker.submit(self._prepare_job, spec, scheme.order, profile,
                                            secrets.randbits(32), peer, loss or 0.0, plan_rate_bps,
                                            split_rate, force=True)
        if spec.inputs.synthetic_tokens is None:
            self.metrics.prefill_done(prepared.prefill_s)
        if prepared.planner is not None and not prepared.planner.get("predicted_only"):
            self.metrics.planner_choice(prepared.planner["choice"])
        self.metrics.handoff_mode(prepared.handoff_mode)
        return prepared

    async def _ask_speed(self, handoff: Handoff, destination: Destination) -> str:
        """The first handoff to a receiver that the planner decides: ask its speed before planning (one
        round trip; the tries are bounded, ``speed_query.QUERY_TRIES``). Returns where the planner's
        speed comes from; the answer's round trip is the path's first RTT sample."""
        answer = await ask_speed(destination, self.psk, self.fingerprint, 2 * self.owd_s)
        handoff.report["speed_query"] = {
            "stated": answer.receiver is not None,
            "rtt_ms": None if answer.rtt_s is None else round(answer.rtt_s * 1000, 3),
            **({"why": answer.why} if answer.why else {}),
        }
        if answer.receiver is None and answer.rtt_s is None:
            log.info("handoff %s: %s; planning on the stored curve", handoff.id, answer.why)
        self.peers.record_query(destination.address, answer.receiver, answer.rtt_s)
        return "stated by the receiver (asked before this first handoff)"

    def paths_view(self) -> list[dict[str, Any]]:
        """Each receiver's path controller as it stands (``GET /paths``; path control only): the per-peer
        view beside each handoff's ``path_rate`` and the metrics' latest values."""
        return self.links.view()

    def _planning_rate(self, address: str) -> tuple[float | None, str]:
        """The rate the planner divides by for a whole-cache handoff to ``address`` and where it comes
        from: under ``path``, the cautious forecast of that receiver's controller once a handoff there
        measured it, as the newest whole-cache handoff left it (a split's stream delivers less where the
        receiver's CPU bounds it; ``PeerNumbers.split_rate_bps`` plans the split's back)."""
        rate = self.links.controller(address)
        if rate is None or not rate.rounds:
            return None, "told (link.rate_mbps or the request's rate_mbps)"
        whole = self.peers.get(address).handoff_rate_bps
        if whole is not None:
            return whole, "forecast of the path's measured rate after its newest whole-cache handoff"
        return rate.forecast_bps, f"forecast of the path's measured rate ({rate.rounds} round trips)"

    def _prepare_job(self, spec: HandoffSpec, order: str, profile_name: str, seed: int,
                     peer: PeerNumbers, loss: float, plan_rate_bps: float | None = None,
                     split_rate_bps: float | None = None) -> Prepared:
        """Worker thread: the profile by name (this node's profile directory), then the KV. The planner
        predicts with what past handoffs to this receiver measured (``peer``, ``loss``, the path's
        forecast rate ``plan_rate_bps``), priors where none did."""
        profile = self.profiles.load(profile_name, self.identity.geometry.n_layers)
        n = spec.inputs.synthetic_tokens
        rtt_s = peer.rtt_s if peer.rtt_s is not None else 2 * self.owd_s
        precision = PrecisionRequest(spec.precision, (spec.rate_mbps or self.rate_mbps) * 1e6, rtt_s,
                                     spec.handoff_mode, spec.rho if spec.deadline_ms is None else None,
                                     spec.deadline_ms, peer.planner_receiver(), loss, plan_rate_bps,
                                     split_rate_bps)
        if n is not None:
            return prepare_synthetic(self.identity, n, order, profile, profile_name, seed,
                                     spec.inputs.question_ids or (), precision)
        assert self.runtime is not None
        return prepare_model(self.runtime, self.identity, spec.inputs, order, profile, profile_name,
                             spec.full_kv_answer, spec.max_new_tokens, self.limits.max_context_tokens,
                             precision)

    async def _stream(self, handoff: Handoff, transfer: PacedTransfer, destination: Destination) -> None:
        """Open the socket, stream until the transfer ends, then linger the socket out in the background."""
        self.transfers.add(transfer)
        try:
            if not self.shutting_down:
                await transfer.open(destination, self.sndbuf)
            if self.shutting_down:
                # close() began before this stream started (it may have cancelled the transfer while the
                # socket opened): nothing went out, so the handoff ends as cancelled, the session unstarted.
                transfer.cancel("sender shutting down")
                return
            handoff.state = "streaming"
            handoff.report["accepted"] = False  # until the receiver's ACCEPT
            transfer.guarded(transfer.start)
            await transfer.finished
        finally:
            self.transfers.discard(transfer)
            closing = asyncio.get_running_loop().create_task(transfer.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _make_transfer(self, handoff: Handoff, prepared: Prepared, scheme: Scheme, profile: str,
                       destination: Destination, link: LinkClock | None = None) -> PacedTransfer:
        spec = handoff.spec
        plan = prepared.plan
        rate_bps = (spec.rate_mbps or self.rate_mbps) * 1e6
        budget = LinkBudget.for_plan(plan, rate_bps, self.owd_s, spec.rho, spec.deadline_ms)
        if budget.deadline_s * 1000 > self.limits.max_budget_ms:
            raise ValueError(
                f"deadline: the handoff's budget of {budget.deadline_s * 1000:.0f} ms is above "
                f"limits.max_budget_ms ({self.limits.max_budget_ms:g} ms); lower rho or deadline_ms, or "
                "raise rate_mbps"
            )
        stream = prepared.stream
        split = prepared.split
        app, blob = self._offer_blob(spec, prepared, scheme, profile)
        setup = SenderSetup(
            scheme=scheme,
            repair_budget=(self.repair_budget if spec.repair_budget is None
                           else repair_fraction(spec.repair_budget)),
            window_cap=self.window_cap,
            fingerprint=self.fingerprint,
            psk=self.psk,
            result_wait_s=self.result_wait_s + (GENERATION_WAIT_S if app.generate else 0.0),
            app_blob=blob,
            loss_prior=self.path_loss.prior(destination.address),
        )
        sid = secrets.randbits(64)
        send = SendQueue(plan, prepared.queue, prepared.symbols, prepared.block_utility,
                         None if stream is None else stream.block_of_symbol,
                         None if split is None or split.meeting_token >= plan.n_tokens else split.token_ends)
        if link is None:  # a fan-out's sessions share the uplink's clock (and controller) it passes
            link = self.links.link_for(destination.address, budget, setup.loss_prior)
        session = assemble_sender(sid, send, budget, setup, CpuMeter(time.perf_counter_ns), link.controller)
        handoff.report.update(plan_report(spec, prepared, budget, scheme.name, sid, profile, destination))
        prefilled = spec.inputs.prefilled
        if prefilled is not None:  # what the receiver will hold for the conversation
            handoff.report["conversation"] = {
                "n_tokens": len(prefilled.context_ids), "cached_tokens": prefilled.cached_tokens,
                "prefilled_tokens": len(prefilled.context_ids) - prefilled.cached_tokens,
                "cache_salt": bool(prefilled.salt)}
            if prepared.held is not None:  # received before: what of it this node lacked when it sent it
                handoff.report["conversation"]["missing_upstream"] = prepared.held.missing()
        if prepared.prefix is not None:  # whether the receiver may keep the context for later requests
            handoff.report["prefix_offered"] = app.prefix is not None
        fraction = setup.repair_budget
        handoff.report["repair_budget"] = WHOLE_DEADLINE if fraction is None else fraction
        return PacedTransfer(handoff, session, link, self.metrics)

    def _offer_blob(self, spec: HandoffSpec, prepared: Prepared, scheme: Scheme, profile: str,
                    group: GroupTicket | None = None) -> tuple[OfferApp, bytes]:
        """The OFFER's application data for ``prepared`` (with a multicast fan-out's group ticket)."""
        stream = prepared.stream
        split = prepared.split
        generate = spec.generate and self.runtime is not None
        app = OfferApp(prepared.plan.n_tokens, prepared.question_ids, spec.mode, profile, scheme.order,
                       spec.max_new_tokens, self.identity.model_id, generate,
                       None if stream is None else stream.offer,
                       None if split is None else SplitOffer(split.meeting_token, split.context_ids),
                       prepared.prefix, prepared.held, group)
        return offer_blob(app, prefix_optional=spec.inputs.prefilled is None)

    def _report_transfer(self, handoff: Handoff, transfer: PacedTransfer, prepared: Prepared) -> float | None:
        session = transfer.session
        report = handoff.report
        report.update(wire_report(session, transfer.bytes_sent, transfer.socket_errors))
        for level, nbytes in sent_bytes_by_level(prepared, session.datagrams_sent["source"]).items():
            self.metrics.precision_bytes_sent(level, nbytes)
        send_deadline = session.deadline - self.owd_s
        if transfer.last_data_at is not None:
            report["deadline_slack_ms"] = round((send_deadline - transfer.last_data_at) * 1000, 3)
        if transfer.failure is not None:
            report["failure"] = transfer.failure
        if (rate := transfer.link.controller) is not None:
            report["path_rate"] = path_rate_report(rate, transfer.congestion_at_start)
            self.metrics.path_rate(rate.estimate_bps, rate.min_rtt, rate.queue_delay_s,
                                   rate.congestion_events - transfer.congestion_at_start)
        if transfer.result is None:
            return None
        section, utility = result_report(transfer.result, prepared)
        if "failure" in section:  # the transfer's own failure, if any, stays the one reported
            report.setdefault("failure", section.pop("failure"))
        report.update(section)
        return utility
