"""`pfec`: the command-line entry point (typer)."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from pfec.common.plan.deadline import DEFAULT_RATE_MBPS, DEFAULT_REPAIR_BUDGET, DEFAULT_RHO, DEFAULT_RTT_MS

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
    from pfec.cli.kv import kvcheck_cmd, kvloss_cmd, profile_cmd, profile_plot_cmd, retention_cmd
    from pfec.common.node.config import keygen_cmd
    from pfec.lab.emulator import emulate_cmd

    app.command("keygen", help="Generate a pre-shared key file for a node pair.")(keygen_cmd)
    app.command("emulate", help="Link emulator: rate, delay and loss between two nodes.")(emulate_cmd)
    app.command("profile", help="Profile a model's KV utility (layer groups x position bins).")(profile_cmd)
    app.command("profile-plot", help="Plot a utility profile.")(profile_plot_cmd)
    app.command("retention", help="Teacher-forced agreement under partial KV retention.")(retention_cmd)
    app.command("kvcheck", help="Fragments -> rebuild: receiver answer vs sender's.")(kvcheck_cmd)
    app.command("kvloss", help="Needle-QA F1 of mask vs zero reconstruction under block loss.")(kvloss_cmd)
    from pfec.cli.eval import eval_cmd, eval_render_cmd, eval_trace_cmd

    app.command("eval", help="The paper's experiments on this code; regenerates docs/RESULTS.md.")(eval_cmd)
    app.command("eval-trace", help="Write the synthetic example loss trace for trace replay.")(eval_trace_cmd)
    app.command("eval-render", help="Rewrite the eval docs from a saved `pfec eval` result.")(eval_render_cmd)


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
    rate_mbps: Annotated[float, typer.Option(help="Bottleneck link rate.")] = DEFAULT_RATE_MBPS,
    rtt_ms: Annotated[float, typer.Option(help="Round-trip time (one-way delay is half).")] = DEFAULT_RTT_MS,
    tokens: Annotated[int, typer.Option(help="Context tokens handed off.")] = 1536,
    realizations: Annotated[int, typer.Option(help="Paired loss realizations per scheme.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the loss realizations.")] = 1,
    repair_budget: Annotated[
        float, typer.Option(help="Repair budget, fraction of source symbols.")
    ] = DEFAULT_REPAIR_BUDGET,
    window: Annotated[int, typer.Option(help="Coding window cap K (symbols).")] = 64,
    profile: Annotated[
        str,
        typer.Option(
            help="Utility profile: 'shipped' (profiles/smollm2-135m-instruct.json), a JSON path, or "
            "'synthetic' (documented stand-in)."
        ),
    ] = "shipped",
    authenticate: Annotated[bool, typer.Option(help="AEAD-protect every simulated datagram.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Simulate handoffs with the real codec and sessions over a paced lossy link (no sleeping)."""
    from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile
    from pfec.lab.channel import parse_loss_spec
    from pfec.lab.sim import SimConfig, simulate

    profile_path = str(SHIPPED_PROFILE) if profile == "shipped" else profile
    names = [s.strip() for s in scheme.split(",") if s.strip()]
    if not names:
        raise _fail("--scheme is empty; give at least one scheme name")
    if rho is None and deadline_ms is None:
        rho = DEFAULT_RHO
    try:
        loss_model = parse_loss_spec(loss)
        prof = None if profile == "synthetic" else UtilityProfile.load(profile_path)
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
    result["inputs"]["loss"] = loss  # the spec as given, e.g. ge:0.001,0.5,0.02,0.1
    result["inputs"]["profile_path"] = None if profile == "synthetic" else profile_path
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
        f"{'scheme':<16}{'utility':>9}{'  95% CI':<18}{'effic.':>8}{'symbols':>9}{'source':>9}{'repair':>8}"
        f"{'stalls':>8}{'ms/run':>9}",
    ]
    for name, s in result["schemes"].items():
        lo, hi = s["recovered_utility_ci95"]
        lines.append(
            f"{name:<16}{s['recovered_utility_mean']:>9.2%}  [{lo:.2%}, {hi:.2%}]".ljust(43)
            + f"{s.get('efficiency_mean', float('nan')):>8.2%}"
            + f"{s['recovered_symbol_fraction_mean']:>9.2%}{s['source_sent_mean']:>9.0f}"
            f"{s['repair_sent_mean']:>8.0f}{s['stalls_mean']:>8.0f}{s['wall_s_mean'] * 1000:>9.0f}"
        )
    lines.append("")
    lines.append("utility = share of the profile's KV utility in blocks fully decoded by the deadline")
    lines.append("effic. = utility / the clairvoyant oracle's on the same realization")
    for name, s in result["schemes"].items():
        if "note" in s:
            lines.append(f"{name}: {s['note']}")
    return "\n".join(lines)


