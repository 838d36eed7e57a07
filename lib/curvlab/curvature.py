r"""Gauss-Newton machinery for any model written as a function of a flat parameter vector (via ``torch.func``).

**Model convention.** A model is a function ``fn(theta: Tensor[p]) -> Tensor[n]`` of a flat parameter vector,
returning the ``n`` outputs (or residuals) whose squared loss defines the Gauss-Newton matrix. A ``torch.nn``
module is turned into one with :func:`flatten_params` and :func:`torch.func.functional_call`.
Flattening, like every vectorisation in ``curvlab``, is row-major (see :mod:`curvlab.linalg` for the
Kronecker-order convention this implies).

With the Jacobian :math:`J = \partial f / \partial \theta \in \mathbb{R}^{n \times p}`:

.. math::

    H_{\mathrm{GN}} = c\, J^\top J \in \mathbb{R}^{p \times p}
    \qquad\text{(Gauss-Newton matrix, } c = \texttt{scale}\text{; the book's } H_{\mathrm{GN}} \text{ has } c = 1/n\text{)},

    K = c\, J J^\top \in \mathbb{R}^{n \times n}
    \qquad\text{(kernel / empirical NTK; same nonzero spectrum as } H_{\mathrm{GN}}\text{)},

    H_{\mathrm{GN}} v = c\, J^\top (J v)
    \qquad\text{(one JVP and one VJP, } J \text{ never formed)}.

The damped Gauss-Newton direction has two equal forms (push-through / Woodbury identity):

.. math::

    \Delta_{\mathrm{GN}} = (J^\top J + \lambda_{\mathrm{GN}} I_p)^{-1} J^\top r
    = J^\top (J J^\top + \lambda_{\mathrm{GN}} I_n)^{-1} r,

(the damping :math:`\lambda_{\mathrm{GN}}` is the ``eps`` argument, in the units of the eigenvalues of
:math:`K = JJ^\top`; see the notation page), a :math:`p \times p` solve (:func:`damped_gn_step`) or an :math:`n \times n` solve (:func:`kernel_gn_step`,
:func:`kernel_gn_step_fn`), cheap when :math:`p \gg n` (Arbel, Menegaux & Wolinski 2023, eq. (4)).

:func:`condition_number` reports :math:`\kappa = \lambda_{\max} / \lambda_r` at a numerical (or forced,
theoretical) rank :math:`r` together with the spectral gap :math:`\lambda_r / \lambda_{r+1}` at the cut
(Zhao, Singh & Lucchi 2024). Spectra are computed in float64 via :func:`curvlab.config.spectral`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.func import jacfwd, jacrev, jvp, vjp, vmap

from . import config
from ._validate import as_tensor, check_finite, check_int, check_matrix, check_nonnegative, check_positive
from .linalg import _eigh, default_rtol

__all__ = [
    "flatten_params",
    "jacobian",
    "gn_matrix",
    "kernel_matrix",
    "gn_vector_product",
    "ConditionNumber",
    "condition_number",
    "damped_gn_step",
    "kernel_gn_step",
    "kernel_gn_step_fn",
]

Model = Callable[[torch.Tensor], torch.Tensor]


def _load_jvp_decompositions_quietly() -> None:
    """Forward-mode AD lazily imports torch's JVP decompositions, which call the deprecated ``torch.jit.script``
    (a DeprecationWarning from inside torch 2.13, a FutureWarning from 2.14 on; not from user code). Import them once
    here, with exactly that warning ignored, so notebooks and tests that use :func:`torch.func.jvp` stay warning-free."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=category)
        try:
            from torch._decomp import decompositions_for_jvp  # noqa: F401
        except ImportError:  # pragma: no cover - layout of a future torch
            pass


_load_jvp_decompositions_quietly()


# ----------------------------------------------------------------------------------------------- validation
def _check_theta(theta) -> torch.Tensor:
    theta = check_finite("theta", as_tensor("theta", theta))
    if theta.dim() != 1 or theta.numel() == 0:
        raise ValueError(f"theta must be a non-empty flat parameter vector of shape (p,), got {tuple(theta.shape)}")
    return theta


