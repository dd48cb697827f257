"""NIfTI (.nii/.nii.gz, written here with nibabel at known affines): the same scan as a DICOM series
comes out alike (array, spacing, orientation, origin); non-canonical storage reoriented to LPS/RAS by
flips and permutations only; label volumes as exact integers of kind volume_mask; clear errors."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

nib = pytest.importorskip("nibabel", reason="nibabel is not installed (extra 'nifti')")

import precompile  # noqa: E402
from conftest import write_recipe  # noqa: E402
from precompile.decoders.dicom import DicomSeriesDecoder  # noqa: E402
from precompile.decoders.nifti import NiftiDecoder, NiftiLabelsDecoder  # noqa: E402
from precompile.errors import BuildError, DecodeError  # noqa: E402
from test_dicom import make_ds  # noqa: E402


D, H, W = 6, 5, 4
ROW_SP, COL_SP, SLICE_SP = 0.5, 0.75, 2.5          # DICOM PixelSpacing [row, col], slice gap (mm)
ORIGIN_LPS = np.array([-12.0, 30.5, -40.0])         # first voxel, patient coordinates (LPS)
FLIP = np.diag([-1.0, -1.0, 1.0, 1.0])              # LPS <-> RAS


def volume() -> np.ndarray:
    """A (D, H, W) volume whose every voxel is distinct, so any flip or transpose shows."""
    return (np.arange(D * H * W, dtype=np.int16).reshape(D, H, W) * 7 - 300)


def labels() -> np.ndarray:
    lab = np.zeros((D, H, W), np.uint8)
    lab[1:4, 1:3, 0:2] = 1
    lab[2:6, 3:5, 2:4] = 2
    lab[5, 0, 3] = 7
    return lab


def axial_affine() -> np.ndarray:
    """RAS affine of the (i, j, k) = (W, H, D) array of an axial series (IOP 1,0,0,0,1,0)."""
    lps = np.eye(4)
    lps[:3, 0] = [COL_SP, 0, 0]      # i (columns) runs along the DICOM row direction (+x, to the Left)
    lps[:3, 1] = [0, ROW_SP, 0]      # j (rows) along the column direction (+y, Posterior)
    lps[:3, 2] = [0, 0, SLICE_SP]    # k (slices) along the normal (+z, Superior)
    lps[:3, 3] = ORIGIN_LPS
    return FLIP @ lps


def save(path, arr_dhw: np.ndarray, affine: np.ndarray, order=(0, 1, 2), flips=(), dtype=None, scale=None):
    """Store a (D, H, W) volume as NIfTI (i, j, k) = (W, H, D), optionally flipped/permuted (affine adjusted)."""
    arr = np.transpose(arr_dhw, (2, 1, 0))
    aff = affine.copy()
    for ax in flips:   # flip stored axis ax: voxel 0 becomes the old last voxel
        n = arr.shape[ax]
        arr = np.flip(arr, ax)
        shift = np.eye(4)
        shift[ax, ax] = -1
        shift[ax, 3] = n - 1
        aff = aff @ shift
    if tuple(order) != (0, 1, 2):  # new axis a is old axis order[a]
        arr = np.transpose(arr, order)
        perm = np.zeros((4, 4))
        perm[3, 3] = 1
        for a, old in enumerate(order):
            perm[old, a] = 1
        aff = aff @ perm
    img = nib.Nifti1Image(np.ascontiguousarray(arr if dtype is None else arr.astype(dtype)), aff)
    img.set_qform(aff, code=1)
    img.set_sform(aff, code=1)
    if scale is not None:
        img.header.set_slope_inter(*scale)
    nib.save(img, str(path))
    return path


def dicom_series(folder, vol: np.ndarray) -> str:
    os.makedirs(folder, exist_ok=True)
    order = [3, 0, 5, 1, 4, 2]  # files named out of order
    for n, k in enumerate(order):
        ds = make_ds(vol[k] + 1024, pos=tuple(ORIGIN_LPS + [0, 0, k * SLICE_SP]), inst=k + 1)
        ds.PixelSpacing = [ROW_SP, COL_SP]
        ds.save_as(os.path.join(folder, f"f{n}"), enforce_file_format=True)
    return str(folder)


GEOM = ("spacing", "spacing_rcs", "orientation", "origin", "shape")


def test_same_scan_as_dicom_series_decodes_alike(tmp_path):
    vol = volume()
    dvol, dmeta = DicomSeriesDecoder().read(dicom_series(tmp_path / "series", vol))
    np.testing.assert_array_equal(dvol, vol.astype(np.float32))
    for ext in (".nii", ".nii.gz"):
        p = save(tmp_path / f"ct{ext}", vol, axial_affine(), dtype=np.int16)
        nvol, nmeta = NiftiDecoder().read(str(p))
        assert nvol.dtype == np.float32 and nvol.shape == (D, H, W)
        np.testing.assert_array_equal(nvol, dvol)
        assert {k: nmeta[k] for k in GEOM} == {k: dmeta[k] for k in GEOM}, (nmeta, dmeta)
        assert nmeta["axis_directions"] == ["S", "P", "L"] and nmeta["stored_axcodes"] == "LPS"
        # LPS reorientation of an already-LPS volume changes nothing
        lvol, lmeta = NiftiDecoder(NiftiDecoder.Params(orient="LPS")).read(str(p))
        np.testing.assert_array_equal(lvol, dvol)
        assert {k: lmeta[k] for k in GEOM} == {k: dmeta[k] for k in GEOM}
    assert (tmp_path / "ct.nii.gz").read_bytes()[:2] == b"\x1f\x8b"  # really gzip


@pytest.mark.parametrize("order,flips", [((0, 1, 2), (0, 1)),       # RAS-canonical storage (nibabel's default)
                                         ((2, 0, 1), ()),           # slices stored first (sagittal-like order)
                                         ((1, 2, 0), (1,))])        # permuted and flipped
def test_non_canonical_storage_reoriented_to_lps_matches_dicom(tmp_path, order, flips):
    vol = volume()
    dvol, dmeta = DicomSeriesDecoder().read(dicom_series(tmp_path / "series", vol))
    p = save(tmp_path / "ct.nii.gz", vol, axial_affine(), order=order, flips=flips, dtype=np.int16)
    native, nmeta = NiftiDecoder().read(str(p))
    assert not np.array_equal(native, dvol) and nmeta["stored_axcodes"] != "LPS"
    # native order: still the same voxels at the same patient positions (the geometry says where)
    assert sorted(native.ravel().tolist()) == sorted(dvol.ravel().tolist())
    lvol, lmeta = NiftiDecoder(NiftiDecoder.Params(orient="LPS")).read(str(p))
    np.testing.assert_array_equal(lvol, dvol)
    assert {k: lmeta[k] for k in GEOM} == {k: dmeta[k] for k in GEOM}
    # RAS: W to the Right, H Anterior, D Superior: the LPS volume with rows and columns reversed
    rvol, rmeta = NiftiDecoder(NiftiDecoder.Params(orient="RAS", dtype="int16")).read(str(p))
    assert rvol.dtype == np.int16
    np.testing.assert_array_equal(rvol, vol[:, ::-1, ::-1])
    assert rmeta["axis_directions"] == ["S", "A", "R"]
    assert rmeta["orientation"] == [[-1, 0, 0], [0, -1, 0], [0, 0, 1]]
    far = ORIGIN_LPS + [(W - 1) * COL_SP, (H - 1) * ROW_SP, 0]  # the first RAS voxel is the last LPS column/row
    assert rmeta["origin"] == [round(float(x), 5) for x in far]
    assert rmeta["spacing"] == [SLICE_SP, ROW_SP, COL_SP]


def test_scaling_is_applied_to_images_not_to_labels(tmp_path):
    vol = volume()
    p = save(tmp_path / "scaled.nii", vol, axial_affine(), dtype=np.int16, scale=(2.0, -5.0))
    np.testing.assert_array_equal(NiftiDecoder().read(str(p))[0], vol.astype(np.float32) * 2 - 5)
    np.testing.assert_array_equal(NiftiDecoder(NiftiDecoder.Params(rescale=False)).read(str(p))[0], vol)
    with pytest.raises(DecodeError, match="a label volume must not be scaled"):
        NiftiLabelsDecoder().read(str(p))


def test_label_volume_exact_integers_reoriented_without_interpolation(tmp_path):
    lab = labels()
    for dt in (np.int16, np.float32, np.uint8):
        p = save(tmp_path / f"seg_{np.dtype(dt).name}.nii.gz", lab, axial_affine(), order=(2, 0, 1), flips=(0,),
                 dtype=dt)
        out, meta = NiftiLabelsDecoder(NiftiLabelsDecoder.Params(orient="LPS")).read(str(p))
        assert out.dtype == np.uint8
        np.testing.assert_array_equal(out, lab)
        assert meta["labels"] == [0, 1, 2, 7] and meta["axis_directions"] == ["S", "P", "L"]
    assert NiftiLabelsDecoder().spec().kind == "volume_mask"
    bad = lab.astype(np.float32)
    bad[0, 0, 0] = 1.5
    with pytest.raises(DecodeError, match="non-integer values"):
        NiftiLabelsDecoder().read(str(save(tmp_path / "frac.nii", bad, axial_affine())))
    big = lab.astype(np.int16)
    big[0, 0, 0] = 300
    p = save(tmp_path / "big.nii", big, axial_affine())
    with pytest.raises(DecodeError, match=r"labels span 0..300, outside uint8's range 0..255; set dtype"):
        NiftiLabelsDecoder().read(str(p))
    out, _ = NiftiLabelsDecoder(NiftiLabelsDecoder.Params(dtype="uint16")).read(str(p))
    assert out.dtype == np.uint16 and out[0, 0, 0] == 300


def test_4d_and_bad_files(tmp_path):
    vol = volume()
    four = np.stack([np.transpose(vol, (2, 1, 0)), np.transpose(vol, (2, 1, 0)) + 1], axis=-1)
    p = tmp_path / "4d.nii"
    nib.save(nib.Nifti1Image(four, axial_affine()), str(p))
    with pytest.raises(DecodeError, match=r"is 4D \(4, 5, 6, 2\); set index"):
        NiftiDecoder().read(str(p))
    np.testing.assert_array_equal(NiftiDecoder(NiftiDecoder.Params(index=1)).read(str(p))[0], vol + 1)
    with pytest.raises(DecodeError, match="index 2 is out of range"):
        NiftiDecoder(NiftiDecoder.Params(index=2)).read(str(p))
    noise = np.random.default_rng(0).integers(-1000, 1000, (40, 40, 40)).astype(np.int16)
    full = save(tmp_path / "ok.nii.gz", noise, axial_affine(), dtype=np.int16).read_bytes()
    (tmp_path / "trunc.nii.gz").write_bytes(full[: len(full) * 3 // 4])
    with pytest.raises(DecodeError, match="truncated"):
        NiftiDecoder().read(str(tmp_path / "trunc.nii.gz"))
    (tmp_path / "junk.nii").write_bytes(b"not a nifti header at all" * 20)
    with pytest.raises(DecodeError, match="not a readable NIfTI file"):
        NiftiDecoder().read(str(tmp_path / "junk.nii"))
    (tmp_path / "junk.nii.gz").write_bytes(gzip.compress(b"\0" * 100))
    with pytest.raises(DecodeError, match="not a readable NIfTI file"):
        NiftiDecoder().read(str(tmp_path / "junk.nii.gz"))


def test_build_image_and_label_volumes(tmp_path):
    vol, lab = volume(), labels()
    for case, off in (("c1", 0), ("c2", 100)):
        (tmp_path / "data" / case).mkdir(parents=True)
        save(tmp_path / "data" / case / "ct.nii.gz", vol + off, axial_affine(), flips=(0, 1), dtype=np.int16)
        save(tmp_path / "data" / case / "seg.nii.gz", lab, axial_affine(), flips=(0, 1), dtype=np.uint8)
    (tmp_path / "data" / "c3").mkdir()
    (tmp_path / "data" / "c3" / "ct.nii.gz").write_bytes(b"\x1f\x8b broken")
    save(tmp_path / "data" / "c3" / "seg.nii.gz", lab, axial_affine(), dtype=np.uint8)
    recipe = {"name": "nii", "inputs": {"root": str(tmp_path / "data"), "match": "{case}/ct.nii.gz",
                                         "fields": {"ct": {"decoder": "nifti", "orient": "LPS"},
                                                    "seg": {"decoder": "nifti_labels", "orient": "LPS",
                                                            "path": "{case}/seg.nii.gz"}}},
              "steps": [{"crop_pad_volume": {"shape": [4, 4, 4]}}], "output": {"samples_per_shard": 2}}
    rf = write_recipe(tmp_path / "r.yaml", recipe)
    with pytest.raises(BuildError, match=r"c3/ct.nii.gz, stage decode, field 'ct': not a readable NIfTI file"):
        precompile.build(rf, out_dir=tmp_path / "out")
    rep = precompile.build(rf, out_dir=tmp_path / "out", on_error="skip")
    assert rep["num_samples"] == 2 and rep["skipped_inputs"] == 1
    ds = precompile.open(tmp_path / "out" / "nii.h5")
    import h5py
    import json

    with h5py.File(tmp_path / "out" / "nii.h5") as f:
        fields = json.loads(f.attrs["fields"])
    assert fields["seg"] == {"kind": "volume_mask", "shape": [4, 4, 4], "dtype": "uint8"}
    assert fields["ct"]["kind"] == "volume"
    for i, off in ((0, 0), (1, 100)):
        s = ds[i]
        np.testing.assert_array_equal(s["ct"], (vol + off)[1:5, 0:4, 0:4].astype(np.float32))
        assert s["seg"].dtype == np.uint8
        np.testing.assert_array_equal(s["seg"], lab[1:5, 0:4, 0:4])
        assert ds.meta(i)["seg"]["spacing"] == [SLICE_SP, ROW_SP, COL_SP]


def _four(vols: list[np.ndarray]) -> np.ndarray:
    """(D, H, W) volumes as one stored 4D (i, j, k, t) array."""
    return np.stack([np.transpose(v, (2, 1, 0)) for v in vols], axis=-1)


def test_index_all_splits_4d_files_into_one_sample_per_volume(tmp_path):
    """A folder mixing 3D and 4D files builds with one recipe: each 4D file gives <key>#v<n> per volume."""
    from precompile.compiler.plan import make_plan
    from precompile.errors import PlanError
    from precompile.recipe import load_recipe

    vol = volume()
    root = tmp_path / "in"
    root.mkdir()
    save(root / "a.nii.gz", vol, axial_affine(), dtype=np.int16)                       # 3D
    nib.save(nib.Nifti1Image(_four([vol + 1, vol + 2, vol + 3]), axial_affine()), str(root / "b.nii"))
    nib.save(nib.Nifti1Image(_four([vol * 2]), axial_affine()), str(root / "c.nii"))   # 4D of one volume
    recipe = {"name": "v", "inputs": {"root": str(root), "match": "{name}.{ext}", "where": {"ext": "nii|nii.gz"},
                                      "fields": {"ct": {"decoder": "nifti", "index": "all"}}},
              "output": {"samples_per_shard": 2}}
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", recipe), out_dir=tmp_path / "out")
    assert rep["num_samples"] == 5
    ds = precompile.open(str(tmp_path / "out" / "v.h5"))
    keys = [ds.key(i) for i in range(len(ds))]
    assert keys == ["a.nii.gz", "b.nii#v0", "b.nii#v1", "b.nii#v2", "c.nii"]
    plan = make_plan(load_recipe(str(tmp_path / "r.yaml")))   # each volume's path is its file's (no #v<n>)
    assert [it.paths["ct"] for it in plan.items] == [str(root / n) for n in ["a.nii.gz"] + ["b.nii"] * 3 + ["c.nii"]]
    want = [vol, vol + 1, vol + 2, vol + 3, vol * 2]
    for i, w in enumerate(want):
        np.testing.assert_array_equal(ds[i]["ct"], w.astype(np.float32))
        assert ds.meta(i)["ct"]["spacing"] == [SLICE_SP, ROW_SP, COL_SP]
    # an image and its labels both 4D: their volumes pair up; different counts are a plan error
    nib.save(nib.Nifti1Image(_four([labels(), labels() * 0, labels()]), axial_affine()), str(root / "b.lab.nii"))
    lab_recipe = {"name": "l", "inputs": {"root": str(root), "match": "b.nii",
                                          "fields": {"ct": {"decoder": "nifti", "index": "all"},
                                                     "seg": {"decoder": "nifti_labels", "path": "b.lab.nii",
                                                             "index": "all"}}}}
    rep = precompile.build(write_recipe(tmp_path / "l.yaml", lab_recipe), out_dir=tmp_path / "out")
    ds = precompile.open(str(tmp_path / "out" / "l.h5"))
    assert len(ds) == 3 and int(ds[1]["seg"].max()) == 0 and int(ds[2]["seg"].max()) == 7
    np.testing.assert_array_equal(ds[2]["ct"], (vol + 3).astype(np.float32))
    nib.save(nib.Nifti1Image(_four([labels(), labels()]), axial_affine()), str(root / "b.lab.nii"))
    with pytest.raises(PlanError, match=r"b.nii: fields split into different numbers of samples"):
        make_plan(precompile.load_recipe(write_recipe(tmp_path / "l.yaml", lab_recipe)))
    # index: all on a 4D file read by the decoder alone (no plan to split it) is a clear error
    with pytest.raises(DecodeError, match="index: all makes one sample per volume in a recipe's plan"):
        NiftiDecoder(NiftiDecoder.Params(index="all")).read(str(root / "b.nii"))
    np.testing.assert_array_equal(NiftiDecoder(NiftiDecoder.Params(index="all")).read(str(root / "c.nii"))[0],
                                  (vol * 2).astype(np.float32))


