"""curvlab.checks: every kind of check must be able to fail, tolerances must be computed, claims never raise."""

import json

import numpy as np
import pytest
import sympy as sp
import torch

from curvlab import checks
from curvlab.checks import CheckError, CheckFailed, Tolerance


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("CURVLAB_LEDGER_DIR", raising=False)
    checks.set_chapter("test")
    yield
    checks.reset()


def replicate_tol(rng, shape=(10,)):
    return Tolerance.replicates(rng.normal(size=(20, *shape)) * 0.01)


# ---------------------------------------------------------------- tolerances
def test_tolerance_refuses_typed_numbers():
    with pytest.raises(TypeError, match="tol must be a curvlab.checks.Tolerance"):
        checks.derived("x", measured=1.0, predicted=1.0, tol=1e-3, foil=2.0)
    with pytest.raises(TypeError, match="tol"):
        checks.bound("x", measured=1.0, upper=2.0, tol=0.1, foil=0.0)


def test_replicates_tolerance_is_a_t_interval_with_bonferroni():
    rng = np.random.default_rng(0)
    samples = rng.normal(size=(5, 1))
    one = Tolerance.replicates(samples)
    many = Tolerance.replicates(np.repeat(samples, 50, axis=1))  # same spread, 50 statistics at once
    se = samples.std(ddof=1) / np.sqrt(5)
    assert one.value > 3 * se  # t with 4 degrees of freedom is wider than z = 3
    assert many.value > one.value  # Bonferroni over 50 statistics widens it
    assert "5 replicates" in one.why


def test_replicates_tolerance_covers_at_the_advertised_rate():
    rng = np.random.default_rng(1)
    misses = 0
    for _ in range(2000):
        s = rng.normal(size=(6,))
        misses += abs(s.mean()) > Tolerance.replicates(s[:, None]).value
    assert misses / 2000 < 0.01  # nominal 0.27 %


