r"""The book's curvature tools on any ``torch.nn.Module``: GN products, κ, K-FAC blocks, one damped GN step.

Chapter: ``notebooks/41_your_own_network``. The rest of ``curvlab`` writes each model as a function of a flat
parameter vector; this module takes an ``nn.Module`` and its data instead, and builds that function with
:func:`torch.func.functional_call`.

**The matrices.** For a network :math:`f_\theta:\mathbb R^{d}\to\mathbb R^{c}` on :math:`n` samples with per-sample
Jacobians :math:`J_i = \partial f_\theta(x_i)/\partial\theta\in\mathbb R^{c\times p}` and the averaged loss
:math:`\mathcal L = \frac1n\sum_i \ell(f_\theta(x_i), y_i)`, the (generalised) Gauss–Newton matrix is

.. math::

    H_{\mathrm{GN}} = \frac1n\sum_{i=1}^n J_i^\top \Lambda_i J_i = \frac1n\tilde J^\top\tilde J,\qquad
    \tilde J_i = S_i^\top J_i,\quad S_iS_i^\top = \Lambda_i = \nabla^2_f\,\ell(f_\theta(x_i), y_i),

with :math:`\ell = \frac12\lVert f - y\rVert^2` (``loss="mse"``, :math:`\Lambda_i = I_c`, so
:math:`H_{\mathrm{GN}} = J^\top J/n` as on the notation page) or the softmax cross-entropy
(``loss="cross_entropy"``, :math:`\Lambda_i = \operatorname{diag}(\pi_i) - \pi_i\pi_i^\top`,
:math:`\pi_i = \operatorname{softmax} f_\theta(x_i)`, :math:`S_i = \operatorname{diag}(\sqrt{\pi_i}) - \pi_i\sqrt{\pi_i}^\top`).
The kernel :math:`K = \tilde J\tilde J^\top` (``nc x nc``) has the nonzero eigenvalues of :math:`nH_{\mathrm{GN}}`.
For cross-entropy :math:`S_i\sqrt{\pi_i} = 0`, so :math:`\operatorname{rank} K \le n(c-1)`: the rank cut matters.
Also: per-token cross-entropy on outputs ``(n, T, classes)`` (:math:`\Lambda_i` block diagonal over the tokens) and
``loss="bce"`` on logits (:math:`\Lambda_i = \operatorname{diag}(\sigma_i(1-\sigma_i))`).

**Scaling.** With ``reduction="mean"`` the summed loss is divided by ``norm``, the number of terms torch's ``"mean"``
averages for cross-entropy (:math:`n`, per token :math:`nT`) and BCE (:math:`nc`), and by :math:`n` for the book's
MSE; ``"sum"`` divides by 1. Everywhere below, :math:`n` in a normalisation stands for ``norm``
(:math:`H_{\mathrm{GN}} = \tilde J^\top\tilde J/\texttt{norm}`). torch's ``MSELoss()`` is :math:`\frac2c` times the
book's MSE; :func:`torch_loss` gives the torch loss and the factor for curvlinops or BackPACK.

**Units** (notation page, ``notation-units``): ``lam_GN`` is added to the averaged :math:`H_{\mathrm{GN}}`, i.e.
:math:`n\lambda_{\mathrm{GN}}` to :math:`K`; :func:`gn_step` returns
:math:`\Delta_{\mathrm{GN}} = (H_{\mathrm{GN}} + \lambda_{\mathrm{GN}} I_p)^{-1}\nabla\mathcal L
= \tilde J^\top (K + n\lambda_{\mathrm{GN}} I)^{-1}\rho`, with :math:`\nabla_f\ell_i = S_i\rho_i`
(for MSE :math:`\rho_i = r_i = f_\theta(x_i) - y_i`), and the step is :math:`\theta \leftarrow \theta - \eta\Delta_{\mathrm{GN}}`.

**What counts as a parameter.** :math:`\theta` is the row-major concatenation of the module's parameters with
``requires_grad=True``, in ``named_parameters()`` order. Parameters with ``requires_grad=False`` and all buffers are
held fixed at their current values (they are constants of :math:`f_\theta`). Batch norm: in **eval** mode the
running statistics are used and :math:`f_\theta(x_i)` depends on :math:`x_i` alone (recommended); in **train** mode the
statistics of each data chunk are used, so :math:`f_\theta` couples the samples of a chunk and the curvature is that
of this coupled function (the chunk is then part of the model: results depend on ``chunk_size``). The module's own
running statistics are never updated by this module in either mode; train-mode batch norm is warned about by
name. Dropout (and any random layer, or a random forward pass) in training mode is refused: a random function has no
Gauss–Newton matrix to compute. ``params=`` chooses a subset of the parameters as :math:`\theta`.

**Routes.** Products (:func:`ggn_vector_product`) use one JVP and one VJP per data chunk and never form
:math:`J`; :func:`ggn_matrix` and :func:`kernel_matrix` form :math:`\tilde J` (``nc x p``, memory :math:`O(ncp)`);
:func:`condition` uses a dense ``eigvalsh`` when :math:`\min(p, nc)` is at most ``dense_max`` (and
:math:`\tilde J` fits in ``dense_max_entries``) and otherwise Lanczos
(:func:`scipy.sparse.linalg.eigsh` on a :class:`scipy.sparse.linalg.LinearOperator`) on the smaller of
:math:`H_{\mathrm{GN}}` and :math:`K/n`. :func:`kfac_factors` gives K-FAC's exact (type-2) Kronecker factors of every
``nn.Linear`` and ``nn.Conv2d`` (expand convention; other layers are named in a warning, shared parameters and
layers with no path to the output refused); :func:`kfac_block_errors` the relative Frobenius distance between
:math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}` (or any operator's diagonal block) and the exact diagonal block of
:math:`H_{\mathrm{GN}}`. :func:`condition` computes dense spectra in float64 by default, warns
(:class:`RankCutWarning`) when the gap at the cut is below 10, and runs Lanczos from a seeded start within a budget,
reporting the rank only where it measured it.

**Operators.** :func:`ggn_operator`, :func:`kernel_operator`, :func:`ggn_inverse_operator` and :func:`kfac_operator`
(with its damped inverse) follow curvlinops 3's operator interface (:class:`CurvatureOperator`, ``.to_scipy()``);
:func:`condition_of`, :func:`kfac_block_errors` and :func:`gn_step` (``jac_op=``) accept curvlinops' operators.
Cross-checked against curvlinops and BackPACK in ``tests/test_model.py`` and ``tests/test_model_operators.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.func import functional_call, jvp, vjp, vmap

from . import config
from ._validate import check_choice, check_int, check_nonnegative, check_positive
from .curvature import ConditionNumber, condition_number
from .linalg import default_rtol

__all__ = [
    "LOSSES",
    "REDUCTIONS",
    "RankCutWarning",
    "Problem",
    "problem",
    "ggn_vector_product",
    "jacobian",
    "ggn_matrix",
    "kernel_matrix",
    "condition",
    "Condition",
    "KFACFactors",
    "kfac_factors",
    "kfac_block_errors",
    "gn_step",
    "apply_step",
    "loss_value",
    "loss_gradient",
    "condition_of",
    "CurvatureOperator",
    "KFACOperator",
    "ggn_operator",
    "kernel_operator",
    "ggn_inverse_operator",
    "kfac_operator",
    "torch_loss",
]

LOSSES = ("mse", "cross_entropy", "bce")
REDUCTIONS = ("mean", "sum")
#: modules whose forward pass is random in training mode (refused by :func:`problem` unless in eval mode)
RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                  nn.RReLU)
#: a rank cut whose gap lambda_r / lambda_{r+1} is below this is warned about (RankCutWarning)
GAP_WARN = 10.0


class RankCutWarning(UserWarning):
    r"""The gap :math:`\lambda_r/\lambda_{r+1}` at the rank cut of a condition number is below 10: :math:`\kappa`
    then depends on where the cut falls (the cut lies inside the spectrum, not at a clean edge)."""


# ============================================================================================ the problem
@dataclass
class Problem:
    r"""A module, its data and its loss, validated once: what every function of this module takes.

    ``chunks`` is the list of ``(X_b, Y_b)`` pairs on the parameters' device; ``names``/``shapes``/``sizes`` describe
    :math:`\theta` (the chosen parameters only); ``n`` samples, ``c`` outputs per sample (all of them: ``T * classes``
    for a per-token output ``(n, T, classes)``), ``p`` parameters. ``norm`` is the divisor of the loss (``reduction``):
    :math:`\mathcal L = \frac1{\texttt{norm}}\sum_i\ell_i`, so :math:`H_{\mathrm{GN}} = \tilde J^\top\tilde J/\texttt{norm}`.
    """

    model: nn.Module
    loss: str
    chunks: list
    names: list
    shapes: list
    sizes: list
    n: int
    c: int
    dtype: torch.dtype
    device: torch.device
    reduction: str = "mean"
    #: size of the softmax axis (cross-entropy) and the per-sample output shape, e.g. ``(c,)`` or ``(T, classes)``
    classes: int = 0
    out_shape: tuple = ()
    #: the loss's divisor, the number of terms it averages over (``reduction="mean"``) or 1 (``"sum"``)
    norm: float = 1.0
    #: the last :func:`jacobian`, with the parameters, buffers and modes it was computed at (reused while unchanged)
    _cache: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def p(self) -> int:
        return int(sum(self.sizes))

    def theta(self) -> torch.Tensor:
        """The current trainable parameters, flattened row-major (a detached copy), shape ``(p,)``."""
        params = dict(self.model.named_parameters())
        return torch.cat([params[k].detach().reshape(-1) for k in self.names])

    def unflatten(self, theta: torch.Tensor) -> dict:
        """``theta`` ``(p,)`` as the dict ``name -> tensor`` of the trainable parameters' shapes (views)."""
        if not isinstance(theta, torch.Tensor) or theta.shape != (self.p,):
            raise ValueError(f"theta must have shape ({self.p},), got {getattr(theta, 'shape', type(theta).__name__)}")
        return {k: t.reshape(s) for k, t, s in zip(self.names, theta.split(self.sizes), self.shapes)}

    def _fixed(self) -> dict:
        """Parameters outside theta and buffers (cloned: a train-mode batch norm must not update the module's own)."""
        chosen = set(self.names)
        frozen = {k: v.detach() for k, v in self.model.named_parameters() if k not in chosen}
        buffers = {k: v.detach().clone() for k, v in self.model.named_buffers()}
        return {**frozen, **buffers}

    def forward_fn(self, X: torch.Tensor):
        """``theta -> f_theta(X)`` of shape ``(n_b, c)``: the module as a function of the flat parameters."""
        fixed = self._fixed()

        def fn(theta: torch.Tensor) -> torch.Tensor:
            with _no_running_stats(self.model):
                return functional_call(self.model, {**self.unflatten(theta), **fixed}, (X,)).flatten(1)

        return fn

    def _params(self) -> tuple:
        """The trainable parameters as a tuple of detached tensors sharing the module's storage (no copy)."""
        params = dict(self.model.named_parameters())
        return tuple(params[k].detach() for k in self.names)

    def _params_fn(self, X: torch.Tensor):
        """``(*params) -> f(X)``: the module as a function of its parameter tensors (the products' primals: unlike
        ``forward_fn``, no flat ``(p,)`` copy of theta is made)."""
        fixed = self._fixed()

        def fn(*params: torch.Tensor) -> torch.Tensor:
            with _no_running_stats(self.model):
                return functional_call(self.model, {**dict(zip(self.names, params)), **fixed}, (X,)).flatten(1)

        return fn

    def _split(self, v: torch.Tensor, *, views: bool = False) -> tuple:
        """``v`` ``(..., p)`` as a tuple of per-parameter tensors ``(..., *shape)``; ``views=True`` guarantees views
        (writing into them writes into ``v``; always possible for a contiguous ``v``) or raises."""
        lead = v.shape[:-1]
        return tuple(t.view(*lead, *s) if views else t.reshape(*lead, *s)
                     for t, s in zip(v.split(self.sizes, dim=-1), self.shapes))


