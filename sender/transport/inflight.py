"""What a sender session sent and the ACKs have not yet covered (sans-IO, pure bookkeeping).

Every data datagram leaves a row: a source's packet number and send time at its ESI, a repair's packet
number, send time and [first, end) window at its index in send order. The rows are preallocated (one per
source, one per repair the budget allows), so sending writes two or three array cells and allocates
nothing. Packet numbers grow in send order within each kind, so the newest ACK's largest packet number
splits each kind into an acknowledged prefix and what is still in flight (``count_upto``, compiled): the
repair planner charges the repairs in flight to the holes they may still fill, the scheduler view counts
both, the newest acknowledged packet gives the RTT sample, and the rate controller (:mod:`.rate`)
hears how many data datagrams each ACK newly covers.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pfec.sender.transport.rate import RateController
from pfec.sender.transport.repair_plan import count_upto_kernel


class InFlight:
    """Send records of one session's sources and repairs, and how many of each the newest ACK covers."""

    __slots__ = (
        "_count_upto", "acked_source_end", "rate", "rep_pn", "rep_time", "rep_window", "repairs_acked",
        "src_pn", "src_time",
    )

    def __init__(self, n_source: int, repair_budget: int, rate: RateController) -> None:
        self._count_upto = count_upto_kernel()
        self.rate = rate  # told how many data datagrams each ACK newly covers
        # Written in place by the send path, one row per datagram.
        self.src_pn = np.zeros(n_source, dtype=np.int64)  # by ESI
        self.src_time = np.zeros(n_source, dtype=np.float64)
        rows = repair_budget + 1
        self.rep_pn = np.zeros(rows, dtype=np.int64)  # by repair index, in send order
        self.rep_time = np.zeros(rows, dtype=np.float64)
        self.rep_window: npt.NDArray[np.int64] = np.zeros((rows, 2), dtype=np.int64)  # first, end
        self.acked_source_end = 0  # every source ESI below this was sent before the newest ACKed packet
        self.repairs_acked = 0  # repairs sent before the newest ACKed packet (a prefix in send order)

    def on_ack(self, now: float, largest_pn: int, sources_sent: int, repairs_sent: int) -> float:
        """Move the acknowledged prefixes to an ACK's largest packet number (never back: a reordered older
        ACK moves nothing) and report the data datagrams newly covered; returns the send time of the packet
        it names when that one is newly acknowledged (an RTT sample's start), else -1."""
        sample_time = -1.0
        count_upto = self._count_upto
        newly = 0
        acked = count_upto(self.src_pn, sources_sent, largest_pn)
        if acked > self.acked_source_end:
            newly = acked - self.acked_source_end
            self.acked_source_end = acked
            if self.src_pn[acked - 1] == largest_pn:
                sample_time = float(self.src_time[acked - 1])
        acked = count_upto(self.rep_pn, repairs_sent, largest_pn)
        if acked > self.repairs_acked:
            newly += acked - self.repairs_acked
            self.repairs_acked = acked
            if self.rep_pn[acked - 1] == largest_pn:
                sample_time = float(self.rep_time[acked - 1])
        if newly:
            self.rate.on_packets_acked(now, newly)
        return sample_time
