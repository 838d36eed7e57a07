r"""Baselines for linear representation learning: NGD, Adam, Shampoo, whitening and batch-norm (chapter 11).

The subject module :mod:`curvlab.linrep` holds the model :math:`y = F_\star G_\star x + \varepsilon`, the head fit,
AMGD, stylised K-FAC and DFW, and the loop :func:`curvlab.linrep.run`. This module adds the paper's baselines
(Zhang et al., ICML 2025) as updates registered in :data:`curvlab.linrep.UPDATES`, so that
``linrep.run("NGD", ...)`` runs them like any other method, batched over seeds:

* ``"NGD"``: the damped Gauss–Newton (natural-gradient) step on :math:`\theta = (\operatorname{vec}F,
  \operatorname{vec}G)` jointly, :math:`\theta \leftarrow \theta - \eta\,(H_{\mathrm{GN}} + \lambda_{\mathrm{GN}}
  I_p)^{-1}\nabla\mathcal{L}` with :math:`H_{\mathrm{GN}} = J^\top J/n` (damping added to :math:`J^\top J/n`, the
  convention of :func:`curvlab.precond.natural_gradient_step`). :math:`F` is *not* re-fitted: NGD moves both layers.
  The :math:`p\times p` solve is done exactly, with no dense matrix, by a Schur complement whose matrix is a
  Kronecker product plus a multiple of the identity (:func:`ngd_direction`; dense reference
  :func:`ngd_direction_dense`).
* ``"Adam"`` and ``"Shampoo"``: the zoo's rules (:func:`curvlab.precond.adam_update`,
  :func:`curvlab.precond.shampoo_update`) on :math:`G`, with :math:`F` re-fitted by least squares on the same
  batch every step, like AMGD and K-FAC (the authors' "SHMP(G)" variant).
* ``"whitening+AMGD"`` and ``"batchnorm+AMGD"``: inputs normalised, :math:`\tilde x = Nx`, then AMGD on the
  representation :math:`\tilde G` of the normalised inputs. :math:`N = \bar\Sigma^{-1/2}` (full, "ZCA" whitening) or
  :math:`N = \operatorname{diag}(\bar\Sigma)^{-1/2}` (per-coordinate batch-norm, without centring — the data have
  mean zero — and without an affine part, which :math:`G` absorbs). :math:`\bar\Sigma` is the running average of
  the batches' second moments (``stats="running"``, default) or the current batch's (``stats="batch"``, batch-norm's
  training mode). The state's ``G`` is :math:`\tilde G N` with the frozen training statistics, i.e. the
  representation *in input coordinates*; :func:`normalised_metrics` gives the distances and transfer losses in every
  stated coordinate system and with frozen or re-estimated statistics.

  The normalised methods always use the same-batch least-squares head (``hp['f_variant']`` is ignored).

Chapter 11 also asks *why* AMGD fails under anisotropy; :func:`gradient_drift` (Monte Carlo) and
:func:`predicted_drift` (exact, Gaussian inputs) give the mean update at :math:`G_\star` for a same-batch or an
independent-batch head, and :func:`amgd_noise_second_moment` the linearised variance of AMGD started at
:math:`G_\star`. :func:`run_method` runs any method (the normalised ones through :func:`run_normalised`),
:func:`tune` is the chapter's fixed grid-search rule and :func:`traces_frame` turns runs into a tidy frame.

Every update has the signature ``fn(problem, state, batch, hp) -> LinRepState`` of :mod:`curvlab.linrep`.
Shapes carry a leading seed dimension ``S``; device and dtype follow the problem (CPU or CUDA; the random batches
are drawn by :meth:`curvlab.linrep.LinRepProblem.sample`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import curvature, linrep, precond
from ._validate import as_tensor, check_choice, check_finite, check_int, check_positive
from .linrep import LinRepProblem, LinRepState

__all__ = [
    "NORMALISERS",
    "ngd_direction",
    "ngd_direction_dense",
    "ngd_update",
    "adam_update",
    "shampoo_update",
    "normaliser",
    "whitening_update",
    "batchnorm_update",
    "normalised_metrics",
    "run_normalised",
    "run_method",
    "grid_scores",
    "grid_runs",
    "score_runs",
    "tail_score",
    "speed_score",
    "steps_to_level",
    "tune",
    "traces_frame",
    "gradient_drift",
    "predicted_drift",
    "amgd_noise_second_moment",
]

#: The input normalisations, ``"full"`` (:math:`N = \bar\Sigma^{-1/2}`) and ``"diagonal"`` (batch-norm).
NORMALISERS = ("full", "diagonal")


def _eye(k: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(k, dtype=like.dtype, device=like.device)


# ============================================================================================ NGD
def ngd_direction(F, G, Sxx, Syx, lam_GN: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The damped GN direction :math:`(H_{\mathrm{GN}} + \lambda_{\mathrm{GN}} I_p)^{-1}\nabla\mathcal{L}` on
    :math:`\theta = (\operatorname{vec}F, \operatorname{vec}G)`, without forming the :math:`p\times p` matrix.

    For :math:`f(x) = FGx` the GN matrix has the blocks (row-major vec; chapter 11)

    .. math:: H_{FF} = I_{d_y}\otimes G\hat\Sigma G^\top,\quad H_{FG} = F\otimes G\hat\Sigma,\quad
              H_{GG} = F^\top F\otimes\hat\Sigma .

    Eliminating :math:`\delta F` with :math:`A = G\hat\Sigma G^\top + \lambda_{\mathrm{GN}} I_k` leaves the Schur
    complement :math:`F^\top F\otimes C + \lambda_{\mathrm{GN}} I`, :math:`C = \hat\Sigma - \hat\Sigma G^\top A^{-1}
    G\hat\Sigma` — a Kronecker product plus a multiple of the identity, solved in the factors' eigenbases by
    :func:`curvlab.precond.kfac_step_tikhonov`:

    .. math:: \delta G = (F^\top F\otimes C + \lambda_{\mathrm{GN}} I)^{-1}\operatorname{vec}\big(\nabla_G
              - F^\top\nabla_F A^{-1}G\hat\Sigma\big),\qquad
              \delta F = \big(\nabla_F - F\,\delta G\,\hat\Sigma G^\top\big)A^{-1}.

    ``F (..., d_y, k)``, ``G (..., k, d)``, moments ``Sxx`` :math:`=\hat\Sigma` ``(..., d, d)`` and ``Syx``
    :math:`=\hat\Sigma_{yx}` ``(..., d_y, d)``; ``lam_GN > 0`` (:math:`H_{\mathrm{GN}}` is singular: the
    :math:`k^2` directions :math:`(FM, -MG)` leave :math:`FG` unchanged). Cost :math:`O(d^3 + d_y k^2)` per seed.
    Returns ``(dF, dG)``; the NGD step is :math:`(F, G) \leftarrow (F, G) - \eta(\delta F, \delta G)`.
    """
    F, G, Sxx, Syx, lam = _check_ngd_args(F, G, Sxx, Syx, lam_GN)
    gF, gG = linrep.grad_F(F, G, Sxx, Syx), linrep.grad_G(F, G, Sxx, Syx)
    GS = G @ Sxx                                                            # G Sigma_hat   (k, d)
    A = GS @ G.transpose(-2, -1) + lam * _eye(G.shape[-2], G)               # G Sigma_hat G^T + lam I
    AinvGS = torch.linalg.solve(A, GS)                                      # A^{-1} G Sigma_hat
    C = Sxx - GS.transpose(-2, -1) @ AinvGS                                 # Schur factor
    C = 0.5 * (C + C.transpose(-2, -1))
    rhs = gG - F.transpose(-2, -1) @ gF @ AinvGS
    dG = precond.kfac_step_tikhonov(rhs, F.transpose(-2, -1) @ F, C, lam)
    dF = linrep._right_solve(gF - F @ dG @ GS.transpose(-2, -1), A)
    return dF, dG