def _check_model(fn, theta) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``fn`` and ``theta``; return ``(theta, fn(theta))`` with a finite 1-D output."""
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(theta) -> Tensor[n], got {type(fn).__name__}")
    theta = _check_theta(theta)
    out = fn(theta)
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.numel() == 0:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"fn(theta) must return a non-empty 1-D tensor of outputs (n,), got {shape}")
    if not bool(torch.isfinite(out).all()):
        raise ValueError("fn(theta) returned non-finite values (NaN or inf)")
    return theta, out


def _check_vector(name: str, value, size: int, like: torch.Tensor, *, batch: bool = False) -> torch.Tensor:
    """A finite vector ``(size,)`` (or ``(b, size)`` when ``batch``) in ``like``'s dtype and device."""
    t = check_finite(name, as_tensor(name, value, dtype=like.dtype, device=like.device))
    ok = t.dim() == 1 or (batch and t.dim() == 2)
    if not ok or t.shape[-1] != size or t.numel() == 0:
        want = f"({size},)" + (f" or (b, {size})" if batch else "")
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    return t


# ----------------------------------------------------------------------------------------------- parameters
def flatten_params(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict]]:
    r"""Flatten named parameters: :math:`\theta = [\operatorname{vec}(P_1); \dots; \operatorname{vec}(P_m)]`, row-major.

    Returns ``(theta, unflatten)`` where ``unflatten(theta)`` gives back the dict of shaped views, so that
    ``fn = lambda th: torch.func.functional_call(model, unflatten(th), (X,)).reshape(-1)`` is a model in the
    convention of this module. ``theta`` is detached (a fresh leaf); order follows the dict.
    """
    if not isinstance(params, dict) or not params:
        raise TypeError("params must be a non-empty dict[str, Tensor] (e.g. dict(model.named_parameters())), "
                        f"got {params!r:.60}")
    for key, p in params.items():
        if not isinstance(key, str) or not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"params must map names to floating tensors; entry {key!r} is {type(p).__name__}")
    first = next(iter(params.values()))
    if any(p.dtype != first.dtype or p.device != first.device for p in params.values()):
        raise ValueError("params must all share one dtype and device")
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    theta = check_finite("params", torch.cat([params[k].detach().reshape(-1) for k in names]))

    def unflatten(th: torch.Tensor) -> dict[str, torch.Tensor]:
        if not isinstance(th, torch.Tensor) or th.shape != (sum(sizes),):
            raise ValueError(f"theta must have shape ({sum(sizes)},), got {getattr(th, 'shape', type(th).__name__)}")
        return {k: t.reshape(s) for k, t, s in zip(names, th.split(sizes), shapes)}

    return theta, unflatten


# ----------------------------------------------------------------------------------------------- Jacobian, G, K
def jacobian(fn: Model, theta) -> torch.Tensor:
    r"""Jacobian :math:`J_{ij} = \partial f_i / \partial \theta_j`, shape ``(n, p)``.

    Forward mode (``jacfwd``, ``p`` JVPs) when :math:`p \le n`, reverse mode (``jacrev``, ``n`` VJPs) otherwise.
    """
    theta, out = _check_model(fn, theta)
    return (jacfwd if theta.numel() <= out.numel() else jacrev)(fn)(theta)


def gn_matrix(fn: Model, theta, scale: float = 1.0) -> torch.Tensor:
    r"""Dense Gauss-Newton matrix :math:`H_{\mathrm{GN}} = c\, J^\top J \in \mathbb{R}^{p \times p}` (``c = scale > 0``).

    The dense REFERENCE every structured product is tested against; memory :math:`O(p^2)`.
    """
    scale = check_positive("scale", scale)
    J = jacobian(fn, theta)
    return scale * (J.transpose(0, 1) @ J)


