"""Scheduling policies and the schemes built from them.

A scheme = a source order ("fifo": plan order, "utility": non-increasing block utility) + a policy.
Every policy sees the same ``SchedulerView`` and must return an action its mask allows; the DDQN and
FlEC-RT of later work plug in through the same ``Policy`` protocol.

Closed loop (every policy but ``FixedRate``): a repair is allowed only against an estimated deficit and
goes where the receiver's newest ACK reports holes. Open loop (``FixedRate``, the paper's fixed-rate
baselines): a policy with ``open_loop = True`` sends repairs at its rate whatever the feedback, each over
the newest window of sources (the session reads the attribute once; a policy without it is closed loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pfec.common.sched.actions import Action, SchedulerView
from pfec.common.sched.flec import FlecRT

SourceOrder = Literal["fifo", "utility"]


class Policy(Protocol):
    name: str
    sends_repairs: bool  # False: the session gives this policy no repair budget at all
    # Optional ``open_loop: bool`` (read with getattr, default False): see the module doc.

    def decide(self, view: SchedulerView) -> Action:
        """Pick an action allowed by ``view.mask`` (at least one is allowed when called)."""
        ...

    def reset(self) -> None:
        """Forget per-handoff state."""
        ...


def _first_allowed(view: SchedulerView, preference: tuple[Action, ...]) -> Action:
    for action in preference:
        if view.mask[action]:
            return action
    raise ValueError("no action is allowed; the session must not ask the policy")


class SourceOnly:
    """No repair at all (`udp`, `priority`): sources while there are slots."""

    name = "source-only"
    sends_repairs = False
    open_loop = False

    def decide(self, view: SchedulerView) -> Action:
        return _first_allowed(view, (Action.SOURCE,))

    def reset(self) -> None:
        pass


class FixedRate:
    """A fixed repair rate (`uniform-fec`, `priority-fixed`): ``rate`` repairs per source packet, sent
    proactively, as the paper's fixed-rate baselines do.

    Open loop: credit accrues with every source burst and is spent as single repairs over the newest
    window of sources (at most ``window_cap`` of them, from the receiver's decoded prefix), whatever holes
    or deficit the receiver reports: 1 repair per 8 sources at the default rate, within the repair budget
    and the slots left. The one use of feedback is the ACK's prefix and seen end: once the receiver's
    decoder is stalled (undecoded range past its span, where it refuses repairs), the window sits at its
    prefix instead (see ``SendPath.on_ack`` in sender/transport/send_path.py). No repair once every source
    is out (a fixed-rate code has nothing left to protect).
    """

    name = "fixed-rate"
    sends_repairs = True
    open_loop = True

    def __init__(self, rate: float = 0.125) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fixed repair rate must be in [0, 1], got {rate!r}")
        self.rate = rate
        self._credit = 0.0
        self._last_sources = 0

    def decide(self, view: SchedulerView) -> Action:
        self._credit += (view.sources_sent - self._last_sources) * self.rate
        self._last_sources = view.sources_sent
        if self._credit >= 1.0 and view.mask[Action.REPAIR_1]:
            self._credit -= 1.0
            return Action.REPAIR_1
        if view.mask[Action.SOURCE]:
            return Action.SOURCE
        return _first_allowed(view, (Action.REPAIR_1,))

    def reset(self) -> None:
        self._credit = 0.0
        self._last_sources = 0


class DeficitHeuristic:
    """Deficit-driven repair bursts under the budget (`heuristic`).

    Sends enough repairs to cover the estimated deficit, inflated by the estimated loss rate, choosing the
    largest burst that does not overshoot; otherwise continues the source stream.
    """

    name = "heuristic"
    sends_repairs = True
    open_loop = False

    def decide(self, view: SchedulerView) -> Action:
        # A burst of k once the need reaches 3/4 of k (a single repair from half a symbol), largest first.
        need = view.deficit_estimate / max(0.05, 1.0 - view.loss_estimate)
        mask = view.mask
        if need >= 12.0 and mask[Action.REPAIR_16]:
            return Action.REPAIR_16
        if need >= 3.0 and mask[Action.REPAIR_4]:
            return Action.REPAIR_4
        if need >= 0.5 and mask[Action.REPAIR_1]:
            return Action.REPAIR_1
        return _first_allowed(view, (Action.SOURCE, Action.REPAIR_1))

    def reset(self) -> None:
        pass


def ddqn_policy() -> Policy:
    """The trained Double-DQN scheduler (imported lazily: it loads numba kernels and the weights)."""
    from pfec.common.sched.ddqn import DDQNPolicy  # deferred: compiles kernels and loads the weights

    return DDQNPolicy()


@dataclass(frozen=True)
class Scheme:
    name: str
    order: SourceOrder
    make_policy: Callable[[], Policy]
    description: str


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("udp", "fifo", SourceOnly, "plan (FIFO) order, no repair"),
        Scheme("priority", "utility", SourceOnly, "utility order, no repair"),
        Scheme("uniform-fec", "fifo", FixedRate, "FIFO order, fixed repair rate 1/8"),
        Scheme("priority-fixed", "utility", FixedRate, "utility order, fixed repair rate 1/8"),
        Scheme("heuristic", "utility", DeficitHeuristic, "utility order, deficit-driven repair bursts"),
        Scheme("rl-fec", "fifo", ddqn_policy, "FIFO order, Double-DQN repair scheduler"),
        Scheme("priorityfec", "utility", ddqn_policy, "utility order, Double-DQN repair scheduler"),
        Scheme("flec-rt", "fifo", FlecRT, "FIFO order, FlEC-style adaptive repair (no KV utility)"),
    )
}


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}") from None
