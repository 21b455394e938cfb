"""Serving on a tiny random-init Llama (fast): a partial (masked) handed-off cache is served with its
masks, exactly as the handoff's own decoding reads it, and the stored entry is never written."""

from __future__ import annotations

import numpy as np
import torch

from pfec.common.model import llm, serving

VOCAB = 96


def test_a_partial_cache_is_served_with_its_masks_and_left_intact(tiny: llm.ModelRuntime) -> None:
    context = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, size=64)]
    question = [5, 6, 7]
    cache, _ = llm.prefill(tiny, context)
    available = torch.ones(3, 2, 64, dtype=torch.bool)
    available[:, :, 16:48] = False
    masked = llm.partial_from_cache(cache, available, "mask")
    before = [k.clone() for k in masked.keys]
    greedy = serving.Sampling(max_tokens=8, temperature=0)
    reference = llm.generate(tiny, masked, question, max_new_tokens=8)
    served = serving.complete(tiny, context + question, masked, 64, greedy)
    assert tuple(served.token_ids) == reference.token_ids
    intact = llm.partial_from_cache(cache, None, "mask")
    whole = serving.complete(tiny, context + question, intact, 64, greedy)
    assert whole.token_ids != served.token_ids  # the masks change what is attended to
    assert all(torch.equal(a, b) for a, b in zip(before, masked.keys, strict=True))
    # The cache it leaves keeps the holes masked for the next turn, and covers every token it fed.
    assert served.kv.n_context == len(served.fed_ids) and served.kv.row_masks is not None
    mask = served.kv.row_masks[0]
    assert mask is not None and not bool(mask[:, 16:48].any()) and bool(mask[:, 48:].all())
    # A cropped reuse of the leftover (the next turn diverging after the question) matches a fresh serve
    # from the handed-off cache.
    again = serving.complete(tiny, context + question + [9], served.kv, 67, greedy)
    fresh = serving.complete(tiny, context + question + [9], masked, 64, greedy)
    assert again.token_ids == fresh.token_ids and again.cached_tokens == 67


def test_stop_strings_and_the_token_limit_end_a_completion(tiny: llm.ModelRuntime) -> None:
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, VOCAB, size=20)]
    pieces: list[str] = []
    free = serving.complete(tiny, prompt, None, 0, serving.Sampling(max_tokens=6, temperature=0),
                            pieces.append)
    assert "".join(pieces) == free.text
    assert free.finish_reason == "length" and len(free.token_ids) == 6 and len(free.fed_ids) == 25
    word = free.text.split()[2]
    cut = serving.complete(tiny, prompt, None, 0, serving.Sampling(max_tokens=6, temperature=0, stop=(word,)))
    assert cut.finish_reason == "stop" and word not in cut.text and free.text.startswith(cut.text)
    seeded = [serving.complete(tiny, prompt, None, 0, serving.Sampling(max_tokens=6, seed=5)).token_ids
              for _ in range(2)]
    assert seeded[0] == seeded[1]
