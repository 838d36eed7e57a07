r"""The preconditioner zoo: update rules for one weight matrix, as the papers write them (chapter 02).

Every rule acts on a weight matrix :math:`W \in \mathbb{R}^{m \times d}` (output side ``m``, input side ``d``)
with gradient :math:`\nabla_W \mathcal{L}` and returns the *preconditioned direction* :math:`\mathcal{P}(\nabla_W\mathcal{L})`;
the step is :math:`W \leftarrow W - \eta\,\mathcal{P}(\nabla_W\mathcal{L})`. Parts I–III use these functions as their
baselines. Each rule fits on one screen, names its paper and mirrors a displayed equation of chapter 02.

* :func:`natural_gradient_step`: :math:`(\mathcal{I} + \lambda_{\mathrm{GN}} I_p)^{-1}\nabla\mathcal{L}` (Amari 1998);
  :func:`natural_gradient_from_jacobian` for :math:`\mathcal{I} = J^\top J/n`, via :mod:`curvlab.curvature`;
* :func:`kfac_step`: :math:`C_{\mathrm{out}}^{-1}\nabla_W\mathcal{L}\,C_{\mathrm{in}}^{-1}` with Tikhonov or factored
  damping (Martens & Grosse 2015);
* :func:`shampoo_update`: :math:`(C^{\mathrm{Sh}}_{\mathrm{out}})^{-1/4}\nabla_W\mathcal{L}\,
  (C^{\mathrm{Sh}}_{\mathrm{in}})^{-1/4}` with accumulated gradient statistics (Gupta, Koren & Singer 2018);
* :func:`adam_update`: :math:`-\eta\,\hat g_t / (\sqrt{\hat s_t} + \lambda_{\mathrm{Adam}})` (Kingma & Ba 2015);
* :func:`muon_update`: Newton–Schulz orthogonalisation of the momentum (Jordan et al. 2024);
* :func:`soap_update`: Adam in Shampoo's eigenbasis, *simplified* (Vyas et al. 2024).

**Conventions.** Vectorisation is row-major (see :mod:`curvlab.linalg`), so the K-FAC block of a layer is
:math:`C_{\mathrm{out}} \otimes C_{\mathrm{in}}` and
:math:`(C_{\mathrm{out}} \otimes C_{\mathrm{in}})^{-1}\operatorname{vec}(\nabla) =
\operatorname{vec}(C_{\mathrm{out}}^{-1}\nabla C_{\mathrm{in}}^{-1})`. Every function accepts leading batch
dimensions ``(..., m, d)`` (seeds, step sizes), keeps the device and dtype of its inputs, and does its spectral
work (eigendecompositions, matrix powers) in float64 through :func:`curvlab.config.spectral`. Stateful methods are
written optax-style: ``*_init`` builds a state, ``*_update(grad, state, ...)`` returns ``(direction, new_state)``.
Where a standard optimiser is meant, Adam is ``torch.optim.Adam``; :func:`adam_update` writes the same rule out
(tested equal). :func:`muon_update` is ``torch.optim.Muon``'s rule batched over seeds (tested equal to it: torch's
optimiser takes one 2-D matrix at a time).

**The test problem** of chapter 02 is :class:`LayerProblem`: a linear layer :math:`z = Wx` read out by fixed
per-sample heads :math:`V_i`, whose loss is an exact quadratic with GN matrix
:math:`H_{\mathrm{GN}} = \frac1n\sum_i V_i^\top V_i \otimes x_i x_i^\top`; it is exactly Kronecker when every
sample has the same head. :func:`run` iterates any method of :data:`METHODS` on it, batched over seeds and step
sizes; :func:`tune` picks a step size on a grid; :func:`preconditioned_loss_curve` is the exact loss curve of
a fixed linear preconditioner (the theory line).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from . import config, curvature, linalg
from ._validate import (
    as_tensor,
    check_choice,
    check_finite,
    check_int,
    check_matrix,
    check_nonnegative,
    check_positive,
)

__all__ = [
    "psd_power",
    "natural_gradient_step",
    "natural_gradient_from_jacobian",
    "kfac_factors",
    "kfac_pi",
    "kfac_step_factored",
    "kfac_step_tikhonov",
    "kfac_step",
    "ShampooState",
    "shampoo_init",
    "shampoo_update",
    "AdamState",
    "adam_init",
    "adam_update",
    "adam_preconditioner",
    "NS_QUINTIC",
    "NS_CUBIC",
    "newton_schulz",
    "newton_schulz_scalar",
    "muon_update",
    "SoapState",
    "soap_init",
    "soap_update",
    "LayerProblem",
    "layer_problem",
    "METHODS",
    "run",
    "tune",
    "linear_rate",
    "run_protocol",
    "preconditioned_loss_curve",
    "kfac_gap",
]


# ============================================================================================ helpers
def _matrix(name: str, value, like: torch.Tensor | None = None) -> torch.Tensor:
    """A finite (batch of) matrix, in ``like``'s dtype and device when given."""
    if like is not None:
        value = as_tensor(name, value, dtype=like.dtype, device=like.device)
    return check_matrix(name, value, batch=True)


