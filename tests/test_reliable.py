"""Reliable baselines: prefix scoring; real kernel TCP and QUIC (qh3, aioquic) handoffs through the link
emulator, at a fixed rate and on a rate trace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.lab.baselines.endpoints import _warm_up
from pfec.lab.baselines.reliable import (
    HANDSHAKE_STALL_MS,
    QUIC_STACKS,
    RELIABLE_SCHEMES,
    ReliableRun,
    _aggregate,
    available_congestion_controls,
    bytes_by,
    run_reliable,
    score_prefix,
    stream_bytes,
)
from pfec.lab.baselines.runs import emulator_config, run_certificates
from pfec.lab.emulator.netns import netns_available
from pfec.lab.sim.channel import Bernoulli
from pfec.lab.sim.rate_trace import load_rate_trace
from pfec.lab.sim.simulate import SimConfig, prepare

_NETNS_OK, _NETNS_WHY = netns_available()
needs_netns = pytest.mark.skipif(not _NETNS_OK, reason=f"kernel TCP between namespaces: {_NETNS_WHY}")


def _small(loss: float = 0.0, **kw: object) -> SimConfig:
    if "deadline_ms" in kw:
        kw.setdefault("rho", None)
    return SimConfig(loss=Bernoulli(loss), tokens=32, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- scoring (no network)


def _oracle_utility(config: SimConfig, prefix: int) -> float:
    """Block by block: a block counts when every one of its fragments ends inside the prefix."""
    h = prepare(config)
    queue = list(h.queue("utility"))
    size = h.plan.symbol_size
    total = 0.0
    for block in range(h.plan.n_blocks):
        ends = [(queue.index(f) + 1) * size for f in h.plan.block_fragments(block)]
        if max(ends) <= prefix:
            total += float(h.block_utility[block])
    return total


def test_score_prefix_matches_a_block_by_block_oracle() -> None:
    cfg = _small(rho=2.0)
    h = prepare(cfg)
    size, n = h.plan.symbol_size, h.plan.n_fragments
    assert score_prefix(h, 0).utility == 0.0
    full = score_prefix(h, n * size)
    assert full.fragments == n and full.blocks == h.plan.n_blocks and full.utility == pytest.approx(1.0)
    for prefix in (size - 1, size, 7 * size + 3, n * size // 3, n * size - 1):
        got = score_prefix(h, prefix)
        assert got.fragments == prefix // size
        assert got.utility == pytest.approx(_oracle_utility(cfg, prefix))
    # Utility order: the first third of the stream holds well over a third of the utility.
    assert score_prefix(h, n * size // 3).utility > 0.4
    with pytest.raises(ValueError, match="prefix_bytes"):
        score_prefix(h, -1)


def test_stream_is_the_simulators_fragments_in_utility_order() -> None:
    h = prepare(_small(rho=2.0))
    data = stream_bytes(h)
    size = h.plan.symbol_size
    queue = h.queue("utility")
    assert len(data) == h.plan.n_fragments * size
    for pos in (0, 5, len(queue) - 1):  # each fragment starts with its big-endian fragment id
        assert int.from_bytes(data[pos * size : pos * size + 4], "big") == queue[pos]
    assert bytes_by([[1.0, 10], [2.0, 30], [3.0, 50]], 2.5) == 30
    assert bytes_by([[1.0, 10]], 0.5) == 0


def test_natural_order_streams_the_plan_order_and_scores_less_of_a_prefix() -> None:
    h = prepare(_small(rho=2.0))
    size, n = h.plan.symbol_size, h.plan.n_fragments
    natural = stream_bytes(h, "natural")
    for pos in (0, 5, n - 1):  # natural order is the plan's fragment order (layer-major)
        assert int.from_bytes(natural[pos * size : pos * size + 4], "big") == pos
    assert natural != stream_bytes(h, "utility") and len(natural) == n * size
    third = n * size // 3
    assert score_prefix(h, third, "natural").utility < score_prefix(h, third, "utility").utility
    assert score_prefix(h, n * size, "natural").utility == pytest.approx(1.0)
    with pytest.raises(ValueError, match="stream order 'random'"):
        score_prefix(h, 0, "random")  # type: ignore[arg-type]


def test_reliable_schemes_name_their_order() -> None:
    assert {n: (s.protocol, s.order) for n, s in RELIABLE_SCHEMES.items()} == {
        "tcp": ("tcp", "natural"), "quic": ("quic", "natural"),
        "priority-tcp": ("tcp", "utility"), "priority-quic": ("quic", "utility"),
    }  # fmt: skip
    assert [n for n, s in RELIABLE_SCHEMES.items() if s.paper_baseline] == ["tcp", "quic"]


def _run(handshake_ms: float, utility: float = 0.0, realization: int = 0) -> ReliableRun:
    return ReliableRun(realization, 0, utility, 0, 0, handshake_ms, None, 0.0, 0, 0, 0, 0.0, 0.0, 0.0, "bbr",
                       True, {}, 0.1)  # fmt: skip


def test_a_stalled_handshake_is_an_outlier_kept_in_the_mean() -> None:
    assert _run(21.0).stall is None and _run(HANDSHAKE_STALL_MS).stall is None
    assert "lost SYN" in str(_run(1021.0).stall)
    assert "no connection" in str(_run(math.nan).stall)
    runs = [_run(21.0, 0.9, 0), _run(math.nan, 0.0, 1), _run(22.0, 0.9, 2)]
    s = _aggregate(prepare(_small(rho=1.0)), RELIABLE_SCHEMES["tcp"], runs)
    assert s["recovered_utility_mean"] == pytest.approx(0.6) and s["recovered_utility_median"] == 0.9
    assert s["outlier_runs"] == 1 and s["outliers"][0]["realization"] == 1
    assert s["handshake_ms_mean"] == pytest.approx(21.5) and s["handshake_ms_max"] == 22.0


# --------------------------------------------------------------------------- real transports


@needs_netns
def test_tcp_small_handoff_without_loss_delivers_everything() -> None:
    out = run_reliable("tcp", _small(deadline_ms=3000.0), 1)
    s = out["schemes"]["tcp"]
    assert s["recovered_utility_mean"] == pytest.approx(1.0)
    assert s["in_order_bytes_mean"] == s["payload_bytes"] and s["payload_intact"]
    assert s["completed_runs"] == 1 and s["forward_lost_mean"] == 0
    default_cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert s["congestion_control"] == [default_cc] and s["emulator_mode"] == "netns"
    assert s["stream_order"] == "natural" and s["paper_baseline"]
    # The handshake (one RTT of 20 ms) is paid inside the budget.
    assert 18.0 <= s["handshake_ms_mean"] < 500.0
    assert s["outlier_runs"] == 0 and s["outliers"] == []


@needs_netns
def test_tcp_congestion_control_can_be_chosen() -> None:
    offered = available_congestion_controls()
    for cc in [c for c in ("cubic", "bbr") if c in offered]:
        out = run_reliable("priority-tcp", _small(deadline_ms=3000.0), 1, congestion_control=cc)
        s = out["schemes"]["priority-tcp"]
        assert s["congestion_control"] == [cc] and s["stream_order"] == "utility"
        assert s["recovered_utility_mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not offered by this kernel"):
        run_reliable("tcp", _small(rho=1.0), 1, congestion_control="nosuch")
    with pytest.raises(ValueError, match="kernel TCP only"):
        run_reliable("quic", _small(rho=1.0), 1, congestion_control="cubic")


def test_quic_small_handoff_without_loss_delivers_everything_via_cli() -> None:
    args = ["reliable", "--proto", "quic", "--loss", "none", "--tokens", "32", "--rho", "40",
            "--realizations", "1", "--json"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{") :])
    s = out["schemes"]["quic"]
    assert s["recovered_utility_mean"] == pytest.approx(1.0), s["runs"]
    assert s["in_order_bytes_mean"] == s["payload_bytes"] and s["payload_intact"]
    assert s["congestion_control"] == ["qh3 2.1.0 native"] and s["emulator_mode"] == "relay"
    assert s["quic_stack"] == "qh3" and "QUIC (qh3)" in s["definition"]
    assert s["handshake_ms_mean"] >= 18.0  # at least one emulated RTT


@pytest.mark.parametrize("stack", QUIC_STACKS)
def test_each_quic_stack_delivers_a_small_handoff_through_the_relay(stack: str) -> None:
    out = run_reliable("priority-quic", _small(deadline_ms=3000.0), 1, quic_stack=stack)
    s = out["schemes"]["priority-quic"]
    assert s["recovered_utility_mean"] == pytest.approx(1.0), s["runs"]
    assert s["payload_intact"] and s["completed_runs"] == 1 and s["emulator_mode"] == "relay"
    assert s["congestion_control"][0].startswith(f"{stack} ") and s["quic_stack"] == stack
    assert s["forward_packets_mean"] >= s["payload_bytes"] / 1400  # every datagram crossed the relay
    run = s["runs"][0]
    assert run["sender_state"]["cwnd_bytes"] > 0 and 0 < run["sender_cpu_share"] < 2
    with pytest.raises(ValueError, match="QUIC stack 'quiche'"):
        run_reliable("quic", _small(rho=1.0), 1, quic_stack="quiche")


@pytest.mark.parametrize("stack", QUIC_STACKS)
def test_the_endpoints_warm_up_handshake_completes_in_memory(stack: str, tmp_path: Path) -> None:
    ca, cert, key = run_certificates(str(tmp_path))
    assert _warm_up({"stack": stack, "ca": ca, "cert": cert, "key": key})
    assert not _warm_up({"stack": stack, "ca": cert, "cert": cert, "key": key})  # CA unknown: refused


# --------------------------------------------------------------------------- a rate-trace link


def _slow_trace(tmp_path: Path) -> Path:
    """A Mahimahi trace of one 1,500-byte opportunity per ms (12 Mbit/s), looping every 100 ms."""
    path = tmp_path / "slow.trace"
    path.write_text("".join(f"{ms}\n" for ms in range(1, 101)))
    return path


def test_the_rate_trace_and_queue_reach_the_emulators_forward_link(tmp_path: Path) -> None:
    trace = load_rate_trace(_slow_trace(tmp_path), 2.0)
    link = emulator_config(_small(rho=1.0, rate_trace=trace, queue_bytes=30_000), 3, queue_packets=50)
    assert link.forward.rate_trace is trace and link.forward.queue_bytes == 30_000
    assert link.reverse.rate_trace is None and link.reverse.queue_packets == 50 and link.realization == 3
    assert emulator_config(_small(rho=1.0), 0).forward.rate_trace is None
    with pytest.raises(ValueError, match="queue_packets"):
        run_reliable("quic", _small(rho=1.0), 1, queue_packets=0)


@pytest.mark.parametrize("proto", ["quic", pytest.param("tcp", marks=needs_netns)])
def test_a_handoff_on_a_slow_rate_trace_takes_the_traces_time(proto: str, tmp_path: Path) -> None:
    """Told 100 Mbit/s but on a 12 Mbit/s trace: the 737 KB stream needs ~0.5 s, not ~0.06 s."""
    args = ["reliable", "--proto", proto, "--loss", "none", "--tokens", "32", "--rho", "40",
            "--realizations", "1", "--rate-trace", str(_slow_trace(tmp_path)), "--rate-scale", "1",
            "--queue-ms", "200", "--json"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout[res.stdout.index("{") :])["schemes"][proto]
    assert s["rate_trace"]["name"].endswith("slow.trace") and s["rate_trace"]["mean_rate_mbps"] == 12.0
    assert s["recovered_utility_mean"] == pytest.approx(1.0) and s["payload_intact"]
    at_trace_rate_ms = s["payload_bytes"] * 8 / 12e6 * 1000
    assert s["completion_ms_mean"] > 0.8 * at_trace_rate_ms > 5 * s["payload_bytes"] * 8 / 100e6 * 1000
    assert s["link_rate_achieved_mbps"] < 20.0


@needs_netns
def test_cli_runs_a_named_scheme_with_a_chosen_congestion_control() -> None:
    default_cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    other = [c for c in ("cubic", "bbr") if c != default_cc and c in available_congestion_controls()]
    if not other:
        pytest.skip("this kernel offers neither cubic nor bbr besides its default")
    args = ["reliable", "--proto", "priority-tcp", "--congestion", other[0], "--loss", "none", "--tokens",
            "32", "--rho", "40", "--realizations", "1", "--json"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout[res.stdout.index("{") :])["schemes"]["priority-tcp"]
    assert s["congestion_control"] == [other[0]] and s["stream_order"] == "utility"
    assert not s["paper_baseline"] and s["recovered_utility_mean"] == pytest.approx(1.0)


def test_loss_and_a_tight_deadline_shorten_the_in_order_prefix() -> None:
    proto = "tcp" if _NETNS_OK else "quic"
    lossless = run_reliable(proto, _small(deadline_ms=150.0), 1)["schemes"][proto]
    lossy = run_reliable(proto, _small(0.1, deadline_ms=150.0), 1)["schemes"][proto]
    assert lossless["payload_intact"] and lossy["payload_intact"]
    assert lossy["forward_lost_mean"] > 0
    assert lossy["in_order_bytes_mean"] < lossless["in_order_bytes_mean"] <= lossless["payload_bytes"]
    assert lossy["recovered_utility_mean"] < 1.0
    assert np.isfinite(lossy["recovered_utility_mean"])


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="'udp'"):
        run_reliable("udp", _small(rho=1.0), 1)
    with pytest.raises(ValueError, match="realizations"):
        run_reliable("quic", _small(rho=1.0), 0)
    res = CliRunner().invoke(app, ["reliable", "--proto", "sctp"])
    assert res.exit_code == 2 and "use one of tcp, quic, priority-tcp, priority-quic" in res.output
    res = CliRunner().invoke(app, ["reliable", "--proto", "priority-quic", "--congestion", "bbr"])
    assert res.exit_code == 2 and "kernel TCP only" in res.output
    res = CliRunner().invoke(app, ["reliable", "--proto", "tcp", "--congestion", "vegas"])
    assert res.exit_code == 2 and "use cubic or bbr" in res.output
    res = CliRunner().invoke(app, ["reliable", "--proto", "quic", "--rho", "-1"])
    assert res.exit_code == 2 and "rho must be positive" in res.output


@pytest.mark.parametrize("stack", QUIC_STACKS)
def test_the_quic_receiver_gives_up_after_the_deadline_when_the_close_is_lost(
    stack: str, tmp_path: Path
) -> None:
    """A sender whose CONNECTION_CLOSE is lost (here: one that vanishes after sending) must not hold the
    run for the receiver's outer limit (~30 s of real time): like the TCP receiver, it reports
    AFTER_DEADLINE_S past the deadline counted from the handshake."""
    import asyncio
    import subprocess
    import sys
    import time

    from pfec.lab.baselines.endpoints import AFTER_DEADLINE_S, READY_TIMEOUT_S, quic_api

    api = quic_api({"stack": stack})
    quic_protocol, quic_configuration, quic_connection = api.protocol, api.configuration, api.connection
    ca, cert, key = run_certificates(str(tmp_path))
    payload = tmp_path / "payload.bin"
    payload.write_bytes(bytes(range(256)) * 64)
    deadline_s = 0.5
    params = {"stack": stack, "host": "127.0.0.1", "port": 0, "payload": str(payload), "total": 1 << 20,
              "deadline_s": deadline_s, "ca": ca, "cert": cert, "key": key}  # fmt: skip
    rx = subprocess.Popen([sys.executable, "-m", "pfec.lab.baselines.endpoints", "quic-receiver",
                           json.dumps(params)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert rx.stdout is not None
        port = int(json.loads(rx.stdout.readline())["port"])

        async def send_then_vanish() -> float:
            cfg = quic_configuration(is_client=True, server_name="localhost")
            cfg.load_verify_locations(cafile=ca)
            loop = asyncio.get_running_loop()
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: quic_protocol(quic_connection(configuration=cfg)),
                local_addr=("127.0.0.1", 0))
            protocol.connect(("127.0.0.1", port))
            await asyncio.wait_for(protocol.wait_connected(), 10)
            connected = time.monotonic()
            _reader, writer = await protocol.create_stream()
            writer.write(payload.read_bytes())
            await asyncio.sleep(0.2)
            transport.abort()  # gone without a CONNECTION_CLOSE
            return connected

        connected = asyncio.run(send_then_vanish())
        result = json.loads(rx.stdout.readline())
        waited = time.monotonic() - connected
    finally:
        rx.kill()
        rx.wait()
    assert result["bytes"] == len(payload.read_bytes()) and result["intact"]
    assert waited < deadline_s + AFTER_DEADLINE_S + 5.0 < READY_TIMEOUT_S, waited


# --------------------------------------------------------------------------- pfec bench quic


def test_the_quic_bench_measures_each_path_and_renders(tmp_path: Path) -> None:
    from pfec.lab.baselines.stack_bench import BENCH_PATHS, format_quic_bench, run_quic_bench

    result = run_quic_bench(("qh3",), runs=1, tokens=32, seconds=1.0)
    cells = {c["path"]: c for c in result["cells"]}
    assert set(cells) == set(BENCH_PATHS) and set(result["keeps_up"]) == {"qh3"}
    lossless = cells["relay"]["runs"][0]
    assert lossless["complete"] and lossless["intact"] and lossless["goodput_mbps"] > 0
    assert lossless["forward_lost"] == 0 and cells["relay-ge"]["runs"][0]["forward_lost"] > 0
    assert cells["loopback"]["runs"][0]["wire_rate_mbps"] is None  # no emulator counted anything
    assert lossless["sender_cpu_ms_per_mb"] > 0 and cells["relay"]["goodput_of_link"] is not None
    page = format_quic_bench({**result, "machine": {"cpu": "test", "cores": 2}})
    assert "| qh3 2.1.0 native | relay-ge |" in page and "Keeps up" in page
    with pytest.raises(ValueError, match="stacks"):
        run_quic_bench(("msquic",))
