"""Real IP multicast (issue 37 item 5): namespaces joined by a Linux bridge, receivers joining the group on
their interface, the sender's datagrams crossing it once as multicast (the kernel replicates them), the
project's emulator (``pfec emulate`` joined to the group) putting each receiver's own losses on its last
mile. Root only (CI); elsewhere it skips with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pfec.lab.emulator.bridge import BridgeLan, setup_bridge_lan, teardown_bridge_lan, veth_counters
from pfec.lab.emulator.netns import netns_available
from pfec.lab.sim.channel import Bernoulli, realization_rng

_OK, _WHY = netns_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"multicast LAN of namespaces unavailable: {_WHY}")

PORT = 7500
SINK_PORT = 7600

# A group member: counts what arrives (by sequence number) until idle, echoes each datagram to its
# source when asked, prints the sequence numbers as JSON.
_MEMBER = textwrap.dedent(
    """
    import json, socket, struct, sys
    bind, port, join, echo = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root)
    s.bind((bind, port))
    if join != "-":
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                     socket.inet_aton(bind) + socket.inet_aton(join))
    print("ready", flush=True)
    s.settimeout(8.0)
    seqs = []
    try:
        while True:
            data, addr = s.recvfrom(4096)
            seqs.append(struct.unpack_from(">I", data)[0])
            s.settimeout(1.5)
            if echo:
                s.sendto(data[:8], addr)
    except socket.timeout:
        pass
    print(json.dumps(seqs), flush=True)
    """
)

# The sender: N datagrams to the group, once, from its veth; then collects replies for a while and prints
# how many came from each source address.
_SENDER = textwrap.dedent(
    """
    import json, socket, struct, sys, time
    group, port, iface, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(iface))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root): the replies wait while it sends
    s.bind((iface, 0))
    pad = bytes(996)
    for i in range(n):
        s.sendto(struct.pack(">I", i) + pad, (group, port))
        if i % 20 == 19:
            time.sleep(0.002)  # ~10 MB/s: no socket or bridge queue overflows on a loaded machine
    s.settimeout(2.0)
    got = {}
    try:
        while True:
            _, addr = s.recvfrom(64)
            got[addr[0]] = got.get(addr[0], 0) + 1
    except socket.timeout:
        pass
    print(json.dumps(got), flush=True)
    """
)


@pytest.fixture
def lan() -> Iterator[BridgeLan]:
    lan = BridgeLan(prefix=f"pmc{uuid.uuid4().hex[:5]}", receivers=4)
    setup_bridge_lan(lan)
    try:
        yield lan
    finally:
        teardown_bridge_lan(lan)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert lan.prefix not in left


def _in(ns: str, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ready(proc: subprocess.Popen[str], stream: Any, marker: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = stream.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"never ready ({marker!r}): {proc.communicate()}")


def _last_json(proc: subprocess.Popen[str], timeout: float = 30.0) -> Any:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    last = out.strip().splitlines()[-1]
    return json.loads(out[out.index("{"):] if last == "}" else last)


def test_kernel_replicates_the_group_to_joined_receivers(lan: BridgeLan) -> None:
    """400 datagrams leave the sender's interface once; each of the three members gets all 400, a host
    listening on the port without joining the group gets none."""
    n = 400
    members = []
    for i in range(lan.receivers):
        ns = lan.receiver(i)
        join = lan.address(ns) if i < 3 else "-"
        p = _in(ns, sys.executable, "-c", _MEMBER, lan.group, str(PORT), join, "0")
        _ready(p, p.stdout, "ready")
        members.append(p)
    before = veth_counters(lan, lan.sender)
    sender = _in(lan.sender, sys.executable, "-c", _SENDER, lan.group, str(PORT), lan.address(lan.sender),
                 str(n))
    assert _last_json(sender) == {}
    sent = veth_counters(lan, lan.sender)["tx_packets"] - before["tx_packets"]
    got = [_last_json(p) for p in members]
    assert [len(g) for g in got] == [n, n, n, 0], [len(g) for g in got]
    assert got[0] == list(range(n))
    # One copy out of the sender (a few IGMP reports besides), not one per receiver.
    assert n <= sent <= n + 20, sent


def test_multicast_through_the_emulated_last_miles(lan: BridgeLan) -> None:
    """Each receiver's `pfec emulate` joins the group and keeps exactly what its seeded loss keeps; the
    receivers' replies reach the sender unicast, told apart by source address."""
    n, losses = 400, (0.02, 0.08, 0.15)
    sinks, relays = [], []
    for i, p_loss in enumerate(losses):
        ns = lan.receiver(i)
        sink = _in(ns, sys.executable, "-c", _MEMBER, "127.0.0.1", str(SINK_PORT), "-", "1")
        _ready(sink, sink.stdout, "ready")
        relay = _in(ns, sys.executable, "-m", "pfec.cli.app", "emulate", "--listen", f"{lan.group}:{PORT}",
                    "--join-on", lan.address(ns), "--forward-to", f"127.0.0.1:{SINK_PORT}", "--loss",
                    f"bernoulli:{p_loss}", "--rate-mbps", "0", "--rtt-ms", "2", "--seed", str(11 + i),
                    "--duration", "12", "--stats-interval", "0", "--json")
        _ready(relay, relay.stderr, "relay listening on")
        sinks.append(sink)
        relays.append(relay)
    sender = _in(lan.sender, sys.executable, "-c", _SENDER, lan.group, str(PORT), lan.address(lan.sender),
                 str(n))
    replies = _last_json(sender)
    got = [_last_json(s) for s in sinks]
    stats = [_last_json(r) for r in relays]
    for i, p_loss in enumerate(losses):
        lost = Bernoulli(p_loss).realize(n, 1.0, realization_rng(11 + i, 0, "forward"))
        assert got[i] == [k for k in range(n) if not lost[k]], (i, stats[i])
        assert stats[i]["forward"]["received"] == n and stats[i]["forward"]["lost"] == int(lost.sum())
        assert replies[lan.address(lan.receiver(i))] == n - int(lost.sum()), replies
    assert len({tuple(g) for g in got}) == 3  # each last mile its own losses
