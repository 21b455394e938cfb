"""Daemons over real sockets: handoffs through the UDP relay, failures, hostile datagrams, refusal, the
control API and the CLI, and (root) two network namespaces joined by the TUN emulator.

Most tests use a tiny random-init Llama (fast) or synthetic KV (no model); tests/test_demo.py runs the
real default model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.common.codec import fec
from pfec.common.model import llm
from pfec.common.model.runtime import runtime_identity
from pfec.common.model.speed import PrefillSpeed
from pfec.common.node.control import ControlClient, ControlServer
from pfec.common.node.eventloop import run_event_loop
from pfec.common.node.udp import UDP_SEGMENT, open_udp_socket
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.plan.prefill import PrefillCurve
from pfec.common.plan.receiver_speed import MeasuredParts, RecentPrefills, stated_fields
from pfec.common.plan.utility import synthetic_profile
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import Role, Source
from pfec.common.wire.seal import PacketProtector
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.emulator.netns import (
    NetnsSpec,
    TunBridge,
    netns_available,
    setup_namespaces,
    teardown_namespaces,
)
from pfec.lab.emulator.relay import UdpRelay
from pfec.lab.processes import Child, node_cpu_sets, pinned
from pfec.lab.sim.channel import Bernoulli
from pfec.receiver import handoffs as receiver_handoffs
from pfec.receiver.control import session_views
from pfec.receiver.daemon import TIMER_EARLY_S, TIMER_STEP_S, ReceiverDaemon, timer_fires_at
from pfec.receiver.rebuild import Front, compute_front
from pfec.receiver.session import ReceiverConfig
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import Handoff, HandoffSpec
from pfec.sender.kv import ContextInput, plan_stream
from pfec.sender.pacer import PacedTransfer
from pfec.sender.transport.session import ResultReceived, SenderSession

T = TypeVar("T")
PSK = bytes(range(100, 132))
VOCAB = 96
SMALL = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=32, dtype="bf16")  # 1 KiB of KV per token
REPO = Path(__file__).resolve().parent.parent


def run(main: Coroutine[Any, Any, T]) -> T:
    return run_event_loop(main)


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    fec.warm_up()


def _context(n: int = 150, seed: int = 0) -> str:
    return " ".join(f"w{i}" for i in np.random.default_rng(seed).integers(3, VOCAB, size=n))


async def _wait(handoff: Handoff, timeout: float = 60.0) -> dict[str, Any]:
    await asyncio.wait_for(handoff.done.wait(), timeout)
    return handoff.view()


# --------------------------------------------------------------------------- handoffs


def test_every_handoff_plans_with_the_receivers_stated_speed_and_the_measured_rtt(
        tiny: llm.ModelRuntime) -> None:
    """The receiver measures its prefill speed and states it in its ACCEPTs and in answer to a speed query;
    the first handoff to it asks before planning (the answer's round trip is the first RTT sample), the
    sender keeps the statement (and the path's measured RTT) for that receiver, and the next handoff's
    planner uses them without asking."""
    identity = runtime_identity(tiny)

    async def main() -> tuple[dict[str, Any], dict[str, Any], Any]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        measured = await rx.measure_prefill_speed()
        assert measured is not None
        statement = stated_fields(measured.curve, measured.decode_s, measured.parts)
        assert rx.endpoint.prefill_statement == statement
        # every part the planner predicts, measured here (the receive path by the daemon itself)
        parts = measured.parts
        assert parts.rebuild_s_per_token is not None and parts.question_fit is not None
        assert parts.datagram_s is not None and 0 < parts.datagram_s < 0.01
        # The tiny model's per-token cost is in the timing noise (a fit may state none, which the sender
        # defaults): state a known curve, and the parts as measured, for the planner's side of the test.
        speed = PrefillSpeed(PrefillCurve(0.01, 2e-4, 1e-8), (), 0.005, 1, "cpu", "tiny", parts)
        rx.endpoint.prefill_statement = stated_fields(speed.curve, speed.decode_s, parts)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=5)
        reports = []
        for _ in range(2):
            h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                      rx.address, rho=4.0, max_new_tokens=2, precision="auto"))
            reports.append(await _wait(h))
        await tx.close()
        await rx.close()
        return reports[0], reports[1], speed

    first, second, speed = run(main())
    assert first["outcome"] == second["outcome"] == "done", (first, second)
    asked = "stated by the receiver (asked before this first handoff)"
    assert first["planner_inputs"]["receiver_speed"] == asked
    assert first["speed_query"]["stated"] is True and first["speed_query"]["rtt_ms"] > 0, first["speed_query"]
    assert first["planner_inputs"]["rtt_from"] == "measured"
    assert first["planner_inputs"]["rtt_ms"] == first["speed_query"]["rtt_ms"]
    stated = first["receiver_stated_prefill"]
    assert stated["b"] == pytest.approx(speed.curve.b, rel=1e-3, abs=1e-9), (stated, speed)
    assert second["planner_inputs"]["receiver_speed"] == "stated by the receiver after an earlier handoff"
    assert "speed_query" not in second
    assert second["planner_inputs"]["rtt_from"] == "measured" and second["planner_inputs"]["rtt_ms"] > 0
    for report in (first, second):
        owd_s = report["planner_inputs"]["rtt_ms"] / 2000
        n = first["n_tokens"]
        local = owd_s + speed.curve.seconds(n) + speed.decode_s + speed.parts.decode_s_per_token * n
        assert report["predicted_local_ttft_s"] == pytest.approx(local, rel=0.05), report
        # planned with what the receiver measured, and each predicted part beside what it took there
        planner = report["planner"]
        assert planner["receiver_defaulted"] == [], planner
        measured_fit = planner["receiver_measured"]["question_fit"]
        assert measured_fit == pytest.approx(speed.parts.question_fit, rel=1e-3)
        table = report["predicted_vs_measured"]
        rows = {"local": ("front_s", "decode_s", "ttft_s"),
                "handoff": ("ready_s", "rebuild_s", "question_s", "decode_s", "ttft_s"),
                "split": ("ready_s", "front_s", "rebuild_s", "question_s", "decode_s", "ttft_s")}
        for part in rows[report["handoff_mode"]]:
            assert table[part]["predicted"] is not None and table[part]["measured"] is not None, (part, table)


def test_the_report_gives_each_predicted_part_beside_what_it_took(tiny: llm.ModelRuntime) -> None:
    """A whole-cache handoff's report: the ready time, rebuild, question's forward, decode step and TTFT
    the planner predicted from the receiver's measurements, each beside what its RESULT says they took."""
    identity = runtime_identity(tiny)
    parts = MeasuredParts((1e-6, 2e-6, 2e-6, 2e-6), (0.001, 1e-5, 1e-6), 1e-7, 20e-6)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        rx.endpoint.prefill_statement = stated_fields(PrefillCurve(0.01, 2e-4, 1e-8), 0.005, parts)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                  rx.address, rho=4.0, max_new_tokens=3, precision="int8",
                                  handoff_mode="handoff"))
        report = await _wait(h)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "done" and report["handoff_mode"] == "handoff", report
    predicted = report["planner"]["predicted_parts"]
    assert predicted["rebuild_s"] == pytest.approx(report["n_tokens"] * 2e-6, rel=1e-3, abs=1e-4)
    table = report["predicted_vs_measured"]
    assert table["rebuild_s"]["measured"] == pytest.approx(report["rebuild_s"], abs=1e-4)
    assert table["question_s"]["predicted"] == pytest.approx(predicted["question_s"], abs=1e-4)
    for part in ("ready_s", "rebuild_s", "question_s", "decode_s", "ttft_s"):
        row = table[part]
        assert row["predicted"] > 0 and row["measured"] > 0, (part, table)
        # The ratio comes from the unrounded times and is rounded to 3 places; the row's times are rounded to
        # 0.1 ms (a part of a few tenths of a ms moves by a tenth or more under rounding, as CI saw: 0.012
        # against 0.0111).
        half = 5e-5
        low = (row["measured"] - half) / (row["predicted"] + half)
        high = (row["measured"] + half) / max(row["predicted"] - half, 1e-9)
        assert low - 5e-4 <= row["measured_over_predicted"] <= high + 5e-4, (part, row)


