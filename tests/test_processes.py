"""The lab's helper processes (lab/processes.py): the two nodes' CPU sets, pinning, the child's protocol."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pfec.common.model import llm
from pfec.common.plan.kvlayout import KVGeometry
from pfec.lab import processes
from pfec.lab.processes import LOOPBACK_PSK, Child, NodeCpus, node_cpu_sets, pinned
from pfec.sender.kv import ContextInput

ALLOWED = sorted(os.sched_getaffinity(0))
VOCAB = 64


@pytest.mark.parametrize(("allowed", "receiver", "sender"), [
    ({0, 1}, (1,), (0,)),  # this machine: one core each
    ({0, 1, 2, 3}, (2, 3), (0, 1)),
    ({0, 1, 2}, (2,), (0, 1)),  # the odd CPU goes where two processes run (sender and relay)
    ({12, 3, 7, 9}, (9, 12), (3, 7)),  # a cgroup's scattered CPUs, split in order
])
def test_cpu_sets_split_the_allowed_cpus_into_disjoint_halves(allowed: set[int], receiver: tuple[int, ...],
                                                              sender: tuple[int, ...]) -> None:
    cpus = node_cpu_sets(allowed)
    assert (cpus.receiver, cpus.sender, cpus.pinned) == (receiver, sender, True)
    assert not set(cpus.receiver) & set(cpus.sender)
    assert set(cpus.receiver) | set(cpus.sender) == allowed
    assert cpus.pin("receiver") == receiver and cpus.pin("sender") == cpus.pin("relay") == sender
    assert cpus.to_json() == {"receiver": list(receiver), "sender": list(sender), "relay": list(sender),
                              "pinned": True}


def test_one_cpu_is_not_pinned_and_says_why() -> None:
    cpus = node_cpu_sets({5})
    assert cpus == NodeCpus((5,), (5,), False, cpus.why) and "1 CPU" in cpus.why
    assert cpus.pin("receiver") is None and cpus.pin("sender") is None and cpus.pin("relay") is None
    assert cpus.to_json() == {"receiver": [5], "sender": [5], "relay": [5], "pinned": False, "why": cpus.why}
    with pytest.raises(ValueError, match="no CPUs"):
        node_cpu_sets(set())


def test_default_cpu_sets_are_this_process_s() -> None:
    cpus = node_cpu_sets()
    assert sorted(cpus.receiver + cpus.sender) == ALLOWED or not cpus.pinned


def test_pinning_moves_every_thread_and_restores_it() -> None:
    """Linux keeps a mask per thread: a thread started before pinning (torch's pool, an executor) moves
    too, and everything is back afterwards, torch's thread count included."""
    release, seen = threading.Event(), {}
    worker = threading.Thread(target=release.wait)
    worker.start()
    threads = torch.get_num_threads()
    try:
        with pinned([ALLOWED[-1]]):
            seen["main"] = os.sched_getaffinity(0)
            seen["worker"] = os.sched_getaffinity(worker.native_id or 0)
            seen["torch"] = torch.get_num_threads()
        with pinned(None):
            seen["none"] = os.sched_getaffinity(0)
    finally:
        release.set()
        worker.join()
    assert seen["main"] == seen["worker"] == {ALLOWED[-1]} and seen["torch"] == 1
    assert seen["none"] == set(ALLOWED) == os.sched_getaffinity(0)
    assert torch.get_num_threads() == threads


def test_child_runs_on_its_cpus_and_answers_bad_requests_with_an_error() -> None:
    """A child given a CPU set reports that set; a bad request gets ("error", text), never a hang, and the
    child keeps serving; a receiver without a model refuses a local prefill the same way."""
    child = Child("receiver", cpus=[ALLOWED[-1]], model="synthetic", psk=LOOPBACK_PSK,
                  geometry=KVGeometry(2, 1, 16, "bf16"))
    try:
        child.wait_ready(60)
        assert child.snapshot()["cpus"] == [ALLOWED[-1]]
        with pytest.raises(RuntimeError, match="unknown request"):
            child.request("frobnicate", 1, timeout_s=10)
        child.conn.send(42)  # not even a tuple
        assert child.conn.poll(10) and child.conn.recv()[0] == "error"
        with pytest.raises(RuntimeError, match="no model"):
            child.local_prefill(ContextInput(context="a", question="b"), 1, timeout_s=10)
        assert child.snapshot()["cpus"] == [ALLOWED[-1]]  # still serving
    finally:
        stats = child.stop()
    assert stats["cpus"] == [ALLOWED[-1]] and stats["datagrams_received"] == 0


@pytest.fixture(scope="module")
def tiny() -> llm.ModelRuntime:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False)
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2")
    return llm.runtime_from_model(LlamaForCausalLM(config).eval(), tok, "tiny-llama", Path("."), "0" * 64,
                                  "fp32")


