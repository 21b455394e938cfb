"""The sender's memory of what past handoffs to a receiver measured (sender/peers.py)."""

from __future__ import annotations

import pytest

from pfec.common.plan.breakeven import ReceiverModel
from pfec.common.plan.prefill import PrefillCurve
from pfec.sender.peers import PeerMemory, PeerNumbers


def test_peer_memory_keeps_the_newest_measurements_per_address_and_forgets_the_oldest() -> None:
    memory = PeerMemory(capacity=2)
    assert memory.get("a:1") == PeerNumbers()  # nothing measured: the planner's priors
    fast = ReceiverModel(PrefillCurve(0.1, 1e-4, 0.0), 0.01)
    memory.record("a:1", fast, 0.030)
    assert memory.get("a:1") == PeerNumbers(fast, 0.030)
    memory.record("a:1", None, 0.0)  # no statement, no RTT sample: the older numbers stay
    assert memory.get("a:1") == PeerNumbers(fast, 0.030)
    memory.record("b:1", None, 0.050)
    memory.get("a:1")  # used: b is now the least recently used
    memory.record("c:1", None, 0.070)
    assert memory.get("b:1") == PeerNumbers() and memory.get("a:1").receiver is fast
    with pytest.raises(ValueError, match="capacity"):
        PeerMemory(capacity=0)


def test_a_split_front_slower_than_stated_slows_the_next_splits_front_but_not_local_prefill() -> None:
    """A receiver states its unloaded speed; a split's front over a path ran twice as slow beside its
    stream (the RESULT's ``front_s``). The next plan over that path predicts the front twice as long and
    local prefill as stated; a second split's slowdown is averaged in; too short a front, or an
    implausible ratio, teaches nothing."""
    from pfec.common.plan.breakeven import DEFAULT_GEOMETRY, LinkModel, level_named, local_option, split_at
    from pfec.sender.peers import front_slowdown

    stated = ReceiverModel(PrefillCurve(0.03, 2.5e-3, 8e-7), 0.08)
    memory = PeerMemory()
    memory.record("rx:1", stated, 0.02)
    assert memory.get("rx:1").planner_receiver() is stated  # no split yet: the statement as it is
    slowdown = front_slowdown(stated, 1024, 2 * stated.unloaded_front_s(1024))
    assert slowdown == pytest.approx(2.0)
    memory.record("rx:1", None, 0.02, slowdown)
    planned = memory.get("rx:1").planner_receiver()
    assert planned is not None and planned.front_scale == pytest.approx(2.0)
    link = LinkModel(20e6, 0.02)
    int8 = level_named("int8")
    assert planned.front_s(1024) == pytest.approx(2 * stated.front_s(1024))
    assert (split_at(1024, 2048, DEFAULT_GEOMETRY, int8, link, planned).parts["front_s"]
            > 1.9 * split_at(1024, 2048, DEFAULT_GEOMETRY, int8, link, stated).parts["front_s"])
    assert local_option(2048, link, planned).ttft_s == local_option(2048, link, stated).ttft_s
    memory.record("rx:1", None, 0.02, 3.0)  # the next split: averaged with the last
    assert memory.get("rx:1").front_slowdown == pytest.approx(2.5)
    memory.record_query("rx:1", stated, 0.02)  # a speed query keeps what splits measured
    assert memory.get("rx:1").front_slowdown == pytest.approx(2.5)
    assert memory.get("other:1").front_slowdown is None  # another path learns nothing from this one
    assert front_slowdown(stated, 64, 1.0) is None  # one call: too short to time
    assert front_slowdown(stated, 1024, 1e4) is None and front_slowdown(stated, 1024, None) is None
    with pytest.raises(ValueError, match="front_scale"):
        ReceiverModel(PrefillCurve(0.03, 2.5e-3, 8e-7), 0.08, front_scale=0.0)


def test_a_split_plans_its_back_on_the_rate_the_newest_split_over_the_path_left() -> None:
    """Where the receiver's CPU bounds the stream, a split's back (the front computing beside it) delivers
    less than a whole-cache handoff: each kind's forecast is kept apart, and the planner's split divides
    by its own; a local prefill streams nothing and teaches no rate."""
    from pfec.common.plan.breakeven import DEFAULT_GEOMETRY, LinkModel, handoff_option, level_named, split_at

    memory = PeerMemory()
    memory.record_rate("rx:1", "handoff", 250e6)
    memory.record_rate("rx:1", "split", 100e6)
    memory.record_rate("rx:1", "local", 1e6)
    peer = memory.get("rx:1")
    assert (peer.handoff_rate_bps, peer.split_rate_bps) == (250e6, 100e6)
    memory.record("rx:1", None, 0.02, 2.0)  # a handoff's other numbers keep the rates
    assert memory.get("rx:1").split_rate_bps == 100e6
    receiver = ReceiverModel(PrefillCurve(0.03, 2.5e-3, 8e-7), 0.08)
    int8 = level_named("int8")
    whole, split = LinkModel(250e6, 0.02), LinkModel(250e6, 0.02, split_rate_bps=100e6)
    slow_back = split_at(512, 2048, DEFAULT_GEOMETRY, int8, split, receiver).parts["back_s"]
    assert slow_back > 2 * split_at(512, 2048, DEFAULT_GEOMETRY, int8, whole, receiver).parts["back_s"]
    assert (handoff_option(2048, DEFAULT_GEOMETRY, int8, split, receiver, True).ttft_s
            == handoff_option(2048, DEFAULT_GEOMETRY, int8, whole, receiver, True).ttft_s)
    with pytest.raises(ValueError, match="link rate"):
        LinkModel(1e6, 0.02, split_rate_bps=0.0)
