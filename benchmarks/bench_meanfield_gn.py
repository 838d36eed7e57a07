"""One Gauss-Newton step of the mean-field network (chapter 20) by three routes, with a flop/byte model.

Problem: paper 2's defaults, n = 500 samples, d = 10, width m in {500, 2000, 5000}, SiLU, sigma_0 = 1 and v != 0
(so every Jacobian block is active), the authors' adaptive damping lambda_GN = max(1e-7, lambda_min(K)). Every route
computes the same thing: K = J J^T in float64, its eigenvalues (for the damping), z = (K + lambda_GN I)^-1 r and the
step J^T z. They differ only in how K and J^T z are obtained:

``structured``
    ``curvlab.meanfield.gn_direction``: K and J^T z from the closed-form Jacobian blocks; J is never formed.
``authors_gn``
    a re-implementation of the authors' step (``benchmarks/authors_gn.py``, following ``GN.step`` in their
    repository's ``core/optimizers/GN.py``; no code copied): one Jacobian block per parameter tensor from
    ``torch.vmap`` of ``torch.autograd.grad`` over the rows of the n x n identity, split into ``pieces`` chunks that
    double when the vmapped call fails (their fallback, up to 128); K accumulated in float64 over the blocks; an
    SVD of K with the damping ``max(1e-7, s_min)`` added to the singular values; J^T z per block. Its vmapped
    intermediates are (n / pieces, n, m) tensors (about 3 GB at m = 500 in float64 with one piece). On a CPU an
    allocation that the kernel would grant lazily and then kill the process for is not an exception, so the
    benchmark makes the failure explicit: a chunk whose modelled intermediates exceed 60 % of the memory available
    raises before it allocates (:func:`_memory_guard`), and the authors' doubling takes over from there. (An earlier
    version of this benchmark called a different route "the authors'": one ``torch.func`` VJP vmapped over a flat
    parameter vector, an ``eigvalsh`` + Cholesky solve, no chunking. It was 1.1-2x slower than their code in float64
    and used about 1.5x its memory; the ratios it gave are withdrawn on the performance page.)
``chunked_dense``
    the same dense J built by VJPs in row chunks whose intermediates fit 256 MiB, then the same dense products.

Two reports per dtype (float64, float32 parameters; Gram matrices are float64 in every route):
``meanfield_gn_step_vs_authors_<dtype>`` (all three routes, baseline ``authors_gn``; m = 500, and outside ``--quick``
2000 and 5000, where the authors' chunking takes over) and, outside
``--quick``, ``meanfield_gn_step_vs_chunked_<dtype>`` (m = 2000 and 5000, baseline ``chunked_dense``).

**The model.** :func:`flop_byte_model` counts the operations and the memory traffic of each route, phase by phase.
:func:`machine_ceilings` times, in the same run, what this machine attains for each kind of work: a GEMM of the Gram
products' shape (in the parameters' dtype and in float64), streaming bandwidth (a copy of 256 MiB into a
preallocated buffer, beyond the last-level cache), and the two LAPACK factorisations on an n x n matrix (a symmetric eigensolver and a Cholesky
factorisation reach neither the GEMM rate nor a bandwidth bound, so they are counted at their own measured time).
:func:`roofline_time` prices each phase at ``max(flops / rate, bytes / bandwidth)`` and sums the phases: the
roofline model of the route on this machine. ``meanfield_gn_step_model`` reports, per size and dtype, the measured
speed-up of ``structured`` as a fraction of the roofline model's speed-up (the goal: at least 70 %), each route's
*efficiency* (model time / measured time: how close it runs to its own roofline), the flop-only and byte-only
ratios (bounds, not time models: the structured route is compute-bound, the dense ones memory-bound), and the
peak-memory ratio.

``meanfield_gn_step_scaling``: the cost of the ``structured`` step against the width m at n = 50 (the model's
4n²m + 2nm(d + 2) + 2nmd terms are linear in m; the 9n³ eigenvalue problem does not grow): exponent 1.

Run ``python benchmarks/bench_meanfield_gn.py [--quick]`` or ``benchmarks/run_all.py --only meanfield``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.func import vjp, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, compare, machine_info, ratio_table, scaling  # noqa: E402
import authors_gn  # noqa: E402

from curvlab import config  # noqa: E402
from curvlab import meanfield as mf  # noqa: E402

N, D, ACT, FLOOR = 500, 10, "silu", 1e-7
CHUNK_BUDGET = 256 * 2**20  # bytes of vmapped intermediates per chunk in the chunked route


def problem(n: int, d: int, m: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> dict:
    """Teacher-student data and a student with v != 0, on the configured device."""
    dev = config.device()
    data = mf.teacher_student([seed], act=ACT, d=d, n=n, n_test=10).to(dtype=dtype, device=dev)
    p = mf.init_student(m, d, init_std=1.0, seeds=[seed], v0_zero=False, dtype=dtype, device=dev)
    p1 = p.map(lambda t: t[0])
    X, Y = data.X[0], data.Y[0]
    fn = mf.model_fn(X, m, ACT)
    return {"params": p1, "X": X, "Y": Y, "fn": fn, "theta": mf.flatten(p1), "n": n, "m": m, "d": d,
            "dtype": dtype, "chunk": _chunk(n, m, torch.finfo(dtype).bits // 8)}


def _chunk(n: int, m: int, itemsize: int) -> int:
    """Rows per chunk so that the vmapped (chunk, n, m) intermediates (about three of them) fit CHUNK_BUDGET."""
    return max(1, min(n, int(CHUNK_BUDGET // (3 * n * m * itemsize))))


def _damped_solve(K: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The authors' damping and solve, shared by the dense routes (eigenvalues for lambda_min, then Cholesky)."""
    lam = max(FLOOR, float(torch.linalg.eigvalsh(K)[0]))
    L = torch.linalg.cholesky(K + lam * torch.eye(K.shape[0], dtype=K.dtype, device=K.device))
    return torch.cholesky_solve(r.unsqueeze(-1), L).squeeze(-1)


