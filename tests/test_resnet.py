"""Tests for curvlab.resnet: ResNet-20's parameter count, shapes and option-A shortcuts; its flop count against a
hook count; the CIFAR-10 python-batch loader on a made folder (exact arrays, splits, errors); the chunked Jacobian
Gram against the dense torch.func Jacobian (an independent route) with a computed tolerance and two foils; the
pruned-ResNet grid cell and its flop model; bad input."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pandas as pd
import pytest
import torch

from curvlab import conv, curvature
from curvlab import resnet as R

F64 = torch.float64


# ============================================================================================ the network
def test_parameter_count_at_width_16():
    # by hand: stem 3*16*9 = 432; stage 1: 6 convs 16*16*9 = 13,824; stage 2: 16*32*9 + 5 * 32*32*9 = 50,688;
    # stage 3: 32*64*9 + 5 * 64*64*9 = 202,752; head 64*10 + 10 = 650; batch norm 2 * (16 + 6*16 + 6*32 + 6*64)
    # = 1,376. Total 269,722 (He et al.: "0.27M"); without batch norm 268,346.
    by_hand = 432 + 13_824 + 50_688 + 202_752 + 650
    assert by_hand + 1_376 == 269_722
    net = R.ResNet20()
    assert sum(p.numel() for p in net.parameters()) == 269_722
    assert sum(p.numel() for p in R.ResNet20(norm="none").parameters()) == by_hand
    # 20 weighted layers: 19 convolutions and the head
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) == 19
    for w in (1, 2, 3, 5):
        for norm in ("eval", "none"):
            assert sum(p.numel() for p in R.ResNet20(w, norm=norm).parameters()) == R._param_count(w, norm=norm)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_output_shape_and_flat_input(width):
    net = R.ResNet20(width, seed=0)
    assert not net.training                                            # built in eval mode
    X = torch.randn(3, 3, 32, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = net(X)
    assert out.shape == (3, 10) and out.dtype == F64
    torch.testing.assert_close(net(X.reshape(3, -1)), out, rtol=0, atol=0)
    assert net(torch.zeros(2, 3, 16, 16, dtype=F64)).shape == (2, 10)  # any side (digits at 16x16)
    with pytest.raises(ValueError, match="x must hold flattened square images"):
        net(torch.zeros(2, 3 * 15, dtype=F64))


def test_seeded_init_is_reproducible_and_kaiming():
    a, b = R.ResNet20(4, seed=3), R.ResNet20(4, seed=3)
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    w = R.ResNet20(16, seed=0).blocks[8].conv2.weight.detach()       # 64 x 64 x 3 x 3: fan-in 576, He std sqrt(2/576)
    assert abs(float(w.std()) / math.sqrt(2 / 576) - 1) < 4 / math.sqrt(w.numel())


def test_option_a_shortcut():
    x = torch.randn(2, 4, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    y = R._shortcut_a(x, 8, 2)
    assert y.shape == (2, 8, 3, 3)
    torch.testing.assert_close(y[:, 2:6], x[:, :, ::2, ::2], rtol=0, atol=0)
    assert float(y[:, :2].abs().sum()) == 0 and float(y[:, 6:].abs().sum()) == 0
    torch.testing.assert_close(R._shortcut_a(x, 4, 1), x, rtol=0, atol=0)
    # the block with zeroed convolutions is relu(shortcut): no projection parameters
    blk = R.ResNet20(4).blocks[3]
    assert blk.stride == 2 and blk.c_out == 8
    with torch.no_grad():
        blk.conv1.weight.zero_(), blk.conv2.weight.zero_()
    torch.testing.assert_close(blk(x), torch.relu(y), rtol=0, atol=0)


@pytest.mark.parametrize("width, image", [(16, 32), (4, 16), (3, 9)])
def test_forward_flops_match_a_hook_count(width, image):
    # independent route: multiply-adds and conv outputs counted by forward hooks on the actual module
    net = R.ResNet20(width, norm="none")
    count = {"macs": 0, "acts": 0}

    def hook(mod, inp, out):
        if isinstance(mod, torch.nn.Conv2d):
            count["macs"] += out.numel() * mod.in_channels * 9
            count["acts"] += out.numel()
        elif isinstance(mod, torch.nn.Linear):
            count["macs"] += out.numel() * mod.in_features

    for m in net.modules():
        m.register_forward_hook(hook)
    net(torch.zeros(1, 3, image, image, dtype=F64))
    assert R.forward_flops(width, image) == 2 * count["macs"] + 8 * count["acts"]
    if (width, image) == (16, 32):
        # by hand: stem 442,368; stage 1: 6 x 2,359,296; stages 2 and 3: 1,179,648 + 5 x 2,359,296 each; head 640
        assert count["macs"] == 442_368 + 6 * 2_359_296 + 2 * (1_179_648 + 5 * 2_359_296) + 640 == 40_551_040


def test_calibrate_sets_batch_statistics():
    X, _ = R.digits_subset(12, 0)
    net = R.ResNet20(2, seed=0).calibrate(X)
    assert not net.training
    torch.testing.assert_close(net.bn.running_mean, net.stem(X).mean(dim=(0, 2, 3)).detach(), rtol=1e-12,
                               atol=1e-12)
    # the calibrated eval-mode network is the train-mode network on that batch, up to torch storing the unbiased
    # variance: a relative factor sqrt(N / (N - 1)) ~ 1 + 1/(2N) per batch norm, N = values per channel
    # (12 images x 16², 8², 4²: 7, 6 and 6 layers); tolerance: the first-order sum, doubled
    tol = sum(k / (12 * s * s) for k, s in ((7, 16), (6, 8), (6, 4)))
    ref = R.ResNet20(2, seed=0)
    ref.train()
    with torch.no_grad():
        a, b = net(X), ref(X)
        ref.eval()
        foil = ref(X)                                              # the default statistics: not calibrated
    assert float((a - b).abs().max() / b.abs().max()) < tol
    assert float((foil - b).abs().max() / b.abs().max()) > tol
    assert R.ResNet20(2, norm="none").calibrate(X) is not None


# ============================================================================================ CIFAR-10 batches
def _fake_batch(n: int, offset: int) -> tuple[np.ndarray, list]:
    data = ((np.arange(n * 3072).reshape(n, 3072) + 7 * offset) % 251).astype(np.uint8)
    labels = [(offset // 10 + i) % 10 for i in range(n)]
    return data, labels


def _write_fake_cifar(root, sizes=(3, 2, 2, 1, 2), n_test=2, protocol=2):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    truth = {"train": ([], []), "test": ([], [])}
    for i, n in enumerate(sizes, start=1):
        data, labels = _fake_batch(n, 10 * i)
        with open(d / f"data_batch_{i}", "wb") as fh:   # bytes keys, as the python-2 pickles of the real files
            pickle.dump({b"batch_label": b"training batch", b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * n}, fh, protocol=protocol)
        truth["train"][0].append(data), truth["train"][1].extend(labels)
    data, labels = _fake_batch(n_test, 99)
    with open(d / "test_batch", "wb") as fh:
        pickle.dump({"labels": labels, "data": data}, fh)             # str keys (a python-3 pickle) also read
    truth["test"][0].append(data), truth["test"][1].extend(labels)
    return d, {k: (np.concatenate(v[0]), np.array(v[1])) for k, v in truth.items()}


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_loader_reads_made_batches_exactly(tmp_path, protocol):
    d, truth = _write_fake_cifar(tmp_path, protocol=protocol)
    for split, n in (("train", 10), ("test", 2)):
        images, labels = R.load_cifar10(tmp_path, split, verify=False)
        assert images.shape == (n, 3, 32, 32) and images.dtype == np.uint8
        assert labels.shape == (n,) and labels.dtype == np.uint8
        data, lab = truth[split]
        np.testing.assert_array_equal(images.reshape(n, -1), data)
        np.testing.assert_array_equal(labels, lab)
        # channel-major rows: value k of a row is channel k // 1024, pixel row (k % 1024) // 32, column k % 32
        i, k = n - 1, 1024 * 2 + 32 * 5 + 7
        assert images[i, 2, 5, 7] == data[i, k]
    # the batches folder itself is also a valid root; batches are concatenated in order 1..5
    images, labels = R.load_cifar10(d, "train", verify=False)
    np.testing.assert_array_equal(labels[:3], [1, 2, 3])
    np.testing.assert_array_equal(labels[3:5], [2, 3])
    np.testing.assert_array_equal(images[3].reshape(-1), _fake_batch(2, 20)[0][0])
    assert R.cifar10_available(tmp_path) and R.cifar10_available(d)


def test_loader_root_from_environment(tmp_path, monkeypatch):
    _write_fake_cifar(tmp_path)
    monkeypatch.setenv(R.CIFAR10_ENV, str(tmp_path))
    assert R.cifar10_available()
    assert R.load_cifar10(split="test", verify=False)[0].shape == (2, 3, 32, 32)
    monkeypatch.delenv(R.CIFAR10_ENV)
    assert not R.cifar10_available()
    with pytest.raises(ValueError, match=r"root.*\$CURVLAB_CIFAR10_DIR.*cifar-10-python.tar.gz"):
        R.load_cifar10(verify=False)


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match=r"root .*does not hold the CIFAR-10 train batches.*CURVLAB_CIFAR10_DIR"):
        R.load_cifar10(tmp_path / "nowhere", verify=False)
    assert not R.cifar10_available(tmp_path / "nowhere")
    d, _ = _write_fake_cifar(tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        R.load_cifar10(tmp_path, "validation", verify=False)
    with pytest.raises(TypeError, match="root"):
        R.load_cifar10(3, verify=False)
    with pytest.raises(TypeError, match="root"):
        R.cifar10_available(3)
    # a missing batch
    (d / "data_batch_4").unlink()
    assert not R.cifar10_available(tmp_path)
    with pytest.raises(ValueError, match=r"data_batch_4"):
        R.load_cifar10(tmp_path, verify=False)
    R.load_cifar10(tmp_path, "test", verify=False)                     # the other split still loads
    # a truncated (corrupt) batch
    raw = (d / "data_batch_1").read_bytes()
    (d / "data_batch_4").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"corrupt CIFAR-10 batch .*data_batch_4"):
        R.load_cifar10(tmp_path, verify=False)


@pytest.mark.parametrize("payload, match", [
    ({b"data": np.zeros((2, 3072), np.uint8)}, "keys b'data' and b'labels'"),
    ({b"data": np.zeros((2, 3071), np.uint8), b"labels": [0, 1]}, r"shape \(N, 3072\)"),
    ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "uint8"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "labels in 0..9"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "labels in 0..9"),
    ([1, 2], "expected a dict"),
])
def test_loader_rejects_malformed_batches(tmp_path, payload, match):
    d, _ = _write_fake_cifar(tmp_path)
    with open(d / "test_batch", "wb") as fh:
        pickle.dump(payload, fh, protocol=2)
    with pytest.raises(ValueError, match=match):
        R.load_cifar10(tmp_path, "test", verify=False)


class _Evil:
    def __reduce__(self):
        return (print, ("pickle ran code",))


def test_loader_refuses_code_in_a_pickle(tmp_path, capsys):
    d, _ = _write_fake_cifar(tmp_path)
    with open(d / "test_batch", "wb") as fh:
        pickle.dump({b"data": _Evil(), b"labels": [0]}, fh)
    with pytest.raises(ValueError, match="not allowed in a CIFAR-10 batch"):
        R.load_cifar10(tmp_path, "test", verify=False)
    assert "pickle ran code" not in capsys.readouterr().out


def test_cifar10_subset(tmp_path):
    _, truth = _write_fake_cifar(tmp_path)
    X, y = R.cifar10_subset(6, 4, root=tmp_path, verify=False)
    assert X.shape == (6, 3, 32, 32) and X.dtype == F64 and y.dtype == torch.int64
    idx = np.random.default_rng(4).permutation(10)[:6]
    np.testing.assert_array_equal(y.numpy(), truth["train"][1][idx])
    raw = torch.as_tensor(truth["train"][0][idx].reshape(6, 3, 32, 32) / 255.0)
    mean, std = raw.mean(dim=(0, 2, 3), keepdim=True), raw.std(dim=(0, 2, 3), keepdim=True, correction=0)
    torch.testing.assert_close(X, (raw - mean) / std, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(X.mean(dim=(0, 2, 3)), torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)
    assert R.cifar10_subset(2, 0, root=tmp_path, split="test", dtype=torch.float32, verify=False)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="n must be <= 10"):
        R.cifar10_subset(11, 0, root=tmp_path, verify=False)


def test_digits_subset():
    X, y = R.digits_subset(5, 1)
    assert X.shape == (5, 3, 16, 16) and y.shape == (5,)
    torch.testing.assert_close(X[:, 0], X[:, 2], rtol=0, atol=0)                  # grey repeated over channels
    torch.testing.assert_close(X[:, :, ::2, ::2], X[:, :, 1::2, 1::2], rtol=0, atol=0)   # nearest upsampling
    torch.testing.assert_close(X.std(dim=(0, 2, 3), correction=0), torch.ones(3, dtype=F64), rtol=1e-12, atol=0)
    assert R.digits_subset(2, 0, side=8)[0].shape == (2, 3, 8, 8)
    for kw, match in (({"side": 12}, "side must be a multiple of 8"), ({"n": 0}, "n must be >= 1"),
                      ({"n": 1798}, "n must be <= 1797"), ({"dtype": torch.int64}, "dtype"),
                      ({"device": "nodevice"}, "device")):
        with pytest.raises((ValueError, TypeError), match=match):
            R.digits_subset(**{"n": 2, "seed": 0, **kw})


# ============================================================================================ pruning, the Gram
def test_magnitude_masks_prune_weights_only():
    net = R.ResNet20(2, seed=0)
    masks = R.magnitude_masks(net, 0.6)
    for k, p in net.named_parameters():
        m = masks[k]
        if p.dim() < 2:
            assert bool((m == 1).all()), k                                   # biases and gamma/beta kept
        else:
            keep = math.ceil(0.4 * p.numel() - 1e-9)
            assert int(m.sum()) == keep, k
            kept, dropped = p.detach().abs()[m.bool()], p.detach().abs()[~m.bool()]
            assert float(kept.min()) >= float(dropped.max()), k                # the largest magnitudes
    assert all(bool((m == 1).all()) for m in R.magnitude_masks(net, 0.0).values())


def _dense_gram(net, masks, X):
    """The reference: torch.func's dense Jacobian of the whole batch over the kept weights (conv.pruned_model)."""
    fn, theta = conv.pruned_model(net, masks, X.reshape(X.shape[0], -1))
    J = curvature.jacobian(fn, theta)
    return J, J @ J.T / X.shape[0]


