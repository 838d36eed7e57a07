"""The slide decks (``make slides``, tools/slides.py) are presentable: every slide fits the 1280 x 800 canvas,
every figure is on a slide of its own and visible, code is hidden unless tagged, speaker notes come from tagged
cells, references carry no LaTeX escapes.

* Unit tests (fast, no outputs needed): the layout rules on small synthetic chapters.
* Built tests (``make test`` runs them after the quick book build): every chapter's deck is laid out from the book's
  execution cache and checked structurally (each figure output present once, on its own slide; every slide's
  estimated height within the canvas; notes where tagged), and one deck (chapter 00, the smallest) is rendered in
  headless Chromium, which measures every slide's height against the canvas and checks that its figure loaded.
  The Chromium test skips with the reason when no Chromium is installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import slides  # noqa: E402

CANVAS_W, CANVAS_H = slides.CANVAS
RENDERED_CHAPTER = "00_how_to_read"  # the smallest deck: rendered in Chromium by the built test


# ------------------------------------------------------------------------------------------------ helpers
def md(source: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(source, metadata={"tags": tags} if tags else {})


def figure_output(seed: int = 0, w: int = 880, h: int = 540) -> dict:
    """A curvlab.plotting.Figure-like HTML output with a PNG of the given size (only the header matters here)."""
    png = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([seed]) * 40
    data = base64.b64encode(png).decode()
    fig = (f'<figure class="curvlab-figure"><img src="data:image/png;base64,{data}" alt="A test figure for the layout" '
           f'style="max-width:100%"/><figcaption><strong>Figure {seed + 1}.</strong> What to see.</figcaption></figure>')
    return nbformat.v4.new_output("display_data", data={"text/html": fig, "text/plain": f"Figure {seed + 1}."})


def code(source: str, outputs: list | None = None, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": tags} if tags else {})
    cell.outputs = outputs or []
    return cell


def layout(cells: list, condense: bool = False) -> list[list[nbformat.NotebookNode]]:
    """The slide notebook of ``cells``, as a list of slides (each a list of its cells, notes included); the layout
    tests keep every paragraph whole (``condense=False``), the condensing test asks for it."""
    nb = slides.slide_notebook(nbformat.v4.new_notebook(cells=cells), ROOT / "notebooks", condense=condense)
    out: list[list] = []
    for c in nb.cells:
        if c.metadata["slideshow"]["slide_type"] in ("slide", "subslide") or not out:
            out.append([])
        out[-1].append(c)
    return out


def text_of(slide: list) -> str:
    return "\n".join(c.source for c in slide if c.cell_type == "markdown")


def figure_keys(cell_outputs: list) -> list[str]:
    """A fingerprint per figure output: a hash of its PNG bytes (resizing on the slide keeps the bytes)."""
    keys = []
    for o in cell_outputs:
        data = o.get("data", {})
        m = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", data.get("text/html", ""))
        png = m.group(1) if m else data.get("image/png") if slides.is_figure(o) else None
        if png:
            keys.append(hashlib.sha1(png.strip().encode()).hexdigest())
    return keys


# ------------------------------------------------------------------------------------------------ unit: layout rules
PARA = ("The Gauss–Newton matrix $\\GN = J^\\top J/n$ is positive semi-definite, and its Kronecker factors are the "
        "covariances of the back-propagated gradients and of the layer's inputs. ") * 3


def test_headings_start_slides_and_long_sections_continue_below():
    cells = [md("# Chapter\n\nIntro."), md("## A section\n\n" + "\n\n".join([PARA] * 8)), md("### A sub-part\n\nShort.")]
    deck = layout(cells)
    kinds = [s[0].metadata["slideshow"]["slide_type"] for s in deck]
    assert kinds[0] == "slide" and kinds[1] == "slide" and kinds[-1] == "subslide"
    section = [s for s in deck if "A section" in text_of(s) or "curvlab-cont" in text_of(s) and "A section" in text_of(s)]
    assert len(section) >= 3, "eight long paragraphs must continue over several slides"
    assert all('<p class="curvlab-cont">A section</p>' in text_of(s) for s in section[1:])
    assert all(s[0].metadata["curvlab_estimate"] <= slides.BUDGET for s in deck)


def test_theorem_and_proof_start_their_own_slides_and_a_long_proof_is_split():
    proof = "\n\n".join(f"Step {i}. " + PARA for i in range(10))
    cells = [md("## Result\n\nSome motivation."),
             md(f"```{{prf:theorem}} A claim\n:class: status-proved\n\nThe statement.\n```\n\n```{{prf:proof}}\n{proof}\n```")]
    deck = layout(cells)
    theorem = [s for s in deck if "**Theorem (A claim).** *Status: proved here.*" in text_of(s)]
    assert len(theorem) == 1 and "Some motivation" not in text_of(theorem[0])
    proofs = [s for s in deck if "*Proof.*" in text_of(s)]
    assert len(proofs) >= 3 and all("*(continued)*" in text_of(s) for s in proofs[1:])
    assert "Step 0." in text_of(proofs[0]) and "Step 9." in text_of(proofs[-1])
    assert all(s[0].metadata["curvlab_estimate"] <= slides.BUDGET for s in deck)


def test_every_figure_gets_its_own_slide_and_code_is_hidden_unless_tagged():
    cells = [md("## Figures\n\nText before."),
             code("fig = draw()\nshow(fig)", [figure_output(0)]),
             code("print('numbers')", [nbformat.v4.new_output("stream", name="stdout", text="numbers\n")], ["slide-code"]),
             code("show(other)", [figure_output(1, 600, 900)])]
    deck = layout(cells)
    with_fig = [s for s in deck if any(c.cell_type == "code" and figure_keys(c.outputs) for c in s)]
    assert len(with_fig) == 2
    for s in with_fig:
        assert sum(len(figure_keys(c.outputs)) for c in s if c.cell_type == "code") == 1
        assert "Text before" not in text_of(s) and "numbers" not in text_of(s)
        fig = next(c for c in s if c.cell_type == "code").outputs[0]["data"]["text/html"]
        height = int(re.search(r"height:(\d+)px", fig).group(1))
        assert 160 <= height <= slides.BUDGET, height
    hidden = [c for s in deck for c in s if c.cell_type == "code"]
    assert all("remove-input" in c.metadata["tags"] for c in hidden)
    assert any("print('numbers')" in text_of(s) for s in deck), "a slide-code cell shows its input"
    assert not any("fig = draw()" in text_of(s) for s in deck)


def test_notes_cells_become_the_previous_slides_speaker_notes():
    cells = [md("## One\n\nShown."), md("Say this, do not show it.", ["notes", "remove-cell"]), md("## Two\n\nShown too.")]
    deck = layout(cells)
    notes = [c for s in deck for c in s if c.metadata["slideshow"]["slide_type"] == "notes"]
    assert [c.source for c in notes] == ["Say this, do not show it."]
    assert notes[0] in deck[0] and "## One" in text_of(deck[0])
    out = slides.export(slides.slide_notebook(nbformat.v4.new_notebook(cells=cells), ROOT / "notebooks"), "_static", "x.js")
    aside = re.search(r'<aside class="notes">(.*?)</aside>', out, flags=re.S)
    assert aside and "Say this, do not show it." in aside.group(1)
    assert "plugin/notes/notes.js" in out and "RevealNotes" in out


def test_long_paragraphs_show_their_lead_sentence_and_go_whole_into_the_notes():
    long = ("The first sentence says what the slide is about, with $\\GN$ in it. " + "Then the details follow, "
            "one after the other, as the book tells them at its own pace. " * 6).strip()
    short = "A short paragraph stays as it is."
    deck = layout([md(f"## Section\n\n{long}\n\n{short}")], condense=True)
    shown = "\n".join(c.source for s in deck for c in s if c.metadata["slideshow"]["slide_type"] != "notes")
    notes = [c for s in deck for c in s if c.metadata.get("curvlab_book_notes")]
    assert "The first sentence says what the slide is about, with $\\GN$ in it. …" in shown
    assert "Then the details follow" not in shown and short in shown
    assert len(notes) == 1 and notes[0].source == long and notes[0].metadata["slideshow"]["slide_type"] == "notes"
    assert slides.condensed(short) is None and slides.condensed("One sentence only " * 20) is None


def test_long_list_items_show_their_lead_sentence_and_the_whole_list_goes_into_the_notes():
    item = ("**The rank cut.** The first sentence says what the item is about. " + "Then the details follow, one "
            "after the other, as the book tells them. " * 6).strip()
    nested = "- **Kept whole.** It holds a nested list. " + "More words here. " * 20 + "\n  - a sub-item"
    listing = f"- {item}\n- A short item stays.\n{nested}"
    deck = layout([md(f"## Section\n\n{listing}")], condense=True)
    shown = "\n".join(c.source for s in deck for c in s if c.metadata["slideshow"]["slide_type"] != "notes")
    notes = [c for s in deck for c in s if c.metadata.get("curvlab_book_notes")]
    assert "- **The rank cut.** The first sentence says what the item is about. …" in shown
    assert "as the book tells them" not in shown and "- A short item stays." in shown and "  - a sub-item" in shown
    assert len(notes) == 1 and notes[0].source == listing
    assert slides.condensed_list("- short\n- items only") is None


def test_every_chapters_deck_has_speaker_notes_for_its_prose():
    """Without executing anything: each chapter's deck carries the book paragraphs it condenses as speaker notes, and
    no reference shows a raw label."""
    for chapter in slides.toc_chapters():
        nb = slides.slide_notebook(nbformat.read(chapter, as_version=4), chapter.parent)
        notes = [c for c in nb.cells if c.metadata["slideshow"]["slide_type"] == "notes"]
        assert len(notes) >= 3, f"{chapter.stem}: {len(notes)} speaker notes"
        raw = [lab for c in nb.cells if c.cell_type == "markdown"
               for lab in slides.myst_export.raw_labels(c.source, slides.book_index())]
        assert not raw, f"{chapter.stem}: labels shown as text on the slides: {sorted(set(raw))[:5]}"
        for c in nb.cells:  # prose outside boxes (a theorem's statement or a proof stays whole)
            if c.metadata["slideshow"]["slide_type"] != "notes" and c.cell_type == "markdown":
                prose = re.sub(r"<div\b.*?</div>|^```.*?^```|\$\$.*?\$\$", "", c.source, flags=re.S | re.M)
                for para in re.split(r"\n\s*\n", prose):
                    if not re.match(r"\s*(<|\$\$|```|[-*>|#]|\d+[.)])", para) \
                            and not para.rstrip().endswith((":", ",")):  # a lead-in stays with what it introduces
                        assert slides.condensed(para.removesuffix(" …")) is None or para.endswith("…"), \
                            f"{chapter.stem}: a long paragraph on a slide: {para[:80]!r}"


def test_labelled_equations_are_tagged_and_references_carry_no_latex():
    label, target = next((k, t) for k, t in slides.book_index().labels.items() if t.kind == "equation")
    cells = [md(f"## Eq\n\n$$\nx = y\n$$ ({label})\n\nAs in {{eq}}`{label}`, cite {{footcite:t}}`marchenko1967distribution`.")]
    text = "\n".join(text_of(s) for s in layout(cells))
    # the book's number (Sphinx numbers labelled equations across the book), never the label
    assert f"\\tag{{{target.number}}}" in text and f"({target.number})" in text and label not in text
    bib = slides.Bibliography()
    for key in bib.entries:
        ref = bib.reference(key) + bib.cite([key], parenthetical=True)
        assert "\\" not in ref and "{" not in ref and "}" not in ref, ref
    assert slides.latex_to_text("Mar\\v{c}enko and P{\\'e}rez") == "Marčenko and Pérez"


def test_block_splitter_keeps_math_code_and_boxes_whole():
    text = ("Para one\ncontinues.\n\n$$\na = b\n\nc = d\n$$\n\n```python\nx = 1\n\ny = 2\n```\n\n"
            '<div class="curvlab-box curvlab-prf">\n\n**Lemma**\n\nBody.\n\n$$\nz\n$$\n\n</div>\n\n- item one\n- item two\n')
    kinds = [b.kind for b in slides.split_blocks(text)]
    assert kinds == ["text", "math", "code", "box", "list"]
    box = slides.split_blocks(text)[3]
    assert box.text == "**Lemma**" and [c.kind for c in box.children] == ["text", "math"]


# ------------------------------------------------------------------------------------------------ built: every deck
@pytest.fixture(scope="module")
def cached_chapters():
    chapters = slides.toc_chapters()
    executed = slides.book_cache_notebooks(chapters, "quick")
    if not executed:
        pytest.skip("no chapter in the book's quick execution cache for this library source (run make book-quick)")
    return executed


@pytest.fixture(scope="module")
def decks(cached_chapters, tmp_path_factory):
    out = tmp_path_factory.mktemp("decks")
    static, mj = slides.vendor_assets(out)
    bib = slides.Bibliography()
    built = {}
    for chapter, nb in cached_chapters.items():
        if chapter.stem == RENDERED_CHAPTER:
            built[chapter] = (nb, *slides.write_deck(chapter, nb, out, static, mj, bib))
        else:  # the structure is in the slide notebook; exporting it to HTML adds nothing the checks need
            built[chapter] = (nb, None, None, slides.slide_notebook(nb, chapter.parent, bib))
    return built


def _slides_of(slide_nb) -> list[list]:
    out: list[list] = []
    for c in slide_nb.cells:
        if c.metadata["slideshow"]["slide_type"] in ("slide", "subslide") or not out:
            out.append([])
        out[-1].append(c)
    return out


def _shown_figures(nb) -> list[str]:
    """Figure fingerprints of the cells a deck must show: not removed, not in an exercise's gated solution."""
    keys, in_solution = [], False
    for c in nb.cells:
        tags = set(c.metadata.get("tags", []))
        if c.cell_type == "markdown":
            for m in re.finditer(r"\{(solution-start|solution-end)\}", c.source):
                in_solution = m.group(1) == "solution-start"
        elif not (in_solution or tags & {"remove-cell", "remove-output", "hide-output"}
                  or c.metadata.get("slideshow", {}).get("slide_type") == "skip"):
            keys += figure_keys(c.get("outputs", []))
    return keys


