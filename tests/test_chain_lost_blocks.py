"""A quantised chain leaves out what was lost upstream (issue 37 item 2: "a block lost upstream is sent as
lost"). The stream plan is computed on both ends from the OFFER: its held map names the lost blocks, the
sender plans no piece of them (their bytes never cross the link), the receiver recomputes that same plan
(the digest and the symbol count match) and masks them."""

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
from pfec.common.plan.handoff import BLOCK_TOKENS, OfferApp, PrefixOffer
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.plan.pieces import HeldBlocks, Level
from pfec.common.plan.precision import PieceLayout
from pfec.common.plan.stream import DEFAULT_FIDELITY, fidelity_named, stream_plan
from pfec.common.plan.utility import synthetic_profile
from pfec.lab.emulator.link import DirectionSpec, EmulatorConfig
from pfec.lab.emulator.relay import UdpRelay
from pfec.lab.sim.channel import Bernoulli
from pfec.receiver.admission import check_stream
from pfec.receiver.rebuild import reconstruct
from pfec.sender.kv import ContextInput, PrecisionRequest, Prefilled, Prepared, plan_stream, prepare_model

LOST = (1, 5, 9)


def _prepared(tiny: llm.ModelRuntime, mix: str,
              lost: tuple[int, ...]) -> tuple[Prepared, HeldBlocks, OfferApp]:
    identity = runtime_identity(tiny)
    ids = tuple(int(x) for x in np.random.default_rng(9).integers(3, 90, size=70))
    cache, _ = llm.prefill(tiny, ids)
    plan = identity.plan(len(ids))
    levels = [Level.NATIVE] * plan.n_blocks
    for block in lost:
        levels[block] = Level.NONE
    held = HeldBlocks(len(ids), identity.geometry.n_layers, tuple(levels), (len(lost),))
    prefilled = Prefilled("s", ids, llm.partial_from_cache(cache, None, "mask"), len(ids), held)
    prepared = prepare_model(tiny, identity, ContextInput(prefilled=prefilled), "utility",
                             synthetic_profile(identity.geometry.n_layers), "synthetic", keep_cache=False,
                             precision=PrecisionRequest(precision=mix, mode="handoff"))
    assert prepared.stream is not None and prepared.precision == mix
    app = OfferApp(len(ids), (), generate=False, prefix=PrefixOffer("s", ids), held=held,
                   precision=prepared.stream.offer)
    return prepared, held, app


@pytest.mark.parametrize("mix", ["int4", "int8-int4"])
def test_a_quantised_chain_sends_no_byte_of_a_block_lost_upstream_and_the_receiver_masks_it(
        tiny: llm.ModelRuntime, mix: str) -> None:
    identity = runtime_identity(tiny)
    prepared, _, app = _prepared(tiny, mix, LOST)
    stream = prepared.stream
    assert stream is not None
    sent_blocks = set(stream.plan.blocks.tolist())
    assert not sent_blocks & set(LOST)  # no piece of a lost block is planned
    assert sent_blocks == set(range(stream.plan.layout.n_blocks)) - set(LOST)
    # The same mix without the held map would have carried them: the difference is their pieces' bytes.
    utilities = synthetic_profile(identity.geometry.n_layers).block_utilities(identity.plan(app.n_tokens))
    whole = plan_stream(identity, app.n_tokens, mix, utilities, "utility").plan
    theirs = int(whole.sizes[np.isin(whole.blocks, LOST)].sum())
    assert theirs > 0 and stream.plan.total_bytes == whole.total_bytes - theirs
    assert prepared.n_source == stream.plan.n_symbols < whole.n_symbols
    assert len(prepared.symbols) == prepared.n_source
    # The receiver recomputes the plan from the OFFER (its held map included) and agrees with the sender.
    profile = synthetic_profile(identity.geometry.n_layers)
    symbol_size = prepared.symbols.shape[1]
    got = check_stream(identity, app, profile, symbol_size, prepared.n_source)
    assert np.array_equal(got.plan.blocks, stream.plan.blocks) and np.array_equal(got.plan.kinds,
                                                                                  stream.plan.kinds)
    # Every symbol arrives: the lost blocks are masked (their rows zero), the rest used, scored as lost.
    done = reconstruct(tiny, identity, app, profile, np.arange(prepared.n_source), prepared.symbols, got)
    assert done.complete is not None and done.kv is not None
    assert [int(b) for b in np.flatnonzero(~done.complete)] == list(LOST)
    assert done.utility == pytest.approx(1.0 - utilities[list(LOST)].sum() / utilities.sum())
    assert done.held is not None and done.held.hops_lost == (len(LOST), 0)
    plan = identity.plan(app.n_tokens)
    for block in LOST:
        layer, tb = plan.block_layer(block), block % plan.n_token_blocks
        rows = done.kv.keys[layer][0, :, tb * BLOCK_TOKENS:(tb + 1) * BLOCK_TOKENS]
        assert float(rows.abs().sum()) == 0.0, block


