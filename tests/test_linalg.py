"""Tests for curvlab.linalg: every tool against a dense or independent reference, plus its bad-input errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlab import linalg

F64 = torch.float64
dims = st.integers(min_value=1, max_value=5)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
FAST = settings(max_examples=20, deadline=None)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def random_psd(n, rank=None, seed=0, batch=()):
    B = randn(*batch, n, n if rank is None else rank, seed=seed)
    return B @ B.transpose(-2, -1)


# ----------------------------------------------------------------------------------------------- vec / kron
@FAST
@given(m=dims, n=dims, seed=seeds)
def test_vec_is_row_major_and_unvec_inverts(m, n, seed):
    M = randn(m, n, seed=seed)
    v = linalg.vec(M)
    assert v.shape == (m * n,)
    for i in range(m):
        for j in range(n):
            assert v[i * n + j] == M[i, j]
    torch.testing.assert_close(linalg.unvec(v, (m, n)), M)


def test_vec_unvec_batched():
    M = randn(3, 2, 4)
    torch.testing.assert_close(linalg.vec(M), M.reshape(3, 8))
    torch.testing.assert_close(linalg.unvec(linalg.vec(M), (2, 4)), M)


@FAST
@given(m=dims, n=dims, p=dims, q=dims, seed=seeds)
def test_kron_matches_torch_kron(m, n, p, q, seed):
    A, B = randn(m, n, seed=seed), randn(p, q, seed=seed + 1)
    torch.testing.assert_close(linalg.kron(A, B), torch.kron(A, B))


def test_kron_batched_matches_loop():
    A, B = randn(4, 2, 3), randn(4, 3, 2, seed=1)
    K = linalg.kron(A, B)
    for b in range(4):
        torch.testing.assert_close(K[b], torch.kron(A[b], B[b]))
    torch.testing.assert_close(linalg.kron(A, B[0])[2], torch.kron(A[2], B[0]))  # broadcast batch


@FAST
@given(m=dims, k=dims, l=dims, n=dims, seed=seeds)
def test_row_major_kronecker_identity(m, k, l, n, seed):
    """vec(A X B) = (A ⊗ Bᵀ) vec(X) row-major; the column-major identity is vec_c(AXB) = (Bᵀ ⊗ A) vec_c(X)."""
    A, X, B = randn(m, k, seed=seed), randn(k, l, seed=seed + 1), randn(l, n, seed=seed + 2)
    torch.testing.assert_close(linalg.vec(A @ X @ B), linalg.kron(A, B.T) @ linalg.vec(X))
    vec_col = lambda M: M.T.reshape(-1)  # noqa: E731  (column-major, for contrast)
    torch.testing.assert_close(vec_col(A @ X @ B), linalg.kron(B.T, A) @ vec_col(X))


# ----------------------------------------------------------------------------------------------- spectra, roots
@FAST
@given(n=dims, b=st.integers(1, 3), seed=seeds)
def test_sym_eigh_reconstructs_in_float64(n, b, seed):
    A = random_psd(n, seed=seed, batch=(b,)).float() - 0.5  # symmetric, indefinite, float32
    lam, Q = linalg.sym_eigh(A)
    assert lam.dtype == F64 and Q.dtype == F64 and lam.shape == (b, n)
    assert bool((lam[..., 1:] >= lam[..., :-1]).all())
    torch.testing.assert_close(Q @ torch.diag_embed(lam) @ Q.transpose(-2, -1), A.double(), atol=1e-5, rtol=1e-5)


@FAST
@given(n=dims, rank=dims, seed=seeds)
def test_psd_sqrt_squares_back(n, rank, seed):
    A = random_psd(n, rank=min(rank, n), seed=seed)
    R = linalg.psd_sqrt(A)
    torch.testing.assert_close(R, R.T)
    torch.testing.assert_close(R @ R, A, atol=1e-10, rtol=1e-8)
    ref = torch.as_tensor(np.real(scipy.linalg.sqrtm(A.numpy())), dtype=F64) if rank >= n else None
    if ref is not None:
        torch.testing.assert_close(R, ref, atol=1e-8, rtol=1e-6)


def test_psd_sqrt_batched_keeps_dtype():
    A = random_psd(3, batch=(4,)).float()
    R = linalg.psd_sqrt(A)
    assert R.dtype == torch.float32 and R.shape == (4, 3, 3)
    torch.testing.assert_close(R @ R, A, atol=1e-4, rtol=1e-4)


@FAST
@given(n=st.integers(2, 6), rank=dims, seed=seeds)
def test_psd_inv_sqrt_is_pinv_root(n, rank, seed):
    A = random_psd(n, rank=min(rank, n), seed=seed) + 0.0
    W = linalg.psd_inv_sqrt(A, rtol=1e-10)
    torch.testing.assert_close(W @ W, torch.linalg.pinv(A, hermitian=True, rtol=1e-10), atol=1e-6, rtol=1e-6)
    P = W @ A @ W  # whitening: identity on range(A), zero on its complement
    torch.testing.assert_close(P @ P, P, atol=1e-8, rtol=1e-8)
    assert round(float(torch.trace(P))) == min(rank, n)


def test_psd_inv_sqrt_default_rtol_drops_the_kernel():
    A = torch.diag(torch.tensor([4.0, 1.0, 0.0], dtype=F64))
    torch.testing.assert_close(linalg.psd_inv_sqrt(A), torch.diag(torch.tensor([0.5, 1.0, 0.0], dtype=F64)))
    assert linalg.default_rtol(3) == 3 * torch.finfo(F64).eps
    assert linalg.default_rtol(3, torch.float32) == 3 * torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------------------------- subspaces
@FAST
@given(d=st.integers(2, 7), ka=dims, kb=dims, seed=seeds)
def test_principal_angles_match_scipy(d, ka, kb, seed):
    ka, kb = min(ka, d), min(kb, d)
    A, B = randn(ka, d, seed=seed), randn(kb, d, seed=seed + 1)
    theta = linalg.principal_angles(A, B)
    ref = np.sort(scipy.linalg.subspace_angles(A.T.numpy(), B.T.numpy()))  # scipy: column spaces
    assert theta.dtype == F64 and theta.shape == (min(ka, kb),)
    np.testing.assert_allclose(theta.numpy(), ref, atol=1e-7)
    M = randn(ka, ka, seed=seed + 2) + 3 * torch.eye(ka, dtype=F64)  # same row space
    torch.testing.assert_close(linalg.principal_angles(M @ A, B), theta, atol=1e-7, rtol=1e-7)


def test_principal_angles_small_angle_accuracy_and_batch():
    A = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    B = torch.tensor([[1.0, 1e-9, 0.0]], dtype=F64)
    torch.testing.assert_close(linalg.principal_angles(A, B), torch.tensor([1e-9], dtype=F64), rtol=1e-6, atol=0)
    assert float(linalg.principal_angles(A, A)) == 0.0
    As, Bs = randn(5, 2, 6), randn(5, 3, 6, seed=1)
    batched = linalg.principal_angles(As, Bs)
    for b in range(5):
        torch.testing.assert_close(batched[b], linalg.principal_angles(As[b], Bs[b]))


@FAST
@given(d=st.integers(2, 7), k=dims, seed=seeds)
def test_sin_theta_distance_is_projector_norm(d, k, seed):
    k = min(k, d)
    A, B = randn(k, d, seed=seed), randn(k, d, seed=seed + 1)
    QA, QB = torch.linalg.qr(A.T)[0], torch.linalg.qr(B.T)[0]
    resid = (torch.eye(d, dtype=F64) - QB @ QB.T) @ QA
    torch.testing.assert_close(linalg.sin_theta_distance(A, B), torch.linalg.matrix_norm(resid, ord=2))
    torch.testing.assert_close(linalg.sin_theta_distance(A, B, norm="fro"), torch.linalg.matrix_norm(resid))


# ----------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument():
    good = torch.eye(3, dtype=F64)
    nan = good.clone()
    nan[0, 0] = math.nan
    with pytest.raises(ValueError, match="A"):
        linalg.sym_eigh(torch.randn(2, 3))
    with pytest.raises(ValueError, match="A must be symmetric"):
        linalg.sym_eigh(torch.tensor([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="A contains"):
        linalg.sym_eigh(nan)
    with pytest.raises(ValueError, match="A must not be empty"):
        linalg.sym_eigh(torch.zeros(0, 0))
    with pytest.raises(TypeError, match="A"):
        linalg.sym_eigh("matrix")
    with pytest.raises(ValueError, match="A must be positive semi-definite"):
        linalg.psd_sqrt(-good)
    with pytest.raises(ValueError, match="A must be positive semi-definite"):
        linalg.psd_inv_sqrt(torch.diag(torch.tensor([1.0, -1.0])))
    with pytest.raises(ValueError, match="rtol"):
        linalg.psd_inv_sqrt(good, rtol=-1.0)
    with pytest.raises(ValueError, match="rtol"):
        linalg.psd_inv_sqrt(good, rtol=2.0)
    with pytest.raises(ValueError, match="M must have at least 2"):
        linalg.vec(torch.ones(3))
    with pytest.raises(ValueError, match="M contains"):
        linalg.vec(nan)
    with pytest.raises(ValueError, match="v must have last dimension"):
        linalg.unvec(torch.ones(5), (2, 3))
    with pytest.raises(TypeError, match="shape"):
        linalg.unvec(torch.ones(6), 6)
    with pytest.raises(ValueError, match="shape"):
        linalg.unvec(torch.ones(6), (0, 3))
    with pytest.raises(ValueError, match="B must be a"):
        linalg.kron(good, torch.ones(3))
    with pytest.raises(ValueError, match="batch dimensions"):
        linalg.kron(torch.ones(2, 2, 2), torch.ones(3, 2, 2))
    with pytest.raises(ValueError, match="same number of columns"):
        linalg.principal_angles(torch.ones(1, 3), torch.ones(1, 4))
    with pytest.raises(ValueError, match="A must have full row rank"):
        linalg.principal_angles(torch.ones(2, 3), torch.eye(3))
    with pytest.raises(ValueError, match="B must have at most"):
        linalg.principal_angles(torch.eye(3)[:1], torch.ones(4, 3))
    with pytest.raises(ValueError, match="norm"):
        linalg.sin_theta_distance(good, good, norm="nuclear")
    with pytest.raises(ValueError, match="size"):
        linalg.default_rtol(0)
    with pytest.raises(TypeError, match="dtype"):
        linalg.default_rtol(3, torch.int64)


def test_covariance_has_the_requested_spectrum_and_root():
    from curvlab.linalg import covariance

    s = torch.logspace(0, 2, 6, dtype=torch.float64)
    Sigma, half = covariance(s, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(torch.linalg.eigvalsh(Sigma), s, rtol=1e-10)
    assert torch.allclose(half @ half, Sigma, atol=1e-10)
    aligned, _ = covariance(s, basis="aligned")
    assert torch.allclose(aligned, torch.diag(s))


@pytest.mark.parametrize("bad, match", [([1.0, -1.0], "> 0"), ([[1.0]], "vector"), ([1.0, float("nan")], "non-finite")])
def test_covariance_bad_input(bad, match):
    from curvlab.linalg import covariance

    with pytest.raises(ValueError, match=match):
        covariance(bad)
    with pytest.raises(ValueError, match="basis"):
        covariance([1.0], basis="diagonal")


# ----------------------------------------------------------------------------- Lanczos extremes


def test_lanczos_extremes_matches_eigvalsh_batched():
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(3, 60, 40, generator=gen, dtype=torch.float64)
    A = X.transpose(-2, -1) @ X + 0.1 * torch.eye(40, dtype=torch.float64)
    res = linalg.lanczos_extremes(A, rtol=1e-10)
    lam = torch.linalg.eigvalsh(A)
    assert res.converged
    torch.testing.assert_close(res.lambda_max, lam[..., -1], rtol=1e-9, atol=0)
    torch.testing.assert_close(res.lambda_min, lam[..., 0], rtol=1e-9, atol=0)
    assert bool((res.residual_min <= 1e-10 * res.lambda_min).all())


def test_lanczos_operator_equals_matrix_form():
    gen = torch.Generator().manual_seed(4)
    A = torch.randn(30, 30, generator=gen, dtype=torch.float64)
    A = A + A.T
    res = linalg.lanczos_extremes_operator(lambda q: A @ q, 30, A)
    lam = torch.linalg.eigvalsh(A)
    torch.testing.assert_close(res.lambda_min, lam[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(res.lambda_max, lam[-1], rtol=1e-9, atol=1e-12)


def test_lanczos_exhausted_krylov_space_is_exact():
    A = torch.diag(torch.tensor([1.0, 1.0, 5.0, 5.0], dtype=torch.float64))
    res = linalg.lanczos_extremes(A)
    assert res.converged and res.iterations <= 2
    assert float(res.lambda_max) == pytest.approx(5.0, rel=1e-14)
    assert float(res.lambda_min) == pytest.approx(1.0, rel=1e-14)


def test_lanczos_reports_non_convergence():
    lam = torch.linspace(1.0, 2.0, 200, dtype=torch.float64)
    res = linalg.lanczos_extremes(torch.diag(lam), rtol=1e-14, max_iter=5)
    assert not res.converged and res.iterations == 5


@pytest.mark.parametrize("kwargs, match", [
    ({"A": torch.ones(2, 3)}, "square"),
    ({"A": torch.tensor([[1.0, 2.0], [0.0, 1.0]])}, "symmetric"),
    ({"A": torch.tensor([[float("nan"), 0.0], [0.0, 1.0]])}, "A"),
    ({"A": torch.eye(3), "rtol": 0.0}, "rtol"),
    ({"A": torch.eye(3), "max_iter": 0}, "max_iter"),
])
def test_lanczos_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linalg.lanczos_extremes(**kwargs)


def test_lanczos_operator_bad_input():
    with pytest.raises(TypeError, match="matvec"):
        linalg.lanczos_extremes_operator(None, 3, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="like"):
        linalg.lanczos_extremes_operator(lambda q: q, 3, torch.zeros(1, dtype=torch.int64))
