"""Tests for curvlab.linrep_baselines: every public function against a dense or Monte Carlo reference."""

import math

import numpy as np
import pytest
import torch

from curvlab import linrep, precond
from curvlab import linrep_baselines as B

DT = torch.float64


def _problem(S=3, d=8, k=2, d_y=4, kappa_x=20.0, noise=0.3, x_dist="gaussian", seed=0, **kw):
    return linrep.linrep_problem(S, d=d, k=k, d_y=d_y, kappa_x=kappa_x, kappa_F=2.0, noise=noise,
                                 x_dist=x_dist, transfer_kappa=10.0, seed=seed, **kw)


def _random_point(S=3, d=8, k=2, d_y=4, n=30, seed=1):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(S, d_y, k, generator=g, dtype=DT)
    G = torch.randn(S, k, d, generator=g, dtype=DT)
    X = torch.randn(S, n, d, generator=g, dtype=DT)
    Y = torch.randn(S, n, d_y, generator=g, dtype=DT)
    return F, G, X, Y


def _moments(X, Y):
    return linrep.batch_moments({"X": X, "Y": Y})


# ------------------------------------------------------------------------------------------------ NGD
@pytest.mark.parametrize("lam", [1e-6, 1e-2, 3.0])
def test_ngd_direction_matches_dense_gn_solve(lam):
    F, G, X, Y = _random_point()
    dF, dG = B.ngd_direction(F, G, *_moments(X, Y), lam)
    for s in range(F.shape[0]):
        rF, rG = B.ngd_direction_dense(F[s], G[s], X[s], Y[s], lam)
        scale = max(float(rF.abs().max()), float(rG.abs().max()))
        cond = 1 + float(torch.linalg.matrix_norm(X[s], 2) ** 2 * (F[s].norm() ** 2 + G[s].norm() ** 2)) / lam
        tol = 1e3 * torch.finfo(DT).eps * scale * cond
        assert torch.allclose(dF[s], rF, atol=tol, rtol=0)
        assert torch.allclose(dG[s], rG, atol=tol, rtol=0)


def test_ngd_direction_float32_keeps_dtype():
    F, G, X, Y = (t.float() for t in _random_point(S=2))
    dF, dG = B.ngd_direction(F, G, *_moments(X, Y), 0.1)
    assert dF.dtype == torch.float32 and dG.dtype == torch.float32
    rF, rG = B.ngd_direction(*(t.double() for t in (F, G)), *_moments(X.double(), Y.double()), 0.1)
    assert torch.allclose(dG.double(), rG, rtol=1e-3, atol=1e-4)


def test_ngd_update_is_one_damped_gn_step():
    P = _problem(S=2)
    st = linrep.init_state(P)
    X, Y = P.sample(40, torch.Generator().manual_seed(3))
    new = B.ngd_update(P, st, {"X": X, "Y": Y}, {"eta_G": 0.7, "lam_GN": 0.05})
    for s in range(2):
        rF, rG = B.ngd_direction_dense(st.F[s], st.G[s], X[s], Y[s], 0.05)
        assert torch.allclose(new.F[s], st.F[s] - 0.7 * rF, atol=1e-10)
        assert torch.allclose(new.G[s], st.G[s] - 0.7 * rG, atol=1e-10)
    assert new.t == 1


def test_ngd_bad_input():
    F, G, X, Y = _random_point()
    Sxx, Syx = _moments(X, Y)
    with pytest.raises(ValueError, match="lam_GN"):
        B.ngd_direction(F, G, Sxx, Syx, 0.0)
    with pytest.raises(ValueError, match="lam_GN"):
        B.ngd_direction(F, G, Sxx, Syx, -1.0)
    with pytest.raises(ValueError, match="agree on k"):
        B.ngd_direction(F[..., :1], G, Sxx, Syx, 0.1)
    with pytest.raises(ValueError, match="Sxx"):
        B.ngd_direction(F, G, Sxx[..., :-1, :-1], Syx, 0.1)
    with pytest.raises(ValueError, match="non-finite"):
        B.ngd_direction(F, G * float("nan"), Sxx, Syx, 0.1)
    with pytest.raises(ValueError, match="one seed"):
        B.ngd_direction_dense(F, G, X, Y, 0.1)
    P = _problem(S=1)
    with pytest.raises(ValueError, match="lam_GN"):
        B.ngd_update(P, linrep.init_state(P), P.population_batch(), {"eta_G": 1.0})


