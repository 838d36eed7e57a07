r"""The Gauss–Newton matrix of a two-layer linear convolutional network (Part III, chapter 31).

Source: Zhao, Singh & Lucchi (2024), *Theoretical characterisation of the Gauss–Newton conditioning in neural
networks* (their convolutional extension; the book's version is derived in ``notebooks/31_gn_conditioning_factors``).

**The network.** An image :math:`x\in\mathbb R^{N\times N}` (flattened row-major, :math:`d=N^2`) goes through one
convolution with :math:`c` filters :math:`K\in\mathbb R^{c\times s\times s}` (stride 1, no padding, no bias:
``torch.nn.Conv2d(1, c, s, bias=False)``), giving :math:`c` maps of side :math:`o=N-s+1`, then through a linear
read-out :math:`V\in\mathbb R^{d_y\times co^2}` of the flattened maps (channel-major, as ``nn.Flatten`` orders them).

**Toeplitz form.** With the shift matrices :math:`S_u\in\{0,1\}^{o^2\times d}`, :math:`(S_ux)_p = x_{p+u}` for the
:math:`s^2` offsets :math:`u` of the kernel (:func:`shift_matrices`), the convolution is the matrix

.. math::

    T(K) = \sum_u K_{:,u}\otimes S_u \in \mathbb R^{co^2\times d},\qquad f(x) = V\,T(K)\,x,

(row-major Kronecker product, :func:`toeplitz`). The end-to-end map :math:`M = VT(K)` is linear in each factor; its
derivative in :math:`K` has the columns :math:`\operatorname{vec}(V_kS_u)`, :math:`V_k` the read-out block of
channel :math:`k` (:func:`readout_unfold`, the matrix :math:`Q(V)\in\mathbb R^{d_yd\times cs^2}`, the book's :math:`\mathcal Q(V)`), and in :math:`V`
it is :math:`I_{d_y}\otimes T^\top`. Hence, with :math:`\hat\Sigma = X^\top X/n`,

.. math::

    H_{\mathrm{GN}} = \Gamma^\top(I_{d_y}\otimes\hat\Sigma)\Gamma,\qquad
    H^{\mathrm{red}}_{\mathrm{GN}} = I_{d_y}\otimes \hat\Sigma^{1/2}T^\top T\hat\Sigma^{1/2}
        + (I_{d_y}\otimes\hat\Sigma^{1/2})\,Q Q^\top(I_{d_y}\otimes\hat\Sigma^{1/2}),

and the two have the same nonzero eigenvalues (:func:`gn_reduced`; :func:`gn_dense` is the torch.func reference of
the actual ``nn.Conv2d`` model). With :math:`W = T\hat\Sigma^{1/2}`, :math:`Q_\Sigma = (I\otimes\hat\Sigma^{1/2})Q`
and :math:`r = \operatorname{rank}\hat\Sigma`, Weyl's inequalities give the bound of Lemma 1's shape
(:func:`kappa_bound`):

.. math::

    \kappa(H_{\mathrm{GN}}) \le \frac{\sigma_1^2(W) + \sigma_1^2(Q_\Sigma)}{\sigma_r^2(W) + \sigma_{d_yr}^2(Q_\Sigma)},

with equality when the kernel covers the image (:math:`s = N`: the convolution is a dense layer), the inputs are
whitened (:math:`\hat\Sigma` a projection) and the denominator is positive: for generic weights when
:math:`c\ge\min(d_y, r)` (with :math:`c<\min(d_y,r)` the bound is infinite and :math:`\kappa` over the nonzero
spectrum is finite).
Every tensor may carry leading batch dimensions (one network per seed); spectral work is float64.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import pandas as pd
import torch

from . import config, linalg
from ._validate import as_tensor, check_finite, check_int, check_matrix
from .deep_linear import Condition, condition
from .linalg import default_rtol

__all__ = [
    "output_side",
    "shift_matrices",
    "toeplitz",
    "readout_unfold",
    "init_weights",
    "conv_model",
    "flat_model",
    "gn_dense",
    "gn_reduced",
    "gn_reduced_dense_foil",
    "bound_terms",
    "kappa_bound",
    "gn_condition",
    "whiten_images",
    "conditioning_frame",
    "ResidualCNN",
    "magnitude_masks_net",
    "pruned_model",
    "flat_mask",
    "jacobian_all",
    "kept_gram",
    "gram_condition",
    "layer_sigma_min",
    "pruning_counterfactuals",
    "train_pruned",
    "train_pruned_many",
    "TRAINING_VARIANTS",
    "kappa_at_rank",
]


#: The reduced matrices here are at most ``d_y h^2`` = a few hundred to a few thousand square: one CPU thread is
#: faster than two for them when cores are shared (OpenMP start-up and oversubscription), see ``config.cpu_threads``.
_SMALL = True


# ============================================================================================ shapes
def output_side(image: int, s: int, padding: int = 0) -> int:
    r"""Side :math:`o = N + 2\,\mathrm{padding} - s + 1` of a stride-1 convolution of an ``image x image`` input with
    an ``s x s`` kernel and zero ``padding`` (0: valid; :math:`(s-1)/2` for odd :math:`s`: same). ValueError if the
    kernel is larger than the image or the padding is not in :math:`[0, s-1]`."""
    N = check_int("image", image, min_value=1)
    s = check_int("s", s, min_value=1)
    if s > N:
        raise ValueError(f"kernel size s must be <= the image side image = {N}, got s = {s}")
    padding = check_int("padding", padding, min_value=0)
    if padding > s - 1:
        raise ValueError(f"padding must be <= s - 1 = {s - 1} (more only adds all-zero maps), got {padding}")
    return N + 2 * padding - s + 1


def shift_matrices(image: int, s: int, padding: int = 0, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    r"""The :math:`s^2` selection matrices :math:`S_u\in\{0,1\}^{o^2\times N^2}`, :math:`(S_ux)_{(a,b)} =
    x_{(a+i-\mathrm{padding},\,b+j-\mathrm{padding})}` for the offset :math:`u=(i,j)` (zero where that pixel lies in
    the padding), row-major in :math:`u`, :math:`(a,b)` and the pixels; shape ``(s*s, o*o, image*image)``. Row
    :math:`u` of ``F.unfold`` of an image is :math:`S_ux`."""
    o = output_side(image, s, padding)
    linalg._check_float_dtype("dtype", dtype)
    i, j = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    a, b = torch.meshgrid(torch.arange(o), torch.arange(o), indexing="ij")
    row = a.reshape(1, -1) + i.reshape(-1, 1) - padding                       # (s^2, o^2)
    col = b.reshape(1, -1) + j.reshape(-1, 1) - padding
    inside = (row >= 0) & (row < image) & (col >= 0) & (col < image)
    S = torch.zeros(s * s, o * o, image * image + 1, dtype=dtype)            # last column collects the padding
    S.scatter_(2, torch.where(inside, row * image + col, image * image).unsqueeze(-1), 1.0)
    return S[..., :-1].contiguous()


def _check_kernel(K, image: int, padding: int = 0) -> tuple[torch.Tensor, int, int, int]:
    K = config.spectral(check_finite("K", as_tensor("K", K)))
    if K.dim() < 3 or K.shape[-1] != K.shape[-2] or K.shape[-3] == 0 or K.shape[-1] == 0:
        raise ValueError(f"K must have shape (..., c, s, s) with c, s >= 1, got {tuple(K.shape)}")
    N = check_int("image", image, min_value=1)
    c, s = K.shape[-3], K.shape[-1]
    if s > N:
        raise ValueError(f"K: kernel size s = {s} must be <= the image side image = {N}")
    return K, c, s, output_side(N, s, padding)


def _check_readout(V, K: torch.Tensor, c: int, o: int) -> torch.Tensor:
    V = config.spectral(check_finite("V", as_tensor("V", V)))
    if V.dim() < 2 or V.shape[-1] != c * o * o or V.shape[-2] == 0:
        raise ValueError(f"V must have shape (..., d_y, c*o*o) = (..., d_y, {c * o * o}) with d_y >= 1 "
                         f"(c = {c} maps of side o = {o}), got {tuple(V.shape)}")
    if V.shape[:-2] != K.shape[:-3]:
        raise ValueError(f"V and K must share their batch dimensions, got {tuple(V.shape[:-2])} and "
                         f"{tuple(K.shape[:-3])}")
    return V


# ============================================================================================ Toeplitz form
def toeplitz(K, image: int = 8, padding: int = 0) -> torch.Tensor:
    r"""The convolution as a matrix, :math:`T(K)=\sum_uK_{:,u}\otimes S_u\in\mathbb R^{co^2\times N^2}`
    (row-major), so that ``T @ x.reshape(-1)`` is ``conv2d(x, K).reshape(-1)``; batched over leading dimensions of
    ``K: (..., c, s, s)`` (chapter 31)."""
    K, c, s, o = _check_kernel(K, image, padding)
    S = shift_matrices(image, s, padding, dtype=K.dtype)
    T = torch.einsum("...ku,upq->...kpq", K.reshape(*K.shape[:-2], s * s), S)
    return T.reshape(*K.shape[:-3], c * o * o, image * image)


def readout_unfold(V, c: int, s: int, image: int = 8, padding: int = 0) -> torch.Tensor:
    r"""The derivative of :math:`\operatorname{vec}(VT(K))` in :math:`K`: the matrix :math:`Q(V)\in
    \mathbb R^{d_yN^2\times cs^2}` whose column :math:`(k,u)` is :math:`\operatorname{vec}(V_kS_u)` — row :math:`i`
    of :math:`V_kS_u` is read-out map :math:`i` of channel :math:`k` placed at offset :math:`u` in an empty image
    (a transposed convolution). Batched over leading dimensions of ``V: (..., d_y, c*o*o)`` (chapter 31)."""
    c = check_int("c", c, min_value=1)
    o = output_side(image, s, padding)
    V = config.spectral(check_finite("V", as_tensor("V", V)))
    if V.dim() < 2 or V.shape[-1] != c * o * o or V.shape[-2] == 0:
        raise ValueError(f"V must have shape (..., d_y, c*o*o) = (..., d_y, {c * o * o}), got {tuple(V.shape)}")
    S = shift_matrices(image, s, padding, dtype=V.dtype)
    d_y = V.shape[-2]
    Vk = V.reshape(*V.shape[:-1], c, o * o)                                  # (..., d_y, c, o^2)
    C = torch.einsum("...ikp,upq->...iqku", Vk, S)                            # (..., d_y, N^2, c, s^2)
    return C.reshape(*V.shape[:-2], d_y * image * image, c * s * s)


# ============================================================================================ the model
def init_weights(c: int, s: int, d_y: int, *, image: int = 8, padding: int = 0, batch: Sequence[int] = (), scale: float = 1.0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""LeCun-initialised ``(K, V)``: kernel entries of variance :math:`1/s^2` (the fan-in of a filter), read-out
    entries of variance :math:`1/(co^2)`, times ``scale``; shapes ``(*batch, c, s, s)`` and ``(*batch, d_y, c o^2)``."""
    c = check_int("c", c, min_value=1)
    d_y = check_int("d_y", d_y, min_value=1)
    o = output_side(image, s, padding)
    batch = tuple(check_int("batch", b, min_value=1) for b in batch)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    dt = torch.float64
    K = torch.randn(*batch, c, s, s, generator=generator, dtype=dt) * (scale / s)
    V = torch.randn(*batch, d_y, c * o * o, generator=generator, dtype=dt) * (scale / math.sqrt(c * o * o))
    return K, V


