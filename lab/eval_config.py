"""What `pfec eval` runs: its configuration, the named loss configs, the schemes and the report's constants.

``EvalConfig`` holds every knob of the evaluation (``SMALL`` is the CI size); the constants here are shared
by the stages (``eval_sweep``, ``eval_task``, ``eval_overhead``), their orchestration (``evaluate``) and the
report (``eval_report``), so none of those imports another for a name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile, synthetic_profile
from pfec.common.sched.policies import SCHEMES, get_scheme
from pfec.lab.channel import LossModel, parse_loss_spec
from pfec.lab.sim import REFERENCE_SCHEMES, SimConfig

__all__ = [
    "SMALL",
    "EvalConfig",
    "parse_configs",
    "scheme_status",
    "stand_in",
]

REPO: Final = Path(__file__).resolve().parent.parent
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
    "rl-fec",
    "heuristic",
    "priorityfec",
    "oracle",
)
RELIABLE = ("tcp", "quic")  # real transport runs (lab/reliable.py), not slot-simulator schemes
TASK_SCHEMES = ("udp", "priority", "heuristic", "priorityfec")
ABLATION_SCHEMES = ("priority", "rl-fec", "priority-fixed", "priorityfec")
ABLATION_RHOS = (0.8, 1.0)
FALLBACK = {"priorityfec": "heuristic"}  # stands in (and says so) while the DDQN is absent
MODES = ("mask", "zero")
RESULTS_BEGIN = "<!-- BEGIN pfec eval (generated: rerun `pfec eval` to replace this part) -->"
RESULTS_END = "<!-- END pfec eval -->"
PAPER = {"utility_rho08": 0.991, "best_baseline_rho08": 0.823, "gain_points": 16.8}
HEADLINE = ("main", 0.8)  # the headline cell: main GE config, rho 0.8


@dataclass(frozen=True)
class EvalConfig:
    realizations: int = 20
    headline_realizations: int = 100  # realizations of the HEADLINE cell (the claims are made there)
    rhos: tuple[float, ...] = SWEEP_RHOS
    configs: tuple[tuple[str, str], ...] = tuple(NAMED_CONFIGS.items())  # (name, loss spec)
    schemes: tuple[str, ...] = ALL_SCHEMES
    profile: str = str(SHIPPED_PROFILE)  # a profile JSON path or "synthetic"
    tokens: int = 1536
    rate_mbps: float = 100.0
    rtt_ms: float = 20.0
    seed: int = 1
    jobs: int = 2
    task_prompts: int = 4
    task_rhos: tuple[float, ...] = (0.6, 0.8, 1.0)
    task_schemes: tuple[str, ...] = TASK_SCHEMES
    context_tokens: int = 1500
    max_new_tokens: int = 24
    overhead_realizations: int = 3
    reliable_realizations: int = 5  # tcp/quic run in real time over an emulated link: slow, so fewer
    reliable_configs: tuple[str, ...] = ("main",)  # loss configs whose cells also get real tcp/quic runs
    overhead_rhos: tuple[float, ...] = ABLATION_RHOS
    command: str = "pfec eval"

    def __post_init__(self) -> None:
        if self.realizations < 1:
            raise ValueError(f"--realizations must be >= 1, got {self.realizations}")
        if self.headline_realizations < 1:
            raise ValueError(f"--headline-realizations must be >= 1, got {self.headline_realizations}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if min(self.task_prompts, self.overhead_realizations, self.reliable_realizations) < 0:
            raise ValueError(
                "--task-prompts, --overhead-realizations and --reliable-realizations must be >= 0 "
                "(0 skips that stage)"
            )
        for rho in (*self.rhos, *self.task_rhos, *self.overhead_rhos):
            if not rho > 0:
                raise ValueError(f"rho {rho!r} must be positive (e.g. --rhos 0.6,0.8,1.0,1.2)")
        known = {*ALL_SCHEMES, *SCHEMES, *REFERENCE_SCHEMES}
        unknown = [s for s in (*self.schemes, *self.task_schemes) if s not in known]
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

    def sim_config(self, loss: LossModel, rho: float, profile: UtilityProfile) -> SimConfig:
        return SimConfig(
            loss=loss,
            rate_mbps=self.rate_mbps,
            rtt_ms=self.rtt_ms,
            rho=rho,
            tokens=self.tokens,
            profile=profile,
            seed=self.seed,
        )


SMALL = EvalConfig(
    realizations=2,
    headline_realizations=2,
    rhos=(0.8,),
    configs=(("main", NAMED_CONFIGS["main"]),),
    profile="synthetic",
    tokens=384,
    task_prompts=0,
    overhead_realizations=1,
    overhead_rhos=(0.8,),
    reliable_realizations=0,
    command="pfec eval --small",
)


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
        if name in REFERENCE_SCHEMES or name in RELIABLE:
            available.append(name)
            continue
        if name not in SCHEMES:
            missing[name] = "not registered in common/sched/policies.py SCHEMES"
            continue
        try:
            get_scheme(name).make_policy()
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
    return fallback if fallback in SCHEMES else None
