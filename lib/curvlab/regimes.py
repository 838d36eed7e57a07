r"""Regimes of wide two-layer networks: NTK, mean-field and µP scalings; lazy versus rich training.

Chapter *Regimes of wide two-layer networks* (``notebooks/03_wide_regimes``). The model is

.. math::

    f_\theta(x) = \nu\, s(m) \sum_{i=1}^m v_i\, \phi\big(h(m)\,(w_i^\top x + b_i)\big),
    \qquad s(m) = m^{-\mathsf a_2},\quad h(m) = m^{-\mathsf a_1},

with trainable :math:`\theta = (W, b, v)`, :math:`W \in \mathbb R^{m \times d}` (rows :math:`w_i^\top`), biases
:math:`b \in \mathbb R^m`, output weights :math:`v \in \mathbb R^m`, and the lazy-training factor :math:`\nu`
(Chizat, Oyallon & Bach 2019 call it :math:`\alpha`; the book reserves :math:`\alpha` for the leaky-ReLU slope).
A :class:`Parametrisation` fixes, per layer :math:`l \in \{1, 2\}` (1: :math:`(W, b)`, 2: :math:`v`), the
multiplier exponent :math:`\mathsf a_l`, the initial-scale exponent :math:`\mathsf b_l` (trainable entries drawn
with standard deviation :math:`\sigma\, m^{-\mathsf b_l}`) and the step-size exponent :math:`\mathsf c_l` (step
size :math:`\eta_0\, m^{-\mathsf c_l}`): the abc-parametrisation of Yang & Hu (2021), with one :math:`\mathsf c`
per layer. Sans-serif letters keep them apart from the book's biases :math:`b` and constant :math:`c_1`.

Loss: :math:`\mathcal L = \frac1{2n}\lVert f_\theta(X) - y\rVert^2`; training is full-batch gradient descent,
each layer with its own step size, vectorised over a leading **seed** dimension ``S``: every tensor is
``(S, ...)`` and one call trains ``S`` independent networks (independent data and teachers too).
Device and dtype follow the inputs.

Learning-rate-weighted tangent kernel (the matrix that drives the function-space dynamics
:math:`f_{t+1} \approx f_t - \frac{\eta_0}{n} K^\eta (f_t - y)`):

.. math::

    K^\eta = \sum_{\text{blocks } B} \frac{\eta_B}{\eta_0} J_B J_B^\top
    = \nu^2 s^2 \Big[\tfrac{\eta_v}{\eta_0}\, \Phi\Phi^\top
      + \tfrac{\eta_W}{\eta_0}\, h^2\, (A A^\top) \odot (X X^\top + \mathbf 1_n \mathbf 1_n^\top)\Big],

with :math:`\Phi = \phi(Z)`, :math:`A = \phi'(Z)\operatorname{diag}(v)`, :math:`Z = h(XW^\top + \mathbf 1_n b^\top)`.
With ``lr_weighted=False`` it is the plain empirical NTK Gram matrix :math:`K = JJ^\top`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from . import config, linalg
from .linalg import default_rtol
from ._validate import as_tensor, check_choice, check_finite, check_int, check_nonnegative, check_positive
from .plotting import style as plotting_style
from .progress import progress

__all__ = [
    "ACTIVATIONS",
    "activation",
    "Parametrisation",
    "NTK",
    "MEAN_FIELD",
    "MUP",
    "MUP_ABC",
    "PARAMETRISATIONS",
    "interpolating",
    "Teacher",
    "make_teacher",
    "sample",
    "TwoLayer",
    "init_two_layer",
    "forward",
    "loss",
    "gradients",
    "gd_step",
    "GDRun",
    "train_gd",
    "tangent_kernel",
    "LinearisedRun",
    "linearised_gd",
    "linearised_forward",
    "relative_distance",
    "kernel_change",
    "teacher_alignment",
    "wcd",
    "top_subspace_distance",
    "refit_test_loss",
    "limiting_ntk",
    "SlopeFit",
    "slope_fit",
    "width_sweep",
    "summarise",
    "LABELS",
    "plot_metric",
]


# ------------------------------------------------------------------------------------------------ activations
def _dtanh(z: torch.Tensor) -> torch.Tensor:
    return 1.0 - torch.tanh(z).square()


def _dsilu(z: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(z)
    return sig * (1.0 + z * (1.0 - sig))


def _drelu(z: torch.Tensor) -> torch.Tensor:
    return (z > 0).to(z.dtype)


ACTIVATIONS = {
    "tanh": (torch.tanh, _dtanh),
    "silu": (torch.nn.functional.silu, _dsilu),
    "relu": (torch.relu, _drelu),
}


def activation(name: str):
    r"""The pair :math:`(\phi, \phi')` for ``name`` in ``ACTIVATIONS`` (``'tanh'``, ``'silu'``, ``'relu'``)."""
    check_choice("act", name, tuple(ACTIVATIONS))
    return ACTIVATIONS[name]


def _phi_dphi(act: str, Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`\phi(Z)` and :math:`\phi'(Z)`, sharing the work where the derivative is a function of the value.

    ``Z`` is consumed: for ``tanh`` the derivative is written into its storage (one large allocation less per
    call), unless ``Z`` takes part in autograd."""
    phi, dphi = activation(act)
    T = phi(Z)
    if act != "tanh":
        return T, dphi(Z)
    if Z.requires_grad:
        return T, 1.0 - T.square()
    return T, torch.mul(T, T, out=Z).neg_().add_(1.0)


# ------------------------------------------------------------------------------------------------ parametrisations
@dataclass(frozen=True)
class Parametrisation:
    r"""An abc-parametrisation of the two-layer network (Yang & Hu 2021), with one step-size exponent per layer.

    Layer 1 is :math:`(W, b)`, layer 2 is :math:`v`. For layer :math:`l`: multiplier :math:`m^{-\mathsf a_l}`,
    trainable entries initialised with standard deviation :math:`\sigma\,m^{-\mathsf b_l}` (:math:`\sigma` is
    :math:`\sigma_0`, :math:`\sigma_b` or :math:`\sigma_v`), step size :math:`\eta_0\,m^{-\mathsf c_l}`.
    Gradient descent on a layer depends on :math:`(\mathsf a_l, \mathsf b_l, \mathsf c_l)` only through the
    **invariants** :math:`(\mathsf a_l + \mathsf b_l,\ \mathsf c_l + 2\mathsf a_l)`: the initial scale and the
    step size of the *effective* weights (chapter 03, per-layer invariance lemma).
    """

    name: str
    a_hidden: float
    a_out: float
    b_hidden: float
    b_out: float
    c_hidden: float
    c_out: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("name must be a non-empty string")
        for f in fields(self)[1:]:
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{f.name} must be a finite real exponent, got {v!r}")

    def multipliers(self, m: int) -> tuple[float, float]:
        r"""``(h, s)`` = :math:`(m^{-\mathsf a_1}, m^{-\mathsf a_2})`: hidden and output multipliers."""
        m = check_int("m", m, min_value=1)
        return m ** (-self.a_hidden), m ** (-self.a_out)

    def init_scales(self, m: int) -> tuple[float, float]:
        r""":math:`(m^{-\mathsf b_1}, m^{-\mathsf b_2})`: factors on the initial standard deviations."""
        m = check_int("m", m, min_value=1)
        return m ** (-self.b_hidden), m ** (-self.b_out)

    def step_sizes(self, m: int, eta0: float) -> tuple[float, float]:
        r""":math:`(\eta_W, \eta_v) = (\eta_0 m^{-\mathsf c_1}, \eta_0 m^{-\mathsf c_2})`; ``(W, b)`` share :math:`\eta_W`."""
        m = check_int("m", m, min_value=1)
        eta0 = check_positive("eta0", eta0)
        return eta0 * m ** (-self.c_hidden), eta0 * m ** (-self.c_out)

    def invariants(self) -> tuple[tuple[float, float], tuple[float, float]]:
        r"""Per layer :math:`(\mathsf a_l + \mathsf b_l, \mathsf c_l + 2\mathsf a_l)`: equal invariants, equal training."""
        return ((self.a_hidden + self.b_hidden, self.c_hidden + 2 * self.a_hidden),
                (self.a_out + self.b_out, self.c_out + 2 * self.a_out))


