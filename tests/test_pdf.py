"""The PDF handout (``make pdf``, ``tools/pdf.py``): notation macros that XeLaTeX accepts, a bibliography, captions.

The last test builds one chapter's handout (chapter 00, the quickest that has citations, theorem blocks and a
figure) in the quick profile and reads its text back with ``pdftotext``; it and the XeLaTeX macro test skip, with
the reason, where XeLaTeX (``tools/install_tex.sh``) or poppler-utils is missing.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import pdf  # noqa: E402

CHAPTER = "00_how_to_read"
needs_xelatex = pytest.mark.skipif(shutil.which("xelatex") is None or shutil.which("latexmk") is None,
                                   reason="XeLaTeX and latexmk are not installed (tools/install_tex.sh)")
needs_pdftotext = pytest.mark.skipif(shutil.which("pdftotext") is None,
                                     reason="pdftotext is not installed (Debian package poppler-utils)")


def _macros() -> dict:
    return yaml.safe_load((ROOT / "book" / "macros.yml").read_text())


# ------------------------------------------------------------------------------------------------ preamble
def test_preamble_makes_each_macro_one_argument_and_keeps_its_class():
    pre = pdf.preamble()
    assert "\\renewcommand{\\Loss}{{\\mathcal{L}}}" in pre  # one group: \tilde\Loss, x^\Loss
    assert "\\renewcommand{\\R}{{\\mathbb{R}}}" in pre
    assert "\\renewcommand{\\EFisher}{{\\mathcal{I}}_{\\mathrm{emp}}}" in pre  # nucleus grouped, scripts outside
    assert "\\renewcommand{\\GN}{H_{\\mathrm{GN}}}" in pre  # \GN^{-1} stacks its scripts, as in MathJax
    assert "\\renewcommand{\\tr}{\\operatorname{tr}}" in pre  # an operator stays an operator
    assert "\\renewcommand{\\kron}{\\otimes}" in pre  # a binary operator stays one


@needs_xelatex
def test_every_macro_compiles_under_an_accent_and_in_a_script(tmp_path):
    """The failure of issue 16 (``\\tilde\\Loss``: "Missing { inserted"), for every macro, with unicode-math."""
    uses = []
    for name, body in _macros().items():
        if isinstance(body, list):
            args = "".join("{x}" for _ in range(int(body[1])))
            uses.append(f"$\\tilde\\{name}{args}$ $a^\\{name}{args}$ $\\{name}{args}^2$")
        elif pdf._split_scripts(body)[1]:  # H_{\mathrm{GN}}: a second script would be one in MathJax too
            power = "^{-1}" if "^" not in pdf._split_scripts(body)[1] else ""
            uses.append(f"$\\tilde\\{name}(x)$ $\\hat\\{name}$ $a^{{\\{name}}}$ $\\{name}{power}$")
        elif not body.startswith("\\operatorname") and not re.fullmatch(r"\\[A-Za-z]+", body):
            uses.append(f"$\\tilde\\{name}(x)$ $\\hat\\{name}_1$ $a^\\{name}$ $e_\\{name}$ $\\{name}^{{-1}}$")
        else:
            uses.append(f"$A \\{name} B$ $\\{name}_x$")
    (tmp_path / "m.tex").write_text(
        "\\documentclass{article}\n\\usepackage{amsmath,amssymb}\n\\usepackage{unicode-math}\n"
        + pdf.preamble() + "\\begin{document}\n" + "\n\n".join(uses) + "\n\\end{document}\n")
    run = subprocess.run(["xelatex", "-interaction=nonstopmode", "-halt-on-error", "m.tex"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stdout.splitlines() if line.startswith("!")]
    assert run.returncode == 0, f"XeLaTeX stopped: {errors[:3]}"


# ------------------------------------------------------------------------------------------------ bibliography
def test_a_lost_bibliography_fails_the_build():
    lost = "parsing bibtex file /x/_build/pdf/conf/book/references.bib... WARNING: could not open bibtex file"
    assert pdf.bibliography_problems(lost, "\\begin{footnote}", cites=True)
    assert pdf.bibliography_problems("ch.ipynb:3: WARNING: could not find bibtex key \"x\"", "", cites=False)
    assert pdf.bibliography_problems("", "no references here", cites=True)
    assert pdf.bibliography_problems("", "\\begin{footnote}[1] Zhang ...", cites=True) == []
    assert pdf.bibliography_problems("", "nothing cited", cites=False) == []


def test_overlay_configuration_resolves_the_books_paths_from_the_repository(tmp_path):
    pdf.overlay_conf(tmp_path, None, "book/intro")
    conf = (tmp_path / "conf.py").read_text()
    assert f"bibtex_bibfiles = [os.path.join({str(ROOT)!r}, p) for p in bibtex_bibfiles]" in conf
    assert "setup_handout(app)" in conf


# ------------------------------------------------------------------------------------------------ one chapter
def _chapter_facts() -> tuple[list[str], list[str]]:
    """The bibliography keys the chapter cites, and the captions of its figures (``plotting.show(caption=...)``)."""
    nb = json.loads((ROOT / "notebooks" / f"{CHAPTER}.ipynb").read_text())
    text = lambda c: c["source"] if isinstance(c["source"], str) else "".join(c["source"])  # noqa: E731
    keys, captions = [], []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for m in re.finditer(r"\{(?:foot)?cite(?::[a-z]+)?\}`([^`]+)`", text(cell)):
                keys += [k.strip() for k in m.group(1).split(",")]
        else:
            try:
                tree = ast.parse(text(cell))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.keyword) and node.arg == "caption" and isinstance(node.value, ast.Constant):
                    captions.append(node.value.value)
    return sorted(set(keys)), captions


def _words(s: str) -> str:
    return " ".join(re.sub(r"[{}\\]", "", s).split())


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    if shutil.which("xelatex") is None or shutil.which("latexmk") is None:
        pytest.skip("XeLaTeX and latexmk are not installed (tools/install_tex.sh)")
    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext is not installed (Debian package poppler-utils)")
    out = tmp_path_factory.mktemp("pdf")
    env = {**os.environ, "CURVLAB_PROFILE": "quick"}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "pdf.py"), "--profile", "quick", "--out", str(out),
                          CHAPTER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"tools/pdf.py {CHAPTER} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    path = out / f"{pdf.TEXNAME}.pdf"
    assert path.is_file() and path.stat().st_size > 10_000
    text = subprocess.run(["pdftotext", str(path), "-"], capture_output=True, text=True, check=True).stdout
    return path, text, (out / "latex" / f"{pdf.TEXNAME}.tex").read_text()


def test_chapter_handout_has_its_bibliography(handout):
    from pybtex.database import parse_file

    _, text, _ = handout
    flat = _words(text)
    keys, _ = _chapter_facts()
    assert keys, f"{CHAPTER} cites nothing: pick a chapter with citations"
    bib = parse_file(str(ROOT / "book" / "references.bib"))
    for key in keys:
        entry = bib.entries[key]
        title = _words(entry.fields["title"])[:40]
        surname = _words(str(entry.persons["author"][0].last_names[0]))
        assert title.lower() in flat.lower(), f"the reference {key} ({title!r}) is not in the PDF"
        # The References section lists it as well (not only the footnote at the first citation).
        sections = [flat[m.end():m.end() + 3000] for m in re.finditer(r"\bReferences\b", flat)]
        assert any(re.match(r"\W*\[1\]", sec) and surname in sec for sec in sections), \
            f"no References section lists {key}"
    assert "??" not in text, "an unresolved reference (??) in the PDF"
    assert not re.search(r"\b(?:as in|see|from|by)\s+[.,;)]", flat), "an empty citation in the PDF"


def test_chapter_handout_has_theorem_blocks_and_figure_captions(handout):
    _, text, tex = handout
    flat = _words(text)
    _, captions = _chapter_facts()
    assert captions, f"{CHAPTER} has no figure: pick a chapter with one"
    for i, caption in enumerate(captions, start=1):
        assert f"Figure {i}." in flat, f"Figure {i}'s caption label is missing"
        start = " ".join(_words(caption).split()[:6])
        assert start in flat, f"the caption of Figure {i} is missing ({start!r} ...)"
    assert re.search(r"\bLemma 1\b", flat), "no numbered theorem block"
    # Each theorem block holds its statement (a chapter as the LaTeX root document had them moved out of the box).
    blocks = re.findall(r"\\begin\{sphinxadmonition\}\{note\}\{((?:Lemma|Theorem|Proposition|Corollary|Definition)"
                        r"[^\n]*)\}(.*?)\\end\{sphinxadmonition\}", tex, re.S)
    assert blocks, "no theorem block in the LaTeX source"
    for title, body in blocks:
        assert len(body.strip()) > 20, f"the block {title[:60]!r} is empty in the PDF"
    # A proof is text, not a box with an empty title bar (sphinx-proof's untitled admonition).
    assert "Proof." in flat and not re.search(r"\\begin\{sphinxadmonition\}\{note\}\s*\\sphinxAtStartPar", tex)
    # Every theorem block's LaTeX label names its document, the target of every {prf:ref} (sphinx-proof's own
    # lookup wrote "None:<label>" for chapters whose title has markup, and those references printed "??").
    labels = re.findall(r"\\label\{([^}:]*):(?:lem|cor|prop|thm)-[^}]*\}", tex)
    assert labels and set(labels) == {f"notebooks/{CHAPTER}"}, f"theorem labels name {sorted(set(labels))}"
