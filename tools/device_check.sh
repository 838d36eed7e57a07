#!/usr/bin/env bash
# The prepared GPU check of issues 4 and 8, for a session that is lent a CUDA machine (one short run, < 10 min):
#   1. the seeds-batched Part I benchmark on the GPU (benchmarks/bench_linrep_seeds.py: batched vs looped, 16 seeds);
#   2. one chapter's paper-scale grid, ch20_gn_flows (the papers' n = 500, m = 5000), timed cell by cell, then the
#      per-grid summary with the measured wall time (what book/paper_scale.md's "measured" column needs);
#   3. curvlab.model on CUDA (issue 25): tests/test_model_device.py (products, kappa dense and Lanczos, K-FAC operator
#      and inverse, the kernel-form step, float64 and float32, against a float64 CPU reference) and chapter 41
#      executed on the device in the quick profile (needs pytest and nbclient; skipped, with a line, where missing).
# It needs only what the device image has (torch, pandas, scipy, joblib, ...): curvlab is imported from lib/.
#   device run:  bash tools/device_check.sh            (results under $OUT, or ./device_out)
#   here, dry:   bash tools/device_check.sh --cpu      (the same steps on the CPU at the quick sizes, to test it)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CURVLAB_PROGRESS=0
# the sweep cache stays outside $OUT (only a few files come back from a device run); the benchmark's report goes to
# $OUT/bench, so the repository's own results are not overwritten
export CURVLAB_CACHE_DIR="${CURVLAB_CACHE_DIR:-/tmp/curvlab_device_cache}" CURVLAB_BENCH_RESULTS="$OUT/bench"
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--cpu" ]]; then   # plumbing test: quick sizes, the cheapest grid
  export CURVLAB_DEVICE=cpu; PROFILE=quick; QUICK=--quick; GRID=ch30_mp_limit
else
  export CURVLAB_DEVICE=cuda; PROFILE=paper; QUICK=; GRID=ch20_gn_flows
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
fi
"$PY" -c "import torch, curvlab; print('torch', torch.__version__, '| curvlab', curvlab.__version__)" | tee "$OUT/versions.txt"
{ time "$PY" benchmarks/bench_linrep_seeds.py $QUICK ; } 2>&1 | tee "$OUT/linrep_seeds.txt"
{ time "$PY" tools/run_sweeps.py --profile "$PROFILE" --only "$GRID" ; } 2>&1 | tee "$OUT/$GRID.txt"
"$PY" - "$PROFILE" "$GRID" <<'PY' | tee "$OUT/${GRID}_provenance.txt"
import sys
from curvlab import paper_runs
runs = paper_runs.load(sys.argv[2], sys.argv[1])
p = runs.provenance
print(f"{len(p)} cells, {p.wall_s.sum():.1f} s of compute ({p.wall_s.sum() / 3600:.4f} device-hours), "
      f"devices {sorted(set(p.device))}, revision {sorted(set(p.revision))}")
print(p[["wall_s", "device", "torch"]].describe(include="all").to_string())
PY
# 3. curvlab.model and chapter 41 on the device
if "$PY" -c "import pytest" 2>/dev/null; then
  { time "$PY" -m pytest -q -p no:cacheprovider tests/test_model_device.py ; } 2>&1 | tee "$OUT/model_device_tests.txt"
else
  echo "pytest not installed: tests/test_model_device.py skipped" | tee "$OUT/model_device_tests.txt"
fi
if "$PY" -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
  { time CURVLAB_PROFILE=quick CURVLAB_BOOK_BUILD=1 CURVLAB_LEDGER_DIR="$OUT/ledger41" "$PY" - <<'NB' ; } 2>&1 | tee "$OUT/ch41.txt"
import nbformat
from nbclient import NotebookClient
nb = nbformat.read("notebooks/41_your_own_network.ipynb", as_version=4)
NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
print("chapter 41 executed:", sum(c.cell_type == "code" for c in nb.cells), "code cells")
NB
else
  echo "nbclient/ipykernel not installed: chapter 41 not executed" | tee "$OUT/ch41.txt"
fi
