"""Tests of :mod:`curvlab.sweep` (grids, tidy frames, the code-keyed cache, parallelism) and :mod:`curvlab.progress`."""

from __future__ import annotations

import json

import importlib.util
import sys
import threading

import joblib
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import curvlab.sweep as sw
from curvlab.progress import progress
from curvlab.sweep import CellError, cache_info, clear_cache, grid, sweep

CALLS: list = []  # cells computed in this process (n_jobs=1 runs in-process)
FAIL_ON: set = set()  # configurations of `flaky` that raise


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    CALLS.clear()
    FAIL_ON.clear()
    monkeypatch.delenv("CURVLAB_BOOK_BUILD", raising=False)
    monkeypatch.delenv("CURVLAB_PROGRESS", raising=False)


def run(fn, configs, cache_dir, **kw):
    return sweep(fn, configs, cache_dir=cache_dir, progress=False, **kw)


def n_computed(frame: pd.DataFrame) -> int:
    """Configurations computed (not read from the cache) in a frame with one row per configuration."""
    return int((~frame["_cached"]).sum())


# ------------------------------------------------------------------------- experiment functions


def one_row(a, b=0):
    CALLS.append((a, b))
    return {"y": a + b, "z": torch.tensor(0.5) * a, "device": "cpu"}


def several_rows(a, b=0):
    CALLS.append((a, b))
    return [{"step": t, "loss": (a + b) / (t + 1)} for t in range(3)]


def frame_rows(a, b=0):
    CALLS.append((a, b))
    return pd.DataFrame({"step": [0, 1], "loss": [float(a), float(b)]})


def flaky(a):
    CALLS.append(a)
    if a in FAIL_ON:
        raise RuntimeError("boom")
    return {"y": 2 * a}


def thread_name(a):
    return {"thread": threading.current_thread().name}


# ---------------------------------------------------------------------------------------- grid


def test_grid_order_is_nested_loops():
    assert grid(a=[1, 2], b=["x", "y"]) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"},
    ]
    methods = [{"method": "gd", "lr": 0.1}, {"method": "kfac", "lr": 1.0}]
    assert grid(methods, seed=range(2)) == [
        {"method": "gd", "lr": 0.1, "seed": 0}, {"method": "gd", "lr": 0.1, "seed": 1},
        {"method": "kfac", "lr": 1.0, "seed": 0}, {"method": "kfac", "lr": 1.0, "seed": 1},
    ]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(), min_size=1, max_size=3, unique=True), min_size=1, max_size=3))
def test_grid_is_the_cartesian_product(axes):
    kwargs = {f"k{i}": values for i, values in enumerate(axes)}
    configs = grid(**kwargs)
    assert len(configs) == int(np.prod([len(v) for v in axes]))
    assert len({tuple(c.items()) for c in configs}) == len(configs)
    last = list(kwargs)[-1]
    assert [c[last] for c in configs[: len(axes[-1])]] == axes[-1]  # last axis varies fastest


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "needle"),
    [
        ((), {}, ValueError, "axis"),
        ((), {"a": 3}, TypeError, "a must be a list"),
        ((), {"a": "xy"}, TypeError, "a must be a list"),
        ((), {"a": []}, ValueError, "a must hold"),
        (([1],), {}, TypeError, "blocks[0][0]"),
        (([{"a": 1}],), {"a": [2]}, ValueError, "'a'"),
    ],
)
def test_grid_errors(args, kwargs, error, needle):
    with pytest.raises(error) as info:
        grid(*args, **kwargs)
    assert needle in str(info.value)


# --------------------------------------------------------------------------------- tidy frames


def test_tidy_frame_from_dicts(tmp_path):
    frame = run(one_row, grid(a=[1, 2], b=[10]), tmp_path)
    assert list(frame.columns) == ["a", "b", "y", "z", "device", "_cached", "_wall_s"]
    assert frame[["a", "b", "y", "z"]].values.tolist() == [[1, 10, 11, 0.5], [2, 10, 12, 1.0]]
    assert isinstance(frame.loc[0, "z"], float)  # 0-d tensors become numbers
    assert frame["_cached"].dtype == bool and (frame["_wall_s"] >= 0).all()


def test_tidy_frame_from_lists_of_dicts(tmp_path):
    frame = run(several_rows, grid(a=[1, 2], b=[0]), tmp_path)
    assert len(frame) == 6
    assert frame["a"].tolist() == [1, 1, 1, 2, 2, 2] and frame["step"].tolist() == [0, 1, 2] * 2
    assert frame.loc[5, "loss"] == pytest.approx(2 / 3)


