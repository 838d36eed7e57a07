"""Tests for curvlab.curvature: every structured or matrix-free path against a dense ``torch.func`` reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import curvature as cv
from curvlab import linalg

F64 = torch.float64
seeds = st.integers(min_value=0, max_value=2**31 - 1)
FAST = settings(max_examples=15, deadline=None)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def toy_model(n: int, p: int, seed: int = 0):
    """A smooth nonlinear model fn(theta) = tanh(A theta) * (B theta) + c, outputs (n,)."""
    A, B, c = randn(n, p, seed=seed), randn(n, p, seed=seed + 1), randn(n, seed=seed + 2)
    return (lambda th: torch.tanh(A @ th) * (B @ th) + c), randn(p, seed=seed + 3)


def mlp_model(n: int = 6, d: int = 3, width: int = 8, seed: int = 0):
    """A torch.nn MLP as a function of its flat parameter vector, via flatten_params + functional_call."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.SiLU(), torch.nn.Linear(width, 1)).double()
    theta, unflatten = cv.flatten_params(dict(net.named_parameters()))
    X = randn(n, d, seed=seed + 1)
    return (lambda th: torch.func.functional_call(net, unflatten(th), (X,)).reshape(-1)), theta, net, X


def dense_jacobian(fn, theta):
    """Independent reference: the autograd.functional (tape-based) Jacobian."""
    return torch.autograd.functional.jacobian(fn, theta)


shapes = st.tuples(st.integers(1, 7), st.integers(1, 9))  # (n, p)


# ----------------------------------------------------------------------------------------------- J, G, K, Gv
@FAST
@given(shape=shapes, seed=seeds)
def test_jacobian_gn_and_kernel_match_dense(shape, seed):
    n, p = shape
    fn, theta = toy_model(n, p, seed)
    J = dense_jacobian(fn, theta)
    torch.testing.assert_close(cv.jacobian(fn, theta), J)  # covers jacfwd (p <= n) and jacrev (p > n)
    torch.testing.assert_close(cv.gn_matrix(fn, theta, scale=0.5), 0.5 * J.T @ J)
    torch.testing.assert_close(cv.kernel_matrix(fn, theta, scale=2.0), 2.0 * J @ J.T)


@FAST
@given(shape=shapes, b=st.integers(1, 4), seed=seeds)
def test_gn_vector_product_matches_dense_gn(shape, b, seed):
    n, p = shape
    fn, theta = toy_model(n, p, seed)
    G = cv.gn_matrix(fn, theta, scale=1.0 / n)
    v, V = randn(p, seed=seed + 7), randn(b, p, seed=seed + 8)
    torch.testing.assert_close(cv.gn_vector_product(fn, theta, v, scale=1.0 / n), G @ v)
    torch.testing.assert_close(cv.gn_vector_product(fn, theta, V, scale=1.0 / n), V @ G)  # batched via vmap


def test_flatten_params_with_nn_linear_and_functional_call():
    fn, theta, net, X = mlp_model()
    assert theta.shape == (sum(p.numel() for p in net.parameters()),) and not theta.requires_grad
    torch.testing.assert_close(fn(theta), net(X).reshape(-1).detach())
    J = dense_jacobian(fn, theta)
    torch.testing.assert_close(cv.gn_matrix(fn, theta), J.T @ J)
    v = randn(theta.numel(), seed=3)
    torch.testing.assert_close(cv.gn_vector_product(fn, theta, v), J.T @ (J @ v))


def test_linear_layer_gn_is_row_major_kronecker():
    """For f_i = W x_i + b (nn.Linear, k outputs), the GN block of vec(W) is I_k ⊗ XᵀX in row-major order."""
    k, d, n = 2, 3, 5
    lin = torch.nn.Linear(d, k).double()
    theta, unflatten = cv.flatten_params(dict(lin.named_parameters()))  # [vec(W) row-major; b]
    X = randn(n, d, seed=1)
    fn = lambda th: torch.func.functional_call(lin, unflatten(th), (X,)).reshape(-1)  # noqa: E731
    G = cv.gn_matrix(fn, theta)
    torch.testing.assert_close(G[: k * d, : k * d], linalg.kron(torch.eye(k, dtype=F64), X.T @ X))
    torch.testing.assert_close(G[k * d :, k * d :], n * torch.eye(k, dtype=F64))


# ----------------------------------------------------------------------------------------------- GN steps
@FAST
@given(shape=shapes, eps=st.floats(1e-4, 10.0), seed=seeds)
def test_kernel_step_equals_parameter_step_woodbury(shape, eps, seed):
    n, p = shape
    fn, theta = toy_model(n, p, seed)
    J, r = dense_jacobian(fn, theta), randn(n, seed=seed + 5)
    dense = torch.linalg.solve(J.T @ J + eps * torch.eye(p, dtype=F64), J.T @ r)  # reference
    torch.testing.assert_close(cv.damped_gn_step(J, r, eps), dense)
    torch.testing.assert_close(cv.kernel_gn_step(J, r, eps), dense)
    torch.testing.assert_close(cv.kernel_gn_step_fn(fn, theta, r, eps), dense)


