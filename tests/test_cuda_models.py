"""One model per device in a process: loads of the same (directory, device, dtypes) share one runtime while
anyone holds it, other keys load their own; on CUDA the model computes in bf16 and the prefix store's
budget is checked against the GPU's free memory at start-up. Runs on the CPU and, marked ``cuda``, on a
GPU where torch sees one (skipped elsewhere, with the reason)."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pfec.common.model import llm
from pfec.common.model.runtime import check_prefix_budget, load_runtime
from pfec.common.node.config import ModelConfig
from pfec.common.node.eventloop import run_event_loop
from pfec.common.node.lifecycle import load_node_model
from pfec.common.plan.prefix_store import device_budget_error

NO_CUDA = "no CUDA GPU visible to torch (the CUDA build and a GPU are needed: scripts/gpu-check.sh)"
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
VOCAB = 64


def _save_tiny(path: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(path)
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2").save_pretrained(path)
    return path


@pytest.mark.parametrize("device", DEVICES)
def test_loads_of_one_key_share_one_runtime_and_other_keys_do_not(tmp_path: Path, device: str) -> None:
    path = _save_tiny(tmp_path / "tiny")
    first = llm.load_model(str(path), device=device)
    assert first.compute_dtype == (torch.bfloat16 if device == "cuda" else torch.float32)
    assert first.device.type == device
    same = llm.load_model(f"{tmp_path}/./tiny/", device=device)  # the same directory, spelled otherwise
    assert same is first
    named = "cuda:0" if device == "cuda" else "cpu"
    assert llm.load_model(str(path), device=named) is first  # cuda is cuda:<current device>
    key = llm.model_key(path, first.device, first.compute_dtype, "bf16")
    assert llm.loaded_models()[key] is first
    others = [
        llm.load_model(str(path), device=device, compute_dtype="fp16"),  # another compute dtype
        llm.load_model(str(path), device=device, transfer_dtype="fp16"),  # another transfer dtype
        llm.load_model(str(shutil.copytree(path, tmp_path / "copy")), device=device),  # another directory
        llm.load_model(str(path), device=device, shared=False),  # asked for a copy of its own
    ]
    assert all(o is not first for o in others) and len({id(o) for o in others}) == len(others)
    assert llm.load_model(str(path), device=device, compute_dtype="fp16") is others[0]
    # A daemon's loader shares it too (the model warm, its threads set).
    runtime, identity = load_runtime(str(path), device=device, torch_threads=torch.get_num_threads())
    assert runtime is first and identity.model_id == first.model_id
    # A model nobody holds any more is freed, not kept: the next load makes a new one.
    del first, same, runtime, others
    gc.collect()
    assert key not in llm.loaded_models()
    fresh = llm.load_model(str(path), device=device)
    assert llm.loaded_models()[key] is fresh


def test_a_bad_transfer_dtype_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="transfer dtype 'int3'"):
        llm.load_model(str(_save_tiny(tmp_path / "tiny")), device="cpu", transfer_dtype="int3")


def test_a_prefix_budget_larger_than_the_gpus_free_memory_is_named() -> None:
    mib = 1 << 20
    assert device_budget_error(512 * mib, 600 * mib, 80_000 * mib, "cuda:0") is None
    error = device_budget_error(512 * mib, 100 * mib, 80_000 * mib, "cuda:1")
    assert error is not None
    assert "limits.prefix_cache_bytes = 512 MiB does not fit cuda:1" in error and "100 MiB" in error


@pytest.mark.parametrize("device", DEVICES)
def test_start_up_checks_the_prefix_budget_on_the_gpu_only(tmp_path: Path, device: str) -> None:
    """A node whose store budget exceeds its GPU's free memory fails at start-up with the reason; on the
    CPU the budget is host memory and not checked against anything."""
    config = ModelConfig(path=str(_save_tiny(tmp_path / "tiny")), device=device)
    huge = 1 << 50  # 1 PiB
    if device == "cpu":
        runtime, _ = run_event_loop(load_node_model(config, huge))
        assert runtime is not None
        check_prefix_budget(runtime, huge)
        return
    runtime, _ = run_event_loop(load_node_model(config, 64 << 20))
    with pytest.raises(ValueError, match=r"limits\.prefix_cache_bytes = .* does not fit cuda"):
        run_event_loop(load_node_model(config, huge))
    free, _total = torch.cuda.mem_get_info(runtime.device if runtime else None)
    with pytest.raises(ValueError, match="device memory"):
        check_prefix_budget(runtime, int(free) + (1 << 30))
