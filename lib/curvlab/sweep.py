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
2. the code it depends on: the source of ``fn``, the source file of the module defining ``fn`` (so helpers in the
   same file count), every ``*.py`` file of the installed ``curvlab`` package, and an optional ``code_version``.

Change any of these and the affected cells are recomputed; extend the grid or resume an interrupted sweep and
*only* the missing cells are. What is not tracked: module-level data a function reads (globals, closures),
helpers imported from modules other than ``curvlab``, data files and library versions (torch, numpy). For those
pass ``code_version=`` and change it by hand. In a notebook (or another place where ``fn``'s module has no
file) only ``fn``'s own source is hashed; a function whose source cannot be read at all needs ``name=`` and
``code_version=``.

Layout on disk
--------------
``<cache_dir>/<name>/<key>.pkl``, one file per cell, where ``<name>`` defaults to ``fn``'s
``module.qualname`` and ``<key>`` is the hash above. Each file is a pickle of
``{"rows": <list of dicts or DataFrame>, "provenance": {...}}``; the provenance records the configuration,
the code hash, ``code_version``, the curvlab git revision (:func:`curvlab.config.git_revision`), the torch
version, the device (when the result has a ``device`` column), the wall time and a UTC timestamp. A cell is
written to a temporary file and moved into place with :func:`os.replace`, so an interrupted sweep never leaves
a half-written cell. Cells of superseded code stay on disk until :func:`clear_cache`; :func:`cache_info` lists
them. The default ``cache_dir`` is ``$CURVLAB_CACHE_DIR``, else ``.curvlab_cache`` at the root of the git checkout
holding the working directory (else in the working directory itself).

