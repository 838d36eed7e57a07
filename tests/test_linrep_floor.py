"""K-FAC's noise floors (chapter 10): the per-step variances against Monte Carlo, the tangent statistic against
principal angles, and bad inputs."""

import math

import pytest
import torch

from curvlab import linrep as L

D64 = torch.float64


def _problem(S=4, d=6, k=2, d_y=3, noise=0.5, seed=0):
    return L.linrep_problem(S, d=d, k=k, d_y=d_y, kappa_x=10.0, kappa_F=2.0, noise=noise, seed=seed)


def test_fixed_head_variance_matches_monte_carlo():
    """E||M N^T X (X^T X)^{-1} Pi||^2 by direct sampling of Gaussian batches (not through sample_moments)."""
    p, n, R = _problem(), 20, 4000
    g = torch.Generator().manual_seed(1)
    F0 = torch.randn(p.Fstar.shape, generator=g, dtype=D64)
    M = torch.linalg.solve(F0.mT @ F0, F0.mT)                          # (S, k, d_y)
    Pi = L.perp_projector(p.Gstar)
    X = torch.randn(R, *p.Sigma.shape[:1], n, p.d, generator=g, dtype=D64) @ p.Sigma_half
    N = p.noise * torch.randn(R, p.n_seeds, n, p.d_y, generator=g, dtype=D64)
    xi = M @ N.mT @ X @ torch.linalg.inv(X.mT @ X) @ Pi
    v = xi.square().sum((-2, -1))                                         # (R, S)
    pred = L.floor_variance_fixed_head(F0, p.Gstar, p.Sigma, p.noise, n)
    se = v.std(0) / math.sqrt(R)
    assert ((v.mean(0) - pred).abs() < 4 * se).all()


def test_tangent_norm2_is_sum_of_tan2_of_principal_angles():
    p = _problem(S=3)
    g = torch.Generator().manual_seed(2)
    G = 1.7 * p.Gstar + 0.3 * torch.randn(p.Gstar.shape, generator=g, dtype=D64)
    Q = torch.linalg.qr(G.mT).Q                                           # orthonormal basis of rowsp G
    cos = torch.linalg.svdvals(p.Gstar @ Q)
    ref = (1 / cos**2 - 1).sum(-1)
    assert torch.allclose(L.tangent_norm2(G, p.Gstar), ref, rtol=1e-10)
    C = torch.randn(3, 2, 2, generator=g, dtype=D64)                      # invariant to G -> C G
    assert torch.allclose(L.tangent_norm2(C @ G, p.Gstar), ref, rtol=1e-8)


def test_refit_head_floor_by_simulation():
    """Small noise, re-fitted head, eta = 1: the stationary E||Z||^2 over eta/(2-eta) v is 1 within Monte Carlo error."""
    p, n, T = _problem(S=48, d=6, k=1, d_y=3, noise=0.1, seed=3), 24, 160
    g = torch.Generator().manual_seed(4)
    st, acc = L.LinRepState(F=None, G=p.Gstar.clone()), []
    for t in range(T):
        Sxx, Syx = p.sample_moments(n, g)
        st = L.kfac_update(p, st, {"Sxx": Sxx, "Syx": Syx}, dict(eta_G=1.0))
        if t >= T // 4:
            acc.append(L.tangent_norm2(st.G, p.Gstar))
    r = torch.stack(acc, -1).mean(-1) / L.noise_floor(1.0, L.floor_variance_refit_head(p.Fstar, p.Gstar, p.Sigma, p.noise, n))
    assert abs(float(r.mean()) - 1) < 4 * float(r.std()) / math.sqrt(p.n_seeds)


def test_floor_bad_inputs():
    p = _problem()
    with pytest.raises(ValueError, match="n must exceed"):
        L.floor_variance_fixed_head(p.Fstar, p.Gstar, p.Sigma, 0.5, p.d + 1)
    with pytest.raises(ValueError, match="F0 must have k"):
        L.floor_variance_fixed_head(p.Fstar[..., :1], p.Gstar, p.Sigma, 0.5, 20)
    with pytest.raises(ValueError, match="Sigma must be"):
        L.floor_variance_refit_head(p.Fstar, p.Gstar, p.Sigma[..., :3, :3], 0.5, 20)
    with pytest.raises(ValueError, match="noise"):
        L.floor_variance_refit_head(p.Fstar, p.Gstar, p.Sigma, -1.0, 20)
    with pytest.raises(ValueError, match="G must have"):
        L.tangent_norm2(p.Gstar[..., :3], p.Gstar)