def test_tidy_frame_from_dataframes(tmp_path):
    frame = run(frame_rows, grid(a=[1, 2], b=[7]), tmp_path)
    assert list(frame.columns[:4]) == ["a", "b", "step", "loss"]
    assert frame["loss"].tolist() == [1.0, 7.0, 2.0, 7.0]
    assert frame.index.tolist() == [0, 1, 2, 3]


def test_tuple_values_stay_whole_and_configs_may_differ(tmp_path):
    configs = [{"a": 1, "shape": (2, 3)}, {"a": 2}]
    frame = run(lambda a, shape=None: {"y": a}, configs, tmp_path, name="tuples")
    assert frame.loc[0, "shape"] == (2, 3) and pd.isna(frame.loc[1, "shape"])


# ------------------------------------------------------------------------------------- caching


def test_second_call_computes_nothing(tmp_path):
    first = run(one_row, grid(a=[1, 2, 3]), tmp_path)
    assert len(CALLS) == 3 and n_computed(first) == 3
    second = run(one_row, grid(a=[1, 2, 3]), tmp_path)
    assert len(CALLS) == 3 and second["_cached"].all()
    pd.testing.assert_frame_equal(first.drop(columns="_cached"), second.drop(columns="_cached"))
    assert not list(tmp_path.rglob("*.tmp"))


def test_extended_grid_computes_only_new_cells(tmp_path):
    run(several_rows, grid(a=[1, 2], b=[0]), tmp_path)
    CALLS.clear()
    frame = run(several_rows, grid(a=[1, 2, 3], b=[0, 1]), tmp_path)
    assert sorted(CALLS) == [(1, 1), (2, 1), (3, 0), (3, 1)]
    assert frame.groupby(["a", "b"])["_cached"].first().sum() == 2


def test_failing_cell_names_config_and_keeps_finished_cells(tmp_path):
    FAIL_ON.add(2)
    with pytest.raises(CellError, match=r"configs\[2\] = \{'a': 2\}.*boom") as info:
        run(flaky, grid(a=[0, 1, 2, 3]), tmp_path)
    assert info.value.config == {"a": 2}
    FAIL_ON.clear()
    CALLS.clear()
    frame = run(flaky, grid(a=[0, 1, 2, 3]), tmp_path)
    assert sorted(CALLS) == [2, 3] and frame["_cached"].tolist() == [True, True, False, False]


def test_key_ignores_dict_order_and_numpy_scalars(tmp_path):
    run(one_row, [{"a": 1, "b": 2}], tmp_path)
    frame = run(one_row, [{"b": np.int64(2), "a": np.int64(1)}], tmp_path)
    assert len(CALLS) == 1 and frame["_cached"].all()
    run(one_row, [{"a": 1.0, "b": 2}], tmp_path)  # a float is another configuration than an int
    assert len(CALLS) == 2


def test_corrupt_cell_is_recomputed(tmp_path):
    run(one_row, grid(a=[1]), tmp_path)
    (cell,) = tmp_path.rglob("*.npz")
    cell.write_bytes(b"not a cell")
    with pytest.warns(sw.CacheWarning, match="ignoring"):
        frame = run(one_row, grid(a=[1]), tmp_path)
    assert n_computed(frame) == 1 and frame.loc[0, "y"] == 1


MODULE_V1 = """
def helper(a):
    return a

def experiment(a):
    CALLS.append(a)
    return {"y": helper(a)}

CALLS = []
"""


