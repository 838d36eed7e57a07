r"""Part II — Gauss–Newton in the mean-field regime (chapters ``20_meanfield_gn_flows``,
``21_meanfield_hidden_learning``, ``22_meanfield_real_data``).

The model is the two-layer network with the **mean-field** output scaling (paper 2, Arbel, Menegaux & Wolinski 2023,
in the book's symbols; the notation page has the translation table):

.. math::

    f_\theta(x) = \frac1m \sum_{i=1}^m v_i\, \phi(w_i^\top x + b_i),
    \qquad \theta = (v, \operatorname{vec}(W), b),\quad W\in\R^{m\times d}\ \text{(row } i\text{ is } w_i^\top),

with :math:`\phi` = ReLU or SiLU, the loss :math:`\Loss = \frac1{2n}\lVert r\rVert^2`, :math:`r = f_\theta(X) - Y`,
and, for the real-data chapter, a vector output :math:`f_\theta(x) = V\phi(Wx+b)/m` with :math:`V\in\R^{d_y\times m}`
(``v`` then has shape ``(d_y, m)``; the residual is flattened row-major, sample-major, ``r = vec(f(X) - Y)``).

**Fast path: the kernel and** :math:`J^\top z` **from the network's structure.** With
:math:`Z = XW^\top + \mathbf 1 b^\top`, :math:`\Phi = \phi(Z)` and :math:`\Phi' = \phi'(Z)` (all :math:`n\times m`),
the Jacobian blocks are (chapter 20)

.. math::

    J_v = \Phi/m, \qquad (J_W)_{k,(i,j)} = v_i\phi'(z_{ki})\,x_{kj}/m, \qquad (J_b)_{k,i} = v_i\phi'(z_{ki})/m,

so with :math:`A = \Phi'\operatorname{diag}(v)/m` the kernel :math:`K = JJ^\top` is

.. math::

    K = \frac{\Phi\Phi^\top}{m^2} + (XX^\top + \mathbf 1\mathbf 1^\top)\odot(AA^\top)
      = \frac{K_\phi}{m} + (XX^\top + \mathbf 1\mathbf 1^\top)\odot(AA^\top),

two :math:`n\times m\times n` products, and :math:`J^\top z = \big(\Phi^\top z/m,\ (A^\top\!\operatorname{diag}(z))X,
\ A^\top z\big)`: :math:`O(nmd)`. :math:`J` (:math:`n\times p`, :math:`p=m(d+2)`) is never formed
(:func:`ntk`, :func:`jt_vec`); the tests compare both with the dense ``torch.func`` Jacobian of
:mod:`curvlab.curvature`. Gram matrices are accumulated in float64 whatever the parameters' dtype (as the authors'
code does). Every function accepts a leading batch dimension (seeds) on the parameters and the data.

**Steps** (chapter 20). Gradient descent :math:`\theta\leftarrow\theta-\eta\nabla\Loss`, :math:`\nabla\Loss=J^\top r/n`
(the paper's step ``lr`` is :math:`\eta`). Gauss–Newton in kernel form,
:math:`\theta\leftarrow\theta-\eta\,\Delta_{\mathrm{GN}}`, :math:`\Delta_{\mathrm{GN}}=J^\top(K+\lamGN I)^{-1}r`, with
the book's normalised step :math:`\eta=\texttt{lr}/n` (the paper's ``lr``; :math:`\eta=1,\lamGN=0` is the full GN
step) and :class:`Damping` constant, relative (:math:`\lamGN=c\,\lmax(K)`) or adaptive
(:math:`\lamGN=\max(\text{floor},\lmin(K))`, the authors' rule with floor :math:`10^{-7}`).
**Function-space time** :math:`t_{\mathrm f}=\texttt{lr}\cdot t/n` after :math:`t` steps, for both methods (for GN it
is :math:`\eta t`), is recorded with every curve.

**Metrics** (chapter 21): train/test loss, Test-LRFit (:func:`refit_output`: minimum-norm least squares for the output
layer on frozen features, the code's cut-off :math:`10^{-10}` on the Gram eigenvalues), random features
(:func:`random_features`), WCD (:func:`wcd`), distance from initialisation, spectrum of :math:`K`.

**Theory helpers** (chapter 20): :func:`mode_contraction`, :func:`steps_bracket` (steps to a loss tolerance from the
spectrum, and the precondition under which it is asserted), :func:`gd_divergence_lr`; for Proposition 1 (global
convergence of the damped GN flow) :func:`flow_rate`, :func:`flow_radius`, the flow itself (:func:`gn_flow`, RK4),
:func:`slowest_mode_targets` (its worst case), :func:`fit_rate` and :func:`ball_lambda_min` (a probe of its hypothesis on
the ball); the authors' SVD solve
(:func:`svd_gn_direction`, whose sign flip chapter 20 measures with :func:`svd_step_difference`).

**Data** (chapters 21, 22): :func:`teacher_student` (the authors' defaults: :math:`d=10`, teacher width 5,
:math:`n=500`, :math:`10\,000` test points), :func:`load_digits_data` (scikit-learn's digits, offline), and a real
MNIST IDX reader (:func:`read_idx`, :func:`load_mnist`) used when the files are present.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from ._validate import as_tensor, check_choice, check_finite, check_int, check_nonnegative, check_positive

__all__ = [
    "ACTIVATIONS",
    "GRIDS",
    "MNIST_TABLE",
    "MNIST_ENV",
    "MFParams",
    "Damping",
    "Data",
    "activation",
    "init_student",
    "teacher_student",
    "forward",
    "features",
    "loss",
    "flatten",
    "unflatten",
    "model_fn",
    "ntk",
    "feature_gram",
    "jt_vec",
    "gradient",
    "gn_direction",
    "GNDirection",
    "gd_step",
    "gn_step",
    "train",
    "Run",
    "refit_output",
    "random_features",
    "test_lrfit",
    "wcd",
    "distance_from_init",
    "fs_time",
    "mode_contraction",
    "steps_bracket",
    "loss_envelope",
    "at_step",
    "first_crossing",
    "rank_correlation",
    "richardson",
    "StepsBracket",
    "gd_divergence_lr",
    "flow_rate",
    "flow_radius",
    "ball_lambda_min",
    "slowest_mode_targets",
    "gn_flow",
    "Flow",
    "fit_rate",
    "svd_gn_direction",
    "svd_step_difference",
    "read_idx",
    "write_idx",
    "load_mnist",
    "mnist_available",
    "load_digits_data",
]

ACTIVATIONS = ("relu", "silu")
MNIST_ENV = "CURVLAB_MNIST_DIR"

#: The configuration of chapters 21 and 22, fixed in the library before their first run (the committed config).
#: Step sizes are the paper's ``lr`` at the paper's n = 500: GN's book step is eta = lr/500 at every n (the paper's
#: per-step contraction), GD's is eta = lr. ``cap_gn``/``cap_gd`` are the paper's iteration caps (review
#: discussion); the book replaces a cap by the function-space time it buys, t_f = lr * cap / 500.
GRIDS: dict[str, Any] = {
    "teacher_student": {
        "d": 10, "m_teacher": 5, "n": 500, "n_test": 10_000,           # the authors' defaults
        "activations": ("relu", "silu"),                                 # main text vs code default
        "init_std": (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 100.0),           # the authors' Figure-2 grid
        "small_std": 0.01,                                               # feature-learning end of the grid
        "lr_paper": (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0),       # GN and GD, from 1e-3 upward
        "lr_ref": 10.0,                                                  # the authors' default (Figure-2 sweep)
        "n_paper": 500,
        "cap_gn": 150_000, "cap_gd": 1_000_000,                          # the paper's caps
        "rel_tol": 1e-8,                                                 # the authors' stopping rule
        "floor": 1e-7,                                                   # the authors' damping floor
        "floor_variants": ("floor 1e-7", "floor 1e-10", "relative 1e-7", "undamped"),
        "eta_flow": 0.02,          # the paper's default GN step; whether it is the flow is checked (chapter 21)
        "eta_check": (0.02, 0.005, 0.002),  # Richardson triple of the flow-limit check (quick: 0.02, 0.01, 0.005)
        "flow_rel_error": 0.1,     # "in the flow limit": Richardson error below 10 % of the extrapolated flow value
        "check_fs_time": 1.0,      # function-space time of the flow-limit check
        "eta_large": (0.2, 2.0),   # the paper's lr = 100, 1000 at n = 500
        "match_fs_time": 4.0,      # matched function-space time for the step-size comparison
        "match_rel_loss": 1e-3,    # matched training loss (relative) for the step-size comparison
        "wcd_threshold_rho": 0.5,  # "WCD is a good proxy": Spearman rho with Test-LRFit above this
    },
    "digits": {
        "init_std": 1e-3,                                                # the review table's protocol
        "lr_paper": (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0),
        "cap": 100_000,                                                  # the review table's iterations
        "train_loss_stop": 1e-6,
        "floor": 1e-7,
    },
}

#: The MNIST table of paper 2's review discussion (the authors' rebuttal), with one hidden layer, squared loss on the
#: logits, initial std 1e-3, 100 000 iterations or train loss < 1e-6. ``None`` marks a diverged run ("div").
MNIST_TABLE = pd.DataFrame({
    "lr": [1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0] * 2,
    "method": ["GN"] * 7 + ["GD"] * 7,
    "train_loss": [330.0, 96.0, 15.5, 1e-6, 1e-6, 1e-6, 1e-6, 200.6, 61.5, 1e-6, 1e-6, 1e-6, None, None],
    "test_lrfit": [52.4, 53.2, 54.4, 56.0, 56.0, 55.1, 60.9, 165.4, 88.2, 64.6, 64.3, 59.1, None, None],
    "test_loss": [337.14, 134.11, 66.9, 56.5, 56.4, 55.6, 60.9, 208.9, 88.3, 64.8, 64.4, 59.2, None, None],
})

_GRAM_DTYPE = torch.float64


# ============================================================================================ parameters
class MFParams(NamedTuple):
    r"""Parameters :math:`\theta=(v,W,b)` of the mean-field network, each with an optional leading batch (seed) shape.

    ``v``: ``(..., m)`` (scalar output) or ``(..., d_y, m)`` (vector output, the rows of :math:`V`);
    ``W``: ``(..., m, d)`` (row :math:`i` is :math:`w_i^\top`); ``b``: ``(..., m)``.
    """

    v: torch.Tensor
    W: torch.Tensor
    b: torch.Tensor

    @property
    def m(self) -> int:
        return int(self.W.shape[-2])

    @property
    def d(self) -> int:
        return int(self.W.shape[-1])

    @property
    def vector_output(self) -> bool:
        return self.v.dim() == self.W.dim()

    @property
    def d_y(self) -> int:
        return int(self.v.shape[-2]) if self.vector_output else 1

    @property
    def batch_shape(self) -> torch.Size:
        return self.W.shape[:-2]

    def map(self, fn) -> MFParams:
        """Apply ``fn`` to each tensor."""
        return MFParams(fn(self.v), fn(self.W), fn(self.b))

    def axpy(self, alpha, other: MFParams) -> MFParams:
        r"""``self + alpha * other``; ``alpha`` a number or a tensor of the batch shape (one value per seed)."""
        if isinstance(alpha, torch.Tensor) and alpha.dim() > 0:
            a1 = alpha.reshape(*alpha.shape, 1)
            a2 = alpha.reshape(*alpha.shape, 1, 1)
            av = a2 if self.vector_output else a1
            return MFParams(self.v + av * other.v, self.W + a2 * other.W, self.b + a1 * other.b)
        return MFParams(self.v + alpha * other.v, self.W + alpha * other.W, self.b + alpha * other.b)

    def select(self, mask: torch.Tensor, other: MFParams) -> MFParams:
        """Per batch entry: ``self`` where ``mask`` is true, ``other`` elsewhere (``mask`` has the batch shape)."""
        m1 = mask.reshape(*mask.shape, 1)
        m2 = mask.reshape(*mask.shape, 1, 1)
        mv = m2 if self.vector_output else m1
        return MFParams(torch.where(mv, self.v, other.v), torch.where(m2, self.W, other.W),
                        torch.where(m1, self.b, other.b))


def _check_params(params: Any, name: str = "params") -> MFParams:
    if not isinstance(params, MFParams):
        raise TypeError(f"{name} must be a curvlab.meanfield.MFParams(v, W, b), got {type(params).__name__}")
    v, W, b = params
    for key, t in (("v", v), ("W", W), ("b", b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}.{key} must be a floating torch.Tensor, got {type(t).__name__}")
    if W.dim() < 2:
        raise ValueError(f"{name}.W must have shape (..., m, d), got {tuple(W.shape)}")
    batch, (m, _) = W.shape[:-2], W.shape[-2:]
    if b.shape != (*batch, m):
        raise ValueError(f"{name}.b must have shape {(*batch, m)} to match W {tuple(W.shape)}, got {tuple(b.shape)}")
    if v.shape != (*batch, m) and not (v.dim() == W.dim() and v.shape[:-2] == batch and v.shape[-1] == m):
        raise ValueError(f"{name}.v must have shape {(*batch, m)} (scalar output) or {(*batch, 'd_y', m)} "
                         f"(vector output), got {tuple(v.shape)}")
    if not (v.dtype == W.dtype == b.dtype) or not (v.device == W.device == b.device):
        raise ValueError(f"{name}.v, {name}.W and {name}.b must share one dtype and device")
    for key, t in (("v", v), ("W", W), ("b", b)):
        check_finite(f"{name}.{key}", t)
    return params


def _check_X(X: Any, params: MFParams, name: str = "X") -> torch.Tensor:
    X = check_finite(name, as_tensor(name, X, dtype=params.W.dtype, device=params.W.device))
    if X.dim() < 2 or X.shape[-1] != params.d:
        raise ValueError(f"{name} must have shape (..., n, d) with d = {params.d}, got {tuple(X.shape)}")
    if X.shape[-2] == 0:
        raise ValueError(f"{name} must hold at least one sample")
    return X


def _f64(name: str, value: Any) -> torch.Tensor:
    """A finite float64 tensor; Python and NumPy numbers are converted directly (``as_tensor`` would round them
    through the default float32 first)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        value = torch.tensor(float(value), dtype=torch.float64)
    elif isinstance(value, (list, tuple, np.ndarray)):
        value = torch.as_tensor(np.asarray(value, dtype=np.float64))
    return check_finite(name, as_tensor(name, value, dtype=torch.float64))


