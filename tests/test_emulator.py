"""Link emulator: the sans-IO pipeline, the UDP relay over real loopback sockets, and the netns/TUN bridge."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import numpy as np
import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.emulator.link import LOSS_CHUNK, DirectionSpec, EmulatorConfig, LinkDirection, parse_loss
from pfec.lab.emulator.netns import (
    NetnsSpec,
    TunBridge,
    netns_available,
    setup_namespaces,
    teardown_namespaces,
)
from pfec.lab.emulator.relay import UdpRelay
from pfec.lab.sim.channel import MAIN_GE, Bernoulli, LossModel, realization_rng

SEQ = struct.Struct(">I")
Tr = asyncio.DatagramTransport

try:
    import uvloop
except ImportError:  # pinned, but the stdlib-loop cases still run without it
    uvloop = None  # type: ignore[assignment]


def _loops() -> list[Any]:
    out: list[Any] = [pytest.param(asyncio.run, id="asyncio")]
    if uvloop is not None:
        out.append(pytest.param(uvloop.run, id="uvloop"))
    else:
        out.append(pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop not installed")))
    return out


# --------------------------------------------------------------------------- pure pipeline


def test_virtual_time_rate_queue() -> None:
    d = LinkDirection(DirectionSpec(rate_bps=1e6, owd_s=0.005, queue_packets=3), np.random.default_rng(0))
    # 1250 B at 1 Mbit/s = 10 ms on the wire, then 5 ms of delay.
    assert d.offer(0.0, 1250) == pytest.approx(0.015)
    assert d.offer(0.0, 1250) == pytest.approx(0.025)  # waits for the first
    assert d.offer(0.001, 1250) == pytest.approx(0.035)
    assert d.offer(0.002, 1250) is None  # three in the link: drop-tail
    assert d.offer(0.0105, 125) == pytest.approx(0.031 + 0.005)  # first one left at 10 ms
    assert d.offer(1.0, 125) == pytest.approx(1.001 + 0.005)  # idle link: starts at once
    st = d.stats
    assert (st.received, st.queue_dropped, st.max_queue) == (6, 1, 3)


def test_unlimited_rate_and_loss_indices() -> None:
    spec = DirectionSpec(rate_bps=0, owd_s=0.0, loss=Bernoulli(0.5), queue_packets=1)
    d = LinkDirection(spec, realization_rng(4, 0, "forward"))
    n = LOSS_CHUNK + 500  # crosses a realization chunk
    got = np.array([d.offer(0.0, 100) is None for _ in range(n)])
    rng = realization_rng(4, 0, "forward")
    first = Bernoulli(0.5).realize(LOSS_CHUNK, 1.0, rng)
    second = Bernoulli(0.5).realize(LOSS_CHUNK, 1.0, rng)[:500]
    assert np.array_equal(got, np.concatenate([first, second]))
    assert d.stats.lost == int(got.sum()) and d.stats.queue_dropped == 0


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="rate_bps must be >= 0"):
        DirectionSpec(rate_bps=-1)
    with pytest.raises(ValueError, match="owd_s must be in"):
        DirectionSpec(owd_s=float("nan"))
    with pytest.raises(ValueError, match="queue_packets must be an int >= 1"):
        DirectionSpec(queue_packets=0)
    assert parse_loss("none") is None
    with pytest.raises(ValueError, match="bad loss spec"):
        parse_loss("gauss:1")
    with pytest.raises(ValueError, match="ns_a and ns_b must differ"):
        NetnsSpec(ns_a="x", ns_b="x")


# --------------------------------------------------------------------------- UDP relay over loopback


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, echo: bool = False) -> None:
        self.echo = echo
        self.arrivals: list[tuple[float, bytes]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.arrivals.append((time.monotonic(), data))
        if self.echo and self.transport is not None:
            self.transport.sendto(data, addr)


async def _endpoint(echo: bool = False) -> tuple[asyncio.DatagramTransport, _Endpoint]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Like the daemons, a large buffer: when the test process is descheduled, the relay's timer delivers
    # the overdue datagrams as one burst, which the 208 KiB default would partly drop.
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    t, p = await loop.create_datagram_endpoint(lambda: _Endpoint(echo), sock=sock)
    return t, p


async def _until(cond: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return
        await asyncio.sleep(0.002)


def _seqs(arrivals: list[tuple[float, bytes]]) -> list[int]:
    return [SEQ.unpack_from(d)[0] for _, d in arrivals]


async def _through_relay(
    config: EmulatorConfig,
    body: Callable[[UdpRelay, asyncio.DatagramTransport, _Endpoint, _Endpoint], Awaitable[None]],
    echo: bool = False,
) -> None:
    sink_t, sink = await _endpoint(echo)
    src_t, src = await _endpoint()
    try:
        async with UdpRelay(config, ("127.0.0.1", 0), sink_t.get_extra_info("sockname")) as relay:
            await body(relay, src_t, src, sink)
    finally:
        sink_t.close()
        src_t.close()


async def _send(t: Tr, addr: tuple[str, int], n: int, size: int, burst: int = 20) -> None:
    pad = bytes(size - SEQ.size)
    for i in range(n):
        t.sendto(SEQ.pack(i) + pad, addr)
        if i % burst == burst - 1:
            await asyncio.sleep(0)  # let the relay drain its socket (loopback has no flow control)


@pytest.mark.parametrize("runner", _loops())
def test_relay_paces_at_the_link_rate(runner: Callable[[Any], Any]) -> None:
    """200 x 1400 B at 20 Mbit/s: 112 ms of serialisation (+-20%), order kept, nothing lost."""
    cfg = EmulatorConfig(forward=DirectionSpec(rate_bps=20e6, owd_s=0.0, queue_packets=1000))
    out: dict[str, Any] = {}

    async def body(relay: UdpRelay, src_t: Tr, src: _Endpoint, sink: _Endpoint) -> None:
        t0 = time.monotonic()
        await _send(src_t, relay.listen_address, 200, 1400)
        await _until(lambda: len(sink.arrivals) >= 200, 3.0)
        out["elapsed"] = sink.arrivals[-1][0] - t0 if sink.arrivals else None
        out["seqs"] = _seqs(sink.arrivals)
        out["stats"] = relay.stats()

    runner(_through_relay(cfg, body))
    assert out["seqs"] == list(range(200)), out["stats"]
    assert 0.112 * 0.8 <= out["elapsed"] <= 0.112 * 1.2, out["elapsed"]
    assert out["stats"]["forward"]["bytes_out"] == 200 * 1400


def test_relay_applies_delay_both_ways() -> None:
    cfg = EmulatorConfig(
        forward=DirectionSpec(rate_bps=0, owd_s=0.030), reverse=DirectionSpec(rate_bps=0, owd_s=0.020)
    )
    lat: dict[str, list[float]] = {"one_way": [], "rtt": []}

    async def body(relay: UdpRelay, src_t: Tr, src: _Endpoint, sink: _Endpoint) -> None:
        for i in range(5):
            t = time.monotonic()
            src_t.sendto(SEQ.pack(i) + bytes(100), relay.listen_address)
            await _until(lambda: len(src.arrivals) > len(lat["rtt"]), 1.0)
            lat["one_way"].append(sink.arrivals[i][0] - t)
            lat["rtt"].append(src.arrivals[i][0] - t)

    asyncio.run(_through_relay(cfg, body, echo=True))
    # Never early; late only by scheduling (the median tight, one datagram may meet a busy machine).
    assert min(lat["one_way"]) >= 0.030 and min(lat["rtt"]) >= 0.050, lat
    assert statistics.median(lat["one_way"]) <= 0.040 and max(lat["one_way"]) <= 0.060, lat
    assert statistics.median(lat["rtt"]) <= 0.065 and max(lat["rtt"]) <= 0.090, lat


@pytest.mark.parametrize("model", [Bernoulli(0.3), MAIN_GE], ids=["bernoulli", "ge"])
def test_relay_seeded_loss_is_deterministic(model: LossModel) -> None:
    """The k-th forwarded datagram is lost exactly when realization_rng(seed, 0, 'forward') says so."""
    n, rate = 400, 50e6
    slot = 1400 * 8 / rate

    def run(seed: int) -> list[int]:
        cfg = EmulatorConfig(forward=DirectionSpec(rate_bps=rate, owd_s=0.001, loss=model), seed=seed)
        got: list[int] = []
        stats: dict[str, Any] = {}

        async def body(relay: UdpRelay, src_t: Tr, src: _Endpoint, sink: _Endpoint) -> None:
            await _send(src_t, relay.listen_address, n, 200)
            fwd = relay.forward.stats
            await _until(lambda: fwd.delivered + fwd.lost >= n, 5.0)
            await _until(lambda: len(sink.arrivals) >= fwd.delivered, 5.0)
            got.extend(_seqs(sink.arrivals))
            stats.update(relay.stats())

        asyncio.run(_through_relay(cfg, body))
        assert stats["forward"]["delivered"] == len(got), stats  # the kernel dropped none
        return got

    lost = model.realize(n, slot, realization_rng(7, 0, "forward"))
    expected = [i for i in range(n) if not lost[i]]
    assert 0 < int(lost.sum()) < n
    first = run(7)
    assert first == expected
    assert run(7) == first
    assert run(8) != first


def test_relay_reverse_path_loss_and_peer_tracking() -> None:
    n = 200
    cfg = EmulatorConfig(
        forward=DirectionSpec(rate_bps=0, owd_s=0.002),
        reverse=DirectionSpec(rate_bps=10e6, owd_s=0.002, loss=Bernoulli(0.5)),
        seed=3,
    )
    got: dict[str, Any] = {}

    async def body(relay: UdpRelay, src_t: Tr, src: _Endpoint, sink: _Endpoint) -> None:
        await _send(src_t, relay.listen_address, n, 100)
        rev = relay.reverse.stats
        await _until(lambda: rev.delivered + rev.lost >= n, 5.0)
        await _until(lambda: len(src.arrivals) >= rev.delivered, 5.0)
        got["echoed"] = _seqs(src.arrivals)
        got["forwarded"] = _seqs(sink.arrivals)
        got["stats"] = relay.stats()

    asyncio.run(_through_relay(cfg, body, echo=True))
    lost = Bernoulli(0.5).realize(n, 1.0, realization_rng(3, 0, "reverse"))
    assert got["forwarded"] == list(range(n))
    assert got["echoed"] == [i for i in range(n) if not lost[i]], got["stats"]
    assert got["stats"]["reverse"]["lost"] == int(lost.sum())


def test_relay_queue_drop_tail() -> None:
    # 1000 B at 0.4 Mbit/s = 20 ms each; 50 sent at once into a 10-datagram queue -> 40 dropped.
    cfg = EmulatorConfig(forward=DirectionSpec(rate_bps=0.4e6, owd_s=0.0, queue_packets=10))
    got: dict[str, Any] = {}

    async def body(relay: UdpRelay, src_t: Tr, src: _Endpoint, sink: _Endpoint) -> None:
        await _send(src_t, relay.listen_address, 50, 1000, burst=50)
        fwd = relay.forward.stats
        await _until(lambda: fwd.received >= 50 and len(sink.arrivals) >= fwd.delivered >= 10, 3.0)
        got["seqs"] = _seqs(sink.arrivals)
        got["stats"] = relay.forward.stats

    asyncio.run(_through_relay(cfg, body))
    assert got["stats"].queue_dropped == 40 and got["stats"].max_queue == 10
    assert got["seqs"] == list(range(10))


def test_emulate_cmd_runs_and_reports(tmp_path: Any) -> None:
    runner = CliRunner()
    args = ["emulate", "--listen", "127.0.0.1:0", "--forward-to", "127.0.0.1:9", "--duration", "0.2",
            "--json"]
    res = runner.invoke(app, [*args, "--loss", "ge:0.001,0.5,0.02,0.1", "--seed", "3"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout[res.stdout.index("{") :])
    assert stats["forward"]["received"] == 0 and "reverse" in stats
    # Its SIGTERM handler went with its loop: one left behind made later forked workers immortal.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    res = runner.invoke(app, [*args, "--loss", "bernoulli:2"])
    assert res.exit_code == 2 and "bad loss spec 'bernoulli:2'" in res.output
    res = runner.invoke(app, ["emulate", "--mode", "tunnel"])
    assert res.exit_code == 2 and "use 'relay' or 'netns'" in res.output


# --------------------------------------------------------------------------- namespaces + TUN

_NETNS_OK, _NETNS_WHY = netns_available()

_ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys, time, json
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 7400))
    s.settimeout(3.0)
    print("ready", flush=True)
    seen = []
    try:
        while True:
            data, addr = s.recvfrom(2048)
            seen.append([time.monotonic(), int.from_bytes(data[:4], "big")])
            s.sendto(data, addr)
    except socket.timeout:
        pass
    print(json.dumps(seen), flush=True)
    """
)

