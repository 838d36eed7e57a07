"""The sweep cache can neither serve stale cells nor trust a file it finds (issue 26).

* Keys from the code a cell reaches: for every registered paper-scale grid, each function its quick cells (one
  per code path: method, kind, activation, ...) call inside ``curvlab`` is found by running them under a
  profiler, then edited in a copy of the package: every such edit changes the grid's key (the issue's blind
  spots among them: ``precond.adam_update``, ``linalg.random_orthogonal``, ``linalg.kron``, ``default_rtol``). The stale-cache demonstration runs a registered grid, edits a function
  its cell calls (in a copy of the package, in a fresh process), reruns it: every cell is recomputed and the
  paper-scale section no longer calls the committed frame the current code's.
* Files: cells are a zip of ``.npy`` arrays and JSON read with ``allow_pickle=False``; a planted pickle (as an
  old ``.pkl`` cell or under a cell's name), a swapped, a copied and an edited cell are refused with a
  :class:`CacheWarning` and recomputed; nothing is unpickled. Cells get the mode the umask says; the provenance
  records the thread counts.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from curvlab import paper_runs
from curvlab import sweep as sw
from curvlab.sweep import CacheWarning, grid, sweep

ROOT = Path(sw.__file__).resolve().parent
CALLS: list = []


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(sw.BACKEND_ENV, raising=False)
    CALLS.clear()


def run(fn, configs, cache_dir, **kw):
    return sweep(fn, configs, cache_dir=cache_dir, progress=False, **kw)


def n_computed(frame: pd.DataFrame) -> int:
    return int((~frame["_cached"]).sum())


def cell(a, b=0):
    CALLS.append(a)
    return {"y": a * 10 + b}


def frame_cell(a):
    CALLS.append(a)
    return pd.DataFrame({"t": [0, 1, 2], "x": [a, a + 0.5, np.nan], "name": ["p", None, "q"],
                         "z": np.array([1 + 2j, 0, -1j]), "ok": [True, False, True]})


# ==================================================================== keys from the code a cell reaches
def _paths(r: paper_runs.PaperRun) -> list[dict]:
    """One quick configuration per code path of ``r``: the cheapest of each combination of its categorical
    settings (strings, bools, None: a method, a kind, an activation, a dataset)."""
    groups: dict[tuple, dict] = {}
    for c in r.configs("quick"):
        key = tuple(sorted((k, v) for k, v in c.items() if v is None or isinstance(v, (str, bool))))
        if key not in groups or r.flops(**c) < r.flops(**groups[key]):
            groups[key] = c
    return list(groups.values())


def _called(r: paper_runs.PaperRun) -> set[tuple[str, int, str]]:
    """The curvlab functions ``r``'s quick cells call, one cell per code path (:func:`_paths`): (file under
    curvlab, first line, name)."""
    calls: set[tuple[str, int, str]] = set()
    prefix = str(ROOT) + os.sep

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            code = frame.f_code
            calls.add((code.co_filename[len(prefix):], code.co_firstlineno, code.co_name))

    for config in _paths(r):
        sys.setprofile(profile)
        try:
            r.fn(**config)
        finally:
            sys.setprofile(None)
    return calls


_COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith, ast.Match)


def _first_simple(body: list) -> ast.stmt:
    """The first simple statement of a body, looking inside compound statements (and, for a class made only of
    methods, inside its first method)."""
    for stmt in body:
        if isinstance(stmt, _COMPOUND):
            inner = [*getattr(stmt, "body", []), *getattr(stmt, "orelse", []),
                     *(h for handler in getattr(stmt, "handlers", []) for h in handler.body),
                     *getattr(stmt, "finalbody", []), *(c for case in getattr(stmt, "cases", []) for c in case.body)]
            return _first_simple(inner)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        return stmt
    return _first_simple(next(s for s in body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                    ast.ClassDef))).body)


@functools.lru_cache(maxsize=64)
def _tree(text: str) -> ast.Module:
    return ast.parse(text)


def _edit(text: str, line: int, name: str) -> str | None:
    """``text`` with the function (or lambda) defined at ``line`` edited: ``pass;`` before its first simple
    statement (a lambda: ``0 or`` before its body), keeping every line where it was; None when none is there."""
    tree = _tree(text)
    target = None
    for node in (ast.walk(tree) if name == "<lambda>" else sw._statements(tree.body)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first == line:
                target = node
        elif isinstance(node, ast.Lambda) and name == "<lambda>" and node.lineno == line and target is None:
            target = node
    if target is None:
        return None
    lines = text.splitlines(keepends=True)
    if isinstance(target, ast.Lambda):
        at, insert = target.body, "0 or "
    else:
        at, insert = _first_simple(target.body), "pass; "
    row = lines[at.lineno - 1]
    col = len(row.encode()[: at.col_offset].decode())
    lines[at.lineno - 1] = row[:col] + insert + row[col:]
    edited = "".join(lines)
    ast.parse(edited)
    return edited


def _copy_as_running(tmp_path) -> Path:
    """A copy of the package whose modules hold the text this process runs (the sweep's snapshots), so that an
    edit of a curvlab file by someone else during the test does not count; skip if a grid's function is not
    where this process has it."""
    copy = tmp_path / "curvlab"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "paper_frames"))
    for path in ROOT.glob("*.py"):
        module = f"curvlab.{path.stem}" if path.stem != "__init__" else "curvlab"
        (copy / path.name).write_bytes(sw._module_text(path, module, sw._ROOT))
    for r in paper_runs.REGISTRY.values():
        code = r.fn.__code__
        line = (copy / Path(code.co_filename).relative_to(ROOT)).read_text().splitlines()[code.co_firstlineno - 1]
        if f"def {r.fn.__name__}(" not in line:
            pytest.skip("a curvlab file changed on disk before this process first read it")
    return copy


@pytest.fixture(scope="module")
def reached(tmp_path_factory):
    """Per registered grid: the functions its quick cell calls, and its key."""
    import importlib

    for module in sw.code_reached(paper_runs.ch11_linrep_fig1, ["paper_runs"]):
        importlib.import_module(module)              # import-time code is not a call of the cell
    for module in ("meanfield", "resnet", "deep_linear", "singleindex", "linrep_baselines", "checks", "plotting"):
        importlib.import_module(f"curvlab.{module}")
    torch.manual_seed(0)
    out = {}
    for name, r in paper_runs.REGISTRY.items():
        out[name] = (_called(r), sw._code_hash(r.fn, r.cache_name(), None))
    return out


def test_every_registered_grid_reaches_the_modules_it_was_listed_with(reached):
    """The hand-kept module lists of the registry are now only a check: the derived set covers each of them
    (a grid's own module counts statement by statement) and the four blind spots of the issue."""
    for name, r in paper_runs.REGISTRY.items():
        derived = {m.removeprefix("curvlab.") for m in sw.code_reached(r.fn)} | {r.fn.__module__.split(".")[-1]}
        assert set(r.modules) <= derived, (name, set(r.modules) - derived)
    for name, module in [("ch11_linrep_fig1", "precond"), ("ch11_linrep_fig1", "linalg"),
                         ("ch31_depth_law", "linalg"), ("ch32_leaky", "linalg"), ("ch32_pruned_resnet", "linalg")]:
        assert f"curvlab.{module}" in sw.code_reached(paper_runs.get(name).fn), (name, module)


def test_editing_any_function_a_registered_cell_calls_changes_its_key(reached, tmp_path):
    """For every registered grid and every curvlab function its cell calls (found by running the cell), an edit
    of that function in a copy of the package changes the grid's key."""
    copy = _copy_as_running(tmp_path)
    base = {name: sw._code_hash(r.fn, r.cache_name(), None, root=copy) for name, r in paper_runs.REGISTRY.items()}
    by_function: dict[tuple[str, int, str], list[str]] = {}
    names = {name: {(rel, fname) for rel, _, fname in calls} for name, (calls, _) in reached.items()}
    assert {("precond.py", "adam_update"), ("linalg.py", "random_orthogonal")} <= names["ch11_linrep_fig1"]
    assert ("linalg.py", "default_rtol") in names["ch32_leaky"] and ("linalg.py", "kron") in names["ch31_depth_law"]
    for name, (calls, _) in reached.items():
        assert calls, f"{name}: the profiler saw no curvlab call"
        for call in calls:
            if not call[2].startswith("<") or call[2] == "<lambda>":
                by_function.setdefault(call, []).append(name)
    unchanged, edited = [], 0
    for (rel, line, fname), names in sorted(by_function.items()):
        path = copy / rel
        original = path.read_text()
        text = _edit(original, line, fname)
        assert text is not None, f"{rel}:{line} {fname} not found"
        path.write_text(text)
        try:
            for name in names:
                r = paper_runs.get(name)
                if sw._code_hash(r.fn, r.cache_name(), None, root=copy) == base[name]:
                    unchanged.append((name, rel, fname))
        finally:
            path.write_text(original)
        edited += 1
    assert edited > 50
    assert not unchanged, f"edits that left a grid's key unchanged: {unchanged}"
    for name, r in paper_runs.REGISTRY.items():          # the copy, restored, gives its keys again
        assert sw._code_hash(r.fn, r.cache_name(), None, root=copy) == base[name]


def test_an_unrelated_edit_keeps_the_key(tmp_path):
    """Precision: a grid's key does not cover code its cell cannot reach (another grid's summary figure, a
    module it does not import)."""
    copy = tmp_path / "curvlab"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "paper_frames"))
    r = paper_runs.get("ch30_mp_limit")
    key = sw._code_hash(r.fn, r.cache_name(), None)
    text = (copy / "paper_runs.py").read_text()
    line = paper_runs._summary_ch20.__code__.co_firstlineno
    (copy / "paper_runs.py").write_text(_edit(text, line, "_summary_ch20"))
    (copy / "singleindex.py").write_text((copy / "singleindex.py").read_text() + "\nEDITED = 1\n")
    assert sw._code_hash(r.fn, r.cache_name(), None, root=copy) == key
    ch20 = paper_runs.get("ch20_gn_flows")             # a cell's local names are not the module's functions
    key20 = sw._code_hash(ch20.fn, ch20.cache_name(), None, root=copy)
    assert "run" in ch20.fn.__code__.co_varnames and "data" in ch20.fn.__code__.co_varnames
    text = (copy / "paper_runs.py").read_text()
    for fn in (paper_runs.run, paper_runs.ch11_linrep_fig1):
        text = _edit(text, fn.__code__.co_firstlineno, fn.__name__)
    (copy / "paper_runs.py").write_text(text)
    assert sw._code_hash(ch20.fn, ch20.cache_name(), None, root=copy) == key20
    assert sw.code_reached(ch20.fn) == ["curvlab._validate", "curvlab.config", "curvlab.data", "curvlab.meanfield"]
    (copy / "linalg.py").write_text((copy / "linalg.py").read_text() + "\nEDITED = 1\n")
    assert sw._code_hash(r.fn, r.cache_name(), None, root=copy) != key


