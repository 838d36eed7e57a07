"""Generate the clean copies of the chapters that Colab, JupyterLab and Binder open: ``notebooks/colab/<chapter>.ipynb``.

    python tools/colab.py                      # (re)write every copy (what `make colab` runs)
    python tools/colab.py --check              # exit 1 if a stored copy is out of date
    python tools/colab.py --ref v1.2.0         # pin the copies' install to this ref (a release: see release.yml)
    python tools/colab.py --fix-setup-cells    # rewrite the install block of every chapter's setup cell
    python tools/colab.py --print-ref          # the ref the copies install by default
    python tools/colab.py --lab [--port N]     # JupyterLab on 127.0.0.1 over a workspace copy (what `make lab` runs)

In ``make lab`` a chapter can be presented live with jupyterlab-rise (the chapters carry slide metadata): the
notebook toolbar's RISE button, or ``http://127.0.0.1:<port>/rise/notebooks/colab/<chapter>.ipynb``.

The chapters (``notebooks/NN_*.ipynb``) are MyST; outside the book (Colab, JupyterLab, Binder) the same cells show
raw MyST and undefined macros. A copy is the chapter converted by the shared export layer, ``tools/myst_export.py``
(the same one the student notebooks and the slides use): roles as text and links to the published book,
theorem-like blocks as block quotes headed "**Lemma 7 (title).** *Status: proved here.*", numbered as in the book,
citations author–year with the chapter's reference list, every formula with the book's macros expanded (it renders in
KaTeX and MathJax without any definition), and a first cell that defines the macros with ``\\def`` for the reader's own
cells. The setup cell, in Colab (detected by ``COLAB_RELEASE_TAG`` or ``find_spec("google.colab")``), installs
``curvlab`` from the repository at :func:`resolve_ref` with the extras the chapter needs, shows pip's errors, and
fetches the data files the chapter reads (``configs/...``).

Copies are generated, committed and never edited by hand; ``tests/test_channels_notebooks.py`` fails when one is
stale, when any MyST syntax is left, or when a formula fails in KaTeX or in jupyterlab-myst's parser. The Colab and
Binder buttons of the built book open them (``book/_ext/curvlab_launch.py``).

``make lab`` never serves the repository itself: it copies ``notebooks/`` into a workspace
(``.curvlab_cache/lab/workspace``, ignored by git; ``CURVLAB_LAB_DIR`` moves it) and serves that, so opening, running
and saving a notebook leaves ``git status`` clean. The MyST chapters get a first cell of front matter with the book's
macros there (jupyterlab-myst reads ``math:`` from it); a file the reader changed in the workspace is kept, the others
follow the repository.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
OUT_DIR = NB_DIR / "colab"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import myst_export  # noqa: E402  (the one MyST -> notebook Markdown layer)
import nbtool  # noqa: E402
from myst_export import (  # noqa: E402,F401  (re-exported: tools and tests use them from here)
    KATEX_BUILTIN, Bibliography, BookIndex, Exporter, book_url, cell_source, expand_macros, lab_frontmatter,
    load_config, load_macros, macro_definitions, repo_url,
)

# ------------------------------------------------------------------------------------------------ configuration
EXTRA = "notebooks"  # the extra of lib/pyproject.toml with what chapters need beyond curvlab's core
#: Code that needs the extra: scikit-learn's digits (meanfield.load_digits_data, deep_linear.digits), sliders.
NEEDS_EXTRA = re.compile(r"\bload_digits_data\b|\bdigits\(|\bsklearn\b|\binteract\b|\bipywidgets\b")
#: Data files a chapter reads, relative to notebooks/ (fetched next to a copy that has no repository around it).
DATA_FILE = re.compile(r"""["'](configs/[\w./-]+\.(?:ya?ml|json|csv))["']""")


def _git(*args: str) -> str:
    try:
        res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def release_tag() -> str:
    """The release tag ``vX.Y.Z`` that HEAD is at, or ''."""
    tags = [t for t in _git("tag", "--points-at", "HEAD").split() if re.fullmatch(r"v\d+\.\d+\.\d+", t)]
    return sorted(tags)[-1] if tags else ""


def resolve_ref(config: dict[str, Any] | None = None) -> str:
    """The git ref a copy installs ``curvlab`` from: one that exists on the repository.

    ``CURVLAB_REF`` if set; else the release tag HEAD is at; else the branch the book is built from,
    ``repository.branch`` of ``_config.yml`` (the launch buttons open that branch; release.yml sets it to the tag);
    else the checked-out branch. The configured branch comes before the checked-out one on purpose: copies are
    committed, and a copy generated on a feature branch must not pin a branch that is deleted after the merge."""
    if os.environ.get("CURVLAB_REF"):
        return os.environ["CURVLAB_REF"].strip()
    tag = release_tag()
    if tag:
        return tag
    branch = str((config or load_config()).get("repository", {}).get("branch") or "").strip()
    if branch:
        return branch
    head = _git("rev-parse", "--abbrev-ref", "HEAD")
    return head if head and head != "HEAD" else "main"


def lib_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "lib" / "pyproject.toml").read_text())["project"]["version"]


