"""Interactive exploration: sliders in a live notebook, small multiples in the built book.

Some lessons are the effect of one parameter — the anisotropy :math:`\\kappa(\\Sigma)`, the step size, the damping
:math:`\\lambda_{\\mathrm{GN}}`, the width :math:`m`. :func:`explore` shows such a parameter two ways from one
drawing function:

* in a live kernel (JupyterLab, Colab), as ipywidgets sliders that redraw the figure;
* while the book is built (:func:`curvlab.config.in_book_build`), or without a kernel or ipywidgets, as a static
  row of **small multiples**, one panel per value of the parameter that carries the lesson, shown through
  :func:`curvlab.plotting.show` with its alt text and caption — so the static page carries no dead widget.

.. code-block:: python

    def draw(ax, kappa, eta):
        ...  # draw one panel for these parameter values

    explore(draw, kappa=[1, 10, 100], eta=[0.1, 0.5, 1.0], static="kappa",
            alt="Three panels ...", caption="As the anisotropy grows ...")
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from curvlab.config import in_book_build

__all__ = ["explore", "live_available"]


def live_available() -> bool:
    """True when widgets can be shown: not in a book build, inside an IPython kernel, with ipywidgets installed.

    In a kernel without ipywidgets it warns (once), naming the extra that installs them, and the figures are static."""
    if in_book_build():
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return False
    if importlib.util.find_spec("ipywidgets") is None:
        warnings.warn('sliders need ipywidgets, which is not installed: pip install "curvlab[notebooks]" (the book\'s '
                      'extra "curvlab[book]" includes it); showing the static figure instead', UserWarning, stacklevel=3)
        return False
    return True


def _values(name: str, values: Any) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not hasattr(values, "tolist"):
        raise TypeError(f"{name} must be a sequence of values (a list, tuple or 1-D array), got {type(values).__name__}")
    vals = list(values.tolist() if hasattr(values, "tolist") else values)
    if not vals:
        raise ValueError(f"{name} must hold at least one value")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (numbers.Number, str)):
            raise TypeError(f"{name} must hold numbers or strings, got {type(v).__name__}")
        if isinstance(v, numbers.Real) and not math.isfinite(v):
            raise ValueError(f"{name} must hold finite values, got {v}")
    return vals


def _label(v: Any) -> str:
    return f"{v:g}" if isinstance(v, numbers.Real) else str(v)


def explore(
    fn: Callable[..., Any],
    *,
    alt: str,
    caption: str,
    static: str | None = None,
    defaults: dict[str, Any] | None = None,
    mode: str = "auto",
    panel_size: tuple[float, float] = (3.6, 3.0),
    max_cols: int = 4,
    **sliders: Sequence[Any],
) -> Any:
    """Explore ``fn(ax, **params)`` over the values of its parameters.

    Parameters
    ----------
    fn
        Draws one panel: ``fn(ax, **params)`` with one value for each slider.
    alt, caption
        Alt text and caption of the static figure (required, as for every figure of the book).
    static
        The parameter whose values become the panels of the static figure (default: the first slider).
    defaults
        Starting values; by default the middle value of each slider.
    mode
        ``"auto"`` (sliders when :func:`live_available`, else the static figure), ``"live"`` or ``"static"``.
    panel_size
        Width and height of one static panel, in inches.
    max_cols
        Panels per row of the static figure.
    **sliders
        One sequence of values per parameter.

    Returns
    -------
    ``ipywidgets.VBox`` or curvlab.plotting.Figure
        The controls and the live figure, or the static small multiples.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not sliders:
        raise ValueError("explore needs at least one slider, e.g. explore(draw, ..., kappa=[1, 10, 100])")
    if mode not in ("auto", "live", "static"):
        raise ValueError(f"mode must be 'auto', 'live' or 'static', got {mode!r}")
    for name, text, least in (("alt", alt, 20), ("caption", caption, 10)):
        if not isinstance(text, str) or len(text.strip()) < least:
            raise ValueError(f"{name} must be a sentence of at least {least} characters (the static figure needs it)")
    if not isinstance(max_cols, int) or max_cols < 1:
        raise ValueError(f"max_cols must be a positive integer, got {max_cols!r}")
    values = {name: _values(name, v) for name, v in sliders.items()}
    static = static if static is not None else next(iter(values))
    if static not in values:
        raise ValueError(f"static must name one of the sliders {sorted(values)}, got {static!r}")
    start = {name: vals[(len(vals) - 1) // 2] for name, vals in values.items()}
    for name, v in (defaults or {}).items():
        if name not in values:
            raise ValueError(f"defaults names {name!r}, which is not a slider ({sorted(values)})")
        if v not in values[name]:
            raise ValueError(f"defaults[{name!r}] = {v!r} is not one of the slider's values {values[name]}")
        start[name] = v
    live = live_available() if mode == "auto" else mode == "live"
    return _live(fn, values, start, panel_size) if live else _static(fn, values, start, static, alt, caption, panel_size, max_cols)


def _static(fn, values, start, static, alt, caption, panel_size, max_cols):
    import matplotlib.pyplot as plt

    from curvlab import plotting

    panels = values[static]
    ncols = min(max_cols, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False,
                             layout="constrained")
    for ax, v in zip(axes.flat, panels):
        fn(ax, **{**start, static: v})
        ax.set_title(f"{static} = {_label(v)}")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    return plotting.show(fig, alt=alt, caption=caption)


def _live(fn, values, start, panel_size):
    from curvlab._validate import _require

    widgets = _require("ipywidgets", purpose="sliders (curvlab.interact.explore with mode='live')")
    import matplotlib.pyplot as plt
    from IPython.display import display

    controls = {
        name: widgets.SelectionSlider(
            options=[(_label(v), v) for v in vals], value=start[name], description=name, continuous_update=False
        )
        for name, vals in values.items()
    }

    def redraw(**params: Any) -> None:
        fig, ax = plt.subplots(figsize=(panel_size[0] * 1.5, panel_size[1] * 1.5))
        fn(ax, **params)
        display(fig)
        plt.close(fig)

    out = widgets.interactive_output(redraw, controls)
    # returned, not displayed: as a cell's last expression the box shows once (displaying it too showed it twice)
    return widgets.VBox([widgets.HBox(list(controls.values())), out])
