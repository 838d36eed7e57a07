"""Sphinx extension: every figure of the performance page (and the running page's chapter-times table) comes from a committed benchmark results file.

``book/performance.md`` names its results in two ways, both resolved when the page is read (``source-read``):

* ``{include}`` of ``../benchmarks/results/<name>.md`` (a table generated from ``<name>.json`` by the benchmark)
  and ``{figure}`` of ``../benchmarks/results/<name>.png``;
* inline figures, ``{bench}`<name>::<figure key>``` (or ``::<figure key>::<field>``, field ``text`` by default,
  e.g. ``interval``): replaced by the string the benchmark stored in ``<name>.json`` under ``figures``.

For every results file the page names, :func:`check_result` requires that the JSON exists, was measured on a clean
revision (``machine.dirty`` false, no uncommitted changes, ``curvlab`` imported from that checkout) and under the
protocol (``benchmarks/harness.py``: a ``protocol`` entry). A missing, dirty or pre-protocol file stops the build
with an error that names the file (:class:`BenchPageError`). Where a file the run executed (its
``exercised_code``: library modules and the benchmark's baseline implementation) has changed since, the page gets
a visible warning after the table that names the changed files (:func:`stale_files`); the run is still shown.
A run the harness flagged for load gets a note too.

The functions are importable without Sphinx (``tests/test_bench_harness.py`` uses them on the page).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGE_DOCNAMES = ("book/performance", "book/running")  # running: the chapter-times table
INCLUDE_RE = re.compile(r"```\{(include|figure)\}\s+\.\./benchmarks/results/([\w.-]+)\.(md|png)[^\n]*\n(.*?)```",
                        re.S)
REF_RE = re.compile(r"\{bench\}`([^`]+)`")
#: Files whose change makes a result stale: the library, and the benchmarks' re-implementation of a baseline.
STALE_PREFIXES = ("lib/", "benchmarks/authors_gn.py")


class BenchPageError(Exception):
    """A results file the performance page needs is missing, dirty, outside the protocol or lacks a figure."""


def load_result(name: str, results: Path = RESULTS) -> dict[str, Any]:
    path = results / f"{name}.json"
    if not path.is_file():
        raise BenchPageError(f"performance page: results file benchmarks/results/{name}.json is missing "
                             "(run its benchmark in a clean checkout and commit the file)")
    return json.loads(path.read_text())


def check_result(name: str, payload: dict[str, Any]) -> None:
    """Raise :class:`BenchPageError` unless ``payload`` is a clean run under the protocol."""
    m = payload.get("machine") or {}
    label = m.get("revision_label") or m.get("curvlab_revision") or "unknown"
    if "protocol" not in payload:
        raise BenchPageError(f"performance page: benchmarks/results/{name}.json predates the benchmark protocol "
                             f"(rev {label}); rerun it")
    dirty = bool(m.get("dirty", True)) or bool(m.get("uncommitted_changes")) or "+dirty" in str(label) \
        or "uncommitted" in str(label) or not m.get("curvlab_from_checkout", False)
    if dirty:
        raise BenchPageError(f"performance page: benchmarks/results/{name}.json was measured on a dirty or foreign "
                             f"checkout (rev {label}, curvlab from {m.get('curvlab_path', '?')}); rerun it in a clean "
                             "clone")


def stale_files(payload: dict[str, Any], root: Path = ROOT) -> list[str]:
    """The library/baseline files the run executed that differ now (or are gone), sorted."""
    out = []
    for path, digest in (payload.get("exercised_code") or {}).items():
        if not path.startswith(STALE_PREFIXES):
            continue
        f = root / path
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            out.append(path)
    return sorted(out)


def figure_text(name: str, key: str, field: str, payload: dict[str, Any]) -> str:
    figs = payload.get("figures") or {}
    if key not in figs:
        near = ", ".join(sorted(figs)[:8])
        raise BenchPageError(f"performance page: benchmarks/results/{name}.json has no figure {key!r} "
                             f"(it has: {near}{', ...' if len(figs) > 8 else ''})")
    value = figs[key].get(field)
    if value is None:
        raise BenchPageError(f"performance page: figure {key!r} of {name}.json has no field {field!r}")
    return str(value)


def _note(name: str, payload: dict[str, Any], root: Path) -> str:
    notes = []
    stale = stale_files(payload, root)
    if stale:
        rev = (payload.get("machine") or {}).get("revision_label", "?")
        notes.append(":::{warning}\nThe library code this run measured has changed since it was made (rev "
                     f"`{rev}`): {', '.join(f'`{s}`' for s in stale)}. The figures of `{name}` are those of the "
                     "older code until `make bench` reruns it.\n:::\n")
    if payload.get("flagged"):
        notes.append(f"*The run of `{name}` was flagged: other jobs' load exceeded the protocol's level (see its "
                     "load figures above); absolute times are inflated, paired ratios less so.*\n")
    return "\n".join(notes)


def process(text: str, results: Path = RESULTS, root: Path = ROOT) -> tuple[str, list[str]]:
    """Resolve the page's results: check every named file, replace every ``{bench}`` figure, add the stale and
    load notes after each include. Returns ``(new text, names used)``; raises :class:`BenchPageError`."""
    cache: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in cache:
            payload = load_result(name, results)
            check_result(name, payload)
            cache[name] = payload
        return cache[name]

    def sub_ref(mo: re.Match) -> str:
        parts = mo.group(1).split("::")
        if len(parts) not in (2, 3):
            raise BenchPageError(f"performance page: {{bench}}`{mo.group(1)}` must be name::figure[::field]")
        name, key = parts[0].strip(), parts[1].strip()
        field = parts[2].strip() if len(parts) == 3 else "text"
        return figure_text(name, key, field, get(name))

    text = REF_RE.sub(sub_ref, text)

    def sub_include(mo: re.Match) -> str:
        kind, name = mo.group(1), mo.group(2)
        payload = get(name)
        note = _note(name, payload, root) if kind == "include" else ""
        return mo.group(0) + ("\n\n" + note if note else "")

    text = INCLUDE_RE.sub(sub_include, text)
    return text, sorted(cache)


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    if docname not in PAGE_DOCNAMES:
        return
    from sphinx.errors import ExtensionError

    try:
        source[0], _ = process(source[0])
    except BenchPageError as exc:
        raise ExtensionError(str(exc)) from None


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
