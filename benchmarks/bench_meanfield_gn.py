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

**The model.** :func:`flop_byte_model` counts the operations and the memory traffic of each route, phase by phase,
at leading order and from below (the LAPACK phases by the flops of their reductions: 4/3 n³ for the eigenvalues,
n³/3 for Cholesky, 8/3 n³ for the SVD). :func:`machine_ceilings` measures the machine's *peaks* in the same run, at
each thread setting: a square 2048 × 2048 GEMM in the route's dtype and in float64 (best of 7) and the copy
bandwidth into a preallocated 256 MiB buffer (best of 7). :func:`roofline_time` prices each phase at
``max(flops / peak rate, bytes / peak bandwidth)`` and sums the phases: a lower bound on the route's time on this
machine. ``meanfield_gn_step_model`` reports, per size, dtype and thread setting, the measured speed-up with its
interval and each route's *efficiency* (bound / measured time, at most 100 % unless a peak was measured too low; the
report flags such rows). The earlier model priced the LAPACK phases at their own measured time and the GEMM at the
median rate of the Gram products' shape: neither is a bound, and a rerun measured 107 % "of roofline"; the fraction
of the model's speed-up is no longer reported (a ratio of two bounds bounds nothing).

``meanfield_gn_step_faults``: resource usage per call of each route at m = 500 (minor page faults, user and system
time), one thread.

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
    # LAPACK work counted by its leading flops, a lower bound for any algorithm of its kind (values only:
    # tridiagonal reduction 4/3 n^3; Cholesky n^3/3; SVD: bidiagonal reduction 8/3 n^3), priced at the GEMM peak
    shared = [("eigenvalues of K", 4.0 / 3.0 * n ** 3, f64 * n * n, "gemm64"),
              ("Cholesky of K + lambda I", n ** 3 / 3.0, f64 * n * n, "gemm64")]
    if route == "authors_gn":
        shared = [("SVD of K", 8.0 / 3.0 * n ** 3, f64 * n * n, "gemm64"),
                  ("V diag(1/(s + lambda)) U^T r", 4.0 * n * n, f64 * 2.0 * n * n, "gemm64")]
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
    flops = sum(f for _, f, _, _ in phases)
    bytes_ = sum(b for _, _, b, _ in phases)
    if route == "structured":
        peak = 8 * (3 * n * m + 2 * n * n)
    else:
        chunk = n if route == "authors_gn" else _chunk(n, m, itemsize)
        p = m * (d + 2)
        peak = itemsize * n * p + 8 * n * p + 3 * itemsize * chunk * n * m
    return {"route": route, "flops": float(flops), "bytes": float(bytes_), "model_peak_bytes": float(peak),
            "phases": phases}


def _best_time(thunk, dev: torch.device, repeats: int = 7) -> float:
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
    return float(min(times))


def machine_ceilings(dtype: torch.dtype, threads: int, size: int = 2048) -> dict:
    """The peaks the roofline assumes, measured now on this machine at ``threads`` torch threads (best of 7):

    ``gemm`` / ``gemm64``: flop/s of a square ``size`` x ``size`` matrix product in ``dtype`` and in float64 (the
    fastest kind of work a CPU does in that dtype, so no phase of any route can run faster per flop);
    ``bandwidth``: bytes/s of copying 256 MiB into a preallocated buffer (read + write, beyond the last-level cache:
    the STREAM copy); ``fresh_copy``: the same copy into new memory (``clone``), which also pays the first touch of
    every page — reported, not used. Best-of rather than median: a peak is what the machine can do, and load only
    ever slows a timing down."""
    dev = config.device()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {"threads": threads, "gemm_size": size}
        for key, dt in (("gemm", dtype), ("gemm64", torch.float64)):
            P = torch.randn(size, size, dtype=dt, device=dev)
            Q = torch.randn(size, size, dtype=dt, device=dev)
            out[key] = 2.0 * size ** 3 / _best_time(lambda: P @ Q, dev)
        big = torch.randn(32 * 2**20, dtype=torch.float64, device=dev)
        dst = torch.empty_like(big)
        out["bandwidth"] = 2.0 * big.numel() * 8 / _best_time(lambda: dst.copy_(big), dev)
        out["fresh_copy"] = 2.0 * big.numel() * 8 / _best_time(lambda: big.clone(), dev, repeats=3)
        del big, dst
    finally:
        torch.set_num_threads(previous)
    return out


def roofline_time(phases: list, ceilings: dict) -> float:
    """A lower bound on a route's seconds on this machine: each phase at ``max(flops / peak rate, bytes / peak
    bandwidth)``, summed. Every flop and byte is counted at its leading order from below and priced at a peak, so a
    measured time below it means a peak was measured too low (under load), never a route beating the bound."""
    return float(sum(max(flops / ceilings[rate], bytes_ / ceilings["bandwidth"]) for _, flops, bytes_, rate in phases))


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


