"""Tests for curvlab.primer: every public function against a dense ``torch.autograd`` / ``torch.func`` or Monte Carlo
reference on small random problems, and its bad-input errors."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from curvlab import linalg  # noqa: E402
from curvlab import primer as P  # noqa: E402

F64 = torch.float64
FAST = settings(max_examples=10, deadline=None)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def net_problem(seed=0, n=5, d=3, m=4, d_y=2):
    X, Y = randn(n, d, seed=seed), randn(n, d_y, seed=seed + 1)
    res, n_ = P.two_layer(X, Y, m)
    return P.LeastSquares("net", res, n_), randn(res.p, seed=seed + 2), X, Y


# ------------------------------------------------------------------------------------------- problems
@FAST
@given(seed=seeds)
def test_least_squares_derivatives_match_autograd(seed):
    prob, theta, _, _ = net_problem(seed)
    loss = lambda th: prob.residual(th).square().sum() / (2 * prob.n)
    torch.testing.assert_close(prob.loss(theta), loss(theta))
    J = torch.autograd.functional.jacobian(prob.residual, theta)
    torch.testing.assert_close(prob.jacobian(theta), J)
    torch.testing.assert_close(prob.gradient(theta), torch.autograd.functional.jacobian(loss, theta))
    torch.testing.assert_close(prob.gn_matrix(theta), J.T @ J / prob.n)
    torch.testing.assert_close(prob.hessian(theta), torch.autograd.functional.hessian(loss, theta))
    batch = torch.stack([theta, 2 * theta, -theta]).reshape(3, 1, -1)
    torch.testing.assert_close(prob.loss(batch).reshape(-1), torch.stack([loss(b[0]) for b in batch]))


def test_least_squares_errors():
    with pytest.raises(TypeError, match="residual"):
        P.LeastSquares("x", 3, 2)
    with pytest.raises(ValueError, match="n"):
        P.LeastSquares("x", lambda t: t, 0)
    prob = P.rosenbrock()
    with pytest.raises(ValueError, match="theta"):
        prob.loss(torch.tensor([float("nan"), 0.0]))
    with pytest.raises(TypeError, match="theta"):
        prob.loss("abc")


@pytest.mark.parametrize("kappa", [1.0, 4.0, 50.0])
def test_quadratic_hessian_and_minimum(kappa):
    q = P.quadratic(kappa, lam_max=2.0)
    A = q.hessian(randn(2))
    torch.testing.assert_close(torch.linalg.eigvalsh(A), torch.tensor([2.0 / kappa, 2.0], dtype=F64))
    torch.testing.assert_close(q.gn_matrix(randn(2)), A)
    assert float(q.loss(q.theta_star)) == 0.0
    theta = randn(2, seed=3)
    e = theta - q.theta_star
    torch.testing.assert_close(q.loss(theta), 0.5 * e @ A @ e)


def test_quadratic_errors():
    with pytest.raises(ValueError, match="kappa"):
        P.quadratic(0.5)
    with pytest.raises(ValueError, match="lam_max"):
        P.quadratic(2.0, lam_max=-1.0)
    with pytest.raises(ValueError, match="theta_star"):
        P.quadratic(2.0, theta_star=(1.0, 2.0, 3.0))


@FAST
@given(x=st.floats(-3, 3), y=st.floats(-3, 3))
def test_rosenbrock_two_gn_steps_and_jacobian(x, y):
    rb = P.rosenbrock()
    theta = torch.tensor([x, y], dtype=F64)
    assert abs(float(torch.linalg.det(rb.jacobian(theta))) - 10.0) < 1e-9
    two = P.run(rb, "GN", theta, 2)
    torch.testing.assert_close(two[1], torch.tensor([1.0, x * (2 - x)], dtype=F64), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(two[2], rb.theta_star, atol=1e-9, rtol=0)


@pytest.mark.parametrize("lam", [-2.0, -0.5, 0.3, 0.9])
def test_dennis_schnabel_stationary_point_and_rate(lam):
    ds = P.dennis_schnabel(lam)
    torch.testing.assert_close(ds.gradient(ds.theta_star), torch.zeros(2, dtype=F64))
    H, H_GN, H_res = P.hessian_parts(ds.residual, ds.theta_star, n=ds.n)
    dense = torch.linalg.eigvals(torch.linalg.solve(H_GN, H_res)).abs().max()
    assert math.isclose(P.gn_local_rate(H_GN, H_res), float(dense), rel_tol=1e-12)
    assert math.isclose(P.gn_local_rate(H_GN, H_res), abs(lam), rel_tol=1e-12)
    assert (float(torch.linalg.eigvalsh(H)[0]) > 0) == (lam < 1)


def test_dennis_schnabel_errors():
    with pytest.raises(TypeError, match="nu"):
        P.dennis_schnabel("1")
    with pytest.raises(TypeError, match="nu"):
        P.dennis_schnabel(float("inf"))


def test_two_layer_matches_explicit_network():
    X, Y = randn(6, 3), randn(6, 2, seed=1)
    res, n = P.two_layer(X, Y, 4, act=torch.sin)
    W, V = randn(4, 3, seed=2), randn(2, 4, seed=3)
    theta = torch.cat([W.reshape(-1), V.reshape(-1)])
    assert n == 6 and res.p == theta.numel()
    torch.testing.assert_close(res(theta), (torch.sin(X @ W.T) @ V.T - Y).reshape(-1))


def test_two_layer_errors():
    with pytest.raises(ValueError, match="Y"):
        P.two_layer(randn(5, 3), randn(4, 2), 3)
    with pytest.raises(ValueError, match="m"):
        P.two_layer(randn(5, 3), randn(5, 2), 0)
    with pytest.raises(TypeError, match="act"):
        P.two_layer(randn(5, 3), randn(5, 2), 3, act=1)
    with pytest.raises(ValueError, match="X"):
        P.two_layer(randn(5), randn(5, 2), 3)


# ------------------------------------------------------------------------------------------- Hessian split
@FAST
@given(seed=seeds)
def test_hessian_parts_against_dense_reference(seed):
    prob, theta, _, _ = net_problem(seed, n=4, d=2, m=3)
    H, H_GN, H_res = P.hessian_parts(prob.residual, theta, n=prob.n)
    loss = lambda th: prob.residual(th).square().sum() / (2 * prob.n)
    torch.testing.assert_close(H, torch.autograd.functional.hessian(loss, theta))
    r = prob.residual(theta)
    ref_res = sum(r[k] * torch.autograd.functional.hessian(lambda th, k=k: prob.residual(th)[k], theta)
                  for k in range(r.numel())) / prob.n
    torch.testing.assert_close(H_res, ref_res)
    torch.testing.assert_close(H, H_GN + H_res)


def test_hessian_parts_errors():
    with pytest.raises(TypeError, match="residual"):
        P.hessian_parts(None, randn(2))
    with pytest.raises(ValueError, match="theta"):
        P.hessian_parts(lambda t: t, randn(2, 2))
    with pytest.raises(ValueError, match="n"):
        P.hessian_parts(lambda t: t, randn(2), n=0)


# ------------------------------------------------------------------------------------------- update rules
def test_steps_on_a_quadratic():
    q = P.quadratic(10.0)
    theta = randn(2, seed=5)
    A = q.hessian(theta)
    torch.testing.assert_close(P.gd_step(q, theta, 0.3), theta - 0.3 * A @ (theta - q.theta_star))
    torch.testing.assert_close(P.gn_step(q, theta), q.theta_star)
    torch.testing.assert_close(P.newton_step(q, theta), q.theta_star)
    damped = theta - torch.linalg.solve(A + 0.5 * torch.eye(2, dtype=F64), A @ (theta - q.theta_star))
    torch.testing.assert_close(P.gn_step(q, theta, lam_GN=0.5), damped)
    torch.testing.assert_close(P.gn_map(q)(theta), q.theta_star)


def test_gn_step_uses_book_normalisation():
    prob, theta, _, _ = net_problem(1, n=6, d=2, m=2)
    lam = 0.7
    H_GN, g = prob.gn_matrix(theta), prob.gradient(theta)
    ref = theta - torch.linalg.solve(H_GN + lam * torch.eye(theta.numel(), dtype=F64), g)
    torch.testing.assert_close(P.gn_step(prob, theta, lam_GN=lam), ref)


def test_gn_map_matches_gn_step():
    ds = P.dennis_schnabel(0.4)
    theta = randn(2, seed=2)
    torch.testing.assert_close(P.gn_map(ds)(theta), P.gn_step(ds, theta))
    with pytest.raises(TypeError, match="problem"):
        P.gn_map(lambda t: t)


def test_armijo_step_satisfies_condition_and_rejects_ascent():
    rb = P.rosenbrock()
    theta = torch.tensor([-1.2, 1.0], dtype=F64)
    g = rb.gradient(theta)
    new = P.armijo_step(rb, theta, g)
    alpha = float((theta - new).norm() / g.norm())
    assert float(rb.loss(new)) <= float(rb.loss(theta)) - 1e-4 * alpha * float(g @ g) + 1e-15
    with pytest.raises(ValueError, match="descent"):
        P.armijo_step(rb, theta, -g)


def test_lm_step_accepts_and_rejects():
    ds = P.dennis_schnabel(0.5)
    far = torch.tensor([1.5, -1.0], dtype=F64)
    new, lam = P.lm_step(ds, far, 1.0)
    assert float(ds.loss(new)) < float(ds.loss(far)) and lam == pytest.approx(1.0 / 3.0)
    stay, lam2 = P.lm_step(ds, ds.theta_star, 1.0)  # nothing beats the minimum
    assert torch.equal(stay, ds.theta_star) and lam2 == pytest.approx(2.0)


def test_run_methods_shapes_and_monotone_line_search():
    ds = P.dennis_schnabel(-2.0)
    start = torch.tensor([1.5, -1.0], dtype=F64)
    for method in P.METHODS:
        path = P.run(ds, method, start, 5, eta=0.1)
        assert path.shape == (6, 2) and path.dtype == F64
    path = P.run(ds, "GN+line-search", start, 20)
    losses = ds.loss(path)
    assert bool((losses[1:] <= losses[:-1] + 1e-15).all())
    blown = P.run(P.quadratic(2.0), "GD", start, 200, eta=1e6)
    assert blown.shape == (201, 2) and bool(torch.isfinite(blown).all())


def test_run_errors():
    q = P.quadratic(2.0)
    with pytest.raises(ValueError, match="method"):
        P.run(q, "Adam", [0.0, 0.0], 3)
    with pytest.raises(TypeError, match="method"):
        P.run(q, 3, [0.0, 0.0], 3)
    with pytest.raises(ValueError, match="eta"):
        P.run(q, "GD", [0.0, 0.0], 3)
    with pytest.raises(ValueError, match="n_steps"):
        P.run(q, "GN", [0.0, 0.0], -1)
    with pytest.raises(TypeError, match="problem"):
        P.run(lambda t: t, "GN", [0.0, 0.0], 3)
    with pytest.raises(ValueError, match="theta0"):
        P.run(q, "GN", [[0.0, 0.0]], 3)
    with pytest.raises(ValueError, match="lam_GN"):
        P.run(q, "LM", [0.0, 0.0], 3, lam_GN=0.0)


# ------------------------------------------------------------------------------------------- rates
@pytest.mark.parametrize("kappa", [2.0, 10.0, 100.0])
def test_gd_rate_is_the_measured_contraction(kappa):
    q = P.quadratic(kappa)
    start = torch.tensor([-1.5, 2.0], dtype=F64)
    opt = P.contraction_ratios(P.run(q, "GD", start, 10, eta=2 / (1 + 1 / kappa)), q.theta_star)
    torch.testing.assert_close(opt, torch.full_like(opt, P.gd_rate(kappa)))
    safe = P.contraction_ratios(P.run(q, "GD", start, 10, eta=1.0), q.theta_star)[1:]
    torch.testing.assert_close(safe, torch.full_like(safe, P.gd_rate(kappa, "1/lmax")))


def test_rate_errors():
    with pytest.raises(ValueError, match="kappa"):
        P.gd_rate(0.5)
    with pytest.raises(ValueError, match="policy"):
        P.gd_rate(2.0, "best")
    with pytest.raises(ValueError, match="H_GN"):
        P.gn_local_rate(torch.zeros(2, 2, dtype=F64), torch.eye(2, dtype=F64))
    with pytest.raises(ValueError, match="H_res"):
        P.gn_local_rate(torch.eye(2, dtype=F64), torch.eye(3, dtype=F64))
    with pytest.raises(ValueError, match="theta_star"):
        P.contraction_ratios(randn(4, 2), randn(3))
    with pytest.raises(ValueError, match="theta_star"):
        P.contraction_ratios(torch.zeros(3, 2, dtype=F64), torch.zeros(2, dtype=F64))


def test_second_derivative_norm_of_a_known_map():
    p = 4
    value = P.second_derivative_norm(lambda x: x**2, randn(3, p))  # D^2 f_i = 2 e_i e_i^T
    assert math.isclose(value, math.sqrt(4 * p), rel_tol=1e-12)
    with pytest.raises(TypeError, match="fn"):
        P.second_derivative_norm(1, randn(3, p))
    with pytest.raises(ValueError, match="points"):
        P.second_derivative_norm(lambda x: x, randn(p))


# ------------------------------------------------------------------------------------------- Fisher matrices
def test_empirical_fisher_matches_per_sample_gradients():
    prob, theta, X, Y = net_problem(2, n=5, d=3, m=3, d_y=2)
    J, r = prob.jacobian(theta), prob.residual(theta)
    ref = torch.zeros(theta.numel(), theta.numel(), dtype=F64)
    for i in range(5):
        def ell(th, i=i):
            return 0.5 * prob.residual(th).reshape(5, 2)[i].square().sum()
        g = torch.autograd.functional.jacobian(ell, theta)
        ref += torch.outer(g, g) / 5
    torch.testing.assert_close(P.empirical_fisher(J, r, 5), ref)


def test_fisher_mc_is_unbiased_for_gn():
    prob, theta, _, _ = net_problem(3, n=4, d=2, m=2, d_y=2)
    J = prob.jacobian(theta)
    draws = P.fisher_mc(J, 4, 20000, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (20000, theta.numel(), theta.numel())
    se = draws.std(0) / math.sqrt(20000)
    assert bool(((draws.mean(0) - J.T @ J / 4).abs() <= 6 * se + 1e-12).all())


def test_fisher_errors():
    J, r = randn(6, 3), randn(6)
    with pytest.raises(ValueError, match="n"):
        P.empirical_fisher(J, r, 4)
    with pytest.raises(ValueError, match="r"):
        P.empirical_fisher(J, randn(5), 3)
    with pytest.raises(ValueError, match="draws"):
        P.fisher_mc(J, 3, 0)


def test_ef_linear_regression_against_monte_carlo():
    Sigma, half = linalg.covariance(torch.tensor([0.5, 1.0, 2.0], dtype=F64), generator=torch.Generator().manual_seed(1))
    e, sig = torch.tensor([0.3, -0.5, 0.2], dtype=F64), 0.4
    n = 200_000
    x = randn(n, 3, seed=4) @ half
    res = x @ e - sig * randn(n, seed=5)
    terms = res[:, None, None] ** 2 * x[:, :, None] * x[:, None, :]
    se = terms.std(0) / math.sqrt(n)
    pred = P.ef_linear_regression(Sigma, e, sig)
    assert bool(((terms.mean(0) - pred).abs() <= 6 * se).all())
    batch = P.ef_linear_regression(Sigma, torch.stack([e, 2 * e]), sig)
    torch.testing.assert_close(batch[0], pred)
    step = torch.linalg.solve(pred, Sigma @ e)
    torch.testing.assert_close(step, e / (sig**2 + 3 * e @ Sigma @ e))
    with pytest.raises(ValueError, match="e must"):
        P.ef_linear_regression(Sigma, torch.ones(2, dtype=F64))
    with pytest.raises(ValueError, match="sigma_eps"):
        P.ef_linear_regression(Sigma, e, -1.0)


def test_gn_step_cost():
    assert P.gn_step_cost(10, 30) == {"parameter": 10 * 900 + 9000, "kernel": 100 * 30 + 1000 // 3}
    with pytest.raises(ValueError, match="p"):
        P.gn_step_cost(10, 0)


# ------------------------------------------------------------------------------------------- Kronecker factors
def mlp_fn(Ws, X, act, layer):
    def f(w_flat):
        ws = list(Ws)
        ws[layer] = w_flat.reshape(Ws[layer].shape)
        a = X
        for i, W in enumerate(ws):
            a = a @ W.T
            if i < len(ws) - 1:
                a = act(a)
        return a  # (n, d_y)
    return f


@pytest.mark.parametrize("act", [torch.tanh, lambda z: z])
def test_layer_jacobian_and_blocks_match_torch_func(act):
    X = randn(7, 3)
    Ws = [randn(4, 3, seed=1), randn(5, 4, seed=2), randn(2, 5, seed=3)]
    for layer, (B, a) in enumerate(P.mlp_layer_factors(Ws, X, act)):
        J = torch.func.jacrev(mlp_fn(Ws, X, act, layer))(Ws[layer].reshape(-1))  # (n, d_y, p_l)
        torch.testing.assert_close(P.layer_jacobian(B, a), J)
        torch.testing.assert_close(P.layer_gn_block(B, a), torch.einsum("iyp,iyq->pq", J, J) / 7)
        r = randn(7, 2, seed=9)
        g = torch.einsum("iyp,iy->ip", J, r)
        torch.testing.assert_close(P.layer_ef_block(B, a, r), g.T @ g / 7)


def test_kfac_factors_type2_empirical_and_exact_cases():
    X = randn(9, 3)
    Ws = [randn(4, 3, seed=1), randn(2, 4, seed=2)]
    (B1, a1), (B2, a2) = P.mlp_layer_factors(Ws, X, act=lambda z: z)
    for B, a in [(B1, a1), (B2, a2)]:
        C_out, C_in = P.kfac_factors(B, a)
        torch.testing.assert_close(C_in, a.T @ a / 9)
        torch.testing.assert_close(C_out, torch.einsum("iyo,iyq->oq", B, B) / 9)
        torch.testing.assert_close(linalg.kron(C_out, C_in), P.layer_gn_block(B, a))  # deep linear: exact
    r = randn(9, 2, seed=4)
    C_out, _ = P.kfac_factors(B1, a1, residual=r)
    g = torch.einsum("iyo,iy->io", B1, r)
    torch.testing.assert_close(C_out, g.T @ g / 9)
    u = randn(20000, 9, 2, seed=5)  # type-2 = E over model labels u ~ N(0, I)
    gu = torch.einsum("iyo,biy->bio", B1, u)
    mc = torch.einsum("bio,biq->oq", gu, gu) / (9 * 20000)
    torch.testing.assert_close(mc, P.kfac_factors(B1, a1)[0], atol=0.1 * float(mc.abs().max()), rtol=0)


def test_weight_sharing_jacobian_matches_torch_func():
    x = randn(5, 8)
    patches = P.conv1d_patches(x, kernel=3)  # (5, 6, 3)
    U = randn(6, 2, 4, seed=1)  # readout per position: f = sum_s U_s W a_s
    W = randn(4, 3, seed=2)
    f = lambda w: torch.einsum("syo,oj,isj->iy", U, w.reshape(4, 3), patches)
    J = torch.func.jacrev(f)(W.reshape(-1))
    B = U.expand(5, *U.shape)
    torch.testing.assert_close(P.layer_jacobian(B, patches), J)
    C_out, C_in = P.kfac_factors(B, patches)
    torch.testing.assert_close(C_in, torch.einsum("isj,isk->jk", patches, patches) / 30)
    torch.testing.assert_close(C_out, torch.einsum("syo,syq->oq", U, U))


def test_conv1d_patches_and_errors():
    x = torch.arange(10, dtype=F64).reshape(2, 5)
    p = P.conv1d_patches(x, 2, stride=2)
    torch.testing.assert_close(p[0], torch.tensor([[0.0, 1.0], [2.0, 3.0]], dtype=F64))
    with pytest.raises(ValueError, match="kernel"):
        P.conv1d_patches(x, 6)
    with pytest.raises(ValueError, match="stride"):
        P.conv1d_patches(x, 2, stride=0)


def test_factor_errors():
    with pytest.raises(TypeError, match="Ws"):
        P.mlp_layer_factors([], randn(3, 2))
    with pytest.raises(ValueError, match="Ws\\[1\\]"):
        P.mlp_layer_factors([randn(4, 2), randn(3, 5)], randn(3, 2))
    with pytest.raises(ValueError, match="a and B"):
        P.layer_jacobian(randn(3, 2, 4), randn(4, 5))
    with pytest.raises(ValueError, match="residual"):
        P.kfac_factors(randn(3, 2, 4), randn(3, 5), residual=randn(3, 3))
    with pytest.raises(ValueError, match="residual"):
        P.layer_ef_block(randn(3, 2, 4), randn(3, 5), randn(2, 2))


def test_relative_error():
    A = randn(3, 3)
    assert P.relative_error(A, A) == 0.0
    assert math.isclose(P.relative_error(2 * A, A), 1.0)
    with pytest.raises(ValueError, match="shape"):
        P.relative_error(A, randn(2, 2))
    with pytest.raises(ValueError, match="exact"):
        P.relative_error(A, torch.zeros(3, 3, dtype=F64))


# ------------------------------------------------------------------------------------------- figures
def test_plot_paths_and_contours():
    fig, ax = plt.subplots()
    q = P.quadratic(5.0)
    path = P.run(q, "GD", [-1.0, 1.0], 5, eta=0.5)
    P.plot_paths(ax, q, {"GD": path, "GN": P.run(q, "GN", [-1.0, 1.0], 1)}, (-2, 2), (-2, 2), labels={"GN": "x"})
    assert [line.get_label() for line in ax.get_lines()][:2] == ["GD", "x"]
    with pytest.raises(ValueError, match="registry"):
        P.plot_paths(ax, q, {"Foo": path}, (-2, 2), (-2, 2))
    with pytest.raises(ValueError, match="levels"):
        P.loss_contours(ax, q, (-1, 1), (-1, 1), levels=1)
    plt.close(fig)


def test_second_derivative_norm_through_a_solve_matches_finite_differences():
    ds = P.dennis_schnabel(-0.6)  # the GN map calls torch.linalg.solve
    G, z = P.gn_map(ds), torch.zeros(2, dtype=F64)
    h, eye = 1e-5, torch.eye(2, dtype=F64)
    jac = torch.func.jacrev(G)
    fd = torch.stack([(jac(z + h * eye[k]) - jac(z - h * eye[k])) / (2 * h) for k in range(2)], dim=-1)
    assert math.isclose(P.second_derivative_norm(G, z[None]), float(fd.norm()), rel_tol=1e-6)
    e = 1e-4 * torch.tensor([1.0, 1.0], dtype=F64) / math.sqrt(2)
    q = G(e) - jac(z) @ e  # the Taylor remainder is within the bound
    assert float(q.norm()) <= 0.5 * P.second_derivative_norm(G, torch.stack([z, e])) * float(e.norm()) ** 2


def test_update_rule_errors():
    q = P.quadratic(3.0)
    theta = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="eta"):
        P.gd_step(q, theta, 0.0)
    with pytest.raises(TypeError, match="problem"):
        P.gd_step(None, theta, 0.1)
    with pytest.raises(ValueError, match="lam_GN"):
        P.gn_step(q, theta, lam_GN=-1.0)
    with pytest.raises(TypeError, match="problem"):
        P.newton_step("q", theta)
    with pytest.raises(ValueError, match="shrink"):
        P.armijo_step(q, theta, q.gradient(theta), shrink=1.5)
    with pytest.raises(ValueError, match="lam_GN"):
        P.lm_step(q, theta, 0.0)
    with pytest.raises(ValueError, match="up"):
        P.lm_step(q, theta, 1.0, up=0.5)
