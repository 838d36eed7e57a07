r"""Prose never contradicts the ledger (issue 23): no hand-typed verdict, direction or measured number.

Every verdict (*reproduced*, *not reproduced*, *inconclusive*, a tuned value *at its grid's edge*), every sign or
direction of a measured effect and every number a build measures must be printed from that build's ledger — on a
prose page with ``{curvlab-value}`chapter::name::field``` or the ``curvlab-case`` directive, in a notebook with
``checks.conclude`` / ``checks.value`` in a code cell (book/conventions.md, "Prose never contradicts the ledger").
This test reads every prose page (``book/*.md``) and every chapter's Markdown cells (``notebooks/*.ipynb``) and
reports, per file, the sentences that break the rule.

The heuristic, in order:

1. **What is read.** Code blocks, ``{curvlab-case}``/``{curvlab-ledger}``/``{literalinclude}``/``{code-cell}``
   directives, directive option lines, HTML comments and display math are dropped; every role
   (``{curvlab-value}`...```, ``{ref}`...```, ...) becomes a placeholder, so a word inside a role or a
   ledger-chosen directive never counts. Inline code becomes a placeholder too, except the profile names
   ```quick```, ```standard```, ```paper```, which are kept as the word ``PROFILE``. The rest is split into
   sentences (a table row, a list item and a heading are units of their own).
2. **Verdict words** — *reproduced*, *not reproduced*, *inconclusive*, *grid's edge* / *grid edge* / *edge of its
   grid*, any case — are refused anywhere, except in a sentence that explains the vocabulary rather than asserts a
   verdict: it names all three claim verdicts ("recorded as reproduced when ..., not reproduced when ...,
   inconclusive otherwise"), or says "reproduced or not", or its subject is generic — "a claim", "a verdict",
   "every claim", "each claim", "any claim", "a choice", "a best value", "a tuned value" — and it has no marker of
   this build (3.).
3. **Context.** A sentence *speaks of this build's measurements* when it has a *strong* marker — a verdict word,
   "ledgered", "this build", "the build measures", "came out", "in our runs", "we measure(d)", "measured here",
   "in this profile" — or a *weak* one — a profile name (```quick``` etc., "quick profile") — and does not quote
   an outside source (the paper, the digest, the authors, a review, "reports", "published"). ("the ledger" alone is
   no marker: pages describe the ledger without quoting it.) A sentence that says it was *measured in chapter N*
   (also "**Measured (chapter N).**", "checked (chapter N)") speaks of the build's measurements for rule 5. Benchmark
   timings (performance and paper-scale pages) are dated runs, not ledger values, and carry none of these markers.
4. **Directions.** *Effect* words — positive / negative / faster / slower / beats / outperforms / wins / reversed /
   flips — are refused in a sentence with a strong or weak marker; *comparatives* — larger / smaller / higher /
   lower / better / worse / exceeds, and above / below followed by a value (``$``, a digit, zero, one, its, their,
   the threshold) — only with a strong marker ("the table below" is no direction). Write ``::sign`` or a
   ``curvlab-case`` instead.
5. **Numbers** — a decimal number (``0.21``), scientific notation (``3.66e-2``, ``3.66\times10^{-2}``) or a
   percentage — in a sentence that speaks of this build's measurements are refused, unless the number is a
   setting or a threshold: it follows ``=``, ``<``, ``>``, ``\le``, ``\ge``, ``\leq``, ``\geq`` (so ``$\eta=0.5$``
   and "closes < half the gap" pass, but "$\approx 0.21$" does not). A decimal number with an uncertainty
   (``0.25 \pm 0.01``) is refused in any sentence. Integers are not read (sizes, seeds and counts are settings far
   more often than measurements).
6. **Allow-list.** :data:`ALLOWED` names the few sentences that match and are right, each with its reason. It is
   reviewed like code: add an entry only for a sentence that states no result of this build.

Run ``python tests/test_prose_ledger.py`` for the offenders of every file at once.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "book").glob("*.md"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

#: (file name, a substring of the offending sentence, why the sentence is right). Keep it short.
ALLOWED: list[tuple[str, str, str]] = [
]

DROP_DIRECTIVES = {"curvlab-case", "curvlab-ledger", "curvlab-status", "literalinclude", "code-cell", "code-block",
                   "code", "math", "raw", "bibliography", "footbibliography", "mermaid", "csv-table"}
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,}|:{3,})\s*(\{([\w:-]+)\})?(.*)$")
_VERDICT = re.compile(r"\bnot\s+reproduced\b|\breproduced\b|\binconclusive\b|\bgrid'?s\s+edge\b|\bgrid\s+edge\b"
                      r"|\bedge\s+of\s+(?:its|the|their)\s+grids?\b", re.I)
_THREE = (re.compile(r"\bnot\s+reproduced\b", re.I), re.compile(r"(?<!not )\breproduced\b", re.I),
          re.compile(r"\binconclusive\b", re.I))
_STRONG = re.compile(r"\bledgered\b|\bthis build\b|\bthe build (?:measures|records|gives)\b|\bcame out\b"
                     r"|\bin our runs\b|\bwe measured?\b|\bmeasured here\b|\bin this profile\b", re.I)
#: Marks a sentence that reports a measurement (numbers in it are refused; directions only with a strong marker).
_MEASURES = re.compile(r"\bmeasured\s+(?:in|by)\s+(?:the\s+|this\s+)?chapters?\b|\bMeasured\s+\(chapters?\b"
                       r"|\bmeasured\s+\(chapters?\b|\bchecked\s+\(chapters?\b", re.I)
_WEAK = re.compile(r"\bPROFILE\b|\b(?:quick|standard|paper)\s+profile\b")
_SOURCE = re.compile(r"\b(?:digest|the paper|the papers|the authors|review|reports?|reported|published|printed)\b",
                     re.I)
_EFFECT = re.compile(r"\b(?:positive|negative|faster|slower|beats?|outperforms?|wins?|reversed?|flips?)\b", re.I)
_COMPARATIVE = re.compile(r"\b(?:larger|smaller|higher|lower|better|worse|exceeds?)\b"
                          r"|\b(?:above|below)\s+(?=\$|\d|zero\b|one\b|its\b|their\b|the threshold\b)", re.I)
_GENERIC_SUBJECT = re.compile(r"\b(?:a|every|each|any)\s+(?:claim|verdict|choice|best value|tuned value)\b", re.I)
_QUOTED = re.compile(r'"[^"\n]{1,160}"|“[^”\n]{1,160}”')
_EITHER = re.compile(r"\breproduced or not\b", re.I)
_NUMBER = re.compile(r"(?<![\w.^_{\\])[-+−]?(?:\d+\.\d+|\d+)(?:\s*(?:\\times|×)\s*10\^\{?[-−]?\d+\}?|e[-+−]?\d+)"
                     r"|(?<![\w.^_{\\])[-+−]?\d+\.\d+|(?<![\w.^_{\\])\d+(?:\.\d+)?\s*\\?%")
_SETTING = re.compile(r"(?:=|<|>|\\le|\\ge|\\leq|\\geq|\\lt|\\gt|≤|≥)\s*[-+−]?\$?\s*$")
_WITH_ERROR = re.compile(r"\d\.\d+\s*\)?\s*(?:\\pm|±)\s*\d")


@dataclass(frozen=True)
class Finding:
    file: str
    rule: str  # verdict | direction | number
    sentence: str

    def __str__(self) -> str:
        return f"{self.file}: [{self.rule}] {self.sentence}"


def strip_markup(text: str) -> str:
    """The prose of a MyST page or Markdown cell: dropped blocks (see the module docstring) removed, roles and
    inline code replaced by placeholders."""
    out, stack = [], []  # stack of (fence char, length, keep content?)
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m:
            char, length, name = m.group(2)[0], len(m.group(2)), m.group(4)
            rest = (m.group(5) or "").strip()
            if stack and char == stack[-1][0] and length >= stack[-1][1] and not name and not rest:
                stack.pop()
                out.append("")
                continue
            if name or not stack or stack[-1][2]:
                keep = bool(name) and name not in DROP_DIRECTIVES and (not stack or stack[-1][2])
                if name or char != ":" or not stack:
                    stack.append((char, length, keep))
                    out.append("")
                    continue
        if stack and not stack[-1][2]:
            continue
        if stack and re.match(r"^\s*:[\w-]+:", line):  # a directive's option line
            continue
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", " ⟨math⟩ ", text, flags=re.S)
    text = re.sub(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", " ⟨math⟩ ", text, flags=re.S)
    text = re.sub(r"\{curvlab-value\}`[^`]*`", "⟨ledger⟩", text)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", "⟨ref⟩", text)
    text = re.sub(r"`(quick|standard|paper)`", "PROFILE", text)
    text = re.sub(r"``.*?``|`[^`\n]*`", "⟨code⟩", text)
    return text


def sentences(text: str) -> list[str]:
    """Units of prose: table rows, list items and headings on their own; paragraphs split into sentences."""
    units: list[str] = []
    for para in re.split(r"\n\s*\n", strip_markup(text)):
        block: list[str] = []
        for ln in para.splitlines():
            s = ln.strip()
            if s.startswith("|") or s.startswith("#"):
                units.append(s)
                continue
            if re.match(r"^([-*+]|\d+[.)])\s", s) and block:
                units.append(" ".join(block))
                block = []
            if s:
                block.append(s)
        if block:
            units.append(" ".join(block))
    out = []
    for u in units:
        out += re.split(r"(?<=[.;!?])\s+(?=[A-Z(*$⟨\[])", u)
    return [s.strip() for s in out if s.strip()]


def _strong(s: str) -> bool:
    return bool(_VERDICT.search(s) or _STRONG.search(s))


def _weak(s: str) -> bool:
    return bool(_WEAK.search(s) and not _SOURCE.search(s))


def _explains_vocabulary(s: str) -> bool:
    """A sentence about what the verdicts mean, not about one claim of this build (rule 2 of the docstring)."""
    if all(p.search(s) for p in _THREE) or _EITHER.search(s):
        return True
    return bool(_GENERIC_SUBJECT.search(s) and not _STRONG.search(s) and not _WEAK.search(s))


def check_text(text: str, file: str = "<text>") -> list[Finding]:
    """The sentences of ``text`` that type a verdict, a direction or a measured number by hand."""
    found = []
    for s in sentences(text):
        if any(file == f and sub in s for f, sub, _ in ALLOWED):
            continue
        if _VERDICT.search(s) and not _explains_vocabulary(s):
            found.append(Finding(file, "verdict", s))
            continue
        if _WITH_ERROR.search(s):
            found.append(Finding(file, "number", s))
            continue
        s_unquoted = _QUOTED.sub("⟨quote⟩", s)  # a quoted claim's name is no assertion of this build
        strong = _strong(s) and not _explains_vocabulary(s)
        measures = bool(_MEASURES.search(s))
        if not (strong or measures or _weak(s)):
            continue
        if _EFFECT.search(s_unquoted) or (strong and _COMPARATIVE.search(s_unquoted)):
            found.append(Finding(file, "direction", s))
            continue
        for m in _NUMBER.finditer(s_unquoted):
            if not _SETTING.search(s_unquoted[max(0, m.start() - 12):m.start()]):
                found.append(Finding(file, "number", s))
                break
    return found


def notebook_markdown(path: Path) -> str:
    nb = json.loads(path.read_text())
    return "\n\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                       for c in nb["cells"] if c["cell_type"] == "markdown")


def check_file(path: Path) -> list[Finding]:
    text = notebook_markdown(path) if path.suffix == ".ipynb" else path.read_text()
    return check_text(text, path.name)


# --------------------------------------------------------------------------------------------------------
# The detector on planted sentences
# --------------------------------------------------------------------------------------------------------
PLANTED_BAD = [
    ("verdict", "The flow-limit hypothesis is ledgered as *not reproduced*."),
    ("verdict", "In `standard` the claim is reproduced."),
    ("verdict", "Adam's tuned step is at its grid's edge in `standard`."),
    ("verdict", "This comparison is inconclusive at these sizes."),
    ("direction", "In `standard` NGD came out negative (NGD faster)."),
    ("direction", "In this build the gap is larger for NGD than for K-FAC."),
    ("direction", "In our runs the ratio is above $1$ for at least one seed."),
    ("verdict", 'In `quick` the claim is "not reproduced".'),
    ("number", "A.8: the build measures 3.66e-2 for the floor."),
    ("number", "In `quick` the ratio is 0.705, with slopes 0.15–0.22."),
    ("number", "The share is $0.21 \\pm 0.03$."),
    ("number", "In the quick profile the floor is $4.1\\times10^{-2}$."),
]
PLANTED_GOOD = [
    "The claim is ledgered as {curvlab-value}`21_x::flow limit::verdict` in this build.",
    "In `standard` NGD came out {curvlab-value}`11_x::NGD slower::sign`.",
    "A claim is recorded as *reproduced* when its interval lies on the claimed side, *not reproduced* when it lies "
    "on the other side, and *inconclusive* otherwise.",
    "The `paper` profile runs $\\eta=0.02$ with $n = 500$ for 30 s.",
    "The digest measured ratios 0.84 and 0.80 in `quick`.",
    "The claim is that Adam closes $< 0.5$ of the gap.",
    "The loss decreases faster with a larger step, as the bound shows.",
    "```{curvlab-case} 21_x::flow limit\n:reproduced: In `quick` the runs are in the flow limit (0.95).\n"
    ":not_reproduced: They are not.\n:inconclusive: Cannot tell.\n```",
    "```python\nprint('reproduced', 0.705)\n```",
    "We reproduce the paper's Figure 2 with the same sizes.",
    "A verdict that rests on a tuned value at the edge of its grid is recorded as *inconclusive*.",
    "Paper claims are ledgered, reproduced or not, and never tuned until they pass.",
    "The table below lists the `quick` profile's run times; the cell above computes them.",
    "The foil is the semicircle's edges $1\\pm2\\sqrt\\gamma$.",
]


@pytest.mark.parametrize("rule,text", PLANTED_BAD, ids=[f"{r}-{i}" for i, (r, _) in enumerate(PLANTED_BAD)])
def test_planted_hand_typed_sentences_are_caught(rule, text):
    found = check_text(text)
    assert [f.rule for f in found] == [rule], found


@pytest.mark.parametrize("text", PLANTED_GOOD, ids=range(len(PLANTED_GOOD)))
def test_ledger_bound_and_generic_sentences_pass(text):
    assert check_text(text) == []


def test_a_planted_sentence_fails_a_real_page(tmp_path):
    """The test over the real pages catches a sentence planted into one that passes (the deviations page)."""
    page = ROOT / "book" / "deviations.md"
    planted = tmp_path / "deviations.md"
    planted.write_text(page.read_text() + "\n\nIn `standard` this claim is not reproduced (gap 0.21).\n")
    before = {f.sentence for f in check_file(page)}
    new = [f for f in check_file(planted) if f.sentence not in before]
    assert [f.rule for f in new] == ["verdict"] and "gap 0.21" in new[0].sentence


def test_a_planted_markdown_cell_fails_a_notebook(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["In `quick` Adam's step is at its grid's edge."],
                     "metadata": {}},
                    {"cell_type": "code", "source": ["checks.conclude('x', reproduced='reproduced')"],
                     "metadata": {}, "outputs": [], "execution_count": None}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "99_planted.ipynb"
    path.write_text(json.dumps(nb))
    assert [f.rule for f in check_file(path)] == ["verdict"]


def test_allow_list_entries_are_needed_and_explained(monkeypatch):
    """Every allow-list entry names a file that exists, has a reason, and is needed: without the list, a sentence it
    matches would be flagged (an entry whose sentence is gone only warns, so that another page's edit does not fail
    here)."""
    monkeypatch.setattr(sys.modules[__name__], "ALLOWED", [])
    for file, sub, why in list(_ALLOWED_AT_IMPORT):
        path = ROOT / "book" / file if file.endswith(".md") else ROOT / "notebooks" / file
        assert path.exists(), file
        assert len(why) > 20, f"{file}: give the reason for allowing {sub!r}"
        text = notebook_markdown(path) if path.suffix == ".ipynb" else path.read_text()
        if not any(sub in s for s in sentences(text)):  # the page changed: say so, without failing another's edit
            warnings.warn(f"{file}: allow-list entry {sub!r} matches no sentence any more (remove it)")
            continue
        flagged = [f.sentence for f in check_file(path)]
        assert any(sub in s for s in flagged), f"{file}: allow-list entry {sub!r} is not needed (remove it)"


_ALLOWED_AT_IMPORT = list(ALLOWED)


# --------------------------------------------------------------------------------------------------------
# The book's prose
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PAGES + NOTEBOOKS, ids=lambda p: p.name)
def test_prose_takes_verdicts_signs_and_numbers_from_the_ledger(path):
    found = check_file(path)
    assert not found, (f"{path.name}: {len(found)} sentence(s) type a verdict, a direction or a measured number by "
                       "hand; render them from the ledger ({curvlab-value}`chapter::name::field`, a curvlab-case "
                       "directive, or checks.conclude / checks.value in a code cell):\n"
                       + "\n".join(f"  [{f.rule}] {f.sentence}" for f in found))


if __name__ == "__main__":  # python tests/test_prose_ledger.py [files...]: the offenders of every file
    paths = [Path(p) for p in sys.argv[1:]] or PAGES + NOTEBOOKS
    total = 0
    for p in paths:
        found = check_file(p)
        total += len(found)
        if found:
            print(f"\n{p.name}: {len(found)}")
            for f in found:
                print(f"  [{f.rule}] {f.sentence[:240]}")
    print(f"\n{total} offending sentence(s)")
