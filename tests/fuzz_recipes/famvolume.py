"""Volumes: NIfTI files (nibabel writes them, any axis order and direction, 3D or 4D, scaled or not) and DICOM
series and files (pydicom writes them: shuffled names, uneven gaps, tilt, MONOCHROME1, two series in a folder,
sub-folders, files without meta) whose voxels hold a linear function of their place, and a label volume that is a
function of that intensity. References: nibabel's own reading and orientation code, the slices sorted by their
position (read with pydicom), and the docs' rules of each 3D step, applied here with numpy."""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from .oracles import Report
from .truth import label_of_volume, linear_volume, rng_of

LABELS = {0, 3, 9}


# -- drawing -------------------------------------------------------------------------------------------------------
def _draw_steps(r: np.random.Generator, shape: tuple[int, int, int], with_mask: bool, mask_name: str) -> list[dict]:
    from .draw import _choice

    steps: list[dict] = []
    D, H, W = shape
    lung = False
    for _ in range(int(_choice(r, [0, 1, 2, 2, 3]))):
        name = _choice(r, ["resample_volume", "crop_pad_volume", "patches3d", "random_flip3d", "random_rot90", "elastic",
                           "hu_window", "standardise", "lung_mask", "apply_mask", "gaussian_noise"],
                       [2, 2, 1, 2, 2, 1, 2, 1, 1, 3, 1])
        if name == "resample_volume":
            if r.random() < 0.5:
                p: dict[str, Any] = {"shape": [int(r.integers(4, 12)) for _ in range(3)]}
            else:
                p = {"spacing": [float(_choice(r, [1.0, 1.5, 2.5])) for _ in range(3)]}
            if r.random() < 0.5:
                p["order"] = int(_choice(r, [0, 1, 2, 3]))
            if r.random() < 0.2:
                p["spacing_from"] = "volume"
            if "spacing" in p:   # keep the grid small
                continue
            D, H, W = p["shape"]
        elif name == "crop_pad_volume":
            p = {"shape": [int(r.integers(3, 14)) for _ in range(3)]}
            if r.random() < 0.4:
                p["pad_value"] = -7
            D, H, W = p["shape"]
        elif name == "patches3d":
            if any(s in steps for s in ()):
                continue
            size = [int(r.integers(2, 7)) for _ in range(3)]
            p = {"size": size}
            if r.random() < 0.5:
                p["stride"] = [int(r.integers(2, 7)) for _ in range(3)]
            if r.random() < 0.3:
                p["pad"] = False
            if r.random() < 0.3:
                p["pad_value"] = -3
            if with_mask and r.random() < 0.4:
                p["mask"] = mask_name
                p["min_fraction"] = float(_choice(r, [0.0, 0.2, 0.5]))
            if r.random() < 0.4:
                p["max_patches"] = int(r.integers(1, 5))
            if r.random() < 0.6:
                p["corner_field"] = "corner"
            steps.append({name: p})
            D, H, W = size
            break   # patches expand: keep it last of the geometric ones
        elif name == "random_flip3d":
            p = {}
            if r.random() < 0.5:
                p["prob"] = float(_choice(r, [0.5, 1.0]))
            if r.random() < 0.5:
                p["axes"] = sorted(set(int(a) for a in r.integers(0, 3, 2)))
        elif name == "random_rot90":
            planes = [pl for pl in ([1, 2], [0, 1], [0, 2]) if (D, H, W)[pl[0]] == (D, H, W)[pl[1]]]
            if planes and r.random() < 0.6:
                p = {"planes": [planes[0]], "k": [0, 1, 2, 3]}
            else:
                p = {"planes": [_choice(r, [[1, 2], [0, 1], [0, 2]])], "k": [0, 2]}
        elif name == "elastic":
            p = {"magnitude": _choice(r, [0.5, 1.5, [0.5, 2.0]])}
            if r.random() < 0.5:
                p["grid"] = int(_choice(r, [2, 3, 4]))
        elif name == "hu_window":
            p = {"window": [-1200, 600]} if r.random() < 0.5 else {"level": -300, "width": 1500}
            if r.random() < 0.4:
                p["dtype"] = "uint8"
        elif name == "standardise":
            p = {"per_sample": True} if r.random() < 0.5 else {"mean": -500.0, "std": 400.0}
            if p.get("per_sample") and with_mask and r.random() < 0.4:
                p["mask"] = mask_name
        elif name == "lung_mask":
            if lung:
                continue
            lung = True
            p = {"out": "lungs", "threshold": float(_choice(r, [-320, -600]))}
            if r.random() < 0.3:
                p["components"] = 1
            if r.random() < 0.3:
                p["min_fraction"] = 0.01
            if r.random() < 0.3:
                p["closing"] = 0
            if r.random() < 0.3:
                p["fill_holes"] = False
        elif name == "apply_mask":
            if not with_mask and not lung:
                continue
            p = {"mask": mask_name if with_mask and (not lung or r.random() < 0.5) else "lungs"}
            if r.random() < 0.5:
                p["fill"] = -1000
        else:
            p = {"std": 5.0, "fields": ["volume"]}
        steps.append({name: p})
    return steps


