"""Bounded, checked readers of the external data sets the book can use: MNIST's IDX files.

Nothing here downloads. A data file is treated as untrusted input: it is read with a size cap fixed *before*
reading (a ``.gz`` file is decompressed as a stream and abandoned once it passes the largest size an official
file has, so a small file cannot expand into gigabytes), its header is checked against the official files'
(magic number, number of dimensions, sizes) before any array is made, the labels must be integers 0..9, and
every failure is a :class:`ValueError` naming the file. :func:`load_mnist` with ``verify=True`` (the default)
accepts only the official files: 60,000 training or 10,000 test images of 28 x 28 pixels with as many labels,
and, for the gzip files, their MD5 as torchvision lists it (:data:`MNIST_MD5`; the uncompressed files have no
published checksum, so their structure alone is checked). ``verify=False`` reads IDX files you made yourself
(fixtures, subsets) under the same structural checks.

The CIFAR-10 python batches are read by :func:`curvlab.resnet.load_cifar10` (a pickle, read as data only).
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ._validate import check_choice

__all__ = ["MNIST_ENV", "MNIST_FILES", "MNIST_IMAGES", "MNIST_MD5", "IDX_MAX_BYTES", "read_idx", "write_idx",
           "mnist_available", "load_mnist"]

MNIST_ENV = "CURVLAB_MNIST_DIR"
#: The IDX files of each split (images, labels), uncompressed or with ``.gz``.
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
#: Images (and labels) in each official split.
MNIST_IMAGES = {"train": 60_000, "test": 10_000}
#: MD5 of the official gzip files, as torchvision lists them (torchvision/datasets/mnist.py, ``resources``).
MNIST_MD5 = {"train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
             "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
             "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
             "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}
#: The largest official IDX file (training images, a 16-byte header and 60,000 x 784 pixels); the default cap of
#: :func:`read_idx` on the (decompressed) bytes it reads.
IDX_MAX_BYTES = 16 + 60_000 * 784
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_MAX_NDIM = 4
_CHUNK = 1 << 20


def _path(path) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    return Path(path)


def _read_capped(p: Path, cap: int) -> bytes:
    """The (decompressed) bytes of ``p``, refusing a file that holds more than ``cap`` of them without reading
    past ``cap + 1``."""
    if p.suffix != ".gz":
        size = p.stat().st_size
        if size > cap:
            raise ValueError(f"IDX file {str(p)!r} holds {size} bytes, more than the {cap} an official file has")
        return p.read_bytes()
    parts, total = [], 0
    try:
        with gzip.open(p, "rb") as fh:
            while total <= cap:
                chunk = fh.read(min(_CHUNK, cap + 1 - total))
                if not chunk:
                    break
                parts.append(chunk)
                total += len(chunk)
    except (OSError, EOFError, zlib.error) as exc:   # gzip.BadGzipFile is an OSError
        raise ValueError(f"IDX file {str(p)!r} is not a readable gzip file ({type(exc).__name__}: {exc})") from None
    if total > cap:
        raise ValueError(f"IDX file {str(p)!r} decompresses to more than {cap} bytes, the most an official file "
                         "holds; it was not read further")
    return b"".join(parts)


def _parse_idx(raw: bytes, p: Path) -> np.ndarray:
    where = f"IDX file {str(p)!r}"
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{where} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    if not 1 <= ndim <= _MAX_NDIM:
        raise ValueError(f"{where} declares {ndim} dimensions (1 to {_MAX_NDIM} allowed)")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise ValueError(f"{where} is truncated in its header")
    shape = struct.unpack(f">{ndim}I", raw[4:head])
    dt = np.dtype(_IDX_TYPES[raw[2]])
    count = math.prod(shape)
    if len(raw) - head != count * dt.itemsize:
        raise ValueError(f"{where}: header says {count} values of {dt.itemsize} bytes, the file holds "
                         f"{len(raw) - head} bytes of data")
    return np.frombuffer(raw, dtype=dt, offset=head).reshape(shape).astype(dt.newbyteorder("="))


def read_idx(path: str | os.PathLike, *, max_bytes: int = IDX_MAX_BYTES) -> np.ndarray:
    """Read an IDX file (the MNIST format; ``.gz`` allowed): magic ``00 00 <type> <ndim>``, big-endian uint32
    sizes, then the data in big-endian order. Returns a NumPy array of the stored dtype and shape.

    At most ``max_bytes`` (decompressed) bytes are read (default: the largest official MNIST file); a larger or
    longer-decompressing file, a header whose sizes do not match the data, and a file that is not gzip or IDX are
    :class:`ValueError` naming the file."""
    p = _path(path)
    if not p.is_file():
        raise ValueError(f"path must name an existing IDX file, got {str(path)!r}")
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 4:
        raise ValueError(f"max_bytes must be an int >= 4, got {max_bytes!r}")
    return _parse_idx(_read_capped(p, max_bytes), p)


def write_idx(path: str | os.PathLike, array) -> Path:
    """Write ``array`` as an IDX file (``.gz`` compresses); the inverse of :func:`read_idx` (tests, small fixtures)."""
    a = np.asarray(array)
    code = {np.dtype("uint8"): 0x08, np.dtype("int8"): 0x09, np.dtype("int16"): 0x0B, np.dtype("int32"): 0x0C,
            np.dtype("float32"): 0x0D, np.dtype("float64"): 0x0E}.get(a.dtype)
    if code is None:
        raise TypeError(f"array must have an IDX dtype (uint8, int8, int16, int32, float32, float64), got {a.dtype}")
    if not 1 <= a.ndim <= _MAX_NDIM:
        raise ValueError(f"array must have 1 to {_MAX_NDIM} dimensions, got {a.ndim}")
    payload = bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(
        a.dtype.newbyteorder(">")).tobytes()
    p = _path(path)
    with (gzip.open if p.suffix == ".gz" else open)(p, "wb") as fh:
        fh.write(payload)
    return p


def _mnist_root(root) -> Path | None:
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a folder path (str or os.PathLike) or None, got {type(root).__name__}")
        return Path(root)
    env = os.environ.get(MNIST_ENV)
    return Path(env) if env else None


def _find(root: Path, stem: str) -> Path | None:
    for cand in (root / stem, root / f"{stem}.gz", root / "MNIST" / "raw" / stem, root / "MNIST" / "raw" / f"{stem}.gz"):
        if cand.is_file():
            return cand
    return None


def mnist_available(root: str | os.PathLike | None = None) -> bool:
    """True when the four MNIST IDX files are under ``root`` (default ``$CURVLAB_MNIST_DIR``; the torchvision layout
    ``MNIST/raw/`` is also searched)."""
    r = _mnist_root(root)
    return r is not None and all(_find(r, s) is not None for pair in MNIST_FILES.values() for s in pair)


def _md5(p: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _mnist_file(p: Path, kind: str, split: str, verify: bool) -> np.ndarray:
    """One MNIST file checked against the official layout before its data is read into an array."""
    full = MNIST_IMAGES[split]
    pixels = 784 if kind == "images" else 1
    magic = bytes([0, 0, 0x08, 3 if kind == "images" else 1])
    if verify and p.suffix == ".gz":
        digest = _md5(p)
        if digest != MNIST_MD5.get(p.name):
            raise ValueError(f"MNIST file {str(p)!r} is not the official {p.name} (md5 {digest}, expected "
                             f"{MNIST_MD5.get(p.name)}); pass verify=False to read files you made yourself")
    raw = _read_capped(p, len(magic) + 4 * magic[3] + full * pixels)
    if raw[:4] != magic:
        raise ValueError(f"MNIST file {str(p)!r} is not an MNIST {kind} file: magic number {raw[:4].hex()}, "
                         f"expected {magic.hex()} (uint8, {magic[3]} dimensions)")
    array = _parse_idx(raw, p)
    n = array.shape[0]
    if kind == "images" and array.shape[1:] != (28, 28):
        raise ValueError(f"MNIST file {str(p)!r}: images of {array.shape[1:]} pixels, expected (28, 28)")
    if (verify and n != full) or not 1 <= n <= full:
        raise ValueError(f"MNIST file {str(p)!r} holds {n} {kind}; the official {split} split has {full}"
                         + ("" if verify else f" (at most {full} without verify)"))
    if kind == "labels" and int(array.max()) > 9:
        raise ValueError(f"MNIST file {str(p)!r}: labels must lie in 0..9, got {int(array.max())}")
    return array


def load_mnist(root: str | os.PathLike | None = None, split: str = "train", *, verify: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 28, 28) uint8, labels (N,) uint8)`` of an MNIST split read from IDX files (no download), under
    ``root`` (default ``$CURVLAB_MNIST_DIR``) or its ``MNIST/raw/`` folder, ``.gz`` or not.

    ``verify=True``: the official files only (N = 60,000 or 10,000; the MD5 of a ``.gz`` file); ``verify=False``:
    any N up to the official one. Always: the uint8 image/label magic numbers, 28 x 28 images, as many labels as
    images, labels 0..9, a size cap on what is read and decompressed; every failure names the file."""
    split = check_choice("split", split, tuple(MNIST_FILES))
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got {type(verify).__name__}")
    r = _mnist_root(root)
    if r is None:
        raise ValueError(f"root must name the MNIST folder (or set ${MNIST_ENV})")
    paths = [_find(r, s) for s in MNIST_FILES[split]]
    if any(p is None for p in paths):
        raise ValueError(f"root {str(r)!r} does not hold the MNIST {split} IDX files {MNIST_FILES[split]}")
    images = _mnist_file(paths[0], "images", split, verify)
    labels = _mnist_file(paths[1], "labels", split, verify)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"MNIST {split}: {images.shape[0]} images in {str(paths[0])!r} but {labels.shape[0]} labels "
                         f"in {str(paths[1])!r}")
    return images, labels
