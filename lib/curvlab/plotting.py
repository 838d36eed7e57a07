"""Plotting: one registered look per method, opaque figures, alt text and captions on every figure.

**The method registry.** Every method name drawn anywhere in the book (SGD/AMGD, K-FAC, DFW, NGD, Adam,
Shampoo, whitening and batch-norm variants, GD, GN, RF, theory curves, bounds, ...) has one colour, one line style
and one marker, so a method looks the same in every chapter and figures stay readable in grey and for
colour-blind readers (colours from the Okabe–Ito palette; no two methods share colour *and* line style *and*
marker). Drawing an unregistered name raises :class:`ValueError`: add it to :data:`METHODS` here, once.

**Figures.** :func:`set_theme` gives opaque white backgrounds (the book's theme has a dark mode, where a
transparent figure would show black axes on black), and a larger ``projector`` context for slides. :func:`show`
displays a figure with its alt text and caption — both required — and numbers it within the chapter.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

__all__ = [
    "MethodStyle",
    "METHODS",
    "style",
    "plot",
    "band",
    "seaborn_kwargs",
    "set_theme",
    "show",
    "Figure",
    "reset_figure_counter",
    "legend_methods",
]

# Okabe & Ito (2008) colour-blind-safe palette.
_OI = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
    "grey": "#7F7F7F",
}


@dataclass(frozen=True)
class MethodStyle:
    """How a method is drawn: colour, line style, marker, and its label in legends."""

    label: str
    color: str
    linestyle: Any
    marker: str
    family: str

    def kwargs(self) -> dict[str, Any]:
        return {"color": self.color, "linestyle": self.linestyle, "marker": self.marker, "label": self.label}


def _m(label: str, color: str, linestyle: Any, marker: str, family: str) -> MethodStyle:
    return MethodStyle(label, _OI[color], linestyle, marker, family)


#: The registry. Keys are the names used in code and data frames; ``label`` is what legends show.
METHODS: dict[str, MethodStyle] = {
    # Part I — layer-wise preconditioning
    "SGD": _m("SGD", "vermillion", "-", "o", "first-order"),
    "AMGD": _m("AMGD", "vermillion", "-", "o", "first-order"),
    "K-FAC": _m("K-FAC", "blue", "-", "s", "layer-wise"),
    "DFW": _m("DFW", "green", "--", "^", "layer-wise"),
    "NGD": _m("NGD (full GN)", "purple", "-.", "D", "second-order"),
    "Adam": _m("Adam", "orange", ":", "v", "diagonal"),
    "Shampoo": _m("Shampoo", "sky", "--", "P", "layer-wise"),
    "Muon": _m("Muon", "sky", "-.", "X", "layer-wise"),
    "SOAP": _m("SOAP", "green", ":", "h", "layer-wise"),
    "whitening+AMGD": _m("whitening + AMGD", "yellow", "-", "<", "normalisation"),
    "batchnorm+AMGD": _m("batch-norm + AMGD", "orange", "--", ">", "normalisation"),
    "OLS": _m("OLS", "grey", "--", "*", "estimator"),
    "ridge": _m("ridge", "grey", "-.", "p", "estimator"),
    # Part II — Gauss-Newton in the mean-field regime
    "GD": _m("GD", "vermillion", "-", "o", "first-order"),
    "GN": _m("GN", "blue", "--", "D", "second-order"),
    "RF": _m("random features", "grey", ":", "x", "baseline"),
    "Newton": _m("Newton", "black", "--", "d", "second-order"),
    "LM": _m("damped GN (LM)", "green", "-", "^", "second-order"),
    "GN+line-search": _m("GN + line search", "sky", "--", "v", "second-order"),
    # Part 0 — curvature matrices and scalings
    "Hessian": _m("Hessian", "black", "-", "*", "curvature"),
    "Fisher": _m("Fisher (true)", "purple", "--", "s", "curvature"),
    "empirical-Fisher": _m("empirical Fisher", "orange", ":", "^", "curvature"),
    "NTK": _m("NTK scaling (1/√m)", "vermillion", "--", "o", "scaling"),
    "mean-field": _m("mean-field scaling (1/m)", "blue", "-", "p", "scaling"),
    "muP": _m("µP", "green", "-.", "^", "scaling"),
    # Part III — conditioning
    "kappa": _m("κ (measured)", "black", "-", "o", "measurement"),
    "bound": _m("bound (ratio of sums)", "blue", "--", "s", "theory"),
    "bound-sigma": _m("bound (Σ̂ inside)", "green", "-.", "D", "theory"),
    "bound-pseudo": _m("pseudo-σ_min formula (wrong)", "grey", "-.", "x", "theory"),
    "bound-loose": _m("loose bound (max)", "vermillion", ":", "^", "theory"),
    "MP": _m("Marchenko–Pastur", "purple", ":", "P", "theory"),
    "linear": _m("linear", "black", "--", "o", "architecture"),
    "residual": _m("residual", "green", "--", "s", "architecture"),
    "leaky-ReLU": _m("leaky ReLU", "orange", "-.", "^", "architecture"),
    # generic
    "theory": _m("theory", "black", "--", "", "theory"),
    "foil": _m("foil (wrong prediction)", "vermillion", ":", "x", "theory"),
    "simulation": _m("simulation", "blue", "none", "o", "measurement"),
    "data": _m("data", "grey", "none", ".", "measurement"),
}


#: Names that denote the same algorithm in different parts (plain gradient steps) and so share one look.
ALIASES: tuple[frozenset[str], ...] = (frozenset({"SGD", "AMGD", "GD"}),)


def style(method: str) -> MethodStyle:
    """The registered style of ``method``; :class:`ValueError` if it is not registered."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a registered method name (str), got {type(method).__name__}")
    try:
        return METHODS[method]
    except KeyError:
        raise ValueError(
            f"method {method!r} is not in the method registry (curvlab.plotting.METHODS); register it there "
            f"so it is drawn the same way everywhere. Registered: {sorted(METHODS)}"
        ) from None


