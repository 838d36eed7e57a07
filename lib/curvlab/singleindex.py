r"""One giant step in a single-index model (chapter *One giant step in single-index models*,
``notebooks/12_single_index_giant_step``).

**Model.** Inputs :math:`x\sim\mathcal N(0,\Sigma)` in :math:`\mathbb R^d`, a unit direction :math:`\beta_\star`, a
link :math:`\phi_\star` and labels :math:`y=\phi_\star(\langle\beta_\star,x\rangle)+\varepsilon`,
:math:`\varepsilon\sim\mathcal N(0,\sigma_\varepsilon^2)`. The network is
:math:`f(x)=v^\top\phi(Wx)/\sqrt m` with :math:`W\in\mathbb R^{m\times d}`. One full-batch step on :math:`W` from
a random initialisation, then ridge regression on :math:`v` (the *giant step* of Ba et al. 2022).

**Coordinates.** Every method here (the gradient step, K-FAC's right factor, an isotropic Gaussian
initialisation) is equivariant under rotations of :math:`x`, so the module works in the eigenbasis of
:math:`\Sigma`: ``eigenvalues`` is the diagonal of :math:`\Sigma` and ``beta`` holds the coordinates of
:math:`\beta_\star` in that basis. A quadratic form :math:`\beta_\star^\top g(\Sigma)\beta_\star` is then
``(beta**2 * g(eigenvalues)).sum()``; for a delocalised :math:`\beta_\star` (all squared coordinates
:math:`1/d`, :func:`beta_star` ``kind="flat"``) it *equals* the normalised trace
:math:`\tfrac1d\operatorname{tr}g(\Sigma)` of the random-:math:`\beta_\star` formulas.

**Notation** (book ↔ the papers' digest): aspect ratio :math:`\gamma=d/n` (digest :math:`\phi`), width
:math:`m` (:math:`N`), output weights :math:`v` (:math:`a`), activation :math:`\phi` (:math:`\sigma`), link
:math:`\phi_\star` (:math:`\sigma_\star`), effective ridge :math:`\tau` (:math:`\kappa`), and K-FAC's right factor
:math:`(\hat\Sigma+\lambda_GI)^{-1}` with :math:`\hat\Sigma=X^\top X/n`, as in the linear-representation
chapters.

What is here:

* problems: :func:`spectrum`, :func:`beta_star`, :data:`LINKS`, :func:`link_moments`, :func:`sample`;
* the network and the step: :func:`init_network`, :func:`features`, :func:`neg_gradient`, :func:`giant_step`,
  :func:`scale_to_norm`, :func:`spike_direction`, :func:`ridge_head`, :func:`risk`;
* idealised spikes :func:`ideal_spikes`, the held-out damping :func:`select_lam_G`, and :func:`cosine`;
* theory: :func:`sgd_cosine`, :func:`kfac_cosine`, :func:`ols_cosine`, :func:`population_kfac_cosine`,
  :func:`effective_ridge_two_level` (the cubic, vectorised in :math:`\lambda_G` *and* :math:`\gamma`),
  :func:`optimal_lam_G`;
* the experiment: :func:`giant_step_experiment` (batched over replicates, tidy frame).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from . import config, rmt
from ._validate import as_tensor, check_choice, check_finite, check_int, check_nonnegative, check_positive

__all__ = [
    "LINKS",
    "ACTIVATIONS",
    "spectrum",
    "beta_star",
    "LinkMoments",
    "link_moments",
    "hermite_nodes",
    "MAX_NODES",
    "sample",
    "init_network",
    "features",
    "neg_gradient",
    "giant_step",
    "scale_to_norm",
    "spike_direction",
    "ridge_head",
    "risk",
    "ideal_spikes",
    "select_lam_G",
    "cosine",
    "sgd_cosine",
    "kfac_cosine",
    "ols_cosine",
    "population_kfac_cosine",
    "effective_ridge_two_level",
    "optimal_lam_G",
    "giant_step_experiment",
]

F64 = torch.float64

#: Links :math:`\phi_\star`. All but ``"he2"`` have :math:`c_1=\E\phi_\star'\ne0`; ``"he2"``
#: (:math:`z^2-1`, even) has :math:`c_1=0` and is the negative control.
LINKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "linear": lambda z: z,
    "tanh": torch.tanh,
    "tanh2": lambda z: torch.tanh(2 * z),
    "cubic": lambda z: z + z**3 / 3,
    "he2": lambda z: z**2 - 1,
}

#: Activations :math:`\phi` of the network and their derivatives.
ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "relu": (torch.relu, lambda z: (z > 0).to(z.dtype)),
    "tanh": (torch.tanh, lambda z: 1 - torch.tanh(z) ** 2),
}


# ============================================================================================ helpers
def _vec(name: str, value, *, positive: bool = False) -> torch.Tensor:
    t = check_finite(name, as_tensor(name, value, dtype=F64))
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty vector, got shape {tuple(t.shape)}")
    if positive and bool((t <= 0).any()):
        raise ValueError(f"{name} must be > 0, got min {float(t.min()):.3g}")
    return t


def _link(link) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(link):
        return link
    if not isinstance(link, str):
        raise TypeError(f"link must be a name in {list(LINKS)} or a callable, got {type(link).__name__}")
    return LINKS[check_choice("link", link, tuple(LINKS))]


def _activation(activation: str) -> tuple[Callable, Callable]:
    if not isinstance(activation, str):
        raise TypeError(f"activation must be one of {list(ACTIVATIONS)}, got {type(activation).__name__}")
    return ACTIVATIONS[check_choice("activation", activation, tuple(ACTIVATIONS))]


def _spectrum_and_beta(eigenvalues, beta_sq) -> tuple[torch.Tensor, torch.Tensor]:
    s = _vec("eigenvalues", eigenvalues, positive=True)
    b2 = _vec("beta_sq", beta_sq)
    if b2.shape != s.shape:
        raise ValueError(f"beta_sq must have the shape of eigenvalues {tuple(s.shape)}, got {tuple(b2.shape)}")
    if bool((b2 < 0).any()) or abs(float(b2.sum()) - 1.0) > 1e-8:
        raise ValueError("beta_sq must hold the squared coordinates of a unit vector (>= 0, summing to 1)")
    return s, b2


def _spd_solve(name: str, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A^{-1} B for a batch of symmetric positive definite A, by Cholesky (batched LU solves misbehave in
    some MKL builds for large batches; Cholesky is also the right tool for an SPD system)."""
    L, info = torch.linalg.cholesky_ex(0.5 * (A + A.transpose(-2, -1)))
    if bool((info != 0).any()):
        raise ValueError(f"{name} is not positive definite (increase the penalty)")
    return torch.cholesky_solve(B, L)


