"""Issue 39 item 3: a quantised stream's cache built while it arrives (``kvcache.LiveRebuild``) is the cache
the one-shot rebuild makes from the same delivered pieces, bit for bit: blocks placed as they complete,
re-placed when a refinement raises their level, zeroed when the session drops them (a split's computed
front), the missing rows masked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pfec.common.model import llm
from pfec.common.model.kvcache import LiveRebuild, cache_layers, stream_symbols
from pfec.common.plan.kvlayout import FRAGMENT_ID_SIZE
from pfec.common.plan.piece_plan import PiecePlan, full_plan
from pfec.common.plan.pieces import Level, PieceKind, PieceLayout, ladder
from pfec.common.plan.stream import file_by_stream_index

N_TOKENS = 72  # four full blocks and a tail block of 8 tokens
PAYLOAD = 200


@pytest.fixture(scope="module")
def tiny() -> llm.ModelRuntime:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                         tie_word_embeddings=False)
    return llm.runtime_from_model(LlamaForCausalLM(config).eval(), None, "tiny-llama", Path("."), "0" * 64,
                                  "fp32")


def _stream(runtime: llm.ModelRuntime, native_top: bool = False) -> tuple[PiecePlan, np.ndarray]:
    """A ladder stream sent level by level (every base, then every REFINE4, ...): blocks climb as it
    arrives; with ``native_top`` each block ends with its native piece."""
    ids = [int(x) for x in np.random.default_rng(3).integers(3, 96, size=N_TOKENS)]
    cache, _ = llm.prefill(runtime, ids)
    layout = PieceLayout(runtime.geometry, N_TOKENS)
    kinds = ladder(Level.INT2, Level.NATIVE if native_top else Level.INT8)
    one = full_plan(layout, kinds, PAYLOAD)
    order = np.lexsort((one.blocks, one.kinds))  # by kind, then block
    plan = PiecePlan(layout, one.blocks[order], one.kinds[order], PAYLOAD)
    layers = [(k[:, :, :N_TOKENS], v[:, :, :N_TOKENS]) for k, v in cache_layers(cache)]
    return plan, stream_symbols(layers, plan)


def _one_shot(runtime: llm.ModelRuntime, plan: PiecePlan, symbols: np.ndarray, got: np.ndarray,
              drop: np.ndarray | None = None) -> tuple[llm.PartialKV, np.ndarray, np.ndarray, np.ndarray]:
    rows = symbols[got]
    payloads = np.ascontiguousarray(rows[:, FRAGMENT_ID_SIZE:])
    store, have = file_by_stream_index(plan, np.flatnonzero(got), payloads)
    levels, bases = plan.usable(have)
    if drop is not None:
        levels = np.where(drop, Level.NONE, levels).astype(np.int8)
    return llm.rebuild_from_stream(runtime, plan, store, levels, bases), store, levels, bases


def _same(a: llm.PartialKV, b: llm.PartialKV) -> None:
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        assert torch.equal(x, y)
    assert (a.row_masks is None) == (b.row_masks is None)
    for m, n in zip(a.row_masks or [], b.row_masks or [], strict=True):
        assert (m is None and n is None) or (m is not None and n is not None and torch.equal(m, n))


@pytest.mark.parametrize("native_top", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_cache_built_as_its_blocks_arrive_equals_the_one_shot_rebuild(tiny: llm.ModelRuntime, seed: int,
                                                                       native_top: bool) -> None:
    plan, symbols = _stream(tiny, native_top)
    rng = np.random.default_rng(seed)
    lost = rng.random(plan.n_symbols) < 0.1  # never arrive: some blocks stay below their top, or at NONE
    arrival = rng.permutation(np.flatnonzero(~lost)) if seed else np.flatnonzero(~lost)  # in order, or not
    live = LiveRebuild(tiny, plan)
    got = np.zeros(plan.n_symbols, dtype=np.bool_)
    placed = []
    for batch in np.array_split(arrival, 7):
        live.offer(symbols[batch].copy())
        got[batch] = True
        placed.append(live.drain())
    assert sum(placed) > 0 and live.placed >= sum(placed)
    expected, store, levels, bases = _one_shot(tiny, plan, symbols, got)
    _same(live.finish(store, levels, bases), expected)


def test_a_refined_block_replaces_its_rows(tiny: llm.ModelRuntime) -> None:
    """Every block placed at int2 first, then raised to int8: its rows are int8's, not int2's."""
    plan, symbols = _stream(tiny)
    live = LiveRebuild(tiny, plan)
    bases_only = np.flatnonzero(plan.kinds[plan.symbol_piece_spans()[0]] == PieceKind.BASE2)
    live.offer(symbols[bases_only].copy())
    live.drain()
    assert set(live.levels.tolist()) <= {int(Level.NONE), int(Level.INT2)}
    assert (live.levels == Level.INT2).any()
    at_int2 = live.keys.clone() if live.keys is not None else None
    live.offer(symbols.copy())
    live.drain()
    assert (live.levels == Level.INT8).all()
    every = np.ones(plan.n_symbols, dtype=np.bool_)
    expected, store, levels, bases = _one_shot(tiny, plan, symbols, every)
    kv = live.finish(store, levels, bases)
    _same(kv, expected)
    assert at_int2 is not None and not torch.equal(at_int2, live.keys)


def test_blocks_the_session_drops_are_zeroed_and_masked(tiny: llm.ModelRuntime) -> None:
    """A split's computed front (or a chain's lost block) arrives and is placed, but the session rebuilds
    it at NONE: its rows are zero and masked, as in the one-shot rebuild."""
    plan, symbols = _stream(tiny)
    live = LiveRebuild(tiny, plan)
    live.offer(symbols.copy())
    live.drain()
    drop = (np.arange(plan.layout.n_blocks) % plan.layout.n_token_blocks) < 2  # the first two token blocks
    every = np.ones(plan.n_symbols, dtype=np.bool_)
    expected, store, levels, bases = _one_shot(tiny, plan, symbols, every, drop)
    kv = live.finish(store, levels, bases)
    _same(kv, expected)
    assert kv.row_masks is not None and all(m is not None and not bool(m[:, :32].any()) for m in kv.row_masks)


def test_answers_from_the_live_cache_equal_the_one_shot_cache_s(tiny: llm.ModelRuntime) -> None:
    plan, symbols = _stream(tiny)
    rng = np.random.default_rng(9)
    got = rng.random(plan.n_symbols) < 0.8
    live = LiveRebuild(tiny, plan)
    for batch in np.array_split(rng.permutation(np.flatnonzero(got)), 4):
        live.offer(symbols[batch].copy())
        live.drain()
    expected, store, levels, bases = _one_shot(tiny, plan, symbols, got)
    question = [5, 6, 7, 8]
    assert llm.generate(tiny, live.finish(store, levels, bases), question, 6).token_ids == llm.generate(
        tiny, expected, question, 6).token_ids


@pytest.mark.parametrize("seed", [0, 1])
def test_a_split_s_computed_rows_placed_as_computed_equal_the_one_shot_join(tiny: llm.ModelRuntime,
                                                                            seed: int) -> None:
    """A split: the front's rows are copied in as its chunks are computed (whole blocks), the stream's
    blocks placed as they arrive (the front's too: the stream carries it after the back), and at the
    deadline the cache is the one-shot rebuild with the computed blocks dropped, joined with the front."""
    plan, symbols = _stream(tiny)
    ids = [int(x) for x in np.random.default_rng(3).integers(3, 96, size=N_TOKENS)]  # _stream's context
    rng = np.random.default_rng(seed)
    front_tokens = 40  # two whole blocks and half of the third
    front, _ = llm.prefill(tiny, ids[:front_tokens])
    live = LiveRebuild(tiny, plan)
    got = rng.random(plan.n_symbols) < 0.9
    batches = np.array_split(rng.permutation(np.flatnonzero(got)), 4)
    for step, batch in enumerate(batches):
        live.offer(symbols[batch].copy())
        live.drain()
        live.place_computed(front, (16, 24, 40, 40)[step])  # the front's chunks as they end
    assert live.computed == 32  # whole blocks only
    layout = plan.layout
    ends = np.minimum((np.arange(layout.n_blocks) % layout.n_token_blocks + 1) * layout.block_tokens,
                      layout.n_tokens)
    computed = ends <= front_tokens
    expected, store, levels, bases = _one_shot(tiny, plan, symbols, got, computed)
    expected = llm.join_prefix(expected, front, front_tokens)
    kv = llm.join_prefix(live.finish(store, levels, bases), front, front_tokens, live.computed)
    _same(kv, expected)
