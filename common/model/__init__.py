"""Transformers glue: load a model, prefill, cut its KV cache into symbols, rebuild a partial cache, generate.

``llm`` is the facade the rest of the tree imports; the parts live in ``attention`` (per-row masked SDPA),
``weights`` (the default model's GGUF -> safetensors cache, weight hashes), ``loading`` (runtime and
fingerprint), ``prompts``, ``kvcache`` (prefill, serialise, rebuild) and ``decode``. ``assets`` (no torch)
says where the data files fetched by scripts/setup.sh live.
"""

import os

# Set here, before any module of this package imports transformers: no hub look-ups, no advisory noise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
