"""(D, H, W) volume kernels: resampling, HU windows, standardising, the lung mask, patches,
flips, quarter turns and elastic deformation (nearest neighbour for label volumes)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .common import dtype_clip




def zoom_volume(v: np.ndarray, shape: tuple[int, int, int], order: int = 1) -> np.ndarray:
    """Resample a (D, H, W) array onto a grid of ``shape`` with voxel centres aligned at the corners
    of the field of view scaled by the size ratio (scipy.ndimage.zoom, ``grid_mode=True``).

    Every order interpolates: the result at an output voxel centre that falls on an input voxel
    centre is that voxel's value. Orders 0 (nearest, for label volumes) and 1 (linear) need no
    prefilter; orders 2 and 3 (quadratic, cubic B-splines) prefilter the data into spline
    coefficients first (without it the spline would smooth: an impulse upsampled 3x loses 70%
    of its peak). Cubic can overshoot near sharp edges; integer volumes are rounded and clipped."""
    from scipy import ndimage

    shape = tuple(int(s) for s in shape)
    if any(s < 1 for s in shape):
        raise ValueError(f"cannot resample to shape {shape}")
    if tuple(v.shape) == shape:
        return v.copy()
    src = v.astype(np.float32) if order > 0 else v
    factors = [s / d for s, d in zip(shape, v.shape)]
    out = ndimage.zoom(src, factors, order=order, mode="grid-constant" if order == 0 else "nearest",
                       grid_mode=True, prefilter=order > 1)
    if out.shape != shape:  # zoom rounds the output shape itself; pin it exactly
        fix = np.zeros(shape, out.dtype)
        sl = tuple(slice(0, min(a, b)) for a, b in zip(shape, out.shape))
        fix[sl] = out[sl]
        out = fix
    if np.issubdtype(v.dtype, np.integer) and out.dtype != v.dtype:
        info = np.iinfo(v.dtype)
        out = np.clip(np.rint(out), info.min, info.max)
    return out.astype(v.dtype, copy=False)


def spacing_shape(shape: tuple[int, ...], spacing: tuple[float, ...], target: tuple[float, ...]) -> tuple[int, ...]:
    """The grid size that covers the same extent as ``shape`` x ``spacing`` at ``target`` spacing."""
    return tuple(max(1, int(round(n * s / t))) for n, s, t in zip(shape, spacing, target))


def hu_window(v: np.ndarray, lo: float, hi: float, dtype: str = "float32") -> np.ndarray:
    """Clip to [lo, hi] and scale to [0, 1] (float32) or [0, 255] (uint8)."""
    if hi <= lo:
        raise ValueError(f"window upper bound {hi} must exceed the lower {lo}")
    x = (np.clip(v.astype(np.float32), lo, hi) - np.float32(lo)) / np.float32(hi - lo)
    if dtype == "uint8":
        return np.rint(x * 255).astype(np.uint8)
    return x.astype(np.float32)


def standardise(v: np.ndarray, mean: float, std: float) -> np.ndarray:
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    return ((v.astype(np.float32) - np.float32(mean)) / np.float32(std)).astype(np.float32)


def lung_mask(v: np.ndarray, threshold: float = -320.0, max_components: int = 2, min_fraction: float = 0.001,
              fill_holes: bool = True, closing: int = 1) -> np.ndarray:
    """A lung mask from a CT volume in HU: (D, H, W) -> (D, H, W) uint8 in {0, 1}.

    Voxels below ``threshold`` are air; air connected to the in-plane border of
    any slice (the room around the patient) is removed; of the remaining 3D
    connected components the ``max_components`` largest that hold at least
    ``min_fraction`` of the volume are kept; holes (vessels, nodules) are filled
    slice by slice and the mask is closed with a ball of radius ``closing``.
    """
    from scipy import ndimage

    if v.ndim != 3:
        raise ValueError(f"lung_mask needs a (D, H, W) volume, got shape {v.shape}")
    air = v < threshold
    # label air per slice in 2D to find what touches the in-plane border (outside the body)
    outside = np.zeros_like(air)
    for z in range(air.shape[0]):
        lab, n = ndimage.label(air[z])
        if n == 0:
            continue
        border = np.unique(np.concatenate([lab[0], lab[-1], lab[:, 0], lab[:, -1]]))
        outside[z] = np.isin(lab, border[border > 0])
    body_air = air & ~outside
    lab, n = ndimage.label(body_air, structure=ndimage.generate_binary_structure(3, 1))
    mask = np.zeros(v.shape, np.uint8)
    if n == 0:
        return mask
    sizes = np.bincount(lab.ravel())[1:]
    order = np.argsort(-sizes, kind="stable")
    keep = [i + 1 for i in order[:max_components] if sizes[i] >= min_fraction * v.size]
    m = np.isin(lab, keep)
    if closing > 0:
        r = int(closing)
        zz, yy, xx = np.mgrid[-r:r + 1, -r:r + 1, -r:r + 1]
        ball = (zz * zz + yy * yy + xx * xx) <= r * r
        m = ndimage.binary_closing(np.pad(m, r), structure=ball)[r:-r, r:-r, r:-r]
    if fill_holes:
        for z in range(m.shape[0]):
            m[z] = ndimage.binary_fill_holes(m[z])
    mask[m] = 1
    return mask


def patch_corners(shape: tuple[int, ...], size: tuple[int, ...], stride: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Corners of overlapping windows of ``size`` every ``stride`` that cover ``shape``; the last
    window on each axis is moved back to end at the border, so the whole extent is covered."""
    axes = []
    for n, s, st in zip(shape, size, stride):
        if n < s:
            raise ValueError(f"extent {n} is smaller than the patch size {s}")
        starts = list(range(0, n - s + 1, st))
        if starts[-1] != n - s:
            starts.append(n - s)
        axes.append(starts)
    import itertools

    return [tuple(c) for c in itertools.product(*axes)]


