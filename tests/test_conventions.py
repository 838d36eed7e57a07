"""The book's mechanical conventions (book/conventions.md), checked on every notebook and page."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PAGES = sorted((ROOT / "book").glob("*.md"))
sys.path.insert(0, str(ROOT / "tools"))
import nbtool  # noqa: E402


def cells(path: Path, kind: str | None = None) -> list[dict]:
    nb = json.loads(path.read_text())
    return [c for c in nb["cells"] if kind is None or c["cell_type"] == kind]


def source(cell: dict) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def documents() -> list[tuple[str, str]]:
    """(name, MyST text) for every page and every notebook's markdown; ``double-backtick`` examples removed."""
    docs = [(p.name, p.read_text()) for p in PAGES]
    docs += [(p.name, "\n\n".join(source(c) for c in cells(p, "markdown"))) for p in NOTEBOOKS]
    return [(name, re.sub(r"(?<!`)``(?!`).+?(?<!`)``(?!`)", "", text)) for name, text in docs]


def python_source(cell: dict) -> str:
    """A code cell's source with IPython magics and shell escapes removed, so that it parses."""
    lines = [ln for ln in source(cell).splitlines() if not ln.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no chapters found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_without_outputs_in_normal_form(path):
    nb = json.loads(path.read_text())
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None, f"{path.name} is stored with outputs"
    assert path.read_text() == nbtool.dumps(nbtool.normalize(nb)), f"run `python tools/nbtool.py normalize {path}`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell(path):
    code = cells(path, "code")
    first = code[0]
    tags = first["metadata"].get("tags", [])
    assert "setup" in tags and "hide-input" in tags, "the first code cell is the setup cell (tags setup, hide-input)"
    src = source(first)
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config["repository"]["url"]
    assert f'REPO = "{repo}"' in src, "the Colab install must use the repository URL of _config.yml"
    assert "git+{REPO}@{REF}#subdirectory=lib" in src and re.search(r'^REF = "[^"]+"', src, re.M), \
        "the Colab install pins a ref that exists (tools/colab.py)"
    assert 'find_spec("google") is not None and' in src and "COLAB_RELEASE_TAG" in src, "Colab detected safely"
    assert 'find_spec("curvlab") is None' in src
    assert "torch==" in src and "numpy==" in src, "Colab's torch and numpy must be pinned, never reinstalled"
    assert f'curvlab.setup("{path.stem}")' in src, "setup() is called with the notebook's file stem"


def _check_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield owner, name, node


_INDEX_KEYWORDS = {"ddof", "axis", "dim", "ord"}  # integers that select, not tolerate


def _numbers(node: ast.AST, *, ints: bool) -> list:
    """Numeric literals under ``node`` (floats always, ints when ``ints``), ignoring subscripts and index keywords."""
    skip: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript):
            skip |= {id(x) for x in ast.walk(n.slice)}
        if isinstance(n, ast.Call):
            for kw in n.keywords:
                if kw.arg in _INDEX_KEYWORDS:
                    skip |= {id(x) for x in ast.walk(kw.value)}
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and id(n) not in skip
            and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
            and (ints or isinstance(n.value, float))]


def literal_tolerances(code: str) -> list[str]:
    """Typed numbers where a tolerance must be computed.

    * ``Tolerance.replicates/standard_error/finite_size``: no numeric literal in what they are given (``z`` too);
    * ``Tolerance.float_error``: integer operation counts are allowed, floats are not;
    * ``tol=`` / ``se=`` of a check: no float literal, and not a bare number.
    """
    found = []
    for owner, name, call in _check_calls(ast.parse(code)):
        if owner == "Tolerance":
            lits = _numbers(call, ints=name != "float_error")
            if lits:
                found.append(f"Tolerance.{name}(...) contains numeric literal(s) {lits}")
        if name in ("derived", "bound", "claim"):
            for kw in call.keywords:
                if kw.arg in ("tol", "se"):
                    bare = isinstance(kw.value, ast.Constant) or (
                        isinstance(kw.value, ast.UnaryOp) and isinstance(kw.value.operand, ast.Constant))
                    if bare or _numbers(kw.value, ints=False):
                        found.append(f"{name}({kw.arg}=...) is or contains a typed number")
    return found