def test_a_receiver_that_states_no_speed_leaves_the_first_handoff_on_the_stored_curve(
        tiny: llm.ModelRuntime) -> None:
    """A receiver that has not measured itself answers the speed query without a statement: the planner
    says it predicts from the stored curve, and the handoff runs as before."""
    identity = runtime_identity(tiny)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=5)
        h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                  rx.address, rho=4.0, max_new_tokens=2, precision="auto"))
        report = await _wait(h)
        assert rx.endpoint.speed_queries == 1 and not rx.endpoint.sessions
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "done", report
    assert report["planner_inputs"]["receiver_speed"] == "stored curve"
    assert report["speed_query"] == {"stated": False, "rtt_ms": report["speed_query"]["rtt_ms"],
                                     "why": "the receiver states no speed"}


def test_handoff_through_lossy_relay_matches_full_kv_answer(tiny: llm.ModelRuntime) -> None:
    """Tiny model, 10% loss at 20 Mbit/s: everything is recovered and the answers agree.

    The handoff is small (tens of data datagrams next to several OFFER parts), so under load a run can
    lose only control datagrams (repeated OFFERs cover them) and need no repair; when a data datagram
    is lost, repairs must have been sent."""
    identity = runtime_identity(tiny)
    link = EmulatorConfig(DirectionSpec(20e6, 0.005, Bernoulli(0.1)), DirectionSpec(20e6, 0.005), seed=3)

    async def main() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], bytes]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        async with UdpRelay(link, ("127.0.0.1", 0), rx.address) as relay:
            tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=5, scheme="heuristic")
            h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                      relay.listen_address, rho=5.0, full_kv_answer=True, max_new_tokens=6,
                                      repair_budget=0.5, precision="native"))
            report = await _wait(h)
            stats = relay.stats()
            await tx.close()
        metrics = rx.metrics.exposition()
        await rx.close()
        return report, stats, list(rx.results), metrics

    report, stats, results, metrics = run(main())
    assert report["outcome"] == "done", report
    assert stats["forward"]["lost"] > 0, stats
    # More gaps than control datagrams sent: at least one SOURCE/REPAIR was lost.
    data_lost = results[-1]["stats"]["lost"] > report["control_sent"] if results else True
    assert report["repair_sent"] > 0 or not data_lost, (stats, report)
    assert report["recovered_utility"] == pytest.approx(1.0), report
    assert report["blocks_recovered"] == report["n_blocks"]
    assert report["answer"] == report["full_kv_answer"] and report["answer"], report
    # Every byte arrived at the wire's dtype: the answer of the intact cache rounded to it.
    assert report["full_kv_wire_answer"] == report["answer"], report
    assert report["precision"] == "native" and report["stream_bytes"] == report["native_bytes"], report
    # Everything decoded: the receiver started when ready, not at the deadline.
    assert report["start"] == "ready" and report["ttft_s"] < report["deadline_ms"] / 1000, report
    assert report["source_sent"] == report["n_source"]
    assert results and results[-1]["recovered_utility"] == pytest.approx(1.0)
    assert b"pfec_receiver_sessions_total{outcome=\"done\"} 1.0" in metrics


def test_partial_delivery_scores_like_the_blocks_received() -> None:
    """A deadline too short for the context: part of the KV arrives, utility is in (0, 1) on both sides."""
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, scheme="priority", result_wait_s=1,
                          rate_control="fixed")  # the told rate is the link (loopback is faster)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=2048), rx.address, rho=0.4, generate=False))
        report = await _wait(h)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "done", report
    assert 0.2 < report["recovered_utility"] < 0.95, report
    assert report["receiver_recovered_utility"] == pytest.approx(report["recovered_utility"])
    assert report["source_sent"] < report["n_source"]
    assert report["deadline_slack_ms"] >= -10.0  # the last send stays at the deadline (a loaded loop lags)


def test_pacing_holds_the_link_rate() -> None:
    """No loss, a long deadline: the stream takes its serialisation time at the configured rate; the
    loss the handoff measured becomes the receiver's loss prior for the next one."""
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], dict[str, float]]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, scheme="priority", loss_prior=0.2,
                          rate_control="fixed")  # told rate = the link (loopback is faster)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=512), rx.address, rho=3.0, generate=False))
        report = await _wait(h)
        where = report["receiver_address"]
        priors = {where: tx.path_loss.prior(where), "other:1": tx.path_loss.prior("other:1")}
        await tx.close()
        await rx.close()
        return report, priors

    report, priors = run(main())
    assert report["outcome"] == "done" and report["source_sent"] == report["n_source"], report
    assert priors == {report["receiver_address"]: 0.0, "other:1": 0.2}  # loopback loses nothing
    streamed_s = (report["deadline_ms"] - 1.0 - report["deadline_slack_ms"]) / 1000
    wire_s = report["bytes_sent"] * 8 / 20e6
    assert 0.9 * wire_s <= streamed_s <= 1.3 * wire_s + 0.01, (streamed_s, wire_s)


def test_receiver_polls_only_for_a_deadline_never_for_its_acks() -> None:
    """Only a session's deadline is kept to the microsecond by polling the loop; ACK and RESULT timers fire
    a loop step late instead. Polling for every ACK made 500-1,200 loop turns per ACK (150k-340k for a
    2,048-token handoff): on a one-core node, CPU taken from the split's front prefill."""
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], int]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, scheme="priority", rate_control="fixed")
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=2048), rx.address, rho=3.0, generate=False))
        report = await _wait(h)
        polls = rx.timer_polls
        await tx.close()
        await rx.close()
        return report, polls

    report, polls = run(main())
    acks = report["receiver_stats"]["acks_sent"]
    assert report["outcome"] == "done" and report["start"] != "deadline" and acks > 50, report
    assert polls <= acks, (polls, acks)  # at most a step-early fire per timer, not a poll loop