def conv_model(c: int, s: int, d_y: int, *, image: int = 8, padding: int = 0) -> torch.nn.Module:
    """The network as torch modules, float64: ``Unflatten -> Conv2d(1, c, s, bias=False) -> Flatten ->
    Linear(c o^2, d_y, bias=False)``; its parameters are named ``"1.weight"`` (the kernel, ``(c, 1, s, s)``) and
    ``"3.weight"`` (the read-out)."""
    c = check_int("c", c, min_value=1)
    d_y = check_int("d_y", d_y, min_value=1)
    o = output_side(image, s, padding)
    nn = torch.nn
    return nn.Sequential(nn.Unflatten(1, (1, image, image)), nn.Conv2d(1, c, s, padding=padding, bias=False),
                         nn.Flatten(),
                         nn.Linear(c * o * o, d_y, bias=False)).to(torch.float64)


def _check_images(X, image: int) -> torch.Tensor:
    X = config.spectral(check_matrix("X", X))
    if X.shape[1] != image * image or X.shape[0] == 0:
        raise ValueError(f"X must be n x image^2 = n x {image * image} (flattened images), got {tuple(X.shape)}")
    return X


def flat_model(X, K, V, image: int = 8, padding: int = 0):
    r"""``(fn, theta)`` for :mod:`curvlab.curvature`: ``fn(theta)`` runs :func:`conv_model` (``nn.Conv2d``, not the
    Toeplitz matrix) on the images ``X: (n, image^2)`` through ``torch.func.functional_call`` and returns the
    ``n d_y`` outputs; ``theta = [vec K; vec V]``. Unbatched ``K``, ``V``."""
    K, c, s, o = _check_kernel(K, image, padding)
    V = _check_readout(V, K, c, o)
    if K.dim() != 3:
        raise ValueError(f"K must be unbatched (c, s, s) here, got {tuple(K.shape)}")
    X = _check_images(X, image)
    model = conv_model(c, s, V.shape[-2], image=image, padding=padding)
    from .curvature import flatten_params

    theta, unflatten = flatten_params({"1.weight": K.reshape(c, 1, s, s).clone(), "3.weight": V.clone()})

    def fn(th: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, unflatten(th), (X,)).reshape(-1)

    return fn, theta


