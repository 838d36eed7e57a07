"""The built pages read without sideways scrolling: no display equation is wider than the text column.

A reader on a laptop (a 1280-px-wide window) should never have to scroll an equation sideways to read it. Each
chapter page and each prose page of the quick build is loaded in headless Chromium at 1280 x 900, MathJax typesets it
(the book's own offline MathJax), and a probe measures every display equation (``mjx-container[display="true"]``)
against the box it sits in (the prose's equations; a cell's output, such as a SymPy expression, scrolls inside its
output box). An equation wider than its box (more than a pixel) fails the test, with its TeX, so the
author can split it into ``aligned`` rows.

Built test: ``make test`` runs it after the quick book build. It skips with the reason when no Chromium is installed
(``.ci/run`` installs it).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
WINDOW = (1280, 900)
#: Pages with no prose mathematics worth measuring (generated indices, the API reference, the search page).
SKIP_PAGES = {"genindex", "search", "py-modindex", "api"}

PROBE = r"""<script>
(function () {
  function measure() {
    var eqs = Array.prototype.slice.call(document.querySelectorAll('mjx-container[display="true"]'))
      .filter(function (e) { return !e.closest('.cell_output, .output'); });  // the prose's equations
    var wide = [];
    eqs.forEach(function (e) {
      var box = e.parentElement, over = Math.max(e.scrollWidth - e.clientWidth,
                                                  box ? box.scrollWidth - box.clientWidth : 0);
      if (over > 1) {
        var item = (window.MathJax ? MathJax.startup.document.getMathItemsWithin(e)[0] : null) || {};
        wide.push({over: over, width: e.scrollWidth, tex: String(item.math || '').slice(0, 160),
                   near: (e.closest('[id]') || {}).id || ''});
      }
    });
    var pre = document.createElement('pre'); pre.id = 'curvlab-measure';
    pre.textContent = JSON.stringify({equations: eqs.length, wide: wide}); document.body.appendChild(pre);
  }
  function go() {
    if (!document.querySelector('script[src*="mathjax"], script[src*="MathJax"], script[src*="tex-"]')) {
      measure();  // a page without mathematics: Sphinx loads no MathJax there
    } else if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise.then(function () { setTimeout(measure, 300); });
    } else { setTimeout(go, 200); }
  }
  window.addEventListener('load', go);
})();
</script>"""


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def pages() -> list[Path]:
    out = sorted((HTML / "notebooks").glob("*.html")) + sorted((HTML / "book").glob("*.html"))
    return [p for p in out if p.stem not in SKIP_PAGES and not p.name.endswith(".probe.html")]


def measure(page: Path, browser: str) -> dict:
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    try:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=60000", "--dump-dom", probe.as_uri()]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink(missing_ok=True)
    m = re.search(r'<pre id="curvlab-measure"[^>]*>(.*?)</pre>', run.stdout, flags=re.S)
    assert m, f"{page.name}: the page did not report its measurements (rc {run.returncode}): {run.stderr[-800:]}"
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.built
def test_no_display_equation_is_wider_than_the_page_at_1280_px():
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium (chromium / google-chrome) on PATH: `apt-get install chromium`, as .ci/run does")
    todo = pages()
    if not any(p.parent.name == "notebooks" for p in todo):
        pytest.skip("no built chapter pages: run the book build first (`make book-quick`)")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(todo, pool.map(lambda p: measure(p, browser), todo)))
    assert sum(r["equations"] for r in results.values()) > 50, "MathJax typeset almost nothing: the probe is broken"
    wide = [f"{p.relative_to(HTML)} (near #{w['near']}): {w['over']} px too wide: {w['tex']}"
            for p, r in results.items() for w in r["wide"]]
    assert not wide, "display equations wider than the text column at 1280 px (split them into aligned rows):\n" + \
        "\n".join(wide)


@pytest.mark.built
def test_probe_reports_an_equation_that_is_too_wide(tmp_path):
    """The probe can fail: a page with one deliberately over-long display equation is reported as too wide."""
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium (chromium / google-chrome) on PATH: `apt-get install chromium`, as .ci/run does")
    mathjax = sorted(HTML.glob("_static/**/tex-*.js")) or sorted(HTML.glob("_static/**/*mathjax*/**/*.js"))
    if not mathjax:
        pytest.skip("no built book with its offline MathJax: run `make book-quick` first")
    long_sum = "+".join(f"x_{{{i}}}^2" for i in range(120))
    page = tmp_path / "wide.html"
    page.write_text(f"""<html><head><script src="{mathjax[0].as_uri()}"></script></head><body>
<div style="width:600px;overflow-x:auto">\\[ {long_sum} \\]</div><div style="width:600px">\\[ a+b \\]</div>
</body></html>""")
    r = measure(page, browser)
    assert r["equations"] == 2
    assert len(r["wide"]) == 1 and r["wide"][0]["tex"].strip().startswith("x_{0}^2+x_{1}^2")