def chapters() -> list[Path]:
    return sorted(p for p in NB_DIR.glob("*.ipynb") if re.match(r"\d\d_", p.name))



# ------------------------------------------------------------------------------------------------ setup cell
INSTALL_BLOCK = '''\
# Setup. In Colab, install curvlab from this book's repository at REF, keeping the runtime's torch and numpy.
# Elsewhere curvlab must be installed already (`make env` in a clone of the repository: the running page).
import importlib.util, os, subprocess, sys
REPO = "{repo}"
REF = "{ref}"  # the release tag in a release, else the branch the book is built from (tools/colab.py)
EXTRAS = "{extras}"  # what this chapter needs beyond curvlab's core{extras_note}
# find_spec("google.colab") imports the package "google" first: ask for it only where "google" exists
IN_COLAB = "COLAB_RELEASE_TAG" in os.environ or (
    importlib.util.find_spec("google") is not None and importlib.util.find_spec("google.colab") is not None)
if IN_COLAB and importlib.util.find_spec("curvlab") is None:
    import numpy, torch  # never reinstalled: pinned to the versions already there
    with open("/tmp/curvlab-pins.txt", "w") as pins:
        pins.write(f"torch=={{torch.__version__}}\\nnumpy=={{numpy.__version__}}\\n")
    pip = [sys.executable, "-m", "pip", "install", "-c", "/tmp/curvlab-pins.txt"]
    done = subprocess.run([*pip, f"curvlab{{EXTRAS}} @ git+{{REPO}}@{{REF}}#subdirectory=lib"], capture_output=True,
                          text=True, env={{**os.environ, "PIP_ROOT_USER_ACTION": "ignore"}})
    print("\\n".join(done.stdout.splitlines()[-3:]))
    if done.returncode:  # pip's own error, then stop here
        print(done.stderr, file=sys.stderr)
    done.check_returncode()
elif importlib.util.find_spec("curvlab") is None:
    raise ModuleNotFoundError(f"curvlab is not installed in this kernel: in a clone of {{REPO}} run `make env` and "
                              f"choose its .venv as the kernel, or pip install "
                              f"'curvlab{{EXTRAS}} @ git+{{REPO}}@{{REF}}#subdirectory=lib'")
'''

FETCH_BLOCK = '''\
for name in {files!r}:  # data files the chapter reads: fetched when not here
    if not os.path.exists(name):
        import shutil, urllib.request
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        if os.path.exists(os.path.join("..", name)):  # a copy opened from notebooks/colab/ of a clone
            shutil.copy(os.path.join("..", name), name)
        else:  # Colab: from the repository at REF
            urllib.request.urlretrieve(f"{raw}/{{REF}}/notebooks/{{name}}", name)
'''


def chapter_needs(nb: dict[str, Any]) -> tuple[str, list[str]]:
    """(extras spec, data files) for a chapter, from its code cells (the setup cell excluded)."""
    code = [cell_source(c) for c in nb["cells"] if c["cell_type"] == "code"
            and "setup" not in c.get("metadata", {}).get("tags", [])]
    text = "\n".join(code)
    extras = f"[{EXTRA}]" if NEEDS_EXTRA.search(text) else ""
    files = sorted(set(DATA_FILE.findall(text)))
    return extras, files


