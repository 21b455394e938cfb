"""`pfec bench chain`: a conversation handed along a chain of three nodes with both roles (issue 37 item
2), measured end to end with the real ``openai`` client (one process, the embedded default model, real
UDP on loopback, ``pfec.node``'s ``NodeDaemon``).

Whole chain: a ~1.5k-token needle-QA conversation is served on A, handed to B (native KV), continued on B
for one turn and handed on to C by the completion id B's API returned. C's first request for the grown
conversation (and a new turn): its ``cached_tokens`` against the grown conversation's tokens, and its TTFT
(client side, to the first streamed content) against the same messages under a salt with nothing stored
(the whole prompt prefilled). Partial chain: the same with A -> B through the relay emulator at a loss rate
and no repairs (scheme ``udp``): what B lacks, what C masks (C's held map, block by block), and what C's
result and ``pfec.prefix`` report. Writes docs/benchmarks/chain.json and .md.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pfec.lab.bench.serving import FOLLOW_UP, SECOND_TURN

T = TypeVar("T")
TTFT_TARGET = 3.0  # cold / warm first-token time on C
TOKEN = "bench-chain-token-0123456789abcdef"
_PSK = bytes(range(96, 128))


@dataclass
class Chain:
    """Three nodes on loopback, their OpenAI and control URLs, and the relay in front of B (or None)."""

    loop: asyncio.AbstractEventLoop
    nodes: list[Any]
    urls: list[str]
    relay_address: tuple[str, int] | None
    model: str

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def chain_nodes(runtime: Any, identity: Any, rate_mbps: float, loss: float | None,
                seed: int = 0) -> Iterator[Chain]:
    """Nodes A, B and C (``NodeDaemon``s on one model) behind their control APIs on loopback TCP; with
    ``loss``, a relay emulator in front of B (that loss toward B, none back)."""
    from pfec.common.node.control import ControlServer  # deferred: aiohttp
    from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig  # deferred: the emulator (asyncio)
    from pfec.lab.emulator.relay import UdpRelay  # deferred: the emulator (asyncio)
    from pfec.lab.sim.channel import Bernoulli  # deferred: with the emulator
    from pfec.node.config import NodeDaemonConfig  # deferred: the daemons (aiohttp)
    from pfec.node.daemon import NodeDaemon  # deferred: the daemons (aiohttp)

    config = NodeDaemonConfig.model_validate({
        "udp": {"host": "127.0.0.1", "port": 0}, "metrics": {"enabled": False},
        "link": {"rate_mbps": rate_mbps, "owd_ms": 1, "rate_control": "fixed"}})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    relay: UdpRelay | None = None

    async def start() -> tuple[list[Any], list[ControlServer]]:
        nonlocal relay
        nodes = [NodeDaemon(config, identity, _PSK, runtime=runtime, process_metrics=False) for _ in range(3)]
        servers = []
        for node in nodes:
            await node.start()
            server = ControlServer(node.routes())
            await server.start(None, ("127.0.0.1", 0), TOKEN)
            servers.append(server)
        if loss is not None:
            link = EmulatorConfig(DirectionSpec(rate_mbps * 1e6, 0.001, Bernoulli(loss)),
                                  DirectionSpec(rate_mbps * 1e6, 0.001), seed=seed)
            relay = UdpRelay(link, ("127.0.0.1", 0), nodes[1].address)
            await relay.__aenter__()
        return nodes, servers

    nodes, servers = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    chain = Chain(loop, nodes, [f"http://127.0.0.1:{s.tcp_port}" for s in servers],
                  None if relay is None else relay.listen_address, runtime.model_id)
    try:
        yield chain
    finally:
        if relay is not None:
            chain.call(relay.__aexit__(None, None, None))
        for server in servers:
            chain.call(server.close())
        for node in nodes:
            chain.call(node.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _streamed(client: Any, model: str, messages: list[dict[str, str]], salt: str,
              max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: client-side TTFT, text, usage and the ``pfec`` extension."""
    started = time.perf_counter()
    first: float | None = None
    text, usage, ext, cid = [], None, None, None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"cache_salt": salt})
    for chunk in stream:
        cid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage, ext = chunk.usage, (chunk.model_extra or {}).get("pfec")
    assert usage is not None
    return {"id": cid, "ttft_s": round(first if first is not None else time.perf_counter() - started, 4),
            "text": "".join(text), "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "prefix": (ext or {}).get("prefix")}


def _hand(chain: Chain, sender: int, to: tuple[str, int], conversation_id: str,
          **extra: Any) -> dict[str, Any]:
    from pfec.common.node.control import ControlClient  # deferred: aiohttp

    client = ControlClient(url=chain.urls[sender], token=TOKEN)
    status, created = chain.call(client.request("POST", "/handoffs", {
        "receiver": "{}:{}".format(*to), "conversation": {"id": conversation_id}, "precision": "native",
        "handoff_mode": "handoff", "rho": 1.5, **extra}))
    if status != 202:
        raise RuntimeError(f"handoff refused: {created}")
    _, report = chain.call(client.request("GET", f"/handoffs/{created['id']}?wait=1"))
    if report.get("outcome") != "done":
        raise RuntimeError(f"handoff failed: {report.get('failure')}")
    for node in chain.nodes:  # the store's upkeep after it (settle)
        while node.worker.pending:
            time.sleep(0.01)
    return dict(report)


def _last_result(chain: Chain, node: int) -> dict[str, Any]:
    from pfec.common.node.control import ControlClient  # deferred: aiohttp

    _, results = chain.call(ControlClient(url=chain.urls[node], token=TOKEN).request("GET", "/results"))
    return dict(results["results"][-1])


def _held_levels(chain: Chain, node: int, salt: str, messages: list[dict[str, str]]) -> list[int] | None:
    """The held map of the store's entry for ``messages`` on ``node`` (in its model worker)."""
    face = chain.nodes[node].face

    def look() -> list[int] | None:
        ids = face.chat_ids(messages, None, add_generation_prompt=False)
        match = face.store.lookup(salt, ids, face.clock(), count=False)
        held = None if match is None else match.entry.info.get("held")
        return None if held is None else list(held.levels)

    async def in_worker() -> list[int] | None:
        levels: list[int] | None = await chain.nodes[node].worker.submit(look)
        return levels

    return chain.call(in_worker())


def masks_exactly_what_b_lacked(b_levels: list[int], c_levels: list[int], n_layers: int) -> bool:
    """Whether C's held map (layer-major, level 0: lost) lacks exactly the blocks B's lacked, over the token
    blocks B received, and nothing after them (B's own turns, computed on B)."""
    b_width, c_width = len(b_levels) // n_layers, len(c_levels) // n_layers
    if b_width > c_width:
        return False
    return all((b_levels[layer * b_width + tb] == 0) == (c_levels[layer * c_width + tb] == 0)
               for layer in range(n_layers) for tb in range(b_width)) and all(
        c_levels[layer * c_width + tb] != 0 for layer in range(n_layers) for tb in range(b_width, c_width))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figure's verdicts: the whole chain's TTFT ratio against the target, cached_tokens equal to the
    grown conversation in every chain, and the partial chain's masks (False where any row says so)."""
    whole = next(r for r in rows if not r["lossy_first_hop"])
    partial = [r for r in rows if r["lossy_first_hop"]]
    ratio = whole["ttft_ratio"]
    return {"ttft_ratio_whole": ratio, "target_ttft_ratio": TTFT_TARGET,
            "meets_target": ratio is not None and ratio >= TTFT_TARGET,
            "cached_equals_grown_all": all(r["cached_equals_grown"] for r in rows),
            "partial_masks_exactly": bool(partial) and all(r["c_masks_exactly_what_b_lacked"] is True
                                                            and (r["b_missing"] or {}).get("blocks_missing")
                                                            for r in partial)}


def _one_chain(chain: Chain, runtime: Any, seed: int, context_tokens: int, max_tokens: int,
               lossy: bool) -> dict[str, Any]:
    import openai  # deferred: the dev extra's client

    from pfec.common.model import llm  # deferred: torch
    from pfec.lab.kv.workloads import needle_qa  # deferred: the essays (data files)

    example = needle_qa(1, context_tokens, seed, count_tokens=lambda t: llm.count_tokens(runtime, t))[0]
    messages = [{"role": "system", "content": llm.DEFAULT_SYSTEM},
                {"role": "user", "content": f"{example.context}\n\n{example.question}"}]
    a, b, c = (openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=600)
               for url in chain.urls)
    salt = f"chain-{seed}-{'lossy' if lossy else 'whole'}"
    first = _streamed(a, chain.model, messages, salt, max_tokens)
    to_b_address = chain.relay_address if lossy and chain.relay_address else chain.nodes[1].address
    to_b = _hand(chain, 0, to_b_address, first["id"], **({"scheme": "udp"} if lossy else {}))
    received = [*messages, {"role": "assistant", "content": first["text"]}]
    grown = [*received, {"role": "user", "content": FOLLOW_UP}]
    on_b = _streamed(b, chain.model, grown, salt, max_tokens)
    to_c = _hand(chain, 1, chain.nodes[2].address, on_b["id"])
    handed = [*grown, {"role": "assistant", "content": on_b["text"]}]
    asked = [*handed, {"role": "user", "content": SECOND_TURN}]
    warm = _streamed(c, chain.model, asked, salt, max_tokens)
    cold = _streamed(c, chain.model, asked, f"{salt}-cold", max_tokens)
    b_levels, c_levels = _held_levels(chain, 1, salt, received), _held_levels(chain, 2, salt, handed)
    b_missing, c_missing = _last_result(chain, 1).get("missing"), _last_result(chain, 2).get("missing")
    masks_exactly = None
    if b_levels is not None and c_levels is not None and b_missing is not None:
        masks_exactly = masks_exactly_what_b_lacked(b_levels, c_levels, runtime.geometry.n_layers)
    return {
        "seed": seed, "lossy_first_hop": lossy,
        "a_to_b": {"recovered_utility": to_b.get("recovered_utility"), "n_tokens": to_b.get("n_tokens"),
                   "n_blocks": to_b.get("n_blocks")},
        "b_to_c": {"recovered_utility": to_c.get("recovered_utility"), "n_tokens": to_c.get("n_tokens"),
                   "n_source": to_c.get("n_source"),
                   "missing_upstream": (to_c.get("conversation") or {}).get("missing_upstream")},
        "b_missing": b_missing, "c_missing": c_missing, "c_masks_exactly_what_b_lacked": masks_exactly,
        "c_prefix_missing": (warm.get("prefix") or {}).get("missing"),
        "warm": {k: warm[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens")},
        "cold": {k: cold[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens")},
        "cached_equals_grown": warm["cached_tokens"] == to_c.get("n_tokens"),
        "ttft_ratio": round(cold["ttft_s"] / warm["ttft_s"], 3) if warm["ttft_s"] > 0 else None,
    }


def run_chain_bench(context_tokens: int = 1500, max_tokens: int = 8, rate_mbps: float = 100.0,
                    loss: float = 0.05, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """A whole chain and a chain with a lossy first hop (seed ``seed``), each on fresh nodes."""
    if context_tokens < 64 or max_tokens < 1 or not 0 < loss < 1:
        raise ValueError("bench chain needs context_tokens >= 64, max_tokens >= 1 and 0 < loss < 1")
    from pfec.common.codec import fec  # deferred: numba
    from pfec.common.model.runtime import load_runtime  # deferred: torch

    fec.warm_up()
    runtime, identity = load_runtime("default", "cpu")
    load_before = os.getloadavg()
    rows = []
    for step, hop_loss in enumerate((None, loss)):
        with chain_nodes(runtime, identity, rate_mbps, hop_loss, seed) as chain:
            rows.append(_one_chain(chain, runtime, seed, context_tokens, max_tokens, hop_loss is not None))
        if progress is not None:
            progress(step + 1, 2)
    return {
        "inputs": {"context_tokens": context_tokens, "max_tokens": max_tokens, "rate_mbps": rate_mbps,
                   "first_hop_loss": loss, "seed": seed, "model": "default", "precision": "native",
                   "cold": "the same messages on C under a cache salt with nothing stored (all prefilled)"},
        "rows": rows,
        "summary": summarise(rows),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def _three(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def write_chain_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "chain.json").write_text(json.dumps(result, indent=2) + "\n")
    inp, summary = result["inputs"], result["summary"]
    machine = result.get("machine", {})
    lines = [
        "# A conversation handed along a chain A -> B -> C (`pfec bench chain`)",
        "",
        f"Three `pfec node` daemons in one process ({machine.get('cpu', '')}, {machine.get('cores')} cores, "
        f"load average {result['loadavg_before']} before, {result['loadavg_after']} after): the default "
        f"model, a ~{inp['context_tokens']}-token needle-QA conversation served on A, handed to B "
        f"({inp['precision']} KV, loopback UDP at {inp['rate_mbps']:g} Mbit/s), continued on B, handed on "
        "to C by B's completion id. TTFT: client side, to the first streamed content. Cold: "
        f"{inp['cold']}. The partial chain loses {inp['first_hop_loss']:g} of A -> B's datagrams, no "
        "repairs.",
        "",
        "| first hop | A->B utility | B lacks (blocks) | C lacks: by hop | C masks exactly that | C cached / "
        "grown | warm TTFT s | cold TTFT s | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b_missing, c_missing = r["b_missing"] or {}, r["c_missing"] or {}
        lacks = f"{b_missing.get('blocks_missing')} / {b_missing.get('blocks')}"
        cached = f"{r['warm']['cached_tokens']} / {r['b_to_c']['n_tokens']}"
        hop = "lossy" if r["lossy_first_hop"] else "whole"
        lines.append(
            f"| {hop} | {_three(r['a_to_b']['recovered_utility'])} | "
            f"{lacks} | {c_missing.get('lost_by_hop')} | {r['c_masks_exactly_what_b_lacked']} | {cached} "
            f"| {r['warm']['ttft_s']:.3f} | {r['cold']['ttft_s']:.3f} | {r['ttft_ratio']} |")
    met = "met" if summary["meets_target"] else "not met"
    lines += ["", f"Whole chain: C's TTFT ratio {summary['ttft_ratio_whole']} (target >= "
              f"{summary['target_ttft_ratio']}: {met}). cached_tokens equal to the grown conversation in "
              f"every chain: {summary['cached_equals_grown_all']}. Partial chain: C masks exactly what B "
              f"lacked: {summary['partial_masks_exactly']}.", ""]
    (out_dir / "chain.md").write_text("\n".join(lines))
