"""Model files on disk: the default model's GGUF converted once to a safetensors cache, and weight hashes.

Two roots: the GGUF comes from the data root that scripts/setup.sh fills (``assets``); the converted model
and the weight-hash memo go to the writable cache root, ``$PFEC_CACHE_DIR`` (a daemon sets it to its
systemd cache directory), else ``~/.cache/pfec``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pfec.common.model.assets import DEFAULT_MODEL_DATA

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "pfec-source.json"  # written last into a converted model: its presence means complete


def _log(message: str) -> None:
    print(f"[pfec] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """Where converted models and weight hashes live: $PFEC_CACHE_DIR, else ~/.cache/pfec."""
    root = Path(os.environ.get("PFEC_CACHE_DIR") or Path.home() / ".cache" / "pfec")
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_files(paths: Sequence[Path]) -> str:
    """sha256 over the names and bytes of ``paths``, in name order."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def weights_hash(model_dir: Path) -> str:
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
        memo[key] = sha256_files(files)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    return str(memo[key])


def default_gguf_path() -> Path:
    """The default model's GGUF in the data root, or a ValueError naming the set-up command."""
    path = DEFAULT_MODEL_DATA.require("the default model") / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"default model file {str(path)!r} is missing: remove {str(path.parent)!r} and "
                         "run scripts/setup.sh again")
    return path


def default_model_dir() -> Path:
    """The embedded SmolLM2 GGUF converted once to safetensors (~17-40 s), then reused (~1 s loads).

    Safe under concurrent first use: each process converts into its own temp dir and renames it into
    place; a loser of the race discards its copy.
    """
    gguf = default_gguf_path()
    target = cache_root() / "models" / "smollm2-135m-instruct-q4_1"
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting {gguf.name} to a safetensors cache in {target} (once)")
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to an fp32 safetensors model directory ``out`` (source record last)."""
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # Tied lm_head is rebuilt from the embeddings on load; GGUF quantization config must not survive.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.__dict__.pop("quantization_config", None)
    model.config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    source = {"model_id": DEFAULT_MODEL_ID, "gguf": gguf.name, "gguf_sha256": sha256_files([gguf])}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2))
