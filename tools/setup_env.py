"""Install what the book needs into the running interpreter (the Makefile's ./.venv), never replacing torch.

* torch: if it imports already (a CUDA build, Colab, a conda env seen through --system-site-packages) it is kept
  as it is. Otherwise ``--torch-pin`` is installed (default ``torch==2.13.0``, the CPU wheel this project's
  machines carry); set ``CURVLAB_TORCH_INDEX`` to an index URL to take it from elsewhere (e.g. PyTorch's CPU index).
* ``lib/`` is installed in editable mode with the extras in ``EXTRAS`` (``book``, ``lab``, ``test``, ``cluster``). Its torch requirement is a
  range, so pip leaves the torch found above alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The extras of lib/pyproject.toml that `make` installs (environment.yml lists the same; a test checks it).
EXTRAS = ("book", "lab", "test", "cluster")


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--torch-pin", default="torch==2.13.0")
    args = parser.parse_args()
    if importlib.util.find_spec("torch") is None:
        extra = ["--index-url", os.environ["CURVLAB_TORCH_INDEX"]] if os.environ.get("CURVLAB_TORCH_INDEX") else []
        pip("--only-binary=:all:", *extra, args.torch_pin)
    else:
        import torch

        print(f"keeping the installed torch {torch.__version__}", flush=True)
    pip("-e", f"{ROOT / 'lib'}[{','.join(EXTRAS)}]")


if __name__ == "__main__":
    main()
