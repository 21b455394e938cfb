"""Progressive KV precision: levels, pieces and their byte sizes, packing pieces into equal symbols.

Why: a block in the model's dtype costs 12,288 B on the default model; int8 keeps answers at 0.52x the
bytes and int4/int2 cost less again (issue 13). Precision is progressive so that whatever of a block has
arrived at the deadline is used at the best precision it reaches, and the stream can order pieces by
value per byte. Sans-IO: numpy only; the torch side (quantise, dequantise) is ``common/model/quant.py``.

The quantiser (scheme ``SCHEME``, KIVI-style, one per block so that a block never depends on another):

* keys per channel over the block's tokens: one group per (KV head, channel);
* values per token over ``value_group`` consecutive channels: one group per (KV head, token, channel group);
* each group has an fp16 minimum ``m`` (rounded down) and step ``s = (max - m) / 256`` (rounded up), and
  each element the 8-bit code ``q = floor((x - m) / s)`` (clamped to 0..255) of the native-dtype value.

A level of ``b`` bits keeps the top ``b`` bits of ``q`` and reconstructs at the middle of its bin:
``x' = m + (q_b * 2^(8-b) + 2^(7-b)) * s``, so ``|x - x'| <= s * 2^(7-b)`` (half a bin). The ladder is
embedded bit-planes, so a refinement needs no scale of its own:

======== ============================================ =========================================
piece    carries                                      needs
======== ============================================ =========================================
BASE2    group scales/minima + top 2 bits of q        nothing        -> int2
BASE4    group scales/minima + top 4 bits of q        nothing        -> int4
BASE8    group scales/minima + all 8 bits of q        nothing        -> int8
REFINE4  bits 5..4 of q                               int2 usable    -> int4 (equal to BASE4's)
REFINE8  bits 3..0 of q                               int4 usable    -> int8 (equal to BASE8's)
NATIVE   the block in the model's dtype               nothing        -> native (exact)
======== ============================================ =========================================

BASE2 + REFINE4 + REFINE8 is exactly as many bytes as BASE8 (the refinements carry no scales), so climbing
the ladder costs nothing over sending a block at int8 at once. The top rung is the native block itself,
not a residual: a residual in the model's dtype would be as large as the block and not bit-exact. Every
piece is self-contained: its bytes plus the pieces below it on its block's ladder are all it needs.

Byte layout of a block's piece (``H`` KV heads, ``n`` tokens, ``D`` head dim, ``G`` value group): for a
base, four fp16 arrays ``K minima [H, D]``, ``K steps [H, D]``, ``V minima [H, n, D/G]``, ``V steps [H, n,
D/G]``, then the codes; for a refinement, the codes only. Codes run over the elements in the order of
``kvlayout``'s block bytes, (head, token, K channels then V channels), packed low bits first
(``8 / bits`` elements a byte) and zero-padded to a whole byte. NATIVE is exactly ``kvlayout``'s block.

A ``PiecePlan`` lists (block, kind) pieces in send order, packs them back to back into one stream and
cuts it into equal symbols (only the last symbol is padded); the receiver maps decoded symbols back to
complete pieces and to each block's usable level.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pfec.common.plan.kvlayout import KVGeometry

SCHEME: Final = "pfec-kivi-bitplane/1"
FIDELITY_FORMAT: Final = "pfec-precision-fidelity/1"
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


# --- Plans ----------------------------------------------------------------------------------------------


def _as_int_array(values: npt.ArrayLike, name: str) -> npt.NDArray[np.int64]:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"piece plan {name} must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64)


def _check_kinds(kinds: npt.NDArray[np.int64]) -> None:
    bad = np.flatnonzero((kinds < 0) | (kinds >= N_KINDS))
    if bad.size:
        raise ValueError(
            f"piece {int(bad[0])} has unknown kind {int(kinds[bad[0]])}: known kinds are "
            + ", ".join(f"{k.value}={k.name}" for k in PieceKind)
        )


def _check_ladders(index: npt.NDArray[np.int64]) -> None:
    """Every block's pieces form a ladder: one base at most, each refinement's need reachable."""
    present = index >= 0
    bases = present[:, [PieceKind.BASE2, PieceKind.BASE4, PieceKind.BASE8]].sum(axis=1)
    two = np.flatnonzero(bases > 1)
    if two.size:
        raise ValueError(f"block {int(two[0])} has more than one base piece: a block carries one base")
    reach = _reachable_level(present)
    for kind in (PieceKind.REFINE4, PieceKind.REFINE8):
        orphan = np.flatnonzero(present[:, kind] & (reach[kind.needs] == 0))
        if orphan.size:
            raise ValueError(
                f"block {int(orphan[0])} has {kind.name} but no piece that reaches {kind.needs.label} "
                "below it: a refinement needs its block's lower pieces"
            )


def _reachable_level(have: npt.NDArray[np.bool_]) -> dict[Level, npt.NDArray[np.bool_]]:
    """Per quantised level, the blocks whose pieces in ``have`` [n_blocks, N_KINDS] make it usable."""
    int2 = have[:, PieceKind.BASE2]
    int4 = have[:, PieceKind.BASE4] | (int2 & have[:, PieceKind.REFINE4])
    int8 = have[:, PieceKind.BASE8] | (int4 & have[:, PieceKind.REFINE8])
    return {Level.INT2: int2, Level.INT4: int4, Level.INT8: int8}


def usable_levels(have: npt.NDArray[np.bool_]) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8]]:
    """From complete pieces [n_blocks, N_KINDS]: each block's best usable Level and its base's Level.

    The base is NONE where a block is unusable or used at NATIVE (NATIVE needs no base).
    """
    reach = _reachable_level(have)
    level = np.zeros(len(have), dtype=np.int8)
    for lvl in QUANTISED_LEVELS:
        level[reach[lvl]] = lvl
    level[have[:, PieceKind.NATIVE]] = Level.NATIVE
    base = np.zeros(len(have), dtype=np.int8)
    quantised = (level > Level.NONE) & (level < Level.NATIVE)
    for lvl in QUANTISED_LEVELS:
        base[quantised & have[:, BASE_OF_LEVEL[lvl]]] = lvl
    return level, base


@dataclass(frozen=True, eq=False)
class PiecePlan:
    """(block, kind) pieces in send order, packed back to back into one stream of equal symbols.

    Piece ``i`` occupies stream bytes ``offsets[i] .. offsets[i] + sizes[i] - 1``; symbol ``s`` holds stream
    bytes ``s * symbol_size ..``; only the stream's last symbol is zero-padded.
    """

    layout: PieceLayout
    blocks: npt.NDArray[np.int64]
    kinds: npt.NDArray[np.int64]
    symbol_size: int
    sizes: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)
    offsets: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)
    index: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        blocks, kinds = _as_int_array(self.blocks, "blocks"), _as_int_array(self.kinds, "kinds")
        if blocks.shape != kinds.shape or blocks.size == 0:
            raise ValueError(
                f"piece plan needs as many blocks as kinds (at least one), got {blocks.size} and {kinds.size}"
            )
        symbol = self.symbol_size
        if not isinstance(symbol, int) or isinstance(symbol, bool) or symbol <= 0:
            raise ValueError(f"piece plan symbol size must be a positive integer, got {self.symbol_size!r}")
        _check_kinds(kinds)
        out = np.flatnonzero((blocks < 0) | (blocks >= self.layout.n_blocks))
        if out.size:
            raise ValueError(
                f"piece {int(out[0])} names block {int(blocks[out[0]])}, outside the layout's "
                f"0..{self.layout.n_blocks - 1}"
            )
        index = np.full((self.layout.n_blocks, N_KINDS), -1, dtype=np.int64)
        index[blocks, kinds] = np.arange(blocks.size)
        if int((index >= 0).sum()) != blocks.size:
            raise ValueError("piece plan lists the same (block, kind) piece twice")
        _check_ladders(index)
        sizes = self.layout.size_table()[blocks, kinds]
        offsets = np.zeros(blocks.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        for name, value in (("blocks", blocks), ("kinds", kinds), ("sizes", sizes), ("offsets", offsets),
                            ("index", index)):
            value.flags.writeable = False
            object.__setattr__(self, name, value)

    # -- geometry of the stream

    @property
    def n_pieces(self) -> int:
        return int(self.blocks.size)

    @property
    def total_bytes(self) -> int:
        return int(self.offsets[-1] + self.sizes[-1])

    @property
    def n_symbols(self) -> int:
        return -(-self.total_bytes // self.symbol_size)

    @property
    def padding_bytes(self) -> int:
        """Zero bytes at the end of the last symbol: the plan's only padding."""
        return self.n_symbols * self.symbol_size - self.total_bytes

    @property
    def piece_first_symbol(self) -> npt.NDArray[np.int64]:
        return self.offsets // self.symbol_size

    @property
    def piece_last_symbol(self) -> npt.NDArray[np.int64]:
        return (self.offsets + self.sizes - 1) // self.symbol_size

    def symbol_pieces(self, symbol: int) -> range:
        """Indices of the pieces that have bytes in ``symbol`` (pieces are contiguous in the stream)."""
        if not 0 <= symbol < self.n_symbols:
            raise ValueError(f"symbol {symbol} is outside the plan's 0..{self.n_symbols - 1}")
        lo = int(np.searchsorted(self.offsets + self.sizes, symbol * self.symbol_size, side="right"))
        hi = int(np.searchsorted(self.offsets, (symbol + 1) * self.symbol_size, side="left"))
        return range(lo, hi)

    def symbol_piece_spans(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """For every symbol, the first and one-past-last index of the pieces it touches."""
        starts = np.arange(self.n_symbols, dtype=np.int64) * self.symbol_size
        lo = np.searchsorted(self.offsets + self.sizes, starts, side="right")
        hi = np.searchsorted(self.offsets, starts + self.symbol_size, side="left")
        return lo.astype(np.int64), hi.astype(np.int64)

    # -- what arrived

    def complete_pieces(self, have_symbols: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Bool [n_pieces]: every symbol a piece touches was decoded."""
        have = np.asarray(have_symbols)
        if have.dtype != np.bool_ or have.shape != (self.n_symbols,):
            raise ValueError(
                f"symbol mask has shape {have.shape} {have.dtype}, the plan needs ({self.n_symbols},) bool"
            )
        missing = np.concatenate([[0], np.cumsum(~have)])
        return np.asarray(missing[self.piece_last_symbol + 1] - missing[self.piece_first_symbol] == 0)

    def block_pieces(self, complete: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """[n_blocks, N_KINDS]: which pieces of each block are complete."""
        complete = np.asarray(complete, dtype=np.bool_)
        if complete.shape != (self.n_pieces,):
            raise ValueError(f"complete mask has shape {complete.shape}, the plan has {self.n_pieces} pieces")
        have = np.zeros((self.layout.n_blocks, N_KINDS), dtype=np.bool_)
        have[self.blocks, self.kinds] = complete
        return have

    def usable(self, have_symbols: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8]]:
        """Each block's best usable Level and its base's Level, from the decoded symbols."""
        return usable_levels(self.block_pieces(self.complete_pieces(have_symbols)))

    def planned_levels(self) -> npt.NDArray[np.int8]:
        """The level each block reaches when every planned piece arrives."""
        return usable_levels(self.block_pieces(np.ones(self.n_pieces, dtype=np.bool_)))[0]

    # -- a declared plan (from the wire) against this one

    def check_declared(self, sizes: npt.ArrayLike, offsets: npt.ArrayLike | None = None,
                       n_symbols: int | None = None) -> None:
        """ValueError with the reason unless declared piece sizes, offsets, symbol count are this plan's."""
        got = _as_int_array(sizes, "sizes")
        if got.shape != self.sizes.shape:
            raise ValueError(f"declared {got.size} piece sizes, the plan has {self.n_pieces} pieces")
        bad = np.flatnonzero(got != self.sizes)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"piece {i} (block {int(self.blocks[i])}, {PieceKind(int(self.kinds[i])).name}) declared "
                f"{int(got[i])} B, the layout makes it {int(self.sizes[i])} B: sizes do not add up"
            )
        if offsets is not None:
            off = _as_int_array(offsets, "offsets")
            if off.shape != self.offsets.shape:
                raise ValueError(f"declared {off.size} offsets, the plan has {self.n_pieces} pieces")
            bad = np.flatnonzero(off != self.offsets)
            if bad.size:
                i = int(bad[0])
                where = "outside the stream" if not 0 <= off[i] < self.total_bytes else "not back to back"
                raise ValueError(
                    f"piece {i} declared at offset {int(off[i])} ({where}), packing puts it at "
                    f"{int(self.offsets[i])}"
                )
        if n_symbols is not None and n_symbols != self.n_symbols:
            raise ValueError(
                f"declared {n_symbols} symbols, {self.total_bytes} B of pieces in {self.symbol_size}-B "
                f"symbols make {self.n_symbols}"
            )


def full_plan(layout: PieceLayout, kinds: Sequence[PieceKind], symbol_size: int,
              block_order: npt.ArrayLike | None = None) -> PiecePlan:
    """Every block with the same ``kinds``, block by block in ``block_order`` (default: plan order)."""
    order = np.arange(layout.n_blocks) if block_order is None else _as_int_array(block_order, "block order")
    blocks = np.repeat(order, len(kinds))
    return PiecePlan(layout, blocks, np.tile(np.asarray([int(k) for k in kinds]), order.size), symbol_size)


# --- Packing ----------------------------------------------------------------------------------------------

PieceBytes = Mapping[PieceKind, npt.NDArray[np.uint8]]
"""Piece bytes by kind: [n_blocks, size of the kind's full-block piece]; a tail block's shorter piece
fills the front of its row."""


def _windows(stream: npt.NDArray[np.uint8], size: int) -> npt.NDArray[np.uint8]:
    """Every ``size``-byte window of ``stream`` as rows of a view (row i starts at byte i)."""
    return np.lib.stride_tricks.as_strided(stream, shape=(stream.size - size + 1, size), strides=(1, 1),
                                           writeable=True)


def _classes(plan: PiecePlan, kind: PieceKind) -> list[tuple[npt.NDArray[np.int64], int]]:
    """Plan indices of ``kind``'s pieces grouped by piece size (full blocks, tail block)."""
    idx = np.flatnonzero(plan.kinds == kind)
    sizes = plan.sizes[idx]
    return [(idx[sizes == s], int(s)) for s in np.unique(sizes)]


def _check_piece_rows(plan: PiecePlan, kind: PieceKind, rows: npt.NDArray[np.uint8] | None) -> None:
    want = (plan.layout.n_blocks, plan.layout.piece_size(kind, plan.layout.block_tokens))
    if rows is None or rows.dtype != np.uint8 or rows.shape != want:
        got = None if rows is None else f"{rows.shape} {rows.dtype}"
        raise ValueError(f"{kind.name} piece bytes are {got}, the plan needs {want} uint8")


def pack_stream(plan: PiecePlan, pieces: PieceBytes) -> npt.NDArray[np.uint8]:
    """The plan's symbols [n_symbols, symbol_size]: pieces back to back in plan order, last symbol padded."""
    stream = np.zeros(plan.n_symbols * plan.symbol_size, dtype=np.uint8)
    for kind in map(PieceKind, np.unique(plan.kinds).tolist()):
        rows = pieces.get(kind)
        _check_piece_rows(plan, kind, rows)
        assert rows is not None
        for idx, size in _classes(plan, kind):
            _windows(stream, size)[plan.offsets[idx]] = rows[plan.blocks[idx], :size]
    return stream.reshape(plan.n_symbols, plan.symbol_size)


def unpack_stream(plan: PiecePlan, symbols: npt.NDArray[np.uint8]) -> dict[PieceKind, npt.NDArray[np.uint8]]:
    """Piece bytes by kind from the symbol store [n_symbols, symbol_size] (rows of absent pieces are zero).

    Which pieces are complete is the caller's (``PiecePlan.complete_pieces``): bytes of missing symbols
    are whatever the store holds.
    """
    if symbols.dtype != np.uint8 or symbols.shape != (plan.n_symbols, plan.symbol_size):
        raise ValueError(
            f"symbol store has shape {symbols.shape} {symbols.dtype}, the plan needs "
            f"({plan.n_symbols}, {plan.symbol_size}) uint8"
        )
    stream = np.ascontiguousarray(symbols).reshape(-1)
    out: dict[PieceKind, npt.NDArray[np.uint8]] = {}
    for kind in map(PieceKind, np.unique(plan.kinds).tolist()):
        rows = np.zeros((plan.layout.n_blocks, plan.layout.piece_size(kind, plan.layout.block_tokens)),
                        dtype=np.uint8)
        for idx, size in _classes(plan, kind):
            rows[plan.blocks[idx], :size] = _windows(stream, size)[plan.offsets[idx]]
        out[kind] = rows
    return out


# --- Fidelity per level and ordering by value per byte ---------------------------------------------------


@dataclass(frozen=True)
class FidelityTable:
    """Share of a block's value kept at each precision, per layer group (1 = as good as native).

    JSON (``format: "pfec-precision-fidelity/1"``)::

        {"format": "pfec-precision-fidelity/1", "scheme": "pfec-kivi-bitplane/1",
         "model": {"id": ..., "fingerprint": ..., "n_layers": 30},
         "levels": ["int2", "int4", "int8"],           # native is 1 by definition
         "layer_groups": [[0, 6], [6, 12], ...],        # half-open, tiling the layers
         "fidelity": [[f_int2, f_int4, f_int8], ...],   # one row per layer group, each in [0, 1]
         "source": {...}}                               # how it was measured (free-form)
    """

    n_layers: int
    layer_groups: tuple[tuple[int, int], ...]
    levels: tuple[Level, ...]
    fidelity: tuple[tuple[float, ...], ...]
    scheme: str = SCHEME
    model_id: str = ""
    fingerprint: str | None = None
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        covered = sorted(self.layer_groups)
        if (not covered or covered[0][0] != 0 or covered[-1][1] != self.n_layers
                or any(lo >= hi for lo, hi in covered)
                or any(a[1] != b[0] for a, b in itertools.pairwise(covered))):
            raise ValueError(
                f"fidelity layer_groups {list(self.layer_groups)} must tile layers 0..{self.n_layers}"
            )
        if sorted(set(self.levels)) != sorted(QUANTISED_LEVELS):
            raise ValueError(
                f"fidelity levels {[Level(x).label for x in self.levels]} must be int2, int4, int8 once each"
            )
        rows = self.fidelity
        if len(rows) != len(self.layer_groups) or any(len(r) != len(self.levels) for r in rows):
            raise ValueError("fidelity must be a layer-groups x levels matrix")
        values = np.asarray(self.fidelity, dtype=np.float64)
        if not np.all(np.isfinite(values)) or values.min() < 0.0 or values.max() > 1.0:
            raise ValueError("fidelity values must be finite and within [0, 1]")
        if self.scheme != SCHEME:
            raise ValueError(
                f"fidelity table is for scheme {self.scheme!r}, this node quantises with {SCHEME!r}"
            )

    def level_values(self) -> npt.NDArray[np.float64]:
        """[n_groups, 5]: fidelity at every Level (NONE = 0, NATIVE = 1)."""
        out = np.zeros((len(self.layer_groups), len(Level)), dtype=np.float64)
        out[:, Level.NATIVE] = 1.0
        for j, lvl in enumerate(self.levels):
            out[:, lvl] = [row[j] for row in self.fidelity]
        return out

    def block_fidelity(self, layout: PieceLayout) -> npt.NDArray[np.float64]:
        """[n_blocks, 5]: fidelity of every block at every Level (from its layer's group)."""
        if layout.geometry.n_layers != self.n_layers:
            raise ValueError(f"fidelity table is for {self.n_layers} layers, the layout has "
                             f"{layout.geometry.n_layers}")
        group_of_layer = np.empty(self.n_layers, dtype=np.int64)
        for g, (lo, hi) in enumerate(self.layer_groups):
            group_of_layer[lo:hi] = g
        layers = np.repeat(np.arange(self.n_layers), layout.n_token_blocks)
        return self.level_values()[group_of_layer[layers]]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FIDELITY_FORMAT, "scheme": self.scheme,
            "model": {"id": self.model_id, "fingerprint": self.fingerprint, "n_layers": self.n_layers},
            "levels": [Level(x).label for x in self.levels],
            "layer_groups": [list(g) for g in self.layer_groups],
            "fidelity": [list(r) for r in self.fidelity],
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: Any, origin: str = "<fidelity>") -> FidelityTable:
        if not isinstance(data, dict) or data.get("format") != FIDELITY_FORMAT:
            shown = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{origin}: format {shown!r} is not {FIDELITY_FORMAT!r}")
        try:
            model = data["model"]
            return cls(
                n_layers=int(model["n_layers"]),
                layer_groups=tuple((int(a), int(b)) for a, b in data["layer_groups"]),
                levels=tuple(parse_level(x) for x in data["levels"]),
                fidelity=tuple(tuple(float(x) for x in row) for row in data["fidelity"]),
                scheme=str(data.get("scheme")),
                model_id=str(model.get("id", "")),
                fingerprint=model.get("fingerprint"),
                source=dict(data.get("source") or {}),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{origin}: not a valid fidelity table ({exc!r})") from None
        except ValueError as exc:
            raise ValueError(f"{origin}: {exc}") from None


def _chain_priorities(values: npt.NDArray[np.float64],
                      sizes: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Per piece of each block's chain [n_blocks, K], the value per byte of the chain segment it falls in.

    A chain's pieces must go in order, so a cheap-but-useless base followed by a valuable refinement is
    judged together: segments are the chain's upper concave hull (Sidney's decomposition), each segment
    scoring its summed value over its summed bytes. Merging chains by segment score is optimal for
    value delivered per byte sent.
    """
    n, k = values.shape
    cum_v = np.concatenate([np.zeros((n, 1)), np.cumsum(values, axis=1)], axis=1)
    cum_b = np.concatenate([np.zeros((n, 1)), np.cumsum(sizes, axis=1)], axis=1)
    prio = np.zeros((n, k), dtype=np.float64)
    start = np.zeros(n, dtype=np.int64)
    rows = np.arange(n)
    pos = np.arange(1, k + 1)
    for _ in range(k):
        active = start < k
        if not active.any():
            break
        dv = cum_v[:, 1:] - cum_v[rows, start][:, None]
        db = cum_b[:, 1:] - cum_b[rows, start][:, None]
        ratio = np.where(pos[None, :] > start[:, None], dv / np.maximum(db, 1.0), -np.inf)
        best = ratio.max(axis=1)
        # Among equal ratios take the longest segment (fewest splits).
        end = k - np.argmax(np.isclose(ratio, best[:, None], rtol=1e-12, atol=0.0)[:, ::-1], axis=1)
        in_seg = (np.arange(k)[None, :] >= start[:, None]) & (np.arange(k)[None, :] < end[:, None])
        in_seg &= active[:, None]
        prio[in_seg] = np.broadcast_to(best[:, None], (n, k))[in_seg]
        start = np.where(active, end, start)
    return prio


def value_order(layout: PieceLayout, block_utility: npt.ArrayLike, fidelity: FidelityTable,
                kinds: Sequence[PieceKind], tops: npt.ArrayLike | None = None,
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(blocks, kinds) of every block's ``kinds`` ladder, ordered by marginal value per byte.

    A block at level L is worth ``utility[b] * fidelity[group(b), L]``; a piece's marginal value is what
    it adds to its block. Each block's pieces stay in ladder order; ties go to the higher-utility block.
    ``tops`` [n_blocks] (Level values) cuts each block's ladder at its own top: the pieces above it are
    left out (they weigh nothing in their chain, so the priorities of the pieces kept do not change).
    """
    kinds = tuple(PieceKind(k) for k in kinds)
    if not kinds or ladder(kinds[0].level, kinds[-1].level) != kinds:
        raise ValueError(f"pieces {[k.name for k in kinds]} are not a ladder (see precision.ladder)")
    util = np.asarray(block_utility, dtype=np.float64)
    if util.shape != (layout.n_blocks,) or not np.all(np.isfinite(util)) or (util < 0).any():
        raise ValueError(
            f"block utility must be {layout.n_blocks} finite non-negative values, got {util.shape}"
        )
    fid = fidelity.block_fidelity(layout)
    levels = np.array([0] + [k.level for k in kinds])
    gains = util[:, None] * np.diff(fid[:, levels], axis=1)
    sizes = layout.size_table()[:, [int(k) for k in kinds]].astype(np.float64)
    keep = np.ones(gains.shape, dtype=np.bool_)
    if tops is not None:
        top = np.asarray(tops, dtype=np.int64)
        if top.shape != (layout.n_blocks,) or (top < kinds[0].level).any() or (top > kinds[-1].level).any():
            raise ValueError(f"block tops must be {layout.n_blocks} levels between {kinds[0].level.label} "
                             f"and {kinds[-1].level.label}")
        keep = levels[None, 1:] <= top[:, None]
        gains, sizes = np.where(keep, gains, 0.0), np.where(keep, sizes, 0.0)
    prio = _chain_priorities(gains, sizes)
    n, k = prio.shape
    block = np.repeat(np.arange(n), k)
    step = np.tile(np.arange(k), n)
    order = np.lexsort((step, block, -np.repeat(util, k), -prio.reshape(-1)))
    order = order[keep.reshape(-1)[order]]
    return block[order].astype(np.int64), np.asarray([int(x) for x in kinds], dtype=np.int64)[step[order]]


def stream_efficiency(plan: PiecePlan) -> float:
    """Piece bytes per symbol byte (1 - the last symbol's padding share)."""
    return plan.total_bytes / (plan.n_symbols * plan.symbol_size)


def value_per_level(levels: npt.NDArray[np.int8], block_utility: npt.ArrayLike,
                    block_fidelity: npt.NDArray[np.float64]) -> float:
    """Recovered utility: sum over blocks of utility x fidelity at the level each block is usable at."""
    util = np.asarray(block_utility, dtype=np.float64)
    lv = np.asarray(levels, dtype=np.int64)
    return float(math.fsum((util * block_fidelity[np.arange(lv.size), lv]).tolist()))
