"""The sans-IO core must not reach for clocks, sockets, event loops or torch (DESIGN.md layering rules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANS_IO = [
    "common/fec.py",
    "common/gf256.py",
    "common/wire.py",
    "common/channel.py",
    "common/kvlayout.py",
    "common/utility.py",
    "common/session_events.py",
    "common/handoff.py",
    "sender/session.py",
    "receiver/session.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "common" / "sched").glob("*.py")),
]
FORBIDDEN = {"asyncio", "socket", "time", "torch", "uvloop", "selectors", "threading"}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_module_imports_no_io(module: str) -> None:
    bad = imported_roots(ROOT / module) & FORBIDDEN
    assert not bad, f"{module} imports {sorted(bad)}; pass `now` and bytes in instead"


def test_checker_sees_forbidden_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import time\nfrom asyncio import sleep\nimport numpy as np\n")
    assert imported_roots(probe) & FORBIDDEN == {"time", "asyncio"}


def test_transport_core_does_not_pull_in_torch() -> None:
    modules = [m.removesuffix(".py").replace("/", ".") for m in SANS_IO] + ["common.sim"]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(','.join(sorted(n for n in ('torch', 'transformers', 'asyncio') if n in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout and "transformers" not in out.stdout, out.stdout
