"""`pfec bench quant`: how fast the sender turns native KV into precision pieces and the receiver back.

Why: progressive precision must never be the bottleneck of a handoff. The target is 500 MB/s of native KV
per direction on one core (4x a 1 Gbit/s line) for the levels the planner uses (int8, int4). Measured on
one torch thread, whole cache at a time, median of several runs after one untimed warm-up:

* quantise + pack: cache tensors in -> ``quant.quantise`` -> ``precision.pack_stream`` -> symbols;
* unpack + dequantise: symbols -> ``precision.unpack_stream`` -> ``PiecePlan.usable`` ->
  ``quant.dequantise`` -> tensors in the receiver's compute dtype.

MB are of the cache in the model's native dtype (bf16 here: 23,040 B per token on the default model).
The synthetic cache is measured as each cache dtype a node meets: bf16 and fp16 (a GPU model's native
dtype, in and out) and fp32 (a CPU node computing a bf16 model in float32: fp32 in and out, bf16 native).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pfec.common.model import llm, quant
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry
from pfec.common.plan.precision import (
    Level,
    PieceKind,
    PieceLayout,
    full_plan,
    ladder,
    pack_stream,
    stream_efficiency,
    unpack_stream,
)
from pfec.lab.kv.workloads import needle_qa

TARGET_MB_S = 500.0
PLANNER_LEVELS = ("int8", "int4")
SYMBOL_SIZE = 1230  # the default plan's fragment payload (1234-B symbols less the 4-B fragment id)
MODEL_LOAD_LIMIT_S = 30.0
CASES: dict[str, tuple[PieceKind, ...]] = {
    "int8": ladder(Level.INT8, Level.INT8),
    "int4": ladder(Level.INT4, Level.INT4),
    "int2": ladder(Level.INT2, Level.INT2),
    "int2+r4+r8": ladder(Level.INT2, Level.INT8),
    "native": ladder(Level.NATIVE, Level.NATIVE),
}
# Cache dtype -> (native dtype of the geometry, dtype of the tensors in and out).
CACHE_DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "bf16": ("bf16", torch.bfloat16),
    "fp16": ("fp16", torch.float16),
    "fp32": ("bf16", torch.float32),
}

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _log(message: str) -> None:
    print(f"[pfec bench quant] {message}", file=sys.stderr, flush=True)


def synthetic_cache(geometry: KVGeometry, tokens: int, seed: int = 0) -> Layers:
    """Random KV of the scale a real one has: keys with per-channel offsets up to ~|20| (outlier
    channels), values near zero; in the geometry's dtype."""
    gen = torch.Generator().manual_seed(seed)
    dtype = quant.NATIVE_DTYPES[geometry.dtype]
    shape = (1, geometry.n_kv_heads, tokens, geometry.head_dim)
    out = []
    for _ in range(geometry.n_layers):
        offset = torch.randn(1, geometry.n_kv_heads, 1, geometry.head_dim, generator=gen) * 5
        keys = torch.randn(shape, generator=gen) * 1.5 + offset
        values = torch.randn(shape, generator=gen) * 0.3
        out.append((keys.to(dtype), values.to(dtype)))
    return out


def _median_s(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: first-use costs are not per-handoff costs
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)), times


def bench_case(layers: Layers, layout: PieceLayout, kinds: Sequence[PieceKind], out_dtype: torch.dtype,
               repeats: int) -> dict[str, Any]:
    """Both directions of one piece set over a whole cache."""
    plan = full_plan(layout, kinds, SYMBOL_SIZE)
    have = np.ones(plan.n_symbols, dtype=bool)

    def send() -> np.ndarray:
        return pack_stream(plan, quant.quantise(layers, layout, kinds))

    symbols = send()

    def receive() -> quant.DequantisedKV:
        levels, bases = plan.usable(have)
        return quant.dequantise(unpack_stream(plan, symbols), layout, levels, bases, out_dtype)

    mb = layout.native_bytes() / 1e6
    send_s, send_all = _median_s(send, repeats)
    recv_s, recv_all = _median_s(receive, repeats)
    return {
        "pieces": [k.name for k in kinds],
        "bytes_per_token": plan.total_bytes / layout.n_tokens,
        "vs_native": plan.total_bytes / layout.native_bytes(),
        "symbol_fill": stream_efficiency(plan),
        "quantise_pack_mb_s": mb / send_s,
        "unpack_dequantise_mb_s": mb / recv_s,
        "quantise_pack_ms": send_s * 1e3,
        "unpack_dequantise_ms": recv_s * 1e3,
        "quantise_pack_ms_all": [round(t * 1e3, 2) for t in send_all],
        "unpack_dequantise_ms_all": [round(t * 1e3, 2) for t in recv_all],
    }


def bench_cache(layers: Layers, layout: PieceLayout, out_dtype: torch.dtype, repeats: int,
                progress: Callable[[str], None]) -> dict[str, Any]:
    out = {}
    for name, kinds in CASES.items():
        out[name] = bench_case(layers, layout, kinds, out_dtype, repeats)
        case = out[name]
        progress(f"{name}: {case['quantise_pack_mb_s']:.0f} / {case['unpack_dequantise_mb_s']:.0f} MB/s")
    return out


