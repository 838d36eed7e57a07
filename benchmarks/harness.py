"""One schema for every Curvature Lab benchmark: variants timed side by side, ratios with their spread.

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
vs the baseline, its IQR and a bootstrap 95% interval of the median), and machine information; they are
written to ``benchmarks/results/<name>.json`` and ``benchmarks/results/<name>.md`` (a table for MyST
``{include}``). Nothing here asserts anything about speed: performance claims live in these reports only.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from curvlab import config

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESERVED = ("benchmark", "size", "variant", "repeat", "order", "time_s", "peak_mem_bytes", "mem_method", "device")

__all__ = ["compare", "ratio_table", "machine_info", "write_results", "RESULTS_DIR"]


# ----------------------------------------------------------------------------------------------- measuring
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_call(thunk: Callable[[], Any], dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    thunk()
    _sync(dev)
    return time.perf_counter() - t0


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
) -> pd.DataFrame:
    """Time ``variants`` side by side at every size; return the tidy frame (and write the reports if ``write``).

    Without ``setup`` a variant is called as ``variant(**size)`` and the whole call is timed. With ``setup``,
    ``state = setup(**size)`` is built once per size, untimed, and each variant is timed as ``variant(state)``.
    ``baseline`` (default: the first variant) is the denominator of the ratio table. ``device`` decides
    synchronisation and the memory method (default :func:`curvlab.config.device`).
    The frame's ``attrs`` hold ``machine`` (:func:`machine_info`), ``baseline`` and the settings.
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
    dev = config.device() if device is None else torch.device(device)
    names = list(variants)

    rows = []
    for size in sizes:
        state = setup(**size) if setup is not None else None
        thunks = {v: (lambda f=variants[v]: f(state)) if setup is not None else (lambda f=variants[v]: f(**size))
                  for v in names}
        for _ in range(int(warmup)):
            for v in names:
                thunks[v]()
        mem = {v: _peak_memory(thunks[v], dev) if memory else (float("nan"), "not measured") for v in names}
        for rep in range(int(repeats)):
            order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: no variant always goes first
            for pos, v in enumerate(order):
                t = _time_call(thunks[v], dev)
                rows.append({"benchmark": name, "size": _label(size), **size, "variant": v, "repeat": rep,
                             "order": pos, "time_s": t, "peak_mem_bytes": mem[v][0], "mem_method": mem[v][1],
                             "device": str(dev)})
    frame = pd.DataFrame(rows)
    frame.attrs.update(machine=machine_info(dev), baseline=baseline,
                       settings={"repeats": int(repeats), "warmup": int(warmup), "sizes": [dict(s) for s in sizes]})
    if write:
        write_results(name, frame, results_dir=results_dir)
    return frame


# ----------------------------------------------------------------------------------------------- summaries
def _bootstrap_median_ci(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> tuple[float, float]:
    if len(x) < 2:
        return float(x[0]), float(x[0])
    meds = np.median(rng.choice(x, size=(n_boot, len(x)), replace=True), axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def ratio_table(frame: pd.DataFrame, baseline: str | None = None, *, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per size and variant: median time and the median of the PAIRED per-repeat ratios ``t_variant / t_baseline``.

    A ratio below 1 means faster than the baseline. Spread: the interquartile range of the paired ratios
    (``ratio_q25``, ``ratio_q75``) and a bootstrap 95% interval of their median (``ratio_ci_low/high``).
    ``mem_ratio`` is the peak-memory ratio to the baseline.
    """
    baseline = frame.attrs.get("baseline") if baseline is None else baseline
    if baseline not in set(frame["variant"]):
        known = sorted(set(frame["variant"]))
        raise ValueError(f"baseline must be one of the frame's variants {known}, got {baseline!r}")
    rng = np.random.default_rng(seed)
    base = frame[frame["variant"] == baseline].set_index(["size", "repeat"])
    out = []
    for (size, variant), g in frame.groupby(["size", "variant"], sort=False):
        g = g.set_index(["size", "repeat"])
        ratios = (g["time_s"] / base.loc[g.index, "time_s"]).to_numpy()
        lo, hi = _bootstrap_median_ci(ratios, n_boot, rng)
        mem, base_mem = g["peak_mem_bytes"].iloc[0], base.loc[g.index, "peak_mem_bytes"].iloc[0]
        out.append({"benchmark": g["benchmark"].iloc[0], "size": size, "variant": variant, "baseline": baseline,
                    "repeats": len(ratios), "median_time_s": float(g["time_s"].median()),
                    "min_time_s": float(g["time_s"].min()),
                    "ratio": float(np.median(ratios)), "ratio_q25": float(np.quantile(ratios, 0.25)),
                    "ratio_q75": float(np.quantile(ratios, 0.75)), "ratio_ci_low": lo, "ratio_ci_high": hi,
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


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """CPU model, cores, thread count, versions, device (and GPU name) and the curvlab git revision."""
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
        "curvlab_revision": config.git_revision(),
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------------------------- reports
def _fmt(x: float, spec: str) -> str:
    return "–" if x is None or not np.isfinite(x) else format(x, spec)


def _markdown(name: str, ratios: pd.DataFrame, machine: Mapping[str, Any], settings: Mapping[str, Any],
              mem_method: str) -> str:
    m = machine
    where = f"{m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else "")
    head = [
        f"**Benchmark `{name}`** — median wall time over {settings['repeats']} interleaved repeats "
        f"(warm-up {settings['warmup']}); *ratio* = variant / `{ratios['baseline'].iloc[0]}` per repeat "
        "(below 1: faster), median [IQR] and bootstrap 95% interval of the median. "
        f"Peak memory: {mem_method}.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores_available']} cores available (torch threads {m['torch_threads']}, "
        f"load average {_fmt(m.get('load_average_1min'), '.2f')} at the start), "
        f"device {where}; torch {m['torch']}, numpy {m['numpy']}; curvlab rev `{m['curvlab_revision']}`; "
        f"{m['timestamp_utc']}.",
        "",
        "| size | variant | median time (ms) | time ratio | IQR | 95% CI | peak mem (MiB) | mem ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    body = [
        f"| {r.size} | {r.variant} | {_fmt(1e3 * r.median_time_s, '.3g')} | {_fmt(r.ratio, '.3g')} | "
        f"{_fmt(r.ratio_q25, '.3g')}–{_fmt(r.ratio_q75, '.3g')} | "
        f"{_fmt(r.ratio_ci_low, '.3g')}–{_fmt(r.ratio_ci_high, '.3g')} | "
        f"{_fmt(r.peak_mem_bytes / 2**20, '.3g')} | {_fmt(r.mem_ratio, '.3g')} |"
        for r in ratios.itertuples()
    ]
    return "\n".join(head + body) + "\n"


def write_results(name: str, frame: pd.DataFrame, *, results_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``<results_dir>/<name>.json`` (machine, settings, raw rows, ratios) and ``<name>.md``; return the paths."""
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    ratios = ratio_table(frame)
    machine, settings = frame.attrs["machine"], frame.attrs["settings"]
    payload = {
        "name": name,
        "machine": machine,
        "settings": {**settings, "baseline": frame.attrs["baseline"]},
        "ratios": json.loads(ratios.to_json(orient="records")),
        "records": json.loads(frame.to_json(orient="records")),
    }
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(_markdown(name, ratios, machine, settings, str(frame["mem_method"].iloc[0])))
    return json_path, md_path
