"""One MyST -> notebook-Markdown export layer, shared by every copy of a chapter made outside the book.

The chapters (``notebooks/NN_*.ipynb``) are MyST: roles (``{term}``, ``{doc}``, ``{prf:ref}``, ``{footcite:t}``, ...),
directives (``prf:theorem`` fences, exercises, gated solutions, ``literalinclude``) and the book's macros
(``book/macros.yml``) are resolved by Jupyter Book. Every copy made for another reader goes through this module:

* ``tools/colab.py``   the clean copies Colab, JupyterLab and Binder open (``notebooks/colab/``),
* ``tools/student.py`` the student notebooks (``notebooks/student/``: solutions left out),
* ``tools/slides.py``  the reveal.js decks (boxes as HTML blocks the layout measures).

What it does, once for all of them:

* **Parsing** with the parser the book itself uses: markdown-it-py with the MyST plugins, as ``myst_parser``'s
  ``create_md_parser`` builds it from the extensions of ``_config.yml``. Directives, ``(label)=`` targets,
  ``%`` comments and labelled equations are the parser's tokens; roles and maths in a run of text are converted
  there and checked by the tests (:func:`leftovers` finds any role, fence, target or option left).
* **Numbers and titles** of the targets (``Lemma 7 (Stein's lemma)``, equation ``(12)``, a section's title) from the
  sources, numbered as Sphinx numbers them here: one counter per kind (``lemma``, ``exercise``, labelled equations
  ...) across the whole book in ``_toc.yml``'s order (the book's toc is not ``numbered``, so Sphinx's figure numbers
  carry no section prefix); ``BookIndex.build(BUILD)`` reads them from the built book instead
  (``_build/html/objects.inv`` for titles, ``_build/.doctrees/environment.pickle`` for the numbers Sphinx assigned),
  and a test after the book build checks that both agree, so the generated copies, made from the sources, carry the
  built book's numbers.
* **Maths** that renders in KaTeX (Colab, jupyterlab-myst, VS Code) and MathJax alike: the book's macros are
  *expanded* in every formula, so a formula never depends on a definition elsewhere; the definitions a copy carries
  for the reader's own cells are ``\\def``s (:func:`macro_definitions`), which KaTeX accepts even where the command
  exists (``\\R``, ``\\argmin`` are KaTeX built-ins: ``\\newcommand`` of them is an error that drops every definition)
  and where a host injected the same names before (jupyterlab-myst's front matter).
* **Boxes**: a theorem, proof, exercise or admonition is a Markdown block quote headed "**Lemma 7 (title).** *Status:
  proved here.*" (``boxes="quote"``): plain CommonMark, so every formula inside renders (an HTML ``<div>`` hides its
  Markdown from jupyterlab-myst and Colab). A display equation inside a quote is written on one line, ``$$ ... $$``,
  so no ``>`` reaches the TeX. The slides ask for ``boxes="html"`` (``<div class="curvlab-box ...">``, which their
  layout measures; nbconvert renders Markdown inside).
* **Cross-references** as text "Lemma 7 (title)", "(12)", a section's title, linked to the published book (GitHub
  Pages of ``repository.url``) when ``links=True``; **citations** author–year with the chapter's reference list.
* **Solutions**: shown (``solutions="show"``) or left out, text and code (``"hide"``; :attr:`Exporter.in_solution`
  tells the caller when a code cell belongs to a gated solution).

Checks of the output (:func:`leftovers`, :func:`raw_labels`, :func:`formulas`) are used by the tests, which also render
every formula in KaTeX and parse every cell with jupyterlab-myst's own MyST parser (``tools/js/``).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import subprocess
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "_build"
JS_DIR = ROOT / "tools" / "js"  # the render checks' npm packages (KaTeX, jupyterlab-myst's MyST parser)

STATUS = {"status-proved": "proved here", "status-checked": "checked here", "status-stated": "stated from a paper"}
PROOF_TYPES = ("axiom", "theorem", "lemma", "algorithm", "definition", "remark", "conjecture", "corollary",
               "criterion", "example", "property", "observation", "proposition", "assumption", "notation")
ADMONITIONS = ("note", "tip", "hint", "important", "warning", "caution", "attention", "danger", "error", "seealso",
               "admonition", "dropdown", "margin", "sidebar", "topic", "epigraph", "card")
DROPPED = ("toctree", "tableofcontents", "bibliography", "curvlab-ledger", "curvlab-status", "only", "raw",
           "eval-rst", "include")
PY_ROLES = ("func", "class", "meth", "mod", "attr", "obj", "data", "exc", "py:func", "py:class", "py:meth",
            "py:mod", "py:attr", "py:obj", "py:data", "py:exc")
CITE_ROLES = ("footcite", "footcite:p", "footcite:t", "cite", "cite:p", "cite:t", "cite:ps", "cite:ts")

ROLE_RE = r"\{([A-Za-z][\w:+-]*)\}`([^`]*)`"
INLINE = re.compile(
    ROLE_RE  # 1, 2: a role
    + r"|(`+)(?:.+?)\3"  # 3: a code span (roles inside it are examples, left alone)
    + r"|\$\$(.+?)\$\$(?:[ \t]*\(([\w:.-]+)\))?"  # 4, 5: display maths, optionally labelled
    + r"|(?<![\\$])\$(?!\s)((?:\\\$|[^$])+?)(?<![\s\\])\$(?!\d)",  # 6: inline maths
    re.S,
)
OPTION = re.compile(r"^\s*:([A-Za-z][\w-]*):[ \t]*(.*?)\s*$")


# ------------------------------------------------------------------------------------------------ configuration
def load_config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def repo_url(config: dict[str, Any] | None = None) -> str:
    return (config or load_config())["repository"]["url"].rstrip("/")


def book_url(config: dict[str, Any] | None = None) -> str:
    """The published book: GitHub Pages of the repository, ``https://<org>.github.io/<repo>/``."""
    m = re.match(r"https?://github\.com/([^/]+)/([^/]+?)(?:\.git)?$", repo_url(config))
    if not m:
        raise ValueError(f"repository.url in _config.yml must be a GitHub repository, got {repo_url(config)!r}")
    return f"https://{m.group(1).lower()}.github.io/{m.group(2)}/"


