"""curvlab.model against curvlinops on the same nn.Module: GGN-vector products and the condition number.

Model: an MLP ``d -> width -> width -> c`` (tanh) with the cross-entropy loss on ``n`` random inputs with random
labels (the curvature does not care whether the labels mean anything). Two benchmarks, written to ``results/``:

``model_ggn_vector_product``
    :math:`H_{\\mathrm{GN}} v` for one vector ``v``: ``curvlinops`` (``GGNLinearOperator @ v``, the baseline) and
    ``curvlab.model`` (:func:`curvlab.model.ggn_vector_product`: one JVP and one VJP per chunk). Two sizes: one where
    the dense ``p x p`` matrix would still fit (float64) and one with ``p >= 10^6`` (float32), where it would not.
``model_kappa``
    :math:`\kappa(H_{\mathrm{GN}})` over the nonzero spectrum at a size where dense spectra are possible:
    ``curvlinops`` (the dense ``p x p`` GGN from ``GGNLinearOperator @ I``, then ``eigvalsh``, the baseline) and
    ``curvlab.model`` (:func:`curvlab.model.condition`: the ``nc x nc`` kernel from vmapped VJPs, then ``eigvalsh``;
    cheaper whenever :math:`nc < p`). The two results are checked to agree before timing.
``model_kappa_lanczos``
    The same :math:`\kappa` at ``p >= 10^6`` (float32), where neither dense route is possible, by Lanczos (SciPy's
    ``eigsh``, ARPACK) on the ``nc x nc`` kernel :math:`K/n = \tilde J\tilde J^\top/n` in both variants, with the
    same ``k``, ``tol`` and rank rule: ``curvlab.model`` (:func:`curvlab.model.condition` with ``method="lanczos"``)
    and ``curvlinops`` (the baseline: the same two ``eigsh`` calls on the operator
    :math:`w \mapsto S^\top J(J^\top S w)/n` built from curvlinops' ``JacobianLinearOperator`` and
    ``TransposedJacobianLinearOperator``, :math:`S` the softmax Hessian's square root). Why the kernel: with
    :math:`nc \ll p` the ``p x p`` GGN has a null space of dimension at least :math:`p - n(c-1)`, and Lanczos on it
    (``eigsh(which="SA")`` on ``GGNLinearOperator``) finds neither the cut nor the smallest *nonzero* eigenvalue; on
    the kernel the only null directions are cross-entropy's :math:`n` known ones, :math:`\sqrt{\pi_i}` in sample
    :math:`i`'s block, which both variants lift to :math:`\lambda_{\max}` before asking for the smallest
    eigenvalues. The agreement of the two variants, :math:`\lambda_{\max}` from curvlinops' ``p x p``
    ``GGNLinearOperator`` (``eigsh(which="LA")``: the one end that route reaches) and what ``eigsh(which="SA")`` on
    it returns are written to ``results/model_kappa_agreement.{json,md}``.

Both libraries see the same module, data and parameters; curvlinops' ``MSELoss``/``CrossEntropyLoss`` conventions are
matched (``CrossEntropyLoss(reduction="mean")`` is the book's averaged loss). Skipped, with a message, when curvlinops
is not installed (it is in the ``test`` extra). Run ``OMP_NUM_THREADS=1 python benchmarks/bench_model.py [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pandas as pd

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, compare, machine_info, ratio_table, revision_text  # noqa: E402

from curvlab import config  # noqa: E402
from curvlab import model as cm  # noqa: E402


def mlp_problem(n: int, d: int, width: int, c: int = 10, dtype: str = "float64", seed: int = 0) -> dict:
    """The module, its data, ``cm.problem``, curvlinops' GGN and Jacobian operators and a probe vector (untimed)."""
    from curvlinops import GGNLinearOperator, JacobianLinearOperator, TransposedJacobianLinearOperator

    dev, dt = config.device(), getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, c))
    net = net.to(device=dev, dtype=dt)
    X = torch.randn(n, d, generator=gen, dtype=dt).to(dev)
    y = torch.randint(0, c, (n,), generator=gen).to(dev)
    prob = cm.problem(net, X, y, "cross_entropy")
    params = [p for p in net.parameters() if p.requires_grad]
    data = [(X, y)]
    op = GGNLinearOperator(net, nn.CrossEntropyLoss(), params, data, check_deterministic=False)
    J = JacobianLinearOperator(net, params, data, check_deterministic=False)
    JT = TransposedJacobianLinearOperator(net, params, data, check_deterministic=False)
    v = torch.randn(prob.p, generator=gen, dtype=dt).to(dev)
    return {"prob": prob, "op": op, "J": J, "JT": JT, "net": net, "X": X, "v": v, "params": params, "p": prob.p}


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