def test_a_receiver_that_ignored_the_held_map_would_disagree_on_the_plan(tiny: llm.ModelRuntime) -> None:
    """The held map is part of the plan both ends compute: an OFFER whose held map says nothing was lost
    does not match the sender's stream (the digest differs), so the handoff is refused, never misread."""
    identity = runtime_identity(tiny)
    prepared, held, app = _prepared(tiny, "int4", LOST)
    whole = HeldBlocks(held.n_tokens, held.n_layers, tuple(Level.NATIVE for _ in held.levels), (0,))
    wrong = OfferApp(app.n_tokens, (), generate=False, prefix=app.prefix, held=whole, precision=app.precision)
    profile = synthetic_profile(identity.geometry.n_layers)
    with pytest.raises(ValueError, match="does not match the plan recomputed here"):
        check_stream(identity, wrong, profile, prepared.symbols.shape[1], prepared.n_source)


def test_the_plan_refuses_an_absent_mask_of_the_wrong_shape_and_one_that_leaves_nothing() -> None:
    geometry = KVGeometry(n_layers=2, n_kv_heads=2, head_dim=16, dtype="bf16")
    layout = PieceLayout(geometry, 40, BLOCK_TOKENS)  # 2 layers x 3 token blocks
    fidelity = fidelity_named(DEFAULT_FIDELITY, 2, None)
    utility = np.linspace(1, 0.1, layout.n_blocks)
    with pytest.raises(ValueError, match="absent blocks"):
        stream_plan(layout, "int4", utility, fidelity, 1024, absent=np.zeros(5, dtype=bool))
    with pytest.raises(ValueError, match="nothing to stream"):
        stream_plan(layout, "int4", utility, fidelity, 1024, absent=np.ones(layout.n_blocks, dtype=bool))
    kept = stream_plan(layout, "int4", utility, fidelity, 1024, absent=np.arange(layout.n_blocks) == 2)
    assert 2 not in kept.blocks.tolist() and set(kept.blocks.tolist()) == {0, 1, 3, 4, 5}



def test_three_nodes_a_lossy_hop_then_an_int4_hop_sends_only_what_b_holds(tiny: llm.ModelRuntime) -> None:
    """A -> B over a lossy relay without repairs (B's copy partial), then B -> C at int4 by B's completion
    id: C admits the OFFER (its plan, recomputed from the held map, matches), the stream carries no piece
    of a block B lacks, C masks exactly those and serves the grown conversation from its cache."""
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TEMPLATE
    identity = runtime_identity(tiny)
    salt = "team-lq"
    lossy = EmulatorConfig(DirectionSpec(20e6, 0.002, Bernoulli(0.1)), DirectionSpec(20e6, 0.002), seed=11)

    async def main() -> None:
        async with _node(tiny) as (a, a_url), _node(tiny) as (b, b_url), _node(tiny) as (c, c_url), UdpRelay(
                lossy, ("127.0.0.1", 0), b.address) as relay, aiohttp.ClientSession(headers=HEADERS) as http:

            async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
                async with http.request(method, url, data=None if body is None else json.dumps(body)) as r:
                    return r.status, await r.json()

            async def hand(url: str, to: tuple[str, int], cid: str, **extra: Any) -> Any:
                status, created = await call("POST", url + "/handoffs", {
                    "receiver": "{}:{}".format(*to), "rho": 6.0, "handoff_mode": "handoff",
                    "conversation": {"id": cid}, **extra})
                assert status == 202, created
                _, report = await call("GET", f"{url}/handoffs/{created['id']}?wait=60")
                assert report["outcome"] == "done", report
                return report

            chat = "/v1/chat/completions"
            request = {"model": identity.model_id, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
            turns = [{"role": "user", "content": " ".join(f"w{5 + i % 80}" for i in range(90))}]
            _, first = await call("POST", a_url + chat, {**request, "messages": turns})
            await _settle(a)
            await hand(a_url, relay.listen_address, first["id"], scheme="udp", precision="native")
            await _settle(b)
            _, b_results = await call("GET", b_url + "/results")
            b_missing = b_results["results"][-1]["missing"]
            assert b_missing["blocks_missing"] > 0, b_missing  # B's copy is partial
            turns += [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "w11 w12"}]
            _, second = await call("POST", b_url + chat, {**request, "messages": turns})
            await _settle(b)
            to_c = await hand(b_url, c.address, second["id"], precision="int4")
            lost = to_c["conversation"]["missing_upstream"]["blocks_missing"]
            assert to_c["precision"] == "int4" and lost == b_missing["blocks_missing"], to_c
            # What B streamed: the int4 plan less the lost blocks' pieces, fewer symbols than with them.
            plan = identity.plan(to_c["n_tokens"])
            utilities = synthetic_profile(identity.geometry.n_layers).block_utilities(plan)
            whole = plan_stream(identity, plan.n_tokens, "int4", utilities, "utility").plan
            assert to_c["n_source"] < whole.n_symbols, (to_c, whole.n_symbols)
            await _settle(c)
            _, c_results = await call("GET", c_url + "/results")
            assert c_results["results"][-1]["missing"]["lost_by_hop"] == [lost, 0], c_results
            text = second["choices"][0]["message"]["content"] or ""
            grown = [*turns, {"role": "assistant", "content": text}, {"role": "user", "content": "w13"}]
            status, third = await call("POST", c_url + chat, {**request, "messages": grown})
            assert status == 200, third
            assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == to_c["n_tokens"], third

    asyncio.run(main())