def test_timer_fires_a_step_early_only_for_the_deadline() -> None:
    assert timer_fires_at(5.0, 5.0) == pytest.approx(5.0 - TIMER_EARLY_S)
    assert timer_fires_at(4.0, 5.0) == pytest.approx(4.0 + TIMER_STEP_S)
    assert timer_fires_at(4.0, None) == pytest.approx(4.0 + TIMER_STEP_S)
    # An ACK due within a step of the deadline does not carry the deadline past its time.
    assert timer_fires_at(5.0 - TIMER_STEP_S / 2, 5.0) == pytest.approx(5.0 - TIMER_EARLY_S)


def test_receiver_killed_mid_stream_sender_reports_and_recovers() -> None:
    """The receiver node in a child process on its own CPUs (2+ CPUs), the sender here on the others."""
    identity = synthetic_identity(SMALL)
    cpus = node_cpu_sets()
    child = Child("receiver", cpus=cpus.pin("receiver"), model="synthetic", psk=PSK, geometry=SMALL)

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        address = tuple(await asyncio.get_running_loop().run_in_executor(None, child.wait_ready))
        tx = SenderDaemon(identity, PSK, rate_mbps=10, owd_ms=1, result_wait_s=0.3,
                          rate_control="fixed")  # told rate = the link (loopback is faster)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=1024), address, deadline_ms=800,
                                  rho=None, generate=False))
        while h.state != "streaming":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        child.kill()
        failed = await _wait(h, 10)
        # The sender is still healthy: a new receiver gets a complete handoff.
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        h2 = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=64), rx.address, rho=3.0, generate=False))
        ok = await _wait(h2, 10)
        health = tx.health()
        await tx.close()
        await rx.close()
        return failed, ok, health

    try:
        with pinned(cpus.pin("sender")):
            failed, ok, health = run(main())
    finally:
        child.kill()
    assert failed["outcome"] == "failed", failed
    assert "no RESULT" in failed["failure"], failed
    assert 0 < failed["source_sent"] < failed["n_source"]
    assert ok["outcome"] == "done" and ok["recovered_utility"] == pytest.approx(1.0), ok
    assert health["status"] == "ok" and health["active_handoffs"] == 0


def test_sender_vanishing_or_shutting_down_leaves_no_state_on_the_receiver() -> None:
    """A sender that goes silent is reaped after its deadline; one that shuts down sends CLOSE at once."""
    identity = synthetic_identity(SMALL)
    link = EmulatorConfig(DirectionSpec(0, 0.001), DirectionSpec(0, 0.001))

    async def reaped(rx: ReceiverDaemon, limit_s: float) -> float:
        started = time.monotonic()
        while rx.endpoint.sessions or rx.sessions:
            assert time.monotonic() - started < limit_s, session_views(rx)
            await asyncio.sleep(0.01)
        return time.monotonic() - started

    async def main() -> tuple[ReceiverDaemon, float, float, bytes, dict[str, Any]]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=10, owd_ms=1)
        # 1. Vanished: the path through the relay disappears mid-stream (no CLOSE can arrive).
        relay = UdpRelay(link, ("127.0.0.1", 0), rx.address)
        await relay.start()
        tx.submit(HandoffSpec(ContextInput(synthetic_tokens=1024), relay.listen_address, deadline_ms=300,
                              rho=None, generate=False))
        while not rx.endpoint.sessions:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await relay.close()
        silent = await reaped(rx, 5.0)  # deadline + RESULT retries (20 x 50 ms)
        # 2. Shutdown: the sender cancels with a CLOSE; the receiver frees the session before its deadline.
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=1024), rx.address, deadline_ms=3000,
                                  rho=None, generate=False))
        while not rx.endpoint.sessions:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await tx.close()
        closed = await reaped(rx, 1.0)
        metrics = rx.metrics.exposition()
        await rx.close()
        return rx, silent, closed, metrics, h.view()

    rx, silent, closed, metrics, cancelled = run(main())
    assert not rx.endpoint.sessions and not rx.sessions and not rx._peers and not rx.handoffs.jobs
    assert silent > 0.2 and closed < 0.5, (silent, closed)
    assert b'pfec_receiver_sessions_total{outcome="timeout"} 1.0' in metrics
    assert b'pfec_receiver_sessions_total{outcome="cancelled"} 1.0' in metrics
    assert cancelled["outcome"] == "cancelled" and "shutting down" in cancelled["failure"], cancelled


