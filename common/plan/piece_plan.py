"""Piece plans (sans-IO, numpy only): (block, kind) pieces in send order, packed back to back into one
stream cut into equal symbols, and the way back from decoded symbols to complete pieces and each block's
usable level. The pieces themselves are :mod:`.pieces`'s; the design is :mod:`.precision`'s docstring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pfec.common.plan.pieces import (
    BASE_OF_LEVEL,
    N_KINDS,
    QUANTISED_LEVELS,
    Level,
    PieceKind,
    PieceLayout,
)

__all__ = [
    "PieceBytes",
    "PiecePlan",
    "full_plan",
    "pack_stream",
    "unpack_stream",
    "usable_levels",
]


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


def unpack_stream(plan: PiecePlan, symbols: npt.NDArray[np.uint8],
                  blocks: npt.NDArray[np.bool_] | None = None) -> dict[PieceKind, npt.NDArray[np.uint8]]:
    """Piece bytes by kind from the symbol store [n_symbols, symbol_size] (rows of absent pieces are zero);
    ``blocks`` [n_blocks]: only those blocks' pieces (a cache built as its blocks arrive).

    Which pieces are complete is the caller's (``PiecePlan.complete_pieces``): bytes of missing symbols
    are whatever the store holds.
    """
    if symbols.dtype != np.uint8 or symbols.shape != (plan.n_symbols, plan.symbol_size):
        raise ValueError(
            f"symbol store has shape {symbols.shape} {symbols.dtype}, the plan needs "
            f"({plan.n_symbols}, {plan.symbol_size}) uint8"
        )
    if blocks is not None and np.asarray(blocks).shape != (plan.layout.n_blocks,):
        raise ValueError(f"blocks must be [{plan.layout.n_blocks}] bool, got {np.asarray(blocks).shape}")
    stream = np.ascontiguousarray(symbols).reshape(-1)
    out: dict[PieceKind, npt.NDArray[np.uint8]] = {}
    for kind in map(PieceKind, np.unique(plan.kinds).tolist()):
        rows = np.zeros((plan.layout.n_blocks, plan.layout.piece_size(kind, plan.layout.block_tokens)),
                        dtype=np.uint8)
        for idx, size in _classes(plan, kind):
            if blocks is not None:
                idx = idx[np.asarray(blocks, dtype=np.bool_)[plan.blocks[idx]]]
            rows[plan.blocks[idx], :size] = _windows(stream, size)[plan.offsets[idx]]
        out[kind] = rows
    return out
