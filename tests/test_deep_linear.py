"""Tests for curvlab.deep_linear: every structured route against the dense torch.func GN matrix, the bounds on
random networks (including bottlenecks), and bad input. The pseudo-sigma_min counter-example lives here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import curvature as cv
from curvlab import deep_linear as dl
from curvlab.linalg import kron

F64 = torch.float64
FAST = settings(max_examples=12, deadline=None)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=gen(seed))


def top(M, k):
    return torch.linalg.eigvalsh(M).flip(-1)[:k]


def dense_rank(H):
    e = torch.linalg.eigvalsh(H).flip(-1)
    return int((e > H.shape[0] * torch.finfo(F64).eps * e[0]).sum())


nets = st.tuples(st.integers(1, 5), st.lists(st.integers(1, 6), min_size=0, max_size=3), st.integers(1, 4))


# --------------------------------------------------------------------------------------------- structure
@FAST
@given(net=nets, seed=seeds)
def test_reduced_routes_match_dense_gn(net, seed):
    d, widths, d_y = net
    Ws = dl.init_weights(d, widths, d_y, generator=gen(seed))
    X = randn(3 * d + 2, d, seed=seed + 1)
    S = dl.second_moment(X)
    H = dl.gn_dense(Ws, X)
    G = dl.gamma_matrix(Ws)
    torch.testing.assert_close(H, G.T @ kron(torch.eye(d_y, dtype=F64), S) @ G)
    Hr = dl.gn_reduced(Ws, S)
    torch.testing.assert_close(Hr, dl.gn_reduced_naive(Ws, S))
    F = dl.reduced_factor(Ws, S)
    torch.testing.assert_close(F @ F.T, Hr)
    k, scale = min(d * d_y, H.shape[0]), float(top(H, 1))  # p may be below d_y d
    torch.testing.assert_close(top(H, k), top(Hr, k), atol=1e-11 * scale, rtol=0)
    torch.testing.assert_close(dl.spectrum_reduced(Ws, S, method="svd"), top(Hr, d * d_y), atol=1e-11 * scale, rtol=0)
    assert dense_rank(H) == dl.rank_gn(d, widths, d_y)


def test_residual_and_gains_match_dense():
    g = gen(3)
    Ws = dl.init_weights(4, [6, 6, 6], 3, scale=0.4, generator=g)
    X = randn(17, 4, seed=4)
    gains = [torch.rand(6, generator=g, dtype=F64) + 0.5 for _ in range(3)]
    for zeta, gs in ((0.8, None), (0.0, gains), (0.8, gains)):
        H = dl.gn_dense(Ws, X, skip_scale=zeta, gains=gs)
        Hr = dl.gn_reduced(Ws, dl.second_moment(X), skip_scale=zeta, gains=gs)
        torch.testing.assert_close(top(H, 12), top(Hr, 12), atol=1e-12 * float(top(H, 1)), rtol=0)
        out = dl.forward(Ws, X, skip_scale=zeta, gains=gs)
        H_ = X
        for l, W in enumerate(Ws, start=1):
            Wl = W + zeta * torch.eye(6, dtype=F64) if 2 <= l <= 3 else W
            H_ = H_ @ Wl.T
            if gs is not None and l <= 3:
                H_ = H_ * gs[l - 1]
        torch.testing.assert_close(out, H_)


def test_batched_spectra_equal_unbatched():
    Ws = dl.init_weights(3, [5, 4], 2, batch=(4,), generator=gen(0))
    eig = dl.spectrum_reduced(Ws)
    for i in range(4):
        torch.testing.assert_close(eig[i], dl.spectrum_reduced([W[i] for W in Ws]))
    c = dl.gn_condition(Ws)
    assert c.kappa.shape == (4,) and c.rank == 6 and bool((c.numerical_rank == 6).all())


def test_theta_roundtrip_and_flat_model():
    Ws = dl.init_weights(3, [4], 2, generator=gen(1))
    th = dl.theta_of(Ws)
    back = dl.weights_of(th, [tuple(W.shape) for W in Ws])
    for a, b in zip(Ws, back):
        torch.testing.assert_close(a, b)
    X = randn(5, 3)
    fn = dl.flat_model(X, [tuple(W.shape) for W in Ws])
    torch.testing.assert_close(fn(th), (X @ Ws[0].T @ Ws[1].T).reshape(-1))


def test_init_schemes():
    Ws = dl.init_weights(200, [400], 100, scheme="lecun", generator=gen(0))
    assert abs(float(Ws[0].var()) * 200 - 1) < 0.05
    Ws = dl.init_weights(200, [400], 100, scheme="kaiming", generator=gen(0))
    assert abs(float(Ws[0].var()) * 200 - 2) < 0.1
    Ws = dl.init_weights(3, [5], 2, scheme="orthogonal", generator=gen(0))
    torch.testing.assert_close(Ws[0].T @ Ws[0], torch.eye(3, dtype=F64))
    torch.testing.assert_close(Ws[1] @ Ws[1].T, torch.eye(2, dtype=F64))


def test_rank_formula_with_bottlenecks():
    assert dl.rank_gn(6, [4], 3) == 18
    assert dl.rank_gn(6, [2, 8], 3) == 2 * (6 + 3 - 2)
    assert dl.rank_gn(3, [], 2) == 6


def test_condition_reports_rank_and_gap():
    c = dl.condition(torch.tensor([4.0, 2.0, 1.0, 1e-20], dtype=F64), rank=3)
    assert math.isclose(float(c.kappa), 4.0) and float(c.gap) > 1e15 and int(c.numerical_rank) == 3
    ref = cv.condition_number(torch.tensor([4.0, 2.0, 1.0, 1e-20], dtype=F64), rank=3)
    assert math.isclose(float(c.kappa), ref.kappa) and math.isclose(float(c.gap), ref.gap)
    with pytest.raises(ValueError, match="svd"):
        dl.condition(torch.tensor([1.0, -1e-17], dtype=F64), rank=2)


# --------------------------------------------------------------------------------------------- bounds
def test_two_layer_whitened_bound_is_an_equality():
    for m in (3, 4, 5, 9):  # m >= d_y = 3, including m below d = 6
        Ws = dl.init_weights(6, [m], 3, generator=gen(m))
        kappa = float(dl.gn_condition(Ws).kappa)
        assert math.isclose(kappa, float(dl.kappa_bound(Ws, kind="ratio")), rel_tol=1e-9)
        sV, sW = torch.linalg.svdvals(Ws[1]), dl._svals(Ws[0], 6)
        sums = (sV[:, None] ** 2 + sW[None, :] ** 2).reshape(-1).sort(descending=True).values
        torch.testing.assert_close(dl.spectrum_reduced(Ws), sums)


def test_pseudo_sigma_min_counter_example_and_exact_bound_never_fails():
    """The digest's example (L = 2, Sigma = I, d = 6, d_y = 3, m = 4) and random nets with a width below d:
    the bound with sigma_{d_y}/sigma_d always holds; with the smallest NONZERO singular values it fails."""
    violations, n_nets = 0, 0
    Ws = dl.init_weights(6, [4], 3, generator=gen(0))
    assert float(dl.gn_condition(Ws).kappa) > float(dl.kappa_bound(Ws, kind="pseudo")) * 1.01
    for seed in range(60):
        g = gen(100 + seed)
        L = 2 + seed % 3
        widths = [int(torch.randint(3, 6, (1,), generator=g)) for _ in range(L - 1)]
        Ws = dl.init_weights(6, widths, 3, generator=g)
        X = randn(20, 6, seed=seed)
        S = dl.second_moment(X)
        kappa = dl.gn_condition(Ws, S).kappa
        for kind in ("ratio", "sigma_inside"):
            assert float(kappa) <= float(dl.kappa_bound(Ws, S, kind=kind)) * (1 + 1e-9)
        n_nets += 1
        violations += float(kappa) > float(dl.kappa_bound(Ws, S, kind="pseudo")) * (1 + 1e-9)
    assert violations >= n_nets // 5, (violations, n_nets)


def test_bound_orderings_full_width():
    Ws = dl.init_weights(4, [6, 7], 3, batch=(5,), generator=gen(2))
    S = dl.second_moment(randn(30, 4, seed=3))
    kappa = dl.gn_condition(Ws, S).kappa
    inside, ratio = dl.kappa_bound(Ws, S, kind="sigma_inside"), dl.kappa_bound(Ws, S, kind="ratio")
    convex, loose = dl.kappa_bound(Ws, S, kind="convex"), dl.kappa_bound(Ws, S, kind="loose")
    assert bool((kappa <= inside * (1 + 1e-9)).all()) and bool((inside <= ratio * (1 + 1e-9)).all())
    torch.testing.assert_close(convex, ratio)
    assert bool((ratio <= loose * (1 + 1e-9)).all())
    t = dl.bound_terms(Ws)
    assert t["out_max"].shape == (5, 3)


def test_convex_form_undefined_with_bottleneck_and_singular_sigma():
    Ws = dl.init_weights(6, [4], 3, generator=gen(0))
    with pytest.raises(ValueError, match="0 \\* inf"):
        dl.kappa_bound(Ws, kind="convex")
    assert math.isinf(float(dl.kappa_bound(Ws, kind="loose")))
    S = dl.second_moment(randn(4, 6))  # n < d: singular
    with pytest.raises(ValueError, match="singular"):
        dl.kappa_bound(Ws, S, kind="ratio")
    assert torch.isfinite(dl.kappa_bound(Ws, dl.second_moment(randn(30, 6)), kind="ratio"))


def test_residual_weyl_bound_holds():
    for seed in range(5):
        Ws = dl.init_weights(3, [5, 5, 5, 5], 2, scale=0.3, generator=gen(seed))
        S = dl.second_moment(randn(20, 3, seed=seed))
        kappa = float(dl.gn_condition(Ws, S, skip_scale=1.0).kappa)
        assert kappa <= float(dl.kappa_bound(Ws, S, skip_scale=1.0)) * (1 + 1e-9)
        assert float(dl.kappa_bound(Ws, S, skip_scale=1.0)) <= float(dl.residual_weyl_bound(Ws, 1.0, S)) * (1 + 1e-9)
    with pytest.raises(ValueError, match="square"):
        dl.residual_weyl_bound(dl.init_weights(3, [5, 4, 5], 2), 1.0)


def test_mp_and_lyapunov():
    torch.testing.assert_close(dl.mp_kappa(0.25), torch.tensor(3.0, dtype=F64))
    k = dl.mp_kappa_two_layer(40, 20, 4000)
    Ws = dl.init_weights(40, [4000], 20, generator=gen(0))
    assert abs(float(dl.gn_condition(Ws).kappa) / k - 1) < 0.05
    mu = dl.lyapunov_exponents(6, 3)
    # Monte Carlo: E log chi^2_{m-i+1}/m via QR of Gaussian m x k matrices
    G = randn(20000, 6, 3, seed=1) / math.sqrt(6)
    R = torch.linalg.qr(G, mode="r")[1]
    mc = torch.log(torch.diagonal(R, dim1=-2, dim2=-1).abs()).mean(0)
    torch.testing.assert_close(mc, mu, atol=0.02, rtol=0)
    mu50 = dl.lyapunov_exponents(50, 4)
    assert math.isclose(dl.depth_slope(50, 4, 10), float(2 * (mu50[0] - mu50[-1])))
    assert math.isclose(dl.depth_slope(50, 4, 10), dl.depth_slope(50, 10, 4))
    with pytest.raises(ValueError):
        dl.depth_slope(3, 4, 2)


# --------------------------------------------------------------------------------------------- leaky ReLU
@FAST
@given(seed=seeds, bias=st.booleans(), alpha=st.sampled_from([0.05, 0.3, 1.0]))
def test_leaky_gram_matches_dense(seed, bias, alpha):
    n, d, m, d_y = 7, 4, 5, 3
    W, V, X = randn(m, d, seed=seed), randn(d_y, m, seed=seed + 1), randn(n, d, seed=seed + 2)
    b = randn(m, seed=seed + 3) if bias else None
    fn, unflatten = dl.leaky_flat_model(X, d, m, d_y, alpha, bias)
    theta = torch.cat([W.reshape(-1)] + ([b] if bias else []) + [V.reshape(-1)])
    torch.testing.assert_close(fn(theta), dl.leaky_forward(W, V, X, alpha, b).reshape(-1))
    H = cv.gn_matrix(fn, theta, scale=1 / n)
    K = dl.leaky_relu_gram(W, V, X, alpha, b)
    torch.testing.assert_close(top(H, n * d_y), top(K, n * d_y), atol=1e-11 * float(top(K, 1)), rtol=0)
    assert dense_rank(H) <= dl.leaky_relu_rank(W, X, d_y, b)


def test_leaky_bound_holds_and_the_slope_free_guess_fails():
    n, d, d_y = 12, 20, 4
    X = randn(n, d, seed=0)
    broken = 0
    for seed, (m, alpha) in enumerate([(6, 0.01), (6, 0.1), (12, 0.3), (30, 0.05), (60, 1.0)]):
        W, V = randn(m, d, seed=seed) / math.sqrt(d), randn(d_y, m, seed=seed + 9) / math.sqrt(m)
        e = torch.linalg.eigvalsh(dl.leaky_relu_gram(W, V, X, alpha))
        kappa = float(e[-1] / e[0])
        assert kappa <= float(dl.leaky_relu_bound(W, V, X, alpha)) * (1 + 1e-9)
        broken += kappa > float(dl.leaky_relu_bound(W, V, X, alpha, slope_factor=False))
    assert broken >= 1


def test_leaky_rank_drops_with_linear_units():
    g = gen(5)
    X = 0.3 * torch.randn(40, 3, generator=g, dtype=F64) + 4.0  # far from the origin: units act linearly
    W = torch.randn(8, 3, generator=g, dtype=F64) / math.sqrt(3)
    V = torch.randn(4, 8, generator=g, dtype=F64)
    b = 0.5 * torch.randn(8, generator=g, dtype=F64)
    assert int(dl.linear_units(W, X, b).sum()) >= 6
    K = dl.leaky_relu_gram(W, V, X, 0.1, b)
    r = dense_rank(K)
    assert r <= dl.leaky_relu_rank(W, X, 4, b) < min(40 * 4, 8 * (3 + 1 + 4) - 8)


# --------------------------------------------------------------------------------------------- pruning, data, BN
def test_masks_and_masked_reduced_matrix():
    Ws = dl.init_weights(3, [5, 4], 2, generator=gen(7))
    masks = dl.magnitude_masks(Ws, 0.4)
    for W, M in zip(Ws, masks):
        assert int(M.sum()) == math.ceil(0.6 * W.numel())
        assert float(W.abs()[M].min()) >= float(W.abs()[~M].max())
    X = randn(15, 3, seed=8)
    sel = torch.cat([M.reshape(-1) for M in masks])
    H = dl.gn_dense([W * M for W, M in zip(Ws, masks)], X)[sel][:, sel]
    Hm = dl.gn_reduced_masked(Ws, masks, dl.second_moment(X))
    torch.testing.assert_close(top(H, 6), top(Hm, 6), atol=1e-12 * float(top(H, 1)), rtol=0)
    full = dl.gn_reduced_masked(Ws, [torch.ones_like(W, dtype=torch.bool) for W in Ws], dl.second_moment(X))
    torch.testing.assert_close(full, dl.gn_reduced(Ws, dl.second_moment(X)))


def test_whiten_digits_and_batchnorm():
    X, Y, kept = dl.digits(200, seed=0)
    assert Y.shape == (200, 10) and X.shape[1] == len(kept) < 64 and bool((X.std(0) > 0).all())
    Xw, lam = dl.whiten(X)
    torch.testing.assert_close(dl.second_moment(Xw), torch.eye(Xw.shape[1], dtype=F64), atol=1e-9, rtol=0)
    Xc = dl.digits(60, seed=0, center=True)[0][:, :12]
    Ws = dl.init_weights(Xc.shape[1], [6], 4, generator=gen(0))
    gains = dl.batchnorm_gains(Ws, Xc)
    h = (Xc @ Ws[0].T) * gains[0]
    torch.testing.assert_close(h.var(0, unbiased=False), torch.ones(6, dtype=F64))
    # frozen BN = diagonal gains: reduced route equals the dense GN of the normalised network
    H = dl.gn_dense(Ws, Xc, gains=gains)
    Hr = dl.gn_reduced(Ws, dl.second_moment(Xc), gains=gains)
    k = 4 * Xc.shape[1]
    torch.testing.assert_close(top(H, k), top(Hr, k), atol=1e-10 * float(top(H, 1)), rtol=0)
    # train-mode BN: a dense model whose outputs are invariant to rescaling a hidden unit's weights
    fn = dl.bn_train_model(Xc[:40], [tuple(W.shape) for W in Ws], eps=0.0)
    th = dl.theta_of(Ws)
    th2 = dl.theta_of([Ws[0] * 3.0, Ws[1]])
    torch.testing.assert_close(fn(th), fn(th2), atol=1e-6, rtol=0)


def test_train_gd_decreases_loss_and_keeps_masks():
    X, Y, _ = dl.digits(100, seed=1)
    Xw = dl.whiten(X)[0]
    Ws = dl.init_weights(Xw.shape[1], [20], 10, generator=gen(0))
    masks = dl.magnitude_masks(Ws, 0.5)
    rows = dl.train_gd(Ws, Xw, Y, eta=0.2, steps=30, every=10, masks=masks,
                       record=lambda t, W: {"zeros": int(sum(int((w[~m] != 0).sum()) for w, m in zip(W, masks)))})
    assert [r["step"] for r in rows] == [0, 10, 20, 30]
    assert rows[-1]["loss"] < rows[0]["loss"] and all(r["zeros"] == 0 for r in rows)
    with pytest.raises(ValueError, match="diverged"):
        dl.train_gd(Ws, Xw, Y, eta=1e6, steps=20)


# --------------------------------------------------------------------------------------------- bad input
def test_bad_inputs():
    Ws = dl.init_weights(3, [4], 2)
    with pytest.raises(ValueError, match="incompatible widths"):
        dl.gn_reduced([Ws[0], torch.zeros(2, 5, dtype=F64)])
    with pytest.raises(ValueError, match="non-finite"):
        dl.gn_reduced([Ws[0], Ws[1] * float("nan")])
    with pytest.raises(TypeError, match="list of weight"):
        dl.gn_reduced(Ws[0])
    with pytest.raises(ValueError, match="d x d"):
        dl.gn_reduced(Ws, torch.eye(4, dtype=F64))
    with pytest.raises(ValueError, match="kind"):
        dl.kappa_bound(Ws, kind="tight")
    with pytest.raises(ValueError, match="method"):
        dl.spectrum_reduced(Ws, method="qr")
    with pytest.raises(ValueError, match="alpha"):
        dl.leaky_relu_gram(torch.ones(2, 3), torch.ones(1, 2), torch.ones(4, 3), alpha=1.5)
    with pytest.raises(ValueError, match="V must have"):
        dl.leaky_relu_gram(torch.ones(2, 3), torch.ones(1, 3), torch.ones(4, 3), alpha=0.5)
    with pytest.raises(ValueError, match="sparsity"):
        dl.magnitude_masks(Ws, 1.0)
    with pytest.raises(ValueError, match="m must exceed"):
        dl.mp_kappa_two_layer(10, 5, 8)
    with pytest.raises(TypeError, match="gains"):
        dl.gn_reduced(Ws, gains=[torch.ones(4), torch.ones(2)])
    with pytest.raises(ValueError, match="X must have"):
        dl.forward(Ws, torch.ones(5, 4))
    with pytest.raises(ValueError, match="n must be"):
        dl.digits(5000)


def test_conditioning_frame_nested_networks_and_min_loss():
    Ws = dl.init_weights(4, [6, 5], 3, batch=(3,), generator=gen(11))
    frame = dl.conditioning_frame(Ws, bounds=("ratio", "loose"), L=3, rule="x")
    assert list(frame.columns[:3]) == ["L", "rule", "seed"] and len(frame) == 3
    torch.testing.assert_close(torch.tensor(frame.kappa.to_numpy()), dl.gn_condition(Ws).kappa)
    torch.testing.assert_close(torch.tensor(frame["ratio/kappa"].to_numpy()),
                               dl.kappa_bound(Ws, kind="ratio") / dl.gn_condition(Ws).kappa)
    nets = dl.nested_networks(3, 5, 2, [2, 4, 6], batch=(2,), generator=gen(12))
    assert [len(nets[L]) for L in (2, 4, 6)] == [2, 4, 6]
    assert nets[4][1] is nets[6][1] and nets[2][0] is nets[6][0] and nets[2][-1] is nets[6][-1]
    assert nets[6][3].shape == (2, 5, 5)
    X, Y = randn(30, 4, seed=13), randn(30, 3, seed=14)
    M = torch.linalg.solve(X.T @ X, X.T @ Y)
    assert math.isclose(dl.min_loss(X, Y), float((X @ M - Y).square().sum() / 60), rel_tol=1e-10)
    with pytest.raises(ValueError, match="rows"):
        dl.min_loss(X, Y[:5])


# ----------------------------------------------------------------------------- kappa-only route


@pytest.mark.parametrize("widths, batch", [([12, 12], ()), ([9], (2,))])
def test_gn_kappa_matches_eigh_route(widths, batch):
    gen = torch.Generator().manual_seed(7)
    Ws = dl.init_weights(6, widths, 4, batch=batch, generator=gen)
    k_fast = dl.gn_kappa(Ws)
    k_ref = dl.gn_condition(Ws).kappa
    torch.testing.assert_close(k_fast, k_ref, rtol=1e-8, atol=0)


def test_gn_kappa_with_sigma_and_bottleneck_fallback():
    gen = torch.Generator().manual_seed(8)
    Ws = dl.init_weights(6, [10], 3, generator=gen)
    X = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    S = X.T @ X / 40
    torch.testing.assert_close(dl.gn_kappa(Ws, S), dl.gn_condition(Ws, S).kappa, rtol=1e-8, atol=0)
    Wb = dl.init_weights(6, [2], 3, generator=gen)  # bottleneck: rank < d d_y, falls back to eigvalsh
    torch.testing.assert_close(dl.gn_kappa(Wb), dl.gn_condition(Wb).kappa, rtol=1e-12, atol=0)


def test_gn_kappa_bad_input():
    with pytest.raises(ValueError):
        dl.gn_kappa([torch.ones(3, 4), torch.ones(2, 5)])


@pytest.mark.parametrize("d, m, k", [(8, 5, 4), (6, 10, 3), (4, 3, 7), (16, 32, 10)])
def test_two_layer_whitened_spectrum_is_the_kronecker_sum_of_the_formed_matrix(d, m, k):
    """The closed form spectrum_reduced uses for L = 2, Sigma = I (bottlenecks included) against eigvalsh of the
    formed reduced matrix, batched; with a covariance the formed route is taken."""
    g = torch.Generator().manual_seed(d * m * k)
    Ws = dl.init_weights(d, [m], k, batch=(3,), generator=g)
    ref = torch.linalg.eigvalsh(dl.gn_reduced(Ws)).flip(-1)
    fast = dl.spectrum_reduced(Ws)
    assert fast.shape == ref.shape
    assert float((fast - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    Sigma = A @ A.T / d + torch.eye(d, dtype=torch.float64)
    ref_S = torch.linalg.eigvalsh(dl.gn_reduced(Ws, Sigma)).flip(-1)
    assert torch.allclose(dl.spectrum_reduced(Ws, Sigma), ref_S)
    with pytest.raises(ValueError, match="skip_scale"):
        dl.spectrum_reduced(Ws, skip_scale=-1.0)
