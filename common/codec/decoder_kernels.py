"""Decoder kernels: on-the-fly Gaussian elimination over GF(2^8), kept in reduced row echelon form.

:class:`pfec.common.codec.fec.Decoder` owns the arrays; each received symbol is one compiled call
(:func:`decoder_add_source`, :func:`decoder_add_repair`) and each ACK one more
(:func:`decoder_ack_snapshot`).

Unknown columns always lie in [prefix, prefix + cap) so column index = esi % cap. Pivot rows
are stored by pivot column: coef[p] (cap bytes) and pay[p] (S bytes); coef[p, p] == 1 marks
slot p as holding a pivot row, and every free slot is kept all zero. Rows only reference
unknown columns (known symbols are substituted out on arrival).

ist (int64) layout: [0] prefix, [1] seen_end, [2] rank, [3] unknowns, [4] redundant,
[5] decoded_count, [6] n_new, [7] spare, [8 : 8+cap+1] ESIs decoded by the last call,
then 4*cap scratch slots, then the pivot rows in no order (rank of them) and each pivot row's
index in that list (cap each): inserts walk the rank pivot rows, not all cap slots.
bscr (uint8, 2*cap): coefficient scratch; acc (uint8, (8, S)):
bit-plane accumulators for the payload linear combination.

The plain numpy references the tests check these kernels against are :mod:`.reference`'s.
"""

from __future__ import annotations

import numpy as np

from pfec.common.codec.coefficients import generate_coefficients
from pfec.common.codec.gf256 import (
    B1,
    I64,
    INV,
    LINCOMB_MIN_TERMS,
    MUL,
    U8,
    acc_add,
    acc_clear,
    acc_finish,
    njit_cached,
    njit_inlined,
    region_copy,
    region_muladd,
    region_scale,
    region_xor,
    region_zero,
)

__all__ = [
    "INSERT_BAD_ESI",
    "INSERT_BAD_PARAMS",
    "INSERT_BAD_SIZE",
    "INSERT_WINDOW_OVERFLOW",
    "ST_DECODED",
    "ST_HEADER",
    "ST_NNEW",
    "ST_PREFIX",
    "ST_RANK",
    "ST_REDUNDANT",
    "ST_SEEN",
    "ST_UNKNOWNS",
    "decoder_ack_snapshot",
    "decoder_add_repair",
    "decoder_add_source",
    "decoder_state_len",
    "pack_holes",
]

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


@njit_cached
def _rows_base(cap: int) -> int:
    return ST_HEADER + cap + 1 + 4 * cap


@njit_cached
def _row_on(ist: I64, cap: int, p: int) -> None:
    """Row ``p`` became a pivot row: append it to the pivot list (its length is the rank)."""
    base = _rows_base(cap)
    n = ist[ST_RANK]
    ist[base + n] = p
    ist[base + cap + p] = n
    ist[ST_RANK] = n + 1


@njit_cached
def _row_off(ist: I64, cap: int, p: int) -> None:
    """Row ``p`` is a pivot row no more: swap the list's last row into its place."""
    base = _rows_base(cap)
    n = ist[ST_RANK] - 1
    i = ist[base + cap + p]
    last = ist[base + n]
    ist[base + i] = last
    ist[base + cap + last] = i
    ist[ST_RANK] = n


@njit_cached
def _col_esi(col: int, prefix: int, cap: int) -> int:
    off = col - prefix % cap
    if off < 0:
        off += cap
    return prefix + off


@njit_cached
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


@njit_cached
def _is_singleton(row: U8) -> bool:
    n = 0
    for j in range(row.shape[0]):
        if row[j] != 0:
            n += 1
            if n > 1:
                return False
    return n == 1


@njit_cached
def _rowop(dst: U8, src: U8, f: int) -> None:
    """Coefficient row op ``dst ^= f * src`` (short rows, table form)."""
    m = MUL[f]
    for j in range(dst.shape[0]):
        s = src[j]
        if s != 0:
            dst[j] ^= m[s]


@njit_cached
def _emit(row: int, store: U8, have: B1, coef: U8, pay: U8, ist: I64) -> None:
    """Pivot row ``row`` is a singleton: deliver it and free the slot."""
    cap = coef.shape[0]
    esi = _col_esi(row, ist[ST_PREFIX], cap)
    region_copy(store[esi], pay[row])
    have[esi] = True
    coef[row, row] = 0
    _row_off(ist, cap, row)
    ist[ST_UNKNOWNS] -= 1
    ist[ST_DECODED] += 1
    n = ist[ST_NNEW]
    ist[ST_HEADER + n] = esi
    ist[ST_NNEW] = n + 1


@njit_cached
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


