"""Condition number of the GN matrix of a two-layer linear CNN: reduced (Toeplitz/unfold) route vs dense torch.func.

The network of chapter 31: ``nn.Conv2d(1, c, s, bias=False)`` on 8 x 8 images, then a linear read-out to d_y = 10
outputs; p = c s^2 + d_y c o^2 parameters (o = 8 - s + 1 without padding, 8 with "same" padding). The data: n
scikit-learn digits whitened in pixel space (``curvlab.conv.whiten_images``), so Sigma_hat is the projection onto
the r directions the data use and the GN matrix has rank d_y r.

``conv_gn_routes`` (one benchmark, variants timed side by side, interleaved per repeat):
    ``dense``    the paper's route: the n d_y x p Jacobian of the ``nn.Conv2d`` model by torch.func,
                 H_GN = J^T J / n, eigvalsh (p x p), kappa at rank d_y r — the baseline;
    ``reduced``  ``curvlab.conv.gn_condition``: the Toeplitz matrix T(K) and the pasted read-out C(V), then
                 eigvalsh of the d_y d x d_y d reduced matrix I x W^T W + C_Sigma C_Sigma^T (d = 64).
Time and peak memory ratios come from the harness (``results/conv_gn_routes.{json,md}``); the agreement of the
two routes (relative difference of kappa, largest eigenvalue difference over lambda_max, gap at the cut) goes to
``results/conv_gn_agreement.{json,md}``.

Run ``python benchmarks/bench_conv_gn.py [--quick]`` or ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, compare, figure, machine_info, ratio_table  # noqa: E402

from curvlab import conv  # noqa: E402
from curvlab import deep_linear as dl  # noqa: E402

D_Y = 10
FRAME_ATTRS: dict = {}
STATES: list[dict] = []
FRAME_ATTRS: dict = {}


def problem(n: int, c: int, s: int, padding: int, seed: int = 0) -> dict:
    """Whitened digits (n images), a LeCun-initialised CNN and everything both routes need."""
    X = dl.digits(n, seed=seed, drop_constant=False)[0]
    Xw, U = conv.whiten_images(X)
    K, V = conv.init_weights(c, s, D_Y, padding=padding, generator=torch.Generator().manual_seed(seed))
    o = conv.output_side(8, s, padding)
    state = {"X": Xw, "Sigma_hat": Xw.T @ Xw / n, "K": K, "V": V, "padding": padding, "n": n, "c": c, "s": s,
             "r": U.shape[1], "rank": D_Y * U.shape[1], "p": c * s * s + D_Y * c * o * o}
    STATES.append(state)
    return state


def _keep(st: dict, name: str, lam: torch.Tensor) -> float:
    st.setdefault("results", {})[name] = lam
    return float(lam[0] / lam[st["rank"] - 1])


def kappa_dense(st: dict) -> float:
    H = conv.gn_dense(st["K"], st["V"], st["X"], padding=st["padding"])
    return _keep(st, "dense", torch.linalg.eigvalsh(H).flip(0))


def kappa_reduced(st: dict) -> float:
    H = conv.gn_reduced(st["K"], st["V"], st["Sigma_hat"], padding=st["padding"])
    return _keep(st, "reduced", torch.linalg.eigvalsh(H).flip(0))


ROUTES = {"dense": kappa_dense, "reduced": kappa_reduced}


def sizes(quick: bool) -> list[dict]:
    """(n, c, s, padding) with c o^2 >= r (so the rank is d_y r): p from about 700 to about 5000 (the dense route's p x p eigensolve dominates)."""
    out = [dict(n=200, c=4, s=5, padding=0),       # p = 740 (c o^2 = 64 >= r: rank d_y r)
           dict(n=200, c=4, s=3, padding=0),       # p = 1476
           dict(n=300, c=4, s=3, padding=1)]       # p = 2596
    if not quick:
        out += [dict(n=500, c=8, s=3, padding=1)]   # p = 5192
    return out


def agreement() -> pd.DataFrame:
    rows = []
    for st in STATES:
        res = st.get("results", {})
        if "dense" not in res or "reduced" not in res:
            continue
        k = st["rank"]
        ld, lr = res["dense"][:k], res["reduced"][:k]
        kd, kr = float(ld[0] / ld[-1]), float(lr[0] / lr[-1])
        rows.append({"size": f"n={st['n']}, c={st['c']}, s={st['s']}, padding={st['padding']}", "p": st["p"],
                     "d_y d": D_Y * 64, "rank d_y r": k, "kappa": kr, "rel. diff kappa": abs(kd - kr) / kr,
                     "max |Δλ| / λ_max": float((ld - lr).abs().max() / ld[0]),
                     "gap at the cut (dense)": float(res["dense"][k - 1] / res["dense"][k].abs().clamp_min(1e-300))})
    return pd.DataFrame(rows)


def _write_agreement(table: pd.DataFrame, quick: bool) -> None:
    md = ["**Agreement** (`conv_gn`, " + ("quick" if quick else "full") + " run): κ(GN) of the two-layer linear CNN "
          "at the rank d_y r, dense torch.func GN of the `nn.Conv2d` model vs the Toeplitz/unfold reduced matrix.", "",
          table.to_markdown(index=False, floatfmt=".3g"), ""]
    from harness import machine_text, write_payload
    m = machine_info()
    md.insert(2, f"Machine: {machine_text(m)}. Sizes as in `conv_gn_routes` (n, c, s, padding; p parameters).\n")
    write_payload("conv_gn_agreement", {"machine": m, "derived_from": "conv_gn_routes",
                                        "exercised_code": FRAME_ATTRS.get("exercised_code", {}),
                                        "runs": FRAME_ATTRS.get("runs", []),
                                        "rows": json.loads(table.to_json(orient="records"))}, "\n".join(md))


def _figures(frame: pd.DataFrame) -> dict:
    r = ratio_table(frame)
    red = r[(r.variant == "reduced") & (r.threads == 1)]
    sp = 1 / red["ratio"]
    mem = 1 / red["mem_ratio"]
    return {"speedup range threads=1": figure(sp.max(), f"{sp.min():.0f}–{sp.max():.0f}×"),
            "memory range threads=1": figure(mem.max(), f"{mem.min():.0f}–{mem.max():.0f}×")}


def main(quick: bool = False) -> list:
    """Run the benchmark; print and return the ratio table and the agreement table."""
    STATES.clear()
    frame = compare("conv_gn_routes", ROUTES, sizes(quick), setup=problem, repeats=5, warmup=1,
                    baseline="dense", memory=True, min_time=0.05, fixed={"d_y": D_Y, "input": "8 x 8 images"},
                    figures=_figures)
    FRAME_ATTRS.clear()
    FRAME_ATTRS.update(frame.attrs)
    agree = agreement()
    _write_agreement(agree, quick)
    tables = [ratio_table(frame), agree]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        for t in tables:
            print(t.to_string(index=False))
    return tables


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CI)")
    main(parser.parse_args().quick)
