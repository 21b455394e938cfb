"""Micro-benchmarks of the RLC codec (used by ``pfec bench codec``).

Timings use ``time.perf_counter_ns`` around single calls with the numba kernels warmed
up first, so they include the Python glue a real sender/receiver pays per packet.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

from pfec.common.codec import gf256
from pfec.common.codec.fec import DEFAULT_TARGET_NONZEROS, DEFAULT_WINDOW, Decoder, Encoder, warm_up

__all__ = ["bench_decode_insert", "bench_encode", "bench_region_muladd", "ge_loss_mask"]

ENCODE_CASES: dict[str, tuple[int, int | None]] = {
    # name: (window, fixed DT or None for the density rule with target 8)
    "k16_dense": (16, 15),
    "k64_dense": (64, 15),
    "k64_sparse8": (64, None),
}


def ge_loss_mask(
    n: int,
    eps_g: float = 0.001,
    eps_b: float = 0.5,
    p_gb: float = 0.02,
    p_bg: float = 0.10,
    seed: int = 0,
) -> npt.NDArray[np.bool_]:
    """Gilbert-Elliott loss realisation (True = lost), starting in the good state."""
    rng = np.random.default_rng(seed)
    u_state = rng.random(n)
    u_loss = rng.random(n)
    lost = np.zeros(n, dtype=np.bool_)
    bad = False
    for t in range(n):
        lost[t] = u_loss[t] < (eps_b if bad else eps_g)
        bad = (u_state[t] >= p_bg) if bad else (u_state[t] < p_gb)
    return lost


def _warm_up() -> None:
    """Compile (or load from cache) every kernel the benchmarks call."""
    warm_up()
    a = np.zeros(24, dtype=np.uint8)
    gf256.region_muladd(a, a.copy(), 7)


def bench_region_muladd(symbol_size: int = 1362, repeats: int = 20000) -> dict[str, float]:
    """Median and mean microseconds of one ``region_muladd`` call from Python."""
    _warm_up()
    rng = np.random.default_rng(2)
    dst = rng.integers(0, 256, symbol_size, dtype=np.uint8)
    src = rng.integers(0, 256, symbol_size, dtype=np.uint8)
    samples = np.empty(repeats, dtype=np.int64)
    clock = time.perf_counter_ns
    fn = gf256.region_muladd
    for i in range(repeats):
        c = (i % 254) + 2
        t0 = clock()
        fn(dst, src, c)
        samples[i] = clock() - t0
    return {
        "region_muladd_us_median": float(np.median(samples)) / 1e3,
        "region_muladd_us_mean": float(samples.mean()) / 1e3,
    }


def bench_encode(symbol_size: int = 1362, repeats: int = 2000) -> dict[str, float]:
    """Median microseconds per repair symbol (``Encoder.make_repair``, key generation included).

    Cases: ``k16_dense`` (window 16, DT=15), ``k64_dense`` (window 64, DT=15) and
    ``k64_sparse8`` (window 64, density rule with target 8 nonzeros, i.e. DT=1).
    """
    _warm_up()
    rng = np.random.default_rng(3)
    clock = time.perf_counter_ns
    result: dict[str, float] = {}
    for name, (k, dt) in ENCODE_CASES.items():
        syms = rng.integers(0, 256, (k, symbol_size), dtype=np.uint8)
        enc = Encoder(syms, window_cap=k, target_nonzeros=DEFAULT_TARGET_NONZEROS, fixed_dt=dt)
        for _ in range(k):
            enc.take_source()
        out = np.zeros(symbol_size, dtype=np.uint8)
        for _ in range(min(50, repeats)):
            enc.make_repair(out)
        samples = np.empty(repeats, dtype=np.int64)
        for i in range(repeats):
            t0 = clock()
            enc.make_repair(out)
            samples[i] = clock() - t0
        result[name] = float(np.median(samples)) / 1e3
    return result


def bench_decode_insert(
    lost: npt.NDArray[np.bool_],
    symbol_size: int = 1362,
    window_cap: int = DEFAULT_WINDOW,
    repair_every: int = 16,
    feedback_delay: int = 180,
    target_nonzeros: int | None = None,
    n_source: int | None = None,
    max_in_flight: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Time ``Decoder.add_repair`` over a stream driven by a per-slot loss mask.

    The stream: slot ``t`` carries at most one packet, dropped iff ``lost[t]`` (forward
    delay is not modelled; only the feedback is late). After every slot the receiver
    reports ``(decoded_prefix, window deficit)``, the window deficit being the undecoded
    ESIs in ``[decoded_prefix, min(decoded_prefix + window_cap, seen_end))`` minus
    ``Decoder.rank`` (the part a repair can act on). The sender sees the report made
    ``feedback_delay`` slots earlier (180 ~ one 20 ms RTT of 1362-byte packets at
    100 Mbit/s; the feedback path is lossless). Each slot the sender:

    1. applies the delayed ACK (``Encoder.on_ack``), so its window ``[ack_prefix,
       ack_prefix + window_cap)`` starts at a stale prefix;
    2. sends a repair if its deficit estimate (reported window deficit minus the
       repairs it sent since that report) is positive ("reactive");
    3. else sends a repair once ``repair_every`` sources (or idle slots) went out since
       the last repair ("proactive"; after the last source it doubles as a probe);
    4. else sends the next source, unless all are out or ``max_in_flight`` (sources
       beyond the ACK point; None = unlimited) stops it; then the slot stays idle.

    ``n_source`` defaults to a third of the slots so the stream normally completes. The
    stream stops when the decoder is complete or the mask is exhausted. Only the repair
    inserts that reach the decoder are timed (Python call and validation included); the
    decoded data is checked against the source at the end.

    Density: ``target_nonzeros=None`` (default) sends dense repairs (DT=15), the costly
    case for the decoder (every known symbol in the window is substituted out). With the
    density rule (e.g. 8) a window-64 repair touches ~8 symbols: inserts get cheaper, but
    a repair then covers a given lost symbol with probability ~1/8, so under this
    ACK-anchored window most repairs are redundant and the stream may not complete
    (see the ``repairs_redundant``, ``decoded_fraction`` and ``complete`` entries).

    Returns ``decode_insert_us_mean`` and ``decode_insert_us_p99`` (all timed repair
    inserts), median and innovative-only figures, and stream counters (as floats).
    """
    stream = _DecodeInsertStream(np.asarray(lost, dtype=np.bool_), symbol_size, window_cap, repair_every,
                                 feedback_delay, target_nonzeros, n_source, max_in_flight, seed)
    stream.run()
    return stream.result()


