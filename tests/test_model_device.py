"""curvlab.model on the configured device (``CURVLAB_DEVICE``; the CPU where none is set): the products, kappa
(dense and Lanczos), K-FAC's operator and inverse and the kernel-form step on the device against a float64 CPU
reference of the same module and data. tools/device_check.sh runs this file with CURVLAB_DEVICE=cuda on a lent GPU
(the module has never run on CUDA before issue 25); here it runs on the CPU as a plain test."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvlab import config
from curvlab import model as cm


def _net():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_model_on_the_device_equals_a_float64_cpu_reference(loss, dtype):
    dev = config.device()
    torch.manual_seed(0)
    net_cpu = _net().double()
    X = torch.randn(12, 1, 6, 6, dtype=torch.float64)
    T = torch.randint(0, 5, (12,)) if loss == "cross_entropy" else torch.randn(12, 5, dtype=torch.float64)
    net = copy.deepcopy(net_cpu).to(device=dev, dtype=dtype)
    net_ref = copy.deepcopy(net).to("cpu", torch.float64)  # the device model's own (rounded) parameters
    ref = cm.problem(net_ref, X.to(dtype).double(), T.to(dtype).double() if T.is_floating_point() else T, loss)
    prob = cm.problem(net, X.to(dev), T.to(dev), loss, chunk_size=5)
    assert prob.device.type == torch.device(dev).type
    tol = 1e-11 if dtype == torch.float64 else 2e-4
    G = cm.ggn_matrix(ref)
    v = torch.randn(prob.p, dtype=torch.float64)
    got = cm.ggn_vector_product(prob, v.to(dev)).cpu().double()
    assert float((got - G @ v).abs().max()) <= tol * float((G @ v).abs().max())
    a, b = cm.condition(prob), cm.condition(ref)  # precision='auto': float64 on the device for the dense route
    assert a.rank == b.rank and a.kappa == pytest.approx(b.kappa, rel=1e-6)
    lanc = cm.condition(prob, method="lanczos", precision="float64", k=4, tol=1e-10)
    assert lanc.rank in (None, b.rank) and lanc.kappa == pytest.approx(b.kappa, rel=1e-5)
    lam = 1e-2 * b.lambda_max
    step = cm.gn_step(prob, lam).cpu().double()
    step_ref = cm.gn_step(ref, lam)
    assert float((step - step_ref).abs().max()) <= 1e3 * tol * float(step_ref.abs().max())
    kp = [p for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) for p in m.parameters()]
    F = cm.kfac_operator(cm.problem(net, X.to(dev), T.to(dev), loss, params=kp), damping=lam)
    w = torch.randn(prob.p, dtype=dtype, device=dev)
    back = F.inverse() @ (F @ w)
    assert float((back - w).abs().max()) <= 1e3 * tol * float(w.abs().max())