@pytest.mark.parametrize("rate, width", [(0.0, 1), (0.5, 2), (0.8, 2)])
def test_chunked_gram_matches_dense_jacobian(rate, width):
    X, _ = R.digits_subset(5, 2, side=8)
    net = R.ResNet20(width, seed=1).calibrate(X)
    masks = R.magnitude_masks(net, rate)
    J, K_ref = _dense_gram(net, masks, X)
    # computed tolerance: the dot products of length p (gamma_p) and the Jacobian entries' own rounding through
    # L = 20 layers of fan-in at most 9 * 4 width (2 L f eps, first order), relative to |J| |J|^T / n
    p, eps, L, f = J.shape[1], torch.finfo(F64).eps, 20, 9 * 4 * width
    tol = (p + 2 * L * f) * eps * (J.abs() @ J.abs().T) / X.shape[0]
    for chunk in (None, 1, 2, 3):
        K = R.jacobian_gram(net, masks, X, chunk=chunk)
        assert K.shape == (50, 50)
        assert bool(((K - K_ref).abs() <= tol).all()), (chunk, float(((K - K_ref).abs() / tol).max()))
    assert bool(((R.jacobian_gram(net, masks, X, max_bytes=1) - K_ref).abs() <= tol).all())   # one sample a block
    # foil 1: cross-sample blocks dropped (a blockwise accumulation that forgets the off-diagonal pairs)
    foil = K_ref.clone()
    for i in range(5):
        for j in range(5):
            if i != j:
                foil[10 * i:10 * i + 10, 10 * j:10 * j + 10] = 0
    assert bool(((foil - K).abs() > tol).any())
    # foil 2: the Jacobian at the unpruned weights, pruned columns dropped (the pruning not applied to the network)
    if rate > 0:
        full = {k: p.detach() for k, p in net.named_parameters()}
        names = list(full)

        def f_full(th):
            ps = dict(zip(names, [t.reshape(full[k].shape) for k, t in zip(names, th.split([full[k].numel()
                                                                                            for k in names]))]))
            return torch.func.functional_call(net, ps, (X,)).reshape(-1)

        Jf = curvature.jacobian(f_full, torch.cat([full[k].reshape(-1) for k in names]))
        keep = torch.cat([masks[k].reshape(-1) for k in names]).bool()
        foil2 = Jf[:, keep] @ Jf[:, keep].T / 5
        assert bool(((foil2 - K).abs() > tol).any())


