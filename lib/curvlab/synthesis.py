r"""One lens on the three parts: curvature, conditioning and features (chapter ``40_synthesis``).

The synthesis chapter puts Part I (layer-wise preconditioning, :mod:`curvlab.linrep`), Part II (Gauss–Newton in
the mean-field regime, :mod:`curvlab.meanfield`) and Part III (conditioning of the GN matrix,
:mod:`curvlab.deep_linear`) side by side. This module holds what the chapter computes that no single part does.

**K-FAC as structured Gauss–Newton.** For the two-layer linear network :math:`f(x) = FGx`,
:math:`F\in\R^{d_y\times k}`, :math:`G\in\R^{k\times d}`, with :math:`\theta = [\operatorname{vec}G;
\operatorname{vec}F]` (row-major; the order of :func:`curvlab.deep_linear.theta_of` with :math:`W_1 = G`,
:math:`W_2 = F`), the GN matrix of the squared loss is

.. math::

    H_{\mathrm{GN}} = \begin{bmatrix} F^\top F\otimes\hat\Sigma & F^\top\otimes\hat\Sigma G^\top \\
    F\otimes G\hat\Sigma & I_{d_y}\otimes G\hat\Sigma G^\top\end{bmatrix},

and its diagonal blocks are *exactly* Kronecker: K-FAC's per-layer blocks (:func:`kfac_blocks`). Preconditioning
:math:`H_{\mathrm{GN}}` by them (:func:`block_preconditioned_spectrum`) leaves the nonzero eigenvalues
:math:`\{1, 2\}` with the multiplicities of :func:`kfac_spectrum_prediction` (chapter 40, proved there). For
one hidden leaky-ReLU layer the :math:`W`-block is no longer Kronecker: :func:`leaky_kfac_report` measures how far
K-FAC's factors, and the best Kronecker product (:func:`nearest_kronecker`), are from it.

**Conditioning of the linear-representation rates.** The variable-projection curvature and AMGD itself live in
:mod:`curvlab.linrep`; :func:`tail_rate` measures a contraction rate from a trace, with an a-posteriori error.

**Probes of open questions** (exploratory): :func:`minibatch_gn` (mini-batch GN in the mean-field model),
:func:`softmax_ggn` (the GGN of the cross-entropy loss; :func:`ce_kfac_spectrum` preconditions it by its blocks,
:func:`ce_kfac_spectrum_prediction` is the :math:`k\ge c-1` case), :func:`linrep_layer_probe` (Muon and SOAP on the
representation layer), :func:`giant_step_probe` (one giant step against several small ones) and
:func:`gn_layer_movement` (how a GN step splits between the layers under NTK and µP scalings).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from . import config
from ._validate import (as_tensor, check_choice, check_finite, check_int, check_matrix, check_nonnegative,
                        check_positive)
from .linalg import default_rtol, kron, psd_inv_sqrt

__all__ = [
    "two_layer_gn",
    "kfac_blocks",
    "block_preconditioned_spectrum",
    "kfac_spectrum_prediction",
    "nearest_kronecker",
    "kronecker_error",
    "leaky_kfac_report",
    "tail_rate",
    "mode_rate",
    "stack_problems",
    "softmax_ggn",
    "minibatch_gn",
    "linrep_layer_probe",
    "giant_step_probe",
    "gn_layer_movement",
    "ce_kfac_spectrum",
    "ce_kfac_spectrum_prediction",
    "distance_from_one_two",
]


# ============================================================================================ validation
def _f64(name: str, value, **kw) -> torch.Tensor:
    return config.spectral(check_matrix(name, value, **kw))


def _check_FG(F, G, Sigma_hat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    F, G = _f64("F", F), _f64("G", G)
    if F.shape[1] != G.shape[0]:
        raise ValueError(f"F must have k = {G.shape[0]} columns (G is {tuple(G.shape)}), got {tuple(F.shape)}")
    S = _f64("Sigma_hat", Sigma_hat, square=True)
    if S.shape[0] != G.shape[1]:
        raise ValueError(f"Sigma_hat must be {G.shape[1]} x {G.shape[1]} (d = G's columns), got {tuple(S.shape)}")
    if not torch.allclose(S, S.T, rtol=0, atol=default_rtol(S.shape[0]) * float(S.abs().max()) * 10):
        raise ValueError("Sigma_hat must be symmetric")
    return F, G, 0.5 * (S + S.T)


# ============================================================================================ K-FAC = structured GN
def two_layer_gn(F, G, Sigma_hat) -> torch.Tensor:
    r"""Closed-form :math:`H_{\mathrm{GN}}` of :math:`f = FGx` at :math:`(F, G)`, :math:`\theta = [\operatorname{vec}G;
    \operatorname{vec}F]` (row-major), ``(p, p)`` with :math:`p = kd + d_yk`, float64 (chapter 40, eq. of the module
    docstring). Jacobians: :math:`\partial f/\partial\operatorname{vec}G = F\otimes x^\top`,
    :math:`\partial f/\partial\operatorname{vec}F = I_{d_y}\otimes(Gx)^\top`; average over :math:`\hat\Sigma`."""
    F, G, S = _check_FG(F, G, Sigma_hat)
    d_y = F.shape[0]
    I = torch.eye(d_y, dtype=F.dtype, device=F.device)
    H_GG = kron(F.T @ F, S)
    H_GF = kron(F.T, S @ G.T)
    H_FF = kron(I, G @ S @ G.T)
    return torch.cat([torch.cat([H_GG, H_GF], 1), torch.cat([H_GF.T, H_FF], 1)], 0)


def kfac_blocks(F, G, Sigma_hat) -> tuple[torch.Tensor, torch.Tensor]:
    r"""K-FAC's per-layer blocks of :math:`f = FGx`: :math:`(F^\top F\otimes\hat\Sigma,\ I_{d_y}\otimes G\hat\Sigma
    G^\top)`, the exact diagonal blocks of :func:`two_layer_gn` (the output-side factor of :math:`G` is
    :math:`\Cout = F^\top F`, its input side :math:`\Cin = \hat\Sigma`; for :math:`F`, :math:`\Cout = I`,
    :math:`\Cin = G\hat\Sigma G^\top`)."""
    F, G, S = _check_FG(F, G, Sigma_hat)
    I = torch.eye(F.shape[0], dtype=F.dtype, device=F.device)
    return kron(F.T @ F, S), kron(I, G @ S @ G.T)


def block_preconditioned_spectrum(H, blocks: Sequence, rtol: float | None = None) -> torch.Tensor:
    r"""Eigenvalues (descending) of :math:`P^{+1/2}H P^{+1/2}`, :math:`P = \operatorname{blockdiag}(B_1,\dots)`:
    the spectrum of the block-preconditioned matrix :math:`P^{+}H` (same nonzero eigenvalues, :math:`AB` vs
    :math:`BA`). Pseudo-inverse square roots drop eigenvalues of a block below ``rtol`` times its largest
    (:func:`curvlab.linalg.psd_inv_sqrt`), so singular blocks are allowed. Float64; ``(p,)``."""
    H = _f64("H", H, square=True)
    if isinstance(blocks, torch.Tensor) or not isinstance(blocks, Sequence) or len(blocks) == 0:
        raise TypeError("blocks must be a non-empty list of square PSD matrices (the diagonal blocks of P)")
    Bs = [_f64(f"blocks[{i}]", B, square=True) for i, B in enumerate(blocks)]
    if sum(B.shape[0] for B in Bs) != H.shape[0]:
        raise ValueError(f"the blocks' sizes {[B.shape[0] for B in Bs]} must add up to H's size {H.shape[0]}")
    R = torch.block_diag(*[psd_inv_sqrt(B, rtol) for B in Bs])
    M = R @ H @ R
    return torch.linalg.eigvalsh(0.5 * (M + M.T)).flip(-1)


def kfac_spectrum_prediction(d: int, k: int, d_y: int, *, rank_F: int | None = None, rank_G: int | None = None,
                             rank_Sigma: int | None = None) -> torch.Tensor:
    r"""The predicted spectrum of K-FAC-preconditioned :math:`H_{\mathrm{GN}}` for :math:`f=FGx` (chapter 40's
    theorem): with :math:`r_F = \operatorname{rank}F`, :math:`r_G = \operatorname{rank}(G\hat\Sigma^{1/2})`,
    :math:`s = \operatorname{rank}\hat\Sigma` (defaults: full rank, :math:`r_F = r_G = k`, :math:`s = d`),

    .. math::

        \underbrace{2,\dots,2}_{r_Fr_G},\quad \underbrace{1,\dots,1}_{d_yr_G + r_Fs - 2r_Fr_G},\quad
        \underbrace{0,\dots,0}_{\text{rest of } p = kd + d_yk}.

    Returned descending, float64, shape ``(p,)``."""
    d, k, d_y = (check_int(n, v, min_value=1) for n, v in (("d", d), ("k", k), ("d_y", d_y)))
    r_F = min(k, d_y) if rank_F is None else check_int("rank_F", rank_F, min_value=0)
    s = d if rank_Sigma is None else check_int("rank_Sigma", rank_Sigma, min_value=0)
    r_G = min(k, s) if rank_G is None else check_int("rank_G", rank_G, min_value=0)
    if r_F > min(k, d_y):
        raise ValueError(f"rank_F must be <= min(k, d_y) = {min(k, d_y)}, got {r_F}")
    if s > d:
        raise ValueError(f"rank_Sigma must be <= d = {d}, got {s}")
    if r_G > min(k, s):
        raise ValueError(f"rank_G must be <= min(k, rank_Sigma) = {min(k, s)}, got {r_G}")
    p = k * d + d_y * k
    twos, ones = r_F * r_G, d_y * r_G + r_F * s - 2 * r_F * r_G
    return torch.tensor([2.0] * twos + [1.0] * ones + [0.0] * (p - twos - ones), dtype=torch.float64)


def nearest_kronecker(M, shape_A: tuple[int, int], shape_B: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The Kronecker product :math:`A\otimes B` nearest to ``M`` in Frobenius norm (Van Loan & Pitsianis): the top
    singular pair of the rearrangement :math:`\mathcal R(M)` whose row :math:`(i, j)` is
    :math:`\operatorname{vec}` of block :math:`(i, j)` of ``M``. For a symmetric PSD ``M`` both factors come out
    symmetric PSD (signs fixed so). Returns ``(A, B)``, float64."""
    M = _f64("M", M)
    (a1, a2), (b1, b2) = (tuple(check_int("shape", s, min_value=1) for s in sh) for sh in (shape_A, shape_B))
    if M.shape != (a1 * b1, a2 * b2):
        raise ValueError(f"M must have shape ({a1 * b1}, {a2 * b2}) for A {shape_A} and B {shape_B}, got "
                         f"{tuple(M.shape)}")
    Rm = M.reshape(a1, b1, a2, b2).permute(0, 2, 1, 3).reshape(a1 * a2, b1 * b2)
    U, s, Vh = torch.linalg.svd(Rm, full_matrices=False)
    A = (U[:, 0] * s[0].sqrt()).reshape(a1, a2)
    B = (Vh[0] * s[0].sqrt()).reshape(b1, b2)
    if float(torch.diagonal(A).sum() if a1 == a2 else A.sum()) < 0:
        A, B = -A, -B
    return A, B


def kronecker_error(M, A, B) -> float:
    r"""Relative Frobenius distance :math:`\lVert M - A\otimes B\rVert_F / \lVert M\rVert_F` (0: exactly Kronecker)."""
    M, A, B = _f64("M", M), _f64("A", A), _f64("B", B)
    if M.shape != (A.shape[0] * B.shape[0], A.shape[1] * B.shape[1]):
        raise ValueError(f"M must have the shape of A kron B, {(A.shape[0] * B.shape[0], A.shape[1] * B.shape[1])}, "
                         f"got {tuple(M.shape)}")
    nM = float(torch.linalg.matrix_norm(M))
    if nM == 0:
        raise ValueError("M must not be zero")
    return float(torch.linalg.matrix_norm(M - kron(A, B))) / nM


def _nonzero(e: torch.Tensor, rank: int) -> torch.Tensor:
    return e[:rank]


def leaky_kfac_report(W, V, X, alpha: float) -> dict:
    r"""How far the per-layer blocks of :math:`f = V\phi(Wx)` (leaky ReLU, slope ``alpha``) are from the linear case.

    The exact blocks are :math:`H_{VV} = I_{d_y}\otimes\Phi^\top\Phi/n` (Kronecker) and
    :math:`H_{WW} = \frac1n\sum_i D_iV^\top VD_i\otimes x_ix_i^\top` (not Kronecker unless every :math:`D_i` is
    the same); K-FAC replaces the latter by :math:`\Cout\otimes\Cin`, :math:`\Cout = \frac1n\sum_iD_iV^\top VD_i`,
    :math:`\Cin = \hat\Sigma`. Returns the relative Kronecker errors of K-FAC's block (``kron_err_kfac``) and of the
    nearest Kronecker product (``kron_err_best``), :math:`\kappa` of :math:`H_{\mathrm{GN}}` (``kappa_gn``), of the
    exact-block-preconditioned matrix (``kappa_exact``) and of the K-FAC-preconditioned one (``kappa_kfac``), and
    the largest distance of a nonzero preconditioned eigenvalue from :math:`\{1,2\}` (``off_12_exact``,
    ``off_12_kfac``). The rank is the numerical rank of :math:`H_{\mathrm{GN}}` (dense, ``torch.func``). Chapter 40.
    """
    from .curvature import condition_number, gn_matrix
    from .deep_linear import leaky_flat_model

    W, V, X = _f64("W", W), _f64("V", V), _f64("X", X)
    if X.shape[1] != W.shape[1] or V.shape[1] != W.shape[0]:
        raise ValueError(f"shapes must chain: X (n, d), W (m, d), V (d_y, m); got {tuple(X.shape)}, "
                         f"{tuple(W.shape)}, {tuple(V.shape)}")
    alpha = check_nonnegative("alpha", alpha)
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    (n, d), (m, d_y) = X.shape, (W.shape[0], V.shape[0])
    fn, _ = leaky_flat_model(X, d, m, d_y, alpha)
    H = gn_matrix(fn, torch.cat([W.reshape(-1), V.reshape(-1)]), scale=1.0 / n)
    pW = m * d
    H_WW, H_VV = H[:pW, :pW], H[pW:, pW:]
    D = torch.where(X @ W.T > 0, 1.0, alpha).to(X)                         # (n, m)
    C_out = torch.einsum("iu,au,av,iv->uv", D, V, V, D) / n
    C_in = X.T @ X / n
    A, B = nearest_kronecker(H_WW, (m, m), (d, d))
    rank = condition_number(H).rank
    e_exact = block_preconditioned_spectrum(H, [H_WW, H_VV])[:rank]
    e_kfac = block_preconditioned_spectrum(H, [kron(C_out, C_in), H_VV])[:rank]
    off = lambda e: float(torch.minimum((e - 1).abs(), (e - 2).abs()).max())  # noqa: E731
    return dict(alpha=alpha, rank=rank, kron_err_kfac=kronecker_error(H_WW, C_out, C_in),
                kron_err_best=kronecker_error(H_WW, A, B), kappa_gn=condition_number(H).kappa,
                kappa_exact=float(e_exact[0] / e_exact[-1]), kappa_kfac=float(e_kfac[0] / e_kfac[-1]),
                off_12_exact=off(e_exact), off_12_kfac=off(e_kfac))


# ============================================================================================ measured rates
def tail_rate(trace, window: int, floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Measured contraction rate of a geometrically decaying positive ``trace (..., T+1)`` near its end,
    :math:`\hat\rho = (e_{T'}/e_{T'-w})^{1/w}` with :math:`T'` the last index where :math:`e > \text{floor}` (a run
    that reached rounding level is cut before it) and :math:`w = \min(\text{window}, \lfloor T'/2\rfloor)`, and
    its **drift** :math:`|\hat\rho - \hat\rho'|`, :math:`\hat\rho'` the same estimate one window earlier. For a
    linear map whose subdominant modes decay by a factor :math:`q\le 1/2` per window relative to the dominant one,
    the estimate's remaining error is at most :math:`q/(1-q)\le 1` times the drift (chapter 40). Returns
    ``(rate, drift, w)`` with the trace's batch shape."""
    e = config.spectral(check_finite("trace", as_tensor("trace", trace)))
    window = check_int("window", window, min_value=1)
    floor = check_nonnegative("floor", floor)
    if e.dim() < 1 or bool((e <= 0).any()):
        raise ValueError("trace must be a positive (..., T+1) tensor (a distance or a norm)")
    flat = e.reshape(-1, e.shape[-1])
    out = torch.empty(3, flat.shape[0], dtype=e.dtype, device=e.device)
    for i, row in enumerate(flat):
        above = torch.nonzero(row > floor).reshape(-1)
        end = int(above[-1]) if above.numel() else -1
        w = min(window, end // 2)
        if w < 1:
            raise ValueError(f"trace {i} has only {end + 1} entries above floor={floor:g}; need at least 3")
        r1 = (row[end] / row[end - w]) ** (1.0 / w)
        r0 = (row[end - w] / row[end - 2 * w]) ** (1.0 / w)
        out[:, i] = torch.stack([r1, (r1 - r0).abs(), torch.tensor(float(w), dtype=e.dtype, device=e.device)])
    rate, drift, ws = (o.reshape(e.shape[:-1]) for o in out)
    return rate, drift, ws


def mode_rate(coords, v, mu, dist, floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Measured decay rate of an iteration's component along a **predicted** eigenvector, with its error bound.

    ``coords (..., T+1, p)`` are the iterates' tangent coordinates :math:`b_t` (for AMGD, :math:`\operatorname{vec}
    (G_tU_\perp^\top)`, row by row), ``v (..., p)`` the predicted slowest eigenvector of the linearised map with
    eigenvalue ``mu (...)``, and ``dist (..., T+1)`` the iterates' distance to the fixed point, used to stop before
    rounding level (the last index with ``dist > floor``). If the prediction is right, :math:`c_t = v^\top b_t`
    obeys :math:`c_{t+1} = \mu c_t + O(\lVert b_t\rVert^2)` whatever the other modes do (a symmetric map keeps
    its eigenvectors orthogonal), so the per-step ratios :math:`r_t = c_{t+1}/c_t` equal :math:`\mu` up to a bias
    :math:`\beta_t = O(\lVert b_t\rVert)` and rounding; if it is wrong, :math:`c_t` follows the true slowest mode
    and the ratios converge to another number.

    The window is the last :math:`w = \lceil\ln 2/(-\ln\mu)\rceil` steps (at least 2): over it the iterate
    shrinks by a factor of at least two, so the bias at its start is at least twice the bias at its end. Returns
    ``(rate, bound, w)``: ``rate`` the geometric mean of the window's ratios and ``bound = 4 max_t|r_t - rate|``,
    which bounds :math:`|\text{rate} - \mu|` for a monotonically decaying bias: the mean bias is at most the
    bias at the start, :math:`\beta_s \le 2(\beta_s - \beta_e)`, and the range :math:`\beta_s - \beta_e` is
    at most twice the largest deviation from the mean (chapter 40)."""
    b = config.spectral(check_finite("coords", as_tensor("coords", coords)))
    v = check_finite("v", as_tensor("v", v, dtype=b.dtype, device=b.device))
    mu = check_finite("mu", as_tensor("mu", mu, dtype=b.dtype, device=b.device))
    e = check_finite("dist", as_tensor("dist", dist, dtype=b.dtype, device=b.device))
    floor = check_nonnegative("floor", floor)
    if b.dim() < 2:
        raise ValueError(f"coords must be (..., T+1, p), got shape {tuple(b.shape)}")
    if v.shape != b.shape[:-2] + b.shape[-1:]:
        raise ValueError(f"v must have shape {tuple(b.shape[:-2] + b.shape[-1:])} to match coords, got {tuple(v.shape)}")
    if mu.shape != b.shape[:-2] or e.shape != b.shape[:-1]:
        raise ValueError(f"mu must have shape {tuple(b.shape[:-2])} and dist {tuple(b.shape[:-1])}, got "
                         f"{tuple(mu.shape)} and {tuple(e.shape)}")
    if bool(((mu <= 0) | (mu >= 1)).any()):
        raise ValueError("mu must lie in (0, 1): the predicted rate of a contracting map")
    c = (b * v.unsqueeze(-2)).sum(-1)
    flat_c, flat_e, flat_mu = c.reshape(-1, c.shape[-1]), e.reshape(-1, e.shape[-1]), mu.reshape(-1)
    out = torch.empty(3, flat_c.shape[0], dtype=b.dtype, device=b.device)
    for i, (ci, ei, mi) in enumerate(zip(flat_c, flat_e, flat_mu)):
        above = torch.nonzero(ei > floor).reshape(-1)
        end = int(above[-1]) if above.numel() else -1
        w = max(2, math.ceil(math.log(2.0) / -math.log(float(mi))))
        if end - w < 0:
            raise ValueError(f"iteration {i} has only {end + 1} iterates above floor={floor:g}; the window needs "
                             f"{w + 1} (run longer or start closer)")
        seg = ci[end - w:end + 1]
        if bool((seg == 0).any()) or bool((seg[1:] / seg[:-1] <= 0).any()):
            raise ValueError(f"iteration {i}: the component along v changes sign or vanishes in the window, so v "
                             "is not a slowest mode of this iteration")
        ratios = seg[1:] / seg[:-1]
        rate = ratios.log().mean().exp()
        out[:, i] = torch.stack([rate, 4 * (ratios - rate).abs().max(),
                                 torch.tensor(float(w), dtype=b.dtype, device=b.device)])
    rate, bound, ws = (o.reshape(mu.shape) for o in out)
    return rate, bound, ws


def stack_problems(problems: Sequence):
    r"""Concatenate :class:`curvlab.linrep.LinRepProblem` instances along the seed dimension (same ``d, k, d_y``,
    noise and input distribution), so problems with different :math:`\kappa(\Sigma)`, :math:`\kappa(F_\star)` run
    as one batched program (chapter 40)."""
    from dataclasses import replace

    from .linrep import LinRepProblem

    if isinstance(problems, LinRepProblem) or not isinstance(problems, Sequence) or len(problems) == 0:
        raise TypeError("problems must be a non-empty list of LinRepProblem")
    if not all(isinstance(p, LinRepProblem) for p in problems):
        raise TypeError("every entry of problems must be a LinRepProblem")
    names = ("Fstar", "Gstar", "Sigma", "Sigma_half", "Fstar_T", "Sigma_T", "Sigma_T_half")
    try:
        return replace(problems[0], **{n: torch.cat([getattr(p, n) for p in problems]) for n in names})
    except RuntimeError as exc:
        raise ValueError(f"problems must share d, k and d_y: {exc}") from exc


# ============================================================================================ probes
def softmax_ggn(logits_fn: Callable[[torch.Tensor], torch.Tensor], theta) -> torch.Tensor:
    r"""Generalised GN matrix of the mean cross-entropy loss, :math:`\frac1n\sum_iJ_i^\top\Lambda_iJ_i`, with
    :math:`\Lambda_i = \operatorname{diag}(p_i) - p_ip_i^\top` the Hessian of the loss in the logits and
    :math:`J_i` the Jacobian of sample :math:`i`'s logits. ``logits_fn(theta)`` returns ``(n, c)``. Float64,
    ``(p, p)``; the dense reference (``torch.func``). Chapter 40, probe 2."""
    from torch.func import jacrev

    theta = config.spectral(check_finite("theta", as_tensor("theta", theta)))
    if theta.dim() != 1:
        raise ValueError(f"theta must be a flat parameter vector (p,), got shape {tuple(theta.shape)}")
    Z = logits_fn(theta)
    if not isinstance(Z, torch.Tensor) or Z.dim() != 2:
        raise ValueError("logits_fn(theta) must return an (n, c) tensor of logits")
    J = jacrev(logits_fn)(theta)                                            # (n, c, p)
    P = torch.softmax(Z.detach(), dim=-1)
    Lam = torch.diag_embed(P) - P.unsqueeze(-1) * P.unsqueeze(-2)           # (n, c, c)
    Hm = torch.einsum("iap,iab,ibq->pq", J, Lam, J) / Z.shape[0]
    return 0.5 * (Hm + Hm.T)


def minibatch_gn(params0, data, *, batch_size: int, epochs: int, eta: float, damping, seed: int = 0) -> pd.DataFrame:
    r"""Mini-batch kernel-form GN on the mean-field network (Part II's step on a batch of ``batch_size`` samples,
    :math:`\theta\leftarrow\theta-\eta J_B^\top(K_B+\lamGN I)^{-1}r_B`), reshuffled every epoch. Returns a tidy
    frame: ``epoch``, ``seed`` (batch index), ``train_loss`` (full batch), ``test_loss``, ``batch_size``,
    ``steps``. Probe 1 of chapter 40 (exploratory)."""
    from . import meanfield as mf

    b = check_int("batch_size", batch_size, min_value=1)
    epochs = check_int("epochs", epochs, min_value=1)
    eta = check_positive("eta", eta)
    n = data.n
    if b > n:
        raise ValueError(f"batch_size must be <= n = {n}, got {b}")
    g = torch.Generator().manual_seed(check_int("seed", seed, min_value=0))
    params, rows, steps = params0, [], 0

    def record(epoch: int) -> None:
        tr = mf.loss(params, data.X, data.Y, data.act)
        te = mf.loss(params, data.X_test, data.Y_test, data.act)
        for s in range(tr.numel()):
            rows.append(dict(epoch=epoch, seed=s, train_loss=float(tr.reshape(-1)[s]),
                             test_loss=float(te.reshape(-1)[s]), batch_size=b, steps=steps))

    record(0)
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(n, generator=g)
        for start in range(0, n - b + 1, b):
            idx = perm[start:start + b].to(data.X.device)
            params = mf.gn_step(params, data.X[..., idx, :], data.Y[..., idx], data.act, eta=eta, damping=damping)
            steps += 1
        record(epoch)
    return pd.DataFrame(rows)


def linrep_layer_probe(method: str, sample: Callable[[], tuple[torch.Tensor, torch.Tensor]], G0, G_star, *,
                       n_steps: int, lr: float, lam: float = 1e-3) -> np.ndarray:
    r"""Train the representation :math:`G` of :math:`f = FGx` with the head refit by least squares on every fresh
    batch (as AMGD and K-FAC do in Part I) and the :math:`G`-step taken by ``method``:

    * ``"AMGD"``: :math:`G \leftarrow G - \eta\nabla_G`;
    * ``"K-FAC"``: :math:`G \leftarrow G - \eta(F^\top F+\lambda I)^{-1}\nabla_G(\hat\Sigma+\lambda I)^{-1}`;
    * ``"Muon"``: :func:`curvlab.precond.muon_update` (momentum 0.95, Newton–Schulz);
    * ``"SOAP"``: :func:`curvlab.precond.soap_update` (simplified SOAP).

    ``sample()`` returns a fresh batch ``(X (n, d), Y (n, d_y))``.
    Returns :math:`\dist(G_t, G_\star)` (sine of the largest principal angle) for :math:`t = 0..T`. Probe 3 of
    chapter 40 (exploratory: one step size, no tuning claims).
    """
    from . import precond
    from .linalg import sin_theta_distance

    method = check_choice("method", method, ("AMGD", "K-FAC", "Muon", "SOAP"))
    T = check_int("n_steps", n_steps, min_value=1)
    lr, lam = check_positive("lr", lr), check_nonnegative("lam", lam)
    G = _f64("G0", G0).clone()
    G_star = _f64("G_star", G_star)
    state = precond.soap_init(G) if method == "SOAP" else torch.zeros_like(G)
    dist = [float(sin_theta_distance(G, G_star))]
    for _ in range(T):
        X, Y = sample()
        X, Y = config.spectral(X), config.spectral(Y)
        n = X.shape[0]
        Z = X @ G.T
        F = torch.linalg.lstsq(Z, Y).solution.T                              # (d_y, k)
        grad = F.T @ (Z @ F.T - Y).T @ X / n                                 # nabla_G L
        if method == "AMGD":
            G = G - lr * grad
        elif method == "K-FAC":
            Ik, Id = torch.eye(G.shape[0], dtype=G.dtype), torch.eye(G.shape[1], dtype=G.dtype)
            G = G - lr * torch.linalg.solve(F.T @ F + lam * Ik, grad) @ torch.linalg.inv(X.T @ X / n + lam * Id)
        elif method == "Muon":
            upd, state = precond.muon_update(grad, state, lr)
            G = G + upd
        else:
            upd, state = precond.soap_update(grad, state, lr)
            G = G + upd
        dist.append(float(sin_theta_distance(G, G_star)))
    return np.asarray(dist)


def giant_step_probe(X, y, W0, v, *, eta: float, n_steps: int, lam_G: float | None = None) -> torch.Tensor:
    r"""First-layer training of :math:`f(x) = v^\top\tanh(Wx)/\sqrt m` with :math:`v` frozen: ``n_steps`` full-batch
    steps of size ``eta / n_steps`` (one giant step when ``n_steps = 1``), each step recomputing the gradient
    :math:`\nabla_W\Loss = \frac1n\sum_i(f(x_i)-y_i)\,(v\odot\phi'(Wx_i))x_i^\top/\sqrt m`; with ``lam_G`` the
    gradient is right-preconditioned by :math:`(\hat\Sigma+\lambda_GI)^{-1}` (K-FAC's input factor). Returns
    :math:`W_T - W_0` (``(m, d)``), whose top right singular vector is the learned direction. Probe 4 of
    chapter 40 (exploratory)."""
    X = _f64("X", X)
    W = _f64("W0", W0).clone()
    y = config.spectral(check_finite("y", as_tensor("y", y)))
    v = config.spectral(check_finite("v", as_tensor("v", v)))
    n, d = X.shape
    m = W.shape[0]
    if W.shape[1] != d or y.shape != (n,) or v.shape != (m,):
        raise ValueError(f"shapes must be X (n, d), y (n,), W0 (m, d), v (m,); got {tuple(X.shape)}, "
                         f"{tuple(y.shape)}, {tuple(W.shape)}, {tuple(v.shape)}")
    eta, T = check_positive("eta", eta), check_int("n_steps", n_steps, min_value=1)
    P = None
    if lam_G is not None:
        lam_G = check_nonnegative("lam_G", lam_G)
        P = torch.linalg.inv(X.T @ X / n + lam_G * torch.eye(d, dtype=X.dtype))
    W_init = W.clone()
    for _ in range(T):
        H = torch.tanh(X @ W.T)                                              # (n, m)
        r = H @ v / math.sqrt(m) - y
        grad = ((r[:, None] * (1 - H**2)) * v[None, :]).T @ X / (n * math.sqrt(m))
        W = W - (eta / T) * (grad if P is None else grad @ P)
    return W - W_init


def gn_layer_movement(m: int, param, *, d: int = 8, n: int = 40, seed: int = 0, lam_GN: float = 0.0) -> dict:
    r"""How one full GN step (:math:`\eta = 1`) splits between the layers of the two-layer network of
    :mod:`curvlab.regimes` under a parametrisation ``param`` (``"NTK"``, ``"mean-field"``, ``"muP"``): the
    minimum-norm step :math:`\Delta\theta = J^\top(JJ^\top+\lamGN I)^{-1}r` on a random tanh teacher's labels, from a
    symmetric initialisation (:math:`f_{\theta_0} = 0`). Returns the relative movements
    :math:`\lVert h\Delta W\rVert_F/\lVert hW_0\rVert_F` of the hidden layer and
    :math:`\lVert s\Delta v\rVert/\lVert s v_0\rVert` of the output layer, in effective weights (the multipliers
    :math:`h, s` included), and the function-space residual after the step relative to before. Probe 5 of
    chapter 40 (exploratory)."""
    from . import regimes
    from .curvature import jacobian

    m, d, n = (check_int(k, v_, min_value=1) for k, v_ in (("m", m), ("d", d), ("n", n)))
    lam_GN = check_nonnegative("lam_GN", lam_GN)
    p = regimes._param(param)
    g = torch.Generator().manual_seed(check_int("seed", seed, min_value=0))
    teacher = regimes.make_teacher(1, d, 2, generator=g, n_mc=2000)
    X, y = regimes.sample(teacher, n, generator=g)
    P0 = regimes.init_two_layer(1, m, d, p, generator=torch.Generator().manual_seed(seed + 1))
    h, s = p.multipliers(m)

    def split(th):
        W, b, v = th.split([m * d, m, m])
        return regimes.TwoLayer(W.reshape(1, m, d), b.reshape(1, m), v.reshape(1, m))

    fn = lambda th: regimes.forward(split(th), X, p)[0]                     # noqa: E731
    th0 = torch.cat([P0.W.reshape(-1), P0.b.reshape(-1), P0.v.reshape(-1)])
    J = jacobian(fn, th0)
    r = fn(th0) - y[0]
    K = J @ J.T + lam_GN * torch.eye(n, dtype=J.dtype)
    delta = J.T @ torch.linalg.solve(K, r)
    D, P1 = split(delta), split(th0 - delta)
    r1 = fn(th0 - delta) - y[0]
    return dict(m=m, param=p.name, move_W=float(h * D.W.norm() / (h * P0.W.norm())),
                move_v=float(s * D.v.norm() / (s * P0.v.norm())),
                residual_ratio=float(r1.norm() / r.norm()))


# ============================================================================================ cross-entropy GGN
def ce_kfac_spectrum(X, F, G, rtol: float | None = None) -> tuple[torch.Tensor, float]:
    r"""The exactly block-preconditioned GGN of the mean cross-entropy loss of :math:`f(x) = FGx`
    (:math:`c` classes, :math:`F\in\R^{c\times k}`, :math:`G\in\R^{k\times d}`, :math:`\theta = [\operatorname{vec}G;
    \operatorname{vec}F]`): the GGN :math:`\frac1n\sum_iJ_i^\top\Lambda_iJ_i` by :func:`softmax_ggn` (``torch.func``),
    preconditioned by its own two diagonal blocks (:func:`block_preconditioned_spectrum`, pseudo-inverses: every
    softmax Hessian :math:`\Lambda_i` annihilates :math:`\mathbf 1`, so the :math:`F`-block is singular).

    Returns the spectrum (descending, ``(p,)``) and the largest condition number of a block on its range, which
    sets the rounding error of the spectrum. Chapter 40, the cross-entropy probe."""
    X = _f64("X", X)
    F, G = _f64("F", F), _f64("G", G)
    if F.shape[1] != G.shape[0]:
        raise ValueError(f"F must have k = {G.shape[0]} columns (G is {tuple(G.shape)}), got {tuple(F.shape)}")
    if X.shape[1] != G.shape[1]:
        raise ValueError(f"X must have d = {G.shape[1]} columns (G is {tuple(G.shape)}), got {tuple(X.shape)}")
    if F.shape[0] < 2:
        raise ValueError(f"F must have c >= 2 rows (classes), got {F.shape[0]}")
    k, d, c = G.shape[0], G.shape[1], F.shape[0]
    logits = lambda th: X @ th[: k * d].reshape(k, d).T @ th[k * d:].reshape(c, k).T   # noqa: E731
    H = softmax_ggn(logits, torch.cat([G.reshape(-1), F.reshape(-1)]))
    blocks = [H[: k * d, : k * d], H[k * d:, k * d:]]
    conds = []
    for B in blocks:
        ev = torch.linalg.eigvalsh(B)
        tol = (default_rtol(B.shape[0]) if rtol is None else rtol) * float(ev[-1])
        conds.append(float(ev[-1] / ev[ev > tol][0]))
    return block_preconditioned_spectrum(H, blocks, rtol), max(conds)


def ce_kfac_spectrum_prediction(d: int, k: int, c: int) -> torch.Tensor:
    r"""The block-preconditioned cross-entropy GGN spectrum of :func:`ce_kfac_spectrum` when :math:`k\ge c-1`
    (chapter 40), at a generic point (:math:`\operatorname{colsp}F + \operatorname{span}\mathbf 1 = \R^c`,
    :math:`G\hat\Sigma G^\top` of rank :math:`r_G = \min(k, d)`, :math:`\hat\Sigma\succ0`), for *any* softmax
    Hessians :math:`\Lambda_i`:

    .. math::

        \underbrace{2,\dots,2}_{(c-1)r_G},\quad \underbrace{1,\dots,1}_{(c-1)(d-r_G)},\quad
        \underbrace{0,\dots,0}_{\text{rest of } p = kd + ck}.

    Modulo :math:`\mathbf 1` (which every :math:`\Lambda_i` annihilates) the head's output range
    :math:`\{AGx_i\}` lies inside the representation's :math:`\{FBx_i\}`, so the two projectors commute whatever the
    metric. For :math:`k\le c-2` there is no such formula: the spectrum leaves :math:`\{1, 2\}` once the
    :math:`\Lambda_i` differ between samples, and a ``ValueError`` says so."""
    d, k, c = (check_int(n, v, min_value=1) for n, v in (("d", d), ("k", k), ("c", c)))
    if c < 2:
        raise ValueError(f"c must be >= 2 classes, got {c}")
    if k < c - 1:
        raise ValueError(f"k must be >= c - 1 = {c - 1} for the {{1, 2}} spectrum, got k={k}: with k <= c - 2 the "
                         "head's range is not inside the representation's and the spectrum leaves {1, 2}")
    r_G = min(k, d)
    twos, ones = (c - 1) * r_G, (c - 1) * (d - r_G)
    p = k * d + c * k
    return torch.tensor([2.0] * twos + [1.0] * ones + [0.0] * (p - twos - ones), dtype=torch.float64)


def distance_from_one_two(spectrum, rank: int) -> float:
    r"""The largest distance of the ``rank`` largest eigenvalues of ``spectrum`` (descending) from :math:`\{1, 2\}`:
    :math:`\max_{i\le r}\min(|\lambda_i - 1|, |\lambda_i - 2|)` (chapter 40)."""
    e = as_tensor("spectrum", spectrum, dtype=torch.float64)
    if e.dim() != 1:
        raise ValueError(f"spectrum must be a 1-D tensor of eigenvalues, got shape {tuple(e.shape)}")
    rank = check_int("rank", rank, min_value=1)
    if rank > e.numel():
        raise ValueError(f"rank must be <= the number of eigenvalues {e.numel()}, got {rank}")
    top = e[:rank]
    return float(torch.minimum((top - 1).abs(), (top - 2).abs()).max())
