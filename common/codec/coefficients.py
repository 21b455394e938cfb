"""RLC coding coefficients: the RFC 8682 TinyMT32 PRNG and RFC 8681 coefficient generation (m = 8).

Both sides derive a repair's coefficient row from its 16-bit repair key alone, so these kernels must
match the RFCs bit for bit: :func:`generate_coefficients` runs for every repair on each side (compiled);
:class:`TinyMT32` and :func:`ref_generate_coefficients` are the pure Python references the tests
compare them against.
"""

from __future__ import annotations

import numpy as np

from pfec.common.codec.gf256 import I64, U8, njit_cached

__all__ = [
    "TinyMT32",
    "generate_coefficients",
    "ref_generate_coefficients",
    "tinymt32_fill",
]

# All state is kept in int64 and masked to 32 bits after every operation that can leave the 32-bit
# range, so numba's integer promotion cannot change results.

_M32 = 0xFFFFFFFF
_MAT1 = 0x8F7011EE
_MAT2 = 0xFC78FF1F
_TMAT = 0x3793FDFF
_TMT_MASK = 0x7FFFFFFF
_TMT_MULT = 1812433253


@njit_cached
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


@njit_cached
def _tmt_temper(s0: int, s2: int, s3: int) -> int:
    t1 = (s0 + (s2 >> 8)) & _M32
    t0 = s3 ^ t1
    if t1 & 1:
        t0 ^= _TMAT
    return t0


@njit_cached
def _tmt_lcg(i: int, prev: int) -> int:
    return (i + _TMT_MULT * (prev ^ (prev >> 30))) & _M32


@njit_cached
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


@njit_cached
def tinymt32_fill(seed: int, out: I64) -> None:
    """Fill ``out`` with successive ``tinymt32_generate_uint32`` outputs for ``seed``."""
    s0, s1, s2, s3 = _tmt_init(seed)
    for i in range(out.shape[0]):
        s0, s1, s2, s3 = _tmt_next(s0, s1, s2, s3)
        out[i] = _tmt_temper(s0, s2, s3)


@njit_cached
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
