"""A node with both roles: the sender daemon and the receiver daemon in one process, on one model worker,
one OpenAI face (and so one prefix cache store), one metrics registry and one control API.

The two daemons stay as they are (``sender/daemon.py``, ``receiver/daemon.py``); this room above them
hands each the parts they share instead of letting each make its own:

- one ``ModelWorker``: prefill for handoffs, rebuilds at deadlines and the OpenAI API's generation queue
  behind one thread, so two model jobs never run at once on the node's CPUs;
- one ``OpenAIFace`` with its ``PrefixStore``: a conversation the node served, a cache it rebuilt from a
  handoff, and a handoff of a conversation it continued all meet in the same store;
- one registry: each role's ``pfec_sender_*`` / ``pfec_receiver_*`` series, and the node's own facts
  (prefill speed, torch threads, the prefix cache store, serving refusals) once, under the receiver's
  names (``NodeMetrics(shared=...)``);
- one control API: the node's ``/healthz``, ``/readyz``, ``/metrics`` and the OpenAI API, then every
  other route of the two roles (``POST /handoffs``, ``GET /sessions``...); a route both roles define is an
  error at start-up, never a silent shadow.

The receiving UDP socket is the receiver's; each handoff the node sends leaves from a socket of its own
(``sender/pacer.py``), as the sender daemon's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from pfec.common.node.control import node_routes
from pfec.common.node.openai.http import OpenAIFace
from pfec.common.node.profiles import ProfileStore
from pfec.common.node.worker import ModelWorker
from pfec.common.plan.handoff import ModelIdentity
from pfec.node.config import NodeDaemonConfig
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.receiver.metrics import ReceiverMetrics
from pfec.receiver.session import ReceiverConfig
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon
from pfec.sender.metrics import SenderMetrics

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime


class NodeDaemon:
    """The sender and the receiver of one node, sharing its model worker, face, store and registry."""

    def __init__(self, config: NodeDaemonConfig, identity: ModelIdentity, psk: bytes, *,
                 runtime: ModelRuntime | None = None, process_metrics: bool = True) -> None:
        limits = config.limits
        self.config = config
        self.identity = identity
        self.runtime = runtime
        self.worker = ModelWorker("pfec-node", limits.worker_queue, limits.worker_stuck_s)
        registry = CollectorRegistry()
        self.receiver_metrics = ReceiverMetrics(registry, process_metrics=process_metrics)
        self.sender_metrics = SenderMetrics(registry, process_metrics=False, shared=self.receiver_metrics)
        self.face = None if runtime is None else OpenAIFace(
            runtime, self.worker, self.receiver_metrics, limits, max_json_depth=limits.max_json_depth)
        profiles = ProfileStore(config.profiles.directory, config.profiles.max_bytes)
        self.receiver = ReceiverDaemon(
            identity, psk, runtime=runtime,
            session_config=ReceiverConfig(max_sessions=limits.max_sessions,
                                          max_session_bytes=limits.max_session_bytes,
                                          max_budget_s=limits.max_budget_ms / 1000),
            metrics=self.receiver_metrics, default_mode=config.reconstruction, limits=limits,
            profiles=profiles, worker=self.worker, face=self.face,
        )
        self.sender = SenderDaemon(
            identity, psk, runtime=runtime, rate_mbps=config.link.rate_mbps, owd_ms=config.link.owd_ms,
            scheme=config.fec.scheme, window_cap=config.fec.window_cap,
            repair_budget=config.fec.repair_budget,
            loss_prior=config.fec.loss_prior, rate_control=config.link.rate_control,
            max_rate_mbps=config.link.max_rate_mbps, sndbuf=config.udp.sndbuf_bytes,
            metrics=self.sender_metrics, limits=limits, profiles=profiles, worker=self.worker, face=self.face,
            multicast_groups=config.udp.multicast_group, multicast_interface=config.udp.multicast_interface,
            multicast_ttl=config.udp.multicast_ttl,
        )
        self.fingerprint = self.receiver.fingerprint

    @property
    def metrics(self) -> ReceiverMetrics:
        """The metrics whose registry holds the node's every series (``/metrics`` exposes it whole)."""
        return self.receiver_metrics

    @property
    def address(self) -> tuple[str, int]:
        """The receiving UDP socket's address."""
        return self.receiver.address

    async def start(self) -> None:
        """Open the receiving UDP socket (``[udp]``)."""
        udp = self.config.udp
        await self.receiver.start(udp.host, udp.port, udp.rcvbuf_bytes, udp.sndbuf_bytes, udp.multicast_group,
                                  udp.multicast_interface)

    async def close(self) -> None:
        """Cancel the handoffs in flight (each receiver gets a CLOSE), let running rebuilds finish, then stop
        the model worker."""
        try:
            await self.sender.close()
            await self.receiver.close()
        finally:
            self.worker.shutdown()

    # ------------------------------------------------------------------ control API
    def health(self) -> dict[str, Any]:
        """Liveness (``/healthz``): the receiving role's view, with the sending role's handoffs."""
        sending = self.sender.health()
        return {**self.receiver.health(), "role": "node", "active_handoffs": sending["active_handoffs"],
                "handoffs": sending["handoffs"]}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (``/readyz``): red while the model worker runs a job past ``limits.worker_stuck_s``."""
        return self.worker.readiness("node")

    def routes(self) -> list[web.RouteDef]:
        """The node's routes, then every other route of the sending and the receiving role, once each."""
        return merge_routes(
            [*node_routes(self), *(self.face.routes() if self.face is not None else [])],
            sender_routes(self.sender), receiver_routes(self.receiver),
        )


def merge_routes(own: list[web.RouteDef], sending: list[web.RouteDef],
                 receiving: list[web.RouteDef]) -> list[web.RouteDef]:
    """``own`` (what the node serves once for both roles), then the roles' other routes. A route of the
    roles that ``own`` has is left out (each role mounts the shared ones too); a route both roles define
    and ``own`` does not is a ValueError: one role's would shadow the other's."""
    taken = {(r.method, r.path) for r in own}
    sender_own = {(r.method, r.path) for r in sending} - taken
    both = sender_own & {(r.method, r.path) for r in receiving}
    if both:
        raise ValueError(f"both roles define {', '.join(f'{m} {p}' for m, p in sorted(both))}")
    return [*own, *(r for r in [*sending, *receiving] if (r.method, r.path) not in taken)]
