"""What ``pfec sender serve`` and ``pfec receiver serve`` share around their daemon: compile the codec and
load the model before anything listens, then run the control API and the metrics endpoint until
SIGINT/SIGTERM, and take it all down in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

from aiohttp import web

from pfec.common.codec import fec
from pfec.common.model.runtime import check_prefix_budget, load_runtime, torch_threads
from pfec.common.node.config import DaemonConfig, ModelConfig, SenderDaemonConfig
from pfec.common.node.control import MAX_BODY_BYTES, ControlServer
from pfec.common.node.metrics import NodeMetrics
from pfec.common.node.signals import wait_for_signal
from pfec.common.plan.handoff import ModelIdentity

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime


class NodeDaemon(Protocol):
    """What ``run_node`` needs of a daemon."""

    @property
    def metrics(self) -> NodeMetrics: ...

    async def close(self) -> None: ...


D = TypeVar("D", bound=NodeDaemon)


async def load_node_model(model: ModelConfig, prefix_cache_bytes: int = 0,
                          ) -> tuple[ModelRuntime | None, ModelIdentity]:
    """Compile the codec kernels, then load and warm the configured model in a thread (seconds). On a GPU,
    a prefix cache store budget (``limits.prefix_cache_bytes``) larger than the device's free memory is a
    ValueError before anything listens."""
    fec.warm_up()
    loaded = await asyncio.get_running_loop().run_in_executor(
        None, partial(load_runtime, model.path, model.device, model.cache_dir,
                      torch_threads=model.torch_threads)
    )
    check_prefix_budget(loaded[0], prefix_cache_bytes)
    return loaded


#: Context lengths timed at start-up for the prefill-speed metric: short, so start-up stays fast (the
#: planner's stored curve comes from a longer measurement, ``breakeven.DEFAULT_MODEL_PREFILL``).
STARTUP_SPEED_LENGTHS = (64, 256)


async def measure_node_speed(runtime: ModelRuntime | None, metrics: NodeMetrics) -> float | None:
    """Time this node's prefill at ``STARTUP_SPEED_LENGTHS`` in a thread and export it as
    ``pfec_prefill_tokens_per_second``; None (and 0 exported) without a model or a model too short."""
    if runtime is None:
        metrics.prefill_speed(0.0)
        metrics.torch_threads(0)
        return None
    from pfec.common.model.speed import measure_prefill_speed  # deferred: torch

    metrics.torch_threads(torch_threads())  # as load_runtime set it

    try:
        speed = await asyncio.get_running_loop().run_in_executor(
            None, measure_prefill_speed, runtime, STARTUP_SPEED_LENGTHS)
    except ValueError:  # the model's context is shorter than the lengths
        metrics.prefill_speed(0.0)
        return None
    tokens_per_second = speed.tokens_per_second(STARTUP_SPEED_LENGTHS[-1])
    metrics.prefill_speed(tokens_per_second)
    return tokens_per_second


async def run_node(daemon: D, routes: list[web.RouteDef], config: DaemonConfig, token: str | None = None,
                   ready: Callable[[D], None] | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve ``routes`` on the configured control sockets and the metrics endpoint, call ``ready``, wait
    for SIGINT/SIGTERM (or ``stop``), then close the control API, the metrics endpoint and the daemon."""
    max_body = config.limits.max_request_bytes if isinstance(config, SenderDaemonConfig) else MAX_BODY_BYTES
    control = ControlServer(routes, max_body)
    await control.start(config.control.socket, config.control.tcp_address, token)
    metrics_runner = None
    if config.metrics.enabled:
        metrics_runner = await daemon.metrics.serve(config.metrics.host, config.metrics.port)
    if ready is not None:
        ready(daemon)
    try:
        await wait_for_signal(stop)
    finally:
        await control.close()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await daemon.close()
