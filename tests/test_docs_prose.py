"""The guide and the references stay readable: no sentence over 40 words, and a README of at most 150 lines.

The rule, kept simple on purpose:

- Prose only: fenced code blocks (```), indented code blocks (4 spaces after a blank line), table rows
  (lines starting with ``|``), headings (``#``) and HTML comments are skipped.
- A paragraph (lines between blank lines) or a list item is joined into one text.
- An inline code span counts as one word, however many spaces it holds: it names one thing.
- Sentences end at ". ", "? ", "! " (the mark followed by whitespace or the end of the text) and at ";".
  Abbreviations such as "e.g. " therefore end a sentence too, which only makes sentences shorter.
- Words are what whitespace separates.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/ARCHITECTURE.md", "docs/CLI.md")
MAX_WORDS = 40
MAX_README_LINES = 150

_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_CODE_SPAN = re.compile(r"`[^`]*`")
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+|;")


def prose_units(markdown: str) -> list[str]:
    """The paragraphs and list items of a markdown text, each joined into one line."""
    units: list[str] = []
    current: list[str] = []
    in_fence = in_comment = False
    previous_blank = True

    def flush() -> None:
        if current:
            units.append(" ".join(current))
            current.clear()

    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            in_fence = not in_fence
        elif in_fence:
            pass
        elif in_comment or stripped.startswith("<!--"):
            flush()
            in_comment = "-->" not in stripped
        elif not stripped:
            flush()
        elif stripped.startswith(("#", "|")) or (previous_blank and line.startswith("    ")):
            flush()
            stripped = ""  # a code line keeps the next line's indentation read as code too
        elif _LIST_ITEM.match(line):
            flush()
            current.append(_LIST_ITEM.sub("", line).strip())
        else:
            current.append(stripped)
        previous_blank = not stripped
    flush()
    return units


def sentences(unit: str) -> list[str]:
    """The sentences of one paragraph, each with its code spans folded to one word."""
    folded = _CODE_SPAN.sub("CODE", unit)
    return [part.strip() for part in _SENTENCE_END.split(folded) if part.strip()]


def long_sentences(markdown: str) -> list[tuple[int, str]]:
    """(word count, sentence) of every sentence over MAX_WORDS words."""
    found = []
    for unit in prose_units(markdown):
        for sentence in sentences(unit):
            words = len(sentence.split())
            if words > MAX_WORDS:
                found.append((words, sentence))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_no_sentence_over_the_limit(doc: str) -> None:
    too_long = long_sentences((ROOT / doc).read_text(encoding="utf-8"))
    report = "\n".join(f"  {words} words: {sentence[:160]}..." for words, sentence in too_long)
    assert not too_long, f"{doc}: sentences over {MAX_WORDS} words (split them):\n{report}"


def test_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; keep it at most {MAX_README_LINES}"


def test_the_rule_splits_and_skips_as_documented() -> None:
    text = "\n".join([
        "# A heading " + "word " * 50,
        "",
        "One. Two words? Three words here! `a code span with many words` counts once; then more.",
        "",
        "```",
        "code " * 50,
        "```",
        "",
        "| table | " + "cell " * 50,
        "",
        "    indented code " + "x " * 50,
        "",
        "- a list item " + "y " * 38,
        "- next item",
    ])
    units = prose_units(text)
    assert units == [
        "One. Two words? Three words here! `a code span with many words` counts once; then more.",
        "a list item " + ("y " * 38).strip(),
        "next item",
    ]
    expected = ["One.", "Two words?", "Three words here!", "CODE counts once", "then more."]
    assert sentences(units[0]) == expected
    assert long_sentences(text) == [(41, "a list item " + ("y " * 38).strip())]