def test_ngd_population_converges_and_registered():
    P = _problem(S=2, noise=0.0)
    out = linrep.run("NGD", P, 30, None, {"eta_G": 1.0, "lam_GN": 1e-8})
    assert float(out["subspace_distance"][:, -1].max()) < 1e-6


# ------------------------------------------------------------------------------------------------ Adam, Shampoo
def test_adam_update_matches_torch_adam_with_least_squares_head():
    P = _problem(S=2)
    gen = torch.Generator().manual_seed(5)
    batches = [dict(zip("XY", P.sample(25, gen))) for _ in range(3)]
    st = linrep.init_state(P)
    G_ref = st.G.clone().requires_grad_(True)
    opt = torch.optim.Adam([G_ref], lr=0.02, betas=(0.9, 0.999), eps=1e-8)
    for b in batches:
        F = linrep.fit_head(G_ref.detach(), b["X"], b["Y"])
        G_ref.grad = linrep.grad_G(F, G_ref.detach(), *_moments(b["X"], b["Y"]))
        opt.step()
        st = B.adam_update(P, st, b, {"eta_G": 0.02})
        assert torch.allclose(st.F, F)
    assert torch.allclose(st.G, G_ref.detach(), atol=1e-12)


def test_shampoo_update_matches_dense_accumulation():
    P = _problem(S=2)
    gen = torch.Generator().manual_seed(6)
    st = linrep.init_state(P)
    G, L, R = st.G.clone(), None, None

    def power(C):  # C^{-1/4} by a float64 eigendecomposition
        lam, Q = torch.linalg.eigh(C)
        return (Q * lam.pow(-0.25).unsqueeze(-2)) @ Q.transpose(-2, -1)

    for i in range(3):
        b = dict(zip("XY", P.sample(25, gen)))
        F = linrep.fit_head(G, b["X"], b["Y"])
        g = linrep.grad_G(F, G, *_moments(b["X"], b["Y"]))
        if L is None:
            eps = 1e-4 * float(torch.linalg.matrix_norm(g, ord=2).max()) ** 2
            L, R = eps * torch.eye(P.k, dtype=DT), eps * torch.eye(P.d, dtype=DT)
        L, R = L + g @ g.transpose(-2, -1), R + g.transpose(-2, -1) @ g
        G = G - 0.1 * power(L) @ g @ power(R)
        st = B.shampoo_update(P, st, b, {"eta_G": 0.1, "shampoo_eps": 1e-4})
    assert torch.allclose(st.G, G, atol=1e-10)
    assert isinstance(st.extra["shampoo"], precond.ShampooState)


def test_adam_shampoo_bad_input():
    P = _problem(S=1)
    st, pop = linrep.init_state(P), P.population_batch()
    with pytest.raises(ValueError, match="eta_G"):
        B.adam_update(P, st, pop, {})
    with pytest.raises(ValueError, match="eta_G"):
        B.shampoo_update(P, st, pop, {"eta_G": -1.0})
    with pytest.raises(ValueError, match="shampoo_eps"):
        B.shampoo_update(P, st, pop, {"eta_G": 0.1, "shampoo_eps": 0.0})


# ------------------------------------------------------------------------------------------------ normalisation
def test_normaliser_full_and_diagonal():
    P = _problem()
    N = B.normaliser(P.Sigma, "full")
    assert torch.allclose(N @ P.Sigma @ N, torch.eye(P.d, dtype=DT).expand_as(N), atol=1e-10)
    assert torch.allclose(N, N.transpose(-2, -1))
    Nd = B.normaliser(P.Sigma, "diagonal")
    assert torch.allclose(torch.diagonal(Nd @ P.Sigma @ Nd, dim1=-2, dim2=-1), torch.ones(P.n_seeds, P.d, dtype=DT))
    assert torch.count_nonzero(Nd - torch.diag_embed(torch.diagonal(Nd, dim1=-2, dim2=-1))) == 0


def test_normaliser_bad_input():
    with pytest.raises(ValueError, match="kind"):
        B.normaliser(torch.eye(3, dtype=DT), "zca")
    with pytest.raises(ValueError, match="square"):
        B.normaliser(torch.ones(3, 2, dtype=DT))
    with pytest.raises(ValueError, match="singular"):
        B.normaliser(torch.zeros(3, 3, dtype=DT))
    with pytest.raises(ValueError, match="diagonal"):
        B.normaliser(-torch.eye(3, dtype=DT), "diagonal")
    with pytest.raises(ValueError, match="non-finite"):
        B.normaliser(torch.full((2, 2), float("inf")))


