"""Issue 12, over real sockets: a real handoff is captured, the receiver restarts, every captured datagram
is replayed at it, and nothing opens.

A receiver daemon and a sender daemon (synthetic KV, AEAD on) run a complete handoff on loopback through
``CaptureRelay``, which records every datagram the sender sent. The receiver daemon is then closed and a
new one (same port, same key) started; the relay replays the capture at it from its own socket, in order,
in reverse, and once more after the pending handshakes expired. The restarted receiver must create no
session (its ``/sessions`` shows no established one; no deadline, decode, result, utility or session
outcome in its metrics; nothing for its model worker), send nothing but small handshake ACCEPTs, and send at
most 3x the bytes it received (RFC 9000 section 8.1), both counted at the relay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pfec.common.codec import fec
from pfec.common.node.control import control_app
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.wire.frames import peek_header
from pfec.common.wire.messages import KeyPhase, MsgType
from pfec.lab.bench.flood import CaptureRelay
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.receiver.endpoint import AMPLIFICATION_FACTOR
from pfec.receiver.session import ReceiverConfig
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

T = TypeVar("T")
PSK = bytes(range(50, 82))
SMALL = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=32, dtype="bf16")  # 1 KiB of KV per token
HANDSHAKE_TIMEOUT_S = 0.5
# Nothing of a handoff may show in a restarted receiver's metrics (counts and histogram counts).
NO_HANDOFF_SERIES = (
    "pfec_receiver_deadline_lateness_seconds_count",
    "pfec_receiver_deadline_slack_seconds_count",
    "pfec_receiver_ttft_seconds_count",
    "pfec_receiver_recovered_utility_count",
    "pfec_receiver_decoded_symbols_total",
    "pfec_receiver_decoder_stalls_total",
    "pfec_receiver_sessions_total",
)


def run(main: Coroutine[Any, Any, T]) -> T:
    return run_event_loop(main)


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    fec.warm_up()


def _receiver(identity: Any) -> ReceiverDaemon:
    config = ReceiverConfig(handshake_timeout_s=HANDSHAKE_TIMEOUT_S)
    return ReceiverDaemon(identity, PSK, session_config=config)


def _samples(metrics: bytes) -> dict[str, float]:
    """Every sample of the exposition, ``name{labels}`` -> value (summed over labels by name too)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def _replay(relay: CaptureRelay, datagrams: list[bytes]) -> None:
    for i, datagram in enumerate(datagrams):
        relay.inject(datagram)
        if i % 16 == 15:  # let the receiver (same loop) read as it goes: no socket-buffer overflow
            await asyncio.sleep(0)
    await asyncio.sleep(0.1)  # the last replies arrive


async def _restart_and_replay(identity: Any, port: int, relay: CaptureRelay,
                              passes: tuple[tuple[str, list[bytes], float], ...]) -> dict[str, Any]:
    """A new receiver daemon on ``port``; each pass (name, datagrams, wait before) replayed at it."""
    rx = _receiver(identity)
    await rx.start("127.0.0.1", port)
    relay.reset_counts()
    out: dict[str, Any] = {"passes": []}
    async with TestClient(TestServer(control_app(receiver_routes(rx)))) as client:
        for name, datagrams, wait in passes:
            await asyncio.sleep(wait)
            sent, got = relay.bytes_to_receiver, relay.bytes_from_receiver
            await _replay(relay, datagrams)
            out["passes"].append({"pass": name, "sent": relay.bytes_to_receiver - sent,
                                  "received": relay.bytes_from_receiver - got,
                                  "sessions": (await (await client.get("/sessions")).json())["sessions"],
                                  "established": len(rx.endpoint.sessions)})
        await asyncio.sleep(HANDSHAKE_TIMEOUT_S + 0.6)  # pending handshakes expire, the reaper runs
        out["sessions_after"] = (await (await client.get("/sessions")).json())["sessions"]
        out["metrics"] = await (await client.get("/metrics")).read()
    out.update(replies=list(relay.replies), sent=relay.bytes_to_receiver, received=relay.bytes_from_receiver,
               results=list(rx.results), worker=rx.worker.view(), deadlines=len(rx.stats.deadline_late_s),
               drops=dict(rx.endpoint.drops), pending_after=len(rx.endpoint.pending_handshakes()),
               established_after=len(rx.endpoint.sessions), daemon_sessions=len(rx.sessions))
    await rx.close()
    return out