def _run(name: str, variants: dict, sizes: list, dtype: torch.dtype, baseline: str, repeats: int) -> tuple:
    def setup(n: int, d: int, m: int) -> dict:
        s = problem(n, d, m, dtype)
        _check_agreement(s, {k: v for k, v in variants.items() if k != "structured"})
        return s

    tag = str(dtype).replace("torch.", "")
    frame = compare(name, variants, sizes, setup=setup, repeats=repeats, warmup=1, baseline=baseline,
                    fixed={"dtype": tag, "activation": ACT, "init_std": 1.0, "damping": f"max({FLOOR:g}, lambda_min(K))"},
                    figures=lambda f: _ratio_figures(f, baseline))
    table = ratio_table(frame)
    table["dtype"] = tag
    return table, frame


def _ratio_figures(frame: pd.DataFrame, baseline: str) -> dict:
    from harness import figure
    out = {}
    for r in ratio_table(frame).itertuples():
        if r.variant == baseline:
            continue
        m = dict(kv.split("=") for kv in r.size.split(", "))["m"]
        sp = 1 / r.ratio
        lo = 1 / r.ratio_ci_high if r.ratio_ci_high == r.ratio_ci_high else float("nan")
        hi = 1 / r.ratio_ci_low if r.ratio_ci_low == r.ratio_ci_low else float("nan")
        out[f"speedup {r.variant} m={m} threads={r.threads}"] = figure(
            sp, f"{sp:.0f}×" if sp >= 10 else f"{sp:.2g}×", interval=f"{lo:.0f}–{hi:.0f}×" if sp >= 10 else
            f"{lo:.2g}–{hi:.2g}×")
        out[f"time {baseline} m={m} threads={r.threads}"] = figure(
            r.median_time_s / r.ratio, f"{r.median_time_s / r.ratio:.2g} s")
    return out


def summarise(table: pd.DataFrame, baseline: str, ceilings: dict) -> pd.DataFrame:
    """Per size, dtype and thread setting: the measured speed-up of ``structured`` over the baseline with its
    interval, each route's roofline bound and *efficiency* (bound / measured time: at most 1 when the peaks hold),
    the flop-only and byte-only ratios, and the memory ratio. ``ceilings[threads]``: :func:`machine_ceilings`."""
    out = []
    for (size, dt, threads), g in table.groupby(["size", "dtype", "threads"]):
        m = int(dict(kv.split("=") for kv in size.split(", "))["m"])
        item = 8 if dt == "float64" else 4
        st = g[g.variant == "structured"].iloc[0]
        base = g[g.variant == baseline].iloc[0]
        ceil = ceilings[int(threads)]
        fm = {r: flop_byte_model(r, N, m, D, item) for r in ("structured", baseline)}
        roof = {r: roofline_time(fm[r]["phases"], ceil) for r in fm}
        measured = 1.0 / st.ratio
        out.append({"size": size, "m": m, "dtype": dt, "threads": int(threads), "baseline": baseline,
                    "time_structured_ms": 1e3 * st.median_time_s, "time_baseline_ms": 1e3 * base.median_time_s,
                    "speedup_measured": measured,
                    "speedup_low": 1 / st.ratio_ci_high if st.ratio_ci_high == st.ratio_ci_high else float("nan"),
                    "speedup_high": 1 / st.ratio_ci_low if st.ratio_ci_low == st.ratio_ci_low else float("nan"),
                    "speedup_coverage": st.ratio_ci_coverage,
                    "roofline_structured_ms": 1e3 * roof["structured"], "roofline_baseline_ms": 1e3 * roof[baseline],
                    "efficiency_structured": roof["structured"] / st.median_time_s,
                    "efficiency_baseline": roof[baseline] / base.median_time_s,
                    "speedup_model_flops": fm[baseline]["flops"] / fm["structured"]["flops"],
                    "speedup_model_bytes": fm[baseline]["bytes"] / fm["structured"]["bytes"],
                    "mem_ratio_measured": 1.0 / st.mem_ratio if st.mem_ratio > 0 else float("nan"),
                    "mem_ratio_model": fm[baseline]["model_peak_bytes"] / fm["structured"]["model_peak_bytes"]})
    return pd.DataFrame(out)