class _no_running_stats:
    """Train-mode batch norms use the batch statistics without updating running ones (restored on exit)."""

    def __init__(self, model: nn.Module):
        self.mods = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     and m.training and m.track_running_stats]

    def __enter__(self):
        for m in self.mods:
            m.track_running_stats = False

    def __exit__(self, *exc):
        for m in self.mods:
            m.track_running_stats = True


def _as_chunks(inputs, targets, chunk_size) -> list:
    if isinstance(inputs, torch.Tensor):
        if targets is None:
            raise ValueError("targets must be given when inputs is a tensor (they are None only with a DataLoader)")
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
        if inputs.dim() < 1 or inputs.shape[0] == 0:
            raise ValueError(f"inputs must have a leading sample dimension n >= 1, got shape {tuple(inputs.shape)}")
        if targets.dim() < 1 or targets.shape[0] != inputs.shape[0]:
            raise ValueError(f"targets must have one row per sample ({inputs.shape[0]}), got shape "
                             f"{tuple(targets.shape)}")
        n = inputs.shape[0]
        size = n if chunk_size is None else check_int("chunk_size", chunk_size, min_value=1)
        return [(inputs[i:i + size], targets[i:i + size]) for i in range(0, n, size)]
    if isinstance(inputs, torch.utils.data.DataLoader) or (isinstance(inputs, Iterable) and not isinstance(
            inputs, (str, bytes, dict, np.ndarray))):
        if targets is not None:
            raise ValueError("targets must be None when inputs is a DataLoader (it yields (inputs, targets) pairs)")
        if chunk_size is not None:
            raise ValueError("chunk_size must be None with a DataLoader: its batches are the chunks")
        chunks = []
        for i, batch in enumerate(inputs):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not all(
                    isinstance(t, torch.Tensor) for t in batch):
                what = f"a {type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, "__len__") else "")
                raise ValueError(f"inputs (a DataLoader) must yield (inputs, targets) pairs of tensors; batch {i} "
                                 f"is {what}")
            X, Y = batch
            if X.dim() < 1 or Y.dim() < 1 or X.shape[0] != Y.shape[0] or X.shape[0] == 0:
                raise ValueError(f"inputs (a DataLoader): batch {i} has inputs {tuple(X.shape)} and targets "
                                 f"{tuple(Y.shape)}; they must share a leading sample dimension >= 1")
            chunks.append((X, Y))
        if not chunks:
            raise ValueError("inputs (a DataLoader) yielded no batches")
        return chunks
    raise TypeError(f"inputs must be a tensor (n, ...) or a DataLoader of (inputs, targets), got {type(inputs).__name__}")


def _choose_params(model: nn.Module, params) -> list:
    """``(name, parameter)`` pairs of theta: every parameter with ``requires_grad=True``, or the subset ``params``
    (names or the parameter tensors themselves), in ``named_parameters()`` order."""
    named = list(model.named_parameters())
    if params is None:
        return [(k, v) for k, v in named if v.requires_grad]
    if isinstance(params, (str, torch.Tensor)) or not isinstance(params, Iterable):
        raise TypeError(f"params must be a list of parameter names or of the model's parameters, got "
                        f"{type(params).__name__}")
    by_id = {id(v): k for k, v in named}
    wanted = set()
    for q in params:
        if isinstance(q, str):
            if q not in dict(named):
                raise ValueError(f"params: {q!r} is not a parameter name of the model (named_parameters(): "
                                 f"{[k for k, _ in named][:8]}{' ...' if len(named) > 8 else ''})")
            wanted.add(q)
        elif isinstance(q, torch.Tensor) and id(q) in by_id:
            wanted.add(by_id[id(q)])
        else:
            raise ValueError(f"params: an entry of type {type(q).__name__} is neither a parameter name nor one of the "
                             "model's parameters")
    if not wanted:
        raise ValueError("params must name at least one parameter")
    return [(k, v) for k, v in named if k in wanted]


def _first_bad_row(t: torch.Tensor) -> int:
    bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(1)
    return int(bad.nonzero()[0, 0])


def _check_finite(chunks: list) -> None:
    """Inputs and targets finite after the cast to the model's dtype (sample numbers global)."""
    start = 0
    for X, Y in chunks:
        if X.is_floating_point() and not bool(torch.isfinite(X).all()):
            raise ValueError(f"inputs are not finite (inf or NaN, in the model's dtype) at sample "
                             f"{start + _first_bad_row(X)}: every curvature would be NaN or meaningless")
        if Y.is_floating_point() and not bool(torch.isfinite(Y).all()):
            raise ValueError(f"targets are not finite (inf or NaN) at sample {start + _first_bad_row(Y)}")
        start += X.shape[0]


def _check_values(loss: str, chunks: list, c: int, classes: int, out_shape: tuple, raw_dtypes: list) -> None:
    """Shapes and values of inputs and targets, chunk by chunk; sample numbers in messages are global."""
    start = 0
    for i, ((X, Y), ydt) in enumerate(zip(chunks, raw_dtypes)):
        nb = X.shape[0]
        if loss in ("mse", "bce") and tuple(Y.shape) != (nb, c):
            raise ValueError(f"targets for loss={loss!r} must have shape (n, c) = ({nb}, {c}); chunk {i} has "
                             f"{tuple(Y.shape)}")
        if loss == "bce" and bool(((Y < 0) | (Y > 1)).any()):
            raise ValueError("targets for loss='bce' must be probabilities in [0, 1] (the model outputs logits)")
        if loss == "cross_entropy":
            tok = out_shape[:-1]
            if Y.is_floating_point():
                if tuple(Y.shape) != (nb, *out_shape):
                    raise ValueError(f"targets for loss='cross_entropy' must be class indices {(nb, *tok)} or "
                                     f"probabilities {(nb, *out_shape)}; chunk {i} has {tuple(Y.shape)}")
                if bool((Y < 0).any()):
                    raise ValueError("targets for loss='cross_entropy' given as probabilities must be nonnegative")
                err = float((Y.sum(-1) - 1).abs().max())
                tol = 16 * classes * torch.finfo(ydt).eps
                if err > tol:
                    raise ValueError(f"targets for loss='cross_entropy' given as probabilities must sum to 1 over the "
                                     f"classes (last axis); a row is off by {err:.3g} (> {tol:.2g}). Normalise them "
                                     "(Y / Y.sum(-1, keepdim=True)), or pass class indices")
            elif Y.dim() != 1 + len(tok) or tuple(Y.shape) != (nb, *tok) or int(Y.min()) < 0 \
                    or int(Y.max()) >= classes:
                raise ValueError(f"targets for loss='cross_entropy' must be class indices in [0, {classes}) of shape "
                                 f"{(nb, *tok)}; chunk {i} has shape {tuple(Y.shape)}")
        start += nb


