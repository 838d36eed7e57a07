r"""Small shared linear-algebra tools: symmetric spectra, PSD roots, vectorisation, Kronecker products, subspaces.

**Vectorisation convention (the one place it is stated for the whole library).** ``curvlab`` vectorises
row-major, as torch's ``reshape`` does: :func:`vec` stacks the *rows* of a matrix. With that convention

.. math::

    \operatorname{vec}(A X B) = (A \otimes B^\top)\, \operatorname{vec}(X),

whereas the column-major convention of most papers gives
:math:`\operatorname{vec}(AXB) = (B^\top \otimes A)\operatorname{vec}(X)`. Every Kronecker product in
``curvlab`` (Jacobians, Gauss-Newton blocks, K-FAC factors) is written in the row-major order above; when a
paper writes :math:`B^\top \otimes A`, the library writes :math:`A \otimes B^\top`.

Spectral work runs in float64 on :func:`curvlab.config.spectral_device` (the CPU when tensors live on MPS).
Functions accept a leading batch dimension ``(..., m, n)`` wherever that is natural (a sweep over seeds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import config
from ._validate import as_tensor, check_choice, check_finite, check_int, check_matrix, check_nonnegative

__all__ = [
    "default_rtol",
    "sym_eigh",
    "psd_sqrt",
    "psd_inv_sqrt",
    "vec",
    "unvec",
    "kron",
    "principal_angles",
    "sin_theta_distance",
    "random_orthogonal",
    "covariance",
    "LanczosResult",
    "lanczos_extremes",
    "lanczos_extremes_operator",
]


def default_rtol(size: int, dtype: torch.dtype = torch.float64) -> float:
    r"""Default relative threshold for a numerical rank: :math:`\mathrm{rtol} = n\,\varepsilon_{\mathrm{dtype}}`.

    Here :math:`n` = ``size``. This is the convention of ``numpy.linalg.matrix_rank``: an eigenvalue (or singular
    value) counts as zero when it is at most ``rtol`` times the largest one. ``dtype`` is the precision the matrix
    was *computed* in (a float32 Gram matrix promoted to float64 still carries float32 noise).
    """
    size = check_int("size", size, min_value=1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return size * torch.finfo(dtype).eps


def _check_float_dtype(name: str, dtype) -> torch.dtype:
    """A floating torch dtype (random draws and factorisations need one)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype (torch.float32 or torch.float64), got {dtype!r}")
    return dtype


def _check_symmetric(name: str, A: torch.Tensor) -> torch.Tensor:
    """Raise if ``A`` is not symmetric to ``100 n eps`` of its dtype, relative to its largest entry."""
    tol = 100 * A.shape[-1] * torch.finfo(A.dtype).eps
    scale = A.abs().amax(dim=(-2, -1)).clamp_min(torch.finfo(A.dtype).tiny)
    asym = (A - A.transpose(-2, -1)).abs().amax(dim=(-2, -1))
    if bool((asym > tol * scale).any()):
        raise ValueError(f"{name} must be symmetric; max |{name} - {name}^T| = {float(asym.max()):.3g}")
    return A


def sym_eigh(A) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Eigendecomposition :math:`A = Q \operatorname{diag}(\lambda) Q^\top` of a symmetric matrix, in float64.

    Returns ``(eigenvalues, Q)`` with eigenvalues ascending, shapes ``(..., n)`` and ``(..., n, n)``, on
    :func:`curvlab.config.spectral_device` (via :func:`curvlab.config.spectral`). ``A`` may be batched
    ``(..., n, n)``; it is symmetrised as :math:`\tfrac12(A + A^\top)` after a symmetry check.
    """
    return _eigh("A", A)


def _eigh(name: str, A) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sym_eigh` with error messages naming the caller's argument ``name``."""
    A = _check_symmetric(name, check_matrix(name, A, square=True, batch=True))
    A64 = config.spectral(A)
    return torch.linalg.eigh(0.5 * (A64 + A64.transpose(-2, -1)))


