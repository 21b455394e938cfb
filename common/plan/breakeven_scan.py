"""The break-even planner beyond one handoff: named models to plan for (a KV geometry and a receiver
speed each, with where the numbers come from) and scans along the context length (where the planner's
choice switches, from which length a stream beats local prefill).

``pfec plan`` and the break-even bench read these; a daemon plans each handoff with :mod:`.breakeven`
alone. Sans-IO: no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pfec.common.plan.breakeven import (
    DEFAULT_FLOOR,
    DEFAULT_MODEL_DECODE_S,
    DEFAULT_MODEL_PREFILL,
    DEFAULT_PRECISION_LEVELS,
    DEFAULT_TIE_TOLERANCE,
    LOCAL_MARGIN,
    LinkModel,
    Mode,
    PrecisionLevel,
    ReceiverModel,
    handoff_option,
    level_named,
    local_option,
    plan_handoff,
    split_option,
)
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry
from pfec.common.plan.prefill import PrefillCurve

# --- Presets ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A model's KV geometry and a receiver speed for it, with where the speed comes from."""

    name: str
    geometry: KVGeometry
    receiver: ReceiverModel
    source: str


# ASSUMED, not measured: Qwen2.5-7B-class GQA (28 layers, 4 KV heads, head dim 128, d_model 3584, 7.6e9
# parameters) on one RTX 4090-class GPU in bf16. Linear term: 2 x 7.6e9 FLOP per token at 50% of the card's
# 165 TFLOPS dense bf16 tensor peak (~82 TFLOPS) = 1.85e-4 s/token (5,400 tokens/s); quadratic term:
# causal attention, 2 x 2 x 28 layers x 3584 x N^2 / 2 FLOP at the same rate = 2.4e-9 s/token^2; 20 ms per
# call; decode: 15.2 GB of weights read per token at ~75% of 1 TB/s = 20 ms; rebuild: KV crosses PCIe 4.0
# x16 (~25 GB/s, 0.04 ms per MB) and dequantises on the GPU, ~2% of this CPU's rebuild time.
GPU_7B_PREFILL: Final = PrefillCurve(a=0.020, b=1.85e-4, c=2.4e-9)
GPU_7B_DECODE_S: Final = 0.020
GPU_7B_REBUILD_SCALE: Final = 0.02

PRESETS: Final[dict[str, ModelPreset]] = {
    "default": ModelPreset(
        "default", DEFAULT_GEOMETRY, ReceiverModel(DEFAULT_MODEL_PREFILL, DEFAULT_MODEL_DECODE_S),
        "measured: SmolLM2-135M-Instruct on this 2-core CPU, 2 torch threads, 2026-12-01 (model/speed.py)",
    ),
    "qwen2.5-7b-geometry": ModelPreset(
        "qwen2.5-7b-geometry", KVGeometry(n_layers=28, n_kv_heads=4, head_dim=128, dtype="bf16"),
        ReceiverModel(GPU_7B_PREFILL, GPU_7B_DECODE_S, rebuild_scale=GPU_7B_REBUILD_SCALE),
        "assumed: RTX 4090-class GPU, bf16, 50% of 165 TFLOPS dense peak (FLOP count, not a measurement)",
    ),
}


def preset_named(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: known presets are {', '.join(PRESETS)}")
    return PRESETS[name]


# --- Crossovers -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Switch:
    """Where the planner's choice changes along the context length."""

    n_tokens: int  # first length with the new choice
    before: str
    after: str


def choice_switches(lengths: Sequence[int], geometry: KVGeometry, link: LinkModel, receiver: ReceiverModel,
                    levels: Sequence[PrecisionLevel] = DEFAULT_PRECISION_LEVELS, floor: str = DEFAULT_FLOOR,
                    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
                    local_margin: float = LOCAL_MARGIN) -> list[Switch]:
    """Every change of the chosen option's label over increasing ``lengths`` (no deadline)."""
    switches: list[Switch] = []
    previous: str | None = None
    for n in sorted(lengths):
        label = plan_handoff(n, geometry, link, receiver, levels, floor, tie_tolerance,
                             local_margin=local_margin).choice.label
        if previous is not None and label != previous:
            switches.append(Switch(n, previous, label))
        previous = label
    return switches


def beats_local_from(lengths: Sequence[int], geometry: KVGeometry, link: LinkModel, receiver: ReceiverModel,
                     mode: Mode, precision: str, levels: Sequence[PrecisionLevel] = DEFAULT_PRECISION_LEVELS,
                     ) -> int | None:
    """The smallest length from which ``mode`` at ``precision`` beats local prefill at every larger length
    in ``lengths`` (None: not even at the largest)."""
    if mode == "local":
        raise ValueError("compare a handoff or split mode with local, not local itself")
    level = level_named(precision, levels)
    make = handoff_option if mode == "handoff" else split_option
    since: int | None = None
    for n in sorted(lengths):
        wins = make(n, geometry, level, link, receiver, True).ttft_s < local_option(n, link, receiver).ttft_s
        if not wins:
            since = None
        elif since is None:
            since = n
    return since
