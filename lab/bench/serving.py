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
import importlib.metadata
import importlib.util
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
                      progress: Callable[[int, int], None] | None = None, constrained_prompts: int = 20,
                      constrained_max_tokens: int = 128) -> dict[str, Any]:
    """``runs`` conversations (seeds 0..runs-1): every run's figures and the median TTFT ratio; then the
    constrained-decoding rows over ``constrained_prompts`` prompts of each kind (0: none)."""
    if runs < 1 or context_tokens < 64 or max_tokens < 1:
        raise ValueError("bench serving needs runs >= 1, context_tokens >= 64, max_tokens >= 1")
    if not 0 <= constrained_prompts <= len(TOOL_PROMPTS) or constrained_max_tokens < 8:
        raise ValueError(f"bench serving takes 0..{len(TOOL_PROMPTS)} constrained prompts, max_tokens >= 8")
    load_before = os.getloadavg()
    rows = []
    constrained: dict[str, Any] | None = None
    with local_nodes(rate_mbps) as nodes:
        for seed in range(runs):
            rows.append(_one_run(nodes, seed, context_tokens, max_tokens))
            if progress is not None:
                progress(seed + 1, runs + (2 if constrained_prompts else 0))
        if constrained_prompts:
            constrained = _constrained_rows(nodes, constrained_prompts, constrained_max_tokens)
            if progress is not None:
                progress(runs + 1, runs + 2)
            constrained["overhead"] = _overhead(nodes.rx.runtime, constrained_prompts, constrained_max_tokens)
            constrained["max_tokens"] = constrained_max_tokens
            if progress is not None:
                progress(runs + 2, runs + 2)
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
        "constrained": constrained,
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
    if result.get("constrained"):
        lines += _constrained_lines(result["constrained"])
    (out_dir / "serving.md").write_text("\n".join(lines))


def _constrained_lines(c: dict[str, Any]) -> list[str]:
    tools, schema, over = c["tool_choice_required"], c["json_schema_strict"], c["overhead"]
    lines = [
        "## Constrained decoding", "",
        f"Through the openai client on the receiver, greedy, max_tokens {c['max_tokens']}: "
        f"`tool_choice: required` over {tools['of']} prompts ({len(BENCH_TOOLS)} tools): **{tools['valid']}/"
        f"{tools['of']}** replies carry only valid calls to a declared tool. A strict `json_schema` over "
        f"{schema['of']} prompts: **{schema['valid']}/{schema['of']}** replies validate.", "",
        "The decode step (forward pass and pick; unconstrained median "
        f"{over['unconstrained_step_ms_median']} ms) with the token mask computed and applied in place, and "
        "the token consumed, per library. The paired overhead is (mask + consume) / (forward + pick) on the "
        f"same step, median over every step; the target is <= {over['target_overhead']:.0%}. The node uses "
        f"{over['chosen']}.", "",
        "| library | steps | compile s | mask ms | consume ms | step ms | overhead (paired) | "
        "vs unconstrained | target |", "|---|---|---|---|---|---|---|---|---|"]
    for name, lib in over["libraries"].items():
        lines.append(f"| {name} | {lib['steps']} | {lib['compile_s']} | {lib['mask_ms_median']} | "
                     f"{lib['consume_ms_median']} | {lib['step_ms_median']} | "
                     f"{lib['overhead_paired_median']:.2%} | "
                     f"{lib['overhead_vs_unconstrained_median']:+.2%} | "
                     f"{'met' if lib['meets_target'] else 'not met'} |")
    lines += [f"| {name} | skipped: {why} | | | | | | | |" for name, why in over["skipped"].items()]
    return [*lines, ""]


# --------------------------------------------------------------------------- constrained decoding

