"""The agent frameworks as their users run them (issue 38 item 6), against both daemons on the embedded
default model (real UDP between them): the OpenAI Agents SDK through ``OpenAIChatCompletionsModel`` and
through its default model class (``OpenAIResponsesModel``, what ``Agent(model="...")`` gets from the
default provider), langchain-openai's ``ChatOpenAI``, LangGraph's ``create_react_agent``. Nothing in a
framework changes and no request carries a field of ours: the nodes run with
``limits.force_include_usage`` (their operator's setting) so that streamed runs report usage.

The embedded 135M model does not choose a tool on its own (tried: plain questions, system prompts asking
for a call, few-shot histories). Under ``tool_choice`` auto a tool turn here dictates the call
(``dictate``): what it proves is the path around the model, not the model's choice (the framework's tool
declaration reaches the node, the node's Hermes parser turns the reply into ``tool_calls`` the framework
accepts, the framework runs the function and sends its result back, the node serves that turn from the
first one's cache). Under ``tool_choice`` required, constrained decoding makes the model call a tool to a
plain question; structured output (``output_type``, ``with_structured_output``) is constrained too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    RunConfig,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.responses import ResponseTextDeltaEvent
from pydantic import BaseModel

from pfec.common.node.config import LimitsConfig, SenderLimitsConfig

pytestmark = [pytest.mark.slow,  # loads the default model; each test runs a few real requests (~5-60 s)
              pytest.mark.filterwarnings("ignore:create_react_agent has been moved")]

TOKEN = "frameworks-token-0123456789abcdef"
PSK = bytes(range(90, 122))
APIS = ["chat", "responses"]
CALLS: list[str] = []  # the cities get_weather was called for, in order


def dictate(name: str, arguments: dict[str, str]) -> str:
    """A user turn that makes the 135M model write the call (it copies it), in the Hermes form."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"Say exactly this and nothing else:\n<tool_call>\n{call}\n</tool_call>"


def weather(city: str) -> str:
    CALLS.append(city)
    return f"sunny, 24 C in {city}"


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return weather(city)


@tool("get_weather")
def lc_get_weather(city: str) -> str:
    """The current weather in a city."""
    return weather(city)


class Weather(BaseModel):
    city: str
    temperature_c: int


@dataclass
class Nodes:
    """Both daemons: their /v1 bases (A the sender, B the receiver), the sender's control API and the
    receiver's UDP address."""

    a: str
    b: str
    control: str
    udp: str
    model: str
    loop: asyncio.AbstractEventLoop

    def base(self, node: str) -> str:
        return self.a if node == "a" else self.b

    def control_call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import urllib.request  # deferred: only the handoff tests call the control API

        request = urllib.request.Request(self.control + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return dict(json.loads(response.read()))


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    """A receiver and a sender daemon on the default model in a loop thread, their control APIs (and so
    their /v1) on loopback TCP, both with ``limits.force_include_usage``."""
    from pfec.common.codec import fec  # deferred: numba
    from pfec.common.model.runtime import load_runtime  # deferred: torch
    from pfec.common.node.control import ControlServer  # deferred: the daemons
    from pfec.receiver.control import receiver_routes  # deferred: the daemons
    from pfec.receiver.daemon import ReceiverDaemon  # deferred: the daemons
    from pfec.sender.control import sender_routes  # deferred: the daemons
    from pfec.sender.daemon import SenderDaemon  # deferred: the daemons

    set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers, which a node is not
    fec.warm_up()
    runtime, identity = load_runtime("default", "cpu")
    assert runtime is not None
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[Any, Any, list[ControlServer]]:
        rx = ReceiverDaemon(identity, PSK, runtime=runtime, limits=LimitsConfig(force_include_usage=True))
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=runtime, rate_mbps=100.0, owd_ms=1, rate_control="fixed",
                          limits=SenderLimitsConfig(force_include_usage=True))
        servers = [ControlServer(receiver_routes(rx)), ControlServer(sender_routes(tx))]
        for server in servers:
            await server.start(None, ("127.0.0.1", 0), TOKEN)
        return rx, tx, servers

    rx, tx, servers = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    b, a = (f"http://127.0.0.1:{s.tcp_port}" for s in servers)
    try:
        yield Nodes(a + "/v1", b + "/v1", a, "{}:{}".format(*rx.address), runtime.model_id, loop)
    finally:
        async def stop() -> None:
            for server in servers:
                await server.close()
            await tx.close()
            await rx.close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


# --------------------------------------------------------------------------- the OpenAI Agents SDK


