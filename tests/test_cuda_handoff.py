"""A GPU node's handoff end to end: sender and receiver daemons in one process sharing one model, over
loopback UDP: prefill, quantise, stream, rebuild, generate (native, int8, a split), then the receiver
serves the handed-off context from its prefix store through its OpenAI API, the store's caches on the
model's device.

The same body runs on the CPU (the tiny geometry: everything but the device is the GPU's code) and, marked
``cuda``, on a GPU with the tiny geometry and with a random model of Qwen2.5-7B's geometry in bf16
(``lab/bench/gpu.random_runtime``); without a GPU those skip with the reason.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pfec.common.codec import fec
from pfec.common.model import llm
from pfec.common.model.runtime import runtime_identity
from pfec.common.node.control import ControlClient, ControlServer
from pfec.common.node.eventloop import run_event_loop
from pfec.lab.bench.gpu import random_runtime
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput

NO_CUDA = "no CUDA GPU visible to torch (the CUDA build and a GPU are needed: scripts/gpu-check.sh)"
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
PSK = bytes(range(40, 72))
SALT = "gpu-node"
# (device, geometry, context tokens, told rate Mbit/s)
CASES = [
    pytest.param("cpu", "tiny", 150, 20.0, id="cpu-tiny"),
    pytest.param("cuda", "tiny", 150, 20.0, id="cuda-tiny", marks=NEEDS_CUDA),
    pytest.param("cuda", "qwen2.5-7b", 1024, 400.0, id="cuda-qwen2.5-7b-geometry", marks=NEEDS_CUDA),
]


def _words(vocab: int, n: int, seed: int) -> str:
    return " ".join(f"w{i}" for i in np.random.default_rng(seed).integers(3, vocab, size=n))


@pytest.mark.parametrize(("device", "geometry", "tokens", "rate_mbps"), CASES)
def test_a_gpu_nodes_handoff_end_to_end(tmp_path: Path, device: str, geometry: str, tokens: int,
                                        rate_mbps: float) -> None:
    fec.warm_up()
    rt = random_runtime(geometry, device, sharpen=4.0 if geometry == "tiny" else 1.0)
    assert rt.device.type == device
    assert rt.compute_dtype == (torch.bfloat16 if device == "cuda" else torch.float32)
    vocab = int(rt.model.config.vocab_size)
    context, question = _words(vocab, tokens, 0), _words(vocab, 3, 1)
    identity = runtime_identity(rt)
    sock = tmp_path / "rx.sock"

    async def main() -> tuple[list[dict[str, Any]], tuple[int, Any], Any]:
        rx = ReceiverDaemon(identity, PSK, runtime=rt)
        await rx.start("127.0.0.1", 0)
        server = ControlServer(receiver_routes(rx))
        await server.start(sock)
        tx = SenderDaemon(identity, PSK, runtime=rt, rate_mbps=rate_mbps, owd_ms=1, rate_control="fixed")
        assert tx.runtime is rx.runtime  # one model for both roles
        reports = []
        try:
            for precision, mode in (("native", "handoff"), ("int8", "handoff"), ("int8", "split")):
                inputs = ContextInput(context=context, question=question, system="", cache_salt=SALT)
                spec = HandoffSpec(inputs, rx.address, rho=8.0, full_kv_answer=True, max_new_tokens=4,
                                   precision=precision, handoff_mode=mode)
                handoff = tx.submit(spec)
                await asyncio.wait_for(handoff.done.wait(), 300)
                reports.append(handoff.view())
            assert rx.face is not None
            ids = list(llm.chat_prompt(rt, context, question, system="").context_ids)
            match = rx.face.store.lookup(SALT, ids, rx.face.clock(), count=False)
            stored = None if match is None else match.entry.value
            served = await ControlClient(sock).request("POST", "/v1/completions", {
                "model": identity.model_id, "prompt": f"{context} {question}", "max_tokens": 2,
                "temperature": 0, "cache_salt": SALT})
        finally:
            await server.close()
            await tx.close()
            await rx.close()
        return reports, served, stored

    reports, (status, body), stored = run_event_loop(main())
    native, int8, split = reports
    for report in reports:
        assert report["outcome"] == "done", (report.get("failure"), report)
        assert report["recovered_utility"] == pytest.approx(1.0), report
        assert report["start"] == "ready" and report["answer"], report
        assert report["prefix_offered"] is True, report
    # Native bf16 bytes rebuild the sender's own cache: the same answer on any device.
    assert native["received_precision"] == "native" and native["answer"] == native["full_kv_answer"], native
    assert int8["received_precision"] == "int8" and int8["stream_bytes"] < int8["native_bytes"], int8
    assert int8["levels"]["int8"] == int8["n_blocks"], int8
    assert split["handoff_mode"] == split["receiver_mode"] == "split", split
    assert split["blocks_computed"] + split["blocks_received"] == split["n_blocks"], split
    if device == "cpu":  # fp32: int8 and a split still answer as the full cache (bf16 may flip a near tie)
        assert int8["answer"] == int8["full_kv_answer"] and split["answer"] == split["full_kv_answer"]
    # The receiver kept the context (the split's, joined, last) and serves it from its store.
    n_context = native["n_tokens"]
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == n_context, body
    assert body["choices"][0]["text"] is not None
    assert stored is not None and stored.n_context == n_context
    assert {k.device.type for k in stored.keys} == {device}  # on a GPU the store's budget is device memory
    assert {k.dtype for k in stored.keys} == {rt.compute_dtype}
