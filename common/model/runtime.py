"""A node's model at start-up: load the configured model (or none, for synthetic KV) and warm it.

Both daemons and the lab's demo call ``load_runtime``; torch is imported only when a real model is asked
for, so a synthetic node (transport benchmarks) never loads it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pfec.common.plan.handoff import ModelIdentity, synthetic_identity
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry
from pfec.common.plan.prefix_store import device_budget_error

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

SYNTHETIC_MODEL: Final = "synthetic"
MAX_TORCH_THREADS: Final = 256

log = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a cgroup/taskset limit, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def set_torch_threads(threads: int | None) -> int:
    """Set torch's intra- and inter-op thread counts once at start-up (``model.torch_threads``; None: the
    usable CPUs) and return the intra-op count. Set, never left to torch's default: under load 2 threads
    prefilled far slower than 1, so the count must match the CPUs the node really has."""
    n = usable_cpus() if threads is None else threads
    if not 1 <= n <= MAX_TORCH_THREADS:
        raise ValueError(f"torch threads must be 1..{MAX_TORCH_THREADS}, got {n}")
    import torch  # deferred: only a node with a model loads torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError as exc:  # allowed once per process, before any inter-op work: keep the first
        log.info("torch inter-op threads stay %d (%s)", torch.get_num_interop_threads(), exc)
    log.info("torch threads: %d intra-op, %d inter-op (%s)", torch.get_num_threads(),
             torch.get_num_interop_threads(), "usable CPUs" if threads is None else "model.torch_threads")
    return int(torch.get_num_threads())


def runtime_identity(runtime: ModelRuntime) -> ModelIdentity:
    """The identity (fingerprint inputs and geometry) of a loaded model."""
    return ModelIdentity(runtime.model_id, runtime.geometry, runtime.fingerprint.to_json())


def torch_threads() -> int:
    """Torch's intra-op thread count now (a node with a model: as ``set_torch_threads`` left it)."""
    import torch  # deferred: only a node with a model loads torch

    return int(torch.get_num_threads())


def load_runtime(path: str, device: str = "auto", cache_dir: Path | None = None,
                 synthetic_geometry: KVGeometry | None = None, torch_threads: int | None = None,
                 ) -> tuple[ModelRuntime | None, ModelIdentity]:
    """(runtime, identity) for ``model.path``: ``synthetic`` (no model: random KV of the default model's
    geometry, for transport benchmarks), ``default`` (the embedded model) or a Hugging Face directory.
    The model is warm on return: one forward (llm.load_model) and one short generation; torch's thread
    counts are set first (``set_torch_threads``).
    """
    if path == SYNTHETIC_MODEL:
        return None, synthetic_identity(synthetic_geometry or DEFAULT_GEOMETRY)
    set_torch_threads(torch_threads)
    if cache_dir is not None:
        os.environ["PFEC_CACHE_DIR"] = str(cache_dir)  # read by llm when it locates the converted weights
    from pfec.common.model import llm  # deferred: torch

    runtime = llm.load_model(path, device=device)
    warm_generation(runtime)
    return runtime, runtime_identity(runtime)


def check_prefix_budget(runtime: ModelRuntime | None, budget_bytes: int) -> None:
    """ValueError (a start-up error naming ``limits.prefix_cache_bytes``) when the prefix cache store's
    budget cannot fit the model's GPU: its caches live there. Nothing to check without a model or on the
    CPU."""
    if runtime is None or runtime.device.type != "cuda" or budget_bytes <= 0:
        return
    import torch  # deferred: only a node with a model loads torch

    free, total = torch.cuda.mem_get_info(runtime.device)
    error = device_budget_error(budget_bytes, int(free), int(total), str(runtime.device))
    if error is not None:
        raise ValueError(error)


def warm_generation(runtime: ModelRuntime) -> None:
    """Prefill a few tokens and decode two: every code path of a handoff runs once before the first one."""
    from pfec.common.model import llm  # deferred: torch

    cache, _ = llm.prefill(runtime, [1, 2, 3, 4, 5, 6, 7, 8])
    llm.generate(runtime, llm.partial_from_cache(cache, None, "mask"), [9, 10], max_new_tokens=2)
