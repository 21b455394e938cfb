"""Summary statistics of the lab's reports: the mean over realizations with its 95% interval.

The simulator, the reliable-transport baselines and the evaluation summarise runs the same way, so a
scheme's ``*_mean`` / ``*_ci95`` fields mean the same thing in every report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# Two-sided 97.5% quantiles of Student's t by degrees of freedom (a dof uses the next entry up).
_T975: dict[int, float] = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    25: 2.060,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def mean_ci95(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """Mean and a 95% Student-t confidence interval of the mean."""
    arr = np.asarray(values, dtype=np.float64)
    n = len(arr)
    mean = float(arr.mean()) if n else math.nan
    if n < 2:
        return mean, (mean, mean)
    half = _t975(n - 1) * float(arr.std(ddof=1)) / math.sqrt(n)
    return mean, (mean - half, mean + half)


def _t975(dof: int) -> float:
    for limit in sorted(_T975):
        if dof <= limit:
            return _T975[limit]
    return 1.960


def mean_ci95_fields(name: str, values: Sequence[float]) -> dict[str, Any]:
    """``{NAME_mean: mean, NAME_ci95: [low, high]}``, the report fields of one measure."""
    mean, ci = mean_ci95(values)
    return {f"{name}_mean": mean, f"{name}_ci95": list(ci)}
