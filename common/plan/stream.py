"""The progressive-precision stream of one handoff: a precision mix -> the piece plan both nodes compute,
the OFFER's precision part that lets the receiver recompute it, and the score of what arrived. Which
mix (and mode) a handoff takes is :mod:`.mode_choice`'s.

Why: the sender quantises the cache (``common/model/quant.py``) and sends its pieces in value-per-byte
order (``precision.value_order``); the receiver must know which stream bytes are which piece without a
table on the wire. Both nodes already share the geometry (the fingerprint), the context length and the
utility profile (by name, in the OFFER), so the OFFER names only the mix, the scheme, the block and value
group sizes and the fidelity table by name, plus a short digest of the plan: the receiver recomputes the
plan, compares digests, and refuses with a reason when they differ ("the plan names each piece, so the
receiver places fragments without guessing"). Each symbol starts with its 4-byte stream index (as a
native handoff's fragment id), so the receiver files it whatever order it decoded in.

Sans-IO: numpy only (reading the shipped fidelity table is a file read, as for the shipped profile).

Mixes (each block's ladder starts at int2 and climbs by bit-plane refinements, so whatever of a block has
arrived at the deadline is usable at the best level it reaches):

=========== ============================================================ ===================
mix         pieces per block                                              bytes vs native bf16
=========== ============================================================ ===================
native      the block in the model's dtype (today's fragments, unchanged)  1
int8        BASE2, REFINE4, REFINE8                                        0.594 (default model)
int8-int4   int8 for the top half of the blocks by utility, int4 for the rest (the planner's level)
int4        BASE2, REFINE4                                                 0.344
int2        BASE2                                                          0.219
=========== ============================================================ ===================
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pfec.common.plan.pieces import BASE_LEVEL, MIX_TOPS
from pfec.common.plan.precision import (
    SCHEME,
    FidelityTable,
    Level,
    PieceKind,
    PieceLayout,
    PiecePlan,
    full_plan,
    ladder,
    value_order,
)

NATIVE: Final = "native"
AUTO: Final = "auto"
MIXES: Final = ("native", "int8", "int8-int4", "int4", "int2")
PRECISION_CHOICES: Final = (AUTO, *MIXES)
DIGEST_CHARS: Final = 16
_DIGEST = re.compile(r"[0-9a-f]{16}")
MAX_SCHEME_CHARS: Final = 64

# --- Fidelity tables ----------------------------------------------------------------------------------------

DEFAULT_FIDELITY: Final = "default"
SHIPPED_FIDELITY: Final = "shipped"
FIDELITY_NAMES: Final = (DEFAULT_FIDELITY, SHIPPED_FIDELITY)
#: lab/kv/fidelity.py's measured table for the default model (data outside the packages, as the profile).
SHIPPED_FIDELITY_PATH: Final = Path(__file__).resolve().parents[2] / "profiles" / "fidelity" / (
    "smollm2-135m-instruct.json")
MAX_FIDELITY_BYTES: Final = 1 << 20
# DEFAULT (not measured per layer): one group over all layers, fidelity = top-1 next-token agreement with
# the full cache of the whole cache at each level, from issue 13's measurements on the default model (12
# needle-QA prompts at ~1.8k tokens; the planner's table, common/plan/breakeven.DEFAULT_PRECISION_LEVELS):
# int2 0.882, int4 0.976, int8 1.0. Used for any model without a measured table.
DEFAULT_FIDELITY_VALUES: Final = (0.882, 0.976, 1.0)


def default_fidelity(n_layers: int) -> FidelityTable:
    """The stand-in table (see ``DEFAULT_FIDELITY_VALUES``) for a model of ``n_layers`` layers."""
    return FidelityTable(
        n_layers=n_layers, layer_groups=((0, n_layers),), levels=(Level.INT2, Level.INT4, Level.INT8),
        fidelity=(DEFAULT_FIDELITY_VALUES,), scheme=SCHEME, model_id="default",
        source={"kind": "issue 13 whole-cache top-1 agreement (breakeven.DEFAULT_PRECISION_LEVELS)"},
    )


def shipped_fidelity(n_layers: int, model_digest: str | None) -> FidelityTable | None:
    """The measured table shipped for the default model, when it exists and is for this model."""
    try:
        raw = SHIPPED_FIDELITY_PATH.read_bytes()[: MAX_FIDELITY_BYTES + 1]
    except OSError:
        return None
    if len(raw) > MAX_FIDELITY_BYTES:
        return None
    try:
        table = FidelityTable.from_json(json.loads(raw), str(SHIPPED_FIDELITY_PATH))
    except (ValueError, RecursionError):
        return None
    other_model = bool(table.fingerprint and model_digest and table.fingerprint != model_digest)
    if table.n_layers != n_layers or other_model:
        return None
    return table


def fidelity_name_for(n_layers: int, model_digest: str | None) -> str:
    """The table a sender uses: the shipped one where it belongs to this model, else the default."""
    return SHIPPED_FIDELITY if shipped_fidelity(n_layers, model_digest) is not None else DEFAULT_FIDELITY


def fidelity_named(name: str, n_layers: int, model_digest: str | None) -> FidelityTable:
    """The table called ``name`` for this model; ValueError with the reason when there is none."""
    if name == DEFAULT_FIDELITY:
        return default_fidelity(n_layers)
    if name == SHIPPED_FIDELITY:
        table = shipped_fidelity(n_layers, model_digest)
        if table is None:
            raise ValueError("fidelity table 'shipped': this node has no measured table for its model")
        return table
    raise ValueError(f"fidelity table {name!r} is unknown: known tables are {', '.join(FIDELITY_NAMES)}")


# --- Mixes and plans ----------------------------------------------------------------------------------------


def check_mix(mix: str) -> str:
    """``mix`` if it is a precision mix, else ValueError naming the known ones."""
    if mix not in MIXES:
        raise ValueError(f"precision {mix!r} is not one of {', '.join(MIXES)}")
    return mix


def block_tops(mix: str, block_utility: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The level every block reaches when all of its planned pieces arrive (a quantised mix)."""
    check_mix(mix)
    if mix == NATIVE:
        raise ValueError("the native mix has no quantised pieces: it sends today's fragments")
    low, high, share = MIX_TOPS[mix]
    util = np.asarray(block_utility, dtype=np.float64)
    tops = np.full(util.size, int(low), dtype=np.int64)
    if high != low:
        ranked = np.lexsort((np.arange(util.size), -util))  # utility descending, ties by block id
        tops[ranked[: math.ceil(share * util.size)]] = int(high)
    return tops


