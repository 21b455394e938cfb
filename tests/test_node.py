"""A node with both roles (issue 37 item 1): ``pfec node serve`` in one process, one model worker, one
prefix store, one control API with the sender's and the receiver's routes and the OpenAI API once, one
receiving UDP port, one metrics registry. Two nodes on loopback on the tiny model: a conversation node A
served is handed off to node B, whose OpenAI face continues it from the handed-off cache; the node's real
start-up path (``node.serve``) on synthetic KV hands off to itself; config errors name the field.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from test_openai_fields import TEMPLATE, TOKEN
from typer.testing import CliRunner

from pfec.cli.app import app
from pfec.common.codec import fec
from pfec.common.model import llm
from pfec.common.model.runtime import runtime_identity
from pfec.common.node.config import ConfigError
from pfec.common.node.control import ControlClient, ControlServer
from pfec.common.plan.handoff import synthetic_identity
from pfec.common.plan.kvlayout import KVGeometry
from pfec.node import serve as node_serve
from pfec.node.config import NodeDaemonConfig, load_node_config
from pfec.node.daemon import NodeDaemon, merge_routes

PSK = bytes(range(150, 182))
SMALL = KVGeometry(n_layers=4, n_kv_heads=2, head_dim=32, dtype="bf16")
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    fec.warm_up()


@pytest.fixture(scope="module")
def chat_tiny(tiny: llm.ModelRuntime) -> llm.ModelRuntime:
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TEMPLATE
    return tiny


def _config(**extra: Any) -> NodeDaemonConfig:
    """A loopback node: ephemeral receiving port, fixed pacing slow enough that a tiny context's deadline
    (rho x its serialisation) is tens of milliseconds on a loaded CPU, short completions."""
    return NodeDaemonConfig.model_validate({
        "udp": {"host": "127.0.0.1", "port": 0},
        "metrics": {"enabled": False},  # the control API's /metrics serves the same registry
        "link": {"rate_mbps": 2, "owd_ms": 1, "rate_control": "fixed"},
        "limits": {"max_completion_tokens": 8},
        **extra,
    })


@asynccontextmanager
async def _node(runtime: llm.ModelRuntime) -> AsyncIterator[tuple[NodeDaemon, str]]:
    """A node on the tiny model behind its control API on TCP (bearer token)."""
    node = NodeDaemon(_config(), runtime_identity(runtime), PSK, runtime=runtime, process_metrics=False)
    await node.start()
    server = ControlServer(node.routes())
    await server.start(None, ("127.0.0.1", 0), TOKEN)
    try:
        yield node, f"http://127.0.0.1:{server.tcp_port}"
    finally:
        await server.close()
        await node.close()


async def _settle(node: NodeDaemon) -> None:
    while node.worker.pending:  # the cache upkeep queued behind the last response
        await asyncio.sleep(0.01)


def _series(exposition: str) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every sample of an exposition as (name, labels)."""
    return [(s.name, tuple(sorted(s.labels.items())))
            for fam in text_string_to_metric_families(exposition) for s in fam.samples]


# --------------------------------------------------------------------------- two nodes, one handoff


