"""Tests for curvlab.linrep: dense / autograd / Monte Carlo references on small problems, and bad input."""

import math

import pytest
import torch

from curvlab import curvature, linalg
from curvlab import linrep as L



@pytest.fixture(autouse=True)
def _float64_default():
    """These tests build tensors in float64; restore the default afterwards so other test files are unaffected."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _problem(S=3, d=7, k=2, d_y=4, kappa_x=20.0, kappa_F=3.0, noise=0.0, **kw):
    return L.linrep_problem(S, d=d, k=k, d_y=d_y, kappa_x=kappa_x, kappa_F=kappa_F, noise=noise, seed=3, **kw)


def _gen(s=0):
    return torch.Generator().manual_seed(s)


# ------------------------------------------------------------------------------------------------ problem
def test_problem_structure():
    P = _problem(transfer_kappa=5.0)
    S, d, k, d_y = 3, 7, 2, 4
    assert P.Fstar.shape == (S, d_y, k) and P.Gstar.shape == (S, k, d) and P.Sigma.shape == (S, d, d)
    assert torch.allclose(P.Gstar @ P.Gstar.transpose(-2, -1), torch.eye(k).expand(S, k, k), atol=1e-12)
    assert torch.allclose(P.Sigma_half @ P.Sigma_half, P.Sigma, atol=1e-10)
    ev = torch.linalg.eigvalsh(P.Sigma)
    assert torch.allclose(ev[:, -1] / ev[:, 0], torch.full((S,), 20.0), rtol=1e-8)
    sv = torch.linalg.svdvals(P.Fstar)
    assert torch.allclose(sv[:, 0] / sv[:, -1], torch.full((S,), 3.0), rtol=1e-8)
    evT = torch.linalg.eigvalsh(P.Sigma_T)
    assert torch.allclose(evT[:, -1] / evT[:, 0], torch.full((S,), 5.0), rtol=1e-8)
    Pa = _problem(basis="aligned")
    assert torch.allclose(Pa.Sigma, torch.diag_embed(torch.diagonal(Pa.Sigma, dim1=-2, dim2=-1)))
    P0 = _problem()
    assert torch.allclose(P0.Sigma_T, torch.eye(d).expand(S, d, d))        # isotropic transfer by default


@pytest.mark.parametrize("x_dist", ["gaussian", "rademacher"])
def test_sample_moments_monte_carlo(x_dist):
    P = _problem(S=2, d=5, noise=0.3, x_dist=x_dist)
    X, Y = P.sample(40000, _gen(1))
    assert X.shape == (2, 40000, 5) and Y.shape == (2, 40000, 4)
    Sxx = X.transpose(-2, -1) @ X / X.shape[1]
    assert (Sxx - P.Sigma).abs().max() < 6 * P.Sigma.abs().max() * math.sqrt(2 / 40000) * 3
    R = Y - X @ (P.Fstar @ P.Gstar).transpose(-2, -1)
    assert abs(float(R.std()) - 0.3) < 0.01
    if x_dist == "rademacher":                        # x = Sigma^{1/2} z with z in {+-1}^d
        Z = torch.linalg.solve(P.Sigma_half, X.transpose(-2, -1))
        assert torch.allclose(Z.abs(), torch.ones_like(Z), atol=1e-8)
    Xt, _ = P.sample(20000, _gen(2), transfer=True)
    assert (Xt.transpose(-2, -1) @ Xt / 20000 - P.Sigma_T).abs().max() < 0.1


@pytest.mark.parametrize("x_dist", ["gaussian", "rademacher"])
@pytest.mark.parametrize("noise", [0.0, 0.4])
@pytest.mark.parametrize("transfer", [False, True])
@pytest.mark.parametrize("n", [33, 5])                   # n >= d: the Z^T Z route; n < d: through sample()
def test_sample_moments_equal_moments_of_sample(x_dist, noise, transfer, n):
    """The fast path of run(): the moments of the very batch sample() draws from the same generator state,
    to rounding (float64: a few ulps of the largest entry)."""
    P = _problem(S=3, d=9, k=3, d_y=5, noise=noise, x_dist=x_dist, transfer_kappa=7.0)
    X, Y = P.sample(n, _gen(8), transfer=transfer)
    want = L.batch_moments({"X": X, "Y": Y})
    got = P.sample_moments(n, _gen(8), transfer=transfer)
    for w, g in zip(want, got):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= 64 * torch.finfo(w.dtype).eps * w.abs().max()
    different = P.sample_moments(n, _gen(9), transfer=transfer)[0]         # it does depend on the draws
    assert (different - want[0]).abs().max() > 1e-3 * want[0].abs().max()


def test_random_bits_are_fair_and_independent():
    """31 bits per generator draw: mean 1/2 and pairwise-uncorrelated bits, including bits of one word (adjacent
    positions) and across word boundaries, within 5 standard errors."""
    n, m = 40_000, 62                                     # a row spans exactly two 31-bit words
    R = L._random_bits((n, m), _gen(4), "cpu", torch.float64)
    assert set(R.unique().tolist()) == {0.0, 1.0}
    se = 0.5 / math.sqrt(n)
    assert (R.mean(0) - 0.5).abs().max() < 5 * se
    Z = 2 * R - 1
    C = Z.T @ Z / n                                       # entries ~ N(0, 1/n) off the diagonal
    off = C - torch.eye(m)
    assert off.abs().max() < 5 / math.sqrt(n)
    foil = torch.cat([Z[:, :1], Z[:, :1]], 1)            # a check that can fail: a repeated bit is caught
    assert (foil.T @ foil / n - torch.eye(2)).abs().max() > 5 / math.sqrt(n)


def test_population_batch_and_select():
    P = _problem()
    pop = P.population_batch()
    assert torch.allclose(pop["Syx"], P.Fstar @ P.Gstar @ P.Sigma)
    P1 = P.select(1)
    assert P1.n_seeds == 1 and torch.equal(P1.Fstar[0], P.Fstar[1])


# ------------------------------------------------------------------------------------------------ heads, grads
def test_fit_head_matches_lstsq_and_gradients_match_autograd():
    P = _problem()
    X, Y = P.sample(30, _gen(4))
    G = torch.randn(3, 2, 7, generator=_gen(5))
    F = L.fit_head(G, X, Y)
    Z = X @ G.transpose(-2, -1)
    F_ref = torch.linalg.lstsq(Z, Y).solution.transpose(-2, -1)
    assert torch.allclose(F, F_ref, atol=1e-10)
    Fr = L.fit_head(G, X, Y, lam=0.5)                 # ridge: (Z^T Z/n + lam I) F^T = Z^T Y/n
    lhs = (Z.transpose(-2, -1) @ Z / 30 + 0.5 * torch.eye(2)) @ Fr.transpose(-2, -1)
    assert torch.allclose(lhs, Z.transpose(-2, -1) @ Y / 30, atol=1e-10)
    F0 = torch.randn(3, 4, 2, generator=_gen(6)).requires_grad_()
    G0 = G.clone().requires_grad_()
    L.loss(F0, G0, X, Y).sum().backward()
    Sxx, Syx = L.batch_moments({"X": X, "Y": Y})
    assert torch.allclose(G0.grad, L.grad_G(F0.detach(), G, Sxx, Syx), atol=1e-10)
    assert torch.allclose(F0.grad, L.grad_F(F0.detach(), G, Sxx, Syx), atol=1e-10)
    assert torch.allclose(L.train_loss(F0.detach(), G, X, Y), L.loss(F0.detach(), G, X, Y))


def test_ls_head_is_one_unit_kfac_step_on_F():
    P = _problem()
    X, Y = P.sample(25, _gen(7))
    G, F = torch.randn(3, 2, 7, generator=_gen(8)), torch.randn(3, 4, 2, generator=_gen(9))
    Sxx, Syx = L.batch_moments({"X": X, "Y": Y})
    step = L._right_solve(L.grad_F(F, G, Sxx, Syx), G @ Sxx @ G.transpose(-2, -1))
    assert torch.allclose(F - step, L.fit_head(G, X, Y), atol=1e-9)


def test_kfac_factors_are_the_gn_block_and_kfac_matches_dense():
    P = _problem(S=1, d=5, k=2, d_y=3)
    X, Y = P.sample(11, _gen(10))
    F, G = torch.randn(3, 2, generator=_gen(11)), torch.randn(2, 5, generator=_gen(12))
    model = lambda th: (X[0] @ th.reshape(2, 5).T @ F.T).reshape(-1)
    H = curvature.gn_matrix(model, G.reshape(-1), scale=1 / 11)
    Sxx = X[0].T @ X[0] / 11
    assert torch.allclose(H, linalg.kron(F.T @ F, Sxx), atol=1e-10)
    # the K-FAC update against the dense preconditioned step
    st = L.LinRepState(F=F[None], G=G[None])
    hp = dict(eta_G=0.4, lam_F=0.1, lam_G=0.2, f_variant="fixed")
    new = L.kfac_update(P, st, {"X": X, "Y": Y}, hp)
    g = L.grad_G(F[None], G[None], *L.batch_moments({"X": X, "Y": Y}))[0].reshape(-1)
    Pre = linalg.kron(F.T @ F + 0.1 * torch.eye(2), Sxx + 0.2 * torch.eye(5))
    ref = G.reshape(-1) - 0.4 * torch.linalg.solve(Pre, g)
    assert torch.allclose(new.G[0].reshape(-1), ref, atol=1e-10)
    assert torch.equal(new.F, st.F) and new.t == 1


def test_perp_identity_and_one_step_recovery_finite_sample():
    P = _problem(S=4, d=9, k=3, d_y=5, kappa_x=100.0)
    X, Y = P.sample(40, _gen(13))
    st = L.init_state(P, _gen(14))
    Pi = L.perp_projector(P.Gstar)
    for eta in (0.3, 1.0):
        new = L.kfac_update(P, st, {"X": X, "Y": Y}, dict(eta_G=eta))
        assert (new.G @ Pi - (1 - eta) * st.G @ Pi).abs().max() < 1e-9
    assert L.subspace_distance(new.G, P.Gstar).max() < 1e-10


def test_other_updates_against_formulas():
    P = _problem()
    X, Y = P.sample(50, _gen(15))
    X2, Y2 = P.sample(50, _gen(16))
    st = L.init_state(P)
    b = {"X": X, "Y": Y, "X2": X2, "Y2": Y2}
    Sxx, Syx = L.batch_moments(b)
    F1 = L.fit_head(st.G, X, Y)
    F2 = L.fit_head(st.G, X2, Y2)
    new = L.amgd_update(P, st, b, dict(eta_G=0.1))
    assert torch.allclose(new.G, st.G - 0.1 * L.grad_G(F1, st.G, Sxx, Syx)) and torch.allclose(new.F, F1)
    new = L.dfw_update(P, st, b, dict(eta_G=0.1))
    assert torch.allclose(new.G, st.G - 0.1 * L.grad_G(F2, st.G, Sxx, Syx) @ torch.linalg.inv(Sxx), atol=1e-10)
    new = L.sgd_update(P, st, b, dict(eta_G=0.1, eta_F=0.2))
    assert torch.allclose(new.G, st.G - 0.1 * L.grad_G(st.F, st.G, Sxx, Syx))
    assert torch.allclose(new.F, st.F - 0.2 * L.grad_F(st.F, st.G, Sxx, Syx))
    new = L.amgd_update(P, st, b, dict(eta_G=0.5, normalize_step=True, orthonormalize=True))
    eta = 0.5 / (torch.linalg.matrix_norm(F1, ord=2) ** 2 * torch.linalg.eigvalsh(Sxx)[:, -1])
    G_ref = st.G - eta[:, None, None] * L.grad_G(F1, st.G, Sxx, Syx)
    assert torch.allclose(new.G @ new.G.transpose(-2, -1), torch.eye(2).expand(3, 2, 2), atol=1e-12)
    assert torch.allclose(new.F @ new.G, F1 @ G_ref, atol=1e-10)


# ------------------------------------------------------------------------------------------------ metrics
def test_subspace_distance_matches_principal_angles():
    G, Gs = torch.randn(4, 3, 8, generator=_gen(17)), L._orthonormal_rows(4, 3, 8, _gen(18))
    assert torch.allclose(L.subspace_distance(G, Gs), linalg.sin_theta_distance(G, Gs), atol=1e-12)
    assert torch.allclose(L.subspace_distance(G, Gs, "fro"), linalg.sin_theta_distance(G, Gs, "fro"), atol=1e-12)
    R = torch.randn(4, 3, 3, generator=_gen(19))
    assert L.subspace_distance(R @ Gs, Gs).max() < 1e-12


def test_representation_and_transfer_loss():
    P = _problem(transfer_kappa=10.0, noise=0.1)
    G = torch.randn(3, 2, 7, generator=_gen(20))
    # best head in population = head_from_moments with population moments; loss = excess risk there
    for tr in (False, True):
        pop = P.population_batch(transfer=tr)
        F = L.head_from_moments(G, pop["Sxx"], pop["Syx"])
        assert torch.allclose(L.representation_loss(G, P, transfer=tr), L.excess_risk(F, G, P, transfer=tr))
        Fp = F + 0.01 * torch.randn(F.shape, generator=_gen(21))
        assert (L.excess_risk(Fp, G, P, transfer=tr) > L.representation_loss(G, P, transfer=tr)).all()
    closed = L.transfer_loss(G, P)
    fs = torch.stack([L.transfer_loss(G, P, closed_form=False, n=400, generator=_gen(s)) for s in range(20)])
    assert (fs >= closed - 1e-12).all()
    # well-specified G = R G*: closed form 0, LS excess = sigma^2 d_y k / (2 (n - k - 1)) for Gaussian x
    Gw = torch.randn(3, 2, 2, generator=_gen(30)) @ P.Gstar
    assert L.transfer_loss(Gw, P).max() < 1e-20
    fw = torch.stack([L.transfer_loss(Gw, P, closed_form=False, n=400, generator=_gen(s)) for s in range(40)])
    ratio = float(fw.mean() / (0.01 * 4 * 2 / (2 * (400 - 3))))
    assert 0.8 < ratio < 1.2
    assert L.representation_loss(P.Gstar, P).max() < 1e-24


def test_schur_curvature_matches_finite_difference_jacobian():
    P = _problem(S=2, d=6, k=2, d_y=3, kappa_x=30.0, kappa_F=2.0)
    Gs, pop = P.Gstar, P.population_batch()
    S, U = L.schur_complement(Gs, P.Sigma)
    Sig_p = U @ P.Sigma @ U.transpose(-2, -1)
    Qb = Gs
    S_ref = Sig_p - U @ P.Sigma @ Qb.transpose(-2, -1) @ torch.linalg.solve(
        Qb @ P.Sigma @ Qb.transpose(-2, -1), Qb @ P.Sigma @ U.transpose(-2, -1))
    assert torch.allclose(S, S_ref, atol=1e-9)
    H = L.schur_curvature(P.Fstar, Gs, P.Sigma)
    eta = 0.3 / float(torch.linalg.eigvalsh(H)[..., -1].max())
    hp = dict(eta_G=eta)
    step = lambda G: L.amgd_update(P, L.LinRepState(P.Fstar, G), pop, hp).G
    J = L.perp_jacobian(step, Gs, U, h=1e-5)
    ref = torch.eye(H.shape[-1]) - eta * H
    assert (J - ref).abs().max() < 1e-7
    rate = L.linearised_rate(H, eta)
    assert torch.allclose(rate, torch.linalg.eigvals(J).abs().amax(-1), atol=1e-7)
    ev = torch.linalg.eigvalsh(H)
    kap = ev[:, -1] / ev[:, 0]
    assert torch.allclose(L.linearised_rate(H, L.optimal_step(H)[:, None]).squeeze(-1) if False else
                          torch.stack([L.linearised_rate(H[i], L.optimal_step(H[i])) for i in range(2)]),
                          (kap - 1) / (kap + 1), atol=1e-12)


def test_noise_floor_formula():
    assert torch.allclose(L.noise_floor(torch.tensor([0.5, 1.0]), 2.0), torch.tensor([2 / 3, 2.0]))
    # simulate the scalar recursion
    g = _gen(22)
    e = torch.zeros(20000)
    acc = []
    for t in range(400):
        e = 0.5 * e + 0.5 * torch.randn(20000, generator=g)
        if t > 50:
            acc.append(float(e.square().mean()))
    assert abs(sum(acc) / len(acc) - 1 / 3) < 0.01


# ------------------------------------------------------------------------------------------------ run
def test_run_shapes_population_and_batched_vs_looped():
    P = _problem(S=3)
    out = L.run("K-FAC", P, 10, 40, dict(eta_G=0.5), record_every=3)
    for key in ("subspace_distance", "train_loss", "transfer_loss", "risk", "step"):
        assert out[key].shape == (3, 5)
    assert out["step"][0].tolist() == [0, 3, 6, 9, 10]
    pop = L.run("K-FAC", P, 30, None, dict(eta_G=0.5))
    ratio = pop["subspace_distance"][:, -1] / pop["subspace_distance"][:, -2]
    assert torch.allclose(ratio, torch.full((3,), 0.5), atol=1e-3)
    init = L.init_state(P)
    a = L.run("AMGD", P, 20, None, dict(eta_G=0.05), init=init)
    b = L.run_looped("AMGD", P, 20, None, dict(eta_G=0.05), init=init)
    assert torch.allclose(a["subspace_distance"], b["subspace_distance"], atol=1e-12)
    c = L.run_looped("DFW", P, 5, 40, dict(eta_G=0.5))
    assert c["subspace_distance"].shape == (3, 6)


def test_register_update():
    def noop(problem, state, batch, hp):
        return L.LinRepState(state.F, state.G, state.t + 1)
    L.register_update("Muon", noop)
    out = L.run("Muon", _problem(), 3, 10, dict(eta_G=1.0))
    assert torch.allclose(out["subspace_distance"][:, 0], out["subspace_distance"][:, -1])
    del L.UPDATES["Muon"]
    with pytest.raises(ValueError, match="name"):
        L.register_update("not-a-method", noop)
    with pytest.raises(TypeError, match="fn"):
        L.register_update("Adam", 3)


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input():
    P = _problem()
    with pytest.raises(ValueError, match="k must be <= d"):
        L.linrep_problem(1, d=3, k=4, d_y=5, kappa_x=2.0)
    with pytest.raises(ValueError, match="k must be <= d_y"):
        L.linrep_problem(1, d=6, k=4, d_y=3, kappa_x=2.0)
    with pytest.raises(ValueError, match="kappa_x"):
        L.linrep_problem(1, d=6, k=2, d_y=3, kappa_x=-2.0)
    with pytest.raises(ValueError, match="noise"):
        L.linrep_problem(1, d=6, k=2, d_y=3, kappa_x=2.0, noise=-1.0)
    with pytest.raises(ValueError, match="x_dist"):
        L.linrep_problem(1, d=6, k=2, d_y=3, kappa_x=2.0, x_dist="uniform")
    bad = P.Sigma.clone()
    bad[:, 0, 0] = -5.0
    from dataclasses import replace
    with pytest.raises(ValueError, match="Sigma"):
        replace(P, Sigma=bad)
    with pytest.raises(ValueError, match="Sigma"):
        replace(P, Sigma=P.Sigma[:, :-1, :-1])
    with pytest.raises(ValueError, match="Sigma"):
        L.schur_complement(P.Gstar, -P.Sigma)
    X, Y = P.sample(10, _gen(0))
    X[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="X"):
        L.fit_head(P.Gstar, X, Y)
    with pytest.raises(ValueError, match="Y"):
        L.fit_head(P.Gstar, X.nan_to_num(), Y[:, :5])
    with pytest.raises(ValueError, match="lam"):
        L.fit_head(P.Gstar, X.nan_to_num(), Y, lam=-1.0)
    with pytest.raises(ValueError, match="eta_G"):
        L.run("K-FAC", P, 3, 10, dict(eta_G=-0.1))
    with pytest.raises(ValueError, match="eta_G"):
        L.run("K-FAC", P, 3, 10, dict())
    with pytest.raises(ValueError, match="lam_G"):
        L.run("K-FAC", P, 3, 10, dict(eta_G=0.1, lam_G=-1e-3))
    with pytest.raises(ValueError, match="lam_F"):
        L.kfac_update(P, L.init_state(P), P.population_batch(), dict(eta_G=0.1, lam_F=-1.0))
    with pytest.raises(ValueError, match="n_steps"):
        L.run("K-FAC", P, -1, 10, dict(eta_G=0.1))
    with pytest.raises(ValueError, match="batch_size"):
        L.run("K-FAC", P, 2, 0, dict(eta_G=0.1))
    with pytest.raises(ValueError, match="f_variant"):
        L.run("K-FAC", P, 2, 10, dict(eta_G=0.1, f_variant="magic"))
    with pytest.raises(ValueError, match="method"):
        L.run("Nope", P, 2, 10, dict(eta_G=0.1))
    with pytest.raises(TypeError, match="hp"):
        L.run("K-FAC", P, 2, 10, [0.1])
    with pytest.raises(TypeError, match="eta_G"):
        L.run("K-FAC", P, 2, 10, dict(eta_G="big"))
    with pytest.raises(ValueError, match="kind"):
        L.subspace_distance(P.Gstar, P.Gstar, kind="cos")
    with pytest.raises(ValueError, match="G"):
        L.representation_loss(P.Gstar[:, :1], P)
    with pytest.raises(ValueError, match="n"):
        L.transfer_loss(P.Gstar, P, closed_form=False)
    with pytest.raises(ValueError, match="eta"):
        L.noise_floor(2.5, 1.0)
    with pytest.raises(ValueError, match="eta"):
        L.linearised_rate(torch.eye(3), -1.0)


def test_fitted_rate_per_seed_steps_and_orthonormalize():
    t = torch.arange(0, 60, dtype=torch.float64)
    D = torch.stack([0.3 * 0.8**t, 2.0 * 0.5**t])
    rate, se, drift = L.fitted_rate(D, t)
    assert torch.allclose(rate, torch.tensor([0.8, 0.5]), atol=1e-10) and (se < 1e-8).all() and (drift < 1e-8).all()
    with pytest.raises(ValueError, match="steps"):
        L.fitted_rate(D, t[:10])
    P = _problem(S=2)
    etas = torch.tensor([0.2, 0.6])                      # per-seed step sizes
    out = L.run("K-FAC", P, 80, None, dict(eta_G=etas))
    r, _, _ = L.fitted_rate(out["subspace_distance"], out["step"][0], min_step=10)
    assert torch.allclose(r, 1 - etas, atol=1e-4)
    st0 = L.init_state(P)
    pn = out["perp_norm2"]
    assert torch.allclose(pn[:, 1], (1 - etas) ** 2 * pn[:, 0], rtol=1e-8)   # the identity, squared
    out2 = L.run("AMGD", P, 5, 30, dict(eta_G=0.3, normalize_step=True, orthonormalize=True))
    G = out2["final_G"]
    assert torch.allclose(G @ G.mT, torch.eye(2).expand(2, 2, 2), atol=1e-12)
    with pytest.raises(ValueError, match="eta_G"):
        L.run("K-FAC", P, 2, None, dict(eta_G=torch.tensor([0.2, -0.1])))
    assert st0.G.shape == (2, 2, 7)


# ------------------------------------------------------------------------------------------------ finite-sample K-FAC
def _refit_kfac_tangent(P, Z, Sxx, Syx, eta):
    """Reference: the K-FAC step written out from the chapter's update rule, then the tangent by angles."""
    G = P.Gstar + Z
    F = Syx @ G.mT @ torch.linalg.inv(G @ Sxx @ G.mT)
    grad = F.mT @ (F @ G @ Sxx - Syx)
    G1 = G - eta * torch.linalg.inv(F.mT @ F) @ grad @ torch.linalg.inv(Sxx)
    return G1