def draw_volume(seed: int) -> dict:
    from .draw import _choice

    r = rng_of(seed, "volume")
    items = []
    four_d = r.random() < 0.2
    for i in range(int(r.integers(1, 3))):
        shape = [int(r.integers(5, 12)) for _ in range(3)]
        if r.random() < 0.4:
            shape[1] = shape[2]
        perm = [int(x) for x in r.permutation(3)] if r.random() < 0.5 else [0, 1, 2]
        signs = [int(_choice(r, [1, -1])) for _ in range(3)]
        items.append({"name": f"s{i}", "shape": shape, "perm": perm, "signs": signs,
                      "spacing": [float(_choice(r, [0.8, 1.0, 2.0])) for _ in range(3)],
                      "coef": [float(x) for x in r.uniform(-60, 60, 3).round(1)], "base": -400.0,
                      "dtype": _choice(r, ["float32", "int16"]), "scl": [2.0, -1000.0] if r.random() < 0.3 else None,
                      "nvol": int(r.integers(2, 4)) if four_d else None, "gz": bool(r.random() < 0.5)})
    orient = _choice(r, ["native", "LPS", "RAS"])
    vol: dict[str, Any] = {"decoder": "nifti"}
    if orient != "native" or r.random() < 0.3:
        vol["orient"] = orient
    if four_d:
        vol["index"] = _choice(r, ["all", 0, 1])
    if r.random() < 0.3:
        vol["dtype"] = "int16"
    if r.random() < 0.25:
        vol["rescale"] = False
    with_mask = r.random() < 0.7
    fields: dict[str, Any] = {"volume": vol}
    mask_name = "seg"
    if with_mask:
        m: dict[str, Any] = {"decoder": "nifti_labels", "path": "seg/{name}.nii.gz"}
        if "orient" in vol:
            m["orient"] = vol["orient"]
        if four_d:
            m["index"] = vol["index"]
        if r.random() < 0.4:
            m["dtype"] = _choice(r, ["uint8", "uint16", "int16", "int32", "int64"])
        fields[mask_name] = m
    shape = tuple(items[0]["shape"])
    steps = _draw_steps(r, (shape[2], shape[1], shape[0]), with_mask, mask_name)
    recipe = {"name": "fz", "seed": int(r.integers(0, 100)),
              "inputs": {"root": "$IN", "match": "vol/{name}.{ext}", "where": {"ext": "nii|nii.gz"}, "fields": fields},
              "steps": steps, "output": {"format": "hdf5", "samples_per_shard": int(r.integers(1, 4))}}
    for it in items:
        it["ext"] = "nii.gz" if it["gz"] else "nii"
    if any(next(iter(s)) in ("random_flip3d", "random_rot90", "elastic") for s in steps) and r.random() < 0.3:
        recipe["copies"] = int(r.integers(1, 3))
    return {"seed": seed, "family": "volume", "inputs": {"items": items, "mask": with_mask}, "recipe": recipe,
            "loader": None, "j2": bool(r.random() < 0.05)}