#: The NTK parametrisation (Jacot et al. 2018) — output multiplier m^{-1/2}, O(1) initialisation, step eta0.
NTK = Parametrisation("NTK", a_hidden=0.0, a_out=0.5, b_hidden=0.0, b_out=0.0, c_hidden=0.0, c_out=0.0)
#: The mean-field parametrisation (Mei et al. 2018, Chizat & Bach 2018) — output multiplier 1/m, step eta0 * m.
MEAN_FIELD = Parametrisation("mean-field", a_hidden=0.0, a_out=1.0, b_hidden=0.0, b_out=0.0, c_hidden=-1.0, c_out=-1.0)
#: µP in the per-layer-step form — no multipliers, output weights initialised with std sigma_v/m, step
#: eta0 * m on (W, b) and eta0 / m on v. Same invariants as MEAN_FIELD.
MUP = Parametrisation("muP", a_hidden=0.0, a_out=0.0, b_hidden=0.0, b_out=1.0, c_hidden=-1.0, c_out=1.0)
#: µP in Yang & Hu's abc form with one global step size, a = (-1/2, 1/2), b = (1/2, 1/2), c = 0.
MUP_ABC = Parametrisation("muP-abc", a_hidden=-0.5, a_out=0.5, b_hidden=0.5, b_out=0.5, c_hidden=0.0, c_out=0.0)

PARAMETRISATIONS = {p.name: p for p in (NTK, MEAN_FIELD, MUP, MUP_ABC)}


def interpolating(a_out: float) -> Parametrisation:
    r"""Output multiplier :math:`m^{-a}` with the step size :math:`\eta_0 m^{2a-1}` that keeps :math:`K^\eta = O(1)`.

    ``a_out = 1/2`` is :data:`NTK`, ``a_out = 1`` is :data:`MEAN_FIELD`; in between the training is lazy with
    relative displacement :math:`O(m^{a-1})` (chapter 03, lazy law).
    """
    a = check_nonnegative("a_out", a_out)
    return Parametrisation(f"a={a:g}", a_hidden=0.0, a_out=a, b_hidden=0.0, b_out=0.0,
                           c_hidden=1.0 - 2 * a, c_out=1.0 - 2 * a)


def _param(param) -> Parametrisation:
    if isinstance(param, str):
        check_choice("param", param, tuple(PARAMETRISATIONS))
        return PARAMETRISATIONS[param]
    if not isinstance(param, Parametrisation):
        raise TypeError(f"param must be a Parametrisation or one of {list(PARAMETRISATIONS)}, got {type(param).__name__}")
    return param


# ------------------------------------------------------------------------------------------------ teacher and data
@dataclass(frozen=True)
class Teacher:
    r"""A batch of ``S`` teacher networks :math:`y = \frac{1}{\varsigma}\sum_{j} v_{\star j}\,\phi(w_{\star j}^\top x + b_{\star j})`.

    ``W_teacher``: ``(S, m_teacher, d)`` with orthogonal rows of norm ``weight_norm``; ``b``, ``v``:
    ``(S, m_teacher)``; ``y_scale`` :math:`\varsigma`: ``(S,)``, chosen so that :math:`\mathbb E y^2 = 1` for
    :math:`x \sim \mathcal N(0, I_d)` (estimated once by Monte Carlo).
    """

    W_teacher: torch.Tensor
    b: torch.Tensor
    v: torch.Tensor
    act: str
    y_scale: torch.Tensor

    def __call__(self, X) -> torch.Tensor:
        X = _check_X("X", X, self.W_teacher.shape[0], self.W_teacher.shape[-1], self.W_teacher)
        phi, _ = activation(self.act)
        Z = torch.baddbmm(self.b.unsqueeze(-1), self.W_teacher, X.transpose(1, 2))  # (S, m*, n)
        return (self.v.unsqueeze(1) @ phi(Z)).squeeze(1) / self.y_scale.unsqueeze(-1)


def make_teacher(n_seeds: int, d: int, m_teacher: int, *, weight_norm: float = 1.5, bias_std: float = 0.5,
                 out_weights: str = "gaussian", act: str = "tanh", generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float64, device=None, n_mc: int = 20_000) -> Teacher:
    r"""``n_seeds`` random teachers in dimension ``d`` with ``m_teacher <= d`` neurons (see :class:`Teacher`).

    Rows of :math:`W_\star` are orthogonal with norm ``weight_norm``, :math:`b_\star \sim \mathcal N(0,`
    ``bias_std``:math:`^2)`; output weights :math:`v_\star \sim \mathcal N(0, 1)` (``out_weights="gaussian"``,
    as in Arbel et al.'s code) or random signs :math:`\pm 1` (``"signs"``: every teacher neuron matters equally).
    The output is normalised to unit second moment with ``n_mc`` Monte Carlo inputs. Random draws happen on the
    CPU with ``generator``, then move to ``device``.
    """
    S = check_int("n_seeds", n_seeds, min_value=1)
    d = check_int("d", d, min_value=1)
    k = check_int("m_teacher", m_teacher, min_value=1)
    if k > d:
        raise ValueError(f"m_teacher must be <= d = {d} (orthogonal teacher neurons), got {k}")
    weight_norm, bias_std = check_positive("weight_norm", weight_norm), check_nonnegative("bias_std", bias_std)
    check_choice("out_weights", out_weights, ("gaussian", "signs"))
    activation(act)
    n_mc = check_int("n_mc", n_mc, min_value=100)
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(S, d, k, generator=g, dtype=torch.float64))
    W = weight_norm * Q.transpose(1, 2)
    b = bias_std * torch.randn(S, k, generator=g, dtype=torch.float64)
    v = torch.randn(S, k, generator=g, dtype=torch.float64)
    if out_weights == "signs":
        v = v.sign()
    Xmc = torch.randn(S, n_mc, d, generator=g, dtype=torch.float64)
    raw = Teacher(W, b, v, act, torch.ones(S, dtype=torch.float64))(Xmc)
    scale = raw.square().mean(dim=1).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    return Teacher(*(t.to(dtype=dtype, device=device) for t in (W, b, v)), act, scale.to(dtype=dtype, device=device))


