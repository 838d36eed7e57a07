"""Build a reveal.js deck per chapter from the executed notebooks: ``make slides``.

    python tools/slides.py [--profile quick] [--jobs 2] [--out _build/slides] [--force] [CHAPTER ...]

1. **Execute** each chapter (all chapters of ``_toc.yml``, or the stems given) in the book-build environment of
   the profile (``CURVLAB_BOOK_BUILD=1``: no progress bars, static fallbacks for widgets), with one extra cell
   right after the setup cell, ``curvlab.plotting.set_theme("projector")``, so every figure is drawn in the
   projector context. Executed copies are kept in ``<out>/.executed/``, keyed on the notebook's code, the
   library's source and the profile (the same key as the book's execution cache), so a rerun re-executes only
   what changed. The chapters' check records go to ``<out>/.ledger/``, never into the book's ledger.
2. **Convert** the MyST Markdown with the shared export layer (``tools/myst_export.py``, as the Colab copies and
   student notebooks): theorem-like blocks become boxes with their number, title and status, exercises are shown
   and their **solutions left out** (text and code), ``literalinclude`` inlines the library function, citations
   become "Author (year)" with a reference list decoded from BibTeX to Unicode, cross-references "Lemma 7 (title)"
   as the book numbers them.
3. **Lay out** the slides (``DeckLayout``) from an estimate of each block's rendered height on the 1280 x 800
   canvas: ``#``/``##`` start a slide, ``###`` one below it; a section longer than a slide continues on slides
   below, titled like it, split between paragraphs, sentences, list items, code lines or a box's blocks; a theorem,
   proof or exercise box starts its own slide; **every figure gets a slide of its own**, scaled to the room left;
   code inputs are hidden unless the cell is tagged ``slide-code``; a Markdown cell tagged ``notes`` becomes the
   previous slide's speaker notes (``s`` in the deck); a book paragraph of more than ``SLIDE_WORDS`` words shows
   its lead sentence on the slide and goes, whole, into the slide's notes, and so does a list with such items
   (each long item cut to its lead sentence on the slide). A slide that still overflows in the
   browser scrolls.
   ``tests/test_slides.py`` checks every chapter's layout and renders one deck in headless Chromium.
4. **Export** with nbconvert's reveal template, its CDN links replaced: reveal.js (with its notes plugin) comes
   from the PyPI package ``sphinx-revealjs`` (which vendors reveal.js 5) and MathJax 3 from
   ``django-static-mathjax`` (as in the book), both copied into ``<out>/_static/``. The decks work offline:
   ``tests/test_lecture_kit.py`` fails on any ``http(s)`` script or stylesheet in the output. The notation macros
   of ``book/macros.yml`` are given to MathJax, as in the book.

``--outputs book-cache`` skips step 1 and takes the outputs of the book's execution cache for the profile (what
``make book`` left; figures then in the book's context, not the projector's).
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import curvlab_book  # noqa: E402  (the book's extension: build environment and cache key)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import myst_export  # noqa: E402  (the MyST -> notebook Markdown layer, shared with the Colab and student copies)

PROJECTOR_CELL = 'curvlab.plotting.set_theme("projector")  # slides: larger fonts and lines'
DEFAULT_OUT = ROOT / "_build" / "slides"


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


def execution_note(stems: list[str], profile: str, jobs: int, what: str = "slides") -> str:
    """What is about to run and about how long it takes: the chapters' kernel times in the latest book build of this
    profile that recorded them (``_build/execution/<profile>-*.json``), or a pointer to the running page."""
    records = sorted((ROOT / "_build" / "execution").glob(f"{profile}-*.json"), key=lambda p: p.stat().st_mtime)
    seconds: dict[str, float] = {}
    for rec in records:  # oldest first: the latest build's times win
        try:
            data = json.loads(rec.read_text())
        except (OSError, ValueError):
            continue
        for rel, row in data.items():
            if row.get("runtime"):
                seconds[Path(rel).name] = float(row["runtime"])
    known = [seconds[s] for s in stems if s in seconds]
    head = f"{what}: profile {profile}: executing {len(stems)} chapter(s), {max(1, jobs)} at a time"
    if known:
        total = sum(known)
        est = f"; the last {profile} book build took {total:.0f} s of kernel time for {len(known)} of them " \
              f"(about {total / max(1, jobs) / 60:.0f} min here)"
    else:
        est = f"; no {profile} build has recorded times yet (book/running.md lists what to expect)"
    other = "quick" if profile != "quick" else "standard"
    return head + est + f". PROFILE={other} runs the {other} profile" + (
        "; OUTPUTS=book-cache takes the book's outputs without running anything" if what == "slides" else "")


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
    if todo:
        print(execution_note([p.stem for p, _ in todo], profile, jobs), flush=True)
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
# One conversion for every copy of a chapter: tools/myst_export.py (the parser the book uses, the book's numbers and
# titles for references). The slides ask it for HTML boxes (the layout below measures them), plain-text references,
# solutions left out, and the macros left to MathJax (the deck defines them, as the book does).
Bibliography = myst_export.Bibliography
latex_to_text = myst_export.latex_to_text
_INDEX: list[myst_export.BookIndex] = []


def book_index() -> myst_export.BookIndex:
    if not _INDEX:
        _INDEX.append(myst_export.BookIndex.build())
    return _INDEX[0]


def slide_exporter(notebook_dir: Path, bib: Bibliography | None = None, stem: str = "deck") -> myst_export.Exporter:
    """The export layer as the slides use it: for a chapter in ``notebook_dir`` (paths resolve from there)."""
    rel = Path(notebook_dir).resolve()
    rel = rel.relative_to(ROOT) if rel.is_relative_to(ROOT) else Path("notebooks")
    return myst_export.Exporter((rel / stem).as_posix(), index=book_index(), bib=bib or Bibliography(),
                                boxes="html", solutions="hide", links=False, expand=False)


# ------------------------------------------------------------------------------------------------ slide layout
# A slide is laid out here, in Python, from an estimate of each block's rendered height (px at the deck's CSS on the
# 1280 x 800 canvas). The model is deliberately on the safe side; tests/test_slides.py renders a deck in headless
# Chromium and measures every slide, and the deck itself makes any slide that still overflows scrollable.
CANVAS = (1280, 800)
BUDGET = 700  # px of estimated content per slide: the canvas less the padding and a safety margin
SLIDE_CODE_TAG = "slide-code"  # a code cell whose *input* the slide shows (inputs are hidden by default)
NOTES_TAG = "notes"  # a Markdown cell that becomes the previous slide's speaker notes (<aside class="notes">)
OWN_SLIDE_BOXES = ("curvlab-prf", "curvlab-proof", "curvlab-exercise")  # theorem-like blocks start their own slide

TEXT_LINE, TEXT_CHARS, PARA_GAP = 34.0, 88, 22.0  # body text: 25 px font, line height 1.35
CODE_LINE, CODE_CHARS, CODE_PAD = 22.0, 100, 34.0  # code and plain-text outputs: 17 px monospace
MATH_ROW, MATH_TALL, MATH_PAD = 44.0, 22.0, 34.0  # a display-equation row; extra for fractions, sums, matrices
HEADING = {1: 72.0, 2: 62.0, 3: 52.0}
CONT_TITLE, BOX_PAD, CAPTION_LINE, CAPTION_CHARS, CONTENT_W = 44.0, 40.0, 26.0, 118, 1180.0
TALL_TEX = re.compile(r"\\(frac|dfrac|sum|prod|int|begin\{(p|b|v)?matrix\}|underbrace|overbrace|binom|sqrt\{[^}]*\\frac)")


@dataclass
class Block:
    """One unit of a slide's Markdown: a heading, a paragraph, a list, a display equation, a code listing, or a
    box (theorem, proof, exercise, admonition) holding blocks of its own."""

    kind: str  # heading | text | list | math | code | box
    text: str  # the Markdown (a box: its head line)
    level: int = 0  # a heading's level
    open: str = ""  # a box: its opening tag
    children: list[Block] = field(default_factory=list)

    def markdown(self) -> str:
        if self.kind == "box":
            return "\n\n".join([self.open, self.text, *(c.markdown() for c in self.children), "</div>"])
        return self.text


BOX_OPEN = re.compile(r"^<(div|details)\b[^>]*>\s*$")
BOX_CLOSE = re.compile(r"^</(div|details)>\s*$")
LIST_ITEM = re.compile(r"^([-*+]|\d+[.)])\s+")
HEAD = re.compile(r"^(#{1,6})\s+(.*)$")


def _starts_block(line: str) -> bool:
    s = line.strip()
    return s.startswith(("$$", "```", "~~~")) or bool(HEAD.match(s)) or bool(BOX_OPEN.match(s)) or bool(BOX_CLOSE.match(s))


def split_blocks(md: str) -> list[Block]:
    """Split converted Markdown into blocks; a box opened and not closed in this text is closed at its end (the
    gated exercise form opens its box in one cell and closes it in another)."""
    lines = md.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line, s = lines[i], lines[i].strip()
        if not s or BOX_CLOSE.match(s):
            i += 1
            continue
        if s.startswith(("```", "~~~")):
            fence = re.match(r"^(`{3,}|~{3,})", s).group(1)
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            out.append(Block("code", "\n".join(lines[i : j + 1])))
            i = j + 1
            continue
        if s.startswith("$$"):
            j = i if (len(s) > 4 and s.endswith("$$")) else i + 1
            while j < len(lines) and not lines[j].strip().endswith("$$"):
                j += 1
            out.append(Block("math", "\n".join(lines[i : j + 1])))
            i = j + 1
            continue
        m = HEAD.match(s)
        if m:
            out.append(Block("heading", s, level=len(m.group(1))))
            i += 1
            continue
        if BOX_OPEN.match(s):
            depth, j = 1, i + 1
            while j < len(lines):
                t = lines[j].strip()
                depth += 1 if BOX_OPEN.match(t) else -1 if BOX_CLOSE.match(t) else 0
                if depth == 0:
                    break
                j += 1
            inner = lines[i + 1 : j]
            k = next((k for k, t in enumerate(inner) if t.strip()), len(inner))
            head = inner[k].strip() if k < len(inner) else ""
            out.append(Block("box", head, open=s, children=split_blocks("\n".join(inner[k + 1 :]))))
            i = j + 1
            continue
        j = i + 1
        if LIST_ITEM.match(line):  # a list runs until a blank line followed by neither an item nor an indented line
            while j < len(lines):
                if not lines[j].strip():
                    k = j
                    while k < len(lines) and not lines[k].strip():
                        k += 1
                    if k < len(lines) and (LIST_ITEM.match(lines[k]) or lines[k].startswith((" ", "\t"))):
                        j = k
                        continue
                    break
                if not lines[j].startswith((" ", "\t")) and not LIST_ITEM.match(lines[j]) and _starts_block(lines[j]):
                    break
                j += 1
            out.append(Block("list", "\n".join(lines[i:j]).rstrip()))
        else:
            while j < len(lines) and lines[j].strip() and not _starts_block(lines[j]):
                j += 1
            out.append(Block("text", "\n".join(lines[i:j])))
        i = j
    return out


def _tex_chars(tex: str) -> int:
    """Roughly how many characters wide a piece of TeX renders (a command is one glyph, sub/superscripts half)."""
    t = re.sub(r"\\(left|right|big|Big|bigg|Bigg|mathrm|mathbf|mathbb|mathcal|operatorname|text|,|;|quad|qquad)\b", "", tex)
    t = re.sub(r"\\[A-Za-z]+", "x", t)
    return len(re.sub(r"[{}\\\s^_&]", "", t))


def visible_chars(md: str) -> int:
    """The characters a reader sees in a piece of Markdown + HTML + inline TeX."""
    t = re.sub(r"\$([^$]+)\$", lambda m: "x" * _tex_chars(m.group(1)), md)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", t)
    t = re.sub(r"[*_`#]", "", t)
    return len(" ".join(t.split()))


def text_height(md: str, chars: int = TEXT_CHARS, line: float = TEXT_LINE) -> float:
    return max(1, -(-visible_chars(md) // chars)) * line


def math_height(tex: str) -> float:
    body = tex.strip().strip("$")
    rows = [r for r in re.split(r"\\\\", body) if r.strip() and not re.fullmatch(r"\s*(\\end\{\w+\*?\}|\\begin\{\w+\*?\})\s*", r)]
    return MATH_PAD + sum(MATH_ROW + (MATH_TALL if TALL_TEX.search(r) else 0.0) for r in rows or [body])


def code_height(lines: list[str]) -> float:
    return CODE_PAD + sum(max(1, -(-len(x) // CODE_CHARS)) for x in lines) * CODE_LINE


def list_items(md: str) -> list[str]:
    items: list[list[str]] = []
    for line in md.splitlines():
        if LIST_ITEM.match(line) or not items:
            items.append([line])
        else:
            items[-1].append(line)
    return ["\n".join(x) for x in items]


def block_height(b: Block) -> float:
    if b.kind == "heading":
        return HEADING.get(b.level, TEXT_LINE + PARA_GAP) + (text_height(b.text) - TEXT_LINE if b.level <= 3 else 0)
    if b.kind == "text":
        return text_height(b.text) + PARA_GAP
    if b.kind == "list":
        return PARA_GAP + sum(text_height(it, TEXT_CHARS - 4) + 6 for it in list_items(b.text))
    if b.kind == "math":
        return math_height(b.text)
    if b.kind == "code":
        return code_height(b.text.splitlines()[1:-1])
    return BOX_PAD + text_height(b.text) + sum(block_height(c) for c in b.children)


def _png_size(data: str) -> tuple[int, int] | None:
    import base64
    import struct

    try:
        raw = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4))
    except ValueError:
        return None
    return struct.unpack(">II", raw[16:24]) if raw[:8] == b"\x89PNG\r\n\x1a\n" else None


def is_figure(output: dict) -> bool:
    data = output.get("data", {})
    return "curvlab-figure" in data.get("text/html", "") or ("image/png" in data and "text/html" not in data)


def output_height(output: dict) -> float:
    """Estimated height of a non-figure output."""
    if output.get("output_type") == "stream":
        return code_height(output.get("text", "").rstrip("\n").splitlines())
    data = output.get("data", {})
    if "text/html" in data:
        h = data["text/html"]
        if h.lstrip().startswith("<details"):  # a collapsed check table: its summary line
            return TEXT_LINE + PARA_GAP
        rows = len(re.findall(r"<tr\b", h))
        if rows:
            return 40.0 + rows * 34.0
        return text_height(re.sub(r"<style.*?</style>", "", h, flags=re.S)) + PARA_GAP
    if "text/latex" in data:
        return math_height(data["text/latex"])
    if "text/plain" in data:
        return code_height(data["text/plain"].splitlines())
    return TEXT_LINE


@dataclass
class Slide:
    kind: str  # slide (a new section, horizontal) | subslide (below the previous one)
    title: str | None  # the section's heading text, repeated small on continuation slides
    items: list[tuple[str, Any]] = field(default_factory=list)  # ("md", text) | ("code", source) | ("out", output)
    height: float = 0.0
    notes: list[str] = field(default_factory=list)
    book_notes: list[str] = field(default_factory=list)  # book paragraphs condensed on the slide, in full
    content: bool = False  # holds more than its heading
    closed: bool = False  # a figure: what follows goes on the next slide


#: A book paragraph longer than this many words is condensed on its slide to its lead sentence, the paragraph itself
#: going into the slide's speaker notes (the lecturer says it; the slide shows what to look at).
SLIDE_WORDS = 45
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(*\[])")


def condensed(md: str) -> str | None:
    """The lead sentence of a long paragraph (more than ``SLIDE_WORDS`` visible words), or None to keep it whole:
    short paragraphs, and those whose first sentence is most of them, stay as they are."""
    words = len(re.sub(r"\$[^$]*\$", "x", md).split())
    if words <= SLIDE_WORDS:
        return None
    # split at a sentence end outside inline maths
    masked = re.sub(r"\$[^$]*\$", lambda m: "x" * len(m.group(0)), md)
    m = next((m for m in SENTENCE_END.finditer(masked)
              if not re.search(r"(\bal|\be\.g|\bi\.e|\bcf|\bvs|\bFig|\bEq|\bSec|\bch|\bp)\.$", masked[:m.start()])),
             None)
    if m is None:
        return None
    first = md[:m.start()].rstrip()
    if len(re.sub(r"\$[^$]*\$", "x", first).split()) > 0.6 * words or first.count("**") % 2 or first.count("`") % 2:
        return None
    return first + " …"


def condensed_list(md: str) -> str | None:
    """A list whose long items (more than ``SLIDE_WORDS`` words, see :func:`condensed`) are cut to their lead
    sentence, or None when no item is: an item holding a nested list, display maths or code stays whole."""
    out, changed = [], False
    for item in list_items(md):
        m = LIST_ITEM.match(item)
        body = item[m.end():] if m else ""
        short = None
        if m and not re.search(r"^\s+([-*+]|\d+[.)])\s|\$\$|```|<", body, flags=re.M):
            short = condensed(" ".join(line.strip() for line in body.splitlines()))
        changed |= short is not None
        out.append(m.group(0) + short if short is not None else item)
    return "\n".join(out) if changed else None


class DeckLayout:
    """Packs a chapter's blocks and outputs into slides of at most ``budget`` estimated pixels.

    ``#``/``##`` start a slide, ``###`` a slide below it; content that does not fit continues on a slide below,
    titled like its section; a theorem, proof or exercise box starts its own slide (split over several when
    long, its head repeated); every figure gets a slide of its own, scaled to the room left; a long code listing is
    split between lines, a long list between items, a long paragraph between sentences. What follows a box may
    share its slide when it fits."""

    def __init__(self, budget: float = BUDGET, condense: bool = True) -> None:
        self.budget = budget
        self.condense = condense
        self.slides: list[Slide] = []
        self.title: str | None = None
        self.lead_in: tuple[str, float] | None = None  # a short line ("**What you will learn**") kept with what follows

    def flush(self) -> None:
        if self.lead_in is not None:
            lead, lead_h = self.lead_in
            self.lead_in = None
            self.add_md(lead, lead_h)

    @property
    def cur(self) -> Slide | None:
        return self.slides[-1] if self.slides else None

    def new(self, kind: str = "subslide", continuation: bool = True) -> Slide:
        s = Slide(kind if self.slides else "slide", self.title)
        self.slides.append(s)
        if continuation and self.title:
            s.items.append(("md", f'<p class="curvlab-cont">{html.escape(self.title, quote=False)}</p>'))
            s.height += CONT_TITLE
        return s

    def place(self, h: float, own: bool = False) -> Slide:
        s = self.cur
        if s is None or s.closed or (s.content and (own or s.height + h > self.budget)):
            s = self.new()
        return s

    def add_md(self, text: str, h: float, own: bool = False) -> None:
        if self.lead_in is not None:  # a lead-in line goes to the slide of what it introduces
            lead, lead_h = self.lead_in
            self.lead_in = None
            s = self.place(h + lead_h, own)
            s.items.append(("md", lead))
            s.height += lead_h
        else:
            s = self.place(h, own)
        s.items.append(("md", text))
        s.height += h
        s.content = True

    def heading(self, b: Block) -> None:
        text = HEAD.match(b.text).group(2).strip()
        if b.level > 3:
            return self.add_md(b.text, block_height(b))
        self.title = text
        s = self.new("slide" if b.level <= 2 else "subslide", continuation=False)
        s.items.append(("md", b.text))
        s.height += block_height(b)

    def block(self, b: Block) -> None:
        if b.kind == "heading":
            self.flush()
            return self.heading(b)
        h = block_height(b)
        if b.kind == "text" and self.lead_in is None and (
            visible_chars(b.text) <= 80 or (b.text.rstrip().endswith((":", ",")) and visible_chars(b.text) <= 4 * TEXT_CHARS)
        ):  # a short line, or a paragraph that introduces what follows ("... by the two factors,"): kept with it
            self.lead_in = (b.text, h)
            return None
        if self.lead_in is not None and self.lead_in[1] + h > self.budget - CONT_TITLE and b.kind in ("math", "box"):
            self.flush()  # the lead-in and its block do not fit one slide together: the lead-in goes first
        # (a list, paragraph or listing that is split takes the lead-in along with its first part)
        if b.kind == "box":
            if any(c in b.open for c in OWN_SLIDE_BOXES):
                self.flush()
            return self.box(b, h)
        if b.kind == "text" and self.condense:
            short = condensed(b.text)
            if short is not None:  # the slide shows the paragraph's lead sentence; the notes hold all of it
                self.add_md(short, self._h("text", short))
                self.cur.book_notes.append(b.text)
                return None
        if b.kind == "list" and self.condense:
            short = condensed_list(b.text)
            if short is not None:  # each long item shows its lead sentence; the notes hold the whole list
                self._place(Block("list", short), self._h("list", short))
                self.cur.book_notes.append(b.text)
                return None
        return self._place(b, h)

    def _place(self, b: Block, h: float) -> None:
        """Put a paragraph, list, equation or listing on the current slide, or split it over slides below."""
        if h <= self.room():
            return self.add_md(b.text, h)
        if b.kind == "code":  # between lines
            lines = b.text.splitlines()
            fence, body, close = lines[0], lines[1:-1], lines[-1]
            chunk: list[str] = []
            for line in body:
                if chunk and code_height(chunk + [line]) > self.room():
                    self.add_md("\n".join([fence, *chunk, close]), code_height(chunk))
                    chunk = []
                chunk.append(line)
            return self.add_md("\n".join([fence, *chunk, close]), code_height(chunk))
        parts = list_items(b.text) if b.kind == "list" else re.split(r"(?<=[.;:])\s+(?=[A-Z(])", b.text) if b.kind == "text" else []
        if len(parts) < 2:
            self.flush()
            return self.add_md(b.text, h)  # one sentence too tall: the slide scrolls
        acc: list[str] = []
        for part in parts:
            joined = ("\n" if b.kind == "list" else " ").join(acc + [part])
            if acc and self._h(b.kind, joined) > self.room():
                text = ("\n" if b.kind == "list" else " ").join(acc)
                self.add_md(text, self._h(b.kind, text))
                acc = []
            acc.append(part)
        text = ("\n" if b.kind == "list" else " ").join(acc)
        self.add_md(text, self._h(b.kind, text))

    def room(self) -> float:
        """What a block may take of a fresh slide: the budget less the continuation title and a pending lead-in."""
        return self.budget - CONT_TITLE - (self.lead_in[1] if self.lead_in is not None else 0.0)

    @staticmethod
    def _h(kind: str, text: str) -> float:
        return block_height(Block(kind, text))

    def box(self, b: Block, h: float) -> None:
        own = any(c in b.open for c in OWN_SLIDE_BOXES)
        head_h = BOX_PAD + text_height(b.text)
        room = self.budget - CONT_TITLE
        if h <= room:
            return self.add_md(b.markdown(), h, own=own)
        # too tall for one slide: the box continues on the slides below, its head repeated
        chunk: list[Block] = []
        first = True

        def flush() -> None:
            nonlocal first
            head = b.text if first else f"{b.text} *(continued)*"
            part = Block("box", head, open=b.open, children=list(chunk))
            self.add_md(part.markdown(), head_h + sum(block_height(c) for c in chunk), own=True)
            first = False

        for c in b.children:
            ch = block_height(c)
            if chunk and head_h + sum(block_height(x) for x in chunk) + ch > room:
                flush()
                chunk = []
            chunk.append(c)
        flush()

    def output(self, out: dict) -> None:
        self.flush()
        if is_figure(out):
            return self.figure(out)
        h = output_height(out)
        if h > self.budget - CONT_TITLE:
            return self.add_md("*(A long output: see this cell in the book.)*", TEXT_LINE + PARA_GAP)
        s = self.place(h)
        s.items.append(("out", out))
        s.height += h
        s.content = True

    def figure(self, out: dict) -> None:
        s = self.cur
        if s is None or s.closed or s.content:
            s = self.new()
        data = out.get("data", {})
        html_fig = data.get("text/html", "")
        m = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]{64})", html_fig)
        size = _png_size(m.group(1)) if m else _png_size(data.get("image/png", ""))
        caption = re.search(r"<figcaption>(.*?)</figcaption>", html_fig, flags=re.S)
        cap_h = (max(1, -(-visible_chars(caption.group(1)) // CAPTION_CHARS)) * CAPTION_LINE + 16) if caption else 0.0
        room = self.budget - s.height - cap_h - 12
        w, hgt = size or (880, 540)
        img_h = int(max(160, min(room, hgt * min(1.5, CONTENT_W / w))))
        out = copy.deepcopy(out)
        if html_fig:
            out["data"]["text/html"] = re.sub(
                r'style="max-width:100%"', f'style="height:{img_h}px;width:auto;max-width:100%"', html_fig, count=1
            )
        else:
            out.setdefault("metadata", {})["image/png"] = {"height": img_h}
        s.items.append(("out", out))
        s.height += img_h + cap_h + 12
        s.content = s.closed = True

    def note(self, text: str) -> None:
        self.flush()
        (self.cur or self.new("slide", continuation=False)).notes.append(text)

    def notebook(self, metadata: dict) -> nbformat.NotebookNode:
        self.flush()
        cells = []
        for s in self.slides:
            first = True
            pending: list[str] = []

            def emit(cell: nbformat.NotebookNode) -> None:
                nonlocal first
                cell.metadata["slideshow"] = {"slide_type": s.kind if first else "-"}
                cell.metadata["curvlab_estimate"] = round(s.height)
                first = False
                cells.append(cell)

            for kind, payload in s.items + [("end", None)]:
                if kind == "md":
                    pending.append(payload)
                    continue
                if pending:
                    emit(nbformat.v4.new_markdown_cell("\n\n".join(pending)))
                    pending = []
                if kind == "out":
                    emit(nbformat.v4.new_code_cell("", outputs=[payload], metadata={"tags": ["remove-input"]}))
            for text in s.notes:
                cell = nbformat.v4.new_markdown_cell(text, metadata={"slideshow": {"slide_type": "notes"}})
                cells.append(cell)
            if s.book_notes:  # the book's paragraphs that the slide shows condensed
                cells.append(nbformat.v4.new_markdown_cell("\n\n".join(s.book_notes), metadata={
                    "slideshow": {"slide_type": "notes"}, "curvlab_book_notes": True}))
        nb = nbformat.v4.new_notebook(cells=cells, metadata=metadata)
        for i, c in enumerate(nb.cells):
            c.id = f"slide-cell-{i}"
        return nb


def slide_notebook(nb: nbformat.NotebookNode, notebook_dir: Path, bib: Bibliography | None = None,
                   budget: float = BUDGET, condense: bool = True) -> nbformat.NotebookNode:
    """The executed chapter laid out as slides: the notebook the reveal exporter renders.

    Markdown is converted (``slide_exporter``) and split into blocks; code inputs are hidden unless the cell is tagged
    ``slide-code``; every figure gets its own slide; a Markdown cell tagged ``notes`` becomes the previous slide's
    speaker notes (it may also carry ``remove-cell``, which keeps it out of the book). Exercise solutions are left
    out, text and code."""
    conv = slide_exporter(notebook_dir, bib)
    deck = DeckLayout(budget, condense)
    for cell in nb.cells:
        tags = set(cell.metadata.get("tags", []))
        stype = cell.metadata.get("slideshow", {}).get("slide_type", "-")
        if cell.cell_type == "markdown" and NOTES_TAG in tags:
            text = conv.markdown(cell.source)
            if text.strip() and not conv.in_solution:
                deck.note(text)
            continue
        if "remove-cell" in tags or stype == "skip":
            continue
        if cell.cell_type == "markdown":
            for b in split_blocks(conv.markdown(cell.source)):
                deck.block(b)
        elif cell.cell_type == "code" and not conv.in_solution:
            show_code = SLIDE_CODE_TAG in tags and not tags & {"remove-input", "hide-input"}
            outputs = [] if tags & {"remove-output", "hide-output"} else [
                o for o in cell.get("outputs", []) if not (o.get("output_type") == "stream" and o.get("name") == "stderr")
                and o.get("output_type") != "error"
            ]
            outputs = [copy.deepcopy(o) for o in outputs]
            for o in outputs:  # no live widgets on a slide: keep the static representations
                if "data" in o:
                    o["data"].pop("application/vnd.jupyter.widget-view+json", None)
            outputs = [o for o in outputs if o.get("output_type") == "stream" or o.get("data")]
            if show_code and cell.source.strip():
                deck.block(Block("code", "\n".join(["```python", *cell.source.splitlines(), "```"])))
            for o in outputs:
                deck.output(o)
    metadata = {k: v for k, v in nb.metadata.items() if k != "widgets"}
    return deck.notebook(metadata)


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
{{ resources.curvlab.fit_js }}
</script>
{% endblock footer_js %}
"""

