"""Application layer of a handoff, shared by both daemons: the compatibility fingerprint, the OFFER and
RESULT application blobs (JSON), and the scoring of what the receiver rebuilt.

Pure (no torch, no sockets): the daemons import it. Loading a model and the identity of a loaded one live
in ``common/model/runtime.py``.

Fingerprint (32 bytes, checked by the receiver before a session exists): SHA-256 over the model
fingerprint (model id, weights hash, layers, KV heads, head dim, RoPE, transfer dtype, library version),
the KV layout (block tokens, symbol size) and the wire version. Two nodes agree iff KV bytes mean the same
thing on both.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import BlockPlan, KVGeometry, decode_fragment_ids, fitted_symbol_size
from pfec.common.plan.utility import SHIPPED_PROFILE, UtilityProfile, synthetic_profile
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE, WIRE_VERSION

APP_VERSION = 1
BLOCK_TOKENS = 16
Mode = Literal["mask", "zero"]


@dataclass(frozen=True)
class ModelIdentity:
    """What the fingerprint covers besides the layout; ``details`` is the model fingerprint's JSON."""

    model_id: str
    geometry: KVGeometry
    details: dict[str, Any]

    def layout(self, max_symbol_size: int = DEFAULT_SYMBOL_SIZE) -> tuple[int, int]:
        """(block tokens, fitted symbol size) of this model's plans."""
        return BLOCK_TOKENS, fitted_symbol_size(self.geometry, max_symbol_size, BLOCK_TOKENS)

    def fingerprint(self) -> bytes:
        block_tokens, symbol_size = self.layout()
        blob = json.dumps(
            {
                "model": self.details,
                "geometry": asdict(self.geometry),
                "block_tokens": block_tokens,
                "symbol_size": symbol_size,
                "wire_version": WIRE_VERSION,
                "app_version": APP_VERSION,
            },
            sort_keys=True,
            default=str,
        ).encode()
        return hashlib.sha256(blob).digest()

    def plan(self, n_tokens: int) -> BlockPlan:
        block_tokens, symbol_size = self.layout()
        return BlockPlan(self.geometry, n_tokens, symbol_size, block_tokens)


def synthetic_identity(geometry: KVGeometry, name: str = "synthetic") -> ModelIdentity:
    """No model: random KV bytes of ``geometry`` (transport benchmarks, tests)."""
    return ModelIdentity(name, geometry, {"model_id": name, "synthetic": True})


def load_profile(identity: ModelIdentity, name: str) -> UtilityProfile:
    """``synthetic``, ``shipped`` (the default model's measured profile) or a path to a profile JSON."""
    if name == "synthetic":
        return synthetic_profile(identity.geometry.n_layers)
    path = SHIPPED_PROFILE if name == "shipped" else Path(name)
    profile = UtilityProfile.load(path)
    if profile.n_layers != identity.geometry.n_layers:
        raise ValueError(
            f"utility profile {str(path)!r} is for {profile.n_layers} layers, the model has "
            f"{identity.geometry.n_layers}"
        )
    return profile


def default_profile_name(identity: ModelIdentity) -> str:
    """The shipped profile when it exists and belongs to this model, else ``synthetic``."""
    if identity.details.get("synthetic") or not SHIPPED_PROFILE.is_file():
        return "synthetic"
    try:
        profile = UtilityProfile.load(SHIPPED_PROFILE)
    except ValueError:
        return "synthetic"
    digest = identity.details.get("model_digest")
    if profile.n_layers != identity.geometry.n_layers:
        return "synthetic"
    if profile.fingerprint is not None and digest is not None and profile.fingerprint not in (
        digest,
        identity.details.get("digest"),
    ):
        return "synthetic"
    return "shipped"


# --------------------------------------------------------------------------- OFFER / RESULT blobs


