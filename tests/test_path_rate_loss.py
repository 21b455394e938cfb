"""PathRate on a lossy link (sender/transport/path_rate/): random loss after the bottleneck is neither
congestion nor a slower link, while loss with a queue standing still cuts the rate (RFC 9265). The toy
bottleneck of test_path_rate drives it with fake time; its channel loses datagrams after the queue."""

from __future__ import annotations

import math

import pytest
from test_path_rate import DATAGRAM, OWD, Bottleneck

from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.path_rate.delivery import MAX_LOSS_CREDIT, DeliveryRate

LINK = 100e6


class Recording(PathRate):
    """A PathRate that keeps each round's estimate."""

    __slots__ = ("estimates",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.estimates: list[tuple[float, float]] = []  # (round end, estimate)

    def _close_round(self, now: float) -> None:
        super()._close_round(now)
        self.estimates.append((now, self.estimate_bps))


def _use(link: Bottleneck, since: float, until: float) -> float:
    """The share of the link's capacity the datagrams sent in [since, until) offered."""
    sent = sum(since <= t < until for t in link.admitted)
    return sent * DATAGRAM * 8 / (link.link_bps * (until - since))


@pytest.mark.parametrize(("loss", "seed"), [(0.10, 1), (0.17, 2), (0.25, 3)])
def test_random_loss_after_the_bottleneck_is_taken_for_neither_congestion_nor_a_slower_link(
        loss: float, seed: int) -> None:
    """10-25% of the datagrams lost on the wire, after the queue, with no loss prior (a first handoff):
    once STARTUP is over (0.2 s, as on a lossless link) the estimate is the link's rate, the sender offers
    >= 95% of it, and no queue builds. Counting only what arrived, the estimate was the link's rate times
    (1 - loss) until the floor was learnt."""
    rate = Recording(LINK, DATAGRAM, rtt_prior_s=2 * OWD, loss_prior=0.0)
    link = Bottleneck(rate, LINK, random_loss=loss, seed=seed)
    link.run(1.5)
    assert rate.congestion_events == 0 and link.dropped == 0
    assert link.max_queue_s <= 0.05
    assert _use(link, 0.2, 1.5) >= 0.95, _use(link, 0.2, 1.5)
    settled = [est for at, est in rate.estimates if at >= 0.2]
    assert min(settled) >= 0.93 * LINK, min(settled) / 1e6
    assert max(settled) <= 1.2 * LINK, max(settled) / 1e6
    assert rate.loss_floor == pytest.approx(loss, abs=0.04)


@pytest.mark.parametrize("prior", [0.4, 0.9, 1.0, -0.2, math.nan])
def test_a_wrong_or_absurd_loss_prior_neither_inflates_the_estimate_nor_starves_the_link(
        prior: float) -> None:
    """A 5% channel and a loss prior far off or not a share at all: no sample credits more loss than the
    round had, so the estimate never runs far above the link (crediting 40% as floor read 1.58x the link),
    and the floor learns the channel's loss within a few rounds."""
    rate = Recording(LINK, DATAGRAM, rtt_prior_s=2 * OWD, loss_prior=prior)
    assert 0.0 <= rate.loss_floor <= 0.5
    link = Bottleneck(rate, LINK, random_loss=0.05, seed=7)
    link.run(1.0)
    assert max(est for _, est in rate.estimates) <= 1.2 * LINK
    assert _use(link, 0.2, 1.0) >= 0.95
    assert link.dropped == 0 and link.max_queue_s <= 0.05
    assert rate.loss_floor == pytest.approx(0.05, abs=0.03)


def test_no_sample_credits_more_loss_than_the_round_had_nor_more_than_half_of_what_it_sent() -> None:
    delivery = DeliveryRate(LINK, None, 0.9, 16)
    assert delivery.loss_floor == 0.5  # a prior above the cap is capped
    assert delivery.credit(900, 100, clear=False) == 100  # the floor (0.5) is above the round's loss
    assert delivery.credit(900, 100, clear=True) == 100
    delivery.loss_floor = 0.05
    assert delivery.credit(900, 100, clear=False) == pytest.approx(50)  # a queue stood: the floor's share
    assert delivery.credit(100, 900, clear=True) == pytest.approx(MAX_LOSS_CREDIT * 1000)
    assert delivery.credit(1000, 0, clear=True) == 0


def test_loss_above_the_floor_while_a_queue_stands_still_cuts_the_rate() -> None:
    """The channel loses 10%, learnt as the floor; then a neighbour takes 60% of the link and the 30 ms
    queue fills and drops. The drops are gaps in the receiver's count like the channel's, but a queue stands:
    they are congestion, not credited as carried, and the estimate falls to the link's new rate."""
    rate = PathRate(LINK, DATAGRAM, rtt_prior_s=2 * OWD, loss_prior=0.1)
    link = Bottleneck(rate, LINK, queue_s=0.03, random_loss=0.1, seed=4)
    link.run(0.5)
    assert rate.congestion_events == 0 and rate.estimate_bps >= 0.9 * LINK
    link.run(1.2, link_bps=40e6)
    assert rate.congestion_events >= 1 and rate.estimate_bps <= 50e6, rate.estimate_bps / 1e6
    assert rate.loss_floor <= 0.13  # the drops were not learnt as the channel's
    dropped = link.dropped
    link.run(2.0)
    assert link.dropped - dropped <= 0.03 * (link.sent - dropped)


def test_a_queue_growing_on_a_lossy_link_cuts_the_rate_without_loss_above_the_floor() -> None:
    """17% channel loss, then the link halves behind a deep queue (nothing drops): only the RTT says so, and
    the rate follows it down; loss at the floor hides no congestion."""
    rate = PathRate(LINK, DATAGRAM, rtt_prior_s=2 * OWD, loss_prior=0.17)
    link = Bottleneck(rate, LINK, queue_s=0.5, random_loss=0.17, seed=5)
    link.run(0.5)
    link.run(1.2, link_bps=50e6)
    assert link.dropped == 0
    assert rate.estimate_bps <= 60e6, rate.estimate_bps / 1e6
    assert link.max_queue_s <= 0.15