def test_tangent_matches_principal_angles():
    P = _problem()
    G = P.Gstar + 0.3 * torch.randn(P.Gstar.shape, generator=_gen(), dtype=torch.float64)
    A = torch.randn(3, 2, 2, generator=_gen(1), dtype=torch.float64) + 2 * torch.eye(2)
    Z = L.tangent(A @ G, P.Gstar)                                  # invariant under G -> A G
    assert torch.allclose(Z, L.tangent(G, P.Gstar), atol=1e-10)
    assert (Z @ P.Gstar.mT).abs().max() < 1e-12
    tan = torch.linalg.matrix_norm(Z, ord=2)
    sin = L.subspace_distance(G, P.Gstar)
    assert torch.allclose(tan / (1 + tan**2).sqrt(), sin, atol=1e-10)
    assert torch.allclose(Z.square().sum((-2, -1)), L.tangent_norm2(G, P.Gstar), rtol=1e-10)


def test_exact_tangent_map_against_the_update_rule():
    P = _problem(noise=0.3)
    Z = 0.2 * torch.randn(P.Gstar.shape, generator=_gen(), dtype=torch.float64) @ L.perp_projector(P.Gstar)
    Sxx, Syx = P.sample_moments(40, _gen(2))
    G1 = _refit_kfac_tangent(P, Z, Sxx, Syx, 0.4)
    lib = L.kfac_update(P, L.LinRepState(None, P.Gstar + Z), {"Sxx": Sxx, "Syx": Syx}, dict(eta_G=0.4)).G
    assert torch.allclose(lib, G1, atol=1e-10)
    D, K = L.kfac_forcing(Z, P.Gstar, Sxx, Syx), L.kfac_coupling(Sxx, P.Gstar, Z)
    assert torch.allclose(L.tangent(G1, P.Gstar), L.kfac_tangent_step(Z, D, K, 0.4), atol=1e-10)
    assert (D @ P.Gstar.mT).abs().max() < 1e-12 and D.abs().max() > 1e-3
    Sxx0, Syx0 = Sxx, P.Fstar @ P.Gstar @ Sxx                     # noiseless moments of the same batch
    assert L.kfac_forcing(Z, P.Gstar, Sxx0, Syx0).abs().max() < 1e-10
    # the coupling at Z = 0 is the regression coefficient of the perp coordinates on the parallel ones
    _, U = L.schur_complement(P.Gstar, Sxx)
    K0 = L.kfac_coupling(Sxx, P.Gstar, torch.zeros_like(Z))
    reg = (U @ Sxx @ P.Gstar.mT) @ torch.linalg.inv(P.Gstar @ Sxx @ P.Gstar.mT)
    assert torch.allclose(U @ K0, reg, atol=1e-10)


