"""`pfec`: the command-line entry point (typer). This module only builds the command tree.

The commands live in one module per group: ``node`` (the daemons, keygen), ``handoff``, ``lab`` (simulation,
demo, emulator, baselines, training, tuning, benchmarks), ``kv`` (model-side measurements) and ``eval``.
Registering reads only their signatures: heavy modules are imported when a command runs.
"""

from __future__ import annotations

import typer

from pfec.cli import bench_chain, bench_gpu, bench_path, bench_serving, kv, lab, node, plan, transports
from pfec.cli import eval as eval_commands
from pfec.cli.fanout import commands as fanout_commands
from pfec.cli.handoff import handoff_cmd

app = typer.Typer(
    name="pfec",
    help="PriorityFEC: deadline-aware KV-cache handoff over lossy links.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks; each writes docs/benchmarks/NAME.json.", no_args_is_help=True)
tune_app = typer.Typer(help="Parameter searches on simulated handoffs.", no_args_is_help=True)
sender_app = typer.Typer(help="The sender daemon (prefill, stream KV, control API).", no_args_is_help=True)
receiver_app = typer.Typer(help="The receiver daemon (decode, rebuild, generate).", no_args_is_help=True)
node_app = typer.Typer(help="A node with both roles: one model, prefix store and control API.",
                       no_args_is_help=True)

app.command("keygen", help="Generate a pre-shared key file for a node pair.")(node.keygen_cmd)
app.command("emulate", help="Link emulator: rate, delay and loss between two nodes.")(lab.emulate_cmd)
app.command("profile", help="Profile a model's KV utility (layer groups x position bins).")(kv.profile_cmd)
app.command("profile-plot", help="Plot a utility profile.")(kv.profile_plot_cmd)
app.command("retention", help="Teacher-forced agreement under partial KV retention.")(kv.retention_cmd)
app.command("kvcheck", help="Fragments -> rebuild: receiver answer vs sender's.")(kv.kvcheck_cmd)
app.command("kvloss", help="Needle-QA F1 of mask vs zero reconstruction under block loss.")(kv.kvloss_cmd)
app.command("eval", help="The paper's experiments on this code; regenerates docs/RESULTS.md.")(
    eval_commands.eval_cmd
)
app.command("eval-trace", help="Write the synthetic example loss trace for trace replay.")(
    eval_commands.eval_trace_cmd
)
app.command("eval-render", help="Rewrite the eval docs from a saved `pfec eval` result.")(
    eval_commands.eval_render_cmd
)
app.command("eval-trace-cells", help="Run only the eval's trace cells and add them to a saved result.")(
    eval_commands.eval_traces_cmd
)
app.command("sim")(lab.sim_cmd)
app.command("handoff")(handoff_cmd)
app.command("demo")(lab.demo_cmd)
app.command("train")(lab.train_cmd)
app.command("reliable")(transports.reliable_cmd)
app.command("plan")(plan.plan_cmd)

app.add_typer(bench_app, name="bench")
bench_app.command("codec")(lab.bench_codec_cmd)
bench_app.command("quant")(lab.bench_quant_cmd)
bench_app.command("scheduler")(lab.bench_scheduler_cmd)
bench_app.command("transport")(lab.bench_transport_cmd)
bench_app.command("fuzz")(lab.bench_fuzz_cmd)
bench_app.command("flood")(lab.bench_flood_cmd)
bench_app.command("breakeven")(lab.bench_breakeven_cmd)
bench_app.command("rate-control")(bench_path.bench_rate_control_cmd)
bench_app.command("traces")(bench_path.bench_traces_cmd)
bench_app.command("serving")(bench_serving.bench_serving_cmd)
bench_app.command("chain")(bench_chain.bench_chain_cmd)
bench_app.command("quic")(transports.bench_quic_cmd)
bench_app.command("fairness")(bench_path.bench_fairness_cmd)
bench_app.command("gpu")(bench_gpu.bench_gpu_cmd)
bench_app.command("fanout")(fanout_commands.bench_fanout_cmd)
app.add_typer(tune_app, name="tune")
tune_app.command("flec-rt")(lab.tune_flec_rt_cmd)
app.add_typer(sender_app, name="sender")
sender_app.command("serve")(node.sender_serve_cmd)
app.add_typer(receiver_app, name="receiver")
receiver_app.command("serve")(node.receiver_serve_cmd)
app.add_typer(node_app, name="node")
node_app.command("serve")(node.node_serve_cmd)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
