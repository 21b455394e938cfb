"""`pfec`: the command-line entry point (typer)."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    name="pfec",
    help="PriorityFEC: deadline-aware KV-cache handoff over lossy links.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks; each writes docs/benchmarks/<name>.json.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _register_external_commands() -> None:
    """Commands whose modules own their options (imports stay light: typer only reads signatures)."""
    from common.config import keygen_cmd
    from common.emulator import emulate_cmd

    app.command("keygen", help="Generate a pre-shared key file for a node pair.")(keygen_cmd)
    app.command("emulate", help="Link emulator: rate, delay and loss between two nodes.")(emulate_cmd)


_register_external_commands()

DOCS_BENCH = Path("docs/benchmarks")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _progress(label: str) -> Any:
    """A minimal stderr progress line (no extra dependency); silent when stderr is not a terminal."""
    tty = sys.stderr.isatty()

    def update(done: int, total: int) -> None:
        if tty:
            end = "\n" if done == total else ""
            sys.stderr.write(f"\r{label}: {done}/{total} ({100 * done // max(total, 1)}%)" + end)
            sys.stderr.flush()

    return update


def machine_info() -> dict[str, Any]:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


@app.command()
def sim(
    scheme: Annotated[str, typer.Option(help="Comma-separated schemes, e.g. udp,priority,heuristic.")] = (
        "udp,priority,uniform-fec,priority-fixed,heuristic"
    ),
    rho: Annotated[float | None, typer.Option(help="Deadline as (D - T_ow) / T_ser.")] = None,
    deadline_ms: Annotated[float | None, typer.Option(help="Deadline D in ms (instead of --rho).")] = None,
    loss: Annotated[str, typer.Option(help="ge:EG,EB,PGB,PBG | bernoulli:P | trace:PATH")] = (
        "ge:0.001,0.5,0.02,0.1"
    ),
    rate_mbps: Annotated[float, typer.Option(help="Bottleneck link rate.")] = 100.0,
    rtt_ms: Annotated[float, typer.Option(help="Round-trip time (one-way delay is half).")] = 20.0,
    tokens: Annotated[int, typer.Option(help="Context tokens handed off.")] = 1536,
    realizations: Annotated[int, typer.Option(help="Paired loss realizations per scheme.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the loss realizations.")] = 1,
    repair_budget: Annotated[float, typer.Option(help="Repair budget, fraction of source symbols.")] = 0.15,
    window: Annotated[int, typer.Option(help="Coding window cap K (symbols).")] = 64,
    profile: Annotated[
        str, typer.Option(help="Utility profile JSON path, or 'synthetic' (documented stand-in).")
    ] = "synthetic",
    authenticate: Annotated[bool, typer.Option(help="AEAD-protect every simulated datagram.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Simulate handoffs with the real codec and sessions over a paced lossy link (no sleeping)."""
    from common.channel import parse_loss_spec
    from common.sim import SimConfig, simulate
    from common.utility import UtilityProfile

    names = [s.strip() for s in scheme.split(",") if s.strip()]
    if not names:
        raise _fail("--scheme is empty; give at least one scheme name")
    if rho is None and deadline_ms is None:
        rho = 0.8
    try:
        loss_model = parse_loss_spec(loss)
        prof = None if profile == "synthetic" else UtilityProfile.load(profile)
        config = SimConfig(
            loss=loss_model,
            rate_mbps=rate_mbps,
            rtt_ms=rtt_ms,
            rho=rho if deadline_ms is None else None,
            deadline_ms=deadline_ms,
            tokens=tokens,
            repair_budget=repair_budget,
            window_cap=window,
            authenticate=authenticate,
            profile=prof,
            seed=seed,
        )
        result = simulate(config, names, realizations, progress=_progress("sim"))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(format_sim_table(result))


def format_sim_table(result: dict[str, Any]) -> str:
    inp = result["inputs"]
    lines = [
        f"Simulated handoff: {inp['tokens']} tokens ({inp['kv_bytes'] / 1e6:.1f} MB KV, {inp['n_source']} "
        f"source symbols of {inp['symbol_size']} B), {inp['rate_mbps']:g} Mbit/s, RTT {inp['rtt_ms']:g} ms, "
        f"loss {inp['loss']}",
        f"deadline {inp['deadline_ms']:.1f} ms (rho {inp['rho']:.2f}, {inp['slots']} slots), repair budget "
        f"{inp['repair_budget']:.0%}, window {inp['window_cap']}, profile {inp['profile']}, "
        f"{inp['realizations']} paired realizations",
        "",
        f"{'scheme':<16}{'utility':>9}{'  95% CI':<18}{'symbols':>9}{'source':>9}{'repair':>8}"
        f"{'stalls':>8}{'ms/run':>9}",
    ]
    for name, s in result["schemes"].items():
        lo, hi = s["recovered_utility_ci95"]
        lines.append(
            f"{name:<16}{s['recovered_utility_mean']:>9.2%}  [{lo:.2%}, {hi:.2%}]".ljust(43)
            + f"{s['recovered_symbol_fraction_mean']:>9.2%}{s['source_sent_mean']:>9.0f}"
            f"{s['repair_sent_mean']:>8.0f}{s['stalls_mean']:>8.0f}{s['wall_s_mean'] * 1000:>9.0f}"
        )
    lines.append("")
    lines.append("utility = share of the profile's KV utility in blocks fully decoded by the deadline")
    return "\n".join(lines)


@bench_app.command("codec")
def bench_codec(
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    out_dir: Annotated[Path, typer.Option(help="Where codec.json and codec.md are written.")] = DOCS_BENCH,
    realizations: Annotated[int, typer.Option(help="Simulated handoffs for the overhead figure.")] = 3,
) -> None:
    """Codec speed: repair encode, decoder insert, and sender+receiver CPU per 1000 packets."""
    from common.bench import run_codec_bench, write_codec_bench

    result = run_codec_bench(realizations=realizations, progress=_progress("bench codec"))
    result["machine"] = machine_info()
    write_codec_bench(result, out_dir)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo((out_dir / "codec.md").read_text())


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
