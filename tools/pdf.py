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
  (``FigureCaptions``), a References list per chapter (``ReferenceLists``), proofs as text (``PlainProofs``), an
  output whose only printable form was its repr (a pandas ``Styler``, the setup cell's HTML badge) as a table or
  text (``RichOutputs``), every table within the text width, in the largest size at which each column holds its widest word
  (``TableWidths``).
* **Glyphs**: characters FreeSerif/FreeSans/FreeMono lack (✘, ᵀ, ★ ...) are set in DejaVu Sans
  (:func:`font_fallbacks`, ``newunicodechar``); after the run, :func:`handout_problems` reports object reprs,
  XeLaTeX's "Missing character" lines and overfull tables (``tests/test_pdf.py`` requires none).
* **Pages** as well as chapters: ``tools/pdf.py 00 book/deviations``.
* **A lost bibliography fails the build** (exit code 3): a bibliography file that cannot be read or a missing key
  (Sphinx's warnings), no formatted reference in the LaTeX source, or, where ``pdftotext`` is installed, no
  References section with entries in the PDF, while the chapters cite.
* **TeX.** ``tools/install_tex.sh`` installs Debian's TeX Live packages (XeLaTeX, latexmk, the fonts Sphinx uses).

The PDF is written to ``_build/pdf/curvature-lab.pdf``.
"""

from __future__ import annotations

import argparse
import functools
import html
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

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


class LatexTransform:
    """A Sphinx post-transform of the LaTeX builder: a subclass gives :meth:`apply_to` (what it does to a document)
    and ``priority`` (where it runs among Sphinx's and MyST-NB's post-transforms)."""

    priority = 3

    @classmethod
    def apply_to(cls, document) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @classmethod
    def setup(cls, app) -> None:
        from sphinx.transforms.post_transforms import SphinxPostTransform

        owner = cls

        class Transform(SphinxPostTransform):
            default_priority = owner.priority
            formats = ("latex",)

            def run(self, **kwargs) -> None:
                owner.apply_to(self.document)

        Transform.__name__ = Transform.__qualname__ = f"{cls.__name__}Transform"
        app.add_post_transform(Transform)


class FigureCaptions(LatexTransform):
    """Sphinx post-transform (LaTeX builder): keep the caption of every ``curvlab.plotting.show`` figure.

    A figure from ``plotting.show`` is one output with two representations: HTML (``<figure>`` with the image, its
    alt text and ``<figcaption>``) and PNG (the image alone). MyST-NB renders one of them per builder, and for LaTeX
    that is the PNG: the caption was lost. This transform runs just before MyST-NB's choice
    (``SelectMimeType``, priority 4) and replaces such an output by the PNG followed by the caption, as the HTML
    book shows it ("**Figure N.** caption": the book's numbering, which the prose uses).
    """

    CAPTION = re.compile(r"<figcaption>\s*<strong>(.*?)</strong>\s*(.*?)</figcaption>", re.S)

    @classmethod
    def apply_to(cls, document) -> None:
        from docutils import nodes

        caption_re = cls.CAPTION

        def is_bundle(node) -> bool:
            return isinstance(node, nodes.container) and node.get("nb_element") == "mime_bundle"

        for bundle in list(document.findall(is_bundle)):
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


class ReferenceLists(LatexTransform):
    """Sphinx post-transform (LaTeX builder): a chapter's *References* section lists its references.

    ``{footcite}`` makes each reference a footnote, and ``{footbibliography}`` the place where the HTML book lists
    those footnotes. LaTeX sets a footnote at the page of its first citation, so the handout's References sections
    were empty headings. This transform (run before Sphinx moves the footnotes) adds, after each footnote
    bibliography, a list of the same entries, numbered as the footnotes are.
    """

    @classmethod
    def apply_to(cls, document) -> None:
        from docutils import nodes

        def is_footbib(node) -> bool:
            return (isinstance(node, nodes.container) and bool(node.children)
                    and all(isinstance(c, nodes.footnote) for c in node.children))

        for box in list(document.findall(is_footbib)):
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


class PlainProofs(LatexTransform):
    """Sphinx post-transform (LaTeX builder): a proof is typeset as text ("Proof. ..."), not as an untitled box.

    sphinx-proof wraps a proof in an admonition without a title; Sphinx's LaTeX writer then opens a note box whose
    title argument swallows the first paragraph's ``\\sphinxAtStartPar``: an empty title bar above every proof.
    The proof's text already starts with "Proof.", so the box is dropped and its paragraphs kept.
    """

    @classmethod
    def apply_to(cls, document) -> None:
        from docutils import nodes

        def is_proof_box(node) -> bool:
            return (isinstance(node, nodes.admonition) and "proof" in node.get("classes", [])
                    and not any(isinstance(c, nodes.title) for c in node.children))

        for box in list(document.findall(is_proof_box)):
            plain = nodes.container("", *box.children, classes=["proof"], ids=box.get("ids", []))
            box.replace_self(plain)


#: A text/plain representation that only names an object (a pandas Styler, IPython's HTML): what printed in the PDF
#: where the rich output had no LaTeX form.
#: Not a placeholder the prose writes on purpose (``<chapter>``, ``<cache_dir>/<name>``): those have neither "object",
#: an address, nor "function".
OBJECT_REPR = re.compile(r"<(?:[\w.-]+(?: [\w.-]+)* object(?: at 0x[0-9a-fA-F]+)?|[\w.]+ at 0x[0-9a-fA-F]+"
                         r"|function [\w.<>]+?|(?:bound|built-in) (?:method|function) [^<>]+)>")


class _HTMLToBlocks(HTMLParser):
    """HTML as blocks: ("table", header rows, body rows) and ("text", paragraph); styles and scripts skipped."""

    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "details", "summary", "caption"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple] = []
        self._skip = 0
        self._text: list[str] = []
        self._table: dict | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._in_head = False

    def _flush_text(self) -> None:
        text = " ".join("".join(self._text).split())
        if text:
            self.blocks.append(("text", text))
        self._text = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("style", "script"):
            self._skip += 1
        elif tag == "table":
            self._flush_text()
            self._table = {"head": [], "body": [], "caption": ""}
        elif self._table is not None and tag == "thead":
            self._in_head = True
        elif self._table is not None and tag == "tr":
            self._row = []
        elif self._row is not None and tag in ("td", "th"):
            self._cell = []
            span = dict(attrs).get("colspan")
            self._span = int(span) if span and span.isdigit() else 1
        elif tag in self.BLOCK and self._table is None:
            self._flush_text()

    def handle_endtag(self, tag) -> None:
        if tag in ("style", "script"):
            self._skip = max(0, self._skip - 1)
        elif self._cell is not None and tag in ("td", "th"):
            self._row.append(" ".join("".join(self._cell).split()))
            self._row.extend([""] * (self._span - 1))
            self._cell = None
        elif self._row is not None and tag == "tr":
            (self._table["head"] if self._in_head else self._table["body"]).append(self._row)
            self._row = None
        elif self._table is not None and tag == "thead":
            self._in_head = False
        elif tag == "table" and self._table is not None:
            self.blocks.append(("table", self._table["head"], self._table["body"]))
            self._table = None
        elif tag in self.BLOCK and self._table is None:
            self._flush_text()

    def handle_data(self, data) -> None:
        if self._skip:
            return
        if self._cell is not None:
            self._cell.append(data)
        elif self._table is None:
            self._text.append(data)

    def close(self) -> None:
        super().close()
        self._flush_text()


def html_to_nodes(text: str) -> list:
    """docutils nodes for an HTML output: each ``<table>`` a table (the LaTeX writer escapes and sets it), the rest
    paragraphs of plain text."""
    from docutils import nodes

    parser = _HTMLToBlocks()
    parser.feed(text)
    parser.close()
    out = []
    for block in parser.blocks:
        if block[0] == "text":
            out.append(nodes.paragraph("", block[1]))
            continue
        _, head, body = block
        rows = [r for r in head + body if any(c.strip() for c in r)]
        if not rows:
            continue
        ncols = max(len(r) for r in rows)
        table = nodes.table(classes=["curvlab-rich-output"])
        group = nodes.tgroup(cols=ncols)
        table += group
        for _ in range(ncols):
            group += nodes.colspec(colwidth=1)

        def row(cells):
            return nodes.row("", *[nodes.entry("", nodes.paragraph("", c)) for c in cells + [""] * (ncols - len(cells))])

        head = [r for r in head if any(c.strip() for c in r)]
        if head:
            group += nodes.thead("", *[row(r) for r in head])
        group += nodes.tbody("", *[row(r) for r in body if any(c.strip() for c in r)])
        out.append(table)
    return out


class RichOutputs(LatexTransform):
    """Sphinx post-transform (LaTeX builder): an output whose only printable form is HTML gets a LaTeX one.

    MyST-NB prints the ``text/plain`` form of an output for LaTeX; for a pandas ``Styler`` or IPython's ``HTML`` (the
    setup cell's badges) that is ``<pandas.io.formats.style.Styler at 0x...>`` or ``<IPython.core.display.HTML
    object>``. Such a bundle (HTML, and a text/plain that only names the object or none) is replaced, before MyST-NB
    picks a form, by the HTML's tables as tables (column widths from their content: :class:`TableWidths`) and its
    text as paragraphs.
    """

    @classmethod
    def apply_to(cls, document) -> None:
        from docutils import nodes

        def is_bundle(node) -> bool:
            return isinstance(node, nodes.container) and node.get("nb_element") == "mime_bundle"

        for bundle in list(document.findall(is_bundle)):
            by_type = {child.get("mime_type"): child for child in bundle.children}
            if "text/html" not in by_type or set(by_type) & {"text/latex", "image/png", "image/pdf",
                                                               "image/jpeg", "image/svg+xml"}:
                continue
            plain = by_type.get("text/plain")
            if plain is not None and not OBJECT_REPR.fullmatch(plain.astext().strip()):
                continue  # a readable text form (a DataFrame's, a CheckTable's): MyST-NB prints it
            text = "".join(n.astext() for n in by_type["text/html"].findall(nodes.raw))
            new = html_to_nodes(text)
            if new:
                bundle.replace_self(nodes.container("", *new, classes=["curvlab-rich-output"]))
            else:
                bundle.parent.remove(bundle)


#: Where a long word in a table cell may break: after these characters (names like ``ch11::batchnorm+AMGD``).
BREAK_AFTER = re.compile(r"(?<=[_:+/=,.])(?=[^\s_:+/=,.])")
#: A word longer than this (characters) gets the break points of ``BREAK_AFTER``, unless it is a number.
BREAK_LONGER_THAN = 8
#: A number, a range or an interval of numbers (``0.000108``, ``1.48e+06,``, ``66.1–72.5``, ``[0.97,``): no letter but
#: an exponent's e, no ``_ : / =``.
NUMBER = re.compile(r"[^A-Za-z_:/=]*\d[^A-Za-z_:/=]*")
EXPONENT = re.compile(r"(?<=\d)[eE](?=[-+−]?\d)")


def break_parts(text: str) -> list[str]:
    """``text`` cut where a table cell may break inside a word: after ``_ : + / = , .`` in a word longer than
    ``BREAK_LONGER_THAN`` characters that is not a number (``kappa_r_star``, ``ch11::batchnorm+AMGD``; never
    ``0.000108``, ``1.48e+06`` or ``66.1–72.5``). Joining the parts gives ``text`` back."""
    parts, start = [], 0
    for m in re.finditer(r"\S+", text):
        word = m.group(0)
        if len(word) <= BREAK_LONGER_THAN or NUMBER.fullmatch(EXPONENT.sub("", word)):
            continue
        for cut in BREAK_AFTER.finditer(word):
            parts.append(text[start:m.start() + cut.start()])
            start = m.start() + cut.start()
    parts.append(text[start:])
    return parts


#: The handout's text width in pt: A4 (597.5 pt) less Sphinx's default 1 in margins (72.27 pt each), less a 2 %
#: allowance for what the width model below does not see (kerning, the rules of a table inside an admonition).
LINE_WIDTH_PT = (597.5 - 2 * 72.27) * 0.98
#: The sizes a table may be set in (11 pt class): LaTeX command, font size (pt), \tabcolsep (pt). The largest one at
#: which every column holds its widest unbreakable word is used.
TABLE_SIZES = (("small", 10.0, 6.0), ("footnotesize", 9.0, 4.0), ("scriptsize", 8.0, 3.0), ("tiny", 6.0, 2.0))
#: A cell wraps past this share of the line (its natural one-line width counts up to here).
CELL_CAP = 0.45


class TextWidths:
    """Advance widths of the handout's fonts (FreeSerif, FreeSans, FreeMono: fontTools over the files fontconfig
    serves), in pt at 10 pt; 0.55 em a character where a font is not found or lacks the glyph."""

    def __init__(self) -> None:
        self._fonts: dict[str, tuple[dict[int, str], Any, float] | None] = {}

    def _font(self, role: str):
        if role not in self._fonts:
            self._fonts[role] = None
            path = font_file(MAIN_FONTS[role])
            if path is not None:
                try:
                    from fontTools.ttLib import TTFont

                    font = TTFont(str(path), lazy=True)
                    self._fonts[role] = (font.getBestCmap(), font["hmtx"], float(font["head"].unitsPerEm))
                except Exception:  # noqa: BLE001 - an unreadable font file: the 0.55 em estimate
                    pass
        return self._fonts[role]

    def width(self, text: str, role: str = "main") -> float:
        font = self._font(role)
        if font is None:
            return 5.5 * len(text)
        cmap, hmtx, upem = font
        total = 0.0
        for c in text:
            glyph = cmap.get(ord(c))
            total += hmtx[glyph][0] / upem * 10.0 if glyph is not None else 5.5
        return total


#: Control sequences of inline maths that print nothing of their own (font switches, delimiters' sizes, accents).
_MATH_SILENT = {"left", "right", "big", "Big", "bigl", "bigr", "Bigl", "Bigr", "mathrm", "mathbf", "mathcal",
                "mathbb", "operatorname", "text", "textrm", "mathit", "boldsymbol", "tilde", "hat", "bar", "widehat",
                "widetilde", "overline", "displaystyle", "scriptstyle", "limits", "nolimits", "mathsf", "mathtt"}


#: Named operators: set upright, one letter each.
_MATH_WORDS = {"log", "exp", "max", "min", "sup", "inf", "det", "tr", "sin", "cos", "tan", "arg", "lim", "ker", "dim",
               "deg", "gcd", "Pr", "ln", "argmax", "argmin", "liminf", "limsup"}
#: Relations (thick spaces either side) and binary operators (medium spaces).
_MATH_RELATIONS = {"le", "ge", "leq", "geq", "approx", "in", "ne", "neq", "sim", "to", "mapsto", "equiv", "propto",
                   "subset", "subseteq", "ll", "gg", "coloneqq", "Rightarrow", "iff"}
_MATH_BINARY = {"cdot", "times", "otimes", "odot", "oplus", "pm", "mp", "circ", "setminus", "cup", "cap"}


@functools.lru_cache(maxsize=1)
def _book_macros() -> dict[str, str]:
    """The notation macros of ``book/macros.yml`` as name -> body (a macro's arguments left as ``#1``)."""
    try:
        raw = yaml.safe_load((ROOT / "book" / "macros.yml").read_text()) or {}
    except OSError:
        raw = {}
    return {k: (v[0] if isinstance(v, list) else v) for k, v in raw.items() if isinstance(v, (str, list))}


def math_width(tex: str) -> float:
    """A rough width (pt at 10 pt) of inline maths from its source, the book's macros expanded (``\\lmin`` is
    ``\\lambda_{\\min}``): 5 pt a symbol, 3.5 pt one in a sub- or superscript, a named operator (``\\max``) a
    letter a character, nothing for font switches and braces; thin and quad spaces as set."""
    macros = _book_macros()
    for _ in range(3):  # macros that use macros
        tex = re.sub(r"\\([A-Za-z]+)", lambda m: "{" + macros[m.group(1)].replace("#1", "x") + "}"
                     if m.group(1) in macros else m.group(0), tex)
    width, script = 0.0, 0
    tokens = re.findall(r"\\[A-Za-z]+|\\.|[_^]\{|[_^]|\{|\}|\S", tex)
    depth: list[bool] = []
    pending = False
    for tok in tokens:
        if tok in ("_", "^"):
            pending = True
            continue
        if tok in ("_{", "^{"):
            depth.append(True)
            script += 1
            continue
        if tok == "{":
            depth.append(False)
            continue
        if tok == "}":
            if depth and depth.pop():
                script -= 1
            continue
        name = tok[1:] if tok.startswith("\\") else None
        if name in _MATH_SILENT:
            continue
        if name in (",", ";", ":", "!"):
            width += 2.0 if name != "!" else -1.5
            continue
        if name in ("quad", "qquad"):
            width += 10.0 if name == "quad" else 20.0
            continue
        small = script or pending
        if name in ("dots", "ldots", "cdots", "sum", "prod", "int", "bigcup", "bigcap"):
            width += (8.0 if small else 12.0)  # three dots, a large operator
        elif tok in "=<>" or name in _MATH_RELATIONS:
            width += (3.5 if small else 5.0) + (0.0 if small else 5.6)  # a relation's thick spaces
        elif tok in "+-*" or name in _MATH_BINARY:
            width += (3.5 if small else 5.0) + (0.0 if small else 4.4)  # a binary operator's medium spaces
        else:
            width += (len(name) if name in _MATH_WORDS else 1) * (3.5 if small else 5.0)
        pending = False
    return max(width, 0.0)


def _cell_runs(entry, header: bool) -> list[tuple[str, str]]:
    """The text of a table cell as runs (text, kind): kind ``math`` (its source), ``mono`` (inline code), ``sans``
    (a header cell, in Sphinx's \\sphinxstyletheadfamily) or ``main``."""
    from docutils import nodes

    runs: list[tuple[str, str]] = []

    def walk(node, kind: str) -> None:
        if isinstance(node, nodes.math):
            runs.append((node.astext(), "math"))
            return
        if isinstance(node, nodes.Text):
            runs.append((str(node), kind))
            return
        if isinstance(node, nodes.raw):
            return
        if isinstance(node, nodes.literal):
            kind = "mono"
        for child in node.children:
            walk(child, kind)
        if isinstance(node, (nodes.paragraph, nodes.list_item)):
            runs.append(("", "end"))  # a paragraph ends: the next one starts a line

    walk(entry, "sans" if header else "main")
    return runs


def cell_widths(entry, header: bool, measure: TextWidths) -> tuple[float, float]:
    """(widest unbreakable piece, natural one-line width) of a table cell in pt at 10 pt. A piece ends at a space,
    at a line break, and inside a word longer than ``BREAK_LONGER_THAN`` after a ``BREAK_AFTER`` character (where
    :class:`TableWidths` lets it break); inline maths is one piece."""
    widest, line, natural = 0.0, 0.0, 0.0
    piece = 0.0
    for text, kind in _cell_runs(entry, header):
        if kind == "end":
            widest, piece = max(widest, piece), 0.0
            natural, line = max(natural, line), 0.0
            continue
        if kind == "math":
            w = math_width(text)
            piece += w
            line += w
            widest = max(widest, piece)
            continue
        for k, part in enumerate(break_parts(text)):
            if k:  # a break point inside a word
                widest, piece = max(widest, piece), 0.0
            for token in re.split(r"(\s+)", part):
                if not token:
                    continue
                if token.isspace():
                    widest, piece = max(widest, piece), 0.0
                    line += measure.width(" ", kind)
                    continue
                w = measure.width(token, kind)
                piece += w
                line += w
            widest = max(widest, piece)
    return max(widest, piece), max(natural, line)


def table_layout(columns: list[tuple[float, float]], line_width: float = LINE_WIDTH_PT
                 ) -> tuple[tuple[str, float, float], list[float], bool]:
    """Font size and column widths of a table from its columns' (widest unbreakable piece, natural width) in pt at
    10 pt: the largest of ``TABLE_SIZES`` at which every column holds its widest piece; each column gets that much,
    and the rest of the line is shared in proportion to what the column's natural width asks beyond it (a column's
    natural width counts up to ``CELL_CAP`` of the line). Returns (size, the widths given to the writer — each
    column's share of the line, padding included —, whether it fits)."""
    n = len(columns)
    for size in TABLE_SIZES:
        _, pt, sep = size
        scale = pt / 10.0
        pad = 2 * sep + 0.4
        avail = line_width - n * pad
        least = [w * scale for w, _ in columns]
        if sum(least) <= avail or size is TABLE_SIZES[-1]:
            break
    fits = sum(least) <= avail
    want = [max(lo, min(nat * scale, CELL_CAP * line_width)) for lo, (_, nat) in zip(least, columns)]
    spare = avail - sum(least)
    if not fits:
        widths = least
    elif sum(want) <= avail:  # everything on one line: the rest in proportion to the natural widths
        widths = [w + (avail - sum(want)) * w / sum(want) for w in want] if sum(want) > 0 else [avail / n] * n
    else:
        extra = sum(w - lo for w, lo in zip(want, least))
        widths = [lo + spare * (w - lo) / extra for w, lo in zip(want, least)]
    return size, [w + pad for w in widths], fits


class TableWidths(LatexTransform):
    """Sphinx post-transform (LaTeX builder): every table fits the text width.

    Sphinx's LaTeX writer sizes a table's columns to their content (tabulary) and lets a wide one run past the margin:
    the deviations table lost its Status column; a column narrower than its widest word (a pandas frame's
    ``0.585000``, a header ``lambda_max``) pushes that word into its neighbour. Each cell is measured in the
    handout's fonts (:func:`cell_widths`); the table is set in the largest size of ``TABLE_SIZES`` at which every
    column holds its widest unbreakable word, and the columns are given to the writer as ``colwidths-given``
    (p-columns ``\\X{w}{W}`` that wrap, sharing the line width: :func:`table_layout`). Long names may break after
    ``_ : + / = , .``.
    """

    priority = 20  # after MyST-NB's choice of output form (4), the ledger values (8), references (10)

    @classmethod
    def apply_to(cls, document) -> None:
        from docutils import nodes

        measure = TextWidths()
        for table in list(document.findall(nodes.table)):
            group = next(iter(table.findall(nodes.tgroup)), None)
            if group is None:
                continue
            specs = [c for c in group.children if isinstance(c, nodes.colspec)]
            columns = [(0.0, 0.0)] * len(specs)
            for part in group.children:
                if not isinstance(part, (nodes.thead, nodes.tbody)):
                    continue
                for row in part.children:
                    col = 0
                    for entry in (c for c in row.children if isinstance(c, nodes.entry)):
                        span = 1 + int(entry.get("morecols", 0))
                        if col + span <= len(columns):
                            lo, nat = cell_widths(entry, isinstance(part, nodes.thead), measure)
                            for k in range(col, col + span):  # a spanning cell asks each column for its share
                                columns[k] = (max(columns[k][0], lo / span), max(columns[k][1], nat / span))
                        col += span
            if not columns:
                continue
            (command, _, sep), widths, _ = table_layout(columns)
            for spec, width in zip(specs, widths):
                spec["colwidth"] = max(1, round(width * 10))
            for text in list(group.findall(nodes.Text)):  # long names may break after _ : + / = , .
                if isinstance(text.parent, (nodes.literal_block, nodes.math, nodes.math_block, nodes.raw)):
                    continue
                parts = break_parts(str(text))
                if len(parts) > 1:
                    pieces = []
                    for k, part in enumerate(parts):
                        pieces += ([nodes.raw("", "\\allowbreak{}", format="latex")] if k else []) + [nodes.Text(part)]
                    text.parent.replace(text, pieces)
            if "colwidths-given" not in table["classes"]:
                table["classes"].append("colwidths-given")
            parent = table.parent
            at = parent.index(table)
            parent.insert(at + 1, nodes.raw("", "\\endgroup\n", format="latex"))
            parent.insert(at, nodes.raw("", table_start(command, sep), format="latex"))


def table_start(command: str, sep: float) -> str:
    """What goes before a table: its font size, its column padding and looser spacing; the group ends after it."""
    return f"\\begingroup\\{command}\\setlength{{\\tabcolsep}}{{{sep:g}pt}}\\sloppy\n"


def setup_handout(app) -> None:
    """The handout's Sphinx hooks (called from the overlay ``conf.py``)."""
    FigureCaptions.setup(app)
    RichOutputs.setup(app)
    TableWidths.setup(app)
    ReferenceLists.setup(app)
    PlainProofs.setup(app)


# ------------------------------------------------------------------------------------------------ fonts
#: The handout's fonts (tools/install_tex.sh installs FreeFont), and the fallback for glyphs they lack (DejaVu, from
#: fonts-dejavu-core: tools/ci_packages.sh; ✘, ᵀ, ⊙ and other symbols FreeSerif does not have).
MAIN_FONTS = {"main": "FreeSerif", "sans": "FreeSans", "mono": "FreeMono"}
FALLBACK_FONT = "DejaVu Sans"


def font_file(family: str) -> Path | None:
    """The file fontconfig serves for ``family`` (None without fontconfig or when it substitutes another family)."""
    try:
        res = subprocess.run(["fc-match", "-f", "%{family}\t%{file}", family], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    fam, _, path = res.stdout.partition("\t")
    name = family.split(":", 1)[0]  # "FreeMono:style=Oblique": the family is what must match
    return Path(path) if res.returncode == 0 and name.lower() in fam.lower() and path else None


#: The styles the handout sets text in: a glyph one of them lacks is missing there ("FreeMono Oblique" has no ⊙).
FONT_STYLES = ("", ":style=Italic", ":style=Oblique", ":style=Bold", ":style=Bold Italic", ":style=Bold Oblique")


def _cmap(family: str) -> set[int]:
    from fontTools.ttLib import TTFont

    path = font_file(family)
    return set(TTFont(str(path), lazy=True).getBestCmap()) if path else set()


def font_fallbacks(tex: str) -> tuple[str, list[str]]:
    """The LaTeX source with each non-ASCII character that the main or the mono font lacks, and the fallback has, set
    in the fallback font (``newunicodechar``: text and maths); returns (source, characters still missing)."""
    chars = sorted({c for c in tex if ord(c) > 127})
    if not chars:
        return tex, []
    have = set.intersection(*(_cmap(family + style) for family in MAIN_FONTS.values() for style in FONT_STYLES
                              if font_file(family + style) is not None))
    fallback = _cmap(FALLBACK_FONT)
    lacking = [c for c in chars if ord(c) not in have and not unicodedata_combining(c)]
    mapped = [c for c in lacking if ord(c) in fallback]
    missing = [c for c in lacking if ord(c) not in fallback]
    if not mapped:
        return tex, missing
    lines = ["% Glyphs the handout's fonts lack, from the fallback font (tools/pdf.py font_fallbacks)",
             "\\usepackage{newunicodechar}",
             f"\\newfontfamily\\curvlabfallback{{{FALLBACK_FONT}}}",
             "\\newcommand{\\curvlabglyph}[1]{\\ifmmode\\text{\\curvlabfallback\\char#1}\\else{\\curvlabfallback\\char#1}\\fi}"]
    lines += [f"\\newunicodechar{{{c}}}{{\\curvlabglyph{{\"{ord(c):04X}}}}}" for c in mapped]
    block = "\n".join(lines) + "\n"
    at = tex.find("\\begin{document}")
    return (tex[:at] + block + tex[at:] if at >= 0 else tex), missing


def unicodedata_combining(c: str) -> bool:
    import unicodedata

    return unicodedata.combining(c) != 0


# ------------------------------------------------------------------------------------------------ what the PDF must not hold
def _table_lines(tex: str) -> list[tuple[int, int]]:
    """Line ranges (1-based) of the tables in a LaTeX source."""
    spans, start = [], None
    for k, line in enumerate(tex.splitlines(), 1):
        if re.search(r"\\begin\{(longtable|tabular|tabulary|tabularx)\}", line) and start is None:
            start = k
        if re.search(r"\\end\{(longtable|tabular|tabulary|tabularx)\}", line) and start is not None:
            spans.append((start, k))
            start = None
    return spans


def handout_problems(log: str, text: str, tex: str = "") -> dict[str, list[str]]:
    """What the typeset handout got wrong: an object's repr printed instead of the object, a glyph XeLaTeX could not
    find ("Missing character" in its log), a table wider than the text ("Overfull \\hbox ... in alignment") or with
    a cell's line past its column (an overfull paragraph inside a table of ``tex``, more than 1 pt)."""
    tables = _table_lines(tex)
    cells = [f"{m.group(1)}pt at lines {m.group(2)}" for m in
             re.finditer(r"Overfull \\hbox \(([\d.]+)pt too wide\) in paragraph at lines (\d+)--\d+", log)
             if float(m.group(1)) > 1.0 and any(a <= int(m.group(2)) <= b for a, b in tables)]
    return {
        "object reprs": sorted(set(m.group(0) for m in OBJECT_REPR.finditer(text))),
        "missing glyphs": sorted(set(re.findall(r"Missing character: There is no (.+?) in font", log))),
        "overfull tables": re.findall(r"Overfull \\hbox \(([\d.]+pt) too wide\) in alignment", log) + cells,
    }


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
    parser.add_argument("chapters", nargs="*", help="chapter stems or numbers, or book pages such as book/deviations "
                        "(default: the whole book)")
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
        pages = [c.removesuffix(".md") for c in args.chapters if (ROOT / f"{c.removesuffix('.md')}.md").is_file()]
        names = [c for c in args.chapters if c.removesuffix(".md") not in pages]
        chapters = [str(p.relative_to(ROOT).with_suffix("")) for p in slides.resolve_chapters(names)] if names else []
        chapters += pages  # book pages (book/deviations) after the chapters
        toc = conf_dir / "_toc.yml"
        conf_dir.mkdir(parents=True, exist_ok=True)
        # The book's front page stays the root: sphinx-jupyterbook-latex flattens the *root* document's nested
        # sections, which, with a chapter as the root, pulled every theorem's statement out of its box.
        root_doc = yaml.safe_load((ROOT / "_toc.yml").read_text())["root"]
        spec = {"format": "jb-book", "root": root_doc, "chapters": [{"file": c} for c in chapters if c != root_doc]}
        toc.write_text(yaml.safe_dump(spec, sort_keys=False))
    else:
        print(slides.execution_note([p.stem for p in slides.toc_chapters()], args.profile, args.jobs, "handout")
              .replace("executing", "outputs from the execution cache, else executing"), flush=True)
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
    docs = ([ROOT / (f"{c}.md" if c in pages else f"{c}.ipynb") for c in chapters] if args.chapters
            else [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("book/*.md")])
    problems = bibliography_problems(warnings_file.read_text(), (latex_dir / f"{TEXNAME}.tex").read_text(),
                                     sources_cite(docs))
    if problems:
        print("the handout has no bibliography:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    tex_path = latex_dir / f"{TEXNAME}.tex"
    source, missing = font_fallbacks(tex_path.read_text())
    tex_path.write_text(source)
    if missing:
        print(f"no font has these characters (they will be missing): {' '.join(missing)}", file=sys.stderr)
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
    if shutil.which("pdftotext"):
        text = subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True).stdout
        log = (latex_dir / f"{TEXNAME}.log").read_text(errors="replace")
        for what, found in handout_problems(log, text, tex_path.read_text()).items():
            if found:
                print(f"the handout has {len(found)} {what}: {found[:5]}", file=sys.stderr)
    print(f"handout: {out / pdf.name} (sphinx {t1 - t0:.0f} s, xelatex {time.time() - t1:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