def test_one_step_bound_holds_and_is_inf_outside_locality():
    P = _problem(noise=0.2)
    Z = 0.1 * torch.randn(P.Gstar.shape, generator=_gen(4), dtype=torch.float64) @ L.perp_projector(P.Gstar)
    Sxx, Syx = P.sample_moments(60, _gen(5))
    D, K = L.kfac_forcing(Z, P.Gstar, Sxx, Syx), L.kfac_coupling(Sxx, P.Gstar, Z)
    tan1 = torch.linalg.matrix_norm(L.kfac_tangent_step(Z, D, K, 0.5), ord=2)
    bound, ell = L.kfac_one_step_bound(torch.linalg.matrix_norm(Z, ord=2), torch.linalg.matrix_norm(D, ord=2),
                                       torch.linalg.matrix_norm(K, ord=2), 0.5)
    assert bool((ell < 1).all()) and bool((tan1 <= bound + 1e-12).all())
    b, e = L.kfac_one_step_bound(torch.tensor([0.5, 2.0]), 0.0, torch.tensor([1.0, 1.0]), 0.5)
    assert math.isfinite(float(b[0])) and math.isinf(float(b[1])) and torch.allclose(e, torch.tensor([0.5, 2.0]))


def test_noiseless_rank_one_ratio_and_spread_monte_carlo():
    one = L.linrep_problem(1, d=8, k=2, d_y=3, kappa_x=50.0, kappa_F=2.0, seed=11)
    Gs, Sig = one.Gstar[0], one.Sigma[0]
    p, q, r = L.canonical_direction(Sig, Gs)
    assert 0 < float(r) <= 49 / 51 + 1e-12 and abs(float(q @ Gs.mT @ torch.ones(2))) < 1e-12
    qKp = float(q @ L.kfac_coupling(Sig, Gs, torch.zeros_like(Gs)) @ p)
    assert qKp > 0
    s, eta, n, R = -0.05 / qKp, 0.5, 60, 3000
    Z = s * torch.outer(p, q)
    rep = L.replicas(one, R)
    Sxx, Syx = rep.sample_moments(n, _gen(6))
    G1 = L.kfac_update(rep, L.LinRepState(None, (Gs + Z).expand(R, 2, 8)), {"Sxx": Sxx, "Syx": Syx},
                       dict(eta_G=eta)).G
    ratio = torch.linalg.matrix_norm(L.tangent(G1, Gs), ord=2) / abs(s)
    chi = s * (q @ L.kfac_coupling(Sxx, Gs, Z) @ p)
    assert torch.allclose(ratio, (1 - eta) / (1 + eta * chi).abs(), atol=1e-10)
    pred = L.kfac_ratio_spread(Sig, Gs, p, q, s, eta, n)
    assert abs(float(ratio.std()) / float(pred) - 1) < 0.1          # Monte Carlo, 3000 batches: SE about 1.3 %