def draw_dicom(seed: int) -> dict:
    from .draw import _choice

    r = rng_of(seed, "dicom")
    items = []
    for i in range(int(r.integers(1, 3))):
        n = int(r.integers(4, 9))
        it = {"name": f"p{i}", "n": n, "rows": int(r.integers(5, 10)), "cols": int(r.integers(5, 10)),
              "gap": float(_choice(r, [1.0, 2.5])), "coef": [float(x) for x in r.uniform(-40, 40, 3).round(1)],
              "slope": float(_choice(r, [1.0, 2.0])), "intercept": float(_choice(r, [-1024.0, 0.0])),
              "uneven": bool(r.random() < 0.2), "tilt": float(_choice(r, [0.0, 0.0, 15.0])),
              "mono1": bool(r.random() < 0.15), "second": bool(r.random() < 0.3), "sub": bool(r.random() < 0.2),
              "nometa": bool(r.random() < 0.15), "single": False}
        items.append(it)
    single = r.random() < 0.3
    if single:   # enhanced multi-frame files: per-frame positions (uneven, tilted), with or without file meta
        for it in items:
            it.update(single=True, second=False, sub=False)
    dec: dict[str, Any] = {"decoder": "dicom" if single else "dicom_series"}
    if r.random() < 0.3:
        dec["dtype"] = "int16"
    if r.random() < 0.3:
        dec["rescale"] = False
    if any(it["nometa"] for it in items):
        dec["force"] = True
    if any(it["uneven"] for it in items):
        dec["uneven"] = _choice(r, ["resample", "keep"])
        if dec["uneven"] == "resample" and r.random() < 0.5:
            dec["slice_spacing"] = float(_choice(r, [1.0, 2.0]))
    if any(it["tilt"] for it in items) and r.random() < 0.5:
        dec["tilt"] = "keep"
    if any(it["mono1"] for it in items) and r.random() < 0.5:
        dec["monochrome1"] = "invert"
    if not single:
        if any(it["second"] for it in items):
            if r.random() < 0.5:
                dec["multiple"] = "largest"
            else:
                dec["series_uid"] = "1.2.826.0.1.9"
        if any(it["sub"] for it in items):
            dec["recursive"] = True
    inputs_r: dict[str, Any] = {"root": "$IN", "fields": {"volume": dec}}
    if single:
        inputs_r["match"] = "{name}.dcm"
    else:
        inputs_r["match"] = "{name}"
        inputs_r["kind"] = "dir"
    shape = (items[0]["n"], items[0]["rows"], items[0]["cols"])
    steps = _draw_steps(r, shape, False, "seg")
    recipe = {"name": "fz", "seed": int(r.integers(0, 100)), "inputs": inputs_r, "steps": steps,
              "output": {"format": "hdf5", "samples_per_shard": int(r.integers(1, 4))}}
    return {"seed": seed, "family": "dicom", "inputs": {"items": items}, "recipe": recipe, "loader": None, "j2": False}


# -- writing -------------------------------------------------------------------------------------------------------
def _nifti_affine(it: dict) -> np.ndarray:
    A = np.zeros((4, 4))
    for ax in range(3):
        A[it["perm"][ax], ax] = it["signs"][ax] * it["spacing"][ax]
    A[:3, 3] = [3.0, -2.0, 5.0]
    A[3, 3] = 1
    return A


def _nifti_data(it: dict) -> np.ndarray:
    v = linear_volume(tuple(it["shape"]), tuple(it["coef"]), it["base"])
    if it["nvol"]:
        v = np.stack([v + 100.0 * t for t in range(it["nvol"])], axis=-1)
    if it["scl"]:
        v = (v - it["scl"][1]) / it["scl"][0]     # stored so that slope * stored + inter is the linear volume
    return np.rint(v).astype(np.int16) if it["dtype"] == "int16" else v.astype(np.float32)


def _thresholds(it: dict) -> tuple[float, float]:
    v = linear_volume(tuple(it["shape"]), tuple(it["coef"]), it["base"])
    return float(np.quantile(v, 0.35)) + 0.5, float(np.quantile(v, 0.7)) + 0.5


def write(case: dict, root: str) -> dict:
    return _write_nifti(case, root) if case["family"] == "volume" else _write_dicom(case, root)


def _write_nifti(case: dict, root: str) -> dict:
    import nibabel as nib

    truth = {}
    for it in case["inputs"]["items"]:
        A = _nifti_affine(it)
        data = _nifti_data(it)
        img = nib.Nifti1Image(data, A)
        if it["scl"]:
            img.header.set_slope_inter(*it["scl"])
        os.makedirs(os.path.join(root, "vol"), exist_ok=True)
        path = os.path.join(root, "vol", f"{it['name']}.{it['ext']}")
        nib.save(img, path)
        if case["inputs"]["mask"]:
            t1, t2 = _thresholds(it)
            lin = linear_volume(tuple(it["shape"]), tuple(it["coef"]), it["base"])
            lab = label_of_volume(lin, t1, t2)
            if it["nvol"]:
                lab = np.stack([lab] * it["nvol"], axis=-1)
            os.makedirs(os.path.join(root, "seg"), exist_ok=True)
            nib.save(nib.Nifti1Image(lab, A), os.path.join(root, "seg", f"{it['name']}.nii.gz"))
        truth[f"vol/{it['name']}.{it['ext']}"] = {"it": it, "path": path}
    return truth


