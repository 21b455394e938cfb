"""Helper processes of the lab's real-time runs (`pfec demo`, `pfec bench ...`): a receiver daemon and the
link emulator's UDP relay, each spawned in its own process with its own event loop.

Two nodes on one machine, honestly: ``node_cpu_sets`` splits this process's CPUs into the receiver's set
and the sender's (which the relay shares); a ``Child`` given ``cpus`` runs on that set only, with as many
torch threads, and the parent runs on the sender's set (``pinned``) for the duration of a run.

A ``Child`` speaks a tiny protocol over a pipe, one answer per request, in order:

- the child, once it listens: ``("ready", address)``;
- ``"snapshot"`` -> ``("snapshot", {...})``: its stats so far (a receiver's; a relay's link counters),
  with ``"cpus"``, the CPUs the child runs on;
- ``("local_prefill", inputs: ContextInput, runs: int)`` -> ``("local_prefill", {...})`` (a receiver with
  a model; ``local_prefill_ttft``'s dict): the receiver's alternative to a handoff, timed in the receiver
  with its loaded model on its own CPUs; served between handoffs;
- ``"stop"`` -> ``("stats", {...})``, then the child exits;
- anything else, or a request that fails -> ``("error", text)``, and the child keeps serving. A child that
  fails outright sends ``("error", text)`` and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from pfec.common.codec.fec import warm_up
from pfec.common.model.runtime import load_runtime, usable_cpus
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.kvlayout import KVGeometry
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig, parse_loss
from pfec.lab.emulator.relay import UdpRelay
from pfec.receiver.daemon import ReceiverDaemon
from pfec.sender.kv import ContextInput, prompt_ids

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

__all__ = ["LOOPBACK_PSK", "Child", "CpuQuota", "NodeCpus", "local_prefill_ttft", "node_cpu_sets", "pinned",
           "raise_priority", "relay_link"]

LOOPBACK_PSK: Final = bytes(range(1, 33))  # loopback only; the daemons of a real deployment read a key file
MAX_LOCAL_RUNS: Final = 20

Node = Literal["receiver", "sender", "relay"]
#: A request handler of a child: the request's arguments in, the answer's value out.
Handler = Callable[..., Awaitable[Any]]


def raise_priority(niceness: int = -10) -> bool:
    """Best effort: the packet paths must not queue behind other work on a busy machine (root only)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
        return True
    except (PermissionError, OSError):
        return False


# --- CPU sets -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeCpus:
    """The CPUs of the two nodes of a run on one machine: the receiver's, and the sender's, which the link
    emulator's relay shares. Disjoint when ``pinned``; otherwise every node runs on all of them (``why``)."""

    receiver: tuple[int, ...]
    sender: tuple[int, ...]
    pinned: bool
    why: str = ""

    def pin(self, node: Node) -> tuple[int, ...] | None:
        """The CPU set ``node`` is to be pinned to, or None where nothing is pinned."""
        if not self.pinned:
            return None
        return self.receiver if node == "receiver" else self.sender

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"receiver": list(self.receiver), "sender": list(self.sender),
                               "relay": list(self.sender), "pinned": self.pinned}
        if not self.pinned:
            out["why"] = self.why
        return out


def node_cpu_sets(allowed: Collection[int] | None = None) -> NodeCpus:
    """Split ``allowed`` (default: the CPUs this process may run on) into two halves: the receiver gets the
    upper half, the sender and relay the lower, and the odd CPU (two processes run there). Under 2 CPUs
    nothing can be kept apart: not pinned, and said so."""
    if allowed is None:
        try:
            allowed = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # no affinity API here: nothing can be pinned
            every = tuple(range(os.cpu_count() or 1))
            return NodeCpus(every, every, False, "this platform cannot pin a process to CPUs")
    cpus = tuple(sorted(set(allowed)))
    if not cpus:
        raise ValueError("node_cpu_sets: no CPUs given")
    if len(cpus) < 2:
        return NodeCpus(cpus, cpus, False, f"{len(cpus)} CPU available: the nodes share it")
    half = (len(cpus) + 1) // 2
    return NodeCpus(receiver=cpus[half:], sender=cpus[:half], pinned=True)


