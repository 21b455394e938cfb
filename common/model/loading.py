"""Load a model into a ``ModelRuntime``: the model, its tokenizer, KV geometry and the handshake fingerprint.

Pinned to transformers 5.24.0 and its cache API: ``cache=`` on forward, ``cache.layers[i].keys/.values``
of shape [1, n_kv_heads, T, head_dim], rebuild with ``DynamicCache()`` + ``update(k, v, layer)``. Every
loaded model is switched to ``pfec_sdpa`` (``attention``) so partial caches can be masked row by row.
On a GPU the model and caches live on the device, computing in bf16. A process holds one copy of a model
per device and dtype: a second load of the same key shares the first (``load_model``'s registry).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from pfec.common.model.attention import PFEC_ATTENTION
from pfec.common.model.weights import SOURCE_FILE, default_model_dir, weights_hash
from pfec.common.plan.kvlayout import BlockPlan, KVGeometry, fitted_symbol_size

TRANSFORMERS_VERSION = "5.24.0"
DEFAULT_MODEL = "default"
# The transport's largest symbol: 1400-B datagram - 14-B header - 16-B AEAD tag - 8-B repair id.
MAX_SYMBOL_SIZE = 1362
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

if transformers.__version__ != TRANSFORMERS_VERSION:  # the cache API moves between releases
    raise ImportError(
        f"pfec.common.model needs transformers=={TRANSFORMERS_VERSION}, found {transformers.__version__}: "
        "run scripts/setup.sh"
    )


@dataclass(frozen=True)
class ModelFingerprint:
    """What both nodes must share for KV bytes to mean the same thing (checked in the handshake)."""

    model_id: str
    weights_sha256: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    rope: str  # canonical JSON of the rope parameters
    transfer_dtype: str
    transformers_version: str = TRANSFORMERS_VERSION

    @property
    def digest(self) -> str:
        """16 hex chars over every field."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def model_digest(self) -> str:
        """16 hex chars over the model alone (no transfer dtype or library version): keys utility profiles."""
        fields = asdict(self)
        fields.pop("transfer_dtype")
        fields.pop("transformers_version")
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "digest": self.digest, "model_digest": self.model_digest}


@dataclass
class ModelRuntime:
    """A loaded model with what the KV side needs to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None  # None for tests' tiny random models
    model_id: str
    path: Path
    device: torch.device
    compute_dtype: torch.dtype
    geometry: KVGeometry
    fingerprint: ModelFingerprint
    max_context: int

    @property
    def transfer_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.geometry.dtype]

    def plan(self, n_tokens: int, max_symbol_size: int = MAX_SYMBOL_SIZE,
             block_tokens: int = 16) -> BlockPlan:
        """The block plan of a context of ``n_tokens`` with the fitted symbol size."""
        size = fitted_symbol_size(self.geometry, max_symbol_size, block_tokens)
        return BlockPlan(self.geometry, n_tokens, size, block_tokens)


def check_length(runtime: ModelRuntime, n_context: int, n_more: int = 0) -> None:
    """A ValueError unless ``n_context`` (> 0) tokens plus ``n_more`` fit the model's context."""
    if n_context + n_more > runtime.max_context:
        raise ValueError(
            f"context of {n_context} tokens (+{n_more} for the question and answer) exceeds the model's "
            f"{runtime.max_context}-token limit: shorten the context"
        )
    if n_context <= 0:
        raise ValueError("context is empty: nothing to prefill")


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device {device!r} is not one of auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU: use --device cpu")
    return torch.device(device)


