#!/usr/bin/env bash
# The prepared GPU check of issues 4 and 8, for a session that is lent a CUDA machine (one short run, < 10 min):
#   1. the seeds-batched Part I benchmark on the GPU (benchmarks/bench_linrep_seeds.py: batched vs looped, 16 seeds);
#   2. one chapter's paper-scale grid, ch20_gn_flows (the papers' n = 500, m = 5000), timed cell by cell, then the
#      per-grid summary with the measured wall time (what book/paper_scale.md's "measured" column needs).
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
