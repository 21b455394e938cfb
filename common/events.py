"""Types shared by the sender and receiver sessions (sans-IO: no clock is read here).

``CpuMeter`` is how an adapter (the simulator, a daemon, a benchmark) measures the CPU time the sessions
spend in the codec, feedback and policy: it injects a clock function and reads the sums back. Sessions
never import ``time`` themselves.

``TableEnum`` is the base of the enums that key the sessions' transition tables.

``Event`` is the base of every event a session emits; each side defines its own (``SenderEvent``,
``ReceiverEvent``) and adapters tell them apart with ``isinstance``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class TableEnum(Enum):
    """An enum whose members key the sessions' transition tables, looked up per datagram. Members are
    singletons compared by identity, so they hash by identity too: ``Enum.__hash__`` is Python code, a
    call per dict or set lookup."""

    __hash__ = object.__hash__


@dataclass(slots=True)
class CpuMeter:
    clock: Callable[[], int]  # nanoseconds, e.g. time.perf_counter_ns
    encode_ns: int = 0  # repair symbol generation (sender)
    decode_ns: int = 0  # decoder inserts (receiver)
    feedback_ns: int = 0  # building ACKs (receiver) and processing them (sender)
    policy_ns: int = 0  # view refresh + masks + policy decision (sender)
    decisions: int = 0
    acks: int = 0
    decision_ns: list[int] = field(default_factory=list)

    def total_ns(self) -> int:
        return self.encode_ns + self.decode_ns + self.feedback_ns + self.policy_ns


class Event:
    """Base of the events sessions emit (frozen dataclasses, each side's own)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class DatagramDropped(Event):
    """A datagram was dropped and counted; ``reason`` comes from a bounded set."""

    reason: str


def earliest(*times: float | None) -> float | None:
    """The earliest of the timers that are set; None when none is."""
    first: float | None = None
    for t in times:
        if t is not None and (first is None or t < first):
            first = t
    return first
