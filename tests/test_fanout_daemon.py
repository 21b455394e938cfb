"""Issue 37 item 3 over loopback: a unicast fan-out from one sender daemon to three receiver daemons (one
preparation, a session per receiver on one uplink clock), and the control API's fan-out validation."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.common.codec import fec
from pfec.common.node.control import ControlClient, ControlServer
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import KVGeometry
from pfec.receiver.daemon import ReceiverDaemon
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

PSK = bytes(range(100, 132))
SMALL = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=32, dtype="bf16")


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    fec.warm_up()


def test_unicast_fanout_to_three_receivers_one_preparation_one_uplink() -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], int, list[int]]:
        rxs = [ReceiverDaemon(identity, PSK) for _ in range(3)]
        for rx in rxs:
            await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, rate_mbps=30, owd_ms=1, result_wait_s=1, rate_control="fixed")
        prepares = 0
        original = tx._prepare

        async def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal prepares
            prepares += 1
            return await original(*args, **kwargs)

        tx._prepare = counting  # type: ignore[method-assign]
        spec = HandoffSpec(ContextInput(synthetic_tokens=256), rxs[0].address, rho=4.0, generate=False,
                           receivers=tuple(rx.address for rx in rxs))
        h = tx.submit(spec)
        await asyncio.wait_for(h.done.wait(), 60)
        links = [id(t.link) for t in tx.transfers]  # emptied after the streams; checked via the report
        await tx.close()
        for rx in rxs:
            await rx.close()
        return h.view(), prepares, links

    report, prepares, _ = run_event_loop(main())
    assert report["outcome"] == "done", report
    assert prepares == 1  # one preparation for the group
    assert report["fanout"] == "unicast" and len(report["receivers"]) == 3
    assert report["handoff_mode"] == "handoff"  # never a split in a fan-out
    for entry in report["receivers"]:
        assert entry["outcome"] == "done", entry
        assert entry["recovered_utility"] == pytest.approx(1.0)
        assert entry["decoded_symbols"] == report["n_source"]
    assert len({e["session_id"] for e in report["receivers"]}) == 3
    assert report["uplink_bytes"] == sum(e["bytes_sent"] for e in report["receivers"])


def test_fanout_validation_names_the_field_and_disturbs_nothing(tmp_path: Path) -> None:
    identity = synthetic_identity(SMALL)

    async def main() -> list[tuple[int, dict[str, Any], str]]:
        rx = await _receiver(identity)
        other = await _receiver(identity)
        tx = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        server = ControlServer(sender_routes(tx))
        sock = tmp_path / "s.sock"
        await server.start(sock, None, None)
        client = ControlClient(sock)
        a = f"{rx.address[0]}:{rx.address[1]}"
        b = f"{other.address[0]}:{other.address[1]}"
        cases = [
            ({"receivers": [a, a], "synthetic_tokens": 64}, "receivers.1"),
            ({"receivers": [a] * 9, "synthetic_tokens": 64}, "receivers"),
            ({"receivers": [], "synthetic_tokens": 64}, "receivers"),
            ({"receivers": [a, "nohost"], "synthetic_tokens": 64}, "receivers.1"),
            ({"receivers": [a, "224.1.1.1:7000"], "synthetic_tokens": 64}, "receivers.1"),  # refused address
            ({"receivers": [a, b, "unknown.invalid:7000"], "synthetic_tokens": 64}, "receivers.2"),  # unknown
            ({"receiver": a, "receivers": [b], "synthetic_tokens": 64}, "receivers"),
            ({"receivers": [a, b], "synthetic_tokens": 64, "fanout": "multicast"}, "fanout"),
            ({"receivers": [a, b], "synthetic_tokens": 64, "fanout": "broadcast"}, "fanout"),
        ]
        out = []
        for body, field in cases:
            status, data = await client.request("POST", "/handoffs", body)
            out.append((status, data, field))
        status, listing = await client.request("GET", "/handoffs")
        out.append((status, listing, "listing"))
        await server.close()
        await tx.close()
        await rx.close()
        await other.close()
        return out

    results = run_event_loop(main())
    for status, data, field in results[:-1]:
        assert status == 422, (field, data)
        assert field in data["error"], (field, data)
    status, listing, _ = results[-1]
    assert status == 200 and listing["handoffs"] == []  # nothing was started


async def _receiver(identity: Any) -> ReceiverDaemon:
    rx = ReceiverDaemon(identity, PSK)
    await rx.start("127.0.0.1", 0)
    return rx


T = TypeVar("T")


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


def test_cli_repeated_receiver_is_a_fanout(tmp_path: Path) -> None:
    """`pfec handoff --receiver A --receiver B` posts receivers (a fan-out), one --receiver stays receiver;
    --fanout goes with it, and is refused for one receiver."""
    identity = synthetic_identity(SMALL)
    lt = _LoopThread()
    sock = tmp_path / "s.sock"

    async def start() -> tuple[SenderDaemon, list[ReceiverDaemon], ControlServer]:
        rxs = [await _receiver(identity) for _ in range(2)]
        tx = SenderDaemon(identity, PSK, rate_mbps=30, owd_ms=1, result_wait_s=1, rate_control="fixed")
        server = ControlServer(sender_routes(tx))
        await server.start(sock, None, None)
        return tx, rxs, server

    tx, rxs, server = lt.call(start())
    try:
        a, b = (f"{rx.address[0]}:{rx.address[1]}" for rx in rxs)
        res = CliRunner().invoke(app, ["handoff", "--receiver", a, "--receiver", b, "--synthetic-tokens",
                                       "64", "--rho", "4", "--fanout", "unicast", "--socket", str(sock),
                                       "--json"])
        assert res.exit_code == 0, res.output
        printed = json.loads(res.stdout)
        assert printed["fanout"] == "unicast" and [e["receiver"] for e in printed["receivers"]] == [a, b]
        res = CliRunner().invoke(app, ["handoff", "--receiver", a, "--synthetic-tokens", "64", "--rho", "4",
                                       "--socket", str(sock), "--json"])
        assert res.exit_code == 0, res.output
        assert "receivers" not in json.loads(res.stdout)  # one receiver: a plain handoff
        res = CliRunner().invoke(app, ["handoff", "--receiver", a, "--fanout", "unicast",
                                       "--synthetic-tokens", "64", "--socket", str(sock)])
        assert res.exit_code == 2 and "--fanout" in res.output, res.output
        res = CliRunner().invoke(app, ["handoff", "--receiver", a, "--receiver", a, "--synthetic-tokens",
                                       "64", "--socket", str(sock)])
        assert res.exit_code == 2 and "receivers.1" in res.output, res.output  # the daemon's 422
        res = CliRunner().invoke(app, ["handoff", "--receiver", a, "--receiver", b, "--group", "239.1.1.1:7",
                                       "--synthetic-tokens", "64", "--socket", str(sock)])
        assert res.exit_code == 2 and "group" in res.output, res.output  # posted; no group configured
    finally:
        lt.call(server.close())
        lt.call(tx.close())
        for rx in rxs:
            lt.call(rx.close())
        lt.stop()