def test_kernel_step_wide_mlp_p_much_larger_than_n():
    fn, theta, _, _ = mlp_model(n=4, d=5, width=40)  # p = 281 >> n = 4
    J, r = cv.jacobian(fn, theta), randn(4, seed=2)
    for eps in (1e-6, 1e-2, 1.0):
        step = cv.damped_gn_step(J, r, eps)
        torch.testing.assert_close(cv.kernel_gn_step(J, r, eps), step)
        torch.testing.assert_close(cv.kernel_gn_step_fn(fn, theta, r, eps), step)
    step0 = cv.kernel_gn_step(J, r, 0.0)  # eps = 0: minimum-norm solution of J d = r
    torch.testing.assert_close(step0, torch.linalg.pinv(J) @ r)
    torch.testing.assert_close(cv.kernel_gn_step_fn(fn, theta, r, 0.0), step0)


def test_damped_step_eps_zero_tall_and_batched():
    J, r = randn(9, 4), randn(9, seed=1)  # p < n: J^T J invertible, eps = 0 is least squares
    torch.testing.assert_close(cv.damped_gn_step(J, r, 0), torch.linalg.lstsq(J, r.unsqueeze(-1)).solution[:, 0])
    Jb, rb = randn(3, 5, 7), randn(3, 5, seed=2)  # a batch of seeds
    for step in (cv.damped_gn_step, cv.kernel_gn_step):
        out = step(Jb, rb, 0.1)
        assert out.shape == (3, 7)
        for b in range(3):
            torch.testing.assert_close(out[b], cv.damped_gn_step(Jb[b], rb[b], 0.1))


# ----------------------------------------------------------------------------------------------- conditioning
def constructed(lams, seed=0):
    lams = torch.as_tensor(lams, dtype=F64)
    Q = torch.linalg.qr(randn(len(lams), len(lams), seed=seed))[0]
    return Q @ torch.diag(lams) @ Q.T


def test_condition_number_on_constructed_spectrum_with_gap():
    M = constructed([10.0, 5.0, 2.0, 0.5, 1e-13, 0.0])
    cn = cv.condition_number(M, rtol=1e-10)
    assert dataclasses.is_dataclass(cn) and cn.rank == 4 and cn.numerical_rank == 4 and cn.size == 6
    assert cn.kappa == pytest.approx(20.0, rel=1e-9) and cn.lambda_max == pytest.approx(10.0, rel=1e-12)
    assert cn.lambda_min_nonzero == pytest.approx(0.5, rel=1e-9) and cn.threshold == pytest.approx(1e-9)
    assert cn.lambda_discarded == pytest.approx(1e-13, abs=1e-14)  # float64 noise of size ~1e-15
    assert cn.gap > 1e11 and not cn.forced and "kappa=20" in str(cn)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cn.kappa = 1.0  # type: ignore[misc]


def test_condition_number_forced_rank_reports_gap_there():
    lams = torch.tensor([8.0, 4.0, 1.0, 0.9, 1e-3])
    cn = cv.condition_number(lams, rtol=1e-6, rank=3)  # eigenvalue-vector input
    assert (cn.rank, cn.numerical_rank, cn.forced) == (3, 5, True)
    assert cn.kappa == pytest.approx(8.0) and cn.gap == pytest.approx(1.0 / 0.9)  # an unclean cut shows
    full = cv.condition_number(lams, rtol=1e-6)
    assert full.rank == 5 and full.gap == math.inf and full.lambda_discarded is None
    assert full.kappa == pytest.approx(8e3)


def test_condition_number_default_rtol_is_size_times_eps():
    cn = cv.condition_number(constructed([3.0, 1.0, 0.0]).float())
    assert cn.rtol == 3 * torch.finfo(torch.float32).eps and cn.rank == 2 and cn.kappa == pytest.approx(3.0, rel=1e-5)
    assert cv.condition_number(torch.tensor([2.0, 1.0], dtype=F64)).rtol == 2 * torch.finfo(F64).eps
    assert set(cn.to_dict()) >= {"kappa", "rank", "lambda_max", "lambda_min_nonzero", "rtol", "threshold", "gap"}


@FAST
@given(shape=shapes, seed=seeds)
def test_condition_number_of_gn_equals_that_of_kernel(shape, seed):
    n, p = shape
    fn, theta = toy_model(n, p, seed)
    G, K = cv.gn_matrix(fn, theta), cv.kernel_matrix(fn, theta)
    cg, ck = cv.condition_number(G, rtol=1e-9), cv.condition_number(K, rtol=1e-9)
    assert cg.rank == ck.rank
    assert cg.kappa == pytest.approx(ck.kappa, rel=1e-6)