def _load_module(path, name, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_changed_function_source_invalidates(tmp_path, monkeypatch):
    source = tmp_path / "sweep_tmp_mod.py"
    source.write_text(MODULE_V1)
    cache = tmp_path / "cache"
    v1 = _load_module(source, "sweep_tmp_mod", monkeypatch)
    assert run(v1.experiment, grid(a=[1, 2]), cache)["y"].tolist() == [1, 2]
    assert n_computed(run(v1.experiment, grid(a=[1, 2]), cache)) == 0

    source.write_text(MODULE_V1.replace('{"y": helper(a)}', '{"y": 10 * helper(a)}'))
    v2 = _load_module(source, "sweep_tmp_mod", monkeypatch)
    frame = run(v2.experiment, grid(a=[1, 2]), cache)
    assert v2.CALLS == [1, 2] and frame["y"].tolist() == [10, 20]

    # same function source, changed helper in its module: also invalidates
    source.write_text(MODULE_V1.replace('{"y": helper(a)}', '{"y": 10 * helper(a)}').replace("return a", "return -a"))
    v3 = _load_module(source, "sweep_tmp_mod", monkeypatch)
    assert run(v3.experiment, grid(a=[1, 2]), cache)["y"].tolist() == [-10, -20]
    assert len(list((cache / "sweep_tmp_mod.experiment").glob("*.npz"))) == 6  # old cells stay until cleared


def uses_linalg(a):
    from curvlab import linalg

    return {"y": a, "rtol": float(linalg.default_rtol(4, torch.float64))}


def _edited(module):
    """A stand-in for an edit of ``module``'s file: its sha in every key changes."""
    real = sw._module_closure
    return lambda root, modules: {m: (h if m != module else "edited") for m, h in real(root, modules).items()}


def test_changed_curvlab_source_invalidates(tmp_path, monkeypatch):
    run(uses_linalg, grid(a=[1, 2]), tmp_path)
    assert "curvlab.linalg" in sw.code_reached(uses_linalg) and "curvlab.meanfield" not in sw.code_reached(uses_linalg)
    monkeypatch.setattr(sw, "_module_closure", _edited("curvlab.meanfield"))    # not reached: cells stay
    assert n_computed(run(uses_linalg, grid(a=[1, 2]), tmp_path)) == 0
    monkeypatch.setattr(sw, "_module_closure", _edited("curvlab.linalg"))
    assert n_computed(run(uses_linalg, grid(a=[1, 2]), tmp_path)) == 2
    assert n_computed(run(uses_linalg, grid(a=[1, 2]), tmp_path)) == 0


def test_code_version_and_sourceless_functions(tmp_path):
    namespace: dict = {}
    exec("def g(a):\n    return {'y': a}\n", namespace)  # no source file: inspect.getsource fails
    g = namespace["g"]
    with pytest.raises(ValueError, match="name=.*code_version="):
        run(g, grid(a=[1]), tmp_path)
    assert n_computed(run(g, grid(a=[1]), tmp_path, name="g", code_version="1")) == 1
    assert n_computed(run(g, grid(a=[1]), tmp_path, name="g", code_version="1")) == 0
    assert n_computed(run(g, grid(a=[1]), tmp_path, name="g", code_version="2")) == 1
    assert run(g, grid(a=[1]), False)["y"].tolist() == [1]  # no cache, no hash needed


def test_default_cache_dir_provenance_and_clearing(tmp_path, monkeypatch):
    monkeypatch.setenv("CURVLAB_CACHE_DIR", str(tmp_path))
    run(one_row, grid(a=[1, 2]), None, code_version="v7")
    info = cache_info(tmp_path)
    name = f"{one_row.__module__}.one_row"
    assert len(info) == 2 and set(info["name"]) == {name}
    assert info["device"].eq("cpu").all() and info["code_version"].eq("v7").all()
    assert info["revision"].map(type).eq(str).all() and (info["wall_s"] >= 0).all()
    assert info["code_hash"].nunique() == 1 and set(info["config"]) == {'{"a": 1}', '{"a": 2}'}
    assert clear_cache(tmp_path, name=name) == 2 and len(cache_info(tmp_path)) == 0


def test_default_cache_dir_is_at_the_checkout_root(tmp_path, monkeypatch):
    monkeypatch.delenv("CURVLAB_CACHE_DIR", raising=False)
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "notebooks")
    assert sw.default_cache_dir() == tmp_path / "repo" / ".curvlab_cache"


def test_cache_disabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CURVLAB_CACHE_DIR", str(tmp_path))
    run(one_row, grid(a=[1]), False)
    run(one_row, grid(a=[1]), False)
    assert len(CALLS) == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", [{1, 2}, object(), {"x": 1}, [1, object()], 1j, np.zeros(2)])
def test_unsupported_config_values_name_the_key(tmp_path, value):
    with pytest.raises(TypeError, match=r"configs\[1\]\['bad'\]"):
        run(one_row, [{"a": 1}, {"a": 2, "bad": value}], tmp_path)
    assert not CALLS


# ------------------------------------------------------------------------------------ parallel