def _check_modes(model: nn.Module, X: torch.Tensor, out: torch.Tensor, n_chunks: int) -> None:
    """Refuse random modules in training mode (named) and a random forward pass; warn about train-mode batch norm."""
    random = [f"'{k}' ({type(m).__name__})" for k, m in model.named_modules()
              if m.training and isinstance(m, RANDOM_MODULES) and getattr(m, "p", 1.0) > 0]
    if random:
        raise ValueError(f"model has random modules in training mode: {', '.join(random)}; a random function has no "
                         "Gauss-Newton matrix (every call would give another curvature). Put them in eval mode: "
                         "model.eval(), or .eval() on those modules")
    if any(m.training for m in model.modules()):
        with torch.no_grad(), _no_running_stats(model):
            again = model(X)
        scale = float(out.abs().max()) if out.numel() else 0.0
        if isinstance(again, torch.Tensor) and again.shape == out.shape and not torch.allclose(
                again, out, rtol=1e-4, atol=1e-5 * scale):
            raise ValueError("model's output is random: two forward passes on the same inputs differ (a dropout or "
                             "other random operation inside a module's forward in training mode). Put the model in "
                             "eval mode (model.eval()) so that its curvature is defined")
    bn = [f"'{k}' ({type(m).__name__})" for k, m in model.named_modules()
          if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if bn:
        warnings.warn(f"batch norm in training mode: {', '.join(bn)}. Each data chunk's own statistics are used, so "
                      f"f couples the samples of a chunk and every curvature depends on chunk_size (here "
                      f"{n_chunks} chunk(s)); model.eval() uses the running statistics (recommended)", UserWarning,
                      stacklevel=3)


def problem(model: nn.Module, inputs, targets=None, loss: str = "mse", *, chunk_size: int | None = None,
            reduction: str = "mean", params=None) -> Problem:
    r"""Validate a module, its data and its loss once, for every other function of :mod:`curvlab.model`.

    ``inputs``: a tensor ``(n, ...)`` with ``targets`` (then split into chunks of ``chunk_size`` samples, default one
    chunk), or a ``DataLoader`` (any iterable) yielding ``(inputs, targets)`` pairs, each batch one chunk.
    ``model(inputs)`` must be ``(n_b, c)``, or ``(n_b, T, classes)`` for a per-token ``"cross_entropy"``.

    Losses (per sample :math:`i`; the exact factors against torch's losses are on the API page):
    ``"mse"`` :math:`\ell_i = \frac12\lVert f_i - y_i\rVert^2` (targets ``(n, c)``; torch's ``MSELoss`` has no
    :math:`\frac12` and its ``"mean"`` also divides by :math:`c`); ``"cross_entropy"`` softmax cross-entropy over the
    last axis, targets class indices ``(n,)`` / ``(n, T)`` or probability rows ``(n, c)`` / ``(n, T, c)`` (nonnegative,
    summing to 1); ``"bce"`` binary cross-entropy on logits (targets in :math:`[0, 1]`, ``(n, c)``), as
    ``BCEWithLogitsLoss``. ``reduction="mean"`` divides the summed loss by the number of terms torch's ``"mean"``
    divides by for cross-entropy and BCE (:math:`n`, :math:`nT`, :math:`nc`) and by :math:`n` for MSE; ``"sum"`` by 1.

    ``params``: the parameters :math:`\theta` (names or tensors of ``model``); default all with
    ``requires_grad=True``. The others and all buffers are constants. Data are moved to the parameters' device and
    dtype (class indices stay integers) and checked once: finite inputs and targets (after the cast), targets of the
    loss's form. Refused: float16/bfloat16 parameters, random modules (dropout) in training mode, a random forward
    pass; batch norm in training mode is warned about (it couples the samples of a chunk).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> prob.n, prob.c, prob.p
    (8, 2, 26)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss = check_choice("loss", loss, LOSSES)
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    chosen = _choose_params(model, params)
    if not chosen:
        raise ValueError("model has no parameter with requires_grad=True: there is no curvature to compute")
    devices = {str(v.device) for _, v in chosen}
    if len(devices) > 1:
        raise ValueError(f"model parameters must live on one device, found {sorted(devices)}")
    dtypes = {v.dtype for _, v in chosen}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"model parameters must share one floating dtype, found {sorted(map(str, dtypes))}")
    dtype, dev = chosen[0][1].dtype, chosen[0][1].device
    if dtype in (torch.float16, torch.bfloat16):
        raise ValueError(f"model parameters are {dtype} (half precision): eigenvalues and the rank cut would be "
                         f"noise at about {torch.finfo(dtype).eps:.0e} of lambda_max. Convert a copy with "
                         "model.float() or model.double() first")
    chunks, raw = [], []
    for X, Y in _as_chunks(inputs, targets, chunk_size):
        raw.append(Y.dtype if Y.is_floating_point() else dtype)
        X = X.to(device=dev, dtype=dtype) if X.is_floating_point() else X.to(dev)
        Y = Y.to(dev) if (loss == "cross_entropy" and not Y.is_floating_point()) else Y.to(device=dev, dtype=dtype)
        chunks.append((X, Y))
    _check_finite(chunks)
    with torch.no_grad(), _no_running_stats(model):
        out = model(chunks[0][0])
    per_token = loss == "cross_entropy" and isinstance(out, torch.Tensor) and out.dim() == 3
    if not isinstance(out, torch.Tensor) or (out.dim() != 2 and not per_token):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model output must be 2-D (n, c) (or (n, T, classes) for loss='cross_entropy', per token), "
                         f"got {shape}; flatten or reshape it inside the module")
    if not bool(torch.isfinite(out).all()):
        raise ValueError("model output is not finite (inf or NaN) on the first chunk of inputs at the current "
                         "parameters")
    out_shape = tuple(out.shape[1:])
    c, classes = int(math.prod(out_shape)), int(out_shape[-1])
    _check_values(loss, chunks, c, classes, out_shape, raw)
    _check_modes(model, chunks[0][0], out, len(chunks))
    n = int(sum(X.shape[0] for X, _ in chunks))
    terms = {"mse": n, "cross_entropy": n * c // classes, "bce": n * c}[loss]
    return Problem(model=model, loss=loss, chunks=chunks, names=[k for k, _ in chosen],
                   shapes=[v.shape for _, v in chosen], sizes=[v.numel() for _, v in chosen],
                   n=n, c=c, dtype=dtype, device=dev, reduction=reduction, classes=classes,
                   out_shape=out_shape, norm=float(terms if reduction == "mean" else 1))


def _check_problem(prob) -> Problem:
    if not isinstance(prob, Problem):
        raise TypeError(f"prob must be a curvlab.model.Problem (from curvlab.model.problem), got {type(prob).__name__}")
    return prob


# ============================================================================================ loss pieces
def _tokens(prob: Problem, f: torch.Tensor) -> torch.Tensor:
    """``f`` ``(n_b, c)`` viewed as ``(n_b, T, classes)`` (``T = 1`` for a 2-D output)."""
    return f.reshape(*f.shape[:-1], -1, prob.classes)


def _probs(prob: Problem, f: torch.Tensor) -> torch.Tensor:
    """Softmax over the classes of each token (cross-entropy) or the sigmoid (BCE), ``f``'s shape."""
    if prob.loss == "bce":
        return torch.sigmoid(f)
    if prob.classes == f.shape[-1]:
        return torch.softmax(f, dim=-1)
    return torch.softmax(_tokens(prob, f), dim=-1).reshape(f.shape)


def _onehot(prob: Problem, f: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    if Y.is_floating_point():
        return Y.reshape(f.shape)
    return torch.nn.functional.one_hot(Y, prob.classes).to(f.dtype).reshape(f.shape)


def _hess_out(prob: Problem, f: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r""":math:`\Lambda_i u_i` for each sample (``u`` of ``f``'s shape)."""
    if prob.loss == "mse":
        return u
    if prob.loss == "bce":
        s = torch.sigmoid(f)
        return s * (1 - s) * u
    if prob.classes == prob.c:
        pi = _probs(prob, f)
        return pi * u - pi * (pi * u).sum(-1, keepdim=True)
    pi, u3 = _tokens(prob, _probs(prob, f)), _tokens(prob, u)
    return (pi * u3 - pi * (pi * u3).sum(-1, keepdim=True)).reshape(u.shape)


def _sqrt_hess(prob: Problem, f: torch.Tensor) -> torch.Tensor:
    r""":math:`S_i` with :math:`S_iS_i^\top = \Lambda_i`, shape ``(n_b, c, c)`` (block diagonal over tokens)."""
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    if prob.loss == "mse":
        return eye.expand(f.shape[0], -1, -1)
    if prob.loss == "bce":
        s = torch.sigmoid(f)
        return torch.diag_embed((s * (1 - s)).sqrt())
    pi = _tokens(prob, _probs(prob, f))  # (n_b, T, classes)
    s = pi.sqrt()
    S = torch.diag_embed(s) - pi.unsqueeze(-1) * s.unsqueeze(-2)  # (n_b, T, classes, classes)
    T = S.shape[1]
    if T == 1:
        return S[:, 0]
    eyeT = torch.eye(T, dtype=f.dtype, device=f.device)
    return torch.einsum("btij,ts->btisj", S, eyeT).reshape(f.shape[0], f.shape[-1], f.shape[-1])


def _loss_grad_out(prob: Problem, f: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    r""":math:`\nabla_f\ell_i`: :math:`r_i = f_i - y_i` (MSE), :math:`\pi_i - y_i` (cross-entropy, per token) or
    :math:`\sigma(f_i) - y_i` (BCE)."""
    if prob.loss == "mse":
        return f - Y
    if prob.loss == "bce":
        return torch.sigmoid(f) - Y
    return _probs(prob, f) - _onehot(prob, f, Y)


def loss_value(prob: Problem, theta: torch.Tensor | None = None) -> float:
    r"""The loss :math:`\mathcal L(\theta) = \frac1{\texttt{norm}}\sum_i\ell_i` (current parameters when ``theta`` is
    None; ``norm`` from ``reduction``, see :func:`problem`).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.loss_value(prob) > 0
    True
    """
    prob = _check_problem(prob)
    theta = prob.theta() if theta is None else theta
    total = 0.0
    with torch.no_grad():
        for X, Y in prob.chunks:
            f = prob.forward_fn(X)(theta)
            if prob.loss == "mse":
                total += 0.5 * float(((f - Y) ** 2).sum())
            elif prob.loss == "bce":
                total += float(torch.nn.functional.binary_cross_entropy_with_logits(f, Y, reduction="sum"))
            else:
                logp = torch.log_softmax(_tokens(prob, f), -1).reshape(f.shape)
                total += float(-(_onehot(prob, f, Y) * logp).sum())
    return total / prob.norm


# ============================================================================================ products
def _as_vectors(prob: Problem, v, size: int, name: str = "v") -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape ({size},) or (b, {size}), got {type(v).__name__}")
    if v.dim() not in (1, 2) or v.shape[-1] != size:
        raise ValueError(f"{name} must have shape ({size},) or (b, {size}), got {tuple(v.shape)}")
    return v.to(device=prob.device, dtype=prob.dtype)


def ggn_vector_product(prob: Problem, v) -> torch.Tensor:
    r""":math:`H_{\mathrm{GN}}v = \frac1n\sum_b J_b^\top\Lambda_b(J_bv)`: per chunk one JVP and one VJP; :math:`J` never formed.

    ``v``: ``(p,)`` or a batch ``(k, p)`` (vectorised with ``vmap``); returns ``v``'s shape.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.ggn_vector_product(prob, torch.ones(prob.p).double()).shape
    torch.Size([26])
    """
    prob = _check_problem(prob)
    v = _as_vectors(prob, v, prob.p)
    # Primals and tangents are per-parameter tensors (views of the module's parameters and of v): no flat copy of
    # theta, and the result is written parameter by parameter into one output, each gradient freed once added, so
    # the peak holds about two p-vectors besides v (the output and one chunk's gradients) and the activations.
    params, tangents = prob._params(), prob._split(v)
    out = views = None
    for X, _ in prob.chunks:
        fn = prob._params_fn(X)
        f, pullback = vjp(fn, *params)

        def gv(*u: torch.Tensor) -> tuple:
            return pullback(_hess_out(prob, f, jvp(fn, params, u)[1]))

        grads = list(gv(*tangents) if v.dim() == 1 else vmap(gv)(*tangents))
        if out is None:  # allocated only now: it is not alive during the JVP's transients
            out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # contiguous, whatever v's strides
            views = prob._split(out, views=True)
        for i, view in enumerate(views):
            view.add_(grads[i])
            grads[i] = None
        del grads
    return out.div_(prob.norm)


def _kernel_vector_product(prob: Problem, w: torch.Tensor) -> torch.Tensor:
    r""":math:`Kw = \tilde J(\tilde J^\top w)`, ``w`` of shape ``(n c,)``, sample-major (for Lanczos on :math:`K`).
    One VJP per chunk accumulates :math:`\tilde J^\top w` per parameter tensor; one JVP per chunk maps it back."""
    params = prob._params()
    Jtw = None
    start, saved = 0, []
    for X, _ in prob.chunks:
        fn = prob._params_fn(X)
        f, pullback = vjp(fn, *params)
        S = _sqrt_hess(prob, f)
        wb = w[start:start + f.numel()].reshape(f.shape)
        g = pullback(torch.einsum("bij,bj->bi", S, wb))
        Jtw = list(g) if Jtw is None else [a.add_(b) for a, b in zip(Jtw, g)]
        del g, pullback
        saved.append((fn, S))
        start += f.numel()
    Jtw = tuple(Jtw)
    outs = [torch.einsum("bij,bi->bj", S, jvp(fn, params, Jtw)[1]).reshape(-1) for fn, S in saved]
    return torch.cat(outs)


def jacobian(prob: Problem) -> torch.Tensor:
    r"""The loss-weighted Jacobian :math:`\tilde J` (rows :math:`\tilde J_i = S_i^\top J_i`), shape ``(n c, p)``,
    sample-major, so that :math:`H_{\mathrm{GN}} = \tilde J^\top\tilde J/n` and :math:`K = \tilde J\tilde J^\top`.
    Built per chunk with ``vmap`` over VJPs; memory :math:`O(ncp)`. Kept on ``prob`` and reused by the next call
    (from :func:`condition`, :func:`kfac_block_errors`, :func:`gn_step`) while parameters, buffers and train/eval
    modes are unchanged.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.jacobian(prob).shape
    torch.Size([16, 26])
    """
    prob = _check_problem(prob)
    theta = prob.theta()
    key = _state_key(prob, theta)
    if prob._cache is not None and _same_key(prob._cache[0], key):
        return prob._cache[1]
    rows = []
    for X, _ in prob.chunks:
        fn = prob.forward_fn(X)
        f, pullback = vjp(fn, theta)
        S = _sqrt_hess(prob, f)  # (b, c, c); row (i, j) of J~ is column j of S_i, pulled back
        E = torch.zeros(f.numel(), *f.shape, dtype=f.dtype, device=f.device)
        idx = torch.arange(f.shape[0], device=f.device).repeat_interleave(f.shape[1])
        E[torch.arange(f.numel(), device=f.device), idx] = S.transpose(1, 2).reshape(-1, f.shape[1])
        rows.append(vmap(lambda e: pullback(e)[0])(E))
    Jt = torch.cat(rows)
    prob._cache = (key, Jt)
    return Jt


def _state_key(prob: Problem, theta: torch.Tensor) -> tuple:
    """What the Jacobian depends on besides the data: parameters, buffers, train/eval flags."""
    return (theta, [b.detach().clone() for b in prob.model.buffers()],
            [p.detach().clone() for p in prob.model.parameters() if not p.requires_grad],
            [m.training for m in prob.model.modules()])


def _same_key(a: tuple, b: tuple) -> bool:
    return (torch.equal(a[0], b[0]) and a[3] == b[3] and len(a[1]) == len(b[1]) and len(a[2]) == len(b[2])
            and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))


def ggn_matrix(prob: Problem, *, max_params: int = 20_000) -> torch.Tensor:
    r"""Dense :math:`H_{\mathrm{GN}} = \tilde J^\top\tilde J/n` (``p x p``); refuses ``p > max_params`` (memory :math:`O(p^2)`).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.ggn_matrix(prob).shape
    torch.Size([26, 26])
    """
    prob = _check_problem(prob)
    max_params = check_int("max_params", max_params, min_value=1)
    if prob.p > max_params:
        raise ValueError(f"the model has p = {prob.p} > max_params = {max_params} parameters; a dense p x p GN "
                         "would not fit: use ggn_vector_product or condition(method='lanczos')")
    Jt = jacobian(prob)
    return Jt.T @ Jt / prob.norm


def kernel_matrix(prob: Problem) -> torch.Tensor:
    r"""Kernel :math:`K = \tilde J\tilde J^\top` (``nc x nc``, summed over samples: eigenvalues :math:`n\mu_i`).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.kernel_matrix(prob).shape
    torch.Size([16, 16])
    """
    prob = _check_problem(prob)
    Jt = jacobian(prob)
    K = Jt @ Jt.T
    return 0.5 * (K + K.T)


# ============================================================================================ conditioning
class _Budget(Exception):
    """Lanczos' wall-time budget ran out (raised from inside a product, caught by the caller)."""


def _scipy_operator(matvec, size: int, dtype: torch.dtype, device, deadline: float | None = None):
    """A float64 SciPy operator around a torch matvec run in ``dtype``; past ``deadline`` a product raises _Budget."""
    from scipy.sparse.linalg import LinearOperator

    def mv(x):
        if deadline is not None and time.monotonic() > deadline:
            raise _Budget
        t = torch.as_tensor(np.asarray(x, dtype=np.float64).reshape(-1), dtype=dtype, device=device)
        with torch.no_grad():
            return matvec(t).detach().to("cpu", torch.float64).numpy()

    return LinearOperator((size, size), matvec=mv, dtype=np.float64)


@dataclass(frozen=True)
class Condition(ConditionNumber):
    r""":class:`curvlab.curvature.ConditionNumber` with the route that measured it (``"dense"`` or ``"lanczos"``) and
    the precision of the spectrum. ``rank`` and ``numerical_rank`` are ``None`` where they were not measured: Lanczos
    found eigenvalues below the cut but cannot count their multiplicity (a repeated zero shows up once)."""

    route: str = "dense"
    precision: str = "float64"

    def __str__(self) -> str:
        if self.rank is not None:
            return f"{super().__str__()} [{self.route}, {self.precision}]"
        return (f"kappa={self.kappa:.4g} over the eigenvalues above rtol={self.rtol:.2g} (rank not measured: Lanczos "
                f"found null directions of unknown multiplicity; size {self.size}), lambda_max={self.lambda_max:.4g}, "
                f"gap at cut={self.gap:.3g} [{self.route}, {self.precision}]")


def _warn_gap(res: ConditionNumber, where: str) -> None:
    if res.gap < GAP_WARN:
        warnings.warn(f"gap lambda_r/lambda_(r+1) = {res.gap:.3g} < 10 at the rank cut ({where}, rank "
                      f"{res.rank if res.rank is not None else 'not measured'} of {res.size}): the cut lies inside the "
                      f"spectrum, so kappa = {res.kappa:.4g} depends on where it falls. Look at the spectrum; compute it "
                      "in float64 (precision='float64'), or choose rtol/rank where the gap is clean", RankCutWarning,
                      stacklevel=3)


def _lanczos(apply, size: int, *, k: int, tol: float, rtol: float | None, dtype: torch.dtype, device, seed: int,
             maxiter: int, deadline: float | None, lift=None, precision: str = "model",
             max_rounds: int = 8) -> Condition:
    r"""kappa over the nonzero spectrum by ``eigsh`` (``k`` largest, then ``k`` smallest) on ``apply``, started from a
    seeded vector. ``lift(lam_max) -> (apply', n_known)`` moves known null directions to ``lam_max`` first.

    The rank is measured, not guessed: a repeated zero eigenvalue shows up in Lanczos once (or a few times), so each
    round lifts the null Ritz vectors it found to ``lam_max`` and asks again, until a round finds no eigenvalue below
    the cut (then ``rank = size - n_known - found``). After ``max_rounds`` rounds the rank is reported as not measured
    (``None``)."""
    from scipy.sparse.linalg import eigsh

    if 2 * k >= size:
        raise ValueError(f"k must be < size/2 = {size / 2:g} for Lanczos; use method='dense'")
    v0 = np.random.default_rng(seed).standard_normal(size)
    opts = dict(k=k, tol=tol, v0=v0, maxiter=maxiter)
    top = eigsh(_scipy_operator(apply, size, dtype, device, deadline), which="LA", return_eigenvectors=False, **opts)
    lam_max = float(np.max(top))
    n_known = 0
    if lift is not None:
        apply, n_known = lift(lam_max)
    rtol = default_rtol(size, dtype) if rtol is None else rtol
    threshold = rtol * lam_max
    base, found, nulls, kept = apply, [], None, np.empty(0)
    for _ in range(max_rounds):
        vals, vecs = eigsh(_scipy_operator(apply, size, dtype, device, deadline), which="SA", **opts)
        below = vals <= threshold
        kept = np.sort(vals[~below])[::-1] if (~below).any() else kept
        if not below.any():
            break
        found.extend(vals[below].tolist())
        new = torch.as_tensor(vecs[:, below], dtype=torch.float64)
        nulls = new if nulls is None else torch.cat([nulls, new], 1)
        Q = torch.linalg.qr(nulls).Q.to(dtype=dtype, device=device)

        def apply(w, Q=Q):  # noqa: E306 - the found null directions lifted to lam_max as well
            return base(w) + lam_max * (Q @ (Q.T @ w))
    else:
        below = np.ones(1, bool)  # the last round still found null directions: the count is not complete
    if kept.size == 0:
        raise ValueError(f"all {k} smallest eigenvalues are below rtol * lambda_max = {threshold:.3g}: the rank cut is "
                         "out of Lanczos' reach; raise k or use method='dense'")
    lam_r = float(kept[-1])
    floor = float(torch.finfo(dtype).eps) * lam_max  # a Ritz value below this is zero to working precision
    measured = not below.any()
    if found:
        lam_next = float(max(found))
        gap = lam_r / max(lam_next, floor)
    else:
        lam_next = 0.0 if n_known else None
        gap = math.inf
    rank = size - n_known - len(found) if measured else None
    return Condition(kappa=lam_max / lam_r, rank=rank, numerical_rank=rank, size=size, lambda_max=lam_max,
                     lambda_min_nonzero=lam_r, lambda_discarded=lam_next, gap=gap, rtol=rtol, threshold=threshold,
                     forced=False, route="lanczos", precision=precision)


def _in_float64(prob: Problem) -> Problem:
    """The same problem on a float64 copy of the module and data (the module itself is not touched)."""
    if prob.dtype == torch.float64:
        return prob
    if prob.device.type == "mps":
        raise ValueError("precision='float64' is not available on MPS (no float64 there); use precision='model' or "
                         "move the model to the CPU")
    model = copy.deepcopy(prob.model).to(torch.float64)
    chunks = [(X.double() if X.is_floating_point() else X, Y.double() if Y.is_floating_point() else Y)
              for X, Y in prob.chunks]
    return dataclasses.replace(prob, model=model, chunks=chunks, dtype=torch.float64, _cache=None)


def condition(prob: Problem, *, rank: int | None = None, rtol: float | None = None, method: str = "auto",
              dense_max: int = 3000, dense_max_entries: int = 2**27, k: int = 6,
              tol: float = 1e-8, precision: str = "auto", seed: int = 0, maxiter: int = 300,
              max_seconds: float | None = None) -> Condition:
    r""":math:`\kappa = \lambda_{\max}/\lambda_r` of :math:`H_{\mathrm{GN}}` over its nonzero spectrum, with the rank cut
    :math:`r` and the gap :math:`\lambda_r/\lambda_{r+1}` there (:class:`Condition`, a
    :class:`curvlab.curvature.ConditionNumber`). A gap below 10 is warned about (:class:`RankCutWarning`) in every route.

    Eigenvalues are those of :math:`H_{\mathrm{GN}}` (units of the loss, see ``reduction``), computed on the smaller of
    :math:`H_{\mathrm{GN}}` (``p x p``) and :math:`K/\texttt{norm}` (``nc x nc``); ``size`` in the result is that
    matrix's size.

    ``method="dense"``: ``eigvalsh``; ``"lanczos"``: :func:`scipy.sparse.linalg.eigsh` on a matrix-free operator for the
    ``k`` largest and ``k`` smallest eigenvalues, started from a vector seeded by ``seed`` (for cross-entropy on
    :math:`K` the known null directions :math:`\sqrt{\pi_{i}}` of every sample and token are lifted to
    :math:`\lambda_{\max}` first). Lanczos reports the rank only where it measured it: when no eigenvalue among the
    ``k`` smallest falls below the cut; otherwise ``rank=None`` (a repeated zero eigenvalue shows up once), and if all
    ``k`` fall below, a ValueError. Budget: ``maxiter`` restarts per end and ``max_seconds`` of wall time in all; past
    either, the dense route is taken with a warning where it fits (``size <= dense_max`` and
    :math:`nc\,p \le` ``dense_max_entries``), else a ValueError. ``"auto"``: dense when it fits, otherwise Lanczos
    (at :math:`p\approx1.9\cdot10^6`, :math:`nc = 1280` the dense route's :math:`\tilde J` would need 9.5 GB in float32,
    Lanczos a few parameter-sized vectors).

    ``precision``: ``"float64"`` computes the spectrum on a float64 copy of the module and data (the same parameters,
    evaluated exactly); ``"model"`` in the model's dtype; ``"auto"`` (default) is ``"float64"`` for the dense route
    and ``"model"`` for Lanczos (a float64 copy of a :math:`10^6`-parameter network doubles time and memory; a float32
    spectrum resolves eigenvalues down to about :math:`10^{-6}\lambda_{\max}` only, and the gap warning says when the
    cut falls inside it). ``rtol`` defaults to ``default_rtol(size, dtype of the spectrum)``; ``rank`` forces the cut
    (dense only).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.condition(prob).rank
    16
    """
    prob = _check_problem(prob)
    method = check_choice("method", method, ("auto", "dense", "lanczos"))
    precision = check_choice("precision", precision, ("auto", "float64", "model"))
    dense_max = check_int("dense_max", dense_max, min_value=1)
    dense_max_entries = check_int("dense_max_entries", dense_max_entries, min_value=1)
    k = check_int("k", k, min_value=1)
    seed = check_int("seed", seed, min_value=0)
    maxiter = check_int("maxiter", maxiter, min_value=1)
    tol = check_nonnegative("tol", tol)
    if rtol is not None:
        rtol = check_nonnegative("rtol", rtol)
    if max_seconds is not None:
        max_seconds = check_nonnegative("max_seconds", max_seconds)
    on_kernel = prob.n * prob.c < prob.p
    size = prob.n * prob.c if on_kernel else prob.p
    fits = size <= dense_max and prob.n * prob.c * prob.p <= dense_max_entries
    if method == "auto":
        method = "dense" if fits else "lanczos"
    if method == "dense":
        work = _in_float64(prob) if precision in ("auto", "float64") else prob
        M = kernel_matrix(work) / work.norm if on_kernel else ggn_matrix(work, max_params=max(work.p, 1))
        lam = torch.linalg.eigvalsh(config.spectral(M)).flip(-1)
        rtol = default_rtol(size, work.dtype) if rtol is None else rtol
        res = Condition(**condition_number(lam, rtol, rank=rank).to_dict(), route="dense",
                        precision=str(work.dtype).replace("torch.", ""))
        _warn_gap(res, "dense route")
        return res
    if rank is not None:
        raise ValueError("rank can only be forced with method='dense' (Lanczos sees only the spectrum's ends)")
    work = _in_float64(prob) if precision == "float64" else prob
    if on_kernel:
        apply = lambda w: _kernel_vector_product(work, w) / work.norm  # noqa: E731
    else:
        apply = lambda v: ggn_vector_product(work, v)  # noqa: E731
    lift = None
    if on_kernel and work.loss == "cross_entropy":
        # K's known null space: sqrt(pi) of each token in its block (S sqrt(pi) = 0). Lift it to lambda_max so that
        # the smallest eigenvalues Lanczos returns are those of the rest of the spectrum.
        def lift(lam_max):
            with torch.no_grad():
                P = torch.cat([_tokens(work, _probs(work, work.forward_fn(X)(work.theta()))).sqrt()
                               for X, _ in work.chunks])  # (n, T, classes)
            U = torch.block_diag(*P.reshape(-1, work.classes).unbind(0)).T  # (n c, n T), orthonormal columns
            return (lambda w: apply(w) + lam_max * (U @ (U.T @ w))), U.shape[1]
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    from scipy.sparse.linalg import ArpackError

    try:
        res = _lanczos(apply, size, k=k, tol=tol, rtol=rtol, dtype=work.dtype, device=work.device, seed=seed,
                       maxiter=maxiter, deadline=deadline, lift=lift, precision=str(work.dtype).replace("torch.", ""))
    except (_Budget, ArpackError) as err:
        why = (f"max_seconds = {max_seconds:g} s" if isinstance(err, _Budget) else
               f"maxiter = {maxiter} restarts without converging to tol = {tol:g}: {err}")
        if fits:
            warnings.warn(f"Lanczos stopped at its budget ({why}); the dense route fits (size {size} <= dense_max, "
                          f"nc p <= dense_max_entries) and is used instead", UserWarning, stacklevel=2)
            return condition(prob, rank=None, rtol=rtol, method="dense", precision=precision)
        raise ValueError(f"Lanczos stopped at its budget ({why}) and the dense route does not fit (size {size}, "
                         f"dense_max = {dense_max}, nc p = {prob.n * prob.c * prob.p}, dense_max_entries = "
                         f"{dense_max_entries}); raise maxiter or max_seconds, loosen tol, or try "
                         "precision='float64'") from None
    _warn_gap(res, "Lanczos")
    return res


def _torch_apply(op):
    """``(apply, size, dtype, device)`` for a square operator: a torch matrix, a SciPy ``LinearOperator``, or an
    object with ``shape`` and ``@`` on torch tensors (a curvlinops operator, a curvlab one)."""
    from scipy.sparse.linalg import LinearOperator

    if isinstance(op, torch.Tensor):
        if op.dim() != 2 or op.shape[0] != op.shape[1] or not op.is_floating_point():
            raise ValueError(f"op must be a square floating matrix, got shape {tuple(op.shape)} ({op.dtype})")
        return (lambda v: op @ v), op.shape[0], op.dtype, op.device
    shape = getattr(op, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != shape[1]:
        raise TypeError(f"op must be a square torch matrix, a scipy LinearOperator or an operator with shape and @ on "
                        f"torch tensors (curvlinops), got {type(op).__name__} of shape {shape}")
    if isinstance(op, LinearOperator):
        def apply(v):
            out = op @ v.detach().cpu().numpy().astype(np.float64)
            return torch.as_tensor(np.asarray(out), dtype=torch.float64)

        return apply, int(shape[0]), torch.float64, torch.device("cpu")
    dtype = getattr(op, "dtype", torch.float64)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float64
    return (lambda v: op @ v), int(shape[0]), dtype, getattr(op, "device", torch.device("cpu"))


def condition_of(op, *, rank: int | None = None, rtol: float | None = None, method: str = "auto",
                 dense_max: int = 3000, k: int = 6, tol: float = 1e-8, seed: int = 0, maxiter: int = 300,
                 max_seconds: float | None = None, known_null: torch.Tensor | None = None) -> Condition:
    r""":math:`\kappa` over the nonzero spectrum, with the rank cut and the gap there, of any symmetric PSD operator:
    a curvlinops operator (``GGNLinearOperator``, ``KFACLinearOperator``, ``FisherMCLinearOperator``, ...), a SciPy
    ``LinearOperator``, a curvlab one (:func:`ggn_operator`) or a torch matrix. The rules of :func:`condition`: dense
    (``op @ I``, then float64 ``eigvalsh``) up to ``dense_max``, Lanczos beyond (seeded, with the same budget, the rank
    reported only where measured; ``known_null``, ``(size, m)`` orthonormal columns, are lifted out of the way first);
    ``rtol`` defaults to ``default_rtol(size, op's dtype)``; a gap below 10 warns. A ``p x p`` GGN with
    :math:`nc < p` has a null space of dimension :math:`\ge p - nc` that Lanczos cannot see past: use the dense route,
    or :func:`condition` (on the kernel) for a :mod:`curvlab.model` problem.

    >>> import torch; from curvlab import model as cm
    >>> cm.condition_of(torch.diag(torch.tensor([4.0, 2.0, 1.0, 0.0], dtype=torch.float64))).kappa
    4.0
    """
    method = check_choice("method", method, ("auto", "dense", "lanczos"))
    dense_max = check_int("dense_max", dense_max, min_value=1)
    k = check_int("k", k, min_value=1)
    seed = check_int("seed", seed, min_value=0)
    maxiter = check_int("maxiter", maxiter, min_value=1)
    tol = check_nonnegative("tol", tol)
    if rtol is not None:
        rtol = check_nonnegative("rtol", rtol)
    apply, size, dtype, device = _torch_apply(op)
    fits = size <= dense_max
    if method == "auto":
        method = "dense" if fits else "lanczos"
    if method == "dense":
        with torch.no_grad():
            M = config.spectral(apply(torch.eye(size, dtype=dtype, device=device)))
        asym = float((M - M.T).abs().max())
        if asym > 1e3 * size * torch.finfo(dtype).eps * float(M.abs().max()):
            raise ValueError(f"op is not symmetric (max |M - M^T| = {asym:.3g}): kappa needs a symmetric PSD operator")
        lam = torch.linalg.eigvalsh(0.5 * (M + M.T)).flip(-1)
        rtol = default_rtol(size, dtype) if rtol is None else rtol
        res = Condition(**condition_number(lam, rtol, rank=rank).to_dict(), route="dense",
                        precision=str(dtype).replace("torch.", ""))
        _warn_gap(res, "dense route")
        return res
    if rank is not None:
        raise ValueError("rank can only be forced with method='dense' (Lanczos sees only the spectrum's ends)")
    lift = None
    if known_null is not None:
        U = torch.as_tensor(known_null, dtype=dtype, device=device)
        if U.dim() != 2 or U.shape[0] != size:
            raise ValueError(f"known_null must have shape ({size}, m), got {tuple(U.shape)}")
        lift = lambda lam_max: ((lambda w: apply(w) + lam_max * (U @ (U.T @ w))), U.shape[1])  # noqa: E731
    deadline = None if max_seconds is None else time.monotonic() + check_nonnegative("max_seconds", max_seconds)
    from scipy.sparse.linalg import ArpackError

    try:
        res = _lanczos(apply, size, k=k, tol=tol, rtol=rtol, dtype=dtype, device=device, seed=seed, maxiter=maxiter,
                       deadline=deadline, lift=lift, precision=str(dtype).replace("torch.", ""))
    except (_Budget, ArpackError) as err:
        why = "max_seconds" if isinstance(err, _Budget) else f"maxiter = {maxiter}: {err}"
        if fits:
            warnings.warn(f"Lanczos stopped at its budget ({why}); the dense route is used instead", UserWarning,
                          stacklevel=2)
            return condition_of(op, rtol=rtol, method="dense", dense_max=dense_max)
        raise ValueError(f"Lanczos stopped at its budget ({why}) and size {size} > dense_max = {dense_max}; raise "
                         "maxiter or max_seconds, or loosen tol") from None
    _warn_gap(res, "Lanczos")
    return res



# ============================================================================================ K-FAC
@dataclass(frozen=True)
class KFACFactors:
    r"""K-FAC's factors of one layer (``module`` its name): the weight block (flattened row-major, ``(d_out, d_in)``
    for a Conv2d's ``(d_out, d_in k_h k_w)``) is approximated by :math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}`, the bias
    block (if any) by :math:`C_{\mathrm{out}}` (the weight and the bias are separate blocks, as in curvlinops)."""

    module: str
    weight: str
    bias: str | None
    C_out: torch.Tensor
    C_in: torch.Tensor


def _layer_inputs(mod: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """Rows the layer's weight multiplies: ``(n, n_pos, d_in)`` (``n_pos = 1`` for Linear)."""
    if isinstance(mod, nn.Linear):
        return a.reshape(a.shape[0], -1, a.shape[-1])
    patches = torch.nn.functional.unfold(a, mod.kernel_size, dilation=mod.dilation, padding=mod.padding,
                                         stride=mod.stride)
    return patches.transpose(1, 2)  # (n, n_pos, d_in k k)


def _pname(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def _supported(mod: nn.Module) -> bool:
    if isinstance(mod, nn.Linear):
        return True
    return (type(mod) is nn.Conv2d and mod.groups == 1 and mod.padding_mode == "zeros"
            and not isinstance(mod.padding, str))


def _why_unsupported(mod: nn.Module) -> str:
    name = type(mod).__name__
    if type(mod) is nn.Conv2d:
        why = [f"groups={mod.groups}"] if mod.groups != 1 else []
        why += [f"padding={mod.padding!r}"] if isinstance(mod.padding, str) else []
        why += [f"padding_mode={mod.padding_mode!r}"] if mod.padding_mode != "zeros" else []
        return f"{name}, {', '.join(why)}"
    return name


def _kfac_layers(prob: Problem) -> list:
    """The (name, module) pairs K-FAC gives factors for; refuses shared parameters, warns about uncovered ones."""
    trainable = set(prob.names)
    owners: dict = {}
    for name, mod in prob.model.named_modules():
        for pn, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(_pname(name, pn))
    chosen = {id(p) for k, p in prob.model.named_parameters() if k in trainable}
    shared = [names for key, names in owners.items() if len(names) > 1 and key in chosen]
    if shared:
        raise ValueError("K-FAC: parameters shared across modules: " + "; ".join(" = ".join(
            repr(x) for x in names) for names in shared) + ". One Kronecker block per layer does not describe a "
            "parameter used by several layers; leave them out with params=[...] or use the GN itself")
    layers, skipped = [], []
    for name, mod in prob.model.named_modules():
        own = [_pname(name, pn) for pn, p in mod._parameters.items() if p is not None]
        if not any(k in trainable for k in own):
            continue
        if _supported(mod) and _pname(name, "weight") in trainable:
            layers.append((name, mod))
        else:
            skipped.append(f"'{name}' ({_why_unsupported(mod)})")
    if skipped:
        warnings.warn("K-FAC covers nn.Linear and nn.Conv2d (groups=1, numeric zero padding) only: no factors for the "
                      f"parameters of {', '.join(skipped)}", UserWarning, stacklevel=3)
    return layers


def kfac_factors(prob: Problem) -> list[KFACFactors]:
    r"""K-FAC's exact (type-2) Kronecker factors of every ``nn.Linear`` / ``nn.Conv2d`` (``groups=1``, zero padding)
    whose weight is trainable: :math:`C_{\mathrm{in}} = \frac1{n\,n_{\mathrm{pos}}}\sum_{i,s}a_{i,s}a_{i,s}^\top`,
    :math:`C_{\mathrm{out}} = \frac1n\sum_{i,s}\sum_{j} g_{i,s,j}g_{i,s,j}^\top` with :math:`g_{i,s,j}` the gradient of
    :math:`(S_i^\top f_\theta(x_i))_j` with respect to the layer's output at position :math:`s` (Martens & Grosse
    2015; "expand" convention for weight sharing, Eschenhagen et al. 2023; chapter 02 and :func:`curvlab.primer.kfac_factors`).
    Other layers (batch norm's affine parameters, grouped or string-padded convolutions, embeddings) get no factors.
    A layer used twice in one forward pass, or not at all, is refused.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> [tuple(f.C_out.shape) + tuple(f.C_in.shape) for f in cm.kfac_factors(prob)]
    [(4, 4, 3, 3), (2, 2, 4, 4)]
    """
    prob = _check_problem(prob)
    trainable = set(prob.names)
    layers = _kfac_layers(prob)
    if not layers:
        raise ValueError("model has no trainable nn.Linear or nn.Conv2d (groups=1, zero padding) layer for K-FAC")
    C_in = {name: 0.0 for name, _ in layers}
    C_out = {name: 0.0 for name, _ in layers}
    theta = prob.theta()
    for X, _ in prob.chunks:
        seen: dict = {}

        def hook(mod, inp, out, name=None):
            if name in seen:
                raise ValueError(f"model uses layer {name!r} twice in one forward pass; K-FAC here needs one use")
            seen[name] = (inp[0].detach(), out)

        handles = [mod.register_forward_hook(lambda m, i, o, name=name: hook(m, i, o, name)) for name, mod in layers]
        try:
            th = theta.clone().requires_grad_(True)
            f = prob.forward_fn(X)(th)
        finally:
            for h in handles:
                h.remove()
        S = _sqrt_hess(prob, f.detach())
        unused = [name for name, _ in layers if name not in seen]
        if unused:
            raise ValueError(f"model has K-FAC layers that its forward pass does not use: {unused}; leave their "
                             "parameters out with params=[...]")
        outs = [seen[name][1] for name, _ in layers]
        for j in range(prob.c):
            grads = torch.autograd.grad(f, outs, grad_outputs=S[:, :, j], retain_graph=j < prob.c - 1,
                                        allow_unused=True)
            dead = [repr(name) for (name, _), g in zip(layers, grads) if g is None]
            if dead:
                raise ValueError(f"K-FAC layers with no path to the output: {', '.join(dead)} (the forward pass uses "
                                 "them, but the model's output does not depend on them: their GN block is zero); leave "
                                 "their parameters out with params=[...]")
            for (name, mod), g in zip(layers, grads):
                g = g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2) if isinstance(mod, nn.Conv2d) \
                    else g.reshape(g.shape[0], -1, g.shape[-1])
                C_out[name] = C_out[name] + torch.einsum("isa,isb->ab", g, g)
        for name, mod in layers:
            a = _layer_inputs(mod, seen[name][0])
            C_in[name] = C_in[name] + torch.einsum("isa,isb->ab", a, a) / a.shape[1]
    result = []
    for name, mod in layers:
        bias = _pname(name, "bias") if mod.bias is not None and _pname(name, "bias") in trainable else None
        result.append(KFACFactors(module=name, weight=_pname(name, "weight"), bias=bias,
                                  C_out=(C_out[name] / prob.norm).detach(), C_in=(C_in[name] / prob.n).detach()))
    return result


def _operator_block_errors(prob: Problem, op, dense_block_max: int) -> pd.DataFrame:
    """The distance of each parameter's diagonal block of any ``p x p`` operator to the exact GN block."""
    apply, size, _, _ = _torch_apply(op)
    if size != prob.p:
        raise ValueError(f"factors (an operator) must be {prob.p} x {prob.p}, the problem's parameters (build the "
                         f"problem with params=[...] the operator's parameters, in the same order); got {size}")
    Jt = jacobian(prob)
    owner = {}
    for name, mod in prob.model.named_modules():
        for pn in mod._parameters:
            owner.setdefault(_pname(name, pn), name)
    rows, start = [], 0
    for name, size_b in zip(prob.names, prob.sizes):
        if size_b > dense_block_max:
            raise ValueError(f"parameter {name!r} has {size_b} > dense_block_max = {dense_block_max} entries: its "
                             "block of an operator is formed column by column")
        E = torch.zeros(prob.p, size_b, dtype=prob.dtype, device=prob.device)
        E[start:start + size_b] = torch.eye(size_b, dtype=prob.dtype, device=prob.device)
        with torch.no_grad():
            A = apply(E)[start:start + size_b].to(dtype=prob.dtype, device=prob.device)
        J_b = Jt[:, start:start + size_b]
        B = J_b.T @ J_b / prob.norm
        nB = float(torch.linalg.matrix_norm(B))
        rel = float(torch.linalg.matrix_norm(B - A)) / nB if nB > 0 else math.nan
        rows.append(dict(module=owner.get(name, ""), param=name, size=size_b, rel_error=rel))
        start += size_b
    return pd.DataFrame(rows)


def kfac_block_errors(prob: Problem, factors=None, *, dense_block_max: int = 2048) -> pd.DataFrame:
    r"""Relative Frobenius distance :math:`\lVert B - C_{\mathrm{out}}\otimes C_{\mathrm{in}}\rVert_F/\lVert B\rVert_F`
    between each layer's exact diagonal GN block :math:`B = \tilde J_W^\top\tilde J_W/n` and its K-FAC block
    (chapter 40's Kronecker error, :func:`curvlab.synthesis.kronecker_error`). Computed from the rows
    :math:`M_r` (``d_out x d_in``) of :math:`\tilde J_W` without forming :math:`B`:
    :math:`\lVert B\rVert_F^2 = \lVert\tilde J_W\tilde J_W^\top\rVert_F^2/n^2`,
    :math:`\langle B, C_{\mathrm{out}}\otimes C_{\mathrm{in}}\rangle = \frac1n\sum_r\langle M_r, C_{\mathrm{out}}M_rC_{\mathrm{in}}\rangle`
    for blocks larger than ``dense_block_max`` (then accurate to about :math:`\sqrt{\varepsilon}`); smaller blocks are
    formed and subtracted directly. ``factors`` may also be any ``p x p`` operator (a curvlinops
    ``KFACLinearOperator`` or ``EKFACLinearOperator`` on the problem's parameters, in the same order and loss units,
    see :func:`torch_loss`; a :class:`KFACOperator`): each parameter's diagonal block is then read off with
    ``op @ E`` and compared with the exact block (blocks up to ``dense_block_max`` entries).
    One row per layer (weight and bias rows): ``module, param, size, rel_error``.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> list(cm.kfac_block_errors(prob).columns)
    ['module', 'param', 'size', 'rel_error']
    """
    prob = _check_problem(prob)
    dense_block_max = check_int("dense_block_max", dense_block_max, min_value=1)
    if factors is not None and not isinstance(factors, list) and hasattr(factors, "shape"):
        return _operator_block_errors(prob, factors, dense_block_max)
    factors = kfac_factors(prob) if factors is None else factors
    if not isinstance(factors, list) or not all(isinstance(f, KFACFactors) for f in factors):
        raise TypeError("factors must be the list returned by kfac_factors, or an operator (p x p)")
    Jt = jacobian(prob)
    offsets = dict(zip(prob.names, np.cumsum([0, *prob.sizes[:-1]]).tolist()))
    size_of = dict(zip(prob.names, prob.sizes))
    rows = []
    for fac in factors:
        for pname, A, B in ((fac.weight, fac.C_out, fac.C_in), (fac.bias, fac.C_out, None)):
            if pname is None:
                continue
            J_W = Jt[:, offsets[pname]:offsets[pname] + size_of[pname]]
            M = J_W.reshape(J_W.shape[0], A.shape[0], -1)
            C = B if B is not None else torch.ones(1, 1, dtype=A.dtype, device=A.device)
            if J_W.shape[1] <= dense_block_max:  # form B: no cancellation in ||B - A kron C||
                o, i = A.shape[0], C.shape[0]
                B4 = (J_W.T @ J_W / prob.norm).reshape(o, i, o, i)
                diff = B4 - A[:, None, :, None] * C[None, :, None, :]
                nB2, nD2 = float((B4 * B4).sum()), float((diff * diff).sum())
            else:  # never form B; the difference then loses about half the digits (sqrt(eps) floor)
                G = J_W @ J_W.T
                nB2 = float((G * G).sum()) / prob.norm ** 2
                inner = float(torch.einsum("rab,ac,rcd,bd->", M, A, M, C)) / prob.norm
                nD2 = max(nB2 - 2 * inner + float((A * A).sum() * (C * C).sum()), 0.0)
            rel = math.sqrt(nD2 / nB2) if nB2 > 0 else math.nan
            rows.append(dict(module=fac.module, param=pname, size=size_of[pname], rel_error=rel))
    return pd.DataFrame(rows)


# ============================================================================================ GN step
def gn_step(prob: Problem, lam_GN: float, *, jac_op=None) -> torch.Tensor:
    r"""Damped GN direction in kernel form, :math:`\Delta_{\mathrm{GN}} = (H_{\mathrm{GN}}+\lambda_{\mathrm{GN}}I_p)^{-1}
    \nabla\mathcal L = \tilde J^\top(K + \texttt{norm}\,\lambda_{\mathrm{GN}}I)^{-1}\rho` (push-through identity; an
    ``nc x nc`` solve, cheap when :math:`p\gg nc`), ``(p,)``; ``norm`` is the loss's divisor (:math:`n` for the mean
    MSE). ``lam_GN`` is in the units of :math:`H_{\mathrm{GN}}`'s eigenvalues (notation page); ``lam_GN = 0`` needs
    :math:`K` invertible (MSE with :math:`nc\le p`; never cross-entropy, whose :math:`K` has rank at most
    :math:`n(c-1)`). :math:`\rho_i = S_i^{+}\nabla_f\ell_i` (exact: :math:`\nabla_f\ell_i` lies in the range of
    :math:`S_i`). Step with :func:`apply_step`.

    ``jac_op``: another implementation's Jacobian of the model's outputs, ``(n c, p)`` with sample-major rows (e.g.
    curvlinops' ``JacobianLinearOperator(model, params, [(X, y)])``); :math:`\tilde J = S^\top J` is then built from
    its transposed products (``jac_op.adjoint() @ I``) instead of this module's own.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.gn_step(prob, lam_GN=1e-3).shape
    torch.Size([26])
    """
    prob = _check_problem(prob)
    lam_GN = check_nonnegative("lam_GN", lam_GN)
    theta = prob.theta()
    rho, Ss = [], []
    with torch.no_grad():
        for X, Y in prob.chunks:
            f = prob.forward_fn(X)(theta)
            g = _loss_grad_out(prob, f, Y)
            S = _sqrt_hess(prob, f)
            Ss.append(S)
            rho.append(g if prob.loss == "mse" else
                       (torch.linalg.pinv(S, hermitian=False) @ g.unsqueeze(-1)).squeeze(-1))
    rho = torch.cat(rho).reshape(-1)
    nc = prob.n * prob.c
    if jac_op is None:
        Jt = jacobian(prob)
    else:
        shape = tuple(getattr(jac_op, "shape", ()))
        if shape != (nc, prob.p):
            raise ValueError(f"jac_op must be an (n c, p) = ({nc}, {prob.p}) operator, got shape {shape}")
        eye = torch.eye(nc, dtype=prob.dtype, device=prob.device)
        with torch.no_grad():
            J = (jac_op.adjoint() @ eye).T if hasattr(jac_op, "adjoint") else jac_op @ torch.eye(
                prob.p, dtype=prob.dtype, device=prob.device)
        J = torch.as_tensor(J, dtype=prob.dtype, device=prob.device).reshape(prob.n, prob.c, prob.p)
        Jt = torch.einsum("bji,bjp->bip", torch.cat(Ss), J).reshape(nc, prob.p)
    K = Jt @ Jt.T
    K = 0.5 * (K + K.T) + prob.norm * lam_GN * torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    L, info = torch.linalg.cholesky_ex(K)
    if int(info) != 0:
        raise ValueError(f"K + norm lam_GN I is numerically singular (lam_GN = {lam_GN:g}); use lam_GN > 0"
                         + (" (cross-entropy's K is always singular)" if prob.loss == "cross_entropy" else ""))
    z = torch.cholesky_solve(rho.unsqueeze(-1), L).squeeze(-1)
    return Jt.T @ z


def loss_gradient(prob: Problem, theta: torch.Tensor | None = None) -> torch.Tensor:
    r"""The gradient :math:`\nabla\mathcal L(\theta)` of the averaged loss by reverse mode, ``(p,)`` (current
    parameters when ``theta`` is None); the gradient-descent direction that :func:`gn_step` preconditions.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.loss_gradient(prob).shape
    torch.Size([26])
    """
    prob = _check_problem(prob)
    theta = prob.theta() if theta is None else _as_vectors(prob, theta, prob.p, "theta")
    if theta.dim() != 1:
        raise ValueError(f"theta must have shape ({prob.p},), got {tuple(theta.shape)}")
    total = torch.zeros_like(theta)
    for X, Y in prob.chunks:
        fn = prob.forward_fn(X)
        f, pullback = vjp(fn, theta)
        total = total + pullback(_loss_grad_out(prob, f.detach(), Y))[0]
    return total / prob.norm


def apply_step(prob: Problem, delta, eta: float = 1.0) -> None:
    r"""In place: :math:`\theta \leftarrow \theta - \eta\,\Delta` on the module's trainable parameters (``delta`` ``(p,)``).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> before = cm.loss_value(prob)
    >>> cm.apply_step(prob, cm.gn_step(prob, lam_GN=1e-2), eta=0.1)
    >>> cm.loss_value(prob) < before
    True
    """
    prob = _check_problem(prob)
    eta = check_positive("eta", eta)
    delta = _as_vectors(prob, delta, prob.p, "delta")
    if delta.dim() != 1:
        raise ValueError(f"delta must have shape ({prob.p},), got {tuple(delta.shape)}")
    params = dict(prob.model.named_parameters())
    with torch.no_grad():
        for k, t in prob.unflatten(delta).items():
            params[k].sub_(eta * t)


# ============================================================================================ the ecosystem
def torch_loss(prob: Problem) -> tuple:
    r"""``(loss_function, scale)``: the torch loss module whose curvature, times ``scale``, is this problem's, for
    handing the same problem to curvlinops or BackPACK (``scale * GGNLinearOperator(model, loss_function, ...)`` is
    :math:`H_{\mathrm{GN}}` here).

    ``"mse"``: ``MSELoss(reduction="sum")`` with ``scale`` :math:`= 1/(2\,\texttt{norm})` (its loss is
    :math:`\sum\lVert f-y\rVert^2`, ours :math:`\frac1{\texttt{norm}}\sum\frac12\lVert f-y\rVert^2`);
    ``"cross_entropy"``: ``CrossEntropyLoss(reduction=...)``, ``"bce"``: ``BCEWithLogitsLoss(reduction=...)``, both with
    ``scale = 1`` (for a per-token output torch wants the classes on axis 1: ``(n, classes, T)``).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.torch_loss(prob)
    (MSELoss(), 0.0625)
    """
    prob = _check_problem(prob)
    if prob.loss == "mse":
        return nn.MSELoss(reduction="sum"), 1.0 / (2.0 * prob.norm)
    if prob.loss == "bce":
        return nn.BCEWithLogitsLoss(reduction=prob.reduction), 1.0
    return nn.CrossEntropyLoss(reduction=prob.reduction), 1.0


class CurvatureOperator:
    r"""A symmetric ``N x N`` operator in curvlinops 3's interface (``PyTorchLinearOperator``): ``shape``, ``dtype``,
    ``device``, ``op @ X`` on a torch vector ``(N,)``, matrix ``(N, K)`` or tensor list (one tensor per parameter,
    ``[*shape]`` or ``[*shape, K]``), ``_matmat`` on tensor lists, ``adjoint()`` and ``to_scipy()`` (a
    :class:`scipy.sparse.linalg.LinearOperator`). curvlinops' estimators (``hutchinson_trace``, ``hutchinson_diag``,
    ``lanczos_approximate_spectrum``, ...) and its ``+``/``-`` compositions take it as they take their own operators.
    Subclasses implement ``_flat(V)`` for ``V`` of shape ``(N, K)``."""

    SELF_ADJOINT = True

    def __init__(self, shapes: list, dtype: torch.dtype, device):
        self._in_shape = [torch.Size(s) for s in shapes]
        self._out_shape = list(self._in_shape)
        self._in_shape_flat = [s.numel() for s in self._in_shape]
        self._out_shape_flat = list(self._in_shape_flat)
        n = int(sum(self._in_shape_flat))
        self.shape = (n, n)
        self._dtype, self._device = dtype, torch.device(device)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def _flat(self, V: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _matmat(self, X: list) -> list:
        K = X[0].shape[len(self._in_shape[0])]
        V = torch.cat([x.reshape(n, K) for x, n in zip(X, self._in_shape_flat)])
        out = self._flat(V)
        return [t.reshape(*s, K) for t, s in zip(out.split(self._out_shape_flat), self._out_shape)]

    def __matmul__(self, X):
        if isinstance(X, (list, tuple)):
            vec = X[0].dim() == len(self._in_shape[0])
            out = self._matmat([x.unsqueeze(-1) for x in X] if vec else list(X))
            return [t.squeeze(-1) for t in out] if vec else out
        if not isinstance(X, torch.Tensor) or X.dim() not in (1, 2) or X.shape[0] != self.shape[1]:
            raise ValueError(f"X must be a tensor ({self.shape[1]},) or ({self.shape[1]}, K), or a tensor list, got "
                             f"{getattr(X, 'shape', type(X).__name__)}")
        V = X.to(device=self.device, dtype=self.dtype)
        out = self._flat(V.unsqueeze(-1) if X.dim() == 1 else V)
        return out.squeeze(-1) if X.dim() == 1 else out

    def adjoint(self):
        return self

    def __add__(self, other):
        return _Combined(self, other, 1.0)

    def __sub__(self, other):
        return _Combined(self, other, -1.0)

    def __mul__(self, scalar):
        return _Combined(self, None, float(scalar))

    __rmul__ = __mul__

    def to_scipy(self, dtype=None):
        """This operator as a :class:`scipy.sparse.linalg.LinearOperator` (NumPy in and out; products in torch)."""
        from scipy.sparse.linalg import LinearOperator

        def mm(x):
            x = np.asarray(x)
            t = torch.as_tensor(x, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                out = self @ (t.reshape(-1) if x.ndim == 1 else t)
            return out.detach().cpu().numpy().astype(x.dtype if x.dtype.kind == "f" else np.float64)

        return LinearOperator(self.shape, matvec=mm, rmatvec=mm, matmat=mm, rmatmat=mm,
                              dtype=np.dtype(np.float64) if dtype is None else dtype)


class _Combined(CurvatureOperator):
    """``a + s b`` (or ``s a`` when ``b`` is None) of two operators with the same shapes (curvlab or curvlinops)."""

    def __init__(self, a, b, s: float):
        super().__init__(a._in_shape, a.dtype, a.device)
        self.a, self.b, self.s = a, b, s

    def _flat(self, V):
        if self.b is None:
            return self.s * (self.a @ V)
        return self.a @ V + self.s * (self.b @ V)


class _GGNOperator(CurvatureOperator):
    def __init__(self, prob: Problem):
        super().__init__(prob.shapes, prob.dtype, prob.device)
        self.prob = prob

    def _flat(self, V):
        with torch.no_grad():
            return ggn_vector_product(self.prob, V.T).T


class _KernelOperator(CurvatureOperator):
    def __init__(self, prob: Problem):
        super().__init__([(prob.n * prob.c,)], prob.dtype, prob.device)
        self.prob = prob

    def _flat(self, V):
        with torch.no_grad():
            return torch.stack([_kernel_vector_product(self.prob, v) for v in V.T], 1) / self.prob.norm


class _GGNInverseOperator(CurvatureOperator):
    def __init__(self, prob: Problem, lam_GN: float):
        super().__init__(prob.shapes, prob.dtype, prob.device)
        self.Jt, self.lam = jacobian(prob), lam_GN
        K = self.Jt @ self.Jt.T
        K = 0.5 * (K + K.T) + prob.norm * lam_GN * torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
        self.L = torch.linalg.cholesky(K)

    def _flat(self, V):  # Woodbury: (J^T J / norm + lam I)^{-1} = (I - J^T (K + norm lam I)^{-1} J) / lam
        return (V - self.Jt.T @ torch.cholesky_solve(self.Jt @ V, self.L)) / self.lam


def ggn_operator(prob: Problem) -> CurvatureOperator:
    r""":math:`H_{\mathrm{GN}}` (``p x p``) as a curvlinops-/SciPy-compatible operator (:class:`CurvatureOperator`):
    products by :func:`ggn_vector_product`, never formed. ``.to_scipy()`` gives a SciPy ``LinearOperator``.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> (cm.ggn_operator(prob) @ torch.ones(prob.p).double()).shape
    torch.Size([26])
    """
    return _GGNOperator(_check_problem(prob))


def kernel_operator(prob: Problem) -> CurvatureOperator:
    r"""The kernel in the loss's units, :math:`K/\texttt{norm} = \tilde J\tilde J^\top/\texttt{norm}` (``nc x nc``, the
    nonzero eigenvalues of :math:`H_{\mathrm{GN}}`), as an operator: one VJP and one JVP per chunk and column.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.kernel_operator(prob).shape
    (16, 16)
    """
    return _KernelOperator(_check_problem(prob))


def ggn_inverse_operator(prob: Problem, lam_GN: float) -> CurvatureOperator:
    r"""The damped inverse :math:`(H_{\mathrm{GN}} + \lambda_{\mathrm{GN}}I_p)^{-1}` by the Woodbury identity
    :math:`\frac1{\lambda_{\mathrm{GN}}}\bigl(I - \tilde J^\top(K + \texttt{norm}\,\lambda_{\mathrm{GN}}I)^{-1}\tilde J\bigr)`:
    one ``nc x nc`` Cholesky factor, then two products with :math:`\tilde J` per vector (exact, no iteration).
    ``lam_GN > 0`` (units of :math:`H_{\mathrm{GN}}`); :func:`gn_step` is this operator applied to the gradient.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> inv = cm.ggn_inverse_operator(prob, 1e-2)
    >>> bool(torch.allclose(inv @ cm.loss_gradient(prob), cm.gn_step(prob, 1e-2)))
    True
    """
    prob = _check_problem(prob)
    lam_GN = check_positive("lam_GN", lam_GN)
    return _GGNInverseOperator(prob, lam_GN)


class KFACOperator(CurvatureOperator):
    r"""K-FAC's block-diagonal approximation of :math:`H_{\mathrm{GN}}` plus ``damping`` :math:`\cdot I`: one block
    :math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}` per weight and :math:`C_{\mathrm{out}}` per bias
    (:func:`kfac_factors`), applied as :math:`\operatorname{vec}(C_{\mathrm{out}}WC_{\mathrm{in}}^\top)` (row-major).
    ``inverse()`` is the exact damped inverse :math:`(C_{\mathrm{out}}\otimes C_{\mathrm{in}} + \lambda I)^{-1}`
    through the factors' eigendecompositions (:math:`Q_{\mathrm{out}}\,[\,Q_{\mathrm{out}}^\top W Q_{\mathrm{in}}
    \oslash (a b^\top + \lambda)\,]\,Q_{\mathrm{in}}^\top`), as curvlinops' ``KFACInverseLinearOperator`` with
    ``use_exact_damping=True``."""

    def __init__(self, prob: Problem, factors: list, damping: float = 0.0, inverse: bool = False):
        super().__init__(prob.shapes, prob.dtype, prob.device)
        covered = {}
        for f in factors:
            covered[f.weight] = f
            if f.bias is not None:
                covered[f.bias] = f
        missing = [k for k in prob.names if k not in covered]
        if missing:
            raise ValueError(f"K-FAC has no block for the parameters {missing}: build the problem with "
                             "params=[...] restricted to nn.Linear / nn.Conv2d parameters for a K-FAC operator")
        self.prob, self.factors, self.damping, self.inv = prob, factors, float(damping), inverse
        self._covered = covered
        self._eig = {}
        if inverse:
            for f in factors:
                a, Qa = torch.linalg.eigh(f.C_out)
                b, Qb = torch.linalg.eigh(f.C_in)
                low = float((a[:, None] * b[None, :]).min()) + self.damping
                if low <= 0 or (f.bias is not None and float(a.min()) + self.damping <= 0):
                    raise ValueError(f"K-FAC block of {f.module!r} plus damping = {self.damping:g} is singular; use "
                                     "damping > 0")
                self._eig[f.module] = (a, Qa, b, Qb)

    def inverse(self, damping: float | None = None) -> "KFACOperator":
        """The exact damped inverse (``damping`` defaults to this operator's)."""
        d = self.damping if damping is None else check_nonnegative("damping", damping)
        return KFACOperator(self.prob, self.factors, d, inverse=True)

    def _flat(self, V):
        outs = []
        for name, part in zip(self.prob.names, V.split(self.prob.sizes)):
            f = self._covered[name]
            if name == f.weight:
                W = part.T.reshape(part.shape[1], f.C_out.shape[0], -1)  # (K, d_out, d_in)
                if self.inv:
                    a, Qa, b, Qb = self._eig[f.module]
                    Z = (Qa.T @ W @ Qb) / (a[:, None] * b[None, :] + self.damping)
                    out = Qa @ Z @ Qb.T
                else:
                    out = f.C_out @ W @ f.C_in.T + self.damping * W
            else:
                W = part.T  # (K, d_out)
                if self.inv:
                    a, Qa, _, _ = self._eig[f.module]
                    out = ((W @ Qa) / (a + self.damping)) @ Qa.T
                else:
                    out = W @ f.C_out.T + self.damping * W
            outs.append(out.reshape(part.shape[1], -1).T)
        return torch.cat(outs)


def kfac_operator(prob: Problem, factors: list | None = None, *, damping: float = 0.0) -> KFACOperator:
    r"""K-FAC's approximation :math:`\operatorname{blockdiag}(C_{\mathrm{out}}\otimes C_{\mathrm{in}}) +
    \texttt{damping}\,I` of :math:`H_{\mathrm{GN}}` as an operator (:class:`KFACOperator`); ``.inverse()`` is its
    exact damped inverse. Every parameter of ``prob`` needs a K-FAC block (restrict with ``params=``).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> F = cm.kfac_operator(prob, damping=1e-3)
    >>> v = torch.randn(prob.p).double()
    >>> bool(torch.allclose(F.inverse() @ (F @ v), v))
    True
    """
    prob = _check_problem(prob)
    damping = check_nonnegative("damping", damping)
    factors = kfac_factors(prob) if factors is None else factors
    if not isinstance(factors, list) or not all(isinstance(f, KFACFactors) for f in factors):
        raise TypeError("factors must be the list returned by kfac_factors")
    return KFACOperator(prob, factors, damping)
