"""The training distribution of the DDQN scheduler: what one training or validation episode draws.

An episode is one short simulated handoff. Its conditions come from ``EpisodeRanges`` (part of
``ddqn.py``'s ``TrainConfig``): a context of a few hundred tokens from a fixed set, a link rate from a
fixed set, an RTT log-uniform over [5, 200] ms (feedback from near-instant to several deadlines' worth of
stale), a deadline rho in [0.3, 1.3] (down to a third of the serialization time) and a Gilbert-Elliott
channel whose parameters are each uniform in a range (bad-state sojourns down to p_bg = 0.025, i.e. mean
bursts of 40 slots, and bad-state loss up to 0.8). ``in_support`` says whether a condition could be drawn at
all, which the held-out evaluation (``lab/train/held_out.py``) relies on to stay apart from training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.plan.utility import UtilityProfile, synthetic_profile
from pfec.lab.sim.channel import GilbertElliott

Range = tuple[float, float]


@dataclass(frozen=True)
class EpisodeRanges:
    """Where training conditions come from (discrete sets and closed ranges)."""

    tokens: tuple[int, ...] = (128, 192, 256, 384)
    rates_mbps: tuple[float, ...] = (25.0, 50.0, 100.0, 200.0)
    rtt_ms: Range = (5.0, 200.0)  # log-uniform
    rho: Range = (0.3, 1.3)
    eps_g: Range = (0.0, 0.005)
    eps_b: Range = (0.25, 0.8)
    p_gb: Range = (0.004, 0.05)
    p_bg: Range = (0.025, 0.3)
    fifo_share: float = 0.2  # episodes in plan order (rl-fec) rather than utility order (priorityfec)

    def problems(self) -> list[tuple[str, str]]:
        """(field, fix) for every invalid field."""
        out: list[tuple[str, str]] = []
        if not self.tokens or any(t < 16 for t in self.tokens):
            out.append(("tokens", "give sizes >= 16 tokens"))
        if not self.rates_mbps or any(r <= 0 for r in self.rates_mbps):
            out.append(("rates_mbps", "give positive link rates"))
        if not 0 < self.rtt_ms[0] <= self.rtt_ms[1]:
            out.append(("rtt_ms", "give 0 < low <= high (log-uniform)"))
        if not 0 < self.rho[0] <= self.rho[1]:
            out.append(("rho", "give 0 < low <= high"))
        for name in ("eps_g", "eps_b", "p_gb", "p_bg"):
            low, high = getattr(self, name)
            if not 0.0 <= low <= high <= 1.0:
                out.append((name, "give probabilities 0 <= low <= high <= 1"))
        if self.p_gb[0] + self.p_bg[0] <= 0:
            out.append(("p_bg", "give p_gb + p_bg > 0 at the low ends"))
        if not 0.0 <= self.fifo_share <= 1.0:
            out.append(("fifo_share", "give a share in [0, 1]"))
        return out


@dataclass
class Episode:
    """What one training episode draws."""

    tokens: int
    rate_mbps: float
    rtt_ms: float
    rho: float
    loss: GilbertElliott
    order: str
    profile: UtilityProfile = field(repr=False)


def random_profile(rng: np.random.Generator, n_layers: int = 30) -> UtilityProfile:
    """A synthetic utility profile: layer decay and position U-shape of random steepness."""
    base = synthetic_profile(n_layers)
    g = np.arange(len(base.layer_groups))
    layer = np.exp(-g / rng.uniform(0.3, 4.0)) + rng.uniform(0.0, 0.3) + rng.uniform(0, 0.2, len(g))
    centres = (np.arange(len(base.position_scores)) + 0.5) / len(base.position_scores)
    position = (0.4 + rng.uniform(0, 3) * np.exp(-centres / rng.uniform(0.05, 0.3))
                + rng.uniform(0, 2) * np.exp(-(1 - centres) / rng.uniform(0.05, 0.3)))
    return UtilityProfile(
        model_id="train-synthetic",
        n_layers=n_layers,
        layer_groups=base.layer_groups,
        position_bins=base.position_bins,
        layer_scores=tuple(float(v) for v in layer / layer.sum()),
        position_scores=tuple(float(v) for v in position / position.sum()),
    )


def draw_episode(ranges: EpisodeRanges, rng: np.random.Generator) -> Episode:
    loss = GilbertElliott(
        eps_g=float(rng.uniform(*ranges.eps_g)),
        eps_b=float(rng.uniform(*ranges.eps_b)),
        p_gb=float(rng.uniform(*ranges.p_gb)),
        p_bg=float(rng.uniform(*ranges.p_bg)),
    )
    log_rtt = rng.uniform(math.log(ranges.rtt_ms[0]), math.log(ranges.rtt_ms[1]))
    return Episode(
        tokens=int(rng.choice(ranges.tokens)),
        rate_mbps=float(rng.choice(ranges.rates_mbps)),
        rtt_ms=float(min(max(math.exp(log_rtt), ranges.rtt_ms[0]), ranges.rtt_ms[1])),
        rho=float(rng.uniform(*ranges.rho)),
        loss=loss,
        order="fifo" if rng.random() < ranges.fifo_share else "utility",
        profile=random_profile(rng) if rng.random() < 0.75 else synthetic_profile(),
    )


def outside_support(ranges: EpisodeRanges, tokens: int, rate_mbps: float, rtt_ms: float, rho: float,
                    loss: GilbertElliott) -> list[str]:
    """The parameters of a condition that training can never draw (empty: it lies in the support)."""

    def inside(value: float, bounds: Range) -> bool:
        return bounds[0] <= value <= bounds[1]

    out = []
    if tokens not in ranges.tokens:
        out.append(f"tokens {tokens} not in {list(ranges.tokens)}")
    if rate_mbps not in ranges.rates_mbps:
        out.append(f"rate {rate_mbps:g} Mbit/s not in {list(ranges.rates_mbps)}")
    if not inside(rtt_ms, ranges.rtt_ms):
        out.append(f"RTT {rtt_ms:g} ms outside {list(ranges.rtt_ms)}")
    if not inside(rho, ranges.rho):
        out.append(f"rho {rho:g} outside {list(ranges.rho)}")
    for name in ("eps_g", "eps_b", "p_gb", "p_bg"):
        value, bounds = getattr(loss, name), getattr(ranges, name)
        if not inside(value, bounds):
            out.append(f"GE {name} {value:g} outside {list(bounds)}")
    return out


def prefix_utility(plan: BlockPlan, queue: npt.NDArray[np.int64], block_utility: npt.NDArray[np.float64]
                   ) -> npt.NDArray[np.float64]:
    """J[k]: utility of the blocks whose every fragment lies in the first k symbols of the send queue."""
    blocks = plan.fragment_block[queue]
    last = np.zeros(plan.n_blocks, dtype=np.int64)
    np.maximum.at(last, blocks, np.arange(len(queue)))
    gained = np.zeros(len(queue) + 1, dtype=np.float64)
    np.add.at(gained, last + 1, block_utility)
    return np.cumsum(gained)