@dataclass(frozen=True)
class OfferApp:
    """The OFFER's application blob: what the receiver needs to rebuild and generate."""

    n_tokens: int
    question_ids: tuple[int, ...]
    mode: Mode = "mask"
    profile: str = "synthetic"
    order: str = "utility"
    max_new_tokens: int = 24
    model_id: str = ""
    generate: bool = True

    def encode(self) -> bytes:
        data = asdict(self)
        data["question_ids"] = list(self.question_ids)
        data["v"] = APP_VERSION
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes) -> OfferApp:
        """Raises ValueError naming the bad field."""
        try:
            data = json.loads(blob)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"OFFER application blob is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("v") != APP_VERSION:
            raise ValueError(f"OFFER application blob: v must be {APP_VERSION}")
        n_tokens = data.get("n_tokens")
        if not isinstance(n_tokens, int) or n_tokens <= 0:
            raise ValueError(f"OFFER n_tokens: bad value {n_tokens!r}, expected a positive integer")
        qids = data.get("question_ids")
        if not isinstance(qids, list) or not all(isinstance(t, int) and t >= 0 for t in qids):
            raise ValueError("OFFER question_ids: expected a list of token ids")
        mode = data.get("mode")
        if mode not in ("mask", "zero"):
            raise ValueError(f"OFFER mode: bad value {mode!r}, expected mask or zero")
        max_new = data.get("max_new_tokens", 24)
        if not isinstance(max_new, int) or not 1 <= max_new <= 512:
            raise ValueError(f"OFFER max_new_tokens: bad value {max_new!r}, expected 1..512")
        return cls(
            n_tokens=n_tokens,
            question_ids=tuple(qids),
            mode=mode,
            profile=str(data.get("profile", "synthetic")),
            order=str(data.get("order", "utility")),
            max_new_tokens=max_new,
            model_id=str(data.get("model_id", "")),
            generate=bool(data.get("generate", True)),
        )


def pack_bits(bits: npt.NDArray[np.bool_]) -> str:
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 6)).decode("ascii")


def unpack_bits(text: str, n: int) -> npt.NDArray[np.bool_]:
    try:
        raw = zlib.decompress(base64.b64decode(text), bufsize=n // 8 + 16)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"RESULT blocks bitmap is corrupt: {exc}") from None
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:n].astype(bool)
    if len(bits) != n:
        raise ValueError(f"RESULT blocks bitmap holds {len(bits)} bits, the plan has {n} blocks")
    return bits


@dataclass
class ResultApp:
    """The RESULT's application blob (receiver -> sender)."""

    recovered_utility: float | None
    blocks_recovered: int
    n_blocks: int
    decoded_symbols: int
    n_source: int
    blocks_bitmap: str
    ttft_s: float | None
    generation_ttft_s: float | None
    deadline_late_ms: float
    answer: str | None
    mode: str
    rebuild_s: float | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes) -> ResultApp:
        try:
            data = json.loads(blob)
            return cls(**data)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"RESULT application blob is malformed: {exc}") from None


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Received:
    """What the receiver has at the deadline, filed by fragment id."""

    store: npt.NDArray[np.uint8]  # [n_fragments, S] by fragment id (rows not in have are zero)
    have: npt.NDArray[np.bool_]  # [n_fragments]
    complete_blocks: npt.NDArray[np.bool_]  # [n_blocks]


def file_by_fragment(
    plan: BlockPlan, decoded_esis: npt.NDArray[np.int64], esi_store: npt.NDArray[np.uint8]
) -> Received:
    """Decoded symbols by ESI (send order) -> by fragment id, using each symbol's protected id prefix.

    Ids outside the plan or duplicated are ignored (the sender is authenticated, so that is a bug there).
    """
    n = plan.n_fragments
    if esi_store.shape[1] != plan.symbol_size:
        raise ValueError(f"decoded symbols are {esi_store.shape[1]} B, the plan's are {plan.symbol_size} B")
    rows = esi_store[decoded_esis] if len(decoded_esis) else esi_store[:0]
    fids = decode_fragment_ids(rows) if len(rows) else np.zeros(0, dtype=np.int64)
    ok = (fids >= 0) & (fids < n)
    fids, rows = fids[ok], rows[ok]
    store = np.zeros((n, plan.symbol_size), dtype=np.uint8)
    store[fids] = rows
    have = np.zeros(n, dtype=bool)
    have[fids] = True
    return Received(store, have, complete_blocks(plan, have))


def complete_blocks(plan: BlockPlan, have: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Blocks whose every fragment is present (the simulator's scoring rule)."""
    got = have.astype(np.int8)
    return np.minimum.reduceat(got, plan.first_fragment[:-1]).astype(bool)


def recovered_utility(block_utility: npt.NDArray[np.float64], complete: npt.NDArray[np.bool_]) -> float:
    total = float(block_utility.sum())
    return float(block_utility[complete].sum()) / total if total > 0 else 0.0