def _eye(k: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(k, dtype=like.dtype, device=like.device)


def _square_factor(name: str, C, size: int, like: torch.Tensor) -> torch.Tensor:
    """A symmetric (batch of) ``size x size`` factor, in ``like``'s dtype and device."""
    C = _matrix(name, C, like)
    if C.shape[-2:] != (size, size):
        raise ValueError(f"{name} must have shape (..., {size}, {size}) to match grad, got {tuple(C.shape)}")
    return linalg._check_symmetric(name, C)


def _eigh_psd(name: str, C: torch.Tensor, *, strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 eigenpairs of a PSD factor; eigenvalues within float noise of 0 clamped to 0.

    ``strict``: a (numerically) singular factor is a ValueError naming ``name`` (it would be inverted)."""
    lam, Q = linalg._eigh(name, C)
    noise = 100 * C.shape[-1] * torch.finfo(C.dtype).eps * lam.abs().amax(dim=-1, keepdim=True)
    if bool((lam < -noise).any()):
        raise ValueError(f"{name} must be positive semi-definite; its smallest eigenvalue is {float(lam.min()):.3g}")
    if strict and bool((lam <= noise).any()):
        raise ValueError(f"{name} is singular (smallest eigenvalue {float(lam.min()):.3g}); use a damping > 0")
    return lam.clamp_min(0.0), Q


def psd_power(A, exponent: float, floor: float = 0.0) -> torch.Tensor:
    r"""Power :math:`A^{p} = Q \operatorname{diag}(\max(\lambda_i, f)^{p}) Q^\top` of a symmetric PSD matrix
    (chapter 02).

    ``A: (..., k, k)``; ``exponent`` any real :math:`p`; ``floor`` :math:`f \ge 0` a known lower bound on the
    eigenvalues (Shampoo's :math:`\lambda_{\mathrm{Sh}}`), which rounding errors cannot then undercut. A negative power with
    ``floor = 0`` needs :math:`A \succ 0` (ValueError otherwise). Float64 inside; returns ``A``'s dtype and device.
    """
    A = check_matrix("A", A, square=True, batch=True)
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not math.isfinite(exponent):
        raise TypeError(f"exponent must be a finite real number, got {exponent!r}")
    p, floor = float(exponent), check_nonnegative("floor", floor)
    lam, Q = _eigh_psd("A", A, strict=p < 0 and floor == 0)
    lam = lam.clamp_min(floor)
    return ((Q * lam.pow(p).unsqueeze(-2)) @ Q.transpose(-2, -1)).to(dtype=A.dtype, device=A.device)


def _spd_solve_matrix(A: torch.Tensor, B: torch.Tensor, name: str) -> torch.Tensor:
    """:math:`A^{-1}B` for SPD ``A`` by Cholesky; a failed factorisation is a ValueError naming ``name``."""
    L, info = torch.linalg.cholesky_ex(A)
    if bool((info != 0).any()):
        raise ValueError(f"{name} is not positive definite (singular factor?); use a damping lam > 0")
    return torch.cholesky_solve(B, L)


def _grad(grad) -> torch.Tensor:
    return _matrix("grad", grad)


# ============================================================================================ NGD
def natural_gradient_step(grad, fisher, lam_GN: float = 0.0) -> torch.Tensor:
    r"""Natural-gradient direction :math:`(\mathcal{I} + \lambda_{\mathrm{GN}} I_p)^{-1}\nabla\mathcal{L}`.

    Amari (1998), *Natural gradient works efficiently in learning*, with Tikhonov damping; for the
    squared loss :math:`\mathcal{I}` is the GN matrix and this is the damped GN step (chapter 02, eq. zoo-ngd).
    ``grad: (..., p)`` on a flat parameter vector (``curvlab.linalg.vec`` of a weight matrix), ``fisher:
    (..., p, p)`` symmetric PSD, ``lam_GN >= 0`` (``0`` needs :math:`\mathcal{I} \succ 0`). Cholesky solve.
    """
    g = check_finite("grad", as_tensor("grad", grad))
    if g.dim() < 1 or g.shape[-1] == 0:
        raise ValueError(f"grad must be a flat (batch of) vector (..., p), got shape {tuple(g.shape)}")
    F = _square_factor("fisher", fisher, g.shape[-1], g)
    lam_GN = check_nonnegative("lam_GN", lam_GN)
    batch = torch.broadcast_shapes(g.shape[:-1], F.shape[:-2])
    A = (F + lam_GN * _eye(g.shape[-1], F)).expand(*batch, *F.shape[-2:])
    return curvature._spd_solve(A, g.expand(*batch, g.shape[-1]), "fisher + lam_GN I (with this lam_GN)")


def natural_gradient_from_jacobian(J, r, lam_GN: float) -> torch.Tensor:
    r"""NGD/GN direction for :math:`\mathcal{I} = J^\top J/n` and :math:`\nabla\mathcal{L} = J^\top r/n`.

    :math:`(J^\top J/n + \lambda_{\mathrm{GN}} I)^{-1} J^\top r/n = (J^\top J + n\lambda_{\mathrm{GN}} I)^{-1}
    J^\top r`, i.e. :func:`curvlab.curvature.damped_gn_step` with ``eps = n * lam_GN`` (``n`` = rows of ``J``).
    """
    J = check_matrix("J", J, batch=True)
    return curvature.damped_gn_step(J, r, J.shape[-2] * check_nonnegative("lam_GN", lam_GN))


# ============================================================================================ K-FAC
def kfac_factors(activations, output_grads) -> tuple[torch.Tensor, torch.Tensor]:
    r"""K-FAC's Kronecker factors of a layer :math:`z = Wa`: :math:`(C_{\mathrm{out}}, C_{\mathrm{in}}) =
    (\frac1n G^\top G, \frac1n A^\top A)`.

    Martens & Grosse (2015): the layer's Fisher block :math:`\mathbb{E}[gg^\top \otimes aa^\top]` is
    approximated by :math:`\mathbb{E}[gg^\top] \otimes \mathbb{E}[aa^\top]` (row-major order) — exact when the
    output gradients :math:`g` are independent of the inputs :math:`a`. ``activations: (..., n, d)`` (rows
    :math:`a_i^\top`), ``output_grads: (..., n, m)`` (rows :math:`g_i^\top`, with targets sampled from the model
    for the true Fisher). Returns ``C_out (..., m, m)`` and ``C_in (..., d, d)``.
    """
    A = _matrix("activations", activations)
    G = _matrix("output_grads", output_grads, A)
    if G.shape[-2] != A.shape[-2]:
        raise ValueError(f"output_grads must have one row per sample ({A.shape[-2]}), got {tuple(G.shape)}")
    n = A.shape[-2]
    return G.transpose(-2, -1) @ G / n, A.transpose(-2, -1) @ A / n


def kfac_pi(C_out, C_in) -> torch.Tensor:
    r"""Martens & Grosse's :math:`\pi = \sqrt{(\operatorname{tr}C_{\mathrm{in}}/d)\,/\,(\operatorname{tr}C_{\mathrm{out}}/m)}`
    (2015, sec. 6.3): the split of the damping that equalises the traces of the two cross terms (chapter 02)."""
    C_out, C_in = _matrix("C_out", C_out), _matrix("C_in", C_in)
    tr = lambda C: torch.diagonal(C, dim1=-2, dim2=-1).mean(-1)  # noqa: E731  tr(C)/size
    if bool((tr(C_out) <= 0).any()) or bool((tr(C_in.to(C_out)) <= 0).any()):
        raise ValueError("C_out and C_in must have a positive trace for the pi-heuristic")
    return (tr(C_in.to(C_out)) / tr(C_out)).sqrt()


def kfac_step_factored(grad, C_out, C_in, lam_GN: float) -> torch.Tensor:
    r"""K-FAC with factored damping, :math:`(C_{\mathrm{out}} + \lambda_{\mathrm{out}} I)^{-1}\,\nabla\,
    (C_{\mathrm{in}} + \lambda_{\mathrm{in}} I)^{-1}` with :math:`\lambda_{\mathrm{out}} = \sqrt{\lambda_{\mathrm{GN}}}/\pi`,
    :math:`\lambda_{\mathrm{in}} = \pi\sqrt{\lambda_{\mathrm{GN}}}`.

    Martens & Grosse (2015), sec. 6.3 (their :math:`(A + \pi\gamma I)\otimes(G + \gamma/\pi\, I)`, with
    :math:`\gamma = \sqrt{\lambda_{\mathrm{GN}}}`), :math:`\pi` from :func:`kfac_pi`. Equal to :func:`kfac_step_tikhonov`
    only when ``lam_GN = 0``: the product of the damped factors adds cross terms to :math:`\lambda_{\mathrm{GN}} I`.
    """
    g = _grad(grad)
    m, d = g.shape[-2:]
    C_out, C_in = _square_factor("C_out", C_out, m, g), _square_factor("C_in", C_in, d, g)
    lam_GN = check_nonnegative("lam_GN", lam_GN)
    one = torch.ones((), dtype=g.dtype, device=g.device)
    pi = kfac_pi(C_out, C_in)[..., None, None] if lam_GN > 0 else one
    left = C_out + math.sqrt(lam_GN) / pi * _eye(m, g)        # C_out + lambda_out I
    right = C_in + math.sqrt(lam_GN) * pi * _eye(d, g)        # C_in + lambda_in I
    left_solved = _spd_solve_matrix(left, g, "C_out + damping")
    return _spd_solve_matrix(right, left_solved.transpose(-2, -1), "C_in + damping").transpose(-2, -1)


def kfac_step_tikhonov(grad, C_out, C_in, lam_GN: float) -> torch.Tensor:
    r"""K-FAC with exact Tikhonov damping, :math:`(C_{\mathrm{out}}\otimes C_{\mathrm{in}} + \lambda_{\mathrm{GN}} I)^{-1}
    \operatorname{vec}\nabla`, in the factors' eigenbases.

    With :math:`C_{\mathrm{out}} = U_{\mathrm{out}}\operatorname{diag}(\lambda(C_{\mathrm{out}}))U_{\mathrm{out}}^\top` and
    :math:`C_{\mathrm{in}} = U_{\mathrm{in}}\operatorname{diag}(\lambda(C_{\mathrm{in}}))U_{\mathrm{in}}^\top`
    (chapter 02, eq. zoo-tikhonov):

    .. math::  U_{\mathrm{out}}\Big[\big(U_{\mathrm{out}}^\top \nabla U_{\mathrm{in}}\big) \oslash
               \big(\lambda(C_{\mathrm{out}})\lambda(C_{\mathrm{in}})^\top + \lambda_{\mathrm{GN}}\big)\Big]
               U_{\mathrm{in}}^\top,

    :math:`\oslash` entrywise. Cost: two eigendecompositions, :math:`O(m^3 + d^3)`; the :math:`md \times md`
    matrix is never formed. Martens & Grosse (2015), sec. 6.3, discuss this exact form as the alternative to
    factored damping. Eigen-work in float64; returns ``grad``'s dtype.
    """
    g = _grad(grad)
    m, d = g.shape[-2:]
    C_out, C_in = _square_factor("C_out", C_out, m, g), _square_factor("C_in", C_in, d, g)
    lam_GN = check_nonnegative("lam_GN", lam_GN)
    s_out, U_out = _eigh_psd("C_out", C_out, strict=lam_GN == 0)
    s_in, U_in = _eigh_psd("C_in", C_in, strict=lam_GN == 0)
    g64 = config.spectral(g)
    inner = (U_out.transpose(-2, -1) @ g64 @ U_in) / (s_out[..., :, None] * s_in[..., None, :] + lam_GN)
    return (U_out @ inner @ U_in.transpose(-2, -1)).to(dtype=g.dtype, device=g.device)


def kfac_step(grad, C_out, C_in, lam_GN: float = 0.0, damping: str = "tikhonov") -> torch.Tensor:
    r"""K-FAC direction :math:`C_{\mathrm{out}}^{-1}\,\nabla\,C_{\mathrm{in}}^{-1}` with ``damping`` in
    ``{"tikhonov", "factored"}`` (:func:`kfac_step_tikhonov`, :func:`kfac_step_factored`); both are this
    when ``lam_GN = 0``. Martens & Grosse (2015)."""
    damping = check_choice("damping", damping, ("tikhonov", "factored"))
    return (kfac_step_tikhonov if damping == "tikhonov" else kfac_step_factored)(grad, C_out, C_in, lam_GN)


# ============================================================================================ Shampoo
@dataclass(frozen=True)
class ShampooState:
    r"""Shampoo's accumulated statistics :math:`C^{\mathrm{Sh}}_{\mathrm{out}} = \lambda_{\mathrm{Sh}} I + \sum_s \nabla_s\nabla_s^\top`
    (``C_out``, ``(..., m, m)``) and :math:`C^{\mathrm{Sh}}_{\mathrm{in}} = \lambda_{\mathrm{Sh}} I + \sum_s \nabla_s^\top\nabla_s`
    (``C_in``, ``(..., d, d)``); Gupta et al. call them :math:`L_t` and :math:`R_t`. ``eps`` (:math:`\lambda_{\mathrm{Sh}}`, the paper's
    :math:`\epsilon`) bounds their eigenvalues from below."""

    C_out: torch.Tensor
    C_in: torch.Tensor
    eps: float


def shampoo_init(W, eps: float) -> ShampooState:
    r"""Statistics :math:`\lambda_{\mathrm{Sh}} I_m` and :math:`\lambda_{\mathrm{Sh}} I_d` (``eps``; Gupta et al. 2018,
    Algorithm 1), batched like ``W``."""
    W = _matrix("W", W)
    eps = check_positive("eps", eps)
    m, d = W.shape[-2:]
    batch = W.shape[:-2]
    C_out = (eps * _eye(m, W)).expand(*batch, m, m).clone()
    C_in = (eps * _eye(d, W)).expand(*batch, d, d).clone()
    return ShampooState(C_out, C_in, eps)


def shampoo_update(grad, state: ShampooState, exponent: float = -0.25) -> tuple[torch.Tensor, ShampooState]:
    r"""Shampoo: accumulate :math:`C^{\mathrm{Sh}}_{\mathrm{out}} \mathrel{+}= \nabla_t\nabla_t^\top` and
    :math:`C^{\mathrm{Sh}}_{\mathrm{in}} \mathrel{+}= \nabla_t^\top\nabla_t`, then return the direction
    :math:`(C^{\mathrm{Sh}}_{\mathrm{out}})^{-1/4}\,\nabla_t\,(C^{\mathrm{Sh}}_{\mathrm{in}})^{-1/4}`.

    Gupta, Koren & Singer (2018), Algorithm 1 (order-2 tensors; their :math:`L_t`, :math:`R_t`). ``exponent``
    (default :math:`-1/4`) is the power :math:`\xi` on *each* side; chapter 02 shows that for gradients with the
    Kronecker second moment :math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}` this preconditions by
    :math:`(C_{\mathrm{out}}\otimes C_{\mathrm{in}})^{\xi}`: :math:`-1/4` gives its :math:`-1/4` power, :math:`-1/2`
    full-matrix AdaGrad's :math:`-1/2`, :math:`-1` its inverse.
    Returns ``(direction, new_state)``.
    """
    g = _grad(grad)
    if not isinstance(state, ShampooState):
        raise TypeError(f"state must be a ShampooState (from shampoo_init), got {type(state).__name__}")
    m, d = g.shape[-2:]
    L = _square_factor("state.C_out", state.C_out, m, g) + g @ g.transpose(-2, -1)
    R = _square_factor("state.C_in", state.C_in, d, g) + g.transpose(-2, -1) @ g
    power = lambda C: psd_power(C, exponent, floor=state.eps)  # noqa: E731  eigenvalues of C are >= eps
    return power(L) @ g @ power(R), ShampooState(L, R, state.eps)


# ============================================================================================ Adam
@dataclass(frozen=True)
class AdamState:
    """Adam's moving averages ``m`` (first moment), ``v`` (second moment) and the step count ``t``."""

    m: torch.Tensor
    v: torch.Tensor
    t: int


def adam_init(W) -> AdamState:
    """Zero moments, ``t = 0`` (Kingma & Ba 2015, Algorithm 1)."""
    W = _matrix("W", W)
    return AdamState(torch.zeros_like(W), torch.zeros_like(W), 0)


def adam_preconditioner(v_hat, lam_adam: float) -> torch.Tensor:
    r"""Adam's diagonal preconditioner :math:`(\sqrt{\hat s} + \lambda_{\mathrm{Adam}})^{-1}`, entrywise (``v_hat`` is
    the bias-corrected second moment :math:`\hat s`): the :math:`-1/2` power of a diagonal curvature estimate
    (chapter 02, Lemma lem-zoo-adam)."""
    v = check_finite("v_hat", as_tensor("v_hat", v_hat))
    if bool((v < 0).any()):
        raise ValueError("v_hat must be >= 0 (a second moment)")
    return 1.0 / (v.sqrt() + check_positive("lam_adam", lam_adam))


def adam_update(grad, state: AdamState, lr: float, betas: Sequence[float] = (0.9, 0.999),
                lam_adam: float = 1e-8) -> tuple[torch.Tensor, AdamState]:
    r"""Adam (Kingma & Ba 2015, Algorithm 1): the update :math:`-\eta\,\hat g_t/(\sqrt{\hat s_t} +
    \lambda_{\mathrm{Adam}})` with :math:`\bar g_t = \beta_1 \bar g_{t-1} + (1-\beta_1)\nabla_t`,
    :math:`\bar s_t = \beta_2 \bar s_{t-1} + (1-\beta_2)\nabla_t^{\odot 2}`, :math:`\hat g_t = \bar g_t/(1-\beta_1^t)`,
    :math:`\hat s_t = \bar s_t/(1-\beta_2^t)` (chapter 02's names; the paper's :math:`m_t, v_t`, kept as ``m``, ``v``
    in the state). Equal to one ``torch.optim.Adam`` step (tested).

    Returns ``(update, new_state)``: the update is *added* to the weights (it includes :math:`-\eta`).
    """
    g = _grad(grad)
    if not isinstance(state, AdamState):
        raise TypeError(f"state must be an AdamState (from adam_init), got {type(state).__name__}")
    lr = check_positive("lr", lr)
    if not isinstance(betas, Sequence) or len(betas) != 2 or not all(0 <= float(b) < 1 for b in betas):
        raise ValueError(f"betas must be a pair (beta1, beta2) in [0, 1), got {betas!r}")
    b1, b2 = (float(b) for b in betas)
    t = state.t + 1
    m = b1 * state.m + (1 - b1) * g
    v = b2 * state.v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return -lr * m_hat * adam_preconditioner(v_hat, lam_adam), AdamState(m, v, t)


# ============================================================================================ Muon
#: Jordan et al.'s quintic Newton–Schulz coefficients a, b, c — fast, maps singular values into ~[0.7, 1.2].
NS_QUINTIC = (3.4445, -4.7750, 2.0315)
#: The classical cubic Newton–Schulz iteration X <- 1.5 X - 0.5 X X^T X, which converges to U V^T.
NS_CUBIC = (1.5, -0.5, 0.0)


def _ns_coefficients(coefficients) -> tuple[float, float, float]:
    if not isinstance(coefficients, Sequence) or len(coefficients) != 3:
        raise ValueError(f"coefficients must be three numbers (a, b, c), got {coefficients!r}")
    return tuple(float(c) for c in coefficients)  # type: ignore[return-value]


def newton_schulz(G, steps: int = 5, coefficients: Sequence[float] = NS_QUINTIC, eps: float = 1e-7) -> torch.Tensor:
    r"""Newton–Schulz orthogonalisation: :math:`X_0 = G/\lVert G\rVert_F`,
    :math:`X_{k+1} = aX_k + (bA_k + cA_k^2)X_k` with :math:`A_k = X_kX_k^\top`.

    Each step maps every singular value through :math:`p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5` and keeps
    the singular vectors, so :math:`X_k = U\,p^{(k)}(\Sigma/\lVert G\rVert_F)\,V^\top` for :math:`G = U\Sigma V^\top`
    (chapter 02). :data:`NS_CUBIC` converges to :math:`UV^\top`; Jordan et al. (2024)'s :data:`NS_QUINTIC` gets
    close in 5 steps. Same operations as ``torch.optim.Muon`` (which runs them in bfloat16); batched
    ``(..., m, d)``, computed in ``G``'s dtype (the wide orientation, as torch does).
    """
    X = _matrix("G", G)
    steps = check_int("steps", steps, min_value=0)
    a, b, c = _ns_coefficients(coefficients)
    eps = check_positive("eps", eps)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])                                  # (batch, rows, cols), rows <= cols
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.transpose(-2, -1)                                 # A_k = X_k X_k^T
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)                 # b A_k + c A_k^2
        X = torch.baddbmm(X, B, X, beta=a)                          # a X_k + (b A_k + c A_k^2) X_k
    X = X.reshape(shape)
    return X.transpose(-2, -1) if tall else X