def test_loky_matches_sequential(tmp_path):
    configs = grid(a=[1, 2, 3, 4], b=[0, 5])
    sequential = run(several_rows, configs, False, backend="sequential")
    parallel = run(several_rows, configs, tmp_path, n_jobs=2, backend="loky")
    pd.testing.assert_frame_equal(sequential.drop(columns="_wall_s"), parallel.drop(columns="_wall_s"))
    cached = run(several_rows, configs, tmp_path)  # the workers wrote every cell
    assert cached["_cached"].all()


def test_backend_none_follows_joblib_context():
    with joblib.parallel_config(backend="threading"):
        frame = run(thread_name, grid(a=[1, 2, 3]), False, n_jobs=2)
    assert "MainThread" not in set(frame["thread"])


# ------------------------------------------------------------------------------------ progress


def test_progress_is_plain_in_book_builds(monkeypatch, capsys):
    items = range(3)
    bar = progress(items, desc="x")
    assert bar is not items and list(bar) == [0, 1, 2]
    monkeypatch.setenv("CURVLAB_PROGRESS", "0")
    assert progress(items) is items
    monkeypatch.delenv("CURVLAB_PROGRESS")
    monkeypatch.setenv("CURVLAB_BOOK_BUILD", "1")
    assert progress(items, total=3) is items
    capsys.readouterr()
    sweep(one_row, grid(a=[1, 2]), cache_dir=False)
    assert capsys.readouterr().err == ""  # no bar printed during a book build


# ---------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("fn", "configs", "kwargs", "error", "needle"),
    [
        (3, [{"a": 1}], {}, TypeError, "fn"),
        (one_row, [], {}, ValueError, "configs"),
        (one_row, {"a": 1}, {}, TypeError, "configs"),
        (one_row, [1], {}, TypeError, "configs[0]"),
        (one_row, [{1: 2}], {}, TypeError, "configs[0]"),
        (one_row, [{"a": 1}, {"a": 1}], {}, ValueError, "configs[1] repeats configs[0]"),
        (one_row, [{"a": 1}], {"n_jobs": 0}, ValueError, "n_jobs"),
        (one_row, [{"a": 1}], {"n_jobs": 1.5}, TypeError, "n_jobs"),
        (one_row, [{"a": 1}], {"backend": "nope"}, ValueError, "backend"),
        (one_row, [{"a": 1}], {"backend": 3}, TypeError, "backend"),
        (one_row, [{"a": 1}], {"progress": "yes"}, TypeError, "progress"),
        (one_row, [{"a": 1}], {"name": "a/b"}, ValueError, "name"),
        (one_row, [{"a": 1}], {"code_version": 1}, TypeError, "code_version"),
        (one_row, [{"a": 1}], {"cache_dir": 3}, TypeError, "cache_dir"),
    ],
)
def test_bad_inputs_name_the_argument(tmp_path, fn, configs, kwargs, error, needle):
    kwargs = {"cache_dir": tmp_path, "progress": False, **kwargs}
    with pytest.raises(error) as info:
        sweep(fn, configs, **kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("result", "error", "needle"),
    [
        (3, TypeError, "fn returned a int for configs[0] = {'a': 1}"),
        ({"y": [1, 2]}, TypeError, "column 'y'"),
        ([{"y": 1}, 2], TypeError, "configs[0]"),
        ({"a": 1.0}, ValueError, "['a']"),
        ({"_cached": 1.0}, ValueError, "['_cached']"),
    ],
)
def test_bad_results_name_the_config_and_are_not_cached(tmp_path, result, error, needle):
    with pytest.raises(error) as info:
        run(lambda a: result, [{"a": 1}], tmp_path, name="bad")
    assert needle in str(info.value)
    assert not list(tmp_path.rglob("*.npz"))


# ------------------------------------------------------------------------ scoped code hash, cache-only reads


def test_code_modules_scope_the_hash_and_compute_false_only_reads(tmp_path, monkeypatch):
    configs = grid(a=[1, 2])
    run(one_row, configs, tmp_path, name="scoped", code_modules=["sweep", "config"])
    real = sw._module_closure
    monkeypatch.setattr(sw, "_module_closure", _edited("curvlab.meanfield"))
    again = run(one_row, configs, tmp_path, name="scoped", code_modules=["sweep", "config"])
    assert again["_cached"].all()  # an edit outside the modules reached and listed keeps the cells
    monkeypatch.setattr(sw, "_module_closure", _edited("curvlab.config"))       # a listed module's edit does not
    assert n_computed(run(one_row, configs, tmp_path, name="scoped", code_modules=["sweep", "config"])) == 2
    monkeypatch.setattr(sw, "_module_closure", real)
    read = run(one_row, configs[:1], tmp_path, name="scoped", code_modules=["sweep", "config"], compute=False)
    assert read["_cached"].all() and read["y"].tolist() == [1]
    with pytest.raises(sw.MissingCells) as info:
        run(one_row, grid(a=[1, 3]), tmp_path, name="scoped", code_modules=["sweep", "config"], compute=False)
    assert info.value.done == 1 and info.value.missing == [{"a": 3}]
    with pytest.raises(ValueError, match="code_modules"):
        run(one_row, configs, tmp_path, code_modules=["no_such_module"])
    with pytest.raises(TypeError, match="code_modules"):
        run(one_row, configs, tmp_path, code_modules="sweep")
    with pytest.raises(ValueError, match="compute=False"):
        run(one_row, configs, False, compute=False)


