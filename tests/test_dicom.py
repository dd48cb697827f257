"""DICOM: files and series (sorting, HU, spacing, uneven gaps, tilt, codecs, endianness,
multi-frame, missing meta) and the lung-CT steps."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pydicom
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydicom.dataset import FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRBigEndian, ExplicitVRLittleEndian, JPEGLSLossless

from precompile.decoders.dicom import DicomDecoder, DicomSeriesDecoder
from precompile.errors import DecodeError, MissingDependencyError, PrecompileError
from precompile.sample import Sample
from precompile.transforms.kernels import volume as F
from precompile.transforms.volume import ApplyMask, LungMask, Patches3d, ResampleVolume

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "sample_data", "dicom")


from conftest import realdata_root as realdata  # noqa: E402  (skips when ../shared/realdata is absent)


def series(**kw):
    return DicomSeriesDecoder(DicomSeriesDecoder.Params(**kw))


def make_ds(pixels: np.ndarray, ts=ExplicitVRLittleEndian, pos=(0.0, 0.0, 0.0), ori=(1, 0, 0, 0, 1, 0),
            slope=1.0, intercept=-1024.0, uid="1.2.3.4", inst=1) -> pydicom.Dataset:
    ds = pydicom.Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ts
    ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = f"{uid}.{inst}"
    ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, f"{uid}.{inst}"
    ds.SeriesInstanceUID, ds.InstanceNumber, ds.Modality = uid, inst, "CT"
    ds.ImagePositionPatient, ds.ImageOrientationPatient = list(pos), list(ori)
    ds.PixelSpacing = [0.5, 0.75]
    ds.Rows, ds.Columns = pixels.shape[-2:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated = ds.BitsStored = 16
    ds.HighBit, ds.PixelRepresentation = 15, 1
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    if pixels.ndim == 3:
        ds.NumberOfFrames = pixels.shape[0]
    order = ">i2" if ts == ExplicitVRBigEndian else "<i2"
    ds.PixelData = pixels.astype(order).tobytes()
    return ds


def test_sample_series_sorted_by_position_with_hu_and_spacing():
    vol, meta = series().read(os.path.join(SAMPLE, "chest_a"))
    assert vol.shape == (24, 64, 64) and vol.dtype == np.float32
    assert meta["spacing"] == [7.5, 5.0, 5.0] and meta["spacing_rcs"] == [5.0, 5.0, 7.5]
    assert meta["orientation"] == [[1, 0, 0], [0, 1, 0], [0, 0, 1]] and meta["origin"][2] == -200.0
    assert not meta["uneven_gaps"] and not meta["resampled"] and "tilt_deg" not in meta
    # file names are shuffled: check each slice against the file at that position
    files = sorted(os.listdir(os.path.join(SAMPLE, "chest_a")))
    assert not any("." in f for f in files)       # no extensions
    for f in files[:6]:
        ds = pydicom.dcmread(os.path.join(SAMPLE, "chest_a", f))
        k = int(round((float(ds.ImagePositionPatient[2]) + 200) / 7.5))
        np.testing.assert_array_equal(vol[k], ds.pixel_array.astype(np.float32) - 1024)
    mid = vol[12]
    assert abs(np.median(mid[28:36, 10:22]) + 800) < 20       # left lung ~ -800 HU
    assert abs(np.median(mid[32, 30:34]) - 50) < 30          # mediastinum
    i16, _ = series(dtype="int16").read(os.path.join(SAMPLE, "chest_a"))
    assert i16.dtype == np.int16 and np.array_equal(i16, np.rint(vol).astype(np.int16))


def test_uneven_gaps_resampled_to_uniform_spacing():
    a, _ = series().read(os.path.join(SAMPLE, "chest_a"))
    vol, meta = series().read(os.path.join(SAMPLE, "chest_b"))
    assert meta["uneven_gaps"] and meta["resampled"] and meta["gap_max"] == 15.0
    assert vol.shape == (24, 64, 64) and meta["spacing"][0] == 7.5
    # slices 9 and 15 were left out: the resampled ones are the mean of their neighbours
    b_raw, m2 = series(uneven="keep").read(os.path.join(SAMPLE, "chest_b"))
    assert b_raw.shape[0] == 22
    # chest_b has its own noise; compare structure: interpolated slice == mean of neighbours in chest_b
    np.testing.assert_allclose(vol[9], (vol[8] + vol[10]) / 2, atol=1e-3)
    np.testing.assert_array_equal(vol[8], b_raw[8])
    np.testing.assert_array_equal(vol[10], b_raw[9])
    with pytest.raises(DecodeError, match="uneven slice gaps"):
        series(uneven="error").read(os.path.join(SAMPLE, "chest_b"))
    v3, m3 = series(slice_spacing=2.5).read(os.path.join(SAMPLE, "chest_a"))
    assert v3.shape[0] == 70 and m3["spacing"][0] == 2.5


def test_tilted_series_is_sheared_back(tmp_path):
    """A rod along the slice normal drifts in-plane across slices of a tilted acquisition; after
    correction it sits at the same pixel in every slice."""
    tilt = np.radians(20)
    row = np.array([1.0, 0, 0])
    col = np.array([0, np.cos(tilt), -np.sin(tilt)])
    normal = np.cross(row, col)
    n = 40
    for i in range(6):
        z = 3.0 * i                                     # table moves along world z
        origin = np.array([0, 0, z])
        # the rod runs along `normal` through world point (10, 10, 0)
        rod = np.array([10.0, 10.0, 0.0])
        rel = rod + ((origin - rod) @ normal) * normal - origin
        r, c = rel @ col / 0.5, rel @ row / 0.75
        img = np.zeros((n, n), np.int16)
        yy, xx = np.mgrid[0:n, 0:n]
        img[(yy - r) ** 2 + ((xx - c) * 1.5) ** 2 <= 6] = 2000
        make_ds(img, pos=origin, ori=list(row) + list(col), inst=i + 1).save_as(
            str(tmp_path / f"s{5 - i}"), enforce_file_format=True)
    vol, meta = series().read(str(tmp_path))
    assert meta["tilt_deg"] == pytest.approx(20, abs=0.5) and meta["tilt_corrected"]
    assert meta["spacing"][0] == pytest.approx(3.0 * np.cos(tilt), abs=1e-3)
    cents = [np.argwhere(s > 500).mean(0) for s in vol]
    assert np.ptp([c[0] for c in cents]) < 0.6 and np.ptp([c[1] for c in cents]) < 0.6
    raw, m2 = series(tilt="keep").read(str(tmp_path))
    cents = [np.argwhere(s > 500).mean(0) for s in raw]
    assert np.ptp([c[0] for c in cents]) > 5 and not m2["tilt_corrected"]


def test_real_tilted_uneven_series(tmp_path):
    src = os.path.join(realdata(), "dicom", "series_ct_ge_tilted_head")
    if not os.path.isdir(src):
        pytest.skip("series_ct_ge_tilted_head absent")
    vol, meta = series().read(src)
    tilt = float(pydicom.dcmread(os.path.join(src, "10.dcm"), stop_before_pixels=True).GantryDetectorTilt)
    assert meta["tilt_deg"] == pytest.approx(tilt, abs=0.2)
    assert meta["uneven_gaps"] and meta["resampled"]
    assert meta["gap_min"] == pytest.approx(1.14 * np.cos(np.radians(tilt)), abs=0.02)
    assert vol.shape[1:] == (512, 512) and vol.dtype == np.float32
    assert meta["spacing"][0] == pytest.approx(4.22 * np.cos(np.radians(tilt)), abs=0.02)
    assert vol.shape[0] == int(np.floor((4 * 4.22 + 1.14 + 2 * 7.38) / 4.22 + 1e-3)) + 1
    assert -1100 < np.median(vol[:, 256, 256]) < 100       # inside the head: tissue, not padding
    # without extensions, in a scrambled order, the result is identical
    for i, f in enumerate(sorted(os.listdir(src))[::-1]):
        shutil.copy(os.path.join(src, f), tmp_path / f"x{i}")
    vol2, _ = series().read(str(tmp_path))
    np.testing.assert_array_equal(vol, vol2)


def test_big_endian_multiframe_and_single_file(tmp_path):
    px = np.arange(3 * 4 * 5, dtype=np.int16).reshape(3, 4, 5) * 37 - 900
    p = str(tmp_path / "be")
    make_ds(px[0], ts=ExplicitVRBigEndian).save_as(p, enforce_file_format=True)
    v, meta = DicomDecoder().read(p)
    assert v.dtype.isnative and v.shape == (1, 4, 5)
    np.testing.assert_array_equal(v[0], px[0].astype(np.float32) - 1024)
    # multi-frame with per-frame positions in reverse order: sorted along the normal
    ds = make_ds(px, slope=2.0, intercept=-10.0)
    del ds.ImagePositionPatient
    ds.PerFrameFunctionalGroupsSequence = []
    for k in range(3):
        grp = pydicom.Dataset()
        pp = pydicom.Dataset()
        pp.ImagePositionPatient = [0, 0, 10.0 - 4 * k]
        grp.PlanePositionSequence = [pp]
        ds.PerFrameFunctionalGroupsSequence.append(grp)
    ds.save_as(str(tmp_path / "mf"), enforce_file_format=True)
    v, meta = DicomDecoder().read(str(tmp_path / "mf"))
    assert v.shape == (3, 4, 5) and meta["spacing"][0] == 4.0
    np.testing.assert_array_equal(v, px[::-1].astype(np.float32) * 2 - 10)


def test_missing_meta_force_truncation_and_codec(tmp_path):
    px = np.full((4, 4), 1000, np.int16)
    ds = make_ds(px)
    ds.file_meta = FileMetaDataset()
    raw = str(tmp_path / "raw")
    ds.save_as(raw, enforce_file_format=False, implicit_vr=True, little_endian=True)
    assert (tmp_path / "raw").read_bytes()[128:132] != b"DICM"
    with pytest.raises(DecodeError, match="force: true"):
        DicomDecoder().read(raw)
    v, _ = DicomDecoder(DicomDecoder.Params(force=True)).read(raw)
    assert (v == -24).all()
    good = str(tmp_path / "good")
    make_ds(np.zeros((64, 64), np.int16)).save_as(good, enforce_file_format=True)
    blob = (tmp_path / "good").read_bytes()
    (tmp_path / "cut").write_bytes(blob[:-1000])
    with pytest.raises(DecodeError, match="truncated"):
        DicomDecoder().read(str(tmp_path / "cut"))
    from pydicom.encaps import encapsulate
    from pydicom.pixels import get_decoder

    if get_decoder(JPEGLSLossless).is_available:
        pytest.skip("a JPEG-LS plugin is installed, so the missing-codec error cannot happen")
    ds = make_ds(px, ts=JPEGLSLossless)
    ds.PixelData = encapsulate([b"\xff\xd8\xff\xf7" + b"\0" * 20 + b"\xff\xd9"])
    ds["PixelData"].VR = "OB"
    ds.save_as(str(tmp_path / "jls"), enforce_file_format=True)
    with pytest.raises(MissingDependencyError, match=r"precompile\[jpeg\]"):
        DicomDecoder().read(str(tmp_path / "jls"))


def test_series_folder_rules(tmp_path):
    for i in range(3):
        make_ds(np.full((4, 4), i, np.int16), pos=(0, 0, i), uid="1.1", inst=i).save_as(
            str(tmp_path / f"a{i}"), enforce_file_format=True)
    (tmp_path / "README.txt").write_text("not dicom")
    v, meta = series().read(str(tmp_path))
    assert v.shape == (3, 4, 4) and meta["skipped"] == ["README.txt"]
    make_ds(np.zeros((4, 4), np.int16), uid="2.2").save_as(str(tmp_path / "b0"), enforce_file_format=True)
    with pytest.raises(DecodeError, match="holds 2 series"):
        series().read(str(tmp_path))
    assert series(multiple="largest").read(str(tmp_path))[1]["series_uid"] == "1.1"
    assert series(series_uid="2.2").read(str(tmp_path))[0].shape == (1, 4, 4)
    make_ds(np.zeros((4, 4), np.int16), pos=(0, 0, 1), uid="1.1", inst=9).save_as(
        str(tmp_path / "dup"), enforce_file_format=True)
    with pytest.raises(DecodeError, match="share one position"):
        series(series_uid="1.1").read(str(tmp_path))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), cut=st.integers(0, 1500), force=st.booleans())
def test_fuzz_only_project_errors(tmp_path, data, cut, force):
    good = tmp_path / "good"
    if not good.exists():
        make_ds(np.ones((16, 16), np.int16)).save_as(str(good), enforce_file_format=True)
    blob = good.read_bytes()
    for b in (data, blob[:cut], b"\0" * 128 + b"DICM" + data, blob[:cut] + data):
        p = tmp_path / "f"
        p.write_bytes(b)
        try:
            v, _ = DicomDecoder(DicomDecoder.Params(force=force)).read(str(p))
        except PrecompileError:
            continue
        assert v.ndim == 3 and v.dtype == np.float32


def _phantom():
    vol, meta = series().read(os.path.join(SAMPLE, "chest_a"))
    return Sample("chest_a", {"ct": vol}, {"ct": "volume"}, {"ct": meta})


def test_lung_pipeline_steps():
    import sys

    sys.path.insert(0, os.path.join(REPO, "sample_data"))
    from make_sample_data import chest_phantom

    rng = np.random.default_rng(0)
    s = _phantom()
    (m,) = LungMask(LungMask.Params(out="lung")).run(s, rng)
    truth = chest_phantom(64, np.arange(24) / 23) < -500
    truth &= ~(chest_phantom(64, np.arange(24) / 23) < -900)   # lungs, not the room air
    got = m.fields["lung"] > 0
    dice = 2 * (got & truth).sum() / (got.sum() + truth.sum())
    assert dice > 0.95 and m.kinds["lung"] == "volume_mask" and m.fields["lung"].dtype == np.uint8
    (r,) = ResampleVolume(ResampleVolume.Params(spacing=[15, 10, 10])).run(m, rng)
    assert r.fields["ct"].shape == (12, 32, 32) and r.fields["lung"].shape == (12, 32, 32)
    assert r.meta["ct"]["spacing"] == [15.0, 10.0, 10.0]
    assert set(np.unique(r.fields["lung"])) <= {0, 1}
    (a,) = ApplyMask(ApplyMask.Params(mask="lung", fill=-1000)).run(m, rng)
    assert (a.fields["ct"][m.fields["lung"] == 0] == -1000).all()
    np.testing.assert_array_equal(a.fields["ct"][got], s.fields["ct"][got])
    pt = Patches3d(Patches3d.Params(size=[8, 32, 32], stride=[8, 16, 16], corner_field="corner")).run(m, rng)
    assert len(pt) == 3 * 3 * 3
    for p in pt:
        z, y, x = p.fields["corner"]
        np.testing.assert_array_equal(p.fields["ct"], s.fields["ct"][z:z + 8, y:y + 32, x:x + 32])
        assert p.meta["patch"]["corner"] == [z, y, x] and p.key.startswith("chest_a#p")
    kept = Patches3d(Patches3d.Params(size=[8, 32, 32], stride=[8, 16, 16], mask="lung", min_fraction=0.2)).run(m, rng)
    assert 0 < len(kept) < len(pt)
    assert F.hu_window(np.array([-2000, -600, 150, 900.0]), -1350, 150).tolist() == [0, 0.5, 1, 1]


def test_recipe_builds(tmp_path):
    import precompile
    from precompile import build

    build(os.path.join(REPO, "recipes", "ct_lung.yaml"), out_dir=str(tmp_path))
    ds = precompile.open(str(tmp_path / "ct_lung.h5"))
    assert len(ds) > 4 and {k.split("#")[0] for k in ds.keys} == {"chest_a", "chest_b"}
    s = ds[0]
    assert s["ct"].shape == (16, 32, 32) and s["ct"].dtype == np.float32 and 0 <= s["ct"].min() <= s["ct"].max() <= 1
    assert s["lung"].mean() >= 0.05 and s["corner"].dtype == np.int32


def test_missing_codec_stops_the_build_even_with_skip(tmp_path):
    """A missing codec is the environment's fault: the build stops and names the extra, skip or not."""
    from pydicom.encaps import encapsulate
    from pydicom.pixels import get_decoder

    import precompile

    if get_decoder(JPEGLSLossless).is_available:
        pytest.skip("a JPEG-LS plugin is installed, so the missing-codec error cannot happen")
    px = np.zeros((8, 8), np.int16)
    (tmp_path / "in").mkdir()
    make_ds(px, inst=1).save_as(str(tmp_path / "in" / "a.dcm"), enforce_file_format=True)
    ds = make_ds(px, ts=JPEGLSLossless, inst=2)
    ds.PixelData = encapsulate([b"\xff\xd8\xff\xf7" + b"\0" * 20 + b"\xff\xd9"])
    ds["PixelData"].VR = "OB"
    ds.save_as(str(tmp_path / "in" / "b.dcm"), enforce_file_format=True)
    recipe = {"name": "d", "on_error": "skip",
              "inputs": {"root": str(tmp_path / "in"), "match": "{n}.dcm", "fields": {"ct": {"decoder": "dicom"}}},
              "steps": [{"crop_pad_volume": {"shape": [1, 8, 8]}}]}
    import yaml

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(MissingDependencyError, match=r"precompile\[jpeg\]"):
        precompile.build(tmp_path / "r.yaml", out_dir=tmp_path / "out")


