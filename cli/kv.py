"""KV-side commands: `pfec profile`, `profile-plot`, `retention`, `kvcheck` and `kvloss` (lab/kv/profiler.py,
lab/kv/retention.py). Plain functions with typer-annotated parameters; bad input exits 2 with the message.

Heavy imports (torch, transformers) happen inside the commands so ``pfec --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pfec.cli.shared import fail, parse_floats
from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

ModelOpt = Annotated[
    str, typer.Option(help="'default' (embedded SmolLM2-135M-Instruct) or a local HF model dir.")
]
DeviceOpt = Annotated[str, typer.Option(help="auto | cpu | cuda")]
ProfileOpt = Annotated[
    Path | None, typer.Option(help="Utility profile JSON (default: the shipped one of the default model).")
]


def _emit(result: dict[str, Any], out: Path | None, as_json: bool, summary: str) -> None:
    text = json.dumps(result, indent=2) + "\n"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"[pfec] wrote {out}", file=sys.stderr)
    if as_json:
        sys.stdout.write(text)
    else:
        typer.echo(summary)


def _load(model: str, device: str, transfer_dtype: str = "bf16") -> ModelRuntime:
    from pfec.common.model import llm  # deferred: torch

    return llm.load_model(model, device=device, transfer_dtype=transfer_dtype)


def _profile_for(runtime: ModelRuntime, profile: Path | None) -> UtilityProfile:
    from pfec.lab.kv.profiler import check_profile  # deferred: torch

    path = profile or SHIPPED_PROFILE
    loaded = UtilityProfile.load(path)
    check_profile(runtime, loaded)
    return loaded


def profile_cmd(
    model: ModelOpt = "default",
    out: Annotated[Path, typer.Option(help="Where to write the profile JSON.")] = SHIPPED_PROFILE,
    prompts: Annotated[int, typer.Option(help="Profiling prompts (needle-QA, profiling essays).")] = 16,
    context_tokens: Annotated[int, typer.Option(help="Haystack tokens per prompt.")] = 1500,
    seed: Annotated[int, typer.Option()] = 0,
    groups: Annotated[int, typer.Option(help="Layer groups.")] = 10,
    bins: Annotated[int, typer.Option(help="Relative position bins.")] = 10,
    cells: Annotated[
        bool, typer.Option(help="Also perturb every (group, bin) cell (G x P more runs per prompt).")
    ] = False,
    perturbation: Annotated[str, typer.Option(help="zero (the paper's KV-zeroing) | mask")] = "zero",
    plot: Annotated[Path | None, typer.Option(help="Also draw the profile (PNG).")] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Measure a model's KV utility profile (paper III-A) and write it as JSON."""
    from pfec.lab.kv.profiler import plot_profile, profile_model  # deferred: torch

    if perturbation not in ("zero", "mask"):
        raise fail(f"--perturbation {perturbation!r} is not one of zero, mask")
    try:
        runtime = _load(model, device)
        result = profile_model(runtime, prompts, context_tokens, seed, groups, bins, cells=cells,
                               mode=perturbation)  # type: ignore[arg-type]
    except ValueError as exc:
        raise fail(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    result.save(out)
    if plot is not None:
        plot_profile(result, plot)
    typer.echo(f"profile of {result.model_id} ({result.fingerprint}) -> {out}")


def profile_plot_cmd(
    profile: Annotated[Path, typer.Argument(help="Profile JSON.")] = SHIPPED_PROFILE,
    out: Annotated[Path, typer.Option(help="PNG to write.")] = Path("docs/figures/kv_profile.png"),
) -> None:
    """Draw a utility profile (layer groups, position bins, cells) without loading a model."""
    from pfec.lab.kv.profiler import plot_profile  # deferred: torch

    try:
        loaded = UtilityProfile.load(profile)
    except ValueError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"wrote {plot_profile(loaded, out)}")