def test_literal_tolerance_detector_catches_typed_tolerances():
    assert literal_tolerances("checks.derived('x', measured=a, predicted=b, tol=Tolerance.finite_size(0.01, why='w'), foil=c)")
    assert literal_tolerances("checks.claim('c', source='s', statistic='t', value=v, se=0.1, expect='>', threshold=0)")
    assert literal_tolerances("tol = Tolerance.replicates(m, z=2)")
    assert literal_tolerances("tol = Tolerance.finite_size(x / 100, why='w')")
    assert literal_tolerances("checks.claim('c', source='s', statistic='t', value=v, se=1, expect='>', threshold=0)")
    assert not literal_tolerances("tol = Tolerance.float_error(x, ops=2 * n, cond=c[-1])")
    assert not literal_tolerances("tol = Tolerance.finite_size(abs(s[-2] - s[-1]), why='Richardson')")
    assert not literal_tolerances("checks.derived('x', measured=a, predicted=b, tol=Tolerance.replicates(m), foil=c)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_typed_tolerances_in_checks(path):
    problems = []
    for c in cells(path, "code"):
        problems += literal_tolerances(python_source(c))
    assert not problems, problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_raw_plt_show_and_registered_methods(path):
    from curvlab.plotting import METHODS

    for c in cells(path, "code"):
        tree = ast.parse(python_source(c))
        for owner, name, call in _check_calls(tree):
            assert not (owner == "plt" and name == "show"), "use curvlab.plotting.show(fig, alt=..., caption=...)"
            if owner == "plotting" and name in ("plot", "band") and len(call.args) >= 4:
                m = call.args[3]
                if isinstance(m, ast.Constant):
                    assert m.value in METHODS, f"method {m.value!r} is not registered"


_PROOF_TYPES = "theorem|lemma|proposition|corollary|conjecture|claim|property|observation"
_BLOCK = re.compile(r"(`{3,}|:{3,})\{prf:(" + _PROOF_TYPES + r")\}[^\n]*\n(.*?)\n\1", re.S)


def test_theorem_blocks_carry_a_status():
    seen = 0
    for name, text in documents():
        for m in _BLOCK.finditer(text):
            seen += 1
            body = m.group(3)
            classes = re.findall(r":class:\s*([^\n]+)", body)
            status = [c for c in " ".join(classes).split() if c.startswith("status-")]
            assert len(status) == 1, f"{name}: a prf:{m.group(2)} block needs exactly one status class, got {status}"
            assert status[0] in ("status-proved", "status-checked", "status-stated"), status
            assert re.search(r":label:\s*\S+", body), f"{name}: a prf:{m.group(2)} block needs a label"
            rest = text[m.end():]
            if status[0] == "status-proved":
                nxt = re.search(r"\{prf:(\w+)\}", rest)
                assert nxt and nxt.group(1) == "proof", f"{name}: a 'proved here' block must be followed by its prf:proof"
            if status[0] == "status-stated":
                assert "cite" in body, f"{name}: a 'stated from a paper' block must cite the paper"
            if status[0] == "status-checked":
                assert "check" in body.lower(), f"{name}: a 'checked here' block must name its check"
    assert seen > 0


def test_one_bibliography_directive_and_footcites_elsewhere():
    holders = [name for name, text in documents() if re.search(r"\{bibliography\}", text)]
    assert holders == ["bibliography.md"], f"only book/bibliography.md may hold a bibliography directive: {holders}"
    for name, text in documents():
        if "{footcite" in text:
            assert "{footbibliography}" in text, f"{name} uses footcite but has no footbibliography"
        assert not re.search(r"\{cite(:[pt])?\}", text), f"{name}: cite with footcite, not cite (see conventions)"


def test_cited_keys_exist():
    import pybtex.database

    keys = set(pybtex.database.parse_file(str(ROOT / "book" / "references.bib")).entries)
    for name, text in documents():
        for group in re.findall(r"\{footcite(?::[pt])?\}`([^`]+)`", text):
            for key in group.split(","):
                assert key.strip() in keys, f"{name} cites unknown key {key.strip()!r}"


def test_gated_exercises_are_balanced():
    for name, text in documents():
        for kind in ("exercise", "solution"):
            assert text.count("{" + kind + "-start}") == text.count("{" + kind + "-end}"), f"{name}: {kind} start/end"


def test_every_notebook_is_in_the_toc_and_every_toc_file_exists():
    toc = (ROOT / "_toc.yml").read_text()
    files = re.findall(r"(?:file|root):\s*(\S+)", toc)
    for f in files:
        assert (ROOT / f"{f}.md").exists() or (ROOT / f"{f}.ipynb").exists(), f"_toc.yml names a missing file {f}"
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.stem}" in files, f"{nb.name} is not in _toc.yml"