def _pin_all_threads(cpus: Collection[int]) -> None:
    """Every thread of this process on ``cpus``: Linux keeps one mask per thread, and the threads started
    before (torch's pool, executors) would keep the old one; a thread started later inherits its
    creator's."""
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        tids = [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that has just exited
            os.sched_setaffinity(tid, cpus)


def _torch_threads(threads: int | None) -> int | None:
    """Set torch's intra-op threads to ``threads`` where torch is loaded (never loads it); the count
    before (None: torch not loaded)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    before = int(torch.get_num_threads())
    if threads is not None:
        torch.set_num_threads(threads)
    return before


@contextlib.contextmanager
def pinned(cpus: Collection[int] | None) -> Iterator[None]:
    """This process (every thread) on ``cpus`` with as many torch threads, both restored on exit; None:
    left as it is (``NodeCpus.pin`` of an unpinned run)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    threads_before = _torch_threads(len(cpus))
    _pin_all_threads(cpus)
    try:
        yield
    finally:
        _pin_all_threads(before)
        _torch_threads(threads_before or len(before))


def _take_cpus(cpus: Collection[int]) -> None:
    """A child's first act: its CPU set, and as many threads for OpenMP/MKL (read when torch is first
    imported, later in the child) and for torch if it is already loaded."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(len(cpus))
    _pin_all_threads(cpus)
    _torch_threads(len(cpus))


def _cpus_now() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# --- CPU quota (a slower node on a fast machine) --------------------------------------------------------

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
#: The quota's period: short, so a throttled node runs in 10 ms slices rather than stalling for tens of ms
#: at a time (the kernel's default period is 100 ms).
QUOTA_PERIOD_US: Final = 10_000


class CpuQuota:
    """A cgroup holding at most ``share`` CPUs' worth of time per ``QUOTA_PERIOD_US`` (0.5: half a CPU)
    for the processes ``add``-ed: a node ``1 / share`` times slower on a one-CPU set, whatever the
    processor. The ``cpu`` controller of cgroup v1 (``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` under
    ``/sys/fs/cgroup/cpu``) or v2 (``cpu.max``); it needs write access there (root). ``close`` moves what
    is left to the parent group and removes the group."""

    def __init__(self, share: float, name: str, root: Path = CGROUP_ROOT) -> None:
        if not (isinstance(share, int | float) and 0.01 <= share <= 64):
            raise ValueError(f"CPU quota {share!r}: a share of CPUs in 0.01..64 (0.5: half a CPU)")
        quota_us = max(1000, round(share * QUOTA_PERIOD_US))
        v1 = root / "cpu"
        try:
            if (v1 / "cpu.cfs_quota_us").exists():
                self.path, self.version = v1 / name, 1
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
            elif (root / "cgroup.controllers").exists():
                if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
                    (root / "cgroup.subtree_control").write_text("+cpu")
                self.path, self.version = root / name, 2
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.max").write_text(f"{quota_us} {QUOTA_PERIOD_US}")
            else:
                raise ValueError(f"CPU quota: no cgroup cpu controller under {root} (v1 {v1}, or v2)")
        except OSError as exc:
            raise ValueError(f"CPU quota: cannot set up a cgroup under {root} ({exc.strerror}); it needs "
                             "the cpu controller and write access there (root)") from None
        self.share = quota_us / QUOTA_PERIOD_US

    def add(self, pid: int) -> None:
        """Move process ``pid`` (every thread, and what it starts later) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Move any process left to the parent group, then remove the group (best effort)."""
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.path.parent / "cgroup.procs").write_text(pid)
            self.path.rmdir()

    def to_json(self) -> dict[str, Any]:
        return {"cpus": self.share, "period_us": QUOTA_PERIOD_US, "cgroup": str(self.path),
                "cgroup_version": self.version}


# --- Local prefill (the receiver's alternative) ---------------------------------------------------------


def local_prefill_ttft(runtime: ModelRuntime, inputs: ContextInput, runs: int = 2,
                       threads: int | None = None) -> dict[str, Any]:
    """The receiver's alternative, timed on a loaded model: prefill the whole prompt and produce the first
    token (context prefill + question forward); the fastest of ``runs``, on the calling thread's CPUs with
    ``threads`` torch threads (None: as set). Torch's thread count is the calling thread's own: set here,
    where the work runs, not where it was asked for."""
    from pfec.common.model import llm  # deferred: torch, only in a process that holds a model
    from pfec.common.model.speed import torch_threads  # deferred: torch

    context_ids, question_ids = prompt_ids(runtime, inputs)
    times = []
    load = os.getloadavg()[0]
    with torch_threads(threads) as used:
        for _ in range(runs):
            started = time.perf_counter()
            cache, _ = llm.prefill(runtime, context_ids)
            prefill_s = time.perf_counter() - started
            gen = llm.generate(runtime, llm.partial_from_cache(cache, None, "mask"), question_ids, 1)
            times.append(prefill_s + gen.ttft_s)
    return {"ttft_s": round(min(times), 6), "runs_s": [round(t, 6) for t in times],
            "load_average_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
            "cpus": _cpus_now(), "torch_threads": used}


# --- The child's side -----------------------------------------------------------------------------------


async def _next_message(conn: Connection) -> Any:
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(conn.fileno(), readable.set)
    try:
        await readable.wait()
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


def _split_request(message: Any) -> tuple[str | None, tuple[Any, ...]]:
    """(kind, arguments) of a request: a bare kind ("snapshot") or a tuple (kind, *arguments)."""
    if isinstance(message, str):
        return message, ()
    if isinstance(message, tuple) and message and isinstance(message[0], str):
        return message[0], message[1:]
    return None, ()


async def _until_parent_says_stop(conn: Connection, role: str, handlers: Mapping[str, Handler]) -> None:
    """Answer the parent's requests with ``(kind, handler(*arguments))`` until it says "stop"; an unknown
    request, or one whose handler raises, is answered ``("error", text)`` and serving goes on."""
    while True:
        try:
            message = await _next_message(conn)
        except (EOFError, OSError):
            raise  # the parent is gone: the child ends
        except Exception as exc:  # an unreadable message: say so, never hang the parent
            conn.send(("error", f"{role}: unreadable request: {type(exc).__name__}: {exc}"))
            continue
        kind, args = _split_request(message)
        if kind == "stop":
            return
        handler = handlers.get(kind) if kind is not None else None
        if handler is None:
            conn.send(("error", f"{role}: unknown request {message!r:.100}"))
            continue
        try:
            conn.send((kind, await handler(*args)))
        except Exception as exc:
            conn.send(("error", f"{role}: {kind}: {type(exc).__name__}: {exc}"))


def _local_prefill_handler(runtime: ModelRuntime | None) -> Handler:
    async def local_prefill(inputs: ContextInput, runs: int) -> dict[str, Any]:
        if runtime is None:
            raise ValueError("this receiver has no model (synthetic KV)")
        if not isinstance(inputs, ContextInput):
            raise TypeError(f"inputs must be a ContextInput, got {type(inputs).__name__}")
        if not isinstance(runs, int) or not 1 <= runs <= MAX_LOCAL_RUNS:
            raise ValueError(f"runs must be 1..{MAX_LOCAL_RUNS}, got {runs!r}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, local_prefill_ttft, runtime, inputs, runs, usable_cpus())

    return local_prefill


async def _receiver_child(conn: Connection, model: str, psk: bytes, host: str = "127.0.0.1",
                          geometry: KVGeometry | None = None) -> None:
    warm_up()
    runtime, identity = load_runtime(model, synthetic_geometry=geometry)
    daemon = ReceiverDaemon(identity, psk, runtime=runtime)
    await daemon.start(host, 0)
    await daemon.measure_prefill_speed()  # before "ready": its ACCEPTs state it, no handoff competes
    cpu0, thread0 = time.process_time(), time.thread_time()

    def stats() -> dict[str, Any]:
        late = np.asarray(daemon.stats.deadline_late_s, dtype=float)
        return {
            "process_cpu_s": time.process_time() - cpu0,
            "loop_thread_cpu_s": time.thread_time() - thread0,
            "monotonic_s": time.monotonic(),
            "cpus": _cpus_now(),
            "datagrams_received": daemon.stats.received,
            "bytes_received": daemon.stats.bytes_received,
            "deadline_late_s": late.tolist(),
            "drops": dict(daemon.endpoint.drops),
            "codec_cpu_ns": daemon.cpu.decode_ns + daemon.cpu.feedback_ns,
            "results": list(daemon.results),
        }

    async def snapshot() -> dict[str, Any]:
        return stats()

    conn.send(("ready", daemon.address))
    await _until_parent_says_stop(conn, "receiver", {"snapshot": snapshot,
                                                     "local_prefill": _local_prefill_handler(runtime)})
    conn.send(("stats", stats()))
    await daemon.close()


def relay_link(rate_bps: float, owd_s: float, loss: str, seed: int) -> EmulatorConfig:
    """A fixed-rate link both ways, ``loss`` (``parse_loss``'s spec) forward only: the demo's and the
    break-even bench's emulated path."""
    return EmulatorConfig(
        forward=DirectionSpec(rate_bps, owd_s, parse_loss(loss)),
        reverse=DirectionSpec(rate_bps, owd_s, None),
        seed=seed,
    )


async def _relay_child(conn: Connection, forward_to: tuple[str, int], link: EmulatorConfig) -> None:
    async with UdpRelay(link, ("127.0.0.1", 0), forward_to) as relay:
        async def snapshot() -> dict[str, Any]:
            return {**relay.stats(), "cpus": _cpus_now()}

        conn.send(("ready", relay.listen_address))
        await _until_parent_says_stop(conn, "relay", {"snapshot": snapshot})
        conn.send(("stats", relay.stats()))


_ROLES: Final[dict[str, Callable[..., Coroutine[Any, Any, None]]]] = {
    "receiver": _receiver_child,
    "relay": _relay_child,
}


def _serve_child(conn: Connection, role: str, kwargs: dict[str, Any], cpus: tuple[int, ...] | None) -> None:
    """Entry point of a spawned child: take its CPUs (before any thread or model), then run ``role``'s
    coroutine on uvloop until the parent says stop."""
    try:
        if cpus is not None:
            _take_cpus(cpus)
        factory = _ROLES[role]
        raise_priority()
        run_event_loop(factory(conn, **kwargs))
    except BaseException as exc:  # report, never hang the parent
        with contextlib.suppress(Exception):
            conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
        raise


# --- The parent's side ----------------------------------------------------------------------------------


class Child:
    """A spawned helper process speaking the module's protocol over a pipe: ready(address), requests
    (snapshot, local_prefill), stop -> stats. ``cpus``: the CPU set it runs on (None: this process's)."""

    def __init__(self, role: str, cpus: Collection[int] | None = None, cpu_quota: CpuQuota | None = None,
                 **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.cpus = tuple(sorted(cpus)) if cpus is not None else None
        self.process = ctx.Process(target=_serve_child, args=(child_conn, role, kwargs, self.cpus),
                                   daemon=True, name=f"pfec-{role}")
        self.role = role
        self.cpu_quota = cpu_quota  # closed with the child (``stop``, ``kill``)
        self.process.start()
        if cpu_quota is not None:  # before the child has loaded anything: its start-up speed is the quota's
            assert self.process.pid is not None
            cpu_quota.add(self.process.pid)

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

    def request(self, kind: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Send a request and wait for its answer's value; RuntimeError on an ("error", text) answer, no
        answer within ``timeout_s`` (the child is then out of step: stop it) or a dead child."""
        try:
            self.conn.send((kind, *args) if args else kind)
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"the {self.role} process did not answer {kind!r} within "
                                   f"{timeout_s:.0f} s")
            answer, value = self.conn.recv()
        except (BrokenPipeError, EOFError, OSError):
            raise RuntimeError(f"the {self.role} process died (exit code {self.process.exitcode})") from None
        if answer != kind:
            raise RuntimeError(f"{self.role} process: {value}")
        return value

    def snapshot(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The child's stats now, while it keeps running (a receiver's: CPU, datagrams, drops; its CPUs)."""
        return dict(self.request("snapshot", timeout_s=timeout_s))

    def local_prefill(self, inputs: ContextInput, runs: int = 2, timeout_s: float = 900.0) -> dict[str, Any]:
        """A receiver's local prefill of ``inputs`` timed in its process, on its CPUs (between handoffs)."""
        return dict(self.request("local_prefill", inputs, runs, timeout_s=timeout_s))

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
        if self.cpu_quota is not None:
            self.cpu_quota.close()
        return stats

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self.cpu_quota is not None:
            self.cpu_quota.close()
