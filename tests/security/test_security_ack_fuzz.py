"""Issue 12, feedback validation: any ACK content a key holder sends (crafted or not) is applied or dropped
and counted; no FecError or other exception escapes a SenderSession method, and its state stays sane."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfec.common.sched.actions import Action, SchedulerView
from pfec.common.wire.messages import Accept, Ack, DoneReason, Role
from pfec.common.wire.seal import Keyring, PacketProtector, seal_handshake
from pfec.lab.bench.fuzz import FuzzRig
from pfec.sender.transport.path import ack_plausible
from pfec.sender.transport.session import SenderConfig, SenderSession, SenderState

u16 = st.one_of(st.sampled_from([0, 1, 0xFFFF]), st.integers(0, 0xFFFF))
u32 = st.one_of(st.sampled_from([0, 1, 2, 0xFFFF_FFFF]), st.integers(0, 600), st.integers(0, 0xFFFF_FFFF))


@st.composite
def acks(draw: st.DrawFn) -> Ack:
    hole_bits = draw(st.one_of(st.sampled_from([0, 1, 8, 4096]), st.integers(0, 4096)))
    holes = draw(st.binary(min_size=(hole_bits + 7) // 8, max_size=(hole_bits + 7) // 8))
    return Ack(draw(u32), draw(u32), draw(u32), draw(u16), draw(u16), draw(u32), draw(u32), draw(u32),
               draw(u32), draw(u32), hole_bits, holes)


@pytest.fixture(scope="module")
def rig() -> FuzzRig:
    return FuzzRig(seed=11)


def assert_sane(sender: SenderSession) -> None:
    enc, view = sender.encoder, sender.view
    assert 0 <= enc.ack_prefix <= enc.next_esi <= enc.n_source
    assert 0.0 <= view.loss_estimate <= 1.0
    assert math.isfinite(view.rtt_estimate) and view.rtt_estimate >= 0
    assert math.isfinite(view.deficit_estimate)
    assert view.repairs_left >= 0
    assert "bad_feedback" not in sender.drops  # validation, not the safety net, handled it


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(ack=acks(), sends=st.integers(0, 24))
def test_any_ack_is_applied_or_dropped_and_never_raises(rig: FuzzRig, ack: Ack, sends: int) -> None:
    sender = rig.sender
    session = rig.endpoint.sessions.get(rig.sid)
    if session is None or sender.state not in (SenderState.STREAMING, SenderState.DRAINING):
        rig.feed(64)  # the rig starts the next handoff
        return
    before = dict(sender.drops)
    sender.receive_datagram(session.protector.seal(ack), rig.now)
    # the rule under test
    plausible = ack_plausible(ack, sender.encoder.next_esi, sender.protector.packets_sealed)
    if not plausible:
        assert sender.drops.get("bad_ack", 0) == before.get("bad_ack", 0) + 1
    else:
        assert sender.drops == before
    for _ in range(sends):  # what the ACK changed drives the next decisions
        if sender.next_datagram(rig.now) is None:
            break
    rig.now += 0.0005
    if (t := sender.get_timer()) is not None and t <= rig.now:
        sender.handle_timer(rig.now)
    while sender.next_event() is not None:
        pass
    assert_sane(sender)


class RepairOnce:
    """Source until 40 are out, then a repair burst of 16 whenever allowed."""

    name = "repair-once"
    sends_repairs = True

    def decide(self, view: SchedulerView) -> Action:
        if view.mask[Action.REPAIR_16]:
            return Action.REPAIR_16
        return Action.SOURCE

    def reset(self) -> None:
        pass


def test_an_ack_that_empties_the_window_mid_burst_does_not_escape() -> None:
    """The `empty_window` FecError of issue 12: a repair burst is decided, then an ACK acknowledges every
    source; the rest of the burst must not try to encode an empty window."""
    kr = Keyring(bytes(range(32)))
    symbols = np.random.default_rng(0).integers(0, 256, size=(40, 16), dtype=np.uint8)
    sender = SenderSession(
        9, SenderConfig(budget_s=1.0, slot_s=1e-4, owd_s=1e-3, repair_budget=64, fingerprint=b"f" * 32,
                        first_flight=1000),
        symbols, RepairOnce(),  # type: ignore[arg-type]
        PacketProtector(kr, 9, Role.SENDER, 16, random_bytes=random.Random(1).randbytes),
    )
    r_r = bytes(range(16))
    receiver = PacketProtector(kr, 9, Role.RECEIVER, 16, local_random=r_r,
                               peer_random=sender.protector.local_random, first_pn=2)
    sender.start(0.0)
    # The receiver's ACCEPT (handshake packet number 1; its session's datagrams start at 2).
    sender.receive_datagram(seal_handshake(kr, Role.RECEIVER, Accept(16, 40, r_r), 9, 1, bytes(12),
                                           sender.protector.local_random), 0.0)
    assert sender.accepted
    while sender.next_datagram(0.0) is not None and sender.encoder.next_esi < 40:
        pass
    # A hole map with holes at 0..7: deficit, a repair burst of 16 is decided and one repair is sent.
    sender.receive_datagram(receiver.seal(Ack(0, 40, 32, 8, 8, sender.protector.packets_sealed, 0, 32, 8, 1,
                                              8, b"\xff")), 0.001)
    assert sender.next_datagram(0.002) is not None
    assert sender.view.repairs_sent >= 1
    # Now everything is decoded: the burst's window [40, 40) is empty.
    all_decoded = Ack(40, 40, 40, 0, 0, sender.protector.packets_sealed, 0, 40, 0, 0)
    sender.receive_datagram(receiver.seal(all_decoded), 0.003)
    for _ in range(20):
        sender.next_datagram(0.004)  # must not raise FecError('empty_window')
    assert "bad_feedback" not in sender.drops
    # Everything decoded: the sender says so (DONE) and stops sending data.
    assert sender.completion.reason is DoneReason.DECODED and sender.state is SenderState.DRAINING