def gn_dense(K, V, X, image: int = 8, padding: int = 0) -> torch.Tensor:
    r"""The reference: :math:`H_{\mathrm{GN}} = J^\top J/n` (``p x p``, :math:`p = cs^2 + d_yco^2`) with the
    Jacobian of the ``nn.Conv2d`` model by torch.func (:func:`flat_model`); memory :math:`O(p^2 + nd_yp)`."""
    from .curvature import jacobian

    fn, theta = flat_model(X, K, V, image, padding)
    small = theta.numel() * X.shape[0] * V.shape[-2] <= 2**24           # J below 128 MiB: one thread is faster
    with config.cpu_threads(1, when=small, device=theta.device):
        J = jacobian(fn, theta)
        return J.T @ J / X.shape[0]


# ============================================================================================ reduced form
def _sigma_root(Sigma_hat, d: int, like: torch.Tensor) -> torch.Tensor | None:
    if Sigma_hat is None:
        return None
    S = check_matrix("Sigma_hat", Sigma_hat, square=True)
    if S.shape[-1] != d:
        raise ValueError(f"Sigma_hat must be image^2 x image^2 = {d} x {d}, got {tuple(S.shape)}")
    return linalg._psd_sqrt("Sigma_hat", S.to(like.dtype))


def _factors(K, V, Sigma_hat, image: int, padding: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``W = T Sigma^{1/2}``, ``C_Sigma = (I x Sigma^{1/2}) C`` and d_y."""
    K, c, s, o = _check_kernel(K, image, padding)
    V = _check_readout(V, K, c, o)
    d, d_y = image * image, V.shape[-2]
    T, C = toeplitz(K, image, padding), readout_unfold(V, c, s, image, padding)
    R = _sigma_root(Sigma_hat, d, T)
    if R is not None:
        T = T @ R
        C = torch.einsum("qr,...irk->...iqk", R, C.reshape(*C.shape[:-2], d_y, d, C.shape[-1])).reshape(C.shape)
    return T, C, d_y


def _assemble(W: torch.Tensor, C: torch.Tensor, d_y: int) -> torch.Tensor:
    r""":math:`I_{d_y}\otimes W^\top W + CC^\top`, the Kronecker sum written into the diagonal blocks."""
    d = W.shape[-1]
    H = C @ C.transpose(-2, -1)
    blocks = H.view(*H.shape[:-2], d_y, d, d_y, d).diagonal(dim1=-4, dim2=-2)     # (..., d, d, d_y), a view
    blocks += (W.transpose(-2, -1) @ W).unsqueeze(-1)
    return H


def gn_reduced(K, V, Sigma_hat=None, image: int = 8, padding: int = 0) -> torch.Tensor:
    r""":math:`H^{\mathrm{red}}_{\mathrm{GN}} = I_{d_y}\otimes W^\top W + Q_\Sigma Q_\Sigma^\top`,
    :math:`W = T(K)\hat\Sigma^{1/2}`, :math:`Q_\Sigma=(I\otimes\hat\Sigma^{1/2})Q(V)` (``d_y N^2`` square; whitened
    inputs when ``Sigma_hat`` is None). Same nonzero eigenvalues as :func:`gn_dense` (chapter 31)."""
    return _assemble(*_factors(K, V, Sigma_hat, image, padding))


def gn_reduced_dense_foil(K, V, Sigma_hat=None, image: int = 8, padding: int = 0) -> torch.Tensor:
    r"""The *wrong* reduced matrix that forgets the weight sharing: Lemma 1's dense-layer form
    :math:`VV^\top\otimes\hat\Sigma + I\otimes W^\top W` with :math:`T(K)` treated as a free dense layer. Kept as
    the foil of the chapter's check."""
    W, _, d_y = _factors(K, V, Sigma_hat, image, padding)
    V = config.spectral(as_tensor("V", V))
    d = image * image
    S = torch.eye(d, dtype=W.dtype) if Sigma_hat is None else config.spectral(as_tensor("Sigma_hat", Sigma_hat))
    eye = torch.eye(d_y, dtype=W.dtype).expand(*W.shape[:-2], d_y, d_y)
    return linalg.kron(V @ V.transpose(-2, -1), S.expand(*W.shape[:-2], d, d)) + linalg.kron(
        eye, W.transpose(-2, -1) @ W)


def _rank_sigma(Sigma_hat, d: int) -> int:
    if Sigma_hat is None:
        return d
    S = check_matrix("Sigma_hat", Sigma_hat, square=True)
    lam = torch.linalg.eigvalsh(config.spectral(S))
    if not bool(lam[-1] > 0):
        raise ValueError("Sigma_hat must have a positive largest eigenvalue")
    return int((lam > default_rtol(d) * lam[-1]).sum())


def _terms(W: torch.Tensor, C: torch.Tensor, d_y: int, r: int) -> dict[str, torch.Tensor]:
    sW = torch.linalg.svdvals(W)
    G = C.transpose(-2, -1) @ C if C.shape[-1] <= C.shape[-2] else C @ C.transpose(-2, -1)
    sC = torch.linalg.eigvalsh(G).flip(-1).clamp_min(0).sqrt()          # singular values of C (its smaller Gram)
    pick = lambda s, k: s[..., k - 1] if s.shape[-1] >= k else torch.zeros_like(s[..., 0])  # noqa: E731
    return {"W_max": sW[..., 0], "W_min": pick(sW, r), "C_max": sC[..., 0], "C_min": pick(sC, d_y * r)}


def _ratio(t: dict[str, torch.Tensor]) -> torch.Tensor:
    num = t["W_max"].square() + t["C_max"].square()
    den = t["W_min"].square() + t["C_min"].square()
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(num.dtype).tiny), torch.full_like(num, math.inf))


