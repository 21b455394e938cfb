"""GF(2^8) arithmetic, RFC 8682 TinyMT32 and the RFC 8681 RLC kernels.

Field: GF(2^8) with the primitive polynomial x^8+x^4+x^3+x^2+1 (0x11D) and
generator 2, as required by RFC 8681 for m = 8.

Layout of this module:

* Tables built at import with numpy: ``EXP`` (512 entries, doubled so that
  ``EXP[LOG[a] + LOG[b]]`` needs no modulo), ``LOG`` (``LOG[0]`` is a
  placeholder 0; 0 has no logarithm), ``MUL`` (full 256x256 product table) and
  ``INV`` (``INV[0] = 0`` placeholder).
* Compiled (numba, ``cache=True``) kernels: region operations,
  repair encoding, TinyMT32 and RFC 8681 coefficient generation, the encoder
  "make one repair" step and the whole decoder insert (one compiled call per
  received symbol).
* Plain numpy / pure Python reference implementations (``ref_*``,
  :class:`TinyMT32`) that the tests use as oracles. They are never on the hot
  path.

Region kernels work eight bytes at a time: a byte ``x`` times a constant ``c``
is ``XOR_b bit_b(x) * (c * 2^b)``, so for a 64-bit word holding eight bytes we
spread each bit plane to whole bytes (``t * 255`` computed as ``(t << 8) - t``,
carry free because every byte of ``t`` is 0 or 1) and mask it with ``c * 2^b``
broadcast to all eight lanes. LLVM vectorises that loop (AVX2 here), which is
about 2-3x faster than a byte-wise ``MUL[c][src]`` table gather.

Sums of three or more scaled regions (repair encoding, the substitution and
reduction of an incoming repair) use bit-plane accumulators instead: one XOR
pass per set coefficient bit, then a single Horner pass (see ``_acc_finish``).

Compile cost: on a cold numba cache the kernels take ~20 s to compile (cached on
disk under ``__pycache__`` afterwards); ``common.fec.warm_up()`` does it up front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

__all__ = [
    "EXP",
    "INV",
    "LOG",
    "MUL",
    "POLY",
    "TinyMT32",
    "decoder_ack_snapshot",
    "decoder_add_repair",
    "decoder_add_source",
    "encode_repair",
    "encoder_make_repair",
    "entry_point",
    "generate_coefficients",
    "ref_encode_repair",
    "ref_generate_coefficients",
    "ref_rank",
    "ref_region_muladd",
    "ref_solve",
    "region_muladd",
    "region_scale",
    "tinymt32_fill",
]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
B1 = npt.NDArray[np.bool_]

POLY = 0x11D

_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(fn: _F) -> _F:
    """``numba.njit(cache=True)`` that keeps the Python signature for mypy.

    Not ``nogil``: these kernels run once or more per datagram on the event loop's thread, and releasing
    and retaking the GIL costs about 0.3 us per call, as much as a source insert's own work."""
    return cast(_F, numba.njit(cache=True)(fn))


_entry_points: dict[tuple[int, tuple[Any, ...]], Callable[..., Any]] = {}


def entry_point(kernel: Any, *example: object) -> Callable[..., Any]:
    """The compiled function of numba ``kernel`` for exactly the argument types of ``example``
    (compiled now, or loaded from numba's cache, once per process). Calling it skips numba's per-call
    type dispatch, which costs about a microsecond for a kernel with many array arguments: worth it on
    per-packet paths. The caller must pass arguments of those same types (a mismatch raises or mis-reads)."""
    typeof = cast(Callable[[object], Any], numba.typeof)
    sig = tuple(typeof(a) for a in example)
    key = (id(kernel), sig)
    bound = _entry_points.get(key)
    if bound is None:
        bound = _entry_points[key] = cast(Callable[..., Any], kernel.compile(sig))
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


@_jit
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


@_jit
def _xor_into(dst: U8, src: U8) -> None:
    """``dst ^= src``. Plain byte loops vectorise best under numba/LLVM."""
    for i in range(dst.shape[0]):
        dst[i] ^= src[i]


