"""Compute profiles, devices, dtypes and seeds: one place for every run-time choice.

One environment variable, ``CURVLAB_PROFILE``, selects how big every experiment in the book is:

``quick``
    what CI builds: the whole book in minutes on two CPU cores;
``standard`` (default)
    a laptop: each notebook in a couple of minutes, every figure qualitatively right;
``paper``
    the papers' own sizes; a GPU is recommended.

Sizes are never edited by hand before a build: chapters call :func:`pick` with one value per profile.

Devices: CUDA, then Apple's MPS, then the CPU, unless ``CURVLAB_DEVICE`` names one. Spectral work
(eigenvalues, condition numbers, Gram matrices) runs in float64, which MPS does not have: :func:`spectral`
routes such work to the CPU there (see :func:`spectral_device`).
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "PROFILES",
    "profile",
    "pick",
    "device",
    "spectral_dtype",
    "spectral_device",
    "spectral",
    "seed_everything",
    "set_deterministic",
    "in_book_build",
    "cpu_threads",
    "thread_policy",
    "apply_thread_policy",
    "git_revision",
    "RunInfo",
]

PROFILES = ("quick", "standard", "paper")
PROFILE_ENV = "CURVLAB_PROFILE"
DEVICE_ENV = "CURVLAB_DEVICE"
BUILD_ENV = "CURVLAB_BOOK_BUILD"
THREADS_ENV = "CURVLAB_THREADS"


def profile() -> str:
    """The active compute profile, from ``CURVLAB_PROFILE`` (default ``standard``)."""
    value = os.environ.get(PROFILE_ENV, "standard").strip().lower() or "standard"
    if value not in PROFILES:
        raise ValueError(f"{PROFILE_ENV} must be one of {list(PROFILES)}, got {value!r}")
    return value


def pick(quick: Any, standard: Any, paper: Any | None = None, *, profile_name: str | None = None) -> Any:
    """Return the value for the active profile.

    ``paper`` defaults to ``standard`` when a size does not change at paper scale.

    >>> pick(quick=100, standard=1000, paper=10000, profile_name="quick")
    100
    """
    name = profile() if profile_name is None else profile_name
    if name not in PROFILES:
        raise ValueError(f"profile_name must be one of {list(PROFILES)}, got {name!r}")
    return {"quick": quick, "standard": standard, "paper": standard if paper is None else paper}[name]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def device(name: str | None = None) -> torch.device:
    """The compute device: ``name``, else ``CURVLAB_DEVICE``, else CUDA, MPS or CPU in that order."""
    requested = name if name is not None else os.environ.get(DEVICE_ENV)
    if requested:
        if not isinstance(requested, str):
            raise TypeError(f"name must be a device string such as 'cpu' or 'cuda', got {type(requested).__name__}")
        try:
            dev = torch.device(requested)
        except RuntimeError as exc:
            raise ValueError(f"name (or {DEVICE_ENV}) is not a valid torch device: {requested!r}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} was requested but CUDA is not available")
        if dev.type == "mps" and not _mps_available():
            raise ValueError(f"device {requested!r} was requested but MPS is not available")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _as_device(dev: torch.device | str | None) -> torch.device:
    if dev is None:
        return device()
    if isinstance(dev, str):
        return torch.device(dev)
    if not isinstance(dev, torch.device):
        raise TypeError(f"dev must be a torch.device or a string, got {type(dev).__name__}")
    return dev


def spectral_dtype(dev: torch.device | str | None = None) -> torch.dtype:
    """The dtype for spectral work: always float64 (run on :func:`spectral_device`)."""
    _as_device(dev)
    return torch.float64


def spectral_device(dev: torch.device | str | None = None) -> torch.device:
    """Where float64 spectral work runs: ``dev`` itself, except on MPS (no float64), where it is the CPU."""
    d = _as_device(dev)
    return torch.device("cpu") if d.type == "mps" else d


def spectral(t: torch.Tensor) -> torch.Tensor:
    """``t`` converted for spectral work: float64, moved to the CPU if it lives on MPS."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    return t.to(device=spectral_device(t.device), dtype=torch.float64)


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch (all devices); return a CPU :class:`torch.Generator` seeded the same."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def set_deterministic(enabled: bool = True) -> None:
    """Ask torch for deterministic kernels where they exist (cuBLAS workspace, cuDNN)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    if hasattr(torch.backends, "cudnn"):
        torch.backends.cudnn.deterministic = enabled
        torch.backends.cudnn.benchmark = not enabled


def in_book_build() -> bool:
    """True while the book is being built (set by the book's Sphinx extension): no live widgets then."""
    return os.environ.get(BUILD_ENV, "") not in ("", "0", "false", "False")


def git_revision(path: str | Path | None = None) -> str:
    """The short git revision of the checkout holding ``path`` (``'unknown'`` outside git), '+dirty' if modified."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
        )
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=where, capture_output=True, text=True, timeout=5
        )
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cores_available() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_policy(cores: int | None = None, environ: dict[str, str] | None = None) -> tuple[int | None, str]:
    """The number of torch CPU threads a chapter should use, and why: ``(n, reason)``; ``n`` is ``None`` when the
    user has chosen (``OMP_NUM_THREADS`` set and no ``CURVLAB_THREADS``): torch has already taken that setting.

    ``CURVLAB_THREADS=n`` wins. Otherwise, with ``OMP_NUM_THREADS`` unset, the default is one thread on a machine
    with at most two cores available and ``min(4, cores // 2)`` above that. The book's tensors are small (a few
    hundred to a few thousand rows): on two cores, torch's default of one thread per core lost to one thread by a
    large factor whenever anything else ran (the performance page's thread-policy table); above two cores the rule
    is reasoned, not measured: leave half the cores to the other kernel of a two-job book build and to the system.
    """
    env = os.environ if environ is None else environ
    cores = _cores_available() if cores is None else int(cores)
    raw = env.get(THREADS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {raw!r}") from None
        if n < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {raw!r}")
        return n, f"{THREADS_ENV}={n}"
    if env.get("OMP_NUM_THREADS", "").strip():
        return None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS'].strip()} (set by you or the book build)"
    n = 1 if cores <= 2 else min(4, cores // 2)
    return n, f"curvlab's default for {cores} core{'s' if cores != 1 else ''}"


def apply_thread_policy(cores: int | None = None) -> tuple[int, str]:
    """Set torch's intra-op threads by :func:`thread_policy`; return ``(threads now, reason)``."""
    n, why = thread_policy(cores)
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads(), why


@dataclass(frozen=True)
class RunInfo:
    """What :func:`curvlab.setup` decided, printed as one line at the top of every chapter."""

    chapter: str
    profile: str
    device: torch.device
    dtype: torch.dtype
    seed: int
    torch_version: str
    curvlab_version: str
    revision: str
    threads: int | None = None
    threads_reason: str = ""

    def line(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        threads = "" if self.threads is None else f" | threads={self.threads}"
        return (
            f"curvlab {self.curvlab_version} | profile={self.profile} | device={self.device} | dtype={dt} "
            f"(spectral: float64 on {spectral_device(self.device)}) | seed={self.seed} | torch {self.torch_version} "
            f"| rev {self.revision}{threads}"
        )

    def threads_line(self) -> str:
        """How many CPU threads torch uses, why, and how to change it (printed by :func:`curvlab.setup`)."""
        if self.threads is None:
            return ""
        return (f"CPU threads: {self.threads} ({self.threads_reason}); to change it, set CURVLAB_THREADS=n "
                "(or OMP_NUM_THREADS=n) before starting Python, or call torch.set_num_threads(n)")


@contextlib.contextmanager
def cpu_threads(n: int, *, when: bool = True, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads on the CPU, then restore the setting.

    Small per-step tensors and batched CPU eigen-solvers lose more to OpenMP start-up and oversubscription than
    they gain from threads, badly so when cores are shared. Nothing changes when ``when`` is false, when
    ``device`` is not the CPU, or when the setting is already ``n``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not when or (device is not None and torch.device(device).type != "cpu") or torch.get_num_threads() == n:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
