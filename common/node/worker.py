"""The model worker both daemons run their model work on (prefill, rebuild, generation): one thread, a
bounded queue, and a readiness view.

``submit`` refuses (``WorkerBusy``) when ``queue`` jobs already wait or run, so a burst of requests cannot
pile up unbounded work (the sender's control API answers 503). ``stuck(now)`` tells when the running job
has run longer than ``stuck_after_s``: ``/readyz`` turns red then, while ``/healthz`` stays liveness.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["ModelWorker", "WorkerBusy"]

R = TypeVar("R")


class WorkerBusy(RuntimeError):
    """The worker's queue is full: try again later."""


class ModelWorker:
    """A single worker thread with at most ``queue`` jobs queued or running."""

    def __init__(self, name: str, queue: int = 8, stuck_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if queue < 1:
            raise ValueError(f"queue must be >= 1, got {queue!r}")
        self.name = name
        self.queue = queue
        self.stuck_after_s = stuck_after_s
        self.clock = clock
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pending = 0  # jobs submitted and not finished
        self.running_since: float | None = None  # when the job now in the thread started
        self.completed = 0

    def submit(self, fn: Callable[..., R], *args: object, force: bool = False) -> asyncio.Future[R]:
        """Run ``fn(*args)`` in the worker thread; WorkerBusy when the queue is full (``force``: a job whose
        slot was reserved earlier, or the follow-up of an admitted one). Call from the event loop."""
        if self.pending >= self.queue and not force:
            raise WorkerBusy(f"the {self.name} worker has {self.pending} jobs queued (limit {self.queue}); "
                             "retry later")
        self.pending += 1

        def job() -> R:
            self.running_since = self.clock()
            try:
                return fn(*args)
            finally:
                self.running_since = None

        future = asyncio.get_running_loop().run_in_executor(self.executor, job)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: asyncio.Future[R]) -> None:
        self.pending -= 1
        self.completed += 1

    def stuck_for(self, now: float | None = None) -> float | None:
        """Seconds the running job has run beyond ``stuck_after_s``, or None when not stuck."""
        since = self.running_since
        if since is None:
            return None
        ran = (self.clock() if now is None else now) - since
        return ran if ran > self.stuck_after_s else None

    def view(self) -> dict[str, object]:
        since = self.running_since
        return {
            "queued": self.pending,
            "queue_limit": self.queue,
            "running_s": None if since is None else round(self.clock() - since, 3),
            "stuck": self.stuck_for() is not None,
        }

    def readiness(self, role: str) -> tuple[bool, dict[str, Any]]:
        """The ``role`` daemon's readiness (``/readyz``): red while this worker runs a job past
        ``stuck_after_s`` (``limits.worker_stuck_s``)."""
        stuck = self.stuck_for()
        body: dict[str, Any] = {"status": "ready" if stuck is None else "stuck", "role": role,
                                "worker": self.view()}
        if stuck is not None:
            body["error"] = (f"the model worker has run one job for {stuck:.1f} s (limits.worker_stuck_s = "
                             f"{self.stuck_after_s:g})")
        return stuck is None, body

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
