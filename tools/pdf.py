"""Build the printable handout: ``make pdf`` (XeLaTeX, not part of ``make test``).

    python tools/pdf.py [--profile quick] [--jobs 2] [CHAPTER ...]

The handout is the book itself, through Sphinx's LaTeX builder and **XeLaTeX** (the text is full of Unicode:
★, κ, ‖, ⊗, Greek in prose), so theorem blocks, exercises, citations and cross-references come out as in the HTML
book. With chapter stems or numbers, only those chapters are built (after the book's front page, the root), which
is also the quick way to try it.

* **Notation macros.** ``book/macros.yml`` is the one source of the book's macros; the LaTeX preamble is generated
  from it (:func:`preamble`), each macro as ``\\providecommand`` + ``\\renewcommand`` so that it is defined whether
  or not a package already has it.
* **Configuration.** ``_config.yml`` stays the one source: the handout reads the ``conf.py`` that
  ``jupyter-book config sphinx`` makes from it (``tools/build_book.py``) and overrides only the LaTeX settings,
  in ``_build/pdf/conf/conf.py``.
* **Outputs** come from the book's execution cache (same key as ``make book``), so after ``make book`` nothing
  re-executes; otherwise the notebooks run first, ``--jobs`` at a time.
* **What the book keeps in print** (Sphinx post-transforms, :func:`setup_handout`): each figure's caption
  (``FigureCaptions``), a References list per chapter (``ReferenceLists``), proofs as text (``PlainProofs``).
* **A lost bibliography fails the build** (exit code 3): a bibliography file that cannot be read or a missing key
  (Sphinx's warnings), no formatted reference in the LaTeX source, or, where ``pdftotext`` is installed, no
  References section with entries in the PDF, while the chapters cite.
* **TeX.** ``tools/install_tex.sh`` installs Debian's TeX Live packages (XeLaTeX, latexmk, the fonts Sphinx uses).

The PDF is written to ``_build/pdf/curvature-lab.pdf``.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402  (conf.py generation, the execution cache, the book's environment)
import slides  # noqa: E402  (chapter selection)

OUT = ROOT / "_build" / "pdf"
TEXNAME = "curvature-lab"


# The code-cell environments sphinx-jupyterbook-latex writes; its own class (jupyterBook.cls) would define them, but it
# needs bbm.sty (Debian's 500 MB texlive-fonts-extra), so the handout uses Sphinx's manual class and defines them here.
CELL_ENVIRONMENTS = r"""
\usepackage[strict]{changepage}
\definecolor{CodeBlockInputBorderColor}{RGB}{204,204,204}
\definecolor{CodeBlockInputColor}{RGB}{247,247,247}
\definecolor{CodeBlockOutputBorderColor}{RGB}{247,247,247}
\definecolor{CodeBlockOutputColor}{RGB}{252,252,252}
\newenvironment{sphinxVerbatimInput}{\colorlet{VerbatimBorderColor}{CodeBlockInputBorderColor}%
  \colorlet{VerbatimColor}{CodeBlockInputColor}\begin{adjustwidth}{5pt}{}}{\end{adjustwidth}}
\newenvironment{sphinxVerbatimOutput}{\colorlet{VerbatimBorderColor}{CodeBlockOutputBorderColor}%
  \colorlet{VerbatimColor}{CodeBlockOutputColor}\begin{adjustwidth}{20pt}{}}{\end{adjustwidth}}
"""


def _split_scripts(body: str) -> tuple[str, str]:
    """``body`` as (nucleus, scripts): the scripts start at the first sub- or superscript outside braces."""
    depth = 0
    for i, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if depth == 0 and ch in "_^":
            return body[:i], body[i:]
    return body, ""


def _one_token(tex: str) -> bool:
    return len(tex) == 1 or re.fullmatch(r"\\[A-Za-z]+", tex) is not None


def _grouped(body: str) -> str:
    r"""``body`` made safe as an accent's or a script's argument, typeset as MathJax typesets the macro.

    With ``unicode-math`` (which the XeLaTeX handout loads) an accent or a script takes *one* token or group, and
    ``\mathcal``, ``\mathbb``, ``\mathrm`` or ``\left`` expand to more than one: ``	ilde\Loss`` with ``\Loss``
    defined as ``\mathcal{L}`` stops with "Missing { inserted", and so would ``x^\R`` or ``\hat
