"""Clairvoyant bound for one loss realization (sans-IO, pure arithmetic).

The oracle knows the forward loss realization (and, on a trace-driven link, the trace's delivery
opportunities) in advance. It sends SOURCE datagrams back to back from
the moment the OFFER has been serialised (as every scheme does), leaves every slot that will be erased
idle, and fills the slots that will arrive with sources in utility order; it never sends a repair. It
therefore delivers the longest utility-ordered prefix that the realization's arriving slots can carry:
with equal fragments per block (the simulator's default, ``fit_symbols``) no scheme, coded or not, can
complete more utility in the same slots, since each arriving datagram adds at most one degree of
freedom and a repair datagram is no shorter than a source one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pfec.lab.sim.rate_trace import RateTrace


@dataclass(frozen=True)
class DataTiming:
    """Forward-link timing shared by the bounds (seconds, from the sender's start)."""

    first_send_s: float  # data may start once the first OFFER is serialised
    datagram_s: float  # serialisation time of one SOURCE datagram
    owd_s: float
    deadline_s: float  # the receiver's deadline D

    @property
    def send_deadline_s(self) -> float:
        """A datagram must be serialised by then to arrive by the deadline."""
        return self.deadline_s - self.owd_s

    def data_slots(self) -> int:
        """SOURCE datagrams that can be serialised between the OFFER and the send deadline."""
        room = (self.send_deadline_s - self.first_send_s) / self.datagram_s
        return max(0, math.floor(room + 1e-9))


def trace_data_slots(trace: RateTrace, timing: DataTiming, datagram_bytes: int) -> int:
    """SOURCE datagrams a trace-driven link carries between the OFFER and the send deadline: the bytes of
    its delivery opportunities in that window, in whole datagrams (the oracle sends at exactly the
    trace's rate, so it never queues and nothing is dropped at the bottleneck)."""
    first = trace.first_at_or_after(timing.first_send_s)
    end = trace.first_at_or_after(timing.send_deadline_s + 1e-9)  # opportunities at the deadline count
    return max(0, math.floor((end - first) * trace.bytes_per_opportunity / datagram_bytes))


def oracle_delivered(lost: npt.NDArray[np.bool_], timing: DataTiming, n_source: int,
                     slots: int | None = None) -> int:
    """Sources the oracle delivers: the arriving slots among the data slots (``slots``: a trace-driven
    link's, ``trace_data_slots``; None: the fixed rate's), at most ``n_source``.

    Data slot ``k`` meets ``lost[k % len(lost)]``, as in the simulator's link.
    """
    slots = timing.data_slots() if slots is None else slots
    if slots == 0 or n_source == 0:
        return 0
    erased = lost[np.arange(slots) % len(lost)]
    return min(n_source, slots - int(np.count_nonzero(erased)))