@_jit
def _copy(dst: U8, src: U8) -> None:
    """``dst[:] = src`` (numba's slice assignment is much slower than this loop)."""
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@_jit
def _zero(dst: U8) -> None:
    for i in range(dst.shape[0]):
        dst[i] = 0


@_jit
def region_muladd(dst: U8, src: U8, c: int) -> None:
    """``dst ^= c * src`` over GF(2^8); both uint8, same length, C-contiguous."""
    if c == 0:
        return
    if c == 1:
        _xor_into(dst, src)
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


@_jit
def _region_mul_into(dst: U8, src: U8, c: int) -> None:
    """``dst = c * src`` (overwrites ``dst``)."""
    n = dst.shape[0]
    if c == 0:
        _zero(dst)
        return
    if c == 1:
        _copy(dst, src)
        return
    n8 = n >> 3
    d = dst[: n8 * 8].view(np.uint64)
    s = src[: n8 * 8].view(np.uint64)
    for i in range(n8):
        d[i] = _word_mul(s[i], c)
    row = MUL[c]
    for i in range(n8 * 8, n):
        dst[i] = row[src[i]]


@_jit
def region_scale(dst: U8, c: int) -> None:
    """``dst = c * dst`` in place."""
    if c == 1:
        return
    _region_mul_into(dst, dst, c)


# Linear combinations of many regions: sum_k c_k * src_k = sum_b 2^b * (XOR of the src_k whose
# coefficient has bit b set). The eight XOR accumulators cost one vectorised XOR pass per set
# coefficient bit; one Horner pass (seven packed xtimes per word) finishes the sum. For three
# or more terms this beats one bit-sliced multiply-add per term.

_HI = np.uint64(0x8080808080808080)
_LO7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_RED = np.uint64(0x1D1D1D1D1D1D1D1D)  # x^8 = x^4+x^3+x^2+1 in every byte lane

#: Use the accumulator form from this many terms on.
LINCOMB_MIN_TERMS = 3


@_jit
def _xtime64(r: np.uint64) -> np.uint64:
    """Eight packed bytes each multiplied by 2 (x)."""
    hi = r & _HI
    return ((r & _LO7) << _S1) ^ ((hi - (hi >> _S7)) & _RED)


@_jit
def _acc_clear(acc: U8) -> None:
    for b in range(8):
        _zero(acc[b])


@_jit
def _acc_add(acc: U8, src: U8, c: int) -> None:
    """Accumulate ``c * src`` into the bit-plane accumulators ``acc`` (8, S)."""
    for b in range(8):
        if (c >> b) & 1:
            _xor_into(acc[b], src)


@_jit
def _acc_finish(acc: U8, dst: U8) -> None:
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


@_jit
def _encode(symbols: U8, fss_esi: int, coefs: U8, out: U8, acc: U8) -> None:
    nnz = 0
    for i in range(coefs.shape[0]):
        if coefs[i] != 0:
            nnz += 1
    if nnz >= LINCOMB_MIN_TERMS:
        _acc_clear(acc)
        for i in range(coefs.shape[0]):
            c = coefs[i]
            if c != 0:
                _acc_add(acc, symbols[fss_esi + i], int(c))
        _acc_finish(acc, out)
        return
    first = True
    for i in range(coefs.shape[0]):
        c = coefs[i]
        if c == 0:
            continue
        if first:
            _region_mul_into(out, symbols[fss_esi + i], int(c))
            first = False
        else:
            region_muladd(out, symbols[fss_esi + i], int(c))
    if first:
        _zero(out)


@_jit
def encode_repair(symbols: U8, fss_esi: int, coefs: U8, out: U8) -> None:
    """``out = sum_i coefs[i] * symbols[fss_esi + i]`` (zero coefficients skipped).

    ``symbols`` is the (N, S) uint8 source array indexed by ESI; ``out`` is uint8[S].
    """
    acc = np.empty((8, out.shape[0]), dtype=np.uint8)
    _encode(symbols, fss_esi, coefs, out, acc)