Parallelism and clusters
------------------------
Cells run through :class:`joblib.Parallel`. ``backend=None`` takes ``$CURVLAB_SWEEP_BACKEND`` when it is set, else
joblib's active backend: ``loky`` (processes) by default, or whatever a surrounding
``joblib.parallel_config(backend=...)`` chooses. So a notebook's unchanged ``sweep(fn, configs)`` runs on a cluster
when the environment (or a context around the notebook's code) says so:

``backend="dask"`` (or ``CURVLAB_SWEEP_BACKEND=dask``)
    Dask distributed through joblib's ``dask`` backend, one cell per task. The client is, in this order: one
    connected to ``$CURVLAB_DASK_SCHEDULER`` (``tcp://host:8786``); the default client of this process, if one
    exists; else a ``distributed.LocalCluster`` of ``n_jobs`` worker *processes* (default: the usable cores)
    on the loopback interface, started for this call and closed after it. Needs ``pip install "curvlab[cluster]"``.
``backend="ray"`` (or ``CURVLAB_SWEEP_BACKEND=ray``)
    Ray's joblib backend (``ray.util.joblib``); connects to ``$RAY_ADDRESS`` when set, else starts a local Ray for
    the call. Needs ``pip install ray`` (not part of the extras).

Each worker writes its own cell as soon as it finishes (on a cluster of several machines ``cache_dir`` must
therefore be a shared path); the driver also writes every cell it receives that is not on its disk, so a
worker that cannot reach the cache loses nothing either. An error or an interrupt, a worker killed mid-sweep
included, therefore loses only the cells still running: when the cluster cannot finish (a worker died and
Dask gave up on its task, the scheduler went away) :func:`sweep` raises :class:`SweepIncomplete`, saying how
many cells are cached, and the same call run again computes only the missing ones. (Dask retries a task whose
worker died up to ``distributed.scheduler.allowed-failures`` times, 3 by default, so a sweep usually survives a
lost worker.) The progress bar counts completed/total cells, cached ones included.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import json
import os
import pickle
import platform
import re
import sys
import tempfile
import time
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
    "CACHE_ENV", "BACKEND_ENV", "DASK_SCHEDULER_ENV", "CLUSTER_BACKENDS", "CellError", "SweepIncomplete",
    "MissingCells", "grid",
    "sweep", "default_cache_dir", "cache_info", "clear_cache",
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


def _package_hash(modules: Sequence[str] | None = None) -> str:
    """Hash of every ``*.py`` file of the installed ``curvlab`` package (paths and contents), or of ``modules``."""
    root = Path(__file__).resolve().parent
    if modules is not None:
        files = []
        for module in sorted(set(modules)):
            path = root / (module.removeprefix("curvlab.").replace(".", "/") + ".py")
            if not path.is_file():
                raise ValueError(f"code_modules names {module!r}, which is not a module file of curvlab ({path})")
            files.append(path)
        return _sha(*itertools.chain.from_iterable((p.relative_to(root).as_posix(), p.read_bytes()) for p in files))
    files = sorted(p for p in root.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(root).parts))
    return _sha(*itertools.chain.from_iterable((p.relative_to(root).as_posix(), p.read_bytes()) for p in files))


def _function_source(fn: Callable) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _module_source(fn: Callable) -> bytes | None:
    """The source file of the module defining ``fn``; ``None`` for ``__main__`` and modules without a file."""
    module_name = getattr(fn, "__module__", None)
    if not module_name or module_name == "__main__":
        return None
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if not path or not str(path).endswith(".py") or not os.path.isfile(path):
        return None
    return Path(path).read_bytes()


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _code_hash(fn: Callable, name: str | None, code_version: str | None,
               code_modules: Sequence[str] | None = None) -> str:
    """Hash of the code a cell depends on: ``fn``, its module file, the curvlab package (or only
    ``code_modules``), ``code_version``."""
    source = _function_source(fn)
    if source is None and (name is None or code_version is None):
        raise ValueError(
            f"cannot read the source of fn ({_qualname(fn)}), so the cache cannot tell when it changes; "
            "pass name='...' and code_version='...' (and change code_version whenever fn changes), "
            "or cache_dir=False"
        )
    module = _module_source(fn)
    return _sha(
        _qualname(fn),
        source or "",
        _sha(module) if module is not None else "",
        _package_hash(code_modules),
        code_version or "",
    )


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


def _write_atomic(path: Path, payload: Any) -> None:
    """Pickle ``payload`` to a temporary file next to ``path``, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load_cell(path: Path) -> dict[str, Any] | None:
    """A cached cell, or ``None`` when missing or unreadable (it is then recomputed and overwritten)."""
    try:
        with open(path, "rb") as fh:
            payload = pickle.load(fh)
    except FileNotFoundError:
        return None
    except Exception:  # a cell written by an incompatible pandas, say: recompute it
        return None
    ok = isinstance(payload, dict) and "rows" in payload and isinstance(payload.get("provenance"), dict)
    return payload if ok else None


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
            "device": _device_of(rows),
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


@contextlib.contextmanager
def _backend_context(backend: str | None, n_jobs: int | None):
    """The joblib configuration cells run under (not Dask's: see :func:`_compute_dask`); yields the ``n_jobs`` to
    hand to :class:`joblib.Parallel`."""
    import joblib

    if backend == "ray":
        try:
            import ray
            from ray.util.joblib import register_ray
        except ImportError as exc:
            raise ImportError('backend="ray" needs ray: pip install "ray[default]"') from exc
        register_ray()
        started = not ray.is_initialized()
        if started:  # $RAY_ADDRESS, when set, names a running cluster; else a local Ray for this call
            ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     **({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": n_jobs if n_jobs and n_jobs > 0 else None}))
        try:
            with joblib.parallel_config(backend="ray"):
                yield -1 if n_jobs is None else n_jobs
        finally:
            if started:
                ray.shutdown()
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


def _compute(fn, configs, paths, todo, meta, *, n_jobs, backend, show, desc) -> dict[int, tuple[Any, float]]:
    """Run the missing cells ``todo``, ticking a bar of completed/total cells as each one finishes."""
    if not todo:
        return {}
    if isinstance(n_jobs, int) and n_jobs > 0:
        n_jobs = min(n_jobs, len(todo))
    done: dict[int, tuple[Any, float]] = {}

    def receive(i, rows, wall_s, provenance):
        if paths[i] is not None and provenance is not None and not paths[i].exists():
            _write_atomic(paths[i], {"rows": rows, "provenance": provenance})  # the worker could not write it
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
        Hash only these ``curvlab`` modules (``"meanfield"``, ...) besides ``fn`` and its module, instead of the whole
        package: for long runs (:mod:`curvlab.paper_runs`) that an edit elsewhere in the library must not
        invalidate. The modules ``fn`` uses are then the caller's to list.
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
    if root is not None:
        code = _code_hash(fn, name, code_version, code_modules)
        paths = [root / label / f"{_sha(key, code)[:32]}.pkl" for key in keys]
        found = {i: cell for i, path in enumerate(paths) if (cell := _load_cell(path)) is not None}
        meta = {"name": label, "code_hash": code, "code_version": code_version}
    todo = [i for i in range(len(configs)) if i not in found]
    if todo and not compute:
        raise MissingCells(f"{len(todo)} of {len(configs)} cells of {label!r} are not in the cache {root}",
                           len(found), [configs[i] for i in todo])
    if todo and root is not None:
        meta |= {"revision": git_revision(), "torch": torch.__version__, "python": platform.python_version()}
    computed = _compute(fn, configs, paths, todo, meta, n_jobs=n_jobs, backend=backend, show=progress, desc=label)
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
    return sorted(f for folder in _folders(cache_dir, name) for f in folder.glob("*.pkl"))


def cache_info(cache_dir: str | os.PathLike | None = None, name: str | None = None) -> pd.DataFrame:
    """One row per cached cell with its provenance (for all experiments, or only ``name``'s).

    Columns: ``name``, ``key``, ``bytes``, ``config`` (JSON), ``code_hash``, ``code_version``, ``revision``,
    ``torch``, ``device``, ``host``, ``wall_s``, ``timestamp``. Cells of superseded code show an old ``code_hash``.
    """
    columns = ["name", "key", "bytes", "config", "code_hash", "code_version", "revision", "torch", "device",
               "host", "wall_s", "timestamp"]
    records = []
    for path in _cell_files(cache_dir, name):
        cell = _load_cell(path)
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

    Only ``<cache_dir>/<name>/*.pkl`` and ``*.tmp`` files are removed, then empty experiment folders.
    Returns the number of cells deleted.
    """
    removed = 0
    for folder in _folders(cache_dir, name):
        for path in folder.glob("*.pkl"):
            path.unlink(missing_ok=True)
            removed += 1
        for tmp in folder.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed
