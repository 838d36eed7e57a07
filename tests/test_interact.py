"""curvlab.interact.explore: static small multiples in a book build, sliders in a live kernel, bad inputs."""

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from curvlab import interact, plotting  # noqa: E402

ALT = "Panels of a line whose slope is the parameter, one panel per value."
CAP = "The slope grows with the parameter."


def recorder():
    calls = []

    def draw(ax, slope, offset):
        calls.append({"slope": slope, "offset": offset})
        x = np.linspace(0, 1, 5)
        ax.plot(x, slope * x + offset)

    return draw, calls


def test_static_in_a_book_build_draws_one_panel_per_value(monkeypatch):
    monkeypatch.setenv("CURVLAB_BOOK_BUILD", "1")
    assert not interact.live_available()
    draw, calls = recorder()
    fig = interact.explore(draw, alt=ALT, caption=CAP, slope=[1, 2, 4, 8, 16], offset=np.array([0.0, 1.0, 2.0]))
    assert isinstance(fig, plotting.Figure) and fig.png.startswith(b"\x89PNG")
    assert [c["slope"] for c in calls] == [1, 2, 4, 8, 16]
    assert {c["offset"] for c in calls} == {1.0}  # the middle value of the other slider


def test_static_parameter_and_defaults_can_be_chosen():
    draw, calls = recorder()
    interact.explore(draw, alt=ALT, caption=CAP, static="offset", defaults={"slope": 4}, mode="static",
                     slope=[1, 2, 4], offset=[0.0, 1.0])
    assert calls == [{"slope": 4, "offset": 0.0}, {"slope": 4, "offset": 1.0}]


def test_live_mode_shows_sliders_that_redraw(monkeypatch):
    pytest.importorskip("ipywidgets")
    monkeypatch.delenv("CURVLAB_BOOK_BUILD", raising=False)
    draw, calls = recorder()
    box = interact.explore(draw, alt=ALT, caption=CAP, mode="live", slope=[1, 2, 4], offset=[0.0, 1.0])
    sliders = box.children[0].children
    assert [s.description for s in sliders] == ["slope", "offset"]
    assert calls[-1] == {"slope": 2, "offset": 0.0}
    sliders[0].value = 4
    assert calls[-1] == {"slope": 4, "offset": 0.0}


def test_auto_mode_without_a_kernel_is_static(monkeypatch):
    monkeypatch.delenv("CURVLAB_BOOK_BUILD", raising=False)
    draw, _ = recorder()
    assert isinstance(interact.explore(draw, alt=ALT, caption=CAP, slope=[1, 2], offset=[0.0]), plotting.Figure)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"fn": 3}, TypeError, "fn must be callable"),
        ({"sliders": {}}, ValueError, "at least one slider"),
        ({"sliders": {"slope": 2}}, TypeError, "slope must be a sequence"),
        ({"sliders": {"slope": []}}, ValueError, "at least one value"),
        ({"sliders": {"slope": [1, float("nan")]}}, ValueError, "finite"),
        ({"static": "width"}, ValueError, "static must name one of the sliders"),
        ({"defaults": {"slope": 3}}, ValueError, "not one of the slider's values"),
        ({"defaults": {"width": 3}}, ValueError, "not a slider"),
        ({"alt": "short"}, ValueError, "alt must be"),
        ({"caption": ""}, ValueError, "caption must be"),
        ({"mode": "web"}, ValueError, "mode must be"),
    ],
)
def test_bad_inputs_are_named(kwargs, error, match):
    draw, _ = recorder()
    args = {"fn": draw, "alt": ALT, "caption": CAP, "mode": "static"}
    sliders = kwargs.pop("sliders", {"slope": [1, 2], "offset": [0.0]})
    args.update(kwargs)
    fn = args.pop("fn")
    with pytest.raises(error, match=match):
        interact.explore(fn, **args, **sliders)
