"""Sphinx extension for Curvature Lab: the things a strict, offline, reproducible build needs.

* **Execution cache keyed on the library.** myst-nb's cache keys a notebook on its own code only, so a change to
  ``lib/`` would serve stale outputs. The cache directory is ``_build/.jupyter_cache/<profile>-<key>``, where
  ``key`` hashes the library's source, ``lib/pyproject.toml`` and the profile: any library change re-executes.
* **The environment of executed notebooks.** ``CURVLAB_BOOK_BUILD=1`` (progress bars off, static fallbacks for
  widgets), ``CURVLAB_PROFILE`` and ``CURVLAB_LEDGER_DIR`` (where :mod:`curvlab.checks` writes each chapter's
  records) are set before any kernel starts.
* **Reproduction ledger and execution status.** The ``curvlab-ledger`` and ``curvlab-status`` directives leave a
  placeholder that is filled after every notebook has run (a post-transform at write time), from the chapters'
  check records and myst-nb's execution data.
* **Numbers, verdicts and signs on prose pages.** The ``curvlab-value`` role, ``{curvlab-value}`chapter::check name```,
  writes one field of *this* build's ledger into a page: the check's measured value by default, or
  ``::predicted``, ``::tolerance``, ``::effect``, ``::status``, ``::statistic``, ``::foil``, ``::profile``,
  ``::verdict``, ``::sign``, ``::estimate``, ``::interval``, ``::routes``, ``::basis``, ``::evidence``
  (:func:`curvlab.checks.record_field` defines each), so a prose page never quotes a build-dependent number,
  verdict or sign typed by hand. The ``curvlab-case`` directive picks a sentence by the record's verdict::

      :::{curvlab-case} 21_meanfield_hidden_learning::name of the claim
      :reproduced: Markdown for a reproduced claim.
      :not_reproduced: Markdown for a claim not reproduced.
      :inconclusive: Markdown for an inconclusive one.
      :::

  (``:passed:``/``:failed:`` for a derived check). Each option is one line, parsed as MyST Markdown (math, roles,
  links; MyST reads `` #`` in an option as the start of a comment);
  only the text of the recorded verdict is kept. A case on a claim must give all three claim verdicts (another
  profile may give another one). A reference to a record the build does not have, or a missing text for the
  recorded verdict, is a warning (an error of the strict build).
* **Budget.** In the ``quick`` profile each notebook has a design budget of :data:`QUICK_BUDGET_S` seconds.
  A timing is not a test: run times are *reported* (the execution-status page marks a notebook over budget, and
  the build prints one summary line), never a warning of the strict build, so ``make test`` passes on a loaded
  machine. ``benchmarks/bench_quick_budget.py`` checks the budget on an idle machine.
* **Offline cross-references.** Intersphinx inventories for the third-party types named in ``curvlab``'s
  signatures (torch, numpy, pandas, sympy, matplotlib) are written from a curated list, so the API page
  resolves under nitpicky mode without the network, and links go to the projects' documentation.
* **Notation macros.** ``book/macros.yml`` is the one source of the book's MathJax macros.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import yaml
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from docutils.parsers.rst import directives
from docutils.statemachine import StringList

LOGGER = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
QUICK_BUDGET_S = 30.0
PROFILES = ("quick", "standard", "paper")

# --------------------------------------------------------------------------------------------------------
# Curated inventories: (project, base URL, [(name, role, relative URI)])
# --------------------------------------------------------------------------------------------------------
INVENTORIES: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "python": (
        "https://docs.python.org/3/",
        [
            ("collections.abc.Callable", "py:class", "library/collections.abc.html#collections.abc.Callable"),
            ("collections.abc.Iterable", "py:class", "library/collections.abc.html#collections.abc.Iterable"),
            ("collections.abc.Iterator", "py:class", "library/collections.abc.html#collections.abc.Iterator"),
            ("collections.abc.Mapping", "py:class", "library/collections.abc.html#collections.abc.Mapping"),
            ("collections.abc.Sequence", "py:class", "library/collections.abc.html#collections.abc.Sequence"),
            ("os.PathLike", "py:class", "library/os.html#os.PathLike"),
            ("os.replace", "py:function", "library/os.html#os.replace"),
            ("pathlib.Path", "py:class", "library/pathlib.html#pathlib.Path"),
            ("random.Random", "py:class", "library/random.html#random.Random"),
        ],
    ),
    "joblib": (
        "https://joblib.readthedocs.io/en/stable/",
        [
            ("joblib", "py:module", "index.html"),
            ("joblib.Parallel", "py:class", "generated/joblib.Parallel.html"),
        ],
    ),
    "tqdm": (
        "https://tqdm.github.io/",
        [
            ("tqdm.auto", "py:module", "docs/shortcuts/#tqdmauto"),
            ("tqdm.auto.tqdm", "py:class", "docs/tqdm/"),
        ],
    ),
    "torch": (
        "https://pytorch.org/docs/stable/",
        [
            ("torch.Tensor", "py:class", "tensors.html#torch.Tensor"),
            ("torch._C.Generator", "py:class", "generated/torch.Generator.html"),
            ("torch.func.functional_call", "py:function", "generated/torch.func.functional_call.html"),
            ("torch.func.jvp", "py:function", "generated/torch.func.jvp.html"),
            ("torch.func.vjp", "py:function", "generated/torch.func.vjp.html"),
            ("torch.func.vmap", "py:function", "generated/torch.func.vmap.html"),
            ("torch.func.jacrev", "py:function", "generated/torch.func.jacrev.html"),
            ("torch.func.jacfwd", "py:function", "generated/torch.func.jacfwd.html"),
            ("torch.kron", "py:function", "generated/torch.kron.html"),
            ("torch.linalg.eigh", "py:function", "generated/torch.linalg.eigh.html"),
            ("torch.dtype", "py:class", "tensor_attributes.html#torch.dtype"),
            ("torch.device", "py:class", "tensor_attributes.html#torch.device"),
            ("torch.Generator", "py:class", "generated/torch.Generator.html"),
            ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html"),
            ("torch.nn.modules.module.Module", "py:class", "generated/torch.nn.Module.html"),
            ("torch.optim.Optimizer", "py:class", "optim.html#torch.optim.Optimizer"),
        ],
    ),
    "scipy": (
        "https://docs.scipy.org/doc/scipy/",
        [
            ("scipy.sparse.linalg.eigsh", "py:function", "reference/generated/scipy.sparse.linalg.eigsh.html"),
            ("scipy.sparse.linalg.LinearOperator", "py:class",
             "reference/generated/scipy.sparse.linalg.LinearOperator.html"),
        ],
    ),
    "numpy": (
        "https://numpy.org/doc/stable/",
        [
            ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html"),
            ("numpy.random.Generator", "py:class", "reference/random/generator.html#numpy.random.Generator"),
            ("numpy.dtype", "py:class", "reference/generated/numpy.dtype.html"),
        ],
    ),
    "pandas": (
        "https://pandas.pydata.org/docs/",
        [
            ("pandas.DataFrame", "py:class", "reference/api/pandas.DataFrame.html"),
            ("pandas.Series", "py:class", "reference/api/pandas.Series.html"),
        ],
    ),
    "sympy": (
        "https://docs.sympy.org/latest/",
        [
            ("sympy.core.expr.Expr", "py:class", "modules/core.html#sympy.core.expr.Expr"),
            ("sympy.matrices.dense.MutableDenseMatrix", "py:class", "modules/matrices/dense.html"),
        ],
    ),
    "matplotlib": (
        "https://matplotlib.org/stable/",
        [
            ("matplotlib.axes.Axes", "py:class", "api/_as_gen/matplotlib.axes.Axes.html"),
            ("matplotlib.figure.Figure", "py:class", "api/_as_gen/matplotlib.figure.Figure.html"),
        ],
    ),
}


def write_inventory(path: Path, project: str, entries: list[tuple[str, str, str]]) -> None:
    """Write a Sphinx ``objects.inv`` (format version 2) for ``entries``."""
    header = f"# Sphinx inventory version 2\n# Project: {project}\n# Version: stable\n# The remainder of this file is compressed using zlib.\n"
    body = "".join(f"{name} {role} 1 {uri} -\n" for name, role, uri in entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + zlib.compress(body.encode()))


# --------------------------------------------------------------------------------------------------------
# Cache key and environment
# --------------------------------------------------------------------------------------------------------
def library_key(profile: str) -> str:
    """Hash of everything that can change a notebook's outputs besides its own code."""
    h = hashlib.sha256(profile.encode())
    files = sorted((ROOT / "lib").rglob("*.py")) + [ROOT / "lib" / "pyproject.toml"]
    for f in files:
        if "__pycache__" in f.parts:
            continue
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def ledger_dir(profile: str, key: str) -> Path:
    return ROOT / "_build" / "ledger" / f"{profile}-{key}"


