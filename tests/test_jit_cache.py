"""numba's on-disk caches cannot serve code compiled from other sources.

numba bakes the global constants and arrays a kernel reads, and the kernels it calls, into the compiled
code, but on its own it invalidates a cached kernel only when the kernel's own file changes. These tests
build a tiny package in ``tmp_path`` whose kernel (decorated by the project's ``njit_cached``) reads a
constant and an array from a sibling module, and change only that sibling between runs of a fresh
interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pfec.common.codec import gf256, jit

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("common", "sender", "receiver", "lab", "cli")

KERNEL = '''\
from pfec.common.codec.gf256 import njit_cached
from tinypkg.consts import SCALE, TABLE


@njit_cached
def kernel(i):
    return TABLE[i] * SCALE
'''

RUNNER = '''\
import json
import tinypkg.kern as k
value = int(k.kernel(1))
stats = k.kernel.stats
print(json.dumps({"value": value, "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()), "cache_path": stats.cache_path}))
'''


def _consts(scale: int, table: list[int]) -> str:
    return f"import numpy as np\n\nSCALE = {scale}\nTABLE = np.array({table}, dtype=np.int64)\n"


def _run(tmp_path: Path, cache_dir: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("NUMBA_DEBUG_CACHE", None)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    # No .pyc: a consts.py rewritten within the same second could otherwise be read from a stale .pyc.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "src"), *sys.path])
    done = subprocess.run([sys.executable, "-c", RUNNER], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("where", ["in-tree", "NUMBA_CACHE_DIR"])
def test_a_changed_constant_in_another_module_is_not_served_from_the_old_cache(
        tmp_path: Path, where: str) -> None:
    pkg = tmp_path / "src" / "tinypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "consts.py").write_text(_consts(3, [10, 20, 30]))
    kern = pkg / "kern.py"
    kern.write_text(KERNEL)
    cache_dir = tmp_path / "numba-cache" if where == "NUMBA_CACHE_DIR" else None

    first = _run(tmp_path, cache_dir)
    assert (first["value"], first["hits"], first["misses"]) == (60, 0, 1), first
    cache_root = str(cache_dir if cache_dir is not None else pkg / "__pycache__")
    assert str(first["cache_path"]).startswith(cache_root), first

    second = _run(tmp_path, cache_dir)  # nothing changed: loaded from the cache, not compiled again
    assert (second["value"], second["hits"], second["misses"]) == (60, 1, 0), second

    kern_bytes, kern_mtime = kern.read_bytes(), kern.stat().st_mtime_ns
    (pkg / "consts.py").write_text(_consts(5, [10, 21, 30]))  # only the dependency changes
    third = _run(tmp_path, cache_dir)
    assert kern.read_bytes() == kern_bytes and kern.stat().st_mtime_ns == kern_mtime
    assert third["value"] == 105, f"stale compiled kernel served after consts.py changed: {third}"
    assert (third["hits"], third["misses"]) == (0, 1), third
    keyed = sorted(p.name for p in Path(cache_root).rglob("numba-kern-*"))
    assert len(keyed) == 1 and str(third["cache_path"]).endswith(keyed[0]), keyed  # the old one was pruned

    (pkg / "consts.py").write_text(_consts(3, [10, 20, 30]))  # back to the first sources
    fourth = _run(tmp_path, cache_dir)
    assert fourth["value"] == 60, fourth
    fifth = _run(tmp_path, cache_dir)
    assert (fifth["value"], fifth["hits"], fifth["misses"]) == (60, 1, 0), fifth


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _raw_caching(path: Path, name: str) -> list[str]:
    """numba's own file-stamped cache: a ``cache=`` keyword other than ``False`` in a module that imports
    numba (however it names what it calls), and any ``enable_caching``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    uses_numba = any(
        (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "numba" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numba")
        for node in ast.walk(tree))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and uses_numba:
            out += [(node.lineno, f"cache={ast.unparse(kw.value)}") for kw in node.keywords
                    if kw.arg == "cache" and not _is_false(kw.value)]
        elif isinstance(node, ast.Attribute) and node.attr == "enable_caching":
            out.append((node.lineno, ".enable_caching"))
    return [f"{name}:{line}: {what}" for line, what in sorted(out)]


def test_no_module_uses_numbas_own_cache() -> None:
    bad = [hit for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
           for hit in _raw_caching(path, str(path.relative_to(ROOT)))]
    assert not bad, ("numba's own cache=True is keyed by the kernel's file alone and can serve stale code; "
                     "use pfec.common.codec.jit's njit_cached / njit_inlined / njit_cached_with:\n"
                     + "\n".join(bad))


def test_the_raw_cache_check_can_fail(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("import numba\n\n@numba.njit(cache=True)\ndef f():\n    pass\n\n"
                    "g = numba.njit(cache=False)(f)\ng.enable_caching()\nh = numba.jit(f, cache=flag)\n")
    other = tmp_path / "other.py"  # cache= of something that is not numba's (a model's KV cache)
    other.write_text("def f(model, kv):\n    return model(cache=kv, use_cache=True)\n")
    assert _raw_caching(other, "other.py") == []
    assert _raw_caching(path, "probe.py") == ["probe.py:3: cache=True", "probe.py:8: .enable_caching",
                                              "probe.py:9: cache=flag"]


def test_the_project_kernels_cache_under_their_sources_key() -> None:
    path = Path(gf256.region_xor.stats.cache_path)
    assert path.name == f"numba-gf256-{jit.source_key('pfec.common.codec.gf256')}"
    sources = jit.project_sources("pfec.sender.transport.repair_plan")
    assert {"pfec.sender.transport.repair_plan", "pfec.common.codec.fec", "pfec.common.codec.decoder_kernels",
            "pfec.common.codec.gf256", "pfec.common.codec.jit", "pfec.common.wire.messages",
            "pfec.common.codec", "pfec.common.wire", "pfec.sender"} <= set(sources)
    assert not any(name.startswith(("numpy", "numba")) for name in sources)
    with pytest.raises(ValueError, match="cache="):
        jit.njit_cached_with(cache=True)


def test_sources_are_followed_through_every_kind_of_import_without_importing_them(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "depsprobe"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "kern.py": ("import numpy as np\n\nfrom depsprobe import consts\nfrom depsprobe.sub import thing\n"
                    "from .rel import Y\n\n\ndef f():\n    from depsprobe.lazy import (  # deferred (why)\n"
                    "        X,\n    )\n    return X\n"),
        "consts.py": "import depsprobe.chain\n\nA = 1\n",
        "chain.py": "B = 2\n",
        "lazy.py": "X = 3\n",
        "rel.py": "Y = 4\n",
        "unused.py": "Z = 5\n",
        "sub/__init__.py": "from . import deep\n\nthing = deep.D\n",
        "sub/deep.py": "D = 6\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    sources = jit.project_sources("depsprobe.kern")
    assert set(sources) == {"depsprobe", "depsprobe.kern", "depsprobe.consts", "depsprobe.chain",
                            "depsprobe.lazy", "depsprobe.rel", "depsprobe.sub", "depsprobe.sub.deep"}
    assert not any(m == "depsprobe" or m.startswith("depsprobe.") for m in sys.modules)  # found, not imported


def _full_parse(source: str) -> set[str]:
    """The import statements of a whole-module parse (``ast.dump`` leaves line numbers out)."""
    return {ast.dump(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import | ast.ImportFrom)}


def _reader(source: str) -> set[str]:
    return {ast.dump(n) for n in jit.import_statements(source)}


def test_the_import_reader_sees_every_import_a_full_parse_does() -> None:
    """jit parses only the lines that start an import: nothing in the tree may hide one elsewhere."""
    missed = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            lost = _full_parse(source) - _reader(source)
            if lost:
                missed[str(path.relative_to(ROOT))] = sorted(lost)
    assert not missed, missed


def test_the_import_reader_can_fail() -> None:
    source = ('"""Doc.\n\nfrom the start, import all\n"""\nimport os\n'
              "from a.b import (  # c (d\n    e,  # f)\n    g,\n)\nif os.sep: import json\n")
    assert _full_parse(source) - _reader(source) == {ast.dump(ast.parse("import json").body[0])}
