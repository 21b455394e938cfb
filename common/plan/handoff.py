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
import re
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import BlockPlan, KVGeometry, decode_fragment_ids, fitted_symbol_size
from pfec.common.plan.pieces import HeldBlocks
from pfec.common.plan.precision import SCHEME as QUANT_SCHEME
from pfec.common.plan.prefix_store import MAX_SALT_CHARS
from pfec.common.plan.stream import PrecisionOffer
from pfec.common.plan.utility import (
    SHIPPED_PROFILE,
    ProfileError,
    UtilityProfile,
    check_profile_name,
    synthetic_profile,
)
from pfec.common.wire.group import GROUP_TICKET_SIZE, GroupTicket
from pfec.common.wire.messages import DEFAULT_SYMBOL_SIZE, WIRE_VERSION, ParseError

APP_VERSION = 1
BLOCK_TOKENS = 16
Mode = Literal["mask", "zero"]
#: Defaults of the bounds a peer's blobs are checked against (each daemon passes its configured ones).
MAX_BLOB_BYTES: Final = 1 << 20  # an OFFER/RESULT application blob, and anything decompressed from one
MAX_CONTEXT_TOKENS: Final = 8192
MAX_QUESTION_TOKENS: Final = 4096
MAX_TOKEN_ID: Final = (1 << 31) - 1
MAX_BLOB_JSON_DEPTH: Final = 8
MAX_NEW_TOKENS: Final = 512
#: A local prefill's OFFER (split with m = n_tokens) streams one placeholder symbol and no KV: the transport
#: has no session without source symbols.
LOCAL_SOURCE_SYMBOLS: Final = 1
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text (strings skipped), without parsing it: cheap
    enough (milliseconds per MiB) to run before ``json.loads`` on a hostile body, which recurses once per
    level."""
    text = np.frombuffer(_STRINGS.sub(b"", raw), dtype=np.uint8)
    step = (text == ord("[")).astype(np.int32) + (text == ord("{"))
    step -= (text == ord("]")).astype(np.int32) + (text == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def bounded_decompress(data: bytes, max_bytes: int, what: str) -> bytes:
    """zlib-inflate ``data`` to at most ``max_bytes``; ValueError when it would give more (a zlib bomb)
    or is corrupt. Never allocates beyond ``max_bytes`` (+ zlib's own window)."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, max_bytes)
        if inflater.unconsumed_tail:
            raise ValueError(f"{what}: inflates beyond {max_bytes} bytes (refused)")
        out += inflater.flush(max_bytes + 1 - len(out)) if len(out) <= max_bytes else b""
    except zlib.error as exc:
        raise ValueError(f"{what} is corrupt: {exc}") from None
    if len(out) > max_bytes or not inflater.eof:
        raise ValueError(f"{what}: inflates beyond {max_bytes} bytes or is truncated (refused)")
    return out


def _load_blob(blob: bytes, what: str, max_bytes: int) -> dict[str, Any]:
    """A peer's JSON blob as a dict: size and nesting bounded before it is parsed."""
    if len(blob) > max_bytes:
        raise ValueError(f"{what} application blob: {len(blob)} bytes, above the {max_bytes}-byte limit")
    if json_depth(blob) > MAX_BLOB_JSON_DEPTH:
        raise ValueError(f"{what} application blob: JSON nested deeper than {MAX_BLOB_JSON_DEPTH} levels")
    try:
        data = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{what} application blob is not JSON: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} application blob is not a JSON object")
    return data


