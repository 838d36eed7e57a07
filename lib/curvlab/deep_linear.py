r"""Conditioning of the Gauss–Newton matrix of deep linear, residual and leaky-ReLU networks (Part III).

Chapters: ``notebooks/30_gn_conditioning_structure`` (structure and bounds), ``31_gn_conditioning_factors``
(what changes the conditioning), ``32_gn_conditioning_leaky_relu`` (beyond linear). Source:
Zhao, Singh & Lucchi (2024), *Theoretical characterisation of the Gauss–Newton conditioning in neural networks*;
the structure of the Jacobian goes back to Singh, Bachmann & Hofmann (2021).

**Networks.** A deep linear network :math:`f(x) = W_L W_{L-1}\cdots W_1 x` is a list ``Ws`` with
``Ws[l-1]`` :math:`= W_l\in\mathbb R^{m_l\times m_{l-1}}`, :math:`m_0 = d`, :math:`m_L = d_y`; any width may be
below :math:`\min(d, d_y)` (a bottleneck). Every tensor may carry the same leading batch dimensions (one network
per seed), and the spectral functions are batched over them. Two variants share the same algebra through
*effective* layers :math:`\tilde W_l`:

* residual (skip scale :math:`\zeta`): hidden layers :math:`2\le l\le L-1` (square) act as :math:`\zeta I+W_l`;
* fixed diagonal gains :math:`g_l` after hidden layer :math:`l` (batch-norm with frozen statistics):
  :math:`\tilde W_l = \operatorname{diag}(g_l)(\zeta I + W_l)`.

Write :math:`A_l = \tilde W_{L:l+1}\operatorname{diag}(g_l)` (:math:`d_y\times m_l`, :math:`A_L = I`) and
:math:`B_l = \tilde W_{l-1:1}` (:math:`m_{l-1}\times d`, :math:`B_1 = I`). With row-major vectorisation the
Jacobian of :math:`f(x)` with respect to :math:`\operatorname{vec}W_l` is
:math:`A_l\otimes(B_l x)^\top = (I_{d_y}\otimes x^\top)(A_l\otimes B_l^\top)`, hence

.. math::

    H_{\mathrm{GN}} = \Gamma^\top(I_{d_y}\otimes\hat\Sigma)\Gamma,\quad
    \Gamma = [A_1\otimes B_1^\top,\dots,A_L\otimes B_L^\top],\qquad
    H_{\mathrm{GN}}^{\mathrm{red}} = \sum_{l=1}^L A_lA_l^\top\otimes \hat\Sigma^{1/2}B_l^\top B_l\hat\Sigma^{1/2},

and :math:`H_{\mathrm{GN}}` (``p x p``) and :math:`H_{\mathrm{GN}}^{\mathrm{red}}` (``d_y d x d_y d``) have the same
nonzero eigenvalues. Three routes compute them: :func:`gn_dense` (torch.func, the reference),
:func:`gn_reduced` / :func:`reduced_factor` (the reduced matrix, from QR-accumulated layer products, cost
:math:`O(L m^2 (d + d_y) + (d_y d)^3)`), and :func:`leaky_relu_gram` (the ``n d_y x n d_y`` Gram form).

**Conditioning.** :math:`\kappa = \lambda_{\max}/\lambda_r` at the rank :math:`r = q(d+d_y-q)`,
:math:`q=\min(d,d_y,m_1,\dots,m_{L-1})` (:func:`rank_gn`); :func:`condition` always reports the numerical rank
and the spectral gap :math:`\lambda_r/\lambda_{r+1}` at the cut as well. All spectral work is float64.

**Bounds** (:func:`kappa_bound`) use :math:`\sigma_{d_y}(A_l)` and :math:`\sigma_d(B_l)` — zero when a width is
below :math:`d_y` or :math:`d` — never the smallest *nonzero* singular value; the ``"pseudo"`` kind does the latter
and is kept only as the wrong bound the chapters reject.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from . import config, linalg
from ._validate import (as_tensor, check_choice, check_finite, check_int, check_int_sequence, check_matrix,
                        check_nonnegative, check_positive)
from .linalg import _psd_sqrt, default_rtol, kron, lanczos_extremes_operator
from ._validate import cast_like

__all__ = [
    "init_weights",
    "effective_weights",
    "forward",
    "theta_of",
    "weights_of",
    "flat_model",
    "rank_gn",
    "layer_factors",
    "gamma_matrix",
    "gn_dense",
    "gn_reduced",
    "gn_reduced_naive",
    "reduced_factor",
    "spectrum_reduced",
    "Condition",
    "condition",
    "gn_condition",
    "gn_kappa",
    "conditioning_frame",
    "nested_networks",
    "bound_terms",
    "kappa_bound",
    "mp_kappa",
    "mp_kappa_two_layer",
    "lyapunov_exponents",
    "depth_slope",
    "residual_weyl_bound",
    "leaky_relu",
    "leaky_forward",
    "leaky_flat_model",
    "leaky_relu_gram",
    "leaky_relu_bound",
    "linear_units",
    "leaky_relu_rank",
    "magnitude_masks",
    "gn_reduced_masked",
    "second_moment",
    "whiten",
    "batchnorm_gains",
    "bn_train_model",
    "train_gd",
    "min_loss",
    "digits",
]


# ============================================================================================ validation
def _check_weights(Ws, name: str = "Ws") -> list[torch.Tensor]:
    """A non-empty chain of finite real matrices with common batch dims and matching widths."""
    if isinstance(Ws, torch.Tensor) or not isinstance(Ws, Sequence) or len(Ws) == 0:
        raise TypeError(f"{name} must be a non-empty list of weight matrices [W_1, ..., W_L], got {type(Ws).__name__}")
    out = []
    for i, W in enumerate(Ws):
        W = check_matrix(f"{name}[{i}] (W_{i + 1})", W, batch=True)
        if not W.is_floating_point():
            W = W.to(torch.get_default_dtype())
        out.append(W)
    batch = out[0].shape[:-2]
    for i, W in enumerate(out):
        if W.shape[:-2] != batch:
            raise ValueError(f"{name}: every W_l must have the same batch dimensions {tuple(batch)}, "
                             f"W_{i + 1} has {tuple(W.shape[:-2])}")
        if W.dtype != out[0].dtype or W.device != out[0].device:
            raise ValueError(f"{name}: every W_l must share one dtype and device")
        if i > 0 and W.shape[-1] != out[i - 1].shape[-2]:
            raise ValueError(f"{name}: incompatible widths: W_{i + 1} has shape {tuple(W.shape[-2:])} but W_{i} "
                             f"outputs m_{i} = {out[i - 1].shape[-2]}")
    return out


def _dims(Ws: list[torch.Tensor]) -> tuple[int, list[int], int]:
    """(d, hidden widths [m_1..m_{L-1}], d_y)."""
    return Ws[0].shape[-1], [W.shape[-2] for W in Ws[:-1]], Ws[-1].shape[-2]


def _check_skip(skip_scale, Ws: list[torch.Tensor]) -> float:
    zeta = check_nonnegative("skip_scale", skip_scale)
    if zeta != 0:
        for l in range(2, len(Ws)):
            W = Ws[l - 1]
            if W.shape[-1] != W.shape[-2]:
                raise ValueError(f"skip_scale > 0 needs square hidden layers W_2..W_(L-1); W_{l} has shape "
                                 f"{tuple(W.shape[-2:])}")
    return zeta


def _check_gains(gains, Ws: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """One gain vector (or None) per hidden layer 1..L-1; the output layer has no gain."""
    L = len(Ws)
    if gains is None:
        return [None] * L
    if isinstance(gains, torch.Tensor) or not isinstance(gains, Sequence) or len(gains) != L - 1:
        raise TypeError(f"gains must be a list of L-1 = {L - 1} vectors (one per hidden layer) or None")
    out: list[torch.Tensor | None] = []
    for l, g in enumerate(gains, start=1):
        if g is None:
            out.append(None)
            continue
        g = check_finite(f"gains[{l - 1}]", as_tensor(f"gains[{l - 1}]", g, dtype=Ws[0].dtype, device=Ws[0].device))
        if g.shape[-1:] != Ws[l - 1].shape[-2:-1]:
            raise ValueError(f"gains[{l - 1}] must have last dimension m_{l} = {Ws[l - 1].shape[-2]}, "
                             f"got shape {tuple(g.shape)}")
        out.append(g)
    return out + [None]


def _sigma_root(Sigma_hat, d: int, like: torch.Tensor) -> torch.Tensor | None:
    if Sigma_hat is None:
        return None
    S = check_matrix("Sigma_hat", Sigma_hat, square=True, batch=True)
    if S.shape[-1] != d:
        raise ValueError(f"Sigma_hat must be d x d = {d} x {d} (the input dimension of W_1), got {tuple(S.shape)}")
    return config.spectral(_psd_sqrt("Sigma_hat", config.spectral(S))).to(like.device)


def _sigma_extremes(Sigma_hat, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lambda_max, lambda_min) of Sigma_hat; ValueError if it is singular (a bound needs full rank)."""
    S = config.spectral(check_matrix("Sigma_hat", Sigma_hat, square=True, batch=True))
    if S.shape[-1] != d:
        raise ValueError(f"Sigma_hat must be d x d = {d} x {d}, got {tuple(S.shape)}")
    lam = torch.linalg.eigvalsh(0.5 * (S + S.transpose(-2, -1)))
    lmax, lmin = lam[..., -1], lam[..., 0]
    if bool((lmin <= default_rtol(d) * lmax).any()):
        raise ValueError(f"Sigma_hat is singular (lambda_min = {float(lmin.min()):.3g} <= rtol * lambda_max): this "
                         "bound needs a full-rank Sigma_hat; drop zero-variance features or project onto the "
                         "numerical rank first (deep_linear.whiten(..., project=True))")
    return lmax, lmin