def _dense_step(s: dict, J: torch.Tensor) -> torch.Tensor:
    r = (s["fn"](s["theta"]) - s["Y"]).to(torch.float64)
    Jg = J.to(torch.float64)
    z = _damped_solve(Jg @ Jg.T, r)
    return J.T @ z.to(J.dtype)


def structured(s: dict) -> torch.Tensor:
    res = mf.gn_direction(s["params"], s["X"], s["Y"], ACT, mf.Damping.adaptive(FLOOR), spectrum=True)
    return mf.flatten(res.delta)


def _memory_guard(n: int, m: int, itemsize: int, share: float = 0.6):
    """A ``chunked_vmap`` that raises (as an allocation failure would) when a chunk's modelled intermediates, about
    three (n / pieces, n, m) tensors, exceed ``share`` of the available memory; otherwise the authors' chunking."""
    real = authors_gn.chunked_vmap

    def guarded(func, pieces, rows):
        need = 3.0 * itemsize * -(-n // pieces) * n * m
        if need > share * _available_bytes():
            raise RuntimeError(f"modelled vmap intermediates {need / 2**30:.1f} GiB do not fit")
        return real(func, pieces, rows)

    return guarded


def authors_gn_route(s: dict) -> torch.Tensor:
    """The authors' step (re-implemented in ``authors_gn.py``), its direction J^T z flattened as ``mf.flatten``."""
    p, X = s["params"], s["X"]
    r = mf.forward(p, X, ACT) - s["Y"]
    opt = s.setdefault("authors_opt", authors_gn.AuthorsGN(epsilon=FLOOR))  # keeps its chunking between steps
    item = torch.finfo(s["dtype"]).bits // 8
    authors_gn.chunked_vmap, real = _memory_guard(s["n"], s["m"], item), authors_gn.chunked_vmap
    try:  # their forward (the read-out as an einsum, parameters in their order and shapes)
        (dW, db, dv), _ = opt.direction(lambda W, b, v: authors_gn.forward_like_theirs(X, W, b, v),
                                        [p.W, p.b, p.v.reshape(-1, 1)], r)
    finally:
        authors_gn.chunked_vmap = real
    return torch.cat([dv.reshape(-1), dW.reshape(-1), db.reshape(-1)])


def chunked_dense(s: dict) -> torch.Tensor:
    _, pull = vjp(s["fn"], s["theta"])
    eye = torch.eye(s["n"], dtype=s["dtype"], device=s["theta"].device)
    J = torch.cat([vmap(pull)(eye[i:i + s["chunk"]])[0] for i in range(0, s["n"], s["chunk"])])
    return _dense_step(s, J)


def _phases(route: str, n: int, m: int, d: int, itemsize: int) -> list[tuple[str, float, float, str]]:
    """``(phase, flops, bytes, rate)`` of one GN step along ``route``; ``rate`` names the ceiling the flops run at:
    ``gemm`` (parameters' dtype), ``gemm64`` (the float64 Gram products), ``eig`` and ``chol`` (timed whole)."""
    p = m * (d + 2)
    f64 = 8
    shared = [("eigenvalues of K", 0.0, 0.0, "eig"), ("Cholesky of K + lambda I", 0.0, 0.0, "chol")]
    if route == "authors_gn":
        shared = [("SVD of K", 0.0, 0.0, "svd"), ("V diag(1/(s + lambda)) U^T r", 4.0 * n * n, f64 * 2.0 * n * n, "gemm64")]
    if route == "structured":
        cast = f64 * 2 * n * m if itemsize != f64 else 0.0        # Phi, A converted to the float64 Gram dtype
        return [
            # Z = X W^T + b, then Phi = sigma(Z) and A = sigma'(Z) v/m: write Z, read it, write Phi and A
            ("features Phi, A", 2.0 * n * m * d, itemsize * 4.0 * n * m, "gemm"),
            # Phi Phi^T and A A^T: read both (n, m) blocks in float64, write two n x n
            ("Gram products", 4.0 * n * n * m, f64 * 2.0 * n * m + f64 * 2.0 * n * n + cast, "gemm64"),
            ("K = G + S o (A A^T)", 2.0 * n * n, f64 * 4.0 * n * n, "gemm64"),
            *shared,
            # J^T z: Phi^T z, Q = A o z, Q^T X, sum over samples; read Phi and A, write Q
            ("J^T z from the blocks", 2.0 * n * m * (d + 2), itemsize * 3.0 * n * m, "gemm"),
        ]
    return [
        ("forward pass", 2.0 * n * m * d, itemsize * 2.0 * n * m, "gemm"),
        # n vector-Jacobian products over the whole batch (the W-gradient, 2nmd each, dominates); vmapped, each
        # writes and reads about three (n, m) intermediates
        ("n VJPs (the rows of J)", 2.0 * n * n * m * d, itemsize * 3.0 * n * n * m, "gemm"),
        ("assemble J, cast to float64", 0.0, itemsize * n * p + f64 * 2.0 * n * p, "gemm64"),
        ("K = J J^T", 2.0 * n * n * p, f64 * (n * p + n * n), "gemm64"),
        *shared,
        ("J^T z", 2.0 * n * p, f64 * n * p, "gemm64"),
    ]


def flop_byte_model(route: str, n: int, m: int, d: int, itemsize: int = 8) -> dict:
    """Leading-order floating-point operations and bytes moved by one GN step along ``route``, and its peak memory.

    Shared by all routes: the n x n eigenvalue problem (about 9n^3 with tridiagonalisation) and the Cholesky solve
    (n^3/3). ``structured``: two n x m x n Gram products (4n^2 m) and J^T z (2nm(d+2)); it touches Phi and A (a few
    passes over 2nm entries) and K. The dense routes: n VJPs over the whole batch, each a backward pass (2nmd for
    the W-gradient, which dominates), i.e. 2n^2 md; then K = JJ^T (2n^2 p) and J^T z (2np), with p = m(d+2); they
    write and read J (np entries, twice) and, vmapped, hold (n, n, m) intermediates. ``phases`` lists the same
    counts phase by phase for :func:`roofline_time`.
    """
    phases = _phases(route, n, m, d, itemsize)
    lapack = 22 * n ** 3 if route == "authors_gn" else 9 * n ** 3 + n ** 3 / 3   # SVD (Golub-Van Loan) vs eig + Cholesky
    flops = sum(f for _, f, _, _ in phases) + lapack
    bytes_ = sum(b for _, _, b, _ in phases)
    if route == "structured":
        peak = 8 * (3 * n * m + 2 * n * n)
    else:
        chunk = n if route == "authors_gn" else _chunk(n, m, itemsize)
        p = m * (d + 2)
        peak = itemsize * n * p + 8 * n * p + 3 * itemsize * chunk * n * m
    return {"route": route, "flops": float(flops), "bytes": float(bytes_), "model_peak_bytes": float(peak),
            "phases": phases}


def _median_time(thunk, dev: torch.device, repeats: int = 5) -> float:
    thunk()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        thunk()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def machine_ceilings(n: int, dtype: torch.dtype, m_gemm: int = 2000) -> dict:
    """What this machine attains for each kind of work in :func:`_phases`, timed now (medians of 5):

    ``gemm`` / ``gemm64``: flop/s of an (n x m_gemm) @ (m_gemm x n) product (the Gram products' shape) in ``dtype``
    and in float64; ``bandwidth``: bytes/s of copying 256 MiB into a preallocated buffer (read + write, beyond the
    last-level cache: the STREAM copy); ``fresh_copy``: the same copy into new memory (``clone``), which also pays
    the first touch of every page — reported, not used by the model;
    ``eig`` / ``chol``: seconds of ``eigvalsh`` and ``cholesky`` of an n x n SPD float64 matrix."""
    dev = config.device()
    out = {}
    for key, dt in (("gemm", dtype), ("gemm64", torch.float64)):
        P = torch.randn(n, m_gemm, dtype=dt, device=dev)
        out[key] = 2.0 * n * n * m_gemm / _median_time(lambda: P @ P.T, dev)
    big = torch.randn(32 * 2**20, dtype=torch.float64, device=dev)
    dst = torch.empty_like(big)
    out["bandwidth"] = 2.0 * big.numel() * 8 / _median_time(lambda: dst.copy_(big), dev)
    # not a ceiling, for the report: the same copy into freshly allocated memory (first-touch page faults)
    out["fresh_copy"] = 2.0 * big.numel() * 8 / _median_time(lambda: big.clone(), dev)
    del big, dst
    A = torch.randn(n, 2 * n, dtype=torch.float64, device=dev)
    K = A @ A.T / n
    out["eig"] = _median_time(lambda: torch.linalg.eigvalsh(K), dev)
    out["chol"] = _median_time(lambda: torch.linalg.cholesky(K), dev)
    out["svd"] = _median_time(lambda: torch.linalg.svd(K), dev)
    return out


def roofline_time(phases: list, ceilings: dict) -> float:
    """Seconds of a route on this machine by the roofline: each phase at ``max(flops / rate, bytes / bandwidth)``,
    the LAPACK phases at their measured time, summed."""
    total = 0.0
    for _, flops, bytes_, rate in phases:
        if rate in ("eig", "chol", "svd"):
            total += ceilings[rate]
        else:
            total += max(flops / ceilings[rate], bytes_ / ceilings["bandwidth"])
    return total


def _available_bytes() -> float:
    """Memory available for new allocations now: the device's free memory on CUDA, else MemAvailable (Linux) or,
    failing that, the physical memory."""
    dev = config.device()
    if dev.type == "cuda":
        return float(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 1024.0 * float(line.split()[1])
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _check_agreement(s: dict, routes: dict) -> None:
    ref = structured(s)
    tol = 1e-6 if s["dtype"] == torch.float64 else 2e-3
    for name, f in routes.items():
        got = f(s)
        err = float((got - ref).norm() / ref.norm())
        if err > tol:
            raise AssertionError(f"{name} disagrees with structured: relative error {err:.2g}")


def _run(name: str, variants: dict, sizes: list, dtype: torch.dtype, baseline: str, repeats: int) -> pd.DataFrame:
    def setup(n: int, d: int, m: int) -> dict:
        s = problem(n, d, m, dtype)
        _check_agreement(s, {k: v for k, v in variants.items() if k != "structured"})
        return s

    frame = compare(name, variants, sizes, setup=setup, repeats=repeats, warmup=1, baseline=baseline)
    table = ratio_table(frame)
    table["dtype"] = str(dtype).replace("torch.", "")
    return table


def summarise(table: pd.DataFrame, baseline: str, ceilings: dict) -> pd.DataFrame:
    """Measured speed-up of ``structured`` over the baseline, as a fraction of the roofline model's (the goal) and of
    the flop-only and byte-only ratios; each route's efficiency against its roofline time; memory ratios."""
    out = []
    for (size, dt), g in table.groupby(["size", "dtype"]):
        m = int(dict(kv.split("=") for kv in size.split(", "))["m"])
        item = 8 if dt == "float64" else 4
        st = g[g.variant == "structured"].iloc[0]
        base = g[g.variant == baseline].iloc[0]
        fm = {r: flop_byte_model(r, N, m, D, item) for r in ("structured", baseline)}
        roof = {r: roofline_time(fm[r]["phases"], ceilings) for r in fm}
        model_r = roof[baseline] / roof["structured"]
        model_f = fm[baseline]["flops"] / fm["structured"]["flops"]
        model_b = fm[baseline]["bytes"] / fm["structured"]["bytes"]
        measured = 1.0 / st.ratio
        out.append({"size": size, "dtype": dt, "baseline": baseline,
                    "time_structured_ms": 1e3 * st.median_time_s, "time_baseline_ms": 1e3 * base.median_time_s,
                    "speedup_measured": measured, "speedup_ci": f"{1 / st.ratio_ci_high:.3g}-{1 / st.ratio_ci_low:.3g}",
                    "roofline_structured_ms": 1e3 * roof["structured"], "roofline_baseline_ms": 1e3 * roof[baseline],
                    "speedup_model_roofline": model_r, "fraction_of_roofline_model": measured / model_r,
                    "efficiency_structured": roof["structured"] / st.median_time_s,
                    "efficiency_baseline": roof[baseline] / base.median_time_s,
                    "speedup_model_flops": model_f, "fraction_of_flop_model": measured / model_f,
                    "speedup_model_bytes": model_b, "fraction_of_byte_model": measured / model_b,
                    "mem_ratio_measured": 1.0 / st.mem_ratio if st.mem_ratio > 0 else float("nan"),
                    "mem_ratio_model": fm[baseline]["model_peak_bytes"] / fm["structured"]["model_peak_bytes"]})
    return pd.DataFrame(out)


def write_model_report(summaries: list, ceilings: dict, results_dir: Path | None = None) -> Path:
    """``meanfield_gn_step_model.{json,md}``: the ceilings measured per dtype and every summary row."""
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.concat(summaries, ignore_index=True)
    frame["_m"] = [int(dict(kv.split("=") for kv in z.split(", "))["m"]) for z in frame["size"]]
    frame = (frame.sort_values(["dtype", "baseline", "_m"], ascending=[False, True, True], kind="stable")
             .drop(columns="_m").reset_index(drop=True))
    machine = machine_info(config.device())
    (out / "meanfield_gn_step_model.json").write_text(json.dumps(
        {"name": "meanfield_gn_step_model", "machine": machine, "ceilings": ceilings,
         "rows": json.loads(frame.to_json(orient="records"))}, indent=1) + "\n")
    lines = [
        "**Benchmark `meanfield_gn_step_model`** — one GN step (n = 500, d = 10): the measured speed-up of "
        "`structured` against the roofline model's, and each route's efficiency (roofline time / measured time).",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cores_available']} cores available (torch threads "
        f"{machine['torch_threads']}), device {machine['device']}; torch {machine['torch']}; curvlab rev "
        f"`{machine['curvlab_revision']}`; {machine['timestamp_utc']}.",
        "",
        "Ceilings measured in the same run: " + "; ".join(
            f"{dt}: GEMM {c['gemm'] / 1e9:.0f} GFLOP/s (float64 {c['gemm64'] / 1e9:.0f}), bandwidth "
            f"{c['bandwidth'] / 1e9:.1f} GB/s (into fresh memory: {c.get('fresh_copy', float('nan')) / 1e9:.1f}), "
            f"eigvalsh {1e3 * c['eig']:.1f} ms, Cholesky {1e3 * c['chol']:.1f} ms"
            for dt, c in ceilings.items()) + ".",
        "",
        "Columns: the baseline; the measured speed-up of `structured` (its 95 % interval is in the ratio tables "
        "below); the roofline model's speed-up; their quotient, *fraction* (goal: at least 70 %); each route's "
        "efficiency (its roofline time over its measured time); the peak-memory ratio. The flop-only and "
        "byte-only ratios (bounds, not time models) span "
        f"{frame.speedup_model_flops.min():.3g}–{frame.speedup_model_flops.max():.3g} and "
        f"{frame.speedup_model_bytes.min():.3g}–{frame.speedup_model_bytes.max():.3g} (in the JSON report).",
        "",
        "| m | dtype | baseline | speed-up | model | fraction | efficiency, structured | baseline | memory |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in frame.itertuples():
        m = dict(kv.split("=") for kv in r.size.split(", "))["m"]
        base = r.baseline.split("_")[0]
        lines.append(f"| {m} | {r.dtype} | {base} | {r.speedup_measured:.3g} | {r.speedup_model_roofline:.3g} | "
                     f"{100 * r.fraction_of_roofline_model:.0f} % | {100 * r.efficiency_structured:.0f} % | "
                     f"{100 * r.efficiency_baseline:.0f} % | {r.mem_ratio_measured:.3g} |")
    path = out / "meanfield_gn_step_model.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(quick: bool = False, widths: list[int] | None = None) -> list:
    """Run the comparisons; return the ratio tables and the model summaries.

    ``quick``: m = 500 only (all three routes), 2 repeats — about a minute on two cores. Full: the authors' route
    at every width that fits in memory (3 repeats), and m = 2000 and 5000 against the chunked route (the dense
    routes take seconds to tens of seconds per call there).
    ``widths``: only the comparison with the authors' route at these widths (no chunked-route tables, no scaling
    curve), for a rerun of the contested ratios in a limited time.
    """
    tables, summaries, ceilings = [], [], {}
    only = widths is not None
    for dtype in (torch.float64, torch.float32):
        tag = str(dtype).replace("torch.", "")
        ceilings[tag] = machine_ceilings(N, dtype)
        ws = widths if only else ([500] if quick else [500, 2000, 5000])
        t1 = _run(f"meanfield_gn_step_vs_authors_{tag}",
                  {"authors_gn": authors_gn_route, "structured": structured, "chunked_dense": chunked_dense},
                  [{"n": N, "d": D, "m": w} for w in ws], dtype, "authors_gn", 5)
        summaries.append(summarise(t1, "authors_gn", ceilings[tag]))
        tables += [t1, summaries[-1]]
        if not quick and not only:
            t2 = _run(f"meanfield_gn_step_vs_chunked_{tag}",
                      {"chunked_dense": chunked_dense, "structured": structured},
                      [{"n": N, "d": D, "m": w} for w in (2000, 5000)], dtype, "chunked_dense", 5)
            summaries.append(summarise(t2, "chunked_dense", ceilings[tag]))
            tables += [t2, summaries[-1]]
    write_model_report(summaries, ceilings)
    if not only:
        tables.append(scaling_curve(quick))
    return tables


def scaling_curve(quick: bool = False) -> pd.DataFrame:
    """Cost of one structured GN step against the width m at n = 50 (chapter 20): expected linear in m.

    The ladder starts where the step's working set (about ten (n, m) float64 arrays) is several times the 32 MiB
    last-level cache, so every size runs in the same memory regime: a ladder that starts inside the cache (as the
    first one did, m = 4000-128000) measures the cache transition too and fits an exponent above 1."""
    lo, hi, k = (32_000, 320_000, 5) if quick else (64_000, 640_000, 6)
    widths = [int(w) for w in np.geomspace(lo, hi, k).round()]
    return scaling("meanfield_gn_step_scaling", {"structured": structured},
                   [{"n": 50, "d": D, "m": m} for m in widths], x="m", probe={"n": 50, "d": D, "m": 2},
                   setup=lambda n, d, m: problem(n, d, m), expected={"structured": 1.0}, repeats=5 if quick else 7,
                   model="Chapter 20: one GN step of the mean-field network by the structured route (K and J^T z "
                         "from the Jacobian blocks), n = 50, d = 10, float64; model 4n²m + 4nmd + 9n³, exponent 1 "
                         "in m. Every size's working set exceeds the last-level cache (one memory regime).")


def fault_profile(m: int = 500, dtype: torch.dtype = torch.float64, calls: int = 3) -> pd.DataFrame:
    """Where each route's CPU time goes at width ``m``: wall, user and system seconds per call and minor page
    faults per call (``resource.getrusage``; Linux/macOS). Not part of the timed report."""
    import resource
    s, rows = problem(N, D, m, dtype), []
    for name, route in (("authors_gn", authors_gn_route), ("chunked_dense", chunked_dense), ("structured", structured)):
        route(s)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(calls):
            route(s)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        rows.append({"route": name, "m": m, "dtype": str(dtype).replace("torch.", ""),
                     "wall_s": (t1 - t0) / calls, "user_s": (r1.ru_utime - r0.ru_utime) / calls,
                     "system_s": (r1.ru_stime - r0.ru_stime) / calls,
                     "minor_faults": (r1.ru_minflt - r0.ru_minflt) / calls})
    return pd.DataFrame(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width 500 only, fewer repeats")
    parser.add_argument("--faults", action="store_true", help="only the page-fault profile of each route (m = 500)")
    parser.add_argument("--widths", default=None,
                        help="comma-separated widths: only the comparison with the authors' route there (e.g. 500,2000)")
    pd.set_option("display.width", 200)
    args = parser.parse_args()
    if args.faults:
        print(fault_profile().to_string(index=False, float_format="{:.4g}".format))
    else:
        widths = [int(w) for w in args.widths.split(",")] if args.widths else None
        for table in main(args.quick, widths):
            print(table.to_string(index=False, float_format="{:.4g}".format))