def sample(teacher: Teacher, n: int, *, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``n`` fresh inputs :math:`x \sim \mathcal N(0, I_d)` per seed and their labels: ``X (S, n, d)``, ``y (S, n)``."""
    if not isinstance(teacher, Teacher):
        raise TypeError(f"teacher must be a Teacher (see make_teacher), got {type(teacher).__name__}")
    n = check_int("n", n, min_value=1)
    S, _, d = teacher.W_teacher.shape
    g = generator if generator is not None else torch.Generator().manual_seed(1)
    X = torch.randn(S, n, d, generator=g, dtype=torch.float64).to(teacher.W_teacher)
    return X, teacher(X)


# ------------------------------------------------------------------------------------------------ the network
@dataclass(frozen=True)
class TwoLayer:
    r"""Trainable parameters of ``S`` two-layer networks: ``W (S, m, d)``, ``b (S, m)``, ``v (S, m)``.

    The *effective* weights are :math:`h(m) W` and :math:`s(m) v` (see :class:`Parametrisation`).
    """

    W: torch.Tensor
    b: torch.Tensor
    v: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(S, m, d)``."""
        return tuple(self.W.shape)

    def clone(self) -> "TwoLayer":
        return TwoLayer(self.W.clone(), self.b.clone(), self.v.clone())


def _check_params(params) -> TwoLayer:
    if not isinstance(params, TwoLayer):
        raise TypeError(f"params must be a TwoLayer (see init_two_layer), got {type(params).__name__}")
    W, b, v = params.W, params.b, params.v
    if W.dim() != 3 or b.shape != W.shape[:2] or v.shape != W.shape[:2]:
        raise ValueError(f"params must have W (S, m, d), b (S, m), v (S, m); got {tuple(W.shape)}, "
                         f"{tuple(b.shape)}, {tuple(v.shape)}")
    for name, t in (("params.W", W), ("params.b", b), ("params.v", v)):
        check_finite(name, t)
    return params


def _check_X(name: str, X, S: int, d: int, like: torch.Tensor) -> torch.Tensor:
    X = check_finite(name, as_tensor(name, X, dtype=like.dtype, device=like.device))
    if X.dim() == 2:
        X = X.unsqueeze(0).expand(S, *X.shape)
    if X.dim() != 3 or X.shape[0] != S or X.shape[2] != d or X.shape[1] == 0:
        raise ValueError(f"{name} must have shape (S={S}, n, d={d}) or (n, d={d}), got {tuple(X.shape)}")
    return X


def _check_y(name: str, y, X: torch.Tensor) -> torch.Tensor:
    y = check_finite(name, as_tensor(name, y, dtype=X.dtype, device=X.device))
    if y.shape != X.shape[:2]:
        raise ValueError(f"{name} must have shape {tuple(X.shape[:2])} (S, n), got {tuple(y.shape)}")
    return y


def init_two_layer(n_seeds: int, m: int, d: int, param, *, init_std: float | None = None, bias_std: float = 0.5,
                   out_std: float = 1.0, symmetric: bool = True, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.float64, device=None) -> TwoLayer:
    r"""Initial parameters of ``n_seeds`` networks of width ``m``.

    Entries: :math:`W_{ij} \sim \mathcal N(0, \sigma_0^2 m^{-2\mathsf b_1})`, :math:`b_i \sim \mathcal N(0,
    \sigma_b^2 m^{-2\mathsf b_1})`, :math:`v_i \sim \mathcal N(0, \sigma_v^2 m^{-2\mathsf b_2})`, with
    :math:`\sigma_0` = ``init_std`` (default :math:`1/\sqrt d`), :math:`\sigma_b` = ``bias_std``,
    :math:`\sigma_v` = ``out_std``. With ``symmetric=True`` (``m`` even) the second half of the neurons copies
    the first with :math:`v \to -v`, so :math:`f_{\theta_0} \equiv 0` exactly while the tangent kernel keeps the
    same expectation (the centring used for lazy training). The underlying Gaussian draws depend only on
    ``generator`` and the shapes, so two parametrisations initialised with equally seeded generators are the
    same network written in two ways.
    """
    S = check_int("n_seeds", n_seeds, min_value=1)
    m = check_int("m", m, min_value=1)
    d = check_int("d", d, min_value=1)
    p = _param(param)
    init_std = 1.0 / math.sqrt(d) if init_std is None else check_positive("init_std", init_std)
    bias_std, out_std = check_nonnegative("bias_std", bias_std), check_positive("out_std", out_std)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    if symmetric and m % 2:
        raise ValueError(f"m must be even for a symmetric initialisation, got {m}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    k = m // 2 if symmetric else m
    W = torch.randn(S, k, d, generator=g, dtype=torch.float64)
    b = torch.randn(S, k, generator=g, dtype=torch.float64)
    v = torch.randn(S, k, generator=g, dtype=torch.float64)
    if symmetric:
        W, b, v = torch.cat([W, W], 1), torch.cat([b, b], 1), torch.cat([v, -v], 1)
    sh, so = p.init_scales(m)
    return TwoLayer((init_std * sh * W).to(dtype=dtype, device=device), (bias_std * sh * b).to(dtype=dtype, device=device),
                    (out_std * so * v).to(dtype=dtype, device=device))


def _hidden(params: TwoLayer, X: torch.Tensor, p: Parametrisation):
    """Pre-activations in (S, m, n) layout (the fast one on CPUs: the d-contraction is a batched matmul)."""
    h, s = p.multipliers(params.W.shape[1])
    Z = h * torch.baddbmm(params.b.unsqueeze(-1), params.W, X.transpose(1, 2))
    return Z, h, s


def _lazy(lazy_factor: float) -> float:
    return check_positive("lazy_factor", lazy_factor)


_CHUNK_ELEMENTS = 2**20


def _chunk(S: int, m: int) -> int:
    """Inputs per chunk so that an ``(S, m, chunk)`` activation tensor stays below ``2**20`` entries (8 MB in
    float64): small enough for the allocator to reuse memory instead of mapping fresh pages for every chunk."""
    return max(1, _CHUNK_ELEMENTS // (S * m))


def forward(params, X, param, *, act: str = "tanh", lazy_factor: float = 1.0) -> torch.Tensor:
    r"""Outputs :math:`f_\theta(X)`, shape ``(S, n)``; ``X`` is ``(S, n, d)`` or shared ``(n, d)``.

    Evaluated in chunks of inputs so that a large test set never needs an ``(S, m, n)`` tensor at once.
    """
    params, p, nu = _check_params(params), _param(param), _lazy(lazy_factor)
    phi, _ = activation(act)
    S, m, d = params.shape
    X = _check_X("X", X, S, d, params.W)
    chunk = _chunk(S, m)
    out = []
    for X_c in X.split(chunk, dim=1):
        Z, _, s = _hidden(params, X_c, p)
        out.append(nu * s * (params.v.unsqueeze(1) @ phi(Z)).squeeze(1))
    return torch.cat(out, dim=1)


def loss(params, X, y, param, *, act: str = "tanh", lazy_factor: float = 1.0) -> torch.Tensor:
    r"""Squared loss :math:`\mathcal L = \frac1{2n}\lVert f_\theta(X) - y\rVert^2` per seed, shape ``(S,)``."""
    params = _check_params(params)
    S, _, d = params.shape
    X = _check_X("X", X, S, d, params.W)
    y = _check_y("y", y, X)
    return 0.5 * (forward(params, X, param, act=act, lazy_factor=lazy_factor) - y).square().mean(dim=1)


def gradients(params, X, y, param, *, act: str = "tanh", lazy_factor: float = 1.0) -> tuple[TwoLayer, torch.Tensor]:
    r"""Closed-form gradients of :math:`\mathcal L` with respect to the trainable ``(W, b, v)``, and the loss.

    With :math:`r = (f - y)/n`, :math:`\Phi = \phi(Z)`, :math:`D = \phi'(Z)`:
    :math:`\nabla_v\mathcal L = \nu s\,\Phi^\top r`,
    :math:`\nabla_{w_i}\mathcal L = \nu s h\, v_i \sum_x r(x)\,\phi'(z_i(x))\,x`,
    :math:`\nabla_{b_i}\mathcal L = \nu s h\, v_i \sum_x r(x)\,\phi'(z_i(x))`.
    """
    params, p, nu = _check_params(params), _param(param), _lazy(lazy_factor)
    S, _, d = params.shape
    X = _check_X("X", X, S, d, params.W)
    y = _check_y("y", y, X)
    return _gradients(params, X, y, p, act, nu)


def _gradients(params: TwoLayer, X: torch.Tensor, y: torch.Tensor, p: Parametrisation, act: str, nu: float):
    Z, h, s = _hidden(params, X, p)
    T, D = _phi_dphi(act, Z)                                     # phi(Z), phi'(Z): (S, m, n)
    f = nu * s * (params.v.unsqueeze(1) @ T).squeeze(1)          # (S, n)
    r = (f - y) / X.shape[1]
    G = D.mul_(r.unsqueeze(1)) if not D.requires_grad else D * r.unsqueeze(1)   # phi'(z_i(x)) r(x)
    coef = (nu * s * h) * params.v
    grad = TwoLayer(coef.unsqueeze(-1) * (G @ X), coef * G.sum(-1), nu * s * (T @ r.unsqueeze(-1)).squeeze(-1))
    return grad, 0.5 * (f - y).square().mean(dim=1)


def gd_step(params: TwoLayer, grad: TwoLayer, eta_W: float, eta_v: float, active: torch.Tensor) -> TwoLayer:
    r"""One gradient-descent step with per-layer step sizes, applied to the seeds where ``active`` is True:
    :math:`W \leftarrow W - \eta_W \nabla_W\mathcal L`, :math:`b \leftarrow b - \eta_W \nabla_b\mathcal L`,
    :math:`v \leftarrow v - \eta_v \nabla_v\mathcal L`."""
    a = active.to(params.W.dtype)
    return TwoLayer(params.W - (eta_W * a)[:, None, None] * grad.W,
                    params.b - (eta_W * a)[:, None] * grad.b,
                    params.v - (eta_v * a)[:, None] * grad.v)


@dataclass(frozen=True)
class GDRun:
    """Result of :func:`train_gd`: final parameters, steps taken and loss per seed, and the loss history
    ``(n_recorded, S)`` (a seed's loss stays constant once it has stopped)."""

    params: TwoLayer
    steps: torch.Tensor
    converged: torch.Tensor
    loss: torch.Tensor
    loss_history: torch.Tensor


def train_gd(params, X, y, param, *, eta0: float, target: float, max_steps: int, act: str = "tanh",
             lazy_factor: float = 1.0) -> GDRun:
    r"""Full-batch gradient descent until :math:`\mathcal L \le` ``target`` (per seed) or ``max_steps``.

    Step sizes :math:`\eta_W = \eta_0 m^{-\mathsf c_1}/\nu^2` and :math:`\eta_v = \eta_0 m^{-\mathsf c_2}/\nu^2`
    (the :math:`1/\nu^2` keeps the function-space dynamics independent of the lazy factor :math:`\nu`,
    Chizat, Oyallon & Bach 2019). Each seed stops at the first step at which its loss is at most ``target``
    (the stopping rule "GD to a fixed loss"); stopped seeds are frozen while the others continue.
    """
    params, p, nu = _check_params(params), _param(param), _lazy(lazy_factor)
    S, m, d = params.shape
    X = _check_X("X", X, S, d, params.W)
    y = _check_y("y", y, X)
    target = check_nonnegative("target", target)
    max_steps = check_int("max_steps", max_steps, min_value=0)
    eta_W, eta_v = (e / nu**2 for e in p.step_sizes(m, eta0))
    steps = torch.zeros(S, dtype=torch.long, device=X.device)
    history = []
    for _ in range(max_steps + 1):
        grad, current = _gradients(params, X, y, p, act, nu)
        history.append(current)
        active = current > target
        if not bool(active.any()) or len(history) > max_steps:
            break
        params = gd_step(params, grad, eta_W, eta_v, active)
        steps += active
    check_finite("the training loss (diverged: lower eta0)", current)
    return GDRun(params, steps, current <= target, current, torch.stack(history))


# ------------------------------------------------------------------------------------------------ tangent kernel
def tangent_kernel(params, X, param, *, X2=None, act: str = "tanh", lazy_factor: float = 1.0,
                   lr_weighted: bool = True) -> torch.Tensor:
    r"""Closed-form tangent kernel, ``(S, n2, n)``: :math:`K^\eta(X_2, X)` or, with ``lr_weighted=False``,
    the empirical NTK :math:`J(X_2) J(X)^\top`.

    .. math::

        K^\eta(x', x) = \nu^2 s^2 \Big[\tfrac{\eta_v}{\eta_0}\,\phi(z(x'))^\top \phi(z(x))
        + \tfrac{\eta_W}{\eta_0}\,h^2 \sum_i v_i^2 \phi'(z_i(x'))\phi'(z_i(x))\,(x'^\top x + 1)\Big].

    The ratios :math:`\eta_B/\eta_0 = m^{-\mathsf c_l}` do not depend on :math:`\eta_0`; the lazy factor's
    :math:`1/\nu^2` in the step sizes is *not* included, so :math:`K^\eta` scales like :math:`\nu^2`.
    Cost :math:`O(S\,m\,n\,n_2)` instead of the dense :math:`O(S\,n\,p)` Jacobian (tested against
    :func:`curvlab.curvature.kernel_matrix`). Returned in float64 (spectral work).
    """
    params, p, nu = _check_params(params), _param(param), _lazy(lazy_factor)
    if not isinstance(lr_weighted, bool):
        raise TypeError(f"lr_weighted must be a bool, got {type(lr_weighted).__name__}")
    activation(act)
    S, m, d = params.shape
    X = _check_X("X", X, S, d, params.W)
    X2 = X if X2 is None else _check_X("X2", X2, S, d, params.W)
    P = TwoLayer(*(config.spectral(t) for t in (params.W, params.b, params.v)))
    X, X2 = config.spectral(X), config.spectral(X2)
    w_W, w_v = p.step_sizes(m, 1.0) if lr_weighted else (1.0, 1.0)
    Z, h, s = _hidden(P, X, p)
    T, D = _phi_dphi(act, Z)
    T2, D2 = (T, D) if X2 is X else _phi_dphi(act, _hidden(P, X2, p)[0])
    A, A2 = D * P.v.unsqueeze(-1), D2 * P.v.unsqueeze(-1)
    K_v = T2.transpose(1, 2) @ T
    K_W = (A2.transpose(1, 2) @ A) * (X2 @ X.transpose(1, 2) + 1.0)
    return (nu * s) ** 2 * (w_v * K_v + w_W * h**2 * K_W)


# ------------------------------------------------------------------------------------------------ linearised model
@dataclass(frozen=True)
class LinearisedRun:
    r"""Gradient descent on the linearised model :math:`f_{\theta_0} + J_0(\theta - \theta_0)`.

    ``delta``: the displacement :math:`\theta_T - \theta_0` as a :class:`TwoLayer`; ``steps`` per seed;
    ``residual_sum`` :math:`\sum_{t<T} r_t` ``(S, n)`` (what :math:`J_0^\top` is applied to); ``loss``.
    """

    delta: TwoLayer
    steps: torch.Tensor
    residual_sum: torch.Tensor
    loss: torch.Tensor


def linearised_gd(params0, X, y, param, *, eta0: float, target: float, max_steps: int, act: str = "tanh",
                  lazy_factor: float = 1.0) -> LinearisedRun:
    r"""The linearised model trained with the same step sizes and stopping rule as :func:`train_gd`.

    In function space :math:`r_{t+1} = \big(I - \tfrac{\eta_0}{n\nu^2} K^\eta_0\big) r_t` with
    :math:`r_t = f_t - y`; the parameters move by :math:`\theta_T - \theta_0 = -\tfrac1n
    \operatorname{diag}(\eta_B/\nu^2)\,J_0^\top \sum_{t<T} r_t`, computed block by block in closed form
    (chapter 03, lazy law). Runs in float64.
    """
    params0, p, nu = _check_params(params0), _param(param), _lazy(lazy_factor)
    S, m, d = params0.shape
    X = _check_X("X", X, S, d, params0.W)
    y = _check_y("y", y, X)
    target = check_nonnegative("target", target)
    max_steps = check_int("max_steps", max_steps, min_value=0)
    eta0 = check_positive("eta0", eta0)
    activation(act)
    P = TwoLayer(*(config.spectral(t) for t in (params0.W, params0.b, params0.v)))
    Xs, ys = config.spectral(X), config.spectral(y)
    n = Xs.shape[1]
    K = tangent_kernel(P, Xs, p, act=act, lazy_factor=nu)
    r = forward(P, Xs, p, act=act, lazy_factor=nu) - ys
    acc, steps = torch.zeros_like(r), torch.zeros(S, dtype=torch.long, device=r.device)
    for _ in range(max_steps):
        active = 0.5 * r.square().mean(1) > target
        if not bool(active.any()):
            break
        ra = r * active.unsqueeze(-1)
        acc, steps = acc + ra, steps + active
        r = r - (eta0 / (n * nu**2)) * (K @ ra.unsqueeze(-1)).squeeze(-1)
    eta_W, eta_v = (e / nu**2 for e in p.step_sizes(m, eta0))
    Z, h, s = _hidden(P, Xs, p)
    T, D = _phi_dphi(act, Z)
    G = D * acc.unsqueeze(1)
    coef = (nu * s * h) * P.v
    delta = TwoLayer(-(eta_W / n) * coef.unsqueeze(-1) * (G @ Xs), -(eta_W / n) * coef * G.sum(-1),
                     -(eta_v / n) * nu * s * (T @ acc.unsqueeze(-1)).squeeze(-1))
    return LinearisedRun(delta, steps, acc, 0.5 * r.square().mean(1))


def linearised_forward(params0, delta, X, param, *, act: str = "tanh", lazy_factor: float = 1.0) -> torch.Tensor:
    r"""Outputs of the linearised model, :math:`f_{\theta_0}(X) + J_0(X)\,\Delta\theta`, shape ``(S, n)``.

    The Jacobian-vector product in closed form: :math:`J_0(x)\Delta\theta = \nu s\big[\Delta v^\top\phi(z(x))
    + \sum_i v_i\,\phi'(z_i(x))\,h\,(\Delta w_i^\top x + \Delta b_i)\big]`, one pass over the inputs
    (no ``n2 x n`` kernel). ``delta`` is a :class:`TwoLayer` displacement, e.g. ``linearised_gd(...).delta``.
    """
    params0, delta, p, nu = _check_params(params0), _check_params(delta), _param(param), _lazy(lazy_factor)
    if delta.shape != params0.shape:
        raise ValueError(f"delta must have the shape of params0 {params0.shape}, got {delta.shape}")
    activation(act)
    S, m, d = params0.shape
    X = _check_X("X", X, S, d, params0.W)
    out = []
    for X_c in X.split(_chunk(S, m), dim=1):
        Z, h, s = _hidden(params0, X_c, p)
        T, D = _phi_dphi(act, Z)
        dZ = h * torch.baddbmm(delta.b.unsqueeze(-1), delta.W, X_c.transpose(1, 2))
        f0 = (params0.v.unsqueeze(1) @ T).squeeze(1)
        jv = (delta.v.unsqueeze(1) @ T).squeeze(1) + (params0.v.unsqueeze(1) @ (D * dZ)).squeeze(1)
        out.append(nu * s * (f0 + jv))
    return torch.cat(out, dim=1)


# ------------------------------------------------------------------------------------------------ metrics
def relative_distance(params0, params1) -> torch.Tensor:
    r""":math:`\lVert W_T - W_0\rVert_F / \lVert W_0\rVert_F` of the hidden weights, per seed ``(S,)``.

    The ratio does not change when :math:`W` is multiplied by a constant, so it is the same for the trainable
    and the effective weights :math:`h(m)W`, and compares parametrisations directly.
    """
    params0, params1 = _check_params(params0), _check_params(params1)
    if params0.shape != params1.shape:
        raise ValueError(f"params0 and params1 must have the same shape, got {params0.shape} and {params1.shape}")
    W0, W1 = params0.W, params1.W.to(params0.W)
    return (W1 - W0).flatten(1).norm(dim=1) / W0.flatten(1).norm(dim=1)


def kernel_change(K0, K1) -> torch.Tensor:
    r""":math:`\lVert K_T - K_0\rVert_F / \lVert K_0\rVert_F` per seed, for kernels ``(S, n, n)`` (or ``(n, n)``)."""
    K0 = check_finite("K0", as_tensor("K0", K0))
    K1 = check_finite("K1", as_tensor("K1", K1, dtype=K0.dtype, device=K0.device))
    if K0.shape != K1.shape or K0.dim() < 2:
        raise ValueError(f"K0 and K1 must be (batches of) matrices of one shape, got {tuple(K0.shape)}, {tuple(K1.shape)}")
    return (K1 - K0).flatten(-2).norm(dim=-1) / K0.flatten(-2).norm(dim=-1)


def _teacher_rows(W, W_teacher) -> tuple[torch.Tensor, torch.Tensor]:
    W = check_finite("W", as_tensor("W", W))
    Wt = check_finite("W_teacher", as_tensor("W_teacher", W_teacher, dtype=W.dtype, device=W.device))
    if W.dim() not in (2, 3) or Wt.dim() not in (2, 3):
        raise ValueError(f"W must be (m, d) or (S, m, d) and W_teacher (m_teacher, d) or (S, m_teacher, d), got "
                         f"{tuple(W.shape)} and {tuple(Wt.shape)}")
    if W.dim() == 2:
        W = W.unsqueeze(0)
    if Wt.dim() == 2:
        Wt = Wt.unsqueeze(0).expand(W.shape[0], *Wt.shape)
    if W.dim() != 3 or Wt.dim() != 3 or W.shape[-1] != Wt.shape[-1] or W.shape[0] != Wt.shape[0]:
        raise ValueError(f"W (S, m, d) and W_teacher (S, m_teacher, d) must agree in S and d, got "
                         f"{tuple(W.shape)} and {tuple(Wt.shape)}")
    return W, Wt


def teacher_alignment(W, W_teacher) -> torch.Tensor:
    r"""Fraction of the hidden weights' energy in the teacher subspace, :math:`\lVert W\Pi_\star\rVert_F^2/\lVert W\rVert_F^2`.

    :math:`\Pi_\star` is the orthogonal projector onto :math:`\operatorname{rowsp}(W_\star)`. For isotropic
    random :math:`W` its expectation is :math:`\operatorname{rank}(W_\star)/d`; it is 1 when every neuron lies
    in the teacher subspace. ``W (S, m, d)``, ``W_teacher (S, m_teacher, d)`` (full row rank); returns ``(S,)``.
    """
    W, Wt = _teacher_rows(W, W_teacher)
    Q = linalg._row_basis("W_teacher", Wt).to(W.dtype)   # (S, d, k)
    return (W @ Q).flatten(1).square().sum(1) / W.flatten(1).square().sum(1)


def wcd(W, W_teacher, *, sign_invariant: bool = False) -> torch.Tensor:
    r"""Weighted cosine distance :math:`\mathrm{WCD} = \sum_i \rho_i \min_j \lVert \bar w_i - \bar w_{\star j}\rVert`
    (Arbel, Menegaux & Wolinski 2023), :math:`\rho_i = \lVert w_i\rVert^2/\sum_k \lVert w_k\rVert^2`.

    :math:`\bar w = w/\lVert w\rVert` (``0`` for ``w = 0``); :math:`\lVert\bar w - \bar w'\rVert = \sqrt{2(1-\cos)}`
    is the chord distance. ``sign_invariant=True`` takes the minimum over :math:`\pm\bar w_{\star j}` too, the
    right choice for an odd activation, where :math:`w` and :math:`-w` give the same feature up to the signs of
    :math:`v` and :math:`b`. Returns ``(S,)``.
    """
    W, Wt = _teacher_rows(W, W_teacher)
    if not isinstance(sign_invariant, bool):
        raise TypeError(f"sign_invariant must be a bool, got {type(sign_invariant).__name__}")
    norms = W.norm(dim=-1)
    if bool((norms.square().sum(-1) <= 0).any()):
        raise ValueError("W must have at least one nonzero row per seed (the weights rho_i are undefined otherwise)")
    Wbar = W / norms.clamp_min(torch.finfo(W.dtype).tiny).unsqueeze(-1)
    Tbar = Wt / Wt.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(W.dtype).tiny)
    if sign_invariant:
        Tbar = torch.cat([Tbar, -Tbar], dim=1)
    dist = torch.cdist(Wbar, Tbar).amin(dim=-1)        # (S, m)
    rho = norms.square() / norms.square().sum(-1, keepdim=True)
    return (rho * dist).sum(-1)


def top_subspace_distance(W, W_teacher, k: int | None = None) -> torch.Tensor:
    r"""Part I's subspace distance for a wide layer: :math:`\sin\psi_{\max}` between the span of the top-``k``
    right singular vectors of :math:`W` and :math:`\operatorname{rowsp}(W_\star)` (``k`` defaults to its rank).

    A layer with :math:`m \ge d` generic rows spans :math:`\mathbb R^d`, so its row space carries no information;
    its dominant directions do. Uses :func:`curvlab.linalg.sin_theta_distance`. Returns float64 ``(S,)``.
    """
    W, Wt = _teacher_rows(W, W_teacher)
    k = Wt.shape[1] if k is None else check_int("k", k, min_value=1)
    if k > min(W.shape[1], W.shape[2]):
        raise ValueError(f"k must be <= min(m, d) = {min(W.shape[1], W.shape[2])}, got {k}")
    W64 = config.spectral(W)
    _, U = torch.linalg.eigh(W64.transpose(1, 2) @ W64)          # right singular vectors, ascending
    return linalg.sin_theta_distance(U[..., -k:].transpose(1, 2), Wt)


def refit_test_loss(params, X, y, X_test, y_test, param, *, act: str = "tanh", rtol: float = 1e-10) -> torch.Tensor:
    r"""Test-LRFit: freeze the hidden layer, refit the output weights by minimum-norm least squares on the
    training set, :math:`\hat v = \Phi^{+} y`, and return the test loss
    :math:`\tfrac12\,\mathrm{mean}(\Phi_{\mathrm{test}}\hat v - y_{\mathrm{test}})^2` per seed
    (Arbel, Menegaux & Wolinski 2023).

    Computed in kernel form, :math:`\hat v = \Phi^\top (\Phi\Phi^\top)^{+} y`, an ``n x n`` eigen-decomposition
    (fast for :math:`m \gg n`, and on any device). Singular values of :math:`\Phi` below ``rtol`` times the
    largest are dropped (their code's rule), and so are eigenvalues of :math:`\Phi\Phi^\top` below
    :math:`n\,\varepsilon_{\mathrm{float64}}\lambda_{\max}` (the Gram matrix cannot resolve smaller ones).

    **Cut-off convention.** The cut is on the Gram eigenvalues at :math:`\max(\mathrm{rtol}^2,\,n\varepsilon)\,
    \lambda_{\max}`; with the default ``rtol = 1e-10`` the second term wins, so singular values of :math:`\Phi`
    below about :math:`\sqrt{n\varepsilon}\,\sigma_{\max}\approx10^{-7}\sigma_{\max}` are dropped. This differs both
    from ``torch.linalg.pinv(Phi)`` (singular values below :math:`\max(n,m)\varepsilon\sigma_{\max}`) and from
    :func:`curvlab.meanfield.refit_output` (Gram eigenvalues below ``rcond`` :math:`\lambda_{\max}`, ``1e-10``).
    On nearly collinear features the refit's test loss depends on the cut (chapter 21 shows how much). The
    output multiplier cancels: :math:`\Phi_{\mathrm{test}}\Phi^{+}y` does not depend on it. Float64.
    """
    params, p = _check_params(params), _param(param)
    S, m, d = params.shape
    X = _check_X("X", X, S, d, params.W)
    y = _check_y("y", y, X)
    X_test = _check_X("X_test", X_test, S, d, params.W)
    y_test = _check_y("y_test", y_test, X_test)
    rtol = check_positive("rtol", rtol)
    phi, _ = activation(act)
    P = TwoLayer(*(config.spectral(t) for t in (params.W, params.b, params.v)))
    Phi = phi(_hidden(P, config.spectral(X), p)[0])                                 # (S, m, n)
    lam, U = torch.linalg.eigh(Phi.transpose(1, 2) @ Phi)                           # ascending
    cut = max(rtol**2, default_rtol(X.shape[1])) * lam[:, -1:]
    inv = torch.where(lam > cut, 1.0 / lam.clamp_min(torch.finfo(lam.dtype).tiny), torch.zeros_like(lam))
    alpha = U @ (inv * (U.transpose(1, 2) @ config.spectral(y).unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
    refit = TwoLayer(P.W, P.b, (Phi @ alpha).squeeze(-1))
    _, s = p.multipliers(m)
    f = forward(refit, config.spectral(X_test), p, act=act) / s
    return 0.5 * (f - config.spectral(y_test)).square().mean(dim=1)


# ------------------------------------------------------------------------------------------------ limits and fits
def limiting_ntk(X, *, act: str = "tanh", init_std: float | None = None, bias_std: float = 0.5,
                 out_std: float = 1.0, n_quad: int = 48) -> torch.Tensor:
    r"""The NTK-scaling limit :math:`\bar k(x, x') = \lim_{m\to\infty} K_0(x, x')` (Jacot et al. 2018), ``(n, n)``.

    .. math::

        \bar k(x, x') = \mathbb E[\phi(z)\phi(z')] + \sigma_v^2\,\mathbb E[\phi'(z)\phi'(z')]\,(x^\top x' + 1),
        \quad \begin{pmatrix} z \\ z'\end{pmatrix} \sim \mathcal N\Big(0,
        \begin{pmatrix} \sigma_0^2\lVert x\rVert^2 + \sigma_b^2 & \sigma_0^2 x^\top x' + \sigma_b^2 \\
        \sigma_0^2 x^\top x' + \sigma_b^2 & \sigma_0^2\lVert x'\rVert^2 + \sigma_b^2\end{pmatrix}\Big),

    each expectation by a tensor-product Gauss–Hermite rule with ``n_quad`` nodes per axis (exact for
    polynomials of degree below ``2 n_quad``). ``X (n, d)``; same defaults as :func:`init_two_layer`. Float64.
    """
    X = check_finite("X", as_tensor("X", X, dtype=torch.float64))
    if X.dim() != 2 or X.shape[0] == 0:
        raise ValueError(f"X must be a matrix (n, d), got {tuple(X.shape)}")
    phi, dphi = activation(act)
    d = X.shape[1]
    s0 = 1.0 / math.sqrt(d) if init_std is None else check_positive("init_std", init_std)
    sb, sv = check_nonnegative("bias_std", bias_std), check_positive("out_std", out_std)
    n_quad = check_int("n_quad", n_quad, min_value=2)
    nodes, weights = np.polynomial.hermite_e.hermegauss(n_quad)
    g = torch.as_tensor(nodes, dtype=torch.float64)
    wq = torch.as_tensor(weights / np.sqrt(2 * np.pi), dtype=torch.float64)
    G = torch.stack(torch.meshgrid(g, g, indexing="ij"), 0).reshape(2, -1)            # (2, Q^2)
    Wq = (wq[:, None] * wq[None, :]).reshape(-1)
    ip = X @ X.T
    C = s0**2 * ip + sb**2
    n = X.shape[0]
    cov = torch.stack([torch.stack([C.diagonal().expand(n, n).T, C], -1),
                       torch.stack([C, C.diagonal().expand(n, n)], -1)], -2)       # (n, n, 2, 2)
    lam, U = torch.linalg.eigh(cov)
    L = U * lam.clamp_min(0).sqrt().unsqueeze(-2)                                      # cov = L L^T
    z = L @ G                                                                          # (n, n, 2, Q^2)
    E = lambda fn: (fn(z[..., 0, :]) * fn(z[..., 1, :]) * Wq).sum(-1)
    return E(phi) + sv**2 * E(dphi) * (ip + 1.0)


@dataclass(frozen=True)
class SlopeFit:
    r"""Per-replicate least-squares fits of :math:`\log y = a + \beta \log x` (the leading law) and of
    :math:`\log y = a' + \beta' \log x + \gamma x^{-q}` (with its first correction).

    ``slopes`` :math:`\beta_s` ``(R,)``; ``corrected_slopes`` :math:`\beta'_s`; ``gamma`` :math:`\gamma_s`;
    ``correction_bias``: :math:`|\bar\gamma|` times the least-squares slope of :math:`x^{-q}` against
    :math:`\log x` on the grid, the bias that the fitted first correction puts on :math:`\bar\beta`.
    """

    slopes: np.ndarray
    intercepts: np.ndarray
    corrected_slopes: np.ndarray
    gamma: np.ndarray
    correction_bias: float
    correction_exponent: float

    @property
    def slope(self) -> float:
        return float(self.slopes.mean())

    @property
    def se(self) -> float:
        return float(self.slopes.std(ddof=1) / math.sqrt(len(self.slopes)))


def slope_fit(x, Y, *, correction_exponent: float = 1.0) -> SlopeFit:
    r"""Fit power laws to ``Y (R, len(x))`` (``R`` replicates, positive values) against ``x`` (positive).

    See :class:`SlopeFit`. Needs at least 4 distinct ``x`` values (three coefficients plus one residual).
    """
    x = np.asarray(x, dtype=float)
    Y = np.asarray(Y, dtype=float)
    if x.ndim != 1 or len(np.unique(x)) < 4 or (x <= 0).any() or not np.isfinite(x).all():
        raise ValueError(f"x must be a vector of at least 4 distinct positive values, got {x!r}")
    if Y.ndim == 1:
        Y = Y[None, :]
    if Y.ndim != 2 or Y.shape[1] != len(x):
        raise ValueError(f"Y must have shape (R, {len(x)}), got {Y.shape}")
    if not np.isfinite(Y).all() or (Y <= 0).any():
        raise ValueError("Y must be finite and > 0 (its logarithm is fitted)")
    q = check_positive("correction_exponent", correction_exponent)
    lx, lY = np.log(x), np.log(Y)
    A = np.stack([np.ones_like(lx), lx], 1)
    coef = np.linalg.lstsq(A, lY.T, rcond=None)[0]
    B = np.stack([np.ones_like(lx), lx, x ** (-q)], 1)
    coef2 = np.linalg.lstsq(B, lY.T, rcond=None)[0]
    corr_slope = float(np.linalg.lstsq(A, x ** (-q), rcond=None)[0][1])
    return SlopeFit(coef[1], coef[0], coef2[1], coef2[2], abs(float(coef2[2].mean()) * corr_slope), q)


# ------------------------------------------------------------------------------------------------ the sweep
def width_sweep(teacher: Teacher, data: tuple, widths: Sequence[int], parametrisations: Sequence, *, eta0: float,
                target: float, max_steps: int, act: str = "tanh", lazy_factors: Sequence[float] = (1.0,),
                init_seed: int = 0, init_kwargs: dict | None = None, refit_min_width: int | None = None,
                show_progress: bool = True):
    r"""Train every parametrisation at every width (and lazy factor) on the same data; a tidy frame of metrics.

    ``data = (X, y, X_test, y_test)`` from :func:`sample`. For each width the initial Gaussian draws are shared
    by all parametrisations and lazy factors (seeded by ``init_seed`` and the width), so the runs are paired.
    One row per (method, m, lazy factor ``nu``, seed) with: ``steps``, ``converged``, ``train_loss``,
    ``test_loss``, ``rel_dist`` (:func:`relative_distance`), ``rel_dist_lin`` (the same for
    :func:`linearised_gd`), ``kernel_change`` (of :math:`K^\eta`), ``lin_gap`` (relative test-prediction gap
    between GD and the linearised model), ``alignment0``/``alignment`` (:func:`teacher_alignment`),
    ``wcd0``/``wcd`` (sign-invariant for odd activations), ``subspace0``/``subspace``
    (:func:`top_subspace_distance`), ``refit0``/``refit`` (:func:`refit_test_loss`; ``refit0`` is the
    random-features baseline; computed only for ``m >= refit_min_width`` when it is given, NaN below:
    minimum-norm refits are meaningless near the interpolation threshold, where the features are about as
    many as the samples).
    """
    import pandas as pd

    if not isinstance(teacher, Teacher):
        raise TypeError(f"teacher must be a Teacher, got {type(teacher).__name__}")
    if not isinstance(data, tuple) or len(data) != 4:
        raise TypeError("data must be the tuple (X, y, X_test, y_test)")
    X, y, X_test, y_test = data
    widths = [check_int("widths", w, min_value=2) for w in widths]
    plist = [_param(p) for p in parametrisations]
    if not widths or not plist:
        raise ValueError("widths and parametrisations must be non-empty")
    nus = [check_positive("lazy_factors", nu) for nu in lazy_factors]
    init_seed = check_int("init_seed", init_seed, min_value=0)
    if refit_min_width is not None:
        refit_min_width = check_int("refit_min_width", refit_min_width, min_value=1)
    kw = dict(init_kwargs or {})
    S, _, d = X.shape
    odd = act == "tanh"
    Wt = teacher.W_teacher
    rows = []
    for m in progress(widths, desc="widths") if show_progress else widths:
        for p in plist:
            p0 = init_two_layer(S, m, d, p, generator=torch.Generator().manual_seed(init_seed * 100_003 + m),
                                dtype=X.dtype, device=X.device, **kw)
            W0 = p0.W
            do_refit = refit_min_width is None or m >= refit_min_width
            nan = torch.full((S,), float("nan"), dtype=torch.float64)
            refit = (lambda q: refit_test_loss(q, X, y, X_test, y_test, p, act=act)) if do_refit else (lambda q: nan)
            base = dict(alignment0=teacher_alignment(W0, Wt), wcd0=wcd(W0, Wt, sign_invariant=odd),
                        subspace0=top_subspace_distance(W0, Wt), refit0=refit(p0))
            for nu in nus:
                K0 = tangent_kernel(p0, X, p, act=act, lazy_factor=nu)
                run = train_gd(p0, X, y, p, eta0=eta0, target=target, max_steps=max_steps, act=act, lazy_factor=nu)
                lin = linearised_gd(p0, X, y, p, eta0=eta0, target=target, max_steps=max_steps, act=act,
                                    lazy_factor=nu)
                p_lin = TwoLayer(config.spectral(p0.W) + lin.delta.W, config.spectral(p0.b) + lin.delta.b,
                                 config.spectral(p0.v) + lin.delta.v)
                f_gd = forward(run.params, X_test, p, act=act, lazy_factor=nu)
                p0_64 = TwoLayer(*(config.spectral(t) for t in (p0.W, p0.b, p0.v)))
                f_lin = linearised_forward(p0_64, lin.delta, config.spectral(X_test), p, act=act, lazy_factor=nu)
                W1 = run.params.W
                metrics = dict(
                    steps=run.steps, converged=run.converged, train_loss=run.loss,
                    test_loss=0.5 * (f_gd - y_test).square().mean(1),
                    rel_dist=relative_distance(p0, run.params),
                    rel_dist_lin=relative_distance(p0_64, p_lin),
                    kernel_change=kernel_change(K0, tangent_kernel(run.params, X, p, act=act, lazy_factor=nu)),
                    lin_gap=(config.spectral(f_gd) - f_lin).norm(dim=1) / f_lin.norm(dim=1),
                    alignment=teacher_alignment(W1, Wt), wcd=wcd(W1, Wt, sign_invariant=odd),
                    subspace=top_subspace_distance(W1, Wt),
                    refit=refit(run.params), **base)
                cols = {k: v.detach().to("cpu", torch.float64).numpy() if v.dtype != torch.bool
                        else v.detach().cpu().numpy() for k, v in metrics.items()}
                for s in range(S):
                    rows.append(dict(method=p.name, m=m, nu=nu, seed=s, **{k: c[s].item() for k, c in cols.items()}))
    return pd.DataFrame(rows)


def summarise(frame, by: Sequence[str] = ("method", "m")):
    """Mean and standard error over seeds of every numeric metric of a :func:`width_sweep` frame.

    Returns one row per group, with columns ``<metric>_mean`` and ``<metric>_sem`` next to the ``by`` columns.
    """
    import pandas as pd

    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame must be a pandas DataFrame (from width_sweep), got {type(frame).__name__}")
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in by if c not in frame.columns]
    if missing:
        raise ValueError(f"by names columns that frame lacks: {missing}")
    metrics = [c for c in frame.select_dtypes("number").columns if c not in (*by, "m", "nu", "seed")]
    stats = frame.groupby(by)[metrics].agg(["mean", "sem"])
    stats.columns = [f"{c}_{s}" for c, s in stats.columns]
    return stats.reset_index()


#: Legend labels of the three scalings, taken from the method registry.
LABELS = {name: plotting_style(name).label for name in ("NTK", "mean-field", "muP")}


def plot_metric(ax, stats, column: str, methods: Sequence[str], *, x: str = "m", band: bool = True,
                labels: dict | None = None):
    """Draw ``<column>_mean`` of a :func:`summarise` frame against ``x`` for each method, in its registered
    style, with a band of two standard errors. ``muP`` is drawn as open markers without line or band, because
    it coincides with the mean-field curve (chapter 03). Ticks are placed at the grid values."""
    from . import plotting

    labels = {**LABELS, **(labels or {})}
    for meth in methods:
        s_ = stats[stats.method == meth]
        if s_.empty:
            raise ValueError(f"methods: no rows for {meth!r} in stats")
        mean, sem = s_[f"{column}_mean"], s_[f"{column}_sem"]
        if meth == "muP":
            plotting.plot(ax, s_[x], mean, meth, linestyle="none", markersize=10, fillstyle="none",
                          label=labels.get(meth, meth))
            continue
        plotting.plot(ax, s_[x], mean, meth, label=labels.get(meth, plotting.style(meth).label))
        if band:
            plotting.band(ax, s_[x], mean - 2 * sem, mean + 2 * sem, meth)
    grid = sorted(stats[x].unique())
    ax.set_xscale("log")
    ax.set_xticks(grid, [f"{g:g}" for g in grid])
    ax.minorticks_off()
    return ax