def install_block(nb: dict[str, Any], ref: str, config: dict[str, Any] | None = None) -> str:
    config = config or load_config()
    extras, files = chapter_needs(nb)
    note = ": scikit-learn, ipywidgets" if extras else " (nothing)"
    block = INSTALL_BLOCK.format(repo=repo_url(config), ref=ref, extras=extras, extra=EXTRA, extras_note=note)
    if files:
        raw = "https://raw.githubusercontent.com/" + repo_url(config).split("github.com/")[1]
        block += FETCH_BLOCK.format(files=files, raw=raw)
    return block


def split_setup(src: str) -> tuple[str, str]:
    """(install block, the chapter's own part) of a setup cell: the block ends after the ``if ...colab...:`` body."""
    lines = src.splitlines(keepends=True)
    start_if = next((k for k, ln in enumerate(lines) if ln.startswith("if ") and re.search(r"colab|IN_COLAB", ln)),
                    None)
    if start_if is None:
        return "", src
    k = start_if + 1
    while k < len(lines) and (not lines[k].strip() or lines[k][0] in " \t" or lines[k].startswith(("elif ", "else:"))):
        k += 1
    # a data-file loop that follows belongs to the block as well
    if k < len(lines) and lines[k].startswith("for name in ") and "data files" in lines[k]:  # FETCH_BLOCK
        k += 1
        while k < len(lines) and (not lines[k].strip() or lines[k][0] in " \t"):
            k += 1
    return "".join(lines[:k]), "".join(lines[k:])


def setup_cell_index(nb: dict[str, Any]) -> int:
    for k, c in enumerate(nb["cells"]):
        if c["cell_type"] == "code":
            if "setup" not in c.get("metadata", {}).get("tags", []):
                raise ValueError("the first code cell is not tagged 'setup'")
            return k
    raise ValueError("no code cell")


def expected_setup_source(nb: dict[str, Any], ref: str, config: dict[str, Any] | None = None) -> str:
    src = cell_source(nb["cells"][setup_cell_index(nb)])
    _, rest = split_setup(src)
    return install_block(nb, ref, config) + rest


# ------------------------------------------------------------------------------------------------ the copy
def convert_notebook(path: Path, ref: str | None = None, *, index: BookIndex | None = None,
                     bib: Bibliography | None = None, config: dict[str, Any] | None = None) -> tuple[dict, list[str]]:
    """The clean copy of one chapter and the list of MyST constructs that had no conversion."""
    config = config or load_config()
    ref = ref or resolve_ref(config)
    index = index or BookIndex.build()
    macros = load_macros()
    doc = f"notebooks/{path.stem}"
    nb = json.loads(path.read_text())
    conv = Exporter(doc, index=index, bib=bib or Bibliography(), macros=macros, config=config, ref=ref)
    out = copy.deepcopy(nb)
    setup_at = setup_cell_index(nb)
    cells = []
    for k, cell in enumerate(out["cells"]):
        cell = copy.deepcopy(cell)
        if cell["cell_type"] == "markdown":
            cell["source"] = conv.markdown(cell_source(cell))
        elif k == setup_at:
            cell["source"] = expected_setup_source(nb, ref, config)
        cells.append(cell)
    title = index.docs.get(doc, path.stem)
    intro = (
        f"${macro_definitions(macros)}$\n\n"
        f"*This is chapter [{title}]({conv.url(doc)}) of **Curvature Lab**, as a plain notebook for Colab and "
        f"JupyterLab: cross-references link to the book, and the book's macros are defined in this cell for your own "
        f"cells. Run the setup cell first (in Colab it installs `curvlab` from the repository at `{ref}`). Generated "
        f"by `tools/colab.py` from `notebooks/{path.name}`; do not edit it, edit the chapter.*"
    )
    cells.insert(0, {"cell_type": "markdown", "id": "colab-intro", "source": intro,
                     "metadata": {"slideshow": {"slide_type": "skip"}}})  # a RISE presentation starts at the title
    out["cells"] = cells
    meta = out.setdefault("metadata", {})
    meta["colab"] = {"name": path.name, "provenance": [], "toc_visible": True}
    meta["curvlab"] = {"generated_from": f"notebooks/{path.name}", "generator": "tools/colab.py", "ref": ref}
    out = nbtool.normalize(out)
    out["cells"][0]["id"] = "colab-intro"
    return out, conv.problems


