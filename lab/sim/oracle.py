"""Clairvoyant bound for one loss realization (sans-IO, pure arithmetic).

The oracle knows the forward loss realization in advance. It sends SOURCE datagrams back to back from
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


def oracle_delivered(lost: npt.NDArray[np.bool_], timing: DataTiming, n_source: int) -> int:
    """Sources the oracle delivers: the arriving slots among the data slots, at most ``n_source``.

    Data slot ``k`` meets ``lost[k % len(lost)]``, as in the simulator's link.
    """
    slots = timing.data_slots()
    if slots == 0 or n_source == 0:
        return 0
    erased = lost[np.arange(slots) % len(lost)]
    return min(n_source, slots - int(np.count_nonzero(erased)))
