"""Sender daemon: holds the model, prepares each handoff in a worker thread, and streams it with one
``PacedTransfer`` (``sender/pacer.py``) per handoff.

A handoff goes: prepare (prefill or synthetic KV, in the worker) -> assemble the session
(``sender/transfer.py``, as the simulator does) -> stream over its own UDP socket until the RESULT, a
refusal, a failure or a cancel -> report (``sender/handoffs.py``). The control API
(``sender/control.py``) submits handoffs and reads their reports; ``sender/serve.py`` runs it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pfec.common.events import CpuMeter
from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_REPAIR_BUDGET
from pfec.common.plan.handoff import ModelIdentity, OfferApp, default_profile_name
from pfec.common.sched.policies import Scheme, get_scheme
from pfec.sender.handoffs import Handoff, HandoffSpec, plan_report, result_report, wire_report
from pfec.sender.kv import Prepared, full_kv_answer, prepare_model, prepare_synthetic
from pfec.sender.metrics import SenderMetrics
from pfec.sender.pacer import LINGER_S, LinkClock, PacedTransfer, clock
from pfec.sender.repair_plan import warm_up as planner_warm_up
from pfec.sender.transfer import LinkBudget, SenderSetup, SendQueue, assemble_sender

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

log = logging.getLogger("pfec.sender")
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
        window_cap: int = 64,
        repair_budget: float = DEFAULT_REPAIR_BUDGET,
        sndbuf: int = 8 << 20,
        metrics: SenderMetrics | None = None,
        result_wait_s: float = 2.0,
    ) -> None:
        get_scheme(scheme)
        planner_warm_up()  # codec and planner kernels compiled before any datagram, not mid-handoff
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
        self.transfers: set[PacedTransfer] = set()
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
        prepared = await self._prepare(spec, scheme, profile)
        handoff.prepared = prepared
        transfer = self._make_transfer(handoff, prepared, scheme, profile)
        await self._stream(handoff, transfer)
        utility = self._report_transfer(handoff, transfer, prepared)
        if spec.full_kv_answer and self.runtime is not None and prepared.cache is not None:
            handoff.report["full_kv_answer"] = await asyncio.get_running_loop().run_in_executor(
                self._executor, full_kv_answer, self.runtime, prepared, spec.max_new_tokens
            )
        return transfer.outcome, utility

    async def _prepare(self, spec: HandoffSpec, scheme: Scheme, profile: str) -> Prepared:
        """Prefill the context (or draw synthetic KV) in the worker thread; the loop keeps streaming."""
        loop = asyncio.get_running_loop()
        synthetic_tokens = spec.inputs.synthetic_tokens
        if synthetic_tokens is None:
            if self.runtime is None:
                raise ValueError("this sender runs without a model: give synthetic_tokens")
            prepared = await loop.run_in_executor(
                self._executor, prepare_model, self.runtime, self.identity, spec.inputs, scheme.order,
                profile, spec.full_kv_answer, spec.max_new_tokens,
            )
            self.metrics.prefill_done(prepared.prefill_s)
            return prepared
        return await loop.run_in_executor(
            self._executor, prepare_synthetic, self.identity, synthetic_tokens,
            scheme.order, profile, secrets.randbits(32), spec.inputs.question_ids or (),
        )

    async def _stream(self, handoff: Handoff, transfer: PacedTransfer) -> None:
        """Open the socket, stream until the transfer ends, then linger the socket out in the background."""
        self.transfers.add(transfer)
        try:
            await transfer.open(handoff.spec.receiver, self.sndbuf)
            handoff.state = "streaming"
            transfer.guarded(transfer.start)
            await transfer.finished
        finally:
            self.transfers.discard(transfer)
            closing = asyncio.get_running_loop().create_task(transfer.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _make_transfer(self, handoff: Handoff, prepared: Prepared, scheme: Scheme,
                       profile: str) -> PacedTransfer:
        spec = handoff.spec
        plan = prepared.plan
        rate_bps = (spec.rate_mbps or self.rate_mbps) * 1e6
        budget = LinkBudget.for_plan(plan, rate_bps, self.owd_s, spec.rho, spec.deadline_ms)
        generate = spec.generate and self.runtime is not None
        app = OfferApp(plan.n_tokens, prepared.question_ids, spec.mode, profile, scheme.order,
                       spec.max_new_tokens, self.identity.model_id, generate)
        setup = SenderSetup(
            scheme=scheme,
            repair_budget=self.repair_budget if spec.repair_budget is None else spec.repair_budget,
            window_cap=self.window_cap,
            fingerprint=self.fingerprint,
            psk=self.psk,
            result_wait_s=self.result_wait_s + (GENERATION_WAIT_S if app.generate else 0.0),
            app_blob=app.encode(),
        )
        sid = secrets.randbits(64)
        send = SendQueue(plan, prepared.queue, prepared.symbols, prepared.block_utility)
        session = assemble_sender(sid, send, budget, setup, CpuMeter(time.perf_counter_ns))
        handoff.report.update(plan_report(spec, prepared, budget, scheme.name, sid, profile))
        link = self._links.setdefault(rate_bps, LinkClock(rate_bps))
        return PacedTransfer(handoff, session, link, self.metrics)

    def _report_transfer(self, handoff: Handoff, transfer: PacedTransfer, prepared: Prepared) -> float | None:
        session = transfer.session
        report = handoff.report
        report.update(wire_report(session, transfer.bytes_sent, transfer.socket_errors))
        send_deadline = session.deadline - self.owd_s
        if transfer.last_data_at is not None:
            report["deadline_slack_ms"] = round((send_deadline - transfer.last_data_at) * 1000, 3)
        if transfer.failure is not None:
            report["failure"] = transfer.failure
        if transfer.result is None:
            return None
        section, utility = result_report(transfer.result, prepared)
        if "failure" in section:  # the transfer's own failure, if any, stays the one reported
            report.setdefault("failure", section.pop("failure"))
        report.update(section)
        return utility