# ------------------------------------------------------------------------------ paper-scale registry


def test_paper_runs_registry_run_and_load(tmp_path):
    from curvlab import paper_runs

    assert {"ch20_gn_flows", "ch21_regimes", "ch22_real_data", "ch30_mp_limit", "ch31_depth_law",
            "ch32_leaky"} <= set(paper_runs.names())
    for r in paper_runs.REGISTRY.values():
        for prof in ("quick", "standard", "paper"):
            cfgs = r.configs(prof)
            assert cfgs and all(np.isfinite(r.flops(**c)) and r.flops(**c) > 0 for c in cfgs)
    est = paper_runs.estimate("paper", flops_per_s=1e13)
    assert (est["cells"] > 0).all() and (est["hours_at_rate"] > 0).all()
    assert "MNIST" in est.set_index("name").loc["ch22_real_data", "data"]
    with pytest.raises(sw.MissingCells, match="make sweeps PROFILE=quick ONLY=ch30_mp_limit"):
        paper_runs.load("ch30_mp_limit", "quick", cache_dir=tmp_path)
    frame = paper_runs.run("ch30_mp_limit", "quick", cache_dir=tmp_path, progress=False)
    loaded = paper_runs.load("ch30_mp_limit", "quick", cache_dir=tmp_path)
    assert loaded.frame["_cached"].all() and len(loaded.frame) == len(frame)
    assert loaded.command == "make sweeps PROFILE=quick ONLY=ch30_mp_limit"
    prov = loaded.provenance
    assert len(prov) == 3 and prov["revision"].notna().all() and (prov["wall_s"] > 0).all()
    assert set(prov["device"]) == {None} or prov["device"].notna().any()
    with pytest.raises(ValueError, match="registered paper runs"):
        paper_runs.get("ch99")


def _tiny(name, keep=None):
    """The registered grid `name` shrunk to a few tiny cells (every profile), for tests of the section."""
    from dataclasses import replace

    from curvlab import paper_runs

    small = {"ch20_gn_flows": dict(n=12, m=8, seeds=[0], max_steps=3),
             "ch21_regimes": dict(n=12, m=8, n_test=16, seeds=[0], max_steps=3),
             "ch22_real_data": dict(n=10, m=6, n_test=16, seeds=[0], max_steps=2),
             "ch30_mp_limit": dict(R=3), "ch31_depth_law": dict(depths=[32, 40], R=2),
             "ch32_leaky": dict(R=1, n_images=8),
             "ch11_linrep_fig1": dict(d=10, k=2, d_y=4, n=30, steps=4, seeds=2, tune_seeds=1, tune_steps=3,
                                      record_every=2),
             "ch12_single_index": dict(d=16, replicates=3, m=16, n_test=40)}[name]
    r = paper_runs.get(name)
    cfgs = r.configs("quick")
    cfgs = [dict(c, **small) for c in (cfgs[:2] + cfgs[-1:] if len(cfgs) > 2 else cfgs)]
    cfgs = list({str(sorted(c.items())): c for c in cfgs}.values())[:keep]
    return replace(r, grids={p: (lambda cfgs=cfgs: cfgs) for p in ("quick", "standard", "paper")})


@pytest.mark.parametrize("name", ["ch20_gn_flows", "ch21_regimes", "ch22_real_data", "ch30_mp_limit",
                                  "ch31_depth_law", "ch32_leaky", "ch11_linrep_fig1", "ch12_single_index"])
def test_paper_run_summary_draws_its_frame(name):
    from curvlab import paper_runs

    r = _tiny(name)
    frame = sw.sweep(r.fn, r.configs("quick"), cache_dir=False, progress=False)
    fig, alt, caption = r.summary(frame)
    assert fig.axes and len(alt) > 40 and len(caption) > 40
    assert any(ax.lines for ax in fig.axes)                      # something was drawn from the frame


