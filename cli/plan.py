"""`pfec plan`: predicted TTFT of local prefill, full handoff per precision, and compute-front/stream-back.

The arithmetic is common/plan/breakeven.py; this module only reads options, picks the receiver's speed (a
preset, or ``--measure``: time this machine's prefill of the default model) and prints the table or JSON.
Bad input exits 2 with the reason.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from pfec.cli.shared import fail
from pfec.common.plan.breakeven import (
    DEFAULT_FLOOR,
    LinkModel,
    Plan,
    ReceiverModel,
    plan_handoff,
)
from pfec.common.plan.breakeven_scan import PRESETS, ModelPreset, preset_named
from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_RTT_MS


def _measured_receiver(preset: ModelPreset, threads: int,
                       device: str) -> tuple[ReceiverModel, dict[str, Any]]:
    """Load the default model and time its prefill here (seconds)."""
    if preset.name != "default":
        raise fail(f"--measure times the default model on this machine; {preset.name!r} is a stated geometry")
    from pfec.common.model import llm  # deferred: torch
    from pfec.common.model.speed import measure_prefill_speed  # deferred: torch

    try:
        runtime = llm.load_model("default", device=device)
        speed = measure_prefill_speed(runtime, threads=threads)
    except ValueError as exc:
        raise fail(str(exc)) from None
    return speed.receiver_model(), speed.to_dict()


def _table(plan: Plan, preset_name: str, source: str) -> str:
    lines = [f"{preset_name}: {plan.n_tokens} tokens; receiver speed {source}",
             f"{'option':<20} {'TTFT s':>8} {'KV MB':>8} {'wire MB':>8} {'meet':>6}  floor",]
    for opt in plan.options:
        mark = "  <- choice" if opt is plan.choice else ""
        meet = "" if opt.meeting_token is None else str(opt.meeting_token)
        keeps = "keeps" if opt.keeps_floor else "below"
        lines.append(f"{opt.label:<20} {opt.ttft_s:>8.3f} {opt.kv_bytes / 1e6:>8.2f} "
                     f"{opt.wire_bytes / 1e6:>8.2f} {meet:>6}  {keeps}{mark}")
    local = plan.option("local").ttft_s
    lines.append(f"choice: {plan.choice.label}, predicted TTFT {plan.choice.ttft_s:.3f} s "
                 f"({plan.choice.ttft_s / local:.2f}x local prefill {local:.3f} s; floor {plan.floor})")
    return "\n".join(lines)


def plan_cmd(
    tokens: Annotated[int, typer.Option(help="Context length in tokens.")],
    rate_mbps: Annotated[float, typer.Option(help="Link rate, Mbit/s.")] = DEFAULT_RATE_MBPS,
    rtt_ms: Annotated[float, typer.Option(help="Round-trip time, ms.")] = DEFAULT_RTT_MS,
    model: Annotated[str, typer.Option(help=f"Preset: {' | '.join(PRESETS)}.")] = "default",
    loss: Annotated[float, typer.Option(help="Expected share of bytes lost (sets FEC overhead).")] = 0.0,
    floor: Annotated[str, typer.Option(help="Lowest precision level allowed (fidelity floor).")] = (
        DEFAULT_FLOOR
    ),
    handshake_rtts: Annotated[float, typer.Option(help="Round trips before the bulk flows.")] = 1.0,
    measure: Annotated[
        bool, typer.Option(help="Time this machine's prefill of the default model, not the stored curve.")
    ] = False,
    threads: Annotated[int, typer.Option(help="torch threads for --measure.")] = 2,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda (for --measure).")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")] = False,
) -> None:
    """Predict TTFT of local prefill, full handoff and split, and choose the fastest above the floor."""
    try:
        preset = preset_named(model)
        link = LinkModel(rate_mbps * 1e6, rtt_ms / 1000.0, loss, handshake_rtts)
    except ValueError as exc:
        raise fail(str(exc)) from None
    receiver, source, speed = preset.receiver, preset.source, None
    if measure:
        receiver, speed = _measured_receiver(preset, threads, device)
        source = f"measured now ({speed['threads']} threads, {speed['device']})"
    try:
        plan = plan_handoff(tokens, preset.geometry, link, receiver, floor=floor)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if as_json:
        result = {
            "model": preset.name, "geometry": repr(preset.geometry), "speed_source": source,
            "prefill": receiver.prefill.to_dict(), "decode_s": receiver.decode_s, "measured": speed,
            "link": {"rate_mbps": rate_mbps, "rtt_ms": rtt_ms, "loss": loss,
                     "handshake_rtts": handshake_rtts},
            **plan.to_dict(),
        }
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        typer.echo(_table(plan, preset.name, source))