BENCH_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 60},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a timezone.",
                                      "parameters": {"type": "object", "properties": {
                                          "timezone": {"type": "string", "maxLength": 60}},
                                          "required": ["timezone"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert money.",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number"},
                                          "from_currency": {"type": "string", "maxLength": 3},
                                          "to_currency": {"type": "string", "maxLength": 3}},
                                          "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 120}},
                                          "required": ["query"]}}},
]
TOOL_PROMPTS = (
    "What's the weather in Paris?", "Is it raining in London right now?", "How hot is it in Cairo today?",
    "Weather for Oslo in fahrenheit, please.", "What time is it in Tokyo?", "Current time in New York?",
    "Which hour is it in Sydney?", "Tell me the time in UTC.", "Convert 100 USD to EUR.",
    "How many yen is 50 dollars?", "Change 20 GBP into CHF.", "What is 75 EUR in USD?",
    "Search the web for the tallest mountain.", "Find recent news about solar power.",
    "Look up who wrote Hamlet.", "Search for a pancake recipe.", "Do I need an umbrella in Berlin?",
    "What's the time difference? Check the time in Paris.", "Hello! How are you today?",
    "Tell me something interesting.",
)
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 60},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                     "occupation": {"type": "string", "maxLength": 60}},
    "required": ["name", "age", "occupation"], "additionalProperties": False}
PERSON_PROMPTS = (
    "Marie Curie was a physicist who died at 66.", "Ada Lovelace, mathematician, lived to 36.",
    "Bob is a 7-year-old schoolboy.", "Grace Hopper was a computer scientist; she reached 85.",
    "My neighbour Tom is a 45-year-old plumber.", "Alice, 29, works as a nurse.",
    "The chef Luca is 52.", "Sara is a pilot and she is 38 years old.",
    "Old Mr. Brown, a retired farmer, is 90.", "Nina is a 24-year-old student.",
    "Albert Einstein, physicist, died aged 76.", "Kenji is a 33-year-old architect.",
    "Our teacher Ms. Lee is 41.", "Pablo Picasso, painter, lived 91 years.",
    "Fatima, 60, is a judge.", "The baker Jean is 47.", "Ivan is a 19-year-old soldier.",
    "Li Wei is a dentist aged 55.", "Emma, a 31-year-old journalist.", "Tell me a joke about a cat.",
)
SCHEMA_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "enum", "minimum",
                             "maximum", "maxLength", "description"})
OVERHEAD_TARGET = 0.10  # constrained decode step over unconstrained, median


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the bench's schemas use only ``SCHEMA_KEYWORDS``; jsonschema is
    not a dependency): empty when it validates."""
    unknown = set(schema) - SCHEMA_KEYWORDS
    if unknown:
        raise ValueError(f"the bench's validator does not read {sorted(unknown)}")
    kinds = {"object": dict, "string": str, "boolean": bool, "array": list}
    kind = schema.get("type")
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int if kind == "integer" else int | float):
            return [f"{path}: not {kind}"]
        low, high = schema.get("minimum", value), schema.get("maximum", value)
        return [] if low <= value <= high else [f"{path}: {value} outside [{low}, {high}]"]
    if kind is not None and not isinstance(value, kinds[kind]):
        return [f"{path}: not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not in {schema['enum']}"]
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return [f"{path}: longer than {schema['maxLength']}"]
    errors = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{path}: {name} missing" for name in schema.get("required", ()) if name not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{path}: {name} not declared" for name in value if name not in props]
        for name, sub in value.items():
            if name in props:
                errors += schema_errors(sub, props[name], f"{path}.{name}")
    return errors


def _call_errors(call: Any) -> list[str]:
    """Why a returned call is not a valid call to a declared tool (empty: it is)."""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in BENCH_TOOLS}
    if call.function.name not in tools:
        return [f"{call.function.name!r} is not declared"]
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        return ["arguments are not JSON"]
    return schema_errors(arguments, {**tools[call.function.name], "additionalProperties": False})


def _constrained_rows(nodes: LocalNodes, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Through the openai client on the receiver: tool_choice required over the tool prompts, a strict
    json_schema over the person prompts; what each reply carried and whether it is valid."""
    import openai  # deferred: the dev extra's client

    client = openai.OpenAI(base_url=nodes.rx_url, api_key=LOCAL_TOKEN, max_retries=0, timeout=600)
    create: Any = client.chat.completions.create  # plain dicts for its typed parameters
    common = {"model": nodes.model, "max_tokens": max_tokens, "temperature": 0,
              "extra_body": {"cache_salt": "bench-c"}}
    tools_rows, json_rows = [], []
    for prompt in TOOL_PROMPTS[:n_prompts]:
        done = create(messages=[{"role": "user", "content": prompt}], tools=BENCH_TOOLS,
                      tool_choice="required", **common)
        calls = done.choices[0].message.tool_calls or []
        errors = [e for c in calls for e in _call_errors(c)]
        named = [[c.function.name, c.function.arguments] for c in calls]
        tools_rows.append({"prompt": prompt, "calls": named,
                           "content": done.choices[0].message.content, "valid": bool(calls) and not errors,
                           "errors": errors, "completion_tokens": done.usage.completion_tokens})
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    for prompt in PERSON_PROMPTS[:n_prompts]:
        done = create(messages=[{"role": "user", "content": f"{prompt} Give the person as JSON."}],
                      response_format=form, **common)
        text = done.choices[0].message.content or ""
        try:
            errors = schema_errors(json.loads(text), PERSON_SCHEMA)
        except ValueError:
            errors = ["not JSON"]
        json_rows.append({"prompt": prompt, "reply": text, "valid": not errors, "errors": errors,
                          "finish_reason": done.choices[0].finish_reason})
    return {"tool_choice_required": {"rows": tools_rows, "valid": sum(r["valid"] for r in tools_rows),
                                     "of": len(tools_rows)},
            "json_schema_strict": {"rows": json_rows, "valid": sum(r["valid"] for r in json_rows),
                                   "of": len(json_rows)}}


