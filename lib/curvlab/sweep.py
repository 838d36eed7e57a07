"""Sweeps: map a pure experiment function over a grid of configurations into one tidy frame.

A chapter's experiment is a *pure* function ``fn(**config)`` of a configuration (sizes, step size, seed,
method, ...) returning a dict of scalars, a list of such dicts (one per step or metric) or a
:class:`pandas.DataFrame`. :func:`sweep` runs it for every configuration of a :func:`grid`, in parallel through
:mod:`joblib`, and returns one tidy frame: the configuration's columns repeated on each of its rows, then the
result's columns, then two bookkeeping columns,

``_cached``
    whether the cell came from the on-disk cache (``False``: computed by this call);
``_wall_s``
    seconds ``fn`` took for the cell when it was computed (also for a cached cell, from its provenance).

Both start with an underscore so plotting code can ignore or drop them (``frame.filter(regex="^[^_]")``).

Why the cache keys on code
--------------------------
A cache keyed only on the configuration goes stale silently: fix a bug in ``curvlab``, rebuild the book, and
every figure still shows the old, cached numbers. Each cell is therefore keyed by a hash of

1. the configuration, as canonical JSON (sorted keys; numbers, strings, bools, ``None`` and lists/tuples of them);
2. the code the cell reaches, derived from the source (:func:`code_reached` lists it), not from a hand-kept list:

   * in ``fn``'s own file, the top-level statements its definition reaches by name, transitively: ``fn``
     itself, the helpers, constants and classes of that file it names (an edit elsewhere in the file, another
     grid's figure say, does not count);
   * every ``curvlab`` module those statements import (at the top of the file or inside a function), and every
     ``curvlab`` module *those* import anywhere in their files, transitively: the static import graph of the
     package, whole files;
   * ``code_modules`` (extra modules) and ``code_version`` (an extra string), when given;
   * the cache format (:data:`CACHE_FORMAT`).

Change any of these and the affected cells are recomputed; extend the grid or resume an interrupted sweep and
*only* the missing cells are. What is not tracked: code reached without an import statement (``importlib``,
``getattr`` on a module by a computed name), helpers imported from modules other than ``curvlab`` (your own
package's other modules included), data files and library versions (torch, numpy): for those pass
``code_version=`` and change it by hand. In a notebook (or another place where ``fn``'s module has no file) the
key covers ``fn``'s source, the sources of the notebook's functions it names (transitively) and the whole
``curvlab`` package, since objects a notebook made with any of it may reach the cell. A function whose source
cannot be read at all needs ``name=`` and ``code_version=``.

Layout on disk, and what a read trusts
--------------------------------------
``<cache_dir>/<name>/<key>.npz``, one file per cell, where ``<name>`` defaults to ``fn``'s ``module.qualname`` and
``<key>`` is the hash above. A cell is an *uncompressed zip of* ``.npy`` *arrays and JSON*, never a pickle: the
member ``meta`` holds (as UTF-8 JSON) the format, the key, the experiment name, the configuration, the code hash,
a SHA-256 digest of the content, the provenance and the rows (for a frame, its non-numeric columns); ``c<j>`` holds
the frame's numeric, bool and datetime columns. It is read with ``numpy.load(..., allow_pickle=False)``, so a
file in the cache cannot run code. Every read checks that the file records *this* key (its name), experiment,
configuration and code hash and that its content matches its digest; a cell copied, renamed or swapped from
another key, edited, truncated or of another format is a miss, with a :class:`CacheWarning`, and is recomputed
and replaced. Pickle cells of older curvlab versions (``*.pkl``) are never opened (a warning says so;
:func:`clear_cache` deletes them). The digest guards against accidents, not against someone who can write the
cache folder: such a person can write a consistent cell, so keep a cache where only its users can write.

The provenance records the configuration, the code hash and the modules it covers, ``code_version``, the
curvlab git revision (:func:`curvlab.config.git_revision`), the torch and Python versions, the device (when the
result has a ``device`` column), the host, the thread counts the cell ran with (torch's intra- and inter-op
threads, the OpenMP and BLAS pools, ``$OMP_NUM_THREADS``: results can differ in the last bits across thread
counts), the wall time and a UTC timestamp. A cell is written to a temporary file and moved into place with
:func:`os.replace`, so an interrupted sweep never leaves a half-written cell.

**File mode.** A cell is created like any file the user writes: mode ``0o666`` less the process's umask
(``0644`` under the usual ``022``: others can read it, only its writer can replace it). For a cache shared by a
group, run the sweeps under ``umask 002`` in a folder owned by the group with the setgid bit (``chmod g+ws``), so
cells are group-writable and stay in the group; under ``umask 077`` cells are private (``0600``) and another
user's sweep recomputes them. Cells of superseded code stay on disk until :func:`clear_cache`; :func:`cache_info`
lists them. The default ``cache_dir`` is ``$CURVLAB_CACHE_DIR``, else ``.curvlab_cache`` at the root of the git
checkout holding the working directory (else in the working directory itself).

Parallelism and clusters
------------------------
Cells run through :class:`joblib.Parallel`. ``backend=None`` takes ``$CURVLAB_SWEEP_BACKEND`` when it is set, else
joblib's active backend: ``loky`` (processes) by default, or whatever a surrounding
``joblib.parallel_config(backend=...)`` chooses. So a notebook's unchanged ``sweep(fn, configs)`` runs on a cluster
when the environment (or a context around the notebook's code) says so:

``backend="dask"`` (or ``CURVLAB_SWEEP_BACKEND=dask``)
    Dask distributed, one task per cell. The client is, in this order: one connected to
    ``$CURVLAB_DASK_SCHEDULER`` (``tcp://host:8786``); the default client of this process, if one exists; else a
    ``distributed.LocalCluster`` of ``n_jobs`` worker *processes* (default: the usable cores) listening on the
    loopback interface only (127.0.0.1, dashboard included), started for this call and closed after it. Needs
    ``pip install "curvlab[cluster]"``.
``backend="ray"`` (or ``CURVLAB_SWEEP_BACKEND=ray``)
    Ray's joblib backend (``ray.util.joblib``); connects to ``$RAY_ADDRESS`` when set, uses the Ray this process
    already runs, else starts a local Ray for the call, without a dashboard and bound to the loopback interface
    (every server of it listens on 127.0.0.1 only; Ray otherwise listens on all interfaces). Needs ``pip install
    "curvlab[cluster]"`` (or ``pip install ray``).

A remote cluster (``$CURVLAB_DASK_SCHEDULER``, ``$RAY_ADDRESS``) is its owner's to secure: anyone who can reach
its scheduler can run code on its workers (see README.md, "Clusters").

**What a killed worker costs.** Each worker writes its own cell as soon as it finishes (on a cluster of several
machines ``cache_dir`` must therefore be a shared path); the driver also writes every cell it receives that is
not on its disk. So a finished cell is never lost, and no cell is ever half-written. What happens to the *call*
depends on the backend:

* Dask retries a task whose worker died, up to ``distributed.scheduler.allowed-failures`` times (3 by default):
  a killed worker then costs only the time of its cell, and the call returns every cell. Past the retries (or
  with ``allowed-failures = 0``) the tasks of that worker are given up: the one it was running and any queued
  on it, so possibly more than one cell; the other cells run to the end and :func:`sweep` raises
  :class:`SweepIncomplete`, saying how many cells are cached.
* Ray's joblib pool does not replace a dead worker: the call stops with :class:`SweepIncomplete`, and every cell
  not finished by then (not only the killed worker's) is missing.
* In every case the same call run again computes exactly the missing cells (and reads the others, bit for
  bit). An error raised by ``fn`` itself is a :class:`CellError` naming the configuration; a killed driver,
  scheduler or Ctrl-C likewise leaves every finished cell in place.

The progress bar counts completed/total cells, cached ones included.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import hashlib
import inspect
import itertools
import json
import os
import platform
import re
import sys
import tempfile
import time
import warnings
import weakref
import zipfile
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from joblib import Parallel, delayed

from curvlab._validate import check_int
from curvlab.config import git_revision
from curvlab.progress import progress as progress_bar

__all__ = [
    "CACHE_ENV", "BACKEND_ENV", "DASK_SCHEDULER_ENV", "CLUSTER_BACKENDS", "CACHE_FORMAT", "CellError",
    "SweepIncomplete", "MissingCells", "CacheWarning", "grid",
    "sweep", "default_cache_dir", "cache_info", "clear_cache", "code_reached",
]

CACHE_ENV = "CURVLAB_CACHE_DIR"
BACKEND_ENV = "CURVLAB_SWEEP_BACKEND"
DASK_SCHEDULER_ENV = "CURVLAB_DASK_SCHEDULER"
CLUSTER_BACKENDS = ("dask", "ray")
META_COLUMNS = ("_cached", "_wall_s")
_SCALARS = (bool, int, float, str, type(None))
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class CellError(RuntimeError):
    """``fn`` raised for one configuration; ``.config`` holds it, the original error is the ``__cause__``."""

    def __init__(self, message: str, config: dict[str, Any]):
        super().__init__(message, config)
        self.config = config

    def __str__(self) -> str:
        return str(self.args[0])


class MissingCells(LookupError):
    """``sweep(..., compute=False)`` found cells missing from the cache: ``.missing`` holds their configurations,
    ``.done`` counts those present."""

    def __init__(self, message: str, done: int, missing: list[dict[str, Any]]):
        super().__init__(message, done, missing)
        self.done, self.missing = done, missing

    def __str__(self) -> str:
        return str(self.args[0])


class SweepIncomplete(RuntimeError):
    """The sweep stopped before every cell finished, for a reason other than ``fn`` raising (a worker died and the
    cluster gave up on its cell, the scheduler went away). ``.done`` cells are cached, ``.missing`` (their
    configurations) are not; the same :func:`sweep` call run again computes only those. The original error is the
    ``__cause__``."""

    def __init__(self, message: str, done: int, total: int, missing: list[dict[str, Any]]):
        super().__init__(message, done, total, missing)
        self.done, self.total, self.missing = done, total, missing

    def __str__(self) -> str:
        return str(self.args[0])


# --------------------------------------------------------------------------------------------- grids


def _axis(key: str, values: Any) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(
            f"{key} must be a list of values (one axis of the grid), got {type(values).__name__}; "
            f"wrap a single value in a list: {key}=[...]"
        )
    values = list(values)
    if not values:
        raise ValueError(f"{key} must hold at least one value, got an empty {type(values).__name__}")
    return values


def _block(where: str, block: Any) -> list[dict[str, Any]]:
    if isinstance(block, Mapping) or not isinstance(block, Sequence) or isinstance(block, (str, bytes)):
        raise TypeError(
            f"{where} must be a list of dicts (configurations that vary together), got {type(block).__name__}"
        )
    if not block:
        raise ValueError(f"{where} must hold at least one configuration, got an empty list")
    for j, entry in enumerate(block):
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where}[{j}] must be a dict, got {type(entry).__name__}")
    return [dict(entry) for entry in block]


def grid(*blocks: Sequence[Mapping[str, Any]], **axes: Sequence[Any]) -> list[dict[str, Any]]:
    """The cartesian product of configuration axes, in a deterministic order.

    Parameters
    ----------
    *blocks
        Explicit lists of dicts, each entering the product as one axis: configurations whose keys vary
        together (a method with its own step size, say).
    **axes
        One list (tuple, range, 1-d array) of values per configuration key.

    Returns
    -------
    list of dict
        Every combination, ordered like nested for-loops written in argument order: blocks first, then the
        keyword axes, the last one varying fastest.

    Examples
    --------
    >>> grid(lr=[0.1, 1.0], seed=[0, 1])
    [{'lr': 0.1, 'seed': 0}, {'lr': 0.1, 'seed': 1}, {'lr': 1.0, 'seed': 0}, {'lr': 1.0, 'seed': 1}]
    >>> grid([{"method": "gd", "lr": 0.1}, {"method": "kfac", "lr": 1.0}], seed=[0, 1])[1]
    {'method': 'gd', 'lr': 0.1, 'seed': 1}
    """
    factors = [_block(f"blocks[{i}]", block) for i, block in enumerate(blocks)]
    factors += [[{key: value} for value in _axis(key, values)] for key, values in axes.items()]
    if not factors:
        raise ValueError("grid needs at least one axis, e.g. grid(seed=[0, 1, 2])")
    seen: dict[str, int] = {}
    for f, factor in enumerate(factors):
        for key in {k for entry in factor for k in entry}:
            if key in seen:
                raise ValueError(f"grid key {key!r} appears in two axes ({seen[key]} and {f}); give it one axis")
            seen[key] = f
    configs = []
    for combo in itertools.product(*factors):
        merged: dict[str, Any] = {}
        for part in combo:
            merged.update(part)
        configs.append(merged)
    return configs


# --------------------------------------------------------------------------------- hashing and keys


def _canonical(where: str, value: Any) -> Any:
    """``value`` as plain JSON data, or a :class:`TypeError` naming ``where`` (``configs[i]['key']``)."""
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(where, v) for v in value]
    raise TypeError(
        f"{where} has unsupported type {type(value).__name__}; configuration values must be numbers, strings, "
        "bools, None or lists/tuples of them, so that they hash into a stable cache key"
    )


def _config_json(where: str, config: Any) -> str:
    """Canonical JSON of one configuration (sorted keys), validating it on the way."""
    if not isinstance(config, Mapping):
        raise TypeError(f"{where} must be a dict of keyword arguments for fn, got {type(config).__name__}")
    for key in config:
        if not isinstance(key, str):
            raise TypeError(f"{where} keys must be strings (keyword arguments of fn), got {key!r}")
    plain = {key: _canonical(f"{where}[{key!r}]", value) for key, value in config.items()}
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def _function_source(fn: Callable) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# ----------------------------------------------------------------------- the code a cell reaches (its key)
#: What a cached cell's key covers; bump when the key's recipe or the file format changes (old cells then miss).
CACHE_FORMAT = "curvlab-sweep-cell/2"
_ROOT = Path(__file__).resolve().parent
_PACKAGE = __name__.partition(".")[0]          # "curvlab"


@functools.lru_cache(maxsize=256)
def _parse(text: bytes) -> ast.Module:
    return ast.parse(text)


def _module_file(root: Path, module: str) -> Path | None:
    """The file of a ``curvlab`` module under ``root`` (the package folder): ``a.b`` -> ``a/b.py`` or
    ``a/b/__init__.py``; ``None`` when there is none."""
    if module == _PACKAGE:
        return root / "__init__.py" if (root / "__init__.py").is_file() else None
    if not module.startswith(_PACKAGE + "."):
        return None
    rel = Path(*module.split(".")[1:])
    for cand in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(node: ast.AST, module: str, is_package: bool, root: Path) -> set[str]:
    """The ``curvlab`` modules an import statement loads (a package's ``__init__`` only when it is imported by
    name: ``import curvlab``, or ``from curvlab import <not a module>``)."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            if name == _PACKAGE or name.startswith(_PACKAGE + "."):
                found.add(name)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base == _PACKAGE or base.startswith(_PACKAGE + "."):
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _module_file(root, sub) is not None else base)
    return {m for m in found if _module_file(root, m) is not None}


