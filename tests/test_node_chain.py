"""Chains (issue 37 item 2): a node hands on what it received. The OFFER carries, per block, whether the
sender holds it and at which level (``HeldBlocks``); a block lost upstream is not streamed and the next
receiver masks it; nothing that arrived quantised is quantised again below that level; the receiver's
result and the ``pfec.prefix`` of the next request say how much was missing and on which hop it was lost.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np
import pytest
from test_node import HEADERS, _node, _settle
from test_openai_fields import TEMPLATE

from pfec.common.model import llm
from pfec.common.model.runtime import runtime_identity
from pfec.common.plan.handoff import OfferApp, PrefixOffer, SplitOffer
from pfec.common.plan.kvlayout import BlockPlan, KVGeometry
from pfec.common.plan.pieces import HeldBlocks, Level, held_after_hop
from pfec.common.plan.stream import fidelity_named
from pfec.common.plan.utility import synthetic_profile
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.emulator.relay import UdpRelay
from pfec.lab.sim.channel import Bernoulli
from pfec.node.daemon import NodeDaemon
from pfec.receiver.rebuild import Front, StreamPlan, compute_front, reconstruct
from pfec.sender.kv import ContextInput, PrecisionRequest, Prefilled, _below_held, plan_stream, prepare_model

GEOMETRY = KVGeometry(n_layers=3, n_kv_heads=2, head_dim=16, dtype="bf16")
N, H, I4, I8 = Level.NONE, Level.NATIVE, Level.INT4, Level.INT8


@pytest.fixture(scope="module")
def chat_tiny(tiny: llm.ModelRuntime) -> llm.ModelRuntime:
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TEMPLATE
    return tiny


# --------------------------------------------------------------------------- the OFFER's held blocks


def test_held_blocks_round_trip_run_length_and_say_what_is_missing_where() -> None:
    levels = (H, H, N, H, H, H, I4, I4, N)  # 3 layers x 3 token blocks (40 tokens: the last block 8)
    held = HeldBlocks(40, 3, levels, (1,))
    data = held.to_json()
    assert data["runs"] == [H, 2, N, 1, H, 3, I4, 2, N, 1] and data["hops"] == [1]
    assert HeldBlocks.from_json(json.loads(json.dumps(data)), 40) == held
    missing = held.missing()
    assert missing["blocks_missing"] == 2 and missing["lost_by_hop"] == [1] and missing["blocks"] == 9
    assert missing["tokens_missing"] == [[32, 40]]  # token block 2: layers 0 and 2
    # A longer context (this node's own turns after it) is computed here: native past the held tokens.
    plan = runtime_plan(70)
    got = held.block_levels(plan).reshape(3, 5)
    assert got[:, :3].tolist() == np.asarray(levels).reshape(3, 3).tolist() and (got[:, 3:] == H).all()


def runtime_plan(n_tokens: int) -> BlockPlan:
    return BlockPlan(GEOMETRY, n_tokens, 1028)


def test_a_held_map_cut_where_a_conversation_left_the_received_context() -> None:
    held = HeldBlocks(40, 3, (H, N, I4, H, H, H, N, H, I4), (2,))
    assert held.truncated(20).levels == (H, N, H, H, N, H) and held.truncated(20).hops_lost == (2,)
    assert held.truncated(40) == held
    with pytest.raises(ValueError, match="cannot cut"):
        held.truncated(41)


@pytest.mark.parametrize("bad, field", [
    ({"n": 41, "layers": 3, "runs": [4, 9], "hops": []}, "held n"),  # beyond the context
    ({"n": 40, "layers": 3, "runs": [4, 8], "hops": []}, "held runs"),  # covers 8 of 9 blocks
    ({"n": 40, "layers": 3, "runs": [5, 9], "hops": []}, "held runs"),  # no level 5
    ({"n": 40, "layers": 3, "runs": [4, 10, 0, -1], "hops": []}, "held runs"),  # a negative count
    ({"n": 40, "layers": 3, "runs": [4, 1 << 40], "hops": []}, "held runs"),  # one huge run
    ({"n": 40, "layers": 3, "runs": [4, True, 4, 8], "hops": []}, "held runs"),  # a bool is no count
    ({"n": 40, "layers": 3, "runs": [4, 9], "hops": [0] * 65}, "held hops"),
    ({"n": 40, "layers": 3, "runs": [4, 9], "hops": [10]}, "held hops"),  # more than the blocks
    ({"n": 40, "layers": 0, "runs": [], "hops": []}, "held layers"),
    ({"n": 40, "layers": 3, "runs": [4, 9]}, "held: expected"),
])
def test_a_hostile_held_map_is_refused_naming_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        HeldBlocks.from_json(bad, 40)


def test_the_offer_carries_the_held_map_and_refuses_it_beside_a_split() -> None:
    held = HeldBlocks(20, 3, (H, N, H, H, I4, H), (1,))
    app = OfferApp(40, (), generate=False, prefix=PrefixOffer("s", tuple(range(3, 43))), held=held)
    assert OfferApp.decode(app.encode()).held == held
    assert OfferApp.decode(OfferApp(40, (5,)).encode()).held is None  # no chain: the blob as before
    split = OfferApp(40, (5,), split=SplitOffer(16, tuple(range(3, 43))), held=held)
    with pytest.raises(ValueError, match="OFFER held: a split"):
        OfferApp.decode(split.encode())


def test_what_a_node_holds_after_a_hop_is_bounded_by_what_its_sender_held() -> None:
    plan = runtime_plan(40)
    upstream = HeldBlocks(40, 3, (H, N, H, I4, H, H, H, H, N), (2,))
    arrived = np.array([H, N, H, H, H, N, H, H, N], dtype=np.int8)  # lost here: 5 (1 and 8 were not sent)
    after = held_after_hop(plan, arrived, upstream)
    assert after.levels == (H, N, H, I4, H, N, H, H, N)  # never above what the sender held (block 3: int4)
    assert after.hops_lost == (2, 1)  # the first hop's two, this hop's one (blocks 1 and 8 were not sent)
    first = held_after_hop(plan, arrived, None)
    assert first.hops_lost == (3,) and first.levels == tuple(arrived)


def test_a_block_that_arrived_quantised_is_never_planned_below_its_level(tiny: llm.ModelRuntime) -> None:
    identity = runtime_identity(tiny)
    plan = identity.plan(64)
    utilities = np.linspace(1.0, 0.1, plan.n_blocks)
    int4 = plan_stream(identity, 64, "int4", utilities, "utility")
    held = np.full(plan.n_blocks, H, dtype=np.int8)
    assert not _below_held(int4, held)  # native held blocks are quantised once, as in any handoff
    held[3] = I8
    assert _below_held(int4, held)  # an int8 block is not quantised again at int4
    held[3] = I4
    assert not _below_held(int4, held)  # at its own level it is not below
    held[3] = N
    assert not _below_held(int4, held)  # a lost block is no bound: it goes as lost


@pytest.mark.parametrize("held_at, asked, sent", [
    (I4, "int2", "int4"),  # int4 blocks are not quantised again at int2: the nearest mix above that fits
    (I8, "int4", "int8"),
    (I8, "int8-int4", "int8"),  # half its blocks would be int4
    (H, "int2", "int2"),  # blocks held native are quantised once, as in any handoff
])
def test_a_chain_raises_the_mix_until_no_block_is_quantised_below_what_it_holds(
        tiny: llm.ModelRuntime, held_at: int, asked: str, sent: str) -> None:
    identity = runtime_identity(tiny)
    ids = tuple(int(x) for x in np.random.default_rng(6).integers(3, 90, size=60))
    cache, _ = llm.prefill(tiny, ids)
    plan = identity.plan(len(ids))
    levels = [held_at] * plan.n_blocks
    levels[2] = N  # lost upstream: no bound on the mix
    held = HeldBlocks(len(ids), identity.geometry.n_layers, tuple(levels), (1,))
    prefilled = Prefilled("s", ids, llm.partial_from_cache(cache, None, "mask"), len(ids), held)
    prepared = prepare_model(tiny, identity, ContextInput(prefilled=prefilled), "utility",
                             synthetic_profile(identity.geometry.n_layers), "synthetic", keep_cache=False,
                             precision=PrecisionRequest(precision=asked, mode="auto"))
    assert prepared.precision == sent and prepared.held == held and prepared.split is None
    assert prepared.planner is not None and prepared.planner.get("raised_from") == (
        asked if sent != asked else None)


def test_a_chain_does_not_stream_what_was_lost_upstream(tiny: llm.ModelRuntime) -> None:
    identity = runtime_identity(tiny)
    ids = tuple(int(x) for x in np.random.default_rng(7).integers(3, 90, size=60))
    cache, _ = llm.prefill(tiny, ids)
    plan = identity.plan(len(ids))
    levels = [H] * plan.n_blocks
    levels[1] = levels[5] = N
    held = HeldBlocks(len(ids), identity.geometry.n_layers, tuple(levels), (2,))
    prefilled = Prefilled("s", ids, llm.partial_from_cache(cache, None, "mask"), len(ids), held)
    prepared = prepare_model(tiny, identity, ContextInput(prefilled=prefilled), "utility",
                             synthetic_profile(identity.geometry.n_layers), "synthetic", keep_cache=False)
    lost = set(plan.block_fragments(1)) | set(plan.block_fragments(5))
    assert set(prepared.queue.tolist()) == set(range(plan.n_fragments)) - lost
    assert prepared.n_source == len(prepared.symbols) == plan.n_fragments - len(lost)


# --------------------------------------------------------------------------- the receiver masks it


@pytest.mark.parametrize("mix", ["native", "int4"])
def test_a_block_the_offer_says_was_lost_upstream_is_masked_whatever_arrived_for_it(
        tiny: llm.ModelRuntime, mix: str) -> None:
    """Every symbol arrives, the OFFER says block 4 was lost before its sender (and block 7 arrived there
    at int8): the rebuild masks block 4 whatever bytes came for it (a sender's zeros are no data), scores it
    lost, and what this node holds now says it, with this hop's losses (none) after the first hop's."""
    identity = runtime_identity(tiny)
    ids = tuple(int(x) for x in np.random.default_rng(4).integers(3, 90, size=70))
    plan = identity.plan(len(ids))
    profile = synthetic_profile(identity.geometry.n_layers)
    utilities = profile.block_utilities(plan)
    cache, _ = llm.prefill(tiny, ids)
    levels = [H] * plan.n_blocks
    levels[4], levels[7] = N, I8
    held = HeldBlocks(len(ids), identity.geometry.n_layers, tuple(levels), (1,))
    if mix == "native":
        queue = plan.fragment_queue(np.arange(plan.n_blocks))
        store, stream = llm.serialise_symbols(tiny, cache, plan, queue), None
    else:
        planned = plan_stream(identity, len(ids), mix, utilities, "utility")
        store = llm.serialise_stream(tiny, cache, planned.plan)
        fidelity = fidelity_named(planned.offer.fidelity, identity.geometry.n_layers, None)
        stream = StreamPlan(mix, planned.plan, fidelity)
    app = OfferApp(len(ids), (), generate=False, prefix=PrefixOffer("s", ids), held=held,
                   precision=None if stream is None else planned.offer)
    done = reconstruct(tiny, identity, app, profile, np.arange(len(store)), store, stream)
    assert done.complete is not None and not done.complete[4] and done.complete.sum() == plan.n_blocks - 1
    assert done.utility == pytest.approx(1.0 - utilities[4] / utilities.sum())
    assert done.held is not None and done.held.levels[4] == N and done.held.hops_lost == (1, 0)
    assert done.held.levels[7] == (I8 if mix == "native" else I4)  # never above what either end held
    layer, token_block = plan.block_layer(4), 4 % plan.n_token_blocks
    assert done.kv is not None
    rows = done.kv.keys[layer][0, :, token_block * 16:(token_block + 1) * 16]
    assert float(rows.abs().sum()) == 0.0


def test_a_split_s_computed_front_is_held_native_not_lost(tiny: llm.ModelRuntime) -> None:
    """A split whose front the receiver computed (the stream's pieces for it replaced by the front's rows):
    those blocks are held native, so a chain from here streams them, never declares them lost."""
    identity = runtime_identity(tiny)
    ids = tuple(int(x) for x in np.random.default_rng(8).integers(3, 90, size=70))
    plan = identity.plan(len(ids))
    profile = synthetic_profile(identity.geometry.n_layers)
    cache, _ = llm.prefill(tiny, ids)
    planned = plan_stream(identity, len(ids), "int4", profile.block_utilities(plan), "utility", 2)
    store = llm.serialise_stream(tiny, cache, planned.plan)
    fidelity = fidelity_named(planned.offer.fidelity, identity.geometry.n_layers, None)
    front = Front(ids, meeting_token=32)
    compute_front(tiny, front, lambda _tokens: None)
    front.tokens = 32  # the stream met it there
    app = OfferApp(len(ids), (), generate=False, prefix=PrefixOffer("s", ids), precision=planned.offer,
                   split=SplitOffer(32, ids))
    done = reconstruct(tiny, identity, app, profile, np.arange(len(store)), store,
                       StreamPlan("int4", planned.plan, fidelity), front)
    assert done.held is not None and done.held.lost_blocks == 0 and done.held.hops_lost == (0,)
    grid = np.asarray(done.held.levels).reshape(identity.geometry.n_layers, -1)
    assert (grid[:, :2] == H).all() and (grid[:, 2:] == I4).all()  # the front native, the back as it came


# --------------------------------------------------------------------------- three nodes, a lossy first hop


def test_a_chain_hands_on_what_b_holds_and_c_masks_exactly_what_b_lacked(chat_tiny: llm.ModelRuntime) -> None:
    """A -> B over a lossy relay without repairs (scheme udp): B's copy is partial. B continues it and hands
    the grown conversation to C: what B lost is not streamed, C's rebuild masks exactly those blocks (their
    rows zero), C's result and the ``pfec.prefix`` of C's first request say how much was missing and on
    which hop, and C serves that request with the whole grown conversation as ``cached_tokens``."""
    identity = runtime_identity(chat_tiny)
    salt = "team-l"
    words = " ".join(f"w{5 + i % 80}" for i in range(90))  # about 100 tokens: 7 token blocks x 3 layers
    lossy = EmulatorConfig(DirectionSpec(20e6, 0.002, Bernoulli(0.1)), DirectionSpec(20e6, 0.002), seed=11)

    async def main() -> None:
        async with _node(chat_tiny) as (a, a_url), _node(chat_tiny) as (b, b_url), _node(chat_tiny) as (
                c, c_url), UdpRelay(lossy, ("127.0.0.1", 0), b.address) as relay, aiohttp.ClientSession(
                headers=HEADERS) as http:

            async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
                data = None if body is None else json.dumps(body)
                async with http.request(method, url, data=data) as response:
                    return response.status, await response.json()

            async def hand(url: str, node: NodeDaemon, to: tuple[str, int], cid: str, **extra: Any) -> Any:
                await _settle(node)
                status, created = await call("POST", url + "/handoffs", {
                    "receiver": "{}:{}".format(*to), "rho": 4.0, "precision": "native",
                    "handoff_mode": "handoff", "conversation": {"id": cid}, **extra})
                assert status == 202, created
                _, report = await call("GET", f"{url}/handoffs/{created['id']}?wait=60")
                assert report["outcome"] == "done", report
                return report

            async def held_of(node: NodeDaemon, ids_of: str) -> tuple[HeldBlocks, Any]:
                assert node.face is not None
                face = node.face

                def look() -> tuple[HeldBlocks, Any]:
                    ids = face.chat_ids(json.loads(ids_of), None, add_generation_prompt=False)
                    match = face.store.lookup(salt, ids, face.clock(), count=False)
                    assert match is not None
                    return match.entry.info["held"], match.entry.value

                return await node.worker.submit(look)

            chat = "/v1/chat/completions"
            request = {"model": identity.model_id, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
            turns = [{"role": "user", "content": words}]
            status, first = await call("POST", a_url + chat, {**request, "messages": turns})
            assert status == 200, first
            to_b = await hand(a_url, a, relay.listen_address, first["id"], scheme="udp")
            await _settle(b)
            _, b_results = await call("GET", b_url + "/results")
            b_missing = b_results["results"][-1]["missing"]
            assert b_missing["lost_by_hop"] == [b_missing["blocks_missing"]], b_missing
            assert 0 < b_missing["blocks_missing"] < to_b["n_blocks"], (b_missing, to_b)  # a partial copy
            turns += [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "w11 w12"}]
            status, second = await call("POST", b_url + chat, {**request, "messages": turns})
            assert status == 200, second
            assert second["pfec"]["prefix"]["missing"] == b_missing, second["pfec"]
            b_held, _ = await held_of(b, json.dumps(turns[:2]))
            to_c = await hand(b_url, b, c.address, second["id"])
            lost_at_b = np.asarray(b_held.levels) == N
            assert to_c["conversation"]["missing_upstream"]["blocks_missing"] == int(lost_at_b.sum()), to_c
            plan_c = identity.plan(to_c["n_tokens"])
            sent = sum(len(plan_c.block_fragments(int(blk))) for blk in
                       np.flatnonzero(b_held.block_levels(plan_c) != N))
            assert to_c["n_source"] == sent < plan_c.n_fragments, to_c  # B streamed only what it holds
            await _settle(c)
            _, c_results = await call("GET", c_url + "/results")
            c_missing = c_results["results"][-1]["missing"]
            assert c_missing["lost_by_hop"] == [int(lost_at_b.sum()), 0], c_missing
            # The same spans: a block that straddles the end of what B received is masked whole on C.
            whole = [[start, min(-(-end // 16) * 16, to_c["n_tokens"])] for start, end in b_missing[
                "tokens_missing"]]
            assert c_missing["tokens_missing"] == whole, (c_missing, b_missing)
            reply = second["choices"][0]["message"]["content"] or ""
            grown = [*turns, {"role": "assistant", "content": reply}]
            c_held, c_kv = await held_of(c, json.dumps(grown))
            c_grid = np.asarray(c_held.levels).reshape(identity.geometry.n_layers, -1)
            b_grid = np.asarray(b_held.levels).reshape(identity.geometry.n_layers, -1)
            width = b_grid.shape[1]  # the token blocks B received (its own turns after them: computed)
            assert ((c_grid[:, :width] == N) == (b_grid == N)).all()  # exactly what B lacked
            assert (c_grid[:, width:] != N).all()
            for layer, tb in zip(*np.nonzero(b_grid == N), strict=True):
                rows = c_kv.keys[layer][0, :, tb * 16:(tb + 1) * 16]
                assert float(rows.abs().sum()) == 0.0, (layer, tb)  # masked on C, never B's zeros as data
            status, third = await call("POST", c_url + chat, {
                **request, "messages": [*grown, {"role": "user", "content": "w13"}]})
            assert status == 200, third
            assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == to_c["n_tokens"], third
            assert third["pfec"]["prefix"]["missing"] == c_missing, third["pfec"]

    asyncio.run(main())


def test_a_quantised_chain_hands_int4_on_at_int4_when_int2_is_asked(chat_tiny: llm.ModelRuntime) -> None:
    """A -> B at int4 (B holds every block at int4 or below), B -> C asked for int2: B raises the mix so no
    block is quantised again below what it holds; C checks the plan, rebuilds it and continues from it."""
    identity = runtime_identity(chat_tiny)
    salt = "team-q"

    async def main() -> None:
        async with _node(chat_tiny) as (a, a_url), _node(chat_tiny) as (b, b_url), _node(chat_tiny) as (
                c, c_url), aiohttp.ClientSession(headers=HEADERS) as http:

            async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
                data = None if body is None else json.dumps(body)
                async with http.request(method, url, data=data) as response:
                    return response.status, await response.json()

            async def hand(url: str, node: NodeDaemon, to: NodeDaemon, cid: str, precision: str) -> Any:
                await _settle(node)
                status, created = await call("POST", url + "/handoffs", {
                    "receiver": "{}:{}".format(*to.address), "rho": 6.0, "precision": precision,
                    "conversation": {"id": cid}})
                assert status == 202, created
                _, report = await call("GET", f"{url}/handoffs/{created['id']}?wait=60")
                assert report["outcome"] == "done", report
                assert report["recovered_utility"] == pytest.approx(1.0), report
                await _settle(to)
                return report

            chat = "/v1/chat/completions"
            request = {"model": identity.model_id, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
            turns = [{"role": "user", "content": " ".join(f"w{5 + i % 80}" for i in range(40))}]
            _, first = await call("POST", a_url + chat, {**request, "messages": turns})
            to_b = await hand(a_url, a, b, first["id"], "int4")
            assert to_b["precision"] == "int4", to_b
            turns += [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "w11"}]
            _, second = await call("POST", b_url + chat, {**request, "messages": turns})
            to_c = await hand(b_url, b, c, second["id"], "int2")
            assert to_c["precision"] == "int4" and to_c["planner"]["raised_from"] == "int2", to_c
            _, c_results = await call("GET", c_url + "/results")
            assert c_results["results"][-1]["missing"]["lost_by_hop"] == [0, 0]
            turns += [{"role": "assistant", "content": second["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "w13"}]
            status, third = await call("POST", c_url + chat, {**request, "messages": turns})
            assert status == 200, third
            assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == to_c["n_tokens"], third

    asyncio.run(main())