def test_the_close_after_a_result_leaves_at_once_not_in_a_far_pacing_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLOSE that answers a RESULT is sent when the RESULT arrives, not in the link's next pacing slot:
    that slot can lie seconds ahead (a trickle pace while the in-flight cap binds, an estimate cut to its
    floor), past the socket's linger, and the receiver would retry its RESULT until it reaps the session.
    Here the slot is pushed 10 s ahead as the RESULT arrives; the receiver must free the session at once."""
    identity = synthetic_identity(SMALL)
    real_on_event = PacedTransfer._on_event

    def slot_far_ahead(self: PacedTransfer, event: Any) -> None:
        if isinstance(event, ResultReceived):
            self.link.next_send = time.monotonic() + 10.0
        real_on_event(self, event)

    monkeypatch.setattr(PacedTransfer, "_on_event", slot_far_ahead)

    async def main() -> tuple[dict[str, Any], float, bytes]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=256), rx.address, rho=3.0, generate=False))
        report = await _wait(h, 30)
        ended = time.monotonic()
        while rx.endpoint.sessions or rx.sessions:
            if time.monotonic() - ended > 3.0:
                break
            await asyncio.sleep(0.005)
        freed_after = time.monotonic() - ended
        metrics = rx.metrics.exposition()
        await tx.close()
        await rx.close()
        return report, freed_after, metrics

    report, freed_after, metrics = run(main())
    assert report["outcome"] == "done", report
    # Without the CLOSE the receiver retries its RESULT (20 x 50 ms) and reaps the session after ~1 s.
    assert freed_after < 0.3, freed_after
    assert b'pfec_receiver_sessions_total{outcome="timeout"} 1.0' not in metrics


def test_concurrent_handoffs_beyond_the_session_limit_are_refused_as_overloaded() -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> list[dict[str, Any]]:
        rx = ReceiverDaemon(identity, PSK, session_config=ReceiverConfig(max_sessions=3))
        await rx.start("127.0.0.1", 0)
        # Each transfer lasts ~1 s (1 MiB at 8 Mbit/s) and the last two are offered only once the
        # receiver holds the first three, so a slow machine cannot let one finish before the refusals.
        tx = SenderDaemon(identity, PSK, rate_mbps=8, owd_ms=1, result_wait_s=1)
        spec = HandoffSpec(ContextInput(synthetic_tokens=1024), rx.address, deadline_ms=4000, rho=None,
                           generate=False)
        handoffs = [tx.submit(spec) for _ in range(3)]
        while len(rx.sessions) < 3:
            await asyncio.sleep(0.002)
        handoffs += [tx.submit(spec) for _ in range(2)]
        reports = [await _wait(h, 20) for h in handoffs]
        await tx.close()
        started = time.monotonic()  # each sender's last CLOSE may still be on its way or in the queue
        while (rx.endpoint.sessions or rx.sessions) and time.monotonic() - started < 5.0:
            await asyncio.sleep(0.01)
        await rx.close()
        assert not rx.endpoint.sessions and not rx.sessions, session_views(rx)
        return reports

    reports = run(main())
    outcomes = [r["outcome"] for r in reports]
    assert outcomes == ["done", "done", "done", "refused", "refused"], [r.get("failure") for r in reports]
    assert all("OVERLOADED" in r["failure"] for r in reports if r["outcome"] == "refused")
    assert all(r["recovered_utility"] == pytest.approx(1.0) for r in reports if r["outcome"] == "done")


def test_a_bug_in_one_handoff_fails_it_and_spares_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    identity = synthetic_identity(SMALL)
    real = SenderSession.next_datagram
    calls = {"n": 0}

    def flaky(self: SenderSession, now: float) -> bytes | None:
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("injected fault")
        return real(self, now)

    monkeypatch.setattr(SenderSession, "next_datagram", flaky)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        spec = HandoffSpec(ContextInput(synthetic_tokens=128), rx.address, rho=3.0, generate=False)
        first = await _wait(tx.submit(spec), 10)
        second = await _wait(tx.submit(spec), 10)
        await tx.close()
        await rx.close()
        return first, second

    first, second = run(main())
    assert first["outcome"] == "failed" and "injected fault" in first["failure"], first
    assert second["outcome"] == "done" and second["recovered_utility"] == pytest.approx(1.0), second


class _Tap(asyncio.DatagramProtocol):
    """Sender -> receiver forwarder that also injects garbage, forged and replayed datagrams (or, with
    ``drop_offer_parts``, loses every OFFER datagram after the first)."""

    def __init__(self, receiver: tuple[str, int], drop_offer_parts: bool = False) -> None:
        self.receiver = receiver
        self.drop_offer_parts = drop_offer_parts
        self.offers = 0
        self.transport: asyncio.DatagramTransport | None = None
        self.sender_addr: Any = None
        self.seen: list[bytes] = []
        self.injected = {"garbage": 0, "forged": 0, "replayed": 0}
        self.rng = np.random.default_rng(7)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        assert self.transport is not None
        if addr == self.receiver:
            self.transport.sendto(data, self.sender_addr)
            return
        self.sender_addr = addr
        if self.drop_offer_parts:
            is_offer = data[1] & 0x3F == 4  # the type under the key-phase bits
            self.offers += is_offer
            if not is_offer or self.offers == 1:
                self.transport.sendto(data, self.receiver)
            return
        self.transport.sendto(data, self.receiver)
        self.seen.append(data)
        n = len(self.seen)
        if data[1] & 0x3F == 1 and n % 5 == 0:  # SOURCE: replay an older one, forge one, add garbage
            self.transport.sendto(self.seen[n // 2], self.receiver)
            self.injected["replayed"] += 1
            header = peek_header(data)
            wrong = PacketProtector(bytes(32), header.session_id, Role.SENDER, len(data) - 34)
            forged = wrong.seal(Source(0, bytes(len(data) - 34)))
            self.transport.sendto(forged, self.receiver)
            self.injected["forged"] += 1
            # Seeded garbage whose first byte is never the wire version: random bytes that happened to
            # carry a valid header for an unknown session would be (rightly) held as early data, not
            # dropped, and make the count below flaky.
            junk = bytearray(self.rng.bytes(n % 1500 + 1))
            junk[0] = int(self.rng.integers(2, 256))
            self.transport.sendto(bytes(junk), self.receiver)
            self.injected["garbage"] += 1


def test_garbage_forged_and_replayed_datagrams_are_dropped_and_counted() -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], dict[str, int], dict[str, int], bytes]:
        loop = asyncio.get_running_loop()
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        transport, tap = await loop.create_datagram_endpoint(lambda: _Tap(rx.address),
                                                             local_addr=("127.0.0.1", 0))
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, result_wait_s=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=256), transport.get_extra_info("sockname"),
                                  rho=3.0, generate=False))
        report = await _wait(h, 20)
        await tx.close()
        transport.close()
        drops = dict(rx.endpoint.drops)
        metrics = rx.metrics.exposition()
        await rx.close()
        return report, tap.injected, drops, metrics

    report, injected, drops, metrics = run(main())
    assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0), report
    assert min(injected.values()) >= 5, injected
    assert drops.get("replay", 0) + drops.get("too_old", 0) == injected["replayed"], drops
    assert drops.get("junk_auth", 0) >= injected["forged"], drops
    garbage = sum(v for k, v in drops.items() if k not in ("replay", "too_old", "junk_auth"))
    assert garbage + drops.get("junk_auth", 0) - injected["forged"] == injected["garbage"], drops
    line = f'pfec_receiver_datagrams_dropped_total{{reason="replay"}} {float(drops["replay"])}'
    assert line.encode() in metrics
    # Junk is counted as junk, never by the type byte it claims (the forged ones claim SOURCE).
    junk = drops.get("junk_auth", 0) + drops.get("junk_header", 0) + drops.get("bad_version", 0)
    assert f'pfec_receiver_datagrams_received_total{{type="junk"}} {float(junk)}'.encode() in metrics, (
        [ln for ln in metrics.decode().splitlines() if "received_total" in ln], drops)


def test_incomplete_offer_ends_with_an_error_result_not_a_stuck_session() -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], ReceiverDaemon]:
        loop = asyncio.get_running_loop()
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        transport, _tap = await loop.create_datagram_endpoint(lambda: _Tap(rx.address, drop_offer_parts=True),
                                                              local_addr=("127.0.0.1", 0))
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, result_wait_s=1)
        long_question = tuple(range(3, 1500))  # an OFFER blob of several parts
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=64, question_ids=long_question),
                                  transport.get_extra_info("sockname"), rho=3.0, generate=False))
        report = await _wait(h, 20)
        for _ in range(200):
            if not rx.endpoint.sessions:
                break
            await asyncio.sleep(0.01)
        await tx.close()
        transport.close()
        await rx.close()
        return report, rx

    report, rx = run(main())
    assert report["outcome"] == "failed" and "never arrived complete" in report["failure"], report
    assert not rx.endpoint.sessions and not rx.sessions


def test_peer_with_another_model_is_refused_with_the_reason() -> None:
    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        rx = ReceiverDaemon(synthetic_identity(SMALL, "model-a"), PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(synthetic_identity(SMALL, "model-b"), PSK, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=64), rx.address, rho=2.0, generate=False))
        report = await _wait(h, 10)
        await tx.close()
        await asyncio.sleep(0.05)
        results = list(rx.results)
        await rx.close()
        return report, results

    report, results = run(main())
    assert report["outcome"] == "refused", report
    assert "FINGERPRINT_MISMATCH" in report["failure"] and "same model" in report["failure"], report
    assert report["source_sent"] < report["n_source"]
    assert results and "refused" in results[-1]["error"]


# --------------------------------------------------------------------------- progressive precision


def test_int8_handoff_streams_fewer_bytes_starts_when_ready_and_matches_full_kv(
        tiny: llm.ModelRuntime) -> None:
    """Tiny model at int8, no loss, a long deadline: the quantised stream is smaller than the native cache,
    the receiver places every symbol by its stream index, rebuilds every block at int8, starts as soon as
    the last symbol decodes (long before the deadline) and answers as the full cache does."""
    identity = runtime_identity(tiny)

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]], bytes]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                  rx.address, rho=20.0, full_kv_answer=True, max_new_tokens=6,
                                  precision="int8", handoff_mode="handoff"))
        report = await _wait(h)
        metrics = tx.metrics.exposition()
        await tx.close()
        await rx.close()
        return report, list(rx.results), metrics

    report, results, metrics = run(main())
    assert report["outcome"] == "done", report
    assert report["precision"] == "int8" and report["received_precision"] == "int8", report
    native_fragments = runtime_identity(tiny).plan(report["n_tokens"]).n_fragments
    assert report["n_source"] < native_fragments and report["stream_bytes"] < report["native_bytes"], report
    assert report["levels"]["int8"] == report["n_blocks"], report
    assert report["recovered_utility"] == pytest.approx(1.0)
    assert report["precision_utility"] == pytest.approx(1.0, abs=1e-3), report  # default table: int8 = 1
    assert report["start"] == "ready" and report["ttft_s"] < report["deadline_ms"] / 1000 * 0.5, report
    assert report["answer"] == report["full_kv_answer"] and report["answer"], report
    assert report["planner_ttft_s"] > 0 and report["planner_choice"], report
    assert results[-1]["start"] == "ready"
    int8_bytes = [ln for ln in metrics.decode().splitlines()
                  if ln.startswith('pfec_sender_precision_bytes_sent_total{precision="int8"}')]
    assert int8_bytes and float(int8_bytes[0].split()[-1]) > 0, int8_bytes
    assert b"pfec_sender_planner_choices_total{choice=" in metrics


@pytest.mark.parametrize(("mode", "precision"), [("split", "int8"), ("split", "native"), ("local", "int8")])
def test_split_and_local_handoffs_compute_the_front_and_match_full_kv(tiny: llm.ModelRuntime,
                                                                     mode: str, precision: str) -> None:
    """Issue 13 item 1 over real sockets: the receiver prefills the front from the OFFER's token ids while
    the back streams (split), or everything itself (local); its cache is the computed prefix plus the
    received blocks, and it answers as the full cache does. ACKs carried its progress to the sender."""
    identity = runtime_identity(tiny)

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]], bytes]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                  rx.address, rho=20.0, full_kv_answer=True, max_new_tokens=6,
                                  precision=precision, handoff_mode=mode))
        report = await _wait(h)
        metrics = tx.metrics.exposition()
        await tx.close()
        await rx.close()
        return report, list(rx.results), metrics

    report, results, metrics = run(main())
    assert report["outcome"] == "done", (report.get("failure"), report)
    assert report["handoff_mode"] == mode and report["receiver_mode"] == mode, report
    n_tokens = report["n_tokens"]
    assert report["answer"] == report["full_kv_answer"] and report["answer"], report
    assert report["recovered_utility"] == pytest.approx(1.0), report
    # The front computes from the start up to the meeting token, the stream carries the rest (and the
    # front too, after the back: whichever arrives first serves); the tiny model's planned meeting token
    # is often 0: all streamed.
    assert report["computed_tokens"] is not None, report
    assert report["start"] == "ready", report
    if mode == "split":
        m = report["meeting_token_planned"]
        assert m is not None and m % 16 == 0 and 0 <= m < n_tokens, report
        assert report["blocks_computed"] + report["blocks_received"] == report["n_blocks"], report
        assert report["received_precision"] == precision, report
        if precision == "native":  # native fragments: the whole cache's bytes, the back's first
            assert report["stream_bytes"] == report["native_bytes"], report
        else:
            assert report["stream_bytes"] < report["native_bytes"], report
    else:
        assert report["computed_tokens"] == n_tokens and report["blocks_computed"] == report["n_blocks"]
        assert report["source_sent"] == 1 and report["precision"] == "none", report
    assert results[-1]["handoff_mode"] == mode
    assert f'pfec_sender_handoff_modes_total{{mode="{mode}"}} 1.0'.encode() in metrics


def test_a_split_whose_front_stalls_gets_the_front_from_the_stream(tiny: llm.ModelRuntime,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver states a fast prefill, so the planner leaves it most of the context to compute; its
    front then computes nothing (a node slower than it said). The stream carries the front after the back,
    the link has the time: everything arrives, the session starts ready, the answer is the full cache's
    (before, the front's tokens were masked at the deadline)."""
    identity = runtime_identity(tiny)

    def stalled(_runtime: llm.ModelRuntime, front: Front, _progress: Any) -> int:
        front.stop.wait(30.0)
        return front.tokens

    monkeypatch.setattr(receiver_handoffs, "compute_front", stalled)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        rx.endpoint.prefill_statement = stated_fields(PrefillCurve(0.001, 2e-6, 0.0), 0.001)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                  rx.address, rho=20.0, full_kv_answer=True, max_new_tokens=6,
                                  precision="int8", handoff_mode="split"))
        report = await _wait(h)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "done" and report["start"] == "ready", report
    assert report["meeting_token_planned"] >= 64 and report["computed_tokens"] == 0, report
    assert report["blocks_received"] == report["n_blocks"], report
    assert report["answer"] == report["full_kv_answer"] and report["answer"], report