def test_noise_bound_and_floor_agree_in_mean():
    one = L.linrep_problem(1, d=6, k=2, d_y=3, kappa_x=10.0, kappa_F=2.0, seed=12)
    R, n, sig = 2000, 200, 0.1
    rep = L.replicas(one, R, noise=sig)
    assert rep.noise == sig and rep.n_seeds == R and torch.equal(rep.Sigma[5], one.Sigma[0])
    Sxx, Syx = rep.sample_moments(n, _gen(7))
    D = L.kfac_forcing(torch.zeros_like(rep.Gstar), rep.Gstar, Sxx, Syx)
    v = L.floor_variance_refit_head(one.Fstar[0], one.Gstar[0], one.Sigma[0], sig, n)
    assert abs(float(D.square().sum((-2, -1)).mean() / v) - 1) < 0.1
    nu = L.kfac_noise_bound(one.Fstar[0], one.Sigma[0], n, sig, 0.05)
    assert float((torch.linalg.matrix_norm(D, ord=2) > nu).double().mean()) <= 0.05


def test_fitted_exponent_on_a_power_law():
    x = torch.tensor([10.0, 20.0, 40.0, 80.0, 160.0])
    noise = 1 + 0.01 * torch.randn(500, 5, generator=_gen(8), dtype=torch.float64)
    a, se, drift = L.fitted_exponent(x, 3 * x**-0.5 * noise)
    assert abs(a + 0.5) < 5 * se + 1e-3 and se < 0.01 and drift < 0.02