def test_whitening_population_limit_is_rowsp_Gstar_Sigma_half():
    """Population whitening + AMGD: tilde G -> rowsp(G* Sigma^{1/2}); mapped back with frozen statistics -> G*."""
    P = _problem(S=2, noise=0.0)
    out = B.run_normalised("whitening+AMGD", P, 400, None, {"eta_G": 0.9, "normalize_step": True}, record_every=400)
    assert float(out["subspace_distance"][:, -1].max()) < 1e-8
    limit = linrep.subspace_distance(P.Gstar @ P.Sigma_half, P.Gstar)
    assert torch.allclose(out["distance_normalised"][:, -1], limit, atol=1e-8)
    G_T = P.Gstar @ P.Sigma_half @ B.normaliser(P.Sigma_T, "full")      # re-estimated at transfer
    assert torch.allclose(out["transfer_loss_reestimated"][:, -1], linrep.transfer_loss(G_T, P), rtol=1e-6)
    assert float(out["transfer_loss"][:, -1].max()) < 1e-10


def test_batchnorm_equals_whitening_for_diagonal_sigma():
    P = _problem(S=2, basis="aligned")
    hp = {"eta_G": 0.5, "normalize_step": True}
    a = linrep.run("whitening+AMGD", P, 20, 40, hp, generator=torch.Generator().manual_seed(1))
    b = linrep.run("batchnorm+AMGD", P, 20, 40, hp, generator=torch.Generator().manual_seed(1))
    # aligned Sigma: the running second moment is not exactly diagonal, so only the population limit agrees
    pa = B.run_normalised("whitening+AMGD", P, 20, None, hp)
    pb = B.run_normalised("batchnorm+AMGD", P, 20, None, hp)
    assert torch.allclose(pa["subspace_distance"], pb["subspace_distance"], atol=1e-12)
    assert a["subspace_distance"].shape == b["subspace_distance"].shape


def test_run_normalised_matches_linrep_run_and_batch_stats():
    P = _problem(S=2)
    hp = {"eta_G": 0.5, "normalize_step": True}
    a = linrep.run("batchnorm+AMGD", P, 15, 30, hp, generator=torch.Generator().manual_seed(2), record_every=5)
    b = B.run_normalised("batchnorm+AMGD", P, 15, 30, hp, generator=torch.Generator().manual_seed(2),
                         record_every=5)
    assert torch.allclose(a["subspace_distance"][:, 1:], b["subspace_distance"], atol=1e-12)
    assert set(b) >= {"distance_normalised", "transfer_loss_reestimated", "step"}
    c = B.run_normalised("whitening+AMGD", P, 5, 30, {**hp, "stats": "batch"})
    assert torch.isfinite(c["subspace_distance"]).all()


def test_normalised_bad_input():
    P = _problem(S=1)
    with pytest.raises(ValueError, match="G_normalised"):
        B.normalised_metrics(P, linrep.init_state(P))
    with pytest.raises(ValueError, match="method"):
        B.run_normalised("AMGD", P, 5, 10, {"eta_G": 0.1})
    with pytest.raises(ValueError, match="stats"):
        B.whitening_update(P, linrep.init_state(P), P.population_batch(), {"eta_G": 0.1, "stats": "ema"})
    with pytest.raises(ValueError, match="n_steps"):
        B.run_normalised("whitening+AMGD", P, 0, 10, {"eta_G": 0.1})


# ------------------------------------------------------------------------------------------------ drift and noise floor
def test_gradient_drift_monte_carlo_matches_prediction():
    P = _problem(S=2, d=6, k=1, d_y=6, noise=3.0, kappa_x=30.0)
    n, R = 40, 3000
    for variant in ("refit_same", "refit_independent"):
        g = B.gradient_drift(P, P.Gstar, R, n, variant, generator=torch.Generator().manual_seed(7))
        pred = B.predicted_drift(P, n, variant)
        se = g.std(0) / math.sqrt(R)
        z = ((g.mean(0) - pred).abs() / se.clamp_min(1e-300))
        z = z[se > 0]
        assert float(z.max()) < 4.5, variant             # 24 statistics, Bonferroni-level threshold
    assert float(B.predicted_drift(P, n, "refit_independent").abs().max()) > 0


