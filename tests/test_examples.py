"""The examples run as a user runs them (a fresh process, the embedded default model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # loads the default model and runs three agent steps: ~20-40 s


def test_the_langgraph_pipeline_continues_the_handed_off_conversation_on_the_receiver() -> None:
    run = subprocess.run([sys.executable, str(REPO / "examples" / "agents_langgraph.py")], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0, run.stderr[-2000:]
    handed = re.search(r"handoff \S+: done, (\d+) tokens of KV, recovered utility 1\.0", run.stdout)
    cached = re.search(r"(\d+) of (\d+) prompt tokens from the handed-off cache", run.stdout)
    assert handed and cached, run.stdout
    assert cached.group(1) == handed.group(1) and int(cached.group(2)) > int(cached.group(1))
    assert "'handoff_id'" in run.stdout
