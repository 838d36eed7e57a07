"""Tests for curvlab.rmt: closed forms against quadrature, dense linear algebra and Monte Carlo; bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import linalg, rmt

F64 = torch.float64
FAST = settings(max_examples=15, deadline=None)
gammas = st.sampled_from([0.1, 0.3, 0.7, 1.0, 1.6, 3.0])


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def quad_density(f, gamma):
    lo, hi = rmt.mp_edges(gamma)
    return scipy.integrate.quad(lambda x: float(rmt.mp_density(torch.tensor(x, dtype=F64), gamma)) * f(x),
                                lo, hi, limit=400, epsabs=1e-11)[0]


# ----------------------------------------------------------------------------------------------- Marchenko–Pastur
@pytest.mark.parametrize("gamma", [0.25, 1.0, 2.5])
def test_mp_density_mass_and_support(gamma):
    assert quad_density(lambda x: 1.0, gamma) == pytest.approx(min(1.0, 1.0 / gamma), abs=1e-7)
    assert quad_density(lambda x: x, gamma) == pytest.approx(1.0, abs=1e-7)  # E x = tr(Sigma)/d = 1; the atom adds 0
    lo, hi = rmt.mp_edges(gamma)
    out = rmt.mp_density(torch.tensor([lo - 1e-3, hi + 1e-3, -1.0, 0.0]), gamma)
    assert torch.all(out == 0)


@pytest.mark.parametrize("gamma", [0.2, 0.9, 1.0, 1.7, 4.0])
def test_mp_cdf_matches_integrated_density(gamma):
    lo, hi = rmt.mp_edges(gamma)
    xs = np.linspace(lo - 0.2, hi + 0.2, 9)
    F = rmt.mp_cdf(torch.tensor(xs), gamma)
    atom = max(0.0, 1 - 1 / gamma)
    for x, Fx in zip(xs, F.tolist()):
        cont = scipy.integrate.quad(lambda t: float(rmt.mp_density(torch.tensor(t, dtype=F64), gamma)),
                                    lo, min(max(x, lo), hi), limit=400)[0]
        assert Fx == pytest.approx(atom * (x >= 0) + cont, abs=1e-7)
    assert torch.all(torch.diff(rmt.mp_cdf(torch.linspace(-1, hi + 1, 200), gamma)) >= 0)


@pytest.mark.parametrize("gamma", [0.3, 1.0, 2.0])
def test_mp_stieltjes_matches_quadrature_and_quadratic(gamma):
    for z in (complex(-0.7, 0.3), complex(1.1, 0.05), complex(3.0, -0.4), complex(-2.0, 0.0)):
        re = quad_density(lambda x: (1 / (x - z)).real, gamma)
        im = quad_density(lambda x: (1 / (x - z)).imag, gamma)
        expected = re + 1j * im + max(0.0, 1 - 1 / gamma) / (0 - z)
        m = complex(rmt.mp_stieltjes(z, gamma))
        assert m == pytest.approx(expected, abs=1e-6)
        assert abs(gamma * z * m * m + (z + gamma - 1) * m + 1) < 1e-10


def test_mp_stieltjes_branch_and_density_inversion():
    gamma = 0.4
    z = torch.complex(torch.linspace(-3, 5, 41, dtype=F64), torch.full((41,), 1e-3, dtype=F64))
    assert torch.all(rmt.mp_stieltjes(z, gamma).imag > 0)  # Im z > 0  =>  Im m > 0
    x = torch.linspace(0.5, 2.5, 7, dtype=F64)
    torch.testing.assert_close(rmt.mp_stieltjes(x, gamma).imag / math.pi, rmt.mp_density(x, gamma))
    assert complex(rmt.mp_stieltjes(torch.tensor(1e8), gamma)) == pytest.approx(-1e-8, rel=1e-6)
    assert float(rmt.mp_stieltjes(torch.tensor(0.0), gamma).real) == pytest.approx(1 / (1 - gamma))


def test_mp_stieltjes_is_the_ridge_trace_monte_carlo():
    d, n = 200, 500
    lam = torch.tensor([0.1, 1.0], dtype=F64)
    e = rmt.sample_covariance_eigh(randn(n, d, seed=3))
    emp = (1 / (e.unsqueeze(0) + lam.unsqueeze(1))).mean(-1)
    torch.testing.assert_close(emp, rmt.mp_stieltjes(-lam, d / n).real, atol=0.02, rtol=0)


def test_mp_condition_number_values_and_monte_carlo():
    assert float(rmt.mp_condition_number(0.25)) == pytest.approx(3.0)
    assert float(rmt.mp_condition_number(0.0)) == 1.0
    kappa = rmt.simulate_condition_number(1000, 100, 10, generator=torch.Generator().manual_seed(1), device="cpu")
    assert kappa.shape == (10,)
    assert float(kappa.mean()) == pytest.approx(float(rmt.mp_condition_number(0.1)), rel=0.03)
    W = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    sv = torch.linalg.svdvals(W)
    kappa = rmt.simulate_condition_number(7, 3, 2, generator=torch.Generator().manual_seed(2), device="cpu")
    torch.testing.assert_close(kappa, sv[:, 0] / sv[:, -1])
    with pytest.raises(ValueError, match="d must be <= m"):
        rmt.simulate_condition_number(3, 7, 2)


# ----------------------------------------------------------------------------------------------- empirical spectra
def test_sample_covariance_eigh_descending_and_dense_reference():
    X = randn(3, 30, 8, seed=2)
    lam, Q = rmt.sample_covariance_eigh(X, vectors=True)
    assert torch.all(lam[..., :-1] >= lam[..., 1:])
    for b in range(3):
        S = (X[b].T @ X[b] / 30).numpy()
        np.testing.assert_allclose(lam[b].numpy(), np.sort(np.linalg.eigvalsh(S))[::-1], atol=1e-12)
        torch.testing.assert_close(Q[b] @ torch.diag(lam[b]) @ Q[b].T, torch.from_numpy(S))
    torch.testing.assert_close(rmt.sample_covariance_eigh(X), lam)


def test_spectral_cdf_counts():
    e = torch.tensor([[3.0, 1.0, 2.0, 2.0]])
    F = rmt.spectral_cdf(e, torch.tensor([0.0, 1.0, 2.0, 2.5, 3.0]))
    torch.testing.assert_close(F, torch.tensor([[0.0, 0.25, 0.75, 0.75, 1.0]], dtype=F64))


@FAST
@given(n=st.integers(2, 60), seed=st.integers(0, 2**31 - 1))
def test_kolmogorov_distance_matches_scipy(n, seed):
    x = torch.rand(n, dtype=F64, generator=torch.Generator().manual_seed(seed))
    ks = rmt.kolmogorov_distance(x, lambda t: t.clamp(0, 1))
    assert float(ks) == pytest.approx(scipy.stats.kstest(x.numpy(), "uniform").statistic, abs=1e-12)


def test_kolmogorov_distance_batched_and_errors():
    e = torch.rand(4, 10, dtype=F64, generator=torch.Generator().manual_seed(0))
    assert rmt.kolmogorov_distance(e, lambda t: t).shape == (4,)
    with pytest.raises(TypeError, match="cdf"):
        rmt.kolmogorov_distance(e, "uniform")
    with pytest.raises(ValueError, match="cdf"):
        rmt.kolmogorov_distance(e, lambda t: t[..., :3])


def test_richardson_bias_recovers_a_power_law():
    limit, c, a, N, s = 2.0, 5.0, 2 / 3, 400, 4.0
    mean = lambda size: limit + c * size**-a  # noqa: E731
    fine, coarse = torch.full((3, 2), mean(N)), torch.full((5, 2), mean(N / s))
    bias = rmt.richardson_bias(coarse, fine, s, a)
    torch.testing.assert_close(bias, torch.full((2,), c * N**-a, dtype=F64))
    noisy = rmt.richardson_bias(coarse + torch.tensor([[1.0], [-1.0], [0.0], [0.0], [0.0]]), fine, s, a, z=3.0)
    assert torch.all(noisy > bias)
    with pytest.raises(ValueError, match="size_ratio"):
        rmt.richardson_bias(coarse, fine, 1.0, a)
    with pytest.raises(ValueError, match="rate"):
        rmt.richardson_bias(coarse, fine, s, 0.0)
    with pytest.raises(ValueError, match="replicates"):
        rmt.richardson_bias(coarse[:1], fine, s, a)
    with pytest.raises(ValueError, match="z"):
        rmt.richardson_bias(coarse, fine, s, a, z=-1.0)


# ----------------------------------------------------------------------------------------------- ridge equivalent
def test_df1_df2_dense_reference():
    Sigma, _ = linalg.covariance(torch.logspace(-1, 1, 6, dtype=F64), generator=torch.Generator().manual_seed(0))
    s = torch.linalg.eigvalsh(Sigma)
    for tau in (0.1, 2.0):
        R = torch.linalg.inv(Sigma + tau * torch.eye(6, dtype=F64))
        assert float(rmt.df1(tau, s)) == pytest.approx(float(torch.trace(Sigma @ R)))
        assert float(rmt.df2(tau, s)) == pytest.approx(float(torch.trace(Sigma @ R @ Sigma @ R)))
    assert rmt.df1(torch.ones(3, 2), s).shape == (3, 2)


@pytest.mark.parametrize("gamma", [0.3, 1.0, 2.5])
def test_effective_ridge_isotropic_closed_form(gamma):
    lam = torch.logspace(-6, 3, 25, dtype=F64)
    tau = rmt.effective_ridge(lam, torch.ones(5), gamma)
    closed = (-(1 - gamma - lam) + ((1 - gamma - lam) ** 2 + 4 * lam).sqrt()) / 2
    torch.testing.assert_close(tau, closed, rtol=1e-9, atol=1e-12)
    assert float(rmt.effective_ridge(0.0, torch.ones(5), gamma)) == pytest.approx(max(0.0, gamma - 1), abs=1e-12)
    assert rmt.effective_ridge_floor(torch.ones(5), gamma) == pytest.approx(max(0.0, gamma - 1), abs=1e-12)


@FAST
@given(gamma=gammas, seed=st.integers(0, 2**31 - 1))
def test_effective_ridge_solves_the_fixed_point_on_the_valid_branch(gamma, seed):
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(7, dtype=F64, generator=gen) * 10 + 0.01
    w = torch.rand(7, dtype=F64, generator=gen) + 0.1
    lam = torch.logspace(-8, 2, 11, dtype=F64)
    tau = rmt.effective_ridge(lam, s, gamma, w)
    m1 = (w / w.sum() * s / (s + tau[:, None])).sum(-1)
    torch.testing.assert_close(tau * (1 - gamma * m1), lam, rtol=1e-9, atol=1e-14)
    assert torch.all(1 - gamma * m1 > 0) and torch.all(torch.diff(tau) > 0)
    assert torch.all(tau >= rmt.effective_ridge_floor(s, gamma, w) - 1e-12)


def test_effective_ridge_two_atoms_is_the_largest_root_of_the_cubic():
    a, b, w = 4.0, 0.25, 0.5
    for gamma in (0.5, 2.0):
        for lam in (0.0, 1e-4, 0.3, 7.0):
            # tau (a+tau)(b+tau) - gamma tau (w a (b+tau) + (1-w) b (a+tau)) - lam (a+tau)(b+tau)
            cubic = np.polysub(np.polymul([1, 0], np.polymul([1, a], [1, b])),
                               np.polyadd(np.polymul([gamma, 0], [w * a + (1 - w) * b, w * a * b + (1 - w) * a * b]),
                                          np.polymul([lam], np.polymul([1, a], [1, b]))))
            roots = np.roots(cubic)
            largest = max(r.real for r in roots if abs(r.imag) < 1e-9)
            tau = rmt.effective_ridge(lam, torch.tensor([a, b]), gamma, torch.tensor([w, 1 - w]))
            assert float(tau) == pytest.approx(largest, rel=1e-8, abs=1e-10)


def test_effective_ridge_floor_counts_only_positive_eigenvalues():
    s = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert rmt.effective_ridge_floor(s, 1.5) == 0.0  # gamma * mass(s > 0) = 0.75 <= 1
    assert rmt.effective_ridge_floor(s, 4.0) == pytest.approx(1.0)  # 4 * 0.5/(1 + t) = 1


def test_ridge_equivalent_derivatives_by_finite_differences():
    s = torch.tensor([4.0, 0.25, 1.0], dtype=F64)
    for gamma in (0.5, 2.0):
        lam = torch.tensor([1e-3, 0.5, 5.0], dtype=F64)
        eq = rmt.ridge_equivalent(lam, s, gamma)
        h = 1e-6 * lam
        fd = (rmt.effective_ridge(lam + h, s, gamma) - rmt.effective_ridge(lam - h, s, gamma)) / (2 * h)
        torch.testing.assert_close(eq.dtau, fd, rtol=1e-6, atol=0)
        torch.testing.assert_close(eq.resolvent, eq.tau[:, None] / (s + eq.tau[:, None]))
        # lam^2 R^2 = lam R - lam d(lam R)/dlam, applied to the equivalent lam R ~ tau/(s+tau)
        first = lambda l: rmt.ridge_equivalent(l, s, gamma).resolvent  # noqa: E731
        deriv = (first(lam + h) - first(lam - h)) / (2 * h[:, None])
        torch.testing.assert_close(eq.squared_resolvent, eq.resolvent - lam[:, None] * deriv, rtol=1e-6, atol=1e-9)


def test_ridge_equivalent_monte_carlo():
    d, n = 160, 320
    s = torch.tensor([4.0, 0.25], dtype=F64).repeat_interleave(d // 2)
    X = randn(4, n, d, seed=7) * s.sqrt()
    beta = randn(10, d, seed=8)
    beta = beta / beta.norm(dim=1, keepdim=True)
    lam = torch.tensor([0.01, 0.3, 3.0], dtype=F64)
    tr, q = rmt.resolvent_statistics(X, lam, beta)
    eq = rmt.ridge_equivalent(lam, s, d / n)
    torch.testing.assert_close(tr.mean(0), eq.resolvent.mean(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(q.mean(0), (beta.square().mean(0) * eq.squared_resolvent).sum(-1), atol=0.03, rtol=0)


def test_resolvent_statistics_dense_reference():
    X = randn(2, 12, 5, seed=4)
    beta = randn(5, seed=5)
    lam = torch.tensor([0.1, 2.0], dtype=F64)
    tr, q = rmt.resolvent_statistics(X, lam, beta)
    assert tr.shape == q.shape == (2, 2)
    for b in range(2):
        S = X[b].T @ X[b] / 12
        for j, l in enumerate(lam):
            R = torch.linalg.inv(S + l * torch.eye(5, dtype=F64))
            assert float(tr[b, j]) == pytest.approx(float(l * torch.trace(R) / 5))
            assert float(q[b, j]) == pytest.approx(float(l**2 * beta @ R @ R @ beta))
    _, q2 = rmt.resolvent_statistics(X, lam, torch.stack([beta, 2 * beta]))
    torch.testing.assert_close(q2, 2.5 * q)


def test_ridge_validation():
    s = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="lam_G"):
        rmt.effective_ridge(-1.0, s, 0.5)
    with pytest.raises(ValueError, match="eigenvalues"):
        rmt.effective_ridge(1.0, torch.tensor([-1.0, 2.0]), 0.5)
    with pytest.raises(ValueError, match="eigenvalues"):
        rmt.effective_ridge(1.0, torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="weights"):
        rmt.effective_ridge(1.0, s, 0.5, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="weights"):
        rmt.effective_ridge(1.0, s, 0.5, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="gamma"):
        rmt.effective_ridge(1.0, s, 0.0)
    with pytest.raises(TypeError, match="gamma"):
        rmt.ridge_equivalent(1.0, s, "half")
    with pytest.raises(ValueError, match="tau"):
        rmt.df1(0.0, s)
    with pytest.raises(ValueError, match="lam_G"):
        rmt.resolvent_statistics(randn(5, 3), torch.tensor([0.0]), torch.ones(3))
    with pytest.raises(ValueError, match="beta"):
        rmt.resolvent_statistics(randn(5, 3), torch.tensor([1.0]), torch.ones(4))
    with pytest.raises(ValueError, match="lam_G"):
        rmt.effective_ridge(float("nan"), s, 0.5)


# ----------------------------------------------------------------------------------------------- spikes
def test_spike_formulas_at_and_around_the_threshold():
    gamma = 0.5
    r = math.sqrt(gamma)
    xi = torch.tensor([0.0, 0.3, r, r + 1e-9, 2.0], dtype=F64)
    top, ov = rmt.spike_outlier(xi, gamma), rmt.spike_overlap(xi, gamma)
    torch.testing.assert_close(top[:4], torch.full((4,), rmt.mp_edges(gamma)[1], dtype=F64))
    assert torch.all(ov[:3] == 0) and float(ov[3]) < 1e-8
    assert float(top[4]) == pytest.approx(3 * 1.25) and float(ov[4]) == pytest.approx((1 - 0.125) / 1.25)


def test_simulate_spike_matches_formulas_and_dense_reference():
    xi = torch.tensor([0.0, 3.0], dtype=F64)
    top, ov = rmt.simulate_spike(xi, 1200, 400, 3, generator=torch.Generator().manual_seed(0), device="cpu")
    assert top.shape == ov.shape == (2, 3)
    assert float(top[0].mean()) == pytest.approx(rmt.mp_edges(1 / 3)[1], abs=0.05)
    assert float(top[1].mean()) == pytest.approx(float(rmt.spike_outlier(3.0, 1 / 3)), abs=0.15)
    assert float(ov[1].mean()) == pytest.approx(float(rmt.spike_overlap(3.0, 1 / 3)), abs=0.05)
    # dense reference for one replicate: same generator stream
    Z = torch.randn(3, 30, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    top2, ov2 = rmt.simulate_spike(torch.tensor([2.0]), 30, 6, 3, generator=torch.Generator().manual_seed(1))
    Sig_half = torch.diag(torch.tensor([math.sqrt(3.0), 1, 1, 1, 1, 1], dtype=F64))
    lam, Q = torch.linalg.eigh(Sig_half @ Z[0].T @ Z[0] @ Sig_half / 30)
    assert float(top2[0, 0]) == pytest.approx(float(lam[-1]))
    assert float(ov2[0, 0]) == pytest.approx(float(Q[0, -1] ** 2))


def test_spike_validation():
    with pytest.raises(ValueError, match="strength"):
        rmt.spike_outlier(-1.0, 0.5)
    with pytest.raises(ValueError, match="strength"):
        rmt.spike_overlap(torch.tensor([float("inf")]), 0.5)
    with pytest.raises(ValueError, match="strength"):
        rmt.simulate_spike(torch.ones(2, 2), 10, 4, 2)
    with pytest.raises(ValueError, match="d"):
        rmt.simulate_spike(torch.ones(2), 10, 1, 2)


def test_mp_validation():
    with pytest.raises(ValueError, match="gamma"):
        rmt.mp_edges(-0.5)
    with pytest.raises(TypeError, match="gamma"):
        rmt.mp_density(torch.ones(2), None)
    with pytest.raises(ValueError, match="x"):
        rmt.mp_cdf(torch.tensor([float("nan")]), 0.5)
    with pytest.raises(ValueError, match="z"):
        rmt.mp_stieltjes(torch.tensor(0.0), 2.0)
    with pytest.raises(ValueError, match="ratio"):
        rmt.mp_condition_number(1.0)
    with pytest.raises(ValueError, match="X"):
        rmt.sample_covariance_eigh(torch.ones(3))
    with pytest.raises(ValueError, match="x"):
        rmt.spectral_cdf(torch.ones(3), torch.ones(2, 2))


# ----------------------------------------------------------------------------------------------- Grassmannian
@FAST
@given(d=st.integers(4, 9), k=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_grassmann_geodesic_angles_grow_linearly(d, k, seed):
    gen = torch.Generator().manual_seed(seed)
    Q = linalg.random_orthogonal(d, generator=gen)[:, :k]
    H = torch.randn(d, k, generator=gen, dtype=F64)
    H = H - Q @ (Q.T @ H)
    H = H / torch.linalg.svdvals(H)[0] * 0.7  # largest angle speed 0.7 rad per unit time
    t = torch.tensor([0.3, 1.0, 2.0], dtype=F64)
    Y = rmt.grassmann_geodesic(Q, H, t)
    assert Y.shape == (3, d, k)
    for i, ti in enumerate(t.tolist()):
        torch.testing.assert_close(Y[i].T @ Y[i], torch.eye(k, dtype=F64))
        expected = (ti * torch.linalg.svdvals(H)).flip(0)
        torch.testing.assert_close(linalg.principal_angles(Q.T, Y[i].T), expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(rmt.grassmann_geodesic(Q, H, 0.0), Q)


def test_grassmann_geodesic_validation():
    Q = torch.eye(4, dtype=F64)[:, :2]
    with pytest.raises(ValueError, match="tangent"):
        rmt.grassmann_geodesic(Q, torch.ones(4, 2), 1.0)
    with pytest.raises(ValueError, match="orthonormal"):
        rmt.grassmann_geodesic(2 * Q, torch.zeros(4, 2), 1.0)
    with pytest.raises(ValueError, match="shape"):
        rmt.grassmann_geodesic(Q, torch.zeros(4, 3), 1.0)
    with pytest.raises(ValueError, match="t"):
        rmt.grassmann_geodesic(Q, torch.zeros(4, 2), torch.ones(2, 2))


def test_batched_eigensolvers_restore_the_thread_setting():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rmt.sample_covariance_eigh(randn(3, 20, 5), vectors=True)
        rmt.simulate_condition_number(20, 5, 3, device="cpu")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_leave_one_out_statistics_dense():
    """tau_hat = lam (1 + tr(Sigma R)/n) and delta_i = x_i^T R_{-i} x_i / n against explicit inverses."""
    g = torch.Generator().manual_seed(3)
    s = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.1], dtype=torch.float64)
    X = torch.randn(2, 9, 5, generator=g, dtype=torch.float64) * s.sqrt()
    lam = torch.tensor([0.05, 1.0], dtype=torch.float64)
    out = rmt.leave_one_out_statistics(X, lam, s)
    assert out.tau_hat.shape == (2, 2) and out.delta_rows.shape == (2, 2, 9)
    for r in range(2):
        S = X[r].T @ X[r] / 9
        for j, l in enumerate(lam.tolist()):
            R = torch.linalg.inv(S + l * torch.eye(5, dtype=torch.float64))
            assert float(out.tau_hat[r, j]) == pytest.approx(l * (1 + float(torch.trace(torch.diag(s) @ R)) / 9), rel=1e-10)
            for i in range(9):
                x = X[r, i]
                R_i = torch.linalg.inv(S - torch.outer(x, x) / 9 + l * torch.eye(5, dtype=torch.float64))
                assert float(out.delta_rows[r, j, i]) == pytest.approx(float(x @ R_i @ x) / 9, rel=1e-9)
    with pytest.raises(ValueError, match="lam_G"):
        rmt.leave_one_out_statistics(X, torch.tensor([0.0]), s)
    with pytest.raises(ValueError, match="eigenvalues"):
        rmt.leave_one_out_statistics(X, lam, s[:3])
