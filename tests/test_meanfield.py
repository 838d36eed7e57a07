"""Tests for curvlab.meanfield: the structured kernel / J^T z against the dense torch.func Jacobian of
curvlab.curvature, the steps against their equations, the metrics against direct formulas, the IDX reader on files
the test writes, and the bad-input errors."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import curvature as cv
from curvlab import meanfield as mf

F64 = torch.float64
FAST = settings(max_examples=12, deadline=None)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def problem(n=6, d=3, m=5, d_y=None, S=2, seed=0, std=0.9, v0_zero=False):
    p = mf.init_student(m, d, init_std=std, seeds=list(range(seed, seed + S)), v0_zero=v0_zero, d_y=d_y)
    X = randn(S, n, d, seed=seed + 100)
    Y = randn(S, n, seed=seed + 200) if d_y is None else randn(S, n, d_y, seed=seed + 200)
    return p, X, Y


def dense_J(p, X, act, s):
    """Dense reference: the torch.func Jacobian of seed s's network (curvlab.curvature.jacobian)."""
    ps = p.map(lambda t: t[s])
    fn = mf.model_fn(X[s], ps.m, act, ps.d_y if ps.vector_output else None)
    return cv.jacobian(fn, mf.flatten(ps)), fn


# ----------------------------------------------------------------------------------------------- the network
def test_forward_matches_the_sum_over_neurons():
    p, X, _ = problem(n=4, d=3, m=5, S=1)
    v, W, b = (t[0] for t in p)
    for act, phi in (("relu", torch.relu), ("silu", torch.nn.functional.silu)):
        want = torch.stack([sum(v[i] * phi(W[i] @ x + b[i]) for i in range(5)) / 5 for x in X[0]])
        torch.testing.assert_close(mf.forward(p, X, act)[0], want)


def test_activation_derivatives_match_autograd():
    z = torch.linspace(-3, 3, 41, dtype=F64).requires_grad_()
    for act in mf.ACTIVATIONS:
        phi, dphi = mf.activation(act)
        (g,) = torch.autograd.grad(phi(z).sum(), z)
        torch.testing.assert_close(dphi(z.detach()), g)


@FAST
@given(n=st.integers(1, 6), d=st.integers(1, 4), m=st.integers(1, 6), d_y=st.sampled_from([None, 1, 3]),
       act=st.sampled_from(mf.ACTIVATIONS), seed=st.integers(0, 10_000))
def test_kernel_and_jt_match_dense_torch_func_jacobian(n, d, m, d_y, act, seed):
    p, X, _ = problem(n, d, m, d_y, S=2, seed=seed)
    K = mf.ntk(p, X, act)
    z = randn(2, K.shape[-1], seed=seed + 7)
    g = mf.flatten(mf.jt_vec(p, X, z, act))
    for s in range(2):  # batched over seeds
        J, _ = dense_J(p, X, act, s)
        torch.testing.assert_close(K[s], J @ J.T)
        torch.testing.assert_close(g[s], J.T @ z[s])


def test_feature_gram_is_m_times_Jv_JvT():
    p, X, _ = problem(n=5, d=3, m=7, S=1)
    J, _ = dense_J(p, X, "silu", 0)
    Jv = J[:, :7]
    torch.testing.assert_close(mf.feature_gram(p, X, "silu")[0], 7 * Jv @ Jv.T)


def test_v0_zero_kernel_is_the_feature_gram_over_m():
    p, X, _ = problem(n=5, d=3, m=7, S=1, v0_zero=True)
    torch.testing.assert_close(mf.ntk(p, X, "relu"), mf.feature_gram(p, X, "relu") / 7)


def test_gradient_matches_autograd_of_the_loss():
    for d_y in (None, 2):
        p, X, Y = problem(n=6, d=3, m=4, d_y=d_y, S=2)
        theta = mf.flatten(p).clone().requires_grad_()
        L = mf.loss(mf.unflatten(theta, 4, 3, d_y), X, Y, "silu").sum()
        (g,) = torch.autograd.grad(L, theta)
        torch.testing.assert_close(mf.flatten(mf.gradient(p, X, Y, "silu")), g)


def test_flatten_unflatten_roundtrip_and_float32():
    p, _, _ = problem(m=4, d=3, d_y=2)
    th = mf.flatten(p)
    assert th.shape == (2, 4 * (2 + 3 + 1))
    back = mf.unflatten(th, 4, 3, 2)
    for a, b in zip(back, p):
        torch.testing.assert_close(a, b)
    p32 = p.map(lambda t: t.float())
    X = randn(2, 6, 3).float()
    assert mf.ntk(p32, X, "relu").dtype == F64  # Gram matrices are accumulated in float64
    assert mf.forward(p32, X, "relu").dtype == torch.float32


# ----------------------------------------------------------------------------------------------- steps
@pytest.mark.parametrize("damping", [mf.Damping.constant(0.3), mf.Damping.relative(0.05), mf.Damping.adaptive(1e-7),
                                     mf.Damping.adaptive(10.0)])
def test_gn_direction_matches_dense_kernel_step(damping):
    p, X, Y = problem(n=5, d=3, m=6, S=2, seed=3)
    res = mf.gn_direction(p, X, Y, "silu", damping, spectrum=True)
    for s in range(2):
        J, fn = dense_J(p, X, "silu", s)
        K = J @ J.T
        ev = torch.linalg.eigvalsh(K)
        lam = {"constant": damping.value, "relative": damping.value * float(ev[-1]),
               "adaptive": max(damping.value, float(ev[0]))}[damping.kind]
        assert math.isclose(float(res.lam[s]), lam, rel_tol=1e-10)
        r = fn(mf.flatten(p.map(lambda t: t[s]))) - Y[s]
        torch.testing.assert_close(mf.flatten(res.delta)[s], cv.kernel_gn_step(J, r, lam))
        torch.testing.assert_close(res.eigs[s], ev.flip(0))


