"""``pfec sender serve``: the sender daemon behind its control API and metrics endpoint, from a
``SenderDaemonConfig``, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pfec.common.node.config import SenderDaemonConfig
from pfec.common.node.lifecycle import load_node_model, measure_node_speed, run_node
from pfec.common.node.profiles import ProfileStore
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon
from pfec.sender.metrics import SenderMetrics

log = logging.getLogger("pfec.sender")


async def serve(config: SenderDaemonConfig, psk: bytes, token: str | None = None,
                ready: Callable[[SenderDaemon], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run a sender from ``config`` until SIGINT/SIGTERM (or ``stop``); ``ready`` once it serves."""
    runtime, identity = await load_node_model(config.model, config.limits.prefix_cache_bytes)
    daemon = SenderDaemon(
        identity, psk, runtime=runtime, rate_mbps=config.link.rate_mbps, owd_ms=config.link.owd_ms,
        scheme=config.fec.scheme, window_cap=config.fec.window_cap, repair_budget=config.fec.repair_budget,
        loss_prior=config.fec.loss_prior, rate_control=config.link.rate_control,
        max_rate_mbps=config.link.max_rate_mbps,
        sndbuf=config.udp.sndbuf_bytes, metrics=SenderMetrics(), limits=config.limits,
        profiles=ProfileStore(config.profiles.directory, config.profiles.max_bytes),
        multicast_groups=config.udp.multicast_group, multicast_interface=config.udp.multicast_interface,
        multicast_ttl=config.udp.multicast_ttl,
    )

    def announce(daemon: SenderDaemon) -> None:
        log.info("sender ready: model %s, fingerprint %s", identity.model_id, daemon.fingerprint.hex()[:16])
        if ready is not None:
            ready(daemon)

    await measure_node_speed(runtime, daemon.metrics)  # pfec_prefill_tokens_per_second, short lengths
    await run_node(daemon, sender_routes(daemon), config, token, announce, stop)
