"""Two agents on two edge nodes, one conversation: a LangGraph pipeline whose first agent (a researcher)
runs on the sender node, whose conversation is then handed off by PriorityFEC (its KV cache, over UDP),
and whose second agent (a writer) continues it on the receiver node from the handed-off cache, through the
OpenAI API both daemons serve. Each agent is a plain LangGraph node calling the real ``openai`` client.

After the README's set-up (``./scripts/setup.sh``):

    .venv/bin/python examples/agents_langgraph.py

starts a receiver and a sender daemon in this process (the embedded default model, real UDP on
loopback). Against running daemons instead (their control APIs on TCP, the bearer token in a file):

    .venv/bin/python examples/agents_langgraph.py --sender http://SENDER:7481 \\
        --receiver-api http://RECEIVER:7480 --receiver-udp RECEIVER:7400 --token-file token

The writer's response says how many prompt tokens came from the handed-off cache
(``usage.prompt_tokens_details.cached_tokens``) and which handoff they came from (``pfec.prefix``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import openai
from langgraph.graph import END, START, StateGraph

SALT = "team-alpha"  # the conversation's cache salt: the receiver reuses its cache for this salt only
FOLLOW_UP = "Write one short sentence for the team that gives that answer."


class Pipeline(TypedDict, total=False):
    document: str
    task: str
    messages: list[dict[str, str]]
    conversation_id: str
    handoff: dict[str, Any]
    research: str
    note: str
    cached_tokens: int
    prompt_tokens: int
    prefix: dict[str, Any] | None


class Nodes:
    """Where the two agents' models are: the sender's and the receiver's /v1 APIs, the sender's control
    API (for the handoff) and the receiver's UDP address (where the KV goes)."""

    def __init__(self, sender: str, receiver_api: str, receiver_udp: str, token: str, model: str) -> None:
        self.sender, self.receiver_api = sender.rstrip("/"), receiver_api.rstrip("/")
        self.receiver_udp = receiver_udp
        self.token, self.model = token, model

    def client(self, base: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base + "/v1", api_key=self.token, max_retries=0, timeout=600)

    def control(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(self.sender + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return dict(json.loads(response.read()))


def build(nodes: Nodes) -> Any:
    """researcher (sender node) -> handoff (PriorityFEC) -> writer (receiver node)."""

    def researcher(state: Pipeline) -> Pipeline:
        messages = [{"role": "system", "content": "You are a careful research assistant."},
                    {"role": "user", "content": f"{state['document']}\n\n{state['task']}"}]
        reply = nodes.client(nodes.sender).chat.completions.create(
            model=nodes.model, messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
            extra_body={"cache_salt": SALT})
        research = reply.choices[0].message.content or ""
        return {"messages": [*messages, {"role": "assistant", "content": research}],
                "conversation_id": reply.id, "research": research}

    def handoff(state: Pipeline) -> Pipeline:
        created = nodes.control("POST", "/handoffs", {
            "receiver": nodes.receiver_udp, "conversation": {"id": state["conversation_id"]},
            "precision": "native", "handoff_mode": "handoff", "rho": 1.5})
        return {"handoff": nodes.control("GET", f"/handoffs/{created['id']}?wait=1")}

    def writer(state: Pipeline) -> Pipeline:
        messages = [*state["messages"], {"role": "user", "content": FOLLOW_UP}]
        reply = nodes.client(nodes.receiver_api).chat.completions.create(
            model=nodes.model, messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
            extra_body={"cache_salt": SALT})
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return {"note": reply.choices[0].message.content or "", "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens or 0,
                "prefix": (reply.model_extra or {}).get("pfec", {}).get("prefix")}

    graph = StateGraph(Pipeline)
    graph.add_node("researcher", researcher)
    graph.add_node("handoff", handoff)
    graph.add_node("writer", writer)
    graph.add_edge(START, "researcher")
    graph.add_edge("researcher", "handoff")
    graph.add_edge("handoff", "writer")
    graph.add_edge("writer", END)
    return graph.compile()


@contextlib.contextmanager
def local_nodes() -> Iterator[Nodes]:
    """Both daemons in this process (the embedded default model, real UDP on loopback)."""
    from pfec.lab.bench.serving import LOCAL_TOKEN
    from pfec.lab.bench.serving import local_nodes as start

    with start() as running:
        yield Nodes(running.tx_control, running.rx_url.removesuffix("/v1"),
                    "{}:{}".format(*running.rx.address), LOCAL_TOKEN, running.model)


def document() -> Pipeline:
    """A real essay with a fact planted in it, and the question about it (the essays `scripts/setup.sh`
    unpacked)."""
    from pfec.lab.kv.workloads import needle_qa

    example = needle_qa(1, context_tokens=700, seed=3, n_needles=1, kinds=("code",))[0]
    return {"document": example.context, "task": example.question}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sender", help="the sender's control API, http://HOST:PORT (default: local "
                        "daemons)")
    parser.add_argument("--receiver-api", help="the receiver's control API, http://HOST:PORT")
    parser.add_argument("--receiver-udp", help="the receiver's data address HOST:PORT")
    parser.add_argument("--token-file", type=Path, help="the bearer token of both control APIs")
    parser.add_argument("--model", default="default", help="the model name both serve")
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
        started = time.perf_counter()
        out = build(nodes).invoke(document())
        handed = out["handoff"]
        print(f"researcher (sender node): {out['research']!r}")
        print(f"handoff {handed['id']}: {handed.get('outcome')}, {handed.get('n_tokens')} tokens of KV, "
              f"recovered utility {handed.get('recovered_utility')}")
        print(f"writer (receiver node): {out['note']!r}")
        print(f"  {out['cached_tokens']} of {out['prompt_tokens']} prompt tokens from the handed-off cache "
              f"({out['prefix']}); {time.perf_counter() - started:.1f} s in all")


if __name__ == "__main__":
    main()
