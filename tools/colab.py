"""Generate the clean copies of the chapters that Colab and JupyterLab open: ``notebooks/colab/<chapter>.ipynb``.

    python tools/colab.py                      # (re)write every copy (what `make colab` runs)
    python tools/colab.py --check              # exit 1 if a stored copy is out of date
    python tools/colab.py --ref v1.2.0         # pin the copies' install to this ref (a release: see release.yml)
    python tools/colab.py --fix-setup-cells    # rewrite the install block of every chapter's setup cell
    python tools/colab.py --print-ref          # the ref the copies install by default
    python tools/colab.py --lab [--port N]     # start JupyterLab on 127.0.0.1 (what `make lab` runs)

The chapters (``notebooks/NN_*.ipynb``) are MyST: roles (``{term}``, ``{doc}``, ``{prf:ref}``, ``{footcite:t}``, ...),
directives (``prf:theorem`` fences, exercises, ``literalinclude``) and the book's macros (``book/macros.yml``) are
resolved by Jupyter Book. Outside the book (Colab, JupyterLab) the same cells show raw MyST and undefined macros. A
copy is the chapter with

* every role turned into plain text or an absolute link to the published book (GitHub Pages of the repository in
  ``_config.yml``), citations into "Author (Year)" and the chapter's reference list;
* every directive turned into a headed Markdown block ("**Lemma 2 (title).** *Status: proved here.*", blockquoted),
  ``literalinclude`` into the listed code, labelled equations into ``\\tag{N}``, numbered as in the book;
* the book's macros **expanded** in every formula, so a formula renders wherever Markdown maths does (Colab's KaTeX,
  JupyterLab's MathJax, jupyterlab-myst, nbconvert, GitHub), and also **defined** in the copy's first cell
  (``$\\newcommand...$``, hidden) for the reader's own cells: ``\\renewcommand`` where KaTeX already has the command,
  ``\\operatorname*`` written as ``\\mathop{\\mathrm{...}}`` (old KaTeX builds reject the starred form);
* a setup cell that, in Colab (detected by ``COLAB_RELEASE_TAG`` or ``find_spec("google.colab")``), installs
  ``curvlab`` from the repository at :func:`resolve_ref` with the extras the chapter needs, shows pip's errors, and
  fetches the data files the chapter reads (``configs/...``).

Copies are generated, committed and never edited by hand; ``tests/test_channels_notebooks.py`` fails when one is
stale or when any MyST syntax or undefined macro is left. The launch buttons of the built book open them
(``book/_ext/curvlab_launch.py``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
OUT_DIR = NB_DIR / "colab"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbtool  # noqa: E402

# ------------------------------------------------------------------------------------------------ configuration
EXTRA = "notebooks"  # the extra of lib/pyproject.toml with what chapters need beyond curvlab's core
#: Code that needs the extra: scikit-learn's digits (meanfield.load_digits_data, deep_linear.digits), sliders.
NEEDS_EXTRA = re.compile(r"\bload_digits_data\b|\bdigits\(|\bsklearn\b|\binteract\b|\bipywidgets\b")
#: Data files a chapter reads, relative to notebooks/ (fetched next to a copy that has no repository around it).
DATA_FILE = re.compile(r"""["'](configs/[\w./-]+\.(?:ya?ml|json|csv))["']""")

STATUS = {"status-proved": "proved here", "status-checked": "checked here", "status-stated": "stated from a paper"}
ADMONITIONS = ("note", "tip", "hint", "important", "warning", "caution", "attention", "danger", "error", "seealso",
               "admonition", "dropdown", "margin", "sidebar", "topic", "epigraph", "card")
DROPPED = ("toctree", "tableofcontents", "bibliography", "curvlab-ledger", "curvlab-status", "only", "raw")
PY_ROLES = ("func", "class", "meth", "mod", "attr", "obj", "data", "exc", "py:func", "py:class", "py:meth",
            "py:mod", "py:attr", "py:obj", "py:data", "py:exc")

FENCE = re.compile(r"^(\s*)(`{3,}|:{3,})\{([A-Za-z][\w:-]*)\}[ \t]*(.*?)\s*$")
CODE_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
OPTION = re.compile(r"^\s*:([A-Za-z][\w-]*):[ \t]*(.*?)\s*$")
TARGET = re.compile(r"^\s*\(([^()\s]+)\)=\s*$")
ROLE_RE = r"\{([A-Za-z][\w:+-]*)\}`([^`]*)`"
INLINE = re.compile(
    ROLE_RE  # 1, 2: a role
    + r"|(`+)(?:.+?)\3"  # 3: a code span (roles inside it are examples, left alone)
    + r"|\$\$(.+?)\$\$(?:[ \t]*\(([\w:.-]+)\))?"  # 4, 5: display maths, optionally labelled
    + r"|(?<![\\$])\$(?!\s)((?:\\\$|[^$])+?)(?<![\s\\])\$(?!\d)",  # 6: inline maths
    re.S,
)

PROOF_TYPES = ("axiom", "theorem", "lemma", "algorithm", "definition", "remark", "conjecture", "corollary",
               "criterion", "example", "property", "observation", "proposition", "assumption", "notation")


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


def _git(*args: str) -> str:
    try:
        res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def release_tag() -> str:
    """The release tag ``vX.Y.Z`` that HEAD is at, or ''."""
    tags = [t for t in _git("tag", "--points-at", "HEAD").split() if re.fullmatch(r"v\d+\.\d+\.\d+", t)]
    return sorted(tags)[-1] if tags else ""


def resolve_ref(config: dict[str, Any] | None = None) -> str:
    """The git ref a copy installs ``curvlab`` from: one that exists on the repository.

    ``CURVLAB_REF`` if set; else the release tag HEAD is at; else the branch the book is built from,
    ``repository.branch`` of ``_config.yml`` (the launch buttons open that branch; release.yml sets it to the tag);
    else the checked-out branch. The configured branch comes before the checked-out one on purpose: copies are
    committed, and a copy generated on a feature branch must not pin a branch that is deleted after the merge."""
    if os.environ.get("CURVLAB_REF"):
        return os.environ["CURVLAB_REF"].strip()
    tag = release_tag()
    if tag:
        return tag
    branch = str((config or load_config()).get("repository", {}).get("branch") or "").strip()
    if branch:
        return branch
    head = _git("rev-parse", "--abbrev-ref", "HEAD")
    return head if head and head != "HEAD" else "main"


def lib_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "lib" / "pyproject.toml").read_text())["project"]["version"]


