"""GF(2^8) arithmetic: the field tables and the compiled region kernels every codec kernel builds on.

Field: GF(2^8) with the primitive polynomial x^8+x^4+x^3+x^2+1 (0x11D) and
generator 2, as required by RFC 8681 for m = 8.

The codec's kernels live in four modules, lowest first:

* this one: tables built at import with numpy (``EXP``: 512 entries, doubled so that
  ``EXP[LOG[a] + LOG[b]]`` needs no modulo; ``LOG``: ``LOG[0]`` is a placeholder 0, 0 has no
  logarithm; ``MUL``: the full 256x256 product table; ``INV``: ``INV[0] = 0`` placeholder), the
  compiled region kernels (``dst ^= c * src`` and friends, bit-plane accumulators for sums of many
  scaled regions) and the :func:`entry_point` helper the other kernel modules use (with ``njit_cached`` /
  ``njit_inlined``, re-exported from :mod:`.jit`);
* :mod:`.coefficients`: RFC 8682 TinyMT32 and RFC 8681 coefficient generation;
* :mod:`.encoder_kernels`: one repair symbol (the encoder's "make one repair" step);
* :mod:`.decoder_kernels`: the decoder's state layout, its inserts (one compiled call per received
  symbol) and the ACK snapshot.

Each also holds plain numpy / pure Python references (``ref_*``) that the tests use as oracles (the
decoder's rank and solve are :mod:`.reference`'s); they are never on the hot path.

Region kernels work eight bytes at a time: a byte ``x`` times a constant ``c``
is ``XOR_b bit_b(x) * (c * 2^b)``, so for a 64-bit word holding eight bytes we
spread each bit plane to whole bytes (``t * 255`` computed as ``(t << 8) - t``,
carry free because every byte of ``t`` is 0 or 1) and mask it with ``c * 2^b``
broadcast to all eight lanes. LLVM vectorises that loop (AVX2 here), which is
about 2-3x faster than a byte-wise ``MUL[c][src]`` table gather.

Sums of three or more scaled regions (repair encoding, the substitution and
reduction of an incoming repair) use bit-plane accumulators instead: one XOR
pass per set coefficient bit, then a single Horner pass (see :func:`acc_finish`).

Compile cost: on a cold numba cache the kernels take ~20 s to compile; :func:`pfec.common.codec.fec.warm_up`
does it up front. They are cached on disk, by :mod:`.jit`, in ``__pycache__/numba-<module>-<key>/`` beside
each module (or under ``$NUMBA_CACHE_DIR`` when set), the key hashing the sources the kernels are compiled
from (the module and everything it imports from ``pfec``) and the numba/numpy/Python versions: an edit to a
table or a called kernel in another module, or an upgrade, never runs code compiled from the old sources.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numba
import numpy as np
import numpy.typing as npt

from pfec.common.codec.jit import njit_cached, njit_inlined

if TYPE_CHECKING:
    from numba.core.dispatcher import Dispatcher
    from numba.core.types import Type as NumbaType

__all__ = [
    "B1",
    "EXP",
    "I64",
    "INV",
    "LINCOMB_MIN_TERMS",
    "LOG",
    "MUL",
    "POLY",
    "U8",
    "acc_add",
    "acc_clear",
    "acc_finish",
    "entry_point",
    "njit_cached",
    "njit_inlined",
    "ref_region_muladd",
    "region_copy",
    "region_mul",
    "region_muladd",
    "region_scale",
    "region_xor",
    "region_zero",
]

# Array types of the kernels' arguments (shared by every kernel module).
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
B1 = npt.NDArray[np.bool_]

POLY = 0x11D

_entry_points: dict[tuple[int, tuple[NumbaType, ...]], Callable[..., Any]] = {}


def entry_point(kernel: Callable[..., Any], *example: object) -> Callable[..., Any]:
    """The compiled function of numba ``kernel`` for exactly the argument types of ``example``
    (compiled now, or loaded from numba's cache, once per process). Calling it skips numba's per-call
    type dispatch, which costs about a microsecond for a kernel with many array arguments: worth it on
    per-packet paths. The caller must pass arguments of those same types (a mismatch raises or mis-reads)."""
    typeof = cast(Callable[[object], "NumbaType"], numba.typeof)
    sig = tuple(typeof(a) for a in example)
    key = (id(kernel), sig)
    bound = _entry_points.get(key)
    if bound is None:
        dispatcher = cast("Dispatcher", kernel)  # what ``njit_cached`` returns at run time
        bound = _entry_points[key] = dispatcher.compile(sig)
    return bound


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _build_tables() -> tuple[U8, npt.NDArray[np.int32], U8, U8]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    exp[255:510] = exp[0:255]
    exp[510:512] = exp[0:2]
    mul = np.zeros((256, 256), dtype=np.uint8)
    mul[1:, 1:] = exp[log[1:, None] + log[None, 1:]]
    inv = np.zeros(256, dtype=np.uint8)
    inv[1:] = exp[255 - log[1:]]
    for t in (exp, log, mul, inv):
        t.setflags(write=False)
    return exp, log, mul, inv


EXP, LOG, MUL, INV = _build_tables()

# _SPREAD[c, b] = (c * 2^b) broadcast to the eight bytes of a uint64.
_SPREAD: npt.NDArray[np.uint64] = MUL[:, [1, 2, 4, 8, 16, 32, 64, 128]].astype(np.uint64) * np.uint64(
    0x0101010101010101
)
_SPREAD.setflags(write=False)

_LANES = np.uint64(0x0101010101010101)
_S1 = np.uint64(1)
_S2 = np.uint64(2)
_S3 = np.uint64(3)
_S4 = np.uint64(4)
_S5 = np.uint64(5)
_S6 = np.uint64(6)
_S7 = np.uint64(7)
_S8 = np.uint64(8)


# --------------------------------------------------------------------------------------------
# Region kernels
# --------------------------------------------------------------------------------------------


@njit_cached
def _word_mul(w: np.uint64, c: int) -> np.uint64:
    """Eight packed bytes of ``w`` each multiplied by ``c`` (bit-plane form)."""
    t = w & _LANES
    acc = ((t << _S8) - t) & _SPREAD[c, 0]
    t = (w >> _S1) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 1]
    t = (w >> _S2) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 2]
    t = (w >> _S3) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 3]
    t = (w >> _S4) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 4]
    t = (w >> _S5) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 5]
    t = (w >> _S6) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 6]
    t = (w >> _S7) & _LANES
    acc ^= ((t << _S8) - t) & _SPREAD[c, 7]
    return np.uint64(acc)


@njit_cached
def region_xor(dst: U8, src: U8) -> None:
    """``dst ^= src``. Plain byte loops vectorise best under numba/LLVM."""
    for i in range(dst.shape[0]):
        dst[i] ^= src[i]


@njit_cached
def region_copy(dst: U8, src: U8) -> None:
    """``dst[:] = src`` (numba's slice assignment is much slower than this loop)."""
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@njit_cached
def region_zero(dst: U8) -> None:
    """``dst[:] = 0``."""
    for i in range(dst.shape[0]):
        dst[i] = 0


@njit_cached
def region_muladd(dst: U8, src: U8, c: int) -> None:
    """``dst ^= c * src`` over GF(2^8); both uint8, same length, C-contiguous."""
    if c == 0:
        return
    if c == 1:
        region_xor(dst, src)
        return
    n = dst.shape[0]
    n8 = n >> 3
    d = dst[: n8 * 8].view(np.uint64)
    s = src[: n8 * 8].view(np.uint64)
    k0 = _SPREAD[c, 0]
    k1 = _SPREAD[c, 1]
    k2 = _SPREAD[c, 2]
    k3 = _SPREAD[c, 3]
    k4 = _SPREAD[c, 4]
    k5 = _SPREAD[c, 5]
    k6 = _SPREAD[c, 6]
    k7 = _SPREAD[c, 7]
    for i in range(n8):
        w = s[i]
        t0 = w & _LANES
        t1 = (w >> _S1) & _LANES
        t2 = (w >> _S2) & _LANES
        t3 = (w >> _S3) & _LANES
        t4 = (w >> _S4) & _LANES
        t5 = (w >> _S5) & _LANES
        t6 = (w >> _S6) & _LANES
        t7 = (w >> _S7) & _LANES
        d[i] ^= (
            (((t0 << _S8) - t0) & k0)
            ^ (((t1 << _S8) - t1) & k1)
            ^ (((t2 << _S8) - t2) & k2)
            ^ (((t3 << _S8) - t3) & k3)
            ^ (((t4 << _S8) - t4) & k4)
            ^ (((t5 << _S8) - t5) & k5)
            ^ (((t6 << _S8) - t6) & k6)
            ^ (((t7 << _S8) - t7) & k7)
        )
    row = MUL[c]
    for i in range(n8 * 8, n):
        dst[i] ^= row[src[i]]


@njit_cached
def region_mul(dst: U8, src: U8, c: int) -> None:
    """``dst = c * src`` (overwrites ``dst``)."""
    n = dst.shape[0]
    if c == 0:
        region_zero(dst)
        return
    if c == 1:
        region_copy(dst, src)
        return
    n8 = n >> 3
    d = dst[: n8 * 8].view(np.uint64)
    s = src[: n8 * 8].view(np.uint64)
    for i in range(n8):
        d[i] = _word_mul(s[i], c)
    row = MUL[c]
    for i in range(n8 * 8, n):
        dst[i] = row[src[i]]


@njit_cached
def region_scale(dst: U8, c: int) -> None:
    """``dst = c * dst`` in place."""
    if c == 1:
        return
    region_mul(dst, dst, c)


# Linear combinations of many regions: sum_k c_k * src_k = sum_b 2^b * (XOR of the src_k whose
# coefficient has bit b set). The eight XOR accumulators cost one vectorised XOR pass per set
# coefficient bit; one Horner pass (seven packed xtimes per word) finishes the sum. For three
# or more terms this beats one bit-sliced multiply-add per term.

_HI = np.uint64(0x8080808080808080)
_LO7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_RED = np.uint64(0x1D1D1D1D1D1D1D1D)  # x^8 = x^4+x^3+x^2+1 in every byte lane

#: Use the accumulator form from this many terms on.
LINCOMB_MIN_TERMS = 3


@njit_cached
def _xtime64(r: np.uint64) -> np.uint64:
    """Eight packed bytes each multiplied by 2 (x)."""
    hi = r & _HI
    return ((r & _LO7) << _S1) ^ ((hi - (hi >> _S7)) & _RED)


@njit_cached
def acc_clear(acc: U8) -> None:
    for b in range(8):
        region_zero(acc[b])


@njit_cached
def acc_add(acc: U8, src: U8, c: int) -> None:
    """Accumulate ``c * src`` into the bit-plane accumulators ``acc`` (8, S)."""
    for b in range(8):
        if (c >> b) & 1:
            region_xor(acc[b], src)


@njit_cached
def acc_finish(acc: U8, dst: U8) -> None:
    """``dst = sum_b 2^b * acc[b]`` (Horner from the top bit plane)."""
    n = dst.shape[0]
    n8 = n >> 3
    m = n8 * 8
    d = dst[:m].view(np.uint64)
    a0 = acc[0, :m].view(np.uint64)
    a1 = acc[1, :m].view(np.uint64)
    a2 = acc[2, :m].view(np.uint64)
    a3 = acc[3, :m].view(np.uint64)
    a4 = acc[4, :m].view(np.uint64)
    a5 = acc[5, :m].view(np.uint64)
    a6 = acc[6, :m].view(np.uint64)
    a7 = acc[7, :m].view(np.uint64)
    for i in range(n8):
        r = a7[i]
        r = _xtime64(r) ^ a6[i]
        r = _xtime64(r) ^ a5[i]
        r = _xtime64(r) ^ a4[i]
        r = _xtime64(r) ^ a3[i]
        r = _xtime64(r) ^ a2[i]
        r = _xtime64(r) ^ a1[i]
        r = _xtime64(r) ^ a0[i]
        d[i] = r
    m2 = MUL[2]
    for i in range(m, n):
        t = acc[7, i]
        for b in range(6, -1, -1):
            t = m2[t] ^ acc[b, i]
        dst[i] = t



def ref_region_muladd(dst: U8, src: U8, c: int) -> None:
    """numpy reference of :func:`region_muladd` (tests only)."""
    dst ^= MUL[c][src]
