"""The benchmarks' re-implementation of the authors' GN step (benchmarks/authors_gn.py) gives their update.

Their step (MichaelArbel/Implicit-Bias-Gauss-Newton, core/optimizers/GN.py) is checked against two independent
routes: curvlab's structured kernel-form step with the adaptive damping (a positive definite kernel: the SVD solve is
the damped GN solve), and the eigenbasis form of the SVD solve (a kernel with a negative eigenvalue: the SVD flips
that mode's sign, which the damped GN step does not).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import authors_gn  # noqa: E402

from curvlab import meanfield as mf  # noqa: E402


def _problem(n=16, m=24, d=3, seed=0):
    data = mf.teacher_student([seed], act="silu", d=d, n=n, n_test=4)
    p = mf.init_student(m, d, init_std=1.0, seeds=[seed], v0_zero=False).map(lambda t: t[0])
    return p, data.X[0], data.Y[0]


def test_authors_step_equals_damped_gn_step_on_a_positive_definite_kernel():
    p, X, Y = _problem()
    res = mf.gn_direction(p, X, Y, "silu", mf.Damping.adaptive(1e-7), spectrum=True)
    assert float(res.eigs.min()) > 1e-7  # the regime where both damp by lambda_min(K)
    r = mf.forward(p, X, "silu") - Y
    opt = authors_gn.AuthorsGN(epsilon=1e-7)
    (dv, dW, db), stats = opt.direction(lambda v, W, b: mf.forward(mf.MFParams(v, W, b), X, "silu"), [p.v, p.W, p.b], r)
    theirs = torch.cat([dv.reshape(-1), dW.reshape(-1), db.reshape(-1)])
    ours = mf.flatten(res.delta)
    assert torch.allclose(theirs, ours, rtol=1e-8, atol=1e-10 * float(ours.abs().max()))
    assert stats["min_sigma"] == pytest.approx(float(res.lam), rel=1e-8)
    # a wrong damping (the floor instead of lambda_min) is told apart at this tolerance
    wrong = mf.flatten(mf.gn_direction(p, X, Y, "silu", mf.Damping.constant(1e-7)).delta)
    assert not torch.allclose(theirs, wrong, rtol=1e-8, atol=1e-10 * float(ours.abs().max()))


def test_svd_solve_flips_the_sign_of_negative_modes():
    torch.manual_seed(0)
    n = 8
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    lam = torch.tensor([-3e-9, 2e-9, 1e-3, 0.1, 0.5, 1.0, 2.0, 5.0], dtype=torch.float64)
    A = Q @ torch.diag(lam) @ Q.T
    A = (A + A.T) / 2
    g = torch.randn(n, dtype=torch.float64)
    z, stats = authors_gn.svd_solve(A, g, 1e-7)
    z_eig = authors_gn.svd_solve_as_eigen(A, g, 1e-7)
    # Two factorisations of A agree to round-off: eigenvalues move by ~ n·u·||A|| ≈ 1e-14, which rotates the two
    # tiny modes (gap 5e-9) by ~ 2e-6 at most and changes their 1/(|λ| + 1e-7) coefficients by ~ 1e-7 relative.
    u = torch.finfo(torch.float64).eps
    rot = n * u * float(torch.linalg.matrix_norm(A, 2)) / 5e-9
    assert float(torch.linalg.vector_norm(z - z_eig)) <= 2 * rot * float(torch.linalg.vector_norm(z))
    # the damped GN solve with the adaptive damping max(eps, lambda_min) = eps
    z_gn = torch.linalg.solve(A + 1e-7 * torch.eye(n, dtype=torch.float64), g)
    q0 = Q[:, 0]
    coef_svd, coef_gn = float(q0 @ z), float(q0 @ z_gn)
    assert coef_svd * coef_gn < 0  # the negative mode's coefficient has the opposite sign
    assert abs(coef_svd) == pytest.approx(abs(float(q0 @ g)) / (3e-9 + 1e-7), rel=1e-5)
    # the other modes agree to the damping's difference only (|lambda| + eps vs lambda + eps)
    rest = Q[:, 2:]
    assert torch.allclose(rest.T @ z, rest.T @ z_gn, rtol=1e-6)


def test_chunk_fallback_doubles_and_keeps_the_result(monkeypatch):
    p, X, Y = _problem(n=12, m=10)
    r = mf.forward(p, X, "silu") - Y
    fwd = lambda v, W, b: mf.forward(mf.MFParams(v, W, b), X, "silu")  # noqa: E731
    ref, _ = authors_gn.AuthorsGN().direction(fwd, [p.v, p.W, p.b], r)
    real = authors_gn.chunked_vmap

    def fails_below_four(func, pieces, rows):
        if pieces < 4:
            raise RuntimeError("simulated allocation failure")
        return real(func, pieces, rows)

    monkeypatch.setattr(authors_gn, "chunked_vmap", fails_below_four)
    opt = authors_gn.AuthorsGN()
    out, stats = opt.direction(fwd, [p.v, p.W, p.b], r)
    assert stats["pieces"] == 4 and opt.pieces == 4
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_forward_like_theirs_is_the_mean_field_forward_and_gives_the_same_step():
    """The baseline's forward is written as the authors' (the read-out as an einsum over an (m, 1) weight): the same
    function as curvlab.meanfield.forward, and the step built on it equals the step built on the latter."""
    p, X, Y = _problem(n=12, m=20)
    out = authors_gn.forward_like_theirs(X, p.W, p.b, p.v.reshape(-1, 1))
    ref = mf.forward(p, X, "silu")
    assert out.shape == (12, 1)
    assert torch.allclose(out.reshape(-1), ref, rtol=1e-13, atol=1e-15)
    r = ref - Y
    (dW, db, dv), _ = authors_gn.AuthorsGN().direction(lambda W, b, v: authors_gn.forward_like_theirs(X, W, b, v),
                                                       [p.W, p.b, p.v.reshape(-1, 1)], r)
    (dv2, dW2, db2), _ = authors_gn.AuthorsGN().direction(lambda v, W, b: mf.forward(mf.MFParams(v, W, b), X, "silu"),
                                                          [p.v, p.W, p.b], r)
    assert dv.shape == (20, 1)
    for a, b in ((dv.reshape(-1), dv2), (dW, dW2), (db, db2)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()))
