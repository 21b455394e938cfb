"""A node's model at start-up: load the configured model (or none, for synthetic KV) and warm it.

Both daemons and the lab's demo call ``load_runtime``; torch is imported only when a real model is asked
for, so a synthetic node (transport benchmarks) never loads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pfec.common.plan.handoff import ModelIdentity, synthetic_identity
from pfec.common.plan.kvlayout import DEFAULT_GEOMETRY, KVGeometry

if TYPE_CHECKING:
    from pfec.common.model.llm import ModelRuntime

SYNTHETIC_MODEL: Final = "synthetic"


def runtime_identity(runtime: ModelRuntime) -> ModelIdentity:
    """The identity (fingerprint inputs and geometry) of a loaded model."""
    return ModelIdentity(runtime.model_id, runtime.geometry, runtime.fingerprint.to_json())


def load_runtime(path: str, device: str = "auto", cache_dir: Path | None = None,
                 synthetic_geometry: KVGeometry | None = None) -> tuple[ModelRuntime | None, ModelIdentity]:
    """(runtime, identity) for ``model.path``: ``synthetic`` (no model: random KV of the default model's
    geometry, for transport benchmarks), ``default`` (the embedded model) or a Hugging Face directory.
    The model is warm on return: one forward (llm.load_model) and one short generation.
    """
    if path == SYNTHETIC_MODEL:
        return None, synthetic_identity(synthetic_geometry or DEFAULT_GEOMETRY)
    if cache_dir is not None:
        os.environ["PFEC_CACHE_DIR"] = str(cache_dir)  # read by llm when it locates the converted weights
    from pfec.common.model import llm  # deferred: torch

    runtime = llm.load_model(path, device=device)
    warm_generation(runtime)
    return runtime, runtime_identity(runtime)


def warm_generation(runtime: ModelRuntime) -> None:
    """Prefill a few tokens and decode two: every code path of a handoff runs once before the first one."""
    from pfec.common.model import llm  # deferred: torch

    cache, _ = llm.prefill(runtime, [1, 2, 3, 4, 5, 6, 7, 8])
    llm.generate(runtime, llm.partial_from_cache(cache, None, "mask"), [9, 10], max_new_tokens=2)