def test_paper_run_section_reads_computes_and_reports_partial_grids(tmp_path, monkeypatch, capsys):
    from curvlab import paper_runs

    monkeypatch.setenv("CURVLAB_PROFILE", "quick")
    monkeypatch.setattr(paper_runs, "FRAMES_DIR", tmp_path / "no-committed-frames")
    slow = _tiny("ch21_regimes")
    cheap = _tiny("ch30_mp_limit")
    monkeypatch.setitem(paper_runs.REGISTRY, "ch21_regimes", slow)
    monkeypatch.setitem(paper_runs.REGISTRY, "ch30_mp_limit", cheap)
    # nothing cached: only the note and the command, no figure, nothing computed (quick: every grid is read)
    for name in ("ch21_regimes", "ch30_mp_limit"):
        sec = paper_runs.section(name, cache_dir=tmp_path)
        assert sec.done == 0 and sec.figure is None and sec.frame.empty
        assert f"make sweeps PROFILE=quick ONLY={name}" in capsys.readouterr().out
    assert cache_info(tmp_path).empty
    # one cell of three run by `make sweeps`: the section shows it and says the rest is missing
    monkeypatch.setitem(paper_runs.REGISTRY, "ch21_regimes", _tiny("ch21_regimes", keep=1))
    paper_runs.run("ch21_regimes", "quick", cache_dir=tmp_path, progress=False)
    monkeypatch.setitem(paper_runs.REGISTRY, "ch21_regimes", slow)
    sec = paper_runs.section("ch21_regimes", cache_dir=tmp_path)
    out = capsys.readouterr().out
    assert (sec.done, sec.total) == (1, len(slow.configs("quick"))) and sec.figure is not None
    assert "Partial: 1 of" in sec.figure.caption and "not in the cache" in out and "provenance: 1 cells" in out
    assert len(sec.provenance) == 1 and sec.provenance["wall_s"].iloc[0] > 0
    # paper profile: a cheap (Part III) grid is computed in the book, a costly one never is
    monkeypatch.setenv("CURVLAB_PROFILE", "paper")
    sec = paper_runs.section("ch30_mp_limit", cache_dir=tmp_path)
    assert sec.done == sec.total == len(cheap.configs("paper")) and sec.figure is not None
    assert set(sec.frame["device"]) == {"cpu"} and "computed in the book" in capsys.readouterr().out
    sec = paper_runs.section("ch21_regimes", cache_dir=tmp_path)
    assert sec.done == 1                                         # the same tiny grid in every profile: 1 cached
    with pytest.raises(ValueError, match="registered paper runs"):
        paper_runs.section("ch99", cache_dir=tmp_path)


def test_committed_frames_round_trip_and_stand_in_for_the_cache(tmp_path, monkeypatch, capsys):
    """`export` writes a complete grid with its provenance; `committed` reads it back (lists intact); every
    profile's section then shows the committed paper-profile frame, and says when it was made by other code."""
    from curvlab import paper_runs

    frames = tmp_path / "frames"
    monkeypatch.setattr(paper_runs, "FRAMES_DIR", frames)
    monkeypatch.setitem(paper_runs.REGISTRY, "ch31_depth_law", _tiny("ch31_depth_law"))
    cache = tmp_path / "cache"
    assert paper_runs.committed("ch31_depth_law") is None
    with pytest.raises(sw.MissingCells, match="make sweeps PROFILE=paper ONLY=ch31_depth_law"):
        paper_runs.export("ch31_depth_law", "paper", cache_dir=cache)          # nothing run: nothing to commit
    frame = paper_runs.run("ch31_depth_law", "paper", cache_dir=cache, progress=False)
    csv, meta = paper_runs.export("ch31_depth_law", "paper", cache_dir=cache)
    assert csv.parent == frames and csv.name == "ch31_depth_law.paper.csv" and meta.is_file()
    got = paper_runs.committed("ch31_depth_law")
    assert list(got.frame["depths"].iloc[0]) == [32, 40]                        # the list column survives
    np.testing.assert_allclose(got.frame["log_kappa"].to_numpy(), frame["log_kappa"].to_numpy(), rtol=1e-8)  # 9 digits
    prov = got.provenance
    assert prov["cells"] == 1 and prov["rows"] == len(frame) and prov["wall_s"] > 0 and prov["devices"] == ["cpu"]
    assert prov["revisions"] and prov["command"] == "make sweeps PROFILE=paper ONLY=ch31_depth_law"
    for prof in ("quick", "standard"):                                         # an empty cache in every profile
        monkeypatch.setenv("CURVLAB_PROFILE", prof)
        sec = paper_runs.section("ch31_depth_law", cache_dir=tmp_path / "empty")
        out = " ".join(capsys.readouterr().out.split())
        assert "committed paper-profile frame" in out and "(the current code's)" in out
        assert sec.figure is not None and "Committed paper-profile frame" in sec.figure.caption
        assert sec.done == sec.total == 1 and len(sec.frame) == len(frame)
    stale = json.loads(meta.read_text())
    stale["code_hash"] = "0" * 64
    meta.write_text(json.dumps(stale))
    paper_runs.section("ch31_depth_law", cache_dir=tmp_path / "empty")
    out = " ".join(capsys.readouterr().out.split())
    assert "(the current code's)" not in out and "not this build's" in out and "made by other code" in out
    with pytest.raises(ValueError, match="profile must be one of"):
        paper_runs.export("ch31_depth_law", "huge", cache_dir=cache)