def test_adaptive_damping_cholesky_shortcut_agrees_with_eigenvalues():
    # small init: lambda_min(K) far below the floor (shortcut) ; large init: above it (eigenvalues needed)
    for std, floor in ((0.01, 1e-3), (2.0, 1e-9)):
        p, X, Y = problem(n=6, d=3, m=12, S=2, std=std, seed=5)
        a = mf.gn_direction(p, X, Y, "relu", mf.Damping.adaptive(floor), spectrum=False)
        b = mf.gn_direction(p, X, Y, "relu", mf.Damping.adaptive(floor), spectrum=True)
        torch.testing.assert_close(a.lam, b.lam)
        torch.testing.assert_close(mf.flatten(a.delta), mf.flatten(b.delta))


def test_gn_and_gd_steps_are_their_update_equations():
    p, X, Y = problem(n=5, d=3, m=6, S=1, seed=2)
    d = mf.gn_direction(p, X, Y, "relu", mf.Damping.constant(0.1)).delta
    torch.testing.assert_close(mf.flatten(mf.gn_step(p, X, Y, "relu", eta=0.3, damping=mf.Damping.constant(0.1))),
                               mf.flatten(p) - 0.3 * mf.flatten(d))
    g = mf.gradient(p, X, Y, "relu")
    torch.testing.assert_close(mf.flatten(mf.gd_step(p, X, Y, "relu", lr=2.0)), mf.flatten(p) - 2.0 * mf.flatten(g))


def test_first_gn_step_from_v0_zero_contracts_each_mode_exactly():
    """v = 0: f is linear in v and J_W = J_b = 0, so the residual's modes shrink by exactly 1 - eta s/(s+lam)."""
    p, X, Y = problem(n=6, d=3, m=10, S=1, v0_zero=True, seed=4)
    lam, eta = 1e-3, 0.4
    r0 = mf.forward(p, X, "silu") - Y
    K = mf.ntk(p, X, "silu")[0]
    s, U = torch.linalg.eigh(K)
    p1 = mf.gn_step(p, X, Y, "silu", eta=eta, damping=mf.Damping.constant(lam))
    r1 = mf.forward(p1, X, "silu") - Y
    torch.testing.assert_close(U.T @ r1[0], mf.mode_contraction(s, lam, eta) * (U.T @ r0[0]))
    torch.testing.assert_close(p1.W, p.W)  # the hidden layer does not move in the first step


def test_undamped_singular_kernel_is_a_named_error():
    p, X, Y = problem(n=6, d=3, m=2, S=1, v0_zero=True)  # rank K = m = 2 < n
    X = X.clone()
    X[0, 1] = X[0, 0]  # two identical samples with different targets: K exactly singular
    Y = Y.clone()
    Y[0, 1] = Y[0, 0] + 1
    with pytest.raises(ValueError, match="singular"):
        mf.gn_direction(p, X, Y, "relu", mf.Damping.constant(0.0))


# ----------------------------------------------------------------------------------------------- metrics
def test_refit_is_min_norm_least_squares_and_interpolates_when_wide():
    for d_y in (None, 3):
        p, X, Y = problem(n=5, d=3, m=9, d_y=d_y, S=2, seed=8)
        q = mf.refit_output(p, X, Y, "relu")
        for s in range(2):
            Phi = mf.features(p, X, "relu")[s] / 9
            want = torch.linalg.pinv(Phi) @ (Y[s] if d_y else Y[s].unsqueeze(-1))
            got = q.v[s].T if d_y else q.v[s].unsqueeze(-1)
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(mf.forward(q, X, "relu"), Y)  # m >= n: interpolation
        torch.testing.assert_close(q.W, p.W)


def test_refit_cut_off_is_on_gram_eigenvalues_that_is_squared_singular_values():
    """The convention the docstrings state: rcond on the Gram's eigenvalues = pinv with rtol = sqrt(rcond) on the
    singular values of J_v; on nearly collinear features (SiLU, tiny sigma_0) pinv's default cut differs."""
    data = mf.teacher_student([0], act="silu", n=60, n_test=200, d=4, m_teacher=3)
    p = mf.init_student(120, 4, init_std=0.01, seeds=[0])
    Phi = mf.features(p, data.X, "silu")[0].double() / 120
    s = torch.linalg.svdvals(Phi)
    assert float(s[-1] / s[0]) < 1e-8                                   # the Gram spans more decades than 1e-10
    for rcond in (1e-6, 1e-10):
        got = mf.refit_output(p, data.X, data.Y, "silu", rcond=rcond).v[0]
        want = torch.linalg.pinv(Phi, rtol=rcond ** 0.5) @ data.Y[0].double()
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-8 * float(want.abs().max()))
    book = mf.loss(mf.random_features(p, data.X, data.Y, "silu"), data.X_test, data.Y_test, "silu")
    v_pinv = torch.linalg.pinv(Phi) @ data.Y[0].double()
    other = mf.loss(mf.MFParams(v_pinv.unsqueeze(0).to(p.W.dtype), p.W, p.b), data.X_test, data.Y_test, "silu")
    assert not torch.allclose(book, other, rtol=1e-3)                  # the convention matters here


