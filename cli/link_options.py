"""The link options the lab commands share (`pfec sim`, `pfec emulate`): a trace-driven link, its
bottleneck queue, the rate the sender is told and its rate control."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pfec.lab.sim.rate_trace import RateTrace, constant_trace, load_rate_trace, queue_limit_bytes

RateTraceOpt = Annotated[Path | None, typer.Option(
    help="Forward link rate from a Mahimahi trace (one line per 1,500-byte delivery opportunity, in ms; it "
    "loops) behind a drop-tail bottleneck; --rate-mbps is then the rate the sender paces at.")]
RateScaleOpt = Annotated[float, typer.Option(
    help="With --rate-trace: opportunities per line (K: a K times faster link of the same shape).")]
QueueMsOpt = Annotated[float | None, typer.Option(
    help="With --rate-trace (`pfec sim`: or a bottleneck): the bottleneck's depth in ms at the link's mean "
    "rate (default 100).")]
QueueBytesOpt = Annotated[int | None, typer.Option(
    help="With --rate-trace (`pfec sim`: or a bottleneck): the bottleneck's depth in bytes (instead of "
    "--queue-ms).")]
TOLD_HELP = ("The rate the sender is told, Mbit/s (default: --rate-mbps): it paces at it (--rate-control "
             "fixed) or starts measuring from it (path); told another rate, the link is a drop-tail "
             "bottleneck at --rate-mbps.")
RATE_CONTROL_HELP = ("fixed: pace at the told rate (the paper) | path: the sender's rate controller "
                     "(PathRate: delivery-rate and min-RTT estimates, probing, congestion response) paces "
                     "into a drop-tail bottleneck.")


def trace_link(path: Path | None, scale: float, queue_ms: float | None,
                queue_bytes: int | None) -> tuple[RateTrace | None, int | None]:
    """The trace-driven link the options describe and its bottleneck depth in bytes (None, None: a
    fixed-rate link); ValueError naming the option for what does not fit."""
    if path is None:
        if scale != 1.0 or queue_ms is not None or queue_bytes is not None:
            raise ValueError("--rate-scale, --queue-ms and --queue-bytes shape a --rate-trace link: give one")
        return None, None
    trace = load_rate_trace(path, scale)
    return trace, queue_limit_bytes(trace, queue_ms, queue_bytes)


def sim_link(path: Path | None, scale: float, queue_ms: float | None, queue_bytes: int | None,
             rate_mbps: float, queued: bool) -> tuple[RateTrace | None, int | None]:
    """`pfec sim`'s link: a trace and its depth, or (``queued``: a sender pacing at a rate of its own) a
    fixed-rate bottleneck at ``rate_mbps`` whose depth the queue options may size (None: the default)."""
    if path is not None or not queued:
        return trace_link(path, scale, queue_ms, queue_bytes)
    if scale != 1.0:
        raise ValueError("--rate-scale shapes a --rate-trace link: give one")
    if queue_ms is None and queue_bytes is None:
        return None, None
    return None, queue_limit_bytes(constant_trace(rate_mbps), queue_ms, queue_bytes)
