"""The lab's figures: matplotlib on the file-only Agg backend, imported only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib  # deferred: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib (after choosing the backend)

    return cast(ModuleType, plt)  # mypy reads matplotlib as Any (not analysed)


def save_figure(fig: Figure, path: str | Path, dpi: int) -> Path:
    """Write ``fig`` as PNG to ``path`` (creating its folder) and close it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)
    return out
