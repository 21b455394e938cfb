"""Deadline arithmetic: the one home of rho, time budgets, link slots and their defaults.

A handoff's deadline D is a time budget counted from the sender's first datagram, in each node's own
monotonic clock (budgets travel between nodes, wall-clock timestamps never do). The paper states it
relative to the link: rho = (D - T_ow) / T_ser, where T_ow is the one-way delay and T_ser the time the
whole KV cache takes to serialise at the link rate. rho = 1 is "just enough time for every byte once".

Every caller (the sender daemon, the simulator, the CLI, the demo, the evaluation) takes its defaults and
budgets from here, so the simulator and the daemons cannot disagree about what "rho 0.8" means.
"""

from __future__ import annotations

import math
from typing import Final, Literal

from pfec.common.wire.messages import HEADER_SIZE, REPAIR_ID_SIZE, TAG_SIZE

DEFAULT_RHO = 0.8
DEFAULT_RATE_MBPS = 100.0
DEFAULT_RTT_MS = 20.0
DEFAULT_REPAIR_BUDGET = 0.15  # B_rep as a fraction of the source symbols (paper III-C): its fixed budget
# The daemons' default: no fixed budget. While the receiver lacks symbols and a repair can still arrive
# in time the sender repairs: the budget is the link time left before the deadline (a repair per slot at
# most). A fraction of the source symbols stays available as a cap (config, per request, `pfec sim`).
WHOLE_DEADLINE: Final = "deadline"
RepairBudget = float | Literal["deadline"]  # a fraction of the source symbols, or WHOLE_DEADLINE
MAX_REPAIR_FRACTION = 10.0

# The coding window cap K. A configured cap of AUTO_WINDOW sizes it from the path (auto_window_cap); any
# other value, 1..MAX_WINDOW_CAP, is used as given.
AUTO_WINDOW = 0
MAX_WINDOW_CAP = 4095  # an RFC 8681 window's 12-bit NSS
MIN_AUTO_WINDOW = 64  # the codec's default window: what short paths keep
MAX_AUTO_WINDOW = 512  # what 200 ms RTT at 100 Mbit/s measured best with; a dense repair costs O(K)
WINDOW_BDP_DIVISOR = 4  # K ~ a quarter of the bandwidth-delay product (see auto_window_cap)


def repair_fraction(budget: RepairBudget | str | None) -> float | None:
    """A repair budget as the sender's setup holds it: a fraction of the source symbols, or None for the
    whole deadline. Refuses anything else (a negative, NaN or absurd fraction, an unknown word)."""
    if budget is None or budget == WHOLE_DEADLINE:
        return None
    if isinstance(budget, str):
        try:
            value = float(budget)
        except ValueError:
            raise ValueError(f"repair budget {budget!r}: a fraction of the source symbols (0..10) or "
                             f"{WHOLE_DEADLINE!r}") from None
    else:
        value = float(budget)
    if not 0.0 <= value <= MAX_REPAIR_FRACTION:  # NaN fails too
        raise ValueError(f"repair budget {budget!r}: a fraction of the source symbols must be in 0..10")
    return value


def repair_cap(fraction: float | None, n_source: int, deadline_s: float, slot_s: float) -> int:
    """Repair datagrams a session may send: ``fraction`` of the sources, or (None) one per link slot of
    the whole deadline, at most MAX_REPAIR_FRACTION per source (the session keeps a record per repair it
    may send; ten per source is past 90% loss)."""
    if fraction is not None:
        return round(fraction * n_source)
    return max(0, min(int(deadline_s / slot_s), round(MAX_REPAIR_FRACTION * n_source)))


def serialisation_s(n_bytes: int, rate_bps: float) -> float:
    """T_ser: seconds ``n_bytes`` take on a link of ``rate_bps``."""
    if rate_bps <= 0:
        raise ValueError(f"link rate must be positive, got {rate_bps!r} bit/s")
    return n_bytes * 8 / rate_bps


def slot_seconds(symbol_size: int, rate_bps: float) -> float:
    """Link time of one full-size data datagram (a REPAIR, the largest) at ``rate_bps``."""
    return serialisation_s(symbol_size + HEADER_SIZE + TAG_SIZE + REPAIR_ID_SIZE, rate_bps)


def budget_seconds(t_ser_s: float, owd_s: float, rho: float | None = None,
                   deadline_ms: float | None = None) -> float:
    """The deadline D in seconds from exactly one of ``rho`` (relative to ``t_ser_s``) and
    ``deadline_ms``; refused unless it leaves time after the one-way delay."""
    if (rho is None) == (deadline_ms is None):
        raise ValueError("give exactly one of rho and deadline_ms")
    if rho is not None:
        if not rho > 0:
            raise ValueError(f"rho must be positive, got {rho!r}")
        budget = owd_s + rho * t_ser_s
    else:
        assert deadline_ms is not None
        budget = deadline_ms / 1000.0
    if not budget > owd_s:
        raise ValueError(
            f"deadline {budget * 1000:.1f} ms must exceed the one-way delay {owd_s * 1000:.1f} ms"
        )
    return budget


def rho_of(budget_s: float, owd_s: float, t_ser_s: float) -> float:
    """The rho a budget of ``budget_s`` stands for."""
    return (budget_s - owd_s) / t_ser_s


def auto_window_cap(owd_s: float, slot_s: float) -> int:
    """The coding window cap K for a path of one-way delay ``owd_s`` and data slot ``slot_s``: a quarter of
    the bandwidth-delay product in datagrams, rounded up to a power of two, within
    [MIN_AUTO_WINDOW, MAX_AUTO_WINDOW]. A loss is reported about a round trip after it was sent, when the
    sender is a bandwidth-delay product further on; a repair whose window spans only the newest 64 sources
    then reaches few of the reported holes, so at long RTT (a few hundred datagrams in flight and more)
    the window grows with the path. Monotone: non-decreasing in the delay and in the rate (shorter slot)."""
    if not (math.isfinite(owd_s) and owd_s >= 0):
        raise ValueError(f"one-way delay must be finite and >= 0, got {owd_s!r} s")
    if not (math.isfinite(slot_s) and slot_s > 0):
        raise ValueError(f"slot must be finite and positive, got {slot_s!r} s")
    want = 2 * owd_s / slot_s / WINDOW_BDP_DIVISOR
    k = MIN_AUTO_WINDOW
    while k < want and k < MAX_AUTO_WINDOW:
        k *= 2
    return k


def check_window_cap(window_cap: int) -> None:
    """A configured window cap: AUTO_WINDOW or 1..MAX_WINDOW_CAP, else a ValueError naming both."""
    if not AUTO_WINDOW <= window_cap <= MAX_WINDOW_CAP:
        raise ValueError(f"window_cap must be {AUTO_WINDOW} (sized from the path) or 1..{MAX_WINDOW_CAP}, "
                         f"got {window_cap!r}")


def resolve_window_cap(window_cap: int, owd_s: float, slot_s: float) -> int:
    """The window cap a session uses: ``window_cap`` as configured, or the path's (``auto_window_cap``)
    when it is AUTO_WINDOW."""
    check_window_cap(window_cap)
    return auto_window_cap(owd_s, slot_s) if window_cap == AUTO_WINDOW else window_cap
