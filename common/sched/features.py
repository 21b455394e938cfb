"""The DDQN scheduler's 15 normalised state features (paper IV-C1), from the ``SchedulerView`` alone.

Sans-IO and causal: every feature is a function of the view the sender session maintains from its own
sends and the newest ACK; nothing here reads the receiver or the channel realization. Features are written
into a caller-owned float32 array so a decision allocates nothing.

Index  name      meaning                                                           range
0      b         remaining repair budget B_rem / B_rep                             [0, 1]
1      tau       remaining slots T_rem / T_max                                     [0, 1]
2      p_src     source pressure: sources left / (sources left + slots left)       [0, 1]
3      s_ddl     deadline slack: (slots left - sources left - deficit) / T_max     [-1, 1]
4      eps       estimated loss rate of the GE channel (ACK counters)              [0, 1]
5      beta      burst tendency 1 - 1 / mean loss-run length                       [0, 1)
6      delta     decoder deficit, log1p(d) / log1p(WINDOW_SCALE) (fine at small d)  [0, 1]
7      chi       deficit severity d / max(1, d + B_rem) (the shaping term of F)    [0, 1]
8      w         coding-window size / WINDOW_SCALE                                 [0, 1]
9      w_fb      unresolved symbols at the last feedback / WINDOW_SCALE            [0, 1]
10     h_ack     ACK staleness in RTTs, x / (1 + x)                                [0, 1)
11     g         share of the current block already sent                           [0, 1]
12     u         current block utility / largest block utility                     [0, 1]
13     u_next    mean normalised utility of the next blocks                        [0, 1]
14     p_eff     P(a repair now hits a reported hole)                              [0, 1]
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pfec.common.sched.actions import SchedulerView

N_FEATURES = 15
FEATURE_NAMES: tuple[str, ...] = (
    "b", "tau", "p_src", "s_ddl", "eps", "beta", "delta", "chi",
    "w", "w_fb", "h_ack", "g", "u", "u_next", "p_eff",
)  # fmt: skip
FEATURE_LOW = np.array([0.0, 0.0, 0.0, -1.0] + [0.0] * 11, dtype=np.float32)
FEATURE_HIGH = np.ones(N_FEATURES, dtype=np.float32)
WINDOW_SCALE = 64.0  # the default coding-window cap K; larger windows and deficits saturate at 1
_LOG_WINDOW = math.log1p(WINDOW_SCALE)


def _clip01(x: float) -> float:
    return 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)


def new_feature_buffer() -> npt.NDArray[np.float32]:
    return np.zeros(N_FEATURES, dtype=np.float32)


class FeatureSink(Protocol):
    """A float32 vector or a memoryview of one (policies use the latter: cheaper scalar stores)."""

    def __setitem__(self, index: int, value: float, /) -> None: ...


def write_features(view: SchedulerView, out: FeatureSink) -> None:
    """Fill ``out`` (float32[15], or a memoryview of one) with the normalised features of ``view``."""
    slots_left = view.slots_left
    slots_total = max(1, view.slots_total)
    sources_left = view.n_source - view.sources_sent
    deficit = view.deficit_estimate
    repairs_left = view.repairs_left
    rtt = view.rtt_estimate
    stale_rtts = view.ack_staleness / rtt if rtt > 0.0 else 0.0
    out[0] = _clip01(repairs_left / max(1, view.repair_budget))
    out[1] = _clip01(slots_left / slots_total)
    out[2] = sources_left / max(1, sources_left + slots_left)
    slack = (slots_left - sources_left - deficit) / slots_total
    out[3] = -1.0 if slack < -1.0 else (1.0 if slack > 1.0 else slack)
    out[4] = _clip01(view.loss_estimate)
    out[5] = _clip01(1.0 - 1.0 / max(1.0, view.burst_estimate))
    out[6] = _clip01(math.log1p(deficit) / _LOG_WINDOW)  # a burst of 1 vs 4 vs 16 is decided at small d
    out[7] = deficit / max(1.0, deficit + repairs_left)
    out[8] = _clip01(view.window_size / WINDOW_SCALE)
    out[9] = _clip01(view.window_at_feedback / WINDOW_SCALE)
    out[10] = stale_rtts / (1.0 + stale_rtts)
    out[11] = _clip01(view.block_progress)
    out[12] = _clip01(view.block_utility)
    out[13] = _clip01(view.upcoming_utility)
    out[14] = _clip01(view.repair_effectiveness)
