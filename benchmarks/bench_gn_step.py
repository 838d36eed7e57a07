"""Gauss-Newton step and GN-vector product: dense vs kernel (push-through) vs matrix-free, for a wide MLP.

Model: one hidden layer, ``f(x) = v^T silu(U x + b)`` (``torch.nn``, via ``curvlab.curvature.flatten_params``),
``n`` training points, width ``M``, so ``p = (d + 2) M >> n``. Two benchmarks, written to ``results/``:

``gn_step``
    the damped GN direction :math:`(J^T J + eps I)^{-1} J^T r`: ``dense_param`` (Jacobian + ``p x p`` solve,
    the baseline), ``kernel`` (Jacobian + ``n x n`` solve), ``matrix_free`` (``n x n`` kernel from VJP/JVPs);
``gn_vector_product``
    :math:`G v`: ``dense_gn`` (form :math:`G = J^T J`, then multiply; the baseline), ``dense_prebuilt``
    (multiply by a :math:`G` formed beforehand, untimed), ``matrix_free`` (one JVP and one VJP).
``gn_step_scaling`` (cost vs width at fixed ``n``)
    the matrix-free step (``n`` VJPs and JVPs under ``vmap``: :math:`O(n^2 d\,\text{width})`, plus an ``n x n``
    solve that does not grow) and the matrix-free GN-vector product (:math:`O(n d\,\text{width})`): both
    expected linear in the width, i.e. in ``p``.

Run ``python benchmarks/bench_gn_step.py [--quick]`` or ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import compare, ratio_table, scaling  # noqa: E402

from curvlab import config  # noqa: E402
from curvlab import curvature as cv  # noqa: E402

EPS = 1e-3


def mlp_problem(n: int, d: int, width: int, seed: int = 0) -> dict:
    """A one-hidden-layer SiLU MLP as ``fn(theta) -> outputs (n,)``, with residual ``r`` and a probe vector ``v``."""
    dev = config.device()
    dtype = torch.float32 if dev.type == "mps" else torch.float64
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.SiLU(), torch.nn.Linear(width, 1, bias=False))
    net = net.to(device=dev, dtype=dtype)
    theta, unflatten = cv.flatten_params(dict(net.named_parameters()))
    X = torch.randn(n, d, generator=gen, dtype=dtype).to(dev)

    def fn(th: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(net, unflatten(th), (X,)).reshape(-1)

    r = torch.randn(n, generator=gen, dtype=dtype).to(dev)
    v = torch.randn(theta.numel(), generator=gen, dtype=dtype).to(dev)
    return {"fn": fn, "theta": theta, "r": r, "v": v, "p": theta.numel()}


STEP_VARIANTS = {
    "dense_param": lambda s: cv.damped_gn_step(cv.jacobian(s["fn"], s["theta"]), s["r"], EPS),
    "kernel": lambda s: cv.kernel_gn_step(cv.jacobian(s["fn"], s["theta"]), s["r"], EPS),
    "matrix_free": lambda s: cv.kernel_gn_step_fn(s["fn"], s["theta"], s["r"], EPS),
}

GVP_VARIANTS = {
    "dense_gn": lambda s: cv.gn_matrix(s["fn"], s["theta"]) @ s["v"],
    "dense_prebuilt": lambda s: s["G"] @ s["v"],
    "matrix_free": lambda s: cv.gn_vector_product(s["fn"], s["theta"], s["v"]),
}


def step_setup(n: int, d: int, width: int) -> dict:
    """Build the problem (untimed) and check once that the three step variants agree."""
    s = mlp_problem(n, d, width)
    ref = STEP_VARIANTS["dense_param"](s)
    for name in ("kernel", "matrix_free"):
        torch.testing.assert_close(STEP_VARIANTS[name](s), ref, rtol=1e-6, atol=1e-8, msg=f"{name} disagrees")
    return s


def gvp_setup(n: int, d: int, width: int) -> dict:
    """Build the problem and the dense G (untimed), and check the matrix-free product against it."""
    s = mlp_problem(n, d, width)
    s["G"] = cv.gn_matrix(s["fn"], s["theta"])
    torch.testing.assert_close(GVP_VARIANTS["matrix_free"](s), s["G"] @ s["v"], rtol=1e-6, atol=1e-8)
    return s


def main(quick: bool = False) -> list:
    """Run both benchmarks; return their ratio tables."""
    widths = (32, 128, 384) if quick else (64, 256, 512)  # p = 12 * width: up to 4608 (quick) / 6144
    sizes = [{"n": 32 if quick else 64, "d": 10, "width": w} for w in widths]
    repeats = 5 if quick else 7
    tables = []
    for name, variants, setup, base in (("gn_step", STEP_VARIANTS, step_setup, "dense_param"),
                                        ("gn_vector_product", GVP_VARIANTS, gvp_setup, "dense_gn")):
        frame = compare(name, variants, sizes, setup=setup, repeats=repeats, warmup=1, baseline=base)
        tables.append(ratio_table(frame))
    tables += scaling_curve(quick)
    return tables


def scaling_curve(quick: bool = False) -> list:
    """Cost of the matrix-free step and of the GN-vector product against the width (p = 12 width) at n = 32, as two
    curves with their own ladders: the product is about 40x cheaper, so its ladder starts (past the overhead rule,
    20x the probe) and ends at larger widths, and it starts where its ten or so live (n, width) arrays no longer fit
    the 32 MiB last-level cache (from 32768 to 524288 it fitted 1.36, the cache transition). The first ladder
    (512-16384, shared) left too few sizes for either."""
    curves = []
    for name, variant, (lo, hi) in (("gn_step_scaling", "step matrix_free", (4096, 65536) if quick else (16384, 262144)),
                                    ("gn_vector_product_scaling", "G v matrix_free",
                                     (65536, 655360) if quick else (131072, 1310720))):
        fn = (STEP_VARIANTS if variant.startswith("step") else GVP_VARIANTS)["matrix_free"]
        widths = [int(w) for w in np.geomspace(lo, hi, 5).round()]
        what = "matrix-free GN step, model O(n² d·width)" if variant.startswith("step") else \
            "matrix-free GN-vector product, model O(n d·width)"
        curves.append(scaling(name, {variant: fn}, [{"n": 32, "d": 10, "width": w} for w in widths], x="width",
                              probe={"n": 32, "d": 10, "width": 2}, setup=mlp_problem, expected={variant: 1.0},
                              repeats=5 if quick else 7,
                              model=f"Chapter 01 (curvature primer): {what} of a one-hidden-layer MLP, n = 32, "
                                    "d = 10; exponent 1 in the width."))
    return curves


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CI)")
    for table in main(parser.parse_args().quick):
        print(table.to_string(index=False))
