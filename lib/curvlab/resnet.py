r"""Paper 3's pruning experiment at the paper's size: ResNet-20 on a CIFAR-10 subset (Part III, paper-profile grid).

Source: Zhao, Singh & Lucchi (2024), *Theoretical characterisation of the Gauss–Newton conditioning in neural
networks*: ResNet-20 trained on about 1000 CIFAR-10 images, pruned layer-wise by magnitude at initialisation
(0/20/40/60/80 %); the paper reports a larger :math:`\kappa(\GN)` and slower training with more pruning. The book's
chapter runs a small residual CNN on digits (:class:`curvlab.conv.ResidualCNN`); this module keeps the paper-sized
version as a ``paper``-profile grid (:func:`pruned_resnet_cell`, with its cost model :func:`pruned_resnet_flops`).

**The network** (:class:`ResNet20`) is the CIFAR ResNet of He et al. (2016, section 4.2): a 3x3 stem, three stages
of three basic blocks with ``width``, ``2 width``, ``4 width`` channels (16/32/64 by default; the first block of
stages 2 and 3 halves the side with stride 2), option-A shortcuts (identity; where the side halves and the channels
double, the input subsampled with stride 2 and zero-padded in channels: no parameters), global average pooling and
a linear head to 10 classes; :math:`6\cdot 3 + 2 = 20` layers with weights, 269,722 parameters at ``width = 16``.

**The data** are read from the official python batches of CIFAR-10 (:func:`load_cifar10`; never downloaded) or, so
that the ``quick``/``standard`` profiles and the tests run offline, scikit-learn's digits upsampled to 16x16 and
repeated over three channels (:func:`digits_subset`); both normalised per channel.

**The curvature.** With squared loss :math:`\frac1{2n}\lVert f_\theta(X) - Y\rVert^2` on one-hot targets,
:math:`\GN = J^\top J/n` over the *kept* weights; its nonzero spectrum is that of the ``n d_y x n d_y`` Gram
:math:`JJ^\top/n` (:func:`jacobian_gram`), which is built from per-sample Jacobians in blocks of samples so that
memory stays bounded (at the paper's size :math:`J` is :math:`10^4\times 2.7\cdot 10^5`, 21.6 GB in float64).
:math:`\kappa` is taken at the numerical rank with the gap at the cut (:func:`curvlab.curvature.condition_number`),
as :func:`curvlab.conv.gram_condition` does for the small network.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from . import config
from ._validate import check_choice, check_int, check_int_sequence

__all__ = [
    "CIFAR10_ENV",
    "CIFAR10_URL",
    "GRAM_BYTES",
    "ResNet20",
    "cifar10_available",
    "load_cifar10",
    "CIFAR10_MD5",
    "cifar10_subset",
    "digits_subset",
    "magnitude_masks",
    "jacobian_gram",
    "gram_condition",
    "forward_flops",
    "pruned_resnet_cell",
    "pruned_resnet_flops",
]

#: Environment variable naming the folder that holds ``cifar-10-batches-py`` (or that folder itself).
CIFAR10_ENV = "CURVLAB_CIFAR10_DIR"
#: Where the python version of CIFAR-10 is published (unpack it; curvlab never downloads).
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

DATASETS = ("cifar10", "digits")
NORMS = ("calibrated", "default", "none")
#: The memory budget of :func:`jacobian_gram`'s per-sample Jacobian blocks when none is given (2 GiB).
GRAM_BYTES = 2**31


# ============================================================================================ the network
def _shortcut_a(x: torch.Tensor, c_out: int, stride: int) -> torch.Tensor:
    """Option A: identity, or the input subsampled by ``stride`` and zero-padded to ``c_out`` channels."""
    if stride > 1:
        x = x[:, :, ::stride, ::stride]
    extra = c_out - x.shape[1]
    if extra:
        lo = extra // 2
        x = nn.functional.pad(x, (0, 0, 0, 0, lo, extra - lo))
    return x


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        bn = (lambda c: nn.BatchNorm2d(c)) if norm == "eval" else (lambda c: nn.Identity())
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = bn(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = bn(c_out)
        self.c_out, self.stride = c_out, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.bn1(self.conv1(x)))
        z = self.bn2(self.conv2(z))
        return torch.relu(z + _shortcut_a(x, self.c_out, self.stride))


class ResNet20(nn.Module):
    r"""The CIFAR ResNet-20 of He et al. (2016): 3x3 stem, 3 stages x 3 basic blocks (``width``, ``2 width``,
    ``4 width`` channels), option-A shortcuts, global average pooling, linear head (with bias) to ``num_classes``.
    Convolutions have no bias. 269,722 parameters at ``width = 16`` (268,346 without batch norm).

    **Batch norm** (``norm``): ``"eval"`` (default) keeps the original's ``BatchNorm2d`` layers but always in
    **eval mode**: each is the fixed per-channel affine map :math:`z\mapsto\gamma(z-\mu)/\sqrt{v+10^{-5}}+\beta`
    with trainable :math:`\gamma` (init 1), :math:`\beta` (init 0) and frozen statistics :math:`\mu, v` — torch's
    defaults (0 and 1: at initialisation the network is then the BN-free one up to the factor
    :math:`1/\sqrt{1+10^{-5}}` per layer) or, after :meth:`calibrate`, the batch statistics of a data set
    (the train-mode network on that batch, frozen); ``"none"`` drops the layers. Why not train mode: a train-mode
    batch norm normalises each sample by statistics of the whole batch, so :math:`f_\theta(x_i)` depends on the
    other samples and the Gauss–Newton matrix is that of a coupled function which changes with the batch (see
    :mod:`curvlab.model`); in eval mode :math:`f_\theta(x_i)` depends on :math:`x_i` alone, the GN matrix is the
    per-sample one the book defines, and the network keeps the paper's layers and parameter count (the
    :math:`\gamma, \beta` columns of :math:`J` included). Without statistics (defaults or ``"none"``) the
    residual sums are not normalised: at width 16 on the digits of :func:`digits_subset` (two seeds) the logits
    start about 8 times larger than with calibrated statistics and :math:`\lambda_{\max}(\GN)` 100 to 200 times
    larger; :func:`pruned_resnet_cell`
    therefore calibrates on its training images after pruning, as the first train-mode forward pass of the
    paper's network would normalise them. The module is put in eval mode when built; calling ``.train()`` would
    switch batch norm to batch statistics (and update the running ones), which the functions of this module never
    do outside :meth:`calibrate`.

    Weights: Kaiming-normal (fan-in, ReLU gain) for convolutions and the head, as the common CIFAR ResNet code does;
    head bias 0; drawn from ``torch.Generator().manual_seed(seed)`` on the CPU when ``seed`` is given (else from
    torch's global generator), then moved to ``device``/``dtype`` (default float64 on the CPU).
    Input: images ``(n, in_channels, h, h)`` or flattened ``(n, in_channels h h)`` (square images)."""

    def __init__(self, width: int = 16, num_classes: int = 10, in_channels: int = 3, *, norm: str = "eval",
                 seed: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float64):
        super().__init__()
        width = check_int("width", width, min_value=1)
        num_classes = check_int("num_classes", num_classes, min_value=1)
        self.in_channels = check_int("in_channels", in_channels, min_value=1)
        self.norm = check_choice("norm", norm, ("eval", "none"))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.is_complex:
            raise TypeError(f"dtype must be a real floating torch.dtype (e.g. torch.float64), got {dtype!r}")
        dev = _check_device(device)
        self.width = width
        self.stem = nn.Conv2d(self.in_channels, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width) if self.norm == "eval" else nn.Identity()
        blocks, c = [], width
        for stage in range(3):
            c_out = width * 2**stage
            for b in range(3):
                blocks.append(_BasicBlock(c, c_out, 2 if (stage > 0 and b == 0) else 1, self.norm))
                c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)
        gen = None if seed is None else torch.Generator().manual_seed(check_int("seed", seed, min_value=0))
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=gen)
                    if m.bias is not None:
                        m.bias.zero_()
        self.to(device=dev, dtype=dtype)
        self.eval()

    def calibrate(self, X: torch.Tensor) -> ResNet20:
        """Set every batch norm's frozen statistics to the batch statistics of images ``X`` (one pass in train mode,
        cumulative average; the variance unbiased, as torch stores it), then return to eval mode. Returns the
        module. A no-op for ``norm="none"``."""
        X = _check_images(self, X)
        bns = [m for m in self.modules() if isinstance(m, nn.BatchNorm2d)]
        if not bns:
            return self
        momenta = [m.momentum for m in bns]
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        try:
            self.train()
            with torch.no_grad():
                self(X)
        finally:
            for m, mo in zip(bns, momenta):
                m.momentum = mo
            self.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, num_classes)`` of images ``x`` (``(n, C, h, h)`` or flattened ``(n, C h h)``)."""
        if x.dim() == 2:
            side = math.isqrt(x.shape[1] // self.in_channels)
            if self.in_channels * side * side != x.shape[1]:
                raise ValueError(f"x must hold flattened square images of {self.in_channels} channels, "
                                 f"got {x.shape[1]} values per row")
            x = x.reshape(x.shape[0], self.in_channels, side, side)
        z = torch.relu(self.bn(self.stem(x)))
        z = self.blocks(z)
        return self.head(z.mean(dim=(-2, -1)))


def _check_device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a torch.device or a string such as 'cpu' or 'cuda', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but CUDA is not available")
    return dev


def forward_flops(width: int = 16, image: int = 32, in_channels: int = 3, num_classes: int = 10) -> float:
    """Floating-point operations of one :class:`ResNet20` forward pass on one image (``image x image``): two per
    multiply-add of the convolutions and the head, plus 8 per activation entry (batch norm, ReLU, shortcut, pooling;
    an upper bound). About 8.2e7 at ``width = 16`` on 32x32 images."""
    width = check_int("width", width, min_value=1)
    h = check_int("image", image, min_value=1)
    c_in = check_int("in_channels", in_channels, min_value=1)
    num_classes = check_int("num_classes", num_classes, min_value=1)
    macs = h * h * width * c_in * 9
    acts = h * h * width
    c = width
    for stage in range(3):
        c_out = width * 2**stage
        for b in range(3):
            if stage > 0 and b == 0:
                h = (h + 1) // 2
            macs += h * h * c_out * c * 9 + h * h * c_out * c_out * 9
            acts += 2 * h * h * c_out
            c = c_out
    macs += c * num_classes
    return float(2 * macs + 8 * acts)


# ============================================================================================ data: CIFAR-10 batches
_CIFAR_FILES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}


