"""Issue 37 item 3, sans-IO: one coded stream to several receivers (sender/transport/fanout, receiver/fanout).

Several real ReceiverSessions (each with its own unicast keys, as its own handshake would leave them) are
fed the SAME group-sealed datagrams with different losses; their ACKs go back sealed under their own keys
and are opened there before the GroupSession sees them.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pfec.common.wire.group import GroupKeyring, GroupTicket, group_opener, group_sealer, open_group
from pfec.common.wire.messages import Ack, Done, DoneReason, Offer, ParseError, Role
from pfec.common.wire.seal import Keyring, PacketProtector
from pfec.receiver.fanout.member import GroupMembership
from pfec.receiver.session import DeadlineReached, ReceiverConfig, ReceiverSession
from pfec.sender.transport.fanout.group import (
    GroupConfig,
    GroupDone,
    GroupSession,
    MemberComplete,
    MemberDropped,
)
from pfec.sender.transport.fanout.states import GROUP, MEMBER, GroupPhase, MemberPhase, Move

PSK = bytes(range(32))
FP = b"f" * 32
SYMBOL = 32
N = 200


def symbols(n: int = N) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, size=(n, SYMBOL), dtype=np.uint8)


class Receiver:
    """One member: its unicast session (own keys), its group membership, and the sender's side of its keys."""

    def __init__(self, index: int, ticket: GroupTicket, n: int, budget_s: float, now: float) -> None:
        rng = random.Random(100 + index)
        sid = 0x1000 + index
        r_s, r_r = rng.randbytes(16), rng.randbytes(16)
        keyring = Keyring(PSK)
        rx_prot = PacketProtector(keyring, sid, Role.RECEIVER, SYMBOL, local_random=r_r, peer_random=r_s)
        self.sender_side = PacketProtector(keyring, sid, Role.SENDER, SYMBOL, local_random=r_s,
                                           peer_random=r_r)
        offer = Offer(SYMBOL, 64, n, int(budget_s * 1e6), FP, sender_random=r_s)
        config = ReceiverConfig(ack_every=4, decoder_span=256)
        self.session = ReceiverSession(sid, rx_prot, offer, 1, now, config)
        self.member = GroupMembership(ticket, self.session)
        self.decoded: DeadlineReached | None = None

    def acks(self) -> list[Ack]:
        out = []
        for d in self.session.datagrams_to_send():
            _h, msg = self.sender_side.open(d)
            if isinstance(msg, Ack):
                out.append(msg)
        while (ev := self.session.next_event()) is not None:
            if isinstance(ev, DeadlineReached):
                self.decoded = ev
        return out


def run_group(losses: list[set[int] | float], *, n: int = N, budget_s: float = 1.0, repair_budget: int = 100,
              config: GroupConfig | None = None, max_member_loss: float = 0.3, steps: int = 40000,
              joins: dict[int, int] | None = None) -> tuple[GroupSession, list[Receiver], list[object]]:
    """Run a group over a fake link: ``losses[i]`` is member i's dropped data indexes (a set) or a rate;
    ``joins[i]``: member i's endpoint knows the group only from that datagram on (its handshake was late),
    so what went before never reaches its session."""
    ticket = GroupTicket.fresh(0xF00D, random.Random(1).randbytes)
    cfg = config or GroupConfig(budget_s=budget_s, owd_s=0.001, repair_budget=repair_budget,
                                max_member_loss=max_member_loss)
    group = GroupSession(group_sealer(ticket, SYMBOL), symbols(n), cfg, [f"r{i}" for i in range(len(losses))])
    now = 0.0
    rxs = [Receiver(i, ticket, n, budget_s, now) for i in range(len(losses))]
    rngs = [random.Random(50 + i) for i in range(len(losses))]
    group.start(now)
    events: list[object] = []
    back: list[tuple[float, int, Ack]] = []
    sent = 0
    for _ in range(steps):
        d = group.next_datagram(now)
        if d is not None:
            for i, rx in enumerate(rxs):
                loss = losses[i]
                lost = (sent in loss) if isinstance(loss, set) else rngs[i].random() < loss
                if not lost and sent >= (joins or {}).get(i, 0):
                    rx.member.receive(d, now)
            sent += 1
        for i, rx in enumerate(rxs):
            for ack in rx.acks():
                back.append((now + 0.002, i, ack))
        while back and back[0][0] <= now:
            _t, i, ack = back.pop(0)
            group.on_ack(i, ack, now)
        while (ev := group.next_event()) is not None:
            events.append(ev)
        if all(rx.decoded is not None for rx in rxs) and not group.phase.sends and not back:
            break
        now += 0.0001
        if (t := group.get_timer()) is not None and t <= now:
            group.handle_timer(now)
        for rx in rxs:
            if (t := rx.session.get_timer()) is not None and t <= now:
                rx.session.handle_timer(now)
    return group, rxs, events


