"""`pfec bench serving`: what the OpenAI face buys after a handoff, measured end to end with the real
``openai`` client against real daemons (one process, the embedded default model, real UDP on loopback).

Per run: a ~1.5k-token needle-QA conversation is served on the sender (``/v1/chat/completions``), handed
off by its id (``POST /handoffs``, native KV), then continued on the receiver: the first request's TTFT
(client side, to the first streamed content) and ``cached_tokens``, against the same messages under a salt
with nothing stored (the store empty for it: the whole prompt prefilled). Then a second turn on each
node: the tokens it prefilled against its new turn's. Writes docs/benchmarks/serving.json and .md.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
TTFT_TARGET = 3.0  # cold / warm first-token time after a handoff
LOCAL_TOKEN = "bench-serving-token-0123456789abcdef"
_PSK = bytes(range(64, 96))
FOLLOW_UP = "Reply with the answer only, once more."
SECOND_TURN = "Thank you. Could you say it one more time?"


@dataclass
class LocalNodes:
    loop: asyncio.AbstractEventLoop
    rx: Any
    tx: Any
    rx_url: str
    tx_url: str
    tx_control: str
    model: str

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def local_nodes(rate_mbps: float = 100.0) -> Iterator[LocalNodes]:
    """A receiver and a sender daemon with the default model in this process, their control APIs (and
    so their /v1 APIs) on loopback TCP behind ``LOCAL_TOKEN`` (also the example's nodes)."""
    from pfec.common.codec import fec  # deferred: numba
    from pfec.common.model.runtime import load_runtime  # deferred: torch
    from pfec.common.node.control import ControlServer  # deferred: aiohttp
    from pfec.receiver.control import receiver_routes  # deferred: the daemons (aiohttp)
    from pfec.receiver.daemon import ReceiverDaemon  # deferred: the daemons (aiohttp)
    from pfec.sender.control import sender_routes  # deferred: the daemons (aiohttp)
    from pfec.sender.daemon import SenderDaemon  # deferred: the daemons (aiohttp)

    fec.warm_up()
    runtime, identity = load_runtime("default", "cpu")
    assert runtime is not None
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[Any, Any, list[ControlServer]]:
        rx = ReceiverDaemon(identity, _PSK, runtime=runtime)
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, _PSK, runtime=runtime, rate_mbps=rate_mbps, owd_ms=1,
                          rate_control="fixed")  # loopback: the told rate is the link
        servers = [ControlServer(receiver_routes(rx)), ControlServer(sender_routes(tx))]
        for server in servers:
            await server.start(None, ("127.0.0.1", 0), LOCAL_TOKEN)
        return rx, tx, servers

    rx, tx, servers = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    base = [f"http://127.0.0.1:{s.tcp_port}" for s in servers]
    nodes = LocalNodes(loop, rx, tx, base[0] + "/v1", base[1] + "/v1", base[1], runtime.model_id)
    try:
        yield nodes
    finally:
        for server in servers:
            nodes.call(server.close())
        nodes.call(tx.close())
        nodes.call(rx.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _streamed(client: Any, model: str, messages: list[dict[str, str]], salt: str,
              max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: client-side TTFT (to the first content), text and usage."""
    started = time.perf_counter()
    first: float | None = None
    text, usage, ext = [], None, None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"cache_salt": salt})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage, ext = chunk.usage, (chunk.model_extra or {}).get("pfec")
    assert usage is not None
    return {"ttft_s": round(first if first is not None else time.perf_counter() - started, 4),
            "text": "".join(text), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "prefix": (ext or {}).get("prefix"), "server_ttft_s": (ext or {}).get("server_ttft_s")}


def _handoff(nodes: LocalNodes, conversation_id: str) -> dict[str, Any]:
    from pfec.common.node.control import ControlClient  # deferred: aiohttp

    client = ControlClient(url=nodes.tx_control, token=LOCAL_TOKEN)
    receiver = "{}:{}".format(*nodes.rx.address)
    status, created = nodes.call(client.request("POST", "/handoffs", {
        "receiver": receiver, "conversation": {"id": conversation_id}, "precision": "native",
        "handoff_mode": "handoff", "rho": 1.5}))
    if status != 202:
        raise RuntimeError(f"handoff refused: {created}")
    _, report = nodes.call(client.request("GET", f"/handoffs/{created['id']}?wait=1"))
    return dict(report)


def _new_turn_tokens(runtime: Any, before: list[dict[str, str]], after: list[dict[str, str]]) -> int:
    from pfec.common.model import serving  # deferred: torch

    return len(serving.chat_ids(runtime, after)) - len(serving.chat_ids(runtime, before, False))


def _one_run(nodes: LocalNodes, seed: int, context_tokens: int, max_tokens: int) -> dict[str, Any]:
    import openai  # deferred: the dev extra's client

    from pfec.common.model import llm  # deferred: torch
    from pfec.lab.kv.workloads import needle_qa  # deferred: the essays (data files)

    runtime = nodes.rx.runtime
    example = needle_qa(1, context_tokens, seed, count_tokens=lambda t: llm.count_tokens(runtime, t))[0]
    messages = [{"role": "system", "content": llm.DEFAULT_SYSTEM},
                {"role": "user", "content": f"{example.context}\n\n{example.question}"}]
    sender = openai.OpenAI(base_url=nodes.tx_url, api_key=LOCAL_TOKEN, max_retries=0, timeout=600)
    receiver = openai.OpenAI(base_url=nodes.rx_url, api_key=LOCAL_TOKEN, max_retries=0, timeout=600)
    salt = f"bench-{seed}"
    upstream = sender.chat.completions.create(model=nodes.model, messages=messages,  # type: ignore[arg-type]
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body={"cache_salt": salt})
    report = _handoff(nodes, upstream.id)
    reply = {"role": "assistant", "content": upstream.choices[0].message.content or ""}
    follow = [*messages, reply, {"role": "user", "content": FOLLOW_UP}]
    warm = _streamed(receiver, nodes.model, follow, salt, max_tokens)
    second = [*follow, {"role": "assistant", "content": warm["text"]},
              {"role": "user", "content": SECOND_TURN}]
    rx_turn = _streamed(receiver, nodes.model, second, salt, max_tokens)
    cold = _streamed(receiver, nodes.model, follow, f"bench-cold-{seed}", max_tokens)
    tx_turn = _streamed(sender, nodes.model, follow, salt, max_tokens)
    handed = report.get("conversation") or {}
    return {
        "seed": seed, "handoff_outcome": report.get("outcome"), "handed_off_tokens": handed.get("n_tokens"),
        "sender_prefilled_for_handoff": handed.get("prefilled_tokens"),
        "recovered_utility": report.get("recovered_utility"), "handoff_ttft_s": report.get("ttft_s"),
        "warm": warm, "cold": cold,
        "ttft_ratio": round(cold["ttft_s"] / warm["ttft_s"], 3) if warm["ttft_s"] > 0 else None,
        "cached_equals_handed_off": warm["cached_tokens"] == handed.get("n_tokens"),
        "receiver_second_turn": {**_turn(rx_turn), "new_turn_tokens": _new_turn_tokens(runtime, second[:-1],
                                                                                      second)},
        "sender_second_turn": {**_turn(tx_turn), "new_turn_tokens": _new_turn_tokens(runtime, follow[:-1],
                                                                                    follow)},
    }


def _turn(result: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": result["prompt_tokens"], "cached_tokens": result["cached_tokens"],
            "prefilled_tokens": result["prompt_tokens"] - result["cached_tokens"], "ttft_s": result["ttft_s"]}


def run_serving_bench(runs: int = 3, context_tokens: int = 1500, max_tokens: int = 8,
                      rate_mbps: float = 100.0,
                      progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """``runs`` conversations (seeds 0..runs-1): every run's figures and the median TTFT ratio."""
    if runs < 1 or context_tokens < 64 or max_tokens < 1:
        raise ValueError("bench serving needs runs >= 1, context_tokens >= 64, max_tokens >= 1")
    load_before = os.getloadavg()
    rows = []
    with local_nodes(rate_mbps) as nodes:
        for seed in range(runs):
            rows.append(_one_run(nodes, seed, context_tokens, max_tokens))
            if progress is not None:
                progress(seed + 1, runs)
    ratios = [r["ttft_ratio"] for r in rows if r["ttft_ratio"] is not None]
    median = statistics.median(ratios) if ratios else None
    return {
        "inputs": {"runs": runs, "context_tokens": context_tokens, "max_tokens": max_tokens,
                   "rate_mbps": rate_mbps, "model": "default", "precision": "native",
                   "cold": "the same messages under a cache salt with nothing stored (the whole prompt "
                           "prefilled)"},
        "rows": rows,
        "summary": {"ttft_ratio_median": median, "ttft_ratio_min": min(ratios) if ratios else None,
                    "target_ttft_ratio": TTFT_TARGET,
                    "meets_target": median is not None and median >= TTFT_TARGET,
                    "cached_equals_handed_off_all": all(r["cached_equals_handed_off"] for r in rows)},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def write_serving_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serving.json").write_text(json.dumps(result, indent=2) + "\n")
    inp, summary = result["inputs"], result["summary"]
    lines = [
        "# A handed-off conversation continued through the OpenAI API (`pfec bench serving`)",
        "",
        f"Real daemons in one process ({result['machine'].get('cpu', '')}, {result['machine'].get('cores')} "
        f"cores, load average {result['loadavg_before']} before, {result['loadavg_after']} after): the "
        f"default model, ~{inp['context_tokens']}-token needle-QA conversations served on the sender, handed "
        f"off ({inp['precision']} KV, loopback UDP paced at {inp['rate_mbps']:g} Mbit/s), then continued on "
        "the receiver with the real openai client. TTFT: client side, to the first streamed content. Cold: "
        f"{inp['cold']}.",
        "",
        "| seed | handed off | cached | warm TTFT s | cold TTFT s | ratio | rx 2nd turn prefilled / new | "
        "tx 2nd turn prefilled / new |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rx, tx = r["receiver_second_turn"], r["sender_second_turn"]
        lines.append(f"| {r['seed']} | {r['handed_off_tokens']} | {r['warm']['cached_tokens']} | "
                     f"{r['warm']['ttft_s']:.3f} | {r['cold']['ttft_s']:.3f} | {r['ttft_ratio']} | "
                     f"{rx['prefilled_tokens']} / {rx['new_turn_tokens']} | "
                     f"{tx['prefilled_tokens']} / {tx['new_turn_tokens']} |")
    met = "met" if summary["meets_target"] else "not met"
    lines += ["", f"Median TTFT ratio {summary['ttft_ratio_median']} (target >= "
              f"{summary['target_ttft_ratio']}: {met}); cached_tokens equal to the handed-off context in "
              f"every run: {summary['cached_equals_handed_off_all']}. Second turn: the tokens it prefilled "
              "against its new turn's.", ""]
    (out_dir / "serving.md").write_text("\n".join(lines))
