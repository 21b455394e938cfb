"""Idealised selective-repeat ARQ over the simulator's link (sans-IO, pure arithmetic).

This is an idealised UPPER BOUND for TCP/QUIC, not a model of either: no congestion control or slow
start (the sender paces at the link rate from the first slot), no handshake beyond the OFFER every
scheme sends, and instant loss detection (a loss is known exactly one RTT after the datagram was
serialised, as if the next ACK always arrived and no reordering threshold or timer had to expire).
Retransmissions go before new data (selective repeat); new data are the sources in utility order (its
best case). Delivery is in order, as a reliable byte stream delivers it: a fragment is usable only once
it and every fragment before it in the stream have arrived. Data datagram ``k`` meets
``lost[k % len(lost)]``, the same forward realization the other schemes meet.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pfec.lab.oracle import DataTiming

ARQ_NOTE = (
    "idealised upper bound for TCP/QUIC: selective repeat with no congestion control, "
    "instant loss detection one RTT after the send, in-order delivery"
)


@dataclass(frozen=True)
class ArqOutcome:
    in_order_s: npt.NDArray[np.float64]  # per stream position: when it (and all before it) had arrived
    new_sent: int
    retransmissions: int
    lost: int

    def delivered(self, deadline_s: float) -> npt.NDArray[np.bool_]:
        """Stream positions delivered in order by the deadline."""
        return self.in_order_s <= deadline_s + 1e-12


def simulate_arq(lost: npt.NDArray[np.bool_], timing: DataTiming, rtt_s: float, n_source: int) -> ArqOutcome:
    arrival = np.full(n_source, math.inf)
    due: deque[tuple[float, int]] = deque()  # (loss detected at, position); detection times only grow
    now = timing.first_send_s
    end_by = timing.send_deadline_s + 1e-12
    k = new = retx = dropped = 0
    while now + timing.datagram_s <= end_by:
        if due and due[0][0] <= now:
            position = due.popleft()[1]
            retx += 1
        elif new < n_source:
            position = new
            new += 1
        elif due:
            now = due[0][0]  # idle until the next loss is detected
            continue
        else:
            break
        now += timing.datagram_s
        if lost[k % len(lost)]:
            due.append((now + rtt_s, position))
            dropped += 1
        else:
            arrival[position] = now + timing.owd_s
        k += 1
    in_order = np.maximum.accumulate(arrival) if n_source else arrival
    return ArqOutcome(in_order, new, retx, dropped)