def test_gram_condition_and_net_unchanged():
    X, _ = R.digits_subset(4, 0, side=8)
    net = R.ResNet20(1, seed=0)
    before = {k: p.detach().clone() for k, p in net.named_parameters()}
    masks = R.magnitude_masks(net, 0.4)
    c = R.gram_condition(net, masks, X)
    K_ref = _dense_gram(net, masks, X)[1]
    ref = curvature.condition_number(K_ref)
    assert c.rank == ref.rank and c.size == 40
    # Weyl: each eigenvalue moves by at most ||K - K_ref||_2 (plus the eigensolvers' own backward error,
    # m eps lambda_max each), so kappa's relative change is at most that times (1/lambda_r + 1/lambda_1)
    dK = float(torch.linalg.matrix_norm(R.jacobian_gram(net, masks, X) - K_ref, ord=2))
    shift = dK + 2 * 40 * torch.finfo(F64).eps * ref.lambda_max
    tol = shift * (1 / ref.lambda_min_nonzero + 1 / ref.lambda_max) / (1 - shift / ref.lambda_min_nonzero)
    assert abs(c.kappa / ref.kappa - 1) <= tol, (abs(c.kappa / ref.kappa - 1), tol)
    for k, p in net.named_parameters():
        torch.testing.assert_close(p, before[k], rtol=0, atol=0)
    # a float32 network: the Gram is still float64 (spectral work), from a float64 copy
    net32 = R.ResNet20(1, seed=0, dtype=torch.float32)
    K32 = R.jacobian_gram(net32, R.magnitude_masks(net32, 0.4), X.float())
    assert K32.dtype == F64 and next(net32.parameters()).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gram_on_cuda_matches_cpu():  # pragma: no cover - CPU CI
    X, _ = R.digits_subset(4, 0, side=8)
    net = R.ResNet20(2, seed=0)
    masks = R.magnitude_masks(net, 0.4)
    K = R.jacobian_gram(net, masks, X)
    netc = R.ResNet20(2, seed=0, device="cuda")
    Kc = R.jacobian_gram(netc, R.magnitude_masks(netc, 0.4), X.cuda())
    torch.testing.assert_close(Kc.cpu(), K, rtol=1e-10, atol=1e-10 * float(K.abs().max()))


