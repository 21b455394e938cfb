"""Scoring, needle-QA generation, LongBench loading (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pfec.lab.kv.workloads import (
    NEEDLE_KINDS,
    SHORT_ANSWER_INSTRUCTION,
    SUITE_DEPTHS,
    answer_stem,
    best_f1,
    contains_answer,
    first_line,
    load_essays,
    load_longbench,
    needle_qa,
    needle_suite,
    normalize_answer,
    token_f1,
)


def test_squad_normalisation_and_f1() -> None:
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert token_f1("the cat sat", "a cat sat") == 1.0
    assert token_f1("cat", "dog") == 0.0
    # 1 of 2 predicted tokens right, 1 of 1 gold: P=0.5, R=1 -> F1=2/3.
    assert token_f1("Dublin Ireland", "Dublin") == pytest.approx(2 / 3)
    assert best_f1("Paris", ["London", "paris."]) == 1.0
    assert token_f1("", "") == 1.0 and token_f1("", "x") == 0.0
    with pytest.raises(ValueError, match="no gold answers"):
        best_f1("x", [])


def test_contains_answer_needs_whole_words() -> None:
    assert contains_answer("The code is 4817.", ["4817"])
    assert not contains_answer("The code is 48170.", ["4817"])
    assert contains_answer("She moved to Lisbon, Portugal", ["lisbon"])
    assert first_line("\n  Lisbon.\nMore text") == "Lisbon."


def test_essay_halves_are_disjoint_real_text() -> None:
    profile, held_out = load_essays("profile"), load_essays("eval")
    assert len(profile) + len(held_out) == len(load_essays("all")) >= 40
    assert not {n for n, _ in profile} & {n for n, _ in held_out}
    assert all(len(text) > 1000 for _, text in profile)
    with pytest.raises(ValueError, match="essay split 'test'"):
        load_essays("test")  # type: ignore[arg-type]


def test_needle_qa_is_seeded_spread_and_answerable() -> None:
    a = needle_qa(6, 800, seed=3)
    assert a == needle_qa(6, 800, seed=3)
    assert a != needle_qa(6, 800, seed=4)
    for ex in a:
        needles = ex.meta["needles"]
        assert isinstance(needles, list) and len(needles) == 3
        assert all(n in ex.context for n in needles)
        assert ex.answers[0] in ex.context and ex.question.endswith("?")
        positions = [ex.context.index(n) / len(ex.context) for n in needles]
        assert positions == sorted(positions) and positions[-1] - positions[0] > 0.3  # spread
        assert set(ex.meta["essays"]) <= {n for n, _ in load_essays("eval")}  # type: ignore[arg-type]
    assert {ex.meta["kind"] for ex in needle_qa(12, 300, seed=0)} <= set(NEEDLE_KINDS)


def test_needle_length_follows_the_token_counter() -> None:
    words = needle_qa(2, 3000, seed=0, count_tokens=lambda s: len(s.split()))
    for ex in words:
        assert 3000 <= len(ex.context.split()) < 3200
    with pytest.raises(ValueError, match="fewer than 10000000 tokens"):
        needle_qa(1, 10_000_000, seed=0)
    with pytest.raises(ValueError, match="needle kind 'ghost'"):
        needle_qa(1, 100, kinds=("ghost",), n_needles=1)


def test_needle_suite_balances_kinds_depths_and_essays() -> None:
    suite = needle_suite(40, 1500, seed=2)
    assert suite == needle_suite(40, 1500, seed=2) and suite != needle_suite(40, 1500, seed=3)
    cells = {(ex.meta["kind"], ex.meta["depth_bin"]) for ex in suite}
    assert cells == {(k, d) for k in NEEDLE_KINDS for d in range(len(SUITE_DEPTHS))}  # 4 x 5, each twice
    assert len({ex.meta["essays"][0] for ex in suite}) >= 20  # type: ignore[index]
    for ex in suite:
        fact = next(f for f in ex.meta["needles"] if ex.answers[0] in f)  # type: ignore[attr-defined]
        depth = ex.context.index(fact) / len(ex.context)
        assert abs(depth - SUITE_DEPTHS[ex.meta["depth_bin"]]) < 0.1  # type: ignore[index]
        assert ex.question.endswith(SHORT_ANSWER_INSTRUCTION) and ex.context.count(fact) == 1
        assert fact.startswith(ex.answer_prefix) and fact == f"{ex.answer_prefix} {ex.answers[0]}."
        assert len(ex.meta["needles"]) == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="depths must lie"):
        needle_suite(1, 300, depths=(0.0,))
    assert answer_stem("The code is 12.", "12") == "The code is"
    with pytest.raises(ValueError, match="not inside the fact"):
        answer_stem("The code is 12.", "13")


def test_longbench_loader_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "lb.jsonl"
    rows = [{"context": "c1", "input": "q1", "answers": ["a"], "_id": "x"},
            {"context": "c2", "input": "q2", "answers": ["b", "B"], "length": 2}]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_longbench(good)
    assert [e.question for e in loaded] == ["q1", "q2"] and loaded[1].answers == ("b", "B")
    assert loaded[0].meta == {"_id": "x"} and len(load_longbench(good, limit=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "c", "input": "q", "answers": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'answers' must be a list"):
        load_longbench(bad)
    bad.write_text('{"context": "c",\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        load_longbench(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_longbench(tmp_path / "missing.jsonl")
