"""An agent graph on three edge nodes: a planner on node A fans its context out to two workers on nodes B
and C in one ``POST /handoffs`` (``receivers``: one preparation, a session per receiver); each worker
starts from the handed-off cache; worker B continues the conversation and hands the grown conversation
on to C (a chain: B hands on what it received and continued); C continues it from that cache. Every
model step goes through the real ``openai`` client against the OpenAI API of the node it runs on.

After the README's set-up (``./scripts/setup.sh``):

    .venv/bin/python examples/agents_graph.py

starts three ``pfec node`` daemons in this process (the embedded default model, real UDP on loopback).
Against running nodes instead (their control APIs on TCP, one bearer token in a file; each node's UDP
address comes from its ``/healthz``):

    .venv/bin/python examples/agents_graph.py --nodes http://A:7481 http://B:7481 http://C:7481 \\
        --token-file token

The trace says who handed what to whom, the bytes on the wire, each step's ``cached_tokens``
(``usage.prompt_tokens_details.cached_tokens``) and its time to the first streamed token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

SALT = "team-graph"  # the conversations' cache salt: a node reuses a cache for this salt only
PLAN = "Planner: in one short line, say what the workers must look for."
TASK_B = "Worker B: answer the team's question."
TASK_C = "Worker C: say in one line where in the document the answer should be."
MERGE = "Worker C: using worker B's answer, write the team's reply in one sentence."


@dataclass
class Node:
    """One node: its control API (the OpenAI API under ``/v1``) and its UDP address (where KV goes)."""

    name: str
    url: str
    udp: str


@dataclass
class Step:
    """One model step: who ran it, its completion id, reply, prompt and cached tokens, and TTFT."""

    agent: str
    node: str
    cid: str
    text: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


class Graph:
    """The three nodes, the bearer token and the model name; the model steps and the handoffs."""

    def __init__(self, nodes: list[Node], token: str, model: str) -> None:
        self.nodes, self.token, self.model = nodes, token, model
        self.lines: list[str] = []

    def client(self, node: Node) -> openai.OpenAI:
        return openai.OpenAI(base_url=node.url + "/v1", api_key=self.token, max_retries=0, timeout=600)

    def control(self, node: Node, method: str, path: str,
                body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(node.url + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as exc:  # the node's answer names the field it refused
            answer = exc.read().decode()
            raise RuntimeError(f"node {node.name}: {method} {path}: {exc.code} {answer}") from None

    def step(self, agent: str, node: Node, messages: list[dict[str, str]], max_tokens: int = 16) -> Step:
        """One streamed chat completion on ``node``: the reply, its usage and the client-side TTFT."""
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        cid, usage = "", None
        stream = self.client(node).chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,  # type: ignore[call-overload]
            stream=True, stream_options={"include_usage": True}, extra_body={"cache_salt": SALT})
        for chunk in stream:
            cid = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started if first is None else first
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None:
            raise RuntimeError(f"{agent} on node {node.name}: the stream carried no usage")
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        done = Step(agent, node.name, cid, "".join(parts), usage.prompt_tokens, cached or 0,
                    first if first is not None else time.perf_counter() - started)
        self.lines.append(f"{agent} on {node.name}: {done.cached_tokens} of {done.prompt_tokens} prompt "
                          f"tokens cached, TTFT {done.ttft_s * 1e3:.0f} ms: {done.text.strip()!r}")
        return done

    def hand(self, sender: Node, receivers: list[Node], conversation_id: str) -> dict[str, Any]:
        """``POST /handoffs`` on ``sender`` for a conversation it served or continued: to one receiver, or
        to several in one unicast fan-out (one preparation); waits for the report."""
        # rho: the deadline over one stream's serialisation; a unicast fan-out's streams share the uplink
        body: dict[str, Any] = {"conversation": {"id": conversation_id}, "precision": "native",
                                "handoff_mode": "handoff", "rho": 2.0 * len(receivers)}
        if len(receivers) == 1:
            body["receiver"] = receivers[0].udp
        else:
            body.update(receivers=[r.udp for r in receivers], fanout="unicast")
        created = self.control(sender, "POST", "/handoffs", body)
        report = self.control(sender, "GET", f"/handoffs/{created['id']}?wait=1")
        if report.get("outcome") != "done":
            raise RuntimeError(f"handoff {created['id']} {report.get('outcome')}: {report.get('failure')}")
        to = " and ".join(r.name for r in receivers)
        if len(receivers) == 1:
            missing = (report.get("conversation") or {}).get("missing_upstream") or {}
            self.lines.append(
                f"  {sender.name} -> {to}, a chain (what it received and continued): "
                f"{report['n_tokens']} tokens of KV, {report['bytes_sent']:,} bytes, recovered utility "
                f"{report['recovered_utility']:.3f}, {missing.get('blocks_missing', 0)} blocks lost upstream")
        else:
            each = ", ".join(f"{r.name} {e['bytes_sent']:,} bytes (utility {e['recovered_utility']:.3f})"
                             for r, e in zip(receivers, report["receivers"], strict=True))
            self.lines.append(
                f"  {sender.name} -> {to}, a fan-out ({report['fanout']}, one preparation): "
                f"{report['n_tokens']} tokens of KV; {each}; uplink {report['uplink_bytes']:,} bytes")
        return report


@dataclass
class Trace:
    fanout: dict[str, Any]
    chain: dict[str, Any]
    steps: dict[str, Step]
    seconds: float


def run(graph: Graph, document: str) -> Trace:
    """planner (A) -> fan-out to B and C -> worker B and worker C each from the handed-off cache -> B hands
    its grown conversation to C (chain) -> C continues it from that cache."""
    started = time.perf_counter()
    a, b, c = graph.nodes
    context = [{"role": "system", "content": "You are one agent of a small team."},
               {"role": "user", "content": f"{document}\n\n{PLAN}"}]
    plan = graph.step("planner", a, context)
    planned = [*context, {"role": "assistant", "content": plan.text}]
    fanout = graph.hand(a, [b, c], plan.cid)
    on_b = graph.step("worker B", b, [*planned, {"role": "user", "content": TASK_B}])
    on_c = graph.step("worker C", c, [*planned, {"role": "user", "content": TASK_C}])
    grown = [*planned, {"role": "user", "content": TASK_B}, {"role": "assistant", "content": on_b.text}]
    chain = graph.hand(b, [c], on_b.cid)
    merged = graph.step("worker C", c, [*grown, {"role": "user", "content": MERGE}], max_tokens=24)
    return Trace(fanout, chain, {"planner": plan, "b": on_b, "c": on_c, "merge": merged},
                 time.perf_counter() - started)


@contextlib.contextmanager
def local_nodes() -> Iterator[Graph]:
    """Three ``pfec node`` daemons in this process (the embedded default model, real UDP on loopback)."""
    from pfec.common.codec import fec  # deferred: only local nodes need the codec warmed here
    from pfec.common.model.runtime import load_runtime  # deferred: torch
    from pfec.lab.bench.chain import TOKEN, chain_nodes  # deferred: only local nodes need the lab

    fec.warm_up()
    runtime, identity = load_runtime("default", "cpu")
    with chain_nodes(runtime, identity, rate_mbps=100.0, loss=None) as chain:
        nodes = [Node(name, url, "{}:{}".format(*node.address))
                 for name, url, node in zip("ABC", chain.urls, chain.nodes, strict=True)]
        yield Graph(nodes, TOKEN, chain.model)


def remote_nodes(urls: list[str], token: str, model: str) -> Graph:
    """Running nodes: each one's UDP address from its ``/healthz`` (its control API's host where the node
    listens on every address)."""
    graph = Graph([], token, model)
    for name, url in zip("ABC", urls, strict=True):
        node = Node(name, url.rstrip("/"), "")
        host, _, port = str(graph.control(node, "GET", "/healthz")["udp"]).rpartition(":")
        if host in ("0.0.0.0", "::", "[::]"):
            host = urllib.parse.urlsplit(node.url).hostname or host
        node.udp = f"{host}:{port}"
        graph.nodes.append(node)
    return graph


def document() -> str:
    """A real essay with a fact planted in it, and its question (the essays `scripts/setup.sh` unpacked)."""
    from pfec.lab.kv.workloads import needle_qa  # deferred: the lab's workloads (data files)

    example = needle_qa(1, context_tokens=600, seed=5, n_needles=1, kinds=("code",))[0]
    return f"{example.context}\n\nThe team's question: {example.question}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", nargs=3, metavar="URL", help="the control APIs of nodes A, B and C, "
                        "http://HOST:PORT each (default: three local nodes)")
    parser.add_argument("--token-file", type=Path, help="the bearer token of the three control APIs")
    parser.add_argument("--model", default="default", help="the model name the nodes serve")
    args = parser.parse_args()
    if bool(args.nodes) != bool(args.token_file):
        parser.error("--nodes and --token-file go together")
    with contextlib.ExitStack() as stack:
        if args.nodes:
            graph = remote_nodes(args.nodes, args.token_file.read_text().strip(), args.model)
        else:
            graph = stack.enter_context(local_nodes())
        out = run(graph, document())
    steps, fanout, chain = out.steps, out.fanout, out.chain
    print("\n".join(graph.lines))
    print(f"fan-out A -> B, C: {fanout['n_tokens']} tokens; B cached {steps['b'].cached_tokens}, "
          f"C cached {steps['c'].cached_tokens}")
    print(f"chain B -> C: {chain['n_tokens']} tokens; C cached {steps['merge'].cached_tokens} of "
          f"{steps['merge'].prompt_tokens}; {out.seconds:.1f} s in all")


if __name__ == "__main__":
    main()