@pytest.mark.filterwarnings("ignore:Invalid value for VR DS")   # (pydicom, writing the hostile headers)
@pytest.mark.parametrize("name, over, msg", [
    ("inf slope", {"slope": "inf"}, r"0\.dcm: RescaleSlope inf / RescaleIntercept -1024 map no stored value to a "
                                    r"Hounsfield unit"),
    ("nan slope", {"slope": "nan"}, r"RescaleSlope nan / RescaleIntercept -1024 map no stored value"),
    ("zero slope", {"slope": 0.0}, r"RescaleSlope 0 / RescaleIntercept -1024 map no stored value"),
    ("inf intercept", {"intercept": "-inf"}, r"RescaleSlope 1 / RescaleIntercept -inf map no stored value"),
    ("zero spacing", {"PixelSpacing": [0, 0.75]}, r"PixelSpacing \[0\.0, 0\.75\] is not positive"),
    ("negative spacing", {"PixelSpacing": [-0.5, 0.75]}, r"PixelSpacing \[-0\.5, 0\.75\] is not positive"),
    ("zero row", {"ori": (0, 0, 0, 0, 1, 0)}, r"ImageOrientationPatient \[0\.0, 0\.0, 0\.0, 0\.0, 1\.0, 0\.0\]: the "
                                              r"row and column directions must be non-zero and not parallel"),
    ("parallel", {"ori": (1, 0, 0, 1, 0, 0)}, r"the row and column directions must be non-zero and not parallel"),
])
def test_series_headers_that_map_to_no_volume_are_refused(tmp_path, name, over, msg):
    """Headers pydicom reads whose numbers make no volume: an infinite or NaN RescaleSlope (or intercept) gave a
    volume of +-inf / NaN, a zero slope one of the intercept alone, a zero PixelSpacing a spacing of 0 (resampling
    divides by it), a zero orientation row NaN geometry in meta, parallel rows and columns the message "two slices
    share one position". Each is a DecodeError naming the header; rescale: false still reads the stored values."""
    rng = np.random.default_rng(1)
    kw = {k: over[k] for k in ("slope", "intercept", "ori") if k in over}
    for k in range(3):
        ds = make_ds(rng.integers(-100, 100, (6, 7)), pos=(0, 0, 2.0 * k), inst=k + 1, **kw)
        if "PixelSpacing" in over:
            ds.PixelSpacing = over["PixelSpacing"]
        ds.save_as(str(tmp_path / f"{k}.dcm"), enforce_file_format=True)
    with pytest.raises(DecodeError, match=msg):
        DicomSeriesDecoder().read(str(tmp_path))
    if "slope" in over or "intercept" in over:
        vol, _ = DicomSeriesDecoder(DicomSeriesDecoder.Params(rescale=False)).read(str(tmp_path))
        assert np.isfinite(vol).all() and vol.shape == (3, 6, 7)
