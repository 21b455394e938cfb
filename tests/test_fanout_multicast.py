"""Issue 37 item 3 over loopback, multicast: one stream sealed once under a group key, from one sender
daemon to three receiver daemons, each member's OFFER carrying the ticket inside its own handshake.

The group destination is a real IPv4 multicast group joined on 127.0.0.1 where the kernel allows it (else
that test skips, saying why), or an in-test replicator that copies each datagram to every member with its
own seeded loss (the role ``pfec emulate --mode relay`` plays with several ``--forward-to``).
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pfec.common.codec import fec
from pfec.common.node.control import ControlClient, ControlServer
from pfec.common.node.eventloop import run_event_loop
from pfec.common.node.multicast import join_socket, send_socket
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.wire.frames import peek_header
from pfec.common.wire.group import GroupTicket, group_sealer
from pfec.common.wire.messages import Offer, Role
from pfec.common.wire.seal import Keyring, PacketProtector
from pfec.receiver.daemon import ReceiverDaemon
from pfec.receiver.endpoint import ReceiverEndpoint
from pfec.receiver.session import ReceiverConfig, ReceiverSession
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

PSK = bytes(range(100, 132))
SMALL = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=32, dtype="bf16")
TOKENS = 512


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    fec.warm_up()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_multicast(group: str) -> str | None:
    """Why a multicast group cannot be used on loopback here (None: it can)."""
    try:
        rx = join_socket(group, "127.0.0.1", 1 << 16)
        tx = send_socket(group, "127.0.0.1", 1, 1 << 16)
    except OSError as exc:
        return f"the kernel refused a loopback multicast group: {exc}"
    try:
        host, port = group.rsplit(":", 1)
        tx.sendto(b"probe", (host, int(port)))
        rx.settimeout(1.0)
        rx.setblocking(True)
        rx.recvfrom(64)
        return None
    except OSError as exc:
        return f"a datagram to {group} did not loop back on lo (IP_MULTICAST_LOOP): {exc}"
    finally:
        rx.close()
        tx.close()


class Replicator(asyncio.DatagramProtocol):
    """A group destination that plays the site's multicast: every datagram copied to each member, with
    member i's own seeded Bernoulli loss ``losses[i]``."""

    def __init__(self, members: list[tuple[str, int]], losses: list[float], seed: int = 7) -> None:
        self.members, self.losses = members, losses
        self.rngs = [random.Random(seed + i) for i in range(len(members))]
        self.transport: asyncio.DatagramTransport | None = None
        self.received = 0
        self.received_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint's (uvloop's own class)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received += 1
        self.received_bytes += len(data)
        assert self.transport is not None
        for member, loss, rng in zip(self.members, self.losses, self.rngs, strict=True):
            if rng.random() >= loss:
                self.transport.sendto(data, member)


async def _receivers(n: int, groups: tuple[str, ...] = ()) -> list[ReceiverDaemon]:
    identity = synthetic_identity(SMALL)
    out = []
    for _ in range(n):
        rx = ReceiverDaemon(identity, PSK)
        await rx.start("127.0.0.1", 0, groups=groups, interface="127.0.0.1" if groups else None)
        out.append(rx)
    return out


def _spec(rxs: list[ReceiverDaemon], fanout: str, group: str | None = None, rho: float = 4.0) -> HandoffSpec:
    return HandoffSpec(ContextInput(synthetic_tokens=TOKENS), rxs[0].address, rho=rho, generate=False,
                       receivers=tuple(rx.address for rx in rxs), fanout=fanout, group=group)


def _check_all_done(report: dict[str, Any], carried: str = "group") -> None:
    assert report["outcome"] == "done", report.get("failure")
    assert report["fanout"] == "multicast" and len(report["receivers"]) == 3
    for entry in report["receivers"]:
        assert entry["outcome"] == "done", entry
        assert entry["carried"] == carried, entry
        assert entry["recovered_utility"] == pytest.approx(1.0), entry
        assert entry["decoded_symbols"] == report["n_source"], entry


def test_multicast_to_a_real_group_on_loopback() -> None:
    """The kernel replicates: three receivers joined to a 239.x group on lo, one datagram each sent."""
    group = f"239.{random.randrange(1, 255)}.{random.randrange(1, 255)}.7:{_free_port()}"
    why = _loopback_multicast(group)
    if why is not None:
        pytest.skip(why)
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rxs = await _receivers(3, (group,))
        tx = SenderDaemon(identity, PSK, rate_mbps=30, owd_ms=1, result_wait_s=1, rate_control="fixed",
                          multicast_groups=[group], multicast_interface="127.0.0.1")
        h = tx.submit(_spec(rxs, "multicast", group))
        await asyncio.wait_for(h.done.wait(), 60)
        await tx.close()
        for rx in rxs:
            await rx.close()
        return h.view()

    report = run_event_loop(main())
    _check_all_done(report)
    group_section = report["group"]
    assert group_section["destination"] == group
    assert group_section["source_sent"] == report["n_source"]  # each source sent once, for all three
    assert len({e["session_id"] for e in report["receivers"]}) == 3  # a handshake (own keys) per member