# ============================================================================================ the grid cell
COLUMNS = ["seed", "step", "loss", "kappa", "rank", "gap", "lambda_max", "lambda_min", "size", "p", "p_kept",
           "sigma_min", "device"]


def test_cell_on_digits():
    f = R.pruned_resnet_cell(0.4, 6, [0, 1], 5, 2, 1, "digits", 1e-3)
    assert isinstance(f, pd.DataFrame) and list(f.columns) == COLUMNS
    assert f["step"].tolist() == [0, 2, 4, 5] * 2 and f["seed"].tolist() == [0] * 4 + [1] * 4
    assert bool(np.isfinite(f[["loss", "kappa", "lambda_max", "sigma_min"]].to_numpy()).all())
    assert (f["size"] == 60).all() and (f["p"] == R._param_count(1)).all() and (f["p_kept"] < f["p"]).all()
    for _, g in f.groupby("seed"):
        assert g["loss"].iloc[-1] < g["loss"].iloc[0]                     # gradient descent at a small step
    # kappa at step 0 is that of the pruned, calibrated network through the public functions
    X, _ = R.digits_subset(6, 1)
    net = R.ResNet20(1, seed=1)
    masks = R.magnitude_masks(net, 0.4)
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.mul_(masks[k])
    c = R.gram_condition(net.calibrate(X), masks, X)
    row = f[(f.seed == 1) & (f.step == 0)].iloc[0]
    assert abs(row["kappa"] / c.kappa - 1) < 1e-9 and row["rank"] == c.rank
    # no configuration key among the columns (curvlab.sweep refuses them)
    assert not set(f.columns) & {"rate", "n", "seeds", "steps", "every", "width", "dataset", "lr", "norm"}


