"""The evidence lint (:func:`curvlab.checks.lint`) on synthetic checks: it must reject each kind of non-evidence.

The same function runs over the executed book's records in ``tests/test_built_book.py`` (marked ``built``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from curvlab import checks
from curvlab.checks import Tolerance


@pytest.fixture(autouse=True)
def fresh():
    checks.set_chapter("lint-test")
    yield
    checks.reset()


def rules(records=None) -> list[str]:
    return [f.rule for f in checks.lint(checks.records() if records is None else records)]


def mc_samples(mean: float, r: int = 64, seed: int = 0) -> np.ndarray:
    return mean + np.random.default_rng(seed).standard_normal(r)


def good_check() -> None:
    x = mc_samples(1.0)
    checks.derived("Monte Carlo mean = 1", measured=x.mean(), predicted=1.0, foil=2.0,
                   tol=Tolerance.replicates(x), routes=("Monte Carlo, 64 draws", "closed form"), evidence="evidence", basis="sampling vs closed form")


def test_a_good_check_passes_the_lint():
    good_check()
    assert rules() == []
    assert checks.evidence_summary(checks.records())["lint-test"]["evidence"] == 1


def test_unclassified_check_is_rejected():
    x = mc_samples(1.0)
    checks.derived("no classification", measured=x.mean(), predicted=1.0, foil=2.0, tol=Tolerance.replicates(x))
    assert rules() == ["unclassified"]


def test_a_deliberately_self_calibrated_check_is_rejected():
    """Chapter 21's old pattern: the tolerance is the deviation of *another* measurement from the prediction."""
    rng = np.random.default_rng(1)
    lo, hi = 3.0 + 0.3 * rng.standard_normal(5), 3.0 + 0.1 * rng.standard_normal(5)
    # Passes as a check (the build would not stop) ...
    checks.derived("travel law, self-calibrated", measured=hi, predicted=3.0, foil=1.0,
                   tol=Tolerance.deviation(lo, reference=3.0, why="deviation of the other decade from 3"),
                   routes=("simulation", "scaling law"), evidence="evidence", basis="sampling vs closed form")
    assert checks.records()[-1].status == "passed"
    # ... but the lint says it is no evidence.
    assert rules() == ["tolerance from prediction"]


