r"""Executable theory: derived predictions are asserted, paper claims are ledgered.

The book makes two kinds of statement, and this module keeps them apart.

1. **Derived predictions** — identities, rates, closed forms and bounds *derived in the book*. They are
   asserted by :func:`derived`, :func:`bound` and :func:`identity`; a failure raises :class:`CheckFailed` and
   stops the book build. Their tolerance is a :class:`Tolerance`, which is *computed*, never typed: it is a sum
   of named components — ``z`` standard errors of the run's own replicate spread
   (:meth:`Tolerance.replicates`), a finite-size term derived or fitted in the chapter
   (:meth:`Tolerance.finite_size`), and floating-point error (:meth:`Tolerance.float_error`). A bare number is
   refused (``TypeError``).
2. **Paper claims** — a phenomenon a paper reports. :func:`claim` records it as *reproduced*, *not reproduced*
   or *inconclusive* with its statistic and uncertainty. It never raises: honesty over tuning.

Every check must be able to fail. :func:`derived` and :func:`bound` require a **foil** — a deliberately
wrong prediction (ideally the competing, wrong theory) — and refuse to pass unless the foil *fails* under the
same tolerance. The distance between the prediction and the foil is the *effect* the check distinguishes;
when the tolerance exceeds a third of it, the check is flagged **underpowered** in the active profile.
:func:`identity` proves a SymPy identity by exact simplification, falling back to exact evaluation at random
rational points, says which route proved it, and refuses to pass unless a perturbed right-hand side is
rejected by the same route.

Not every check that can fail is *evidence*. Each check names its two **routes** — ``routes=(measured route,
predicted route)``, the code or derivation each side comes from — and says whether they are independent
(``evidence="evidence"``, with a ``basis`` from :data:`INDEPENDENCE_BASES`) or not (``evidence="consistency"``,
optionally with a basis from :data:`CONSISTENCY_BASES`); the rule is on the book's conventions page. :func:`lint`
reads check records (live ones, or the JSON a book build writes) and rejects a derived check that (a) does not say
what it compares, or is classed as evidence without named routes and a basis, (b) has a tolerance computed from its
own prediction, (c) cannot tell the prediction from its foil within the tolerance, or (d) is classed as evidence
although both sides come from one computation. The book's test suite runs it over every executed chapter.

Prose never types what the ledger says. :func:`value` returns the ledger's string for a field of a record
(``measured``, ``verdict``, ``sign``, …, :func:`record_field`), and :func:`conclude` displays the Markdown sentence
written for the recorded verdict (one text per possible verdict), so a conclusion cannot contradict its ledger.

Every check is recorded in a registry. :func:`report` renders the current section's checks as one compact,
collapsed table; the book build collects the records into the reproduction ledger page (the chapter's records
are written as JSON to ``$CURVLAB_LEDGER_DIR/<chapter>.json`` when that variable is set).
"""

from __future__ import annotations

import html
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import config

__all__ = [
    "Z_DEFAULT",
    "UNDERPOWERED_RATIO",
    "Tolerance",
    "CheckRecord",
    "CheckFailed",
    "CheckError",
    "derived",
    "bound",
    "identity",
    "claim",
    "at_grid_edge",
    "lint",
    "LINT_RTOL",
    "INDEPENDENCE_BASES",
    "CONSISTENCY_BASES",
    "VALUE_FIELDS",
    "conclude",
    "conclusion_text",
    "value",
    "record_field",
    "LintFinding",
    "evidence_summary",
    "section",
    "report",
    "records",
    "set_chapter",
    "reset",
    "expect_failure",
    "CheckTable",
    "NotRecorded",
]

#: How many standard errors a replicate-spread tolerance spans (a false-alarm rate of about 0.3 % per
#: Gaussian statistic). Changing it changes every check in the book at once, and the ledger says so.
Z_DEFAULT = 3.0
#: A check is *underpowered* when its tolerance exceeds this fraction of the effect it distinguishes.
UNDERPOWERED_RATIO = 1.0 / 3.0
LEDGER_ENV = "CURVLAB_LEDGER_DIR"


class CheckFailed(AssertionError):
    """A derived prediction disagreed with the numbers: the book must not build."""


class CheckError(ValueError):
    """A check is malformed: e.g. its foil passes too, so it could not have failed."""


