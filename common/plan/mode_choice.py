"""How one handoff goes, decided before it starts: its mode (the whole cache, a split, or local prefill)
and its precision mix, from the break-even planner's predictions (:mod:`.breakeven`) for this handoff's
tokens, deadline, link and receiver. The stream a mix makes is :mod:`.stream`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

from pfec.common.plan.breakeven import (
    DEFAULT_MODEL_DECODE_S,
    DEFAULT_MODEL_PREFILL,
    LinkModel,
    ReceiverModel,
    level_named,
    plan_handoff,
    split_at,
    split_option,
)
from pfec.common.plan.deadline import budget_seconds, serialisation_s
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.plan.stream import AUTO, NATIVE, check_mix

# --- Which mix ----------------------------------------------------------------------------------------------


def handoff_deadline_s(n_tokens: int, geometry: KVGeometry, rate_bps: float, owd_s: float,
                       rho: float | None = None, deadline_ms: float | None = None) -> float | None:
    """The deadline D a handoff of ``n_tokens`` runs under (rho is relative to its native KV's
    serialisation, as the daemons and the simulator count it); None when neither is given."""
    if rho is None and deadline_ms is None:
        return None
    t_ser = serialisation_s(n_tokens * geometry.bytes_per_token, rate_bps)
    return budget_seconds(t_ser, owd_s, rho, deadline_ms)


def _receiver(stated: ReceiverModel | None, question_tokens: int) -> ReceiverModel:
    """The receiver the planner predicts for: its stated speed, else the default model's stored curve,
    with this handoff's question."""
    model = stated or ReceiverModel(DEFAULT_MODEL_PREFILL, DEFAULT_MODEL_DECODE_S)
    return replace(model, question_tokens=question_tokens)


def choose_mix(requested: str, n_tokens: int, geometry: KVGeometry, rate_bps: float, rtt_s: float,
               receiver: ReceiverModel | None = None, deadline_s: float | None = None, loss: float = 0.0,
               question_tokens: int = 0) -> tuple[str, dict[str, Any]]:
    """(the mix to send, the planner's view) for ``requested`` (``auto`` or a mix).

    ``auto`` takes the planner's choice (``breakeven.plan_handoff``: fidelity first, then speed, for this
    handoff's tokens and ``deadline_s``, the link's rate, RTT and loss, the receiver's prefill curve, by
    default the stored curve of the default model). A whole-cache stream at the level a ``split`` choice
    streams its back; after a ``local`` choice, the fastest whole-cache option that keeps the fidelity
    floor. The planner's own choice is reported next to it. ``question_tokens``: the question the receiver
    runs once the context's KV is whole.
    """
    if requested != AUTO:
        check_mix(requested)
    recv = _receiver(receiver, question_tokens)
    plan = plan_handoff(n_tokens, geometry, LinkModel(rate_bps, rtt_s, loss), recv, deadline_s=deadline_s,
                        modes=("local", "handoff"))
    handoffs = [o for o in plan.options if o.mode == "handoff"]
    if requested != AUTO:
        mix = requested
    elif plan.choice.mode != "local":
        mix = plan.choice.precision
    else:
        mix = min((o for o in handoffs if o.keeps_floor), key=lambda o: o.ttft_s).precision
    used = next(o for o in handoffs if o.precision == mix)
    view = {
        "requested": requested, "choice": plan.choice.label, "choice_ttft_s": plan.choice.ttft_s,
        "used": used.label, "predicted_ttft_s": used.ttft_s, "predicted_parts": _rounded(used.parts),
        "local_ttft_s": plan.option("local").ttft_s, "floor": plan.floor, "owd_s": rtt_s / 2,
        **_receiver_view(recv, LinkModel(rate_bps, rtt_s, loss)),
    }
    return mix, view


def _rounded(parts: dict[str, float]) -> dict[str, float]:
    """A prediction's terms for a report (ms precision is all a TTFT prediction has)."""
    return {name: round(seconds, 4) for name, seconds in parts.items()}


# --- Which mode ---------------------------------------------------------------------------------------------

HANDOFF_MODES: Final = (AUTO, "handoff", "split", "local")
PLANNER_MODES: Final = ("handoff", "split", "local")
#: The modes ``auto`` may pick (the planner's choice among them: fidelity first, then speed) once the
#: receiver has stated its prefill speed (its ACCEPT of an earlier handoff): a split's front runs at the
#: receiver's speed, and the stored curve (the whole 2-core machine's) put a one-core receiver's meeting
#: point far off (measured 1.6-2.4x slower than predicted).
AUTO_MODES: Final = PLANNER_MODES
#: ``auto``'s modes while the receiver's speed is only the stored curve: no split.
AUTO_MODES_UNSTATED: Final = ("handoff", "local")


