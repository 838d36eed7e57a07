"""curvlab.model's operators in the ecosystem (issue 25): curvlab's GGN, kernel, K-FAC and damped inverses as
curvlinops-/SciPy-compatible operators, checked against curvlinops on three models (an MLP, a CNN, an eval-mode
batch-norm net); curvlinops' operators accepted where curvlab computes something new (kappa with its cut and gap,
K-FAC's distance to the exact block, the kernel-form damped step); the new losses, reductions and parameter subsets
against a dense torch.func reference (the full Jacobian and the loss's own Hessian in its outputs, by autograd)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from curvlab import model as cm

curvlinops = pytest.importorskip("curvlinops", reason="curvlinops-for-pytorch (the `test` extra) is not installed")
N = 10


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(2 * 2 * 2, 3))


def _bn():
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    return net.eval()


MODELS = {"mlp": (_mlp, (4,)), "cnn": (_cnn, (1, 4, 4)), "bn_eval": (_bn, (4,))}


def _case(kind, loss, seed=0):
    torch.manual_seed(seed)
    make, shape = MODELS[kind]
    net = make().double()
    X = torch.randn(N, *shape, dtype=torch.float64)
    T = {"mse": lambda: torch.randn(N, 3, dtype=torch.float64), "cross_entropy": lambda: torch.randint(0, 3, (N,)),
         "bce": lambda: torch.randint(0, 2, (N, 3)).double()}[loss]()
    return net, X, T


def _kparams(net):
    return [p for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) for p in m.parameters()]


@pytest.mark.parametrize("loss", cm.LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_ggn_operator_equals_curvlinops_and_composes_with_it(kind, loss):
    net, X, T = _case(kind, loss)
    prob = cm.problem(net, X, T, loss)
    lf, scale = cm.torch_loss(prob)
    params = [p for p in net.parameters() if p.requires_grad]
    theirs = curvlinops.GGNLinearOperator(net, lf, params, [(X, T)])
    ours = cm.ggn_operator(prob)
    eye = torch.eye(prob.p, dtype=torch.float64)
    G = cm.ggn_matrix(prob)
    tol = 1e-13 * float(G.abs().max())
    assert float((ours @ eye - G).abs().max()) <= tol
    assert float((scale * (theirs @ eye) - ours @ eye).abs().max()) <= tol
    # curvlinops' composition takes our operator: (scale * theirs - ours) is zero
    diff = (theirs * scale - ours) @ eye
    assert float(diff.abs().max()) <= tol
    # the tensor-list format, as curvlinops passes it
    v = [torch.randn(*p.shape, 2, dtype=torch.float64) for p in params]
    got = ours @ v
    ref = theirs @ v
    assert all(float((scale * b - a).abs().max()) <= tol for a, b in zip(got, ref))
    # a curvlinops estimator on our operator: the same random vectors give the same Hutchinson trace
    torch.manual_seed(7)
    t_ours = curvlinops.hutchinson_trace(ours, 8)
    torch.manual_seed(7)
    t_theirs = curvlinops.hutchinson_trace(theirs, 8) * scale
    assert float(t_ours) == pytest.approx(float(t_theirs), rel=1e-10)
    # SciPy: the largest eigenvalue by eigsh on .to_scipy() is the dense one
    from scipy.sparse.linalg import eigsh

    top = eigsh(ours.to_scipy(), k=1, which="LA", tol=1e-12, return_eigenvectors=False)[0]
    assert top == pytest.approx(float(torch.linalg.eigvalsh(G)[-1]), rel=1e-9)


@pytest.mark.parametrize("kind", list(MODELS))
def test_condition_of_a_curvlinops_operator_equals_condition(kind):
    net, X, T = _case(kind, "cross_entropy")
    prob = cm.problem(net, X, T, "cross_entropy")
    theirs = curvlinops.GGNLinearOperator(net, nn.CrossEntropyLoss(), list(net.parameters()), [(X, T)])
    a, b = cm.condition_of(theirs), cm.condition(prob)
    assert a.rank == b.rank == N * 2 and a.kappa == pytest.approx(b.kappa, rel=1e-8)
    assert a.gap > 1e8 and b.gap > 1e8
    # our kernel operator by Lanczos, with the softmax null directions handed over as known: the same kappa
    K = cm.kernel_operator(prob)
    with torch.no_grad():
        P = net(X).softmax(-1).sqrt()
    U = torch.block_diag(*P.unbind(0)).T
    c = cm.condition_of(K, method="lanczos", k=4, tol=1e-12, known_null=U)
    assert c.rank == b.rank and c.kappa == pytest.approx(b.kappa, rel=1e-7)


@pytest.mark.parametrize("loss", cm.LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.filterwarnings("ignore:K-FAC covers nn.Linear:UserWarning")
def test_kfac_operator_inverse_and_block_errors_against_curvlinops(kind, loss):
    net, X, T = _case(kind, loss)
    kp = _kparams(net)
    prob = cm.problem(net, X, T, loss, params=kp)  # K-FAC's parameters only
    lf, scale = cm.torch_loss(prob)
    theirs = curvlinops.KFACLinearOperator(net, lf, kp, [(X, T)], fisher_type="type-2")
    ours = cm.kfac_operator(prob)
    eye = torch.eye(prob.p, dtype=torch.float64)
    F = ours @ eye
    assert float((scale * (theirs @ eye) - F).abs().max()) <= 1e-13 * float(F.abs().max())
    lam = 1e-2 * float(torch.linalg.eigvalsh(F)[-1])
    inv_theirs = curvlinops.KFACInverseLinearOperator(theirs, damping=lam / scale, use_exact_damping=True)
    inv_ours = ours.inverse(lam) @ eye
    ref = torch.linalg.inv(F + lam * eye)
    assert float((inv_ours - ref).abs().max()) <= 1e-9 * float(ref.abs().max())
    assert float((inv_theirs @ eye / scale - inv_ours).abs().max()) <= 1e-9 * float(ref.abs().max())
    # K-FAC's distance to the exact GN block, from curvlinops' operator, equals curvlab's own (from its factors)
    own = cm.kfac_block_errors(prob).set_index("param").rel_error
    from_op = cm.kfac_block_errors(prob, theirs * scale).set_index("param").rel_error
    assert list(own.index) == list(from_op.index)
    assert (own - from_op).abs().max() <= 1e-10


@pytest.mark.parametrize("loss", cm.LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_damped_inverse_and_kernel_step_from_curvlinops_jacobian(kind, loss):
    net, X, T = _case(kind, loss)
    prob = cm.problem(net, X, T, loss)
    G = cm.ggn_matrix(prob)
    lam = 1e-2 * float(torch.linalg.eigvalsh(G)[-1])
    eye = torch.eye(prob.p, dtype=torch.float64)
    ref = torch.linalg.inv(G + lam * eye)
    assert float((cm.ggn_inverse_operator(prob, lam) @ eye - ref).abs().max()) <= 1e-9 * float(ref.abs().max())
    step = ref @ cm.loss_gradient(prob)
    J = curvlinops.JacobianLinearOperator(net, list(net.parameters()), [(X, T)])
    got = cm.gn_step(prob, lam, jac_op=J)
    assert float((got - step).abs().max()) <= 1e-9 * float(step.abs().max())
    assert float((cm.gn_step(prob, lam) - step).abs().max()) <= 1e-9 * float(step.abs().max())


# --------------------------------------------------------------------------- new losses against torch.func + autograd
def _reference(prob, X, T, torch_loss_fn):
    """H_GN = J^T (d^2 L / d f^2) J and grad L, with J by jacrev of the model and the loss's Hessian in its outputs by
    autograd (torch's own loss function): no code shared with curvlab.model."""
    th = prob.theta()
    f = lambda t: functional_call(prob.model, prob.unflatten(t), (X,))  # noqa: E731
    out, J = f(th), jacrev(f)(th)
    H = hessian(lambda o: torch_loss_fn(o, T))(out)
    k = out.numel()
    J2, H2 = J.reshape(k, -1), H.reshape(k, k)
    g = torch.func.grad(lambda o: torch_loss_fn(o, T))(out).reshape(-1)
    return J2.T @ H2 @ J2, J2.T @ g


def _per_token_net():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()  # (n, T, 4) -> (n, T, 3)


@pytest.mark.parametrize("reduction", cm.REDUCTIONS)
@pytest.mark.parametrize("case", ["per_token_ce", "per_token_soft", "bce", "mse", "ce"])
def test_losses_and_reductions_against_torch_func_and_autograd(case, reduction):
    torch.manual_seed(4)
    Tn = 5
    if case.startswith("per_token"):
        net, X = _per_token_net(), torch.randn(N, Tn, 4, dtype=torch.float64)
        T = torch.randint(0, 3, (N, Tn)) if case == "per_token_ce" else torch.softmax(
            torch.randn(N, Tn, 3, dtype=torch.float64), -1)
        loss = "cross_entropy"

        def fn(o, t):  # torch wants the classes on axis 1
            return nn.functional.cross_entropy(o.transpose(1, 2), t if t.dtype == torch.long else t.transpose(1, 2),
                                               reduction=reduction)
    else:
        net, X = _mlp().double(), torch.randn(N, 4, dtype=torch.float64)
        loss = {"bce": "bce", "mse": "mse", "ce": "cross_entropy"}[case]
        T = {"bce": torch.rand(N, 3, dtype=torch.float64), "mse": torch.randn(N, 3, dtype=torch.float64),
             "ce": torch.randint(0, 3, (N,))}[case]
        torch_fn = {"bce": nn.functional.binary_cross_entropy_with_logits, "ce": nn.functional.cross_entropy,
                    "mse": nn.functional.mse_loss}[case]
        # the book's MSE is (1/2)||f - y||^2 per sample: torch's mse_loss(sum) / 2, and 'mean' divides by n (not n c)
        div = 2.0 * (N if reduction == "mean" else 1) if case == "mse" else 1.0
        red = "sum" if case == "mse" else reduction

        def fn(o, t):
            return torch_fn(o, t, reduction=red) / div
    prob = cm.problem(net, X, T, loss, chunk_size=4, reduction=reduction)
    G, grad = _reference(prob, X, T, fn)
    scale = float(G.abs().max())
    assert float((cm.ggn_matrix(prob) - G).abs().max()) <= 1e-12 * scale
    assert float((cm.loss_gradient(prob) - grad).abs().max()) <= 1e-12 * float(grad.abs().max())
    with torch.no_grad():
        L = float(fn(net(X), T))
    assert cm.loss_value(prob) == pytest.approx(L, rel=1e-12)
    lam = 1e-2 * float(torch.linalg.eigvalsh(G)[-1])
    step = torch.linalg.solve(G + lam * torch.eye(prob.p, dtype=torch.float64), grad)
    assert float((cm.gn_step(prob, lam) - step).abs().max()) <= 1e-9 * float(step.abs().max())
    # the rank cut at the reference's rank (cross-entropy: the softmax shift's null directions, per sample and token)
    cond = cm.condition(prob)
    assert cond.rank == int(torch.linalg.matrix_rank(G, hermitian=True)) and cond.gap > 1e6
    assert cond.kappa == pytest.approx(float(torch.linalg.eigvalsh(G)[-1] / torch.linalg.eigvalsh(G)[-cond.rank]),
                                       rel=1e-7)


def test_params_subset_is_the_submatrix_of_the_full_ggn():
    net, X, T = _case("mlp", "mse")
    full = cm.problem(net, X, T)
    sub = cm.problem(net, X, T, params=[net[2].weight, "4.bias"])
    assert sub.names == ["2.weight", "4.bias"]
    idx = torch.cat([torch.arange(o, o + s) for k, o, s in zip(
        full.names, torch.tensor([0, *full.sizes]).cumsum(0).tolist(), full.sizes) if k in sub.names])
    G = cm.ggn_matrix(full)
    assert torch.allclose(cm.ggn_matrix(sub), G[idx][:, idx], atol=1e-14, rtol=0)
    with pytest.raises(ValueError, match="params: 'nope' is not a parameter name"):
        cm.problem(net, X, T, params=["nope"])


class _ClassesOnAxis1(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)  # (n, T, c) -> (n, c, T), torch's layout for CrossEntropyLoss


def test_per_token_cross_entropy_ggn_and_kfac_equal_curvlinops():
    # the same parameters; curvlinops sees the module with the classes moved to axis 1, as torch's loss wants them
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(6, 7, 4, dtype=torch.float64), torch.randint(0, 3, (6, 7))
    prob = cm.problem(net, X, y, "cross_entropy")
    assert prob.norm == 6 * 7 and prob.out_shape == (7, 3)
    wrapped, params = nn.Sequential(net, _ClassesOnAxis1()), list(net.parameters())
    eye = torch.eye(prob.p, dtype=torch.float64)
    G = curvlinops.GGNLinearOperator(wrapped, nn.CrossEntropyLoss(), params, [(X, y)]) @ eye
    assert float((G - cm.ggn_matrix(prob)).abs().max()) <= 1e-13 * float(G.abs().max())
    K = curvlinops.KFACLinearOperator(wrapped, nn.CrossEntropyLoss(), params, [(X, y)], fisher_type="type-2") @ eye
    assert float((K - cm.kfac_operator(prob) @ eye).abs().max()) <= 1e-13 * float(K.abs().max())


def test_condition_of_takes_scipy_and_torch_operators_and_names_bad_ones():
    from scipy.sparse.linalg import aslinearoperator

    lam = torch.tensor([5.0, 2.0, 1.0, 1e-20, 0.0], dtype=torch.float64)
    Q = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).Q
    M = Q @ torch.diag(lam) @ Q.T
    for op in (M, aslinearoperator(M.numpy())):
        got = cm.condition_of(op)
        assert got.rank == 3 and got.kappa == pytest.approx(5.0, rel=1e-12) and got.gap > 1e12
    with pytest.raises(ValueError, match="op is not symmetric"):
        cm.condition_of(M + torch.triu(torch.ones(5, 5, dtype=torch.float64), 1))
    with pytest.raises(TypeError, match="op must be a square"):
        cm.condition_of("matrix")
    with pytest.raises(ValueError, match="known_null must have shape"):
        cm.condition_of(M, method="lanczos", k=1, known_null=torch.ones(3, 1, dtype=torch.float64))