class _DecodeInsertStream:
    """The sender, lossy slots and receiver of ``bench_decode_insert``, one slot at a time."""

    def __init__(self, lost: npt.NDArray[np.bool_], symbol_size: int, window_cap: int, repair_every: int,
                 feedback_delay: int, target_nonzeros: int | None, n_source: int | None,
                 max_in_flight: int | None, seed: int) -> None:
        self.lost = lost
        n_slots = int(lost.shape[0])
        self.n_source = max(1, n_slots // 3) if n_source is None else n_source
        self.window_cap = window_cap
        self.repair_every = repair_every
        self.feedback_delay = feedback_delay
        self.max_in_flight = max_in_flight
        self.dense = target_nonzeros is None
        _warm_up()
        rng = np.random.default_rng(seed)
        self.syms = rng.integers(0, 256, (self.n_source, symbol_size), dtype=np.uint8)
        self.enc = Encoder(self.syms, window_cap=window_cap, target_nonzeros=target_nonzeros)
        self.dec = Decoder(self.n_source, symbol_size, window_cap)
        self.out = np.zeros(symbol_size, dtype=np.uint8)
        # The receiver's report after each slot, read by the sender feedback_delay slots later.
        self.rep_prefix = np.zeros(n_slots, dtype=np.int64)
        self.rep_deficit = np.zeros(n_slots, dtype=np.int64)
        self.repair_sent = np.zeros(n_slots + 1, dtype=np.int64)  # cumulative repairs sent before slot t
        self.times = np.empty(n_slots, dtype=np.int64)  # timed repair inserts (ns)
        self.innovative = np.zeros(n_slots, dtype=np.bool_)
        self.src_times = np.empty(n_slots, dtype=np.int64)  # timed source inserts (ns)
        self.n_times = self.n_src_times = 0
        self.since_repair = 0
        self.sent_sources = self.sent_repairs = self.proactive = self.reactive = 0
        self.slots_used = 0

    def run(self) -> None:
        for t in range(int(self.lost.shape[0])):
            if self.dec.complete:
                break
            self.slots_used = t + 1
            if self._wants_repair(self._deficit_estimate(t)):
                self._send_repair(t)
            else:
                self._send_source_or_idle(t)
            self._report(t)

    def _deficit_estimate(self, t: int) -> int:
        """Apply the ACK sent ``feedback_delay`` slots ago; the window deficit it reported minus the repairs
        sent since."""
        td = t - self.feedback_delay
        if td < 0:
            return 0
        self.enc.on_ack(int(self.rep_prefix[td]))
        return int(self.rep_deficit[td]) - int(self.repair_sent[t] - self.repair_sent[td + 1])

    def _wants_repair(self, est: int) -> bool:
        if self.enc.window()[1] <= 0:
            return False
        if est > 0:
            self.reactive += 1
            return True
        if self.since_repair >= self.repair_every:
            self.proactive += 1
            return True
        return False

    def _send_repair(self, t: int) -> None:
        rid = self.enc.make_repair(self.out)
        self.since_repair = 0
        self.sent_repairs += 1
        self.repair_sent[t + 1] = self.repair_sent[t] + 1
        if not self.lost[t]:
            dec, out, clock = self.dec, self.out, time.perf_counter_ns  # locals: no lookups inside the timing
            red0 = dec.redundant
            t0 = clock()
            dec.add_repair(rid, out)
            self.times[self.n_times] = clock() - t0
            self.innovative[self.n_times] = dec.redundant == red0
            self.n_times += 1

    def _send_source_or_idle(self, t: int) -> None:
        enc = self.enc
        self.repair_sent[t + 1] = self.repair_sent[t]
        self.since_repair += 1  # an idle slot counts towards the next proactive repair (probe) too
        if enc.next_esi < self.n_source and (
            self.max_in_flight is None or enc.next_esi - enc.ack_prefix < self.max_in_flight
        ):
            esi = enc.take_source()
            self.sent_sources += 1
            if not self.lost[t]:
                dec, syms, clock = self.dec, self.syms, time.perf_counter_ns
                t0 = clock()
                dec.add_source(esi, syms[esi])
                self.src_times[self.n_src_times] = clock() - t0
                self.n_src_times += 1

    def _report(self, t: int) -> None:
        """The receiver's ACK after slot ``t``: decoded prefix and the window deficit a repair can act on."""
        dec = self.dec
        p = dec.decoded_prefix
        hi = min(p + self.window_cap, dec.seen_end)
        w_unknown = hi - p - int(np.count_nonzero(dec.have[p:hi])) if hi > p else 0
        self.rep_prefix[t] = p
        self.rep_deficit[t] = max(0, w_unknown - dec.rank)

    def result(self) -> dict[str, float]:
        dec = self.dec
        have = dec.have
        if not np.array_equal(dec.store[have], self.syms[have]):
            raise AssertionError("decoder delivered corrupt symbols")
        ts = self.times[: self.n_times].astype(np.float64) / 1e3
        ti = ts[self.innovative[: self.n_times]]
        ss = self.src_times[: self.n_src_times].astype(np.float64) / 1e3
        slots_used = self.slots_used
        return {
            "decode_insert_us_mean": float(ts.mean()) if ts.size else 0.0,
            "decode_insert_us_p99": float(np.percentile(ts, 99)) if ts.size else 0.0,
            "decode_insert_us_median": float(np.median(ts)) if ts.size else 0.0,
            "decode_insert_innovative_us_mean": float(ti.mean()) if ti.size else 0.0,
            "decode_insert_innovative_us_p99": float(np.percentile(ti, 99)) if ti.size else 0.0,
            "decode_source_us_mean": float(ss.mean()) if self.n_src_times else 0.0,
            "repairs_received": float(self.n_times),
            "repairs_redundant": float(dec.redundant),
            "repairs_sent": float(self.sent_repairs),
            "repairs_reactive": float(self.reactive),
            "repairs_proactive": float(self.proactive),
            "sources_sent": float(self.sent_sources),
            "slots_used": float(slots_used),
            "loss_rate": float(self.lost[:slots_used].mean()) if slots_used else 0.0,
            "decoded_fraction": float(dec.decoded_count) / float(self.n_source),
            "complete": float(dec.complete),
            "dense": float(self.dense),
        }