def model_figures(frame: pd.DataFrame) -> dict:
    """Named figures of the model report for the performance page."""
    from harness import figure
    out = {}
    for r in frame.itertuples():
        key = f"{r.baseline} m={r.m} {r.dtype} threads={r.threads}"
        out[f"speedup {key}"] = figure(r.speedup_measured, f"{r.speedup_measured:.0f}×",
                                       interval=f"{r.speedup_low:.0f}–{r.speedup_high:.0f}×")
        out[f"efficiency structured {key}"] = figure(r.efficiency_structured, f"{100 * r.efficiency_structured:.0f} %")
        out[f"efficiency baseline {key}"] = figure(r.efficiency_baseline, f"{100 * r.efficiency_baseline:.0f} %")
        out[f"memory {key}"] = figure(r.mem_ratio_measured, f"{r.mem_ratio_measured:.0f}×")
    for name, col in (("structured", "efficiency_structured"), ("baseline", "efficiency_baseline")):
        out[f"efficiency {name} range"] = figure(frame[col].max(), f"{100 * frame[col].min():.0f}–"
                                                 f"{100 * frame[col].max():.0f} %")
    out["efficiency max"] = figure(frame[["efficiency_structured", "efficiency_baseline"]].to_numpy().max(),
                                   f"{100 * frame[['efficiency_structured', 'efficiency_baseline']].to_numpy().max():.0f} %")
    return out


