"""The chapters outside the built book: the clean copies Colab and JupyterLab open (tools/colab.py), the setup cell's
install, the launch buttons, the lab extra, and curvlab in a fresh virtual environment with only torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import colab  # noqa: E402
import curvlab_launch  # noqa: E402
import myst_export  # noqa: E402
import nbtool  # noqa: E402

CHAPTERS = colab.chapters()
CONFIG = colab.load_config()


@pytest.fixture(scope="module")
def shared():
    return {"index": colab.BookIndex.build(), "bib": colab.Bibliography(), "config": CONFIG}


@pytest.fixture(scope="module")
def js():
    """node with KaTeX and jupyterlab-myst's MyST parser (tools/js, ``npm ci``; tools/ci_packages.sh installs them)."""
    import shutil

    if shutil.which("node") is None:
        pytest.skip("node is not installed: the KaTeX / jupyterlab-myst render checks need it (tools/ci_packages.sh)")
    if not myst_export.install_js():
        pytest.skip("cannot npm ci tools/js (KaTeX, myst-parser): run tools/ci_packages.sh")
    return True


FRONT = {f"\\{k}": myst_export.katex_safe(v) for k, (v, _n) in myst_export.load_macros().items()}


def assert_renders(cells: list[str], index, what: str, frontmatter=FRONT) -> dict:
    """Every formula renders in KaTeX (no macros; and after the first cell's definitions) and in jupyterlab-myst (its
    parser and math transform, with the lab's front-matter macros); no raw TeX, MyST, HTML box or label is left."""
    r = myst_export.render_check(cells, frontmatter)
    for key in ("katex_plain", "katex_shared", "myst_errors", "quote_markers", "raw_tex", "myst_syntax", "html_boxes"):
        assert not r[key], f"{what}: {len(r[key])} {key}, e.g. {r[key][:3]}"
    assert r["myst_math"] == r["formulas"], f"{what}: jupyterlab-myst sees {r['myst_math']} of {r['formulas']} formulas"
    raw = [lab for c in cells for lab in myst_export.raw_labels(c, index)]
    raw += [lab for t in r["text"] for lab in myst_export.raw_labels(t, index)]
    assert not raw, f"{what}: raw labels shown as text: {sorted(set(raw))[:10]}"
    return r


# ------------------------------------------------------------------------------------------------ the conversion
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_converts_and_renders_in_katex_and_jupyterlab_myst(path, shared, js):
    nb, problems = colab.convert_notebook(path, "main", **shared)
    assert not problems, f"{path.name}: MyST without a conversion in tools/myst_export.py: {problems}"
    left = colab.leftovers(nb)
    assert not left, f"{path.name}: left in the Colab copy: {left[:10]}"
    cells = [colab.cell_source(c) for c in nb["cells"] if c["cell_type"] == "markdown"]
    r = assert_renders(cells, shared["index"], f"Colab copy of {path.name}")
    assert r["formulas"] > 0 or path.stem.startswith("00")


def test_render_check_catches_what_the_issue_saw(shared, js):
    """The checker itself: a \\newcommand of a KaTeX built-in, an HTML box, a stray > in quoted maths, a raw label."""
    cells = ["$\\newcommand{\\R}{\\mathbb{R}}\\newcommand{\\E}{\\mathbb{E}}$",
             '<div class="curvlab-box">\n\n$x$\n\n</div>', "> **Lemma.**\n>\n> $$\n> a = b\n> $$",
             "by notation-lem-vec", "{term}`K-FAC`", "$\\GN$ and $\\frac{1}$"]
    r = myst_export.render_check(cells, FRONT)
    assert r["katex_shared"] and any(e["cell"] == 0 for e in r["myst_errors"]), "\\newcommand of \\E, \\R must fail"
    assert r["html_boxes"] and r["quote_markers"] and r["myst_syntax"]
    assert any(e["cell"] == 5 for e in r["katex_plain"]), "an undefined macro must fail without definitions"
    assert myst_export.raw_labels(cells[3], shared["index"]) == ["notation-lem-vec"]