def generate(paths: list[Path], ref: str | None = None, check: bool = False) -> int:
    config = load_config()
    ref = ref or resolve_ref(config)
    index, bib = BookIndex.build(), Bibliography()
    OUT_DIR.mkdir(exist_ok=True)
    bad = 0
    for path in paths:
        nb, problems = convert_notebook(path, ref, index=index, bib=bib, config=config)
        for p in problems:
            print(f"{path.name}: {p}", file=sys.stderr)
        text = nbtool.dumps(nb)
        target = OUT_DIR / path.name
        if check:
            if not target.exists() or target.read_text() != text:
                print(f"{target.relative_to(ROOT)} is out of date: run `make colab`", file=sys.stderr)
                bad += 1
        elif not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
        bad += bool(problems) and not check
    if not check:
        stale = {p.name for p in OUT_DIR.glob("*.ipynb")} - {p.name for p in chapters()}
        for name in sorted(stale):
            (OUT_DIR / name).unlink()
            print(f"removed {name} (no such chapter)")
    return 1 if bad else 0


def fix_setup_cells(paths: list[Path], ref: str | None = None) -> int:
    """Rewrite the install block of each chapter's setup cell, and nothing else: the file is read right before it is
    written (other cells may be under edit by someone else)."""
    config = load_config()
    ref = ref or str(config["repository"].get("branch") or "main")
    for path in paths:
        nb = json.loads(path.read_text())
        k = setup_cell_index(nb)
        new = expected_setup_source(nb, ref, config)
        if cell_source(nb["cells"][k]) == new:
            continue
        nb["cells"][k]["source"] = new
        path.write_text(nbtool.dumps(nb))  # the stored form (nbtool); other cells exactly as read
        print(f"setup cell of {path.name} rewritten")
    return 0



# ------------------------------------------------------------------------------------------------ make lab
LAB_MACROS_TAG = "curvlab-lab-macros"


def lab_dir() -> Path:
    """The workspace ``make lab`` serves: ``$CURVLAB_LAB_DIR``, else ``.curvlab_cache/lab/workspace`` (git-ignored)."""
    return Path(os.environ.get("CURVLAB_LAB_DIR") or ROOT / ".curvlab_cache" / "lab" / "workspace").resolve()


def lab_version(path: Path) -> str:
    """What the workspace holds for repository file ``path`` (notebooks/...): the file itself, a MyST chapter with a
    first cell of front matter that defines the book's macros for jupyterlab-myst."""
    text = path.read_text()
    rel = path.relative_to(ROOT)
    if path.suffix != ".ipynb" or rel.parent != Path("notebooks"):
        return text
    nb = json.loads(text)
    cell = {"cell_type": "markdown", "id": LAB_MACROS_TAG, "source": lab_frontmatter(),
            "metadata": {"tags": [LAB_MACROS_TAG], "editable": False, "deletable": False}}
    nb["cells"].insert(0, cell)
    return nbtool.dumps(nb)


def _content_digest(data: bytes, notebook: bool) -> str:
    """A file's digest; for a notebook, of its cells' types and sources only (running cells, which adds outputs,
    execution counts and metadata, is not an edit)."""
    if notebook:
        try:
            cells = json.loads(data)["cells"]
            data = json.dumps([[c.get("cell_type"), cell_source(c)] for c in cells]).encode()
        except (ValueError, KeyError, TypeError):
            pass
    return hashlib.sha256(data).hexdigest()