def _check_act(act: Any) -> str:
    return check_choice("act", act, ACTIVATIONS)


def activation(act: str):
    r"""``(phi, dphi)`` for ``act`` in ``ACTIVATIONS``: ReLU (:math:`\phi'(0)=0`, torch's convention) or SiLU
    :math:`\phi(z)=z\,s(z)`, :math:`\phi'(z)=s(z)\,(1+z(1-s(z)))` with :math:`s` the logistic function."""
    act = _check_act(act)
    if act == "relu":
        return torch.relu, lambda z: (z > 0).to(z.dtype)

    def dsilu(z: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))

    return torch.nn.functional.silu, dsilu


# ============================================================================================ initialisation, data
def _generator(seed: int) -> torch.Generator:
    seed = check_int("seed", seed, min_value=0)
    return torch.Generator().manual_seed(seed)


def init_student(m: int, d: int, *, init_std: float | Sequence[float], seeds: Sequence[int] = (0,),
                 v0_zero: bool = True, d_y: int | None = None, dtype: torch.dtype = torch.float64,
                 device=None) -> MFParams:
    r"""Student initialisation of the authors' code, one per seed (leading batch dimension ``len(seeds)``).

    :math:`w_i, b_i \sim \Normal(0, \sigma_0^2)` i.i.d. (``init_std`` :math:`=\sigma_0`, a number or one value per
    seed: a batch can sweep :math:`\sigma_0`); then :math:`v=0` when ``v0_zero`` (the code's ``init_net_last_zero``),
    else :math:`v_i\sim\Normal(0,\sigma_0^2)`. ``d_y`` given: vector output, ``v`` of shape ``(d_y, m)``. The same
    seed gives the same standard-normal draws at every :math:`\sigma_0` (they are scaled).
    """
    m, d = check_int("m", m, min_value=1), check_int("d", d, min_value=1)
    if isinstance(seeds, (int, np.integer)) or not isinstance(seeds, Sequence) or len(seeds) == 0:
        raise TypeError("seeds must be a non-empty sequence of integers (one student per seed)")
    if isinstance(init_std, Sequence):
        if len(init_std) != len(seeds):
            raise ValueError(f"init_std must be a number or have one value per seed ({len(seeds)}), "
                             f"got {len(init_std)}")
        stds = [check_positive("init_std", s) for s in init_std]
    else:
        stds = [check_positive("init_std", init_std)] * len(seeds)
    if d_y is not None:
        d_y = check_int("d_y", d_y, min_value=1)
    vs, Ws, bs = [], [], []
    for s, std in zip(seeds, stds):
        g = _generator(10_007 * int(s) + 1)
        W = std * torch.randn(m, d, generator=g, dtype=torch.float64)
        b = std * torch.randn(m, generator=g, dtype=torch.float64)
        vshape = (m,) if d_y is None else (d_y, m)
        v = torch.zeros(vshape, dtype=torch.float64) if v0_zero else std * torch.randn(vshape, generator=g,
                                                                                       dtype=torch.float64)
        vs.append(v), Ws.append(W), bs.append(b)
    return MFParams(torch.stack(vs), torch.stack(Ws), torch.stack(bs)).map(lambda t: t.to(dtype=dtype, device=device))


@dataclass(frozen=True)
class Data:
    """Training and test data, batched over seeds: ``X (S, n, d)``, ``Y (S, n[, d_y])``, ``X_test``, ``Y_test``;
    ``teacher`` holds the teacher's parameters (teacher–student data) or ``None``."""

    X: torch.Tensor
    Y: torch.Tensor
    X_test: torch.Tensor
    Y_test: torch.Tensor
    act: str
    teacher: MFParams | None = None

    @property
    def n(self) -> int:
        return int(self.X.shape[-2])

    def to(self, dtype=None, device=None) -> Data:
        conv = lambda t: t.to(dtype=dtype or t.dtype, device=device)
        return Data(conv(self.X), conv(self.Y), conv(self.X_test), conv(self.Y_test), self.act,
                    None if self.teacher is None else self.teacher.map(conv))


def teacher_student(seeds: Sequence[int] = (0,), *, act: str = "relu", d: int = 10, m_teacher: int = 5,
                    n: int = 500, n_test: int = 10_000, dtype: torch.dtype = torch.float64, device=None) -> Data:
    r"""Teacher–student data of the authors' code (defaults: :math:`d=10`, :math:`m_\star=5`, :math:`n=500`,
    :math:`n_{\mathrm{test}}=10\,000`), one data set per seed.

    Teacher: every parameter :math:`\Normal(0,1)` (output weights and biases included), the same mean-field
    network :math:`y=\frac1{m_\star}\sum_j v_{\star j}\phi(w_{\star j}^\top x+b_{\star j})`, noiseless;
    :math:`x\sim\Normal(0,I_d)`. As in the code, :math:`\max(n, 2000)` training inputs are drawn and the first
    :math:`n` kept, so training sets are nested in :math:`n`.
    """
    act = _check_act(act)
    d, m_teacher = check_int("d", d, min_value=1), check_int("m_teacher", m_teacher, min_value=1)
    n, n_test = check_int("n", n, min_value=1), check_int("n_test", n_test, min_value=1)
    if isinstance(seeds, (int, np.integer)) or not isinstance(seeds, Sequence) or len(seeds) == 0:
        raise TypeError("seeds must be a non-empty sequence of integers")
    Xs, Xts, teachers = [], [], []
    for s in seeds:
        g = _generator(int(s))
        teachers.append(MFParams(torch.randn(m_teacher, generator=g, dtype=torch.float64),
                                 torch.randn(m_teacher, d, generator=g, dtype=torch.float64),
                                 torch.randn(m_teacher, generator=g, dtype=torch.float64)))
        Xs.append(torch.randn(max(n, 2000), d, generator=g, dtype=torch.float64)[:n])
        Xts.append(torch.randn(n_test, d, generator=g, dtype=torch.float64))
    teacher = MFParams(*(torch.stack(t) for t in zip(*teachers)))
    X, X_test = torch.stack(Xs), torch.stack(Xts)
    data = Data(X, forward(teacher, X, act), X_test, forward(teacher, X_test, act), act, teacher)
    return data.to(dtype=dtype, device=device)


# ============================================================================================ the network
def _preact(params: MFParams, X: torch.Tensor) -> torch.Tensor:
    return X @ params.W.transpose(-1, -2) + params.b.unsqueeze(-2)  # (..., n, m)


def features(params: MFParams, X, act: str) -> torch.Tensor:
    r"""Hidden features :math:`\Phi=\phi(XW^\top+\mathbf 1b^\top)`, shape ``(..., n, m)``."""
    params = _check_params(params)
    X = _check_X(X, params)
    return activation(act)[0](_preact(params, X))


def _out(params: MFParams, Phi: torch.Tensor) -> torch.Tensor:
    m = params.m
    if params.vector_output:
        return Phi @ params.v.transpose(-1, -2) / m  # (..., n, d_y)
    return (Phi @ params.v.unsqueeze(-1)).squeeze(-1) / m  # (..., n)


def forward(params: MFParams, X, act: str) -> torch.Tensor:
    r""":math:`f_\theta(X)=\phi(XW^\top+\mathbf 1b^\top)\,v/m`, shape ``(..., n)`` (or ``(..., n, d_y)``)."""
    return _out(params, features(params, X, act))


def _check_Y(Y: Any, params: MFParams, X: torch.Tensor, name: str = "Y") -> torch.Tensor:
    Y = check_finite(name, as_tensor(name, Y, dtype=params.W.dtype, device=params.W.device))
    n = X.shape[-2]
    want_last = (n, params.d_y) if params.vector_output else (n,)
    if tuple(Y.shape[-len(want_last):]) != want_last:
        raise ValueError(f"{name} must have trailing shape {want_last} (one target per sample"
                         f"{' and output' if params.vector_output else ''}), got {tuple(Y.shape)}")
    return Y


