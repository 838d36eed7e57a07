"""Run the paper-scale grids of :mod:`curvlab.paper_runs` into the sweep cache, outside the book build.

    make sweeps PROFILE=paper                       # every registered grid, the papers' sizes (GPU recommended)
    make sweeps PROFILE=quick ONLY=ch20_gn_flows    # one grid, reduced sizes
    python tools/run_sweeps.py --list               # the registry: cells and cost model per grid
    python tools/run_sweeps.py --profile paper --estimate --flops-per-s 1e13
    python tools/run_sweeps.py --profile paper --only ch30_mp_limit --export   # run, then commit the frame

``--export`` writes each complete grid's tidy frame and provenance to ``lib/curvlab/paper_frames/`` (package data:
a ``pip install`` carries them), which the chapters' "At paper scale" sections show in every profile.

Cells already in the cache are read, not recomputed, so an interrupted run resumes where it stopped. The backend
follows ``CURVLAB_SWEEP_BACKEND`` (``dask`` with ``CURVLAB_DASK_SCHEDULER``, ``ray`` with ``RAY_ADDRESS``) or
``--backend``. Each cell's provenance (configuration hash, code hash, git revision, torch, device, host, wall
time) is in the cache (:func:`curvlab.sweep.cache_info`); a summary per grid is printed and written to
``<cache>/_reports/paper_runs-<profile>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

import pandas as pd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=os.environ.get("CURVLAB_PROFILE", "paper"),
                        choices=("quick", "standard", "paper"))
    parser.add_argument("--only", default=None, help="comma-separated grid names (default: all)")
    parser.add_argument("--backend", default=None, help="joblib backend: loky, dask, ray, ... (default: environment)")
    parser.add_argument("--n-jobs", type=int, default=None, help="cells at once (default: joblib's choice)")
    parser.add_argument("--cache-dir", default=None, help="sweep cache (default: $CURVLAB_CACHE_DIR or .curvlab_cache)")
    parser.add_argument("--list", action="store_true", help="list the registry and exit")
    parser.add_argument("--estimate", action="store_true", help="print the cost model's table and exit")
    parser.add_argument("--flops-per-s", type=float, default=None, help="throughput for --estimate's hours")
    parser.add_argument("--export", action="store_true",
                        help="write each complete grid to lib/curvlab/paper_frames/ (the committed frames every "
                             "profile's book shows in its 'At paper scale' section)")
    args = parser.parse_args(argv)
    os.environ["CURVLAB_PROFILE"] = args.profile  # the cells' device and sizes follow the profile

    import torch

    from curvlab import config, paper_runs, sweep

    chosen = paper_runs.names() if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    for name in chosen:
        paper_runs.get(name)  # validates
    pd.set_option("display.width", 200)
    if args.list or args.estimate:
        table = paper_runs.estimate(args.profile, flops_per_s=args.flops_per_s)
        print(table[table.name.isin(chosen)].to_string(index=False, float_format="{:.3g}".format))
        if args.list:
            for name in chosen:
                r = paper_runs.get(name)
                print(f"{name}: {r.title} ({r.chapter}). {r.note}".rstrip(" ."))
        return 0

    dev = config.device()
    summary = {"profile": args.profile, "device": str(dev), "revision": config.git_revision(),
               "torch": torch.__version__, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "grids": []}
    print(f"paper runs, profile {args.profile}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", rev {summary['revision']}, backend {args.backend or os.environ.get(sweep.BACKEND_ENV) or 'joblib default'}")
    status = 0
    for name in chosen:
        r = paper_runs.get(name)
        cfgs = r.configs(args.profile)
        flops = sum(r.flops(**c) for c in cfgs)
        print(f"== {name} ({r.chapter}): {len(cfgs)} cells, at most {flops:.3g} flop; regenerate with "
              f"`{paper_runs.command(name, args.profile)}`", flush=True)
        t0 = time.perf_counter()
        try:
            frame = paper_runs.run(name, args.profile, backend=args.backend, n_jobs=args.n_jobs,
                                   cache_dir=args.cache_dir)
        except sweep.SweepIncomplete as exc:
            print(f"   incomplete: {exc}", file=sys.stderr)
            summary["grids"].append({"name": name, "complete": False, "done": exc.done, "cells": exc.total})
            status = 1
            continue
        elapsed = time.perf_counter() - t0
        info = paper_runs.load(name, args.profile, cache_dir=args.cache_dir).provenance  # one row per cell
        entry = {"name": name, "chapter": r.chapter, "complete": True, "cells": len(cfgs),
                 "cell_seconds_total": float(info["wall_s"].sum()), "elapsed_s": elapsed,
                 "devices": sorted({str(d) for d in info["device"].dropna()}),
                 "hosts": sorted({str(h) for h in info["host"].dropna()}), "flops_upper": flops, "rows": len(frame)}
        summary["grids"].append(entry)
        print(f"   done: {entry['cells']} cells, {entry['cell_seconds_total']:.1f} s of cell time "
              f"(sum over cells, from provenance), {elapsed:.1f} s wall now, devices {entry['devices']}", flush=True)
        if args.export:
            csv, meta = paper_runs.export(name, args.profile, cache_dir=args.cache_dir)
            print(f"   exported to {csv} and {meta.name}", flush=True)
    root = sweep._resolve_cache_dir(args.cache_dir)
    out = root / "_reports" / f"paper_runs-{args.profile}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary written to {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
