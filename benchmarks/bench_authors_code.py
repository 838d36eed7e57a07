"""The benchmarks' baseline against the authors' own released code: is ``authors_gn.py`` as fast as their step?

Paper 2's authors released their Gauss–Newton optimizer (MichaelArbel/Implicit-Bias-Gauss-Newton,
``core/optimizers/GN.py``) and network (``models/multilayer_net.py``). Their code is **not** in this repository
and is never committed: this benchmark loads it from a checkout (or a bare git mirror) named by
``--authors-code DIR`` or ``CURVLAB_AUTHORS_CODE``. Without it the benchmark writes nothing and says so.

Three variants compute the same GN direction at the same θ₀ and data (paper 2's n = 500, d = 10, SiLU, σ₀ = 1,
v ≠ 0, width m), baseline ``authors_code``:

``authors_code``
    their ``GN.step`` on their ``OneHiddenLayer`` (lr = 1, ε = 1e-7, loss ½‖f − y‖², whose output gradient is the
    residual), the parameters restored after each step; the direction is the parameters' change.
``authors_gn``
    the benchmarks' re-implementation (``benchmarks/authors_gn.py``) with the forward written as theirs
    (:func:`authors_gn.forward_like_theirs`: the read-out as an ``einsum``).
``authors_gn_matvec``
    the same re-implementation with the forward written as a matrix-vector product (``curvlab.meanfield.forward``),
    as the baseline was before: it shows what the way the read-out is written does to the step's speed.

Their code as released runs in float32 only: its last line casts ``z`` with ``.float()`` before the product with a
float64 Jacobian, which raises. For the float64 rows the file is loaded with that expression (in its two branches)
replaced, in memory, by ``.to(jac.dtype)`` (a no-op in float32); nothing else is changed. The directions of the three variants
are compared before timing (relative difference, recorded).

Run ``python benchmarks/bench_authors_code.py --authors-code /path/to/Implicit-Bias-Gauss-Newton``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import authors_gn  # noqa: E402
from harness import compare, figure, ratio_table, write_results  # noqa: E402

from curvlab import meanfield as mf  # noqa: E402

N, D, ACT, EPS = 500, 10, "silu", 1e-7
ENV = "CURVLAB_AUTHORS_CODE"
PATCH = ("grad.float()", "grad.to(jac.dtype)")


def _source_dir(path: str | Path) -> tuple[Path, str]:
    """A directory holding ``core/optimizers/GN.py`` and ``models/multilayer_net.py``, and the commit they are from.
    ``path`` is a checkout or a bare git mirror (then the two files are exported into a temporary directory)."""
    path = Path(path)
    if (path / "core" / "optimizers" / "GN.py").is_file():
        rev = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        return path, rev.stdout.strip() or "unknown"
    if (path / "HEAD").is_file() and (path / "objects").is_dir():
        out = Path(tempfile.mkdtemp(prefix="authors_code_"))
        archive = subprocess.run(["git", f"--git-dir={path}", "archive", "HEAD", "core", "models"],
                                 capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
        rev = subprocess.run(["git", f"--git-dir={path}", "rev-parse", "HEAD"], capture_output=True, text=True)
        return out, rev.stdout.strip()
    raise FileNotFoundError(f"authors_code must be a checkout or bare mirror of Implicit-Bias-Gauss-Newton, got {path}")


def load_theirs(path: str | Path, patch_dtype: bool) -> tuple[type, type, str]:
    """``(GN, OneHiddenLayer, commit)`` from their files; ``patch_dtype`` applies the one float64 cast (module doc)."""
    src, rev = _source_dir(path)
    gn_text = (src / "core" / "optimizers" / "GN.py").read_text()
    if patch_dtype:
        if PATCH[0] not in gn_text:
            raise RuntimeError(f"expected {PATCH[0]!r} in their GN.py: their code changed, review the patch")
        gn_text = gn_text.replace(*PATCH)
    gn_mod = type(sys)("authors_GN")
    exec(compile(gn_text, str(src / "core" / "optimizers" / "GN.py"), "exec"), gn_mod.__dict__)  # noqa: S102
    spec = importlib.util.spec_from_file_location("authors_multilayer_net", src / "models" / "multilayer_net.py")
    net_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net_mod)
    return gn_mod.GN, net_mod.OneHiddenLayer, rev


def problem(m: int, dtype: torch.dtype, code: str, n: int = N, d: int = D, seed: int = 0) -> dict:
    GN, Net, rev = load_theirs(code, patch_dtype=dtype != torch.float32)
    data = mf.teacher_student([seed], act=ACT, d=d, n=n, n_test=10).to(dtype=dtype)
    p = mf.init_student(m, d, init_std=1.0, seeds=[seed], v0_zero=False, dtype=dtype).map(lambda t: t[0])
    X, Y = data.X[0], data.Y[0]
    net = Net(d, m).to(dtype)
    with torch.no_grad():
        net.linear1.weight.copy_(p.W)
        net.linear1.bias.copy_(p.b)
        net.linear2.weight.copy_(p.v.reshape(-1, 1))
    opt = GN(net.parameters(), lr=1.0, epsilon=EPS)
    closure = opt.custom_closure(X, Y.reshape(-1, 1), lambda pred, y: 0.5 * ((pred - y) ** 2).sum(), net)
    theta0 = [q.detach().clone() for q in net.parameters()]
    return {"p": p, "X": X, "r": mf.forward(p, X, ACT) - Y, "net": net, "opt": opt, "closure": closure,
            "theta0": theta0, "rev": rev, "mine": authors_gn.AuthorsGN(epsilon=EPS),
            "matvec": authors_gn.AuthorsGN(epsilon=EPS)}


def authors_code(s: dict) -> torch.Tensor:
    """Their step; the direction is θ₀ − θ₁ (lr = 1), flattened as (v, W, b); θ₀ restored."""
    s["opt"].step(s["closure"])
    W, b, v = s["net"].parameters()
    out = torch.cat([(s["theta0"][2] - v).reshape(-1), (s["theta0"][0] - W).reshape(-1), s["theta0"][1] - b])
    with torch.no_grad():
        for q, q0 in zip(s["net"].parameters(), s["theta0"]):
            q.copy_(q0)
    return out


def authors_gn_einsum(s: dict) -> torch.Tensor:
    p, X = s["p"], s["X"]
    (dW, db, dv), _ = s["mine"].direction(lambda W, b, v: authors_gn.forward_like_theirs(X, W, b, v),
                                          [p.W, p.b, p.v.reshape(-1, 1)], s["r"])
    return torch.cat([dv.reshape(-1), dW.reshape(-1), db.reshape(-1)])


def authors_gn_matvec(s: dict) -> torch.Tensor:
    p, X = s["p"], s["X"]
    (dv, dW, db), _ = s["matvec"].direction(lambda v, W, b: mf.forward(mf.MFParams(v, W, b), X, ACT),
                                            [p.v, p.W, p.b], s["r"])
    return torch.cat([dv.reshape(-1), dW.reshape(-1), db.reshape(-1)])


VARIANTS = {"authors_code": authors_code, "authors_gn": authors_gn_einsum, "authors_gn_matvec": authors_gn_matvec}


def _figures(frame: pd.DataFrame, agreement: dict) -> dict:
    r = ratio_table(frame)
    out = {}
    for row in r.itertuples():
        if row.variant == "authors_code":
            continue
        key = f"{row.variant} {row.size} threads={row.threads}"
        out[key] = figure(row.ratio, f"{row.ratio:.2f}", low=row.ratio_ci_low, high=row.ratio_ci_high,
                          interval=f"{row.ratio_ci_low:.2f}–{row.ratio_ci_high:.2f}", within_10_percent=bool(
                              abs(row.ratio - 1) <= 0.10), coverage=row.ratio_ci_coverage)
    for k, v in agreement.items():
        out[f"agreement {k}"] = figure(v, f"{v:.1e}")
    return out


def main(quick: bool = False, code: str | None = None, widths: tuple[int, ...] = (500,), repeats: int = 5) -> list:
    code = code or os.environ.get(ENV)
    if not code:
        print(f"bench_authors_code: skipped (no {ENV} / --authors-code: the authors' code is not in this repository)")
        return []
    tables = []
    for dtype in (torch.float64, torch.float32):
        tag = str(dtype).replace("torch.", "")
        agreement: dict = {}

        def setup(m: int, dtype=dtype) -> dict:
            s = problem(m, dtype, code)
            with torch.no_grad():
                ref = authors_code(s).detach()
            p, X = s["p"], s["X"]
            _, stats = authors_gn.AuthorsGN(epsilon=EPS).direction(
                lambda W, b, v: authors_gn.forward_like_theirs(X, W, b, v), [p.W, p.b, p.v.reshape(-1, 1)], s["r"])
            # round-off of a solve with condition number cond, in the Jacobian's dtype: n u cond (times 10)
            tol = 10 * N * torch.finfo(dtype).eps * stats["cond"]
            agreement[f"tolerance {tag} m={m}"] = tol
            for name in ("authors_gn", "authors_gn_matvec"):
                err = float((VARIANTS[name](s).detach() - ref).norm() / ref.norm())
                agreement[f"{name} vs authors_code {tag} m={m}"] = err
                if err > tol:
                    raise AssertionError(f"{name} disagrees with their step: relative difference {err:.2g} > {tol:.2g}")
            return s

        name = f"authors_code_vs_authors_gn_{tag}"
        frame = compare(name, VARIANTS, [{"m": w} for w in widths], setup=setup,
                        repeats=repeats, warmup=1, baseline="authors_code", memory=False,
                        fixed={"n": N, "d": D, "activation": ACT, "dtype": tag, "epsilon": EPS,
                               "authors_commit": None},
                        figures=lambda f: _figures(f, agreement), write=False)
        rev = load_theirs(code, patch_dtype=False)[2]
        frame.attrs["settings"]["fixed"]["authors_commit"] = rev
        frame.attrs["settings"]["fixed"]["authors_code_patched"] = (
            f"{PATCH[0]} -> {PATCH[1]} in memory" if dtype != torch.float32 else "unmodified")
        write_results(name, frame)
        tables.append(ratio_table(frame))
    return tables


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors-code", default=None, help=f"their checkout or bare mirror (or set {ENV})")
    parser.add_argument("--widths", default="500")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    for t in main(code=args.authors_code, widths=tuple(int(w) for w in args.widths.split(",")),
                  repeats=args.repeats):
        print(t.to_string(index=False, float_format="{:.4g}".format))
