r"""Random-matrix toolkit (chapter *A random-matrix toolkit*, ``notebooks/04_random_matrix_toolkit``).

**Convention.** Data :math:`X \in \mathbb{R}^{n\times d}` has i.i.d. rows :math:`x_i = \Sigma^{1/2} g_i` with
:math:`g_i \sim \mathcal N(0, I_d)`; the sample second moment is :math:`\hat\Sigma = X^\top X / n` (``d × d``) and
the aspect ratio is :math:`\gamma = d/n` (**dimension over samples**, the book's notation). With
:math:`\Sigma = I_d` and :math:`\gamma \le 1` the spectrum of :math:`\hat\Sigma` fills
:math:`[\lambda_-, \lambda_+] = [(1-\sqrt\gamma)^2, (1+\sqrt\gamma)^2]` (Marchenko–Pastur); for
:math:`\gamma > 1` a fraction :math:`1 - 1/\gamma` of its eigenvalues is exactly zero. For a Gaussian layer
:math:`W \in \mathbb{R}^{m\times d}` the same law applies to :math:`W^\top W/m` with ratio :math:`d/m`.

What is here:

* the Marchenko–Pastur law: :func:`mp_edges`, :func:`mp_density`, :func:`mp_cdf`, :func:`mp_stieltjes`, and
  the condition number of a Gaussian matrix, :func:`mp_condition_number` (limit) and
  :func:`simulate_condition_number` (Monte Carlo);
* empirical spectra: :func:`sample_covariance_eigh`, :func:`spectral_cdf`, :func:`kolmogorov_distance`;
* the ridge deterministic equivalent :math:`\lambda_G(\hat\Sigma+\lambda_G I)^{-1} \asymp \tau(\Sigma+\tau I)^{-1}`
  with the effective ridge :math:`\tau` solving :math:`\lambda_G = \tau(1 - \mathrm{df}_1(\tau)/n)`:
  :func:`df1`, :func:`df2`, :func:`effective_ridge_floor`, :func:`effective_ridge`,
  :func:`ridge_equivalent`, and the matching empirical statistics :func:`resolvent_statistics`;
* a spiked covariance :math:`\Sigma = I + \xi\, e_1 e_1^\top` (BBP transition): :func:`spike_outlier`,
  :func:`spike_overlap`, :func:`simulate_spike`;
* finite-size terms for checks: :func:`richardson_bias`;
* the Grassmannian: :func:`grassmann_geodesic` (principal angles and the sin-θ distance themselves live in
  :mod:`curvlab.linalg`).

Spectral work runs in float64 on :func:`curvlab.config.spectral_device` of the inputs (the CPU for MPS tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import config
from ._validate import as_tensor, check_finite, check_int, check_matrix, check_nonnegative, check_positive

__all__ = [
    "LeaveOneOut",
    "leave_one_out_statistics",
    "mp_edges",
    "mp_density",
    "mp_cdf",
    "mp_stieltjes",
    "mp_condition_number",
    "simulate_condition_number",
    "sample_covariance_eigh",
    "spectral_cdf",
    "kolmogorov_distance",
    "richardson_bias",
    "df1",
    "df2",
    "effective_ridge_floor",
    "effective_ridge",
    "RidgeEquivalent",
    "ridge_equivalent",
    "resolvent_statistics",
    "spike_outlier",
    "spike_overlap",
    "simulate_spike",
    "grassmann_geodesic",
]


# ------------------------------------------------------------------------------------------------ helpers
def _real(name: str, value, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """A finite real tensor in float64 on the spectral device (of ``like`` if given, else its own)."""
    if not isinstance(value, torch.Tensor) and not isinstance(value, bool):
        try:  # straight to float64: a Python float must not pass through float32
            value = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"{name} must be a real number, tensor or array of numbers, got {type(value).__name__}"
            ) from exc
    t = check_finite(name, as_tensor(name, value))
    dev = like.device if like is not None else t.device
    return t.to(device=config.spectral_device(dev), dtype=torch.float64)


def _single_threaded_lapack(t: torch.Tensor):
    """One intra-op thread for a batched CPU eigen-solver: torch's batched ``eigh``/``eigvalsh`` nests its own
    parallelism with the threaded LAPACK kernels, and a (40, 200, 200) ``eigvalsh`` measured 20x slower with 2
    threads than with 1 on a loaded machine (matrix products were unaffected). GPU tensors are left alone."""
    return config.cpu_threads(1, device=t.device)


def _eigvalsh(A: torch.Tensor) -> torch.Tensor:
    with _single_threaded_lapack(A):
        return torch.linalg.eigvalsh(A)


def _eigh(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with _single_threaded_lapack(A):
        return torch.linalg.eigh(A)


def _gamma(gamma) -> float:
    return check_positive("gamma", gamma)


# ------------------------------------------------------------------------------------------------ Marchenko–Pastur
def mp_edges(gamma: float) -> tuple[float, float]:
    r"""Edges :math:`\lambda_\pm = (1 \pm \sqrt\gamma)^2` of the Marchenko–Pastur law, :math:`\gamma = d/n`.

    The bulk of the spectrum of :math:`\hat\Sigma = X^\top X/n` (``Σ = I``) fills :math:`[\lambda_-, \lambda_+]`.
    For :math:`\gamma > 1` the remaining fraction :math:`1 - 1/\gamma` of eigenvalues sits at :math:`0`.
    Returns ``(lambda_minus, lambda_plus)`` as floats.
    """
    s = math.sqrt(_gamma(gamma))
    return (1.0 - s) ** 2, (1.0 + s) ** 2


def mp_density(x, gamma: float) -> torch.Tensor:
    r"""Density of the continuous part of the Marchenko–Pastur law (ratio :math:`\gamma = d/n`, variance 1):

    .. math::

        \mu_\gamma'(\lambda) = \frac{\sqrt{(\lambda_+ - \lambda)(\lambda - \lambda_-)}}{2\pi\gamma \lambda}
        \quad\text{on } [\lambda_-, \lambda_+], \qquad 0 \text{ elsewhere}.

    It integrates to :math:`\min(1, 1/\gamma)`; for :math:`\gamma > 1` the law also has the atom
    :math:`(1 - 1/\gamma)\,\delta_0`, which this density does not include (see :func:`mp_cdf`).
    ``x`` is any real tensor; the result is float64 of the same shape.
    """
    g = _gamma(gamma)
    x = _real("x", x)
    lo, hi = mp_edges(g)
    inside = (x > lo) & (x < hi)
    safe = torch.where(inside, x, torch.ones_like(x))
    rho = torch.sqrt(((hi - safe) * (safe - lo)).clamp_min(0.0)) / (2 * math.pi * g * safe)
    return torch.where(inside, rho, torch.zeros_like(x))


def mp_cdf(x, gamma: float) -> torch.Tensor:
    r"""Cumulative distribution function of the Marchenko–Pastur law, in closed form, atom included.

    With :math:`\lambda = 1 + \gamma + 2\sqrt\gamma\cos\chi` (:math:`\chi \in [0, \pi]`) and

    .. math::

        \mathcal A(\chi) = -\frac{\sin\chi}{2\sqrt\gamma} + \frac{(1+\gamma)\chi}{4\gamma}
        - \frac{|1-\gamma|}{2\gamma}\arctan\!\Big(\frac{|1-\sqrt\gamma|}{1+\sqrt\gamma}\tan\frac\chi2\Big),

    the continuous part is :math:`\frac{2}{\pi}\big(\mathcal A(\pi) - \mathcal A(\chi)\big)` (an antiderivative
    of :func:`mp_density` in the angle :math:`\chi`, derived and checked in chapter 04), and
    :math:`\mu_\gamma(\lambda) = (1 - 1/\gamma)_+ [\lambda \ge 0] + \frac{2}{\pi}(\mathcal A(\pi) - \mathcal A(\chi))`.
    ``x`` holds the points :math:`\lambda`.
    """
    g = _gamma(gamma)
    x = _real("x", x)
    s = math.sqrt(g)
    c = ((x - 1.0 - g) / (2.0 * s)).clamp(-1.0, 1.0)
    phi = torch.arccos(c)
    k = abs(1.0 - s) / (1.0 + s)

    def integral(p: torch.Tensor) -> torch.Tensor:
        at = torch.atan2(k * torch.sin(p / 2), torch.cos(p / 2))  # arctan(k tan(p/2)) on [0, pi]
        return -torch.sin(p) / (2 * s) + (1 + g) * p / (4 * g) - abs(1 - g) / (2 * g) * at

    cont = (2.0 / math.pi) * (integral(torch.full_like(phi, math.pi)) - integral(phi))
    atom = max(0.0, 1.0 - 1.0 / g) * (x >= 0).to(x.dtype)
    return (atom + cont).clamp(0.0, 1.0)


def mp_stieltjes(z, gamma: float) -> torch.Tensor:
    r"""Stieltjes transform :math:`s_\gamma(z) = \int \frac{d\mu_\gamma(\lambda)}{\lambda - z}` of the MP law.

    :math:`s_\gamma` is the root of :math:`\gamma z s^2 + (z + \gamma - 1) s + 1 = 0` with
    :math:`s_\gamma(z) \sim -1/z` at infinity (so :math:`\operatorname{Im} s_\gamma > 0` when
    :math:`\operatorname{Im} z > 0`). In rationalised form,

    .. math::

        s_\gamma(z) = \frac{2}{1 - \gamma - z - \sqrt{z - \lambda_+}\,\sqrt{z - \lambda_-}},

    with principal square roots: their product is analytic off :math:`[\lambda_-, \lambda_+]` and behaves like
    :math:`z` at infinity, which selects the right branch. A real ``z`` is read as :math:`z + i0`, so inside
    the bulk :math:`\operatorname{Im} s_\gamma(\lambda + i0) = \pi \mu_\gamma'(\lambda)`; on the negative axis
    :math:`s_\gamma(-\lambda_G) = \lim \tfrac1d \operatorname{tr}(\hat\Sigma + \lambda_G I)^{-1}` (the ridge
    resolvent). Returns complex128. :math:`z = 0` is a pole when :math:`\gamma \ge 1` (``ValueError``).
    """
    g = _gamma(gamma)
    if not isinstance(z, torch.Tensor):
        try:
            z = torch.as_tensor(z, dtype=torch.complex128)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"z must be a number or a tensor, got {type(z).__name__}") from exc
    elif not z.is_complex():
        z = as_tensor("z", z)
    if not bool(torch.isfinite(z).all()):
        raise ValueError("z contains non-finite values")
    z = z.to(device=config.spectral_device(z.device), dtype=torch.complex128)
    if g >= 1 and bool((z == 0).any()):
        raise ValueError(f"z must not be 0 when gamma >= 1 (gamma = {g}): m has a pole there")
    lo, hi = mp_edges(g)
    root = torch.sqrt(z - hi) * torch.sqrt(z - lo)
    return 2.0 / (1.0 - g - z - root)


def mp_condition_number(ratio) -> torch.Tensor:
    r"""Limit of :math:`\kappa(W) = \smax(W)/\smin(W)` for a Gaussian :math:`W \in \mathbb{R}^{m\times d}`, d ≤ m:

    .. math::

        \kappa(W) \to \sqrt{\lambda_+/\lambda_-} = \frac{1 + \sqrt{d/m}}{1 - \sqrt{d/m}}, \qquad d/m \to r < 1,

    since the squared singular values of :math:`W/\sqrt m` follow Marchenko–Pastur with ratio :math:`d/m`
    (Zhao, Singh & Lucchi 2024 use it for the width dependence of the GN conditioning). ``ratio`` is
    :math:`d/m` (a number or tensor in :math:`[0, 1)`; the limit is infinite at 1). Returns float64.
    """
    r = _real("ratio", ratio)
    if bool(((r < 0) | (r >= 1)).any()):
        raise ValueError(f"ratio = d/m must lie in [0, 1), got values in [{float(r.min()):.3g}, {float(r.max()):.3g}]")
    s = r.sqrt()
    return (1 + s) / (1 - s)


def simulate_condition_number(m: int, d: int, replicates: int, *, generator: torch.Generator | None = None,
                              device=None) -> torch.Tensor:
    r"""Condition numbers :math:`\kappa(W) = \sqrt{\lmax(W^\top W)/\lmin(W^\top W)}` of ``replicates`` Gaussian
    matrices :math:`W \in \mathbb{R}^{m\times d}` (i.i.d. standard entries, :math:`d \le m`), to compare with
    :func:`mp_condition_number` ``(d/m)``. One batched ``eigvalsh`` of the ``d × d`` Gram matrices, in float64 on
    ``device`` (default :func:`curvlab.config.device`, spectral work on its spectral device). Returns ``(replicates,)``.
    """
    m, d = check_int("m", m, min_value=1), check_int("d", d, min_value=1)
    if d > m:
        raise ValueError(f"d must be <= m (a tall matrix has a nonzero smallest singular value), got d={d}, m={m}")
    R = check_int("replicates", replicates, min_value=1)
    dev = config.spectral_device(config.device() if device is None else device)
    W = torch.randn(R, m, d, generator=generator, dtype=torch.float64).to(dev)
    e = _eigvalsh(W.transpose(-2, -1) @ W)
    return (e[:, -1] / e[:, 0]).sqrt()


# ------------------------------------------------------------------------------------------------ empirical spectra
def sample_covariance_eigh(X, vectors: bool = False):
    r"""Eigen-decomposition of :math:`\hat\Sigma = X^\top X / n` in float64, eigenvalues in **decreasing** order.

    ``X`` has shape ``(..., n, d)`` (a batch of replicates is natural). Returns the eigenvalues ``(..., d)``, and
    with ``vectors=True`` also the eigenvectors as columns ``(..., d, d)`` in the same order. Tiny negative
    eigenvalues from rounding are kept (they are of order :math:`d\,\varepsilon\,\lambda_{\max}`).
    """
    X = check_matrix("X", X, batch=True)
    X64 = config.spectral(X)
    S = X64.transpose(-2, -1) @ X64 / X.shape[-2]
    S = 0.5 * (S + S.transpose(-2, -1))
    if not vectors:
        return _eigvalsh(S).flip(-1)
    lam, Q = _eigh(S)
    return lam.flip(-1), Q.flip(-1)


def spectral_cdf(eigenvalues, x) -> torch.Tensor:
    r"""Empirical spectral distribution function :math:`\hat\mu_d(\lambda) = \frac1d \#\{i : \lambda_i \le \lambda\}`.

    ``eigenvalues`` ``(..., d)``, ``x`` ``(P,)``; returns ``(..., P)`` in float64.
    """
    e = _real("eigenvalues", eigenvalues)
    if e.dim() < 1 or e.shape[-1] == 0:
        raise ValueError(f"eigenvalues must have a non-empty last dimension, got shape {tuple(e.shape)}")
    x = _real("x", x, like=e)
    if x.dim() != 1:
        raise ValueError(f"x must be a vector of points, got shape {tuple(x.shape)}")
    return (e.unsqueeze(-2) <= x.unsqueeze(-1)).to(torch.float64).mean(-1)


def kolmogorov_distance(eigenvalues, cdf: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    r"""Kolmogorov distance :math:`\sup_\lambda |\hat\mu_d(\lambda) - \mu(\lambda)|` between an empirical spectrum
    and a continuous distribution function :math:`\mu` (``cdf``).

    Exact for continuous :math:`\mu`: with sorted eigenvalues :math:`e_{(1)} \le \dots \le e_{(d)}`,
    :math:`\max_i \max\big(i/d - \mu(e_{(i)}),\, \mu(e_{(i)}) - (i-1)/d\big)`. ``eigenvalues`` ``(..., d)``;
    ``cdf`` maps a float64 tensor to a tensor of the same shape (e.g. ``lambda x: mp_cdf(x, gamma)``).
    Returns ``(...)``.
    """
    e = _real("eigenvalues", eigenvalues)
    if e.dim() < 1 or e.shape[-1] == 0:
        raise ValueError(f"eigenvalues must have a non-empty last dimension, got shape {tuple(e.shape)}")
    if not callable(cdf):
        raise TypeError(f"cdf must be a callable CDF, got {type(cdf).__name__}")
    e = e.sort(dim=-1).values
    F = torch.as_tensor(cdf(e), dtype=torch.float64, device=e.device)
    if F.shape != e.shape:
        raise ValueError(f"cdf must return the shape of its input {tuple(e.shape)}, got {tuple(F.shape)}")
    d = e.shape[-1]
    i = torch.arange(1, d + 1, dtype=torch.float64, device=e.device)
    return torch.maximum((i / d - F).amax(-1), (F - (i - 1) / d).amax(-1))


def richardson_bias(coarse, fine, size_ratio: float, rate: float, *, z: float = 0.0) -> torch.Tensor:
    r"""Finite-size bias left at the fine size, from replicates at two sizes (Richardson's argument).

    If a statistic's mean approaches its limit as :math:`E_N = E_\infty + C N^{-a}`, then, with the size ratio
    :math:`\varrho` = ``size_ratio``, :math:`E_{N/\varrho} - E_N = C N^{-a}(\varrho^a - 1)`, so the bias still present
    at size :math:`N` is

    .. math::

        |E_N - E_\infty| = \frac{|E_{N/\varrho} - E_N|}{\varrho^a - 1}
        \;\le\; \frac{|\bar E_{N/\varrho} - \bar E_N| + z\,\mathrm{SE}}{\varrho^a - 1},

    where :math:`\bar E` are replicate means and SE the standard error of their difference (``z = 0`` gives
    the plain estimate; ``z = 3`` an upper confidence bound). ``coarse`` ``(R_c, ...)`` and ``fine``
    ``(R_f, ...)`` are replicate samples at sizes :math:`N/\varrho` and :math:`N`; ``size_ratio`` must be
    :math:`> 1` and ``rate`` is :math:`a > 0` (``1`` for smooth spectral statistics, ``2/3`` at a spectral edge,
    the Tracy–Widom scale). Returns ``(...)`` in float64. The term never uses the prediction, so it cannot
    rescue a wrong one: an error that does not shrink with size is not a finite-size term.
    """
    s, a = check_positive("size_ratio", size_ratio), check_positive("rate", rate)
    z = check_nonnegative("z", z)
    if s <= 1:
        raise ValueError(f"size_ratio must be > 1 (the fine size over the coarse one), got {s}")
    c, f = _real("coarse", coarse), _real("fine", fine)
    for name, t in (("coarse", c), ("fine", f)):
        if t.dim() == 0 or t.shape[0] < 2:
            raise ValueError(f"{name} must hold at least 2 replicates along axis 0, got shape {tuple(t.shape)}")
    f = f.to(c.device)
    se = lambda t: t.std(0) / math.sqrt(t.shape[0])  # noqa: E731
    try:
        diff = (c.mean(0) - f.mean(0)).abs() + z * (se(c).square() + se(f).square()).sqrt()
    except RuntimeError as exc:
        raise ValueError(f"coarse and fine must have the same statistics shape: {exc}") from None
    return diff / (s**a - 1.0)


# ------------------------------------------------------------------------------------------------ ridge equivalent
def df1(tau, eigenvalues) -> torch.Tensor:
    r"""Degrees of freedom :math:`\mathrm{df}_1(\tau) = \operatorname{tr}\Sigma(\Sigma+\tau I)^{-1}
    = \sum_i \lambda_i/(\lambda_i+\tau)`, from the eigenvalues :math:`\lambda_i = \lambda_i(\Sigma) \ge 0`.

    ``tau`` (any shape, :math:`> 0`) and ``eigenvalues`` ``(d,)``; returns the shape of ``tau``.
    """
    s = _spectrum(eigenvalues)
    t = _taus(tau, s)
    return (s / (s + t.unsqueeze(-1))).sum(-1)


def df2(tau, eigenvalues) -> torch.Tensor:
    r"""Degrees of freedom :math:`\mathrm{df}_2(\tau) = \operatorname{tr}\Sigma^2(\Sigma+\tau I)^{-2}
    = \sum_i \lambda_i^2/(\lambda_i+\tau)^2`. Same shapes as :func:`df1`."""
    s = _spectrum(eigenvalues)
    t = _taus(tau, s)
    return (s / (s + t.unsqueeze(-1))).square().sum(-1)


def _spectrum(eigenvalues) -> torch.Tensor:
    s = _real("eigenvalues", eigenvalues)
    if s.dim() != 1 or s.numel() == 0:
        raise ValueError(f"eigenvalues must be a non-empty vector, got shape {tuple(s.shape)}")
    if bool((s < 0).any()) or not bool((s > 0).any()):
        raise ValueError("eigenvalues must be >= 0 with at least one > 0 (the spectrum of a covariance)")
    return s


def _measure(eigenvalues, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """The spectral distribution (atoms s, probabilities w) of Sigma; uniform weights 1/d by default."""
    s = _spectrum(eigenvalues)
    if weights is None:
        return s, torch.full_like(s, 1.0 / s.numel())
    w = _real("weights", weights, like=s)
    if w.shape != s.shape:
        raise ValueError(f"weights must have the shape of eigenvalues {tuple(s.shape)}, got {tuple(w.shape)}")
    if bool((w <= 0).any()):
        raise ValueError("weights must be > 0")
    return s, w / w.sum()


def _taus(tau, s: torch.Tensor) -> torch.Tensor:
    t = _real("tau", tau, like=s)
    if bool((t <= 0).any()):
        raise ValueError(f"tau must be > 0, got min {float(t.min()):.3g}")
    return t


def _bracketed_newton(F, lo: torch.Tensor, hi: torch.Tensor, max_iter: int) -> torch.Tensor:
    """Root of an increasing ``F`` (returning value, derivative) with ``F(lo) <= 0 <= F(hi)``, element-wise.

    Each iteration evaluates F at the midpoint and at the Newton points from both ends (clamped into the
    bracket) and keeps the tightest bracket: bisection guarantees convergence, Newton makes it quadratic.
    It stops when the bracket is a few ulps wide or a Newton step from one end is below an ulp of it, and
    returns that end (the one with the smaller Newton step).
    """
    eps, tiny = torch.finfo(torch.float64).eps, torch.finfo(torch.float64).tiny

    def newton_step(x):
        f, g = F(x)
        return torch.where(g > 0, f / g.clamp_min(tiny), torch.where(f == 0, 0.0, torch.inf))

    for _ in range(max_iter):
        step_lo, step_hi = newton_step(lo), newton_step(hi)
        ulp = 2 * eps * hi.abs().clamp_min(1e-300)
        done = ((hi - lo) <= 2 * ulp) | (torch.minimum(step_lo.abs(), step_hi.abs()) <= ulp)
        if bool(done.all()):
            break
        cands = [0.5 * (lo + hi)]
        for x0, step in ((lo, step_lo), (hi, step_hi)):
            cands.append(torch.minimum(torch.maximum(x0 - step.nan_to_num(0.0, 0.0, 0.0), lo), hi))
        for x in cands:
            fx, _ = F(x)
            lo = torch.where(fx <= 0, torch.maximum(lo, x), lo)
            hi = torch.where(fx >= 0, torch.minimum(hi, x), hi)
    step_lo, step_hi = newton_step(lo).abs(), newton_step(hi).abs()
    return torch.where(step_lo < step_hi, lo, hi)


def effective_ridge_floor(eigenvalues, gamma: float, weights=None) -> float:
    r"""The limit :math:`\tau_0 = \lim_{\lambda_G \to 0}\tau`: zero when :math:`\gamma\,\nu(\lambda>0) \le 1`, else
    the root of :math:`\gamma\sum_i \nu_i \lambda_i/(\lambda_i+\tau_0) = 1`, where the spectral distribution of
    :math:`\Sigma` has atoms :math:`\lambda_i` (``eigenvalues``) with probabilities :math:`\nu_i` (``weights``) and
    :math:`\nu(\lambda>0)` is the probability of the positive atoms.

    With more dimensions than samples (:math:`\gamma > 1`), ridgeless regression still behaves like a ridge
    with penalty :math:`\tau_0 > 0` (for :math:`\Sigma = I`, :math:`\tau_0 = \gamma - 1`). The fixed-point
    equation of :func:`effective_ridge` has the spurious root :math:`\tau = 0` at :math:`\lambda_G = 0`, which
    is why a bracket starting at 0 fails; the valid branch starts at :math:`\tau_0`.
    """
    g = _gamma(gamma)
    s, w = _measure(eigenvalues, weights)
    return float(_floor(s, w, g))


def _floor(s: torch.Tensor, w: torch.Tensor, g: float) -> torch.Tensor:
    mass = float(w[s > 0].sum())
    if g * mass <= 1.0:
        return torch.zeros((), dtype=torch.float64, device=s.device)

    def F(t: torch.Tensor):  # 1 - gamma m1(t): increasing in t
        r = torch.where(s > 0, s / (s + t).clamp_min(torch.finfo(torch.float64).tiny), 0.0)
        return 1.0 - g * (w * r).sum(-1), g * (w * r * r / s.clamp_min(torch.finfo(torch.float64).tiny)).sum(-1)

    hi = torch.tensor(g * float((w * s).sum()), dtype=torch.float64, device=s.device)  # gamma m1(hi) <= 1
    return _bracketed_newton(lambda t: tuple(v.squeeze(-1) for v in F(t.unsqueeze(-1))),
                             torch.zeros_like(hi), hi, 200)


def effective_ridge(lam_G, eigenvalues, gamma: float, weights=None, *, max_iter: int = 200) -> torch.Tensor:
    r"""Effective ridge :math:`\tau`: the root of the fixed-point equation (chapter 04)

    .. math::

        \lambda_G = \tau\Big(1 - \gamma\sum_i \nu_i \frac{\lambda_i}{\lambda_i + \tau}\Big), \qquad
        1 - \gamma\sum_i \nu_i \frac{\lambda_i}{\lambda_i + \tau} > 0,

    where the spectral distribution of :math:`\Sigma` has atoms :math:`\lambda_i` (``eigenvalues``) with
    probabilities :math:`\nu_i` (``weights``, default :math:`1/d`, in which case the sum is
    :math:`\mathrm{df}_1(\tau)/d` and this is the book's :math:`\lambda_G = \tau(1 - \mathrm{df}_1(\tau)/n)`). The
    papers' digest calls this root :math:`\kappa`, the ratio :math:`\phi` and the sum :math:`m_1(\kappa)`; the book
    writes :math:`\tau`, :math:`\gamma = d/n` and :math:`\mathrm{df}_1(\tau)/d`.

    The map :math:`h(\tau)` on the right is convex with :math:`h' = 1 - \mathrm{df}_2/n > 0` on the valid branch
    :math:`\tau > \tau_0` (:func:`effective_ridge_floor`), so the root is unique and lies in
    :math:`[\max(\lambda_G, \tau_0),\ \lambda_G + \gamma\sum_i \nu_i \lambda_i]`; it is found by safeguarded Newton
    (bisection keeps the bracket). ``lam_G`` is a number or a tensor of any shape (:math:`\ge 0`;
    :math:`\lambda_G = 0` returns :math:`\tau_0`); the result has its shape, float64.
    """
    g = _gamma(gamma)
    s, w = _measure(eigenvalues, weights)
    lam = _real("lam_G", lam_G, like=s)
    if bool((lam < 0).any()):
        raise ValueError(f"lam_G must be >= 0, got min {float(lam.min()):.3g}")
    max_iter = check_int("max_iter", max_iter, min_value=1)
    tau0 = _floor(s, w, g)
    flat = lam.reshape(-1, 1)

    def F(t: torch.Tensor):  # h(t) - lam and h'(t), t of shape (L, 1)
        r = torch.where(s > 0, s / (s + t).clamp_min(torch.finfo(torch.float64).tiny), 0.0)
        return (t.squeeze(-1) * (1.0 - g * (w * r).sum(-1)) - flat.squeeze(-1),
                1.0 - g * (w * r * r).sum(-1))

    lam_flat, zero = flat.squeeze(-1), flat.squeeze(-1) == 0
    lo = torch.maximum(lam_flat, tau0.expand_as(lam_flat))
    hi = torch.where(zero, tau0.expand_as(lam_flat), lam_flat + g * (w * s).sum())  # lam_G = 0: tau = tau_0
    tau = _bracketed_newton(lambda t: F(t.unsqueeze(-1)), lo, hi, max_iter)
    return torch.where(zero, tau0.expand_as(tau), tau).reshape(lam.shape)


class RidgeEquivalent(NamedTuple):
    r"""Deterministic equivalents of the ridge resolvent, in the eigenbasis of :math:`\Sigma`.

    ``tau`` — the effective ridge :math:`\tau` (shape of ``lam_G``);
    ``dtau`` — :math:`d\tau/d\lambda_G = 1/(1 - \mathrm{df}_2(\tau)/n)`;
    ``resolvent`` — :math:`\tau/(\lambda_i+\tau)`, the eigenvalues of the equivalent of
    :math:`\lambda_G(\hat\Sigma+\lambda_G I)^{-1}` (shape ``lam_G.shape + (k,)``);
    ``squared_resolvent`` — :math:`\tau/(\lambda_i+\tau) - \lambda_G\,\tau'\, \lambda_i/(\lambda_i+\tau)^2`, the
    equivalent of :math:`\lambda_G^2(\hat\Sigma+\lambda_G I)^{-2}`. Here :math:`\lambda_i = \lambda_i(\Sigma)`.
    """

    tau: torch.Tensor
    dtau: torch.Tensor
    resolvent: torch.Tensor
    squared_resolvent: torch.Tensor


def ridge_equivalent(lam_G, eigenvalues, gamma: float, weights=None) -> RidgeEquivalent:
    r"""The ridge deterministic equivalent (Dobriban & Wager 2018; Hastie et al. 2022), for a general spectrum:

    .. math::

        \lambda_G(\hat\Sigma + \lambda_G I)^{-1} \asymp \tau(\Sigma + \tau I)^{-1}, \qquad
        \lambda_G^2(\hat\Sigma + \lambda_G I)^{-2} \asymp \tau(\Sigma+\tau I)^{-1}
        - \lambda_G\,\frac{d\tau}{d\lambda_G}\,\Sigma(\Sigma+\tau I)^{-2},

    with :math:`\tau` from :func:`effective_ridge` and :math:`d\tau/d\lambda_G = 1/(1 - \gamma\sum_i \nu_i
    \lambda_i^2/(\lambda_i+\tau)^2)` (implicit differentiation; :math:`1/(1-\mathrm{df}_2(\tau)/n)` for uniform
    weights). The second line follows from the first because, per eigenvalue :math:`e` of :math:`\hat\Sigma`,
    :math:`\lambda_G^2/(e+\lambda_G)^2 = \lambda_G/(e+\lambda_G) - \lambda_G\tfrac{d}{d\lambda_G}[\lambda_G/(e+\lambda_G)]`.
    A trace :math:`\tfrac1d\operatorname{tr}` becomes
    ``(weights * resolvent).sum(-1)``; a quadratic form :math:`\beta_\star^\top(\cdot)\beta_\star` becomes
    ``((U.T @ beta)**2 * resolvent).sum(-1)`` with the eigenvectors ``U`` of :math:`\Sigma`. Returns a
    :class:`RidgeEquivalent`. ``dtau`` is infinite at :math:`\lambda_G = 0` when :math:`\gamma\nu(\lambda>0) = 1`.
    """
    g = _gamma(gamma)
    s, w = _measure(eigenvalues, weights)
    tau = effective_ridge(lam_G, s, g, w)
    lam = _real("lam_G", lam_G, like=s).reshape(tau.shape)
    t = tau.unsqueeze(-1)
    safe = torch.where(t > 0, t, torch.ones_like(t))
    r = torch.where(t > 0, s / (s + safe), (s > 0).to(torch.float64))  # s/(s+tau), with 0/0 := [s > 0]
    one_minus = 1.0 - g * (w * r * r).sum(-1)
    dtau = torch.where(one_minus > 0, 1.0 / one_minus.clamp_min(torch.finfo(torch.float64).tiny),
                       torch.full_like(one_minus, math.inf))
    first = 1.0 - r  # tau/(s+tau)
    lam_dtau = torch.where(lam > 0, lam * dtau, torch.zeros_like(lam)).unsqueeze(-1)
    second = first - lam_dtau * r * (1.0 - r) / safe  # lam tau' s/(s+tau)^2 = lam tau' r (1-r)/tau
    return RidgeEquivalent(tau, dtau, first, second)


def resolvent_statistics(X, lam_G, beta) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Empirical ridge statistics from data, for a grid of penalties, with one eigen-decomposition:

    .. math::

        \frac{\lambda_G}{d}\operatorname{tr}(\hat\Sigma+\lambda_G I)^{-1}
        \quad\text{and}\quad \lambda_G^2\,\beta^\top(\hat\Sigma+\lambda_G I)^{-2}\beta,
        \qquad \hat\Sigma = X^\top X/n.

    ``X`` ``(..., n, d)``, ``lam_G`` ``(L,)`` with entries :math:`> 0`, ``beta`` ``(d,)`` or ``(k, d)``: with
    several rows the quadratic form is averaged over them (``k`` fixed directions reduce its variance by about
    ``k``). Returns two tensors ``(..., L)`` (float64), to compare with :func:`ridge_equivalent`.
    """
    lam, Q = sample_covariance_eigh(X, vectors=True)
    lam_G = _real("lam_G", lam_G, like=lam)
    if lam_G.dim() != 1 or bool((lam_G <= 0).any()):
        raise ValueError("lam_G must be a vector of penalties > 0")
    beta = _real("beta", beta, like=lam)
    d = lam.shape[-1]
    if beta.dim() not in (1, 2) or beta.shape[-1] != d:
        raise ValueError(f"beta must have shape ({d},) or (k, {d}), got {tuple(beta.shape)}")
    B = beta.reshape(-1, d)
    filt = lam_G.unsqueeze(-1) / (lam.clamp_min(0.0).unsqueeze(-2) + lam_G.unsqueeze(-1))  # (..., L, d)
    proj = (B @ Q).square().mean(-2).unsqueeze(-2)  # (..., 1, d): mean over rows of (Q^T beta)^2
    return filt.mean(-1), (proj * filt.square()).sum(-1)


class LeaveOneOut(NamedTuple):
    r"""Monte Carlo ingredients of the heuristic derivation of the ridge equivalent (chapter 04).

    ``tau_hat`` ``(..., L)`` — the *measured* effective ridge :math:`\hat\tau=\lambda_G(1+\hat\delta)` with
    :math:`\hat\delta=\frac1n\operatorname{tr}\Sigma(\hat\Sigma+\lambda_GI)^{-1}`; ``delta_rows`` ``(..., L, n)`` —
    the leave-one-out quadratic forms :math:`\delta_i=\frac1n x_i^\top(\hat\Sigma_{-i}+\lambda_GI)^{-1}x_i`, with
    :math:`\hat\Sigma_{-i}=\hat\Sigma-x_ix_i^\top/n`.
    """

    tau_hat: torch.Tensor
    delta_rows: torch.Tensor


def leave_one_out_statistics(X, lam_G, eigenvalues) -> LeaveOneOut:
    r"""The measured effective ridge and the leave-one-out quadratic forms of the heuristic derivation of
    :func:`ridge_equivalent`, from data ``X`` ``(..., n, d)`` whose population covariance is **diagonal** with
    diagonal ``eigenvalues`` ``(d,)``, for penalties ``lam_G`` ``(L,)`` :math:`>0`; one eigen-decomposition.

    With :math:`R=(\hat\Sigma+\lambda_GI)^{-1}` and :math:`q_i=\frac1n x_i^\top Rx_i`, Sherman–Morrison gives the
    leave-one-out form exactly, :math:`\delta_i=q_i/(1-q_i)`, so no :math:`n` separate inverses are needed.
    The derivation predicts :math:`\hat\tau\to\tau` (the root of :math:`\lambda_G=\tau(1-\mathrm{df}_1(\tau)/n)`)
    and a spread of :math:`\delta_i` over :math:`i` that shrinks like :math:`n^{-1/2}`.
    """
    e, Q = sample_covariance_eigh(X, vectors=True)
    lam_G = _real("lam_G", lam_G, like=e)
    if lam_G.dim() != 1 or bool((lam_G <= 0).any()):
        raise ValueError("lam_G must be a vector of penalties > 0")
    s = _real("eigenvalues", eigenvalues, like=e)
    d, n = e.shape[-1], X.shape[-2]
    if s.shape != (d,) or bool((s <= 0).any()):
        raise ValueError(f"eigenvalues must be a positive vector of length {d}, got shape {tuple(s.shape)}")
    filt = 1.0 / (e.clamp_min(0.0).unsqueeze(-2) + lam_G.unsqueeze(-1))        # (..., L, d)
    sq = (s.unsqueeze(-1) * Q.square()).sum(-2).unsqueeze(-2)                   # (..., 1, d): q_k^T Sigma q_k
    delta = (filt * sq).sum(-1) / n                                           # tr(Sigma R)/n
    proj = (X.to(Q.dtype) @ Q).square()                                        # (..., n, d): (x_i^T q_k)^2
    q = (proj.unsqueeze(-3) * filt.unsqueeze(-2)).sum(-1) / n                   # (..., L, n)
    return LeaveOneOut(lam_G * (1 + delta), q / (1 - q))


# ------------------------------------------------------------------------------------------------ spikes (BBP)
def _strength(strength) -> torch.Tensor:
    xi = _real("strength", strength)
    if bool((xi < 0).any()):
        raise ValueError("strength must be >= 0")
    return xi


def spike_outlier(strength, gamma: float) -> torch.Tensor:
    r"""Limit of :math:`\lmax(\hat\Sigma)` for :math:`\Sigma = I + \xi\,e_1e_1^\top` (ratio :math:`\gamma = d/n`):

    .. math::

        \lambda_{\mathrm{out}} = (1+\xi)\Big(1 + \frac{\gamma}{\xi}\Big) \quad (\xi > \sqrt\gamma),
        \qquad \lambda_+ = (1+\sqrt\gamma)^2 \quad (\xi \le \sqrt\gamma).

    The BBP transition (Baik, Ben Arous & Péché 2005): below the threshold :math:`\sqrt\gamma` the spike is
    invisible in the top eigenvalue; above it an outlier separates from the bulk, by
    :math:`(\xi-\sqrt\gamma)^2/\xi`. Derived in chapter 04 from the secular equation
    :math:`1 + \frac{\lambda\xi}{1+\xi}s_\gamma(\lambda) = 0`. ``strength`` is :math:`\xi \ge 0`, any shape;
    float64. By rotation invariance the direction of the spike does not matter.
    """
    g = _gamma(gamma)
    xi = _strength(strength)
    above = xi > math.sqrt(g)
    safe = torch.where(above, xi, torch.ones_like(xi))
    return torch.where(above, (1 + safe) * (1 + g / safe), torch.full_like(xi, mp_edges(g)[1]))


def spike_overlap(strength, gamma: float) -> torch.Tensor:
    r"""Limit of :math:`\langle \hat u_1, e_1\rangle^2`, the squared cosine between the top eigenvector of
    :math:`\hat\Sigma` and the spike direction of :math:`\Sigma = I + \xi\,e_1e_1^\top`:

    .. math::

        \frac{1 - \gamma/\xi^2}{1 + \gamma/\xi} \quad (\xi > \sqrt\gamma), \qquad 0 \quad (\xi \le \sqrt\gamma).

    Derived in chapter 04 as the residue of :math:`e_1^\top(z-\hat\Sigma)^{-1}e_1` at the outlier. ``strength``
    is :math:`\xi \ge 0`, any shape; float64.
    """
    g = _gamma(gamma)
    xi = _strength(strength)
    above = xi > math.sqrt(g)
    safe = torch.where(above, xi, torch.ones_like(xi))
    return torch.where(above, (1 - g / safe**2) / (1 + g / safe), torch.zeros_like(xi))


def simulate_spike(strength, n: int, d: int, replicates: int, *, generator: torch.Generator | None = None,
                   device=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Top eigenvalue of :math:`\hat\Sigma` and its squared overlap with the spike of :math:`\Sigma = I+\xi e_1e_1^\top`.

    Draws ``replicates`` Gaussian matrices :math:`Z \in \mathbb{R}^{n\times d}` once and reuses them for every
    strength :math:`\xi` (common random numbers: :math:`\hat\Sigma_\xi = D_\xi (Z^\top Z/n) D_\xi` with
    :math:`D_\xi = \operatorname{diag}(\sqrt{1+\xi}, 1, \dots, 1)`; by rotation invariance the spike can be
    :math:`e_1`). ``strength`` is a vector of :math:`\xi \ge 0`. Returns ``(top, overlap)``, each
    ``(len(strength), replicates)`` in float64.
    """
    xi = _strength(strength)
    if xi.dim() != 1:
        raise ValueError(f"strength must be a vector of spike strengths, got shape {tuple(xi.shape)}")
    n, d = check_int("n", n, min_value=1), check_int("d", d, min_value=2)
    R = check_int("replicates", replicates, min_value=1)
    dev = config.spectral_device(config.device() if device is None else device)
    Z = torch.randn(R, n, d, generator=generator, dtype=torch.float64).to(dev)
    S = Z.transpose(-2, -1) @ Z / n
    tops, overlaps = [], []
    for value in xi.tolist():
        D = torch.ones(d, dtype=torch.float64, device=dev)
        D[0] = math.sqrt(1.0 + value)
        lam, Q = _eigh(D[:, None] * S * D[None, :])
        tops.append(lam[:, -1])
        overlaps.append(Q[:, 0, -1].square())
    return torch.stack(tops), torch.stack(overlaps)


# ------------------------------------------------------------------------------------------------ Grassmannian
def grassmann_geodesic(Q, H, t) -> torch.Tensor:
    r"""Point at time :math:`t` on the Grassmann geodesic from :math:`\operatorname{span}(Q)` with velocity H.

    With the thin SVD :math:`H = U\,\operatorname{diag}(\psi)\,V^\top` of a tangent vector (:math:`Q^\top H = 0`),

    .. math::

        Y(t) = Q V \cos(t\psi) V^\top + U \sin(t\psi) V^\top

    (Edelman, Arias & Smith 1998) has orthonormal columns, and the principal angles between
    :math:`\operatorname{span}(Q)` and :math:`\operatorname{span}(Y(t))` are :math:`t\psi_i` while
    :math:`t\psi_i \le \pi/2`. ``Q`` ``(d, k)`` with orthonormal columns, ``H`` ``(d, k)``, ``t`` a number or a
    vector ``(T,)``; returns ``(d, k)`` or ``(T, d, k)`` in float64. Column spaces here; pass ``Y.mT`` to
    :func:`curvlab.linalg.principal_angles`, which compares row spaces.
    """
    Q = config.spectral(check_matrix("Q", Q))
    H = config.spectral(check_matrix("H", H)).to(Q.device)
    if H.shape != Q.shape:
        raise ValueError(f"H must have the shape of Q {tuple(Q.shape)}, got {tuple(H.shape)}")
    k = Q.shape[-1]
    eye = torch.eye(k, dtype=torch.float64, device=Q.device)
    scale = 100 * max(Q.shape) * torch.finfo(torch.float64).eps
    if float((Q.T @ Q - eye).abs().max()) > scale:
        raise ValueError("Q must have orthonormal columns")
    if float((Q.T @ H).abs().max()) > scale * max(1.0, float(H.abs().max())):
        raise ValueError("H must be tangent at Q: Q^T H = 0")
    tt = _real("t", t, like=Q)
    if tt.dim() > 1:
        raise ValueError(f"t must be a number or a vector, got shape {tuple(tt.shape)}")
    U, psi, Vh = torch.linalg.svd(H, full_matrices=False)
    arg = tt.reshape(-1, 1, 1) * psi  # (T, 1, k)
    cos_part = (Q @ Vh.T).unsqueeze(0) * torch.cos(arg)
    sin_part = U.unsqueeze(0) * torch.sin(arg)
    Y = (cos_part + sin_part) @ Vh
    return Y[0] if tt.dim() == 0 else Y