def bound_terms(K, V, Sigma_hat=None, image: int = 8, padding: int = 0) -> dict[str, torch.Tensor]:
    r"""The four singular values of the bound: :math:`\sigma_1(W)`, :math:`\sigma_r(W)`, :math:`\sigma_1(Q_\Sigma)`,
    :math:`\sigma_{d_yr}(Q_\Sigma)` (zero where the matrix has fewer columns than that), :math:`r`
    the numerical rank of :math:`\hat\Sigma` (:math:`N^2` when it is None). Batched."""
    with config.cpu_threads(1, when=_SMALL):
        W, C, d_y = _factors(K, V, Sigma_hat, image, padding)
        return _terms(W, C, d_y, _rank_sigma(Sigma_hat, image * image))


def kappa_bound(K, V, Sigma_hat=None, image: int = 8, padding: int = 0) -> torch.Tensor:
    r"""Lemma 1's shape for the convolutional network:
    :math:`(\sigma_1^2(W)+\sigma_1^2(Q_\Sigma))/(\sigma_r^2(W)+\sigma_{d_yr}^2(Q_\Sigma))` (inf when the denominator
    vanishes). Batched (chapter 31)."""
    return _ratio(bound_terms(K, V, Sigma_hat, image, padding))


def gn_condition(K, V, Sigma_hat=None, image: int = 8, padding: int = 0, *, rank: int | None = None) -> Condition:
    r""":math:`\kappa(H_{\mathrm{GN}})` through :func:`gn_reduced`, cut at the rank :math:`d_yr` (:math:`r` the
    numerical rank of :math:`\hat\Sigma`) unless ``rank`` is given; the numerical rank and the gap at the cut are
    reported (:func:`curvlab.deep_linear.condition`). The cut is the full rank of the reduced matrix on the range
    of :math:`I\otimes\hat\Sigma^{1/2}`; it needs :math:`W` of rank :math:`r` (e.g. :math:`co^2\ge r`)."""
    with config.cpu_threads(1, when=_SMALL):
        H = gn_reduced(K, V, Sigma_hat, image, padding)
        d_y = H.shape[-1] // (image * image)
        if rank is None:
            rank = d_y * _rank_sigma(Sigma_hat, image * image)
        return condition(torch.linalg.eigvalsh(H), rank=rank)


