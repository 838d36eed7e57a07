"""Launch buttons: the Colab button of a chapter opens its clean copy, ``notebooks/colab/<chapter>.ipynb``.

sphinx-book-theme builds the Colab URL from the page's path (``.../blob/<branch>/notebooks/<chapter>.ipynb``): the
MyST source, which Colab shows with raw roles, directive fences and undefined macros. ``tools/colab.py`` generates a
copy of every chapter that reads cleanly outside the book; this hook, run after the theme's own
``html-page-context`` handler (priority 501), points the Colab button at that copy, at the ref the copy installs
``curvlab`` from (:func:`colab.resolve_ref`: the release tag when the book is built at one, else
``repository.branch``). Binder and JupyterHub buttons keep the source chapter: they run JupyterLab with
jupyterlab-myst (``environment.yml``), which renders MyST.

Enable it from the book's extension: ``app.setup_extension("curvlab_launch")`` in ``curvlab_book.setup``.
"""

from __future__ import annotations

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


def _point_colab_at_copies(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    branch = str((app.config.html_theme_options or {}).get("repository_branch") or "main")
    ref = app.config.curvlab_colab_ref or branch
    for button in _buttons(context.get("header_buttons", [])):
        url = button.get("url", "")
        if "colab.research.google.com" in url:
            button["url"] = colab_url(url, pagename, branch, ref)


def _set_ref(app, config) -> None:
    if not config.curvlab_colab_ref:
        try:
            config.curvlab_colab_ref = _ref()
        except Exception:  # noqa: BLE001 - without git or tools/, the theme's branch is kept
            config.curvlab_colab_ref = ""


def setup(app) -> dict[str, Any]:
    app.add_config_value("curvlab_colab_ref", "", "html")
    app.connect("config-inited", _set_ref)
    app.connect("html-page-context", _point_colab_at_copies, priority=502)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