def test_cell_on_made_cifar_files(tmp_path, monkeypatch):
    _write_fake_cifar(tmp_path)
    monkeypatch.setenv(R.CIFAR10_ENV, str(tmp_path))
    real = R.cifar10_subset                                  # the cell reads official files only; these are made
    monkeypatch.setattr(R, "cifar10_subset", lambda *a, **k: real(*a, **k, verify=False))
    f = R.pruned_resnet_cell(0.2, 4, [0], 1, 1, 1, "cifar10", 1e-3, norm="none")
    assert f["step"].tolist() == [0, 1] and (f["size"] == 40).all()
    monkeypatch.delenv(R.CIFAR10_ENV)
    with pytest.raises(ValueError, match="CURVLAB_CIFAR10_DIR"):
        R.pruned_resnet_cell(0.2, 4, [0], 1, 1, 1, "cifar10", 1e-3)


def test_cell_divergence_names_lr():
    with pytest.raises(ValueError, match="lr = 100000000.0 makes gradient descent diverge"):
        R.pruned_resnet_cell(0.0, 4, [0], 3, 1, 1, "digits", 1e8)


def test_flop_model():
    kw = dict(rate=0.4, n=16, seeds=[0, 1], steps=20, every=5, width=4, dataset="digits")
    f = R.pruned_resnet_flops(**kw)
    assert f > 0
    assert R.pruned_resnet_flops(**{**kw, "seeds": [0, 1, 2, 3]}) == pytest.approx(2 * f, rel=1e-12)
    assert R.pruned_resnet_flops(**{**kw, "n": 32}) > 2 * f                     # the Gram grows like n^2
    assert R.pruned_resnet_flops(**{**kw, "dataset": "cifar10"}) > f            # 32x32 against 16x16
    assert R.pruned_resnet_flops(**kw, lr=0.1, norm="none") == f                # extra cell keys are ignored
    # one checkpoint and no step at n = 1: Jacobian, Gram, eigenvalues and SVDs of one image
    one = R.pruned_resnet_flops(0.0, 1, [0], 0, 1, 1, "digits")
    F, p = R.forward_flops(1, 16), R._param_count(1)
    lower = 21 * F + 2 * 100 * p + 4 * 1000
    assert lower <= one <= 2 * lower