# --------------------------------------------------------------------------------------------
# RFC 8682 TinyMT32 (compiled). All state is kept in int64 and masked to 32 bits after every
# operation that can leave the 32-bit range, so numba's integer promotion cannot change results.
# --------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
_MAT1 = 0x8F7011EE
_MAT2 = 0xFC78FF1F
_TMAT = 0x3793FDFF
_TMT_MASK = 0x7FFFFFFF
_TMT_MULT = 1812433253


@_jit
def _tmt_next(s0: int, s1: int, s2: int, s3: int) -> tuple[int, int, int, int]:
    y = s3
    x = (s0 & _TMT_MASK) ^ s1 ^ s2
    x ^= (x << 1) & _M32
    y ^= (y >> 1) ^ x
    n1 = s2
    n2 = x ^ ((y << 10) & _M32)
    if y & 1:
        n1 ^= _MAT1
        n2 ^= _MAT2
    return s1, n1, n2, y


@_jit
def _tmt_temper(s0: int, s2: int, s3: int) -> int:
    t1 = (s0 + (s2 >> 8)) & _M32
    t0 = s3 ^ t1
    if t1 & 1:
        t0 ^= _TMAT
    return t0


@_jit
def _tmt_lcg(i: int, prev: int) -> int:
    return (i + _TMT_MULT * (prev ^ (prev >> 30))) & _M32


@_jit
def _tmt_init(seed: int) -> tuple[int, int, int, int]:
    s0 = seed & _M32
    s1 = _MAT1
    s2 = _MAT2
    s3 = _TMAT
    # status[i & 3] ^= i + 1812433253 * (status[(i-1) & 3] ^ (status[(i-1) & 3] >> 30)), i = 1..7
    s1 ^= _tmt_lcg(1, s0)
    s2 ^= _tmt_lcg(2, s1)
    s3 ^= _tmt_lcg(3, s2)
    s0 ^= _tmt_lcg(4, s3)
    s1 ^= _tmt_lcg(5, s0)
    s2 ^= _tmt_lcg(6, s1)
    s3 ^= _tmt_lcg(7, s2)
    if (s0 & _TMT_MASK) == 0 and s1 == 0 and s2 == 0 and s3 == 0:  # period certification
        s0 = 84  # 'T'
        s1 = 73  # 'I'
        s2 = 78  # 'N'
        s3 = 89  # 'Y'
    for _ in range(8):
        s0, s1, s2, s3 = _tmt_next(s0, s1, s2, s3)
    return s0, s1, s2, s3


@_jit
def tinymt32_fill(seed: int, out: I64) -> None:
    """Fill ``out`` with successive ``tinymt32_generate_uint32`` outputs for ``seed``."""
    s0, s1, s2, s3 = _tmt_init(seed)
    for i in range(out.shape[0]):
        s0, s1, s2, s3 = _tmt_next(s0, s1, s2, s3)
        out[i] = _tmt_temper(s0, s2, s3)


@_jit
def generate_coefficients(repair_key: int, dt: int, nss: int, out: U8) -> int:
    """RFC 8681 ``generate_coding_coefficients`` for m = 8 into ``out[:nss]``.

    Returns the number of nonzero coefficients. ``dt`` must be in 0..15 (checked by callers).
    """
    s0, s1, s2, s3 = _tmt_init(repair_key)
    nnz = 0
    if dt == 15:
        for i in range(nss):
            c = 0
            while c == 0:
                s0, s1, s2, s3 = _tmt_next(s0, s1, s2, s3)
                c = _tmt_temper(s0, s2, s3) & 0xFF
            out[i] = c
        return nss
    for i in range(nss):
        s0, s1, s2, s3 = _tmt_next(s0, s1, s2, s3)
        if (_tmt_temper(s0, s2, s3) & 0xF) <= dt:
            c = 0
            while c == 0:
                s0, s1, s2, s3 = _tmt_next(s0, s1, s2, s3)
                c = _tmt_temper(s0, s2, s3) & 0xFF
            out[i] = c
            nnz += 1
        else:
            out[i] = 0
    return nnz


