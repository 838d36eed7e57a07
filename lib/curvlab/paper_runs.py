r"""Paper-scale runs: the registry of each chapter's grid, run outside the book build into the sweep cache.

A chapter in the ``paper`` profile does not run its largest grid inside the Sphinx build: ``make sweeps
PROFILE=paper`` (``tools/run_sweeps.py``) runs every registered grid into the :mod:`curvlab.sweep` cache, on
whatever the environment provides (a GPU, a Dask or Ray cluster: ``CURVLAB_SWEEP_BACKEND``), and the chapter
reads the tidy frame back with :func:`load`, which also returns the command that regenerates it::

    runs = paper_runs.load("ch21_regimes")          # the frame, its provenance and the command
    print(runs.command)                             # make sweeps PROFILE=paper ONLY=ch21_regimes

One :class:`PaperRun` per chapter grid: a pure cell function of one configuration (seeds are a batch inside a
cell, so a cell is one batched computation on the device), its configurations in each profile, a **cost model**
(floating-point operations of one cell, every run taken to its iteration cap, so an upper bound) and the external
data sets a full reproduction needs. :func:`estimate` turns the cost model into a table; ``book/paper_scale.md``
gives the measured times. The ``quick`` and ``standard`` grids are the same computations at reduced sizes (what
``make sweeps PROFILE=quick`` runs, and what the page's CPU times were measured on).

Each cell carries provenance (:func:`curvlab.sweep.cache_info`: configuration, code hash, git revision, torch,
device, host, thread counts, wall time). The cache key covers the code the cell reaches, derived from the source
(:func:`curvlab.sweep.code_reached`): the statements of this module the cell function names (its helpers, not the
other grids or the summary figures) and every ``curvlab`` module they import, transitively, so an edit to any
function a cell calls recomputes it while an edit to code it cannot reach does not throw away GPU-hours. A
committed frame (:func:`committed`) records the code hash it was made with; :func:`section` says when that is
not this build's.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import torch

from . import config, sweep as _sweep

__all__ = ["PaperRun", "Loaded", "Section", "Committed", "REGISTRY", "names", "get", "load", "run", "section",
           "estimate", "command", "export", "committed", "GPU_FLOPS_PER_S"]

_PROFILES = ("quick", "standard", "paper")
#: The folder of committed frames, package data of ``curvlab`` (so a ``pip install`` of the library, in Colab too,
#: carries them), written from the sweep cache by ``tools/run_sweeps.py --export``.
FRAMES_DIR = Path(__file__).resolve().parent / "paper_frames"
#: The sustained rate that turns a grid's flop upper bound into *estimated* device-hours when no paper-profile
#: frame is committed, 1e13 flop/s (about a third of an H100/H200's float64 peak; an assumption, printed as such).
GPU_FLOPS_PER_S = 1e13


# =============================================================================================== the registry
@dataclass(frozen=True)
class PaperRun:
    """One chapter's grid: ``fn(**config)`` over ``grids[profile]()``, with a cost model and its data sets.

    ``modules`` names the ``curvlab`` modules the grid is known to use. It is documentation and a check
    (tests/test_sweep_cache.py: the modules derived from the code cover it), not the cache key: the key covers
    whatever the cell reaches (:func:`curvlab.sweep.code_reached`)."""

    name: str
    chapter: str
    title: str
    fn: Callable[..., Any]
    grids: Mapping[str, Callable[[], list[dict[str, Any]]]]
    flops: Callable[..., float]
    modules: tuple[str, ...]
    data: tuple[str, ...] = ()
    note: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    summary: Callable[[pd.DataFrame], tuple[Any, str, str]] | None = None
    in_book: bool = False

    def configs(self, profile: str | None = None) -> list[dict[str, Any]]:
        """The grid of ``profile`` (default: ``$CURVLAB_PROFILE``)."""
        prof = config.profile() if profile is None else profile
        if prof not in _PROFILES:
            raise ValueError(f"profile must be one of {_PROFILES}, got {prof!r}")
        return self.grids[prof]()

    def cache_name(self, profile: str | None = None) -> str:
        return f"paper_runs.{self.name}"

    def command(self, profile: str = "paper") -> str:
        return command(self.name, profile)


class Loaded(NamedTuple):
    """What :func:`load` returns: the tidy ``frame``, each cell's ``provenance`` and the regenerating ``command``."""

    frame: pd.DataFrame
    provenance: pd.DataFrame
    command: str


def _device() -> torch.device:
    return config.device()


# ------------------------------------------------------------- chapter 11: linear representations (Figure 1)
#: Chapter 11's configuration (notebooks/configs/linrep_fig1.yml), copied here so that the registry does not depend
#: on the notebooks folder (a pip-installed curvlab has none); tests/test_sweep.py checks it equals the file.
CH11_CONFIG: dict[str, Any] = {
    "problem": {"kappa_x": 100, "kappa_F": 3, "x_dist": "rademacher", "noise": 0.1, "transfer_kappa": 100,
                "seed": 0, "tune_seed": 1000, "iso_kappa_x": 1},
    "sizes": {"quick": {"d": 30, "k": 3, "d_y": 8, "n": 150, "steps": 80, "seeds": 4, "tune_seeds": 2,
                        "tune_steps": 20, "record_every": 5},
              "standard": {"d": 60, "k": 6, "d_y": 16, "n": 300, "steps": 300, "seeds": 6, "tune_seeds": 3,
                           "tune_steps": 300, "record_every": 10},
              "paper": {"d": 100, "k": 8, "d_y": 20, "n": 500, "steps": 600, "seeds": 8, "tune_seeds": 4,
                        "tune_steps": 600, "record_every": 10}},
    "methods": {"AMGD": {"eta_G": 0.5, "normalize_step": True},
                "K-FAC": {"eta_G": 0.5, "lam_G": 1.0e-3, "lam_F": 0.0},
                "DFW": {"eta_G": 0.5, "lam_G": 1.0e-3, "normalize_step": True},
                "whitening+AMGD": {"eta_G": 0.5, "normalize_step": True, "stats": "running"},
                "batchnorm+AMGD": {"eta_G": 0.5, "normalize_step": True, "stats": "running"}},
    "grids": {"NGD": {"eta_G": [0.0625, 0.125, 0.25, 0.5, 1.0], "lam_GN": [1.0e-6, 1.0e-4, 1.0e-2, 1.0, 100.0]},
              "Adam": {"eta_G": [1.0e-3, 3.0e-3, 1.0e-2, 3.0e-2, 1.0e-1, 3.0e-1, 1.0]},
              "Shampoo": {"eta_G": [3.0e-2, 1.0e-1, 3.0e-1, 1.0, 3.0, 10.0, 30.0]}},
    "speed": {"metric": "subspace_distance", "level": 0.1},
}
_CH11_METHODS = ("AMGD", "K-FAC", "DFW", "NGD", "Adam", "Shampoo", "whitening+AMGD", "batchnorm+AMGD")


