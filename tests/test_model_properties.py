"""Property test of curvlab.model (issue 25): on random small modules — layers (Linear, LayerNorm, BatchNorm1d,
Dropout, ReLU/Tanh), dtypes (float32, float64), train/eval mode, losses and reductions — every answer **matches the
dense torch.func reference, or comes with a clear error or warning**.

The reference shares no code with curvlab.model: the full Jacobian of the module by ``torch.func.jacrev`` on a float64
copy, and the Hessian of torch's own loss in the outputs by autograd, give H_GN = J^T H_f J; its float64 eigenvalues
give kappa at the numerical rank. The property, per drawn case:

* a module with dropout in training mode is refused (ValueError naming the module);
* batch norm in training mode warns (naming the module); the answer is then the chunk-coupled function's, not
  compared here (test_model.py checks it on its own reference);
* otherwise the GN matrix equals the reference to a tolerance set by the dtype (float64: 1e-10, float32: 1e-4 of the
  largest entry), and kappa equals the reference's at the same rank (relative 1e-6), or a RankCutWarning says the
  cut is not clean.

Derandomised (fixed seed), ``CURVLAB_PROPERTY_EXAMPLES`` examples (default 12), as tests/test_properties.py.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, hessian, jacrev

from curvlab import model as cm

MAX_EXAMPLES = int(os.environ.get("CURVLAB_PROPERTY_EXAMPLES", "12"))


@st.composite
def cases(draw):
    d, c, n = draw(st.integers(2, 4)), draw(st.integers(2, 3)), draw(st.integers(2, 7))
    width = draw(st.integers(2, 5))
    layers, dim = [], d
    for _ in range(draw(st.integers(1, 2))):
        layers.append(nn.Linear(dim, width))
        dim = width
        extra = draw(st.sampled_from(["none", "layernorm", "batchnorm", "dropout"]))
        layers += {"none": [], "layernorm": [nn.LayerNorm(width)], "batchnorm": [nn.BatchNorm1d(width)],
                   "dropout": [nn.Dropout(0.3)]}[extra]
        layers.append(draw(st.sampled_from([nn.Tanh, nn.ReLU, nn.SiLU]))())
    layers.append(nn.Linear(dim, c))
    return dict(layers=layers, d=d, c=c, n=n, dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                train=draw(st.booleans()), loss=draw(st.sampled_from(cm.LOSSES)),
                reduction=draw(st.sampled_from(cm.REDUCTIONS)), seed=draw(st.integers(0, 2**16)),
                chunk=draw(st.sampled_from([None, 2])))


def _torch_loss_fn(loss, reduction, n):
    if loss == "mse":  # the book's (1/2)||f - y||^2 per sample, mean over samples
        return lambda o, t: nn.functional.mse_loss(o, t, reduction="sum") / (2.0 * (n if reduction == "mean" else 1))
    if loss == "bce":
        return lambda o, t: nn.functional.binary_cross_entropy_with_logits(o, t, reduction=reduction)
    return lambda o, t: nn.functional.cross_entropy(o, t, reduction=reduction)


def _reference(net, X, T, loss, reduction):
    """Dense float64 H_GN from jacrev of the module and autograd's Hessian of torch's loss in the outputs."""
    net = copy.deepcopy(net).double().eval()
    X = X.double()
    T = T.double() if T.is_floating_point() else T
    names = [k for k, _ in net.named_parameters()]
    shapes = [v.shape for _, v in net.named_parameters()]
    th = torch.cat([v.detach().reshape(-1) for _, v in net.named_parameters()])

    def f(t):
        parts = dict(zip(names, (p.reshape(s) for p, s in zip(t.split([s.numel() for s in shapes]), shapes))))
        return functional_call(net, parts, (X,))

    out, J = f(th), jacrev(f)(th)
    fn = _torch_loss_fn(loss, reduction, X.shape[0])
    H = hessian(lambda o: fn(o, T))(out)
    k = out.numel()
    return J.reshape(k, -1).T @ H.reshape(k, k) @ J.reshape(k, -1)


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_random_modules_match_the_dense_reference_or_say_why_not(case):
    torch.manual_seed(case["seed"])
    net = nn.Sequential(*case["layers"]).to(case["dtype"])
    for m in net.modules():
        if isinstance(m, nn.BatchNorm1d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    net.train(case["train"])
    n, c, loss = case["n"], case["c"], case["loss"]
    X = torch.randn(n, case["d"], dtype=case["dtype"])
    T = {"mse": torch.randn(n, c, dtype=case["dtype"]), "bce": torch.rand(n, c, dtype=case["dtype"]),
         "cross_entropy": torch.randint(0, c, (n,))}[loss]
    has = {kind: any(isinstance(m, kind) for m in net.modules()) for kind in (nn.Dropout, nn.BatchNorm1d)}
    args = dict(loss=loss, reduction=case["reduction"], chunk_size=case["chunk"])
    if case["train"] and has[nn.Dropout]:
        with pytest.raises(ValueError, match=r"\(Dropout\).*eval"):
            cm.problem(net, X, T, **args)
        return
    if case["train"] and has[nn.BatchNorm1d]:
        with pytest.warns(UserWarning, match=r"\(BatchNorm1d\)"):
            cm.problem(net, X, T, **args)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about on this path, except a rank cut (below)
        prob = cm.problem(net, X, T, **args)
    G_ref = _reference(net, X, T, loss, case["reduction"])
    scale = float(G_ref.abs().max())
    tol = (1e-10 if case["dtype"] == torch.float64 else 1e-4) * scale
    assert float((cm.ggn_matrix(prob).double() - G_ref).abs().max()) <= tol
    if scale == 0:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cond = cm.condition(prob)
    if any(issubclass(w.category, cm.RankCutWarning) for w in caught):
        return  # a cut inside the spectrum, said out loud
    lam = torch.linalg.eigvalsh(G_ref).flip(0)
    assert cond.kappa == pytest.approx(float(lam[0] / lam[cond.rank - 1]), rel=1e-6)
    assert cond.rank == int((lam > cond.threshold).sum())