def test_predicted_drift_vanishes_without_noise_or_anisotropy():
    assert float(B.predicted_drift(_problem(noise=0.0), 30, "refit_independent").abs().max()) == 0
    assert float(B.predicted_drift(_problem(kappa_x=1.0), 30, "refit_independent").abs().max()) < 1e-12
    with pytest.raises(ValueError, match="gaussian"):
        B.predicted_drift(_problem(x_dist="rademacher"), 30, "refit_independent")
    with pytest.raises(ValueError, match="batch_size"):
        B.predicted_drift(_problem(), 3, "refit_independent")
    with pytest.raises(ValueError, match="f_variant"):
        B.gradient_drift(_problem(), _problem().Gstar, 2, 10, "fixed")


def test_amgd_noise_second_moment_monte_carlo():
    P = _problem(S=48, d=6, k=2, d_y=4, kappa_x=10.0, noise=0.5)
    n, T = 50, 40
    h_max = float(torch.linalg.eigvalsh(linrep.schur_curvature(P.Fstar, P.Gstar, P.Sigma)).max())
    eta = 0.5 / h_max
    init = linrep.LinRepState(F=P.Fstar.clone(), G=P.Gstar.clone())
    out = linrep.run("AMGD", P, T, n, {"eta_G": eta}, init=init, record_every=T,
                     generator=torch.Generator().manual_seed(8))
    sq = linrep.subspace_distance(out["final_G"], P.Gstar, "fro") ** 2
    pred = B.amgd_noise_second_moment(P, eta, T, n)
    ratio = sq / pred
    assert abs(float(ratio.mean()) - 1) < 4 * float(ratio.std()) / math.sqrt(48) + 0.05
    stat = B.amgd_noise_second_moment(P, eta, T, n, stationary=True)
    assert bool((stat >= pred).all())
    with pytest.raises(ValueError, match="too large"):
        B.amgd_noise_second_moment(P, 10 / h_max, T, n)
    with pytest.raises(ValueError, match="batch_size"):
        B.amgd_noise_second_moment(P, eta, T, 2)


def test_all_baselines_registered_and_run():
    P = _problem(S=2)
    hps = {"NGD": {"eta_G": 0.5, "lam_GN": 1e-3}, "Adam": {"eta_G": 1e-2}, "Shampoo": {"eta_G": 0.1},
           "whitening+AMGD": {"eta_G": 0.5, "normalize_step": True},
           "batchnorm+AMGD": {"eta_G": 0.5, "normalize_step": True}}
    for m, hp in hps.items():
        assert m in linrep.UPDATES
        out = linrep.run(m, P, 5, 20, hp)
        assert out["subspace_distance"].shape == (2, 6)
        assert torch.isfinite(out["transfer_loss"]).all()


# ------------------------------------------------------------------------------------------------ tuning, frames
def test_tune_picks_the_best_score_and_scores_errors_as_inf():
    P = _problem(S=2)
    best, scores = B.tune("Shampoo", P, 10, 30, {}, {"eta_G": [0.01, 1.0], "shampoo_eps": [1e-4, 0.0]},
                          record_every=5)
    assert len(scores) == 4
    assert all(s == math.inf for hp, s in scores if hp["shampoo_eps"] == 0.0)   # a ValueError scores inf
    finite = [(hp, s) for hp, s in scores if math.isfinite(s)]
    assert best == min(finite, key=lambda hs: hs[1])[0]
    out = linrep.run("Shampoo", P, 10, 30, best, record_every=5, generator=torch.Generator().manual_seed(0))
    m = max(1, round(0.1 * out["transfer_loss"].shape[-1]))
    ref = float(out["transfer_loss"][:, -m:].mean(-1).log10().mean())
    assert abs(ref - min(s for _, s in finite)) < 1e-12
    with pytest.raises(ValueError, match="grid"):
        B.tune("Adam", P, 5, 10, {}, {})
    with pytest.raises(ValueError, match="tail"):
        B.tune("Adam", P, 5, 10, {}, {"eta_G": [0.1]}, tail=0.0)


