"""Issue 12, what a client or a key-holding peer sends to the daemons: profile names (never paths), bounds
before allocation, strict types, destinations, the bounded model worker and /readyz, bounded
decompression, and every session ending.

The control API cases run against the real aiohttp app of a synthetic sender (no model); the profile and
session cases against real daemons on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import resource
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pfec.common.codec import fec
from pfec.common.node.config import LimitsConfig, SenderLimitsConfig
from pfec.common.node.control import control_app
from pfec.common.node.eventloop import run_event_loop
from pfec.common.node.profiles import ProfileStore
from pfec.common.node.udp import DestinationRefused, check_destination
from pfec.common.plan.handoff import OfferApp, ResultApp, synthetic_identity, unpack_bits
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.plan.utility import SHIPPED_PROFILE, ProfileError, synthetic_profile
from pfec.receiver.control import receiver_routes, session_views
from pfec.receiver.daemon import ReceiverDaemon
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import Handoff, HandoffSpec
from pfec.sender.kv import ContextInput
from pfec.sender.transport.transfer import MAX_FIRST_FLIGHT, MIN_FIRST_FLIGHT

T = TypeVar("T")
PSK = bytes(range(7, 39))
SMALL = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=32, dtype="bf16")
SECRET = "s3cr3t-contents-of-a-file-that-must-never-be-echoed"


def run(main: Coroutine[Any, Any, T]) -> T:
    return run_event_loop(main)


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    fec.warm_up()


@pytest.fixture()
def profile_dir(tmp_path: Path) -> Path:
    """A profile directory with a good profile, a FIFO, a directory, a secret non-profile and an
    oversized file, each under a valid profile name."""
    d = tmp_path / "profiles"
    d.mkdir()
    synthetic_profile(SMALL.n_layers).save(d / "good.json")
    os.mkfifo(d / "fifo.json")
    (d / "adir.json").mkdir()
    (d / "secret.json").write_text(SECRET)
    (d / "big.json").write_bytes(b" " * (64 << 10))
    (tmp_path / "outside.json").write_text(SECRET)
    return d


async def _with_sender(profile_dir: Path, limits: SenderLimitsConfig,
                       body: Callable[[TestClient[Any, Any], SenderDaemon], Awaitable[T]]) -> T:
    daemon = SenderDaemon(synthetic_identity(SMALL), PSK, rate_mbps=20, owd_ms=1, limits=limits,
                          profiles=ProfileStore(profile_dir, max_bytes=16 << 10))
    app = control_app(sender_routes(daemon), max_body=limits.max_request_bytes)
    async with TestClient(TestServer(app)) as client:
        try:
            return await body(client, daemon)
        finally:
            await daemon.close()


def _post_all(profile_dir: Path, bodies: list[Any], limits: SenderLimitsConfig | None = None,
              raw: bool = False) -> list[tuple[int, dict[str, Any], float]]:
    Result = list[tuple[int, dict[str, Any], float]]

    async def body(client: TestClient[Any, Any], _daemon: SenderDaemon) -> Result:
        out = []
        for b in bodies:
            started = time.monotonic()
            kwargs: dict[str, Any] = {"data": b} if raw else {"json": b}
            resp = await asyncio.wait_for(client.post("/handoffs", **kwargs), 10)
            out.append((resp.status, await resp.json(), time.monotonic() - started))
        return out

    return run(_with_sender(profile_dir, limits or SenderLimitsConfig(), body))


# --------------------------------------------------------------------------- profiles: names, never paths


def test_profile_names_that_are_paths_fifos_or_directories_are_refused(profile_dir: Path) -> None:
    base = {"receiver": "127.0.0.1:9", "synthetic_tokens": 64, "generate": False}
    cases = {
        "/etc/passwd": "bad value",  # an absolute path
        "../outside": "bad value",  # a traversal
        "..": "bad value",
        "a/b": "bad value",
        "Good": "bad value",  # names are lower case
        "fifo": "not a regular file",  # opened non-blocking: no hang
        "adir": "not a regular file",
        "secret": "not UTF-8 JSON",
        "big": "above the 16384-byte limit",
        "missing": "unknown",
    }
    results = _post_all(profile_dir, [{**base, "profile": name} for name in cases])
    for (name, reason), (status, data, elapsed) in zip(cases.items(), results, strict=True):
        assert status == 422, (name, data)
        assert data["fields"][0]["field"] == "profile", (name, data)
        assert reason in data["error"], (name, data)
        assert SECRET not in json.dumps(data), (name, data)
        assert elapsed < 5, (name, elapsed)
    status, data, _ = _post_all(profile_dir, [{**base, "profile": "good"}])[0]
    assert status == 202, data


def test_profile_store_reads_only_bounded_regular_files(profile_dir: Path) -> None:
    store = ProfileStore(profile_dir, max_bytes=16 << 10)
    assert store.load("good", SMALL.n_layers).n_layers == SMALL.n_layers
    assert store.load("synthetic", 7).n_layers == 7
    if SHIPPED_PROFILE.is_file():
        assert store.path_of("shipped") == SHIPPED_PROFILE
    for name, reason in (("fifo", "not a regular file"), ("adir", "not a regular file"),
                         ("big", "limit"), ("secret", "not UTF-8 JSON"), ("../x", "bad value")):
        with pytest.raises(ProfileError, match=reason) as info:
            store.load(name, SMALL.n_layers)
        assert SECRET not in str(info.value)
    with pytest.raises(ProfileError, match="for 4 layers, the model has 5"):
        store.load("good", 5)


def test_receiver_refuses_an_unknown_or_unusable_profile_with_a_reason(profile_dir: Path) -> None:
    """The OFFER's profile is a name resolved in the receiver's own directory, off the loop: a FIFO, a
    directory or an unknown name refuses the handoff (REFUSE with the reason), nothing hangs, and a good
    name completes."""
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rx = ReceiverDaemon(identity, PSK, profiles=ProfileStore(profile_dir, max_bytes=16 << 10))
        await rx.start("127.0.0.1", 0)
        # The sender knows every name (its own directory holds them all as good profiles).
        sender_dir = profile_dir.parent / "sender-profiles"
        sender_dir.mkdir()
        for name in ("fifo", "adir", "missing", "good"):
            synthetic_profile(SMALL.n_layers).save(sender_dir / f"{name}.json")
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, result_wait_s=1,
                          profiles=ProfileStore(sender_dir))
        handoffs = [tx.submit(HandoffSpec(ContextInput(synthetic_tokens=128), rx.address, deadline_ms=300,
                                          rho=None, generate=False, profile=name))
                    for name in ("fifo", "adir", "missing", "good")]
        reports = [await _wait(h, 15) for h in handoffs]
        await tx.close()
        for _ in range(100):
            if not rx.endpoint.sessions:
                break
            await asyncio.sleep(0.02)
        results = list(rx.results)
        assert not rx.endpoint.sessions, session_views(rx)
        await rx.close()
        return reports, results

    reports, _results = run(main())
    for report, reason in zip(reports[:3], ("not a regular file", "not a regular file", "unknown"),
                              strict=True):
        assert report["outcome"] == "refused", report
        assert "BAD_PARAMETERS" in report["failure"] and reason in report["failure"], report
    assert reports[3]["outcome"] == "done" and reports[3]["profile"] == "good", reports[3]


async def _wait(handoff: Handoff, timeout: float) -> dict[str, Any]:
    await asyncio.wait_for(handoff.done.wait(), timeout)
    return handoff.view()


# --------------------------------------------------------------------------- control API bounds and types


def test_control_api_types_bounds_depth_and_size(profile_dir: Path) -> None:
    limits = SenderLimitsConfig(max_context_tokens=1024, max_budget_ms=5000, max_request_bytes=64 << 10,
                                max_json_depth=8)
    target = "127.0.0.1:9"
    bodies: list[tuple[Any, int, str]] = [
        ({"receiver": target, "synthetic_tokens": True}, 422, "synthetic_tokens"),
        ({"receiver": target, "synthetic_tokens": 64.0}, 422, "synthetic_tokens"),
        ({"receiver": target, "synthetic_tokens": "64"}, 422, "synthetic_tokens"),
        ({"receiver": target, "synthetic_tokens": 2048}, 422, "max_context_tokens"),
        ({"receiver": target, "synthetic_tokens": 64, "deadline_ms": 10_000}, 422, "max_budget_ms"),
        ({"receiver": target, "synthetic_tokens": 64, "deadline_ms": 1e12}, 422, "deadline_ms"),
        ({"receiver": target, "synthetic_tokens": 64, "generate": 1}, 422, "generate"),
        ({"receiver": target, "context_ids": list(range(2000)), "question_ids": [1]}, 422, "context_ids"),
        ({"receiver": target, "synthetic_tokens": 64, "question_ids": [-1]}, 422, "question_ids"),
        ([[[[[[[[[[[[{"receiver": target}]]]]]]]]]]]], 400, "nests JSON"),
        ({"receiver": target, "synthetic_tokens": 64, "x": [[[[[[[[[[1]]]]]]]]]]}, 400, "nests JSON"),
    ]
    results = _post_all(profile_dir, [b for b, _, _ in bodies], limits)
    for (body, want, word), (status, data, _) in zip(bodies, results, strict=True):
        assert status == want and word in data["error"], (body, status, data)
    raw = [b"[" * 30_000 + b"]" * 30_000, b"{not json", b"\xff\xfe", b"x" * (65 << 10)]
    results = _post_all(profile_dir, raw, limits, raw=True)
    assert [s for s, _, _ in results] == [400, 400, 400, 413], results
    assert all(isinstance(d.get("error"), str) for _, d, _ in results)


def test_receiver_addresses_that_are_not_unicast_are_refused(profile_dir: Path) -> None:
    base = {"synthetic_tokens": 64, "generate": False}
    refused = ["224.0.0.1:7400", "239.1.2.3:7400", "255.255.255.255:7400", "0.0.0.0:7400",
               "169.254.169.254:80", "[ff02::1]:7400", "[fe80::1]:7400", "[::]:7400",
               "[::ffff:169.254.169.254]:80", "no-such-host.invalid:7400"]
    results = _post_all(profile_dir, [{**base, "receiver": r} for r in refused])
    for target, (status, data, _) in zip(refused, results, strict=True):
        assert status == 422 and data["fields"][0]["field"] == "receiver", (target, data)
        assert "refuses" in data["error"] or "cannot resolve" in data["error"], (target, data)
    # The allow-list re-enables a network; a plain address passes and the report shows what was used.
    check_destination("239.1.2.3", [__import__("ipaddress").ip_network("239.1.0.0/16")])
    with pytest.raises(DestinationRefused):
        check_destination("239.2.2.3", [__import__("ipaddress").ip_network("239.1.0.0/16")])
    limits = SenderLimitsConfig(allow_destinations=("239.1.0.0/16",))
    status, data, _ = _post_all(profile_dir, [{**base, "receiver": "239.1.2.3:7400"}], limits)[0]
    assert status == 202, data


def test_localhost_name_is_resolved_once_and_reported() -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=64), ("localhost", rx.address[1]), rho=3.0,
                                  generate=False))
        report = await _wait(h, 15)
        await tx.close()
        await rx.close()
        return report

    report = run(main())
    assert report["receiver"].startswith("localhost:") and report["receiver_address"] in (
        f"127.0.0.1:{report['receiver'].split(':')[1]}", f"[::1]:{report['receiver'].split(':')[1]}"), report
    assert report["outcome"] == "done", report


# --------------------------------------------------------------------------- model worker: bounded, /readyz


def test_full_worker_queue_is_503_and_a_stuck_worker_turns_readyz_red(profile_dir: Path) -> None:
    limits = SenderLimitsConfig(worker_queue=1, worker_stuck_s=0.05)
    release = threading.Event()

    async def body(client: TestClient[Any, Any], daemon: SenderDaemon) -> dict[str, Any]:
        out: dict[str, Any] = {}
        resp = await client.get("/readyz")
        out["ready_before"] = resp.status
        blocked = daemon.worker.submit(release.wait, 10)  # a model job that does not come back
        await asyncio.sleep(0.2)
        resp = await client.get("/readyz")
        out["ready_stuck"], out["ready_body"] = resp.status, await resp.json()
        resp = await client.get("/healthz")
        out["health"] = resp.status
        resp = await client.post("/handoffs", json={"receiver": "127.0.0.1:9", "synthetic_tokens": 64})
        out["busy"], out["busy_body"] = resp.status, await resp.json()
        release.set()
        await blocked
        resp = await client.get("/readyz")
        out["ready_after"] = resp.status
        return out

    try:
        out = run(_with_sender(profile_dir, limits, body))
    finally:
        release.set()
    assert out["ready_before"] == 200 and out["health"] == 200, out
    assert out["ready_stuck"] == 503 and "worker_stuck_s" in out["ready_body"]["error"], out
    assert out["busy"] == 503 and "worker_queue" in out["busy_body"]["error"], out
    assert out["ready_after"] == 200, out


def test_receiver_readyz_and_sessions_endpoints() -> None:
    async def main() -> tuple[int, int, dict[str, Any]]:
        rx = ReceiverDaemon(synthetic_identity(SMALL), PSK, limits=LimitsConfig(worker_stuck_s=0.05))
        await rx.start("127.0.0.1", 0)
        release = threading.Event()
        async with TestClient(TestServer(control_app(receiver_routes(rx)))) as client:
            ok = (await client.get("/readyz")).status
            job = rx.worker.submit(release.wait, 10)
            await asyncio.sleep(0.2)
            stuck = (await client.get("/readyz")).status
            sessions = await (await client.get("/sessions")).json()
            release.set()
            await job
        await rx.close()
        return ok, stuck, sessions

    ok, stuck, sessions = run(main())
    assert ok == 200 and stuck == 503 and sessions == {"sessions": []}


# --------------------------------------------------------------------------- a key holder's blobs


def _bomb(size: int) -> str:
    inflater = zlib.compressobj(9)
    packed = inflater.compress(bytes(size)) + inflater.flush()
    return base64.b64encode(packed).decode()


def test_zlib_bomb_in_a_result_is_refused_without_inflating_it() -> None:
    bomb = _bomb(577 << 20)  # the audit's RESULT: ~0.8 MB of base64 that inflates to 577 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with pytest.raises(ValueError, match="inflates beyond"):
        unpack_bits(bomb, 4096)
    assert time.perf_counter() - started < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: < 64 MiB grew
    fields = {"recovered_utility": 1.0, "blocks_recovered": 1, "n_blocks": 1, "decoded_symbols": 1,
              "n_source": 1, "blocks_bitmap": "", "ttft_s": None, "generation_ttft_s": None,
              "deadline_late_ms": 0.0, "answer": None, "mode": "mask"}
    assert ResultApp.decode(json.dumps(fields).encode()).n_blocks == 1
    for bad in ({**fields, "n_blocks": "1"}, {**fields, "stats": [1]}, {**fields, "blocks_bitmap": 5},
                {**fields, "surprise": 1}, {k: v for k, v in fields.items() if k != "mode"}):
        with pytest.raises(ValueError, match="RESULT"):
            ResultApp.decode(json.dumps(bad).encode())
    with pytest.raises(ValueError, match="limit"):
        ResultApp.decode(b" " * (2 << 20))


def test_offer_blob_is_bounded_before_anything_is_planned() -> None:
    good = OfferApp(128, (1, 2, 3), profile="shipped")
    assert OfferApp.decode(good.encode(), max_tokens=128) == good
    blob = json.loads(good.encode())
    cases = [
        ({**blob, "n_tokens": 20_000_000}, "n_tokens"),
        ({**blob, "n_tokens": 129}, "n_tokens"),
        ({**blob, "n_tokens": True}, "n_tokens"),
        ({**blob, "question_ids": list(range(5000))}, "question_ids"),
        ({**blob, "question_ids": [2**40]}, "question_ids"),
        ({**blob, "profile": "/etc/passwd"}, "profile"),
        ({**blob, "profile": "../../x"}, "profile"),
        ({**blob, "generate": "yes"}, "generate"),
        ({**blob, "order": "random"}, "order"),
    ]
    for data, field in cases:
        started = time.perf_counter()
        with pytest.raises(ValueError, match=f"OFFER {field}"):
            OfferApp.decode(json.dumps(data).encode(), max_tokens=128)
        assert time.perf_counter() - started < 0.05
    with pytest.raises(ValueError, match="nested"):
        OfferApp.decode(b"[" * 50_000 + b"]" * 50_000)
    with pytest.raises(ValueError, match="limit"):
        OfferApp.decode(b" " * (2 << 20))


def test_receiver_refuses_an_offer_beyond_its_limits_before_allocating() -> None:
    """A key holder's OFFER with a budget above the receiver's maximum, or more tokens than its maximum
    context, is refused with the reason; no session stays."""
    identity = synthetic_identity(SMALL)

    async def main() -> list[dict[str, Any]]:
        rx = ReceiverDaemon(identity, PSK, limits=LimitsConfig(max_context_tokens=256, max_budget_ms=2000))
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, result_wait_s=1,
                          limits=SenderLimitsConfig(max_budget_ms=10_000))
        specs = [HandoffSpec(ContextInput(synthetic_tokens=512), rx.address, rho=2.0, generate=False),
                 HandoffSpec(ContextInput(synthetic_tokens=64), rx.address, deadline_ms=5000, rho=None,
                             generate=False)]
        reports = [await _wait(tx.submit(spec), 15) for spec in specs]
        await tx.close()
        await asyncio.sleep(0.05)
        assert not rx.endpoint.sessions
        await rx.close()
        return reports

    too_long, too_slow = run(main())
    assert too_long["outcome"] == "refused" and "maximum context" in too_long["failure"], too_long
    assert too_slow["outcome"] == "refused" and "max_budget_ms" in too_slow["failure"], too_slow


# --------------------------------------------------------------------------- every session ends


def test_a_stuck_worker_cannot_keep_a_session_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild never returns: at its deadline plus the grace the receiver answers with an error
    RESULT and the session ends; /sessions shows it while it lives."""
    identity = synthetic_identity(SMALL)
    release = threading.Event()
    import pfec.receiver.daemon as rxd
    import pfec.receiver.handoffs as handoffs

    def stuck(*_args: Any) -> Any:
        release.wait(20)
        raise RuntimeError("released")

    monkeypatch.setattr(handoffs, "reconstruct", stuck)
    monkeypatch.setattr(rxd, "REAP_EVERY_S", 0.05)

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]], float]:
        rx = ReceiverDaemon(identity, PSK, limits=LimitsConfig(session_grace_s=0.3))
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, result_wait_s=3)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=64), rx.address, deadline_ms=200, rho=None,
                                  generate=False))
        while not rx.endpoint.sessions:
            await asyncio.sleep(0.005)
        views = session_views(rx)
        report = await _wait(h, 15)
        started = time.monotonic()
        while rx.endpoint.sessions:
            assert time.monotonic() - started < 5, session_views(rx)
            await asyncio.sleep(0.02)
        ended = time.monotonic() - started
        await tx.close()
        release.set()
        await rx.close()
        return report, views, ended

    try:
        report, views, _ended = run(main())
    finally:
        release.set()
    assert views and views[0]["state"] in ("receiving", "offer_incomplete"), views
    assert report["outcome"] == "failed" and "session_grace_s" in report["failure"], report


