"""What `pfec eval` runs: its configuration, the named loss configs, the schemes and the report's constants.

``EvalConfig`` holds every knob of the evaluation (``SMALL`` is the CI size); the constants here are shared
by the stages (``sweep``, ``task``, ``overhead``), their orchestration (``evaluate``) and the
report (``report``), so none of those imports another for a name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile, synthetic_profile
from pfec.common.sched.policies import SCHEMES, get_scheme
from pfec.lab.baselines.reliable import RELIABLE_SCHEMES
from pfec.lab.sim.arq import ARQ_SCHEMES
from pfec.lab.sim.channel import LossModel, parse_loss_spec
from pfec.lab.sim.known_rate import KNOWN_RATE_SCHEMES
from pfec.lab.sim.simulate import REFERENCE_SCHEMES, SimConfig, whole_deadline_base

__all__ = [
    "SMALL",
    "EvalConfig",
    "ReliableRow",
    "parse_configs",
    "scheme_definitions",
    "scheme_status",
    "stand_in",
]

REPO: Final = Path(__file__).resolve().parents[2]
EXAMPLE_TRACE: Final = REPO / "profiles" / "example-loss.trace"

NAMED_CONFIGS: dict[str, str] = {
    "main": "ge:0.001,0.5,0.02,0.1",
    "milder": "ge:0.001,0.3,0.01,0.2",
    "burstier": "ge:0.001,0.5,0.01,0.05",
    "trace": f"trace:{EXAMPLE_TRACE}",
}
SWEEP_RHOS = (0.6, 0.8, 1.0, 1.2)
ALL_SCHEMES = (
    "udp",
    "tcp",
    "quic",
    "priority",
    "uniform-fec",
    "priority-fixed",
    "flec-rt",
    "arq",
    "priority-arq",
    "arq-ideal",
    "rl-fec",
    "heuristic",
    "priorityfec",
    "oracle",
    "priority-tcp",
    "priority-quic",
    # The daemons' repair rule beside the paper's: the whole deadline as the repair budget (the sweep only).
    "heuristic@deadline",
    "priorityfec@deadline",
)
RELIABLE = tuple(RELIABLE_SCHEMES)  # real transport runs (lab/baselines/), not slot-simulator schemes
CONGESTION_CONTROLS = ("cubic", "bbr")  # kernel TCP's, one row each (lab/baselines/reliable.py)
# Session schemes (common/sched/policies.py SCHEMES) by their role in the paper: its compared transports,
# its ablation variants, and ours. ARQ and real-transport schemes carry their own flag (ARQ_SCHEMES,
# RELIABLE_SCHEMES); the oracle is a bound.
PAPER_SESSION_BASELINES = ("udp", "uniform-fec", "flec-rt")
PAPER_ABLATION_VARIANTS = ("priority", "priority-fixed", "rl-fec")
GRID_SCHEMES = ("priorityfec", "priority-arq", "arq", "oracle")
GRID_AUTO = "priorityfec@auto"  # the grid's extra row: priorityfec with --precision auto
TASK_SCHEMES = ("udp", "priority", "heuristic", "priorityfec")
ABLATION_SCHEMES = ("priority", "rl-fec", "priority-fixed", "priorityfec")
ABLATION_RHOS = (0.8, 1.0)
# Stands in (and says so) while the DDQN is absent.
FALLBACK = {"priorityfec": "heuristic", "priorityfec@deadline": "heuristic@deadline"}
MODES = ("mask", "zero")
RESULTS_BEGIN = "<!-- BEGIN pfec eval (generated: rerun `pfec eval` to replace this part) -->"
RESULTS_END = "<!-- END pfec eval -->"
PAPER = {"utility_rho08": 0.991, "best_baseline_rho08": 0.823, "gain_points": 16.8}
# The fidelity stage (lab/eval/precision.py): deadlines (rho of the native cache) and variants, native first.
PRECISION_RHOS = (0.3, 0.5, 0.8, 1.0)
PRECISION_VARIANTS = ("native", "int8", "int8-int4", "int4", "int2", "auto", "split")
REFERENCE_VARIANT = "native"  # every variant's paired difference is taken against native-only
HEADLINE = ("main", 0.8)  # the headline cell: main GE config, rho 0.8


@dataclass(frozen=True)
class ReliableRow:
    """One real-transport row of the eval: a RELIABLE_SCHEMES name and (TCP) its congestion control."""

    scheme: str
    congestion: str | None

    @property
    def label(self) -> str:
        return self.scheme if self.congestion is None else f"{self.scheme}/{self.congestion}"


@dataclass(frozen=True)
class EvalConfig:
    realizations: int = 10  # per cell; the HEADLINE cell gets headline_realizations (the claims' cell)
    headline_realizations: int = 64  # realizations of the HEADLINE cell (the claims are made there)
    rhos: tuple[float, ...] = SWEEP_RHOS
    configs: tuple[tuple[str, str], ...] = tuple(NAMED_CONFIGS.items())  # (name, loss spec)
    schemes: tuple[str, ...] = ALL_SCHEMES
    profile: str = str(SHIPPED_PROFILE)  # a profile JSON path or "synthetic"
    tokens: int = 1536
    rate_mbps: float = 100.0
    rtt_ms: float = 20.0
    seed: int = 1
    jobs: int = 2
    reverse_lossy: bool = True  # the cell's loss model on the ACK path too (paper-like; sim's default: none)
    task_prompts: int = 32
    task_rhos: tuple[float, ...] = (0.6, 0.8, 1.0)
    task_schemes: tuple[str, ...] = TASK_SCHEMES
    context_tokens: int = 1500
    max_new_tokens: int = 24
    overhead_realizations: int = 3
    reliable_realizations: int = 20  # tcp/quic runs per cell, real time over an emulated link (issue: >= 20)
    reliable_configs: tuple[str, ...] = ("main",)  # loss configs whose cells also get real tcp/quic runs
    reliable_rhos: tuple[float, ...] = (0.8,)  # real time: 120 runs here already take ~6 of the 45 min
    congestion: tuple[str, ...] = CONGESTION_CONTROLS  # one tcp row per kernel congestion control
    grid_rtts_ms: tuple[float, ...] = (5.0, 20.0, 50.0, 100.0, 200.0)
    grid_tokens: tuple[int, ...] = (192, 384, 1536, 4096)
    grid_rhos: tuple[float, ...] = (0.6, 0.8, 1.0)
    grid_schemes: tuple[str, ...] = GRID_SCHEMES
    grid_realizations: int = 6  # per grid cell (0 skips the grid)
    scheduler_realizations: int = 50  # DDQN vs heuristic per held-out condition (lab/sched_eval; 0 skips)
    grid_auto: bool = True  # the priorityfec --precision auto row, scored by credited utility
    overhead_rhos: tuple[float, ...] = ABLATION_RHOS
    precision_prompts: int = 32  # fidelity stage prompts (0 skips it)
    precision_rhos: tuple[float, ...] = PRECISION_RHOS
    precision_variants: tuple[str, ...] = PRECISION_VARIANTS
    # Trace cells (lab/eval/traces.py): Mahimahi files, each scaled to trace_target_mbps and at its own rate.
    trace_files: tuple[str, ...] = ()
    trace_target_mbps: float = 100.0
    trace_rho: float = 0.8
    trace_realizations: int = 6  # per trace cell, each from its own start in the trace (0 skips them)
    command: str = "pfec eval"

    def __post_init__(self) -> None:
        if self.realizations < 1:
            raise ValueError(f"--realizations must be >= 1, got {self.realizations}")
        if self.headline_realizations < 1:
            raise ValueError(f"--headline-realizations must be >= 1, got {self.headline_realizations}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if min(self.task_prompts, self.overhead_realizations, self.reliable_realizations,
               self.grid_realizations) < 0:
            raise ValueError(
                "--task-prompts, --overhead-realizations, --reliable-realizations and --grid-realizations "
                "must be >= 0 (0 skips that stage)"
            )
        if self.scheduler_realizations == 1 or self.scheduler_realizations < 0:
            raise ValueError("--scheduler-realizations must be 0 (skip) or >= 2 (a paired CI needs two), "
                             f"got {self.scheduler_realizations}")
        for cc in self.congestion:
            if cc not in CONGESTION_CONTROLS:
                raise ValueError(f"--congestion {cc!r}: use {' or '.join(CONGESTION_CONTROLS)}")
        if any(rtt < 0 for rtt in self.grid_rtts_ms) or any(t < 1 for t in self.grid_tokens):
            raise ValueError("--grid-rtts must be >= 0 ms and --grid-tokens >= 1")
        if self.trace_realizations < 0 or not self.trace_target_mbps > 0 or not self.trace_rho > 0:
            raise ValueError("--trace-realizations must be >= 0, --trace-target-mbps and the trace rho > 0")
        if self.precision_prompts < 0:
            raise ValueError(f"--precision-prompts must be >= 0 (0 skips it), got {self.precision_prompts}")
        bad = [v for v in self.precision_variants if v not in PRECISION_VARIANTS]
        if bad or (self.precision_prompts and REFERENCE_VARIANT not in self.precision_variants):
            raise ValueError(f"--precision-variants {','.join(self.precision_variants)}: choose from "
                             f"{', '.join(PRECISION_VARIANTS)}, with {REFERENCE_VARIANT} (the reference)")
        for rho in (*self.rhos, *self.task_rhos, *self.overhead_rhos, *self.reliable_rhos, *self.grid_rhos,
                    *self.precision_rhos):
            if not rho > 0:
                raise ValueError(f"rho {rho!r} must be positive (e.g. --rhos 0.6,0.8,1.0,1.2)")
        known = {*ALL_SCHEMES, *SCHEMES, *REFERENCE_SCHEMES, *(f"{s}@deadline" for s in SCHEMES)}
        unknown = [s for s in (*self.schemes, *self.task_schemes, *self.grid_schemes) if s not in known]
        if unknown:
            raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; choose from {', '.join(ALL_SCHEMES)}")
        if not self.configs:
            raise ValueError("--configs is empty; give e.g. main,milder,burstier,trace")

    def realizations_of(self, config_name: str, rho: float) -> int:
        """Paired realizations of one cell: more in the headline cell, where the claims are checked."""
        headline = config_name == HEADLINE[0] and math.isclose(rho, HEADLINE[1])
        return self.headline_realizations if headline else self.realizations

    def load_profile(self, n_layers: int = 30) -> UtilityProfile:
        if self.profile == "synthetic":
            return synthetic_profile(n_layers)
        return UtilityProfile.load(self.profile)

    def main_loss_spec(self) -> str:
        """The loss spec of the ``main`` config (as given in ``configs``, else the named default)."""
        return dict(self.configs).get("main", NAMED_CONFIGS["main"])

    def reliable_rows(self, names: Sequence[str]) -> list[ReliableRow]:
        """The real-transport rows of ``names``: one per congestion control for TCP, one for QUIC."""
        rows = []
        for name in names:
            if RELIABLE_SCHEMES[name].protocol == "tcp":
                rows += [ReliableRow(name, cc) for cc in self.congestion]
            else:
                rows.append(ReliableRow(name, None))
        return rows

    def sim_config(self, loss: LossModel, rho: float, profile: UtilityProfile, rtt_ms: float | None = None,
                   tokens: int | None = None, precision: str = "native") -> SimConfig:
        """A cell's simulator config; the loss model on both directions unless ``reverse_lossy`` is off."""
        return SimConfig(
            loss=loss,
            rate_mbps=self.rate_mbps,
            rtt_ms=self.rtt_ms if rtt_ms is None else rtt_ms,
            rho=rho,
            tokens=self.tokens if tokens is None else tokens,
            reverse_loss=loss if self.reverse_lossy else None,
            profile=profile,
            seed=self.seed,
            precision=precision,
        )


