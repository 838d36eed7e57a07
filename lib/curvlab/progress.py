"""Progress bars that know where they run.

Long loops in the book show a :mod:`tqdm.auto` bar (a widget in Jupyter, text in a terminal). The static book
must not contain live widgets, so while the book is being built (:func:`curvlab.config.in_book_build`), or when
``CURVLAB_PROGRESS=0``, :func:`progress` hands back the plain iterable instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from curvlab.config import in_book_build

__all__ = ["PROGRESS_ENV", "progress_enabled", "progress"]

PROGRESS_ENV = "CURVLAB_PROGRESS"


def progress_enabled() -> bool:
    """True unless the book is being built or ``CURVLAB_PROGRESS`` is ``0``/``false``."""
    if in_book_build():
        return False
    return os.environ.get(PROGRESS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def progress(iterable: Iterable, total: int | None = None, desc: str | None = None, **tqdm_kwargs: Any) -> Iterable:
    """Wrap ``iterable`` in a :mod:`tqdm.auto` bar, or return it unchanged when bars are off.

    Parameters
    ----------
    iterable
        What to iterate over.
    total
        Number of items, for iterables without a length (generators).
    desc
        Label shown left of the bar.
    **tqdm_kwargs
        Passed to :class:`tqdm.auto.tqdm` (for instance ``initial=`` or ``leave=``).

    Returns
    -------
    Iterable
        A ``tqdm`` bar over ``iterable``, or ``iterable`` itself during a book build or with
        ``CURVLAB_PROGRESS=0`` (see :func:`progress_enabled`).
    """
    if not isinstance(iterable, Iterable) or (hasattr(iterable, "dim") and callable(iterable.dim)
                                              and iterable.dim() == 0):
        raise TypeError(f"iterable must be iterable, got {type(iterable).__name__}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise TypeError(f"total must be a non-negative integer or None, got {total!r}")
    if desc is not None and not isinstance(desc, str):
        raise TypeError(f"desc must be a string or None, got {type(desc).__name__}")
    if not progress_enabled():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, **tqdm_kwargs)
