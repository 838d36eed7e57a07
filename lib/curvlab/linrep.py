r"""Linear representation learning: data, layer-wise updates, metrics and rates (Part I, chapters 10 and 11).

API used by ``curvlab.linrep_baselines`` and ``40_synthesis``; keep stable.

**Model** (notebook ``10_linrep_derivations``). Inputs :math:`x\in\mathbb{R}^d` with second moment
:math:`\Sigma`, targets :math:`y = F_\star G_\star x + \varepsilon`, :math:`G_\star\in\mathbb{R}^{k\times d}` with
orthonormal rows, :math:`F_\star\in\mathbb{R}^{d_y\times k}` of full column rank,
:math:`\varepsilon\sim\mathcal{N}(0,\sigma_\varepsilon^2 I_{d_y})`. The network is :math:`f(x) = FGx` and the loss on a
batch is :math:`\mathcal{L}(F,G) = \frac1{2n}\lVert Y - XG^\top F^\top\rVert_F^2` (rows of ``X``, ``Y`` are samples).
A *transfer task* shares :math:`G_\star` but has its own head :math:`F_{\star,T}` and covariance :math:`\Sigma_T`.

**Shapes.** Everything is batched over ``S`` seeds: ``Fstar (S, d_y, k)``, ``Gstar (S, k, d)``,
``Sigma (S, d, d)``, ``X (S, n, d)``, ``Y (S, n, d_y)``, ``F (S, d_y, k)``, ``G (S, k, d)``. Vectorisation is
row-major (the book's convention), so the Gauss–Newton block of :math:`G` is :math:`F^\top F\otimes\hat\Sigma`.

**Batches.** An update reads its data through :func:`batch_moments`: a batch is a dict with ``'X'``, ``'Y'`` (and
``'X2'``, ``'Y2'``, an independent batch, for ``f_variant='refit_independent'``), or — the *population* batch of
:meth:`LinRepProblem.population_batch` — the moments ``'Sxx'`` :math:`=\Sigma` and ``'Syx'``
:math:`=F_\star G_\star\Sigma`. Every update of this module needs only these moments
(:math:`\hat\Sigma = X^\top X/n`, :math:`\hat\Sigma_{yx} = Y^\top X/n`), so :func:`run` hands them the
moments of each fresh batch (:meth:`LinRepProblem.sample_moments`, ``'Sxx2'``, ``'Syx2'`` for the independent one)
without forming ``X`` and ``Y``; an update registered from outside must read its batch through
:func:`batch_moments` too.

**Update protocol.** ``fn(problem, state, batch, hp) -> LinRepState``; registered in :data:`UPDATES` with
:func:`register_update`. ``hp`` keys: ``eta_G`` (required; a number or per-seed ``(S,)`` tensor), ``eta_F`` (gradient head; default ``eta_G``),
``lam_F``, ``lam_G`` (K-FAC/DFW dampings, default 0), ``lam_head`` (ridge of the least-squares head, default 0),
``f_variant`` in ``F_VARIANTS`` (default per method, ``DEFAULT_F_VARIANT``), ``normalize_step`` (AMGD/SGD/
DFW: the step is :math:`\eta_G/(\lVert F\rVert_2^2\lambda_{\max}(\hat\Sigma))`), ``orthonormalize`` (re-orthonormalise
the rows of :math:`G` after each step; does not change any row space K-FAC visits).

The head variants (which :math:`F` the :math:`G`-step uses):

* ``'refit_same'`` — :math:`F_t = \arg\min_F\mathcal{L}(F, G_t)` on the *same* batch as the :math:`G`-step;
* ``'refit_independent'`` — the least-squares head on an independent batch (``X2``, ``Y2``), DFW's "de-bias";
* ``'fixed'`` — :math:`F_t = F_0` (the authors' stylised remark);
* ``'gradient'`` — :math:`F` takes its own gradient step :math:`F - \eta_F\nabla_F\mathcal{L}`, simultaneously with
  :math:`G`.

After a step the state holds ``F`` = the head the :math:`G`-step used (``F_t``; for ``'gradient'``, ``F_{t+1}``)
and ``G`` = :math:`G_{t+1}`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import config, linalg
from ._validate import (
    as_tensor,
    check_choice,
    check_matrix,
    check_finite,
    check_int,
    check_nonnegative,
    check_positive,
    check_psd,
)

__all__ = [
    "LinRepProblem",
    "linrep_problem",
    "LinRepState",
    "init_state",
    "F_VARIANTS",
    "DEFAULT_F_VARIANT",
    "UPDATES",
    "register_update",
    "batch_moments",
    "fit_head",
    "head_from_moments",
    "grad_G",
    "grad_F",
    "loss",
    "train_loss",
    "sgd_update",
    "amgd_update",
    "kfac_update",
    "dfw_update",
    "run",
    "run_looped",
    "subspace_distance",
    "perp_projector",
    "representation_loss",
    "transfer_loss",
    "excess_risk",
    "schur_complement",
    "schur_curvature",
    "linearised_rate",
    "optimal_step",
    "perp_jacobian",
    "noise_floor",
    "fitted_rate",
]

F_VARIANTS = ("refit_same", "refit_independent", "fixed", "gradient")
X_DISTS = ("gaussian", "rademacher")
SPECTRA = ("geometric", "linear", "two-level")


_BITS = 31          # uniform bits per draw of the generator used by _random_bits


def _random_bits(shape: tuple[int, ...], generator: torch.Generator | None, device, dtype) -> torch.Tensor:
    """Independent fair bits in ``{0, 1}`` (as ``dtype``), 31 to each 32-bit draw of the generator.

    ``torch.randint(0, 2, ...)`` spends one 32-bit draw of the Mersenne twister per bit; at chapter 11's sizes that
    was a sixth of a step. Here ``torch.randint(0, 2**31)`` draws uniform 31-bit words (one 32-bit draw each), unpacked
    by shifts: 31 times fewer draws, the same distribution."""
    numel = math.prod(shape)
    words = torch.randint(0, 2**_BITS, (-(-numel // _BITS),), generator=generator, device=device,
                          dtype=torch.int64).to(torch.int32)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
    bits = ((words[:, None] >> shifts) & 1).reshape(-1)[:numel]
    return bits.reshape(shape).to(dtype)


# ============================================================================================ the problem
@dataclass(frozen=True)
class LinRepProblem:
    r"""``S`` instances of :math:`y = F_\star G_\star x + \varepsilon` with a transfer task (chapter 10).

    ``Fstar (S, d_y, k)``, ``Gstar (S, k, d)`` (orthonormal rows), ``Sigma``, ``Sigma_half`` :math:`=\Sigma^{1/2}`
    ``(S, d, d)``; ``noise`` :math:`=\sigma_\varepsilon`; ``x_dist``: ``'gaussian'`` (:math:`x=\Sigma^{1/2}z`,
    :math:`z\sim\mathcal{N}(0,I)`) or ``'rademacher'`` (:math:`x=\Sigma^{1/2}z`, :math:`z` uniform on
    :math:`\{\pm1\}^d`, as in the paper); the transfer task has ``Fstar_T``, ``Sigma_T``, ``Sigma_T_half`` and
    noise ``noise_T``.
    """

    Fstar: torch.Tensor
    Gstar: torch.Tensor
    Sigma: torch.Tensor
    Sigma_half: torch.Tensor
    noise: float
    x_dist: str
    Fstar_T: torch.Tensor
    Sigma_T: torch.Tensor
    Sigma_T_half: torch.Tensor
    noise_T: float = 0.0

    def __post_init__(self) -> None:
        Gs = check_finite("Gstar", as_tensor("Gstar", self.Gstar))
        if Gs.dim() != 3:
            raise ValueError(f"Gstar must have shape (S, k, d), got {tuple(Gs.shape)}")
        S, k, d = Gs.shape
        if k > d:
            raise ValueError(f"k must be <= d (Gstar has shape {tuple(Gs.shape)})")
        for name in ("Fstar", "Fstar_T"):
            t = check_finite(name, getattr(self, name))
            if t.dim() != 3 or t.shape[0] != S or t.shape[2] != k:
                raise ValueError(f"{name} must have shape ({S}, d_y, {k}), got {tuple(t.shape)}")
        if self.Fstar.shape[1] < k:
            raise ValueError(f"k must be <= d_y so that Fstar has full column rank, got k={k}, d_y={self.Fstar.shape[1]}")
        for name in ("Sigma", "Sigma_half", "Sigma_T", "Sigma_T_half"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.shape != (S, d, d):
                raise ValueError(f"{name} must have shape ({S}, {d}, {d}), got {tuple(getattr(t, 'shape', ()))}")
            check_psd(name, t)
        check_nonnegative("noise", self.noise)
        check_nonnegative("noise_T", self.noise_T)
        check_choice("x_dist", self.x_dist, X_DISTS)

    # ---------------------------------------------------------------------------------------- sizes
    @property
    def n_seeds(self) -> int:
        return self.Gstar.shape[0]

    @property
    def d(self) -> int:
        return self.Gstar.shape[2]

    @property
    def k(self) -> int:
        return self.Gstar.shape[1]

    @property
    def d_y(self) -> int:
        return self.Fstar.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.Gstar.dtype

    @property
    def device(self) -> torch.device:
        return self.Gstar.device

    # ---------------------------------------------------------------------------------------- data
    def sample(self, n: int, generator: torch.Generator | None = None, transfer: bool = False):
        r"""A fresh batch ``(X (S, n, d), Y (S, n, d_y))`` of the training (or ``transfer``) task.

        Random numbers are drawn on the generator's device (the default generator when ``None``) and moved to
        the problem's device.
        """
        n = check_int("n", n, min_value=1)
        S, d, d_y = self.n_seeds, self.d, self.d_y
        gdev = generator.device if generator is not None else self.device
        opts = dict(generator=generator, dtype=self.dtype, device=gdev)
        if self.x_dist == "gaussian":
            Z = torch.randn(S, n, d, **opts)
        else:
            Z = _random_bits((S, n, d), generator, gdev, self.dtype) * 2 - 1
        half, F, sig = ((self.Sigma_T_half, self.Fstar_T, self.noise_T) if transfer
                        else (self.Sigma_half, self.Fstar, self.noise))
        X = Z.to(self.device) @ half       # Sigma_half is symmetric: row i is (Sigma^{1/2} z_i)^T
        Y = X @ (F @ self.Gstar).transpose(-2, -1)
        if sig > 0:                        # noiseless tasks draw no noise
            Y = Y + sig * torch.randn(S, n, d_y, **opts).to(self.device)
        return X, Y

    def sample_moments(self, n: int, generator: torch.Generator | None = None,
                       transfer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The moments ``(Sxx (S, d, d), Syx (S, d_y, d))`` :math:`=(X^\top X/n, Y^\top X/n)` of the batch
        :meth:`sample` would draw from the same generator state, without forming ``X`` and ``Y``.

        With :math:`X = Z\Sigma^{1/2}` and :math:`Y = XB^\top + \sigma E` (:math:`B = F_\star G_\star`),
        :math:`\hat\Sigma = \Sigma^{1/2}(Z^\top Z/n)\Sigma^{1/2}` and :math:`\hat\Sigma_{yx} = B\hat\Sigma +
        \sigma(E^\top Z/n)\Sigma^{1/2}`: one product of size :math:`n d^2` per seed instead of four (:math:`Z`,
        :math:`X^\top X`, :math:`Y`, :math:`Y^\top X`), and products of size :math:`d^3`: cheaper when
        :math:`n\ge d`, as in the book's experiments; for :math:`n < d` the moments are formed from :meth:`sample`'s
        ``X`` and ``Y``, the same draws. For Rademacher inputs :math:`Z = 2R - 1` with :math:`R\in\{0,1\}^{n\times d}`, and
        :math:`Z^\top Z = 4R^\top R - 2(c\mathbf 1^\top + \mathbf 1c^\top) + n\mathbf 1\mathbf 1^\top`
        (:math:`c = R^\top\mathbf 1`) is an integer matrix computed exactly. Agrees with
        ``batch_moments({'X': X, 'Y': Y})`` of :meth:`sample` to rounding (tested)."""
        n = check_int("n", n, min_value=1)
        S, d, d_y = self.n_seeds, self.d, self.d_y
        if n < d:                          # the d^3 products would cost more than forming X and Y
            return batch_moments(dict(zip("XY", self.sample(n, generator, transfer))))
        gdev = generator.device if generator is not None else self.device
        opts = dict(generator=generator, dtype=self.dtype, device=gdev)
        half, F, sig = ((self.Sigma_T_half, self.Fstar_T, self.noise_T) if transfer
                        else (self.Sigma_half, self.Fstar, self.noise))
        if self.x_dist == "gaussian":
            Z = torch.randn(S, n, d, **opts).to(self.device)
            ZZ = Z.transpose(-2, -1) @ Z
        else:                                                               # the same draws as sample()
            Z = _random_bits((S, n, d), generator, gdev, self.dtype).to(self.device)     # R in {0, 1}
            c = Z.sum(-2)                                                   # (S, d) column sums, exact
            ZZ = 4 * (Z.transpose(-2, -1) @ Z) - 2 * (c[..., :, None] + c[..., None, :]) + n
        Sxx = half @ (ZZ / n) @ half
        Syx = (F @ self.Gstar) @ Sxx
        if sig > 0:
            E = torch.randn(S, n, d_y, **opts).to(self.device)
            EZ = E.transpose(-2, -1) @ Z
            if self.x_dist != "gaussian":
                EZ = 2 * EZ - E.sum(-2)[..., :, None]                         # E^T (2R - 1)
            Syx = Syx + (sig / n) * (EZ @ half)
        return Sxx, Syx

    def population_batch(self, transfer: bool = False) -> dict[str, torch.Tensor]:
        r"""The population moments as a batch: ``Sxx`` :math:`=\Sigma`, ``Syx`` :math:`=F_\star G_\star\Sigma`."""
        Sig, F = (self.Sigma_T, self.Fstar_T) if transfer else (self.Sigma, self.Fstar)
        return {"Sxx": Sig, "Syx": F @ self.Gstar @ Sig}

    def select(self, s: int) -> LinRepProblem:
        """Seed ``s`` alone, as a problem with ``S = 1`` (used by :func:`run_looped`)."""
        s = check_int("s", s, min_value=0)
        if s >= self.n_seeds:
            raise ValueError(f"s must be < n_seeds={self.n_seeds}, got {s}")
        sl = slice(s, s + 1)
        return replace(self, Fstar=self.Fstar[sl], Gstar=self.Gstar[sl], Sigma=self.Sigma[sl],
                       Sigma_half=self.Sigma_half[sl], Fstar_T=self.Fstar_T[sl], Sigma_T=self.Sigma_T[sl],
                       Sigma_T_half=self.Sigma_T_half[sl])