# ============================================================================================ bad input
GOOD = dict(rate=0.2, n=4, seeds=[0], steps=1, every=1, width=1, dataset="digits", lr=1e-3)


@pytest.mark.parametrize("key, value, exc", [
    ("rate", 1.0, ValueError), ("rate", -0.1, ValueError), ("rate", math.nan, ValueError), ("rate", "0.2", TypeError),
    ("rate", True, TypeError), ("n", 0, ValueError), ("n", 2.5, TypeError), ("n", 1798, ValueError),
    ("seeds", [], ValueError), ("seeds", [-1], ValueError), ("seeds", 3, TypeError), ("steps", -1, ValueError),
    ("every", 0, ValueError), ("width", 0, ValueError), ("dataset", "mnist", ValueError), ("dataset", 3, TypeError),
    ("lr", 0.0, ValueError), ("lr", math.inf, ValueError), ("lr", "1e-3", TypeError),
])
def test_cell_and_flops_bad_input(key, value, exc):
    for fn in (R.pruned_resnet_cell, R.pruned_resnet_flops)[:1 if key == "lr" else 2]:   # the flops ignore lr
        with pytest.raises(exc, match=key):
            fn(**{**GOOD, key: value})
    with pytest.raises(ValueError, match="norm"):
        R.pruned_resnet_cell(**GOOD, norm="train")


