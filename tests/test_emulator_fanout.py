"""The emulator's fan-out relay: one uplink crossed once, a branch per receiver with its own delay and
seeded loss, receiver ports that reach one receiver, and each receiver's replies from its own relay port."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections import Counter
from typing import Any, cast

import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.emulator.fanout import Branch, FanoutRelay
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.sim.channel import Bernoulli, realization_rng

SEQ = struct.Struct(">I")


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.arrivals: list[tuple[float, bytes, Any]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.arrivals.append((time.monotonic(), data, addr))
        if self.echo and self.transport is not None:
            self.transport.sendto(data, addr)


async def _endpoint(echo: bool = False) -> tuple[asyncio.DatagramTransport, _Endpoint]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    t, p = await asyncio.get_running_loop().create_datagram_endpoint(lambda: _Endpoint(echo), sock=sock)
    return t, p


async def _until(cond: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.002)


async def _send(t: asyncio.DatagramTransport, addr: tuple[str, int], seqs: range, size: int) -> None:
    pad = bytes(size - SEQ.size)
    for k, i in enumerate(seqs):
        t.sendto(SEQ.pack(i) + pad, addr)
        if k % 20 == 19:
            await asyncio.sleep(0)


def _seqs(arrivals: list[tuple[float, bytes, Any]]) -> list[int]:
    return [SEQ.unpack_from(d)[0] for _, d, _ in arrivals]


LOSSES = (None, Bernoulli(0.2), Bernoulli(0.4))
OWDS = (0.002, 0.010, 0.030)


def test_fanout_relay_one_uplink_copy_per_receiver_branches_and_reverse_ports() -> None:
    """300 datagrams to the group port cross the 20 Mbit/s uplink once; receiver i gets exactly the ones
    its seeded branch keeps, after its own delay; every echo comes back from receiver i's relay port."""
    n, size = 300, 1000
    cfg = EmulatorConfig(forward=DirectionSpec(rate_bps=20e6, owd_s=0.0),
                         reverse=DirectionSpec(rate_bps=0, owd_s=0.0), seed=5)
    out: dict[str, Any] = {}

    async def main() -> None:
        sinks = [await _endpoint(echo=True) for _ in range(3)]
        src_t, src = await _endpoint()
        branches = [Branch(t.get_extra_info("sockname"), owd, loss) for (t, _), owd, loss
                    in zip(sinks, OWDS, LOSSES, strict=True)]
        try:
            async with FanoutRelay(cfg, ("127.0.0.1", 0), branches) as relay:
                t0 = time.monotonic()
                await _send(src_t, relay.listen_address, range(n), size)
                await _until(lambda: relay.forward.stats.received >= n and relay.in_flight() == 0, 5.0)
                await _until(lambda: relay.in_flight() == 0, 5.0)
                await asyncio.sleep(0.05)
                out["t0"] = t0
                out["got"] = [_seqs(p.arrivals) for _, p in sinks]
                out["first"] = [p.arrivals[0][0] - t0 for _, p in sinks]
                out["echo_from"] = Counter(a[:2] for _, _, a in src.arrivals)
                out["ports"] = relay.receiver_addresses
                out["group"] = relay.listen_address
                out["group_stats"] = relay.stats()
                # A receiver port reaches its receiver only.
                before = [len(p.arrivals) for _, p in sinks]
                await _send(src_t, relay.receiver_addresses[1], range(n, n + 10), 100)
                await _until(lambda: relay.in_flight() == 0, 2.0)
                await asyncio.sleep(0.05)
                out["unicast"] = [_seqs(p.arrivals[b:]) for (_, p), b in zip(sinks, before, strict=True)]
                out["stats"] = relay.stats()
        finally:
            for t, _ in sinks:
                t.close()
            src_t.close()

    asyncio.run(main())
    stats = out["stats"]
    assert stats["uplink"]["forward"]["received"] == n + 10  # one copy in, whatever the receivers
    assert stats["uplink"]["forward"]["bytes_in"] == n * size + 10 * 100
    for i, loss in enumerate(LOSSES):
        if loss is None:
            expected = list(range(n))
        else:
            lost = loss.realize(n, 1.0, realization_rng(5, 0, f"forward-{i}"))
            expected = [k for k in range(n) if not lost[k]]
            assert 0 < int(lost.sum()) < n
        assert out["got"][i] == expected, (i, stats["receivers"][i])
        assert out["group_stats"]["receivers"][i]["forward"]["lost"] == n - len(expected)
    assert out["got"][1] != out["got"][2]  # each branch its own erasure pattern
    # Each receiver's delay: never early; the 30 ms one clearly after the 2 ms one.
    assert out["first"][0] >= OWDS[0] and out["first"][2] >= OWDS[2], out["first"]
    assert out["first"][2] - out["first"][0] >= 0.020, out["first"]
    # Replies come back from receiver i's relay port, as many as receiver i got (lossless reverse).
    for i in range(3):
        assert out["echo_from"][out["ports"][i]] == len(out["got"][i]), out["echo_from"]
    assert out["group"] not in out["echo_from"]
    assert len(set(out["ports"])) == 3
    lost = Bernoulli(0.2).realize(n + 10, 1.0, realization_rng(5, 0, "forward-1"))[n:]
    assert out["unicast"] == [[], [n + k for k in range(10) if not lost[k]], []]