def test_tolerance_declared_from_prediction_is_rejected():
    x = mc_samples(10.0)
    checks.derived("relative tolerance", measured=x.mean(), predicted=10.0, foil=20.0,
                   tol=Tolerance.finite_size(0.05 * 10.0 + 0.013, why="5 % of the prediction", from_prediction=True),
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == ["tolerance from prediction"]


def test_typed_relative_tolerance_is_detected_without_a_flag():
    checks.derived("typed 5 %", measured=0.85, predicted=0.847, foil=2.0,
                   tol=Tolerance.finite_size(0.05 * abs(0.847), why="looks computed"),
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == ["tolerance from prediction"]


def test_round_prediction_with_a_round_computed_tolerance_is_not_flagged():
    x = mc_samples(1.0)
    checks.derived("finite size 1/sqrt(100) around 1", measured=x.mean(), predicted=1.0, foil=2.0,
                   tol=Tolerance.finite_size(1 / np.sqrt(100), why="1/sqrt(d), d = 100"),
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == []


def test_tolerance_fitted_to_the_error_is_detected():
    x = mc_samples(1.0)
    err = abs(x.mean() - 1.0)
    checks.derived("tol = error", measured=x.mean(), predicted=1.0, foil=2.0,
                   tol=Tolerance.finite_size(err, why="the gap we saw"),
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == ["tolerance from prediction"]


def test_deviation_around_something_else_is_fine():
    rng = np.random.default_rng(2)
    a, b = 1.0 + 0.01 * rng.standard_normal(8), 1.0 + 0.01 * rng.standard_normal(8)
    checks.derived("two seeds sets", measured=a.mean(), predicted=1.0, foil=2.0,
                   tol=Tolerance.deviation(a, reference=b.mean(), why="spread of a around b's mean"),
                   routes=("seeds A", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == []


def test_foil_within_tolerance_is_rejected():
    # The foil is rejected in this run (the measurement fell on the far side), but the effect is below the tolerance.
    x = mc_samples(1.0, r=4, seed=3)
    tol = Tolerance.replicates(x)
    meas = 1.0 - 0.5 * tol.value
    checks.derived("weak foil", measured=meas, predicted=1.0, foil=1.0 + 0.6 * tol.value, tol=tol,
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == ["foil within tolerance"]


def test_one_computation_shown_as_evidence_is_rejected():
    y = np.random.default_rng(4).standard_normal(10)
    same = np.cumsum(y)
    checks.derived("same code path", measured=same, predicted=np.cumsum(y), foil=same + 1.0,
                   tol=Tolerance.float_error(same, ops=10), routes=("cumsum", "cumsum"), evidence="evidence", basis="different algorithm")
    assert set(rules()) == {"one computation"}
    checks.reset()
    checks.derived("same code path, honest", measured=same, predicted=np.cumsum(y), foil=same + 1.0,
                   tol=Tolerance.float_error(same, ops=10), compares="cumsum vs cumsum", evidence="consistency")
    assert rules() == []
    assert checks.evidence_summary(checks.records())["lint-test"] == {
        "evidence": 0, "consistency": 1, "unclassified": 0, "not evidence (lint)": 0,
        "reproduced": 0, "not reproduced": 0, "inconclusive": 0}


def test_integer_valued_agreement_is_not_one_computation():
    checks.derived("rank formula", measured=np.array([6.0, 8.0]), predicted=np.array([6.0, 8.0]),
                   foil=np.array([9.0, 12.0]), tol=Tolerance.float_error(np.array([9.0]), ops=1),
                   routes=("numerical rank (SVD)", "q(d + d_y - q)"), evidence="evidence", basis="different algorithm")
    assert rules() == []


def test_bound_rules():
    m = np.array([0.5, 0.8])
    checks.bound("bound, fitted slack", measured=m, upper=np.array([1.0, 1.0]), foil=np.array([0.1, 0.1]),
                 tol=Tolerance.finite_size(abs(float(np.max(m - 1.0))), why="the margin we saw"),
                 routes=("simulation", "bound"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == ["tolerance from prediction"]  # the tolerance is the check's own worst slack
    checks.reset()
    checks.bound("bound, weak foil", measured=np.array([0.5, 1.1]), upper=np.array([1.0, 1.0]), foil=np.array([0.75, 0.75]),
                 tol=Tolerance.float_error(m, ops=1) + Tolerance.finite_size(0.3, why="a finite-size term"),
                 routes=("simulation", "bound"), evidence="evidence", basis="sampling vs closed form")
    assert rules() == ["foil within tolerance"]


def test_lint_reads_ledger_json_and_skips_claims_and_demonstrations(tmp_path, monkeypatch):
    monkeypatch.setenv(checks.LEDGER_ENV, str(tmp_path))
    checks.set_chapter("lint-json")
    x = mc_samples(1.0)
    checks.derived("unclassified", measured=x.mean(), predicted=1.0, foil=2.0, tol=Tolerance.replicates(x))
    with checks.expect_failure("a wrong prediction"):
        checks.derived("demo", measured=x.mean(), predicted=5.0, foil=1.0, tol=Tolerance.replicates(x))
    checks.claim("a claim", source="paper", statistic="s", value=1.0, se=0.1, expect=">", threshold=0.0)
    recs = {"lint-json": json.loads((tmp_path / "lint-json.json").read_text())}
    found = checks.lint(recs)
    assert [(f.name, f.rule) for f in found] == [("unclassified", "unclassified")]
    assert "unclassified" in str(found[0])
    summary = checks.evidence_summary(recs)["lint-json"]
    assert summary["unclassified"] == 1 and summary["reproduced"] == 1


def test_lint_rejects_bad_input():
    with pytest.raises(TypeError, match="records"):
        checks.lint([1, 2])


def test_tolerance_provenance_bad_input():
    with pytest.raises(ValueError, match="values and reference"):
        Tolerance.deviation([], reference=1.0, why="w")
    with pytest.raises(ValueError, match="broadcast"):
        Tolerance.deviation(np.ones(3), reference=np.ones(2), why="w")
    with pytest.raises(TypeError, match="from_prediction"):
        Tolerance.finite_size(0.1, why="w", from_prediction="yes")
    t = Tolerance.deviation([1.0, 1.5], reference=1.0, why="w") + Tolerance.finite_size(0.1, why="v")
    assert t.value == pytest.approx(0.6) and len(t._refs()) == 2 and t._refs()[1] is None


def test_evidence_without_named_routes_and_basis_is_flagged():
    """The rule of the conventions page: an evidence check names its two routes and why they are independent."""
    x = mc_samples(1.0)
    tol = Tolerance.replicates(x)
    checks.derived("old style", measured=x.mean(), predicted=1.0, foil=2.0, tol=tol,
                   compares="Monte Carlo vs closed form", evidence="evidence")
    assert rules() == ["routes not named"]
    assert checks.evidence_summary(checks.records())["lint-test"]["not evidence (lint)"] == 1
    checks.reset()
    checks.derived("routes, no basis", measured=x.mean(), predicted=1.0, foil=2.0, tol=tol,
                   routes=("Monte Carlo", "closed form"), evidence="evidence")
    assert rules() == ["routes not named"]
    checks.reset()
    checks.derived("consistency needs no basis", measured=x.mean(), predicted=1.0, foil=2.0, tol=tol,
                   routes=("GD run", "the bound evaluated on the same run"), evidence="consistency")
    checks.derived("consistency with a basis", measured=x.mean(), predicted=1.0, foil=2.0, tol=tol,
                   routes=("GD run", "the bound evaluated on the same run"), evidence="consistency",
                   basis="bound vs what defines it")
    assert rules() == []
    rec = checks.records()[-1]
    assert rec.routes == ["GD run", "the bound evaluated on the same run"] and rec.basis == "bound vs what defines it"
    assert rec.compares == "GD run vs the bound evaluated on the same run"


def test_routes_and_basis_are_validated():
    x = mc_samples(1.0)
    kw = dict(measured=x.mean(), predicted=1.0, foil=2.0, tol=Tolerance.replicates(x))
    with pytest.raises(ValueError, match="basis of an evidence check must be one of"):
        checks.derived("a", routes=("a", "b"), evidence="evidence", basis="I checked it", **kw)
    with pytest.raises(ValueError, match="basis of an consistency check must be one of"):
        checks.derived("a", routes=("a", "b"), evidence="consistency", basis="sampling vs closed form", **kw)
    with pytest.raises(ValueError, match="routes must be a pair"):
        checks.derived("a", routes="a vs b", evidence="evidence", basis="different algorithm", **kw)
    with pytest.raises(ValueError, match="routes must be a pair"):
        checks.derived("a", routes=("a", ""), evidence="evidence", basis="different algorithm", **kw)
    with pytest.raises(ValueError, match="not both"):
        checks.derived("a", routes=("a", "b"), compares="c vs d", evidence="evidence", basis="different algorithm", **kw)
    with pytest.raises(ValueError, match="basis is given but evidence is not"):
        checks.derived("a", routes=("a", "b"), basis="different algorithm", **kw)
    with pytest.raises(ValueError, match="routes"):
        checks.bound("b", measured=0.5, upper=1.0, foil=0.1, tol=Tolerance.finite_size(0.01, why="w"),
                     evidence="evidence", basis="different algorithm")
    assert checks.records() == []


def test_identity_routes_default_and_override():
    import sympy as sp

    a = sp.Symbol("a")
    checks.identity("default routes", (a + 1) ** 2, a**2 + 2 * a + 1)
    rec = checks.records()[-1]
    assert rec.basis == "computer algebra vs hand derivation" and len(rec.routes) == 2
    checks.identity("rhs made by SymPy", (a + 1) ** 2, sp.expand((a + 1) ** 2),
                    routes=("SymPy: (a+1)^2", "SymPy: expand of the same"), evidence="consistency",
                    basis="same code path")
    assert rules() == []
    checks.identity("old compares", (a + 1) ** 2, a**2 + 2 * a + 1, compares="SymPy: lhs vs rhs, exact")
    assert rules() == ["routes not named"]
