"""The long-running kernel TCP neighbour of `pfec bench fairness`: a bulk sender and a sink, one process each.

``python -m pfec.lab.pathbench.tcp_bulk ROLE JSON`` (stdlib only, started with ``ip netns exec NS``, so the
sockets are the namespace's real kernel TCP). The sink binds, prints one JSON ready line with its port,
accepts one connection and reads (discarding) until the sender closes or ``duration_s`` and a grace period
have passed. The sender sets ``TCP_CONGESTION`` (cubic, bbr: the driver checked the kernel offers it),
connects, writes zeros for ``duration_s`` (or until SIGINT) as fast as the socket takes them, and resets
the connection.
Each prints one JSON result line with its CPU time; the bytes through the bottleneck are counted in the
emulator, by flow, not here.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Final

__all__ = ["ROLES"]

_CHUNK: Final = 1 << 16
_ACCEPT_TIMEOUT_S: Final = 30.0
_GRACE_S: Final = 5.0


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({**obj, "cpu_s": round(time.process_time(), 3)}) + "\n")
    sys.stdout.flush()


def _sink(p: dict[str, Any]) -> None:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((str(p["host"]), int(p["port"])))
    lsock.listen(1)
    lsock.settimeout(_ACCEPT_TIMEOUT_S)
    _emit({"ready": True, "port": lsock.getsockname()[1]})
    got = 0
    with contextlib.suppress(OSError):  # no connection, or reset by the sender at its end
        conn, _ = lsock.accept()
        give_up = time.monotonic() + float(p["duration_s"]) + _GRACE_S
        buf = bytearray(1 << 20)
        conn.settimeout(0.5)
        with conn:
            while time.monotonic() < give_up:
                try:
                    n = conn.recv_into(buf)
                except TimeoutError:
                    continue
                if n == 0:
                    break
                got += n
    lsock.close()
    _emit({"received": got})


def _bulk(p: dict[str, Any]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, str(p["congestion_control"]).encode())
    congestion = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()
    data = memoryview(bytes(_CHUNK))
    sent = 0
    started = time.monotonic()
    end = started + float(p["duration_s"])
    with contextlib.suppress(OSError, KeyboardInterrupt):  # KeyboardInterrupt: the driver's SIGINT, stop
        sock.settimeout(_ACCEPT_TIMEOUT_S)
        sock.connect((str(p["host"]), int(p["port"])))
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                sent += sock.send(data)
            except TimeoutError:
                break
    # Abort (RST): what is still queued in the socket must not trickle through after the run.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + bytes(4))
    sock.close()
    _emit({"sent": sent, "congestion_control": congestion, "started": started})


ROLES: Final[dict[str, Callable[[dict[str, Any]], None]]] = {"sink": _sink, "bulk": _bulk}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ROLES:
        sys.exit(f"usage: python -m pfec.lab.pathbench.tcp_bulk {{{','.join(ROLES)}}} JSON")
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