def test_leftover_detector_catches_myst_and_unexpanded_macros():
    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}  # noqa: E731
    nb = {"cells": [md("$\\def\\GN{H}$"), md("see {term}`K-FAC`"), md("```{prf:lemma} x\n:label: a\n```"),
                    md("(sec-x)=\n# X"), md("$\\GN x$"), md("$$ a $$ (eq-a)"),
                    md("`{term}` in code and ``{doc}`x` `` stay"), md('<div class="x">\n\n$a$\n\n</div>')]}
    found = "\n".join(colab.leftovers(nb))
    for what in ("a MyST role", "a directive fence", "a (label)= target", "a directive option", "\\GN (a book macro",
                 "an equation label", "an HTML box"):
        assert what in found, what
    assert "cell 6" not in found


def test_macro_expansion_is_token_safe():
    macros = colab.load_macros()
    assert colab.expand_macros(r"\kron\Cin", macros) == r"\otimes C_{\mathrm{in}}"
    assert colab.expand_macros(r"\tilde\Loss", macros) == r"\tilde{\mathcal{L}}"
    assert colab.expand_macros(r"\norm{\GN x}_2", macros) == r"\left\lVert H_{\mathrm{GN}} x \right\rVert_2"
    assert colab.expand_macros(r"\argmin_F", macros) == r"\mathop{\mathrm{arg\,min}}_F"
    assert colab.expand_macros(r"\begin{pmatrix}z\\z'\end{pmatrix}\Rd", macros) == r"\begin{pmatrix}z\\z'\end{pmatrix}\Rd"
    assert colab.expand_macros(r"\ip{a}{\R^d}", macros) == r"\left\langle a, \mathbb{R}^d \right\rangle"
    # a script whose token takes an argument: MathJax reads x_\tilde w as x_{\tilde w}, KaTeX stops without braces
    assert colab.expand_macros(r"\nabla_\tilde w\Loss", macros) == r"\nabla_{\tilde w}\mathcal{L}"
    assert colab.expand_macros(r"x^\mathrm{T}_\text{in} W^\top", macros) == r"x^{\mathrm{T}}_{\text{in}} W^\top"


def test_macro_definitions_are_katex_safe(js):
    """\\def, never \\newcommand: KaTeX refuses \\newcommand{\\R} (a built-in) and of a name a host defined before
    (jupyterlab-myst's front matter), and then defines none. The definitions must render under both, and define."""
    defs = colab.macro_definitions(colab.load_macros())
    assert "\\newcommand" not in defs and "\\operatorname*" not in defs
    assert defs.count("\\def\\") == len(colab.load_macros())
    r = myst_export.render_check([f"${defs}$", "$\\GN \\R^d \\norm{x}$"], FRONT)
    assert not r["katex_shared"] and not r["myst_errors"], (r["katex_shared"][:2], r["myst_errors"][:2])
    assert [e["cell"] for e in r["katex_plain"]] == [1], "without the definitions the macros are undefined"


def test_references_show_the_books_numbers_and_titles(shared):
    """Cross-references read "Lemma N (title)" with Sphinx's numbering (one counter per kind across the book, in
    _toc.yml's order), linked to the published book; citations are author-year."""
    base = colab.book_url(CONFIG)
    m = re.match(r"https://github\.com/([^/]+)/([^/]+)", CONFIG["repository"]["url"])
    assert base == f"https://{m.group(1)}.github.io/{m.group(2)}/"
    index = shared["index"]
    lemmas = sorted((t for t in index.labels.values() if t.kind == "lemma"),
                    key=lambda t: (myst_export.toc_docs().index(t.doc), int(t.number)))
    assert [int(t.number) for t in lemmas] == sorted(int(t.number) for t in lemmas), "one counter across the book"
    vec = index.labels["notation-lem-vec"]
    conv = colab.Exporter("notebooks/10_linrep_derivations", **shared)
    md = conv.markdown("{term}`K-FAC` and {doc}`../book/notation`, {footcite:t}`zhang2025concurrence`; "
                       "by {prf:ref}`notation-lem-vec`.")
    assert f"]({base}book/glossary.html#term-K-FAC)" in md and f"]({base}book/notation.html)" in md
    assert f"[Lemma {vec.number} ({vec.title})]({base}book/notation.html#notation-lem-vec)" in md
    assert "Zhang et al. (2025)" in md and not conv.problems
    plain = colab.Exporter("notebooks/10_linrep_derivations", links=False, **shared)
    assert plain.markdown("by {prf:ref}`notation-lem-vec`") == f"by Lemma {vec.number} ({vec.title})"


def test_boxes_are_block_quotes_with_display_maths_on_one_line(shared):
    conv = colab.Exporter("notebooks/10_linrep_derivations", **shared)
    md = conv.markdown("```{prf:lemma} Title $\\GN$\n:class: status-proved\n\nSay\n\n$$\n\\GN\n= 1 % c\n$$\n```")
    assert md.splitlines()[0] == "> **Lemma (Title $H_{\\mathrm{GN}}$).** *Status: proved here.*"
    assert "> $$ H_{\\mathrm{GN}} = 1 $$" in md and "<div" not in md


@pytest.mark.parametrize("stem", ["10_linrep_derivations", "32_gn_conditioning_leaky_relu"])
def test_student_notebook_renders_in_katex_and_jupyterlab_myst(stem, shared, js):
    """A student notebook (tools/student.py, the stored hashed references reused: no kernel runs) renders with 0 raw
    TeX and 0 raw labels, its boxes as block quotes and its first cell's definitions accepted by KaTeX."""
    import nbformat
    import student

    chapter = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    specs = student.load_specs(chapter, stem)
    nb = student.student_notebook(chapter, stem, specs, student.stored_refs(student.STUDENT_DIR / f"{stem}.ipynb"))
    cells = [colab.cell_source(c) for c in nb["cells"] if c["cell_type"] == "markdown"]
    assert all(not myst_export.leftovers(c) for c in cells), [myst_export.leftovers(c) for c in cells if myst_export.leftovers(c)]
    r = assert_renders(cells, shared["index"], f"student notebook {stem}")
    assert r["blockquotes"] > 0 and r["quoted_math"] > 0


# ------------------------------------------------------------------------------------------------ the stored copies
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_colab_copy_is_up_to_date(path, shared):
    copy_path = colab.OUT_DIR / path.name
    assert copy_path.exists(), f"no Colab copy of {path.name}: run `make colab`"
    stored = json.loads(copy_path.read_text())
    ref = stored["metadata"]["curvlab"]["ref"]
    allowed = {colab.resolve_ref(CONFIG), f"v{colab.lib_version()}"}
    assert ref in allowed, f"{copy_path.name} installs curvlab @ {ref}, not one of {sorted(allowed)}: run `make colab`"
    nb, _ = colab.convert_notebook(path, ref, **shared)
    assert copy_path.read_text() == nbtool.dumps(nb), f"{copy_path.relative_to(ROOT)} is stale: run `make colab`"


def test_no_copy_without_a_chapter():
    extra = {p.name for p in colab.OUT_DIR.glob("*.ipynb")} - {p.name for p in CHAPTERS}
    assert not extra, f"copies of no chapter: {sorted(extra)} (run `make colab`)"


def test_resolve_ref_prefers_a_release_tag(monkeypatch):
    monkeypatch.delenv("CURVLAB_REF", raising=False)
    monkeypatch.setattr(colab, "release_tag", lambda: "v9.9.9")
    assert colab.resolve_ref(CONFIG) == "v9.9.9"
    monkeypatch.setattr(colab, "release_tag", lambda: "")
    assert colab.resolve_ref({"repository": {"branch": "stable"}}) == "stable"
    monkeypatch.setenv("CURVLAB_REF", "v1.0.0")
    assert colab.resolve_ref(CONFIG) == "v1.0.0"