# ============================================================================================ data
def whiten_images(X, image: int = 8, *, rtol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Whiten images *in pixel space* (ZCA) with the uncentred second moment of the same samples:
    :math:`X_{\mathrm w}=XU_r\Lambda_r^{-1/2}U_r^\top`, :math:`r` the numerical rank, so that
    :math:`X_{\mathrm w}^\top X_{\mathrm w}/n = U_rU_r^\top` (a projection) and every whitened image is still an
    image. Pixels that are zero in every sample stay zero (they lie outside :math:`U_r`): this is how the
    constant pixels of the digits are dropped without breaking the grid. Returns ``(X_w, U_r)``."""
    X = _check_images(X, image)
    lam, U = torch.linalg.eigh(X.T @ X / X.shape[0])
    lam, U = lam.flip(-1), U.flip(-1)
    if not bool(lam[0] > 0):
        raise ValueError("X must not be all zeros")
    rtol = default_rtol(X.shape[1]) if rtol is None else float(rtol)
    if not math.isfinite(rtol) or rtol < 0:
        raise ValueError(f"rtol must be a finite number >= 0, got {rtol}")
    r = int((lam > rtol * lam[0]).sum())
    U_r = U[:, :r]
    return X @ (U_r / lam[:r].sqrt()) @ U_r.T, U_r


def conditioning_frame(K, V, Sigma_hat=None, image: int = 8, padding: int = 0, **labels) -> pd.DataFrame:
    r"""One row per network of the batch: ``kappa``, ``bound``, ``bound/kappa``, ``rank`` (the cut, :math:`d_yr`),
    ``gap`` (:math:`\lambda_r/\lambda_{r+1}` there) and the ``labels`` given (e.g. ``c=4, s=3``). The factors are
    formed once for both."""
    with config.cpu_threads(1, when=_SMALL):
        W, C, d_y = _factors(K, V, Sigma_hat, image, padding)
        r = _rank_sigma(Sigma_hat, image * image)
        cond = condition(torch.linalg.eigvalsh(_assemble(W, C, d_y)), rank=d_y * r)
        b = _ratio(_terms(W, C, d_y, r)).reshape(-1)
    kap = cond.kappa.reshape(-1)
    frame = pd.DataFrame({"kappa": kap.numpy(), "bound": b.numpy(), "bound/kappa": (b / kap).numpy(),
                          "gap": cond.gap.reshape(-1).numpy(), "rank": cond.rank})
    for k, v in labels.items():
        frame[k] = v
    return frame


# ============================================================================================ pruned residual CNN
class ResidualCNN(torch.nn.Module):
    r"""A small nonlinear residual CNN on ``h x h`` images (chapter 32, pruning): a 3x3 stem ``1 -> c``, ``blocks``
    residual blocks :math:`z\mapsto z+\mathrm{conv}_2(\mathrm{ReLU}(\mathrm{conv}_1(\mathrm{ReLU}(z))))` (3x3, same
    padding, ``c -> c``), global average pooling and a linear head ``c -> d_y``; no biases, float64. With ``c = 8``
    and two blocks it has 2,456 parameters. The paper's network is ResNet-20 (about 270,000)."""

    def __init__(self, c: int = 8, blocks: int = 2, d_y: int = 10, image: int = 8):
        super().__init__()
        c, blocks = check_int("c", c, min_value=1), check_int("blocks", blocks, min_value=0)
        d_y, self.image = check_int("d_y", d_y, min_value=1), check_int("image", image, min_value=3)
        nn = torch.nn
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1, bias=False) for _ in range(2 * blocks))
        self.head = nn.Linear(c, d_y, bias=False)
        self.to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, d_y)`` of images ``x`` (``(n, h * h)`` or ``(n, 1, h, h)``): stem, residual blocks, head."""
        z = self.stem(x.reshape(-1, 1, self.image, self.image))
        for k in range(0, len(self.convs), 2):
            z = z + self.convs[k + 1](torch.relu(self.convs[k](torch.relu(z))))
        return self.head(z.mean(dim=(-2, -1)))


def _check_net(net) -> torch.nn.Module:
    if not isinstance(net, torch.nn.Module):
        raise TypeError(f"net must be a torch.nn.Module (e.g. conv.ResidualCNN()), got {type(net).__name__}")
    return net


def magnitude_masks_net(net, rate: float) -> dict[str, torch.Tensor]:
    r"""Layer-wise magnitude pruning at initialisation: in every weight tensor keep the
    :math:`\lceil(1-\mathrm{rate})\,n_l\rceil` entries of largest magnitude (ties broken by position). Returns
    ``{name: 0/1 mask}``. ValueError if ``rate`` is not in :math:`[0, 1)` or if a layer would keep nothing."""
    net = _check_net(net)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or not 0 <= rate < 1:
        raise ValueError(f"rate must be a pruning fraction in [0, 1), got {rate!r}")
    masks = {}
    for name, w in net.named_parameters():
        keep = math.ceil((1 - rate) * w.numel() - 1e-9)
        if keep < 1:
            raise ValueError(f"rate = {rate} would prune every weight of layer {name!r} ({w.numel()} weights): "
                             "an all-pruned layer cuts the network")
        idx = w.detach().abs().reshape(-1).argsort(descending=True, stable=True)[:keep]
        m = torch.zeros(w.numel(), dtype=w.dtype, device=w.device)
        m[idx] = 1
        masks[name] = m.reshape(w.shape)
    return masks


def _check_masks(net, masks) -> dict[str, torch.Tensor]:
    if not isinstance(masks, dict):
        raise TypeError(f"masks must be a dict {{name: 0/1 tensor}} from magnitude_masks_net, got {type(masks).__name__}")
    params = dict(net.named_parameters())
    if set(masks) != set(params):
        raise ValueError(f"masks must have one entry per parameter of net: {sorted(params)}, got {sorted(masks)}")
    for k, m in masks.items():
        if not isinstance(m, torch.Tensor) or m.shape != params[k].shape:
            raise ValueError(f"masks[{k!r}] must be a tensor of shape {tuple(params[k].shape)}")
        if not bool(m.any()):
            raise ValueError(f"masks[{k!r}] prunes the whole layer: an all-pruned layer cuts the network")
    return masks


def pruned_model(net, masks, X):
    r"""``(fn, theta)`` over the *kept* weights only: ``fn(theta)`` scatters ``theta`` into the pruned weights and
    returns the ``n d_y`` outputs of ``net`` on ``X`` (``torch.func.functional_call``)."""
    net = _check_net(net)
    masks = _check_masks(net, masks)
    X = config.spectral(check_matrix("X", X))
    params = {k: p.detach() for k, p in net.named_parameters()}
    idx = {k: masks[k].reshape(-1).nonzero().squeeze(-1) for k in params}
    theta = torch.cat([params[k].reshape(-1)[idx[k]] for k in params])
    sizes = [idx[k].numel() for k in params]

    def fn(th: torch.Tensor) -> torch.Tensor:
        out = {}
        for (k, p), t in zip(params.items(), th.split(sizes)):
            out[k] = torch.zeros(p.numel(), dtype=th.dtype, device=th.device).index_put((idx[k],), t).reshape(p.shape)
        return torch.func.functional_call(net, out, (X,)).reshape(-1)

    return fn, theta


def flat_mask(net, masks) -> torch.Tensor:
    r"""The masks as one 0/1 vector over *all* ``p`` weights of ``net``, in ``named_parameters`` order: the column
    order of :func:`jacobian_all`."""
    net = _check_net(net)
    masks = _check_masks(net, masks)
    return torch.cat([masks[k].reshape(-1) for k, _ in net.named_parameters()])


def _jacobian_at(net, params: dict[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
    """Per-sample Jacobian ``(n d_y, p)`` of ``net`` at the weights ``params`` (``vmap`` of ``jacrev`` over the
    samples: ``n d_y`` backward passes through one image each)."""
    def one(p, x):
        return torch.func.functional_call(net, p, (x.reshape(1, -1),)).reshape(-1)

    Jd = torch.func.vmap(torch.func.jacrev(one), in_dims=(None, 0))(params, X)
    rows = X.shape[0] * next(iter(Jd.values())).shape[1]
    return torch.cat([Jd[k].reshape(rows, -1) for k in params], dim=1)


def jacobian_all(net, X, masks=None) -> torch.Tensor:
    r"""Jacobian ``(n d_y, p)`` of the outputs of ``net`` on ``X`` with respect to **all** ``p`` weights, at the
    pruned weights :math:`W\odot M` (at the unpruned ones when ``masks`` is None). Rows are sample-major (sample
    ``i``'s ``d_y`` outputs together), columns in ``named_parameters`` order (:func:`flat_mask`). Computed sample
    by sample; :func:`pruned_model` with :func:`curvlab.curvature.jacobian` is the full-batch reference."""
    net = _check_net(net)
    X = config.spectral(check_matrix("X", X))
    params = {k: p.detach() for k, p in net.named_parameters()}
    if masks is not None:
        masks = _check_masks(net, masks)
        params = {k: p * masks[k] for k, p in params.items()}
    return _jacobian_at(net, params, X)


def kept_gram(J, keep=None) -> torch.Tensor:
    r"""The Jacobian Gram over the columns ``keep`` (a 0/1 vector from :func:`flat_mask`; all columns when None):
    :math:`J\,\mathrm{diag}(\mathrm{keep})\,J^\top`, ``n d_y x n d_y``. Divided by ``n`` it has the nonzero
    eigenvalues of the GN matrix over the kept weights."""
    J = config.spectral(check_matrix("J", J))
    if keep is None:
        return J @ J.T
    keep = as_tensor("keep", keep, dtype=J.dtype, device=J.device)
    if keep.shape != (J.shape[1],):
        raise ValueError(f"keep must be a 0/1 vector of length {J.shape[1]} (J's columns), got {tuple(keep.shape)}")
    return (J * keep) @ J.T


def gram_condition(net, masks, X):
    r""":math:`\kappa(\GN)` over the nonzero spectrum, through the ``n d_y x n d_y`` Jacobian Gram
    :math:`JJ^\top/n` (same nonzero eigenvalues as :math:`J^\top J/n`) at the numerical rank, with the gap at the
    cut (:func:`curvlab.curvature.condition_number`). ``J`` is over the kept weights, at the pruned weights."""
    from .curvature import condition_number

    J = jacobian_all(net, X, masks)
    return condition_number(kept_gram(J, flat_mask(net, masks)) / X.shape[0])


def layer_sigma_min(net, masks) -> dict[str, float]:
    r"""Smallest singular value of each pruned layer as a matrix: a convolution's weight ``(c_out, c_in, s, s)``
    as ``c_out x c_in s^2`` (its action on one patch), the head as itself — the quantity the paper's explanation of
    pruning rests on."""
    net = _check_net(net)
    masks = _check_masks(net, masks)
    out = {}
    for k, p in net.named_parameters():
        M = (p.detach() * masks[k]).reshape(p.shape[0], -1)
        out[k] = float(torch.linalg.svdvals(config.spectral(M))[-1])
    return out


def pruning_counterfactuals(net, X, rates, *, spectra: bool = True) -> pd.DataFrame:
    r"""For one network and each pruning ``rate``: the spectrum of the Gram matrix (divided by ``n``) of

    * the **pruned** network: the kept weights, at the pruned weights :math:`W\odot M` (``eig``, ``kappa``, ...);
    * **zeroed, all trainable**: every weight, at :math:`W\odot M` -- the same function and the same lowered
      layer :math:`\sigma_{\min}`, no direction removed (``eig_zeroed``, ``kappa_zeroed``, ...);
    * **frozen, not zeroed**: the kept weights, at the unpruned :math:`W` -- every layer keeps its unpruned
      :math:`\sigma_{\min}`, the same directions removed (``eig_frozen``, ``kappa_frozen``, ...);

    with :math:`\kappa` over the nonzero spectrum, rank and gap (:func:`curvlab.curvature.condition_number`), and the
    layers' :math:`\sigma_{\min}` after pruning relative to before (median and minimum over layers,
    :func:`layer_sigma_min`), and the rank of the pruned read-out (the last layer). One Jacobian at :math:`W` serves
    every rate (:func:`jacobian_all`). With ``spectra=False`` only the last two (no Jacobian is computed): the
    spectra along training come from :func:`train_pruned_many`, whose step 0 holds the same three spectra."""
    from .curvature import condition_number

    net = _check_net(net)
    X = config.spectral(check_matrix("X", X))
    if not isinstance(spectra, bool):
        raise TypeError(f"spectra must be True or False, got {spectra!r}")
    n, J0 = X.shape[0], jacobian_all(net, X) if spectra else None
    s0 = layer_sigma_min(net, magnitude_masks_net(net, 0.0))
    rows = []
    for rate in rates:
        masks = magnitude_masks_net(net, rate)
        row = {"rate": float(rate)}
        if spectra:
            keep, Jr = flat_mask(net, masks), jacobian_all(net, X, masks)
            for tag, G in (("", kept_gram(Jr, keep)), ("_zeroed", kept_gram(Jr)), ("_frozen", kept_gram(J0, keep))):
                lam = torch.linalg.eigvalsh(G / n).flip(0)
                c = condition_number(lam)
                row.update({f"kappa{tag}": c.kappa, f"rank{tag}": c.rank, f"gap{tag}": c.gap,
                            f"lambda_max{tag}": c.lambda_max, f"eig{tag}": lam.cpu().numpy()})
        head = list(net.named_parameters())[-1]
        row["head rank"] = int(torch.linalg.matrix_rank(config.spectral(head[1].detach() * masks[head[0]])))
        ratio = [v / s0[k] for k, v in layer_sigma_min(net, masks).items()]
        row.update({"sigma_min ratio (median)": float(statistics.median(ratio)),
                    "sigma_min ratio (min)": float(min(ratio))})
        rows.append(row)
    return pd.DataFrame(rows)


def kappa_at_rank(frame: pd.DataFrame, by: Sequence[str], eig: str = "eig") -> pd.DataFrame:
    r"""Condition numbers compared at one rank: within each group of rows sharing the columns ``by``, the common
    rank :math:`r_\star` is the smallest number of positive entries of the spectra in column ``eig`` (decreasing
    eigenvalues, as :func:`train_pruned_many` returns with ``spectrum=True``: only the numerically nonzero ones are
    positive after the cut below), and each row gets :math:`\lambda_{r_\star}` and
    :math:`\kappa_{r_\star}=\lambda_1/\lambda_{r_\star}`. Spectra of different rank (a pruned read-out loses
    rank) are then compared over the same number of eigenvalues. The cut is the numerical rank of
    :func:`curvlab.curvature.condition_number` (its default tolerance). Rows whose ``eig`` is None (a diverged run)
    get NaN. Returns a frame with ``r_star``, ``lambda_r_star``, ``kappa_r_star``, indexed like ``frame`` (chapter 32)."""
    from .curvature import condition_number

    if not isinstance(frame, pd.DataFrame) or eig not in frame.columns:
        raise ValueError(f"frame must be a DataFrame with a column {eig!r} of spectra (train_pruned_many(..., "
                         "spectrum=True))")
    by = [by] if isinstance(by, str) else list(by)
    missing = [b for b in by if b not in frame.columns]
    if missing:
        raise ValueError(f"by must name columns of frame; missing {missing}")
    ranks = pd.Series([condition_number(e).rank if e is not None else math.nan for e in frame[eig]], index=frame.index)
    r_star = ranks.groupby([frame[b] for b in by]).transform("min")
    lam = [float(e[int(r) - 1]) if e is not None and math.isfinite(r) else math.nan for e, r in zip(frame[eig], r_star)]
    out = pd.DataFrame({"r_star": r_star, "lambda_r_star": lam}, index=frame.index)
    out["kappa_r_star"] = [float(e[0]) / v if e is not None and math.isfinite(v) else math.nan
                           for e, v in zip(frame[eig], out.lambda_r_star)]
    return out


def _check_lr(lr, count: int) -> torch.Tensor:
    vals = [lr] * count if isinstance(lr, (int, float)) and not isinstance(lr, bool) else list(lr) if isinstance(
        lr, (list, tuple)) else None
    if vals is None or len(vals) != count or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in vals):
        raise ValueError(f"lr must be a finite positive step, or a list of {count} of them (one per network), "
                         f"got {lr!r}")
    return torch.tensor(vals, dtype=torch.float64)


#: What :func:`train_pruned_many` trains for a network ``W`` and its mask ``M`` (chapter 32's counterfactuals).
TRAINING_VARIANTS = {
    "pruned": "start at W * M, train the kept weights (the pruned network)",
    "zeroed": "start at W * M, train every weight (zeroed, all trainable: no direction removed)",
    "frozen": "start at W, train the kept weights, the others held at their initial values (frozen, not zeroed)",
}


def _check_variants(variant, count: int) -> list[str]:
    vals = [variant] * count if isinstance(variant, str) else list(variant) if isinstance(variant, (list, tuple)) \
        else None
    if vals is None or len(vals) != count or not all(isinstance(v, str) and v in TRAINING_VARIANTS for v in vals):
        raise ValueError(f"variant must be one of {sorted(TRAINING_VARIANTS)}, or a list of {count} of them (one per "
                         f"network), got {variant!r}")
    return vals


def train_pruned_many(nets, masks, X, Y, *, lr, steps: int, every: int, variant="pruned", spectrum: bool = False,
                      show_progress: bool = False) -> pd.DataFrame:
    r"""Full-batch gradient descent on :math:`\frac1{2n}\lVert f(X)-Y\rVert^2` over the kept weights of several
    pruned networks of the same architecture at once (``torch.func.vmap`` over the networks; the pruned weights stay
    at zero). ``lr`` is one step or one per network. Returns a frame with ``net`` (the index in ``nets``),
    ``variant``, ``step``, ``loss`` and, from the Jacobian Gram over the trained weights at the current weights,
    ``kappa``, ``rank``, ``gap`` and ``lambda_max`` at every ``every`` steps and at the end (NaN once a network's
    loss is no longer finite: the step was too large for it); with ``spectrum`` also ``eig``, that Gram's
    eigenvalues divided by ``n`` in decreasing order (a NumPy array; None after divergence). The networks are not
    modified. ``show_progress`` shows a bar over the steps (:func:`curvlab.progress.progress`).

    ``variant`` (one for all networks, or one per network; :data:`TRAINING_VARIANTS`) runs chapter 32's
    counterfactuals along training: ``"pruned"`` (the default) starts at :math:`W\odot M` and trains the kept
    weights; ``"zeroed"`` starts at :math:`W\odot M` and trains every weight; ``"frozen"`` starts at :math:`W`
    and trains the kept weights, the others held at their initial, nonzero values."""
    if not isinstance(nets, (list, tuple)) or not nets:
        raise ValueError("nets must be a non-empty list of networks")
    nets = [_check_net(net) for net in nets]
    if not isinstance(masks, (list, tuple)) or len(masks) != len(nets):
        raise ValueError(f"masks must be a list of {len(nets)} mask dicts, one per network")
    shapes = [(k, p.shape) for k, p in nets[0].named_parameters()]
    for i, net in enumerate(nets):
        if [(k, p.shape) for k, p in net.named_parameters()] != shapes:
            raise ValueError(f"nets must share one architecture; nets[{i}] differs from nets[0]")
    masks = [_check_masks(net, m) for net, m in zip(nets, masks)]
    X = config.spectral(check_matrix("X", X))
    Y = config.spectral(check_matrix("Y", Y))
    if Y.shape[0] != X.shape[0]:
        raise ValueError(f"Y must have n = {X.shape[0]} rows, got {tuple(Y.shape)}")
    eta = _check_lr(lr, len(nets)).to(X.device)
    steps, every = check_int("steps", steps, min_value=0), check_int("every", every, min_value=1)
    variants = _check_variants(variant, len(nets))
    if not isinstance(spectrum, bool):
        raise TypeError(f"spectrum must be True or False, got {spectrum!r}")
    from .curvature import condition_number

    base, n = nets[0], X.shape[0]
    trained = [{k: torch.ones_like(m[k]) for k in m} if v == "zeroed" else m for m, v in zip(masks, variants)]
    start = [{k: torch.ones_like(m[k]) for k in m} if v == "frozen" else m for m, v in zip(masks, variants)]
    M = {k: torch.stack([m[k] for m in trained]).to(X) for k, _ in shapes}
    P = {k: torch.stack([dict(net.named_parameters())[k].detach() * s0[k] for net, s0 in zip(nets, start)]).to(X)
         for k, _ in shapes}
    keep = [flat_mask(net, m).to(X) for net, m in zip(nets, trained)]

    def losses(P):
        out = torch.func.vmap(lambda p: torch.func.functional_call(base, p, (X,)))(P)
        return (out - Y).square().sum(dim=(-2, -1)) / (2 * n)

    grad = torch.func.grad(lambda P: losses(P).sum())
    from .progress import progress

    rows = []
    for t in progress(range(steps + 1), desc="GD steps") if show_progress else range(steps + 1):
        if t % every == 0 or t == steps:
            loss = losses(P)
            for b in range(len(nets)):
                row = {"net": b, "variant": variants[b], "step": t, "loss": float(loss[b]), "kappa": math.nan,
                       "rank": 0, "gap": math.nan, "lambda_max": math.nan}
                if spectrum:
                    row["eig"] = None
                if math.isfinite(row["loss"]):                       # a diverged network keeps NaN curvature
                    J = _jacobian_at(base, {k: v[b] for k, v in P.items()}, X)
                    lam = torch.linalg.eigvalsh(kept_gram(J, keep[b]) / n).flip(0)
                    c = condition_number(lam)
                    row.update(kappa=c.kappa, rank=c.rank, gap=c.gap, lambda_max=c.lambda_max)
                    if spectrum:
                        row["eig"] = lam.cpu().numpy()
                rows.append(row)
        if t < steps:
            g = grad(P)
            P = {k: v - eta.view(-1, *[1] * (v.dim() - 1)) * g[k] * M[k] for k, v in P.items()}
    return pd.DataFrame(rows)


def train_pruned(net, masks, X, Y, *, lr: float, steps: int, every: int) -> pd.DataFrame:
    r"""Full-batch gradient descent on :math:`\frac1{2n}\lVert f(X)-Y\rVert^2` over the kept weights (the pruned ones
    stay at zero); returns a frame with ``step``, ``loss`` and ``kappa`` (:func:`gram_condition`), ``rank``, ``gap``,
    ``lambda_max`` at every ``every`` steps and at the end. ``net`` is not modified. One network of
    :func:`train_pruned_many`."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite positive step, got {lr!r}")
    return train_pruned_many([net], [masks], X, Y, lr=lr, steps=steps, every=every).drop(columns=["net", "variant"])
