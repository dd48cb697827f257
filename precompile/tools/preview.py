"""``precompile preview``: one PNG contact sheet of a built output, each kind shown as its users look at it.

One row per sample key (evenly spread over the output; ``n`` rows): a header
with the key, the label and small scalar fields, then panels, each drawn by the
renderer registered for its field's kind in :data:`RENDERERS`:

- ``image``: the image; in a build with augmented ``copies``, every copy of the
  key side by side, each captioned with the parameters its steps drew
  (``meta["augment"]``);
- ``mask``: the class map overlaid in colour (class 0 clear, class k the
  palette colour :data:`PALETTE` ``[k]``) on the image of the same size, if any,
  for every copy, and a legend of the classes shown (names where known);
- ``flow``: the Middlebury colour coding of Baker et al. (the ``flow_vis``
  convention: hue is the direction, saturation the magnitude relative to the
  largest in the sample; +u is red), invalid vectors black, and the validity;
- ``volume``: three orthogonal slices with the ``volume_mask`` fields
  overlaid, through the most masked plane along each axis (the centre without
  a mask); CT data is shown in a lung (L -600 / W 1500)
  or soft-tissue (L 40 / W 400) window, any other volume (MRI) in its own
  percentile window, already-windowed data in [0, 1] as it is;
- ``video``: a strip of frames; ``audio``: a waveform and a log-mel spectrogram
  (numpy/scipy, no librosa).

The same output and arguments give a byte-identical PNG: nothing random, no
time stamps, Pillow's built-in font. Nothing here imports torch.
"""
from __future__ import annotations

import base64
import html
import io
import functools
import json
import math
import os
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import PrecompileError
from ..formats import Dataset, open_dataset
from .stats import target_columns


class PreviewError(PrecompileError):
    """A preview cannot be drawn (an unknown field, nothing to show, a bad option)."""

    exit_code = 2


# --- colours ---------------------------------------------------------------------------------