def _data(X, y) -> tuple[torch.Tensor, torch.Tensor]:
    X = check_finite("X", as_tensor("X", X))
    y = check_finite("y", as_tensor("y", y, dtype=X.dtype))
    if X.dim() < 2:
        raise ValueError(f"X must have shape (..., n, d), got {tuple(X.shape)}")
    if y.shape != X.shape[:-1]:
        raise ValueError(f"y must have shape {tuple(X.shape[:-1])} (one label per row of X), got {tuple(y.shape)}")
    return X, y


# ============================================================================================ problems
def spectrum(kind: str, d: int, anisotropy: float = 1.0, *, fraction: float = 0.5, mean: float = 1.0) -> torch.Tensor:
    r"""Eigenvalues of :math:`\Sigma` (decreasing, float64, ``(d,)``) with condition number ``anisotropy``.

    ``kind``: ``"isotropic"`` (all equal; ``anisotropy`` must be 1), ``"two-level"`` (a ``fraction`` of the
    eigenvalues at the high level, the rest at the low one, ratio ``anisotropy``), ``"power-law"``
    (:math:`\lambda_i\propto i^{-\alpha}` with :math:`\lambda_1/\lambda_d=` ``anisotropy``) or ``"spiked"``
    (:math:`I+\xi e_1e_1^\top`, :math:`1+\xi=` ``anisotropy``). The spectrum is scaled to the given ``mean``
    :math:`\operatorname{tr}\Sigma/d`, so pre-activations stay of order one as the anisotropy grows.
    The papers' digest's two-level example (levels 4 and 1/4) is ``spectrum("two-level", d, 16, mean=2.125)``.
    """
    check_choice("kind", kind, ("isotropic", "two-level", "power-law", "spiked"))
    d = check_int("d", d, min_value=2)
    r = check_positive("anisotropy", anisotropy)
    mean = check_positive("mean", mean)
    if r < 1:
        raise ValueError(f"anisotropy must be >= 1 (a condition number), got {r}")
    if kind == "isotropic":
        if r != 1:
            raise ValueError(f"an isotropic spectrum has anisotropy 1, got {r}")
        s = torch.ones(d, dtype=F64)
    elif kind == "two-level":
        f = check_positive("fraction", fraction)
        k = round(f * d)
        if not 0 < k < d:
            raise ValueError(f"fraction * d must round to an integer in (0, d), got {f} * {d}")
        s = torch.cat([torch.full((k,), r, dtype=F64), torch.ones(d - k, dtype=F64)])
    elif kind == "power-law":
        i = torch.arange(1, d + 1, dtype=F64)
        s = i ** (-math.log(r) / math.log(d))
    else:
        s = torch.ones(d, dtype=F64)
        s[0] = r
    return s * (mean / s.mean())