def test_random_features_and_test_lrfit():
    data = mf.teacher_student([0, 1], act="relu", n=20, n_test=50, d=4, m_teacher=3)
    p0 = mf.init_student(30, 4, init_std=1.0, seeds=[0, 1])
    rf = mf.random_features(p0, data.X, data.Y, "relu")
    torch.testing.assert_close(mf.loss(rf, data.X, data.Y, "relu"), torch.zeros(2, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(mf.test_lrfit(p0, data), mf.loss(rf, data.X_test, data.Y_test, "relu"))


def test_wcd_matches_a_direct_loop_and_its_conventions():
    W, Wt = randn(2, 6, 4, seed=1), randn(2, 3, 4, seed=2)
    W[0, 2] = 0.0  # a zero row: weight 0, normalised vector 0
    got = mf.wcd(W, Wt)
    for s in range(2):
        norms = W[s].norm(dim=1)
        total = 0.0
        for i in range(6):
            u = W[s, i] / norms[i] if norms[i] > 0 else torch.zeros(4, dtype=F64)
            dist = min(math.sqrt(max(0.0, 2 * (1 - float(u @ Wt[s, j] / Wt[s, j].norm())))) for j in range(3))
            total += float(norms[i] ** 2 / (norms ** 2).sum()) * dist
        assert math.isclose(float(got[s]), total, rel_tol=1e-12)
    aligned = torch.cat([2.0 * Wt[:, :1], 0.5 * Wt[:, 1:]], dim=1)  # positive multiples of teacher rows
    torch.testing.assert_close(mf.wcd(aligned, Wt), torch.zeros(2, dtype=F64), atol=1e-7, rtol=0)
    torch.testing.assert_close(mf.wcd(W, 3.0 * Wt), got)  # teacher scale does not matter


def test_distance_from_init_and_fs_time():
    p, _, _ = problem(m=4, d=3, S=2)
    q = p.map(lambda t: t + 1.0)
    torch.testing.assert_close(mf.distance_from_init(q, p), torch.full((2,), math.sqrt(4 * 3 + 4), dtype=F64))
    assert np.allclose(mf.fs_time(10.0, [0, 50, 100], 500), [0.0, 1.0, 2.0])


# ----------------------------------------------------------------------------------------------- theory helpers
def linear_gn_steps(s, lam, eta, tol, r0):
    """First T with loss_T <= tol loss_0 for the linear map r <- (1 - eta s/(s+lam)) r, mode by mode."""
    c = 1 - eta * s / (s + lam)
    L0 = float((r0 ** 2).sum())
    for T in range(1, 100_000):
        if float(((c ** T * r0) ** 2).sum()) <= tol * L0:
            return T
    raise AssertionError("did not converge")


@FAST
@given(seed=st.integers(0, 10_000), eta=st.floats(0.01, 1.0), logtol=st.integers(-10, -2))
def test_steps_bracket_contains_the_linear_count(seed, eta, logtol):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(8, generator=g, dtype=F64) * 10 + 0.1
    r0 = torch.randn(8, generator=g, dtype=F64)
    lam = float(s.min())  # adaptive damping at lambda_min(K)
    br = mf.steps_bracket(s, lam, eta, 10.0 ** logtol, floor=1e-7)
    T = linear_gn_steps(s, lam, eta, 10.0 ** logtol, r0)
    assert br.precondition and br.low <= T <= br.high
    assert math.isclose(br.c_slow, 1 - eta / 2, rel_tol=1e-12)


def test_steps_bracket_reproduces_the_digest_counts_and_flags_the_floor():
    # eta = 0.02 (lr = 10, n = 500), tolerance 1e-8: bulk 456 steps, the mode at lambda_min 916 (digest)
    s = torch.tensor([1e3, 1.0, 1e-2], dtype=F64)
    br = mf.steps_bracket(s, float(s.min()), 0.02, 1e-8, floor=1e-7)
    assert 455 <= br.low <= 457 and 915 <= br.high <= 917
    flagged = mf.steps_bracket(s, 1e-1, 0.02, 1e-8, floor=1e-1)
    assert not flagged.precondition and "floor" in flagged.reason
    assert not mf.steps_bracket(s, float(s.min()), 1.5, 1e-8).precondition  # over-relaxed


def test_mode_contraction_and_gd_divergence_lr():
    torch.testing.assert_close(mf.mode_contraction(torch.tensor([1.0, 3.0]), 1.0, 0.5),
                               torch.tensor([0.75, 0.625], dtype=F64))
    K = torch.diag(torch.tensor([4.0, 1.0], dtype=F64))
    lr_star = float(mf.gd_divergence_lr(K, n=10))
    assert math.isclose(lr_star, 5.0)
    r = torch.ones(2, dtype=F64)
    for lr, grows in ((0.95 * lr_star, False), (1.05 * lr_star, True)):
        x = r.clone()
        for _ in range(200):
            x = x - lr * K @ x / 10
        assert (float(x.norm()) > 1.0) == grows


# ----------------------------------------------------------------------------------------------- training
def test_train_gn_matches_a_manual_loop_and_records_fs_time():
    data = mf.teacher_student([0, 1], act="silu", n=12, n_test=30, d=3, m_teacher=2)
    p0 = mf.init_student(16, 3, init_std=1.0, seeds=[0, 1])
    damping = mf.Damping.constant(1e-4)
    run = mf.train(p0, data, method="GN", lr=6.0, damping=damping, max_steps=7, rel_tol=0.0, spectrum=True)
    p = p0
    for _ in range(7):
        p = mf.gn_step(p, data.X, data.Y, "silu", eta=6.0 / 12, damping=damping)
    torch.testing.assert_close(mf.flatten(run.params), mf.flatten(p))
    last = run.history.groupby("seed").tail(1)
    assert (last.status == "cap").all() and (last.step == 7).all()
    assert np.allclose(run.history.fs_time, 6.0 * run.history.step / 12)
    assert {"test_lrfit", "wcd", "hidden_travel", "lam_min_K", "frac_below_damping"} <= set(run.history.columns)


def test_train_stopping_rules_per_seed():
    data = mf.teacher_student([0, 1], act="relu", n=10, n_test=20, d=3, m_teacher=2)
    p0 = mf.init_student(40, 3, init_std=1.0, seeds=[0, 1])
    conv = mf.train(p0, data, method="GN", lr=10.0, max_steps=500, rel_tol=1e-6, metrics=False)
    assert (conv.history.groupby("seed").tail(1).status == "converged").all()
    bud = mf.train(p0, data, method="GN", lr=1.0, max_steps=500, fs_time_budget=0.5, metrics=False)
    last = bud.history.groupby("seed").tail(1)
    assert (last.status == "budget").all() and np.allclose(last.fs_time, 0.5)
    lr_star = float(mf.gd_divergence_lr(mf.ntk(p0, data.X, "relu"), 10).min())
    div = mf.train(p0, data, method="GD", lr=20 * lr_star, max_steps=300, metrics=False)
    assert (div.history.groupby("seed").tail(1).status == "diverged").all()
    gd = mf.train(p0, data, method="GD", lr=1.0, max_steps=3, metrics=False)
    torch.testing.assert_close(mf.flatten(gd.params), mf.flatten(
        mf.gd_step(mf.gd_step(mf.gd_step(p0, data.X, data.Y, "relu", lr=1.0), data.X, data.Y, "relu", lr=1.0),
                   data.X, data.Y, "relu", lr=1.0)))


# ----------------------------------------------------------------------------------------------- data
def test_teacher_student_defaults_nesting_and_labels():
    a = mf.teacher_student([0, 1], act="relu", n=30, n_test=40)
    b = mf.teacher_student([0, 1], act="relu", n=60, n_test=40)
    assert a.X.shape == (2, 30, 10) and a.X_test.shape == (2, 40, 10) and a.teacher.W.shape == (2, 5, 10)
    torch.testing.assert_close(b.X[:, :30], a.X)  # nested training sets, as in the authors' code
    torch.testing.assert_close(a.Y, mf.forward(a.teacher, a.X, "relu"))
    assert not torch.equal(a.X[0], a.X[1])


def test_init_student_scales_and_v0():
    p = mf.init_student(4000, 10, init_std=0.3, seeds=[0])
    assert float(p.v.abs().max()) == 0.0
    assert abs(float(p.W.std()) - 0.3) < 0.01 and abs(float(p.b.std()) - 0.3) < 0.02
    q = mf.init_student(4000, 10, init_std=0.3, seeds=[0], v0_zero=False, d_y=2)
    assert q.v.shape == (1, 2, 4000) and abs(float(q.v.std()) - 0.3) < 0.01


def test_idx_roundtrip_and_mnist_loader(tmp_path):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7).astype(np.uint8)
    floats = rng.standard_normal((3, 2))
    for name, arr in (("a.idx", imgs), ("b.idx.gz", labels), ("c.idx", floats)):
        mf.write_idx(tmp_path / name, arr)
        back = mf.read_idx(tmp_path / name)
        assert back.dtype == arr.dtype and np.array_equal(back, arr)
    raw = (tmp_path / "a.idx").read_bytes()
    assert raw[:4] == bytes([0, 0, 8, 3]) and int.from_bytes(raw[4:8], "big") == 7  # the MNIST header
    root = tmp_path / "mnist"
    root.mkdir()
    assert not mf.mnist_available(root)
    mf.write_idx(root / "train-images-idx3-ubyte.gz", imgs)
    mf.write_idx(root / "train-labels-idx1-ubyte.gz", labels)
    mf.write_idx(root / "t10k-images-idx3-ubyte", imgs[:4])
    mf.write_idx(root / "t10k-labels-idx1-ubyte", labels[:4])
    assert mf.mnist_available(root)
    X, y = mf.load_mnist(root, "train", verify=False)              # 7 images: not the official file
    assert np.array_equal(X, imgs) and np.array_equal(y, labels)
    data = mf.mnist_data([0], n=5, n_test=3, root=root, verify=False)
    assert data.X.shape == (1, 5, 784) and data.Y.shape == (1, 5, 10) and data.X_test.shape == (1, 3, 784)
    assert float(data.X.max()) <= 1.0


def test_idx_reader_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.idx"
    bad.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="magic"):
        mf.read_idx(bad)
    good = mf.write_idx(tmp_path / "g.idx", np.zeros((2, 3), dtype=np.uint8))
    (tmp_path / "t.idx").write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ValueError, match="holds"):
        mf.read_idx(tmp_path / "t.idx")
    with pytest.raises(ValueError, match="existing"):
        mf.read_idx(tmp_path / "missing.idx")
    with pytest.raises(TypeError, match="dtype"):
        mf.write_idx(tmp_path / "x.idx", np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="MNIST"):
        mf.load_mnist(tmp_path, "train")