def test_a_front_times_its_chunks_and_the_receiver_states_the_refitted_speed(tiny: llm.ModelRuntime) -> None:
    """The front's chunks are timed as they run (each a forward call over the cache before it), and the
    receiver's statement from then on is its curve refitted over them (``RecentPrefills``)."""
    ids = tuple(int(x) for x in np.random.default_rng(5).integers(3, VOCAB, size=200))
    front = Front(ids, meeting_token=200, chunk_tokens=64)  # the tiny model holds 256 tokens
    assert compute_front(tiny, front, lambda _tokens: None) == 200
    assert [(start, stop) for start, stop, _ in front.timed] == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert all(seconds > 0 for _, _, seconds in front.timed)
    identity = runtime_identity(tiny)
    rx = ReceiverDaemon(identity, PSK, runtime=tiny)
    slow = PrefillCurve(1.0, 1e-3, 0.0)  # far slower than the tiny model: the timed chunks refit it
    rx.recent_prefills = RecentPrefills(slow, 0.05, [(128, slow.seconds(128)), (512, slow.seconds(512))])
    rx._on_prefill_timed(front.timed)
    assert rx.recent_prefills.timed == 4 and rx.recent_prefills.curve.seconds(200) < slow.seconds(200)
    assert rx.endpoint.prefill_statement == rx.recent_prefills.stated()


