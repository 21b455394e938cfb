"""What the CLI's command modules share: the error exit, comma-separated number options, default folders."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import typer

DOCS_BENCH: Final = Path("docs/benchmarks")  # where `pfec bench ...` writes its JSON and Markdown


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` on stderr; raise the returned exit (status 2: bad input or set-up)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def parse_floats(text: str, name: str, example: str) -> list[float]:
    """``--name 0.6,0.8`` -> [0.6, 0.8]; a bad or empty list exits 2 naming the option and an example."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise fail(f"--{name} {text!r} is not a comma-separated list of numbers (e.g. {example})") from None
    if not values:
        raise fail(f"--{name} is empty; give e.g. {example}")
    return values


def parse_names(text: str) -> list[str]:
    """``a, b,,c`` -> [a, b, c]."""
    return [x.strip() for x in text.split(",") if x.strip()]