def test_digits_data():
    data = mf.load_digits_data([0, 1], n=100, n_test=50)
    assert data.X.shape == (2, 100, 61) and data.Y.shape == (2, 100, 10) and data.X_test.shape == (2, 50, 61)
    assert torch.equal(data.Y.sum(-1), torch.ones(2, 100, dtype=F64))
    assert float(data.X.min()) >= 0 and float(data.X.max()) <= 1


# ----------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_are_named_errors():
    p, X, Y = problem()
    with pytest.raises(TypeError, match="params"):
        mf.forward((p.v, p.W, p.b), X, "relu")
    with pytest.raises(ValueError, match="act"):
        mf.forward(p, X, "tanh")
    with pytest.raises(ValueError, match="X"):
        mf.forward(p, randn(2, 6, 4), "relu")
    with pytest.raises(ValueError, match="Y"):
        mf.loss(p, X, randn(2, 5), "relu")
    with pytest.raises(ValueError, match="params.b"):
        mf.forward(mf.MFParams(p.v, p.W, p.b[..., :-1]), X, "relu")
    with pytest.raises(ValueError, match="non-finite"):
        mf.forward(mf.MFParams(p.v * float("nan"), p.W, p.b), X, "relu")
    with pytest.raises(ValueError, match="z"):
        mf.jt_vec(p, X, randn(2, 5), "relu")
    with pytest.raises(ValueError, match="kind"):
        mf.Damping("weird", 1.0)
    with pytest.raises(ValueError, match="value"):
        mf.Damping.constant(-1.0)
    with pytest.raises(TypeError, match="damping"):
        mf.gn_direction(p, X, Y, "relu", 1e-3)
    with pytest.raises(ValueError, match="eta"):
        mf.gn_step(p, X, Y, "relu", eta=0.0, damping=mf.Damping.adaptive())
    with pytest.raises(ValueError, match="lr"):
        mf.gd_step(p, X, Y, "relu", lr=-1.0)
    with pytest.raises(ValueError, match="init_std"):
        mf.init_student(3, 2, init_std=0.0)
    with pytest.raises(TypeError, match="seeds"):
        mf.teacher_student(3)
    with pytest.raises(ValueError, match="tol"):
        mf.steps_bracket(torch.ones(3), 0.1, 0.5, 2.0)
    with pytest.raises(ValueError, match="lam"):
        mf.steps_bracket(torch.ones(2, 3), torch.ones(3), 0.5, 1e-3)
    with pytest.raises(ValueError, match="s \\+ lam"):
        mf.mode_contraction(torch.zeros(2), 0.0, 0.5)
    with pytest.raises(ValueError, match="W"):
        mf.wcd(torch.zeros(4, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="method"):
        mf.train(p, mf.teacher_student([0, 1], d=3, n=6, n_test=4), method="Adam", lr=1.0)
    with pytest.raises(TypeError, match="data"):
        mf.train(p, (X, Y), method="GD", lr=1.0)
    with pytest.raises(ValueError, match="theta"):
        mf.unflatten(torch.zeros(7), 2, 2)
    with pytest.raises(ValueError, match="n \\+ n_test"):
        mf.load_digits_data([0], n=1700, n_test=200)


# ----------------------------------------------------------------------------------------------- run helpers
def test_loss_envelope_brackets_a_gn_run_and_needs_every_step():
    data = mf.teacher_student([0, 1], act="silu", n=16, n_test=20, d=3, m_teacher=2)
    p0 = mf.init_student(40, 3, init_std=1.0, seeds=[0, 1])
    run = mf.train(p0, data, method="GN", lr=0.1 * 16, max_steps=30, rel_tol=0.0, record_every=1,
                   spectrum=True, metrics=False)
    env = mf.loss_envelope(run.history)
    assert len(env) == 2 * 31 and (env.lower <= env.upper + 1e-15).all()
    assert (np.log(env.rel_loss) <= np.log(env.upper) + 1e-9).all()  # the damping-limited envelope
    sparse = mf.train(p0, data, method="GN", lr=1.6, max_steps=30, spectrum=True, metrics=False, n_records=5)
    with pytest.raises(ValueError, match="every step"):
        mf.loss_envelope(sparse.history)
    with pytest.raises(ValueError, match="record_every"):
        mf.loss_envelope(run.history.drop(columns="lam_min_K"))


def test_at_step_and_first_crossing():
    data = mf.teacher_student([0, 1], act="relu", n=12, n_test=10, d=3, m_teacher=2)
    p0 = mf.init_student(30, 3, init_std=1.0, seeds=[0, 1])
    h = mf.train(p0, data, method="GN", lr=6.0, max_steps=40, rel_tol=1e-6, record_every=1,
                 metrics=False).history
    a = mf.at_step(h, 5)
    assert list(a.seed) == [0, 1] and (a.step == 5).all()
    last = mf.at_step(h, 10**6)  # past the stop: each seed's final record
    assert (last.step.to_numpy() == h.groupby("seed").step.max().to_numpy()).all()
    c = mf.first_crossing(h, "rel_loss", 1e-2)
    for s_, row in c.set_index("seed").iterrows():
        hs = h[h.seed == s_]
        assert row.step == hs[hs.rel_loss <= 1e-2].step.min()
    assert mf.first_crossing(h, "rel_loss", -1.0).empty
    with pytest.raises(ValueError, match="column"):
        mf.first_crossing(h, "nope", 0.0)


def test_rank_correlation_matches_scipy_and_its_interval_covers():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    x = rng.standard_normal(200)
    y = x + rng.standard_normal(200)
    rc = mf.rank_correlation(x, y, n_boot=500)
    assert math.isclose(rc["rho"], spearmanr(x, y).statistic)
    assert rc["low"] < rc["rho"] < rc["high"] and rc["se"] > 0 and rc["n"] == 200
    assert mf.rank_correlation(x, -x, n_boot=200)["rho"] == -1.0
    with pytest.raises(ValueError, match="length"):
        mf.rank_correlation([1, 2], [1, 2])
    with pytest.raises(ValueError, match="finite"):
        mf.rank_correlation([1.0, np.nan, 3.0], [1.0, 2.0, 3.0])


def test_mnist_table_is_the_review_table():
    t = mf.MNIST_TABLE
    assert len(t) == 14 and set(t.method) == {"GN", "GD"}
    gn = t[t.method == "GN"].set_index("lr")
    assert gn.loc[1e-3, "test_lrfit"] == 52.4 and gn.loc[1e3, "test_loss"] == 60.9
    assert t[(t.method == "GD") & (t.lr >= 100)].train_loss.isna().all()  # "div"


# ----------------------------------------------------------------------------------------------- Proposition 1
def test_flow_rate_and_radius_formulas_and_limits():
    lam = torch.tensor([0.5, 2.0], dtype=F64)
    torch.testing.assert_close(mf.flow_rate(lam, 0.0), torch.full((2,), 2.0, dtype=F64))
    torch.testing.assert_close(mf.flow_rate(lam, lam), torch.ones(2, dtype=F64))
    big = mf.flow_rate(1.0, 1e8)
    assert float(big) == pytest.approx(2e-8, rel=1e-6)  # ~ 2 lambda_star / eps
    # R = |r0| sup_{s >= lam} sqrt(s)/(s+eps) / nu(lam): a brute-force sup on a grid
    for lam_s, eps in ((1.0, 0.3), (1.0, 1.0), (1.0, 4.0), (0.2, 7.0)):
        s = np.geomspace(lam_s, lam_s * 1e6, 200_001)
        rho = np.max(np.sqrt(s) / (s + eps))
        want = 3.0 * rho / (lam_s / (lam_s + eps))
        assert float(mf.flow_radius(3.0, lam_s, eps)) == pytest.approx(want, rel=1e-6)
    # continuous at eps = lambda_star, and never below |r0|/sqrt(lambda_star)
    assert float(mf.flow_radius(1.0, 2.0, 2.0 * (1 + 1e-9))) == pytest.approx(1 / math.sqrt(2.0), rel=1e-8)
    for bad in (dict(lam_star=0.0, eps=1.0), dict(lam_star=1.0, eps=-1.0)):
        with pytest.raises(ValueError, match="lam_star|eps"):
            mf.flow_rate(**bad)
    with pytest.raises(ValueError, match="r0_norm"):
        mf.flow_radius(-1.0, 1.0, 1.0)


def test_slowest_mode_targets_put_the_residual_in_the_slowest_mode():
    p, X, _ = problem(n=6, d=3, m=9, S=2, seed=3)
    Y = mf.slowest_mode_targets(p, X, "silu", amplitude=0.7)
    r0 = mf.forward(p, X, "silu") - Y
    lam, U = torch.linalg.eigh(mf.ntk(p, X, "silu"))
    torch.testing.assert_close(r0.norm(dim=-1), 0.7 * lam[:, 0].sqrt())
    K = mf.ntk(p, X, "silu")
    torch.testing.assert_close((K @ r0.unsqueeze(-1)).squeeze(-1), lam[:, :1] * r0)
    with pytest.raises(ValueError, match="amplitude"):
        mf.slowest_mode_targets(p, X, "silu", amplitude=0.0)
    pv, Xv, _ = problem(n=4, d=3, m=5, d_y=2, S=1)
    with pytest.raises(ValueError, match="scalar output"):
        mf.slowest_mode_targets(pv, Xv, "silu", amplitude=1.0)


def test_gn_flow_matches_scipy_on_the_dense_torch_func_field():
    from scipy.integrate import solve_ivp

    p, X, Y = problem(n=4, d=2, m=3, S=2, seed=5)
    eps, t_end = torch.tensor([0.1, 0.5], dtype=F64), 1.0
    fl, fl_half = (mf.gn_flow(p, X, Y, "silu", eps=eps, t_end=t_end, steps=k) for k in (60, 30))
    for s in range(2):
        ps = p.map(lambda t: t[s])
        fn = mf.model_fn(X[s], ps.m, "silu")

        def field(_, th, s=s, fn=fn):  # -J^T (J J^T + eps I)^-1 r, from the dense Jacobian
            th = torch.as_tensor(th, dtype=F64)
            J = cv.jacobian(fn, th)
            r = fn(th) - Y[s]
            return (-J.T @ torch.linalg.solve(J @ J.T + eps[s] * torch.eye(4, dtype=F64), r)).numpy()

        ref = solve_ivp(field, (0, t_end), mf.flatten(ps).numpy(), method="DOP853", rtol=1e-12, atol=1e-12).y[:, -1]
        err, err_half = (np.abs(mf.flatten(f.params)[s].numpy() - ref).max() for f in (fl, fl_half))
        assert err < 1e-7
        assert 10 < err_half / err < 22  # fourth order: halving the step divides the error by about 16
    h = fl.history
    assert set(h.columns) >= {"entry", "step", "fs_time", "loss", "rel_loss", "lam_min_K", "travel", "speed"}
    assert (h.groupby("entry").rel_loss.diff().dropna() <= 1e-15).all()  # the loss never increases (prop 3)
    for s in range(2):  # the recorded speed at t = 0 is |field| from the dense Jacobian
        ps = p.map(lambda t: t[s])
        fn = mf.model_fn(X[s], ps.m, "silu")
        th = mf.flatten(ps)
        J, r = cv.jacobian(fn, th), fn(th) - Y[s]
        dense = (J.T @ torch.linalg.solve(J @ J.T + eps[s] * torch.eye(4, dtype=F64), r)).norm()
        first = h[(h.entry == s) & (h.step == 0)].speed.iloc[0]
        assert first == pytest.approx(float(dense), rel=1e-10)
        # part 3 of the book's Proposition 1: |field| <= |r_0| / (2 sqrt(eps)) all along the damped flow
        assert (h[h.entry == s].speed <= float(r.norm()) / (2 * float(eps[s]) ** 0.5) * (1 + 1e-12)).all()


def test_gn_flow_worst_case_decays_at_the_proposition_rate():
    p = mf.init_student(40, 3, init_std=1.0, seeds=[0, 1])
    X = randn(2, 8, 3, seed=9)
    Y = mf.slowest_mode_targets(p, X, "silu", amplitude=1e-3)  # tiny: the kernel does not move
    lam0 = torch.linalg.eigvalsh(mf.ntk(p, X, "silu"))[:, 0]
    eps = lam0 * torch.tensor([0.1, 10.0], dtype=F64)
    c = mf.flow_rate(lam0, eps)
    h = mf.gn_flow(p, X, Y, "silu", eps=eps, t_end=3 / c, steps=40).history
    for e_, he in h.groupby("entry"):
        rate, se = mf.fit_rate(he.fs_time.to_numpy(), np.log(he.rel_loss.to_numpy()))
        assert rate[0] == pytest.approx(float(c[e_]), rel=1e-4)
        assert se[0] < 1e-4 * rate[0]
    # the damping-free rate 2 is far off for the damped entry
    assert abs(2.0 - float(c[1])) > 1.0


def test_gn_flow_bad_inputs():
    p, X, Y = problem(n=4, d=2, m=3, S=2)
    with pytest.raises(ValueError, match="eps"):
        mf.gn_flow(p, X, Y, "silu", eps=-1.0, t_end=1.0, steps=2)
    with pytest.raises(ValueError, match="t_end"):
        mf.gn_flow(p, X, Y, "silu", eps=0.1, t_end=0.0, steps=2)
    with pytest.raises(ValueError, match="one value per batch entry"):
        mf.gn_flow(p, X, Y, "silu", eps=[0.1, 0.2, 0.3], t_end=1.0, steps=2)
    with pytest.raises(ValueError, match="steps"):
        mf.gn_flow(p, X, Y, "silu", eps=0.1, t_end=1.0, steps=0)
    with pytest.raises(ValueError, match="params0"):
        mf.gn_flow(p.map(lambda t: t[0]), X[0], Y[0], "silu", eps=0.1, t_end=1.0, steps=2)
    with pytest.raises(TypeError, match="params0"):
        mf.gn_flow((1, 2, 3), X, Y, "silu", eps=0.1, t_end=1.0, steps=2)


def test_fit_rate_recovers_an_exponential_and_its_se():
    t = np.linspace(0, 5, 50)
    rate, se = mf.fit_rate(t, -0.7 * t + 0.3)
    assert rate[0] == pytest.approx(0.7, rel=1e-12) and se[0] < 1e-12
    noisy = -0.7 * t + np.random.default_rng(0).normal(0, 0.01, (200, t.size))
    rates, ses = mf.fit_rate(np.broadcast_to(t, noisy.shape), noisy)
    assert abs(rates.mean() - 0.7) < 4 * rates.std() / np.sqrt(200)
    assert np.median(ses) == pytest.approx(rates.std(), rel=0.2)  # the SE is the spread of the slope
    for bad in ((t[:2], t[:2]), (t, t[:-1]), (np.zeros(5), np.arange(5.0)), (t, np.full_like(t, np.nan))):
        with pytest.raises(ValueError):
            mf.fit_rate(*bad)


def test_svd_gn_direction_is_the_damped_step_on_a_positive_definite_kernel_and_the_authors_solve():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import authors_gn

    p, X, Y = problem(n=8, d=3, m=20, S=2, seed=4, std=1.0)
    gn = mf.gn_direction(p, X, Y, "silu", mf.Damping.adaptive(1e-7), spectrum=True)
    assert float(gn.eigs[:, -1].min()) > 1e-7
    sv = mf.svd_gn_direction(p, X, Y, "silu", floor=1e-7)
    torch.testing.assert_close(mf.flatten(sv.delta), mf.flatten(gn.delta), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(sv.lam, gn.lam)
    # small initial scale: K has round-off negative eigenvalues; the benchmarks' independent re-implementation of
    # the authors' solve gives the same z (both are one SVD of the same K)
    q = mf.init_student(30, 3, init_std=1e-3, seeds=[0])
    Xq, Yq = randn(1, 12, 3, seed=1), randn(1, 12, seed=2)
    svq = mf.svd_gn_direction(q, Xq, Yq, "silu", floor=1e-7)
    r = mf.forward(q, Xq, "silu") - Yq
    z_ref, stats = authors_gn.svd_solve(svq.K[0], r[0], 1e-7)
    torch.testing.assert_close(svq.z[0], z_ref, rtol=1e-10, atol=0.0)
    assert float(svq.lam[0]) == pytest.approx(stats["min_sigma"])
    with pytest.raises(ValueError, match="floor"):
        mf.svd_gn_direction(p, X, Y, "silu", floor=-1.0)


def test_svd_step_difference_records_the_run_and_agrees_on_positive_definite_kernels():
    p, X, Y = problem(n=8, d=3, m=20, S=2, seed=4, std=1.0)
    tab = mf.svd_step_difference(p, X, Y, "silu", eta=0.5, steps=2)
    assert list(tab.step) == [1, 1, 2, 2] and set(tab.dtype) == {"float64"}
    assert (tab.negative_eigs == 0).all() and (tab.rel_diff < 1e-8).all()
    # the first row's difference is the one svd_gn_direction and gn_direction give directly
    gn = mf.flatten(mf.gn_direction(p, X, Y, "silu", mf.Damping.adaptive(1e-7)).delta)
    sv = mf.flatten(mf.svd_gn_direction(p, X, Y, "silu").delta)
    assert tab.rel_diff.iloc[0] == pytest.approx(float((sv - gn)[0].norm() / gn[0].norm()), rel=1e-12, abs=1e-300)
    with pytest.raises(ValueError, match="eta"):
        mf.svd_step_difference(p, X, Y, "silu", eta=0.0)
    with pytest.raises(ValueError, match="steps"):
        mf.svd_step_difference(p, X, Y, "silu", eta=0.5, steps=0)
    with pytest.raises(ValueError, match="params0"):
        mf.svd_step_difference(p.map(lambda t: t[0]), X[0], Y[0], "silu", eta=0.5)


def test_ball_lambda_min_probes_the_ball():
    p, X, _ = problem(n=5, d=3, m=4, S=2, seed=3)
    lam0 = torch.linalg.eigvalsh(mf.ntk(p, X, "silu"))[:, 0]
    # radius 0: every point is theta_0
    torch.testing.assert_close(mf.ball_lambda_min(p, X, "silu", radius=0.0, points=3), lam0)
    # the probe is a minimum over points of the ball: one fixed point of the ball is never below it, and the
    # points really lie in the ball (a tiny radius stays close to lambda_min(K_0))
    small = mf.ball_lambda_min(p, X, "silu", radius=[1e-8, 1e-8], points=5)
    torch.testing.assert_close(small, lam0, rtol=1e-5, atol=1e-12)
    # against the dense torch.func kernel at the same draws (uniform in the ball: direction x radius U^(1/p))
    got = mf.ball_lambda_min(p, X, "silu", radius=2.0, points=6, seed=1)
    theta0 = mf.flatten(p)
    P = theta0.shape[-1]
    g = mf._generator(1)
    u = torch.randn(2, 6, P, generator=g, dtype=F64)
    u = u / u.norm(dim=-1, keepdim=True) * torch.rand(2, 6, 1, generator=g, dtype=F64) ** (1.0 / P)
    for s_ in range(2):
        fn = mf.model_fn(X[s_], p.m, "silu")
        lams = []
        for k in range(6):
            th = theta0[s_] + 2.0 * u[s_, k]
            assert float((th - theta0[s_]).norm()) <= 2.0 + 1e-12
            J = cv.jacobian(fn, th)
            lams.append(float(torch.linalg.eigvalsh(J @ J.T)[0]))
        assert float(got[s_]) == pytest.approx(min(lams), rel=1e-8, abs=1e-14)
    with pytest.raises(ValueError, match="radius"):
        mf.ball_lambda_min(p, X, "silu", radius=-1.0)
    with pytest.raises(ValueError, match="radius"):
        mf.ball_lambda_min(p, X, "silu", radius=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="points"):
        mf.ball_lambda_min(p, X, "silu", radius=1.0, points=0)
    with pytest.raises(ValueError, match="params0"):
        mf.ball_lambda_min(p.map(lambda t: t[0]), X[0], "silu", radius=1.0)


@pytest.mark.parametrize("steps", [(0.2, 0.02, 0.005), (0.4, 0.2, 0.1), (0.02, 0.005, 0.002)])
@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.7])
def test_richardson_recovers_order_flow_and_errors(steps, p):
    h = np.array(steps)
    M0, C = np.array([0.3, -1.0]), np.array([2.0, 0.5])
    M = M0[None, :] + C[None, :] * h[:, None] ** p
    out = mf.richardson(steps, M)
    assert out.determined.all()
    np.testing.assert_allclose(out.order, p, rtol=1e-8)
    np.testing.assert_allclose(out.flow, M0, rtol=1e-8, atol=1e-10)
    for k in range(3):
        np.testing.assert_allclose(out[f"error_{k + 1}"], np.abs(C) * h[k] ** p, rtol=1e-7)


