"""NIfTI-1/2 through nibabel: ``nifti`` (image volumes) and ``nifti_labels`` (label volumes), ``.nii``/``.nii.gz``.

Output follows the DICOM decoders' conventions (:mod:`precompile.decoders.dicom`)
so that a NIfTI and a DICOM series of the same scan come out alike:

- the array is (D, H, W) = (slice, row, column); NIfTI stores (i, j, k), so the
  volume is the stored data transposed to (k, j, i): W is NIfTI's i, H is j, D is k;
- metadata are in DICOM's patient coordinates (LPS: x to the patient's Left,
  y to Posterior, z to Superior), converted from NIfTI's RAS world coordinates:
  ``spacing`` [slice, row, col] (mm), ``spacing_rcs`` [row, col, slice],
  ``orientation`` [row cosines (direction of W), column cosines (direction of H),
  slice direction (of D)] and ``origin`` (the first voxel's position);
  ``axis_directions`` names where D, H and W point (e.g. ``["S", "P", "L"]``).

``orient`` chooses the voxel order: ``native`` keeps the stored order;
``LPS`` reorders (flips and permutations only, never interpolation) so that
W runs to the patient's Left, H to Posterior and D to Superior, which is what the
DICOM decoder gives for an ordinary axial series (ImageOrientationPatient
1,0,0,0,1,0); ``RAS`` makes W run to the Right, H to Anterior, D to Superior
(nibabel's closest canonical, i.e. ``as_closest_canonical``, in our axis order).
An oblique volume is reordered to the closest of these; its true direction
cosines stay in ``orientation``.

``nifti`` applies the header's scl_slope/scl_inter (``rescale``) and gives
float32 or rounded int16, like the DICOM decoder. ``nifti_labels`` gives kind
``volume_mask`` integer labels: the stored integers unchanged (scaling that is not
the identity, or non-integer values, is an error rather than a rounding), checked
against the chosen ``dtype``'s range; no interpolation anywhere.
4D files: a trailing axis of size 1 is dropped; otherwise ``index`` picks one volume,
and ``index: all`` makes one sample per volume: the plan reads each file's header
(:meth:`_NiftiDecoder.item_options`) and a 4D file of N volumes becomes the samples
``<key>#v0`` .. ``<key>#v<N-1>``, each decoding its own volume, while a 3D file stays one
sample under its own key (so a folder mixing 3D and 4D files builds with one recipe).
"""
from __future__ import annotations

import importlib.util
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import Field, NonNegativeInt

from ..errors import DecodeError, MissingDependencyError
from ..registry import DECODERS
from ..sample import FieldSpec
from .base import DEFAULT_INPUT_BYTES, Decoder, DecoderParams, check_budget

NIFTI_EXTRA = "pip install 'precompile[nifti]' (nibabel)"
_LPS = np.diag([-1.0, -1.0, 1.0])   # RAS <-> LPS (its own inverse)
# target directions of NIfTI axes (i, j, k) = our (W, H, D)
_TARGET = {"LPS": ("L", "P", "S"), "RAS": ("R", "A", "S")}


def _need_nibabel() -> None:
    if importlib.util.find_spec("nibabel") is None:
        raise MissingDependencyError(f"the NIfTI decoders need nibabel: {NIFTI_EXTRA}")


class _NiftiParams(DecoderParams):
    orient: Literal["native", "LPS", "RAS"] = "native"   # voxel order: as stored, or reordered (see the module doc)
    index: Optional[Union[NonNegativeInt, Literal["all"]]] = Field(
        None, description="4D files: which volume along the 4th axis, or all: one sample per volume "
                          "(3D files stay one sample)")


class _NiftiDecoder(Decoder):
    """What the two NIfTI decoders share: ``index: all`` splits a 4D file into one item per volume."""

    def item_options(self, path: str) -> Optional[list[dict[str, Any]]]:
        """With ``index: all``: the decoder options of each sample the file at ``path`` makes
        (``[{"index": 0}, ...]`` for a 4D file), None to keep the one sample (a 3D file, another
        ``index``, or a header that cannot be read: decoding then names the problem)."""
        if self.params.index != "all":
            return None
        n = volume_count(path)
        return None if n is None else [{"index": i} for i in range(n)]


def volume_count(path: str) -> Optional[int]:
    """The number of volumes along the 4th axis of the NIfTI at ``path`` from its header alone (no voxels
    read); None for a 3D file (or 4D with one volume) and for a file nibabel cannot open."""
    import nibabel as nib

    try:
        shape = tuple(int(v) for v in nib.load(path).shape)
    except Exception:  # unreadable: the decode stage reports it with the file's name
        return None
    if len(shape) != 4 or shape[3] == 1:
        return None
    return shape[3]