def client(nodes: Nodes, node: str) -> openai.AsyncOpenAI:
    """The node's client; closed by ``async with`` inside the run's loop."""
    return openai.AsyncOpenAI(base_url=nodes.base(node), api_key=TOKEN, max_retries=0)


def sdk_agent(nodes: Nodes, node_client: openai.AsyncOpenAI, api: str, **kwargs: Any,
              ) -> tuple[Agent[Any], RunConfig]:
    """An agent on a node: ``OpenAIChatCompletionsModel``, or the model name alone through the SDK's
    default provider (``OpenAIResponsesModel``) given the node's client."""
    settings = kwargs.pop("model_settings", ModelSettings(max_tokens=24, temperature=0))
    if api == "chat":
        return (Agent(name="Assistant", model=OpenAIChatCompletionsModel(nodes.model, node_client),
                      model_settings=settings, **kwargs), RunConfig())
    return (Agent(name="Assistant", model=nodes.model, model_settings=settings, **kwargs),
            RunConfig(model_provider=OpenAIProvider(openai_client=node_client)))


async def sdk_run(agent: Agent[Any], config: RunConfig, text: str, stream: bool,
                  max_turns: int = 4) -> tuple[RunResult | RunResultStreaming, str]:
    """A run, streamed or not: the result and the text its stream's deltas carried ("" unstreamed)."""
    if not stream:
        return await Runner.run(agent, text, run_config=config, max_turns=max_turns), ""
    result = Runner.run_streamed(agent, text, run_config=config, max_turns=max_turns)
    deltas = [event.data.delta async for event in result.stream_events()
              if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)]
    return result, "".join(deltas)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("node", ["a", "b"])
@pytest.mark.parametrize("api", APIS)
def test_agents_sdk_plain_turn(nodes: Nodes, api: str, node: str, stream: bool) -> None:
    """A turn and the same turn again: text (streamed: the deltas make the text), usage (streamed too),
    and the second turn served from the first's cache."""

    async def main() -> None:
        async with client(nodes, node) as node_client:
            agent, config = sdk_agent(nodes, node_client, api,
                                      instructions=f"You are a helpful assistant ({api}, {node}).")
            for turn in range(2):
                result, streamed = await sdk_run(agent, config, "What is the capital of France?", stream)
                text = str(result.final_output)
                assert text.strip() and (not stream or streamed == text), (text, streamed)
                usage = result.raw_responses[-1].usage
                assert usage.input_tokens > 10 and usage.output_tokens > 0, usage
                if turn == 1:  # all but the prompt's last token, which is fed to get the first logits
                    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1, usage

    asyncio.run(main())


@pytest.mark.parametrize(("node", "stream"), [("a", False), ("b", True)])
@pytest.mark.parametrize("api", APIS)
def test_agents_sdk_tool_turn(nodes: Nodes, api: str, node: str, stream: bool) -> None:
    """The model's call comes back as a function call the SDK runs; the tool's result goes back to the
    node, which serves that request from the first one's cache."""
    CALLS.clear()

    async def main() -> None:
        async with client(nodes, node) as node_client:
            agent, config = sdk_agent(nodes, node_client, api, instructions="You are a helpful assistant.",
                                      tools=[get_weather],
                                      model_settings=ModelSettings(max_tokens=40, temperature=0))
            result, _ = await sdk_run(agent, config, dictate("get_weather", {"city": "Paris"}), stream)
        assert CALLS == ["Paris"]
        assert [item.type for item in result.new_items] == [
            "tool_call_item", "tool_call_output_item", "message_output_item"]
        first, second = result.raw_responses
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, second.usage

    asyncio.run(main())


@pytest.mark.parametrize("api", APIS)
def test_agents_sdk_tool_choice_required_calls_a_tool_unprompted(nodes: Nodes, api: str) -> None:
    CALLS.clear()

    async def main() -> RunResult | RunResultStreaming:
        async with client(nodes, "a") as node_client:
            required = ModelSettings(max_tokens=40, temperature=0, tool_choice="required")
            agent, config = sdk_agent(nodes, node_client, api, instructions="You are a helpful assistant.",
                                      tools=[get_weather], model_settings=required)
            return (await sdk_run(agent, config, "What is the weather in Paris?", False))[0]

    result = asyncio.run(main())
    assert len(CALLS) == 1 and isinstance(CALLS[0], str)
    assert [item.type for item in result.new_items][:2] == ["tool_call_item", "tool_call_output_item"]