@_jit
def encoder_make_repair(
    symbols: U8,
    first: int,
    count: int,
    dt: int,
    key: int,
    cc: U8,
    out: U8,
    acc: U8,
    cover_first: bool,
    cover_last: bool,
) -> tuple[int, int]:
    """Generate one repair over ``symbols[first:first+count]`` into ``out``.

    Starts at repair key ``key`` and moves to the next key (16-bit wrap) while the
    coefficient row is all zero, or, with ``cover_first`` / ``cover_last``, while the first / last
    window symbol's coefficient is zero. Returns ``(key_used, keys_skipped)``; ``key_used`` is -1 if no
    key in the whole 16-bit space qualifies. ``acc`` is (8, S) scratch.
    """
    skipped = 0
    for _ in range(65536):
        nnz = generate_coefficients(key, dt, count, cc)
        if nnz > 0 and (not cover_first or cc[0] != 0) and (not cover_last or cc[count - 1] != 0):
            _encode(symbols, first, cc[:count], out, acc)
            return key, skipped
        skipped += 1
        key = (key + 1) & 0xFFFF
    return -1, skipped


# --------------------------------------------------------------------------------------------
# Decoder: on-the-fly Gaussian elimination kept in reduced row echelon form.
#
# Unknown columns always lie in [prefix, prefix + cap) so column index = esi % cap. Pivot rows
# are stored by pivot column: coef[p] (cap bytes) and pay[p] (S bytes); coef[p, p] == 1 marks
# slot p as holding a pivot row, and every free slot is kept all zero. Rows only reference
# unknown columns (known symbols are substituted out on arrival).
#
# ist (int64) layout: [0] prefix, [1] seen_end, [2] rank, [3] unknowns, [4] redundant,
# [5] decoded_count, [6] n_new, [7] spare, [8 : 8+cap+1] ESIs decoded by the last call,
# then 4*cap scratch slots, then the pivot rows in no order (rank of them) and each pivot row's
# index in that list (cap each): inserts walk the rank pivot rows, not all cap slots.
# bscr (uint8, 2*cap): coefficient scratch; acc (uint8, (8, S)):
# bit-plane accumulators for the payload linear combination.
# --------------------------------------------------------------------------------------------

ST_PREFIX = 0
ST_SEEN = 1
ST_RANK = 2
ST_UNKNOWNS = 3
ST_REDUNDANT = 4
ST_DECODED = 5
ST_NNEW = 6
ST_HEADER = 8


def decoder_state_len(cap: int) -> int:
    """Length of the decoder's int64 state array for window ``cap``: header, newly decoded ESIs
    (cap + 1), four scratch lists (cap each), then the pivot row list and each row's place in it."""
    return ST_HEADER + (cap + 1) + 6 * cap


#: Negative returns of the decoder inserts: the input was out of range (the caller names the field).
INSERT_BAD_ESI = -1
INSERT_BAD_SIZE = -2
INSERT_BAD_PARAMS = -3
INSERT_WINDOW_OVERFLOW = -4


@_jit
def _rows_base(cap: int) -> int:
    return ST_HEADER + cap + 1 + 4 * cap


@_jit
def _row_on(ist: I64, cap: int, p: int) -> None:
    """Row ``p`` became a pivot row: append it to the pivot list (its length is the rank)."""
    base = _rows_base(cap)
    n = ist[ST_RANK]
    ist[base + n] = p
    ist[base + cap + p] = n
    ist[ST_RANK] = n + 1


@_jit
def _row_off(ist: I64, cap: int, p: int) -> None:
    """Row ``p`` is a pivot row no more: swap the list's last row into its place."""
    base = _rows_base(cap)
    n = ist[ST_RANK] - 1
    i = ist[base + cap + p]
    last = ist[base + n]
    ist[base + i] = last
    ist[base + cap + last] = i
    ist[ST_RANK] = n


