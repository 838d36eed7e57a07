"""Tests for curvlab.regimes: closed forms against dense torch.func references, batched runs against loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import curvature as cv
from curvlab import linalg
from curvlab import regimes as rg

F64 = torch.float64
FAST = settings(max_examples=12, deadline=None)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
PARAMS = [rg.NTK, rg.MEAN_FIELD, rg.MUP, rg.MUP_ABC, rg.interpolating(0.75)]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def setup_problem(S=2, m=6, d=3, n=5, param=rg.NTK, seed=0, symmetric=True):
    teacher = rg.make_teacher(S, d, 2, generator=gen(seed), n_mc=500)
    X, y = rg.sample(teacher, n, generator=gen(seed + 1))
    p0 = rg.init_two_layer(S, m, d, param, generator=gen(seed + 2), symmetric=symmetric)
    return teacher, X, y, p0


def flat_model(p0: rg.TwoLayer, s: int, X, param, act="tanh", nu=1.0):
    """Seed ``s`` of the batch as fn(theta) -> outputs, theta = [vec(W); b; v] (row-major)."""
    m, d = p0.W.shape[1:]

    def fn(theta):
        W, b, v = theta[: m * d].reshape(1, m, d), theta[m * d: m * d + m].reshape(1, m), theta[m * d + m:].reshape(1, m)
        return rg.forward(rg.TwoLayer(W, b, v), X[s: s + 1], param, act=act, lazy_factor=nu)[0]

    theta = torch.cat([p0.W[s].reshape(-1), p0.b[s], p0.v[s]])
    return fn, theta


def lr_weights(param, m, d):
    eta_W, eta_v = param.step_sizes(m, 1.0)
    return torch.cat([torch.full((m * d + m,), eta_W, dtype=F64), torch.full((m,), eta_v, dtype=F64)])


# ----------------------------------------------------------------------------------------------- tangent kernel
@pytest.mark.parametrize("param", PARAMS, ids=lambda p: p.name)
@pytest.mark.parametrize("act", ["tanh", "silu", "relu"])
def test_tangent_kernel_matches_dense_jacobian(param, act):
    _, X, y, p0 = setup_problem(m=6, param=param, symmetric=False)
    X2 = torch.randn(2, 4, 3, dtype=F64, generator=gen(9))
    K = rg.tangent_kernel(p0, X, param, act=act, lazy_factor=2.0, lr_weighted=False)
    Kw = rg.tangent_kernel(p0, X, param, act=act, lazy_factor=2.0)
    Kx = rg.tangent_kernel(p0, X, param, X2=X2, act=act, lazy_factor=2.0)
    w = lr_weights(param, 6, 3)
    for s in range(2):
        fn, theta = flat_model(p0, s, X, param, act, 2.0)
        torch.testing.assert_close(K[s], cv.kernel_matrix(fn, theta))
        J = cv.jacobian(fn, theta)
        torch.testing.assert_close(Kw[s], (J * w) @ J.T)
        fn2, _ = flat_model(p0, s, X2, param, act, 2.0)
        torch.testing.assert_close(Kx[s], (cv.jacobian(fn2, theta) * w) @ J.T)


@FAST
@given(seed=seeds, m=st.integers(1, 5).map(lambda k: 2 * k), n=st.integers(1, 6))
def test_gradients_match_autograd(seed, m, n):
    _, X, y, p0 = setup_problem(m=m, n=n, param=rg.MEAN_FIELD, seed=seed % 1000)
    grad, L = rg.gradients(p0, X, y, rg.MEAN_FIELD, lazy_factor=1.5)
    W, b, v = (t.clone().requires_grad_(True) for t in (p0.W, p0.b, p0.v))
    Lref = rg.loss(rg.TwoLayer(W, b, v), X, y, rg.MEAN_FIELD, lazy_factor=1.5)
    gW, gb, gv = torch.autograd.grad(Lref.sum(), (W, b, v))
    torch.testing.assert_close(L, Lref.detach())
    for a, r in ((grad.W, gW), (grad.b, gb), (grad.v, gv)):
        torch.testing.assert_close(a, r)


# ----------------------------------------------------------------------------------------------- initialisation
def test_init_scales_symmetry_and_shared_draws():
    p = rg.init_two_layer(3, 2000, 4, rg.MUP, init_std=0.5, bias_std=0.3, out_std=2.0, generator=gen(0))
    assert p.shape == (3, 2000, 4)
    assert abs(float(p.W.std()) - 0.5) < 0.02 and abs(float(p.b.std()) - 0.3) < 0.02
    assert abs(float(p.v.std()) * 2000 - 2.0) < 0.1                         # mu-P: std sigma_v / m
    torch.testing.assert_close(p.W[:, :1000], p.W[:, 1000:])
    torch.testing.assert_close(p.v[:, :1000], -p.v[:, 1000:])
    X = torch.randn(3, 7, 4, dtype=F64)
    assert float(rg.forward(p, X, rg.MUP).abs().max()) < 1e-12              # f_0 = 0 exactly
    q = rg.init_two_layer(3, 2000, 4, rg.MEAN_FIELD, init_std=0.5, bias_std=0.3, out_std=2.0, generator=gen(0))
    torch.testing.assert_close(q.v / 2000, p.v)                              # same draws, other parametrisation


def test_invariants_put_mup_and_mean_field_together():
    assert rg.MUP.invariants() == rg.MEAN_FIELD.invariants() == rg.MUP_ABC.invariants()
    assert rg.NTK.invariants() != rg.MEAN_FIELD.invariants()
    assert rg.interpolating(0.5).invariants() == rg.NTK.invariants()
    assert rg.interpolating(1.0).invariants() == rg.MEAN_FIELD.invariants()


# ----------------------------------------------------------------------------------------------- training
def test_train_gd_one_step_by_hand_and_stopping():
    _, X, y, p0 = setup_problem(m=8, param=rg.NTK)
    run = rg.train_gd(p0, X, y, rg.NTK, eta0=0.3, target=0.0, max_steps=1)
    grad, L0 = rg.gradients(p0, X, y, rg.NTK)
    torch.testing.assert_close(run.params.W, p0.W - 0.3 * grad.W)
    torch.testing.assert_close(run.params.v, p0.v - 0.3 * grad.v)
    assert run.steps.tolist() == [1, 1] and run.loss_history.shape == (2, 2)
    torch.testing.assert_close(run.loss_history[0], L0)
    stop = rg.train_gd(p0, X, y, rg.NTK, eta0=0.3, target=float(L0.max()) + 1.0, max_steps=10)
    assert stop.steps.tolist() == [0, 0] and bool(stop.converged.all())
    target = 0.5 * float(L0.min())
    run = rg.train_gd(p0, X, y, rg.NTK, eta0=1.0, target=target, max_steps=500)
    assert bool(run.converged.all()) and bool((run.loss <= target).all())
    hist = run.loss_history
    for s in range(2):   # stops at the FIRST step below the target
        k = int(run.steps[s])
        assert float(hist[k, s]) <= target and (k == 0 or float(hist[k - 1, s]) > target)


def test_batched_seeds_equal_separate_runs():
    _, X, y, p0 = setup_problem(S=3, m=8, param=rg.MEAN_FIELD)
    run = rg.train_gd(p0, X, y, rg.MEAN_FIELD, eta0=0.5, target=0.05, max_steps=50)
    for s in range(3):
        one = rg.TwoLayer(p0.W[s:s + 1], p0.b[s:s + 1], p0.v[s:s + 1])
        r1 = rg.train_gd(one, X[s:s + 1], y[s:s + 1], rg.MEAN_FIELD, eta0=0.5, target=0.05, max_steps=50)
        torch.testing.assert_close(r1.params.W[0], run.params.W[s])
        assert int(r1.steps[0]) == int(run.steps[s])


@pytest.mark.parametrize("mup", [rg.MUP, rg.MUP_ABC], ids=lambda p: p.name)
def test_mup_trains_like_mean_field(mup):
    _, X, y, _ = setup_problem(m=12)
    kw = dict(eta0=0.7, target=0.0, max_steps=20)
    mf = rg.init_two_layer(2, 12, 3, rg.MEAN_FIELD, generator=gen(5))
    mu = rg.init_two_layer(2, 12, 3, mup, generator=gen(5))
    r_mf, r_mu = rg.train_gd(mf, X, y, rg.MEAN_FIELD, **kw), rg.train_gd(mu, X, y, mup, **kw)
    h, _ = mup.multipliers(12)
    torch.testing.assert_close(h * r_mu.params.W, r_mf.params.W)
    torch.testing.assert_close(rg.forward(r_mu.params, X, mup), rg.forward(r_mf.params, X, rg.MEAN_FIELD))
    torch.testing.assert_close(rg.tangent_kernel(r_mu.params, X, mup), rg.tangent_kernel(r_mf.params, X, rg.MEAN_FIELD))


# ----------------------------------------------------------------------------------------------- linearised model
@pytest.mark.parametrize("param", [rg.NTK, rg.MUP], ids=lambda p: p.name)
def test_linearised_gd_matches_dense_linear_model(param):
    _, X, y, p0 = setup_problem(S=2, m=6, n=5, param=param)
    eta0, target, nu = 0.4, 0.02, 2.0
    lin = rg.linearised_gd(p0, X, y, param, eta0=eta0, target=target, max_steps=40, lazy_factor=nu)
    w = lr_weights(param, 6, 3) * eta0 / nu**2
    X2 = torch.randn(2, 3, 3, dtype=F64, generator=gen(3))
    for s in range(2):
        fn, theta0 = flat_model(p0, s, X, param, nu=nu)
        J, f0 = cv.jacobian(fn, theta0), fn(theta0)
        theta, steps = theta0.clone(), 0
        for _ in range(40):
            r = f0 + J @ (theta - theta0) - y[s]
            if 0.5 * float(r.square().mean()) <= target:
                break
            theta, steps = theta - w * (J.T @ r) / 5, steps + 1
        delta = torch.cat([lin.delta.W[s].reshape(-1), lin.delta.b[s], lin.delta.v[s]])
        torch.testing.assert_close(delta, theta - theta0)
        assert int(lin.steps[s]) == steps
        fn2, _ = flat_model(p0, s, X2, param, nu=nu)
        pred = rg.linearised_forward(p0, lin.delta, X2, param, lazy_factor=nu)[s]
        torch.testing.assert_close(pred, fn2(theta0) + cv.jacobian(fn2, theta0) @ (theta - theta0))


def test_limiting_ntk_against_monte_carlo():
    X = torch.tensor([[1.0, 0.0, 0.5], [0.2, -1.0, 0.3], [0.0, 0.0, 0.0]], dtype=F64)
    kbar = rg.limiting_ntk(X, init_std=0.8, bias_std=0.4, out_std=1.3)
    g = gen(0)
    N = 400_000
    w = 0.8 * torch.randn(N, 3, generator=g, dtype=F64)
    b = 0.4 * torch.randn(N, generator=g, dtype=F64)
    Z = X @ w.T + b                                              # (3, N)
    terms = (torch.tanh(Z)[:, None, :] * torch.tanh(Z)[None]
             + 1.3**2 * ((1 - torch.tanh(Z) ** 2)[:, None, :] * (1 - torch.tanh(Z) ** 2)[None])
             * (X @ X.T + 1)[..., None])
    mc, se = terms.mean(-1), terms.std(-1) / math.sqrt(N)
    assert bool(((mc - kbar).abs() <= 5 * se + 1e-12).all())


# ----------------------------------------------------------------------------------------------- metrics
def test_alignment_wcd_subspace_against_references():
    W = torch.randn(2, 9, 4, dtype=F64, generator=gen(1))
    Wt = torch.randn(2, 2, 4, dtype=F64, generator=gen(2))
    Wt[1] *= 3.0
    al = rg.teacher_alignment(W, Wt)
    for s in range(2):
        P = Wt[s].T @ torch.linalg.pinv(Wt[s].T)
        torch.testing.assert_close(al[s], (W[s] @ P).square().sum() / W[s].square().sum())
    for signed in (False, True):
        got = rg.wcd(W, Wt, sign_invariant=signed)
        for s in range(2):
            rho = W[s].norm(dim=1) ** 2 / W[s].square().sum()
            total = 0.0
            for i in range(9):
                cands = [Wt[s, j] * sgn for j in range(2) for sgn in ((1, -1) if signed else (1,))]
                cos = [float(W[s, i] @ c / (W[s, i].norm() * c.norm())) for c in cands]
                total += float(rho[i]) * min(math.sqrt(max(2 * (1 - c), 0.0)) for c in cos)
            assert abs(float(got[s]) - total) < 1e-10
    Wz = W.clone()
    Wz[:, 0] = 0.0                                          # a dead neuron has weight 0 and no NaN
    assert bool(torch.isfinite(rg.wcd(Wz, Wt)).all())
    dist = rg.top_subspace_distance(W, Wt)
    for s in range(2):
        _, _, Vh = np.linalg.svd(W[s].numpy())
        torch.testing.assert_close(dist[s], linalg.sin_theta_distance(torch.as_tensor(Vh[:2]), Wt[s]))
    aligned = torch.cat([5 * Wt[:, :1], 5 * Wt[:, 1:], 0.01 * W], dim=1)
    assert float(rg.top_subspace_distance(aligned, Wt).max()) < 1e-2
    assert float(rg.teacher_alignment(aligned, Wt).min()) > 0.99


def test_relative_distance_and_kernel_change():
    p0 = rg.init_two_layer(2, 4, 3, rg.NTK, generator=gen(0))
    p1 = rg.TwoLayer(2 * p0.W, p0.b, p0.v)
    torch.testing.assert_close(rg.relative_distance(p0, p1), torch.ones(2, dtype=F64))
    K = torch.eye(3, dtype=F64).expand(2, 3, 3)
    torch.testing.assert_close(rg.kernel_change(K, 1.5 * K), torch.full((2,), 0.5, dtype=F64))


def test_refit_is_min_norm_least_squares():
    _, X, y, p0 = setup_problem(S=2, m=16, n=5)
    Xt, yt = torch.randn(2, 7, 3, dtype=F64, generator=gen(4)), torch.randn(2, 7, dtype=F64, generator=gen(5))
    got = rg.refit_test_loss(p0, X, y, Xt, yt, rg.NTK)
    for s in range(2):
        Phi = torch.tanh(X[s] @ p0.W[s].T + p0.b[s])
        v = torch.linalg.pinv(Phi) @ y[s]
        pred = torch.tanh(Xt[s] @ p0.W[s].T + p0.b[s]) @ v
        torch.testing.assert_close(got[s], 0.5 * (pred - yt[s]).square().mean())


# ----------------------------------------------------------------------------------------------- teacher, fits, sweep
def test_teacher_rows_and_normalisation():
    t = rg.make_teacher(3, 6, 2, weight_norm=2.0, generator=gen(0))
    G = t.W_teacher @ t.W_teacher.transpose(1, 2)
    torch.testing.assert_close(G, 4.0 * torch.eye(2, dtype=F64).expand(3, 2, 2))
    X, y = rg.sample(t, 50_000, generator=gen(1))
    assert X.shape == (3, 50_000, 6) and float((y.square().mean(1) - 1).abs().max()) < 0.05
    assert bool((rg.make_teacher(3, 6, 2, out_weights="signs", generator=gen(0)).v.abs() == 1).all())


def test_slope_fit_recovers_power_laws():
    x = np.array([64, 128, 256, 512, 1024.0])
    Y = np.stack([3 * x**-0.5, 2 * x**-0.5 * (1 + 4 / x)])
    f = rg.slope_fit(x, Y)
    np.testing.assert_allclose(f.slopes, np.polyfit(np.log(x), np.log(Y).T, 1)[0])
    np.testing.assert_allclose(f.corrected_slopes[0], -0.5, atol=1e-12)
    assert abs(f.corrected_slopes[1] + 0.5) < 1e-3 and f.correction_bias > 0


def test_width_sweep_frame():
    teacher = rg.make_teacher(2, 3, 1, generator=gen(0), n_mc=500)
    data = (*rg.sample(teacher, 6, generator=gen(1)), *rg.sample(teacher, 20, generator=gen(2)))
    df = rg.width_sweep(teacher, data, [8, 16], ["NTK", "mean-field", "muP"], eta0=0.5, target=0.1, max_steps=30,
                        lazy_factors=(1.0, 4.0), refit_min_width=16, show_progress=False)
    assert len(df) == 2 * 3 * 2 * 2 and {"rel_dist", "kernel_change", "alignment", "wcd", "refit"} <= set(df.columns)
    assert df[df.m == 8].refit.isna().all() and df[df.m == 16].refit.notna().all()
    mf, mu = df[df.method == "mean-field"], df[df.method == "muP"]
    np.testing.assert_allclose(mf.rel_dist.to_numpy(), mu.rel_dist.to_numpy(), rtol=1e-10)


def test_summarise_and_plot_metric():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from curvlab import plotting

    df = pd.DataFrame({"method": ["NTK"] * 4 + ["muP"] * 4, "m": [8, 8, 16, 16] * 2, "seed": [0, 1] * 4,
                       "rel_dist": [1.0, 3.0, 2.0, 4.0, 5.0, 7.0, 6.0, 8.0], "converged": [True] * 8})
    st_ = rg.summarise(df)
    assert list(st_.columns) == ["method", "m", "rel_dist_mean", "rel_dist_sem"]
    ref = df.groupby(["method", "m"]).rel_dist.agg(["mean", "sem"]).reset_index()
    np.testing.assert_allclose(st_.rel_dist_mean, ref["mean"])
    np.testing.assert_allclose(st_.rel_dist_sem, ref["sem"])
    fig, ax = plt.subplots()
    rg.plot_metric(ax, st_, "rel_dist", ["NTK", "muP"])
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines[rg.LABELS["NTK"]].get_color() == plotting.style("NTK").color
    assert lines[rg.LABELS["muP"]].get_linestyle() == "None"          # muP: markers only
    with pytest.raises(ValueError, match="methods"):
        rg.plot_metric(ax, st_, "rel_dist", ["mean-field"])
    with pytest.raises(ValueError, match="by"):
        rg.summarise(df, by=["width"])
    with pytest.raises(TypeError, match="frame"):
        rg.summarise(st_.to_numpy())
    plt.close(fig)


def test_interpolating_scales_and_steps():
    p = rg.interpolating(0.75)
    assert p.multipliers(16) == (1.0, 16 ** -0.75) and p.step_sizes(16, 2.0) == (2.0 * 16**0.5, 2.0 * 16**0.5)
    with pytest.raises(ValueError, match="a_out"):
        rg.interpolating(-1.0)


# ----------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_with_the_argument_named():
    _, X, y, p0 = setup_problem()
    with pytest.raises(ValueError, match="param"):
        rg.forward(p0, X, "NTP")
    with pytest.raises(TypeError, match="param"):
        rg.forward(p0, X, 3)
    with pytest.raises(ValueError, match="X"):
        rg.forward(p0, X[..., :2], rg.NTK)
    with pytest.raises(ValueError, match="y"):
        rg.train_gd(p0, X, y[:, :2], rg.NTK, eta0=1.0, target=0.1, max_steps=3)
    with pytest.raises(ValueError, match="eta0"):
        rg.train_gd(p0, X, y, rg.NTK, eta0=-1.0, target=0.1, max_steps=3)
    with pytest.raises(ValueError, match="lazy_factor"):
        rg.forward(p0, X, rg.NTK, lazy_factor=0.0)
    with pytest.raises(ValueError, match="act"):
        rg.forward(p0, X, rg.NTK, act="gelu")
    with pytest.raises(ValueError, match="m must be even"):
        rg.init_two_layer(1, 5, 3, rg.NTK)
    with pytest.raises(ValueError, match="m_teacher"):
        rg.make_teacher(1, 3, 4)
    with pytest.raises(ValueError, match="out_weights"):
        rg.make_teacher(1, 3, 2, out_weights="uniform")
    with pytest.raises(TypeError, match="params"):
        rg.forward((p0.W, p0.b, p0.v), X, rg.NTK)
    with pytest.raises(ValueError, match="params.W"):
        rg.forward(rg.TwoLayer(p0.W * float("nan"), p0.b, p0.v), X, rg.NTK)
    with pytest.raises(ValueError, match="x must be"):
        rg.slope_fit([1, 2, 3], np.ones((2, 3)))
    with pytest.raises(ValueError, match="Y must be"):
        rg.slope_fit([1, 2, 3, 4], -np.ones((2, 4)))
    with pytest.raises(TypeError, match="a_out"):
        rg.Parametrisation("x", 0, True, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="W_teacher"):
        rg.teacher_alignment(torch.randn(2, 5, 3), torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match="nonzero row"):
        rg.wcd(torch.zeros(2, 5, 3), torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match="k must be"):
        rg.top_subspace_distance(torch.randn(2, 5, 3), torch.randn(2, 2, 3), k=4)
    with pytest.raises(ValueError, match="K0 and K1"):
        rg.kernel_change(torch.eye(3), torch.eye(2))
    with pytest.raises(ValueError, match="delta"):
        rg.linearised_forward(p0, rg.TwoLayer(p0.W[:, :2], p0.b[:, :2], p0.v[:, :2]), X, rg.NTK)
    with pytest.raises(ValueError, match="diverged"):
        rg.train_gd(p0, X, y, rg.NTK, eta0=1e6, target=0.0, max_steps=200)
