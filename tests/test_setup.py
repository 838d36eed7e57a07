"""curvlab.config profiles/devices/seeds, curvlab.setup, and curvlab.plotting (registry, figures)."""

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import curvlab  # noqa: E402
from curvlab import config, plotting  # noqa: E402


# ---------------------------------------------------------------- profiles
@pytest.mark.parametrize("prof, expected", [("quick", 1), ("standard", 2), ("paper", 3)])
def test_pick_follows_the_profile(monkeypatch, prof, expected):
    monkeypatch.setenv("CURVLAB_PROFILE", prof)
    assert config.profile() == prof
    assert config.pick(quick=1, standard=2, paper=3) == expected


def test_profile_default_and_paper_fallback(monkeypatch):
    monkeypatch.delenv("CURVLAB_PROFILE", raising=False)
    assert config.profile() == "standard"
    monkeypatch.setenv("CURVLAB_PROFILE", "paper")
    assert config.pick(quick=1, standard=2) == 2


def test_bad_profile_is_named(monkeypatch):
    monkeypatch.setenv("CURVLAB_PROFILE", "huge")
    with pytest.raises(ValueError, match="CURVLAB_PROFILE"):
        config.profile()
    with pytest.raises(ValueError, match="profile_name"):
        config.pick(1, 2, profile_name="tiny")


# ---------------------------------------------------------------- devices, dtypes, seeds
def test_device_override_and_errors(monkeypatch):
    monkeypatch.setenv("CURVLAB_DEVICE", "cpu")
    assert config.device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        config.device("cuda")
    with pytest.raises(ValueError, match="not a valid torch device"):
        config.device("quantum")


def test_spectral_dtype_is_float64_and_mps_routes_to_cpu():
    assert config.spectral_dtype("cpu") is torch.float64
    assert config.spectral_device("mps") == torch.device("cpu")
    assert config.spectral_device("cpu") == torch.device("cpu")
    t = config.spectral(torch.ones(2, dtype=torch.float32))
    assert t.dtype is torch.float64
    with pytest.raises(TypeError, match="t must be"):
        config.spectral([1.0])


def test_seed_everything_reproduces_and_validates():
    config.seed_everything(3)
    a = torch.randn(3), np.random.rand()
    config.seed_everything(3)
    b = torch.randn(3), np.random.rand()
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    with pytest.raises(TypeError, match="seed"):
        config.seed_everything(1.5)
    with pytest.raises(ValueError, match="seed"):
        config.seed_everything(-1)


def test_setup_prints_the_run_line_and_the_thread_line(monkeypatch, capsys):
    """One line for the run (profile, device, seed, versions, revision), one for the CPU threads and how to change
    them (the thread policy of book/running.md, section Threads)."""
    monkeypatch.setenv("CURVLAB_PROFILE", "quick")
    monkeypatch.setenv("CURVLAB_DEVICE", "cpu")
    monkeypatch.setenv("CURVLAB_THREADS", "1")
    info = curvlab.setup("unit_test", seed=7)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    line, threads = lines
    for part in ("profile=quick", "device=cpu", "seed=7", f"torch {torch.__version__}", "rev "):
        assert part in line
    assert threads.startswith("CPU threads: 1 ") and "CURVLAB_THREADS" in threads
    assert info.chapter == "unit_test" and curvlab.checks.records() == []
    with pytest.raises(ValueError, match="chapter"):
        curvlab.setup("")
    torch.use_deterministic_algorithms(False)


# ---------------------------------------------------------------- plotting
def test_registry_rejects_unregistered_methods():
    with pytest.raises(ValueError, match="not in the method registry"):
        plotting.style("MyNewOptimizer")
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="registry"):
        plotting.plot(ax, [0, 1], [0, 1], "MyNewOptimizer")
    with pytest.raises(ValueError, match="registry"):
        plotting.seaborn_kwargs(["K-FAC", "unknown"])
    plt.close(fig)


def test_registry_looks_are_unique_except_declared_aliases():
    looks: dict = {}
    for name, st in plotting.METHODS.items():
        looks.setdefault((st.color, st.linestyle, st.marker), set()).add(name)
    for names in looks.values():
        if len(names) > 1:
            assert any(names <= group for group in plotting.ALIASES), f"methods share one look: {sorted(names)}"


def test_registry_colours_are_colour_blind_safe():
    okabe_ito = {"#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#7F7F7F"}
    assert {st.color for st in plotting.METHODS.values()} <= okabe_ito