def test_a_conversation_node_a_served_continues_on_node_b_from_the_handed_off_cache(
        chat_tiny: llm.ModelRuntime) -> None:
    """Node A serves a turn through its OpenAI API and hands the conversation (by its completion id) to node
    B's receiving port through A's ``POST /handoffs``; B's OpenAI API serves the next turn with the whole
    handed-off conversation as ``cached_tokens``. Each node answers every route of both roles once."""
    identity = runtime_identity(chat_tiny)
    salt = "team-n"

    async def main() -> None:
        async with _node(chat_tiny) as (a, a_url), _node(chat_tiny) as (b, b_url), aiohttp.ClientSession(
                headers=HEADERS) as http:

            async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
                data = None if body is None else json.dumps(body)
                async with http.request(method, url, data=data) as response:
                    return response.status, await response.json()

            # One node: the sender's, the receiver's and the OpenAI routes on one listener.
            for path in ("/handoffs", "/paths", "/sessions", "/results", "/v1/models", "/readyz"):
                status, body = await call("GET", a_url + path)
                assert status == 200, (path, body)
            status, health = await call("GET", a_url + "/healthz")
            assert health["role"] == "node" and health["udp"] == "{}:{}".format(*a.address), health
            assert a.sender.worker is a.receiver.worker is a.worker and a.sender.face is a.receiver.face
            messages = [{"role": "user", "content": "w5 w6 w7 w8 w9 w10"}]
            request = {"model": identity.model_id, "messages": messages, "max_tokens": 3, "temperature": 0,
                       "cache_salt": salt}
            status, reply = await call("POST", a_url + "/v1/chat/completions", request)
            assert status == 200, reply
            await _settle(a)
            target = "{}:{}".format(*b.address)
            status, created = await call("POST", a_url + "/handoffs", {
                "receiver": target, "rho": 4.0, "precision": "native", "handoff_mode": "handoff",
                "conversation": {"id": reply["id"]}})
            assert status == 202, created
            status, report = await call("GET", f"{a_url}/handoffs/{created['id']}?wait=60")
            assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0), report
            # A's store held the whole conversation: nothing was prefilled for the handoff.
            assert report["conversation"]["prefilled_tokens"] == 0, report
            await _settle(b)
            status, results = await call("GET", b_url + "/results")
            assert [r["session_id"] for r in results["results"]] == [report["session_id"]], results
            text = reply["choices"][0]["message"]["content"] or ""
            follow = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "w11"}]
            status, next_turn = await call("POST", b_url + "/v1/chat/completions", {**request,
                                                                                    "messages": follow})
            assert status == 200, next_turn
            assert next_turn["usage"]["prompt_tokens_details"]["cached_tokens"] == report["n_tokens"]
            assert next_turn["pfec"]["prefix"]["handoff_id"] == report["session_id"], next_turn["pfec"]
            # One registry per node: each role's series, the node's own facts once, no series twice.
            async with http.get(b_url + "/metrics") as response:
                exposition = await response.text()
            series = _series(exposition)
            assert len(series) == len(set(series)), [s for s in series if series.count(s) > 1]
            names = {name for name, _ in series}
            assert "pfec_sender_handoffs_total" in names and "pfec_receiver_sessions_total" in names
            assert not any(n.startswith("pfec_sender_prefix_cache") for n in names), names
            lookups = {labels: s.value for fam in text_string_to_metric_families(exposition)
                       for s in fam.samples if s.name == "pfec_receiver_prefix_cache_lookups_total"
                       for labels in [dict(s.labels)["outcome"]]}
            assert lookups["hit"] >= 1, lookups

    asyncio.run(main())


