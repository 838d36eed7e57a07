"""Tests for curvlab.config (device routing). The lead may add further tests below; these are the MPS-routing ones."""

from __future__ import annotations

import pytest
import torch

from curvlab import config, curvature, linalg


class FakeMPSTensor(torch.Tensor):
    """A CPU tensor that reports ``device == mps``, so MPS routing can be tested on any machine.

    Every torch operation on it returns a plain tensor (the subclass is dropped), so where an operation's
    result lives is the truth, not the fake property.
    """

    @property
    def device(self):  # type: ignore[override]
        return torch.device("mps")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.fixture
def mocked_mps(monkeypatch):
    """Pretend the machine has MPS and no CUDA, with no device requested through the environment."""
    monkeypatch.delenv(config.DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(config, "_mps_available", lambda: True)


@pytest.fixture
def eigh_spy(monkeypatch):
    """Record the dtype and device of every matrix that reaches ``torch.linalg.eigh``."""
    seen: list[tuple[torch.dtype, torch.device, type]] = []
    real = torch.linalg.eigh

    def spy(A, *args, **kwargs):
        seen.append((A.dtype, A.device, type(A)))
        return real(A, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", spy)
    return seen


def test_mps_spectral_routing_device_choice(mocked_mps):
    assert config.device().type == "mps"
    assert config.spectral_device().type == "cpu"
    assert config.spectral_device("mps").type == "cpu"
    assert config.spectral_dtype("mps") == torch.float64
    assert config.spectral_device("cpu").type == "cpu"


def test_mps_spectral_conversion_lands_on_cpu_float64(mocked_mps):
    A = torch.randn(4, 4, dtype=torch.float32).as_subclass(FakeMPSTensor)
    assert A.device.type == "mps"
    S = config.spectral(A)
    assert type(S) is torch.Tensor and S.device.type == "cpu" and S.dtype == torch.float64


def test_mps_spectral_work_in_linalg_and_curvature_runs_on_cpu_float64(mocked_mps, eigh_spy):
    B = torch.randn(5, 3, dtype=torch.float32)
    A = (B @ B.T).as_subclass(FakeMPSTensor)  # a float32 "MPS" Gram matrix of rank 3
    lam, Q = linalg.sym_eigh(A)
    assert lam.dtype == torch.float64 and lam.device.type == "cpu" and Q.device.type == "cpu"
    cn = curvature.condition_number(A)
    assert cn.rank == 3 and cn.rtol == 5 * torch.finfo(torch.float32).eps  # default rtol from the input dtype
    assert len(eigh_spy) == 2
    assert all(dt == torch.float64 and dev.type == "cpu" and t is torch.Tensor for dt, dev, t in eigh_spy)


def test_cpu_threads_sets_and_restores():
    import torch

    before = torch.get_num_threads()
    with config.cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with config.cpu_threads(1, when=False):
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="n must be"):
        with config.cpu_threads(0):
            pass


def test_thread_policy_defaults_env_and_bad_values():
    """The thread policy (performance page, 'Threads'): one thread on <= 2 cores, min(4, cores // 2) above,
    CURVLAB_THREADS wins, OMP_NUM_THREADS set means the user (or the book build) chose; no timing here."""
    from curvlab import config

    assert config.thread_policy(cores=2, environ={})[0] == 1
    assert config.thread_policy(cores=1, environ={})[0] == 1
    assert config.thread_policy(cores=8, environ={})[0] == 4
    assert config.thread_policy(cores=6, environ={})[0] == 3
    assert config.thread_policy(cores=64, environ={})[0] == 4
    n, why = config.thread_policy(cores=2, environ={"OMP_NUM_THREADS": "2"})
    assert n is None and "OMP_NUM_THREADS=2" in why
    assert config.thread_policy(cores=2, environ={"OMP_NUM_THREADS": "2", "CURVLAB_THREADS": "3"})[0] == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="CURVLAB_THREADS"):
            config.thread_policy(cores=2, environ={"CURVLAB_THREADS": bad})


def test_setup_applies_the_thread_policy_and_says_how_to_change_it(monkeypatch, capsys):
    import curvlab
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("CURVLAB_THREADS", "1")
    monkeypatch.setenv("CURVLAB_DEVICE", "cpu")
    try:
        info = curvlab.setup("00_threads_test")
        out = capsys.readouterr().out
        assert torch.get_num_threads() == 1 and info.threads == 1
        assert "threads=1" in out and "CURVLAB_THREADS=n" in out and "OMP_NUM_THREADS=n" in out
    finally:
        torch.set_num_threads(before)