class _XGrammar:
    """xgrammar's matcher over the same JSON Schema, filling the model room's ``TokenMask`` (the same
    unpacking and in-place masking as llguidance's path: only the library's work differs)."""

    def __init__(self, runtime: Any, schema: str) -> None:
        import xgrammar  # deferred: optional, measured only where installed

        from pfec.common.model import constrained, decode  # deferred: torch

        state = constrained._state(runtime)
        info = xgrammar.TokenizerInfo.from_huggingface(runtime.tokenizer, vocab_size=state.n_vocab,
                                                       stop_token_ids=sorted(decode.stop_token_ids(runtime)))
        compiler = xgrammar.GrammarCompiler(info)
        started = time.perf_counter()
        self.compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        self.compile_s = time.perf_counter() - started
        self.n_vocab = state.n_vocab
        self.library = f"xgrammar {importlib.metadata.version('xgrammar')}"

    def matcher(self) -> Any:
        import xgrammar  # deferred: optional

        from pfec.common.model import constrained  # deferred: torch

        inner, mask = xgrammar.GrammarMatcher(self.compiled), constrained.TokenMask(self.n_vocab)

        class Matcher:
            def restrict(self, row: Any) -> None:
                inner.fill_next_token_bitmask(mask.bitmask, 0)
                mask.apply(row)

            def consume(self, token: int) -> None:
                if not inner.accept_token(token):
                    raise ValueError(f"xgrammar refused token {token}")

            @property
            def done(self) -> bool:
                return bool(inner.is_terminated())

        return Matcher()


