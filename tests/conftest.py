"""Fixtures more than one test module uses."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

TINY_VOCAB = 96  # the tiny model's words are w0 .. w95 (w0 unknown, w2 the end of a turn)


@pytest.fixture(scope="module")
def tiny() -> ModelRuntime:
    """A 3-layer Llama with a word-level tokenizer, its attention sharpened so that answers depend on the
    context: a real transformers model and cache at test speed."""
    import torch  # deferred: only the tests that use it pay for torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from pfec.common.model import llm

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(TINY_VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2")
    return llm.runtime_from_model(model, tok, "tiny-llama", Path("."), "0" * 64, "fp32")
