"""The cautious forecast the session plans on (after Sprout): the rate the path delivers with confidence.

It is the ``FORECAST_QUANTILE`` of the last ``FORECAST_ROUNDS`` samples that were not app-limited, never
above the estimate. Until ``FORECAST_MIN_SAMPLES`` exist (since the start or the newest cut) it is the
told rate, then the estimate. The session counts the slots left before its deadline at this rate.
"""

from __future__ import annotations

import math
from typing import Final

from pfec.sender.transport.path_rate.delivery import DeliveryRate

FORECAST_ROUNDS: Final = 16  # the samples the quantile is taken over
FORECAST_QUANTILE: Final = 0.2
FORECAST_MIN_SAMPLES: Final = 4


class Forecast:
    """The forecast rate, updated once per round."""

    __slots__ = ("bps",)

    def __init__(self, start_bps: float) -> None:
        self.bps = start_bps

    def update(self, delivery: DeliveryRate, rounds: int, start_bps: float) -> None:
        recent = list(delivery.samples)[-FORECAST_ROUNDS:]
        rates = sorted(rate for rate, limited in recent if not limited)
        if len(rates) < FORECAST_MIN_SAMPLES:
            # Too few samples since the start or the newest cut: the told rate until the path has taught
            # the estimate, then the estimate (a cut sets it cautiously). Never the drain's pace: at half
            # the estimate, a handoff that ended draining would hand the next one's plan half the link.
            told = start_bps if rounds < FORECAST_MIN_SAMPLES else math.inf
            self.bps = min(told, delivery.estimate_bps)
        else:
            low = rates[int(FORECAST_QUANTILE * (len(rates) - 1))]
            self.bps = delivery.clamp(min(low, delivery.estimate_bps))
