"""The OpenAI-compatible face of both daemons, through the real ``openai`` client over the control API's
TCP listener (bearer token), on the embedded default model: completions streaming and not, multi-turn
reuse of each turn's cache, salt isolation, refusals (400 naming the parameter, 404, 503 with
Retry-After), a conversation served on the sender, handed off over real UDP and continued on the
receiver from the handed-off cache (``cached_tokens`` equal to the handed-off context), and a
question/answer handoff's context left in the receiver's store under its cache salt.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.common.codec import fec
from pfec.common.model import llm, serving
from pfec.common.model.runtime import runtime_identity
from pfec.common.node.config import LimitsConfig, SenderLimitsConfig
from pfec.common.node.control import ControlClient, ControlServer
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon

pytestmark = pytest.mark.slow  # the default model: ~2 minutes on 2 cores
T = TypeVar("T")
PSK = bytes(range(7, 39))
TOKEN = "k" * 32
# A shared context of a few hundred tokens (the bench measures ~1.5k): short keeps the test fast.
CONTEXT = ("The lighthouse keeper on Skerry Island logs the weather at six every morning. " * 12
           + "The code word for the supply boat is 'heron'.")


class _Loop:
    """An event loop in a thread: the daemons run there, the (synchronous) openai client here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Nodes:
    def __init__(self, rx: ReceiverDaemon, tx: SenderDaemon, rx_port: int, tx_port: int, tx_sock: Path,
                 lt: _Loop) -> None:
        self.rx, self.tx, self.lt, self.tx_sock = rx, tx, lt, tx_sock
        self.rx_url, self.tx_url = f"http://127.0.0.1:{rx_port}/v1", f"http://127.0.0.1:{tx_port}/v1"
        self.model = rx.identity.model_id

    def client(self, url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    fec.warm_up()
    runtime = llm.load_model("default", device="cpu")
    identity = runtime_identity(runtime)
    sock = tmp_path_factory.mktemp("ctl") / "sender.sock"
    lt = _Loop()

    async def start() -> tuple[ReceiverDaemon, SenderDaemon, list[ControlServer]]:
        rx = ReceiverDaemon(identity, PSK, runtime=runtime,
                            limits=LimitsConfig(serving_queue=1, max_completion_tokens=64))
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=runtime, rate_mbps=400, owd_ms=1, rate_control="fixed",
                          limits=SenderLimitsConfig(max_completion_tokens=64))  # told rate = the link
        servers = [ControlServer(receiver_routes(rx)), ControlServer(sender_routes(tx))]
        await servers[0].start(None, ("127.0.0.1", 0), TOKEN)
        await servers[1].start(sock, ("127.0.0.1", 0), TOKEN)
        return rx, tx, servers

    rx, tx, servers = lt.call(start())
    assert servers[0].tcp_port is not None and servers[1].tcp_port is not None
    try:
        yield Nodes(rx, tx, servers[0].tcp_port, servers[1].tcp_port, sock, lt)
    finally:
        for server in servers:
            lt.call(server.close())
        lt.call(tx.close())
        lt.call(rx.close())
        lt.stop()


def _ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]], **extra: Any) -> Any:
    options: dict[str, Any] = {"max_tokens": 6, "temperature": 0, **extra}
    return client.chat.completions.create(model=model, messages=messages, **options)  # type: ignore[arg-type]