def newton_schulz_scalar(x, steps: int = 5, coefficients: Sequence[float] = NS_QUINTIC) -> torch.Tensor:
    r"""The scalar map :math:`p^{(k)}(x)` that :func:`newton_schulz` applies to each normalised singular value."""
    x = check_finite("x", as_tensor("x", x))
    steps = check_int("steps", steps, min_value=0)
    a, b, c = _ns_coefficients(coefficients)
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def muon_update(grad, buf, lr: float, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                ns_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Muon (Jordan et al. 2024): momentum, then Newton–Schulz orthogonalisation of the update.

    With :math:`\beta_{\mathrm{m}}` = ``momentum``: :math:`B_t = \beta_{\mathrm{m}} B_{t-1} + (1-\beta_{\mathrm{m}})
    \nabla_t`; :math:`\tilde B_t = (1-\beta_{\mathrm{m}})\nabla_t + \beta_{\mathrm{m}} B_t` (Nesterov) or :math:`B_t`;
    update :math:`-\eta\sqrt{\max(1, m/d)}\;\mathrm{NS}_5(\tilde B_t)` (:func:`newton_schulz`). This is
    ``torch.optim.Muon`` with ``weight_decay=0`` (its averaging convention; Jordan's original
    :math:`B_t = \beta_{\mathrm{m}} B_{t-1} + \nabla_t` differs by the factor :math:`1-\beta_{\mathrm{m}}`, which the
    normalisation removes). ``ns_dtype=torch.bfloat16`` reproduces torch's precision. Returns
    ``(update, new_buf)``; the update includes :math:`-\eta`.
    """
    g = _grad(grad)
    buf = _matrix("buf", buf, g)
    if buf.shape != g.shape:
        raise ValueError(f"buf must have grad's shape {tuple(g.shape)}, got {tuple(buf.shape)}")
    lr = check_positive("lr", lr)
    mu = check_nonnegative("momentum", momentum)
    if mu >= 1:
        raise ValueError(f"momentum must be in [0, 1), got {mu}")
    buf = torch.lerp(buf, g, 1 - mu)
    update = torch.lerp(g, buf, mu) if nesterov else buf
    O = newton_schulz(update.to(ns_dtype or g.dtype), ns_steps).to(g.dtype)
    m, d = g.shape[-2:]
    return -lr * math.sqrt(max(1.0, m / d)) * O, buf


# ============================================================================================ SOAP
@dataclass(frozen=True)
class SoapState:
    """Simplified SOAP's state: Shampoo statistics (EMA), Adam's first moment (original coordinates), second
    moment (in the current eigenbasis) and the step count."""

    C_out: torch.Tensor
    C_in: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    t: int


def soap_init(W) -> SoapState:
    """Zero statistics and moments."""
    W = _matrix("W", W)
    m, d = W.shape[-2:]
    z = torch.zeros_like
    return SoapState(z(W[..., :1, :1]).expand(*W.shape[:-2], m, m).clone(),
                     z(W[..., :1, :1]).expand(*W.shape[:-2], d, d).clone(), z(W), z(W), 0)


def soap_update(grad, state: SoapState, lr: float, betas: Sequence[float] = (0.95, 0.95),
                lam_adam: float = 1e-8, shampoo_beta: float | None = None) -> tuple[torch.Tensor, SoapState]:
    r"""SOAP, **simplified**: Adam run in the eigenbasis of Shampoo's statistics (Vyas et al. 2024).

    Exponential averages :math:`C^{\mathrm{Sh}}_{\mathrm{out}} \leftarrow \beta C^{\mathrm{Sh}}_{\mathrm{out}} +
    (1-\beta)\nabla\nabla^\top` and :math:`C^{\mathrm{Sh}}_{\mathrm{in}} \leftarrow \beta C^{\mathrm{Sh}}_{\mathrm{in}}
    + (1-\beta)\nabla^\top\nabla` (:math:`\beta` = ``shampoo_beta``, default :math:`\beta_2`) with eigenvectors
    :math:`Q_{\mathrm{out}}, Q_{\mathrm{in}}`; rotate
    :math:`\nabla' = Q_{\mathrm{out}}^\top\nabla Q_{\mathrm{in}}` and the first moment likewise, take Adam's
    step :math:`N'` there, rotate back: :math:`-\eta\,Q_{\mathrm{out}}N'Q_{\mathrm{in}}^\top`.
    Simplifications (labelled in chapter 02): the eigenbasis is recomputed by ``eigh`` at *every* step (SOAP
    refreshes it every 10 steps with one QR power step), the second moment is not re-projected when the basis
    changes, and there is no grafting or weight decay.
    """
    g = _grad(grad)
    if not isinstance(state, SoapState):
        raise TypeError(f"state must be a SoapState (from soap_init), got {type(state).__name__}")
    lr = check_positive("lr", lr)
    if not isinstance(betas, Sequence) or len(betas) != 2 or not all(0 <= float(b) < 1 for b in betas):
        raise ValueError(f"betas must be a pair (beta1, beta2) in [0, 1), got {betas!r}")
    b1, b2 = (float(x) for x in betas)
    t = state.t + 1
    bs = b2 if shampoo_beta is None else check_nonnegative("shampoo_beta", shampoo_beta)
    if bs >= 1:
        raise ValueError(f"shampoo_beta must be in [0, 1), got {bs}")
    C_out = bs * state.C_out + (1 - bs) * g @ g.transpose(-2, -1)
    C_in = bs * state.C_in + (1 - bs) * g.transpose(-2, -1) @ g
    Q_out, Q_in = (linalg._eigh("state", C)[1].to(g) for C in (C_out, C_in))
    rot = lambda M: Q_out.transpose(-2, -1) @ M @ Q_in  # noqa: E731  into the eigenbasis
    m = b1 * state.m + (1 - b1) * g
    v = b2 * state.v + (1 - b2) * rot(g) ** 2
    N = (rot(m) / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + lam_adam)
    return -lr * Q_out @ N @ Q_in.transpose(-2, -1), SoapState(C_out, C_in, m, v, t)


# ============================================================================================ the test problem
@dataclass(frozen=True)
class LayerProblem:
    r"""Chapter 02's quadratic: a linear layer :math:`z = Wx`, :math:`W \in \mathbb{R}^{m\times d}`, read out by a
    fixed head :math:`V_i \in \mathbb{R}^{d_y\times m}` per sample, with a realisable target:

    .. math::  \mathcal{L}(W) = \frac{1}{2n}\sum_{i=1}^n \lVert V_i (W - W_\star) x_i\rVert^2, \qquad
               H_{\mathrm{GN}} = \frac1n\sum_i V_i^\top V_i \otimes x_i x_i^\top \ \text{(row-major)}.

    K-FAC's factors (true Fisher: targets sampled from the model) are
    :math:`C_{\mathrm{out}} = \frac1n\sum_i V_i^\top V_i` and :math:`C_{\mathrm{in}} = \hat\Sigma`; the block is
    exactly :math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}` when all heads are equal.
    Shapes: ``X (S, n, d)``, ``heads (S, n, d_y, m)``, ``W_star``, ``W0 (S, m, d)``; ``S`` seeds. Methods accept
    weights ``(..., S, m, d)`` (extra leading dimensions: step sizes).
    """

    X: torch.Tensor
    heads: torch.Tensor
    W_star: torch.Tensor
    W0: torch.Tensor

    def __post_init__(self) -> None:
        X = check_finite("X", as_tensor("X", self.X))
        if X.dim() != 3:
            raise ValueError(f"X must have shape (S, n, d), got {tuple(X.shape)}")
        S, n, d = X.shape
        if self.heads.dim() != 4 or self.heads.shape[:2] != (S, n):
            raise ValueError(f"heads must have shape ({S}, {n}, d_y, m), got {tuple(self.heads.shape)}")
        m = self.heads.shape[-1]
        for name in ("W_star", "W0"):
            if getattr(self, name).shape != (S, m, d):
                raise ValueError(f"{name} must have shape ({S}, {m}, {d}), got {tuple(getattr(self, name).shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(m, d)``: the layer's output and input sizes."""
        return self.heads.shape[-1], self.X.shape[-1]

    def _weights(self, W) -> torch.Tensor:
        W = as_tensor("W", W, dtype=self.X.dtype, device=self.X.device)
        if W.dim() < 3 or W.shape[-3:] != self.W0.shape:
            raise ValueError(f"W must have shape (..., {', '.join(map(str, self.W0.shape))}), got {tuple(W.shape)}")
        return W

    def residuals(self, W) -> torch.Tensor:
        r""":math:`r_i = V_i (W - W_\star) x_i`, shape ``(..., S, n, d_y)``."""
        E = self._weights(W) - self.W_star
        return torch.einsum("snym,...smd,snd->...sny", self.heads, E, self.X)

    def output_grads(self, W) -> torch.Tensor:
        r"""Backpropagated gradients :math:`g_i = \partial\ell_i/\partial z_i = V_i^\top r_i`, ``(..., S, n, m)``."""
        return torch.einsum("snym,...sny->...snm", self.heads, self.residuals(W))

    def grad_from_samples(self, W) -> torch.Tensor:
        r""":math:`\nabla_W\mathcal{L} = \frac1n\sum_i g_i x_i^\top` from the per-sample output gradients (the
        back-propagation form; :meth:`grad` computes the same from :math:`H_{\mathrm{GN}}`)."""
        return torch.einsum("...snm,snd->...smd", self.output_grads(W), self.X) / self.X.shape[-2]

    @cached_property
    def H(self) -> torch.Tensor:
        r""":math:`H_{\mathrm{GN}} = \frac1n\sum_i V_i^\top V_i \otimes x_i x_i^\top` (the exact Hessian of this
        quadratic), ``(S, md, md)``, computed once from the closed form (tested against
        :func:`curvlab.curvature.gn_matrix` applied to :meth:`model`)."""
        m, d = self.shape
        S, n = self.X.shape[:2]
        B = torch.einsum("snym,snyk->snmk", self.heads, self.heads).reshape(S, n, m * m)
        XX = (self.X.unsqueeze(-1) * self.X.unsqueeze(-2)).reshape(S, n, d * d)
        H = (B.transpose(-2, -1) @ XX / n).reshape(S, m, m, d, d)      # [a, b, i, j]
        return H.permute(0, 1, 3, 2, 4).reshape(S, m * d, m * d)         # row (a, i), column (b, j)

    def _H_times_error(self, W) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e, H e)`` for ``e = vec(W - W_star)``, as one matmul batched over seeds (no copies of ``H``)."""
        E = self._weights(W) - self.W_star
        e = E.reshape(*E.shape[:-2], E.shape[-2] * E.shape[-1])              # vec, row-major: (..., S, p)
        flat = e.movedim(-2, 0).reshape(e.shape[-2], -1, e.shape[-1])       # (S, k, p)
        He = (flat @ self.H).reshape(e.movedim(-2, 0).shape).movedim(0, -2)  # H is symmetric
        return e, He

    def loss(self, W) -> torch.Tensor:
        r""":math:`\mathcal{L}(W) = \tfrac12 e^\top H_{\mathrm{GN}}\, e` with :math:`e = \operatorname{vec}(W -
        W_\star)`, equal to :math:`\frac{1}{2n}\sum_i\lVert r_i\rVert^2`; shape ``(..., S)``."""
        e, He = self._H_times_error(W)
        return 0.5 * (e * He).sum(-1)

    def grad(self, W) -> torch.Tensor:
        r""":math:`\nabla_W\mathcal{L} = \operatorname{unvec}(H_{\mathrm{GN}}\,e)`, shape ``(..., S, m, d)``."""
        return linalg.unvec(self._H_times_error(W)[1], self.shape)

    def kfac_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Exact true-Fisher factors: :math:`C_{\mathrm{out}} = \frac1n\sum_i V_i^\top V_i` (the expectation over
        targets sampled from the model, in closed form) and :math:`C_{\mathrm{in}} = \hat\Sigma`."""
        C_out = torch.einsum("snym,snyk->smk", self.heads, self.heads) / self.X.shape[-2]
        return C_out, self.X.transpose(-2, -1) @ self.X / self.X.shape[-2]

    def model(self, s: int):
        r"""Seed ``s`` as a model in :mod:`curvlab.curvature`'s convention: :math:`\theta = \operatorname{vec}(W)
        \mapsto (V_i W x_i)_i` flattened, so that ``gn_matrix(model, theta, 1/n)`` is :math:`H_{\mathrm{GN}}`."""
        s = check_int("s", s, min_value=0)
        if s >= self.X.shape[0]:
            raise ValueError(f"s must be < the number of seeds {self.X.shape[0]}, got {s}")
        m, d = self.shape
        return lambda theta: torch.einsum("nym,md,nd->ny", self.heads[s], theta.reshape(m, d), self.X[s]).reshape(-1)


def _head(sv: torch.Tensor, d_y: int, basis: str, gen: torch.Generator) -> torch.Tensor:
    """A head ``V = P diag(sv) Q^T`` (d_y x m): P with orthonormal columns, Q random or the identity."""
    m = sv.numel()
    P = linalg.random_orthogonal(d_y, generator=gen)[:, :m]
    Q = linalg.random_orthogonal(m, generator=gen) if basis == "random" else torch.eye(m, dtype=torch.float64)
    return (P * sv) @ Q.T


def layer_problem(n_seeds: int, *, n: int, d: int, m: int, d_y: int, kappa_in: float = 100.0,
                  kappa_out: float = 10.0, frac2: float = 0.0, basis: str = "random", seed: int = 0,
                  dtype: torch.dtype = torch.float64, device=None) -> LayerProblem:
    r"""Draw ``n_seeds`` instances of :class:`LayerProblem` (chapter 02's comparison).

    A fraction :math:`\nu_1 = 1 - \nu_2` of the samples (group 1) has inputs :math:`x \sim \mathcal{N}(0, \Sigma_1)`
    and head :math:`V_1`; the rest, :math:`\nu_2` = ``frac2`` (group 2), has :math:`\Sigma_2` and :math:`V_2`, drawn
    the same way with the spectra
    reversed. :math:`\kappa(\Sigma_g)` = ``kappa_in``, :math:`\kappa(V_g^\top V_g)` = ``kappa_out``; eigenbases are
    Haar-random (``basis="random"``) or the coordinate axes (``"aligned"``). With ``frac2 = 0`` the GN matrix is
    exactly :math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}`; with two groups it differs from K-FAC's product by
    :math:`\nu_1\nu_2(B_1 - B_2)\otimes(\hat\Sigma_1 - \hat\Sigma_2)`, :math:`B_k = V_k^\top V_k`.
    ``W_star`` has i.i.d. :math:`\mathcal{N}(0, 1/d)` entries and ``W0 = 0``.
    """
    S = check_int("n_seeds", n_seeds, min_value=1)
    n, d, m, d_y = (check_int(k, v, min_value=1) for k, v in (("n", n), ("d", d), ("m", m), ("d_y", d_y)))
    if d_y < m:
        raise ValueError(f"d_y must be >= m so that the heads have full column rank, got d_y={d_y} < m={m}")
    k_in, k_out = check_positive("kappa_in", kappa_in), check_positive("kappa_out", kappa_out)
    if k_in < 1 or k_out < 1:
        raise ValueError("kappa_in and kappa_out must be >= 1")
    frac2 = check_nonnegative("frac2", frac2)
    if frac2 >= 1:
        raise ValueError(f"frac2 must be in [0, 1), got {frac2}")
    check_choice("basis", basis, ("random", "aligned"))
    n2 = int(round(frac2 * n))
    s_in = torch.logspace(0, math.log10(k_in), d, dtype=torch.float64)
    s_out = torch.logspace(0, 0.5 * math.log10(k_out), m, dtype=torch.float64)
    gen = torch.Generator().manual_seed(check_int("seed", seed, min_value=0))
    Xs, Hs, Ws = [], [], []
    for _ in range(S):
        groups = [(n - n2, s_in, s_out), (n2, s_in.flip(0), s_out.flip(0))]
        X, heads = [], []
        for size, spec_in, spec_out in groups:
            _, half = linalg.covariance(spec_in, basis, generator=gen)
            V = _head(spec_out, d_y, basis, gen)
            X.append(torch.randn(size, d, generator=gen, dtype=torch.float64) @ half)
            heads.append(V.expand(size, d_y, m))
        Xs.append(torch.cat(X))
        Hs.append(torch.cat(heads))
        Ws.append(torch.randn(m, d, generator=gen, dtype=torch.float64) / math.sqrt(d))
    to = dict(dtype=dtype, device=device)
    W_star = torch.stack(Ws).to(**to)
    return LayerProblem(torch.stack(Xs).to(**to), torch.stack(Hs).to(**to), W_star, torch.zeros_like(W_star))


# ============================================================================================ running methods
#: The methods :func:`run` knows, with the registry names of :mod:`curvlab.plotting`.
METHODS = ("GD", "NGD", "K-FAC", "Shampoo", "Adam", "Muon", "SOAP")
_DIVERGED = 1e8  # a run whose loss exceeds this multiple of its initial loss is stopped and reported as inf


def _etas(eta, S: int, like: torch.Tensor) -> torch.Tensor:
    """Step sizes as ``(E, S, 1, 1)`` from a number, a vector ``(E,)`` or a grid ``(E, S)``."""
    e = check_finite("eta", as_tensor("eta", eta, dtype=like.dtype, device=like.device))
    if e.dim() == 0:
        e = e.reshape(1)
    if e.dim() == 1:
        e = e[:, None].expand(-1, S)
    if e.dim() != 2 or e.shape[1] != S or e.shape[0] == 0:
        raise ValueError(f"eta must be a number, a vector (E,) or a grid (E, {S}), got shape {tuple(e.shape)}")
    if bool((e <= 0).any()):
        raise ValueError("eta must be > 0")
    return e[..., None, None]


def _adam(W: torch.Tensor, eta: torch.Tensor, opts: dict):
    """``torch.optim.Adam`` with one parameter group per step size; each parameter holds all seeds ``(S, m, d)``
    (Adam acts entrywise, so seeds batched in one tensor do not interact)."""
    if bool((eta != eta[:, :1]).any()):
        raise ValueError("Adam runs as torch.optim.Adam: eta must be the same for every seed (shape (E,))")
    params = [w.clone() for w in W]
    groups = [{"params": [p], "lr": float(lr)} for p, lr in zip(params, eta[:, 0, 0, 0])]
    return params, torch.optim.Adam(groups, betas=opts.get("betas", (0.9, 0.999)), eps=opts.get("lam_adam", 1e-8))


def run(method: str, problem: LayerProblem, n_steps: int, eta, **opts) -> torch.Tensor:
    r"""Iterate ``method`` on ``problem`` from ``W0`` for ``n_steps`` steps: :math:`W \leftarrow W - \eta\mathcal{P}(\nabla)`.

    ``eta``: a number, a vector ``(E,)`` (a grid of step sizes, run at once) or ``(E, S)`` (per seed).
    Returns the relative losses :math:`\mathcal{L}(W_t)/\mathcal{L}(W_0)`, shape ``(E, S, n_steps + 1)``; a run
    whose loss passes :math:`10^8\mathcal{L}(W_0)` is stopped and reported as ``inf`` from then on.
    ``opts``: ``lam_GN`` (the damping of NGD and K-FAC) and ``damping`` (K-FAC); ``eps`` (relative to
    :math:`\lVert\nabla\mathcal{L}(W_0)\rVert_2^2`) and ``exponent`` (Shampoo);
    ``betas``, ``lam_adam`` (Adam, SOAP; default Adam's :math:`(0.9, 0.999)` for both, so that SOAP differs from
    Adam only by its basis) and ``shampoo_beta`` (SOAP); ``momentum`` (Muon). Adam runs as
    ``torch.optim.Adam``. Muon runs :func:`muon_update`, the rule of ``torch.optim.Muon`` batched over seeds (torch's
    optimiser takes one 2-D matrix at a time and orthogonalises in bfloat16); the others use this module's rules.
    """
    check_choice("method", method, METHODS)
    if not isinstance(problem, LayerProblem):
        raise TypeError(f"problem must be a LayerProblem (see layer_problem), got {type(problem).__name__}")
    T = check_int("n_steps", n_steps, min_value=1)
    eta = _etas(eta, problem.X.shape[0], problem.X)
    with _one_thread_if_small(problem):
        return _iterate(method, problem, T, eta, opts)


def _one_thread_if_small(problem: LayerProblem):
    """Per-step tensors of a small problem are tiny: on the CPU, OpenMP's start-up cost per operation dominates and
    stalls badly when cores are shared, so :func:`run` iterates on one thread and restores the setting after."""
    return config.cpu_threads(1, when=problem.H.shape[-1] <= 1024, device=problem.X.device)


def _iterate(method: str, problem: LayerProblem, T: int, eta: torch.Tensor, opts: dict) -> torch.Tensor:
    """The loop of :func:`run`: one product with H per step gives the loss at W_t and the gradient for step t+1."""
    S, (m, d) = problem.X.shape[0], problem.shape
    W = problem.W0.expand(eta.shape[0], S, m, d).clone()
    e, He = problem._H_times_error(W)
    L0 = 0.5 * (e * He).sum(-1)                                          # (E, S), equal over E
    if method == "Adam":
        params, opt = _adam(W, eta, opts)
    else:
        direction = _direction(method, problem, W, opts)
    losses, alive = [L0 / L0], torch.ones(W.shape[:2], dtype=torch.bool, device=W.device)
    for _ in range(T):
        grad = He.reshape(W.shape)                                       # unvec(H e), row-major
        if method == "Adam":
            for p, g in zip(params, grad):
                p.grad = g
            opt.step()
            W_new = torch.stack(params)
        else:
            W_new = W - eta * direction(grad)
        e_new, He_new = problem._H_times_error(W_new)
        loss = 0.5 * (e_new * He_new).sum(-1) / L0
        alive = alive & torch.isfinite(loss) & (loss < _DIVERGED)
        W = torch.where(alive[..., None, None], W_new, W)
        He = torch.where(alive[..., None], He_new, He)
        losses.append(torch.where(alive, loss, torch.full_like(loss, math.inf)))
        if method == "Adam":  # a stopped run stays where it was
            with torch.no_grad():
                for p, w in zip(params, W):
                    p.copy_(w)
    return torch.stack(losses, dim=-1)


def _direction(method: str, problem: LayerProblem, W: torch.Tensor, opts: dict):
    """The preconditioned direction ``P(grad)`` of a method implemented here (state kept in a closure)."""
    if method == "GD":
        return lambda g: g
    if method == "NGD":
        return lambda g: linalg.unvec(natural_gradient_step(linalg.vec(g), problem.H, opts.get("lam_GN", 0.0)),
                                      problem.shape)
    if method == "K-FAC":
        C_out, C_in = problem.kfac_factors()
        return lambda g: kfac_step(g, C_out, C_in, opts.get("lam_GN", 0.0), opts.get("damping", "tikhonov"))
    state: dict = {}
    if method == "Shampoo":
        scale = float(torch.linalg.matrix_norm(problem.grad(problem.W0), ord=2).max()) ** 2
        state["s"] = shampoo_init(W, opts.get("eps", 1e-6) * scale)  # eps relative to |grad_0|_2^2

        def shampoo(g):
            out, state["s"] = shampoo_update(g, state["s"], opts.get("exponent", -0.25))
            return out
        return shampoo
    if method == "Muon":
        state["buf"] = torch.zeros_like(W)

        def muon(g):  # unit learning rate inside; run() multiplies by eta
            out, state["buf"] = muon_update(g, state["buf"], 1.0, opts.get("momentum", 0.95))
            return -out
        return muon
    state["s"] = soap_init(W)

    def soap(g):  # unit learning rate inside; run() multiplies by eta; Adam's betas unless given
        out, state["s"] = soap_update(g, state["s"], 1.0, opts.get("betas", (0.9, 0.999)),
                                      opts.get("lam_adam", 1e-8), opts.get("shampoo_beta"))
        return -out
    return soap


def linear_rate(H, precond=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Best constant step and rate of :math:`e \leftarrow (I - \eta\mathcal{P}^{-1}H)e` (chapter 02).

    With :math:`\lambda_i` the eigenvalues of :math:`\mathcal{P}^{-1}H` (those of :math:`\mathcal{P}^{-1/2}H
    \mathcal{P}^{-1/2}`) and :math:`\kappa = \lambda_{\max}/\lambda_{\min}`: :math:`\eta^\star = 2/(\lambda_{\max} +
    \lambda_{\min})` minimises :math:`\max_i|1 - \eta\lambda_i|`, whose value is the rate :math:`(\kappa - 1)/(\kappa + 1)`.
    ``precond`` (:math:`\mathcal{P}`) ``= None`` is GD (:math:`\mathcal{P} = I`). ``H, precond: (..., p, p)`` positive
    definite. Returns ``(eta_star, rate)``, float64.
    """
    H = check_matrix("H", H, square=True, batch=True)
    K = config.spectral(H)
    if precond is not None:
        root = psd_power(config.spectral(_square_factor("precond", precond, H.shape[-1], H)), -0.5)
        K = root @ K @ root
    lam = _eigh_psd("H", 0.5 * (K + K.transpose(-2, -1)), strict=True)[0]
    lo, hi = lam[..., 0], lam[..., -1]
    return 2.0 / (hi + lo), (hi - lo) / (hi + lo)


