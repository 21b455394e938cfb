"""Fan-out commands (issue 37): `pfec sim --receivers N --fanout ...` (its body) and `pfec bench fanout`.

The lab modules are imported inside the commands, so `pfec --help` does not load numba or the daemons.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from pfec.cli.shared import DOCS_BENCH, fail, parse_floats, parse_names
from pfec.lab.reporting.progress import progress_line
from pfec.lab.sim.channel import parse_loss_spec

if TYPE_CHECKING:
    from pfec.lab.sim.handoff import SimConfig

T = TypeVar("T")
SIM_DEFAULT_SCHEME = "heuristic"  # a fan-out's session scheme when --scheme is left at its default list


def per_receiver(option: str, values: list[T], n: int) -> list[T]:
    """One value for every receiver, or one per receiver (``n`` of them, in order)."""
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{option}: give it once for all receivers or once per receiver ({n}), "
                         f"got {len(values)}")
    return list(values)


def sim_fanout(config: SimConfig, losses: list[str], receivers: int, fanout: str, scheme: str,
               realizations: int, as_json: bool) -> None:
    """`pfec sim --receivers N --fanout coded,unicast`: each fan-out, each receiver's solo and oracle."""
    from pfec.lab.sim.fanout import MAX_RECEIVERS, FanoutConfig, simulate_fanout  # deferred: numba

    try:
        if not 1 <= receivers <= MAX_RECEIVERS:
            raise ValueError(f"--receivers must be 1..{MAX_RECEIVERS}, got {receivers}")
        specs = per_receiver("--loss", losses, receivers)
        fan = FanoutConfig(config, tuple(parse_loss_spec(s) for s in specs), scheme)
        result = simulate_fanout(fan, parse_names(fanout), realizations, progress=progress_line("sim fanout"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    result["inputs"]["losses"] = specs
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(format_sim_fanout(result))


def format_sim_fanout(result: dict[str, object]) -> str:
    """One line per scheme: each receiver's recovered utility, the uplink's datagrams."""
    inputs = result["inputs"]
    assert isinstance(inputs, dict)
    lines = [f"fan-out to {inputs['receivers']} receivers, rho {inputs['rho']}, deadline "
             f"{inputs['deadline_ms']} ms, losses {', '.join(inputs['losses'])}"]
    schemes = result["schemes"]
    assert isinstance(schemes, dict)
    for name, row in schemes.items():
        utils = " ".join(f"{r['recovered_utility_mean']:.4f}" for r in row["receivers"])
        up = row.get("uplink_datagrams_mean")
        lines.append(f"{name:>8}: utility {utils}" + ("" if up is None else f"  uplink datagrams {up:.0f}"))
    return "\n".join(lines)


def bench_fanout_cmd(
    receivers: Annotated[int, typer.Option(help="Receivers (their losses: the first N of --losses).")] = 3,
    losses: Annotated[str, typer.Option(
        help="Each receiver's bursty (Gilbert-Elliott) loss share, comma-separated.")] = "0.02,0.08,0.15",
    rate_mbps: Annotated[float, typer.Option(help="The uplink's rate.")] = 100.0,
    rtt_ms: Annotated[float, typer.Option(help="Round-trip time of every receiver's path.")] = 20.0,
    rho: Annotated[float, typer.Option(help="Deadline in serialisation times of one stream.")] = 0.8,
    tokens: Annotated[int, typer.Option(help="Context tokens.")] = 1500,
    model: Annotated[str, typer.Option(
        help="The nodes' model: default, or synthetic (synthetic KV, no generation, no TTFT).")] = "default",
    seeds: Annotated[int, typer.Option(help="Loss seeds (each: every solo, then the fan-outs).")] = 3,
    sim_realizations: Annotated[int, typer.Option(help="Simulated realizations for the sim figure.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    out_dir: Annotated[Path, typer.Option(help="Where fanout.json and fanout.md are written.")] = DOCS_BENCH,
) -> None:
    """One context to several receivers through the fan-out relay (real daemons): uplink bytes, each
    receiver's utility and TTFT against its solo handoff; and the simulator's coded fan-out."""
    from pfec.lab.pathbench.fanout import (  # deferred: daemons
        FanoutBench,
        run_fanout_bench,
        write_fanout_bench,
    )
    from pfec.lab.reporting.machine import machine_info  # deferred: numba

    shares = parse_floats(losses, "losses", "0.02,0.08,0.15")
    if not 1 <= receivers <= len(shares):
        raise fail(f"--receivers {receivers}: give 1..{len(shares)} (one --losses share each)")
    try:
        cfg = FanoutBench(losses=tuple(shares[:receivers]), rate_mbps=rate_mbps, rtt_ms=rtt_ms, rho=rho,
                          tokens=tokens, model=model, seeds=seeds, sim_realizations=sim_realizations)
        result = run_fanout_bench(cfg, log=lambda m: typer.echo(m, err=True))
    except ValueError as exc:
        raise fail(str(exc)) from None
    result["machine"] = machine_info()
    write_fanout_bench(result, out_dir)
    typer.echo(json.dumps(result, indent=2) if as_json else (out_dir / "fanout.md").read_text())