def test_tables_cover_every_entry() -> None:
    for phase, rows in GROUP.items():
        assert set(rows) == set(rows.keys()) and len(rows) == 3, phase
    for mphase, mrows in MEMBER.items():
        assert len(mrows) == 4, mphase
        for row in mrows.values():
            if isinstance(row, Move):
                assert hasattr(GroupSession, row.action)
    assert not any(isinstance(r, Move) for r in MEMBER[MemberPhase.DROPPED].values())
    assert GroupPhase.STREAMING.sends and not GroupPhase.DRAINING.sends


def test_three_members_different_losses_all_decode_with_max_not_sum_repairs() -> None:
    """The same datagrams, three loss patterns: every member decodes everything; the repairs are about
    the worst member's losses, well under the sum of all members' losses."""
    group, rxs, events = run_group([0.02, 0.08, 0.15])
    for rx in rxs:
        assert rx.decoded is not None and rx.session.decoder.decoded_count == N
        assert np.array_equal(rx.session.decoder.store[:N], symbols())
    lost = [rx.session.stats.lost for rx in rxs]
    assert group.datagrams_sent["source"] == N
    assert group.repairs_sent < 0.75 * sum(lost), (group.repairs_sent, lost)
    assert any(isinstance(e, GroupDone) and e.reason == "decoded" for e in events)
    assert sum(isinstance(e, MemberComplete) for e in events) == 3
    assert group.datagrams_sent["control"] == 1  # one DONE, sealed once for the group


def test_one_repair_fills_a_different_hole_at_each_member() -> None:
    """Member 0 misses source 10, member 1 source 11 (both ACKs report them together): one repair, dense
    over the union window, fills both holes."""
    group, rxs, _ = run_group([{10}, {11}], n=40)
    assert all(rx.decoded is not None and rx.session.decoder.decoded_count == 40 for rx in rxs)
    assert group.repairs_sent == 1
    assert all(rx.session.stats.received["repair"] == 1 for rx in rxs)