def _check_root(root) -> Path | None:
    if root is None:
        env = os.environ.get(CIFAR10_ENV)
        return Path(env) if env else None
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a folder path (str or os.PathLike) or None, got {type(root).__name__}")
    return Path(root)


def _cifar10_dir(root) -> Path | None:
    """The folder holding the batch files: ``root`` itself or ``root/cifar-10-batches-py`` (None if neither)."""
    r = _check_root(root)
    if r is None:
        return None
    for cand in (r / "cifar-10-batches-py", r):
        if (cand / "data_batch_1").is_file() or (cand / "test_batch").is_file():
            return cand
    return None


def cifar10_available(root: str | os.PathLike | None = None) -> bool:
    """True when the six CIFAR-10 python batches (``data_batch_1`` .. ``data_batch_5``, ``test_batch``) are under
    ``root`` (default ``$CURVLAB_CIFAR10_DIR``), either directly or in its ``cifar-10-batches-py`` folder."""
    d = _cifar10_dir(root)
    return d is not None and all((d / f).is_file() for files in _CIFAR_FILES.values() for f in files)


#: MD5 of the official python batches (cifar-10-python.tar.gz), as torchvision lists them
#: (torchvision/datasets/cifar.py, ``train_list`` and ``test_list``).
CIFAR10_MD5 = {"data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
               "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
               "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e"}