# ============================================================================================ networks
def init_weights(d: int, widths: Sequence[int], d_y: int, *, scheme: str = "lecun", scale: float = 1.0,
                 batch: Sequence[int] = (), generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float64, device=None) -> list[torch.Tensor]:
    r"""Random weights :math:`W_l\in\mathbb R^{m_l\times m_{l-1}}` for widths ``[m_1, ..., m_{L-1}]``.

    ``scheme``: ``"lecun"`` (entries :math:`\mathcal N(0, \text{scale}^2/m_{l-1})`, i.e. Kaiming-normal for a
    linear network), ``"kaiming"`` (:math:`\mathcal N(0, 2\,\text{scale}^2/m_{l-1})`, the ReLU gain) or
    ``"orthogonal"`` (Haar semi-orthogonal, times ``scale``). ``batch`` prepends batch dimensions (one network per
    seed). Chapter 31 uses a small ``scale`` with residual networks.
    """
    d, d_y = check_int("d", d, min_value=1), check_int("d_y", d_y, min_value=1)
    widths = check_int_sequence("widths", widths, min_value=1)
    scheme = check_choice("scheme", scheme, ("lecun", "kaiming", "orthogonal"))
    scale = check_positive("scale", scale)
    linalg._check_float_dtype("dtype", dtype)
    batch = tuple(check_int_sequence("batch", batch, min_value=1))
    dims = [d, *widths, d_y]
    Ws = []
    for fan_in, fan_out in zip(dims[:-1], dims[1:]):
        G = torch.randn(*batch, fan_out, fan_in, generator=generator, dtype=dtype)
        if scheme == "orthogonal":
            tall = fan_out >= fan_in
            Q, R = torch.linalg.qr(G if tall else G.transpose(-2, -1))
            Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)
            W = scale * (Q if tall else Q.transpose(-2, -1))
        else:
            gain = 2.0 if scheme == "kaiming" else 1.0
            W = G * (scale * math.sqrt(gain / fan_in))
        Ws.append(W.to(device) if device is not None else W)
    return Ws


def effective_weights(Ws, skip_scale: float = 0.0, gains=None) -> list[torch.Tensor]:
    r"""The layers the network applies: :math:`\tilde W_l = \operatorname{diag}(g_l)(\zeta I + W_l)`.

    The skip term :math:`\zeta I` is added to the hidden layers :math:`2\le l\le L-1` only (they must be square);
    the gain :math:`g_l` (hidden layers only) defaults to 1.
    """
    Ws = _check_weights(Ws)
    zeta, gs = _check_skip(skip_scale, Ws), _check_gains(gains, Ws)
    out = []
    for l, (W, g) in enumerate(zip(Ws, gs), start=1):
        if zeta != 0 and 2 <= l <= len(Ws) - 1:
            W = W + zeta * torch.eye(W.shape[-1], dtype=W.dtype, device=W.device)
        out.append(W if g is None else g.unsqueeze(-1) * W)
    return out


