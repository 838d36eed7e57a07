"""One schema for every Curvature Lab benchmark: variants timed side by side, ratios with their spread.

**The protocol** (fixed here, once, for every benchmark; :data:`PROTOCOL` is written into each results file):

1. *Threads.* Every comparison runs twice, with one torch thread and with torch's default (one per core available,
   :func:`default_threads`); the rows carry a ``threads`` column, and ratios are taken within a thread setting.
   The one-thread ratios are the ones the performance page quotes for the algorithm: on a shared machine the
   default setting also measures how many cores other jobs leave free (and OpenMP oversubscription).
2. *Routes alternated.* Repeat ``k`` runs every variant once, in an order rotated by ``k``.
3. *Repeats.* At least :data:`MIN_REPEATS` (5) repeats per size and thread setting (:func:`compare` raises below
   that unless ``allow_few_repeats``, which marks the file as outside the protocol).
4. *Statistics.* The median of the paired per-repeat ratios ``t_variant / t_baseline`` and a distribution-free
   interval of that median from order statistics (:func:`median_interval`: ``[x_(k), x_(n+1-k)]`` with the largest
   ``k`` whose binomial coverage is at least :data:`INTERVAL_COVERAGE`; its exact coverage is recorded), never a
   bootstrap of a median of three; fewer than :data:`MIN_REPEATS` values give no interval.
5. *Load.* What other processes did to the CPUs during each thread setting's run is measured, not guessed:
   :func:`cpu_mark` before and :func:`others_cpu` after give the average number of cores that anything but this
   process and its children used over the run (all CPUs' busy time from ``/proc/stat``, steal included, less this
   process's own user and system time and that of its reaped children, per second of wall time). A run is
   *flagged* (not refused: on a shared machine nothing would run) when that exceeds :data:`OTHERS_LIMIT_CORES`.
   The one-minute load average before and after is recorded too, but it does not decide the flag: it lags by a
   minute, so it counts the previous thread setting's own threads as somebody else's load, and on this project's
   virtual machines it has read 1.5-2 with every core idle. Where ``/proc/stat`` is missing (macOS) the old rule
   applies: load before > :data:`LOAD_LIMIT_PER_CORE` x cores, or load after less the run's own threads above it.
   The flag, the others' CPU use and both loads are in the results file and in every table.
6. *Provenance.* Each results file records the revision (:func:`code_revision`; ``dirty`` when files under
   ``lib/`` or ``benchmarks/`` differ from it — the performance page refuses such a file), the SHA-256 of every
   library and benchmark source file the timed calls executed (traced once per variant, untimed:
   ``exercised_code``; the page flags a table whose code has changed since), every size, the fixed parameters,
   the thread counts, the loads and the machine.

:func:`compare` runs several implementations of the same computation in ONE process, interleaved per repeat
(repeat ``k`` runs every variant once, in an order rotated by ``k``), so that drifts in machine load, clock
and caches hit all variants alike; ratios are then taken *per repeat* against a named baseline (paired).

Measured per call:

* wall time, ``time.perf_counter`` around the call, with ``torch.cuda.synchronize()`` before and after on CUDA;
* peak memory, in one extra untimed call per variant and size:

  - CUDA: ``torch.cuda.max_memory_allocated`` above the allocation before the call;
  - CPU: the peak of the running sum of torch's allocation/free records from ``torch.profiler``
    (``profile_memory=True``): tensor storage only, not BLAS/LAPACK workspaces or Python objects.
    (``tracemalloc`` is not used: it does not see torch's CPU allocator at all.)
  - elsewhere (MPS): not measured (``NaN``, method ``"unavailable"``).

Results are a tidy frame (one row per benchmark x size x variant x repeat), a ratio table (median paired ratio
vs the baseline, its IQR and the order-statistic interval of the median), and machine information; they are
written to ``benchmarks/results/<name>.json`` and ``benchmarks/results/<name>.md`` (a table for MyST
``{include}``). Nothing here asserts anything about speed: performance claims live in these reports only.

**Cost-vs-size curves.** :func:`scaling` times each variant at a ladder of sizes (plus a tiny *probe* size),
and :func:`fit_exponent` fits ``log t = a + b log x`` to the per-size median times. The rule for what enters the
fit is fixed in advance (:data:`OVERHEAD_FACTOR`): a size is *overhead-dominated*, and excluded, when its median
time is below 20 times the median time of the same call at the probe size, ``t0``; ``t0`` bounds every fixed
per-call cost (Python, dispatch, allocation), so a kept size carries at most 5 % of such cost. A fit is valid
when at least :data:`MIN_SIZES` (5) sizes spanning at least one decade of ``x`` are kept. The exponent's 95 %
interval is the union of two intervals: a bootstrap over repeats (repeats resampled within each size, medians
refitted: measurement noise) and the Student-*t* interval of the slope from the residuals around the line (model
misfit, sub-leading terms). The verdict compares it with the expected exponent of the complexity model.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from curvlab import config

RESULTS_DIR = Path(os.environ.get("CURVLAB_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
RESERVED = ("benchmark", "size", "variant", "repeat", "order", "time_s", "calls_per_timing", "peak_mem_bytes", "mem_method",
            "device", "threads")
ROOT = Path(__file__).resolve().parents[1]

#: At least this many repeats per size and thread setting (the protocol's item 3).
MIN_REPEATS = 5
#: The interval of a median ratio covers the true median with at least this probability (order statistics).
INTERVAL_COVERAGE = 0.90
#: A run is flagged when other processes used more than this many cores on average during it (protocol item 5).
OTHERS_LIMIT_CORES = 0.25
#: Where the CPUs' busy time cannot be read: flagged when the one-minute load average exceeds this per core.
LOAD_LIMIT_PER_CORE = 0.5
#: The thread settings every comparison runs at: one thread and torch's default.
THREAD_SETTINGS = (1, "default")
PROTOCOL = {
    "threads": "1 and torch's default (one per core available); ratios within a thread setting",
    "order": "variants alternated: repeat k runs every variant once, order rotated by k",
    "min_repeats": MIN_REPEATS,
    "statistic": "median of paired per-repeat ratios",
    "interval": f"order statistics [x_(k), x_(n+1-k)], largest k with binomial coverage >= {INTERVAL_COVERAGE:g}",
    "others_limit_cores": OTHERS_LIMIT_CORES,
    "load_limit_per_core": LOAD_LIMIT_PER_CORE,
    "load_rule": "flagged when other processes used more than others_limit_cores cores on average during the run "
                 "(/proc/stat busy time, steal included, less this process's and its children's CPU time); "
                 "without /proc/stat: load before > limit x cores, or load after - own threads > limit x cores",
}

__all__ = ["compare", "ratio_table", "machine_info", "write_results", "RESULTS_DIR", "scaling", "fit_exponent",
           "scaling_table", "write_scaling", "OVERHEAD_FACTOR", "MIN_SIZES", "MIN_REPEATS", "PROTOCOL",
           "median_interval", "default_threads", "load_average", "load_flag", "cpu_mark", "others_cpu", "run_to_completion", "trace_code", "code_hashes",
           "provenance", "figure"]

#: A size is overhead-dominated when its median time is below OVERHEAD_FACTOR x the probe's (fixed cost <= 5 %).
OVERHEAD_FACTOR = 20.0
#: A cost-vs-size fit needs at least this many kept sizes, spanning at least MIN_DECADES decades.
MIN_SIZES = 5
MIN_DECADES = 1.0


# ----------------------------------------------------------------------------------------------- measuring
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_call(thunk: Callable[[], Any], dev: torch.device, number: int = 1) -> float:
    """Seconds per call of ``thunk``, over ``number`` back-to-back calls."""
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(number):
        thunk()
    _sync(dev)
    return (time.perf_counter() - t0) / number


def _cpu_peak_bytes(thunk: Callable[[], Any]) -> float:
    """Peak of the running sum of torch CPU allocations during ``thunk()``, from the profiler's records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        thunk()
    events = prof.profiler.kineto_results.events()
    records = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    running = np.cumsum([b for _, b in records]) if records else np.zeros(1)
    return float(max(running.max(), 0))


