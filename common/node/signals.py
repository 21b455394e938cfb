"""Stopping a node: SIGINT/SIGTERM set an ``asyncio.Event`` that the daemon's main coroutine waits on
(the daemons, and the lab's link emulator, which runs as a long-lived process the same way)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """While open, SIGINT and SIGTERM set ``stop`` (where the loop can install handlers: not on Windows,
    not off the main thread). On exit the default handlers come back: a handler left behind outlives its
    loop and makes the process (and anything it later forks) ignore SIGTERM."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in _STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)


async def wait_for_signal(stop: asyncio.Event | None = None) -> None:
    """Return once SIGINT/SIGTERM arrives or ``stop`` is set."""
    stop = stop or asyncio.Event()
    with stop_on_signals(stop):
        await stop.wait()
