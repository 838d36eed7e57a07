"""Sphinx extension: the paper-scale page reads each committed frame's measured figures from its provenance.

``book/paper_scale.md`` quotes what a committed frame (``lib/curvlab/paper_frames/<grid>.<profile>.json``) records
about the run that made it — its time, revision, date — as ``{frame}`<grid>.<profile>::<field>```, replaced when
the page is read (``source-read``) by the provenance's value, so that a re-exported frame never leaves an old
figure behind. Fields:

``wall_s``   the sum of the cells' wall times, "948 s";
``cpu_h``    the same in hours, three significant digits;
``revision`` the revision(s) the cells ran at, as recorded (``+dirty`` included);
``date``     the day of the last cell (UTC);
``threads``  the torch intra-op thread count(s) of the cells.

A missing frame, field or value stops the build with an error naming it (:class:`FramePageError`). The functions
are importable without Sphinx (``tests/test_book_extension.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FRAMES = ROOT / "lib" / "curvlab" / "paper_frames"
PAGE_DOCNAMES = ("book/paper_scale",)
REF_RE = re.compile(r"\{frame\}`([^`]+)`")
FIELDS = ("wall_s", "cpu_h", "revision", "date", "threads")


class FramePageError(Exception):
    """A ``{frame}`` reference the committed frames cannot answer."""


def frame_text(ref: str, frames: Path = FRAMES) -> str:
    """The text of ``{frame}`<grid>.<profile>::<field>```."""
    parts = [p.strip() for p in ref.split("::")]
    if len(parts) != 2 or not all(parts) or parts[1] not in FIELDS:
        raise FramePageError(f"{{frame}}`{ref}` must be <grid>.<profile>::<field> with field in {FIELDS}")
    stem, fld = parts
    path = frames / f"{stem}.json"
    if not path.is_file():
        raise FramePageError(f"{{frame}}`{ref}`: no committed frame {path}")
    try:
        prov: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise FramePageError(f"{{frame}}`{ref}`: {path.name} is not valid JSON ({exc})") from None
    try:
        if fld == "wall_s":
            return f"{float(prov['wall_s']):.0f} s"
        if fld == "cpu_h":
            return f"{float(prov['wall_s']) / 3600:.3g}"
        if fld == "revision":
            revs = prov["revisions"]
            return ", ".join(f"`{r}`" for r in revs) if revs else _missing(ref)
        if fld == "date":
            stamps = sorted(prov["timestamps"])
            return stamps[-1][:10] if stamps else _missing(ref)
        threads = prov["threads"]["torch_threads"]
        return ", ".join(str(t) for t in threads) if threads else _missing(ref)
    except (KeyError, TypeError, ValueError) as exc:
        raise FramePageError(f"{{frame}}`{ref}`: {path.name} records no usable {fld} ({exc!r})") from None


def _missing(ref: str) -> str:
    raise FramePageError(f"{{frame}}`{ref}`: the frame's provenance has no value for this field")


def process(text: str, frames: Path = FRAMES) -> str:
    """Replace every ``{frame}`` reference of ``text``; raises :class:`FramePageError`."""
    return REF_RE.sub(lambda mo: frame_text(mo.group(1), frames), text)


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    if docname not in PAGE_DOCNAMES:
        return
    from sphinx.errors import ExtensionError

    try:
        source[0] = process(source[0])
    except FramePageError as exc:
        raise ExtensionError(str(exc)) from None


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
