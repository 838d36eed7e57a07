"""curvlab.model on nn.Modules: against a dense torch.func reference, curvlinops, BackPACK, and the book's own
structured routes (deep linear networks of chapter 30, the mean-field network of chapter 20)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from curvlab import deep_linear, meanfield
from curvlab import model as cm

N = 10


class _Flatten2d(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1)


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 3), nn.Tanh(), _Flatten2d(),
                         nn.Linear(2 * 2 * 2, 3))


def _bn():
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.uniform_(0.5, 1.5)
    return net.eval()


MODELS = {"mlp": (_mlp, (4,)), "cnn": (_cnn, (1, 4, 4)), "bn_eval": (_bn, (4,))}


def _case(kind: str, loss: str, seed: int = 0):
    torch.manual_seed(seed)
    make, shape = MODELS[kind]
    net = make().double()
    X = torch.randn(N, *shape, dtype=torch.float64)
    T = {"mse": lambda: torch.randn(N, 3, dtype=torch.float64), "cross_entropy": lambda: torch.randint(0, 3, (N,)),
         "bce": lambda: torch.rand(N, 3, dtype=torch.float64)}[loss]()
    return net, X, T


def _dense_reference(prob, X, T):
    """H_GN, grad L from the full Jacobian (torch.func.jacrev of the whole batch) and the loss Hessian in closed form."""
    th = prob.theta()
    f = lambda t: functional_call(prob.model, prob.unflatten(t), (X,))  # noqa: E731
    out, J = f(th), jacrev(f)(th)  # (n, c), (n, c, p)
    if prob.loss == "mse":
        Lam, g = torch.eye(3, dtype=out.dtype).expand(N, 3, 3), out - T
    elif prob.loss == "bce":  # BCEWithLogitsLoss(mean) averages over the n c entries
        s = out.sigmoid()
        Lam, g = torch.diag_embed(s * (1 - s)), s - T
    else:
        pi = out.softmax(-1)
        Lam, g = torch.diag_embed(pi) - pi[:, :, None] * pi[:, None, :], pi - nn.functional.one_hot(T, 3).double()
    norm = N * 3 if prob.loss == "bce" else N
    return torch.einsum("icp,icd,idq->pq", J, Lam, J) / norm, torch.einsum("icp,ic->p", J, g) / norm


@pytest.mark.parametrize("loss", cm.LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_against_dense_torch_func_reference(kind, loss):
    net, X, T = _case(kind, loss)
    prob = cm.problem(net, X, T, loss, chunk_size=4)  # three chunks: chunking must not change anything
    G, grad = _dense_reference(prob, X, T)
    scale = float(G.abs().max())
    assert torch.allclose(cm.ggn_matrix(prob), G, atol=1e-13 * scale, rtol=0)
    V = torch.randn(3, prob.p, dtype=torch.float64)
    assert torch.allclose(cm.ggn_vector_product(prob, V), V @ G, atol=1e-12 * scale, rtol=0)
    assert torch.allclose(cm.ggn_vector_product(prob, V[0]), G @ V[0], atol=1e-12 * scale, rtol=0)
    lam = torch.linalg.eigvalsh(G).flip(0)
    mu = torch.linalg.eigvalsh(cm.kernel_matrix(prob)).flip(0) / prob.norm  # K/norm has H_GN's nonzero eigenvalues
    r = min(prob.p, N * 3)
    assert torch.allclose(mu[:r], lam[:r], atol=1e-12 * scale, rtol=0)
    lam_GN = 1e-2 * float(lam[0])
    step = torch.linalg.solve(G + lam_GN * torch.eye(prob.p, dtype=G.dtype), grad)
    assert torch.allclose(cm.gn_step(prob, lam_GN), step, atol=1e-10 * float(step.abs().max()), rtol=0)
    # the foil: the undamped-kernel step with the damping in the wrong units (lam_GN added to K, not n lam_GN)
    foil = cm.gn_step(prob, lam_GN / N)
    assert not torch.allclose(foil, step, atol=1e-4 * float(step.abs().max()), rtol=0)


def test_cross_entropy_rank_cut_and_kappa_at_it():
    net, X, T = _case("mlp", "cross_entropy")
    prob = cm.problem(net, X, T, "cross_entropy")
    cond = cm.condition(prob)
    assert cond.rank == N * (3 - 1) < min(prob.p, 3 * N)  # S_i sqrt(pi_i) = 0 removes one direction per sample
    assert cond.gap > 1e8
    lam = torch.linalg.eigvalsh(_dense_reference(prob, X, T)[0]).flip(0)
    assert cond.kappa == pytest.approx(float(lam[0] / lam[cond.rank - 1]), rel=1e-9)


@pytest.mark.parametrize("loss", cm.LOSSES)
def test_lanczos_matches_dense_on_the_kernel_and_on_parameters(loss):
    torch.manual_seed(1)
    # nc < p: Lanczos on K/n;  nc > p: Lanczos on H_GN, where cross-entropy's softmax shift (the same vector added to
    # every row of the last layer) leaves width + 1 = 4 null directions, so k = 6 reaches past them
    for width, n, k in ((40, 6, 4), (3, 40, 6)):
        net = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2)).double()
        X = torch.randn(n, 3, dtype=torch.float64)
        T = {"mse": torch.randn(n, 2, dtype=torch.float64), "cross_entropy": torch.randint(0, 2, (n,)),
             "bce": torch.rand(n, 2, dtype=torch.float64)}[loss]
        prob = cm.problem(net, X, T, loss)
        dense, lanc = cm.condition(prob, method="dense"), cm.condition(prob, method="lanczos", k=k, tol=1e-12)
        assert lanc.size == dense.size and lanc.rank == dense.rank
        assert lanc.kappa == pytest.approx(dense.kappa, rel=1e-7)
        assert lanc.lambda_max == pytest.approx(dense.lambda_max, rel=1e-9)



def test_products_leave_parameters_and_vectors_alone_and_take_any_strides():
    # the products differentiate with respect to views of the module's own parameters and of v (no flat copies):
    # nothing may be written into them, and a non-contiguous batch of vectors gives the same products
    net, X, T = _case("cnn", "cross_entropy")
    prob = cm.problem(net, X, T, "cross_entropy", chunk_size=3)
    G = _dense_reference(prob, X, T)[0]
    th = prob.theta()
    V = torch.randn(prob.p, 3, dtype=torch.float64).T  # (3, p), not contiguous
    V0 = V.clone()
    got = cm.ggn_vector_product(prob, V)
    assert got.is_contiguous() and torch.equal(V, V0) and torch.equal(prob.theta(), th)
    assert torch.allclose(got, V @ G, atol=1e-12 * float(G.abs().max()), rtol=0)
    w = torch.randn(N * 3, dtype=torch.float64)  # the kernel product, accumulated over four chunks
    assert torch.allclose(cm._kernel_vector_product(prob, w), cm.kernel_matrix(prob) @ w,
                          atol=1e-12 * float(G.abs().max()) * N, rtol=0)
    assert torch.equal(prob.theta(), th)


def test_auto_never_forms_a_jacobian_larger_than_dense_max_entries(monkeypatch):
    # at p ~ 1e6 the dense route's J~ (nc x p) would not fit, although the kernel (nc x nc) is small: auto must
    # then take Lanczos, which never forms J~ (the foil: with the default budget the dense route forms it)
    net, X, T = _case("mlp", "mse")
    prob = cm.problem(net, X, T, "mse", chunk_size=4)
    dense = cm.condition(prob, method="dense")
    formed = []
    real = cm.jacobian
    monkeypatch.setattr(cm, "jacobian", lambda pr: formed.append(pr) or real(pr))
    lanc = cm.condition(prob, dense_max_entries=N * 3 * prob.p - 1, k=4, tol=1e-12)
    assert not formed
    assert lanc.rank == dense.rank and lanc.kappa == pytest.approx(dense.kappa, rel=1e-7)
    cm.condition(prob)  # default budget: dense, J~ formed
    assert formed
    with pytest.raises(ValueError, match="dense_max_entries"):
        cm.condition(prob, dense_max_entries=0)

def test_dataloader_equals_tensor_and_checks_batches():
    net, X, T = _case("mlp", "mse")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, T), batch_size=3)
    a, b = cm.problem(net, loader, loss="mse"), cm.problem(net, X, T, "mse")
    assert a.n == b.n == N and len(a.chunks) == 4
    v = torch.randn(a.p, dtype=torch.float64)
    assert torch.allclose(cm.ggn_vector_product(a, v), cm.ggn_vector_product(b, v), atol=1e-14, rtol=0)
    with pytest.raises(ValueError, match=r"inputs \(a DataLoader\) must yield \(inputs, targets\) pairs"):
        cm.problem(net, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=3))
    with pytest.raises(ValueError, match=r"inputs \(a DataLoader\) must yield"):
        cm.problem(net, [(X, T, T)])
    with pytest.raises(ValueError, match="leading sample dimension"):
        cm.problem(net, [(X, T[:3])])
    with pytest.raises(ValueError, match="targets must be None"):
        cm.problem(net, loader, T)


def test_frozen_parameters_and_buffers_are_constants():
    net, X, T = _case("bn_eval", "mse")
    net[0].bias.requires_grad_(False)
    prob = cm.problem(net, X, T, "mse")
    assert "0.bias" not in prob.names and prob.p == sum(p.numel() for p in net.parameters() if p.requires_grad)
    G, _ = _dense_reference(prob, X, T)
    assert torch.allclose(cm.ggn_matrix(prob), G, atol=1e-13, rtol=0)


def test_train_mode_batchnorm_uses_chunk_statistics_and_leaves_running_stats_alone():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double().train()
    X, T = torch.randn(N, 4, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)
    before = [b.clone() for b in net.buffers()]
    with pytest.warns(UserWarning, match=r"batch norm in training mode: '1' \(BatchNorm1d\)"):
        prob = cm.problem(net, X, T, "mse")
    G = cm.ggn_matrix(prob)
    cm.ggn_vector_product(prob, torch.ones(prob.p, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(before, net.buffers()))
    ref = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.Tanh(),
                        nn.Linear(6, 3)).double()
    ref.load_state_dict({k: v for k, v in net.state_dict().items() if "running" not in k and "num_batches" not in k})
    with pytest.warns(UserWarning, match="batch norm in training mode"):
        p_ref = cm.problem(ref, X, T, "mse")
    th = p_ref.theta()
    J = jacrev(lambda t: functional_call(ref, p_ref.unflatten(t), (X,)).reshape(-1))(th)  # samples coupled
    assert torch.allclose(G, J.T @ J / N, atol=1e-12, rtol=0)
    assert net.training


@pytest.mark.parametrize("loss", cm.LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.filterwarnings("ignore:K-FAC covers nn.Linear:UserWarning")  # bn_eval: batch norm's affine parameters
def test_kfac_factors_exact_on_last_layer_and_blocks_against_dense(kind, loss):
    net, X, T = _case(kind, loss)
    prob = cm.problem(net, X, T, loss, chunk_size=5)
    G, _ = _dense_reference(prob, X, T)
    facs = cm.kfac_factors(prob)
    errs = cm.kfac_block_errors(prob, facs)
    off = dict(zip(prob.names, torch.tensor([0, *prob.sizes]).cumsum(0).tolist()))
    for f in facs:
        o = off[f.weight]
        B = G[o:o + f.C_out.shape[0] * f.C_in.shape[0], o:o + f.C_out.shape[0] * f.C_in.shape[0]]
        rel = float(torch.linalg.matrix_norm(B - torch.kron(f.C_out, f.C_in)) / torch.linalg.matrix_norm(B))
        got = float(errs.set_index("param").loc[f.weight, "rel_error"])
        assert got == pytest.approx(rel, rel=1e-8, abs=1e-12)
    last = facs[-1]
    if loss == "mse":  # last layer of an MSE net: g_ij = e_j, so the block is exactly I kron C_in
        assert float(errs.set_index("param").loc[last.weight, "rel_error"]) < 1e-12
        # a small block also goes through the never-form-B route, accurate to ~sqrt(eps)
        assert float(cm.kfac_block_errors(prob, facs, dense_block_max=1).set_index("param")
                     .loc[last.weight, "rel_error"]) < 1e-6


# ----------------------------------------------------------------------------------------------- curvlinops
@pytest.mark.parametrize("loss", cm.LOSSES)
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.filterwarnings("ignore:K-FAC covers nn.Linear:UserWarning")  # bn_eval: batch norm's affine parameters
def test_against_curvlinops_ggn_and_kfac(kind, loss):
    curvlinops = pytest.importorskip("curvlinops", reason="curvlinops-for-pytorch (the `test` extra) is not installed")
    net, X, T = _case(kind, loss)
    T = (T > 0.5).double() if loss == "bce" else T  # curvlinops' BCEWithLogitsLoss takes binary targets only
    prob = cm.problem(net, X, T, loss)
    # curvlinops uses the module's loss: MSELoss(sum) = 2 * (our per-sample loss), not averaged: scale 1/(2n);
    # CrossEntropyLoss and BCEWithLogitsLoss (mean) are ours
    lf, scale = cm.torch_loss(prob)
    params = [p for p in net.parameters() if p.requires_grad]
    eye = torch.eye(prob.p, dtype=torch.float64)
    G_cl = scale * (curvlinops.GGNLinearOperator(net, lf, params, [(X, T)]) @ eye)
    G = cm.ggn_matrix(prob)
    assert float((G_cl - G).abs().max()) <= 1e-13 * float(G.abs().max())
    # K-FAC covers the Linear/Conv2d parameters only (not batch norm's affine ones)
    kparams = [p for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) for p in m.parameters()]
    K_cl = scale * (curvlinops.KFACLinearOperator(net, lf, kparams, [(X, T)], fisher_type="type-2")
                    @ torch.eye(sum(p.numel() for p in kparams), dtype=torch.float64))
    blocks = []
    for f in cm.kfac_factors(prob):
        blocks += [torch.kron(f.C_out, f.C_in)] + ([f.C_out] if f.bias else [])
    K = torch.block_diag(*blocks)
    assert float((K_cl - K).abs().max()) <= 1e-13 * float(K.abs().max())


# ----------------------------------------------------------------------------------------------- BackPACK
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # BackPACK's own hooks, inputs w/o grad
def test_against_backpack_diag_ggn_and_kflr(kind, loss):
    backpack = pytest.importorskip("backpack", reason="backpack-for-pytorch (the `test` extra) is not installed")
    from backpack.extensions import KFLR, DiagGGNExact

    net, X, T = _case(kind, loss)
    if kind == "cnn":
        net[4] = nn.Flatten()  # BackPACK knows nn.Flatten, not our reshape module
    prob = cm.problem(net, X, T, loss)
    G, facs = cm.ggn_matrix(prob), cm.kfac_factors(prob)  # before BackPACK's hooks are attached to a copy
    lf, scale = (nn.MSELoss(reduction="sum"), 1 / (2 * N)) if loss == "mse" else (nn.CrossEntropyLoss(), 1.0)
    bnet, blf = backpack.extend(copy.deepcopy(net)), backpack.extend(lf)
    with backpack.backpack(DiagGGNExact(), KFLR()):
        blf(bnet(X), T).backward()
    diag = torch.cat([scale * p.diag_ggn_exact.reshape(-1) for p in bnet.parameters()])
    assert float((diag - G.diagonal()).abs().max()) <= 1e-13 * float(G.abs().max())
    for f in facs:
        mod = dict(bnet.named_modules())[f.module]
        if isinstance(mod, nn.Conv2d):  # BackPACK's KFLR normalises over positions differently (checked: curvlinops)
            continue
        A, B = mod.weight.kflr  # BackPACK: [C_out, C_in] with its own split of the scale
        assert torch.allclose(scale * torch.kron(A, B), torch.kron(f.C_out, f.C_in), atol=1e-13, rtol=1e-10)


# ----------------------------------------------------------------------------------------------- the book's routes
def test_deep_linear_kappa_equals_chapter_30_reduced_form():
    torch.manual_seed(3)
    d, widths, d_y, n = 5, [4, 6], 3, 40
    Ws = deep_linear.init_weights(d, widths, d_y, generator=torch.Generator().manual_seed(3))
    net = nn.Sequential(*[nn.Linear(W.shape[1], W.shape[0], bias=False) for W in Ws]).double()
    with torch.no_grad():
        for lin, W in zip(net, Ws):
            lin.weight.copy_(W)
    X = torch.randn(n, d, dtype=torch.float64)
    prob = cm.problem(net, X, torch.zeros(n, d_y, dtype=torch.float64), "mse")
    reduced = deep_linear.gn_condition(Ws, X.T @ X / n)
    got = cm.condition(prob, rank=deep_linear.rank_gn(d, widths, d_y))
    assert got.rank == reduced.rank == deep_linear.rank_gn(d, widths, d_y) < cm.condition(prob).size
    assert got.kappa == pytest.approx(float(reduced.kappa), rel=1e-9)
    assert got.lambda_max == pytest.approx(float(reduced.lambda_max), rel=1e-10)
    assert cm.condition(prob).rank == got.rank  # the numerical cut finds the theoretical rank


class _MeanField(nn.Module):
    """curvlab.meanfield's network f = phi(XW^T + 1b^T) V^T / m as a module (parameters v, W, b)."""

    def __init__(self, params: meanfield.MFParams, act: str):
        super().__init__()
        self.v, self.W, self.b = (nn.Parameter(t[0].clone()) for t in params)
        self.act = act

    def forward(self, X):
        return meanfield.forward(meanfield.MFParams(self.v, self.W, self.b), X, self.act)