def tune(method: str, problem: LayerProblem, n_steps: int, etas, *, tune_seeds=None, tail: float = 0.1,
         **opts) -> tuple[float, torch.Tensor, torch.Tensor]:
    r"""Run ``method`` for every step size of ``etas`` at once and pick the best on the tuning seeds.

    The score of a step size is the mean over ``tune_seeds`` (indices of seeds; default all) of
    :math:`\log_{10}` of the mean relative loss over the last ``tail`` fraction of the run; a run that diverged
    scores ``inf``. Returns ``(best_eta, scores (E,), losses (S, n_steps + 1))``, the losses being those of every
    seed at ``best_eta`` — report the seeds *not* in ``tune_seeds``: seeds are independent, so they are the same
    as a separate run at ``best_eta``.
    """
    e = check_finite("etas", as_tensor("etas", etas, dtype=problem.X.dtype))
    if e.dim() != 1 or e.numel() < 1:
        raise ValueError(f"etas must be a non-empty vector of step sizes, got shape {tuple(e.shape)}")
    tail = check_positive("tail", tail)
    if tail > 1:
        raise ValueError(f"tail must be in (0, 1], got {tail}")
    S = problem.X.shape[0]
    idx = list(range(S)) if tune_seeds is None else list(tune_seeds)
    if not idx or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < S for i in idx):
        raise ValueError(f"tune_seeds must be a non-empty list of seed indices in [0, {S}), got {tune_seeds!r}")
    losses = run(method, problem, n_steps, e, **opts)
    k = max(1, int(round(tail * n_steps)))
    scores = losses[:, idx, -k:].mean(-1).log10().mean(-1)
    scores = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, math.inf))
    best = int(torch.argmin(scores))
    return float(e[best]), scores, losses[best]


