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

The parts: levels, piece kinds and sizes in :mod:`.pieces`; plans and packing in :mod:`.piece_plan`; the
fidelity per level and the ordering by value per byte here. Every name of the three is importable from here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pfec.common.plan.piece_plan import (
    PieceBytes,
    PiecePlan,
    full_plan,
    pack_stream,
    unpack_stream,
    usable_levels,
)
from pfec.common.plan.pieces import (
    BASE_OF_LEVEL,
    CODE_BITS,
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_VALUE_GROUP,
    LEVEL_NAMES,
    META_BYTES,
    N_KINDS,
    QUANTISED_LEVELS,
    REFINE_TO,
    SCHEME,
    Level,
    PieceKind,
    PieceLayout,
    default_value_group,
    ladder,
    parse_level,
)

__all__ = [
    "BASE_OF_LEVEL",
    "CODE_BITS",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_VALUE_GROUP",
    "FIDELITY_FORMAT",
    "LEVEL_NAMES",
    "META_BYTES",
    "N_KINDS",
    "QUANTISED_LEVELS",
    "REFINE_TO",
    "SCHEME",
    "FidelityTable",
    "Level",
    "PieceBytes",
    "PieceKind",
    "PieceLayout",
    "PiecePlan",
    "default_value_group",
    "full_plan",
    "ladder",
    "pack_stream",
    "parse_level",
    "stream_efficiency",
    "unpack_stream",
    "usable_levels",
    "value_order",
    "value_per_level",
]

FIDELITY_FORMAT: Final = "pfec-precision-fidelity/1"


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