def center_offset(n: int, s: int) -> int:
    """Where a centred crop (n >= s) or pad (n < s, negative) of an extent ``n`` to ``s`` starts in it."""
    return (n - s) // 2 if n >= s else -((s - n) // 2)


def pad_crop_center(a: np.ndarray, shape: tuple[int, ...], value: float = 0) -> tuple[np.ndarray, tuple[int, ...]]:
    """Centre-crop or pad the leading ``len(shape)`` axes to ``shape``.

    Returns the array and, per axis, the offset of the output's origin in the
    input (negative where padded)."""
    out = np.full(tuple(shape) + a.shape[len(shape):], value, dtype=a.dtype)
    src, dst, offs = [], [], []
    for n, s in zip(a.shape, shape):
        off = center_offset(n, s)
        offs.append(int(off))
        if n >= s:  # crop (off >= 0); padding by one voxel gives off == 0 too, hence not "off >= 0"
            src.append(slice(off, off + s))
            dst.append(slice(0, s))
        else:
            src.append(slice(0, n))
            dst.append(slice(-off, -off + n))
    out[tuple(dst)] = a[tuple(src)]
    return out, tuple(offs)


def flip_axes(a: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    return np.flip(a, axis=tuple(axes)).copy() if axes else a.copy()


def rot90(a: np.ndarray, k: int, plane: Sequence[int]) -> np.ndarray:
    return np.rot90(a, k, axes=tuple(plane)).copy()


def _index_probe(op: Callable[[np.ndarray], np.ndarray], shape: Sequence[int], axis: int) -> np.ndarray:
    """``op`` applied to a (zero-stride, never copied) array holding each voxel's index along ``axis``."""
    ramp = np.arange(shape[axis]).reshape([-1 if i == axis else 1 for i in range(3)])
    return op(np.broadcast_to(ramp, tuple(shape)))


def voxel_map(op: Callable[[np.ndarray], np.ndarray], shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """How an axis permutation / flip / shift ``op`` (a function of a (D, H, W) array, e.g.
    ``np.rot90`` or ``np.flip``) moves voxels of a ``shape`` volume: ``(P, t)`` with
    ``old_index = P @ new_index + t``, P a signed permutation (3, 3) and t the old index of
    the new voxel (0, 0, 0). Found by running ``op`` itself on index ramps (views, no copies),
    so it cannot disagree with what ``op`` does to the data."""
    P = np.zeros((3, 3), np.int64)
    t = np.zeros(3, np.int64)
    for a in range(3):
        g = _index_probe(op, (2, 2, 2), a)   # P does not depend on the size; a 2-cube shows every axis
        if g.shape != (2, 2, 2):
            raise ValueError("not an axis permutation or flip (it changes the shape of a 2x2x2 volume)")
        for b in range(3):
            e = [0, 0, 0]
            e[b] = 1
            P[a, b] = int(g[tuple(e)]) - int(g[0, 0, 0])
        t[a] = int(_index_probe(op, shape[:3], a)[0, 0, 0])
    if sorted(np.abs(P).sum(axis=0)) != [1, 1, 1] or sorted(np.abs(P).sum(axis=1)) != [1, 1, 1]:
        raise ValueError("not an axis permutation or flip")
    return P, t


def elastic_displacement(shape: Sequence[int], grid: int, magnitude: float, seed: int) -> np.ndarray:
    """A smooth (3, D, H, W) float32 displacement: a ``grid``^3 lattice of N(0, magnitude)
    voxel offsets from ``default_rng(seed)``, upsampled with cubic splines."""
    coarse = np.random.default_rng(seed).standard_normal((3, grid, grid, grid)) * magnitude
    wz, wy, wx = (_spline_matrix(int(n), grid) for n in shape[:3])
    # cubic-spline upsampling is separable: one small matrix per axis. Plain einsum loops (no
    # BLAS, whose thread count could change the summation order and so the bytes)
    t = np.einsum("ck,dijk->dijc", wx, coarse, optimize=False)
    t = np.einsum("bj,dijc->dibc", wy, t, optimize=False)
    return np.einsum("ai,dibc->dabc", wz, t, optimize=False).astype(np.float32)


def _spline_matrix(n: int, g: int) -> np.ndarray:
    """(n, g): row i weights the g lattice values for output position i (``ndimage.zoom``, cubic)."""
    from scipy import ndimage

    eye = np.eye(g)
    return np.stack([ndimage.zoom(eye[j], n / g, order=3, mode="nearest")[:n] for j in range(g)], axis=1)


def elastic(a: np.ndarray, grid: int, magnitude: float, seed: int, label: bool = False) -> np.ndarray:
    """Deform a (D, H, W[, ...]) volume by :func:`elastic_displacement` with
    ``scipy.ndimage.map_coordinates``: linear, or nearest for a label volume (``label``); edges repeated."""
    if magnitude == 0:
        return a.copy()
    from scipy import ndimage

    shp = a.shape[:3]
    disp = elastic_displacement(shp, grid, magnitude, seed)
    coords = np.indices(shp, dtype=np.float32) + disp
    order = 0 if label else 1
    flat = a.reshape(*shp, -1)
    out = np.empty_like(flat)
    for c in range(flat.shape[-1]):
        ch = flat[..., c]
        if order == 0:
            out[..., c] = ndimage.map_coordinates(ch, coords, order=0, mode="nearest", output=ch.dtype)
        else:
            r = ndimage.map_coordinates(ch.astype(np.float64), coords, order=1, mode="nearest")
            out[..., c] = dtype_clip(r, a.dtype)
    return out.reshape(a.shape)