def _psd_eigh(name: str, A) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, eigenvalues, Q)`` of a PSD matrix; eigenvalues within the float noise of zero are clamped to zero."""
    A = check_matrix(name, A, square=True, batch=True)
    lam, Q = _eigh(name, A)
    noise = 100 * A.shape[-1] * torch.finfo(A.dtype).eps * lam.abs().amax(dim=-1, keepdim=True)
    if bool((lam < -noise).any()):
        raise ValueError(f"{name} must be positive semi-definite; its smallest eigenvalue is {float(lam.min()):.3g}")
    return A, lam.clamp_min(0.0), Q


def psd_sqrt(A) -> torch.Tensor:
    r"""Symmetric square root :math:`A^{1/2} = Q \operatorname{diag}(\sqrt{\lambda}) Q^\top` of a PSD matrix.

    Computed in float64 through :func:`sym_eigh`, returned in ``A``'s dtype and device. Batched ``(..., n, n)``.
    """
    return _psd_sqrt("A", A)


def _psd_sqrt(name: str, A) -> torch.Tensor:
    """:func:`psd_sqrt` with error messages naming the caller's argument ``name`` (e.g. ``"Sigma_hat"``)."""
    A, lam, Q = _psd_eigh(name, A)
    root = (Q * lam.sqrt().unsqueeze(-2)) @ Q.transpose(-2, -1)
    return root.to(dtype=A.dtype, device=A.device)


def psd_inv_sqrt(A, rtol: float | None = None) -> torch.Tensor:
    r"""Pseudo-inverse square root of a PSD matrix,

    .. math::

        (A^{+})^{1/2} = Q \operatorname{diag}\big(\lambda_i^{-1/2}\,[\lambda_i > \mathrm{rtol}\,\lambda_{\max}]\big)
        Q^\top.

    Eigenvalues at or below ``rtol * lambda_max`` are treated as zero (their directions are dropped, not
    blown up), so the result is finite for singular ``A`` (whitening with a rank-deficient covariance).
    ``rtol`` defaults to :func:`default_rtol` ``(n, A.dtype)``. Computed in float64, returned in ``A``'s dtype.
    """
    A, lam, Q = _psd_eigh("A", A)
    rtol = default_rtol(A.shape[-1], A.dtype) if rtol is None else check_nonnegative("rtol", rtol)
    if rtol >= 1:
        raise ValueError(f"rtol must be < 1, got {rtol}")
    keep = lam > rtol * lam.amax(dim=-1, keepdim=True)
    inv = torch.where(keep, lam.clamp_min(torch.finfo(lam.dtype).tiny).rsqrt(), torch.zeros_like(lam))
    return ((Q * inv.unsqueeze(-2)) @ Q.transpose(-2, -1)).to(dtype=A.dtype, device=A.device)


def vec(M) -> torch.Tensor:
    r"""Row-major vectorisation :math:`\operatorname{vec}(M)_{i n + j} = M_{ij}`: ``(..., m, n) -> (..., m n)``.

    See the module docstring for the Kronecker identity this convention implies.
    """
    M = check_finite("M", as_tensor("M", M))
    if M.dim() < 2:
        raise ValueError(f"M must have at least 2 dimensions (..., m, n), got shape {tuple(M.shape)}")
    return M.reshape(*M.shape[:-2], M.shape[-2] * M.shape[-1])


def unvec(v, shape) -> torch.Tensor:
    r"""Inverse of :func:`vec`: ``(..., m n) -> (..., m, n)`` for ``shape = (m, n)``, row-major."""
    v = check_finite("v", as_tensor("v", v))
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2:
        raise TypeError(f"shape must be a pair (m, n), got {shape!r}")
    m, n = (check_int("shape", s, min_value=1) for s in shape)
    if v.dim() < 1 or v.shape[-1] != m * n:
        raise ValueError(f"v must have last dimension m*n = {m * n} for shape {(m, n)}, got shape {tuple(v.shape)}")
    return v.reshape(*v.shape[:-1], m, n)


