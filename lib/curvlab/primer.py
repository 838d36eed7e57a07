r"""Toy problems and helpers for the chapter *The curvature primer* (``notebooks/01_curvature_primer``).

The chapter compares the curvature matrices of the squared loss and the optimisers built on them. Everything
here is small and dense on purpose: the point is to *see* each object. The Jacobian machinery, Gauss–Newton
products and the kernel-form GN step come from :mod:`curvlab.curvature`; this module adds

* **least-squares problems** :class:`LeastSquares` with residual :math:`r(\theta)\in\R^{N}` and loss
  :math:`\Loss(\theta)=\lVert r(\theta)\rVert^2/(2n)`, and three 2-D ones — an ill-conditioned quadratic
  (:func:`quadratic`), the Rosenbrock residuals (:func:`rosenbrock`) and a nonzero-residual problem
  (:func:`dennis_schnabel`);
* the **Hessian split** :math:`H=\GN+H_{\mathrm{res}}` (:func:`hessian_parts`) and the two-layer network whose
  curvature the chapter dissects (:func:`two_layer`);
* the **update rules** of GD, GN, Newton, Levenberg–Marquardt and GN with a line search, one function each,
  :func:`run`, which iterates one of them, and the GN map :func:`gn_map` as a pure function;
* **rates**: :func:`gd_rate`, :func:`gn_local_rate`, :func:`contraction_ratios`;
* **Fisher matrices**: :func:`empirical_fisher`, :func:`fisher_mc`, and the population empirical Fisher of
  Gaussian linear regression (:func:`ef_linear_regression`);
* **Kronecker factors** of a layer (:func:`mlp_layer_factors`, :func:`layer_jacobian`, :func:`layer_gn_block`,
  :func:`kfac_factors`, :func:`conv1d_patches`, :func:`relative_error`);
* **figures**: loss contours with optimiser paths drawn in the method registry's styles (:func:`plot_paths`).

Conventions: row-major :math:`\operatorname{vec}` (so a layer's K-FAC block is :math:`\Cout\otimes\Cin`), the book's
normalisation :math:`\GN=J^\top J/n`, :math:`H_{\mathrm{res}}=\frac1n\sum_{i,c}r_{i,c}\nabla^2 r_{i,c}`, and damping
:math:`\lamGN` in the units of the eigenvalues of :math:`\GN`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.func import hessian, jacfwd, jacrev, jvp, vmap

from . import config
from ._validate import (_check_number, as_tensor, check_choice, check_finite, check_int, check_matrix,
                        check_nonnegative, check_positive)
from .curvature import damped_gn_step, jacobian

__all__ = [
    "LeastSquares",
    "quadratic",
    "rosenbrock",
    "dennis_schnabel",
    "two_layer",
    "hessian_parts",
    "gd_step",
    "gn_step",
    "newton_step",
    "gn_map",
    "lm_step",
    "armijo_step",
    "run",
    "METHODS",
    "gd_rate",
    "gn_local_rate",
    "contraction_ratios",
    "second_derivative_norm",
    "empirical_fisher",
    "fisher_mc",
    "ef_linear_regression",
    "gn_step_cost",
    "mlp_layer_factors",
    "layer_jacobian",
    "layer_gn_block",
    "layer_ef_block",
    "kfac_factors",
    "conv1d_patches",
    "relative_error",
    "loss_contours",
    "plot_paths",
]

Residual = Callable[[torch.Tensor], torch.Tensor]


# ============================================================================================ problems
@dataclass(frozen=True)
class LeastSquares:
    r"""A least-squares problem :math:`\Loss(\theta)=\frac1{2n}\lVert r(\theta)\rVert^2`.

    ``residual`` maps a flat ``theta`` of shape ``(p,)`` to the residual vector ``(N,)`` (``N = n d_y``);
    ``n`` is the number of samples that normalises the loss (``N`` for scalar outputs); ``theta_star`` is a
    known minimiser (or ``None``). Gradient :math:`\nabla\Loss=J^\top r/n`, Gauss–Newton matrix
    :math:`\GN=J^\top J/n` (chapter *The curvature primer*).
    """

    name: str
    residual: Residual
    n: int
    theta_star: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not callable(self.residual):
            raise TypeError(f"residual must be callable theta -> r, got {type(self.residual).__name__}")
        check_int("n", self.n, min_value=1)

    def loss(self, theta) -> torch.Tensor:
        """:math:`\\lVert r(\\theta)\\rVert^2/(2n)`; ``theta`` may carry leading batch dimensions ``(..., p)``."""
        theta = _theta(theta)
        if theta.dim() == 1:
            return self.residual(theta).square().sum() / (2 * self.n)
        flat = theta.reshape(-1, theta.shape[-1])
        out = vmap(lambda th: self.residual(th).square().sum())(flat) / (2 * self.n)
        return out.reshape(theta.shape[:-1])

    def jacobian(self, theta) -> torch.Tensor:
        """:math:`J=\\partial r/\\partial\\theta`, shape ``(N, p)``."""
        return jacobian(self.residual, _theta(theta))

    def gradient(self, theta) -> torch.Tensor:
        """:math:`\\nabla\\Loss=J^\\top r/n`."""
        theta = _theta(theta)
        return self.jacobian(theta).T @ self.residual(theta) / self.n

    def gn_matrix(self, theta) -> torch.Tensor:
        """:math:`\\GN=J^\\top J/n`."""
        J = self.jacobian(theta)
        return J.T @ J / self.n

    def hessian(self, theta) -> torch.Tensor:
        """The Hessian of the loss, by ``torch.func.hessian`` (forward-over-reverse)."""
        theta = _theta(theta)
        return hessian(lambda th: self.residual(th).square().sum() / (2 * self.n))(theta)


def _theta(theta) -> torch.Tensor:
    t = check_finite("theta", as_tensor("theta", theta))
    if t.dim() < 1 or t.shape[-1] == 0:
        raise ValueError(f"theta must have shape (p,) or (..., p) with p >= 1, got {tuple(t.shape)}")
    return t


def _check_problem(problem) -> LeastSquares:
    if not isinstance(problem, LeastSquares):
        raise TypeError(f"problem must be a curvlab.primer.LeastSquares, got {type(problem).__name__}")
    return problem


def quadratic(kappa: float, lam_max: float = 1.0, angle: float = math.pi / 6,
              theta_star=(1.0, 0.5)) -> LeastSquares:
    r"""The ill-conditioned quadratic :math:`\Loss(\theta)=\frac12(\theta-\theta_\star)^\top A(\theta-\theta_\star)`.

    :math:`A=Q\operatorname{diag}(\lambda_{\max},\lambda_{\max}/\kappa)Q^\top` with :math:`Q` the rotation by
    ``angle``. Written as least squares with :math:`n=2` residuals :math:`r=\sqrt2A^{1/2}(\theta-\theta_\star)`, so
    :math:`H=\GN=A` and :math:`H_{\mathrm{res}}=0`.
    """
    kappa = check_positive("kappa", kappa)
    if kappa < 1:
        raise ValueError(f"kappa must be >= 1 (a condition number), got {kappa}")
    lam_max = check_positive("lam_max", lam_max)
    angle = _check_number("angle", angle)
    c, s = math.cos(angle), math.sin(angle)
    Q = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    R = math.sqrt(2.0) * Q @ torch.diag(torch.tensor([lam_max, lam_max / kappa], dtype=torch.float64).sqrt()) @ Q.T
    star = check_finite("theta_star", as_tensor("theta_star", theta_star, dtype=torch.float64))
    if star.shape != (2,):
        raise ValueError(f"theta_star must have shape (2,), got {tuple(star.shape)}")

    def residual(theta: torch.Tensor) -> torch.Tensor:
        return R.to(theta) @ (theta - star.to(theta))

    return LeastSquares(f"quadratic(kappa={kappa:g})", residual, 2, star)


def rosenbrock() -> LeastSquares:
    r"""Rosenbrock's function as least squares: :math:`r(\theta)=\big(10(\theta_2-\theta_1^2),\ 1-\theta_1\big)`.

    Zero residual at :math:`\theta_\star=(1,1)`; :math:`J` is square with :math:`\det J=10`, so it is invertible
    everywhere and the undamped GN step is Newton's method for :math:`r(\theta)=0`.
    """

    def residual(theta: torch.Tensor) -> torch.Tensor:
        return torch.stack([10 * (theta[1] - theta[0] ** 2), 1 - theta[0]])

    return LeastSquares("rosenbrock", residual, 2, torch.tensor([1.0, 1.0], dtype=torch.float64))


def dennis_schnabel(nu: float) -> LeastSquares:
    r"""A nonzero-residual problem: :math:`r(\theta)=(\theta_1+1,\ \nu\theta_1^2+\theta_1-1,\ \theta_2-\theta_1)`.

    A two-parameter version of the classic one-dimensional example of Dennis and Schnabel. For every
    :math:`\nu` the point :math:`\theta_\star=0` is stationary with residual :math:`(1,-1,0)`; it is a strict
    minimum iff :math:`\nu<1`, and :math:`-\GN^{-1}H_{\mathrm{res}}` has the eigenvalues :math:`\nu` and
    :math:`0` there, so undamped GN converges locally at the rate :math:`|\nu|`, and not at all (from generic
    starts) when :math:`|\nu|>1`.
    """
    if isinstance(nu, bool) or not isinstance(nu, (int, float)) or not math.isfinite(nu):
        raise TypeError(f"nu must be a finite real number, got {nu!r}")
    nu = float(nu)

    def residual(theta: torch.Tensor) -> torch.Tensor:
        t1, t2 = theta[0], theta[1]
        return torch.stack([t1 + 1, nu * t1**2 + t1 - 1, t2 - t1])

    return LeastSquares(f"dennis_schnabel(nu={nu:g})", residual, 3, torch.zeros(2, dtype=torch.float64))


def two_layer(X, Y, m: int, act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh):
    r"""The two-layer network :math:`f_\theta(x)=V\phi(Wx)` as a residual function of :math:`\theta=(\vecop W,\vecop V)`.

    ``X: (n, d)``, ``Y: (n, d_y)``; returns ``(residual, n)`` where ``residual(theta)`` is
    :math:`\vecop\big(f_\theta(X)-Y\big)\in\R^{n d_y}` (row-major: sample by sample) and
    :math:`p=md+d_ym`. Wrap it in :class:`LeastSquares` to get the loss :math:`\frac1{2n}\lVert f_\theta(X)-Y\rVert_F^2`.
    """
    X = check_matrix("X", X)
    Y = check_matrix("Y", Y, dtype=X.dtype, device=X.device)
    if Y.shape[0] != X.shape[0]:
        raise ValueError(f"Y must have as many rows as X ({X.shape[0]}), got {Y.shape[0]}")
    m = check_int("m", m, min_value=1)
    if not callable(act):
        raise TypeError(f"act must be callable, got {type(act).__name__}")
    n, d = X.shape
    d_y = Y.shape[1]

    def residual(theta: torch.Tensor) -> torch.Tensor:
        W = theta[: m * d].reshape(m, d)
        V = theta[m * d:].reshape(d_y, m)
        return (act(X @ W.T) @ V.T - Y).reshape(-1)

    residual.p = m * d + d_y * m  # type: ignore[attr-defined]
    return residual, n


# ============================================================================================ Hessian split
def hessian_parts(residual: Residual, theta, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The Hessian of :math:`\Loss=\lVert r\rVert^2/(2n)` and its two parts, each computed on its own.

    Returns ``(H, H_GN, H_res)``: :math:`H` by ``torch.func.hessian`` of the loss;
    :math:`\GN=J^\top J/n`; :math:`H_{\mathrm{res}}=\frac1n\sum_{i,c}r_{i,c}\nabla^2_\theta r_{i,c}` from the per-residual
    Hessians (forward mode over the reverse-mode Jacobian). The identity :math:`H=\GN+H_{\mathrm{res}}` is the chain rule;
    ``n`` defaults to the length of :math:`r` (scalar outputs).
    """
    if not callable(residual):
        raise TypeError(f"residual must be callable theta -> r, got {type(residual).__name__}")
    theta = _theta(theta)
    if theta.dim() != 1:
        raise ValueError(f"theta must be a flat vector (p,), got {tuple(theta.shape)}")
    r = residual(theta)
    n = r.numel() if n is None else check_int("n", n, min_value=1)
    J = jacobian(residual, theta)
    H = hessian(lambda th: residual(th).square().sum() / (2 * n))(theta)
    # (N, p, p): the Hessian of each residual entry, forward-over-reverse. Not jacfwd(jacfwd(.)): in torch 2.13
    # second-order forward mode through torch.linalg.solve is wrong, and a residual may contain a solve.
    per_residual = jacfwd(jacrev(residual))(theta)
    H_res = torch.einsum("k,kij->ij", r, per_residual) / n
    return H, J.T @ J / n, H_res


