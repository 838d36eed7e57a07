"""Linear representation learning (chapters 10-11): all seeds in one tensor program vs a Python loop over seeds.

The experiment is ``curvlab.linrep.run`` — ``n_steps`` fresh batches of ``n`` samples, an update and the metrics
(subspace distance, training and transfer losses) at every step — for ``S`` seeds of the problem
``y = F* G* x`` with ``kappa(Sigma) = 1e3`` and Rademacher inputs. Two variants, timed side by side:

``looped``
    ``linrep.run_looped``: the same experiment seed by seed (``S`` problems with one seed each), the baseline;
``batched``
    ``linrep.run``: every seed advances in the same batched tensor operations.

Sizes: the ``standard`` profile of chapter 10 (``d = 60``, ``k = 6``, ``d_y = 20``, ``n = 4d``) and the paper-sized
problem of the digest (``d = 100``, ``k = 8``, ``d_y = 20``, ``n = 5d``), 16 seeds, for AMGD and K-FAC. Both variants
use the library's thread rule (one thread for small per-step tensors, see ``linrep.ONE_THREAD_BELOW``).
On a CUDA device the problem and the generators live on the GPU.

Run ``python benchmarks/bench_linrep_seeds.py [--quick]`` or ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import compare, ratio_table  # noqa: E402

from curvlab import config  # noqa: E402
from curvlab import linrep as L  # noqa: E402

HP = {"AMGD": {"eta_G": 0.5, "normalize_step": True}, "K-FAC": {"eta_G": 0.5}}


def setup(method: str, S: int, d: int, k: int, d_y: int, n: int, T: int) -> dict:
    """Build the problem on the device (untimed); check once that both variants give traces of the same shape
    and statistically the same final distance (K-FAC, noiseless: both have converged)."""
    dev = config.device()
    prob = L.linrep_problem(S, d=d, k=k, d_y=d_y, kappa_x=1e3, kappa_F=5.0, x_dist="rademacher", seed=0,
                            device=dev)
    s = {"prob": prob, "method": method, "n": n, "T": T, "dev": dev}
    a, b = VARIANTS["looped"](s), VARIANTS["batched"](s)
    assert a["subspace_distance"].shape == b["subspace_distance"].shape == (S, T + 1)
    if method == "K-FAC":
        assert float(a["subspace_distance"][:, -1].max()) < 1e-3 and float(b["subspace_distance"][:, -1].max()) < 1e-3
    return s


def _batched(s: dict) -> dict:
    gen = torch.Generator(device=s["dev"]).manual_seed(0)
    return L.run(s["method"], s["prob"], s["T"], s["n"], HP[s["method"]], generator=gen)


def _looped(s: dict) -> dict:
    return L.run_looped(s["method"], s["prob"], s["T"], s["n"], HP[s["method"]], generator_seed=0)


VARIANTS = {"looped": _looped, "batched": _batched}


def main(quick: bool = False) -> list:
    """Run the benchmark; return its ratio table."""
    S, T = 16, (20 if quick else 60)
    shapes = [(60, 6, 20, 240)] if quick else [(60, 6, 20, 240), (100, 8, 20, 500)]
    sizes = [{"method": m, "S": S, "d": d, "k": k, "d_y": dy, "n": n, "T": T}
             for (d, k, dy, n) in shapes for m in ("AMGD", "K-FAC")]
    frame = compare("linrep_seeds", VARIANTS, sizes, setup=setup, repeats=5 if quick else 9, warmup=1,
                    baseline="looped")
    return [ratio_table(frame)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CI)")
    for table in main(parser.parse_args().quick):
        print(table.to_string(index=False))
