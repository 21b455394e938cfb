"""Helper processes of the lab's real-time runs (`pfec demo`, `pfec bench transport`): a receiver daemon and
the link emulator's UDP relay, each spawned in its own process with its own core and event loop.

A ``Child`` speaks a tiny protocol over a pipe: the child sends ``("ready", address)`` once it listens,
answers each "snapshot" with ``("snapshot", {...})`` (a receiver's stats so far) and runs until the parent
sends "stop", then answers ``("stats", {...})`` (or ``("error", text)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np

from pfec.common.codec.fec import warm_up
from pfec.common.model.runtime import load_runtime
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.kvlayout import KVGeometry
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig, parse_loss
from pfec.lab.emulator.relay import UdpRelay
from pfec.receiver.daemon import ReceiverDaemon

__all__ = ["LOOPBACK_PSK", "Child", "raise_priority"]

LOOPBACK_PSK: Final = bytes(range(1, 33))  # loopback only; the daemons of a real deployment read a key file


def raise_priority(niceness: int = -10) -> bool:
    """Best effort: the packet paths must not queue behind other work on a busy machine (root only)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
        return True
    except (PermissionError, OSError):
        return False


async def _until_parent_says_stop(conn: Connection,
                                  snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
    """Serve the parent until it says "stop"; a "snapshot" is answered with ``("snapshot", snapshot())``."""
    loop = asyncio.get_running_loop()
    while True:
        readable = asyncio.Event()
        loop.add_reader(conn.fileno(), readable.set)
        await readable.wait()
        loop.remove_reader(conn.fileno())
        message = conn.recv()
        if message == "snapshot" and snapshot is not None:
            conn.send(("snapshot", snapshot()))
            continue
        return


async def _receiver_child(conn: Connection, model: str, psk: bytes, host: str = "127.0.0.1",
                          geometry: KVGeometry | None = None) -> None:
    warm_up()
    runtime, identity = load_runtime(model, synthetic_geometry=geometry)
    daemon = ReceiverDaemon(identity, psk, runtime=runtime)
    await daemon.start(host, 0)
    cpu0, thread0 = time.process_time(), time.thread_time()

    def stats() -> dict[str, Any]:
        late = np.asarray(daemon.stats.deadline_late_s, dtype=float)
        return {
            "process_cpu_s": time.process_time() - cpu0,
            "loop_thread_cpu_s": time.thread_time() - thread0,
            "monotonic_s": time.monotonic(),
            "datagrams_received": daemon.stats.received,
            "bytes_received": daemon.stats.bytes_received,
            "deadline_late_s": late.tolist(),
            "drops": dict(daemon.endpoint.drops),
            "codec_cpu_ns": daemon.cpu.decode_ns + daemon.cpu.feedback_ns,
            "results": list(daemon.results),
        }

    conn.send(("ready", daemon.address))
    await _until_parent_says_stop(conn, stats)
    conn.send(("stats", stats()))
    await daemon.close()


async def _relay_child(conn: Connection, forward_to: tuple[str, int], rate_bps: float, owd_s: float,
                       loss: str, seed: int) -> None:
    config = EmulatorConfig(
        forward=DirectionSpec(rate_bps, owd_s, parse_loss(loss)),
        reverse=DirectionSpec(rate_bps, owd_s, None),
        seed=seed,
    )
    async with UdpRelay(config, ("127.0.0.1", 0), forward_to) as relay:
        conn.send(("ready", relay.listen_address))
        await _until_parent_says_stop(conn)
        conn.send(("stats", relay.stats()))


_ROLES: Final[dict[str, Callable[..., Coroutine[Any, Any, None]]]] = {
    "receiver": _receiver_child,
    "relay": _relay_child,
}


def _serve_child(conn: Connection, role: str, kwargs: dict[str, Any]) -> None:
    """Entry point of a spawned child: run ``role``'s coroutine on uvloop until the parent says stop."""
    factory = _ROLES[role]
    raise_priority()
    try:
        run_event_loop(factory(conn, **kwargs))
    except BaseException as exc:  # report, never hang the parent
        with contextlib.suppress(Exception):
            conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
        raise


class Child:
    """A spawned helper process speaking a tiny protocol over a pipe: ready(address) ... stop -> stats."""

    def __init__(self, role: str, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve_child, args=(child_conn, role, kwargs), daemon=True,
                                   name=f"pfec-{role}")
        self.role = role
        self.process.start()

    def wait_ready(self, timeout_s: float = 120.0) -> Any:
        try:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"the {self.role} process did not start within {timeout_s:.0f} s")
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the {self.role} process exited during start-up "
                               f"(exit code {self.process.exitcode})") from None
        if kind != "ready":
            raise RuntimeError(str(value))
        return value

    def snapshot(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The child's stats now, while it keeps running (a receiver's: CPU, datagrams, drops)."""
        self.conn.send("snapshot")
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the {self.role} process did not answer a snapshot within {timeout_s:.0f} s")
        kind, value = self.conn.recv()
        if kind != "snapshot":
            raise RuntimeError(f"{self.role} process: {value}")
        return dict(value)

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        try:
            self.conn.send("stop")
            if self.conn.poll(timeout_s):
                kind, value = self.conn.recv()
                stats = value if kind == "stats" else {"error": value}
        except (BrokenPipeError, EOFError, OSError):
            stats = {"error": f"{self.role} process died"}
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        return stats

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