def cell_source(cell: dict[str, Any]) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def toc_docs() -> list[str]:
    """The book's documents in ``_toc.yml``'s order, root first (the order Sphinx numbers them in)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    docs = [toc["root"]]
    for part in toc.get("parts", []):
        docs += [c["file"] for c in part.get("chapters", [])]
    return docs


# ------------------------------------------------------------------------------------------------ the parser
@lru_cache(maxsize=1)
def md_parser():
    """markdown-it-py with the MyST plugins, configured like the book (``parse.myst_enable_extensions``)."""
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser

    exts = set(load_config().get("parse", {}).get("myst_enable_extensions", [])) - {"linkify"}  # linkify-it: optional
    return create_md_parser(MdParserConfig(enable_extensions=exts), RendererHTML)


def directive_name(token) -> str | None:
    """``prf:lemma`` for a fence or colon fence ``{prf:lemma}``; None for a plain code block."""
    if token.type not in ("fence", "colon_fence"):
        return None
    m = re.match(r"^\{([A-Za-z][\w:-]*)\}", token.info.strip())
    return m.group(1) if m else None


def split_options(body: str) -> tuple[dict[str, str], list[str]]:
    """A directive body as (options, content lines): ``:key: value`` lines or a ``---`` YAML block first."""
    lines = body.splitlines()
    options: dict[str, str] = {}
    if lines and lines[0].strip() == "---":
        end = next((k for k in range(1, len(lines)) if lines[k].strip() == "---"), None)
        if end is not None:
            options = {str(k): str(v) for k, v in (yaml.safe_load("\n".join(lines[1:end])) or {}).items()}
            lines = lines[end + 1:]
    while lines and OPTION.match(lines[0]):
        o = OPTION.match(lines[0])
        options[o.group(1)] = o.group(2)
        lines = lines[1:]
    while lines and not lines[0].strip():
        lines = lines[1:]
    return options, lines


@dataclass
class Directive:
    name: str
    arg: str
    options: dict[str, str]
    body: list[str]


def iter_directives(text: str) -> Iterator[Directive | tuple[str, Any]]:
    """Every directive of a MyST text in document order, nested ones after their parent; also ``("target", label,
    next heading)`` and ``("equation", label)`` items, as the parser finds them."""
    tokens = md_parser().parse(text)
    for k, t in enumerate(tokens):
        name = directive_name(t)
        if name:
            options, body = split_options(t.content)
            yield Directive(name, t.info.strip()[len(name) + 2:].strip(), options, body)
            if name not in ("code", "code-block", "code-cell", "literalinclude", "glossary", "math"):
                yield from iter_directives("\n".join(body))
        elif t.type == "myst_target":
            nxt = next((j for j in range(k + 1, len(tokens)) if tokens[j].map
                        and tokens[j].type not in ("myst_target", "myst_line_comment")), None)
            is_heading = nxt is not None and tokens[nxt].type == "heading_open"
            yield ("target", t.content.strip(), tokens[nxt + 1].content if is_heading else None)
        elif t.type == "math_block_label":
            yield ("equation", t.info.strip())


# ------------------------------------------------------------------------------------------------ macros
def load_macros() -> dict[str, tuple[str, int]]:
    """``book/macros.yml`` as ``{name: (body, number of arguments)}``."""
    raw = yaml.safe_load((ROOT / "book" / "macros.yml").read_text()) or {}
    out = {}
    for name, value in raw.items():
        body, nargs = (value[0], int(value[1])) if isinstance(value, list) else (str(value), 0)
        out[str(name)] = (body, nargs)
    return out


#: Commands KaTeX defines itself, so that ``\newcommand`` of them is an error there ("use \renewcommand");
#: MathJax does not have them. Checked with KaTeX 0.16.
KATEX_BUILTIN = frozenset({"R", "argmin", "argmax", "C", "N", "Z", "Q", "cal", "bold", "Complex", "Reals", "natnums"})


def _balanced_end(s: str, open_pos: int) -> int:
    """Index just after the brace group that opens at ``open_pos``."""
    depth = 0
    i = open_pos
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(s)


#: Commands that take an argument: after ``_`` or ``^`` MathJax reads ``x_\tilde w`` as ``x_{\tilde w}``, KaTeX stops
#: ("Got function '\tilde' with no arguments as subscript").
SCRIPT_ARG_TAKERS = ("tilde", "widetilde", "hat", "widehat", "bar", "overline", "underline", "vec", "dot", "ddot",
                     "check", "breve", "acute", "grave", "mathring", "boldsymbol", "mathbf", "mathrm", "mathcal",
                     "mathbb", "mathsf", "mathit", "sqrt", "operatorname", "text")


def _group_script_arguments(tex: str) -> str:
    r"""``_\tilde w`` -> ``_{\tilde w}``, ``^\mathrm{T}`` -> ``^{\mathrm{T}}``: a script whose token takes an argument
    gets braces around both, as MathJax reads it."""
    pattern = re.compile(r"([_^])(\s*)\\(" + "|".join(SCRIPT_ARG_TAKERS) + r")(?![A-Za-z])")
    out, i = [], 0
    for m in pattern.finditer(tex):
        if m.start() < i:
            continue
        _arg, end = _read_arg(tex, m.end())
        out.append(tex[i:m.start()] + m.group(1) + "{" + tex[m.end(2):end].strip() + "}")
        i = end
    out.append(tex[i:])
    return "".join(out)


def katex_safe(tex: str) -> str:
    r"""What KaTeX reads as MathJax does: ``\operatorname*{X}`` as ``\mathop{\mathrm{X}}`` (the same limits placement;
    old KaTeX builds reject the star), a script's argument-taking token grouped (:func:`_group_script_arguments`)."""
    tex = _group_script_arguments(tex)
    out, i = [], 0
    for m in re.finditer(r"\\operatorname\*\s*\{", tex):
        if m.start() < i:
            continue
        end = _balanced_end(tex, m.end() - 1)
        out.append(tex[i:m.start()] + r"\mathop{\mathrm{" + tex[m.end():end] + "}")
        i = end
    out.append(tex[i:])
    return "".join(out)