def ch11_linrep_fig1(method: str, hp: str | None, grid: str | None, d: int, k: int, d_y: int, kappa_x: float,
                     kappa_F: float, x_dist: str, noise: float, transfer_kappa: float, iso_kappa_x: float,
                     problem_seed: int, tune_seed: int, n: int, steps: int, seeds: int, tune_seeds: int,
                     tune_steps: int, record_every: int, speed_level: float = 0.1) -> pd.DataFrame:
    """Chapter 11's Figure 1 for one method: its fixed setting ``hp``, or the best of ``grid`` (both JSON text) by
    each of the chapter's two rules, on the tuning problem (its first ``tune_seeds`` seeds, ``tune_steps`` steps,
    generator seed 1; one set of grid runs, :func:`curvlab.linrep_baselines.grid_runs`): the *tail* rule (mean
    log10 tail transfer loss, a floor) and the *speed* rule (mean excess log-distance area above ``speed_level``,
    :func:`curvlab.linrep_baselines.speed_score`). Then ``steps`` steps on the reported problem (anisotropic) and
    on the isotropic control (Sigma = I) with each chosen setting, all ``seeds`` in one batch, generator seed 2: the
    traces every ``record_every``. Column ``rule``: ``fixed``, ``tail`` or ``speed``."""
    from dataclasses import fields, replace

    from . import checks, linrep
    from . import linrep_baselines as baselines

    dev = _device()
    hp, grid = (None if v is None else json.loads(v) for v in (hp, grid))

    def make(draw: int, kx: float) -> Any:
        return linrep.linrep_problem(seeds, d=d, k=k, d_y=d_y, kappa_x=kx, kappa_F=kappa_F, x_dist=x_dist,
                                     noise=noise, transfer_kappa=transfer_kappa, seed=draw, device=dev)

    chosen = {"fixed": (hp, float("nan"), [])}
    if grid is not None:                         # tuned, exactly as the chapter: the first seeds of the same draw
        tuning = make(tune_seed, kappa_x)
        tuning = replace(tuning, **{f.name: getattr(tuning, f.name)[:tune_seeds] for f in fields(tuning)
                                    if torch.is_tensor(getattr(tuning, f.name))})
        runs = baselines.grid_runs(method, tuning, tune_steps, n, {}, grid, record_every=record_every, seed=1)
        chosen = {}
        for rule in ("tail", "speed"):
            cells = baselines.score_runs(runs, tune_seeds, rule, level=speed_level)
            best, score = min(((h, float(s.mean())) for h, s in cells), key=lambda hs: hs[1])
            chosen[rule] = (best, score, [key for key, vals in grid.items() if checks.at_grid_edge(vals, best[key])])
    frames, done = [], {}
    for rule, (h, score, edge) in chosen.items():
        for name, kx in (("anisotropic", kappa_x), ("isotropic", iso_kappa_x)):
            key = (json.dumps(h, sort_keys=True), name)
            if key not in done:                  # the two rules chose the same value: one run serves both
                out = baselines.run_method(method, make(problem_seed, kx), steps, n, h, record_every=record_every,
                                           generator=torch.Generator().manual_seed(2))
                S, T = out["subspace_distance"].shape
                done[key] = pd.DataFrame({
                    "problem": name, "seed": [s for s in range(S) for _ in range(T)],
                    "step": out["step"].reshape(-1).cpu().numpy(),
                    **{m: out[m].detach().double().reshape(-1).cpu().numpy()
                       for m in ("subspace_distance", "train_loss", "transfer_loss")}})
            frames.append(done[key].assign(rule=rule, hp_used=key[0], tuned=grid is not None, tune_score=score,
                                           tuned_at_edge=",".join(edge)))
    return pd.concat(frames, ignore_index=True).assign(device=str(dev))


def _ch11_grid(profile: str) -> list[dict[str, Any]]:
    C = CH11_CONFIG
    base = {**{("problem_seed" if k == "seed" else k): v for k, v in C["problem"].items()}, **C["sizes"][profile],
            "speed_level": C["speed"]["level"]}
    js = lambda v: None if v is None else json.dumps(v, sort_keys=True)  # noqa: E731  (configs hold no dicts)
    cells = [{"method": m, "hp": js(C["methods"].get(m)), "grid": js(C["grids"].get(m))} for m in _CH11_METHODS]
    return [{**c, **base} for c in cells]


def _ch11_flops(method, grid, d, k, d_y, n, steps, seeds, tune_seeds, tune_steps, record_every, **_):
    """Per step and seed: the batch moments (2 n d^2), the method's d x d work (an eigen-decomposition, about
    9 d^3, for NGD, Shampoo and the normalised methods; a Cholesky solve, d^3, otherwise) and, every
    ``record_every`` steps, the three losses (about 6 d^3). Tuning: every grid cell on the tuning seeds, then the
    reported runs of both rules' choices (at most; one when they agree)."""
    heavy = method in ("NGD", "Shampoo", "whitening+AMGD", "batchnorm+AMGD")
    step = 2 * n * d * d + (9 if heavy else 1) * d ** 3 + 2 * d_y * k * d + 6 * d ** 3 / record_every
    cells = math.prod(len(v) for v in json.loads(grid).values()) if grid else 0
    return step * (2 * seeds * steps * (2 if grid else 1) + cells * tune_seeds * tune_steps)


# ---------------------------------------------------------------- chapter 12: the single-index giant step
#: The protocol of chapter 12 (notebooks/12_single_index_giant_step) - the link tanh(2 z), the six dampings of the
#: simulated points and 80 of the theory curves, the held-out grid of 11 dampings, the spike norms theta.
_CH12_LAMS = (1e-3, 1e-2, None, 1.0, 10.0, 100.0)   # None: the optimal damping lambda_G* of the chapter's setting
_CH12_THETAS = (0.5, 1.0, 2.0, 4.0, 8.0)


def ch12_single_index(kind: str, kappa: float, gamma: float, d: int, replicates: int, seed: int,
                      m: int | None = None, n_test: int | None = None) -> pd.DataFrame:
    """Chapter 12 at one anisotropy ``kappa``. ``kind="correlation"``: the cosine of the idealised spikes with
    beta* (SGD, and K-FAC at six dampings) on a two-level spectrum, per replicate, with the theory
    (:func:`curvlab.singleindex.kfac_cosine` on 80 dampings, :func:`~curvlab.singleindex.sgd_cosine`).
    ``kind="risk"``: one giant step of width ``m`` and a ridge head on a power-law spectrum
    (:func:`~curvlab.singleindex.giant_step_experiment`), K-FAC's damping the median choice of four pilot
    replicates on the held-out grid, every spike norm theta."""
    from . import singleindex as si

    dev = config.spectral_device(_device())
    gen = torch.Generator().manual_seed(seed)
    n = round(d / gamma)
    if kind == "correlation":
        s = si.spectrum("two-level", d, kappa) if kappa > 1 else si.spectrum("isotropic", d)
        b = si.beta_star(d, "flat", generator=gen)
        lm = si.link_moments("tanh2", float((b ** 2 * s).sum()))
        lm0 = si.link_moments("tanh2", 2.125)   # the chapter's lambda_G* = gamma sigma_eff^2 / c1^2 at gamma = 1/4
        lam_star = 0.25 * float(lm0.sigma_eff2 / lm0.c1 ** 2)
        lams = torch.tensor([lam_star if v is None else v for v in _CH12_LAMS], dtype=torch.float64)
        X, y = si.sample(s, b, "tanh2", n, replicates, generator=gen, device=dev)
        u, uk = si.ideal_spikes(X, y, lams)
        bd = b.to(dev)
        ck, cs = si.cosine(uk, bd[None]).cpu(), si.cosine(u, bd).cpu()              # (R, L), (R,)
        R = ck.shape[0]
        sim = [pd.DataFrame({"estimator": "K-FAC", "source": "simulation", "lam_G": float(lam),
                             "replicate": range(R), "cos": ck[:, j].numpy()}) for j, lam in enumerate(lams)]
        sim.append(pd.DataFrame({"estimator": "SGD", "source": "simulation", "lam_G": float("nan"),
                                 "replicate": range(R), "cos": cs.numpy()}))
        dense = torch.logspace(-3, 2, 80, dtype=torch.float64)
        th = si.kfac_cosine(dense, s, b ** 2, lm.c1, lm.sigma_eff2, gamma)
        sim.append(pd.DataFrame({"estimator": "K-FAC", "source": "theory", "lam_G": dense.numpy(),
                                 "replicate": -1, "cos": torch.as_tensor(th).double().cpu().numpy()}))
        sim.append(pd.DataFrame({"estimator": "SGD", "source": "theory", "lam_G": [float("nan")], "replicate": -1,
                                 "cos": [float(si.sgd_cosine(s, b ** 2, lm.c1, lm.Ey2, gamma))]}))
        return pd.concat(sim, ignore_index=True).assign(device=str(X.device))
    if kind != "risk":
        raise ValueError(f"kind must be 'correlation' or 'risk', got {kind!r}")
    s = si.spectrum("power-law", d, kappa) if kappa > 1 else si.spectrum("isotropic", d)
    b = si.beta_star(d, "flat", generator=gen)
    grid_G = torch.logspace(-3, 2, 11, dtype=torch.float64)
    pilot = [si.sample(s, b, "tanh2", n, 4, noise_std=0.1, generator=gen, device=dev) for _ in range(2)]
    lam_G = float(grid_G[si.select_lam_G(*pilot[0], *pilot[1], grid_G)[0].cpu()].median())
    f = si.giant_step_experiment(s, b, link="tanh2", n=n, m=m, replicates=replicates, lam_G=lam_G,
                                 spike_norms=list(_CH12_THETAS), noise_std=0.1, n_test=n_test, generator=gen,
                                 device=dev)
    return f.assign(lam_G=lam_G, rel_risk=f.test_risk / f.null_risk, device=str(dev))