# The deck's own safety net and the measurement the tests use: a slide whose content is taller than the canvas
# (the layout's estimate was wrong) becomes scrollable instead of being cut off.
FIT_JS = """
window.curvlabContentHeight = function (s) {
  var h = s.style.height; s.style.height = 'auto'; var v = s.scrollHeight; s.style.height = h; return v;
};
window.curvlabFit = function (s) {
  if (s) s.classList.toggle('curvlab-scroll', curvlabContentHeight(s) > Reveal.getConfig().height + 1);
};
window.curvlabMeasure = function () {  /* every slide: indices, title, content height in canvas px */
  var rows = [], here = Reveal.getIndices();
  Reveal.getSlides().forEach(function (s) {
    var ix = Reveal.getIndices(s); Reveal.slide(ix.h, ix.v);
    var t = s.querySelector('h1, h2, h3, .curvlab-cont');
    rows.push({h: ix.h, v: ix.v || 0, title: t ? t.textContent.trim().slice(0, 80) : '',
               height: curvlabContentHeight(s), figures: s.querySelectorAll('figure.curvlab-figure img').length,
               visible_figures: Array.prototype.filter.call(s.querySelectorAll('figure.curvlab-figure img'),
                 function (im) { var r = im.getBoundingClientRect(); return im.complete && im.naturalWidth > 0 && r.height > 50; }).length,
               notes: s.querySelectorAll('aside.notes').length});
  });
  Reveal.slide(here.h, here.v);
  return rows;
};
function curvlabFitAll() { Reveal.getSlides().forEach(curvlabFit); }
Reveal.on('ready', function (e) { curvlabFit(e.currentSlide); });
Reveal.on('slidechanged', function (e) { curvlabFit(e.currentSlide); });
if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
  MathJax.startup.promise.then(function () { curvlabFit(Reveal.getCurrentSlide()); });
}
"""