def macro_definitions(macros: dict[str, tuple[str, int]]) -> str:
    r"""The book's macros as ``\def``s, one formula's worth: KaTeX accepts a ``\def`` of a command it has (``\R``) or
    one defined before (a host's front matter, a second run of the cell), MathJax accepts it as well; both read
    ``#1`` parameters."""
    parts = []
    for name, (body, nargs) in macros.items():
        params = "".join(f"#{k}" for k in range(1, nargs + 1))
        parts.append(f"\\def\\{name}{params}{{{katex_safe(body)}}}")
    return "".join(parts)


def lab_frontmatter(macros: dict[str, tuple[str, int]] | None = None, *, numbered: bool = True) -> str:
    """MyST front matter defining the book's macros (jupyterlab-myst reads ``math:`` from a notebook's first cell);
    ``numbered=False`` turns off its numbering of display equations (a copy's ``\\tag`` carries the book's)."""
    macros = macros or load_macros()
    front: dict[str, Any] = {"math": {f"\\{k}": katex_safe(v) for k, (v, _n) in macros.items()}}
    if not numbered:
        front["numbering"] = {"equation": False}
    return f"---\n{yaml.safe_dump(front, allow_unicode=True, width=1000)}---"


def _read_arg(tex: str, i: int) -> tuple[str, int]:
    """One TeX argument at ``tex[i:]`` (after spaces): a brace group's inside, a control word or one character."""
    while i < len(tex) and tex[i] in " \t\n":
        i += 1
    if i >= len(tex):
        return "", i
    if tex[i] == "{":
        end = _balanced_end(tex, i)
        return tex[i + 1:end - 1], end
    if tex[i] == "\\":
        m = re.match(r"\\([A-Za-z]+|.)", tex[i:])
        return m.group(0), i + len(m.group(0))
    return tex[i], i + 1


#: What takes the next token as its argument, so that a macro after it must expand to one group.
ARG_TAKER = re.compile(r"(\\(tilde|widetilde|hat|widehat|bar|overline|underline|vec|dot|ddot|check|breve|acute|grave|"
                       r"mathring|boldsymbol|mathbf|mathrm|mathcal|mathbb|mathsf|mathit|sqrt|frac|dfrac|tfrac|text|"
                       r"operatorname|overbrace|underbrace)|[\^_])\s*$")


def expand_macros(tex: str, macros: dict[str, tuple[str, int]]) -> str:
    """Replace every use of a book macro by its body, as MathJax does (nested uses too)."""
    pattern = re.compile(r"\\([A-Za-z]+|.)", re.S)
    for _ in range(10):
        out, i, changed = [], 0, False
        for m in pattern.finditer(tex):
            if m.start() < i or m.group(1) not in macros:
                continue
            body, nargs = macros[m.group(1)]
            j = m.end()
            args = []
            for _k in range(nargs):
                a, j = _read_arg(tex, j)
                args.append(a)
            for k, a in enumerate(args, 1):
                body = body.replace(f"#{k}", a)
            before = "".join(out) + tex[i:m.start()]
            if ARG_TAKER.search(before) and not re.fullmatch(r"\\[A-Za-z]+|.", body):
                body = "{" + body + "}"  # \tilde\Loss: "\tilde{\mathcal{L}}", as MathJax reads the macro
            elif re.search(r"\\[A-Za-z]+$", before) and re.match(r"[A-Za-z]", body):
                body = " " + body  # \kron\Cin: "\otimes C", not "\otimesC"
            if re.search(r"\\[A-Za-z]+$", body) and re.match(r"[A-Za-z]", tex[j:j + 1]):
                body += " "
            out.append(tex[i:m.start()] + body)
            i, changed = j, True
        out.append(tex[i:])
        tex = "".join(out)
        if not changed:
            break
    return katex_safe(tex)


def one_line(tex: str) -> str:
    """Display TeX on one line (TeX comments dropped first): how a display equation is written inside a quote."""
    tex = re.sub(r"(?<!\\)%[^\n]*", "", tex)
    return " ".join(tex.split())


# ------------------------------------------------------------------------------------------------ the book's index
def sphinx_id(text: str) -> str:
    """The HTML id Sphinx gives a glossary term (``sphinx.util.nodes._make_id``)."""
    try:
        from sphinx.util.nodes import _make_id

        return _make_id(text)
    except ImportError:  # pragma: no cover - the same algorithm, for a reader without Sphinx
        s = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        s = re.sub(r"[^a-zA-Z0-9._]+", "-", " ".join(s.split()))
        return re.sub(r"^[-0-9._]+|-+$", "", s)


def strip_roles(text: str) -> str:
    """A title's roles as their text (``{term}`K-FAC``` -> ``K-FAC``)."""
    def repl(m: re.Match) -> str:
        explicit = re.match(r"^(.*?)\s*<([^>]+)>$", m.group(2), re.S)
        return explicit.group(1) if explicit else m.group(2)

    return re.sub(ROLE_RE, repl, text)