#: Images in each official batch, and the bytes of one image (3 x 32 x 32, uint8).
CIFAR10_BATCH_IMAGES, _IMAGE_BYTES = 10_000, 3072
#: No batch file is read past this size (an official batch is about 31 MB, 30.72 MB of pixels, labels, names).
_CIFAR_MAX_FILE = 32 * 2 ** 20
_INT_DTYPES = {"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8"}


class _Refused(pickle.UnpicklingError):
    pass


class _Ndarray:
    """What the name ``numpy.ndarray`` stands for in a batch: an argument of ``_reconstruct``, never called (a
    pickle that calls it directly would get uninitialised memory of any size it declares)."""

    def __call__(self, *args, **kwargs):
        raise _Refused("numpy.ndarray may not be called directly in a CIFAR-10 batch (uninitialised memory)")


_NDARRAY = _Ndarray()


class _Dtype:
    """A plain numeric dtype named in a batch (``numpy.dtype('u1', 0, 1)`` and its state), nothing else."""

    def __init__(self, name, align=False, copy=True):
        name = name.decode("latin1") if isinstance(name, bytes) else name
        if not isinstance(name, str) or name not in _INT_DTYPES:
            raise _Refused(f"dtype {name!r} is not allowed in a CIFAR-10 batch")
        self.dtype = np.dtype(name)

    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) >= 2 and state[1] in ("|", "<", ">", b"|", b"<", b">")
                and all(s in (None, -1, 0) for s in state[2:])):
            raise _Refused(f"dtype state {state!r:.80} is not a plain numeric dtype's")
        order = state[1].decode() if isinstance(state[1], bytes) else state[1]
        self.dtype = self.dtype.newbyteorder("=" if order == "|" else order)


def _check_shape(shape, dtype: np.dtype, nbytes: int) -> tuple[int, ...]:
    if (not isinstance(shape, tuple) or not 1 <= len(shape) <= 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s for s in shape)):
        raise _Refused(f"array shape {shape!r:.80} is not one or two sizes")
    count = math.prod(shape)
    if count > CIFAR10_BATCH_IMAGES * _IMAGE_BYTES or count * dtype.itemsize != nbytes:
        raise _Refused(f"array declares shape {shape} of {dtype} ({count * dtype.itemsize} bytes) but holds "
                       f"{nbytes} bytes of data")
    return shape


class _Array:
    """An array rebuilt from a batch: made empty by ``_reconstruct(ndarray, (0,), b'b')``, then filled by its state
    ``(version, shape, dtype, fortran, raw bytes)``, whose size must match its shape (nothing is allocated from
    what a header merely declares)."""

    array = None

    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], _Dtype)
                and state[3] in (False, 0)):
            raise _Refused("array state is not (version, shape, numeric dtype, C order, data)")
        raw = state[4]
        raw = raw.encode("latin1") if isinstance(raw, str) else raw
        if not isinstance(raw, (bytes, bytearray)):
            raise _Refused(f"array data must be bytes, got {type(raw).__name__}")
        dtype = state[2].dtype
        shape = _check_shape(state[1], dtype, len(raw))
        self.array = np.frombuffer(bytes(raw), dtype=dtype).reshape(shape).copy()


def _reconstruct(cls, shape, typecode):
    if cls is not _NDARRAY or shape != (0,) or typecode not in (b"b", "b"):
        raise _Refused("numpy's _reconstruct may only make an empty ndarray to be filled from data")
    return _Array()


def _frombuffer(buf, dtype, shape, order):
    if not isinstance(dtype, _Dtype) or not isinstance(buf, (bytes, bytearray)) or order not in ("C", b"C"):
        raise _Refused("numpy's _frombuffer needs bytes, a numeric dtype and C order")
    return np.frombuffer(bytes(buf), dtype=dtype.dtype).reshape(_check_shape(shape, dtype.dtype, len(buf))).copy()