def test_a_front_asks_where_each_later_chunk_meets_the_stream(tiny: llm.ModelRuntime) -> None:
    """After its first chunk the front asks ``meet`` (done, planned end, its pace) where the next ends; an
    answer outside (done, planned end] is clamped, so the front always moves and never passes the plan."""
    ids = tuple(int(x) for x in np.random.default_rng(6).integers(3, VOCAB, size=200))
    asked: list[tuple[int, int]] = []

    def meet(done: int, end: int, pace: float) -> int:
        assert pace > 0
        asked.append((done, end))
        return {64: 72, 72: 72, 73: 10_000}.get(done, end)

    front = Front(ids, meeting_token=200, chunk_tokens=64, meet=meet)
    assert compute_front(tiny, front, lambda _tokens: None) == 200
    assert [(start, stop) for start, stop, _ in front.timed] == [(0, 64), (64, 72), (72, 73), (73, 137),
                                                                 (137, 200)]
    assert asked == [(64, 128), (72, 136), (73, 137), (137, 200)]


def test_rebuild_from_a_partial_stream_masks_the_blocks_with_no_level(tiny: llm.ModelRuntime) -> None:
    """Blocks none of whose pieces arrived are masked (mask mode) or zero (zero mode), the rest are
    dequantised into the compute dtype; the model answers from the result."""
    identity = runtime_identity(tiny)
    ids = [int(x) for x in np.random.default_rng(3).integers(3, VOCAB, size=70)]
    cache, _ = llm.prefill(tiny, ids)
    utilities = synthetic_profile(identity.geometry.n_layers).block_utilities(identity.plan(len(ids)))
    stream = plan_stream(identity, len(ids), "int4", utilities, "utility")
    symbols = llm.serialise_stream(tiny, cache, stream.plan)
    have = np.ones(stream.plan.n_symbols, dtype=bool)
    have[stream.plan.n_symbols // 3 :] = False  # the stream opens with int2 bases: a third is half of them
    levels, bases = stream.plan.usable(have)
    assert (levels == 0).any() and (levels > 0).any()
    store = np.where(have[:, None], symbols[:, 4:], 0).astype(np.uint8)
    kv = llm.rebuild_from_stream(tiny, stream.plan, store, levels, bases, "mask")
    assert kv.row_masks is not None and any(m is not None for m in kv.row_masks)
    assert kv.keys[0].dtype == tiny.compute_dtype and 0 < kv.available_fraction < 1
    assert llm.generate(tiny, kv, [7, 8], 3).token_ids
    zero = llm.rebuild_from_stream(tiny, stream.plan, store, levels, bases, "zero")
    assert zero.row_masks is None
    with pytest.raises(ValueError, match="reconstruction mode"):
        llm.rebuild_from_stream(tiny, stream.plan, store, levels, bases, "blur")  # type: ignore[arg-type]


def test_quantised_partial_delivery_credits_blocks_at_the_level_that_arrived() -> None:
    """Synthetic int4 stream, a deadline too short for it: every usable block is int2 or int4, the plain
    block utility matches on both sides, and the utility credited at precision is below it."""
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, scheme="priority", result_wait_s=1,
                          rate_control="fixed")  # told rate = the link (loopback is faster)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=2048), rx.address, rho=0.2, generate=False,
                                  precision="int4"))
        report = await _wait(h)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "done", report
    assert report["start"] == "deadline" and report["source_sent"] < report["n_source"], report
    levels = report["levels"]
    assert levels["int2"] > 0 and levels["int4"] > 0 and levels["int8"] == levels["native"] == 0, levels
    assert 0.2 < report["recovered_utility"] < 1.0, report
    assert report["receiver_recovered_utility"] == pytest.approx(report["recovered_utility"])
    assert report["precision_utility"] < report["recovered_utility"], report


def test_a_plan_the_receiver_cannot_recompute_is_refused_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The OFFER's plan digest is not what the receiver computes from the same inputs: REFUSE, reason."""
    import pfec.sender.kv as kv

    identity = synthetic_identity(SMALL)
    real = kv.plan_stream

    def skewed(*args: Any, **kwargs: Any) -> kv.Stream:
        stream = real(*args, **kwargs)
        offer = dataclasses.replace(stream.offer, plan="0" * 16)
        return dataclasses.replace(stream, offer=offer)

    monkeypatch.setattr(kv, "plan_stream", skewed)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=256), rx.address, rho=2.0, generate=False,
                                  precision="int8"))
        report = await _wait(h, 10)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "refused", report
    assert "does not match the plan recomputed here" in report["failure"], report


def test_a_receiver_without_the_quantisation_scheme_is_refused_by_fingerprint() -> None:
    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(dataclasses.replace(synthetic_identity(SMALL), quant_scheme=None), PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(synthetic_identity(SMALL), PSK, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=64), rx.address, rho=2.0, generate=False,
                                  precision="int8"))
        report = await _wait(h, 10)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "refused" and "FINGERPRINT_MISMATCH" in report["failure"], report


# --------------------------------------------------------------------------- control API and CLI