CSS = """
:root { --jp-content-font-size1: 25px; --jp-ui-font-size1: 22px; --jp-code-font-size: 17px; --jp-cell-prompt-width: 0px;
        --jp-cell-padding: 0px; }
.reveal .slides { text-align: left; }
.reveal .slides section { box-sizing: border-box; padding: 8px 16px 0 8px; }
.reveal .slides > section:not(.stack), .reveal .slides > section > section { height: 100%; overflow: hidden; }
.reveal .slides section.curvlab-scroll { overflow-y: auto !important; }
.reveal .jp-Cell { padding: 0; }
.reveal .jp-RenderedHTMLCommon { padding-right: 0; }
.reveal h1, .reveal h2, .reveal h3 { text-transform: none !important; text-align: left; margin: 0 0 0.4em 0; }
.reveal h1 { font-size: 1.6em !important; } .reveal h2 { font-size: 1.3em !important; } .reveal h3 { font-size: 1.05em !important; }
.reveal .jp-RenderedHTMLCommon p, .reveal .jp-RenderedHTMLCommon li { font-size: inherit; line-height: 1.35; }
.reveal .jp-RenderedHTMLCommon p { margin: 0 0 0.6em 0; }
.reveal .jp-RenderedHTMLCommon ul, .reveal .jp-RenderedHTMLCommon ol { margin: 0 0 0.6em 0; }
.reveal p.curvlab-cont { color: #555; font-size: 0.8em; border-bottom: 1px solid #ccc; margin: 0 0 0.5em 0; padding-bottom: 0.1em; }
.reveal p.curvlab-cont::after { content: " (continued)"; font-style: italic; }
.reveal .jp-OutputArea-output pre { max-height: none; }
.reveal .jp-InputPrompt, .reveal .jp-OutputPrompt { display: none; }
.reveal .jp-RenderedHTMLCommon table { font-size: 0.7em; }
.reveal figure.curvlab-figure { margin: 0.2em 0; text-align: center; }
.reveal figure.curvlab-figure img { display: block; margin: 0 auto; }
.reveal figure.curvlab-figure figcaption { font-size: 0.75em; line-height: 1.3; text-align: left; margin-top: 0.3em; }
.reveal .curvlab-box { border-left: 6px solid #0072B2; background: #f2f7fb; padding: 0.4em 0.8em 0.1em 0.8em; margin: 0.3em 0 0.6em 0; }
.reveal .curvlab-proof { border-left-color: #999; background: #f7f7f7; }
.reveal .curvlab-exercise { border-left-color: #009E73; background: #f0faf6; }
.reveal mjx-container[display="true"] { margin: 0.4em 0 !important; overflow-x: auto; overflow-y: hidden; }
.reveal details.curvlab-checks { font-size: 0.8em; }
.reveal aside.notes { display: none; }
.reveal .anchor-link { display: none; }
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
    resources = {"curvlab": {"macros_json": json.dumps(macros), "static": static, "mathjax_name": mathjax_name, "css": CSS,
                             "fit_js": FIT_JS}}
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


def book_cache_notebooks(chapters: list[Path], profile: str) -> dict[Path, nbformat.NotebookNode]:
    """The chapters' outputs from the book's execution cache (``make book`` / ``make test`` fill it; keyed on the
    library's source and the profile, so stale outputs are never used): chapter -> executed notebook. Figures
    there are drawn in the book's context, not the projector's. Chapters not in the cache are left out."""
    from jupyter_cache import get_cache

    cache_dir = Path(curvlab_book.build_environment(profile)["CURVLAB_EXECUTION_CACHE"])
    if not cache_dir.is_dir():
        return {}
    cache = get_cache(str(cache_dir))
    found = {}
    for p in chapters:
        try:
            _, merged = cache.merge_match_into_notebook(nbformat.read(p, as_version=4))
        except KeyError:
            continue
        found[p] = merged
    return found


def write_deck(chapter: Path, executed: nbformat.NotebookNode, out: Path, static: str, mathjax_name: str,
               bib: Bibliography | None = None) -> tuple[Path, str, nbformat.NotebookNode]:
    """Lay out and export one chapter's deck to ``<out>/<stem>.slides.html``; return (path, title, slide notebook)."""
    nb = slide_notebook(executed, chapter.parent, bib)
    target = out / f"{chapter.stem}.slides.html"
    target.write_text(export(nb, static, mathjax_name))
    first = next((c.source for c in nb.cells if c.cell_type == "markdown"), chapter.stem)
    title = next((re.sub(r"^#+\s*", "", line) for line in first.splitlines() if line.startswith("#")), chapter.stem)
    return target, title, nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", help="chapter stems or numbers (default: every chapter in _toc.yml)")
    parser.add_argument("--profile", default=os.environ.get("CURVLAB_PROFILE", "quick"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="re-execute even when an executed copy is up to date")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--outputs", choices=("execute", "book-cache"), default="execute",
                        help="execute: run each chapter in the projector context (default); book-cache: take the "
                        "outputs of the book's execution cache for the profile, as they are (nothing runs)")
    args = parser.parse_args(argv)
    t0 = time.time()
    chapters = resolve_chapters(args.chapters)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"slides: {len(chapters)} chapter(s), profile {args.profile}, into {out}", flush=True)
    static, mj = vendor_assets(out)
    if args.outputs == "book-cache":
        executed = book_cache_notebooks(chapters, args.profile)
        for p in chapters:
            if p not in executed:
                print(f"  {p.stem}: not in the book's execution cache for profile {args.profile} (run make book)", flush=True)
    else:
        executed = {p: nbformat.read(path, as_version=4)
                    for p, path in execute_all(chapters, out, args.profile, args.jobs, args.force, args.timeout).items()}
    bib = Bibliography()
    decks = []
    for chapter, nb in executed.items():
        target, title, _ = write_deck(chapter, nb, out, static, mj, bib)
        decks.append((target.name, title))
        print(f"  wrote {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}", flush=True)
    (out / "index.html").write_text(index_page(decks))
    missing = len(chapters) - len(executed)
    print(f"slides: {len(decks)} deck(s) in {time.time() - t0:.0f} s; open {out / 'index.html'}" + (f"; {missing} failed" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