def _holes(offsets: list[int], bits: int) -> bytes:
    """A hole map (MSB first) with the given offsets from the prefix set."""
    packed = bytearray((bits + 7) // 8)
    for o in offsets:
        packed[o >> 3] |= 0x80 >> (o & 7)
    return bytes(packed)


def test_need_is_the_largest_deficit_not_the_sum() -> None:
    """The repair rule: member deficits 3 and 5 ask for 5 repairs, not 8; each repair, over the neediest
    member's holes widened over the other's, counts for both; repairs sent since an ACK count."""
    ticket = GroupTicket.fresh(1, random.Random(2).randbytes)
    group = GroupSession(group_sealer(ticket, SYMBOL), symbols(50), GroupConfig(1.0, 0.001, 50), ["a", "b"])
    group.start(0.0)
    for _ in range(30):
        assert group.next_datagram(0.0) is not None
    for member, offsets in ((0, [0, 5, 11]), (1, [1, 3, 7, 12, 18])):  # ESIs 10 15 21; 11 13 17 22 28
        deficit = len(offsets)
        ack = Ack(decoded_prefix=10, seen_end=30, decoded_count=30 - deficit, deficit=deficit,
                  unknowns=deficit, largest_pn=30, ack_delay_us=0, received=30 - deficit, lost=deficit,
                  loss_runs=deficit, hole_bits=20, holes=_holes(offsets, 20))
        assert group.on_ack(member, ack, 0.001)
    assert group.need_of(group.members[0]) == pytest.approx(3.0)
    assert group.group_need() == pytest.approx(5.0)
    assert group.repair_window() == (10, 19)  # b's holes [11, 29) widened over a's [10, 22)
    sent = 0
    while group.group_need() >= 0.5:
        d = group.next_datagram(0.002)
        assert d is not None
        sent += 1
    assert sent == group.repairs_sent == 5  # the largest deficit, never the sum (8)
    assert group.need_of(group.members[0]) <= 0.0  # every repair reached a's holes too


def test_a_repair_counts_only_for_members_whose_holes_it_reaches() -> None:
    """Member a lacks ESIs 10-12, member b ESIs 100-102, too far apart for one window of 16: the repairs
    over a's holes leave b's need whole, and b's holes get repairs of their own (6 in all)."""
    ticket = GroupTicket.fresh(4, random.Random(8).randbytes)
    config = GroupConfig(1.0, 0.001, 50, window_cap=16, span=128)
    group = GroupSession(group_sealer(ticket, SYMBOL), symbols(120), config, ["a", "b"])
    group.start(0.0)
    for _ in range(110):
        assert group.next_datagram(0.0) is not None
    for member, prefix in ((0, 10), (1, 100)):
        ack = Ack(decoded_prefix=prefix, seen_end=110, decoded_count=107, deficit=3, unknowns=3,
                  largest_pn=110, ack_delay_us=0, received=107, lost=3, loss_runs=1, hole_bits=110 - prefix,
                  holes=_holes([0, 1, 2], 110 - prefix))
        assert group.on_ack(member, ack, 0.001)
    a, b = group.members
    windows = []
    while group.group_need() >= 0.5:
        windows.append(group.repair_window())
        before = group.need_of(a) + group.need_of(b)
        assert group.next_datagram(0.002) is not None
        assert group.need_of(a) + group.need_of(b) == pytest.approx(before - 1.0)  # it served one of them
    assert group.repairs_sent == 6
    assert sorted(set(windows)) == [(10, 3), (100, 3)]


def test_slow_member_is_dropped_and_the_others_finish() -> None:
    """A member losing 60% cannot keep up: dropped with a reason; it no longer steers the repairs."""
    group, rxs, events = run_group([0.0, 0.05, 0.6], budget_s=0.5)
    dropped = [e for e in events if isinstance(e, MemberDropped)]
    assert [e.member for e in dropped] == [2] and "loss" in dropped[0].reason
    assert group.members[2].phase is MemberPhase.DROPPED
    for rx in rxs[:2]:
        assert rx.decoded is not None or rx.session.decoder.decoded_count == N
        assert rx.session.decoder.decoded_count == N
    assert group.repairs_sent < 0.5 * rxs[2].session.stats.lost


def test_a_lost_last_source_is_probed_not_taken_for_silence() -> None:
    """Member 1 loses only the last source: its ACKs report no hole (it never saw that symbol) and then it
    has nothing to ACK. Once it is overdue the group sends one repair over the tail, which provokes an ACK
    and fills the hole, instead of dropping the member as silent (seen: the multicast daemon test)."""
    group, rxs, events = run_group([set(), {39}], n=40, budget_s=2.0,
                                   config=GroupConfig(2.0, 0.001, 50, ack_timeout_s=0.3))
    assert not [e for e in events if isinstance(e, MemberDropped)], events
    assert all(rx.session.decoder.decoded_count == 40 for rx in rxs)
    assert group.repairs_sent == 1 and rxs[1].session.stats.received["repair"] == 1
    assert sum(isinstance(e, MemberComplete) for e in events) == 2


def test_a_member_that_joined_late_counts_no_loss_for_what_went_before() -> None:
    """Member 1's endpoint joins the stream after 150 of its datagrams (its handshake finished late): those
    never reached its session and are not the channel's loss. It reports no loss, stays in the group and
    decodes everything from the repairs. (Counted from its OFFER's packet number, it reported 97% loss and
    was dropped: seen in `pfec bench fanout`, three receivers' handshakes on one core.)"""
    group, rxs, events = run_group([0.0, 0.0], n=400, budget_s=2.0, repair_budget=300, joins={1: 150})
    assert not [e for e in events if isinstance(e, MemberDropped)], events
    stats = rxs[1].session.stats
    assert stats.lost == 0 and stats.loss_runs == 0, stats
    assert group.members[1].loss == 0.0
    assert all(rx.session.decoder.decoded_count == 400 for rx in rxs)
    assert group.repairs_sent >= 150


def test_a_reordered_datagram_keeps_loss_runs_within_the_losses() -> None:
    """Packet 3 arrives after 4: the gap counted as a loss run is filled, and the ACK stays plausible (loss
    runs never above the losses; before, the sender refused every ACK until the next loss)."""
    ticket = GroupTicket.fresh(0xF00D, random.Random(1).randbytes)
    rx = Receiver(0, ticket, 10, 1.0, 0.0)
    sealer = group_sealer(ticket, SYMBOL)
    group = GroupSession(sealer, symbols(10), GroupConfig(1.0, 0.001, 10), ["r0"])
    group.start(0.0)
    datagrams = [group.next_datagram(0.0) for _ in range(4)]
    for i in (0, 1, 3, 2):
        d = datagrams[i]
        assert d is not None
        rx.member.receive(d, 0.001)
    stats = rx.session.stats
    assert (stats.lost, stats.loss_runs) == (0, 0), stats
    rx.session.handle_timer(0.5)  # the ACK timer or deadline: whatever it sends must be plausible
    for ack in rx.acks():
        assert group.on_ack(0, ack, 0.01), ack


def test_silent_member_is_dropped() -> None:
    _group, _rxs, events = run_group([0.0, 1.0], budget_s=2.0,
                                    config=GroupConfig(2.0, 0.001, 50, ack_timeout_s=0.05))
    assert any(isinstance(e, MemberDropped) and e.member == 1 and "no ACK" in e.reason for e in events)


def test_forged_or_implausible_ack_is_dropped() -> None:
    ticket = GroupTicket.fresh(3, random.Random(3).randbytes)
    group = GroupSession(group_sealer(ticket, SYMBOL), symbols(20), GroupConfig(1.0, 0.001, 10), ["a"])
    group.start(0.0)
    group.next_datagram(0.0)
    bad = Ack(decoded_prefix=19, seen_end=19, decoded_count=19, deficit=0, unknowns=0, largest_pn=1,
              ack_delay_us=0, received=1, lost=0, loss_runs=0)
    assert not group.on_ack(0, bad, 0.0) and group.drops["bad_ack"] == 1
    assert group.members[0].phase is MemberPhase.JOINED


# ---------------------------------------------------------------- security: group key isolation
def test_a_datagram_of_one_stream_never_opens_under_another_streams_key() -> None:
    rng = random.Random(9)
    a, b = GroupTicket.fresh(0xA, rng.randbytes), GroupTicket.fresh(0xB, rng.randbytes)
    same_sid = GroupTicket.fresh(0xA, rng.randbytes)  # another stream that drew the same session id
    datagram = group_sealer(a, SYMBOL).seal_source(0, bytes(SYMBOL))
    with pytest.raises(ParseError) as wrong:
        open_group(group_opener(b, SYMBOL), datagram)
    assert wrong.value.reason == "wrong_session"
    with pytest.raises(ParseError) as auth:
        open_group(group_opener(same_sid, SYMBOL), datagram)
    assert auth.value.reason == "auth"
    assert open_group(group_opener(a, SYMBOL), datagram)[1].esi == 0  # type: ignore[union-attr]


def test_member_counts_cross_stream_datagrams_and_its_session_sees_none() -> None:
    rng = random.Random(4)
    mine, other = GroupTicket.fresh(0xC, rng.randbytes), GroupTicket.fresh(0xC, rng.randbytes)
    rx = Receiver(0, mine, 20, 1.0, 0.0)
    other_sealer = group_sealer(other, SYMBOL)
    for esi in range(5):
        assert not rx.member.receive(other_sealer.seal_source(esi, bytes(SYMBOL)), 0.0)
    assert rx.member.drops == {"junk_auth": 5}
    assert rx.session.stats.received["source"] == 0 and rx.session.decoder.decoded_count == 0
    # A group member holding K_g can forge data of THAT stream only; what it seals as the receiver role
    # (an ACK under the group key) is never opened as one.
    member_forger = PacketProtector(GroupKeyring(mine.key), mine.session_id, Role.RECEIVER, SYMBOL,
                                    local_random=mine.group_random, peer_random=mine.sender_random)
    forged_ack = member_forger.seal(Ack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    assert not rx.member.receive(forged_ack, 0.0)
    mine_sealer = group_sealer(mine, SYMBOL)
    assert rx.member.receive(mine_sealer.seal_source(0, bytes(SYMBOL)), 0.0)
    assert rx.member.receive(mine_sealer.seal(Done(1, 0, 2, DoneReason.DECODED)), 0.0)
    assert rx.member.opened == 2


def test_the_group_key_does_not_open_unicast_sessions() -> None:
    """A member's unicast session datagram never opens under the group key, nor the other way round."""
    rng = random.Random(5)
    ticket = GroupTicket.fresh(0x1000, rng.randbytes)
    rx = Receiver(0, ticket, 20, 1.0, 0.0)  # its unicast sid is 0x1000 too: only the keys tell them apart
    unicast = rx.sender_side.seal_source(0, bytes(SYMBOL))
    assert not rx.member.receive(unicast, 0.0)
    assert rx.member.drops == {"junk_auth": 1}
    with pytest.raises(ParseError):
        rx.session.protector.open(group_sealer(ticket, SYMBOL).seal_source(0, bytes(SYMBOL)))


def test_ticket_is_bounded_and_never_printed() -> None:
    t = GroupTicket.fresh(7, random.Random(6).randbytes)
    assert GroupTicket.parse(t.pack()) == t
    assert t.key.hex() not in repr(t)
    for bad in (b"", t.pack()[:-1], t.pack() + b"x", b"\x02" + t.pack()[1:]):
        with pytest.raises(ParseError):
            GroupTicket.parse(bad)
