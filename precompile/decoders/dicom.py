"""DICOM through pydicom: single files (``dicom``) and series folders (``dicom_series``) -> volumes.

Volumes are (D, H, W) = (slice, row, column), in HU (RescaleSlope/Intercept
applied per slice) as float32 or int16. Slices are sorted by their position
along the slice normal (ImagePositionPatient projected on the cross product of
the ImageOrientationPatient vectors), never by file name or InstanceNumber.
Uneven gaps are resampled onto a uniform spacing (linear in z); a tilted
gantry (slice origins drifting in-plane) is corrected by shifting each slice
back onto a grid orthogonal to the slice planes. Big-endian pixel data comes
out native-endian; multi-frame files give a volume.

Metadata: ``spacing`` in array order [slice, row, col] (mm), ``spacing_rcs``
[row, col, slice] (DICOM order), ``orientation`` [row cosines, column cosines,
normal], ``origin`` (the first voxel's patient position), tilt and gap facts.

Compressed transfer syntaxes pydicom cannot decode with what is installed
(JPEG-LS, 12-bit JPEG, some JPEG 2000) raise MissingDependencyError naming the
``jpeg`` extra (pylibjpeg). Files without the DICOM preamble/file meta are an
error unless ``force: true``.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field

from ..errors import DecodeError, MissingDependencyError
from ..registry import DECODERS
from ..sample import FieldSpec
from .base import Decoder, DecoderParams, check_budget

JPEG_EXTRA = "pip install 'precompile[jpeg]' (pylibjpeg, pylibjpeg-libjpeg, pylibjpeg-openjpeg)"


@dataclass
class Frame:
    pixels: np.ndarray            # (H, W) stored values, native-endian
    position: Optional[np.ndarray]  # ImagePositionPatient (3,)
    orientation: Optional[np.ndarray]  # ImageOrientationPatient (6,)
    pixel_spacing: Optional[tuple[float, float]]  # (row spacing, column spacing)
    slope: float
    intercept: float
    thickness: Optional[float]
    source: str


def _f(v: Any) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _vec(v: Any, n: int) -> Optional[np.ndarray]:
    try:
        a = np.array([float(x) for x in v], dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return a if a.shape == (n,) and np.isfinite(a).all() else None


def read_dataset(path: str, force: bool = False, header_only: bool = False):
    """pydicom.dcmread with every failure turned into DecodeError (and warnings collected)."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ds = pydicom.dcmread(path, force=force, stop_before_pixels=header_only)
        except InvalidDicomError:
            raise DecodeError("not a DICOM file: no 'DICM' preamble/file meta (set force: true to read a "
                              "raw dataset anyway)", path=path) from None
        except FileNotFoundError:
            raise DecodeError("file not found", path=path) from None
        except IsADirectoryError:
            raise DecodeError("is a folder (use the dicom_series decoder with inputs.kind: dir)", path=path) from None
        except MemoryError:
            raise
        except Exception as e:  # pydicom raises many types on corrupt data
            raise DecodeError(f"corrupt or truncated DICOM: {type(e).__name__}: {e}", path=path) from None
    ds._precompile_warnings = [str(w.message)[:200] for w in caught]
    fm = getattr(ds, "file_meta", None)
    if fm is None or "TransferSyntaxUID" not in fm:
        # a raw dataset read with force: record the encoding pydicom detected as the transfer syntax
        from pydicom.dataset import FileMetaDataset
        from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

        implicit, little = getattr(ds, "original_encoding", (True, True))
        if fm is None:
            ds.file_meta = FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = (ImplicitVRLittleEndian if implicit else
                                          ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
    return ds


def _transfer_syntax(ds):
    from pydicom.uid import ImplicitVRLittleEndian

    fm = getattr(ds, "file_meta", None)
    ts = getattr(fm, "TransferSyntaxUID", None) if fm is not None else None
    return ts or ImplicitVRLittleEndian


def declared_bytes(ds) -> tuple[str, int]:
    """(``FxHxW`` as the header declares it, the bytes decoding it takes: the stored values, the float32
    values they are rescaled to and the output); (``?``, 0) when the header lacks a size (reported later)."""
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        nframes = int(getattr(ds, "NumberOfFrames", 1) or 1)
        stored = max(1, int(getattr(ds, "BitsAllocated", 16) or 16) // 8)
    except Exception:  # pydicom parses elements lazily and raises many types on damage: pixel_frames names it
        return "?", 0
    return f"{nframes}x{rows}x{cols} pixels", max(0, rows * cols * nframes) * (stored + 4 + 4)


def check_dicom_budget(datasets: list, path: str, budget: int) -> None:
    """Refuse a file (or a series of files) whose headers declare more pixels than ``budget`` holds."""
    sizes = [declared_bytes(ds) for ds in datasets]
    what = sizes[0][0] if len(sizes) == 1 else f"{len(sizes)} files of {sizes[0][0]}"
    check_budget(path, what, sum(n for _, n in sizes), budget)


def pixel_frames(ds, path: str) -> np.ndarray:
    """Stored pixel values as (F, H, W) native-endian; codec problems become clear errors."""
    from pydicom.pixels import get_decoder

    if "PixelData" not in ds and "FloatPixelData" not in ds and "DoubleFloatPixelData" not in ds:
        raise DecodeError("has no pixel data", path=path)
    ts = _transfer_syntax(ds)
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        spp = int(getattr(ds, "SamplesPerPixel", 1) or 1)
        bits = int(ds.BitsAllocated)
        nframes = int(getattr(ds, "NumberOfFrames", 1) or 1)
    except (AttributeError, TypeError, ValueError) as e:
        raise DecodeError(f"missing or bad image attributes (Rows/Columns/BitsAllocated): {e}", path=path) from None
    if spp != 1:
        raise DecodeError(f"has {spp} samples per pixel; only monochrome images can become volumes", path=path)
    if rows < 1 or cols < 1 or nframes < 1 or rows * cols * nframes > 2 ** 31:
        raise DecodeError(f"absurd image size {nframes}x{rows}x{cols}", path=path)
    compressed = getattr(ts, "is_compressed", False)
    if compressed:
        try:
            dec = get_decoder(ts)
        except (NotImplementedError, ValueError, KeyError):
            raise DecodeError(f"transfer syntax {ts} ({getattr(ts, 'name', '?')}) is not supported", path=path) from None
        if not dec.is_available:
            raise MissingDependencyError(
                f"{path}: pixel data is {ts.name}, which no installed plugin decodes; install the jpeg extra: "
                f"{JPEG_EXTRA}")
    elif "PixelData" in ds:
        need = rows * cols * nframes * max(1, bits // 8) if bits >= 8 else (rows * cols * nframes + 7) // 8
        have = len(ds.PixelData)
        if have < need:
            raise DecodeError(f"truncated pixel data: {have} bytes, {nframes}x{rows}x{cols} at {bits} bits "
                              f"needs {need}", path=path)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            arr = ds.pixel_array
        except MemoryError:
            raise
        except Exception as e:
            if compressed:
                try:
                    import pylibjpeg  # noqa: F401
                except ImportError:
                    raise MissingDependencyError(
                        f"{path}: the installed plugins failed on {ts.name} pixel data ({type(e).__name__}: {e}); "
                        f"pylibjpeg decodes it: {JPEG_EXTRA}") from None
            raise DecodeError(f"cannot decode pixel data ({getattr(ts, 'name', ts)}): {type(e).__name__}: {e}",
                              path=path) from None
    arr = np.asarray(arr)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise DecodeError(f"unexpected pixel array shape {arr.shape}", path=path)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return np.ascontiguousarray(arr)


def _seq_item(ds, name: str):
    seq = getattr(ds, name, None)
    return seq[0] if seq else None


GREY = ("MONOCHROME1", "MONOCHROME2")


def photometric(ds, path: str) -> str:
    """The file's PhotometricInterpretation; anything but grey is refused, naming it: a palette
    file's values are indices into a colour table and colour files hold no single intensity, so
    neither can become an intensity (HU) volume."""
    pi = str(getattr(ds, "PhotometricInterpretation", "") or "MONOCHROME2").strip().upper()
    if pi in GREY:
        return pi
    what = ("its pixel values are indices into a colour palette" if pi.startswith("PALETTE")
            else "it is a colour image")
    raise DecodeError(f"photometric interpretation {pi}: {what}, not grey intensities; the dicom decoders make "
                      f"grey (HU) volumes and accept only MONOCHROME1/MONOCHROME2", path=path)


def invert_monochrome1(pix: np.ndarray, ds) -> np.ndarray:
    """Flip MONOCHROME1 stored values (low displays bright) onto the MONOCHROME2 sense, within the
    stored bit range, so that a larger value is brighter as in every other file."""
    bits = int(getattr(ds, "BitsStored", 0) or getattr(ds, "BitsAllocated", 16))
    x = pix.astype(np.int64)
    if int(getattr(ds, "PixelRepresentation", 0) or 0) == 1:
        out = -1 - x
    else:
        out = (1 << bits) - 1 - x
    return out.astype(pix.dtype)


def frames_of(ds, path: str, monochrome1: str = "flag") -> list[Frame]:
    """One Frame per image frame, with geometry and rescale (per-frame functional groups honoured).

    ``monochrome1: invert`` flips MONOCHROME1 values (:func:`invert_monochrome1`); ``flag`` keeps
    them as stored and adds a warning to the file's metadata."""
    pi = photometric(ds, path)
    pix = pixel_frames(ds, path)
    if pi == "MONOCHROME1":
        if monochrome1 == "invert":
            pix = invert_monochrome1(pix, ds)
        else:
            ds._precompile_warnings.append("MONOCHROME1: low stored values display bright; values kept as stored "
                                           "(set monochrome1: invert to flip them)")
    top_pos = _vec(getattr(ds, "ImagePositionPatient", None), 3)
    top_ori = _vec(getattr(ds, "ImageOrientationPatient", None), 6)
    ps = _vec(getattr(ds, "PixelSpacing", None), 2)
    top_ps = (float(ps[0]), float(ps[1])) if ps is not None else None
    slope = _f(getattr(ds, "RescaleSlope", None))
    inter = _f(getattr(ds, "RescaleIntercept", None))
    thick = _f(getattr(ds, "SliceThickness", None))
    shared = _seq_item(ds, "SharedFunctionalGroupsSequence")
    per = getattr(ds, "PerFrameFunctionalGroupsSequence", None)
    out = []
    for i in range(pix.shape[0]):
        pos, ori, psp, sl, ic, th = top_pos, top_ori, top_ps, slope, inter, thick
        for grp in ([shared] if shared is not None else []) + ([per[i]] if per is not None and i < len(per) else []):
            pp = _seq_item(grp, "PlanePositionSequence")
            if pp is not None and _vec(getattr(pp, "ImagePositionPatient", None), 3) is not None:
                pos = _vec(pp.ImagePositionPatient, 3)
            po = _seq_item(grp, "PlaneOrientationSequence")
            if po is not None and _vec(getattr(po, "ImageOrientationPatient", None), 6) is not None:
                ori = _vec(po.ImageOrientationPatient, 6)
            pm = _seq_item(grp, "PixelMeasuresSequence")
            if pm is not None:
                v = _vec(getattr(pm, "PixelSpacing", None), 2)
                if v is not None:
                    psp = (float(v[0]), float(v[1]))
                th = _f(getattr(pm, "SliceThickness", None)) or th
            pv = _seq_item(grp, "PixelValueTransformationSequence")
            if pv is not None:
                sl = _f(getattr(pv, "RescaleSlope", None)) or sl
                ic = _f(getattr(pv, "RescaleIntercept", None)) if _f(getattr(pv, "RescaleIntercept", None)) is not None else ic
        out.append(Frame(pix[i], pos, ori, psp, 1.0 if sl is None else sl, 0.0 if ic is None else ic, th,
                         os.path.basename(path)))
    return out


def assemble(frames: list[Frame], path: str, dtype: str = "float32", uneven: str = "resample",
             slice_spacing: Optional[float] = None, tilt: str = "correct", rescale: bool = True,
             sort: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """Stack frames into a (D, H, W) volume sorted along the slice normal; see the module docstring.

    Stages: check the frames agree -> rescale -> sort along the slice normal -> undo a gantry tilt
    -> even out the slice gaps -> the output dtype and the geometry metadata."""
    ps = _common_pixel_spacing(frames, path)
    meta: dict[str, Any] = {"num_slices_read": len(frames)}
    if rescale:   # an infinite or NaN slope made every voxel +-inf or NaN; a zero one made every voxel the intercept
        for f in frames:
            if not (np.isfinite(f.slope) and np.isfinite(f.intercept)) or f.slope == 0:
                raise DecodeError(f"{f.source}: RescaleSlope {f.slope:g} / RescaleIntercept {f.intercept:g} map no "
                                  f"stored value to a Hounsfield unit (the slope must be a finite non-zero number, "
                                  f"the intercept finite); rescale: false keeps the stored values", path=path)
    vals = [f.pixels.astype(np.float32) * np.float32(f.slope) + np.float32(f.intercept) if rescale
            else f.pixels.astype(np.float32) for f in frames]
    thickness = frames[0].thickness
    axes = origin = None
    if all(f.position is not None and f.orientation is not None for f in frames):
        axes, d, pos, vals = _sort_along_normal(frames, vals, path, sort)
        vals = _correct_tilt(vals, pos, d, axes, ps, tilt, meta)
        origin = pos[0]
        if len(d) > 1:
            vol, slice_sp = _even_gaps(vals, d, slice_spacing, uneven, path, meta)
        else:
            vol, slice_sp = np.stack(vals), thickness
    else:
        vol, slice_sp = np.stack(vals), thickness
        meta["positions"] = "missing: stored order kept"
    if dtype == "int16":
        vol = np.clip(np.rint(vol), -32768, 32767).astype(np.int16)
    else:
        vol = vol.astype(np.float32, copy=False)
    sz = None if slice_sp is None else round(float(slice_sp), 6)
    meta.update(
        spacing=[sz, float(ps[0]), float(ps[1])],
        spacing_rcs=[float(ps[0]), float(ps[1]), sz],
        orientation=None if axes is None else [[round(float(x), 7) for x in v] for v in axes],
        origin=None if origin is None else [round(float(x), 5) for x in origin],
        shape=list(vol.shape),
    )
    return np.ascontiguousarray(vol), meta


def _common_pixel_spacing(frames: list[Frame], path: str) -> tuple[float, float]:
    """The frames' one size and PixelSpacing (DecodeError when they differ); (1, 1) when none is stored."""
    shapes = {f.pixels.shape for f in frames}
    if len(shapes) != 1:
        raise DecodeError(f"slices differ in size: {sorted(shapes)}", path=path)
    ps = frames[0].pixel_spacing or (1.0, 1.0)
    if any((f.pixel_spacing or ps) != ps for f in frames):
        raise DecodeError("slices differ in PixelSpacing", path=path)
    if min(ps) <= 0:   # (resampling divided by it; a negative one flipped nothing and broke every size)
        raise DecodeError(f"PixelSpacing {[float(x) for x in ps]} is not positive", path=path)
    return ps


def _sort_along_normal(frames: list[Frame], vals: list[np.ndarray], path: str, sort: bool
                       ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray, np.ndarray, list[np.ndarray]]:
    """((row, col, normal) unit axes, positions along the normal, slice origins, slices), sorted along
    the normal (unless ``sort`` is off); DecodeError for mixed orientations or a shared position."""
    oris = np.stack([f.orientation for f in frames])
    if np.abs(oris - oris[0]).max() > 1e-3:
        raise DecodeError("slices differ in ImageOrientationPatient (not one stack)", path=path)
    row, col = oris[0][:3], oris[0][3:]
    nr, nc = np.linalg.norm(row), np.linalg.norm(col)
    normal = np.cross(row, col)
    if min(nr, nc) < 1e-6 or np.linalg.norm(normal) < 1e-3 * nr * nc:   # (a zero row gave NaN geometry)
        raise DecodeError(f"ImageOrientationPatient {[float(x) for x in oris[0]]}: the row and column directions "
                          f"must be non-zero and not parallel", path=path)
    row, col = row / nr, col / nc
    normal = np.cross(row, col)
    pos = np.stack([f.position for f in frames])
    d = pos @ normal
    order = np.argsort(d, kind="stable") if sort else np.arange(len(frames))
    d, pos = d[order], pos[order]
    vals = [vals[i] for i in order]
    if len(d) > 1 and np.min(np.diff(d)) < 1e-4:
        raise DecodeError("two slices share one position along the slice normal (duplicate or mixed "
                          "acquisitions)", path=path)
    return (row, col, normal), d, pos, vals


def _correct_tilt(vals: list[np.ndarray], pos: np.ndarray, d: np.ndarray, axes: tuple[np.ndarray, ...],
                  ps: tuple[float, float], tilt: str, meta: dict[str, Any]) -> list[np.ndarray]:
    """Shift each slice back by its origin's in-plane drift (a tilted gantry) when ``tilt`` is
    ``correct``; records the tilt angle in ``meta``."""
    from scipy import ndimage

    row, col, normal = axes
    # in-plane drift of each slice origin, in pixels (row index, column index): a tilted gantry
    rel = pos - pos[0]
    drift = np.stack([rel @ col / ps[0], rel @ row / ps[1]], axis=1)
    if not (len(d) > 1 and np.abs(drift).max() > 0.05):
        return vals
    step = np.linalg.norm(rel[-1] - (rel[-1] @ normal) * normal)
    meta["tilt_deg"] = round(float(np.degrees(np.arctan2(step, d[-1] - d[0]))), 3)
    if tilt == "correct":
        cval = float(min(v.min() for v in vals))
        vals = [ndimage.shift(v, (dr, dc), order=1, mode="constant", cval=cval) if abs(dr) + abs(dc) > 1e-6
                else v for v, (dr, dc) in zip(vals, drift)]
    meta["tilt_corrected"] = tilt == "correct"
    return vals


def _even_gaps(vals: list[np.ndarray], d: np.ndarray, slice_spacing: Optional[float], uneven: str, path: str,
               meta: dict[str, Any]) -> tuple[np.ndarray, float]:
    """The stacked volume and its slice spacing: resampled (linearly along the normal) onto even gaps
    when the gaps are uneven (``uneven: resample``) or ``slice_spacing`` asks for another spacing."""
    gaps = np.diff(d)
    med = float(np.median(gaps))
    meta["gap_min"], meta["gap_max"] = round(float(gaps.min()), 4), round(float(gaps.max()), 4)
    is_uneven = float(np.abs(gaps - med).max()) > max(0.01, 0.01 * med)
    meta["uneven_gaps"] = bool(is_uneven)
    target = float(slice_spacing) if slice_spacing else med
    if not ((is_uneven and uneven != "keep") or (slice_spacing and abs(slice_spacing - med) > 1e-6)):
        meta["resampled"] = False
        return np.stack(vals), med
    if is_uneven and uneven == "error":
        raise DecodeError(f"uneven slice gaps ({meta['gap_min']}..{meta['gap_max']} mm); set "
                          f"uneven: resample or keep", path=path)
    z = d - d[0]
    n_new = int(np.floor(z[-1] / target + 1e-6)) + 1
    znew = np.arange(n_new) * target
    hi = np.clip(np.searchsorted(z, znew, side="right"), 1, len(z) - 1)
    lo = hi - 1
    w = ((znew - z[lo]) / (z[hi] - z[lo])).astype(np.float32)
    stack = np.stack(vals)
    meta["resampled"] = True
    return stack[lo] * (1 - w)[:, None, None] + stack[hi] * w[:, None, None], target


class _DicomParams(DecoderParams):
    dtype: Literal["float32", "int16"] = "float32"   # HU as float32, or rounded to int16
    rescale: bool = True          # apply RescaleSlope/RescaleIntercept (HU for CT)
    force: bool = False           # read files without the DICOM preamble/file meta
    uneven: Literal["resample", "keep", "error"] = "resample"   # uneven slice gaps
    slice_spacing: Optional[float] = Field(None, gt=0)  # resample to this slice spacing (mm); default: the median gap
    tilt: Literal["correct", "keep"] = "correct"      # tilted gantry: shift slices onto an orthogonal grid
    monochrome1: Literal["flag", "invert"] = "flag"   # MONOCHROME1 files: keep values (warned) or invert them


def _finish_meta(meta: dict, warns: list[str], extra: dict) -> dict:
    meta.update(extra)
    if warns:
        meta["warnings"] = sorted(set(warns))[:5]
    return meta


@DECODERS.register()
class DicomDecoder(Decoder):
    """One DICOM file -> (F, H, W) volume (a multi-frame file sorted along the normal; one frame: F = 1)."""

    name = "dicom"
    kind = "volume"
    Params = _DicomParams

    def spec(self) -> FieldSpec:
        return FieldSpec("volume", (None, None, None), self.params.dtype)

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        ds = read_dataset(path, p.force)
        check_dicom_budget([ds], path, self.max_bytes)
        fr = frames_of(ds, path, p.monochrome1)
        vol, meta = assemble(fr, path, p.dtype, p.uneven, p.slice_spacing, p.tilt, p.rescale)
        return vol, _finish_meta(meta, ds._precompile_warnings, {
            "modality": str(getattr(ds, "Modality", "")), "transfer_syntax": str(_transfer_syntax(ds)),
            **_photometric_meta([ds], p.monochrome1)})


def _photometric_meta(datasets: list, monochrome1: str) -> dict[str, Any]:
    pis = sorted({str(getattr(d, "PhotometricInterpretation", "") or "MONOCHROME2").strip().upper() for d in datasets})
    out: dict[str, Any] = {"photometric": pis[0] if len(pis) == 1 else pis}
    if "MONOCHROME1" in pis:
        out["inverted"] = monochrome1 == "invert"
    return out


def _has_preamble(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:132] == b"DICM"


@DECODERS.register()
class DicomSeriesDecoder(Decoder):
    """A folder of single-frame DICOM files (any names, no extension needed) -> one (D, H, W) volume.

    Files without the DICOM preamble are skipped (listed in ``meta.skipped``)
    unless ``force``; if the folder holds several SeriesInstanceUIDs, pick one
    with ``series_uid`` or ``multiple: largest``."""

    name = "dicom_series"
    kind = "volume"
    reads_dirs = True

    class Params(_DicomParams):
        series_uid: Optional[str] = None     # take only this series from the folder
        multiple: Literal["error", "largest"] = "error"   # a folder with several series
        recursive: bool = False              # also read files in sub-folders

    def spec(self) -> FieldSpec:
        return FieldSpec("volume", (None, None, None), self.params.dtype)

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        if not os.path.isdir(path):
            raise DecodeError("is not a folder (dicom_series reads a folder; use the dicom decoder for files)",
                              path=path)
        files = []
        for dirpath, dirnames, names in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if p.recursive else []
            files += [os.path.join(dirpath, n) for n in sorted(names) if not n.startswith(".")]
        skipped, headers = [], []
        for fp in files:
            if self.inner_check is not None:
                self.inner_check(fp)   # a file linked out of inputs.root fails the series, naming the file
            if not p.force and not _has_preamble(fp):
                skipped.append(os.path.relpath(fp, path))
                continue
            ds = read_dataset(fp, p.force, header_only=True)
            headers.append((fp, ds))
        if not headers:
            raise DecodeError(f"no DICOM files in the folder ({len(skipped)} other files)", path=path)
        groups: dict[str, list] = {}
        for fp, ds in headers:
            groups.setdefault(str(getattr(ds, "SeriesInstanceUID", "")), []).append(fp)
        if p.series_uid is not None:
            if p.series_uid not in groups:
                raise DecodeError(f"no series {p.series_uid!r} here (found {sorted(groups)})", path=path)
            uid = p.series_uid
        elif len(groups) > 1:
            if p.multiple == "error":
                raise DecodeError(f"the folder holds {len(groups)} series ({', '.join(sorted(groups))}); set "
                                  f"series_uid or multiple: largest", path=path)
            uid = max(sorted(groups), key=lambda u: len(groups[u]))
        else:
            uid = next(iter(groups))
        chosen = set(groups[uid])
        check_dicom_budget([ds for fp, ds in headers if fp in chosen], path, self.max_bytes)
        frames, warns, ds0, all_ds = [], [], None, []
        for fp in groups[uid]:
            ds = read_dataset(fp, p.force)
            ds0 = ds0 or ds
            all_ds.append(ds)
            fr = frames_of(ds, fp, p.monochrome1)
            warns += ds._precompile_warnings
            if len(fr) != 1:
                raise DecodeError(f"is a multi-frame file ({len(fr)} frames) inside a series folder; decode it "
                                  f"with the dicom decoder", path=fp)
            frames += fr
        vol, meta = assemble(frames, path, p.dtype, p.uneven, p.slice_spacing, p.tilt, p.rescale)
        extra = {"series_uid": uid, "num_files": len(groups[uid]), "modality": str(getattr(ds0, "Modality", "")),
                 "transfer_syntax": str(_transfer_syntax(ds0)), **_photometric_meta(all_ds, p.monochrome1)}
        if skipped:
            extra["skipped"] = skipped[:20]
        return vol, _finish_meta(meta, warns, extra)
