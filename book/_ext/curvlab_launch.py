"""Launch buttons: the Colab and Binder buttons of a chapter open its clean copy, ``notebooks/colab/<chapter>.ipynb``.

sphinx-book-theme builds the launch URLs from the page's path (``.../blob/<branch>/notebooks/<chapter>.ipynb``,
``.../v2/gh/<org>/<repo>/<branch>?urlpath=lab/tree/notebooks/<chapter>.ipynb``): the MyST source, which Colab shows
with raw roles, directive fences and undefined macros, and which Binder's JupyterLab shows without the book's macros
(jupyterlab-myst does not read ``book/macros.yml``), with raw citation keys and labels. ``tools/colab.py`` generates a
copy of every chapter that reads cleanly outside the book (every formula's macros expanded, references as "Lemma 7
(title)", citations author–year; tests/test_channels_notebooks.py renders each in KaTeX and jupyterlab-myst's parser);
this hook, run after the theme's own ``html-page-context`` handler (priority 501), points both buttons at that copy,
at the ref the copy installs ``curvlab`` from (:func:`colab.resolve_ref`: the release tag when the book is built at
one, else ``repository.branch``).

It also drops duplicate inline scripts from a page: sphinx-thebe 0.3 adds its configuration script
(``const THEBE_JS_URL = ...``) in ``env-before-read-docs`` through ``app.add_js_file``, which Sphinx 7.4 registers with
both the registry (file name ``''``) and the builder (``None``), so Sphinx's own de-duplication by file name
misses it; the page then declares the constant twice and the browser logs
"Identifier 'THEBE_JS_URL' has already been declared" (seen on a two-page Jupyter Book with nothing of ours).

Enable it from the book's extension: ``app.setup_extension("curvlab_launch")`` in ``curvlab_book.setup``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COPIES = ROOT / "notebooks" / "colab"


def _ref() -> str:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import colab

        return colab.resolve_ref()
    finally:
        sys.path.remove(str(ROOT / "tools"))


def _buttons(items: list[Any]):
    for item in items or []:
        if isinstance(item, dict):
            yield item
            yield from _buttons(item.get("buttons", []))


def colab_url(url: str, pagename: str, branch: str, ref: str) -> str:
    """The theme's Colab URL of ``pagename`` rewritten to the copy at ``ref`` (unchanged when there is no copy)."""
    name = Path(pagename).name
    if Path(pagename).parent.as_posix() != "notebooks" or not (COPIES / f"{name}.ipynb").exists():
        return url
    source = f"/blob/{branch}/notebooks/{name}.ipynb"
    if not url.endswith(source):
        return url
    return url[: -len(source)] + f"/blob/{ref}/notebooks/colab/{name}.ipynb"


def binder_url(url: str, pagename: str, branch: str, ref: str) -> str:
    """The theme's Binder URL of ``pagename`` rewritten to the copy at ``ref`` (unchanged when there is no copy)."""
    name = Path(pagename).name
    if Path(pagename).parent.as_posix() != "notebooks" or not (COPIES / f"{name}.ipynb").exists():
        return url
    m = re.match(rf"^(.*/v2/gh/[^/]+/[^/?]+/){re.escape(branch)}\?urlpath=([\w-]+)/tree/notebooks/{re.escape(name)}"
                 r"\.ipynb$", url)
    if not m:
        return url
    return f"{m.group(1)}{ref}?urlpath={m.group(2)}/tree/notebooks/colab/{name}.ipynb"


def _point_buttons_at_copies(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    branch = str((app.config.html_theme_options or {}).get("repository_branch") or "main")
    ref = app.config.curvlab_colab_ref or branch
    for button in _buttons(context.get("header_buttons", [])):
        url = button.get("url", "")
        if "colab.research.google.com" in url:
            button["url"] = colab_url(url, pagename, branch, ref)
        elif "/v2/gh/" in url:
            button["url"] = binder_url(url, pagename, branch, ref)


_point_colab_at_copies = _point_buttons_at_copies  # the name the tests and older builds know


def _dedupe_scripts(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Each script of a page once: the same file, or the same inline body, listed twice is dropped the second time."""
    seen, kept = set(), []
    for script in context.get("script_files") or []:
        # Sphinx 7.4's _JavaScript: the registry's copy has filename '', the builder's None, with the same body
        attrs = getattr(script, "attributes", {}) or {}
        name = getattr(script, "filename", script) or ""
        key = (str(name), tuple(sorted((k, str(v)) for k, v in attrs.items())))
        if key in seen:
            continue
        seen.add(key)
        kept.append(script)
    if "script_files" in context:
        context["script_files"][:] = kept


def _set_ref(app, config) -> None:
    if not config.curvlab_colab_ref:
        try:
            config.curvlab_colab_ref = _ref()
        except Exception:  # noqa: BLE001 - without git or tools/, the theme's branch is kept
            config.curvlab_colab_ref = ""


def setup(app) -> dict[str, Any]:
    app.add_config_value("curvlab_colab_ref", "", "html")
    app.connect("config-inited", _set_ref)
    app.connect("html-page-context", _point_buttons_at_copies, priority=502)
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