@dataclass(frozen=True)
class ModeChoice:
    """How one handoff goes: ``handoff`` (the whole cache streams at ``mix``), ``split`` (the receiver
    prefills [0, ``meeting_token``), the back streams at ``mix``) or ``local`` (the receiver prefills
    everything, ``mix`` None, ``meeting_token`` = the context), with the planner's view of it."""

    mode: str
    mix: str | None
    meeting_token: int | None
    view: dict[str, Any]


def aligned_meeting_token(m: float, n_tokens: int, block_tokens: int) -> int:
    """The planner's meeting point, down to a block boundary, leaving at least one block to stream."""
    aligned = int(m) // block_tokens * block_tokens
    return max(0, min(aligned, (n_tokens - 1) // block_tokens * block_tokens))


def choose_mode(mode: str, precision: str, n_tokens: int, geometry: KVGeometry, rate_bps: float, rtt_s: float,
                receiver: ReceiverModel | None = None, block_tokens: int = 16,
                auto_modes: tuple[str, ...] = AUTO_MODES, deadline_s: float | None = None,
                loss: float = 0.0, question_tokens: int = 0, split_rate_bps: float | None = None,
                ) -> ModeChoice:
    """The mode and mix for ``mode`` (``auto`` or one of handoff, split, local) and ``precision`` (``auto``
    or a mix), from the break-even planner (this handoff's tokens, the link's rate, RTT and loss, the
    receiver's prefill curve, by default the stored curve of the default model; ``split_rate_bps``: the
    path's rate beside a split's front, ``LinkModel``). ValueError for an unknown mode or mix. A split
    streams the back at the mix chosen (native when asked for by name; auto's native split streams int8),
    and the front after it."""
    if mode not in HANDOFF_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(HANDOFF_MODES)}")
    if precision != AUTO:
        check_mix(precision)
    recv = _receiver(receiver, question_tokens)
    link = LinkModel(rate_bps, rtt_s, loss, split_rate_bps=split_rate_bps)
    modes = ("local", *auto_modes) if mode == AUTO else ("local", mode)
    plan = plan_handoff(n_tokens, geometry, link, recv, deadline_s=deadline_s, modes=modes)
    used_mode = mode
    keeping = [o for o in plan.options if o.keeps_floor]
    if mode == AUTO:
        allowed = [o for o in keeping if o.mode in auto_modes]
        if plan.choice.mode in auto_modes:
            used_mode = plan.choice.mode
        else:  # the planner's choice is not allowed: the fastest allowed option that keeps the floor
            used_mode = min(allowed, key=lambda o: o.ttft_s).mode if allowed else "handoff"
    mix: str | None = None
    meeting: int | None = None
    if used_mode == "local":
        used = plan.option("local")
        meeting = n_tokens
    elif used_mode == "handoff":
        if precision != AUTO:
            mix = precision
        elif plan.choice.mode != "local":  # the level the planner chose (fidelity first)
            mix = plan.choice.precision
        else:
            mix = min((o for o in keeping if o.mode == "handoff"), key=lambda o: o.ttft_s).precision
        used = plan.option("handoff", mix)
    else:
        if precision != AUTO:
            mix = precision
        elif plan.choice.mode != "local":
            mix = plan.choice.precision
        else:
            mix = min((o for o in keeping if o.mode == "split"), key=lambda o: o.ttft_s).precision
        if mix == NATIVE and precision == AUTO:
            # Auto streams a native split as int8: half the bytes. A split's front shares the receiver's
            # CPU with the stream, so it runs slower than the receiver states, and a native back left the
            # default demo's receiver at its deadline with 18% of the utility missing (int8: ready, the
            # answers equal in 10 of 10 seeds). Asked for by name, a split streams native fragments.
            mix = "int8"
        level = level_named(mix)
        best = split_option(n_tokens, geometry, level, link, recv, True)
        meeting = aligned_meeting_token(best.meeting_token or 0, n_tokens, block_tokens)
        used = split_at(meeting, n_tokens, geometry, level, link, recv)
    view = {
        "requested": precision, "requested_mode": mode, "mode": used_mode, "choice": plan.choice.label,
        "choice_ttft_s": plan.choice.ttft_s, "used": used.label, "predicted_ttft_s": used.ttft_s,
        "predicted_parts": _rounded(used.parts), "local_ttft_s": plan.option("local").ttft_s,
        "floor": plan.floor, "meeting_token": meeting, "owd_s": link.owd_s, **_receiver_view(recv, link),
    }
    return ModeChoice(used_mode, mix, meeting, view)


def _receiver_view(receiver: ReceiverModel, link: LinkModel) -> dict[str, Any]:
    """What the planner took the receiver to be: the numbers it measured and stated, and those defaulted."""
    return {
        "receiver_defaulted": list(receiver.defaulted),
        "receiver_measured": {
            "rebuild_s_per_token": receiver.rebuild_s_per_token, "question_fit": receiver.question_fit,
            "decode_s": receiver.decode_s, "decode_s_per_token": receiver.decode_s_per_token,
            "datagram_s": receiver.datagram_s,
            "front_scale": round(receiver.beside_stream(link.split_link()).front_scale, 4),
        },
    }
