"""``pfec node serve``: a node with both roles (``node/daemon.py``) on its receiving UDP socket, behind its
one control API and metrics endpoint, from a ``NodeDaemonConfig``, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pfec.common.node.lifecycle import load_node_model, measure_node_speed, run_node
from pfec.node.config import NodeDaemonConfig
from pfec.node.daemon import NodeDaemon

log = logging.getLogger("pfec.node")


async def serve(config: NodeDaemonConfig, psk: bytes, token: str | None = None,
                ready: Callable[[NodeDaemon], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run a node from ``config`` until SIGINT/SIGTERM (or ``stop``); ``ready`` once it serves."""
    runtime, identity = await load_node_model(config.model, config.limits.prefix_cache_bytes)
    node = NodeDaemon(config, identity, psk, runtime=runtime)
    routes = node.routes()  # a route both roles define fails here, before anything listens
    await node.start()

    def announce(node: NodeDaemon) -> None:
        log.info("node ready: model %s, fingerprint %s, UDP %s:%d", identity.model_id,
                 node.fingerprint.hex()[:16], *node.address)
        if ready is not None:
            ready(node)

    try:
        await measure_node_speed(runtime, node.metrics)  # pfec_prefill_tokens_per_second, short lengths
        await node.receiver.measure_prefill_speed()  # the curve its ACCEPTs state (senders' planners use it)
    except BaseException:
        await node.close()
        raise
    await run_node(node, routes, config, token, announce, stop)