_SNAPSHOTS: dict[str, tuple[Any, bytes]] = {}     # path: (weak reference to the module object, its text)


def _module_text(path: Path, module: str, root: Path) -> bytes:
    """The text of a module file as this process first read it while running that module (a module object in
    ``sys.modules``): a file edited after its import keeps keying the code the process runs, not the edit, until
    the module is reloaded or the process restarts. Files of modules not imported, or of another copy of the
    package (``root``), are read as they are."""
    loaded = sys.modules.get(module) if root == _ROOT else None
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path.resolve():
        ref, text = _SNAPSHOTS.get(str(path), (None, b""))
        if ref is None or ref() is not loaded:
            text = path.read_bytes()
            _SNAPSHOTS[str(path)] = (weakref.ref(loaded), text)
        return text
    return path.read_bytes()


def _module_closure(root: Path, modules: set[str]) -> dict[str, str]:
    """``{module: sha of its file}`` for ``modules`` and every ``curvlab`` module they import, anywhere in the
    file (functions' bodies included), transitively."""
    todo, seen = sorted(modules), {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        path = _module_file(root, module)
        if path is None:
            continue
        text = _module_text(path, module, root)
        seen[module] = _sha(text)
        todo.extend(_file_imports(text, module, path.name == "__init__.py", root) - set(seen))
    return seen


@functools.lru_cache(maxsize=256)
def _file_imports(text: bytes, module: str, is_package: bool, root: Path) -> frozenset[str]:
    """Every ``curvlab`` module a file imports, anywhere in it."""
    return frozenset(m for node in _statements(_parse(text).body) if isinstance(node, (ast.Import, ast.ImportFrom))
                     for m in _imports(node, module, is_package, root))


def _statements(body: list) -> Any:
    """Every statement of a body, nested bodies included (an import is a statement: expressions need no visit)."""
    for stmt in body:
        yield stmt
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                yield from _statements(inner)


def _bound_names(stmt: ast.stmt) -> list[tuple[str, ast.alias | None]]:
    """The module-level names a top-level statement binds (with the alias, for imports)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(stmt.name, None)]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [((a.asname or a.name.partition(".")[0]) if isinstance(stmt, ast.Import) else (a.asname or a.name), a)
                for a in stmt.names if a.name != "*"]
    names = []
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.append((node.id, None))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append((node.name, None))
    return names


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
           ast.DictComp, ast.GeneratorExp)


def _local_names(node: ast.AST) -> set[str]:
    """The names a function (or comprehension) binds in its own scope: its arguments, and every name its body
    stores, imports or defines, not looking inside nested scopes; less those declared ``global``."""
    bound: set[str] = set()
    declared_global: set[str] = set()
    args = getattr(node, "args", None)
    if isinstance(args, ast.arguments):
        bound |= {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        roots = [g.target for g in node.generators]
    else:
        roots = node.body if isinstance(node.body, list) else [node.body]
    stack = list(roots)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)            # the nested scope's own body is not this scope's
            stack.extend([*n.decorator_list, *getattr(n, "bases", []), *getattr(n, "keywords", [])])
            continue
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound |= {a.asname or a.name.partition(".")[0] for a in n.names if a.name != "*"}
        elif isinstance(n, ast.Global):
            declared_global |= set(n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
            bound.add(n.name)
        if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        stack.extend(ast.iter_child_nodes(n))
    return bound - declared_global


def _free_names(stmt: ast.AST) -> set[str]:
    """The names a top-level statement reads that no enclosing function or comprehension of it binds: those can
    only be the module's globals (or builtins). Over-approximates (a class body's names count), never misses."""
    found: set[str] = set()

    def visit(node: ast.AST, bound: frozenset[str]) -> None:
        if isinstance(node, ast.Name):
            if node.id not in bound:
                found.add(node.id)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args       # defaults, decorators and annotations are read in the enclosing scope
            for outer in [*args.defaults, *(d for d in args.kw_defaults if d), *getattr(node, "decorator_list", []),
                          *(a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                                                   args.kwarg] if a and a.annotation),
                          *([node.returns] if getattr(node, "returns", None) else [])]:
                visit(outer, bound)
            inner = bound | _local_names(node)
            for child in (node.body if isinstance(node.body, list) else [node.body]):
                visit(child, frozenset(inner))
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            inner = frozenset(bound | _local_names(node))
            for k, gen in enumerate(node.generators):
                visit(gen.iter, bound if k == 0 else inner)       # the first iterable is read outside
                for cond in gen.ifs:
                    visit(cond, inner)
            for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
                visit(part, inner)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, bound)

    visit(stmt, frozenset())
    return found


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", [])
    return min([stmt.lineno, *(d.lineno for d in decorators)])


@functools.lru_cache(maxsize=256)
def _statements_reached(text: bytes, module: str, is_package: bool, line: int, root: Path
                        ) -> tuple[str, frozenset[str]]:
    """From the top-level statement of a module file holding ``line`` (a function's definition), the statements
    it reaches by name, transitively (helpers, constants, classes of the same file), and every ``curvlab``
    module those statements import. Returns (sha of the statements' source, in file order; the modules)."""
    tree = _parse(text)
    lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
    body = tree.body
    binds: dict[str, list[tuple[int, ast.alias | None]]] = {}
    always: list[int] = []
    for i, stmt in enumerate(body):
        names = _bound_names(stmt)
        for name, alias in names:
            binds.setdefault(name, []).append((i, alias))
        docstring = i == 0 and isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant)
        future = isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"
        if not names and not docstring and not future:
            always.append(i)             # module-level code that binds nothing (a call, an attribute set) runs too
    start = next((i for i, s in enumerate(body) if _first_line(s) <= line <= (s.end_lineno or s.lineno)), None)
    if start is None:
        raise ValueError(f"no top-level statement of {module} holds line {line}")
    included: set[int] = set()
    modules: set[str] = set()
    todo = [start, *always]
    while todo:
        i = todo.pop()
        if i in included:
            continue
        included.add(i)
        stmt = body[i]
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue                     # reached by name: only the aliases used count (below)
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules |= _imports(node, module, is_package, root)
        for name in _free_names(stmt):
            for j, alias in binds.get(name, ()):
                if alias is not None:            # a top-level import: that alias's module only
                    one = copy.copy(body[j])
                    one.names = [alias]
                    modules |= _imports(one, module, is_package, root)
                    included.add(j)
                elif j not in included:
                    todo.append(j)
    source = "".join("".join(lines[_first_line(body[i]) - 1: body[i].end_lineno or body[i].lineno])
                     for i in sorted(included))
    return _sha(source), frozenset(modules)


def _same_module_helpers(fn: Callable, seen: set[int] | None = None) -> list[str]:
    """Sources of the functions of ``fn``'s own (file-less) module that ``fn`` names, transitively (a notebook's
    helpers)."""
    seen = set() if seen is None else seen
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return []
    seen.add(id(code))
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    out = []
    for name in sorted(names):
        value = getattr(fn, "__globals__", {}).get(name)
        if inspect.isfunction(value) and value.__module__ == fn.__module__ and id(value.__code__) not in seen:
            out.append(_function_source(value) or "")
            out += _same_module_helpers(value, seen)
    return out


def _target(fn: Callable) -> Any:
    """The function (or class) whose definition a cell runs: ``fn`` unwrapped, a bound method's function."""
    target = inspect.unwrap(fn) if callable(fn) else fn
    return getattr(target, "__func__", target)


def _own_file(fn: Callable, root: Path) -> tuple[bytes, str, bool, int] | None:
    """``(file text, module name, is a package, first line)`` of ``fn``'s definition, read under ``root`` when the
    file belongs to ``curvlab``; ``None`` for a function without a module file (a notebook's)."""
    target = _target(fn)
    module_name = getattr(target, "__module__", None)
    if not module_name or module_name == "__main__":
        return None
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if not path or not str(path).endswith(".py") or not os.path.isfile(path):
        return None
    if inspect.isfunction(target):
        if not os.path.samefile(target.__code__.co_filename, path) if os.path.isfile(target.__code__.co_filename) \
                else True:
            return None                  # made by exec() in that module: its file does not hold the source
        line = target.__code__.co_firstlineno
    elif inspect.isclass(target):
        try:
            line = inspect.getsourcelines(target)[1]
        except (OSError, TypeError):
            return None
    else:
        return None
    path = Path(path).resolve()
    if root != _ROOT and path.is_relative_to(_ROOT):   # the same file in another copy of the package (tests)
        path = root / path.relative_to(_ROOT)
    return _module_text(path, module_name, root), module_name, path.name == "__init__.py", line


def _reach(fn: Callable, code_modules: Sequence[str] | None = None, root: Path | None = None
           ) -> tuple[str, dict[str, str]]:
    """What a cell's key covers besides its configuration: (digest of ``fn``'s own part, ``{module: file sha}``).

    ``fn``'s own part is the source of the top-level statements of its file that its definition reaches by name
    (its helpers, constants and classes there, transitively); the modules are every ``curvlab`` module those
    statements import (at the top of the file or inside a function), and every module *those* import, anywhere
    in their files, transitively (the static import graph of ``curvlab``), plus ``code_modules``. A function
    without a module file (a notebook's) covers its source, its file-less helpers' and the whole package."""
    root = _ROOT if root is None else root
    modules: set[str] = set()
    if code_modules is not None and (isinstance(code_modules, (str, bytes))
                                     or not isinstance(code_modules, (list, tuple, set, frozenset))
                                     or not all(isinstance(m, str) and m for m in code_modules)):
        raise TypeError(f"code_modules must be a list of curvlab module names, got {code_modules!r}")
    for module in code_modules or ():
        full = module if module.startswith(_PACKAGE + ".") or module == _PACKAGE else f"{_PACKAGE}.{module}"
        if _module_file(root, full) is None:
            raise ValueError(f"code_modules names {module!r}, which is not a module file of {_PACKAGE} ({root})")
        modules.add(full)
    own = _own_file(fn, root)
    if own is not None:
        text, module_name, is_package, line = own
        digest, reached = _statements_reached(text, module_name, is_package, line, root)
        reached = set(reached)
        if module_name.startswith(_PACKAGE + ".") or module_name == _PACKAGE:
            reached.discard(module_name)             # its own file counts statement by statement
        modules |= reached
    else:
        target = _target(fn)
        digest = _sha(_function_source(target) or "", *_same_module_helpers(target))
        modules |= {f"{_PACKAGE}.{p.relative_to(root).with_suffix('').as_posix().replace('/', '.')}"
                    .removesuffix(".__init__") for p in root.rglob("*.py")
                    if not any(part.startswith(".") for part in p.relative_to(root).parts)}
    return digest, _module_closure(root, modules)


def code_reached(fn: Callable, code_modules: Sequence[str] | None = None) -> list[str]:
    """The ``curvlab`` modules whose files are in ``fn``'s cache key (besides the statements of ``fn``'s own
    file that it reaches): the static import graph of the package from ``fn``'s definition; see the module notes.

    Examples
    --------
    >>> from curvlab import paper_runs
    >>> "curvlab.linalg" in code_reached(paper_runs.ch31_depth_law)
    True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    return sorted(_reach(fn, code_modules)[1])


def _code_identity(fn: Callable, name: str | None, code_version: str | None,
                   code_modules: Sequence[str] | None = None, root: Path | None = None) -> tuple[str, list[str]]:
    """(hash of the code a cell depends on, the ``curvlab`` modules in it). The hash covers :func:`_reach`
    (``fn``'s statements, the modules reached, ``code_modules``), ``code_version`` and the cache format.
    ``root``: another copy of the package folder, read instead of the installed one (tests)."""
    source = _function_source(fn)
    if source is None and (name is None or code_version is None):
        raise ValueError(
            f"cannot read the source of fn ({_qualname(fn)}), so the cache cannot tell when it changes; "
            "pass name='...' and code_version='...' (and change code_version whenever fn changes), "
            "or cache_dir=False"
        )
    digest, modules = _reach(fn, code_modules, root)
    code = _sha(CACHE_FORMAT, _qualname(fn), source or "", digest,
                *(f"{module}={sha}" for module, sha in sorted(modules.items())), code_version or "")
    return code, sorted(modules)


def _code_hash(fn: Callable, name: str | None, code_version: str | None,
               code_modules: Sequence[str] | None = None, root: Path | None = None) -> str:
    """The first half of :func:`_code_identity`: the hash in every cell's key."""
    return _code_identity(fn, name, code_version, code_modules, root)[0]


def _default_name(fn: Callable) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", _qualname(fn)).strip(".") or "fn"


# ------------------------------------------------------------------------------------- cache files


def default_cache_dir() -> Path:
    """``$CURVLAB_CACHE_DIR``, else ``.curvlab_cache`` at the root of the git checkout holding the working
    directory, else in the working directory."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return folder / ".curvlab_cache"
    return here / ".curvlab_cache"


def _resolve_cache_dir(cache_dir: Any) -> Path | None:
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        return default_cache_dir()
    if isinstance(cache_dir, (str, os.PathLike)):
        return Path(cache_dir).expanduser()
    raise TypeError(
        f"cache_dir must be a path, None (default folder) or False (no cache), got {type(cache_dir).__name__}"
    )


class CacheWarning(UserWarning):
    """A file in the sweep cache was not used: an old pickle cell (never unpickled), or a cell whose recorded key,
    configuration, code hash or content does not match (copied, renamed, swapped, edited or corrupt). The cell
    is recomputed (and its file replaced)."""


_CELL_SUFFIX = ".npz"
_OLD_SUFFIX = ".pkl"
_MAX_JSON = 1 << 30


def _json_value(where: str, value: Any) -> Any:
    """A result value as JSON data that reads back as the same value (complex numbers and tuples tagged)."""
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, complex):
        return {"__complex__": [value.real, value.imag]}
    if isinstance(value, (list, tuple)):
        items = [_json_value(where, v) for v in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: _json_value(where, v) for k, v in value.items()}}
    raise TypeError(f"{where} holds a {type(value).__name__}, which the sweep cache cannot store; results must be "
                    "numbers, strings, bools, None, or lists/tuples/dicts of them (or numeric DataFrame columns)")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__complex__" in value:
            re_, im = value["__complex__"]
            return complex(re_, im)
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: _from_json(v) for k, v in value["__dict__"].items()}
        raise ValueError(f"unknown tagged value {sorted(value)}")
    return value


def _encode_rows(rows: list[dict[str, Any]] | pd.DataFrame) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Rows as (JSON spec, arrays): dict rows entirely as JSON; a frame's numeric, bool and datetime columns as
    ``.npy`` arrays, the others as JSON lists."""
    if not isinstance(rows, pd.DataFrame):
        return {"kind": "records", "records": [{k: _json_value(f"column {k!r}", v) for k, v in row.items()}
                                               for row in rows]}, {}
    arrays: dict[str, np.ndarray] = {}
    columns = []
    for j, name in enumerate(rows.columns):
        col = rows.iloc[:, j]
        label = _json_value(f"a column name ({name!r})", name)
        if isinstance(col.dtype, np.dtype) and col.dtype.kind in "biufcmM":
            arrays[f"c{j}"] = np.ascontiguousarray(col.to_numpy())
            columns.append({"name": label, "store": "npy"})
        else:
            columns.append({"name": label, "store": "json", "dtype": str(col.dtype),
                            "values": [None if v is pd.NA else _json_value(f"column {name!r}", v) for v in col]})
    return {"kind": "frame", "length": len(rows), "columns": columns}, arrays


def _decode_rows(spec: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> list[dict[str, Any]] | pd.DataFrame:
    if spec["kind"] == "records":
        return [{k: _from_json(v) for k, v in row.items()} for row in spec["records"]]
    data, names = {}, []
    for j, col in enumerate(spec["columns"]):
        if col["store"] == "npy":
            values = arrays[f"c{j}"]
        else:
            values = pd.Series([_from_json(v) for v in col["values"]], dtype=object)
            if col.get("dtype") not in (None, "object"):
                with contextlib.suppress(TypeError, ValueError):
                    values = values.astype(col["dtype"])
        if len(values) != spec["length"]:
            raise ValueError(f"column {j} holds {len(values)} values, expected {spec['length']}")
        data[j] = values
        names.append(_from_json(col["name"]))
    frame = pd.DataFrame(data, index=pd.RangeIndex(spec["length"]))
    frame.columns = names
    return frame


def _content_digest(spec: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    parts: list[str | bytes] = [json.dumps(spec, sort_keys=True, allow_nan=True)]
    for name in sorted(arrays):
        a = arrays[name]
        parts += [name, a.dtype.str, repr(a.shape), a.tobytes()]
    return _sha(*parts)


def _umask() -> int:
    """This process's umask, read without changing it where the system tells (Linux), else by setting it back."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write a cell (``{"rows", "provenance"}``) to a temporary file next to ``path``, then move it into place.

    The file is an uncompressed ``.npz`` (a zip of ``.npy`` files, no pickles): ``meta`` is the JSON of the key,
    name, configuration, code hash, provenance, a digest of the content and the rows (or, for a frame, its
    non-numeric columns); ``c<j>`` the frame's numeric columns. Its mode is ``0o666`` less the umask, as for any
    file the user writes (``0644`` under the common umask ``022``; ``0664`` under ``002``, for a group's cache)."""
    prov = payload["provenance"]
    spec, arrays = _encode_rows(payload["rows"])
    meta = {"format": CACHE_FORMAT, "key": path.stem, "name": prov.get("name"), "config_json": prov["config_json"],
            "code_hash": prov.get("code_hash"), "digest": _content_digest(spec, arrays),
            "provenance": {k: _json_value(f"provenance[{k!r}]", v) for k, v in prov.items() if k != "config_json"},
            "rows": spec}
    blob = np.frombuffer(json.dumps(meta, allow_nan=True).encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, meta=blob, **arrays)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_meta(path: Path) -> tuple[dict[str, Any], Any]:
    """The meta record of a cell file and the open archive, refusing anything but a plain zip of ``.npy`` files
    (nothing is unpickled: ``allow_pickle=False``)."""
    size = path.stat().st_size
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        if "meta.npy" not in names or any(not re.fullmatch(r"meta\.npy|c\d+\.npy", n) for n in names):
            raise ValueError(f"unexpected members {names}")
        if any(i.compress_type != zipfile.ZIP_STORED for i in infos) or sum(i.file_size for i in infos) > size:
            raise ValueError("compressed members (cells are written uncompressed)")
    archive = np.load(path, allow_pickle=False)
    raw = archive["meta"]
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size > _MAX_JSON:
        raise ValueError("meta is not JSON bytes")
    meta = json.loads(raw.tobytes().decode())
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                         f"expected {CACHE_FORMAT!r}")
    if meta.get("key") != path.stem:
        raise ValueError(f"it records the key {str(meta.get('key'))[:32]!r}: a cell copied or renamed from "
                         "another key")
    return meta, archive


def _warn(message: str) -> None:
    warnings.warn(message, CacheWarning, stacklevel=4)


def _load_cell(path: Path, expect: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A cached cell verified against ``expect`` (``name``, ``config_json``, ``code_hash``), or ``None`` when it
    is missing or refused (with a :class:`CacheWarning`; it is then recomputed and overwritten)."""
    try:
        meta, archive = _read_meta(path)
        with archive:
            arrays = {n: archive[n] for n in archive.files if n != "meta"}
        spec = meta["rows"]
        if _content_digest(spec, arrays) != meta.get("digest"):
            raise ValueError("its content does not match its recorded digest (an edited or damaged file)")
        for field in ("name", "config_json", "code_hash"):
            if expect is not None and meta.get(field) != expect[field]:
                what = {"name": "experiment", "config_json": "configuration", "code_hash": "code hash"}[field]
                raise ValueError(f"it records another {what} ({str(meta.get(field))[:80]!r}, expected "
                                 f"{str(expect[field])[:80]!r}): a cell copied, renamed or swapped")
        rows = _decode_rows(spec, arrays)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - anything wrong with a file is a miss, said out loud
        _warn(f"sweep cache: ignoring {path} ({type(exc).__name__}: {exc}); the cell is recomputed")
        return None
    prov = {**{k: _from_json(v) for k, v in meta["provenance"].items()}, "config_json": meta["config_json"]}
    return {"rows": rows, "provenance": prov}


def _old_cells(folder: Path) -> None:
    """Warn about pickle cells of an older curvlab in ``folder``: never unpickled, never served."""
    old = sorted(folder.glob(f"*{_OLD_SUFFIX}")) if folder.is_dir() else []
    if old:
        _warn(f"sweep cache: {len(old)} pickle cell(s) of an older curvlab in {folder} are ignored (a pickle can "
              "run code, so they are never opened); clear_cache() deletes them")


# ---------------------------------------------------------------------------------- running a cell


def _scalar(where: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (np.generic, np.ndarray)) and np.size(value) == 1:
        return np.asarray(value).item()
    if isinstance(value, (*_SCALARS, complex)):
        return value
    raise TypeError(
        f"{where} holds a {type(value).__name__}; results must be scalars (return a list of dicts for several rows)"
    )


def _normalise(result: Any, where: str, config: Mapping[str, Any]) -> list[dict[str, Any]] | pd.DataFrame:
    """Check ``fn``'s result and bring it to a list of scalar rows or a DataFrame with a plain index."""
    if isinstance(result, pd.DataFrame):
        rows = result.reset_index(drop=isinstance(result.index, pd.RangeIndex))
        columns = list(rows.columns)
    elif isinstance(result, (Mapping, list, tuple)):
        raw = [result] if isinstance(result, Mapping) else list(result)
        for j, row in enumerate(raw):
            if not isinstance(row, Mapping):
                raise TypeError(f"fn's result for {where} has a {type(row).__name__} at position {j}; expected dicts")
        rows = [{str(k): _scalar(f"fn's result for {where}, column {k!r},", v) for k, v in row.items()} for row in raw]
        columns = [k for row in rows for k in row]
    else:
        raise TypeError(
            f"fn returned a {type(result).__name__} for {where}; return a dict of scalars, "
            "a list of such dicts (one per row) or a pandas DataFrame"
        )
    clash = sorted(set(map(str, columns)) & (set(config) | set(META_COLUMNS)))
    if clash:
        raise ValueError(f"fn's result for {where} has column(s) {clash} that are configuration keys or reserved names")
    return rows


def _device_of(rows: list[dict[str, Any]] | pd.DataFrame) -> str | None:
    values = rows["device"] if isinstance(rows, pd.DataFrame) and "device" in rows else (
        [row["device"] for row in rows if "device" in row] if isinstance(rows, list) else []
    )
    found = sorted({str(v) for v in values})
    return ", ".join(found) if found else None


def _threads() -> dict[str, Any]:
    """The thread counts a cell ran with: torch's intra- and inter-op pools, the OpenMP and BLAS pools
    (:mod:`threadpoolctl`, when installed) and ``$OMP_NUM_THREADS`` (results can differ across thread counts in
    the last bits, so the provenance records them)."""
    pools: dict[str, int] = {}
    with contextlib.suppress(Exception):
        from threadpoolctl import threadpool_info

        for info in threadpool_info():
            api = str(info.get("user_api"))
            pools[api] = max(pools.get(api, 0), int(info.get("num_threads", 0)))
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "openmp_threads": pools.get("openmp"), "blas_threads": pools.get("blas"),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS")}


def _run_cell(fn: Callable, index: int, config: dict[str, Any], path: Path | None, meta: dict[str, Any]):
    """Compute one cell in a worker and, when caching, write it to ``path`` at once."""
    where = f"configs[{index}] = {config!r}"
    start = time.perf_counter()
    try:
        result = fn(**config)
    except Exception as exc:
        raise CellError(f"fn failed for {where}: {type(exc).__name__}: {exc}", config) from exc
    wall_s = time.perf_counter() - start
    try:
        rows = _normalise(result, where, config)
    except (TypeError, ValueError) as exc:
        exc.curvlab_cell_error = True  # fn's fault, not the backend's: sweep re-raises it as it is
        raise
    provenance = None
    if path is not None:
        provenance = {
            **meta,
            "config": config,
            "config_json": _config_json("config", config),
            "device": _device_of(rows),
            **_threads(),
            "host": platform.node(),
            "wall_s": wall_s,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        try:
            _write_atomic(path, {"rows": rows, "provenance": provenance})
        except OSError:  # a worker that cannot reach the cache folder: the driver writes the cell
            pass
    return index, rows, wall_s, provenance


# ------------------------------------------------------------------------------------------ frames


def _repeat(value: Any, n: int) -> Any:
    """A column holding ``value`` ``n`` times (lists and tuples stay whole, one per row)."""
    if isinstance(value, (list, tuple)):
        column = np.empty(n, dtype=object)
        for i in range(n):
            column[i] = value
        return column
    return [value] * n


def _cell_frame(config: Mapping[str, Any], rows: Any, cached: bool, wall_s: float) -> pd.DataFrame:
    frame = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame.from_records(rows)
    for position, (key, value) in enumerate(config.items()):
        frame.insert(position, key, _repeat(value, len(frame)))
    frame["_cached"] = np.full(len(frame), cached, dtype=bool)
    frame["_wall_s"] = np.full(len(frame), float(wall_s))
    return frame


def _assemble(configs: list[dict[str, Any]], cells: list[tuple[Any, bool, float]]) -> pd.DataFrame:
    frames = [_cell_frame(config, *cell) for config, cell in zip(configs, cells)]
    frame = pd.concat([f for f in frames if len(f)] or frames[:1], ignore_index=True)
    config_columns = list(dict.fromkeys(key for config in configs for key in config))
    result_columns = [c for c in frame.columns if c not in config_columns and c not in META_COLUMNS]
    return frame.reindex(columns=config_columns + result_columns + list(META_COLUMNS))


# ------------------------------------------------------------------------------------------- sweep


def _check_configs(configs: Any) -> tuple[list[dict[str, Any]], list[str]]:
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Sequence):
        raise TypeError(f"configs must be a list of dicts (see grid), got {type(configs).__name__}")
    if len(configs) == 0:
        raise ValueError("configs must hold at least one configuration, got an empty list")
    keys = [_config_json(f"configs[{i}]", config) for i, config in enumerate(configs)]
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in first:
            raise ValueError(
                f"configs[{i}] repeats configs[{first[key]}] ({configs[i]!r}); list each configuration once"
            )
        first[key] = i
    return [dict(config) for config in configs], keys


def _check_backend(backend: Any, where: str = "backend") -> str | None:
    if backend is None:
        return None
    from joblib.parallel import BACKENDS, EXTERNAL_BACKENDS

    if not isinstance(backend, str):
        raise TypeError(f"{where} must be a joblib backend name or None, got {type(backend).__name__}")
    known = {*BACKENDS, *EXTERNAL_BACKENDS, *CLUSTER_BACKENDS}
    if backend not in known:
        raise ValueError(f"{where} must be None or a joblib backend {sorted(known)}, got {backend!r}")
    return backend


def _check_options(fn: Any, n_jobs: Any, backend: Any, progress: Any, name: Any, code_version: Any) -> int | None:
    if not callable(fn):
        raise TypeError(f"fn must be callable (a function of the configuration's keys), got {type(fn).__name__}")
    if n_jobs is not None:
        n_jobs = check_int("n_jobs", n_jobs, min_value=-1)
        if n_jobs == 0:
            raise ValueError("n_jobs must be >= 1, -1 (every core or worker) or None (joblib's choice), got 0")
    _check_backend(backend)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
    if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name) or set(name) == {"."}):
        raise ValueError(f"name must be a folder name of letters, digits, '_', '-' and '.', got {name!r}")
    if code_version is not None and not isinstance(code_version, str):
        raise TypeError(f"code_version must be a string or None, got {type(code_version).__name__}")
    return n_jobs


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _active_dask_client() -> Any:
    """The client of an active ``joblib.parallel_config(backend="dask")`` context, else ``None``."""
    try:
        from joblib.parallel import get_active_backend

        active, _ = get_active_backend()
    except Exception:  # pragma: no cover - joblib without the helper
        return None
    return getattr(active, "client", None) if type(active).__name__ == "DaskDistributedBackend" else None


@contextlib.contextmanager
def _dask_client(n_jobs: int | None, client: Any = None):
    """A ``distributed.Client``: ``client``, one to ``$CURVLAB_DASK_SCHEDULER``, the default one, or a loopback
    LocalCluster of ``n_jobs`` worker processes started for this call."""
    if client is not None:
        yield client
        return
    try:
        import distributed
    except ImportError as exc:
        raise ImportError('backend="dask" needs dask.distributed: pip install "curvlab[cluster]"') from exc
    owned: list[Any] = []
    address = os.environ.get(DASK_SCHEDULER_ENV, "").strip()
    if address:
        client = distributed.Client(address, set_as_default=False)
        owned.append(client)
    else:
        try:
            client = distributed.get_client()
        except ValueError:  # no client in this process: a local cluster of worker processes, loopback only
            workers = n_jobs if n_jobs is not None and n_jobs > 0 else _usable_cores()
            cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                               host="127.0.0.1", dashboard_address="127.0.0.1:0")
            client = distributed.Client(cluster, set_as_default=False)
            owned += [client, cluster]
    try:
        yield client
    finally:
        for thing in owned:
            with contextlib.suppress(Exception):
                thing.close()


#: Ray's switch (read by ``ray._private.services``) that makes a node's address the loopback one; set for a local
#: Ray started by :func:`sweep`, so that every one of its servers listens on 127.0.0.1 only.
_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray_local_init_kwargs(n_jobs: int | None) -> dict[str, Any]:
    """The arguments of ``ray.init`` for a local Ray started by :func:`sweep`: loopback only, no dashboard."""
    return {"_node_ip_address": "127.0.0.1", "include_dashboard": False, "dashboard_host": "127.0.0.1",
            "log_to_driver": False, "ignore_reinit_error": True,
            "num_cpus": n_jobs if n_jobs and n_jobs > 0 else None}


@contextlib.contextmanager
def _ray_runtime(n_jobs: int | None):
    """Ray for one :func:`sweep` call: the cluster at ``$RAY_ADDRESS`` when set (its security is its owner's), the
    Ray this process already runs, else a local Ray bound to the loopback interface, shut down after the call.

    Ray resolves a node address of ``127.0.0.1`` to the machine's outward address unless its cluster mode is off
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when its servers start): both are set here, so the GCS, the
    raylet, the object manager, the agents and the workers listen on 127.0.0.1 only (tests/test_sweep_cluster.py
    lists the started processes' listening sockets)."""
    try:
        import ray
        from ray.util.joblib import register_ray
    except ImportError as exc:
        raise ImportError('backend="ray" needs ray: pip install "curvlab[cluster]" (or pip install ray)') from exc
    register_ray()
    if ray.is_initialized():
        yield
        return
    if os.environ.get("RAY_ADDRESS", "").strip():
        ray.init(log_to_driver=False, ignore_reinit_error=True)
        try:
            yield
        finally:
            ray.shutdown()
        return
    saved_env = os.environ.get(_RAY_LOOPBACK_ENV)
    constants = None
    with contextlib.suppress(Exception):
        from ray._private import ray_constants as constants
    saved_flag = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_RAY_LOOPBACK_ENV] = "0"
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**_ray_local_init_kwargs(n_jobs))
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        if saved_env is None:
            os.environ.pop(_RAY_LOOPBACK_ENV, None)
        else:
            os.environ[_RAY_LOOPBACK_ENV] = saved_env
        if constants is not None and saved_flag is not None:
            constants.ENABLE_RAY_CLUSTER = saved_flag