def _compute_dtype(compute_dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU (fastest there), bf16 on CUDA."""
    if compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if compute_dtype in TORCH_DTYPES:
        return TORCH_DTYPES[compute_dtype]
    raise ValueError(f"compute dtype {compute_dtype!r} is not one of auto, bf16, fp16, fp32")


def _rope_json(config: PreTrainedConfig) -> str:
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    return json.dumps(rope, sort_keys=True, default=str)


def geometry_of(config: PreTrainedConfig, transfer_dtype: str) -> KVGeometry:
    """The KV geometry of a model config, in ``transfer_dtype``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVGeometry(int(config.num_hidden_layers), int(n_kv), int(head_dim), transfer_dtype)


def runtime_from_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, model_id: str,
                       path: Path, weights_sha256: str, transfer_dtype: str = "bf16") -> ModelRuntime:
    """Wrap an already built model (tests build tiny random ones) and switch it to ``pfec_sdpa``."""
    if transfer_dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"transfer dtype {transfer_dtype!r} is not one of bf16, fp16, fp32")
    model.set_attn_implementation(PFEC_ATTENTION)
    model.eval()
    config = model.config
    geometry = geometry_of(config, transfer_dtype)
    fingerprint = ModelFingerprint(model_id, weights_sha256, geometry.n_layers, geometry.n_kv_heads,
                                   geometry.head_dim, _rope_json(config), transfer_dtype)
    param = next(model.parameters())
    return ModelRuntime(model, tokenizer, model_id, path, param.device, param.dtype, geometry, fingerprint,
                        int(getattr(config, "max_position_embeddings", 0) or 1 << 30))


def _model_dir(model: str) -> Path:
    """The directory of ``default`` or of a local Hugging Face model (cheap: no hashing)."""
    if model == DEFAULT_MODEL:
        return default_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {model!r} is not a local Hugging Face model directory (no config.json); "
            f"give a directory saved with save_pretrained, or {DEFAULT_MODEL!r} for the embedded model"
        )
    return path


def _model_source(model: str, path: Path) -> tuple[str, str]:
    """(model id, weights sha256) of the model in ``path``."""
    if model == DEFAULT_MODEL:
        source = json.loads((path / SOURCE_FILE).read_text())
        return source["model_id"], source["gguf_sha256"]
    return path.resolve().name, weights_hash(path)


#: Which loaded model a load may share: (model directory, device, compute dtype, transfer dtype).
ModelKey: TypeAlias = tuple[str, str, str, str]
# One model per device and dtype in a process (a node's two roles, the lab's daemons side by side): a second
# load of the same key gets the runtime already loaded while anyone holds it (weak values: a model nobody
# holds is freed, not kept for ever). The lock makes a concurrent second load wait for the first.
_LOADED: weakref.WeakValueDictionary[ModelKey, ModelRuntime] = weakref.WeakValueDictionary()
_LOADING = threading.Lock()


def model_key(path: Path, device: torch.device, compute_dtype: torch.dtype, transfer_dtype: str) -> ModelKey:
    """The registry key of a model directory loaded on ``device`` (``cuda`` is named by its index)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(path.resolve()), str(device), str(compute_dtype).removeprefix("torch."), transfer_dtype


def loaded_models() -> dict[ModelKey, ModelRuntime]:
    """The models this process holds now, by key."""
    with _LOADING:
        return dict(_LOADED.items())


def load_model(model: str = DEFAULT_MODEL, device: str = "auto", transfer_dtype: str = "bf16",
               compute_dtype: str = "auto", shared: bool = True) -> ModelRuntime:
    """Load ``default`` (embedded SmolLM2-135M-Instruct) or a local Hugging Face causal-LM directory.

    compute_dtype ``auto``: fp32 on CPU (fastest there), bf16 on CUDA. ``shared`` (default): a model of
    the same directory, device and dtypes this process already holds is returned as it is, so one GPU
    holds one copy however many daemons or roles load it; ``shared=False`` always loads a new copy.
    """
    torch_device = resolve_device(device)
    path = _model_dir(model)
    dtype = _compute_dtype(compute_dtype, torch_device)
    if transfer_dtype not in TORCH_DTYPES:
        raise ValueError(f"transfer dtype {transfer_dtype!r} is not one of bf16, fp16, fp32")
    key = model_key(path, torch_device, dtype, transfer_dtype)
    with _LOADING:
        found = _LOADED.get(key) if shared else None
        if found is not None:
            return found
        model_id, weights = _model_source(model, path)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
        hf_model.to(torch_device)
        runtime = runtime_from_model(hf_model, tokenizer, model_id, path, weights, transfer_dtype)
        warm_up(runtime)
        if shared:
            _LOADED[key] = runtime
    return runtime


def warm_up(runtime: ModelRuntime) -> None:
    """One tiny forward so the first timed request does not pay for lazy initialisation."""
    with torch.inference_mode():
        runtime.model(input_ids=torch.tensor([[1, 2, 3]], device=runtime.device))
