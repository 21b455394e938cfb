"""The examples run as a user runs them (a fresh process, the embedded default model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # each loads the default model and runs a few agent steps: ~20-70 s


def test_the_langgraph_pipeline_continues_the_handed_off_conversation_on_the_receiver() -> None:
    run = subprocess.run([sys.executable, str(REPO / "examples" / "agents_langgraph.py")], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0, run.stderr[-2000:]
    handed = re.search(r"handoff \S+: done, (\d+) tokens of KV, recovered utility 1\.0", run.stdout)
    cached = re.search(r"(\d+) of (\d+) prompt tokens from the handed-off cache", run.stdout)
    assert handed and cached, run.stdout
    assert cached.group(1) == handed.group(1) and int(cached.group(2)) > int(cached.group(1))
    assert "'handoff_id'" in run.stdout


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agents_sdk_handoff_moves_the_conversation_and_the_writer_continues_from_it(api: str) -> None:
    """The researcher calls its tool on node A, hands off with the SDK's transfer_to_writer, and the
    writer's first request on node B is served from the handed-off cache: every token of the handed-off
    conversation, under OpenAIChatCompletionsModel and under the SDK's default OpenAIResponsesModel."""
    run = subprocess.run([sys.executable, str(REPO / "examples" / "agents_handoff.py"), "--api", api],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"researcher \(node A\): tool_call_item, tool_call_output_item, message_output_item",
                     run.stdout), run.stdout
    handed = re.search(r"handoff \S+: done, (\d+) tokens of KV \(\d+ prefilled on A for it\), recovered "
                       r"utility 1\.0", run.stdout)
    cached = re.search(r"(\d+) of (\d+) prompt tokens from the handed-off cache", run.stdout)
    assert handed and cached and "after the handoff, Writer (node B)" in run.stdout, run.stdout
    assert int(cached.group(1)) == int(handed.group(1)) > 0 and int(cached.group(2)) > int(cached.group(1))


def test_an_agent_graph_fans_the_planner_out_and_chains_worker_b_to_worker_c() -> None:
    """Three nodes: the planner's conversation on A fanned out to B and C in one handoff (each worker's
    first request cached the whole of it), then B's grown conversation handed on to C (a chain: C's next
    request cached the whole grown conversation); every step through the openai client."""
    run = subprocess.run([sys.executable, str(REPO / "examples" / "agents_graph.py")], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"A -> B and C, a fan-out \(unicast, one preparation\)", run.stdout), run.stdout
    fanout = re.search(r"fan-out A -> B, C: (\d+) tokens; B cached (\d+), C cached (\d+)", run.stdout)
    chain = re.search(r"chain B -> C: (\d+) tokens; C cached (\d+) of (\d+)", run.stdout)
    assert fanout and chain, run.stdout
    assert int(fanout.group(1)) == int(fanout.group(2)) == int(fanout.group(3)) > 0, run.stdout
    assert int(chain.group(1)) == int(chain.group(2)) > int(fanout.group(1)), run.stdout  # grown on B
    assert int(chain.group(3)) > int(chain.group(2)), run.stdout