def _timed_steps(runtime: Any, ids: list[int], max_tokens: int, grammar: Any) -> list[dict[str, float]]:
    """Greedy decoding as ``serving.complete`` does it (the reserved cache, ``forward_rows``, argmax), each
    step timed in parts: the forward pass, the pick, and with a grammar the mask (computed and applied to
    the logits in place) and the token's consumption. The same step without the grammar's parts is the
    unconstrained step, measured on the same step: a paired ratio, robust to the machine's drift."""
    import torch  # deferred: torch

    from pfec.common.model import decode, serving  # deferred: torch

    stops = decode.stop_token_ids(runtime)
    matcher = None if grammar is None else grammar.matcher()
    steps = []
    with torch.inference_mode():
        cache, masks, logits = serving.start_cache(runtime, None, ids, 0, max_tokens)
        position = len(ids)
        for _ in range(max_tokens):
            t0 = time.perf_counter()
            if matcher is not None:
                matcher.restrict(logits[0, -1])
            t1 = time.perf_counter()
            token = int(logits[0, -1].float().cpu().argmax())
            t2 = time.perf_counter()
            if token in stops:
                break
            if matcher is not None:
                matcher.consume(token)
            t3 = time.perf_counter()
            if matcher is not None and matcher.done:
                break
            logits = decode.forward_rows(runtime, masks, cache, [[token]], position, last_only=True)
            position += 1
            steps.append({"mask_s": t1 - t0, "pick_s": t2 - t1, "consume_s": t3 - t2,
                          "forward_s": time.perf_counter() - t3})
    return steps


def _overhead(runtime: Any, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """The constrained decode step against the unconstrained one, per library, over the person prompts
    with their strict schema: medians over every step, and the paired ratio (mask + consume) / (forward +
    pick). llguidance runs the product's path (``constrained.compile_grammar``); xgrammar, where
    installed, the same loop with its matcher."""
    from pfec.common.model import constrained, serving  # deferred: torch

    schema = json.dumps(PERSON_SCHEMA)
    prompts = [serving.chat_ids(runtime, [{"role": "user", "content": f"{p} Give the person as JSON."}])
               for p in PERSON_PROMPTS[:n_prompts]]
    libraries: dict[str, Any] = {}
    started = time.perf_counter()
    llg = constrained.compile_grammar(runtime, constrained.Grammar(content=schema))  # a cache miss: new text
    grammars: dict[str, Any] = {constrained.LIBRARY: llg}
    compile_s = {constrained.LIBRARY: time.perf_counter() - started}  # each library's tokenizer set-up apart
    skipped = {}
    if importlib.util.find_spec("xgrammar") is None:
        skipped["xgrammar"] = ("not installed (an optional measurement: xgrammar 0.2.9 pulls triton, 286 MB, "
                               "into a CPU install; pip install xgrammar==0.2.9 to measure it)")
    else:
        xgr = _XGrammar(runtime, schema)
        grammars[xgr.library] = xgr
        compile_s[xgr.library] = xgr.compile_s
    free: list[dict[str, float]] = []
    held: dict[str, list[dict[str, float]]] = {name: [] for name in grammars}
    for ids in prompts:  # interleaved: each prompt unconstrained, then under each library
        free += _timed_steps(runtime, ids, max_tokens, None)
        for name, grammar in grammars.items():
            held[name] += _timed_steps(runtime, ids, max_tokens, grammar)

    def step(s: dict[str, float]) -> float:
        return s["forward_s"] + s["pick_s"]

    base = statistics.median(step(s) for s in free)
    for name, steps in held.items():
        paired = [(s["mask_s"] + s["consume_s"]) / step(s) for s in steps]
        whole = statistics.median(step(s) + s["mask_s"] + s["consume_s"] for s in steps)
        libraries[name] = {
            "steps": len(steps), "compile_s": round(compile_s[name], 4),
            "mask_ms_median": round(statistics.median(s["mask_s"] for s in steps) * 1e3, 4),
            "consume_ms_median": round(statistics.median(s["consume_s"] for s in steps) * 1e3, 4),
            "step_ms_median": round(whole * 1e3, 3),
            "overhead_paired_median": round(statistics.median(paired), 4),
            "overhead_vs_unconstrained_median": round(whole / base - 1, 4),
            "meets_target": statistics.median(paired) <= OVERHEAD_TARGET,
        }
    return {"unconstrained_step_ms_median": round(base * 1e3, 3), "unconstrained_steps": len(free),
            "libraries": libraries, "skipped": skipped, "chosen": constrained.LIBRARY,
            "target_overhead": OVERHEAD_TARGET}