@bench_app.command("codec")
def bench_codec(
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    out_dir: Annotated[Path, typer.Option(help="Where codec.json and codec.md are written.")] = DOCS_BENCH,
    realizations: Annotated[
        int, typer.Option(min=1, help="Simulated handoffs for the overhead figure (the median is reported).")
    ] = 5,
) -> None:
    """Codec speed: repair encode, decoder insert, and sender+receiver CPU per 1000 packets."""
    from pfec.lab.bench import run_codec_bench, write_codec_bench

    result = run_codec_bench(realizations=realizations, progress=_progress("bench codec"))
    result["machine"] = machine_info()
    write_codec_bench(result, out_dir)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo((out_dir / "codec.md").read_text())


@bench_app.command("scheduler")
def bench_scheduler(
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    out_dir: Annotated[Path, typer.Option(help="Where scheduler.json and .md are written.")] = DOCS_BENCH,
    realizations: Annotated[int, typer.Option(help="Simulated handoffs whose states are timed.")] = 2,
    passes: Annotated[int, typer.Option(help="Timed passes over the recorded states.")] = 20,
) -> None:
    """DDQN decision latency (features + network + mask) over states recorded from simulated handoffs."""
    from pfec.lab.sched_bench import run_scheduler_bench, write_scheduler_bench

    if realizations < 1 or passes < 1:
        raise _fail(f"--realizations {realizations} and --passes {passes} must both be >= 1")
    try:
        result = run_scheduler_bench(realizations, passes, progress=_progress("bench scheduler"))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    result["machine"] = machine_info()
    write_scheduler_bench(result, out_dir)
    typer.echo(json.dumps(result, indent=2) if as_json else (out_dir / "scheduler.md").read_text())


# --------------------------------------------------------------------------- daemons (issue 4)