def loss(params: MFParams, X, Y, act: str) -> torch.Tensor:
    r"""Training loss :math:`\Loss=\frac1{2n}\lVert f_\theta(X)-Y\rVert_F^2` (half the mean squared error, summed over
    outputs), one value per batch entry."""
    params = _check_params(params)
    X = _check_X(X, params)
    Y = _check_Y(Y, params, X)
    r = forward(params, X, act) - Y
    r = r.flatten(-2) if params.vector_output else r
    return 0.5 * (r ** 2).sum(-1) / X.shape[-2]


def flatten(params: MFParams) -> torch.Tensor:
    r""":math:`\theta=(v,\operatorname{vec}W,b)` flattened row-major, shape ``(..., p)``, :math:`p=m(d_y+d+1)`."""
    params = _check_params(params)
    batch = params.batch_shape
    return torch.cat([params.v.reshape(*batch, -1), params.W.reshape(*batch, -1), params.b], dim=-1)


def unflatten(theta, m: int, d: int, d_y: int | None = None) -> MFParams:
    """Inverse of :func:`flatten` (``d_y`` given: vector output)."""
    m, d = check_int("m", m, min_value=1), check_int("d", d, min_value=1)
    theta = as_tensor("theta", theta)
    k = 1 if d_y is None else check_int("d_y", d_y, min_value=1)
    p = m * (k + d + 1)
    if theta.dim() < 1 or theta.shape[-1] != p:
        raise ValueError(f"theta must have shape (..., {p}) for m={m}, d={d}, d_y={d_y}, got {tuple(theta.shape)}")
    batch = theta.shape[:-1]
    v, W, b = theta.split([m * k, m * d, m], dim=-1)
    v = v.reshape(*batch, m) if d_y is None else v.reshape(*batch, k, m)
    return MFParams(v, W.reshape(*batch, m, d), b)


def model_fn(X, m: int, act: str, d_y: int | None = None):
    r"""``fn(theta) -> r``: the network's outputs on ``X`` (``(n, d)``, no batch) as a function of the flat
    :math:`\theta`, flattened row-major — the model convention of :mod:`curvlab.curvature` (dense references)."""
    X = check_finite("X", as_tensor("X", X))
    if X.dim() != 2:
        raise ValueError(f"X must have shape (n, d), got {tuple(X.shape)}")
    m, act = check_int("m", m, min_value=1), _check_act(act)
    d = X.shape[-1]

    def fn(theta: torch.Tensor) -> torch.Tensor:
        return forward(unflatten(theta, m, d, d_y), X, act).reshape(-1)

    return fn


# ============================================================================================ kernel, J^T z
class _Feat(NamedTuple):
    """Features of one evaluation, computed once and shared by f, K and J^T z: ``Phi`` (..., n, m) and
    ``A`` = phi'(Z) v_c / m as (..., n, m) (scalar output) or (..., n, d_y, m) (vector output)."""

    Phi: torch.Tensor
    A: torch.Tensor


def _feat(params: MFParams, X: torch.Tensor, act: str) -> _Feat:
    Z = _preact(params, X)
    if act == "relu":
        Phi, D = torch.relu(Z), (Z > 0).to(Z.dtype)
    else:  # silu: phi = z s(z), phi' = s + phi (1 - s)
        sg = torch.sigmoid(Z)
        Phi = Z * sg
        D = sg + Phi * (1 - sg)
    if params.vector_output:
        A = D.unsqueeze(-2) * (params.v / params.m).unsqueeze(-3)  # (..., n, d_y, m)
    else:
        A = D * (params.v / params.m).unsqueeze(-2)  # (..., n, m)
    return _Feat(Phi, A)


def _kernel(params: MFParams, X: torch.Tensor, F: _Feat) -> torch.Tensor:
    Phi, A, Xg = F.Phi.to(_GRAM_DTYPE), F.A.to(_GRAM_DTYPE), X.to(_GRAM_DTYPE)
    S = Xg @ Xg.transpose(-1, -2) + 1.0  # (..., n, n)
    G = Phi @ Phi.transpose(-1, -2) / params.m ** 2
    if not params.vector_output:
        return G + S * (A @ A.transpose(-1, -2))
    n, k = A.shape[-3], A.shape[-2]
    Af = A.reshape(*A.shape[:-3], n * k, A.shape[-1])  # rows (k, c), sample-major
    KW = (Af @ Af.transpose(-1, -2)).reshape(*A.shape[:-3], n, k, n, k) * S[..., :, None, :, None]
    eye = torch.eye(k, dtype=G.dtype, device=G.device)
    Kv = G[..., :, None, :, None] * eye[:, None, :]  # delta_cc' G_kl
    return (KW + Kv).reshape(*A.shape[:-3], n * k, n * k)


def _jt_feat(params: MFParams, X: torch.Tensor, F: _Feat, z: torch.Tensor) -> MFParams:
    z = z.to(F.Phi.dtype)
    if params.vector_output:
        zz = z.reshape(*z.shape[:-1], X.shape[-2], params.d_y)  # (..., n, d_y)
        gv = zz.transpose(-1, -2) @ F.Phi / params.m  # (..., d_y, m)
        Q = (zz.unsqueeze(-1) * F.A).sum(-2)  # (..., n, m): sum_c z_kc v_ci phi'_ki / m
    else:
        gv = (z.unsqueeze(-2) @ F.Phi).squeeze(-2) / params.m
        Q = F.A * z.unsqueeze(-1)
    return MFParams(gv, Q.transpose(-1, -2) @ X, Q.sum(-2))


def _resid_feat(params: MFParams, F: _Feat, Y: torch.Tensor) -> torch.Tensor:
    r = _out(params, F.Phi) - Y
    return r.flatten(-2) if params.vector_output else r


def feature_gram(params: MFParams, X, act: str) -> torch.Tensor:
    r"""Feature Gram matrix :math:`K_\phi=\Phi\Phi^\top/m` (float64), shape ``(..., n, n)``; :math:`J_vJ_v^\top=K_\phi/m`."""
    Phi = features(params, X, act).to(_GRAM_DTYPE)
    return Phi @ Phi.transpose(-1, -2) / params.m


def ntk(params: MFParams, X, act: str) -> torch.Tensor:
    r"""Kernel :math:`K=JJ^\top` from the Jacobian blocks, never forming :math:`J`; float64, ``(..., N, N)``.

    Scalar output (:math:`N=n`): :math:`K=\Phi\Phi^\top/m^2+(XX^\top+\mathbf 1\mathbf 1^\top)\odot(AA^\top)`,
    :math:`A=\Phi'\operatorname{diag}(v)/m`. Vector output (:math:`N=nd_y`, index :math:`k d_y+c`):
    :math:`K_{(k,c),(l,c')}=\delta_{cc'}(\Phi\Phi^\top)_{kl}/m^2+(x_k^\top x_l+1)\,\sum_iV_{ci}V_{c'i}
    \phi'(z_{ki})\phi'(z_{li})/m^2`. Cost :math:`O(n^2 m d_y^2)`; memory :math:`O(nm d_y + n^2d_y^2)`.
    """
    params = _check_params(params)
    X = _check_X(X, params)
    return _kernel(params, X, _feat(params, X, _check_act(act)))


def jt_vec(params: MFParams, X, z, act: str) -> MFParams:
    r""":math:`J^\top z` as parameters :math:`(J_v^\top z, J_W^\top z, J_b^\top z)`, never forming :math:`J`.

    ``z`` has shape ``(..., N)`` with :math:`N=nd_y` (row-major, sample-major). Scalar output:
    :math:`J_v^\top z=\Phi^\top z/m`, :math:`J_W^\top z=(A\odot z\mathbf 1^\top)^\top X`, :math:`J_b^\top z=A^\top z`.
    """
    params = _check_params(params)
    X = _check_X(X, params)
    N = X.shape[-2] * params.d_y
    z = check_finite("z", as_tensor("z", z, dtype=params.W.dtype, device=params.W.device))
    if z.dim() < 1 or z.shape[-1] != N:
        raise ValueError(f"z must have shape (..., {N}) (n * d_y), got {tuple(z.shape)}")
    return _jt_feat(params, X, _feat(params, X, _check_act(act)), z)


def gradient(params: MFParams, X, Y, act: str) -> MFParams:
    r""":math:`\nabla\Loss=J^\top r/n` (closed form)."""
    params = _check_params(params)
    X = _check_X(X, params)
    Y = _check_Y(Y, params, X)
    F = _feat(params, X, _check_act(act))
    return _jt_feat(params, X, F, _resid_feat(params, F, Y) / X.shape[-2])


# ============================================================================================ damping, GN
@dataclass(frozen=True)
class Damping:
    r"""How :math:`\lamGN` (the paper's :math:`\varepsilon`) is chosen at each GN step, in the units of :math:`K`'s eigenvalues.

    ``kind='constant'``: :math:`\lamGN=` ``value`` (``0`` = undamped);
    ``kind='relative'``: :math:`\lamGN=` ``value`` :math:`\cdot\lmax(K)`;
    ``kind='adaptive'``: :math:`\lamGN=\max(\texttt{value},\lmin(K))` — the authors' rule with floor ``value``
    (:math:`10^{-7}` in their code).
    """

    kind: str
    value: float

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, ("constant", "relative", "adaptive"))
        v = check_nonnegative("value", self.value)
        if self.kind == "relative" and v <= 0:
            raise ValueError("value must be > 0 for relative damping")
        object.__setattr__(self, "value", v)

    @classmethod
    def constant(cls, lam: float) -> Damping:
        return cls("constant", lam)

    @classmethod
    def relative(cls, c: float) -> Damping:
        return cls("relative", c)

    @classmethod
    def adaptive(cls, floor: float = 1e-7) -> Damping:
        return cls("adaptive", floor)

    def label(self) -> str:
        return {"constant": f"constant {self.value:g}", "relative": f"{self.value:g}·λmax(K)",
                "adaptive": f"max({self.value:g}, λmin(K))"}[self.kind]


def _check_damping(damping: Any) -> Damping:
    if not isinstance(damping, Damping):
        raise TypeError(f"damping must be a curvlab.meanfield.Damping, got {type(damping).__name__}")
    return damping


class GNDirection(NamedTuple):
    r"""One GN direction: ``delta`` :math:`=\Delta_{\mathrm{GN}}` (as parameters), ``z`` :math:`=(K+\lamGN I)^{-1}r`,
    ``lam`` :math:`\lamGN` per batch entry, ``eigs`` :math:`K`'s eigenvalues in decreasing order (or ``None`` if not
    computed), and ``K``."""

    delta: MFParams
    z: torch.Tensor
    lam: torch.Tensor
    eigs: torch.Tensor | None
    K: torch.Tensor