@pytest.mark.built
def test_every_deck_shows_each_figure_on_its_own_slide_within_the_canvas(decks):
    problems = []
    for chapter, (nb, _, _, slide_nb) in decks.items():
        deck = _slides_of(slide_nb)
        placed = []
        for i, s in enumerate(deck):
            est = s[0].metadata["curvlab_estimate"]
            if est > CANVAS_H:
                problems.append(f"{chapter.stem}: slide {i} estimated {est} px > {CANVAS_H}")
            figs = [k for c in s if c.cell_type == "code" for k in figure_keys(c.outputs)]
            others = [c for c in s if c.cell_type == "code" and not figure_keys(c.outputs)]
            if len(figs) > 1 or (figs and others):
                problems.append(f"{chapter.stem}: slide {i} holds {len(figs)} figure(s) and {len(others)} other output(s)")
            placed += figs
        want = _shown_figures(nb)
        if sorted(placed) != sorted(want):
            problems.append(f"{chapter.stem}: {len(want)} figure(s) in the chapter, {len(placed)} on its slides")
        shown_code = [c for s in deck for c in s if c.cell_type == "code" and "remove-input" not in c.metadata.get("tags", [])]
        if shown_code:
            problems.append(f"{chapter.stem}: {len(shown_code)} code input(s) shown")
    assert not problems, "\n".join(problems)
    assert sum(len(_shown_figures(nb)) for nb, *_ in decks.values()) > 0


