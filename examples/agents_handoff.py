"""An OpenAI Agents SDK handoff that moves the conversation's KV cache to another edge node: a researcher
agent on node A (the sender daemon) calls a function tool, then hands off to a writer agent on node B (the
receiver daemon) with the SDK's own ``transfer_to_writer``; the handoff's input filter hands the
conversation, as the writer will send it, to B over PriorityFEC (the sender's ``POST /handoffs``); the
writer's first request on B is then served from the handed-off cache. Neither the SDK nor its requests
change: both agents talk to the OpenAI API their node serves.

After the README's set-up (``./scripts/setup.sh``):

    .venv/bin/python examples/agents_handoff.py

starts a receiver and a sender daemon in this process (the embedded default model, real UDP on
loopback). Against running daemons instead (their control APIs on TCP, the bearer token in a file):

    .venv/bin/python examples/agents_handoff.py --sender http://SENDER:7481 \\
        --receiver-api http://RECEIVER:7480 --receiver-udp RECEIVER:7400 --token-file token

``--api responses`` runs both agents on the SDK's default model class (``OpenAIResponsesModel``, the
Responses API) instead of ``OpenAIChatCompletionsModel``.

Why the input filter and not ``on_handoff``: ``on_handoff`` gets the run context only (the turn's input,
not the model's items), while ``input_filter`` gets every item the writer will see and is awaited before
the writer's first request. The writer's prompt starts with its own instructions, and a cache is only
reused for the tokens it starts with, so what is handed off is the conversation as the writer renders it:
node A prefills what its cache of the researcher's turns lacks (all but the template's first tokens
here, the instructions differing), node B none of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from agents import (
    Agent,
    HandoffInputData,
    ItemHelpers,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    handoff,
    set_tracing_disabled,
)


def dictate(name: str, arguments: dict[str, str]) -> str:
    """A user turn that makes the embedded 135M model call a tool: it does not choose one on its own, so the
    user dictates the call in the Hermes form the node parses (a larger model decides for itself)."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"Say exactly this and nothing else:\n<tool_call>\n{call}\n</tool_call>"


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny, 24 C in {city}"


