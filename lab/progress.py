"""Progress of long lab runs, on stderr only: stdout stays free for a command's `--json` output."""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[int, int], None]  # (done, total)
StageProgress = Callable[[str, int, int], None]  # (stage, done, total)


def progress_line(label: str) -> Progress:
    """A minimal one-line counter on stderr (no extra dependency); silent when stderr is not a terminal."""
    tty = sys.stderr.isatty()

    def update(done: int, total: int) -> None:
        if tty:
            end = "\n" if done == total else ""
            sys.stderr.write(f"\r{label}: {done}/{total} ({100 * done // max(total, 1)}%)" + end)
            sys.stderr.flush()

    return update