def test_finite_sample_bad_input():
    P = _problem()
    Gs, Sig = P.Gstar[0], P.Sigma[0]
    with pytest.raises(ValueError, match="Z"):
        L.kfac_coupling(Sig, Gs, Gs.clone())                        # rows not in the complement
    with pytest.raises(ValueError, match="Sxx"):
        L.kfac_coupling(torch.eye(3), Gs, torch.zeros_like(Gs))
    with pytest.raises(ValueError, match="eta"):
        L.kfac_tangent_step(torch.zeros_like(Gs), torch.zeros_like(Gs), torch.zeros(7, 2), 1.5)
    with pytest.raises(ValueError, match="Z and P"):
        L.kfac_tangent_step(torch.zeros_like(Gs), torch.zeros_like(Gs), torch.zeros(2, 7), 0.5)
    with pytest.raises(ValueError, match="n must satisfy"):
        L.kfac_noise_bound(P.Fstar[0], Sig, 10, 0.1, 0.1)
    with pytest.raises(ValueError, match="delta"):
        L.kfac_noise_bound(P.Fstar[0], Sig, 1000, 0.1, 1.5)
    with pytest.raises(ValueError, match="forcing"):
        L.kfac_one_step_bound(0.1, -1.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="one instance"):
        L.replicas(P, 4)
    with pytest.raises(TypeError, match="problem"):
        L.replicas("P", 4)
    with pytest.raises(ValueError, match="samples"):
        L.fitted_exponent(torch.ones(4), torch.ones(3, 5))
    with pytest.raises(ValueError, match="n must be whole"):
        L.kfac_ratio_spread(Sig, Gs, torch.ones(2) / 2**0.5, torch.zeros(7), 0.1, 0.5, 3)
    with pytest.raises(ValueError, match="k < d"):
        L.canonical_direction(torch.eye(2), torch.eye(2))