class _LoopThread:
    """An event loop in a background thread (the CLI under test runs its own asyncio.run)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_control_api_validation_names_the_field_and_cli_handoff(tmp_path: Path) -> None:
    identity = synthetic_identity(SMALL)
    sock = tmp_path / "sender.sock"
    token = "t" * 32
    lt = _LoopThread()

    async def start() -> tuple[SenderDaemon, ReceiverDaemon, ControlServer]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        server = ControlServer(sender_routes(tx))
        await server.start(sock, ("127.0.0.1", 0), token)
        return tx, rx, server

    tx, rx, server = lt.call(start())
    try:
        assert oct(sock.stat().st_mode & 0o777) == "0o660"
        client = ControlClient(sock)
        target = f"{rx.address[0]}:{rx.address[1]}"
        bad = [
            ({"synthetic_tokens": 64}, "receiver"),
            ({"receiver": "nohost", "synthetic_tokens": 64}, "receiver"),
            ({"receiver": target, "synthetic_tokens": 64, "rho": -1}, "rho"),
            ({"receiver": target, "synthetic_tokens": 64, "scheme": "bogus"}, "scheme"),
            ({"receiver": target, "synthetic_tokens": 64, "reconstruction": "blur"}, "reconstruction"),
            ({"receiver": target, "synthetic_tokens": 64, "precision": "int3"}, "precision"),
            ({"receiver": target, "synthetic_tokens": 64, "colour": 1}, "colour"),
            ({"receiver": target, "context": "x"}, "question"),
            ({"receiver": target, "synthetic_tokens": 64, "repair_budget": "all"}, "repair_budget"),
            ({"receiver": target, "synthetic_tokens": 64, "repair_budget": -0.5}, "repair_budget"),
            ({"receiver": target, "synthetic_tokens": 64, "repair_budget": 11}, "repair_budget"),
        ]
        for body, field in bad:
            status, data = lt.call(client.request("POST", "/handoffs", body))
            assert status == 422, (body, data)
            assert field in data["error"], (field, data)
        status, data = lt.call(client.request("GET", "/handoffs/nope"))
        assert status == 404 and "nope" in data["error"]
        # TCP needs the bearer token.
        url = f"http://127.0.0.1:{server.tcp_port}"
        status, data = lt.call(ControlClient(url=url, token="wrong" * 4).request("GET", "/healthz"))
        assert status == 401
        status, data = lt.call(ControlClient(url=url, token=token).request("GET", "/healthz"))
        assert status == 200 and data["role"] == "sender"
        # A real handoff through the API, then the CLI prints its report.
        status, created = lt.call(client.request("POST", "/handoffs",
                                                 {"receiver": target, "synthetic_tokens": 64, "rho": 4.0,
                                                  "generate": False}))
        assert status == 202
        status, report = lt.call(client.request("GET", f"/handoffs/{created['id']}?wait=1"))
        assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0)
        assert report["repair_budget"] == "deadline" and report["start"] in ("ready", "sender-done"), report
        status, capped = lt.call(client.request("POST", "/handoffs",
                                                {"receiver": target, "synthetic_tokens": 64, "rho": 4.0,
                                                 "generate": False, "repair_budget": 0.1}))
        assert status == 202
        status, report = lt.call(client.request("GET", f"/handoffs/{capped['id']}?wait=1"))
        assert report["repair_budget"] == 0.1 and report["repair_cap"] == round(0.1 * report["n_source"])
        status, listing = lt.call(client.request("GET", "/handoffs"))
        assert [h["id"] for h in listing["handoffs"]] == [created["id"], capped["id"]]
        res = CliRunner().invoke(app, ["handoff", "--receiver", target, "--context", "abc", "--question", "q",
                                       "--socket", str(sock), "--rho", "-2"])
        assert res.exit_code == 2 and "rho" in res.output, res.output
        res = CliRunner().invoke(app, ["handoff", "--receiver", target, "--synthetic-tokens", "64",
                                       "--socket", str(sock), "--json"])
        assert res.exit_code == 0, res.output
        printed = json.loads(res.stdout)
        assert printed["outcome"] == "done" and 0 < printed["source_sent"] <= printed["n_source"], printed
        res = CliRunner().invoke(app, ["handoff", "--receiver", target, "--synthetic-tokens", "64",
                                       "--url", url, "--token-file", str(tmp_path / "missing")])
        assert res.exit_code == 2 and "missing" in res.output, res.output
    finally:
        lt.call(server.close())
        lt.call(tx.close())
        lt.call(rx.close())
        lt.stop()


def test_serve_with_a_bad_config_prints_the_value_and_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "r.toml"
    cfg.write_text("[udp]\nport = 70000\n")
    res = CliRunner().invoke(app, ["receiver", "serve", "--config", str(cfg)])
    assert res.exit_code == 2 and "70000" in res.output and "udp.port" in res.output, res.output


# --------------------------------------------------------------------------- two namespaces over TUN

_NETNS_OK, _NETNS_WHY = netns_available()


def _write_configs(tmp: Path, spec: NetnsSpec) -> tuple[Path, Path, Path]:
    psk = tmp / "psk"
    psk.write_text(PSK.hex() + "\n")
    psk.chmod(0o600)
    rx_cfg, tx_cfg = tmp / "receiver.toml", tmp / "sender.toml"
    common = f'[security]\npsk_file = "{psk}"\n[metrics]\nenabled = false\n[model]\npath = "synthetic"\n'
    rx_sock = tmp / "rx.sock"
    udp = f'[udp]\nhost = "{spec.addr_b}"\nport = 7400\n'
    rx_cfg.write_text(udp + f'[control]\nsocket = "{rx_sock}"\n' + common)
    link = "[link]\nrate_mbps = 50\nowd_ms = 5\n"
    tx_cfg.write_text(f'[control]\nsocket = "{tmp / "tx.sock"}"\n' + link + common)
    return rx_cfg, tx_cfg, tmp / "tx.sock"


@pytest.mark.skipif(not _NETNS_OK, reason=f"netns/TUN emulator unavailable: {_NETNS_WHY}")
def test_daemons_in_two_namespaces_over_tun(tmp_path: Path) -> None:
    """`pfec receiver serve` / `pfec sender serve` in their own namespaces; a handoff over the TUN link."""
    tag = uuid.uuid4().hex[:6]
    spec = NetnsSpec(ns_a=f"pfec-da-{tag}", ns_b=f"pfec-db-{tag}")
    rx_cfg, tx_cfg, tx_sock = _write_configs(tmp_path, spec)
    pfec = str(REPO / ".venv" / "bin" / "pfec") if (REPO / ".venv/bin/pfec").exists() else "pfec"
    link = EmulatorConfig(DirectionSpec(50e6, 0.005, Bernoulli(0.02)), DirectionSpec(50e6, 0.005), seed=5)

    async def main() -> dict[str, Any]:
        async with TunBridge(link, spec):
            procs = []
            for ns, cfg, role in ((spec.ns_b, rx_cfg, "receiver"), (spec.ns_a, tx_cfg, "sender")):
                cmd = ["ip", "netns", "exec", ns, pfec, role, "serve", "--config", str(cfg)]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            try:
                client = ControlClient(tx_sock)
                for _ in range(600):
                    if tx_sock.exists() and (tmp_path / "rx.sock").exists():
                        break
                    await asyncio.sleep(0.05)
                body = {"receiver": f"{spec.addr_b}:7400", "synthetic_tokens": 256, "rho": 2.0,
                        "generate": False}
                status, created = await client.request("POST", "/handoffs", body)
                assert status == 202, created
                _, report = await client.request("GET", f"/handoffs/{created['id']}?wait=30")
                _, results = await ControlClient(tmp_path / "rx.sock").request("GET", "/results")
                report["_rx_results"] = results
                return report
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()

    teardown_namespaces(spec)
    setup_namespaces(spec)
    try:
        report = asyncio.run(main())
    finally:
        teardown_namespaces(spec)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert spec.ns_a not in left and spec.ns_b not in left
    assert report["outcome"] == "done", report
    assert report["recovered_utility"] > 0.95, report  # 2% loss, 15% repair budget, rho 2
    rx_result = report["_rx_results"]["results"][-1]
    assert rx_result["recovered_utility"] == pytest.approx(report["recovered_utility"])


def test_udp_socket_gets_a_large_receive_buffer() -> None:
    rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
    want = 2 * rmem_max + (1 << 20)
    sock = open_udp_socket("127.0.0.1", 0, want, 1 << 20)
    try:
        got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        if os.geteuid() == 0:
            assert got >= want  # SO_RCVBUFFORCE goes past net.core.rmem_max (the kernel doubles it)
        else:
            assert got == 2 * min(want, rmem_max)
    finally:
        sock.close()



def _gso_supported() -> bool:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.getsockopt(socket.IPPROTO_UDP, UDP_SEGMENT)
        return True
    except OSError:
        return False
    finally:
        probe.close()


@pytest.mark.skipif(not _gso_supported(), reason="kernel without UDP GSO (Linux < 4.18)")
def test_a_gso_batch_is_split_back_into_its_datagrams() -> None:
    """One GSO send of seven equal datagrams and a shorter last one: the receiver (GRO on, or the kernel
    segmenting) sees eight datagrams, each dropped and counted as the garbage it is."""
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[int, dict[str, int]]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            segment = 100
            batch = bytes(7 * segment) + bytes(40)  # version byte 0: never a valid wire version
            gso = [(socket.IPPROTO_UDP, UDP_SEGMENT, segment.to_bytes(2, "little"))]
            tx.sendmsg([batch], gso, 0, rx.address)
            tx.sendto(bytes(segment), rx.address)  # a plain datagram after it
        finally:
            tx.close()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if rx.stats.received >= 9:
                break
        drops = dict(rx.endpoint.drops)
        received = rx.stats.received
        await rx.close()
        return received, drops

    received, drops = run(main())
    assert received == 9, (received, drops)
    assert sum(drops.values()) == 9, drops


def test_fast_loopback_handoffs_batch_their_datagrams() -> None:
    """At 1 Gbit/s pacing over loopback every wake-up sends a batch (GSO where the kernel has it): the
    stream still decodes completely and the sender's byte count matches the datagrams it reports."""
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=1000, owd_ms=1, scheme="heuristic", result_wait_s=2)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=4096), rx.address, deadline_ms=3000, rho=None,
                                  generate=False))
        report = await _wait(h)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["outcome"] == "done", report
    assert report["recovered_utility"] == pytest.approx(1.0), report
    assert report["source_sent"] == report["n_source"], report