def stream_plan(layout: PieceLayout, mix: str, block_utility: npt.ArrayLike, fidelity: FidelityTable,
                payload_size: int, order: str = "utility", first_block: int = 0,
                front_after: bool = False, absent: npt.ArrayLike | None = None) -> PiecePlan:
    """The piece plan of a quantised ``mix``: pieces packed into ``payload_size``-byte symbol payloads.

    ``order`` ``utility`` sends pieces by marginal value per byte (``precision.value_order``); ``fifo``
    sends block by block in block order, each block's ladder at once (the fifo schemes' order).
    ``first_block`` > 0 (a split handoff: the receiver computes the front itself) keeps only the pieces of
    token blocks ``first_block``.. (the back, in every layer), in the same order; the tops are those of
    the whole cache, so the back's blocks get the levels they would get in a whole-cache handoff.
    ``front_after`` (a split whose meeting point follows the receiver's speed) keeps the front too, after
    the back, token block by token block from the meeting point down (the blocks the receiver's prefill
    reaches last first; each block's pieces in ``order``): the sender never sends what the receiver has
    computed (its ACKs say how far it got), so the link's spare time fills the gap a slower prefill
    leaves instead of the receiver starting with it masked.
    ``absent`` (bool per block; a chain: the blocks lost upstream, from the OFFER's held map) drops every
    piece of those blocks: the stream carries nothing for them, and both ends plan it alike.
    """
    if not 0 <= first_block < layout.n_token_blocks:
        raise ValueError(f"first token block {first_block!r} lies outside the context's "
                         f"0..{layout.n_token_blocks - 1}")
    tops = block_tops(mix, block_utility)
    kinds = ladder(BASE_LEVEL, Level(int(tops.max())))
    if order == "utility":
        blocks, kind_ids = value_order(layout, block_utility, fidelity, kinds, tops)
    elif order == "fifo":
        plan = full_plan(layout, kinds, payload_size)
        keep = np.asarray([kinds[int(i)].level for i in range(len(kinds))] * layout.n_blocks) <= np.repeat(
            tops, len(kinds))
        blocks, kind_ids = plan.blocks[keep], plan.kinds[keep]
    else:
        raise ValueError(f"order {order!r} is not one of utility, fifo")
    if first_block:
        sent = split_order(blocks % layout.n_token_blocks, first_block, front_after)
        blocks, kind_ids = blocks[sent], kind_ids[sent]
    if absent is not None:
        lost = np.asarray(absent, dtype=np.bool_)
        if lost.shape != (layout.n_blocks,):
            raise ValueError(f"absent blocks: {lost.shape}, the layout has ({layout.n_blocks},) blocks")
        kept = ~lost[blocks]
        if not kept.any():
            raise ValueError("every block of the context was lost upstream: nothing to stream")
        blocks, kind_ids = blocks[kept], kind_ids[kept]
    return PiecePlan(layout, blocks, kind_ids, payload_size)