# ----------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument():
    fn, theta = toy_model(3, 4)
    J, r = randn(3, 4), randn(3)
    nan_theta = theta.clone()
    nan_theta[0] = math.nan
    with pytest.raises(TypeError, match="fn"):
        cv.jacobian("not callable", theta)
    with pytest.raises(ValueError, match="theta"):
        cv.jacobian(fn, theta.reshape(2, 2))
    with pytest.raises(ValueError, match="theta"):
        cv.gn_matrix(fn, nan_theta)
    with pytest.raises(ValueError, match="theta"):
        cv.kernel_matrix(fn, torch.zeros(0))
    with pytest.raises(ValueError, match="fn"):
        cv.jacobian(lambda th: th.sum(), theta)  # scalar output
    with pytest.raises(ValueError, match="fn"):
        cv.jacobian(lambda th: th / 0.0, theta)  # non-finite output
    with pytest.raises(ValueError, match="scale"):
        cv.gn_matrix(fn, theta, scale=-1.0)
    with pytest.raises(TypeError, match="scale"):
        cv.kernel_matrix(fn, theta, scale="1")
    with pytest.raises(ValueError, match="v must have shape"):
        cv.gn_vector_product(fn, theta, torch.ones(5))
    with pytest.raises(ValueError, match="v contains"):
        cv.gn_vector_product(fn, theta, torch.full((4,), math.inf))
    with pytest.raises(TypeError, match="params"):
        cv.flatten_params({})
    with pytest.raises(TypeError, match="params"):
        cv.flatten_params({"w": torch.ones(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="params"):
        cv.flatten_params({"w": torch.ones(2), "b": torch.ones(2, dtype=F64)})
    _, unflatten = cv.flatten_params({"w": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="theta"):
        unflatten(torch.ones(3))
    for step in (cv.damped_gn_step, cv.kernel_gn_step):
        with pytest.raises(ValueError, match="eps"):
            step(J, r, -1e-3)
        with pytest.raises(ValueError, match="r must have shape"):
            step(J, torch.ones(4), 1.0)
        with pytest.raises(ValueError, match="J must"):
            step(torch.ones(3), r, 1.0)
        with pytest.raises(ValueError, match="J must not be empty"):
            step(torch.zeros(3, 0), r, 1.0)
        with pytest.raises(ValueError, match="r contains"):
            step(J, torch.tensor([1.0, math.nan, 0.0]), 1.0)
        with pytest.raises(ValueError, match="eps"):
            step(J, r, math.inf)
    with pytest.raises(ValueError, match="eps=0"):
        cv.damped_gn_step(J, r, 0.0)  # p > n: J^T J singular
    with pytest.raises(ValueError, match="eps=0"):
        cv.kernel_gn_step(J.T, torch.ones(4), 0.0)  # n > p: J J^T singular
    with pytest.raises(ValueError, match="eps"):
        cv.kernel_gn_step_fn(fn, theta, r, -1.0)
    with pytest.raises(ValueError, match="r must have shape"):
        cv.kernel_gn_step_fn(fn, theta, torch.ones(4), 1.0)
    tall_fn, tall_theta = toy_model(5, 2)
    with pytest.raises(ValueError, match="eps=0"):
        cv.kernel_gn_step_fn(tall_fn, tall_theta, torch.ones(5), 0.0)


def test_condition_number_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="M must be positive semi-definite"):
        cv.condition_number(torch.diag(torch.tensor([1.0, -0.5])))
    with pytest.raises(ValueError, match="M must be symmetric"):
        cv.condition_number(torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="M must have a positive eigenvalue"):
        cv.condition_number(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="M must not be empty"):
        cv.condition_number(torch.zeros(0))
    with pytest.raises(ValueError, match="M contains"):
        cv.condition_number(torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="M must be a square"):
        cv.condition_number(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="M must be square"):
        cv.condition_number(torch.ones(2, 3))
    with pytest.raises(ValueError, match="rtol"):
        cv.condition_number(torch.eye(2), rtol=-1e-3)
    with pytest.raises(ValueError, match="rtol"):
        cv.condition_number(torch.eye(2), rtol=1.5)
    with pytest.raises(ValueError, match="rank"):
        cv.condition_number(torch.eye(2), rank=3)
    with pytest.raises(ValueError, match="rank"):
        cv.condition_number(torch.eye(2), rank=0)
    with pytest.raises(TypeError, match="rank"):
        cv.condition_number(torch.eye(2), rank=1.5)
    with pytest.raises(ValueError, match="rank=2"):
        cv.condition_number(torch.tensor([1.0, 0.0]), rank=2)