@dataclass(frozen=True)
class ModelIdentity:
    """What the fingerprint covers besides the layout; ``details`` is the model fingerprint's JSON.

    ``quant_scheme`` names the KV quantisation scheme this node speaks (``precision.SCHEME``; None: native
    only): it is in the fingerprint, so a peer without it is refused before a session exists."""

    model_id: str
    geometry: KVGeometry
    details: dict[str, Any]
    quant_scheme: str | None = QUANT_SCHEME

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
                "quant_scheme": self.quant_scheme,
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
    """The built-in profiles by name: ``synthetic`` or ``shipped`` (the default model's measured profile).

    Any other name is a ProfileError here: named profiles live in each daemon's profile directory
    (``common/node/profiles.ProfileStore``). Nothing here opens a path a peer or a client chose."""
    check_profile_name(name)
    if name == "synthetic":
        return synthetic_profile(identity.geometry.n_layers)
    if name != "shipped":
        raise ProfileError(f"profile {name!r}: unknown here (only 'synthetic' and 'shipped' are built in)")
    try:
        raw = SHIPPED_PROFILE.read_bytes()
    except OSError:
        raise ProfileError("profile 'shipped': the shipped profile file is missing") from None
    return UtilityProfile.from_bytes(raw, name, identity.geometry.n_layers)


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
class SplitOffer:
    """A split handoff's part of the OFFER: the receiver prefills the context's front [0, m) itself (from
    the token ids given here, the whole context, so it may compute past m) while the back streams, then the
    front after it (native fragments without a precision plan, or the plan's pieces).

    JSON: ``{"m": <block-aligned meeting token>, "ids": [<n_tokens context token ids>]}``; ``m`` equal to
    the context length is a local prefill (nothing streams)."""

    meeting_token: int
    context_ids: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"m": self.meeting_token, "ids": list(self.context_ids)}

    @classmethod
    def from_json(cls, data: object, n_tokens: int) -> SplitOffer:
        """Typed and bounded against the OFFER's context; ValueError naming the bad field."""
        if not isinstance(data, dict) or set(data) != {"m", "ids"}:
            raise ValueError("OFFER split: expected an object with m and ids")
        m, ids = data["m"], data["ids"]
        if type(m) is not int or not 0 <= m <= n_tokens or (m % BLOCK_TOKENS and m != n_tokens):
            raise ValueError(f"OFFER split m: expected a multiple of {BLOCK_TOKENS} in 0..{n_tokens} (or "
                             f"{n_tokens}: all local)")
        if not isinstance(ids, list) or len(ids) != n_tokens:
            raise ValueError(f"OFFER split ids: expected the context's {n_tokens} token ids")
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise ValueError(f"OFFER split ids: expected token ids in 0..{MAX_TOKEN_ID}")
        return cls(m, tuple(ids))


