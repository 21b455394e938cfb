"""Progress of long lab runs, on stderr only: stdout stays free for a command's `--json` output."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

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


def progress_lines(stream: TextIO, step_percent: int = 10) -> StageProgress:
    """Stage progress as plain lines for a log (no terminal): one when a stage starts and one each time
    it passes another ``step_percent`` percent, with the minutes since the first line."""
    started = time.monotonic()
    reported: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        step = percent // step_percent
        if reported.get(stage) == step:
            return
        reported[stage] = step
        minutes = (time.monotonic() - started) / 60
        stream.write(f"[{minutes:5.1f} min] {stage}: {done}/{total} ({percent}%)\n")
        stream.flush()

    return update
