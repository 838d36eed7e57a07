"""Tests for curvlab.precond: every update rule against a dense reference or the standard torch.optim optimiser,
the test problem against torch.func, and the bad-input errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import curvature, linalg
from curvlab import precond as P

F64 = torch.float64
dims = st.integers(min_value=1, max_value=4)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
FAST = settings(max_examples=15, deadline=None)


def randn(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def spd(n, seed=0, batch=(), shift=0.1):
    B = randn(*batch, n, n, seed=seed)
    return B @ B.transpose(-2, -1) / n + shift * torch.eye(n, dtype=F64)


def dense_power(A, p):
    return torch.from_numpy(np.real(scipy.linalg.fractional_matrix_power(A.numpy(), p)))


# ----------------------------------------------------------------------------------------------- psd_power
@FAST
@given(n=dims, seed=seeds, p=st.sampled_from([-1.0, -0.5, -0.25, 0.5, 2.0]))
def test_psd_power_matches_scipy(n, seed, p):
    A = spd(n, seed)
    torch.testing.assert_close(P.psd_power(A, p), dense_power(A, p), rtol=1e-8, atol=1e-10)


def test_psd_power_batched_dtype_and_errors():
    A = spd(3, batch=(2,)).float()
    out = P.psd_power(A, -0.5)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 3)
    singular = torch.diag(torch.tensor([1.0, 0.0], dtype=F64))
    torch.testing.assert_close(P.psd_power(singular, 0.5), singular)
    with pytest.raises(ValueError, match="singular"):
        P.psd_power(singular, -0.25)
    with pytest.raises(TypeError, match="exponent"):
        P.psd_power(spd(2), "half")
    with pytest.raises(ValueError, match="positive semi-definite"):
        P.psd_power(-spd(2), 0.5)


# ----------------------------------------------------------------------------------------------- NGD
@FAST
@given(p=dims, b=st.integers(1, 3), seed=seeds, lam=st.sampled_from([0.0, 0.3]))
def test_natural_gradient_step_is_a_damped_solve(p, b, seed, lam):
    F, g = spd(p, seed, batch=(b,)), randn(b, p, seed=seed + 1)
    expected = torch.linalg.solve(F + lam * torch.eye(p, dtype=F64), g.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(P.natural_gradient_step(g, F, lam), expected)


def test_natural_gradient_broadcasts_and_from_jacobian():
    F, g = spd(4), randn(3, 2, 4)  # one Fisher, a (3, 2) batch of gradients
    out = P.natural_gradient_step(g, F, 0.1)
    assert out.shape == (3, 2, 4)
    torch.testing.assert_close(out[1, 0], torch.linalg.solve(F + 0.1 * torch.eye(4, dtype=F64), g[1, 0]))
    J, r = randn(10, 4, seed=3), randn(10, seed=4)
    step = P.natural_gradient_from_jacobian(J, r, 0.05)
    torch.testing.assert_close(step, P.natural_gradient_step(J.T @ r / 10, J.T @ J / 10, 0.05))


def test_natural_gradient_errors():
    with pytest.raises(ValueError, match="fisher"):
        P.natural_gradient_step(randn(3), spd(4))
    with pytest.raises(ValueError, match="lam_GN"):
        P.natural_gradient_step(randn(2), spd(2), -1.0)
    with pytest.raises(ValueError, match="fisher"):
        P.natural_gradient_step(randn(2), torch.zeros(2, 2, dtype=F64), 0.0)
    with pytest.raises(ValueError, match="symmetric"):
        P.natural_gradient_step(randn(2), torch.tensor([[1.0, 2.0], [0.0, 1.0]], dtype=F64))


# ----------------------------------------------------------------------------------------------- K-FAC
def test_kfac_factors_are_batch_averages_of_outer_products():
    A, G = randn(2, 7, 3), randn(2, 7, 4, seed=1)
    C_out, C_in = P.kfac_factors(A, G)
    for b in range(2):
        torch.testing.assert_close(C_in[b], sum(torch.outer(a, a) for a in A[b]) / 7)
        torch.testing.assert_close(C_out[b], sum(torch.outer(g, g) for g in G[b]) / 7)
    with pytest.raises(ValueError, match="one row per sample"):
        P.kfac_factors(randn(5, 3), randn(4, 2))


def test_kfac_pi_formula_and_errors():
    C_out, C_in = spd(3), spd(5, seed=1)
    expected = math.sqrt((torch.trace(C_in) / 5) / (torch.trace(C_out) / 3))
    assert float(P.kfac_pi(C_out, C_in)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="positive trace"):
        P.kfac_pi(torch.zeros(2, 2, dtype=F64), C_in)


@FAST
@given(m=dims, d=dims, seed=seeds, lam=st.sampled_from([0.0, 1e-3, 0.7]))
def test_kfac_tikhonov_is_the_exact_damped_kronecker_solve(m, d, seed, lam):
    C_out, C_in, g = spd(m, seed), spd(d, seed + 1), randn(m, d, seed=seed + 2)
    dense = linalg.kron(C_out, C_in) + lam * torch.eye(m * d, dtype=F64)
    expected = linalg.unvec(torch.linalg.solve(dense, linalg.vec(g)), (m, d))
    torch.testing.assert_close(P.kfac_step_tikhonov(g, C_out, C_in, lam), expected)


@FAST
@given(m=dims, d=dims, seed=seeds, lam=st.sampled_from([1e-3, 0.7]))
def test_kfac_factored_is_the_product_of_damped_factors(m, d, seed, lam):
    C_out, C_in, g = spd(m, seed), spd(d, seed + 1), randn(m, d, seed=seed + 2)
    pi = float(P.kfac_pi(C_out, C_in))
    left = C_out + math.sqrt(lam) / pi * torch.eye(m, dtype=F64)
    right = C_in + math.sqrt(lam) * pi * torch.eye(d, dtype=F64)
    expected = linalg.unvec(torch.linalg.solve(linalg.kron(left, right), linalg.vec(g)), (m, d))
    torch.testing.assert_close(P.kfac_step_factored(g, C_out, C_in, lam), expected)


def test_kfac_dampings_agree_at_zero_and_differ_otherwise_batched():
    C_out, C_in, g = spd(3, batch=(2,)), spd(4, seed=1, batch=(2,)), randn(5, 2, 3, 4, seed=2)
    plain = torch.linalg.solve(C_out, g) @ torch.linalg.inv(C_in)
    for damping in ("tikhonov", "factored"):
        torch.testing.assert_close(P.kfac_step(g, C_out, C_in, 0.0, damping), plain)
    assert not torch.allclose(P.kfac_step(g, C_out, C_in, 0.5, "tikhonov"), P.kfac_step(g, C_out, C_in, 0.5, "factored"))


def test_kfac_errors():
    g = randn(3, 4)
    with pytest.raises(ValueError, match="damping"):
        P.kfac_step(g, spd(3), spd(4), 0.0, "levenberg")
    with pytest.raises(ValueError, match="C_in must have shape"):
        P.kfac_step(g, spd(3), spd(3), 0.1)
    singular = torch.zeros(3, 3, dtype=F64)
    with pytest.raises(ValueError, match="singular"):
        P.kfac_step_tikhonov(g, singular, spd(4), 0.0)
    with pytest.raises(ValueError, match="not positive definite|positive trace"):
        P.kfac_step_factored(g, singular, spd(4), 0.0)
    with pytest.raises(ValueError, match="lam"):
        P.kfac_step(g, spd(3), spd(4), -1.0)
    with pytest.raises(ValueError, match="non-finite"):
        P.kfac_step(g * float("nan"), spd(3), spd(4))


# ----------------------------------------------------------------------------------------------- Shampoo
def test_shampoo_accumulates_and_applies_quarter_powers():
    W, eps = randn(3, 5), 1e-2
    state = P.shampoo_init(W, eps)
    g1, g2 = randn(3, 5, seed=1), randn(3, 5, seed=2)
    _, state = P.shampoo_update(g1, state)
    out, state = P.shampoo_update(g2, state)
    L = eps * torch.eye(3, dtype=F64) + g1 @ g1.T + g2 @ g2.T
    R = eps * torch.eye(5, dtype=F64) + g1.T @ g1 + g2.T @ g2
    torch.testing.assert_close(state.C_out, L)
    torch.testing.assert_close(out, dense_power(L, -0.25) @ g2 @ dense_power(R, -0.25))
    out_half, _ = P.shampoo_update(g2, P.shampoo_init(W, eps), exponent=-0.5)
    L1, R1 = eps * torch.eye(3, dtype=F64) + g2 @ g2.T, eps * torch.eye(5, dtype=F64) + g2.T @ g2
    torch.testing.assert_close(out_half, dense_power(L1, -0.5) @ g2 @ dense_power(R1, -0.5))


@FAST
@given(m=dims, d=dims, seed=seeds)
def test_shampoo_without_memory_shrinks_singular_values(m, d, seed):
    """One step from L0 = eps I: L^{-1/4} G R^{-1/4} = U diag(s / sqrt(s^2 + eps)) V^T (chapter 02)."""
    g = randn(m, d, seed=seed)
    U, s, Vh = torch.linalg.svd(g, full_matrices=False)
    eps = float(s.min() ** 2) + 1e-3
    out, _ = P.shampoo_update(g, P.shampoo_init(g, eps))
    torch.testing.assert_close(out, U @ torch.diag(s / (s**2 + eps).sqrt()) @ Vh)


def test_shampoo_batched_and_errors():
    W = randn(2, 3, 4)
    out, state = P.shampoo_update(randn(2, 3, 4, seed=1), P.shampoo_init(W, 1e-3))
    assert out.shape == (2, 3, 4) and state.C_in.shape == (2, 4, 4)
    with pytest.raises(ValueError, match="eps"):
        P.shampoo_init(W, 0.0)
    with pytest.raises(TypeError, match="ShampooState"):
        P.shampoo_update(W, {"C_out": 1})
    torch.testing.assert_close(P.psd_power(torch.diag(torch.tensor([4.0, 1e-30], dtype=F64)), -0.5, floor=1e-2),
                               torch.diag(torch.tensor([0.5, 10.0], dtype=F64)))
    with pytest.raises(ValueError, match="state.C_out"):
        P.shampoo_update(randn(4, 4), state)


# ----------------------------------------------------------------------------------------------- Adam
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_adam_update_equals_torch_optim_adam(dtype):
    W0 = randn(2, 3, 4, dtype=dtype)
    p = W0.clone()
    opt = torch.optim.Adam([p], lr=0.05, betas=(0.8, 0.99), eps=1e-6)
    W, state = W0.clone(), P.adam_init(W0)
    for k in range(6):
        g = randn(2, 3, 4, seed=10 + k, dtype=dtype)
        p.grad = g.clone()
        opt.step()
        upd, state = P.adam_update(g, state, 0.05, (0.8, 0.99), 1e-6)
        W = W + upd
    torch.testing.assert_close(W, p)
    assert state.t == 6


def test_adam_preconditioner_and_errors():
    v = torch.tensor([0.0, 4.0, 0.25], dtype=F64)
    torch.testing.assert_close(P.adam_preconditioner(v, 1e-8), 1 / (v.sqrt() + 1e-8))
    with pytest.raises(ValueError, match="v_hat"):
        P.adam_preconditioner(-v, 1e-8)
    with pytest.raises(ValueError, match="lam_adam"):
        P.adam_preconditioner(v, 0.0)
    s = P.adam_init(randn(2, 2))
    with pytest.raises(ValueError, match="betas"):
        P.adam_update(randn(2, 2), s, 0.1, (0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        P.adam_update(randn(2, 2), s, -0.1)
    with pytest.raises(TypeError, match="AdamState"):
        P.adam_update(randn(2, 2), None, 0.1)


# ----------------------------------------------------------------------------------------------- Muon
@FAST
@given(m=dims, d=dims, seed=seeds, steps=st.integers(0, 6))
def test_newton_schulz_maps_singular_values_through_the_polynomial(m, d, seed, steps):
    G = randn(m, d, seed=seed)
    U, s, Vh = torch.linalg.svd(G, full_matrices=False)
    mapped = P.newton_schulz_scalar(s / torch.linalg.matrix_norm(G), steps)
    torch.testing.assert_close(P.newton_schulz(G, steps), U @ torch.diag(mapped) @ Vh)


def test_cubic_newton_schulz_converges_to_the_polar_factor():
    G = randn(2, 4, 6)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    torch.testing.assert_close(P.newton_schulz(G, 40, P.NS_CUBIC), U @ Vh)
    quintic = torch.linalg.svdvals(P.newton_schulz(G, 5))
    assert float(quintic.min()) > 0.6 and float(quintic.max()) < 1.25  # "approximately UV^T"


@pytest.mark.parametrize("shape", [(4, 6), (6, 4)])
def test_muon_update_equals_torch_optim_muon(shape):
    W0 = randn(*shape, dtype=torch.float32)
    p = W0.clone()
    opt = torch.optim.Muon([p], lr=0.02, weight_decay=0.0, momentum=0.9, nesterov=True)
    W, buf = W0.clone(), torch.zeros_like(W0)
    for k in range(3):
        g = randn(*shape, seed=20 + k, dtype=torch.float32)
        p.grad = g.clone()
        opt.step()
        upd, buf = P.muon_update(g, buf, 0.02, momentum=0.9, ns_dtype=torch.bfloat16)
        W = W + upd
    torch.testing.assert_close(W, p)


def test_muon_errors():
    g = randn(3, 4)
    with pytest.raises(ValueError, match="momentum"):
        P.muon_update(g, torch.zeros_like(g), 0.1, momentum=1.0)
    with pytest.raises(ValueError, match="buf"):
        P.muon_update(g, torch.zeros(4, 3, dtype=F64), 0.1)
    with pytest.raises(ValueError, match="coefficients"):
        P.newton_schulz(g, 5, (1.0, 2.0))
    with pytest.raises(ValueError, match="steps"):
        P.newton_schulz(g, -1)


# ----------------------------------------------------------------------------------------------- SOAP
def test_soap_is_adam_in_a_fixed_eigenbasis():
    """Gradients Q_out D_t Q_in^T with D_t diagonal, ordered: SOAP's basis is fixed, so SOAP = rotated Adam."""
    Q_out, Q_in = linalg.random_orthogonal(3), linalg.random_orthogonal(4)
    state, adam = P.soap_init(torch.zeros(3, 4, dtype=F64)), P.adam_init(torch.zeros(3, 4, dtype=F64))
    for t in range(5):
        D = torch.zeros(3, 4, dtype=F64)
        D[range(3), range(3)] = torch.tensor([1.0, 2.0, 3.0], dtype=F64) * (1 + 0.3 * t)
        out, state = P.soap_update(Q_out @ D @ Q_in.T, state, 0.1, (0.9, 0.99))
        upd, adam = P.adam_update(D, adam, 0.1, (0.9, 0.99))
        torch.testing.assert_close(Q_out.T @ out @ Q_in, upd, atol=1e-7, rtol=1e-7)  # null directions: ~eps/lam_adam


