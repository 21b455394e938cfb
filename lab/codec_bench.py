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
    lost = np.asarray(lost, dtype=np.bool_)
    n_slots = int(lost.shape[0])
    if n_source is None:
        n_source = max(1, n_slots // 3)
    _warm_up()
    rng = np.random.default_rng(seed)
    syms = rng.integers(0, 256, (n_source, symbol_size), dtype=np.uint8)
    enc = Encoder(syms, window_cap=window_cap, target_nonzeros=target_nonzeros)
    dec = Decoder(n_source, symbol_size, window_cap)
    out = np.zeros(symbol_size, dtype=np.uint8)

    rep_prefix = np.zeros(n_slots, dtype=np.int64)
    rep_deficit = np.zeros(n_slots, dtype=np.int64)
    repair_sent = np.zeros(n_slots + 1, dtype=np.int64)  # cumulative repairs sent before slot t
    times = np.empty(n_slots, dtype=np.int64)
    innovative = np.zeros(n_slots, dtype=np.bool_)
    src_times = np.empty(n_slots, dtype=np.int64)
    n_times = 0
    n_src_times = 0
    since_repair = 0
    sent_sources = sent_repairs = proactive = reactive = 0
    clock = time.perf_counter_ns
    slots_used = 0
    for t in range(n_slots):
        if dec.complete:
            break
        slots_used = t + 1
        td = t - feedback_delay
        if td >= 0:
            enc.on_ack(int(rep_prefix[td]))
            est = int(rep_deficit[td]) - int(repair_sent[t] - repair_sent[td + 1])
        else:
            est = 0
        count = enc.window()[1]
        send_repair = False
        if count > 0:
            if est > 0:
                send_repair = True
                reactive += 1
            elif since_repair >= repair_every:
                send_repair = True
                proactive += 1
        if send_repair:
            rid = enc.make_repair(out)
            since_repair = 0
            sent_repairs += 1
            repair_sent[t + 1] = repair_sent[t] + 1
            if not lost[t]:
                red0 = dec.redundant
                t0 = clock()
                dec.add_repair(rid, out)
                times[n_times] = clock() - t0
                innovative[n_times] = dec.redundant == red0
                n_times += 1
        else:
            repair_sent[t + 1] = repair_sent[t]
            if enc.next_esi < n_source and (
                max_in_flight is None or enc.next_esi - enc.ack_prefix < max_in_flight
            ):
                esi = enc.take_source()
                since_repair += 1
                sent_sources += 1
                if not lost[t]:
                    t0 = clock()
                    dec.add_source(esi, syms[esi])
                    src_times[n_src_times] = clock() - t0
                    n_src_times += 1
            else:
                since_repair += 1  # idle slot: counts towards the next proactive repair (probe)
        p = dec.decoded_prefix
        hi = min(p + window_cap, dec.seen_end)
        w_unknown = hi - p - int(np.count_nonzero(dec.have[p:hi])) if hi > p else 0
        rep_prefix[t] = p
        rep_deficit[t] = max(0, w_unknown - dec.rank)

    have = dec.have
    if not np.array_equal(dec.store[have], syms[have]):
        raise AssertionError("decoder delivered corrupt symbols")
    ts = times[:n_times].astype(np.float64) / 1e3
    ti = ts[innovative[:n_times]]
    ss = src_times[:n_src_times].astype(np.float64) / 1e3
    return {
        "decode_insert_us_mean": float(ts.mean()) if ts.size else 0.0,
        "decode_insert_us_p99": float(np.percentile(ts, 99)) if ts.size else 0.0,
        "decode_insert_us_median": float(np.median(ts)) if ts.size else 0.0,
        "decode_insert_innovative_us_mean": float(ti.mean()) if ti.size else 0.0,
        "decode_insert_innovative_us_p99": float(np.percentile(ti, 99)) if ti.size else 0.0,
        "decode_source_us_mean": float(ss.mean()) if n_src_times else 0.0,
        "repairs_received": float(n_times),
        "repairs_redundant": float(dec.redundant),
        "repairs_sent": float(sent_repairs),
        "repairs_reactive": float(reactive),
        "repairs_proactive": float(proactive),
        "sources_sent": float(sent_sources),
        "slots_used": float(slots_used),
        "loss_rate": float(lost[:slots_used].mean()) if slots_used else 0.0,
        "decoded_fraction": float(dec.decoded_count) / float(n_source),
        "complete": float(dec.complete),
        "dense": float(target_nonzeros is None),
    }