def write_model_report(summaries: list, ceilings: dict, results_dir: Path | None = None,
                       exercised: dict | None = None, runs: list | None = None) -> Path:
    """``meanfield_gn_step_model.{json,md}``: the peaks measured per dtype and thread setting, every summary row."""
    from harness import machine_text, runs_text, write_payload

    frame = pd.concat(summaries, ignore_index=True)
    frame = (frame.sort_values(["dtype", "baseline", "threads", "m"], ascending=[False, True, True, True],
                               kind="stable").reset_index(drop=True))
    machine = machine_info(config.device())
    over = frame[(frame.efficiency_structured > 1) | (frame.efficiency_baseline > 1)]
    lines = [
        f"**Benchmark `meanfield_gn_step_model`** — one GN step, n = {N}, d = {D}, SiLU, widths m as listed: the "
        "measured speed-up of `structured` over the baseline (median of paired ratios, order-statistic interval) and "
        "each route's *efficiency*: its roofline bound over its measured median time. The bound prices every phase's "
        "leading-order flops at the peak GEMM rate of the same dtype and thread count (a square 2048 × 2048 "
        "product, best of 7, measured in the same run) and its bytes at the peak copy bandwidth, and takes the "
        "larger, so an efficiency cannot exceed 100 % unless a peak was measured too low.",
        "",
        "Peaks: " + "; ".join(
            f"{dt}, {c['threads']} thread{'s' if c['threads'] != 1 else ''}: GEMM {c['gemm'] / 1e9:.1f} GFLOP/s "
            f"(float64 {c['gemm64'] / 1e9:.1f}), copy {c['bandwidth'] / 1e9:.1f} GB/s (into fresh memory "
            f"{c['fresh_copy'] / 1e9:.1f})" for (dt, _), c in ceilings.items()) + ".",
        "",
        f"Runs: {runs_text(runs or [])}." if runs else "",
        "",
        f"Machine: {machine_text(machine)}."
        + (f" **{len(over)} row(s) above 100 %: a peak was measured too low (load).**" if len(over) else ""),
        "",
        "| m | dtype | threads | baseline | speed-up | interval | efficiency, structured | baseline | memory ratio |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in frame.itertuples():
        lines.append(f"| {r.m} | {r.dtype} | {r.threads} | {r.baseline.split('_')[0]} | {r.speedup_measured:.3g} | "
                     f"{r.speedup_low:.3g}–{r.speedup_high:.3g} | {100 * r.efficiency_structured:.0f} % | "
                     f"{100 * r.efficiency_baseline:.0f} % | {r.mem_ratio_measured:.3g} |")
    out = Path(results_dir) if results_dir is not None else RESULTS_DIR
    return write_payload("meanfield_gn_step_model", {
        "machine": machine, "settings": {"n": N, "d": D, "activation": ACT, "floor": FLOOR,
                                         "sizes": sorted(set(frame["size"]))},
        "ceilings": [{"dtype": dt, **c} for (dt, _), c in ceilings.items()], "runs": runs or [],
        "flagged": any(r.get("flagged") for r in (runs or [])), "exercised_code": exercised or {},
        "figures": model_figures(frame), "rows": json.loads(frame.to_json(orient="records"))},
        "\n".join(lines) + "\n", results_dir=out)


def main(quick: bool = False, widths: list[int] | None = None, chunked: bool = False) -> list:
    """Run the comparisons; return the ratio tables and the model summaries.

    Every comparison runs at one thread and at torch's default (the harness's protocol), 5 repeats.
    ``quick``: m = 500 only. Full: m = 500 and 2000, the structured step against the authors' route, the
    page-fault profile at m = 500 and the cost-vs-size curve. ``widths``: only the comparison with the authors'
    route at these widths. ``chunked``: the chunked dense route in that comparison too, and m = 2000 and 5000
    against it (tens of minutes on two cores).
    """
    from harness import default_threads

    tables, summaries, ceilings, exercised, runs = [], [], {}, {}, []
    only = widths is not None
    threads = sorted({1, default_threads()})
    for dtype in (torch.float64, torch.float32):
        tag = str(dtype).replace("torch.", "")
        cdict = {t: machine_ceilings(dtype, t) for t in threads}
        ceilings.update({(tag, t): c for t, c in cdict.items()})
        ws = widths if only else ([500] if quick else [500, 2000])
        variants = {"authors_gn": authors_gn_route, "structured": structured}
        if chunked:
            variants["chunked_dense"] = chunked_dense
        t1, f1 = _run(f"meanfield_gn_step_vs_authors_{tag}", variants,
                      [{"n": N, "d": D, "m": w} for w in ws], dtype, "authors_gn", 5)
        exercised.update(f1.attrs["exercised_code"])
        runs += f1.attrs["runs"]
        summaries.append(summarise(t1, "authors_gn", cdict))
        tables += [t1, summaries[-1]]
        if chunked and not only:
            t2, f2 = _run(f"meanfield_gn_step_vs_chunked_{tag}",
                          {"chunked_dense": chunked_dense, "structured": structured},
                          [{"n": N, "d": D, "m": w} for w in (2000, 5000)], dtype, "chunked_dense", 5)
            summaries.append(summarise(t2, "chunked_dense", cdict))
            tables += [t2, summaries[-1]]
    write_model_report(summaries, ceilings, exercised=exercised, runs=runs)
    if not only and not quick:
        tables.append(write_fault_profile())
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


def write_fault_profile(m: int = 500, calls: int = 3) -> pd.DataFrame:
    """:func:`fault_profile` at one thread, written to ``meanfield_gn_step_faults.{json,md}`` with provenance."""
    from harness import (code_hashes, cpu_mark, figure, load_average, load_flag, machine_text, others_cpu, runs_text,
                         trace_code, write_payload)

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before, t0, mark = load_average(), time.perf_counter(), cpu_mark()
        frame = fault_profile(m, calls=calls)
        after, others = load_average(), others_cpu(mark)
        s = problem(N, D, 50)
        exercised = set()
        for route in (authors_gn_route, chunked_dense, structured):
            exercised |= trace_code(lambda r=route: r(s))
    finally:
        torch.set_num_threads(previous)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    runs = [{"threads": 1, "load_before": before, "load_after": after, "others_cores": others,
             "wall_s": time.perf_counter() - t0, "cores_available": cores,
             "flagged": load_flag(before, after, 1, cores, others)}]
    machine = machine_info(config.device())
    figures = {}
    for r in frame.itertuples():
        figures[f"faults {r.route}"] = figure(r.minor_faults, f"{r.minor_faults:,.0f}")
        figures[f"system {r.route}"] = figure(r.system_s, f"{r.system_s:.2f} s")
        figures[f"user {r.route}"] = figure(r.user_s, f"{r.user_s:.2f} s")
        figures[f"wall {r.route}"] = figure(r.wall_s, f"{r.wall_s:.2f} s")
    md = [f"**Benchmark `meanfield_gn_step_faults`** — resource usage per call of each route (`resource.getrusage` "
          f"around {calls} calls after one warm call), n = {N}, d = {D}, m = {m}, float64, one thread.", "",
          f"Runs: {runs_text(runs)}.", "", f"Machine: {machine_text(machine)}.", "",
          "| route | wall (s) | user (s) | system (s) | minor page faults |", "|---|---:|---:|---:|---:|"]
    md += [f"| {r.route} | {r.wall_s:.3g} | {r.user_s:.3g} | {r.system_s:.3g} | {r.minor_faults:,.0f} |"
           for r in frame.itertuples()]
    write_payload("meanfield_gn_step_faults", {
        "machine": machine, "settings": {"n": N, "d": D, "m": m, "dtype": "float64", "calls": calls, "threads": 1},
        "runs": runs, "flagged": runs[0]["flagged"], "exercised_code": code_hashes(sorted(exercised)),
        "figures": figures, "rows": json.loads(frame.to_json(orient="records"))}, "\n".join(md) + "\n")
    return frame


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width 500 only, fewer repeats")
    parser.add_argument("--faults", action="store_true", help="only the page-fault profile of each route (m = 500)")
    parser.add_argument("--chunked", action="store_true", help="also the tables against the chunked route")
    parser.add_argument("--widths", default=None,
                        help="comma-separated widths: only the comparison with the authors' route there (e.g. 500,2000)")
    pd.set_option("display.width", 200)
    args = parser.parse_args()
    if args.faults:
        print(fault_profile().to_string(index=False, float_format="{:.4g}".format))
    else:
        widths = [int(w) for w in args.widths.split(",")] if args.widths else None
        for table in main(args.quick, widths, args.chunked):
            print(table.to_string(index=False, float_format="{:.4g}".format))
