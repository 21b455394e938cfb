"""RFC 8681 sliding-window RLC codec: encoder, decoder, bookkeeping and error handling."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pfec.common.codec import coefficients, encoder_kernels, gf256, reference
from pfec.common.codec.fec import (
    DEFAULT_TARGET_NONZEROS,
    DEFAULT_WINDOW,
    FEC_ERROR_REASONS,
    Decoder,
    Encoder,
    FecError,
    RepairId,
    coding_coefficients,
    density_for,
    warm_up,
)
from pfec.lab.bench import codec_kernels

U8 = npt.NDArray[np.uint8]
SETTINGS = settings(max_examples=40, deadline=None)


def make_symbols(n: int, size: int, seed: int = 0) -> U8:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def check_bookkeeping(dec: Decoder) -> None:
    p = dec.decoded_prefix
    undecoded = np.flatnonzero(~dec.have)
    assert p == (int(undecoded[0]) if undecoded.size else dec.n_source)
    assert dec.unknowns == int(np.count_nonzero(~dec.have[p : dec.seen_end]))
    assert 0 <= dec.rank <= dec.unknowns
    assert dec.deficit == max(0, dec.unknowns - dec.rank)
    assert dec.decoded_count == int(np.count_nonzero(dec.have))


# --- module hygiene ---------------------------------------------------------------------------


def test_fec_is_sans_io() -> None:
    tree = ast.parse(Path(__file__).parents[1].joinpath("common", "codec", "fec.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "socket", "time", "torch"}


def test_constants() -> None:
    assert DEFAULT_WINDOW == 64
    assert DEFAULT_TARGET_NONZEROS == 8


# --- density rule and coefficients -------------------------------------------------------------


@pytest.mark.parametrize(
    ("nss", "target", "dt"),
    [(64, 8, 1), (16, 8, 7), (8, 8, 15), (1, 8, 15), (128, 8, 0), (1000, 8, 0), (64, 4, 0), (32, 8, 3)],
)
def test_density_for(nss: int, target: int, dt: int) -> None:
    assert density_for(nss, target) == dt


@given(st.integers(1, 4095), st.integers(1, 64))
def test_density_for_expected_nonzeros(nss: int, target: int) -> None:
    dt = density_for(nss, target)
    assert 0 <= dt <= 15
    if 0 < dt < 15:
        # The smallest DT whose expected nonzero count reaches the target.
        assert nss * (dt + 1) / 16 >= target > nss * dt / 16


def test_density_for_rejects_empty_window() -> None:
    with pytest.raises(FecError) as ei:
        density_for(0)
    assert ei.value.reason == "bad_nss"


def test_coding_coefficients() -> None:
    cc = coding_coefficients(1234, 5, 40)
    assert cc.dtype == np.uint8 and cc.shape == (40,)
    np.testing.assert_array_equal(cc, coefficients.ref_generate_coefficients(1234, 5, 40))
    for args, reason in [
        ((-1, 5, 4), "bad_repair_key"),
        ((0x10000, 5, 4), "bad_repair_key"),
        ((1, 16, 4), "bad_dt"),
        ((1, -1, 4), "bad_dt"),
        ((1, 5, 0), "bad_nss"),
        ((1, 5, 4096), "bad_nss"),
    ]:
        with pytest.raises(FecError) as ei:
            coding_coefficients(*args)
        assert ei.value.reason == reason


# --- encoder ----------------------------------------------------------------------------------


def test_encoder_window_and_ack_semantics() -> None:
    enc = Encoder(make_symbols(10, 8), window_cap=4)
    assert (enc.n_source, enc.symbol_size, enc.window_cap) == (10, 8, 4)
    assert enc.window() == (0, 0)
    assert [enc.take_source() for _ in range(6)] == list(range(6))
    assert enc.next_esi == 6
    assert enc.window() == (0, 4)  # capped
    enc.on_ack(3)
    assert enc.ack_prefix == 3 and enc.window() == (3, 3)
    enc.on_ack(2)  # stale
    assert enc.ack_prefix == 3
    enc.on_ack(100)  # clamped to next_esi
    assert enc.ack_prefix == 6 and enc.window() == (6, 0)
    for _ in range(4):
        enc.take_source()
    with pytest.raises(IndexError):
        enc.take_source()
    assert enc.window() == (6, 4)


def test_encoder_make_repair_ids_and_payload() -> None:
    syms = make_symbols(100, 50)
    enc = Encoder(syms, window_cap=64, first_repair_key=0xFFFE)
    out = np.zeros(50, dtype=np.uint8)
    with pytest.raises(FecError) as ei:
        enc.make_repair(out)
    assert ei.value.reason == "empty_window"
    for _ in range(70):
        enc.take_source()
    enc.on_ack(3)
    keys = []
    for _ in range(3):
        rid = enc.make_repair(out, cover_first=False)
        keys.append(rid.repair_key)
        assert (rid.dt, rid.nss, rid.fss_esi) == (density_for(64, 8), 64, 3)
        cc = coefficients.ref_generate_coefficients(rid.repair_key, rid.dt, rid.nss)
        np.testing.assert_array_equal(out, encoder_kernels.ref_encode_repair(syms, rid.fss_esi, cc))
        np.testing.assert_array_equal(cc, coding_coefficients(rid.repair_key, rid.dt, rid.nss))
    assert keys == [0xFFFE, 0xFFFF, 0]  # 16-bit wrap
    assert enc.repairs_made == 3
    with pytest.raises(ValueError):
        enc.make_repair(np.zeros(49, dtype=np.uint8))


def test_make_repair_covers_the_first_symbol_and_honours_count_and_dt() -> None:
    syms = make_symbols(100, 50)
    enc = Encoder(syms, window_cap=64)
    out = np.zeros(50, dtype=np.uint8)
    for _ in range(80):
        enc.take_source()
    enc.on_ack(10)
    skipped_any = False
    for _ in range(40):
        rid = enc.make_repair(out, dt=1)  # sparse: ~1/8 of the symbols
        cc = coding_coefficients(rid.repair_key, rid.dt, rid.nss)
        assert cc[0] != 0, "the receiver's first missing symbol must be in every repair"
        np.testing.assert_array_equal(out, encoder_kernels.ref_encode_repair(syms, 10, cc))
        skipped_any |= enc.zero_rows_skipped > 0
    assert skipped_any  # some keys were passed over for missing the first symbol
    rid = enc.make_repair(out, count=5, dt=15)
    assert (rid.fss_esi, rid.nss, rid.dt) == (10, 5, 15)
    assert enc.make_repair(out, count=500).nss == 64  # never beyond the window
    with pytest.raises(ValueError):
        enc.make_repair(out, dt=16)


def test_encoder_density_options() -> None:
    syms = make_symbols(20, 4)
    out = np.zeros(4, dtype=np.uint8)
    dense = Encoder(syms, window_cap=16, target_nonzeros=None)
    fixed = Encoder(syms, window_cap=16, fixed_dt=3)
    rule = Encoder(syms, window_cap=16)
    for enc in (dense, fixed, rule):
        for _ in range(16):
            enc.take_source()
    assert dense.make_repair(out).dt == 15
    assert fixed.make_repair(out).dt == 3
    assert rule.make_repair(out).dt == 7
    rid = RepairId(1, 2, 3, 4)
    with pytest.raises(AttributeError):
        rid.dt = 5  # type: ignore[misc]


def test_encoder_rejects_bad_arguments() -> None:
    syms = make_symbols(4, 4)
    with pytest.raises(ValueError):
        Encoder(syms.astype(np.int16))
    with pytest.raises(ValueError):
        Encoder(np.asfortranarray(make_symbols(4, 4)[:, :3]))
    with pytest.raises(ValueError):
        Encoder(syms, window_cap=0)
    with pytest.raises(ValueError):
        Encoder(syms, fixed_dt=16)
    with pytest.raises(ValueError):
        Encoder(syms, first_repair_key=0x10000)


def _find_zero_row_key(dt: int, nss: int) -> tuple[int, int]:
    """First key whose RFC 8681 row is all zero, and the next key with a nonzero row."""
    key = 0
    while np.any(coefficients.ref_generate_coefficients(key, dt, nss)):
        key += 1
    nxt = key + 1
    while not np.any(coefficients.ref_generate_coefficients(nxt, dt, nss)):
        nxt += 1
    return key, nxt


def test_encoder_skips_all_zero_rows() -> None:
    zero_key, good_key = _find_zero_row_key(dt=0, nss=2)
    syms = make_symbols(2, 16)
    enc = Encoder(syms, window_cap=2, fixed_dt=0, first_repair_key=zero_key)
    enc.take_source()
    enc.take_source()
    out = np.zeros(16, dtype=np.uint8)
    rid = enc.make_repair(out)
    assert rid.repair_key == good_key
    assert enc.zero_rows_skipped == good_key - zero_key >= 1
    assert enc.next_repair_key == (good_key + 1) & 0xFFFF
    cc = coefficients.ref_generate_coefficients(rid.repair_key, 0, 2)
    np.testing.assert_array_equal(out, encoder_kernels.ref_encode_repair(syms, 0, cc))
    # A receiver given the all-zero row itself just counts it as redundant.
    dec = Decoder(2, 16, 2)
    assert dec.add_repair(RepairId(zero_key, 0, 2, 0), np.zeros(16, dtype=np.uint8)) == 0
    assert dec.redundant == 1 and dec.rank == 0 and dec.unknowns == 2


# --- decoder: errors -------------------------------------------------------------------------


def test_decoder_errors_leave_state_untouched() -> None:
    dec = Decoder(100, 8, window_cap=16)
    ok = np.zeros(8, dtype=np.uint8)
    cases: list[tuple[str, tuple[object, ...]]] = [
        ("esi_out_of_range", ("source", -1, ok)),
        ("esi_out_of_range", ("source", 100, ok)),
        ("bad_symbol_size", ("source", 0, b"\x00" * 7)),
        ("bad_symbol_size", ("repair", RepairId(1, 15, 4, 0), b"\x00" * 9)),
        ("bad_nss", ("repair", RepairId(1, 15, 0, 0), ok)),
        ("bad_nss", ("repair", RepairId(1, 15, 17, 0), ok)),
        ("bad_dt", ("repair", RepairId(1, 16, 4, 0), ok)),
        ("bad_dt", ("repair", RepairId(1, -1, 4, 0), ok)),
        ("bad_repair_key", ("repair", RepairId(0x10000, 15, 4, 0), ok)),
        ("esi_out_of_range", ("repair", RepairId(1, 15, 4, -1), ok)),
        ("esi_out_of_range", ("repair", RepairId(1, 15, 4, 97), ok)),
        ("window_overflow", ("repair", RepairId(1, 15, 4, 13), ok)),
    ]
    for reason, (kind, a, payload) in cases:
        with pytest.raises(FecError) as ei:
            if kind == "source":
                dec.add_source(a, payload)  # type: ignore[arg-type]
            else:
                dec.add_repair(a, payload)  # type: ignore[arg-type]
        assert ei.value.reason == reason
        assert reason in FEC_ERROR_REASONS
        assert isinstance(ei.value, ValueError)
    assert dec.seen_end == 0 and dec.decoded_count == 0 and dec.redundant == 0
    # The window limit follows the decoded prefix.
    for esi in range(5):
        dec.add_source(esi, ok)
    dec.add_repair(RepairId(1, 15, 16, 5), ok)  # ends at prefix + cap: accepted
    with pytest.raises(FecError) as ei:
        dec.add_repair(RepairId(1, 15, 16, 6), ok)
    assert ei.value.reason == "window_overflow"


def test_decoder_accepts_payload_types_and_duplicates() -> None:
    syms = make_symbols(3, 10)
    dec = Decoder(3, 10, window_cap=4)
    assert dec.add_source(0, syms[0].tobytes()) == 1
    assert dec.add_source(1, memoryview(syms[1].tobytes())) == 1
    assert dec.add_source(2, bytearray(syms[2].tobytes())) == 1
    assert dec.newly_decoded.tolist() == [2]
    assert dec.add_source(2, syms[2]) == 0
    assert dec.newly_decoded.tolist() == []
    np.testing.assert_array_equal(dec.store, syms)
    assert dec.decoded_esis().tolist() == [0, 1, 2]
    assert dec.decoded_prefix == 3 and dec.complete


def test_decoder_reads_unusual_memoryviews_by_their_bytes() -> None:
    """The inserts hand byte memoryviews to the kernels as they are; views of other shapes, item sizes
    or strides must still be read as their bytes (or refused), never mis-read."""
    syms = make_symbols(4, 8, seed=3)
    words = syms[0].view(np.int32)  # 2 items of 4 bytes: same 8 bytes
    dec = Decoder(4, 8, window_cap=4)
    assert dec.add_source(0, memoryview(words)) == 1
    assert dec.add_source(1, memoryview(syms[1].reshape(2, 4))) == 1
    wide = np.zeros(16, dtype=np.uint8)
    wide[::2] = syms[2]
    assert dec.add_source(2, memoryview(wide)[::2]) == 1  # strided
    assert dec.add_source(3, memoryview(bytearray(syms[3].tobytes()))) == 1  # writable
    np.testing.assert_array_equal(dec.store, syms)
    with pytest.raises(FecError) as ei:
        Decoder(4, 8, window_cap=4).add_source(0, memoryview(syms[0].view(np.int32)[:1]))
    assert ei.value.reason == "bad_symbol_size"


# --- decoder: bookkeeping and partial delivery ------------------------------------------------


def test_bookkeeping_and_partial_delivery() -> None:
    syms = make_symbols(64, 32, seed=7)
    cap = 16
    enc = Encoder(syms, window_cap=cap, target_nonzeros=None)
    dec = Decoder(64, 32, window_cap=cap)
    out = np.zeros(32, dtype=np.uint8)
    lost = {2, 12}
    for _ in range(8):
        esi = enc.take_source()
        if esi not in lost:
            dec.add_source(esi, syms[esi])
    rid_a = enc.make_repair(out)  # window [0, 8): covers ESI 2 only
    pay_a = out.copy()
    for _ in range(8):
        esi = enc.take_source()
        if esi not in lost:
            dec.add_source(esi, syms[esi])
    assert (dec.decoded_prefix, dec.seen_end, dec.unknowns, dec.rank, dec.deficit) == (2, 16, 2, 0, 2)
    check_bookkeeping(dec)

    # Partial delivery: ESI 2 resolves although the window still misses ESI 12.
    assert dec.add_repair(rid_a, pay_a) == 1
    assert dec.newly_decoded.tolist() == [2]
    np.testing.assert_array_equal(dec.store[2], syms[2])
    assert (dec.decoded_prefix, dec.unknowns, dec.rank, dec.deficit) == (12, 1, 0, 1)
    assert dec.add_repair(rid_a, pay_a) == 0  # nothing new
    assert dec.redundant == 1
    check_bookkeeping(dec)

    rid_b = enc.make_repair(out)  # window [0, 16)
    assert dec.add_repair(rid_b, out) == 1
    assert dec.newly_decoded.tolist() == [12]
    assert (dec.decoded_prefix, dec.unknowns, dec.rank, dec.deficit) == (16, 0, 0, 0)
    np.testing.assert_array_equal(dec.store[:16], syms[:16])
    check_bookkeeping(dec)


def test_late_source_resolves_pending_equation() -> None:
    syms = make_symbols(8, 24, seed=3)
    enc = Encoder(syms, window_cap=8, target_nonzeros=None)
    dec = Decoder(8, 24, window_cap=8)
    out = np.zeros(24, dtype=np.uint8)
    for _ in range(8):
        esi = enc.take_source()
        if esi not in (1, 5):
            dec.add_source(esi, syms[esi])
    assert dec.add_repair(enc.make_repair(out), out) == 0  # two unknowns, one equation
    assert (dec.rank, dec.unknowns, dec.deficit) == (1, 2, 1)
    # ESI 1 (the pivot column) arrives late: the equation now yields ESI 5 as well.
    assert dec.add_source(1, syms[1]) == 2
    assert sorted(dec.newly_decoded.tolist()) == [1, 5]
    assert dec.newly_decoded[0] == 1
    assert dec.complete and (dec.rank, dec.unknowns, dec.deficit) == (0, 0, 0)
    np.testing.assert_array_equal(dec.store, syms)


def test_late_source_in_free_column() -> None:
    syms = make_symbols(8, 24, seed=4)
    enc = Encoder(syms, window_cap=8, target_nonzeros=None)
    dec = Decoder(8, 24, window_cap=8)
    out = np.zeros(24, dtype=np.uint8)
    for _ in range(8):
        esi = enc.take_source()
        if esi not in (1, 5, 6):
            dec.add_source(esi, syms[esi])
    dec.add_repair(enc.make_repair(out), out)
    dec.add_repair(enc.make_repair(out), out)
    assert (dec.rank, dec.unknowns, dec.deficit) == (2, 3, 1)
    # ESI 6 is a free column of both pivot rows (1 and 5): both become singletons.
    assert dec.add_source(6, syms[6]) == 3
    assert sorted(dec.newly_decoded.tolist()) == [1, 5, 6]
    assert dec.complete
    np.testing.assert_array_equal(dec.store, syms)


# --- round trips ------------------------------------------------------------------------------


@SETTINGS
@example(n=150, size=33, cap=7, density="rule8", p_loss=0.45, repair_every=2, ack_delay=12, seed=1)
@example(n=150, size=17, cap=40, density="dense", p_loss=0.3, repair_every=3, ack_delay=5, seed=2)
@example(n=120, size=9, cap=16, density="dt0", p_loss=0.2, repair_every=1, ack_delay=0, seed=3)
@given(
    n=st.integers(1, 150),
    size=st.integers(1, 40),
    cap=st.integers(1, 40),
    density=st.sampled_from(["dense", "rule8", "rule2", "dt0", "dt7"]),
    p_loss=st.floats(0.0, 0.5),
    repair_every=st.integers(1, 6),
    ack_delay=st.integers(0, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_under_random_erasures(
    n: int,
    size: int,
    cap: int,
    density: str,
    p_loss: float,
    repair_every: int,
    ack_delay: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    syms = make_symbols(n, size, seed)
    options: dict[str, dict[str, Any]] = {
        "dense": {"target_nonzeros": None},
        "rule8": {"target_nonzeros": 8},
        "rule2": {"target_nonzeros": 2},
        "dt0": {"fixed_dt": 0},
        "dt7": {"fixed_dt": 7},
    }
    key0 = int(rng.integers(0, 0x10000))
    enc = Encoder(syms, window_cap=cap, first_repair_key=key0, **options[density])
    dec = Decoder(n, size, window_cap=cap)
    out = np.zeros(size, dtype=np.uint8)
    prefixes: list[int] = []
    delivered: list[int] = []
    step = 0
    while not dec.complete:
        step += 1
        assert step < 20000, "stream did not converge"
        enc.on_ack(prefixes[-1 - ack_delay] if len(prefixes) > ack_delay else 0)
        first, count = enc.window()
        if enc.next_esi < n and (step % (repair_every + 1) or count == 0):
            esi = enc.take_source()
            if rng.random() >= p_loss:
                dec.add_source(esi, syms[esi])
                delivered.extend(dec.newly_decoded.tolist())
        elif count > 0:
            rid = enc.make_repair(out)
            assert rid.fss_esi == first and rid.nss == count
            if rng.random() >= p_loss:
                dec.add_repair(rid, out)
                delivered.extend(dec.newly_decoded.tolist())
        for esi in dec.newly_decoded.tolist():
            np.testing.assert_array_equal(dec.store[esi], syms[esi])
        check_bookkeeping(dec)
        prefixes.append(dec.decoded_prefix)
    np.testing.assert_array_equal(dec.store, syms)
    # Every symbol was reported exactly once by newly_decoded.
    assert sorted(delivered) == list(range(n))
    assert dec.decoded_esis().tolist() == list(range(n))


@SETTINGS
@given(
    n=st.integers(2, 24),
    n_repairs=st.integers(0, 24),
    p_loss=st.floats(0.1, 0.9),
    dense=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_decoder_recovers_exactly_what_the_equations_determine(
    n: int, n_repairs: int, p_loss: float, dense: bool, seed: int
) -> None:
    """Random sets of sources and repairs, inserted in random order.

    Oracle: with E the erased sources and A the repair coefficients restricted to E, an
    erased symbol is recoverable iff removing its column lowers rank(A) by one; when
    rank(A) == |E| everything decodes (the reference solver agrees with the data).
    """
    rng = np.random.default_rng(seed)
    size = 12
    cap = n + int(rng.integers(0, 8))
    syms = make_symbols(n, size, seed)
    erased = np.flatnonzero(rng.random(n) < p_loss)
    known = [e for e in range(n) if e not in set(erased.tolist())]
    repairs: list[tuple[RepairId, U8, U8]] = []
    for _ in range(n_repairs):
        fss = int(rng.integers(0, n))
        nss = int(rng.integers(1, n - fss + 1))
        dt = 15 if dense else int(rng.integers(0, 16))
        rid = RepairId(int(rng.integers(0, 0x10000)), dt, nss, fss)
        cc = coefficients.ref_generate_coefficients(rid.repair_key, dt, nss)
        row = np.zeros(n, dtype=np.uint8)
        row[fss : fss + nss] = cc
        repairs.append((rid, encoder_kernels.ref_encode_repair(syms, fss, cc), row))

    a = (
        np.array([row[erased] for _, _, row in repairs], dtype=np.uint8)
        if repairs
        else np.zeros((0, erased.size), dtype=np.uint8)
    )
    rank = reference.ref_rank(a) if a.size else 0
    determined = {
        int(e)
        for i, e in enumerate(erased)
        if rank - (reference.ref_rank(np.delete(a, i, axis=1)) if a.size else 0) == 1
    }

    events: list[tuple[str, int]] = [("s", e) for e in known] + [("r", i) for i in range(len(repairs))]
    order = rng.permutation(len(events))
    dec = Decoder(n, size, window_cap=cap)
    for k in order:
        kind, idx = events[int(k)]
        if kind == "s":
            dec.add_source(idx, syms[idx])
        else:
            rid, payload, _ = repairs[idx]
            dec.add_repair(rid, payload)
        check_bookkeeping(dec)

    recovered = {int(e) for e in erased if dec.have[e]}
    assert recovered == determined
    assert dec.rank == rank - len(determined)
    np.testing.assert_array_equal(dec.store[dec.have], syms[dec.have])
    if rank == erased.size:
        assert dec.have.all()
        if erased.size and a.size:
            # Independent check of the equations with the reference solver.
            b = np.array([p.copy() for _, p, _ in repairs], dtype=np.uint8)
            for r, (_, _, row) in enumerate(repairs):
                for e in known:
                    if row[e]:
                        gf256.ref_region_muladd(b[r], syms[e], int(row[e]))
            sol = reference.ref_solve(a, b)
            assert sol is not None
            np.testing.assert_array_equal(sol, syms[erased])


def test_window_wraps_many_times() -> None:
    """Long stream with a small window: column indices wrap around esi % cap repeatedly."""
    n, size, cap = 600, 16, 5
    syms = make_symbols(n, size, seed=11)
    enc = Encoder(syms, window_cap=cap, target_nonzeros=None)
    dec = Decoder(n, size, window_cap=cap)
    out = np.zeros(size, dtype=np.uint8)
    rng = np.random.default_rng(11)
    while not dec.complete:
        enc.on_ack(dec.decoded_prefix)
        if enc.next_esi < n and enc.next_esi - enc.ack_prefix < cap:
            esi = enc.take_source()
            if rng.random() > 0.3:
                dec.add_source(esi, syms[esi])
        else:
            rid = enc.make_repair(out)
            if rng.random() > 0.3:
                dec.add_repair(rid, out)
        check_bookkeeping(dec)
    np.testing.assert_array_equal(dec.store, syms)


# --- warm-up and bench smoke tests ------------------------------------------------------------


def test_warm_up_runs() -> None:
    warm_up()  # compiles (cold cache) or loads every kernel variant; self-checks a round trip


def test_codec_bench_smoke() -> None:
    enc = codec_kernels.bench_encode(symbol_size=64, repeats=5)
    assert set(enc) == {"k16_dense", "k64_dense", "k64_sparse8"}
    assert all(v > 0 for v in enc.values())
    lost = codec_kernels.ge_loss_mask(3000, seed=3)
    assert 0.0 < lost.mean() < 0.3
    res = codec_kernels.bench_decode_insert(lost, symbol_size=64)
    assert res["decode_insert_us_mean"] > 0 and res["decode_insert_us_p99"] >= res["decode_insert_us_median"]
    assert res["complete"] == 1.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), span=st.sampled_from([8, 64, 512]), drop=st.floats(0.0, 0.5))
def test_ack_snapshot_matches_decoder_state(seed: int, span: int, drop: float) -> None:
    """The one-call ACK snapshot equals the decoder's own properties and a numpy-packed hole map."""
    rng = np.random.default_rng(seed)
    n, size = 300, 16
    syms = rng.integers(0, 256, (n, size), dtype=np.uint8)
    enc = Encoder(syms, window_cap=32)
    dec = Decoder(n, size, window_cap=32)
    out = np.zeros((span + 7) // 8, dtype=np.uint8)
    for _ in range(int(rng.integers(1, n))):
        esi = enc.take_source()
        if rng.random() >= drop:
            dec.add_source(esi, syms[esi])
        if rng.random() < 0.1 and enc.window()[1] > 0:
            rep = np.zeros(size, dtype=np.uint8)
            dec.add_repair(enc.make_repair(rep), rep)
        enc.on_ack(dec.decoded_prefix)
    prefix, seen, decoded, unknowns, deficit, bits = dec.ack_snapshot(span, out)
    assert (prefix, seen, decoded) == (dec.decoded_prefix, dec.seen_end, dec.decoded_count)
    hi = min(prefix + span, seen)
    missing = np.flatnonzero(~dec.have[prefix:hi])
    assert unknowns == len(missing)
    assert deficit == (max(0, unknowns - dec.rank) if unknowns else 0)
    assert bits == (int(missing[-1]) + 1 if len(missing) else 0)
    want = np.zeros(len(out) * 8, dtype=bool)
    want[missing] = True
    assert np.array_equal(np.unpackbits(out)[:bits], want[:bits])
    with pytest.raises(ValueError, match="C-contiguous"):
        dec.ack_snapshot(span, np.zeros(128, dtype=np.uint8)[::2])
