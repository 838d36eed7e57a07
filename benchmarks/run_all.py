"""Run every ``benchmarks/bench_*.py`` (each exposes ``main(quick: bool)``); reports go to ``benchmarks/results/``.

    python benchmarks/run_all.py            # full sizes
    python benchmarks/run_all.py --quick    # CI sizes, a minute or two on two CPU cores
    python benchmarks/run_all.py --only gn  # only bench_*gn*.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent


def discover(only: str | None = None) -> list[Path]:
    """The benchmark scripts, sorted; ``only`` keeps those whose file name contains it."""
    return [p for p in sorted(HERE.glob("bench_*.py")) if only is None or only in p.name]


def load(path: Path):
    """Import a benchmark script as a module (``benchmarks/`` on ``sys.path`` so it finds ``harness``)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise TypeError(f"{path.name} must define main(quick: bool)")
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every Curvature Lab benchmark.")
    parser.add_argument("--quick", action="store_true", help="CI sizes and fewer repeats")
    parser.add_argument("--only", default=None, help="run only bench_*.py files whose name contains this")
    args = parser.parse_args(argv)
    scripts = discover(args.only)
    if not scripts:
        print(f"no benchmarks match {args.only!r}", file=sys.stderr)
        return 1
    pd.set_option("display.width", 200)
    for path in scripts:
        t0 = time.perf_counter()
        tables = load(path).main(quick=args.quick) or []
        print(f"== {path.name} ({time.perf_counter() - t0:.1f} s) ==")
        for table in tables:
            cols = ["benchmark", "size", "variant", "median_time_s", "ratio", "ratio_q25", "ratio_q75", "mem_ratio"]
            print(table[[c for c in cols if c in table]].to_string(index=False, float_format="{:.4g}".format))
    print(f"reports written to {HERE / 'results'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
