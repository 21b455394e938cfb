"""Plain numpy references of the decoder's GF(2^8) linear algebra (rank, solve), for tests and
cross-checks only: slow, obviously correct Gauss-Jordan elimination, apart from the compiled kernels of
:mod:`.decoder_kernels` they check.
"""

from __future__ import annotations

import numpy as np

from pfec.common.codec.gf256 import INV, MUL, U8

__all__ = ["ref_rank", "ref_solve"]


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