def _peak_memory(thunk: Callable[[], Any], dev: torch.device) -> tuple[float, str]:
    """``(peak bytes, method)`` of one call of ``thunk``; ``(nan, 'unavailable')`` where it cannot be measured."""
    if dev.type == "cuda":
        _sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        thunk()
        _sync(dev)
        return float(torch.cuda.max_memory_allocated(dev) - base), "torch.cuda.max_memory_allocated"
    if dev.type == "cpu":
        try:
            return _cpu_peak_bytes(thunk), "torch.profiler allocation records (tensor storage)"
        except (AttributeError, RuntimeError):  # profiler internals differ in this torch build
            return float("nan"), "unavailable"
    return float("nan"), "unavailable"


def _label(size: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in size.items())


# ----------------------------------------------------------------------------------------------- protocol helpers
def default_threads() -> int:
    """torch's default intra-op thread count here: one per core available (what ``OMP_NUM_THREADS`` unset gives),
    whatever the current setting; ``CURVLAB_BENCH_DEFAULT_THREADS`` overrides it."""
    env = os.environ.get("CURVLAB_BENCH_DEFAULT_THREADS")
    if env:
        return max(1, int(env))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _resolve_threads(setting: int | str) -> int:
    if setting == "default":
        return default_threads()
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads must hold positive integers or 'default', got {setting!r}")
    return setting


def load_average() -> float | None:
    """The one-minute load average (``None`` where the OS has none)."""
    return float(os.getloadavg()[0]) if hasattr(os, "getloadavg") else None


def _busy_seconds(stat: str = "/proc/stat") -> float | None:
    """All CPUs' busy time since boot in seconds (user, nice, system, irq, softirq, steal), or None."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_mark() -> tuple[float, float | None, float]:
    """A mark to measure others' CPU use from (:func:`others_cpu`): (wall clock, all CPUs' busy seconds, this
    process's and its reaped children's CPU seconds)."""
    t = os.times()
    return time.perf_counter(), _busy_seconds(), t.user + t.system + t.children_user + t.children_system


def others_cpu(mark: tuple[float, float | None, float], now: tuple[float, float | None, float] | None = None,
               own_extra: float = 0.0) -> float | None:
    """The average number of cores that other processes kept busy since ``mark`` (None without ``/proc/stat``).
    ``own_extra``: CPU seconds of this process's descendants that it did not reap (:func:`run_to_completion`)."""
    now = cpu_mark() if now is None else now
    wall = now[0] - mark[0]
    if mark[1] is None or now[1] is None or wall <= 0:
        return None
    return max(0.0, ((now[1] - mark[1]) - (now[2] - mark[2]) - own_extra) / wall)


def run_to_completion(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
                      cwd: str | Path | None = None) -> tuple[int | None, str, float]:
    """Run ``cmd``; return ``(exit code, stderr, 0.0)``, or, when it ran past ``timeout``, ``(None, stderr, CPU
    seconds of the processes it had started)``.

    At the limit every process ``cmd`` started is killed too — ``jupyter nbconvert`` runs its kernel in a session of
    its own, which killing nbconvert alone leaves running — so nothing goes on loading the runs that follow. Those
    processes are reaped by init, not by this process, so their CPU time never reaches this process's children's
    time: it is returned, measured just before they are killed, for :func:`others_cpu` (``own_extra``) to count as
    the benchmark's own."""
    import subprocess

    import psutil

    proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), cwd=cwd, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err or "", 0.0
    except subprocess.TimeoutExpired:
        try:
            started = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        proc.kill()                       # first the command, so that it reaps none of the others
        cpu = 0.0
        for child in started:
            try:
                t = child.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(started, timeout=10)
        _, err = proc.communicate()       # only now: a process it started may hold its stderr open
        return None, err or "", cpu