def test_macros_are_all_on_the_notation_page():
    macros = yaml.safe_load((ROOT / "book" / "macros.yml").read_text())
    notation = (ROOT / "book" / "notation.md").read_text()
    missing = [m for m in macros if f"\\{m}" not in notation]
    assert not missing, f"macros not documented on the notation page: {missing}"


def _requirements_from_pyproject() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "lib" / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    setup_env = (ROOT / "tools" / "setup_env.py").read_text()  # the extras `make` installs
    extras = ast.literal_eval(re.search(r"^EXTRAS = (\(.*?\))$", setup_env, re.M).group(1))
    assert {"book", "lab", "test", "cluster"} <= set(extras)
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return {r.replace(" ", "") for r in reqs}


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {r.replace(" ", "") for r in pip if not r.startswith("-e")}
    assert listed == _requirements_from_pyproject()
    assert "-e ./lib" in pip
    assert any(r.startswith("jupyter-book") and "<2" in r for r in listed)


def test_readme_and_ci_use_the_same_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make book" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run must call the README's test command"


def test_makefile_never_downloads_a_cuda_torch():
    make = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in make
    setup = (ROOT / "tools" / "setup_env.py").read_text()
    assert 'find_spec("torch") is None' in setup, "an installed torch must be kept"


def test_nbtool_slide_rules():
    md = lambda s, tags=(): {"cell_type": "markdown", "metadata": {"tags": list(tags)}, "source": s}
    assert nbtool.slide_type(md("# Title")) == "slide"
    assert nbtool.slide_type(md("## Section")) == "slide"
    assert nbtool.slide_type(md("### Sub")) == "subslide"
    assert nbtool.slide_type(md("text")) == "-"
    assert nbtool.slide_type(md("text", ["fragment"])) == "fragment"
    assert nbtool.slide_type({"cell_type": "code", "metadata": {"tags": ["setup"]}, "source": ""}) == "skip"


def test_nbtool_check_flags_outputs(tmp_path):
    nb = json.loads(NOTEBOOKS[0].read_text())
    nb["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x"}]
    bad = tmp_path / "bad.ipynb"
    bad.write_text(json.dumps(nb))
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "nbtool.py"), "check", str(bad)], capture_output=True)
    assert res.returncode == 1


def test_module_data_comments_are_not_read_as_types():
    """napoleon reads a ``#:`` comment whose first line contains a colon as 'type: description', which becomes an
    unresolved reference under the strict build. Keep colons off the first line of such comments."""
    bad = []
    for path in sorted((ROOT / "lib" / "curvlab").glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            first = line.lstrip().startswith("#:") and not (i and lines[i - 1].lstrip().startswith("#:"))
            text = re.sub(r":\w+:`[^`]*`", "", line.lstrip()[2:])  # roles such as :func:`run` are fine
            if first and ":" in text.split("`")[0]:
                bad.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert not bad, bad


# --------------------------------------------------------------------------------------------------------
# Units of dampings and step sizes (book/notation.md, section "notation-units"): one convention, machine-read
# --------------------------------------------------------------------------------------------------------
UNITS_START, UNITS_END = "<!-- curvlab-units-table", "<!-- /curvlab-units-table -->"
_SPACING = re.compile(r"\\[,;:!]|\\quad|\\qquad|\\left|\\right|\\big[lr]?|\\Big[lr]?|\s+")
_SYNONYMS = {r"\lambda_{\mathrm{GN}}": r"\lamGN", r"\lambda_\mathrm{GN}": r"\lamGN", r"\lambda_{\rm GN}": r"\lamGN",
             r"\mathcal{I}": r"\Fisher", r"H_{\mathrm{GN}}": r"\GN"}


def units_table(text: str) -> dict[str, dict[str, str]]:
    """``{latex symbol: {matrix: factor}}`` from the marked table of the notation page."""
    if UNITS_START not in text or UNITS_END not in text:
        raise AssertionError("the notation page has no machine-readable units table")
    block = text.split(UNITS_START, 1)[1].split(UNITS_END, 1)[0]
    table: dict[str, dict[str, str]] = {}
    for line in block.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) < 3 or not cols[1].startswith("`"):
            continue
        sym = cols[1].strip("`")
        pairs = [p.rsplit(":", 1) for p in cols[2].strip("`").split(";") if p.strip()]
        table[sym] = {_norm(m): f.strip() for m, f in pairs}
    return table


def _norm(tex: str) -> str:
    for a, b in _SYNONYMS.items():
        tex = tex.replace(a, b)
    return _SPACING.sub("", tex)


def _factor(coef: str) -> str:
    coef = coef.strip("{}()")
    return coef or "1"


def unit_violations(text: str, table: dict[str, dict[str, str]]) -> list[str]:
    """Every place where a damping or step symbol sits next to a matrix with a factor other than the table's.

    Three forms are read: ``M + c·sym`` (a damping added to ``M``), ``c·sym = max(…, λ_min(M))`` or
    ``c·sym = λ_min(M)`` (a damping set from ``M``'s spectrum), and ``sym·c·M`` (a step multiplying the direction
    ``M``; a factor ``1/n`` requires ``/n`` right after ``M``). ``c`` is the text between them (``n`` or nothing).
    """
    t = _norm(text)
    found = []
    for sym, mats in table.items():
        s = re.escape(sym)
        for mat, want in mats.items():
            m = re.escape(mat)
            lead = r"(?<![A-Za-z\\])" if mat[0].isalpha() else ""
            tail = r"(?![A-Za-z_])" if re.search(r"[A-Za-z]$", mat) else ""
            for hit in re.finditer(lead + m + tail + r"\+(?P<c>[A-Za-z0-9{}()]{0,4}?)" + s, t):
                if _factor(hit["c"]) != want and want != "1/n":
                    found.append(f"`{hit.group(0)}`: {sym} is added to {mat} with factor {want}")
            for hit in re.finditer(r"(?P<c>(?<![A-Za-z\\])[A-Za-z0-9]{0,2}?)" + s + r"=(?:\\max\([^,()]*,)?\\lmin\("
                                   + m + r"\)", t):
                if _factor(hit["c"]) != want and want != "1/n":
                    found.append(f"`{hit.group(0)}`: {sym} set from the spectrum of {mat} needs factor {want}")
            for hit in re.finditer(s + r"(?P<c>[0-9n]{0,2}?)" + m + tail + r"(?P<after>/\(?n?)?", t):
                if want == "1/n":
                    if hit["c"] or hit["after"] not in ("/n", "/(n"):
                        found.append(f"`{hit.group(0)}`: {sym} multiplies {mat}, which must be divided by n")
                elif hit["c"] and _factor(hit["c"]) != want:
                    found.append(f"`{hit.group(0)}`: {sym} multiplies {mat} with factor {want}")
    return found


NOTATION = ROOT / "book" / "notation.md"


def test_units_table_is_read():
    table = units_table(NOTATION.read_text())
    assert table[r"\lamGN"][r"\GN"] == "1" and table[r"\lamGN"]["K"] == "n"
    assert table[r"\eta"]["J^\\topr"] == "1/n"


def test_unit_scan_catches_a_wrong_chapter_text():
    table = units_table(NOTATION.read_text())
    good = (r"$\Delta_{\mathrm{GN}}=(\GN+\lamGN I)^{-1}\nabla\Loss=J^\top(K+n\lamGN I)^{-1}r$, the rate "
            r"$s_i/(s_i+n\lamGN)$, $n\lamGN=\max(10^{-7},\lmin(K))$, the GD step $\eta\,J^\top r/n$, "
            r"$(\Fisher + \lambda_{\mathrm{GN}} I)^{-1}$, $(\hat\Sigma+\lambda_GI)^{-1}$, $A^\top\Fisher A+\lamGN I$")
    assert unit_violations(good, table) == []
    wrong = [r"$\Delta_{\mathrm{GN}}=J^\top(K + \lamGN I)^{-1}r$",               # kernel form without the n
             r"$(J^\top J+\lambda_{\mathrm{GN}} I_p)^{-1}J^\top r$",               # summed JᵀJ without the n
             r"$(\GN+n\lamGN I)^{-1}\nabla\Loss$",                                 # averaged GN with an n
             r"the authors' damping $\lamGN=\max(10^{-7},\lmin(K))$",              # kernel-unit rule, no n
             r"$(X^\top X+\lambda_G I)^{-1}X^\top Y$",                             # ridge on the summed Gram
             r"the GD step $\theta-\eta\,J^\top r$"]                               # summed gradient
    for text in wrong:
        assert unit_violations(text, table), f"not caught: {text}"


#: Chapters whose owners are converting them to the convention (issue 17, item 4); remove an entry once it passes.
UNITS_PENDING: dict[str, str] = {}


@pytest.mark.parametrize("name,text", [pytest.param(n, t, id=n, marks=[pytest.mark.xfail(reason=UNITS_PENDING[n], strict=False)]
                                                    if n in UNITS_PENDING else []) for n, t in documents()])