#: class k >= 1 of a mask is drawn in PALETTE[1 + (k - 1) % 19] (class 0, background, is left clear)
PALETTE: tuple[tuple[int, int, int], ...] = (
    (0, 0, 0), (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
    (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128),
    (220, 190, 255), (170, 110, 40), (255, 250, 200), (128, 0, 0), (170, 255, 195), (128, 128, 0),
    (255, 215, 180), (0, 0, 128),
)
MASK_ALPHA = 0.5

#: HU windows as (level, width)
WINDOWS: dict[str, tuple[float, float]] = {"lung": (-600.0, 1500.0), "soft": (40.0, 400.0)}
#: ``window`` choices: a HU window for CT, or ``auto`` (every volume through its percentile window)
WINDOW_CHOICES = (*WINDOWS, "auto")
#: the percentiles of a volume's values that bound its automatic window (non-CT volumes, ``auto``)
AUTO_PERCENTILES = (1.0, 99.0)
CT_AIR = -500.0          # a volume whose values reach this low is taken as CT in HU (air is -1000)

BG = (24, 24, 24)
FG = (235, 235, 235)
DIM = (150, 150, 150)
PANEL_HEIGHT = 96        # panels are scaled up by a whole factor to at least this height
STRIP_FRAMES = 8         # at most this many frames of a video clip
PAD = 6
LEGEND_ROWS = 12         # a mask legend lists at most this many classes


def make_colorwheel() -> np.ndarray:
    """The 55-colour Middlebury flow wheel (Baker et al. 2011; ``flow_vis.make_colorwheel``), (55, 3) 0..255."""
    ry, yg, gc, cb, bm, mr = 15, 6, 4, 11, 13, 6
    wheel = np.zeros((ry + yg + gc + cb + bm + mr, 3))
    c = 0
    wheel[c:c + ry, 0] = 255
    wheel[c:c + ry, 1] = np.floor(255 * np.arange(ry) / ry)
    c += ry
    wheel[c:c + yg, 0] = 255 - np.floor(255 * np.arange(yg) / yg)
    wheel[c:c + yg, 1] = 255
    c += yg
    wheel[c:c + gc, 1] = 255
    wheel[c:c + gc, 2] = np.floor(255 * np.arange(gc) / gc)
    c += gc
    wheel[c:c + cb, 1] = 255 - np.floor(255 * np.arange(cb) / cb)
    wheel[c:c + cb, 2] = 255
    c += cb
    wheel[c:c + bm, 2] = 255
    wheel[c:c + bm, 0] = np.floor(255 * np.arange(bm) / bm)
    c += bm
    wheel[c:c + mr, 2] = 255 - np.floor(255 * np.arange(mr) / mr)
    wheel[c:c + mr, 0] = 255
    return wheel


_WHEEL = make_colorwheel()


def flow_to_rgb(flow: np.ndarray, max_rad: float | None = None) -> np.ndarray:
    """(H, W, 2) flow (u right, v down) -> (H, W, 3) uint8 in the Middlebury colour coding.

    Vectors are divided by ``max_rad`` (default: the largest finite magnitude); non-finite
    vectors are black."""
    flow = np.asarray(flow, dtype=np.float64)
    finite = np.isfinite(flow).all(axis=-1)
    u = np.where(finite, flow[..., 0], 0.0)
    v = np.where(finite, flow[..., 1], 0.0)
    rad = np.sqrt(u * u + v * v)
    if max_rad is None:
        max_rad = float(rad.max()) if rad.size else 0.0
    eps = 1e-5
    u, v = u / (max_rad + eps), v / (max_rad + eps)
    rad = np.sqrt(u * u + v * v)
    ncols = _WHEEL.shape[0]
    a = np.arctan2(-v, -u) / np.pi
    fk = (a + 1) / 2 * (ncols - 1)
    k0 = np.floor(fk).astype(np.int64)
    k1 = k0 + 1
    k1[k1 == ncols] = 0
    f = fk - k0
    out = np.zeros((*flow.shape[:-1], 3), dtype=np.uint8)
    for i in range(3):
        col = (1 - f) * _WHEEL[k0, i] / 255.0 + f * _WHEEL[k1, i] / 255.0
        inside = rad <= 1
        col = np.where(inside, 1 - rad * (1 - col), col * 0.75)
        out[..., i] = np.floor(255 * col).astype(np.uint8)
    out[~finite] = 0
    return out


def wheel_key(size: int = 48) -> np.ndarray:
    """A disc showing the flow colour coding (the key printed next to flow panels)."""
    c = (size - 1) / 2
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    fl = np.stack([x - c, y - c], axis=-1)
    img = flow_to_rgb(fl, max_rad=c)
    img[np.hypot(x - c, y - c) > c] = BG
    return img


def to_rgb8(a: np.ndarray) -> np.ndarray:
    """An image array ((H, W), (H, W, 1|2|3|4), any dtype) as (H, W, 3) uint8 for display.

    uint8 as it is; uint16 / 257; floats in [0, 1] scaled by 255, other floats stretched
    from their min to their max; other integers stretched likewise."""
    a = np.asarray(a)
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim == 3 and a.shape[-1] == 2:
        a = a[..., 0]
    if a.ndim == 3 and a.shape[-1] >= 4:
        a = a[..., :3]
    if a.dtype == np.uint8:
        g = a
    elif a.dtype == np.uint16:
        g = (a.astype(np.float64) / 257.0 + 0.5).astype(np.uint8)
    else:
        g = stretch(a.astype(np.float64))
    if g.ndim == 2:
        g = np.repeat(g[..., None], 3, axis=-1)
    return np.ascontiguousarray(g)


def stretch(a: np.ndarray, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """Floats -> uint8: [lo, hi] to [0, 255] (default: [0, 1] when the data lies there, else its range)."""
    fin = a[np.isfinite(a)]
    if lo is None or hi is None:
        if fin.size == 0:
            lo, hi = 0.0, 1.0
        elif fin.min() >= 0 and fin.max() <= 1:
            lo, hi = 0.0, 1.0
        else:
            lo, hi = float(fin.min()), float(fin.max())
    if hi <= lo:
        hi = lo + 1.0
    x = np.clip((np.nan_to_num(a, nan=lo) - lo) / (hi - lo), 0.0, 1.0)
    return np.floor(x * 255.0 + 0.5).astype(np.uint8)


def hu_window(a: np.ndarray, window: str) -> np.ndarray:
    """HU values -> uint8 through a named window (:data:`WINDOWS`): level - width/2 is black, level + width/2 white."""
    level, width = WINDOWS[window]
    return stretch(np.asarray(a, dtype=np.float64), level - width / 2, level + width / 2)


def overlay(rgb: np.ndarray, classes: np.ndarray, alpha: float = MASK_ALPHA) -> np.ndarray:
    """Blend the class map ``classes`` (H, W) over ``rgb``: class 0 clear, class k in PALETTE[k]."""
    classes = np.asarray(classes)
    if classes.ndim == 3:
        classes = classes[..., 0] if classes.shape[-1] == 1 else classes.argmax(axis=-1)
    ids = np.nan_to_num(classes.astype(np.float64)).astype(np.int64)
    pal = np.asarray(PALETTE, dtype=np.float64)
    col = pal[np.where(ids > 0, 1 + np.mod(ids - 1, len(PALETTE) - 1), 0)]  # classes past the palette wrap to 1..
    out = rgb.astype(np.float64)
    on = ids != 0
    out[on] = (1 - alpha) * out[on] + alpha * col[on]
    return np.floor(out + 0.5).astype(np.uint8)


def class_map(a: np.ndarray) -> np.ndarray:
    """A mask as (H, W) class ids (a one-channel map, or the argmax of a one-hot stack)."""
    a = np.asarray(a)
    if a.ndim == 3:
        return a[..., 0] if a.shape[-1] == 1 else a.argmax(axis=-1)
    return a


# --- audio -----------------------------------------------------------------------------------

def waveform(x: np.ndarray, width: int = 256, height: int = 64) -> np.ndarray:
    """(C, N) or (N,) samples -> (C * height, width, 3) uint8: min..max of each column's samples."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    rows = []
    for ch in x:
        img = np.zeros((height, width, 3), dtype=np.uint8)
        img[:] = (16, 16, 32)
        img[height // 2, :] = (70, 70, 90)
        peak = max(1.0, float(np.max(np.abs(ch)))) if ch.size else 1.0  # [-1, 1] audio at its true level
        edges = np.linspace(0, ch.size, width + 1).astype(np.int64)
        for col in range(width):
            seg = ch[edges[col]:max(edges[col + 1], edges[col] + 1)]
            if seg.size == 0:
                continue
            lo, hi = float(seg.min()) / peak, float(seg.max()) / peak
            y0 = int(round((1 - hi) / 2 * (height - 1)))
            y1 = int(round((1 - lo) / 2 * (height - 1)))
            img[min(y0, y1):max(y0, y1) + 1, col] = (90, 200, 255)
        rows.append(img)
    return np.concatenate(rows, axis=0)


def mel_filterbank(sr: float, n_fft: int, n_mels: int) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) triangular filters on the HTK mel scale, 0 Hz to sr / 2."""
    def hz_to_mel(f: np.ndarray | float) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    pts = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    fb = np.zeros((n_mels, freqs.size))
    for m in range(n_mels):
        lo, c, hi = pts[m], pts[m + 1], pts[m + 2]
        up = (freqs - lo) / max(c - lo, 1e-9)
        down = (hi - freqs) / max(hi - c, 1e-9)
        fb[m] = np.maximum(0.0, np.minimum(up, down))
    return fb


def log_mel(x: np.ndarray, sr: float, n_fft: int = 512, hop: int = 128, n_mels: int = 64,
            top_db: float = 80.0) -> np.ndarray:
    """Mono samples -> (n_mels, frames) log-mel power in dB relative to the peak, floored at -top_db."""
    from scipy.signal import stft

    x = np.asarray(x, dtype=np.float64).reshape(-1)
    n_fft = int(min(n_fft, max(16, 2 ** int(math.floor(math.log2(max(x.size, 16)))))))
    hop = max(1, min(hop, n_fft // 2))
    _, _, z = stft(x, fs=sr, window="hann", nperseg=n_fft, noverlap=n_fft - hop, boundary=None,
                   padded=False, return_onesided=True)
    power = np.abs(z) ** 2
    mel = mel_filterbank(sr, n_fft, n_mels) @ power
    db = 10.0 * np.log10(np.maximum(mel, 1e-12))
    return np.maximum(db - db.max(), -top_db)


# a perceptual dark-to-bright map (points of matplotlib's "magma", linearly interpolated)
_MAGMA = np.array([(0, 0, 4), (28, 16, 68), (79, 18, 123), (129, 37, 129), (181, 54, 122),
                   (229, 80, 100), (251, 135, 97), (254, 194, 135), (252, 253, 191)], dtype=np.float64)


def colormap(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> uint8 RGB through :data:`_MAGMA`."""
    x = np.clip(np.nan_to_num(np.asarray(x, dtype=np.float64)), 0.0, 1.0) * (len(_MAGMA) - 1)
    i0 = np.floor(x).astype(np.int64)
    i1 = np.minimum(i0 + 1, len(_MAGMA) - 1)
    f = (x - i0)[..., None]
    return np.floor((1 - f) * _MAGMA[i0] + f * _MAGMA[i1] + 0.5).astype(np.uint8)


def spectrogram_image(x: np.ndarray, sr: float, top_db: float = 80.0) -> np.ndarray:
    """(n_mels, frames, 3) uint8, low frequencies at the bottom."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64)).mean(axis=0)
    db = log_mel(x, sr, top_db=top_db)
    return colormap((db + top_db) / top_db)[::-1]


# --- panels and rows -------------------------------------------------------------------------

@dataclass
class Panel:
    """One picture in a row: (H, W, 3) uint8 and caption lines; ``scale`` False keeps its pixel size."""

    image: np.ndarray
    caption: list[str] = field(default_factory=list)
    scale: bool = True


@dataclass
class Item:
    """What a renderer sees: one sample key's copies (``samples[c]`` with ``metas[c]``), field specs and labels."""

    key: str
    samples: list[dict[str, np.ndarray]]
    metas: list[dict[str, Any]]
    copies: list[int]
    specs: dict[str, dict]
    label_names: list[str]
    options: dict[str, Any]

    def kind(self, f: str) -> str:
        return str(self.specs[f].get("kind", ""))

    def fields_of(self, *kinds: str) -> list[str]:
        return [f for f in self.specs if self.kind(f) in kinds and f in self.samples[0]]


Renderer = Callable[[Item, str], list[Panel]]


def _num(v: Any) -> str:
    if isinstance(v, bool):
        return "y" if v else "n"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_num(x) for x in v) + "]"
    return str(v)


def augment_caption(meta: dict[str, Any]) -> list[str]:
    """One line per random step that ran: ``step: k=v, ...`` (floats to 3 significant digits)."""
    lines = []
    for entry in meta.get("augment", []) or []:
        if not isinstance(entry, dict):
            continue
        name = entry.get("step", "?")
        kv = ", ".join(f"{k}={_num(v)}" for k, v in entry.items() if k != "step")
        lines.append(f"{name}: {kv}" if kv else str(name))
    return lines


def _validity_of(item: Item, f: str) -> str | None:
    """The flow field that ``f`` is the validity mask of (the spec's ``of``, else ``<flow>_valid``), or None."""
    flows = item.fields_of("flow")
    of = item.specs[f].get("of")
    if of in flows:
        return of
    return next((g for g in flows if f == g + "_valid"), None)


def _is_validity(item: Item, f: str) -> bool:
    return item.kind(f) == "flow_valid" or _validity_of(item, f) is not None


def render_image(item: Item, f: str) -> list[Panel]:
    panels = []
    for c, (s, m) in enumerate(zip(item.samples, item.metas)):
        a = s[f]
        rgb = to_rgb8(a)
        cap = [f"{f} {'x'.join(map(str, a.shape))} {a.dtype}" if c == 0 else f"{f}"]
        if len(item.samples) > 1:
            cap[0] += f" copy {item.copies[c]}"
            cap += augment_caption(m) or (["original"] if item.copies[c] == 0 else [])
        panels.append(Panel(rgb, cap))
    return panels


def render_mask(item: Item, f: str) -> list[Panel]:
    """The class map over the image of the same size, for every copy (an augmented copy's mask moved
    with its image), then a legend of the classes shown: colour, id and name where the output has one."""
    if _is_validity(item, f):
        return []  # drawn next to its flow
    panels, seen = [], set()
    for c, s in enumerate(item.samples):
        cls = class_map(s[f])
        present = [int(v) for v in np.unique(cls) if v != 0]
        seen.update(present)
        images = [g for g in item.fields_of("image") if np.shape(s[g])[:2] == cls.shape[:2]]
        base = to_rgb8(s[images[0]]) if images else np.zeros((*cls.shape[:2], 3), np.uint8)
        cap = [f"{f} over {images[0]}" if images else f"{f}"]
        if len(item.samples) > 1:
            cap[0] += f" copy {item.copies[c]}"
        cap.append("classes " + (", ".join(map(str, present[:8])) or "none"))
        panels.append(Panel(overlay(base, cls), cap))
    if seen:
        names = item.options.get("class_names", {}).get(f, {})
        panels.append(legend(sorted(seen), names))
    return panels


def legend(ids: Sequence[int], names: dict[int, str] | None = None, rows: int = LEGEND_ROWS) -> Panel:
    """A key to the mask colours: one swatch per class id (its :func:`overlay` colour at full strength)
    with the id and its name; at most ``rows`` lines, then how many more."""
    names = names or {}
    shown = list(ids)[:rows]
    sw = 10
    img = np.zeros((len(shown) * (sw + 2), sw, 3), np.uint8)
    for r, k in enumerate(shown):
        img[r * (sw + 2):r * (sw + 2) + sw] = overlay(np.zeros((sw, sw, 3), np.uint8), np.full((sw, sw), k), 1.0)
    cap = ["legend"] + [f"{k}: {names[k]}" if k in names else f"{k}" for k in shown]
    if len(ids) > rows:
        cap.append(f"+{len(ids) - rows} more")
    return Panel(img, cap, scale=False)


def mask_class_names(ds: Dataset) -> dict[str, dict[int, str]]:
    """{mask field: {class id: name}} where the output says (the rule of :func:`precompile.tools.stats.class_names`:
    a COCO semantic mask holds category (box label) + 1, so id k is ``label_names[k - 1]``)."""
    from .stats import class_names

    return {f: names for f, s in ds.field_specs.items() if s.get("kind") == "mask" and (names := class_names(ds, f))}


def render_flow(item: Item, f: str) -> list[Panel]:
    fl = np.asarray(item.samples[0][f], dtype=np.float64)
    valid = np.isfinite(fl).all(axis=-1)
    vf = next((g for g in item.specs if g in item.samples[0] and g != f and _validity_of(item, g) == f), None)
    if vf is not None:
        valid &= class_map(item.samples[0][vf]) != 0
    shown = np.where(valid[..., None], fl, np.nan)
    rad = np.hypot(shown[..., 0], shown[..., 1])
    peak = float(np.nanmax(rad)) if np.isfinite(rad).any() else 0.0
    rgb = flow_to_rgb(shown)
    panels = [Panel(rgb, [f"{f} (max {peak:.3g} px)"])]
    vis = np.where(valid, 255, 0).astype(np.uint8)
    panels.append(Panel(to_rgb8(vis), [f"{vf or f} valid {100.0 * valid.mean():.1f}%"]))
    if item.options.get("_first_flow", True):
        item.options["_first_flow"] = False
        panels.append(Panel(wheel_key(48), ["key (+u red)"], scale=False))
    return panels


def _volume_window(a: np.ndarray, window: str, modality: str = "") -> tuple[Callable[[np.ndarray], np.ndarray], str]:
    """How a volume becomes grey levels: data in [0, 1] as it is; CT (the DICOM modality, or HU-like
    values reaching air, <= -500) through the named HU window; anything else (MRI, PET, standardised
    data), or ``window: auto``, through its own 1st-99th percentile window, so no scan comes out blank."""
    fin = a[np.isfinite(a)]
    if fin.size and fin.min() >= 0 and fin.max() <= 1:
        return (lambda s: stretch(s, 0.0, 1.0)), "[0, 1]"
    modality = modality.upper()
    ct = modality == "CT" or (modality in ("", "OT") and fin.size > 0 and float(fin.min()) <= CT_AIR)
    if ct and window in WINDOWS:
        lv, wd = WINDOWS[window]
        return (lambda s: hu_window(s, window)), f"{window} window L{lv:g} W{wd:g}"
    lo, hi = percentile_window(fin)
    return (lambda s: stretch(s, lo, hi)), f"auto window p{AUTO_PERCENTILES[0]:g}-p{AUTO_PERCENTILES[1]:g} " \
                                           f"[{lo:.3g}, {hi:.3g}]"


def percentile_window(values: np.ndarray) -> tuple[float, float]:
    """The (low, high) display window of finite ``values``: their :data:`AUTO_PERCENTILES` (the full
    range when those meet, (0, 1) when there is nothing)."""
    if values.size == 0:
        return 0.0, 1.0
    lo, hi = (float(v) for v in np.percentile(values, AUTO_PERCENTILES))
    if hi <= lo:
        lo, hi = float(values.min()), float(values.max())
    return lo, hi


def render_volume(item: Item, f: str) -> list[Panel]:
    v = np.asarray(item.samples[0][f])
    if v.ndim == 4 and v.shape[-1] == 1:
        v = v[..., 0]
    if v.ndim != 3:
        return render_other(item, f)
    fmeta = item.metas[0].get(f) if isinstance(item.metas[0].get(f), dict) else {}
    to8, wname = _volume_window(v.astype(np.float64), str(item.options.get("window", "lung")),
                                str(fmeta.get("modality") or ""))
    masks = [g for g in item.fields_of("volume_mask") if np.shape(item.samples[0][g])[:3] == v.shape]
    d, h, w = v.shape
    z, y, x = d // 2, h // 2, w // 2
    if masks:  # through the most masked plane along each axis (a centre cut may miss both lungs)
        m = sum((np.asarray(item.samples[0][g]).reshape(v.shape) != 0).astype(np.int64) for g in masks)
        if m.any():
            z, y, x = (int(np.argmax(m.sum(axis=tuple(a for a in range(3) if a != k)))) for k in range(3))
    cuts = ((f"axial z={z}", lambda a: a[z]), (f"coronal y={y}", lambda a: a[:, y]),
            (f"sagittal x={x}", lambda a: a[:, :, x]))
    panels = []
    for name, cut in cuts:
        rgb = to_rgb8(to8(cut(v.astype(np.float64))))
        for g in masks:
            m = np.asarray(item.samples[0][g])
            rgb = overlay(rgb, cut(m[..., 0] if m.ndim == 4 else m))
        cap = [f"{f} {name}", wname] if name.startswith("axial") else [f"{f} {name}"]
        if masks and name.startswith("axial"):
            cap.append("mask " + ", ".join(masks))
        panels.append(Panel(rgb, cap))
    return panels


def render_video(item: Item, f: str) -> list[Panel]:
    v = np.asarray(item.samples[0][f])
    t = v.shape[0]
    pick = np.unique(np.linspace(0, t - 1, min(t, STRIP_FRAMES)).round().astype(np.int64))
    src = (item.metas[0].get("clip") or {}).get("frames") if isinstance(item.metas[0].get("clip"), dict) else None
    panels = []
    for k, i in enumerate(pick):
        cap = [f"{f} t={i}" + (f" (frame {src[i]})" if src and i < len(src) else "")]
        if k == 0:
            cap.insert(0, f"{f} {'x'.join(map(str, v.shape))} {v.dtype}")
        panels.append(Panel(to_rgb8(v[i]), cap))
    return panels


def _sample_rate(item: Item, f: str) -> float:
    m = item.metas[0].get(f)
    if isinstance(m, dict) and m.get("sample_rate"):
        return float(m["sample_rate"])
    return float(item.options.get("sample_rate", 16000))


def render_audio(item: Item, f: str) -> list[Panel]:
    x = np.asarray(item.samples[0][f], dtype=np.float64)
    if x.ndim == 1:
        x = x[None]
    sr = _sample_rate(item, f)
    dur = x.shape[-1] / sr
    wave = Panel(waveform(x), [f"{f} {x.shape[0]} ch, {x.shape[-1]} samples, {dur:.3g} s"], scale=False)
    spec = spectrogram_image(x, sr)
    sh = 64
    spec = np.repeat(spec, max(1, sh // spec.shape[0]), axis=0)
    reps = max(1, 256 // max(1, spec.shape[1]))
    spec = np.repeat(spec, reps, axis=1)
    return [wave, Panel(spec, [f"log-mel, 64 bands to {sr / 2000:g} kHz, 80 dB"], scale=False)]


def render_other(item: Item, f: str) -> list[Panel]:
    """Fallback: a 2-D or 3-D array as a grey (or colour) picture; smaller arrays go into the header."""
    a = np.asarray(item.samples[0][f])
    if a.ndim in (2, 3) and min(a.shape[:2]) >= 4:
        return [Panel(to_rgb8(a), [f"{f} ({item.kind(f)}) {'x'.join(map(str, a.shape))}"])]
    return []


def draw_annotations(rgb: np.ndarray, boxes: np.ndarray | None = None, labels: np.ndarray | None = None,
                     names: Sequence[str] = (), keypoints: np.ndarray | None = None, min_side: int = 256) -> np.ndarray:
    """``rgb`` (enlarged by a whole factor to at least ``min_side`` on its longer side, nearest neighbour)
    with each box outlined in its class's :data:`PALETTE` colour and captioned with its class name (or
    id), and each keypoint a dot of its box's colour: filled when visible (2), hollow when labelled but
    hidden (1), absent at visibility 0. Coordinates are continuous pixels (see docs/annotations.md)."""
    from PIL import Image, ImageDraw

    s = max(1, -(-min_side // max(1, max(rgb.shape[:2]))))
    pic = Image.fromarray(np.repeat(np.repeat(rgb, s, 0), s, 1))
    d, font = ImageDraw.Draw(pic), _font()
    n = 0 if boxes is None else len(boxes)
    colour = [PALETTE[1 + (int(labels[i]) if labels is not None else i) % (len(PALETTE) - 1)] for i in range(n)]
    for i in range(n):
        x1, y1, x2, y2 = (float(v) * s for v in boxes[i])
        d.rectangle([x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)], outline=colour[i], width=2)
        if labels is not None:
            v = int(labels[i])
            text = names[v] if 0 <= v < len(names) else str(v)
            text = _printable(text)
            tb = d.textbbox((x1 + 3, y1 + 2), text, font=font)
            d.rectangle([tb[0] - 2, tb[1] - 1, tb[2] + 1, tb[3] + 1], fill=colour[i])   # a tag in the box's colour
            ink = (0, 0, 0) if sum(colour[i]) > 382 else (255, 255, 255)
            d.text((x1 + 3, y1 + 2), text, fill=ink, font=font)
    for i, pts in enumerate([] if keypoints is None else keypoints):
        c = colour[i] if i < n else PALETTE[1 + i % (len(PALETTE) - 1)]
        for x, y, v in pts:
            if v <= 0 or not (np.isfinite(x) and np.isfinite(y)):
                continue
            cx, cy = float(x) * s, float(y) * s
            d.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], outline=c, fill=c if v >= 2 else None, width=2)
    return np.asarray(pic)


def _tied(item: Item, owner: str, kind: str) -> str | None:
    """The ``kind`` field tied to the boxes field ``owner``: its spec's ``of``, or the only one
    beside the only boxes field."""
    cands = item.fields_of(kind)
    tied = [g for g in cands if item.specs[g].get("of") == owner]
    if not tied and len(cands) == 1 and len(item.fields_of("boxes")) == 1:
        tied = cands
    return tied[0] if tied else None


def render_boxes(item: Item, f: str) -> list[Panel]:
    """Boxes with class names, and the keypoints tied to them, on the image of their grid (every copy)."""
    panels = []
    labels_f, kp_f = _tied(item, f, "box_labels"), _tied(item, f, "keypoints")
    for c, s in enumerate(item.samples):
        images = [g for g in item.fields_of("image") if np.ndim(s[g]) == 3]
        base = to_rgb8(s[images[0]]) if images else np.zeros((64, 64, 3), np.uint8)
        pic = draw_annotations(base, s[f], s.get(labels_f) if labels_f else None, item.label_names,
                               s.get(kp_f) if kp_f else None)
        cap = [f"{f}: {len(s[f])} box(es)" + (f" on {images[0]}" if images else "")
               + (f" copy {item.copies[c]}" if len(item.samples) > 1 else "")]
        panels.append(Panel(pic, cap))
    return panels


def render_keypoints(item: Item, f: str) -> list[Panel]:
    """Keypoints with no boxes field: dots on the image (tied ones are drawn by :func:`render_boxes`)."""
    if item.fields_of("boxes"):
        return []
    s = item.samples[0]
    images = [g for g in item.fields_of("image") if np.ndim(s[g]) == 3]
    base = to_rgb8(s[images[0]]) if images else np.zeros((64, 64, 3), np.uint8)
    return [Panel(draw_annotations(base, keypoints=s[f]), [f"{f}: {len(s[f])} x {np.shape(s[f])[1]} keypoints"])]


#: kind -> renderer; a kind that is missing here is drawn by :func:`render_other`
RENDERERS: dict[str, Renderer] = {
    "image": render_image,
    "mask": render_mask,
    "flow": render_flow,
    "flow_valid": render_mask,   # skipped by render_mask: drawn with its flow
    "volume": render_volume,
    "volume_mask": lambda item, f: [] if item.fields_of("volume") else render_other(item, f),
    "video": render_video,
    "audio": render_audio,
    "label": lambda item, f: [],  # in the header
    "text": lambda item, f: [],   # in the header (text_line)
    "target": lambda item, f: [],  # in the header (target_line)
    "boxes": render_boxes,
    "box_labels": lambda item, f: [],  # drawn as the names of their boxes
    "keypoints": render_keypoints,
}

KIND_ORDER = {k: i for i, k in enumerate(("image", "mask", "flow", "flow_valid", "volume", "volume_mask", "video", "audio"))}


TEXT_CHARS = 120   # a text field's characters shown in the header


def text_line(item: Item, f: str) -> str:
    """``caption: "the text"`` (newlines shown as ⏎, cut at TEXT_CHARS with …)."""
    t = str(item.samples[0][f]).replace("\r\n", "\n").replace("\n", " ⏎ ")
    return f'{f}: "{t[:TEXT_CHARS]}{"…" if len(t) > TEXT_CHARS else ""}"'


def target_line(item: Item, f: str) -> str:
    """``findings: Edema=1, Cardiomegaly=0, 12 blank (NaN)``: the finite values, named by their table
    column when the recipe says (``options['target_columns']``), and the count of NaN (blank) entries."""
    a = np.asarray(item.samples[0][f], dtype=np.float64).reshape(-1)
    names = item.options.get("target_columns", {}).get(f) or [str(i) for i in range(a.size)]
    if a.size == 1 and not item.options.get("target_columns", {}).get(f):
        return f"{f}: {'NaN (blank)' if np.isnan(a[0]) else _num(float(a[0]))}"
    parts = [f"{n}={_num(float(v))}" for n, v in zip(names, a) if not np.isnan(v)]
    blank = int(np.isnan(a).sum())
    return f"{f}: {', '.join(parts) or '-'}" + (f", {blank} blank (NaN)" if blank else "")


def header_lines(item: Item) -> list[str]:
    lines = [item.key]
    for f, spec in item.specs.items():
        if f not in item.samples[0]:
            continue
        a = np.asarray(item.samples[0][f])
        if spec.get("kind") == "label" and a.size == 1:
            v = int(a.reshape(()))
            name = item.label_names[v] if 0 <= v < len(item.label_names) else "?"
            lines.append(f"{f}: {name} ({v})")
        elif spec.get("kind") == "text":
            lines.append(text_line(item, f))
        elif spec.get("kind") == "target":
            lines.append(target_line(item, f))
        elif a.size <= 8 and spec.get("kind") not in RENDERERS:
            lines.append(f"{f}: {_num(a.tolist())}")
    if len(item.copies) > 1:
        lines.append(f"{len(item.copies)} copies")
    return lines


# --- drawing ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _font():
    from PIL import ImageFont

    return ImageFont.load_default()


#: a code point no font has a glyph for: what the default font draws for a character it lacks
_NO_GLYPH = "\U0010FFFD"


@functools.lru_cache(maxsize=4096)
def _drawable(ch: str) -> bool:
    """Whether the default font has a glyph for ``ch`` (its drawing differs from a missing glyph's). Pillow's
    default font (Aileron from 10.1 on, a Latin-1 bitmap font before) lacks most letters past ASCII."""
    if not ch.isprintable():
        return False
    if ch == " ":
        return True
    font = _font()

    def drawn(c: str) -> tuple:
        m = font.getmask(c)
        return m.size, bytes(m)

    try:
        got = drawn(ch)
    except (UnicodeError, ValueError, OSError):   # a bitmap font cannot encode it
        return False
    try:
        return got != drawn(_NO_GLYPH)
    except (UnicodeError, ValueError, OSError):   # ... nor the probe: it drew ch, so it has it
        return True


def _printable(s: str) -> str:
    """``s`` as the default font can draw it, never as missing-glyph boxes: a character the font lacks is
    written as its base letters when it has them (é -> e, ﬁ -> fi), else as its escape (猫 -> \\u732b)."""
    out = []
    for ch in s:
        if _drawable(ch):
            out.append(ch)
            continue
        base = "".join(c for c in unicodedata.normalize("NFKD", ch) if not unicodedata.combining(c))
        if base and base != ch and all(_drawable(c) for c in base):
            out.append(base)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return "".join(out)


def _text_width(font: Any, s: str) -> int:
    return int(math.ceil(font.getlength(_printable(s))))


def _wrap(font: Any, lines: Sequence[str], width: int) -> list[str]:
    out: list[str] = []
    for line in lines:
        words = line.split(" ")
        cur = ""
        for w in words:
            cand = w if not cur else cur + " " + w
            if _text_width(font, cand) <= width or not cur:
                cur = cand
            else:
                out.append(cur)
                cur = "  " + w
        out.append(cur)
    return out


LINE = 12


MAX_PANEL = (256, 512)    # larger pictures are shrunk by a whole factor (box filter) to fit


def _scaled(p: Panel, target: int) -> np.ndarray:
    """Small pictures grow by a whole factor (nearest) to ``target`` rows; large ones shrink to :data:`MAX_PANEL`."""
    img = p.image
    if not p.scale:
        return img
    shrink = int(math.ceil(max(img.shape[0] / MAX_PANEL[0], img.shape[1] / MAX_PANEL[1])))
    if shrink > 1:
        from PIL import Image

        small = Image.fromarray(np.ascontiguousarray(img)).resize(
            (max(1, img.shape[1] // shrink), max(1, img.shape[0] // shrink)), Image.Resampling.BOX)
        return np.asarray(small)
    k = max(1, int(math.ceil(target / max(1, img.shape[0]))))
    k = min(k, max(1, 512 // max(1, img.shape[1])))
    return np.repeat(np.repeat(img, k, axis=0), k, axis=1) if k > 1 else img


def draw_row(head: list[str], panels: list[Panel], header_width: int = 170) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """One sample's row: header text then the panels with their captions below, as (H, W, 3) uint8,
    and each panel's picture box (x, y, width, height) in the row."""
    from PIL import Image, ImageDraw

    font = _font()
    pics = [_scaled(p, PANEL_HEIGHT) for p in panels]
    caps = [_wrap(font, p.caption, max(pic.shape[1], 96)) for p, pic in zip(panels, pics)]
    widths = [max(pic.shape[1], 96) for pic in pics]
    head = _wrap(font, head, header_width - PAD)
    body_h = max([pic.shape[0] for pic in pics] + [0])
    cap_h = max([len(c) for c in caps] + [0]) * LINE
    height = max(body_h + cap_h + 2 * PAD, len(head) * LINE + 2 * PAD)
    width = header_width + sum(w + PAD for w in widths) + PAD
    canvas = Image.new("RGB", (width, height), BG)
    d = ImageDraw.Draw(canvas)
    for i, line in enumerate(head):
        d.text((PAD, PAD + i * LINE), _printable(line), fill=FG if i == 0 else DIM, font=font)
    x = header_width
    boxes = []
    for pic, cap, w in zip(pics, caps, widths):
        canvas.paste(Image.fromarray(np.ascontiguousarray(pic)), (x, PAD))
        boxes.append((x, PAD, pic.shape[1], pic.shape[0]))
        for j, line in enumerate(cap):
            d.text((x, PAD + body_h + 2 + j * LINE), _printable(line), fill=FG if j == 0 else DIM, font=font)
        x += w + PAD
    d.line([(0, height - 1), (width, height - 1)], fill=(60, 60, 60))
    return np.asarray(canvas), boxes


TITLE_HEIGHT = 2 * LINE + PAD   # the least room above the rows (a title that wraps takes more)


def title_lines(title: str, width: int) -> list[str]:
    """The title wrapped to a sheet ``width`` pixels wide: at spaces, and inside a word (a long file
    name) that alone is wider than the sheet, so no line is cut at the sheet's edge."""
    font = _font()
    room = max(width - 2 * PAD, 8)
    out: list[str] = []
    for line in _wrap(font, [title], room):
        while _text_width(font, line) > room and len(line) > 1:
            n = len(line) - 1
            while n > 1 and _text_width(font, line[:n]) > room:
                n -= 1
            out.append(line[:n])
            line = "  " + line[n:]
        out.append(line)
    return out


def stack_rows(rows: list[np.ndarray], title: str) -> tuple[np.ndarray, int]:
    """The rows one below the other under the title (wrapped to the sheet's width); and the y at
    which the rows start."""
    from PIL import Image, ImageDraw

    width = max(r.shape[1] for r in rows)
    lines = title_lines(title, width)
    top = max(TITLE_HEIGHT, 2 * PAD + len(lines) * LINE)
    height = top + sum(r.shape[0] for r in rows)
    canvas = Image.new("RGB", (width, height), BG)
    d = ImageDraw.Draw(canvas)
    for i, line in enumerate(lines):
        d.text((PAD, PAD + i * LINE), _printable(line), fill=FG, font=_font())
    y = top
    for r in rows:
        canvas.paste(Image.fromarray(r), (0, y))
        y += r.shape[0]
    return np.asarray(canvas), top


def png_bytes(img: np.ndarray) -> bytes:
    """A PNG of ``img`` with no time stamp or other varying chunk (byte-identical for identical pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img)).save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


# --- the sheet -------------------------------------------------------------------------------

@dataclass
class Preview:
    """A rendered preview: the sheet; per row its key, metadata and picture (for the HTML page); and
    per panel its row, field, first caption line and box (x, y, width, height) in the sheet."""

    sheet: np.ndarray
    rows: list[tuple[str, list[dict[str, Any]], np.ndarray]]
    title: str
    panels: list[dict[str, Any]] = field(default_factory=list)


def pick_keys(ds: Dataset, n: int) -> list[tuple[str, list[int]]]:
    """``n`` sample keys spread evenly over the output, each with its rows in copy order."""
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(ds.keys):
        groups.setdefault(k, []).append(i)
    keys = list(groups)
    if n >= len(keys):
        chosen = keys
    else:
        chosen = [keys[int(j)] for j in np.unique(np.linspace(0, len(keys) - 1, n).round().astype(np.int64))]
    return [(k, sorted(groups[k], key=lambda i: ds.copy(i))) for k in chosen]


def render(path: str | os.PathLike, n: int = 6, fields: Sequence[str] | None = None, window: str = "lung",
           max_copies: int = 6) -> Preview:
    """Render the contact sheet of the output at ``path`` (see the module docstring)."""
    if n < 1:
        raise PreviewError(f"--n must be at least 1, got {n}")
    if window not in WINDOW_CHOICES:
        raise PreviewError(f"unknown window {window!r} (known: {', '.join(WINDOW_CHOICES)})")
    ds = open_dataset(path)
    if fields:
        bad = [f for f in fields if f not in ds.field_specs]
        if bad:
            raise PreviewError(f"{path}: no field {bad[0]!r} (fields: {', '.join(ds.field_specs)})")
        names = list(dict.fromkeys(fields))
        # draw a field's partners too (the image under a mask, a flow's validity, a volume's masks)
        specs = {f: ds.field_specs[f] for f in ds.field_specs
                 if f in names or _partner(f, names, ds.field_specs)}
    else:
        specs = dict(ds.field_specs)
    if len(ds) == 0:
        raise PreviewError(f"{path}: the output holds no samples")
    shown = [f for f in specs if not fields or f in fields]
    options: dict[str, Any] = {"window": window, "target_columns": {
        f: target_columns(ds, f) for f, sp in specs.items() if sp.get("kind") == "target"},
        "class_names": mask_class_names(ds)}
    rows = []
    boxes: list[dict[str, Any]] = []
    y = 0   # below the title: moved down by the title's height once the sheet's width is known
    for key, idx in pick_keys(ds, n):
        idx = idx[:max_copies]
        samples = [{f: a for f, a in ds[i].items() if f in specs} for i in idx]
        item = Item(key, samples, [ds.meta(i) for i in idx], [ds.copy(i) for i in idx], specs,
                    list(ds.label_names), options)
        panels: list[Panel] = []
        owners: list[str] = []
        for f in sorted(shown, key=lambda f: KIND_ORDER.get(item.kind(f), len(KIND_ORDER))):
            got = RENDERERS.get(item.kind(f), render_other)(item, f)
            panels += got
            owners += [f] * len(got)
        if not panels and not header_lines(item)[1:]:
            continue
        img, bx = draw_row(header_lines(item), panels)
        for f, p, (bx0, by0, bw, bh) in zip(owners, panels, bx):
            boxes.append({"row": len(rows), "key": key, "field": f, "caption": p.caption[0] if p.caption else "",
                          "box": (bx0, y + by0, bw, bh)})
        rows.append((key, item.metas, img))
        y += img.shape[0]
    if not rows:
        raise PreviewError(f"{path}: nothing to draw for field(s) {', '.join(shown)}")
    title = (f"{os.path.basename(str(path))}: {len(ds)} samples, {ds.output_format}, fields "
             + ", ".join(f"{f} ({s.get('kind')})" for f, s in ds.field_specs.items()))
    sheet, top = stack_rows([r[2] for r in rows], title)
    for b in boxes:
        x0, y0, bw, bh = b["box"]
        b["box"] = (x0, y0 + top, bw, bh)
    return Preview(sheet, rows, title, boxes)


def _partner(f: str, names: list[str], specs: dict[str, dict]) -> bool:
    kind = specs[f].get("kind")
    for g in names:
        gk = specs[g].get("kind")
        if gk == "mask" and kind == "image":
            return True
        if gk == "flow" and (f == g + "_valid" or specs[f].get("of") == g):
            return True
        if gk == "volume" and kind == "volume_mask":
            return True
        if gk == "image" and kind == "label":
            return True
        if gk == "boxes" and (kind == "image" or specs[f].get("of") == g):   # the image under them, their rows
            return True
    return False


def write_html(p: Preview, path: str) -> None:
    """An HTML page: the title, then per row its picture and the samples' metadata (JSON)."""
    parts = ["<!doctype html>", "<meta charset='utf-8'>", f"<title>{html.escape(p.title)}</title>",
             "<style>body{background:#181818;color:#ddd;font:13px monospace}img{image-rendering:pixelated}"
             "pre{white-space:pre-wrap}</style>", f"<h3>{html.escape(p.title)}</h3>"]
    for key, metas, img in p.rows:
        b64 = base64.b64encode(png_bytes(img)).decode("ascii")
        meta = json.dumps(metas if len(metas) > 1 else metas[0], indent=1, sort_keys=True)
        parts.append(f"<section><h4>{html.escape(key)}</h4><img src='data:image/png;base64,{b64}'>"
                     f"<details><summary>metadata</summary><pre>{html.escape(meta)}</pre></details></section>")
    _write_atomic(path, "\n".join(parts).encode("utf-8") + b"\n")


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def preview(path: str | os.PathLike, out: str | None = None, n: int = 6, fields: Sequence[str] | None = None,
            html_path: str | None = None, window: str = "lung") -> str:
    """Write the contact sheet of ``path`` to ``out`` (default ``<index>.preview.png``); returns ``out``."""
    p = render(path, n=n, fields=fields, window=window)
    out = out or os.path.splitext(str(path))[0] + ".preview.png"
    _write_atomic(out, png_bytes(p.sheet))
    if html_path:
        write_html(p, html_path)
    return out