def beta_star(d: int, kind: str = "flat", *, index: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""A unit :math:`\beta_\star` in the eigenbasis of :math:`\Sigma`, float64 ``(d,)``.

    ``"flat"``: random signs :math:`\pm1/\sqrt d` — a delocalised direction whose quadratic forms equal the
    normalised traces *exactly*, at every :math:`d`; ``"haar"``: uniform on the sphere (quadratic forms equal
    the traces up to :math:`O(d^{-1/2})`); ``"eigenvector"``: the basis vector ``index`` (an eigenvector of
    :math:`\Sigma`: the control where the gradient spike is unbiased).
    """
    d = check_int("d", d, min_value=1)
    check_choice("kind", kind, ("flat", "haar", "eigenvector"))
    if kind == "eigenvector":
        index = check_int("index", index, min_value=0)
        if index >= d:
            raise ValueError(f"index must be < d = {d}, got {index}")
        b = torch.zeros(d, dtype=F64)
        b[index] = 1.0
        return b
    if kind == "flat":
        return (torch.randint(0, 2, (d,), generator=generator) * 2 - 1).to(F64) / math.sqrt(d)
    b = torch.randn(d, generator=generator, dtype=F64)
    return b / b.norm()


class LinkMoments(NamedTuple):
    r"""Moments of the link at :math:`z=\langle\beta_\star,x\rangle\sim\mathcal N(0,s^2)`,
    :math:`s^2=\beta_\star^\top\Sigma\beta_\star`.

    ``c1`` — :math:`c_1=\E\phi_\star'(z)=\E[\phi_\star(z)z]/s^2` (Stein); ``Ey2`` — :math:`\E y^2` (noise
    included); ``sigma_eff2`` — :math:`\sigma_{\mathrm{eff}}^2=\E y^2-c_1^2s^2`, the part of :math:`y` that a
    linear spike cannot use; ``s2`` — :math:`s^2`.
    """

    c1: float
    Ey2: float
    sigma_eff2: float
    s2: float


#: Largest number of quadrature nodes :func:`link_moments` accepts (the Golub–Welsch eigenproblem is
#: ``nodes x nodes``; far more nodes than any smooth link needs).
MAX_NODES = 4000


def hermite_nodes(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    r"""Gauss–Hermite rule for the **standard normal** law: nodes :math:`x_j` and weights :math:`w_j`
    (:math:`\sum_jw_j=1`, :math:`\sum_jw_jh(x_j)=\E h(g)` exactly for polynomials of degree below ``2*nodes``).

    Computed by Golub–Welsch: the nodes are the eigenvalues of the symmetric tridiagonal Jacobi matrix of the
    probabilists' Hermite polynomials (off-diagonal :math:`\sqrt k`), the weights the squared first components of
    its unit eigenvectors. Unlike NumPy's ``hermegauss`` (which evaluates the polynomials and overflows to NaN
    weights beyond about 300 nodes) this stays finite at every size; weights of far-out nodes underflow to 0.
    ``nodes`` must lie in ``[2, MAX_NODES]``.
    """
    nodes = check_int("nodes", nodes, min_value=2)
    if nodes > MAX_NODES:
        raise ValueError(f"nodes must lie in [2, {MAX_NODES}], got {nodes}")
    from scipy.linalg import eigh_tridiagonal

    off = np.sqrt(np.arange(1, nodes, dtype=np.float64))
    x, V = eigh_tridiagonal(np.zeros(nodes), off)
    w = V[0] ** 2
    return x, w / w.sum()


def link_moments(link, s2: float, noise_std: float = 0.0, *, nodes: int = 120) -> LinkMoments:
    r""":math:`c_1`, :math:`\E y^2` and :math:`\sigma_{\mathrm{eff}}^2` of ``link`` at variance ``s2``, by
    Gauss–Hermite quadrature with ``nodes`` nodes (exact for polynomial links of degree below ``2*nodes``;
    ``nodes`` in ``[2, MAX_NODES]``, rule from :func:`hermite_nodes`, stable at every size).

    :math:`c_1` is computed in Stein's form :math:`\E[\phi_\star(z)z]/s^2`, which needs no derivative, so
    ``link`` may be any name in :data:`LINKS` or a callable on float64 tensors. A link that is not finite where
    the rule has weight (it overflows at the far nodes) raises a ValueError naming ``link`` and ``nodes``.
    """
    f = _link(link)
    s2 = check_positive("s2", s2)
    noise_std = check_nonnegative("noise_std", noise_std)
    x, w = hermite_nodes(nodes)
    keep = w > 0                                   # underflowed far-out nodes carry no weight
    z = torch.as_tensor(x[keep], dtype=F64) * math.sqrt(s2)
    w = torch.as_tensor(w[keep], dtype=F64)
    fz = f(z)
    if not bool(torch.isfinite(fz).all()):
        raise ValueError(f"link is not finite at the quadrature nodes (|z| up to {float(z.abs().max()):.3g}); "
                         f"use fewer nodes (got nodes={nodes})")
    c1 = float((w * fz * z).sum()) / s2
    Ey2 = float((w * fz**2).sum()) + noise_std**2
    if not (math.isfinite(c1) and math.isfinite(Ey2) and math.isfinite(c1 * c1 * s2)):
        raise ValueError(f"link has no finite Gaussian moments at s2={s2:g} with nodes={nodes} "
                         f"(c1={c1:.3g}, E y^2={Ey2:.3g}): the link grows too fast")
    return LinkMoments(c1, Ey2, max(Ey2 - c1**2 * s2, 0.0), s2)


def sample(eigenvalues, beta, link, n: int, replicates: int, *, noise_std: float = 0.0,
           generator: torch.Generator | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``replicates`` independent data sets: :math:`X` ``(R, n, d)`` with rows :math:`x\sim\mathcal N(0,\Sigma)`
    (:math:`\Sigma` diagonal in its eigenbasis) and :math:`y=\phi_\star(X\beta_\star)+\varepsilon` ``(R, n)``,
    float64 on ``device`` (default :func:`curvlab.config.device`; the CPU generator draws, then moves).
    """
    s = _vec("eigenvalues", eigenvalues, positive=True)
    b = _vec("beta", beta)
    if b.shape != s.shape:
        raise ValueError(f"beta must have the shape of eigenvalues {tuple(s.shape)}, got {tuple(b.shape)}")
    f = _link(link)
    n, R = check_int("n", n, min_value=1), check_int("replicates", replicates, min_value=1)
    noise_std = check_nonnegative("noise_std", noise_std)
    dev = config.spectral_device(config.device() if device is None else device)
    X = (torch.randn(R, n, s.numel(), generator=generator, dtype=F64) * s.sqrt()).to(dev)
    eps = torch.randn(R, n, generator=generator, dtype=F64).to(dev) * noise_std
    return X, f(X @ b.to(dev)) + eps


