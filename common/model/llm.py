"""The model glue the rest of the tree uses, in one namespace: ``from pfec.common.model import llm``.

A facade over the parts of this package (see its docstring): loading a model into a ``ModelRuntime``,
chat prompts split at the question, prefill and KV serialisation, partial-cache rebuild (``mask`` or
``zero`` mode), and decoding from a handed-off cache. Callers write ``llm.prefill``, ``llm.generate``, ...
and need not know which part holds a name; the parts import each other directly.
"""

from __future__ import annotations

from pfec.common.model.attention import PFEC_ATTENTION, Observation, observing, pfec_sdpa, row_masks
from pfec.common.model.decode import (
    Generation,
    generate,
    generate_batch,
    local_answer,
    stop_token_ids,
    teacher_forced_logits,
)
from pfec.common.model.kvcache import (
    ChunkStopped,
    PartialKV,
    ReconstructionMode,
    cache_layers,
    cache_rows,
    join_prefix,
    partial_from_cache,
    prefill,
    prefill_chunk,
    rebuild_from_rows,
    rebuild_from_stream,
    rebuild_from_symbols,
    serialise_stream,
    serialise_symbols,
)
from pfec.common.model.loading import (
    DEFAULT_MODEL,
    MAX_SYMBOL_SIZE,
    TORCH_DTYPES,
    TRANSFORMERS_VERSION,
    ModelFingerprint,
    ModelRuntime,
    check_length,
    geometry_of,
    load_model,
    loaded_models,
    model_key,
    resolve_device,
    runtime_from_model,
    warm_up,
)
from pfec.common.model.prompts import DEFAULT_SYSTEM, HandoffPrompt, chat_prompt, count_tokens
from pfec.common.model.weights import DEFAULT_MODEL_ID, cache_root, default_model_dir

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_ID",
    "DEFAULT_SYSTEM",
    "MAX_SYMBOL_SIZE",
    "PFEC_ATTENTION",
    "TORCH_DTYPES",
    "TRANSFORMERS_VERSION",
    "ChunkStopped",
    "Generation",
    "HandoffPrompt",
    "ModelFingerprint",
    "ModelRuntime",
    "Observation",
    "PartialKV",
    "ReconstructionMode",
    "cache_layers",
    "cache_root",
    "cache_rows",
    "chat_prompt",
    "check_length",
    "count_tokens",
    "default_model_dir",
    "generate",
    "generate_batch",
    "geometry_of",
    "join_prefix",
    "load_model",
    "loaded_models",
    "local_answer",
    "model_key",
    "observing",
    "partial_from_cache",
    "pfec_sdpa",
    "prefill",
    "prefill_chunk",
    "rebuild_from_rows",
    "rebuild_from_stream",
    "rebuild_from_symbols",
    "resolve_device",
    "row_masks",
    "runtime_from_model",
    "serialise_stream",
    "serialise_symbols",
    "stop_token_ids",
    "teacher_forced_logits",
    "warm_up",
]