def _scalar(dtype, raw):
    if not isinstance(dtype, _Dtype) or dtype.dtype.kind not in "iu" or not isinstance(raw, (bytes, str)):
        raise _Refused("numpy scalars in a CIFAR-10 batch must be integers")
    raw = raw.encode("latin1") if isinstance(raw, str) else raw
    if len(raw) != dtype.dtype.itemsize:
        raise _Refused("integer scalar of the wrong size")
    return int(np.frombuffer(raw, dtype=dtype.dtype)[0])


def _encode(text, encoding="utf-8"):
    if not isinstance(text, str) or encoding != "latin1":
        raise _Refused("_codecs.encode may only turn latin-1 text into bytes")
    return text.encode("latin1")


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 batch and nothing else: a dict of bytes/str keys, lists, ints and NumPy arrays of plain
    numeric dtypes rebuilt from the data in the file. Every global a pickle names is replaced by a checking
    stand-in (``numpy.ndarray`` may not be called; ``_reconstruct`` only makes an empty array whose state must
    carry exactly the bytes its shape needs; ``dtype`` only names plain numeric types); any other global is
    refused, so no code runs and no memory is allocated that the file does not hold."""

    _STANDINS = {**{(m, "_reconstruct"): _reconstruct for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
                 **{(m, "scalar"): _scalar for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
                 **{(m, "_frombuffer"): _frombuffer for m in ("numpy.core.numeric", "numpy._core.numeric")},
                 ("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _Dtype, ("_codecs", "encode"): _encode}

    def find_class(self, module: str, name: str):
        if (module, name) in self._STANDINS:
            return self._STANDINS[(module, name)]
        raise _Refused(f"global {module}.{name} is not allowed in a CIFAR-10 batch")


def _resolve(value):
    if isinstance(value, _Array):
        if value.array is None:
            raise _Refused("an array without its data")
        return value.array
    if isinstance(value, (_Dtype, _Ndarray)):
        raise _Refused("a bare dtype or ndarray class where data was expected")
    return value


def _read_batch(path: Path, *, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: ``(images (N, 3, 32, 32) uint8, labels (N,) uint8)``, every failure a ValueError naming it."""
    where = f"root holds a corrupt CIFAR-10 batch {str(path)!r}"
    size = path.stat().st_size
    if size > _CIFAR_MAX_FILE:
        raise ValueError(f"{where}: {size} bytes, more than any official batch (about 31 MB)")
    raw = path.read_bytes()
    if verify:
        digest = hashlib.md5(raw, usedforsecurity=False).hexdigest()
        if digest != CIFAR10_MD5.get(path.name):
            raise ValueError(f"{where}: not the official file (md5 {digest}, expected {CIFAR10_MD5.get(path.name)} "
                             "from the python version of CIFAR-10); pass verify=False to read a batch you made "
                             "yourself (its layout is still checked)")
    try:
        obj = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
        if not isinstance(obj, dict):
            raise _Refused(f"expected a dict, got {type(obj).__name__}")
        obj = {k: _resolve(v) for k, v in obj.items()}
    except _Refused as exc:
        raise ValueError(f"{where}: {exc}") from None
    except (Exception, MemoryError, RecursionError) as exc:  # noqa: BLE001 - any failure of a hostile file
        raise ValueError(f"{where} (not a python batch pickle: {type(exc).__name__}: {exc})") from None
    get = lambda k: obj.get(k.encode(), obj.get(k))  # noqa: E731 - python-2 batches have bytes keys
    data, labels = get("data"), get("labels")
    if data is None or labels is None:
        raise ValueError(f"{where}: keys b'data' and b'labels' expected, got {sorted(map(str, obj))}")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _IMAGE_BYTES:
        raise ValueError(f"{where}: data must be uint8 of shape (N, 3072), got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    n = data.shape[0]
    if verify and n != CIFAR10_BATCH_IMAGES or not 1 <= n <= CIFAR10_BATCH_IMAGES:
        raise ValueError(f"{where}: {n} images, an official batch holds {CIFAR10_BATCH_IMAGES}")
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise ValueError(f"{where}: labels must be integers 0..9, got an array of {labels.dtype}")
        labels = labels.tolist()
    if not isinstance(labels, list) or not all(type(v) is int for v in labels):
        bad = next((v for v in labels if type(v) is not int), labels) if isinstance(labels, list) else labels
        raise ValueError(f"{where}: labels must be a list of integers 0..9, got a {type(bad).__name__} ({bad!r:.40})")
    if len(labels) != n or any(not 0 <= v <= 9 for v in labels):
        raise ValueError(f"{where}: {n} labels in 0..9 expected for {n} images, got {len(labels)} labels in "
                         f"{min(labels, default=0)}..{max(labels, default=0)}")
    return data.reshape(-1, 3, 32, 32), np.asarray(labels, dtype=np.uint8)


def load_cifar10(root: str | os.PathLike | None = None, split: str = "train", *, verify: bool = True
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 3, 32, 32) uint8, labels (N,) uint8)`` of a CIFAR-10 split read from the official python
    batches (``train``: ``data_batch_1`` .. ``data_batch_5`` in order, 50,000 images; ``test``: ``test_batch``,
    10,000), each a pickled dict with ``b"data"`` (``N x 3072`` uint8, channel-major: 1024 red, 1024 green,
    1024 blue values, rows top to bottom) and ``b"labels"``. ``root`` (default ``$CURVLAB_CIFAR10_DIR``) is the
    folder holding ``cifar-10-batches-py`` or that folder itself. Nothing is downloaded.

    A batch is a pickle, read as data only: no global but NumPy's array reconstruction is honoured, and that only
    through checking stand-ins (``numpy.ndarray`` is never called, an array must carry the bytes its shape
    declares, dtypes are plain numbers), files larger than 32 MiB are not read. With ``verify`` (default) each
    file must be the official one: its MD5 as torchvision lists it (:data:`CIFAR10_MD5`) and 10,000 images;
    ``verify=False`` reads batches you made yourself (1 to 10,000 images). Either way the data must be uint8 of
    shape ``(N, 3072)`` and the labels a list of ``N`` integers in 0..9. Every failure is a :class:`ValueError`
    naming the file."""
    split = check_choice("split", split, tuple(_CIFAR_FILES))
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got {type(verify).__name__}")
    r = _check_root(root)
    if r is None:
        raise ValueError(f"root must name the CIFAR-10 folder (or set ${CIFAR10_ENV}); download the python "
                         f"version from {CIFAR10_URL} and unpack it there (curvlab never downloads)")
    d = _cifar10_dir(r)
    missing = [f for f in _CIFAR_FILES[split] if d is None or not (d / f).is_file()]
    if missing:
        raise ValueError(f"root {str(r)!r} does not hold the CIFAR-10 {split} batches {missing} (directly or in "
                         f"cifar-10-batches-py/; set ${CIFAR10_ENV} or pass root; the python version is at "
                         f"{CIFAR10_URL})")
    parts = [_read_batch(d / f, verify=verify) for f in _CIFAR_FILES[split]]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _check_float_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"dtype must be a real floating torch.dtype (e.g. torch.float64), got {dtype!r}")
    return dtype


def _normalise(X: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    """Float tensor with each channel at mean 0 and standard deviation 1 over the subset (a constant channel: 1)."""
    t = torch.as_tensor(X, dtype=torch.float64)
    mean = t.mean(dim=(0, 2, 3), keepdim=True)
    std = t.std(dim=(0, 2, 3), keepdim=True, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return ((t - mean) / std).to(dtype=dtype, device=device)


def _subset_index(total: int, n: int, seed: int) -> np.ndarray:
    if n > total:
        raise ValueError(f"n must be <= {total} images, got {n}")
    return np.random.default_rng(seed).permutation(total)[:n]


def cifar10_subset(n: int, seed: int, *, root: str | os.PathLike | None = None, split: str = "train",
                   dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
                   verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` CIFAR-10 images of ``split`` drawn without replacement by ``numpy.random.default_rng(seed)``, as
    ``(X (n, 3, 32, 32) float, labels (n,) int64)``; pixels scaled to :math:`[0, 1]`, then each channel normalised
    to mean 0 and standard deviation 1 over the subset (the paper's ~1000-image subset: its statistics are within
    a few per cent of the full training set's). ``verify``: as for :func:`load_cifar10`."""
    n = check_int("n", n, min_value=1)
    seed = check_int("seed", seed, min_value=0)
    dtype = _check_float_dtype(dtype)
    dev = _check_device(device)
    images, labels = load_cifar10(root, split, verify=verify)
    idx = _subset_index(len(labels), n, seed)
    return _normalise(images[idx] / 255.0, dtype, dev), torch.as_tensor(labels[idx].astype(np.int64), device=dev)


