r"""A re-implementation of the authors' Gauss–Newton step (Arbel et al., paper 2), for side-by-side benchmarks.

This follows the algorithm of ``GN.step`` and ``GN.custom_closure`` in the authors' public repository
MichaelArbel/Implicit-Bias-Gauss-Newton, file ``core/optimizers/GN.py`` (read at commit b1a794b; none of its code is
copied here). It is *their algorithm*, step for step, written again for curvlab's benchmarks:

1. **Jacobian.** The model's outputs on the batch, ``pred`` (``N`` scalars), are differentiated by one
   vector–Jacobian product per output: ``torch.vmap`` of ``torch.autograd.grad(pred, params, v)`` over the rows ``v``
   of the ``N × N`` identity, one Jacobian block per trainable parameter tensor, shape ``(N, *param.shape)``.
   The rows are split into ``chunk`` pieces (``torch.chunk``; one piece at first); when the vmapped call raises
   (e.g. an allocation failure), the number of pieces doubles, up to ``chunk_max`` (128), and the choice is kept for
   later steps — as their optimizer keeps it in its defaults.
2. **Kernel.** ``A = Σ_params J_p J_pᵀ`` accumulated in float64 (each block cast to float64 first).
3. **Solve by SVD, damping on the singular values.** ``U, s, Vᴴ = svd(A)``, ``s`` clamped at 0, the damping
   ``min_sigma = max(ε, min s)`` (ε = 1e-7 by default), and the direction coefficients
   ``z = V diag(1 / (s + min_sigma)) Uᵀ g``, ``g`` the loss gradient with respect to the outputs.
4. **Direction.** ``Δ_p = J_pᵀ z`` per parameter (``z`` cast back to the parameters' dtype); the optimizer's update
   is ``p ← p − lr Δ_p``.

**The model's forward, as theirs.** Their network (``models/multilayer_net.py``, ``OneHiddenLayer``) computes
``h = SiLU(linear1(x))`` and the read-out as an ``einsum('hi,nh->ni', linear2.weight, h) / H`` with the read-out
weight of shape ``(H, 1)``. :func:`forward_like_theirs` writes it the same way (same operations, same parameter
shapes and order: ``W``, ``b``, ``v`` as an ``(m, 1)`` column). This matters for speed, not for the value: written
as a matrix-vector product (``curvlab.meanfield.forward``), the backward of the read-out hands SiLU's backward a
different cotangent layout inside the vmapped Jacobian, and the whole step runs at a different speed than theirs;
``benchmarks/bench_authors_code.py`` times both against their released code.

Two properties of this route that the book discusses (chapter 20, the deviations page):

* For a positive semi-definite ``A`` the SVD is an eigendecomposition and the step equals the damped GN step
  ``Jᵀ(A + λ I)⁻¹ g`` with the *adaptive* damping ``λ = max(ε, λ_min(A))`` (``curvlab.meanfield.Damping.adaptive``).
* When round-off leaves ``A`` with negative eigenvalues ``λ_i < 0`` (a kernel of numerical rank below ``N``, at small
  initial scale), the SVD returns ``s_i = |λ_i|`` with ``u_i = −v_i``: that mode's coefficient is
  ``−1/(|λ_i| + min_sigma)`` where the damped GN step has ``+1/(λ_i + λ)``. The sign of those modes flips.
  :func:`svd_solve_as_eigen` writes the SVD solve in the eigenbasis, which makes the flip explicit; the tests
  compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["AuthorsGN", "chunked_vmap", "svd_solve", "svd_solve_as_eigen", "forward_like_theirs"]


def forward_like_theirs(X: torch.Tensor, W: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Their ``OneHiddenLayer.forward``: ``einsum('hi,nh->ni', v, SiLU(X Wᵀ + b)) / H`` with ``v`` of shape
    ``(H, 1)``; returns ``(n, 1)``. The same function as :func:`curvlab.meanfield.forward` with SiLU."""
    h = torch.nn.functional.silu(torch.nn.functional.linear(X, W, b))
    return torch.einsum("hi,nh->ni", v, h) / W.shape[0]


def chunked_vmap(func: Callable, pieces: int, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``vmap(func)`` over ``rows`` split into ``pieces`` chunks, the per-output tuples concatenated (their layout)."""
    if pieces == 1:
        return tuple(torch.vmap(func)(rows))
    parts = [torch.vmap(func)(block) for block in torch.chunk(rows, pieces, dim=0)]
    return tuple(torch.cat([p[i] for p in parts], dim=0) for i in range(len(parts[0])))


def svd_solve(A: torch.Tensor, g: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, dict]:
    """``z = V diag(1/(s + max(ε, min s))) Uᵀ g`` from ``svd(A)`` (step 3), and the optimizer's statistics."""
    U, s, Vh = torch.linalg.svd(A)
    s = s.clamp(min=0.0)
    min_sigma = max(epsilon, float(s.min()))
    inv = 1.0 / (s + min_sigma)
    z = Vh.transpose(-1, -2) @ (inv * (U.transpose(-1, -2) @ g.to(A.dtype)))
    return z, {"min_sigma": min_sigma, "max_sigma": float(s.max()), "cond": float(s.max()) / min_sigma}


def svd_solve_as_eigen(A: torch.Tensor, g: torch.Tensor, epsilon: float) -> torch.Tensor:
    r"""The same solve as :func:`svd_solve`, written in the eigenbasis of the symmetric ``A = Q diag(λ) Qᵀ``:
    ``z = Q diag(sign(λ_i) / (|λ_i| + max(ε, min |λ|))) Qᵀ g``. An independent route (``eigh``, no SVD) that makes
    the sign flip of negative modes explicit."""
    lam, Q = torch.linalg.eigh(A)
    a = lam.abs()
    min_sigma = max(epsilon, float(a.min()))
    coef = torch.sign(lam) / (a + min_sigma)
    return Q @ (coef * (Q.transpose(-1, -2) @ g.to(A.dtype)))


class AuthorsGN:
    """The authors' GN step on a list of parameter tensors (see the module docstring for the four steps).

    ``forward(*params) -> pred`` gives the ``N`` model outputs (any shape; flattened as ``pred.view(-1)``).
    :meth:`direction` returns ``(Δ_p for each parameter, statistics)`` for the output gradient ``g``.
    """

    def __init__(self, epsilon: float = 1e-7, chunk_max: int = 128) -> None:
        self.epsilon, self.chunk_max, self.pieces = float(epsilon), int(chunk_max), 1

    def jacobian(self, forward: Callable[..., torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        leaves = [p.detach().requires_grad_(True) for p in params]
        with torch.enable_grad():
            pred = forward(*leaves).reshape(-1)
            eye = torch.eye(pred.shape[0], dtype=pred.dtype, device=pred.device)

            def vjp_row(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return torch.autograd.grad(pred, leaves, v, allow_unused=True, retain_graph=True)

            while True:
                try:
                    return chunked_vmap(vjp_row, self.pieces, eye)
                except RuntimeError:
                    if self.pieces * 2 > self.chunk_max:
                        raise
                    self.pieces *= 2

    def direction(self, forward: Callable[..., torch.Tensor], params: Sequence[torch.Tensor],
                  g: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        jac = self.jacobian(forward, params)
        A = 0.0
        for J in jac:
            Jd = J.double()
            A = A + torch.einsum("n...,m...->nm", Jd, Jd)
        z, stats = svd_solve(A, g.reshape(-1), self.epsilon)
        out = [torch.einsum("n...,n->...", J, z.to(J.dtype)) for J in jac]
        return out, {**stats, "pieces": self.pieces}
