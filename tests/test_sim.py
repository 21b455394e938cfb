"""The slot simulator: determinism, pairing, the channel-consistency checks of issue 2, the CLI contract."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pfec.common.sched.policies import get_scheme
from pfec.lab.bench.drivers import OVERHEAD_PARTS, measure_overhead
from pfec.lab.reporting.stats import mean_ci95
from pfec.lab.sim.channel import MAIN_GE, Bernoulli
from pfec.lab.sim.simulate import SimConfig, prepare, run_once, run_scheme, simulate

ROOT = Path(__file__).resolve().parent.parent


def small(**kw: object) -> SimConfig:
    base: dict[str, object] = {"loss": MAIN_GE, "rho": 0.8, "tokens": 256}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_same_seed_same_result_other_seed_differs() -> None:
    a = simulate(small(seed=3), ["heuristic"], 2)
    b = simulate(small(seed=3), ["heuristic"], 2)
    c = simulate(small(seed=4), ["heuristic"], 2)

    def strip(report: dict[str, Any]) -> dict[str, Any]:
        timing = ("wall", "cpu")
        return {k: v for k, v in report["schemes"]["heuristic"].items() if not k.startswith(timing)}

    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_schemes_meet_the_same_losses() -> None:
    handoff = prepare(small(rho=0.6))
    udp = run_once(handoff, get_scheme("udp"), 0)
    pri = run_once(handoff, get_scheme("priority"), 0)
    # Same number of data datagrams in the same slots -> the very same erasures.
    assert udp.source_sent == pri.source_sent
    assert udp.forward_lost == pri.forward_lost
    assert udp.decoded_symbols == pri.decoded_symbols
    # ... but the utility-ordered stream keeps more of the profile's utility.
    assert pri.recovered_utility > udp.recovered_utility


def test_lossless_link_delivers_what_the_deadline_allows() -> None:
    r = run_once(prepare(small(loss=Bernoulli(0.0), rho=1.1)), get_scheme("heuristic"), 0)
    assert r.recovered_symbol_fraction == 1.0 and r.recovered_utility == pytest.approx(1.0)
    assert r.repair_sent == 0 and r.failure is None
    r = run_once(prepare(small(loss=Bernoulli(0.0), rho=0.5)), get_scheme("udp"), 0)
    assert 0.40 < r.recovered_symbol_fraction < 0.50  # rho 0.5 of the KV bytes, less framing


@pytest.mark.slow
def test_main_ge_rho_1_2_heuristic_recovers_nearly_all_udp_loses_the_channel_rate() -> None:
    """Issue 2: at the main GE config, rho 1.2, 1536 tokens."""
    result = simulate(SimConfig(loss=MAIN_GE, rho=1.2, tokens=1536), ["udp", "heuristic"], 2)
    udp = result["schemes"]["udp"]["recovered_symbol_fraction_mean"]
    heuristic = result["schemes"]["heuristic"]["recovered_symbol_fraction_mean"]
    assert heuristic >= 0.99
    assert abs(udp - (1 - MAIN_GE.mean_loss)) < 0.03


def test_mean_ci95() -> None:
    mean, (lo, hi) = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and lo < 2.0 < hi
    assert mean_ci95([5.0]) == (5.0, (5.0, 5.0))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pfec.cli.app", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_cli_json_contract() -> None:
    out = run_cli(
        "sim", "--scheme", "udp,heuristic", "--rho", "0.8", "--loss", "ge:0.001,0.5,0.02,0.1",
        "--rate-mbps", "100", "--rtt-ms", "20", "--tokens", "128", "--realizations", "2", "--seed", "5",
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["inputs"]["tokens"] == 128 and data["inputs"]["realizations"] == 2
    for name in ("udp", "heuristic"):
        s = data["schemes"][name]
        for key in (
            "recovered_utility_mean",
            "recovered_utility_ci95",
            "recovered_symbol_fraction_mean",
            "source_sent_mean",
            "repair_sent_mean",
        ):
            assert key in s
    assert data["schemes"]["udp"]["repair_sent_mean"] == 0


def test_a_quantised_precision_sends_the_piece_plans_symbols_and_credits_blocks_by_level() -> None:
    """Same deadline (the native cache's), fewer symbols; on a lossless link the int4 stream fits where the
    native cache does not, every block reaches int4 and is credited at int4's fidelity; under loss the
    reference schemes score by level too, and native results carry no precision fields."""
    native = simulate(small(loss=Bernoulli(0.0), rho=0.5), ["udp", "oracle"], 1)
    int4 = simulate(small(loss=Bernoulli(0.0), rho=0.5, precision="int4"), ["udp", "oracle"], 1)
    assert int4["inputs"]["deadline_ms"] == native["inputs"]["deadline_ms"]
    assert int4["inputs"]["stream_symbols"] < 0.5 * native["inputs"]["n_source"]
    assert "precision" not in native["inputs"]
    assert "recovered_block_utility_mean" not in native["schemes"]["udp"]
    for name in ("udp", "oracle"):
        assert native["schemes"][name]["recovered_utility_mean"] < 0.8
        s = int4["schemes"][name]
        assert s["recovered_block_utility_mean"] == pytest.approx(1.0)
        # int4's fidelity is below 1 in every layer group of the shipped table
        assert 0.9 < s["recovered_utility_mean"] < s["recovered_block_utility_mean"] - 1e-4, s
    lossy = simulate(small(rho=0.5, precision="int8"), ["udp", "heuristic", "arq", "oracle"], 2)
    for s in lossy["schemes"].values():
        assert s["recovered_utility_mean"] <= s["recovered_block_utility_mean"] + 1e-12
    out = run_cli("sim", "--scheme", "udp", "--tokens", "128", "--realizations", "1", "--precision", "int2",
                  "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["inputs"]["precision"] == "int2"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--precision", "int3"], "int3"),
        (["--loss", "gauss:0.1"], "gauss"),
        (["--loss", "ge:0.1,0.5"], "ge:"),
        (["--scheme", "tcp"], "unknown scheme 'tcp'"),
        (["--rho", "-1"], "rho"),
        (["--profile", "/nonexistent.json"], "/nonexistent.json"),
        (["--repair-budget", "all"], "--repair-budget: repair budget 'all'"),
        (["--repair-budget", "-0.5"], "must be in 0..10"),
        (["--repair-budget", "nan"], "must be in 0..10"),
        (["--scheme", "udp@deadline2"], "unknown scheme 'udp@deadline2'"),
    ],
)
def test_cli_bad_input_names_the_value(args: list[str], needle: str) -> None:
    out = run_cli("sim", "--tokens", "64", "--realizations", "1", *args)
    assert out.returncode == 2
    assert needle in out.stderr


def test_a_handoff_whose_offer_never_arrives_fails_with_zero_utility() -> None:
    """Every datagram lost, the OFFER's retries included: the receiver never knows the session. The
    simulator reports a failed handoff (utility 0, the sender's reason), not an internal error."""
    handoff = prepare(SimConfig(loss=Bernoulli(1.0), rho=0.5, tokens=32))
    result = run_once(handoff, get_scheme("heuristic"), 0)
    assert result.recovered_utility == 0.0 and result.decoded_symbols == 0
    assert result.failure is not None and "never got the OFFER" in result.failure
    assert not result.recovered_blocks.any() and len(result.recovered_blocks) == handoff.plan.n_blocks


def test_overhead_benchmark_reports_the_median_handoff() -> None:
    seen: list[tuple[int, int]] = []
    result = measure_overhead(3, lambda done, total: seen.append((done, total)))
    totals = result["overhead_per_handoff_ms_per_1k_packets"]
    assert len(totals) == 3 and all(t > 0 for t in totals)
    assert result["overhead_ms_per_1k_packets"] == sorted(totals)[1]
    breakdown = result["overhead_breakdown_ms_per_1k_packets"]
    assert set(breakdown) == set(OVERHEAD_PARTS) and all(v > 0 for v in breakdown.values())
    assert sum(breakdown.values()) == pytest.approx(result["overhead_ms_per_1k_packets"])
    assert seen == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(ValueError, match="realizations"):
        measure_overhead(0)


# --- split and local modes (lab/sim/split.py) -----------------------------------------------------------


def test_a_split_sender_stops_sending_blocks_the_receiver_reports_computed() -> None:
    # A slow link (T_ser ~ 5.6 s for 512 tokens at 2 Mbit/s) against a front that computes the whole context
    # in about 1 s: the receiver's ACKs report computed_tokens and the real sender drops computed blocks.
    from pfec.common.plan.stream import symbol_token_ends

    cfg = small(loss=Bernoulli(0.0), rho=1.0, tokens=512, rate_mbps=2.0, precision="int8", mode="split",
                meeting_token=0)
    handoff = prepare(cfg)
    stream = handoff.stream("utility")
    assert stream is not None
    r = run_once(handoff, get_scheme("priorityfec"), 0)
    assert r.sources_dropped > 0  # the sender acted on computed_tokens
    assert r.source_sent + r.sources_dropped == stream.n_symbols  # a dropped symbol is never sent
    assert r.computed_tokens == 512 and r.recovered_utility == pytest.approx(1.0)
    # Started well before the deadline, and every decoded symbol the front had not already computed
    # at the start carries tokens past it (nothing was needed for the computed prefix).
    assert r.start_s is not None and r.start_s < handoff.deadline_s / 2
    assert r.decoded_ids is not None
    ends = symbol_token_ends(stream)
    assert len(r.decoded_ids) == r.decoded_symbols and ends[r.decoded_ids].max() <= 512


@pytest.mark.parametrize("precision", ["int4", "native"])
def test_split_credits_the_computed_front_as_exact_and_streams_the_back_first(precision: str) -> None:
    handoff = prepare(small(rho=0.5, tokens=512, rate_mbps=20.0, precision=precision, mode="split",
                            meeting_token=256))
    stream = handoff.stream("utility")
    send = handoff.send_queue("utility")
    n_token_blocks = handoff.plan.n_token_blocks
    blocks = send.blocks_in_send_order() % n_token_blocks
    n_back = int((blocks >= 256 // 16).sum())
    assert (blocks[:n_back] >= 16).all() and (blocks[n_back:] < 16).all()  # the back, then the front
    assert (np.diff(blocks[n_back:]) <= 0).all() and (stream is None) == (precision == "native")
    r = run_once(handoff, get_scheme("priorityfec"), 0)
    assert r.computed_tokens >= 256
    token_block = np.arange(handoff.plan.n_blocks) % n_token_blocks
    front = token_block < r.computed_tokens // 16
    assert r.recovered_blocks[front].all()  # computed blocks count as exact, nothing of them streamed
    assert r.recovered_utility >= float(handoff.block_utility[front].sum())


def test_a_split_front_ends_its_last_chunk_where_the_stream_meets_it() -> None:
    """A meeting token planned too far up for this link (768 of 1024 tokens at 30 Mbit/s): the stream brings
    the front's region from 768 down before the front gets there, so the chunk after 512 ends where the two
    meet. The planned chunks would compute to 768 (the session waits at 512 for the tokens up to it)."""
    from pfec.lab.sim.split import DEFAULT_RECEIVER, front_schedule

    handoff = prepare(small(loss=Bernoulli(0.0), rho=1.0, tokens=1024, rate_mbps=30.0, precision="int8",
                            mode="split", meeting_token=768))
    r = run_once(handoff, get_scheme("priorityfec"), 0)
    planned = dict((tokens, at) for at, tokens in front_schedule(DEFAULT_RECEIVER.prefill, 1024, 768))
    assert r.start_s is not None and 512 < r.computed_tokens < 768
    assert r.start_s < planned[768]  # before the planned chunks reach the meeting token (from the OFFER on)
    assert r.recovered_utility == pytest.approx(1.0, abs=1e-4)  # int8's fidelity: all of it arrived


def test_local_ttft_is_the_speed_models_prefill_time() -> None:
    from pfec.lab.sim.split import DEFAULT_RECEIVER, FRONT_CHUNK_TOKENS

    cfg = small(tokens=1000, mode="local")
    report = simulate(cfg, ["priorityfec"], 1)
    curve = DEFAULT_RECEIVER.prefill
    bounds = [*range(0, 1000, FRONT_CHUNK_TOKENS), 1000]
    chunks = [curve.chunk_seconds(i, j) for i, j in itertools.pairwise(bounds)]
    assert chunks[0] == pytest.approx(curve.seconds(FRONT_CHUNK_TOKENS))  # later chunks pay the call again
    expected_s = cfg.owd_s + sum(chunks) + DEFAULT_RECEIVER.decode_s
    scheme = report["schemes"]["priorityfec"]
    assert scheme["ttft_ms_mean"] == pytest.approx(expected_s * 1000)
    assert scheme["source_sent_mean"] == 0 and scheme["recovered_utility_mean"] == 1.0
    assert report["inputs"]["local_ttft_ms"] == pytest.approx(expected_s * 1000, abs=1e-3)


def test_split_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="mode 'fast'"):
        small(mode="fast")
    with pytest.raises(ValueError, match="meeting token 256"):
        small(mode="split", precision="int8", meeting_token=256)


def test_cli_sim_mode_split_reports_the_meeting_point_and_ttft() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pfec.cli.app", "sim", "--mode", "split", "--scheme", "priorityfec",
         "--realizations", "1", "--tokens", "512", "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["inputs"]["mode"] == "split" and report["inputs"]["meeting_token"] % 16 == 0
    assert report["inputs"]["planner"]["mode"] == "split"
    assert report["schemes"]["priorityfec"]["ttft_ms_mean"] > 0


def test_the_decoder_check_compares_every_byte_of_the_named_rows() -> None:
    """The simulator's per-run check (decoded symbols equal the sent ones) reads rows in place; it must
    agree with numpy's comparison of the copied rows, byte for byte."""
    from pfec.lab.sim.simulate import _rows_equal

    rng = np.random.default_rng(3)
    symbols = rng.integers(0, 256, (40, 96), dtype=np.uint8)
    store = np.zeros_like(symbols)
    rows = np.sort(rng.choice(40, 25, replace=False)).astype(np.int64)
    store[rows] = symbols[rows]
    assert _rows_equal(store, rows, symbols, rows)
    assert _rows_equal(store, rows[:0], symbols, rows[:0])
    for r, col in [(rows[0], 0), (rows[-1], 95), (rows[12], 40)]:
        bad = store.copy()
        bad[r, col] ^= 1
        assert not _rows_equal(bad, rows, symbols, rows)
    other = np.setdiff1d(np.arange(40), rows)[:25].astype(np.int64)
    assert not _rows_equal(store, rows, symbols, other)  # the rows of other symbols
    assert not _rows_equal(store, rows, symbols[:, :95], rows)  # another symbol size


def test_a_whole_deadline_budget_repairs_past_the_papers_fixed_one_on_the_same_losses() -> None:
    """Bursty loss near 17% with room before the deadline: the paper's fixed budget (15% of the sources)
    runs out with symbols missing; ``heuristic@deadline`` (the whole deadline as its budget, the daemons'
    default) meets the very same losses and keeps repairing until everything it can use decoded."""
    from pfec.lab.sim.channel import GilbertElliott

    handoff = prepare(small(loss=GilbertElliott(0.002, 0.6, 0.03, 0.08), rho=1.4, tokens=512))
    fixed = run_once(handoff, get_scheme("heuristic"), 0)
    whole = run_scheme(handoff, "heuristic@deadline", 0)
    assert whole.scheme == "heuristic@deadline"
    assert fixed.repair_sent == round(0.15 * handoff.plan.n_fragments)  # the fixed budget binds
    assert whole.repair_sent > fixed.repair_sent
    assert whole.recovered_symbol_fraction == 1.0 > fixed.recovered_symbol_fraction
    assert whole.source_sent == fixed.source_sent  # every source went out either way


def test_repair_budget_words_and_bounds() -> None:
    from pfec.common.plan.deadline import repair_cap, repair_fraction

    assert repair_fraction("deadline") is None and repair_fraction(None) is None
    assert repair_fraction("0.15") == 0.15 and repair_fraction(2) == 2.0
    for bad in ("all", -0.1, 10.5, float("nan"), "inf"):
        with pytest.raises(ValueError, match="repair budget"):
            repair_fraction(bad)  # type: ignore[arg-type]
    assert repair_cap(0.15, 1000, 1.0, 1e-3) == 150
    assert repair_cap(None, 1000, 1.0, 1e-3) == 1000  # one per slot of the deadline
    assert repair_cap(None, 10, 1.0, 1e-3) == 100  # at most ten per source