def digits_subset(n: int, seed: int, *, side: int = 16, dtype: torch.dtype = torch.float64,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The offline stand-in for :func:`cifar10_subset`: ``n`` of scikit-learn's 1797 8x8 digits drawn by
    ``numpy.random.default_rng(seed)``, scaled to :math:`[0, 1]`, upsampled to ``side x side`` (nearest
    neighbour; ``side`` a multiple of 8), repeated over 3 channels and normalised per channel like CIFAR-10:
    ``(X (n, 3, side, side), labels (n,) int64)``."""
    n = check_int("n", n, min_value=1)
    seed = check_int("seed", seed, min_value=0)
    side = check_int("side", side, min_value=8)
    if side % 8:
        raise ValueError(f"side must be a multiple of 8 (the digits are 8x8), got {side}")
    dtype = _check_float_dtype(dtype)
    dev = _check_device(device)
    from ._validate import _require

    load_digits = _require("sklearn.datasets", purpose="the digits data (resnet.digits_subset)").load_digits
    X, y = load_digits(return_X_y=True)
    idx = _subset_index(len(y), n, seed)
    k = side // 8
    img = (X[idx] / 16.0).reshape(n, 1, 8, 8).repeat(k, axis=2).repeat(k, axis=3)
    return _normalise(np.repeat(img, 3, axis=1), dtype, dev), torch.as_tensor(y[idx].astype(np.int64), device=dev)


# ============================================================================================ pruning and curvature
def _check_net(net) -> nn.Module:
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module (e.g. resnet.ResNet20()), got {type(net).__name__}")
    return net


def _check_rate(rate) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise TypeError(f"rate must be a pruning fraction in [0, 1) (a number), got {type(rate).__name__}")
    rate = float(rate)
    if not math.isfinite(rate) or not 0 <= rate < 1:
        raise ValueError(f"rate must be a pruning fraction in [0, 1), got {rate!r}")
    return rate


def magnitude_masks(net, rate: float) -> dict[str, torch.Tensor]:
    r"""Layer-wise magnitude pruning at initialisation of the *weight* tensors (convolutions and the head: the
    parameters with two or more dimensions), by :func:`curvlab.conv.magnitude_masks_net`'s rule (keep the
    :math:`\lceil(1-\mathrm{rate})\,n_l\rceil` largest magnitudes of each layer); biases and batch-norm
    :math:`\gamma, \beta` are kept whole (mask 1), as weight pruning does. Returns ``{name: 0/1 mask}``."""
    from .conv import magnitude_masks_net

    net = _check_net(net)
    rate = _check_rate(rate)
    masks = magnitude_masks_net(net, rate)
    for k, p in net.named_parameters():
        if p.dim() < 2:
            masks[k] = torch.ones_like(p.detach())
    return masks


def _check_masks(net, masks) -> dict[str, torch.Tensor]:
    from .conv import _check_masks as check

    return check(net, masks)


def _check_images(net, X) -> torch.Tensor:
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"X must be a tensor of images (n, C, h, h) or flattened (n, C h h), got {type(X).__name__}")
    if X.dim() not in (2, 4) or X.shape[0] < 1 or not X.is_floating_point():
        raise ValueError(f"X must be a float tensor of images (n, C, h, h) or flattened (n, C h h), got "
                         f"{X.dtype} {tuple(X.shape)}")
    if not bool(torch.isfinite(X).all()):
        raise ValueError("X contains non-finite values (NaN or inf)")
    p = next(iter(net.parameters()), None)
    return X if p is None else X.to(device=p.device, dtype=p.dtype)


def _block_size(n: int, d_y: int, p: int, max_bytes: int | None, chunk: int | None) -> int:
    if chunk is not None:
        return min(n, check_int("chunk", chunk, min_value=1))
    budget = GRAM_BYTES if max_bytes is None else check_int("max_bytes", max_bytes, min_value=1)
    # two Jacobian blocks of b d_y x p live at once, plus the vmapped backward's intermediates: about 3 blocks
    per_sample = 3 * 8 * d_y * p
    return max(1, min(n, budget // per_sample))


def _gram(net: nn.Module, params: dict, masks: dict, X: torch.Tensor, b: int) -> torch.Tensor:
    """``J M Jᵀ / n`` from per-sample Jacobians in blocks of ``b`` samples (rows sample-major: i d_y + k)."""
    from torch.func import functional_call, jacrev, vmap

    buffers = dict(net.named_buffers())
    names = list(params)

    def one(ps: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, (ps, buffers), (x.unsqueeze(0),))[0]

    per_sample = vmap(jacrev(one), in_dims=(None, 0))

    def block(lo: int, hi: int) -> torch.Tensor:
        jd = per_sample(params, X[lo:hi])
        rows = (hi - lo) * jd[names[0]].shape[1]
        return torch.cat([(jd[k] * masks[k]).reshape(rows, -1) for k in names], dim=1)

    n = X.shape[0]
    cuts = list(range(0, n, b)) + [n]
    spans = list(zip(cuts[:-1], cuts[1:]))
    K = None
    for a, (lo, hi) in enumerate(spans):
        Ja = block(lo, hi)
        if K is None:
            d_y = Ja.shape[0] // (hi - lo)
            K = torch.zeros(n * d_y, n * d_y, dtype=Ja.dtype, device=Ja.device)
        K[lo * d_y:hi * d_y, lo * d_y:hi * d_y] = Ja @ Ja.T
        for lo2, hi2 in spans[a + 1:]:
            Jb = block(lo2, hi2)                  # recomputed, not stored: memory stays about two blocks
            Kab = Ja @ Jb.T
            K[lo * d_y:hi * d_y, lo2 * d_y:hi2 * d_y] = Kab
            K[lo2 * d_y:hi2 * d_y, lo * d_y:hi * d_y] = Kab.T
    return K / n


def jacobian_gram(net, masks, X, *, max_bytes: int | None = None, chunk: int | None = None) -> torch.Tensor:
    r"""The ``n d_y x n d_y`` Jacobian Gram :math:`JJ^\top/n` of the pruned ``net`` (its weights times
    ``masks``, from :func:`magnitude_masks`) on images ``X`` over the kept weights (the pruned columns of :math:`J`
    are zeroed; ``net`` itself is not changed), rows sample-major
    (row :math:`i d_y + k` is output :math:`k` of sample :math:`i`, as ``net(X).reshape(-1)``); the same nonzero
    eigenvalues as :math:`\GN = J^\top J/n`. Needs :math:`f_\theta(x_i)` to depend on :math:`x_i` alone (batch
    norm in eval mode, as :class:`ResNet20` builds it).

    Per-sample Jacobians (``vmap`` over samples of ``jacrev``, :math:`d_y` VJPs each) are formed for blocks of
    ``chunk`` samples (default: as many as keep about three ``chunk d_y x p`` blocks within ``max_bytes``, default
    :data:`GRAM_BYTES`), and :math:`K` is accumulated blockwise, block pair by block pair, recomputing the second
    block of each pair: memory :math:`O(\mathrm{chunk}\,d_y p + (nd_y)^2)` instead of :math:`O(nd_yp)`, at the
    price of about :math:`(B+1)/2` times the Jacobian work for :math:`B` blocks. Float64 for spectral work
    (:func:`curvlab.config.spectral`: the net's parameters are converted, the CPU on MPS)."""
    net = _check_net(net)
    masks = _check_masks(net, masks)
    if not any(True for _ in net.parameters()):
        raise ValueError("net must have parameters")
    if any(m.training for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        raise ValueError("net has a batch norm in train mode: its outputs couple the samples of a batch; call "
                         "net.eval() (or ResNet20.calibrate) first")
    net64 = _as_spectral(net)
    dev = next(net64.parameters()).device
    ms = {k: m.to(device=dev, dtype=torch.float64) for k, m in masks.items()}
    params = {k: p.detach() * ms[k] for k, p in net64.named_parameters()}
    X = config.spectral(_check_images(net, X)).to(dev)
    with torch.no_grad():
        d_y = int(net64(X[:1]).reshape(1, -1).shape[1])
    b = _block_size(X.shape[0], d_y, sum(p.numel() for p in params.values()), max_bytes, chunk)
    return _gram(net64, params, ms, X, b)


def _as_spectral(net: nn.Module) -> nn.Module:
    """``net`` itself when its parameters and float buffers are float64 on the spectral device, else a float64
    copy there (the module itself is never changed)."""
    import copy

    tensors = [t for t in (*net.parameters(), *net.buffers()) if t.is_floating_point()]
    if all(t.dtype == torch.float64 and t.device == config.spectral_device(t.device) for t in tensors):
        return net
    dev = config.spectral_device(next(net.parameters()).device)
    return copy.deepcopy(net).to(device=dev, dtype=torch.float64)


def gram_condition(net, masks, X, *, max_bytes: int | None = None, chunk: int | None = None):
    r""":math:`\kappa(\GN)` over the nonzero spectrum from :func:`jacobian_gram`, at the numerical rank with the gap
    at the cut (:func:`curvlab.curvature.condition_number`; a :class:`curvlab.curvature.ConditionNumber`)."""
    from .curvature import condition_number

    return condition_number(jacobian_gram(net, masks, X, max_bytes=max_bytes, chunk=chunk))


def _layer_sigma_min(params: dict, masks: dict) -> float:
    """Smallest singular value over the pruned weight layers (each ``(c_out, c_in, s, s)`` as ``c_out x c_in s²``)."""
    vals = [float(torch.linalg.svdvals((p * masks[k]).reshape(p.shape[0], -1))[-1])
            for k, p in params.items() if p.dim() >= 2]
    return min(vals)


# ============================================================================================ the paper grid cell
def _check_cell(rate, n, seeds, steps, every, width, dataset, lr) -> tuple:
    rate = _check_rate(rate)
    n = check_int("n", n, min_value=1)
    seeds = check_int_sequence("seeds", seeds, min_value=0)
    if not seeds:
        raise ValueError("seeds must hold at least one seed, got an empty list")
    steps = check_int("steps", steps, min_value=0)
    every = check_int("every", every, min_value=1)
    width = check_int("width", width, min_value=1)
    dataset = check_choice("dataset", dataset, DATASETS)
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.integer, np.floating)):
        raise TypeError(f"lr must be a positive step size (a number), got {type(lr).__name__}")
    lr = float(lr)
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite positive step size, got {lr!r}")
    if dataset == "digits" and n > 1797:
        raise ValueError(f"n must be <= 1797 for dataset 'digits' (scikit-learn's digits), got {n}")
    if dataset == "cifar10" and n > 50_000:
        raise ValueError(f"n must be <= 50000 for dataset 'cifar10' (the training split), got {n}")
    return rate, n, seeds, steps, every, width, dataset, lr


