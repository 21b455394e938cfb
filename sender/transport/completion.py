"""The completion signal (sans-IO): when the sender will send nothing more the receiver could use, it
says so with a DONE, and the receiver starts generating then rather than at its deadline.

The sender is done once every source is sent and the ACKs say all is decoded, or no repair may follow:
its repair cap is spent, or its scheme sends no closed-loop repairs (a source-only stream, an open-loop
code whose repairs ride with the sources). The DONE carries what was sent (sources, repairs, the last
data packet number) so the receiver can check it against what arrived; it is sealed under the session
keys (never early: the sender is done only after the ACCEPT) with a fresh packet number each time, and
repeated ``DONE_REPEATS`` times a round trip apart unless the RESULT comes first. A lost DONE costs the
receiver nothing but time: its deadline stays the last resort.

A split's sender is done too once all the receiver lacks holds only blocks it computed
(:mod:`.split`'s ``needs_nothing``). The RESULT that ends the handoff may come in parts (``ResultParts``).
"""

from __future__ import annotations

from pfec.common.sched.actions import SchedulerView
from pfec.common.wire.messages import Done, DoneReason, Result
from pfec.common.wire.seal import PacketProtector

DONE_REPEATS = 3  # DONE datagrams per handoff at most (one may be lost; the deadline is the last resort)
DONE_RETRY_MIN_S = 0.002  # between DONE repeats: a round trip, at least this


def done_reason(view: SchedulerView, ack_prefix: int, sends_repairs: bool) -> DoneReason | None:
    """Why the sender will send nothing more the receiver could use, or None while it may."""
    if view.sources_left > 0:
        return None
    if ack_prefix >= view.n_source:
        return DoneReason.DECODED
    if view.open_loop or not sends_repairs:
        return DoneReason.NO_REPAIR
    if view.repairs_left <= 0:
        return DoneReason.BUDGET_SPENT
    return None


class Completion:
    """One session's DONE: why, how many went, when the next repeat is due."""

    __slots__ = ("last_data_pn", "reason", "sent", "timer")

    def __init__(self) -> None:
        self.reason: DoneReason | None = None  # why the sender is done (None: it is not)
        self.sent = 0
        self.timer: float | None = None  # when the next repeat is due
        self.last_data_pn = 0  # packet number of the newest SOURCE/REPAIR sealed

    def datagram(self, protector: PacketProtector, sources_sent: int, repairs_sent: int, now: float,
                 rtt: float) -> bytes | None:
        """A DONE sealed now (None if the packet-number space is spent), its repeat armed unless enough
        went."""
        assert self.reason is not None
        self.timer = None
        try:
            datagram = protector.seal(Done(sources_sent, repairs_sent, self.last_data_pn, self.reason))
        except ValueError:
            return None
        self.sent += 1
        if self.sent < DONE_REPEATS:
            self.timer = now + max(rtt, DONE_RETRY_MIN_S)
        return datagram


class ResultParts:
    """The receiver's RESULT as its parts arrive, in any order, repeats allowed: the whole blob once every
    part is in. ``add`` raises ValueError for a part that does not fit the first one's count (or
    ``max_parts``)."""

    __slots__ = ("count", "max_parts", "parts")

    def __init__(self, max_parts: int) -> None:
        self.max_parts = max_parts
        self.count = 0  # the part count the first part stated (0: none yet)
        self.parts: dict[int, bytes] = {}

    def add(self, result: Result) -> bytes | None:
        """The whole RESULT once ``result`` completes it, else None."""
        count = self.count or result.part_count
        if result.part_index >= result.part_count or result.part_count != count or count > self.max_parts:
            raise ValueError(f"RESULT part {result.part_index} of {result.part_count} (expected {count})")
        self.count = count
        self.parts[result.part_index] = bytes(result.app)
        if len(self.parts) < count:
            return None
        return b"".join(self.parts[i] for i in range(count))