@_jit
def _col_esi(col: int, prefix: int, cap: int) -> int:
    off = col - prefix % cap
    if off < 0:
        off += cap
    return prefix + off


@_jit
def _first_nonzero(row: U8, prefix: int, cap: int) -> int:
    """First nonzero column of ``row`` in ESI order from ``prefix``; -1 if none."""
    base = prefix % cap
    for j in range(base, cap):
        if row[j] != 0:
            return j
    for j in range(0, base):
        if row[j] != 0:
            return j
    return -1


@_jit
def _is_singleton(row: U8) -> bool:
    n = 0
    for j in range(row.shape[0]):
        if row[j] != 0:
            n += 1
            if n > 1:
                return False
    return n == 1


@_jit
def _rowop(dst: U8, src: U8, f: int) -> None:
    """Coefficient row op ``dst ^= f * src`` (short rows, table form)."""
    m = MUL[f]
    for j in range(dst.shape[0]):
        s = src[j]
        if s != 0:
            dst[j] ^= m[s]


@_jit
def _emit(row: int, store: U8, have: B1, coef: U8, pay: U8, ist: I64) -> None:
    """Pivot row ``row`` is a singleton: deliver it and free the slot."""
    cap = coef.shape[0]
    esi = _col_esi(row, ist[ST_PREFIX], cap)
    _copy(store[esi], pay[row])
    have[esi] = True
    coef[row, row] = 0
    _row_off(ist, cap, row)
    ist[ST_UNKNOWNS] -= 1
    ist[ST_DECODED] += 1
    n = ist[ST_NNEW]
    ist[ST_HEADER + n] = esi
    ist[ST_NNEW] = n + 1


@_jit
def _install(p: int, store: U8, have: B1, coef: U8, pay: U8, ist: I64, mod: I64) -> None:
    """Slot ``p`` holds a reduced row whose first nonzero column is ``p``: make it a pivot.

    Normalises it (if ``coef[p, p] != 1``), back-substitutes it into every other pivot
    row, then delivers any row that became a singleton.
    """
    cap = coef.shape[0]
    lead = coef[p, p]
    rowp = coef[p]
    if lead != 1:
        inv = INV[lead]
        m = MUL[inv]
        for j in range(cap):
            rowp[j] = m[rowp[j]]
        region_scale(pay[p], int(inv))
    nmod = 0
    rows = _rows_base(cap)
    for k in range(ist[ST_RANK]):  # only pivot rows can hold column p (p is not one of them yet)
        q = ist[rows + k]
        f = coef[q, p]
        if f != 0:
            _rowop(coef[q], rowp, int(f))
            region_muladd(pay[q], pay[p], int(f))
            mod[nmod] = q
            nmod += 1
    _row_on(ist, cap, p)
    if _is_singleton(rowp):
        _emit(p, store, have, coef, pay, ist)
    for k in range(nmod):
        q = mod[k]
        if coef[q, q] != 0 and _is_singleton(coef[q]):
            _emit(q, store, have, coef, pay, ist)


@_jit
def _advance_prefix(have: B1, ist: I64) -> None:
    p = ist[ST_PREFIX]
    n = have.shape[0]
    while p < n and have[p]:
        p += 1
    ist[ST_PREFIX] = p