def test_new_arguments_are_checked_by_name():
    net, X, T = _case("mlp", "mse")
    with pytest.raises(ValueError, match="reduction must be one of"):
        cm.problem(net, X, T, reduction="average")
    with pytest.raises(TypeError, match="params must be a list"):
        cm.problem(net, X, T, params="0.weight")
    with pytest.raises(ValueError, match="params: an entry"):
        cm.problem(net, X, T, params=[torch.ones(3)])
    with pytest.raises(ValueError, match="targets for loss='bce' must be probabilities"):
        cm.problem(net, X, 2 * torch.ones(N, 3, dtype=torch.float64), "bce")
    prob = cm.problem(net, X, T)
    with pytest.raises(ValueError, match="precision must be one of"):
        cm.condition(prob, precision="half")
    with pytest.raises(ValueError, match="lam_GN"):
        cm.ggn_inverse_operator(prob, 0.0)
    with pytest.raises(ValueError, match="jac_op must be an"):
        cm.gn_step(prob, 1e-2, jac_op=torch.ones(3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="X must be a tensor"):
        cm.ggn_operator(prob) @ torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"factors \(an operator\) must be"):
        cm.kfac_block_errors(prob, torch.eye(3, dtype=torch.float64))
    lin = nn.Linear(4, 3).double()  # C_in of 2 samples in 4 dimensions is singular: no undamped inverse
    small = cm.problem(lin, X[:2], T[:2])
    with pytest.raises(ValueError, match="use damping > 0"):
        cm.kfac_operator(small).inverse()
    assert torch.isfinite(cm.kfac_operator(small).inverse(1e-3) @ torch.ones(small.p, dtype=torch.float64)).all()
    bn = _bn().double()
    with pytest.raises(ValueError, match=r"K-FAC has no block for the parameters \['1.weight', '1.bias'\]"), \
            pytest.warns(UserWarning, match="BatchNorm1d"):
        cm.kfac_operator(cm.problem(bn, X, T))
