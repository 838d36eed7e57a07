"""Keep chapter notebooks in the book's stored form.

    python tools/nbtool.py normalize notebooks/*.ipynb   # rewrite in place
    python tools/nbtool.py check notebooks/*.ipynb       # exit 1 if any notebook is not normalised

Stored form: no outputs, no execution counts, no widget state, a fixed kernelspec, and **slide metadata** on every
cell by the book's convention (``book/conventions.md``) so `make slides` and RISE need no hand editing:

* a Markdown cell opening with ``#`` or ``##`` starts a **slide**; one opening with ``###`` a **subslide**;
* the setup cell (tag ``setup``) and cells tagged ``remove-cell`` are **skip**ped;
* cells tagged ``fragment`` appear as a **fragment**; cells tagged ``notes`` become speaker **notes**;
* every other cell continues the current slide (``-``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def slide_type(cell: dict[str, Any]) -> str:
    tags = set(cell.get("metadata", {}).get("tags", []))
    if tags & {"setup", "remove-cell"}:
        return "skip"
    if "notes" in tags:
        return "notes"
    if "fragment" in tags:
        return "fragment"
    if cell["cell_type"] == "markdown":
        first = "".join(cell.get("source", "")).lstrip().split("\n", 1)[0]
        if first.startswith("### "):
            return "subslide"
        if first.startswith("# ") or first.startswith("## "):
            return "slide"
    return "-"


def normalize(nb: dict[str, Any]) -> dict[str, Any]:
    nb = copy.deepcopy(nb)
    nb.setdefault("metadata", {})
    nb["metadata"].pop("widgets", None)
    nb["metadata"]["kernelspec"] = KERNELSPEC
    nb["metadata"].setdefault("language_info", {"name": "python"})
    nb["nbformat"], nb["nbformat_minor"] = 4, max(5, nb.get("nbformat_minor", 5))
    seen: set[str] = set()
    for index, cell in enumerate(nb.get("cells", [])):
        cid = cell.get("id")
        if not cid or cid in seen:
            cell["id"] = cid = f"cell-{index:03d}"
        seen.add(cid)
        src = cell.get("source", "")
        if isinstance(src, list):
            src = "".join(src)
        cell["source"] = src
        cell.setdefault("metadata", {})
        cell["metadata"].pop("execution", None)
        cell["metadata"]["slideshow"] = {"slide_type": slide_type(cell)}
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    return nb


def dumps(nb: dict[str, Any]) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("normalize", "check"):
        print(__doc__)
        return 2
    bad = 0
    for name in argv[1:]:
        path = Path(name)
        text = path.read_text()
        want = dumps(normalize(json.loads(text)))
        if argv[0] == "normalize":
            path.write_text(want)
        elif text != want:
            print(f"{path}: not in stored form (run `python tools/nbtool.py normalize {path}`)")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