SMALL = EvalConfig(
    realizations=2,
    headline_realizations=2,
    rhos=(0.8,),
    configs=(("main", NAMED_CONFIGS["main"]),),
    profile="synthetic",
    tokens=384,
    task_prompts=0,
    precision_prompts=0,
    overhead_realizations=1,
    overhead_rhos=(0.8,),
    reliable_realizations=2,
    reliable_rhos=(0.8,),
    grid_rtts_ms=(20.0, 200.0),
    grid_tokens=(192,),
    grid_rhos=(0.8,),
    grid_realizations=2,
    scheduler_realizations=2,
    command="pfec eval --small",
)


def default_trace_files() -> tuple[str, ...]:
    """The trace files ``pfec eval`` uses unless told: ``$PFEC_TRACES_DIR``, else a ``shared/traces``
    folder beside the checkout (the LTE traces of the development machines), else none."""
    folder = Path(os.environ.get("PFEC_TRACES_DIR") or REPO.parent / "shared" / "traces")
    if not folder.is_dir():
        return ()
    return tuple(str(p) for p in sorted(folder.iterdir())
                 if p.is_file() and not p.name.startswith(".") and p.suffix.lower() not in (".md", ".txt"))


def parse_configs(text: str) -> tuple[tuple[str, str], ...]:
    """``main,trace`` or ``NAME=SPEC`` items (e.g. ``capture=trace:my.trace``) -> (name, spec) pairs."""
    out = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if "=" in item:
            name, spec = item.split("=", 1)
        elif item in NAMED_CONFIGS:
            name, spec = item, NAMED_CONFIGS[item]
        else:
            raise ValueError(
                f"--configs item {item!r} is neither one of {', '.join(NAMED_CONFIGS)} nor "
                "NAME=SPEC (e.g. mine=ge:0.001,0.5,0.02,0.1 or cap=trace:PATH)"
            )
        parse_loss_spec(spec)  # bad spec or unreadable trace: fail now with the channel's message
        out.append((name.strip(), spec.strip()))
    return tuple(out)


