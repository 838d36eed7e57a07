"""Bad input found by an independent check (issue 15): each case is refused with a clear error naming the user's
argument, instead of a silent divergence, a NaN or an error about an internal name."""

from __future__ import annotations

import pytest
import torch

from curvlab import deep_linear as D
from curvlab import linrep as L


# ---------------------------------------------------------------------------------------------- linrep K-FAC
@pytest.fixture(scope="module")
def small_problem():
    return L.linrep_problem(2, d=12, k=2, d_y=4, kappa_x=4.0, seed=1)


@pytest.mark.parametrize("method", ["K-FAC", "DFW"])
def test_undamped_whitened_step_with_fewer_samples_than_d_is_refused(small_problem, method):
    # n = 6 < d = 12 with lam_G = 0: Sigma_hat is singular; before the fix K-FAC ran and diverged (risk 28.8)
    with pytest.raises(ValueError, match=r"lam_G.*n = 6 < d = 12"):
        L.run(method, small_problem, 5, 6, dict(eta_G=0.5))
    with pytest.raises(ValueError, match="lam_G"):
        L.run_looped(method, small_problem, 5, 6, dict(eta_G=0.5))


def test_undamped_kfac_direct_call_with_rank_deficient_batch_is_refused(small_problem):
    gen = torch.Generator().manual_seed(0)
    X, Y = small_problem.sample(6, gen)
    state = L.init_state(small_problem, gen)
    with pytest.raises(ValueError, match=r"lam_G.*n = 6 < d = 12"):
        L.kfac_update(small_problem, state, {"X": X, "Y": Y}, dict(eta_G=0.5))
    with pytest.raises(ValueError, match="lam_G"):
        L.dfw_update(small_problem, state, {"X": X, "Y": Y, "X2": X, "Y2": Y}, dict(eta_G=0.5))
    # an exactly singular moment matrix (no 'X' to count rows): the failed solve is reported as lam_G's fault
    Sxx = torch.zeros(2, 12, 12, dtype=torch.float64)
    Sxx[:, :6, :6] = torch.eye(6, dtype=torch.float64)
    Syx = torch.zeros(2, 4, 12, dtype=torch.float64)
    Syx[:, :, :6] = 1.0
    G = torch.zeros(2, 2, 12, dtype=torch.float64)
    G[:, 0, 0] = G[:, 1, 1] = 1.0
    with pytest.raises(ValueError, match="lam_G"):
        L.kfac_update(small_problem, L.LinRepState(state.F, G), {"Sxx": Sxx, "Syx": Syx}, dict(eta_G=0.5))


def test_damped_or_full_batch_kfac_still_runs(small_problem):
    out = L.run("K-FAC", small_problem, 30, 6, dict(eta_G=0.5, lam_G=1e-3))   # n < d, damped: allowed
    assert torch.isfinite(out["risk"]).all()
    out = L.run("K-FAC", small_problem, 30, 12, dict(eta_G=0.5))                # n = d, undamped: allowed
    assert torch.isfinite(out["risk"]).all()
    assert float(out["subspace_distance"][:, -1].max()) < 1e-6


def test_least_squares_head_with_fewer_samples_than_k_is_refused(small_problem):
    with pytest.raises(ValueError, match=r"lam_head.*batch_size >= k = 2"):
        L.run("AMGD", small_problem, 3, 1, dict(eta_G=0.5))
    L.run("AMGD", small_problem, 3, 1, dict(eta_G=0.1, lam_head=1e-2))         # a ridge head is fine


# ---------------------------------------------------------------------------------------------- deep_linear
def test_gn_condition_names_sigma_hat_when_not_psd():
    Ws = D.init_weights(4, [3], 2, generator=torch.Generator().manual_seed(0))
    S = torch.diag(torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="Sigma_hat must be positive semi-definite") as info:
        D.gn_condition(Ws, S)
    assert "A must" not in str(info.value)
    for fn in (D.gn_reduced, D.spectrum_reduced, D.reduced_factor, D.layer_factors):
        with pytest.raises(ValueError, match="Sigma_hat"):
            fn(Ws, S)
    with pytest.raises(ValueError, match=r"Sigma_hat must be d x d = 4 x 4"):
        D.gn_condition(Ws, torch.eye(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="Sigma_hat must be square"):
        D.gn_condition(Ws, torch.ones(4, 3, dtype=torch.float64))


def test_rank_gn_with_a_bare_width_says_a_list_is_expected():
    with pytest.raises(TypeError, match=r"widths must be a list of integers \(e\.g\. \[3\]"):
        D.rank_gn(4, 3, 2)
    with pytest.raises(TypeError, match="widths"):
        D.rank_gn(4, "3", 2)
    with pytest.raises(ValueError, match=r"widths\[1\] must be >= 1"):
        D.rank_gn(4, [3, 0], 2)
    assert D.rank_gn(4, [3], 2) == 2 * (4 + 2 - 2)
    with pytest.raises(TypeError, match="widths must be a list"):
        D.init_weights(4, 3, 2)
    with pytest.raises(TypeError, match="batch must be a list"):
        D.init_weights(4, [3], 2, batch=5)
    with pytest.raises(TypeError, match="depths must be a list"):
        D.nested_networks(4, 3, 2, 3)


# ---------------------------------------------------------------------------------------------- fitted_rate
def test_fitted_rate_raises_for_a_window_with_fewer_than_six_points():
    """Consistent with curvlab.synthesis.tail_rate / mode_rate, which raise a ValueError when the trace has too
    few usable points: a rate is never NaN."""
    t = torch.arange(40, dtype=torch.float64)
    D_ = 0.5 ** t
    rate, se, drift = L.fitted_rate(D_, t)
    assert abs(float(rate[0]) - 0.5) < 1e-12
    with pytest.raises(ValueError, match=r"seed 0 has \d point\(s\).*window.*min_step"):
        L.fitted_rate(D_, t, window=(1e-3, 1e-2))
    with pytest.raises(ValueError, match="min_step"):
        L.fitted_rate(D_, t, min_step=38)
    two = torch.stack([D_, torch.full_like(D_, 0.5)])   # second seed: nothing inside the window
    with pytest.raises(ValueError, match="seed 1"):
        L.fitted_rate(two, t)
    with pytest.raises(ValueError, match="window must satisfy low < high"):
        L.fitted_rate(D_, t, window=(1e-2, 1e-10))
    with pytest.raises(TypeError, match="window must be a pair"):
        L.fitted_rate(D_, t, window=1e-2)
    with pytest.raises(TypeError, match="min_step"):
        L.fitted_rate(D_, t, min_step=1.5)


@pytest.mark.parametrize("make", [
    lambda X: D.flat_model(X, [(3, 4), (2, 3)]),
    lambda X: D.leaky_flat_model(X, 4, 3, 2, 0.1)[0],
    lambda X: D.bn_train_model(X, [(3, 4), (2, 3)]),
])
def test_float64_data_is_not_rounded_to_float32_parameters_silently(make):
    """Issue 26: the dense-route models computed in theta's dtype, rounding a float64 X to a float32 theta without
    a word; they now warn naming X and theta (and keep float64 when theta is float64)."""
    X = torch.randn(5, 4, dtype=torch.float64)
    fn = make(X)
    with pytest.warns(UserWarning, match="X is torch.float64 but theta is torch.float32"):
        assert fn(torch.randn(18, dtype=torch.float32)).dtype == torch.float32
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fn(torch.randn(18, dtype=torch.float64)).dtype == torch.float64