orm{x}``. So a
    body is wrapped in braces, one group, except where a group would typeset differently from the HTML book
    (MathJax substitutes a macro's text):

    * operators (``\operatorname``: ``	r A`` keeps its thin space, ``rgmin_x`` its limits) and a single control
      sequence (``\otimes`` stays a binary operator; one token is what an accent takes anyway) stay as they are;
    * a body with a sub- or superscript outside braces keeps its scripts outside, so that ``\GN^{-1}`` stacks
      them as ``H_{\mathrm{GN}}^{-1}`` does; only its nucleus is grouped when it is more than one token
      (``\EFisher`` = ``{\mathcal{I}}_{\mathrm{emp}}``), so ``	ilde\EFisher`` puts the tilde on the nucleus.
    """
    b = body.strip()
    if b.startswith("\\operatorname") or _one_token(b):
        return b
    nucleus, scripts = _split_scripts(b)
    if scripts:
        return (nucleus if _one_token(nucleus) else "{" + nucleus + "}") + scripts
    return "{" + b + "}"


def preamble(path: Path = ROOT / "book" / "macros.yml") -> str:
    """LaTeX definitions of the notation macros of ``book/macros.yml`` (MathJax format: body, or [body, nargs])."""
    macros = yaml.safe_load(path.read_text()) or {}
    lines = ["% Notation macros, generated from book/macros.yml by tools/pdf.py: edit macros.yml, not this."]
    for name, body in macros.items():
        if isinstance(body, list):
            tex, nargs = _grouped(body[0]), int(body[1])
            lines.append(f"\\providecommand{{\\{name}}}[{nargs}]{{}}\\renewcommand{{\\{name}}}[{nargs}]{{{tex}}}")
        else:
            lines.append(f"\\providecommand{{\\{name}}}{{}}\\renewcommand{{\\{name}}}{{{_grouped(body)}}}")
    return "\n".join(lines) + "\n"


class FigureCaptions:
    """Sphinx post-transform (LaTeX builder): keep the caption of every ``curvlab.plotting.show`` figure.

    A figure from ``plotting.show`` is one output with two representations: HTML (``<figure>`` with the image, its
    alt text and ``<figcaption>``) and PNG (the image alone). MyST-NB renders one of them per builder, and for LaTeX
    that is the PNG: the caption was lost. This transform runs just before MyST-NB's choice
    (``SelectMimeType``, priority 4) and replaces such an output by the PNG followed by the caption, as the HTML
    book shows it ("**Figure N.** caption": the book's numbering, which the prose uses).
    """

    CAPTION = re.compile(r"<figcaption>\s*<strong>(.*?)</strong>\s*(.*?)</figcaption>", re.S)

    @classmethod
    def setup(cls, app) -> None:
        from docutils import nodes
        from sphinx.transforms.post_transforms import SphinxPostTransform

        caption_re = cls.CAPTION

        class Transform(SphinxPostTransform):
            default_priority = 3
            formats = ("latex",)

            def run(self, **kwargs) -> None:
                def is_bundle(node) -> bool:
                    return isinstance(node, nodes.container) and node.get("nb_element") == "mime_bundle"

                for bundle in list(self.document.findall(is_bundle)):
                    by_type = {child.get("mime_type"): child for child in bundle.children}
                    html_part, png_part = by_type.get("text/html"), by_type.get("image/png")
                    if html_part is None or png_part is None:
                        continue
                    text = "".join(n.astext() for n in html_part.findall(nodes.raw))
                    m = caption_re.search(text) if 'class="curvlab-figure"' in text else None
                    if m is None:
                        continue
                    number, caption = (html.unescape(re.sub(r"<[^>]+>", "", g)).strip() for g in m.groups())
                    para = nodes.paragraph("", "", nodes.strong(number, number), nodes.Text(" " + caption))
                    box = nodes.container("", *[c.deepcopy() for c in png_part.children], para,
                                          classes=["curvlab-figure"])
                    bundle.replace_self(box)

        app.add_post_transform(Transform)


class ReferenceLists:
    """Sphinx post-transform (LaTeX builder): a chapter's *References* section lists its references.

    ``{footcite}`` makes each reference a footnote, and ``{footbibliography}`` the place where the HTML book lists
    those footnotes. LaTeX sets a footnote at the page of its first citation, so the handout's References sections
    were empty headings. This transform (run before Sphinx moves the footnotes) adds, after each footnote
    bibliography, a list of the same entries, numbered as the footnotes are.
    """

    @classmethod
    def setup(cls, app) -> None:
        from docutils import nodes
        from sphinx.transforms.post_transforms import SphinxPostTransform

        class Transform(SphinxPostTransform):
            default_priority = 3
            formats = ("latex",)

            def run(self, **kwargs) -> None:
                def is_footbib(node) -> bool:
                    return (isinstance(node, nodes.container) and bool(node.children)
                            and all(isinstance(c, nodes.footnote) for c in node.children))

                for box in list(self.document.findall(is_footbib)):
                    items = nodes.bullet_list(classes=["curvlab-references"])
                    for note in box.children:
                        label = next((c.astext() for c in note.children if isinstance(c, nodes.label)), "")
                        para = nodes.paragraph("", "")
                        if label:
                            para += nodes.Text(f"[{label}] ")
                        for child in note.children:
                            if isinstance(child, nodes.paragraph):
                                for inner in child.children:
                                    para += inner.deepcopy()
                        items += nodes.list_item("", para)
                    box.parent.insert(box.parent.index(box) + 1, items)

        app.add_post_transform(Transform)


class PlainProofs:
    """Sphinx post-transform (LaTeX builder): a proof is typeset as text ("Proof. ..."), not as an untitled box.

    sphinx-proof wraps a proof in an admonition without a title; Sphinx's LaTeX writer then opens a note box whose
    title argument swallows the first paragraph's ``\\sphinxAtStartPar``: an empty title bar above every proof.
    The proof's text already starts with "Proof.", so the box is dropped and its paragraphs kept.
    """

    @classmethod
    def setup(cls, app) -> None:
        from docutils import nodes
        from sphinx.transforms.post_transforms import SphinxPostTransform

        class Transform(SphinxPostTransform):
            default_priority = 3
            formats = ("latex",)

            def run(self, **kwargs) -> None:
                def is_proof_box(node) -> bool:
                    return (isinstance(node, nodes.admonition) and "proof" in node.get("classes", [])
                            and not any(isinstance(c, nodes.title) for c in node.children))

                for box in list(self.document.findall(is_proof_box)):
                    plain = nodes.container("", *box.children, classes=["proof"], ids=box.get("ids", []))
                    box.replace_self(plain)

        app.add_post_transform(Transform)


def setup_handout(app) -> None:
    """The handout's Sphinx hooks (called from the overlay ``conf.py``)."""
    FigureCaptions.setup(app)
    ReferenceLists.setup(app)
    PlainProofs.setup(app)


def overlay_conf(conf_dir: Path, toc: Path | None, root_doc: str) -> None:
    """A conf.py that runs the book's generated conf.py, then sets the LaTeX (XeLaTeX) options.

    Sphinx resolves relative paths in the configuration against the folder of ``conf.py``, here ``conf_dir``: the
    book's relative paths (``html_static_path``, ``bibtex_bibfiles``) are made absolute, or they point into
    ``_build/pdf/conf/`` (the bibliography was lost that way: "could not open bibtex file").
    """
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "preamble.tex").write_text(CELL_ENVIRONMENTS + preamble())
    (conf_dir / "conf.py").write_text(
        f'''# Generated by tools/pdf.py: the book's conf.py, then the handout's LaTeX settings.
import os, sys
__file__ = {str(ROOT / "conf.py")!r}
exec(compile(open(__file__).read(), __file__, "exec"))
external_toc_path = {str(toc or ROOT / "_toc.yml")!r}
html_static_path = [os.path.join({str(ROOT)!r}, p) for p in html_static_path]
bibtex_bibfiles = [os.path.join({str(ROOT)!r}, p) for p in bibtex_bibfiles]
latex_engine = "xelatex"
latex_use_xindy = False
latex_elements = {{
    "papersize": "a4paper",
    "pointsize": "11pt",
    "preamble": open({str(conf_dir / "preamble.tex")!r}).read(),
    "fontpkg": r"\\setmainfont{{FreeSerif}}\\setsansfont{{FreeSans}}\\setmonofont{{FreeMono}}",
}}
latex_documents = [({root_doc!r}, "{TEXNAME}.tex", project if "project" in dir() else "Curvature Lab", author, "manual")]

sys.path.insert(0, {str(ROOT / "tools")!r})
import pdf as _handout


def setup(app):
    _handout.setup_handout(app)
'''
    )


#: Sphinx warnings that mean the handout lost its bibliography: the build fails on them.
BIB_WARNINGS = re.compile(r"could not open bibtex file|could not find bibtex key|bibtex.*(?:error|not found)", re.I)


CITE = re.compile(r"\{(?:foot)?cite(?::[a-z]+)?\}`")


def bibliography_problems(warnings: str, tex: str, cites: bool) -> list[str]:
    """Why the handout's bibliography is missing, from Sphinx's warnings and the LaTeX source (empty: it is there).

    Every citation key the chapters use must be found, and when the sources cite anything (``cites``) the LaTeX
    source must hold formatted references (sphinxcontrib-bibtex writes ``footcite`` references as footnotes,
    ``cite`` ones as a bibliography).
    """
    problems = sorted({line.strip()[:300] for line in warnings.splitlines() if BIB_WARNINGS.search(line)})
    if cites and "\\begin{footnote}" not in tex and "\\begin{sphinxthebibliography}" not in tex:
        problems.append("the sources cite references, but the LaTeX source has no footnote or bibliography entry")
    return problems


def sources_cite(docs: list[Path]) -> bool:
    return any(CITE.search(p.read_text()) for p in docs if p.exists())
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", help="chapter stems or numbers (default: the whole book)")
    parser.add_argument("--profile", default=os.environ.get("CURVLAB_PROFILE", "standard"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if shutil.which("xelatex") is None or shutil.which("latexmk") is None:
        print("make pdf needs XeLaTeX and latexmk: run `sudo tools/install_tex.sh` (Debian/Ubuntu) first", file=sys.stderr)
        return 2
    t0 = time.time()
    build_book.generate_conf()
    os.environ["CURVLAB_PROFILE"] = args.profile
    os.environ.update(build_book.curvlab_book.build_environment(args.profile))
    conf_dir = out / "conf"
    toc = None
    if args.chapters:
        chapters = [str(p.relative_to(ROOT).with_suffix("")) for p in slides.resolve_chapters(args.chapters)]
        toc = conf_dir / "_toc.yml"
        conf_dir.mkdir(parents=True, exist_ok=True)
        # The book's front page stays the root: sphinx-jupyterbook-latex flattens the *root* document's nested
        # sections, which, with a chapter as the root, pulled every theorem's statement out of its box.
        root_doc = yaml.safe_load((ROOT / "_toc.yml").read_text())["root"]
        spec = {"format": "jb-book", "root": root_doc, "chapters": [{"file": c} for c in chapters if c != root_doc]}
        toc.write_text(yaml.safe_dump(spec, sort_keys=False))
    else:
        build_book.pre_execute(args.jobs, False, args.timeout)  # fill the execution cache, --jobs at a time
        root_doc = yaml.safe_load((ROOT / "_toc.yml").read_text())["root"]
    overlay_conf(conf_dir, toc, root_doc)
    latex_dir = out / "latex"
    warnings_file = out / "sphinx-warnings.txt"
    cmd = [sys.executable, "-m", "sphinx", "-b", "latex", "-c", str(conf_dir), "-d", str(out / ".doctrees"),
           "-w", str(warnings_file), str(ROOT), str(latex_dir)]
    print("+ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc:
        return rc
    docs = ([ROOT / f"{c}.ipynb" for c in chapters] if args.chapters
            else [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("book/*.md")])
    problems = bibliography_problems(warnings_file.read_text(), (latex_dir / f"{TEXNAME}.tex").read_text(),
                                     sources_cite(docs))
    if problems:
        print("the handout has no bibliography:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    t1 = time.time()
    tex = ["latexmk", "-xelatex", "-interaction=nonstopmode", "-halt-on-error", "-file-line-error", f"{TEXNAME}.tex"]
    print("+ " + " ".join(tex), f"(in {latex_dir})", flush=True)
    with open(out / "xelatex.log", "w") as log:
        rc = subprocess.run(tex, cwd=latex_dir, stdout=log, stderr=subprocess.STDOUT).returncode
    pdf = latex_dir / f"{TEXNAME}.pdf"
    if rc or not pdf.exists():
        print(f"XeLaTeX failed (exit code {rc}): see {out / 'xelatex.log'}", file=sys.stderr)
        return rc or 1
    if shutil.which("pdftotext") and sources_cite(docs):  # the typeset PDF itself lists references
        text = subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True).stdout
        if not re.search(r"\bReferences\b\W*\[1\]\s*\S", text):
            print(f"the handout has no bibliography: no References section with entries in {pdf}", file=sys.stderr)
            return 3
    shutil.copy2(pdf, out / pdf.name)
    print(f"handout: {out / pdf.name} (sphinx {t1 - t0:.0f} s, xelatex {time.time() - t1:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
