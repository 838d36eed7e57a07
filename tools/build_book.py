"""Build the book: execute the notebooks in parallel into the execution cache, then run Sphinx on them.

    python tools/build_book.py [--jobs N] [--strict] [--force]

1. ``jupyter-book config sphinx .`` turns ``_config.yml`` into ``conf.py`` (not committed: ``_config.yml`` stays
   the one source of configuration).
2. Every notebook in ``_toc.yml`` whose outputs are not in the execution cache runs, ``--jobs`` at a time, in the
   environment the book's extension defines (profile, ledger directory, ``CURVLAB_BOOK_BUILD=1``). Successes are
   stored in the cache that myst-nb reads — the cache directory is keyed on the library's source and the profile
   (``book/_ext/curvlab_book.py``), so a library change re-executes everything. ``--force`` empties that cache
   first, so every notebook runs.
3. ``sphinx-build`` renders the book from the cache. A notebook that failed in step 2 is executed once more by
   myst-nb, which reports the failing cell; ``--strict`` (``-W -n --keep-going``) turns that, and any other
   warning, into a failed build.

Sphinx itself reads serially: sphinx-proof keeps its labels outside Sphinx's parallel-merge protocol, so the
parallelism lives in step 2, where the time goes. The profile comes from ``CURVLAB_PROFILE`` (default ``standard``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import curvlab_book  # noqa: E402  (the book's extension: cache key, ledger and execution-record locations)


def generate_conf() -> None:
    jb = Path(sys.executable).parent / "jupyter-book"
    subprocess.run([str(jb), "config", "sphinx", str(ROOT)], check=True, stdout=subprocess.DEVNULL)
    conf = ROOT / "conf.py"
    prelude = "import os, sys\nsys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'book', '_ext'))\n"
    conf.write_text(prelude + conf.read_text())


def toc_notebooks() -> list[Path]:
    """Notebooks listed in ``_toc.yml``, in order."""
    found: list[Path] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            f = node.get("file") or node.get("root")
            if isinstance(f, str) and (ROOT / f"{f}.ipynb").exists():
                found.append(ROOT / f"{f}.ipynb")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    return found


def execute(path: str, timeout: int) -> tuple[str, str | None, float, str | None]:
    """Run one notebook in its own directory; return (path, executed notebook JSON or None, seconds, error)."""
    from jupyter_cache.executors.utils import single_nb_execution

    nb = nbformat.read(path, as_version=4)
    result = single_nb_execution(nb, cwd=str(Path(path).parent), timeout=timeout, allow_errors=False, meta_override=True)
    if result.err is not None:
        return path, None, result.time, f"{type(result.err).__name__}: {result.err}"
    return path, nbformat.writes(nb), result.time, None


def pre_execute(jobs: int, force: bool, timeout: int) -> dict[str, dict]:
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache_dir = Path(os.environ["CURVLAB_EXECUTION_CACHE"])
    if force:
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(os.environ["CURVLAB_LEDGER_DIR"], ignore_errors=True)
    cache = get_cache(str(cache_dir))
    todo, record = [], {}
    for nb_path in toc_notebooks():
        rel = str(nb_path.relative_to(ROOT).with_suffix(""))
        try:
            cache.match_cache_notebook(nbformat.read(nb_path, as_version=4))
            record[rel] = {"executed": False, "runtime": None, "error": None}
        except KeyError:
            todo.append(nb_path)
    if todo:
        print(f"executing {len(todo)} notebook(s), {jobs} at a time", flush=True)
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(execute, str(p), timeout) for p in todo]
        for fut in as_completed(futures):
            path, text, seconds, err = fut.result()
            rel = str(Path(path).relative_to(ROOT).with_suffix(""))
            record[rel] = {"executed": True, "runtime": seconds, "error": err}
            if err is None:
                stage = cache.add_nb_to_project(path)
                cache.cache_notebook_bundle(
                    CacheBundleIn(nbformat.reads(text, as_version=4), stage.uri, data={"execution_seconds": seconds}),
                    check_validity=False,
                    overwrite=True,
                )
                print(f"  executed {rel} in {seconds:.1f} s", flush=True)
            else:
                print(f"  FAILED {rel} after {seconds:.1f} s: {err}", flush=True)
    out = curvlab_book.execution_record_path(os.environ["CURVLAB_PROFILE"], os.environ["CURVLAB_KEY"])
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() and not force else {}
    for rel, rec in record.items():
        if not rec["executed"] and rel in previous:
            rec.update(runtime=previous[rel].get("runtime"), executed_at=previous[rel].get("executed_at"))
        elif rec["executed"]:
            rec["executed_at"] = time.time()
    out.write_text(json.dumps(record, indent=1))
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--builder", default="html")
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args()
    t0 = time.time()
    generate_conf()
    os.environ.update(curvlab_book.build_environment(os.environ.get("CURVLAB_PROFILE", "standard")))
    # Kernels run --jobs at a time: give each its share of the cores, so BLAS threads do not oversubscribe them.
    threads = str(max(1, (os.cpu_count() or 1) // max(1, args.jobs)))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    profile = os.environ["CURVLAB_PROFILE"]
    record = pre_execute(args.jobs, args.force, args.timeout)
    t1 = time.time()
    out = ROOT / "_build" / args.builder
    cmd = [sys.executable, "-m", "sphinx", "-b", args.builder, "-d", str(ROOT / "_build" / ".doctrees")]
    if args.strict:
        cmd += ["-W", "-n", "--keep-going"]
    if args.force:
        cmd += ["-E"]
    cmd += [str(ROOT), str(out)]
    print("+ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    failed = [k for k, v in record.items() if v["error"]]
    print(
        f"book build ({profile}): notebooks {t1 - t0:.0f} s, sphinx {time.time() - t1:.0f} s, exit code {rc}"
        + (f"; failed notebooks: {failed}" if failed else "")
        + f"; open {out / 'index.html'}",
        flush=True,
    )
    return rc or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
