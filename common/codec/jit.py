"""numba's ``njit`` with an on-disk cache keyed by the sources the kernel was compiled from.

numba bakes the global constants and arrays a kernel reads, and the kernels it calls, into the compiled
code, yet ``njit(cache=True)`` reuses a cached kernel as long as the kernel's *own* file is unchanged. After
an edit to a table, a constant or a called kernel in another module (or an upgrade of the package), it
silently runs the old code. Here every kernel caches into a folder whose name hashes what it was compiled
from, so code compiled from other sources is never found:

* key = sha256 over the numba, llvmlite, numpy and Python versions and the bytes of the kernel's module
  file and of every module it imports from the same top-level package (``pfec``), transitively, with the
  ``__init__`` of each package on the way. Imports are top-level and function-local alike (read by
  :func:`import_statements`: the lines that start one, parsed with ``ast``); ``from a import b`` counts
  ``a.b`` when that is a module. Files are found without importing anything: ``sys.modules`` for imported
  modules, else the import system's finders. One key per module per process (its 20 kernels hash once);
  it adds a few ms to importing the codec (3 ms for ``fec``'s 37 kernels here), ~10 ms for ``lab.sim``,
  whose one kernel's module imports 49 of the tree's modules.
* folder = ``numba-<module stem>-<key, 16 hex>`` under the base numba itself would use, in numba's order:
  ``$NUMBA_CACHE_DIR/<module's folder name>_<sha1 of its path>/`` when set (the deployed units set it), else
  ``__pycache__/`` beside the module, else the user-wide cache folder when ``__pycache__`` is not writable.
  Inside, numba's own index and data files (which still check the module file's hash and numba's version).
* The first time a process writes into a keyed folder, it removes the module's other keyed folders beside
  it (``numba-<stem>-<other key>``): old sources' caches do not pile up. Flip-flopping between two versions
  recompiles each time. numba's unkeyed files from before this module (``__pycache__/<stem>.*.nbi|nbc``)
  are never read and left alone.

Uses numba internals (pinned in pyproject.toml): subclasses of ``numba.core.caching``'s locators,
``CompileResultCacheImpl`` and ``FunctionCache``, assigned to the dispatcher's private ``_cache`` (what
``Dispatcher.enable_caching`` does with numba's own ``FunctionCache``). ``NUMBA_CACHE_LOCATOR_CLASSES``,
when set, overrides the locators as it does numba's.

A process reads the sources once, when a module's first kernel is decorated (during its import): a file
edited while the process runs is seen by the next process, as with Python's own imports.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar, cast

import llvmlite
import numba
import numpy as np
from numba.core.caching import (
    CompileResultCacheImpl,
    FunctionCache,
    InTreeCacheLocator,
    UserProvidedCacheLocator,
    UserWideCacheLocator,
)

__all__ = ["import_statements", "njit_cached", "njit_cached_with", "njit_inlined", "project_sources",
           "source_key"]

_F = TypeVar("_F", bound=Callable[..., Any])

KEY_HEX = 16  # 64 bits of the sha256: folder names stay short
_FORMAT = b"pfec-jit-cache 1\n"  # bump to orphan every existing keyed cache


def njit_cached(fn: _F) -> _F:
    """``numba.njit`` with the source-keyed on-disk cache; keeps the Python signature for mypy.

    Not ``nogil``: these kernels run once or more per datagram on the event loop's thread, and releasing
    and retaking the GIL costs about 0.3 us per call, as much as a source insert's own work."""
    return _with_keyed_cache(fn, numba.njit(fn))


def njit_inlined(fn: _F) -> _F:
    """:func:`njit_cached` for a named step of a per-packet kernel: numba inlines it into its callers
    (as a compiled call of its own it made a repair insert about 5% slower)."""
    return _with_keyed_cache(fn, numba.njit(inline="always")(fn))


def njit_cached_with(**options: bool | str) -> Callable[[_F], _F]:
    """:func:`njit_cached` with numba options (``fastmath=True``, ``boundscheck=False``, ``inline=...``)."""
    if "cache" in options:
        raise ValueError("the cache is always the source-keyed one; do not pass cache=")

    def decorate(fn: _F) -> _F:
        return _with_keyed_cache(fn, cast(Any, numba.njit)(**options)(fn))

    return decorate