def _check_ax(ax: Any, needs: str) -> Any:
    """``ax`` must be a matplotlib Axes (anything with the method ``needs``)."""
    if not callable(getattr(ax, needs, None)):
        raise TypeError(f"ax must be a matplotlib Axes (with .{needs}), got {type(ax).__name__}")
    return ax


def _check_data(name: str, value: Any) -> Any:
    """Data to draw: anything NumPy reads as an array of real numbers (tensors on any device included)."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an array of real numbers, got {type(value).__name__}")
    probe = value.detach().cpu() if hasattr(value, "detach") and callable(value.detach) else value
    try:
        arr = np.asarray(probe)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{name} must be an array of real numbers, got {type(value).__name__}") from exc
    if arr.dtype.kind == "O":            # None entries, ragged lists: matplotlib would fail deep inside
        try:
            arr = arr.astype(float)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be an array of real numbers (or categories), got {arr.dtype} entries "
                            f"of {type(value).__name__}") from exc
    if arr.ndim > 2:
        raise ValueError(f"{name} must have at most 2 dimensions, got shape {arr.shape}")
    return value


def _check_methods(methods: Any) -> list[str]:
    """A list of registered method names; a bare string is refused (it would be read letter by letter)."""
    if isinstance(methods, (str, bytes)) or not isinstance(methods, Iterable):
        raise TypeError(f"methods must be a list of registered method names, got {methods!r}")
    names = list(methods)
    for i, m in enumerate(names):
        if not isinstance(m, str) or m not in METHODS:
            raise ValueError(f"methods[{i}] = {m!r} is not in the method registry (curvlab.plotting.METHODS); "
                             f"registered: {sorted(METHODS)}")
    return names


def plot(ax: Any, x: Any, y: Any, method: str, *, markevery: Any = None, **kw: Any) -> Any:
    """``ax.plot`` with the method's registered colour, line style, marker and label (``kw`` may override the label)."""
    _check_ax(ax, "plot")
    x, y = _check_data("x", x), _check_data("y", y)
    st = style(method).kwargs()
    if markevery is None:
        try:
            n = len(x)
            markevery = max(1, n // 10)
        except TypeError:
            markevery = 1
    st.update(kw)
    return ax.plot(x, y, markevery=markevery, **st)


def band(ax: Any, x: Any, lo: Any, hi: Any, method: str, *, alpha: float = 0.2, **kw: Any) -> Any:
    """A shaded band (e.g. a replicate interval) in the method's colour."""
    _check_ax(ax, "fill_between")
    x, lo, hi = _check_data("x", x), _check_data("lo", lo), _check_data("hi", hi)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return ax.fill_between(x, lo, hi, color=style(method).color, alpha=alpha, linewidth=0, **kw)


def seaborn_kwargs(methods: Iterable[str]) -> dict[str, Any]:
    """``hue_order``, ``palette``, ``dashes`` and ``markers`` for seaborn's ``lineplot(hue=..., style=...)``."""
    names = list(dict.fromkeys(_check_methods(methods)))
    styles = {m: style(m) for m in names}

    def dash(ls: Any) -> Any:
        return {"-": "", "--": (4, 2), ":": (1, 2), "-.": (4, 2, 1, 2), "none": ""}.get(ls, ls) if isinstance(ls, str) else ls

    return {
        "hue_order": names,
        "style_order": names,
        "palette": {m: s.color for m, s in styles.items()},
        "dashes": {m: dash(s.linestyle) for m, s in styles.items()},
        "markers": {m: (s.marker or "o") for m, s in styles.items()},
    }


_CONTEXTS = {"paper": 0.9, "notebook": 1.0, "talk": 1.3, "projector": 1.6}


def set_theme(context: str = "notebook") -> None:
    """Apply the book's theme: seaborn ``ticks`` style, opaque white figures, colour-blind-safe cycle.

    ``context='projector'`` scales fonts and lines for slides.
    """
    import seaborn as sns

    if context not in _CONTEXTS:
        raise ValueError(f"context must be one of {sorted(_CONTEXTS)}, got {context!r}")
    sns.set_theme(
        context="notebook",
        style="ticks",
        font_scale=_CONTEXTS[context],
        rc={
            "figure.facecolor": "white",
            "axes.facecolor": "white",
            "savefig.facecolor": "white",
            "savefig.transparent": False,
            "figure.dpi": 110,
            "savefig.dpi": 144,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "figure.constrained_layout.use": True,
            "legend.frameon": False,
        },
    )
    plt.rcParams["axes.prop_cycle"] = matplotlib.cycler(color=[_OI[c] for c in ("blue", "vermillion", "green", "orange", "purple", "sky", "black")])


_COUNTER = {"n": 0}


def reset_figure_counter() -> None:
    """Restart figure numbering (called by :func:`curvlab.setup` at the top of each chapter)."""
    _COUNTER["n"] = 0


class Figure:
    """A rendered figure with alt text and a numbered caption; displays as HTML (``<figure>``)."""

    def __init__(self, png: bytes, alt: str, caption: str, number: int, label: str | None) -> None:
        self.png, self.alt, self.caption, self.number, self.label = png, alt, caption, number, label

    def _repr_html_(self) -> str:
        data = base64.b64encode(self.png).decode("ascii")
        ident = f' id="{html.escape(self.label)}"' if self.label else ""
        return (
            f'<figure class="curvlab-figure"{ident}>'
            f'<img src="data:image/png;base64,{data}" alt="{html.escape(self.alt, quote=True)}" style="max-width:100%"/>'
            f"<figcaption><strong>Figure {self.number}.</strong> {html.escape(self.caption)}</figcaption></figure>"
        )

    def _repr_png_(self) -> bytes:
        """The image alone, for front ends that do not render HTML (the LaTeX handout, ``make pdf``)."""
        return self.png

    def __repr__(self) -> str:
        return f"Figure {self.number}. {self.caption}\n[alt: {self.alt}]"


def show(fig: Any, *, alt: str, caption: str, label: str | None = None) -> Figure:
    """Render ``fig`` with alt text (what the figure shows, for screen readers) and a caption (what to see).

    Both are required and must be real sentences. The matplotlib figure is closed, so it is not drawn twice.
    """
    if not isinstance(alt, str) or len(alt.strip()) < 20:
        raise ValueError("alt must describe the figure for a reader who cannot see it (at least 20 characters)")
    if not isinstance(caption, str) or len(caption.strip()) < 10:
        raise ValueError("caption must say what to see in the figure (at least 10 characters)")
    if not hasattr(fig, "savefig"):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white", transparent=False, bbox_inches="tight")
    plt.close(fig)
    _COUNTER["n"] += 1
    return Figure(buf.getvalue(), alt.strip(), caption.strip(), _COUNTER["n"], label)


def legend_methods(ax: Any, methods: Sequence[str], **kw: Any) -> Any:
    """A legend with one handle per registered method, in the given order."""
    from matplotlib.lines import Line2D

    _check_ax(ax, "legend")
    handles = [Line2D([], [], **style(m).kwargs()) for m in _check_methods(methods)]
    return ax.legend(handles=handles, **kw)
