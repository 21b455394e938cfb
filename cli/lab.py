"""The lab's commands: `pfec sim`, `demo`, `emulate`, `train`, `bench ...` and `tune ...`.

Each parses its options, calls the lab module that does the work and prints the result (one JSON object on
stdout with ``--json``; progress always on stderr). The lab modules that pull numba, torch or the daemons
are imported inside the commands, so `pfec --help` does not load them.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from pfec.cli.fanout.commands import SIM_DEFAULT_SCHEME, per_receiver, sim_fanout
from pfec.cli.link_options import (
    RATE_CONTROL_HELP,
    TOLD_HELP,
    QueueBytesOpt,
    QueueMsOpt,
    RateScaleOpt,
    RateTraceOpt,
    sim_link,
    trace_link,
)
from pfec.cli.shared import DOCS_BENCH, fail, parse_floats
from pfec.common.node.config import parse_host_port
from pfec.common.plan.deadline import (
    AUTO_WINDOW,
    DEFAULT_RATE_MBPS,
    DEFAULT_REPAIR_BUDGET,
    DEFAULT_RHO,
    DEFAULT_RTT_MS,
    WHOLE_DEADLINE,
    repair_fraction,
)
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY
from pfec.common.plan.mode_choice import PLANNER_MODES, choose_mix, choose_mode, handoff_deadline_s
from pfec.common.plan.stream import AUTO, check_mix
from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile
from pfec.lab.emulator.emulate import emulate
from pfec.lab.emulator.fanout import MAX_RECEIVERS, Branch
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig, parse_loss
from pfec.lab.emulator.netns import NetnsSpec
from pfec.lab.reporting.progress import progress_line
from pfec.lab.reporting.text import format_sim_table
from pfec.lab.sim.channel import parse_loss_spec

SIM_SCHEMES = "udp,priority,uniform-fec,priority-fixed,heuristic"
MAIN_LOSS = "ge:0.001,0.5,0.02,0.1"  # the paper's main Gilbert-Elliott config
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
ResultJsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
TokensOpt = Annotated[int, typer.Option(help="Context tokens handed off.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the loss realizations.")]
RttOpt = Annotated[float, typer.Option(help="Round-trip time (one-way delay is half).")]
PrecisionOpt = Annotated[str, typer.Option(
    help="KV precision: auto (the break-even planner's mix) | native | int8 | int8-int4 | int4 | int2.")]
ModeOpt = Annotated[str, typer.Option(
    help="auto (the daemons: the faster of handoff and local prefill as the break-even planner predicts; "
    "`pfec sim`: the planner's choice) | handoff (the whole cache streams) | split (the receiver "
    "prefills the front while the back streams) | local (the receiver prefills everything).")]


# --------------------------------------------------------------------------- simulation


def sim_cmd(
    scheme: Annotated[str, typer.Option(
        help="Comma-separated schemes, e.g. udp,priority,heuristic (fan-out: the first; default "
        "heuristic).")] = SIM_SCHEMES,
    rho: Annotated[float | None, typer.Option(help="Deadline as (D - T_ow) / T_ser.")] = None,
    deadline_ms: Annotated[float | None, typer.Option(help="Deadline D in ms (instead of --rho).")] = None,
    loss: Annotated[list[str] | None, typer.Option(
        help=f"ge:EG,EB,PGB,PBG | bernoulli:P | trace:PATH (default: {MAIN_LOSS}); with --receivers, once "
        "for all or once per receiver.")] = None,
    rate_mbps: Annotated[float, typer.Option(help="Bottleneck link rate.")] = DEFAULT_RATE_MBPS,
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    tokens: TokensOpt = 1536,
    realizations: Annotated[int, typer.Option(help="Paired loss realizations per scheme.")] = 10,
    seed: SeedOpt = 1,
    repair_budget: Annotated[
        str, typer.Option(help="Repair budget: a fraction of the source symbols (default: the paper's "
                          f"fixed {DEFAULT_REPAIR_BUDGET}), or {WHOLE_DEADLINE!r}: repair while symbols are "
                          "missing and a repair can still arrive in time (the daemons' default).")
    ] = str(DEFAULT_REPAIR_BUDGET),
    window: Annotated[int, typer.Option(
        help="Coding window cap K (symbols), as the sender's fec.window_cap: 0 sizes it from the path "
        "(a quarter of the bandwidth-delay product, 64..512).")] = AUTO_WINDOW,
    profile: Annotated[
        str,
        typer.Option(
            help="Utility profile: 'shipped' (profiles/smollm2-135m-instruct.json), a JSON path, or "
            "'synthetic' (documented stand-in)."
        ),
    ] = "shipped",
    authenticate: Annotated[bool, typer.Option(help="AEAD-protect every simulated datagram.")] = False,
    precision: Annotated[str | None, typer.Option(
        help="KV precision: auto (the break-even planner's mix) | native | int8 | int8-int4 | int4 | int2 "
        "(default: native for a handoff, the planner's mix for a split).")] = None,
    mode: Annotated[str, typer.Option(
        help="handoff (the whole cache streams) | split (the receiver prefills the front while the back "
        "streams) | local (the receiver prefills everything) | auto (the break-even planner's choice).")] = (
        "handoff"),
    prefill_speed: Annotated[Path | None, typer.Option(
        help="The receiver's measured prefill speed (PrefillSpeed JSON) for split/local; default: the "
        "default model's curve measured on this machine (breakeven.DEFAULT_MODEL_PREFILL).")] = None,
    rate_trace: RateTraceOpt = None,
    rate_scale: RateScaleOpt = 1.0,
    queue_ms: QueueMsOpt = None,
    queue_bytes: QueueBytesOpt = None,
    told_rate_mbps: Annotated[float | None, typer.Option(help=TOLD_HELP)] = None,
    rate_control: Annotated[str, typer.Option(help=RATE_CONTROL_HELP)] = "fixed",
    receivers: Annotated[int, typer.Option(help="Fan-out: receivers behind one uplink (1-8).")] = 1,
    fanout: Annotated[str | None, typer.Option(
        help="Fan-out: coded (one group stream) and/or unicast (N sessions), comma-separated; each beside "
        "every receiver's solo handoff and oracle (default with --receivers > 1: coded,unicast).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate handoffs with the real codec and sessions over a paced lossy link (no sleeping)."""
    from pfec.lab.sim.simulate import SimConfig, simulate  # deferred: numba (keeps `pfec --help` fast)
    from pfec.lab.sim.split import DEFAULT_RECEIVER, load_receiver_model  # deferred: as above

    planner: dict[str, Any] | None = None
    meeting: int | None = None
    try:
        receiver = DEFAULT_RECEIVER if prefill_speed is None else load_receiver_model(prefill_speed)
        rho_given = None if deadline_ms is not None else (rho or DEFAULT_RHO)
        deadline_s = handoff_deadline_s(tokens, DEFAULT_GEOMETRY, rate_mbps * 1e6, rtt_ms / 2000, rho_given,
                                        deadline_ms)
        if mode == "handoff":
            precision = precision or "native"
            if precision == AUTO:
                precision, planner = choose_mix(AUTO, tokens, DEFAULT_GEOMETRY, rate_mbps * 1e6,
                                                rtt_ms / 1000, receiver, deadline_s)
            check_mix(precision)
        else:  # the simulator models no CPU contention: auto may pick any of the planner's modes
            choice = choose_mode(mode, precision or AUTO, tokens, DEFAULT_GEOMETRY, rate_mbps * 1e6,
                                 rtt_ms / 1000, receiver, auto_modes=PLANNER_MODES, deadline_s=deadline_s)
            mode, precision, meeting = choice.mode, choice.mix or "native", choice.meeting_token
            planner = choice.view
    except ValueError as exc:
        raise fail(f"--precision/--mode: {exc}") from None

    profile_path = str(SHIPPED_PROFILE) if profile == "shipped" else profile
    losses = loss or [MAIN_LOSS]
    fan = receivers != 1 or fanout is not None
    if len(losses) > 1 and not fan:
        raise fail("--loss is given once per receiver only with --receivers")
    names = [s.strip() for s in scheme.split(",") if s.strip()]
    if not names:
        raise fail("--scheme is empty; give at least one scheme name")
    if rho is None and deadline_ms is None:
        rho = DEFAULT_RHO
    try:
        fraction = repair_fraction(repair_budget)
    except ValueError as exc:
        raise fail(f"--repair-budget: {exc}") from None
    try:
        queued = rate_control == "path" or told_rate_mbps not in (None, rate_mbps)
        trace, depth = sim_link(rate_trace, rate_scale, queue_ms, queue_bytes, rate_mbps, queued)
        config = SimConfig(
            loss=parse_loss_spec(losses[0]),
            rate_mbps=rate_mbps,
            rtt_ms=rtt_ms,
            rho=rho if deadline_ms is None else None,
            deadline_ms=deadline_ms,
            tokens=tokens,
            repair_budget=fraction,
            window_cap=window,
            authenticate=authenticate,
            profile=None if profile == "synthetic" else UtilityProfile.load(profile_path),
            seed=seed,
            precision=precision,
            mode=mode,
            meeting_token=meeting if mode == "split" else None,
            receiver=receiver,
            rate_trace=trace,
            queue_bytes=depth,
            told_rate_mbps=told_rate_mbps,
            rate_control=rate_control,
        )
        if not fan:
            result = simulate(config, names, realizations, progress=progress_line("sim"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    if fan:
        one = names[0] if scheme != SIM_SCHEMES else SIM_DEFAULT_SCHEME
        sim_fanout(config, losses, receivers, fanout or "coded,unicast", one, realizations, as_json)
        return
    result["inputs"]["loss"] = losses[0]  # the spec as given, e.g. ge:0.001,0.5,0.02,0.1
    result["inputs"]["profile_path"] = None if profile == "synthetic" else profile_path
    if planner is not None:
        result["inputs"]["planner"] = planner
    typer.echo(json.dumps(result, indent=2) if as_json else format_sim_table(result))


# --------------------------------------------------------------------------- real handoffs and links


def demo_cmd(
    scheme: Annotated[str, typer.Option(help="Scheme.")] = "heuristic",
    rho: Annotated[float, typer.Option(help="Deadline as (D - T_ow) / T_ser.")] = DEFAULT_RHO,
    loss: Annotated[str, typer.Option(help="Forward loss of the emulated link.")] = MAIN_LOSS,
    rate_mbps: Annotated[float, typer.Option(help="Emulated link rate.")] = DEFAULT_RATE_MBPS,
    rtt_ms: Annotated[float, typer.Option(help="Emulated round-trip time.")] = DEFAULT_RTT_MS,
    tokens: Annotated[int, typer.Option(help="Approximate context tokens (needle QA over essays).")] = 1500,
    seed: Annotated[int, typer.Option(help="Workload and loss seed.")] = 1,
    reconstruction: Annotated[str, typer.Option(help="mask | zero")] = "mask",
    compare_sim: Annotated[bool, typer.Option(help="Also run `pfec sim` on the same link (10 runs).")] = True,
    precision: PrecisionOpt = AUTO,
    mode: ModeOpt = AUTO,
    receiver_cpu_quota: Annotated[
        float | None, typer.Option(help="CPUs the receiver may use (cgroup cpu quota; 0.5: half a CPU, a "
                                        "node ~2x slower on one CPU). Needs root.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """A real handoff on this machine: receiver, sender and link emulator over loopback UDP."""
    from pfec.lab.demo import DemoConfig, format_demo, run_demo  # deferred: numba + the daemons

    try:
        cfg = DemoConfig(scheme=scheme, rho=rho, loss=loss, rate_mbps=rate_mbps, rtt_ms=rtt_ms,
                         tokens=tokens, seed=seed, reconstruction=reconstruction, compare_sim=compare_sim,
                         precision=precision, mode=mode, receiver_cpu_quota=receiver_cpu_quota)
        result = run_demo(cfg)
    except ValueError as exc:
        raise fail(str(exc)) from None
    typer.echo(json.dumps(result, indent=2) if as_json else format_demo(result))


def emulate_cmd(
    mode: Annotated[
        str, typer.Option(help="relay: UDP relay (no root); netns: TUN between two namespaces (root).")
    ] = "relay",
    listen: Annotated[str, typer.Option(
        help="relay: HOST:PORT the sender sends to (with several --forward-to: the group port; receiver i's "
        "own port is PORT+1+i). An IPv4 multicast group is joined: one receiver's last mile.")] = (
        "0.0.0.0:7401"),
    join_on: Annotated[str | None, typer.Option(
        help="relay: with a multicast --listen, join the group on the interface with this IPv4 address.",
    )] = None,
    forward_to: Annotated[list[str] | None, typer.Option(
        help="relay: the receiver's HOST:PORT (default: 127.0.0.1:7400). Give it up to 8 times to fan out: "
        "one uplink (rate, queue, trace), then per receiver its own delay and loss.")] = None,
    rate_mbps: Annotated[float, typer.Option(help="Link rate, Mbit/s (0 = unlimited).")] = 100.0,
    reverse_rate_mbps: Annotated[
        float | None, typer.Option(help="Reverse link rate, Mbit/s (default: --rate-mbps).")
    ] = None,
    rtt_ms: Annotated[list[float] | None, typer.Option(
        help="Round-trip time; each direction delays RTT/2 (default: 20). Fan-out: once for all receivers "
        "or once per receiver, in --forward-to's order.")] = None,
    owd_ms: Annotated[list[float] | None, typer.Option(
        help="One-way delay per direction (overrides --rtt-ms); fan-out: once or once per receiver.")] = None,
    loss: Annotated[list[str] | None, typer.Option(
        help="Forward loss: none | bernoulli:P | ge:EG,EB,PGB,PBG | trace:PATH (default: none). Fan-out: "
        "once for all receivers or once per receiver, in order.")] = None,
    reverse_loss: Annotated[list[str] | None, typer.Option(
        help="Reverse (ACK path) loss, same forms (default: none); fan-out: once or once per receiver.",
    )] = None,
    seed: Annotated[int, typer.Option(help="Seed of the loss realizations (streams forward/reverse).")] = 1,
    realization: Annotated[int, typer.Option(help="Realization index (pairs runs with `pfec sim`).")] = 0,
    queue_packets: Annotated[
        int, typer.Option(help="Drop-tail queue limit per direction, datagrams.")
    ] = 1000,
    rate_trace: RateTraceOpt = None,
    rate_scale: RateScaleOpt = 1.0,
    queue_ms: QueueMsOpt = None,
    queue_bytes: QueueBytesOpt = None,
    stats_interval: Annotated[
        float, typer.Option(help="Seconds between stats lines on stderr (0: none).")
    ] = 1.0,
    duration: Annotated[
        float, typer.Option(help="Stop after this many seconds (0: until SIGINT/SIGTERM).")
    ] = 0.0,
    ns_a: Annotated[str, typer.Option(help="netns: the sender's namespace.")] = "pfec-a",
    ns_b: Annotated[str, typer.Option(help="netns: the receiver's namespace.")] = "pfec-b",
    keep_namespaces: Annotated[
        bool, typer.Option(help="netns: leave the namespaces in place on exit.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the final counters as one JSON object.")
    ] = False,
) -> None:
    """Emulate a rate-limited, delayed, lossy link between a sender and a receiver, or one sender and up
    to 8 receivers behind a shared uplink (lab/emulator/)."""
    if mode not in ("relay", "netns"):
        raise fail(f"--mode {mode!r}: use 'relay' or 'netns'")
    targets = forward_to or ["127.0.0.1:7400"]
    try:
        if join_on is not None:
            parse_host_port(f"{join_on}:1")
        if len(targets) > 1 and mode != "relay":
            raise ValueError("several --forward-to fan out through the relay: use --mode relay")
        if len(targets) > MAX_RECEIVERS:
            raise ValueError(f"--forward-to: at most {MAX_RECEIVERS} receivers, got {len(targets)}")
        n = len(targets)
        owds = per_receiver("--owd-ms", owd_ms, n) if owd_ms else [
            r / 2.0 for r in per_receiver("--rtt-ms", rtt_ms or [20.0], n)]
        losses = [parse_loss(s) for s in per_receiver("--loss", loss or ["none"], n)]
        rev_losses = [parse_loss(s) for s in per_receiver("--reverse-loss", reverse_loss or ["none"], n)]
        rev_rate = rate_mbps if reverse_rate_mbps is None else reverse_rate_mbps
        trace, depth = trace_link(rate_trace, rate_scale, queue_ms, queue_bytes)
        listen_hp = parse_host_port(listen, allow_port_zero=True) if mode == "relay" else ("", 0)
        hps = [parse_host_port(t) if mode == "relay" else ("", 0) for t in targets]
        fan = n > 1  # the uplink has the rate and queue; each branch its delay and loss
        config = EmulatorConfig(
            forward=DirectionSpec(rate_mbps * 1e6, 0.0 if fan else owds[0] / 1000.0,
                                  None if fan else losses[0], queue_packets, trace, depth),
            reverse=DirectionSpec(rev_rate * 1e6, 0.0 if fan else owds[0] / 1000.0,
                                  None if fan else rev_losses[0], queue_packets),
            seed=seed,
            realization=realization,
        )
        branches = tuple(Branch(hp, o / 1000.0, lo, rl)
                         for hp, o, lo, rl in zip(hps, owds, losses, rev_losses, strict=True)) if fan else ()
        spec = NetnsSpec(ns_a=ns_a, ns_b=ns_b)
        if seed < 0 or realization < 0:
            raise ValueError(f"--seed and --realization must be >= 0, got {seed} and {realization}")
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        stats = emulate("relay" if mode == "relay" else "netns", config, listen_hp, hps[0], spec,
                        stats_interval, duration, quiet=as_json, keep_namespaces=keep_namespaces,
                        branches=branches, multicast_interface=join_on)
    except OSError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    for label, part in ([("uplink ", stats["uplink"])] + [(f"receiver {r['address']} ", r)
                                                          for r in stats["receivers"]]
                        if "uplink" in stats else [("", stats)]):
        for name in ("forward", "reverse"):
            typer.echo(f"{label}{name}: " + ", ".join(f"{k} {v}" for k, v in part[name].items()), err=True)
    typer.echo(f"cpu {stats['cpu_s']} s over {stats['elapsed_s']} s", err=True)


# --------------------------------------------------------------------------- learning and tuning


def train_cmd(
    episodes: Annotated[int | None, typer.Option(help="RL episodes (default: TrainConfig's).")] = None,
    heuristic_episodes: Annotated[
        int | None, typer.Option(help="Heuristic episodes seeding the replay (0 with --pretrain-updates 0: "
                                      "RL from a random network).")
    ] = None,
    pretrain_updates: Annotated[
        int | None, typer.Option(help="Imitation updates on the heuristic's transitions before RL.")
    ] = None,
    validate_every: Annotated[
        int | None, typer.Option(help="RL episodes between validations; the best is kept (0: the last).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of episodes, exploration and network init.")] = 0,
    init: Annotated[Path | None, typer.Option(help="Start from these weights (npz).")] = None,
    out: Annotated[Path | None, typer.Option(help="Weights (default common/sched/ddqn_weights.npz).")] = None,
    log: Annotated[Path | None, typer.Option(help="JSON-lines log (default docs/training/).")] = None,
    evaluate: Annotated[bool, typer.Option(
        "--evaluate", help="Do not train: compare the weights (--out or the shipped ones) with the "
                           "heuristic on the held-out conditions; write docs/training/heldout_eval.json "
                           "and .md (with --out: next to those weights).")] = False,
    realizations: Annotated[int, typer.Option(help="--evaluate: paired runs per held-out condition.")] = 50,
    jobs: Annotated[int, typer.Option(help="--evaluate: worker processes.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train the Double-DQN repair scheduler by RL on simulated handoffs (torch; run under nice), or
    --evaluate it against the heuristic on the held-out conditions."""
    from pfec.common.sched.ddqn import WEIGHTS_PATH  # deferred: numba (keeps `pfec --help` fast)

    if evaluate:
        from pfec.lab.train.held_out import heldout_comparison, render_markdown, write_result  # deferred: sim

        if out is not None and not out.exists():
            raise fail(f"--out {str(out)!r} does not exist; give a weights file written by `pfec train`")
        try:
            result = heldout_comparison(realizations, jobs, str(out) if out is not None else None,
                                        progress=progress_line("held-out"))
        except ValueError as exc:
            raise fail(str(exc)) from None
        # Other weights than the shipped ones: the report goes next to them, not over the committed one.
        write_result(result, *(() if out is None else (out.with_suffix(".heldout.json"),)))
        typer.echo(json.dumps(result, indent=2) if as_json else render_markdown(result))
        return
    from pfec.lab.train.ddqn import LOG_PATH, TrainConfig, train  # deferred: torch

    if init is not None and not init.exists():
        raise fail(f"--init {str(init)!r} does not exist; give a weights file written by `pfec train`")
    given: dict[str, Any] = {"episodes": episodes, "heuristic_episodes": heuristic_episodes,
                             "pretrain_updates": pretrain_updates, "validate_every": validate_every}
    try:
        cfg = TrainConfig(seed=seed, init=str(init) if init is not None else None,
                          **{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise fail(str(exc)) from None
    command = "pfec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    summary = train(cfg, out or WEIGHTS_PATH, log or LOG_PATH, progress=progress_line("train"),
                    command=command)
    typer.echo(json.dumps(summary, indent=2) if as_json else
               "\n".join(f"{k}: {v}" for k, v in summary.items()))


def tune_flec_rt_cmd(
    realizations: Annotated[int, typer.Option(help="Paired realizations per combination.")] = 4,
    seed: Annotated[int, typer.Option(help="Tuning seed (keep it apart from the evaluation seed 1).")] = 101,
    rho: Annotated[float, typer.Option(help="Deadline as (D - T_ow) / T_ser.")] = DEFAULT_RHO,
    loss: Annotated[str, typer.Option(help="Loss spec.")] = MAIN_LOSS,
    burst_weight: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    fill: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    deadline_rtts: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    inflate: Annotated[str | None, typer.Option(help="Comma-separated values (default: GRID).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Grid search of FlEC-RT's parameters on paired realizations, best first (lab/train/flec_tune.py)."""
    from pfec.lab.sim.simulate import SimConfig  # deferred: numba
    from pfec.lab.train.flec_tune import format_ranking, tune, tuning_grid  # deferred: numba

    if realizations < 1:
        raise typer.BadParameter(f"--realizations must be >= 1, got {realizations}")
    try:
        grid = tuning_grid(
            {"burst_weight": burst_weight, "fill": fill, "deadline_rtts": deadline_rtts, "inflate": inflate}
        )
        config = SimConfig(
            loss=parse_loss_spec(loss), rho=rho, profile=UtilityProfile.load(SHIPPED_PROFILE), seed=seed
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    rows = tune(config, realizations, grid, progress_line("flec-rt tuning"))
    if as_json:
        typer.echo(json.dumps({"loss": loss, "rho": rho, "seed": seed, "realizations": realizations,
                               "ranking": rows}, indent=2))  # fmt: skip
    else:
        typer.echo(format_ranking(rows))


# --------------------------------------------------------------------------- benchmarks


def bench_codec_cmd(
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where codec.json and codec.md are written.")] = DOCS_BENCH,
    realizations: Annotated[
        int, typer.Option(min=1, help="Simulated handoffs for the overhead figure (the median is reported).")
    ] = 5,
) -> None:
    """Codec speed: repair encode, decoder insert, and sender+receiver CPU per 1000 packets."""
    from pfec.lab.bench.drivers import run_codec_bench, write_codec_bench  # deferred: numba

    result = run_codec_bench(realizations=realizations, progress=progress_line("bench codec"))
    _write_bench(result, write_codec_bench, out_dir, "codec.md", as_json)


def bench_quant_cmd(
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where quant.json and quant.md are written.")] = DOCS_BENCH,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per case (the median is reported).")] = 7,
    tokens: Annotated[int, typer.Option(min=16, help="Tokens of the synthetic default-shaped cache.")] = 1792,
    model: Annotated[
        bool, typer.Option(help="Also time the default model's cache of a needle prompt.")
    ] = True,
) -> None:
    """Progressive precision speed on one core: quantise+pack and unpack+dequantise MB/s of native KV."""
    from pfec.lab.bench.quant import run_quant_bench, write_quant_bench  # deferred: torch

    try:
        result = run_quant_bench(repeats=repeats, tokens=tokens, model=model)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_quant_bench, out_dir, "quant.md", as_json)


def bench_scheduler_cmd(
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where scheduler.json and .md are written.")] = DOCS_BENCH,
    realizations: Annotated[int, typer.Option(help="Simulated handoffs whose states are timed.")] = 2,
    passes: Annotated[int, typer.Option(help="Timed passes over the recorded states.")] = 20,
) -> None:
    """DDQN decision latency (features + network + mask) over states recorded from simulated handoffs."""
    from pfec.lab.bench.scheduler import run_scheduler_bench, write_scheduler_bench  # deferred: numba

    if realizations < 1 or passes < 1:
        raise fail(f"--realizations {realizations} and --passes {passes} must both be >= 1")
    try:
        result = run_scheduler_bench(realizations, passes, progress=progress_line("bench scheduler"))
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_scheduler_bench, out_dir, "scheduler.md", as_json)


def bench_transport_cmd(
    handoffs: Annotated[int, typer.Option(help="Handoffs (>= 30 for the lateness percentiles).")] = 30,
    tokens: Annotated[int, typer.Option(help="Synthetic KV tokens per handoff.")] = 384,
    rate_mbps: Annotated[float, typer.Option(help="Pacing rate of the sender.")] = 1000.0,
    deadline_ms: Annotated[float, typer.Option(help="Deadline of each handoff.")] = 1000.0,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where transport.json and transport.md go.")] = DOCS_BENCH,
) -> None:
    """Transport only (synthetic KV, FEC + AEAD on): goodput, pps, CPU per packet, deadline lateness."""
    from pfec.lab.bench.transport import run_transport_bench, write_transport_bench  # deferred: daemons

    try:
        result = run_transport_bench(handoffs=handoffs, tokens=tokens, rate_mbps=rate_mbps,
                                     deadline_ms=deadline_ms)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_transport_bench, out_dir, "transport.md", as_json)


def bench_fuzz_cmd(
    inputs: Annotated[int, typer.Option(min=1, help="Mutated datagrams (both directions).")] = 1_000_000,
    seed: Annotated[int, typer.Option(help="Seed of the corpus handoff and the mutations.")] = 1,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where fuzz.json and fuzz.md are written.")] = DOCS_BENCH,
) -> None:
    """Receive-path robustness: mutated datagrams into a live receiver endpoint and sender session."""
    from pfec.lab.bench.fuzz import run_fuzz_bench, write_fuzz_bench  # deferred: numba

    result = run_fuzz_bench(inputs=inputs, seed=seed, progress=progress_line("bench fuzz"))
    _write_bench(result, write_fuzz_bench, out_dir, "fuzz.md", as_json)
    if result["escapes"] or result["hangs"]:
        raise fail(f"{result['escapes']} escapes and {result['hangs']} hangs (both must be 0)")


def bench_flood_cmd(
    rate: Annotated[float, typer.Option(help="Flood datagrams/s at the receiver's UDP port.")] = 25_000,
    handoffs: Annotated[int, typer.Option(help="Handoffs per condition (interleaved).")] = 10,
    tokens: Annotated[int, typer.Option(help="Synthetic KV tokens per handoff.")] = 384,
    rate_mbps: Annotated[float, typer.Option(help="Pacing rate of the sender.")] = DEFAULT_RATE_MBPS,
    rho: Annotated[float, typer.Option(help="Deadline / serialisation time of the KV.")] = DEFAULT_RHO,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where flood.json and flood.md are written.")] = DOCS_BENCH,
) -> None:
    """Cheap rejection: handoffs with and without a flood of forged OFFERs, junk and replays."""
    from pfec.lab.bench.flood import run_flood_bench, write_flood_bench  # deferred: daemons

    try:
        result = run_flood_bench(rate=rate, handoffs=handoffs, tokens=tokens, rate_mbps=rate_mbps, rho=rho)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_flood_bench, out_dir, "flood.md", as_json)


def bench_breakeven_cmd(
    lengths: Annotated[str, typer.Option(help="Context lengths in tokens, comma-separated (100..8000).")] =
        "512,1024,2048,4096",
    rates: Annotated[str, typer.Option(help="Link rates in Mbit/s, comma-separated.")] = "20,100,1000",
    rtt_ms: RttOpt = DEFAULT_RTT_MS,
    local_runs: Annotated[int, typer.Option(help="Local prefill timings per length (fastest counts).")] = 2,
    as_json: ResultJsonOpt = False,
    out_dir: Annotated[Path, typer.Option(help="Where breakeven.json, .md and .png go.")] = DOCS_BENCH,
    rate_control: Annotated[str, typer.Option(
        help="How the sender paces: path (measured per path, the daemons' default) or fixed (told).",
    )] = "path",
) -> None:
    """Measured TTFT of local prefill, native handoff, auto-precision handoff and split (real daemons over
    the loopback emulator, default model) by context length and link rate; ~20 min at the defaults."""
    from pfec.lab.bench.breakeven import (  # deferred: torch and the daemons
        BreakevenConfig,
        run_breakeven_bench,
        write_breakeven_bench,
    )

    tokens = parse_floats(lengths, "lengths", "512,1024,2048,4096")
    if any(t != int(t) for t in tokens):
        raise fail(f"--lengths {lengths!r}: whole token counts, e.g. 512,1024,2048,4096")
    try:
        cfg = BreakevenConfig(lengths=tuple(int(t) for t in tokens),
                              rates_mbps=tuple(parse_floats(rates, "rates", "20,100,1000")),
                              rtt_ms=rtt_ms, local_runs=local_runs, rate_control=rate_control)
        result = run_breakeven_bench(cfg)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _write_bench(result, write_breakeven_bench, out_dir, "breakeven.md", as_json)


def _write_bench(
    result: dict[str, Any],
    write: Callable[[dict[str, Any], Path], None],
    out_dir: Path,
    markdown: str,
    as_json: bool,
) -> None:
    """Stamp the machine, write the benchmark's files, print the JSON or the Markdown it wrote."""
    from pfec.lab.reporting.machine import machine_info  # deferred: numba (keeps `pfec --help` fast)

    result["machine"] = machine_info()
    write(result, out_dir)
    typer.echo(json.dumps(result, indent=2) if as_json else (out_dir / markdown).read_text())