def _with_keyed_cache(fn: _F, dispatcher: Any) -> _F:
    """``dispatcher`` (numba's for ``fn``) caching through the keyed folder, typed as ``fn`` for mypy."""
    if hasattr(dispatcher, "enable_caching"):  # else NUMBA_DISABLE_JIT: njit handed back the function
        # RuntimeError: no writable cache folder anywhere; it compiles in memory, never from stale files.
        with contextlib.suppress(RuntimeError):
            dispatcher._cache = _KeyedFunctionCache(dispatcher.py_func)  # type: ignore[no-untyped-call]
    return cast(_F, dispatcher)


# --------------------------------------------------------------------------------------------
# The key
# --------------------------------------------------------------------------------------------


class _Module(NamedTuple):
    digest: bytes  # sha256 of the file; b"" for a namespace package
    imports: tuple[str, ...]  # dotted names it imports that may be modules of the same top-level package


_modules: dict[str, _Module | None] = {}  # None: not a module (an attribute named in ``from a import b``)
_keys: dict[str, str] = {}


def _locate(name: str) -> tuple[str | None, list[str] | None] | None:
    """(file, submodule search path) of module ``name``, or None when no module has that name; imports
    nothing (a parent package not yet imported is looked up the same way)."""
    module = sys.modules.get(name)
    if module is not None:
        path = getattr(module, "__path__", None)
        return getattr(module, "__file__", None), (list(path) if path is not None else None)
    parent, _, _ = name.rpartition(".")
    search: list[str] | None = None
    if parent:
        found = _locate(parent)
        if found is None or found[1] is None:
            return None
        search = found[1]
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, search, None)
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is not None:
            origin = spec.origin if spec.has_location else None
            locations = spec.submodule_search_locations
            return origin, (list(locations) if locations is not None else None)
    return None


# The first line of an import statement (prose in a docstring rarely has this shape; a line that does and
# parses only adds a module to hash).
_IMPORT_LINE = re.compile(r"[ \t]*(?:import[ \t]+[\w.]|from[ \t]+[\w.]+[ \t]+import\b)")
_MAX_STATEMENT_LINES = 200


def import_statements(source: str) -> list[ast.Import | ast.ImportFrom]:
    """Every ``import`` / ``from ... import`` statement of a module's source, top-level or nested, parsed
    with ``ast``. A statement begins its own line (ruff's E701/E702 hold in this tree, and a test checks
    this reader against a whole-module ``ast.walk``), so only those lines are parsed, all in one go: parsing
    whole modules cost ~13 us a line here, 35 ms for the codec's sources."""
    lines = source.splitlines()
    statements = []
    for first, line in enumerate(lines):
        if not _IMPORT_LINE.match(line):
            continue
        # Import statements hold no strings: a '#' starts a comment.
        stmt = line.partition("#")[0].strip()
        last = first
        while ((stmt.count("(") > stmt.count(")") or stmt.endswith("\\"))
               and last + 1 < len(lines) and last - first < _MAX_STATEMENT_LINES):
            last += 1
            stmt += "\n" + lines[last].partition("#")[0]
        statements.append(stmt)
    try:
        trees = [ast.parse("\n".join(statements))]
    except SyntaxError:  # a docstring's line that looked like one: parse them one by one
        trees = []
        for stmt in statements:
            with contextlib.suppress(SyntaxError):
                trees.append(ast.parse(stmt))
    return [node for tree in trees for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]