@pytest.mark.built
def test_every_deck_has_the_notes_its_chapter_tags(decks):
    for chapter, (nb, _, _, slide_nb) in decks.items():
        tagged = [c for c in nb.cells if c.cell_type == "markdown" and "notes" in c.metadata.get("tags", [])]
        notes = [c for c in slide_nb.cells if c.metadata["slideshow"]["slide_type"] == "notes"
                 and not c.metadata.get("curvlab_book_notes")]
        assert len(notes) == len(tagged), f"{chapter.stem}: {len(tagged)} notes cell(s), {len(notes)} on the slides"
        assert not any(c.cell_type == "markdown" and "notes" in c.metadata.get("tags", []) and
                       c.metadata.get("slideshow", {}).get("slide_type") != "notes" for c in slide_nb.cells)


# ------------------------------------------------------------------------------------------------ built: rendered
def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


PROBE = """<script>
(function () {
  function go() { var pre = document.createElement('pre'); pre.id = 'curvlab-measure';
    pre.textContent = JSON.stringify(curvlabMeasure()); document.body.appendChild(pre); }
  var p = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
  p.then(function () { if (Reveal.isReady()) go(); else Reveal.on('ready', go); });
})();
</script>"""


def render_and_measure(deck: Path, browser: str) -> list[dict]:
    """Load the deck in headless Chromium at 1280 x 800, typeset, visit every slide, and return its measurements
    (``curvlabMeasure`` in the deck: content height in canvas px, figures, loaded figures, notes)."""
    probe = deck.with_name(deck.stem + ".probe.html")
    probe.write_text(deck.read_text().replace("</body>", PROBE + "</body>"))
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--window-size={CANVAS_W},{CANVAS_H}", "--virtual-time-budget=60000", "--dump-dom", probe.as_uri()]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    m = re.search(r'<pre id="curvlab-measure">(.*?)</pre>', run.stdout, flags=re.S)
    assert m, f"the deck did not report its measurements (rc {run.returncode}): {run.stderr[-1500:]}"
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.built
def test_one_deck_rendered_in_chromium_fits_the_canvas_with_its_figures_visible(decks):
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium (chromium / google-chrome) on PATH: `apt-get install chromium`, as .ci/run does")
    entry = next((v for k, v in decks.items() if k.stem == RENDERED_CHAPTER), None)
    if entry is None:
        pytest.skip(f"{RENDERED_CHAPTER} is not in the book's quick execution cache")
    nb, path, _, slide_nb = entry
    rows = render_and_measure(path, browser)
    n_slides = sum(c.metadata["slideshow"]["slide_type"] in ("slide", "subslide") for c in slide_nb.cells)
    assert len(rows) == n_slides
    tall = [f"{r['h']}/{r['v']} '{r['title']}': {r['height']} px" for r in rows if r["height"] > CANVAS_H]
    assert not tall, f"slides taller than the {CANVAS_H}-px canvas: {tall}"
    assert sum(r["figures"] for r in rows) == len(_shown_figures(nb)) > 0
    assert all(r["visible_figures"] == r["figures"] for r in rows), [r for r in rows if r["visible_figures"] < r["figures"]]


def test_make_slides_says_which_profile_runs_and_how_long(tmp_path, monkeypatch):
    """Right after `make test` (quick) a `make slides` in the standard profile re-executes every chapter: it says so,
    with the kernel time the last build of that profile recorded, and how to avoid it."""
    monkeypatch.setattr(slides, "ROOT", tmp_path)
    (tmp_path / "_build" / "execution").mkdir(parents=True)
    (tmp_path / "_build" / "execution" / "standard-abc.json").write_text(
        '{"notebooks/00_how_to_read": {"runtime": 30.0}, "notebooks/10_linrep_derivations": {"runtime": 90.0}}')
    note = slides.execution_note(["00_how_to_read", "10_linrep_derivations", "11_linrep_experiments"], "standard", 2)
    assert "profile standard" in note and "executing 3 chapter(s)" in note and "120 s" in note and "2 of them" in note
    assert "PROFILE=quick" in note and "OUTPUTS=book-cache" in note
    assert "no quick build has recorded times" in slides.execution_note(["00_how_to_read"], "quick", 2)
