"""curvlab — the companion library of *Curvature Lab*.

One module per subject the book teaches, plus shared tools:

``config``      profiles (``CURVLAB_PROFILE``), device, dtype, seeds
``checks``      derived predictions (asserted, computed tolerances) and paper claims (ledgered)
``curvature``   Jacobians, Gauss–Newton matrices and products, condition numbers, damped GN steps
``linalg``      row-major vec/Kronecker conventions, PSD roots, principal angles
``plotting``    the method registry, theme, figures with alt text and captions
``sweep``       cached, code-aware parameter sweeps into tidy frames
``progress``    progress bars that stay out of the static book
``deep_linear`` deep linear / residual / leaky-ReLU networks: the GN matrix three ways, bounds, rank, pruning
``meanfield``   Part II: mean-field network, kernel-form GN/GD, metrics, teacher-student / digits / MNIST data
``precond``     the preconditioner zoo: NGD, K-FAC (Tikhonov/factored damping), Shampoo, Adam, Muon, SOAP
``primer``      toy least-squares problems, Hessian = GN + residual part, Fisher vs empirical Fisher, K-FAC blocks
``regimes``     NTK / mean-field / µP scalings of two-layer networks, lazy vs rich training
``rmt``         Marchenko–Pastur law, ridge deterministic equivalent, spikes (BBP), Grassmann geodesics
``linrep``      Part I: linear representation learning — data, K-FAC/AMGD/DFW updates, subspace metrics, Schur curvature
``linrep_baselines`` Part I baselines: NGD (structured), Adam, Shampoo, whitening / batch-norm + AMGD
``singleindex`` Part I: one giant step in single-index models — spikes, deterministic-equivalent cosines, risk
``synthesis``   K-FAC as structured GN (eigenvalues {1, 2}), Kronecker error, probes of open questions
``interact``    sliders in a live kernel, small multiples in the static book
``conv``        Part III: two-layer linear CNN — Toeplitz form of the convolution, reduced GN matrix, κ bound
``resnet``      Part III at paper size: ResNet-20, the CIFAR-10 python batches, pruned κ(GN) via a chunked Jacobian Gram
``paper_runs``  registry of paper-scale grids run outside the book build (``make sweeps``)
``data``        bounded, checked readers of external data files (MNIST's IDX files; size caps, official checksums)
``model``       any ``torch.nn.Module`` (MSE, cross-entropy incl. per-token, BCE): GN/GGN products, κ with its rank
                cut and gap, K-FAC blocks, a kernel-form GN step; operators in curvlinops' interface (and curvlinops'
                operators accepted where curvlab computes κ, K-FAC distances or a damped step)

Call :func:`setup` once at the top of a notebook.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("config", "checks", "curvature", "linalg", "plotting", "sweep", "progress", "deep_linear", "meanfield", "precond", "primer", "regimes", "rmt", "linrep", "linrep_baselines", "singleindex", "synthesis", "interact", "paper_runs", "model", "conv", "resnet", "data")
__all__ = ["setup", "installed_revision", "__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'curvlab' has no attribute {name!r}")


def setup(chapter: str, *, seed: int = 0, deterministic: bool = True, context: str = "notebook", quiet: bool = False):
    """Prepare a chapter: profile, device, dtype, seed, determinism, plotting theme, check registry.

    Prints one line — profile, device, dtype, seed, versions, git revision, CPU threads — and, in a notebook,
    shows the profile badge. On the CPU it sets torch's thread count by :func:`curvlab.config.thread_policy` (one
    thread on a machine with two cores or fewer, unless ``CURVLAB_THREADS`` or ``OMP_NUM_THREADS`` says otherwise)
    and prints how to change it. Returns the :class:`curvlab.config.RunInfo`.
    """
    import torch

    from . import checks, config, plotting

    if not isinstance(chapter, str) or not chapter.strip():
        raise ValueError("chapter must be a non-empty string naming the notebook (e.g. '00_how_to_read')")
    prof = config.profile()
    dev = config.device()
    config.seed_everything(seed)
    config.set_deterministic(deterministic)
    plotting.set_theme(context)
    plotting.reset_figure_counter()
    checks.set_chapter(chapter)
    threads, threads_reason = config.apply_thread_policy() if dev.type == "cpu" else (None, "")
    info = config.RunInfo(
        chapter=chapter,
        profile=prof,
        device=dev,
        dtype=torch.get_default_dtype(),
        seed=seed,
        torch_version=torch.__version__,
        curvlab_version=__version__,
        revision=installed_revision(),
        threads=threads,
        threads_reason=threads_reason,
    )
    if not quiet:
        print(info.line())
        if info.threads_line():
            print(info.threads_line())
        _show_badge(info)
    return info


def installed_revision() -> str:
    """The revision of the curvlab code this kernel runs, as :func:`setup` prints it.

    A copy pip installed from git (Colab's setup cell: ``curvlab @ git+<repo>@<ref>#subdirectory=lib``) has no
    ``.git``; pip records the commit it built in the distribution's ``direct_url.json`` (PEP 610), and that commit is
    returned, with the ref asked for (``'1a2b3c4 (main, installed)'``). The record is read only when that
    distribution's ``curvlab/__init__.py`` is the file this kernel imported: a clone's ``lib/`` put ahead of an
    installed copy on ``sys.path`` is not the installed commit. Otherwise (an editable install in a clone, or a copy
    on ``sys.path``) it is :func:`curvlab.config.git_revision` of the package's folder, ``'unknown'`` where neither
    says.
    """
    import json
    import re
    from importlib import metadata
    from pathlib import Path

    from . import config

    try:
        dist = metadata.distribution("curvlab")
        located = Path(dist.locate_file("curvlab/__init__.py")).resolve()
        text = dist.read_text("direct_url.json") if located == Path(__file__).resolve() else None
    except (metadata.PackageNotFoundError, OSError, TypeError, ValueError):
        text = None
    if text:
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        vcs = record.get("vcs_info") if isinstance(record, dict) else None
        commit = vcs.get("commit_id") if isinstance(vcs, dict) else None
        if isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit):
            ref = vcs.get("requested_revision")
            ref = ref if isinstance(ref, str) and re.fullmatch(r"[\w./-]{1,100}", ref) else None
            return f"{commit[:7]} ({ref + ', ' if ref and not commit.startswith(ref) else ''}installed)"
    return config.git_revision()


def _show_badge(info: Any) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:  # pragma: no cover
        return
    if get_ipython() is None:
        return
    colour = {"quick": "#D55E00", "standard": "#0072B2", "paper": "#009E73"}[info.profile]
    display(
        HTML(
            f'<span class="curvlab-profile-badge" style="background:{colour};color:white;padding:2px 8px;'
            f'border-radius:4px;font-size:0.85em">profile: {info.profile}</span> '
            f'<span class="curvlab-device-badge" style="font-size:0.85em">device: {info.device}</span>'
        )
    )