def test_network_and_gram_bad_input():
    for kw, exc, match in (({"width": 0}, ValueError, "width"), ({"norm": "train"}, ValueError, "norm"),
                           ({"dtype": torch.int64}, TypeError, "dtype"), ({"seed": -1}, ValueError, "seed"),
                           ({"device": "nodevice"}, ValueError, "device"), ({"num_classes": 0}, ValueError,
                                                                            "num_classes")):
        with pytest.raises(exc, match=match):
            R.ResNet20(**kw)
    net = R.ResNet20(1)
    X = torch.zeros(2, 3, 8, 8, dtype=F64)
    masks = R.magnitude_masks(net, 0.0)
    with pytest.raises(TypeError, match="net"):
        R.magnitude_masks("net", 0.2)
    with pytest.raises(ValueError, match="rate"):
        R.magnitude_masks(net, 1.0)
    with pytest.raises(ValueError, match="masks"):
        R.jacobian_gram(net, {}, X)
    with pytest.raises(TypeError, match="X"):
        R.jacobian_gram(net, masks, X.numpy())
    with pytest.raises(ValueError, match="X"):
        R.jacobian_gram(net, masks, torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="X contains non-finite"):
        R.jacobian_gram(net, masks, torch.full((2, 3, 8, 8), math.nan, dtype=F64))
    net.train()
    with pytest.raises(ValueError, match="net has a batch norm in train mode"):
        R.jacobian_gram(net, masks, X)
    net.eval()
    with pytest.raises(ValueError, match="chunk"):
        R.jacobian_gram(net, masks, X, chunk=0)
    with pytest.raises(ValueError, match="max_bytes"):
        R.jacobian_gram(net, masks, X, max_bytes=0)
    with pytest.raises(ValueError, match="width"):
        R.forward_flops(0)


# ------------------------------------------------------------------------ hostile CIFAR-10 batches (issue 26)
def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(text: str) -> bytes:                                    # BINUNICODE
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _b(raw: bytes) -> bytes:                                    # BINBYTES
    return b"B" + len(raw).to_bytes(4, "little") + raw


def _i(v: int) -> bytes:                                       # BININT, or LONG1 beyond 32 bits
    if -2 ** 31 <= v < 2 ** 31:
        return b"J" + v.to_bytes(4, "little", signed=True)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


_U1 = _g("numpy", "dtype") + b"(" + _u("u1") + _i(0) + _i(1) + b"tR(" + _i(3) + _u("|") + b"NNN" + _i(-1) \
    + _i(-1) + _i(0) + b"tb"


def _batch(data: bytes, labels: bytes = b"]") -> bytes:
    """A protocol-3 pickle ``{b'data': <data>, b'labels': <labels>}`` from raw opcodes."""
    return b"\x80\x03}(" + _b(b"data") + data + _b(b"labels") + labels + b"u."


def _array(shape: tuple, payload: bytes, dtype: bytes = _U1) -> bytes:
    """numpy's own encoding: _reconstruct(ndarray, (0,), b'b') filled by BUILD (1, shape, dtype, False, data)."""
    return (_g("numpy.core.multiarray", "_reconstruct") + b"(" + _g("numpy", "ndarray") + b"(" + _i(0) + b"t"
            + _b(b"b") + b"tR(" + _i(1) + b"(" + b"".join(_i(s) for s in shape) + b"t" + dtype + b"\x89"
            + _b(payload) + b"tb")


def _load_hostile(tmp_path, raw: bytes, verify: bool = False):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir(exist_ok=True)
    (d / "test_batch").write_bytes(raw)
    return R.load_cifar10(tmp_path, "test", verify=verify)


def test_hand_made_pickles_are_what_numpy_writes(tmp_path):
    """The opcodes of these tests load as numpy's own pickles do (so the hostile variants below differ from a
    valid batch only where they say)."""
    X, y = _load_hostile(tmp_path, _batch(_array((2, 3072), bytes(range(256)) * 24), b"](" + _i(3) + _i(9) + b"e"))
    assert X.shape == (2, 3, 32, 32) and X.reshape(-1)[:256].tolist() == list(range(256)) and y.tolist() == [3, 9]