#: Lanczos settings shared by both variants of ``model_kappa_lanczos``: eigenpairs per end and ARPACK's tolerance
#: (relative residual; float32 products resolve about 1e-7 of lambda_max, so 1e-8 would ask for noise).
LANCZOS = {"k": 6, "tol": 1e-6}


def _scipy(matvec, size: int, dtype: torch.dtype, device, counter: list | None = None):
    """A float64 SciPy operator around a torch matvec in the model's dtype (as curvlab.model's own operator)."""
    import numpy as np
    from scipy.sparse.linalg import LinearOperator

    def mv(x):
        if counter is not None:
            counter[0] += 1
        t = torch.as_tensor(np.asarray(x, dtype=np.float64).reshape(-1), dtype=dtype, device=device)
        with torch.no_grad():
            return matvec(t).to("cpu", torch.float64).numpy()

    return LinearOperator((size, size), matvec=mv, dtype=np.float64)


def _curvlinops_kernel(s: dict):
    """``(w -> K w / n, sqrt(pi))`` with ``K = S^T J J^T S`` from curvlinops' J and J^T operators (w sample-major)."""
    prob, J, JT = s["prob"], s["J"], s["JT"]
    n, c = prob.n, prob.c
    with torch.no_grad():
        pi = torch.softmax(s["net"](s["X"]), dim=-1)
    sq = pi.sqrt()
    S = torch.diag_embed(sq) - pi.unsqueeze(-1) * sq.unsqueeze(-2)  # S S^T = diag(pi) - pi pi^T

    def kernel(w):
        u = JT @ torch.einsum("bij,bj->bi", S, w.reshape(n, c)).reshape(-1)
        return torch.einsum("bij,bi->bj", S, (J @ u).reshape(n, c)).reshape(-1) / n

    return kernel, sq


def _curvlinops_kernel_condition(s: dict, counter: list | None = None) -> dict:
    """kappa over the nonzero spectrum by Lanczos on K/n = S^T J J^T S / n, products by curvlinops' J and J^T.

    The same algorithm as :func:`curvlab.model.condition` (method="lanczos"), written out on curvlinops' operators:
    eigsh for the k largest; cross-entropy's n known null directions sqrt(pi_i) lifted to lambda_max; eigsh for the k
    smallest; the numerical rank cut at rtol * lambda_max with curvlab's default rtol for the kernel's size.
    """
    import numpy as np
    from scipy.sparse.linalg import eigsh

    from curvlab.linalg import default_rtol

    prob = s["prob"]
    n, c, dt, dev = prob.n, prob.c, prob.dtype, prob.device
    kernel, sq = _curvlinops_kernel(s)
    k, tol = LANCZOS["k"], LANCZOS["tol"]
    top = eigsh(_scipy(kernel, n * c, dt, dev, counter), k=k, which="LA", tol=tol, return_eigenvectors=False)
    lam_max = float(np.max(top))

    def lifted(w):
        return kernel(w) + lam_max * (sq * (sq * w.reshape(n, c)).sum(-1, keepdim=True)).reshape(-1)

    bottom = np.sort(eigsh(_scipy(lifted, n * c, dt, dev, counter), k=k, which="SA", tol=tol,
                           return_eigenvectors=False))[::-1]
    threshold = default_rtol(n * c, dt) * lam_max
    kept = bottom[bottom > threshold]
    rank = n * c - n - int((bottom <= threshold).sum())
    return {"lambda_max": lam_max, "lambda_min_nonzero": float(kept[-1]), "rank": rank,
            "kappa": lam_max / float(kept[-1])}


def _curvlab_lanczos_condition(s: dict) -> dict:
    r = cm.condition(s["prob"], method="lanczos", **LANCZOS)
    return {"lambda_max": r.lambda_max, "lambda_min_nonzero": r.lambda_min_nonzero, "rank": r.rank, "kappa": r.kappa}


LANCZOS_VARIANTS = {"curvlinops": _curvlinops_kernel_condition, "curvlab.model": _curvlab_lanczos_condition}
#: what lanczos_setup measured, per size: the agreement table is built from it after the run
AGREEMENT: list = []