# --------------------------------------------------------------------------- scheme availability


def scheme_status(names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(available schemes, {missing scheme: why}); nothing is substituted here."""
    available: list[str] = []
    missing: dict[str, str] = {}
    for name in names:
        if name in REFERENCE_SCHEMES or name in RELIABLE or name in ARQ_SCHEMES:
            available.append(name)
            continue
        base = whole_deadline_base(name) or name  # <scheme>@deadline needs what its scheme needs
        if base not in SCHEMES:
            missing[name] = "not registered in common/sched/policies.py SCHEMES"
            continue
        try:
            get_scheme(base).make_policy()
        except Exception as exc:  # e.g. a DDQN whose weights are not trained yet
            missing[name] = f"cannot build its policy: {exc}"
            continue
        available.append(name)
    return available, missing


def stand_in(name: str, available: Sequence[str]) -> str | None:
    """The scheme that runs for ``name``: itself, its documented fallback, or None."""
    if name in available:
        return name
    fallback = FALLBACK.get(name)
    if fallback is None or (whole_deadline_base(fallback) or fallback) not in SCHEMES:
        return None
    return fallback


def scheme_definitions(names: Sequence[str], congestion: Sequence[str] = CONGESTION_CONTROLS,
                       ) -> list[dict[str, str | bool]]:
    """What each scheme of ``names`` is and whether it is one of the paper's baselines, from the scheme
    tables themselves (``SCHEMES``' descriptions, ``ARQ_SCHEMES``, ``RELIABLE_SCHEMES``); the report prints
    these rows as they are."""
    out: list[dict[str, str | bool]] = []
    for name in dict.fromkeys(names):
        if name in ARQ_SCHEMES:
            arq = ARQ_SCHEMES[name]
            role = "paper baseline" if arq.paper_baseline else "reference (ours)"
            out.append({"scheme": name, "role": role, "paper_baseline": arq.paper_baseline,
                        "definition": arq.definition})  # fmt: skip
        elif name in RELIABLE_SCHEMES:
            rel = RELIABLE_SCHEMES[name]
            ccs = f"; one row per congestion control ({', '.join(congestion)})"
            ccs = ccs if rel.protocol == "tcp" else ""
            role = "paper baseline" if rel.paper_baseline else "reference (ours)"
            out.append({"scheme": name, "role": role, "paper_baseline": rel.paper_baseline,
                        "definition": rel.describe() + ccs})  # fmt: skip
        elif name == "oracle":
            out.append({"scheme": name, "role": "bound", "paper_baseline": False,
                        "definition": REFERENCE_SCHEMES["oracle"]})  # fmt: skip
        elif name in KNOWN_RATE_SCHEMES:
            out.append({"scheme": name, "role": "idealised reference (trace cells)", "paper_baseline": False,
                        "definition": REFERENCE_SCHEMES[name]})  # fmt: skip
        elif (base := whole_deadline_base(name)) is not None:
            out.append({"scheme": name, "role": "ours (the daemons' repair rule)", "paper_baseline": False,
                        "definition": f"{SCHEMES[base].description}; repair budget: the whole deadline "
                        "(repairs while the receiver lacks symbols and one can still arrive; idle slots "
                        "carry them), not the cell's fixed fraction"})  # fmt: skip
        elif name in SCHEMES:
            role = ("paper baseline" if name in PAPER_SESSION_BASELINES
                    else "paper ablation variant" if name in PAPER_ABLATION_VARIANTS
                    else "the method" if name == "priorityfec" else "ours")  # fmt: skip
            out.append({"scheme": name, "role": role, "paper_baseline": name in PAPER_SESSION_BASELINES,
                        "definition": SCHEMES[name].description})  # fmt: skip
    return out
