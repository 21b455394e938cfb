"""Issue 12: hypothesis fuzzing of both endpoints' receive paths from a corpus of valid datagrams of every
type, both directions and every key phase (bit flips, truncation, splicing, rewritten header fields).

The rig (``pfec.lab.bench.fuzz.FuzzRig``) is one live authenticated handoff in mid-stream: a receiver
endpoint with an established session and the sender session talking to it. No exception may escape, and
an input that is not byte for byte a corpus datagram (so cannot authenticate) must be counted as a drop
(or, on the receiver, held unopened as early data of an unknown session).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfec.common.wire.frames import peek_header
from pfec.lab.bench.fuzz import FuzzRig, run_fuzz_bench


@pytest.fixture(scope="module")
def rig() -> FuzzRig:
    return FuzzRig(seed=3)


@st.composite
def mutants(draw: st.DrawFn, rig: FuzzRig) -> tuple[bool, bytes]:
    to_receiver = draw(st.booleans())
    own = rig.s2r if to_receiver else rig.r2s
    corpus = own if draw(st.integers(0, 9)) else (rig.r2s if to_receiver else rig.s2r)
    base = bytearray(corpus[draw(st.integers(0, len(corpus) - 1))])
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "header", "append"]))
    if kind == "flip":
        for pos in draw(st.lists(st.integers(0, len(base) - 1), min_size=1, max_size=6)):
            base[pos] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del base[draw(st.integers(0, len(base) - 1)):]
    elif kind == "splice":
        other = corpus[draw(st.integers(0, len(corpus) - 1))]
        base = base[: draw(st.integers(0, len(base)))] + other[draw(st.integers(0, len(other))):]
    elif kind == "header":
        pos = draw(st.integers(0, min(13, len(base) - 1)))
        base[pos] = draw(st.integers(0, 255))
    else:
        base += draw(st.binary(min_size=1, max_size=64))
    return to_receiver, bytes(base)


def test_corpus_has_every_type_both_ways(rig: FuzzRig) -> None:
    s2r = {(peek_header(d).phase.name, peek_header(d).type.name) for d in rig.s2r}
    r2s = {(peek_header(d).phase.name, peek_header(d).type.name) for d in rig.r2s}
    assert {("HANDSHAKE", "OFFER"), ("SESSION", "OFFER"), ("EARLY", "SOURCE"), ("SESSION", "SOURCE"),
            ("SESSION", "REPAIR"), ("SESSION", "CLOSE")} <= s2r
    assert {("HANDSHAKE", "ACCEPT"), ("HANDSHAKE", "REFUSE"), ("SESSION", "REFUSE"), ("SESSION", "ACK"),
            ("SESSION", "RESULT"), ("SESSION", "CLOSE")} <= r2s


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_datagrams_are_dropped_and_counted_never_raise(rig: FuzzRig, data: st.DataObject) -> None:
    to_receiver, datagram = data.draw(mutants(rig))
    known = datagram in set(rig.s2r) | set(rig.r2s)
    if to_receiver:
        rx = rig.endpoint
        before, held = sum(rx.drops.values()), rx.early_held
        header = rx.receive_datagram(datagram, rig.now)
        while rx.next_event() is not None:
            pass
        rx.datagrams_to_send()
        if not known:
            assert header is None and (sum(rx.drops.values()) == before + 1 or rx.early_held == held + 1)
    else:
        tx = rig.sender
        before = sum(tx.drops.values())
        tx.receive_datagram(datagram, rig.now)
        while tx.next_event() is not None:
            pass
        if not known:
            assert sum(tx.drops.values()) == before + 1, tx.drops
        tx.next_datagram(rig.now)  # what the input changed is exercised too


def test_small_fuzz_bench_has_no_escape_hang_or_growth() -> None:
    """The CI-sized `pfec bench fuzz` (20k inputs); the 1M-input figures are docs/benchmarks/fuzz.json."""
    result = run_fuzz_bench(inputs=20_000, seed=5)
    assert result["escapes"] == 0, result["escape_samples"]
    assert result["hangs"] == 0
    assert result["inputs"] == 20_000 and result["crafted_by_key_holder"] > 1000
    assert result["rss_growth_kib"] < 16 * 1024
    assert result["pending_handshakes_after"] <= 64