def kernel_matrix(fn: Model, theta, scale: float = 1.0) -> torch.Tensor:
    r"""Kernel (empirical NTK) :math:`K = c\, J J^\top \in \mathbb{R}^{n \times n}`, column by column, no :math:`H_{\mathrm{GN}}`.

    Column :math:`i` is :math:`J (J^\top e_i)`: a VJP then a JVP, vectorised over :math:`i` with ``vmap``.
    Memory :math:`O(n p)` for the batch of VJPs; the :math:`p \times p` matrix never exists.
    """
    scale = check_positive("scale", scale)
    theta, out = _check_model(fn, theta)
    _, pullback = vjp(fn, theta)

    def column(e: torch.Tensor) -> torch.Tensor:
        return jvp(fn, (theta,), pullback(e))[1]

    K = vmap(column)(torch.eye(out.numel(), dtype=out.dtype, device=out.device))
    return scale * 0.5 * (K + K.transpose(0, 1))  # symmetric up to rounding; make it exactly so


def gn_vector_product(fn: Model, theta, v, scale: float = 1.0) -> torch.Tensor:
    r"""Matrix-free :math:`G v = c\, J^\top (J v)`: one JVP (:math:`Jv`) then one VJP, :math:`J` never formed.

    ``v`` has shape ``(p,)`` or a batch ``(b, p)`` (vectorised with ``vmap``); the result has ``v``'s shape.
    """
    scale = check_positive("scale", scale)
    theta, _ = _check_model(fn, theta)
    v = _check_vector("v", v, theta.numel(), theta, batch=True)
    _, pullback = vjp(fn, theta)

    def gv(u: torch.Tensor) -> torch.Tensor:
        return pullback(jvp(fn, (theta,), (u,))[1])[0]

    return scale * (gv(v) if v.dim() == 1 else vmap(gv)(v))


# ----------------------------------------------------------------------------------------------- conditioning
@dataclass(frozen=True)
class ConditionNumber:
    r"""Condition number at rank :math:`r` of a PSD spectrum :math:`\lambda_1 \ge \dots \ge \lambda_n`.

    ``kappa`` :math:`= \lambda_1/\lambda_r`; ``lambda_min_nonzero`` :math:`= \lambda_r`, the smallest KEPT
    eigenvalue; ``lambda_discarded`` :math:`= \lambda_{r+1}` (``None`` when nothing is discarded);
    ``gap`` :math:`= \lambda_r / \lambda_{r+1}` (``inf`` when nothing is discarded or :math:`\lambda_{r+1} \le 0`):
    a large gap means the rank cut is clean, a gap near 1 means ``kappa`` depends on where the cut falls.
    ``numerical_rank`` counts :math:`\lambda_i > \texttt{threshold} = \texttt{rtol}\cdot\lambda_1`; ``rank``
    equals it unless a theoretical rank was forced (``forced=True``).
    """

    kappa: float
    rank: int
    numerical_rank: int
    size: int
    lambda_max: float
    lambda_min_nonzero: float
    lambda_discarded: float | None
    gap: float
    rtol: float
    threshold: float
    forced: bool

    def to_dict(self) -> dict:
        """A flat dict, one row of a tidy frame."""
        return asdict(self)

    def __str__(self) -> str:
        how = "forced" if self.forced else f"numerical, rtol={self.rtol:.2g}"
        return (f"kappa={self.kappa:.4g} at rank {self.rank}/{self.size} ({how}; numerical rank "
                f"{self.numerical_rank}), lambda_max={self.lambda_max:.4g}, gap at cut={self.gap:.3g}")


def _spectrum(name: str, M) -> tuple[torch.Tensor, torch.dtype]:
    """Descending float64 eigenvalues of a symmetric matrix (or of a given eigenvalue vector)."""
    t = as_tensor(name, M)
    if t.dim() == 1:
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty")
        return config.spectral(check_finite(name, t)).sort(descending=True).values, t.dtype
    if t.dim() != 2:
        raise ValueError(f"{name} must be a square matrix (n, n) or a vector of eigenvalues (n,), got {tuple(t.shape)}")
    return _eigh(name, check_matrix(name, t, square=True))[0].flip(-1), t.dtype


