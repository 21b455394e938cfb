"""Measuring a node's prefill speed (common/model/speed.py) on a tiny random Llama and on fake timings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pfec.common.model import llm, speed
from pfec.common.plan.prefill import PrefillCurve

LENGTHS = (16, 48, 96)


@pytest.fixture(scope="module")
def tiny() -> llm.ModelRuntime:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    return llm.runtime_from_model(model, None, "tiny-llama", Path("."), "0" * 64, "fp32")


def test_fake_timings_are_fitted_and_the_fastest_repeat_kept(tiny: llm.ModelRuntime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    truth = PrefillCurve(a=0.02, b=1e-3, c=2e-6)
    calls: dict[int, int] = {}

    def fake(runtime: llm.ModelRuntime, ids: list[int]) -> tuple[float, Any]:
        n = len(ids)
        calls[n] = calls.get(n, 0) + 1
        stall = 0.5 if calls[n] == 1 else 0.0  # the first run of every length stalls
        cache, _ = llm.prefill(runtime, ids)
        return truth.seconds(n) + stall, cache

    monkeypatch.setattr(speed, "_timed_prefill", fake)
    measured = speed.measure_prefill_speed(tiny, LENGTHS, threads=1, repeats=2)
    assert [n for n, _ in measured.points] == list(LENGTHS)
    assert [t for _, t in measured.points] == pytest.approx([truth.seconds(n) for n in LENGTHS])
    fitted = (measured.curve.a, measured.curve.b, measured.curve.c)
    assert fitted == pytest.approx((0.02, 1e-3, 2e-6), rel=1e-6)
    assert measured.chunk_seconds(48, 96) == pytest.approx(truth.chunk_seconds(48, 96))


def test_real_measurement_on_a_tiny_model(tiny: llm.ModelRuntime) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        measured = speed.measure_prefill_speed(tiny, LENGTHS, threads=1)
        assert torch.get_num_threads() == 2  # the measurement's thread count does not leak
    finally:
        torch.set_num_threads(before)
    assert measured.threads == 1 and measured.device == "cpu" and measured.model_id == "tiny-llama"
    assert [n for n, _ in measured.points] == list(LENGTHS)
    assert all(t > 0 and math.isfinite(t) for _, t in measured.points)
    assert min(measured.curve.a, measured.curve.b, measured.curve.c) >= 0
    assert 0 < measured.decode_s < 10
    assert measured.seconds(96) > 0 and measured.tokens_per_second(96) > 0
    again = speed.PrefillSpeed.from_dict(measured.to_dict())
    assert again == measured
    assert again.receiver_model().prefill == measured.curve


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"lengths": (32,)}, "at least 2 distinct"),
        ({"lengths": (0, 32)}, "at least 2 distinct positive"),
        ({"lengths": (32, 400)}, "exceeds the model's 160-token limit"),
        ({"lengths": (16, 32), "threads": 0}, "threads must be positive"),
        ({"lengths": (16, 32), "repeats": 0}, "repeats must be >= 1"),
    ],
)
def test_bad_measurement_settings_are_refused(tiny: llm.ModelRuntime, kwargs: dict[str, Any],
                                              reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        speed.measure_prefill_speed(tiny, **kwargs)


@pytest.mark.parametrize(
    "record",
    [
        {},
        {"curve": {"a": 0, "b": 1e-3, "c": math.nan}, "points": [], "decode_s": 0.1, "threads": 1,
         "device": "cpu", "model_id": "m"},
        {"curve": {"a": 0, "b": 1e-3, "c": 0}, "points": [], "decode_s": -1, "threads": 1,
         "device": "cpu", "model_id": "m"},
    ],
)
def test_bad_speed_records_are_refused(record: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        speed.PrefillSpeed.from_dict(record)
