"""`pfec bench fairness`: the per-flow meter (no privileges), and a small real run (root + netns)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pfec.lab.emulator.flows import MAX_FLOWS, OTHER, FlowMeter, flow_of
from pfec.lab.emulator.netns import netns_available
from pfec.lab.pathbench.fairness import FairnessConfig, run_fairness_bench, write_fairness_bench

_NETNS_OK, _NETNS_WHY = netns_available()


def _ipv4(proto: int, src_port: int, size: int, ihl: int = 5) -> bytes:
    header = bytes([0x40 | ihl]) + bytes(8) + bytes([proto]) + bytes(ihl * 4 - 10)
    ports = struct.pack("!HH", src_port, 7400)
    return header + ports + bytes(max(0, size - len(header) - 4))


def test_flow_of_names_tcp_and_udp_by_source_port_and_garbage_as_other() -> None:
    assert flow_of(_ipv4(6, 40646, 1500)) == "tcp:40646"
    assert flow_of(_ipv4(17, 7501, 1428)) == "udp:7501"
    assert flow_of(_ipv4(17, 9, 100, ihl=6)) == "udp:9"  # options: the ports follow the longer header
    assert flow_of(_ipv4(1, 0, 84)) == OTHER  # ICMP
    assert flow_of(b"") == OTHER
    assert flow_of(bytes([0x60]) + bytes(60)) == OTHER  # IPv6
    assert flow_of(bytes([0x4F]) + bytes(30)) == OTHER  # header longer than the packet
    assert flow_of(bytes([0x41]) + bytes(30)) == OTHER  # header length below 20


def test_flow_meter_bins_bytes_by_leaving_time_and_delay_and_drops_by_arrival() -> None:
    meter = FlowMeter(origin=100.0, bin_s=0.1, bins=10, owd_s=0.01)
    tcp, udp = _ipv4(6, 5000, 1500), _ipv4(17, 6000, 1428)
    meter.record(100.05, tcp, 100.05 + 0.02 + 0.01)  # left at 100.07: bin 0, 20 ms in the queue
    meter.record(100.08, udp, 100.08 + 0.04 + 0.01)  # arrived in bin 0, left at 100.12: bin 1
    meter.record(100.15, udp, None)  # dropped in bin 1
    meter.record(99.0, tcp, 99.5)  # before the origin
    meter.record(100.95, tcp, 101.5)  # leaves after the last bin
    assert meter.mbps("tcp:5000")[:2] == [round(1500 * 8 / 0.1 / 1e6, 3), 0.0]
    assert meter.mbps("udp:6000")[:2] == [0.0, round(1428 * 8 / 0.1 / 1e6, 3)]
    means, worst = meter.queue_delay_ms()
    assert means[0] == pytest.approx(30.0) and worst[0] == pytest.approx(40.0)
    assert means[1] is None
    assert list(meter.dropped[:2]) == [0, 1]
    assert meter.late == 2
    assert meter.active_s("udp:6000") == pytest.approx((0.12, 0.12))
    assert meter.active_s("missing") is None
    assert meter.window_bytes("udp:6000", 0, 10) == 1428
    assert meter.totals()["udp:6000"] == {"delivered_bytes": 1428, "dropped_packets": 1}


def test_flow_meter_holds_a_bounded_number_of_flows() -> None:
    meter = FlowMeter(origin=0.0, bin_s=1.0, bins=2, owd_s=0.0)
    for port in range(3 * MAX_FLOWS):
        meter.record(0.5, _ipv4(17, port, 1400), 0.6)
    assert len(meter.flows) <= MAX_FLOWS
    assert meter.flows[OTHER].delivered_bytes == 1400 * (3 * MAX_FLOWS - (MAX_FLOWS - 1))
    with pytest.raises(ValueError, match="bin_s"):
        FlowMeter(origin=0.0, bin_s=0.0, bins=2, owd_s=0.0)


def test_fairness_config_refuses_out_of_range_inputs() -> None:
    with pytest.raises(ValueError, match="tokens"):
        FairnessConfig(tokens=10**6)
    with pytest.raises(ValueError, match="queue_ms"):
        FairnessConfig(queue_ms=0.0)
    assert FairnessConfig().queue_packets == 833  # 100 ms at 100 Mbit/s in 1,500-byte packets


@pytest.mark.skipif(not _NETNS_OK, reason=f"netns/TUN emulator unavailable: {_NETNS_WHY}")
def test_a_short_handoff_next_to_kernel_tcp_through_the_namespaces(tmp_path: Path) -> None:
    """One small cubic scenario, real daemons and real kernel TCP: structure and that both flows got bytes
    through the bottleneck (the share targets are the benchmark's business, not this test's)."""
    cfg = FairnessConfig(tokens=1024, deadline_ms=1000.0, warmup_s=0.5, tail_s=0.3, link_mbps=50.0)
    result = run_fairness_bench(cfg, ("cubic",))
    write_fairness_bench(result, tmp_path)
    row = result["scenarios"][0]
    assert row["scenario"] == "cubic" and set(row["flows"]) == {"handoff", "tcp-cubic"}
    assert row["tcp"]["congestion_control"] == "cubic" and row["tcp"]["sent"] > 0
    for label, key in row["flows"].items():
        assert row["flow_totals"][key]["delivered_bytes"] > 100_000, (label, row["flow_totals"])
        assert max(row["series"]["mbps"][label]) > 1.0
    assert row["handoffs"][0]["outcome"] == "done", row["handoffs"]
    assert row["flows"]["handoff"] == f"udp:{row['handoffs'][0]['source_port']}"  # paired by the receiver
    assert row["window"] is not None and set(row["shares_of_link"]) == {"handoff", "tcp-cubic"}
    assert 0 < sum(row["shares_of_link"].values()) <= 1.05  # IP bytes through a link of that capacity
    assert len(row["series"]["t_s"]) == len(row["series"]["queue_delay_ms_mean"])
    assert json.loads((tmp_path / "fairness.json").read_text())["scenarios"][0]["scenario"] == "cubic"
    assert (tmp_path / "fairness.png").stat().st_size > 0
    assert "cubic" in (tmp_path / "fairness.md").read_text()