# ------------------------------------------------------------------------------------------------ the setup cell
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_setup_cell_installs_a_ref_that_exists_and_shows_pip_errors(path):
    nb = json.loads(path.read_text())
    src = colab.cell_source(nb["cells"][colab.setup_cell_index(nb)])
    ref = re.search(r'^REF = "([^"]+)"', src, re.M)
    assert ref, f"{path.name}: the setup cell has no REF line: run `python tools/colab.py --fix-setup-cells`"
    assert ref.group(1) in {CONFIG["repository"]["branch"], f"v{colab.lib_version()}"}
    assert src == colab.expected_setup_source(nb, ref.group(1), CONFIG), (
        f"{path.name}: the setup cell's install block differs from tools/colab.py's: "
        "run `python tools/colab.py --fix-setup-cells`")
    block, _ = colab.split_setup(src)
    assert '"-q"' not in block and "check_returncode()" in block and "print(done.stderr" in block
    assert 'find_spec("google.colab")' in block and "COLAB_RELEASE_TAG" in block
    assert "google.colab\" in sys.modules" not in block, "Colab must be detected before google.colab is imported"
    # outside Colab, no suggestion of a name no package index serves: a clone's `make env`, or pip from the repository
    assert 'pip install "curvlab[' not in block and "make env" in block and "git+{REPO}@{REF}" in block


def test_extras_follow_what_the_chapter_uses():
    needs = {p.stem[:2]: colab.chapter_needs(json.loads(p.read_text()))[0] for p in CHAPTERS}
    for chapter in ("22", "31", "32"):  # scikit-learn's digits
        assert needs[chapter] == f"[{colab.EXTRA}]", chapter
    assert needs["00"] == "", "chapter 00 needs only curvlab's core (the fresh-venv test runs it so)"


def test_install_block_fetches_the_data_files_a_chapter_reads():
    nb = json.loads((ROOT / "notebooks" / "11_linrep_experiments.ipynb").read_text())
    _, files = colab.chapter_needs(nb)
    for f in files:
        assert (ROOT / "notebooks" / f).exists(), f
    if files:
        assert all(f in colab.install_block(nb, "main", CONFIG) for f in files)


# ------------------------------------------------------------------------------------------------ launch buttons
def test_colab_and_binder_buttons_open_the_copy_at_the_ref():
    """Both launch buttons open the clean copy (which the render tests above check in KaTeX and jupyterlab-myst), at
    the ref it installs curvlab from; pages without a copy keep the theme's URLs."""
    page = "notebooks/10_linrep_derivations"
    theme = "https://colab.research.google.com/github/o/r/blob/main/notebooks/10_linrep_derivations.ipynb"
    binder = "https://mybinder.org/v2/gh/o/r/main?urlpath=lab/tree/notebooks/10_linrep_derivations.ipynb"
    context = {"header_buttons": [{"type": "group", "buttons": [{"text": "Binder", "url": binder},
                                                                {"text": "Colab", "url": theme}]}]}
    app = SimpleNamespace(config=SimpleNamespace(html_theme_options={"repository_branch": "main"},
                                                 curvlab_colab_ref="v1.2.3"))
    curvlab_launch._point_buttons_at_copies(app, page, "page.html", context, None)
    buttons = context["header_buttons"][0]["buttons"]
    assert buttons[1]["url"] == ("https://colab.research.google.com/github/o/r/blob/v1.2.3/notebooks/colab/"
                                 "10_linrep_derivations.ipynb")
    assert buttons[0]["url"] == ("https://mybinder.org/v2/gh/o/r/v1.2.3?urlpath=lab/tree/notebooks/colab/"
                                 "10_linrep_derivations.ipynb")
    for url in (buttons[0]["url"], buttons[1]["url"]):  # the target exists and is a generated copy
        target = ROOT / re.search(r"(notebooks/colab/[\w.]+\.ipynb)$", url).group(1)
        assert json.loads(target.read_text())["metadata"]["curvlab"]["generator"] == "tools/colab.py"
    assert curvlab_launch.colab_url(theme, "book/notation", "main", "v1") == theme
    assert curvlab_launch.binder_url(binder, "book/notation", "main", "v1") == binder