def test_tolerance_components_add_and_explain():
    t = Tolerance.finite_size(0.1, why="c/sqrt(d) with c fitted") + Tolerance.float_error(np.ones(3), ops=10)
    assert t.value == pytest.approx(0.1 + 10 * np.finfo(float).eps)
    assert "finite size" in t.why and "float" in t.why


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Tolerance.replicates(np.ones(1)), "at least 2 replicates"),
        (lambda: Tolerance.replicates(np.array([1.0, np.nan])), "non-finite"),
        (lambda: Tolerance.finite_size(-1.0, why="x"), ">= 0"),
        (lambda: Tolerance.finite_size(1.0, why=""), "why"),
        (lambda: Tolerance.float_error(np.ones(2), ops=0), "ops"),
        (lambda: Tolerance.float_error(ops=3), "arrays"),
        (lambda: Tolerance.float_error(np.ones(2), ops=3, cond=0.5), "cond"),
    ],
)
def test_tolerance_bad_input(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_float_error_uses_the_array_dtype():
    t32 = Tolerance.float_error(torch.ones(3, dtype=torch.float32), ops=1)
    t64 = Tolerance.float_error(torch.ones(3, dtype=torch.float64), ops=1)
    assert t32.value == pytest.approx(np.finfo(np.float32).eps)
    assert t64.value == pytest.approx(np.finfo(np.float64).eps)


# ---------------------------------------------------------------- derived
def test_derived_passes_on_the_right_prediction_and_fails_on_a_wrong_one():
    rng = np.random.default_rng(2)
    truth = rng.normal(size=10)
    samples = truth + 0.01 * rng.normal(size=(20, 10))
    tol = Tolerance.replicates(samples)
    checks.derived("right", measured=samples.mean(0), predicted=truth, tol=tol, foil=truth + 1)
    with pytest.raises(CheckFailed, match="wrong"):
        checks.derived("wrong", measured=samples.mean(0), predicted=truth + 1, tol=tol, foil=truth)
    statuses = [r.status for r in checks.records()]
    assert statuses == ["passed", "failed"]


def test_derived_refuses_a_foil_that_passes():
    tol = Tolerance.finite_size(0.5, why="test")
    with pytest.raises(CheckError, match="foil also passes"):
        checks.derived("weak", measured=1.0, predicted=1.0, tol=tol, foil=1.1)


def test_derived_flags_underpowered_checks():
    tol = Tolerance.finite_size(0.5, why="test")
    checks.derived("coarse", measured=0.0, predicted=0.0, tol=tol, foil=1.0)  # tol = effect / 2
    checks.derived("fine", measured=0.0, predicted=0.0, tol=tol, foil=10.0)  # tol = effect / 20
    coarse, fine = checks.records()
    assert coarse.underpowered and not fine.underpowered


@pytest.mark.parametrize("bad", [np.nan, np.inf, [], "abc"])
def test_derived_bad_measurements(bad):
    tol = Tolerance.finite_size(0.1, why="t")
    with pytest.raises((ValueError, TypeError), match="measured"):
        checks.derived("x", measured=bad, predicted=0.0, tol=tol, foil=1.0)


def test_derived_shape_mismatch_is_a_clear_error():
    tol = Tolerance.finite_size(0.1, why="t")
    with pytest.raises(ValueError, match="broadcast"):
        checks.derived("x", measured=np.zeros(3), predicted=np.zeros(4), tol=tol, foil=np.ones(4))


def test_expect_failure_records_a_rejection_and_refuses_a_pass():
    tol = Tolerance.finite_size(0.1, why="t")
    with checks.expect_failure("a deliberately wrong value"):
        checks.derived("wrong", measured=0.0, predicted=1.0, tol=tol, foil=0.0)
    assert checks.records()[-1].status == "rejected as intended"
    with pytest.raises(CheckError, match="passed"):
        with checks.expect_failure("not wrong at all"):
            checks.derived("right", measured=0.0, predicted=0.0, tol=tol, foil=1.0)


# ---------------------------------------------------------------- bounds
def test_bound_holds_fails_and_needs_a_violated_foil():
    tol = Tolerance.float_error(np.ones(3), ops=3)
    checks.bound("kappa <= bound", measured=[1.0, 2.0, 3.0], upper=[2.0, 2.0, 4.0], tol=tol, foil=[1.0, 1.0, 1.0])
    with pytest.raises(CheckFailed, match="violated"):
        checks.bound("too small", measured=[1.0, 2.0, 3.0], upper=[1.0, 1.0, 1.0], tol=tol, foil=[0.0, 0.0, 0.0])
    with pytest.raises(CheckError, match="foil bound holds"):
        checks.bound("foil too loose", measured=[1.0], upper=[2.0], tol=tol, foil=[1.5])


# ---------------------------------------------------------------- identities
def test_identity_exact_route_and_perturbation():
    a, b = sp.symbols("a b", positive=True)
    checks.identity("square", (a + b) ** 2, a**2 + 2 * a * b + b**2)
    rec = checks.records()[-1]
    assert rec.route == "exact simplification" and "rejected" in rec.note
    with pytest.raises(CheckFailed):
        checks.identity("wrong square", (a + b) ** 2, a**2 + b**2)


def test_identity_falls_back_to_random_rationals(monkeypatch):
    monkeypatch.setattr(checks, "_is_zero_exact", lambda diff: False)
    x = sp.Symbol("x")
    checks.identity("rational fallback", (x**2 - 1) / (x - 1), x + 1, trials=5)
    assert checks.records()[-1].route == "exact evaluation at 5 random rational points"
    with pytest.raises(CheckFailed):
        checks.identity("rational fallback, wrong", (x**2 - 1) / (x - 1), x + 2, trials=5)


def test_identity_matrices_woodbury():
    J = sp.Matrix(2, 3, sp.symbols("j0:6"))
    e = sp.Symbol("e", positive=True)
    lhs = (e * sp.eye(3) + J.T * J).inv() * J.T
    rhs = J.T * (e * sp.eye(2) + J * J.T).inv()
    checks.identity("push-through", lhs, rhs)
    with pytest.raises(CheckFailed):
        checks.identity("push-through without damping on one side", lhs, J.T * (J * J.T + 2 * e * sp.eye(2)).inv())


def test_identity_rejects_a_helper_that_cannot_fail(monkeypatch):
    monkeypatch.setattr(checks, "_prove", lambda diff, trials, seed: "always")
    with pytest.raises(CheckError, match="perturbed"):
        checks.identity("vacuous", sp.Symbol("x"), sp.Symbol("x"))


def test_identity_bad_input():
    with pytest.raises(ValueError, match="shape"):
        checks.identity("shapes", sp.eye(2), sp.eye(3))
    with pytest.raises(TypeError, match="matrices"):
        checks.identity("kinds", sp.eye(2), sp.Symbol("x"))


# ---------------------------------------------------------------- claims
@pytest.mark.parametrize(
    "value, se, expect, status",
    [
        (1.0, 0.1, ">", "reproduced"),
        (-1.0, 0.1, ">", "not reproduced"),
        (0.1, 0.1, ">", "inconclusive"),
        (-1.0, 0.1, "<", "reproduced"),
        (1.0, 0.1, "<", "not reproduced"),
    ],
)
def test_claim_statuses_never_raise(value, se, expect, status):
    checks.claim("a claim", source="paper, Fig. 1", statistic="gap", value=value, se=se, expect=expect, threshold=0.0)
    assert checks.records()[-1].status == status


def test_claim_bad_input():
    with pytest.raises(ValueError, match="expect"):
        checks.claim("c", source="s", statistic="t", value=1.0, se=0.1, expect=">=", threshold=0.0)
    with pytest.raises(ValueError, match="single number"):
        checks.claim("c", source="s", statistic="t", value=[1.0, 2.0], se=0.1, expect=">", threshold=0.0)
    with pytest.raises(ValueError, match="se"):
        checks.claim("c", source="s", statistic="t", value=1.0, se=-0.1, expect=">", threshold=0.0)
    with pytest.raises(ValueError, match="source"):
        checks.claim("c", source="", statistic="t", value=1.0, se=0.1, expect=">", threshold=0.0)


# ---------------------------------------------------------------- ledger and report
def test_records_are_written_to_the_ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CURVLAB_LEDGER_DIR", str(tmp_path))
    checks.set_chapter("chapter_x")
    checks.section("S")
    checks.claim("c", source="s", statistic="t", value=1.0, se=0.1, expect=">", threshold=0.0)
    data = json.loads((tmp_path / "chapter_x.json").read_text())
    assert data[0]["section"] == "S" and data[0]["status"] == "reproduced" and data[0]["chapter"] == "chapter_x"


def test_report_is_one_collapsed_table_per_section():
    checks.section("First")
    checks.claim("c1", source="s", statistic="t", value=1.0, se=0.1, expect=">", threshold=0.0)
    first = checks.report()
    checks.section("Second")
    checks.claim("c2", source="s", statistic="t", value=-1.0, se=0.1, expect=">", threshold=0.0)
    second = checks.report()
    assert len(first.recs) == 1 and len(second.recs) == 1
    html = second._repr_html_()
    assert html.startswith("<details") and "<summary>" in html and "c2" in html and "c1" not in html
    assert "1 not reproduced" in second.summary()


# --------------------------------------------------------------------------------------------------------
# Prose bound to the ledger: checks.value and checks.conclude
# --------------------------------------------------------------------------------------------------------
def _three_claims():
    checks.claim("gap > 0", source="p", statistic="gap", value=1.0, se=0.1, expect=">", threshold=0.0)
    checks.claim("gap < 0", source="p", statistic="gap", value=1.0, se=0.1, expect="<", threshold=0.0)
    checks.claim("share < 0.5", source="p", statistic="share", value=0.45, se=0.1, expect="<", threshold=0.5)


def test_value_renders_the_ledger_fields():
    _three_claims()
    assert checks.value("gap > 0") == "1 ± 3·0.1"
    assert checks.value("gap > 0", field="verdict") == "reproduced"
    assert checks.value("gap < 0", field="verdict") == "not reproduced"
    assert checks.value("gap < 0", field="sign") == "positive"          # the interval's side of 0, whatever was claimed
    assert checks.value("share < 0.5", field="verdict") == "inconclusive"
    assert checks.value("share < 0.5", field="sign") == "undetermined"
    assert checks.value("share < 0.5", field="estimate") == "0.45"
    assert checks.value("share < 0.5", field="interval") == "[0.15, 0.75]"
    assert checks.value("share < 0.5", field="predicted") == "< 0.5"
    assert checks.value("share < 0.5", field="tolerance") == "0.3"
    checks.claim("share < 0.5", source="p", statistic="share", value=0.9, se=0.1, expect="<", threshold=0.5)
    assert checks.value("share < 0.5", field="sign") == "above 0.5"    # the last record of a name counts


def test_value_of_a_derived_check_and_its_sign():
    x = 1.0 + 0.1 * np.random.default_rng(0).standard_normal(32)
    checks.derived("mean", measured=x.mean(), predicted=1.0, foil=2.0, tol=Tolerance.replicates(x),
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert checks.value("mean", field="verdict") == "passed"
    assert checks.value("mean", field="sign") == "positive"
    assert checks.value("mean", field="routes") == "Monte Carlo vs closed form"
    assert checks.value("mean", field="basis") == "sampling vs closed form"
    assert float(checks.value("mean", field="estimate")) == pytest.approx(x.mean(), rel=1e-3)
    y = 0.01 * np.random.default_rng(1).standard_normal(32)
    checks.derived("zero mean", measured=y.mean(), predicted=0.0, foil=1.0, tol=Tolerance.replicates(y),
                   routes=("Monte Carlo", "symmetry"), evidence="evidence", basis="sampling vs closed form")
    assert checks.value("zero mean", field="sign") == "undetermined"   # within its tolerance of 0


def test_value_edge_rule_verdict():
    checks.claim("NGD faster", source="p", statistic="gap", value=-1.0, se=0.1, expect="<", threshold=0.0,
                 tuned_at_edge=["NGD damping"])
    assert checks.value("NGD faster", field="verdict") == "inconclusive (a tuned value at its grid's edge: NGD damping)"
    assert checks.value("NGD faster", field="status") == "inconclusive"
    assert checks.value("NGD faster", field="sign") == "negative"


def test_value_bad_input():
    _three_claims()
    with pytest.raises(checks.NotRecorded, match="no check or claim named 'gap = 0'"):
        checks.value("gap = 0")
    with pytest.raises(ValueError, match="field must be one of"):
        checks.value("gap > 0", field="colour")
    with pytest.raises(ValueError, match="has no 'foil'"):
        checks.value("gap > 0", field="foil")
    with pytest.raises(ValueError, match="name"):
        checks.value("")


def test_conclude_chooses_the_text_by_the_verdict(capsys):
    _three_claims()
    texts = dict(reproduced="R: $x$", not_reproduced="N", inconclusive="I")
    assert checks.conclusion_text("gap > 0", **texts) == "R: $x$"
    assert checks.conclusion_text("gap < 0", **texts) == "N"
    assert checks.conclusion_text("share < 0.5", **texts) == "I"
    checks.conclude("gap < 0", **texts)            # outside IPython: printed
    assert capsys.readouterr().out.strip() == "N"


def test_conclude_in_ipython_displays_markdown(monkeypatch):
    import IPython
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    _three_claims()
    checks.conclude("gap > 0", reproduced="**yes**", not_reproduced="no", inconclusive="?")
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Markdown) and shown[0].data == "**yes**"
    assert shown[0]._repr_markdown_() == "**yes**"


def test_conclude_refuses_what_the_ledger_does_not_support():
    _three_claims()
    with pytest.raises(checks.NotRecorded, match="record it before you cite it"):
        checks.conclude("never recorded", reproduced="r", not_reproduced="n", inconclusive="i")
    with pytest.raises(ValueError, match="is 'inconclusive', but no inconclusive= text"):
        checks.conclude("share < 0.5", reproduced="r", not_reproduced="n")
    with pytest.raises(ValueError, match="give the text"):
        checks.conclude("gap > 0")
    with pytest.raises(TypeError, match="reproduced must be Markdown"):
        checks.conclude("gap > 0", reproduced=1)
    x = 1.0 + 0.1 * np.random.default_rng(0).standard_normal(32)
    checks.derived("mean", measured=x.mean(), predicted=1.0, foil=2.0, tol=Tolerance.replicates(x),
                   routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    assert checks.conclusion_text("mean", passed="P") == "P"
    with checks.expect_failure("wrong mean"):
        checks.derived("wrong mean", measured=x.mean(), predicted=3.0, foil=1.0, tol=Tolerance.replicates(x),
                       routes=("Monte Carlo", "closed form"), evidence="evidence", basis="sampling vs closed form")
    with pytest.raises(ValueError, match="demonstration"):
        checks.conclude("wrong mean", passed="P", failed="F")