def _counted_curvlab(s: dict) -> tuple[dict, int]:
    """curvlab.model's Lanczos result and the number of kernel products it used (instrumented; not timed)."""
    count, real = [0], cm._kernel_vector_product

    def counted(prob, w):
        count[0] += 1
        return real(prob, w)

    cm._kernel_vector_product = counted
    try:
        return _curvlab_lanczos_condition(s), count[0]
    finally:
        cm._kernel_vector_product = real


def _pxp_ends(s: dict) -> dict:
    """What Lanczos on curvlinops' p x p GGNLinearOperator gives: lambda_max (which="LA") and, for the other end,
    what which="SA" returns within a bounded number of restarts (the null space, or no convergence)."""
    import time

    import numpy as np
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh

    count = [0]
    op = _scipy(lambda x: s["op"] @ x, s["p"], s["prob"].dtype, s["prob"].device, count)
    t0 = time.perf_counter()
    top = eigsh(op, k=LANCZOS["k"], which="LA", tol=LANCZOS["tol"], return_eigenvectors=False)
    out = {"lambda_max": float(np.max(top)), "la_products": count[0], "la_time_s": time.perf_counter() - t0}
    count[0] = 0
    t0 = time.perf_counter()
    try:
        bottom = eigsh(op, k=LANCZOS["k"], which="SA", tol=LANCZOS["tol"], maxiter=10, return_eigenvectors=False)
        out["sa"] = "smallest " + ", ".join(f"{x:.2g}" for x in np.sort(bottom))
    except ArpackNoConvergence as err:
        out["sa"] = f"no convergence ({len(err.eigenvalues)} of {LANCZOS['k']} converged)"
    out.update(sa_products=count[0], sa_time_s=time.perf_counter() - t0)
    return out


