"""The book's Sphinx extension: cache key on lib/, offline inventories, macros, ledger tables."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import curvlab_book  # noqa: E402


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    (tmp_path / "lib" / "curvlab").mkdir(parents=True)
    (tmp_path / "lib" / "curvlab" / "a.py").write_text("x = 1\n")
    (tmp_path / "lib" / "pyproject.toml").write_text("[project]\nname='curvlab'\n")
    monkeypatch.setattr(curvlab_book, "ROOT", tmp_path)
    return tmp_path


def test_cache_key_changes_with_the_library_and_the_profile(fake_root):
    key = curvlab_book.library_key("quick")
    assert curvlab_book.library_key("quick") == key
    assert curvlab_book.library_key("standard") != key
    (fake_root / "lib" / "curvlab" / "a.py").write_text("x = 2\n")
    assert curvlab_book.library_key("quick") != key, "a library change must re-execute the notebooks"
    key2 = curvlab_book.library_key("quick")
    (fake_root / "lib" / "curvlab" / "b.py").write_text("")
    assert curvlab_book.library_key("quick") != key2, "a new library file must re-execute the notebooks"


def test_build_environment_points_cache_and_ledger_at_the_key(fake_root):
    env = curvlab_book.build_environment("quick")
    key = env["CURVLAB_KEY"]
    assert env["CURVLAB_EXECUTION_CACHE"].endswith(f"quick-{key}")
    assert env["CURVLAB_LEDGER_DIR"].endswith(f"quick-{key}")
    assert env["CURVLAB_BOOK_BUILD"] == "1" and env["CURVLAB_PROGRESS"] == "0"
    with pytest.raises(ValueError, match="CURVLAB_PROFILE"):
        curvlab_book.build_environment("enormous")


def test_inventories_load_with_sphinx(tmp_path):
    from sphinx.util.inventory import InventoryFile

    for project, (base, entries) in curvlab_book.INVENTORIES.items():
        path = tmp_path / f"{project}.inv"
        curvlab_book.write_inventory(path, project, entries)
        with open(path, "rb") as f:
            inv = InventoryFile.load(f, base, lambda a, b: a + b)
        for name, role, uri in entries:
            assert name in inv[role], f"{name} missing from the {project} inventory"
            assert inv[role][name][2] == base + uri


def test_macros_file_is_valid_mathjax():
    import yaml

    macros = yaml.safe_load((ROOT / "book" / "macros.yml").read_text())
    assert macros, "book/macros.yml is empty"
    for name, value in macros.items():
        assert name.isalpha(), name
        if isinstance(value, list):
            body, nargs = value
            assert isinstance(body, str) and isinstance(nargs, int) and f"#{nargs}" in body
        else:
            assert isinstance(value, str) and "\\\\" not in value, f"{name}: doubled backslash"


def test_ledger_rows_keep_claims_and_derived_apart():
    records = {
        "ch": [
            {"kind": "claim", "name": "c", "source": "paper", "status": "reproduced", "tolerance": 0.1},
            {"kind": "derived", "name": "d", "source": "here", "status": "passed", "tolerance": 0.01,
             "effect": 1.0, "underpowered": False},
            {"kind": "identity", "name": "i", "source": "here", "status": "passed", "route": "exact simplification"},
        ]
    }
    claims = curvlab_book.ledger_rows(records, ("claim",))
    derived = curvlab_book.ledger_rows(records, ("derived", "bound", "identity"))
    assert [r["check"] for r in claims] == ["c"] and [r["check"] for r in derived] == ["d", "i"]
    assert derived[1]["why"] == "exact simplification" and derived[1]["tolerance"] == "exact"
    html = curvlab_book.ledger_html(derived)
    assert html.count("<tr>") == 3 and "<strong>d</strong>" in html


def _derived(name, **kw):
    base = {"kind": "derived", "name": name, "source": "here", "status": "passed", "tolerance": 0.0123, "effect": 1.0,
            "underpowered": False, "error": 0.001, "foil_error": 1.0, "predicted_scale": 1.0, "identical": False,
            "tolerance_parts": [{"kind": "replicates", "value": 0.0123, "why": "spread", "from_prediction": False}]}
    return {**base, **kw}


def test_ledger_shows_what_each_derived_check_compares_and_how_it_counts():
    records = {
        "ch": [
            _derived("mc", compares="Monte Carlo vs closed form", routes=["Monte Carlo", "closed form"],
                     evidence="evidence", basis="sampling vs closed form"),
            _derived("same", compares="library vs same library", evidence="consistency"),
            _derived("bare"),
            _derived("self", compares="run vs law", routes=["run", "law"], evidence="evidence",
                     basis="sampling vs closed form",
                     tolerance_parts=[{"kind": "deviation", "value": 0.01, "why": "other decade", "from_prediction": True}]),
            _derived("old", compares="simulation vs theory", evidence="evidence"),
            {"kind": "claim", "name": "c", "source": "paper", "status": "inconclusive", "tolerance": 0.1},
        ]
    }
    rows = curvlab_book.ledger_rows(records, ("derived", "bound", "identity"))
    assert [r["evidence"] for r in rows] == ["evidence", "consistency", "unclassified",
                                             "not evidence: tolerance from prediction",
                                             "not evidence: routes not named"]
    html = curvlab_book.ledger_html(rows)
    assert "<th>routes</th>" in html and "Monte Carlo vs closed form" in html
    assert "curvlab-evidence-not-evidence" in html
    header, table = curvlab_book.evidence_summary_rows(records)
    assert header[1] == "derived: evidence"
    assert "(sampling vs closed form)" in html
    assert table[0] == ["ch", "1", "1", "2", "1", "0", "0", "1"] and table[-1][0] == "all chapters"


def test_value_reference_parsing_and_lookup():
    assert curvlab_book.parse_value_ref("ch::a check") == ("ch", "a check", "measured")
    assert curvlab_book.parse_value_ref(" ch :: a check :: status ") == ("ch", "a check", "status")
    for bad in ("no separator", "ch::name::colour", "::name"):
        with pytest.raises(ValueError, match="curvlab-value"):
            curvlab_book.parse_value_ref(bad)
    records = {"ch": [{"name": "a", "measured": "0.5", "status": "passed", "tolerance": 0.012345},
                      {"name": "a", "measured": "0.7", "status": "passed", "tolerance": 0.0123}]}
    assert curvlab_book.ledger_value(records, "ch::a") == "0.7"          # the last record of that name
    assert curvlab_book.ledger_value(records, "ch::a::tolerance") == "0.0123"
    assert curvlab_book.ledger_value(records, "ch::missing") is None
    assert curvlab_book.ledger_value(records, "other::a") is None


def test_value_role_fills_prose_from_this_builds_ledger(fake_root, tmp_path, monkeypatch):
    """A tiny Sphinx project with the extension: the role shows the ledger's number, and a reference the build did
    not record is a warning (an error of the strict book build)."""
    import io
    import json

    from sphinx.application import Sphinx

    for key in ("CURVLAB_PROFILE", "CURVLAB_KEY", "CURVLAB_BOOK_BUILD", "CURVLAB_PROGRESS", "CURVLAB_LEDGER_DIR",
                "CURVLAB_EXECUTION_CACHE", "MPLBACKEND"):
        monkeypatch.setenv(key, "")
    monkeypatch.setenv("CURVLAB_PROFILE", "quick")
    ledger = curvlab_book.ledger_dir("quick", curvlab_book.library_key("quick"))
    ledger.mkdir(parents=True)
    (ledger / "11_x.json").write_text(json.dumps([{"kind": "claim", "name": "NGD is slower", "measured": "-0.51 ± 3·0.01",
                                                   "status": "not reproduced", "source": "p", "profile": "quick"}]))
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
                                 "extensions = ['myst_parser', 'sphinx.ext.intersphinx', 'sphinx.ext.mathjax', 'curvlab_book']\n")
    (src / "index.md").write_text("# T\n\nRatio {curvlab-value}`11_x::NGD is slower` "
                                  "(*{curvlab-value}`11_x::NGD is slower::status`*), "
                                  "gone {curvlab-value}`11_x::renamed check`.\n\n"
                                  "```{curvlab-case} 11_x::NGD is slower\n"
                                  ":reproduced: CASE-R NGD is slower.\n"
                                  ":not_reproduced: CASE-N NGD is **not** slower, $x^2$.\n"
                                  ":inconclusive: CASE-I cannot tell.\n"
                                  "```\n\n"
                                  "```{curvlab-case} 11_x::NGD is slower\n"
                                  ":reproduced: CASE-HALF only one verdict written.\n"
                                  "```\n\n"
                                  "```{curvlab-case} 11_x::a claim nobody recorded\n"
                                  ":reproduced: CASE-GONE-R\n:not_reproduced: CASE-GONE-N\n:inconclusive: CASE-GONE-I\n"
                                  "```\n")
    warnings = io.StringIO()
    app = Sphinx(str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"), "html",
                 status=None, warning=warnings, freshenv=True)
    app.build()
    html = (tmp_path / "out" / "index.html").read_text()
    assert "-0.51 ± 3·0.01" in html and "not reproduced" in html and 'class="curvlab-value"' in html
    assert "renamed check" in warnings.getvalue() and "no value" in warnings.getvalue()
    # curvlab-case keeps only the recorded verdict's text, parsed as MyST (bold, math) ...
    assert "CASE-N" in html and "<strong>not</strong>" in html and "CASE-R" not in html and "CASE-I" not in html
    assert "curvlab-case-not-reproduced" in html
    # ... warns when a claim's case lacks a verdict or the recorded one, and when the record is missing
    w = warnings.getvalue()
    assert "no text for not reproduced, inconclusive" in w and "has no text for it" in w
    assert "CASE-HALF" not in html and "CASE-GONE" not in html
    assert "no record '11_x::a claim nobody recorded'" in w


def test_api_values_that_hold_code_list_their_keys_instead_of_function_reprs(fake_root, tmp_path, monkeypatch):
    """autodoc printed ``UPDATES = {'sgd': <function sgd_step>, …}`` (18 function reprs in the handout's API chapter):
    a value that holds code gets no value line, a mapping its keys; a plain constant keeps its value."""
    import io

    from sphinx.application import Sphinx

    monkeypatch.setenv("CURVLAB_PROFILE", "quick")
    mod = tmp_path / "regmod.py"
    mod.write_text("def step(x):\n    return x\n\n\n"
                   "class Run:\n    def __init__(self, f):\n        self.f = f\n\n\n"
                   "#: name -> update rule.\nRULES = {'sgd': step, 'kfac': lambda x: x}\n"
                   "#: name -> a run object.\nRUNS = {'a': Run(step)}\n"
                   "#: a plain constant.\nLIMIT = 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
                                 "extensions = ['myst_parser', 'sphinx.ext.intersphinx', 'sphinx.ext.autodoc', 'curvlab_book']\n")
    (src / "index.rst").write_text("T\n=\n\n.. automodule:: regmod\n   :members:\n")
    app = Sphinx(str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"), "html",
                 status=None, warning=io.StringIO(), freshenv=True)
    app.build()
    text = re.sub(r"<[^>]+>", "", (tmp_path / "out" / "index.html").read_text())
    text = text.replace("&lt;", "<").replace("&gt;", ">").replace("&#39;", "'")
    assert not curvlab_book.CODE_REPR.search(text), curvlab_book.CODE_REPR.search(text)
    assert "Keys when the module is loaded (2): sgd, kfac." in text and "loaded (1): a." in text
    assert "= 0.25" in text  # a value that holds no code is still shown


def test_value_fields_match_the_library_and_render_verdict_and_sign():
    from curvlab import checks

    assert curvlab_book.VALUE_FIELDS == checks.VALUE_FIELDS
    records = {"ch": [
        {"kind": "claim", "name": "up", "status": "reproduced", "interval": [0.2, 0.9], "threshold": 0.0,
         "estimate": 0.55, "note": ""},
        {"kind": "claim", "name": "edge", "status": "inconclusive", "interval": [-0.9, -0.2], "threshold": 0.0,
         "note": "tuned value at its grid's edge (Adam lr): inconclusive; interval alone said not reproduced"},
        {"kind": "claim", "name": "mid", "status": "inconclusive", "interval": [0.4, 0.6], "threshold": 0.5},
        {"kind": "derived", "name": "d", "status": "passed", "tolerance": 0.1, "measured_min": -0.05,
         "measured_max": 0.3, "underpowered": True, "routes": ["Monte Carlo", "closed form"],
         "basis": "sampling vs closed form"},
    ]}
    v = lambda ref: curvlab_book.ledger_value(records, ref)  # noqa: E731
    assert v("ch::up::verdict") == "reproduced" and v("ch::up::sign") == "positive"
    assert v("ch::up::estimate") == "0.55" and v("ch::up::interval") == "[0.2, 0.9]"
    assert v("ch::edge::verdict") == "inconclusive (a tuned value at its grid's edge: Adam lr)"
    assert v("ch::edge::sign") == "negative"            # the interval's side, whatever the edge rule decided
    assert v("ch::mid::sign") == "undetermined"
    assert v("ch::d::verdict") == "passed (underpowered)" and v("ch::d::sign") == "undetermined"
    assert v("ch::d::routes") == "Monte Carlo vs closed form" and v("ch::d::basis") == "sampling vs closed form"


def test_case_choice_warns_on_missing_records_and_texts():
    records = {"ch": [{"kind": "claim", "name": "c", "status": "inconclusive"},
                      {"kind": "derived", "name": "d", "status": "passed"}]}
    assert curvlab_book.choose_case(records, "ch::c", {"reproduced", "not reproduced", "inconclusive"}) == ("inconclusive", [])
    keep, problems = curvlab_book.choose_case(records, "ch::c", {"reproduced", "inconclusive"})
    assert keep == "inconclusive" and "no text for not reproduced" in problems[0]
    keep, problems = curvlab_book.choose_case(records, "ch::c", {"reproduced", "not reproduced"})
    assert keep is None and "has no text for it" in problems[-1]
    assert curvlab_book.choose_case(records, "ch::d", {"passed"}) == ("passed", [])
    keep, problems = curvlab_book.choose_case(records, "ch::gone", {"passed"})
    assert keep is None and "no record" in problems[0]
    with pytest.raises(ValueError, match="curvlab-case"):
        curvlab_book.parse_case_ref("ch::c::verdict")


def test_markdown_outputs_of_conclude_render_as_markdown_in_the_book(tmp_path):
    """``checks.conclude`` displays ``text/markdown``; with the book's ``nb_render_markdown_format: myst`` myst-nb
    renders it like a Markdown cell (bold, math), not as a code block."""
    import io

    import nbformat
    from sphinx.application import Sphinx

    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text("extensions = ['myst_nb']\nnb_execution_mode = 'off'\n"
                                 "nb_render_markdown_format = 'myst'\nmyst_enable_extensions = ['dollarmath']\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# T"), nbformat.v4.new_code_cell("checks.conclude(...)")]
    nb.cells[1].outputs = [nbformat.v4.new_output("display_data", data={
        "text/markdown": "The claim is **CONCLUDED** here, $x^2$.", "text/plain": "<IPython.core.display.Markdown object>"})]
    nbformat.write(nb, str(src / "index.ipynb"))
    app = Sphinx(str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"), "html",
                 status=None, warning=io.StringIO(), freshenv=True)
    app.build()
    html = (tmp_path / "out" / "index.html").read_text()
    assert "<strong>CONCLUDED</strong>" in html and "Markdown object" not in html
    assert 'class="math' in html


def test_theorem_labels_in_latex_name_their_document_even_when_the_title_has_markup():
    """sphinx-proof's ``find_parent`` compares a section's names with the title text; a chapter title with math or
    markup (chapters 11, 12, 22) made it return ``None``, so the LaTeX label was ``None:<label>`` and each
    ``{prf:ref}`` printed ``??``. The book's replacement finds the enclosing ``start_of_file`` (or the source)."""
    from types import SimpleNamespace

    from docutils import nodes
    from sphinx import addnodes

    env = SimpleNamespace(titles={"notebooks/12_x": nodes.title(text="One giant step: $\\eta$")},
                          config=SimpleNamespace(root_doc="book/index"),
                          path2doc=lambda path: {"/book/notebooks/12_x.ipynb": "notebooks/12_x"}.get(path))
    sec = nodes.section(names=["one giant step: eta"], docname="notebooks/12_x")
    block = nodes.container()
    sec += block
    included = addnodes.start_of_file(docname="notebooks/12_x")
    included += sec
    import sphinx_proof.nodes as proof_nodes

    curvlab_book._patch_sphinx_proof()
    assert curvlab_book._proof_find_parent_orig(env, block, "section") is None  # the upstream lookup fails here
    assert proof_nodes.find_parent(env, block, "section") == "notebooks/12_x"
    # without a start_of_file (a one-document LaTeX build), the node's source names the document
    sec2 = nodes.section(names=["x"])
    sec2.source = "/book/notebooks/12_x.ipynb"
    block2 = nodes.container()
    sec2 += block2
    assert proof_nodes.find_parent(env, block2, "section") == "notebooks/12_x"


# --------------------------------------------------------------------------------------------------------
# The paper-scale page's {frame} figures (book/_ext/curvlab_frames.py)
# --------------------------------------------------------------------------------------------------------
def test_paper_scale_page_reads_every_frame_figure_from_the_committed_provenance():
    import curvlab_frames as cf

    page = (cf.ROOT / "book" / "paper_scale.md").read_text()
    refs = cf.REF_RE.findall(page)
    assert len(refs) >= 9, "the paper-scale page quotes its frames' times through {frame} references"
    out = cf.process(page)
    assert "{frame}" not in out
    wall = json.loads((cf.FRAMES / "ch11_linrep_fig1.paper.json").read_text())["wall_s"]
    assert f"{wall:.0f} s" in out
    # a committed frame's time is never typed next to it: "NNN s of one CPU core" only through the role
    assert not re.search(r"\|\s*\d[\d.,]*\s*s of one CPU core", page)


def test_frame_reference_errors_name_what_is_missing(tmp_path):
    import curvlab_frames as cf

    (tmp_path / "g.paper.json").write_text(json.dumps({"wall_s": 12.4, "revisions": [], "timestamps": ["2026-12-05T01:00:00"],
                                                        "threads": {"torch_threads": [1]}}))
    assert cf.process("{frame}`g.paper::wall_s`", tmp_path) == "12 s"
    assert cf.process("{frame}`g.paper::date`", tmp_path) == "2026-12-05"
    with pytest.raises(cf.FramePageError, match="no committed frame"):
        cf.process("{frame}`nope.paper::wall_s`", tmp_path)
    with pytest.raises(cf.FramePageError, match="field in"):
        cf.process("{frame}`g.paper::speed`", tmp_path)
    with pytest.raises(cf.FramePageError, match="no value"):
        cf.process("{frame}`g.paper::revision`", tmp_path)