# ============================================================================================ network
def init_network(replicates: int, m: int, d: int, *, generator: torch.Generator | None = None,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Symmetric random initialisation: ``W0`` ``(R, m, d)`` with rows :math:`w_j\sim\mathcal N(0,I_d/d)` and
    ``v`` ``(R, m)`` with :math:`v_j=\pm1`, neurons in pairs :math:`(w,+1),(w,-1)`, so that :math:`f_0\equiv0`.

    With :math:`f_0=0` the first gradient is driven by the labels alone; an unpaired initialisation adds an
    :math:`O(1)` spike along :math:`W_0^\top v` that has nothing to do with :math:`\beta_\star`. ``m`` must be even.
    """
    R, m, d = (check_int(k, x, min_value=1) for k, x in (("replicates", replicates), ("m", m), ("d", d)))
    if m % 2:
        raise ValueError(f"m must be even (neurons come in +/- pairs), got {m}")
    dev = config.spectral_device(config.device() if device is None else device)
    half = torch.randn(R, m // 2, d, generator=generator, dtype=F64) / math.sqrt(d)
    W0 = half.repeat_interleave(2, dim=1).to(dev)
    v = torch.tensor([1.0, -1.0], dtype=F64).repeat(m // 2).expand(R, m).contiguous().to(dev)
    return W0, v


def features(X, W, activation: str = "relu") -> torch.Tensor:
    r"""Hidden features :math:`\phi(XW^\top)/\sqrt m`, ``X`` ``(..., n, d)``, ``W`` ``(..., m, d)`` → ``(..., n, m)``."""
    act, _ = _activation(activation)
    W = check_finite("W", as_tensor("W", W))
    return act(X @ W.transpose(-2, -1)) / math.sqrt(W.shape[-2])


def neg_gradient(X, y, W, v, activation: str = "relu") -> torch.Tensor:
    r"""The negative gradient of :math:`\Loss(W)=\frac1{2n}\sum_i(f(x_i)-y_i)^2` with respect to :math:`W`:

    .. math::

        -\nabla_W\Loss=\frac1{n\sqrt m}\,\big[(v\,r^\top)\odot\phi'(WX^\top)\big]X,\qquad r=y-f(X).

    Shapes ``X`` ``(..., n, d)``, ``y`` ``(..., n)``, ``W`` ``(..., m, d)``, ``v`` ``(..., m)`` → ``(..., m, d)``.
    """
    X, y = _data(X, y)
    act, dact = _activation(activation)
    W = check_finite("W", as_tensor("W", W, dtype=X.dtype))
    v = check_finite("v", as_tensor("v", v, dtype=X.dtype))
    if W.shape[-1] != X.shape[-1] or v.shape[-1] != W.shape[-2]:
        raise ValueError(f"W must be (..., m, {X.shape[-1]}) and v (..., m); got {tuple(W.shape)}, {tuple(v.shape)}")
    m, n = W.shape[-2], X.shape[-2]
    pre = X @ W.transpose(-2, -1)                                   # (..., n, m)
    r = y - (act(pre) * v.unsqueeze(-2)).sum(-1) / math.sqrt(m)       # residual y - f(X)
    back = dact(pre) * r.unsqueeze(-1) * v.unsqueeze(-2)            # (..., n, m)
    return back.transpose(-2, -1) @ X / (n * math.sqrt(m))


def giant_step(X, y, W0, v, *, method: str = "SGD", lam_G: float = 1e-3, activation: str = "relu") -> torch.Tensor:
    r"""Direction of the first step on :math:`W` (unscaled; see :func:`scale_to_norm`):

    .. math::

        \Delta_{\mathrm{SGD}}=-\nabla_W\Loss,\qquad
        \Delta_{\mathrm{K\text{-}FAC}}=-\nabla_W\Loss\,(\hat\Sigma+\lambda_GI_d)^{-1},\quad \hat\Sigma=X^\top X/n.

    K-FAC is used with its **right (input) factor only**: to leading order the gradient is the rank-one
    :math:`\frac{\mu_1}{\sqrt m}v\,u_{\mathrm{SGD}}^\top`, and a left factor multiplies it on the left, which
    cannot change its right singular vector — the direction the step learns.
    """
    check_choice("method", method, ("SGD", "K-FAC"))
    G = neg_gradient(X, y, W0, v, activation)
    if method == "SGD":
        return G
    lam_G = check_nonnegative("lam_G", lam_G)
    d, n = X.shape[-1], X.shape[-2]
    A = X.transpose(-2, -1) @ X / n + lam_G * torch.eye(d, dtype=X.dtype, device=X.device)
    return _spd_solve("Sigma_hat + lam_G I", A, G.transpose(-2, -1)).transpose(-2, -1)   # G A^{-1}


def scale_to_norm(D, norm) -> torch.Tensor:
    r"""The step :math:`\eta D` with :math:`\eta` chosen so that :math:`\lVert\eta D\rVert_2=` ``norm``, for each
    matrix of the batch ``D`` ``(..., m, d)``; ``norm`` a number or a tensor broadcasting against the batch.

    This is the book's **step-size matching rule**: SGD and K-FAC steps are compared at equal operator norm of
    the update :math:`\Delta W`, which fixes the strength of the rank-one spike each neuron receives.
    """
    D = check_finite("D", as_tensor("D", D))
    target = as_tensor("norm", norm, dtype=D.dtype, device=D.device)
    if bool((target < 0).any()):
        raise ValueError("norm must be >= 0")
    op = torch.linalg.matrix_norm(D, ord=2)
    if bool((op == 0).any()):
        raise ValueError("D has a zero matrix in its batch: no direction to scale")
    return D * (target / op).unsqueeze(-1).unsqueeze(-1)


def spike_direction(D) -> torch.Tensor:
    r"""Top right singular vector of each update ``D`` ``(..., m, d)``: the spike's direction :math:`\hat u`
    (sign arbitrary; compare with :func:`cosine` in absolute value). Returns ``(..., d)``."""
    D = check_finite("D", as_tensor("D", D))
    if D.dim() < 2:
        raise ValueError(f"D must be a (batch of) matrix, got shape {tuple(D.shape)}")
    _, V = rmt._eigh(D.transpose(-2, -1) @ D)          # d x d Gram: cheaper than an SVD when m > d
    return V[..., :, -1]


def ridge_head(Phi, y, lam_v: float) -> torch.Tensor:
    r"""Ridge regression of the output layer on features ``Phi`` ``(..., n, m)``:
    :math:`\hat v=(\Phi^\top\Phi/n+\lambda_vI_m)^{-1}\Phi^\top y/n`, returns ``(..., m)``."""
    Phi = check_finite("Phi", as_tensor("Phi", Phi))
    y = check_finite("y", as_tensor("y", y, dtype=Phi.dtype))
    if y.shape != Phi.shape[:-1]:
        raise ValueError(f"y must have shape {tuple(Phi.shape[:-1])}, got {tuple(y.shape)}")
    lam_v = check_positive("lam_v", lam_v)
    n, m = Phi.shape[-2], Phi.shape[-1]
    A = Phi.transpose(-2, -1) @ Phi / n + lam_v * torch.eye(m, dtype=Phi.dtype, device=Phi.device)
    return _spd_solve("Phi^T Phi / n + lam_v I", A, Phi.transpose(-2, -1) @ y.unsqueeze(-1) / n).squeeze(-1)


def risk(Phi, y, v_hat) -> torch.Tensor:
    r"""Mean squared error :math:`\frac1n\lVert\Phi\hat v-y\rVert^2` (``(..., n, m)``, ``(..., n)``, ``(..., m)`` → ``(...)``)."""
    Phi = as_tensor("Phi", Phi)
    return ((Phi @ as_tensor("v_hat", v_hat, dtype=Phi.dtype).unsqueeze(-1)).squeeze(-1) - y).square().mean(-1)


# ============================================================================================ idealised spikes
def ideal_spikes(X, y, lam_G) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The idealised spikes :math:`u_{\mathrm{SGD}}=X^\top y/n` ``(..., d)`` and
    :math:`u_{\mathrm{KFAC}}=(\hat\Sigma+\lambda_GI)^{-1}X^\top y/n` ``(..., L, d)`` for a vector ``lam_G`` ``(L,)``
    of penalties :math:`\ge0` (one eigen-decomposition of :math:`\hat\Sigma` serves the whole grid).

    :math:`\lambda_G=0` is the least-squares spike, as in :func:`kfac_cosine`: the pseudo-inverse
    :math:`\hat\Sigma^+X^\top y/n` — OLS when :math:`n>d`, the minimum-norm interpolator when :math:`d>n`. The
    eigenvalues of :math:`\hat\Sigma` treated as zero are those below :math:`\max(n,d)\,\epsilon\,\lambda_{\max}`
    (NumPy's ``pinv`` convention, :math:`\epsilon` the dtype's machine epsilon).
    """
    X, y = _data(X, y)
    lam = _vec("lam_G", lam_G).to(device=X.device, dtype=X.dtype)
    if bool((lam < 0).any()):
        raise ValueError(f"lam_G must be >= 0, got min {float(lam.min()):.3g}")
    n = X.shape[-2]
    u = (X.transpose(-2, -1) @ y.unsqueeze(-1)).squeeze(-1) / n
    e, Q = rmt.sample_covariance_eigh(X, vectors=True)
    e, Q = e.to(u.dtype), Q.to(u.dtype)
    coef = (Q.transpose(-2, -1) @ u.unsqueeze(-1)).squeeze(-1)               # (..., d)
    e = e.clamp_min(0.0).unsqueeze(-2)                                         # (..., 1, d)
    filt = 1.0 / (e + lam.unsqueeze(-1))                                       # (..., L, d)
    if bool((lam == 0).any()):
        cut = max(X.shape[-2:]) * torch.finfo(X.dtype).eps * e.amax(-1, keepdim=True)
        pinv = torch.where(e > cut, 1.0 / torch.where(e > cut, e, torch.ones_like(e)), torch.zeros_like(e))
        filt = torch.where((lam == 0).unsqueeze(-1), pinv, filt)
    return u, (filt * coef.unsqueeze(-2)) @ Q.transpose(-2, -1)


def select_lam_G(X, y, X_val, y_val, grid) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The damping chosen on **held-out samples**: for each replicate, the :math:`\lambda_G` of ``grid`` whose
    K-FAC spike, read as a linear predictor :math:`x\mapsto\langle u_{\mathrm{KFAC}}(\lambda_G),x\rangle` (the ridge
    estimator), has the smallest mean squared error on ``(X_val, y_val)``. No population quantity enters.

    ``X`` ``(..., n, d)``, ``y`` ``(..., n)``, ``X_val`` ``(..., n_val, d)``, ``y_val`` ``(..., n_val)``, ``grid``
    ``(L,)`` penalties :math:`\ge0`, fixed before the run. Returns ``(index, val_mse)``: the chosen grid index
    ``(...)`` and the validation errors ``(..., L)``. Use :func:`curvlab.checks.at_grid_edge` on the choice.
    """
    Xv, yv = _data(X_val, y_val)
    lam = _vec("grid", grid)
    if lam.numel() < 2:
        raise ValueError(f"grid must hold at least 2 penalties, got {lam.numel()}")
    _, uk = ideal_spikes(X, y, lam)                                    # (..., L, d)
    if Xv.shape[-1] != uk.shape[-1]:
        raise ValueError(f"X_val must have {uk.shape[-1]} columns like X, got shape {tuple(Xv.shape)}")
    pred = Xv.to(uk.device) @ uk.transpose(-2, -1)                     # (..., n_val, L)
    mse = (pred - yv.to(uk.device).unsqueeze(-1)).square().mean(-2)    # (..., L)
    return mse.argmin(-1), mse


def cosine(u, w, *, absolute: bool = False) -> torch.Tensor:
    r"""Cosine :math:`\langle u,w\rangle/(\lVert u\rVert\lVert w\rVert)` along the last dimension (broadcasting);
    ``absolute=True`` for directions defined up to sign (singular vectors)."""
    u = check_finite("u", as_tensor("u", u))
    w = check_finite("w", as_tensor("w", w, dtype=u.dtype, device=u.device))
    c = (u * w).sum(-1) / (u.norm(dim=-1) * w.norm(dim=-1)).clamp_min(torch.finfo(u.dtype).tiny)
    return c.abs() if absolute else c


# ============================================================================================ theory
def sgd_cosine(eigenvalues, beta_sq, c1: float, Ey2: float, gamma, *, target: str = "beta") -> torch.Tensor:
    r"""Limit of :math:`\cos(u_{\mathrm{SGD}},\beta_\star)` in the proportional regime, for a fixed :math:`\beta_\star`:

    .. math::

        \cos(u_{\mathrm{SGD}},\beta_\star)\to\frac{c_1\,\beta_\star^\top\Sigma\beta_\star}
        {\sqrt{c_1^2\,\beta_\star^\top\Sigma^2\beta_\star+\E[y^2]\,\gamma\operatorname{tr}(\Sigma)/d}},

    from :math:`u_{\mathrm{SGD}}=c_1\hat\Sigma\beta_\star+X^\top r/n` and :math:`\E\hat\Sigma^2=\Sigma^2+(\Sigma^2+
    \Sigma\operatorname{tr}\Sigma)/n`. ``beta_sq``: squared coordinates of :math:`\beta_\star` in the eigenbasis.
    ``gamma`` :math:`\ge0`, any shape (:math:`\gamma=0` is the population limit
    :math:`\beta_\star^\top\Sigma\beta_\star/\lVert\Sigma\beta_\star\rVert`, times the sign of :math:`c_1`).
    ``target="Sigma_beta"`` gives instead the cosine with :math:`\Sigma\beta_\star`, the direction the spike is
    biased towards: :math:`c_1\lVert\Sigma\beta_\star\rVert/\sqrt{\cdots}`, with the same denominator (:math:`\to1`
    as :math:`\gamma\to0`).
    """
    check_choice("target", target, ("beta", "Sigma_beta"))
    s, b2 = _spectrum_and_beta(eigenvalues, beta_sq)
    c1 = float(check_finite("c1", as_tensor("c1", c1, dtype=F64)))
    Ey2 = check_nonnegative("Ey2", Ey2)
    g = check_finite("gamma", as_tensor("gamma", gamma, dtype=F64))
    if bool((g < 0).any()):
        raise ValueError("gamma must be >= 0")
    a, b = float((b2 * s).sum()), float((b2 * s * s).sum())
    den = (c1**2 * b + Ey2 * g * float(s.mean())).sqrt()
    num = c1 * (a if target == "beta" else math.sqrt(b))
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(den))


def kfac_cosine(lam_G, eigenvalues, beta_sq, c1: float, sigma_eff2: float, gamma: float, *,
                plug_in: bool = False) -> torch.Tensor:
    r"""Limit of :math:`\cos(u_{\mathrm{KFAC}},\beta_\star)` from the ridge deterministic equivalent, for a fixed
    :math:`\beta_\star` (quadratic forms, not traces):

    .. math::

        \cos\to\frac{c_1\,q_1}{\sqrt{c_1^2\,(q_1-\lambda_G\tau'q_2)+\sigma_{\mathrm{eff}}^2\,\gamma\,\tau'\,t_1}},
        \quad q_1=\beta_\star^\top\Sigma(\Sigma+\tau)^{-1}\beta_\star,\
        q_2=\beta_\star^\top\Sigma(\Sigma+\tau)^{-2}\beta_\star,\ t_1=\tfrac1d\operatorname{tr}\Sigma(\Sigma+\tau)^{-2},

    with :math:`\tau` the effective ridge (:math:`\lambda_G=\tau(1-\mathrm{df}_1(\tau)/n)`) and
    :math:`\tau'=1/(1-\mathrm{df}_2(\tau)/n)`, from :func:`curvlab.rmt.ridge_equivalent`. ``lam_G`` any shape,
    :math:`\ge0` (:math:`\lambda_G=0` gives OLS for :math:`\gamma<1` and the minimum-norm interpolator, at
    :math:`\tau_0>0`, for :math:`\gamma>1`). ``gamma=0`` gives :math:`\tau=\lambda_G`, no noise term: the cosine
    of :math:`\Sigma(\Sigma+\lambda_G)^{-1}\beta_\star` with :math:`\beta_\star`. ``plug_in=True`` is the
    naive prediction :math:`\tau=\lambda_G`, :math:`\tau'=1` (no random-matrix correction), used as a foil.
    """
    s, b2 = _spectrum_and_beta(eigenvalues, beta_sq)
    c1 = float(check_finite("c1", as_tensor("c1", c1, dtype=F64)))
    sigma_eff2 = check_nonnegative("sigma_eff2", sigma_eff2)
    g = check_nonnegative("gamma", gamma)
    lam = check_finite("lam_G", as_tensor("lam_G", lam_G, dtype=F64))
    if bool((lam < 0).any()):
        raise ValueError(f"lam_G must be >= 0, got min {float(lam.min()):.3g}")
    if g == 0:
        if bool((lam == 0).any()):
            return torch.where(lam == 0, torch.ones_like(lam), population_kfac_cosine(lam.clamp_min(1e-300), s, b2))
        return population_kfac_cosine(lam, s, b2) * math.copysign(1.0, c1)
    if plug_in:
        if bool((lam == 0).any()):
            raise ValueError("the plug-in needs lam_G > 0")
        eq = rmt.RidgeEquivalent(lam, torch.ones_like(lam), None, None)
    else:
        eq = rmt.ridge_equivalent(lam, s, g)
    tau = eq.tau.unsqueeze(-1)
    q1 = (b2 * s / (s + tau)).sum(-1)
    # q1 - lam tau' q2 = sum b^2 s (s + E)/(s + tau)^2 with E = tau - lam tau' = gamma tau' mean(s tau^2/(s+tau)^2)
    # >= 0 (from lam = tau(1 - df1/n)): a sum of positive terms, free of the cancellation in 1 - 2r + r2.
    E = torch.where((eq.tau > 0) & (not plug_in), g * eq.dtau.clamp_max(1e300) * (s * (tau / (s + tau)).square()).mean(-1),
                    torch.zeros_like(eq.tau)).unsqueeze(-1)
    signal = (b2 * s * (s + E) / (s + tau).square()).sum(-1)
    t1 = (s / (s + tau).square()).mean(-1)
    noise = torch.where(torch.isinf(eq.dtau), torch.full_like(t1, math.inf), g * eq.dtau * t1) * sigma_eff2 \
        if sigma_eff2 > 0 else torch.zeros_like(t1)
    den = (c1**2 * signal.clamp_min(0.0) + noise).sqrt()
    return torch.where(den > 0, c1 * q1 / den.clamp_min(1e-300), torch.zeros_like(den)).reshape(lam.shape)


def ols_cosine(eigenvalues, c1: float, sigma_eff2: float, gamma: float) -> float:
    r"""The :math:`\lambda_G\to0` limit for :math:`\gamma<1` (OLS):
    :math:`c_1/\sqrt{c_1^2+\sigma_{\mathrm{eff}}^2\,\gamma\,\tfrac1d\operatorname{tr}\Sigma^{-1}/(1-\gamma)}`,
    the same for every unit :math:`\beta_\star`."""
    s = _vec("eigenvalues", eigenvalues, positive=True)
    c1 = float(c1)
    sigma_eff2 = check_nonnegative("sigma_eff2", sigma_eff2)
    g = check_positive("gamma", gamma)
    if g >= 1:
        raise ValueError(f"OLS needs gamma < 1 (more samples than dimensions), got {g}")
    return c1 / math.sqrt(c1**2 + sigma_eff2 * g * float((1 / s).mean()) / (1 - g))


def population_kfac_cosine(lam_G, eigenvalues, beta_sq) -> torch.Tensor:
    r""":math:`\cos\big(\Sigma(\Sigma+\lambda_GI)^{-1}\beta_\star,\ \beta_\star\big)`, the :math:`\gamma\to0` limit of the
    K-FAC cosine at fixed :math:`\lambda_G>0`; below 1 unless :math:`\beta_\star` is an eigenvector. Shape of ``lam_G``."""
    s, b2 = _spectrum_and_beta(eigenvalues, beta_sq)
    lam = check_finite("lam_G", as_tensor("lam_G", lam_G, dtype=F64))
    if bool((lam <= 0).any()):
        raise ValueError("lam_G must be > 0")
    h = s / (s + lam.unsqueeze(-1))
    return (b2 * h).sum(-1) / (b2 * h * h).sum(-1).sqrt()


def effective_ridge_two_level(lam_G, gamma, high: float, low: float, fraction: float) -> torch.Tensor:
    r"""Effective ridge of a two-level spectrum from its **cubic**, vectorised over ``lam_G`` *and* ``gamma``.

    With a fraction :math:`\nu` of eigenvalues at :math:`\lambda_1` (``high``) and the rest at :math:`\lambda_d`
    (``low``), multiplying :math:`\tau(1-\gamma[\nu\lambda_1/(\lambda_1+\tau)+(1-\nu)\lambda_d/(\lambda_d+\tau)])=
    \lambda_G` by :math:`(\lambda_1+\tau)(\lambda_d+\tau)` gives the monic cubic :math:`\tau^3+a_2\tau^2+a_1\tau+a_0`
    with :math:`a_2=\lambda_1+\lambda_d-\gamma(\nu\lambda_1+(1-\nu)\lambda_d)-\lambda_G`,
    :math:`a_1=\lambda_1\lambda_d(1-\gamma)-\lambda_G(\lambda_1+\lambda_d)`, :math:`a_0=-\lambda_G\lambda_1\lambda_d`.
    **Root choice:** the largest real root — the only positive one for :math:`\lambda_G>0`, and :math:`\tau_0` at
    :math:`\lambda_G=0` (chapter 04, Proposition *The effective ridge*, item 5). Roots come from the eigenvalues
    of the companion matrix, polished by two Newton steps. ``lam_G`` and ``gamma`` broadcast; float64.
    """
    lam = check_finite("lam_G", as_tensor("lam_G", lam_G, dtype=F64))
    g = check_finite("gamma", as_tensor("gamma", gamma, dtype=F64))
    if bool((lam < 0).any()) or bool((g <= 0).any()):
        raise ValueError("lam_G must be >= 0 and gamma > 0")
    l1, ld = check_positive("high", high), check_positive("low", low)
    nu = check_positive("fraction", fraction)
    if nu >= 1:
        raise ValueError(f"fraction must lie in (0, 1), got {nu}")
    lam, g = torch.broadcast_tensors(lam, g)
    a2 = l1 + ld - g * (nu * l1 + (1 - nu) * ld) - lam
    a1 = l1 * ld * (1 - g) - lam * (l1 + ld)
    a0 = -lam * l1 * ld
    C = torch.zeros(*lam.shape, 3, 3, dtype=F64)
    C[..., 0, :] = torch.stack([-a2, -a1, -a0], -1)
    C[..., 1, 0] = 1.0
    C[..., 2, 1] = 1.0
    roots = torch.linalg.eigvals(C)
    scale = 1.0 + roots.abs()
    real = torch.where(roots.imag.abs() <= 1e-7 * scale, roots.real, torch.full_like(roots.real, -math.inf))
    tau = real.amax(-1)
    for _ in range(2):  # Newton polish on the cubic
        p = ((tau + a2) * tau + a1) * tau + a0
        dp = (3 * tau + 2 * a2) * tau + a1
        tau = torch.where(dp.abs() > 0, tau - p / torch.where(dp.abs() > 0, dp, torch.ones_like(dp)), tau)
    return tau.clamp_min(0.0)


def optimal_lam_G(eigenvalues, beta_sq, c1: float, sigma_eff2: float, gamma: float, *,
                  lo: float = 1e-4, hi: float = 1e3, iters: int = 80) -> tuple[float, float]:
    r"""The penalty :math:`\lambda_G^\ast` maximising :func:`kfac_cosine` on :math:`[\mathrm{lo},\mathrm{hi}]` and the
    maximal cosine: a log-grid of 200 points, then golden-section search in :math:`\log\lambda_G` around the best
    grid point. Returns ``(lam_star, cos_star)``; ``lam_star`` at an end of the interval means no interior optimum
    there (for example when :math:`\sigma_{\mathrm{eff}}=0`)."""
    lo, hi = check_positive("lo", lo), check_positive("hi", hi)
    if lo >= hi:
        raise ValueError(f"lo must be < hi, got {lo}, {hi}")
    iters = check_int("iters", iters, min_value=1)
    f = lambda t: kfac_cosine(torch.exp(t), eigenvalues, beta_sq, c1, sigma_eff2, gamma)  # noqa: E731
    grid = torch.linspace(math.log(lo), math.log(hi), 200, dtype=F64)
    vals = f(grid)
    k = int(vals.argmax())
    a, b = float(grid[max(k - 1, 0)]), float(grid[min(k + 1, 199)])
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(iters):
        x1, x2 = b - phi * (b - a), a + phi * (b - a)
        f1, f2 = f(torch.tensor([x1, x2], dtype=F64)).tolist()
        if f1 >= f2:
            b = x2
        else:
            a = x1
    t = 0.5 * (a + b)
    return math.exp(t), float(f(torch.tensor(t, dtype=F64)))


# ============================================================================================ experiment
def giant_step_experiment(eigenvalues, beta, *, link, n: int, m: int, replicates: int, lam_G: float,
                          spike_norms, lam_v: float = 1e-2, noise_std: float = 0.0, n_test: int = 2000,
                          activation: str = "relu", generator: torch.Generator | None = None, device=None):
    r"""One giant step, then a ridge head, for SGD and K-FAC, batched over replicates. Returns a tidy frame.

    Per replicate: a step batch of ``n`` samples, an independent batch of ``n`` for the ridge head (as in
    Ba et al. 2022), a validation and a test set of ``n_test``. Each method's direction (:func:`giant_step`) is
    scaled to :math:`\lVert\Delta W\rVert_2=\theta\sqrt m` for each :math:`\theta` in ``spike_norms`` (the
    matching rule: equal operator norm; :math:`\theta` is the spike's strength per neuron, the :math:`\eta\propto
    \sqrt m` scaling), and ``"RF"`` keeps :math:`W_0` (random features). Columns: ``replicate``, ``method``,
    ``theta``, ``val_risk``, ``test_risk``, ``cos`` (:math:`|\cos|` of the extracted spike with
    :math:`\beta_\star`), ``null_risk`` (:math:`\E y^2` estimated on the test set).
    """
    import pandas as pd

    thetas = _vec("spike_norms", spike_norms, positive=True)
    lam_v = check_positive("lam_v", lam_v)
    n, m, n_test = check_int("n", n, min_value=2), check_int("m", m, min_value=2), check_int("n_test", n_test, min_value=2)
    R = check_int("replicates", replicates, min_value=1)
    s = _vec("eigenvalues", eigenvalues, positive=True)
    b = _vec("beta", beta)
    kw = dict(noise_std=noise_std, generator=generator, device=device)
    X, y = sample(s, b, link, n, R, **kw)
    X2, y2 = sample(s, b, link, n, R, **kw)
    Xv, yv = sample(s, b, link, n_test, R, **kw)
    Xt, yt = sample(s, b, link, n_test, R, **kw)
    W0, v = init_network(R, m, s.numel(), generator=generator, device=X.device)
    bdev = b.to(X.device)
    rows = []

    def evaluate(method, theta, W1, cos):
        vh = ridge_head(features(X2, W1, activation), y2, lam_v)
        val = risk(features(Xv, W1, activation), yv, vh)
        test = risk(features(Xt, W1, activation), yt, vh)
        for r in range(R):
            rows.append(dict(replicate=r, method=method, theta=theta, val_risk=float(val[r]),
                             test_risk=float(test[r]), cos=float(cos[r]), null_risk=float(yt[r].square().mean())))

    evaluate("RF", 0.0, W0, torch.full((R,), float("nan")))
    for method in ("SGD", "K-FAC"):
        D = giant_step(X, y, W0, v, method=method, lam_G=lam_G, activation=activation)
        cos = cosine(spike_direction(D), bdev, absolute=True)
        for th in thetas.tolist():
            evaluate(method, th, W0 + scale_to_norm(D, th * math.sqrt(m)), cos)
    return pd.DataFrame(rows)