def test_multicast_through_a_replicator_one_stream_plus_repairs() -> None:
    """Losses 2/8/15% per member behind one replicator: every member decodes everything; the uplink
    carries one stream plus repairs (well under the three streams of a unicast fan-out); a node that is
    not a member receives the same copies and opens none of them."""
    identity = synthetic_identity(SMALL)

    async def main() -> tuple[dict[str, Any], dict[str, Any], Replicator, dict[str, int], int,
                              dict[str, float | None]]:
        rxs = await _receivers(3)
        (outsider,) = await _receivers(1)
        loop = asyncio.get_running_loop()
        members = [rx.address for rx in rxs] + [outsider.address]
        transport, relay = await loop.create_datagram_endpoint(
            lambda: Replicator(members, [0.02, 0.08, 0.15, 0.0]), local_addr=("127.0.0.1", 0))
        host, port = transport.get_extra_info("sockname")[:2]
        group = f"{host}:{port}"
        tx = SenderDaemon(identity, PSK, rate_mbps=30, owd_ms=1, result_wait_s=1, rate_control="fixed",
                          multicast_groups=[group])
        h = tx.submit(_spec(rxs, "multicast", group, rho=8.0))  # a loaded CI machine still decodes all
        await asyncio.wait_for(h.done.wait(), 60)
        sent = {t: tx.metrics.registry.get_sample_value("pfec_sender_datagrams_sent_total", {"type": t})
                for t in ("source", "repair")}
        u = tx.submit(_spec(rxs, "unicast", rho=8.0))
        await asyncio.wait_for(u.done.wait(), 60)
        drops = dict(outsider.endpoint.drops)
        sessions = len(outsider.endpoint.sessions) + len(outsider.endpoint.groups)
        await tx.close()
        for rx in [*rxs, outsider]:
            await rx.close()
        transport.close()
        return h.view(), u.view(), relay, drops, sessions, sent

    report, unicast, relay, outsider_drops, outsider_sessions, sent = run_event_loop(main())
    _check_all_done(report)
    # The node's metrics count the group's datagrams as the pacer counts a session's (before: none).
    errors = report["group"]["socket_errors"]  # a datagram the socket refused is not counted as sent
    for kind in ("source", "repair"):
        made = report["group"][f"{kind}_sent"]
        assert made - errors <= (sent[kind] or 0) <= made, (kind, made, errors, sent)
    assert unicast["outcome"] == "done" and unicast["fanout"] == "unicast"
    stream = report["group"]["bytes"]
    one_stream = report["n_source"] * (report["symbol_size"] + 30)
    assert relay.received_bytes == stream  # the group's bytes crossed the uplink once
    assert stream < 1.35 * one_stream, (stream, one_stream)  # one stream + the worst member's repairs
    assert report["uplink_bytes"] < 0.5 * unicast["uplink_bytes"], (report["uplink_bytes"],
                                                                     unicast["uplink_bytes"])
    # The outsider got every group datagram and opened none: it has no ticket (no session for the id).
    assert outsider_sessions == 0 and outsider_drops.get("no_session", 0) >= report["n_source"] - 5


def test_a_member_that_cannot_keep_up_is_dropped_and_served_by_unicast() -> None:
    """One member loses 60% of the group's datagrams: the group drops it (a reason in the report) and
    its own unicast handoff, direct and lossless, gives it everything; the others stay in the group."""
    identity = synthetic_identity(SMALL)

    async def main() -> dict[str, Any]:
        rxs = await _receivers(3)
        loop = asyncio.get_running_loop()
        transport, _relay = await loop.create_datagram_endpoint(
            lambda: Replicator([rx.address for rx in rxs], [0.0, 0.02, 0.6]), local_addr=("127.0.0.1", 0))
        host, port = transport.get_extra_info("sockname")[:2]
        group = f"{host}:{port}"
        tx = SenderDaemon(identity, PSK, rate_mbps=30, owd_ms=1, result_wait_s=1, rate_control="fixed",
                          multicast_groups=[group])
        h = tx.submit(_spec(rxs, "multicast", group, rho=8.0))
        await asyncio.wait_for(h.done.wait(), 60)
        await tx.close()
        for rx in rxs:
            await rx.close()
        transport.close()
        return h.view()

    report = run_event_loop(main())
    assert report["outcome"] == "done", report.get("failure")
    entries = report["receivers"]
    assert [e["carried"] for e in entries] == ["group", "group", "unicast"], entries
    assert "loss" in entries[2]["dropped"], entries[2]
    for entry in entries:
        assert entry["outcome"] == "done" and entry["recovered_utility"] == pytest.approx(1.0), entry
    assert report["group"]["members"][2]["phase"] == "dropped"
    assert report["uplink_bytes"] >= report["group"]["bytes"] + entries[2]["unicast_bytes"]


