"""The Loader's random device steps beyond flip and crop (issue 35): drawn per sample per epoch from the
seeded stream (:func:`~precompile.reader.gpu.step_params`), applied with torch on whatever device the batch
is on.

Geometric twins of build steps (same names, options and per-kind rules; the draw is the build step's own
method, the coordinate map its ``coord_map``, boxes and keypoints move by its ``move_boxes`` /
``move_keypoints`` and a dropped box renumbers a tied instance mask: :func:`~precompile.reader.gpu.run_steps`):

- :class:`RandomResizedCrop` (``random_resized_crop``): the window resized with OpenCV's own tap rules
  (``linear``: ``INTER_LINEAR``'s, ``area``: ``INTER_AREA``'s, ``auto`` per sample: area when the window
  shrinks, else linear; masks: ``INTER_NEAREST_EXACT``'s integer rule, exact), the taps computed on the
  batch's device from the windows (:func:`device_taps`, equal to the host tables bit for bit), then per axis a
  few row copies and weighted sums for the whole batch; flow by the build's ``resize_flow`` rule
  (validity-weighted, vectors scaled).
- :class:`RandomAffine` (``random_affine``): the build's inverse map per sample, sampled as ``cv2.remap``
  (OpenCV 5) samples (bilinear at the float coordinates, each uncovered tap ``fill``; integers rounded),
  masks by the build's nearest rule; flow validity-weighted and its vectors turned.

Value steps (images and clips only; masks, flow and annotations are kept):

- :class:`ColorJitter` (``color_jitter``): the build's brightness, contrast, saturation rule
  (:func:`~precompile.transforms.kernels.colour.color_jitter`, in that order), plus ``hue`` (torchvision's
  ``adjust_hue`` through HSV, applied last; a device-only option: the build step has none).
- :class:`RandomGrayscale` (``random_grayscale``, torchvision v2's ``p``): the build's luma rule (uint8: the
  integer rule of ``convert: gray8``; floats: 0.299, 0.587, 0.114), in every colour channel.
- :class:`GaussianBlur` (``gaussian_blur``, torchvision v2's ``kernel_size``, ``sigma``): a separable
  gaussian per sample, reflected at the edges (OpenCV's ``BORDER_REFLECT_101``).
- :class:`RandomErasing` (``random_erasing``, torchvision v2's ``p``, ``scale``, ``ratio``, ``value``): one
  rectangle per sample set to ``value``.

Integer results are rounded (half to even, as OpenCV's ``saturate_cast``) and clipped to the dtype. Only the
Loader imports this module.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Union

import numpy as np
import torch
from pydantic import Field, field_validator

from ..kinds import Kind, kinds
from ..optschema import checked
from ..transforms import colour, geometry
from ..transforms.base import RandomParams, RandomStep, range_param, uniform
from ..transforms.kernels.common import load_cv2
from ..transforms.kernels.geometry import affine_matrix, resize_hwc
from . import gpu
from .gpu import _SIGNED_TWIN, BatchStep, to_device


# -- helpers ----------------------------------------------------------------------------------------
def _fold(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(N, H, W, C) as it is; a clip (N, T, H, W, C) as (N, H, W, T * C): every frame moves in one call."""
    if x.ndim == 4:
        return x, lambda y: y
    n, t, h, w, c = x.shape
    y = x.permute(0, 2, 3, 1, 4).reshape(n, h, w, t * c)

    def unfold(z: torch.Tensor) -> torch.Tensor:
        return z.reshape(z.shape[0], z.shape[1], z.shape[2], t, c).permute(0, 3, 1, 2, 4).contiguous()
    return y, unfold