def _spectrum(kind: str, size: int, kappa: float) -> torch.Tensor:
    """Eigenvalues in ``[1, kappa]``, decreasing: geometric, linear or two-level (half at ``kappa``, half at 1)."""
    if kind == "geometric":
        return torch.logspace(math.log10(kappa), 0.0, size, dtype=torch.float64)
    if kind == "linear":
        return torch.linspace(kappa, 1.0, size, dtype=torch.float64)
    s = torch.ones(size, dtype=torch.float64)
    s[: (size + 1) // 2] = kappa
    return s


def _orthonormal_rows(S: int, k: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``(S, k, d)`` with Haar-distributed orthonormal rows."""
    Q, R = torch.linalg.qr(torch.randn(S, d, k, generator=gen, dtype=torch.float64))
    return (Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)).transpose(-2, -1)


def linrep_problem(n_seeds: int, *, d: int, k: int, d_y: int, kappa_x: float, kappa_F: float = 1.0,
                   spectrum: str = "geometric", basis: str = "random", x_dist: str = "gaussian",
                   noise: float = 0.0, transfer_kappa: float | None = None, seed: int = 0,
                   dtype: torch.dtype = torch.float64, device=None) -> LinRepProblem:
    r"""Draw ``n_seeds`` instances of the linear representation problem (chapter 10).

    * :math:`\Sigma = U\operatorname{diag}(s)U^\top`, :math:`s` in :math:`[1, \kappa_x]` (``spectrum``:
      ``'geometric'``, ``'linear'`` or ``'two-level'``), :math:`U` Haar (``basis='random'``) or :math:`I`
      (``'aligned'``, a diagonal :math:`\Sigma`), so :math:`\kappa(\Sigma)` = ``kappa_x``;
    * :math:`G_\star` Haar-random with orthonormal rows;
    * :math:`F_\star = P\operatorname{diag}(\sigma)Q^\top`, singular values geometric in :math:`[1,\kappa_F]`, so
      :math:`\kappa(F_\star)` = ``kappa_F`` and :math:`\sigma_{\min}(F_\star) = 1`;
    * the transfer task: an independent head :math:`F_{\star,T}` drawn the same way, and
      :math:`\Sigma_T` with its own Haar basis and condition number ``transfer_kappa`` (``None``:
      :math:`\Sigma_T = I_d`, an isotropic transfer task); noise as the training task.
    """
    S = check_int("n_seeds", n_seeds, min_value=1)
    d, k, d_y = (check_int(nm, v, min_value=1) for nm, v in (("d", d), ("k", k), ("d_y", d_y)))
    if k > d:
        raise ValueError(f"k must be <= d, got k={k} > d={d}")
    if k > d_y:
        raise ValueError(f"k must be <= d_y (Fstar of full column rank), got k={k} > d_y={d_y}")
    kx, kF = check_positive("kappa_x", kappa_x), check_positive("kappa_F", kappa_F)
    if kx < 1 or kF < 1:
        raise ValueError(f"kappa_x and kappa_F must be >= 1, got {kx}, {kF}")
    check_choice("spectrum", spectrum, SPECTRA)
    check_choice("basis", basis, ("random", "aligned"))
    check_choice("x_dist", x_dist, X_DISTS)
    noise = check_nonnegative("noise", noise)
    if transfer_kappa is not None and check_positive("transfer_kappa", transfer_kappa) < 1:
        raise ValueError(f"transfer_kappa must be >= 1, got {transfer_kappa}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    gen = torch.Generator().manual_seed(check_int("seed", seed, min_value=0))
    sx = _spectrum(spectrum, d, kx)
    sF = torch.logspace(math.log10(kF), 0.0, k, dtype=torch.float64)

    def cov(spec, bas):
        U = (torch.stack([linalg.random_orthogonal(d, generator=gen) for _ in range(S)]) if bas == "random"
             else torch.eye(d, dtype=torch.float64).expand(S, d, d))
        return (U * spec) @ U.transpose(-2, -1), (U * spec.sqrt()) @ U.transpose(-2, -1)

    def head():
        P = _orthonormal_rows(S, k, d_y, gen).transpose(-2, -1)     # (S, d_y, k), orthonormal columns
        Q = _orthonormal_rows(S, k, k, gen)
        return (P * sF) @ Q

    Sigma, half = cov(sx, basis)
    Gstar = _orthonormal_rows(S, k, d, gen)
    Fstar = head()
    Fstar_T = head()
    if transfer_kappa is None:
        Sigma_T = torch.eye(d, dtype=torch.float64).expand(S, d, d).clone()
        half_T = Sigma_T.clone()
    else:
        Sigma_T, half_T = cov(_spectrum(spectrum, d, float(transfer_kappa)), "random")
    to = dict(dtype=dtype, device=device)
    return LinRepProblem(Fstar.to(**to), Gstar.to(**to), Sigma.to(**to), half.to(**to), float(noise), x_dist,
                         Fstar_T.to(**to), Sigma_T.to(**to), half_T.to(**to), float(noise))


# ============================================================================================ state, heads, gradients
@dataclass
class LinRepState:
    """The iterate of a method: head ``F (S, d_y, k)``, representation ``G (S, k, d)``, step count ``t`` and a
    free ``extra`` dict for optimiser state (moments, accumulated factors, ...)."""

    F: torch.Tensor
    G: torch.Tensor
    t: int = 0
    extra: dict = field(default_factory=dict)


def init_state(problem: LinRepProblem, generator: torch.Generator | None = None) -> LinRepState:
    r""":math:`G_0` Haar-random with orthonormal rows; :math:`F_0` its population least-squares head (full rank)."""
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is None or generator.device.type != "cpu":
        gen = torch.Generator().manual_seed(12345 if generator is None else generator.initial_seed())
    else:
        gen = generator
    G0 = _orthonormal_rows(problem.n_seeds, problem.k, problem.d, gen).to(problem.dtype).to(problem.device)
    pop = problem.population_batch()
    return LinRepState(F=_head_from_moments(G0, pop["Sxx"], pop["Syx"]), G=G0, t=0)


def batch_moments(batch: dict, second: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(Sxx, Syx)`` :math:`=(\hat\Sigma, \hat\Sigma_{yx}) = (X^\top X/n, Y^\top X/n)` of a batch (or of its
    independent half ``X2``, ``Y2`` when ``second``); a batch of moments (``'Sxx'``, ``'Syx'``, and ``'Sxx2'``,
    ``'Syx2'`` for the independent half; the population batch has no second half) passes them through."""
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict with keys 'X', 'Y' (or 'Sxx', 'Syx'), got {type(batch).__name__}")
    kx, ky = ("X2", "Y2") if second else ("X", "Y")
    if kx in batch:
        X, Y = batch[kx], batch[ky]
        n = X.shape[-2]
        return X.transpose(-2, -1) @ X / n, Y.transpose(-2, -1) @ X / n
    if second and "Sxx2" in batch:
        return batch["Sxx2"], batch["Syx2"]
    if "Sxx" in batch:
        return batch["Sxx"], batch["Syx"]
    raise ValueError(f"batch must hold '{kx}' and '{ky}' (or population moments 'Sxx', 'Syx'), got {list(batch)}")


def _eye(k: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(k, dtype=like.dtype, device=like.device)


def _right_solve(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``B A^{-1}`` for symmetric positive definite ``A`` (batched)."""
    return torch.linalg.solve(A, B.transpose(-2, -1)).transpose(-2, -1)


def _check_moments(G, Sxx, Syx, F=None):
    """Validate ``G (..., k, d)``, ``Sxx (..., d, d)``, ``Syx (..., d_y, d)`` (and ``F (..., d_y, k)``) for the public
    moment functions; the updates call the unvalidated ``_``-versions in their loops."""
    G = check_finite("G", as_tensor("G", G))
    if G.dim() < 2 or G.shape[-1] == 0 or G.shape[-2] == 0:
        raise ValueError(f"G must have shape (..., k, d) with k, d >= 1, got {tuple(G.shape)}")
    k, d = G.shape[-2:]
    Sxx = check_finite("Sxx", as_tensor("Sxx", Sxx, dtype=G.dtype, device=G.device))
    if Sxx.dim() < 2 or Sxx.shape[-2:] != (d, d):
        raise ValueError(f"Sxx must have shape (..., {d}, {d}) to match G {tuple(G.shape)}, got {tuple(Sxx.shape)}")
    Syx = check_finite("Syx", as_tensor("Syx", Syx, dtype=G.dtype, device=G.device))
    if Syx.dim() < 2 or Syx.shape[-1] != d or Syx.shape[-2] == 0:
        raise ValueError(f"Syx must have shape (..., d_y, {d}) to match G {tuple(G.shape)}, got {tuple(Syx.shape)}")
    out = [G, Sxx, Syx]
    if F is not None:
        F = check_finite("F", as_tensor("F", F, dtype=G.dtype, device=G.device))
        if F.dim() < 2 or F.shape[-2:] != (Syx.shape[-2], k):
            raise ValueError(f"F must have shape (..., {Syx.shape[-2]}, {k}) to match Syx and G, got {tuple(F.shape)}")
        out.insert(0, F)
    try:
        torch.broadcast_shapes(*(t.shape[:-2] for t in out))
    except RuntimeError:
        names = ["F", "G", "Sxx", "Syx"][4 - len(out):]
        raise ValueError(f"the batch dimensions of {', '.join(names)} do not broadcast: "
                         f"{[tuple(t.shape) for t in out]}") from None
    return out


def head_from_moments(G: torch.Tensor, Sxx: torch.Tensor, Syx: torch.Tensor, lam: float = 0.0) -> torch.Tensor:
    r"""Least-squares head from moments: :math:`F = \hat\Sigma_{yx}G^\top(G\hat\Sigma G^\top + \lambda I_k)^{-1}`.

    ``G (..., k, d)``, ``Sxx (..., d, d)``, ``Syx (..., d_y, d)``; ValueError naming ``lam`` when
    :math:`G\hat\Sigma G^\top + \lambda I` is singular."""
    G, Sxx, Syx = _check_moments(G, Sxx, Syx)
    lam = check_nonnegative("lam", lam)
    try:
        return _head_from_moments(G, Sxx, Syx, lam)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"G Sxx G^T + lam I is singular (lam = {lam:g}): the least-squares head does not exist; "
                         "pass lam > 0 or a G and Sxx of full rank") from exc


def _head_from_moments(G: torch.Tensor, Sxx: torch.Tensor, Syx: torch.Tensor, lam: float = 0.0) -> torch.Tensor:
    A = G @ Sxx @ G.transpose(-2, -1)
    if lam:
        A = A + lam * _eye(A.shape[-1], A)
    return _right_solve(Syx @ G.transpose(-2, -1), A)


def _check_data(G, X, Y) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    G = check_finite("G", as_tensor("G", G))
    X = check_finite("X", as_tensor("X", X, dtype=G.dtype, device=G.device))
    Y = check_finite("Y", as_tensor("Y", Y, dtype=G.dtype, device=G.device))
    if G.dim() < 2:
        raise ValueError(f"G must have shape (..., k, d), got {tuple(G.shape)}")
    if X.dim() != G.dim() or X.shape[-1] != G.shape[-1]:
        raise ValueError(f"X must have shape (..., n, {G.shape[-1]}) matching G {tuple(G.shape)}, got {tuple(X.shape)}")
    if Y.dim() != X.dim() or Y.shape[-2] != X.shape[-2]:
        raise ValueError(f"Y must have shape (..., {X.shape[-2]}, d_y), got {tuple(Y.shape)}")
    return G, X, Y


def fit_head(G, X, Y, lam: float = 0.0) -> torch.Tensor:
    r"""Batched least squares :math:`F = \arg\min_F \frac1{2n}\lVert Y - XG^\top F^\top\rVert_F^2 +
    \frac\lambda2\lVert F\rVert_F^2 = \hat\Sigma_{yx}G^\top(G\hat\Sigma G^\top+\lambda I_k)^{-1}` (chapter 10; one
    unit K-FAC step on :math:`F`). ``G (..., k, d)``, ``X (..., n, d)``, ``Y (..., n, d_y)`` → ``(..., d_y, k)``."""
    G, X, Y = _check_data(G, X, Y)
    lam = check_nonnegative("lam", lam)
    n = X.shape[-2]
    if n == 0:
        raise ValueError(f"X must hold at least one sample, got shape {tuple(X.shape)}")
    try:
        return _head_from_moments(G, X.transpose(-2, -1) @ X / n, Y.transpose(-2, -1) @ X / n, lam)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"G Sigma_hat G^T + lam I is singular (lam = {lam:g}, n = {n} samples): pass lam > 0 or "
                         "more samples") from exc


def grad_G(F, G, Sxx, Syx) -> torch.Tensor:
    r""":math:`\nabla_G\mathcal{L} = \frac1n F^\top(FGX^\top - Y^\top)X = F^\top(FG\hat\Sigma - \hat\Sigma_{yx})`.

    ``F (..., d_y, k)``, ``G (..., k, d)``, ``Sxx (..., d, d)``, ``Syx (..., d_y, d)`` (validated; the updates of
    this module call the unvalidated ``_grad_G`` in their loops)."""
    return _grad_G(*_check_moments(G, Sxx, Syx, F))


def _grad_G(F, G, Sxx, Syx) -> torch.Tensor:
    return F.transpose(-2, -1) @ (F @ G @ Sxx - Syx)


def grad_F(F, G, Sxx, Syx) -> torch.Tensor:
    r""":math:`\nabla_F\mathcal{L} = (FG\hat\Sigma - \hat\Sigma_{yx})G^\top` (shapes and validation as
    :func:`grad_G`)."""
    return _grad_F(*_check_moments(G, Sxx, Syx, F))


def _grad_F(F, G, Sxx, Syx) -> torch.Tensor:
    return (F @ G @ Sxx - Syx) @ G.transpose(-2, -1)


def loss(F, G, X, Y) -> torch.Tensor:
    r"""The batch loss :math:`\mathcal{L}(F,G) = \frac1{2n}\lVert Y - XG^\top F^\top\rVert_F^2`, shape ``(...)``
    (validated, the same as :func:`train_loss`)."""
    return train_loss(F, G, X, Y)


def _loss(F, G, X, Y) -> torch.Tensor:
    R = Y - X @ G.transpose(-2, -1) @ F.transpose(-2, -1)
    return 0.5 * R.square().sum((-2, -1)) / X.shape[-2]


def train_loss(F, G, X, Y) -> torch.Tensor:
    r"""Validated :func:`loss`: the empirical training loss of :math:`(F, G)` on ``(X, Y)``, shape ``(...)``."""
    G, X, Y = _check_data(G, X, Y)
    F = check_finite("F", as_tensor("F", F, dtype=G.dtype, device=G.device))
    if F.dim() < 2 or F.shape[-1] != G.shape[-2] or F.shape[-2] != Y.shape[-1]:
        raise ValueError(f"F must have shape (..., {Y.shape[-1]}, {G.shape[-2]}), got {tuple(F.shape)}")
    if X.shape[-2] == 0:
        raise ValueError(f"X must hold at least one sample, got shape {tuple(X.shape)}")
    try:
        torch.broadcast_shapes(F.shape[:-2], G.shape[:-2], X.shape[:-2], Y.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dimensions of F, G, X, Y do not broadcast: {tuple(F.shape)}, {tuple(G.shape)}, "
                         f"{tuple(X.shape)}, {tuple(Y.shape)}") from None
    return _loss(F, G, X, Y)


# ============================================================================================ the updates
def _hp(hp: Any, method: str) -> dict:
    if not isinstance(hp, dict):
        raise TypeError(f"hp must be a dict of hyperparameters, got {type(hp).__name__}")
    if "eta_G" not in hp:
        raise ValueError(f"hp must contain 'eta_G' (the step size of G) for {method}")
    out = dict(hp)
    out["eta_G"] = _step_size("eta_G", hp["eta_G"])
    out["eta_F"] = _step_size("eta_F", hp.get("eta_F", out["eta_G"]))
    for name in ("lam_F", "lam_G", "lam_head"):
        out[name] = check_nonnegative(name, hp.get(name, 0.0))
    out["f_variant"] = check_choice("f_variant", hp.get("f_variant", DEFAULT_F_VARIANT.get(method, "refit_same")),
                                    F_VARIANTS)
    return out


def _step_size(name: str, value: Any) -> float | torch.Tensor:
    """A positive number, or a tensor of per-seed step sizes ``(S,)`` returned as ``(S, 1, 1)``."""
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        v = check_finite(name, value)
        if bool((v <= 0).any()):
            raise ValueError(f"{name} must be > 0, got min {float(v.min()):.3g}")
        return v.reshape(-1, 1, 1)
    return check_positive(name, value)


def _head_for_step(state: LinRepState, batch: dict, hp: dict, moments=None) -> torch.Tensor:
    """The head the G-step uses, per ``hp['f_variant']`` (the F-gradient variant returns the current F).
    ``moments``: the step batch's ``(Sxx, Syx)`` if the caller has them already (reused for ``'refit_same'``)."""
    v = hp["f_variant"]
    if v in ("fixed", "gradient"):
        return state.F
    if v == "refit_same" and moments is not None:
        Sxx, Syx = moments
    else:
        Sxx, Syx = batch_moments(batch, second=(v == "refit_independent"))
    return _head_from_moments(state.G, Sxx, Syx, hp["lam_head"])


def _finish(state: LinRepState, F: torch.Tensor, G_new: torch.Tensor, Sxx, Syx, hp: dict) -> LinRepState:
    """Apply the F-gradient variant (simultaneous step) and optional re-orthonormalisation; bump ``t``."""
    if hp["f_variant"] == "gradient":
        F = F - hp["eta_F"] * _grad_F(F, state.G, Sxx, Syx)
    if hp.get("orthonormalize", False):
        Q, R = torch.linalg.qr(G_new.transpose(-2, -1))
        F = F @ R.transpose(-2, -1)                    # keep the product F G unchanged
        G_new = Q.transpose(-2, -1)
    return LinRepState(F=F, G=G_new, t=state.t + 1, extra=state.extra)


def _step_scale(F: torch.Tensor, Sxx: torch.Tensor, hp: dict) -> torch.Tensor | float:
    r""":math:`\eta_G`, or :math:`\eta_G/(\lVert F\rVert_2^2\lambda_{\max}(\hat\Sigma))` per seed when
    ``hp['normalize_step']``."""
    if not hp.get("normalize_step", False):
        return hp["eta_G"]
    fF = torch.linalg.matrix_norm(F, ord=2).square()
    lx = torch.linalg.eigvalsh(Sxx)[..., -1]
    return hp["eta_G"] / (fF * lx)[..., None, None]


def sgd_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""SGD on both layers (default ``f_variant='gradient'``): :math:`G \leftarrow G - \eta_G\nabla_G\mathcal{L}`,
    :math:`F \leftarrow F - \eta_F\nabla_F\mathcal{L}`, both gradients at :math:`(F_t, G_t)` on the same batch."""
    hp = _hp(hp, "SGD")
    Sxx, Syx = batch_moments(batch)
    F = _head_for_step(state, batch, hp, (Sxx, Syx))
    G = state.G - _step_scale(F, Sxx, hp) * _grad_G(F, state.G, Sxx, Syx)
    return _finish(state, F, G, Sxx, Syx, hp)


def amgd_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""AMGD (the paper's "SGD"; alternating minimisation–descent): :math:`F_t = \arg\min_F\mathcal{L}(F, G_t)` on
    the step's batch (default ``f_variant='refit_same'``), then :math:`G_{t+1} = G_t - \eta_G\nabla_G\mathcal{L}(F_t,
    G_t)` on the same batch."""
    hp = _hp(hp, "AMGD")
    Sxx, Syx = batch_moments(batch)
    F = _head_for_step(state, batch, hp, (Sxx, Syx))
    G = state.G - _step_scale(F, Sxx, hp) * _grad_G(F, state.G, Sxx, Syx)
    return _finish(state, F, G, Sxx, Syx, hp)


#: Methods whose G-step right-multiplies by :math:`(\hat\Sigma + \lambda_G I_d)^{-1}`, so that with ``lam_G = 0``
#: they need a batch of at least ``d`` samples (:func:`_check_run`, :func:`_whitened`).
INPUT_WHITENED = ("K-FAC", "DFW")


def _undamped_singular_message(method: str, n: int | None, d: int) -> str:
    size = f"a batch of n = {n} < d = {d} samples" if n is not None else "this batch"
    return (f"{method} with lam_G = 0 needs an invertible input covariance Sigma_hat, but {size} gives a singular "
            f"one (rank <= n): the undamped step amplifies rounding errors without bound and diverges. Pass "
            f"lam_G > 0 (the lam_G -> 0+ limit of the damped step is the pseudo-inverse step, which converges), "
            f"or use batch_size >= d")


def _whitened(method: str, grad: torch.Tensor, Sxx: torch.Tensor, batch: dict, hp: dict) -> torch.Tensor:
    r""":math:`\nabla(\hat\Sigma + \lambda_G I)^{-1}`; ``lam_G = 0`` with a rank-deficient batch is refused
    (ValueError naming ``lam_G``): a batch ``X`` of ``n < d`` rows, or a solve that finds ``Sxx`` singular."""
    d = Sxx.shape[-1]
    if hp["lam_G"] == 0:
        X = batch.get("X") if isinstance(batch, dict) else None
        if isinstance(X, torch.Tensor) and X.shape[-2] < d:
            raise ValueError(_undamped_singular_message(method, X.shape[-2], d))
    C_in = Sxx + hp["lam_G"] * _eye(d, Sxx)
    try:
        return _right_solve(grad, C_in)
    except torch.linalg.LinAlgError as exc:
        if hp["lam_G"] == 0:
            raise ValueError(_undamped_singular_message(method, None, d)) from exc
        raise


def kfac_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""Stylised K-FAC (the paper's main algorithm): with :math:`F_t` the least-squares head (default
    ``'refit_same'``),

    .. math:: G_{t+1} = G_t - \eta_G\,(F_t^\top F_t + \lambda_F I_k)^{-1}\,\nabla_G\mathcal{L}(F_t, G_t)\,
              (\hat\Sigma + \lambda_G I_d)^{-1}.

    **Undamped and rank-deficient.** With ``lam_G = 0`` a batch of :math:`n < d` samples has a singular
    :math:`\hat\Sigma` and the step does not exist; it is refused with a ValueError naming ``lam_G`` (up front in
    :func:`run` from ``batch_size``; here from a batch ``X`` of ``n < d`` rows or a failed solve). The rows of
    :math:`\nabla_G\mathcal{L}` lie in the range of :math:`\hat\Sigma`, so the :math:`\lambda_G\to0^+` limit of
    the damped step exists — it is the pseudo-inverse step — but the undamped solve in floating point divides
    rounding errors by :math:`\lambda_{\min}(\hat\Sigma)\approx 0` and diverged in the case that was reported
    (risk 28.8); a small ``lam_G`` (``1e-3`` at :math:`n = d/2`) follows the limit and converges.
    """
    hp = _hp(hp, "K-FAC")
    Sxx, Syx = batch_moments(batch)
    F = _head_for_step(state, batch, hp, (Sxx, Syx))
    C_out = F.transpose(-2, -1) @ F + hp["lam_F"] * _eye(F.shape[-1], F)
    step = torch.linalg.solve(C_out, _whitened("K-FAC", _grad_G(F, state.G, Sxx, Syx), Sxx, batch, hp))
    return _finish(state, F, state.G - hp["eta_G"] * step, Sxx, Syx, hp)


def dfw_update(problem: LinRepProblem, state: LinRepState, batch: dict, hp: dict) -> LinRepState:
    r"""DFW, "De-bias & Feature-Whiten" (Zhang, Toso, Anderson & Matni, ICLR 2024; an adaptation of AMGD): the head
    is fit on an independent batch (default ``'refit_independent'``, the de-biasing) and the gradient is whitened on
    the right only,

    .. math:: G_{t+1} = G_t - \eta_G\,\nabla_G\mathcal{L}(F_t, G_t)\,(\hat\Sigma + \lambda_G I_d)^{-1}.

    ``lam_G = 0`` with fewer than :math:`d` samples per batch is refused, as for :func:`kfac_update`.
    """
    hp = _hp(hp, "DFW")
    Sxx, Syx = batch_moments(batch)
    F = _head_for_step(state, batch, hp, (Sxx, Syx))
    step = _whitened("DFW", _grad_G(F, state.G, Sxx, Syx), Sxx, batch, hp)
    if hp.get("normalize_step", False):
        scale = hp["eta_G"] / torch.linalg.matrix_norm(F, ord=2).square()[..., None, None]  # (S,1,1) or float
    else:
        scale = hp["eta_G"]
    return _finish(state, F, state.G - scale * step, Sxx, Syx, hp)


UpdateFn = Callable[[LinRepProblem, LinRepState, dict, dict], LinRepState]
#: name -> update rule ``fn(problem, state, batch, hp) -> LinRepState``; names are those of ``plotting.METHODS``.
UPDATES: dict[str, UpdateFn] = {}
#: name -> the head variant a method uses when ``hp`` does not say.
DEFAULT_F_VARIANT: dict[str, str] = {}


def register_update(name: str, fn: UpdateFn, *, default_f_variant: str = "refit_same", overwrite: bool = True) -> None:
    """Register an update rule under a method name of :data:`curvlab.plotting.METHODS` (checked)."""
    from .plotting import METHODS

    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"name must be a method registered in curvlab.plotting.METHODS, got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_choice("default_f_variant", default_f_variant, F_VARIANTS)
    if name in UPDATES and not overwrite:
        raise ValueError(f"an update named {name!r} is already registered")
    UPDATES[name] = fn
    DEFAULT_F_VARIANT[name] = default_f_variant


register_update("SGD", sgd_update, default_f_variant="gradient")
register_update("AMGD", amgd_update, default_f_variant="refit_same")
register_update("K-FAC", kfac_update, default_f_variant="refit_same")
register_update("DFW", dfw_update, default_f_variant="refit_independent")


# ============================================================================================ metrics
def _orth_cols(A: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the column space of a full-column-rank ``A (..., d, k)``."""
    return torch.linalg.qr(A)[0]


def subspace_distance(G, Gstar, kind: str = "sin_max") -> torch.Tensor:
    r"""Distance between row spaces through the principal angles :math:`\psi_i`: ``'sin_max'`` gives
    :math:`\operatorname{dist}(G, G_\star) = \sin\psi_{\max} = \lVert(I - G_\star^\top G_\star)Q_G\rVert_2`,
    ``'fro'`` gives :math:`(\sum_i\sin^2\psi_i)^{1/2}`, with :math:`Q_G` an orthonormal basis of
    :math:`\operatorname{rowsp}(G)` (columns). ``G (..., k, d)``, ``Gstar (..., k_\star, d)`` with orthonormal rows.
    Accurate at small angles (no :math:`\sqrt{1-\cos^2}`)."""
    kind = check_choice("kind", kind, ("sin_max", "fro"))
    G = check_finite("G", as_tensor("G", G))
    Gstar = check_finite("Gstar", as_tensor("Gstar", Gstar, dtype=G.dtype, device=G.device))
    if G.dim() < 2 or Gstar.dim() < 2 or G.shape[-1] != Gstar.shape[-1]:
        raise ValueError(f"G and Gstar must be (..., k, d) with the same d, got {tuple(G.shape)}, {tuple(Gstar.shape)}")
    if G.shape[-2] > G.shape[-1]:
        raise ValueError(f"G must have k <= d rows, got shape {tuple(G.shape)}")
    return _dist(G, Gstar, kind)


def _dist(G: torch.Tensor, Gstar: torch.Tensor, kind: str = "sin_max") -> torch.Tensor:
    Q = _orth_cols(G.transpose(-2, -1))
    P = Q - Gstar.transpose(-2, -1) @ (Gstar @ Q)
    s = torch.linalg.svdvals(P)
    return s[..., 0] if kind == "sin_max" else s.square().sum(-1).sqrt()


def perp_projector(Gstar) -> torch.Tensor:
    r""":math:`\Pi_\perp = I_d - G_\star^\top G_\star`, the projector onto :math:`\operatorname{rowsp}(G_\star)^\perp`."""
    Gstar = check_finite("Gstar", as_tensor("Gstar", Gstar))
    if Gstar.dim() < 2 or Gstar.shape[-1] == 0:
        raise ValueError(f"Gstar must have shape (..., k, d) with d >= 1, got {tuple(Gstar.shape)}")
    return _eye(Gstar.shape[-1], Gstar) - Gstar.transpose(-2, -1) @ Gstar


def _rep_loss(G, Fstar, Gstar, half) -> torch.Tensor:
    B = Fstar @ Gstar @ half                               # (S, d_y, d)
    Q = _orth_cols(half @ G.transpose(-2, -1))             # basis of colsp(Sigma^{1/2} G^T)
    R = B - (B @ Q) @ Q.transpose(-2, -1)
    return 0.5 * R.square().sum((-2, -1))


def representation_loss(G, problem: LinRepProblem, transfer: bool = False) -> torch.Tensor:
    r"""Excess population risk of :math:`G` with its best head (the variable-projection objective, chapter 10):

    .. math:: \varphi(G) = \min_F \tfrac12\mathbb{E}\lVert F_\star G_\star x - FGx\rVert^2
              = \tfrac12\lVert F_\star G_\star\Sigma^{1/2}(I - \Pi_G)\rVert_F^2,

    :math:`\Pi_G` the orthogonal projector onto :math:`\operatorname{colsp}(\Sigma^{1/2}G^\top)`. With
    ``transfer``, :math:`F_{\star,T}` and :math:`\Sigma_T`. Add :math:`\tfrac12 d_y\sigma_\varepsilon^2` for the full
    risk. Shape ``(S,)``."""
    G = _check_G(G, problem)
    if transfer:
        return _rep_loss(G, problem.Fstar_T, problem.Gstar, problem.Sigma_T_half)
    return _rep_loss(G, problem.Fstar, problem.Gstar, problem.Sigma_half)


def _check_G(G, problem: LinRepProblem) -> torch.Tensor:
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    G = check_finite("G", as_tensor("G", G, dtype=problem.dtype, device=problem.device))
    if G.shape != problem.Gstar.shape:
        raise ValueError(f"G must have shape {tuple(problem.Gstar.shape)}, got {tuple(G.shape)}")
    return G


def excess_risk(F, G, problem: LinRepProblem, transfer: bool = False) -> torch.Tensor:
    r"""Population excess risk of the pair :math:`(F, G)`: :math:`\tfrac12\operatorname{tr}\big((FG - F_\star
    G_\star)\Sigma(FG - F_\star G_\star)^\top\big)` (``transfer``: :math:`F_{\star,T}`, :math:`\Sigma_T`). ``(S,)``."""
    G = _check_G(G, problem)
    F = check_finite("F", as_tensor("F", F, dtype=G.dtype, device=G.device))
    Fs, half = (problem.Fstar_T, problem.Sigma_T_half) if transfer else (problem.Fstar, problem.Sigma_half)
    D = (F @ G - Fs @ problem.Gstar) @ half
    return 0.5 * D.square().sum((-2, -1))


def transfer_loss(G, problem: LinRepProblem, closed_form: bool = True, *, n: int | None = None,
                  generator: torch.Generator | None = None, lam: float = 0.0) -> torch.Tensor:
    r"""Transfer loss of a frozen representation :math:`G` (chapter 10), shape ``(S,)``.

    ``closed_form=True``: the optimal new head under :math:`\Sigma_T`,
    :math:`\tfrac12\lVert F_{\star,T}G_\star\Sigma_T^{1/2}(I-\Pi_G)\rVert_F^2` (:func:`representation_loss` with
    ``transfer=True``). ``closed_form=False``: the head is fit by least squares (ridge ``lam``) on ``n`` fresh
    noisy transfer samples, and its population excess risk :func:`excess_risk` is returned; it is :math:`\ge` the
    closed form and tends to it as :math:`n\to\infty`."""
    if closed_form:
        return representation_loss(G, problem, transfer=True)
    if n is None:
        raise ValueError("n (the number of transfer samples) is required when closed_form=False")
    G = _check_G(G, problem)
    X, Y = problem.sample(check_int("n", n, min_value=1), generator, transfer=True)
    return excess_risk(fit_head(G, X, Y, lam), G, problem, transfer=True)


def schur_complement(G, Sigma) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The Schur complement of :math:`\Sigma` on :math:`\operatorname{rowsp}(G)^\perp` and that basis.

    With :math:`U_\perp\in\mathbb{R}^{(d-k)\times d}` orthonormal rows spanning :math:`\operatorname{rowsp}(G)^\perp`
    and :math:`Q` those spanning :math:`\operatorname{rowsp}(G)`,

    .. math:: S = \big[(U_\perp\Sigma^{-1}U_\perp^\top)\big]^{-1}
              = \Sigma_{\perp\perp} - \Sigma_{\perp\parallel}\Sigma_{\parallel\parallel}^{-1}\Sigma_{\parallel\perp},

    the residual covariance of :math:`U_\perp x` after regressing on :math:`Qx`. Returns ``(S (..., d-k, d-k),
    U_perp (..., d-k, d))``. It equals :math:`U_\perp\Sigma U_\perp^\top` only when :math:`\operatorname{rowsp}(G)`
    is an invariant subspace of :math:`\Sigma`."""
    G = check_finite("G", as_tensor("G", G))
    if G.dim() < 2 or G.shape[-2] == 0:
        raise ValueError(f"G must have shape (..., k, d) with k >= 1, got {tuple(G.shape)}")
    if not G.is_floating_point():
        G = G.to(torch.get_default_dtype())
    Sigma = check_psd("Sigma", as_tensor("Sigma", Sigma, dtype=G.dtype, device=G.device), strict=True)
    k, d = G.shape[-2:]
    if k >= d:
        raise ValueError(f"G must have k < d rows (a nontrivial complement), got shape {tuple(G.shape)}")
    if Sigma.shape[-1] != d:
        raise ValueError(f"Sigma must be ({d}, {d}) to match G, got {tuple(Sigma.shape)}")
    try:
        torch.broadcast_shapes(G.shape[:-2], Sigma.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dimensions of G {tuple(G.shape)} and Sigma {tuple(Sigma.shape)} do not "
                         "broadcast") from None
    if bool((torch.linalg.matrix_rank(G) < k).any()):
        raise ValueError(f"G must have full row rank k = {k} (its row space is the subspace), got a rank-deficient G")
    Qfull = torch.linalg.qr(G.transpose(-2, -1), mode="complete")[0]      # (..., d, d)
    U = Qfull[..., :, k:].transpose(-2, -1)
    Sinv_perp = U @ torch.linalg.solve(Sigma, U.transpose(-2, -1))
    S = torch.linalg.inv(Sinv_perp)
    return 0.5 * (S + S.transpose(-2, -1)), U


def schur_curvature(F, G, Sigma) -> torch.Tensor:
    r"""Variable-projection curvature of AMGD on the Grassmann tangent (chapters 10 and 40):

    .. math:: H_{\mathrm{vp}} = F^\top F \otimes S, \qquad S = \Sigma_{\perp\perp} - \Sigma_{\perp\parallel}
              \Sigma_{\parallel\parallel}^{-1}\Sigma_{\parallel\perp}\ \ (:func:`schur_complement`).

    **Vec convention.** A tangent perturbation is :math:`\delta G = B\,U_\perp` with :math:`B\in\mathbb{R}^{k\times
    (d-k)}` and :math:`U_\perp` from :func:`schur_complement`; :math:`H_{\mathrm{vp}}` acts on
    :math:`\operatorname{vec}(B)` stacked row by row (``B.reshape(-1)``), so :math:`H\operatorname{vec}(B) =
    \operatorname{vec}(F^\top F\,B\,S)`. At a fixed point :math:`G = RG_\star` of population AMGD, the linearised map
    is :math:`B \mapsto B - \eta F^\top F B S` (rate :func:`linearised_rate`). Returns ``(..., k(d-k), k(d-k))``."""
    F = check_finite("F", as_tensor("F", F))
    G_t = as_tensor("G", G)
    if G_t.dim() < 2:
        raise ValueError(f"G must have shape (..., k, d), got {tuple(G_t.shape)}")
    k = G_t.shape[-2]
    if F.dim() < 2 or F.shape[-1] != k:
        raise ValueError(f"F must have shape (..., d_y, {k}) to match G, got {tuple(F.shape)}")
    S, _ = schur_complement(G, Sigma)
    try:
        torch.broadcast_shapes(F.shape[:-2], S.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dimensions of F {tuple(F.shape)} and G {tuple(G_t.shape)} do not "
                         "broadcast") from None
    return linalg.kron(F.transpose(-2, -1) @ F.to(S.dtype), S)


def linearised_rate(H, eta) -> torch.Tensor:
    r""":math:`\max_i|1 - \eta\lambda_i(H)|`: the contraction factor of :math:`B\mapsto(I-\eta H)B` for a symmetric
    PSD curvature ``H (..., p, p)``; ``eta`` a number or a tensor broadcasting against ``H``'s batch shape."""
    H = check_psd("H", H)
    ev = torch.linalg.eigvalsh(H)
    eta = as_tensor("eta", eta, dtype=ev.dtype, device=ev.device)
    if bool((eta <= 0).any()):
        raise ValueError("eta must be > 0")
    return torch.maximum((1 - eta * ev[..., 0]).abs(), (1 - eta * ev[..., -1]).abs())


def optimal_step(H) -> torch.Tensor:
    r"""The step :math:`2/(\lambda_{\min}+\lambda_{\max})` minimising :func:`linearised_rate`; the rate there is
    :math:`(\kappa-1)/(\kappa+1)`, :math:`\kappa = \lambda_{\max}/\lambda_{\min}`."""
    ev = torch.linalg.eigvalsh(check_psd("H", H, strict=True))
    return 2.0 / (ev[..., 0] + ev[..., -1])


def perp_jacobian(step: Callable[[torch.Tensor], torch.Tensor], G, U_perp, h: float = 1e-6) -> torch.Tensor:
    r"""Central finite-difference Jacobian of a map :math:`G\mapsto G_+` restricted to the tangent block
    :math:`B\mapsto B_+` with :math:`\delta G = B U_\perp`, :math:`B_+ = \delta G_+ U_\perp^\top`, in the row-major
    vec convention of :func:`schur_curvature`. ``G (..., k, d)``; returns ``(..., k(d-k), k(d-k))``."""
    if not callable(step):
        raise TypeError("step must be callable G -> G_plus")
    h = check_positive("h", h)
    G = check_finite("G", as_tensor("G", G))
    if G.dim() < 2 or G.shape[-2] == 0 or G.shape[-1] == 0:
        raise ValueError(f"G must have shape (..., k, d) with k, d >= 1, got {tuple(G.shape)}")
    U_perp = check_finite("U_perp", as_tensor("U_perp", U_perp, dtype=G.dtype, device=G.device))
    if U_perp.dim() < 2 or U_perp.shape[-1] != G.shape[-1] or U_perp.shape[-2] == 0:
        raise ValueError(f"U_perp must have shape (..., d - k, {G.shape[-1]}) with d - k >= 1 to match G, got "
                         f"{tuple(U_perp.shape)}")
    try:
        torch.broadcast_shapes(G.shape[:-2], U_perp.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dimensions of G {tuple(G.shape)} and U_perp {tuple(U_perp.shape)} do not "
                         "broadcast") from None
    k, r = G.shape[-2], U_perp.shape[-2]
    probe = step(G)
    if not isinstance(probe, torch.Tensor) or probe.shape != G.shape:
        raise ValueError(f"step must map G {tuple(G.shape)} to a tensor of the same shape, got "
                         f"{tuple(probe.shape) if isinstance(probe, torch.Tensor) else type(probe).__name__}")
    cols = []
    for a in range(k):
        for b in range(r):
            E = torch.zeros(*G.shape[:-2], k, r, dtype=G.dtype, device=G.device)
            E[..., a, b] = 1.0
            D = E @ U_perp
            diff = (step(G + h * D) - step(G - h * D)) / (2 * h)
            cols.append((diff @ U_perp.transpose(-2, -1)).reshape(*G.shape[:-2], k * r))
    return torch.stack(cols, dim=-1)


def fitted_rate(trace, steps, *, window: tuple[float, float] = (1e-10, 1e-2), min_step: int = 0):
    r"""Per-seed geometric tail rate :math:`\rho` of a trace :math:`D_t\approx c\rho^t` (chapter 10).

    Least squares of :math:`\log D_t` on :math:`t` over the points with ``window[0] < D_t < window[1]`` and
    ``t >= min_step`` (above the floating-point floor, past the transient). Returns ``(rate, se, drift)``, each
    ``(S,)``: :math:`\rho = e^{\text{slope}}`; its standard error by the delta method from the regression's
    residuals; and ``drift``, :math:`|\rho_{\text{first half}} - \rho_{\text{second half}}|` of the window, which
    measures how far the trace still is from a pure geometric tail.

    A seed with fewer than 6 points in the window raises a ValueError naming ``window`` and ``min_step`` (and the
    seed), like every other rate fitter of curvlab (:func:`curvlab.synthesis.tail_rate`,
    :func:`curvlab.synthesis.mode_rate`): a rate is never returned as NaN."""
    D = as_tensor("trace", trace, dtype=torch.float64).cpu()
    st = as_tensor("steps", steps, dtype=torch.float64).cpu()
    if D.dim() not in (1, 2) or D.shape[-1] == 0:
        raise ValueError(f"trace must have shape (T,) or (S, T) with T >= 1, got {tuple(D.shape)}")
    if st.dim() not in (1, 2):
        raise ValueError(f"steps must have shape (T,) or (S, T), got {tuple(st.shape)}")
    if D.dim() == 1:
        D = D[None]
    st = st.reshape(-1)[-D.shape[-1]:] if st.dim() == 1 else st[0]
    if st.numel() != D.shape[-1]:
        raise ValueError(f"steps must have {D.shape[-1]} entries to match trace, got {tuple(st.shape)}")
    if isinstance(window, (str, bytes)) or not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (low, high) of positive numbers, got {window!r}")
    lo, hi = (check_positive("window", w) for w in window)
    if lo >= hi:
        raise ValueError(f"window must satisfy low < high, got {tuple(window)}")
    min_step = check_int("min_step", min_step)
    check_finite("steps", st)
    rates, ses, drifts = [], [], []

    def fit(t, y):
        A = torch.stack([t, torch.ones_like(t)], -1)
        coef = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
        res = y - A @ coef
        cov = (res @ res) / max(len(t) - 2, 1) * torch.linalg.inv(A.T @ A)
        return coef[0], cov[0, 0].clamp_min(0).sqrt()

    for s in range(D.shape[0]):
        m = (D[s] > lo) & (D[s] < hi) & (st >= min_step)
        t, y = st[m], D[s][m].log()
        if t.numel() < 6:
            raise ValueError(f"trace: seed {s} has {t.numel()} point(s) with window[0] < D_t < window[1] "
                             f"(window={tuple(window)}) and step >= min_step={min_step}; a rate needs at least 6 "
                             "(widen the window, lower min_step or run longer)")
        slope, se = fit(t, y)
        h = t.numel() // 2
        s1, _ = fit(t[:h], y[:h])
        s2, _ = fit(t[h:], y[h:])
        rates.append(float(slope.exp())), ses.append(float(slope.exp() * se))
        drifts.append(abs(float(s1.exp() - s2.exp())))
    return tuple(torch.tensor(v, dtype=torch.float64) for v in (rates, ses, drifts))


def noise_floor(eta, per_step_variance) -> torch.Tensor:
    r"""Stationary second moment of :math:`e_{t+1} = (1-\eta)e_t + \eta\xi_t` with independent mean-zero
    :math:`\xi_t`, :math:`\mathbb{E}\lVert\xi_t\rVert^2 = v`: :math:`\frac{\eta^2 v}{1-(1-\eta)^2} =
    \frac{\eta}{2-\eta}\,v` for :math:`0<\eta<2` (chapter 10)."""
    eta = as_tensor("eta", eta, dtype=torch.float64)
    if bool(((eta <= 0) | (eta >= 2)).any()):
        raise ValueError("eta must be in (0, 2) for a stationary noise floor")
    v = as_tensor("per_step_variance", per_step_variance, dtype=torch.float64)
    if bool((v < 0).any()):
        raise ValueError("per_step_variance must be >= 0")
    return eta / (2 - eta) * v


# ============================================================================================ running
def _needs_second(method: str, hp: dict) -> bool:
    return hp.get("f_variant", DEFAULT_F_VARIANT.get(method, "refit_same")) == "refit_independent"


def _check_run(method: str, problem: Any, n_steps: Any, batch_size: Any, hp: Any, record_every: Any, *,
               min_steps: int = 0) -> tuple[int, int | None, int]:
    """Validate the arguments every runner of this module (and of ``linrep_baselines``) takes."""
    if method not in UPDATES:
        raise ValueError(f"method must be one of {sorted(UPDATES)}, got {method!r}")
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    n_steps = check_int("n_steps", n_steps, min_value=min_steps)
    if batch_size is not None:
        batch_size = check_int("batch_size", batch_size, min_value=1)
    record_every = check_int("record_every", record_every, min_value=1)
    checked = _hp(hp, method)                               # validate once, up front
    if batch_size is not None and batch_size < problem.d and method in INPUT_WHITENED and checked["lam_G"] == 0:
        raise ValueError(_undamped_singular_message(method, batch_size, problem.d))
    if (batch_size is not None and batch_size < problem.k and checked["lam_head"] == 0
            and checked["f_variant"] in ("refit_same", "refit_independent")):
        raise ValueError(f"the least-squares head (f_variant={checked['f_variant']!r}) with lam_head = 0 needs "
                         f"batch_size >= k = {problem.k} (G Sigma_hat G^T is singular otherwise), got "
                         f"batch_size={batch_size}; pass lam_head > 0 or a larger batch")
    return n_steps, batch_size, record_every


def _batches(method: str, problem: LinRepProblem, n_steps: int, batch_size: int | None, hp: dict,
             gen: torch.Generator):
    """The batch of each step: the population moments when ``batch_size`` is None, else the moments of fresh
    samples (:meth:`LinRepProblem.sample_moments`; and of a second independent batch, ``'Sxx2'``, ``'Syx2'``, when
    the method's head is fit on one)."""
    second = _needs_second(method, hp)
    pop = problem.population_batch() if batch_size is None else None
    for _ in range(n_steps):
        if pop is not None:
            yield pop
            continue
        Sxx, Syx = problem.sample_moments(batch_size, gen)
        batch = {"Sxx": Sxx, "Syx": Syx}
        if second:
            batch["Sxx2"], batch["Syx2"] = problem.sample_moments(batch_size, gen)
        yield batch


def _record(problem: LinRepProblem, state: LinRepState) -> dict[str, torch.Tensor]:
    return {
        "subspace_distance": _dist(state.G, problem.Gstar),
        "train_loss": _rep_loss(state.G, problem.Fstar, problem.Gstar, problem.Sigma_half),
        "transfer_loss": _rep_loss(state.G, problem.Fstar_T, problem.Gstar, problem.Sigma_T_half),
        "risk": excess_risk(state.F, state.G, problem),
        "perp_norm2": (state.G - (state.G @ problem.Gstar.transpose(-2, -1)) @ problem.Gstar).square().sum((-2, -1)),
    }


#: On the CPU, :func:`run` iterates on one thread when a step's data tensor has fewer elements than this, because
#: per-step tensors are then tiny and OpenMP's start-up cost per operation dominates (and stalls when cores are shared).
#: Measured on 2 idle cores (AMGD, 60 steps): 18 000 elements (quick sizes) run equally fast on 1 or 2 threads,
#: 108 000 (standard) 1.2x and 230 000 (16 seeds) 1.35x faster on 2; the threshold was 10^6 before that measurement.
ONE_THREAD_BELOW = 100_000


def _one_thread_if_small(problem: LinRepProblem, batch_size: int | None):
    size = problem.n_seeds * (batch_size or problem.d) * problem.d
    return config.cpu_threads(1, when=size < ONE_THREAD_BELOW, device=problem.device)


def run(method: str, problem: LinRepProblem, n_steps: int, batch_size: int | None, hp: dict, *,
        init: LinRepState | None = None, record_every: int = 1,
        generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    r"""Iterate ``UPDATES[method]`` for ``n_steps`` steps, a fresh batch of ``batch_size`` samples per step (and a
    second independent one for ``'refit_independent'``); ``batch_size=None`` uses the population moments (the
    deterministic population map). All seeds advance in one tensor program.

    Returns traces of shape ``(S, T_rec)`` recorded at steps ``0, record_every, ...`` (and the last step):
    ``'subspace_distance'`` (:math:`\sin\psi_{\max}`), ``'train_loss'`` and ``'transfer_loss'`` (the excess
    population risks of :math:`G_t` with its best head, :func:`representation_loss`), ``'risk'`` (the excess
    population risk of the held pair, :func:`excess_risk`), ``'perp_norm2'`` (:math:`\lVert G_t\Pi_\perp\rVert_F^2`,
    the component the exact identity of chapter 10 contracts), ``'step'`` (the step indices), plus ``'final_F'``,
    ``'final_G'`` ``(S, ...)``.
    """
    n_steps, batch_size, record_every = _check_run(method, problem, n_steps, batch_size, hp, record_every)
    fn = UPDATES[method]
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    state = init if init is not None else init_state(problem, gen)
    if not isinstance(state, LinRepState):
        raise TypeError(f"init must be a LinRepState, got {type(state).__name__}")
    with _one_thread_if_small(problem, batch_size):
        return _iterate(fn, method, problem, n_steps, batch_size, hp, state, record_every, gen)


def _iterate(fn, method, problem, n_steps, batch_size, hp, state, record_every, gen) -> dict[str, torch.Tensor]:
    recs, steps = [_record(problem, state)], [0]
    for t, batch in enumerate(_batches(method, problem, n_steps, batch_size, hp, gen), start=1):
        state = fn(problem, state, batch, hp)
        if t % record_every == 0 or t == n_steps:
            recs.append(_record(problem, state))
            steps.append(t)
    out = {key: torch.stack([r[key] for r in recs], dim=-1) for key in recs[0]}
    out["step"] = torch.tensor(steps).expand(problem.n_seeds, -1)
    out["final_F"], out["final_G"] = state.F, state.G
    return out


def run_looped(method: str, problem: LinRepProblem, n_steps: int, batch_size: int | None, hp: dict, *,
               init: LinRepState | None = None, record_every: int = 1,
               generator: torch.Generator | None = None, generator_seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`run` seed by seed (a Python loop over ``S`` problems with ``S = 1``), for the benchmark. Each seed
    draws its own batches — from ``generator`` in turn when given, else from a generator on the problem's device
    seeded ``generator_seed + s`` — so the result is statistically, not bitwise, the same as :func:`run`'s."""
    generator_seed = check_int("generator_seed", generator_seed, min_value=0)
    _check_run(method, problem, n_steps, batch_size, hp, record_every)
    if init is not None and not isinstance(init, LinRepState):
        raise TypeError(f"init must be a LinRepState, got {type(init).__name__}")
    outs = []
    for s in range(problem.n_seeds):
        sub = problem.select(s)
        st = None if init is None else LinRepState(init.F[s:s + 1], init.G[s:s + 1], init.t, dict(init.extra))
        g = generator if generator is not None else torch.Generator(device=problem.device).manual_seed(generator_seed + s)
        outs.append(run(method, sub, n_steps, batch_size, hp, init=st, record_every=record_every, generator=g))
    return {key: torch.cat([o[key] for o in outs], dim=0) for key in outs[0]}


# ============================================================================================ noise floors (chapter 10)
def _floor_inputs(name: str, F, Gstar, Sigma, noise, n) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int]:
    F = as_tensor(name, F, dtype=torch.float64)
    Gstar = as_tensor("Gstar", Gstar, dtype=torch.float64)
    Sigma = as_tensor("Sigma", Sigma, dtype=torch.float64)
    if F.dim() < 2 or Gstar.dim() < 2 or Sigma.dim() < 2:
        raise ValueError(f"{name}, Gstar and Sigma must be matrices (optionally batched)")
    k, d = Gstar.shape[-2:]
    if F.shape[-1] != k:
        raise ValueError(f"{name} must have k = {k} columns (Gstar is {tuple(Gstar.shape[-2:])}), got {tuple(F.shape[-2:])}")
    if Sigma.shape[-2:] != (d, d):
        raise ValueError(f"Sigma must be {d} x {d} (d = Gstar's columns), got {tuple(Sigma.shape[-2:])}")
    noise = check_nonnegative("noise", noise)
    n = check_int("n", n, min_value=1)
    if n <= d + 1:
        raise ValueError(f"n must exceed d + 1 = {d + 1} (the mean of an inverse Wishart matrix), got {n}")
    return F, Gstar, Sigma, noise, n


def _floor(F, Gstar, Sigma, noise: float, n: int) -> torch.Tensor:
    d = Gstar.shape[-1]
    Pi = torch.eye(d, dtype=torch.float64) - Gstar.transpose(-2, -1) @ Gstar
    tr_F = torch.linalg.inv(F.transpose(-2, -1) @ F).diagonal(dim1=-2, dim2=-1).sum(-1)
    tr_S = (Pi @ torch.linalg.inv(Sigma)).diagonal(dim1=-2, dim2=-1).sum(-1)
    return noise**2 * tr_F * tr_S / (n - d - 1)


def floor_variance_fixed_head(F0, Gstar, Sigma, noise: float, n: int) -> torch.Tensor:
    r"""Per-step variance :math:`v` of K-FAC's forcing term with a fixed head :math:`F_0` (chapter 10,
    *The noise floor of K-FAC*): Gaussian inputs, :math:`\lambda_F = \lambda_G = 0`,

    .. math:: v = \frac{\sigma_\varepsilon^2\,\operatorname{tr}\big((F_0^\top F_0)^{-1}\big)\,
              \operatorname{tr}\big(\Pi_\perp\Sigma^{-1}\big)}{n-d-1},

    so that the stationary :math:`\mathbb{E}\lVert G_t\Pi_\perp\rVert_F^2 = \frac{\eta_G}{2-\eta_G}v`
    (:func:`noise_floor`). Exact for any :math:`\sigma_\varepsilon`. Batched over leading dimensions."""
    return _floor(*_floor_inputs("F0", F0, Gstar, Sigma, noise, n))


def floor_variance_refit_head(Fstar, Gstar, Sigma, noise: float, n: int) -> torch.Tensor:
    r"""Per-step variance :math:`v` of K-FAC's forcing term with the least-squares head re-fitted on each step's batch,
    in the tangent coordinates :math:`Z = (GG_\star^\top)^{-1}G\Pi_\perp` (:func:`tangent_norm2`; the singular values
    of :math:`Z` are the tangents of the principal angles), to leading order in :math:`\sigma_\varepsilon^2`
    (chapter 10, *The floor with a re-fitted head*):

    .. math:: v = \frac{\sigma_\varepsilon^2\,\operatorname{tr}\big((F_\star^\top F_\star)^{-1}\big)\,
              \operatorname{tr}\big(\Pi_\perp\Sigma^{-1}\big)}{n-d-1},

    the fixed-head formula with the true head :math:`F_\star` in place of :math:`F_0`; the stationary
    :math:`\mathbb{E}\lVert Z_t\rVert_F^2 = \frac{\eta_G}{2-\eta_G}v\,(1 + O(\sigma_\varepsilon^2))`."""
    return _floor(*_floor_inputs("Fstar", Fstar, Gstar, Sigma, noise, n))


def tangent_norm2(G, Gstar) -> torch.Tensor:
    r""":math:`\lVert Z\rVert_F^2` with :math:`Z = (GG_\star^\top)^{-1}G\Pi_\perp`: the sum of :math:`\tan^2` of the
    principal angles between :math:`\operatorname{rowsp}G` and :math:`\operatorname{rowsp}G_\star` (orthonormal rows),
    free of the scale and rotation :math:`GG_\star^\top` of the representation (chapter 10). Batched."""
    G = as_tensor("G", G, dtype=torch.float64)
    Gstar = as_tensor("Gstar", Gstar, dtype=torch.float64)
    if G.dim() < 2 or G.shape[-2:] != Gstar.shape[-2:]:
        raise ValueError(f"G must have Gstar's shape {tuple(Gstar.shape[-2:])} (k x d), got {tuple(G.shape)}")
    check_finite("G", G)
    check_finite("Gstar", Gstar)
    A = G @ Gstar.transpose(-2, -1)
    E = G - A @ Gstar
    sv = torch.linalg.svdvals(A)
    if bool((sv[..., -1] <= sv[..., :1].squeeze(-1).clamp_min(1.0) * G.shape[-1] * torch.finfo(A.dtype).eps).any()):
        raise ValueError("G G_star^T must be invertible: G's row space has a direction orthogonal to Gstar's "
                         "(a principal angle of 90 degrees, so the tangent is infinite), or G or Gstar is rank-deficient")
    return torch.linalg.solve(A, E).square().sum((-2, -1))


__all__ += ["floor_variance_fixed_head", "floor_variance_refit_head", "tangent_norm2"]


# ============================================================================================ finite-sample K-FAC (chapter 10)
def _check_rows_perp(name: str, Z: torch.Tensor, Gstar: torch.Tensor) -> None:
    leak = (Z @ Gstar.transpose(-2, -1)).abs().amax()
    if float(leak) > 1e3 * torch.finfo(Z.dtype).eps * max(1.0, float(Z.abs().amax())) * Z.shape[-1]:
        raise ValueError(f"{name} must have its rows in rowsp(Gstar)^perp ({name} Gstar^T = 0), got "
                         f"max |{name} Gstar^T| = {float(leak):.3g}")


def _check_orthonormal_rows(name: str, G: torch.Tensor) -> None:
    k = G.shape[-2]
    gram = G @ G.transpose(-2, -1)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    err = float((gram - eye).abs().amax()) if gram.numel() else 0.0
    if err > 1e-8 * max(k, 1):
        raise ValueError(f"{name} must have orthonormal rows ({name} {name}^T = I_k), as the book's G_star does; "
                         f"max |{name} {name}^T - I| = {err:.3g}")


def _check_unit(name: str, x: torch.Tensor) -> None:
    dev = float((x.norm(dim=-1) - 1).abs().amax()) if x.numel() else 0.0
    if dev > 1e-8:
        raise ValueError(f"{name} must be a unit vector (|{name}| = 1), got norms off by up to {dev:.3g}")


def _tangent_inputs(Z, Gstar, Sxx=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    Gstar = check_finite("Gstar", as_tensor("Gstar", Gstar, dtype=torch.float64))
    Z = check_finite("Z", as_tensor("Z", Z, dtype=torch.float64))
    if Gstar.dim() < 2 or Z.shape[-2:] != Gstar.shape[-2:]:
        raise ValueError(f"Z must have Gstar's shape {tuple(Gstar.shape[-2:])} (k x d), got {tuple(Z.shape)}")
    _check_orthonormal_rows("Gstar", Gstar)
    _check_rows_perp("Z", Z, Gstar)
    if Sxx is not None:
        Sxx = check_finite("Sxx", as_tensor("Sxx", Sxx, dtype=torch.float64))
        d = Gstar.shape[-1]
        if Sxx.dim() < 2 or Sxx.shape[-2:] != (d, d):
            raise ValueError(f"Sxx must be {d} x {d} (d = Gstar's columns), got {tuple(Sxx.shape)}")
        Sxx = check_psd("Sxx", Sxx, rtol=1e-5)             # a second-moment matrix: symmetric, PSD (float32 batches)
    return Z, Gstar, Sxx


def tangent(G, Gstar) -> torch.Tensor:
    r"""The tangent :math:`Z = (GG_\star^\top)^{-1}G\Pi_\perp` ``(..., k, d)`` of :math:`G = A(G_\star + Z)`, with
    :math:`A = GG_\star^\top`: its rows lie in :math:`\operatorname{rowsp}(G_\star)^\perp`, its singular values are the
    tangents of the principal angles, so :math:`\lVert Z\rVert_2 = \tan\psi_{\max}\ge\operatorname{dist}(G, G_\star)`
    (chapter 10, *One step at finite n*; :func:`tangent_norm2` is :math:`\lVert Z\rVert_F^2`). ``Gstar`` has
    orthonormal rows. Raises a ValueError when :math:`GG_\star^\top` is singular (an angle of 90 degrees)."""
    tangent_norm2(G, Gstar)                                    # validates, and refuses a singular G Gstar^T
    G = as_tensor("G", G, dtype=torch.float64)
    Gstar = as_tensor("Gstar", Gstar, dtype=torch.float64)
    A = G @ Gstar.transpose(-2, -1)
    return torch.linalg.solve(A, G - A @ Gstar)


def kfac_coupling(Sxx, Gstar, Z) -> torch.Tensor:
    r"""The batch coupling :math:`\hat{\mathcal C} = \Pi_\perp\hat\Sigma W^\top(G_\star\hat\Sigma W^\top)^{-1}` ``(..., d, k)``
    at the normalised representation :math:`W = G_\star + Z` (chapter 10, *One step at finite n*).

    At :math:`Z = 0` it is :math:`\Pi_\perp\hat\Sigma G_\star^\top(G_\star\hat\Sigma G_\star^\top)^{-1}`, the
    least-squares coefficient of the :math:`\perp` coordinates of :math:`x` on its :math:`\parallel` coordinates in
    the batch; it vanishes in the population exactly when :math:`\operatorname{rowsp}(G_\star)` is an invariant
    subspace of :math:`\Sigma`. ``Z`` ``(..., k, d)`` must have its rows in :math:`\operatorname{rowsp}(G_\star)^\perp`
    (:func:`tangent`)."""
    Z, Gstar, Sxx = _tangent_inputs(Z, Gstar, Sxx)
    W = Gstar + Z
    SW = Sxx @ W.transpose(-2, -1)                              # (..., d, k)
    M = Gstar @ SW
    if bool((torch.linalg.svdvals(M)[..., -1] <= torch.finfo(M.dtype).eps * M.abs().amax()).any()):
        raise ValueError("Gstar Sxx (Gstar + Z)^T must be invertible: Sxx is singular on rowsp(Gstar) or Z is "
                         "too far from 0 (the coupling is undefined there)")
    return torch.linalg.solve(M, SW - Gstar.transpose(-2, -1) @ M, left=False)   # X M = Pi_perp Sxx W^T


def kfac_forcing(Z, Gstar, Sxx, Syx) -> torch.Tensor:
    r"""The noise term :math:`P = H^+\hat W\Pi_\perp` ``(..., k, d)`` of one K-FAC step with the head re-fitted on
    the same batch (chapter 10, *One step at finite n*): :math:`\hat W = \hat\Sigma_{yx}\hat\Sigma^{-1}` is the
    batch's least-squares map :math:`F_\star G_\star + \Xi` and :math:`H` the least-squares head of the normalised
    representation :math:`W = G_\star + Z` on the batch. Zero without label noise; to first order in
    :math:`\sigma_\varepsilon` it is :math:`(I + Z\hat{\mathcal C})F_\star^+\Xi\Pi_\perp`."""
    Z, Gstar, Sxx = _tangent_inputs(Z, Gstar, Sxx)
    Syx = check_finite("Syx", as_tensor("Syx", Syx, dtype=torch.float64))
    if Syx.dim() < 2 or Syx.shape[-1] != Gstar.shape[-1]:
        raise ValueError(f"Syx must be (..., d_y, {Gstar.shape[-1]}), got {tuple(Syx.shape)}")
    W = Gstar + Z
    H = _head_from_moments(W, Sxx, Syx)
    W_hat = _right_solve(Syx, Sxx)
    P = torch.linalg.solve(H.transpose(-2, -1) @ H, H.transpose(-2, -1) @ W_hat)
    return P - (P @ Gstar.transpose(-2, -1)) @ Gstar


def kfac_tangent_step(Z, P, B, eta) -> torch.Tensor:
    r"""The exact tangent map of one K-FAC step (re-fitted head, :math:`\lambda_F=\lambda_G=0`; chapter 10):

    .. math:: Z_{+} = \big[I_k + \eta_G(Z - P)\hat{\mathcal C}\big]^{-1}\big[(1-\eta_G)Z + \eta_G P\big],

    with ``Z (..., k, d)`` the tangent (:func:`tangent`), ``P (..., k, d)`` the noise term (:func:`kfac_forcing`)
    and ``B (..., d, k)`` the coupling :math:`\hat{\mathcal C}` (:func:`kfac_coupling`). ``eta`` a number in (0, 1] or a per-row tensor."""
    Z = check_finite("Z", as_tensor("Z", Z, dtype=torch.float64))
    P = check_finite("P", as_tensor("P", P, dtype=torch.float64))
    B = check_finite("B", as_tensor("B", B, dtype=torch.float64))
    if Z.dim() < 2 or P.shape[-2:] != Z.shape[-2:] or B.shape[-2:] != Z.shape[-2:][::-1]:
        raise ValueError(f"Z and P must be (..., k, d) and B (..., d, k); got {tuple(Z.shape)}, {tuple(P.shape)}, "
                         f"{tuple(B.shape)}")
    eta = as_tensor("eta", eta, dtype=torch.float64)
    if bool(((eta <= 0) | (eta > 1)).any()):
        raise ValueError("eta must be in (0, 1]")
    eta = eta.reshape(*eta.shape, 1, 1) if eta.dim() else eta
    k = Z.shape[-2]
    return torch.linalg.solve(_eye(k, Z) + eta * ((Z - P) @ B), (1 - eta) * Z + eta * P)


def kfac_one_step_bound(tau, forcing, coupling, eta) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The one-step guarantee of chapter 10's one-step theorem (deterministic, given the batch): with :math:`\tau = \tan\psi_{\max}(G_t)`,
    :math:`p = \lVert P_t\rVert_2` (``forcing``) and :math:`b = \lVert\hat{\mathcal C}_t\rVert_2` (``coupling``), the locality
    :math:`\beta = (\tau + p)\,b`, and where :math:`\beta<1`

    .. math:: \tau_{t+1}\le\big(1-(1-\beta)\eta_G\big)\tau + \frac{\eta_G\,p}{1-\beta}.

    Returns ``(bound, beta)``, broadcast; the bound is ``inf`` where :math:`\beta\ge1` (no guarantee)."""
    tau, p, b = (as_tensor(nm, v, dtype=torch.float64) for nm, v in
                 (("tau", tau), ("forcing", forcing), ("coupling", coupling)))
    for nm, v in (("tau", tau), ("forcing", p), ("coupling", b)):
        check_finite(nm, v)
        if bool((v < 0).any()):
            raise ValueError(f"{nm} must be >= 0 (a norm)")
    eta = as_tensor("eta", eta, dtype=torch.float64)
    if bool(((eta <= 0) | (eta > 1)).any()):
        raise ValueError("eta must be in (0, 1]")
    beta = (tau + p) * b
    ok = beta < 1
    safe = torch.where(ok, beta, torch.zeros_like(beta))
    bound = (1 - (1 - safe) * eta) * tau + eta * p / (1 - safe)
    return torch.where(ok, bound, torch.full_like(bound, math.inf)), beta


def kfac_noise_bound(Fstar, Sigma, n: int, noise: float, delta: float) -> torch.Tensor:
    r"""The explicit high-probability size of K-FAC's first-order noise term (chapter 10): for Gaussian inputs,
    with probability at least :math:`1-\delta`,

    .. math:: \lVert F_\star^+\Xi\Pi_\perp\rVert_2\le N_\delta := \frac{\sigma_\varepsilon\big(\sqrt{d-k}+\sqrt k+
              \sqrt{2\log(2/\delta)}\big)}{\sigma_{\min}(F_\star)\sqrt{\lambda_{\min}(\Sigma)}\,
              \big(\sqrt n-\sqrt d-\sqrt{2\log(2/\delta)}\big)}

    (Chevet's inequality and Gaussian concentration given :math:`X`, Davidson–Szarek for :math:`\lambda_{\min}
    (X^\top X)`). ``Fstar (..., d_y, k)``, ``Sigma (..., d, d)``. Refuses ``n`` with :math:`\sqrt n\le\sqrt d+
    \sqrt{2\log(2/\delta)}` (the bound is vacuous there)."""
    Fstar = check_finite("Fstar", as_tensor("Fstar", Fstar, dtype=torch.float64))
    Sigma = check_finite("Sigma", as_tensor("Sigma", Sigma, dtype=torch.float64))
    if Fstar.dim() < 2 or Sigma.dim() < 2 or Sigma.shape[-1] != Sigma.shape[-2]:
        raise ValueError(f"Fstar must be (..., d_y, k) and Sigma (..., d, d), got {tuple(Fstar.shape)}, "
                         f"{tuple(Sigma.shape)}")
    Sigma = check_psd("Sigma", Sigma, strict=True, rtol=1e-6)  # a covariance: symmetric, positive definite
    k, d = Fstar.shape[-1], Sigma.shape[-1]
    if k > d:
        raise ValueError(f"Fstar's k = {k} columns must not exceed Sigma's d = {d}")
    n = check_int("n", n, min_value=1)
    noise = check_nonnegative("noise", noise)
    delta = check_positive("delta", delta)
    if delta >= 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    t = math.sqrt(2 * math.log(2 / delta))
    if math.sqrt(n) <= math.sqrt(d) + t:
        raise ValueError(f"n must satisfy sqrt(n) > sqrt(d) + sqrt(2 log(2/delta)) = {math.sqrt(d) + t:.3g} "
                         f"(d = {d}, delta = {delta}), got n = {n}: the bound is vacuous")
    if Fstar.shape[-2] < k:
        raise ValueError(f"Fstar must have d_y >= k rows (full column rank), got shape {tuple(Fstar.shape)}")
    s_min = torch.linalg.svdvals(Fstar)[..., -1]
    if bool((s_min <= 1e-12 * torch.linalg.svdvals(Fstar)[..., 0]).any()):
        raise ValueError("Fstar must have full column rank (sigma_min(Fstar) > 0): the bound divides by it")
    l_min = torch.linalg.eigvalsh(Sigma)[..., 0]
    return noise * (math.sqrt(d - k) + math.sqrt(k) + t) / (s_min * l_min.sqrt() * (math.sqrt(n) - math.sqrt(d) - t))


def fitted_exponent(x, samples) -> tuple[float, float, float]:
    r"""Log-log exponent of a power law :math:`\mathbb{E}[y]\propto x^a` from replicates (chapter 10).

    ``x (m,)`` positive, ``samples (R, m)`` positive replicate values at each ``x``. Weighted least squares of
    :math:`\log\bar y` on :math:`\log x` with weights from the delta-method standard errors
    :math:`\mathrm{se}(\bar y)/\bar y`. Returns ``(a, se, drift)``: the exponent, its standard error, and
    :math:`|a_{\text{lower half}} - a_{\text{upper half}}|` over the two halves of the ``x`` range (overlapping in
    the middle point when ``m`` is odd), which measures curvature — how far the data are from one power law."""
    x = as_tensor("x", x, dtype=torch.float64).reshape(-1)
    Y = as_tensor("samples", samples, dtype=torch.float64)
    if Y.dim() != 2 or Y.shape[1] != x.numel() or Y.shape[0] < 2:
        raise ValueError(f"samples must be (R >= 2, m = {x.numel()}), got {tuple(Y.shape)}")
    if x.numel() < 4:
        raise ValueError(f"x must have at least 4 points (two halves of 2), got {x.numel()}")
    check_finite("x", x)
    check_finite("samples", Y)
    if bool((x <= 0).any()) or bool((Y.mean(0) <= 0).any()):
        raise ValueError("x and the mean of samples must be > 0 for a log-log fit")
    lx, ly = x.log(), Y.mean(0).log()
    w = (Y.mean(0) / (Y.std(0, unbiased=True) / math.sqrt(Y.shape[0])).clamp_min(1e-300)).square()

    def fit(idx):
        xm = (w[idx] * lx[idx]).sum() / w[idx].sum()
        sxx = (w[idx] * (lx[idx] - xm).square()).sum()
        slope = (w[idx] * (lx[idx] - xm) * ly[idx]).sum() / sxx
        return float(slope), float(sxx.rsqrt())

    m = x.numel()
    a, se = fit(torch.arange(m))
    lo, _ = fit(torch.arange(0, (m + 1) // 2))
    hi, _ = fit(torch.arange(m // 2, m))
    return a, se, abs(lo - hi)


__all__ += ["tangent", "kfac_coupling", "kfac_forcing", "kfac_tangent_step", "kfac_one_step_bound",
            "kfac_noise_bound", "fitted_exponent"]


def replicas(problem: LinRepProblem, n_replicas: int, *, noise: float | None = None) -> LinRepProblem:
    r"""``n_replicas`` copies of a one-instance problem (``S = 1``) as one problem with ``S = n_replicas``, so that
    :meth:`LinRepProblem.sample_moments` draws that many independent batches of the *same* instance in one tensor
    call (chapter 10's batch-to-batch statistics). ``noise`` replaces :math:`\sigma_\varepsilon` (training and
    transfer) when given."""
    if not isinstance(problem, LinRepProblem):
        raise TypeError(f"problem must be a LinRepProblem, got {type(problem).__name__}")
    if problem.n_seeds != 1:
        raise ValueError(f"problem must hold one instance (S = 1; use problem.select(s)), got S = {problem.n_seeds}")
    R = check_int("n_replicas", n_replicas, min_value=1)
    sig = problem.noise if noise is None else check_nonnegative("noise", noise)
    sig_T = problem.noise_T if noise is None else sig
    ex = lambda t: t.expand(R, *t.shape[1:]).contiguous()  # noqa: E731
    return replace(problem, Fstar=ex(problem.Fstar), Gstar=ex(problem.Gstar), Sigma=ex(problem.Sigma),
                   Sigma_half=ex(problem.Sigma_half), Fstar_T=ex(problem.Fstar_T), Sigma_T=ex(problem.Sigma_T),
                   Sigma_T_half=ex(problem.Sigma_T_half), noise=float(sig), noise_T=float(sig_T))


__all__ += ["replicas"]


def kfac_ratio_spread(Sigma, Gstar, u, v, s, eta, n: int) -> torch.Tensor:
    r"""Predicted batch-to-batch standard deviation of noiseless K-FAC's one-step ratio
    :math:`\tau_{t+1}/\tau_t = (1-\eta_G)/\lvert1+\eta_G s\,v^\top\hat{\mathcal C}u\rvert` at a rank-one tangent
    :math:`Z = s\,uv^\top` (chapter 10), for Gaussian inputs, to first order in :math:`s` and in the batch fluctuation:

    .. math:: \operatorname{sd} = \frac{(1-\eta_G)\,\eta_G\lvert s\rvert}{(1+\eta_G s\,b)^2}
              \sqrt{\frac{(v^\top S v)\,(u^\top\Sigma_{\parallel\parallel}^{-1}u)}{n-k-1}},

    with :math:`b = v^\top\mathcal C u` the population coupling at :math:`Z = 0`, :math:`S = (\Pi_\perp\Sigma^{-1}
    \Pi_\perp)^+` the Schur complement (as a :math:`d\times d` matrix on :math:`\operatorname{rowsp}(G_\star)^\perp`)
    and :math:`\Sigma_{\parallel\parallel} = G_\star\Sigma G_\star^\top`: the batch regression coefficient
    :math:`v^\top\hat{\mathcal C} u` of the :math:`\perp` coordinates on the :math:`\parallel` ones has conditional variance
    :math:`(v^\top Sv)\,u^\top(X_\parallel^\top X_\parallel)^{-1}u`, whose mean is the above (inverse Wishart).
    ``u (..., k)`` and ``v (..., d)`` unit vectors, ``v`` in :math:`\operatorname{rowsp}(G_\star)^\perp`.; ``n`` an integer or
    a tensor of them (broadcast)."""
    Sigma = check_psd("Sigma", Sigma, strict=True, rtol=1e-6, dtype=torch.float64)  # a covariance: symmetric, positive definite
    Gstar = check_matrix("Gstar", Gstar, batch=True, dtype=torch.float64)
    u = check_finite("u", as_tensor("u", u, dtype=torch.float64))
    v = check_finite("v", as_tensor("v", v, dtype=torch.float64))
    if u.dim() < 1 or v.dim() < 1:
        raise ValueError(f"u and v must be vectors (..., k) and (..., d), got shapes {tuple(u.shape)}, {tuple(v.shape)}")
    k, d = Gstar.shape[-2:]
    if Sigma.shape[-2:] != (d, d) or u.shape[-1] != k or v.shape[-1] != d:
        raise ValueError(f"Sigma must be ({d}, {d}), u (..., {k}) and v (..., {d}); got {tuple(Sigma.shape)}, "
                         f"{tuple(u.shape)}, {tuple(v.shape)}")
    n = as_tensor("n", n, dtype=torch.float64)
    if bool((n < k + 2).any()) or bool((n != n.round()).any()):
        raise ValueError(f"n must be whole numbers >= k + 2 = {k + 2} (the inverse-Wishart mean), got {n.tolist()}")
    eta = check_positive("eta", eta)
    if eta > 1:
        raise ValueError(f"eta must be in (0, 1], got {eta}")
    s = check_finite("s", as_tensor("s", s, dtype=torch.float64))
    _check_orthonormal_rows("Gstar", Gstar)
    _check_unit("u", u)
    _check_unit("v", v)
    Pi = _eye(d, Gstar) - Gstar.transpose(-2, -1) @ Gstar
    _check_rows_perp("v", v[..., None, :], Gstar)
    S = torch.linalg.pinv(Pi @ torch.linalg.inv(Sigma) @ Pi, hermitian=True)
    S_par = Gstar @ Sigma @ Gstar.transpose(-2, -1)
    B = kfac_coupling(Sigma, Gstar, torch.zeros_like(Gstar))
    b = (v[..., None, :] @ B @ u[..., :, None])[..., 0, 0]
    vSv = (v[..., None, :] @ S @ v[..., :, None])[..., 0, 0]
    uSu = (u[..., None, :] @ torch.linalg.solve(S_par, u[..., :, None]))[..., 0, 0]
    return (1 - eta) * eta * s.abs() / (1 + eta * s * b).square() * (vSv * uSu / (n - k - 1)).sqrt()


__all__ += ["kfac_ratio_spread"]


def canonical_direction(Sigma, Gstar) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The top canonical pair between the :math:`\parallel` coordinates :math:`G_\star x` and the :math:`\perp`
    coordinates of :math:`x` (chapter 10): the rank-one tangent direction :math:`uv^\top` of largest *correlation*.
    It is **not** the direction along which noiseless K-FAC contracts slowest at a fixed :math:`\tan\psi`: that is
    the top singular pair of the coupling, :func:`coupling_direction` (the per-step ratio is
    :math:`(1-\eta_G)/\lvert1+\eta_G s\,v^\top\mathcal C u\rvert` at :math:`Z = s\,uv^\top`, largest when
    :math:`\lvert v^\top\mathcal C u\rvert = \sigma_{\max}(\mathcal C)`). Returns ``(u (..., k), v (..., d), rho (...))``, unit vectors with
    ``v`` in :math:`\operatorname{rowsp}(G_\star)^\perp`, :math:`u\propto\Sigma_{\parallel\parallel}w` for the
    canonical weight :math:`w`, and the top canonical correlation :math:`\rho\le(\kappa(\Sigma)-1)/(\kappa(\Sigma)+1)`
    (Wielandt), so that :math:`v^\top\mathcal C u>0` for the population coupling :math:`\mathcal C` (:func:`kfac_coupling`
    at :math:`Z = 0`)."""
    Sigma = check_psd("Sigma", Sigma, strict=True, dtype=torch.float64)
    Gstar = check_matrix("Gstar", Gstar, batch=True, dtype=torch.float64)
    k, d = Gstar.shape[-2:]
    if Sigma.shape[-2:] != (d, d):
        raise ValueError(f"Sigma must be ({d}, {d}) for Gstar of shape {tuple(Gstar.shape)}, got {tuple(Sigma.shape)}")
    if k >= d:
        raise ValueError(f"Gstar must have k < d rows (rowsp(Gstar)^perp is empty otherwise), got shape {tuple(Gstar.shape)}")
    _check_orthonormal_rows("Gstar", Gstar)
    _, U = schur_complement(Gstar, Sigma)                            # (..., d - k, d), orthonormal rows
    def inv_sqrt(A):
        e, V = torch.linalg.eigh(A)
        return (V / e.sqrt().unsqueeze(-2)) @ V.transpose(-2, -1)
    S_pp, S_pa = U @ Sigma @ U.transpose(-2, -1), U @ Sigma @ Gstar.transpose(-2, -1)
    M = Gstar @ Sigma @ Gstar.transpose(-2, -1)
    Ip, Im = inv_sqrt(S_pp), inv_sqrt(M)
    P, rho, Qh = torch.linalg.svd(Ip @ S_pa @ Im)
    v = (U.transpose(-2, -1) @ (Ip @ P[..., :, :1]))[..., 0]
    u = (M @ Im @ Qh[..., :1, :].transpose(-2, -1))[..., 0]
    v, u = v / v.norm(dim=-1, keepdim=True), u / u.norm(dim=-1, keepdim=True)
    sign = torch.sign((v[..., None, :] @ kfac_coupling(Sigma, Gstar, torch.zeros_like(Gstar)) @ u[..., :, None])[..., 0, 0])
    return u * sign[..., None], v, rho[..., 0]


__all__ += ["canonical_direction"]


def coupling_direction(Sigma, Gstar) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The rank-one tangent direction along which noiseless K-FAC contracts slowest per step at a fixed
    :math:`\tan\psi` (chapter 10): the top singular pair of the population coupling :math:`\mathcal C`
    (:func:`kfac_coupling` at :math:`Z = 0`, a :math:`d\times k` matrix). To first order in :math:`s`, the step from
    :math:`Z = s\,uv^\top` (unit :math:`u\in\mathbb R^k`, unit :math:`v\perp\operatorname{rowsp}G_\star`,
    :math:`\tan\psi = \lvert s\rvert`) has ratio :math:`(1-\eta_G)/\lvert1+\eta_G s\,v^\top\mathcal C u\rvert`,
    and :math:`\max_{u,v}\lvert v^\top\mathcal C u\rvert = \sigma_{\max}(\mathcal C)`, attained at the top
    singular pair (with :math:`s<0`). Returns ``(u (..., k), v (..., d), sigma (...))``, unit vectors signed so that
    :math:`v^\top\mathcal C u = \sigma_{\max}(\mathcal C) > 0`; ``v`` lies in :math:`\operatorname{rowsp}(G_\star)^\perp`
    (the columns of :math:`\mathcal C` do). Compare :func:`canonical_direction`, the direction of largest correlation."""
    Sigma = check_psd("Sigma", Sigma, strict=True, rtol=1e-6, dtype=torch.float64)
    Gstar = check_matrix("Gstar", Gstar, batch=True, dtype=torch.float64)
    k, d = Gstar.shape[-2:]
    if Sigma.shape[-2:] != (d, d):
        raise ValueError(f"Sigma must be ({d}, {d}) for Gstar of shape {tuple(Gstar.shape)}, got {tuple(Sigma.shape)}")
    if k >= d:
        raise ValueError(f"Gstar must have k < d rows (rowsp(Gstar)^perp is empty otherwise), got shape {tuple(Gstar.shape)}")
    C = kfac_coupling(Sigma, Gstar, torch.zeros_like(Gstar))       # (..., d, k); validates Gstar
    U, sv, Vh = torch.linalg.svd(C, full_matrices=False)
    return Vh[..., 0, :], U[..., :, 0], sv[..., 0]                  # v^T C u = U[:, 0]^T C Vh[0] = sigma_max > 0


__all__ += ["coupling_direction"]
