"""Tests for curvlab.conv: the Toeplitz matrix against torch's conv2d, the reduced GN matrix against the dense
torch.func GN matrix of the nn.Conv2d model, the kappa bound (and its equality when the kernel covers the image),
whitening in pixel space, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import conv as cv

F64 = torch.float64
FAST = settings(max_examples=10, deadline=None)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def top(M, k):
    return torch.linalg.eigvalsh(M).flip(-1)[:k]


@FAST
@given(st.integers(2, 6), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_toeplitz_is_conv2d(N, c, s, padding, seed):
    s = min(s, N)
    padding = min(padding, s - 1)
    K = torch.randn(c, s, s, dtype=F64, generator=gen(seed))
    x = torch.randn(3, N * N, dtype=F64, generator=gen(seed + 1))
    T = cv.toeplitz(K, N, padding)
    ref = torch.nn.functional.conv2d(x.view(3, 1, N, N), K.view(c, 1, s, s), padding=padding).reshape(3, -1)
    o = cv.output_side(N, s, padding)
    assert T.shape == (c * o * o, N * N)
    torch.testing.assert_close(x @ T.T, ref, rtol=0, atol=1e-12)


def test_shift_matrices_are_unfold():
    x = torch.randn(1, 1, 5, 5, dtype=F64, generator=gen(0))
    S = cv.shift_matrices(5, 3, 1)
    unf = torch.nn.functional.unfold(x, 3, padding=1)[0]           # (s^2, o^2)
    torch.testing.assert_close(S @ x.reshape(-1), unf, rtol=0, atol=0)


@FAST
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(0, 1), st.integers(0, 2**31 - 1))
def test_readout_unfold_is_jacobian_in_K(c, s, d_y, padding, seed):
    N = 4
    s = min(s, N)
    padding = min(padding, s - 1)
    K, V = cv.init_weights(c, s, d_y, image=N, padding=padding, generator=gen(seed))
    J = torch.func.jacrev(lambda k: (V @ cv.toeplitz(k, N, padding)).reshape(-1))(K).reshape(d_y * N * N, -1)
    torch.testing.assert_close(cv.readout_unfold(V, c, s, N, padding), J, rtol=0, atol=1e-12)


@pytest.mark.parametrize("c,s,padding", [(2, 3, 0), (3, 2, 0), (2, 3, 1), (1, 4, 0)])
def test_reduced_matches_dense_torch_func(c, s, padding):
    N, d_y, n = 5, 3, 40
    K, V = cv.init_weights(c, s, d_y, image=N, padding=padding, generator=gen(c + s))
    X = torch.randn(n, N * N, dtype=F64, generator=gen(7)) * torch.linspace(0.5, 2, N * N, dtype=F64)
    H = cv.gn_dense(K, V, X, N, padding)
    Hr = cv.gn_reduced(K, V, X.T @ X / n, N, padding)
    k = min(H.shape[0], Hr.shape[0])
    scale = float(torch.linalg.eigvalsh(H)[-1])
    torch.testing.assert_close(top(H, k), top(Hr, k), rtol=0, atol=1e-10 * scale)
    # weight sharing matters: the dense-layer formula is a different matrix
    foil = top(cv.gn_reduced_dense_foil(K, V, X.T @ X / n, N, padding), k)
    assert float((foil - top(Hr, k)).abs().max()) > 1e-3 * scale


@FAST
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_bound_holds_and_is_equality_when_kernel_covers_image(c, s, seed):
    N, d_y = 4, 2
    K, V = cv.init_weights(c + 3, s, d_y, image=N, batch=(3,), generator=gen(seed))
    if (c + 3) * cv.output_side(N, s) ** 2 >= N * N:                   # W = T(K) of full column rank
        kap = cv.gn_condition(K, V, image=N).kappa
        assert bool((kap <= cv.kappa_bound(K, V, image=N) * (1 + 1e-9)).all())
    K, V = cv.init_weights(max(c, d_y), N, d_y, image=N, batch=(3,), generator=gen(seed))   # s = N: a dense layer
    torch.testing.assert_close(cv.gn_condition(K, V, image=N).kappa, cv.kappa_bound(K, V, image=N), rtol=1e-9,
                               atol=0)


def test_whiten_images_projection_and_zero_pixels():
    X = torch.rand(30, 16, dtype=F64, generator=gen(1))
    X[:, [0, 5]] = 0                                                 # pixels that are zero in every image
    Xw, U = cv.whiten_images(X, 4)
    assert U.shape == (16, 14)
    torch.testing.assert_close(Xw.T @ Xw / 30, U @ U.T, rtol=0, atol=1e-10)
    assert float(Xw[:, [0, 5]].abs().max()) < 1e-12


def test_condition_rank_is_dy_times_rank_sigma():
    X = torch.rand(30, 16, dtype=F64, generator=gen(2))
    X[:, 0] = 0
    Xw, U = cv.whiten_images(X, 4)
    K, V = cv.init_weights(4, 2, 3, image=4, generator=gen(3))
    cond = cv.gn_condition(K, V, Xw.T @ Xw / 30, 4)
    assert cond.rank == 3 * 15 and float(cond.gap) > 1e8
    frame = cv.conditioning_frame(K.unsqueeze(0), V.unsqueeze(0), U @ U.T, 4, c=4, s=2)
    assert list(frame.columns[:5]) == ["kappa", "bound", "bound/kappa", "gap", "rank"] and frame.c[0] == 4


def test_bad_input():
    with pytest.raises(ValueError, match="s must be <= the image side"):
        cv.output_side(8, 9)
    with pytest.raises(ValueError, match="K: kernel size"):
        cv.toeplitz(torch.zeros(2, 9, 9, dtype=F64), 8)
    with pytest.raises(ValueError, match="padding"):
        cv.shift_matrices(8, 3, 3)
    with pytest.raises(ValueError, match="K must have shape"):
        cv.toeplitz(torch.zeros(3, 2, dtype=F64))
    K, V = cv.init_weights(2, 3, 4)
    with pytest.raises(ValueError, match="V must have shape"):
        cv.gn_reduced(K, V[:, :-1])
    with pytest.raises(ValueError, match="Sigma_hat"):
        cv.gn_reduced(K, V, torch.eye(10, dtype=F64))
    with pytest.raises(ValueError, match="X must be"):
        cv.gn_dense(K, V, torch.zeros(5, 10, dtype=F64))
    with pytest.raises(ValueError, match="scale"):
        cv.init_weights(2, 3, 4, scale=-1.0)
    with pytest.raises(ValueError, match="X must not be all zeros"):
        cv.whiten_images(torch.zeros(4, 64, dtype=F64))


# ---------------------------------------------------------------------------------------------- pruned residual CNN
def small_net(seed=0):
    torch.manual_seed(seed)
    return cv.ResidualCNN(c=2, blocks=1, d_y=3, image=4)


def test_residual_cnn_shapes_and_parameter_count():
    assert sum(p.numel() for p in cv.ResidualCNN().parameters()) == 2456
    net = small_net()
    assert net(torch.randn(5, 16, dtype=F64)).shape == (5, 3)


@pytest.mark.parametrize("rate", [0.0, 0.2, 0.5, 0.8, 0.95])
def test_magnitude_masks_keep_the_largest_fraction_per_layer(rate):
    net = small_net(1)
    masks = cv.magnitude_masks_net(net, rate)
    for name, p in net.named_parameters():
        m = masks[name].bool()
        assert int(m.sum()) == math.ceil((1 - rate) * p.numel() - 1e-9) >= 1
        if (~m).any():
            assert float(p.detach().abs()[m].min()) >= float(p.detach().abs()[~m].max())


def test_gram_condition_equals_dense_gn_over_the_kept_weights():
    net, X = small_net(2), torch.randn(6, 16, dtype=F64, generator=gen(3))
    masks = cv.magnitude_masks_net(net, 0.5)
    fn, theta = cv.pruned_model(net, masks, X)
    assert theta.numel() == sum(int(m.sum()) for m in masks.values())
    from curvlab import curvature
    H = curvature.gn_matrix(fn, theta, scale=1 / X.shape[0])
    dense = curvature.condition_number(H)
    got = cv.gram_condition(net, masks, X)
    assert got.rank == dense.rank
    assert abs(got.kappa / dense.kappa - 1) < 1e-8
    # the pruned weights are really zero in the model fn evaluates
    full = dict(net.named_parameters())
    pruned = {k: (p.detach() * masks[k]) for k, p in full.items()}
    ref = torch.func.functional_call(net, pruned, (X,)).reshape(-1)
    torch.testing.assert_close(fn(theta), ref, rtol=0, atol=1e-12)


def test_pruning_lowers_layer_sigma_min_and_training_runs():
    net, X = small_net(4), torch.randn(6, 16, dtype=F64, generator=gen(5))
    s0 = cv.layer_sigma_min(net, cv.magnitude_masks_net(net, 0.0))
    s8 = cv.layer_sigma_min(net, cv.magnitude_masks_net(net, 0.8))
    assert all(s8[k] <= s0[k] + 1e-12 for k in s0)
    Y = torch.randn(6, 3, dtype=F64, generator=gen(6))
    tr = cv.train_pruned(net, cv.magnitude_masks_net(net, 0.4), X, Y, lr=0.1, steps=5, every=5)
    assert list(tr.step) == [0, 5] and tr.loss.iloc[-1] < tr.loss.iloc[0]


def test_pruning_bad_input():
    net = small_net()
    for rate in (-0.1, 1.0, 1.5, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match="rate"):
            cv.magnitude_masks_net(net, rate)
    tiny = cv.ResidualCNN(c=1, blocks=0, d_y=1, image=4)          # the head has a single weight
    with pytest.raises(ValueError, match="all-pruned layer"):
        cv.magnitude_masks_net(tiny, 1 - 1e-12)                  # < 1, yet keeps no weight of the head
    masks = cv.magnitude_masks_net(net, 0.5)
    masks["head.weight"] = torch.zeros_like(masks["head.weight"])
    with pytest.raises(ValueError, match="all-pruned layer"):
        cv.gram_condition(net, masks, torch.randn(4, 16, dtype=F64))
    with pytest.raises(TypeError, match="net must be"):
        cv.magnitude_masks_net("resnet", 0.5)
    with pytest.raises(ValueError, match="masks must have one entry"):
        cv.layer_sigma_min(net, {"stem.weight": masks["stem.weight"]})


def test_jacobian_all_per_sample_matches_full_batch_and_kept_gram():
    net, X = small_net(7), torch.randn(5, 16, dtype=F64, generator=gen(8))
    masks = cv.magnitude_masks_net(net, 0.4)
    J = cv.jacobian_all(net, X, masks)
    # full-batch reference over all weights at the pruned point
    params = {k: p.detach() * masks[k] for k, p in net.named_parameters()}
    names = list(params)
    flat = torch.cat([params[k].reshape(-1) for k in names])
    sizes = [params[k].numel() for k in names]

    def f(th):
        d = {k: t.reshape(params[k].shape) for k, t in zip(names, th.split(sizes))}
        return torch.func.functional_call(net, d, (X,)).reshape(-1)

    torch.testing.assert_close(J, torch.func.jacrev(f)(flat), rtol=0, atol=1e-12)
    keep = cv.flat_mask(net, masks)
    assert keep.shape == (flat.numel(),) and int(keep.sum()) == sum(int(m.sum()) for m in masks.values())
    torch.testing.assert_close(cv.kept_gram(J, keep), J[:, keep.bool()] @ J[:, keep.bool()].T, rtol=0, atol=1e-12)
    # freezing weights can only lower every eigenvalue (Loewner order)
    lk, la = torch.linalg.eigvalsh(cv.kept_gram(J, keep)), torch.linalg.eigvalsh(cv.kept_gram(J))
    assert bool((lk <= la + 1e-12 * float(la[-1])).all())
    with pytest.raises(ValueError, match="keep must be"):
        cv.kept_gram(J, keep[:-1])


def test_pruning_counterfactuals_rank_bound_and_rate_zero():
    torch.manual_seed(3)
    net = cv.ResidualCNN(c=3, blocks=1, d_y=5, image=4)
    X = torch.randn(6, 16, dtype=F64, generator=gen(9))
    frame = cv.pruning_counterfactuals(net, X, [0.0, 0.5, 0.9])
    row0 = frame.iloc[0]                                   # nothing pruned: all three spectra coincide
    assert row0.kappa == pytest.approx(row0.kappa_zeroed, rel=1e-9) == pytest.approx(row0.kappa_frozen, rel=1e-9)
    assert row0["sigma_min ratio (median)"] == 1.0 and row0["head rank"] == 3
    n, c, d_y = 6, 3, 5                                    # rank <= n rank V_m + c (d_y - rank V_m)
    assert bool((frame["rank"] <= n * frame["head rank"] + c * (d_y - frame["head rank"])).all())
    assert int(row0["rank"]) == n * c + c * (d_y - c)


def test_train_pruned_many_matches_single_runs_and_bad_input():
    nets = [small_net(10), small_net(11)]
    X, Y = torch.randn(5, 16, dtype=F64, generator=gen(12)), torch.randn(5, 3, dtype=F64, generator=gen(13))
    masks = [cv.magnitude_masks_net(nets[0], 0.3), cv.magnitude_masks_net(nets[1], 0.6)]
    many = cv.train_pruned_many(nets, masks, X, Y, lr=[0.05, 0.1], steps=6, every=3)
    for b, lr in enumerate((0.05, 0.1)):
        one = cv.train_pruned(nets[b], masks[b], X, Y, lr=lr, steps=6, every=3)
        got = many[many.net == b].reset_index(drop=True)
        torch.testing.assert_close(torch.tensor(got.loss.to_numpy()), torch.tensor(one.loss.to_numpy()), rtol=1e-12, atol=0)
        fn, theta = cv.pruned_model(nets[b], masks[b], X)         # reference: plain GD over the kept weights
        y, th = Y.reshape(-1), theta
        for _ in range(6):
            th = th - lr * torch.func.grad(lambda t: (fn(t) - y).square().sum() / 10)(th)
        assert got.loss.iloc[-1] == pytest.approx(float((fn(th) - y).square().sum() / 10), rel=1e-10)
    with pytest.raises(ValueError, match="lr must be"):
        cv.train_pruned_many(nets, masks, X, Y, lr=[0.1], steps=1, every=1)
    with pytest.raises(ValueError, match="one architecture"):
        cv.train_pruned_many([nets[0], cv.ResidualCNN(c=3, blocks=1, d_y=3, image=4)], masks, X, Y, lr=0.1, steps=1,
                             every=1)
    with pytest.raises(ValueError, match="masks must be a list"):
        cv.train_pruned_many(nets, masks[:1], X, Y, lr=0.1, steps=1, every=1)
    diverged = cv.train_pruned_many(nets[:1], masks[:1], X, Y * 1e3, lr=1e3, steps=8, every=4)   # a step far too large
    assert math.isfinite(diverged.kappa.iloc[0]) and not math.isfinite(diverged.loss.iloc[-1])
    assert math.isnan(diverged.kappa.iloc[-1]) and diverged["rank"].iloc[-1] == 0       # recorded, not raised


def test_train_pruned_many_counterfactual_variants():
    # "zeroed": plain GD over every weight from W * M; "frozen": GD over the kept weights from W, the others held at
    # their initial values; step 0 of each holds the spectra of pruning_counterfactuals
    torch.manual_seed(4)
    net = cv.ResidualCNN(c=3, blocks=1, d_y=3, image=4)
    X, Y = torch.randn(5, 16, dtype=F64, generator=gen(14)), torch.randn(5, 3, dtype=F64, generator=gen(15))
    masks = cv.magnitude_masks_net(net, 0.5)
    hist = cv.train_pruned_many([net] * 3, [masks] * 3, X, Y, lr=0.1, steps=4, every=4,
                                variant=["pruned", "zeroed", "frozen"], spectrum=True)
    assert list(hist.variant.unique()) == ["pruned", "zeroed", "frozen"]
    names = [k for k, _ in net.named_parameters()]
    full = {k: p.detach() for k, p in net.named_parameters()}
    for b, start, train in ((1, {k: full[k] * masks[k] for k in names}, {k: torch.ones_like(masks[k]) for k in names}),
                            (2, dict(full), masks)):
        P = dict(start)
        for _ in range(4):
            g = torch.func.grad(lambda p: (torch.func.functional_call(net, p, (X,)) - Y).square().sum() / 10)(P)
            P = {k: P[k] - 0.1 * g[k] * train[k] for k in names}
        ref = float((torch.func.functional_call(net, P, (X,)) - Y).square().sum() / 10)
        assert hist[(hist.net == b) & (hist.step == 4)].loss.iloc[0] == pytest.approx(ref, rel=1e-10)
    frozen_end = hist[(hist.net == 2) & (hist.step == 4)]
    assert frozen_end.eig.iloc[0][0] == pytest.approx(frozen_end.lambda_max.iloc[0], rel=1e-12)
    cf = cv.pruning_counterfactuals(net, X, [0.5]).iloc[0]
    at0 = hist[hist.step == 0].set_index("variant")
    for v, tag in (("pruned", ""), ("zeroed", "_zeroed"), ("frozen", "_frozen")):
        torch.testing.assert_close(torch.tensor(at0.eig[v]), torch.tensor(cf["eig" + tag]), rtol=0,
                                   atol=1e-12 * float(cf["lambda_max" + tag]))
    light = cv.pruning_counterfactuals(net, X, [0.0, 0.5], spectra=False)
    assert "kappa" not in light and list(light["head rank"]) == [3, int(cf["head rank"])]
    with pytest.raises(ValueError, match="variant must be"):
        cv.train_pruned_many([net], [masks], X, Y, lr=0.1, steps=1, every=1, variant="frozen-zeroed")
    with pytest.raises(ValueError, match="variant must be"):
        cv.train_pruned_many([net, net], [masks, masks], X, Y, lr=0.1, steps=1, every=1, variant=["pruned"])
    with pytest.raises(TypeError, match="spectrum must be"):
        cv.train_pruned_many([net], [masks], X, Y, lr=0.1, steps=1, every=1, spectrum="yes")
    with pytest.raises(TypeError, match="spectra must be"):
        cv.pruning_counterfactuals(net, X, [0.5], spectra=1)


def test_kappa_at_rank_compares_spectra_at_the_smallest_rank_of_a_group():
    import numpy as np
    import pandas as pd

    e_full = np.array([4.0, 2.0, 1.0, 0.5])
    e_low = np.array([3.0, 1.5, 0.25, 0.0])                     # numerical rank 3
    frame = pd.DataFrame({"seed": [0, 0, 1, 1], "eig": [e_full, e_low, e_full, None]})
    out = cv.kappa_at_rank(frame, ["seed"])
    assert list(out.r_star[:2]) == [3, 3] and out.r_star[2] == 4
    assert out.kappa_r_star[0] == pytest.approx(4.0) and out.kappa_r_star[1] == pytest.approx(12.0)
    assert out.kappa_r_star[2] == pytest.approx(8.0) and math.isnan(out.kappa_r_star[3])
    with pytest.raises(ValueError, match="by must name"):
        cv.kappa_at_rank(frame, ["rate"])
    with pytest.raises(ValueError, match="frame must be"):
        cv.kappa_at_rank(frame.drop(columns="eig"), ["seed"])


def test_equality_at_s_equals_image_needs_c_at_least_min_dy_r():
    # s = N, whitened (Sigma_hat a rank-r projection): kappa over the nonzero spectrum equals the bound iff
    # c >= min(d_y, r); below, the bound's denominator vanishes (cond-prop-conv, chapter 31)
    N, d_y, g = 4, 5, gen(21)
    for r, c, equal in ((2, 3, True), (2, 1, False), (4, 5, True), (4, 3, False), (4, 4, True)):
        U = torch.linalg.qr(torch.randn(N * N, r, dtype=F64, generator=g))[0]
        K, V = cv.init_weights(c, N, d_y, image=N, generator=g)
        lam = torch.linalg.eigvalsh(cv.gn_reduced(K, V, U @ U.T, image=N)).flip(0)
        nz = lam[lam > 1e-10 * lam[0]]
        bound = float(cv.kappa_bound(K, V, U @ U.T, image=N))
        if equal:
            assert len(nz) == d_y * r and float(nz[0] / nz[-1]) == pytest.approx(bound, rel=1e-8)
        else:
            assert len(nz) < d_y * r and (bound > 1e12 or math.isinf(bound))