# --------------------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """A computed tolerance: a sum of named, explained, non-negative components.

    Build one with :meth:`replicates`, :meth:`standard_error`, :meth:`finite_size` or :meth:`float_error`
    and add them with ``+``. ``value`` is the sum; ``why`` explains each part in the ledger.
    """

    components: tuple[tuple[str, float, str], ...]
    #: One entry per component, ``None``, ``"prediction"`` (the component was computed from the predicted value,
    #: declared by the author) or a reference array (:meth:`deviation`), compared with the prediction at check time.
    references: tuple[Any, ...] = ()

    @property
    def value(self) -> float:
        return float(sum(v for _, v, _ in self.components))

    @property
    def why(self) -> str:
        return " + ".join(f"{kind} {v:.3g} ({why})" for kind, v, why in self.components)

    def __add__(self, other: Tolerance) -> Tolerance:
        if not isinstance(other, Tolerance):
            raise TypeError(f"can only add a Tolerance to a Tolerance, got {type(other).__name__}")
        return Tolerance(self.components + other.components, self._refs() + other._refs())

    def _refs(self) -> tuple[Any, ...]:
        return tuple(self.references) + (None,) * (len(self.components) - len(self.references))

    @staticmethod
    def _component(kind: str, value: float, why: str, reference: Any = None) -> Tolerance:
        if not isinstance(why, str) or not why.strip():
            raise ValueError("why must say where this tolerance component comes from")
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a {kind} tolerance component must be finite and >= 0, got {value}")
        return Tolerance(((kind, value, why),), (reference,))

    @classmethod
    def replicates(cls, samples: Any, *, z: float = Z_DEFAULT, why: str = "replicate spread") -> Tolerance:
        r"""A confidence half-width for the replicate mean, from the replicates' own spread.

        ``samples`` has shape ``(R, ...)``: ``R`` independent replicates of a scalar or of an array of ``m``
        statistics. The half-width is ``q · max(std / sqrt(R))`` where ``q`` is the Student-t quantile with
        ``R − 1`` degrees of freedom at the two-sided coverage of ``z`` Gaussian standard errors, Bonferroni-
        corrected for the ``m`` statistics checked at once — so a check on many coordinates, or with few
        replicates, is not a coin toss.
        """
        from scipy import stats

        a = np.asarray(_to_numpy(samples), dtype=float)
        if a.ndim == 0 or a.shape[0] < 2:
            raise ValueError(f"samples must hold at least 2 replicates along axis 0, got shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("samples contains non-finite values")
        r, m = a.shape[0], max(1, int(np.prod(a.shape[1:])))
        alpha = 2.0 * stats.norm.sf(z) / m
        q = float(stats.t.isf(alpha / 2.0, df=r - 1))
        se = float(np.max(a.std(axis=0, ddof=1) / math.sqrt(r)))
        return cls._component(
            "replicates", q * se, f"t-quantile {q:.3g} (z={z:g}, {r} replicates, {m} statistics) · SE {se:.2g}; {why}"
        )

    @classmethod
    def standard_error(cls, se: Any, *, z: float = Z_DEFAULT, why: str) -> Tolerance:
        """``z`` times a standard error computed elsewhere (e.g. a regression's slope SE)."""
        se_arr = np.asarray(_to_numpy(se), dtype=float)
        if se_arr.size == 0 or not np.isfinite(se_arr).all() or (se_arr < 0).any():
            raise ValueError("se must be finite standard errors >= 0")
        se_val = float(np.max(se_arr))
        return cls._component("standard error", z * se_val, f"{z:g}·SE; {why}")

    @classmethod
    def finite_size(cls, value: Any, *, why: str, from_prediction: bool = False) -> Tolerance:
        """A finite-size term the chapter derived or fitted (e.g. ``c/sqrt(d)`` with ``c`` fitted on a sweep).

        ``from_prediction=True`` declares that ``value`` was computed from the predicted value itself (e.g. a
        relative tolerance ``0.05·|predicted|``); the check still runs, but the ledger and :func:`lint` do not count
        it as evidence.
        """
        v = np.asarray(_to_numpy(value), dtype=float)
        if v.size == 0 or (v < 0).any():
            raise ValueError("a finite size tolerance component must be >= 0")
        if not isinstance(from_prediction, bool):
            raise TypeError(f"from_prediction must be a bool, got {type(from_prediction).__name__}")
        return cls._component("finite size", float(np.max(v)), why, "prediction" if from_prediction else None)

    @classmethod
    def deviation(cls, values: Any, *, reference: Any, why: str) -> Tolerance:
        """``max |values − reference|``: the spread of *other* measurements (a neighbouring size, decade or seed
        set) around a reference value.

        The reference is kept: when the check that uses this tolerance predicts that same reference, the tolerance
        was computed from the prediction (the spread of one measurement around the claim calibrates the test of
        another), and the check is flagged ``tolerance from prediction`` — not evidence (:func:`lint`).
        """
        v = np.asarray(_to_numpy(values), dtype=float)
        r = np.asarray(_to_numpy(reference), dtype=float)
        if v.size == 0 or r.size == 0 or not (np.isfinite(v).all() and np.isfinite(r).all()):
            raise ValueError("values and reference must be non-empty and finite")
        try:
            dev = float(np.max(np.abs(v - r)))
        except ValueError as exc:
            raise ValueError(f"values and reference must broadcast together: {exc}") from exc
        return cls._component("deviation", dev, why, r.copy())

    @classmethod
    def float_error(cls, *arrays: Any, ops: int, cond: float = 1.0, dtype: Any = None) -> Tolerance:
        r"""Rounding error of a computation with ``ops`` sequential operations on these arrays.

        ``eps(dtype) · ops · cond · max|a|``: the standard worst-case growth of floating-point error
        (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3), with ``cond`` the condition number
        of the problem when a solve is involved. ``dtype`` defaults to the arrays' own.
        """
        if not arrays:
            raise ValueError("float_error needs the arrays whose scale sets the error")
        if isinstance(ops, bool) or not isinstance(ops, (int, np.integer)) or ops < 1:
            raise ValueError(f"ops must be a positive integer, got {ops!r}")
        np_arrays = [np.asarray(_to_numpy(a)) for a in arrays]
        if dtype is None:
            dtype = np.result_type(*[a.dtype for a in np_arrays])
        eps = float(np.finfo(_np_dtype(dtype)).eps)
        scale = max(float(np.max(np.abs(a))) if a.size else 0.0 for a in np_arrays)
        if not math.isfinite(cond) or cond < 1:
            raise ValueError(f"cond must be a finite condition number >= 1, got {cond}")
        return cls._component(
            "float", eps * int(ops) * cond * max(scale, 1e-300), f"eps={eps:.2g} · ops={int(ops)} · cond={cond:.3g} · scale={scale:.3g}"
        )


def _np_dtype(dtype: Any) -> Any:
    s = str(dtype).replace("torch.", "")
    return {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.float32}.get(s, dtype)


def _to_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu")
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return x


# --------------------------------------------------------------------------------------------------------
# Records and the registry
# --------------------------------------------------------------------------------------------------------
@dataclass
class CheckRecord:
    """One line of the reproduction ledger."""

    chapter: str
    section: str
    kind: str  # derived | bound | identity | claim
    name: str
    source: str
    profile: str
    status: str  # passed | failed | reproduced | not reproduced | inconclusive
    statistic: str = ""
    measured: str = ""
    predicted: str = ""
    foil: str = ""
    tolerance: float | None = None
    tolerance_why: str = ""
    effect: float | None = None
    underpowered: bool = False
    route: str = ""
    compares: str = ""  # "what is compared with what": the measured side's route vs the predicted side's route
    evidence: str = ""  # "evidence" (two independent routes) | "consistency" (one code path) | "" (unclassified)
    routes: list = field(default_factory=list)  # [measured route, predicted route] when named with routes=
    basis: str = ""  # why the routes are independent (INDEPENDENCE_BASES) or why they are not (CONSISTENCY_BASES)
    note: str = ""
    # Numbers for the evidence lint (:func:`lint`), recorded by derived() and bound():
    error: float | None = None  # max |measured − predicted| (derived) or worst slack max(measured − bound) (bound)
    foil_error: float | None = None  # the same for the foil
    predicted_scale: float | None = None  # max |predicted|
    identical: bool = False  # measured and predicted equal bit for bit, and not all integers
    tolerance_parts: list = field(default_factory=list)  # [{kind, value, why, from_prediction}]
    # Numbers behind the ``sign`` field (:func:`record_field`): a claim's estimate, interval and threshold; a derived
    # or bound check's smallest and largest measured value.
    estimate: float | None = None
    interval: list | None = None  # [low, high] of a claim's z·SE interval
    threshold: float | None = None
    measured_min: float | None = None
    measured_max: float | None = None
    timestamp: float = field(default_factory=time.time)


_STATE: dict[str, Any] = {"chapter": "interactive", "section": "", "records": [], "reported": 0}


def set_chapter(chapter: str) -> None:
    """Name the chapter whose checks follow (called by :func:`curvlab.setup`); clears the registry."""
    if not isinstance(chapter, str) or not chapter.strip():
        raise ValueError("chapter must be a non-empty string")
    reset()
    _STATE["chapter"] = chapter.strip()


def reset() -> None:
    """Forget all records (tests use this)."""
    _STATE.update(section="", records=[], reported=0)


def section(title: str) -> None:
    """Start a new section: following checks are grouped under ``title`` in reports and the ledger."""
    if not isinstance(title, str) or not title.strip():
        raise ValueError("title must be a non-empty string")
    _STATE["section"] = title.strip()


def records() -> list[CheckRecord]:
    """All records of the current chapter, in order."""
    return list(_STATE["records"])


def _record(rec: CheckRecord) -> CheckRecord:
    _STATE["records"].append(rec)
    _flush()
    return rec


def _flush() -> None:
    out = os.environ.get(LEDGER_ENV)
    if not out:
        return
    path = Path(out) / f"{_STATE['chapter']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([asdict(r) for r in _STATE["records"]], indent=1))
    os.replace(tmp, path)


def _fmt(x: Any) -> str:
    a = np.asarray(_to_numpy(x), dtype=float)
    if a.size == 1:
        return f"{float(a.reshape(-1)[0]):.6g}"
    return f"array{tuple(a.shape)} in [{a.min():.4g}, {a.max():.4g}]"


def _as_array(name: str, x: Any) -> np.ndarray:
    try:
        a = np.asarray(_to_numpy(x), dtype=float)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a number or an array of numbers, got {type(x).__name__}") from exc
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains non-finite values")
    return a


def _require_tolerance(tol: Any) -> Tolerance:
    if not isinstance(tol, Tolerance):
        raise TypeError(
            "tol must be a curvlab.checks.Tolerance computed from the run (replicates, standard_error, "
            f"finite_size, float_error), not a typed {type(tol).__name__}"
        )
    return tol


EVIDENCE_KINDS = ("evidence", "consistency")

#: Why two routes count as independent — the only admissible ``basis`` of an evidence check (the rule is stated on
#: the book's conventions page, "Evidence and consistency"):
#:
#: * ``"different algorithm"`` — the two sides compute the same quantity by different algorithms (a dense
#:   ``torch.func`` Jacobian vs a structured or matrix-free route; an eigensolver vs a power iteration);
#: * ``"symbolic vs numeric"`` — SymPy (or another exact computation) on one side, floating-point numerics on the other;
#: * ``"sampling vs closed form"`` — Monte Carlo over random draws on one side, a closed form derived in the text on
#:   the other;
#: * ``"numerics vs closed form"`` — a deterministic computation (a run of an iteration, a dense eigendecomposition) on
#:   one side, a closed form the text derives for its outcome (a rate, a spectrum, a fixed point) on the other;
#: * ``"computer algebra vs hand derivation"`` — SymPy builds one side from the definitions, the other is the closed
#:   form derived by hand in the text (the default of :func:`identity`);
#: * ``"independent implementation"`` — another implementation of the same method (another library, the authors'
#:   code, a from-scratch re-implementation that shares no code with the route it checks);
#: * ``"different source"`` — the two sides come from different data or different published results.
INDEPENDENCE_BASES = (
    "different algorithm",
    "symbolic vs numeric",
    "sampling vs closed form",
    "numerics vs closed form",
    "computer algebra vs hand derivation",
    "independent implementation",
    "different source",
)
#: Why two routes are NOT independent — the admissible ``basis`` of a consistency check (optional there):
#: one code path, the same data re-fitted, an identity or inequality that holds for every input applied to the objects
#: that define both sides, a library function vs a closed form of the same iteration, a bound compared with what
#: defines it, or true by construction.
CONSISTENCY_BASES = (
    "same code path",
    "same data re-fitted",
    "algebra on its defining objects",
    "same iteration in two forms",
    "bound vs what defines it",
    "by construction",
)


def _classify(compares: str, evidence: str | None, routes: Any = None, basis: str | None = None) -> dict[str, Any]:
    """Validate the "what is compared with what" keywords of a check: ``routes`` (or the older ``compares``),
    ``evidence`` and ``basis``."""
    if not isinstance(compares, str):
        raise TypeError(f"compares must be a string ('<measured route> vs <predicted route>'), got {type(compares).__name__}")
    if evidence is None:
        evidence = ""
    if evidence not in ("",) + EVIDENCE_KINDS:
        raise ValueError(f"evidence must be one of {list(EVIDENCE_KINDS)}, got {evidence!r}")
    route_list: list[str] = []
    if routes is not None:
        if (isinstance(routes, str) or not isinstance(routes, (tuple, list)) or len(routes) != 2
                or not all(isinstance(x, str) and x.strip() for x in routes)):
            raise ValueError("routes must be a pair of non-empty strings: (measured route, predicted route), "
                             f"got {routes!r}")
        route_list = [x.strip() for x in routes]
        joined = " vs ".join(route_list)
        if compares.strip() and compares.strip() != joined:
            raise ValueError("give routes= or the older compares=, not both (compares is derived from routes)")
        compares = joined
    if basis is None:
        basis = ""
    if not isinstance(basis, str):
        raise TypeError(f"basis must be a string, got {type(basis).__name__}")
    basis = basis.strip()
    if basis:
        allowed = INDEPENDENCE_BASES if evidence == "evidence" else CONSISTENCY_BASES if evidence == "consistency" else ()
        if not evidence:
            raise ValueError("basis is given but evidence is not: say evidence='evidence' or 'consistency'")
        if basis not in allowed:
            raise ValueError(f"basis of an {evidence} check must be one of {list(allowed)}, got {basis!r} "
                             "(the rule is on the book's conventions page)")
    if evidence and not compares.strip():
        raise ValueError("routes (or compares) must say what is compared with what when evidence is given")
    return dict(compares=compares.strip(), evidence=evidence, routes=route_list, basis=basis)


def _common(name: str, source: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name.strip():
        raise ValueError("name must be a non-empty string")
    if not isinstance(source, str) or not source.strip():
        raise ValueError("source must say where the prediction comes from (e.g. 'derived here, eq. (3)')")
    return dict(chapter=_STATE["chapter"], section=_STATE["section"], name=name, source=source, profile=config.profile())


# --------------------------------------------------------------------------------------------------------
# Derived predictions (asserted)
# --------------------------------------------------------------------------------------------------------
def derived(
    name: str,
    *,
    measured: Any,
    predicted: Any,
    tol: Tolerance,
    foil: Any,
    source: str = "derived here",
    statistic: str = "",
    compares: str = "",
    evidence: str | None = None,
    routes: tuple[str, str] | None = None,
    basis: str | None = None,
) -> None:
    r"""Assert ``max |measured − predicted| ≤ tol`` and that the foil is rejected: ``max |measured − foil| > tol``.

    Parameters
    ----------
    measured, predicted, foil
        Numbers or broadcastable arrays. ``foil`` is a deliberately wrong prediction — the competing theory
        (e.g. ``P⊥ΣP⊥`` instead of the Schur complement) or the prediction with the effect removed.
    tol
        A :class:`Tolerance`; a plain number is refused.
    routes, evidence, basis
        ``routes = (measured route, predicted route)``: which code or derivation each side comes from
        (``("Monte Carlo, 32 seeds", "closed form, eq. (3)")``); ``evidence``: whether the two routes are independent
        (``"evidence"``) or not (``"consistency"``: a unit test shown in the book, not counted as evidence);
        ``basis``: why — for evidence one of :data:`INDEPENDENCE_BASES`, for consistency (optional) one of
        :data:`CONSISTENCY_BASES`. The rule is on the book's conventions page; :func:`lint` flags an evidence check
        without routes and basis. Shown in the ledger's "routes" column.
    compares
        The older form of ``routes``: one string ``"<measured route> vs <predicted route>"``; still accepted.

    Raises
    ------
    CheckFailed
        when the prediction misses (the book build stops).
    CheckError
        when the foil passes too: the check could not have failed, so it is no evidence.
    """
    tol = _require_tolerance(tol)
    cls = _classify(compares, evidence, routes, basis)
    m, p, f = _as_array("measured", measured), _as_array("predicted", predicted), _as_array("foil", foil)
    try:
        err = float(np.max(np.abs(m - p)))
        foil_err = float(np.max(np.abs(m - f)))
        effect = float(np.max(np.abs(p - f)))
    except ValueError as exc:
        raise ValueError(f"measured, predicted and foil must broadcast together: {exc}") from exc
    _settle("derived", name, source, statistic or "max |measured − predicted|", (m, p, f), tol, err, foil_err,
            effect, cls, f"error {err:.3g}; foil error {foil_err:.3g}",
            f"{name}: |measured − predicted| = {err:.4g} > tol = {tol.value:.4g} [{tol.why}]",
            f"{name}: the foil also passes (|measured − foil| = {foil_err:.4g} ≤ tol = {tol.value:.4g}); "
            "this check could not have failed, so it is no evidence")


def _settle(kind: str, name: str, source: str, statistic: str, values: tuple, tol: Tolerance, err: float,
            foil_err: float, effect: float, cls: dict[str, Any], note: str, fail_msg: str, foil_msg: str) -> None:
    """Record a derived or bound check, then raise if the prediction missed or the foil was not rejected."""
    ok, foil_ok = err <= tol.value, foil_err <= tol.value
    m, p, f = values
    parts = []
    for (k, v, why), ref in zip(tol.components, tol._refs()):
        from_pred = isinstance(ref, str) and ref == "prediction"
        if isinstance(ref, np.ndarray):
            try:
                from_pred = bool(np.allclose(np.broadcast_to(ref, np.broadcast_shapes(ref.shape, p.shape)),
                                             np.broadcast_to(p, np.broadcast_shapes(ref.shape, p.shape)),
                                             rtol=1e-12, atol=0.0))
            except ValueError:
                from_pred = False
        parts.append(dict(kind=k, value=float(v), why=why, from_prediction=from_pred))
    identical = bool(m.shape == p.shape and np.array_equal(m, p) and not np.all(np.equal(np.round(m), m)))
    _record(CheckRecord(
        kind=kind,
        status="passed" if ok and not foil_ok else "failed",
        statistic=statistic,
        measured=_fmt(m),
        predicted=_fmt(p),
        foil=_fmt(f),
        tolerance=tol.value,
        tolerance_why=tol.why,
        effect=effect,
        underpowered=tol.value > UNDERPOWERED_RATIO * effect,
        note=note,
        error=float(err),
        foil_error=float(foil_err),
        predicted_scale=float(np.max(np.abs(p))),
        identical=identical,
        tolerance_parts=parts,
        measured_min=float(np.min(m)),
        measured_max=float(np.max(m)),
        **cls,
        **_common(name, source),
    ))
    if not ok:
        raise CheckFailed(fail_msg)
    if foil_ok:
        raise CheckError(foil_msg)


def bound(
    name: str,
    *,
    measured: Any,
    upper: Any,
    tol: Tolerance,
    foil: Any,
    source: str = "derived here",
    statistic: str = "",
    compares: str = "",
    evidence: str | None = None,
    routes: tuple[str, str] | None = None,
    basis: str | None = None,
) -> None:
    r"""Assert the derived bound ``measured ≤ upper + tol`` element-wise, and that the foil bound is violated.

    ``foil`` is a deliberately wrong (too small) bound — e.g. the same formula with the pseudo ``σ_min`` — that
    the measured values must violate somewhere (``measured > foil + tol``), otherwise the check is no evidence.
    ``routes``, ``evidence``, ``basis`` (and the older ``compares``) as in :func:`derived`.
    """
    tol = _require_tolerance(tol)
    cls = _classify(compares, evidence, routes, basis)
    m, u, f = _as_array("measured", measured), _as_array("upper", upper), _as_array("foil", foil)
    try:
        slack = float(np.max(m - u))
        foil_slack = float(np.max(m - f))
    except ValueError as exc:
        raise ValueError(f"measured, upper and foil must broadcast together: {exc}") from exc
    _settle("bound", name, source, statistic or "max (measured − bound)", (m, u, f), tol, slack, foil_slack,
            float(np.max(np.abs(u - f))), cls, f"worst slack {slack:.3g}; foil worst slack {foil_slack:.3g}",
            f"{name}: the bound is violated by {slack:.4g} > tol = {tol.value:.4g} [{tol.why}]",
            f"{name}: the foil bound holds too (worst slack {foil_slack:.4g}); the check is no evidence")


# --------------------------------------------------------------------------------------------------------
# SymPy identities (asserted)
# --------------------------------------------------------------------------------------------------------
def _sympy_residual(lhs: Any, rhs: Any) -> Any:
    import sympy as sp

    lhs, rhs = sp.sympify(lhs), sp.sympify(rhs)
    if isinstance(lhs, sp.MatrixBase) != isinstance(rhs, sp.MatrixBase):
        raise TypeError("lhs and rhs must both be matrices or both be scalars")
    if isinstance(lhs, sp.MatrixBase):
        if lhs.shape != rhs.shape:
            raise ValueError(f"lhs and rhs must have the same shape, got {lhs.shape} and {rhs.shape}")
        return sp.Matrix(lhs - rhs)
    return lhs - rhs


def _is_zero_exact(diff: Any) -> bool:
    import sympy as sp

    if isinstance(diff, sp.MatrixBase):
        return all(sp.simplify(e) == 0 for e in diff)
    return sp.simplify(diff) == 0


def _random_rational(sym: Any, rng: random.Random) -> Any:
    import sympy as sp

    num, den = rng.randint(1, 97), rng.randint(1, 53)
    value = sp.Rational(num, den)
    if sym.is_positive or sym.is_nonnegative:
        return value
    return value if rng.random() < 0.5 else -value


def _is_zero_at_rationals(diff: Any, trials: int, seed: int) -> bool | None:
    """True if ``diff`` is exactly 0 at ``trials`` random rational points; None if it has no symbols to vary."""
    import sympy as sp

    syms = sorted(diff.free_symbols, key=lambda s: s.name)
    if not syms:
        return None
    rng = random.Random(seed)
    done, attempts = 0, 0
    while done < trials:
        attempts += 1
        if attempts > 20 * trials:
            raise CheckError("could not find rational points where the expressions are defined")
        point = {s: _random_rational(s, rng) for s in syms}
        try:
            val = diff.subs(point)
            vals = list(val) if isinstance(val, sp.MatrixBase) else [val]
            vals = [v if v.is_Number else sp.simplify(v) for v in vals]
        except (ZeroDivisionError, ValueError):
            continue
        if any(v.has(sp.zoo, sp.nan, sp.oo) for v in vals):
            continue
        if any(v != 0 for v in vals):
            return False
        done += 1
    return True


def _prove(diff: Any, trials: int, seed: int) -> str | None:
    """The route that proves ``diff ≡ 0``, or None. Random rational points first: they reject a false identity
    quickly; then exact simplification, which, when it succeeds, is the stronger (deterministic) route."""
    at_rationals = _is_zero_at_rationals(diff, trials, seed)
    if at_rationals is False:
        return None
    if _is_zero_exact(diff):
        return "exact simplification"
    if at_rationals:
        return f"exact evaluation at {trials} random rational points"
    return None


def identity(
    name: str,
    lhs: Any,
    rhs: Any,
    *,
    source: str = "derived here",
    trials: int = 8,
    seed: int = 0,
    compares: str = "",
    evidence: str | None = "evidence",
    routes: tuple[str, str] | None = None,
    basis: str | None = None,
) -> None:
    r"""Prove the SymPy identity ``lhs = rhs`` (scalars or matrices) and record which route proved it.

    Route 1, *exact simplification*: ``simplify(lhs − rhs) == 0`` (entry-wise for matrices). Route 2, when
    simplification is inconclusive: exact evaluation of ``lhs − rhs`` at ``trials`` random rational points
    (positive ones for symbols declared positive) — a probabilistic proof for rational functions
    (Schwartz–Zippel), recorded as such. The check then perturbs the right-hand side by a non-vanishing
    rational function and requires the same procedure to *reject* it; if it does not, :class:`CheckError`.

    ``routes``/``evidence``/``basis`` as in :func:`derived`. Without them the identity is recorded as evidence with
    routes ``("SymPy: the left-hand side, built from the definitions", "the closed form derived in the text")`` and
    basis ``"computer algebra vs hand derivation"``; name other routes (or say ``evidence="consistency"``) when the
    right-hand side was itself produced by SymPy from the left-hand side.
    """
    import sympy as sp

    if routes is None and not compares.strip() and evidence == "evidence":
        routes = ("SymPy: the left-hand side, built from the definitions", "the closed form derived in the text")
        basis = basis or "computer algebra vs hand derivation"
    cls = _classify(compares, evidence, routes, basis)
    diff = _sympy_residual(lhs, rhs)
    route = _prove(diff, trials, seed)
    syms = sorted(diff.free_symbols, key=lambda s: s.name)
    bump = sp.Rational(1, 7) * (1 + (syms[0] ** 2 if syms else 0))
    if isinstance(diff, sp.MatrixBase):
        delta = sp.zeros(*diff.shape)
        delta[0, 0] = bump
        perturbed_diff = diff - delta
    else:
        perturbed_diff = diff - bump
    perturbed_route = _prove(perturbed_diff, trials, seed + 1)
    rec = CheckRecord(
        kind="identity",
        status="passed" if route and not perturbed_route else "failed",
        statistic="lhs − rhs ≡ 0",
        measured="0" if route else "nonzero",
        predicted="0",
        foil="rhs + (1 + s²)/7",
        route=route or "not proved",
        note="perturbed right-hand side rejected" if not perturbed_route else "perturbed right-hand side ACCEPTED",
        **cls,
        **_common(name, source),
    )
    _record(rec)
    if not route:
        raise CheckFailed(f"{name}: lhs − rhs is not identically zero")
    if perturbed_route:
        raise CheckError(f"{name}: a perturbed right-hand side was also accepted ({perturbed_route})")


# --------------------------------------------------------------------------------------------------------
# Paper claims (ledgered, never raise)
# --------------------------------------------------------------------------------------------------------
_COMPARATORS = (">", "<")


def claim(
    claim: str,
    *,
    source: str,
    statistic: str,
    value: Any,
    se: Any,
    expect: str,
    threshold: Any,
    z: float = Z_DEFAULT,
    tuned_at_edge: Any = None,
) -> None:
    r"""Record a paper's claim as reproduced, not reproduced or inconclusive — never raise on the outcome.

    The claim is that ``statistic`` (measured ``value`` with standard error ``se``) is ``expect`` (``'>'``
    or ``'<'``) ``threshold``. It is *reproduced* when the whole ``z``·SE interval lies on the claimed side,
    *not reproduced* when it lies on the other side, *inconclusive* otherwise.

    ``tuned_at_edge``: when the statistic compares methods whose hyper-parameters were tuned on a grid, give the
    names of the tuned values that landed on their grid's edge (a string, a list of strings, or a dict
    ``{name: bool}``). A verdict resting on a tuned value at its grid's edge is recorded as *inconclusive*
    whatever the interval says (the optimum may lie outside the grid), and the note names the edge values.
    """
    if expect not in _COMPARATORS:
        raise ValueError(f"expect must be one of {list(_COMPARATORS)}, got {expect!r}")
    if not isinstance(statistic, str) or not statistic.strip():
        raise ValueError("statistic must name what is measured")
    v = float(np.asarray(_as_array("value", value)).reshape(-1)[0]) if np.size(_to_numpy(value)) == 1 else None
    if v is None:
        raise ValueError("value must be a single number (aggregate replicates first; give their SE as se)")
    s = float(np.asarray(_as_array("se", se)).reshape(-1)[0])
    if s < 0:
        raise ValueError(f"se must be >= 0, got {s}")
    t = float(np.asarray(_as_array("threshold", threshold)).reshape(-1)[0])
    lo, hi = v - z * s, v + z * s
    if expect == ">":
        status = "reproduced" if lo > t else ("not reproduced" if hi < t else "inconclusive")
    else:
        status = "reproduced" if hi < t else ("not reproduced" if lo > t else "inconclusive")
    edge = _edge_names(tuned_at_edge)
    note = ""
    if edge:
        note = f"tuned value at its grid's edge ({', '.join(edge)}): inconclusive; interval alone said {status}"
        status = "inconclusive"
    rec = CheckRecord(
        kind="claim",
        status=status,
        statistic=statistic,
        measured=f"{v:.4g} ± {z:g}·{s:.2g}",
        predicted=f"{expect} {t:.4g}",
        tolerance=z * s,
        tolerance_why=f"{z:g}·SE of the statistic",
        note=note,
        estimate=v,
        interval=[lo, hi],
        threshold=t,
        **_common(claim, source),
    )
    _record(rec)


def _edge_names(tuned_at_edge: Any) -> list[str]:
    if tuned_at_edge is None or tuned_at_edge is False:
        return []
    if isinstance(tuned_at_edge, str):
        return [tuned_at_edge] if tuned_at_edge.strip() else []
    if isinstance(tuned_at_edge, dict):
        return [str(k) for k, v in tuned_at_edge.items() if v]
    if isinstance(tuned_at_edge, (list, tuple, set)):
        return [str(x) for x in tuned_at_edge]
    raise TypeError(f"tuned_at_edge must be a name, a list of names or a dict of booleans, got {type(tuned_at_edge).__name__}")


def at_grid_edge(grid: Any, best: Any) -> bool:
    """True when ``best`` is the smallest or largest value of the tuning ``grid`` (fixed before the run)."""
    g = np.asarray(_to_numpy(grid), dtype=float).reshape(-1)
    if g.size < 2:
        raise ValueError(f"grid must hold at least 2 values, got {g.size}")
    b = float(np.asarray(_to_numpy(best), dtype=float).reshape(-1)[0])
    return bool(np.isclose(b, g.min()) or np.isclose(b, g.max()))


class expect_failure:
    """Demonstrate that a check rejects a deliberately wrong prediction.

    Inside the ``with`` block a :class:`CheckFailed` is expected: it is caught, and the record is marked
    ``rejected as intended``. If the block passes, :class:`CheckError` is raised — the check could not fail.

    >>> with checks.expect_failure("the isotropic guess c1·beta"):   # doctest: +SKIP
    ...     checks.derived("Stein, wrong prediction", measured=m, predicted=c1 * beta, tol=tol, foil=c1 * Sigma @ beta)
    """

    def __init__(self, why: str) -> None:
        if not isinstance(why, str) or not why.strip():
            raise ValueError("why must say which wrong prediction is being rejected")
        self.why = why

    def __enter__(self) -> "expect_failure":
        self.start = len(_STATE["records"])
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        new = _STATE["records"][self.start :]
        if exc_type is not None and issubclass(exc_type, CheckFailed):
            for r in new:
                if r.status == "failed":
                    r.status = "rejected as intended"
                    r.note = f"deliberately wrong prediction ({self.why}): {r.note}"
            _flush()
            return True
        if exc_type is None:
            raise CheckError(f"expected the check to reject a wrong prediction ({self.why}), but it passed")
        return False


# --------------------------------------------------------------------------------------------------------
# The evidence lint
# --------------------------------------------------------------------------------------------------------
#: A tolerance component equal to the check's own error, foil error or effect to this relative precision was
#: fitted to the outcome, not computed from the run.
LINT_RTOL = 1e-9
#: Typed ratios, a component equal to ``r · max|predicted|`` with ``r`` one of these is a hand-typed relative
#: tolerance on the prediction (1, 2 and 5 times a power of ten, 1e-12 … 1).
_ROUND_RATIOS = tuple(c * 10.0**k for k in range(-12, 1) for c in (1.0, 2.0, 5.0) if c * 10.0**k <= 1.0)
LINT_RULES = {
    "unclassified": "does not say what it compares (routes=, evidence='evidence'|'consistency')",
    "routes not named": "classed as evidence, but does not name its two routes (routes=) and an independence basis "
                        "(basis=, one of INDEPENDENCE_BASES)",
    "tolerance from prediction": "a tolerance component is computed from the predicted value",
    "foil within tolerance": "the foil lies within the tolerance of the prediction (effect <= tol)",
    "one computation": "classed as evidence, but its two sides come from one computation",
}


@dataclass(frozen=True)
class LintFinding:
    """One reason a derived check is not evidence."""

    chapter: str
    name: str
    rule: str  # a key of LINT_RULES
    detail: str

    def __str__(self) -> str:
        return f"{self.chapter}: {self.name!r}: {self.rule} — {self.detail}"


def _as_dict(r: Any) -> dict[str, Any]:
    if isinstance(r, CheckRecord):
        return asdict(r)
    if isinstance(r, dict):
        return r
    raise TypeError(f"records must be CheckRecord objects or their dicts (ledger JSON), got {type(r).__name__}")


def _close(a: float, b: float) -> bool:
    return a > 0 and b > 0 and abs(a - b) <= LINT_RTOL * max(a, b)


def _is_round(x: float) -> bool:
    """``x = c·10^k`` with an integer ``1 <= c <= 99``: a prediction such as 1, 2, 0.5 or 25, whose round fractions a
    computed tolerance (``1/sqrt(100)``) can equal by coincidence."""
    if not (x > 0 and math.isfinite(x)):
        return True
    k = math.floor(math.log10(x)) - 1
    c = x / 10.0**k
    return abs(c - round(c)) <= 1e-9 * c


def lint(records: Any) -> list[LintFinding]:
    r"""The derived checks among ``records`` that are not evidence, and why.

    ``records``: :class:`CheckRecord` objects or their dicts (the ledger's JSON), or a dict ``{chapter: [...]}``.
    Claims and checks recorded as *rejected as intended* (the demonstrations of :class:`expect_failure`) are
    skipped. Rules, for a ``derived`` or ``bound`` check (a ``identity`` only gets rule a):

    a. **unclassified** — ``evidence`` is neither ``"evidence"`` nor ``"consistency"``, or ``compares`` is empty.
       **routes not named** — classed ``"evidence"`` without ``routes=(measured route, predicted route)`` or without a
       ``basis`` in :data:`INDEPENDENCE_BASES` (an older ``compares=`` string alone does not say why the routes are
       independent). Applies to identities too.
    b. **tolerance from prediction** — a tolerance component (i) was declared or detected as computed from the
       prediction (:meth:`Tolerance.finite_size` with ``from_prediction=True``; :meth:`Tolerance.deviation`
       around the predicted value), or (ii) equals the check's own error ``max|measured − predicted|`` (or worst
       bound slack), its foil error or its effect ``max|predicted − foil|`` to :data:`LINT_RTOL` (a tolerance
       fitted to the outcome), or (iii) is not a floating-point term and equals ``r·max|predicted|`` for a typed
       ratio ``r ∈ {1, 2, 5}·10^k`` (a hand-typed relative tolerance on the prediction) — read only when the
       prediction is not itself a round number (``c·10^k``, ``c`` an integer below 100), where a computed term such
       as ``1/sqrt(100)`` could equal a round fraction of it by coincidence; declare such a tolerance instead.
    c. **foil within tolerance** — ``effect <= tolerance``: within the tolerance the prediction and its foil are
       the same statement, so the check cannot tell the claim from its negation (whatever side the measurement
       fell on in this run).
    d. **one computation** — classed ``"evidence"``, but measured and predicted are bit-for-bit equal non-integer
       arrays (two independent floating-point routes do not agree to the last bit), or ``compares`` names the same
       route on both sides of its ``" vs "``. A ``"consistency"`` check is allowed, and is not counted as evidence.
    """
    if isinstance(records, dict):
        records = [r for recs in records.values() for r in recs]
    found: list[LintFinding] = []
    for rec in records:
        r = _as_dict(rec)
        kind, status = r.get("kind"), r.get("status", "")
        if kind not in ("derived", "bound", "identity") or status == "rejected as intended":
            continue
        add = lambda rule, detail: found.append(LintFinding(r.get("chapter", ""), r.get("name", ""), rule, detail))  # noqa: E731
        evidence, compares = r.get("evidence", ""), (r.get("compares") or "").strip()
        if evidence not in EVIDENCE_KINDS or not compares:
            add("unclassified", f"evidence={evidence!r}, compares={compares!r}")
        routes = [str(x).strip() for x in (r.get("routes") or [])]
        if evidence == "evidence" and (len(routes) != 2 or not all(routes)
                                       or (r.get("basis") or "") not in INDEPENDENCE_BASES):
            add("routes not named", f"routes={routes!r}, basis={r.get('basis', '')!r}")
        if kind == "identity":
            continue
        tol = r.get("tolerance")
        err, foil_err, effect = r.get("error"), r.get("foil_error"), r.get("effect")
        scale = r.get("predicted_scale")
        for part in r.get("tolerance_parts") or []:
            v = float(part.get("value", 0.0))
            label = f"{part.get('kind')} {v:.3g} ({part.get('why', '')})"
            if part.get("from_prediction"):
                add("tolerance from prediction", f"{label} is computed from the predicted value")
                continue
            hit = next((n for n, x in (("its own error", err), ("its foil error", foil_err), ("its effect", effect))
                        if x is not None and _close(v, abs(float(x)))), None)
            if hit:
                add("tolerance from prediction", f"{label} equals {hit}: the tolerance was fitted to the outcome")
            elif (part.get("kind") != "float" and scale and not _is_round(scale)
                  and any(_close(v, q * scale) for q in _ROUND_RATIOS)):
                add("tolerance from prediction", f"{label} is a typed fraction of |predicted| = {scale:.3g}")
        if tol is not None and effect is not None and effect <= tol:
            add("foil within tolerance", f"effect {effect:.3g} <= tolerance {tol:.3g}")
        if evidence == "evidence":
            sides = [x.lower() for x in routes] if len(routes) == 2 else [x.strip().lower() for x in compares.split(" vs ")]
            if r.get("identical"):
                add("one computation", "measured and predicted are bit-for-bit identical non-integer values")
            elif len(sides) == 2 and sides[0] and sides[0] == sides[1]:
                add("one computation", f"the routes name one route on both sides: {compares!r}")
    return found


def evidence_summary(records: Any) -> dict[str, dict[str, int]]:
    """Per chapter: derived checks that count as evidence, consistency checks, unclassified ones, checks the lint
    rejects, and paper claims by status — the counts the ledger page shows."""
    if not isinstance(records, dict):
        grouped: dict[str, list] = {}
        for rec in records:
            d = _as_dict(rec)
            grouped.setdefault(d.get("chapter", ""), []).append(d)
        records = grouped
    out: dict[str, dict[str, int]] = {}
    for chapter, recs in records.items():
        recs = [_as_dict(r) for r in recs]
        rejected = {(f.chapter, f.name) for f in lint(recs)}
        row = {"evidence": 0, "consistency": 0, "unclassified": 0, "not evidence (lint)": 0,
               "reproduced": 0, "not reproduced": 0, "inconclusive": 0}
        for r in recs:
            if r.get("kind") == "claim":
                if r.get("status") in row:
                    row[r["status"]] += 1
                continue
            if r.get("status") == "rejected as intended":
                continue
            if (r.get("chapter", ""), r.get("name", "")) in rejected and r.get("evidence") == "evidence":
                row["not evidence (lint)"] += 1
            elif r.get("evidence") in EVIDENCE_KINDS:
                row[r["evidence"]] += 1
            else:
                row["unclassified"] += 1
        out[chapter] = row
    return out


# --------------------------------------------------------------------------------------------------------
# Prose bound to the ledger: values and verdict-chosen conclusions
# --------------------------------------------------------------------------------------------------------
#: The fields :func:`value` and the book's ``{curvlab-value}`` role render (see :func:`record_field`).
VALUE_FIELDS = ("measured", "predicted", "tolerance", "effect", "status", "statistic", "foil", "profile",
                "verdict", "sign", "estimate", "interval", "routes", "basis", "evidence")
#: The verdicts a conclusion can depend on, and the keyword of :func:`conclude` that gives each one's text.
VERDICT_KEYWORDS = {"reproduced": "reproduced", "not reproduced": "not_reproduced", "inconclusive": "inconclusive",
                    "passed": "passed", "failed": "failed"}


class NotRecorded(ValueError, LookupError):
    """:func:`value` or :func:`conclude` named a check or claim that this chapter has not recorded (yet).

    A ``ValueError`` (the argument ``name`` is wrong) and a ``LookupError`` (nothing recorded under it)."""


def _g(r: Any, key: str) -> Any:
    return r.get(key) if isinstance(r, dict) else getattr(r, key, None)


def _sign_word(lo: float, hi: float, threshold: float) -> str:
    if threshold == 0.0:
        return "positive" if lo > 0 else "negative" if hi < 0 else "undetermined"
    return f"above {threshold:.4g}" if lo > threshold else f"below {threshold:.4g}" if hi < threshold else "undetermined"


def record_field(rec: Any, fld: str) -> str | None:
    r"""The ledger's text for one field of one record (a :class:`CheckRecord` or its JSON dict), or None when the
    record has no such value. The book's ``{curvlab-value}`` role and :func:`value` both render through this.

    Fields (:data:`VALUE_FIELDS`):

    * ``measured``, ``predicted``, ``foil``, ``statistic``, ``status``, ``profile``, ``basis``, ``evidence`` — the
      record's own strings (a claim's ``measured`` is ``"value ± z·SE"``, its ``predicted`` ``"> threshold"``);
    * ``tolerance``, ``effect`` — three significant digits;
    * ``verdict`` — a claim's status (reproduced / not reproduced / inconclusive), followed by
      ``" (a tuned value at its grid's edge: …)"`` when the grid-edge rule made it inconclusive; a derived check's
      status (passed / failed / rejected as intended), followed by ``" (underpowered)"`` when flagged;
    * ``sign`` — for a claim, the side of the threshold on which the *whole* ``z``·SE interval lies: ``"positive"``
      / ``"negative"`` when the threshold is 0, ``"above t"`` / ``"below t"`` otherwise, and ``"undetermined"`` when
      the interval contains the threshold (the grid-edge rule does not change the sign: it is what the interval
      says). For a derived or bound check, the sign of the measured statistic: ``"positive"`` when every measured
      value exceeds the check's tolerance, ``"negative"`` when every one is below minus the tolerance,
      ``"undetermined"`` otherwise and for identities;
    * ``estimate`` — a claim's point estimate (4 significant digits; a derived check's measured value when it is a
      single number); ``interval`` — a claim's ``[low, high]`` interval;
    * ``routes`` — ``"measured route vs predicted route"``.
    """
    if fld not in VALUE_FIELDS:
        raise ValueError(f"field must be one of {VALUE_FIELDS}, got {fld!r}")
    kind, status = _g(rec, "kind"), _g(rec, "status") or ""
    if fld in ("tolerance", "effect"):
        v = _g(rec, fld)
        return None if v is None else f"{float(v):.3g}"
    if fld == "verdict":
        if not status:
            return None
        note = _g(rec, "note") or ""
        if kind == "claim" and note.startswith("tuned value at its grid's edge"):
            names = note.split("(", 1)[1].split(")", 1)[0] if "(" in note else ""
            return f"{status} (a tuned value at its grid's edge: {names})" if names else f"{status} (a tuned value at its grid's edge)"
        return status + (" (underpowered)" if _g(rec, "underpowered") and kind != "claim" else "")
    if fld == "sign":
        if kind == "claim":
            iv, t = _g(rec, "interval"), _g(rec, "threshold")
            if not iv or t is None:
                return None
            return _sign_word(float(iv[0]), float(iv[1]), float(t))
        lo, hi, tol = _g(rec, "measured_min"), _g(rec, "measured_max"), _g(rec, "tolerance")
        if lo is None or hi is None or tol is None:
            return "undetermined" if kind == "identity" else None
        return _sign_word(float(lo) - float(tol), float(hi) + float(tol), 0.0)
    if fld == "estimate":
        v = _g(rec, "estimate")
        if v is None and _g(rec, "measured_min") is not None and _g(rec, "measured_min") == _g(rec, "measured_max"):
            v = _g(rec, "measured_min")
        return None if v is None else f"{float(v):.4g}"
    if fld == "interval":
        iv = _g(rec, "interval")
        return None if not iv else f"[{float(iv[0]):.4g}, {float(iv[1]):.4g}]"
    if fld == "routes":
        routes = _g(rec, "routes") or []
        text = " vs ".join(routes) if routes else (_g(rec, "compares") or "")
        return text or None
    v = _g(rec, fld)
    return None if v is None or v == "" else str(v)


def _lookup(name: str, caller: str) -> CheckRecord:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{caller}: name must be the name of a recorded check or claim, got {name!r}")
    found = [r for r in _STATE["records"] if r.name == name]
    if not found:
        known = sorted({r.name for r in _STATE["records"]})
        close = [k for k in known if name.lower()[:20] in k.lower() or k.lower()[:20] in name.lower()]
        hint = f"; similar names: {close[:3]}" if close else f" ({len(known)} names recorded so far)"
        raise NotRecorded(f"{caller}: no check or claim named {name!r} has been recorded in chapter "
                          f"{_STATE['chapter']!r} (record it before you cite it){hint}")
    return found[-1]


def value(name: str, field: str = "measured") -> str:
    """The ledger's string for one field of the last record named ``name`` in this chapter (:func:`record_field`).

    Use it to print a measured number next to prose (``f"the gap is {checks.value('gap', field='estimate')}"``)
    instead of typing it. Raises :class:`NotRecorded` for an unknown name and ``ValueError`` for an unknown field or
    a field the record has no value for.
    """
    if not isinstance(field, str) or field not in VALUE_FIELDS:
        raise ValueError(f"field must be one of {VALUE_FIELDS}, got {field!r}")
    rec = _lookup(name, "checks.value")
    text = record_field(rec, field)
    if text is None:
        raise ValueError(f"checks.value: the record {name!r} ({rec.kind}) has no {field!r}")
    return text


def conclusion_text(name: str, *, reproduced: str | None = None, not_reproduced: str | None = None,
                    inconclusive: str | None = None, passed: str | None = None, failed: str | None = None) -> str:
    """The text of :func:`conclude` for this build's verdict, without displaying it."""
    texts = dict(reproduced=reproduced, not_reproduced=not_reproduced, inconclusive=inconclusive, passed=passed,
                 failed=failed)
    for k, t in texts.items():
        if t is not None and not isinstance(t, str):
            raise TypeError(f"checks.conclude: {k} must be Markdown text (a string), got {type(t).__name__}")
    if all(t is None for t in texts.values()):
        raise ValueError("checks.conclude: give the text for each verdict the record can have "
                         "(reproduced=, not_reproduced=, inconclusive= for a claim; passed= for a derived check)")
    rec = _lookup(name, "checks.conclude")
    key = VERDICT_KEYWORDS.get(rec.status)
    if key is None:
        raise ValueError(f"checks.conclude: {name!r} is recorded as {rec.status!r} (a demonstration), which "
                         "no conclusion can rest on")
    text = texts[key]
    if text is None or not text.strip():
        raise ValueError(f"checks.conclude: this build's ledger says {name!r} is {rec.status!r}, but no {key}= text "
                         "was given — write the sentence for every verdict the record can have")
    return text


def conclude(name: str, *, reproduced: str | None = None, not_reproduced: str | None = None,
             inconclusive: str | None = None, passed: str | None = None, failed: str | None = None) -> None:
    r"""Display the conclusion that this build's verdict on ``name`` supports.

    ``name`` is a claim or check recorded earlier in this chapter (the last record of that name counts). Give one
    Markdown text per verdict the record can have — ``reproduced``, ``not_reproduced``, ``inconclusive`` for a
    :func:`claim`, ``passed`` (and ``failed``, for a check inside :class:`expect_failure`) for a derived check;
    math is allowed. The text of the recorded verdict is displayed as Markdown in IPython/Jupyter (the book renders
    it like a Markdown cell) and printed elsewhere. A missing record raises :class:`NotRecorded`; a missing text for
    the recorded verdict raises ``ValueError``, so a notebook cannot print a conclusion its ledger does not support.

    >>> checks.conclude("NGD beats K-FAC",                                      # doctest: +SKIP
    ...     reproduced="NGD is faster here, as the paper says.",
    ...     not_reproduced="K-FAC is faster here, against the paper.",
    ...     inconclusive="At this size the runs cannot tell NGD from K-FAC.")
    """
    text = conclusion_text(name, reproduced=reproduced, not_reproduced=not_reproduced, inconclusive=inconclusive,
                           passed=passed, failed=failed)
    shell = None
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:  # pragma: no cover - IPython ships with the notebook extra
        pass
    if shell is not None:
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(text)


# --------------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------------
_ICON = {
    "passed": "✔",
    "reproduced": "✔",
    "failed": "✘",
    "not reproduced": "✘",
    "inconclusive": "?",
    "rejected as intended": "⊘",
}


class CheckTable:
    """A compact, collapsed table of check records (HTML in notebooks and the book, text elsewhere)."""

    def __init__(self, recs: list[CheckRecord], title: str) -> None:
        self.recs, self.title = recs, title

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.recs:
            counts[r.status] = counts.get(r.status, 0) + 1
        parts = ", ".join(f"{n} {s}" for s, n in counts.items())
        under = sum(r.underpowered for r in self.recs)
        return f"{self.title}: {len(self.recs)} checks ({parts})" + (f"; {under} underpowered" if under else "")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("", "check", "kind", "measured", "predicted", "tolerance", "foil", "note"))
        rows = []
        for r in self.recs:
            tol = "" if r.tolerance is None else f"{r.tolerance:.2g}"
            flag = " <em>(underpowered)</em>" if r.underpowered else ""
            note = r.route if r.kind == "identity" else r.note
            label = r.evidence + (f": {r.basis}" if r.basis else "")
            what = (f'<br/><small class="curvlab-compares">{html.escape(r.compares)} ({html.escape(label)})</small>'
                    if r.compares and r.kind != "claim" else "")
            cells = (
                _ICON.get(r.status, ""),
                html.escape(r.name) + flag + what,
                html.escape(r.kind),
                html.escape(r.measured),
                html.escape(r.predicted),
                f'<span title="{html.escape(r.tolerance_why)}">{tol}</span>',
                html.escape(r.foil),
                html.escape(note),
            )
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        return (
            f'<details class="curvlab-checks"><summary>{html.escape(self.summary())}</summary>'
            f'<table class="curvlab-checks-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
            "</table></details>"
        )

    def __repr__(self) -> str:
        lines = [self.summary()]
        for r in self.recs:
            lines.append(f"  {_ICON.get(r.status, '')} [{r.kind}] {r.name}: {r.measured} vs {r.predicted} ({r.status})")
        return "\n".join(lines)


def report(title: str | None = None) -> CheckTable:
    """The checks recorded since the previous :func:`report`, as one compact collapsed table."""
    recs = _STATE["records"][_STATE["reported"] :]
    _STATE["reported"] = len(_STATE["records"])
    return CheckTable(recs, title or _STATE["section"] or "Checks")
