"""`pfec bench gpu`: a GPU node's model side on a random model of Qwen2.5-7B's geometry, and the planner's
TTFT for that geometry on this GPU against a real handoff's (docs/benchmarks/gpu.{json,md}).

Random weights (bf16 on the GPU) are enough: bytes and speed depend on the geometry, not on what the model
knows. Measured, each the fastest of ``repeats`` with the device synchronised around it:

- prefill tokens/s (``speed.measure_prefill_speed``, the curve a receiver states in its ACCEPT);
- quantise and dequantise GB/s at int8 and int4 (``quant.quantise_tensors``/``dequantise``, on the device;
  GB of the bf16 cache per second), and each precision's stream the daemons' way: quantise, pack and cross
  to the host (``kvcache.serialise_stream``), and the receiver's rebuild (``rebuild_from_stream``: upload,
  unpack, dequantise, masks) and first token (the question's forward and one token, ``generate``);
- the planner's TTFT against a measured one: sender and receiver daemons in this process, sharing the one
  model on the GPU, hand the context over loopback UDP at a told rate; the report holds the planner's
  prediction (the receiver stated its measured speed) beside what the handoff took, part by part, and the
  planner's assumed preset for the geometry (``breakeven_scan.PRESETS``) beside both.

``--device cpu`` runs the same code on the tiny geometry (the bench's own test); without CUDA the GPU run
is refused with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from pfec.common.model import llm, quant
from pfec.common.model.kvcache import cache_layers, rebuild_from_stream, serialise_stream
from pfec.common.model.runtime import runtime_identity
from pfec.common.model.speed import measure_prefill_speed
from pfec.common.node.eventloop import run_event_loop
from pfec.common.plan.breakeven import LinkModel, handoff_option, level_named
from pfec.common.plan.breakeven_scan import preset_named
from pfec.common.plan.precision import BASE_OF_LEVEL, Level, PieceLayout
from pfec.common.plan.stream import default_fidelity, stream_plan

T = TypeVar("T")
# Qwen2.5-7B's config.json (Hugging Face, Qwen/Qwen2.5-7B): 28 layers, 28 query and 4 KV heads of 128.
QWEN25_7B: Final[dict[str, Any]] = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
    "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28, "attention_dropout": 0.0,
    "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
}
TINY: Final[dict[str, Any]] = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
GEOMETRIES: Final = {"qwen2.5-7b": QWEN25_7B, "tiny": TINY}
PRESET_OF: Final = {"qwen2.5-7b": "qwen2.5-7b-geometry"}  # the planner's assumed receiver for it
NO_CUDA: Final = ("no CUDA GPU: torch {version} sees none (install the CUDA build where nvidia-smi answers: "
                  "PFEC_TORCH=cuda scripts/setup.sh), or run the bench's own check with --device cpu")
PSK: Final = bytes(range(64, 96))
QUANTISED: Final = ("int8", "int4")
STREAMS: Final = ("native", "int8", "int4")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def word_tokenizer(vocab: int, eos_id: int) -> PreTrainedTokenizerFast:
    """Words w0 .. w{vocab-1}, one token each (w0 unknown): text for a random model's every id."""
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token=f"w{eos_id}")


def random_runtime(geometry: str, device: str, seed: int = 0, sharpen: float = 1.0) -> llm.ModelRuntime:
    """A random Qwen2 model of ``geometry`` (``GEOMETRIES``) built on ``device`` in the node's compute dtype
    (bf16 on CUDA, fp32 on the CPU), with a word tokenizer. ``sharpen`` scales the query and key weights
    (tiny models: answers then depend on the context)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry {geometry!r} is not one of {', '.join(GEOMETRIES)}")
    where = llm.resolve_device(device)
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    config = Qwen2Config(**GEOMETRIES[geometry])
    torch.manual_seed(seed)
    with torch.device(where), _default_dtype(dtype):
        model = Qwen2ForCausalLM(config).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(sharpen)
                layer.self_attn.k_proj.weight.mul_(sharpen)
    tokenizer = word_tokenizer(config.vocab_size, int(config.eos_token_id))
    return llm.runtime_from_model(model, tokenizer, f"random-{geometry}", Path("."), f"{seed:064x}", "bf16")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, repeats: int, fn: Callable[[], T]) -> tuple[float, T]:
    """The fastest of ``repeats`` runs of ``fn`` (device synchronised before and after) and its last
    result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    assert out is not None
    return best, out


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, size=n)]


