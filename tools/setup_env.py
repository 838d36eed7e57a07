"""Install what the book needs into the running interpreter (the Makefile's ./.venv), never replacing torch.

* torch: if it imports already (a CUDA build, Colab, a conda env seen through --system-site-packages) it is kept
  as it is. Otherwise ``--torch-pin`` is installed (default ``torch==2.13.0``, the CPU wheel this project's
  machines carry); set ``CURVLAB_TORCH_INDEX`` to an index URL to take it from elsewhere (e.g. PyTorch's CPU index).
* ``lib/`` is installed in editable mode with the extras in ``EXTRAS`` (``book``, ``lab``, ``test``, ``cluster``). Its torch requirement is a
  range, and the install runs under a constraint ``torch==<the version found above>``, so that a dependency that
  pins torch itself (BackPACK's torchvision, in the ``test`` extra) gets the release built for that torch instead of
  replacing it (with a CUDA build, by default, from PyPI). A torchvision brought in this way that cannot be imported
  (PyPI's build next to a local torch build such as ``+cpu``) is uninstalled again: BackPACK does not import it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
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
    version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], check=True,
                             capture_output=True, text=True).stdout.strip()
    had_torchvision = importlib.util.find_spec("torchvision") is not None
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "keep-torch.txt"
        constraints.write_text(f"torch=={version}\n")
        pip("-c", str(constraints), "-e", f"{ROOT / 'lib'}[{','.join(EXTRAS)}]")
    # BackPACK (via the test extra) requires torchvision but never imports it outside its examples. PyPI's torchvision
    # is compiled for PyPI's torch, so next to a local build such as 2.13.0+cpu it fails to import; remove a
    # torchvision this run brought in if it cannot be imported, rather than leave a broken package behind.
    if not had_torchvision and subprocess.run([sys.executable, "-c", "import torchvision"],
                                              capture_output=True).returncode != 0:
        print(f"torchvision does not load with torch {version}; nothing here imports it: uninstalling it", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "torchvision"], check=True)


if __name__ == "__main__":
    main()