def test_replay_after_restart_opens_nothing_and_does_not_amplify() -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rx = _receiver(identity)
        await rx.start("127.0.0.1", 0)
        port = rx.address[1]
        out: dict[str, Any] = {}
        # 20 ms before a reply reaches the sender: its first flight goes out under the early key (on bare
        # loopback the ACCEPT can come back before the first paced data slot, and the capture holds no early
        # data: CI saw that once).
        async with CaptureRelay(rx.address, reply_delay_s=0.02) as relay:
            tx = SenderDaemon(identity, PSK, rate_mbps=50, owd_ms=1, scheme="heuristic", result_wait_s=1.0)
            handoff = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=512), relay.listen_address, rho=3.0,
                                            generate=False, repair_budget=0.3))
            await asyncio.wait_for(handoff.done.wait(), 30)
            out["report"] = handoff.view()
            await tx.close()
            out["first_results"] = list(rx.results)
            await rx.close()

            relay.forward_replies = False
            captured = out["captured"] = list(relay.captured)
            offers = [d for d in captured if peek_header(d).phase is KeyPhase.HANDSHAKE]
            expire = HANDSHAKE_TIMEOUT_S + 0.2
            # Two restarts (a new daemon on the same port and key each time): the first gets the capture in
            # order, reversed while its pending handshake lives, and again once it expired; the second, with
            # no memory of the first, gets it reversed (early data before its OFFER).
            out["restarts"] = []
            for passes in ((("in order", captured, 0.0), ("reversed", captured[::-1], 0.0),
                            ("after expiry", captured, expire)),
                           (("reversed", captured[::-1], 0.0), ("OFFERs x 50", offers * 50, 0.0))):
                out["restarts"].append(await _restart_and_replay(identity, port, relay, passes))
        return out

    out = run(main())
    report = out["report"]
    # The capture is a real, complete handoff: handshake, early and session data, CLOSE.
    assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0), report
    assert out["first_results"] and out["first_results"][-1].get("error") is None, out["first_results"]
    kinds = {(peek_header(d).phase, peek_header(d).type) for d in out["captured"]}
    for kind in ((KeyPhase.HANDSHAKE, MsgType.OFFER), (KeyPhase.EARLY, MsgType.SOURCE),
                 (KeyPhase.SESSION, MsgType.SOURCE), (KeyPhase.SESSION, MsgType.CLOSE)):
        assert kind in kinds, (kind, kinds)

    sent = received = replies = 0
    for restart in out["restarts"]:
        _check_restart(restart)
        sent, received, replies = sent + restart["sent"], received + restart["received"], replies + len(
            restart["replies"])
    factor = received / sent
    assert factor <= AMPLIFICATION_FACTOR
    worst = out["restarts"][-1]["passes"][-1]  # the OFFER alone, repeated: the most a replayer gets back
    assert 0 < worst["received"] <= AMPLIFICATION_FACTOR * worst["sent"], worst
    print(f"\nreplay after restart: {len(out['captured'])} datagrams, {len(out['restarts'])} restarts, "
          f"{sent} B replayed, {received} B answered ({replies} ACCEPTs): amplification {factor:.5f}; "
          f"OFFERs alone x 50: {worst['sent']} B -> {worst['received']} B = "
          f"{worst['received'] / worst['sent']:.3f}; drops {[r['drops'] for r in out['restarts']]}")


def _check_restart(out: dict[str, Any]) -> None:
    # No session: neither while the replays run nor after.
    for p in out["passes"]:
        assert p["established"] == 0, p
        assert all(s["state"] == "handshake" for s in p["sessions"]), p
    assert out["established_after"] == 0 and out["daemon_sessions"] == 0 and out["pending_after"] == 0
    assert out["sessions_after"] == []
    assert out["results"] == [] and out["deadlines"] == 0, out
    assert out["worker"]["queued"] == 0 and out["worker"]["running_s"] is None, out["worker"]
    samples = _samples(out["metrics"])
    for name in NO_HANDOFF_SERIES:
        assert samples.get(name, 0.0) == 0.0, (name, samples.get(name))
    assert samples.get("pfec_receiver_datagrams_sent_total", 0.0) == samples.get(
        "pfec_receiver_datagrams_sent_total{type=accept}", 0.0), samples

    # No data back: at most small ACCEPTs (handshake phase), within 3x of what the replayer sent.
    assert out["replies"], "a replayed OFFER gets its stateless challenge"
    for reply in out["replies"]:
        header = peek_header(reply)
        assert (header.phase, header.type) == (KeyPhase.HANDSHAKE, MsgType.ACCEPT), header
        assert len(reply) <= 116, len(reply)  # an ACCEPT (its stated speed included)
    assert out["drops"].get("junk_auth", 0) + out["drops"].get("no_session", 0) > 0  # old session data
    for p in out["passes"]:
        assert p["received"] <= AMPLIFICATION_FACTOR * p["sent"], p