@dataclass(frozen=True)
class GpuBenchInputs:
    device: str = "cuda"
    geometry: str = "qwen2.5-7b"
    tokens: int = 2048
    question_tokens: int = 16
    repeats: int = 3
    rate_mbps: float = 400.0
    handoff_tokens: int = 1024
    handoff_precisions: tuple[str, ...] = ("native", "int8")


def _card(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"device": str(device), "name": props.name, "memory_gib": round(total / 2**30, 1),
            "free_gib_after_model": round(free / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}


def _kernels(rt: llm.ModelRuntime, ids: list[int], repeats: int) -> dict[str, Any]:
    """Quantise and dequantise GB/s (bf16 cache bytes per second), on the device."""
    cache, _ = llm.prefill(rt, ids)
    layers = cache_layers(cache)
    layout = PieceLayout(rt.geometry, len(ids))
    cache_bytes = len(ids) * rt.geometry.bytes_per_token
    out: dict[str, Any] = {"cache_bytes": cache_bytes}
    for name in QUANTISED:
        level = Level[name.upper()]
        kinds = [BASE_OF_LEVEL[level]]
        q_s, pieces = _timed(rt.device, repeats, partial(quant.quantise_tensors, layers, layout, kinds))
        levels = np.full(layout.n_blocks, level, dtype=np.int8)
        d_s, _ = _timed(rt.device, repeats, partial(quant.dequantise, pieces, layout, levels, levels,
                                                    rt.compute_dtype, rt.device))
        out[name] = {"quantise_s": q_s, "quantise_gbps": cache_bytes / q_s / 1e9,
                     "dequantise_s": d_s, "dequantise_gbps": cache_bytes / d_s / 1e9}
    return out


def _streams(rt: llm.ModelRuntime, ids: list[int], question: list[int], repeats: int) -> dict[str, Any]:
    """Each precision's stream as the daemons move it: serialise (quantise, pack, to the host), rebuild
    (upload, unpack, dequantise, masks), first token from the rebuilt cache."""
    cache, _ = llm.prefill(rt, ids)
    layout = PieceLayout(rt.geometry, len(ids))
    payload = rt.plan(len(ids)).symbol_size - 4
    fidelity = default_fidelity(rt.geometry.n_layers)
    utility = np.ones(layout.n_blocks)
    out: dict[str, Any] = {}
    for mix in STREAMS:
        if mix == "native":  # native fragments: the cache's bytes as they are (BlockPlan)
            native = rt.plan(len(ids))
            queue = np.arange(native.n_fragments, dtype=np.int64)
            serialise = partial(llm.serialise_symbols, rt, cache, native, queue)
            ser_s, symbols = _timed(rt.device, repeats, serialise)
            have = np.ones(native.n_fragments, dtype=bool)
            rebuild = partial(llm.rebuild_from_symbols, rt, native, symbols, have)
            reb_s, kv = _timed(rt.device, repeats, rebuild)
            stream_bytes = native.kv_bytes
        else:
            plan = stream_plan(layout, mix, utility, fidelity, payload)
            ser_s, symbols = _timed(rt.device, repeats, partial(serialise_stream, rt, cache, plan))
            store = np.ascontiguousarray(symbols[:, 4:])
            levels, bases = plan.usable(np.ones(plan.n_symbols, dtype=bool))
            rebuild = partial(rebuild_from_stream, rt, plan, store, levels, bases)
            reb_s, kv = _timed(rt.device, repeats, rebuild)
            stream_bytes = plan.total_bytes
        first_s, gen = _timed(rt.device, repeats, partial(llm.generate, rt, kv, question, 1))
        out[mix] = {"stream_bytes": int(stream_bytes), "serialise_s": ser_s,
                    "serialise_gbps": len(ids) * rt.geometry.bytes_per_token / ser_s / 1e9,
                    "rebuild_s": reb_s, "first_token_s": first_s,
                    "rebuild_plus_first_token_s": reb_s + first_s, "first_token": list(gen.token_ids)}
    return out


def measured_handoffs(rt: llm.ModelRuntime, ids: list[int], question: list[int], rate_mbps: float,
                      precisions: tuple[str, ...], max_new_tokens: int = 2) -> list[dict[str, Any]]:
    """Real handoffs through sender and receiver daemons in this process (one model, shared), over loopback
    UDP at ``rate_mbps`` (told, fixed: loopback has no other bottleneck): each report's planner prediction,
    measured TTFT and parts. A first handoff (``warm_up``: the sender learns the receiver's stated speed
    from its ACCEPT, so it was planned on the stored curve) comes first, at the first precision."""
    from pfec.common.codec import fec  # deferred: numba
    from pfec.receiver.daemon import ReceiverDaemon  # deferred: the daemons
    from pfec.sender.daemon import SenderDaemon  # deferred: the daemons
    from pfec.sender.handoffs import HandoffSpec  # deferred: the daemons
    from pfec.sender.kv import ContextInput  # deferred: the daemons

    fec.warm_up()
    identity = runtime_identity(rt)

    async def run() -> list[dict[str, Any]]:
        rx = ReceiverDaemon(identity, PSK, runtime=rt)
        await rx.start("127.0.0.1", 0)
        await rx.measure_prefill_speed()  # stated in its ACCEPTs, as a node states it at start-up
        tx = SenderDaemon(identity, PSK, runtime=rt, rate_mbps=rate_mbps, owd_ms=1, rate_control="fixed")
        reports = []
        try:
            for precision in (precisions[0], *precisions):
                spec = HandoffSpec(ContextInput(context_ids=tuple(ids), question_ids=tuple(question)),
                                   rx.address, rho=4.0, max_new_tokens=max_new_tokens, full_kv_answer=True,
                                   precision=precision, handoff_mode="handoff")
                handoff = tx.submit(spec)
                await asyncio.wait_for(handoff.done.wait(), 600)
                reports.append(handoff.view())
        finally:
            await tx.close()
            await rx.close()
        return reports

    reports = run_event_loop(run())
    return [{**_handoff_row(r), "warm_up": i == 0} for i, r in enumerate(reports)]


def _handoff_row(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("outcome", "precision", "received_precision", "n_tokens", "stream_bytes", "native_bytes",
            "planner_ttft_s", "ttft_s", "recovered_utility", "answer", "full_kv_answer", "failure")
    row = {k: report.get(k) for k in keys}
    row["predicted_vs_measured"] = report.get("predicted_vs_measured")
    pair = (report.get("predicted_vs_measured") or {}).get("ttft_s") or {}
    row["ttft_measured_over_predicted"] = pair.get("measured_over_predicted")
    return row


def _preset_predictions(geometry: str, n_tokens: int, question_tokens: int, rate_mbps: float,
                        precisions: tuple[str, ...]) -> dict[str, Any] | None:
    """The planner's TTFT with its assumed receiver for the geometry (a preset of constants, not this GPU)."""
    if geometry not in PRESET_OF:
        return None
    preset = preset_named(PRESET_OF[geometry])
    receiver = replace(preset.receiver, question_tokens=question_tokens)
    link = LinkModel(rate_mbps * 1e6, 0.002)
    return {"preset": preset.name, "source": preset.source,
            **{p: handoff_option(n_tokens, preset.geometry, level_named(p), link, receiver, True).ttft_s
               for p in precisions}}


def run_gpu_bench(inputs: GpuBenchInputs,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every figure of the bench (module docstring) for ``inputs``; ValueError without the device asked."""
    if inputs.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(NO_CUDA.format(version=torch.__version__))
    if min(inputs.tokens, inputs.handoff_tokens) < 64 or inputs.question_tokens < 1 or inputs.repeats < 1:
        raise ValueError("bench gpu needs tokens and handoff tokens >= 64, question tokens >= 1, "
                         "repeats >= 1")
    steps, done = 5, 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, steps)

    load_before = os.getloadavg()
    started = time.perf_counter()
    rt = random_runtime(inputs.geometry, inputs.device)
    build_s = time.perf_counter() - started
    llm.warm_up(rt)
    card = _card(rt.device)
    step()
    n = inputs.tokens
    vocab = int(rt.model.config.vocab_size)
    ids, question = _ids(vocab, n, 1), _ids(vocab, inputs.question_tokens, 2)
    speed = measure_prefill_speed(rt, (n // 4, n // 2, n), repeats=inputs.repeats)
    step()
    kernels = _kernels(rt, ids, inputs.repeats)
    step()
    streams = _streams(rt, ids, question, inputs.repeats)
    step()
    handoff_ids = ids[: inputs.handoff_tokens]
    handoffs = measured_handoffs(rt, handoff_ids, question, inputs.rate_mbps, inputs.handoff_precisions)
    step()
    g = rt.geometry
    return {
        "inputs": {**asdict(inputs), "handoff_precisions": list(inputs.handoff_precisions),
                   "geometry_kv": {"n_layers": g.n_layers, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
                                   "dtype": g.dtype, "bytes_per_token": g.bytes_per_token},
                   "compute_dtype": str(rt.compute_dtype).removeprefix("torch."),
                   "weights": "random (seed 0): bytes and speed depend on the geometry only"},
        "card": card,
        "model_build_s": build_s,
        "prefill": {"tokens_per_second": speed.tokens_per_second(n),
                    "points": [list(p) for p in speed.points], "curve": speed.curve.to_dict(),
                    "decode_s": speed.decode_s},
        "kernels": kernels,
        "streams": streams,
        "handoffs": handoffs,
        "planner_preset": _preset_predictions(inputs.geometry, inputs.handoff_tokens, inputs.question_tokens,
                                              inputs.rate_mbps, inputs.handoff_precisions),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def write_gpu_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    inp, card, pre = result["inputs"], result["card"], result["prefill"]
    where = card.get("name", card["device"])
    lines = [
        "# A GPU node's model side (`pfec bench gpu`)",
        "",
        f"{where} ({card.get('memory_gib', '-')} GiB, torch {card['torch']}, CUDA {card.get('cuda', '-')}); "
        f"a random model of the {inp['geometry']} geometry ({inp['geometry_kv']['n_layers']} layers, "
        f"{inp['geometry_kv']['n_kv_heads']} KV heads of {inp['geometry_kv']['head_dim']}), "
        f"{inp['compute_dtype']} compute, bf16 KV. Fastest of {inp['repeats']} runs, device synchronised. "
        f"Load average {result['loadavg_before']} before, {result['loadavg_after']} after.",
        "",
        f"Prefill: {pre['tokens_per_second']:.0f} tokens/s at {inp['tokens']} tokens; one decode step "
        f"{pre['decode_s'] * 1000:.1f} ms.",
        "",
        "| precision | quantise GB/s | dequantise GB/s |",
        "|---|---|---|",
    ]
    for p in QUANTISED:
        k = result["kernels"][p]
        lines.append(f"| {p} | {k['quantise_gbps']:.1f} | {k['dequantise_gbps']:.1f} |")
    lines += ["", f"Streams of {inp['tokens']} tokens as the daemons move them:", "",
              "| precision | stream MB | serialise s | rebuild s | first token s |", "|---|---|---|---|---|"]
    for mix, s in result["streams"].items():
        lines.append(f"| {mix} | {s['stream_bytes'] / 1e6:.1f} | {s['serialise_s']:.4f} | "
                     f"{s['rebuild_s']:.4f} | {s['first_token_s']:.4f} |")
    preset = result.get("planner_preset") or {}
    lines += ["", f"Handoffs of {inp['handoff_tokens']} tokens through both daemons (one shared model), "
              f"loopback UDP told {inp['rate_mbps']:g} Mbit/s. The planner used the receiver's stated speed; "
              "the preset column is its assumed receiver for the geometry.", "",
              "| precision | outcome | planner TTFT s | measured TTFT s | measured / predicted | "
              "preset TTFT s |",
              "|---|---|---|---|---|---|"]
    for h in result["handoffs"]:
        if h["warm_up"]:
            continue
        lines.append(f"| {h['precision']} | {h['outcome']} | {_f(h['planner_ttft_s'])} | {_f(h['ttft_s'])} | "
                     f"{_f(h['ttft_measured_over_predicted'])} | {_f(preset.get(h['precision']))} |")
    lines.append("")
    (out_dir / "gpu.md").write_text("\n".join(lines))