def condition_number(M, rtol: float | None = None, *, rank: int | None = None) -> ConditionNumber:
    r"""Condition number :math:`\kappa = \lambda_{\max} / \lambda_r` of a PSD matrix or of its eigenvalues.

    ``M`` is a symmetric PSD matrix ``(n, n)`` (eigenvalues computed in float64) or an eigenvalue vector ``(n,)``.
    The numerical rank :math:`r` counts :math:`\lambda_i > \mathrm{rtol}\,\lambda_{\max}`; ``rtol`` defaults to
    :func:`curvlab.linalg.default_rtol` ``(n, M.dtype)`` :math:`= n\,\varepsilon_{\mathrm{dtype}}` and is
    reported in the result. ``rank=`` forces the theoretical rank (e.g. :math:`q(d+k-q)` for deep linear
    networks); the gap :math:`\lambda_r/\lambda_{r+1}` is reported at whichever cut is used.
    Eigenvalues below :math:`-\mathrm{rtol}\,\lambda_{\max}` mean ``M`` is not PSD: ValueError.
    """
    lam, dtype = _spectrum("M", M)
    n = lam.numel()
    rtol = default_rtol(n, dtype) if rtol is None else check_nonnegative("rtol", rtol)
    if rtol >= 1:
        raise ValueError(f"rtol must be < 1, got {rtol}")
    lam_max = float(lam[0])
    if lam_max <= 0:
        raise ValueError(f"M must have a positive eigenvalue; its largest is {lam_max:.3g}")
    threshold = rtol * lam_max
    if float(lam[-1]) < -threshold:
        raise ValueError(f"M must be positive semi-definite; its smallest eigenvalue is {float(lam[-1]):.3g} "
                         f"< -rtol * lambda_max = {-threshold:.3g}")
    numerical_rank = int((lam > threshold).sum())
    r = numerical_rank if rank is None else check_int("rank", rank, min_value=1)
    if r > n:
        raise ValueError(f"rank must be <= the matrix size {n}, got {r}")
    if float(lam[r - 1]) <= 0:
        raise ValueError(f"rank={r} exceeds the spectrum's support: lambda_{r} = {float(lam[r - 1]):.3g} <= 0")
    lam_r = float(lam[r - 1])
    lam_next = float(lam[r]) if r < n else None
    gap = lam_r / lam_next if lam_next is not None and lam_next > 0 else math.inf
    return ConditionNumber(kappa=lam_max / lam_r, rank=r, numerical_rank=numerical_rank, size=n,
                           lambda_max=lam_max, lambda_min_nonzero=lam_r, lambda_discarded=lam_next, gap=gap,
                           rtol=rtol, threshold=threshold, forced=rank is not None)


# ----------------------------------------------------------------------------------------------- GN steps
def _check_step_args(J, r, eps) -> tuple[torch.Tensor, torch.Tensor, float]:
    J = check_matrix("J", J, batch=True)
    r = check_finite("r", as_tensor("r", r, dtype=J.dtype, device=J.device))
    if r.shape != J.shape[:-1]:
        raise ValueError(f"r must have shape {tuple(J.shape[:-1])} (J's rows), got {tuple(r.shape)}")
    return J, r, check_nonnegative("eps", eps)


def _require_full_rank(J: torch.Tensor, side: int, what: str) -> None:
    """For ``eps = 0``: ``J`` must have full rank ``side`` (relative to ``default_rtol``), else ValueError."""
    s = torch.linalg.svdvals(config.spectral(J))
    rtol = default_rtol(max(J.shape[-2:]), J.dtype)
    if s.shape[-1] < side or bool((s[..., side - 1] <= rtol * s[..., 0]).any()):
        raise ValueError(f"eps=0 needs {what} to be invertible, but J has rank < {side}; use eps > 0")