def _resolve_damping(damping: Damping, K: torch.Tensor, want_eigs: bool):
    """``(lam, eigs)``: lam per batch entry (float64); eigs descending or None.

    Adaptive damping without a spectrum request first tries a Cholesky factorisation of ``K - floor I``: if it
    fails, lambda_min(K) <= floor (to rounding) and lambda_GN = floor without an eigen-decomposition."""
    batch = K.shape[:-2]
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    eigs = None
    if want_eigs or damping.kind == "relative":
        eigs = torch.linalg.eigvalsh(K).flip(-1)
    if damping.kind == "constant":
        lam = torch.full(batch, damping.value, dtype=K.dtype, device=K.device)
    elif damping.kind == "relative":
        lam = damping.value * eigs[..., 0]
    else:
        floor = torch.full(batch, damping.value, dtype=K.dtype, device=K.device)
        if eigs is None:
            _, info = torch.linalg.cholesky_ex(K - damping.value * eye)
            if bool((info == 0).any()):  # some entry has lambda_min(K) > floor: its exact value is needed
                eigs = torch.linalg.eigvalsh(K).flip(-1)
                lam = torch.maximum(floor, eigs[..., -1])
            else:
                lam = floor
        else:
            lam = torch.maximum(floor, eigs[..., -1])
    return lam, eigs