def test_finite_sample_functions_refuse_silent_inputs():
    """Issue 26: kfac_coupling, kfac_noise_bound and kfac_ratio_spread used to accept these without a word (a NaN or
    a wrong number came back): each error names the argument."""
    one = L.linrep_problem(1, d=8, k=2, d_y=3, kappa_x=50.0, kappa_F=2.0, seed=11)
    Gs, Sig, Fs = one.Gstar[0], one.Sigma[0], one.Fstar[0]
    p, q, _ = L.canonical_direction(Sig, Gs)
    Z0 = torch.zeros_like(Gs)
    with pytest.raises(ValueError, match="Gstar must have orthonormal rows"):
        L.kfac_coupling(Sig, 2 * Gs, Z0)                            # 1: a scaled G_star
    asym = Sig.clone()
    asym[0, 1] += 1.0
    with pytest.raises(ValueError, match="Sxx must be symmetric"):
        L.kfac_coupling(asym, Gs, Z0)                               # 2: a non-symmetric moment matrix
    indefinite = Sig - 2 * torch.linalg.eigvalsh(Sig)[0] * torch.eye(8, dtype=Sig.dtype)
    with pytest.raises(ValueError, match="Sigma must be positive"):
        L.kfac_noise_bound(Fs, indefinite, 1000, 0.1, 0.05)          # 3: was NaN (sqrt of a negative eigenvalue)
    with pytest.raises(ValueError, match="Fstar must have full column rank"):
        L.kfac_noise_bound(torch.zeros_like(Fs), Sig, 1000, 0.1, 0.05)   # 4: was inf
    with pytest.raises(ValueError, match="u must be a unit vector"):
        L.kfac_ratio_spread(Sig, Gs, 3 * p, q, 0.1, 0.5, 60)         # 5: the formula assumes unit vectors
    with pytest.raises(ValueError, match="v must be a unit vector"):
        L.kfac_ratio_spread(Sig, Gs, p, 0.5 * q, 0.1, 0.5, 60)
    with pytest.raises(ValueError, match="s contains"):
        L.kfac_ratio_spread(Sig, Gs, p, q, float("nan"), 0.5, 60)   # 6: a NaN step came back as NaN
    with pytest.raises(ValueError, match="Sigma must be symmetric"):
        L.kfac_ratio_spread(asym, Gs, p, q, 0.1, 0.5, 60)
    with pytest.raises(ValueError, match="Gstar must have orthonormal rows"):
        L.kfac_ratio_spread(Sig, 2 * Gs, p, q, 0.1, 0.5, 60)
    # valid inputs still go through, float32 batches included
    Sxx, _ = one.sample_moments(60, _gen(9))
    assert torch.isfinite(L.kfac_coupling(Sxx.float(), Gs, Z0)).all()
    assert float(L.kfac_noise_bound(Fs, Sig, 1000, 0.1, 0.05)) > 0