def test_multicast_validation_names_the_field() -> None:
    """A group outside the configured ones is a 422 naming group; multicast with no group configured
    names fanout; group without multicast names it; nothing is started."""
    identity = synthetic_identity(SMALL)

    async def main(tmp: str) -> list[tuple[int, dict[str, Any], str]]:
        rxs = await _receivers(2)
        a, b = (f"{rx.address[0]}:{rx.address[1]}" for rx in rxs)
        configured = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1, multicast_groups=["239.9.9.9:7500"])
        bare = SenderDaemon(identity, PSK, rate_mbps=20, owd_ms=1)
        out = []
        for i, (tx, cases) in enumerate(((configured, [
                ({"receivers": [a, b], "synthetic_tokens": 64, "fanout": "multicast",
                  "group": "239.9.9.8:7500"}, "group"),
                ({"receivers": [a, b], "synthetic_tokens": 64, "fanout": "multicast", "group": "nohost:1"},
                 "group"),
                ({"receivers": [a, b], "synthetic_tokens": 64, "group": "239.9.9.9:7500"}, "group"),
                ({"receiver": a, "synthetic_tokens": 64, "group": "239.9.9.9:7500"}, "group")]),
                (bare, [({"receivers": [a, b], "synthetic_tokens": 64, "fanout": "multicast"}, "fanout")]))):
            server = ControlServer(sender_routes(tx))
            sock = Path(tmp) / f"s{i}.sock"
            await server.start(sock, None, None)
            client = ControlClient(sock)
            for body, field in cases:
                status, data = await client.request("POST", "/handoffs", body)
                out.append((status, data, field))
            status, listing = await client.request("GET", "/handoffs")
            out.append((status, listing, "listing"))
            await server.close()
            await tx.close()
        for rx in rxs:
            await rx.close()
        return out

    import tempfile  # deferred: only this test needs a short socket path

    with tempfile.TemporaryDirectory(prefix="pfec-") as tmp:
        results = run_event_loop(main(tmp))
    for status, data, field in results:
        if field == "listing":
            assert status == 200 and data["handoffs"] == []
        else:
            assert status == 422 and field in data["error"], (field, data)


def test_a_ticket_opens_its_own_stream_only_and_joins_are_bounded() -> None:
    """At the receiver's endpoint: a member of stream A takes A's datagrams; B's datagrams (another
    ticket) find no group there; B's datagram relabelled with A's id fails A's key; a join whose group id
    is a live session's, or a second join of one session, is refused."""
    n, symbol = 40, 32
    endpoint = ReceiverEndpoint(PSK, b"f" * 32)
    rng = random.Random(3)
    sid = 0x5151
    r_s, r_r = rng.randbytes(16), rng.randbytes(16)
    protector = PacketProtector(Keyring(PSK), sid, Role.RECEIVER, symbol, local_random=r_r, peer_random=r_s)
    offer = Offer(symbol, 64, n, 1_000_000, b"f" * 32, sender_random=r_s)
    session = endpoint.sessions[sid] = ReceiverSession(sid, protector, offer, 1, 0.0, ReceiverConfig())
    ticket_a = GroupTicket.fresh(0xA1, rng.randbytes)
    ticket_b = GroupTicket.fresh(0xB2, rng.randbytes)
    assert endpoint.join_group(sid, GroupTicket.fresh(sid, rng.randbytes)) is not None  # a session's id
    assert endpoint.join_group(sid, ticket_a) is None
    assert endpoint.join_group(sid, ticket_b) is not None  # one group per session
    symbols = np.random.default_rng(1).integers(0, 256, size=(n, symbol), dtype=np.uint8)
    sealer_a, sealer_b = group_sealer(ticket_a, symbol), group_sealer(ticket_b, symbol)
    assert endpoint.receive_datagram(sealer_a.seal_source(0, symbols[0].data), 0.001) is not None
    assert session.decoder.decoded_count == 1
    from_b = sealer_b.seal_source(1, symbols[1].data)
    assert endpoint.receive_datagram(from_b, 0.002) is None
    assert endpoint.drops.get("no_session") == 1  # B's stream: no group of that id here
    relabelled = bytearray(from_b)
    relabelled[2:10] = (0xA1).to_bytes(8, "big")  # header layout: version, type, session id (u64)
    assert peek_header(bytes(relabelled)).session_id == 0xA1
    assert endpoint.receive_datagram(bytes(relabelled), 0.003) is None
    assert endpoint.drops.get("group_junk_auth") == 1  # A's opener: not A's key
    assert session.decoder.decoded_count == 1  # nothing but A's own datagram reached the member
