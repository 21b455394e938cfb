"""Encoder kernels: one RFC 8681 repair symbol, a linear combination of the window's source symbols.

:func:`encoder_make_repair` is what :class:`pfec.common.codec.fec.Encoder` calls once per repair: it
picks the first repair key whose coefficient row suits the window, then encodes. Few nonzero
coefficients are multiplied in one by one; from ``LINCOMB_MIN_TERMS`` on, the bit-plane accumulators
of :mod:`.gf256` do the sum. :func:`ref_encode_repair` is the numpy reference the tests use.
"""

from __future__ import annotations

import numpy as np

from pfec.common.codec.coefficients import generate_coefficients
from pfec.common.codec.gf256 import (
    LINCOMB_MIN_TERMS,
    MUL,
    U8,
    acc_add,
    acc_clear,
    acc_finish,
    njit_cached,
    region_mul,
    region_muladd,
    region_zero,
)

__all__ = ["encode_repair", "encoder_make_repair", "ref_encode_repair"]


@njit_cached
def _encode(symbols: U8, fss_esi: int, coefs: U8, out: U8, acc: U8) -> None:
    """``out = sum_i coefs[i] * symbols[fss_esi + i]``; ``acc`` is (8, S) accumulator scratch."""
    nnz = 0
    for i in range(coefs.shape[0]):
        if coefs[i] != 0:
            nnz += 1
    if nnz >= LINCOMB_MIN_TERMS:
        acc_clear(acc)
        for i in range(coefs.shape[0]):
            c = coefs[i]
            if c != 0:
                acc_add(acc, symbols[fss_esi + i], int(c))
        acc_finish(acc, out)
        return
    first = True
    for i in range(coefs.shape[0]):
        c = coefs[i]
        if c == 0:
            continue
        if first:
            region_mul(out, symbols[fss_esi + i], int(c))
            first = False
        else:
            region_muladd(out, symbols[fss_esi + i], int(c))
    if first:
        region_zero(out)


@njit_cached
def encode_repair(symbols: U8, fss_esi: int, coefs: U8, out: U8) -> None:
    """``out = sum_i coefs[i] * symbols[fss_esi + i]`` (zero coefficients skipped).

    ``symbols`` is the (N, S) uint8 source array indexed by ESI; ``out`` is uint8[S].
    """
    acc = np.empty((8, out.shape[0]), dtype=np.uint8)
    _encode(symbols, fss_esi, coefs, out, acc)


@njit_cached
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


def ref_encode_repair(symbols: U8, fss_esi: int, coefs: U8) -> U8:
    """numpy reference of :func:`encode_repair`; returns a new uint8[S]."""
    out = np.zeros(symbols.shape[1], dtype=np.uint8)
    for i, c in enumerate(coefs.tolist()):
        if c:
            out ^= MUL[c][symbols[fss_esi + i]]
    return out