def test_soap_errors():
    s = P.soap_init(randn(2, 3))
    with pytest.raises(TypeError, match="SoapState"):
        P.soap_update(randn(2, 3), None, 0.1)
    with pytest.raises(ValueError, match="shampoo_beta"):
        P.soap_update(randn(2, 3), s, 0.1, shampoo_beta=1.5)


# ----------------------------------------------------------------------------------------------- the test problem
@pytest.fixture(scope="module")
def problem():
    return P.layer_problem(2, n=30, d=5, m=3, d_y=4, frac2=0.3, seed=3)


def test_problem_hessian_matches_torch_func_and_gradients_agree(problem):
    for s in range(2):
        H = curvature.gn_matrix(problem.model(s), linalg.vec(problem.W0[s]), 1.0 / 30)
        torch.testing.assert_close(problem.H[s], H)
    W = randn(4, 2, 3, 5, seed=5).requires_grad_(True)
    auto = torch.autograd.grad(0.5 * problem.residuals(W).square().sum(-1).mean(-1).sum(), W)[0]
    torch.testing.assert_close(problem.grad(W.detach()), auto)
    torch.testing.assert_close(problem.grad_from_samples(W.detach()), auto)
    torch.testing.assert_close(problem.loss(W.detach()), 0.5 * problem.residuals(W.detach()).square().sum(-1).mean(-1))


def test_problem_kronecker_structure():
    exact = P.layer_problem(1, n=20, d=4, m=2, d_y=3, frac2=0.0)
    C_out, C_in = exact.kfac_factors()
    torch.testing.assert_close(exact.H, linalg.kron(C_out, C_in))
    mixed = P.layer_problem(1, n=20, d=4, m=2, d_y=3, frac2=0.25)
    C_out, C_in = mixed.kfac_factors()
    X, V = mixed.X[0], mixed.heads[0]
    groups = [slice(0, 15), slice(15, 20)]
    B = [V[g][0].T @ V[g][0] for g in groups]
    S = [X[g].T @ X[g] / X[g].shape[0] for g in groups]
    torch.testing.assert_close(mixed.H[0] - linalg.kron(C_out[0], C_in[0]), 0.25 * 0.75 * linalg.kron(B[0] - B[1], S[0] - S[1]))
    sampled = mixed.heads[0].transpose(-2, -1) @ randn(20, 3, 1, seed=9)  # g_i = V_i^T eps_i
    assert P.kfac_factors(X, sampled.squeeze(-1))[0].shape == (2, 2)


def test_problem_aligned_basis_is_diagonal():
    prob = P.layer_problem(1, n=10, d=3, m=2, d_y=2, basis="aligned", kappa_out=4.0)
    C_out, _ = prob.kfac_factors()
    torch.testing.assert_close(C_out[0], torch.diag(torch.diagonal(C_out[0])))
    torch.testing.assert_close(torch.diagonal(C_out[0]), torch.tensor([1.0, 4.0], dtype=F64))


def test_problem_errors(problem):
    with pytest.raises(ValueError, match="d_y"):
        P.layer_problem(1, n=5, d=3, m=4, d_y=2)
    with pytest.raises(ValueError, match="frac2"):
        P.layer_problem(1, n=5, d=3, m=2, d_y=2, frac2=1.0)
    with pytest.raises(ValueError, match="basis"):
        P.layer_problem(1, n=5, d=3, m=2, d_y=2, basis="diagonal")
    with pytest.raises(ValueError, match="kappa_in"):
        P.layer_problem(1, n=5, d=3, m=2, d_y=2, kappa_in=0.5)
    with pytest.raises(ValueError, match="W must have shape"):
        problem.loss(torch.zeros(3, 5, dtype=F64))
    with pytest.raises(ValueError, match="s must be"):
        problem.model(2)
    with pytest.raises(ValueError, match="heads"):
        P.LayerProblem(problem.X, problem.heads[:, :3], problem.W_star, problem.W0)


# ----------------------------------------------------------------------------------------------- runs and theory
def test_linear_methods_follow_the_exact_loss_curve(problem):
    C_out, C_in = problem.kfac_factors()
    e0 = linalg.vec(problem.W0 - problem.W_star)
    for method, Pm in (("GD", torch.eye(15, dtype=F64).expand(2, 15, 15)), ("K-FAC", linalg.kron(C_out, C_in)),
                       ("NGD", problem.H)):
        eta, rate = P.linear_rate(problem.H, None if method == "GD" else Pm)
        losses = P.run(method, problem, 12, eta[None])[0]
        theory = P.preconditioned_loss_curve(problem.H, Pm, e0, 1.0, 12)  # unit step for the curve shape
        if method == "NGD":
            torch.testing.assert_close(eta, torch.ones(2, dtype=F64))
            assert float(rate.abs().max()) < 1e-10 and float(losses[:, 1:].max()) < 1e-20
        for s in range(2):
            curve = P.preconditioned_loss_curve(problem.H[s], Pm[s], e0[s], float(eta[s]), 12)
            torch.testing.assert_close(losses[s], curve / curve[0], atol=1e-12, rtol=1e-9)
        assert theory.shape == (2, 13)


def test_linear_rate_is_the_condition_number_rate():
    H = torch.diag(torch.tensor([1.0, 3.0, 9.0], dtype=F64))
    eta, rate = P.linear_rate(H)
    assert float(eta) == pytest.approx(0.2) and float(rate) == pytest.approx(8 / 10)
    eta, rate = P.linear_rate(H, H)
    assert float(eta) == pytest.approx(1.0) and float(rate) == pytest.approx(0.0, abs=1e-12)


def test_run_adam_is_torch_adam_and_shapes(problem):
    etas = torch.tensor([0.01, 0.1], dtype=F64)
    losses = P.run("Adam", problem, 5, etas)
    assert losses.shape == (2, 2, 6)
    W, state = problem.W0.clone(), P.adam_init(problem.W0)
    for _ in range(5):
        upd, state = P.adam_update(problem.grad(W), state, 0.1)
        W = W + upd
    torch.testing.assert_close(losses[1, :, -1], problem.loss(W) / problem.loss(problem.W0))


@pytest.mark.parametrize("method", ["Shampoo", "Muon", "SOAP"])
def test_run_other_methods_decrease_the_loss(problem, method):
    best, scores, losses = P.tune(method, problem, 30, torch.logspace(-2, 0, 3), tune_seeds=[0])
    assert scores.shape == (3,) and losses.shape == (2, 31)
    assert float(losses[:, -1].max()) < 1.0


def test_run_stops_diverging_runs_and_validates(problem):
    losses = P.run("GD", problem, 30, 1e3)
    assert bool(torch.isinf(losses[..., -1]).all())
    with pytest.raises(ValueError, match="method"):
        P.run("LBFGS", problem, 3, 0.1)
    with pytest.raises(ValueError, match="eta"):
        P.run("GD", problem, 3, torch.ones(2, 3))
    with pytest.raises(ValueError, match="eta"):
        P.run("GD", problem, 3, -0.1)
    with pytest.raises(ValueError, match="same for every seed"):
        P.run("Adam", problem, 3, torch.tensor([[0.1, 0.2]], dtype=F64))
    with pytest.raises(TypeError, match="problem"):
        P.run("GD", "problem", 3, 0.1)
    with pytest.raises(ValueError, match="tune_seeds"):
        P.tune("GD", problem, 3, [0.1], tune_seeds=[5])


def test_preconditioned_loss_curve_matches_iteration():
    H, Pm, e0 = spd(4, seed=1), spd(4, seed=2), randn(4, seed=3)
    curve = P.preconditioned_loss_curve(H, Pm, e0, 0.3, 5)
    e, direct = e0.clone(), []
    for _ in range(6):
        direct.append(0.5 * e @ H @ e)
        e = e - 0.3 * torch.linalg.solve(Pm, H @ e)
    torch.testing.assert_close(curve, torch.stack(direct))
    with pytest.raises(ValueError, match="e0"):
        P.preconditioned_loss_curve(H, Pm, randn(3), 0.3, 5)


def test_run_protocol_uses_oracle_steps_and_tuning(problem):
    eta, losses = P.run_protocol("NGD", problem, 3, [0.1], tune_seeds=[0])
    torch.testing.assert_close(eta, torch.ones(2, dtype=F64))
    assert float(losses[:, 1:].max()) < 1e-20
    eta_gd, _ = P.run_protocol("GD", problem, 3, [0.1], tune_seeds=[0])
    torch.testing.assert_close(eta_gd, P.linear_rate(problem.H)[0])
    etas = torch.tensor([1e-3, 1e-1], dtype=F64)
    eta_adam, losses = P.run_protocol("Adam", problem, 10, etas, tune_seeds=[0])
    best, _, expected = P.tune("Adam", problem, 10, etas, tune_seeds=[0])
    assert float(eta_adam[1]) == best
    torch.testing.assert_close(losses, expected)
    with pytest.raises(ValueError, match="method"):
        P.run_protocol("SGD", problem, 3, [0.1], tune_seeds=[0])


# ----------------------------------------------------------------------------------------------- consistency (chapter 02)
def test_consistency_kfac_and_ngd_solve_in_one_step():
    """Consistency, not evidence (chapter 02 shows these in its figure, and checks the directions against torch.func):
    on a Kronecker problem K-FAC at eta = 1 is Newton's step, and NGD at eta = 1 is Newton's step on any problem."""
    kron_prob = P.layer_problem(2, n=30, d=5, m=3, d_y=4, frac2=0.0, seed=4)
    mixed = P.layer_problem(2, n=30, d=5, m=3, d_y=4, frac2=0.3, seed=4)
    assert float(P.run("K-FAC", kron_prob, 1, 1.0)[0, :, 1].max()) < 1e-20
    assert float(P.run("NGD", mixed, 1, 1.0)[0, :, 1].max()) < 1e-20
    assert float(P.run("K-FAC", mixed, 1, 1.0)[0, :, 1].min()) > 1e-6      # the gap of the lemma


def test_kfac_gap_is_the_lemma_and_errors():
    mixed = P.layer_problem(2, n=20, d=4, m=2, d_y=3, frac2=0.25, seed=2)
    C_out, C_in = mixed.kfac_factors()
    torch.testing.assert_close(P.kfac_gap(mixed, 5), mixed.H - linalg.kron(C_out, C_in))
    exact = P.layer_problem(1, n=20, d=4, m=2, d_y=3, frac2=0.0)
    assert float(P.kfac_gap(exact, 0).abs().max()) == 0.0
    with pytest.raises(ValueError, match="n2"):
        P.kfac_gap(mixed, 21)
    with pytest.raises(TypeError, match="LayerProblem"):
        P.kfac_gap(mixed.H, 5)