def test_meanfield_kernel_and_gn_step_equal_chapter_20_routes():
    m, d, d_y, n = 12, 4, 2, 9
    params = meanfield.init_student(m, d, init_std=1.0, v0_zero=False, d_y=d_y, seeds=(0,))
    X = torch.randn(1, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    Y = torch.randn(1, n, d_y, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    net = _MeanField(params, "silu")
    prob = cm.problem(net, X[0], Y[0], "mse")
    K_mf = meanfield.ntk(params, X, "silu")[0]
    assert torch.allclose(cm.kernel_matrix(prob), K_mf, atol=1e-13 * float(K_mf.abs().max()), rtol=0)
    eps = 1e-2  # meanfield.Damping is in kernel units: n lam_GN
    dirn = meanfield.gn_direction(params, X, Y, "silu", meanfield.Damping.constant(eps)).delta
    ref = torch.cat([dirn.v[0].reshape(-1), dirn.W[0].reshape(-1), dirn.b[0].reshape(-1)])
    assert torch.allclose(cm.gn_step(prob, eps / n), ref, atol=1e-10 * float(ref.abs().max()), rtol=0)


def test_apply_step_moves_the_parameters_by_minus_eta_delta():
    net, X, T = _case("mlp", "mse")
    prob = cm.problem(net, X, T, "mse")
    th, delta = prob.theta(), cm.gn_step(prob, 1e-3)
    loss0 = cm.loss_value(prob)
    cm.apply_step(prob, delta, eta=1e-3)
    assert torch.allclose(prob.theta(), th - 1e-3 * delta, atol=1e-15, rtol=0)
    assert cm.loss_value(prob) < loss0  # a descent direction: (H_GN + lam_GN I)^{-1} is positive definite


# ----------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_named():
    net, X, T = _case("mlp", "mse")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        cm.problem(lambda x: x, X, T)
    with pytest.raises(ValueError, match="loss must be one of"):
        cm.problem(net, X, T, "hinge")
    with pytest.raises(ValueError, match=r"model output must be 2-D \(n, c\)"):
        cm.problem(nn.Sequential(nn.Linear(4, 3), nn.Unflatten(1, (3, 1))).double(), X, T)
    with pytest.raises(ValueError, match=r"targets for loss='mse' must have shape \(n, c\)"):
        cm.problem(net, X, T[:, :2])
    with pytest.raises(ValueError, match="class indices"):
        cm.problem(net, X, torch.full((N,), 7), "cross_entropy")
    with pytest.raises(ValueError, match="targets must be given"):
        cm.problem(net, X)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        cm.problem(net, 3.0, T)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        cm.problem(net, X.numpy(), T)
    two = _mlp().double()
    two[2].to("meta")
    with pytest.raises(ValueError, match="model parameters must live on one device"):
        cm.problem(two, X, T)
    with pytest.raises(ValueError, match="requires_grad=True"):
        cm.problem(_mlp().double().requires_grad_(False), X, T)
    prob = cm.problem(net, X, T)
    with pytest.raises(ValueError, match=r"v must have shape"):
        cm.ggn_vector_product(prob, torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="prob must be a curvlab.model.Problem"):
        cm.condition(net)
    with pytest.raises(ValueError, match="method must be one of"):
        cm.condition(prob, method="power")
    with pytest.raises(ValueError, match="max_params"):
        cm.ggn_matrix(prob, max_params=10)
    with pytest.raises(ValueError, match="lam_GN"):
        cm.gn_step(prob, -1.0)
    ce = cm.problem(net, X, torch.randint(0, 3, (N,)), "cross_entropy")
    with pytest.raises(ValueError, match="cross-entropy's K is always singular"):
        cm.gn_step(ce, 0.0)
    with pytest.raises(ValueError, match="no trainable nn.Linear"), pytest.warns(UserWarning, match="_MeanField"):
        cm.kfac_factors(cm.problem(_MeanField(meanfield.init_student(3, 4, init_std=1.0, d_y=3), "silu"), X, T))


def test_docstring_examples_run():
    """The API page shows one example per function (in its docstring): they must run and print what they say."""
    import doctest

    torch.manual_seed(0)
    result = doctest.testmod(cm, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


@pytest.mark.parametrize("loss", cm.LOSSES)
def test_loss_value_and_gradient_against_torch_losses(loss):
    net, X, T = _case("cnn", loss)
    prob = cm.problem(net, X, T, loss, chunk_size=3)
    th = prob.theta().requires_grad_(True)
    out = functional_call(net, prob.unflatten(th), (X,))
    L = {"mse": lambda: 0.5 * ((out - T) ** 2).sum(1).mean(), "cross_entropy": lambda: nn.functional.cross_entropy(
        out, T), "bce": lambda: nn.functional.binary_cross_entropy_with_logits(out, T)}[loss]()
    (g,) = torch.autograd.grad(L, th)
    assert cm.loss_value(prob) == pytest.approx(float(L.detach()), rel=1e-13)
    assert torch.allclose(cm.loss_gradient(prob), g, atol=1e-14, rtol=1e-12)


def test_a_bare_linear_module_and_an_unused_layer():
    torch.manual_seed(5)
    lin = nn.Linear(4, 3).double()
    X, T = torch.randn(N, 4, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)
    (fac,) = cm.kfac_factors(cm.problem(lin, X, T))
    assert (fac.weight, fac.bias) == ("weight", "bias")
    assert torch.allclose(fac.C_in, X.T @ X / N) and torch.allclose(fac.C_out, torch.eye(3, dtype=torch.float64))

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(ValueError, match="does not use"):
        cm.kfac_factors(cm.problem(Unused().double(), X, T))
