"""The house plan (docs/ARCHITECTURE.md), enforced: every module of the tree is walked, no list to forget.

Each module belongs to one group; a group has a set of groups and third-party roots it must never import.
Imports are read with ``ast`` (top-level and function-local alike), so a rule holds however an import is
written. The import graph over the whole tree must have no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("common", "sender", "receiver", "node", "lab", "cli")  # installed as pfec.<folder>

# The sans-IO core: bytes and `now` in, datagrams, timers and events out. Prefixes of module names.
SANS_IO = (
    "pfec.common.codec", "pfec.common.wire", "pfec.common.sched", "pfec.common.plan", "pfec.common.events",
    "pfec.sender.transport",
    "pfec.receiver.session", "pfec.receiver.endpoint", "pfec.receiver.session_states",
    "pfec.receiver.session_types", "pfec.receiver.split", "pfec.receiver.handshake", "pfec.receiver.fanout",
)
IO = {"asyncio", "socket", "time", "threading", "selectors", "uvloop", "aiohttp", "prometheus_client"}
TORCH = {"torch", "transformers", "safetensors", "accelerate", "gguf"}

# group -> (pfec groups it must never import, third-party/stdlib roots it must never import)
RULES: dict[str, tuple[set[str], set[str]]] = {
    "sans-io": ({"model", "node", "sender", "receiver", "roles", "lab", "cli"}, IO | TORCH),
    "model": ({"node", "sender", "receiver", "roles", "lab", "cli"}, set()),
    "node": ({"sender", "receiver", "roles", "lab", "cli"}, TORCH),
    "sender": ({"receiver", "roles", "lab", "cli"}, TORCH),
    "receiver": ({"sender", "roles", "lab", "cli"}, TORCH),
    # the top-level node/ (a node with both roles): above sender/ and receiver/, composing them
    "roles": ({"lab", "cli"}, TORCH),
    # lab and cli never run on a node: they may import torch where they train (the DDQN), measure the
    # model's answers and quantisers, or profile it; among the node code only common/model does.
    "lab": ({"cli"}, set()),
    "cli": (set(), set()),
}

# No module may grow past this: one that does is cut along its parts, with no exemption list.
MAX_LINES = 600

# The lab's rooms (docs/ARCHITECTURE.md): room -> the other rooms it may import. A room is a sub-package of
# lab/, or one of the modules standing directly in lab/ (the demo and its helper processes). The rooms form
# one stack: the simulator and the KV tools stand on the lab's reporting only; the emulator takes its loss
# models from the simulator; the benchmarks and the evaluation stand on top and never import each other.
LAB_ROOMS: dict[str, set[str]] = {
    "reporting": set(),
    "sim": {"reporting"},
    "kv": {"reporting"},
    "emulator": {"sim"},
    "baselines": {"sim", "emulator", "reporting"},
    "train": {"sim", "reporting"},
    "processes": {"emulator"},
    "demo": {"sim", "kv", "reporting", "processes"},
    "eval": {"sim", "baselines", "kv", "train", "reporting"},
    "bench": {"sim", "kv", "emulator", "reporting", "processes", "demo"},
    "pathbench": {"sim", "emulator", "reporting", "processes"},
}
# The simulator runs the sans-IO sessions in simulated time: outside the lab it imports only the sans-IO
# core, and no event loop, socket, thread or model (``time`` only to report its own wall time).
SIM_BANNED_ROOTS = (IO - {"time"}) | TORCH

# How many modules a folder may hold before it wants rooms of its own (``__init__`` counts), and how many
# may stand directly in lab/ beside its rooms.
MAX_FOLDER_MODULES = 15
MAX_LAB_TOP_MODULES = 6

# folder -> folders it must never import, whatever the groups (sender and receiver never import each other)
FOLDER_RULES: dict[str, set[str]] = {
    "common": {"sender", "receiver", "node", "lab", "cli"},
    "sender": {"receiver", "node", "lab", "cli"},
    "receiver": {"sender", "node", "lab", "cli"},
    "node": {"lab", "cli"},
    "lab": {"cli"},
    "cli": set(),
}


def group_of(module: str) -> str:
    """The layering group of a dotted ``pfec.*`` module name."""
    if module.startswith(SANS_IO) and any(module == p or module.startswith(p + ".") for p in SANS_IO):
        return "sans-io"
    parts = module.split(".")
    if parts[1] == "node":  # the top-level node/ ("roles"), not common/node ("node")
        return "roles"
    if parts[1] == "common":
        return {"model": "model", "node": "node"}.get(parts[2] if len(parts) > 2 else "", "sans-io")
    return parts[1]


def all_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found["pfec." + ".".join(parts)] = path
    return found


def imports_of(path: Path) -> Iterator[tuple[str, int]]:
    """(imported dotted name, line) for every import statement; ``from a import b`` also yields ``a.b``
    (b may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def internal_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, _ in imports_of(path):
            if name in modules and name != module:
                edges[module].add(name)
    return edges


def violations(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    group = group_of(module)
    banned_groups, banned_roots = RULES[group]
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for name, line in imports_of(path):
        root = name.split(".")[0]
        if root in banned_roots:
            out.append(f"{where}:{line} ({group}) imports {name}")
        elif root == "pfec" and name in modules and (
            group_of(name) in banned_groups or name.split(".")[1] in FOLDER_RULES[module.split(".")[1]]
        ):
            out.append(f"{where}:{line} ({group}) imports {name} ({group_of(name)})")
    return out


def lab_room_of(module: str) -> str:
    """The lab room of a ``pfec.lab.*`` module: its sub-package, or its own name for a top-level module."""
    return module.split(".")[2]


def lab_room_violations(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Imports of a lab module that cross the rooms' table, or leave the sans-IO core from the simulator."""
    room = lab_room_of(module)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for name, line in imports_of(path):
        if name.split(".")[0] in SIM_BANNED_ROOTS and room == "sim":
            out.append(f"{where}:{line} (lab room sim) imports {name}")
        if name not in modules or not name.startswith("pfec."):
            continue
        if name.startswith("pfec.lab."):
            other = lab_room_of(name)
            if other != room and other not in LAB_ROOMS[room]:
                out.append(f"{where}:{line} (lab room {room}) imports {name} (room {other})")
        elif room == "sim" and group_of(name) != "sans-io":
            out.append(f"{where}:{line} (lab room sim) imports {name} ({group_of(name)})")
    return out


def crowded_folders(paths: list[Path]) -> list[str]:
    """Folders over MAX_FOLDER_MODULES modules, and lab/ over MAX_LAB_TOP_MODULES standing in it directly."""
    count: dict[Path, int] = {}
    for path in paths:
        count[path.parent] = count.get(path.parent, 0) + 1
    out = [f"{folder} holds {n} modules (at most {MAX_FOLDER_MODULES})"
           for folder, n in sorted(count.items()) if n > MAX_FOLDER_MODULES]
    lab = ROOT / "lab"
    if count.get(lab, 0) > MAX_LAB_TOP_MODULES:
        out.append(f"{lab} holds {count[lab]} modules directly (at most {MAX_LAB_TOP_MODULES})")
    return out


def undeclared_local_imports(path: Path) -> list[str]:
    """Imports inside a function body without a ``deferred`` comment on that line or the one above:
    a function-local import is only for a heavy dependency deferred on purpose, and says so."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    out = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import | ast.ImportFrom):
                near = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
                if "deferred" not in near:
                    out.append(f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


MODULES = all_modules()


def test_every_folder_is_walked() -> None:
    assert {m.split(".")[1] for m in MODULES} == set(FOLDERS)
    assert "pfec.sender.transport.session" in MODULES and "pfec.common.codec.fec" in MODULES


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_follows_the_layering_table(module: str) -> None:
    bad = violations(module, MODULES[module], MODULES)
    assert not bad, "layering broken (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_every_lab_module_stands_in_a_listed_room() -> None:
    rooms = {lab_room_of(m) for m in MODULES if m.startswith("pfec.lab.")}
    assert rooms == set(LAB_ROOMS), f"rooms on disk {sorted(rooms)} vs the table {sorted(LAB_ROOMS)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("pfec.lab.")))
def test_lab_module_follows_the_rooms_table(module: str) -> None:
    bad = lab_room_violations(module, MODULES[module], MODULES)
    assert not bad, "lab rooms crossed (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_no_folder_is_crowded() -> None:
    bad = crowded_folders(list(MODULES.values()))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_function_local_imports_say_why(module: str) -> None:
    bad = undeclared_local_imports(MODULES[module])
    assert not bad, "function-local import without a '# deferred: <why>' comment:\n" + "\n".join(bad)


def static_import_problems(path: Path) -> list[str]:
    """Imports the table cannot see: relative ones, and modules loaded by name at run time."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append(f"{path.name}:{node.lineno}: relative import")
        elif isinstance(node, ast.Call):
            func = node.func
            name = (func.attr if isinstance(func, ast.Attribute)
                    else func.id if isinstance(func, ast.Name) else "")
            if name in ("import_module", "__import__"):
                out.append(f"{path.name}:{node.lineno}: {name}()")
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_are_absolute_and_static(module: str) -> None:
    bad = static_import_problems(MODULES[module])
    assert not bad, "an import the layering table cannot check:\n" + "\n".join(bad)


def test_no_module_is_too_long() -> None:
    lengths = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    over = sorted(f"{m} ({n} lines)" for m, n in lengths.items() if n > MAX_LINES)
    assert not over, f"over {MAX_LINES} lines: cut along its parts: {over}"


def test_no_import_cycle() -> None:
    cycle = find_cycle(internal_edges(MODULES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# --- the checker itself must be able to fail -------------------------------------------------------


def _probe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(text)
    return path


def test_checker_catches_a_forbidden_import_in_each_group(tmp_path: Path) -> None:
    cases = {
        "pfec.common.codec.probe": "import time\n",
        "pfec.receiver.session": "def f():\n    from pfec.common.node import config\n",
        "pfec.sender.daemon": "from pfec.receiver import daemon\n",
        "pfec.receiver.daemon": "import pfec.sender.transport.session\n",
        "pfec.common.node.probe": "from pfec.lab.sim.simulate import simulate\n",
        "pfec.common.plan.probe": "import torch\n",
        "pfec.lab.probe": "from pfec.cli import app\n",
        "pfec.sender.probe": "from pfec.node.daemon import NodeDaemon\n",
        "pfec.receiver.probe": "import pfec.node.config\n",
        "pfec.common.node.probe2": "from pfec.node import serve\n",
        "pfec.node.probe": "from pfec.cli import app\n",
    }
    for module, text in cases.items():
        assert violations(module, _probe(tmp_path, text), MODULES), (module, text)
    assert not violations("pfec.lab.probe", _probe(tmp_path, "import torch\nimport pfec.sender.daemon\n"),
                          MODULES)
    both = "from pfec.sender.daemon import SenderDaemon\nfrom pfec.receiver.daemon import ReceiverDaemon\n"
    assert not violations("pfec.node.probe", _probe(tmp_path, both), MODULES)
    assert not violations("pfec.cli.probe", _probe(tmp_path, "from pfec.node.serve import serve\n"), MODULES)


def test_checker_catches_a_lab_room_crossing(tmp_path: Path) -> None:
    cases = {
        "pfec.lab.sim.probe": "from pfec.lab.eval import config\n",  # the simulator above the evaluation
        "pfec.lab.eval.probe": "import pfec.lab.bench.drivers\n",  # the two top rooms apart
        "pfec.lab.reporting.probe": "from pfec.lab.sim import simulate\n",
        "pfec.lab.sim.probe2": "from pfec.common.node import config\n",  # the simulator leaves the core
        "pfec.lab.sim.probe3": "import asyncio\n",
    }
    for module, text in cases.items():
        assert lab_room_violations(module, _probe(tmp_path, text), MODULES), (module, text)
    allowed = ("from pfec.lab.sim import channel\nfrom pfec.sender.transport.session import SenderSession\n"
               "import time\n")
    assert not lab_room_violations("pfec.lab.sim.probe", _probe(tmp_path, allowed), MODULES)
    assert not lab_room_violations("pfec.lab.emulator.probe", _probe(tmp_path, allowed), MODULES)


def test_checker_catches_a_crowded_folder() -> None:
    many = [ROOT / "sender" / f"m{i}.py" for i in range(MAX_FOLDER_MODULES + 1)]
    assert crowded_folders(many) == [f"{ROOT / 'sender'} holds 16 modules (at most {MAX_FOLDER_MODULES})"]
    top = [ROOT / "lab" / f"m{i}.py" for i in range(MAX_LAB_TOP_MODULES + 1)]
    assert len(crowded_folders(top)) == 1 and not crowded_folders(top[:-1])


def test_checker_catches_relative_and_dynamic_imports(tmp_path: Path) -> None:
    probe = _probe(tmp_path, "from . import x\nfrom ..lab import sim\nimport importlib\n"
                             "importlib.import_module('pfec.lab.sim')\n__import__('os')\nimport pfec.lab\n")
    assert static_import_problems(probe) == ["probe.py:1: relative import", "probe.py:2: relative import",
                                             "probe.py:4: import_module()", "probe.py:5: __import__()"]


def test_checker_catches_an_undeclared_local_import(tmp_path: Path) -> None:
    probe = _probe(tmp_path, "def f():\n    import os\n\ndef g():\n    import torch  # deferred: torch\n")
    assert undeclared_local_imports(probe) == ["probe.py:2: import os"]


def test_checker_names_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_transport_core_does_not_pull_in_torch() -> None:
    """Importing every sans-IO module and the simulator loads no torch, transformers or asyncio."""
    modules = [m for m in MODULES if group_of(m) == "sans-io"] + ["pfec.lab.sim.simulate"]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(','.join(sorted(n for n in ('torch', 'transformers', 'asyncio') if n in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout and "transformers" not in out.stdout, out.stdout