def test_a_silent_receiver_gets_a_bounded_first_flight_then_a_close() -> None:
    """No ACCEPT (a closed or silent port): the sender sends at most its first flight, gives up with a
    clear "no ACCEPT" failure and sends the CLOSE its session queued."""
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], list[int]]:
        loop = asyncio.get_running_loop()
        seen: list[int] = []

        class Silent(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                seen.append(data[1] & 0x3F)  # the message type under the key-phase bits

        transport, _ = await loop.create_datagram_endpoint(Silent, local_addr=("127.0.0.1", 0))
        tx = SenderDaemon(identity, PSK, rate_mbps=50, owd_ms=1, result_wait_s=0.2)
        h = tx.submit(HandoffSpec(ContextInput(synthetic_tokens=4096), transport.get_extra_info("sockname"),
                                  deadline_ms=8000, rho=None, generate=False))
        report = await _wait(h, 15)
        await asyncio.sleep(0.2)
        await tx.close()
        transport.close()
        return report, seen

    report, seen = run(main())
    assert report["outcome"] == "failed" and "ACCEPT" in report["failure"], report
    assert report["accepted"] is False, report
    data = sum(t in (1, 2) for t in seen)
    # The first flight: the handshake's round trip plus three OFFER repeats at 50 Mbit/s, bounded.
    assert MIN_FIRST_FLIGHT < data <= MAX_FIRST_FLIGHT < report["n_source"], (data, report["n_source"])
    assert seen[-1] == 8, seen[-5:]  # the CLOSE left last
