"""Tests for curvlab.singleindex: dense / autograd / Monte Carlo references on small problems; bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import rmt
from curvlab import singleindex as si

F64 = torch.float64
FAST = settings(max_examples=10, deadline=None)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def problem(d=40, kind="two-level", kappa=9.0, beta="flat", seed=0):
    s = si.spectrum(kind, d, kappa) if kind != "isotropic" else si.spectrum(kind, d)
    return s, si.beta_star(d, beta, generator=gen(seed))


# ----------------------------------------------------------------------------------------------- problems
@pytest.mark.parametrize("kind", ["two-level", "power-law", "spiked"])
def test_spectrum_condition_number_and_mean(kind):
    s = si.spectrum(kind, 50, 20.0, mean=2.0)
    assert s.shape == (50,) and s.dtype == F64
    assert float(s.max() / s.min()) == pytest.approx(20.0)
    assert float(s.mean()) == pytest.approx(2.0)
    assert torch.all(s[:-1] >= s[1:])
    assert torch.allclose(si.spectrum("isotropic", 7), torch.ones(7, dtype=F64))
    two = si.spectrum("two-level", 8, 16.0, mean=2.125)
    assert torch.allclose(two, torch.tensor([4.0] * 4 + [0.25] * 4, dtype=F64))


def test_beta_star_kinds():
    b = si.beta_star(30, "flat", generator=gen())
    assert torch.allclose(b.square(), torch.full((30,), 1 / 30, dtype=F64))
    h = si.beta_star(30, "haar", generator=gen())
    assert float(h.norm()) == pytest.approx(1.0)
    e = si.beta_star(30, "eigenvector", index=3)
    assert float(e[3]) == 1.0 and float(e.abs().sum()) == 1.0


def test_link_moments_closed_forms_and_monte_carlo():
    lm = si.link_moments("linear", 2.0, noise_std=0.5)
    assert lm.c1 == pytest.approx(1.0) and lm.Ey2 == pytest.approx(2.25) and lm.sigma_eff2 == pytest.approx(0.25)
    assert si.link_moments("he2", 1.7).c1 == pytest.approx(0.0, abs=1e-12)
    cub = si.link_moments("cubic", 1.5)  # c1 = E[1 + z^2] = 1 + s2
    assert cub.c1 == pytest.approx(2.5)
    z = torch.randn(400_000, generator=gen(1), dtype=F64) * math.sqrt(0.8)
    lm = si.link_moments("tanh", 0.8)
    assert lm.c1 == pytest.approx(float((1 - torch.tanh(z) ** 2).mean()), abs=3e-3)
    assert lm.Ey2 == pytest.approx(float(torch.tanh(z).square().mean()), abs=3e-3)
    assert si.link_moments(lambda t: 2 * t, 1.0).c1 == pytest.approx(2.0)


def test_sample_shapes_and_covariance():
    s, b = problem(d=6)
    X, y = si.sample(s, b, "linear", 20_000, 2, noise_std=0.1, generator=gen(2), device="cpu")
    assert X.shape == (2, 20_000, 6) and y.shape == (2, 20_000)
    S = X.transpose(-2, -1) @ X / X.shape[-2]
    assert torch.allclose(torch.diagonal(S, dim1=-2, dim2=-1), s.expand(2, 6), rtol=0.06)
    resid = y - X @ b
    assert float(resid.std()) == pytest.approx(0.1, rel=0.05)


# ----------------------------------------------------------------------------------------------- network
def test_init_network_is_symmetric():
    W0, v = si.init_network(3, 10, 5, generator=gen())
    assert W0.shape == (3, 10, 5) and v.shape == (3, 10)
    assert torch.equal(W0[:, 0::2], W0[:, 1::2]) and torch.all(v[:, 0::2] == 1) and torch.all(v[:, 1::2] == -1)
    X = torch.randn(3, 7, 5, dtype=F64, generator=gen(3))
    f0 = (si.features(X, W0) * v.unsqueeze(-2)).sum(-1)
    assert torch.allclose(f0, torch.zeros_like(f0), atol=1e-14)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_neg_gradient_matches_autograd(activation):
    X = torch.randn(2, 9, 4, dtype=F64, generator=gen(4))
    y = torch.randn(2, 9, dtype=F64, generator=gen(5))
    W = torch.randn(2, 6, 4, dtype=F64, generator=gen(6)).requires_grad_(True)
    v = torch.randn(2, 6, dtype=F64, generator=gen(7))
    f = (si.features(X, W, activation) * v.unsqueeze(-2)).sum(-1)
    loss = ((f - y) ** 2).sum() / (2 * 9)  # summed over the batch: each replicate's own gradient
    loss.backward()
    G = si.neg_gradient(X, y, W.detach(), v, activation)
    assert torch.allclose(G, -W.grad, atol=1e-12)


def test_giant_step_kfac_is_right_preconditioned_gradient():
    X = torch.randn(2, 30, 5, dtype=F64, generator=gen(8))
    y = torch.randn(2, 30, dtype=F64, generator=gen(9))
    W0, v = si.init_network(2, 8, 5, generator=gen(10))
    G = si.giant_step(X, y, W0, v, method="SGD")
    K = si.giant_step(X, y, W0, v, method="K-FAC", lam_G=0.3)
    A = X.transpose(-2, -1) @ X / 30 + 0.3 * torch.eye(5, dtype=F64)
    assert torch.allclose(K, G @ torch.linalg.inv(A), atol=1e-12)


def test_scale_and_spike_direction():
    D = torch.randn(3, 7, 4, dtype=F64, generator=gen(11))
    S = si.scale_to_norm(D, torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    assert torch.allclose(torch.linalg.matrix_norm(S, ord=2), torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    u = si.spike_direction(D)
    Vh = torch.linalg.svd(D, full_matrices=False).Vh[:, 0]
    assert torch.allclose(si.cosine(u, Vh, absolute=True), torch.ones(3, dtype=F64))
    # a left factor cannot change the right singular vector of a rank-one update
    R1 = torch.randn(7, 1, dtype=F64, generator=gen(12)) @ torch.randn(1, 4, dtype=F64, generator=gen(13))
    A = torch.randn(7, 7, dtype=F64, generator=gen(14)) + 5 * torch.eye(7, dtype=F64)
    assert float(si.cosine(si.spike_direction(A @ R1), si.spike_direction(R1), absolute=True)) == pytest.approx(1.0)


def test_ridge_head_and_risk_dense():
    Phi = torch.randn(40, 6, dtype=F64, generator=gen(15))
    y = torch.randn(40, dtype=F64, generator=gen(16))
    v = si.ridge_head(Phi, y, 0.2)
    ref = torch.linalg.solve(Phi.T @ Phi / 40 + 0.2 * torch.eye(6, dtype=F64), Phi.T @ y / 40)
    assert torch.allclose(v, ref, atol=1e-12)
    assert float(si.risk(Phi, y, v)) == pytest.approx(float(((Phi @ ref - y) ** 2).mean()))


def test_ideal_spikes_dense():
    X = torch.randn(2, 25, 4, dtype=F64, generator=gen(17))
    y = torch.randn(2, 25, dtype=F64, generator=gen(18))
    lam = torch.tensor([0.01, 1.0], dtype=F64)
    u, uk = si.ideal_spikes(X, y, lam)
    assert torch.allclose(u, (X.transpose(-2, -1) @ y.unsqueeze(-1)).squeeze(-1) / 25)
    for j, l in enumerate(lam.tolist()):
        A = X.transpose(-2, -1) @ X / 25 + l * torch.eye(4, dtype=F64)
        assert torch.allclose(uk[:, j], torch.linalg.solve(A, u.unsqueeze(-1)).squeeze(-1), atol=1e-12)


@pytest.mark.parametrize("n, d", [(30, 5), (6, 10)])
def test_ideal_spikes_at_zero_damping_is_least_squares(n, d):
    """lam_G = 0 is accepted, as by kfac_cosine: OLS when n > d, the minimum-norm interpolator when d > n."""
    X = torch.randn(2, n, d, dtype=F64, generator=gen(5))
    y = torch.randn(2, n, dtype=F64, generator=gen(6))
    _, uk = si.ideal_spikes(X, y, torch.tensor([0.0, 1e-3], dtype=F64))
    ls = (torch.linalg.pinv(X) @ y.unsqueeze(-1)).squeeze(-1)          # min-norm least squares, = OLS if n > d
    assert torch.allclose(uk[:, 0], ls, atol=1e-10)
    assert not torch.allclose(uk[:, 1], ls, atol=1e-10)                   # a positive penalty is not the pinv
    s = si.spectrum("two-level", d, 4.0)
    b2 = torch.full((d,), 1.0 / d, dtype=F64)
    assert torch.isfinite(si.kfac_cosine(0.0, s, b2, 1.0, 0.1, d / n))      # the theory accepts it too


def test_select_lam_G_is_the_validation_argmin():
    X = torch.randn(3, 40, 6, dtype=F64, generator=gen(7))
    y = X @ torch.ones(6, dtype=F64) + torch.randn(3, 40, dtype=F64, generator=gen(8))
    Xv = torch.randn(3, 50, 6, dtype=F64, generator=gen(9))
    yv = Xv @ torch.ones(6, dtype=F64)
    grid = torch.tensor([0.0, 0.01, 1.0, 100.0], dtype=F64)
    idx, mse = si.select_lam_G(X, y, Xv, yv, grid)
    assert idx.shape == (3,) and mse.shape == (3, 4)
    for r in range(3):
        for j, lam in enumerate(grid.tolist()):
            A = X[r].T @ X[r] / 40 + lam * torch.eye(6, dtype=F64)
            u = torch.linalg.solve(A, X[r].T @ y[r] / 40)
            assert float(mse[r, j]) == pytest.approx(float((Xv[r] @ u - yv[r]).square().mean()), rel=1e-10)
        assert int(idx[r]) == int(mse[r].argmin())
    assert bool((idx < 3).all())          # the huge penalty shrinks the spike to nothing: never chosen here


def test_link_moments_stable_at_high_node_counts():
    """Issue 15: hermegauss returned NaN weights at nodes = 400; the Golub-Welsch rule does not."""
    for link in ("tanh2", "cubic", "linear"):
        lo, hi = si.link_moments(link, 1.3, nodes=200), si.link_moments(link, 1.3, nodes=400)
        assert all(math.isfinite(v) for v in hi)
        assert hi.c1 == pytest.approx(lo.c1, rel=1e-6) and hi.Ey2 == pytest.approx(lo.Ey2, rel=1e-6)
    x, w = si.hermite_nodes(si.MAX_NODES)
    assert np.isfinite(x).all() and np.isfinite(w).all() and w.sum() == pytest.approx(1.0)
    x, w = si.hermite_nodes(7)       # exact moments E g^2 = 1, E g^4 = 3, E g^12 = 10395
    for k, mom in ((2, 1.0), (4, 3.0), (12, 10395.0)):
        assert float((w * x**k).sum()) == pytest.approx(mom, rel=1e-12)


# ----------------------------------------------------------------------------------------------- theory
def test_sgd_cosine_limits_and_cauchy_schwarz():
    s, b = problem(d=20, beta="haar")
    b2 = b.square()
    lm = si.link_moments("tanh", float((b2 * s).sum()))
    pop = si.sgd_cosine(s, b2, lm.c1, lm.Ey2, 0.0)
    Sb = s * b
    assert float(pop) == pytest.approx(float((b * Sb).sum() / Sb.norm()))
    assert float(pop) < 1
    e = si.beta_star(20, "eigenvector", index=4)
    assert float(si.sgd_cosine(s, e.square(), lm.c1, lm.Ey2, 0.0)) == pytest.approx(1.0)
    g = torch.tensor([0.1, 0.5, 2.0], dtype=F64)
    c = si.sgd_cosine(s, b2, lm.c1, lm.Ey2, g)
    assert torch.all(c[:-1] > c[1:])
    assert float(si.sgd_cosine(s, b2, lm.c1, lm.Ey2, 0.0, target="Sigma_beta")) == pytest.approx(1.0)


def test_kfac_cosine_limits():
    s, b = problem(d=50, kappa=16.0)
    b2 = b.square()
    lm = si.link_moments("tanh2", float((b2 * s).sum()), 0.1)
    g = 0.3
    big = si.kfac_cosine(torch.tensor(1e7, dtype=F64), s, b2, lm.c1, lm.sigma_eff2, g)
    assert float(big) == pytest.approx(float(si.sgd_cosine(s, b2, lm.c1, lm.Ey2, g)), abs=1e-5)
    assert float(si.kfac_cosine(0.0, s, b2, lm.c1, lm.sigma_eff2, g)) == pytest.approx(
        si.ols_cosine(s, lm.c1, lm.sigma_eff2, g), abs=1e-12)
    small = si.kfac_cosine(torch.tensor(1e-9, dtype=F64), s, b2, lm.c1, lm.sigma_eff2, g)
    assert float(small) == pytest.approx(si.ols_cosine(s, lm.c1, lm.sigma_eff2, g), abs=1e-6)
    lam = torch.tensor([0.1, 1.0], dtype=F64)
    assert torch.allclose(si.kfac_cosine(lam, s, b2, lm.c1, lm.sigma_eff2, 0.0),
                          si.population_kfac_cosine(lam, s, b2))
    tiny = si.kfac_cosine(lam, s, b2, lm.c1, lm.sigma_eff2, 1e-9)
    assert torch.allclose(tiny, si.population_kfac_cosine(lam, s, b2), atol=1e-6)
    assert float(si.kfac_cosine(torch.tensor(1e-8, dtype=F64), s, b2, lm.c1, lm.sigma_eff2, 1e-8)) == pytest.approx(
        1.0, abs=1e-6)
    wide = si.kfac_cosine(torch.tensor([0.0, 1e-8], dtype=F64), s, b2, lm.c1, lm.sigma_eff2, 2.0)
    assert torch.all(torch.isfinite(wide)) and float(wide[0]) > 0
    assert float(wide[0]) == pytest.approx(float(wide[1]), abs=1e-6)  # continuous at lam_G -> 0, gamma > 1
    assert float(si.kfac_cosine(0.1, s, b2, 0.0, 0.2, g)) == 0.0      # even link: no spike


def test_kfac_cosine_matches_monte_carlo():
    d, R = 120, 24
    s, b = problem(d=d, kappa=16.0)
    lm = si.link_moments("tanh2", float((b.square() * s).sum()))
    lam = torch.tensor([0.01, 0.3, 3.0], dtype=F64)
    X, y = si.sample(s, b, "tanh2", 3 * d, R, generator=gen(19), device="cpu")
    u, uk = si.ideal_spikes(X, y, lam)
    ck, cs = si.cosine(uk, b), si.cosine(u, b)
    th = si.kfac_cosine(lam, s, b.square(), lm.c1, lm.sigma_eff2, 1 / 3)
    se = ck.std(0) / math.sqrt(R)
    assert torch.all((ck.mean(0) - th).abs() < 4 * se + 0.01)
    ts = si.sgd_cosine(s, b.square(), lm.c1, lm.Ey2, 1 / 3)
    assert abs(float(cs.mean() - ts)) < 4 * float(cs.std() / math.sqrt(R)) + 0.01


@given(lam=st.floats(0.0, 50.0), gamma=st.sampled_from([0.1, 0.5, 0.9, 1.5, 3.0]),
       nu=st.sampled_from([0.25, 0.5, 0.8]))
@FAST
def test_effective_ridge_two_level_matches_newton(lam, gamma, nu):
    d = 40
    k = round(nu * d)
    s = torch.cat([torch.full((k,), 4.0, dtype=F64), torch.full((d - k,), 0.25, dtype=F64)])
    tau = si.effective_ridge_two_level(lam, gamma, 4.0, 0.25, k / d)
    ref = rmt.effective_ridge(lam, s, gamma)
    assert float(tau) == pytest.approx(float(ref), rel=1e-9, abs=1e-12)


def test_effective_ridge_two_level_broadcasts():
    lam = torch.tensor([0.0, 0.1, 1.0], dtype=F64)
    g = torch.tensor([[0.5], [2.0]], dtype=F64)
    tau = si.effective_ridge_two_level(lam, g, 2.0, 0.5, 0.5)
    assert tau.shape == (2, 3)
    assert float(tau[0, 0]) == 0.0 and float(tau[1, 0]) > 0
    assert float(tau[1, 0]) == pytest.approx(rmt.effective_ridge_floor(torch.tensor([2.0, 0.5]), 2.0), rel=1e-9)


def test_optimal_lam_G_is_gamma_sigma_over_c1_for_flat_beta():
    s, b = problem(d=60, kind="power-law", kappa=50.0)
    lm = si.link_moments("tanh2", float((b.square() * s).sum()), 0.1)
    lam_star, cos_star = si.optimal_lam_G(s, b.square(), lm.c1, lm.sigma_eff2, 0.25)
    assert lam_star == pytest.approx(0.25 * lm.sigma_eff2 / lm.c1**2, rel=1e-4)
    grid = si.kfac_cosine(torch.logspace(-4, 3, 300, dtype=F64), s, b.square(), lm.c1, lm.sigma_eff2, 0.25)
    assert cos_star >= float(grid.max()) - 1e-12


def test_giant_step_experiment_frame():
    s, b = problem(d=16)
    df = si.giant_step_experiment(s, b, link="tanh", n=48, m=8, replicates=2, lam_G=0.1, spike_norms=[1.0, 2.0],
                                  n_test=30, generator=gen(20), device="cpu")
    assert set(df.columns) >= {"replicate", "method", "theta", "val_risk", "test_risk", "cos", "null_risk"}
    assert len(df) == 2 * (1 + 2 * 2)
    assert df[df.method != "RF"].cos.between(0, 1).all()


# ----------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs():
    s, b = problem(d=10)
    with pytest.raises(ValueError, match="kind"):
        si.spectrum("flat", 10)
    with pytest.raises(ValueError, match="anisotropy"):
        si.spectrum("two-level", 10, 0.5)
    with pytest.raises(ValueError, match="anisotropy"):
        si.spectrum("isotropic", 10, 3.0)
    with pytest.raises(ValueError, match="index"):
        si.beta_star(5, "eigenvector", index=5)
    with pytest.raises(ValueError, match="link"):
        si.link_moments("sigmoid", 1.0)
    with pytest.raises(TypeError, match="link"):
        si.link_moments(3, 1.0)
    with pytest.raises(ValueError, match="s2"):
        si.link_moments("tanh", -1.0)
    with pytest.raises(ValueError, match="beta"):
        si.sample(s, b[:5], "tanh", 10, 1)
    with pytest.raises(ValueError, match="m must be even"):
        si.init_network(1, 5, 3)
    with pytest.raises(ValueError, match="y must have shape"):
        si.neg_gradient(torch.zeros(4, 3), torch.zeros(5), torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="activation"):
        si.features(torch.zeros(4, 3), torch.zeros(2, 3), "gelu")
    with pytest.raises(ValueError, match="method"):
        si.giant_step(torch.zeros(4, 3), torch.zeros(4), torch.zeros(2, 3), torch.zeros(2), method="Adam")
    with pytest.raises(ValueError, match="positive definite"):
        X = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64)  # n < d: the sample covariance is singular
        si.giant_step(X, torch.ones(2, dtype=F64), torch.randn(2, 3, dtype=F64), torch.ones(2, dtype=F64),
                      method="K-FAC", lam_G=0.0)
    with pytest.raises(ValueError, match="zero matrix"):
        si.scale_to_norm(torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match="lam_v"):
        si.ridge_head(torch.ones(4, 2), torch.ones(4), 0.0)
    with pytest.raises(ValueError, match="lam_G"):
        si.ideal_spikes(torch.randn(5, 3), torch.randn(5), torch.tensor([-1e-3]))
    with pytest.raises(ValueError, match=r"nodes must lie in \[2, 4000\]"):
        si.link_moments("tanh", 1.0, nodes=10_000)
    with pytest.raises(ValueError, match="nodes"):
        si.link_moments("tanh", 1.0, nodes=1)
    with pytest.raises(ValueError, match="link is not finite.*nodes"):
        si.link_moments(lambda t: torch.where(t.abs() > 5, torch.inf, t), 1.0, nodes=200)
    with pytest.raises(ValueError, match="link has no finite Gaussian moments.*nodes"):
        si.link_moments(lambda t: torch.exp(t**2), 1.0, nodes=200)
    with pytest.raises(ValueError, match="grid"):
        si.select_lam_G(torch.randn(5, 3), torch.randn(5), torch.randn(4, 3), torch.randn(4), [0.1])
    with pytest.raises(ValueError, match="X_val"):
        si.select_lam_G(torch.randn(5, 3), torch.randn(5), torch.randn(4, 2), torch.randn(4), [0.1, 1.0])
    with pytest.raises(ValueError, match="beta_sq"):
        si.sgd_cosine(s, torch.ones(10), 1.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="gamma"):
        si.sgd_cosine(s, b.square(), 1.0, 1.0, -0.5)
    with pytest.raises(ValueError, match="lam_G"):
        si.kfac_cosine(-1.0, s, b.square(), 1.0, 0.1, 0.5)
    with pytest.raises(ValueError, match="eigenvalues"):
        si.kfac_cosine(1.0, -s, b.square(), 1.0, 0.1, 0.5)
    with pytest.raises(ValueError, match="gamma < 1"):
        si.ols_cosine(s, 1.0, 0.1, 1.5)
    with pytest.raises(ValueError, match="fraction"):
        si.effective_ridge_two_level(0.1, 0.5, 2.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="lo must be"):
        si.optimal_lam_G(s, b.square(), 1.0, 0.1, 0.5, lo=2.0, hi=1.0)
    with pytest.raises(TypeError, match="c1"):
        si.kfac_cosine(1.0, s, b.square(), "a", 0.1, 0.5)