def _model_cache(tokens: int) -> tuple[dict[str, Any], Layers | None, PieceLayout | None, torch.dtype]:
    """The default model's cache of one needle prompt, unless loading takes too long."""
    started = time.perf_counter()
    runtime = llm.load_model("default", device="cpu")
    load_s = time.perf_counter() - started
    info: dict[str, Any] = {"model": runtime.model_id, "load_s": round(load_s, 2),
                            "compute_dtype": str(runtime.compute_dtype).removeprefix("torch."),
                            "native_dtype": runtime.geometry.dtype}
    if load_s >= MODEL_LOAD_LIMIT_S:
        info["skipped"] = f"loading took {load_s:.0f} s (limit {MODEL_LOAD_LIMIT_S:.0f} s)"
        return info, None, None, runtime.compute_dtype
    example = needle_qa(1, tokens, seed=0, split="eval", count_tokens=partial(llm.count_tokens, runtime))[0]
    prompt = llm.chat_prompt(runtime, example.context, example.question)
    cache, _ = llm.prefill(runtime, prompt.context_ids)
    n = len(prompt.context_ids)
    info["context_tokens"] = n
    layers = [(k[:, :, :n], v[:, :, :n]) for k, v in llm.cache_layers(cache)]
    return info, layers, PieceLayout(runtime.geometry, n), runtime.compute_dtype


def run_quant_bench(repeats: int = 7, tokens: int = 1792, model: bool = True,
                    progress: Callable[[str], None] = _log) -> dict[str, Any]:
    """Throughput of every piece set, on a synthetic default-shaped cache and the real model's cache."""
    if repeats < 1 or tokens < 1:
        raise ValueError(f"repeats and tokens must be >= 1, got {repeats} and {tokens}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        synthetic = {}
        for name, (native, dtype) in CACHE_DTYPES.items():
            geometry = dataclasses.replace(DEFAULT_GEOMETRY, dtype=native)
            layout = PieceLayout(geometry, tokens)
            progress(f"synthetic {name} cache ({native} native), {tokens} tokens, "
                     f"{layout.native_bytes() / 1e6:.1f} MB native")
            cache = [(k.to(dtype), v.to(dtype)) for k, v in synthetic_cache(geometry, tokens)]
            synthetic[name] = bench_cache(cache, layout, dtype, repeats, progress)
        result: dict[str, Any] = {"synthetic": synthetic}
        if model:
            info, layers, model_layout, compute = _model_cache(tokens)
            if layers is not None and model_layout is not None:
                progress(f"model cache, {model_layout.n_tokens} tokens ({info['compute_dtype']} in and out)")
                info["cases"] = bench_cache(layers, model_layout, compute, repeats, progress)
            result["model"] = info
        else:
            result["model"] = {"skipped": "--no-model"}
    finally:
        torch.set_num_threads(threads)
    result["target"] = _target(result)
    result["setup"] = {
        "torch_threads": 1, "repeats": repeats, "statistic": "median after one untimed warm-up",
        "tokens": tokens, "geometry": "30 layers x 3 KV heads x head dim 64, bf16 (SmolLM2-135M)",
        "synthetic": "random keys (per-channel offsets N(0,5) + N(0,1.5)) and values N(0,0.3), rounded to "
                     "the native dtype; per cache dtype: " + ", ".join(
                         f"{k}: {v[0]} native, {str(v[1]).removeprefix('torch.')} in/out"
                         for k, v in CACHE_DTYPES.items()),
        "symbol_size": SYMBOL_SIZE, "mb": "MB (1e6 B) of the cache in its native dtype",
        "send": "quant.quantise + precision.pack_stream (tensors -> symbols)",
        "receive": "precision.unpack_stream + PiecePlan.usable + quant.dequantise (symbols -> tensors)",
        "torch": torch.__version__,
    }
    return result


def _target(result: dict[str, Any]) -> dict[str, Any]:
    """Whether both directions reach TARGET_MB_S for the planner's levels, on each cache measured."""
    checks = {}
    sources = {f"synthetic {k}": v for k, v in result["synthetic"].items()}
    sources["model"] = result["model"].get("cases")
    for source, cases in sources.items():
        if not cases:
            continue
        for level in PLANNER_LEVELS:
            case = cases[level]
            slower = min(case["quantise_pack_mb_s"], case["unpack_dequantise_mb_s"])
            checks[f"{source}/{level}"] = bool(slower >= TARGET_MB_S)
    return {"mb_s": TARGET_MB_S, "levels": list(PLANNER_LEVELS), "met": checks,
            "all_met": all(checks.values())}


def write_quant_bench(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quant.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result.get("machine", {})
    lines = [
        "# Quantisation benchmark (`pfec bench quant`)",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, Python {m.get('python', '?')}; "
        f"one torch thread; median of {result['setup']['repeats']} runs after a warm-up. "
        "MB are of native KV (2 bytes a value).",
        "",
    ]
    tables = [(f"Synthetic {name} cache ({CACHE_DTYPES[name][0]} native)", cases, result["setup"]["tokens"])
              for name, cases in result["synthetic"].items()]
    model = result["model"]
    if model.get("cases"):
        tables.append((f"Default model, needle prompt ({model['compute_dtype']} cache in and out)",
                       model["cases"], model["context_tokens"]))
    for title, cases, tokens in tables:
        lines += [f"## {title}, {tokens} tokens", "",
                  "| pieces | B/token | vs native | symbol fill | quantise+pack MB/s "
                  "| unpack+dequantise MB/s |",
                  "|---|---|---|---|---|---|"]
        for name, c in cases.items():
            lines.append(f"| {name} | {c['bytes_per_token']:,.0f} | {c['vs_native']:.3f} "
                         f"| {c['symbol_fill']:.4f} "
                         f"| {c['quantise_pack_mb_s']:.0f} | {c['unpack_dequantise_mb_s']:.0f} |")
        lines.append("")
    if model.get("skipped"):
        lines += [f"Model cache: skipped ({model['skipped']}).", ""]
    target = result["target"]
    lines += [f"Target {target['mb_s']:.0f} MB/s both ways for {', '.join(target['levels'])}: "
              + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in target["met"].items()), ""]
    (out_dir / "quant.md").write_text("\n".join(lines))