def _imported_names(source: str, name: str, is_package: bool) -> Iterator[str]:
    """Dotted names module ``name`` imports; ``from a import b`` yields ``a`` and ``a.b`` (b may be a
    module); relative imports are resolved against ``name``."""
    package = name if is_package else name.rpartition(".")[0]
    for node in import_statements(source):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            anchor = ".".join(parts[: len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _module(name: str) -> _Module | None:
    if name in _modules:
        return _modules[name]
    found = _locate(name)
    info: _Module | None = None
    if found is not None:
        path, search = found
        if path is None or not os.path.isfile(path):
            info = _Module(b"", ())  # a namespace package, or a module with no file of its own
        else:
            with open(path, "rb") as f:
                data = f.read()
            imports: tuple[str, ...] = ()
            if path.endswith(".py"):
                top = name.partition(".")[0]
                names = _imported_names(data.decode("utf-8", "replace"), name, search is not None)
                imports = tuple(sorted({n for n in names if n == top or n.startswith(top + ".")}))
            info = _Module(hashlib.sha256(data).digest(), imports)
    _modules[name] = info
    return info


def project_sources(module: str) -> dict[str, bytes]:
    """Every module whose source a kernel of ``module`` may be compiled from: ``module``, what it imports
    from its own top-level package, transitively, and the packages on the way -> sha256 of its file."""
    seen: dict[str, bytes] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        info = _module(name)
        if info is None:
            continue
        seen[name] = info.digest
        todo.extend(info.imports)
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return seen


def source_key(module: str) -> str:
    """The cache key of ``module``'s kernels (hex): versions of the compiler stack and the sources."""
    key = _keys.get(module)
    if key is None:
        h = hashlib.sha256(_FORMAT)
        for part in (numba.__version__, llvmlite.__version__, np.__version__, sys.version):
            h.update(part.encode() + b"\n")
        for name, digest in sorted(project_sources(module).items()):
            h.update(name.encode() + b"\0" + digest + b"\n")
        key = _keys[module] = h.hexdigest()[:KEY_HEX]
    return key


# --------------------------------------------------------------------------------------------
# numba's cache machinery, pointed at the keyed folder (numba internals: see the module docstring)
# --------------------------------------------------------------------------------------------

_PREFIX = "numba-"


def _folder_name(py_func: Any, py_file: str) -> str:
    stem = os.path.splitext(os.path.basename(py_file))[0]
    module = getattr(py_func, "__module__", None) or ""
    if module in sys.modules:
        key = source_key(module)
    else:  # a function with no importable module: its own file, at least
        with open(py_file, "rb") as f:
            key = hashlib.sha256(_FORMAT + f.read()).hexdigest()[:KEY_HEX]
    return f"{_PREFIX}{stem}-{key}"


class _KeyedLocator:
    """Mixin over one of numba's locators: its folder, plus the keyed sub-folder."""

    def __init__(self, py_func: Any, py_file: str) -> None:
        super().__init__(py_func, py_file)  # type: ignore[call-arg]
        base: str = super().get_cache_path()  # type: ignore[misc]
        self._keyed_path = os.path.join(base, _folder_name(py_func, py_file))

    def get_cache_path(self) -> str:
        return self._keyed_path


class _KeyedUserProvided(_KeyedLocator, UserProvidedCacheLocator):
    pass


class _KeyedInTree(_KeyedLocator, InTreeCacheLocator):
    pass


class _KeyedUserWide(_KeyedLocator, UserWideCacheLocator):
    pass


class _KeyedCacheImpl(CompileResultCacheImpl):
    # numba's order; a class attribute in numba, not a ClassVar (hence the noqa).
    _locator_classes = [_KeyedUserProvided, _KeyedInTree, _KeyedUserWide]  # noqa: RUF012


_pruned: set[str] = set()


def _prune_siblings(path: str) -> None:
    """Remove the other keyed folders of the same module beside ``path`` (once per folder per process)."""
    if path in _pruned:
        return
    _pruned.add(path)
    base, own = os.path.split(path)
    stem_prefix = own[: -KEY_HEX]
    try:
        entries = os.listdir(base)
    except OSError:
        return
    for entry in entries:
        key = entry[len(stem_prefix):]
        if (entry != own and entry.startswith(stem_prefix) and len(key) == KEY_HEX
                and all(c in "0123456789abcdef" for c in key)):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


class _KeyedFunctionCache(FunctionCache):
    _impl_class = _KeyedCacheImpl

    def save_overload(self, sig: Any, data: Any) -> None:
        super().save_overload(sig, data)  # type: ignore[no-untyped-call]
        _prune_siblings(cast(str, self.cache_path))