@dataclass
class Target:
    doc: str  # docname, e.g. notebooks/10_linrep_derivations
    anchor: str
    kind: str  # "section", "equation", a proof kind ("lemma"), "exercise"
    number: str = ""  # "7" (Sphinx's figure number), "" when unnumbered
    title: str = ""  # a theorem's, exercise's or section's own title

    @property
    def head(self) -> str:
        """What a reference shows: "Lemma 7", "(12)", a section's title."""
        if self.kind == "equation":
            return f"({self.number})"
        if self.kind == "section":
            return self.title
        return self.kind.capitalize() + (f" {self.number}" if self.number else "")

    @property
    def text(self) -> str:
        """The full reference: "Lemma 7 (Stein's lemma)"."""
        if self.kind in ("equation", "section") or not self.title:
            return self.head
        return f"{self.head} ({self.title})"


@dataclass
class BookIndex:
    docs: dict[str, str] = field(default_factory=dict)  # docname -> title
    labels: dict[str, Target] = field(default_factory=dict)
    terms: dict[str, str] = field(default_factory=dict)  # lower-case term -> glossary spelling
    source: str = "sources"  # "sources", or "built book" when numbers came from _build
    matched: int = 0  # labels whose number the built book gave

    @classmethod
    def build(cls, build_dir: Path | None = None) -> BookIndex:
        """From the sources, numbered as Sphinx numbers them; then, with ``build_dir`` (``myst_export.BUILD``), the
        built book's numbers and titles where it has them. The generated copies use the sources only, so that they
        do not depend on whether a build is lying around; tests/test_channels_notebooks.py checks, after a build,
        that the two agree."""
        idx = cls()
        counters: dict[str, int] = {}
        for doc in toc_docs():
            for suffix in (".ipynb", ".md"):
                path = ROOT / (doc + suffix)
                if path.exists():
                    idx._scan(doc, path, counters)
                    break
        if build_dir is not None:
            idx._from_build(build_dir)
            for label, title in idx.inventory_titles(build_dir / "html" / "objects.inv").items():
                t = idx.labels.get(label)
                if t is not None and t.kind == "section" and title:
                    t.title = title  # the section's title as the built book shows it
        return idx

    def _scan(self, doc: str, path: Path, counters: dict[str, int]) -> None:
        if path.suffix == ".ipynb":
            text = "\n\n".join(cell_source(c) for c in json.loads(path.read_text())["cells"]
                               if c["cell_type"] == "markdown"  # a removed cell is not in the book: not numbered
                               and "remove-cell" not in c.get("metadata", {}).get("tags", []))
        else:
            text = re.sub(r"\A---\n.*?\n---\n", "", path.read_text(), flags=re.S)
        m = re.search(r"^#\s+(.+?)\s*$", text, re.M)
        self.docs[doc] = strip_roles(m.group(1)) if m else Path(doc).name
        for item in iter_directives(text):
            if isinstance(item, tuple):
                if item[0] == "target":
                    title = strip_roles(item[2]) if item[2] else item[1]
                    self.labels[item[1]] = Target(doc, item[1], "section", title=title)
                else:
                    n = counters["displaymath"] = counters.get("displaymath", 0) + 1
                    self.labels[item[1]] = Target(doc, f"equation-{item[1]}", "equation", str(n))
                continue
            d = item
            kind = d.name.split(":", 1)[1] if d.name.startswith("prf:") else d.name
            if d.name.startswith("prf:") and kind in PROOF_TYPES or d.name in ("exercise", "exercise-start"):
                kind = "exercise" if d.name.startswith("exercise") else kind
                n = ""
                if "nonumber" not in d.options:
                    counters[kind] = counters.get(kind, 0) + 1
                    n = str(counters[kind])
                if "label" in d.options:
                    self.labels[d.options["label"]] = Target(doc, d.options["label"], kind, n, strip_roles(d.arg))
            elif d.name == "math" and "label" in d.options:
                n = counters["displaymath"] = counters.get("displaymath", 0) + 1
                self.labels[d.options["label"]] = Target(doc, f"equation-{d.options['label']}", "equation", str(n))
            elif d.name == "glossary":
                for line in d.body:
                    if line and not line[0].isspace() and not line.startswith(":"):
                        self.terms.setdefault(line.strip().lower(), line.strip())

    def _from_build(self, build_dir: Path) -> None:
        """Numbers (``toc_fignumbers``) and section titles (``std`` labels) of the built book, where it has them."""
        pickled = build_dir / ".doctrees" / "environment.pickle"
        if not pickled.exists():
            return
        try:
            with pickled.open("rb") as fh:
                env = pickle.load(fh)  # noqa: S301  (our own build's environment)
            fignumbers = env.toc_fignumbers
            std = env.domaindata.get("std", {})
        except Exception:  # noqa: BLE001 - an unreadable or foreign pickle: keep the sources' numbers
            return
        by_id = {}
        for doc, kinds in fignumbers.items():
            for kind, ids in kinds.items():
                for node_id, number in ids.items():
                    by_id[(doc, node_id)] = ".".join(map(str, number))
        for label, t in self.labels.items():
            anchor = t.anchor if t.kind != "equation" else t.anchor
            number = by_id.get((t.doc, anchor))
            if number is None and t.kind == "equation":
                number = by_id.get((t.doc, label))
            if number and t.kind != "section":
                t.number = number
                self.matched += 1
            sect = std.get("labels", {}).get(label)
            if sect and t.kind == "section" and sect[2]:
                t.title = sect[2]
        self.source = "built book"

    @staticmethod
    def inventory_titles(inv: Path = BUILD / "html" / "objects.inv") -> dict[str, str]:
        """Label -> display name from the built book's inventory (what intersphinx reads), if there is one."""
        if not inv.exists():
            return {}
        try:
            from sphinx.util.inventory import InventoryFile

            with inv.open("rb") as fh:
                data = InventoryFile.load(fh, "", lambda a, b: b)
        except Exception:  # noqa: BLE001 - an unreadable inventory: the sources' titles stay
            return {}
        return {name: entry[3] for name, entry in data.get("std:label", {}).items() if entry[3] != "-"}