def _ch12_grid(d_corr, R_corr, d_risk, R_risk, n_test, kappas_risk=(1.0, 10.0, 100.0, 1000.0)):
    corr = _sweep.grid(kind=["correlation"], kappa=[1.0, 16.0, 100.0], gamma=[0.25, 1.0, 2.0], d=[d_corr],
                       replicates=[R_corr], seed=[12])
    risk = _sweep.grid(kind=["risk"], kappa=list(kappas_risk), gamma=[0.25], d=[d_risk], replicates=[R_risk],
                       seed=[12], m=[d_risk], n_test=[n_test])
    return corr + risk


def _ch12_flops(kind, d, gamma, replicates, m=None, n_test=None, **_):
    n = round(d / gamma)
    if kind == "correlation":                  # X^T X, the eigen-decomposition with vectors, the six spikes
        return replicates * (n * d * d + 9 * d ** 3 + 12 * d * d)
    # per evaluation (RF + 2 methods x 5 norms): features of three batches, the ridge head's Gram and solve
    ev = 2 * (n + 2 * n_test) * m * d + 2 * n * m * m + m ** 3 / 3
    pilot = 8 * (n * d * d + 9 * d ** 3)
    return replicates * (11 * ev + 2 * (2 * n * m * d) + 2 * 9 * m * d * min(m, d)) + pilot


def _resnet_cell():
    from .resnet import pruned_resnet_cell

    return pruned_resnet_cell


def _resnet_flops(*args: Any, **kw: Any) -> float:
    from .resnet import pruned_resnet_flops

    return pruned_resnet_flops(*args, **kw)


# ----------------------------------------------------------------------------------- chapter 20: GN flows
def ch20_gn_flows(act: str, n: int, m: int, init_std: float, damping: str, floor: float, seeds: list,
                  eta: float, max_steps: int, rel_tol: float) -> pd.DataFrame:
    """GN on the mean-field network with constant or adaptive damping, every step recorded with its spectrum."""
    from . import meanfield as mf

    dev = _device()
    data = mf.teacher_student(seeds, act=act, n=n, n_test=10, device=dev)
    p0 = mf.init_student(m, 10, init_std=init_std, seeds=seeds, device=dev)
    rule = mf.Damping.adaptive(floor) if damping == "adaptive" else mf.Damping.constant(floor)
    run = mf.train(p0, data, method="GN", lr=eta * n, damping=rule, max_steps=max_steps, rel_tol=rel_tol,
                   record_every=1, spectrum=True, metrics=False)
    return run.history.drop(columns=["eta"]).assign(device=str(dev))  # eta: a configuration key


def _gn_step_flops(n: int, m: int, d: int, d_y: int = 1) -> float:
    """One kernel-form GN step (meanfield): Gram products 4 N^2 m (N = n d_y), features and J^T z, eigh 9 N^3."""
    N = n * d_y
    return 4 * N * N * m + 6 * n * m * d + 9 * N ** 3 + N ** 3 / 3


def _gd_step_flops(n: int, m: int, d: int, d_y: int = 1) -> float:
    return 6 * n * m * (d + d_y)


def _ch20_grid(n, m, seeds, steps, floor_steps):
    base = {"act": "silu", "n": n, "m": m, "seeds": list(range(seeds)), "eta": 0.02, "rel_tol": 1e-8}
    flows = [{"init_std": 1.0, "damping": dmp, "floor": fl, "max_steps": steps}
             for dmp, fl in (("adaptive", 1e-7), ("constant", 1e-9))]
    floors = [{"init_std": s, "damping": "adaptive", "floor": fl, "max_steps": floor_steps}
              for s in (0.01, 0.1, 1.0) for fl in (1e-7, 1e-10)]
    unique = {json.dumps(c, sort_keys=True): c for c in flows + floors}  # quick: a flow run is also a floor run
    return [{**base, **c} for c in unique.values()]


def _ch20_flops(n, m, seeds, max_steps, **_):
    return len(seeds) * max_steps * _gn_step_flops(n, m, 10)


# -------------------------------------------------------------------------- chapter 21: hidden learning
def ch21_regimes(act: str, init_std: float, method: str, lr: float | None, n: int, m: int, n_test: int,
                 seeds: list, max_steps: int, rel_tol: float) -> pd.DataFrame:
    """GN or GD at step ``lr`` (or random features) from sigma_0 = ``init_std``: the last row of each seed."""
    from . import meanfield as mf

    dev = _device()
    data = mf.teacher_student(seeds, act=act, n=n, n_test=n_test, device=dev)
    p0 = mf.init_student(m, 10, init_std=init_std, seeds=seeds, device=dev)
    if method == "RF":
        rf = mf.random_features(p0, data.X, data.Y, act)
        return pd.DataFrame({"seed": range(len(seeds)), "status": "exact",
                             "test_loss": mf.loss(rf, data.X_test, data.Y_test, act).cpu().numpy(),
                             "wcd": mf.wcd(rf.W, data.teacher.W).cpu().numpy(), "device": str(dev)})
    run = mf.train(p0, data, method=method, lr=lr, max_steps=max_steps, rel_tol=rel_tol, n_records=15)
    last = run.history.groupby("seed").tail(1).reset_index(drop=True)
    return last.drop(columns=["method", "lr"], errors="ignore").assign(device=str(dev))


def _ch21_grid(n, m, n_test, seeds, cap_gn, cap_gd, stds, lrs):
    from . import meanfield as mf

    G = mf.GRIDS["teacher_student"]
    stds = G["init_std"] if stds is None else stds
    lrs = G["lr_paper"] if lrs is None else lrs
    methods = ([{"method": "GN", "lr": lr, "max_steps": cap_gn} for lr in lrs]
               + [{"method": "GD", "lr": lr, "max_steps": cap_gd} for lr in lrs]
               + [{"method": "RF", "lr": None, "max_steps": 0}])
    return _sweep.grid(methods, act=list(G["activations"]), init_std=list(stds), n=[n], m=[m], n_test=[n_test],
                       seeds=[list(range(seeds))], rel_tol=[G["rel_tol"]])


def _ch21_flops(method, n, m, seeds, max_steps, **_):
    S = len(seeds)
    if method == "RF":
        return S * (2 * n * m * m + m ** 3)
    step = _gn_step_flops(n, m, 10) if method == "GN" else _gd_step_flops(n, m, 10)
    return S * max_steps * step


# ------------------------------------------------------------------------------- chapter 22: real data
def ch22_real_data(dataset: str, method: str, lr: float, n: int, m: int, n_test: int, seeds: list,
                   init_std: float, max_steps: int, loss_stop: float) -> pd.DataFrame:
    """The review's MNIST protocol (one hidden layer, squared loss on 10 logits, init std 1e-3, a cap or train loss
    below ``loss_stop``) on scikit-learn's digits or on MNIST (IDX files under ``$CURVLAB_MNIST_DIR``)."""
    from . import meanfield as mf

    dev = _device()
    if dataset == "mnist":
        data = mf.mnist_data(seeds, n=n, n_test=n_test, act="silu", device=dev)
    else:
        data = mf.load_digits_data(seeds, n=n, n_test=n_test, act="silu", device=dev)
    p0 = mf.init_student(m, data.X.shape[-1], init_std=init_std, seeds=seeds, d_y=10, device=dev)
    run = mf.train(p0, data, method=method, lr=lr, max_steps=max_steps, rel_tol=0.0, loss_stop=loss_stop,
                   n_records=10)
    last = run.history.groupby("seed").tail(1).reset_index(drop=True)
    return last.drop(columns=["method", "lr"], errors="ignore").assign(device=str(dev))


def _ch22_grid(datasets, n, m, n_test, seeds, cap):
    from . import meanfield as mf

    D = mf.GRIDS["digits"]
    return _sweep.grid(dataset=list(datasets), method=["GN", "GD"], lr=list(D["lr_paper"]), n=[n], m=[m],
                       n_test=[n_test], seeds=[list(range(seeds))], init_std=[D["init_std"]], max_steps=[cap],
                       loss_stop=[D["train_loss_stop"]])


