"""How long each chapter takes a student: every chapter run as a student runs it, in one profile.

    python benchmarks/bench_chapter_times.py                     # the standard profile (a student's default)
    python benchmarks/bench_chapter_times.py --profile quick
    python benchmarks/bench_chapter_times.py --chapters 00_how_to_read 41_your_own_network

Each chapter of ``_toc.yml`` is executed top to bottom by ``jupyter nbconvert --execute`` (a fresh kernel, the
chapter's folder as working directory), one at a time, as a student's *first* run of it: an empty sweep cache and
ledger directory of its own, ``CURVLAB_BOOK_BUILD`` unset (progress bars and widgets as in JupyterLab), and no
thread setting in the environment, so ``curvlab.setup`` applies its thread policy (one thread on a machine with two
cores or fewer; :func:`curvlab.config.thread_policy`). The time is the wall time of the whole run, kernel start
included. A chapter that fails, or runs past ``--timeout``, is recorded as such, never dropped.

The load is measured as in the harness (protocol item 5): other processes' average CPU use over each chapter's
run. Reports: ``benchmarks/results/chapter_times_<profile>.{json,md}``, with the harness's provenance; the running
page (``book/running.md``) includes the table, and the book's extension refuses a dirty or pre-protocol file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

from harness import (code_hashes, cpu_mark, figure, load_average, load_flag, machine_info, machine_text,  # noqa: E402
                     others_cpu, run_to_completion, runs_text, write_payload)

#: Environment variables a student's kernel would not have: the book build's, and any thread setting.
CLEARED = ("CURVLAB_BOOK_BUILD", "CURVLAB_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CURVLAB_LEDGER_DIR",
           "CURVLAB_CACHE_DIR", "CURVLAB_EXECUTION_CACHE")


def chapters(names: list[str] | None = None) -> list[Path]:
    from build_book import toc_notebooks

    toc = toc_notebooks()
    if not names:
        return toc
    by_stem = {p.stem: p for p in toc}
    unknown = [n for n in names if n not in by_stem]
    if unknown:
        raise SystemExit(f"not chapters of _toc.yml: {unknown}")
    return [by_stem[n] for n in names]


def run_chapter(path: Path, profile: str, timeout: float) -> dict:
    """One first run of ``path`` in ``profile`` as a student's kernel does it; seconds, outcome, others' CPU."""
    with tempfile.TemporaryDirectory(prefix="curvlab_chapter_") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in CLEARED}
        env |= {"CURVLAB_PROFILE": profile, "CURVLAB_CACHE_DIR": str(Path(tmp) / "cache"),
                "CURVLAB_LEDGER_DIR": str(Path(tmp) / "ledger"), "MPLBACKEND": "Agg"}
        cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
               f"--ExecutePreprocessor.timeout={int(timeout)}", "--output", str(Path(tmp) / "out.ipynb"), str(path)]
        mark, t0 = cpu_mark(), time.perf_counter()
        code, stderr, lost = run_to_completion(cmd, env=env, timeout=timeout + 60)  # killed whole at the limit
        seconds = time.perf_counter() - t0
        if code is None:
            outcome = f"stopped after {timeout:g} s"
        else:
            outcome = "ran" if code == 0 else "failed: " + (stderr.strip().splitlines() or ["?"])[-1][:200]
        others = others_cpu(mark, own_extra=lost)
    return {"chapter": path.stem, "seconds": seconds, "outcome": outcome, "others_cores": others, "unreaped_cpu_s": lost}


def main(quick: bool = False, profile: str = "standard", names: list[str] | None = None,
         timeout: float = 1800.0) -> list:
    import pandas as pd

    from curvlab import config

    todo = chapters(names or (["00_how_to_read"] if quick else None))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    threads, why = config.thread_policy(environ=env)
    rows = []
    before, t0, mark = load_average(), time.perf_counter(), cpu_mark()
    unreaped = 0.0
    for path in todo:
        row = run_chapter(path, profile, timeout)
        rows.append(row)
        unreaped += row["unreaped_cpu_s"]
        print(f"  {row['chapter']}: {row['seconds']:.1f} s, {row['outcome']}", flush=True)
    after, others = load_average(), others_cpu(mark, own_extra=unreaped)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    runs = [{"threads": threads, "load_before": before, "load_after": after, "others_cores": others,
             "wall_s": time.perf_counter() - t0, "cores_available": cores,
             "flagged": load_flag(before, after, threads or 1, cores, others)}]
    frame = pd.DataFrame(rows)
    ok = frame[frame["outcome"] == "ran"]
    name = f"chapter_times_{profile}"
    figures = {f"seconds {r['chapter']}": figure(r["seconds"], f"{r['seconds']:.0f} s") for r in rows}
    total = float(frame["seconds"].sum())
    figures["total"] = figure(total, f"{total / 60:.0f} min")
    if len(ok):
        slowest = ok.loc[ok["seconds"].idxmax()]
        figures["slowest"] = figure(float(slowest["seconds"]), f"{slowest['seconds']:.0f} s ({slowest['chapter']})")
    machine = machine_info("cpu")
    flagged_rows = [r["chapter"] for r in rows if r["others_cores"] is not None and r["others_cores"] > 0.25]
    lines = [
        f"**Benchmark `{name}`** — each chapter run once, top to bottom, as a student's first run of it "
        f"(`jupyter nbconvert --execute`, a fresh kernel, an empty sweep cache), profile `{profile}`, CPU threads "
        f"{threads} ({why}). Time: wall seconds of the whole run, kernel start included; *others* is the average "
        "number of cores other processes used during the chapter.", "",
        f"Runs: {runs_text(runs)}" + (f"; chapters run while others used more than a quarter core: "
                                      f"{', '.join(flagged_rows)}" if flagged_rows else "") + ".", "",
        f"Machine: {machine_text(machine)}.", "",
        "| chapter | time (s) | outcome | others (cores) |", "|---|---:|---|---:|",
        *(f"| {r['chapter']} | {r['seconds']:.0f} | {r['outcome']} | "
          f"{'–' if r['others_cores'] is None else format(r['others_cores'], '.2f')} |" for r in rows),
        f"| **all {len(rows)}** | **{total:.0f}** ({total / 60:.0f} min) | {len(ok)} ran | |", "",
    ]
    lib = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "lib" / "curvlab").rglob("*.py"))]
    write_payload(name, {"kind": "chapter_times", "profile": profile, "threads": threads, "threads_reason": why,
                         "runs": runs, "flagged": runs[0]["flagged"], "rows": rows, "figures": figures,
                         "exercised_code": code_hashes(lib + [str(p.relative_to(ROOT)) for p in todo]),
                         "machine": machine}, "\n".join(lines) + "\n")
    return [frame]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="chapter 00 only (plumbing)")
    parser.add_argument("--profile", default="standard", choices=("quick", "standard", "paper"))
    parser.add_argument("--chapters", nargs="*", default=None)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per chapter")
    args = parser.parse_args()
    for table in main(args.quick, args.profile, args.chapters, args.timeout):
        print(table.to_string(index=False))
