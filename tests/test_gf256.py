"""GF(2^8) tables and kernels, RFC 8682 TinyMT32 and RFC 8681 coefficient generation."""

from __future__ import annotations

import galois
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pfec.common.codec import coefficients, encoder_kernels, gf256, reference
from pfec.common.codec.gf256 import EXP, INV, LOG, MUL

GF = galois.GF(2**8, irreducible_poly=0x11D)

# RFC 8682, Section 2.2 (Figure 2): the first 50 values returned by
# tinymt32_generate_uint32(s) as 32-bit unsigned integers, with a seed value of 1
# (read line by line). Copied verbatim from the RFC; not derived from this code.
RFC8682_SEED1_FIRST50 = """
2545341989  981918433 3715302833 2387538352 3591001365
3820442102 2114400566 2196103051 2783359912  764534509
 643179475 1822416315  881558334 4207026366 3690273640
3240535687 2921447122 3984931427 4092394160   44209675
2188315343 2908663843 1834519336 3774670961 3019990707
4065554902 1239765502 4035716197 3412127188  552822483
 161364450  353727785  140085994  149132008 2547770827
4064042525 4078297538 2057335507  622384752 2041665899
2193913817 1080849512   33160901  662956935  642999063
3384709977 1723175122 3866752252  521822317 2292524454
"""
RFC_VALUES = [int(v) for v in RFC8682_SEED1_FIRST50.split()]

SETTINGS = settings(max_examples=60, deadline=None)


# --- tables vs galois ------------------------------------------------------------------------


def test_field_is_the_rfc8681_one() -> None:
    assert GF.irreducible_poly == galois.Poly.Int(0x11D)
    assert int(GF.primitive_element) == 2


def test_exp_log_against_galois() -> None:
    alpha = GF(2)
    powers = np.array([int(alpha**i) for i in range(255)], dtype=np.uint8)
    np.testing.assert_array_equal(EXP[:255], powers)
    np.testing.assert_array_equal(EXP[255:510], powers)  # doubled table
    assert sorted(EXP[:255].tolist()) == list(range(1, 256))  # 2 generates the group
    logs = np.log(GF(np.arange(1, 256)))
    np.testing.assert_array_equal(LOG[1:], np.asarray(logs))
    assert all(EXP[LOG[a]] == a for a in range(1, 256))


def test_mul_table_against_galois() -> None:
    a = GF(np.arange(256))
    full = np.asarray(a[:, None] * a[None, :]).astype(np.uint8)
    np.testing.assert_array_equal(MUL, full)
    assert MUL.dtype == np.uint8 and MUL.shape == (256, 256)


def test_inv_table_against_galois() -> None:
    np.testing.assert_array_equal(INV[1:], np.asarray(np.reciprocal(GF(np.arange(1, 256)))))
    assert INV[0] == 0
    assert all(MUL[a, INV[a]] == 1 for a in range(1, 256))


def test_tables_are_read_only() -> None:
    for t in (EXP, LOG, MUL, INV):
        assert not t.flags.writeable


byte = st.integers(0, 255)


@SETTINGS
@given(byte, byte, byte)
def test_field_axioms(a: int, b: int, c: int) -> None:
    m = MUL
    assert m[a, b] == m[b, a]
    assert m[m[a, b], c] == m[a, m[b, c]]
    assert m[a, b ^ c] == m[a, b] ^ m[a, c]
    assert m[a, 1] == a and m[a, 0] == 0
    if a:
        assert m[a, INV[a]] == 1
    assert int(m[a, b]) == int(GF(a) * GF(b))
    assert (a ^ b) == int(GF(a) + GF(b))


# --- region kernels vs numpy references -------------------------------------------------------


