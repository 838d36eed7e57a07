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
running statistics are never updated by this module in either mode. Put dropout (and any other random layer) in
eval mode: a random function has no Gauss–Newton matrix to compute.

**Routes.** Products (:func:`ggn_vector_product`) use one JVP and one VJP per data chunk and never form
:math:`J`; :func:`ggn_matrix` and :func:`kernel_matrix` form :math:`\tilde J` (``nc x p``, memory :math:`O(ncp)`);
:func:`condition` uses a dense ``eigvalsh`` when :math:`\min(p, nc)` is at most ``dense_max`` (and
:math:`\tilde J` fits in ``dense_max_entries``) and otherwise Lanczos
(:func:`scipy.sparse.linalg.eigsh` on a :class:`scipy.sparse.linalg.LinearOperator`) on the smaller of
:math:`H_{\mathrm{GN}}` and :math:`K/n`. :func:`kfac_factors` gives K-FAC's exact (type-2) Kronecker factors of every
``nn.Linear`` and ``nn.Conv2d`` (expand convention); :func:`kfac_block_errors` the relative Frobenius distance between
:math:`C_{\mathrm{out}}\otimes C_{\mathrm{in}}` and the exact diagonal block of :math:`H_{\mathrm{GN}}`.
Cross-checked against curvlinops and BackPACK in ``tests/test_model.py``.
"""

from __future__ import annotations

import math
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
    "Problem",
    "problem",
    "ggn_vector_product",
    "jacobian",
    "ggn_matrix",
    "kernel_matrix",
    "condition",
    "KFACFactors",
    "kfac_factors",
    "kfac_block_errors",
    "gn_step",
    "apply_step",
    "loss_value",
    "loss_gradient",
]

LOSSES = ("mse", "cross_entropy")


# ============================================================================================ the problem
@dataclass
class Problem:
    r"""A module, its data and its loss, validated once: what every function of this module takes.

    ``chunks`` is the list of ``(X_b, Y_b)`` pairs on the parameters' device; ``names``/``shapes``/``sizes`` describe
    :math:`\theta` (trainable parameters only); ``n`` samples, ``c`` outputs, ``p`` parameters.
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
        """Frozen parameters and buffers (cloned: a train-mode batch norm must not update the module's own)."""
        frozen = {k: v.detach() for k, v in self.model.named_parameters() if not v.requires_grad}
        buffers = {k: v.detach().clone() for k, v in self.model.named_buffers()}
        return {**frozen, **buffers}

    def forward_fn(self, X: torch.Tensor):
        """``theta -> f_theta(X)`` of shape ``(n_b, c)``: the module as a function of the flat parameters."""
        fixed = self._fixed()

        def fn(theta: torch.Tensor) -> torch.Tensor:
            with _no_running_stats(self.model):
                return functional_call(self.model, {**self.unflatten(theta), **fixed}, (X,))

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
                return functional_call(self.model, {**dict(zip(self.names, params)), **fixed}, (X,))

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