@_jit
def decoder_add_source(esi: int, payload: U8, store: U8, have: B1, coef: U8, pay: U8, ist: I64) -> int:
    """Insert source symbol ``esi``. Returns the newly decoded count, or a negative ``INSERT_*`` code
    (nothing changed) when ``esi`` or the payload's length is out of range."""
    cap = coef.shape[0]
    ist[ST_NNEW] = 0
    if esi < 0 or esi >= have.shape[0]:
        return INSERT_BAD_ESI
    if payload.shape[0] != store.shape[1]:
        return INSERT_BAD_SIZE
    if have[esi]:
        return 0
    seen = ist[ST_SEEN]
    if esi >= seen:
        ist[ST_UNKNOWNS] += esi + 1 - seen
        ist[ST_SEEN] = esi + 1
    _copy(store[esi], payload)
    have[esi] = True
    ist[ST_UNKNOWNS] -= 1
    ist[ST_DECODED] += 1
    ist[ST_HEADER] = esi
    ist[ST_NNEW] = 1
    prefix = ist[ST_PREFIX]
    # Rows only exist while equations are pending (rank > 0); most sources skip the column scan.
    if ist[ST_RANK] > 0 and esi < prefix + cap:
        col = esi % cap
        scr = ST_HEADER + cap + 1
        mod = ist[scr : scr + cap]
        mod2 = ist[scr + cap : scr + 2 * cap]
        src = store[esi]
        nmod = 0
        rows = _rows_base(cap)
        for k in range(ist[ST_RANK]):  # only pivot rows hold equations
            q = ist[rows + k]
            if q != col:
                f = coef[q, col]
                if f != 0:
                    coef[q, col] = 0
                    region_muladd(pay[q], src, int(f))
                    mod[nmod] = q
                    nmod += 1
        if coef[col, col] != 0:
            # The row pivoting on this symbol becomes an equation over its free columns.
            # RREF: it is already reduced against every other pivot, so re-insert it as is.
            _xor_into(pay[col], src)
            coef[col, col] = 0
            _row_off(ist, cap, col)
            lead = _first_nonzero(coef[col], prefix, cap)
            if lead >= 0:
                _copy(coef[lead], coef[col])
                _copy(pay[lead], pay[col])
                _zero(coef[col])
                _install(lead, store, have, coef, pay, ist, mod2)
        for k in range(nmod):
            q = mod[k]
            if coef[q, q] != 0 and _is_singleton(coef[q]):
                _emit(q, store, have, coef, pay, ist)
    _advance_prefix(have, ist)
    return int(ist[ST_NNEW])


@_jit
def decoder_add_repair(
    repair_key: int,
    dt: int,
    nss: int,
    fss_esi: int,
    payload: U8,
    store: U8,
    have: B1,
    coef: U8,
    pay: U8,
    ist: I64,
    bscr: U8,
    acc: U8,
) -> int:
    """Insert one repair symbol. Returns the newly decoded count, or a negative ``INSERT_*`` code
    (nothing changed) when a field or the payload's length is out of range or the window reaches
    past ``decoded prefix + cap``.

    The coefficient row is reduced first; payload work is only done when the row is
    innovative, so redundant repairs cost almost nothing. ``acc`` is (8, S) scratch.
    """
    cap = coef.shape[0]
    ist[ST_NNEW] = 0
    if not (0 <= repair_key <= 0xFFFF and 0 <= dt <= 15 and 1 <= nss <= cap):
        return INSERT_BAD_PARAMS
    if fss_esi < 0 or fss_esi + nss > have.shape[0]:
        return INSERT_BAD_ESI
    if payload.shape[0] != store.shape[1]:
        return INSERT_BAD_SIZE
    if fss_esi + nss > ist[ST_PREFIX] + cap:
        return INSERT_WINDOW_OVERFLOW
    cc = bscr[:cap]
    r = bscr[cap : 2 * cap]
    generate_coefficients(repair_key, dt, nss, cc)
    end = fss_esi + nss
    seen = ist[ST_SEEN]
    if end > seen:
        ist[ST_UNKNOWNS] += end - seen
        ist[ST_SEEN] = end
    _zero(r)
    any_unknown = False
    for i in range(nss):
        c = cc[i]
        if c != 0 and not have[fss_esi + i]:
            r[(fss_esi + i) % cap] = c
            any_unknown = True
    if not any_unknown:
        ist[ST_REDUNDANT] += 1
        return 0
    scr = ST_HEADER + cap + 1
    fcol = ist[scr : scr + cap]
    ffac = ist[scr + cap : scr + 2 * cap]
    mod = ist[scr + 2 * cap : scr + 3 * cap]
    nf = 0
    for j in range(cap):
        f = r[j]
        if f != 0 and coef[j, j] != 0:
            _rowop(r, coef[j], int(f))
            fcol[nf] = j
            ffac[nf] = f
            nf += 1
    prefix = ist[ST_PREFIX]
    lead = _first_nonzero(r, prefix, cap)
    if lead < 0:
        ist[ST_REDUNDANT] += 1
        return 0
    # Innovative: payload = payload - known symbols - reductions, normalised by 1/lead.
    _copy(coef[lead], r)
    dst = pay[lead]
    nterms = 1 + nf
    for i in range(nss):
        if cc[i] != 0 and have[fss_esi + i]:
            nterms += 1
    if nterms >= LINCOMB_MIN_TERMS:
        mi = MUL[INV[r[lead]]]
        _acc_clear(acc)
        _acc_add(acc, payload, int(INV[r[lead]]))
        for i in range(nss):
            c = cc[i]
            if c != 0 and have[fss_esi + i]:
                _acc_add(acc, store[fss_esi + i], int(mi[c]))
        for k in range(nf):
            _acc_add(acc, pay[fcol[k]], int(mi[ffac[k]]))
        _acc_finish(acc, dst)
        rowp = coef[lead]
        for j in range(cap):
            rowp[j] = mi[rowp[j]]
    else:
        _copy(dst, payload)
        for i in range(nss):
            c = cc[i]
            if c != 0 and have[fss_esi + i]:
                region_muladd(dst, store[fss_esi + i], int(c))
        for k in range(nf):
            region_muladd(dst, pay[fcol[k]], int(ffac[k]))
    _install(lead, store, have, coef, pay, ist, mod)
    _advance_prefix(have, ist)
    return int(ist[ST_NNEW])