def kron(A, B) -> torch.Tensor:
    r"""Kronecker product :math:`(A \otimes B)_{(i p + k),(j q + l)} = A_{ij} B_{kl}`, batched over leading dims.

    ``A: (..., m, n)``, ``B: (..., p, q)`` give ``(..., m p, n q)``; equal to :func:`torch.kron` for matrices.
    In row-major order, :math:`\operatorname{vec}(A X B) = (A \otimes B^\top)\operatorname{vec}(X)`.
    """
    A = check_matrix("A", A, batch=True)
    B = check_matrix("B", B, batch=True)
    try:
        batch = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    except RuntimeError:
        raise ValueError(f"A and B batch dimensions do not broadcast: {tuple(A.shape)} vs {tuple(B.shape)}") from None
    (m, n), (p, q) = A.shape[-2:], B.shape[-2:]
    out = A[..., :, None, :, None] * B[..., None, :, None, :]
    return out.reshape(*batch, m * p, n * q)


def _row_basis(name: str, A: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis ``(..., d, k)`` of the row space of a full-row-rank ``A: (..., k, d)``, in float64."""
    k, d = A.shape[-2:]
    if k > d:
        raise ValueError(f"{name} must have at most as many rows as columns (k <= d), got shape {tuple(A.shape)}")
    U, S, _ = torch.linalg.svd(config.spectral(A).transpose(-2, -1), full_matrices=False)
    if bool((S[..., -1] <= default_rtol(max(k, d), A.dtype) * S[..., 0]).any()):
        smallest = float(S[..., -1].min())
        raise ValueError(f"{name} must have full row rank {k}; its smallest singular value is {smallest:.3g}")
    return U


def principal_angles(A, B) -> torch.Tensor:
    r"""Principal angles :math:`0 \le \psi_1 \le \dots \le \psi_r \le \pi/2` between the ROW spaces of A and B.

    Rows are the convention of the book (a layer :math:`G \in \mathbb{R}^{k \times d}` learns the subspace
    :math:`\operatorname{row}(G)`). With orthonormal bases :math:`Q_A, Q_B` of the row spaces,
    :math:`\cos\psi_i = \sigma_i(Q_A^\top Q_B)` and :math:`\sin\psi_i = \sigma_{r+1-i}((I - Q_A Q_A^\top) Q_B)`;
    the angle is :math:`\operatorname{atan2}(\sin, \cos)`, accurate for small and large angles alike.
    ``A: (..., k_A, d)``, ``B: (..., k_B, d)`` of full row rank; returns float64 ``(..., min(k_A, k_B))``.
    """
    A = check_matrix("A", A, batch=True)
    B = check_matrix("B", B, batch=True)
    if A.shape[-1] != B.shape[-1]:
        raise ValueError(f"A and B must have the same number of columns, got {tuple(A.shape)} and {tuple(B.shape)}")
    try:
        torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    except RuntimeError:
        raise ValueError(f"A and B batch dimensions do not broadcast: {tuple(A.shape)} vs {tuple(B.shape)}") from None
    QA, QB = _row_basis("A", A), _row_basis("B", B.to(A.device))
    if QA.shape[-1] < QB.shape[-1]:
        QA, QB = QB, QA  # angles are symmetric; project the smaller basis
    cos = torch.linalg.svdvals(QA.transpose(-2, -1) @ QB).clamp(0.0, 1.0)
    sin = torch.linalg.svdvals(QB - QA @ (QA.transpose(-2, -1) @ QB)).clamp(0.0, 1.0).flip(-1)
    return torch.atan2(sin, cos)


def sin_theta_distance(A, B, norm: str = "spectral") -> torch.Tensor:
    r"""Sin-theta distance between row spaces: :math:`\|(I - Q_B Q_B^\top) Q_A\|`, i.e. :math:`\|\sin\Psi\|`.

    ``norm="spectral"`` (default) gives :math:`\sin\psi_{\max}`, the book's subspace distance
    :math:`\operatorname{dist}(G, G_\star)` (chapter on linear representation learning); ``norm="fro"`` gives
    :math:`(\sum_i \sin^2\psi_i)^{1/2}`. Batched like :func:`principal_angles`; float64.
    """
    norm = check_choice("norm", norm, ("spectral", "fro"))
    s = torch.sin(principal_angles(A, B))
    return s.amax(dim=-1) if norm == "spectral" else s.square().sum(dim=-1).sqrt()


def random_orthogonal(d: int, *, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    r"""A Haar-distributed orthogonal :math:`d \times d` matrix (QR of a Gaussian matrix with the sign fix)."""
    d = check_int("d", d, min_value=1)
    _check_float_dtype("dtype", dtype)
    A = torch.randn(d, d, generator=generator, dtype=dtype)
    Q, R = torch.linalg.qr(A)
    return Q * torch.sign(torch.diagonal(R)).unsqueeze(0)


def covariance(eigenvalues, basis: str = "random", *, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A covariance :math:`\Sigma = U \operatorname{diag}(s) U^\top` with a chosen spectrum, and its square root.

    ``eigenvalues`` (``s``, positive) fix the spectrum, e.g. ``torch.logspace(0, 2, d)`` for
    :math:`\kappa(\Sigma) = 100`; ``basis='random'`` draws :math:`U` Haar-uniformly (anisotropy not aligned with any
    coordinate), ``basis='aligned'`` takes :math:`U = I` (a diagonal :math:`\Sigma`). Returns
    ``(Sigma, Sigma_half)`` in float64, with ``Sigma_half`` the symmetric square root, so that
    ``x = Sigma_half @ g`` with ``g ~ N(0, I)`` has covariance ``Sigma``.
    """
    s = check_finite("eigenvalues", as_tensor("eigenvalues", eigenvalues, dtype=torch.float64))
    if s.dim() != 1 or s.numel() == 0:
        raise ValueError(f"eigenvalues must be a non-empty vector, got shape {tuple(s.shape)}")
    if bool((s <= 0).any()):
        raise ValueError(f"eigenvalues must be > 0 (a covariance), got min {float(s.min()):.3g}")
    check_choice("basis", basis, ("random", "aligned"))
    U = random_orthogonal(s.numel(), generator=generator) if basis == "random" else torch.eye(s.numel(), dtype=torch.float64)
    return (U * s) @ U.T, (U * s.sqrt()) @ U.T


class LanczosResult(NamedTuple):
    r"""Extreme Ritz values of a batch of symmetric matrices from :func:`lanczos_extremes`.

    ``lambda_max``/``lambda_min`` are the largest/smallest Ritz values, ``residual_max``/``residual_min`` their
    residual norms :math:`\beta_k|s_{k,i}|` (an eigenvalue of the matrix lies within that distance of each Ritz
    value), ``iterations`` the Krylov dimension used and ``converged`` whether both residuals met the tolerance."""

    lambda_max: torch.Tensor
    lambda_min: torch.Tensor
    residual_max: torch.Tensor
    residual_min: torch.Tensor
    iterations: int
    converged: bool


def lanczos_extremes(A, *, rtol: float = 1e-10, max_iter: int | None = None, check_every: int = 4,
                     generator: torch.Generator | None = None) -> LanczosResult:
    r"""Largest and smallest eigenvalues of symmetric ``A`` (``(..., N, N)``, batched) by Lanczos with full
    reorthogonalisation, without the :math:`O(N^3)` tridiagonal reduction of ``eigvalsh``.

    Stops when both extreme Ritz values :math:`\theta` have residual :math:`\beta_k|s_{k,i}|\le`
    ``rtol`` :math:`\cdot|\theta|` in every batch member (then :math:`|\theta-\lambda|\le` ``rtol``
    :math:`|\theta|` for *some* eigenvalue :math:`\lambda`; with a random start vector it is the extreme one
    with probability one), when the Krylov space is exhausted (:math:`\beta_k = 0`: the Ritz values are exact),
    or after ``max_iter`` steps (default :math:`N`), reporting ``converged=False``. Cost per step: one
    matrix–vector product and :math:`O(Nk)` for reorthogonalisation. Float64 on the spectral device.
    :func:`lanczos_extremes_operator` is the same for an operator given by its matrix–vector product.
    """
    A = config.spectral(check_finite("A", check_matrix("A", A, batch=True)))
    N = A.shape[-1]
    if A.shape[-2] != N:
        raise ValueError(f"A must be square, got shape {tuple(A.shape)}")
    _check_symmetric("A", A)
    scale = A.abs().amax(dim=(-2, -1))
    return _lanczos(lambda q: A @ q, A.shape[:-2], N, A, scale, rtol, max_iter, check_every, generator)


def lanczos_extremes_operator(matvec, size: int, like: torch.Tensor, *, batch=(), scale=None, rtol: float = 1e-10,
                              max_iter: int | None = None, check_every: int = 4,
                              generator: torch.Generator | None = None) -> LanczosResult:
    r""":func:`lanczos_extremes` for a symmetric operator known only through ``matvec`` (which maps
    ``(*batch, size, 1)`` to the same shape); ``like`` gives dtype and device, ``scale`` (default 1) a magnitude
    of the operator used to detect an exhausted Krylov space. Used for Kronecker sums that are never formed."""
    size = check_int("size", size, min_value=1)
    if not callable(matvec):
        raise TypeError("matvec must be callable")
    if not isinstance(like, torch.Tensor) or not like.dtype.is_floating_point:
        raise TypeError("like must be a floating tensor")
    batch = tuple(batch)
    scale = torch.ones(batch, dtype=like.dtype, device=like.device) if scale is None else scale
    return _lanczos(matvec, batch, size, like, scale, rtol, max_iter, check_every, generator)


def _lanczos(matvec, batch, N, like, scale, rtol, max_iter, check_every, generator) -> LanczosResult:
    if not isinstance(rtol, (int, float)) or not 0 < rtol < 1:
        raise ValueError(f"rtol must be a number in (0, 1), got {rtol!r}")
    max_iter = N if max_iter is None else min(check_int("max_iter", max_iter, min_value=1), N)
    check_every = check_int("check_every", check_every, min_value=1)
    dt, dev = like.dtype, like.device
    gen = generator if generator is not None else torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(*batch, N, 1, generator=gen, dtype=dt, device=dev)
    q = q / torch.linalg.vector_norm(q, dim=-2, keepdim=True)
    Q = torch.empty(*batch, N, max_iter, dtype=dt, device=dev)
    alpha = torch.empty(*batch, max_iter, dtype=dt, device=dev)
    beta = torch.zeros(*batch, max_iter, dtype=dt, device=dev)
    floor = torch.finfo(dt).eps * scale
    k, theta, s_last = 0, None, None
    for k in range(1, max_iter + 1):
        j = k - 1
        Q[..., j : j + 1] = q
        w = matvec(q)
        alpha[..., j] = (q * w).sum(dim=(-2, -1))
        Qk = Q[..., :k]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            w = w - Qk @ (Qk.transpose(-2, -1) @ w)
        b = torch.linalg.vector_norm(w, dim=(-2, -1))
        beta[..., j] = b
        exhausted = bool((b <= floor).all())
        if k % check_every == 0 or k == max_iter or exhausted:
            T = torch.diag_embed(alpha[..., :k]) + torch.diag_embed(beta[..., : k - 1], 1) \
                + torch.diag_embed(beta[..., : k - 1], -1)
            theta, S = torch.linalg.eigh(T)
            s_last = S[..., -1, :].abs() * b.unsqueeze(-1)
            res_min, res_max = s_last[..., 0], s_last[..., -1]
            ok = (res_min <= rtol * theta[..., 0].abs()) & (res_max <= rtol * theta[..., -1].abs())
            if exhausted or bool(ok.all()):
                return LanczosResult(theta[..., -1], theta[..., 0], res_max, res_min, k, True)
        q = w / torch.maximum(b, floor).unsqueeze(-1).unsqueeze(-1)
    return LanczosResult(theta[..., -1], theta[..., 0], s_last[..., -1], s_last[..., 0], k, False)
