"""curvlab.data: the MNIST IDX reader treats a file as untrusted input (issue 26). Every file here is made by the
test: a gzip bomb is stopped past the official size (memory stays bounded), headers that disagree with the
official layout, the data or each other are refused, labels must be 0..9, and every error names the file."""

from __future__ import annotations

import gzip
import struct
import tracemalloc
import zlib

import numpy as np
import pytest

from curvlab import data as D
from curvlab import meanfield as mf


def _idx(magic: bytes, dims: tuple, payload: bytes) -> bytes:
    return magic + struct.pack(f">{len(dims)}I", *dims) + payload


IMG, LAB = bytes([0, 0, 8, 3]), bytes([0, 0, 8, 1])


def _folder(tmp_path, images: bytes, labels: bytes, gz: bool = False):
    root = tmp_path / "mnist"
    root.mkdir(exist_ok=True)
    for stem, raw in (("t10k-images-idx3-ubyte", images), ("t10k-labels-idx1-ubyte", labels)):
        for old in root.glob(stem + "*"):
            old.unlink()
        if gz:
            (root / f"{stem}.gz").write_bytes(gzip.compress(raw))
        else:
            (root / stem).write_bytes(raw)
    return root


def _good(n=3):
    return _idx(IMG, (n, 28, 28), bytes(n * 784)), _idx(LAB, (n,), bytes([1, 2, 3, 4, 5][:n]))


def test_made_files_load_without_verify_and_meanfield_reexports():
    assert mf.read_idx is D.read_idx and mf.load_mnist is D.load_mnist and mf.mnist_available is D.mnist_available


@pytest.mark.parametrize("gz", [False, True])
def test_made_files_load_without_verify(tmp_path, gz):
    root = _folder(tmp_path, *_good(), gz=gz)
    X, y = D.load_mnist(root, "test", verify=False)
    assert X.shape == (3, 28, 28) and y.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"holds 3 images; the official test split has 10000|not the official"):
        D.load_mnist(root, "test")                                             # verify=True: official only


def test_a_gzip_bomb_is_stopped_past_the_official_size(tmp_path):
    """1 GiB of zeros compresses to about 1 MB; reading stops a chunk past the 7.8 MB an official test-image
    file holds, and peak memory stays near that (not the 1 GiB the header's data would need)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)                               # gzip container
    head = _idx(IMG, (10_000, 28, 28), b"")
    parts = [comp.compress(head)]
    block = bytes(1 << 20)
    parts += [comp.compress(block) for _ in range(1024)]
    parts.append(comp.flush())
    root = tmp_path / "mnist"
    root.mkdir()
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(b"".join(parts))
    (root / "t10k-labels-idx1-ubyte").write_bytes(_idx(LAB, (10_000,), bytes(10_000)))
    assert (root / "t10k-images-idx3-ubyte.gz").stat().st_size < 2 * 2 ** 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz.*decompresses to more than 7840016"):
            D.load_mnist(root, "test", verify=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2 ** 20, peak
    with pytest.raises(ValueError, match="decompresses to more than"):
        D.read_idx(root / "t10k-images-idx3-ubyte.gz")                          # the reader's own cap


@pytest.mark.parametrize("images, labels, match", [
    # magic numbers: labels as images, float images, a 4-d header, not IDX
    (_idx(LAB, (3,), bytes(3)), None, "not an MNIST images file"),
    (_idx(bytes([0, 0, 0x0D, 3]), (3, 28, 28), bytes(3 * 784 * 4)), None, "not an MNIST images file"),
    (b"\x1f\x8b\x08\x00garbage", None, "not an MNIST images file"),
    # dimensions: images of another size, more images than the official split, header sizes beyond the data
    (_idx(IMG, (3, 32, 32), bytes(3 * 1024)), None, r"\(32, 32\) pixels"),
    (_idx(IMG, (10_001, 28, 28), b""), None, "holds"),
    (_idx(IMG, (3, 28, 28), bytes(100)), None, "header says"),
    (_idx(IMG, (2 ** 31, 28, 28), bytes(784)), None, "header says"),
    (IMG + b"\0\0", None, "truncated in its header"),
    # labels: out of range, another count than the images, int32 labels, too many
    (None, _idx(LAB, (3,), bytes([1, 2, 10])), r"labels must lie in 0..9, got 10"),
    (None, _idx(LAB, (2,), bytes([1, 2])), r"3 images in .* but 2 labels"),
    (None, _idx(bytes([0, 0, 0x0C, 1]), (3,), bytes(12)), "not an MNIST labels file"),
    (None, _idx(LAB, (10_001,), bytes(10_001)), "labels"),
    (None, b"", "not an MNIST labels file"),
])
def test_crafted_files_are_refused_naming_the_file(tmp_path, images, labels, match):
    good_images, good_labels = _good()
    root = _folder(tmp_path, images if images is not None else good_images,
                   labels if labels is not None else good_labels)
    with pytest.raises(ValueError, match=match) as info:
        D.load_mnist(root, "test", verify=False)
    assert "ubyte" in str(info.value)


def test_broken_gzip_and_oversize_raw_files(tmp_path):
    images, labels = _good()
    root = _folder(tmp_path, images, labels, gz=True)
    raw = (root / "t10k-images-idx3-ubyte.gz").read_bytes()
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(raw[: len(raw) // 2])   # truncated stream
    with pytest.raises(ValueError, match="not a readable gzip file.*t10k-images|t10k-images.*not a readable gzip"):
        D.load_mnist(root, "test", verify=False)
    (root / "t10k-images-idx3-ubyte.gz").unlink()
    with open(root / "t10k-images-idx3-ubyte", "wb") as fh:
        fh.truncate(D.IDX_MAX_BYTES + 1)                                      # sparse
    with pytest.raises(ValueError, match="more than the"):
        D.load_mnist(root, "test", verify=False)


def test_official_checksums_for_gzip_files(tmp_path):
    images, labels = _good()
    root = _folder(tmp_path, images, labels, gz=True)
    with pytest.raises(ValueError, match="not the official t10k-images-idx3-ubyte.gz.*9fb629c4189551a2d022fa330f9573f3"):
        D.load_mnist(root, "test")
    assert set(D.MNIST_MD5) == {f"{s}.gz" for pair in D.MNIST_FILES.values() for s in pair}


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match="path"):
        D.read_idx(None)
    with pytest.raises(ValueError, match="max_bytes"):
        D.read_idx(D.write_idx(tmp_path / "a.idx", np.zeros(3, np.uint8)), max_bytes=0)
    with pytest.raises(TypeError, match="verify"):
        D.load_mnist(tmp_path, "test", verify=1)
    with pytest.raises(TypeError, match="root"):
        D.load_mnist(3, "test")
    with pytest.raises(ValueError, match="dimensions"):
        D.write_idx(tmp_path / "b.idx", np.uint8(3))
