"""Does the first ``deep_linear.gn_condition`` call after a large allocation stall? (issue: 0.4-0.9 s reported)

Times the reduced route warm, then right after (a) a 2 GiB allocation that is filled and freed, (b) the dense
``torch.func`` route of ``bench_gn_conditioning`` (d = 16, d_y = 10, L = 3), (c) two idle seconds, with the minor page
faults and the system and user CPU time of each call (``resource.getrusage``). Not part of ``make bench``: a probe for
the performance page's timing rule. Run ``python benchmarks/first_call_stall.py`` (add ``OMP_NUM_THREADS=1`` for one
thread).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gn_conditioning as bench  # noqa: E402

SIZE = {"d": 16, "d_y": 10, "L": 3, "m": 52}


def timed(fn, state) -> tuple[float, int, float, float]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn(state)
    t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return t * 1e3, r1.ru_minflt - r0.ru_minflt, (r1.ru_stime - r0.ru_stime) * 1e3, (r1.ru_utime - r0.ru_utime) * 1e3


def main(repeats: int = 3) -> None:
    state = bench._setup_general(**SIZE)
    reduced, dense = bench.GENERAL["reduced"], bench.GENERAL["dense"]
    for _ in range(5):
        timed(reduced, state)
    warm = sorted(timed(reduced, state)[0] for _ in range(9))
    print(f"warm: median {warm[4]:.2f} ms (range {warm[0]:.2f}-{warm[-1]:.2f})")
    before = {"after a 2 GiB allocation, filled and freed":
              lambda: torch.empty(2 * 2**30 // 8, dtype=torch.float64).fill_(1.0),
              "after the dense torch.func route": lambda: dense(state),
              "after 2 s idle": lambda: time.sleep(2)}
    for label, fn in before.items():
        for _ in range(repeats):
            x = fn()
            del x
            t, faults, sys_ms, user_ms = timed(reduced, state)
            print(f"{label}: first call {t:.2f} ms ({faults} minor faults, {sys_ms:.1f} ms system, {user_ms:.1f} ms "
                  f"user); next {timed(reduced, state)[0]:.2f} ms")


if __name__ == "__main__":
    main()
