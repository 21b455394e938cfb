"""``pfec node serve``'s configuration: one file for a node with both roles, loaded like the daemons'
(``common/node/config.py``: defaults < the TOML file < ``PFEC_NODE__<SECTION>__<KEY>`` variables < systemd's
credentials and cache directory), every error naming the field, the value and the fix.

Its tables are the sender's and the receiver's together: ``[udp]`` is the node's one receiving socket
(0.0.0.0:7400 by default; each handoff it sends leaves from a socket of its own), ``[control]`` its one
control API, ``[metrics]`` its one Prometheus endpoint, ``[link]`` and ``[fec]`` its sending role's pacing
and repair defaults, ``reconstruction`` its receiving role's default rebuild, and ``[limits]`` both roles'
bounds (``NodeLimitsConfig``): the model worker, the OpenAI face and the prefix cache store are the node's
one each, so their limits are stated once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from pydantic import Field

from pfec.common.node.config import (
    ControlConfig,
    LimitsConfig,
    MetricsConfig,
    ReceiverDaemonConfig,
    SenderDaemonConfig,
    SenderLimitsConfig,
    UdpConfig,
    load_daemon_config,
)

__all__ = ["ENV_PREFIX", "NodeDaemonConfig", "NodeLimitsConfig", "load_node_config"]

ENV_PREFIX: Final = "PFEC_NODE__"
NODE_SOCKET: Final = Path("/run/pfec/node.sock")
NODE_METRICS_PORT: Final = 9402
# Merged under the file's values: a partial [udp] table must not reset the port (as for the daemons).
_SECTION_DEFAULTS: Final[dict[str, dict[str, Any]]] = {
    "udp": {"port": 7400},
    "control": {"socket": str(NODE_SOCKET)},
    "metrics": {"port": NODE_METRICS_PORT},
}


class NodeLimitsConfig(SenderLimitsConfig, LimitsConfig):
    """Both roles' limits: the sender's request bounds and destinations, the receiver's admission limits,
    and what the two share once (the model worker's queue, the OpenAI face, the prefix cache store)."""


class NodeDaemonConfig(SenderDaemonConfig, ReceiverDaemonConfig):
    """`pfec node serve`: both roles in one process, on one model worker, prefix store and control API."""

    udp: UdpConfig = Field(
        default_factory=lambda: UdpConfig(), description="The receiving socket (0.0.0.0:7400 by default)."
    )
    control: ControlConfig = Field(
        default_factory=lambda: ControlConfig(socket=NODE_SOCKET),
        description="Control API: the sender's and the receiver's routes and the OpenAI API, once.",
    )
    metrics: MetricsConfig = Field(
        default_factory=lambda: MetricsConfig(port=NODE_METRICS_PORT), description="Prometheus endpoint."
    )
    limits: NodeLimitsConfig = Field(
        default_factory=lambda: NodeLimitsConfig(), description="Both roles' bounds."
    )


def load_node_config(path: Path | None, env: Mapping[str, str]) -> NodeDaemonConfig:
    """Defaults < TOML file ``path`` < ``PFEC_NODE__...`` variables of ``env`` -> a validated config;
    ``ConfigError`` (print ``str(exc)``) otherwise."""
    return load_daemon_config(NodeDaemonConfig, "node", ENV_PREFIX, _SECTION_DEFAULTS, path, env)