def test_index_all_volumes_of_one_file_share_a_split(tmp_path):
    vol = volume()
    root = tmp_path / "in"
    root.mkdir()
    for n in range(6):
        nib.save(nib.Nifti1Image(_four([vol + n, vol - n, vol]), axial_affine()), str(root / f"s{n}.nii"))
    recipe = {"name": "v", "seed": 1, "inputs": {"root": str(root), "match": "{name}.nii",
                                                 "fields": {"ct": {"decoder": "nifti", "index": "all"}}},
              "split": {"fractions": {"train": 0.5, "val": 0.5}}}
    from precompile.compiler.plan import make_plan

    plan = make_plan(precompile.load_recipe(write_recipe(tmp_path / "r.yaml", recipe)))
    assert len(plan.items) == 18
    by_file: dict[str, set] = {}
    for it in plan.items:
        by_file.setdefault(it.key.split("#")[0], set()).add(it.split)
    assert all(len(v) == 1 for v in by_file.values()) and len({s for v in by_file.values() for s in v}) == 2


def test_hostile_headers_and_voxels_are_refused_not_decoded(tmp_path):
    """Headers and voxels nibabel reads but no scalar volume has: they decoded as plausible volumes, wrong. A complex
    volume lost its imaginary part, float64 voxels past float32's range became inf, NaN voxels stored as int16 took whatever the cast gave, and
    a volume with no voxels crashed resample_volume (ZeroDivisionError). Each is a DecodeError naming what is wrong;
    a NaN or infinite slope still means "no scaling" (nibabel's rule, the standard's for 0) and NaN voxels stay NaN
    in float32."""
    v = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6) - 60

    def write(name, arr, **header):
        img = nib.Nifti1Image(arr, np.eye(4))
        for k, x in header.items():
            img.header[k] = x
        nib.save(img, str(tmp_path / name))
        return str(tmp_path / name)

    cases = [
        (write("c.nii", np.ones((4, 4, 4), np.complex64)), {}, r"stores complex voxels \(complex64\), not one intensity"),
        (write("big.nii", np.full((4, 4, 4), 1e300)), {}, r"64 voxel\(s\) \(e.g. 1e\+300\) are beyond float32's range"),
        (write("nan.nii", np.where(v > 50, np.nan, v).astype(np.float32)), {"dtype": "int16"},
         r"9 voxel\(s\) are NaN or infinite, which int16 cannot store; use dtype: float32"),
        (write("empty.nii", np.ones((4, 0, 4), np.int16)), {}, r"has no voxels \(4, 0, 4\)"),
    ]
    rgb = np.zeros((4, 4, 4), dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    cases.append((write("rgb.nii", rgb), {}, r"stores RGB\(A\) voxels"))
    for path, params, msg in cases:
        with pytest.raises(DecodeError, match=msg):
            NiftiDecoder(NiftiDecoder.Params(**params)).read(path)
    out, _ = NiftiDecoder().read(write("nanslope.nii", v, scl_slope=np.nan, scl_inter=np.nan))
    np.testing.assert_array_equal(out, np.transpose(v, (2, 1, 0)).astype(np.float32))   # NaN slope: unscaled
    out, _ = NiftiDecoder().read(write("infslope.nii", v, scl_slope=np.inf, scl_inter=0))
    np.testing.assert_array_equal(out, np.transpose(v, (2, 1, 0)).astype(np.float32))   # inf slope: unscaled
    out, _ = NiftiDecoder().read(write("nanvox.nii", np.where(v > 50, np.nan, v).astype(np.float32)))
    assert int(np.isnan(out).sum()) == 9