def load_flag(before: float | None, after: float | None, threads: int, cores: int | None = None,
              others: float | None = None) -> bool:
    """True when other processes loaded the machine during a run (protocol item 5): ``others`` (cores, from
    :func:`others_cpu`) above :data:`OTHERS_LIMIT_CORES`; without it, the load-average rule."""
    if others is not None:
        return bool(others > OTHERS_LIMIT_CORES)
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    limit = LOAD_LIMIT_PER_CORE * cores
    return bool((before is not None and before > limit) or (after is not None and after - threads > limit))


def median_interval(x: Sequence[float], coverage: float = INTERVAL_COVERAGE) -> tuple[float, float, float]:
    """Distribution-free interval of the median of ``x``: ``(low, high, coverage)`` = ``[x_(k), x_(n+1-k)]`` for the
    largest ``k`` whose coverage ``1 - 2 P(Bin(n, 1/2) < k)`` is at least ``coverage``. Fewer than
    :data:`MIN_REPEATS` values (or none reaching the coverage): ``(nan, nan, nan)``."""
    from scipy import stats

    v = np.sort(np.asarray(x, dtype=float))
    n = len(v)
    if n < MIN_REPEATS:
        return float("nan"), float("nan"), float("nan")
    best = None
    for k in range(1, n // 2 + 1):
        cov = 1.0 - 2.0 * float(stats.binom.cdf(k - 1, n, 0.5))
        if cov >= coverage:
            best = (float(v[k - 1]), float(v[n - k]), cov)
    return best if best is not None else (float("nan"), float("nan"), float("nan"))


def trace_code(thunk: Callable[[], Any], root: Path | None = None) -> set[str]:
    """Run ``thunk()`` once under ``sys.setprofile`` and return the source files under ``root/lib`` and
    ``root/benchmarks`` whose Python functions it called (paths relative to ``root``)."""
    root = (root or ROOT).resolve()
    seen: set[str] = set()

    def prof(frame, event, arg):  # noqa: ANN001
        if event == "call":
            seen.add(frame.f_code.co_filename)

    previous = sys.getprofile()
    sys.setprofile(prof)
    try:
        thunk()
    finally:
        sys.setprofile(previous)
    out = set()
    for f in seen:
        try:
            rel = Path(f).resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        if rel.parts and rel.parts[0] in ("lib", "benchmarks") and rel.suffix == ".py":
            out.add(rel.as_posix())
    return out


def code_hashes(paths: Sequence[str], root: Path | None = None) -> dict[str, str]:
    """``{path: sha256 of its bytes}`` for repository-relative ``paths`` (what the page compares with the tree)."""
    root = root or ROOT
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in sorted(set(paths)) if (root / p).is_file()}


def provenance(extra_files: Sequence[str] = ()) -> dict[str, Any]:
    """Revision and dirtiness of the checkout, and where ``curvlab`` was imported from (it must be this checkout's
    ``lib/``, or the revision says nothing about the code that ran)."""
    import curvlab

    rev = code_revision(ROOT)
    lib = Path(curvlab.__file__).resolve().parent
    inside = (ROOT / "lib" / "curvlab").resolve() == lib
    dirty = bool(rev["uncommitted_changes"]) or rev["revision"] == "unknown" or not inside
    return {**rev, "dirty": dirty, "curvlab_path": str(lib), "curvlab_from_checkout": inside,
            "revision_label": rev["revision"] + ("+dirty" if dirty else "")}


def figure(value: float, text: str, **context: Any) -> dict[str, Any]:
    """A named figure for the performance page: the number, the text the page shows, and what it was measured on."""
    return {"value": None if value is None or not np.isfinite(value) else float(value), "text": text, **context}


