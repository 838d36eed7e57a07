"""curvlab.model against curvlinops on the same nn.Module: GGN-vector products and the condition number.

Model: an MLP ``d -> width -> width -> c`` (tanh) with the cross-entropy loss on ``n`` random inputs with random
labels (the curvature does not care whether the labels mean anything). Two benchmarks, written to ``results/``:

``model_ggn_vector_product``
    :math:`H_{\\mathrm{GN}} v` for one vector ``v``: ``curvlinops`` (``GGNLinearOperator @ v``, the baseline) and
    ``curvlab.model`` (:func:`curvlab.model.ggn_vector_product`: one JVP and one VJP per chunk). Two sizes: one where
    the dense ``p x p`` matrix would still fit (float64) and one with ``p >= 10^6`` (float32), where it would not.
``model_kappa``
    :math:`\\kappa(H_{\\mathrm{GN}})` over the nonzero spectrum at a size where dense spectra are possible:
    ``curvlinops`` (the dense ``p x p`` GGN from ``GGNLinearOperator @ I``, then ``eigvalsh``, the baseline) and
    ``curvlab.model`` (:func:`curvlab.model.condition`: the ``nc x nc`` kernel from vmapped VJPs, then ``eigvalsh``;
    cheaper whenever :math:`nc < p`). The two results are checked to agree before timing.

Both libraries see the same module, data and parameters; curvlinops' ``MSELoss``/``CrossEntropyLoss`` conventions are
matched (``CrossEntropyLoss(reduction="mean")`` is the book's averaged loss). Skipped, with a message, when curvlinops
is not installed (it is in the ``test`` extra). Run ``python benchmarks/bench_model.py [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import compare, ratio_table  # noqa: E402

from curvlab import config  # noqa: E402
from curvlab import model as cm  # noqa: E402


def mlp_problem(n: int, d: int, width: int, c: int = 10, dtype: str = "float64", seed: int = 0) -> dict:
    """The module, its data, ``cm.problem``, curvlinops' GGN operator and a probe vector (built untimed)."""
    from curvlinops import GGNLinearOperator

    dev, dt = config.device(), getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, c))
    net = net.to(device=dev, dtype=dt)
    X = torch.randn(n, d, generator=gen, dtype=dt).to(dev)
    y = torch.randint(0, c, (n,), generator=gen).to(dev)
    prob = cm.problem(net, X, y, "cross_entropy")
    params = [p for p in net.parameters() if p.requires_grad]
    op = GGNLinearOperator(net, nn.CrossEntropyLoss(), params, [(X, y)], check_deterministic=False)
    v = torch.randn(prob.p, generator=gen, dtype=dt).to(dev)
    return {"prob": prob, "op": op, "v": v, "params": params, "p": prob.p}


GVP_VARIANTS = {
    "curvlinops": lambda s: s["op"] @ s["v"],
    "curvlab.model": lambda s: cm.ggn_vector_product(s["prob"], s["v"]),
}


def _curvlinops_kappa(s: dict) -> float:
    """kappa over the nonzero spectrum of curvlinops' dense GGN, with curvlab's rank rule (rtol = size eps)."""
    G = s["op"] @ torch.eye(s["p"], dtype=s["v"].dtype, device=s["v"].device)
    lam = torch.linalg.eigvalsh(config.spectral(0.5 * (G + G.T))).flip(0)
    size = min(s["p"], s["prob"].n * s["prob"].c)  # the nonzero spectrum lives in the smaller of p and nc
    kept = lam[lam > size * torch.finfo(s["v"].dtype).eps * lam[0]]
    return float(kept[0] / kept[-1])


def _curvlab_kappa(s: dict) -> float:
    s["prob"]._cache = None  # time the whole computation, not a Jacobian kept from the previous call
    return cm.condition(s["prob"], method="dense").kappa


KAPPA_VARIANTS = {"curvlinops": _curvlinops_kappa, "curvlab.model": _curvlab_kappa}


def gvp_setup(**size) -> dict:
    s = mlp_problem(**size)
    a, b = (f(s) for f in GVP_VARIANTS.values())
    tol = 1e-10 if s["v"].dtype == torch.float64 else 1e-4
    assert float((a - b).abs().max()) <= tol * float(a.abs().max()), "curvlab.model and curvlinops disagree on G v"
    return s


def kappa_setup(**size) -> dict:
    s = mlp_problem(**size)
    a, b = (f(s) for f in KAPPA_VARIANTS.values())
    assert abs(a - b) <= 1e-6 * a, f"kappa disagrees: curvlinops {a:.6g}, curvlab.model {b:.6g}"
    return s


def main(quick: bool = False) -> list:
    """Run both benchmarks; return their ratio tables (empty when curvlinops is absent)."""
    if importlib.util.find_spec("curvlinops") is None:
        print("bench_model: curvlinops is not installed (pip install 'curvlab[test]'); skipped")
        return []
    dense = {"n": 32 if quick else 128, "d": 32, "width": 24 if quick else 32}  # p = 1642 / 2474: dense p x p fits
    large = {"n": 64 if quick else 128, "d": 784, "width": 1024, "dtype": "float32"}  # p = 1.86e6: it would not
    repeats = 3 if quick else 5
    tables = []
    frame = compare("model_ggn_vector_product", GVP_VARIANTS, [dense, large], setup=gvp_setup, repeats=repeats,
                    warmup=1, baseline="curvlinops", min_time=0.2)
    tables.append(ratio_table(frame))
    frame = compare("model_kappa", KAPPA_VARIANTS, [dense], setup=kappa_setup, repeats=repeats, warmup=1,
                    baseline="curvlinops")
    tables.append(ratio_table(frame))
    return tables


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CI)")
    for table in main(parser.parse_args().quick):
        print(table.to_string(index=False))
