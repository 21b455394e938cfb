"""docs/CLI.md says what `pfec ... --help` says: its reference part is regenerated here and compared.

When this fails after a change to a command, run ./scripts/cli-docs.sh and commit docs/CLI.md.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import typer

from pfec.cli.app import app

ROOT = Path(__file__).resolve().parent.parent

# What rich's markup parser reads as a tag (and drops from --help): a bracket opening on a lower-case
# letter, '#', '/' or '@'. docs/CLI.md is written in plain mode, so such text would show there only.
_RICH_TAG = re.compile(r"\[[a-z#/@][^\[\]]*\]")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help_texts(command: Any, path: str, params: bool = True) -> Iterator[tuple[str, str]]:
    """(where, help text) of a command, its parameters (unless params is false) and its sub-commands."""
    yield path, command.help or ""
    for param in command.params if params else ():
        yield f"{path} {param.name}", getattr(param, "help", None) or ""
    for name, sub in getattr(command, "commands", {}).items():
        yield from _help_texts(sub, f"{path} {name}", params)


def test_cli_md_matches_the_help_texts() -> None:
    generator = _generator()
    committed = generator.CLI_MD.read_text(encoding="utf-8")
    assert generator.render(committed) == committed, (
        "docs/CLI.md is stale: run ./scripts/cli-docs.sh and commit it")


def test_the_reference_names_no_path_of_this_checkout() -> None:
    """A default resolved from the checkout reads relative to it: the file is the same in every clone."""
    reference = _generator().reference()
    assert str(ROOT) not in reference
    assert "[default: profiles/smollm2-135m-instruct.json]" in reference


def test_the_reference_has_a_heading_per_command() -> None:
    committed = (ROOT / "docs" / "CLI.md").read_text(encoding="utf-8")
    command_paths = [path for path, _ in _help_texts(typer.main.get_command(app), "pfec", params=False)]
    assert len(command_paths) > 30
    missing = [path for path in command_paths if f"# `{path}`\n" not in committed]
    assert not missing, f"docs/CLI.md lacks {missing}: run ./scripts/cli-docs.sh"


def test_no_help_text_holds_what_rich_markup_would_swallow() -> None:
    swallowed = [f"{path}: {match}" for path, text in _help_texts(typer.main.get_command(app), "pfec")
                 for match in _RICH_TAG.findall(text)]
    hint = "--help drops these as markup; write defaults as (default: X):\n"
    assert not swallowed, hint + "\n".join(swallowed)