def _check_ngd_args(F, G, Sxx, Syx, lam_GN):
    G = check_finite("G", as_tensor("G", G))
    F = check_finite("F", as_tensor("F", F, dtype=G.dtype, device=G.device))
    Sxx = check_finite("Sxx", as_tensor("Sxx", Sxx, dtype=G.dtype, device=G.device))
    Syx = check_finite("Syx", as_tensor("Syx", Syx, dtype=G.dtype, device=G.device))
    if G.dim() < 2 or F.dim() < 2 or F.shape[-1] != G.shape[-2]:
        raise ValueError(f"F (..., d_y, k) and G (..., k, d) must agree on k, got {tuple(F.shape)}, {tuple(G.shape)}")
    d = G.shape[-1]
    if Sxx.shape[-2:] != (d, d):
        raise ValueError(f"Sxx must have shape (..., {d}, {d}), got {tuple(Sxx.shape)}")
    if Syx.shape[-2:] != (F.shape[-2], d):
        raise ValueError(f"Syx must have shape (..., {F.shape[-2]}, {d}), got {tuple(Syx.shape)}")
    lam = check_positive("lam_GN", lam_GN)
    return F, G, Sxx, Syx, lam


def ngd_direction_dense(F, G, X, Y, lam_GN: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Dense reference for :func:`ngd_direction`: the Jacobian :math:`J` of :math:`\theta\mapsto\operatorname{vec}
    (XG^\top F^\top)` by ``torch.func`` (:func:`curvlab.curvature.jacobian`), :math:`H_{\mathrm{GN}} = J^\top J/n`,
    and a dense :math:`p\times p` solve. One seed: ``F (d_y, k)``, ``G (k, d)``, ``X (n, d)``, ``Y (n, d_y)``."""
    G = check_finite("G", as_tensor("G", G))
    F, X, Y = (check_finite(nm, as_tensor(nm, v, dtype=G.dtype, device=G.device))
               for nm, v in (("F", F), ("X", X), ("Y", Y)))
    if F.dim() != 2 or G.dim() != 2 or X.dim() != 2 or Y.dim() != 2:
        raise ValueError("ngd_direction_dense takes one seed: 2-D F, G, X, Y")
    lam = check_positive("lam_GN", lam_GN)
    (d_y, k), d, n = F.shape, G.shape[-1], X.shape[0]
    theta = torch.cat([F.reshape(-1), G.reshape(-1)])

    def model(th: torch.Tensor) -> torch.Tensor:
        Fm, Gm = th[: d_y * k].reshape(d_y, k), th[d_y * k:].reshape(k, d)
        return (X @ Gm.transpose(0, 1) @ Fm.transpose(0, 1)).reshape(-1)

    J = curvature.jacobian(model, theta)
    r = model(theta) - Y.reshape(-1)
    p = theta.numel()
    step = torch.linalg.solve(J.T @ J / n + lam * torch.eye(p, dtype=J.dtype, device=J.device), J.T @ r / n)
    return step[: d_y * k].reshape(d_y, k), step[d_y * k:].reshape(k, d)


def ngd_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""NGD: damped Gauss–Newton on both layers, :math:`(F, G) \leftarrow (F, G) - \eta_G\,(\delta F, \delta G)` with
    :math:`(\delta F, \delta G) = (H_{\mathrm{GN}} + \lambda_{\mathrm{GN}} I)^{-1}\nabla\mathcal{L}` on the step's
    batch (:func:`ngd_direction`). ``hp``: ``eta_G`` (one step size for both layers), ``lam_GN`` (> 0)."""
    if "lam_GN" not in hp:
        raise ValueError("hp must contain 'lam_GN' (> 0), the damping of the NGD step")
    eta = check_positive("eta_G", hp.get("eta_G"))
    Sxx, Syx = linrep.batch_moments(batch)
    dF, dG = ngd_direction(state.F, state.G, Sxx, Syx, hp["lam_GN"])
    return LinRepState(F=state.F - eta * dF, G=state.G - eta * dG, t=state.t + 1, extra=state.extra)


# ============================================================================================ Adam, Shampoo
def _refit(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict, method: str):
    """Validated hp, the batch moments and the head the G-step uses (least squares unless ``f_variant`` says)."""
    hp = linrep._hp(hp, method)
    Sxx, Syx = linrep.batch_moments(batch)
    if hp["f_variant"] != "refit_independent":      # the moments are all the head needs
        batch = {"Sxx": Sxx, "Syx": Syx}
    return hp, Sxx, Syx, linrep._head_for_step(state, batch, hp)


def adam_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""Adam on :math:`G` (:func:`curvlab.precond.adam_update`, Kingma & Ba 2015) with the least-squares head:
    :math:`F_t = \arg\min_F\mathcal{L}(F, G_t)`, then :math:`G_{t+1} = G_t - \eta_G\,\hat g_t/(\sqrt{\hat s_t} +
    \lambda_{\mathrm{Adam}})` from the moments of :math:`\nabla_G\mathcal{L}(F_t, G_t)`. ``hp``: ``eta_G``,
    ``betas`` (default ``(0.9, 0.999)``), ``lam_adam`` (default ``1e-8``)."""
    hp, Sxx, Syx, F = _refit(problem, state, batch, hp, "Adam")
    g = linrep.grad_G(F, state.G, Sxx, Syx)
    st = state.extra.get("adam") or precond.adam_init(state.G)
    upd, st = precond.adam_update(g, st, hp["eta_G"], hp.get("betas", (0.9, 0.999)), hp.get("lam_adam", 1e-8))
    return LinRepState(F=F, G=state.G + upd, t=state.t + 1, extra={**state.extra, "adam": st})


def shampoo_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""Shampoo on :math:`G` (:func:`curvlab.precond.shampoo_update`, Gupta, Koren & Singer 2018) with the
    least-squares head: :math:`G_{t+1} = G_t - \eta_G (C^{\mathrm{Sh}}_{\mathrm{out}})^{-1/4}\nabla_G
    (C^{\mathrm{Sh}}_{\mathrm{in}})^{-1/4}`, statistics accumulated from :math:`\lambda_{\mathrm{Sh}} I` with
    :math:`\lambda_{\mathrm{Sh}}` = ``hp['shampoo_eps']`` (default ``1e-6``) times :math:`\max_s\lVert\nabla_G\rVert_2^2`
    at the first step (the zoo's relative convention). ``hp``: ``eta_G``, ``shampoo_eps``, ``exponent`` (-1/4)."""
    hp, Sxx, Syx, F = _refit(problem, state, batch, hp, "Shampoo")
    g = linrep.grad_G(F, state.G, Sxx, Syx)
    st = state.extra.get("shampoo")
    if st is None:
        scale = float(torch.linalg.matrix_norm(g, ord=2).max()) ** 2
        st = precond.shampoo_init(state.G, check_positive("shampoo_eps", hp.get("shampoo_eps", 1e-6)) * scale)
    direction, st = precond.shampoo_update(g, st, hp.get("exponent", -0.25))
    return LinRepState(F=F, G=state.G - hp["eta_G"] * direction, t=state.t + 1,
                       extra={**state.extra, "shampoo": st})


# ============================================================================================ normalisation
def normaliser(Sigma, kind: str = "full") -> torch.Tensor:
    r"""The input normaliser :math:`N` with :math:`\tilde x = Nx` (chapter 11): :math:`N = \Sigma^{-1/2}` (``"full"``,
    symmetric "ZCA" whitening, :math:`\mathbb{E}\tilde x\tilde x^\top = I_d`) or :math:`N =
    \operatorname{diag}(\Sigma)^{-1/2}` (``"diagonal"``, batch-norm without centring: unit second moment per
    coordinate). ``Sigma (..., d, d)`` positive definite (uncentred second moments). Symmetric ``(..., d, d)``."""
    kind = check_choice("kind", kind, NORMALISERS)
    Sigma = check_finite("Sigma", as_tensor("Sigma", Sigma))
    if Sigma.dim() < 2 or Sigma.shape[-1] != Sigma.shape[-2]:
        raise ValueError(f"Sigma must be a (batch of) square matrix (..., d, d), got {tuple(Sigma.shape)}")
    if kind == "diagonal":
        diag = torch.diagonal(Sigma, dim1=-2, dim2=-1)
        if bool((diag <= 0).any()):
            raise ValueError("Sigma must have a positive diagonal for batch-norm")
        return torch.diag_embed(diag.rsqrt())
    lam, Q = torch.linalg.eigh(0.5 * (Sigma + Sigma.transpose(-2, -1)))
    if bool((lam <= 1e3 * torch.finfo(lam.dtype).eps * lam[..., -1:].abs()).any()):
        raise ValueError("Sigma must be positive definite for full whitening (it is numerically singular)")
    return (Q * lam.rsqrt().unsqueeze(-2)) @ Q.transpose(-2, -1)


def _normalised_amgd(kind: str, method: str):
    def update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
        hp = linrep._hp(hp, method)
        stats = check_choice("stats", hp.get("stats", "running"), ("running", "batch"))
        Sxx, Syx = linrep.batch_moments(batch)
        ex = state.extra
        Gn = ex.get("G_normalised", state.G)                 # G~ : the representation of x~ = N x
        count = ex.get("count", 0) + 1
        M = ex.get("second_moment_sum", torch.zeros_like(Sxx)) + Sxx
        N_run = normaliser(M / count, kind)                  # frozen (running) training statistics
        N = N_run if stats == "running" else normaliser(Sxx, kind)
        Sxx_n, Syx_n = N @ Sxx @ N, Syx @ N                  # moments of (x~, y)
        F = linrep.head_from_moments(Gn, Sxx_n, Syx_n, hp["lam_head"])
        Gn = Gn - linrep._step_scale(F, Sxx_n, hp) * linrep.grad_G(F, Gn, Sxx_n, Syx_n)
        extra = {**ex, "G_normalised": Gn, "count": count, "second_moment_sum": M, "N": N_run, "kind": kind}
        return LinRepState(F=F, G=Gn @ N_run, t=state.t + 1, extra=extra)

    update.__name__ = f"{'whitening' if kind == 'full' else 'batchnorm'}_update"
    return update


whitening_update = _normalised_amgd("full", "whitening+AMGD")
whitening_update.__doc__ = r"""Full whitening, then AMGD (chapter 11): :math:`\tilde x = \bar\Sigma^{-1/2}x`,
    :math:`F_t` the least-squares head of :math:`\tilde G_t\tilde x`, :math:`\tilde G_{t+1} = \tilde G_t -
    \eta\nabla_{\tilde G}\mathcal{L}`. :math:`\bar\Sigma` is the running mean of the batches' second moments
    (``hp['stats']='running'``, default) or the batch's own (``'batch'``). The state's ``G`` is :math:`\tilde G
    \bar\Sigma^{-1/2}`, the representation in input coordinates with the frozen (running) statistics; ``extra`` holds
    ``G_normalised`` (:math:`\tilde G`) and ``N``. ``hp`` as AMGD (``eta_G``, ``normalize_step``)."""
batchnorm_update = _normalised_amgd("diagonal", "batchnorm+AMGD")
batchnorm_update.__doc__ = r"""Per-coordinate batch-norm, then AMGD (chapter 11): as :func:`whitening_update` with
    :math:`N = \operatorname{diag}(\bar\Sigma)^{-1/2}`: it equalises the coordinates' scales and leaves their
    correlations."""


def normalised_metrics(problem: LinRepProblem, state: LinRepState) -> dict[str, torch.Tensor]:
    r"""Distances and losses of a normalised method in every coordinate system (chapter 11), each ``(S,)``:

    * ``"distance_normalised"``: :math:`\operatorname{dist}(\tilde G, G_\star)`, in normalised coordinates;
    * ``"subspace_distance"``: :math:`\operatorname{dist}(\tilde G N, G_\star)`, in input coordinates with the frozen
      training statistics :math:`N`;
    * ``"transfer_loss"``: the transfer loss of :math:`\tilde G N` (statistics frozen at transfer time);
    * ``"transfer_loss_reestimated"``: the transfer loss of :math:`\tilde G N_T`, :math:`N_T` the normaliser of the
      transfer inputs' own second moment :math:`\Sigma_T` (statistics re-estimated at transfer time, exactly);
    * ``"train_loss"``: :func:`curvlab.linrep.representation_loss` of :math:`\tilde G N`.
    """
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    if not isinstance(state, LinRepState) or "G_normalised" not in state.extra:
        raise ValueError("state must come from whitening_update or batchnorm_update (extra['G_normalised'])")
    Gn, N = state.extra["G_normalised"], state.extra["N"]
    N_T = normaliser(problem.Sigma_T, state.extra["kind"])
    G_in = Gn @ N
    return {
        "subspace_distance": linrep.subspace_distance(G_in, problem.Gstar),
        "distance_normalised": linrep.subspace_distance(Gn, problem.Gstar),
        "train_loss": linrep.representation_loss(G_in, problem),
        "transfer_loss": linrep.transfer_loss(G_in, problem),
        "transfer_loss_reestimated": linrep.transfer_loss(Gn @ N_T, problem),
    }


def run_normalised(method: str, problem: LinRepProblem, n_steps: int, batch_size: int | None, hp: dict, *,
                   record_every: int = 1, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    r""":func:`curvlab.linrep.run` for ``"whitening+AMGD"`` / ``"batchnorm+AMGD"`` recording
    :func:`normalised_metrics` (traces ``(S, T_rec)`` at steps ``record_every, 2 record_every, ...``, plus
    ``"step"``) and the final ``G`` (input coordinates), ``G_normalised`` and frozen normaliser ``N``. Same batches
    as ``linrep.run`` with the same generator."""
    if method not in ("whitening+AMGD", "batchnorm+AMGD"):
        raise ValueError(f"method must be 'whitening+AMGD' or 'batchnorm+AMGD', got {method!r}")
    n_steps, batch_size, record_every = linrep._check_run(method, problem, n_steps, batch_size, hp, record_every,
                                                          min_steps=1)
    fn = linrep.UPDATES[method]
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    state = linrep.init_state(problem, gen)
    recs, steps = [], []
    for t, batch in enumerate(linrep._batches(method, problem, n_steps, batch_size, hp, gen), start=1):
        state = fn(problem, state, batch, hp)
        if t % record_every == 0 or t == n_steps:
            recs.append(normalised_metrics(problem, state))
            steps.append(t)
    out = {key: torch.stack([r[key] for r in recs], dim=-1) for key in recs[0]}
    out["step"] = torch.tensor(steps).expand(problem.n_seeds, -1)
    out["final_G"], out["final_G_normalised"], out["final_N"] = (state.G, state.extra["G_normalised"],
                                                                 state.extra["N"])
    return out


# ============================================================================================ tuning, frames
def run_method(method: str, problem: LinRepProblem, n_steps: int, batch_size: int | None, hp: dict, *,
               record_every: int = 1, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """:func:`run_normalised` for the normalised methods (every coordinate system recorded), else
    :func:`curvlab.linrep.run`: one entry point for every method of chapter 11."""
    if method in ("whitening+AMGD", "batchnorm+AMGD"):
        return run_normalised(method, problem, n_steps, batch_size, hp, record_every=record_every,
                              generator=generator)
    return linrep.run(method, problem, n_steps, batch_size, hp, record_every=record_every, generator=generator)


def _check_out(out, metric: str) -> None:
    if not isinstance(out, dict) or "step" not in out:
        raise TypeError(f"out must be a run's output (a dict of traces with a 'step' entry), got {type(out).__name__}")
    if metric not in out:
        raise ValueError(f"metric must be a recorded trace of the run, one of {sorted(out)}; got {metric!r}")


def tail_score(out: dict, metric: str = "transfer_loss", tail: float = 0.1) -> np.ndarray:
    r"""The chapter's tuning score of one run, **per seed**: :math:`\log_{10}` of ``metric`` averaged over the last
    ``tail`` fraction of the recorded steps (chapter 11); a seed whose score is not finite scores :math:`+\infty`.
    It rewards a low *floor* (where a method ends), not speed."""
    if not 0 < check_positive("tail", tail) <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail}")
    _check_out(out, metric)
    trace = out[metric]
    m = max(1, int(round(tail * trace.shape[-1])))
    per_seed = trace[:, -m:].mean(-1).log10().double().cpu().numpy()
    return np.where(np.isfinite(per_seed), per_seed, np.inf)


def speed_score(out: dict, level: float, metric: str = "subspace_distance") -> np.ndarray:
    r"""How slowly a run gets down to ``level``, **per seed** (chapter 11): the area between the curve
    :math:`\log_{10}` ``metric``:math:`_t` and the level, counted only above the level, per step of the horizon,

    .. math:: A = \frac{1}{T}\int_0^T\big(\log_{10} d_t - \log_{10}\ell\big)_+\,dt

    (trapezoid rule over the recorded steps, in decades). A run that drops from :math:`d_0` to :math:`\ell` at a
    constant log-rate and at time :math:`\tau` has :math:`A = \tau\log_{10}(d_0/\ell)/(2T)`: for a fixed start,
    :math:`A` is proportional to the time to reach the level. Below the level nothing counts, so with :math:`\ell`
    above every method's noise floor the score compares *speed*, never floors; unlike a time-to-level it needs no
    censoring for a run that never gets there. A non-finite trace scores :math:`+\infty`."""
    level = check_positive("level", level)
    _check_out(out, metric)
    trace = out[metric].double().cpu()
    steps = out["step"][0].double().cpu()
    if steps.numel() < 2:
        raise ValueError("speed_score needs at least two recorded steps (record_every <= n_steps)")
    excess = (trace.log10() - math.log10(level)).clamp(min=0)
    area = torch.trapezoid(excess, steps, dim=-1) / (steps[-1] - steps[0])
    area = area.numpy()
    return np.where(np.isfinite(area), area, np.inf)


def steps_to_level(out: dict, level: float, metric: str = "subspace_distance") -> np.ndarray:
    r"""Per seed, the first recorded step at which ``metric`` is at or below ``level`` (chapter 11); ``inf`` if the
    run never gets there. Resolution: the run's ``record_every``."""
    level = check_positive("level", level)
    _check_out(out, metric)
    trace, steps = out[metric].double().cpu(), out["step"][0].double().cpu()
    hit = trace <= level
    first = torch.where(hit.any(-1), steps[hit.int().argmax(-1)], torch.tensor(float("inf"), dtype=steps.dtype))
    return first.numpy()


def grid_runs(method: str, problem: LinRepProblem, n_steps: int, batch_size: int, base_hp: dict, grid: dict, *,
              record_every: int = 1, seed: int = 0) -> list:
    r"""Every combination of ``grid`` (a dict of lists, fixed before the run) on top of ``base_hp``, run on
    ``problem`` with generator seed ``seed``. Returns ``(hp, out)`` pairs in the order of ``itertools.product``
    over the grid's keys, ``out`` the run's traces or ``None`` for a run that failed (an error). Score them with
    :func:`tail_score` (the chapter's floor rule) or :func:`speed_score` (its speed rule) without running twice."""
    import itertools

    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    if not isinstance(base_hp, dict):
        raise TypeError(f"base_hp must be a dict of hyper-parameters, got {type(base_hp).__name__}")
    method = check_choice("method", method, tuple(linrep.UPDATES))
    n_steps, batch_size = check_int("n_steps", n_steps, min_value=1), check_int("batch_size", batch_size, min_value=1)
    record_every, seed = check_int("record_every", record_every, min_value=1), check_int("seed", seed)
    if not isinstance(grid, dict) or not grid or not all(isinstance(v, (list, tuple)) and v for v in grid.values()):
        raise ValueError("grid must be a non-empty dict of non-empty lists of values")
    keys, runs = list(grid), []
    for values in itertools.product(*(grid[k] for k in keys)):
        hp = {**base_hp, **dict(zip(keys, values))}
        try:
            out = run_method(method, problem, n_steps, batch_size, hp, record_every=record_every,
                             generator=torch.Generator().manual_seed(seed))
        except (ValueError, RuntimeError, torch.linalg.LinAlgError):
            out = None
        runs.append((hp, out))
    return runs


def score_runs(runs: list, n_seeds: int, rule: str = "tail", *, metric: str | None = None, tail: float = 0.1,
               level: float | None = None) -> list:
    r"""Per-seed scores of :func:`grid_runs`' output by ``rule``: ``"tail"`` (:func:`tail_score`, ``metric``
    defaults to the transfer loss) or ``"speed"`` (:func:`speed_score` at ``level``, ``metric`` defaults to the
    subspace distance). A failed run scores :math:`+\infty` on each of its ``n_seeds`` seeds. Lower is better."""
    rule = check_choice("rule", rule, ("tail", "speed"))
    n_seeds = check_int("n_seeds", n_seeds, min_value=1)
    if not isinstance(runs, (list, tuple)) or not all(isinstance(r, tuple) and len(r) == 2 for r in runs):
        raise TypeError("runs must be grid_runs' list of (hp, out) pairs")
    if rule == "speed" and level is None:
        raise ValueError("level is required for rule='speed'")
    if rule == "tail":
        score = lambda o: tail_score(o, metric or "transfer_loss", tail)  # noqa: E731
    else:
        score = lambda o: speed_score(o, level, metric or "subspace_distance")  # noqa: E731
    return [(hp, np.full(n_seeds, np.inf) if out is None else score(out)) for hp, out in runs]


def grid_scores(method: str, problem: LinRepProblem, n_steps: int, batch_size: int, base_hp: dict, grid: dict, *,
                metric: str = "transfer_loss", tail: float = 0.1, record_every: int = 1, seed: int = 0):
    r"""Every combination of ``grid`` (a dict of lists, fixed before the run) on top of ``base_hp``, run on
    ``problem`` and scored **per seed** by :math:`\log_{10}` of ``metric`` averaged over the last ``tail`` fraction of
    the recorded steps (chapter 11). A run that fails (an error) scores :math:`+\infty` on every seed, a seed whose
    score is not finite scores :math:`+\infty`. Returns a list of ``(hp, scores)`` with ``scores`` a float array of
    shape ``(S,)``, in the order of ``itertools.product`` over the grid's keys. Comparing two methods' stability
    over the same grid and seeds uses these per-seed scores (seeds are the replicates, not grid cells).
    :func:`grid_runs` with :func:`score_runs` gives this and the speed rule from one set of runs."""
    if not 0 < check_positive("tail", tail) <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail}")
    runs = grid_runs(method, problem, n_steps, batch_size, base_hp, grid, record_every=record_every, seed=seed)
    return score_runs(runs, problem.Gstar.shape[0], "tail", metric=metric, tail=tail)


def tune(method: str, problem: LinRepProblem, n_steps: int, batch_size: int, base_hp: dict, grid: dict, *,
         metric: str = "transfer_loss", tail: float = 0.1, record_every: int = 1, seed: int = 0):
    r"""Grid search by a rule fixed in advance (chapter 11): every combination of ``grid`` (a dict of lists) on
    top of ``base_hp`` is run on ``problem`` (a *tuning* problem, not the reported one) and scored by the mean over
    seeds of :math:`\log_{10}` of ``metric`` averaged over the last ``tail`` fraction of the recorded steps; a run
    that diverges (an error or a non-finite value) scores :math:`+\infty`. Returns ``(best_hp, scores)`` with
    ``scores`` a list of ``(hp, score)``; :func:`grid_scores` gives the per-seed scores."""
    cells = grid_scores(method, problem, n_steps, batch_size, base_hp, grid, metric=metric, tail=tail,
                        record_every=record_every, seed=seed)
    scores = [(hp, float(s.mean())) for hp, s in cells]
    best = min(scores, key=lambda hs: hs[1])[0]
    return best, scores


def traces_frame(outs: dict, metrics=("subspace_distance", "train_loss", "transfer_loss")):
    r"""A tidy :class:`pandas.DataFrame` (method, seed, step, metric, value) from ``{method: run output}``."""
    import pandas as pd

    rows = []
    for method, out in outs.items():
        steps = out["step"][0].tolist()
        for metric in metrics:
            if metric not in out:
                continue
            vals = out[metric].detach().cpu().double()
            for s in range(vals.shape[0]):
                rows += [(method, s, t, metric, float(v)) for t, v in zip(steps, vals[s].tolist())]
    return pd.DataFrame(rows, columns=["method", "seed", "step", "metric", "value"])


# ============================================================================================ SGD's failure: bias or variance?
def gradient_drift(problem: LinRepProblem, G, n_batches: int, batch_size: int, f_variant: str = "refit_same", *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Monte Carlo samples of the AMGD gradient's component off :math:`\operatorname{rowsp}(G_\star)`,
    :math:`\nabla_G\mathcal{L}(F_t, G)\,\Pi_\perp` with :math:`\Pi_\perp = I - G_\star^\top G_\star` (chapter 11).

    ``f_variant``: ``"refit_same"`` (the least-squares head of the same batch) or ``"refit_independent"`` (of an
    independent batch). Its mean is the *drift* of AMGD at :math:`G`; at :math:`G = G_\star` a nonzero drift is a bias:
    the fixed point leaves :math:`\operatorname{rowsp}(G_\star)` however small the step. Returns ``(n_batches, S, k,
    d)``."""
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    G = linrep._check_G(G, problem)
    B, n = check_int("n_batches", n_batches, min_value=1), check_int("batch_size", batch_size, min_value=1)
    f_variant = check_choice("f_variant", f_variant, ("refit_same", "refit_independent"))
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    P = linrep.perp_projector(problem.Gstar)
    chunk = max(1, min(B, 2**22 // max(1, problem.n_seeds * n * problem.d)))   # ~32 MB per draw

    def draw(b):                                             # b batches at once, as (b, S, n, .)
        X, Y = problem.sample(b * n, gen)
        split = lambda A: A.reshape(A.shape[0], b, n, A.shape[-1]).transpose(0, 1)  # noqa: E731
        return split(X), split(Y)

    out, done = [], 0
    while done < B:
        b = min(chunk, B - done)
        X, Y = draw(b)
        Sxx, Syx = linrep.batch_moments({"X": X, "Y": Y})
        F = linrep.head_from_moments(G, *(linrep.batch_moments(dict(zip("XY", draw(b))))
                                          if f_variant == "refit_independent" else (Sxx, Syx)))
        out.append(linrep.grad_G(F, G, Sxx, Syx) @ P)
        done += b
    return torch.cat(out)


def predicted_drift(problem: LinRepProblem, batch_size: int, f_variant: str = "refit_same") -> torch.Tensor:
    r"""The exact drift :math:`\mathbb{E}[\nabla_G\mathcal{L}(F_t, G_\star)]\,\Pi_\perp` at :math:`G = G_\star` for
    Gaussian inputs (chapter 11), ``(S, k, d)``:

    * same batch: :math:`0` — the residual of a least-squares fit is orthogonal to the features, so the noise in
      :math:`F_t` and in the residual cancel in expectation;
    * independent batch: :math:`D\,G_\star\Sigma\,\Pi_\perp` with :math:`D = \mathbb{E}[(F_t - F_\star)^\top(F_t -
      F_\star)] = \frac{\sigma_\varepsilon^2 d_y}{n-k-1}(G_\star\Sigma G_\star^\top)^{-1}` (the mean of an inverse
      Wishart matrix); it vanishes when :math:`\sigma_\varepsilon = 0` or when :math:`\operatorname{rowsp}(G_\star)`
      is an invariant subspace of :math:`\Sigma` (e.g. :math:`\Sigma = I`).
    """
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    n = check_int("batch_size", batch_size, min_value=1)
    f_variant = check_choice("f_variant", f_variant, ("refit_same", "refit_independent"))
    Gs, Sig, k = problem.Gstar, problem.Sigma, problem.k
    if f_variant == "refit_same":
        return torch.zeros_like(Gs)
    if n <= k + 1:
        raise ValueError(f"batch_size must exceed k + 1 = {k + 1} for the inverse-Wishart mean, got {n}")
    if problem.x_dist != "gaussian":
        raise ValueError("predicted_drift is exact for x_dist='gaussian' only")
    D = problem.noise**2 * problem.d_y / (n - k - 1) * torch.linalg.inv(Gs @ Sig @ Gs.transpose(-2, -1))
    return D @ Gs @ Sig @ linrep.perp_projector(Gs)


def amgd_noise_second_moment(problem: LinRepProblem, eta: float, n_steps: int, batch_size: int, *,
                             stationary: bool = False) -> torch.Tensor:
    r"""Predicted :math:`\mathbb{E}\sum_i\sin^2\psi_i(G_T, G_\star)` for AMGD with the same-batch head and a fixed
    step ``eta``, started at :math:`G_0 = G_\star` (chapter 11), ``(S,)``.

    Linearised at :math:`G_\star` the error :math:`B_t` (:math:`\delta G = B U_\perp`) follows
    :math:`B_{t+1} = B_t - \eta(F_\star^\top F_\star\otimes S_n)B_t + \eta\xi_t` with :math:`S_n = \frac{n-k}{n}S`
    (:func:`curvlab.linrep.schur_complement`; the factor is the mean of a residual covariance with :math:`k`
    regressors) and gradient noise of covariance :math:`\frac{\sigma_\varepsilon^2}{n}F_\star^\top F_\star\otimes
    S_n`: proportional to the curvature. Mode by mode, with :math:`h_i` the eigenvalues of :math:`F_\star^\top
    F_\star\otimes S_n`,

    .. math:: \mathbb{E}\lVert B_T\rVert_F^2 = \sum_i \frac{\eta\sigma_\varepsilon^2}{n(2-\eta h_i)}
              \big(1 - (1-\eta h_i)^{2T}\big),

    and ``stationary=True`` drops the bracket (the :math:`T\to\infty` floor, :math:`\approx\eta\sigma_\varepsilon^2
    k(d-k)/(2n)` for small :math:`\eta`: it vanishes with the step).
    """
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    eta = check_positive("eta", eta)
    T = check_int("n_steps", n_steps, min_value=0)
    n = check_int("batch_size", batch_size, min_value=1)
    if n <= problem.k:
        raise ValueError(f"batch_size must exceed k = {problem.k}, got {n}")
    H = linrep.schur_curvature(problem.Fstar, problem.Gstar, problem.Sigma) * ((n - problem.k) / n)
    h = torch.linalg.eigvalsh(H)
    if bool((eta * h >= 2).any()):
        raise ValueError(f"eta is too large: eta * lambda_max = {float((eta * h).max()):.3g} >= 2 (unstable)")
    per_mode = eta * problem.noise**2 / (n * (2 - eta * h))
    if not stationary:
        per_mode = per_mode * (1 - (1 - eta * h) ** (2 * T))
    return per_mode.sum(-1)


# ============================================================================================ registration
linrep.register_update("NGD", ngd_update, default_f_variant="gradient")
linrep.register_update("Adam", adam_update, default_f_variant="refit_same")
linrep.register_update("Shampoo", shampoo_update, default_f_variant="refit_same")
linrep.register_update("whitening+AMGD", whitening_update, default_f_variant="refit_same")
linrep.register_update("batchnorm+AMGD", batchnorm_update, default_f_variant="refit_same")