def _ch22_flops(dataset, method, n, m, seeds, max_steps, **_):
    d = 784 if dataset == "mnist" else 61
    step = _gn_step_flops(n, m, d, 10) if method == "GN" else _gd_step_flops(n, m, d, 10)
    return len(seeds) * max_steps * step


# ------------------------------------------------------------------- chapters 30-32: GN conditioning
def ch30_mp_limit(scale: int, R: int, seed: int) -> pd.DataFrame:
    """kappa(GN) of f = VWx, (d, d_y, m) = (16, 4, 32) * scale, R networks: the Marchenko-Pastur extrapolation."""
    from . import deep_linear as dl

    gen = torch.Generator().manual_seed(seed)
    W, V = dl.init_weights(16 * scale, [32 * scale], 4 * scale, batch=(R,), generator=gen)
    sV, sW = torch.linalg.svdvals(V) ** 2, torch.linalg.svdvals(W) ** 2
    kappa = (sV[:, 0] + sW[:, 0]) / (sV[:, -1] + sW[:, -1])
    return pd.DataFrame({"m": 32 * scale, "net": range(R), "kappa": kappa.numpy(),
                         "mp_limit": dl.mp_kappa_two_layer(16, 4, 32), "device": str(kappa.device)})


def ch31_depth_law(depths: list, R: int, seed: int) -> pd.DataFrame:
    """log kappa(GN) of nested deep linear networks (d = 4, m = 8, d_y = 2) against depth, by the SVD route."""
    from . import deep_linear as dl

    gen = torch.Generator().manual_seed(seed)
    nets = dl.nested_networks(4, 8, 2, depths, batch=(R,), generator=gen)
    rows = []
    for L in depths:
        k = dl.gn_condition(nets[L], method="svd").kappa
        rows += [{"L": L, "net": i, "log_kappa": float(v)} for i, v in enumerate(k.log())]
    return pd.DataFrame(rows).assign(xi=dl.depth_slope(8, 4, 2), device=str(nets[depths[0]][0].device))


def ch32_leaky(m: int, R: int, n_images: int, seed: int) -> pd.DataFrame:
    """kappa of the leaky-ReLU GN Gram matrix on digits, with the chapter's bound, over slopes alpha."""
    from . import deep_linear as dl

    gen = torch.Generator().manual_seed(seed)
    X = dl.digits(n_images, seed=2)[0]
    rows = []
    for net in range(R):
        W, V = dl.init_weights(X.shape[1], [m], 10, scheme="kaiming", generator=gen)
        for a in (0.01, 0.03, 0.1, 0.3, 1.0):
            c = dl.condition(torch.linalg.eigvalsh(dl.leaky_relu_gram(W, V, X, a)))
            rows.append({"net": net, "alpha": a, "kappa": float(c.kappa), "rank": c.rank,
                         "bound": float(dl.leaky_relu_bound(W, V, X, a))})
    return pd.DataFrame(rows).assign(device=str(X.device))


def _ch30_flops(scale, R, **_):
    d, m = 16 * scale, 32 * scale
    return R * 2 * 4 * (m * d * d + m * (4 * scale) ** 2)  # two thin SVDs (about 4 m k^2 each)


def _ch31_flops(depths, R, **_):
    return R * sum(L * 8 ** 2 * 6 + (8 * L) ** 2 * 8 * 4 for L in depths)  # QR products + SVD of the factor


def _ch32_flops(m, R, n_images, **_):
    N = 10 * n_images
    return R * 5 * (N * N * m * 2 + 9 * N ** 3)



# --------------------------------------------------------------------------------------- chapter summaries
# One figure per grid, drawn from the tidy frame alone (so a chapter in the paper profile shows what `make sweeps`
# computed without re-running anything). Each returns (figure, alt text, caption).
def _shades(n: int):
    import matplotlib.pyplot as plt

    return [plt.get_cmap("viridis")(x) for x in ([0.5] if n == 1 else [0.1 + 0.75 * i / (n - 1) for i in range(n)])]


def _sizes(f: pd.DataFrame, *keys: str) -> str:
    return ", ".join(f"{k} = {sorted(set(f[k]))[0] if f[k].nunique() == 1 else sorted(set(f[k]))}" for k in keys)


def _median_band(ax, f: pd.DataFrame, x: str, y: str, label: str) -> pd.DataFrame:
    """Median of ``y`` per ``x`` as a line and its min-max range as a band (the networks of Part III's grids)."""
    from . import plotting

    st = f.groupby(x)[y].agg(["median", "min", "max"])
    plotting.band(ax, st.index, st["min"], st["max"], "kappa")
    plotting.plot(ax, st.index, st["median"], "kappa", markevery=1, label=label)
    return st


def _panels(f: pd.DataFrame, column: str, width: float, **kw):
    """One panel per value of ``column``, in a row: ``(fig, axes, [(ax, value), ...])``."""
    import matplotlib.pyplot as plt

    values = sorted(set(f[column]))
    fig, axes = plt.subplots(1, len(values), figsize=(width * len(values), 3.5), squeeze=False, **kw)
    return fig, axes, list(zip(axes[0], values))