def _spd_solve(A: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    """Solve :math:`A x = b` for SPD ``A`` by Cholesky; a failed factorisation is a ValueError naming ``eps``."""
    L, info = torch.linalg.cholesky_ex(A)
    if bool((info != 0).any()):
        raise ValueError(f"{name} is numerically singular in {A.dtype}; increase eps or use float64")
    return torch.cholesky_solve(b.unsqueeze(-1), L).squeeze(-1)


def damped_gn_step(J, r, eps: float) -> torch.Tensor:
    r"""Parameter-space damped GN direction :math:`(J^\top J + \lambda_{\mathrm{GN}} I_p)^{-1} J^\top r` (a ``p x p`` solve).

    ``J: (..., n, p)``, ``r: (..., n)``, ``eps >= 0``; ``eps = 0`` only if :math:`J^\top J` is invertible
    (:math:`p \le n`, full column rank). Cost :math:`O(n p^2 + p^3)`. Returns ``(..., p)``.
    """
    J, r, eps = _check_step_args(J, r, eps)
    if eps == 0:
        _require_full_rank(J, J.shape[-1], "J^T J (p x p)")
    Jt = J.transpose(-2, -1)
    A = Jt @ J + eps * torch.eye(J.shape[-1], dtype=J.dtype, device=J.device)
    return _spd_solve(A, (Jt @ r.unsqueeze(-1)).squeeze(-1), "J^T J + eps I (with this eps)")


def kernel_gn_step(J, r, eps: float) -> torch.Tensor:
    r"""Kernel-form damped GN direction :math:`J^\top (J J^\top + \lambda_{\mathrm{GN}} I_n)^{-1} r` (an ``n x n`` solve).

    Equal to :func:`damped_gn_step` by the push-through identity
    :math:`(J^\top J + \lambda_{\mathrm{GN}} I)^{-1} J^\top = J^\top (J J^\top + \lambda_{\mathrm{GN}} I)^{-1}`; cost
    :math:`O(n^2 p + n^3)`, cheap when :math:`p \gg n`. ``eps = 0`` only if :math:`J J^\top` is invertible.
    """
    J, r, eps = _check_step_args(J, r, eps)
    if eps == 0:
        _require_full_rank(J, J.shape[-2], "J J^T (n x n)")
    K = J @ J.transpose(-2, -1) + eps * torch.eye(J.shape[-2], dtype=J.dtype, device=J.device)
    z = _spd_solve(K, r, "J J^T + eps I (with this eps)")
    return (J.transpose(-2, -1) @ z.unsqueeze(-1)).squeeze(-1)


def kernel_gn_step_fn(fn: Model, theta, r, eps: float) -> torch.Tensor:
    r"""Matrix-free kernel GN direction :math:`J^\top (K + \lambda_{\mathrm{GN}} I_n)^{-1} r`, with :math:`K = J J^\top`.

    Forms only the ``n x n`` kernel (VJPs then JVPs under ``vmap``) and applies :math:`J^\top` by one VJP:
    neither :math:`J` as a matrix nor the ``p x p`` matrix is formed. ``eps = 0`` only if :math:`K` is invertible.
    """
    theta, out = _check_model(fn, theta)
    r = _check_vector("r", r, out.numel(), out)
    eps = check_nonnegative("eps", eps)
    K = kernel_matrix(fn, theta)
    if eps == 0:
        lam = _eigh("K", K)[0]
        if float(lam[0]) <= default_rtol(K.shape[-1], K.dtype) * float(lam[-1]):
            raise ValueError(f"eps=0 needs K = J J^T to be invertible, but lambda_min(K) = {float(lam[0]):.3g}; "
                             "use eps > 0")
    z = _spd_solve(K + eps * torch.eye(K.shape[-1], dtype=K.dtype, device=K.device), r, "K + eps I (with this eps)")
    return vjp(fn, theta)[1](z)[0]
