"""Regenerate the reference part of docs/CLI.md from the `pfec` typer app, or check that it is current.

Run it through ``./scripts/cli-docs.sh`` (rewrites the file) or ``./scripts/cli-docs.sh --check`` (exit 1 on
drift). docs/CLI.md has two parts: the notes above ``MARKER`` are written by hand and kept as they are;
everything below it is typer's own generator run in plain markup mode. Help texts appear as ``--help``
gives them, and the output depends on no terminal width, colour setting or locale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from typer.cli import get_docs_for_click

from pfec.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "CLI.md"
MARKER = "<!-- Generated below by ./scripts/cli-docs.sh from the help texts in cli/: do not edit by hand. -->"


def reference() -> str:
    """The generated part: every command, argument and option as the current help texts give them."""
    command = typer.main.get_command(app)
    # A context without typer's markup-mode object keeps the help text raw: rich mode would escape
    # quotes to HTML entities and swallow bracketed text such as "[default: 100]" as markup.
    context = typer.Context(command)
    text = get_docs_for_click(obj=command, ctx=context, name="pfec", indent=1).strip() + "\n"
    # Defaults resolved from the checkout (the shipped profile) read relative to it: the same file wherever
    # the repo was cloned.
    return text.replace(str(ROOT) + "/", "")


def render(current: str) -> str:
    """docs/CLI.md with its hand-written notes kept and its reference regenerated."""
    notes, found, _ = current.partition(MARKER + "\n")
    if not found:
        raise SystemExit(f"{CLI_MD}: the line {MARKER!r} is missing; put it where the reference starts")
    return notes + MARKER + "\n\n" + reference()


def main(argv: list[str]) -> int:
    current = CLI_MD.read_text(encoding="utf-8")
    text = render(current)
    if argv[1:] == ["--check"]:
        if current == text:
            return 0
        print(f"{CLI_MD} differs from the CLI's help texts: run ./scripts/cli-docs.sh", file=sys.stderr)
        return 1
    if argv[1:]:
        print("usage: cli-docs.sh [--check]", file=sys.stderr)
        return 2
    CLI_MD.write_text(text, encoding="utf-8")
    print(f"wrote {CLI_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
