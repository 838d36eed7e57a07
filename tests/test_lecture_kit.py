"""The lecture kit: offline slide decks (tools/slides.py), student notebooks (tools/student.py) and nbgrader
assignments (tools/nbgrader_export.py)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import slides  # noqa: E402
import student  # noqa: E402

SIDECARS = sorted(student.SPEC_DIR.glob("*.yml"))
STORED = sorted({*(student.STUDENT_DIR / f"{p.stem}.ipynb" for p in SIDECARS), *student.STUDENT_DIR.glob("*.ipynb")})
EXTERNAL = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*?\b(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I)
CSS_EXTERNAL = re.compile(r"""(?:@import\s+(?:url\()?|url\()\s*["']?\s*(?:https?:)?//""", re.I)


def external_urls(text: str) -> list[str]:
    """Script, stylesheet, image or frame URLs, and CSS imports, that point off the page's own folder."""
    return [m.group(0) for m in EXTERNAL.finditer(text)] + [m.group(0) for m in CSS_EXTERNAL.finditer(text)]


def test_external_url_scanner_catches_cdns():
    assert external_urls('<script src="https://unpkg.com/reveal.js/dist/reveal.js"></script>')
    assert external_urls("<link rel='stylesheet' href='//cdn.example/x.css'>")
    assert external_urls("<style>@import url(https://fonts.example/css);</style>")
    assert not external_urls('<script src="_static/reveal.js/dist/reveal.js"></script> see https://revealjs.com')


# ------------------------------------------------------------------------------------------------ slides
@pytest.fixture(scope="module")
def deck(tmp_path_factory):
    """Chapter 00, unexecuted (the conversion and the template do not need outputs), as a deck."""
    out = tmp_path_factory.mktemp("slides")
    static, mj = slides.vendor_assets(out)
    nb = slides.slide_notebook(nbformat.read(ROOT / "notebooks" / "00_how_to_read.ipynb", as_version=4), ROOT / "notebooks")
    html = slides.export(nb, static, mj)
    (out / "deck.html").write_text(html)
    return out, html, nb


def test_deck_is_offline_and_its_assets_are_bundled(deck):
    out, html, _ = deck
    assert external_urls(html) == []
    local = re.findall(r"""<(?:script|link)\b[^>]*?\b(?:src|href)="([^"]+)\"""", html)
    assert {"_static/reveal.js/dist/reveal.js", "_static/reveal.js/dist/reveal.css", "_static/mathjax/tex-svg-full.js"} <= set(local)
    for rel in local:
        assert (out / rel).is_file(), f"{rel} is referenced but not bundled"
    theme_css = (out / "_static/reveal.js/dist/theme/white.css").read_text()
    assert external_urls(f"<style>{theme_css}</style>") == []
    assert '"GN": "H_{\\\\mathrm{GN}}"' in html  # the notation macros reach MathJax


def test_deck_slides_follow_the_metadata_and_leave_solutions_out(deck):
    _, html, nb = deck
    n_slides = sum(c.metadata.get("slideshow", {}).get("slide_type") == "slide" for c in nb.cells)
    assert n_slides >= 8 and html.count("<section") >= n_slides
    assert "{prf:" not in html and "{footcite" not in html and "{doc}" not in html
    assert "Stein&#39;s lemma" in html or "Stein's lemma" in html
    assert "An unbiased spike" in html  # exercises stay ...
    assert "By the corollary, the cosine is exactly" not in html  # ... their solutions go
    assert "beta_eig = torch.linalg.eigh" not in html
    assert "Kernel-form damped GN direction" in html  # literalinclude is inlined (the docstring of the function)
    assert "Zhang et al. (2025)" in html  # footcite -> author (year), with a reference list


def test_built_decks_are_offline():
    built = sorted((ROOT / "_build" / "slides").glob("*.slides.html"))
    if not built:
        pytest.skip("no decks built (make slides)")
    for path in built:
        assert external_urls(path.read_text()) == [], path.name


def test_projector_cell_follows_the_setup_cell():
    nb = slides.with_projector_theme(nbformat.read(ROOT / "notebooks" / "01_curvature_primer.ipynb", as_version=4))
    i = next(i for i, c in enumerate(nb.cells) if "setup" in c.metadata.get("tags", []))
    assert 'set_theme("projector")' in nb.cells[i + 1].source
    assert nb.cells[i + 1].metadata["slideshow"]["slide_type"] == "skip"


# ------------------------------------------------------------------------------------------------ self-check
def _helpers():
    ns = student._helpers()
    ref = {"tol": 0.01, "salt": "s", "hashes": [ns["_k_hash"]("s:0", round(0.63 / 0.01)), ns["_k_hash"]("s:1", round(-2.0 / 0.01))]}
    ns["SELF_CHECKS"] = {"ex": {"x": ref}}
    return ns


@pytest.mark.parametrize("value", [[0.63, -2.0], [0.6349, -2.009], (0.621, -1.991)])
def test_self_check_accepts_answers_within_tolerance(value):
    _helpers()["self_check"]("ex", x=value)


@pytest.mark.parametrize("value, match", [(..., "TODO"), (None, "TODO"), ([0.66, -2.0], "not right"),
                                           ([0.63], "2 number"), ([float("nan"), -2.0], "finite"), ("abc", "finite")])
def test_self_check_rejects_wrong_or_missing_answers(value, match):
    with pytest.raises(AssertionError, match=match):
        _helpers()["self_check"]("ex", x=value)


def test_the_self_check_code_holds_no_reference_value():
    for path in SIDECARS:
        stored = student.STUDENT_DIR / f"{path.stem}.ipynb"
        text = stored.read_text()
        for label, answers in student.stored_refs(stored).items():
            for name, ref in answers.items():
                assert set(ref) == {"tol", "salt", "hashes"}, f"{label}.{name}"


# ------------------------------------------------------------------------------------------------ student notebooks
def test_student_folder_ships_only_generated_notebooks():
    """notebooks/student/ is what students download: the specs (teacher code) live in tools/student_specs/."""
    shipped = sorted(p.name for p in student.STUDENT_DIR.iterdir() if not p.name.startswith("."))
    assert shipped and all(name.endswith(".ipynb") for name in shipped), shipped
    assert SIDECARS, "no student specs found in tools/student_specs/"


@pytest.mark.parametrize("stored", STORED, ids=lambda p: p.stem)
def test_student_notebook_is_stored_and_current(stored):
    """The stored student notebook is what the generator makes from the chapter now (reference hashes aside)."""
    chapter = ROOT / "notebooks" / f"{stored.stem}.ipynb"
    assert stored.exists(), f"run `make student` to create {stored.name}"
    nb = nbformat.read(chapter, as_version=4)
    specs = student.load_specs(nb, stored.stem)
    assert set(specs) <= set(student.gated_solutions(nb)), "a spec names an exercise without a gated solution"
    refs = student.stored_refs(stored)
    assert set(refs) == set(specs) and all(set(refs[k]) == set(specs[k]["answers"]) for k in specs)
    want = student.nbtool.dumps(student.student_notebook(nb, stored.stem, specs, refs))
    assert stored.read_text() == want, f"{stored.name} is out of date: run `make student`"


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_student_notebook_leaves_every_solution_out(sidecar):
    chapter = nbformat.read(ROOT / "notebooks" / f"{sidecar.stem}.ipynb", as_version=4)
    text = (student.STUDENT_DIR / f"{sidecar.stem}.ipynb").read_text()
    specs = student.load_specs(chapter, sidecar.stem)
    solution_cells = {i for idx in student.gated_solutions(chapter).values() for i in idx}
    shown = "\n".join(c.source for i, c in enumerate(chapter.cells)  # the chapter's other code, which students get
                       if c.cell_type == "code" and i not in solution_cells)
    for label, idx in student.gated_solutions(chapter).items():
        given = specs.get(label, {}).get("stub", "") + "\n" + shown  # what the notebook hands out on purpose
        for i in idx:
            for line in chapter.cells[i].source.splitlines():
                if len(line.strip()) > 25 and line.strip() not in given:
                    assert line.strip() not in text, f"solution code of {label} leaked: {line.strip()!r}"
    assert "{solution" not in text and "{exercise" not in text
    assert "student-stub" in text and "TODO" in text
    stud = nbformat.reads(text, as_version=4)
    assert not [c.id for c in stud.cells if student.LECTURER_ONLY & set(c.metadata.get("tags", []))
                and c.cell_type == "markdown"], "speaker notes in a student notebook"
    for label, spec in specs.items():  # the spec's teacher code (answers the solution does not bind) stays out too
        for name, answer in spec["answers"].items():
            for line in str(answer.get("teacher", "")).splitlines():
                if len(line.strip()) > 25:
                    assert line.strip() not in text, f"teacher code of {label}.{name} leaked: {line.strip()!r}"


@pytest.mark.parametrize("stored", STORED, ids=lambda p: p.stem)
def test_student_notebook_defines_the_macros_katex_safely(stored):
    """The first cell defines every macro with \\def (KaTeX refuses \\newcommand of its built-ins \\R, \\argmin and
    of a name a host defined before, then defines none); the formulas themselves have the macros expanded
    (tests/test_channels_notebooks.py renders them in KaTeX and jupyterlab-myst)."""
    import yaml

    nb = nbformat.read(stored, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "student-notation" in first.metadata.get("tags", [])
    assert "\\newcommand" not in first.source
    for name in yaml.safe_load((ROOT / "book" / "macros.yml").read_text()):
        assert f"\\def\\{name}" in first.source, f"\\{name} is not defined in the first cell"


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_stubs_fail_their_self_check_and_the_solution_passes(sidecar):
    """Run the setup cell, the cells each exercise needs, then the stub + self-check (must raise AssertionError),
    then the chapter's own solution + the same self-check (must pass) — in the quick profile, in one kernel."""
    from nbclient.exceptions import CellExecutionError

    chapter = nbformat.read(ROOT / "notebooks" / f"{sidecar.stem}.ipynb", as_version=4)
    stud = nbformat.read(student.STUDENT_DIR / f"{sidecar.stem}.ipynb", as_version=4)
    text = (student.STUDENT_DIR / f"{sidecar.stem}.ipynb").read_text()
    specs = student.load_specs(chapter, sidecar.stem)
    tagged = lambda tag: [c for c in stud.cells if tag in c.metadata.get("tags", [])]  # noqa: E731
    stubs, checks = tagged("student-stub"), tagged("self-check")
    kernel = student.Kernel(ROOT / "notebooks", "quick")
    try:
        kernel.run(student.setup_cell(stud).source)
        kernel.run(tagged("self-check-helpers")[0].source)
        for label, spec in specs.items():
            check = next(c.source for c in checks if f'"{label}"' in c.source)
            stub = stubs[[c.source for c in checks].index(check)].source if len(stubs) == len(checks) else spec["stub"]
            for cid in spec["needs"]:
                kernel.run(student.cell_by_id(chapter, cid).source)
            kernel.run(stub)
            with pytest.raises(CellExecutionError) as failed:
                kernel.run(check)
            assert failed.value.ename == "AssertionError", f"{label}: the stub failed by {failed.value.ename}, not its self-check"
            for src in student.teacher_cells(chapter, label, spec):
                kernel.run(src)
            out = kernel.run(check)
            assert f"{label}: right" in "".join(o.get("text", "") for o in out.outputs)
            for name in spec["answers"]:  # the student notebook does not print the reference value
                for v in kernel.value(name):
                    if v != 0 and len(f"{abs(v):.3g}".replace(".", "").strip("0")) >= 3:  # not 8, 0.5, -0.25
                        for shown in {f"{v:.3g}", f"{v:.4g}"}:
                            assert shown not in text, f"{label}.{name}: the reference value {shown} is in the notebook"
    finally:
        kernel.close()


# ------------------------------------------------------------------------------------------------ pages
def test_lecture_kit_page_links_every_student_notebook_through_the_books_repository():
    import yaml

    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    slug = repo.split("github.com/", 1)[1].rstrip("/")
    page = (ROOT / "book" / "lecture_kit.md").read_text()
    for stored in STORED:
        assert f"<../notebooks/student/{stored.name}>" in page, f"{stored.name} is not offered for download"
    for link in re.findall(r"https://colab\.research\.google\.com/github/([^)\s]+)", page):
        assert link.startswith(f"{slug}/blob/"), f"Colab link {link} does not follow _config.yml's repository"
        assert (ROOT / link.split("/blob/main/", 1)[1]).exists(), link


def test_handout_preamble_defines_every_macro():
    import yaml

    sys.path.insert(0, str(ROOT / "tools"))
    import pdf

    macros = yaml.safe_load((ROOT / "book" / "macros.yml").read_text())
    pre = pdf.preamble()
    for name in macros:
        assert f"\\renewcommand{{\\{name}}}" in pre
    assert "\\renewcommand{\\norm}[1]{{\\left\\lVert #1 \\right\\rVert}}" in pre  # one group (tests/test_pdf.py)


# ------------------------------------------------------------------------------------------------ nbgrader
def test_nbgrader_generates_and_autogrades_a_chapter(tmp_path):
    """tools/nbgrader_export.py on chapter 00, then nbgrader's own steps: generate_assignment removes the solution and
    the hidden tests from the release; autograde gives the chapter's solution full marks and a wrong answer none."""
    pytest.importorskip("nbgrader")
    import shutil
    import subprocess

    import nbgrader_export
    from nbgrader.api import Gradebook

    stem = "00_how_to_read"
    course = tmp_path / "course"
    (source,) = nbgrader_export.export([ROOT / "notebooks" / f"{stem}.ipynb"], course, "quick")
    src = nbformat.read(source, as_version=4)
    graded = [c for c in src.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert graded and all("### BEGIN HIDDEN TESTS" in c.source for c in graded)
    bindir = str(Path(sys.executable).parent)  # nbgrader runs `alembic` from the environment's bin
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "CURVLAB_PROFILE": "quick"}
    nbg = [sys.executable, "-m", "nbgrader"]

    def run(*args: str) -> None:
        res = subprocess.run([*nbg, *args, "--force"] if args[0] in ("generate_assignment", "autograde") else [*nbg, *args],
                             cwd=course, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{res.stderr[-3000:]}"

    run("generate_assignment", stem)
    release = (course / "release" / stem / f"{stem}.ipynb").read_text()
    assert "### BEGIN SOLUTION" not in release and "HIDDEN TESTS" not in release and "_ref = " not in release
    solution = next(c.source for c in src.cells if c.metadata.get("nbgrader", {}).get("solution"))
    body = re.search(r"### BEGIN SOLUTION\n(.*?)\n### END SOLUTION", solution, re.S).group(1)
    for line in body.splitlines():
        if len(line.strip()) > 25:
            assert line.strip() not in release, f"solution line in the release: {line.strip()!r}"
    for student_id, answer in (("solved", body), ("wrong", body + "\ncos_pop_eig = 0.5")):
        nb = nbformat.read(course / "release" / stem / f"{stem}.ipynb", as_version=4)
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("solution"):
                assert "raise NotImplementedError()" in cell.source
                cell.source = cell.source.replace("# YOUR CODE HERE\nraise NotImplementedError()", answer)
        folder = course / "submitted" / student_id / stem
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{stem}.ipynb")
        if (course / "source" / stem / "configs").is_dir():
            shutil.copytree(course / "source" / stem / "configs", folder / "configs")
        run("db", "student", "add", student_id)
    run("autograde", stem)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        solved, wrong = (gb.find_submission(stem, s) for s in ("solved", "wrong"))
        assert solved.max_score == len(graded) and solved.score == solved.max_score
        assert wrong.score == 0