@dataclass
class Nodes:
    """Where the two agents' models are: the sender's and the receiver's control APIs (their /v1 under
    them), the receiver's UDP address (where the KV goes) and the bearer token."""

    sender: str
    receiver_api: str
    receiver_udp: str
    token: str
    model: str

    def client(self, base: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=base.rstrip("/") + "/v1", api_key=self.token, max_retries=0,
                                  timeout=600)

    def control(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(self.sender.rstrip("/") + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return dict(json.loads(response.read()))


@dataclass
class HandOver:
    """The ``transfer_to_writer`` handoff's input filter: hands the conversation the writer will send (its
    instructions, then every item) from node A to node B, waits until B holds its cache, and passes the
    items on unchanged."""

    nodes: Nodes
    writer_instructions: str
    report: dict[str, Any] = field(default_factory=dict)

    async def __call__(self, data: HandoffInputData) -> HandoffInputData:
        history = data.input_history
        items = [*ItemHelpers.input_to_new_input_list(history if isinstance(history, str) else list(history)),
                 *(item.to_input_item() for item in (*data.pre_handoff_items, *data.new_items))]
        messages = [{"role": "system", "content": self.writer_instructions}, *items]
        created = await asyncio.to_thread(self.nodes.control, "POST", "/handoffs", {
            "receiver": self.nodes.receiver_udp, "conversation": {"messages": messages},
            "precision": "native", "handoff_mode": "handoff", "rho": 1.5})
        self.report = await asyncio.to_thread(self.nodes.control, "GET", f"/handoffs/{created['id']}?wait=1")
        return data


@dataclass
class Outcome:
    tool_items: list[str]
    research: str
    note: str
    last_agent: str
    handoff: dict[str, Any]
    writer_usage: dict[str, int]
    seconds: float


def model(nodes: Nodes, base: str, api: str) -> Model:
    client = nodes.client(base)
    if api == "responses":
        return OpenAIResponsesModel(nodes.model, client)
    return OpenAIChatCompletionsModel(nodes.model, client)


async def run(nodes: Nodes, api: str = "chat") -> Outcome:
    """Turn 1: the researcher (node A) calls its tool and answers. Turn 2: the user asks for the writer;
    the researcher hands off; the writer (node B) answers from the handed-off cache."""
    set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers, which a node is not
    started = time.perf_counter()
    writer_instructions = "You are a writer. Write one short sentence for the team."
    writer = Agent(name="Writer", instructions=writer_instructions,
                   model=model(nodes, nodes.receiver_api, api),
                   model_settings=ModelSettings(max_tokens=24, temperature=0))
    hand_over = HandOver(nodes, writer_instructions)
    transfer = handoff(writer)  # transfer_to_writer
    transfer.input_filter = hand_over  # async: awaited (handoff()'s overloads type a sync filter only)
    researcher = Agent(name="Researcher", instructions="You are a careful research assistant.",
                       tools=[get_weather], handoffs=[transfer],
                       model=model(nodes, nodes.sender, api),
                       model_settings=ModelSettings(max_tokens=40, temperature=0))  # a whole dictated call
    first = await Runner.run(researcher, dictate("get_weather", {"city": "Paris"}))
    second = await Runner.run(researcher, [*first.to_input_list(),
                                           {"role": "user", "content": dictate("transfer_to_writer", {})}])
    usage = second.raw_responses[-1].usage
    return Outcome(tool_items=[item.type for item in first.new_items], research=str(first.final_output),
                   note=str(second.final_output), last_agent=second.last_agent.name, handoff=hand_over.report,
                   writer_usage={"input_tokens": usage.input_tokens,
                                 "cached_tokens": usage.input_tokens_details.cached_tokens},
                   seconds=time.perf_counter() - started)


@contextlib.contextmanager
def local_nodes() -> Iterator[Nodes]:
    """Both daemons in this process (the embedded default model, real UDP on loopback)."""
    from pfec.lab.bench.serving import LOCAL_TOKEN  # deferred: only local nodes need the lab
    from pfec.lab.bench.serving import local_nodes as start  # deferred: torch

    with start() as running:
        yield Nodes(running.tx_control, running.rx_url.removesuffix("/v1"),
                    "{}:{}".format(*running.rx.address), LOCAL_TOKEN, running.model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sender", help="the sender's control API, http://HOST:PORT (default: local "
                        "daemons)")
    parser.add_argument("--receiver-api", help="the receiver's control API, http://HOST:PORT")
    parser.add_argument("--receiver-udp", help="the receiver's data address HOST:PORT")
    parser.add_argument("--token-file", type=Path, help="the bearer token of both control APIs")
    parser.add_argument("--model", default="default", help="the model name both serve")
    parser.add_argument("--api", choices=("chat", "responses"), default="chat",
                        help="OpenAIChatCompletionsModel (chat) or the SDK's default OpenAIResponsesModel")
    args = parser.parse_args()
    remote = [args.sender, args.receiver_api, args.receiver_udp, args.token_file]
    if any(remote) and not all(remote):
        parser.error("--sender, --receiver-api, --receiver-udp and --token-file go together")
    with contextlib.ExitStack() as stack:
        if args.sender:
            nodes = Nodes(args.sender, args.receiver_api, args.receiver_udp,
                          args.token_file.read_text().strip(), args.model)
        else:
            nodes = stack.enter_context(local_nodes())
        out = asyncio.run(run(nodes, api=args.api))
    handed = out.handoff
    print(f"researcher (node A): {', '.join(out.tool_items)}; {out.research!r}")
    print(f"handoff {handed.get('id')}: {handed.get('outcome')}, {handed.get('n_tokens')} tokens of KV "
          f"({handed.get('conversation', {}).get('prefilled_tokens')} prefilled on A for it), recovered "
          f"utility {handed.get('recovered_utility')}")
    print(f"after the handoff, {out.last_agent} (node B): {out.note!r}")
    print(f"  {out.writer_usage['cached_tokens']} of {out.writer_usage['input_tokens']} prompt tokens from "
          f"the handed-off cache; {out.seconds:.1f} s in all")


if __name__ == "__main__":
    main()
