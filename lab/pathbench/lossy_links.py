"""`pfec bench rate-control`'s lossy-link rows: is channel loss taken for a slower link? (issue: a lossy
link's whole rate)

The same nodes and relay as the told-rate rows (:mod:`.rate_control`), the sender told the link's own rate.
The channel loses ``LOSS_PERCENTS`` of the datagrams after the bottleneck's queue (the relay's loss stage
follows its queue), Bernoulli or bursty (Gilbert-Elliott: ``GE_GOOD_LOSS`` in the good state,
``GE_BAD_LOSS`` in the bad one, which lasts ``1 / GE_LEAVE_BAD`` datagrams on average; the good state's
length sets the mean). Each loss share has a deadline of ``LOSS_RHOS`` times the serialisation time.

Per link rate, loss and seed: ``path`` (the measuring controller) and the reference ``fixed`` (paced at the
link's rate, the paper's setting told the truth). A path row gives the **link use**: the bytes its data
datagrams offered at the bottleneck over the link's capacity, from its first data datagram to its last
(the sender stops once the receiver is ready, or at the deadline). Targets: use >= ``USE_TARGET``,
queueing-delay P95 <= ``DELAY_TARGET_MS``, no queue drops, every source symbol decoded and the receiver
started when ready.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.sim.channel import parse_loss_spec

LOSS_PERCENTS: Final = (10.0, 17.0, 25.0)
LOSS_RHOS: Final = (1.3, 1.4, 1.5)  # the deadline for each share, in serialisation times
LOSS_LINKS_MBPS: Final = (50.0, 100.0)
LOSS_KINDS: Final = ("bernoulli", "ge")
GE_GOOD_LOSS: Final = 0.01
GE_BAD_LOSS: Final = 0.6
GE_LEAVE_BAD: Final = 0.1  # bad spells of 10 datagrams on average
USE_TARGET: Final = 0.95
DELAY_TARGET_MS: Final = 50.0


@dataclass(frozen=True)
class LossyRows:
    """Which lossy cells run: each link rate, loss share (with its deadline) and kind, per seed."""

    links_mbps: Sequence[float] = LOSS_LINKS_MBPS
    percents: Sequence[float] = LOSS_PERCENTS
    rhos: Sequence[float] = LOSS_RHOS
    kinds: Sequence[str] = LOSS_KINDS
    seeds: int = 3

    def __post_init__(self) -> None:
        if len(self.rhos) != len(self.percents):
            raise ValueError(f"give one deadline (rho) per loss share: {len(self.percents)} shares, "
                             f"{len(self.rhos)} rhos")
        for pct in self.percents:
            if not 0 < pct < 50:
                raise ValueError(f"a loss share is a percentage in (0, 50), got {pct!r}")
        for rho in self.rhos:
            if not 1 <= rho <= 10:
                raise ValueError(f"a deadline (rho) is 1-10 serialisation times, got {rho!r}")
        for kind in self.kinds:
            if kind not in LOSS_KINDS:
                raise ValueError(f"a loss kind is one of {', '.join(LOSS_KINDS)}, got {kind!r}")
        for link in self.links_mbps:
            if not link > 0:
                raise ValueError(f"a link rate is a positive number of Mbit/s, got {link!r}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be at least 1, got {self.seeds!r}")

    def cells(self) -> list[tuple[float, str, float, float]]:
        """(link Mbit/s, kind, loss %, rho) of every cell, in the order run."""
        return [(link, kind, pct, rho) for link in self.links_mbps
                for pct, rho in zip(self.percents, self.rhos, strict=True) for kind in self.kinds]


def loss_spec(kind: str, percent: float) -> str:
    """The relay's loss model for ``percent`` of the datagrams lost, Bernoulli or Gilbert-Elliott."""
    share = percent / 100
    if kind == "bernoulli":
        return f"bernoulli:{share:g}"
    bad = (share - GE_GOOD_LOSS) / (GE_BAD_LOSS - GE_GOOD_LOSS)  # the stationary share of the bad state
    enter_bad = bad * GE_LEAVE_BAD / (1 - bad)
    return f"ge:{GE_GOOD_LOSS:g},{GE_BAD_LOSS:g},{enter_bad:.5f},{GE_LEAVE_BAD:g}"


def lossy_link(link_mbps: float, spec: str, rtt_ms: float, queue_packets: int, seed: int) -> EmulatorConfig:
    owd = rtt_ms / 2000
    forward = DirectionSpec(link_mbps * 1e6, owd, parse_loss_spec(spec), queue_packets=queue_packets)
    return EmulatorConfig(forward, DirectionSpec(link_mbps * 1e6, owd), seed=seed)


def link_use(sent: dict[str, float] | None, link_mbps: float) -> float | None:
    """The data bytes offered at the bottleneck over its capacity while the sender sent (None: fixed)."""
    if sent is None or sent["span_s"] <= 0:
        return None
    return sent["bytes"] * 8 / (link_mbps * 1e6 * sent["span_s"])


RowOf = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


class Nodes(Protocol):
    """What the rows need of :class:`.rate_control.PathBenchNodes`: one relayed handoff."""

    def handoff(self, link: EmulatorConfig, told_mbps: float, control: str, tokens: int,
                deadline_ms: float | None, rho: float | None = None,
                ) -> tuple[dict[str, Any], dict[str, Any], dict[str, float] | None]: ...