def execution_record_path(profile: str, key: str) -> Path:
    """Where ``tools/build_book.py`` records which notebooks it executed, and how long each took."""
    return ROOT / "_build" / "execution" / f"{profile}-{key}.json"


def build_environment(profile: str) -> dict[str, str]:
    """The environment every notebook of a book build runs in (and where its cache and ledger live)."""
    profile = (profile or "standard").strip().lower()
    if profile not in PROFILES:
        raise ValueError(f"CURVLAB_PROFILE must be one of {PROFILES}, got {profile!r}")
    key = library_key(profile)
    return {
        "CURVLAB_PROFILE": profile,
        "CURVLAB_KEY": key,
        "CURVLAB_BOOK_BUILD": "1",
        "CURVLAB_PROGRESS": "0",
        "CURVLAB_LEDGER_DIR": str(ledger_dir(profile, key)),
        "CURVLAB_EXECUTION_CACHE": str(ROOT / "_build" / ".jupyter_cache" / f"{profile}-{key}"),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


def _config_inited(app: Sphinx, config: Any) -> None:
    env = build_environment(os.environ.get("CURVLAB_PROFILE", "standard"))
    os.environ.update(env)
    config.nb_execution_cache_path = env["CURVLAB_EXECUTION_CACHE"]
    app.curvlab_profile = env["CURVLAB_PROFILE"]  # type: ignore[attr-defined]
    app.curvlab_key = env["CURVLAB_KEY"]  # type: ignore[attr-defined]

    macros = yaml.safe_load((ROOT / "book" / "macros.yml").read_text()) if (ROOT / "book" / "macros.yml").exists() else {}
    mj = dict(config.mathjax3_config or {})
    tex = dict(mj.get("tex", {}))
    tex["macros"] = {**tex.get("macros", {}), **(macros or {})}
    mj["tex"] = tex
    config.mathjax3_config = mj

    _bundle_mathjax(config)

    inv_dir = ROOT / "_build" / "inventories"
    mapping = dict(config.intersphinx_mapping or {})
    for project, (base, entries) in INVENTORIES.items():
        path = inv_dir / f"{project}.inv"
        write_inventory(path, project, entries)
        mapping[project] = (base, str(path))
    config.intersphinx_mapping = mapping


def _bundle_mathjax(config: Any) -> None:
    """Serve MathJax from the book itself (the PyPI package django-static-mathjax ships MathJax 3), so pages
    render their mathematics offline: in a lecture hall, a train, or a headless screenshot."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("mathjax")
    src = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5" / "tex-svg-full.js" if spec else None
    if src is None or not src.exists():
        LOGGER.info("MathJax package not found: pages will load MathJax from its CDN")
        return
    dest = ROOT / "_build" / "static-mathjax" / "mathjax"
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / src.name).exists() or (dest / src.name).stat().st_size != src.stat().st_size:
        shutil.copy2(src, dest / src.name)
    config.html_static_path = [*config.html_static_path, str(dest.parent)]
    config.mathjax_path = f"mathjax/{src.name}"


# --------------------------------------------------------------------------------------------------------
# Ledger and status directives
# --------------------------------------------------------------------------------------------------------
class LedgerNode(nodes.General, nodes.Element):
    """Placeholder for the reproduction ledger."""


class StatusNode(nodes.General, nodes.Element):
    """Placeholder for the execution-status table."""


class _Placeholder(SphinxDirective):
    node_class: type = nodes.Element
    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.curvlab_generated = getattr(self.env, "curvlab_generated", set()) | {self.env.docname}
        return [self.node_class()]


class ValueNode(nodes.Inline, nodes.TextElement):
    """Placeholder for one number of the ledger, filled after execution (``curvlab-value`` role)."""


#: The same tuple as :data:`curvlab.checks.VALUE_FIELDS` (a test keeps them equal; the role parses without the library).
VALUE_FIELDS = ("measured", "predicted", "tolerance", "effect", "status", "statistic", "foil", "profile",
                "verdict", "sign", "estimate", "interval", "routes", "basis", "evidence")


def parse_value_ref(text: str) -> tuple[str, str, str]:
    """``"chapter::check name[::field]"`` -> ``(chapter, name, field)``; the field defaults to ``measured``."""
    parts = [x.strip() for x in text.split("::")]
    if len(parts) == 2:
        parts.append("measured")
    if len(parts) != 3 or not all(parts) or parts[2] not in VALUE_FIELDS:
        raise ValueError(f"curvlab-value expects 'chapter::check name[::field]' with field in {VALUE_FIELDS}, got {text!r}")
    return parts[0], parts[1], parts[2]


def find_record(records: dict[str, list[dict[str, Any]]], chapter: str, name: str) -> dict[str, Any] | None:
    """The last record named ``name`` in ``chapter`` (a chapter may re-run a check), or None."""
    found = [r for r in records.get(chapter, []) if r.get("name") == name]
    return found[-1] if found else None


def ledger_value(records: dict[str, list[dict[str, Any]]], ref: str) -> str | None:
    """The text the ``curvlab-value`` role shows for ``ref``, or None when the build recorded no such check.

    Rendered by :func:`curvlab.checks.record_field` (the same function as ``checks.value`` in a notebook): the
    ledger's own strings (``measured``, ``predicted``: as the check recorded them), three significant digits
    (``tolerance``, ``effect``), the verdict and the sign as defined there. The last record of that name wins.
    """
    from curvlab.checks import record_field

    chapter, name, fld = parse_value_ref(ref)
    rec = find_record(records, chapter, name)
    return None if rec is None else record_field(rec, fld)


CASE_VERDICTS = {"reproduced": "reproduced", "not_reproduced": "not reproduced", "inconclusive": "inconclusive",
                 "passed": "passed", "failed": "failed"}
CLAIM_VERDICTS = ("reproduced", "not reproduced", "inconclusive")


def parse_case_ref(text: str) -> tuple[str, str]:
    """``"chapter::check name"`` -> ``(chapter, name)`` for the ``curvlab-case`` directive."""
    parts = [x.strip() for x in text.split("::")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"curvlab-case expects 'chapter::check or claim name', got {text!r}")
    return parts[0], parts[1]


def choose_case(records: dict[str, list[dict[str, Any]]], ref: str, given: set[str]) -> tuple[str | None, list[str]]:
    """Which verdict's text a ``curvlab-case`` keeps, and the problems to warn about.

    ``given``: the verdicts (ledger spelling: ``"not reproduced"``) the directive has a text for. Returns the
    verdict to keep (None when there is none to keep) and a list of warning messages.
    """
    chapter, name = parse_case_ref(ref)
    rec = find_record(records, chapter, name)
    if rec is None:
        return None, [f"curvlab-case: this build's ledger has no record {ref!r}"]
    problems = []
    if rec.get("kind") == "claim":
        missing = [v for v in CLAIM_VERDICTS if v not in given]
        if missing:
            problems.append(f"curvlab-case {ref!r}: a claim can be {', '.join(CLAIM_VERDICTS)}; no text for "
                            f"{', '.join(missing)} (another profile may give it)")
    status = rec.get("status", "")
    if status not in given:
        problems.append(f"curvlab-case {ref!r}: this build's ledger says {status!r}, and the directive has no text "
                        "for it")
        return None, problems
    return status, problems


class CaseNode(nodes.General, nodes.Element):
    """Placeholder for the ``curvlab-case`` directive: one child container per verdict, one kept after execution."""


class CaseDirective(SphinxDirective):
    """``{curvlab-case} chapter::name`` with one option per verdict (see the module docstring)."""

    required_arguments = 1
    final_argument_whitespace = True
    has_content = False
    option_spec = {k: directives.unchanged_required for k in CASE_VERDICTS}

    def run(self) -> list[nodes.Node]:
        ref = self.arguments[0]
        try:
            parse_case_ref(ref)
        except ValueError as exc:
            raise self.error(str(exc)) from exc
        if not self.options:
            raise self.error(f"curvlab-case {ref!r}: give a text for each verdict (:reproduced:, :not_reproduced:, "
                             ":inconclusive: for a claim; :passed: for a derived check)")
        self.env.curvlab_generated = getattr(self.env, "curvlab_generated", set()) | {self.env.docname}
        node = CaseNode()
        node["ref"] = ref
        self.set_source_info(node)
        for key, text in self.options.items():
            branch = nodes.container(classes=["curvlab-case"])
            branch["verdict"] = CASE_VERDICTS[key]
            self.state.nested_parse(StringList(text.splitlines(), source=self.get_source_info()[0]),
                                    self.content_offset, branch)
            node += branch
        return [node]


def value_role(name: str, rawtext: str, text: str, lineno: int, inliner: Any, options: Any = None, content: Any = None):
    try:
        parse_value_ref(text)
    except ValueError as exc:
        msg = inliner.reporter.error(str(exc), line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    env = inliner.document.settings.env
    env.curvlab_generated = getattr(env, "curvlab_generated", set()) | {env.docname}
    node = ValueNode(rawtext, text)
    node["ref"] = text
    return [node], []


class LedgerDirective(_Placeholder):
    node_class = LedgerNode


class StatusDirective(_Placeholder):
    node_class = StatusNode


def _load_records(app: Sphinx) -> dict[str, list[dict[str, Any]]]:
    d = ledger_dir(app.curvlab_profile, app.curvlab_key)  # type: ignore[attr-defined]
    out: dict[str, list[dict[str, Any]]] = {}
    if d.is_dir():
        for f in sorted(d.glob("*.json")):
            out[f.stem] = json.loads(f.read_text())
    return out


def _table(header: list[str], rows: list[list[str]], classes: list[str]) -> nodes.table:
    table = nodes.table(classes=["colwidths-auto", *classes])
    tgroup = nodes.tgroup(cols=len(header))
    table += tgroup
    for _ in header:
        tgroup += nodes.colspec(colwidth=1)
    thead, tbody = nodes.thead(), nodes.tbody()
    tgroup += thead
    tgroup += tbody
    row = nodes.row()
    for h in header:
        row += nodes.entry("", nodes.paragraph(text=h))
    thead += row
    for r in rows:
        row = nodes.row()
        for c in r:
            row += nodes.entry("", nodes.paragraph(text=c))
        tbody += row
    return table


_ICONS = {"passed": "✔", "reproduced": "✔", "failed": "✘", "not reproduced": "✘", "inconclusive": "?",
          "rejected as intended": "⊘"}


def _lint_index(records: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str], list[str]]:
    """``{(chapter, check name): [lint rules it breaks]}`` (:func:`curvlab.checks.lint`)."""
    from curvlab.checks import lint

    out: dict[tuple[str, str], list[str]] = {}
    for chapter, recs in records.items():
        for f in lint([{**r, "chapter": chapter} for r in recs]):
            out.setdefault((chapter, f.name), []).append(f.rule)
    return out


def evidence_class(r: dict[str, Any], lint_rules: list[str] | None = None) -> str:
    """How the ledger counts a derived check: evidence, consistency, unclassified, or not evidence (lint rules)."""
    if r.get("kind") == "claim":
        return ""
    if r.get("status") == "rejected as intended":
        return "demonstration (a wrong prediction, not counted)"
    ev = r.get("evidence", "")
    broken = [x for x in (lint_rules or []) if x != "unclassified"]
    if ev not in ("evidence", "consistency"):
        return "unclassified"
    if ev == "evidence" and broken:
        return "not evidence: " + ", ".join(broken)
    return ev


def ledger_rows(records: dict[str, list[dict[str, Any]]], kinds: tuple[str, ...]) -> list[dict[str, str]]:
    """One dict per check of the given kinds: the cells of the ledger table, as plain text."""
    rows = []
    linted = _lint_index(records) if any(k != "claim" for k in kinds) else {}
    for chapter, recs in records.items():
        for r in recs:
            if r["kind"] not in kinds:
                continue
            tol, why = ("", "") if r.get("tolerance") is None else (f"{r['tolerance']:.3g}", r.get("tolerance_why", ""))
            if r["kind"] == "identity":
                tol, why = "exact" if r.get("route", "").startswith("exact simpl") else "probabilistic", r.get("route", "")
            effect = "" if r.get("effect") is None else f"effect {r['effect']:.3g}"
            status = r["status"] + (" (underpowered)" if r.get("underpowered") else "")
            where = " · ".join(x for x in (chapter, r.get("section", ""), r["kind"], r["source"]) if x)
            rows.append({"status": status, "icon": _ICONS.get(r["status"], ""), "check": r["name"], "where": where,
                         "statistic": r.get("statistic", ""), "measured": r.get("measured", ""),
                         "prediction": r.get("predicted", ""), "tolerance": tol, "why": why,
                         "foil": r.get("foil", ""), "effect": effect, "note": r.get("note", ""),
                         "compares": " vs ".join(r["routes"]) if r.get("routes") else r.get("compares", ""),
                         "basis": r.get("basis", ""),
                         "evidence": evidence_class(r, linted.get((chapter, r["name"])))})
    return rows


def evidence_summary_rows(records: dict[str, list[dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    """Per chapter: derived checks by evidence class, paper claims by status (header, rows)."""
    from curvlab.checks import evidence_summary

    summary = evidence_summary({c: [{**r, "chapter": c} for r in recs] for c, recs in records.items()})
    keys = ["evidence", "consistency", "not evidence (lint)", "unclassified", "reproduced", "not reproduced",
            "inconclusive"]
    header = ["chapter", "derived: evidence", "consistency", "not evidence (lint)", "unclassified",
              "claims: reproduced", "not reproduced", "inconclusive"]
    rows = [[chapter] + [str(summary[chapter][k]) for k in keys] for chapter in sorted(summary)]
    if rows:
        rows.append(["all chapters"] + [str(sum(summary[c][k] for c in summary)) for k in keys])
    return header, rows


def ledger_html(rows: list[dict[str, str]]) -> str:
    """A compact HTML table: main values in the cells, explanations in small text beneath them."""
    from html import escape

    def e(text: str) -> str:
        return escape(text, quote=False)

    if not rows:
        return "<p><em>No checks of this kind in this build.</em></p>"
    derived = any(r.get("evidence") for r in rows)
    cols = ("status", "check", "statistic", "measured", "prediction", "tolerance", "foil") + (("routes",) if derived else ())
    head = "".join(f"<th>{h}</th>" for h in cols)
    body = []
    for r in rows:
        small = lambda t: f'<br/><span class="curvlab-small">{e(t)}</span>' if t else ""  # noqa: E731
        body.append(
            "<tr>"
            f'<td class="curvlab-status-{e(r["status"].split(" (")[0].replace(" ", "-"))}">{r["icon"]} {e(r["status"])}</td>'
            f"<td><strong>{e(r['check'])}</strong>{small(r['where'])}</td>"
            f"<td>{e(r['statistic'])}</td><td>{e(r['measured'])}</td><td>{e(r['prediction'])}</td>"
            f"<td>{e(r['tolerance'])}{small(r['why'])}</td><td>{e(r['foil'])}{small(r['effect'])}</td>"
            + (f'<td>{e(r.get("compares", ""))}<br/><span class="curvlab-evidence curvlab-evidence-'
               f'{e(r.get("evidence", "").split(":")[0].replace(" ", "-"))}">{e(r.get("evidence", ""))}</span>'
               + (f' <span class="curvlab-small">({e(r["basis"])})</span>' if r.get("basis") else "") + "</td>"
               if derived else "")
            + "</tr>"
        )
    return f'<table class="curvlab-ledger-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


class CurvlabPostTransform(SphinxPostTransform):
    default_priority = 8

    def run(self, **kwargs: Any) -> None:
        app = self.app
        records = _load_records(app)
        for node in list(self.document.findall(LedgerNode)):
            container = nodes.container(classes=["curvlab-ledger", "full-width"])
            profile = app.curvlab_profile  # type: ignore[attr-defined]
            n_claims = sum(r["kind"] == "claim" for recs in records.values() for r in recs)
            n_derived = sum(r["kind"] != "claim" for recs in records.values() for r in recs)
            container += nodes.paragraph(
                text=f"Profile of this build: {profile}. {n_derived} derived checks (asserted; the build fails if one "
                f"misses) and {n_claims} paper claims (ledgered, never failing the build)."
            )
            container += nodes.rubric(text="Per chapter")
            header, rows = evidence_summary_rows(records)
            container += _table(header, rows, ["curvlab-evidence-summary"])
            container += nodes.rubric(text="Paper claims")
            container += nodes.raw("", ledger_html(ledger_rows(records, ("claim",))), format="html")
            container += nodes.rubric(text="Derived predictions")
            container += nodes.raw("", ledger_html(ledger_rows(records, ("derived", "bound", "identity"))), format="html")
            node.replace_self(container)
        for node in list(self.document.findall(StatusNode)):
            node.replace_self(self._status(records))
        for node in list(self.document.findall(ValueNode)):
            value = ledger_value(records, node["ref"])
            if value is None:
                LOGGER.warning(f"curvlab-value: this build's ledger has no value for {node['ref']!r}",
                               location=node, type="curvlab", subtype="value")
                value = f"[no ledger value: {node['ref']}]"
            chapter, check, fld = parse_value_ref(node["ref"])
            span = nodes.inline(value, value, classes=["curvlab-value"])
            span["title"] = f"{fld} of '{check}' ({chapter}), from this build's ledger"
            node.replace_self(span)
        for node in list(self.document.findall(CaseNode)):
            branches = {b["verdict"]: b for b in node.children if isinstance(b, nodes.container)}
            keep, problems = choose_case(records, node["ref"], set(branches))
            for msg in problems:
                LOGGER.warning(msg, location=node, type="curvlab", subtype="case")
            if keep is None:
                text = f"[no ledger verdict for: {node['ref']}]"
                node.replace_self(nodes.paragraph(text, text, classes=["curvlab-case-missing"]))
            else:
                chosen = branches[keep]
                chosen["classes"].append(f"curvlab-case-{keep.replace(' ', '-')}")
                node.replace_self(chosen)

    def _status(self, records: dict[str, list[dict[str, Any]]]) -> nodes.Node:
        from myst_nb.sphinx_ import NbMetadataCollector

        data = NbMetadataCollector.get_doc_data(self.env)
        profile, key = self.app.curvlab_profile, self.app.curvlab_key  # type: ignore[attr-defined]
        path = execution_record_path(profile, key)
        executed = json.loads(path.read_text()) if path.exists() else {}
        rows = []
        for docname in sorted(data):
            ex = data[docname].get("exec_data")
            if not ex:
                continue
            rec = executed.get(docname, {})
            runtime = rec.get("runtime", ex.get("runtime"))
            how = "executed in this build" if rec.get("executed") else "from the execution cache"
            recs = records.get(Path(docname).name, [])
            over = profile == "quick" and runtime is not None and runtime > QUICK_BUDGET_S
            rows.append([
                docname,
                how,
                "-" if runtime is None else f"{runtime:.1f}" + (" (over budget)" if over else ""),
                str(sum(r["kind"] != "claim" for r in recs)),
                str(sum(r["kind"] == "claim" for r in recs)),
                "ok" if ex.get("succeeded") else "FAILED",
            ])
        header = ["notebook", "outputs", "run time (s)", "derived checks", "claims", "status"]
        container = nodes.container(classes=["curvlab-status"])
        budget = f" Budget per notebook in this profile: {QUICK_BUDGET_S:g} s." if profile == "quick" else ""
        container += nodes.paragraph(
            text=f"Profile of this build: {profile}; execution-cache key {key} (library source + profile).{budget}"
        )
        container += _table(header, rows, ["curvlab-status-table"])
        return container


def _env_updated(app: Sphinx, env: Any) -> list[str]:
    return sorted(getattr(env, "curvlab_generated", set()))


def _merge(app: Sphinx, env: Any, docnames: Any, other: Any) -> None:
    env.curvlab_generated = getattr(env, "curvlab_generated", set()) | getattr(other, "curvlab_generated", set())


def _purge(app: Sphinx, env: Any, docname: str) -> None:
    if hasattr(env, "curvlab_generated"):
        env.curvlab_generated.discard(docname)


def _build_finished(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None:
        return
    profile, key = app.curvlab_profile, app.curvlab_key  # type: ignore[attr-defined]
    path = execution_record_path(profile, key)
    executed = json.loads(path.read_text()) if path.exists() else {}
    runs = {d: r.get("runtime") for d, r in executed.items() if r.get("executed") and r.get("runtime") is not None}
    if runs:
        over = sorted(d for d, t in runs.items() if profile == "quick" and t > QUICK_BUDGET_S)
        slowest = max(runs, key=runs.get)
        # Information, not a warning: run time depends on the machine's load (see the module docstring).
        LOGGER.info(
            f"curvlab: executed {len(runs)} notebook(s) in the {profile} profile, {sum(runs.values()):.0f} s in all; "
            f"slowest {slowest} ({runs[slowest]:.1f} s)"
            + (f"; over the {QUICK_BUDGET_S:g} s design budget (reported, not an error): {', '.join(over)}" if over else "")
        )
    for chapter, recs in _load_records(app).items():
        for r in recs:
            if r["status"] == "failed":
                LOGGER.warning(f"{chapter}: derived check failed: {r['name']} ({r.get('note', '')})", type="curvlab", subtype="check")


def _proof_docname(env: Any, node: Any, parent_tag: str = "section") -> str | None:
    """The document a sphinx-proof block belongs to, for its LaTeX ``\\label``.

    sphinx-proof's own ``find_parent`` matches a section's ``names`` against the document's title text, which fails
    for titles with markup or math (chapters 11, 12, 22): the label became ``None:<label>`` and every
    ``{prf:ref}`` to it printed ``??`` in the PDF. In the LaTeX builder each included document sits in a
    ``start_of_file`` node that carries its ``docname``; the nearest one is the document.
    """
    from sphinx import addnodes

    current = node
    while current is not None:
        if isinstance(current, addnodes.start_of_file):
            return current["docname"]
        source = getattr(current, "source", None)
        if source:
            docname = env.path2doc(source.split(":", 1)[0] if not Path(source).exists() else source)
            if docname:
                return docname
        current = current.parent
    return _proof_find_parent_orig(env, node, parent_tag) or env.config.root_doc


def _patch_sphinx_proof() -> None:
    global _proof_find_parent_orig
    try:
        import sphinx_proof.nodes as proof_nodes
    except ImportError:  # pragma: no cover - the book always has sphinx-proof
        return
    if proof_nodes.find_parent is not _proof_docname:
        _proof_find_parent_orig = proof_nodes.find_parent
        proof_nodes.find_parent = _proof_docname


_proof_find_parent_orig: Any = None

#: What a value that holds code prints as (``object_description`` drops the addresses): ``<function f>``,
#: ``<bound method …>``, ``<… object>``. Such a value tells a reader nothing and printed in the handout as a repr.
CODE_REPR = re.compile(r"<(?:function|bound method|built-in function|lambda)[^<>]*>|<[^<>]* object>")


def _registry_documenter() -> type:
    """autodoc's ``data`` documenter, except for a value that holds code (a registry of update rules, links or paper
    grids: ``{'sgd': <function sgd_step>, …}``): its value line is left out and, for a mapping, its keys are listed
    under the docstring, so the page says what the registry holds instead of printing function reprs."""
    from sphinx.ext.autodoc import DataDocumenter
    from sphinx.util.inspect import object_description

    class RegistryDataDocumenter(DataDocumenter):
        def _holds_code(self) -> bool:
            try:
                return bool(CODE_REPR.search(object_description(self.object)))
            except ValueError:
                return False

        def should_suppress_value_header(self) -> bool:
            return super().should_suppress_value_header() or self._holds_code()

        def add_content(self, more_content: Any) -> None:
            super().add_content(more_content)
            if self._holds_code() and isinstance(self.object, dict) and self.object:
                source = self.get_sourcename()
                keys = ", ".join(f"``{k!r}``" if not isinstance(k, str) else f"``{k}``" for k in self.object)
                self.add_line("", source)
                self.add_line(f"Keys when the module is loaded ({len(self.object)}): {keys}.", source)

    return RegistryDataDocumenter


def setup(app: Sphinx) -> dict[str, Any]:
    _patch_sphinx_proof()  # prf labels in the PDF name their document (see _proof_docname)
    app.setup_extension("curvlab_launch")  # Colab launch buttons open the clean copies (notebooks/colab/)
    app.connect("config-inited", _config_inited, priority=100)
    app.setup_extension("sphinx.ext.autodoc")
    app.add_autodocumenter(_registry_documenter(), override=True)  # no function reprs as values (the API page)
    app.add_node(LedgerNode)
    app.add_node(StatusNode)
    app.add_node(ValueNode)
    app.add_node(CaseNode)
    app.add_role("curvlab-value", value_role)
    app.add_directive("curvlab-case", CaseDirective)
    app.add_directive("curvlab-ledger", LedgerDirective)
    app.add_directive("curvlab-status", StatusDirective)
    app.add_post_transform(CurvlabPostTransform)
    app.connect("env-updated", _env_updated)
    app.connect("env-merge-info", _merge)
    app.connect("env-purge-doc", _purge)
    app.connect("build-finished", _build_finished)
    return {"version": "0.1", "parallel_read_safe": True, "parallel_write_safe": True}
