"""``pfec receiver serve``: the receiver daemon on its UDP socket, behind its control API and metrics
endpoint, from a ``ReceiverDaemonConfig``, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pfec.common.node.config import ReceiverDaemonConfig
from pfec.common.node.lifecycle import load_node_model, measure_node_speed, run_node
from pfec.common.node.profiles import ProfileStore
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.receiver.metrics import ReceiverMetrics
from pfec.receiver.session import ReceiverConfig

log = logging.getLogger("pfec.receiver")


async def serve(config: ReceiverDaemonConfig, psk: bytes, token: str | None = None,
                ready: Callable[[ReceiverDaemon], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run a receiver from ``config`` until SIGINT/SIGTERM (or ``stop``); ``ready`` once it serves."""
    runtime, identity = await load_node_model(config.model, config.limits.prefix_cache_bytes)
    limits = config.limits
    daemon = ReceiverDaemon(
        identity, psk, runtime=runtime,
        session_config=ReceiverConfig(max_sessions=limits.max_sessions,
                                      max_session_bytes=limits.max_session_bytes,
                                      max_budget_s=limits.max_budget_ms / 1000),
        metrics=ReceiverMetrics(), default_mode=config.reconstruction, limits=limits,
        profiles=ProfileStore(config.profiles.directory, config.profiles.max_bytes),
    )
    await daemon.start(config.udp.host, config.udp.port, config.udp.rcvbuf_bytes, config.udp.sndbuf_bytes,
                       config.udp.multicast_group, config.udp.multicast_interface)

    def announce(daemon: ReceiverDaemon) -> None:
        log.info("receiver ready: model %s, fingerprint %s, UDP %s:%d", identity.model_id,
                 daemon.fingerprint.hex()[:16], *daemon.address)
        if ready is not None:
            ready(daemon)

    await measure_node_speed(runtime, daemon.metrics)  # pfec_prefill_tokens_per_second, short lengths
    await daemon.measure_prefill_speed()  # the curve its ACCEPTs state (the sender's planner uses it)
    await run_node(daemon, receiver_routes(daemon), config, token, announce, stop)
