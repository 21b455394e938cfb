"""`pfec reliable` and `pfec bench quic`: the handoff over real kernel TCP and QUIC; the QUIC stacks' speed.

Apart from cli/lab.py (the simulator's and the daemons' commands): these run real transports across the
link emulator (lab/baselines/).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from pfec.cli.lab import MAIN_LOSS, JsonOpt, ResultJsonOpt, RttOpt, SeedOpt, TokensOpt, _write_bench
from pfec.cli.link_options import QueueBytesOpt, QueueMsOpt, RateScaleOpt, RateTraceOpt, trace_link
from pfec.cli.shared import DOCS_BENCH, fail
from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_RHO, DEFAULT_RTT_MS
from pfec.lab.reporting.progress import progress_line
from pfec.lab.reporting.text import format_reliable_summary
from pfec.lab.sim.channel import Bernoulli, parse_loss_spec

QUIC_STACK_NAMES = ("qh3", "aioquic")  # lab/baselines/endpoints.QUIC_STACKS (not imported: keeps --help fast)


def reliable_cmd(
    proto: Annotated[str, typer.Option(
        help="tcp | quic (the paper's: natural order) | priority-tcp | priority-quic (ours: utility order); "
        "TCP is kernel TCP between namespaces (root), QUIC is --quic-stack over the UDP relay.")] = "tcp",
    congestion: Annotated[str | None, typer.Option(
        help="Kernel TCP congestion control: cubic | bbr (default: the kernel's); TCP only.")] = None,
    quic_stack: Annotated[str, typer.Option(
        help="QUIC only: qh3 (native packet core) | aioquic (pure Python).")] = QUIC_STACK_NAMES[0],
    rho: Annotated[
        float, typer.Option(help="Deadline as (D - T_ow) / T_ser at --rate-mbps, as in `pfec sim`.")
    ] = DEFAULT_RHO,
    loss: Annotated[
        str, typer.Option(help="Forward loss: none | ge:EG,EB,PGB,PBG | bernoulli:P")
    ] = MAIN_LOSS,
    rate_mbps: Annotated[float, typer.Option(
        help="Emulated link rate, each direction (with --rate-trace: the reverse's, and the rate --rho "
        "counts the deadline at).")] = DEFAULT_RATE_MBPS,
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    tokens: TokensOpt = 1536,
    realizations: Annotated[int, typer.Option(help="Loss realizations (paired with `pfec sim`).")] = 3,
    seed: SeedOpt = 1,
    queue_packets: Annotated[int, typer.Option(
        help="Drop-tail queue per direction, datagrams (a fixed-rate link; with --rate-trace the reverse's)."
    )] = 1000,
    rate_trace: RateTraceOpt = None,
    rate_scale: RateScaleOpt = 1.0,
    queue_ms: QueueMsOpt = None,
    queue_bytes: QueueBytesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The handoff over a real reliable transport (kernel TCP or QUIC) through the link emulator."""
    from pfec.lab.baselines.reliable import (  # deferred: numba (keeps `pfec --help` fast)
        RELIABLE_SCHEMES,
        run_reliable,
    )
    from pfec.lab.sim.simulate import SimConfig  # deferred: numba

    if proto not in RELIABLE_SCHEMES:
        raise fail(f"--proto {proto!r}: use one of {', '.join(RELIABLE_SCHEMES)}")
    is_tcp = RELIABLE_SCHEMES[proto].protocol == "tcp"
    if congestion is not None and congestion not in ("cubic", "bbr"):
        raise fail(f"--congestion {congestion!r}: use cubic or bbr")
    if congestion is not None and not is_tcp:
        raise fail(f"--congestion applies to kernel TCP only, not to --proto {proto} (QUIC: its stack's own)")
    if quic_stack not in QUIC_STACK_NAMES:
        raise fail(f"--quic-stack {quic_stack!r}: use one of {', '.join(QUIC_STACK_NAMES)}")
    try:
        loss_model = Bernoulli(0.0) if loss.strip().lower() == "none" else parse_loss_spec(loss)
        trace, depth = trace_link(rate_trace, rate_scale, queue_ms, queue_bytes)
        config = SimConfig(loss=loss_model, rate_mbps=rate_mbps, rtt_ms=rtt_ms, rho=rho, tokens=tokens,
                           seed=seed, rate_trace=trace, queue_bytes=depth)  # fmt: skip
        if seed < 0 or realizations < 1:
            raise ValueError(f"--seed must be >= 0 and --realizations >= 1, got {seed} and {realizations}")
        result = run_reliable(proto, config, realizations, progress=progress_line(f"reliable {proto}"),
                              congestion_control=congestion, quic_stack=quic_stack,
                              queue_packets=queue_packets)  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{exc}{'; run as root or use --proto quic' if is_tcp else ''}") from None
    result["inputs"]["loss"] = loss
    typer.echo(json.dumps(result, indent=2) if as_json else format_reliable_summary(result, proto))


def bench_quic_cmd(
    stacks: Annotated[str, typer.Option(help="QUIC stacks, comma-separated: qh3, aioquic.")] = "qh3,aioquic",
    runs: Annotated[int, typer.Option(min=1, help="Transfers per stack and path.")] = 3,
    tokens: TokensOpt = 1536,
    rate_mbps: Annotated[float, typer.Option(help="The relay's link rate, each direction.")] = 100.0,
    rtt_ms: RttOpt = 20.0,
    seconds: Annotated[float, typer.Option(help="Each transfer's time limit from its first Initial.")] = 6.0,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where quic.json and quic.md go.")] = DOCS_BENCH,
) -> None:
    """QUIC stacks' bulk goodput and CPU through the relay emulator (lossless and main GE loss) and over
    plain loopback (the stack's own ceiling)."""
    from pfec.lab.baselines.stack_bench import format_quic_bench, run_quic_bench  # deferred: numba

    names = tuple(s.strip() for s in stacks.split(",") if s.strip())
    try:
        result = run_quic_bench(names, runs, tokens, rate_mbps, rtt_ms, seconds,
                                progress=progress_line("bench quic"))  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from None

    def write(res: dict[str, Any], directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "quic.json").write_text(json.dumps(res, indent=2) + "\n")
        (directory / "quic.md").write_text(format_quic_bench(res))

    _write_bench(result, write, out_dir, "quic.md", as_json)
