"""Build a reveal.js deck per chapter from the executed notebooks: ``make slides``.

    python tools/slides.py [--profile quick] [--jobs 2] [--out _build/slides] [--force] [CHAPTER ...]

1. **Execute** each chapter (all chapters of ``_toc.yml``, or the stems given) in the book-build environment of
   the profile (``CURVLAB_BOOK_BUILD=1``: no progress bars, static fallbacks for widgets), with one extra cell
   right after the setup cell, ``curvlab.plotting.set_theme("projector")``, so every figure is drawn in the
   projector context. Executed copies are kept in ``<out>/.executed/``, keyed on the notebook's code, the
   library's source and the profile (the same key as the book's execution cache), so a rerun re-executes only
   what changed. The chapters' check records go to ``<out>/.ledger/``, never into the book's ledger.
2. **Convert** the MyST Markdown the book's extensions render (theorem blocks, proofs, exercises, gated
   solutions, ``literalinclude``, citations, cross-references) into plain Markdown + HTML that a slide can show:
   theorem-like blocks become boxes with their status, proofs collapse into ``<details>``, exercises are shown
   and their **solutions left out** (text and code), ``literalinclude`` inlines the library function, citations
   become "Author (year)" with a reference list on the last slide.
3. **Export** with nbconvert's reveal template, its CDN links replaced: reveal.js comes from the PyPI package
   ``sphinx-revealjs`` (which vendors reveal.js 5) and MathJax 3 from ``django-static-mathjax`` (as in the
   book), both copied into ``<out>/_static/``. The decks work offline: ``tests/test_lecture_kit.py`` fails on
   any ``http(s)`` script or stylesheet in the output. The notation macros of ``book/macros.yml`` are given to
   MathJax, as in the book.

Slide boundaries come from the cells' ``slideshow`` metadata, which ``tools/nbtool.py normalize`` sets by the
rules of ``book/conventions.md`` (section *Slides*).
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import html
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import curvlab_book  # noqa: E402  (the book's extension: build environment and cache key)

PROJECTOR_CELL = 'curvlab.plotting.set_theme("projector")  # slides: larger fonts and lines'
DEFAULT_OUT = ROOT / "_build" / "slides"
STATUS = {"status-proved": "proved here", "status-checked": "checked here", "status-stated": "stated from a paper"}
ADMONITIONS = {"note", "tip", "hint", "important", "warning", "caution", "attention", "danger", "error", "seealso",
               "admonition", "dropdown", "margin", "sidebar", "topic"}


# ------------------------------------------------------------------------------------------------ chapters
def toc_chapters() -> list[Path]:
    """Chapter notebooks listed in ``_toc.yml``, in order (the book build's own list)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from build_book import toc_notebooks

    return toc_notebooks()


def resolve_chapters(names: list[str]) -> list[Path]:
    chapters = toc_chapters()
    if not names:
        return chapters
    out = []
    for name in names:
        stem = Path(name).stem
        match = [p for p in chapters if p.stem == stem or p.stem.startswith(stem + "_") or p.stem.split("_")[0] == stem]
        if not match:
            raise SystemExit(f"no chapter in _toc.yml matches {name!r}")
        out.extend(m for m in match if m not in out)
    return out


# ------------------------------------------------------------------------------------------------ execution
def with_projector_theme(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` with a hidden cell setting the projector context right after the setup cell."""
    nb = copy.deepcopy(nb)
    where = next((i for i, c in enumerate(nb.cells) if "setup" in c.metadata.get("tags", [])), None)
    if where is None:
        raise ValueError("the notebook has no setup cell (tag 'setup'): see book/conventions.md")
    cell = nbformat.v4.new_code_cell(PROJECTOR_CELL, metadata={"tags": ["remove-cell"], "slideshow": {"slide_type": "skip"}})
    cell.id = "slides-projector-theme"
    nb.cells.insert(where + 1, cell)
    return nb


def execution_key(nb: nbformat.NotebookNode, profile: str) -> str:
    h = hashlib.sha256(curvlab_book.library_key(profile).encode())
    h.update(PROJECTOR_CELL.encode())
    for c in nb.cells:
        if c.cell_type == "code":
            h.update(c.source.encode() + b"\0")
    return h.hexdigest()[:16]


def _execute(path: str, out: str, env: dict[str, str], timeout: int) -> tuple[str, float, str | None]:
    from nbclient import NotebookClient

    os.environ.update(env)
    nb = with_projector_theme(nbformat.read(path, as_version=4))
    t0 = time.time()
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(Path(path).parent)}}).execute()
    except Exception as exc:  # noqa: BLE001  (reported, the other decks still build)
        return path, time.time() - t0, f"{type(exc).__name__}: {str(exc)[-2000:]}"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return path, time.time() - t0, None


def execute_all(chapters: list[Path], out_dir: Path, profile: str, jobs: int, force: bool, timeout: int) -> dict[Path, Path]:
    env = curvlab_book.build_environment(profile)
    env["CURVLAB_LEDGER_DIR"] = str(out_dir / ".ledger")
    threads = str(max(1, (os.cpu_count() or 1) // max(1, jobs)))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, os.environ.get(var, threads))
    executed: dict[Path, Path] = {}
    todo = []
    for p in chapters:
        key = execution_key(nbformat.read(p, as_version=4), profile)
        target = out_dir / ".executed" / f"{p.stem}-{profile}-{key}.ipynb"
        executed[p] = target
        if force or not target.exists():
            todo.append((p, target))
        else:
            print(f"  {p.stem}: executed copy up to date", flush=True)
    failed = []
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_execute, str(p), str(t), env, timeout) for p, t in todo]
        for fut in futures:
            path, seconds, err = fut.result()
            if err:
                failed.append(Path(path).stem)
                print(f"  FAILED {Path(path).stem} after {seconds:.1f} s: {err}", flush=True)
            else:
                print(f"  executed {Path(path).stem} in {seconds:.1f} s ({profile}, projector context)", flush=True)
    return {p: t for p, t in executed.items() if p.stem not in failed}


# ------------------------------------------------------------------------------------------------ MyST -> Markdown
class Bibliography:
    """Author–year labels and reference lines from ``book/references.bib`` (pybtex ships with sphinxcontrib-bibtex)."""

    def __init__(self, path: Path = ROOT / "book" / "references.bib") -> None:
        from pybtex.database import parse_file

        self.entries = parse_file(str(path)).entries if path.exists() else {}

    def _authors(self, key: str) -> str:
        entry = self.entries.get(key)
        if entry is None:
            return key
        people = entry.persons.get("author") or entry.persons.get("editor") or []
        last = [" ".join(p.last_names).replace("{", "").replace("}", "") for p in people]
        if not last:
            return key
        return last[0] if len(last) == 1 else f"{last[0]} and {last[1]}" if len(last) == 2 else f"{last[0]} et al."

    def year(self, key: str) -> str:
        entry = self.entries.get(key)
        return entry.fields.get("year", "n.d.") if entry is not None else "n.d."

    def cite(self, keys: list[str], parenthetical: bool) -> str:
        if parenthetical:
            return "(" + "; ".join(f"{self._authors(k)}, {self.year(k)}" for k in keys) + ")"
        return "; ".join(f"{self._authors(k)} ({self.year(k)})" for k in keys)

    def reference(self, key: str) -> str:
        entry = self.entries.get(key)
        if entry is None:
            return f"{key} (not in the bibliography)"
        clean = lambda s: re.sub(r"[{}]", "", s)  # noqa: E731
        people = entry.persons.get("author") or []
        names = ", ".join(clean(" ".join(p.first_names + p.middle_names + p.last_names)) for p in people[:6])
        names += " et al." if len(people) > 6 else ""
        venue = entry.fields.get("journal") or entry.fields.get("booktitle") or entry.fields.get("publisher") or ""
        title = clean(entry.fields.get("title", ""))
        return f"{names} ({self.year(key)}). *{title}*." + (f" {clean(venue)}." if venue else "")


FENCE = re.compile(r"^(\s*)(`{3,}|:{3,})\{([A-Za-z][\w:-]*)\}\s*(.*)$")
ROLE = re.compile(r"\{([A-Za-z][\w:+-]*)\}`([^`]+)`")
OPTION = re.compile(r"^\s*:([A-Za-z][\w-]*):\s*(.*)$")


class MystToSlides:
    """Convert one chapter's MyST Markdown cells to Markdown + HTML for nbconvert's reveal exporter.

    State runs across cells, because the gated exercise form opens a solution in one cell and closes it in another:
    while ``in_solution`` is true every line and every code cell is left out of the deck.
    """

    def __init__(self, notebook_dir: Path, bib: Bibliography, nb: nbformat.NotebookNode) -> None:
        self.dir = notebook_dir
        self.bib = bib
        self.in_solution = False
        self.cited: list[str] = []
        self.labels: dict[str, str] = {}
        for c in nb.cells:  # theorem-like labels -> "Lemma (Stein's lemma)"
            if c.cell_type != "markdown":
                continue
            lines = c.source.splitlines()
            for i, line in enumerate(lines):
                m = FENCE.match(line)
                if m and m.group(3).startswith("prf:"):
                    for opt in lines[i + 1 : i + 6]:
                        o = OPTION.match(opt)
                        if o and o.group(1) == "label":
                            kind = m.group(3).split(":", 1)[1].capitalize()
                            self.labels[o.group(2).strip()] = f"{kind} ({m.group(4).strip()})" if m.group(4).strip() else kind

    # ---- roles
    def _doc_title(self, target: str) -> str:
        base = (self.dir / target).resolve()
        for suffix in (".ipynb", ".md"):
            f = base.with_suffix(suffix)
            if f.exists():
                try:
                    if suffix == ".ipynb":
                        text = next(c.source for c in nbformat.read(f, as_version=4).cells if c.cell_type == "markdown")
                    else:
                        text = f.read_text()
                    m = re.search(r"^#\s+(.+)$", text, flags=re.M)
                    if m:
                        return m.group(1).strip()
                except (OSError, StopIteration, ValueError):
                    pass
        return Path(target).name.replace("_", " ")

    def role(self, m: re.Match) -> str:
        name, content = m.group(1), m.group(2)
        explicit = re.match(r"^(.*?)\s*<([^>]+)>$", content, flags=re.S)
        text, target = (explicit.group(1), explicit.group(2)) if explicit else (None, content)
        if name.startswith("footcite"):
            keys = [k.strip() for k in content.split(",") if k.strip()]
            self.cited.extend(k for k in keys if k not in self.cited)
            return self.bib.cite(keys, parenthetical=name.endswith(":p") or name == "footcite")
        if name == "doc":
            return f"*{text or self._doc_title(target)}*"
        if name == "prf:ref":
            return text or self.labels.get(target, target)
        if name in ("ref", "numref"):
            return text or target.replace("-", " ")
        if name == "eq":
            return f"({target})"
        if name == "math":
            return f"${content}$"
        if name in ("func", "class", "meth", "mod", "attr", "obj", "data", "exc") or name.startswith("py:"):
            return f"`{target.lstrip('~')}`"
        if name == "download":
            return text or Path(target).name
        return text or target  # term, abbr, sub, ...

    def roles(self, line: str) -> str:
        return ROLE.sub(self.role, line)

    # ---- directives
    def literalinclude(self, arg: str, options: dict[str, str]) -> list[str]:
        path = (self.dir / arg).resolve()
        try:
            source = path.read_text()
        except OSError:
            return [f"*(listing: {arg})*"]
        obj = options.get("pyobject")
        if obj:
            tree = ast.parse(source)
            node = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == obj.split(".")[-1]), None)
            if node is not None:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                source = "\n".join(source.splitlines()[start - 1 : node.end_lineno])
        lang = options.get("language", "python")
        return [f"```{lang}", *source.splitlines(), "```"]

    def directive(self, name: str, arg: str, options: dict[str, str], body: list[str]) -> list[str]:
        if name == "exercise-start":
            return ["", f'<div class="curvlab-box curvlab-exercise">', "", f"**Exercise.** {self.roles(arg)}", ""]
        if name == "exercise-end":
            return ["", "</div>", ""]
        if name == "solution-start":
            self.in_solution = True
            return []
        if name == "solution-end":
            self.in_solution = False
            return []
        if name == "solution":
            return []
        inner = self.convert_lines(body)
        if name.startswith("prf:") and name != "prf:proof":
            kind = name.split(":", 1)[1].capitalize()
            status = STATUS.get(options.get("class", "").split()[0] if options.get("class") else "", "")
            head = f"**{kind}**" + (f" ({self.roles(arg)})" if arg else "") + (f" · *{status}*" if status else "")
            return ["", f'<div class="curvlab-box curvlab-prf">', "", head, "", *inner, "", "</div>", ""]
        if name == "prf:proof":
            return ["", '<details class="curvlab-proof"><summary>Proof</summary>', "", *inner, "", "</details>", ""]
        if name == "exercise":
            return ["", '<div class="curvlab-box curvlab-exercise">', "", f"**Exercise.** {self.roles(arg)}", "", *inner, "", "</div>", ""]
        if name == "literalinclude":
            return ["", *self.literalinclude(arg, options), ""]
        if name == "footbibliography":
            return ["", *[f"- {self.bib.reference(k)}" for k in self.cited], ""]
        if name in ("math",):
            return ["", "$$", *body, "$$", ""]
        if name in ("code", "code-block", "code-cell"):
            return ["", f"```{arg}", *body, "```", ""]
        if name in ADMONITIONS:
            title = self.roles(arg) if arg else name.capitalize()
            return ["", f'<div class="curvlab-box curvlab-{name}">', "", f"**{title}**", "", *inner, "", "</div>", ""]
        if name in ("figure", "image"):
            return ["", f"*(figure: {arg})*", *inner, ""]
        if name in ("bibliography", "toctree", "tableofcontents", "curvlab-ledger", "curvlab-status"):
            return []
        return ["", *inner, ""]

    def convert_lines(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if m:
                fence, name, arg = m.group(2), m.group(3), m.group(4).strip()
                j = i + 1
                while j < len(lines):
                    s = lines[j].strip()
                    if s and set(s) == {fence[0]} and len(s) >= len(fence):
                        break
                    j += 1
                block = lines[i + 1 : j]
                options: dict[str, str] = {}
                while block and OPTION.match(block[0]):
                    o = OPTION.match(block[0])
                    options[o.group(1)] = o.group(2).strip()
                    block = block[1:]
                i = j + 1
                if self.in_solution and name != "solution-end":
                    continue
                out.extend(self.directive(name, arg, options, block))
                continue
            line = lines[i]
            i += 1
            if self.in_solution or re.match(r"^\s*\([\w:-]+\)=\s*$", line) or re.match(r"^%", line):
                continue
            out.append(self.roles(line))
        return out

    def markdown(self, source: str) -> str:
        text = "\n".join(self.convert_lines(source.splitlines()))
        return re.sub(r"\n{3,}", "\n\n", text).strip()


def slide_notebook(nb: nbformat.NotebookNode, notebook_dir: Path, bib: Bibliography | None = None) -> nbformat.NotebookNode:
    """The executed chapter turned into the notebook the reveal exporter renders (cells, metadata and outputs)."""
    nb = copy.deepcopy(nb)
    conv = MystToSlides(notebook_dir, bib or Bibliography(), nb)
    kept = []
    carry: str | None = None  # a dropped cell's slide start moves to the next kept cell
    for cell in nb.cells:
        tags = set(cell.metadata.get("tags", []))
        stype = cell.metadata.get("slideshow", {}).get("slide_type", "-")
        drop = "remove-cell" in tags or stype == "skip"
        if cell.cell_type == "markdown":
            cell.source = conv.markdown(cell.source)
            drop = drop or not cell.source.strip()
        elif cell.cell_type == "code":
            drop = drop or conv.in_solution
            if "remove-output" in tags:
                cell.outputs = []
            cell.outputs = [o for o in cell.outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
            for o in cell.outputs:  # no live widgets on a slide: keep the static representations
                if "data" in o:
                    o["data"].pop("application/vnd.jupyter.widget-view+json", None)
            hidden_input = bool(tags & {"remove-input", "hide-input"})
            drop = drop or ((hidden_input or not cell.source.strip()) and not cell.outputs)
        else:
            drop = True
        if drop:
            if stype in ("slide", "subslide") and carry != "slide":
                carry = stype
            continue
        if carry and stype in ("-", "fragment"):
            cell.metadata.setdefault("slideshow", {})["slide_type"] = carry
        carry = None
        kept.append(cell)
    nb.cells = kept
    nb.metadata.pop("widgets", None)
    return nb


# ------------------------------------------------------------------------------------------------ export
TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}
<script>
window.MathJax = {
  tex: {inlineMath: [['$', '$'], ['\\(', '\\)']], displayMath: [['$$', '$$'], ['\\[', '\\]']],
        processEscapes: true, macros: {{ resources.curvlab.macros_json }}},
  svg: {fontCache: 'global'},
  options: {skipHtmlTags: ['script', 'noscript', 'style', 'textarea', 'pre', 'code']}
};
</script>
<script src="{{ resources.curvlab.static }}/mathjax/{{ resources.curvlab.mathjax_name }}"></script>
{%- endblock html_head_js_mathjax -%}
{%- block html_head_css -%}
<style type="text/css">{{ resources.curvlab.css }}</style>
{%- endblock html_head_css -%}
{% block footer_js %}
<script src="{{ resources.reveal.url_prefix }}/dist/reveal.js"></script>
<script src="{{ resources.reveal.url_prefix }}/plugin/notes/notes.js"></script>
<script>
Reveal.initialize({
  controls: true, progress: true, history: true, center: false, hash: true,
  transition: "{{ resources.reveal.transition }}", slideNumber: "c/t",
  width: {{ resources.reveal.width }}, height: {{ resources.reveal.height }}, margin: 0.04,
  plugins: [RevealNotes]
});
</script>
{% endblock footer_js %}
"""

CSS = """
:root { --jp-content-font-size1: 25px; --jp-ui-font-size1: 22px; --jp-code-font-size: 17px; --jp-cell-prompt-width: 0px; }
.reveal .slides { text-align: left; }
.reveal .slides > section, .reveal .slides > section > section { height: 100%; overflow-y: auto !important; padding-right: 0.5em; }
.reveal h1, .reveal h2, .reveal h3 { text-transform: none !important; text-align: left; margin-bottom: 0.4em; }
.reveal h1 { font-size: 1.6em !important; } .reveal h2 { font-size: 1.3em !important; } .reveal h3 { font-size: 1.05em !important; }
.reveal p, .reveal li { font-size: inherit; line-height: 1.35; }
.reveal .jp-OutputArea-output pre { max-height: 12em; overflow: auto; }
.reveal .jp-InputPrompt, .reveal .jp-OutputPrompt { display: none; }
.reveal .jp-RenderedHTMLCommon table { font-size: 0.7em; }
.reveal figure.curvlab-figure img { max-height: 560px; width: auto; }
.reveal figure.curvlab-figure figcaption { font-size: 0.75em; }
.reveal .curvlab-box { border-left: 6px solid #0072B2; background: #f2f7fb; padding: 0.1em 0.8em; margin: 0.4em 0; }
.reveal .curvlab-exercise { border-left-color: #009E73; background: #f0faf6; }
.reveal details.curvlab-proof { margin: 0.3em 0; font-size: 0.9em; }
.reveal details.curvlab-proof summary { font-style: italic; cursor: pointer; }
.reveal pre code { max-height: 460px; }
"""


def mathjax_source() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        return None
    src = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5" / "tex-svg-full.js"
    return src if src.exists() else None


def reveal_source() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("sphinx_revealjs")
    if spec is None or not spec.submodule_search_locations:
        return None
    src = Path(next(iter(spec.submodule_search_locations))) / "_static" / "revealjs"
    return src if (src / "dist" / "reveal.js").exists() else None


def vendor_assets(out_dir: Path) -> tuple[str, str]:
    """Copy reveal.js (dist + notes plugin + licence) and MathJax into ``<out>/_static``; return their names."""
    reveal, mathjax = reveal_source(), mathjax_source()
    if reveal is None or mathjax is None:
        raise SystemExit(
            "slides need reveal.js (PyPI: sphinx-revealjs) and MathJax (PyPI: django-static-mathjax), bundled so the "
            "decks work offline: run `make env` (both are in lib/pyproject.toml's `book` extra)"
        )
    static = out_dir / "_static"
    dest = static / "reveal.js"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(reveal / "dist", dest / "dist", ignore=shutil.ignore_patterns("*.map", "*.esm.js"))
    shutil.copytree(reveal / "plugin" / "notes", dest / "plugin" / "notes", ignore=shutil.ignore_patterns("*.map", "*.esm.js"))
    if (reveal / "LICENSE").exists():
        shutil.copy2(reveal / "LICENSE", dest / "LICENSE")
    (static / "mathjax").mkdir(parents=True, exist_ok=True)
    shutil.copy2(mathjax, static / "mathjax" / mathjax.name)
    return "_static", mathjax.name


def export(nb: nbformat.NotebookNode, static: str, mathjax_name: str) -> str:
    from jinja2 import DictLoader
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    macros = yaml.safe_load((ROOT / "book" / "macros.yml").read_text()) or {}
    # cells tagged hide-input/remove-input show their output only (nbconvert's TagRemovePreprocessor)
    config = Config({"TagRemovePreprocessor": {"enabled": True, "remove_input_tags": ["remove-input", "hide-input"]}})
    exporter = SlidesExporter(
        config=config,
        extra_loaders=[DictLoader({"curvlab_reveal.html.j2": TEMPLATE})],
        template_file="curvlab_reveal.html.j2",
        reveal_url_prefix=f"{static}/reveal.js",
        reveal_theme="white",
        reveal_transition="none",
        reveal_width="1280",
        reveal_height="800",
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )
    resources = {"curvlab": {"macros_json": json.dumps(macros), "static": static, "mathjax_name": mathjax_name, "css": CSS}}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return body


def index_page(decks: list[tuple[str, str]]) -> str:
    items = "\n".join(f'<li><a href="{html.escape(f)}">{html.escape(t)}</a></li>' for f, t in decks)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Curvature Lab — slides</title></head>'
        f"<body><h1>Curvature Lab — lecture slides</h1><ul>\n{items}\n</ul>"
        "<p>Keys: arrows to move, <kbd>s</kbd> for speaker notes, <kbd>Esc</kbd> for the overview. "
        "Everything is served from this folder: no network needed.</p></body></html>\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", help="chapter stems or numbers (default: every chapter in _toc.yml)")
    parser.add_argument("--profile", default=os.environ.get("CURVLAB_PROFILE", "quick"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="re-execute even when an executed copy is up to date")
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args(argv)
    t0 = time.time()
    chapters = resolve_chapters(args.chapters)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"slides: {len(chapters)} chapter(s), profile {args.profile}, into {out}", flush=True)
    static, mj = vendor_assets(out)
    executed = execute_all(chapters, out, args.profile, args.jobs, args.force, args.timeout)
    bib = Bibliography()
    decks = []
    for chapter, path in executed.items():
        nb = slide_notebook(nbformat.read(path, as_version=4), chapter.parent, bib)
        target = out / f"{chapter.stem}.slides.html"
        target.write_text(export(nb, static, mj))
        title = next((re.sub(r"^#\s*", "", c.source.splitlines()[0]) for c in nb.cells if c.cell_type == "markdown"), chapter.stem)
        decks.append((target.name, title))
        print(f"  wrote {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}", flush=True)
    (out / "index.html").write_text(index_page(decks))
    missing = len(chapters) - len(executed)
    print(f"slides: {len(decks)} deck(s) in {time.time() - t0:.0f} s; open {out / 'index.html'}" + (f"; {missing} failed" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