STALE = textwrap.dedent("""
    import io, json, sys, contextlib, warnings
    from pathlib import Path
    warnings.simplefilter("error", UserWarning)
    from curvlab import paper_runs, sweep
    cache, step = sys.argv[1], sys.argv[2]
    name = "ch32_leaky"
    frame = paper_runs.run(name, "quick", cache_dir=cache, progress=False)
    out = {"computed": int(frame.loc[~frame["_cached"], "m"].nunique()), "cells": int(frame["m"].nunique()),
           "kappa": frame.groupby("m").kappa.median().tolist()}
    if step == "first":   # commit the frame, as tools/run_sweeps.py --export does (the quick frame stands in)
        csv, meta = paper_runs.export(name, "quick", cache_dir=cache)
        for p in (csv, meta):
            p.rename(p.with_name(p.name.replace(".quick.", ".paper.")))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        paper_runs.section(name, "quick", cache_dir=cache)
    out["section"] = buf.getvalue()
    print(json.dumps(out))
""")


def test_stale_cache_demonstration(tmp_path):
    """Run a registered grid (ch32_leaky, quick) from a copy of the package and commit its frame; edit a
    function its cell calls (``deep_linear.leaky_relu_bound``) in the copy; in a fresh process the rerun
    recomputes every cell and the section says the committed frame predates the change."""
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT, pkg / "curvlab", ignore=shutil.ignore_patterns("__pycache__"))
    for old in (pkg / "curvlab" / "paper_frames").glob("ch32_leaky.*"):
        old.unlink()
    env = {**os.environ, "PYTHONPATH": str(pkg), "CURVLAB_PROFILE": "quick", "OMP_NUM_THREADS": "1",
           "MPLBACKEND": "Agg"}
    env.pop(sw.BACKEND_ENV, None)
    script = tmp_path / "stale.py"
    script.write_text(STALE)
    cache = tmp_path / "cache"

    def step(which):
        done = subprocess.run([sys.executable, str(script), str(cache), which], env=env, capture_output=True,
                              text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = step("first")
    assert first["computed"] == first["cells"] == 4
    again = step("again")
    assert again["computed"] == 0 and "(the current code's)" in again["section"]
    target = pkg / "curvlab" / "deep_linear.py"
    text = target.read_text()
    import curvlab.deep_linear as dl

    line = dl.leaky_relu_bound.__code__.co_firstlineno
    target.write_text(_edit(text, line, "leaky_relu_bound"))
    edited = step("edited")
    assert edited["computed"] == edited["cells"] == 4, "an edit of a called function must recompute every cell"
    assert edited["kappa"] == first["kappa"]            # the edit ('pass;') changes no number
    assert "(the current code's)" not in edited["section"] and "not this build's" in edited["section"]


# ======================================================================================== the files
class Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_cells_are_npy_and_json_without_pickles(tmp_path):
    frame = run(frame_cell, grid(a=[1.5]), tmp_path, name="f")
    (path,) = (tmp_path / "f").glob("*.npz")
    with np.load(path, allow_pickle=False) as z:               # readable with pickles disallowed
        meta = json.loads(z["meta"].tobytes())
        assert all(z[n].dtype != object for n in z.files)
    assert meta["format"] == sw.CACHE_FORMAT and meta["key"] == path.stem and meta["config_json"] == '{"a":1.5}'
    again = run(frame_cell, grid(a=[1.5]), tmp_path, name="f")
    assert again["_cached"].all() and CALLS == [1.5]
    pd.testing.assert_frame_equal(again.drop(columns=["_cached", "_wall_s"]),
                                  frame.drop(columns=["_cached", "_wall_s"]))
    assert again["z"].dtype == np.complex128 and again["name"].tolist()[::2] == ["p", "q"]


def test_a_planted_pickle_is_never_unpickled(tmp_path):
    run(cell, grid(a=[1, 2]), tmp_path, name="c")
    marker = tmp_path / "pwned"
    (tmp_path / "c" / ("0" * 32 + ".pkl")).write_bytes(pickle.dumps(Boom(marker)))   # an old-format cell
    victim = sorted((tmp_path / "c").glob("*.npz"))[0]
    victim.write_bytes(pickle.dumps(Boom(marker)))                                    # a pickle as a cell
    with pytest.warns(CacheWarning) as record:
        frame = run(cell, grid(a=[1, 2]), tmp_path, name="c")
    text = " ".join(str(w.message) for w in record)
    assert "never opened" in text and "ignoring" in text
    assert n_computed(frame) == 1 and frame["y"].tolist() == [10, 20] and not marker.exists()
    with pytest.warns(CacheWarning, match="never opened"):
        info = sw.cache_info(tmp_path, "c")
    assert len(info) == 2 and not marker.exists()
    assert sw.clear_cache(tmp_path, "c") == 3 and not marker.exists()


def test_swapped_copied_and_edited_cells_are_refused(tmp_path):
    run(cell, grid(a=[1, 2, 3]), tmp_path, name="c")
    paths = {json.loads(np.load(p)["meta"].tobytes())["config_json"]: p for p in (tmp_path / "c").glob("*.npz")}
    one, two, three = paths['{"a":1}'], paths['{"a":2}'], paths['{"a":3}']
    b1, b2 = one.read_bytes(), two.read_bytes()
    one.write_bytes(b2)
    two.write_bytes(b1)                                   # swapped
    CALLS.clear()
    with pytest.warns(CacheWarning, match="copied or renamed"):
        frame = run(cell, grid(a=[1, 2, 3]), tmp_path, name="c")
    assert sorted(CALLS) == [1, 2] and frame["y"].tolist() == [10, 20, 30]
    shutil.copyfile(three, one)                           # copied under another key
    CALLS.clear()
    with pytest.warns(CacheWarning, match="copied or renamed"):
        frame = run(cell, grid(a=[1, 2, 3]), tmp_path, name="c")
    assert CALLS == [1] and frame["y"].tolist() == [10, 20, 30]
    # a copy that keeps its recorded key but sits in another experiment's folder, with other code
    (tmp_path / "d").mkdir()
    shutil.copyfile(one, tmp_path / "d" / one.name)
    with pytest.warns(CacheWarning, match="another experiment"):
        assert n_computed(run(cell, grid(a=[1]), tmp_path, name="d")) == 1
    # an edited value (1 %): the content no longer matches its digest
    # (a byte flipped in place fails the zip's own CRC; a careful edit rewrites the archive)
    meta = json.loads(np.load(two)["meta"].tobytes())
    assert meta["rows"]["records"] == [{"y": 20}]
    meta["rows"]["records"] = [{"y": 20.2}]
    np.savez(two, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    CALLS.clear()
    with pytest.warns(CacheWarning, match="digest"):
        frame = run(cell, grid(a=[1, 2, 3]), tmp_path, name="c")
    assert CALLS == [2] and frame["y"].tolist() == [10, 20, 30]
    assert run(cell, grid(a=[1, 2, 3]), tmp_path, name="c")["_cached"].all()   # rewritten, trusted again


def test_a_cell_of_other_code_under_the_right_name_is_refused(tmp_path, monkeypatch):
    """A cell renamed to the key of the current code but recording another code hash (a forged or hand-renamed
    file) is a miss."""
    run(cell, grid(a=[1]), tmp_path, name="c")
    (old,) = (tmp_path / "c").glob("*.npz")
    code = sw._code_hash(cell, "c", "v2")
    new = old.with_name(sw._sha('{"a":1}', code)[:32] + ".npz")
    meta_blob = json.loads(np.load(old)["meta"].tobytes())
    meta_blob["key"] = new.stem
    with np.load(old) as z:
        arrays = {n: z[n] for n in z.files if n != "meta"}
    np.savez(new, meta=np.frombuffer(json.dumps(meta_blob).encode(), np.uint8), **arrays)
    CALLS.clear()
    with pytest.warns(CacheWarning, match="another code hash"):
        assert n_computed(run(cell, grid(a=[1]), tmp_path, name="c", code_version="v2")) == 1


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_cell_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        run(cell, grid(a=[1]), tmp_path, name="c")
    finally:
        os.umask(old)
    (path,) = (tmp_path / "c").glob("*.npz")
    assert path.stat().st_mode & 0o777 == mode


def test_provenance_records_threads_and_code_modules(tmp_path):
    run(cell, grid(a=[1]), tmp_path, name="c")
    info = sw.cache_info(tmp_path, "c")
    assert info.loc[0, "torch_threads"] == torch.get_num_threads()
    assert {"openmp_threads", "blas_threads"} <= set(info.columns)
    (path,) = (tmp_path / "c").glob("*.npz")
    prov = json.loads(np.load(path)["meta"].tobytes())["provenance"]
    assert prov["code_modules"] == [] and prov["torch_interop_threads"] == torch.get_num_interop_threads()
