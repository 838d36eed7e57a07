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
import nbtool  # noqa: E402

CHAPTERS = colab.chapters()
CONFIG = colab.load_config()


@pytest.fixture(scope="module")
def shared():
    return {"index": colab.BookIndex.build(), "bib": colab.Bibliography(), "config": CONFIG}


# ------------------------------------------------------------------------------------------------ the conversion
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_converts_without_leftover_myst_or_undefined_macro(path, shared):
    nb, problems = colab.convert_notebook(path, "main", **shared)
    assert not problems, f"{path.name}: MyST without a conversion in tools/colab.py: {problems}"
    left = colab.leftovers(nb)
    assert not left, f"{path.name}: left in the Colab copy: {left[:10]}"


def test_leftover_detector_catches_myst_and_unknown_macros():
    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}  # noqa: E731
    nb = {"cells": [md("$\\newcommand{\\GN}{H}$"), md("see {term}`K-FAC`"), md("```{prf:lemma} x\n:label: a\n```"),
                    md("(sec-x)=\n# X"), md("$\\GN x$ and $\\foo$"), md("$$ a $$ (eq-a)"),
                    md("`{term}` in code and ``{doc}`x` `` stay")]}
    found = "\n".join(colab.leftovers(nb))
    for what in ("a MyST role", "a directive fence", "a (label)= target", "a directive option", "\\GN (a book macro",
                 "\\foo (unknown", "an equation label"):
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


def test_macro_definitions_accepted_by_katex_and_mathjax():
    defs = colab.macro_definitions(colab.load_macros())
    assert "\\operatorname*" not in defs, "old KaTeX builds reject \\operatorname*"
    for name in colab.KATEX_BUILTIN & set(colab.load_macros()):
        assert f"\\renewcommand{{\\{name}}}" in defs, f"KaTeX refuses \\newcommand{{\\{name}}}: it has \\{name}"
    assert defs.count("command{") == len(colab.load_macros())


def test_roles_become_links_to_the_published_book(shared):
    base = colab.book_url(CONFIG)
    m = re.match(r"https://github\.com/([^/]+)/([^/]+)", CONFIG["repository"]["url"])
    assert base == f"https://{m.group(1)}.github.io/{m.group(2)}/"
    conv = colab.Converter("notebooks/10_linrep_derivations", shared["index"], shared["bib"], colab.load_macros(),
                           CONFIG, "main")
    md = conv.markdown("{term}`K-FAC` and {doc}`../book/notation`, {footcite:t}`zhang2025concurrence`.")
    assert f"]({base}book/glossary.html#term-K-FAC)" in md and f"]({base}book/notation.html)" in md
    assert "Zhang et al. (2025)" in md and not conv.problems


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
def test_colab_button_opens_the_copy_at_the_ref():
    page = "notebooks/10_linrep_derivations"
    theme = "https://colab.research.google.com/github/o/r/blob/main/notebooks/10_linrep_derivations.ipynb"
    context = {"header_buttons": [{"type": "group", "buttons": [
        {"text": "Binder", "url": "https://mybinder.org/v2/gh/o/r/main?urlpath=lab/tree/notebooks/x.ipynb"},
        {"text": "Colab", "url": theme}]}]}
    app = SimpleNamespace(config=SimpleNamespace(html_theme_options={"repository_branch": "main"},
                                                 curvlab_colab_ref="v1.2.3"))
    curvlab_launch._point_colab_at_copies(app, page, "page.html", context, None)
    buttons = context["header_buttons"][0]["buttons"]
    assert buttons[1]["url"] == ("https://colab.research.google.com/github/o/r/blob/v1.2.3/notebooks/colab/"
                                 "10_linrep_derivations.ipynb")
    assert buttons[0]["url"].endswith("notebooks/x.ipynb"), "Binder keeps the MyST source (jupyterlab-myst)"
    assert curvlab_launch.colab_url(theme, "book/notation", "main", "v1") == theme


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


def test_lab_serves_chapters_with_the_macros_and_never_saves_them(tmp_path):
    import asyncio

    pytest.importorskip("jupyter_server")
    (tmp_path / "notebooks").mkdir()
    src = ROOT / "notebooks" / "00_how_to_read.ipynb"
    (tmp_path / "notebooks" / src.name).write_text(src.read_text())
    manager = colab.lab_contents_manager()(root_dir=str(tmp_path))
    model = asyncio.run(manager.get(f"/notebooks/{src.name}", content=True, type="notebook"))
    first = model["content"].cells[0]
    assert first.source.startswith("---\nmath:\n") and "\\GN: H_{\\mathrm{GN}}" in first.source
    asyncio.run(manager.save({"type": "notebook", "format": "json", "content": model["content"]},
                             f"/notebooks/{src.name}"))
    saved = json.loads((tmp_path / "notebooks" / src.name).read_text())
    assert [colab.cell_source(c) for c in saved["cells"]] == [colab.cell_source(c) for c in json.loads(src.read_text())["cells"]]
    assert "numbering" in colab.lab_frontmatter(numbered=False) and "numbering" not in first.source