# ------------------------------------------------------------------------------------------------ bibliography
def latex_to_text(s: str) -> str:
    """BibTeX field text as Unicode: accents and escapes decoded (``Mar\\v{c}enko`` -> ``Marčenko``), braces gone."""
    import codecs

    try:
        import latexcodec  # noqa: F401  (registers 'ulatex'; a dependency of pybtex)

        s = codecs.decode(s, "ulatex")
    except (ImportError, UnicodeDecodeError, ValueError):  # pragma: no cover
        pass
    return re.sub(r"\s+", " ", s.replace("{", "").replace("}", "")).strip()


class Bibliography:
    """Author–year citations and reference lines from ``book/references.bib`` (pybtex, a dependency of
    sphinxcontrib-bibtex), every field decoded from LaTeX to Unicode."""

    def __init__(self, path: Path = ROOT / "book" / "references.bib") -> None:
        from pybtex.database import parse_file

        self.entries = parse_file(str(path)).entries if path.exists() else {}

    def _people(self, key: str):
        e = self.entries[key]
        return e.persons.get("author") or e.persons.get("editor") or []

    def authors(self, key: str) -> str:
        if key not in self.entries:
            return key
        last = [latex_to_text(" ".join(p.prelast_names + p.last_names)) for p in self._people(key)]
        if not last:
            return latex_to_text(self.entries[key].fields.get("title", key))
        return last[0] if len(last) == 1 else f"{last[0]} and {last[1]}" if len(last) == 2 else f"{last[0]} et al."

    def year(self, key: str) -> str:
        return self.entries[key].fields.get("year", "n.d.") if key in self.entries else "n.d."

    def cite(self, keys: list[str], parenthetical: bool) -> str:
        if parenthetical:
            return "(" + "; ".join(f"{self.authors(k)}, {self.year(k)}" for k in keys) + ")"
        return "; ".join(f"{self.authors(k)} ({self.year(k)})" for k in keys)

    def sort_key(self, key: str) -> tuple:
        return (self.authors(key).lower(), self.year(key), key)

    def reference(self, key: str, links: bool = True) -> str:
        if key not in self.entries:
            return f"{key} (not in the bibliography)"
        e = self.entries[key]
        people = self._people(key)
        names = ", ".join(latex_to_text(" ".join(p.first_names + p.middle_names + p.prelast_names + p.last_names))
                          for p in people[:6]) + (" et al." if len(people) > 6 else "")
        f = e.fields
        venue = f.get("journal") or f.get("booktitle") or f.get("publisher") or f.get("howpublished") or ""
        line = f"{names} ({self.year(key)}). *{latex_to_text(f.get('title', key))}*." + (
            f" {latex_to_text(venue)}." if venue else "")
        if not links:
            return line
        if f.get("doi"):
            line += f" [doi:{f['doi']}](https://doi.org/{f['doi']})"
        elif f.get("url"):
            line += f" <{f['url']}>"
        elif f.get("eprint"):
            line += f" [arXiv:{f['eprint']}](https://arxiv.org/abs/{f['eprint']})"
        return line