def chapters() -> list[Path]:
    return sorted(p for p in NB_DIR.glob("*.ipynb") if re.match(r"\d\d_", p.name))


def cell_source(cell: dict[str, Any]) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


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
#: MathJax does not have them and accepts either form. Checked with KaTeX 0.16.
KATEX_BUILTIN = frozenset({"R", "argmin", "argmax", "C", "N", "Z", "Q", "cal", "bold", "Complex", "Reals", "natnums"})


def katex_safe(tex: str) -> str:
    r"""``\operatorname*{X}`` as ``\mathop{\mathrm{X}}`` (the same limits placement; old KaTeX builds reject the star)."""
    return re.sub(r"\\operatorname\*\s*\{", r"\\mathop{\\mathrm{", _close_mathop(tex))


def _close_mathop(tex: str) -> str:
    # \operatorname*{...} -> \operatorname*{...}} so that the rewrite above balances \mathop{\mathrm{...}}
    out, i = [], 0
    for m in re.finditer(r"\\operatorname\*\s*\{", tex):
        if m.start() < i:
            continue
        end = _balanced_end(tex, m.end() - 1)
        out.append(tex[i:end] + "}")
        i = end
    out.append(tex[i:])
    return "".join(out)


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


def macro_definitions(macros: dict[str, tuple[str, int]]) -> str:
    """One line of ``\\newcommand``s that MathJax and KaTeX both accept."""
    parts = []
    for name, (body, nargs) in macros.items():
        cmd = "renewcommand" if name in KATEX_BUILTIN else "newcommand"
        parts.append(f"\\{cmd}{{\\{name}}}" + (f"[{nargs}]" if nargs else "") + f"{{{katex_safe(body)}}}")
    return "".join(parts)


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


@dataclass
class Target:
    doc: str  # docname, e.g. notebooks/10_linrep_derivations
    anchor: str
    text: str  # what a reference without explicit text shows ("Lemma 2", "(3)", a section title)
    title: str = ""  # a theorem's or exercise's own title


@dataclass
class BookIndex:
    docs: dict[str, str] = field(default_factory=dict)  # docname -> title
    labels: dict[str, Target] = field(default_factory=dict)
    terms: dict[str, str] = field(default_factory=dict)  # lower-case term -> glossary spelling

    @classmethod
    def build(cls) -> BookIndex:
        idx = cls()
        toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
        files = [toc["root"]]
        for part in toc.get("parts", []):
            files += [c["file"] for c in part.get("chapters", [])]
        for doc in files:
            for suffix in (".ipynb", ".md"):
                path = ROOT / (doc + suffix)
                if path.exists():
                    idx._scan(doc, path)
                    break
        return idx

    def _scan(self, doc: str, path: Path) -> None:
        if path.suffix == ".ipynb":
            text = "\n\n".join(cell_source(c) for c in json.loads(path.read_text())["cells"]
                               if c["cell_type"] == "markdown")
        else:
            text = re.sub(r"\A---\n.*?\n---\n", "", path.read_text(), flags=re.S)
        m = re.search(r"^#\s+(.+?)\s*$", text, re.M)
        self.docs[doc] = strip_roles(m.group(1)) if m else Path(doc).name
        counters: dict[str, int] = {}
        lines = text.splitlines()
        in_glossary = False
        for i, line in enumerate(lines):
            t = TARGET.match(line)
            if t:
                nxt = next((ln for ln in lines[i + 1:] if ln.strip()), "")
                h = re.match(r"^#+\s+(.*?)\s*$", nxt)
                self.labels[t.group(1)] = Target(doc, t.group(1), strip_roles(h.group(1)) if h else t.group(1))
            f = FENCE.match(line)
            if f:
                name, arg = f.group(3), f.group(4)
                opts = _options(lines[i + 1:])
                kind = name.split(":", 1)[1] if name.startswith("prf:") else name
                if name.startswith("prf:") and kind in PROOF_TYPES or name in ("exercise", "exercise-start"):
                    kind = "exercise" if name.startswith("exercise") else kind
                    n = None
                    if "nonumber" not in opts:
                        n = counters[kind] = counters.get(kind, 0) + 1
                    if "label" in opts:
                        head = kind.capitalize() + (f" {n}" if n else "")
                        self.labels[opts["label"]] = Target(doc, opts["label"], head, strip_roles(arg))
                if name == "glossary":
                    in_glossary = True
                    continue
            if in_glossary:
                if re.match(r"^(`{3,}|:{3,})\s*$", line):
                    in_glossary = False
                elif line and not line[0].isspace() and not line.startswith(":"):
                    self.terms.setdefault(line.strip().lower(), line.strip())
        for k, m in enumerate(re.finditer(r"\$\$.+?\$\$[ \t]*\(([\w:.-]+)\)", text, re.S), 1):
            self.labels[m.group(1)] = Target(doc, f"equation-{m.group(1)}", f"({k})")