@dataclass(frozen=True)
class PrefixOffer:
    """The context's token ids and cache salt: the receiver keeps the rebuilt context as a prefix cache
    keyed by them (``prefix_store``), for the requests that continue it (a conversation handoff's, or a
    question/answer handoff's after its answer; salt "" is the shared namespace).

    JSON: ``{"salt": <at most MAX_SALT_CHARS characters, "" for none>, "ids": [<n_tokens token ids>]}``;
    a split's OFFER, whose ``split`` already carries the same ids, sends ``{"salt": ...}`` alone (the blob
    holds the ids once: its size bounds the contexts a receiver's ``max_offer_parts`` admits)."""

    salt: str
    context_ids: tuple[int, ...]

    def to_json(self, ids_elsewhere: bool = False) -> dict[str, Any]:
        return {"salt": self.salt} if ids_elsewhere else {"salt": self.salt, "ids": list(self.context_ids)}

    @classmethod
    def from_json(cls, data: object, n_tokens: int, split: SplitOffer | None = None) -> PrefixOffer:
        """Typed and bounded against the OFFER's context; without ids, the split's (which must be there);
        ValueError naming the bad field."""
        if not isinstance(data, dict) or not {"salt"} <= set(data) <= {"salt", "ids"}:
            raise ValueError("OFFER prefix: expected an object with salt and ids")
        salt = data["salt"]
        if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
            raise ValueError(f"OFFER prefix salt: expected a string of at most {MAX_SALT_CHARS} characters")
        if "ids" not in data:
            if split is None:
                raise ValueError("OFFER prefix ids: expected the context's token ids (no split carries them)")
            return cls(salt, split.context_ids)
        ids = data["ids"]
        if not isinstance(ids, list) or len(ids) != n_tokens:
            raise ValueError(f"OFFER prefix ids: expected the context's {n_tokens} token ids")
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise ValueError(f"OFFER prefix ids: expected token ids in 0..{MAX_TOKEN_ID}")
        return cls(salt, tuple(ids))


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
    precision: PrecisionOffer | None = None  # None: native fragments (the blob is then as before)
    split: SplitOffer | None = None  # None: the whole cache streams (the blob is then as before)
    prefix: PrefixOffer | None = None  # the context's ids and salt: the receiver keeps it as a prefix cache
    held: HeldBlocks | None = None  # a context received before (a chain): each block's level, lost ones
    # A multicast fan-out: the stream's group ticket (common/wire/group.py), inside this member's own
    # authenticated OFFER; the data then comes on the group stream, not under this session's keys.
    group: GroupTicket | None = None

    def encode(self) -> bytes:
        data = asdict(self)
        data["question_ids"] = list(self.question_ids)
        data["v"] = APP_VERSION
        for name, part in (("precision", self.precision), ("split", self.split)):
            if part is None:
                del data[name]
            else:
                data[name] = part.to_json()
        if self.held is None:
            del data["held"]
        else:
            data["held"] = self.held.to_json()
        del data["group"]
        if self.group is not None:
            data["group"] = base64.b64encode(self.group.pack()).decode("ascii")
        if self.prefix is None:
            del data["prefix"]
        else:
            same_ids = self.split is not None and self.split.context_ids == self.prefix.context_ids
            data["prefix"] = self.prefix.to_json(ids_elsewhere=same_ids)
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes, *, max_tokens: int = MAX_CONTEXT_TOKENS,
               max_blob_bytes: int = MAX_BLOB_BYTES) -> OfferApp:
        """Raises ValueError naming the bad field. Every field is typed and bounded here, before the
        receiver plans (allocates) anything for it: ``n_tokens`` by ``max_tokens`` (the receiver's
        configured maximum context and its model's), question ids in number and value, the blob's size."""
        data = _load_blob(blob, "OFFER", max_blob_bytes)
        if data.get("v") != APP_VERSION:
            raise ValueError(f"OFFER application blob: v must be {APP_VERSION}")
        n_tokens = data.get("n_tokens")
        if type(n_tokens) is not int or not 0 < n_tokens <= max_tokens:
            shown = n_tokens if type(n_tokens) is int else type(n_tokens).__name__
            raise ValueError(f"OFFER n_tokens: bad value {shown!r}, expected 1..{max_tokens} (this "
                             "receiver's "
                             "maximum context)")
        qids = data.get("question_ids")
        if not isinstance(qids, list) or len(qids) > MAX_QUESTION_TOKENS or not all(
            type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in qids
        ):
            raise ValueError(f"OFFER question_ids: expected a list of at most {MAX_QUESTION_TOKENS} token "
                             "ids "
                             f"in 0..{MAX_TOKEN_ID}")
        mode = data.get("mode")
        if mode not in ("mask", "zero"):
            raise ValueError("OFFER mode: bad value, expected mask or zero")
        max_new = data.get("max_new_tokens", 24)
        if type(max_new) is not int or not 1 <= max_new <= MAX_NEW_TOKENS:
            raise ValueError(f"OFFER max_new_tokens: bad value, expected 1..{MAX_NEW_TOKENS}")
        order = data.get("order", "utility")
        if order not in ("utility", "fifo"):
            raise ValueError("OFFER order: bad value, expected utility or fifo")
        model_id = data.get("model_id", "")
        if not isinstance(model_id, str) or len(model_id) > 256:
            raise ValueError("OFFER model_id: expected a string of at most 256 characters")
        generate = data.get("generate", True)
        if not isinstance(generate, bool):
            raise ValueError("OFFER generate: expected true or false")
        profile = check_profile_name(data.get("profile", "synthetic"), "OFFER profile")
        precision = data.get("precision")
        offer = None if precision is None else PrecisionOffer.from_json(precision)
        split_data = data.get("split")
        split = None if split_data is None else SplitOffer.from_json(split_data, n_tokens)
        if split is not None and split.meeting_token == n_tokens and offer is not None:
            raise ValueError("OFFER split: a local prefill (m = n_tokens) streams nothing (no precision)")
        prefix_data = data.get("prefix")
        prefix = None if prefix_data is None else PrefixOffer.from_json(prefix_data, n_tokens, split)
        held_data = data.get("held")
        held = None if held_data is None else HeldBlocks.from_json(held_data, n_tokens, BLOCK_TOKENS)
        if held is not None and split is not None:
            raise ValueError("OFFER held: a split's front is computed by the receiver (whole handoffs only)")
        group = _group_ticket(data.get("group"))
        if group is not None and split is not None:
            raise ValueError("OFFER group: a fan-out is never split")
        return cls(n_tokens=n_tokens, question_ids=tuple(qids), mode=mode, profile=profile, order=order,
                   max_new_tokens=max_new, model_id=model_id, generate=generate, precision=offer,
                   split=split, prefix=prefix, held=held, group=group)