def test_each_script_is_on_a_page_once():
    """sphinx-thebe's inline configuration script reaches the page twice under Sphinx 7.4 (registry: file name '',
    builder: None): the second copy is dropped, so the page declares THEBE_JS_URL once."""
    from sphinx.builders.html._assets import _JavaScript

    body = 'const THEBE_JS_URL = "x"'
    context = {"script_files": [_JavaScript("a.js"), _JavaScript("", body=body), _JavaScript("a.js"),
                                _JavaScript(None, body=body), _JavaScript(None, body="other")]}
    curvlab_launch._dedupe_scripts(None, "p", "page.html", context, None)
    assert [(s.filename, s.attributes.get("body")) for s in context["script_files"]] == [
        ("a.js", None), ("", body), (None, "other")]


def test_release_workflow_points_the_book_and_the_copies_at_the_tag():
    release = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    publish = (ROOT / ".github" / "workflows" / "publish.yml").read_text()
    for wf in (release, publish):
        assert re.search(r"sed -i .*branch: .*GITHUB_REF_NAME.* _config\.yml", wf), "branch: must become the tag"
    assert "notebooks/colab" in release, "release.yml must check that the copies install the tag"


# ------------------------------------------------------------------------------------------------ requirements
def test_lab_extra_has_jupyterlab_myst_and_environment_yml_agrees():
    project = tomllib.loads((ROOT / "lib" / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(r.startswith("jupyterlab-myst") for r in extras["lab"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    for req in extras["lab"]:
        assert req in pip, f"environment.yml lacks {req} of the lab extra"
    assert set(extras[colab.EXTRA]) <= set(extras["book"]), "the book extra must include what chapters need"


def test_makefile_lab_starts_on_localhost_and_as_root():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^lab: env\n\t\$\(PY\) tools/colab\.py --lab", make, re.M)
    assert re.search(r"^colab: env\n\t\$\(PY\) tools/colab\.py$", make, re.M)
    cmd = colab.lab_command(8899, "t")
    assert "--ip=127.0.0.1" in cmd and "--port=8899" in cmd
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)


def test_missing_extra_is_named(monkeypatch):
    from curvlab import _validate

    with pytest.raises(ImportError, match=r'pip install "curvlab\[notebooks\]".*curvlab\[book\]'):
        _validate._require("curvlab_no_such_module_xyz", purpose="x")


# ------------------------------------------------------------------------------------------------ a fresh venv
FRESH = ROOT / ".venv-fresh-test"
TORCH = "torch==2.13.0"


def _fresh_python(tmp_path_factory) -> Path:
    """A virtual environment without the system's packages: ``pip install torch==2.13.0`` then ``pip install ./lib``.

    Kept in .venv-fresh-test/ between runs while lib/pyproject.toml is unchanged (a changed requirement starts a new
    venv); curvlab is reinstalled from lib/ each time and the extras' packages removed, so the test sees what a
    student's ``pip install lib`` gives."""
    import hashlib

    py = FRESH / "bin" / "python"
    key = hashlib.sha256((TORCH + (ROOT / "lib" / "pyproject.toml").read_text()).encode()).hexdigest()
    stamp = FRESH / ".curvlab-key"
    cfg = FRESH / "pyvenv.cfg"  # without it the copied interpreter IS the base one, and pip would install there
    if not py.exists() or not cfg.exists() or not stamp.exists() or stamp.read_text() != key:
        venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(FRESH)
        stamp.write_text(key)
    isolated = subprocess.run([str(py), "-c", "import sys; sys.exit(sys.prefix == sys.base_prefix)"])
    assert isolated.returncode == 0, f"{FRESH} is not a virtual environment: refusing to pip install into the base Python"
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    have_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode == 0
    if not have_torch:
        index = ["--index-url", os.environ["CURVLAB_TORCH_INDEX"]] if os.environ.get("CURVLAB_TORCH_INDEX") else []
        res = subprocess.run([*pip, "--only-binary=:all:", *index, TORCH], capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot install {TORCH} into a fresh venv here: {res.stderr[-400:]}")
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "curvlab", "scikit-learn", "ipywidgets"],
                   capture_output=True)
    res = subprocess.run([*pip, str(ROOT / "lib")], capture_output=True, text=True)
    assert res.returncode == 0, f"pip install ./lib failed:\n{res.stderr[-2000:]}"
    return py


def _chapter_script(path: Path) -> str:
    """A chapter's code as one script (IPython magics and shell escapes dropped), run from notebooks/."""
    nb = json.loads(path.read_text())
    code = []
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            code.append("\n".join(ln for ln in colab.cell_source(c).splitlines()
                                  if not ln.lstrip().startswith(("%", "!"))))
    return "import matplotlib\nmatplotlib.use('Agg')\n" + "\n\n".join(code)


def test_a_chapter_runs_in_a_fresh_venv_with_only_torch_and_lib(tmp_path_factory, tmp_path):
    py = _fresh_python(tmp_path_factory)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CURVLAB_"))}
    env.update(CURVLAB_PROFILE="quick", CURVLAB_DEVICE="cpu", CURVLAB_PROGRESS="0", MPLBACKEND="Agg")
    chapter = ROOT / "notebooks" / "00_how_to_read.ipynb"
    script = tmp_path / "chapter.py"
    script.write_text(_chapter_script(chapter))
    res = subprocess.run([str(py), "-W", "error::FutureWarning:curvlab", str(script)], cwd=ROOT / "notebooks",
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{chapter.name} failed in the fresh venv:\n{res.stderr[-3000:]}"
    assert "profile=quick" in res.stdout
    # a chapter that needs scikit-learn fails with a message that names the extra
    res = subprocess.run([str(py), "-c", "import curvlab.deep_linear as dl; dl.digits(10)"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and 'pip install "curvlab[notebooks]"' in res.stderr, res.stderr[-1500:]
    res = subprocess.run([str(py), "-c", "import curvlab.meanfield as mf; mf.load_digits_data(n=10)"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and 'curvlab[notebooks]' in res.stderr, res.stderr[-1500:]


LAB_OPENED = ("notebooks/colab/00_how_to_read.ipynb", "notebooks/00_how_to_read.ipynb",
              "notebooks/student/10_linrep_derivations.ipynb")


def _git_state() -> tuple[str, dict[str, str]]:
    """`git status` and the bytes of the notebooks the lab test opens (only those: on a shared working tree other
    notebooks may be under edit meanwhile), and whether a checkpoint folder appeared in the repository."""
    import hashlib

    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored", "--", *LAB_OPENED],
                            cwd=ROOT, capture_output=True, text=True).stdout
    files = {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in LAB_OPENED}
    files["checkpoints"] = str(sorted(str(p) for p in (ROOT / "notebooks").rglob(".ipynb_checkpoints")))
    return status, files


def test_lab_browsing_never_changes_the_repository(tmp_path, monkeypatch):
    """`make lab` serves a workspace copy: start JupyterLab as `make lab` does (no browser, a loopback port), open and
    save notebooks through the Jupyter server's REST API as the front end does (GET, then PUT of the model), and
    check that the repository's notebooks/ and `git status` are unchanged and the served root holds no repository."""
    import importlib.util
    import secrets
    import socket
    import time
    import urllib.error
    import urllib.request

    pytest.importorskip("jupyterlab")
    monkeypatch.setenv("CURVLAB_LAB_DIR", str(tmp_path / "ws"))
    before = _git_state()
    ws, kept = colab.sync_lab()
    assert ws == (tmp_path / "ws").resolve() and not kept
    src = json.loads((ws / "notebooks" / "00_how_to_read.ipynb").read_text())
    assert colab.cell_source(src["cells"][0]).startswith("---\nmath:\n"), "MyST chapters get the macros' front matter"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = secrets.token_hex(8)
    cmd = colab.lab_command(port, token, ws)
    if "--no-browser" not in cmd:
        cmd.append("--no-browser")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}/api"

    def call(method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"token {token}",
                                                                           "Content-Type": "application/json"},
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=60) as res:  # noqa: S310  (loopback only)
            return json.loads(res.read() or b"{}")

    try:
        deadline = time.time() + 180
        while True:
            try:
                call("GET", "/status")
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"JupyterLab did not start: {proc.stderr.read()[-2000:] if proc.poll() is not None else 'timeout'}")
                time.sleep(1)
        root = {m["name"] for m in call("GET", "/contents")["content"]}
        assert "notebooks" in root and not root & {"lib", "tools", "_config.yml", ".git"}, root
        for name in LAB_OPENED:
            model = call("GET", f"/contents/{name}?type=notebook&content=1")
            model["content"]["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "my note",
                                              "id": "reader-note"})
            call("PUT", f"/contents/{name}", {"type": "notebook", "format": "json", "content": model["content"]})
            call("POST", f"/contents/{name}/checkpoints")
        assert "my note" in (ws / "notebooks" / "colab" / "00_how_to_read.ipynb").read_text()
        if importlib.util.find_spec("jupyterlab_rise") is not None:  # a chapter presented live (the lab extra)
            req = urllib.request.Request(f"http://127.0.0.1:{port}/rise/notebooks/colab/00_how_to_read.ipynb",
                                         headers={"Authorization": f"token {token}"})
            with urllib.request.urlopen(req, timeout=60) as res:  # noqa: S310  (loopback only)
                page = res.read().decode()
            assert res.status == 200 and '"appName": "Rise"' in page
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    after = _git_state()
    assert after == before, "browsing in `make lab` changed the repository"
    _, kept = colab.sync_lab()
    assert sorted(kept) == sorted(LAB_OPENED), "the reader's saved edits are kept"
    # a notebook that was only run (outputs, execution counts) is not an edit: the next sync refreshes it
    ran = ws / "notebooks" / "colab" / "01_curvature_primer.ipynb"
    nb = json.loads(ran.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell.update(execution_count=1, outputs=[{"output_type": "stream", "name": "stdout", "text": "ran"}])
    ran.write_text(json.dumps(nb))
    _, kept = colab.sync_lab()
    assert "notebooks/colab/01_curvature_primer.ipynb" not in kept


def test_index_takes_numbers_and_titles_from_a_built_book(tmp_path):
    """With a built book, references use its numbers (the environment's toc_fignumbers) and its section titles
    (objects.inv); without one, the sources' numbering."""
    import pickle
    import zlib

    plain = myst_export.BookIndex.build(build_dir=None)
    assert plain.source == "sources" and plain.labels["lem-how-stein"].number == "1"
    section = next(k for k, t in plain.labels.items() if t.kind == "section")
    (tmp_path / ".doctrees").mkdir()
    env = SimpleNamespace(toc_fignumbers={"notebooks/00_how_to_read": {"lemma": {"lem-how-stein": (7,)}}},
                          domaindata={"std": {"labels": {}}})
    (tmp_path / ".doctrees" / "environment.pickle").write_bytes(pickle.dumps(env))
    (tmp_path / "html").mkdir()
    body = f"{section} std:label -1 page.html#{section} A built title\n".encode()
    (tmp_path / "html" / "objects.inv").write_bytes(
        b"# Sphinx inventory version 2\n# Project: x\n# Version: 1\n# The remainder of this file is compressed "
        b"using zlib.\n" + zlib.compress(body))
    built = myst_export.BookIndex.build(build_dir=tmp_path)
    assert built.source == "built book" and built.labels["lem-how-stein"].number == "7"
    assert built.labels["lem-how-stein"].text.startswith("Lemma 7 (")
    assert built.labels[section].title == "A built title"


@pytest.mark.built
def test_sources_number_the_references_as_the_built_book_does():
    """After the book build: every theorem, exercise and labelled equation has the number Sphinx gave it (the
    environment of _build), so the copies made from the sources show the HTML book's numbers."""
    if not (myst_export.BUILD / ".doctrees" / "environment.pickle").exists():
        pytest.skip("no built book (_build/.doctrees/environment.pickle): run make book-quick first")
    plain = myst_export.BookIndex.build()
    built = myst_export.BookIndex.build(build_dir=myst_export.BUILD)
    assert built.source == "built book"
    numbered = [t for t in plain.labels.values() if t.kind != "section" and t.number]
    assert built.matched >= 0.9 * len(numbered), f"the build numbers only {built.matched} of {len(numbered)} labels"
    differ = [(label, t.number, built.labels[label].number) for label, t in plain.labels.items()
              if t.kind != "section" and t.number != built.labels[label].number]
    assert not differ, f"{len(differ)} references numbered differently from the built book, e.g. {differ[:5]}"