def _solve(Kd: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Solve ``Kd z = r`` (SPD by Cholesky; LU when Cholesky fails, e.g. undamped near-singular ``K``)."""
    L, info = torch.linalg.cholesky_ex(Kd)
    if not bool((info != 0).any()):
        return torch.cholesky_solve(r.unsqueeze(-1), L).squeeze(-1)
    try:
        return torch.linalg.solve(Kd, r)
    except RuntimeError as exc:  # exactly singular
        raise ValueError("K + lambda_GN I is singular: the undamped GN step is undefined here (blow-up); "
                         "use a damping > 0") from exc


def gn_direction(params: MFParams, X, Y, act: str, damping: Damping, *, spectrum: bool = False) -> GNDirection:
    r"""Kernel-form GN direction :math:`\Delta_{\mathrm{GN}}=J^\top(K+\lamGN I)^{-1}r`, :math:`r=f_\theta(X)-Y`.

    :math:`K` from :func:`ntk`, the solve in float64, :math:`J^\top z` from :func:`jt_vec`; :math:`\lamGN` from
    ``damping``. ``spectrum=True`` also returns :math:`K`'s eigenvalues. The authors' step
    :math:`w-\texttt{lr}\,J^\top(JJ^\top+\varepsilon I)^{-1}(f-y)/n` is :math:`\theta-\eta\Delta_{\mathrm{GN}}` with
    :math:`\eta=\texttt{lr}/n` (chapter 20).
    """
    params = _check_params(params)
    X = _check_X(X, params)
    Y = _check_Y(Y, params, X)
    damping = _check_damping(damping)
    F = _feat(params, X, _check_act(act))
    K = _kernel(params, X, F)
    r = _resid_feat(params, F, Y).to(_GRAM_DTYPE)
    lam, eigs = _resolve_damping(damping, K, spectrum)
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    z = _solve(K + lam[..., None, None] * eye, r)
    return GNDirection(_jt_feat(params, X, F, z), z, lam, eigs, K)


def gn_step(params: MFParams, X, Y, act: str, *, eta: float, damping: Damping) -> MFParams:
    r"""One GN step :math:`\theta\leftarrow\theta-\eta\,J^\top(K+\lamGN I)^{-1}r` (book's :math:`\eta=\texttt{lr}/n`)."""
    eta = check_positive("eta", eta)
    return params.axpy(-eta, gn_direction(params, X, Y, act, damping).delta)


def gd_step(params: MFParams, X, Y, act: str, *, lr: float) -> MFParams:
    r"""One GD step :math:`\theta\leftarrow\theta-\texttt{lr}\,J^\top r/n` (the book's :math:`\eta=\texttt{lr}`)."""
    lr = check_positive("lr", lr)
    return params.axpy(-lr, gradient(params, X, Y, act))


# ============================================================================================ metrics
def _gram_pinv_solve(Phi: torch.Tensor, Y: torch.Tensor, m: int, rcond: float) -> torch.Tensor:
    r"""Minimum-norm least squares for the output layer: :math:`V^\top = J_v^\top(J_vJ_v^\top)^{+}Y` with
    :math:`J_v=\Phi/m`, eigenvalues of the Gram below ``rcond`` times the largest dropped (the authors' rule)."""
    P = Phi.to(_GRAM_DTYPE) / m
    G = P @ P.transpose(-1, -2)
    lam, U = torch.linalg.eigh(G)
    keep = lam > rcond * lam[..., -1:].clamp_min(torch.finfo(lam.dtype).tiny)
    inv = torch.where(keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))
    Yg = Y.to(_GRAM_DTYPE)
    Ym = Yg.unsqueeze(-1) if Yg.dim() == Phi.dim() - 1 else Yg
    coef = U @ (inv.unsqueeze(-1) * (U.transpose(-1, -2) @ Ym))  # (..., n, d_y)
    return (P.transpose(-1, -2) @ coef).transpose(-1, -2)  # (..., d_y, m)


def refit_output(params: MFParams, X, Y, act: str, *, rcond: float = 1e-10) -> MFParams:
    r"""Test-LRFit's refit: keep :math:`(W,b)`, set :math:`v` to the minimum-norm least-squares fit on :math:`(X,Y)`.

    :math:`v=J_v^\top(J_vJ_v^\top)^{+}Y` with :math:`J_v=\Phi/m`; the pseudo-inverse drops eigenvalues of
    :math:`J_vJ_v^\top` below ``rcond`` :math:`\cdot` the largest (the authors' ``train_last_layer`` with
    ``is_linear``). With :math:`m\ge n` and :math:`K_\phi` invertible the refit interpolates the training data.

    **Cut-off convention.** ``rcond`` cuts the *Gram eigenvalues*, i.e. the *squared* singular values of
    :math:`J_v`: the default ``1e-10`` drops singular values below :math:`10^{-5}\sigma_{\max}(J_v)`. This is not
    the cut of ``torch.linalg.pinv(J_v)`` / ``numpy.linalg.pinv`` (singular values below
    :math:`\max(n,m)\,\epsilon\,\sigma_{\max}`, about :math:`10^{-13}\sigma_{\max}` in float64), which keeps far more
    directions. Where the features are nearly collinear (random features of SiLU at small :math:`\sigma_0`) the two
    conventions give different test losses, by a factor of several; chapter 21 tabulates the sensitivity (random
    features, and trained networks). Every number of the book uses this convention; state it when comparing.
    """
    params = _check_params(params)
    X = _check_X(X, params)
    Y = _check_Y(Y, params, X)
    rcond = check_nonnegative("rcond", rcond)
    Phi = activation(act)[0](_preact(params, X))
    V = _gram_pinv_solve(Phi, Y, params.m, rcond).to(params.W.dtype)
    return MFParams(V if params.vector_output else V.squeeze(-2), params.W, params.b)


def random_features(params0: MFParams, X, Y, act: str, *, rcond: float = 1e-10) -> MFParams:
    r"""Random-features baseline (RF): hidden layer frozen at initialisation, output layer by :func:`refit_output`.

    The baseline depends on the pseudo-inverse's cut-off when the random features are nearly collinear: ``rcond``
    cuts Gram eigenvalues (squared singular values of :math:`J_v`) at ``rcond`` times the largest, not singular values
    as ``pinv`` does — see :func:`refit_output` and chapter 21's sensitivity table.

    (The authors' RF runs add 1000 damped GN steps on :math:`v` at lr 100 after this exact solve; on an
    interpolating fit they change nothing, and the book leaves them out — see the deviations page.)
    """
    return refit_output(params0, X, Y, act, rcond=rcond)


def test_lrfit(params: MFParams, data: Data, *, rcond: float = 1e-10) -> torch.Tensor:
    r"""Test-LRFit: the test loss :math:`\frac1{2n_{\mathrm{test}}}\lVert f(X_{\mathrm{test}})-Y_{\mathrm{test}}\rVert^2`
    after :func:`refit_output` on the training set (one value per seed); ``rcond`` cuts Gram eigenvalues, the
    convention of :func:`refit_output`."""
    _check_data(data)
    refit = refit_output(params, data.X, data.Y, data.act, rcond=rcond)
    return loss(refit, data.X_test, data.Y_test, data.act)


def wcd(W, W_teacher) -> torch.Tensor:
    r"""Weighted cosine distance (paper 2's WCD) between student and teacher hidden weights (biases excluded).

    :math:`\mathrm{WCD}=\sum_i\rho_i\min_j\lVert\bar w_i-\bar w_{\star j}\rVert`, with
    :math:`\lVert\bar w-\bar w'\rVert=\sqrt{2(1-\cos(w,w'))}` and :math:`\rho_i=\lVert w_i\rVert^2/\sum_k\lVert w_k\rVert^2`;
    a zero row gets a zero normalised vector (the authors' convention). ``W (..., m, d)``, ``W_teacher (..., m*, d)``.
    """
    W = check_finite("W", as_tensor("W", W))
    Wt = check_finite("W_teacher", as_tensor("W_teacher", W_teacher, dtype=W.dtype, device=W.device))
    if W.dim() < 2 or Wt.dim() < 2 or W.shape[-1] != Wt.shape[-1]:
        raise ValueError(f"W (..., m, d) and W_teacher (..., m*, d) must share d, got {tuple(W.shape)}, "
                         f"{tuple(Wt.shape)}")
    norms = W.norm(dim=-1)
    if bool((norms.pow(2).sum(-1) <= 0).any()):
        raise ValueError("W must have at least one nonzero row (the weights rho_i are undefined otherwise)")
    unit = lambda A, nr: A / torch.where(nr > 0, nr, torch.ones_like(nr)).unsqueeze(-1)
    cos = unit(W, norms) @ unit(Wt, Wt.norm(dim=-1)).transpose(-1, -2)
    dist = torch.sqrt(torch.clamp(2 * (1 - cos), min=0)).amin(-1)
    rho = norms ** 2 / (norms ** 2).sum(-1, keepdim=True)
    return (rho * dist).sum(-1)


def distance_from_init(params: MFParams, params0: MFParams) -> torch.Tensor:
    r"""Hidden-weight travel :math:`\lVert (W,b)-(W_0,b_0)\rVert` per batch entry (the output layer excluded)."""
    params, params0 = _check_params(params), _check_params(params0, "params0")
    dW = (params.W - params0.W).pow(2).sum((-1, -2))
    db = (params.b - params0.b).pow(2).sum(-1)
    return (dW + db).sqrt()


def fs_time(lr: float, steps, n: int):
    r"""Function-space time :math:`t_{\mathrm f}=\texttt{lr}\cdot t/n` after ``steps`` steps of the paper's step ``lr``
    (GN: :math:`\eta t` with :math:`\eta=\texttt{lr}/n`; GD: :math:`\eta t/n` with :math:`\eta=\texttt{lr}`)."""
    lr, n = check_positive("lr", lr), check_int("n", n, min_value=1)
    return lr * np.asarray(steps, dtype=float) / n


# ============================================================================================ theory helpers
def mode_contraction(eigs, lam, eta: float) -> torch.Tensor:
    r"""Per-mode contraction of the residual by one linearised damped GN step, :math:`\xi_i=1-\eta\,s_i/(s_i+\lamGN)`
    (:math:`s_i` the eigenvalues of :math:`K`); for gradient descent use :math:`c_i=1-\eta s_i/n` directly."""
    s = _f64("eigs", eigs)
    eta = check_positive("eta", eta)
    lam_t = _f64("lam", lam)
    if bool((s < 0).any()) or bool((lam_t < 0).any()):
        raise ValueError("eigs and lam must be >= 0 (clip rounding negatives of a PSD spectrum first)")
    den = s + lam_t
    if bool((den <= 0).any()):
        raise ValueError("s + lam must be > 0: an undamped step needs a nonsingular K")
    return 1 - eta * s / den


@dataclass(frozen=True)
class StepsBracket:
    r"""Steps to reach :math:`\Loss_t\le\mathrm{tol}\cdot\Loss_0`, bracketed from the spectrum (chapter 20).

    ``low`` :math:`=\lceil\ln\mathrm{tol}/(2\ln\xi_{\mathrm{fast}})\rceil` (every mode as fast as the fastest, the bulk
    :math:`1-\eta` when :math:`s\gg\lamGN`), ``high`` :math:`=\lceil\ln\mathrm{tol}/(2\ln\xi_{\mathrm{slow}})\rceil` (every mode as
    slow as the slowest, damping-limited one). ``precondition``: the bracket is informative and asserted only when
    the damping is set by the spectrum, not by a floor: :math:`\lmin(K)\ge\text{floor}` at every recorded step
    (then :math:`s/(s+\lamGN)\ge\tfrac12` for adaptive damping), and :math:`\eta\,\max_i s_i/(s_i+\lamGN)\le1`."""

    low: int
    high: int
    c_fast: float
    c_slow: float
    precondition: bool
    reason: str


def steps_bracket(eigs, lam, eta: float, tol: float, *, floor: float | None = None) -> StepsBracket:
    r"""Bracket the number of GN steps to a loss tolerance ``tol`` from the spectra of :math:`K` along the run.

    ``eigs``: eigenvalues of :math:`K` at one or several recorded steps, ``(T, N)`` or ``(N,)``; ``lam`` the damping
    used there (``(T,)`` or a number). For a symmetric :math:`\mathcal M_t=K_t(K_t+\lamGN I)^{-1}` with eigenvalues in
    :math:`[\nu^-,\nu^+]` and :math:`\eta\nu^+\le1`, :math:`(1-\eta\nu^+)\lVert r\rVert\le\lVert(I-\eta\mathcal M_t)r\rVert
    \le(1-\eta\nu^-)\lVert r\rVert`, whatever the eigenvectors; the loss is :math:`\lVert r\rVert^2/(2n)`, so
    :math:`\Loss_T/\Loss_0\in[\xi_{\mathrm{fast}}^{2T},\xi_{\mathrm{slow}}^{2T}]` for the linearised steps. ``floor``:
    the adaptive damping's floor, for the precondition (``None``: no floor, e.g. constant damping).
    """
    s = _f64("eigs", eigs)
    if s.dim() == 1:
        s = s.unsqueeze(0)
    if s.dim() != 2 or s.numel() == 0:
        raise ValueError(f"eigs must have shape (T, N) or (N,), got {tuple(s.shape)}")
    lam_t = _f64("lam", lam).reshape(-1)
    if lam_t.numel() == 1:
        lam_t = lam_t.expand(s.shape[0])
    if lam_t.shape[0] != s.shape[0]:
        raise ValueError(f"lam must be a number or have one value per row of eigs ({s.shape[0]}), got {lam_t.numel()}")
    eta = check_positive("eta", eta)
    tol = check_positive("tol", tol)
    if tol >= 1:
        raise ValueError(f"tol must be < 1 (a relative loss tolerance), got {tol}")
    s = s.clamp_min(0)
    mu = s / (s + lam_t[:, None])
    mu_max, mu_min = float(mu.max()), float(mu.min())
    c_fast, c_slow = 1 - eta * mu_max, 1 - eta * mu_min
    reasons = []
    if eta * mu_max > 1:
        reasons.append(f"eta * max s/(s+lam) = {eta * mu_max:.3g} > 1 (over-relaxed modes)")
    if floor is not None and float(s[:, -1].min()) < check_nonnegative("floor", floor):
        k = int((s[:, -1] < floor).sum())
        reasons.append(f"lambda_min(K) = {float(s[:, -1].min()):.2g} < floor {floor:g} at {k} of "
                       f"{s.shape[0]} steps: the floor sets the damping there")
    if c_slow >= 1:
        reasons.append("a mode does not contract (s = 0 or eta = 0)")
    ok = not reasons

    def steps(c: float) -> int:
        if c <= 0:
            return 1
        if c >= 1:
            return 2 ** 62
        return int(math.ceil(math.log(tol) / (2 * math.log(c))))

    return StepsBracket(steps(abs(c_fast)), steps(c_slow), c_fast, c_slow, ok, "; ".join(reasons) or "holds")


def gd_divergence_lr(K, n: int) -> torch.Tensor:
    r"""Largest stable GD step at the linearisation: :math:`\texttt{lr}^\ast=2n/\lmax(K)`.

    One GD step maps the residual to :math:`(I-\texttt{lr}\,K/n)r` to first order, so the top mode grows when
    :math:`\texttt{lr}\,\lmax(K)/n>2`. ``K``: ``(..., N, N)``; returns one value per batch entry.
    """
    K = _f64("K", K)
    if K.dim() < 2 or K.shape[-1] != K.shape[-2]:
        raise ValueError(f"K must be square (..., N, N), got {tuple(K.shape)}")
    n = check_int("n", n, min_value=1)
    top = torch.linalg.eigvalsh(K)[..., -1]
    if bool((top <= 0).any()):
        raise ValueError("K must have a positive eigenvalue")
    return 2 * n / top


# ============================================================================================ Proposition 1: the flow
def flow_rate(lam_star, eps) -> torch.Tensor:
    r"""Guaranteed loss rate of the damped GN flow (chapter 20, Proposition 1 in the book's version).

    Along :math:`\dot\theta=-\Delta_{\mathrm{GN}}` (time :math:`t_{\mathrm f}`) with
    :math:`\lmin(K_t)\ge\lambda_\star>0`, :math:`\Loss(t_{\mathrm f})\le e^{-c\,t_{\mathrm f}}\Loss(0)` with

    .. math:: c(\varepsilon)=\frac{2\lambda_\star}{\lambda_\star+\varepsilon},\qquad \varepsilon=n\lamGN

    (``eps`` in kernel units, like :class:`Damping`). :math:`c\to2` as :math:`\varepsilon\to0` whatever
    :math:`\lambda_\star`, :math:`c=1` at :math:`\varepsilon=\lambda_\star`, :math:`c\approx2\lambda_\star/\varepsilon`
    for :math:`\varepsilon\gg\lambda_\star`. Broadcasts; float64.
    """
    lam = _f64("lam_star", lam_star)
    e = _f64("eps", eps)
    if bool((lam <= 0).any()):
        raise ValueError("lam_star must be > 0 (a lower bound on lambda_min(K) along the flow)")
    if bool((e < 0).any()):
        raise ValueError("eps must be >= 0 (the damping n lambda_GN, in kernel units)")
    return 2 * lam / (lam + e)


def flow_radius(r0_norm, lam_star, eps) -> torch.Tensor:
    r"""Radius of the ball the damped GN flow stays in (chapter 20, Proposition 1):
    :math:`\lVert\theta_t-\theta_0\rVert\le R(\varepsilon)=\lVert r_0\rVert\,\rho_\varepsilon(\lambda_\star)/
    \nu_\varepsilon(\lambda_\star)` with :math:`\nu_\varepsilon(s)=s/(s+\varepsilon)` and
    :math:`\rho_\varepsilon(\lambda_\star)=\sup_{s\ge\lambda_\star}\sqrt s/(s+\varepsilon)`, i.e.

    .. math:: R(\varepsilon)=\frac{\lVert r_0\rVert}{\sqrt{\lambda_\star}}\ \text{if}\ \varepsilon\le\lambda_\star,
        \qquad R(\varepsilon)=\frac{\lVert r_0\rVert}{\sqrt{\lambda_\star}}\,
        \frac{\lambda_\star+\varepsilon}{2\sqrt{\varepsilon\lambda_\star}}\ \text{if}\ \varepsilon>\lambda_\star
        \quad(\varepsilon=n\lamGN).

    ``r0_norm`` :math:`=\lVert r_0\rVert` (not the loss). Broadcasts; float64.
    """
    r0 = _f64("r0_norm", r0_norm)
    if bool((r0 < 0).any()):
        raise ValueError("r0_norm must be >= 0 (the norm of the initial residual)")
    lam = _f64("lam_star", lam_star)
    e = _f64("eps", eps)
    flow_rate(lam, e)  # validates lam_star > 0 and eps >= 0
    ratio = (lam + e) / (2 * torch.sqrt(e * lam))
    return r0 / torch.sqrt(lam) * torch.where(e >= lam, ratio, torch.ones_like(ratio))


def slowest_mode_targets(params: MFParams, X, act: str, *, amplitude: float) -> torch.Tensor:
    r"""Targets whose initial residual lies in the slowest mode of :math:`K_0` (chapter 20, Proposition 1's
    worst case): :math:`Y=f_{\theta_0}(X)-a\sqrt{\lmin(K_0)}\,u_{\min}`, so :math:`r_0=a\sqrt{\lmin(K_0)}\,u_{\min}`
    and the linearised flow moves :math:`\theta` by exactly :math:`a` (``amplitude``). Scalar output only;
    one target vector per batch entry, ``(..., n)``."""
    params = _check_params(params)
    if params.vector_output:
        raise ValueError("params must have a scalar output (v of shape (..., m)) for slowest_mode_targets")
    X = _check_X(X, params)
    a = check_positive("amplitude", amplitude)
    F = _feat(params, X, _check_act(act))
    lam, U = torch.linalg.eigh(_kernel(params, X, F))
    if bool((lam[..., 0] <= 0).any()):
        raise ValueError("K(theta_0) must be positive definite (lambda_min > 0) to define the slowest mode")
    r0 = a * torch.sqrt(lam[..., :1]) * U[..., :, 0]
    return (_out(params, F.Phi) - r0.to(F.Phi.dtype)).detach()


def ball_lambda_min(params0: MFParams, X, act: str, *, radius, points: int = 64, seed: int = 0) -> torch.Tensor:
    r"""Monte Carlo probe of Proposition 1's hypothesis on the ball (chapter 20): the smallest
    :math:`\lmin(K_\theta)` over ``points`` points :math:`\theta` drawn uniformly in the ball
    :math:`\lVert\theta-\theta_0\rVert\le` ``radius`` (all parameters), one value per batch entry.

    A sample minimum is an *upper* estimate of :math:`\inf_B\lmin(K_\theta)`: a value below a trajectory's
    :math:`\min_t\lmin(K_t)` shows that the hypothesis fails on the ball with that :math:`\lambda_\star`; a value
    above it proves nothing. ``radius``: a number or one value per batch entry (leading dimension of ``params0``).
    """
    params0 = _check_params(params0, "params0")
    if len(params0.batch_shape) != 1:
        raise ValueError(f"params0 must carry one leading batch dimension (B, ...), got {tuple(params0.batch_shape)}")
    B = params0.batch_shape[0]
    act = _check_act(act)
    X = _check_X(X, params0)
    points = check_int("points", points, min_value=1)
    rad = _f64("radius", radius)
    if bool((rad < 0).any()):
        raise ValueError("radius must be >= 0")
    try:
        rad = rad.expand(B).contiguous()
    except RuntimeError as exc:
        raise ValueError(f"radius must be a number or have one value per batch entry ({B})") from exc
    theta0 = flatten(params0)
    p = theta0.shape[-1]
    g = _generator(int(seed))
    u = torch.randn(B, points, p, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True) * torch.rand(B, points, 1, generator=g, dtype=torch.float64) ** (1.0 / p)
    theta = theta0.unsqueeze(1) + (rad.view(B, 1, 1) * u).to(theta0.dtype).to(theta0.device)
    pts = unflatten(theta.reshape(B * points, p), params0.m, params0.d, params0.d_y if params0.vector_output else None)
    Xr = X.repeat_interleave(points, 0)
    lam = torch.linalg.eigvalsh(ntk(pts, Xr, act))[..., 0]
    return lam.view(B, points).min(dim=1).values


class Flow(NamedTuple):
    """Result of :func:`gn_flow`: the final parameters and the tidy history (one row per batch entry × record)."""

    params: MFParams
    history: pd.DataFrame


def _flow_field(p: MFParams, X: torch.Tensor, Y: torch.Tensor, act: str, eps: torch.Tensor, want: bool):
    F = _feat(p, X, act)
    K = _kernel(p, X, F)
    r = _resid_feat(p, F, Y).to(_GRAM_DTYPE)
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    z = _solve(K + eps[..., None, None] * eye, r)
    lmin = torch.linalg.eigvalsh(K)[..., 0] if want else None
    return _jt_feat(p, X, F, z), 0.5 * (r ** 2).sum(-1) / X.shape[-2], lmin


def gn_flow(params0: MFParams, X, Y, act: str, *, eps, t_end, steps: int, record_every: int = 1) -> Flow:
    r"""The damped GN flow :math:`\dot\theta=-\Delta_{\mathrm{GN}}=-J^\top(K+\varepsilon I)^{-1}r` in
    function-space time :math:`t_{\mathrm f}` (chapter 20, Proposition 1), integrated by the classical
    fourth-order Runge–Kutta method with ``steps`` equal steps up to ``t_end``.

    ``eps`` (:math:`\varepsilon=n\lamGN`, kernel units) and ``t_end`` are numbers or one value per batch entry
    (leading dimension of ``params0``): a sweep over seeds and dampings is one batched integration. The error of
    RK4 is :math:`O(h^4)`, :math:`h=t_{\mathrm{end}}/\texttt{steps}`; halve ``steps`` and compare to estimate it.
    Records every ``record_every`` steps (and the last): ``entry``, ``step``, ``fs_time``, ``loss``, ``rel_loss``,
    ``lam_min_K`` (:math:`\lmin(K)` at the recorded point), ``travel`` :math:`\lVert\theta-\theta_0\rVert`
    (all parameters) and ``speed`` :math:`\lVert\Delta_{\mathrm{GN}}\rVert` (the field's norm there).
    """
    params0 = _check_params(params0, "params0")
    if len(params0.batch_shape) != 1:
        raise ValueError(f"params0 must carry one leading batch dimension (B, ...), got {tuple(params0.batch_shape)}")
    B = params0.batch_shape[0]
    act = _check_act(act)
    X = _check_X(X, params0)
    Y = _check_Y(Y, params0, X)
    steps = check_int("steps", steps, min_value=1)
    record_every = check_int("record_every", record_every, min_value=1)
    eps_t, t_t = _f64("eps", eps).to(X.device), _f64("t_end", t_end).to(X.device)
    if bool((eps_t < 0).any()):
        raise ValueError("eps must be >= 0 (the damping n lambda_GN, in kernel units)")
    if bool((t_t <= 0).any()):
        raise ValueError("t_end must be > 0")
    try:
        eps_t, t_t = eps_t.expand(B).contiguous(), t_t.expand(B).contiguous()
    except RuntimeError as exc:
        raise ValueError(f"eps and t_end must be numbers or have one value per batch entry ({B})") from exc
    h = (t_t / steps).to(params0.W.dtype)
    theta0 = flatten(params0)
    rows: list[dict] = []
    p, loss0 = params0, None
    with torch.no_grad():
        for k in range(steps + 1):
            rec = k % record_every == 0 or k == steps
            k1, cur, lmin = _flow_field(p, X, Y, act, eps_t, rec)
            if loss0 is None:
                loss0 = cur
            if rec:
                travel, speed = (flatten(p) - theta0).norm(dim=-1), flatten(k1).norm(dim=-1)
                for e_ in range(B):
                    rows.append({"entry": e_, "step": k, "fs_time": float(h[e_]) * k, "loss": float(cur[e_]),
                                 "rel_loss": float(cur[e_] / loss0[e_]), "lam_min_K": float(lmin[e_]),
                                 "travel": float(travel[e_]), "speed": float(speed[e_])})
            if k == steps:
                break
            k2 = _flow_field(p.axpy(-h / 2, k1), X, Y, act, eps_t, False)[0]
            k3 = _flow_field(p.axpy(-h / 2, k2), X, Y, act, eps_t, False)[0]
            k4 = _flow_field(p.axpy(-h, k3), X, Y, act, eps_t, False)[0]
            incr = k1.axpy(2.0, k2).axpy(2.0, k3).axpy(1.0, k4)
            p = p.axpy(-h / 6, incr)
    hist = pd.DataFrame(rows)
    hist.attrs.update(n=X.shape[-2], act=act, steps=steps)
    return Flow(p, hist)


def fit_rate(t, log_loss) -> tuple[np.ndarray, np.ndarray]:
    r"""Least-squares decay rate of a loss curve: the slope :math:`\hat c` of :math:`-\log\Loss` against
    :math:`t_{\mathrm f}` (with an intercept) and its standard error, per row. ``t`` and ``log_loss`` have shape
    ``(T,)`` or ``(R, T)`` with ``T >= 3`` (chapter 20). For a curve whose derivative is
    :math:`\le-c` everywhere the slope is :math:`\ge c` (it is a positively weighted average of derivatives)."""
    tt = np.atleast_2d(np.asarray(t, dtype=float))
    yy = np.atleast_2d(np.asarray(log_loss, dtype=float))
    if tt.shape != yy.shape or tt.shape[1] < 3:
        raise ValueError(f"t and log_loss must share a shape (T,) or (R, T) with T >= 3, got {tt.shape}, {yy.shape}")
    if not (np.isfinite(tt).all() and np.isfinite(yy).all()):
        raise ValueError("t and log_loss must be finite")
    tc = tt - tt.mean(1, keepdims=True)
    sxx = (tc ** 2).sum(1)
    if bool((sxx <= 0).any()):
        raise ValueError("t must not be constant within a row")
    slope = (tc * (yy - yy.mean(1, keepdims=True))).sum(1) / sxx
    resid = yy - yy.mean(1, keepdims=True) - slope[:, None] * tc
    se = np.sqrt((resid ** 2).sum(1) / (tt.shape[1] - 2) / sxx)
    return -slope, se


# ============================================================================================ the authors' SVD solve
def svd_gn_direction(params: MFParams, X, Y, act: str, *, floor: float = 1e-7) -> GNDirection:
    r"""The GN direction solved as paper 2's released optimizer solves it (chapter 20; deviations A.8).

    With the SVD :math:`K=U\operatorname{diag}(s)V^\top` (singular values clamped at 0) and the damping
    :math:`\lambda=\max(\text{floor},\min_i s_i)` added to the singular values, :math:`z=V\operatorname{diag}
    \big(1/(s_i+\lambda)\big)U^\top r` and the direction is :math:`J^\top z`. For a positive semi-definite
    :math:`K` this is :func:`gn_direction` with ``Damping.adaptive(floor)``. An eigenvalue :math:`\lambda_i<0`
    that round-off leaves in :math:`K` has :math:`s_i=|\lambda_i|` and :math:`u_i=-v_i`: its coefficient is
    :math:`-1/(|\lambda_i|+\lambda)` where the damped GN step has :math:`+1/(\lambda_i+\lambda)`.
    Returns a :class:`GNDirection` whose ``eigs`` are the singular values (descending) and ``lam`` the damping.
    """
    params = _check_params(params)
    X = _check_X(X, params)
    Y = _check_Y(Y, params, X)
    floor = check_nonnegative("floor", floor)
    F = _feat(params, X, _check_act(act))
    K = _kernel(params, X, F)
    r = _resid_feat(params, F, Y).to(_GRAM_DTYPE)
    U, s, Vh = torch.linalg.svd(K)
    s = s.clamp_min(0)
    lam = torch.clamp(s.amin(-1), min=floor)
    if bool((s + lam[..., None] <= 0).any()):
        raise ValueError("K is zero and floor = 0: the SVD solve is undefined; use floor > 0")
    coef = (U.transpose(-1, -2) @ r.unsqueeze(-1)).squeeze(-1) / (s + lam[..., None])
    z = (Vh.transpose(-1, -2) @ coef.unsqueeze(-1)).squeeze(-1)
    return GNDirection(_jt_feat(params, X, F, z), z, lam, s, K)


def svd_step_difference(params0: MFParams, X, Y, act: str, *, eta: float, floor: float = 1e-7,
                        steps: int = 3) -> pd.DataFrame:
    r"""How far the authors' SVD solve (:func:`svd_gn_direction`) is from the damped GN step along a run
    (chapter 20; deviations A.8).

    Runs ``steps`` damped GN steps :math:`\theta\leftarrow\theta-\eta\Delta_{\mathrm{GN}}` with the adaptive damping
    ``floor`` from ``params0`` (in its dtype: the authors' parameters are float32, the Gram matrix float64) and, at
    each, records per batch entry: ``negative_eigs`` (eigenvalues of the computed :math:`K` below 0),
    ``lam_max_K``, ``lam_gn``, ``cond`` :math:`=(\lmax+\lamGN)/(\lmin+\lamGN)` and ``rel_diff``
    :math:`=\lVert\Delta_{\mathrm{SVD}}-\Delta_{\mathrm{GN}}\rVert/\lVert\Delta_{\mathrm{GN}}\rVert`.
    """
    params0 = _check_params(params0, "params0")
    if len(params0.batch_shape) != 1:
        raise ValueError(f"params0 must carry one leading batch dimension (B, ...), got {tuple(params0.batch_shape)}")
    eta = check_positive("eta", eta)
    steps = check_int("steps", steps, min_value=1)
    rows, p = [], params0
    for k in range(1, steps + 1):
        gn = gn_direction(p, X, Y, act, Damping.adaptive(floor), spectrum=True)
        d_gn = flatten(gn.delta).double()
        d_svd = flatten(svd_gn_direction(p, X, Y, act, floor=floor).delta).double()
        rel = (d_svd - d_gn).norm(dim=-1) / d_gn.norm(dim=-1)
        for s_ in range(params0.batch_shape[0]):
            e_ = gn.eigs[s_]
            rows.append({"step": k, "entry": s_, "dtype": str(params0.W.dtype).replace("torch.", ""),
                         "negative_eigs": int((e_ < 0).sum()), "lam_max_K": float(e_[0]),
                         "lam_gn": float(gn.lam[s_]), "cond": float((e_[0] + gn.lam[s_]) / (e_[-1] + gn.lam[s_])),
                         "rel_diff": float(rel[s_])})
        p = p.axpy(-eta, gn.delta)
    return pd.DataFrame(rows)


# ============================================================================================ training
@dataclass
class Run:
    """Result of :func:`train`: final parameters, the initial ones, the tidy ``history`` (one row per seed × record),
    and ``spectra`` (eigenvalues of :math:`K` at the recorded steps, if requested: list of ``(step, (S, N))``)."""

    params: MFParams
    params0: MFParams
    history: pd.DataFrame
    spectra: list


def _check_data(data: Any) -> Data:
    if not isinstance(data, Data):
        raise TypeError(f"data must be a curvlab.meanfield.Data, got {type(data).__name__}")
    return data


def _record_steps(max_steps: int, n_records: int) -> set[int]:
    grid = np.unique(np.round(np.geomspace(1, max(max_steps, 1), max(n_records, 2))).astype(int))
    return {0, *grid.tolist(), max_steps}


def train(params0: MFParams, data: Data, *, method: str, lr: float, damping: Damping | None = None,
          max_steps: int = 1000, rel_tol: float = 1e-8, loss_stop: float | None = None,
          fs_time_budget: float | None = None, n_records: int = 40, record_every: int | None = None,
          record_steps: Sequence[int] | None = None, spectrum: bool = False, metrics: bool = True,
          diverge_factor: float = 1e6) -> Run:
    r"""Train the batch of students ``params0`` (one per seed) on ``data`` by GD or GN; record every curve.

    ``method``: ``'GD'`` (:math:`\theta\leftarrow\theta-\texttt{lr}\,\nabla\Loss`) or ``'GN'``
    (:math:`\theta\leftarrow\theta-(\texttt{lr}/n)\,\Delta_{\mathrm{GN}}` with ``damping``, default adaptive with floor
    :math:`10^{-7}`); ``lr`` is the paper's step. Each seed stops on its own at the first of: the authors' rule
    :math:`\Loss_t\le` ``rel_tol`` :math:`\cdot\Loss_0` (status ``converged``), an absolute ``loss_stop``, the
    function-space time budget :math:`t_{\mathrm f}=\texttt{lr}\,t/n\ge` ``fs_time_budget`` (``budget``), the cap
    ``max_steps`` (``cap``), or divergence (non-finite or above ``diverge_factor`` :math:`\cdot\Loss_0`,
    ``diverged``). Records at ``n_records`` log-spaced steps (or every ``record_every`` steps, or at
    ``record_steps`` as well) and at each seed's last step: step, :math:`t_{\mathrm f}`, train loss, and (``metrics``) test loss, Test-LRFit, WCD (teacher–student
    data), hidden-weight travel. GN rows also carry :math:`\lamGN` of the step that led there, and with
    ``spectrum=True`` (both methods) :math:`\lmin(K)`, :math:`\lmax(K)` and the fraction of eigenvalues below
    :math:`\lamGN` at the start of that step (computed for recorded steps only; ``record_every=1`` records every
    step, as :func:`loss_envelope` needs).
    """
    params0 = _check_params(params0, "params0")
    data = _check_data(data)
    method = check_choice("method", method, ("GD", "GN"))
    lr = check_positive("lr", lr)
    max_steps = check_int("max_steps", max_steps, min_value=0)
    rel_tol = check_nonnegative("rel_tol", rel_tol)
    if loss_stop is not None:
        loss_stop = check_nonnegative("loss_stop", loss_stop)
    if fs_time_budget is not None:
        fs_time_budget = check_positive("fs_time_budget", fs_time_budget)
    diverge_factor = check_positive("diverge_factor", diverge_factor)
    damping = Damping.adaptive() if damping is None else _check_damping(damping)
    if len(params0.batch_shape) != 1:
        raise ValueError(f"params0 must carry one leading seed dimension (S, ...), got batch {tuple(params0.batch_shape)}")
    S = params0.batch_shape[0]
    act = _check_act(data.act)
    X = _check_X(data.X, params0, "data.X")
    Y = _check_Y(data.Y, params0, X, "data.Y")
    if X.dim() == 3 and X.shape[0] != S:
        raise ValueError(f"data has {X.shape[0]} seeds but params0 has {S}")
    Xt = _check_X(data.X_test, params0, "data.X_test")
    Yt = _check_Y(data.Y_test, params0, Xt, "data.Y_test")
    n = X.shape[-2]
    eta_gn = lr / n
    if record_every is not None:
        record_every = check_int("record_every", record_every, min_value=1)
        records = {0, *range(record_every, max_steps + 1, record_every), max_steps}
    else:
        records = _record_steps(max_steps, n_records)
    if record_steps is not None:
        records |= {check_int("record_steps", int(k), min_value=0) for k in record_steps}
    budget_steps = math.inf if fs_time_budget is None else math.ceil(fs_time_budget * n / lr * (1 - 1e-12))

    def evaluate(p: MFParams):
        F = _feat(p, X, act)
        r = _resid_feat(p, F, Y)
        return F, r, 0.5 * (r ** 2).sum(-1) / n

    work, final = params0, params0  # work: the running parameters (stopped seeds reset to params0)
    F, r, cur_loss = evaluate(work)
    loss0 = cur_loss.clone()
    steps = torch.zeros(S, dtype=torch.long)
    status = ["running"] * S
    active = torch.ones(S, dtype=torch.bool)
    rows: list[dict] = []
    spectra: list = []
    info: dict[str, torch.Tensor] = {}

    def record(which: list[int], p: MFParams) -> None:
        extra = {}
        if metrics:
            extra["test_loss"] = 0.5 * ((_out(p, _feat(p, Xt, act).Phi) - Yt) ** 2).reshape(S, -1).sum(-1) / Xt.shape[-2]
            extra["test_lrfit"] = test_lrfit(p, data)
            extra["hidden_travel"] = distance_from_init(p, params0)
            if data.teacher is not None:
                extra["wcd"] = wcd(p.W, data.teacher.W)
        vals = {k: v.tolist() for k, v in {**extra, **info}.items()}
        losses, st = cur_loss.tolist(), steps.tolist()
        l0 = loss0.tolist()
        for s_ in which:
            row = {"seed": s_, "method": method, "lr": lr, "eta": eta_gn if method == "GN" else lr,
                   "step": st[s_], "fs_time": lr * st[s_] / n, "train_loss": losses[s_],
                   "rel_loss": losses[s_] / l0[s_], "status": status[s_]}
            row.update({k: v[s_] for k, v in vals.items()})
            rows.append(row)

    t = 0
    with torch.no_grad():
        while True:
            # stopping rules, per seed (all active seeds have made t steps)
            finite = torch.isfinite(cur_loss)
            rules = [("diverged", ~finite | (cur_loss > diverge_factor * loss0)),
                     ("converged", cur_loss <= rel_tol * loss0)]
            if loss_stop is not None:
                rules.append(("converged", cur_loss <= loss_stop))
            rules += [("budget", torch.full((S,), t >= budget_steps)), ("cap", torch.full((S,), t >= max_steps))]
            newly = torch.zeros(S, dtype=torch.bool)
            for name, hit in rules:
                for s_ in torch.nonzero(active & hit & ~newly).flatten().tolist():
                    status[s_] = name
                newly |= active & hit
            which = torch.nonzero(active).flatten().tolist() if t in records else torch.nonzero(newly).flatten().tolist()
            if which:
                record(which, work)
            if bool(newly.any()):
                final = work.select(newly, final)
                active &= ~newly
                work = params0.select(newly, work)
                F, r, _ = evaluate(work)
            if not bool(active.any()):
                break
            # one step (stopped seeds sit at params0 and are not moved)
            want = spectrum and (t + 1) in records  # spectra are only kept where a row is recorded
            if method == "GN":
                K = _kernel(work, X, F)
                lam, eigs = _resolve_damping(damping, K, want)
                eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
                z = _solve(K + lam[..., None, None] * eye, r.to(_GRAM_DTYPE))
                delta, step = _jt_feat(work, X, F, z), eta_gn
                info = {"lam_gn": lam}
                if want:
                    info.update(lam_min_K=eigs[..., -1], lam_max_K=eigs[..., 0],
                                frac_below_damping=(eigs < lam[..., None]).double().mean(-1))
            else:
                delta, step = _jt_feat(work, X, F, r / n), lr
                info = {}
                if want:
                    eigs = torch.linalg.eigvalsh(_kernel(work, X, F)).flip(-1)
                    info = {"lam_min_K": eigs[..., -1], "lam_max_K": eigs[..., 0]}
            if want:
                spectra.append((t, eigs.detach().cpu()))
            new = work.axpy(-step * active.to(work.W.dtype), delta)
            ok = torch.stack([torch.isfinite(q.reshape(S, -1)).all(-1) for q in new]).all(0)
            new = new.select(ok, work)
            F, r, new_loss = evaluate(new)
            work = new
            cur_loss = torch.where(active, torch.where(ok, new_loss, torch.full_like(new_loss, math.inf)), cur_loss)
            steps = steps + active.long()
            t += 1

    hist = pd.DataFrame(rows).sort_values(["seed", "step"], kind="stable").reset_index(drop=True)
    hist.attrs.update(method=method, lr=lr, damping=damping.label() if method == "GN" else None, n=n, act=act)
    return Run(final, params0, hist, spectra)


def loss_envelope(history: pd.DataFrame) -> pd.DataFrame:
    r"""Envelopes of :math:`\Loss_t/\Loss_0` from the spectra recorded at every step of a :func:`train` run
    (``record_every=1, spectrum=True``), for the linearised steps (chapter 20).

    GN: :math:`\prod_{s<t}(1-\eta\nu^{+}_s)^2\le\Loss_t/\Loss_0\le\prod_{s<t}(1-\eta\nu^{-}_s)^2` with
    :math:`\nu^{\pm}=\lambda_{\max/\min}(K)/(\lambda_{\max/\min}(K)+\lamGN)`; GD: the same with
    :math:`\eta\nu^{\pm}` replaced by :math:`\texttt{lr}\,\lambda_{\max/\min}(K)/n` (valid while
    :math:`\texttt{lr}\,\lmax(K)/n\le1`). Returns seed, step, fs_time, rel_loss, lower, upper.
    """
    if not isinstance(history, pd.DataFrame):
        raise TypeError(f"history must be a pandas DataFrame from train(), got {type(history).__name__}")
    need = {"seed", "step", "fs_time", "rel_loss", "lam_min_K", "lam_max_K", "method", "lr"}
    if not need <= set(history.columns):
        raise ValueError(f"history must come from train(..., record_every=1, spectrum=True); missing "
                         f"{sorted(need - set(history.columns))}")
    n = history.attrs.get("n")
    if n is None:
        raise ValueError("history.attrs must hold n (a frame returned by train())")
    out = []
    for seed, h in history.groupby("seed", sort=True):
        h = h.sort_values("step")
        if not np.array_equal(h.step.to_numpy(), np.arange(len(h))):
            raise ValueError("history must hold every step (train with record_every=1)")
        lo_f, hi_f = h.lam_max_K.to_numpy()[1:], h.lam_min_K.to_numpy()[1:]
        if h.method.iloc[0] == "GN":
            lam, eta = h.lam_gn.to_numpy()[1:], h.eta.iloc[0]
            fast, slow = 1 - eta * lo_f / (lo_f + lam), 1 - eta * np.clip(hi_f, 0, None) / (np.clip(hi_f, 0, None) + lam)
        else:
            lr = h.lr.iloc[0]
            fast, slow = 1 - lr * lo_f / n, 1 - lr * np.clip(hi_f, 0, None) / n
        lower = np.concatenate([[1.0], np.cumprod(fast ** 2)])
        upper = np.concatenate([[1.0], np.cumprod(slow ** 2)])
        out.append(pd.DataFrame({"seed": seed, "step": h.step.to_numpy(), "fs_time": h.fs_time.to_numpy(),
                                 "rel_loss": h.rel_loss.to_numpy(), "lower": lower, "upper": upper}))
    return pd.concat(out, ignore_index=True)


def at_step(history: pd.DataFrame, step: int) -> pd.DataFrame:
    """One row per seed: the record at ``step``, or the seed's last record if it stopped earlier (its final state)."""
    if not isinstance(history, pd.DataFrame) or not {"seed", "step"} <= set(history.columns):
        raise TypeError("history must be a frame returned by train()")
    step = check_int("step", step, min_value=0)
    h = history[history.step <= step]
    return h.sort_values(["seed", "step"]).groupby("seed").tail(1).reset_index(drop=True)


def first_crossing(history: pd.DataFrame, column: str, threshold: float) -> pd.DataFrame:
    """One row per seed: the first record where ``column`` <= ``threshold`` (e.g. matched training loss); seeds that
    never cross are left out."""
    if not isinstance(history, pd.DataFrame) or column not in history.columns:
        raise ValueError(f"column must be a column of history, got {column!r}")
    h = history[history[column] <= threshold]
    return h.sort_values(["seed", "step"]).groupby("seed").head(1).reset_index(drop=True)


def richardson(steps, values, *, max_order: float = 8.0) -> pd.DataFrame:
    r"""Richardson extrapolation to the flow limit with a **fitted order** (chapter 21, the flow-limit test).

    For three step sizes :math:`\eta_1>\eta_2>\eta_3` and a statistic that behaves like
    :math:`\mathcal Y(\eta)=\mathcal Y_0+\mathcal Y_1\eta^{\varpi}` near the flow (:math:`\eta\to0`), the ratio of
    successive differences

    .. math::

        \frac{\mathcal Y(\eta_1)-\mathcal Y(\eta_2)}{\mathcal Y(\eta_2)-\mathcal Y(\eta_3)}
        =\frac{\eta_1^{\varpi}-\eta_2^{\varpi}}{\eta_2^{\varpi}-\eta_3^{\varpi}}

    fixes the order :math:`\varpi` (for a geometric triple, :math:`\eta_1/\eta_2=\eta_2/\eta_3`, it is
    :math:`(\eta_1/\eta_2)^{\varpi}`); then
    :math:`\mathcal Y_1=(\mathcal Y(\eta_2)-\mathcal Y(\eta_3))/(\eta_2^{\varpi}-\eta_3^{\varpi})`, the extrapolated
    flow value :math:`\hat{\mathcal Y}_0=\mathcal Y(\eta_3)-\mathcal Y_1\eta_3^{\varpi}` and the error of each step
    :math:`|\mathcal Y_1|\eta_k^{\varpi}`. Nothing is assumed about :math:`\varpi` (a first-order allowance would assume
    :math:`\varpi=1`). (The order is :math:`\varpi`, as on the book's notation page, where :math:`p` is the parameter count.)

    The order is **undetermined** — ``order``, ``flow`` and the errors are NaN, ``determined`` is False and
    ``reason`` says why — when the two differences have opposite signs or the second is zero (the ratio is
    :math:`\le0`: the statistic is not monotone in :math:`\eta`), when they do not shrink as fast as any positive order
    requires (the ratio at or below its :math:`\varpi\to0` limit :math:`\ln(\eta_1/\eta_2)/\ln(\eta_2/\eta_3)`), or
    when the fitted order exceeds ``max_order``.

    ``steps``: three decreasing positive numbers; ``values``: shape ``(3,)`` or ``(3, R)`` (one column per replicate).
    Returns one row per replicate: ``order``, ``flow``, ``error_1``, ``error_2``, ``error_3``, ``determined``,
    ``reason``.
    """
    from scipy.optimize import brentq

    h = np.asarray(steps, dtype=float).reshape(-1)
    if h.shape != (3,) or not np.isfinite(h).all() or not (h > 0).all() or not (h[0] > h[1] > h[2]):
        raise ValueError(f"steps must be three decreasing positive numbers, got {steps!r}")
    M = np.asarray(values, dtype=float)
    if M.ndim == 1:
        M = M[:, None]
    if M.ndim != 2 or M.shape[0] != 3 or not np.isfinite(M).all():
        raise ValueError(f"values must be finite with shape (3,) or (3, R), one row per step, got {np.shape(values)}")
    max_order = check_positive("max_order", max_order)
    ratio = lambda p: (h[0] ** p - h[1] ** p) / (h[1] ** p - h[2] ** p)
    low, high = np.log(h[0] / h[1]) / np.log(h[1] / h[2]), ratio(max_order)
    rows = []
    for r in range(M.shape[1]):
        d12, d23 = M[0, r] - M[1, r], M[1, r] - M[2, r]
        row = {"order": np.nan, "flow": np.nan, "error_1": np.nan, "error_2": np.nan, "error_3": np.nan,
               "determined": False, "reason": ""}
        rho = d12 / d23 if d23 != 0 else np.nan
        if not np.isfinite(rho) or rho <= 0:
            row["reason"] = "not monotone in the step (the differences change sign)"
        elif rho <= low:
            row["reason"] = "the differences do not shrink with the step (no positive order)"
        elif rho >= high:
            row["reason"] = f"fitted order above {max_order:g}"
        else:
            p = brentq(lambda q: ratio(q) - rho, 1e-9, max_order, xtol=1e-12)
            C = d23 / (h[1] ** p - h[2] ** p)
            row.update(order=p, flow=M[2, r] - C * h[2] ** p, determined=True,
                       **{f"error_{k + 1}": abs(C) * h[k] ** p for k in range(3)})
        rows.append(row)
    return pd.DataFrame(rows)


def rank_correlation(x, y, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    r"""Spearman rank correlation of paired samples with a percentile-bootstrap interval (pairs resampled).

    Returns ``{"rho", "low", "high", "se", "n"}``; ``se`` is the bootstrap standard deviation. Used for the WCD vs
    Test-LRFit agreement (chapter 21) and the step-size trends (chapter 22)."""
    from scipy.stats import rankdata, spearmanr

    a = np.asarray(x, dtype=float)
    b = np.asarray(y, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or a.size < 3:
        raise ValueError(f"x and y must be 1-D of the same length >= 3, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("x and y must be finite")
    n_boot = check_int("n_boot", n_boot, min_value=10)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rho = float(spearmanr(a, b).statistic)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, (n_boot, a.size))
    ra, rb = rankdata(a[idx], axis=1), rankdata(b[idx], axis=1)   # Spearman = Pearson on ranks
    ra, rb = ra - ra.mean(1, keepdims=True), rb - rb.mean(1, keepdims=True)
    den = np.sqrt((ra ** 2).sum(1) * (rb ** 2).sum(1))
    boots = (ra * rb).sum(1)[den > 0] / den[den > 0]
    q = (1 - level) / 2
    return {"rho": rho, "low": float(np.quantile(boots, q)), "high": float(np.quantile(boots, 1 - q)),
            "se": float(boots.std(ddof=1)), "n": int(a.size)}


# ============================================================================================ data: MNIST (IDX), digits
# The IDX reader and the MNIST loader are curvlab.data's (bounded and checked: a size cap on what is read and
# decompressed, the official layout and checksums, labels 0..9, errors naming the file); re-exported here.
from .data import load_mnist, mnist_available, read_idx, write_idx  # noqa: E402


def _classification_data(Xall: np.ndarray, labels: np.ndarray, seeds, n: int, n_test: int, dtype, device,
                         act: str, n_classes: int = 10) -> Data:
    d_y = n_classes
    if int(labels.max()) >= d_y:
        raise ValueError(f"labels must lie in 0..{d_y - 1}, got a label {int(labels.max())}")
    Xs, Ys, Xts, Yts = [], [], [], []
    for s in seeds:
        perm = np.random.default_rng(int(s)).permutation(len(labels))
        tr, te = perm[:n], perm[n:n + n_test]
        onehot = np.eye(d_y)[labels]
        Xs.append(Xall[tr]), Ys.append(onehot[tr]), Xts.append(Xall[te]), Yts.append(onehot[te])
    conv = lambda a: torch.as_tensor(np.stack(a), dtype=dtype, device=device)
    return Data(conv(Xs), conv(Ys), conv(Xts), conv(Yts), act, None)


def load_digits_data(seeds: Sequence[int] = (0,), *, n: int = 1000, n_test: int | None = None, act: str = "relu",
                     dtype: torch.dtype = torch.float64, device=None) -> Data:
    r"""scikit-learn's 8×8 digits (bundled, offline) for chapter 22: pixels scaled to :math:`[0,1]`, the pixels that are
    0 in every image dropped (:math:`d=61`), one-hot targets (squared loss on the 10 outputs, as in the review's MNIST
    protocol); a seeded split into ``n`` training and ``n_test`` test images (default: the rest), one per seed."""
    act = _check_act(act)
    from ._validate import _require

    load_digits = _require("sklearn.datasets", purpose="the digits data (load_digits_data)").load_digits

    X, labels = load_digits(return_X_y=True)
    keep = X.std(axis=0) > 0
    X = X[:, keep] / 16.0
    n = check_int("n", n, min_value=1)
    n_test = len(labels) - n if n_test is None else check_int("n_test", n_test, min_value=1)
    if n + n_test > len(labels):
        raise ValueError(f"n + n_test must be <= {len(labels)} images, got {n} + {n_test}")
    return _classification_data(X, labels, seeds, n, n_test, dtype, device, act)


def mnist_data(seeds: Sequence[int] = (0,), *, n: int = 1000, n_test: int = 10_000, act: str = "relu",
               root: str | os.PathLike | None = None, dtype: torch.dtype = torch.float64, device=None,
               verify: bool = True) -> Data:
    """MNIST from IDX files (:func:`load_mnist`; ``verify``: the official files only), pixels scaled to
    :math:`[0,1]`, one-hot targets; training images from the training split, test images from the test split, each
    seeded."""
    act = _check_act(act)
    Xtr, ltr = load_mnist(root, "train", verify=verify)
    Xte, lte = load_mnist(root, "test", verify=verify)
    Xtr = Xtr.reshape(len(Xtr), -1) / 255.0
    Xte = Xte.reshape(len(Xte), -1) / 255.0
    a = _classification_data(Xtr, ltr, seeds, n, 1, dtype, device, act)
    b = _classification_data(Xte, lte, seeds, n_test, 1, dtype, device, act)
    return Data(a.X, a.Y, b.X, b.Y, act, None)


__all__.append("mnist_data")