def _group_ticket(text: object) -> GroupTicket | None:
    """The OFFER's ``group``: base64 of exactly one packed ticket (ValueError naming the field)."""
    if text is None:
        return None
    if not isinstance(text, str) or len(text) != 4 * ((GROUP_TICKET_SIZE + 2) // 3):
        raise ValueError(f"OFFER group: expected base64 of a {GROUP_TICKET_SIZE}-byte group ticket")
    try:
        return GroupTicket.parse(base64.b64decode(text, validate=True))
    except (ValueError, ParseError) as exc:
        raise ValueError(f"OFFER group: {exc}") from None


def pack_bits(bits: npt.NDArray[np.bool_]) -> str:
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 6)).decode("ascii")


def unpack_bits(text: str, n: int) -> npt.NDArray[np.bool_]:
    """The ``n`` bits ``pack_bits`` made; ValueError for anything else (corrupt, short, or a zlib bomb:
    inflation stops at the ``ceil(n / 8)`` bytes the bits need)."""
    if not isinstance(text, str) or len(text) > 4 * MAX_BLOB_BYTES // 3 + 4:
        raise ValueError("RESULT blocks bitmap: expected base64 text of bounded size")
    try:
        packed = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise ValueError(f"RESULT blocks bitmap is corrupt: {exc}") from None
    raw = bounded_decompress(packed, (n + 7) // 8, "RESULT blocks bitmap")
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
    start: str | None = None  # "ready" (everything planned decoded before the deadline) or "deadline"
    precision: str | None = None  # the mix received ("native" for fragments)
    precision_utility: float | None = None  # utility x fidelity at the level each block arrived at
    levels: dict[str, int] | None = None  # blocks per usable level
    handoff_mode: str | None = None  # "handoff" (whole cache), "split" or "local"
    computed_tokens: int | None = None  # split/local: context tokens [0, c) prefilled by the receiver
    blocks_computed: int | None = None  # blocks entirely inside [0, c)
    blocks_received: int | None = None  # blocks after c rebuilt from what arrived
    # split/local: seconds the receiver's whole front chunks of [0, c) took, as they ran (beside the stream:
    # the sender learns the path's front slowdown from it)
    front_s: float | None = None
    # What the parts the planner predicts took here (seconds): OFFER arrival -> decoding closed (ready, DONE
    # or deadline), the question's forward to the first token (decode buffers included), the decode step
    # after it (None: generation stopped at the first token)
    stream_s: float | None = None
    question_s: float | None = None
    decode_step_s: float | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes, max_blob_bytes: int = MAX_BLOB_BYTES) -> ResultApp:
        """Raises ValueError naming the bad field: every field is type-checked (a key-holding but buggy
        receiver must not make the sender fail later on a wrong type)."""
        data = _load_blob(blob, "RESULT", max_blob_bytes)
        unknown = set(data) - _RESULT_FIELDS.keys()
        if unknown:
            raise ValueError(f"RESULT application blob: unknown field {sorted(unknown)[0][:40]!r}")
        for name, (kinds, nullable, required) in _RESULT_FIELDS.items():
            if name not in data:
                if required:
                    raise ValueError(f"RESULT {name}: missing")
                continue
            value = data[name]
            if value is None:
                if not nullable:
                    raise ValueError(f"RESULT {name}: must not be null")
            elif not isinstance(value, kinds) or (type(value) is bool and bool not in kinds):
                raise ValueError(f"RESULT {name}: bad type {type(value).__name__}")
        levels = data.get("levels")
        if levels is not None and (len(levels) > 8 or not all(
                isinstance(k, str) and len(k) <= 16 and type(v) is int for k, v in levels.items())):
            raise ValueError("RESULT levels: expected at most 8 level names with integer block counts")
        start = data.get("start")
        if start not in (None, *RESULT_STARTS):
            raise ValueError(f"RESULT start: expected {', '.join(RESULT_STARTS)}")
        if data.get("handoff_mode") not in (None, "handoff", "split", "local"):
            raise ValueError("RESULT handoff_mode: expected handoff, split or local")
        for name in ("computed_tokens", "blocks_computed", "blocks_received"):
            if data.get(name) is not None and not 0 <= data[name] <= MAX_TOKEN_ID:
                raise ValueError(f"RESULT {name}: expected a count in 0..{MAX_TOKEN_ID}")
        for name in ("front_s", "stream_s", "question_s", "decode_step_s"):
            seconds = data.get(name)
            if seconds is not None and not 0 <= seconds <= MAX_RESULT_SECONDS:  # NaN fails too
                raise ValueError(f"RESULT {name}: expected seconds in 0..{MAX_RESULT_SECONDS:g}")
        return cls(**data)