# ----------------------------------------------------------------------------------------------- compare
def compare(
    name: str,
    variants: Mapping[str, Callable[..., Any]],
    sizes: Sequence[Mapping[str, Any]],
    *,
    setup: Callable[..., Any] | None = None,
    repeats: int = 7,
    warmup: int = 1,
    baseline: str | None = None,
    device: torch.device | str | None = None,
    memory: bool = True,
    write: bool = True,
    results_dir: str | Path | None = None,
    min_time: float | None = None,
    threads: Sequence[int | str] = THREAD_SETTINGS,
    fixed: Mapping[str, Any] | None = None,
    trace: bool = True,
    allow_few_repeats: bool = False,
    figures: Callable[[pd.DataFrame], Mapping[str, Any]] | None = None,
) -> pd.DataFrame:
    """Time ``variants`` side by side at every size and thread setting; return the tidy frame (and write the
    reports if ``write``), under the module's protocol.

    ``threads``: the thread settings, each run as a whole comparison (default: one thread and torch's default).
    ``fixed``: parameters every size shares that are not keys of ``sizes`` (``n``, dtype, ...), recorded in the file.
    ``trace``: record the source files each variant executes (one untimed traced call per variant at the first
    size). ``figures``: ``frame -> {name: figure(...)}``, named numbers the performance page cites.

    ``min_time`` (seconds; needs ``warmup >= 1``): a variant whose warm-up call took less is timed over ``number``
    back-to-back calls per repeat, ``number`` chosen from the warm-up so that a timing lasts about ``min_time``
    (as ``timeit``'s autorange does), and the time per call is recorded. Without it every repeat is one call, which
    for a millisecond call right after a seconds-long one measures mostly cold caches.

    Without ``setup`` a variant is called as ``variant(**size)`` and the whole call is timed. With ``setup``,
    ``state = setup(**size)`` is built once per size, untimed, and each variant is timed as ``variant(state)``.
    ``baseline`` (default: the first variant) is the denominator of the ratio table. ``device`` decides
    synchronisation and the memory method (default :func:`curvlab.config.device`).
    The frame's ``attrs`` hold ``machine`` (:func:`machine_info`), ``baseline``, the settings and the runs' loads.
    """
    if not isinstance(name, str) or not name or any(c in name for c in "/\\ "):
        raise ValueError(f"name must be a non-empty file-name-safe string, got {name!r}")
    if not isinstance(variants, Mapping) or not variants or not all(callable(f) for f in variants.values()):
        raise TypeError("variants must be a non-empty dict[str, callable]")
    if not sizes or not all(isinstance(s, Mapping) for s in sizes):
        raise TypeError("sizes must be a non-empty list of dicts (keyword arguments of setup or the variants)")
    if any(k in RESERVED for s in sizes for k in s):
        raise ValueError(f"sizes keys must not be one of the frame's columns {RESERVED}")
    baseline = next(iter(variants)) if baseline is None else baseline
    if baseline not in variants:
        raise ValueError(f"baseline must be one of {list(variants)}, got {baseline!r}")
    if int(repeats) < 1 or int(warmup) < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if int(repeats) < MIN_REPEATS and not allow_few_repeats:
        raise ValueError(f"repeats must be >= {MIN_REPEATS} (the protocol), got {repeats}; "
                         "pass allow_few_repeats=True for a run marked outside the protocol")
    if min_time is not None and (not min_time > 0 or int(warmup) < 1):
        raise ValueError(f"min_time must be > 0 and needs warmup >= 1, got min_time={min_time}, warmup={warmup}")
    if not threads:
        raise ValueError("threads must name at least one thread setting (an int or 'default')")
    settings_threads = [_resolve_threads(t) for t in threads]
    dev = config.device() if device is None else torch.device(device)
    names = list(variants)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    rows, runs, exercised = [], [], set()
    states: dict[int, Any] = {}
    previous = torch.get_num_threads()
    try:
        for t_label, nthreads in zip(threads, settings_threads):
            torch.set_num_threads(nthreads)
            before, t_start, mark = load_average(), time.perf_counter(), cpu_mark()
            for i, size in enumerate(sizes):
                if setup is not None and i not in states:
                    states[i] = setup(**size)
                state = states.get(i)
                thunks = {v: (lambda f=variants[v]: f(state)) if setup is not None
                          else (lambda f=variants[v], sz=size: f(**sz)) for v in names}
                if trace and i == 0 and not exercised:
                    for v in names:
                        exercised |= trace_code(thunks[v])
                number = dict.fromkeys(names, 1)
                for _ in range(int(warmup)):
                    for v in names:
                        t = _time_call(thunks[v], dev)
                        if min_time is not None:
                            number[v] = max(1, math.ceil(min_time / max(t, 1e-9)))
                mem = {v: _peak_memory(thunks[v], dev) if memory else (float("nan"), "not measured") for v in names}
                for rep in range(int(repeats)):
                    order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: none always goes first
                    for pos, v in enumerate(order):
                        t = _time_call(thunks[v], dev, number[v])
                        rows.append({"benchmark": name, "size": _label(size), **size, "threads": nthreads,
                                     "variant": v, "repeat": rep, "order": pos, "time_s": t,
                                     "calls_per_timing": number[v], "peak_mem_bytes": mem[v][0],
                                     "mem_method": mem[v][1], "device": str(dev)})
            after, others = load_average(), others_cpu(mark)
            runs.append({"threads": nthreads, "setting": str(t_label), "load_before": before, "load_after": after,
                         "others_cores": others, "wall_s": time.perf_counter() - t_start, "cores_available": cores,
                         "flagged": load_flag(before, after, nthreads, cores, others)})
    finally:
        torch.set_num_threads(previous)
    frame = pd.DataFrame(rows)
    frame.attrs.update(machine=machine_info(dev), baseline=baseline, runs=runs,
                       exercised_code=code_hashes(sorted(exercised)),
                       settings={"repeats": int(repeats), "warmup": int(warmup), "min_time": min_time,
                                 "sizes": [dict(s) for s in sizes], "fixed": dict(fixed or {}),
                                 "threads": settings_threads, "protocol_ok": int(repeats) >= MIN_REPEATS})
    if figures is not None:
        frame.attrs["figures"] = dict(figures(frame))
    if write:
        write_results(name, frame, results_dir=results_dir)
    return frame


