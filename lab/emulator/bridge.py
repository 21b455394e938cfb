"""A multicast LAN of network namespaces (root only): a sender and N receivers joined by a Linux bridge.

``setup_bridge_lan`` creates a hub namespace holding the bridge and one namespace per host, each joined to
the bridge by a veth pair, addressed ``SUBNET.1`` (the sender) and ``SUBNET.2+i`` (receiver i) on a /24,
with a route for 224.0.0.0/4 on the veth, so a datagram sent to a group leaves the sender once and the
bridge replicates it to every member (IGMP snooping on, the kernel's default). The project's emulator puts
each receiver's own losses on its last mile: ``pfec emulate --listen GROUP:PORT --join-on ADDR`` inside the
receiver's namespace joins the group and relays what it keeps to the receiver (``relay.join_group``).
Only the namespaces this module created are touched; nothing is routed to other networks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from pfec.lab.emulator.netns import _NAME_RE, _ip, _ip_ok

__all__ = ["DEV", "BridgeLan", "setup_bridge_lan", "teardown_bridge_lan", "veth_counters"]

DEV: Final = "lan0"  # the veth's name inside each host namespace


@dataclass(frozen=True)
class BridgeLan:
    """The names and addresses of one multicast LAN (``prefix``-hub, -s, -r0 ..)."""

    prefix: str = "pfec-mc"
    receivers: int = 3
    subnet: str = "10.78.0"
    group: str = "239.77.0.1"

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.prefix + "-hub"):
            raise ValueError(f"prefix {self.prefix!r}: 1-11 letters, digits, '_', '.', '-'")
        if not 1 <= self.receivers <= 8:
            raise ValueError(f"receivers must be 1..8, got {self.receivers!r}")

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def sender(self) -> str:
        return f"{self.prefix}-s"

    def receiver(self, i: int) -> str:
        return f"{self.prefix}-r{i}"

    @property
    def namespaces(self) -> list[str]:
        return [self.sender, *(self.receiver(i) for i in range(self.receivers))]

    def address(self, ns: str) -> str:
        """The IPv4 address of a host namespace."""
        return f"{self.subnet}.{self.namespaces.index(ns) + 1}"



def setup_bridge_lan(lan: BridgeLan = BridgeLan()) -> None:
    """Create the hub (bridge up) and every host namespace (loopback and veth up, addressed, routed)."""
    existing = set(_ip("netns", "list").stdout.split())
    clash = [n for n in (lan.hub, *lan.namespaces) if n in existing]
    if clash:
        raise OSError(f"network namespace(s) {', '.join(clash)} already exist: remove them with "
                      "'ip netns del NAME' if they are stale, or choose another prefix")
    try:
        _ip_ok("netns", "add", lan.hub)
        _ip_ok("-n", lan.hub, "link", "add", "br0", "type", "bridge")
        _ip_ok("-n", lan.hub, "link", "set", "br0", "up")
        for k, ns in enumerate(lan.namespaces):
            _ip_ok("netns", "add", ns)
            port = f"p{k}"
            _ip_ok("-n", lan.hub, "link", "add", port, "type", "veth", "peer", "name", DEV,
                   "netns", ns)
            _ip_ok("-n", lan.hub, "link", "set", port, "master", "br0", "up")
            _ip_ok("-n", ns, "addr", "add", f"{lan.address(ns)}/24", "dev", DEV)
            _ip_ok("-n", ns, "link", "set", "lo", "up")
            _ip_ok("-n", ns, "link", "set", DEV, "up")
            _ip_ok("-n", ns, "route", "add", "224.0.0.0/4", "dev", DEV)
    except BaseException:
        teardown_bridge_lan(lan)
        raise


def teardown_bridge_lan(lan: BridgeLan = BridgeLan()) -> None:
    """Delete the LAN's namespaces (missing ones are fine); the veths and the bridge go with them."""
    for ns in (*lan.namespaces, lan.hub):
        _ip("netns", "del", ns)


def veth_counters(lan: BridgeLan, ns: str) -> dict[str, int]:
    """The host veth's kernel counters: tx_packets, rx_packets, tx_bytes, rx_bytes."""
    proc = _ip("-n", ns, "-j", "-s", "link", "show", "dev", DEV)
    if proc.returncode != 0:
        raise OSError(f"cannot read {ns}'s counters: {proc.stderr.strip()}")
    stats: dict[str, Any] = json.loads(proc.stdout)[0]["stats64"]
    return {"tx_packets": int(stats["tx"]["packets"]), "rx_packets": int(stats["rx"]["packets"]),
            "tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])}