def run_lossy_rows(nodes: Nodes, rows: LossyRows, tokens: int, rtt_ms: float,
                   queue_packets: Callable[[float], int], handoff_row: RowOf,
                   progress: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Every lossy cell, path and fixed, once per seed (see the module doc); ``handoff_row`` keeps what a
    row of the bench keeps of a handoff's report and the relay's forward counters."""
    out: list[dict[str, Any]] = []
    for seed in range(1, rows.seeds + 1):
        for link_mbps, kind, pct, rho in rows.cells():
            spec = loss_spec(kind, pct)
            for control in ("path", "fixed"):
                link = lossy_link(link_mbps, spec, rtt_ms, queue_packets(link_mbps), seed)
                report, forward, sent = nodes.handoff(link, link_mbps, control, tokens, None, rho=rho)
                carried = forward["received"] - forward["queue_dropped"]
                out.append({
                    "link_mbps": link_mbps, "loss_kind": kind, "loss_percent": pct, "loss": spec, "rho": rho,
                    "deadline_ms": report.get("deadline_ms"), "control": control, "seed": seed,
                    **handoff_row(report, forward),
                    "channel_loss": forward["lost"] / carried if carried else None,
                    "decoded_symbols": report.get("decoded_symbols"), "n_source": report.get("n_source"),
                    "link_use": link_use(sent, link_mbps),
                    "loss_floor": (report.get("path_rate") or {}).get("loss_floor"),
                })
                if progress is not None:
                    progress()
    return out


def everything_ready(row: dict[str, Any]) -> bool:
    """Every source symbol decoded and the receiver started when ready (not at the deadline)."""
    n = row.get("n_source")
    return row.get("start") == "ready" and n is not None and row.get("decoded_symbols") == n


def lossy_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    path = [r for r in rows if r["control"] == "path"]
    fixed = [r for r in rows if r["control"] == "fixed"]
    uses = [r["link_use"] for r in path if r["link_use"] is not None]
    return {
        "path_link_use_min": min(uses, default=None),
        "path_queue_delay_ms_p95_max": max((r["queue_delay_ms_p95"] or 0.0 for r in path), default=None),
        "path_queue_drop_share_max": max((r["queue_drop_share"] for r in path), default=None),
        "path_ready": sum(everything_ready(r) for r in path),
        "fixed_ready": sum(everything_ready(r) for r in fixed),
        "rows_per_control": len(path),
        "use_target": USE_TARGET, "delay_target_ms": DELAY_TARGET_MS,
    }


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def lossy_lines(result: dict[str, Any]) -> list[str]:
    """The lossy rows' section of the report."""
    rows, t = result.get("lossy_rows") or [], result.get("lossy_targets")
    if not rows or t is None:
        return []
    inp = result["lossy_inputs"]
    lines = [
        "## Lossy links",
        "",
        "The channel loses datagrams after the bottleneck's queue: Bernoulli, or bursty (Gilbert-Elliott, "
        f"{inp['ge_good_loss']:g} lost in the good state, {inp['ge_bad_loss']:g} in the bad one, bad spells "
        f"of {1 / inp['ge_leave_bad']:g} datagrams on average). Sender told the link's rate; deadline rho "
        f"times the serialisation time; {inp['tokens']} tokens; {inp['seeds']} seeds. `fixed` paces at the "
        "link's rate (the reference). Link use: the data bytes offered at the bottleneck over its capacity "
        "while the sender sent (path rows).",
        "",
        "| link Mbit/s | loss | measured loss | rho | control | seed | decoded | start | link use "
        "| queue drops | queue delay p95 ms | estimate Mbit/s | loss floor | utility |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        decoded = f"{r['decoded_symbols']}/{r['n_source']}" if r["n_source"] is not None else "-"
        lines.append(
            f"| {r['link_mbps']:g} | {r['loss_kind']} {r['loss_percent']:g}% | {_pct(r['channel_loss'])} | "
            f"{r['rho']:g} | {r['control']} | {r['seed']} | {decoded} | {r['start'] or '-'} | "
            f"{_pct(r['link_use'])} | {r['queue_drop_share']:.1%} | {r['queue_delay_ms_p95'] or 0:.1f} | "
            f"{'-' if r['estimate_mbps'] is None else r['estimate_mbps']} | "
            f"{'-' if r['loss_floor'] is None else r['loss_floor']} | {(r['recovered_utility'] or 0):.4f} |")
    lines += [
        "",
        f"Path rows: lowest link use {_pct(t['path_link_use_min'])} (target >= {t['use_target']:.0%}), "
        f"highest queueing-delay P95 {t['path_queue_delay_ms_p95_max'] or 0:.1f} ms "
        f"(target <= {t['delay_target_ms']:g}), highest queue drop share "
        f"{_pct(t['path_queue_drop_share_max'])} (target none). Everything decoded and the receiver started "
        f"when ready: path {t['path_ready']} of {t['rows_per_control']}, fixed reference {t['fixed_ready']} "
        f"of {t['rows_per_control']}.",
        "",
    ]
    return lines
