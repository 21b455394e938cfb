"""Stopping a node: SIGINT/SIGTERM set an ``asyncio.Event`` that the daemon's main coroutine waits on
(the daemons, and the lab's link emulator, which runs as a long-lived process the same way)."""

from __future__ import annotations

import asyncio
import contextlib
import signal


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (where the loop can install handlers: not on Windows, not off the
    main thread)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)


async def wait_for_signal(stop: asyncio.Event | None = None) -> None:
    """Return once SIGINT/SIGTERM arrives or ``stop`` is set."""
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    await stop.wait()
