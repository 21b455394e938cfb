"""RFC 8681 sliding-window RLC codec over GF(2^8): encoder and on-the-fly decoder.

Sans-IO: no sockets, clocks or event loop here. The heavy lifting (coefficient
generation, repair encoding, Gaussian elimination) is done by compiled kernels in
:mod:`.coefficients`, :mod:`.encoder_kernels` and :mod:`.decoder_kernels` (on the field
arithmetic of :mod:`.gf256`); one decoder insert is one compiled call.

Repair symbols follow RFC 8681 (m = 8): coefficients come from
``generate_coding_coefficients(repair_key, cc_tab, NSS, DT)`` seeded with the 16-bit
repair key, the density threshold DT is 4 bits (density (DT+1)/16), NSS (12 bits)
is the number of source symbols in the encoding window and FSS_ESI its first ESI. A
repair symbol is ``sum_i cc[i] * source[FSS_ESI + i]``.

The encoding window is ACK driven: it starts at the receiver's cumulative decoded
prefix as last reported to the sender (``Encoder.ack_prefix``) and holds at most
``window_cap`` symbols. The receiver's prefix is never behind the sender's view of
it, so every unknown symbol a conforming repair references lies in
``[decoded_prefix, decoded_prefix + window_cap)`` at the decoder; repairs that break
this are rejected with :class:`FecError` (``window_overflow``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from pfec.common.codec import decoder_kernels
from pfec.common.codec.coefficients import generate_coefficients
from pfec.common.codec.encoder_kernels import encoder_make_repair
from pfec.common.codec.gf256 import entry_point

__all__ = [
    "DEFAULT_TARGET_NONZEROS",
    "DEFAULT_WINDOW",
    "FEC_ERROR_REASONS",
    "MAX_NSS",
    "Decoder",
    "Encoder",
    "FecError",
    "RepairId",
    "coding_coefficients",
    "density_for",
    "warm_up",
]

DEFAULT_WINDOW: Final = 64
DEFAULT_TARGET_NONZEROS: Final = 8
MAX_NSS: Final = 0x0FFF  # NSS is a 12-bit field
MAX_REPAIR_KEY: Final = 0xFFFF  # 16-bit field
MAX_DT: Final = 15  # 4-bit field

#: Every ``FecError.reason`` this module raises (bounded set, usable as metric labels).
FEC_ERROR_REASONS: Final = frozenset(
    {
        "esi_out_of_range",
        "window_overflow",
        "bad_symbol_size",
        "bad_nss",
        "bad_dt",
        "bad_repair_key",
        "empty_window",
        "no_nonzero_row",
    }
)

U8 = npt.NDArray[np.uint8]
Payload = bytes | bytearray | memoryview | npt.NDArray[np.uint8]


class FecError(ValueError):
    """Bad input (normally from the network). Callers drop the packet and count ``reason``."""

    reason: str

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RepairId(NamedTuple):
    """RFC 8681 repair FEC Payload ID fields (a tuple: one is made per repair on each side)."""

    repair_key: int  # 16 bits
    dt: int  # 4 bits
    nss: int  # 12 bits
    fss_esi: int  # 32 bits


def density_for(nss: int, target_nonzeros: int = DEFAULT_TARGET_NONZEROS) -> int:
    """DT giving about ``target_nonzeros`` expected nonzero coefficients over ``nss`` symbols.

    ``clamp(ceil(16 * target / nss) - 1, 0, 15)``; the expected count is ``nss * (DT+1) / 16``.
    """
    if nss <= 0:
        raise FecError("bad_nss", f"nss={nss}")
    if target_nonzeros <= 0:
        return 0
    dt = -(-16 * target_nonzeros // nss) - 1
    return max(0, min(MAX_DT, dt))


def _check_row_params(repair_key: int, dt: int, nss: int) -> None:
    if not 0 <= repair_key <= MAX_REPAIR_KEY:
        raise FecError("bad_repair_key", f"repair_key={repair_key}")
    if not 0 <= dt <= MAX_DT:
        raise FecError("bad_dt", f"dt={dt}")
    if not 1 <= nss <= MAX_NSS:
        raise FecError("bad_nss", f"nss={nss}")


def coding_coefficients(repair_key: int, dt: int, nss: int) -> U8:
    """RFC 8681 ``generate_coding_coefficients`` (m = 8) as a new uint8[nss] array."""
    _check_row_params(repair_key, dt, nss)
    out = np.zeros(nss, dtype=np.uint8)
    generate_coefficients(repair_key, dt, nss, out)
    return out


def _as_u8(payload: Payload, size: int) -> U8:
    if isinstance(payload, memoryview) and not payload.c_contiguous:
        payload = np.array(payload)  # strided view: its bytes in order (frombuffer refuses it)
    if isinstance(payload, np.ndarray):
        arr = payload
        if arr.dtype != np.uint8 or arr.ndim != 1:
            arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        elif not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
    else:
        arr = np.frombuffer(payload, dtype=np.uint8)
    if arr.shape[0] != size:
        raise FecError("bad_symbol_size", f"got {arr.shape[0]} bytes, want {size}")
    if arr.flags.writeable:
        # One numba signature for every payload kind (bytes give read-only arrays): this
        # halves JIT work and the kernels never write to the payload anyway.
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def _nbytes(payload: Payload) -> int:
    return payload.nbytes if isinstance(payload, (np.ndarray, memoryview)) else len(payload)


def _fast_view(payload: Payload) -> bool:
    """Whether ``payload`` can go to the decoder kernels as it is: a 1-D contiguous memoryview of 1-byte
    items (what the receive path's parser hands over). numba reads such a buffer directly, where
    ``np.frombuffer`` alone would cost about a microsecond per datagram; the kernels check the length."""
    return (
        type(payload) is memoryview and payload.ndim == 1 and payload.itemsize == 1 and payload.c_contiguous
    )


class Encoder:
    """Sliding-window RLC encoder over an ordered, fully known source queue.

    ``symbols`` is the (N, S) uint8 C-contiguous array of source symbols indexed by ESI.
    The sender releases sources in ESI order with :meth:`take_source`, feeds the
    receiver's cumulative decoded prefix to :meth:`on_ack`, and builds repairs over the
    oldest un-acknowledged symbols with :meth:`make_repair`.
    """

    def __init__(
        self,
        symbols: U8,
        window_cap: int = DEFAULT_WINDOW,
        target_nonzeros: int | None = DEFAULT_TARGET_NONZEROS,
        fixed_dt: int | None = None,
        first_repair_key: int = 0,
    ) -> None:
        if not isinstance(symbols, np.ndarray) or symbols.dtype != np.uint8 or symbols.ndim != 2:
            raise ValueError("symbols must be a 2-D uint8 array (N, S)")
        if not symbols.flags.c_contiguous:
            raise ValueError("symbols must be C-contiguous")
        if symbols.shape[1] < 1:
            raise ValueError("symbol size must be >= 1")
        if not 1 <= window_cap <= MAX_NSS:
            raise ValueError(f"window_cap must be in 1..{MAX_NSS}")
        if fixed_dt is not None and not 0 <= fixed_dt <= MAX_DT:
            raise ValueError("fixed_dt must be in 0..15")
        if target_nonzeros is not None and target_nonzeros < 1:
            raise ValueError("target_nonzeros must be >= 1 or None (dense)")
        if not 0 <= first_repair_key <= MAX_REPAIR_KEY:
            raise ValueError("first_repair_key must be a 16-bit value")
        self._symbols = symbols
        self.n_source: int = int(symbols.shape[0])
        self.symbol_size: int = int(symbols.shape[1])
        self.window_cap: int = int(window_cap)
        self.target_nonzeros = target_nonzeros
        self.fixed_dt = fixed_dt
        self.next_esi: int = 0
        self.ack_prefix: int = 0
        self.repairs_made: int = 0
        self.zero_rows_skipped: int = 0
        self._next_key = first_repair_key
        self._cc = np.zeros(self.window_cap, dtype=np.uint8)
        self._acc = np.zeros((8, self.symbol_size), dtype=np.uint8)
        out = np.zeros(self.symbol_size, dtype=np.uint8)
        # Bound for this encoder's argument types (a repair per few packets: skip numba's dispatch).
        self._make_repair = entry_point(
            encoder_make_repair, symbols, 0, 1, 0, 0, self._cc, out, self._acc, True, False
        )
        self._bound_out: U8 | None = None  # the output buffer make_repair last checked for the bound kernel

    @property
    def next_repair_key(self) -> int:
        """Key the next :meth:`make_repair` will try first."""
        return self._next_key

    def take_source(self) -> int:
        """Release the next source symbol and return its ESI (IndexError when none left)."""
        esi = self.next_esi
        if esi >= self.n_source:
            raise IndexError("no source symbols left")
        self.next_esi = esi + 1
        return esi

    def on_ack(self, decoded_prefix: int) -> None:
        """Receiver's cumulative decoded prefix; stale (older) values are ignored."""
        p = min(int(decoded_prefix), self.next_esi)
        if p > self.ack_prefix:
            self.ack_prefix = p

    def window(self) -> tuple[int, int]:
        """(first ESI, count) of the encoding window: the oldest un-acknowledged symbols."""
        first = self.ack_prefix
        return first, min(first + self.window_cap, self.next_esi) - first

    def dt_for(self, nss: int) -> int:
        """Density threshold used for a window of ``nss`` symbols."""
        if self.fixed_dt is not None:
            return self.fixed_dt
        if self.target_nonzeros is None:
            return MAX_DT
        return density_for(nss, self.target_nonzeros)

    def make_repair(
        self,
        out: U8,
        count: int | None = None,
        dt: int | None = None,
        cover_first: bool = True,
        first: int | None = None,
        cover_last: bool = False,
    ) -> RepairId:
        """Encode one repair symbol into ``out`` (uint8[S], in place).

        By default the window is :meth:`window`; ``first``/``count`` place it elsewhere among the
        symbols already sent (the sender aims repairs at the receiver's reported holes), ``dt``
        overrides the density rule. Every call uses a fresh 16-bit repair key (wrapping); a key
        whose RFC 8681 coefficient row is all zero (possible at low DT and small windows) is
        skipped, and with ``cover_first`` so is a key whose row skips the window's first symbol:
        that is a hole the receiver reported, so a sparse repair that misses it is usually wasted.
        ``cover_last`` does the same for the window's last symbol (a region of two holes ends on one).
        """
        if first is None:
            first, full = self.window()
            count = full if count is None else min(count, full)
        elif count is None or first < 0 or first + count > self.next_esi:
            raise ValueError(
                f"repair window [{first}, {first}+{count}) must lie within the {self.next_esi} sent symbols"
            )
        if count <= 0:
            raise FecError("empty_window", f"ack_prefix={self.ack_prefix} next_esi={self.next_esi}")
        if count > self.window_cap:
            raise ValueError(f"repair window of {count} symbols exceeds window_cap {self.window_cap}")
        kernel = self._make_repair
        if out is not self._bound_out:  # a sender passes the same buffer every time: check it once
            if out.dtype != np.uint8 or out.shape != (self.symbol_size,):
                raise ValueError(f"out must be uint8[{self.symbol_size}]")
            # The bound kernel takes exactly a writable C-contiguous ``out``; anything else is dispatched.
            if out.flags.c_contiguous and out.flags.writeable:
                self._bound_out = out
            else:
                kernel = encoder_make_repair
        if dt is None:
            dt = self.dt_for(count)
        elif not 0 <= dt <= MAX_DT:
            raise ValueError(f"dt must be in 0..{MAX_DT}, got {dt!r}")
        key, skipped = kernel(
            self._symbols,
            first,
            count,
            dt,
            self._next_key,
            self._cc,
            out,
            self._acc,
            bool(cover_first),
            bool(cover_last),
        )
        self.zero_rows_skipped += int(skipped)
        if key < 0:
            raise FecError("no_nonzero_row", f"dt={dt} nss={count}")
        key = int(key)
        self._next_key = (key + 1) & MAX_REPAIR_KEY
        self.repairs_made += 1
        return RepairId(key, dt, count, first)


class Decoder:
    """On-the-fly Gaussian elimination decoder (reduced row echelon form).

    Source symbols go straight into :attr:`store`. A repair has every known symbol
    substituted out, is reduced against the pivot rows held, and, if innovative, is
    normalised, back-substituted and installed; rows that become singletons are
    delivered at once (partial delivery, see :attr:`newly_decoded`).
    """

    def __init__(self, n_source: int, symbol_size: int, window_cap: int = DEFAULT_WINDOW) -> None:
        if n_source < 0 or symbol_size < 1:
            raise ValueError("n_source must be >= 0 and symbol_size >= 1")
        if not 1 <= window_cap <= MAX_NSS:
            raise ValueError(f"window_cap must be in 1..{MAX_NSS}")
        self.n_source: int = int(n_source)
        self.symbol_size: int = int(symbol_size)
        self.window_cap: int = int(window_cap)
        self.store: U8 = np.zeros((n_source, symbol_size), dtype=np.uint8)
        self.have: npt.NDArray[np.bool_] = np.zeros(n_source, dtype=np.bool_)
        cap = self.window_cap
        self._coef = np.zeros((cap, cap), dtype=np.uint8)
        self._pay = np.zeros((cap, symbol_size), dtype=np.uint8)
        self._ist = np.zeros(decoder_kernels.decoder_state_len(cap), dtype=np.int64)
        self._bscr = np.zeros(2 * cap, dtype=np.uint8)
        self._acc = np.zeros((8, symbol_size), dtype=np.uint8)
        self._source_args = (self.store, self.have, self._coef, self._pay, self._ist)
        self._repair_args = (*self._source_args, self._bscr, self._acc)
        # Kernels bound per payload type (byte memoryview, read-only array: see _fast_view): one insert per
        # datagram, where numba's type dispatch would cost as much as the insert.
        view = memoryview(bytes(symbol_size))
        array = _as_u8(np.zeros(symbol_size, dtype=np.uint8), symbol_size)
        self._add_source_view = entry_point(decoder_kernels.decoder_add_source, 0, view, *self._source_args)
        self._add_source_array = entry_point(decoder_kernels.decoder_add_source, 0, array, *self._source_args)
        self._add_repair_view = entry_point(
            decoder_kernels.decoder_add_repair, 0, 0, 1, 0, view, *self._repair_args
        )
        self._add_repair_array = entry_point(
            decoder_kernels.decoder_add_repair, 0, 0, 1, 0, array, *self._repair_args
        )
        self._ack_snapshot: Callable[..., tuple[int, int, int, int, int, int]] | None = None
        self._checked_holes_out: U8 | None = None  # the buffer (and span) ack_snapshot last validated
        self._checked_span = -1

    # --- state ---------------------------------------------------------------------------

    @property
    def decoded_prefix(self) -> int:
        """First undecoded ESI (cumulative ACK point)."""
        return int(self._ist[decoder_kernels.ST_PREFIX])

    @property
    def decoded_count(self) -> int:
        return int(self._ist[decoder_kernels.ST_DECODED])

    @property
    def seen_end(self) -> int:
        """One past the highest ESI seen in a source or covered by a repair window."""
        return int(self._ist[decoder_kernels.ST_SEEN])

    @property
    def rank(self) -> int:
        """Independent equations held (pivot rows)."""
        return int(self._ist[decoder_kernels.ST_RANK])

    @property
    def unknowns(self) -> int:
        """Undecoded ESIs in ``[decoded_prefix, seen_end)``."""
        return int(self._ist[decoder_kernels.ST_UNKNOWNS])

    @property
    def deficit(self) -> int:
        """Equations still missing: ``max(0, unknowns - rank)``."""
        return max(0, self.unknowns - self.rank)

    @property
    def redundant(self) -> int:
        """Repairs that brought no new equation."""
        return int(self._ist[decoder_kernels.ST_REDUNDANT])

    @property
    def newly_decoded(self) -> npt.NDArray[np.int64]:
        """ESIs delivered by the last ``add_*`` call (a view, valid until the next call)."""
        n = int(self._ist[decoder_kernels.ST_NNEW])
        return self._ist[decoder_kernels.ST_HEADER : decoder_kernels.ST_HEADER + n]

    @property
    def complete(self) -> bool:
        return self.decoded_prefix >= self.n_source

    def decoded_esis(self) -> npt.NDArray[np.int64]:
        """All decoded ESIs, ascending."""
        return np.flatnonzero(self.have).astype(np.int64, copy=False)

    def ack_snapshot(self, span: int, holes_out: U8) -> tuple[int, int, int, int, int, int]:
        """(decoded prefix, seen end, decoded count, unknowns, deficit, hole bits) for an ACK, with the map
        of undecoded ESIs over [prefix, min(prefix + span, seen end)) packed MSB first into ``holes_out``
        (uint8, C-contiguous, at least ceil(span / 8) bytes). One compiled call: it runs for every ACK."""
        if holes_out is not self._checked_holes_out or span != self._checked_span:  # same buffer each ACK
            if (
                holes_out.dtype != np.uint8
                or holes_out.ndim != 1
                or len(holes_out) * 8 < span
                or not (holes_out.flags.c_contiguous and holes_out.flags.writeable)
            ):
                raise ValueError(f"holes_out must be a writable C-contiguous uint8[>= {(span + 7) // 8}]")
            self._checked_holes_out, self._checked_span = holes_out, span
        kernel = self._ack_snapshot
        if kernel is None:
            kernel = entry_point(decoder_kernels.decoder_ack_snapshot, self.have, self._ist, span, holes_out)
            self._ack_snapshot = kernel
        return cast(tuple[int, int, int, int, int, int], kernel(self.have, self._ist, span, holes_out))

    # --- inserts -------------------------------------------------------------------------

    def add_source(self, esi: int, payload: Payload) -> int:
        """Insert a source symbol; returns the number of newly decoded symbols (0 if duplicate)."""
        if _fast_view(payload):
            n = self._add_source_view(esi, payload, *self._source_args)
        else:
            n = self._add_source_array(esi, _as_u8(payload, self.symbol_size), *self._source_args)
        if n < 0:  # the kernel checked the input and changed nothing
            if n == decoder_kernels.INSERT_BAD_ESI:
                raise FecError("esi_out_of_range", f"esi={esi} n_source={self.n_source}")
            raise FecError(
                "bad_symbol_size", f"got {_nbytes(payload)} bytes, want {self.symbol_size}"
            )
        return int(n)

    def add_repair(self, rid: RepairId, payload: Payload) -> int:
        """Insert a repair symbol; returns the number of newly decoded symbols."""
        return self.add_repair_fields(rid.repair_key, rid.dt, rid.nss, rid.fss_esi, payload)

    def add_repair_fields(self, repair_key: int, dt: int, nss: int, fss_esi: int, payload: Payload) -> int:
        """:meth:`add_repair` with the Repair FEC Payload ID as plain fields (the receive path's form)."""
        if _fast_view(payload):
            n = self._add_repair_view(repair_key, dt, nss, fss_esi, payload, *self._repair_args)
        else:
            arr = _as_u8(payload, self.symbol_size)
            n = self._add_repair_array(repair_key, dt, nss, fss_esi, arr, *self._repair_args)
        if n < 0:
            raise self._repair_error(repair_key, dt, nss, fss_esi, payload)
        return int(n)

    def _repair_error(self, key: int, dt: int, nss: int, fss: int, payload: Payload) -> FecError:
        """The reason the kernel refused a repair, named after its first bad field."""
        if not 0 <= key <= MAX_REPAIR_KEY:
            return FecError("bad_repair_key", f"repair_key={key}")
        if not 0 <= dt <= MAX_DT:
            return FecError("bad_dt", f"dt={dt}")
        if not 1 <= nss <= self.window_cap:
            return FecError("bad_nss", f"nss={nss} window_cap={self.window_cap}")
        if fss < 0 or fss + nss > self.n_source:
            return FecError("esi_out_of_range", f"fss_esi={fss} nss={nss} n_source={self.n_source}")
        size = _nbytes(payload)
        if size != self.symbol_size:
            return FecError("bad_symbol_size", f"got {size} bytes, want {self.symbol_size}")
        return FecError(
            "window_overflow",
            f"fss_esi={fss} nss={nss} decoded_prefix={self.decoded_prefix} cap={self.window_cap}",
        )


def warm_up() -> None:
    """Compile, or load from numba's on-disk cache, every kernel variant the codec uses.

    Payloads given as ``bytes``/``memoryview`` (read-only) and as writable arrays are
    distinct numba signatures; each is compiled on first use (seconds) and cached on
    disk afterwards (milliseconds to load). Call this at process start so that the
    first packet of a session does not pay for it.
    """
    size = 16
    syms = (np.arange(6 * size, dtype=np.int64) * 37 % 251).astype(np.uint8).reshape(6, size)
    out = np.zeros(size, dtype=np.uint8)
    kinds: list[Callable[[U8], Payload]] = [
        lambda a: a,
        lambda a: a.tobytes(),
        lambda a: memoryview(a.tobytes()),
        lambda a: bytearray(a.tobytes()),
    ]
    for kind in kinds:
        enc = Encoder(syms, window_cap=6, target_nonzeros=None)
        dec = Decoder(6, size, window_cap=6)
        for _ in range(6):
            esi = enc.take_source()
            if esi % 2:
                dec.add_source(esi, kind(syms[esi]))
        for _ in range(3):
            rid = enc.make_repair(out)
            dec.add_repair(rid, kind(out))
        if not dec.complete or not np.array_equal(dec.store, syms):
            raise AssertionError("codec self-test failed during warm-up")
    coding_coefficients(1, 3, 8)
    Decoder(16, 4).ack_snapshot(16, np.zeros(2, dtype=np.uint8))  # every ACK
