"""How many CPU threads should a chapter use? One thread against torch's default, measured two ways.

1. **Cold calls** (``thread_cold_calls``). The reduced κ route of a deep linear network (``bench_gn_conditioning``'s
   general case, d = 16, d_y = 10, L = 3, m = 52: one call takes a few milliseconds) is called once after two idle
   seconds, ``cold`` times per thread setting, the settings alternated call by call; warm calls (back to back) give
   the reference. With more OpenMP threads than free cores, a thread of the pool can wait for a core that another job
   holds, and a millisecond call then takes as long as the scheduler makes it wait. Reported per setting: the median
   warm and cold call, the slowest cold call, and how many cold calls took more than a tenth of a second (stalls).
2. **A chapter** (``thread_chapter``): chapter 32 executed in the quick profile (``jupyter nbconvert --execute``,
   a fresh kernel per run; a run over the cap, 240 s unless ``--cap`` says otherwise, is stopped and counted as the cap, a lower bound) with ``CURVLAB_THREADS=1`` and with torch's default thread
   count (``CURVLAB_THREADS`` = cores available), alternated run by run, each run with a fresh sweep cache and
   ledger directory (nothing reused between runs).

Both write ``benchmarks/results/<name>.{json,md}`` with the harness's provenance and the load before and after.

``--busy N`` repeats a part with N other jobs running: N processes started by the benchmark, each spinning on one
core for as long as the part runs (a second kernel, a browser tab, a compiler — what a student's laptop runs beside a
chapter). Those reports are ``<name>_busy``; their runs are flagged, since that load is the experiment.

    python benchmarks/bench_threads.py            # 10 cold calls per setting; the chapter 5 times per setting
    python benchmarks/bench_threads.py --quick    # 4 cold calls; the chapter 2 times per setting
    python benchmarks/bench_threads.py --busy 1   # the same with one other job spinning on a core
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))
import bench_gn_conditioning as gnc  # noqa: E402
from harness import (ROOT as HROOT, code_hashes, cpu_mark, default_threads, figure, load_average, load_flag, others_cpu,
                     run_to_completion,  # noqa: E402
                     median_interval, trace_code, write_payload)

SIZE = {"d": 16, "d_y": 10, "L": 3, "m": 52}
CHAPTER = "notebooks/32_gn_conditioning_leaky_relu.ipynb"
SLOW_S = 0.1  # a 'stall': a cold call of a few-millisecond computation taking more than a tenth of a second


def _settings() -> list[int]:
    return [1, default_threads()] if default_threads() != 1 else [1]


def _run_info(before, after, threads, t0, others=None) -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"threads": threads, "load_before": before, "load_after": after, "others_cores": others,
            "wall_s": time.perf_counter() - t0, "cores_available": cores,
            "flagged": load_flag(before, after, threads, cores, others)}


def cold_calls(cold: int = 10, idle_s: float = 2.0, warm: int = 9) -> dict:
    state = gnc._setup_general(**SIZE)
    reduced = gnc.GENERAL["reduced"]
    previous = torch.get_num_threads()
    rows, runs = [], []
    exercised = trace_code(lambda: reduced(state))
    try:
        before, t0, mark = load_average(), time.perf_counter(), cpu_mark()
        for k in range(cold):
            order = _settings() if k % 2 == 0 else _settings()[::-1]
            for t in order:
                torch.set_num_threads(t)
                for _ in range(3):
                    reduced(state)
                w = []
                for _ in range(warm):
                    s0 = time.perf_counter()
                    reduced(state)
                    w.append(time.perf_counter() - s0)
                time.sleep(idle_s)
                s0 = time.perf_counter()
                reduced(state)
                rows.append({"threads": t, "repeat": k, "cold_s": time.perf_counter() - s0,
                             "warm_median_s": float(np.median(w))})
        after, others = load_average(), others_cpu(mark)
        runs = [_run_info(before, after, t, t0, others) for t in _settings()]
    finally:
        torch.set_num_threads(previous)
    frame = pd.DataFrame(rows)
    summary, figures = [], {}
    for t, g in frame.groupby("threads"):
        warm_med = float(g["warm_median_s"].median())
        slow = int((g["cold_s"] > SLOW_S).sum())
        lo, hi, cov = median_interval(g["cold_s"].to_numpy())
        row = {"threads": int(t), "calls": len(g), "warm_median_ms": 1e3 * warm_med,
               "cold_median_ms": 1e3 * float(g["cold_s"].median()), "cold_max_ms": 1e3 * float(g["cold_s"].max()),
               "cold_interval_ms": [1e3 * lo, 1e3 * hi], "cold_interval_coverage": cov, "slow_calls": slow}
        summary.append(row)
        figures[f"warm median threads={t}"] = figure(row["warm_median_ms"], f"{row['warm_median_ms']:.1f} ms")
        figures[f"cold median threads={t}"] = figure(row["cold_median_ms"], f"{row['cold_median_ms']:.1f} ms")
        figures[f"cold max threads={t}"] = figure(row["cold_max_ms"], f"{row['cold_max_ms']:.0f} ms")
        figures[f"stalls threads={t}"] = figure(slow, f"{slow} of {len(g)}")
    return {"frame": frame, "summary": summary, "figures": figures, "runs": runs,
            "exercised_code": code_hashes(sorted(exercised))}


def chapter_runs(repeats: int = 5, cap: float = 240.0) -> dict:
    """Chapter 32 in the quick profile by ``jupyter nbconvert --execute`` (a fresh kernel per run), at one thread
    and at the default, alternated; a run longer than ``cap`` seconds is stopped and recorded as censored at
    ``cap`` (its time is at least that)."""
    rows, unreaped = [], 0.0
    before, t0, mark = load_average(), time.perf_counter(), cpu_mark()
    for k in range(repeats):
        order = _settings() if k % 2 == 0 else _settings()[::-1]
        for t in order:
            with tempfile.TemporaryDirectory(prefix="curvlab_threads_") as tmp:
                env = {**os.environ, "CURVLAB_THREADS": str(t), "OMP_NUM_THREADS": str(t),
                       "MKL_NUM_THREADS": str(t), "CURVLAB_PROFILE": "quick", "CURVLAB_BOOK_BUILD": "1",
                       "CURVLAB_PROGRESS": "0", "CURVLAB_CACHE_DIR": str(Path(tmp) / "cache"),
                       "CURVLAB_LEDGER_DIR": str(Path(tmp) / "ledger")}
                cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                       "--ExecutePreprocessor.timeout=900", "--output", str(Path(tmp) / "out.ipynb"),
                       str(ROOT / CHAPTER)]
                la, s0 = load_average(), time.perf_counter()
                code, stderr, lost = run_to_completion(cmd, env=env, timeout=cap)  # at the cap: killed whole
                unreaped += lost
                if code is None:
                    seconds, censored, err = cap, True, None
                else:
                    seconds, censored = time.perf_counter() - s0, False
                    err = None if code == 0 else stderr[-300:]
            rows.append({"threads": t, "repeat": k, "seconds": seconds, "censored": censored, "error": err,
                         "load_at_start": la})
            print(f"chapter 32 quick, {t} thread(s): {seconds:.1f} s" + (" (stopped at the cap)" if censored else "")
                  + (f" ERROR {err}" if err else ""), flush=True)
    after, others = load_average(), others_cpu(mark, own_extra=unreaped)
    frame = pd.DataFrame(rows)
    summary, figures = [], {}
    ones = frame[frame.threads == 1].set_index("repeat")["seconds"]
    for t, g in frame.groupby("threads"):
        lo, hi, cov = median_interval(g["seconds"].to_numpy())
        med = float(g["seconds"].median())
        censored_median = bool((g["seconds"] >= med).all() and g["censored"].any()) or \
            bool(g["censored"].sum() > len(g) // 2)
        row = {"threads": int(t), "runs": len(g), "median_s": med, "median_censored": censored_median,
               "censored_runs": int(g["censored"].sum()), "cap_s": cap_used(g),
               "min_s": float(g["seconds"].min()), "max_s": float(g["seconds"].max()), "interval_s": [lo, hi],
               "interval_coverage": cov, "errors": int(g["error"].notna().sum())}
        ratio = (g.set_index("repeat")["seconds"] / ones).to_numpy()
        rlo, rhi, rcov = median_interval(ratio)
        row.update(ratio_to_1_thread=float(np.median(ratio)), ratio_interval=[rlo, rhi], ratio_coverage=rcov)
        summary.append(row)
        figures[f"median threads={t}"] = figure(row["median_s"], ("more than " if censored_median else "")
                                                + f"{row['median_s']:.0f} s")
        figures[f"range threads={t}"] = figure(row["max_s"], f"{row['min_s']:.0f}–{row['max_s']:.0f} s")
        figures[f"ratio threads={t}"] = figure(row["ratio_to_1_thread"], ("at least " if censored_median and t != 1 else "")
                                               + f"{row['ratio_to_1_thread']:.1f}×",
                                               interval=f"{rlo:.1f}–{rhi:.1f}×" if np.isfinite(rlo) else "–")
    lib = sorted(str(p.relative_to(HROOT)) for p in (HROOT / "lib" / "curvlab").rglob("*.py")
                 if "__pycache__" not in p.parts)
    hashes = code_hashes(lib)
    hashes[CHAPTER] = hashlib.sha256((ROOT / CHAPTER).read_bytes()).hexdigest()
    return {"frame": frame, "summary": summary, "figures": figures,
            "runs": [_run_info(before, after, t, t0, others) for t in _settings()], "exercised_code": hashes}


@contextlib.contextmanager
def other_jobs(n: int):
    """``n`` processes spinning on a core each while the block runs (the benchmark's own, so its load is known)."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(n))]
    try:
        time.sleep(1.0 if procs else 0.0)  # let them reach a core before anything is timed
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def policy_verdict(busy_summary: list[dict], idle_file: Path | None = None) -> dict:
    """Does the two-core rule (one thread) hold up? Read from the idle chapter runs (``thread_chapter.json``) and
    these busy ones: it stands when the default's time over one thread's is at least 0.9 on the idle machine (one
    thread at most about 10 % slower) and the interval of that ratio lies above 1 with another job running."""
    import json

    from harness import RESULTS_DIR

    idle_file = idle_file or RESULTS_DIR / "thread_chapter.json"
    if not idle_file.is_file():
        return figure(None, "not decided: no idle run (thread_chapter.json) to compare with")
    idle = {r["threads"]: r for r in json.loads(idle_file.read_text())["summary"]}
    busy = {r["threads"]: r for r in busy_summary}
    t = max(busy)
    if t == 1 or t not in idle:
        return figure(None, "not decided: one thread is the default here")
    r_idle, r_busy, lo_busy = idle[t]["ratio_to_1_thread"], busy[t]["ratio_to_1_thread"], busy[t]["ratio_interval"][0]
    stands = r_idle >= 0.9 and np.isfinite(lo_busy) and lo_busy > 1.0
    at_least = "at least " if busy[t].get("censored_runs") else ""  # runs stopped at the cap: lower bounds
    text = (("the two-core rule stands: " if stands else "the measurements do not support the two-core rule: ")
            + f"torch's default took {r_idle:.2f}× one thread's time on the idle machine and {at_least}{r_busy:.2f}× "
            f"(interval from {lo_busy:.2f}) with another job running")
    return figure(1.0 if stands else 0.0, text, idle_ratio=r_idle, busy_ratio=r_busy, busy_ratio_low=lo_busy)


def cap_used(g: pd.DataFrame) -> float | None:
    c = g.loc[g["censored"], "seconds"]
    return float(c.max()) if len(c) else None


def _fmt(x, spec):
    return "–" if x is None or not np.isfinite(x) else format(x, spec)


def main(quick: bool = False, parts: str = "cold,chapter", busy: int = 0, cap: float = 240.0) -> list:
    from harness import runs_text, machine_text, machine_info

    tables = []
    suffix = "_busy" if busy else ""
    busy_text = (f" While it ran, {busy} other process{'es' if busy > 1 else ''} started by this benchmark spun on a "
                 "core each: the other job this measurement is about (its runs are flagged for that load)."
                 if busy else "")
    if "cold" in parts:
        with other_jobs(busy):
            res = cold_calls(cold=4 if quick else 10)
        m = machine_info()
        md = [f"**Benchmark `thread_cold_calls{suffix}`** — one call of the reduced κ route (d = {SIZE['d']}, d_y = "
              f"{SIZE['d_y']}, L = {SIZE['L']}, m = {SIZE['m']}) after {2:g} idle seconds, per thread setting, the "
              "settings alternated; warm = median of 9 back-to-back calls just before; *stalls* = cold calls over "
              f"{SLOW_S:g} s.{busy_text}", "",
              f"Runs: {runs_text(res['runs'])}.", "", f"Machine: {machine_text(m)}.", "",
              "| threads | cold calls | warm median (ms) | cold median (ms) | interval (ms) | slowest cold (ms) | stalls |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["summary"]:
            md.append(f"| {r['threads']} | {r['calls']} | {r['warm_median_ms']:.2f} | {r['cold_median_ms']:.2f} | "
                      f"{_fmt(r['cold_interval_ms'][0], '.3g')}–{_fmt(r['cold_interval_ms'][1], '.3g')} | "
                      f"{r['cold_max_ms']:.1f} | {r['slow_calls']} |")
        write_payload(f"thread_cold_calls{suffix}", {
            "machine": m, "settings": {"size": SIZE, "idle_s": 2.0, "other_jobs": busy, "cold_calls": len(res["frame"]) // len(_settings()),
                                       "threads": _settings(), "stall_s": SLOW_S},
            "runs": res["runs"], "flagged": any(r["flagged"] for r in res["runs"]),
            "exercised_code": res["exercised_code"], "figures": res["figures"], "summary": res["summary"],
            "records": res["frame"].to_dict(orient="records")}, "\n".join(md) + "\n")
        tables.append(pd.DataFrame(res["summary"]))
    if "chapter" in parts:
        with other_jobs(busy):
            res = chapter_runs(repeats=2 if quick else 5, cap=cap)
        m = machine_info()
        md = [f"**Benchmark `thread_chapter{suffix}`** — chapter 32 (`" + CHAPTER + "`) executed in the quick profile by "
              "`jupyter nbconvert --execute` (a fresh kernel per run, its start included), with `CURVLAB_THREADS` (and `OMP_NUM_THREADS`) = 1 and = the cores available, "
              "alternated run by run, a fresh sweep cache for every run; ratio = the run's time over the 1-thread "
              "run of the same repeat (median and order-statistic interval). A run still going after "
              f"{cap:g} s was stopped and counts as {cap:g} s (a lower bound)." + busy_text, "",
              f"Runs: {runs_text(res['runs'])}; load at the start of each run in the JSON.", "",
              f"Machine: {machine_text(m)}.", "",
              "| threads | runs | median (s) | range (s) | ratio to 1 thread | interval | stopped at the cap | errors |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["summary"]:
            md.append(f"| {r['threads']} | {r['runs']} | {r['median_s']:.1f} | {r['min_s']:.1f}–{r['max_s']:.1f} | "
                      f"{r['ratio_to_1_thread']:.2f} | {_fmt(r['ratio_interval'][0], '.2f')}–"
                      f"{_fmt(r['ratio_interval'][1], '.2f')} | {r['censored_runs']} | {r['errors']} |")
        if busy:
            res["figures"]["policy"] = policy_verdict(res["summary"])
        write_payload(f"thread_chapter{suffix}", {
            "machine": m, "settings": {"chapter": CHAPTER, "profile": "quick", "other_jobs": busy, "cap_s": cap, "repeats": len(res["frame"]) //
                                       len(_settings()), "threads": _settings()},
            "runs": res["runs"], "flagged": any(r["flagged"] for r in res["runs"]),
            "exercised_code": res["exercised_code"], "figures": res["figures"], "summary": res["summary"],
            "records": res["frame"].to_dict(orient="records")}, "\n".join(md) + "\n")
        tables.append(pd.DataFrame(res["summary"]))
    return tables


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="cold,chapter", help="cold, chapter or both (comma-separated)")
    parser.add_argument("--busy", type=int, default=0, help="other jobs spinning on a core each while it runs")
    parser.add_argument("--cap", type=float, default=240.0, help="seconds after which a chapter run is stopped")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    for t in main(args.quick, args.parts, args.busy, args.cap):
        print(t.to_string(index=False))
