""":func:`curvlab.sweep.sweep` on cluster backends: Dask distributed on a local, loopback-only cluster of worker
processes (a worker killed mid-sweep loses nothing, and the rerun computes only the missing cells), and Ray when it
is importable. Run alone: ``pytest tests/test_sweep_cluster.py`` (about 20 s on two cores)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import joblib
import pytest

from curvlab.sweep import DASK_SCHEDULER_ENV, BACKEND_ENV, SweepIncomplete, grid, sweep

distributed = pytest.importorskip("distributed", reason='the cluster extra is not installed: pip install "curvlab[cluster]"')
cloudpickle = pytest.importorskip("cloudpickle")


# ------------------------------------------------------------------------ cells (pickled by value to workers)


def pid_cell(i):
    return {"y": i * i, "pid": os.getpid()}


def slow_cell(i, delay, marks):
    """Sleeps ``delay`` seconds; while it runs, a file ``<marks>/<pid>`` says which process is busy."""
    mark = Path(marks) / str(os.getpid())
    mark.write_text(str(i))
    time.sleep(delay)
    mark.unlink(missing_ok=True)
    return {"y": i * i}


@pytest.fixture(scope="module")
def client():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address="127.0.0.1:0", silence_logs=40)
    client = distributed.Client(cluster, set_as_default=False)
    client.run(__import__, "curvlab.sweep")                           # the workers' imports, once
    try:
        yield client
    finally:
        client.close()
        cluster.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in (BACKEND_ENV, DASK_SCHEDULER_ENV, "CURVLAB_BOOK_BUILD", "CURVLAB_PROGRESS"):
        monkeypatch.delenv(var, raising=False)


def _cells(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.rglob("*.pkl")}


# ------------------------------------------------------------------------------------------------- Dask


def test_environment_sends_an_unchanged_call_to_the_cluster(client, tmp_path, monkeypatch, capsys):
    """What a notebook does: a plain ``sweep(fn, configs)``; the environment picks the cluster."""
    monkeypatch.setenv(BACKEND_ENV, "dask")
    monkeypatch.setenv(DASK_SCHEDULER_ENV, client.scheduler.address)
    configs = grid(i=range(6))
    frame = sweep(pid_cell, configs, cache_dir=tmp_path, name="pids")
    assert frame["y"].tolist() == [i * i for i in range(6)]
    assert os.getpid() not in set(frame["pid"])                      # computed on the workers
    assert set(frame["pid"]) <= set(client.run(os.getpid).values())
    assert len(_cells(tmp_path)) == 6                                 # and cached with provenance
    assert "6/6" in capsys.readouterr().err                           # progress: completed/total
    again = sweep(pid_cell, configs + [{"i": 6}], cache_dir=tmp_path, name="pids")
    assert (~again["_cached"]).sum() == 1                             # only the new cell
    assert "7/7" in capsys.readouterr().err


def test_joblib_context_and_explicit_backend(client, tmp_path):
    configs = grid(i=range(4))
    with joblib.parallel_config(backend="dask", client=client):
        in_context = sweep(pid_cell, configs, cache_dir=False, progress=False)
    assert os.getpid() not in set(in_context["pid"])
    with distributed.Client(client.scheduler.address) as default:    # the process's default client
        assert distributed.get_client() is default
        explicit = sweep(pid_cell, configs, cache_dir=tmp_path, backend="dask", progress=False, name="pids")
    assert explicit[["i", "y"]].equals(in_context[["i", "y"]])


def test_worker_killed_mid_sweep_loses_nothing(client, tmp_path, monkeypatch):
    """SIGKILL a busy worker once two cells are cached, with Dask told not to retry a task whose worker died (by
    default it retries up to ``distributed.scheduler.allowed-failures`` = 3 times, and the sweep then simply
    finishes). The sweep runs every other cell to the end and raises SweepIncomplete; every cell written stays as
    it is, and the rerun computes exactly the cells that are missing."""
    client.wait_for_workers(2, timeout=120)
    monkeypatch.setenv(DASK_SCHEDULER_ENV, client.scheduler.address)
    scheduler = client.cluster.scheduler                              # in this process (LocalCluster)
    scheduler.allowed_failures = 0                                    # distributed.scheduler.allowed-failures
    marks = tmp_path / "running"
    marks.mkdir()
    cache = tmp_path / "cache"
    configs = grid(i=range(8), delay=[0.3], marks=[str(marks)])
    killed: list[int] = []

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [int(p.name) for p in marks.iterdir()] if len(_cells(cache) if cache.exists() else {}) >= 2 else []
            if busy:
                os.kill(busy[0], signal.SIGKILL)
                killed.append(busy[0])
                return
            time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        first = sweep(slow_cell, configs, cache_dir=cache, backend="dask", progress=False, name="slow")
        error = None
    except SweepIncomplete as exc:
        first, error = None, exc
    finally:
        thread.join(timeout=60)
        scheduler.allowed_failures = 3
    assert killed, "no busy worker was found to kill"
    before = _cells(cache)
    assert first is None and error is not None, "the sweep should report the cell lost with its worker"
    assert error.total == 8 and error.done == len(before) < 8 and "KilledWorker" in str(error)
    assert len(error.missing) == 8 - len(before) and "run the same call again" in str(error)
    rerun = sweep(slow_cell, configs, cache_dir=cache, backend="sequential", progress=False, name="slow")
    assert int((~rerun["_cached"]).sum()) == 8 - len(before)           # only the missing cells
    assert rerun["y"].tolist() == [i * i for i in range(8)]
    after = _cells(cache)
    changed = sorted(k for k, v in before.items() if after[k] != v)
    assert not changed, f"cells rewritten by the rerun: {changed}"   # nothing written before was redone


def test_dask_backend_without_a_client_starts_a_loopback_cluster(client, monkeypatch):
    """No scheduler address, no default client: a LocalCluster of worker processes on 127.0.0.1 (HTTP included),
    closed after the call. (The spy hands back the test cluster instead of starting one, to save the start-up.)"""
    monkeypatch.setattr(distributed, "get_client", lambda: (_ for _ in ()).throw(ValueError("no client")))
    started, closed = [], []

    class Borrowed(str):  # the test cluster's address, which a Client accepts in place of a cluster
        def close(self):
            closed.append(True)

    def spy(**kwargs):
        started.append(kwargs)
        return Borrowed(client.scheduler.address)

    monkeypatch.setattr(distributed, "LocalCluster", spy)
    frame = sweep(pid_cell, grid(i=range(2)), cache_dir=False, backend="dask", n_jobs=3, progress=False)
    assert frame["y"].tolist() == [0, 1] and os.getpid() not in set(frame["pid"])
    (kw,) = started
    assert kw["host"] == "127.0.0.1" and kw["processes"] is True and kw["n_workers"] == 2  # min(n_jobs, cells)
    assert kw["dashboard_address"].startswith("127.0.0.1:") and closed == [True]


def test_bad_backend_from_the_environment_is_named(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "slurm")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        sweep(pid_cell, grid(i=[1]), cache_dir=False, progress=False)


# -------------------------------------------------------------------------------------------------- Ray


def test_ray_backend(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (optional: pip install ray)")
    frame = sweep(pid_cell, grid(i=range(3)), cache_dir=tmp_path, backend="ray", n_jobs=2, progress=False)
    assert frame["y"].tolist() == [0, 1, 4]
    assert len(_cells(tmp_path)) == 3