_CLIENT = textwrap.dedent(
    """
    import socket, sys, time, json
    n = int(sys.argv[2])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((sys.argv[1], 7400))
    t0 = time.monotonic()
    for i in range(n):
        s.send(i.to_bytes(4, "big") + bytes(1200))
        time.sleep(0.0002)
    s.settimeout(1.0)
    echoed = []
    try:
        while True:
            echoed.append(int.from_bytes(s.recv(2048)[:4], "big"))
    except socket.timeout:
        pass
    print(json.dumps({"t0": t0, "echoed": echoed}), flush=True)
    """
)


@pytest.mark.skipif(not _NETNS_OK, reason=f"netns/TUN bridge unavailable: {_NETNS_WHY}")
def test_netns_tun_bridge() -> None:
    """Two namespaces created by this test only; real IP/UDP between them through the emulated link."""
    tag = uuid.uuid4().hex[:6]
    spec = NetnsSpec(ns_a=f"pfec-ta-{tag}", ns_b=f"pfec-tb-{tag}")
    n = 100
    cfg = EmulatorConfig(
        forward=DirectionSpec(rate_bps=20e6, owd_s=0.005, loss=Bernoulli(0.2)),
        reverse=DirectionSpec(rate_bps=20e6, owd_s=0.005),
        seed=11,
    )

    async def main() -> tuple[dict[str, Any], list[list[float]], dict[str, Any]]:
        async with TunBridge(cfg, spec) as bridge:
            server = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", spec.ns_b, sys.executable, "-c", _ECHO_SERVER, spec.addr_b,
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                assert server.stdout is not None
                line = await asyncio.wait_for(server.stdout.readline(), 20)
                assert line.strip() == b"ready"
                client = await asyncio.create_subprocess_exec(
                    "ip", "netns", "exec", spec.ns_a, sys.executable, "-c", _CLIENT, spec.addr_b, str(n),
                    stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                c_out, _ = await asyncio.wait_for(client.communicate(), 30)
                s_out, _ = await asyncio.wait_for(server.communicate(), 30)
            finally:
                if server.returncode is None:
                    server.kill()
                    await server.wait()
            return json.loads(c_out), json.loads(s_out.splitlines()[-1]), bridge.stats()

    teardown_namespaces(spec)
    setup_namespaces(spec)
    try:
        client, seen, stats = asyncio.run(main())
    finally:
        teardown_namespaces(spec)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert spec.ns_a not in left and spec.ns_b not in left
    lost = Bernoulli(0.2).realize(n, 1.0, realization_rng(11, 0, "forward"))
    expected = [i for i in range(n) if not lost[i]]
    assert stats["forward"]["received"] == n, stats  # nothing but our datagrams crossed the link
    assert [s for _, s in seen] == expected, stats
    assert client["echoed"] == expected
    first_latency = seen[0][0] - client["t0"]
    assert 0.005 <= first_latency <= 0.05, first_latency
    # 1232-byte IP packets at 20 Mbit/s: ~0.49 ms each, so the sender's 0.2 ms spacing is paced out.
    span = seen[-1][0] - seen[0][0]
    assert span >= 0.8 * (expected[-1] - expected[0]) * 1232 * 8 / 20e6, span


@pytest.mark.skipif(not _NETNS_OK, reason=f"netns/TUN bridge unavailable: {_NETNS_WHY}")
def test_emulate_cmd_netns_creates_and_removes_its_namespaces() -> None:
    tag = uuid.uuid4().hex[:6]
    a, b = f"pfec-ca-{tag}", f"pfec-cb-{tag}"
    try:
        args = ["emulate", "--mode", "netns", "--ns-a", a, "--ns-b", b, "--duration", "0.3", "--json"]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        stats = json.loads(res.stdout[res.stdout.index("{") :])
        assert stats["forward"]["received"] == 0  # nothing but our own traffic would cross the link
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert a not in left and b not in left
        # An existing namespace of the same name is never reused (it may not be ours).
        subprocess.run(["ip", "netns", "add", a], check=True)
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and f"{a} already exist" in res.output
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert a in left and b not in left  # the clash left the foreign namespace alone
    finally:
        teardown_namespaces(NetnsSpec(ns_a=a, ns_b=b))