@njit_cached
def _advance_prefix(have: B1, ist: I64) -> None:
    p = ist[ST_PREFIX]
    n = have.shape[0]
    while p < n and have[p]:
        p += 1
    ist[ST_PREFIX] = p


@njit_cached
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
    region_copy(store[esi], payload)
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
            region_xor(pay[col], src)
            coef[col, col] = 0
            _row_off(ist, cap, col)
            lead = _first_nonzero(coef[col], prefix, cap)
            if lead >= 0:
                region_copy(coef[lead], coef[col])
                region_copy(pay[lead], pay[col])
                region_zero(coef[col])
                _install(lead, store, have, coef, pay, ist, mod2)
        for k in range(nmod):
            q = mod[k]
            if coef[q, q] != 0 and _is_singleton(coef[q]):
                _emit(q, store, have, coef, pay, ist)
    _advance_prefix(have, ist)
    return int(ist[ST_NNEW])


@njit_inlined
def _unknown_row(cc: U8, nss: int, fss_esi: int, have: B1, r: U8) -> bool:
    """The repair's coefficients on still-unknown symbols, by column, into ``r`` (the known ones are
    substituted out later, in the payload). False when the repair covers no unknown symbol."""
    cap = r.shape[0]
    region_zero(r)
    any_unknown = False
    for i in range(nss):
        c = cc[i]
        if c != 0 and not have[fss_esi + i]:
            r[(fss_esi + i) % cap] = c
            any_unknown = True
    return any_unknown


@njit_inlined
def _reduce_row(r: U8, coef: U8, fcol: I64, ffac: I64) -> int:
    """Eliminate every pivot column from ``r``; each step's (column, factor) goes to ``fcol``/``ffac``
    for the payload. Returns the number of steps."""
    nf = 0
    for j in range(coef.shape[0]):
        f = r[j]
        if f != 0 and coef[j, j] != 0:
            _rowop(r, coef[j], int(f))
            fcol[nf] = j
            ffac[nf] = f
            nf += 1
    return nf


@njit_inlined
def _repair_payload(
    lead: int,
    cc: U8,
    nss: int,
    fss_esi: int,
    payload: U8,
    store: U8,
    have: B1,
    coef: U8,
    pay: U8,
    fcol: I64,
    ffac: I64,
    nf: int,
    acc: U8,
) -> None:
    """An innovative repair's row (already in ``coef[lead]``) gets its payload in ``pay[lead]``: the
    received payload minus the known symbols and the reduction steps. The accumulator form also
    normalises row and payload by 1/lead; the short form leaves that to :func:`_install`."""
    dst = pay[lead]
    nterms = 1 + nf
    for i in range(nss):
        if cc[i] != 0 and have[fss_esi + i]:
            nterms += 1
    if nterms >= LINCOMB_MIN_TERMS:
        rowp = coef[lead]
        inv = INV[rowp[lead]]
        mi = MUL[inv]
        acc_clear(acc)
        acc_add(acc, payload, int(inv))
        for i in range(nss):
            c = cc[i]
            if c != 0 and have[fss_esi + i]:
                acc_add(acc, store[fss_esi + i], int(mi[c]))
        for k in range(nf):
            acc_add(acc, pay[fcol[k]], int(mi[ffac[k]]))
        acc_finish(acc, dst)
        for j in range(rowp.shape[0]):
            rowp[j] = mi[rowp[j]]
    else:
        region_copy(dst, payload)
        for i in range(nss):
            c = cc[i]
            if c != 0 and have[fss_esi + i]:
                region_muladd(dst, store[fss_esi + i], int(c))
        for k in range(nf):
            region_muladd(dst, pay[fcol[k]], int(ffac[k]))


@njit_cached
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
    if not _unknown_row(cc, nss, fss_esi, have, r):
        ist[ST_REDUNDANT] += 1
        return 0
    scr = ST_HEADER + cap + 1
    fcol = ist[scr : scr + cap]
    ffac = ist[scr + cap : scr + 2 * cap]
    mod = ist[scr + 2 * cap : scr + 3 * cap]
    nf = _reduce_row(r, coef, fcol, ffac)
    lead = _first_nonzero(r, ist[ST_PREFIX], cap)
    if lead < 0:
        ist[ST_REDUNDANT] += 1
        return 0
    region_copy(coef[lead], r)  # innovative: a new pivot row
    _repair_payload(lead, cc, nss, fss_esi, payload, store, have, coef, pay, fcol, ffac, nf, acc)
    _install(lead, store, have, coef, pay, ist, mod)
    _advance_prefix(have, ist)
    return int(ist[ST_NNEW])


@njit_cached
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


@njit_cached
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