# ----------------------------------------------------------------------------------------------- summaries
def ratio_table(frame: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """Per size, thread setting and variant: median time and the median of the PAIRED per-repeat ratios
    ``t_variant / t_baseline`` (the same size, thread setting and repeat).

    A ratio below 1 means faster than the baseline. Spread: the interquartile range of the paired ratios
    (``ratio_q25``, ``ratio_q75``) and the order-statistic interval of their median (``ratio_ci_low/high``, exact
    coverage ``ratio_ci_coverage``; none with fewer than :data:`MIN_REPEATS` repeats). ``mem_ratio`` is the
    peak-memory ratio to the baseline.
    """
    baseline = frame.attrs.get("baseline") if baseline is None else baseline
    if baseline not in set(frame["variant"]):
        known = sorted(set(frame["variant"]))
        raise ValueError(f"baseline must be one of the frame's variants {known}, got {baseline!r}")
    if "threads" not in frame:
        frame = frame.assign(threads=torch.get_num_threads())
    key = ["size", "threads", "repeat"]
    base = frame[frame["variant"] == baseline].set_index(key)
    out = []
    for (size, threads, variant), g in frame.groupby(["size", "threads", "variant"], sort=False):
        g = g.set_index(key)
        ratios = (g["time_s"] / base.loc[g.index, "time_s"]).to_numpy()
        lo, hi, cov = median_interval(ratios)
        mem, base_mem = g["peak_mem_bytes"].iloc[0], base.loc[g.index, "peak_mem_bytes"].iloc[0]
        out.append({"benchmark": g["benchmark"].iloc[0], "size": size, "threads": int(threads), "variant": variant,
                    "baseline": baseline, "repeats": len(ratios), "median_time_s": float(g["time_s"].median()),
                    "min_time_s": float(g["time_s"].min()),
                    "ratio": float(np.median(ratios)), "ratio_q25": float(np.quantile(ratios, 0.25)),
                    "ratio_q75": float(np.quantile(ratios, 0.75)), "ratio_ci_low": lo, "ratio_ci_high": hi,
                    "ratio_ci_coverage": cov,
                    "peak_mem_bytes": float(mem), "mem_ratio": float(mem / base_mem) if base_mem > 0 else float("nan")})
    return pd.DataFrame(out)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The code a benchmark runs: uncommitted changes under these paths make its numbers unreproducible from the revision.
CODE_PATHS = ("lib", "benchmarks")


def code_revision(root: Path | None = None) -> dict[str, Any]:
    """The checkout's clean git revision and the uncommitted changes to the code a benchmark runs.

    ``revision``: the short hash of ``HEAD`` (``'unknown'`` outside git), never with a ``+dirty`` suffix;
    ``uncommitted_changes``: tracked files under :data:`CODE_PATHS` that differ from it (edits elsewhere, to a
    chapter or a page, do not change what a benchmark measures); ``curvlab_revision``: the revision, followed by
    ``" + uncommitted changes"`` when there are any (what a one-line report prints).
    """
    import subprocess

    where = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    rev, changed = "unknown", []
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=5)
        if out.returncode == 0:
            rev = out.stdout.strip()
            # results files are the benchmarks' outputs, not code: a run that has written some is still clean
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS,
                                 ":(exclude)benchmarks/results"],
                                cwd=where, capture_output=True, text=True, timeout=5)
            changed = sorted(line[3:].strip() for line in st.stdout.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return {"revision": rev, "uncommitted_changes": changed,
            "curvlab_revision": rev + (" + uncommitted changes" if changed else "")}


def revision_text(m: Mapping[str, Any]) -> str:
    """The revision as a report cites it: ``rev `abc1234` `` or, explicitly, with the uncommitted files."""
    rev = m.get("revision", m.get("curvlab_revision", "unknown"))
    changed = m.get("uncommitted_changes") or []
    if not changed:
        return f"curvlab rev `{rev}`"
    shown = ", ".join(f"`{c}`" for c in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return f"curvlab rev `{rev}` **with uncommitted changes** to {shown}"


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """CPU model, cores, thread count, versions, device (and GPU name) and the curvlab revision (:func:`code_revision`)."""
    dev = config.device() if device is None else torch.device(device)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "cores_available": affinity,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "platform": platform.platform(),
        **provenance(),
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------------------------- reports
def _fmt(x: float, spec: str) -> str:
    return "–" if x is None or not np.isfinite(x) else format(x, spec)


def _kv(d: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in d.items())


def runs_text(runs: Sequence[Mapping[str, Any]]) -> str:
    """One clause per thread setting: threads, others' CPU use, load before/after, flagged or not."""
    parts = []
    for r in runs:
        others = r.get("others_cores")
        parts.append(f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}: "
                     + (f"other processes used {others:.2f} cores on average (load average " if others is not None
                        else "load average ")
                     + f"{_fmt(r.get('load_before'), '.2f')} before, {_fmt(r.get('load_after'), '.2f')} after"
                     + (")" if others is not None else "") + f" on {r.get('cores_available', '?')} cores"
                     + (" — **flagged: the machine was loaded**" if r.get("flagged") else ""))
    return "; ".join(parts)


def machine_text(m: Mapping[str, Any]) -> str:
    where = f"{m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else "")
    rev = m.get("revision_label") or m.get("curvlab_revision", "unknown")
    return (f"{m['cpu_model']}, {m['cores_available']} cores available, device {where}; torch {m['torch']}, "
            f"numpy {m['numpy']}; rev `{rev}`; {m['timestamp_utc']}")


def _markdown(name: str, ratios: pd.DataFrame, machine: Mapping[str, Any], settings: Mapping[str, Any],
              mem_method: str, runs: Sequence[Mapping[str, Any]] = ()) -> str:
    m = machine
    sizes = "; ".join(_kv(sz) for sz in settings.get("sizes", []))
    fixed = settings.get("fixed") or {}
    head = [
        f"**Benchmark `{name}`** — median wall time over {settings['repeats']} alternated repeats per size and "
        f"thread setting (warm-up {settings['warmup']}"
        + (f"; calls under {settings['min_time'] * 1e3:g} ms timed back to back over about that long, per call"
           if settings.get("min_time") else "")
        + f"); *ratio* = variant / `{ratios['baseline'].iloc[0]}`, paired per repeat (below 1: faster), median, "
        "IQR and the order-statistic interval of the median (coverage in the JSON). "
        f"Peak memory: {mem_method}.",
        "",
        f"Sizes: {sizes}" + (f"; fixed: {_kv(fixed)}" if fixed else "") + ".",
        "",
        f"Runs: {runs_text(runs)}." if runs else "Runs: load not recorded.",
        "",
        f"Machine: {machine_text(m)}."
        + ("" if settings.get("protocol_ok", True) else f" **Fewer than {MIN_REPEATS} repeats: outside the protocol.**"),
        "",
        "| size | threads | variant | median time (ms) | time ratio | IQR | interval | peak mem (MiB) | mem ratio |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    body = [
        f"| {r.size} | {r.threads} | {r.variant} | {_fmt(1e3 * r.median_time_s, '.3g')} | {_fmt(r.ratio, '.3g')} | "
        f"{_fmt(r.ratio_q25, '.3g')}–{_fmt(r.ratio_q75, '.3g')} | "
        f"{_fmt(r.ratio_ci_low, '.3g')}–{_fmt(r.ratio_ci_high, '.3g')} | "
        f"{_fmt(r.peak_mem_bytes / 2**20, '.3g')} | {_fmt(r.mem_ratio, '.3g')} |"
        for r in ratios.itertuples()
    ]
    return "\n".join(head + body) + "\n"


def write_payload(name: str, payload: Mapping[str, Any], markdown: str | None = None, *,
                  results_dir: str | Path | None = None) -> Path:
    """Write a results file that is not a comparison (a measurement of its own), with the protocol and provenance
    fields the performance page requires: ``machine`` (:func:`machine_info`) is added when missing."""
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    body = {"name": name, "protocol": PROTOCOL, **payload}
    body.setdefault("machine", machine_info())
    path = out / f"{name}.json"
    path.write_text(json.dumps(body, indent=1, default=float) + "\n")
    if markdown is not None:
        (out / f"{name}.md").write_text(markdown)
    _warn_dirty(body["machine"], path)
    return path


def _warn_dirty(machine: Mapping[str, Any], path: Path) -> None:
    if machine.get("dirty"):
        print(f"warning: {path.name} was measured on a dirty or foreign checkout ({machine.get('revision_label')}, "
              f"curvlab from {machine.get('curvlab_path')}); the performance page will refuse it", file=sys.stderr)


def auto_figures(ratios: pd.DataFrame) -> dict[str, Any]:
    """A named figure for every non-baseline row: ``speedup <variant> [<size>] threads=<t>`` (baseline time over the
    variant's, with the interval) and ``ratio <variant> [<size>] threads=<t>`` (the time ratio itself)."""
    out = {}
    for r in ratios.itertuples():
        if r.variant == r.baseline:
            continue
        key = f"{r.variant} [{r.size}] threads={r.threads}"
        sp = 1 / r.ratio
        lo = 1 / r.ratio_ci_high if np.isfinite(r.ratio_ci_high) else float("nan")
        hi = 1 / r.ratio_ci_low if np.isfinite(r.ratio_ci_low) else float("nan")
        spec = ".0f" if sp >= 10 else ".2g"
        out[f"speedup {key}"] = figure(sp, f"{format(sp, spec)}×", interval=f"{_fmt(lo, spec)}–{_fmt(hi, spec)}×")
        out[f"ratio {key}"] = figure(r.ratio, f"{r.ratio:.2f}",
                                     interval=f"{_fmt(r.ratio_ci_low, '.2f')}–{_fmt(r.ratio_ci_high, '.2f')}")
        if np.isfinite(r.mem_ratio):
            out[f"memory {key}"] = figure(r.mem_ratio, f"{r.mem_ratio:.2f}×")
        out[f"time {key}"] = figure(r.median_time_s, f"{r.median_time_s * 1e3:.3g} ms" if r.median_time_s < 1
                                    else f"{r.median_time_s:.3g} s")
    return out


def write_results(name: str, frame: pd.DataFrame, *, results_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``<results_dir>/<name>.json`` (protocol, machine, settings, runs, exercised code, figures, raw rows,
    ratios) and ``<name>.md``; return the paths."""
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    ratios = ratio_table(frame)
    machine, settings = frame.attrs["machine"], frame.attrs["settings"]
    runs = frame.attrs.get("runs", [])
    payload = {
        "name": name,
        "protocol": PROTOCOL,
        "machine": machine,
        "settings": {**settings, "baseline": frame.attrs["baseline"]},
        "runs": runs,
        "flagged": any(r.get("flagged") for r in runs),
        "exercised_code": frame.attrs.get("exercised_code", {}),
        "figures": {**auto_figures(ratios), **frame.attrs.get("figures", {})},
        "ratios": json.loads(ratios.to_json(orient="records")),
        "records": json.loads(frame.to_json(orient="records")),
    }
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(_markdown(name, ratios, machine, settings, str(frame["mem_method"].iloc[0]), runs))
    _warn_dirty(machine, json_path)
    return json_path, md_path


# ----------------------------------------------------------------------------------------- cost-vs-size curves
def fit_exponent(x: Sequence[float], samples: Sequence[Sequence[float]], *, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> dict[str, float]:
    """Fit ``log median(t) = a + b log x``; return the exponent ``b``, its intervals and the fit's scatter.

    ``samples[k]`` holds the repeated times at size ``x[k]``. Intervals: ``boot_low/high`` (percentile bootstrap,
    repeats resampled within each size), ``t_low/t_high`` (Student-*t* on the residuals, ``len(x) - 2`` degrees of
    freedom) and ``ci_low/ci_high``, their union. ``rms_log_resid``: root-mean-square residual in natural log.
    """
    from scipy import stats

    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or len(x) < 3 or len(samples) != len(x) or np.any(x <= 0):
        raise ValueError(f"x must be >= 3 positive sizes with one sample list each, got {len(x)} and {len(samples)}")
    arrays = [np.asarray(s, dtype=float) for s in samples]
    if any(a.size == 0 or np.any(a <= 0) for a in arrays):
        raise ValueError("samples must be non-empty lists of positive times")
    lx = np.log(x)
    cx = lx - lx.mean()
    sxx = float(cx @ cx)
    ly = np.log([np.median(a) for a in arrays])
    b = float(cx @ (ly - ly.mean()) / sxx)
    resid = ly - ly.mean() - b * cx
    dof = len(x) - 2
    se = float(np.sqrt(resid @ resid / dof / sxx)) if dof > 0 else float("nan")
    tq = float(stats.t.ppf(0.5 + level / 2, dof)) if dof > 0 else float("nan")
    rng = np.random.default_rng(seed)
    boot_ly = np.stack([np.log(np.median(rng.choice(a, size=(n_boot, a.size), replace=True), axis=1))
                        for a in arrays], axis=1)                                  # (n_boot, sizes)
    boot_b = (boot_ly - boot_ly.mean(1, keepdims=True)) @ cx / sxx
    lo, hi = np.quantile(boot_b, [(1 - level) / 2, (1 + level) / 2])
    t_lo, t_hi = b - tq * se, b + tq * se
    return {"exponent": b, "boot_low": float(lo), "boot_high": float(hi), "t_low": t_lo, "t_high": t_hi,
            "ci_low": float(min(lo, t_lo)), "ci_high": float(max(hi, t_hi)), "se": se,
            "rms_log_resid": float(np.sqrt(np.mean(resid ** 2)))}


def scaling_table(frame: pd.DataFrame, *, x: str, expected: Mapping[str, float], probe: str,
                  overhead_factor: float = OVERHEAD_FACTOR, n_boot: int = 2000, seed: int = 0
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Apply the exclusion rule and fit each variant's exponent; return ``(points, fits)``.

    ``frame``: from :func:`compare`, with the probe size labelled ``probe`` and a numeric column ``x``.
    ``points``: one row per variant and size (median, IQR, ``kept`` or the reason it is not). ``fits``: one row per
    variant: kept sizes, decades spanned, exponent with intervals, ``expected`` and ``verdict`` (``consistent``:
    the expected exponent lies in the interval; ``differs``; ``too few sizes``: fewer than :data:`MIN_SIZES` kept
    sizes or less than a decade).
    """
    points, fits = [], []
    for variant, g in frame.groupby("variant", sort=False):
        t0 = float(g.loc[g["size"] == probe, "time_s"].median())
        ladder = g[g["size"] != probe]
        by_size = [(float(xv), h["time_s"].to_numpy()) for xv, h in ladder.groupby(x, sort=True)]
        kept = []
        for xv, t in by_size:
            med = float(np.median(t))
            ok = med >= overhead_factor * t0
            kept += [(xv, t)] if ok else []
            points.append({"variant": variant, x: xv, "median_time_s": med, "q25_time_s": float(np.quantile(t, 0.25)),
                           "q75_time_s": float(np.quantile(t, 0.75)), "repeats": len(t), "probe_time_s": t0,
                           "kept": ok, "why": "fitted" if ok else f"overhead: median < {overhead_factor:g} x probe"})
        xs = [k for k, _ in kept]
        decades = float(np.log10(max(xs) / min(xs))) if len(xs) >= 2 else 0.0
        fit = fit_exponent(xs, [t for _, t in kept], n_boot=n_boot, seed=seed) if len(xs) >= 3 else {}
        exp_b = expected.get(variant, float("nan"))
        valid = len(xs) >= MIN_SIZES and decades >= MIN_DECADES - 1e-9
        if not fit:
            verdict = "too few sizes"
        elif not np.isfinite(exp_b):
            verdict = "no model"
        else:
            inside = fit["ci_low"] <= exp_b <= fit["ci_high"]
            verdict = ("consistent" if inside else "differs") + ("" if valid else " (too few sizes)")
        fits.append({"benchmark": frame["benchmark"].iloc[0], "variant": variant, "x": x, "sizes_kept": len(xs),
                     "sizes_total": len(by_size), "x_min": min(xs) if xs else float("nan"),
                     "x_max": max(xs) if xs else float("nan"), "decades": decades, "expected": exp_b,
                     **{k: fit.get(k, float("nan")) for k in ("exponent", "ci_low", "ci_high", "boot_low", "boot_high",
                                                              "t_low", "t_high", "rms_log_resid")},
                     "valid": valid, "verdict": verdict})
    return pd.DataFrame(points), pd.DataFrame(fits)


def scaling(name: str, variants: Mapping[str, Callable[..., Any]], sizes: Sequence[Mapping[str, Any]], *, x: str,
            expected: Mapping[str, float], probe: Mapping[str, Any], setup: Callable[..., Any] | None = None,
            repeats: int = 5, warmup: int = 1, overhead_factor: float = OVERHEAD_FACTOR, model: str = "",
            device: torch.device | str | None = None, single_thread: bool = True, write: bool = True,
            results_dir: str | Path | None = None, allow_few_repeats: bool = False,
            fixed: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Cost-vs-size curve: time ``variants`` at ``probe`` and at every size of ``sizes`` (interleaved, as in
    :func:`compare`), apply the exclusion rule, fit the exponents in the size key ``x``; return the fits.

    ``expected``: the complexity model's exponent per variant (``model`` says which model, for the report).
    ``single_thread``: time with ``torch.set_num_threads(1)`` (recorded in the machine line), so that the curve
    measures the algorithm rather than how many cores other jobs leave free. Writes ``<name>.json``, ``<name>.md`` and ``<name>.png`` (log-log curves) when ``write``.
    """
    if not isinstance(x, str) or any(x not in s for s in [probe, *sizes]):
        raise ValueError(f"x must be a key of probe and of every size, got {x!r}")
    if len({float(s[x]) for s in sizes}) < 3:
        raise ValueError(f"sizes must give at least 3 distinct values of {x!r}")
    # the exponent is the algorithm's: one thread keeps other jobs' load on a shared machine out
    frame = compare(name, variants, [probe, *sizes], setup=setup, repeats=repeats, warmup=warmup,
                    baseline=next(iter(variants)), device=device, memory=False, write=False,
                    threads=(1,) if single_thread else ("default",), allow_few_repeats=allow_few_repeats,
                    fixed=fixed)
    points, fits = scaling_table(frame, x=x, expected=expected, probe=_label(probe), overhead_factor=overhead_factor)
    fits.attrs.update(points=points, machine=frame.attrs["machine"], model=model, probe=_label(probe),
                      settings=frame.attrs["settings"], overhead_factor=overhead_factor,
                      runs=frame.attrs.get("runs", []), exercised_code=frame.attrs.get("exercised_code", {}))
    if write:
        write_scaling(name, fits, results_dir=results_dir)
    return fits


def _scaling_markdown(name: str, fits: pd.DataFrame) -> str:
    a, m = fits.attrs, fits.attrs["machine"]
    x = fits["x"].iloc[0]
    head = [
        f"**Cost-vs-size `{name}`** — {a['model']} Median wall time over {a['settings']['repeats']} interleaved "
        f"repeats per size (warm-up {a['settings']['warmup']}); probe size `{a['probe']}`; sizes whose median is "
        f"below {a['overhead_factor']:g} × the probe's are excluded as overhead-dominated; 95 % interval: union of "
        "a bootstrap over repeats and the Student-*t* interval of the slope.",
        "",
        f"Sizes: {'; '.join(_kv(sz) for sz in a['settings'].get('sizes', []))}.",
        "",
        f"Runs: {runs_text(a.get('runs', []))}.",
        "",
        f"Machine: {machine_text(m)}.",
        "",
        f"| variant | sizes kept | {x} range | decades | fitted exponent | 95 % interval | expected | verdict |",
        "|---|---:|---|---:|---:|---|---:|---|",
    ]
    body = [
        f"| {r.variant} | {r.sizes_kept}/{r.sizes_total} | {_fmt(r.x_min, 'g')}–{_fmt(r.x_max, 'g')} | "
        f"{_fmt(r.decades, '.2f')} | {_fmt(r.exponent, '.3f')} | [{_fmt(r.ci_low, '.3f')}, {_fmt(r.ci_high, '.3f')}] | "
        f"{_fmt(r.expected, 'g')} | {r.verdict} |"
        for r in fits.itertuples()
    ]
    pts = a["points"]
    detail = ["", f"| variant | {x} | median time (ms) | IQR (ms) | in the fit |", "|---|---:|---:|---|---|"] + [
        f"| {r.variant} | {_fmt(getattr(r, x), 'g')} | {_fmt(1e3 * r.median_time_s, '.3g')} | "
        f"{_fmt(1e3 * r.q25_time_s, '.3g')}–{_fmt(1e3 * r.q75_time_s, '.3g')} | "
        f"{'yes' if r.kept else 'no: ' + r.why} |"
        for r in pts.itertuples()
    ]
    return "\n".join(head + body + detail) + "\n"


def _scaling_figure(name: str, fits: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    pts, x = fits.attrs["points"], fits["x"].iloc[0]
    fig, ax = plt.subplots(figsize=(5.2, 3.4), facecolor="white")
    colours = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9"]
    for k, fit in enumerate(fits.itertuples()):
        c = colours[k % len(colours)]
        g = pts[pts.variant == fit.variant]
        keep = g[g.kept]
        ax.errorbar(keep[x], keep.median_time_s, yerr=[keep.median_time_s - keep.q25_time_s,
                    keep.q75_time_s - keep.median_time_s], fmt="o", color=c, ms=4, capsize=2,
                    label=f"{fit.variant}: {_fmt(fit.exponent, '.2f')} (expected {_fmt(fit.expected, 'g')})")
        out = g[~g.kept]
        ax.plot(out[x], out.median_time_s, "o", mfc="none", color=c, ms=4)
        if np.isfinite(fit.exponent) and len(keep) >= 2:
            xs = np.geomspace(keep[x].min(), keep[x].max(), 20)
            lx, ly = np.log(keep[x].to_numpy(float)), np.log(keep.median_time_s.to_numpy())
            ax.plot(xs, np.exp(ly.mean() + fit.exponent * (np.log(xs) - lx.mean())), "-", color=c, lw=1)
    ax.set(xscale="log", yscale="log", xlabel=x, ylabel="median time (s)", title=name)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, facecolor="white")
    plt.close(fig)


def write_scaling(name: str, fits: pd.DataFrame, *, results_dir: str | Path | None = None) -> tuple[Path, Path, Path]:
    """Write ``<name>.json`` (machine, settings, points, fits), ``<name>.md`` and ``<name>.png``; return the paths."""
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    a = fits.attrs
    payload = {"name": name, "kind": "scaling", "protocol": PROTOCOL, "model": a["model"], "probe": a["probe"],
               "overhead_factor": a["overhead_factor"], "min_sizes": MIN_SIZES, "min_decades": MIN_DECADES,
               "machine": a["machine"], "settings": a["settings"], "runs": a.get("runs", []),
               "flagged": any(r.get("flagged") for r in a.get("runs", [])),
               "exercised_code": a.get("exercised_code", {}),
               "figures": {f"exponent {f['variant']}": figure(f["exponent"], _fmt(f["exponent"], ".2f"),
                                                               interval=f"[{_fmt(f['ci_low'], '.2f')}, "
                                                                        f"{_fmt(f['ci_high'], '.2f')}]",
                                                               verdict=f["verdict"])
                           for f in fits.to_dict(orient="records")},
               "fits": json.loads(fits.to_json(orient="records")),
               "points": json.loads(a["points"].to_json(orient="records"))}
    paths = out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"
    paths[0].write_text(json.dumps(payload, indent=1) + "\n")
    paths[1].write_text(_scaling_markdown(name, fits))
    _scaling_figure(name, fits, paths[2])
    _warn_dirty(a["machine"], paths[0])
    return paths