def load_nifti(path: str, index: Optional[int | str],
               budget: int = DEFAULT_INPUT_BYTES) -> tuple[Any, tuple, np.ndarray, dict[str, Any]]:
    """(image, the index that picks the 3D volume, its RAS affine, meta); the voxels are not read yet, and
    a volume whose declared size needs more than ``budget`` (stored, float64 scaled, output) is refused."""
    import nibabel as nib
    from nibabel import orientations as ornt_mod

    try:
        img = nib.load(path)
    except FileNotFoundError:
        raise DecodeError("file not found", path=path) from None
    except MemoryError:
        raise
    except Exception as e:  # ImageFileError, gzip/zlib errors, bad headers
        raise DecodeError(f"not a readable NIfTI file: {type(e).__name__}: {e}", path=path) from None
    if not isinstance(img, (nib.Nifti1Image, nib.Nifti2Image)):
        raise DecodeError(f"is a {type(img).__name__}, not NIfTI-1/2", path=path)
    shape = tuple(int(s) for s in img.shape)
    if len(shape) < 3:
        raise DecodeError(f"has {len(shape)} dimensions {shape}; a volume needs 3", path=path)
    sl: tuple = (slice(None),) * 3
    if index == "all":   # the plan split 4D files into one item per volume; what is left is one volume
        if len(shape) > 3 and any(n != 1 for n in shape[3:]):
            raise DecodeError(f"is {len(shape)}D {shape}: index: all makes one sample per volume in a "
                              f"recipe's plan; a decoder used alone needs index: N", path=path)
        index = None
    if len(shape) > 3:
        extra = shape[3:]
        if index is None:
            if any(n != 1 for n in extra):
                raise DecodeError(f"is {len(shape)}D {shape}; set index to pick one volume along axis 4 "
                                  f"(or index: all for one sample per volume)", path=path)
            sl += (0,) * len(extra)
        else:
            if len(extra) > 1 or index >= extra[0]:
                raise DecodeError(f"index {index} is out of range for shape {shape}", path=path)
            sl += (index,)
    elif index is not None:
        raise DecodeError(f"index is set but the file is 3D {shape}", path=path)
    n = shape[0] * shape[1] * shape[2]
    if n == 0:   # (resampling it divided by zero)
        raise DecodeError(f"has no voxels {shape}", path=path)
    dt = img.get_data_dtype()
    if dt.fields is not None or dt.kind == "c":   # RGB24/RGBA32 or complex voxels: no one intensity per voxel
        kind = "complex" if dt.kind == "c" else "RGB(A)"
        raise DecodeError(f"stores {kind} voxels ({dt}), not one intensity per voxel", path=path)
    check_budget(path, f"{shape[0]}x{shape[1]}x{shape[2]} voxels", n * (dt.itemsize + 8 + 4), budget)
    affine = np.asarray(img.affine, dtype=np.float64)
    if not np.isfinite(affine).all() or abs(np.linalg.det(affine[:3, :3])) < 1e-12:
        raise DecodeError("has a degenerate or non-finite affine (no usable qform/sform)", path=path)
    meta: dict[str, Any] = {"qform_code": int(img.header["qform_code"]), "sform_code": int(img.header["sform_code"]),
                            "stored_axcodes": "".join(ornt_mod.aff2axcodes(affine))}
    return img, sl, affine, meta


def read_voxels(img: Any, sl: tuple, scaled: bool, path: str) -> np.ndarray:
    """The (i, j, k) voxels, with or without scl_slope/scl_inter; read errors become DecodeError."""
    try:
        arr = np.asanyarray(img.dataobj) if scaled else np.asanyarray(img.dataobj.get_unscaled())
        return np.asarray(arr[sl])
    except MemoryError:
        raise
    except Exception as e:  # truncated data, bad gzip stream
        raise DecodeError(f"cannot read the voxel data (truncated?): {type(e).__name__}: {e}", path=path) from None


def reorient(arr: np.ndarray, affine: np.ndarray, orient: str) -> tuple[np.ndarray, np.ndarray]:
    """Flip/permute the (i, j, k) array to ``orient`` (no interpolation); returns the array and its affine."""
    from nibabel import orientations as o

    if orient == "native":
        return arr, affine
    transform = o.ornt_transform(o.io_orientation(affine), o.axcodes2ornt(_TARGET[orient]))
    return o.apply_orientation(arr, transform), affine @ o.inv_ornt_aff(transform, arr.shape[:3])


def geometry_meta(affine: np.ndarray, shape_ijk: tuple[int, ...]) -> dict[str, Any]:
    """DICOM-style geometry (LPS, array order (D, H, W) = (k, j, i)) from a RAS affine of an (i, j, k) array."""
    from nibabel.orientations import aff2axcodes

    cols = _LPS @ affine[:3, :3]
    sp = np.linalg.norm(cols, axis=0)              # spacing along i, j, k
    dirs = cols / sp                                # unit directions in LPS
    origin = _LPS @ affine[:3, 3]
    codes = aff2axcodes(affine)                     # where i, j, k point (RAS letters)
    r = lambda v: [round(float(x), 7) + 0.0 for x in v]  # noqa: E731  (+0.0: no "-0.0" in meta)
    return {
        "spacing": [round(float(sp[2]), 6), round(float(sp[1]), 6), round(float(sp[0]), 6)],
        "spacing_rcs": [round(float(sp[1]), 6), round(float(sp[0]), 6), round(float(sp[2]), 6)],
        "orientation": [r(dirs[:, 0]), r(dirs[:, 1]), r(dirs[:, 2])],
        "origin": [round(float(x), 5) + 0.0 for x in origin],
        "axis_directions": [codes[2], codes[1], codes[0]],
        "shape": [int(shape_ijk[2]), int(shape_ijk[1]), int(shape_ijk[0])],
    }