def test_show_requires_alt_and_caption_and_renders_an_opaque_figure():
    plotting.set_theme()
    plotting.reset_figure_counter()
    fig, ax = plt.subplots()
    plotting.plot(ax, [1, 2, 3], [3, 2, 1], "K-FAC")
    with pytest.raises(ValueError, match="alt"):
        plotting.show(fig, alt="", caption="A caption long enough.")
    out = plotting.show(fig, alt="A falling line for K-FAC over three points.", caption="K-FAC falls.")
    html = out._repr_html_()
    assert 'alt="A falling line for K-FAC over three points."' in html and "Figure 1." in html
    assert out.png[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.rcParams["savefig.transparent"] is False and plt.rcParams["figure.facecolor"] == "white"
    # the PNG has no transparent pixels (dark theme safety)
    import io

    from matplotlib.image import imread

    img = imread(io.BytesIO(out.png))
    assert img.shape[-1] == 3 or np.all(img[..., 3] == 1.0)


def test_projector_context_is_larger():
    plotting.set_theme("notebook")
    small = plt.rcParams["font.size"]
    plotting.set_theme("projector")
    assert plt.rcParams["font.size"] > small
    plotting.set_theme("notebook")
    with pytest.raises(ValueError, match="context"):
        plotting.set_theme("poster")


def test_seaborn_kwargs_are_complete():
    kw = plotting.seaborn_kwargs(["SGD", "K-FAC"])
    assert kw["hue_order"] == ["SGD", "K-FAC"] and set(kw["palette"]) == {"SGD", "K-FAC"}
    assert all(re.match(r"#[0-9A-F]{6}", c) for c in kw["palette"].values())


def test_as_tensor_keeps_float64_precision():
    from curvlab._validate import as_tensor

    x = 1.2345678901234567
    assert float(as_tensor("x", x, dtype=torch.float64)) == x


class _FakeDist:
    """A distribution whose files hold the imported package (``root`` = the folder above ``curvlab/``)."""

    def __init__(self, text, root=None):
        self.text = text
        self.root = Path(curvlab.__file__).resolve().parent.parent if root is None else Path(root)

    def locate_file(self, path):
        return self.root / path

    def read_text(self, name):
        assert name == "direct_url.json"
        return self.text


@pytest.mark.parametrize("record, expected", [
    # pip's PEP 610 record of `pip install "curvlab @ git+https://...@main#subdirectory=lib"` (Colab's setup cell)
    ('{"url": "https://github.com/o/r", "vcs_info": {"vcs": "git", "requested_revision": "main", '
     '"commit_id": "0123456789abcdef0123456789abcdef01234567"}, "subdirectory": "lib"}', "0123456 (main, installed)"),
    ('{"url": "https://github.com/o/r", "vcs_info": {"vcs": "git", '
     '"commit_id": "0123456789abcdef0123456789abcdef01234567"}}', "0123456 (installed)"),
])
def test_installed_revision_reads_pips_record_of_a_git_install(monkeypatch, record, expected):
    from importlib import metadata

    monkeypatch.setattr(metadata, "distribution", lambda name: _FakeDist(record))
    assert curvlab.installed_revision() == expected


@pytest.mark.parametrize("record", [
    None,                                                   # no record: a copy on sys.path
    '{"url": "file:///x/lib", "dir_info": {"editable": true}}',   # `make env`'s editable install
    "not json",
    '{"vcs_info": {"commit_id": "$(rm -rf /)"}}',           # never printed unless it is a commit hash
    '{"vcs_info": "0123456789abcdef0123456789abcdef01234567"}',
])
def test_installed_revision_falls_back_to_git_and_never_prints_an_unchecked_record(monkeypatch, record):
    from importlib import metadata

    monkeypatch.setattr(metadata, "distribution", lambda name: _FakeDist(record))
    monkeypatch.setattr(config, "git_revision", lambda path=None: "abc1234")
    assert curvlab.installed_revision() == "abc1234"


def test_installed_revision_ignores_the_record_of_a_copy_it_did_not_import(monkeypatch, tmp_path):
    """A git-installed copy in site-packages while a clone's ``lib/`` is imported first: the clone's revision."""
    from importlib import metadata

    installed = tmp_path / "site-packages"
    (installed / "curvlab").mkdir(parents=True)
    (installed / "curvlab" / "__init__.py").write_text("")
    record = ('{"url": "https://github.com/o/r", "vcs_info": {"vcs": "git", "requested_revision": "main", '
              '"commit_id": "0123456789abcdef0123456789abcdef01234567"}, "subdirectory": "lib"}')
    monkeypatch.setattr(metadata, "distribution", lambda name: _FakeDist(record, root=installed))
    monkeypatch.setattr(config, "git_revision", lambda path=None: "abc1234")
    assert curvlab.installed_revision() == "abc1234"


def test_installed_revision_without_a_distribution(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    monkeypatch.setattr(config, "git_revision", lambda path=None: "unknown")
    assert curvlab.installed_revision() == "unknown"