# --------------------------------------------------------------------------------------------
# References (tests / cross-checks only)
# --------------------------------------------------------------------------------------------


class TinyMT32:
    """Pure Python RFC 8682 TinyMT32 (mat1=0x8f7011ee, mat2=0xfc78ff1f, tmat=0x3793fdff)."""

    __slots__ = ("status",)

    def __init__(self, seed: int) -> None:
        st = [seed & _M32, _MAT1, _MAT2, _TMAT]
        for i in range(1, 8):
            prev = st[(i - 1) & 3]
            st[i & 3] ^= (i + _TMT_MULT * (prev ^ (prev >> 30))) & _M32
        if (st[0] & _TMT_MASK) == 0 and st[1] == 0 and st[2] == 0 and st[3] == 0:
            st = [ord("T"), ord("I"), ord("N"), ord("Y")]
        self.status = st
        for _ in range(8):
            self._next_state()

    def _next_state(self) -> None:
        st = self.status
        y = st[3]
        x = (st[0] & _TMT_MASK) ^ st[1] ^ st[2]
        x = (x ^ (x << 1)) & _M32
        y = y ^ (y >> 1) ^ x
        st[0] = st[1]
        st[1] = st[2]
        st[2] = (x ^ (y << 10)) & _M32
        st[3] = y
        if y & 1:
            st[1] ^= _MAT1
            st[2] ^= _MAT2

    def generate_uint32(self) -> int:
        self._next_state()
        st = self.status
        t0 = st[3]
        t1 = (st[0] + (st[2] >> 8)) & _M32
        t0 ^= t1
        if t1 & 1:
            t0 ^= _TMAT
        return t0

    def rand256(self) -> int:
        return self.generate_uint32() & 0xFF

    def rand16(self) -> int:
        return self.generate_uint32() & 0xF


def ref_generate_coefficients(repair_key: int, dt: int, nss: int) -> U8:
    """RFC 8681 coefficient generation (m = 8) on the pure Python PRNG."""
    prng = TinyMT32(repair_key)
    out = np.zeros(nss, dtype=np.uint8)
    for i in range(nss):
        if dt == 15 or prng.rand16() <= dt:
            c = 0
            while c == 0:
                c = prng.rand256()
            out[i] = c
    return out