def problem(model: nn.Module, inputs, targets=None, loss: str = "mse", *, chunk_size: int | None = None) -> Problem:
    r"""Validate a module, its data and its loss once, for every other function of :mod:`curvlab.model`.

    ``inputs``: a tensor ``(n, ...)`` with ``targets`` (then split into chunks of ``chunk_size`` samples, default one
    chunk), or a ``DataLoader`` (any iterable) yielding ``(inputs, targets)`` pairs, each batch one chunk.
    ``model(inputs)`` must be ``(n_b, c)``. Targets: ``(n, c)`` for ``"mse"``; class indices ``(n,)`` or
    probability rows ``(n, c)`` for ``"cross_entropy"``. Data are moved to the parameters' device and dtype
    (class indices stay integers). All trainable parameters must share one device and one floating dtype.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> prob.n, prob.c, prob.p
    (8, 2, 26)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss = check_choice("loss", loss, LOSSES)
    params = [(k, v) for k, v in model.named_parameters() if v.requires_grad]
    if not params:
        raise ValueError("model has no parameter with requires_grad=True: there is no curvature to compute")
    devices = {str(v.device) for _, v in params}
    if len(devices) > 1:
        raise ValueError(f"model parameters must live on one device, found {sorted(devices)}")
    dtypes = {v.dtype for _, v in params}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"model parameters must share one floating dtype, found {sorted(map(str, dtypes))}")
    dtype, dev = params[0][1].dtype, params[0][1].device
    chunks = []
    for X, Y in _as_chunks(inputs, targets, chunk_size):
        X = X.to(device=dev, dtype=dtype) if X.is_floating_point() else X.to(dev)
        Y = Y.to(dev) if (loss == "cross_entropy" and not Y.is_floating_point()) else Y.to(device=dev, dtype=dtype)
        chunks.append((X, Y))
    with torch.no_grad(), _no_running_stats(model):
        out = model(chunks[0][0])
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model output must be 2-D (n, c), got {shape}; flatten or reshape it inside the module")
    c = out.shape[1]
    for i, (X, Y) in enumerate(chunks):
        if loss == "mse" and tuple(Y.shape) != (X.shape[0], c):
            raise ValueError(f"targets for loss='mse' must have shape (n, c) = ({X.shape[0]}, {c}); chunk {i} has "
                             f"{tuple(Y.shape)}")
        if loss == "cross_entropy":
            if Y.is_floating_point() and tuple(Y.shape) != (X.shape[0], c):
                raise ValueError(f"targets for loss='cross_entropy' must be class indices (n,) or probabilities "
                                 f"(n, c) = ({X.shape[0]}, {c}); chunk {i} has {tuple(Y.shape)}")
            if not Y.is_floating_point() and (Y.dim() != 1 or int(Y.min()) < 0 or int(Y.max()) >= c):
                raise ValueError(f"targets for loss='cross_entropy' must be class indices in [0, {c}) of shape (n,); "
                                 f"chunk {i} has shape {tuple(Y.shape)}")
    return Problem(model=model, loss=loss, chunks=chunks, names=[k for k, _ in params],
                   shapes=[v.shape for _, v in params], sizes=[v.numel() for _, v in params],
                   n=int(sum(X.shape[0] for X, _ in chunks)), c=int(c), dtype=dtype, device=dev)


def _check_problem(prob) -> Problem:
    if not isinstance(prob, Problem):
        raise TypeError(f"prob must be a curvlab.model.Problem (from curvlab.model.problem), got {type(prob).__name__}")
    return prob


# ============================================================================================ loss pieces
def _probs(f: torch.Tensor) -> torch.Tensor:
    return torch.softmax(f, dim=-1)


def _hess_out(prob: Problem, f: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r""":math:`\Lambda_i u_i` for each sample (``u`` of ``f``'s shape)."""
    if prob.loss == "mse":
        return u
    pi = _probs(f)
    return pi * u - pi * (pi * u).sum(-1, keepdim=True)


def _sqrt_hess(prob: Problem, f: torch.Tensor) -> torch.Tensor:
    r""":math:`S_i` with :math:`S_iS_i^\top = \Lambda_i`, shape ``(n_b, c, c)``."""
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    if prob.loss == "mse":
        return eye.expand(f.shape[0], -1, -1)
    pi = _probs(f)
    s = pi.sqrt()
    return torch.diag_embed(s) - pi.unsqueeze(-1) * s.unsqueeze(-2)


def _loss_grad_out(prob: Problem, f: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    r""":math:`\nabla_f\ell_i`: :math:`r_i = f_i - y_i` (MSE) or :math:`\pi_i - y_i` (cross-entropy)."""
    if prob.loss == "mse":
        return f - Y
    onehot = Y if Y.is_floating_point() else torch.nn.functional.one_hot(Y, f.shape[-1]).to(f.dtype)
    return _probs(f) - onehot


def loss_value(prob: Problem, theta: torch.Tensor | None = None) -> float:
    r"""The averaged loss :math:`\mathcal L(\theta)` (current parameters when ``theta`` is None).

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
            else:
                logp = torch.log_softmax(f, -1)
                onehot = Y if Y.is_floating_point() else torch.nn.functional.one_hot(Y, f.shape[-1]).to(f.dtype)
                total += float(-(onehot * logp).sum())
    return total / prob.n


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
    return out.div_(prob.n)


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
    return Jt.T @ Jt / prob.n


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
def _scipy_operator(matvec, size: int, prob: Problem):
    from scipy.sparse.linalg import LinearOperator

    def mv(x):
        t = torch.as_tensor(np.asarray(x, dtype=np.float64).reshape(-1), dtype=prob.dtype, device=prob.device)
        with torch.no_grad():
            return matvec(t).detach().to("cpu", torch.float64).numpy()

    return LinearOperator((size, size), matvec=mv, dtype=np.float64)


def condition(prob: Problem, *, rank: int | None = None, rtol: float | None = None, method: str = "auto",
              dense_max: int = 3000, dense_max_entries: int = 2**27, k: int = 6,
              tol: float = 1e-8) -> ConditionNumber:
    r""":math:`\kappa = \lambda_{\max}/\lambda_r` of :math:`H_{\mathrm{GN}}` over its nonzero spectrum, with the rank cut
    :math:`r` and the gap :math:`\lambda_r/\lambda_{r+1}` there (:class:`curvlab.curvature.ConditionNumber`).

    Eigenvalues are those of :math:`H_{\mathrm{GN}}` (averaged units), computed on the smaller of
    :math:`H_{\mathrm{GN}}` (``p x p``) and :math:`K/n` (``nc x nc``); ``size`` in the result is that matrix's size.
    ``method="dense"``: float64 ``eigvalsh``; ``"lanczos"``: :func:`scipy.sparse.linalg.eigsh` on a matrix-free
    operator for the ``k`` largest and ``k`` smallest eigenvalues (the numerical rank is then counted among the
    smallest ``k``; if all of them fall below the threshold the cut is out of reach and a ValueError says so; for
    cross-entropy on :math:`K` the ``n`` known null directions :math:`\sqrt{\pi_i}` are lifted out of the way first);
    ``"auto"``: dense when the smaller size is at most ``dense_max`` *and* the dense route's :math:`\tilde J`
    (``nc x p``, formed in full) has at most ``dense_max_entries`` entries (default :math:`2^{27}`, 1 GiB in float64);
    otherwise Lanczos, whose products never form :math:`\tilde J` (at :math:`p\approx1.9\cdot10^6`, :math:`nc = 1280`
    the dense route would need 9.5 GB in float32, Lanczos a few parameter-sized vectors). ``rtol`` defaults to
    ``default_rtol(size, dtype)``; ``rank`` forces the cut (dense only).

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.condition(prob).rank
    16
    """
    prob = _check_problem(prob)
    method = check_choice("method", method, ("auto", "dense", "lanczos"))
    dense_max = check_int("dense_max", dense_max, min_value=1)
    dense_max_entries = check_int("dense_max_entries", dense_max_entries, min_value=1)
    k = check_int("k", k, min_value=1)
    tol = check_nonnegative("tol", tol)
    on_kernel = prob.n * prob.c < prob.p
    size = prob.n * prob.c if on_kernel else prob.p
    if method == "auto":
        method = "dense" if size <= dense_max and prob.n * prob.c * prob.p <= dense_max_entries else "lanczos"
    if method == "dense":
        M = kernel_matrix(prob) / prob.n if on_kernel else ggn_matrix(prob, max_params=max(prob.p, 1))
        lam = torch.linalg.eigvalsh(config.spectral(M)).flip(-1)
        if rtol is None:
            rtol = default_rtol(size, prob.dtype)
        return condition_number(lam, rtol, rank=rank)
    if rank is not None:
        raise ValueError("rank can only be forced with method='dense' (Lanczos sees only the spectrum's ends)")
    from scipy.sparse.linalg import eigsh

    if 2 * k >= size:
        raise ValueError(f"k must be < size/2 = {size / 2:g} for Lanczos; use method='dense'")
    if on_kernel:
        op = _scipy_operator(lambda w: _kernel_vector_product(prob, w) / prob.n, size, prob)
    else:
        op = _scipy_operator(lambda v: ggn_vector_product(prob, v), size, prob)
    top = np.sort(eigsh(op, k=k, which="LA", tol=tol, return_eigenvectors=False))[::-1]
    lam_max = float(top[0])
    n_known = 0
    if on_kernel and prob.loss == "cross_entropy":
        # K's known null space: sqrt(pi_i) in sample i's block (S_i sqrt(pi_i) = 0). Lift it to lambda_max so that
        # the smallest eigenvalues Lanczos returns are those of the rest of the spectrum.
        U = torch.cat([_probs(prob.forward_fn(X)(prob.theta()).detach()).sqrt() for X, _ in prob.chunks])
        U = torch.block_diag(*U.unbind(0)).T  # (n c, n), orthonormal columns
        op = _scipy_operator(lambda w: _kernel_vector_product(prob, w) / prob.n + lam_max * (U @ (U.T @ w)),
                             size, prob)
        n_known = prob.n
    bottom = np.sort(eigsh(op, k=k, which="SA", tol=tol, return_eigenvectors=False))[::-1]
    rtol = default_rtol(size, prob.dtype) if rtol is None else check_nonnegative("rtol", rtol)
    threshold = rtol * lam_max
    kept = bottom[bottom > threshold]
    if kept.size == 0:
        raise ValueError(f"all {k} smallest eigenvalues are below rtol * lambda_max = {threshold:.3g}: the rank cut is "
                         "out of Lanczos' reach; raise k or use method='dense'")
    n_zero = int((bottom <= threshold).sum()) + n_known
    lam_r = float(kept[-1])
    below = bottom[bottom <= threshold]
    lam_next = float(below[0]) if below.size else (0.0 if n_zero else None)
    gap = lam_r / lam_next if lam_next is not None and lam_next > 0 else math.inf
    return ConditionNumber(kappa=lam_max / lam_r, rank=size - n_zero, numerical_rank=size - n_zero, size=size,
                           lambda_max=lam_max, lambda_min_nonzero=lam_r, lambda_discarded=lam_next, gap=gap,
                           rtol=rtol, threshold=threshold, forced=False)


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
    return (isinstance(mod, nn.Conv2d) and mod.groups == 1 and mod.padding_mode == "zeros"
            and not isinstance(mod.padding, str))


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
    layers = [(name, mod) for name, mod in prob.model.named_modules() if _supported(mod)
              and _pname(name, "weight") in trainable]
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
            raise ValueError(f"model has K-FAC layers that its forward pass does not use: {unused}")
        outs = [seen[name][1] for name, _ in layers]
        for j in range(prob.c):
            grads = torch.autograd.grad(f, outs, grad_outputs=S[:, :, j], retain_graph=j < prob.c - 1)
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
                                  C_out=(C_out[name] / prob.n).detach(), C_in=(C_in[name] / prob.n).detach()))
    return result


def kfac_block_errors(prob: Problem, factors: list[KFACFactors] | None = None, *,
                      dense_block_max: int = 2048) -> pd.DataFrame:
    r"""Relative Frobenius distance :math:`\lVert B - C_{\mathrm{out}}\otimes C_{\mathrm{in}}\rVert_F/\lVert B\rVert_F`
    between each layer's exact diagonal GN block :math:`B = \tilde J_W^\top\tilde J_W/n` and its K-FAC block
    (chapter 40's Kronecker error, :func:`curvlab.synthesis.kronecker_error`). Computed from the rows
    :math:`M_r` (``d_out x d_in``) of :math:`\tilde J_W` without forming :math:`B`:
    :math:`\lVert B\rVert_F^2 = \lVert\tilde J_W\tilde J_W^\top\rVert_F^2/n^2`,
    :math:`\langle B, C_{\mathrm{out}}\otimes C_{\mathrm{in}}\rangle = \frac1n\sum_r\langle M_r, C_{\mathrm{out}}M_rC_{\mathrm{in}}\rangle`
    for blocks larger than ``dense_block_max`` (then accurate to about :math:`\sqrt{\varepsilon}`); smaller blocks are
    formed and subtracted directly.
    One row per layer (weight and bias rows): ``module, param, size, rel_error``.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> list(cm.kfac_block_errors(prob).columns)
    ['module', 'param', 'size', 'rel_error']
    """
    prob = _check_problem(prob)
    factors = kfac_factors(prob) if factors is None else factors
    dense_block_max = check_int("dense_block_max", dense_block_max, min_value=1)
    if not isinstance(factors, list) or not all(isinstance(f, KFACFactors) for f in factors):
        raise TypeError("factors must be the list returned by kfac_factors")
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
                B4 = (J_W.T @ J_W / prob.n).reshape(o, i, o, i)
                diff = B4 - A[:, None, :, None] * C[None, :, None, :]
                nB2, nD2 = float((B4 * B4).sum()), float((diff * diff).sum())
            else:  # never form B; the difference then loses about half the digits (sqrt(eps) floor)
                G = J_W @ J_W.T
                nB2 = float((G * G).sum()) / prob.n ** 2
                inner = float(torch.einsum("rab,ac,rcd,bd->", M, A, M, C)) / prob.n
                nD2 = max(nB2 - 2 * inner + float((A * A).sum() * (C * C).sum()), 0.0)
            rel = math.sqrt(nD2 / nB2) if nB2 > 0 else math.nan
            rows.append(dict(module=fac.module, param=pname, size=size_of[pname], rel_error=rel))
    return pd.DataFrame(rows)


# ============================================================================================ GN step
def gn_step(prob: Problem, lam_GN: float) -> torch.Tensor:
    r"""Damped GN direction in kernel form, :math:`\Delta_{\mathrm{GN}} = (H_{\mathrm{GN}}+\lambda_{\mathrm{GN}}I_p)^{-1}
    \nabla\mathcal L = \tilde J^\top(K + n\lambda_{\mathrm{GN}}I)^{-1}\rho` (push-through identity; an ``nc x nc``
    solve, cheap when :math:`p\gg nc`), ``(p,)``. ``lam_GN`` is in the units of :math:`H_{\mathrm{GN}}`'s eigenvalues
    (notation page); ``lam_GN = 0`` needs :math:`K` invertible (MSE with :math:`nc\le p`; never cross-entropy, whose
    :math:`K` has rank at most :math:`n(c-1)`). :math:`\rho_i = S_i^{+}\nabla_f\ell_i` (exact: :math:`\nabla_f\ell_i`
    lies in the range of :math:`S_i`). Step with :func:`apply_step`.

    >>> import torch; from torch import nn; from curvlab import model as cm
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    >>> prob = cm.problem(net, torch.randn(8, 3).double(), torch.randn(8, 2).double())
    >>> cm.gn_step(prob, lam_GN=1e-3).shape
    torch.Size([26])
    """
    prob = _check_problem(prob)
    lam_GN = check_nonnegative("lam_GN", lam_GN)
    theta = prob.theta()
    Jt = jacobian(prob)
    rho = []
    with torch.no_grad():
        for X, Y in prob.chunks:
            f = prob.forward_fn(X)(theta)
            g = _loss_grad_out(prob, f, Y)
            S = _sqrt_hess(prob, f)
            rho.append(g if prob.loss == "mse" else
                       (torch.linalg.pinv(S, hermitian=False) @ g.unsqueeze(-1)).squeeze(-1))
    rho = torch.cat(rho).reshape(-1)
    K = Jt @ Jt.T
    K = 0.5 * (K + K.T) + prob.n * lam_GN * torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    L, info = torch.linalg.cholesky_ex(K)
    if int(info) != 0:
        raise ValueError(f"K + n lam_GN I is numerically singular (lam_GN = {lam_GN:g}); use lam_GN > 0"
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
    return total / prob.n


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