def sync_lab(workspace: Path | None = None) -> tuple[Path, list[str]]:
    """Copy ``notebooks/`` into the workspace; a file whose content the reader changed there since it was copied is
    kept (and listed), a notebook that was only run is refreshed. Returns (workspace, kept files)."""
    ws = workspace or lab_dir()
    ws.mkdir(parents=True, exist_ok=True)
    manifest_path = ws / ".curvlab-lab.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    kept = []
    for src in sorted(NB_DIR.rglob("*")):
        rel = src.relative_to(ROOT)
        if not src.is_file() or ".ipynb_checkpoints" in rel.parts or "__pycache__" in rel.parts:
            continue
        new = lab_version(src) if src.suffix == ".ipynb" else None
        dest = ws / rel
        is_nb = src.suffix == ".ipynb"
        digest = _content_digest(new.encode() if new is not None else src.read_bytes(), is_nb)
        if dest.exists():
            have = _content_digest(dest.read_bytes(), is_nb)
            if have == digest:
                manifest[str(rel)] = digest
                continue
            if manifest.get(str(rel)) not in (None, have):
                kept.append(str(rel))  # the reader's own edits: never overwritten
                continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        if new is not None:
            dest.write_text(new)
        else:
            shutil.copyfile(src, dest)
        manifest[str(rel)] = digest
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return ws, kept


def lab_command(port: int, token: str, root_dir: Path | None = None) -> list[str]:
    """JupyterLab on 127.0.0.1 over the workspace, opening the clean copies; ``--allow-root`` where the user is root."""
    cmd = [sys.executable, "-m", "jupyter", "lab", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.root_dir={root_dir or lab_dir()}", f"--IdentityProvider.token={token}",
           "--LabApp.default_url=/lab/tree/notebooks/colab"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")
    return cmd


def launch_lab(port: int | None = None) -> int:
    import secrets
    import socket

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    token = secrets.token_hex(16)
    ws, kept = sync_lab()
    print(f"JupyterLab (with jupyterlab-myst) over a workspace copy of notebooks/: {ws}\n"
          "Edits and saves stay there; the repository is never written. notebooks/colab/ holds the chapters as they "
          "read in Colab; notebooks/ the MyST sources, with the book's macros; notebooks/student/ the exercises.")
    if kept:
        print(f"Kept your edited copies of {len(kept)} file(s) (delete them in the workspace to get the repository's): "
              + ", ".join(kept))
    print(f"Open  http://127.0.0.1:{port}/lab/tree/notebooks/colab?token={token}\n", flush=True)
    os.execv(sys.executable, lab_command(port, token, ws))
    return 0  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chapters", nargs="*", help="chapter stems or files (default: every chapter)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a stored copy is out of date")
    ap.add_argument("--ref", help="git ref the copies install curvlab from (default: tools/colab.py resolve_ref)")
    ap.add_argument("--fix-setup-cells", action="store_true", help="rewrite the chapters' setup-cell install block")
    ap.add_argument("--print-ref", action="store_true")
    ap.add_argument("--lab", action="store_true", help="start JupyterLab on 127.0.0.1 and print its URL")
    ap.add_argument("--port", type=int, help="JupyterLab's port (default: a free one)")
    args = ap.parse_args(argv)
    if args.lab:
        return launch_lab(args.port)
    if args.print_ref:
        print(args.ref or resolve_ref())
        return 0
    paths = chapters()
    if args.chapters:
        want = {Path(c).stem for c in args.chapters}
        paths = [p for p in paths if p.stem in want]
    if args.fix_setup_cells:
        return fix_setup_cells(paths, args.ref)
    return generate(paths, args.ref, check=args.check)


# ------------------------------------------------------------------------------------------------ what a copy may hold
def leftovers(nb: dict[str, Any]) -> list[str]:
    """MyST syntax, HTML boxes and book macros left unexpanded in a copy's Markdown (code excluded)."""
    defined = set(load_macros())
    found = []
    for k, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        src = cell_source(cell)
        found += [f"cell {k}: {x}" for x in myst_export.leftovers(src)]
        if k == 0:
            continue  # the definitions themselves
        for _display, tex in myst_export.formulas(src):
            for cmd in sorted(set(re.findall(r"\\([A-Za-z]+)", tex)) & defined):
                found.append(f"cell {k}: \\{cmd} (a book macro left unexpanded) in ${tex.strip()[:50]}$")
    return found


if __name__ == "__main__":
    sys.exit(main())