def split_order(token_blocks: npt.NDArray[np.int64], first_block: int,
                front_after: bool) -> npt.NDArray[np.intp]:
    """Indices into a send order (each entry's token block given) for a split from ``first_block``: the
    back's entries in their order, then (``front_after``) the front's, token block by token block from the
    meeting point down, each block's entries in their order; without ``front_after`` the back only."""
    back = token_blocks >= first_block
    keep = np.flatnonzero(back)
    if not front_after:
        return keep
    front = np.flatnonzero(~back)
    return np.concatenate((keep, front[np.argsort(-token_blocks[front], kind="stable")]))


def symbol_token_ends(plan: PiecePlan) -> npt.NDArray[np.int64]:
    """For every symbol of ``plan``, the token end of the last token block any of its pieces belongs to
    (in any layer): once the receiver has computed the context up to it (a split handoff), nothing in the
    symbol is needed."""
    lo, hi = plan.symbol_piece_spans()
    blocks = plan.blocks.astype(np.int64) % plan.layout.n_token_blocks
    top = blocks[lo].copy()
    width = int((hi - lo).max(initial=1))
    for k in range(1, width):  # a symbol touches a few pieces at most (pieces span many symbols)
        more = lo + k < hi
        top[more] = np.maximum(top[more], blocks[(lo + k)[more]])
    return np.minimum((top + 1) * plan.layout.block_tokens, plan.layout.n_tokens)


def plan_digest(plan: PiecePlan, mix: str, fidelity: str) -> str:
    """16 hex chars over everything that fixes the plan: a different plan has a different digest."""
    head = json.dumps({"scheme": SCHEME, "mix": mix, "fidelity": fidelity, "n_tokens": plan.layout.n_tokens,
                       "block_tokens": plan.layout.block_tokens, "value_group": plan.layout.value_group,
                       "symbol": plan.symbol_size}, sort_keys=True).encode()
    h = hashlib.sha256(head)
    h.update(plan.blocks.astype("<u4").tobytes())
    h.update(plan.kinds.astype("u1").tobytes())
    return h.hexdigest()[:DIGEST_CHARS]


def mix_summary(plan: PiecePlan) -> dict[str, Any]:
    """Blocks per planned top level and piece bytes per level (what the mix ships)."""
    tops = plan.planned_levels()
    blocks = {Level(int(v)).label: int((tops == v).sum()) for v in np.unique(tops)}
    by_level: dict[str, int] = {}
    for kind in np.unique(plan.kinds).tolist():
        label = PieceKind(kind).level.label
        by_level[label] = by_level.get(label, 0) + int(plan.sizes[plan.kinds == kind].sum())
    return {"blocks_by_top_level": blocks, "piece_bytes_by_level": by_level}


# --- The OFFER's precision part -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionOffer:
    """What the receiver needs to recompute the sender's piece plan, and the plan's digest to check it.

    JSON in the OFFER blob: ``{"scheme": ..., "mix": ..., "block_tokens": 16, "value_group": 32,
    "fidelity": "shipped", "plan": "<16 hex>"}``; the profile and the context length are the blob's own.
    """

    scheme: str
    mix: str
    block_tokens: int
    value_group: int
    fidelity: str
    plan: str

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "mix": self.mix, "block_tokens": self.block_tokens,
                "value_group": self.value_group, "fidelity": self.fidelity, "plan": self.plan}

    @classmethod
    def from_json(cls, data: object, head_dim_max: int = 1 << 16) -> PrecisionOffer:
        """Typed and bounded; ValueError naming the bad field. Whether this node knows the scheme and can
        rebuild the plan is ``check_against``'s, once the geometry and the profile are known."""
        if not isinstance(data, dict):
            raise ValueError("OFFER precision: expected an object")
        unknown = set(data) - {"scheme", "mix", "block_tokens", "value_group", "fidelity", "plan"}
        if unknown:
            raise ValueError(f"OFFER precision: unknown field {sorted(unknown)[0][:40]!r}")
        scheme = data.get("scheme")
        if not isinstance(scheme, str) or not 0 < len(scheme) <= MAX_SCHEME_CHARS:
            raise ValueError(f"OFFER precision scheme: expected a string of 1..{MAX_SCHEME_CHARS} characters")
        mix = data.get("mix")
        if mix not in MIXES or mix == NATIVE:
            raise ValueError(f"OFFER precision mix: {str(mix)[:40]!r} is not one of "
                             f"{', '.join(m for m in MIXES if m != NATIVE)}")
        block_tokens, group = data.get("block_tokens"), data.get("value_group")
        for name, value in (("block_tokens", block_tokens), ("value_group", group)):
            if type(value) is not int or not 0 < value <= head_dim_max:
                raise ValueError(f"OFFER precision {name}: expected an integer in 1..{head_dim_max}")
        fidelity = data.get("fidelity")
        if fidelity not in FIDELITY_NAMES:
            raise ValueError(f"OFFER precision fidelity: expected one of {', '.join(FIDELITY_NAMES)}")
        digest = data.get("plan")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ValueError(f"OFFER precision plan: expected {DIGEST_CHARS} lowercase hex characters")
        assert isinstance(block_tokens, int) and isinstance(group, int)
        return cls(scheme, str(mix), block_tokens, group, str(fidelity), digest)


