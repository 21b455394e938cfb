"""The GPU path of a stream, on whatever device the test gets: pieces packed and unpacked as tensors equal
numpy's packers byte for byte; bytes cross to and from the device through the pinned staging buffer
unchanged (in several chunks); a stream serialised and rebuilt on the device equals the CPU's.

Every test runs on the CPU (the same tensor code a GPU runs) and, marked ``cuda``, on CUDA where torch
sees a GPU (skipped elsewhere, with the reason).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pfec.common.model import quant, staging
from pfec.common.plan.kvlayout import KVGeometry
from pfec.common.plan.precision import (
    Level,
    PieceKind,
    PieceLayout,
    PiecePlan,
    full_plan,
    ladder,
    pack_stream,
    unpack_stream,
)
from pfec.common.plan.stream import default_fidelity, stream_plan

NO_CUDA = "no CUDA GPU visible to torch (the CUDA build and a GPU are needed: scripts/gpu-check.sh)"
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
LADDER = ladder(Level.INT2, Level.NATIVE)


def _cache(g: KVGeometry, tokens: int, device: str, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(g.n_layers):
        k = torch.randn(1, g.n_kv_heads, tokens, g.head_dim, generator=gen) * 3
        v = torch.randn(1, g.n_kv_heads, tokens, g.head_dim, generator=gen) * 0.5
        out.append((k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device)))
    return out


def _mixed(layout: PieceLayout, payload: int) -> PiecePlan:
    """An int8-int4 stream in utility order (the daemons' plan): two bases, refinements, a tail block."""
    utility = np.random.default_rng(2).random(layout.n_blocks)
    return stream_plan(layout, "int8-int4", utility, default_fidelity(layout.geometry.n_layers), payload)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan_kind", ["ladder", "int8-int4"])
def test_tensor_packers_equal_numpys(device: str, plan_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "PACK_CHUNK_BYTES", 300)  # many chunks per size class
    g = KVGeometry(3, 2, 16, "bf16")
    layout = PieceLayout(g, 85)  # a tail block of 5 tokens
    layers = _cache(g, 85, device)
    order = np.random.default_rng(1).permutation(layout.n_blocks)
    plan = (full_plan(layout, LADDER, 97, block_order=order) if plan_kind == "ladder"
            else _mixed(layout, 97))
    kinds = [PieceKind(k) for k in np.unique(plan.kinds).tolist()]
    on_device = quant.quantise_tensors(layers, layout, kinds)
    assert all(t.device.type == device for t in on_device.values())
    host = {k: t.cpu().numpy() for k, t in on_device.items()}
    assert {k: v.tobytes() for k, v in quant.quantise(layers, layout, kinds).items()} == \
        {k: v.tobytes() for k, v in host.items()}
    packed = staging.pack_stream_tensor(plan, on_device)
    assert packed.device.type == device
    assert np.array_equal(packed.cpu().numpy(), pack_stream(plan, host))
    symbols = pack_stream(plan, host)
    symbols[::7] = 0  # lost symbols: whatever the store holds
    back = staging.unpack_stream_tensor(plan, torch.from_numpy(symbols).to(device))
    want = unpack_stream(plan, symbols)
    assert set(back) == set(want)
    for kind, rows in want.items():
        assert np.array_equal(back[kind].cpu().numpy(), rows), kind
    with pytest.raises(ValueError, match="piece bytes"):
        staging.pack_stream_tensor(plan, {k: v[:-1] for k, v in on_device.items()})
    with pytest.raises(ValueError, match="symbol store"):
        staging.unpack_stream_tensor(plan, torch.from_numpy(symbols[:-1]).to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_bytes_cross_the_staging_buffer_unchanged(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the staged loops run too (``STAGE_ON_CPU``: an unpinned buffer), the code a GPU runs."""
    monkeypatch.setattr(staging, "STAGING_BYTES", 4096)  # a small buffer: many chunks, both halves
    monkeypatch.setattr(staging, "_STAGING", {})
    monkeypatch.setattr(staging, "STAGE_ON_CPU", True)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(301, 70), dtype=np.uint8)
    on = staging.to_device(data[:, 3:], torch.device(device))  # a strided source
    assert on.device.type == device and np.array_equal(on.cpu().numpy(), data[:, 3:])
    out = np.zeros((301, 80), dtype=np.uint8)
    staging.to_host(on, out[:, 10:77])  # a strided destination
    assert np.array_equal(out[:, 10:77], data[:, 3:]) and not out[:, :10].any() and not out[:, 77:].any()
    wide = rng.integers(0, 256, size=(3, 5000), dtype=np.uint8)  # a row longer than a half: it grows
    assert np.array_equal(staging.to_host(staging.to_device(wide, torch.device(device))), wide)
    assert staging.staging(torch.device(device)).half >= 5000
    with pytest.raises(ValueError, match="2-D uint8"):
        staging.to_host(torch.zeros(4, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="2-D uint8"):
        staging.to_device(np.zeros((2, 2), dtype=np.int16), torch.device(device))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_the_gpu_stages_through_one_pinned_buffer_and_rebuilds_as_the_cpu() -> None:
    """A stream quantised and packed on the GPU is the CPU's stream byte for byte; its rebuild on the GPU
    equals the CPU's; every crossing reused the device's one pinned buffer."""
    from pfec.common.model.kvcache import dequantise_stream, stream_symbols  # deferred: after the skip

    g = KVGeometry(4, 2, 32, "bf16")
    layout = PieceLayout(g, 333)
    layers_gpu = _cache(g, 333, "cuda")
    layers_cpu = [(k.cpu(), v.cpu()) for k, v in layers_gpu]
    plan = _mixed(layout, 1362)
    gpu = stream_symbols(layers_gpu, plan)
    assert np.array_equal(gpu, stream_symbols(layers_cpu, plan))
    buffer = staging.staging(torch.device("cuda")).buffer
    assert buffer.is_pinned()
    store = gpu[:, 4:].copy()
    have = np.ones(plan.n_symbols, dtype=bool)
    levels, bases = plan.usable(have)
    on_gpu = dequantise_stream(plan, store, levels, bases, torch.bfloat16, "cuda")
    on_cpu = dequantise_stream(plan, store, levels, bases, torch.bfloat16, "cpu")
    assert on_gpu.keys[0].device.type == "cuda"
    for a, b in zip(on_gpu.keys + on_gpu.values, on_cpu.keys + on_cpu.values, strict=True):
        assert torch.equal(a.cpu(), b)
    assert staging.staging(torch.device("cuda")).buffer.data_ptr() == buffer.data_ptr()  # reused, not remade