def test_a_node_hands_on_a_conversation_it_received_and_continued(chat_tiny: llm.ModelRuntime) -> None:
    """A chain A -> B -> C: B continues the conversation A handed it and hands the grown conversation on by
    the completion id B's API returned; C's first request for it (and a new turn) is served with the
    whole grown conversation as ``cached_tokens``."""
    identity = runtime_identity(chat_tiny)
    salt = "team-c"

    async def main() -> None:
        async with _node(chat_tiny) as (a, a_url), _node(chat_tiny) as (b, b_url), _node(chat_tiny) as (
                c, c_url), aiohttp.ClientSession(headers=HEADERS) as http:

            async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
                data = None if body is None else json.dumps(body)
                async with http.request(method, url, data=data) as response:
                    return response.status, await response.json()

            async def hand(url: str, node: NodeDaemon, to: NodeDaemon, cid: str) -> dict[str, Any]:
                await _settle(node)
                status, created = await call("POST", url + "/handoffs", {
                    "receiver": "{}:{}".format(*to.address), "rho": 4.0, "precision": "native",
                    "handoff_mode": "handoff", "conversation": {"id": cid}})
                assert status == 202, created
                _, report = await call("GET", f"{url}/handoffs/{created['id']}?wait=60")
                assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0)
                await _settle(to)
                return dict(report)

            turns = [{"role": "user", "content": "w5 w6 w7 w8 w9 w10"}]
            request = {"model": identity.model_id, "max_tokens": 3, "temperature": 0, "cache_salt": salt}
            chat = "/v1/chat/completions"
            status, first = await call("POST", a_url + chat, {**request, "messages": turns})
            assert status == 200, first
            to_b = await hand(a_url, a, b, first["id"])
            turns += [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "w11 w12"}]
            status, second = await call("POST", b_url + chat, {**request, "messages": turns})
            assert status == 200 and second["usage"]["prompt_tokens_details"]["cached_tokens"] == to_b[
                "n_tokens"], second
            to_c = await hand(b_url, b, c, second["id"])
            assert to_c["n_tokens"] > to_b["n_tokens"] and to_c["conversation"]["prefilled_tokens"] == 0, to_c
            turns += [{"role": "assistant", "content": second["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "w13"}]
            status, third = await call("POST", c_url + chat, {**request, "messages": turns})
            assert status == 200, third
            assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == to_c["n_tokens"], third
            assert third["pfec"]["prefix"]["handoff_id"] == to_c["session_id"], third["pfec"]
            # A conversation that leaves what B received early (its first message cut short): what B
            # holds of it goes on cut there, the rest computed again.
            status, created = await call("POST", b_url + "/handoffs", {
                "receiver": "{}:{}".format(*c.address), "rho": 4.0, "precision": "native",
                "handoff_mode": "handoff", "conversation": {
                    "messages": [{"role": "user", "content": "w5 w6 w7"}], "cache_salt": salt}})
            assert status == 202, created
            _, cut = await call("GET", f"{b_url}/handoffs/{created['id']}?wait=60")
            assert cut["outcome"] == "done", cut
            held = cut["conversation"]["missing_upstream"]
            assert held["n_tokens"] == cut["conversation"]["cached_tokens"] < to_b["n_tokens"], cut

    asyncio.run(main())


# --------------------------------------------------------------------------- the real start-up path


def test_node_serve_hands_off_to_its_own_receiving_port_through_one_control_socket(tmp_path: Path) -> None:
    """``node.serve`` (what ``pfec node serve`` runs) on synthetic KV: one control socket answers a handoff
    to the node's own receiving port, the session it received and the result; the node's registry has
    the process collector and the node-wide series once; stopping it closes the socket."""
    sock = tmp_path / "node.sock"
    config = NodeDaemonConfig.model_validate({
        "udp": {"host": "127.0.0.1", "port": 0}, "control": {"socket": str(sock)},
        "metrics": {"enabled": False}, "model": {"path": "synthetic"},
        "link": {"rate_mbps": 200, "owd_ms": 1, "rate_control": "fixed"}})

    async def main() -> tuple[dict[str, Any], dict[str, Any], list[Any], str]:
        stop = asyncio.Event()
        started: asyncio.Future[NodeDaemon] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(node_serve.serve(config, PSK, None, started.set_result, stop))
        await asyncio.wait([started, task], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # serve failed before it was ready: its error
        node = started.result()
        try:
            client = ControlClient(sock)
            target = "{}:{}".format(*node.address)
            status, created = await client.request("POST", "/handoffs", {
                "receiver": target, "synthetic_tokens": 64, "rho": 4.0, "generate": False})
            assert status == 202, created
            _, report = await client.request("GET", f"/handoffs/{created['id']}?wait=60")
            _, results = await client.request("GET", "/results")
            status, health = await client.request("GET", "/healthz")
            assert status == 200 and health["handoffs"] == 1 and health["datagrams_received"] > 0, health
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as http, \
                    http.get("http://node/metrics") as response:
                exposition = await response.text()
            return report, health, results["results"], exposition
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    report, _health, results, exposition = asyncio.run(main())
    assert report["outcome"] == "done" and report["recovered_utility"] == pytest.approx(1.0), report
    assert [r["session_id"] for r in results] == [report["session_id"]]
    series = _series(exposition)
    assert len(series) == len(set(series))
    names = [name for name, _ in series]
    assert names.count("pfec_prefill_tokens_per_second") == 1
    assert names.count("process_cpu_seconds_total") == 1
    assert not sock.exists() or not _listening(sock)


def _listening(sock: Path) -> bool:
    import socket  # deferred: only this check needs it

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        probe.close()


# --------------------------------------------------------------------------- one registry, one route table


def test_one_registry_holds_both_roles_and_the_node_wide_series_once() -> None:
    node = NodeDaemon(_config(model={"path": "synthetic"}), synthetic_identity(SMALL), PSK)
    try:
        node.sender_metrics.prefill_speed(123.0)  # either role's call lands in the one series
        series = _series(node.metrics.exposition().decode())
        assert len(series) == len(set(series)), [s for s in series if series.count(s) > 1]
        names = [name for name, _ in series]
        assert names.count("pfec_prefill_tokens_per_second") == 1
        assert names.count("pfec_torch_threads") == 1 and names.count("process_cpu_seconds_total") == 1
        assert "pfec_receiver_prefix_cache_bytes" in names
        assert not any(n.startswith(("pfec_sender_prefix_cache", "pfec_sender_serving")) for n in names)
        assert {"pfec_sender_datagrams_sent_total", "pfec_receiver_datagrams_received_total"} <= set(names)
        speed = [s.value for fam in text_string_to_metric_families(node.metrics.exposition().decode())
                 for s in fam.samples if s.name == "pfec_prefill_tokens_per_second"]
        assert speed == [123.0]
    finally:
        node.worker.shutdown()


def test_a_route_both_roles_define_is_an_error_not_a_shadow() -> None:
    async def a(_request: web.Request) -> web.Response:
        return web.Response()

    own = [web.get("/healthz", a)]
    merged = merge_routes(own, [web.get("/healthz", a), web.post("/handoffs", a)],
                          [web.get("/healthz", a), web.get("/sessions", a)])
    assert [(r.method, r.path) for r in merged] == [("GET", "/healthz"), ("POST", "/handoffs"),
                                                    ("GET", "/sessions")]
    with pytest.raises(ValueError, match="both roles define GET /results"):
        merge_routes(own, [web.get("/results", a)], [web.get("/results", a)])


# --------------------------------------------------------------------------- configuration


def test_node_config_takes_both_roles_tables_and_names_bad_fields(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text('reconstruction = "zero"\n[link]\nrate_mbps = 50\n[limits]\nmax_sessions = 3\n'
                   'max_request_bytes = 4096\n')
    config = load_node_config(cfg, {"PFEC_NODE__UDP__PORT": "7600"})
    assert config.udp.port == 7600 and config.reconstruction == "zero" and config.link.rate_mbps == 50
    assert config.limits.max_sessions == 3 and config.limits.max_request_bytes == 4096
    assert str(config.control.socket) == "/run/pfec/node.sock" and config.metrics.port == 9402
    # A partial [udp] table keeps the node's receiving port.
    cfg.write_text('[udp]\nhost = "127.0.0.1"\n')
    assert load_node_config(cfg, {}).udp.port == 7400
    cfg.write_text("[limits]\nmax_sesions = 3\n")
    with pytest.raises(ConfigError) as caught:
        load_node_config(cfg, {})
    text = str(caught.value)
    assert "invalid node configuration" in text and "limits.max_sesions" in text, text
    assert "max_sessions" in text and "allow_destinations" in text, text  # the valid keys of both roles
    with pytest.raises(ConfigError, match=r"fec\.scheme.*PFEC_NODE__FEC__SCHEME"):
        load_node_config(None, {"PFEC_NODE__FEC__SCHEME": "bogus"})


def test_node_serve_with_a_bad_config_prints_the_value_and_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text('reconstruction = "blur"\n')
    res = CliRunner().invoke(app, ["node", "serve", "--config", str(cfg)])
    assert res.exit_code == 2 and "reconstruction" in res.output and "blur" in res.output, res.output