def lanczos_setup(**size) -> dict:
    """Build the problem; run both variants once (the agreement pass, also the warm-up) and the p x p ends."""
    import time

    s = mlp_problem(**size)
    # the two routes' kernel products must agree before any Lanczos is trusted
    w = torch.randn(s["prob"].n * s["prob"].c, dtype=s["prob"].dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        Kw_a, Kw_b = _curvlinops_kernel(s)[0](w), cm._kernel_vector_product(s["prob"], w) / s["prob"].n
    assert float((Kw_a - Kw_b).abs().max()) <= 1e-4 * float(Kw_b.abs().max()), "kernel products disagree"
    count = [0]
    t0 = time.perf_counter()
    a = _curvlinops_kernel_condition(s, count)
    t_a, n_a = time.perf_counter() - t0, count[0]
    t0 = time.perf_counter()
    b, n_b = _counted_curvlab(s)
    t_b = time.perf_counter() - t0
    pxp = _pxp_ends(s)
    eps = float(torch.finfo(s["prob"].dtype).eps)
    # Each Ritz value is within ARPACK's residual bound tol * |lambda| of an eigenvalue of the operator it saw; the two
    # operators are the same matrix up to float rounding of the products (about sqrt(width) * eps relative to
    # lambda_max): allow both on each side, times 10 for the bound's constant.
    bound = 10 * (2 * LANCZOS["tol"] + 2 * math.sqrt(size["width"]) * eps)
    rel = {key: abs(a[key] - b[key]) / abs(b["lambda_max"]) for key in ("lambda_max", "lambda_min_nonzero")}
    assert a["rank"] == b["rank"], f"rank disagrees: curvlinops {a['rank']}, curvlab.model {b['rank']}"
    assert max(rel.values()) <= bound, f"Lanczos ends disagree beyond {bound:.2g} lambda_max: {rel}"
    assert abs(pxp["lambda_max"] - b["lambda_max"]) <= bound * b["lambda_max"], "p x p lambda_max disagrees"
    label = ", ".join(f"{k}={v}" for k, v in size.items())
    nc = s["prob"].n * s["prob"].c
    common = {"size": label, "p": s["p"], "nc": nc}
    AGREEMENT.extend([
        {**common, "route": "curvlab.model.condition: eigsh on K/n (sqrt(pi) lifted)", **b, "products": n_b,
         "time_s": t_b},
        {**common, "route": "curvlinops J, J^T operators: the same eigsh on K/n", **a, "products": n_a,
         "time_s": t_a},
        {**common, "route": "curvlinops GGNLinearOperator (p x p): eigsh LA", "lambda_max": pxp["lambda_max"],
         "lambda_min_nonzero": math.nan, "rank": math.nan, "kappa": math.nan, "products": pxp["la_products"],
         "time_s": pxp["la_time_s"]},
        {**common, "route": f"curvlinops GGNLinearOperator (p x p): eigsh SA, maxiter 10: {pxp['sa']}",
         "lambda_max": math.nan, "lambda_min_nonzero": math.nan, "rank": math.nan, "kappa": math.nan,
         "products": pxp["sa_products"], "time_s": pxp["sa_time_s"]},
    ])
    AGREEMENT.append({**common, "route": "difference, curvlinops K route vs curvlab, / lambda_max (bound asserted: "
                      f"{bound:.2g})", "lambda_max": rel["lambda_max"], "lambda_min_nonzero": rel["lambda_min_nonzero"],
                      "rank": a["rank"] - b["rank"], "kappa": abs(a["kappa"] - b["kappa"]) / b["kappa"],
                      "products": math.nan, "time_s": math.nan})
    return s


LANCZOS_ATTRS: dict = {}


def _write_agreement(quick: bool) -> pd.DataFrame:
    table = pd.DataFrame(AGREEMENT)
    m = machine_info()
    md = ["**Agreement** (`model_kappa_lanczos`, " + ("quick" if quick else "full") + " run): the ends of the GN "
          "spectrum at p ≥ 10⁶ by each route, one untimed call each (the agreement pass before the timed repeats; "
          "*products*: operator applications; *time*: that one call). λ_r is the smallest eigenvalue kept above the "
          f"rank cut (rtol × λ_max); κ = λ_max/λ_r. Lanczos: k = {LANCZOS['k']} per end, tol = {LANCZOS['tol']:g}. "
          "Last row per size: differences relative to λ_max (κ: relative to κ), with the bound the run asserts.", "",
          f"Machine: {m['cpu_model']}, {m['cores_available']} cores available (load average "
          f"{m.get('load_average_1min', float('nan')):.2f} at the end), device {m['device']}; "
          f"rev `{m['revision_label']}`; {m['timestamp_utc']}.", "",
          table.to_markdown(index=False, floatfmt=".4g"), ""]
    from harness import write_payload
    write_payload("model_kappa_agreement", {"machine": m, "lanczos": LANCZOS, "derived_from": "model_kappa_lanczos",
                                            "exercised_code": LANCZOS_ATTRS.get("exercised_code", {}),
                                            "runs": LANCZOS_ATTRS.get("runs", []),
                                            "rows": json.loads(table.to_json(orient="records"))}, "\n".join(md))
    return table


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
    """Run the three benchmarks; return their ratio tables and the agreement table (empty when curvlinops is absent).

    Single-threaded when run as a script (``torch.set_num_threads(1)``): both libraries on one core.
    """
    if importlib.util.find_spec("curvlinops") is None:
        print("bench_model: curvlinops is not installed (pip install 'curvlab[test]'); skipped")
        return []
    dense = {"n": 32 if quick else 128, "d": 32, "width": 24 if quick else 32}  # p = 1642 / 2442: dense p x p fits
    large = {"n": 32 if quick else 128, "d": 784, "width": 1024, "dtype": "float32"}  # p = 1.86e6: it would not
    repeats = 5
    tables = []
    frame = compare("model_ggn_vector_product", GVP_VARIANTS, [dense, large], setup=gvp_setup, repeats=repeats,
                    warmup=1, baseline="curvlinops", min_time=0.2)
    tables.append(ratio_table(frame))
    frame = compare("model_kappa", KAPPA_VARIANTS, [dense], setup=kappa_setup, repeats=repeats, warmup=1,
                    baseline="curvlinops")
    tables.append(ratio_table(frame))
    # one Lanczos kappa takes tens of seconds on one core: the setup's agreement pass is the warm-up
    AGREEMENT.clear()
    frame = compare("model_kappa_lanczos", LANCZOS_VARIANTS, [large], setup=lanczos_setup, repeats=5,
                    warmup=0, baseline="curvlinops", threads=(1,) if quick else ("default", 1)[::-1])
    LANCZOS_ATTRS.clear()
    LANCZOS_ATTRS.update(frame.attrs)
    tables.append(ratio_table(frame))
    tables.append(_write_agreement(quick))
    return tables


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CI)")
    torch.set_num_threads(1)
    for table in main(parser.parse_args().quick):
        print(table.to_string(index=False))