def _options(lines: list[str]) -> dict[str, str]:
    opts = {}
    for line in lines:
        o = OPTION.match(line)
        if not o:
            break
        opts[o.group(1)] = o.group(2)
    return opts


def strip_roles(text: str) -> str:
    """A title's roles as their text (``{term}`K-FAC``` -> ``K-FAC``)."""
    def repl(m: re.Match) -> str:
        explicit = re.match(r"^(.*?)\s*<([^>]+)>$", m.group(2), re.S)
        return explicit.group(1) if explicit else m.group(2)

    return re.sub(ROLE_RE, repl, text)


# ------------------------------------------------------------------------------------------------ bibliography
def _latex_text(s: str) -> str:
    import codecs

    try:
        import latexcodec  # noqa: F401  (registers 'ulatex'; a dependency of pybtex)

        s = codecs.decode(s, "ulatex")
    except (ImportError, UnicodeDecodeError, ValueError):  # pragma: no cover
        pass
    return re.sub(r"\s+", " ", s.replace("{", "").replace("}", "")).strip()


class Bibliography:
    """Author–year citations and reference lines from ``book/references.bib`` (pybtex, a dependency of
    sphinxcontrib-bibtex)."""

    def __init__(self, path: Path = ROOT / "book" / "references.bib") -> None:
        from pybtex.database import parse_file

        self.entries = parse_file(str(path)).entries

    def _people(self, key: str):
        e = self.entries[key]
        return e.persons.get("author") or e.persons.get("editor") or []

    def authors(self, key: str) -> str:
        last = [_latex_text(" ".join(p.prelast_names + p.last_names)) for p in self._people(key)]
        if not last:
            return _latex_text(self.entries[key].fields.get("title", key))
        return last[0] if len(last) == 1 else f"{last[0]} and {last[1]}" if len(last) == 2 else f"{last[0]} et al."

    def year(self, key: str) -> str:
        return self.entries[key].fields.get("year", "n.d.")

    def cite(self, keys: list[str], parenthetical: bool) -> str:
        if parenthetical:
            return "(" + "; ".join(f"{self.authors(k)}, {self.year(k)}" for k in keys) + ")"
        return "; ".join(f"{self.authors(k)} ({self.year(k)})" for k in keys)

    def sort_key(self, key: str) -> tuple:
        return (self.authors(key).lower(), self.year(key), key)

    def reference(self, key: str) -> str:
        e = self.entries[key]
        people = self._people(key)
        names = ", ".join(_latex_text(" ".join(p.first_names + p.middle_names + p.prelast_names + p.last_names))
                          for p in people[:6]) + (" et al." if len(people) > 6 else "")
        f = e.fields
        venue = f.get("journal") or f.get("booktitle") or f.get("publisher") or f.get("howpublished") or ""
        line = f"{names} ({self.year(key)}). *{_latex_text(f.get('title', key))}*." + (
            f" {_latex_text(venue)}." if venue else "")
        if f.get("doi"):
            line += f" [doi:{f['doi']}](https://doi.org/{f['doi']})"
        elif f.get("url"):
            line += f" <{f['url']}>"
        elif f.get("eprint"):
            line += f" [arXiv:{f['eprint']}](https://arxiv.org/abs/{f['eprint']})"
        return line