def retention_cmd(
    model: ModelOpt = "default",
    profile: ProfileOpt = None,
    retentions: Annotated[str, typer.Option(help="Comma-separated retention fractions.")] = "0.2,0.4,0.6,0.8",
    prompts: Annotated[int, typer.Option(help="Held-out prompts (essays disjoint from profiling).")] = 20,
    context_tokens: Annotated[int, typer.Option()] = 1500,
    seed: Annotated[int, typer.Option()] = 1,
    random_draws: Annotated[int, typer.Option(help="Random retentions averaged per prompt.")] = 3,
    mode: Annotated[str, typer.Option(help="zero (paper Fig. 2c) | mask")] = "zero",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result JSON on stdout.")] = False,
    out: Annotated[Path | None, typer.Option(help="Also write the JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the figure here (PNG).")] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Teacher-forced top-1 agreement under partial KV retention: profile-ranked vs per-request vs random."""
    from pfec.lab.kv.retention import plot_retention, retention_check  # deferred: torch

    if mode not in ("zero", "mask"):
        raise fail(f"--mode {mode!r} is not one of zero, mask")
    fractions = parse_floats(retentions, "retentions", "0.2,0.4,0.6,0.8")
    try:
        runtime = _load(model, device)
        result = retention_check(runtime, _profile_for(runtime, profile), fractions, prompts, context_tokens,
                                 seed, random_draws, mode=mode)  # type: ignore[arg-type]
    except ValueError as exc:
        raise fail(str(exc)) from None
    if plot is not None:
        plot_retention(result, plot)
    lines = [f"{'retention':>9}  {'ranked':>7}  {'request':>7}  {'random':>7}"]
    lines += [f"{p['retention']:>9.0%}  {p['ranked']:>7.1%}  {p['request_ranked']:>7.1%}  {p['random']:>7.1%}"
              for p in result["points"]]
    _emit(result, out, as_json, "\n".join(lines))


def kvcheck_cmd(
    model: ModelOpt = "default",
    n: Annotated[int, typer.Option(help="Needle-QA prompts.")] = 20,
    context_tokens: Annotated[int, typer.Option()] = 1500,
    seed: Annotated[int, typer.Option()] = 0,
    mode: Annotated[str, typer.Option(help="mask | zero")] = "mask",
    transfer_dtype: Annotated[str, typer.Option(help="bf16 | fp16")] = "bf16",
    max_new_tokens: Annotated[int, typer.Option(help="Greedy answer length cap.")] = 24,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    out: Annotated[Path | None, typer.Option()] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Full-delivery round trip: serialise -> symbols -> rebuild -> answer, vs the sender's own answer."""
    from pfec.lab.kv.retention import needle_examples, roundtrip_check  # deferred: torch

    try:
        runtime = _load(model, device, transfer_dtype)
        result = roundtrip_check(runtime, needle_examples(runtime, n, context_tokens, seed),
                                 max_new_tokens, mode=mode)  # type: ignore[arg-type]
    except ValueError as exc:
        raise fail(str(exc)) from None
    result["inputs"] = {"model": runtime.model_id, "n": n, "context_tokens": context_tokens, "seed": seed,
                        "mode": mode, "transfer_dtype": transfer_dtype, "max_new_tokens": max_new_tokens}
    _emit(result, out, as_json,
          f"receiver == sender on {result['receiver_equals_sender']}/{result['n']}; full-KV correct "
          f"{result['sender_correct']}/{result['n']}; median TTFT {result['median_ttft_s'] * 1000:.0f} ms")


def kvloss_cmd(
    model: ModelOpt = "default",
    profile: ProfileOpt = None,
    n: Annotated[int, typer.Option(help="Needle-QA prompts.")] = 20,
    losses: Annotated[str, typer.Option(help="Comma-separated lost-block fractions.")] = "0.1,0.2,0.4",
    context_tokens: Annotated[int, typer.Option()] = 1500,
    seed: Annotated[int, typer.Option()] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy answer length cap.")] = 24,
    kinds: Annotated[str, typer.Option(help="Comma-separated loss kinds: random, ranked.")] = "random,ranked",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    out: Annotated[Path | None, typer.Option()] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Needle-QA F1 of mask vs zero reconstruction under random and profile-ranked block loss."""
    from pfec.lab.kv.retention import needle_examples, reconstruction_table  # deferred: torch

    fractions = parse_floats(losses, "losses", "0.1,0.2,0.4")
    loss_kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    if not loss_kinds or any(k not in ("random", "ranked") for k in loss_kinds):
        raise fail(f"--kinds {kinds!r} must list random and/or ranked")
    try:
        runtime = _load(model, device)
        result = reconstruction_table(runtime, _profile_for(runtime, profile),
                                      needle_examples(runtime, n, context_tokens, seed), fractions, seed,
                                      max_new_tokens, loss_kinds)
    except ValueError as exc:
        raise fail(str(exc)) from None
    lines = [f"full KV: F1 {result['full_kv']['f1_gold']:.3f}, correct {result['full_kv']['correct']}/{n}"]
    lines += [f"{r['loss']:>6} {r['lost_fraction']:>4.0%} {r['mode']:>4}: F1 gold {r['f1_gold']:.3f}  "
              f"F1 vs full {r['f1_full']:.3f}  correct {r['correct']}/{r['n']}" for r in result["table"]]
    _emit(result, out, as_json, "\n".join(lines))