def test_closing_while_a_handoff_opens_its_socket_cancels_it_cleanly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon closes while a handoff awaits its socket: the handoff ends as cancelled, nothing is sent
    and nothing is logged as an error (the cancelled session is never started)."""
    identity = synthetic_identity(SMALL)
    real_open = PacedTransfer.open
    opening, release = asyncio.Event(), asyncio.Event()

    async def gated_open(self: PacedTransfer, *args: Any) -> None:
        opening.set()
        await release.wait()
        await real_open(self, *args)

    monkeypatch.setattr(PacedTransfer, "open", gated_open)

    async def main() -> tuple[dict[str, Any], int]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=128), rx.address, rho=3.0, generate=False))
        await asyncio.wait_for(opening.wait(), 10)
        closing = asyncio.get_running_loop().create_task(tx.close())
        await asyncio.sleep(0)  # close() cancels the transfer and lingers; the socket opens meanwhile
        release.set()
        await closing
        report = await _wait(h, 5)
        await asyncio.sleep(0.05)
        received = rx.stats.received
        await rx.close()
        return report, received

    with caplog.at_level("WARNING"):
        report, received = run(main())
    assert report["outcome"] == "cancelled" and "shutting down" in report["failure"], report
    assert received == 0, received
    errors = [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, errors


def test_a_sender_measuring_its_path_is_not_undone_by_a_told_rate_4x_too_high() -> None:
    """link.rate_control = path: told 40 Mbit/s on a 10 Mbit/s relay with a ~100 ms drop-tail queue, the
    controller finds the link's rate (the report's path_rate), the queue drops little and the handoff
    recovers what the link carries; the same handoff paced at the told rate floods the queue and spends
    repairs on its own losses."""
    identity = synthetic_identity(SMALL)
    link = EmulatorConfig(DirectionSpec(10e6, 0.005, queue_packets=100), DirectionSpec(10e6, 0.005), seed=1)

    views: list[dict[str, Any]] = []

    async def main(control: str, handoffs: int = 1) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        reports = []
        async with UdpRelay(link, ("127.0.0.1", 0), rx.address) as relay:
            tx = SenderDaemon(identity, PSK, rate_mbps=40, owd_ms=5, scheme="heuristic", rate_control=control)
            for _ in range(handoffs):
                h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=768), relay.listen_address,
                                          rho=None, deadline_ms=1500, generate=False))
                reports.append(await _wait(h))
                if reports[-1]["outcome"] != "done":
                    break
            stats = relay.stats()["forward"]
            views.extend(tx.paths_view())
            await tx.close()
        await rx.close()
        return reports, stats

    (measured, *later), queue = run(main("path", handoffs=2))
    assert measured["outcome"] == "done", measured
    assert measured["planner_inputs"]["rate_from"].startswith("told"), measured["planner_inputs"]
    # The next handoff to that receiver plans on the path's forecast, not on the told 40 Mbit/s.
    assert later[0]["planner_inputs"]["rate_from"].startswith("forecast"), later[0]["planner_inputs"]
    assert 5 <= later[0]["planner_inputs"]["rate_mbps"] <= 13, later[0]["planner_inputs"]
    (peer,) = views  # GET /paths: the receiver's controller, remembered between its handoffs
    assert peer["receiver"] == measured["receiver_address"] and peer["estimate_mbps"] > 0, peer
    assert peer["rounds"] >= measured["path_rate"]["rounds"], peer
    rate = measured["path_rate"]
    # Within 0.7-1.5x of the link, not the told 4x: ACKs bunched by a busy machine overstate a round or two.
    # The min RTT is the path's 10 ms, less the relay's timer slack (its delays may fire a little early:
    # CI saw 9.926 ms).
    assert 7 <= rate["estimate_mbps"] <= 15 and rate["min_rtt_ms"] >= 9.5, rate
    assert queue["queue_dropped"] <= 0.05 * queue["received"], queue
    assert measured["recovered_utility"] >= 0.9, measured
    (told,), flooded = run(main("fixed"))
    assert "path_rate" not in told
    assert flooded["queue_dropped"] > 0.3 * flooded["received"], flooded
    # The FEC took the self-inflicted loss for the channel's and spent repairs on it.
    assert told["repair_sent"] > 2 * measured["repair_sent"], (told["repair_sent"], measured["repair_sent"])


def test_a_quantised_stream_is_rebuilt_while_it_arrives_with_the_same_answer(
        tiny: llm.ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39 item 3 end to end: over a slow link the receiver places the stream's blocks into the cache
    as they complete (the RESULT's ``live_rebuild``: blocks placed before the deadline), and its answer is
    the one-shot rebuild's (the same handoff with the live build switched off)."""
    identity = runtime_identity(tiny)

    async def handoff() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK, runtime=tiny)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=tiny, rate_mbps=1, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(context=_context(), question="w7 w8 w9", system=""),
                                  rx.address, rho=3.0, max_new_tokens=6, precision="int8",
                                  handoff_mode="handoff", full_kv_answer=True))
        report = await _wait(h)
        await tx.close()
        await rx.close()
        return report

    live = run(handoff())
    assert live["outcome"] == "done" and live["start"] == "ready", live
    placed = live["receiver_stats"]["live_rebuild"]
    assert placed["blocks_placed_before"] > 0 and placed["place_s"] > 0, placed
    monkeypatch.setattr(receiver_handoffs.Handoffs, "_start_live", lambda *_args: None)
    whole = run(handoff())
    assert "live_rebuild" not in whole["receiver_stats"], whole["receiver_stats"]
    assert live["answer"] == whole["answer"] and live["answer"], (live["answer"], whole["answer"])
    assert live["recovered_utility"] == whole["recovered_utility"] == 1.0