# ------------------------------------------------------------------------------------------------ the exporter
def quote(lines: list[str]) -> list[str]:
    """A block quote (an empty line inside stays in the quote)."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    while lines and not lines[0].strip():
        lines = lines[1:]
    return [("> " + ln) if ln.strip() else ">" for ln in lines]


class Exporter:
    """MyST cells of one chapter -> notebook Markdown. State runs across cells: the gated exercise/solution pairs
    that open in one cell and close in another, and the citations since the last reference list.

    ``boxes``: "quote" (Markdown block quotes) or "html" (``<div class="curvlab-box ...">``, for the slides);
    ``solutions``: "show" or "hide"; ``links``: cross-references and terms as links to the published book, or plain
    text; ``expand``: the book's macros expanded in every formula (False leaves them to a renderer that has them).
    """

    def __init__(self, doc: str, *, index: BookIndex | None = None, bib: Bibliography | None = None,
                 macros: dict[str, tuple[str, int]] | None = None, config: dict[str, Any] | None = None,
                 ref: str = "main", boxes: str = "quote", solutions: str = "show", links: bool = True,
                 expand: bool = True) -> None:
        config = config or load_config()
        self.doc = doc
        self.index = index or BookIndex.build()
        self.bib = bib or Bibliography()
        self.macros = macros if macros is not None else load_macros()
        self.base = book_url(config)
        self.repo = repo_url(config)
        self.ref = ref
        self.boxes, self.solutions, self.links, self.expand = boxes, solutions, links, expand
        self.cited: list[str] = []
        self.problems: list[str] = []  # MyST without a conversion (the tests require none)
        self.in_solution = False  # inside a gated solution (solution-start ... solution-end)
        self.exercise_heads: dict[str, str] = {}  # label -> "Exercise 12"
        self._quoted = 0  # depth of block quotes being written: display maths goes on one line there

    # ---- links and targets
    def url(self, doc: str, anchor: str = "") -> str:
        return f"{self.base}{doc}.html" + (f"#{anchor}" if anchor else "")

    def link(self, text: str, doc: str, anchor: str = "") -> str:
        return f"[{text}]({self.url(doc, anchor)})" if self.links else text

    def _resolve_doc(self, target: str) -> str:
        here = Path(self.doc).parent
        doc = os.path.normpath(str(here / target)) if not target.startswith("/") else target.lstrip("/")
        doc = re.sub(r"\.(ipynb|md)$", "", doc)
        if doc not in self.index.docs:
            self.problems.append(f"{{doc}} target {target!r} is not a page of the book")
        return doc

    def _label(self, target: str, role: str) -> Target | None:
        t = self.index.labels.get(target) or self.index.labels.get(target.lower())
        if t is None:
            self.problems.append(f"{{{role}}} target {target!r} is not a label of the book")
        return t

    def math(self, tex: str) -> str:
        return expand_macros(tex, self.macros) if self.expand else tex

    # ---- roles
    def role(self, name: str, content: str) -> str:
        explicit = re.match(r"^(.*?)\s*<([^>]+)>$", content, re.S)
        text, target = (explicit.group(1).strip(), explicit.group(2).strip()) if explicit else (None, content.strip())
        if name in CITE_ROLES:
            keys = [k.strip() for k in content.split(",") if k.strip()]
            missing = [k for k in keys if k not in self.bib.entries]
            if missing:
                self.problems.append(f"citation keys not in references.bib: {missing}")
                keys = [k for k in keys if k in self.bib.entries]
            self.cited += [k for k in keys if k not in self.cited]
            return self.bib.cite(keys, parenthetical=not name.endswith(":t") and not name.endswith(":ts"))
        if name == "term":
            canon = self.index.terms.get(" ".join(target.split()).lower())
            if canon is None:
                self.problems.append(f"{{term}} {target!r} is not in the glossary")
                return text or target
            return self.link(text or target, "book/glossary", "term-" + sphinx_id(canon))
        if name == "doc":
            doc = self._resolve_doc(target)
            shown = text or self.index.docs.get(doc, target)
            return self.link(shown, doc) if self.links else f"*{shown}*"
        if name in ("ref", "numref", "prf:ref", "eq"):
            t = self._label(target, name)
            if t is None:
                return text or target
            if text:
                shown = text.replace("{number}", t.number).replace("{name}", t.title) if name == "numref" else text
            elif name == "numref":
                shown = self._inline(t.head)
            elif name == "eq":
                shown = f"({t.number})" if t.number else t.head
            else:
                shown = self._inline(t.text)  # a title's maths, with the macros expanded
            return self.link(shown, t.doc, t.anchor)
        if name == "math":
            return f"${self.math(content)}$"
        if name in PY_ROLES:
            obj = target.lstrip("~")
            shown = text or (obj.split(".")[-1] if target.startswith("~") else obj)
            if name in ("func", "meth", "py:func", "py:meth") and not text:
                shown += "()"
            return f"[`{shown}`]({self.url('book/api', obj)})" if self.links else f"`{shown}`"
        if name == "abbr":
            return re.sub(r"\s*\(.*\)$", "", content)
        if name in ("sub", "sup"):
            return f"<{name}>{content}</{name}>"
        if name == "download":
            rel = os.path.normpath(str(Path(self.doc).parent / target))
            shown = text or Path(target).name
            return f"[{shown}]({self.repo}/blob/{self.ref}/{rel})" if self.links else shown
        if name in ("kbd", "command", "file", "samp", "code", "literal", "guilabel", "menuselection"):
            return f"`{content}`"
        self.problems.append(f"role {{{name}}} has no conversion")
        return text or target

    def inline(self, text: str) -> str:
        """Roles and maths of a run of Markdown that holds no directive (plain code blocks are copied as they are)."""
        out, i = [], 0
        for m in re.finditer(r"^[ \t>]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t>]*\1[ \t]*$", text, re.M | re.S):
            out.append(self._inline(text[i:m.start()]))
            out.append(text[m.start():m.end()])
            i = m.end()
        out.append(self._inline(text[i:]))
        return "".join(out)

    def _display(self, tex: str, label: str | None = None) -> str:
        body = self.math(tex).strip()
        if label:
            t = self._label(label, "eq")
            if t is not None and t.number:
                body += f" \\tag{{{t.number}}}"
        if self._quoted or "\n" not in body:
            return f"$$ {one_line(body)} $$"
        return f"$$\n{body}\n$$"

    def _inline(self, text: str) -> str:
        def repl(m: re.Match) -> str:
            if m.group(1):
                return self.role(m.group(1), m.group(2))
            if m.group(3):
                return m.group(0)
            if m.group(4) is not None:
                return self._display(m.group(4), m.group(5))
            return f"${self.math(m.group(6))}$"

        return INLINE.sub(repl, text)

    # ---- directives
    def literalinclude(self, arg: str, options: dict[str, str]) -> list[str]:
        rel = os.path.normpath(str(Path(self.doc).parent / arg))
        path = ROOT / rel
        try:
            source = path.read_text()
        except OSError:
            self.problems.append(f"literalinclude: {rel} not found")
            return [f"*(listing: {arg})*"]
        obj = options.get("pyobject")
        if obj:
            tree = ast.parse(source)
            node = next((n for n in ast.walk(tree)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                         and n.name == obj.split(".")[-1]), None)
            if node is None:
                self.problems.append(f"literalinclude: {obj} not found in {rel}")
            else:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                source = "\n".join(source.splitlines()[start - 1:node.end_lineno])
        elif options.get("lines"):
            keep = set()
            for part in options["lines"].split(","):
                a, _, b = part.partition("-")
                keep |= set(range(int(a), int(b or a) + 1))
            source = "\n".join(ln for k, ln in enumerate(source.splitlines(), 1) if k in keep)
        lang = options.get("language", options.get("lang", "python"))
        where = (f"[`{rel}`]({self.repo}/blob/{self.ref}/{rel})" if self.links else f"`{rel}`") + (
            f", `{obj}`" if obj else "")
        return [f"*From {where}:*", "", f"```{lang}", *source.rstrip().splitlines(), "```"]

    def box(self, kind: str, head: str, body: list[str], tail: list[str] | None = None) -> list[str]:
        """A theorem-like block: a block quote, or an HTML box for the slides."""
        if self.boxes == "html":
            return ["", f'<div class="curvlab-box curvlab-{kind}">', "", head, "", *self.convert(body),
                    *(["", *tail] if tail else []), "", "</div>", ""]
        self._quoted += 1
        try:
            inner = self.convert(body)
        finally:
            self._quoted -= 1
        return ["", *quote([head, "", *inner, *(["", *tail] if tail else [])]), ""]

    def _head(self, kind: str, options: dict[str, str]) -> str:
        t = self.index.labels.get(options.get("label", ""))
        if t is not None and t.number:
            return t.head
        return kind.capitalize()

    def directive(self, name: str, arg: str, options: dict[str, str], body: list[str]) -> list[str]:
        arg_md = self.inline(arg).strip()
        if name == "solution-end":
            self.in_solution = False
            if self.solutions == "hide":
                return []
            which = self.exercise_heads.get(arg.strip(), "the exercise")
            return ["", f"*End of the solution to {which}.*", "", "***", ""]
        if self.in_solution and self.solutions == "hide":
            return []
        if name.startswith("prf:") and name.split(":", 1)[1] in PROOF_TYPES:
            kind = name.split(":", 1)[1]
            head = self._head(kind, options)
            status = STATUS.get((options.get("class") or "").split()[0] if options.get("class") else "", "")
            first = f"**{head}" + (f" ({arg_md})" if arg_md else "") + ".**" + (f" *Status: {status}.*" if status else "")
            return self.box("prf", first, body)
        if name == "prf:proof":
            return self.box("proof", "*Proof.*" + (f" ({arg_md})" if arg_md else ""), body, ["∎"])
        if name in ("exercise", "exercise-start"):
            head = self._head("exercise", options)
            if options.get("label"):
                self.exercise_heads[options["label"]] = head
            first = f"**{head}" + (f" ({arg_md})" if arg_md else "") + ".**"
            if name == "exercise-start" and self.boxes == "html":  # closed by exercise-end, maybe cells later
                return ["", '<div class="curvlab-box curvlab-exercise">', "", first, ""]
            if name == "exercise-start":
                return ["", "***", "", first, ""]  # not "---": at a cell's start that opens front matter
            return self.box("exercise", first, body)
        if name == "exercise-end":
            return ["", "</div>", ""] if self.boxes == "html" else []
        if name in ("solution", "solution-start"):
            if name == "solution-start":
                self.in_solution = True
            if self.solutions == "hide":
                return []
            which = self.exercise_heads.get(arg.strip(), "the exercise")
            first = f"**Solution to {which}.**"
            if name == "solution-start":
                return ["", first, ""]
            return self.box("solution", first, body)
        if name == "literalinclude":
            return ["", *self.literalinclude(arg, options), ""]
        if name == "footbibliography":
            cited, self.cited = sorted(self.cited, key=self.bib.sort_key), []
            return ["", *([f"- {self.bib.reference(k, self.links)}" for k in cited] or ["*(no references)*"]), ""]
        if name == "math":
            return ["", self._display("\n".join(body), options.get("label")), ""]
        if name in ("code", "code-block", "code-cell", "sourcecode"):
            return ["", f"```{arg or 'python'}", *body, "```", ""]
        if name in ("figure", "image"):
            src = arg if re.match(r"https?://", arg) else (
                f"https://raw.githubusercontent.com/{self.repo.split('github.com/')[1]}/{self.ref}/"
                + os.path.normpath(str(Path(self.doc).parent / arg)))
            caption = self.convert(body)
            alt = options.get("alt") or (strip_roles(" ".join(body)).strip() or Path(arg).name)
            return ["", f"![{alt}]({src})", "", *(["*" + " ".join(caption).strip() + "*"] if caption else []), ""]
        if name in ("glue", "glue:", "glue:any", "glue:text", "glue:figure", "glue:math"):
            return [f"*(the value `{arg}` computed above; the book shows it here)*"]
        if name in DROPPED:
            if name == "bibliography":
                return ["", "The full bibliography is on the book's "
                        + self.link("references page", "book/bibliography") + ".", ""]
            return []
        if name in ADMONITIONS:
            title = arg_md if name == "admonition" or (arg_md and name in ("dropdown", "card", "topic", "sidebar")) \
                else name.capitalize() + (f": {arg_md}" if arg_md else "")
            return self.box(name, f"**{title or name.capitalize()}.**", body)
        self.problems.append(f"directive {{{name}}} has no conversion")
        return self.box(name, f"**{name.split(':')[-1].capitalize()}" + (f" ({arg_md})" if arg_md else "") + ".**",
                        body)

    def convert(self, lines: list[str]) -> list[str]:
        """Lines of MyST -> lines of Markdown. The parser splits the text into blocks; a directive, target, comment or
        labelled equation is converted from its token, any other block is copied with its roles and maths converted."""
        text = "\n".join(lines)
        tokens = md_parser().parse(text)
        out: list[str] = []
        pos = 0  # the next source line not yet copied

        def copy_until(end: int) -> None:
            nonlocal pos
            if end > pos:
                chunk = lines[pos:end]
                if not (self.in_solution and self.solutions == "hide"):
                    out.extend(self.inline("\n".join(chunk)).split("\n"))
                pos = end

        depth = 0
        for t in tokens:
            if depth > 0:  # inside a list, quote or table: copied with its block (a directive there is reported)
                depth += t.nesting
                if directive_name(t):
                    self.problems.append(f"directive {{{directive_name(t)}}} inside a list or quote has no conversion")
                continue
            depth += t.nesting
            if t.map is None:
                continue
            start, end = t.map
            name = directive_name(t)
            hidden = self.in_solution and self.solutions == "hide"
            if name:
                copy_until(start)
                pos = max(pos, end)
                options, body = split_options(t.content)
                out.extend(self.directive(name, t.info.strip()[len(name) + 2:].strip(), options, body))
            elif t.type in ("myst_target", "myst_line_comment"):
                copy_until(start)
                pos = max(pos, end)
            elif t.type in ("math_block", "math_block_label", "amsmath"):
                copy_until(start)
                pos = max(pos, end)
                if not hidden:
                    label = t.info.strip() if t.type == "math_block_label" else None
                    out.extend(["", self._display(t.content, label), ""])
            else:
                copy_until(end)
        copy_until(len(lines))
        return out

    def markdown(self, source: str) -> str:
        text = "\n".join(self.convert(source.splitlines()))
        return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


# ------------------------------------------------------------------------------------------------ what a copy may hold
def formulas(markdown: str) -> list[tuple[bool, str]]:
    """(display?, TeX) of every formula in a Markdown cell, outside code; block-quote markers removed."""
    s = re.sub(r"^[ \t>]*(`{3,}|~{3,}).*?^[ \t>]*\1[ \t]*$", "", markdown, flags=re.M | re.S)
    s = re.sub(r"(`+)(.+?)\1", "", s, flags=re.S)
    out = []
    for m in re.finditer(r"\$\$(.+?)\$\$|(?<![\\$])\$(?!\s)((?:\\\$|[^$])+?)(?<![\s\\])\$", s, re.S):
        tex = m.group(1) if m.group(1) is not None else m.group(2)
        out.append((m.group(1) is not None, re.sub(r"\n[ \t]*(>[ \t]?)+", "\n", tex)))
    return out


LEFTOVER = [
    ("a MyST role", re.compile(ROLE_RE)),
    ("a directive fence", re.compile(r"^\s*>?\s*(`{3,}|:{3,})\{[\w:-]+\}", re.M)),
    ("a (label)= target", re.compile(r"^\s*>?\s*\([^()\s]+\)=\s*$", re.M)),
    ("a directive option", re.compile(r"^\s*>?\s*:(label|class|name|nonumber|pyobject|language|enumerated):", re.M)),
    ("an equation label", re.compile(r"\$\$[ \t]*\([\w:.-]+\)")),
    ("an HTML box", re.compile(r"<div\b")),
    ("a quote marker inside display maths", re.compile(r"\$\$[^$]*\n[ \t]*>[^$]*\$\$")),
]


def _drop_code(text: str) -> str:
    """Code blocks and code spans removed; a role's backticks are not a code span."""
    text = re.sub(r"^[ \t>]*(`{3,}|~{3,})(?!\{).*?^[ \t>]*\1[ \t]*$", "", text, flags=re.M | re.S)
    out, i = [], 0
    for m in re.finditer(ROLE_RE + r"|(?<!`)(`{1,2})(?!`)(.+?)(?<!`)\3(?!`)", text, re.S):
        if m.group(3):
            out.append(text[i:m.start()])
            i = m.end()
    out.append(text[i:])
    return "".join(out)


