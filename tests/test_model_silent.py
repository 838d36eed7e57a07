"""Issue 25: every way `curvlab.model` used to give a silent wrong answer is now a correct answer or a clear
error/warning. Each test here failed on the code before the fix (commit 222ca74) and names the case it covers."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from curvlab import model as cm

N = 12


def _mlp(width=6, c=3, d=4):
    return nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, c))


def _data(d=4, c=3, n=N, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randn(n, c, generator=g, dtype=dtype)


# ------------------------------------------------------------------------------------------------ float32 kappa
def _f32_problem():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 30), nn.Tanh(), nn.Linear(30, 30), nn.Tanh(), nn.Linear(30, 3))
    X, T = _data(5, 3, 60, dtype=torch.float32)
    return net, X, T


def test_float32_kappa_is_computed_in_float64_by_default():
    # before: the float32 kernel's eigenvalues were cut at 180 eps32 inside a continuous spectrum (gap 1.07), kappa 29x
    # too small, silently. Now the dense route evaluates a float64 copy of the module: kappa of the same parameters.
    net, X, T = _f32_problem()
    ref = cm.condition(cm.problem(copy.deepcopy(net).double(), X.double(), T.double()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean cut: no warning
        got = cm.condition(cm.problem(net, X, T))
    assert got.rank == ref.rank and got.kappa == pytest.approx(ref.kappa, rel=1e-9)
    assert next(net.parameters()).dtype == torch.float32  # the module itself is untouched


def test_float32_in_its_own_precision_warns_about_the_gap():
    net, X, T = _f32_problem()
    with pytest.warns(cm.RankCutWarning, match="gap"):
        cm.condition(cm.problem(net, X, T), precision="model")


def test_a_small_gap_at_the_cut_warns_in_every_route():
    torch.manual_seed(3)
    net = _mlp(width=20)
    X, T = _data(n=N)
    prob = cm.problem(net.double(), X, T)
    lam = torch.linalg.eigvalsh(cm.kernel_matrix(prob) / N).flip(0)
    ratio = lam[:-1] / lam[1:]
    size, k = 3 * N, 3 * N // 2 - 1
    j = size - k + int(torch.argmin(ratio[size - k:]))  # the closest pair Lanczos' k smallest see: gap < 10
    assert float(ratio[j]) < 10
    rtol = float((lam[j] * lam[j + 1]).sqrt() / lam[0])
    with pytest.warns(cm.RankCutWarning, match=r"gap .* < 10"):
        cm.condition(prob, method="dense", rtol=rtol)
    with pytest.warns(cm.RankCutWarning, match=r"gap .* < 10"):
        cm.condition(prob, method="dense", rank=j + 1)
    with pytest.warns(cm.RankCutWarning, match=r"gap .* < 10"):
        cm.condition(prob, method="lanczos", rtol=rtol, k=k, tol=1e-12)


# ------------------------------------------------------------------------------------------------ training mode
def test_dropout_in_training_mode_is_refused_naming_the_module():
    net = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3)).double()
    X, T = _data()
    with pytest.raises(ValueError, match=r"'1' \(Dropout\).*eval\(\)"):
        cm.problem(net, X, T)
    cm.problem(net.eval(), X, T)


def test_a_random_forward_without_a_dropout_module_is_refused():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return nn.functional.dropout(self.lin(x), 0.5, training=True)

    X, T = _data()
    with pytest.raises(ValueError, match="random"):
        cm.problem(Noisy().double(), X, T)


def test_train_mode_batchnorm_warns_naming_the_module():
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    X, T = _data()
    with pytest.warns(UserWarning, match=r"'1' \(BatchNorm1d\).*chunk_size"):
        cm.problem(net, X, T, chunk_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.problem(net.eval(), X, T, chunk_size=4)


# ------------------------------------------------------------------------------------------------ Lanczos
def _duplicated():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 40), nn.Tanh(), nn.Linear(40, 2)).double()
    X = torch.randn(12, 3, dtype=torch.float64)
    X[9:] = X[:3]  # three repeated samples: 6 extra null directions of K
    return cm.problem(net, X, torch.randn(12, 2, dtype=torch.float64))


def test_lanczos_is_seeded(monkeypatch):
    # before: ARPACK drew its own random start (v0=None), so whether and how it converged changed from call to call
    import scipy.sparse.linalg as sla

    starts, real = [], sla.eigsh
    monkeypatch.setattr(sla, "eigsh", lambda *a, **kw: starts.append(kw.get("v0")) or real(*a, **kw))
    prob = _duplicated()
    a = cm.condition(prob, method="lanczos", k=8, tol=1e-12)
    b = cm.condition(prob, method="lanczos", k=8, tol=1e-12, seed=0)
    assert starts and all(v is not None for v in starts)
    assert all((v == starts[0]).all() for v in starts)  # the same seeded start, every call and end
    assert a.kappa == pytest.approx(b.kappa, rel=1e-10) and a.rank == b.rank


def test_lanczos_reports_the_rank_only_where_measured():
    # before: rank 22 (dense: 18) shown with gap = inf; Lanczos sees one copy of a repeated zero eigenvalue
    prob = _duplicated()
    dense = cm.condition(prob, method="dense")
    lanc = cm.condition(prob, method="lanczos", k=8, tol=1e-12)
    assert dense.rank == 18
    assert lanc.rank in (None, dense.rank) and lanc.numerical_rank in (None, dense.rank)
    assert math.isfinite(lanc.gap) and lanc.gap > 1e8
    assert lanc.kappa == pytest.approx(dense.kappa, rel=1e-8)
    assert "not measured" in str(lanc) or lanc.rank == dense.rank


def test_lanczos_budget_falls_back_to_dense_where_it_fits_or_raises_clearly():
    prob = _duplicated()
    dense = cm.condition(prob, method="dense")
    with pytest.warns(UserWarning, match="max_seconds.*dense"):
        got = cm.condition(prob, method="lanczos", max_seconds=0.0)
    assert got.rank == dense.rank and got.kappa == dense.kappa
    with pytest.raises(ValueError, match="max_seconds"):
        cm.condition(prob, method="lanczos", max_seconds=0.0, dense_max=5)
    with pytest.raises(ValueError, match="maxiter"):
        cm.condition(prob, method="lanczos", maxiter=1, tol=1e-300, k=3, dense_max=5)


# ------------------------------------------------------------------------------------------------ inputs
def test_cross_entropy_probability_rows_must_sum_to_one_and_be_nonnegative():
    net = _mlp().double()
    X, _ = _data()
    P = torch.softmax(torch.randn(N, 3, dtype=torch.float64), -1)
    cm.problem(net, X, P, "cross_entropy")
    with pytest.raises(ValueError, match="sum to 1"):
        cm.problem(net, X, 1.3 * P, "cross_entropy")
    Q = P.clone()
    Q[0] = torch.tensor([1.5, -0.5, 0.0])
    with pytest.raises(ValueError, match="nonnegative"):
        cm.problem(net, X, Q, "cross_entropy")


def test_non_finite_inputs_and_targets_are_refused():
    net = _mlp().double()
    X, T = _data()
    Xi, Tn = X.clone(), T.clone()
    Xi[3, 1], Tn[5, 0] = math.inf, math.nan
    with pytest.raises(ValueError, match=r"inputs.*not finite.*sample 3"):
        cm.problem(net, Xi, T)
    with pytest.raises(ValueError, match=r"targets.*not finite.*sample 5"):
        cm.problem(net, X, Tn)
    with pytest.raises(ValueError, match=r"inputs.*not finite.*sample 9"):
        cm.problem(net, [(X[:6], T[:6]), (Xi[:6], T[:6])])
    Xb = X.clone()
    Xb[0, 0] = 1e300  # finite in float64, inf once cast to the model's float32
    with pytest.raises(ValueError, match=r"inputs.*not finite"):
        cm.problem(_mlp(), Xb, T)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_are_refused(dtype):
    net = _mlp().to(dtype)
    X, T = _data(dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"{str(dtype).split('.')[1]}.*\.float\(\)"):
        cm.problem(net, X, T)


# ------------------------------------------------------------------------------------------------ K-FAC
class _AuxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.aux, self.head = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        self.last_aux = self.aux(h)  # computed, never reaches the output
        return self.head(h)


def test_kfac_layer_without_a_path_to_the_output_is_named():
    X, T = _data()
    prob = cm.problem(_AuxHead().double(), X, T)
    with pytest.raises(ValueError, match=r"no path to the output: 'aux'.*params="):
        cm.kfac_factors(prob)
    sub = cm.problem(_AuxHead().double(), X, T, params=["body.weight", "body.bias", "head.weight", "head.bias"])
    assert [f.module for f in cm.kfac_factors(sub)] == ["body", "head"]


def test_kfac_refuses_parameters_shared_across_modules():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    net[2].weight = net[0].weight
    X, T = _data()
    prob = cm.problem(net, X, T)
    with pytest.raises(ValueError, match=r"shared across modules: '0.weight' = '2.weight'"):
        cm.kfac_factors(prob)


@pytest.mark.parametrize("layer, name", [
    (nn.Conv1d(2, 2, 3, padding=1), "Conv1d"),
    (nn.Conv2d(2, 2, 3, padding=1, groups=2), "groups=2"),
    (nn.Conv2d(2, 2, 3, padding="same"), "padding='same'"),
])
def test_kfac_warns_naming_layers_it_does_not_cover(layer, name):
    conv1d = isinstance(layer, nn.Conv1d)
    net = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * (1 if conv1d else 4), 3)).double()
    X = torch.randn(N, 2, 4, dtype=torch.float64) if conv1d else torch.randn(N, 2, 4, 4, dtype=torch.float64)
    prob = cm.problem(net, X, torch.randn(N, 3, dtype=torch.float64))
    with pytest.warns(UserWarning, match=rf"'0'.*{name}"):
        facs = cm.kfac_factors(prob)
    assert [f.module for f in facs] == ["3"]
