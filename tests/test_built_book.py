"""Checks on the built book (``make test`` runs them after the strict quick build; skipped without a build)."""

from __future__ import annotations

import html
import json
import os
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
CACHES = ROOT / "_build" / ".jupyter_cache"


def executed_notebooks() -> list[Path]:
    """The executed notebooks the pages were rendered from: the newest quick execution cache."""
    caches = sorted(CACHES.glob("quick-*"), key=lambda p: p.stat().st_mtime)
    return sorted(caches[-1].glob("executed/*/base.ipynb")) if caches else []
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

#: Set to a ledger directory (e.g. one filled by single chapters run with ``CURVLAB_LEDGER_DIR``) to run the
#: evidence lint on those records without a book build.
LINT_DIR_ENV = "CURVLAB_LINT_LEDGER_DIR"

pytestmark = [pytest.mark.built]


@pytest.fixture(autouse=True)
def _needs_the_built_book(request):
    if request.node.name.startswith("test_evidence_lint") and os.environ.get(LINT_DIR_ENV):
        return
    if not (HTML / "book" / "index.html").exists():
        pytest.skip("the book has not been built")


def ledger_records() -> dict[str, list[dict]]:
    """The check records of the executed chapters: the ledger directory of the quick build that rendered the pages
    (the one keyed on the current library; else the newest), or ``$CURVLAB_LINT_LEDGER_DIR``."""
    if os.environ.get(LINT_DIR_ENV):
        d = Path(os.environ[LINT_DIR_ENV])
    else:
        sys.path.insert(0, str(ROOT / "book" / "_ext"))
        import curvlab_book

        d = curvlab_book.ledger_dir("quick", curvlab_book.library_key("quick"))
        if not d.is_dir():
            dirs = sorted((ROOT / "_build" / "ledger").glob("quick-*"), key=lambda p: p.stat().st_mtime)
            d = dirs[-1] if dirs else d
    return {f.stem: json.loads(f.read_text()) for f in sorted(d.glob("*.json"))}


def test_evidence_lint_over_the_executed_chapters():
    """Every derived check of the build says what it compares, and none is self-calibrated, unable to tell its
    prediction from its foil, or one computation shown as evidence (:func:`curvlab.checks.lint`)."""
    from curvlab import checks

    records = ledger_records()
    assert records, "no check records found for the built book"
    findings = checks.lint(records)
    assert not findings, f"{len(findings)} derived checks are not evidence:\n" + "\n".join(map(str, findings))


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.images: list[tuple[dict, list[str]]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append((a, list(self.stack)))
        elif tag not in ("br", "hr", "meta", "link", "input", "source"):
            self.stack.append(f"{tag}.{a.get('class', '')}")

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].split(".")[0] == tag:
                del self.stack[i:]
                break


def chapter_pages() -> list[Path]:
    return [HTML / "notebooks" / f"{nb.stem}.html" for nb in NOTEBOOKS]


def test_every_chapter_was_built():
    for page in chapter_pages():
        assert page.exists(), f"{page} missing"


@pytest.mark.parametrize("page", chapter_pages(), ids=lambda p: p.stem)
def test_figures_have_alt_text_and_captions(page):
    parser = _Images()
    parser.feed(page.read_text())
    content = [(a, st) for a, st in parser.images if a.get("src", "").startswith("data:image")]
    for attrs, stack in content:
        alt = attrs.get("alt", "")
        assert len(alt) >= 20 and not alt.endswith(".png"), f"{page.stem}: an image without real alt text"
        assert any("curvlab-figure" in s for s in stack), f"{page.stem}: a figure not shown with plotting.show"
    html = page.read_text()
    # matplotlib figures that bypassed plotting.show are rendered by myst-nb as plain <img> files
    assert not re.search(r'<img[^>]+src="\.\./_images/[^"]+\.png"[^>]*alt="[^"]*\.png"', html)
    assert html.count("<figcaption>") >= len(content)


@pytest.mark.parametrize("page", chapter_pages(), ids=lambda p: p.stem)
def test_profile_badge_and_setup_line(page):
    html = page.read_text()
    assert "curvlab-profile-badge" in html and "profile: quick" in html
    assert re.search(r"curvlab \S+ \| profile=quick \| device=", html)


def test_no_widget_views_or_stderr_in_executed_notebooks():
    executed = executed_notebooks()
    assert len(executed) >= len(NOTEBOOKS), "executed notebooks missing from the execution cache"
    for path in executed:
        nb = json.loads(path.read_text())
        assert sum(len(c.get("outputs", [])) for c in nb["cells"]) > 0, f"{path} has no outputs"
        for cell in nb["cells"]:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                assert "application/vnd.jupyter.widget-view+json" not in data, f"{path}: a dead widget view"
                assert not (out.get("output_type") == "stream" and out.get("name") == "stderr"), (
                    f"{path}: stderr output {''.join(out.get('text', ''))[:200]!r}"
                )
                assert out.get("output_type") != "error", f"{path}: an error output"


def test_ledger_page_lists_every_chapter_check():
    ledger = (HTML / "book" / "ledger.html").read_text()
    records = sorted((ROOT / "_build" / "ledger").glob("quick-*/*.json"), key=lambda p: p.stat().st_mtime)
    assert records, "no ledger records were written"
    latest_dir = records[-1].parent
    n = 0
    for f in latest_dir.glob("*.json"):
        for rec in json.loads(f.read_text()):
            n += 1
            assert html.escape(rec["name"], quote=False) in ledger, f"{rec['name']} is missing from the ledger"
            assert rec["status"] != "failed", f"a failed derived check reached the ledger: {rec['name']}"
    assert n > 0
    assert "Paper claims" in ledger and "Derived predictions" in ledger


def test_status_page_lists_every_notebook_with_its_time():
    status = (HTML / "book" / "status.html").read_text()
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.stem}" in status
    assert "executed in this build" in status
    assert "Profile of this build: quick" in status


def test_api_page_documents_the_core_modules():
    api = (HTML / "book" / "api.html").read_text()
    for name in ("curvlab.checks.derived", "curvlab.checks.Tolerance", "curvlab.curvature.kernel_gn_step",
                 "curvlab.sweep.sweep", "curvlab.plotting.show", "curvlab.config.pick"):
        assert f'id="{name}"' in api, f"{name} is not documented"
    assert 'href="https://pytorch.org/docs/stable/tensors.html#torch.Tensor"' in api, "torch.Tensor is not linked"
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import curvlab_book

    text = html.unescape(re.sub(r"<[^>]+>", "", api))
    reprs = sorted(set(m.group(0) for m in curvlab_book.CODE_REPR.finditer(text)))
    assert not reprs, f"the API page prints {len(reprs)} object reprs as values: {reprs[:3]}"
    assert re.search(r"Keys when the module is loaded \(\d+\): SGD\b", text), "curvlab.linrep.UPDATES should list its update rules"


def test_mathjax_is_served_from_the_book():
    page = (HTML / "notebooks" / f"{NOTEBOOKS[0].stem}.html").read_text()
    assert re.search(r'src="[^"]*_static/mathjax/tex-svg-full\.js', page), "MathJax should be bundled for offline reading"
    assert (HTML / "_static" / "mathjax" / "tex-svg-full.js").exists()


def test_launch_buttons_point_at_the_repository():
    import yaml

    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    page = (HTML / "notebooks" / f"{NOTEBOOKS[0].stem}.html").read_text()
    assert repo.replace("https://github.com/", "") in page and "colab.research.google.com" in page


def test_prose_numbers_come_from_this_builds_ledger():
    """Every ``{curvlab-value}`` on a prose page found its check in this build's ledger (the strict build warns too)."""
    missing = [p.name for p in sorted((HTML / "book").glob("*.html")) if "[no ledger value:" in p.read_text()]
    assert not missing, f"pages quoting a number the ledger does not supply: {missing}"
