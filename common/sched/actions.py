"""Scheduler actions, the view a policy decides on, and the hard masks (paper IV-C2).

Sans-IO: no clocks, sockets or torch. The sender session owns one ``SchedulerView`` and updates it in
place before each decision, so a decision allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Action(IntEnum):
    """A source burst of up to SOURCE_BURST packets, or a repair burst of 1, 4 or 16 packets."""

    SOURCE = 0
    REPAIR_1 = 1
    REPAIR_4 = 2
    REPAIR_16 = 3


SOURCE_BURST = 8
REPAIR_SIZES: tuple[int, ...] = (0, 1, 4, 16)  # indexed by Action
N_ACTIONS = 4


@dataclass(slots=True)
class SchedulerView:
    """Causal transport state at a decision epoch: only what the sender knows from its own sends and ACKs."""

    now: float = 0.0
    # Stream and budgets.
    n_source: int = 0
    sources_sent: int = 0  # next ESI to send
    slots_total: int = 0  # T_max: transmission opportunities before the deadline at session start
    slots_left: int = 0  # T_rem
    repair_budget: int = 0  # B_rep
    repairs_left: int = 0  # B_rem
    repairs_sent: int = 0
    # Feedback (from the newest ACK) and estimates derived from it.
    acked_prefix: int = 0  # receiver's cumulative decoded prefix
    window_size: int = 0  # symbols a repair would combine now
    window_at_feedback: int = 0  # unresolved symbols the receiver reported (its unknowns)
    deficit_reported: int = 0  # receiver's window deficit in the newest ACK
    deficit_estimate: float = 0.0  # reported deficit, corrected for what is in flight
    loss_estimate: float = 0.0  # lost / (received + lost) from the ACK counters
    burst_estimate: float = 1.0  # mean loss-run length from the ACK counters
    rtt_estimate: float = 0.0  # seconds; 0 until the first ACK
    ack_staleness: float = 0.0  # seconds since the prefix last advanced
    feedback_seen: bool = False
    sources_in_flight: int = 0
    repairs_in_flight: int = 0
    repair_effectiveness: float = 0.0  # P(a repair now has a nonzero coefficient on a reported hole)
    # Open-loop repair (a fixed-rate code, the policy's ``open_loop``): a repair needs no reported deficit,
    # only a source still to protect; the session aims each one at the newest window (see FixedRate).
    open_loop: bool = False
    # Application (KV utility) features; neutral when the stream carries no utility.
    block_progress: float = 0.0  # share of the current block's fragments already sent
    block_utility: float = 0.0  # current block's utility / the largest block utility
    upcoming_utility: float = 0.0  # mean normalised utility of the next few blocks
    # Hard masks, indexed by Action.
    mask: list[bool] = field(default_factory=lambda: [False] * N_ACTIONS)

    @property
    def sources_left(self) -> int:
        return self.n_source - self.sources_sent

    def update_mask(self) -> bool:
        """Recompute the masks; return whether any action is allowed.

        Runs before every decision, hence written out per action (literal indices: Action and
        REPAIR_SIZES order)."""
        slots = self.slots_left
        left = self.repairs_left
        mask = self.mask
        sources_left = self.n_source > self.sources_sent
        source_ok = sources_left and slots > 0
        if self.open_loop:  # a fixed-rate code: repairs ride along with the sources, not the feedback
            repair_ok = self.window_size > 0 and sources_left
        else:
            repair_ok = self.window_size > 0 and self.deficit_estimate >= 0.5
        mask[0] = source_ok
        mask[1] = repair_ok and left >= 1 and slots >= 1
        mask[2] = repair_ok and left >= 4 and slots >= 4
        mask[3] = repair_ok and left >= 16 and slots >= 16
        return source_ok or mask[1]
