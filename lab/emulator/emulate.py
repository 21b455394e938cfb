"""`pfec emulate`: a user-space link emulator (rate, one-way delay, seeded loss) for real UDP traffic.

The link model and its timed delivery are in ``link``; the front ends that put real traffic through it
are ``relay.UdpRelay`` (a UDP relay, no privileges), ``fanout.FanoutRelay`` (the relay with several
receivers: one uplink, then a branch per receiver) and ``netns.TunBridge`` (TUN devices between two
network namespaces, root). This module runs one of them as a long-lived process:
until SIGINT/SIGTERM or a duration, with periodic counters on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any, Literal, TypeVar

from pfec.common.node.eventloop import run_event_loop
from pfec.common.node.signals import stop_on_signals
from pfec.lab.emulator.fanout import Branch, FanoutRelay
from pfec.lab.emulator.link import EmulatorConfig
from pfec.lab.emulator.netns import (
    NetnsSpec,
    TunBridge,
    netns_available,
    setup_namespaces,
    teardown_namespaces,
)
from pfec.lab.emulator.relay import UdpRelay

__all__ = ["EmulatorMode", "emulate", "format_stats"]

EmulatorMode = Literal["relay", "netns"]
T = TypeVar("T")
Front = UdpRelay | FanoutRelay | TunBridge

def format_stats(t: float, stats: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> str:
    """One line of counters per direction, with the rates since the previous line; a fan-out relay's
    uplink, then each receiver's branch."""
    if "uplink" in stats:
        lines = [format_stats(t, stats["uplink"], prev["uplink"] if prev else None, dt) + " (uplink)"]
        for i, r in enumerate(stats["receivers"]):
            before = prev["receivers"][i] if prev else None
            lines.append(format_stats(t, r, before, dt) + f" (receiver {i} {r['address']})")
        return "\n".join(lines)
    parts = [f"t={t:7.1f}s"]
    for name in ("forward", "reverse"):
        s = stats[name]
        p = prev[name] if prev else {"delivered": 0, "bytes_out": 0}
        pps = (s["delivered"] - p["delivered"]) / dt if dt > 0 else 0.0
        mbps = (s["bytes_out"] - p["bytes_out"]) * 8 / dt / 1e6 if dt > 0 else 0.0
        parts.append(
            f"{name[:3]}: in {s['received']} out {s['delivered']} lost {s['lost']} qdrop {s['queue_dropped']}"
            f" err {s['send_errors']} ({pps:.0f} pps, {mbps:.2f} Mbit/s)"
        )
    return " | ".join(parts)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _announce(front: Front, forward_to: tuple[str, int]) -> None:
    if isinstance(front, FanoutRelay):
        host, port = front.listen_address
        _log(f"fan-out relay: group port {host}:{port}")
        for (h, p), b in zip(front.receiver_addresses, front.branches, strict=True):
            _log(f"  receiver port {h}:{p} -> {b.address[0]}:{b.address[1]}")
    elif isinstance(front, UdpRelay):
        host, port = front.listen_address
        _log(f"relay listening on {host}:{port}, forwarding to {forward_to[0]}:{forward_to[1]}")
    else:
        spec = front.spec
        _log(f"bridging {spec.ns_a} ({spec.addr_a}) <-> {spec.ns_b} ({spec.addr_b}) on {spec.dev}")


async def _run_front(
    mode: EmulatorMode,
    config: EmulatorConfig,
    listen: tuple[str, int],
    forward_to: tuple[str, int],
    spec: NetnsSpec,
    stats_interval: float,
    duration: float,
    quiet: bool,
    branches: tuple[Branch, ...],
    multicast_interface: str | None,
) -> dict[str, Any]:
    stop = asyncio.Event()
    front: Front
    if mode == "netns":
        front = TunBridge(config, spec)
    elif len(branches) > 1:
        front = FanoutRelay(config, listen, branches)
    else:
        front = UdpRelay(config, listen, forward_to, multicast_interface=multicast_interface)
    with stop_on_signals(stop):
        return await _relay_until_stopped(front, forward_to, stop, stats_interval, duration, quiet)


async def _relay_until_stopped(
    front: Front,
    forward_to: tuple[str, int],
    stop: asyncio.Event,
    stats_interval: float,
    duration: float,
    quiet: bool,
) -> dict[str, Any]:
    async with front:
        _announce(front, forward_to)
        t0 = time.monotonic()
        cpu0 = time.process_time()
        prev: dict[str, Any] | None = None
        last = t0
        while not stop.is_set():
            wait = stats_interval if stats_interval > 0 else 3600.0
            if duration > 0:
                wait = min(wait, max(0.0, t0 + duration - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)
            now = time.monotonic()
            if stats_interval > 0 and not quiet:
                stats = front.stats()
                _log(format_stats(now - t0, stats, prev, now - last))
                prev, last = stats, now
            if duration > 0 and now - t0 >= duration:
                break
        stats = front.stats()
        # Process CPU (all threads) over the run: what an emulated datagram costs, cf. DESIGN's ~26 us.
        stats["elapsed_s"] = round(time.monotonic() - t0, 3)
        stats["cpu_s"] = round(time.process_time() - cpu0, 3)
        return stats


def emulate(
    mode: EmulatorMode,
    config: EmulatorConfig,
    listen: tuple[str, int],
    forward_to: tuple[str, int],
    spec: NetnsSpec,
    stats_interval: float = 1.0,
    duration: float = 0.0,
    quiet: bool = False,
    keep_namespaces: bool = False,
    branches: tuple[Branch, ...] = (),
    multicast_interface: str | None = None,
) -> dict[str, Any]:
    """Emulate the link until SIGINT/SIGTERM (or ``duration`` s); the final counters.

    Relay mode with several ``branches`` fans out (``fanout.FanoutRelay``: ``config`` is the uplink's, the
    branches carry each receiver's delay and loss); otherwise ``forward_to`` is the one receiver. A
    multicast ``listen`` group is joined on ``multicast_interface`` (``relay.join_group``).
    netns mode creates the two namespaces first and removes them afterwards unless ``keep_namespaces``.
    Raises OSError when the front end cannot start (netns mode without root, a port in use, ...).
    ``quiet`` leaves out the periodic counter lines (stderr).
    """
    created = False
    try:
        if mode == "netns":
            ok, why = netns_available()
            if not ok:
                raise OSError(f"--mode netns: {why}; use --mode relay instead")
            setup_namespaces(spec)
            created = True
        return run_event_loop(
            _run_front(mode, config, listen, forward_to, spec, stats_interval, duration, quiet,
                       branches, multicast_interface)
        )
    finally:
        if created and not keep_namespaces:
            teardown_namespaces(spec)