def forward(Ws, X, skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""Outputs :math:`f(X) = X\tilde W_1^\top\cdots\tilde W_L^\top`, shape ``(..., n, d_y)``; ``X: (..., n, d)``."""
    E = effective_weights(Ws, skip_scale, gains)
    X = check_matrix("X", X, batch=True, dtype=E[0].dtype, device=E[0].device)
    if X.shape[-1] != E[0].shape[-1]:
        raise ValueError(f"X must have d = {E[0].shape[-1]} columns, got shape {tuple(X.shape)}")
    H = X
    for W in E:
        H = H @ W.transpose(-2, -1)
    return H


def theta_of(Ws) -> torch.Tensor:
    r""":math:`\theta = [\operatorname{vec}W_1;\dots;\operatorname{vec}W_L]` (row-major), shape ``(..., p)``."""
    Ws = _check_weights(Ws)
    return torch.cat([W.reshape(*W.shape[:-2], -1) for W in Ws], dim=-1)


def weights_of(theta, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Inverse of :func:`theta_of`: the list of ``(m_l, m_{l-1})`` matrices (views) of a flat ``theta``."""
    theta = check_finite("theta", as_tensor("theta", theta))
    shapes = _check_shapes(shapes)
    if theta.dim() < 1:
        raise ValueError(f"theta must be a flat parameter vector (..., p), got shape {tuple(theta.shape)}")
    sizes = [a * b for a, b in shapes]
    if theta.shape[-1] != sum(sizes):
        raise ValueError(f"theta must have last dimension p = {sum(sizes)} for shapes {list(shapes)}, "
                         f"got {tuple(theta.shape)}")
    parts = theta.split(sizes, dim=-1)
    return [t.reshape(*t.shape[:-1], a, b) for t, (a, b) in zip(parts, shapes)]


def _check_shapes(shapes) -> list[tuple[int, int]]:
    """A non-empty list of layer shapes ``(m_l, m_{l-1})`` of positive integers."""
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or len(shapes) == 0:
        raise TypeError(f"shapes must be a non-empty list of layer shapes (m_l, m_(l-1)), got {shapes!r}")
    out = []
    for i, sh in enumerate(shapes):
        if isinstance(sh, (str, bytes)) or not isinstance(sh, Sequence) or len(sh) != 2:
            raise TypeError(f"shapes[{i}] must be a pair (m_l, m_(l-1)), got {sh!r}")
        out.append(tuple(check_int(f"shapes[{i}]", v, min_value=1) for v in sh))
    return out


def flat_model(X, shapes: Sequence[tuple[int, int]], skip_scale: float = 0.0,
               gains=None) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""``fn(theta) = vec f(X)`` (row-major, sample by sample) for :mod:`curvlab.curvature` (the dense route)."""
    X = check_matrix("X", X)

    def fn(theta: torch.Tensor) -> torch.Tensor:
        return forward(weights_of(theta, shapes), cast_like("X", X, theta, "theta"), skip_scale, gains).reshape(-1)

    return fn


# ============================================================================================ rank and GN
def rank_gn(d: int, widths: Sequence[int], d_y: int) -> int:
    r"""Rank of the GN matrix of a deep linear network (full-rank :math:`\hat\Sigma`, generic weights):
    :math:`q(d + d_y - q)`, :math:`q = \min(d, d_y, m_1, \dots, m_{L-1})` (Singh et al. 2021; chapter 30)."""
    d, d_y = check_int("d", d, min_value=1), check_int("d_y", d_y, min_value=1)
    q = min([d, d_y, *check_int_sequence("widths", widths, min_value=1)])
    return q * (d + d_y - q)


def layer_factors(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None) -> tuple[list, list]:
    r"""Square-root factors :math:`a_l, b_l` with :math:`a_la_l^\top = A_lA_l^\top` and
    :math:`b_lb_l^\top = \hat\Sigma^{1/2}B_l^\top B_l\hat\Sigma^{1/2}`, from QR-accumulated products.

    The products :math:`\tilde W_{l-1:1}\hat\Sigma^{1/2}` and :math:`\tilde W_{L:l+1}^\top` are carried as
    :math:`QR` with :math:`R` triangular and multiplied one layer at a time (the Lyapunov-exponent algorithm), so
    small singular values keep their relative accuracy at large depth. ``a_l: (..., d_y, r)``,
    ``b_l: (..., d, r')``, float64. Cost :math:`O(L m^2 (d + d_y))`.
    """
    Ws = _check_weights(Ws)
    E = [config.spectral(W) for W in effective_weights(Ws, skip_scale, gains)]
    gs = _check_gains(gains, Ws)
    L, (d, _, d_y) = len(E), _dims(Ws)
    batch, dev = E[0].shape[:-2], E[0].device
    eye = lambda k: torch.eye(k, dtype=torch.float64, device=dev).expand(*batch, k, k)
    S = _sigma_root(Sigma_hat, d, E[0])
    # input side: B_l S = Q R, b_l = R^T
    Q, R = eye(d), (eye(d) if S is None else S.expand(*batch, d, d))
    b = [R.transpose(-2, -1)]
    for l in range(1, L):
        Q, R1 = torch.linalg.qr(E[l - 1] @ Q)
        R = R1 @ R
        b.append(R.transpose(-2, -1))
    # output side: P_l^T = Q R with P_l = W~_{L:l+1}; A_l^T = diag(g_l) P_l^T, a_l = (R'' R)^T
    Q, R = eye(d_y), eye(d_y)
    a = [None] * L
    a[L - 1] = R.transpose(-2, -1)
    for l in range(L - 1, 0, -1):
        # (Q^T W)^T, not W^T Q: a transposed m x m operand sends torch's CPU matmul down a path 4-30x slower
        Q, R1 = torch.linalg.qr((Q.transpose(-2, -1) @ E[l]).transpose(-2, -1))
        R = R1 @ R
        g = gs[l - 1]
        if g is None:
            a[l - 1] = R.transpose(-2, -1)
        else:
            R2 = torch.linalg.qr(config.spectral(g).unsqueeze(-1) * Q, mode="r")[1]
            a[l - 1] = (R2 @ R).transpose(-2, -1)
    return a, b


def gamma_matrix(Ws, skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""The stacked weight factor :math:`\Gamma = [A_1\otimes B_1^\top,\dots,A_L\otimes B_L^\top]`
    (``d_y d x p``), with :math:`H_{\mathrm{GN}} = \Gamma^\top(I_{d_y}\otimes\hat\Sigma)\Gamma` (chapter 30).
    Unbatched; float64; memory :math:`O(d_y d\,p)`."""
    Ws = _check_weights(Ws)
    if Ws[0].dim() != 2:
        raise ValueError("gamma_matrix takes one network (no batch dimensions)")
    E = [config.spectral(W) for W in effective_weights(Ws, skip_scale, gains)]
    gs = _check_gains(gains, Ws)
    L, (d, _, d_y) = len(E), _dims(Ws)
    blocks = []
    for l in range(1, L + 1):
        A = torch.eye(d_y, dtype=torch.float64, device=E[0].device)
        for W in reversed(E[l:]):
            A = A @ W
        if gs[l - 1] is not None:
            A = A * config.spectral(gs[l - 1]).unsqueeze(-2)
        B = torch.eye(d, dtype=torch.float64, device=E[0].device)
        for W in E[: l - 1]:
            B = W @ B
        blocks.append(kron(A, B.transpose(-2, -1)))
    return torch.cat(blocks, dim=-1)


def gn_dense(Ws, X, skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""Dense :math:`H_{\mathrm{GN}} = J^\top J/n` (``p x p``) by ``torch.func`` (:func:`curvlab.curvature.gn_matrix`):
    the reference the structured routes are tested against. Unbatched; float64."""
    from .curvature import gn_matrix

    Ws = _check_weights(Ws)
    X = config.spectral(check_matrix("X", X))
    fn = flat_model(X, [tuple(W.shape[-2:]) for W in Ws], skip_scale, gains)
    return gn_matrix(fn, config.spectral(theta_of(Ws)), scale=1.0 / X.shape[0])


def gn_reduced(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""The reduced matrix :math:`H_{\mathrm{GN}}^{\mathrm{red}} = \sum_l A_lA_l^\top\otimes
    \hat\Sigma^{1/2}B_l^\top B_l\hat\Sigma^{1/2}` (``(..., d_y d, d_y d)``, float64), same nonzero spectrum as
    :math:`H_{\mathrm{GN}}`; ``Sigma_hat=None`` means :math:`\hat\Sigma = I` (whitened inputs). Chapter 30."""
    a, b = layer_factors(Ws, Sigma_hat, skip_scale, gains)
    return sum(kron(al @ al.transpose(-2, -1), bl @ bl.transpose(-2, -1)) for al, bl in zip(a, b))


def gn_reduced_naive(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""The same :math:`H_{\mathrm{GN}}^{\mathrm{red}}` from plainly multiplied products
    :math:`W_{L:l+1}`, :math:`W_{l-1:1}` (the formula as written; less accurate at large depth). Batched."""
    Ws = _check_weights(Ws)
    E = [config.spectral(W) for W in effective_weights(Ws, skip_scale, gains)]
    gs = _check_gains(gains, Ws)
    L, (d, _, d_y) = len(E), _dims(Ws)
    batch, dev = E[0].shape[:-2], E[0].device
    S = _sigma_root(Sigma_hat, d, E[0])
    H = 0
    for l in range(1, L + 1):
        A = torch.eye(d_y, dtype=torch.float64, device=dev).expand(*batch, d_y, d_y)
        for W in reversed(E[l:]):
            A = A @ W
        if gs[l - 1] is not None:
            A = A * config.spectral(gs[l - 1]).unsqueeze(-2)
        B = torch.eye(d, dtype=torch.float64, device=dev).expand(*batch, d, d)
        for W in E[: l - 1]:
            B = W @ B
        BB = B.transpose(-2, -1) @ B
        if S is not None:
            BB = S @ BB @ S
        H = H + kron(A @ A.transpose(-2, -1), BB)
    return H


def reduced_factor(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""A factor :math:`F = [a_1\otimes b_1,\dots,a_L\otimes b_L]` with :math:`FF^\top = H_{\mathrm{GN}}^{\mathrm{red}}`
    (``(..., d_y d, c)``). Its singular values squared are the eigenvalues of the reduced matrix, accurate to
    :math:`\varepsilon\,\sigma_{\max}(F)`, so condition numbers up to about :math:`10^{25}` survive (chapter 31)."""
    a, b = layer_factors(Ws, Sigma_hat, skip_scale, gains)
    return torch.cat([kron(al, bl) for al, bl in zip(a, b)], dim=-1)


def _kronecker_sum_spectrum(Ws) -> torch.Tensor:
    r"""Two layers on whitened inputs: :math:`H_{\mathrm{GN}}^{\mathrm{red}} = W_2W_2^\top\otimes I_d + I_{d_y}\otimes
    W_1^\top W_1` is a Kronecker sum, so its eigenvalues are all sums :math:`\lambda_i(W_2W_2^\top) +
    \lambda_j(W_1^\top W_1)` (chapter 30): two small eigenproblems instead of one of size :math:`d_yd`.
    Decreasing, ``(..., d_y d)``, float64. (A skip term does not enter: two layers have no hidden-to-hidden layer.)"""
    W1, W2 = (config.spectral(W) for W in _check_weights(Ws))
    a = torch.linalg.eigvalsh(W2 @ W2.transpose(-2, -1))                  # (..., d_y)
    b = torch.linalg.eigvalsh(W1.transpose(-2, -1) @ W1)                  # (..., d)
    return (a.unsqueeze(-1) + b.unsqueeze(-2)).flatten(-2).sort(dim=-1, descending=True).values


def spectrum_reduced(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None, *, method: str = "eigh") -> torch.Tensor:
    r"""Eigenvalues of :math:`H_{\mathrm{GN}}^{\mathrm{red}}` in decreasing order, ``(..., d_y d)``, float64.

    ``method="eigh"``: ``eigvalsh`` of the reduced matrix (absolute error :math:`\approx\varepsilon\lambda_{\max}`),
    or, for two layers on whitened inputs without gains, the Kronecker-sum closed form of chapter 30 (eigenvalues
    :math:`\lambda_i(W_2W_2^\top) + \lambda_j(W_1^\top W_1)`);
    ``method="svd"``: squared singular values of :func:`reduced_factor` (relative accuracy of
    :math:`\lambda_{\min}` about :math:`\varepsilon\sqrt\kappa`), for very deep or ill-conditioned networks.
    """
    method = check_choice("method", method, ("eigh", "svd"))
    if method == "eigh":
        if Sigma_hat is None and gains is None and len(_check_weights(Ws)) == 2:
            _check_skip(skip_scale, _check_weights(Ws))                  # validated, though two layers have no skip
            return _kronecker_sum_spectrum(Ws)
        H = gn_reduced(Ws, Sigma_hat, skip_scale, gains)
        return torch.linalg.eigvalsh(H).flip(-1)
    F = reduced_factor(Ws, Sigma_hat, skip_scale, gains)
    s = torch.linalg.svdvals(F)
    N = F.shape[-2]
    if s.shape[-1] < N:
        s = torch.cat([s, s.new_zeros(*s.shape[:-1], N - s.shape[-1])], dim=-1)
    return s.square()


class Condition(NamedTuple):
    r"""Batched condition numbers at rank :math:`r`: ``kappa`` :math:`=\lambda_1/\lambda_r`, ``gap``
    :math:`=\lambda_r/\lambda_{r+1}` (inf when nothing is cut), the ``numerical_rank`` at ``rtol``, and the
    extreme kept eigenvalues. Tensors with the batch shape (``rank`` and ``rtol`` are numbers)."""

    kappa: torch.Tensor
    gap: torch.Tensor
    numerical_rank: torch.Tensor
    lambda_max: torch.Tensor
    lambda_min_nonzero: torch.Tensor
    rank: int
    rtol: float


def condition(eigenvalues, rank: int | None = None, rtol: float | None = None) -> Condition:
    r"""Condition number over the nonzero spectrum of (a batch of) PSD spectra, eigenvalues in the last dimension.

    ``rank`` forces the cut (e.g. :func:`rank_gn`); by default the numerical rank
    :math:`\#\{\lambda_i>\mathrm{rtol}\,\lambda_1\}`, ``rtol`` :math:`= N\varepsilon` (the notation page). The
    numerical rank and the gap at the cut are always returned. ValueError if a kept eigenvalue is :math:`\le 0`
    (use ``method="svd"`` in :func:`spectrum_reduced` for extreme condition numbers).
    """
    lam = config.spectral(check_finite("eigenvalues", as_tensor("eigenvalues", eigenvalues)))
    if lam.dim() < 1 or lam.shape[-1] == 0:
        raise ValueError("eigenvalues must have a non-empty last dimension")
    lam = lam.sort(dim=-1, descending=True).values
    N = lam.shape[-1]
    rtol = default_rtol(N) if rtol is None else check_nonnegative("rtol", rtol)
    if bool((lam[..., 0] <= 0).any()):
        raise ValueError("eigenvalues: every spectrum needs a positive largest eigenvalue")
    num = (lam > rtol * lam[..., :1]).sum(dim=-1)
    if rank is None:
        if bool((num != num.reshape(-1)[0]).any()):
            raise ValueError("the numerical ranks differ across the batch; pass rank= explicitly")
        r = int(num.reshape(-1)[0])
    else:
        r = check_int("rank", rank, min_value=1)
        if r > N:
            raise ValueError(f"rank must be <= {N}, got {r}")
    lam_r = lam[..., r - 1]
    if bool((lam_r <= 0).any()):
        raise ValueError(f"rank={r}: lambda_{r} <= 0 in floating point; the spectrum is too ill-conditioned for "
                         "eigvalsh (use spectrum_reduced(..., method='svd')) or the rank is wrong")
    nxt = lam[..., r] if r < N else torch.zeros_like(lam_r)
    gap = torch.where(nxt > 0, lam_r / nxt.clamp_min(torch.finfo(lam.dtype).tiny), torch.full_like(lam_r, math.inf))
    return Condition(lam[..., 0] / lam_r, gap, num, lam[..., 0], lam_r, r, rtol)


def gn_condition(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None, *, method: str = "eigh",
                 rank: int | None = None) -> Condition:
    r""":math:`\kappa(H_{\mathrm{GN}})` of deep linear networks through the reduced matrix, at the theoretical rank
    :math:`q(s + d_y - q)` (:math:`s` = numerical rank of :math:`\hat\Sigma`, :math:`d` when it is None) unless
    ``rank`` is given; the numerical rank and the gap are reported alongside (chapters 30–31)."""
    Ws = _check_weights(Ws)
    d, widths, d_y = _dims(Ws)
    if rank is None:
        s = d
        if Sigma_hat is not None:
            S = check_matrix("Sigma_hat", Sigma_hat, square=True, batch=True)
            if S.shape[-1] != d:
                raise ValueError(f"Sigma_hat must be d x d = {d} x {d} (the input dimension of W_1), got "
                                 f"{tuple(S.shape)}")
            lam = linalg._psd_eigh("Sigma_hat", S)[1]
            s = int((lam > default_rtol(d) * lam[..., -1:]).sum(dim=-1).min())
        rank = rank_gn(s, widths, d_y)
    return condition(spectrum_reduced(Ws, Sigma_hat, skip_scale, gains, method=method), rank=rank)


def gn_kappa(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None, *, rtol: float = 1e-10) -> torch.Tensor:
    r"""Only :math:`\kappa(H_{\mathrm{GN}})` (batched), for large :math:`d_yd`: when the theoretical rank equals
    :math:`d_yd` (no bottleneck, full-rank :math:`\hat\Sigma`) the reduced matrix is nonsingular, and Lanczos
    (:func:`curvlab.linalg.lanczos_extremes_operator`) finds its two extreme eigenvalues to relative residual
    ``rtol`` from the Kronecker-sum product :math:`V\mapsto\sum_l (a_la_l^\top)V(b_lb_l^\top)` — the
    :math:`d_yd\times d_yd` matrix is never formed, so the cost per step is :math:`O(L\,d_yd(d_y+d))` instead of
    :math:`O((d_yd)^2)`, and no :math:`O((d_yd)^3)` eigendecomposition is needed. Otherwise, or if Lanczos does not
    converge within :math:`d_yd` steps, it falls back to :func:`gn_condition`. Worth it from
    :math:`d_yd` of a few thousand (MNIST's 7840); below that, eigvalsh of the formed matrix is as fast
    (chapter 31's benchmark)."""
    Ws = _check_weights(Ws)
    d, widths, d_y = _dims(Ws)
    full = rank_gn(d, widths, d_y) == d * d_y
    if full and Sigma_hat is not None:
        lam = torch.linalg.eigvalsh(config.spectral(check_matrix("Sigma_hat", Sigma_hat, batch=True)))
        full = bool((lam[..., 0] > default_rtol(d) * lam[..., -1]).all())
    if full:
        a, b = layer_factors(Ws, Sigma_hat, skip_scale, gains)
        M = [al @ al.transpose(-2, -1) for al in a]
        N = [bl @ bl.transpose(-2, -1) for bl in b]
        batch = M[0].shape[:-2]

        def matvec(q: torch.Tensor) -> torch.Tensor:
            V = q.reshape(*batch, d_y, d)
            return sum(Ml @ V @ Nl for Ml, Nl in zip(M, N)).reshape(*batch, d_y * d, 1)

        scale = sum(torch.linalg.matrix_norm(Ml) * torch.linalg.matrix_norm(Nl) for Ml, Nl in zip(M, N))
        res = lanczos_extremes_operator(matvec, d_y * d, M[0], batch=batch, scale=scale, rtol=rtol)
        if res.converged and bool((res.lambda_min > 0).all()):
            return res.lambda_max / res.lambda_min
    return gn_condition(Ws, Sigma_hat, skip_scale, gains).kappa


def conditioning_frame(Ws, Sigma_hat=None, *, skip_scale: float = 0.0, gains=None,
                       bounds: Sequence[str] = ("ratio", "loose"), method: str = "eigh", **labels):
    r"""A tidy frame, one row per network of the batch: ``labels``, ``seed`` (batch index), ``kappa`` (at the
    theoretical rank), ``numerical_rank``, ``gap``, each bound in ``bounds`` (:func:`kappa_bound` kinds) and its
    tightness ``<kind>/kappa`` (chapter 31). Unbatched weights give one row."""
    import pandas as pd

    Ws = _check_weights(Ws)
    c = gn_condition(Ws, Sigma_hat, skip_scale, gains, method=method)
    cols = {"kappa": c.kappa, "numerical_rank": c.numerical_rank.to(torch.float64), "gap": c.gap}
    for kind in bounds:
        b = kappa_bound(Ws, Sigma_hat, kind=kind, skip_scale=skip_scale, gains=gains)
        cols[kind], cols[f"{kind}/kappa"] = b, b / c.kappa
    flat = {k: v.reshape(-1).cpu().numpy() for k, v in cols.items()}
    frame = pd.DataFrame({"seed": range(len(flat["kappa"])), **flat})
    frame["numerical_rank"] = frame["numerical_rank"].astype(int)
    for key, value in reversed(list(labels.items())):
        frame.insert(0, key, value)
    return frame


def nested_networks(d: int, m: int, d_y: int, depths: Sequence[int], *, batch: Sequence[int] = (),
                    generator: torch.Generator | None = None) -> dict[int, list[torch.Tensor]]:
    r"""Networks of several depths that share their layers (chapter 31): one input layer :math:`W_1` (``m x d``),
    one output layer (``d_y x m``) and the first :math:`L-2` of a common stack of ``m x m`` hidden layers, all
    LeCun-initialised. Nesting makes :math:`\log\kappa(L)` of one seed a path in :math:`L`, so slopes in depth
    are estimated with far less noise than from independent networks."""
    depths = check_int_sequence("depths", depths, min_value=2)
    if not depths:
        raise ValueError("depths must name at least one depth L >= 2")
    W_in, W_out = init_weights(d, [m], d_y, batch=batch, generator=generator)
    mids = init_weights(m, [m] * (max(depths) - 3), m, batch=batch, generator=generator) if max(depths) > 2 else []
    return {L: [W_in, *mids[: L - 2], W_out] for L in depths}


# ============================================================================================ bounds
def _svals(M: torch.Tensor, k: int) -> torch.Tensor:
    """Singular values padded with zeros to length k (sigma_j := 0 for j > min(shape))."""
    s = torch.linalg.svdvals(M)
    if s.shape[-1] < k:
        s = torch.cat([s, s.new_zeros(*s.shape[:-1], k - s.shape[-1])], dim=-1)
    return s[..., :k]


def _pseudo_min(s: torch.Tensor, size: int) -> torch.Tensor:
    """Smallest singular value above rtol * sigma_1 (the 'smallest nonzero' one), rtol = size * eps."""
    keep = s > default_rtol(size) * s[..., :1]
    return torch.where(keep, s, torch.full_like(s, math.inf)).amin(dim=-1)


def bound_terms(Ws, Sigma_hat=None, skip_scale: float = 0.0, gains=None) -> dict[str, torch.Tensor]:
    r"""Per-layer singular values the bounds use, each ``(..., L)``, float64 (chapter 30):

    ``out_max``, ``out_min``, ``out_pmin``: :math:`\sigma_1`, :math:`\sigma_{d_y}` and the smallest nonzero singular
    value of :math:`A_l = \tilde W_{L:l+1}\operatorname{diag}(g_l)`; ``in_max``, ``in_min``, ``in_pmin``: the same
    (:math:`\sigma_1`, :math:`\sigma_d`, smallest nonzero) for :math:`B_l\hat\Sigma^{1/2}` (:math:`B_l` when
    ``Sigma_hat`` is None). :math:`\sigma_{d_y}` and :math:`\sigma_d` are zero when a width is below
    :math:`d_y` or :math:`d`.
    """
    Ws = _check_weights(Ws)
    d, _, d_y = _dims(Ws)
    a, b = layer_factors(Ws, Sigma_hat, skip_scale, gains)
    sa = [_svals(al, d_y) for al in a]
    sb = [_svals(bl, d) for bl in b]
    st = lambda xs: torch.stack(xs, dim=-1)
    return {
        "out_max": st([s[..., 0] for s in sa]), "out_min": st([s[..., -1] for s in sa]),
        "out_pmin": st([_pseudo_min(s, max(d_y, 1)) for s in sa]),
        "in_max": st([s[..., 0] for s in sb]), "in_min": st([s[..., -1] for s in sb]),
        "in_pmin": st([_pseudo_min(s, max(d, 1)) for s in sb]),
    }


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(num.dtype).tiny), torch.full_like(num, math.inf))


def kappa_bound(Ws, Sigma_hat=None, *, kind: str = "ratio", skip_scale: float = 0.0, gains=None) -> torch.Tensor:
    r"""Upper bounds on :math:`\kappa(H_{\mathrm{GN}})` of a deep linear network, batched (chapter 30).

    With :math:`\bar s_l = \sigma_1(A_l)\sigma_1(B_l)`, :math:`\underline s_l = \sigma_{d_y}(A_l)\sigma_d(B_l)`:

    * ``"ratio"`` — Zhao et al.'s L-layer bound in ratio-of-sums form,
      :math:`\kappa(\hat\Sigma)\sum_l\bar s_l^2/\sum_l\underline s_l^2` (inf when the denominator is 0);
    * ``"sigma_inside"`` — the same with :math:`\hat\Sigma^{1/2}` kept inside, :math:`B_l\to B_l\hat\Sigma^{1/2}`,
      no :math:`\kappa(\hat\Sigma)` factor (for :math:`L = 2` this is Lemma 1; never larger than ``"ratio"``);
    * ``"convex"`` — :math:`\kappa(\hat\Sigma)\sum_l\omega_l\kappa^2(A_l)\kappa^2(B_l)`,
      :math:`\omega_l\propto\underline s_l^2`; equal to ``"ratio"``, and undefined (ValueError, :math:`0\cdot\infty`)
      when some :math:`\underline s_l = 0` — a width below :math:`d_y` or :math:`d`;
    * ``"loose"`` — :math:`\kappa(\hat\Sigma)\max_l\kappa^2(A_l)\kappa^2(B_l)` (inf when some
      :math:`\underline s_l = 0`);
    * ``"pseudo"`` — ``"ratio"`` with the smallest *nonzero* singular values: **not a bound** (it fails when a
      width is below :math:`d`); kept as the foil.

    ``Sigma_hat=None`` means :math:`\hat\Sigma = I`; otherwise it must be nonsingular for every kind except
    ``"sigma_inside"`` (ValueError).
    """
    kind = check_choice("kind", kind, ("ratio", "sigma_inside", "convex", "loose", "pseudo"))
    Ws = _check_weights(Ws)
    d = Ws[0].shape[-1]
    if kind == "sigma_inside":
        t = bound_terms(Ws, Sigma_hat, skip_scale, gains)
        num = (t["out_max"] * t["in_max"]).square().sum(-1)
        return _ratio(num, (t["out_min"] * t["in_min"]).square().sum(-1))
    k_sigma = torch.ones((), dtype=torch.float64)
    if Sigma_hat is not None:
        lmax, lmin = _sigma_extremes(Sigma_hat, d)
        k_sigma = lmax / lmin
    t = bound_terms(Ws, None, skip_scale, gains)
    hi = (t["out_max"] * t["in_max"]).square()
    lo_key = ("out_pmin", "in_pmin") if kind == "pseudo" else ("out_min", "in_min")
    lo = (t[lo_key[0]] * t[lo_key[1]]).square()
    k_sigma = k_sigma.to(hi.device)
    if kind in ("ratio", "pseudo"):
        return k_sigma * _ratio(hi.sum(-1), lo.sum(-1))
    if kind == "loose":
        return k_sigma * _ratio(hi, lo).amax(dim=-1)
    if bool((lo <= 0).any()):
        raise ValueError("kind='convex' is undefined (0 * inf) when a width is below d_y or d; use kind='ratio'")
    omega = lo / lo.sum(-1, keepdim=True)
    return k_sigma * (omega * hi / lo).sum(-1)


def mp_kappa(ratio) -> torch.Tensor:
    r"""Marchenko–Pastur limit of :math:`\kappa(W)` for a Gaussian :math:`W\in\mathbb R^{m\times d}`, ratio
    :math:`\min(d,m)/\max(d,m) < 1`: :math:`(1+\sqrt{r})/(1-\sqrt{r})` (chapter 30; see chapter 04)."""
    r = config.spectral(check_finite("ratio", as_tensor("ratio", ratio)))
    if bool(((r < 0) | (r >= 1)).any()):
        raise ValueError("ratio must lie in [0, 1)")
    return (1 + r.sqrt()) / (1 - r.sqrt())


def mp_kappa_two_layer(d: int, d_y: int, m: int) -> float:
    r"""Closed-form limit of :math:`\kappa(H_{\mathrm{GN}})` for :math:`f = VWx` on whitened data (:math:`\hat\Sigma=I`),
    LeCun initialisation (:math:`W` entries of variance :math:`1/d`, :math:`V` of variance :math:`1/m`), as
    :math:`d, d_y, m\to\infty` at fixed ratios with :math:`m > \max(d, d_y)` (chapter 30):

    .. math::

        \kappa \to \frac{(1+\sqrt{d_y/m})^2 + \tfrac md(1+\sqrt{d/m})^2}{(1-\sqrt{d_y/m})^2 + \tfrac md(1-\sqrt{d/m})^2}.
    """
    d, d_y, m = (check_int(n, v, min_value=1) for n, v in (("d", d), ("d_y", d_y), ("m", m)))
    if m <= max(d, d_y):
        raise ValueError(f"m must exceed max(d, d_y) = {max(d, d_y)}, got {m}")
    ry, rx = math.sqrt(d_y / m), math.sqrt(d / m)
    return ((1 + ry) ** 2 + m / d * (1 + rx) ** 2) / ((1 - ry) ** 2 + m / d * (1 - rx) ** 2)


def lyapunov_exponents(m: int, k: int) -> torch.Tensor:
    r"""Lyapunov exponents :math:`\nu_i = \tfrac12\,[\operatorname{digamma}(\tfrac{m-i+1}2) + \log\tfrac2m]`,
    :math:`i=1..k`, of products of :math:`m\times m` Gaussian matrices with entries of variance :math:`1/m` acting
    on a :math:`k`-frame (Bartlett decomposition: the :math:`i`-th diagonal entry of each QR factor is
    :math:`\chi_{m-i+1}/\sqrt m`; chapter 31). Float64, decreasing."""
    m, k = check_int("m", m, min_value=1), check_int("k", k, min_value=1)
    if k > m:
        raise ValueError(f"k must be <= m = {m}, got {k}")
    i = torch.arange(1, k + 1, dtype=torch.float64)
    return 0.5 * (torch.special.digamma((m - i + 1) / 2) + math.log(2 / m))


def depth_slope(m: int, d: int, d_y: int) -> float:
    r"""Asymptotic growth rate of :math:`\log\kappa(H_{\mathrm{GN}})` per layer for Gaussian deep linear networks of
    width :math:`m\ge\max(d,d_y)`: :math:`\xi = 2(\nu_1-\nu_q) = \operatorname{digamma}(\tfrac m2)
    - \operatorname{digamma}(\tfrac{m-q+1}2) \approx (q-1)/m`, :math:`q = \min(d, d_y)` (derived in chapter 31)."""
    m, d, d_y = check_int("m", m, min_value=1), check_int("d", d, min_value=1), check_int("d_y", d_y, min_value=1)
    if m < max(d, d_y):
        raise ValueError(f"m must be >= max(d, d_y) = {max(d, d_y)}, got {m}")
    mu = lyapunov_exponents(m, min(d, d_y))
    return float(2 * (mu[0] - mu[-1]))


def residual_weyl_bound(Ws, skip_scale: float, Sigma_hat=None) -> torch.Tensor:
    r"""A bound on :math:`\kappa(H_{\mathrm{GN}})` of a residual network from per-layer quantities only (chapter 31).

    Weyl: :math:`\zeta-\lVert W_j\rVert_2\le\sigma_i(\zeta I+W_j)\le\zeta+\lVert W_j\rVert_2`, so
    :math:`\sigma_1(A_l)\le\lVert W_L\rVert_2\prod_{j=l+1}^{L-1}(\zeta+\lVert W_j\rVert_2)`,
    :math:`\sigma_{d_y}(A_l)\ge\sigma_{d_y}(W_L)\prod_{j=l+1}^{L-1}(\zeta-\lVert W_j\rVert_2)_+` (and likewise on the
    input side with :math:`W_1`), plugged into the ratio-of-sums bound. No alignment assumption.
    """
    Ws = [config.spectral(W) for W in _check_weights(Ws)]
    zeta = _check_skip(skip_scale, Ws)
    L, (d, _, d_y) = len(Ws), _dims(Ws)
    norms = [torch.linalg.matrix_norm(W, ord=2) for W in Ws]
    up = [zeta + nrm for nrm in norms]
    dn = [(zeta - nrm).clamp_min(0.0) for nrm in norms]
    one = torch.ones_like(norms[0])
    sL, s1 = _svals(Ws[-1], d_y), _svals(Ws[0], d)
    hi, lo = [], []
    for l in range(1, L + 1):
        mid_out = range(l + 1, L)       # residual layers inside W_{L:l+1}, output layer excluded
        mid_in = range(2, l)            # residual layers inside W_{l-1:1}, input layer excluded
        o_hi = (sL[..., 0] if l < L else one) * math.prod((up[j - 1] for j in mid_out), start=one)
        o_lo = (sL[..., -1] if l < L else one) * math.prod((dn[j - 1] for j in mid_out), start=one)
        i_hi = (s1[..., 0] if l > 1 else one) * math.prod((up[j - 1] for j in mid_in), start=one)
        i_lo = (s1[..., -1] if l > 1 else one) * math.prod((dn[j - 1] for j in mid_in), start=one)
        hi.append((o_hi * i_hi).square())
        lo.append((o_lo * i_lo).square())
    k_sigma = one
    if Sigma_hat is not None:
        lmax, lmin = _sigma_extremes(Sigma_hat, d)
        k_sigma = (lmax / lmin).to(one.device)
    return k_sigma * _ratio(sum(hi), sum(lo))


# ============================================================================================ leaky ReLU
def leaky_relu(z, alpha: float) -> torch.Tensor:
    r""":math:`\phi(z) = \max(z, \alpha z)` for :math:`0\le\alpha\le 1` (chapter 32)."""
    alpha = check_nonnegative("alpha", alpha)
    if alpha > 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    z = check_finite("z", as_tensor("z", z))
    return torch.where(z > 0, z, alpha * z)


def _check_leaky(W, V, X, b, alpha):
    W = check_matrix("W", W)
    V = check_matrix("V", V, dtype=W.dtype, device=W.device)
    X = check_matrix("X", X, dtype=W.dtype, device=W.device)
    if X.shape[1] != W.shape[1]:
        raise ValueError(f"X must have d = {W.shape[1]} columns (W is {tuple(W.shape)}), got {tuple(X.shape)}")
    if V.shape[1] != W.shape[0]:
        raise ValueError(f"V must have m = {W.shape[0]} columns (W is {tuple(W.shape)}), got {tuple(V.shape)}")
    if b is not None:
        b = check_finite("b", as_tensor("b", b, dtype=W.dtype, device=W.device))
        if b.shape != (W.shape[0],):
            raise ValueError(f"b must have shape ({W.shape[0]},), got {tuple(b.shape)}")
    alpha = check_nonnegative("alpha", alpha)
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    return W, V, X, b, alpha


def leaky_forward(W, V, X, alpha: float, b=None) -> torch.Tensor:
    r""":math:`f(X) = \phi(XW^\top + \mathbf 1 b^\top)V^\top`, shape ``(n, d_y)`` (chapter 32)."""
    W, V, X, b, alpha = _check_leaky(W, V, X, b, alpha)
    Z = X @ W.T + (0 if b is None else b)
    return leaky_relu(Z, alpha) @ V.T


def leaky_flat_model(X, d: int, m: int, d_y: int, alpha: float, bias: bool = False):
    r"""``(fn, unflatten)`` for the dense route: :math:`\theta = [\operatorname{vec}W; b; \operatorname{vec}V]`,
    ``fn(theta) = vec f(X)``; ``unflatten(theta)`` gives ``(W, b, V)`` (``b`` None without bias)."""
    X = check_matrix("X", X)
    sizes = [m * d, m if bias else 0, d_y * m]

    def unflatten(theta):
        w, bb, v = theta.split(sizes, dim=-1)
        return w.reshape(m, d), (bb if bias else None), v.reshape(d_y, m)

    def fn(theta):
        W, bb, V = unflatten(theta)
        Z = cast_like("X", X, theta, "theta") @ W.T + (0 if bb is None else bb)
        return (torch.where(Z > 0, Z, alpha * Z) @ V.T).reshape(-1)

    return fn, unflatten


def leaky_relu_gram(W, V, X, alpha: float, b=None) -> torch.Tensor:
    r"""The ``n d_y x n d_y`` Gram matrix :math:`K/n = JJ^\top/n` of :math:`f = V\phi(Wx+b)`, same nonzero
    spectrum as :math:`H_{\mathrm{GN}}` (chapter 32). Sample-major blocks

    .. math::

        \tfrac1n\big[(\tilde x_i^\top\tilde x_j)\,VD_iD_jV^\top + \phi_i^\top\phi_j\,I_{d_y}\big],\qquad
        D_i = \operatorname{diag}\phi'(Wx_i+b),

    with :math:`\tilde x = (x, 1)` when there are biases. Float64.
    """
    W, V, X, b, alpha = _check_leaky(W, V, X, b, alpha)
    W, V, X = config.spectral(W), config.spectral(V), config.spectral(X)
    Z = X @ W.T + (0 if b is None else config.spectral(b))
    D = torch.where(Z > 0, torch.ones_like(Z), torch.full_like(Z, alpha))          # (n, m)
    Phi = Z * D
    Xt = X if b is None else torch.cat([X, torch.ones_like(X[:, :1])], dim=1)
    n, d_y = X.shape[0], V.shape[0]
    VD = D.unsqueeze(1) * V.unsqueeze(0)                                            # (n, d_y, m)
    KW = torch.einsum("ij,iau,jcu->iajc", Xt @ Xt.T, VD, VD)
    KV = torch.einsum("ij,ac->iajc", Phi @ Phi.T, torch.eye(d_y, dtype=torch.float64, device=X.device))
    return (KW + KV).reshape(n * d_y, n * d_y) / n


def leaky_relu_bound(W, V, X, alpha: float, b=None, *, slope_factor: bool = True) -> torch.Tensor:
    r"""A Lemma-1-shaped bound for one hidden leaky-ReLU layer, derived in chapter 32 from the Gram form:

    .. math::

        \kappa(H_{\mathrm{GN}}) \le \frac{\sigma_1^2(V)\,\sigma_1^2(\tilde X) + \sigma_1^2(\Phi)}
        {\alpha^2\sigma_{d_y}^2(V)\,\sigma_n^2(\tilde X) + \sigma_n^2(\Phi)},

    :math:`\sigma_n(\cdot)` the :math:`n`-th singular value (zero when :math:`n` exceeds the number of columns);
    infinite (vacuous) when the denominator vanishes. ``slope_factor=False`` drops the :math:`\alpha^2` (the
    linear-network guess, not a bound: the chapter's foil).
    """
    W, V, X, b, alpha = _check_leaky(W, V, X, b, alpha)
    W, V, X = config.spectral(W), config.spectral(V), config.spectral(X)
    Z = X @ W.T + (0 if b is None else config.spectral(b))
    Phi = leaky_relu(Z, alpha)
    Xt = X if b is None else torch.cat([X, torch.ones_like(X[:, :1])], dim=1)
    n, d_y = X.shape[0], V.shape[0]
    sv, sx, sp = _svals(V, d_y), _svals(Xt, n), _svals(Phi, n)
    a2 = alpha ** 2 if slope_factor else 1.0
    num = sv[0] ** 2 * sx[0] ** 2 + sp[0] ** 2
    return _ratio(num, a2 * sv[-1] ** 2 * sx[-1] ** 2 + sp[-1] ** 2)


def linear_units(W, X, b=None) -> torch.Tensor:
    r"""Boolean mask of hidden units whose pre-activation :math:`w_j^\top x_i + b_j` has one sign on all the data
    (they act linearly on it; chapter 32)."""
    W = check_matrix("W", W)
    X = check_matrix("X", X, dtype=W.dtype, device=W.device)
    Z = X @ W.T + (0 if b is None else as_tensor("b", b, dtype=W.dtype, device=W.device))
    return (Z > 0).all(dim=0) | (Z < 0).all(dim=0)


def leaky_relu_rank(W, X, d_y: int, b=None) -> int:
    r"""Upper bound on :math:`\operatorname{rank}H_{\mathrm{GN}}` of :math:`f=V\phi(Wx+b)` (chapter 32):

    .. math::

        \min\Big(n d_y,\ (m - m_{\mathrm{lin}})(s + d_y - 1) + q(s + d_y - q)\Big),\quad q=\min(s, d_y, m_{\mathrm{lin}}),

    with :math:`m` hidden units, :math:`m_{\mathrm{lin}}` of them linear on the data (:func:`linear_units`),
    :math:`s = \operatorname{rank}\tilde X` (:math:`\tilde X = [X, \mathbf 1]` with biases). Each nonlinear unit
    loses one direction to the rescaling symmetry :math:`(w_j, b_j, v_j)\mapsto(cw_j, cb_j, v_j/c)`; the linear
    units form a linear network with the deep-linear rank. Without linear units it is :math:`\min(nd_y, p-m)`
    on data of full rank.
    """
    W = check_matrix("W", W)
    X = check_matrix("X", X, dtype=W.dtype, device=W.device)
    d_y = check_int("d_y", d_y, min_value=1)
    Xt = X if b is None else torch.cat([X, torch.ones_like(X[:, :1])], dim=1)
    sx = torch.linalg.svdvals(config.spectral(Xt))
    s = int((sx > default_rtol(max(Xt.shape)) * sx[0]).sum())
    h, h_lin = W.shape[0], int(linear_units(W, X, b).sum())
    q = min(s, d_y, h_lin)
    return min(X.shape[0] * d_y, (h - h_lin) * (s + d_y - 1) + q * (s + d_y - q))


# ============================================================================================ pruning
def magnitude_masks(Ws, sparsity: float) -> list[torch.Tensor]:
    r"""Layer-wise magnitude pruning: in each :math:`W_l` keep the :math:`\lceil(1-s)\,m_lm_{l-1}\rceil` entries of
    largest :math:`|w|` (ties broken by position), ``s = sparsity`` in :math:`[0, 1)`. Boolean masks (chapter 31)."""
    Ws = _check_weights(Ws)
    s = check_nonnegative("sparsity", sparsity)
    if s >= 1:
        raise ValueError(f"sparsity must lie in [0, 1), got {s}")
    masks = []
    for W in Ws:
        flat = W.abs().reshape(*W.shape[:-2], -1)
        keep = max(1, math.ceil((1 - s) * flat.shape[-1]))
        idx = flat.topk(keep, dim=-1).indices
        mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
        masks.append(mask.reshape(W.shape))
    return masks


def gn_reduced_masked(Ws, masks, Sigma_hat=None) -> torch.Tensor:
    r"""Reduced GN matrix of a pruned deep linear network whose pruned weights are fixed at zero (chapter 31):

    .. math::

        \sum_l\sum_{(a,b)\ \text{kept}} (A_le_a)(A_le_a)^\top
        \otimes\hat\Sigma^{1/2}(B_l^\top e_b)(B_l^\top e_b)^\top\hat\Sigma^{1/2},

    the products taken with the pruned weights. Same nonzero spectrum as the GN matrix over the kept weights.
    """
    Ws = _check_weights(Ws)
    if isinstance(masks, torch.Tensor) or not isinstance(masks, Sequence) or len(masks) != len(Ws):
        raise TypeError(f"masks must be a list of {len(Ws)} boolean tensors shaped like Ws")
    Ms = []
    for i, (M, W) in enumerate(zip(masks, Ws)):
        if not isinstance(M, torch.Tensor) or M.shape != W.shape:
            raise ValueError(f"masks[{i}] must be a tensor of shape {tuple(W.shape)}")
        Ms.append(config.spectral(M.to(W.device)))
    Wp = [config.spectral(W) * M for W, M in zip(Ws, Ms)]
    L, (d, _, d_y) = len(Wp), _dims(Ws)
    batch, dev = Wp[0].shape[:-2], Wp[0].device
    S = _sigma_root(Sigma_hat, d, Wp[0])
    H = 0
    for l in range(1, L + 1):
        A = torch.eye(d_y, dtype=torch.float64, device=dev).expand(*batch, d_y, d_y)
        for W in reversed(Wp[l:]):
            A = A @ W
        B = torch.eye(d, dtype=torch.float64, device=dev).expand(*batch, d, d)
        for W in Wp[: l - 1]:
            B = W @ B
        if S is not None:
            B = B @ S
        T = torch.einsum("...ia,...ka,...ab->...ikb", A, A, Ms[l - 1])
        H = H + torch.einsum("...ikb,...bj,...bt->...ijkt", T, B, B).reshape(*batch, d_y * d, d_y * d)
    return H


# ============================================================================================ data
def second_moment(X) -> torch.Tensor:
    r"""Uncentred sample second moment :math:`\hat\Sigma = X^\top X/n` in float64, ``X: (..., n, d)``."""
    X = config.spectral(check_matrix("X", X, batch=True))
    return X.transpose(-2, -1) @ X / X.shape[-2]


def whiten(X, *, rtol: float | None = None, project: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Whiten with the uncentred second moment of the same samples: :math:`X_{\mathrm{w}} = XU_r\Lambda_r^{-1/2}`
    (``project=True``: ``n x r``, :math:`r` the numerical rank of :math:`\hat\Sigma`) or
    :math:`X\hat\Sigma^{+1/2}` (``project=False``: ``n x d``). Either way :math:`X_{\mathrm{w}}^\top X_{\mathrm{w}}/n`
    is the identity on the kept subspace. Returns ``(X_w, eigenvalues of Sigma_hat, decreasing)`` (chapter 31)."""
    X = config.spectral(check_matrix("X", X))
    lam, U = torch.linalg.eigh(second_moment(X))
    lam, U = lam.flip(-1), U.flip(-1)
    rtol = default_rtol(X.shape[1]) if rtol is None else check_nonnegative("rtol", rtol)
    r = int((lam > rtol * lam[0]).sum())
    T = U[:, :r] / lam[:r].sqrt()
    return (X @ T if project else X @ T @ U[:, :r].T), lam


def batchnorm_gains(Ws, X, eps: float = 0.0) -> list[torch.Tensor]:
    r"""Frozen batch-norm gains :math:`g_l = (\operatorname{Var}_i h_{l,i} + \epsilon)^{-1/2}` of each hidden layer,
    computed forward through the already-normalised network on the data ``X`` (chapter 31). With centred inputs a
    linear network's hidden units have zero mean, so frozen batch-norm is exactly the diagonal reparametrisation
    :math:`\tilde W_l = \operatorname{diag}(g_l)W_l`."""
    Ws = _check_weights(Ws)
    X = check_matrix("X", X, dtype=Ws[0].dtype, device=Ws[0].device)
    eps = check_nonnegative("eps", eps)
    gains, H = [], X
    for W in Ws[:-1]:
        H = H @ W.transpose(-2, -1)
        g = (H.var(dim=-2, unbiased=False) + eps).rsqrt()
        if not bool(torch.isfinite(g).all()):
            raise ValueError("a hidden unit has zero variance on X; pass eps > 0")
        gains.append(g)
        H = H * g.unsqueeze(-2)
    return gains


def bn_train_model(X, shapes: Sequence[tuple[int, int]], eps: float = 1e-5) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""``fn(theta) = vec f(X)`` for a linear network with train-mode batch-norm after every hidden layer:
    :math:`h\mapsto(h-\mu_{\mathrm{batch}})/\sqrt{\sigma^2_{\mathrm{batch}}+\epsilon}` over the ``n`` samples of ``X``.
    The statistics couple the samples, so its GN matrix is only available by the dense route (chapter 31)."""
    X = check_matrix("X", X)
    eps = check_nonnegative("eps", eps)

    def fn(theta: torch.Tensor) -> torch.Tensor:
        Ws = weights_of(theta, shapes)
        H = cast_like("X", X, theta, "theta")
        for W in Ws[:-1]:
            H = H @ W.T
            H = (H - H.mean(0)) / (H.var(0, unbiased=False) + eps).sqrt()
        return (H @ Ws[-1].T).reshape(-1)

    return fn


def train_gd(Ws, X, Y, *, eta: float, steps: int, every: int = 1, skip_scale: float = 0.0, masks=None,
             record: Callable[[int, list[torch.Tensor]], dict] | None = None) -> list[dict]:
    r"""Full-batch gradient descent on :math:`\mathcal L = \lVert f(X)-Y\rVert_F^2/(2n)` for a deep linear
    network (pruned weights, given by boolean ``masks``, stay at zero). Every ``every`` steps (and at the end)
    one row ``{"step", "loss", **record(step, Ws)}`` is appended. Returns the rows (chapter 31)."""
    Ws = [W.detach().clone() for W in _check_weights(Ws)]
    X = check_matrix("X", X, dtype=Ws[0].dtype, device=Ws[0].device)
    Y = check_matrix("Y", Y, dtype=Ws[0].dtype, device=Ws[0].device)
    eta, steps = check_positive("eta", eta), check_int("steps", steps, min_value=0)
    every = check_int("every", every, min_value=1)
    if masks is not None:
        Ws = [W * M for W, M in zip(Ws, masks)]
    rows = []
    for t in range(steps + 1):
        for W in Ws:
            W.requires_grad_(True)
        loss = (forward(Ws, X, skip_scale) - Y).square().sum() / (2 * X.shape[0])
        if t % every == 0 or t == steps:
            with torch.no_grad():
                extra = record(t, [W.detach() for W in Ws]) if record else {}
                rows.append({"step": t, "loss": float(loss.detach()), **extra})
        if not math.isfinite(float(loss.detach())):
            raise ValueError(f"gradient descent diverged at step {t} (loss {float(loss.detach())}); lower eta")
        if t == steps:
            break
        grads = torch.autograd.grad(loss, Ws)
        with torch.no_grad():
            Ws = [(W - eta * g) * (1 if masks is None else M)
                  for W, g, M in zip(Ws, grads, masks or [None] * len(Ws))]
    return rows


def min_loss(X, Y) -> float:
    r"""Smallest training loss :math:`\min_M\lVert XM^\top - Y\rVert_F^2/(2n)` of any linear map (least squares),
    which every deep linear network with widths at least :math:`\min(d, d_y)` can reach (chapter 31)."""
    X = config.spectral(check_matrix("X", X))
    Y = config.spectral(check_matrix("Y", Y))
    if Y.shape[0] != X.shape[0]:
        raise ValueError(f"Y must have n = {X.shape[0]} rows, got {tuple(Y.shape)}")
    M = torch.linalg.lstsq(X, Y).solution
    return float((X @ M - Y).square().sum() / (2 * X.shape[0]))


def digits(n: int | None = None, *, seed: int = 0, center: bool = False, drop_constant: bool = True,
           dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""scikit-learn's digits (1797 images of 8x8 pixels, no download), pixels scaled to :math:`[0, 1]`.

    Returns ``(X, Y, kept)``: ``n`` random samples (all if None), one-hot targets ``Y`` (``n x 10``), and the
    indices of the pixels kept. ``drop_constant`` drops the pixels that are constant on *these* samples (in the
    full set, pixels 0, 32 and 39 are 0 in every image, which makes the uncentred :math:`\hat\Sigma` singular);
    ``center`` subtracts the sample mean of each pixel (chapters 31–32).
    """
    from ._validate import _require

    load_digits = _require("sklearn.datasets", purpose="the digits data (deep_linear.digits)").load_digits

    linalg._check_float_dtype("dtype", dtype)
    data = load_digits()
    X = torch.as_tensor(data.data, dtype=dtype) / 16.0
    y = torch.as_tensor(data.target)
    if n is not None:
        n = check_int("n", n, min_value=2)
        if n > X.shape[0]:
            raise ValueError(f"n must be <= {X.shape[0]}, got {n}")
        idx = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(check_int("seed", seed)))[:n]
        X, y = X[idx], y[idx]
    kept = torch.arange(X.shape[1])
    if drop_constant:
        keep = X.std(dim=0) > 0
        X, kept = X[:, keep], kept[keep]
    if center:
        X = X - X.mean(dim=0)
    Y = torch.nn.functional.one_hot(y, 10).to(dtype)
    return X, Y, kept