sender_app = typer.Typer(help="The sender daemon (prefill, stream KV, control API).", no_args_is_help=True)
receiver_app = typer.Typer(help="The receiver daemon (decode, rebuild, generate).", no_args_is_help=True)
app.add_typer(sender_app, name="sender")
app.add_typer(receiver_app, name="receiver")
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (deploy/*.example.toml).")]


def _daemon_setup(kind: str, config_path: Path | None) -> tuple[Any, bytes, str | None]:
    """Load the config, the key and the token; any problem prints the bad value and exits 2."""
    import logging
    import os

    from pfec.common.node.config import ConfigError, load_config, read_psk, read_token

    try:
        config = load_config(kind, config_path, os.environ)  # type: ignore[call-overload]
        psk = read_psk(config.security.psk_file).key
        token = read_token(config.control.token_file) if config.control.tcp is not None else None
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return config, psk, token


@sender_app.command("serve")
def sender_serve(config: ConfigOpt = None) -> None:
    """Run the sender daemon until SIGTERM."""
    from pfec.lab.emulator import run_event_loop
    from pfec.sender.daemon import serve

    cfg, psk, token = _daemon_setup("sender", config)
    try:
        run_event_loop(serve(cfg, psk, token))
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None


@receiver_app.command("serve")
def receiver_serve(config: ConfigOpt = None) -> None:
    """Run the receiver daemon until SIGTERM."""
    from pfec.lab.emulator import run_event_loop
    from pfec.receiver.daemon import serve

    cfg, psk, token = _daemon_setup("receiver", config)
    try:
        run_event_loop(serve(cfg, psk, token))
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from None


def format_report(report: dict[str, Any]) -> str:
    """The handoff report as a few human-readable lines."""

    def num(key: str, fmt: str, scale: float = 1.0) -> str:
        value = report.get(key)
        return "-" if value is None else format(value * scale, fmt)

    lines = [
        f"handoff {report.get('id', '?')}: {report.get('outcome', report.get('state'))}"
        f" ({report.get('scheme', '?')}, {report.get('mode', '?')} reconstruction)",
        f"  recovered utility {num('recovered_utility', '.2%')}, blocks {report.get('blocks_recovered', '-')}"
        f"/{report.get('n_blocks', '-')}, decoded symbols {report.get('decoded_symbols', '-')}"
        f"/{report.get('n_source', '-')}",
        f"  sent: source {report.get('source_sent', '-')}, repair {report.get('repair_sent', '-')}, "
        f"control {report.get('control_sent', '-')}, {num('bytes_sent', ',.0f')} bytes",
        f"  deadline {num('deadline_ms', '.1f')} ms (rho {num('rho', '.2f')}), "
        f"slack {num('deadline_slack_ms', '.2f')} ms, "
        f"receiver start lateness {num('deadline_late_ms', '.2f')} ms",
        f"  prefill {num('prefill_s', '.2f')} s, TTFT {num('ttft_s', '.3f')} s",
        f"  answer: {report.get('answer')!r}",
    ]
    if "full_kv_answer" in report:
        lines.append(f"  full-KV answer: {report['full_kv_answer']!r}")
    if report.get("failure"):
        lines.append(f"  failure: {report['failure']}")
    return "\n".join(lines)


@app.command()
def handoff(
    receiver: Annotated[str, typer.Option(help="Receiver data address HOST:PORT.")],
    question: Annotated[str | None, typer.Option(help="The question the receiver answers.")] = None,
    context: Annotated[str | None, typer.Option(help="Context text.")] = None,
    context_file: Annotated[Path | None, typer.Option(help="Read the context from this file.")] = None,
    deadline_ms: Annotated[float | None, typer.Option(help="Deadline D in ms.")] = None,
    rho: Annotated[float | None, typer.Option(help="Deadline as (D - T_ow) / T_ser (default 0.8).")] = None,
    scheme: Annotated[str | None, typer.Option(help="Scheme (default: the sender's).")] = None,
    reconstruction: Annotated[str, typer.Option(help="mask | zero")] = "mask",
    rate_mbps: Annotated[float | None, typer.Option(help="Link rate override, Mbit/s.")] = None,
    full_kv_answer: Annotated[bool, typer.Option(help="Also answer from the sender's intact cache.")] = False,
    synthetic_tokens: Annotated[
        int | None, typer.Option(help="Transport test: random KV of this many tokens (no context).")
    ] = None,
    socket_path: Annotated[Path, typer.Option("--socket", help="Sender control socket.")] = Path(
        "/run/pfec/sender.sock"
    ),
    url: Annotated[
        str | None, typer.Option(help="TCP control API http://HOST:PORT (instead of --socket).")
    ] = None,
    token_file: Annotated[Path | None, typer.Option(help="Bearer token file for --url.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Ask the sender daemon for a handoff, wait for it and print the report."""
    import asyncio

    from pfec.common.node.config import ConfigError, read_token
    from pfec.common.node.control import ControlClient

    if context_file is not None:
        try:
            context = context_file.read_text()
        except OSError as exc:
            raise _fail(f"--context-file {str(context_file)!r}: {exc.strerror}") from None
    body: dict[str, Any] = {"receiver": receiver, "reconstruction": reconstruction,
                            "full_kv_answer": full_kv_answer}
    if synthetic_tokens is not None:
        body.update(synthetic_tokens=synthetic_tokens, generate=False)
    else:
        body.update(context=context, question=question)
    options = {"deadline_ms": deadline_ms, "rho": rho, "scheme": scheme, "rate_mbps": rate_mbps}
    for key, value in options.items():
        if value is not None:
            body[key] = value
    try:
        token = read_token(token_file) if token_file is not None else None
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    client = ControlClient(None if url else socket_path, url, token)

    async def run() -> tuple[int, Any]:
        status, created = await client.request("POST", "/handoffs", body)
        if status != 202:
            return status, created
        hid, state = created["id"], created.get("state")
        typer.echo(f"handoff {hid}: {state}", err=True)
        while True:  # progress on stderr: preparing (prefill) -> streaming -> draining -> done/failed
            status, report = await client.request("GET", f"/handoffs/{hid}?wait=0.5")
            if status != 200 or report.get("state") in ("done", "failed"):
                return status, report
            if report.get("state") != state:
                state = report.get("state")
                typer.echo(f"handoff {hid}: {state}", err=True)

    try:
        status, data = asyncio.run(run())
    except OSError as exc:
        raise _fail(f"cannot reach the sender's control API ({url or socket_path}): {exc}") from None
    if status >= 400:
        raise _fail(str(data.get("error", data)))
    typer.echo(json.dumps(data, indent=2) if as_json else format_report(data))
    if data.get("outcome") != "done":
        raise typer.Exit(1)


@app.command()
def demo(
    scheme: Annotated[str, typer.Option(help="Scheme.")] = "heuristic",
    rho: Annotated[float, typer.Option(help="Deadline as (D - T_ow) / T_ser.")] = DEFAULT_RHO,
    loss: Annotated[str, typer.Option(help="Forward loss of the emulated link.")] = "ge:0.001,0.5,0.02,0.1",
    rate_mbps: Annotated[float, typer.Option(help="Emulated link rate.")] = DEFAULT_RATE_MBPS,
    rtt_ms: Annotated[float, typer.Option(help="Emulated round-trip time.")] = DEFAULT_RTT_MS,
    tokens: Annotated[int, typer.Option(help="Approximate context tokens (needle QA over essays).")] = 1500,
    seed: Annotated[int, typer.Option(help="Workload and loss seed.")] = 1,
    reconstruction: Annotated[str, typer.Option(help="mask | zero")] = "mask",
    compare_sim: Annotated[bool, typer.Option(help="Also run `pfec sim` on the same link (10 runs).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A real handoff on this machine: receiver, sender and link emulator over loopback UDP."""
    from pfec.lab.demo import DemoConfig, format_demo, run_demo

    try:
        cfg = DemoConfig(scheme=scheme, rho=rho, loss=loss, rate_mbps=rate_mbps, rtt_ms=rtt_ms,
                         tokens=tokens, seed=seed, reconstruction=reconstruction, compare_sim=compare_sim)
        result = run_demo(cfg)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    typer.echo(json.dumps(result, indent=2) if as_json else format_demo(result))


@bench_app.command("transport")
def bench_transport(
    handoffs: Annotated[int, typer.Option(help="Handoffs (>= 30 for the lateness percentiles).")] = 30,
    tokens: Annotated[int, typer.Option(help="Synthetic KV tokens per handoff.")] = 384,
    rate_mbps: Annotated[float, typer.Option(help="Pacing rate of the sender.")] = 1000.0,
    deadline_ms: Annotated[float, typer.Option(help="Deadline of each handoff.")] = 1000.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    out_dir: Annotated[Path, typer.Option(help="Where transport.json and transport.md go.")] = DOCS_BENCH,
) -> None:
    """Transport only (synthetic KV, FEC + AEAD on): goodput, pps, CPU per packet, deadline lateness."""
    from pfec.lab.bench_transport import run_transport_bench, write_transport_bench

    try:
        result = run_transport_bench(handoffs=handoffs, tokens=tokens, rate_mbps=rate_mbps,
                                     deadline_ms=deadline_ms)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    result["machine"] = machine_info()
    write_transport_bench(result, out_dir)
    typer.echo(json.dumps(result, indent=2) if as_json else (out_dir / "transport.md").read_text())


@app.command()
def train(
    episodes: Annotated[int, typer.Option(help="Learning episodes (after the heuristic seeding).")] = 600,
    heuristic_episodes: Annotated[int, typer.Option(help="Heuristic episodes seeding the replay.")] = 40,
    pretrain_updates: Annotated[
        int, typer.Option(help="Updates on the heuristic's transitions before the first own episode.")
    ] = 5000,
    validate_every: Annotated[
        int, typer.Option(help="Episodes between validations; the best validated weights are kept (0: last).")
    ] = 50,
    seed: Annotated[int, typer.Option(help="Seed of episodes, exploration and network init.")] = 0,
    init: Annotated[Path | None, typer.Option(help="Start from these weights (npz).")] = None,
    out: Annotated[Path | None, typer.Option(help="Weights (default common/sched/ddqn_weights.npz).")] = None,
    log: Annotated[Path | None, typer.Option(help="JSON-lines log (default next to the weights).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train the Double-DQN repair scheduler on simulated handoffs (torch; run under nice)."""
    from pfec.common.sched.ddqn import WEIGHTS_PATH
    from pfec.lab.train import LOG_PATH, TrainConfig
    from pfec.lab.train import train as run_training

    if init is not None and not init.exists():
        raise _fail(f"--init {str(init)!r} does not exist; give a weights file written by `pfec train`")
    try:
        cfg = TrainConfig(episodes=episodes, heuristic_episodes=heuristic_episodes, seed=seed,
                          pretrain_updates=pretrain_updates, validate_every=validate_every,
                          init=str(init) if init is not None else None)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    summary = run_training(cfg, out or WEIGHTS_PATH, log or LOG_PATH, progress=_progress("train"))
    typer.echo(json.dumps(summary, indent=2) if as_json else
               "\n".join(f"{k}: {v}" for k, v in summary.items()))


@app.command()
def reliable(
    proto: Annotated[str, typer.Option(help="tcp (kernel TCP, netns; root) | quic (aioquic).")] = "tcp",
    rho: Annotated[
        float, typer.Option(help="Deadline as (D - T_ow) / T_ser, as in `pfec sim`.")
    ] = DEFAULT_RHO,
    loss: Annotated[str, typer.Option(help="Forward loss: none | ge:EG,EB,PGB,PBG | bernoulli:P")] = (
        "ge:0.001,0.5,0.02,0.1"
    ),
    rate_mbps: Annotated[float, typer.Option(help="Emulated link rate, each direction.")] = DEFAULT_RATE_MBPS,
    rtt_ms: Annotated[float, typer.Option(help="Round-trip time (one-way delay is half).")] = DEFAULT_RTT_MS,
    tokens: Annotated[int, typer.Option(help="Context tokens handed off.")] = 1536,
    realizations: Annotated[int, typer.Option(help="Loss realizations (paired with `pfec sim`).")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the loss realizations.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The handoff over a real reliable transport (kernel TCP or QUIC) through the link emulator."""
    from pfec.lab.channel import Bernoulli, parse_loss_spec
    from pfec.lab.reliable import run_reliable
    from pfec.lab.sim import SimConfig

    if proto not in ("tcp", "quic"):
        raise _fail(f"--proto {proto!r}: use 'tcp' or 'quic'")
    try:
        loss_model = Bernoulli(0.0) if loss.strip().lower() == "none" else parse_loss_spec(loss)
        config = SimConfig(loss=loss_model, rate_mbps=rate_mbps, rtt_ms=rtt_ms, rho=rho, tokens=tokens,
                           seed=seed)
        if seed < 0 or realizations < 1:
            raise ValueError(f"--seed must be >= 0 and --realizations >= 1, got {seed} and {realizations}")
        result = run_reliable(proto, config, realizations, progress=_progress(f"reliable {proto}"))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:
        hint = "; run as root or use --proto quic" if proto == "tcp" else ""
        raise _fail(f"{exc}{hint}") from None
    result["inputs"]["loss"] = loss
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    s = result["schemes"][proto]
    lo, hi = s["recovered_utility_ci95"]
    typer.echo(
        f"{proto} ({', '.join(s['congestion_control'])}, emulator {s['emulator_mode']}), "
        f"deadline {result['inputs']['deadline_ms']:.1f} ms, {s['realizations']} realizations\n"
        f"utility {s['recovered_utility_mean']:.2%} [{lo:.2%}, {hi:.2%}], in-order bytes "
        f"{s['in_order_bytes_mean'] / s['payload_bytes']:.1%} of {s['payload_bytes']}, link rate achieved "
        f"{s['link_rate_achieved_mbps']:.1f} of {s['link_rate_mbps']:g} Mbit/s"
    )


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