_NUM = (int, float)
MAX_RESULT_SECONDS: Final = 3600.0  # a front timed longer says more about the receiver's clock than its speed
#: What may start generation (``ReceiverSession.start``): all decoded, the sender's DONE, the deadline.
RESULT_STARTS: Final = ("ready", "sender-done", "deadline")
#: ResultApp's fields: (accepted types, may be null, required).
_RESULT_FIELDS: Final[dict[str, tuple[tuple[type, ...], bool, bool]]] = {
    "recovered_utility": (_NUM, True, True),
    "blocks_recovered": ((int,), False, True),
    "n_blocks": ((int,), False, True),
    "decoded_symbols": ((int,), False, True),
    "n_source": ((int,), False, True),
    "blocks_bitmap": ((str,), False, True),
    "ttft_s": (_NUM, True, True),
    "generation_ttft_s": (_NUM, True, True),
    "deadline_late_ms": (_NUM, False, True),
    "answer": ((str,), True, True),
    "mode": ((str,), False, True),
    "rebuild_s": (_NUM, True, False),
    "error": ((str,), True, False),
    "stats": ((dict,), False, False),
    "start": ((str,), True, False),
    "precision": ((str,), True, False),
    "precision_utility": (_NUM, True, False),
    "levels": ((dict,), True, False),
    "handoff_mode": ((str,), True, False),
    "computed_tokens": ((int,), True, False),
    "blocks_computed": ((int,), True, False),
    "blocks_received": ((int,), True, False),
    "front_s": (_NUM, True, False),
    "stream_s": (_NUM, True, False),
    "question_s": (_NUM, True, False),
    "decode_step_s": (_NUM, True, False),
}


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