def _to_dtype(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float results as ``dtype``: integers rounded (half to even) and clipped to their range (``f`` is
    used up: rounded in place)."""
    if dtype.is_floating_point:
        return f.to(dtype)
    info = torch.iinfo(dtype)
    return f.round_().clamp_(info.min, info.max).to(dtype)


def _per_sample(a: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """(n,) float values as a float32 tensor on ``x``'s device, shaped to broadcast over ``x``'s samples."""
    return to_device(np.asarray(a, np.float32), x.device).view((-1,) + (1,) * (x.ndim - 1))


def _uniform_n(rng: np.random.Generator, r: list[float], n: int) -> np.ndarray:
    """``n`` draws of the build's ``uniform`` rule at once: ``r[0]`` when the range is one value (nothing drawn),
    else uniform on [r[0], r[1])."""
    if r[0] == r[1]:
        return np.full(n, float(r[0]) + 0.0)
    return rng.uniform(r[0], r[1], n)


def _stack_draws(draws: list[dict[str, Any]], keys: tuple[str, ...], dtype: Any) -> dict[str, np.ndarray]:
    return {k: np.array([d[k] for d in draws], dtype=dtype).reshape(len(draws)) for k in keys}


# -- OpenCV's resize taps (one axis, one sample) -------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _taps_nearest(length: int, out: int) -> np.ndarray:
    """The source index of each of ``out`` pixels resized from ``length`` with nearest neighbour: the build's
    own kernel (``resize_hwc``, OpenCV's ``INTER_NEAREST_EXACT``) run on the indices themselves, so every tie
    breaks the build's way. Read-only (cached)."""
    ids = np.arange(length, dtype=np.uint16).reshape(1, length, 1)
    idx = resize_hwc(ids, 1, out, "nearest").reshape(out).astype(np.int64)
    idx.flags.writeable = False
    return idx


def _frozen(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    for a in arrays:
        a.flags.writeable = False
    return arrays


def cv_scale(length: Any, out: Any) -> Any:
    """OpenCV's source step per output pixel: ``1 / (out / length)`` (``scale_x = 1. / inv_scale_x`` in
    ``cv::resize``), not ``length / out``: the two differ in the last bit, and where ``d * scale`` lands on a whole
    number the floor takes another source pixel (14 -> 18 under INTER_AREA: output column 9 read source column
    7 where OpenCV reads 6). Numbers or numpy arrays."""
    return 1.0 / (np.asarray(out, np.float64) / np.asarray(length, np.float64))


@functools.lru_cache(maxsize=4096)
def _taps_linear(length: int, out: int, area_up: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``INTER_LINEAR``'s two taps (or ``INTER_AREA``'s when an axis grows): indices (out, 2), weights (out, 2).
    Read-only (cached: a batch's windows share a few lengths)."""
    scale = cv_scale(length, out)
    d = np.arange(out, dtype=np.float64)
    if area_up:
        sx = np.floor(d * scale).astype(np.int64)
        fx = ((d + 1) - (sx + 1) / scale).astype(np.float32).astype(np.float64)
        fx = np.where(fx <= 0, 0.0, fx - np.floor(fx))
    else:
        f = ((d + 0.5) * scale - 0.5).astype(np.float32).astype(np.float64)
        sx = np.floor(f).astype(np.int64)
        fx = f - sx
    low = sx < 0
    sx, fx = np.where(low, 0, sx), np.where(low, 0.0, fx)
    high = sx >= length - 1
    sx, fx = np.where(high, length - 1, sx), np.where(high, 0.0, fx)
    idx = np.stack([sx, np.minimum(sx + 1, length - 1)], axis=1)
    return _frozen(idx, np.stack([1 - fx, fx], axis=1))


@functools.lru_cache(maxsize=4096)
def _taps_area(length: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """``INTER_AREA``'s taps when the axis shrinks: each output pixel's share of the input pixels it covers.
    Read-only (cached)."""
    scale = cv_scale(length, out)
    rows: list[list[tuple[int, float]]] = []
    for dx in range(out):
        fsx1 = dx * scale
        fsx2 = fsx1 + scale
        cell = min(scale, length - fsx1)
        sx1, sx2 = math.ceil(fsx1), math.floor(fsx2)
        sx2 = min(sx2, length - 1)
        sx1 = min(sx1, sx2)
        r = []
        if sx1 - fsx1 > 1e-3:
            r.append((sx1 - 1, (sx1 - fsx1) / cell))
        r += [(sx, 1.0 / cell) for sx in range(sx1, sx2)]
        if fsx2 - sx2 > 1e-3:
            r.append((sx2, min(min(fsx2 - sx2, 1.0), cell) / cell))
        rows.append(r)
    k = max(len(r) for r in rows)
    idx = np.zeros((out, k), np.int64)
    w = np.zeros((out, k), np.float64)
    for i, r in enumerate(rows):
        for j, (s, v) in enumerate(r):
            idx[i, j], w[i, j] = s, v
    return _frozen(idx, w)


def resize_taps(mode: str, starts: np.ndarray, lengths: np.ndarray, out: int,
                other: tuple[np.ndarray, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, one axis of OpenCV's resize of the window ``[start, start + length)`` to ``out`` pixels:
    source indices (n, out, K) into the whole axis and weights (n, out, K) (K: the batch's largest tap count,
    zero weights past a sample's own). ``mode``: linear, area (OpenCV's area rule: a growing axis, or the
    other axis ``other`` = (lengths, out) growing, takes its linear-like taps), or nearest (K = 1)."""
    n = len(starts)
    lengths = np.asarray(lengths, np.int64)
    if mode == "area":   # each sample's rule: area taps where both axes shrink, else the area-up ones
        grows = lengths < out if other is None else (lengths < out) | (np.asarray(other[0]) < other[1])
        keys = lengths * 2 + grows
    else:
        keys = lengths
    uniq, inv = np.unique(keys, return_inverse=True)   # one table per distinct window length (few per batch)
    tables = []
    for key in uniq.tolist():
        L = key // 2 if mode == "area" else key
        if mode == "nearest":
            tables.append((_taps_nearest(L, out)[:, None], np.ones((out, 1))))
        elif mode == "linear":
            tables.append(_taps_linear(L, out))
        else:
            tables.append(_taps_linear(L, out, area_up=True) if key % 2 else _taps_area(L, out))
    k = max((t[0].shape[1] for t in tables), default=1)
    ti = np.zeros((len(tables), out, k), np.int64)
    tw = np.zeros((len(tables), out, k), np.float64)
    for j, (a, b) in enumerate(tables):
        ti[j, :, :a.shape[1]], tw[j, :, :a.shape[1]] = a, b
    return ti[inv.reshape(n)] + np.asarray(starts, np.int64).reshape(n, 1, 1), tw[inv.reshape(n)]


def _gather(x: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``x`` (n, ...) gathered along ``dim`` with a per-sample index (n, m): whole rows (or pixels) copied by
    advanced indexing where torch has the kernel (measured faster on an H200 than ``gather`` with an expanded
    index; uint16 has no CUDA indexing kernel: ``gather`` there)."""
    if x.ndim == 4 and dim in (1, 2) and x.dtype not in _SIGNED_TWIN:
        b = torch.arange(x.shape[0], device=x.device)
        if dim == 1:
            return x[b[:, None], idx]
        return x[b[:, None, None], torch.arange(x.shape[1], device=x.device)[None, :, None], idx[:, None, :]]
    shape = list(x.shape)
    shape[dim] = idx.shape[1]
    view = [idx.shape[0]] + [1] * (x.ndim - 1)
    view[dim] = idx.shape[1]
    return torch.gather(x, dim, idx.view(view).expand(shape))


#: tap rules of :func:`device_taps`, per sample
LINEAR, AREA_UP, AREA_DOWN = 0, 1, 2


def tap_count(codes: np.ndarray, lengths: np.ndarray, out: int) -> int:
    """The most taps any sample of one axis needs: 2 for the linear rules, the widest area table otherwise
    (the host's cached tables: a few distinct window lengths per batch)."""
    down = np.asarray(lengths)[np.asarray(codes) == AREA_DOWN]
    k = 2 if (np.asarray(codes) != AREA_DOWN).any() else 1
    for L in np.unique(down).tolist():
        k = max(k, _taps_area(int(L), out)[0].shape[1])
    return k


def device_taps(starts: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: int,
                k: int, rules: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`resize_taps` computed on the tensors' device from each sample's window (``starts``, ``lengths``:
    (n,) float64), rule (``codes``: LINEAR, AREA_UP, AREA_DOWN) and ``scales`` (:func:`cv_scale`, divided on
    the host: CUDA divides a tensor by a number as a product with its reciprocal, not always the quotient):
    source indices (k, n, out) int64 into the whole axis and float32 weights (k, n, out), each tap in the host
    tables' slot, with the same float64 arithmetic (so the same float32 weights); slots past a sample's own
    taps weigh 0 at index ``start``. ``rules``: the codes some sample takes (the others are not computed).
    Only the windows cross to the device (a few numbers a sample), not the tables."""
    dev = starts.device
    f64 = torch.float64
    L, s0, code, scale = lengths[:, None], starts[:, None], codes[:, None], scales[:, None]
    d = torch.arange(out, dtype=f64, device=dev)[None]
    zero = torch.zeros((), dtype=f64, device=dev)
    idx = w = None
    if rules & {LINEAR, AREA_UP}:   # INTER_LINEAR and the area rule of a growing axis: two taps
        if LINEAR in rules:
            f = ((d + 0.5) * scale - 0.5).to(torch.float32).to(f64)
            sx = torch.floor(f)
            fx = f - sx
        if AREA_UP in rules:
            sxu = torch.floor(d * scale)
            fxu = ((d + 1) - (sxu + 1) / scale).to(torch.float32).to(f64)
            fxu = torch.where(fxu <= 0, zero, fxu - torch.floor(fxu))
            if LINEAR in rules:
                up = code == AREA_UP
                sx, fx = torch.where(up, sxu, sx), torch.where(up, fxu, fx)
            else:
                sx, fx = sxu, fxu
        low = sx < 0
        sx, fx = torch.where(low, zero, sx), torch.where(low, zero, fx)
        high = sx >= L - 1
        sx, fx = torch.where(high, L - 1, sx), torch.where(high, zero, fx)
        idx, w = torch.stack([sx, torch.minimum(sx + 1, L - 1)]), torch.stack([1 - fx, fx])   # (2, n, out)
        if k > 2:
            pad = torch.zeros((k - 2,) + idx.shape[1:], dtype=f64, device=dev)
            idx, w = torch.cat([idx, pad]), torch.cat([w, pad])
        elif k == 1:
            idx, w = idx[:1], w[:1]
    if AREA_DOWN in rules:   # INTER_AREA shrinking: a partial tap on the left, whole ones, a partial one on the right
        fsx1 = d * scale
        fsx2 = fsx1 + scale
        cell = torch.minimum(scale.expand_as(fsx1), L - fsx1)
        sx2 = torch.minimum(torch.floor(fsx2), L - 1)
        sx1 = torch.minimum(torch.ceil(fsx1), sx2)
        left = (sx1 - fsx1) > 1e-3
        right = (fsx2 - sx2) > 1e-3
        j = torch.arange(k, dtype=f64, device=dev).view(k, 1, 1)
        s = sx1 - left.to(f64) + j                                               # (k, n, out)
        whole = (s >= sx1) & (s < sx2)
        is_left = left & (j == 0)
        is_right = right & (s == sx2)
        part = torch.clamp(torch.clamp(fsx2 - sx2, max=1.0), max=cell) / cell
        w_area = torch.where(is_left, (sx1 - fsx1) / cell, torch.where(whole, 1.0 / cell,
                                                                        torch.where(is_right, part, zero)))
        idx_area = torch.where(is_left | whole | is_right, s, zero)
        if idx is None:
            idx, w = idx_area, w_area
        else:
            down = code == AREA_DOWN
            idx, w = torch.where(down, idx_area, idx), torch.where(down, w_area, w)
    return (idx + s0).to(torch.int64), w.to(torch.float32)


def _row_taps(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` (n, L, R...) resampled along axis 1 with per-sample taps (k, n, m): sum_k w[k] * x[idx[k]] in
    order, float32 (n, m, R...). Each tap copies whole rows with one ``index_select`` over the batch's rows
    (a row copy at memory speed) and adds them weighted in one pass (``addcmul``: an integer ``x`` is widened
    inside it, never copied as floats)."""
    n, L = x.shape[0], x.shape[1]
    rows = x.reshape((n * L,) + tuple(x.shape[2:]))
    base = (torch.arange(n, device=x.device) * L).view(1, n, 1)
    flat = (idx + base).reshape(idx.shape[0], -1)
    shape = (n, idx.shape[2]) + tuple(x.shape[2:])
    view = (n, idx.shape[2]) + (1,) * (x.ndim - 2)
    acc = None
    for t in range(idx.shape[0]):
        g = rows.index_select(0, flat[t]).view(shape)
        if acc is None:
            acc = torch.mul(g, w[t].view(view)) if g.dtype != torch.float32 else g.mul_(w[t].view(view))
        else:
            acc.addcmul_(g, w[t].view(view))
    return acc


def _gather_nearest(x: torch.Tensor, iy: np.ndarray, ix: np.ndarray) -> torch.Tensor:
    """``x`` (n, H, W, C) of any dtype at per-sample row and column indices (n, h), (n, w): values copied."""
    twin = _SIGNED_TWIN.get(x.dtype)
    if twin is not None:
        return _gather_nearest(x.view(twin), iy, ix).view(x.dtype)
    dev = x.device
    y = _gather(x, 1, to_device(iy, dev))
    return _gather(y, 2, to_device(ix, dev))


# -- random_resized_crop -------------------------------------------------------------------------------------
class RandomResizedCrop(gpu.SizedStep):
    """``random_resized_crop``: the build step's window (its ``draw_window``) resized to ``size`` with
    OpenCV's taps; masks nearest (exact), flow by ``resize_flow``'s rule."""

    name = "random_resized_crop"
    STEP = geometry.RandomResizedCrop
    resamples = True

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        if self.params.interpolation == "cubic":
            raise ValueError(f"{self.name}: interpolation 'cubic' has no device kernel; use auto, area, linear "
                             f"or nearest")
        return super().bind(specs, shapes)

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        return self.step.draw_windows(rng, *self.hw, n)

    def _modes(self, height: np.ndarray, width: np.ndarray, mode: str) -> np.ndarray:
        h, w = self.params.size
        if mode != "auto":
            return np.full(len(height), mode)
        return np.where((height >= h) & (width >= w), "area", "linear")   # resize_hwc's auto rule

    def _resize(self, x: torch.Tensor, top, left, height, width, modes: np.ndarray) -> torch.Tensor:
        """(n, H, W, C) -> float (n, h, w, C), each sample with its mode's taps (linear, or area: OpenCV's
        area-up rule on both axes where either grows), across each row first, then down (OpenCV's order). The
        taps are computed on ``x``'s device from the windows (:func:`device_taps`); each axis is a few row
        copies and weighted sums for the whole batch."""
        if x.dtype in _SIGNED_TWIN:
            x = x.to(torch.float32)
        ix, wx, iy, wy = self.taps(x.device, top, left, height, width, modes)
        cols = _row_taps(x.transpose(1, 2), ix, wx)            # (n, w, H, C): the columns of each window
        return _row_taps(cols.transpose(1, 2), iy, wy)         # (n, h, w, C)

    def taps(self, device: torch.device, top, left, height, width,
             modes: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sample's column and row taps on ``device`` (:func:`device_taps`, with its mode's rule: linear,
        or area: OpenCV's area-up rule on both axes where either grows): ``ix``, ``wx`` (kx, n, w) and ``iy``,
        ``wy`` (ky, n, h): what :meth:`_resize` sums (and the fused kernel, :mod:`~precompile.reader.fused`)."""
        h, w = self.params.size
        windows, kx, ky, rules = self.tap_windows(top, left, height, width, modes)
        t = to_device(windows, device)
        ix, wx = device_taps(*t[:4], w, kx, rules)
        iy, wy = device_taps(*t[4:], h, ky, rules)
        return ix, wx, iy, wy

    def tap_windows(self, top, left, height, width, modes: np.ndarray) -> tuple[np.ndarray, int, int, set[int]]:
        """What :func:`device_taps` computes the taps from, for both axes: (8, n) float64 rows left, width, rule,
        scale, top, height, rule, scale (:func:`cv_scale`; the rule: LINEAR, AREA_UP, AREA_DOWN); the tap counts of the
        columns and of the rows; the rules some sample takes."""
        h, w = self.params.size
        grows = (np.asarray(height) < h) | (np.asarray(width) < w)
        codes = np.where(modes == "area", np.where(grows, AREA_UP, AREA_DOWN), LINEAR)
        width, height = np.asarray(width, np.float64), np.asarray(height, np.float64)
        windows = np.stack([left, width, codes, cv_scale(width, w), top, height, codes,
                            cv_scale(height, h)]).astype(np.float64)
        return windows, tap_count(codes, width, w), tap_count(codes, height, h), set(codes.tolist())

    def apply_image(self, x: torch.Tensor, top, left, height, width) -> torch.Tensor:
        y, unfold = _fold(x)
        modes = self._modes(height, width, self.params.interpolation)
        if (modes == "nearest").all():
            return self.apply_mask(x, top, left, height, width)
        r = self._resize(y if y.dtype == torch.uint8 else y.to(torch.float32), top, left, height, width, modes)
        return unfold(_to_dtype(r, x.dtype))

    def apply_mask(self, x: torch.Tensor, top, left, height, width) -> torch.Tensor:
        y, unfold = _fold(x)
        h, w = self.params.size
        iy = np.stack([_taps_nearest(int(L), h) + int(s) for s, L in zip(top, height)]) if len(top) else \
            np.zeros((0, h), np.int64)
        ix = np.stack([_taps_nearest(int(L), w) + int(s) for s, L in zip(left, width)]) if len(left) else \
            np.zeros((0, w), np.int64)
        return unfold(_gather_nearest(y, iy, ix))

    def apply_flow(self, x: torch.Tensor, top, left, height, width) -> torch.Tensor:
        h, w = self.params.size
        valid = torch.isfinite(x).all(-1, keepdim=True)
        f = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).to(torch.float32)
        v = valid.to(torch.float32)
        modes = np.where((height >= h) & (width >= w), "area", "linear")   # resize_flow: area when shrinking
        r = self._resize(torch.cat([f * v, v], dim=-1), top, left, height, width, modes)
        num, den = r[..., :2], r[..., 2:]
        ok = den >= 0.5 - 1e-6
        out = torch.where(ok, num / den.clamp(min=1e-6), torch.full((), float("nan"), device=x.device))
        scale = np.stack([w / width, h / height], axis=1).astype(np.float32)
        return (out * to_device(scale, x.device).view(-1, 1, 1, 2)).to(x.dtype)


# -- random_affine -------------------------------------------------------------------------------------------
def _remap_linear(y: torch.Tensor, mx: torch.Tensor, my: torch.Tensor, fill: float) -> torch.Tensor:
    """``cv2.remap``'s linear sampling of (n, H, W, C) at float coordinates (mx, my) (n, H, W), each uncovered
    tap ``fill``, as one ``grid_sample`` call (float32 (n, H, W, C), channels last as a view): bilinear with
    zero padding of ``y - fill``, plus ``fill`` (sum of the covered taps' w * (v - fill) + fill = the covered
    taps' w * v + the uncovered taps' w * fill). Coordinates go to grid_sample's [-1, 1] (align_corners) in
    float64, then float32 (a few 1e-5 px). H and W >= 2."""
    n, H, W, C = y.shape
    gx = mx.to(torch.float64).mul_(2.0 / (W - 1)).sub_(1.0)
    gy = my.to(torch.float64).mul_(2.0 / (H - 1)).sub_(1.0)
    grid = torch.stack([gx, gy], -1).to(torch.float32)
    src = y.to(torch.float32)
    if fill != 0:
        src = src - fill
    out = torch.nn.functional.grid_sample(src.permute(0, 3, 1, 2), grid, mode="bilinear", padding_mode="zeros",
                                          align_corners=True).permute(0, 2, 3, 1)
    return out.add_(fill) if fill != 0 else out



class RandomAffine(BatchStep):
    """``random_affine``: the build step's draw (``draw_affine``) and map, sampled as ``cv2.remap`` samples
    (linear: bilinear at the float coordinates, each uncovered tap ``fill``); masks by the build's nearest
    rule (0 outside); flow validity-weighted, NaN outside, its vectors through the map's linear part."""

    name = "random_affine"
    STEP = geometry.RandomAffine
    resamples = True

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        if self.params.interpolation == "cubic":
            raise ValueError(f"{self.name}: interpolation 'cubic' has no device kernel; use linear or nearest")
        return super().bind(specs, shapes)

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        draws = [self.step.draw_affine(rng, *self.hw) for _ in range(n)]
        return _stack_draws(draws, ("angle", "scale", "tx", "ty"), np.float64)

    def _coords(self, x: torch.Tensor, angle, scale, tx, ty) -> tuple[torch.Tensor, torch.Tensor]:
        """Each output pixel's source coordinates (n, H, W) float32: the build's inverse map (OpenCV's
        ``invertAffineTransform`` of ``affine_matrix``), computed in float64 and cast as the build casts."""
        cv2 = load_cv2()
        H, W = self.hw
        inv = np.stack([cv2.invertAffineTransform(affine_matrix(H, W, a, s, u, v))
                        for a, s, u, v in zip(angle, scale, tx, ty)]) if len(angle) else np.zeros((0, 2, 3))
        m = to_device(inv, x.device).view(-1, 2, 3, 1, 1)
        ys = torch.arange(H, dtype=torch.float64, device=x.device).view(1, H, 1)
        xs = torch.arange(W, dtype=torch.float64, device=x.device).view(1, 1, W)
        mx = m[:, 0, 0] * xs + m[:, 0, 1] * ys + m[:, 0, 2]
        my = m[:, 1, 0] * xs + m[:, 1, 1] * ys + m[:, 1, 2]
        return mx.to(torch.float32), my.to(torch.float32)

    def _sample(self, y: torch.Tensor, mx: torch.Tensor, my: torch.Tensor, fill: float,
                nearest: bool) -> torch.Tensor:
        """(n, H, W, C) sampled at (mx, my): nearest (values copied, ``fill`` outside) or remap's linear
        (float32 result)."""
        n, H, W, C = y.shape
        flat = y.reshape(n, H * W, C)

        def take(xi: torch.Tensor, yi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            inside = (xi >= 0) & (xi < W) & (yi >= 0) & (yi < H)
            i = (yi.clamp(0, H - 1) * W + xi.clamp(0, W - 1)).reshape(n, H * W)
            return _gather(flat[..., None], 1, i)[..., 0].reshape(n, H, W, C), inside[..., None]

        if nearest:
            twin = _SIGNED_TWIN.get(y.dtype)
            if twin is not None:
                fv = gpu._twin_value(fill, y.dtype, twin)
                return self._sample(y.view(twin), mx, my, fv, True).view(y.dtype)
            v, inside = take(torch.floor(mx + 0.5).long(), torch.floor(my + 0.5).long())
            return torch.where(inside, v, torch.full((), fill, dtype=y.dtype, device=y.device))
        if H >= 2 and W >= 2 and math.isfinite(fill):
            return _remap_linear(y, mx, my, float(fill))
        fx0, fy0 = torch.floor(mx), torch.floor(my)
        x0, y0 = fx0.long(), fy0.long()
        fx, fy = (mx - fx0)[..., None], (my - fy0)[..., None]
        yf = y.to(torch.float32)
        flat = yf.reshape(n, H * W, C)
        out = None
        for dy, wy in ((0, 1 - fy), (1, fy)):
            for dx, wx in ((0, 1 - fx), (1, fx)):
                v, inside = take(x0 + dx, y0 + dy)
                term = torch.where(inside, v, torch.full((), float(fill), device=y.device)) * (wy * wx)
                out = term if out is None else out + term
        return out

    def apply_image(self, x: torch.Tensor, angle, scale, tx, ty) -> torch.Tensor:
        y, unfold = _fold(x)
        mx, my = self._coords(x, angle, scale, tx, ty)
        if self.params.interpolation == "nearest":
            return unfold(self._sample(y, mx, my, self.params.fill, True))
        return unfold(_to_dtype(self._sample(y, mx, my, self.params.fill, False), x.dtype).contiguous())

    def apply_mask(self, x: torch.Tensor, angle, scale, tx, ty) -> torch.Tensor:
        y, unfold = _fold(x)
        mx, my = self._coords(x, angle, scale, tx, ty)
        return unfold(self._sample(y, mx, my, 0, True))

    def apply_flow(self, x: torch.Tensor, angle, scale, tx, ty) -> torch.Tensor:
        mx, my = self._coords(x, angle, scale, tx, ty)
        if self.params.interpolation == "nearest":
            out = self._sample(x.to(torch.float32), mx, my, float("nan"), True)
        else:
            valid = torch.isfinite(x).all(-1, keepdim=True)
            f = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).to(torch.float32)
            r = self._sample(torch.cat([f, valid.to(torch.float32)], -1), mx, my, 0.0, False)
            num, den = r[..., :2], r[..., 2:]
            out = torch.where(den > 1e-3, num / den.clamp(min=1e-3), torch.full((), float("nan"), device=x.device))
        lin = np.stack([affine_matrix(*self.hw, a, s, u, v)[:, :2]
                        for a, s, u, v in zip(angle, scale, tx, ty)]).astype(np.float32) if len(angle) \
            else np.zeros((0, 2, 2), np.float32)
        m = to_device(lin, x.device).view(-1, 1, 1, 2, 2)
        u, v = out[..., 0], out[..., 1]
        return torch.stack([m[..., 0, 0] * u + m[..., 0, 1] * v, m[..., 1, 0] * u + m[..., 1, 1] * v],
                           dim=-1).to(x.dtype)


# -- value steps -----------------------------------------------------------------------------------------------
class _ValueStep(BatchStep):
    """A step that changes image and clip values only (never where they are): no map, masks and flow kept."""

    moves_grid = False

    def apply(self, x: torch.Tensor, kind: Kind, **params: Any) -> torch.Tensor:
        return self.apply_image(x, **params)


def _colour_channels(x: torch.Tensor) -> int:
    """The colour channels a value step changes: the first 3, or the first of 1-2 (an alpha channel is kept)."""
    return 3 if x.shape[-1] >= 3 else 1


def _gray(f: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma of float (..., 3) pixels, the build's float rule (``kernels.colour._gray``): the same
    float32 products and sums, in the same order."""
    g = f[..., 0] * 0.299
    return g.add_(f[..., 1] * 0.587).add_(f[..., 2] * 0.114)


def rgb_to_hsv(rgb: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_rgb2hsv`` on (..., 3) floats in [0, 1]."""
    r, g, b = rgb.unbind(-1)
    maxc, minc = rgb.max(-1).values, rgb.min(-1).values
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    div = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / div, (maxc - g) / div, (maxc - b) / div
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack([h, s, maxc], -1)


def hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_hsv2rgb`` on (..., 3) floats."""
    h, s, v = hsv.unbind(-1)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int32) % 6
    p = (v * (1.0 - s)).clamp(0.0, 1.0)
    q = (v * (1.0 - s * f)).clamp(0.0, 1.0)
    t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0)
    table = ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))
    out = [torch.zeros_like(v) for _ in range(3)]
    for k, row in enumerate(table):
        sel = i == k
        out = [torch.where(sel, c, o) for c, o in zip(row, out)]
    return torch.stack(out, -1)


class _JitterParams(colour.ColorJitter.Params):
    hue: Union[float, list[float]] = Field(0.0, description="hue shift (a fraction of the colour circle) from "
                                           "[-x, x] or [low, high] within [-0.5, 0.5] (torchvision's hue); "
                                           "device only", json_schema_extra=checked(ge=0))

    @field_validator("hue", mode="before")
    @classmethod
    def _h(cls, v: Any) -> Any:
        lo, hi = range_param(v, "hue", symmetric_about=0.0)
        if lo < -0.5 or hi > 0.5:
            raise ValueError("hue: the shift must be within [-0.5, 0.5]")
        return [lo, hi]


class ColorJitter(_ValueStep):
    """``color_jitter``: the build step's brightness, contrast and saturation (drawn in its order, applied by
    its rule), then ``hue`` (torchvision's; on floats in [0, 1], integers scaled by their largest value)."""

    name = "color_jitter"
    STEP = colour.ColorJitter
    Params = _JitterParams

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        p = self.params
        return {k: _uniform_n(rng, getattr(p, k), n) for k in ("brightness", "contrast", "saturation", "hue")}

    def apply_image(self, x: torch.Tensor, brightness, contrast, saturation, hue) -> torch.Tensor:
        cc = _colour_channels(x)
        if (brightness != 1).any() and (not x.dtype.is_floating_point or x.dtype == torch.float32):
            f = torch.mul(x[..., :cc], _per_sample(brightness, x))   # widened to float32 inside the product
        else:   # a new tensor: changed in place below (the build's float32 ops, in order)
            f = x[..., :cc].to(torch.float32)
            if f.data_ptr() == x.data_ptr():
                f = f.clone()
            if (brightness != 1).any():
                f.mul_(_per_sample(brightness, f))
        if (contrast != 1).any():
            gray = _gray(f) if cc == 3 else f[..., 0]
            m = gray.mean(dim=(-2, -1), dtype=torch.float64).to(torch.float32)[..., None, None, None]
            f.mul_(_per_sample(contrast, f)).add_(m.mul_(_per_sample((1 - contrast).astype(np.float32), m)))
        if cc == 3 and (saturation != 1).any():
            g = _gray(f)[..., None]
            f.mul_(_per_sample(saturation, f)).add_(g.mul_(_per_sample((1 - saturation).astype(np.float32), g)))
        if cc == 3 and (hue != 0).any():
            top = 1.0 if x.dtype.is_floating_point else float(torch.iinfo(x.dtype).max)
            hsv = rgb_to_hsv(f.clamp(0, top) / top)
            h = torch.remainder(hsv[..., 0] + _per_sample(hue, hsv[..., 0]), 1.0)
            hued = hsv_to_rgb(torch.stack([h, hsv[..., 1], hsv[..., 2]], -1)) * top
            f = torch.where(_per_sample(hue, f) != 0, hued, f)
        if cc == x.shape[-1]:
            return _to_dtype(f, x.dtype)
        out = x.clone()
        out[..., :cc] = _to_dtype(f, x.dtype)
        return out


class _GrayscaleStep(RandomStep):
    name = "random_grayscale"
    keeps_grid = True
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(RandomParams):
        p: float = Field(0.1, description="probability of turning a sample gray (torchvision's p)",
                         json_schema_extra=checked(ge=0, le=1))

        @field_validator("p")
        @classmethod
        def _p(cls, v: float) -> float:
            if not 0 <= v <= 1:
                raise ValueError("a probability must be within [0, 1]")
            return v


class RandomGrayscale(_ValueStep):
    """``random_grayscale``: with probability ``p`` a sample's colour channels all become its luma (the
    build's rule: uint8 by ``convert: gray8``'s integer formula, floats by 0.299, 0.587, 0.114)."""

    name = "random_grayscale"
    STEP = _GrayscaleStep

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        return {"gray": rng.random(n) < self.params.p}

    def apply_image(self, x: torch.Tensor, gray) -> torch.Tensor:
        if x.shape[-1] < 3 or not gray.any():
            return x
        if x.dtype == torch.uint8:
            r, g, b = (x[..., i].to(torch.int32) for i in range(3))
            luma = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8)
        else:
            luma = _to_dtype(_gray(x[..., :3].to(torch.float32)), x.dtype)
        out = x.clone()
        sel = to_device(gray, x.device).view((-1,) + (1,) * (x.ndim - 2))
        out[..., :3] = torch.where(sel[..., None], luma[..., None].expand_as(x[..., :3]), x[..., :3])
        return out


def _odd_pair(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v, v]
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(k, int) and not isinstance(k, bool)
                                                                 for k in v)):
        raise ValueError(f"expected an odd integer or [height, width] of odd integers, got {v!r}")
    if any(k < 1 or k % 2 == 0 for k in v):
        raise ValueError(f"sizes must be odd and positive, got {list(v)}")
    return [int(v[0]), int(v[1])]


class _BlurStep(RandomStep):
    name = "gaussian_blur"
    keeps_grid = True
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(RandomParams):
        kernel_size: Union[int, list[int]] = Field(description="odd kernel size [height, width] (one integer: "
                                                   "a square)", json_schema_extra=checked(gt=0))
        sigma: Union[float, list[float]] = Field([0.1, 2.0], description="the gaussian's standard deviation "
                                                 "in pixels: x, or [low, high] drawn per sample",
                                                 json_schema_extra=checked(gt=0, item={"gt": 0}))

        @field_validator("kernel_size", mode="before")
        @classmethod
        def _k(cls, v: Any) -> Any:
            return _odd_pair(v)

        @field_validator("sigma", mode="before")
        @classmethod
        def _s(cls, v: Any) -> Any:
            lo, hi = range_param(v, "sigma")
            if lo <= 0:
                raise ValueError("sigma must be positive")
            return [lo, hi]


def gaussian_taps(ksize: int, sigma: np.ndarray) -> np.ndarray:
    """(n, ksize) normalised gaussian weights, one row per sigma (float64)."""
    x = np.arange(ksize, dtype=np.float64) - (ksize - 1) / 2
    k = np.exp(-0.5 * (x[None] / np.asarray(sigma, np.float64)[:, None]) ** 2)
    return k / k.sum(axis=1, keepdims=True)


def _reflect101(n: int, pad: int) -> np.ndarray:
    """Indices of an axis of ``n`` padded by ``pad`` on each side with ``BORDER_REFLECT_101`` (no edge repeat)."""
    i = np.arange(-pad, n + pad)
    if n == 1:
        return np.zeros_like(i)
    period = 2 * (n - 1)
    i = np.abs(i) % period
    return np.where(i >= n, period - i, i)


class GaussianBlur(_ValueStep):
    """``gaussian_blur``: a separable gaussian of ``kernel_size`` with a sigma drawn per sample from
    ``sigma``, edges reflected without repeating the edge pixel (OpenCV's default border, torch's reflect)."""

    name = "gaussian_blur"
    STEP = _BlurStep

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        chosen = super().bind(specs, shapes)
        kh, kw = self.params.kernel_size
        if self.hw is not None and (kh // 2 >= max(self.hw[0], 2) or kw // 2 >= max(self.hw[1], 2)):
            raise ValueError(f"{self.name}: kernel_size {kh}x{kw} reaches past the {self.hw[0]}x{self.hw[1]} "
                             f"grid it blurs; use a kernel under twice the size")
        return chosen

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        return {"sigma": _uniform_n(rng, self.params.sigma, n)}

    def apply_image(self, x: torch.Tensor, sigma) -> torch.Tensor:
        y, unfold = _fold(x)
        f = y.to(torch.float32)
        for dim, k in ((1, self.params.kernel_size[0]), (2, self.params.kernel_size[1])):
            if k == 1:
                continue
            pad = k // 2
            idx = to_device(_reflect101(f.shape[dim], pad), f.device)
            p = f.index_select(dim, idx)
            w = to_device(gaussian_taps(k, sigma).astype(np.float32), f.device)
            view = [-1] + [1] * (f.ndim - 1)
            acc = p.narrow(dim, 0, f.shape[dim]) * w[:, 0].view(view)
            for j in range(1, k):   # each tap added in place: one pass, no new tensor
                acc.addcmul_(p.narrow(dim, j, f.shape[dim]), w[:, j].view(view))
            f = acc
        return unfold(_to_dtype(f, x.dtype))


class _ErasingStep(RandomStep):
    name = "random_erasing"
    keeps_grid = True
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(RandomParams):
        p: float = Field(0.5, description="probability of erasing a rectangle (torchvision's p)",
                         json_schema_extra=checked(ge=0, le=1))
        scale: list[float] = Field([0.02, 0.33], description="[low, high] fraction of the image's area erased",
                                   json_schema_extra=checked(gt=0, le=1, item={"gt": 0, "le": 1}))
        ratio: list[float] = Field([0.3, 3.3], description="[low, high] aspect ratio of the rectangle, drawn "
                                   "log-uniformly (torchvision's rule: height = sqrt(area * ratio))",
                                   json_schema_extra=checked(gt=0, item={"gt": 0}))
        value: Union[float, list[float]] = Field(0, description="the erased pixels' value: one, or one per "
                                                 "channel")

        @field_validator("p")
        @classmethod
        def _p(cls, v: float) -> float:
            if not 0 <= v <= 1:
                raise ValueError("a probability must be within [0, 1]")
            return v

        @field_validator("scale", "ratio", mode="before")
        @classmethod
        def _r(cls, v: Any, info) -> Any:
            lo, hi = range_param(v, info.field_name)
            if lo <= 0 or (info.field_name == "scale" and hi > 1):
                raise ValueError("scale must be within (0, 1]" if info.field_name == "scale"
                                 else "ratio must be positive")
            return [lo, hi]

    def fill_values(self):
        v = self.params.value
        return {f"value[{i}]" if isinstance(v, list) else "value": (x, kinds(Kind.IMAGE, Kind.VIDEO))
                for i, x in enumerate(v if isinstance(v, list) else [v])}


class RandomErasing(_ValueStep):
    """``random_erasing``: with probability ``p`` one rectangle of area ``scale`` and aspect ``ratio``
    (torchvision's draw: 10 tries, else nothing) set to ``value`` in every frame of the sample."""

    name = "random_erasing"
    STEP = _ErasingStep

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        chosen = super().bind(specs, shapes)
        v = self.params.value
        for f in chosen:
            if isinstance(v, list) and len(v) != shapes[f][-1]:
                raise ValueError(f"{self.name}: value has {len(v)} values and field {f!r} has {shapes[f][-1]} "
                                 f"channels")
        return chosen

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        H, W = self.hw
        p = self.params
        lr = (math.log(p.ratio[0]), math.log(p.ratio[1]))
        out = np.zeros((n, 4), np.int64)
        for i in range(n):
            if not rng.random() < p.p:
                continue
            for _ in range(10):
                area = H * W * uniform(rng, p.scale)
                r = math.exp(uniform(rng, lr))
                h, w = int(round(math.sqrt(area * r))), int(round(math.sqrt(area / r)))
                if not (h < H and w < W):
                    continue
                out[i] = (int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w)
                break
        return {"top": out[:, 0], "left": out[:, 1], "height": out[:, 2], "width": out[:, 3]}

    def apply_image(self, x: torch.Tensor, top, left, height, width) -> torch.Tensor:
        if not (height > 0).any():
            return x
        dev = x.device
        H, W = x.shape[-3], x.shape[-2]
        t, l_ = to_device(top, dev).view(-1, 1), to_device(left, dev).view(-1, 1)
        rows = torch.arange(H, device=dev).view(1, H)
        cols = torch.arange(W, device=dev).view(1, W)
        in_y = (rows >= t) & (rows < t + to_device(height, dev).view(-1, 1))
        in_x = (cols >= l_) & (cols < l_ + to_device(width, dev).view(-1, 1))
        box = (in_y[:, :, None] & in_x[:, None, :])[..., None]
        box = box.view((-1,) + (1,) * (x.ndim - 4) + box.shape[1:])
        v = self.params.value
        twin = _SIGNED_TWIN.get(x.dtype)
        vals = np.asarray(v if isinstance(v, list) else [v], np.float64)
        if twin is not None:
            fill = torch.tensor([gpu._twin_value(a, x.dtype, twin) for a in vals], dtype=twin, device=dev)
            return torch.where(box, fill, x.view(twin)).view(x.dtype)
        fill = torch.tensor(vals, dtype=torch.float64).to(x.dtype).to(dev)
        return torch.where(box, fill, x)


#: every device step, by name: the build's twins and the torchvision-named value steps
STEP_NAMES: dict[str, Callable[..., BatchStep]] = {
    **gpu.STEP_NAMES, "random_resized_crop": RandomResizedCrop, "random_affine": RandomAffine,
    "color_jitter": ColorJitter, "random_grayscale": RandomGrayscale, "gaussian_blur": GaussianBlur,
    "random_erasing": RandomErasing}


def parse_steps(steps: Any) -> list[BatchStep]:
    """:func:`~precompile.reader.gpu.parse_steps` with every device step of this module too."""
    return gpu.parse_steps(steps, STEP_NAMES)