def test_richardson_ratio_is_monotone_in_the_order():
    h = np.array([0.2, 0.02, 0.005])
    p = np.linspace(1e-6, 8, 2000)
    ratio = (h[0] ** p - h[1] ** p) / (h[1] ** p - h[2] ** p)
    assert (np.diff(ratio) > 0).all()  # so the fitted order is unique


def test_richardson_undetermined_cases_and_bad_input():
    steps = (0.2, 0.02, 0.005)
    out = mf.richardson(steps, np.array([[1.0, 1.0, 1.0], [2.0, 1.0, 1.1], [1.0, 0.9, 0.5]]).T)
    assert not out.determined.any() and out.order.isna().all() and out.flow.isna().all()
    assert "monotone" in out.reason[0] and "monotone" in out.reason[1]  # d23 = 0, then opposite signs
    assert "shrink" in out.reason[2]  # differences grow as the step decreases
    steep = mf.richardson(steps, [0.2**20, 0.02**20, 0.005**20], max_order=8)
    assert not steep.determined[0] and "above 8" in steep.reason[0]
    with pytest.raises(ValueError, match="steps"):
        mf.richardson((0.02, 0.2, 0.005), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="steps"):
        mf.richardson((0.2, 0.02), [1.0, 2.0])
    with pytest.raises(ValueError, match="values"):
        mf.richardson(steps, [1.0, 2.0])
    with pytest.raises(ValueError, match="values"):
        mf.richardson(steps, [1.0, np.nan, 2.0])
    with pytest.raises(ValueError, match="max_order"):
        mf.richardson(steps, [1.0, 2.0, 3.0], max_order=0)