def test_section_without_a_committed_paper_frame_estimates_device_hours(tmp_path, monkeypatch, capsys):
    from curvlab import paper_runs

    monkeypatch.setattr(paper_runs, "FRAMES_DIR", tmp_path / "none")
    monkeypatch.setenv("CURVLAB_PROFILE", "standard")
    paper_runs.section("ch21_regimes", cache_dir=tmp_path)
    out = " ".join(capsys.readouterr().out.split())
    assert "is not committed" in out and "device-hours at an assumed 1e+13 flop/s" in out and "not a measurement" in out


def test_hidden_learning_summary_bands_span_the_seeds_of_the_best_step():
    from curvlab import paper_runs

    rows = [dict(act=a, init_std=s, method=m, lr=lr, seed=k, n=10, m=20, status="converged",
                 test_loss=0.1 * (1 + k) + (lr or 0) * 0.01)
            for a in ("relu", "silu") for s in (0.01, 1.0) for m, lrs in (("GN", (1.0, 10.0)), ("RF", (None,)))
            for lr in lrs for k in range(3)]
    fig, _, _ = paper_runs.get("ch21_regimes").summary(pd.DataFrame(rows))
    gn_band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    assert np.isclose(gn_band.min(), 0.11) and np.isclose(gn_band.max(), 0.31)   # lr = 1 (best), all three seeds


# ------------------------------------------------------------------------------ Part I's paper-scale grids


def test_ch11_grid_is_the_chapter_config_file():
    """The registry's copy of notebooks/configs/linrep_fig1.yml (a pip-installed curvlab has no notebooks folder)
    equals the file, in every profile: sizes, problem, fixed settings and tuning grids."""
    from pathlib import Path

    import yaml

    from curvlab import paper_runs

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "notebooks/configs/linrep_fig1.yml").read_text())
    at = lambda node, prof: node[prof] if isinstance(node, dict) else node  # noqa: E731
    for prof in ("quick", "standard", "paper"):
        cells = paper_runs.get("ch11_linrep_fig1").configs(prof)
        assert [c["method"] for c in cells] == ["AMGD", "K-FAC", "DFW", "NGD", "Adam", "Shampoo",
                                                "whitening+AMGD", "batchnorm+AMGD"]
        for c in cells:
            for key in ("d", "k", "d_y", "kappa_x", "kappa_F", "x_dist", "noise", "transfer_kappa", "tune_seed"):
                assert c[key] == at(cfg["problem"][key], prof), (prof, key)
            assert c["problem_seed"] == cfg["problem"]["seed"]
            assert c["iso_kappa_x"] == cfg["isotropic_control"]["kappa_x"]
            for key in ("n", "steps", "seeds", "tune_seeds", "tune_steps", "record_every"):
                assert c[key] == at(cfg["run"][key], prof), (prof, key)
            assert c["speed_level"] == cfg["speed"]["level"]
            if c["method"] in ("NGD", "Adam", "Shampoo"):
                assert c["hp"] is None and json.loads(c["grid"]) == cfg["grids"][c["method"]]
            else:
                assert c["grid"] is None and json.loads(c["hp"]) == cfg["methods"][c["method"]]