def _checkpoints(steps: int, every: int) -> list[int]:
    ts = list(range(0, steps + 1, every))
    return ts if ts[-1] == steps else ts + [steps]


def pruned_resnet_cell(rate: float, n: int, seeds: list, steps: int, every: int, width: int, dataset: str,
                       lr: float, norm: str = "calibrated") -> pd.DataFrame:
    r"""One cell of the paper's pruning grid: for each seed, a :class:`ResNet20` of base ``width`` (seeded init)
    pruned at initialisation by :func:`magnitude_masks` at ``rate`` — with batch norm in eval mode, its statistics
    then set by :meth:`ResNet20.calibrate` on the training images (``norm="calibrated"``, default), left at torch's
    defaults (``"default"``), or without batch norm (``"none"``) — trained by full-batch
    gradient descent (step ``lr``) on :math:`\frac1{2n}\lVert f_\theta(X)-Y\rVert^2` over the kept weights (the
    pruned ones stay 0) for ``steps`` steps on ``n`` images (one-hot targets) of ``dataset`` — ``"cifar10"``
    (:func:`cifar10_subset`, needs the files) or ``"digits"`` (:func:`digits_subset`, offline) — drawn with the
    seed. Every ``every`` steps and at the end: the loss, :math:`\kappa(\GN)` over the nonzero spectrum
    (:func:`jacobian_gram`, rank and gap at the cut), :math:`\lambda_{\max}`, and the smallest singular value over
    the pruned layers. Float64 on :func:`curvlab.config.device` (spectral work on
    :func:`curvlab.config.spectral_device`).

    Returns a tidy frame, one row per (seed, checkpoint): ``seed``, ``step``, ``loss``, ``kappa``, ``rank``,
    ``gap``, ``lambda_max``, ``lambda_min``, ``size`` (:math:`nd_y`), ``p`` (all parameters), ``p_kept``,
    ``sigma_min``, ``device``. The configuration (``rate``, ``n``, ...) is not repeated in it: :func:`curvlab.sweep.sweep`
    adds those columns (and refuses a result that holds them). A step that makes the loss or the gradient
    non-finite stops the cell with a ValueError naming ``lr``."""
    rate, n, seeds, steps, every, width, dataset, lr = _check_cell(rate, n, seeds, steps, every, width, dataset, lr)
    norm = check_choice("norm", norm, NORMS)
    from torch.func import functional_call, grad

    from .curvature import condition_number

    dev = config.spectral_device(config.device())
    rows = []
    marks = set(_checkpoints(steps, every))
    for seed in seeds:
        if dataset == "cifar10":
            X, labels = cifar10_subset(n, seed, device=dev)
        else:
            X, labels = digits_subset(n, seed, device=dev)
        Y = nn.functional.one_hot(labels, 10).to(X.dtype)
        net = ResNet20(width, seed=seed, norm="none" if norm == "none" else "eval", device=dev)
        masks = magnitude_masks(net, rate)
        with torch.no_grad():
            for k, p in net.named_parameters():
                p.mul_(masks[k])
        if norm == "calibrated":
            net.calibrate(X)
        params = {k: p.detach().clone() for k, p in net.named_parameters()}
        buffers = dict(net.named_buffers())
        p_all = sum(p.numel() for p in params.values())
        p_kept = int(sum(int(m.sum()) for m in masks.values()))
        d_y = 10
        b = _block_size(n, d_y, p_all, None, None)

        def loss_fn(ps: dict) -> torch.Tensor:
            out = functional_call(net, (ps, buffers), (X,))
            return (out - Y).square().sum() / (2 * n)

        g_fn = grad(loss_fn)
        for t in range(steps + 1):
            if t in marks:
                loss = float(loss_fn(params))
                if not math.isfinite(loss):
                    raise ValueError(f"lr = {lr} makes gradient descent diverge (loss {loss} at step {t}, seed "
                                     f"{seed}): use a smaller lr")
                c = condition_number(_gram(net, params, masks, X, b))
                rows.append({"seed": seed, "step": t, "loss": loss, "kappa": c.kappa,
                             "rank": c.rank, "gap": c.gap, "lambda_max": c.lambda_max,
                             "lambda_min": c.lambda_min_nonzero, "size": c.size, "p": p_all, "p_kept": p_kept,
                             "sigma_min": _layer_sigma_min(params, masks), "device": str(dev)})
            if t < steps:
                g = g_fn(params)
                if not all(bool(torch.isfinite(v.sum())) for v in g.values()):
                    raise ValueError(f"lr = {lr} makes gradient descent diverge (non-finite gradient at step {t}, "
                                     f"seed {seed}): use a smaller lr")
                params = {k: v - lr * g[k] * masks[k] for k, v in params.items()}
    return pd.DataFrame(rows)