@contextlib.contextmanager
def _backend_context(backend: str | None, n_jobs: int | None):
    """The joblib configuration cells run under (not Dask's: see :func:`_compute_dask`); yields the ``n_jobs`` to
    hand to :class:`joblib.Parallel`."""
    import joblib

    if backend == "ray":
        with _ray_runtime(n_jobs):
            with joblib.parallel_config(backend="ray"):
                yield -1 if n_jobs is None else n_jobs
    elif backend is not None:
        with joblib.parallel_config(backend=backend):
            yield n_jobs
    else:
        yield n_jobs


def _parallel(n_jobs: int | None, batch_size: Any) -> Parallel:
    """A :class:`joblib.Parallel` yielding cells as they finish, or all at the end where the backend cannot."""
    try:
        return Parallel(n_jobs=n_jobs, batch_size=batch_size, return_as="generator_unordered")
    except ValueError as exc:  # Ray's backend (a multiprocessing pool) returns lists only
        if "return_as" not in str(exc):
            raise
        return Parallel(n_jobs=n_jobs, batch_size=batch_size, return_as="list")


def _compute_dask(client, fn, configs, paths, todo, meta, *, show, desc, receive) -> list[tuple[int, BaseException]]:
    """Run the cells as Dask futures, one task per cell; return the cells the cluster lost, with the reason.

    Cells go to Dask directly rather than through joblib's ``dask`` backend: that backend never completes a task
    that Dask gave up on (a worker died while running it more than ``allowed-failures`` times), so joblib would
    wait for it forever (joblib 1.6). Here such a cell is reported, the others run to the end, and an error of
    ``fn`` itself cancels what is still queued and is raised as it is.
    """
    from uuid import uuid4

    from distributed import as_completed

    tag = uuid4().hex[:8]
    futures = {client.submit(_run_cell, fn, i, configs[i], paths[i], meta, key=f"curvlab-sweep-{desc}-{i}-{tag}",
                             pure=False): i for i in todo}
    stream = as_completed(list(futures), loop=client.loop, with_results=True, raise_errors=False)
    if show:
        stream = progress_bar(stream, total=len(configs), desc=desc, initial=len(configs) - len(todo))
    lost = []
    for future, result in stream:
        if future.status == "finished":
            receive(*result)
            future.release()  # else Dask recomputes a received cell whose worker dies later, to keep it in memory
            continue
        exc = result[1] if isinstance(result, tuple) and len(result) == 3 else result
        if not isinstance(exc, BaseException):
            exc = RuntimeError(f"Dask task {future.key} ended with status {future.status!r}")
        if isinstance(exc, CellError) or getattr(exc, "curvlab_cell_error", False):
            client.cancel(list(futures))
            raise exc
        lost.append((futures[future], exc))
    return lost