def test_dampings_and_steps_follow_the_notation_table(name, text):
    table = units_table(NOTATION.read_text())
    if name == "notation.md":
        text = text.split(UNITS_START, 1)[0] + text.split(UNITS_END, 1)[1]
    bad = unit_violations(text, table)
    assert not bad, f"{name}: dampings/steps disagree with the units table of book/notation.md: {bad}"



# --------------------------------------------------------------------------------------------------------
# Numbers on prose pages come from the ledger of the build that renders them (issue 17, item 11)
# --------------------------------------------------------------------------------------------------------
_VALUE_ROLE = re.compile(r"\{curvlab-value\}`[^`]*`")
_FENCED = re.compile(r"^(```+|~~~+)[^\n]*\n.*?^\1", re.S | re.M)
#: A sentence that attributes a number to a build: a profile name in backticks, "this build", or the book's own
#: simulations. Such a number is a measurement and must be a ``{curvlab-value}`` role.
_BUILD_WORDS = re.compile(r"`(quick|standard|paper)`|\bthis build\b|\bin our runs\b|\bwe measured?\b|\bsimulated here\b")
#: ... unless the sentence quotes it from an outside source (the paper, its digest, the authors, the review).
_SOURCE_WORDS = re.compile(r"\b(digest|the paper|the authors|review|printed|published|reports?)\b", re.I)
_DECIMAL = re.compile(r"(?<![\w.^_{\\])[-+−]?\d+\.\d+(?:\s*\\?%)?|(?<![\w.^_{\\])\d+\s*\\?%")
_WITH_ERROR = re.compile(r"\d\s*\)?\s*(\\pm|±)\s*\d")


def prose_sentences(text: str) -> list[str]:
    """The sentences of a MyST page, without code blocks, comments, ledger roles and cross-reference roles; each
    table row is a sentence of its own."""
    text = _FENCED.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = _VALUE_ROLE.sub("⟨ledger⟩", text)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", "⟨ref⟩", text)
    out = []
    for para in re.split(r"\n\s*\n", text):
        rows = [ln for ln in para.splitlines() if ln.lstrip().startswith("|")]
        rest = " ".join(ln for ln in para.splitlines() if not ln.lstrip().startswith("|"))
        out += rows + re.split(r"(?<=[.;])\s+(?=[A-Z(*-])", rest)
    return [s for s in out if s.strip()]


def hand_typed_measurements(text: str) -> list[str]:
    """Build-dependent numbers typed by hand on a prose page.

    Rule: (a) a number with an uncertainty (``0.25 ± 0.01``) is a measurement; (b) a decimal number or percentage in
    a sentence that attributes it to a build (a profile name in backticks, "this build", "in our runs") is a
    measurement, unless it is a setting (right after ``=``) or the sentence quotes an outside source (the paper,
    the digest, the authors, the review). Both must be written ``{curvlab-value}`chapter::check```, which the build
    fills from its own ledger.
    """
    found = []
    for s in prose_sentences(text):
        if _WITH_ERROR.search(s):
            found.append(s)
            continue
        if _BUILD_WORDS.search(s) and not _SOURCE_WORDS.search(s):
            for m in _DECIMAL.finditer(s):
                if not re.search(r"(=|\\approx|\\le|\\ge)\s*$", s[max(0, m.start() - 8):m.start()]):
                    found.append(s)
                    break
    return found


def test_measured_number_detector():
    assert hand_typed_measurements("NGD is faster in `standard` (log ratio $-0.51\\pm0.03$).")
    assert hand_typed_measurements("Adam closes $0.17$ of the gap in `quick`.")
    assert hand_typed_measurements("In this build the slope is 1.52.")
    assert not hand_typed_measurements("NGD is faster in `standard` (log ratio {curvlab-value}`11_x::NGD`).")
    assert not hand_typed_measurements("The `paper` profile runs $\\eta=0.02$ with $n = 500$ for 30 s.")
    assert not hand_typed_measurements("The digest measured ratios 0.84 and 0.80 in `quick`.")
    assert not hand_typed_measurements("inputs uniform on $\\{\\pm1\\}^d$, a rate of 0.7.")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_prose_pages_take_measured_numbers_from_the_ledger(path):
    bad = hand_typed_measurements(path.read_text())
    assert not bad, (f"{path.name}: build-dependent numbers typed by hand; write them as "
                     "{curvlab-value}`chapter::check name` (book/_ext/curvlab_book.py):\n" + "\n".join(bad))