def pruned_resnet_flops(rate: float, n: int, seeds: list, steps: int, every: int, width: int, dataset: str,
                        **_) -> float:
    r"""Upper bound of the floating-point operations of :func:`pruned_resnet_cell` (to turn a grid into device
    hours). Per seed and checkpoint: the per-sample Jacobians, :math:`n(1+2d_y)F` for a forward pass of :math:`F`
    flop (:func:`forward_flops`) and :math:`d_y` backward passes of at most :math:`2F`, times :math:`(B+1)/2` for
    the recomputed blocks of :func:`jacobian_gram` (:math:`B` blocks at :data:`GRAM_BYTES`); the Gram,
    :math:`2(nd_y)^2p`; its eigenvalues, :math:`4(nd_y)^3`; the layer singular values. Per training step
    :math:`3nF + 3p` (forward, backward, update). ``rate`` does not lower the bound (pruned weights are computed as
    zeros)."""
    _, n, seeds, steps, every, width, dataset, _lr = _check_cell(rate, n, seeds, steps, every, width, dataset, 1.0)
    side = 32 if dataset == "cifar10" else 16
    d_y = 10
    F = forward_flops(width, side)
    p = _param_count(width)
    m = n * d_y
    b = _block_size(n, d_y, p, None, None)
    B = math.ceil(n / b)
    svd = sum(4.0 * min(r, c) ** 2 * max(r, c) for r, c in _weight_shapes(width))
    checkpoint = n * (1 + 2 * d_y) * F * (B + 1) / 2 + n * d_y * p + 2.0 * m * m * p + 4.0 * m**3 + svd
    step = 3.0 * n * F + 3.0 * p
    return float(len(seeds) * (len(_checkpoints(steps, every)) * checkpoint + steps * step))


def _weight_shapes(width: int, in_channels: int = 3, num_classes: int = 10) -> list[tuple[int, int]]:
    shapes, c = [(width, in_channels * 9)], width
    for stage in range(3):
        c_out = width * 2**stage
        for _ in range(3):
            shapes += [(c_out, c * 9), (c_out, c_out * 9)]
            c = c_out
    return shapes + [(num_classes, c)]


def _param_count(width: int, in_channels: int = 3, num_classes: int = 10, norm: str = "eval") -> int:
    """Parameters of :class:`ResNet20` (the formula; checked against the module in the tests)."""
    weights = sum(r * c for r, c in _weight_shapes(width, in_channels, num_classes))
    bn = 2 * (width + sum(2 * 3 * width * 2**s for s in range(3))) if norm == "eval" else 0
    return weights + num_classes + bn