def test_turns_reuse_the_last_turns_cache_and_stream(nodes: Nodes) -> None:
    client = nodes.client(nodes.rx_url)
    assert [m.id for m in client.models.list().data] == [nodes.model]
    first = [{"role": "user", "content": "Name a colour."}]
    r1 = _ask(client, nodes.model, first)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 and r1.choices[0].message.content
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And another one?"}]
    r2 = _ask(client, nodes.model, second)
    runtime = nodes.rx.runtime
    assert runtime is not None
    turn_ends = len(serving.chat_ids(runtime, second[:2], add_generation_prompt=False))
    new_turn = len(serving.chat_ids(runtime, second)) - turn_ends
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # The whole first turn is served from its cache (the reply's unfed last token and the template's
    # end-of-turn marker were added behind the response): the second turn prefills only its own tokens.
    assert cached == turn_ends and r2.usage.prompt_tokens - cached == new_turn, (cached, turn_ends, r2.usage)
    assert r2.model_extra["pfec"]["prefix"]["completion_id"] == r1.id
    # Streaming: the same answer token by token, usage in the last chunk.
    chunks = list(client.chat.completions.create(model=nodes.model, messages=second, max_tokens=6,  # type: ignore[arg-type]
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r2.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    # Another tenant's salt sees none of it.
    other = _ask(client, nodes.model, second, extra_body={"cache_salt": "tenant-b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == r2.choices[0].message.content  # greedy: same tokens
    # Sampling is seeded: the same seed gives the same text.
    a, b = (_ask(client, nodes.model, first, temperature=0.9, top_p=0.9, seed=7).choices[0].message.content
            for _ in range(2))
    assert a == b
    done = client.completions.create(model=nodes.model, prompt="One, two, three,", max_tokens=4,
                                     temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 4


def test_bad_requests_get_a_4xx_naming_the_parameter(nodes: Nodes) -> None:
    client = nodes.client(nodes.rx_url)
    hello = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"n": 2}, openai.BadRequestError, "n"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, openai.BadRequestError,
         "tools.0.function.name"),
        ({"max_tokens": 65}, openai.BadRequestError, "max_tokens"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, openai.BadRequestError, "messages.0"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, openai.BadRequestError, "messages"),
        ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
        ({"extra_body": {"cache_salt": "x" * 300}}, openai.BadRequestError, "cache_salt"),
    ]
    for extra, error, param in cases:
        body: dict[str, Any] = {"model": nodes.model, "messages": hello, "max_tokens": 2, **extra}
        with pytest.raises(error) as caught:
            client.chat.completions.create(**body)
        assert caught.value.body["param"].startswith(param), (extra, caught.value.body)  # type: ignore[union-attr]
    # Bodies nested past the depth limit or past the size limit, and non-JSON, over plain HTTP.
    async def raw(data: bytes) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(headers=headers) as session, session.post(
                nodes.rx_url + "/chat/completions", data=data) as response:
            return response.status, await response.json(content_type=None)

    deep = b'{"model": "m", "messages": ' + b"[" * 40 + b"]" * 40 + b"}"
    for data, status in ((deep, 400), (b"not json", 400), (b'{"x": "' + b"a" * (2 << 20) + b'"}', 413)):
        got, answer = nodes.lt.call(raw(data))
        assert got == status and answer["error"]["message"], (got, answer)
    # Unauthenticated over TCP: 401.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=nodes.rx_url, api_key="wrong", max_retries=0).models.list()


def test_a_full_serving_queue_answers_503_with_retry_after(nodes: Nodes) -> None:
    url = nodes.rx_url + "/chat/completions"
    body = {"model": nodes.model, "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 12, "temperature": 0}

    async def two() -> tuple[int, int, str | None]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            first = asyncio.ensure_future(session.post(url, json=body))
            await asyncio.sleep(0.3)  # the first is in the worker now (serving_queue = 1)
            async with session.post(url, json=body) as second:
                status, retry = second.status, second.headers.get("Retry-After")
            async with await first as response:
                return response.status, status, retry

    ok, busy, retry = nodes.lt.call(two())
    assert (ok, busy) == (200, 503) and retry is not None and int(retry) >= 1


def test_a_conversation_handed_off_continues_on_the_receiver_from_its_cache(nodes: Nodes) -> None:
    sender, receiver = nodes.client(nodes.tx_url), nodes.client(nodes.rx_url)
    salt = {"cache_salt": "team-a"}
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": CONTEXT + "\n\nWhat is the code word for the supply boat?"}]
    upstream = _ask(sender, nodes.model, messages, extra_body=salt)
    control = ControlClient(nodes.tx_sock)
    target = "{}:{}".format(*nodes.rx.address)
    unknown = {"receiver": target, "conversation": {"id": "chatcmpl-none"}}
    status, bad = nodes.lt.call(control.request("POST", "/handoffs", unknown))
    assert status == 404 and "conversation.id" in bad["error"]
    nobody = {"receiver": target, "conversation": {"messages": messages, "cache_salt": "nobody"}}
    status, bad = nodes.lt.call(control.request("POST", "/handoffs", nobody))
    assert status == 404 and "conversation.cache_salt" in bad["error"], bad
    status, created = nodes.lt.call(control.request("POST", "/handoffs", {
        "receiver": target, "conversation": {"id": upstream.id}, "rho": 4.0, "precision": "native",
        "handoff_mode": "handoff"}))
    assert status == 202, created
    status, report = nodes.lt.call(control.request("GET", f"/handoffs/{created['id']}?wait=1"))
    assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0), report
    handed = report["conversation"]
    # The sender's store held the whole conversation: nothing was prefilled for the handoff.
    assert handed["n_tokens"] == report["n_tokens"] and handed["prefilled_tokens"] == 0, handed
    follow = [*messages, {"role": "assistant", "content": upstream.choices[0].message.content},
              {"role": "user", "content": "Say it again in capitals."}]
    downstream = _ask(receiver, nodes.model, follow, extra_body=salt)
    assert downstream.usage.prompt_tokens_details.cached_tokens == report["n_tokens"]
    prefix = downstream.model_extra["pfec"]["prefix"]
    assert prefix["handoff_id"] == report["session_id"] and prefix["precision"] == "native"
    assert prefix["recovered_utility"] == pytest.approx(1.0)
    # Without the conversation's salt the handed-off cache is not reachable.
    stranger = _ask(receiver, nodes.model, follow)
    assert stranger.usage.prompt_tokens_details.cached_tokens < 16
    # The same conversation again, quantised (int8): the receiver serves it from the dequantised cache and
    # says so; the next turn reuses that entry (it supersedes nothing of another salt).
    status, created = nodes.lt.call(control.request("POST", "/handoffs", {
        "receiver": target, "conversation": {"messages": messages, "cache_salt": "team-b"}, "rho": 4.0,
        "precision": "int8", "handoff_mode": "handoff"}))
    assert status == 404  # team-b never served it on the sender: nothing to hand over without a prefill
    upstream_b = _ask(sender, nodes.model, messages, extra_body={"cache_salt": "team-b"})
    status, created = nodes.lt.call(control.request("POST", "/handoffs", {
        "receiver": target, "conversation": {"id": upstream_b.id}, "rho": 4.0, "precision": "int8",
        "handoff_mode": "handoff"}))
    status, report_b = nodes.lt.call(control.request("GET", f"/handoffs/{created['id']}?wait=1"))
    assert report_b["outcome"] == "done" and report_b["precision"] == "int8", report_b
    follow_b = [*messages, {"role": "assistant", "content": upstream_b.choices[0].message.content},
                {"role": "user", "content": "Say it again in capitals."}]
    quantised = _ask(receiver, nodes.model, follow_b, extra_body={"cache_salt": "team-b"})
    assert quantised.usage.prompt_tokens_details.cached_tokens == report_b["n_tokens"]
    assert quantised.model_extra["pfec"]["prefix"]["precision"] == "int8"
    # A deadline too short for the whole cache (rho 0.4 at 20 Mbit/s, no repair): a partial cache, served
    # with its mask at the context's full length, and the response says what it was built from.
    upstream_c = _ask(sender, nodes.model, messages, extra_body={"cache_salt": "team-c"})
    status, created = nodes.lt.call(control.request("POST", "/handoffs", {
        "receiver": target, "conversation": {"id": upstream_c.id}, "rho": 0.4, "rate_mbps": 20,
        "scheme": "priority", "precision": "native", "handoff_mode": "handoff"}))
    status, report_c = nodes.lt.call(control.request("GET", f"/handoffs/{created['id']}?wait=1"))
    assert report_c["outcome"] == "done" and 0 < report_c["recovered_utility"] < 1, report_c
    follow_c = [*messages, {"role": "assistant", "content": upstream_c.choices[0].message.content},
                {"role": "user", "content": "Say it again in capitals."}]
    partial = _ask(receiver, nodes.model, follow_c, extra_body={"cache_salt": "team-c"})
    assert partial.usage.prompt_tokens_details.cached_tokens == report_c["n_tokens"]
    built_from = partial.model_extra["pfec"]["prefix"]
    assert built_from["recovered_utility"] == pytest.approx(report_c["receiver_recovered_utility"])
    # The CLI names a conversation the same way.
    cli = CliRunner().invoke(app, ["handoff", "--receiver", target, "--conversation", upstream.id,
                                   "--socket", str(nodes.tx_sock), "--precision", "native",
                                   "--mode", "handoff", "--rho", "4"])
    assert cli.exit_code == 0 and "tokens handed over (0 prefilled for it" in cli.output, cli.output
    metrics = nodes.rx.metrics.exposition().decode()
    assert 'pfec_receiver_prefix_cache_lookups_total{outcome="hit"}' in metrics


def test_a_client_leaving_mid_stream_frees_the_node(nodes: Nodes) -> None:
    url = nodes.rx_url + "/chat/completions"
    body = {"model": nodes.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 64, "temperature": 0, "stream": True}

    async def leave() -> tuple[int, int]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            response = await session.post(url, json=body)
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data: ")
                if seen >= 3:  # the role chunk and two pieces of text
                    break
            response.close()
        face = nodes.rx.face
        assert face is not None
        for _ in range(200):  # the job stops at its next token once the client is gone
            if face.in_flight == 0 and nodes.rx.worker.pending == 0:
                break
            await asyncio.sleep(0.05)
        return face.in_flight, nodes.rx.worker.pending

    assert nodes.lt.call(leave()) == (0, 0)
    again = _ask(nodes.client(nodes.rx_url), nodes.model, [{"role": "user", "content": "hi"}])
    assert again.choices[0].finish_reason in ("stop", "length")


def _handoff(nodes: Nodes, body: dict[str, Any]) -> dict[str, Any]:
    """POST a handoff to the sender (its UNIX socket), wait for its report."""
    control = ControlClient(nodes.tx_sock)
    full = {"receiver": "{}:{}".format(*nodes.rx.address), "rho": 4.0, "precision": "native", **body}
    status, created = nodes.lt.call(control.request("POST", "/handoffs", full))
    assert status == 202, created
    status, report = nodes.lt.call(control.request("GET", f"/handoffs/{created['id']}?wait=1"))
    assert status == 200 and report["outcome"] == "done", report
    return dict(report)


def _kept_context(nodes: Nodes, salt: str, context: list[int]) -> llm.PartialKV:
    """The receiver's stored entry for ``context`` under ``salt``: it holds the context's tokens, no more
    (not the cache the answer's decoding extended)."""
    face = nodes.rx.face
    assert face is not None
    match = face.store.lookup(salt, context, face.clock(), count=False)
    assert match is not None and match.tokens == len(context)
    assert match.entry.n_tokens == len(context), "the entry is not the context's"
    kv = match.entry.value
    assert kv.n_context == len(context)
    assert {k.shape[2] for k in kv.keys} == {v.shape[2] for v in kv.values} == {len(context)}
    assert kv.row_masks is None or all(m is None or m.shape[-1] == len(context) for m in kv.row_masks)
    return kv


def test_a_question_answer_handoff_leaves_its_context_in_the_receivers_prefix_cache(nodes: Nodes) -> None:
    """Issue 22 item 2 for a question/answer handoff: after its answer (the sender's own from its intact
    cache), the receiver keeps the rebuilt context under the handoff's cache salt, at the context's length;
    a chat request whose rendering starts with the context reuses all of it, another salt none. A split
    (the front computed on the receiver, joined) and no salt (the shared namespace) the same way."""
    runtime = nodes.rx.runtime
    assert runtime is not None
    question = "What is the code word for the supply boat?"
    context = list(llm.chat_prompt(runtime, CONTEXT, question).context_ids)
    report = _handoff(nodes, {"context": CONTEXT, "question": question, "cache_salt": "qa-team",
                              "handoff_mode": "handoff", "full_kv_answer": True})
    assert report["n_tokens"] == len(context) and report["prefix_offered"] is True, report
    assert report["answer"] == report["full_kv_answer"], report
    record = next(r for r in nodes.rx.handoffs.results if r["session_id"] == report["session_id"])
    assert record["prefix_kept"] is True and record["answer"] == report["answer"]
    _kept_context(nodes, "qa-team", context)
    # The chat template renders the context's user turn ending "\n\n" as the handoff's split did only
    # when the question is a turn of its own (one user turn "context\n\nquestion" merges the newlines
    # with what follows: all but the context's last token would match).
    follow = [{"role": "system", "content": llm.DEFAULT_SYSTEM},
              {"role": "user", "content": CONTEXT + "\n\n"}, {"role": "user", "content": question}]
    assert serving.chat_ids(runtime, follow)[: len(context)] == context
    receiver = nodes.client(nodes.rx_url)
    other = _ask(receiver, nodes.model, follow, extra_body={"cache_salt": "qa-other"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    reply = _ask(receiver, nodes.model, follow, extra_body={"cache_salt": "qa-team"})
    assert reply.usage.prompt_tokens_details.cached_tokens == len(context)
    built_from = reply.model_extra["pfec"]["prefix"]
    assert built_from["handoff_id"] == report["session_id"] and built_from["precision"] == "native"
    assert built_from["recovered_utility"] == pytest.approx(1.0)
    # A split, no salt: the receiver prefilled the front itself; the entry is the joined context.
    split = _handoff(nodes, {"context": CONTEXT, "question": question, "handoff_mode": "split",
                             "full_kv_answer": True})
    assert split["handoff_mode"] == "split" and split["prefix_offered"] is True, split
    assert split["answer"] == split["full_kv_answer"], split
    _kept_context(nodes, "", context)
    shared = _ask(receiver, nodes.model, follow)
    assert shared.usage.prompt_tokens_details.cached_tokens == len(context)
    assert shared.model_extra["pfec"]["prefix"]["handoff_id"] == split["session_id"]
    cli = CliRunner().invoke(app, ["handoff", "--receiver", "{}:{}".format(*nodes.rx.address), "--context",
                                   CONTEXT, "--question", question, "--cache-salt", "qa-cli", "--socket",
                                   str(nodes.tx_sock), "--precision", "native", "--mode", "handoff",
                                   "--rho", "4"])
    assert cli.exit_code == 0, cli.output
    _kept_context(nodes, "qa-cli", context)