def _compute(fn, configs, paths, todo, meta, *, n_jobs, backend, show, desc, refused=frozenset()
             ) -> dict[int, tuple[Any, float]]:
    """Run the missing cells ``todo``, ticking a bar of completed/total cells as each one finishes (``refused``:
    cells whose file was refused, which the driver rewrites)."""
    if not todo:
        return {}
    if isinstance(n_jobs, int) and n_jobs > 0:
        n_jobs = min(n_jobs, len(todo))
    done: dict[int, tuple[Any, float]] = {}

    def receive(i, rows, wall_s, provenance):
        # the worker could not write it (or a refused file is still in the way): the driver does
        if paths[i] is not None and provenance is not None and (not paths[i].exists() or i in refused):
            _write_atomic(paths[i], {"rows": rows, "provenance": provenance})
        done[i] = (rows, wall_s)

    context_client = _active_dask_client() if backend is None else None
    lost: list[tuple[int, BaseException]] = []
    try:
        if backend == "dask" or context_client is not None:
            backend = "dask"
            with _dask_client(n_jobs, context_client) as client:
                lost = _compute_dask(client, fn, configs, paths, todo, meta, show=show, desc=desc, receive=receive)
        else:
            with _backend_context(backend, n_jobs) as jobs:
                # cells are long: one per task on a cluster, so a lost worker takes one cell with it, not a batch
                parallel = _parallel(jobs, 1 if backend in CLUSTER_BACKENDS else "auto")
                results = parallel(delayed(_run_cell)(fn, i, configs[i], paths[i], meta) for i in todo)
                if show:
                    results = progress_bar(results, total=len(configs), desc=desc, initial=len(configs) - len(todo))
                for result in results:
                    receive(*result)
    except CellError:
        raise
    except Exception as exc:
        if getattr(exc, "curvlab_cell_error", False):
            raise
        lost = [(-1, exc)]
    if lost:
        cause = lost[0][1]
        caching = paths[0] is not None
        cached = sum(1 for p in paths if p is not None and p.exists()) if caching else len(done)
        missing = [configs[i] for i in todo if i not in done and (paths[i] is None or not paths[i].exists())]
        where = f"on the {backend} backend" if backend else "in joblib"
        raise SweepIncomplete(
            f"sweep {desc!r} did not finish {where}: {type(cause).__name__}: {cause}. {cached} of {len(configs)} "
            f"cells are {'cached' if caching else 'finished'}, {len(missing)} missing"
            + ("; run the same call again to compute only the missing ones" if caching else ""),
            cached, len(configs), missing,
        ) from cause
    return done