@pytest.mark.parametrize("raw, match", [
    # numpy.ndarray called directly: 4,000 images of uninitialised memory from a 100-byte file
    (_batch(_g("numpy", "ndarray") + b"((" + _i(4000) + _i(3072) + b"t" + _u("u1") + b"tR"), "called directly"),
    # a header declaring 200,000 and 10^8 images over a few bytes of data
    (_batch(_array((200_000, 3072), b"\0" * 3000)), "declares shape"),
    (_batch(_array((10 ** 8, 3072), b"\0" * 3000)), "declares shape"),
    (_batch(_array((2 ** 70, 3072), b"\0" * 30)), "declares shape"),                     # OverflowError territory
    (_batch(_array((-1, 3072), b"\0" * 30)), "not one or two sizes"),
    # _reconstruct asked for a non-empty array, a bare ndarray, an object dtype
    (_batch(_g("numpy.core.multiarray", "_reconstruct") + b"(" + _g("numpy", "ndarray") + b"(" + _i(9) + b"t"
            + _b(b"b") + b"tR"), "empty ndarray"),
    (_batch(_g("numpy", "ndarray")), "bare dtype or ndarray"),
    (_batch(_array((2, 3072), b"\0" * 6144, _g("numpy", "dtype") + b"(" + _u("O8") + _i(0) + _i(1) + b"tR")),
     "dtype 'O8' is not allowed"),
    # an array whose state never came (uninitialised), a codec lookup, a memo miss, any other global
    (_batch(_g("numpy.core.multiarray", "_reconstruct") + b"(" + _g("numpy", "ndarray") + b"(" + _i(0) + b"t"
            + _b(b"b") + b"tR"), "without its data"),
    (_batch(_g("_codecs", "encode") + b"(" + _u("abc") + _u("no-such-codec") + b"tR"), "latin-1"),
    (b"\x80\x03h\x05.", "not a python batch pickle"),
    (_batch(_g("os", "system") + b"(" + _u("echo hi") + b"tR"), "global os.system is not allowed"),
    (b"\x80\x03" + b"(" * 100 + b".", "not a python batch pickle"),
])
def test_hostile_pickles_are_refused_naming_the_file(tmp_path, raw, match):
    with pytest.raises(ValueError, match=match) as info:
        _load_hostile(tmp_path, raw)
    assert "test_batch" in str(info.value) and "corrupt CIFAR-10 batch" in str(info.value)


@pytest.mark.parametrize("labels, match", [
    (b"](G\x3f\xf0\x00\x00\x00\x00\x00\x00" + _i(1) + b"e", "float"),                 # 1.0
    (b"](" + _u("1") + _i(1) + b"e", "str"),
    (b"](\x88" + _i(1) + b"e", "bool"),
    (b"](" + _i(1) + b"e", "1 labels"),                                  # one label for two images
    (b"](" + _i(1) + _i(10) + b"e", "in 0..9"),
])
def test_labels_must_be_integers_0_to_9_one_per_image(tmp_path, labels, match):
    with pytest.raises(ValueError, match=match):
        _load_hostile(tmp_path, _batch(_array((2, 3072), b"\0" * 6144), labels))


def test_official_layout_and_checksums(tmp_path):
    """verify=True (the default) wants the official file: 10,000 images and the MD5 torchvision lists; a made
    batch of the right size still fails the checksum, a short one the count; too large a file is not read."""
    small = _batch(_array((2, 3072), b"\0" * 6144), b"](" + _i(1) + _i(2) + b"e")
    with pytest.raises(ValueError, match="not the official file.*40351d587109b95175f43aff81a1287e"):
        _load_hostile(tmp_path, small, verify=True)
    data = np.zeros((R.CIFAR10_BATCH_IMAGES, 3072), np.uint8)
    full = pickle.dumps({b"data": data, b"labels": [1] * R.CIFAR10_BATCH_IMAGES}, protocol=2)
    assert 30_720_000 < len(full) < R._CIFAR_MAX_FILE
    X, _ = _load_hostile(tmp_path, full)                                        # verify=False: the layout holds
    assert X.shape == (10_000, 3, 32, 32)
    with pytest.raises(ValueError, match="md5"):
        _load_hostile(tmp_path, full, verify=True)
    many = _batch(_array((3, 3072), b"\0" * 9216), b"](" + _i(1) * 3 + b"e")
    X, _ = _load_hostile(tmp_path, many)
    assert len(X) == 3
    with pytest.raises(ValueError, match="more than any official batch"):
        with open(tmp_path / "cifar-10-batches-py" / "test_batch", "r+b") as fh:
            fh.truncate(R._CIFAR_MAX_FILE + 1)                                  # sparse: nothing is written
        R.load_cifar10(tmp_path, "test", verify=False)
    with pytest.raises(TypeError, match="verify"):
        R.load_cifar10(tmp_path, "test", verify="yes")
    assert set(R.CIFAR10_MD5) == {*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"}