def _slice_hu(it: dict, z: float) -> np.ndarray:
    rr, cc = np.mgrid[0:it["rows"], 0:it["cols"]].astype(np.float64)
    return -300.0 + it["coef"][0] * z + it["coef"][1] * rr + it["coef"][2] * cc


def _write_dicom(case: dict, root: str) -> dict:
    import pydicom
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian

    truth = {}
    for it in case["inputs"]["items"]:
        rng = rng_of(case["seed"], it["name"])
        zs = [k * it["gap"] for k in range(it["n"])]
        if it["uneven"]:
            zs = [z for k, z in enumerate(zs) if k != it["n"] // 2]      # one slice missing: a double gap
        tilt = np.radians(it["tilt"])
        row = np.array([1.0, 0, 0])
        col = np.array([0, np.cos(tilt), -np.sin(tilt)])
        slices = []
        for k, z in enumerate(zs):
            hu = _slice_hu(it, z)
            raw = np.rint((hu - it["intercept"]) / it["slope"])
            unsigned = it["mono1"]
            if unsigned:   # MONOCHROME1 (an X-ray's sense) as unsigned 12-bit values
                raw = np.clip(raw + 2048, 0, 4095)
            slices.append((z, raw, unsigned))
        frames_z = [s_[0] for s_ in slices][::-1]   # frames stored in reverse order: sorting matters
        def make(pix, z, inst, uid, unsigned, frames=None):
            ds = pydicom.Dataset()
            ds.file_meta = FileMetaDataset()
            ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
            ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
            ds.file_meta.MediaStorageSOPInstanceUID = f"{uid}.{inst}"
            ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, f"{uid}.{inst}"
            ds.SeriesInstanceUID, ds.InstanceNumber, ds.Modality = uid, int(rng.integers(1, 1000)), "CT"
            ds.ImagePositionPatient = [0.0, 0.0, float(z)] if not tilt else list(np.array([0.0, 0.0, z]))
            ds.ImageOrientationPatient = list(row) + list(col)
            ds.PixelSpacing = [0.5, 0.75]
            ds.SliceThickness = it["gap"]
            ds.Rows, ds.Columns = pix.shape[-2:]
            ds.SamplesPerPixel = 1
            ds.PhotometricInterpretation = "MONOCHROME1" if it["mono1"] else "MONOCHROME2"
            ds.BitsAllocated = 16
            ds.BitsStored = 12 if unsigned else 16
            ds.HighBit, ds.PixelRepresentation = (11, 0) if unsigned else (15, 1)
            ds.RescaleSlope, ds.RescaleIntercept = it["slope"], it["intercept"]
            if frames:   # an enhanced multi-frame: each frame's position in its functional group
                ds.NumberOfFrames = frames
                per = []
                for zz in frames_z:
                    g, pp = pydicom.Dataset(), pydicom.Dataset()
                    pp.ImagePositionPatient = [0.0, 0.0, float(zz)]
                    g.PlanePositionSequence = pydicom.Sequence([pp])
                    per.append(g)
                ds.PerFrameFunctionalGroupsSequence = pydicom.Sequence(per)
            ds.PixelData = pix.astype("<u2" if unsigned else "<i2").tobytes()
            return ds
        uid = "1.2.826.0.1.9" if not it["second"] else "1.2.826.0.1.9"
        if it["single"]:
            pix = np.stack([s[1] for s in slices][::-1])
            ds = make(pix, 0.0, 1, uid, slices[0][2], frames=len(slices))
            path = os.path.join(root, f"{it['name']}.dcm")
            if it["nometa"]:   # no preamble or file meta: needs force
                del ds.file_meta
                pydicom.dcmwrite(path, ds, enforce_file_format=False, implicit_vr=False, little_endian=True)
            else:
                ds.save_as(path, enforce_file_format=True)
            truth[f"{it['name']}.dcm"] = {"it": it, "zs": zs, "slices": slices}
            continue
        folder = os.path.join(root, it["name"])
        os.makedirs(folder, exist_ok=True)
        names = [f"f{int(x)}" for x in rng.permutation(len(slices) + 10)[:len(slices)]]
        for k, (z, raw, uns) in enumerate(slices):
            ds = make(raw, z, k + 1, uid, uns)
            sub = os.path.join(folder, "sub") if it["sub"] and k % 2 else folder
            os.makedirs(sub, exist_ok=True)
            p = os.path.join(sub, names[k])
            if it["nometa"] and k == 0:
                del ds.file_meta
                pydicom.dcmwrite(p, ds, enforce_file_format=False, implicit_vr=False, little_endian=True)
            else:
                ds.save_as(p, enforce_file_format=True)
        if it["second"]:   # a smaller second series in the same folder
            for k in range(2):
                ds = make(slices[0][1], 100.0 + k, 50 + k, "1.2.826.0.1.77", slices[0][2])
                ds.save_as(os.path.join(folder, f"zz{k}"), enforce_file_format=True)
        truth[it["name"]] = {"it": it, "zs": zs, "slices": slices}
    return truth


def input_keys(case: dict, truth: dict) -> list[str]:
    return list(truth)


_RANGES = {"uint8": (0, 255), "int16": (-32768, 32767)}
_FILLS = {"crop_pad_volume": "pad_value", "patches3d": "pad_value", "apply_mask": "fill"}


def refused_fill(case: dict) -> Optional[str]:
    """docs/reference-steps.md: a pad_value or fill outside the volume's dtype range (a uint8 volume after
    ``hu_window dtype: uint8``) is a plan-time error naming the step, the option, the value, the field and the
    range; the message the build must give, or None."""
    dtype = case["recipe"]["inputs"]["fields"]["volume"].get("dtype", "float32")
    for i, st in enumerate(case["recipe"].get("steps", [])):
        (name, p), = st.items()
        p = p or {}
        if name == "hu_window":
            dtype = p.get("dtype", "float32")
        elif name == "standardise":
            dtype = "float32"
        opt = _FILLS.get(name)
        if opt is None or dtype not in _RANGES or (name == "patches3d" and p.get("pad", True) is False):
            continue
        v, (lo, hi) = p.get(opt, 0), _RANGES[dtype]
        if not lo <= v <= hi:
            return (f"steps[{i}].{name}: {opt} {v:g} is outside the range of field 'volume': its dtype {dtype} "
                    f"holds {lo} to {hi}; give a value in that range")
    return None


def expected_error(case: dict, e: Any, truth: dict) -> Optional[str]:
    """The plan-time refusal of :func:`refused_fill` (the build must fail with its message, and only then)."""
    want = refused_fill(case)
    if e is None:
        return None if want is None else f"the docs refuse it at plan time: {want}"
    return "a pad_value or fill outside the volume's dtype refused" if want and want in str(e) else None


def dropped_keys(case: dict, truth: dict) -> set:
    """patches3d with pad: false drops a volume smaller than a patch; with mask + min_fraction, every patch may go."""
    return set(truth) if any("patches3d" in s for s in case["recipe"].get("steps", [])) else set()


# -- reference ------------------------------------------------------------------------------------------------------
def nifti_reference(case: dict, info: dict, field: str = "volume", vol_index: Optional[int] = None) -> np.ndarray:
    """nibabel's reading: the scaled data (raw with rescale: false), the 4D index, the orientation, then
    (i, j, k) -> (W, H, D)."""
    import nibabel as nib
    from nibabel import orientations as O

    dec = case["recipe"]["inputs"]["fields"][field]
    path = info["path"] if field == "volume" else info["path"].replace("/vol/", "/seg/").replace(".nii.gz", ".nii").replace(".nii", ".nii.gz")
    img = nib.load(path)
    if field == "volume" and dec.get("rescale", True):
        a = np.asarray(img.get_fdata(dtype=np.float64))
    else:
        a = np.asarray(img.dataobj.get_unscaled() if hasattr(img.dataobj, "get_unscaled") else img.dataobj).astype(np.float64)
    if a.ndim == 4:
        idx = dec.get("index")
        a = a[..., vol_index if idx == "all" else idx]
    orient = dec.get("orient", "native")
    if orient != "native":
        target = ("L", "P", "S") if orient == "LPS" else ("R", "A", "S")
        t = O.ornt_transform(O.io_orientation(img.affine), O.axcodes2ornt(target))
        a = O.apply_orientation(a, t)
    a = a.transpose(2, 1, 0)
    if field == "volume" and dec.get("dtype") == "int16":
        a = np.rint(a)
    return a


def dicom_reference(case: dict, info: dict) -> Optional[np.ndarray]:
    """The slices sorted by position along the normal, HU by slope/intercept; None where the docs' geometry is
    a resampling this reference does not redo (tilt correction, uneven gaps)."""
    dec = case["recipe"]["inputs"]["fields"]["volume"]
    it = info["it"]
    if it["tilt"] and dec.get("tilt", "correct") == "correct":
        return None
    order = sorted(range(len(info["slices"])), key=lambda k: info["slices"][k][0])
    raw = np.stack([info["slices"][k][1] for k in order]).astype(np.float64)
    if it["mono1"] and dec.get("monochrome1", "flag") == "invert":
        raw = (2 ** 12 - 1) - raw
    v = raw * it["slope"] + it["intercept"] if dec.get("rescale", True) else raw
    zs = [info["slices"][k][0] * np.cos(np.radians(it["tilt"])) for k in order]   # positions along the normal
    gaps = np.diff(zs)
    uneven = len(gaps) and (np.abs(gaps - np.median(gaps)) > 1e-3).any()
    if (uneven or dec.get("slice_spacing")) and dec.get("uneven", "resample") == "resample":
        sp = dec.get("slice_spacing") or float(np.median(gaps))
        n = int(np.floor((zs[-1] - zs[0]) / sp + 1e-6)) + 1
        zq = zs[0] + sp * np.arange(n)
        v = np.stack([np.stack([np.interp(zq, zs, v[:, r, c]) for c in range(v.shape[2])], -1) for r in range(v.shape[1])], 1)
    if dec.get("dtype") == "int16":
        v = np.clip(np.rint(v), -32768, 32767)
    return v


class Ref:
    """The reference volume (None once an inexact step ran), its label volume, and the tolerance."""

    def __init__(self, vol: Optional[np.ndarray], mask: Optional[np.ndarray], tol: float):
        self.vol, self.mask, self.tol = vol, mask, tol
        self.exact_geometry = True
        self.intensity_changed = False
        # voxels that hold data (not padding), moved by the exact steps; None once padding went through a resample
        self.valid: Optional[np.ndarray] = np.ones(vol.shape, bool) if vol is not None else None


def _apply_steps(case: dict, ref: Ref, meta: dict, R: Report, key: str, patch: Optional[dict]) -> Ref:
    recs = list(meta.get("augment", []))
    for st in case["recipe"].get("steps", []):
        (name, p), = st.items()
        p = p or {}
        rec = None
        if name in ("random_flip3d", "random_rot90", "elastic", "gaussian_noise"):
            rec = next((x for x in recs if x.get("step") == name), None)
            if rec is not None:
                recs.remove(rec)
        arrays = [a for a in (ref.vol, ref.mask) if a is not None]
        if name == "crop_pad_volume":
            ref.vol = _crop_pad(ref.vol, p["shape"], p.get("pad_value", 0))
            ref.mask = _crop_pad(ref.mask, p["shape"], 0)
            ref.valid = _crop_pad(ref.valid, p["shape"], 0) > 0 if ref.valid is not None else None
        elif name == "random_flip3d" and rec is not None:
            ax = tuple(rec.get("axes", []))
            ref.vol, ref.mask, ref.valid = (_moved(a, lambda x: np.flip(x, ax) if ax else x)
                                            for a in (ref.vol, ref.mask, ref.valid))
        elif name == "random_rot90" and rec is not None:
            ref.vol, ref.mask, ref.valid = (_moved(a, lambda x: np.rot90(x, rec["k"], axes=tuple(rec["plane"])))
                                            for a in (ref.vol, ref.mask, ref.valid))
        elif name == "patches3d":
            if patch is None:
                R.check("patches", False, "a patch without meta['patch']", key)
                return ref
            c, size = patch["corner"], patch["size"]
            ref.vol = _take(ref.vol, c, size, p.get("pad_value", 0))
            ref.mask = _take(ref.mask, c, size, 0)
            ref.valid = _take(ref.valid, c, size, 0) > 0 if ref.valid is not None else None
        elif name in ("resample_volume", "elastic"):
            if name == "elastic" and rec is not None and float(rec.get("magnitude", 1)) == 0:
                continue
            shape = p.get("shape") or (meta.get("volume") or {}).get("shape")
            ref.exact_geometry = False
            shape_out = tuple(p["shape"]) if name == "resample_volume" and "shape" in p else \
                (ref.vol.shape if ref.vol is not None else None)
            ref.valid = np.ones(shape_out, bool) if ref.valid is not None and shape_out and ref.valid.all() else None
            ref.vol = _ShapeOnly(tuple(p["shape"])) if name == "resample_volume" and "shape" in p else (
                _ShapeOnly(ref.vol.shape) if ref.vol is not None else None)
            ref.mask = _ShapeOnly(ref.vol.shape) if ref.mask is not None and ref.vol is not None else None
        elif name == "hu_window":
            lo, hi = (p["window"] if "window" in p else (p["level"] - p["width"] / 2, p["level"] + p["width"] / 2))
            if isinstance(ref.vol, np.ndarray):
                x = (np.clip(ref.vol, lo, hi) - lo) / (hi - lo)
                # uint8: the stored value is the rounding of x * 255; against the unrounded reference that is
                # within half a level plus the reference's own slack (seed 114514: against a rounded reference a
                # value 0.02 across a half level counted as a whole level off)
                ref.vol = x * 255 if p.get("dtype") == "uint8" else x
                ref.tol = ref.tol / (hi - lo) * (255 if p.get("dtype") == "uint8" else 1) + (0.51 if p.get("dtype") == "uint8" else 1e-6)
            ref.intensity_changed = True
        elif name == "standardise":
            if isinstance(ref.vol, np.ndarray):
                if p.get("per_sample"):
                    sel = ref.vol if not p.get("mask") or not isinstance(ref.mask, np.ndarray) else ref.vol[ref.mask > 0]
                    if sel.size == 0:
                        ref.vol = None
                        continue
                    m, s = float(sel.mean()), float(sel.std())
                    if s == 0:
                        ref.vol = None
                        continue
                else:
                    m, s = p["mean"], p["std"]
                ref.vol = (ref.vol - m) / s
                ref.tol = ref.tol / s + 1e-4 * max(1.0, float(np.abs(ref.vol).max(initial=0)))
            ref.intensity_changed = True
        elif name == "apply_mask":
            if p.get("mask", "lung_mask") == "lungs":
                ref.vol = _ShapeOnly(ref.vol.shape) if ref.vol is not None else None
            elif isinstance(ref.vol, np.ndarray) and isinstance(ref.mask, np.ndarray):
                ref.vol = np.where(ref.mask == 0, p.get("fill", 0), ref.vol)
            else:
                ref.vol = _ShapeOnly(ref.vol.shape) if ref.vol is not None else None
            ref.intensity_changed = True
        elif name == "gaussian_noise":
            ref.tol += 6 * float((rec or {}).get("std", 5.0))
            ref.intensity_changed = True
    return ref


def _moved(a: Any, fn: Any) -> Any:
    if a is None:
        return None
    if isinstance(a, _ShapeOnly):
        return _ShapeOnly(fn(np.zeros(a.shape, np.uint8)).shape)
    return fn(a)


class _ShapeOnly:
    """A reference that knows only the shape (after an inexact step)."""

    def __init__(self, shape: tuple):
        self.shape = tuple(shape)

    ndim = 3


def _crop_pad(a: Any, shape: list[int], value: float) -> Any:
    if a is None:
        return None
    if isinstance(a, _ShapeOnly):
        return _ShapeOnly(tuple(shape))
    out = np.full(tuple(shape), value, dtype=np.float64)
    src, dst = [], []
    for n, s in zip(a.shape, shape):
        if n >= s:
            o = (n - s) // 2
            src.append(slice(o, o + s))
            dst.append(slice(0, s))
        else:
            o = (s - n) // 2
            src.append(slice(0, n))
            dst.append(slice(o, o + n))
    out[tuple(dst)] = a[tuple(src)]
    return out


def _take(a: Any, corner: list[int], size: list[int], value: float) -> Any:
    if a is None:
        return None
    if isinstance(a, _ShapeOnly):
        return _ShapeOnly(tuple(size))
    out = np.full(tuple(size), value, dtype=np.float64)
    src, dst = [], []
    for c, s, n in zip(corner, size, a.shape):
        lo, hi = max(c, 0), min(c + s, n)
        src.append(slice(lo, hi))
        dst.append(slice(lo - c, hi - c))
    if all(sl.stop > sl.start for sl in src):
        out[tuple(dst)] = a[tuple(src)]
    return out


# -- oracles --------------------------------------------------------------------------------------------------------
def check_sample(case: dict, truth: dict, key: str, s: dict, meta: dict, R: Report, copy: int) -> None:
    base = key.split("#")[0]
    info = truth.get(base)
    if not R.check("key", info is not None, f"stored key {key!r} is no input's", key):
        return
    dec = case["recipe"]["inputs"]["fields"]["volume"]
    vidx = None
    m = [p for p in key.split("#")[1:] if p.startswith("v")]
    if m:
        vidx = int(m[0][1:])
    if case["family"] == "volume":
        it = info["it"]
        if it["nvol"] and dec.get("index") is None:
            return
        vol = nifti_reference(case, info, "volume", vidx)
        tol = 0.51 if dec.get("dtype") == "int16" else (1e-3 if it["scl"] or it["dtype"] == "int16" else 1e-3)
        if it["dtype"] == "int16" and not dec.get("rescale", True) is False:
            tol = max(tol, 0.51 * (it["scl"][0] if it["scl"] else 1))
        mask = nifti_reference(case, info, "seg", vidx) if "seg" in case["recipe"]["inputs"]["fields"] else None
    else:
        vol = dicom_reference(case, info)
        tol = 0.51 if dec.get("dtype") == "int16" else 1e-3
        if dec.get("dtype") == "int16" and (info["it"]["uneven"] or dec.get("slice_spacing")):
            tol = 1.01   # an interpolated slice rounded to int16: a value near .5 may round either way
        mask = None
        if vol is not None and not case["recipe"].get("steps"):
            R.check("dicom_order", vol.shape == s["volume"].shape,
                    f"volume {s['volume'].shape}, the slices sorted by position give {vol.shape}", key)
    if vol is None:
        R.check("volume_shape", s["volume"].ndim == 3, f"volume of shape {s['volume'].shape}", key)
        return
    ref = _apply_steps(case, Ref(vol, mask, tol), meta, R, key, meta.get("patch"))
    got = np.asarray(s["volume"], np.float64)
    if ref.vol is not None:
        R.check("volume_shape", tuple(got.shape) == tuple(ref.vol.shape),
                f"volume {got.shape}, the documented steps give {tuple(ref.vol.shape)}", key)
        if isinstance(ref.vol, np.ndarray) and got.shape == ref.vol.shape:
            err = float(np.abs(got - ref.vol).max(initial=0))
            R.check("volume_truth", err <= ref.tol, lambda: f"voxels off by {err:.4g} (tolerance {ref.tol:.3g}); "
                    f"each holds a linear function of its place", key)
    if "seg" in s and mask is not None:
        seg = np.asarray(s["seg"])
        vals = set(np.unique(seg).tolist())
        R.check("mask_values", vals <= LABELS, f"label values {sorted(vals - LABELS)} were never written", key)
        if isinstance(ref.mask, np.ndarray) and seg.shape == ref.mask.shape:
            R.check("mask_truth", np.array_equal(seg, ref.mask), f"{int((seg != ref.mask).sum())} label voxels "
                    f"differ from nibabel's labels moved by the documented steps", key)
        elif not ref.intensity_changed and got.shape == seg.shape and case["family"] == "volume":
            it = info["it"]
            t1, t2 = _thresholds(it)
            add = 100.0 * (vidx or (dec.get("index") if isinstance(dec.get("index"), int) else 0) or 0)
            want = label_of_volume(got - add, t1, t2) if dec.get("rescale", True) else None
            # a statistic: judged on 27 voxels or more (in a patch of 12, one boundary plane is a quarter of it:
            # seed 110182, 3x2x2 patches at 75% where the whole volume and 3x3x3 patches of it pass)
            if want is not None and ref.valid is not None and ref.valid.shape == seg.shape and ref.valid.sum() >= 27:
                agree = float((want == seg)[ref.valid].mean())
                # each interpolating step moves labels (nearest) and intensities (linear or cubic) apart at the
                # label boundaries, which are most voxels of a small volume: 0.8 for one, 0.7 for more
                interp = sum(n in ("elastic", "resample_volume") for st in case["recipe"].get("steps", []) for n in st)
                floor = 0.8 if interp <= 1 else 0.7
                R.check("mask_truth", agree >= floor, f"labels agree with the intensities they were cut from at "
                        f"{agree:.0%} of voxels (at least {floor:.0%} expected)", key)
    if "lungs" in s:
        R.check("lung_mask", s["lungs"].shape == got.shape and set(np.unique(s["lungs"]).tolist()) <= {0, 1},
                f"lung mask {s['lungs'].shape} with values {np.unique(s['lungs'])[:5]}", key)
    if "corner" in s:
        R.check("patches", s["corner"].tolist() == meta.get("patch", {}).get("corner"),
                f"corner field {s['corner'].tolist()} != meta {meta.get('patch')}", key)