def test_local_prefill_request_is_timed_with_the_receiver_s_threads(tiny: llm.ModelRuntime) -> None:
    """The receiver's handler: as many torch threads as its CPUs, the calling thread's count left alone;
    bad arguments refused (the serving loop turns them into an ("error", text) answer)."""
    handler = processes._local_prefill_handler(tiny)
    inputs = ContextInput(context_ids=tuple(range(3, 40)), question_ids=(7, 8, 9))
    threads = torch.get_num_threads()

    async def ask(*args: Any) -> dict[str, Any]:
        return dict(await handler(*args))

    out = asyncio.run(ask(inputs, 2))
    assert out["ttft_s"] == min(out["runs_s"]) > 0 and len(out["runs_s"]) == 2, out
    assert out["torch_threads"] == len(ALLOWED) and out["cpus"] == ALLOWED, out
    assert torch.get_num_threads() == threads
    for bad in ((inputs, 0), ("text", 1), (inputs,)):
        with pytest.raises((ValueError, TypeError)):
            asyncio.run(ask(*bad))


def test_a_cpu_quota_writes_its_share_of_a_short_period(tmp_path: Path) -> None:
    """``CpuQuota`` under a cgroup v1 ``cpu`` controller: the group's period and quota, a process moved in
    by pid; a share outside 0.01..64, or no controller, is refused with the reason."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    quota = processes.CpuQuota(0.5, "pfec-test", root=tmp_path)
    group = tmp_path / "cpu" / "pfec-test"
    assert (group / "cpu.cfs_period_us").read_text() == str(processes.QUOTA_PERIOD_US)
    assert (group / "cpu.cfs_quota_us").read_text() == str(processes.QUOTA_PERIOD_US // 2)
    quota.add(4242)
    assert (group / "cgroup.procs").read_text() == "4242"
    assert quota.to_json()["cpus"] == 0.5 and quota.to_json()["cgroup_version"] == 1
    for share in (0.0, -1.0, 100.0):
        with pytest.raises(ValueError, match="share of CPUs"):
            processes.CpuQuota(share, "pfec-test", root=tmp_path)
    with pytest.raises(ValueError, match="no cgroup cpu controller"):
        processes.CpuQuota(0.5, "pfec-test", root=tmp_path / "nothing")


def _cgroup_writable() -> bool:
    try:
        processes.CpuQuota(0.5, f"pfec-probe-{os.getpid()}").close()
        return True
    except ValueError:
        return False


@pytest.mark.skipif(not _cgroup_writable(), reason="no writable cgroup cpu controller here (needs root)")
def test_a_process_under_a_cpu_quota_gets_its_share() -> None:
    """A busy process in a group of a quarter CPU gets about a quarter of the wall time it spins."""
    import subprocess
    import sys

    quota = processes.CpuQuota(0.25, f"pfec-test-{os.getpid()}")
    spin = ("import time\nstart = time.monotonic()\nwhile time.monotonic() - start < 1.5: pass\n"
            "print(time.process_time())")
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        quota.add(child.pid)
        out, _ = child.communicate(timeout=30)
    finally:
        quota.close()
    assert float(out) < 0.75, out  # unthrottled it would be ~1.5 s of CPU
