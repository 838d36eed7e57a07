"""The quick profile's design budget: each chapter's run time in ``quick``, measured here, not in CI.

    python benchmarks/bench_quick_budget.py            # every chapter of _toc.yml, one at a time
    python benchmarks/bench_quick_budget.py --quick    # the first two chapters only (plumbing)

The ``quick`` profile promises the whole book in minutes on two CPU cores, each notebook within
``QUICK_BUDGET_S`` (30 s) of execution. That is a *design target*: a run time depends on what else the machine
is doing, so the strict book build only reports it (the execution-status page and the build's summary line), and
``make test`` never fails on it. This benchmark is where the budget is checked: run it on an idle machine; each
chapter executes alone (one kernel, nothing else scheduled by this script), in the same way as the book build
(``jupyter_cache``'s single-notebook executor, the chapter's folder as working directory), and the report lists
each chapter's time, the budget and the margin. Reports: ``benchmarks/results/quick_budget.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "book" / "_ext"))
sys.path.insert(0, str(HERE))

import build_book  # noqa: E402
import curvlab_book  # noqa: E402
from harness import RESULTS_DIR, machine_info  # noqa: E402


def run_chapter(path: Path, timeout: int = 600) -> tuple[float, str | None]:
    """Execute one chapter in the quick profile; return (seconds, error or None)."""
    os.environ["CURVLAB_PROFILE"] = "quick"
    os.environ.pop("CURVLAB_LEDGER_DIR", None)
    _, _, seconds, err = build_book.execute(str(path), timeout)
    return seconds, err


def main(quick: bool = False) -> list[pd.DataFrame]:
    chapters = build_book.toc_notebooks()[: 2 if quick else None]
    rows = []
    for path in chapters:
        t0 = time.perf_counter()
        seconds, err = run_chapter(path)
        rows.append({
            "chapter": path.stem,
            "execution_s": round(seconds, 2),
            "wall_s": round(time.perf_counter() - t0, 2),
            "budget_s": curvlab_book.QUICK_BUDGET_S,
            "margin_s": round(curvlab_book.QUICK_BUDGET_S - seconds, 2),
            "within_budget": bool(seconds <= curvlab_book.QUICK_BUDGET_S and err is None),
            "error": err or "",
        })
        print(f"  {path.stem}: {seconds:.1f} s" + (f"  FAILED: {err}" if err else ""), flush=True)
    frame = pd.DataFrame(rows)
    machine = machine_info("cpu")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "quick_budget", "kind": "budget", "machine": machine,
               "load_1min": os.getloadavg()[0], "rows": rows}
    (RESULTS_DIR / "quick_budget.json").write_text(json.dumps(payload, indent=1))
    n_ok = int(frame["within_budget"].sum())
    md = [f"Quick-profile run time per chapter (budget {curvlab_book.QUICK_BUDGET_S:g} s each; "
          f"{n_ok} of {len(frame)} within it; 1-minute load average at the end {payload['load_1min']:.2f}; "
          f"{machine.get('cpu_model', '')}).", "", frame.drop(columns=["error"]).to_markdown(index=False), ""]
    (RESULTS_DIR / "quick_budget.md").write_text("\n".join(md))
    return [frame]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two chapters only")
    for table in main(parser.parse_args().quick):
        print(table.to_string(index=False))