def _to_dhw(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(arr, (2, 1, 0)))


@DECODERS.register()
class NiftiDecoder(_NiftiDecoder):
    """A ``.nii``/``.nii.gz`` image volume -> (D, H, W) float32 (or int16), scaled by scl_slope/scl_inter."""

    name = "nifti"
    kind = "volume"

    class Params(_NiftiParams):
        dtype: Literal["float32", "int16"] = Field("float32", description="the stored voxel type")
        rescale: bool = True       # apply the header's scl_slope / scl_inter

    def __init__(self, params: DecoderParams | None = None):
        _need_nibabel()
        super().__init__(params)

    def spec(self) -> FieldSpec:
        return FieldSpec("volume", (None, None, None), self.params.dtype)

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        img, sl, affine, meta = load_nifti(path, p.index, self.max_bytes)
        raw = read_voxels(img, sl, p.rescale, path)
        with np.errstate(over="ignore"):   # (checked below)
            arr = raw.astype(np.float32, copy=False)
        if raw.dtype.itemsize > 4 and raw.dtype.kind == "f":   # float64 values past float32's range became inf
            over = np.isinf(arr) & np.isfinite(raw)
            if over.any():
                raise DecodeError(f"{int(over.sum())} voxel(s) (e.g. {float(raw[over][0]):g}) are beyond float32's "
                                  f"range", path=path)
        if p.dtype == "int16" and not np.isfinite(arr).all():   # NaN has no int16 (the cast gave arbitrary values)
            raise DecodeError(f"{int((~np.isfinite(arr)).sum())} voxel(s) are NaN or infinite, which int16 cannot "
                              f"store; use dtype: float32 (NaN kept)", path=path)
        arr, affine = reorient(arr, affine, p.orient)
        meta.update(geometry_meta(affine, arr.shape))
        if p.dtype == "int16":
            vol = np.clip(np.rint(arr), -32768, 32767).astype(np.int16)
        else:
            vol = arr.astype(np.float32, copy=False)
        return _to_dhw(vol), meta


_LABEL_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")


@DECODERS.register()
class NiftiLabelsDecoder(_NiftiDecoder):
    """A ``.nii``/``.nii.gz`` label volume -> (D, H, W) integer labels of kind ``volume_mask``."""

    name = "nifti_labels"
    kind = "volume_mask"

    class Params(_NiftiParams):
        dtype: Literal["uint8", "uint16", "int16", "int32", "int64"] = Field(
            "uint8", description="the stored integer type of label ids")

    def __init__(self, params: DecoderParams | None = None):
        _need_nibabel()
        super().__init__(params)

    def spec(self) -> FieldSpec:
        return FieldSpec("volume_mask", (None, None, None), self.params.dtype)

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        img, sl, affine, meta = load_nifti(path, p.index, self.max_bytes)
        # nibabel moves scl_slope/scl_inter from the header to the array proxy when it loads a file
        slope, inter = getattr(img.dataobj, "slope", 1.0), getattr(img.dataobj, "inter", 0.0)
        if slope != 1.0 or inter != 0.0:
            raise DecodeError(f"a label volume must not be scaled (scl_slope={slope}, scl_inter={inter}); labels are "
                              f"read as stored integers", path=path)
        raw = read_voxels(img, sl, False, path)
        if raw.dtype.kind == "f":
            if not np.isfinite(raw).all() or not np.array_equal(raw, np.round(raw)):
                raise DecodeError(f"label volume holds non-integer values ({raw.dtype}); use the nifti decoder for "
                                  f"intensities", path=path)
        elif raw.dtype.kind not in "iub":
            raise DecodeError(f"label volume has data type {raw.dtype}, not integers", path=path)
        info = np.iinfo(p.dtype)
        if raw.size:
            lo, hi = raw.min(), raw.max()
            if lo < info.min or hi > info.max:
                raise DecodeError(f"labels span {lo:g}..{hi:g}, outside {p.dtype}'s range {info.min}..{info.max}; "
                                  f"set dtype (one of {', '.join(_LABEL_DTYPES)})", path=path)
        arr = raw.astype(p.dtype)
        arr, affine = reorient(arr, affine, p.orient)
        meta.update(geometry_meta(affine, arr.shape))
        meta["labels"] = [int(v) for v in np.unique(arr)[:256]]
        return _to_dhw(arr), meta