# ============================================================================================ update rules
def gd_step(problem: LeastSquares, theta, eta: float) -> torch.Tensor:
    r"""Gradient descent: :math:`\theta\leftarrow\theta-\eta\nabla\Loss(\theta)`."""
    eta = check_positive("eta", eta)
    return theta - eta * _check_problem(problem).gradient(theta)


def gn_step(problem: LeastSquares, theta, lam_GN: float = 0.0, eta: float = 1.0) -> torch.Tensor:
    r"""(Damped) Gauss–Newton: :math:`\theta\leftarrow\theta-\eta(\GN+\lamGN I)^{-1}\nabla\Loss(\theta)`.

    Since :math:`(\GN+\lamGN I)^{-1}\nabla\Loss=(J^\top J+n\lamGN I)^{-1}J^\top r`, this is
    :func:`curvlab.curvature.damped_gn_step` with damping :math:`n\lamGN`.
    """
    problem = _check_problem(problem)
    lam_GN, eta = check_nonnegative("lam_GN", lam_GN), check_positive("eta", eta)
    J, r = problem.jacobian(theta), problem.residual(theta)
    return theta - eta * damped_gn_step(J, r, problem.n * lam_GN)


def gn_map(problem: LeastSquares) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""The undamped GN map :math:`\Psi(\theta)=\theta-(J^\top J)^{-1}J^\top r` as a pure function (``torch.func``-friendly,
    so :math:`D\Psi` and :math:`D^2\Psi` can be taken with ``jacrev``; see :func:`second_derivative_norm` for why not
    with nested ``jacfwd``)."""
    problem = _check_problem(problem)
    jac = jacfwd(problem.residual)

    def G(theta: torch.Tensor) -> torch.Tensor:
        J = jac(theta)
        return theta - torch.linalg.solve(J.T @ J, J.T @ problem.residual(theta))

    return G


def newton_step(problem: LeastSquares, theta) -> torch.Tensor:
    r"""Newton: :math:`\theta\leftarrow\theta-H(\theta)^{-1}\nabla\Loss(\theta)` with the full Hessian :math:`H=\GN+H_{\mathrm{res}}`."""
    problem = _check_problem(problem)
    return theta - torch.linalg.solve(problem.hessian(theta), problem.gradient(theta))


def armijo_step(problem: LeastSquares, theta, direction, grad=None, c: float = 1e-4, shrink: float = 0.5,
                max_halvings: int = 60) -> torch.Tensor:
    r"""Backtracking (Armijo) line search along ``-direction``, starting from the full step :math:`\alpha=1`:

    the first :math:`\alpha\in\{1,\tfrac12,\tfrac14,\dots\}` with
    :math:`\Loss(\theta-\alpha\Delta)\le\Loss(\theta)-c\,\alpha\,\nabla\Loss^\top\Delta`
    (Nocedal & Wright, ch. 3). ``direction`` must be a descent direction, :math:`\nabla\Loss^\top\Delta>0`;
    ``grad`` is :math:`\nabla\Loss(\theta)` when already computed. If no step passes, or the slope is exactly zero,
    ``theta`` is returned.
    """
    problem = _check_problem(problem)
    c, shrink = _check_number("c", c), _check_number("shrink", shrink)
    if not 0 < c < 1 or not 0 < shrink < 1:
        raise ValueError(f"c and shrink must lie in (0, 1), got c={c}, shrink={shrink}")
    max_halvings = check_int("max_halvings", max_halvings, min_value=0)
    theta = _theta(theta)
    if theta.dim() != 1:
        raise ValueError(f"theta must be a parameter vector (p,), got shape {tuple(theta.shape)}")
    direction = check_finite("direction", as_tensor("direction", direction, dtype=theta.dtype))
    if direction.shape != theta.shape:
        raise ValueError(f"direction must have the shape of theta {tuple(theta.shape)}, got {tuple(direction.shape)}")
    if grad is None:
        g = problem.gradient(theta)
    else:
        g = check_finite("grad", as_tensor("grad", grad, dtype=theta.dtype))
        if g.shape != theta.shape:
            raise ValueError(f"grad must have the shape of theta {tuple(theta.shape)}, got {tuple(g.shape)}")
    slope, base, alpha = float(g @ direction), float(problem.loss(theta)), 1.0
    if slope < 0:
        raise ValueError(f"direction must be a descent direction (grad . direction > 0), got {slope:.3g}")
    if slope == 0:  # a stationary point (or a zero direction): nothing to gain
        return theta
    for _ in range(max_halvings):
        trial = theta - alpha * direction
        if float(problem.loss(trial)) <= base - c * alpha * slope:
            return trial
        alpha *= shrink
    return theta


def lm_step(problem: LeastSquares, theta, lam_GN: float, up: float = 2.0, down: float = 3.0):
    r"""One Levenberg–Marquardt step with adaptive damping; returns ``(theta, lam_GN)``.

    Try the damped GN step :math:`\theta'=\theta-(\GN+\lamGN I)^{-1}\nabla\Loss`. If it lowers the loss, accept it
    and trust the model more (:math:`\lamGN\leftarrow\lamGN/\mathrm{down}`); otherwise stay and damp more
    (:math:`\lamGN\leftarrow\mathrm{up}\cdot\lamGN`). Large :math:`\lamGN` gives a short gradient step,
    small :math:`\lamGN` the GN step.
    """
    lam_GN = check_positive("lam_GN", lam_GN)
    if not (up > 1 and down > 1):
        raise ValueError(f"up and down must be > 1, got up={up}, down={down}")
    trial = gn_step(problem, theta, lam_GN)
    if float(problem.loss(trial)) < float(problem.loss(theta)):
        return trial, lam_GN / down
    return theta, lam_GN * up


#: The methods :func:`run` knows, by their names in the plotting registry.
METHODS = ("GD", "GN", "Newton", "LM", "GN+line-search")


def run(problem: LeastSquares, method: str, theta0, n_steps: int, *, eta: float | None = None,
        lam_GN: float = 1.0, line_search: bool = False) -> torch.Tensor:
    r"""Iterate one update rule from ``theta0`` for ``n_steps`` steps; returns the iterates ``(n_steps + 1, p)``.

    ``method`` is one of :data:`METHODS`: ``"GD"`` (step ``eta``; with ``line_search=True``, Armijo
    backtracking from the step ``eta``), ``"GN"`` (undamped, full step), ``"Newton"``, ``"LM"`` (initial damping
    ``lam_GN``, adapted by :func:`lm_step`; a rejected step repeats the iterate) and ``"GN+line-search"``
    (Armijo backtracking along the undamped GN direction). Iterates are float64; a run that leaves the
    floating-point range stops early and repeats its last finite iterate.
    """
    problem = _check_problem(problem)
    method = check_choice("method", method, METHODS)
    n_steps = check_int("n_steps", n_steps, min_value=0)
    theta = check_finite("theta0", as_tensor("theta0", theta0, dtype=torch.float64))
    if theta.dim() != 1:
        raise ValueError(f"theta0 must have shape (p,), got {tuple(theta.shape)}")
    if method == "GD":
        if eta is None:
            raise ValueError("eta (the GD step size) is required for method 'GD'")
        eta = check_positive("eta", eta)
    lam = check_positive("lam_GN", lam_GN)
    out = [theta]
    for _ in range(n_steps):
        if method == "GD" and line_search:
            g = problem.gradient(theta)
            new = armijo_step(problem, theta, eta * g, grad=g)
        elif method == "GD":
            new = gd_step(problem, theta, eta)
        elif method == "GN":
            new = gn_step(problem, theta)
        elif method == "Newton":
            new = newton_step(problem, theta)
        elif method == "LM":
            new, lam = lm_step(problem, theta, lam)
        else:
            J, r = problem.jacobian(theta), problem.residual(theta)
            new = armijo_step(problem, theta, damped_gn_step(J, r, 0.0), grad=J.T @ r / problem.n)
        if not bool(torch.isfinite(new).all()) or float(new.abs().max()) > 1e150:
            out.extend([theta] * (n_steps + 1 - len(out)))
            break
        theta = new
        out.append(theta)
    return torch.stack(out)


# ============================================================================================ rates
def gd_rate(kappa: float, policy: str = "optimal") -> float:
    r"""Per-step contraction of :math:`\lVert\theta_t-\theta_\star\rVert` for GD on a quadratic with :math:`\kappa=\lmax/\lmin`.

    ``policy="optimal"``: step :math:`2/(\lmin+\lmax)`, rate :math:`(\kappa-1)/(\kappa+1)` (both eigen-directions
    contract by exactly this factor, so every step does). ``policy="1/lmax"``: step :math:`1/\lmax`, rate
    :math:`1-1/\kappa` (exact from the second step on: the first step removes the top eigen-component).
    """
    kappa = check_positive("kappa", kappa)
    if kappa < 1:
        raise ValueError(f"kappa must be >= 1, got {kappa}")
    policy = check_choice("policy", policy, ("optimal", "1/lmax"))
    return (kappa - 1) / (kappa + 1) if policy == "optimal" else 1 - 1 / kappa


def gn_local_rate(H_GN, H_res) -> float:
    r"""Local linear rate of undamped GN at a minimum: the spectral radius :math:`\rho(\GN^{-1}H_{\mathrm{res}})`.

    The GN map :math:`\Psi(\theta)=\theta-\GN^{-1}\nabla\Loss` has derivative :math:`I-\GN^{-1}H=-\GN^{-1}H_{\mathrm{res}}`
    at a stationary point. Its eigenvalues are real: they are those of the symmetric
    :math:`\GN^{-1/2}H_{\mathrm{res}}\GN^{-1/2}`. Computed in float64.
    """
    G = config.spectral(check_matrix("H_GN", H_GN, square=True))
    R = config.spectral(check_matrix("H_res", H_res, square=True)).to(G.device)
    if R.shape != G.shape:
        raise ValueError(f"H_res must have the shape of H_GN {tuple(G.shape)}, got {tuple(R.shape)}")
    lam, Q = torch.linalg.eigh(0.5 * (G + G.T))
    if float(lam[0]) <= G.shape[0] * torch.finfo(torch.float64).eps * float(lam[-1]):
        raise ValueError(f"H_GN must be positive definite; its smallest eigenvalue is {float(lam[0]):.3g}")
    inv_half = (Q / lam.sqrt()) @ Q.T
    S = inv_half @ (0.5 * (R + R.T)) @ inv_half
    return float(torch.linalg.eigvalsh(S).abs().max())


def contraction_ratios(iterates, theta_star) -> torch.Tensor:
    r"""Per-step ratios :math:`\lVert\theta_{t+1}-\theta_\star\rVert/\lVert\theta_t-\theta_\star\rVert`, shape ``(T,)``."""
    it = check_matrix("iterates", iterates)
    star = check_finite("theta_star", as_tensor("theta_star", theta_star, dtype=it.dtype, device=it.device))
    if star.shape != it.shape[-1:]:
        raise ValueError(f"theta_star must have shape ({it.shape[-1]},), got {tuple(star.shape)}")
    err = (it - star).norm(dim=-1)
    if bool((err[:-1] == 0).any()):
        raise ValueError("iterates hit theta_star exactly; contraction ratios are undefined from there on")
    return err[1:] / err[:-1]


def second_derivative_norm(fn: Callable[[torch.Tensor], torch.Tensor], points) -> float:
    r"""The largest Frobenius norm of the second derivative :math:`D^2\!f` over ``points`` ``(k, p)``.

    For a map :math:`f:\R^p\to\R^q` the Taylor remainder obeys
    :math:`\lVert f(x+e)-f(x)-Df(x)e\rVert\le\frac12\sup\lVert D^2f\rVert\,\lVert e\rVert^2`; this returns the
    maximum of :math:`\lVert D^2 f\rVert_F\ge\lVert D^2f\rVert_{\mathrm{op}}` at the given points.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    pts = check_matrix("points", points)
    # Reverse over reverse: in torch 2.13, jacfwd(jacfwd(f)) and jacrev(jacfwd(f)) return wrong second
    # derivatives when f calls torch.linalg.solve (as the GN map does); reverse-over-reverse is correct.
    second = jacrev(jacrev(fn))
    return max(float(second(pt).norm()) for pt in pts)


