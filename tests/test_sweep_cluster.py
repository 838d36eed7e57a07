""":func:`curvlab.sweep.sweep` on cluster backends: Dask distributed on a local, loopback-only cluster of worker
processes (a worker killed mid-sweep: with Dask's retries the sweep finishes; without them, or on Ray, the call
stops with SweepIncomplete, nothing finished is lost, and the rerun computes only the missing cells), and Ray when
it is importable: a local Ray listens on the loopback interface only. Run alone: ``pytest
tests/test_sweep_cluster.py`` (about 20 s on two cores, a minute more with Ray installed)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import joblib
import pytest

from curvlab import sweep as sw
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
    return {p.name: p.read_bytes() for p in root.rglob("*.npz")}


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


def test_dask_retries_a_killed_worker_and_the_sweep_finishes(client, tmp_path, monkeypatch):
    """With Dask's default retries (``distributed.scheduler.allowed-failures`` = 3), a worker SIGKILLed mid-sweep
    costs nothing but time: its cell is recomputed on another worker and the call returns every cell."""
    client.wait_for_workers(2, timeout=120)
    monkeypatch.setenv(DASK_SCHEDULER_ENV, client.scheduler.address)
    assert client.cluster.scheduler.allowed_failures == 3
    marks = tmp_path / "running"
    marks.mkdir()
    configs = grid(i=range(6), delay=[0.3], marks=[str(marks)])
    killed = _kill_one_busy_worker(marks, tmp_path / "cache", after=1)
    frame = sweep(slow_cell, configs, cache_dir=tmp_path / "cache", backend="dask", progress=False, name="slow")
    killed.join(timeout=60)
    assert killed.pids, "no busy worker was found to kill"
    assert frame["y"].tolist() == [i * i for i in range(6)] and len(_cells(tmp_path / "cache")) == 6


def _kill_one_busy_worker(marks: Path, cache: Path, after: int) -> threading.Thread:
    """A thread that SIGKILLs one busy worker (it has a mark file) once ``after`` cells are cached."""
    def killer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            busy = [int(p.name) for p in marks.iterdir()] if len(_cells(cache) if cache.exists() else {}) >= after \
                else []
            if busy:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(busy[0], signal.SIGKILL)
                    thread.pids.append(busy[0])
                return
            time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.pids = []
    thread.start()
    return thread


# -------------------------------------------------------------------------------------------------- Ray


class _FakeRay:
    """Stands in for ``ray``: records what :func:`sweep` passes to ``ray.init`` and the environment then."""

    def __init__(self):
        self.calls, self.up = [], False
        self.util = types.SimpleNamespace(joblib=types.SimpleNamespace(register_ray=lambda: None))

    def is_initialized(self):
        return self.up

    def init(self, **kwargs):
        self.calls.append((kwargs, os.environ.get(sw._RAY_LOOPBACK_ENV)))
        self.up = True

    def shutdown(self):
        self.up = False


def test_a_local_ray_is_started_on_the_loopback_interface_fake(monkeypatch):
    """Without Ray installed: the arguments of ``ray.init`` for a local Ray name 127.0.0.1 and switch Ray's
    cluster mode off while its servers start (else Ray turns 127.0.0.1 into the machine's outward address); the
    switch is put back afterwards. ``$RAY_ADDRESS`` connects to a running cluster instead."""
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.util", fake.util)
    monkeypatch.setitem(sys.modules, "ray.util.joblib", fake.util.joblib)
    monkeypatch.setitem(sys.modules, "ray._private", None)           # no private constants to patch
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(sw._RAY_LOOPBACK_ENV, raising=False)
    with sw._ray_runtime(2):
        assert fake.up
    (kwargs, env), = fake.calls
    assert kwargs["_node_ip_address"] == "127.0.0.1" and kwargs["include_dashboard"] is False
    assert kwargs["num_cpus"] == 2 and env == "0" and sw._RAY_LOOPBACK_ENV not in os.environ and not fake.up
    monkeypatch.setenv("RAY_ADDRESS", "ray://cluster.example:10001")
    with sw._ray_runtime(2):
        pass
    assert "_node_ip_address" not in fake.calls[-1][0] and fake.calls[-1][1] is None


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module, started as sweep starts it (slow to start: about half a minute here)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (optional: pip install \"curvlab[cluster]\")")
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    os.environ.pop("RAY_ADDRESS", None)
    from ray import cloudpickle as ray_cloudpickle

    ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        for attempt in (1, 2):
            runtime = sw._ray_runtime(2)
            try:
                runtime.__enter__()
                break
            except Exception as exc:  # Ray gives its raylet 30 s (hard-coded) to register
                with contextlib.suppress(Exception):
                    ray.shutdown()
                if "timed out during startup" not in str(exc):
                    raise
                if attempt == 2:
                    pytest.skip(f"Ray did not start within its 30 s limit twice on this loaded machine: {exc}")
        try:
            yield ray
        finally:
            runtime.__exit__(None, None, None)
    finally:
        ray_cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _listening(pids: set[int]) -> list[tuple[str, str, int]]:
    psutil = pytest.importorskip("psutil")
    names = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            names[pid] = psutil.Process(pid).name()
    return [(names[c.pid], c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in names]


def test_local_ray_listens_on_loopback_only(local_ray):
    """Every listening socket of the Ray that sweep starts (GCS, raylet, object manager, agents, workers) is on
    127.0.0.1, so no other machine can reach it (the issue saw a task submitted from the network)."""
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    sockets = _listening({me.pid, *(p.pid for p in me.children(recursive=True))})
    assert len(sockets) >= 3, sockets                                       # the servers were seen
    outward = [s for s in sockets if s[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not outward, f"Ray listens beyond the loopback interface: {outward}"
    node = local_ray.nodes()[0]["NodeManagerAddress"]
    assert node == "127.0.0.1"


def test_ray_backend(local_ray, tmp_path):
    frame = sweep(pid_cell, grid(i=range(3)), cache_dir=tmp_path, backend="ray", n_jobs=2, progress=False)
    assert frame["y"].tolist() == [0, 1, 4]
    assert len(_cells(tmp_path)) == 3


def test_ray_worker_killed_mid_sweep(local_ray, tmp_path):
    """Ray's joblib pool does not replace a dead worker (ActorDiedError): the call stops with SweepIncomplete,
    naming the cells not cached (those that had not finished anywhere, possibly several); every finished cell
    stays as written and the rerun computes exactly the missing ones."""
    marks = tmp_path / "running"
    marks.mkdir()
    cache = tmp_path / "cache"
    configs = grid(i=range(8), delay=[0.5], marks=[str(marks)])
    killer = _kill_one_busy_worker(marks, cache, after=2)
    try:
        sweep(slow_cell, configs, cache_dir=cache, backend="ray", n_jobs=2, progress=False, name="slow")
        error = None
    except SweepIncomplete as exc:
        error = exc
    killer.join(timeout=120)
    assert killer.pids, "no busy worker was found to kill"
    before = _cells(cache)
    assert error is not None, "Ray's pool replaced the dead worker: update the module notes of curvlab.sweep"
    assert error.done == len(before) < 8 and len(error.missing) == 8 - len(before)
    assert "run the same call again" in str(error) and "ray backend" in str(error)
    rerun = sweep(slow_cell, configs, cache_dir=cache, backend="sequential", progress=False, name="slow")
    assert int((~rerun["_cached"]).sum()) == 8 - len(before) and rerun["y"].tolist() == [i * i for i in range(8)]
    after = _cells(cache)
    assert all(after[k] == v for k, v in before.items()), "a finished cell was rewritten"