def check_offer(offer: PrecisionOffer, layout: PieceLayout, block_utility: npt.ArrayLike,
                fidelity: FidelityTable, payload_size: int, n_source: int, order: str,
                scheme: str | None, first_block: int = 0, front_after: bool = False,
                absent: npt.ArrayLike | None = None) -> PiecePlan:
    """The plan the OFFER describes, recomputed here; ValueError with the reason when this node does not
    know the scheme, cannot rebuild the layout, or gets another plan (digest or symbol count)."""
    if scheme is None or offer.scheme != scheme:
        raise ValueError(f"OFFER precision scheme {offer.scheme[:64]!r}: this receiver quantises with "
                         f"{scheme!r} only")
    if offer.block_tokens != layout.block_tokens or offer.value_group != layout.value_group:
        raise ValueError(
            f"OFFER precision layout: blocks of {offer.block_tokens} tokens and value groups of "
            f"{offer.value_group} channels, this receiver's are {layout.block_tokens} and "
            f"{layout.value_group}"
        )
    plan = stream_plan(layout, offer.mix, block_utility, fidelity, payload_size, order, first_block,
                       front_after, absent)
    digest = plan_digest(plan, offer.mix, offer.fidelity)
    if digest != offer.plan:
        raise ValueError(f"OFFER precision plan {offer.plan} does not match the plan recomputed here "
                         f"({digest}): the nodes disagree on the profile, fidelity table or layout")
    if plan.n_symbols != n_source:
        raise ValueError(f"OFFER precision plan: {plan.n_symbols} symbols here, the sender offers {n_source}")
    return plan


# --- What arrived -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamScore:
    """Each block's usable level and the utility recovered, plain and credited at precision."""

    levels: npt.NDArray[np.int8]  # Level per block
    bases: npt.NDArray[np.int8]  # base Level per block (for dequantise)
    block_utility: float  # share of utility in blocks usable at any level (as a native handoff scores)
    precision_utility: float  # share of utility x fidelity at the level each block arrived at

    @property
    def usable(self) -> npt.NDArray[np.bool_]:
        return np.asarray(self.levels > Level.NONE)

    def level_counts(self) -> dict[str, int]:
        return {lvl.label: int((self.levels == lvl).sum()) for lvl in Level}


def score_stream(plan: PiecePlan, have_symbols: npt.NDArray[np.bool_], block_utility: npt.ArrayLike,
                 fidelity: FidelityTable) -> StreamScore:
    """Levels from the decoded symbols, and both utilities (each a share of the profile's total)."""
    levels, bases = plan.usable(have_symbols)
    util = np.asarray(block_utility, dtype=np.float64)
    total = float(util.sum())
    fid = fidelity.block_fidelity(plan.layout)
    plain = float(util[levels > Level.NONE].sum()) / total if total > 0 else 0.0
    credited = float((util * fid[np.arange(levels.size), levels]).sum()) / total if total > 0 else 0.0
    return StreamScore(levels, bases, plain, credited)


def file_by_stream_index(plan: PiecePlan, ids: npt.NDArray[np.int64], payloads: npt.NDArray[np.uint8],
                         ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
    """Decoded symbols' stream indices and payloads -> (store [n_symbols, payload], have [n_symbols]).

    Indices outside the plan are ignored (the sender is authenticated: that is its bug)."""
    if payloads.ndim != 2 or payloads.shape[1] != plan.symbol_size or payloads.dtype != np.uint8:
        raise ValueError(f"payloads are {payloads.shape} {payloads.dtype}, the plan's symbols carry "
                         f"{plan.symbol_size} B")
    ok = (ids >= 0) & (ids < plan.n_symbols)
    store = np.zeros((plan.n_symbols, plan.symbol_size), dtype=np.uint8)
    store[ids[ok]] = payloads[ok]
    have = np.zeros(plan.n_symbols, dtype=np.bool_)
    have[ids[ok]] = True
    return store, have