def _summary_ch20(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    groups = list(f.groupby(["damping", "floor", "init_std"]))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for color, ((dmp, fl, sd), g) in zip(_shades(len(groups)), groups):
        med = g[g.step > 0].groupby("fs_time").train_loss.median()
        plotting.plot(ax, med.index, med.to_numpy(), "GN", color=color, markevery=max(1, len(med) // 8),
                      label=f"{dmp} {fl:g}, sigma_0 = {sd:g}")
    ax.set(xscale="log", yscale="log", xlabel="function-space time $t_f$", ylabel="training loss (median)")
    ax.legend(fontsize="x-small", ncol=2)
    return (fig, "Training loss against function-space time on log axes, one line per damping rule and initial "
                 "scale of the registered GN-flow grid.",
            f"GN flows of the registered grid ({_sizes(f, 'n', 'm')}; median over seeds): the damping rule "
            "and floor against the initial scale sigma_0.")


def _summary_ch21(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    fig, axes, panels = _panels(f, "act", 4.4, sharey=True)
    for ax, a in panels:
        for meth in ("GN", "GD", "RF"):
            g = f[(f.act == a) & (f.method == meth) & (f.status != "diverged")]
            if meth != "RF" and len(g):                  # every seed of the best step size per sigma_0 (by median)
                best = g.groupby(["init_std", "lr"]).test_loss.median().groupby(level="init_std").idxmin()
                g = g.set_index(["init_std", "lr"]).loc[list(best)].reset_index()
            st = g.groupby("init_std").test_loss.agg(["median", "min", "max"])
            if len(st):
                plotting.plot(ax, st.index, st["median"], meth)
                plotting.band(ax, st.index, st["min"], st["max"], meth)
        ax.set(xscale="log", yscale="log", xlabel=r"$\sigma_0$", title=a)
    axes[0, 0].set_ylabel("test loss at the stop")
    axes[0, 0].legend(fontsize="small")
    return (fig, "Test loss against the initial scale on log axes for GN, GD (best step size) and random "
                 "features, one panel per activation.",
            f"Hidden learning at the registered grid's sizes ({_sizes(f, 'n', 'm')}): GN and GD at their best "
            "step size per sigma_0 (diverged runs dropped), and random features; bands over seeds.")


def _summary_ch22(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    fig, axes, panels = _panels(f, "dataset", 4.6)
    for ax, ds in panels:
        for meth in ("GN", "GD"):
            g = f[(f.dataset == ds) & (f.method == meth) & (f.status != "diverged")]
            for col, ls in (("train_loss", ":"), ("test_loss", "-")):
                st = g.groupby("lr")[col].median()
                if len(st):
                    plotting.plot(ax, st.index, st.to_numpy(), meth, linestyle=ls,
                                  label=f"{meth}, {col.replace('_', ' ')}")
        ax.set(xscale="log", yscale="log", xlabel="learning rate", title=ds)
    axes[0, 0].set_ylabel("loss at the stop (median)")
    axes[0, 0].legend(fontsize="x-small")
    return (fig, "Training and test loss against the learning rate on log axes for GN and GD, one panel per "
                 "data set.",
            f"The review's table as a figure ({_sizes(f, 'n', 'm')}): final training (dotted) and test (solid) "
            "loss against the step size; diverged runs dropped.")


def _summary_ch30(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    fig, ax = plt.subplots(figsize=(5.2, 3.5))
    _median_band(ax, f, "m", "kappa", r"$\kappa(H_{GN})$, median")
    ax.axhline(float(f.mp_limit.iloc[0]), **{**plotting.style("MP").kwargs(), "label": "Marchenko-Pastur limit"})
    ax.set(xscale="log", xlabel="hidden width m  (d = m/2, d_y = m/8)", ylabel=r"$\kappa(H_{GN})$")
    ax.legend(fontsize="small")
    return (fig, "Condition number against width on a log axis, median line with range band, and a "
                 "horizontal line at the Marchenko-Pastur limit.",
            f"kappa(GN) of two-layer linear networks with all sizes scaled together ({f.R.iloc[0]} networks per "
            "size): median and range against the Marchenko-Pastur limit of chapter 30 (horizontal line).")


def _summary_ch31(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    fig, ax = plt.subplots(figsize=(5.2, 3.5))
    st = _median_band(ax, f, "L", "log_kappa", r"$\log\kappa$, median")
    xi, L0 = float(f.xi.iloc[0]), float(st.index[0])   # xi: the growth of log kappa per layer (depth_slope)
    plotting.plot(ax, st.index, st["median"].iloc[0] + xi * (st.index - L0), "theory",
                  label=r"slope $\xi$ (Lyapunov)")
    ax.set(xlabel="depth L  (d = 4, m = 8, d_y = 2)", ylabel=r"$\log\kappa(H_{GN})$")
    ax.legend(fontsize="small")
    return (fig, "Log condition number against depth, a median line with a range band over networks, next "
                 "to a theory line of the predicted slope.",
            f"The depth law at the registered grid's depths ({f.R.iloc[0]} networks): log kappa against depth; "
            "the theory line has the slope of chapter 31's Lyapunov prediction, drawn from the "
            "first depth.")


def _summary_ch32(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    ms = sorted(set(f.m))
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for color, m in zip(_shades(len(ms)), ms):
        g = f[f.m == m].groupby("alpha")[["kappa", "bound"]].median()
        plotting.plot(ax, g.index, g.kappa, "leaky-ReLU", color=color, markevery=1, linestyle="-", label=f"m = {m}")
        finite = g.bound[g.bound < float("inf")]
        if len(finite):
            plotting.plot(ax, finite.index, finite.to_numpy(), "bound", color=color, markevery=1, label=None)
    ax.set(xscale="log", yscale="log", xlabel=r"slope $\alpha$", ylabel=r"$\kappa$ (solid), bound (dashed)")
    ax.legend(fontsize="x-small", ncol=2)
    return (fig, "Condition number against the leaky-ReLU slope on log axes, one line per width, with dashed "
                 "bound lines where the bound is finite.",
            "kappa of the leaky-ReLU GN matrix on digits against the slope alpha, one line per width (median "
            "over networks); dashed: the chapter's bound where it is finite.")


def _summary_ch32_pruned(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    fig, (a, b) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    first, last = f[f.step == 0], f[f.step == f.groupby(["rate", "seed"]).step.transform("max")]
    for frame, method, label in ((first, "kappa", "at initialisation"), (last, "GN", "after training")):
        st = frame.groupby("rate")["kappa"].agg(["median", "min", "max"])
        plotting.band(a, 100 * st.index, st["min"], st["max"], method)
        plotting.plot(a, 100 * st.index, st["median"], method, markevery=1, label=label)
    a.set(yscale="log", xlabel="pruned weights (%)", ylabel=r"$\kappa(\mathrm{GN})$, nonzero spectrum")
    a.legend(fontsize="x-small")
    rates = sorted(set(f.rate))
    for color, rate in zip(_shades(len(rates)), rates):
        g = f[f.rate == rate].copy()
        g["rel"] = g.loss / g.groupby("seed").loss.transform("first")
        med = g.groupby("step").rel.median()
        plotting.plot(b, med.index, med.to_numpy(), "GD", color=color, markevery=1, label=f"{100 * rate:.0f} %")
    b.set(yscale="log", xlabel="gradient-descent step", ylabel="training loss / initial loss")
    b.legend(fontsize="x-small", title="pruned", title_fontsize="x-small")
    n, width = (int(f[c].iloc[0]) if c in f else "?" for c in ("n", "width"))
    data = f["dataset"].iloc[0] if "dataset" in f else "?"
    return (fig, "Left: condition number against the pruning rate, at initialisation and after training, median "
                 "line with min-max band on a log axis. Right: median relative training loss against the step, one "
                 "line per pruning rate.",
            f"ResNet-20 (base width {width}) pruned layer-wise by magnitude at initialisation, {n} images of "
            f"{data}: left, kappa(GN) over the nonzero spectrum at initialisation and after full-batch gradient "
            "descent (median over seeds, band min to max); right, the median training loss relative to its "
            "initial value, one line per pruning rate.")


def _hp_text(v: Any) -> str:
    hp = json.loads(v) if isinstance(v, str) else dict(v)
    return ", ".join(f"{k} = {hp[k]:g}" for k in sorted(hp) if isinstance(hp[k], (int, float))
                     and not isinstance(hp[k], bool))


def _summary_ch11(f: pd.DataFrame):
    import matplotlib.pyplot as plt

    from . import plotting

    speed = f[f.rule == "speed"] if "rule" in f else f.iloc[:0]
    f = f[f.rule != "speed"] if "rule" in f else f          # the figure: fixed settings and the tail rule's choices
    probs = [p for p in ("anisotropic", "isotropic") if p in set(f.problem)]
    fig, axes = plt.subplots(1, len(probs), figsize=(5.4 * len(probs), 3.8), sharey=True, squeeze=False)
    methods = [m for m in _CH11_METHODS if m in set(f.method)] + sorted(set(f.method) - set(_CH11_METHODS))
    for ax, prob in zip(axes[0], probs):
        for m in methods:
            st = f[(f.problem == prob) & (f.method == m)].groupby("step").subspace_distance.agg(
                ["median", "min", "max"])
            if len(st):
                plotting.band(ax, st.index, st["min"], st["max"], m)
                plotting.plot(ax, st.index, st["median"], m, markevery=max(1, len(st) // 8))
        ax.set(yscale="log", xlabel="iteration t", title=prob)
    axes[0, 0].set_ylabel(r"$\mathrm{dist}(G_t, G_\star)$")
    axes[0, -1].legend(fontsize="x-small", ncol=2)
    tuned = f[f.tuned.astype(bool)].groupby("method").first() if "tuned" in f else pd.DataFrame()
    chosen = "; ".join(f"{m}: {_hp_text(row.hp_used)}" + (f" (grid edge: {row.tuned_at_edge})"
                                                           if isinstance(row.tuned_at_edge, str)
                                                           and row.tuned_at_edge else "")
                       for m, row in tuned.iterrows())
    fast = "; ".join(f"{m}: {_hp_text(row.hp_used)}" + (f" (grid edge: {row.tuned_at_edge})"
                                                        if isinstance(row.tuned_at_edge, str)
                                                        and row.tuned_at_edge else "")
                     for m, row in speed.groupby("method").first().iterrows())
    return (fig, "Subspace distance against iteration on a log axis for the eight methods of Figure 1, median "
                 "line and min-max band over seeds, for anisotropic inputs and the isotropic control.",
            f"Figure 1 of chapter 11 at the registered grid's sizes ({_sizes(f, 'd', 'k', 'd_y', 'n')}, "
            f"{f.seed.nunique()} seeds): median and range over seeds of the subspace distance, anisotropic "
            "inputs and the isotropic control (same hyper-parameters). Tuned on the tuning problem at these "
            f"sizes by the chapter's tail (floor) rule: {chosen or 'none'}"
            + (f"; by its speed rule (runs in the frame, not drawn): {fast}." if fast else "."))


def _summary_ch12(f: pd.DataFrame):
    import matplotlib.pyplot as plt
    import numpy as np

    from . import plotting

    corr = f[f.kind == "correlation"] if "kind" in f else f.iloc[:0]
    risk = f[f.kind == "risk"] if "kind" in f else f.iloc[:0]
    kaps = sorted(set(corr.kappa))
    fig, axes = plt.subplots(1, len(kaps) + (len(risk) > 0), figsize=(3.9 * (len(kaps) + (len(risk) > 0)), 3.6),
                             squeeze=False)
    gams = sorted(set(corr.gamma))
    shade = dict(zip(gams, [1.0, 0.65, 0.35, 0.2][: len(gams)]))
    for ax, kap in zip(axes[0], kaps):
        for g in gams:
            c = corr[(corr.kappa == kap) & (corr.gamma == g)]
            th = c[(c.source == "theory") & (c.estimator == "K-FAC")].sort_values("lam_G")
            plotting.plot(ax, th.lam_G, th.cos, "K-FAC", marker="", alpha=shade[g],
                          label=fr"K-FAC theory, $\gamma={g:g}$")
            sim = c[(c.source == "simulation") & (c.estimator == "K-FAC")].groupby("lam_G").cos
            mu, se = sim.mean(), sim.std() / np.sqrt(sim.count())
            plotting.band(ax, mu.index, mu - 2 * se, mu + 2 * se, "K-FAC")
            ax.plot(mu.index, mu.to_numpy(), "s", color=plotting.style("K-FAC").color, alpha=shade[g])
            sgd = c[(c.source == "theory") & (c.estimator == "SGD")].cos
            if len(sgd):
                plotting.plot(ax, [th.lam_G.min(), th.lam_G.max()], [float(sgd.iloc[0])] * 2, "SGD", marker="",
                              alpha=shade[g], linestyle=":", label=fr"SGD, $\gamma={g:g}$")
        ax.set(xscale="log", xlabel=r"damping $\lambda_G$", title=fr"$\kappa(\Sigma)={kap:g}$")
    if kaps:
        axes[0, 0].set_ylabel(r"$\cos(u,\beta_\star)$")
        axes[0, 0].legend(fontsize=6, ncol=2)
    if len(risk):
        ax = axes[0, -1]
        best = risk.loc[risk.groupby(["kappa", "method", "replicate"]).val_risk.idxmin()]
        for meth in ("SGD", "K-FAC", "RF"):
            t = best[best.method == meth].groupby("kappa").rel_risk
            mu, se = t.mean(), t.sem()
            plotting.plot(ax, mu.index, mu.to_numpy(), meth, markevery=1)
            plotting.band(ax, mu.index, (mu - 2 * se).to_numpy(), (mu + 2 * se).to_numpy(), meth)
        ax.set(xscale="log", yscale="log", xlabel=r"$\kappa(\Sigma)$ (power law)", ylabel=r"test risk / $E y^2$",
               title=f"test risk, d = m = {int(risk.d.iloc[0])}")
        ax.legend(fontsize="x-small")
    return (fig, "Panels of the K-FAC spike's cosine with beta* against the damping on a log axis, one per "
                 "condition number, theory lines with simulated points and bands for three aspect ratios and "
                 "dotted SGD levels; a last panel of relative test risk against the condition number for SGD, "
                 "K-FAC and random features.",
            f"Chapter 12 at the registered grid's sizes: the correlation figure (two-level spectra, "
            f"d = {int(corr.d.iloc[0]) if len(corr) else '-'}, "
            f"{int(corr.replicates.iloc[0]) if len(corr) else 0} replicates; lines theory, squares simulation "
            "with two-SE bands, gamma = d/n dark to light) and the test risk after one giant step and a ridge "
            f"head (power-law spectra, gamma = 1/4, {int(risk.replicates.iloc[0]) if len(risk) else 0} "
            "replicates, each method's spike norm tuned on validation data; mean and two SE).")


# ------------------------------------------------------------------------------------------- the table
def _registry() -> dict[str, PaperRun]:
    runs = [
        PaperRun("ch11_linrep_fig1", "11_linrep_experiments",
                 "Figure 1: the eight methods on one linear-representation problem, anisotropic and isotropic, "
                 "NGD, Adam and Shampoo tuned at the profile's sizes by the tail (floor) rule and by the speed rule",
                 ch11_linrep_fig1,
                 {p: (lambda p=p: _ch11_grid(p)) for p in _PROFILES},
                 _ch11_flops, ("linrep", "linrep_baselines", "checks"),
                 note="one cell per method; a tuned method's cell runs its grid on the tuning problem at the same "
                      "sizes first and reports the best value by each of the chapter's two rules (tail, speed); K-FAC's stability sweep over NGD's grid is "
                      "not part of this grid",
                 summary=_summary_ch11),
        PaperRun("ch12_single_index", "12_single_index_giant_step",
                 "the correlation figure (cosine against damping, three anisotropies and aspect ratios) and the "
                 "test risk after one giant step",
                 ch12_single_index,
                 {"quick": lambda: _ch12_grid(80, 6, 40, 4, 400),
                  "standard": lambda: _ch12_grid(200, 16, 120, 8, 2000),
                  "paper": lambda: _ch12_grid(1000, 20, 800, 16, 2000)},
                 _ch12_flops, ("singleindex", "rmt"),
                 note="the digest's sizes: d = 1000 for the correlation figure (n = 4000, 1000, 500), "
                      "d = m = 800 and n = 3200 for the test risk",
                 summary=_summary_ch12),
        PaperRun("ch20_gn_flows", "20_meanfield_gn_flows",
                 "GN with adaptive and constant damping, and the damping-floor runs (sigma_0 x floor)",
                 ch20_gn_flows,
                 {"quick": lambda: _ch20_grid(64, 128, 2, 300, 300),
                  "standard": lambda: _ch20_grid(100, 400, 4, 1200, 3000),
                  "paper": lambda: _ch20_grid(500, 5000, 5, 1200, 3000)},
                 _ch20_flops, ("meanfield",),
                 note="every step records the spectrum of K (an n x n eigenvalue problem)", summary=_summary_ch20),
        PaperRun("ch21_regimes", "21_meanfield_hidden_learning",
                 "GN, GD (7 step sizes each) and random features over the 7 initial scales, ReLU and SiLU",
                 ch21_regimes,
                 {"quick": lambda: _ch21_grid(40, 80, 500, 2, 300, 300, (0.01, 1.0, 10.0), (1.0, 10.0)),
                  "standard": lambda: _ch21_grid(64, 128, 2000, 3, 800, 800, None, (0.1, 1.0, 10.0, 100.0)),
                  "paper": lambda: _ch21_grid(500, 5000, 10_000, 5, 150_000, 1_000_000, None, None)},
                 _ch21_flops, ("meanfield",),
                 note="caps are the paper's (150 000 GN, 10^6 GD iterations); most GN runs stop far earlier",
                 summary=_summary_ch21),
        PaperRun("ch22_real_data", "22_meanfield_real_data",
                 "the review's MNIST table: GN and GD at 7 step sizes, digits and MNIST",
                 ch22_real_data,
                 {"quick": lambda: _ch22_grid(("digits",), 30, 48, 500, 2, 60),
                  "standard": lambda: _ch22_grid(("digits",), 40, 64, 1000, 3, 150),
                  "paper": lambda: _ch22_grid(("digits", "mnist"), 1000, 2000, 10_000, 5, 100_000)},
                 _ch22_flops, ("meanfield",), data=("MNIST (IDX files, $CURVLAB_MNIST_DIR)",),
                 note="GN's kernel is (10 n) x (10 n): 10 000 x 10 000 at n = 1000", summary=_summary_ch22),
        PaperRun("ch30_mp_limit", "30_gn_conditioning_structure",
                 "kappa(GN) of two-layer linear networks towards the Marchenko-Pastur limit",
                 ch30_mp_limit,
                 {"quick": lambda: _sweep.grid(scale=[4, 8, 16], R=[32], seed=[0]),
                  "standard": lambda: _sweep.grid(scale=[4, 8, 12, 16, 24], R=[48], seed=[0]),
                  "paper": lambda: _sweep.grid(scale=[4, 8, 16, 32, 64], R=[96], seed=[0])},
                 _ch30_flops, ("deep_linear",), summary=_summary_ch30, in_book=True),
        PaperRun("ch31_depth_law", "31_gn_conditioning_factors",
                 "log kappa(GN) against depth of nested deep linear networks (the depth law)",
                 ch31_depth_law,
                 {"quick": lambda: _sweep.grid(depths=[list(range(32, 129, 16))], R=[32], seed=[0]),
                  "standard": lambda: _sweep.grid(depths=[list(range(32, 193, 16))], R=[96], seed=[0]),
                  "paper": lambda: _sweep.grid(depths=[list(range(32, 257, 8))], R=[256], seed=[0])},
                 _ch31_flops, ("deep_linear",), data=("CIFAR-10 (the paper's whitening experiment, width 3100)",),
                 note="the paper's CIFAR-10 networks are not reproduced by this grid (digits stand in)",
                 summary=_summary_ch31, in_book=True),
        PaperRun("ch32_leaky", "32_gn_conditioning_leaky_relu",
                 "kappa of the leaky-ReLU GN matrix on digits over width and slope, with the bound",
                 ch32_leaky,
                 {"quick": lambda: _sweep.grid(m=[8, 16, 64, 256], R=[3], n_images=[24], seed=[0]),
                  "standard": lambda: _sweep.grid(m=[8, 12, 16, 32, 64, 128, 256], R=[8], n_images=[24], seed=[0]),
                  "paper": lambda: _sweep.grid(m=[8, 12, 16, 32, 64, 128, 256, 512], R=[20], n_images=[24],
                                               seed=[0])},
                 _ch32_flops, ("deep_linear",), summary=_summary_ch32, in_book=True),
        PaperRun("ch32_pruned_resnet", "32_gn_conditioning_leaky_relu",
                 "ResNet-20 pruned layer-wise by magnitude at initialisation: kappa(GN) over the nonzero spectrum "
                 "(rank, gap) and the training loss, over pruning rates and seeds",
                 _resnet_cell(),
                 {"quick": lambda: _sweep.grid(rate=[0.0, 0.4, 0.8], n=[16], seeds=[[0, 1]], steps=[20], every=[10],
                                               width=[4], dataset=["digits"], lr=[1e-3]),
                  "standard": lambda: _sweep.grid(rate=[0.0, 0.2, 0.4, 0.6, 0.8], n=[32], seeds=[[0, 1, 2]],
                                                  steps=[60], every=[20], width=[8], dataset=["digits"], lr=[3e-4]),
                  "paper": lambda: _sweep.grid(rate=[0.0, 0.2, 0.4, 0.6, 0.8], n=[1000], seeds=[[0, 1, 2, 3, 4]],
                                               steps=[300], every=[25], width=[16], dataset=["cifar10"],
                                               lr=[3e-4])},
                 _resnet_flops, ("resnet", "conv", "curvature"),
                 data=("CIFAR-10 (python batches, $CURVLAB_CIFAR10_DIR)",),
                 note="the GN Gram is (10 n) x (10 n), 10 000 x 10 000 at n = 1000, built from per-sample Jacobians "
                      "in blocks (2 GiB); quick and standard run digits at 16 x 16 over three channels as a "
                      "stand-in", summary=_summary_ch32_pruned),
    ]
    return {r.name: r for r in runs}


#: Every registered paper-scale grid, by name (one per chapter grid).
REGISTRY: dict[str, PaperRun] = _registry()


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> PaperRun:
    if name not in REGISTRY:
        raise ValueError(f"name must be one of the registered paper runs {names()}, got {name!r}")
    return REGISTRY[name]


def command(name: str, profile: str = "paper") -> str:
    """The shell command that (re)generates ``name``'s cells in ``profile``, from the repository root."""
    get(name)
    return f"make sweeps PROFILE={profile} ONLY={name}"


def run(name: str, profile: str | None = None, *, backend: str | None = None, n_jobs: int | None = None,
        cache_dir: str | os.PathLike | None = None, progress: bool = True) -> pd.DataFrame:
    """Run (or complete) ``name``'s grid in ``profile`` into the sweep cache; return the tidy frame."""
    r = get(name)
    return _sweep.sweep(r.fn, r.configs(profile), cache_dir=cache_dir, n_jobs=n_jobs, backend=backend,
                        progress=progress, name=r.cache_name())


def load(name: str, profile: str | None = None, *, cache_dir: str | os.PathLike | None = None) -> Loaded:
    """Read ``name``'s frame in ``profile`` (default ``$CURVLAB_PROFILE``) from the cache, computing nothing.

    Raises :class:`curvlab.sweep.MissingCells` naming the command to run when cells are missing (never run by
    a book build: paper-scale grids are run by ``make sweeps``).
    """
    r = get(name)
    prof = config.profile() if profile is None else profile
    try:
        frame = _sweep.sweep(r.fn, r.configs(prof), cache_dir=cache_dir, progress=False, name=r.cache_name(),
                             compute=False)
    except _sweep.MissingCells as exc:
        raise _sweep.MissingCells(f"{exc}; run `{command(name, prof)}` first", exc.done, exc.missing) from None
    keys = {_sweep._config_json("config", c) for c in r.configs(prof)}
    code = _code_hash_of(r)
    info = _sweep.cache_info(cache_dir, r.cache_name())
    mine = info["config"].map(lambda s: _sweep._config_json("config", json.loads(s)) in keys) & (info["code_hash"] == code)
    return Loaded(frame, info[mine].reset_index(drop=True), command(name, prof))


class Committed(NamedTuple):
    """A committed frame (:func:`committed`): the tidy ``frame`` and its ``provenance`` (a dict: profile, cells,
    code hash, revisions, devices, torch, hosts, wall time, timestamps, the regenerating command)."""

    frame: pd.DataFrame
    provenance: dict


def _frame_paths(name: str, profile: str, folder: Path | None = None) -> tuple[Path, Path]:
    folder = FRAMES_DIR if folder is None else Path(folder)
    return folder / f"{name}.{profile}.csv", folder / f"{name}.{profile}.json"


def _code_hash_of(r: PaperRun) -> str:
    """The code hash in the keys of ``r``'s cells (:func:`curvlab.sweep.code_reached` lists what it covers)."""
    return _sweep._code_hash(r.fn, r.cache_name(), None)


def export(name: str, profile: str = "paper", *, cache_dir: str | os.PathLike | None = None,
           folder: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write ``name``'s complete frame in ``profile`` from the sweep cache to the committed frames
    (``<folder>/<name>.<profile>.csv`` and ``.json``, default :data:`FRAMES_DIR`), with its provenance.

    Raises :class:`curvlab.sweep.MissingCells` (naming the command) when the grid is not complete in the cache: a
    committed frame is always a whole grid. List-valued columns (a configuration's list of depths, say) are
    written as JSON text and read back as lists by :func:`committed`.
    """
    r = get(name)
    if profile not in _PROFILES:
        raise ValueError(f"profile must be one of {_PROFILES}, got {profile!r}")
    loaded = load(name, profile, cache_dir=cache_dir)
    frame = loaded.frame.drop(columns=[c for c in ("_cached",) if c in loaded.frame.columns]).copy()
    for col in frame.columns:
        if frame[col].map(lambda v: isinstance(v, (list, tuple, dict))).any():
            frame[col] = frame[col].map(lambda v: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v)
    # a column with one value in every row (a configuration's list of depths, say) is stored once, in the JSON
    constant = {c: frame[c].iloc[0] for c in frame.columns
                if len(frame) and frame[c].nunique(dropna=False) == 1 and not c.startswith("_")}
    constant = {c: (v.item() if hasattr(v, "item") else v) for c, v in constant.items()}
    frame = frame.drop(columns=list(constant))
    info = loaded.provenance
    text = lambda col: sorted({str(v) for v in info[col].dropna()}) if col in info else []  # noqa: E731
    prov = {
        "name": name, "chapter": r.chapter, "title": r.title, "profile": profile,
        "cells": int(len(info)), "rows": int(len(frame)), "code_hash": _code_hash_of(r),
        "config_keys": sorted(str(k) for k in info["key"]) if "key" in info else [],
        "revisions": text("revision"), "devices": text("device"), "torch": text("torch"), "hosts": text("host"),
        "wall_s": float(info["wall_s"].sum()) if "wall_s" in info and len(info) else float("nan"),
        "timestamps": [min(text("timestamp"), default=""), max(text("timestamp"), default="")],
        "command": command(name, profile),
        "constant_columns": constant,
        "code_modules": _sweep.code_reached(r.fn),
        "threads": {col: sorted({int(v) for v in info[col].dropna()}) for col in
                    ("torch_threads", "openmp_threads", "blas_threads") if col in info},
    }
    out = Path(FRAMES_DIR if folder is None else folder)
    out.mkdir(parents=True, exist_ok=True)
    csv, meta = _frame_paths(name, profile, out)
    frame.to_csv(csv, index=False, float_format="%.9g")  # nine digits: a figure's precision, a tenth of the bytes
    meta.write_text(json.dumps(prov, indent=1, sort_keys=True) + "\n")
    return csv, meta


def committed(name: str, profile: str = "paper", *, folder: str | os.PathLike | None = None) -> Committed | None:
    """The committed frame of ``name`` in ``profile`` with its provenance, or ``None`` when none is committed."""
    get(name)
    csv, meta = _frame_paths(name, profile, None if folder is None else Path(folder))
    if not (csv.is_file() and meta.is_file()):
        return None
    frame = pd.read_csv(csv)
    prov = json.loads(meta.read_text())
    for col, value in prov.get("constant_columns", {}).items():
        frame[col] = [value] * len(frame)
    for col in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[col]) and frame[col].astype(str).str.match(r"^[\[{]").all():
            frame[col] = frame[col].map(json.loads)
    return Committed(frame, prov)


class Section(NamedTuple):
    """What :func:`section` returns: the (possibly partial) ``frame``, its ``provenance``, the regenerating
    ``command``, the cells ``done`` out of ``total`` and the summary ``figure`` (``None`` without data)."""

    frame: pd.DataFrame
    provenance: pd.DataFrame
    command: str
    done: int
    total: int
    figure: Any


def section(name: str, profile: str | None = None, *, cache_dir: str | os.PathLike | None = None) -> Section:
    """A chapter's *paper-scale* section: the registered grid's frame in ``profile`` (default
    ``$CURVLAB_PROFILE``), its provenance, the command that regenerates it, and its summary figure.

    In the ``paper`` profile, cheap grids (``in_book``: Part III) are computed here, into the cache; the others
    are only *read* from what ``make sweeps PROFILE=paper`` left there — missing cells are reported with the
    command, and the cells present are shown. In ``quick`` and ``standard`` every grid is only read (the chapter
    itself runs the same experiments at its own sizes), so the section shows data after ``make sweeps
    PROFILE=<profile>`` and otherwise just the note. Nothing here runs a grid that belongs
    outside the book build. Prints a short provenance line; the summary figure is ``Section.figure`` (shown when
    it is a cell's last expression)."""
    from . import plotting

    r = get(name)
    prof = config.profile() if profile is None else profile
    configs = r.configs(prof)
    cmd = command(name, prof)
    computed = r.in_book and prof == "paper"
    if computed:
        frame = _sweep.sweep(r.fn, configs, cache_dir=cache_dir, progress=False, name=r.cache_name())
        done = len(configs)
    else:
        try:
            frame = _sweep.sweep(r.fn, configs, cache_dir=cache_dir, progress=False, name=r.cache_name(),
                                 compute=False)
            done = len(configs)
        except _sweep.MissingCells as exc:
            missing = {_sweep._config_json("config", c) for c in exc.missing}
            present = [c for c in configs if _sweep._config_json("config", c) not in missing]
            frame = (_sweep.sweep(r.fn, present, cache_dir=cache_dir, progress=False, name=r.cache_name(),
                                  compute=False) if present else pd.DataFrame())
            done = len(present)
    keys = {_sweep._config_json("config", c) for c in configs}
    code = _code_hash_of(r)
    info = _sweep.cache_info(cache_dir, r.cache_name())
    if len(info):
        mine = info["config"].map(lambda s: _sweep._config_json("config", json.loads(s)) in keys)
        info = info[mine & (info["code_hash"] == code)].reset_index(drop=True)
    say = lambda text: print(textwrap.fill(text, width=100, subsequent_indent="    "))  # noqa: E731
    # Outside a complete paper-profile cache, the committed frame of the largest profile is what a reader sees.
    use = None
    if not (prof == "paper" and done == len(configs)):
        for p in ("paper", "standard"):  # a committed standard frame stands in only for missing cells
            if p == "standard" and (prof == "paper" or done == len(configs)):
                continue
            if (c := committed(name, p)) is not None:
                use = (p, c)
                break
    if use is not None:
        p, c = use
        prov = c.provenance
        fresh = prov.get("code_hash") == code
        say(f"{name} ({r.title}): the committed {p}-profile frame, {prov['cells']} cells "
            f"(curvlab/paper_frames/{name}.{p}.csv); this build's profile is {prof}.")
        say(f"  provenance: {prov['wall_s']:.1f} s of compute in all, device {', '.join(prov['devices'])}, "
            f"revision {', '.join(prov['revisions'])}, torch {', '.join(prov['torch'])}, "
            f"run {prov['timestamps'][0][:10]}; code hash {prov['code_hash'][:12]}"
            + (" (the current code's)." if fresh else
               f", not this build's ({code[:12]}): the frame was made by other code than this build's (or keyed by "
               "an older curvlab), so its numbers may not be what the current code computes; refresh it with "
               f"`{prov['command']}` and `python tools/run_sweeps.py --export`."))
        say(f"  regenerate with: {prov['command']}")
        _gpu_note(r, say)
        fig = None
        if r.summary is not None:
            figure, alt, caption = r.summary(c.frame)
            caption += f" Committed {p}-profile frame ({prov['cells']} cells, {', '.join(prov['devices'])})."
            fig = plotting.show(figure, alt=alt, caption=caption)
        return Section(c.frame, pd.DataFrame([prov]), prov["command"], prov["cells"], prov["cells"], fig)
    where = "computed in the book (a cheap grid)" if computed else "read from the sweep cache"
    say(f"{name} ({r.title}), profile {prof}: {done}/{len(configs)} cells, {where}.")
    say(f"  regenerate with: {cmd}")
    if len(info):
        wall = float(info["wall_s"].sum()) if "wall_s" in info else float("nan")
        devices = ", ".join(sorted(set(map(str, info.get("device", pd.Series(["?"]))))))
        revs = ", ".join(sorted(set(map(str, info.get("revision", pd.Series(["?"]))))))
        say(f"  provenance: {len(info)} cells, {wall:.1f} s of compute in all, device {devices}, revision {revs}")
    if done < len(configs):
        say(f"  {len(configs) - done} cells are not in the cache: run the command above (outside the book build) "
            "to fill them" + ("; the figure shows the cells present." if done else "."))
    if prof != "paper" or done < len(configs):
        _gpu_note(r, say)
    fig = None
    if done and r.summary is not None:
        figure, alt, caption = r.summary(frame)
        if done < len(configs):
            caption += f" Partial: {done} of {len(configs)} cells."
        fig = plotting.show(figure, alt=alt, caption=caption)
    return Section(frame, info, cmd, done, len(configs), fig)


def _gpu_note(r: PaperRun, say: Callable[[str], None]) -> None:
    """Say whether the paper-profile grid is committed, and if not what it would cost (an estimate)."""
    if committed(r.name, "paper") is not None:
        return
    cfgs = r.configs("paper")
    flops = float(sum(r.flops(**c) for c in cfgs))
    hours = flops / GPU_FLOPS_PER_S / 3600
    say(f"  The paper-profile grid ({len(cfgs)} cells) is not committed: it needs at most {flops:.2g} flop, "
        f"about {hours:.2g} device-hours at an assumed {GPU_FLOPS_PER_S:.0e} flop/s (an extrapolation of the cost "
        "model, every run to its iteration cap; not a measurement)"
        + (f"; data: {'; '.join(r.data)}" if r.data else "") + ".")


def estimate(profile: str = "paper", *, flops_per_s: float | None = None) -> pd.DataFrame:
    """Cells and floating-point operations (upper bound: every run to its cap) of every grid in ``profile``; with
    ``flops_per_s``, the hours that throughput would take (an extrapolation, not a measurement)."""
    rows = []
    for r in REGISTRY.values():
        cfgs = r.configs(profile)
        flops = float(sum(r.flops(**c) for c in cfgs))
        row = {"name": r.name, "chapter": r.chapter, "cells": len(cfgs), "flops_upper": flops,
               "data": "; ".join(r.data) or "bundled (scikit-learn digits) or generated"}
        if flops_per_s:
            row["hours_at_rate"] = flops / flops_per_s / 3600
        rows.append(row)
    return pd.DataFrame(rows)


def _check_finite_cost() -> None:  # pragma: no cover - a guard for editors of the registry
    for r in REGISTRY.values():
        for prof in _PROFILES:
            assert all(math.isfinite(r.flops(**c)) for c in r.configs(prof)), r.name