@pytest.mark.parametrize("api", APIS)
def test_agents_sdk_output_type_is_structured_output(nodes: Nodes, api: str) -> None:
    async def main() -> RunResult | RunResultStreaming:
        async with client(nodes, "b") as node_client:
            agent, config = sdk_agent(nodes, node_client, api, instructions="Report the weather.",
                                      output_type=Weather,
                                      model_settings=ModelSettings(max_tokens=40, temperature=0))
            return (await sdk_run(agent, config, "It is 24 C in Paris.", False))[0]

    assert isinstance(asyncio.run(main()).final_output, Weather)


# --------------------------------------------------------------------------- langchain-openai, LangGraph


def chat_model(nodes: Nodes, node: str, max_tokens: int = 24) -> ChatOpenAI:
    return ChatOpenAI(model=nodes.model, base_url=nodes.base(node), api_key=TOKEN,  # type: ignore[arg-type]
                      temperature=0, max_tokens=max_tokens, max_retries=0)  # type: ignore[call-arg]


def usage_of(message: BaseMessage) -> dict[str, Any]:
    assert isinstance(message, AIMessage) and message.usage_metadata is not None, message
    return dict(message.usage_metadata)


@pytest.mark.parametrize("node", ["a", "b"])
def test_langchain_plain_turn_whole_and_streamed(nodes: Nodes, node: str) -> None:
    llm = chat_model(nodes, node)
    question = [HumanMessage(f"What is the capital of France? ({node})")]
    whole = llm.invoke(question)
    assert isinstance(whole.content, str) and whole.content.strip()
    assert usage_of(whole)["input_tokens"] > 5 and usage_of(whole)["output_tokens"] > 0
    chunks = list(llm.stream(question))
    assert "".join(str(c.content) for c in chunks) == whole.content  # temperature 0: the same reply
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]  # the node's force_include_usage
    assert len(usage) == 1 and usage[0]["input_token_details"]["cache_read"] == usage[0]["input_tokens"] - 1


@pytest.mark.parametrize(("node", "stream"), [("a", True), ("b", False)])
def test_langchain_bind_tools_turn(nodes: Nodes, node: str, stream: bool) -> None:
    llm = chat_model(nodes, node, max_tokens=40).bind_tools([lc_get_weather])
    question = [HumanMessage(dictate("get_weather", {"city": "Paris"}))]
    if stream:
        chunks = list(llm.stream(question))
        reply: Any = chunks[0]
        for chunk in chunks[1:]:
            reply = reply + chunk
    else:
        reply = llm.invoke(question)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert reply.tool_calls[0]["id"].startswith("call_")


def test_langchain_bind_tools_required_and_structured_output(nodes: Nodes) -> None:
    llm = chat_model(nodes, "a", max_tokens=40)
    forced = llm.bind_tools([lc_get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert isinstance(forced, AIMessage) and [c["name"] for c in forced.tool_calls] == ["get_weather"]
    structured = llm.with_structured_output(Weather).invoke("It is 24 C in Paris.")
    assert isinstance(structured, Weather)


def test_langgraph_react_agent_tool_turn_then_a_handoff_continued_on_the_receiver(nodes: Nodes) -> None:
    """LangGraph's prebuilt ReAct agent on node A calls its tool and answers; the conversation is handed
    off by the completion id LangChain keeps (``response_metadata["id"]``); the same agent on node B
    continues it, its first request served from the handed-off cache."""
    from langgraph.prebuilt import create_react_agent  # deferred: langgraph's prebuilt agents

    CALLS.clear()
    on_a = create_react_agent(chat_model(nodes, "a", max_tokens=40), [lc_get_weather])
    out = on_a.invoke({"messages": [HumanMessage(dictate("get_weather", {"city": "Paris"}))]},
                      {"recursion_limit": 6})
    messages = out["messages"]
    assert CALLS == ["Paris"] and [m.type for m in messages] == ["human", "ai", "tool", "ai"], messages
    created = nodes.control_call("POST", "/handoffs", {
        "receiver": nodes.udp, "conversation": {"id": messages[-1].response_metadata["id"]},
        "precision": "native", "handoff_mode": "handoff", "rho": 1.5})
    report = nodes.control_call("GET", f"/handoffs/{created['id']}?wait=1")
    assert report["outcome"] == "done" and report["conversation"]["prefilled_tokens"] == 0, report
    on_b = create_react_agent(chat_model(nodes, "b", max_tokens=12), [lc_get_weather])
    out = on_b.invoke({"messages": [*messages, HumanMessage("Write one short sentence for the team.")]},
                      {"recursion_limit": 6})
    first_on_b = out["messages"][len(messages) + 1]
    assert usage_of(first_on_b)["input_token_details"]["cache_read"] == report["n_tokens"], report