def ref_region_muladd(dst: U8, src: U8, c: int) -> None:
    """numpy reference of :func:`region_muladd`."""
    dst ^= MUL[c][src]


def ref_encode_repair(symbols: U8, fss_esi: int, coefs: U8) -> U8:
    """numpy reference of :func:`encode_repair`; returns a new uint8[S]."""
    out = np.zeros(symbols.shape[1], dtype=np.uint8)
    for i, c in enumerate(coefs.tolist()):
        if c:
            out ^= MUL[c][symbols[fss_esi + i]]
    return out


def _ref_eliminate(a: U8, b: U8 | None) -> tuple[U8, U8 | None, list[int]]:
    """Gauss-Jordan elimination over GF(2^8); returns (rref(a), transformed b, pivot columns)."""
    a = a.astype(np.uint8, copy=True)
    b = None if b is None else b.astype(np.uint8, copy=True)
    m, n = a.shape
    pivots: list[int] = []
    r = 0
    for col in range(n):
        if r == m:
            break
        nz = np.flatnonzero(a[r:, col])
        if nz.size == 0:
            continue
        k = r + int(nz[0])
        if k != r:
            a[[r, k]] = a[[k, r]]
            if b is not None:
                b[[r, k]] = b[[k, r]]
        inv = int(INV[a[r, col]])
        a[r] = MUL[inv][a[r]]
        if b is not None:
            b[r] = MUL[inv][b[r]]
        for i in range(m):
            f = int(a[i, col])
            if i != r and f:
                a[i] ^= MUL[f][a[r]]
                if b is not None:
                    b[i] ^= MUL[f][b[r]]
        pivots.append(col)
        r += 1
    return a, b, pivots


def ref_rank(a: U8) -> int:
    """Rank over GF(2^8) of a uint8 matrix."""
    return len(_ref_eliminate(np.asarray(a, dtype=np.uint8), None)[2])


def ref_solve(a: U8, b: U8) -> U8 | None:
    """Solve ``a @ x = b`` over GF(2^8) (a: (m, n), b: (m, S)); None unless rank(a) == n."""
    a = np.asarray(a, dtype=np.uint8)
    b = np.asarray(b, dtype=np.uint8)
    n = a.shape[1]
    _, bb, pivots = _ref_eliminate(a, b)
    if len(pivots) != n or bb is None:
        return None
    return bb[:n].copy()


@_jit
def pack_holes(have: B1, lo: int, hi: int, out: U8) -> tuple[int, int]:
    """Bitmap (MSB first) of the undecoded ESIs in [lo, hi) into ``out``; returns (unknowns, bits).

    ``bits`` ends just after the last undecoded ESI (0 when none), so the map carries no tail of
    zeros. Used for every ACK, hence compiled.
    """
    unknowns = 0
    last = -1
    for i in range(hi - lo):
        if i % 8 == 0:
            out[i // 8] = 0
        if not have[lo + i]:
            out[i // 8] |= np.uint8(0x80 >> (i % 8))
            unknowns += 1
            last = i
    return unknowns, last + 1


@_jit
def decoder_ack_snapshot(have: B1, ist: I64, span: int, out: U8) -> tuple[int, int, int, int, int, int]:
    """What an ACK reports about the decoder, in one call: (decoded prefix, seen end, decoded count,
    unknowns, deficit, hole bits), the hole map over [prefix, min(prefix + span, seen end)) packed into
    ``out`` as :func:`pack_holes` does. Every equation the decoder holds lies in that range, so its
    rank counts against these unknowns only."""
    lo = ist[ST_PREFIX]
    seen = ist[ST_SEEN]
    hi = min(lo + span, seen)
    unknowns, bits = pack_holes(have, lo, hi, out) if hi > lo else (0, 0)
    deficit = max(0, unknowns - ist[ST_RANK]) if unknowns > 0 else 0
    return lo, seen, ist[ST_DECODED], unknowns, deficit, bits