def sweep(
    fn: Callable[..., Any],
    configs: Sequence[Mapping[str, Any]],
    *,
    cache_dir: str | os.PathLike | None | bool = None,
    n_jobs: int | None = None,
    backend: str | None = None,
    progress: bool = True,
    name: str | None = None,
    code_version: str | None = None,
    code_modules: Sequence[str] | None = None,
    compute: bool = True,
) -> pd.DataFrame:
    """Run ``fn(**config)`` for every configuration and collect the results in one tidy frame.

    Parameters
    ----------
    fn
        A pure function of the configuration's keys returning a dict of scalars, a list of such dicts (several
        rows: one per step, metric, ...) or a :class:`pandas.DataFrame`. 0-d tensors and NumPy scalars in dicts
        are turned into Python numbers.
    configs
        A list of dicts, usually from :func:`grid`; each configuration appears once.
    cache_dir
        Folder of the on-disk cache; ``None`` for :func:`default_cache_dir`, ``False`` for no cache.
    n_jobs
        Cells run at once (``>= 1``, or ``-1`` for every core); ``None``: joblib's choice, which is ``1`` (in this
        process) unless a ``joblib.parallel_config`` context sets it, and every worker on a cluster backend. For
        ``backend="dask"`` without a running cluster it is the number of local worker processes started.
    backend
        A joblib backend name: ``"loky"``, ``"threading"``, ``"sequential"``, ``"dask"``, ``"ray"`` (see the module
        notes) or another registered one. ``None``: ``$CURVLAB_SWEEP_BACKEND`` if set, else joblib's active
        backend, ``loky`` unless a ``joblib.parallel_config`` context says otherwise.
    progress
        Show a bar of completed/total cells, cached ones included (never during a book build, see
        :mod:`curvlab.progress`).
    name
        Cache folder for this experiment; default ``fn``'s ``module.qualname`` (``__main__.<fn>`` in a notebook,
        so pass a chapter-specific name there to tell experiments apart in :func:`cache_info`).
    code_version
        Extra string in the cache key: change it when something the hash cannot see changes (see module notes).
    code_modules
        Extra ``curvlab`` modules (``"meanfield"``, ...) whose files, and whose imports, the key covers besides the
        code ``fn`` reaches (:func:`code_reached`), for code reached without an import statement.
    compute
        ``False``: only read the cache, raising :class:`MissingCells` when a cell is not there.

    Returns
    -------
    pandas.DataFrame
        One row per configuration and result row: configuration columns, result columns, then ``_cached``
        (bool: read from the cache) and ``_wall_s`` (seconds ``fn`` took for that cell).

    Raises
    ------
    CellError
        ``fn`` raised for a configuration (named in the message); cells finished before stay cached.
    SweepIncomplete
        The backend failed (a worker died and the cluster gave up on its cell, say); finished cells stay cached,
        and running the same call again computes only the missing ones.

    Examples
    --------
    >>> def square(x):
    ...     return {"y": x * x}
    >>> sweep(square, grid(x=[1, 2]), cache_dir=False, progress=False)[["x", "y"]]
       x  y
    0  1  1
    1  2  4
    """
    n_jobs = _check_options(fn, n_jobs, backend, progress, name, code_version)
    if backend is None:
        backend = _check_backend(os.environ.get(BACKEND_ENV, "").strip() or None, f"${BACKEND_ENV}")
    configs, keys = _check_configs(configs)
    root = _resolve_cache_dir(cache_dir)
    label = name or _default_name(fn)
    paths: list[Path | None] = [None] * len(configs)
    found: dict[int, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    if code_modules is not None and (isinstance(code_modules, str) or not all(isinstance(m, str) for m in code_modules)):
        raise TypeError("code_modules must be a list of curvlab module names, e.g. ['meanfield', 'config']")
    if not isinstance(compute, bool):
        raise TypeError(f"compute must be a bool, got {type(compute).__name__}")
    if not compute and root is None:
        raise ValueError("compute=False reads the cache, so cache_dir must not be False")
    refused: set[int] = set()
    if root is not None:
        code, reached = _code_identity(fn, name, code_version, code_modules)
        paths = [root / label / f"{_sha(key, code)[:32]}{_CELL_SUFFIX}" for key in keys]
        _old_cells(root / label)
        for i, path in enumerate(paths):
            cell = _load_cell(path, {"name": label, "config_json": keys[i], "code_hash": code})
            if cell is not None:
                found[i] = cell
            elif path.exists():
                refused.add(i)
        meta = {"name": label, "code_hash": code, "code_version": code_version,
                "code_modules": reached}
    todo = [i for i in range(len(configs)) if i not in found]
    if todo and not compute:
        raise MissingCells(f"{len(todo)} of {len(configs)} cells of {label!r} are not in the cache {root}",
                           len(found), [configs[i] for i in todo])
    if todo and root is not None:
        meta |= {"revision": git_revision(), "torch": torch.__version__, "python": platform.python_version()}
    computed = _compute(fn, configs, paths, todo, meta, n_jobs=n_jobs, backend=backend, show=progress, desc=label,
                        refused=refused)
    cells = [
        (found[i]["rows"], True, found[i]["provenance"].get("wall_s", float("nan"))) if i in found
        else (computed[i][0], False, computed[i][1])
        for i in range(len(configs))
    ]
    return _assemble(configs, cells)


# ----------------------------------------------------------------------------------- cache helpers


def _folders(cache_dir: Any, name: str | None) -> list[Path]:
    """The experiment folders of the cache: ``<cache_dir>/<name>``, or all of them."""
    root = _resolve_cache_dir(cache_dir)
    if root is None:
        raise ValueError("cache_dir must name a cache folder (or be None for the default), got False")
    if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name) or set(name) == {"."}):
        raise ValueError(f"name must be a cache folder name, got {name!r}")
    if name is not None:
        return [root / name] if (root / name).is_dir() else []
    return sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []


def _cell_files(cache_dir: Any, name: str | None) -> list[Path]:
    folders = _folders(cache_dir, name)
    for folder in folders:
        _old_cells(folder)
    return sorted(f for folder in folders for f in folder.glob(f"*{_CELL_SUFFIX}"))


def cache_info(cache_dir: str | os.PathLike | None = None, name: str | None = None) -> pd.DataFrame:
    """One row per cached cell with its provenance (for all experiments, or only ``name``'s).

    Columns: ``name``, ``key``, ``bytes``, ``config`` (JSON), ``code_hash``, ``code_version``, ``revision``,
    ``torch``, ``device``, ``host``, ``torch_threads``, ``openmp_threads``, ``blas_threads``, ``wall_s``,
    ``timestamp``. Cells of superseded code show an old ``code_hash``. A file that is not a valid cell (an old
    pickle, a cell renamed from another key, an edited one) is left out with a :class:`CacheWarning`; nothing in
    the folder is unpickled.
    """
    columns = ["name", "key", "bytes", "config", "code_hash", "code_version", "revision", "torch", "device",
               "host", "torch_threads", "openmp_threads", "blas_threads", "wall_s", "timestamp"]
    records = []
    for path in _cell_files(cache_dir, name):
        cell = _load_cell(path)
        if cell is None:
            continue
        prov = dict(cell["provenance"]) if cell is not None else {}
        config = prov.pop("config", None)
        records.append({
            **{k: prov.get(k) for k in columns},
            "name": path.parent.name,
            "key": path.stem,
            "bytes": path.stat().st_size,
            "config": json.dumps(config, sort_keys=True, default=str) if config is not None else None,
        })
    return pd.DataFrame.from_records(records, columns=columns)


def clear_cache(cache_dir: str | os.PathLike | None = None, name: str | None = None) -> int:
    """Delete the cached cells (all experiments, or only ``name``'s) and leftover temporary files.

    Only ``<cache_dir>/<name>/*.npz`` cells (and ``*.pkl`` cells of older curvlab versions) and ``*.tmp`` files
    are removed, then empty experiment folders. Returns the number of cells deleted.
    """
    removed = 0
    for folder in _folders(cache_dir, name):
        for path in [*folder.glob(f"*{_CELL_SUFFIX}"), *folder.glob(f"*{_OLD_SUFFIX}")]:
            path.unlink(missing_ok=True)
            removed += 1
        for tmp in folder.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed
