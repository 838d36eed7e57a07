"""Tests for curvlab.synthesis (chapter 40): dense torch.func references and bad inputs."""

import math

import numpy as np
import pytest
import torch

from curvlab import deep_linear as dl
from curvlab import synthesis as sy
from curvlab.curvature import gn_matrix

D64 = torch.float64


def _two_layer(d=6, k=2, d_y=4, n=40, seed=0, kappa=30.0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=D64) * torch.logspace(0, math.log10(kappa), d, dtype=D64).sqrt()
    G = torch.randn(k, d, generator=g, dtype=D64)
    F = torch.randn(d_y, k, generator=g, dtype=D64)
    return X, F, G, X.T @ X / n


@pytest.mark.parametrize("d,k,d_y", [(6, 2, 4), (5, 3, 3), (4, 1, 2)])
def test_two_layer_gn_matches_torch_func(d, k, d_y):
    X, F, G, S = _two_layer(d, k, d_y)
    H = sy.two_layer_gn(F, G, S)
    ref = dl.gn_dense([G, F], X)
    assert torch.allclose(H, ref, atol=1e-10 * float(ref.abs().max()))
    B1, B2 = sy.kfac_blocks(F, G, S)
    assert torch.allclose(B1, ref[: k * d, : k * d], atol=1e-10 * float(ref.abs().max()))
    assert torch.allclose(B2, ref[k * d:, k * d:], atol=1e-10 * float(ref.abs().max()))


@pytest.mark.parametrize("d,k,d_y", [(6, 2, 4), (7, 3, 5), (3, 3, 3), (5, 6, 3)])
def test_kfac_spectrum_is_one_two(d, k, d_y):
    X, F, G, S = _two_layer(d, k, d_y, seed=d + k)
    e = sy.block_preconditioned_spectrum(sy.two_layer_gn(F, G, S), sy.kfac_blocks(F, G, S))
    pred = sy.kfac_spectrum_prediction(d, k, d_y, rank_F=min(k, d_y), rank_G=min(k, d))
    assert e.shape == pred.shape
    assert torch.allclose(e, pred, atol=1e-8)


def test_kfac_spectrum_singular_sigma():
    X, F, G, _ = _two_layer(d=6, k=2, d_y=4, n=4)          # n < d: Sigma_hat of rank 4
    S = X.T @ X / X.shape[0]
    e = sy.block_preconditioned_spectrum(sy.two_layer_gn(F, G, S), sy.kfac_blocks(F, G, S))
    assert torch.allclose(e, sy.kfac_spectrum_prediction(6, 2, 4, rank_Sigma=4), atol=1e-7)


def test_block_preconditioned_spectrum_dense_reference():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(7, 5, generator=g, dtype=D64)
    H = A @ A.T + torch.eye(7, dtype=D64)
    blocks = [H[:3, :3], H[3:, 3:]]
    P = torch.block_diag(*blocks)
    ref = torch.linalg.eigvals(torch.linalg.solve(P, H)).real.sort(descending=True).values
    assert torch.allclose(sy.block_preconditioned_spectrum(H, blocks), ref, atol=1e-10)


def test_nearest_kronecker_and_error():
    g = torch.Generator().manual_seed(4)
    A, B = torch.randn(3, 3, generator=g, dtype=D64), torch.randn(4, 4, generator=g, dtype=D64)
    A, B = A @ A.T, B @ B.T
    M = torch.kron(A, B)
    A2, B2 = sy.nearest_kronecker(M, (3, 3), (4, 4))
    assert torch.allclose(torch.kron(A2, B2), M, atol=1e-10 * float(M.abs().max()))
    assert sy.kronecker_error(M, A2, B2) < 1e-12
    # the nearest product beats any other, e.g. the true factors of a perturbed matrix
    N = M + 0.1 * torch.randn(12, 12, generator=g, dtype=D64)
    A3, B3 = sy.nearest_kronecker(N, (3, 3), (4, 4))
    assert sy.kronecker_error(N, A3, B3) <= sy.kronecker_error(N, A, B) + 1e-12


def test_leaky_report_linear_limit_and_nonlinear():
    g = torch.Generator().manual_seed(5)
    W, V = torch.randn(3, 6, generator=g, dtype=D64), torch.randn(4, 3, generator=g, dtype=D64)
    X = torch.randn(80, 6, generator=g, dtype=D64)
    lin = sy.leaky_kfac_report(W, V, X, 1.0)
    assert lin["kron_err_kfac"] < 1e-12 and abs(lin["kappa_exact"] - 2) < 1e-8 and lin["off_12_kfac"] < 1e-8
    nl = sy.leaky_kfac_report(W, V, X, 0.3)
    assert nl["kron_err_best"] <= nl["kron_err_kfac"] + 1e-12
    assert nl["kron_err_kfac"] > 1e-3 and nl["off_12_exact"] > 1e-3
    # kappa of the dense GN matches the torch.func matrix
    from curvlab.deep_linear import leaky_flat_model
    from curvlab.curvature import condition_number
    fn, _ = leaky_flat_model(X, 6, 3, 4, 0.3)
    H = gn_matrix(fn, torch.cat([W.reshape(-1), V.reshape(-1)]), scale=1 / 80)
    assert math.isclose(nl["kappa_gn"], condition_number(H).kappa, rel_tol=1e-10)


def test_tail_rate():
    t = torch.arange(200, dtype=D64)
    e = 0.95**t + 1e-3 * 0.5**t
    rate, drift, w = sy.tail_rate(e, 30)
    assert abs(float(rate) - 0.95) <= float(drift) + 1e-12 and float(w) == 30
    floored = torch.clamp(0.8**t, min=1e-12)
    r2, _, w2 = sy.tail_rate(floored, 100, floor=1e-10)
    assert abs(float(r2) - 0.8) < 1e-10 and float(w2) < 100


def _quadratic_iteration(mu, T=400, seed=0):
    """b <- M b + 0.3 |b|^2 u on a symmetric map M with eigenvalues mu (eigenvectors Q), u a fixed unit vector."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(len(mu), len(mu), generator=g, dtype=D64))[0]
    M = Q @ torch.diag(torch.tensor(mu, dtype=D64)) @ Q.T
    u = torch.randn(len(mu), generator=g, dtype=D64)
    b = [1e-2 * torch.randn(len(mu), generator=g, dtype=D64)]
    for _ in range(T):
        b.append(M @ b[-1] + 0.3 * b[-1].norm() ** 2 * u / u.norm())
    B = torch.stack(b)
    return B, Q, B.norm(dim=-1)


def test_mode_rate_recovers_the_slowest_eigenvalue_within_its_bound():
    mu = [0.9, 0.899, 0.85, 0.5, 0.1]           # nearly degenerate slowest pair: the distance's tail rate drifts
    B, Q, dist = _quadratic_iteration(mu)
    rate, bound, w = sy.mode_rate(B, Q[:, 0], mu[0], dist, floor=1e-12)
    assert abs(float(rate) - 0.9) <= float(bound) and float(bound) < 1e-4 and float(w) == 7
    # a wrong eigenvector (mixing the slowest pair) is not a mode: its rate misses its own eigenvalue
    v_wrong = (Q[:, 0] + Q[:, 2]) / 2 ** 0.5
    rate_w, bound_w, _ = sy.mode_rate(B, v_wrong, 0.875, dist, floor=1e-12)
    assert abs(float(rate_w) - 0.875) > float(bound_w)
    # batched: the same numbers per entry
    r2, b2, _ = sy.mode_rate(torch.stack([B, B]), torch.stack([Q[:, 0], Q[:, 0]]), torch.tensor([0.9, 0.9], dtype=D64),
                             torch.stack([dist, dist]), floor=1e-12)
    assert torch.allclose(r2, rate.expand(2)) and torch.allclose(b2, bound.expand(2))


def test_mode_rate_bad_input():
    B, Q, dist = _quadratic_iteration([0.9, 0.5], T=50)
    with pytest.raises(ValueError, match="mu must lie"):
        sy.mode_rate(B, Q[:, 0], 1.2, dist)
    with pytest.raises(ValueError, match="v must have shape"):
        sy.mode_rate(B, Q[:1, 0], 0.9, dist)
    with pytest.raises(ValueError, match="dist"):
        sy.mode_rate(B, Q[:, 0], 0.9, dist[:-1])
    with pytest.raises(ValueError, match="run longer"):
        sy.mode_rate(B, Q[:, 0], 0.9, dist, floor=1.0)
    with pytest.raises(ValueError, match="finite"):
        sy.mode_rate(B * float("nan"), Q[:, 0], 0.9, dist)
    with pytest.raises(ValueError, match="coords must be"):
        sy.mode_rate(B[0], Q[:, 0], 0.9, dist)


def test_softmax_ggn_against_hessian_at_linear_model():
    # for a linear softmax model the GGN equals the Hessian of the cross-entropy exactly
    g = torch.Generator().manual_seed(6)
    X, labels = torch.randn(30, 4, generator=g, dtype=D64), torch.randint(0, 3, (30,), generator=g)
    fn = lambda th: X @ th.reshape(3, 4).T                                   # noqa: E731
    th = 0.3 * torch.randn(12, generator=g, dtype=D64)
    loss = lambda th: torch.nn.functional.cross_entropy(fn(th), labels)     # noqa: E731
    H = torch.func.hessian(loss)(th)
    assert torch.allclose(sy.softmax_ggn(fn, th), H, atol=1e-12)


def test_minibatch_gn_full_batch_equals_gn_step():
    from curvlab import meanfield as mf
    data = mf.teacher_student((0,), d=4, m_teacher=2, n=20, n_test=50)
    p0 = mf.init_student(30, 4, init_std=0.5, seeds=(0,), v0_zero=False)
    damp = mf.Damping.constant(1e-6)
    frame = sy.minibatch_gn(p0, data, batch_size=20, epochs=1, eta=0.5, damping=damp)
    p1 = mf.gn_step(p0, data.X, data.Y, data.act, eta=0.5, damping=damp)
    assert math.isclose(frame.train_loss.iloc[-1], float(mf.loss(p1, data.X, data.Y, data.act)), rel_tol=1e-10)
    assert list(frame.epoch) == [0, 1] and frame.steps.iloc[-1] == 1


def test_linrep_layer_probe_kfac_population_like():
    g = torch.Generator().manual_seed(7)
    d, k, d_y, n = 8, 2, 4, 4000
    Gs = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=D64))[0].T
    Fs = torch.randn(d_y, k, generator=g, dtype=D64)
    half = torch.diag(torch.logspace(0, 1, d, dtype=D64).sqrt())

    def sample():
        X = torch.randn(n, d, generator=g, dtype=D64) @ half
        return X, X @ (Fs @ Gs).T

    G0 = torch.randn(k, d, generator=g, dtype=D64)
    dist = sy.linrep_layer_probe("K-FAC", sample, G0, Gs, n_steps=3, lr=1.0, lam=0.0)
    assert dist.shape == (4,) and dist[-1] < 1e-8                            # noiseless, eta = 1: one step
    for method in ("AMGD", "Muon", "SOAP"):
        out = sy.linrep_layer_probe(method, sample, G0, Gs, n_steps=2, lr=1e-3)
        assert np.isfinite(out).all()


def test_giant_step_probe_one_step_is_gradient():
    g = torch.Generator().manual_seed(8)
    X, y = torch.randn(50, 5, generator=g, dtype=D64), torch.randn(50, generator=g, dtype=D64)
    W0, v = 0.1 * torch.randn(6, 5, generator=g, dtype=D64), torch.randn(6, generator=g, dtype=D64)
    loss = lambda W: 0.5 * ((torch.tanh(X @ W.T) @ v / math.sqrt(6) - y) ** 2).mean()  # noqa: E731
    grad = torch.func.grad(loss)(W0)
    assert torch.allclose(sy.giant_step_probe(X, y, W0, v, eta=2.0, n_steps=1), -2.0 * grad, atol=1e-12)
    P = torch.linalg.inv(X.T @ X / 50 + 0.1 * torch.eye(5, dtype=D64))
    assert torch.allclose(sy.giant_step_probe(X, y, W0, v, eta=2.0, n_steps=1, lam_G=0.1), -2.0 * grad @ P,
                          atol=1e-12)


def test_gn_layer_movement_full_step_fits_linearisation():
    out = sy.gn_layer_movement(16, "NTK", n=10, lam_GN=0.0)
    assert set(out) == {"m", "param", "move_W", "move_v", "residual_ratio"}
    assert out["move_W"] > 0 and out["move_v"] > 0 and out["residual_ratio"] < 1


def test_bad_inputs():
    X, F, G, S = _two_layer()
    with pytest.raises(ValueError, match="F must have k"):
        sy.two_layer_gn(F[:, :1], G, S)
    with pytest.raises(ValueError, match="Sigma_hat"):
        sy.kfac_blocks(F, G, S[:3, :3])
    with pytest.raises(ValueError, match="Sigma_hat must be symmetric"):
        sy.two_layer_gn(F, G, S + torch.triu(torch.ones_like(S), 1))
    with pytest.raises(TypeError, match="blocks"):
        sy.block_preconditioned_spectrum(S, S)
    with pytest.raises(ValueError, match="add up"):
        sy.block_preconditioned_spectrum(S, [S[:2, :2]])
    with pytest.raises(ValueError, match="rank_F"):
        sy.kfac_spectrum_prediction(6, 2, 4, rank_F=3)
    with pytest.raises(ValueError, match="rank_G"):
        sy.kfac_spectrum_prediction(6, 2, 4, rank_G=3)
    with pytest.raises(ValueError, match="M must have shape"):
        sy.nearest_kronecker(S, (2, 2), (2, 2))
    with pytest.raises(ValueError, match="alpha"):
        sy.leaky_kfac_report(G, F, X, 0.0)
    with pytest.raises(ValueError, match="positive"):
        sy.tail_rate(torch.tensor([1.0, 0.0, 0.5]), 1)
    with pytest.raises(ValueError, match="at least 3"):
        sy.tail_rate(torch.ones(2), 2)
    with pytest.raises(ValueError, match="method"):
        sy.linrep_layer_probe("Newton", lambda: None, G, G, n_steps=1, lr=0.1)
    with pytest.raises(ValueError, match="eta"):
        sy.giant_step_probe(X, X[:, 0], torch.zeros(4, 6, dtype=D64), F[:, 0], eta=-1.0, n_steps=1)
    with pytest.raises(ValueError, match="shapes"):
        sy.giant_step_probe(X, X[:5, 0], G, F[:, 0], eta=1.0, n_steps=1)
    with pytest.raises(TypeError):
        sy.two_layer_gn("F", G, S)
    with pytest.raises(ValueError, match="theta"):
        sy.softmax_ggn(lambda th: th, torch.ones(2, 2))


def test_stack_problems():
    from curvlab import linrep
    a = linrep.linrep_problem(2, d=6, k=2, d_y=3, kappa_x=3.0, seed=0)
    b = linrep.linrep_problem(1, d=6, k=2, d_y=3, kappa_x=30.0, seed=1)
    P = sy.stack_problems([a, b])
    assert P.n_seeds == 3 and torch.equal(P.Sigma[2], b.Sigma[0])
    with pytest.raises(TypeError):
        sy.stack_problems(a)
    with pytest.raises(ValueError, match="share"):
        sy.stack_problems([a, linrep.linrep_problem(1, d=7, k=2, d_y=3, kappa_x=3.0)])


def _ce_point(c, k, d=5, n=60, seed=12, tau=1.0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=D64)
    G = torch.randn(k, d, generator=g, dtype=D64)
    F = tau * torch.randn(c, k, generator=g, dtype=D64)
    return X, F, G


@pytest.mark.parametrize("c,k", [(2, 1), (3, 2), (4, 3), (3, 4), (3, 6)])
def test_ce_spectrum_is_one_two_when_k_at_least_c_minus_1(c, k):
    X, F, G = _ce_point(c, k)
    e, cond = sy.ce_kfac_spectrum(X, F, G)
    pred = sy.ce_kfac_spectrum_prediction(X.shape[1], k, c)
    assert e.shape == pred.shape
    assert float((e - pred).abs().max()) <= 1e3 * np.finfo(float).eps * len(e) * cond


def test_ce_spectrum_against_dense_reference():
    """The preconditioned spectrum from an independently formed GGN (explicit per-sample Jacobians)."""
    X, F, G = _ce_point(4, 1)
    k, d, c = 1, X.shape[1], 4
    Z = X @ G.T @ F.T
    P = torch.softmax(Z, -1)
    Jg = torch.einsum("ak,id->iakd", F, X).reshape(X.shape[0], c, k * d)           # d z / d vec G
    Jf = torch.einsum("ab,ik->iabk", torch.eye(c, dtype=D64), X @ G.T).reshape(X.shape[0], c, c * k)
    J = torch.cat([Jg, Jf], -1)
    Lam = torch.diag_embed(P) - P[:, :, None] * P[:, None, :]
    H = torch.einsum("iap,iab,ibq->pq", J, Lam, J) / X.shape[0]
    ref = sy.block_preconditioned_spectrum(H, [H[: k * d, : k * d], H[k * d:, k * d:]])
    e, _ = sy.ce_kfac_spectrum(X, F, G)
    assert torch.allclose(e, ref, atol=1e-10)
    # k = c - 3 at unit scale: the spectrum leaves {1, 2}; near uniform predictions it returns to it
    assert sy.distance_from_one_two(e, int((e > 1e-8).sum())) > 0.05
    e0, _ = sy.ce_kfac_spectrum(*_ce_point(4, 1, tau=1e-5))
    assert sy.distance_from_one_two(e0, int((e0 > 1e-12).sum())) < 1e-3


def test_ce_bad_inputs():
    X, F, G = _ce_point(3, 2)
    with pytest.raises(ValueError, match="k must be >= c - 1"):
        sy.ce_kfac_spectrum_prediction(5, 1, 3)
    with pytest.raises(ValueError, match="c must be >= 2"):
        sy.ce_kfac_spectrum_prediction(5, 1, 1)
    with pytest.raises(ValueError, match="F must have k"):
        sy.ce_kfac_spectrum(X, F[:, :1], G)
    with pytest.raises(ValueError, match="X must have d"):
        sy.ce_kfac_spectrum(X[:, :3], F, G)
    with pytest.raises(ValueError, match="rank"):
        sy.distance_from_one_two(torch.ones(3), 4)
    with pytest.raises(ValueError, match="1-D"):
        sy.distance_from_one_two(torch.ones(3, 3), 1)
