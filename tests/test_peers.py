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