# ============================================================================================ Fisher matrices
def _per_sample(J: torch.Tensor, n: int) -> torch.Tensor:
    if J.shape[0] % n:
        raise ValueError(f"J must have n * d_y rows (n = {n}), got {J.shape[0]}")
    return J.reshape(n, J.shape[0] // n, J.shape[1])


def empirical_fisher(J, r, n: int) -> torch.Tensor:
    r"""The empirical Fisher :math:`\EFisher=\frac1n\sum_i\nabla\ell_i\nabla\ell_i^\top` with :math:`\nabla\ell_i=J_i^\top r_i`.

    ``J: (n d_y, p)`` (rows sample by sample), ``r: (n d_y,)``. Built from the *observed* residuals.
    """
    J = check_matrix("J", J)
    n = check_int("n", n, min_value=1)
    r = check_finite("r", as_tensor("r", r, dtype=J.dtype, device=J.device))
    if r.shape != (J.shape[0],):
        raise ValueError(f"r must have shape ({J.shape[0]},), got {tuple(r.shape)}")
    Ji = _per_sample(J, n)
    grads = torch.einsum("iop,io->ip", Ji, r.reshape(n, -1))
    return grads.T @ grads / n


def fisher_mc(J, n: int, draws: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Monte Carlo true Fisher of the Gaussian likelihood :math:`y\sim\Normal(f_\theta(x),I_{d_y})`, one per draw.

    Each draw samples labels from the model, so the residuals are :math:`u_i\sim\Normal(0,I_{d_y})`, and forms
    :math:`\frac1n\sum_iJ_i^\top u_iu_i^\top J_i`. Returns ``(draws, p, p)``; their mean is unbiased for
    :math:`\Fisher=\GN=J^\top J/n`.
    """
    J = check_matrix("J", J)
    n = check_int("n", n, min_value=1)
    draws = check_int("draws", draws, min_value=1)
    Ji = _per_sample(J, n)
    u = torch.randn(draws, n, Ji.shape[1], generator=generator, dtype=J.dtype).to(J.device)
    grads = torch.einsum("iop,bio->bip", Ji, u)
    return grads.transpose(-2, -1) @ grads / n


def ef_linear_regression(Sigma, e, sigma_eps: float = 0.0) -> torch.Tensor:
    r"""Population empirical Fisher of linear regression with Gaussian inputs, :math:`x\sim\Normal(0,\Sigma)`.

    For :math:`y=x^\top\theta_\star+\varepsilon`, :math:`\varepsilon\sim\Normal(0,\sigma_\varepsilon^2)` and
    :math:`e=\theta-\theta_\star`, Isserlis' theorem gives
    :math:`\E[(x^\top e-\varepsilon)^2xx^\top]=(e^\top\Sigma e+\sigma_\varepsilon^2)\Sigma+2\Sigma ee^\top\Sigma`.
    ``e`` may be batched ``(..., d)``.
    """
    Sigma = check_matrix("Sigma", Sigma, square=True)
    e = check_finite("e", as_tensor("e", e, dtype=Sigma.dtype, device=Sigma.device))
    if e.dim() < 1 or e.shape[-1] != Sigma.shape[0]:
        raise ValueError(f"e must have shape (..., {Sigma.shape[0]}), got {tuple(e.shape)}")
    sigma_eps = check_nonnegative("sigma_eps", sigma_eps)
    b = e @ Sigma
    a = (b * e).sum(-1) + sigma_eps**2
    return a[..., None, None] * Sigma + 2 * b[..., :, None] * b[..., None, :]


def gn_step_cost(n: int, p: int) -> dict[str, int]:
    r"""Leading flop counts of the damped GN direction: parameter form :math:`np^2+p^3/3` (form :math:`J^\top J`,
    Cholesky), kernel form :math:`n^2p+n^3/3` (form :math:`JJ^\top`, Cholesky); the :math:`O(np)` products omitted."""
    n, p = check_int("n", n, min_value=1), check_int("p", p, min_value=1)
    return {"parameter": n * p * p + p**3 // 3, "kernel": n * n * p + n**3 // 3}


# ============================================================================================ Kronecker factors
def _derivative(act: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """Entrywise derivative of an entrywise activation, by one forward-mode product."""
    return jvp(act, (z,), (torch.ones_like(z),))[1]


def mlp_layer_factors(Ws, X, act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh):
    r"""Inputs and backward factors of every layer of :math:`f(x)=W_L\phi(W_{L-1}\cdots\phi(W_1x))` (no biases).

    For layer :math:`l` with :math:`z_l=W_la_l`, returns ``[(B_l, a_l)]`` with ``B_l: (n, d_y, m_l)`` the output Jacobians :math:`B_l=\partial f/\partial z_l`, by the backward recursion
    :math:`B_L=I_{d_y}`, :math:`B_l=B_{l+1}W_{l+1}\diag\phi'(z_l)`, and ``a_l: (n, m_{l-1})`` the layer inputs. The layer's per-sample Jacobian is then
    :math:`J_i=B_{l,i}\otimes a_{l,i}^\top` (row-major :math:`\vecop`).
    """
    if not isinstance(Ws, (list, tuple)) or not Ws:
        raise TypeError("Ws must be a non-empty list of weight matrices [W_1, ..., W_L]")
    X = check_matrix("X", X)
    Ws = [check_matrix(f"Ws[{i}]", W, dtype=X.dtype, device=X.device) for i, W in enumerate(Ws)]
    for i, W in enumerate(Ws):
        prev = X.shape[1] if i == 0 else Ws[i - 1].shape[0]
        if W.shape[1] != prev:
            raise ValueError(f"Ws[{i}] must have {prev} columns, got shape {tuple(W.shape)}")
    if not callable(act):
        raise TypeError(f"act must be callable, got {type(act).__name__}")
    inputs, slopes, a = [], [], X
    for i, W in enumerate(Ws):
        inputs.append(a)
        z = a @ W.T
        if i < len(Ws) - 1:
            slopes.append(_derivative(act, z))
            a = act(z)
    n, d_y = X.shape[0], Ws[-1].shape[0]
    B = torch.eye(d_y, dtype=X.dtype, device=X.device).expand(n, d_y, d_y)
    backward = [B]
    for i in range(len(Ws) - 2, -1, -1):
        B = (B @ Ws[i + 1]) * slopes[i][:, None, :]
        backward.append(B)
    return list(zip(backward[::-1], inputs))


def _check_factors(B, a) -> tuple[torch.Tensor, torch.Tensor]:
    """``a -> (n, n_pos, d_in)``, ``B -> (n, n_pos, d_y, d_out)`` (no position axis means ``n_pos = 1``)."""
    a = check_finite("a", as_tensor("a", a))
    B = check_finite("B", as_tensor("B", B, dtype=a.dtype, device=a.device))
    if a.dim() == 2:
        a = a[:, None, :]
    if B.dim() == 3:
        B = B[:, None]
    if a.dim() != 3 or B.dim() != 4:
        raise ValueError(f"a must be (n, d_in) or (n, n_pos, d_in) and B (n, d_y, d_out) or (n, n_pos, d_y, d_out); "
                         f"got {tuple(a.shape)} and {tuple(B.shape)}")
    if a.shape[:2] != B.shape[:2]:
        raise ValueError(f"a and B must agree on (n, n_pos): {tuple(a.shape[:2])} vs {tuple(B.shape[:2])}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"a and B must hold at least one sample and one position, got (n, n_pos) = {tuple(a.shape[:2])}")
    return B, a


def layer_jacobian(B, a) -> torch.Tensor:
    r"""Per-sample Jacobians of :math:`f` with respect to :math:`\vecop W` of a (possibly shared) layer :math:`z_s=Wa_s`:

    :math:`J_i=\sum_sB_{i,s}\otimes a_{i,s}^\top\in\R^{d_y\times d_{\mathrm{out}}d_{\mathrm{in}}}` (row-major).
    ``B: (n, [n_pos,] d_y, d_out)``, ``a: (n, [n_pos,] d_in)``; returns ``(n, d_y, d_out d_in)``.
    """
    B, a = _check_factors(B, a)
    n, _, d_y, d_out = B.shape
    return torch.einsum("isyo,isj->iyoj", B, a).reshape(n, d_y, d_out * a.shape[-1])


def layer_gn_block(B, a) -> torch.Tensor:
    r"""The layer's exact GN block :math:`\frac1n\sum_iJ_i^\top J_i` (equal to its true-Fisher block, type-2)."""
    J = layer_jacobian(B, a)
    return torch.einsum("iyp,iyq->pq", J, J) / J.shape[0]


def layer_ef_block(B, a, residual) -> torch.Tensor:
    r"""The layer's empirical-Fisher block :math:`\frac1n\sum_i(J_i^\top r_i)(J_i^\top r_i)^\top`, ``residual: (n, d_y)``."""
    J = layer_jacobian(B, a)
    r = check_finite("residual", as_tensor("residual", residual, dtype=J.dtype, device=J.device))
    if r.shape != J.shape[:2]:
        raise ValueError(f"residual must have shape {tuple(J.shape[:2])}, got {tuple(r.shape)}")
    g = torch.einsum("iyp,iy->ip", J, r)
    return g.T @ g / J.shape[0]


def kfac_factors(B, a, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""K-FAC's Kronecker factors :math:`(\Cout,\Cin)` of a layer; the block is approximated by :math:`\Cout\otimes\Cin`.

    :math:`\Cin=\frac1{n\,n_{\mathrm{pos}}}\sum_{i,s}a_{i,s}a_{i,s}^\top` and :math:`\Cout=\frac1n\sum_{i,s}\E[g_{i,s}g_{i,s}^\top]`
    with the output gradients :math:`g_{i,s}=B_{i,s}^\top u_i`: with the *true-Fisher (type-2)* statistics
    (``residual=None``) :math:`u_i\sim\Normal(0,I)`, so :math:`\E[gg^\top]=B^\top B` exactly; with the *empirical*
    statistics, :math:`u_i=r_i` the observed residuals. For weight sharing (``n_pos > 1`` positions)
    this is the "expand" convention: positions count as extra samples (Martens & Grosse 2015 for ``n_pos = 1``).
    """
    B, a = _check_factors(B, a)
    n, n_pos = a.shape[:2]
    C_in = torch.einsum("isj,isk->jk", a, a) / (n * n_pos)
    if residual is None:
        C_out = torch.einsum("isyo,isyq->oq", B, B) / n
    else:
        r = check_finite("residual", as_tensor("residual", residual, dtype=B.dtype, device=B.device))
        if r.shape != (n, B.shape[2]):
            raise ValueError(f"residual must have shape ({n}, {B.shape[2]}), got {tuple(r.shape)}")
        g = torch.einsum("isyo,iy->iso", B, r)
        C_out = torch.einsum("iso,isq->oq", g, g) / n
    return C_out, C_in


def conv1d_patches(x, kernel: int, stride: int = 1) -> torch.Tensor:
    r"""The patches a 1-D convolution with kernel size ``kernel`` sees: ``x: (n, length) -> (n, n_pos, kernel)``.

    A convolution :math:`z_s=Wa_s` applies one weight matrix :math:`W` to every patch :math:`a_s`: weight sharing.
    """
    x = check_matrix("x", x)
    kernel = check_int("kernel", kernel, min_value=1)
    stride = check_int("stride", stride, min_value=1)
    if kernel > x.shape[1]:
        raise ValueError(f"kernel must be <= the signal length {x.shape[1]}, got {kernel}")
    return x.unfold(1, kernel, stride)


def relative_error(approx, exact) -> float:
    r""":math:`\lVert\mathrm{approx}-\mathrm{exact}\rVert_F/\lVert\mathrm{exact}\rVert_F`."""
    A = check_finite("approx", as_tensor("approx", approx))
    E = check_finite("exact", as_tensor("exact", exact, dtype=A.dtype, device=A.device))
    if A.shape != E.shape:
        raise ValueError(f"approx and exact must have the same shape, got {tuple(A.shape)} and {tuple(E.shape)}")
    scale = float(E.norm())
    if scale == 0:
        raise ValueError("exact must not be zero")
    return float((A - E).norm()) / scale


# ============================================================================================ figures
def loss_contours(ax, problem: LeastSquares, xlim, ylim, levels: int = 14, n_grid: int = 160, log: bool = True):
    r"""Contours of :math:`\Loss` over a 2-D box, geometrically spaced between the minimum and maximum on the grid
    when ``log`` (for losses that span decades), evenly spaced otherwise. Returns the contour set."""
    problem = _check_problem(problem)
    levels, n_grid = check_int("levels", levels, min_value=2), check_int("n_grid", n_grid, min_value=2)
    if not callable(getattr(ax, "contour", None)):
        raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}")
    (x0, x1), (y0, y1) = _check_box("xlim", xlim), _check_box("ylim", ylim)
    gx = torch.linspace(float(x0), float(x1), n_grid, dtype=torch.float64)
    gy = torch.linspace(float(y0), float(y1), n_grid, dtype=torch.float64)
    TX, TY = torch.meshgrid(gx, gy, indexing="xy")
    Z = problem.loss(torch.stack([TX, TY], dim=-1))
    lo, hi = float(Z.min()), float(Z.max())
    if log:
        lo = max(lo, hi * 1e-6, 1e-300)
        lv = torch.logspace(math.log10(lo), math.log10(hi), levels).tolist()
    else:
        lv = torch.linspace(lo, hi, levels).tolist()
    return ax.contour(TX.numpy(), TY.numpy(), Z.numpy(), levels=lv, colors="0.65", linewidths=0.8)


def _check_box(name: str, lim) -> tuple[float, float]:
    """A pair ``(low, high)`` of finite numbers with ``low < high``."""
    if isinstance(lim, (str, bytes)) or not hasattr(lim, "__len__") or len(lim) != 2:
        raise TypeError(f"{name} must be a pair (low, high) of numbers, got {lim!r}")
    lo, hi = _check_number(name, lim[0]), _check_number(name, lim[1])
    if not lo < hi:
        raise ValueError(f"{name} must satisfy low < high, got {tuple(lim)}")
    return lo, hi


def plot_paths(ax, problem: LeastSquares, paths: dict, xlim, ylim, *, levels: int = 14, log: bool = True,
               labels: dict | None = None, markevery: int = 1, **kw) -> None:
    r"""Loss contours (:func:`loss_contours`) with optimiser paths on top and a star at ``problem.theta_star``.

    ``paths`` maps a registered method name (``"GD"``, ``"GN"``, ...) to its iterates ``(T + 1, 2)``; each is drawn
    in its registered style by :func:`curvlab.plotting.plot`, labelled by ``labels[method]`` when given.
    """
    from . import plotting

    if not isinstance(paths, dict):
        raise TypeError(f"paths must be a dict {{method: iterates (T + 1, 2)}}, got {type(paths).__name__}")
    if labels is not None and not isinstance(labels, dict):
        raise TypeError(f"labels must be a dict {{method: label}} or None, got {type(labels).__name__}")
    markevery = check_int("markevery", markevery, min_value=1)
    loss_contours(ax, problem, xlim, ylim, levels=levels, log=log)
    for method, path in paths.items():
        path = check_matrix(f"paths[{method!r}]", path)
        if path.shape[-1] != 2:
            raise ValueError(f"paths[{method!r}] must be iterates of shape (T + 1, 2), got {tuple(path.shape)}")
        extra = {"label": labels[method]} if labels and method in labels else {}
        plotting.plot(ax, path[:, 0], path[:, 1], method, markevery=markevery, **extra, **kw)
    if problem.theta_star is not None:
        ax.plot(*problem.theta_star.tolist(), "k*", ms=12, zorder=5)
    ax.set(xlim=xlim, ylim=ylim, xlabel="θ₁", ylabel="θ₂")
