"""Optical flow: the strict .flo reader and writer, flow semantics of resize/crop/flip, real pairs."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from precompile.decoders.flo import FloDecoder, read_flo, write_flo
from precompile.errors import DecodeError, PrecompileError
from precompile.sample import Sample
from precompile.transforms.kernels import geometry as F
from precompile.transforms.geometry import CenterCrop, Resize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from conftest import realdata_root as realdata  # noqa: E402  (skips when ../shared/realdata is absent)


def _flo_bytes(w: int, h: int, data: np.ndarray | None = None, magic: float = 202021.25) -> bytes:
    data = np.zeros((h, w, 2), "<f4") if data is None else data.astype("<f4")
    return struct.pack("<fii", magic, w, h) + data.tobytes()


def test_round_trip_and_unknown_values(tmp_path):
    rng = np.random.default_rng(0)
    flow = rng.normal(0, 5, (7, 9, 2)).astype(np.float32)
    flow[2, 3] = np.nan
    p = str(tmp_path / "a.flo")
    write_flo(p, flow)
    assert os.path.getsize(p) == 12 + 7 * 9 * 8
    raw = np.fromfile(p, "<f4")[3:].reshape(7, 9, 2)
    assert raw[2, 3, 0] > 1e9          # stored the Middlebury way
    back = read_flo(p)
    assert back.dtype == np.float32 and back.shape == (7, 9, 2)
    np.testing.assert_array_equal(np.isnan(back), np.isnan(flow))
    np.testing.assert_array_equal(back[~np.isnan(back)], flow[~np.isnan(flow)])
    # one component above 1e9 makes the whole vector unknown
    flow2 = np.ones((2, 2, 2), np.float32)
    flow2[0, 1, 1] = 2e9
    (tmp_path / "b.flo").write_bytes(_flo_bytes(2, 2, flow2))
    arrays, meta = FloDecoder(FloDecoder.Params(valid_mask=True)).decode(str(tmp_path / "b.flo"), "flow")
    assert np.isnan(arrays["flow"][0, 1]).all() and meta["invalid"] == 1
    assert arrays["flow_valid"][..., 0].tolist() == [[1, 0], [1, 1]]
    assert arrays["flow_valid"].dtype == np.uint8


@pytest.mark.parametrize("blob, msg", [
    (b"PIEH", "shorter than the 12-byte header"),
    (_flo_bytes(3, 2, magic=1.0), "magic"),
    (_flo_bytes(3, 2)[:-4], "truncated"),
    (_flo_bytes(3, 2) + b"\0" * 8, "the file has"),
    (struct.pack("<fii", 202021.25, 0, 5), "absurd size"),
    (struct.pack("<fii", 202021.25, -3, 5), "absurd size"),
    (struct.pack("<fii", 202021.25, 100000, 100000), "absurd size"),
])
def test_bad_files_are_clean_errors(tmp_path, blob, msg):
    p = tmp_path / "bad.flo"
    p.write_bytes(blob)
    with pytest.raises(DecodeError, match=msg) as e:
        read_flo(str(p))
    assert str(p) in str(e.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200), cut=st.integers(0, 12 + 4 * 3 * 8))
def test_fuzz_only_project_errors(tmp_path, data, cut):
    good = _flo_bytes(4, 3, np.arange(24, dtype=np.float32).reshape(3, 4, 2))
    for blob in (data, good[:cut], good[:12] + data):
        p = tmp_path / "f.flo"
        p.write_bytes(blob)
        try:
            out = read_flo(str(p))
        except PrecompileError:
            continue
        assert out.dtype == np.float32 and out.ndim == 3 and out.shape[-1] == 2


def test_resize_scales_vectors_and_never_mixes_invalid():
    flow = np.zeros((40, 60, 2), np.float32)
    flow[..., 0], flow[..., 1] = 3.0, -2.0
    flow[10:20, 10:30] = np.nan
    for h, w in ((20, 30), (80, 90), (33, 47)):
        out = F.resize_flow(flow, h, w)
        ok = np.isfinite(out).all(-1)
        assert ok.any() and (~ok).any()
        np.testing.assert_allclose(out[ok][:, 0], 3.0 * w / 60, rtol=1e-5)
        np.testing.assert_allclose(out[ok][:, 1], -2.0 * h / 40, rtol=1e-5)
        # the invalid region stays where it was, about the same relative size
        frac = (~ok).mean()
        assert abs(frac - (10 * 20) / (40 * 60)) < 0.05


def test_flip_negates_the_matching_component():
    flow = np.random.default_rng(1).normal(size=(4, 5, 2)).astype(np.float32)
    h = F.flip_flow(flow, horizontal=True)
    np.testing.assert_array_equal(h[:, ::-1, 0], -flow[..., 0])
    np.testing.assert_array_equal(h[:, ::-1, 1], flow[..., 1])
    v = F.flip_flow(flow, horizontal=False, vertical=True)
    np.testing.assert_array_equal(v[::-1, :, 1], -flow[..., 1])
    img = np.arange(20, dtype=np.uint8).reshape(4, 5, 1)
    np.testing.assert_array_equal(F.flip_hw(img, True), img[:, ::-1])


def warp_error(img1: np.ndarray, img2: np.ndarray, flow: np.ndarray | None) -> float:
    """Mean abs difference between img1 and img2 sampled at x + flow (valid, in-bounds pixels only)."""
    import cv2

    h, w = img1.shape[:2]
    gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    f = np.zeros((h, w, 2), np.float32) if flow is None else flow
    ok = np.isfinite(f).all(-1)
    f = np.where(ok[..., None], f, 0)
    mx, my = gx + f[..., 0], gy + f[..., 1]
    ok &= (mx >= 0) & (mx <= w - 1) & (my >= 0) & (my <= h - 1)
    warped = cv2.remap(img2.astype(np.float32), mx, my, cv2.INTER_LINEAR)
    return float(np.abs(warped - img1.astype(np.float32))[ok].mean())


def _pairs():
    root = realdata()
    chairs = os.path.join(root, "flow", "flyingchairs")
    sintel = os.path.join(root, "flow", "sintel_alley_1_clean")
    out = [(os.path.join(chairs, f"{i}-img0.ppm"), os.path.join(chairs, f"{i}-img1.ppm"),
            os.path.join(chairs, f"{i}-gt.flo")) for i in ("0000000", "0000001")]
    out.append((os.path.join(sintel, "frame_0002.png"), os.path.join(sintel, "frame_0003.png"),
                os.path.join(sintel, "frame_0002.flo")))
    return [p for p in out if all(os.path.exists(x) for x in p)]


def test_real_pairs_warp_better_than_no_warp_before_and_after_steps():
    from precompile.decoders.image import decode_image_file

    pairs = _pairs()
    if not pairs:
        pytest.skip("no real flow pairs under realdata/flow")
    for a, b, f in pairs:
        img1, img2 = decode_image_file(a), decode_image_file(b)
        flow = read_flo(f)
        assert flow.shape[:2] == img1.shape[:2]
        base = warp_error(img1, img2, None)
        assert warp_error(img1, img2, flow) < 0.6 * base, a
        s = Sample("k", {"img1": img1, "img2": img2, "flow": flow},
                   {"img1": "image", "img2": "image", "flow": "flow"})
        H, W = img1.shape[:2]
        chains = [
            [Resize(Resize.Params(size=[H // 2, W // 3]))],
            [Resize(Resize.Params(size=[H * 3 // 4, W // 2])), CenterCrop(CenterCrop.Params(size=[H // 2, W // 3]))],
        ]
        rng = np.random.default_rng(0)
        for chain in chains:
            t = s
            for step in chain:
                (t,) = step.run(t, rng)
            i1, i2, fl = t.fields["img1"], t.fields["img2"], t.fields["flow"]
            assert fl.shape[:2] == i1.shape[:2] == i2.shape[:2]
            assert warp_error(i1, i2, fl) < 0.6 * warp_error(i1, i2, None), (a, chain)
        # a horizontal flip of all three keeps the correspondence
        fi1, fi2, ffl = F.flip_hw(img1, True), F.flip_hw(img2, True), F.flip_flow(flow, True)
        assert warp_error(fi1, fi2, ffl) < 0.6 * warp_error(fi1, fi2, None)
        assert warp_error(fi1, fi2, ffl) < 0.6 * warp_error(fi1, fi2, F.flip_hw(flow, True))


def test_sintel_invalid_mask_decodes_as_mask():
    from precompile.decoders.flo import FlowMaskDecoder

    p = os.path.join(realdata(), "flow", "sintel_alley_1_clean", "invalid_frame_0002.png")
    if not os.path.exists(p):
        pytest.skip("sintel invalid mask absent")
    m = FlowMaskDecoder(FlowMaskDecoder.Params(invert=True)).read(p)
    assert m.shape == (436, 1024, 1) and m.dtype == np.uint8 and set(np.unique(m)) <= {0, 1}
    assert m.mean() > 0.5       # most pixels are valid


def test_recipe_builds_and_flow_follows_images(tmp_path):
    import precompile
    from precompile import build

    rep = build(os.path.join(REPO, "recipes", "flow.yaml"), out_dir=str(tmp_path))
    ds = precompile.open(rep["output"] if "output" in rep else str(tmp_path / "flow.h5"))
    assert len(ds) == 4
    for i in range(len(ds)):
        s = ds[i]
        assert s["flow"].shape == (32, 48, 2) and s["flow_valid"].shape == (32, 48, 1)
        assert warp_error(s["img1"], s["img2"], s["flow"]) < 0.6 * warp_error(s["img1"], s["img2"], None)
    s = ds[ds.keys.index("pair3_img1.png")]
    assert np.isnan(s["flow"]).any()
    # the NaN pattern and the nearest-resized valid mask agree on nearly every pixel
    agree = (np.isfinite(s["flow"]).all(-1) == (s["flow_valid"][..., 0] == 1)).mean()
    assert agree > 0.97