@SETTINGS
@given(
    n=st.integers(0, 3000),
    c=byte,
    offset=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_region_muladd_and_scale_match_reference(n: int, c: int, offset: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    # Offset views exercise unaligned eight-byte words and odd tails.
    dst_buf = rng.integers(0, 256, n + 8, dtype=np.uint8)
    src_buf = rng.integers(0, 256, n + 8, dtype=np.uint8)
    dst = dst_buf[offset : offset + n]
    src = src_buf[8 - offset : 8 - offset + n]
    expect = dst.copy()
    gf256.ref_region_muladd(expect, src, c)
    gf256.region_muladd(dst, src, c)
    np.testing.assert_array_equal(dst, expect)

    before = dst.copy()
    gf256.region_scale(dst, c)
    np.testing.assert_array_equal(dst, MUL[c][before])


def test_region_muladd_readonly_source() -> None:
    src = np.frombuffer(bytes(range(256)) * 6, dtype=np.uint8)[5:1367]
    dst = np.zeros(1362, dtype=np.uint8)
    gf256.region_muladd(dst, src, 0x53)
    np.testing.assert_array_equal(dst, MUL[0x53][src])


@SETTINGS
@given(
    nss=st.integers(1, 80),
    size=st.integers(1, 300),
    dt=st.integers(0, 15),
    key=st.integers(0, 0xFFFF),
    seed=st.integers(0, 2**32 - 1),
)
def test_encode_repair_matches_reference(nss: int, size: int, dt: int, key: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    fss = int(rng.integers(0, 10))
    symbols = rng.integers(0, 256, (fss + nss + 3, size), dtype=np.uint8)
    coefs = coefficients.ref_generate_coefficients(key, dt, nss)
    out = rng.integers(0, 256, size, dtype=np.uint8)  # garbage must be overwritten
    encoder_kernels.encode_repair(symbols, fss, coefs, out)
    np.testing.assert_array_equal(out, encoder_kernels.ref_encode_repair(symbols, fss, coefs))


@pytest.mark.parametrize("nnz", [0, 1, 2, 3, 64])
def test_encode_repair_both_paths(nnz: int) -> None:
    rng = np.random.default_rng(nnz)
    symbols = rng.integers(0, 256, (64, 1362), dtype=np.uint8)
    coefs = np.zeros(64, dtype=np.uint8)
    coefs[rng.choice(64, nnz, replace=False)] = rng.integers(1, 256, nnz, dtype=np.uint8)
    out = np.full(1362, 7, dtype=np.uint8)
    encoder_kernels.encode_repair(symbols, 0, coefs, out)
    expect = np.zeros(1362, dtype=np.uint8)
    for i in np.flatnonzero(coefs):
        expect ^= np.asarray(GF(int(coefs[i])) * GF(symbols[i])).astype(np.uint8)
    np.testing.assert_array_equal(out, expect)


# --- RFC 8682 TinyMT32 ------------------------------------------------------------------------


def test_rfc8682_vector_transcribed() -> None:
    assert len(RFC_VALUES) == 50
    assert RFC_VALUES[:3] == [2545341989, 981918433, 3715302833]
    assert RFC_VALUES[-1] == 2292524454


def test_tinymt32_python_matches_rfc8682() -> None:
    prng = coefficients.TinyMT32(1)
    assert [prng.generate_uint32() for _ in range(50)] == RFC_VALUES


def test_tinymt32_compiled_matches_rfc8682() -> None:
    out = np.zeros(50, dtype=np.int64)
    coefficients.tinymt32_fill(1, out)
    assert out.tolist() == RFC_VALUES


def test_rand256_rand16_are_the_low_bits() -> None:
    a = coefficients.TinyMT32(1)
    b = coefficients.TinyMT32(1)
    assert [a.rand256() for _ in range(50)] == [v & 0xFF for v in RFC_VALUES]
    assert [b.rand16() for _ in range(50)] == [v & 0xF for v in RFC_VALUES]


@SETTINGS
@given(st.integers(0, 2**32 - 1))
def test_tinymt32_compiled_equals_python(seed: int) -> None:
    prng = coefficients.TinyMT32(seed)
    out = np.zeros(40, dtype=np.int64)
    coefficients.tinymt32_fill(seed, out)
    assert out.tolist() == [prng.generate_uint32() for _ in range(40)]
    assert all(0 <= v <= 0xFFFFFFFF for v in out.tolist())


# --- RFC 8681 coefficient generation ---------------------------------------------------------


@SETTINGS
@given(key=st.integers(0, 0xFFFF), dt=st.integers(0, 15), nss=st.integers(1, 200))
def test_generate_coefficients_matches_python(key: int, dt: int, nss: int) -> None:
    out = np.full(nss + 5, 99, dtype=np.uint8)
    nnz = coefficients.generate_coefficients(key, dt, nss, out)
    ref = coefficients.ref_generate_coefficients(key, dt, nss)
    np.testing.assert_array_equal(out[:nss], ref)
    assert nnz == np.count_nonzero(ref)
    assert (out[nss:] == 99).all()  # nothing written past nss


def test_dt15_has_no_zero_coefficients() -> None:
    out = np.zeros(64, dtype=np.uint8)
    for key in range(0, 0x10000, 97):
        assert coefficients.generate_coefficients(key, 15, 64, out) == 64
        assert (out != 0).all()


@pytest.mark.parametrize("dt", [0, 1, 3, 7, 11, 14])
def test_density_close_to_dt_plus_one_over_16(dt: int) -> None:
    out = np.zeros(64, dtype=np.uint8)
    total = 0
    keys = range(0, 0x10000, 16)  # 4096 keys x 64 coefficients
    values = np.zeros(256, dtype=np.int64)
    for key in keys:
        total += coefficients.generate_coefficients(key, dt, 64, out)
        values += np.bincount(out, minlength=256)
    density = total / (len(keys) * 64)
    assert abs(density - (dt + 1) / 16) < 0.01
    # Nonzero coefficients are uniform over 1..255: chi-square with 254 degrees of freedom
    # (mean 254, sd ~22.5); the keys are fixed, so this is deterministic.
    nz = values[1:].astype(np.float64)
    chi2 = float(((nz - nz.mean()) ** 2 / nz.mean()).sum())
    assert chi2 < 254 + 6 * 22.5


# --- reference solver -------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 12), extra=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_ref_solver_against_galois(n: int, extra: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (n + extra, n), dtype=np.uint8)
    x = rng.integers(0, 256, (n, 5), dtype=np.uint8)
    b = np.asarray(GF(a) @ GF(x)).astype(np.uint8)
    rank = int(np.linalg.matrix_rank(GF(a)))
    assert reference.ref_rank(a) == rank
    sol = reference.ref_solve(a, b)
    if rank == n:
        assert sol is not None
        np.testing.assert_array_equal(sol, x)
    else:
        assert sol is None


def test_ref_rank_of_singular_matrix() -> None:
    a = np.array([[1, 2, 3], [2, 4, 6], [0, 0, 0]], dtype=np.uint8)
    a[1] = MUL[7][a[0]]
    assert reference.ref_rank(a) == 1
    assert reference.ref_solve(a, np.zeros((3, 4), dtype=np.uint8)) is None
