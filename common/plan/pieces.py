"""Precision levels and pieces (sans-IO, numpy only): the levels, the piece kinds and their ladders, the
byte size of every piece of a KV cache (``PieceLayout``), and the level a node holds each block of a
context it received at (``HeldBlocks``, for a chain that hands it on).

The quantiser, the ladder of pieces and their byte layout are described in :mod:`.precision`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import BlockPlan, KVGeometry

__all__ = [
    "BASE_LEVEL",
    "BASE_OF_LEVEL",
    "CODE_BITS",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_VALUE_GROUP",
    "LEVEL_NAMES",
    "MAX_HOPS",
    "META_BYTES",
    "MIX_TOPS",
    "N_KINDS",
    "QUANTISED_LEVELS",
    "REFINE_TO",
    "SCHEME",
    "HeldBlocks",
    "Level",
    "PieceKind",
    "PieceLayout",
    "default_value_group",
    "held_after_hop",
    "ladder",
    "mix_bytes_per_token",
    "parse_level",
]

SCHEME: Final = "pfec-kivi-bitplane/1"
CODE_BITS: Final = 8  # the quantiser's full code width; lower levels keep its top bits
META_BYTES: Final = 2  # fp16 minimum and step
DEFAULT_BLOCK_TOKENS: Final = 16
DEFAULT_VALUE_GROUP: Final = 32  # KIVI's group of value channels


class Level(IntEnum):
    """Precision a block can be used at; NONE means nothing usable arrived (the block is masked)."""

    NONE = 0
    INT2 = 1
    INT4 = 2
    INT8 = 3
    NATIVE = 4

    @property
    def bits(self) -> int:
        """Code bits of a quantised level (0 for NONE and NATIVE)."""
        return _LEVEL_BITS.get(self, 0)

    @property
    def label(self) -> str:
        return self.name.lower()


_LEVEL_BITS: Final = {Level.INT2: 2, Level.INT4: 4, Level.INT8: 8}
QUANTISED_LEVELS: Final = (Level.INT2, Level.INT4, Level.INT8)
LEVEL_NAMES: Final = {lvl.label: lvl for lvl in Level if lvl is not Level.NONE}


def parse_level(name: object) -> Level:
    """``int2`` / ``int4`` / ``int8`` / ``native`` -> Level; anything else is a ValueError naming them."""
    if isinstance(name, str) and name.strip().lower() in LEVEL_NAMES:
        return LEVEL_NAMES[name.strip().lower()]
    raise ValueError(f"precision {name!r} is not one of {', '.join(LEVEL_NAMES)}")


class PieceKind(IntEnum):
    """What a piece of a block carries (values are the kinds' wire codes)."""

    BASE2 = 0
    BASE4 = 1
    BASE8 = 2
    REFINE4 = 3
    REFINE8 = 4
    NATIVE = 5

    @property
    def level(self) -> Level:
        """The level a block reaches with this piece (and what it needs)."""
        return _KIND_LEVEL[self]

    @property
    def is_base(self) -> bool:
        return self in (PieceKind.BASE2, PieceKind.BASE4, PieceKind.BASE8)

    @property
    def code_bits(self) -> int:
        """Bits of code per element in this piece (0 for NATIVE)."""
        return _KIND_CODE_BITS[self]

    @property
    def needs(self) -> Level:
        """Level that must already be usable for this piece to help (NONE: self-contained)."""
        return _KIND_NEEDS.get(self, Level.NONE)

    @property
    def code_shift(self) -> int:
        """Right shift of the 8-bit code that yields this piece's field (then masked to ``code_bits``)."""
        return CODE_BITS - self.level.bits if self is not PieceKind.NATIVE else 0


_KIND_LEVEL: Final = {
    PieceKind.BASE2: Level.INT2, PieceKind.BASE4: Level.INT4, PieceKind.BASE8: Level.INT8,
    PieceKind.REFINE4: Level.INT4, PieceKind.REFINE8: Level.INT8, PieceKind.NATIVE: Level.NATIVE,
}
_KIND_CODE_BITS: Final = {
    PieceKind.BASE2: 2, PieceKind.BASE4: 4, PieceKind.BASE8: 8,
    PieceKind.REFINE4: 2, PieceKind.REFINE8: 4, PieceKind.NATIVE: 0,
}
_KIND_NEEDS: Final = {PieceKind.REFINE4: Level.INT2, PieceKind.REFINE8: Level.INT4}
BASE_OF_LEVEL: Final = {Level.INT2: PieceKind.BASE2, Level.INT4: PieceKind.BASE4, Level.INT8: PieceKind.BASE8}
REFINE_TO: Final = {Level.INT4: PieceKind.REFINE4, Level.INT8: PieceKind.REFINE8}
N_KINDS: Final = len(PieceKind)


def ladder(base: Level, top: Level) -> tuple[PieceKind, ...]:
    """The pieces that take a block from nothing to ``top``, starting with a base at ``base``.

    ``ladder(INT2, INT8)`` is BASE2, REFINE4, REFINE8; a ``top`` of NATIVE appends NATIVE (which then
    supersedes the quantised pieces); a ``base`` of NATIVE is NATIVE alone.
    """
    base, top = Level(base), Level(top)
    if base is Level.NONE or top < base:
        raise ValueError(f"ladder needs a base level and top >= base, got base {base.label}, top {top.label}")
    if base is Level.NATIVE:
        return (PieceKind.NATIVE,)
    kinds = [BASE_OF_LEVEL[base]]
    kinds += [REFINE_TO[lvl] for lvl in QUANTISED_LEVELS if base < lvl <= top]
    if top is Level.NATIVE:
        kinds.append(PieceKind.NATIVE)
    return tuple(kinds)


# Quantised mixes: (lowest top, highest top, share of blocks by utility that reach the highest top).
MIX_TOPS: Final[dict[str, tuple[Level, Level, float]]] = {
    "int8": (Level.INT8, Level.INT8, 1.0),
    "int8-int4": (Level.INT4, Level.INT8, 0.5),
    "int4": (Level.INT4, Level.INT4, 1.0),
    "int2": (Level.INT2, Level.INT2, 1.0),
}
BASE_LEVEL: Final = Level.INT2  # every quantised mix starts its blocks at int2


def default_value_group(head_dim: int) -> int:
    """KIVI's 32 channels when they tile the head; otherwise the whole head row of a token."""
    return DEFAULT_VALUE_GROUP if head_dim % DEFAULT_VALUE_GROUP == 0 else head_dim


# --- Sizes --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PieceLayout:
    """The blocks of one handoff and the byte size of every piece kind of every block."""

    geometry: KVGeometry
    n_tokens: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    value_group: int = 0  # 0: default_value_group(head_dim)

    def __post_init__(self) -> None:
        for name in ("n_tokens", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PieceLayout.{name} must be a positive integer, got {value!r}")
        if self.value_group == 0:
            object.__setattr__(self, "value_group", default_value_group(self.geometry.head_dim))
        group = self.value_group
        if not isinstance(group, int) or group <= 0 or self.geometry.head_dim % group:
            raise ValueError(
                f"value group {group!r} must be a positive divisor of the head dim {self.geometry.head_dim}"
            )

    @property
    def n_token_blocks(self) -> int:
        return -(-self.n_tokens // self.block_tokens)

    @property
    def n_full_token_blocks(self) -> int:
        return self.n_tokens // self.block_tokens

    @property
    def tail_tokens(self) -> int:
        """Tokens of the last, partial token block (0 when the blocks tile the context)."""
        return self.n_tokens % self.block_tokens

    @property
    def n_blocks(self) -> int:
        return self.geometry.n_layers * self.n_token_blocks

    @property
    def elements_per_token(self) -> int:
        """K and V elements of one token in one layer (all KV heads)."""
        return 2 * self.geometry.n_kv_heads * self.geometry.head_dim

    def block_layer(self, block: int) -> int:
        return block // self.n_token_blocks

    def block_token_range(self, block: int) -> tuple[int, int]:
        start = (block % self.n_token_blocks) * self.block_tokens
        return start, min(start + self.block_tokens, self.n_tokens)

    def block_n_tokens(self) -> npt.NDArray[np.int64]:
        """Tokens in every block [n_blocks]."""
        per_tb = np.full(self.n_token_blocks, self.block_tokens, dtype=np.int64)
        if self.tail_tokens:
            per_tb[-1] = self.tail_tokens
        return np.tile(per_tb, self.geometry.n_layers)

    def meta_bytes(self, tokens: int) -> int:
        """Bytes of a base piece's fp16 minima and steps for a block of ``tokens`` tokens."""
        g = self.geometry
        groups = g.n_kv_heads * g.head_dim + g.n_kv_heads * tokens * (g.head_dim // self.value_group)
        return 2 * META_BYTES * groups

    def piece_size(self, kind: PieceKind, tokens: int) -> int:
        """Exact bytes of one piece of a block of ``tokens`` tokens."""
        kind = PieceKind(kind)
        elements = tokens * self.elements_per_token
        if kind is PieceKind.NATIVE:
            return elements * self.geometry.dtype_bytes
        codes = -(-elements * kind.code_bits // 8)
        return codes + (self.meta_bytes(tokens) if kind.is_base else 0)

    def piece_sizes(self, kind: PieceKind) -> npt.NDArray[np.int64]:
        """Bytes of ``kind`` for every block [n_blocks]."""
        full = self.piece_size(kind, self.block_tokens)
        sizes = np.full(self.n_blocks, full, dtype=np.int64)
        if self.tail_tokens:
            sizes[self.n_token_blocks - 1 :: self.n_token_blocks] = self.piece_size(kind, self.tail_tokens)
        return sizes

    def size_table(self) -> npt.NDArray[np.int64]:
        """[n_blocks, N_KINDS] bytes of every piece kind of every block."""
        return np.stack([self.piece_sizes(k) for k in PieceKind], axis=1)

    def native_bytes(self) -> int:
        return self.n_tokens * self.geometry.n_layers * self.elements_per_token * self.geometry.dtype_bytes

    def bytes_per_token(self, kinds: Sequence[PieceKind]) -> float:
        """Mean bytes per context token when every block carries ``kinds``."""
        table = self.size_table()
        return float(table[:, [int(k) for k in kinds]].sum()) / self.n_tokens


def mix_bytes_per_token(layout: PieceLayout, mix: str) -> float:
    """Mean bytes per context token of a quantised mix's stream: each block's ladder of pieces from
    ``BASE_LEVEL`` to its top (an int8 block carries its int2 base, minima and steps included, and two
    refinements: more than a plain int8 cache)."""
    low, high, share = MIX_TOPS[mix]
    low_bytes = layout.bytes_per_token(ladder(BASE_LEVEL, low))
    high_bytes = layout.bytes_per_token(ladder(BASE_LEVEL, high))
    return (1.0 - share) * low_bytes + share * high_bytes


# --- What a node holds of a context it received (a chain A -> B -> C) ------------------------------
#
# What a node holds of a context it received, for a handoff that passes it on (a chain A -> B -> C).
#
# B's rebuilt cache is not the context A prefilled: a block lost on the way is masked (its rows are zeros),
# and a block that arrived quantised holds its dequantised values. When B hands the grown conversation on,
# its OFFER says so per block (``HeldBlocks``): the level B holds each block at (``Level.NONE``: lost
# upstream), over the first ``n_tokens`` tokens of the context (what B received; B's own continuation after
# them is computed, native), and how many blocks each earlier hop lost. The sender never streams a lost
# block's rows as data, nor quantises a held block below the level it holds; C masks what was lost upstream
# and reports it beside what its own hop lost.
#
# Blocks are the ``BlockPlan``'s: layer-major, ``BLOCK_TOKENS`` tokens each, all KV heads. JSON:
# ``{"n": <tokens covered>, "layers": <n_layers>, "runs": [level, count, level, count, ...], "hops": [...]}``
# (run-length levels; every field typed and bounded by ``from_json``).

MAX_HOPS: Final = 64  # earlier hops an OFFER may list
MAX_LAYERS: Final = 1024  # layers an OFFER's held blocks may name (the receiver checks its own)


def _token_blocks(n_tokens: int, block_tokens: int) -> int:
    return -(-n_tokens // block_tokens)


@dataclass(frozen=True)
class HeldBlocks:
    """The level each block of a received context is held at, and the blocks each earlier hop lost."""

    n_tokens: int
    n_layers: int
    levels: tuple[int, ...]  # Level values, n_layers x ceil(n_tokens / block_tokens), layer-major
    hops_lost: tuple[int, ...] = ()
    block_tokens: int = 16

    def __post_init__(self) -> None:
        expected = self.n_layers * _token_blocks(self.n_tokens, self.block_tokens)
        if self.n_tokens < 1 or self.n_layers < 1 or len(self.levels) != expected:
            raise ValueError(f"held blocks: {len(self.levels)} levels for {self.n_layers} layers of "
                             f"{self.n_tokens} tokens ({expected} expected)")
        if any(not Level.NONE <= lvl <= Level.NATIVE for lvl in self.levels):
            raise ValueError("held blocks: a level outside none..native")

    @property
    def lost_blocks(self) -> int:
        return sum(1 for lvl in self.levels if lvl == Level.NONE)

    @property
    def lost_upstream(self) -> int:
        """Blocks lost on the hops before this node (the sum of ``hops_lost``)."""
        return sum(self.hops_lost)

    def truncated(self, n_tokens: int) -> HeldBlocks:
        """The levels of the first ``n_tokens`` tokens (a conversation that left the received context
        there: the rest was computed again); a block cut in two keeps its level."""
        if not 1 <= n_tokens <= self.n_tokens:
            raise ValueError(f"held blocks: cannot cut {self.n_tokens} tokens to {n_tokens}")
        grid = np.asarray(self.levels, dtype=np.int8).reshape(self.n_layers, -1)
        kept = grid[:, :_token_blocks(n_tokens, self.block_tokens)]
        return HeldBlocks(n_tokens, self.n_layers, tuple(int(v) for v in kept.reshape(-1)), self.hops_lost,
                          self.block_tokens)

    def missing(self) -> dict[str, Any]:
        """How much of the context is missing and where it was lost: blocks lost in all and on each hop
        (first hop first), the share of blocks, and the token spans where some layer's block is lost."""
        n_tb = _token_blocks(self.n_tokens, self.block_tokens)
        lost = np.asarray(self.levels, dtype=np.int8).reshape(self.n_layers, n_tb) == Level.NONE
        spans: list[list[int]] = []
        for tb in np.flatnonzero(lost.any(axis=0)):
            start, end = int(tb) * self.block_tokens, min((int(tb) + 1) * self.block_tokens, self.n_tokens)
            if spans and spans[-1][1] == start:
                spans[-1][1] = end
            else:
                spans.append([start, end])
        total = len(self.levels)
        return {"blocks": total, "blocks_missing": int(lost.sum()), "fraction_missing": round(
            float(lost.sum()) / total, 6), "lost_by_hop": list(self.hops_lost), "tokens_missing": spans,
            "n_tokens": self.n_tokens}

    def block_levels(self, plan: BlockPlan) -> npt.NDArray[np.int8]:
        """The level of each block of ``plan`` (a context that starts with the held one): a block inside
        the held tokens is held as received; one past them was computed here (native); one that straddles
        the end takes the held block's level (a lost one is lost whole: its rows are masked together)."""
        if plan.n_tokens < self.n_tokens or plan.geometry.n_layers != self.n_layers:
            raise ValueError(f"held blocks cover {self.n_tokens} tokens of {self.n_layers} layers; the "
                             f"handoff has {plan.n_tokens} tokens of {plan.geometry.n_layers}")
        if plan.block_tokens != self.block_tokens:
            raise ValueError("held blocks: another block size than the handoff's")
        held_tb = _token_blocks(self.n_tokens, self.block_tokens)
        out = np.full((self.n_layers, plan.n_token_blocks), Level.NATIVE, dtype=np.int8)
        out[:, :held_tb] = np.asarray(self.levels, dtype=np.int8).reshape(self.n_layers, held_tb)
        return out.reshape(-1)

    def to_json(self) -> dict[str, Any]:
        runs: list[int] = []
        for lvl in self.levels:
            if runs and runs[-2] == lvl:
                runs[-1] += 1
            else:
                runs += [int(lvl), 1]
        return {"n": self.n_tokens, "layers": self.n_layers, "runs": runs, "hops": list(self.hops_lost)}

    @classmethod
    def from_json(cls, data: object, n_tokens: int, block_tokens: int = 16) -> HeldBlocks:
        """Typed and bounded against the OFFER's context (``n_tokens``); ValueError naming the bad field.
        The runs are expanded only after their total is checked against the blocks they must cover."""
        if not isinstance(data, dict) or set(data) != {"n", "layers", "runs", "hops"}:
            raise ValueError("OFFER held: expected an object with n, layers, runs and hops")
        n, layers, runs, hops = data["n"], data["layers"], data["runs"], data["hops"]
        if type(n) is not int or not 1 <= n <= n_tokens:
            raise ValueError(f"OFFER held n: expected 1..{n_tokens} (the context's tokens)")
        if type(layers) is not int or not 1 <= layers <= MAX_LAYERS:
            raise ValueError(f"OFFER held layers: expected 1..{MAX_LAYERS}")
        expected = layers * _token_blocks(n, block_tokens)
        if (not isinstance(runs, list) or len(runs) % 2 or len(runs) > 2 * expected
                or not all(type(v) is int for v in runs)):
            raise ValueError(f"OFFER held runs: expected [level, count, ...] pairs over {expected} blocks")
        pairs = list(zip(runs[::2], runs[1::2], strict=True))
        if any(not Level.NONE <= lvl <= Level.NATIVE or count < 1 for lvl, count in pairs) or sum(
                count for _, count in pairs) != expected:
            raise ValueError(f"OFFER held runs: levels 0..4 with positive counts covering {expected} blocks")
        if (not isinstance(hops, list) or len(hops) > MAX_HOPS
                or not all(type(h) is int and 0 <= h <= expected for h in hops)):
            raise ValueError(f"OFFER held hops: expected at most {MAX_HOPS} block counts in 0..{expected}")
        levels = tuple(lvl for lvl, count in pairs for _ in range(count))
        return cls(n, layers, levels, tuple(hops), block_tokens)


def held_after_hop(plan: BlockPlan, received: npt.NDArray[np.int8],
                   upstream: HeldBlocks | None) -> HeldBlocks:
    """What a receiver holds after this hop: each block at the level it arrived here (``received``, Level
    values over ``plan``'s blocks), never above what the sender held it at (``upstream``); this hop's
    losses (blocks the sender held that did not arrive) appended to the earlier hops'."""
    levels = np.asarray(received, dtype=np.int8)
    hops: Sequence[int] = ()
    sent = np.ones(len(levels), dtype=bool)
    if upstream is not None:
        held = upstream.block_levels(plan)
        sent = held != Level.NONE
        levels = np.minimum(levels, held)
        hops = upstream.hops_lost
    lost_here = int(((levels == Level.NONE) & sent).sum())
    return HeldBlocks(plan.n_tokens, plan.geometry.n_layers, tuple(int(v) for v in levels),
                      (*hops, lost_here), plan.block_tokens)