def test_fanout_relay_uplink_paces_once_for_all() -> None:
    """200 x 1400 B at 20 Mbit/s: 112 ms on the uplink for all three receivers, not 3 x 112 ms."""
    cfg = EmulatorConfig(forward=DirectionSpec(rate_bps=20e6, owd_s=0.0))
    out: dict[str, float] = {}

    async def main() -> None:
        sinks = [await _endpoint() for _ in range(3)]
        src_t, _ = await _endpoint()
        branches = [Branch(t.get_extra_info("sockname"), 0.0) for t, _ in sinks]
        try:
            async with FanoutRelay(cfg, ("127.0.0.1", 0), branches) as relay:
                t0 = time.monotonic()
                await _send(src_t, relay.listen_address, range(200), 1400)
                await _until(lambda: all(len(p.arrivals) >= 200 for _, p in sinks), 3.0)
                out["elapsed"] = max(p.arrivals[-1][0] for _, p in sinks) - t0
        finally:
            for t, _ in sinks:
                t.close()
            src_t.close()

    asyncio.run(main())
    assert 0.112 * 0.8 <= out["elapsed"] <= 0.112 * 1.3, out


def test_fanout_relay_rejects_duplicates_and_too_many() -> None:
    cfg = EmulatorConfig()
    with pytest.raises(ValueError, match="appears twice"):
        FanoutRelay(cfg, ("127.0.0.1", 0), [Branch(("127.0.0.1", 9)), Branch(("127.0.0.1", 9))])
    with pytest.raises(ValueError, match=r"1\.\.8 receivers"):
        FanoutRelay(cfg, ("127.0.0.1", 0), [Branch(("127.0.0.1", 9 + i)) for i in range(9)])
    with pytest.raises(ValueError, match="owd_s must be in"):
        Branch(("127.0.0.1", 9), owd_s=-1)


def test_emulate_cmd_fans_out_and_reports_per_receiver() -> None:
    runner = CliRunner()
    fwd = ["--forward-to", "127.0.0.1:9", "--forward-to", "127.0.0.1:10", "--forward-to", "127.0.0.1:11"]
    base = ["emulate", "--listen", "127.0.0.1:0", *fwd, "--duration", "0.2", "--json"]
    res = runner.invoke(app, [*base, "--loss", "bernoulli:0.02", "--loss", "none", "--loss",
                              "ge:0.001,0.5,0.02,0.1", "--rtt-ms", "10", "--rtt-ms", "20", "--rtt-ms", "40"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(stats["uplink"]) == {"forward", "reverse"}
    assert [r["address"] for r in stats["receivers"]] == ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"]
    assert [r["owd_ms"] for r in stats["receivers"]] == [5.0, 10.0, 20.0]
    res = runner.invoke(app, [*base, "--loss", "none", "--loss", "none"])
    assert res.exit_code == 2 and "--loss: give it once for all receivers or once per receiver (3)" in (
        res.output)
    res = runner.invoke(app, [*base, "--mode", "netns"])
    assert res.exit_code == 2 and "use --mode relay" in res.output