def leftovers(markdown: str) -> list[str]:
    """MyST syntax or HTML boxes left in a cell of exported Markdown (code excluded)."""
    text = _drop_code(markdown)
    return [f"{what}: {m.group(0).strip()[:60]!r}" for what, pattern in LEFTOVER for m in pattern.finditer(text)]


def raw_labels(markdown: str, index: BookIndex) -> list[str]:
    """Labels of the book shown as text (``notation-lem-vec``, or ``notation lem vec``): outside code and link
    targets. Only labels with a separator count (a one-word label may be an ordinary word)."""
    text = re.sub(r"\]\([^)]*\)|<https?://[^>]*>", "]", _drop_code(markdown))
    found = []
    for label in index.labels:
        if not re.search(r"[-:_]", label) or len(label) < 5:
            continue
        for form in {label, re.sub(r"[-:_]", " ", label)}:
            if re.search(rf"(?<![\w#/-]){re.escape(form)}(?![\w-])", text):
                found.append(form)
    return found


# ------------------------------------------------------------------------------------------------ render checks
def js_ready() -> bool:
    return (JS_DIR / "node_modules" / "katex").is_dir() and (JS_DIR / "node_modules" / "myst-parser").is_dir()


def install_js(timeout: int = 600) -> bool:
    """``npm ci`` the render checks' packages into tools/js/node_modules (the npm registry; a few MB)."""
    if js_ready():
        return True
    npm = "npm"
    try:
        cmd = [npm, "ci" if (JS_DIR / "package-lock.json").exists() else "install", "--no-audit", "--no-fund"]
        subprocess.run(cmd, cwd=JS_DIR, capture_output=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return js_ready()


def render_check(cells: list[str], frontmatter: dict[str, str] | None = None) -> dict[str, Any]:
    """Render notebook Markdown cells as KaTeX and jupyterlab-myst do (``tools/js/render_check.mjs``): every formula
    in KaTeX with no macros (a renderer that keeps nothing), after the first cell's definitions (one that keeps them,
    like Colab), and under jupyterlab-myst (its MyST parser, then KaTeX with the front matter's ``math`` macros).
    Returns the failures and the structure counts the script reports."""
    payload = json.dumps({"cells": cells, "formulas": [formulas(c) for c in cells], "frontmatter": frontmatter or {}})
    res = subprocess.run(["node", str(JS_DIR / "render_check.mjs")], input=payload, capture_output=True, text=True,
                         cwd=JS_DIR, timeout=600)
    if res.returncode:
        raise RuntimeError(f"render_check.mjs failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)