# ------------------------------------------------------------------------------------------------ conversion
class Converter:
    """MyST cells of one chapter -> plain Markdown. State runs across cells: numbering of exercises, the gated
    exercise/solution pairs that open in one cell and close in another, and the citations so far."""

    def __init__(self, doc: str, index: BookIndex, bib: Bibliography, macros: dict[str, tuple[str, int]],
                 config: dict[str, Any], ref: str) -> None:
        self.doc = doc
        self.index = index
        self.bib = bib
        self.macros = macros
        self.base = book_url(config)
        self.repo = repo_url(config)
        self.ref = ref
        self.cited: list[str] = []
        self.problems: list[str] = []  # MyST that had no dedicated conversion (the test requires none)
        self.counters: dict[str, int] = {}
        self.exercise_numbers: dict[str, str] = {}  # label -> "Exercise 2"

    # ---- links
    def url(self, doc: str, anchor: str = "") -> str:
        return f"{self.base}{doc}.html" + (f"#{anchor}" if anchor else "")

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

    # ---- roles
    def role(self, name: str, content: str) -> str:
        explicit = re.match(r"^(.*?)\s*<([^>]+)>$", content, re.S)
        text, target = (explicit.group(1).strip(), explicit.group(2).strip()) if explicit else (None, content.strip())
        if name in ("footcite", "footcite:p", "footcite:t", "cite", "cite:p", "cite:t", "cite:ps", "cite:ts"):
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
            return f"[{text or target}]({self.url('book/glossary', 'term-' + sphinx_id(canon))})"
        if name == "doc":
            doc = self._resolve_doc(target)
            return f"[{text or self.index.docs.get(doc, target)}]({self.url(doc)})"
        if name in ("ref", "numref", "prf:ref", "eq", "prf:proof"):
            t = self._label(target, name)
            if t is None:
                return text or target
            shown = text or (t.text if name != "ref" or not t.title else t.title)
            if name == "numref" and text and "{number}" in text:
                shown = text.replace("{number}", t.text.split()[-1])
            return f"[{shown}]({self.url(t.doc, t.anchor)})"
        if name == "math":
            return f"${expand_macros(content, self.macros)}$"
        if name in PY_ROLES:
            obj = target.lstrip("~")
            shown = text or (obj.split(".")[-1] if target.startswith("~") else obj)
            if name in ("func", "meth", "py:func", "py:meth") and not text:
                shown += "()"
            return f"[`{shown}`]({self.url('book/api', obj)})"
        if name == "abbr":
            return re.sub(r"\s*\(.*\)$", "", content)
        if name in ("sub", "sup"):
            return f"<{name}>{content}</{name}>"
        if name == "download":
            rel = os.path.normpath(str(Path(self.doc).parent / target))
            return f"[{text or Path(target).name}]({self.repo}/blob/{self.ref}/{rel})"
        if name in ("kbd", "command", "file", "samp", "code", "literal", "guilabel", "menuselection"):
            return f"`{content}`"
        self.problems.append(f"role {{{name}}} has no conversion")
        return text or target

    def inline(self, text: str) -> str:
        """Roles, maths and code spans of a run of Markdown (no directive fences in it)."""
        out, i = [], 0
        for m in _fenced_blocks(text):  # plain ``` code blocks are left as they are
            out.append(self._inline(text[i:m[0]]))
            out.append(text[m[0]:m[1]])
            i = m[1]
        out.append(self._inline(text[i:]))
        return "".join(out)

    def _inline(self, text: str) -> str:
        def repl(m: re.Match) -> str:
            if m.group(1):
                return self.role(m.group(1), m.group(2))
            if m.group(3):
                return m.group(0)
            if m.group(4) is not None:
                body = expand_macros(m.group(4), self.macros)
                if m.group(5):
                    t = self._label(m.group(5), "eq")
                    body = body.rstrip() + (f" \\tag{{{t.text.strip('()')}}}" if t else "")
                    body = body if body.endswith("\n") or "\n" not in body else body + "\n"
                return f"$${body}$$"
            return f"${expand_macros(m.group(6), self.macros)}$"

        return INLINE.sub(repl, text)

    # ---- directives
    def literalinclude(self, arg: str, options: dict[str, str]) -> list[str]:
        rel = os.path.normpath(str(Path(self.doc).parent / arg))
        path = ROOT / rel
        source = path.read_text()
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
        where = f"[`{rel}`]({self.repo}/blob/{self.ref}/{rel})" + (f", `{obj}`" if obj else "")
        return [f"*From {where}:*", "", f"```{lang}", *source.rstrip().splitlines(), "```"]

    def _number(self, kind: str, options: dict[str, str]) -> str:
        if "nonumber" in options:
            return kind.capitalize()
        self.counters[kind] = self.counters.get(kind, 0) + 1
        return f"{kind.capitalize()} {self.counters[kind]}"

    def directive(self, name: str, arg: str, options: dict[str, str], body: list[str]) -> list[str]:
        arg_md = self.inline(arg).strip()
        if name.startswith("prf:") and name.split(":", 1)[1] in PROOF_TYPES:
            head = self._number(name.split(":", 1)[1], options)
            status = STATUS.get((options.get("class") or "").split()[0] if options.get("class") else "", "")
            first = f"**{head}" + (f" ({arg_md})" if arg_md else "") + ".**" + (f" *Status: {status}.*" if status else "")
            return quote([first, "", *self.convert(body)])
        if name == "prf:proof":
            inner = self.convert(body)
            return quote(["*Proof.*" + (f" ({arg_md})" if arg_md else ""), "", *inner, "", "∎"])
        if name in ("exercise", "exercise-start"):
            head = self._number("exercise", options)
            if options.get("label"):
                self.exercise_numbers[options["label"]] = head
            first = f"**{head}" + (f" ({arg_md})" if arg_md else "") + ".**"
            if name == "exercise-start":
                return ["---", "", first]
            return quote([first, "", *self.convert(body)])
        if name == "exercise-end":
            return []
        if name in ("solution", "solution-start"):
            which = self.exercise_numbers.get(arg.strip(), "the exercise")
            first = f"**Solution to {which}.**"
            if name == "solution-start":
                return [first]
            return quote([first, "", *self.convert(body)])
        if name == "solution-end":
            return [f"*End of the solution to {self.exercise_numbers.get(arg.strip(), 'the exercise')}.*", "", "---"]
        if name == "literalinclude":
            return self.literalinclude(arg, options)
        if name == "footbibliography":
            cited, self.cited = sorted(self.cited, key=self.bib.sort_key), []
            return [f"- {self.bib.reference(k)}" for k in cited] or ["*(no references)*"]
        if name in ("math",):
            tex = expand_macros("\n".join(body), self.macros)
            if options.get("label"):
                t = self._label(options["label"], "math")
                tex += f" \\tag{{{t.text.strip('()')}}}" if t else ""
            return ["$$", tex, "$$"]
        if name in ("code", "code-block", "code-cell", "sourcecode"):
            return [f"```{arg or 'python'}", *body, "```"]
        if name in ("figure", "image"):
            src = arg if re.match(r"https?://", arg) else (
                f"https://raw.githubusercontent.com/{self.repo.split('github.com/')[1]}/{self.ref}/"
                + os.path.normpath(str(Path(self.doc).parent / arg)))
            caption = self.convert(body)
            alt = options.get("alt") or (strip_roles(" ".join(body)).strip() or Path(arg).name)
            return [f"![{alt}]({src})", "", *(["*" + " ".join(caption).strip() + "*"] if caption else [])]
        if name in ("glue", "glue:", "glue:any", "glue:text", "glue:figure", "glue:math"):
            return [f"*(the value `{arg}` computed above; the book shows it here)*"]
        if name in DROPPED:
            if name == "bibliography":
                return [f"The full bibliography is on the book's [references page]({self.url('book/bibliography')})."]
            return []
        if name in ADMONITIONS:
            title = arg_md if name == "admonition" or (arg_md and name in ("dropdown", "card", "topic", "sidebar")) \
                else name.capitalize() + (f": {arg_md}" if arg_md else "")
            return quote([f"**{title or name.capitalize()}.**", "", *self.convert(body)])
        self.problems.append(f"directive {{{name}}} has no conversion")
        return quote([f"**{name.split(':')[-1].capitalize()}" + (f" ({arg_md})" if arg_md else "") + ".**", "",
                       *self.convert(body)])

    def convert(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        buf: list[str] = []

        def flush() -> None:
            if buf:
                out.extend(self.inline("\n".join(buf)).split("\n"))
                buf.clear()

        i = 0
        while i < len(lines):
            line = lines[i]
            code = CODE_FENCE.match(line)
            f = FENCE.match(line)
            if code and not f:  # a plain code block: copied as it is, with its closing fence
                fence = code.group(1)
                j = i + 1
                while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
                    j += 1
                buf.extend(lines[i:j + 1])
                i = j + 1
                continue
            if f:
                flush()
                indent, fence, name, arg = f.groups()
                j = i + 1
                depth = 0
                while j < len(lines):
                    s = lines[j].strip()
                    g = FENCE.match(lines[j])
                    if g and g.group(2)[0] == fence[0] and len(g.group(2)) == len(fence):
                        depth += 1  # a nested directive with the same fence
                    elif s and set(s) == {fence[0]} and len(s) >= len(fence):
                        if depth == 0:
                            break
                        depth -= 1
                    j += 1
                block = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
                options: dict[str, str] = {}
                while block and OPTION.match(block[0]):
                    o = OPTION.match(block[0])
                    options[o.group(1)] = o.group(2)
                    block = block[1:]
                while block and not block[0].strip():
                    block = block[1:]
                out.extend(["", *self.directive(name, arg, options, block), ""])
                i = j + 1
                continue
            i += 1
            if TARGET.match(line) or re.match(r"^%", line):  # (label)= targets and MyST comments
                continue
            buf.append(line)
        flush()
        return out

    def markdown(self, source: str) -> str:
        text = "\n".join(self.convert(source.splitlines()))
        return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def _fenced_blocks(text: str) -> list[tuple[int, int]]:
    spans = []
    for m in re.finditer(r"^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t]*\1[ \t]*$", text, re.M | re.S):
        spans.append((m.start(), m.end()))
    return spans


def quote(lines: list[str]) -> list[str]:
    """A blockquote (an empty line inside stays in the quote)."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return [("> " + ln) if ln.strip() else ">" for ln in lines]


# ------------------------------------------------------------------------------------------------ setup cell
INSTALL_BLOCK = '''\
# Setup. In Colab (or any kernel without curvlab, e.g. a fresh venv: pip install "curvlab[{extra}]"),
# install curvlab from this book's repository at REF, keeping the runtime's torch and numpy.
import importlib.util, os, subprocess, sys
REPO = "{repo}"
REF = "{ref}"  # the release tag in a release, else the branch the book is built from (tools/colab.py)
EXTRAS = "{extras}"  # what this chapter needs beyond curvlab's core{extras_note}
# find_spec("google.colab") imports the package "google" first: ask for it only where "google" exists
IN_COLAB = "COLAB_RELEASE_TAG" in os.environ or (
    importlib.util.find_spec("google") is not None and importlib.util.find_spec("google.colab") is not None)
if IN_COLAB and importlib.util.find_spec("curvlab") is None:
    import numpy, torch  # never reinstalled: pinned to the versions already there
    with open("/tmp/curvlab-pins.txt", "w") as pins:
        pins.write(f"torch=={{torch.__version__}}\\nnumpy=={{numpy.__version__}}\\n")
    pip = [sys.executable, "-m", "pip", "install", "-c", "/tmp/curvlab-pins.txt"]
    done = subprocess.run([*pip, f"curvlab{{EXTRAS}} @ git+{{REPO}}@{{REF}}#subdirectory=lib"], capture_output=True,
                          text=True, env={{**os.environ, "PIP_ROOT_USER_ACTION": "ignore"}})
    print("\\n".join(done.stdout.splitlines()[-3:]))
    if done.returncode:  # pip's own error, then stop here
        print(done.stderr, file=sys.stderr)
    done.check_returncode()
'''

FETCH_BLOCK = '''\
for name in {files!r}:  # data files the chapter reads: fetched when not here
    if not os.path.exists(name):
        import shutil, urllib.request
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        if os.path.exists(os.path.join("..", name)):  # a copy opened from notebooks/colab/ of a clone
            shutil.copy(os.path.join("..", name), name)
        else:  # Colab: from the repository at REF
            urllib.request.urlretrieve(f"{raw}/{{REF}}/notebooks/{{name}}", name)
'''


def chapter_needs(nb: dict[str, Any]) -> tuple[str, list[str]]:
    """(extras spec, data files) for a chapter, from its code cells (the setup cell excluded)."""
    code = [cell_source(c) for c in nb["cells"] if c["cell_type"] == "code"
            and "setup" not in c.get("metadata", {}).get("tags", [])]
    text = "\n".join(code)
    extras = f"[{EXTRA}]" if NEEDS_EXTRA.search(text) else ""
    files = sorted(set(DATA_FILE.findall(text)))
    return extras, files


def install_block(nb: dict[str, Any], ref: str, config: dict[str, Any] | None = None) -> str:
    config = config or load_config()
    extras, files = chapter_needs(nb)
    note = ": scikit-learn, ipywidgets" if extras else " (nothing)"
    block = INSTALL_BLOCK.format(repo=repo_url(config), ref=ref, extras=extras, extra=EXTRA, extras_note=note)
    if files:
        raw = "https://raw.githubusercontent.com/" + repo_url(config).split("github.com/")[1]
        block += FETCH_BLOCK.format(files=files, raw=raw)
    return block


def split_setup(src: str) -> tuple[str, str]:
    """(install block, the chapter's own part) of a setup cell: the block ends after the ``if ...colab...:`` body."""
    lines = src.splitlines(keepends=True)
    start_if = next((k for k, ln in enumerate(lines) if ln.startswith("if ") and re.search(r"colab|IN_COLAB", ln)),
                    None)
    if start_if is None:
        return "", src
    k = start_if + 1
    while k < len(lines) and (not lines[k].strip() or lines[k][0] in " \t"):
        k += 1
    # a data-file loop that follows belongs to the block as well
    if k < len(lines) and lines[k].startswith("for name in ") and "data files" in lines[k]:  # FETCH_BLOCK
        k += 1
        while k < len(lines) and (not lines[k].strip() or lines[k][0] in " \t"):
            k += 1
    return "".join(lines[:k]), "".join(lines[k:])


def setup_cell_index(nb: dict[str, Any]) -> int:
    for k, c in enumerate(nb["cells"]):
        if c["cell_type"] == "code":
            if "setup" not in c.get("metadata", {}).get("tags", []):
                raise ValueError("the first code cell is not tagged 'setup'")
            return k
    raise ValueError("no code cell")


def expected_setup_source(nb: dict[str, Any], ref: str, config: dict[str, Any] | None = None) -> str:
    src = cell_source(nb["cells"][setup_cell_index(nb)])
    _, rest = split_setup(src)
    return install_block(nb, ref, config) + rest


# ------------------------------------------------------------------------------------------------ the copy
def convert_notebook(path: Path, ref: str | None = None, *, index: BookIndex | None = None,
                     bib: Bibliography | None = None, config: dict[str, Any] | None = None) -> tuple[dict, list[str]]:
    """The clean copy of one chapter and the list of MyST constructs that had no conversion."""
    config = config or load_config()
    ref = ref or resolve_ref(config)
    index = index or BookIndex.build()
    bib = bib or Bibliography()
    macros = load_macros()
    doc = f"notebooks/{path.stem}"
    nb = json.loads(path.read_text())
    conv = Converter(doc, index, bib, macros, config, ref)
    out = copy.deepcopy(nb)
    setup_at = setup_cell_index(nb)
    cells = []
    for k, cell in enumerate(out["cells"]):
        cell = copy.deepcopy(cell)
        if cell["cell_type"] == "markdown":
            cell["source"] = conv.markdown(cell_source(cell))
        elif k == setup_at:
            cell["source"] = expected_setup_source(nb, ref, config)
        cells.append(cell)
    title = index.docs.get(doc, path.stem)
    intro = (
        f"${macro_definitions(macros)}$\n\n"
        f"*This is chapter [{title}]({conv.url(doc)}) of **Curvature Lab**, as a plain notebook for Colab and "
        f"JupyterLab: cross-references link to the book, the book's macros are defined in this cell. Run the setup "
        f"cell first (in Colab it installs `curvlab` from the repository at `{ref}`). Generated by `tools/colab.py` "
        f"from `notebooks/{path.name}`; do not edit it, edit the chapter.*"
    )
    cells.insert(0, {"cell_type": "markdown", "id": "colab-intro", "metadata": {}, "source": intro})
    out["cells"] = cells
    meta = out.setdefault("metadata", {})
    meta["colab"] = {"name": path.name, "provenance": [], "toc_visible": True}
    meta["curvlab"] = {"generated_from": f"notebooks/{path.name}", "generator": "tools/colab.py", "ref": ref}
    out = nbtool.normalize(out)
    out["cells"][0]["id"] = "colab-intro"
    return out, conv.problems


def generate(paths: list[Path], ref: str | None = None, check: bool = False) -> int:
    config = load_config()
    ref = ref or resolve_ref(config)
    index, bib = BookIndex.build(), Bibliography()
    OUT_DIR.mkdir(exist_ok=True)
    bad = 0
    for path in paths:
        nb, problems = convert_notebook(path, ref, index=index, bib=bib, config=config)
        for p in problems:
            print(f"{path.name}: {p}", file=sys.stderr)
        text = nbtool.dumps(nb)
        target = OUT_DIR / path.name
        if check:
            if not target.exists() or target.read_text() != text:
                print(f"{target.relative_to(ROOT)} is out of date: run `make colab`", file=sys.stderr)
                bad += 1
        elif not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
        bad += bool(problems) and not check
    if not check:
        stale = {p.name for p in OUT_DIR.glob("*.ipynb")} - {p.name for p in chapters()}
        for name in sorted(stale):
            (OUT_DIR / name).unlink()
            print(f"removed {name} (no such chapter)")
    return 1 if bad else 0


def fix_setup_cells(paths: list[Path], ref: str | None = None) -> int:
    """Rewrite the install block of each chapter's setup cell, and nothing else: the file is read right before it is
    written (other cells may be under edit by someone else)."""
    config = load_config()
    ref = ref or str(config["repository"].get("branch") or "main")
    for path in paths:
        nb = json.loads(path.read_text())
        k = setup_cell_index(nb)
        new = expected_setup_source(nb, ref, config)
        if cell_source(nb["cells"][k]) == new:
            continue
        nb["cells"][k]["source"] = new
        path.write_text(nbtool.dumps(nb))  # the stored form (nbtool); other cells exactly as read
        print(f"setup cell of {path.name} rewritten")
    return 0


LAB_MACROS_TAG = "curvlab-lab-macros"


def lab_frontmatter(macros: dict[str, tuple[str, int]] | None = None, *, numbered: bool = True) -> str:
    """MyST front matter defining the book's macros: what jupyterlab-myst reads from a notebook's first cell.
    ``numbered=False`` turns off its numbering of every display equation (a copy's ``\\tag`` carries the book's)."""
    macros = macros or load_macros()
    front: dict[str, Any] = {"math": {f"\\{k}": v for k, (v, _n) in macros.items()}}
    if not numbered:
        front["numbering"] = {"equation": False}
    return f"---\n{yaml.safe_dump(front, allow_unicode=True, width=1000)}---"


def lab_contents_manager():
    """A Jupyter contents manager that serves every notebook under notebooks/ with a first cell of front matter defining
    the book's macros (jupyterlab-myst reads ``math:`` there; for the clean copies it also turns off jupyterlab-myst's
    numbering of every display equation), and drops that cell again on save: the files on disk never hold it.
    ``make lab`` runs JupyterLab with it."""
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
    from nbformat.v4 import new_markdown_cell

    fronts = {True: lab_frontmatter(), False: lab_frontmatter(numbered=False)}

    def chapter(path: str) -> bool:
        p = Path(path.lstrip("/"))
        return p.suffix == ".ipynb" and p.parts[:1] == ("notebooks",)

    class MacroContentsManager(AsyncLargeFileManager):
        async def get(self, path, content=True, type=None, format=None, **kwargs):
            model = await super().get(path, content=content, type=type, format=format, **kwargs)
            if content and model.get("type") == "notebook" and chapter(path) and model.get("content") is not None:
                front = fronts["colab" not in Path(path.lstrip("/")).parts]
                cell = new_markdown_cell(front, metadata={"tags": [LAB_MACROS_TAG], "editable": False,
                                                          "deletable": False})
                cell["id"] = LAB_MACROS_TAG
                model["content"].cells.insert(0, cell)
            return model

        async def save(self, model, path=""):
            if model.get("type") == "notebook" and model.get("content") is not None:
                cells = model["content"]["cells"]
                model["content"]["cells"] = [c for c in cells
                                             if LAB_MACROS_TAG not in c.get("metadata", {}).get("tags", [])]
            return await super().save(model, path)

    return MacroContentsManager


def lab_command(port: int, token: str) -> list[str]:
    """JupyterLab on 127.0.0.1, opening the clean copies; ``--allow-root`` where the user is root (containers)."""
    cmd = [sys.executable, "-m", "jupyter", "lab", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.root_dir={ROOT}", f"--IdentityProvider.token={token}",
           "--LabApp.default_url=/lab/tree/notebooks/colab",
           "--ServerApp.contents_manager_class=curvlab_lab_contents.MacroContentsManager"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")
    return cmd


def launch_lab(port: int | None = None) -> int:
    import secrets
    import socket

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    token = secrets.token_hex(16)
    print("JupyterLab (with jupyterlab-myst): notebooks/colab/ holds the chapters as they read in Colab (roles as "
          "links, the book's macros defined); notebooks/ holds the MyST sources, shown with the book's macros.\n"
          f"Open  http://127.0.0.1:{port}/lab/tree/notebooks/colab?token={token}\n", flush=True)
    cmd = lab_command(port, token)
    shim = ROOT / ".curvlab_cache" / "lab"  # a module jupyter_server can import: the contents manager above
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "curvlab_lab_contents.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tools')!r})\nimport colab\n\n"
        "MacroContentsManager = colab.lab_contents_manager()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
    os.execve(sys.executable, cmd, env)
    return 0  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chapters", nargs="*", help="chapter stems or files (default: every chapter)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a stored copy is out of date")
    ap.add_argument("--ref", help="git ref the copies install curvlab from (default: tools/colab.py resolve_ref)")
    ap.add_argument("--fix-setup-cells", action="store_true", help="rewrite the chapters' setup-cell install block")
    ap.add_argument("--print-ref", action="store_true")
    ap.add_argument("--lab", action="store_true", help="start JupyterLab on 127.0.0.1 and print its URL")
    ap.add_argument("--port", type=int, help="JupyterLab's port (default: a free one)")
    args = ap.parse_args(argv)
    if args.lab:
        return launch_lab(args.port)
    if args.print_ref:
        print(args.ref or resolve_ref())
        return 0
    paths = chapters()
    if args.chapters:
        want = {Path(c).stem for c in args.chapters}
        paths = [p for p in paths if p.stem in want]
    if args.fix_setup_cells:
        return fix_setup_cells(paths, args.ref)
    return generate(paths, args.ref, check=args.check)



# ------------------------------------------------------------------------------------------------ what a copy may hold
#: Every TeX command the copies' formulas use, each checked to render in KaTeX 0.16 and MathJax 3 (all formulas of
#: all copies were rendered with both, without the macro definitions, when this list was last extended). A command
#: that is not here fails tests/test_channels_notebooks.py: check it renders in both, then add it.
TEX_COMMANDS = frozenset("""
Big Delta Gamma Lambda Phi Pi Psi Sigma Theta Xi alpha angle approx arccos arctan ast asymp bar begin beta big
bullet cap cdot cdots chi cos delta det dfrac dot dots downarrow ell end epsilon equiv eta frac gamma ge gg hat in inf
infty int kappa lVert lambda langle lceil le left leftarrow leftrightarrow lesssim lim ll ln log longrightarrow lvert
mapsto mathbb mathbf mathcal mathop mathrm mathsf max mid min mu nabla ne neq notin nu odot omega operatorname oplus
oslash otimes overline parallel partial perp phi pi pm preceq prod propto psi qquad quad rVert rangle rceil rho right
rvert sigma sim sin sqrt star subset subseteq succ succeq sum sup tag tan tanh tau text tfrac theta tilde times to top
underbrace upsilon varepsilon varphi varsigma vartheta xi xrightarrow zeta
Bigg Biggl Biggr Bigl Bigr bigg biggl biggr bigl bigr boldsymbol cdotp circ colon coloneqq cup ddot ddots emptyset
exp forall exists geq gets iff implies leq lfloor rfloor mathit mathscr max nmid not overbrace prime setminus sinh cosh
textbf textit triangleq underline varrho vdots vee wedge widehat widetilde hline displaystyle textstyle scriptstyle
limits nolimits gtrsim square Box ldots sharp flat natural dagger ddagger Pr arg lim liminf limsup
""".split())


def formulas(markdown: str) -> list[tuple[bool, str]]:
    """(display?, TeX) of every formula in a Markdown cell, outside code; blockquote markers removed."""
    s = re.sub(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$", "", markdown, flags=re.M | re.S)
    s = re.sub(r"(`+)(.+?)\1", "", s, flags=re.S)
    out = []
    for m in re.finditer(r"\$\$(.+?)\$\$|(?<![\\$])\$(?!\s)((?:\\\$|[^$])+?)(?<![\s\\])\$", s, re.S):
        tex = m.group(1) if m.group(1) is not None else m.group(2)
        out.append((m.group(1) is not None, re.sub(r"\n>[ ]?", "\n", tex)))
    return out


def tex_commands(tex: str) -> set[str]:
    return {w for w in re.findall(r"\\([A-Za-z]+|.)", tex, re.S) if w.isalpha()}


LEFTOVER = [
    ("a MyST role", re.compile(ROLE_RE)),
    ("a directive fence", re.compile(r"^\s*>?\s*(`{3,}|:{3,})\{[\w:-]+\}", re.M)),
    ("a (label)= target", re.compile(r"^\s*>?\s*\([^()\s]+\)=\s*$", re.M)),
    ("a directive option", re.compile(r"^\s*>?\s*:(label|class|name|nonumber|pyobject|language|enumerated):", re.M)),
    ("an equation label", re.compile(r"\$\$[ \t]*\([\w:.-]+\)")),
]


def leftovers(nb: dict[str, Any]) -> list[str]:
    """MyST syntax and undefined TeX commands left in a copy's Markdown (code blocks and spans excluded)."""
    defined = set(load_macros())
    found = []
    for k, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        src = cell_source(cell)
        text = re.sub(r"^[ \t>]*(`{3,}|~{3,})(?!\{).*?^[ \t>]*\1[ \t]*$", "", src, flags=re.M | re.S)
        text = _drop_code_spans(text)
        for what, pattern in LEFTOVER:
            for m in pattern.finditer(text):
                found.append(f"cell {k}: {what}: {m.group(0).strip()[:60]!r}")
        if k == 0:
            continue  # the definitions themselves
        for _display, tex in formulas(src):
            for cmd in sorted(tex_commands(tex) - TEX_COMMANDS):
                why = "a book macro left unexpanded" if cmd in defined else "unknown to the list checked in KaTeX/MathJax"
                found.append(f"cell {k}: \\{cmd} ({why}) in ${tex.strip()[:50]}$")
    return found


def _drop_code_spans(text: str) -> str:
    """Code spans removed, roles kept: a role's backticks are not a code span."""
    out, i = [], 0
    for m in re.finditer(ROLE_RE + r"|(?<!`)(`{1,2})(?!`)(.+?)(?<!`)\3(?!`)", text, re.S):
        if m.group(3):
            out.append(text[i:m.start()])
            i = m.end()
    out.append(text[i:])
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())