def test_coupling_direction_is_the_top_singular_pair_not_the_canonical_pair():
    """The slowest rank-one direction at fixed tan psi maximises |q^T C p|: the top singular pair of the population
    coupling (issue 23: the canonical pair is a different direction, with a smaller |q^T C p|)."""
    one = L.linrep_problem(1, d=20, k=3, d_y=6, kappa_x=1000.0, kappa_F=2.0, seed=7)
    Gs, Sig = one.Gstar[0], one.Sigma[0]
    u, v, sig = L.coupling_direction(Sig, Gs)
    C = L.kfac_coupling(Sig, Gs, torch.zeros_like(Gs))
    assert abs(float(v @ C @ u) - float(sig)) < 1e-10 and abs(float(sig) - float(torch.linalg.matrix_norm(C, ord=2))) < 1e-10
    assert float((v @ Gs.mT).abs().max()) < 1e-10 and abs(float(u.norm()) - 1) < 1e-12 and abs(float(v.norm()) - 1) < 1e-12
    p, q, _ = L.canonical_direction(Sig, Gs)
    assert float((q @ C @ p).abs()) < float(sig) - 0.1                   # 0.60 vs 1.76 here
    P = torch.randn(500, 3, generator=_gen(3), dtype=torch.float64)
    Q = torch.randn(500, 20, generator=_gen(4), dtype=torch.float64) @ L.perp_projector(Gs)
    P, Q = P / P.norm(dim=-1, keepdim=True), Q / Q.norm(dim=-1, keepdim=True)
    assert float(((Q @ C) * P).sum(-1).abs().max()) <= float(sig) + 1e-12
    with pytest.raises(ValueError, match="k < d"):
        L.coupling_direction(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="Sigma must be"):
        L.coupling_direction(torch.eye(5, dtype=torch.float64), Gs)