def run_protocol(method: str, problem: LayerProblem, n_steps: int, etas, tune_seeds,
                 **opts) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Chapter 02's step-size protocol, fixed before any run.

    The linear preconditioners GD, K-FAC and NGD (undamped) take the best constant step of their preconditioned
    spectrum, :math:`2/(\mu_{\max} + \mu_{\min})` per seed (:func:`linear_rate`; :math:`\eta = 1` for NGD); the
    other methods get the step of ``etas`` that :func:`tune` picks on ``tune_seeds``. Returns ``(eta, losses)``,
    shapes ``(S,)`` and ``(S, n_steps + 1)``, for every seed; report the seeds not in ``tune_seeds``.
    """
    check_choice("method", method, METHODS)
    if method in ("GD", "K-FAC", "NGD"):
        if not isinstance(problem, LayerProblem):
            raise TypeError(f"problem must be a LayerProblem, got {type(problem).__name__}")
        P = {"GD": None, "NGD": problem.H, "K-FAC": linalg.kron(*problem.kfac_factors())}[method]
        eta = linear_rate(problem.H, P)[0]
        return eta, run(method, problem, n_steps, eta[None], **opts)[0]
    best, _, losses = tune(method, problem, n_steps, etas, tune_seeds=tune_seeds, **opts)
    return torch.full(losses.shape[:1], best, dtype=losses.dtype, device=losses.device), losses


def preconditioned_loss_curve(H, precond, e0, eta, n_steps: int) -> torch.Tensor:
    r"""Exact loss curve of :math:`e_{t+1} = (I - \eta\mathcal{P}^{-1}H)e_t` on :math:`\mathcal{L} = \tfrac12 e^\top He`.

    With :math:`\mathcal{P}^{-1/2}H\mathcal{P}^{-1/2} = Q\operatorname{diag}(\lambda)Q^\top` and
    :math:`\tilde e = Q^\top\mathcal{P}^{1/2}e_0` (chapter 02):

    .. math::  \mathcal{L}_t = \tfrac12\sum_i \lambda_i (1 - \eta\lambda_i)^{2t}\,\tilde e_i^2,

    so the rate is :math:`\max_i|1-\eta\lambda_i|`. ``precond`` (:math:`\mathcal{P}`) is the identity for GD,
    :math:`H` for NGD, :math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}` for K-FAC. ``H, precond: (..., p, p)``
    (``precond`` positive definite), ``e0: (..., p)``, ``eta > 0``. Float64; returns :math:`\mathcal{L}_t` for
    ``t = 0..n_steps``, shape ``(..., n_steps + 1)``.
    """
    H = check_matrix("H", H, square=True, batch=True)
    P = _square_factor("precond", precond, H.shape[-1], H)
    e0 = check_finite("e0", as_tensor("e0", e0, dtype=H.dtype, device=H.device))
    if e0.shape[-1] != H.shape[-1]:
        raise ValueError(f"e0 must have last dimension {H.shape[-1]}, got {tuple(e0.shape)}")
    eta = check_positive("eta", eta)
    T = check_int("n_steps", n_steps, min_value=0)
    P_half, P_inv_half = psd_power(config.spectral(P), 0.5), psd_power(config.spectral(P), -0.5)
    K = P_inv_half @ config.spectral(H) @ P_inv_half
    lam, Q = linalg._eigh("H", 0.5 * (K + K.transpose(-2, -1)))
    e_rot = (Q.transpose(-2, -1) @ (P_half @ config.spectral(e0).unsqueeze(-1))).squeeze(-1)
    t = torch.arange(T + 1, dtype=torch.float64, device=lam.device)
    factors = (1 - eta * lam)[..., None, :] ** (2 * t[:, None])
    return 0.5 * (factors * (lam * e_rot**2)[..., None, :]).sum(-1)


def kfac_gap(problem: LayerProblem, n2: int) -> torch.Tensor:
    r"""The gap :math:`H_{\mathrm{GN}} - C_{\mathrm{out}}\otimes C_{\mathrm{in}}` predicted by chapter 02's lemma for a
    two-group :class:`LayerProblem` whose last ``n2`` samples form group 2 (as :func:`layer_problem` builds it):

    .. math:: \nu_1\nu_2\,(B_1 - B_2)\otimes(\hat\Sigma_1 - \hat\Sigma_2),\qquad
              B_k = V_k^\top V_k,\quad \hat\Sigma_k = X_k^\top X_k/n_k,\quad \nu_k = n_k/n,

    computed from the groups' heads and inputs only (never from :math:`H_{\mathrm{GN}}`). ``(S, md, md)``."""
    if not isinstance(problem, LayerProblem):
        raise TypeError(f"problem must be a LayerProblem, got {type(problem).__name__}")
    n = problem.X.shape[-2]
    n2 = check_int("n2", n2, min_value=0)
    if n2 > n:
        raise ValueError(f"n2 must be at most the number of samples n = {n}, got {n2}")
    if n2 in (0, n):
        p = problem.H.shape[-1]
        return torch.zeros(problem.X.shape[0], p, p, dtype=problem.X.dtype, device=problem.X.device)
    out = []
    for g in (slice(0, n - n2), slice(n - n2, n)):
        V, X = problem.heads[:, g][:, 0], problem.X[:, g]
        out.append((V.transpose(-2, -1) @ V, X.transpose(-2, -1) @ X / X.shape[-2]))
    (B1, S1), (B2, S2) = out
    return (n - n2) / n * n2 / n * linalg.kron(B1 - B2, S1 - S2)