def test_ch11_cell_tunes_by_the_chapter_rule_and_runs_both_problems():
    """A tuned method's cell picks the grid value of smallest mean tail score (grid_scores, the chapter's rule),
    flags a choice at the grid's edge, and reports the traces of every seed on both problems."""
    from curvlab import linrep_baselines as baselines
    from curvlab import paper_runs

    base = dict(paper_runs.get("ch11_linrep_fig1").configs("quick")[4])            # Adam
    base.update(d=10, k=2, d_y=4, n=30, steps=6, seeds=2, tune_seeds=2, tune_steps=4, record_every=2,
                grid=json.dumps({"eta_G": [1e-3, 0.1, 1.0]}))
    f = paper_runs.ch11_linrep_fig1(**base)
    assert set(f.problem) == {"anisotropic", "isotropic"} and f.tuned.all() and set(f.rule) == {"tail", "speed"}
    speed, f = f[f.rule == "speed"], f[f.rule == "tail"]
    assert len(f) == 2 * 2 * 4 and f.groupby("problem").seed.nunique().eq(2).all()   # steps 0, 2, 4, 6
    hp = json.loads(f.hp_used.iloc[0])
    # the same rule by hand: the tuning problem's first seeds, generator seed 1
    from dataclasses import fields, replace

    from curvlab import linrep

    tun = linrep.linrep_problem(2, d=10, k=2, d_y=4, kappa_x=100, kappa_F=3, x_dist="rademacher", noise=0.1,
                                transfer_kappa=100, seed=base["tune_seed"])
    tun = replace(tun, **{x.name: getattr(tun, x.name)[:2] for x in fields(tun)
                          if torch.is_tensor(getattr(tun, x.name))})
    cells = baselines.grid_scores("Adam", tun, 4, 30, {}, {"eta_G": [1e-3, 0.1, 1.0]}, record_every=2, seed=1)
    best = min(cells, key=lambda c: c[1].mean())
    assert hp == best[0] and np.isclose(f.tune_score.iloc[0], best[1].mean())
    assert (f.tuned_at_edge.iloc[0] == "eta_G") == (hp["eta_G"] in (1e-3, 1.0))
    runs = baselines.grid_runs("Adam", tun, 4, 30, {}, {"eta_G": [1e-3, 0.1, 1.0]}, record_every=2, seed=1)
    fast = min(baselines.score_runs(runs, 2, "speed", level=base["speed_level"]), key=lambda c: c[1].mean())
    assert json.loads(speed.hp_used.iloc[0]) == fast[0] and len(speed) == len(f)
    fixed = paper_runs.ch11_linrep_fig1(**{**base, "method": "K-FAC", "grid": None,
                                           "hp": json.dumps({"eta_G": 0.5, "lam_G": 1e-3, "lam_F": 0.0})})
    assert not fixed.tuned.any() and np.isnan(fixed.tune_score).all() and set(fixed.rule) == {"fixed"}


def test_ch12_cells_hold_simulation_theory_and_risk():
    from curvlab import paper_runs

    c = paper_runs.ch12_single_index("correlation", 16.0, 0.25, 24, 3, 12)
    sim = c[c.source == "simulation"]
    assert len(sim) == 3 * 7 and set(sim.estimator) == {"K-FAC", "SGD"}
    assert ((c.cos > -1) & (c.cos <= 1)).all() and len(c[(c.source == "theory") & (c.estimator == "K-FAC")]) == 80
    r = paper_runs.ch12_single_index("risk", 10.0, 0.25, 12, 2, 12, m=12, n_test=40)
    assert set(r.method) == {"RF", "SGD", "K-FAC"} and (r.rel_risk > 0).all() and r.lam_G.nunique() == 1
    with pytest.raises(ValueError, match="kind"):
        paper_runs.ch12_single_index("bias", 1.0, 0.25, 12, 2, 12)


@pytest.mark.parametrize("name", ["ch11_linrep_fig1", "ch12_single_index"])
def test_part_one_paper_frames_are_committed(name):
    """Part I's grids were run at the paper's sizes and committed: the whole paper grid, with its provenance."""
    from curvlab import paper_runs

    got = paper_runs.committed(name, "paper")
    assert got is not None, f"no committed paper frame for {name}: run tools/run_sweeps.py --profile paper --export"
    prov = got.provenance
    assert prov["profile"] == "paper" and prov["cells"] == len(paper_runs.get(name).configs("paper"))
    assert prov["wall_s"] > 0 and prov["devices"] and prov["revisions"] and len(got.frame) == prov["rows"]