def test_grid_scores_are_per_seed_and_tune_takes_their_mean():
    P = _problem(S=3)
    grid = {"eta_G": [0.01, 1.0], "shampoo_eps": [1e-4, 0.0]}
    cells = B.grid_scores("Shampoo", P, 10, 30, {}, grid, record_every=5)
    assert [hp for hp, _ in cells] == [{"eta_G": e, "shampoo_eps": x} for e in grid["eta_G"] for x in grid["shampoo_eps"]]
    assert all(s.shape == (3,) for _, s in cells)
    assert all(np.isinf(s).all() for hp, s in cells if hp["shampoo_eps"] == 0.0)   # an error: inf on every seed
    out = linrep.run("Shampoo", P, 10, 30, cells[0][0], record_every=5, generator=torch.Generator().manual_seed(0))
    m = max(1, round(0.1 * out["transfer_loss"].shape[-1]))
    np.testing.assert_allclose(cells[0][1], out["transfer_loss"][:, -m:].mean(-1).log10().double().numpy(), rtol=1e-12)
    _, scores = B.tune("Shampoo", P, 10, 30, {}, grid, record_every=5)
    assert [s for _, s in scores] == [float(c.mean()) for _, c in cells]
    with pytest.raises(ValueError, match="grid"):
        B.grid_scores("Adam", P, 5, 10, {}, {"eta_G": []})


def test_speed_score_is_the_area_above_the_level_and_ignores_floors():
    """A straight log-line from 1 to 1e-2 over 10 steps: the area above 1e-1 is the triangle, 1 decade x 5 steps / 2,
    per step of the 10-step horizon; any floor below the level does not count; time-to-level is the first hit."""
    steps = torch.arange(0, 11.0, dtype=torch.float64)
    line = 10 ** (-steps / 5)                                # log10 d from 0 to -2
    floor = torch.where(steps <= 5, line, torch.full_like(line, 1e-9))   # same descent, far lower floor
    flat = torch.ones_like(line)                             # never moves
    out = {"subspace_distance": torch.stack([line, floor, flat]), "step": steps.expand(3, -1)}
    area = B.speed_score(out, 0.1)
    np.testing.assert_allclose(area[:2], [0.25, 0.25], rtol=1e-12)       # (1 * 5 / 2) / 10
    np.testing.assert_allclose(area[2], 1.0, rtol=1e-12)
    np.testing.assert_allclose(B.steps_to_level(out, 0.1), [5.0, 5.0, np.inf])
    assert np.isinf(B.speed_score({**out, "subspace_distance": torch.full((3, 11), float("nan"))}, 0.1)).all()
    with pytest.raises(ValueError, match="level"):
        B.speed_score(out, 0.0)
    with pytest.raises(ValueError, match="metric"):
        B.speed_score(out, 0.1, metric="loss")
    with pytest.raises(ValueError, match="rule"):
        B.score_runs([], 2, "fastest")
    with pytest.raises(ValueError, match="level"):
        B.score_runs([], 2, "speed")


def test_grid_runs_scored_by_both_rules_equal_grid_scores():
    P = _problem(S=2)
    grid = {"eta_G": [0.01, 0.3]}
    runs = B.grid_runs("Adam", P, 10, 30, {}, grid, record_every=5)
    tail = B.score_runs(runs, 2, "tail")
    ref = B.grid_scores("Adam", P, 10, 30, {}, grid, record_every=5)
    for (h1, s1), (h2, s2) in zip(tail, ref):
        assert h1 == h2 and np.array_equal(s1, s2)
    speed = B.score_runs(runs + [({"eta_G": 9.0}, None)], 2, "speed", level=0.1)
    np.testing.assert_array_equal(speed[0][1], B.speed_score(runs[0][1], 0.1))
    assert np.isinf(speed[-1][1]).all() and speed[-1][1].shape == (2,)


def test_traces_frame_is_tidy():
    P = _problem(S=2)
    outs = {m: B.run_method(m, P, 4, 20, {"eta_G": 0.5, "normalize_step": True}, record_every=2)
            for m in ("AMGD", "whitening+AMGD")}
    assert "distance_normalised" in outs["whitening+AMGD"] and "risk" in outs["AMGD"]
    df = B.traces_frame(outs, metrics=("subspace_distance", "distance_normalised"))
    assert list(df.columns) == ["method", "seed", "step", "metric", "value"]
    assert len(df) == 2 * 3 + 2 * 2 * 2                    # AMGD: steps 0,2,4; whitening: 2,4 (two metrics)
    assert set(df.metric) == {"subspace_distance", "distance_normalised"}
