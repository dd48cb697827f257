"""``precompile preview``: each kind drawn as expected (colours of known regions), byte-identical sheets."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import precompile
from precompile import build
from precompile.cli import main
from precompile.tools import preview as pv

from conftest import make_image_tree, write_recipe

REPO = Path(__file__).resolve().parents[1]


def _flo(path: Path, flow: np.ndarray) -> None:
    h, w = flow.shape[:2]
    path.write_bytes(struct.pack("<fii", 202021.25, w, h) + flow.astype("<f4").tobytes())


def _crop(sheet: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x, y, w, h = box
    return sheet[y:y + h, x:x + w]


def _panel(p: pv.Preview, row: int, caption_start: str) -> np.ndarray:
    hits = [b for b in p.panels if b["row"] == row and b["caption"].startswith(caption_start)]
    assert hits, f"no panel {caption_start!r} in row {row}: {[b['caption'] for b in p.panels if b['row'] == row]}"
    return _crop(p.sheet, hits[0]["box"])


# --- the colour conventions, on arrays ------------------------------------------------------

def test_flow_colours_follow_the_middlebury_wheel():
    h, w = 4, 5
    one = np.ones((h, w))
    zero = np.zeros((h, w))

    def colour(u, v):
        out = pv.flow_to_rgb(np.stack([u, v], -1))
        assert (out == out[0, 0]).all()
        return tuple(int(c) for c in out[0, 0])

    # the wheel's 55 colours: red->yellow (15), yellow->green (6), green->cyan (4), cyan->blue (11),
    # blue->magenta (13), magenta->red (6); +u is angle 0 = colour 0
    assert colour(one, zero) == (255, 0, 0)
    assert colour(-one, zero) == (0, 255 - 255 * 2 // 11, 255)            # colour 27 (cyan->blue, step 2)
    assert colour(zero, one) == (255, int(255 * ((255 * 13 // 15 + 255 * 14 // 15) / 2 / 255)), 0)  # 13.5
    assert colour(zero, -one) == (int(255 * ((255 * 4 // 13 + 255 * 5 // 13) / 2 / 255)), 0, 255)  # 40.5
    # magnitude is saturation relative to the largest vector: half length is halfway to white
    fl = np.zeros((1, 2, 2))
    fl[0, 0] = (2.0, 0.0)
    fl[0, 1] = (1.0, 0.0)
    out = pv.flow_to_rgb(fl)
    assert tuple(out[0, 0]) == (255, 0, 0)
    assert tuple(out[0, 1]) == (255, 127, 127)
    # no motion is white, unknown vectors are black
    assert tuple(pv.flow_to_rgb(np.zeros((1, 1, 2)))[0, 0]) == (255, 255, 255)
    assert tuple(pv.flow_to_rgb(np.array([[[np.nan, 1.0]]]))[0, 0]) == (0, 0, 0)


def test_hu_windows():
    lung = pv.hu_window(np.array([-2000, -1350, -1000, -600, 150, 3000.0]), "lung")  # L -600 W 1500
    assert lung.tolist() == [0, 0, int(350 / 1500 * 255 + 0.5), 128, 255, 255]
    soft = pv.hu_window(np.array([-1000, -160, 40, 240, 1000.0]), "soft")            # L 40 W 400
    assert soft.tolist() == [0, 0, 128, 255, 255]


def test_mask_classes_get_their_palette_colour():
    img = np.full((6, 8, 3), 100, np.uint8)
    mask = np.zeros((6, 8, 1), np.uint8)
    mask[1:3, 2:5] = 2
    mask[4:, 6:] = 5
    item = pv.Item("k", [{"image": img, "seg": mask}], [{}], [0],
                   {"image": {"kind": "image"}, "seg": {"kind": "mask"}}, [], {})
    panels = pv.RENDERERS["mask"](item, "seg")
    assert len(panels) == 2   # the overlay, then the legend
    out = panels[0].image
    for cls, (r, c) in ((2, (1, 2)), (5, (5, 7))):
        want = [int(np.floor(0.5 * 100 + 0.5 * v + 0.5)) for v in pv.PALETTE[cls]]
        assert out[r, c].tolist() == want
    assert out[0, 0].tolist() == [100, 100, 100]  # class 0 stays clear
    # classes past the palette wrap to colour 1 onwards, never to the background's
    many = pv.overlay(np.zeros((1, 2, 3), np.uint8), np.array([[len(pv.PALETTE), len(pv.PALETTE) - 1]]), alpha=1.0)
    assert many[0, 0].tolist() == list(pv.PALETTE[1]) and many[0, 1].tolist() == list(pv.PALETTE[-1])
    assert panels[0].caption[1] == "classes 2, 5"
    key = panels[1]
    assert key.caption == ["legend", "2", "5"] and not key.scale
    assert key.image[0, 0].tolist() == list(pv.PALETTE[2]) and key.image[12, 0].tolist() == list(pv.PALETTE[5])


def test_volume_three_slices_windowed_with_the_mask_overlaid():
    d, h, w = 8, 10, 12
    vol = np.full((d, h, w), -1000.0, np.float32)
    vol[2:6, 3:7, 4:9] = 40.0
    m = (vol > 0).astype(np.uint8)
    item = pv.Item("k", [{"ct": vol, "lung": m}], [{}], [0],
                   {"ct": {"kind": "volume"}, "lung": {"kind": "volume_mask"}}, [], {"window": "soft"})
    panels = pv.RENDERERS["volume"](item, "ct")
    assert [p.image.shape[:2] for p in panels] == [(h, w), (d, w), (d, h)]
    # through the most masked plane along each axis (the first of equals: the block's first plane)
    assert panels[0].caption[:2] == ["ct axial z=2", "soft window L40 W400"]
    assert [p.caption[0] for p in panels[1:]] == ["ct coronal y=3", "ct sagittal x=4"]
    axial = panels[0].image
    assert axial[0, 0].tolist() == [0, 0, 0]                       # -1000 HU is black in the soft window
    want = [int(np.floor(0.5 * 128 + 0.5 * v + 0.5)) for v in pv.PALETTE[1]]
    assert axial[4, 5].tolist() == want                           # 40 HU (grey 128) under mask class 1
    lung = pv.RENDERERS["volume"](pv.Item("k", [{"ct": vol}], [{}], [0], {"ct": {"kind": "volume"}}, [],
                                          {"window": "lung"}), "ct")
    assert lung[0].image[0, 0].tolist() == [60] * 3                # -1000 HU in L -600 W 1500
    # data already in [0, 1] (a hu_window step ran) is shown as it is, not windowed again
    unit = pv.RENDERERS["volume"](pv.Item("k", [{"ct": np.full((3, 4, 5), 0.5, np.float32)}], [{}], [0],
                                          {"ct": {"kind": "volume"}}, [], {"window": "lung"}), "ct")
    assert unit[0].caption[1] == "[0, 1]" and unit[0].image[0, 0].tolist() == [128] * 3


def test_large_pictures_shrink_by_a_whole_factor():
    big = np.zeros((1000, 300, 3), np.uint8)
    big[:500] = 200
    row, boxes = pv.draw_row(["k"], [pv.Panel(big, ["big"])])
    x, y, w, h = boxes[0]
    assert (h, w) == (250, 75)                        # 1000 rows / 4 fit in 256
    assert (row[y:y + 125, x:x + w] == 200).all() and (row[y + 125:y + h, x:x + w] == 0).all()


def test_video_strip_shows_evenly_spaced_frames():
    t = 12
    colours = np.arange(t) * 20
    clip = np.zeros((t, 4, 6, 3), np.uint8)
    clip[..., 0] = colours[:, None, None]
    item = pv.Item("v", [{"video": clip}], [{"clip": {"frames": list(range(100, 100 + t))}}], [0],
                   {"video": {"kind": "video"}}, [], {})
    panels = pv.RENDERERS["video"](item, "video")
    picked = [0, 2, 3, 5, 6, 8, 9, 11]  # 8 of 12, evenly spread
    assert [int(p.image[0, 0, 0]) for p in panels] == [colours[i] for i in picked]
    assert panels[1].caption[-1] == "video t=2 (frame 102)"


def test_audio_waveform_and_log_mel_put_a_tone_where_it_belongs():
    sr = 16000
    x = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(8000) / sr)
    db = pv.log_mel(x, sr)
    assert db.shape[0] == 64 and db.max() == 0.0 and db.min() >= -80.0
    fb = pv.mel_filterbank(sr, 512, 64)
    centres = np.fft.rfftfreq(512, 1 / sr)[fb.argmax(axis=1)]
    band = int(np.median(db.argmax(axis=0)))
    assert abs(centres[band] - 1000) <= 100        # the loudest band holds 1 kHz
    wave = pv.waveform(x[None], width=64, height=33)
    lit = (wave == (90, 200, 255)).all(axis=-1)
    rows = np.flatnonzero(lit.any(axis=1))
    assert rows.min() == 8 and rows.max() == 24     # +-0.5 of full scale: a quarter from each edge
    item = pv.Item("a", [{"audio": x[None].astype(np.float32)}], [{"audio": {"sample_rate": sr}}], [0],
                   {"audio": {"kind": "audio"}}, [], {})
    panels = pv.RENDERERS["audio"](item, "audio")
    assert panels[0].caption[0] == "audio 1 ch, 8000 samples, 0.5 s"
    assert panels[1].image.shape[0] == 64


# --- whole sheets from built outputs --------------------------------------------------------

@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Path:
    """Image + mask (flow_mask decoder) + flow (.flo with an unknown block) outputs: two scenes."""
    root = tmp_path_factory.mktemp("scene")
    data = root / "data"
    data.mkdir()
    h, w = 24, 32
    for i, (u, v) in enumerate(((3.0, 0.0), (0.0, -2.0))):
        Image.fromarray(np.full((h, w, 3), 100, np.uint8)).save(data / f"s{i}_img.png")
        occ = np.zeros((h, w), np.uint8)
        occ[4:10, 20:30] = 255
        Image.fromarray(occ).save(data / f"s{i}_occ.png")
        fl = np.zeros((h, w, 2), np.float32)
        fl[..., 0], fl[..., 1] = u, v
        fl[12:16, 8:12] = np.nan
        _flo(data / f"s{i}_flow.flo", fl)
    recipe = write_recipe(root / "scene.yaml", {
        "name": "scene",
        "inputs": {"root": str(data), "match": "{name}_img.png", "fields": {
            "img": {"decoder": "image", "mode": "rgb8"},
            "occ": {"decoder": "flow_mask", "path": "{name}_occ.png"},
            "flow": {"decoder": "flo", "valid_mask": True, "path": "{name}_flow.flo"}}},
        "output": {"format": "hdf5", "samples_per_shard": 4}})
    build(recipe, out_dir=root / "out")
    return root / "out" / "scene.h5"


def test_flow_mask_and_image_panels_on_a_built_output(scene):
    p = pv.render(scene, n=2)
    k = 4  # 24 rows scaled to 96
    img = _panel(p, 0, "img")
    assert img.shape == (24 * k, 32 * k, 3) and (img == 100).all()
    occ = _panel(p, 0, "occ")
    want = [int(np.floor(0.5 * 100 + 0.5 * v + 0.5)) for v in pv.PALETTE[1]]
    assert occ[4 * k:10 * k, 20 * k:30 * k].reshape(-1, 3).tolist() == [want] * (6 * 10 * k * k)
    assert (occ[:4 * k] == 100).all()
    flow = _panel(p, 0, "flow (max 3 px)")
    unknown = np.zeros((24, 32), bool)
    unknown[12:16, 8:12] = True
    unknown = np.repeat(np.repeat(unknown, k, 0), k, 1)
    assert (flow[~unknown] == (255, 0, 0)).all()          # pure +u: the wheel's colour for angle 0
    assert (flow[unknown] == 0).all()                     # unknown vectors black
    valid = _panel(p, 0, "flow_valid valid")
    assert (valid[~unknown] == 255).all() and (valid[unknown] == 0).all()
    up = _panel(p, 1, "flow (max 2 px)")                   # pure -v (upwards): colour 40.5 of the wheel
    assert (up[~unknown] == (int(255 * ((255 * 4 // 13 + 255 * 5 // 13) / 2 / 255)), 0, 255)).all()
    assert any(b["caption"] == "key (+u red)" for b in p.panels if b["row"] == 0)


def test_multi_class_mask_decoder_output_in_palette_colours(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.fromarray(np.full((24, 32, 3), 100, np.uint8)).save(data / "a_img.png")
    m = np.zeros((24, 32), np.uint8)
    m[2:8, 2:10] = 2
    m[12:20, 14:30] = 5
    Image.fromarray(m).save(data / "a_seg.png")
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "seg", "inputs": {"root": str(data), "match": "{name}_img.png", "fields": {
            "img": {"decoder": "image", "mode": "rgb8"},
            "seg": {"decoder": "mask", "classes": [0, 2, 5], "path": "{name}_seg.png"}}}})
    build(recipe, out_dir=tmp_path / "out")
    p = pv.render(tmp_path / "out" / "seg.h5", fields=["seg"])
    # its image is drawn under it, not beside; then the legend of its classes
    assert [(q["field"], q["caption"]) for q in p.panels] == [("seg", "seg over img"), ("seg", "legend")]
    over = _panel(p, 0, "seg over img")
    k = over.shape[0] // 24
    cls = np.repeat(np.repeat(m, k, 0), k, 1)
    for c in (0, 2, 5):
        want = [100] * 3 if c == 0 else [int(np.floor(0.5 * 100 + 0.5 * v + 0.5)) for v in pv.PALETTE[c]]
        assert (over[cls == c] == want).all(), c


def test_sheet_is_byte_identical_and_sized_by_its_panels(scene, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    r = CliRunner().invoke(main, ["preview", str(scene), "-o", str(a)])
    assert r.exit_code == 0, r.output
    pv.preview(scene, out=str(b))
    assert a.read_bytes() == b.read_bytes()
    p = pv.render(scene)
    with Image.open(a) as im:
        assert im.size == (p.sheet.shape[1], p.sheet.shape[0])
        assert np.array_equal(np.asarray(im), p.sheet)
    right = max(x + w for x, _, w, _ in (q["box"] for q in p.panels))
    assert right + pv.PAD <= p.sheet.shape[1] <= right + 96 + pv.PAD  # no more than one caption column spare
    assert {q["row"] for q in p.panels} == {0, 1}


def test_augmented_copies_side_by_side_with_their_drawn_parameters(tmp_path):
    data = make_image_tree(tmp_path / "data", per_class=2)
    recipe = write_recipe(tmp_path / "aug.yaml", {
        "name": "aug", "seed": 3,
        "inputs": {"root": str(data), "match": "{label}/{name}.{ext}", "where": {"ext": "jpg|png"},
                   "fields": {"image": {"decoder": "image", "mode": "rgb8"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [32, 32]}}, {"random_flip": {"horizontal": 0.5}},
                  {"color_jitter": {"brightness": 0.3}}],
        "copies": 2, "output": {"format": "hdf5", "samples_per_shard": 4}})
    build(recipe, out_dir=tmp_path / "out")
    path = tmp_path / "out" / "aug.h5"
    ds = precompile.open(path)
    p = pv.render(path, n=2)
    assert [r[0] for r in p.rows] == [ds.key(0), ds.key(len(ds) - 1)]
    rows0 = [i for i in range(len(ds)) if ds.key(i) == ds.key(0)]
    panels = [q for q in p.panels if q["row"] == 0]
    assert [q["caption"] for q in panels] == ["image 32x32x3 uint8 copy 0", "image copy 1", "image copy 2"]
    for q, i in zip(panels, sorted(rows0, key=ds.copy)):
        want = np.repeat(np.repeat(ds[i]["image"], 3, 0), 3, 1)   # 32 -> 96 by a whole factor
        assert np.array_equal(_crop(p.sheet, q["box"]), want)
    cap = pv.augment_caption(ds.meta(rows0[1]))
    flip = ds.meta(rows0[1])["augment"][0]
    assert cap[0] == f"random_flip: horizontal={'y' if flip['horizontal'] else 'n'}, vertical=n"
    assert cap[1].startswith("color_jitter: brightness=")
    # the HTML page: one section per row, the picture inline, the drawn parameters in the metadata
    page = tmp_path / "aug.html"
    pv.preview(path, out=str(tmp_path / "aug.png"), n=2, html_path=str(page))
    text = page.read_text()
    assert text.count("<section>") == 2 and "data:image/png;base64," in text and "color_jitter" in text


def test_sample_outputs_of_every_kind_render(tmp_path):
    for name in ("ct_lung", "video", "audio", "images_png"):
        build(REPO / "recipes" / f"{name}.yaml", out_dir=tmp_path)
    ext = {"images_png": ".json"}
    seen = {}
    for name in ("ct_lung", "video", "audio", "images_png"):
        path = tmp_path / (name + ext.get(name, ".h5"))
        p = pv.render(path, n=2)
        seen[name] = [q["caption"] for q in p.panels if q["row"] == 0]
        assert pv.png_bytes(p.sheet) == pv.png_bytes(pv.render(path, n=2).sheet)
    assert [c.split(" ")[1] for c in seen["ct_lung"][:3]] == ["axial", "coronal", "sagittal"]
    assert seen["video"][0] == "video 8x32x32x3 uint8" and len(seen["video"]) == 8
    assert seen["audio"][0].startswith("audio 1 ch, 8000 samples") and seen["audio"][1].startswith("log-mel")
    assert seen["images_png"] == ["image 64x64x3 uint8"]
    # HU data (no hu_window step): the lung window, air (-1000 HU) at grey 60 outside the lung mask
    recipe = write_recipe(tmp_path / "hu.yaml", {
        "name": "hu", "inputs": {"root": str(REPO / "sample_data" / "dicom"), "match": "{series}", "kind": "dir",
                                 "fields": {"ct": {"decoder": "dicom_series", "dtype": "float32"}}},
        "steps": [{"resample_volume": {"spacing": 10}}, {"lung_mask": {"threshold": -320, "out": "lung"}}],
        "output": {"format": "hdf5", "samples_per_shard": 1}})
    build(recipe, out_dir=tmp_path)
    p = pv.render(tmp_path / "hu.h5", n=1)
    axial = _panel(p, 0, "ct axial")
    ds = precompile.open(tmp_path / "hu.h5")
    vol, lung = ds[0]["ct"], ds[0]["lung"]
    z = int(np.argmax((lung != 0).sum(axis=(1, 2))))
    assert p.panels[0]["caption"] == f"ct axial z={z}"
    sl = vol[z]
    k = axial.shape[0] // sl.shape[0]
    outside = (np.abs(sl + 1000) < 1) & (lung[z] == 0)
    assert outside.any()
    got = axial[::k, ::k][outside]
    want = np.floor(np.clip((sl[outside].astype(np.float64) + 1350) / 1500, 0, 1) * 255 + 0.5)
    assert np.array_equal(got[:, 0], want) and set(want.tolist()) <= {59.0, 60.0}


def test_field_choice_and_errors(scene, tmp_path):
    p = pv.render(scene, n=1, fields=["flow"])
    assert {q["field"] for q in p.panels} == {"flow"}
    r = CliRunner().invoke(main, ["preview", str(scene), "--field", "nope", "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "no field 'nope'" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["preview", str(tmp_path / "missing.h5")])
    assert r.exit_code == 5 and "no such file" in r.output
    assert not (tmp_path / "x.png").exists()


def test_preview_stats_and_schema_never_import_torch(scene, tmp_path):
    code = ("import sys; from precompile.tools import preview, stats, schema; "
            f"preview.preview({str(scene)!r}, out={str(tmp_path / 's.png')!r}); "
            f"stats.stats({str(scene)!r}, write=False); schema.schema_text(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_title_wraps_on_a_narrow_sheet(tmp_path):
    """One small picture makes a narrow sheet: the title (a long output name, then every field) wraps
    inside it, a word wider than the sheet is broken, and the rows start below the last line."""
    data = tmp_path / "data"
    data.mkdir()
    Image.fromarray(np.full((8, 8, 3), 90, np.uint8)).save(data / "a.png")
    name = "an_output_name_so_long_that_it_is_wider_than_the_whole_narrow_contact_sheet"
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": name, "inputs": {"root": str(data), "match": "{n}.png", "fields": {
            "picture": {"decoder": "image", "mode": "rgb8"}, "second_picture": {"decoder": "image", "path": "{n}.png"}}}})
    build(recipe, out_dir=tmp_path / "out")
    p = pv.render(tmp_path / "out" / f"{name}.h5", fields=["picture"])
    width = p.sheet.shape[1]
    lines = pv.title_lines(p.title, width)
    assert len(lines) >= 3
    font = pv._font()
    assert all(pv._text_width(font, line) <= width - 2 * pv.PAD for line in lines)
    assert "".join(lines).replace(" ", "") == p.title.replace(" ", "")   # nothing lost
    top = min(q["box"][1] for q in p.panels)
    assert top >= 2 * pv.PAD + len(lines) * pv.LINE
    title = p.sheet[:2 * pv.PAD + len(lines) * pv.LINE]
    assert (title[:, -pv.PAD:] == pv.BG).all()                      # nothing drawn into the right margin
    last = title[pv.PAD + (len(lines) - 1) * pv.LINE: pv.PAD + len(lines) * pv.LINE]
    assert (last != pv.BG).any()                                    # the last line is drawn


def test_mri_volume_gets_a_percentile_window_not_blank_white():
    """Non-CT intensities (an MRI: 0 .. ~2000, never air at -1000 HU) through their 1st-99th percentiles."""
    rng = np.random.default_rng(0)
    vol = np.zeros((8, 20, 20), np.float32)
    vol[:, 4:16, 4:16] = rng.normal(800, 50, (8, 12, 12))        # tissue
    vol[:, 8:12, 8:12] = 1600                                      # a bright structure
    vol[0, 0, 0] = 30000                                           # one outlier voxel must not flatten the rest
    item = pv.Item("k", [{"mr": vol}], [{"mr": {"modality": "MR"}}], [0], {"mr": {"kind": "volume"}}, [],
                   {"window": "lung"})
    axial = pv.RENDERERS["volume"](item, "mr")[0]
    lo, hi = np.percentile(vol[np.isfinite(vol)], [1, 99])
    assert axial.caption[1] == f"auto window p1-p99 [{lo:.3g}, {hi:.3g}]"
    img = axial.image[..., 0]
    assert img[1, 1] == 0 and img[10, 10] == 255                   # background black, the bright structure white
    assert 60 < int(np.median(img[5:7, 5:7])) < 200                 # tissue is grey, not clipped white
    assert img.max() == 255 and (img == 255).mean() < 0.2           # the lung window made all of it white
    # the same values as CT (modality CT): the HU window, as asked
    ct = pv.RENDERERS["volume"](pv.Item("k", [{"mr": vol}], [{"mr": {"modality": "CT"}}], [0],
                                        {"mr": {"kind": "volume"}}, [], {"window": "lung"}), "mr")[0]
    assert ct.caption[1] == "lung window L-600 W1500" and (ct.image[5:15, 5:15] == 255).all()
    # no modality: HU is recognised by air (<= -500); window auto shows a CT in its percentiles too
    hu = np.where(vol > 0, vol - 1000, -1000).astype(np.float32)
    cap = lambda w: pv.RENDERERS["volume"](pv.Item("k", [{"v": hu}], [{}], [0], {"v": {"kind": "volume"}}, [],  # noqa: E731
                                                   {"window": w}), "v")[0].caption[1]
    assert cap("soft") == "soft window L40 W400" and cap("auto").startswith("auto window p1-p99")


def test_masks_are_overlaid_on_every_copy_with_a_legend(tmp_path):
    build(REPO / "recipes" / "segmentation.yaml", out_dir=tmp_path)
    path = tmp_path / "segmentation.h5"
    ds = precompile.open(path)
    p = pv.render(path, n=2, fields=["mask"])
    rows0 = sorted([i for i in range(len(ds)) if ds.key(i) == p.rows[0][0]], key=ds.copy)
    caps = [q["caption"] for q in p.panels if q["row"] == 0]
    assert caps == ["mask over image copy 0", "mask over image copy 1", "mask over image copy 2", "legend"]
    for c, i in enumerate(rows0):
        got = _panel(p, 0, f"mask over image copy {c}")
        want = pv.overlay(ds[i]["image"], ds[i]["mask"][..., 0])
        k = got.shape[0] // want.shape[0]
        assert np.array_equal(got, np.repeat(np.repeat(want, k, 0), k, 1)), c   # each copy's own mask
    assert not np.array_equal(ds[rows0[1]]["mask"], ds[rows0[0]]["mask"])      # the copies really differ
    seen = sorted({int(v) for i in rows0 for v in np.unique(ds[i]["mask"]) if v})
    legend = pv.RENDERERS["mask"](pv.Item("k", [ds[i] for i in rows0], [ds.meta(i) for i in rows0],
                                          [ds.copy(i) for i in rows0], ds.field_specs, [], {}), "mask")[-1]
    assert legend.caption == ["legend", *map(str, seen)]


def test_coco_semantic_mask_legend_names_the_categories(tmp_path):
    pytest.importorskip("pycocotools")
    build(REPO / "recipes" / "coco.yaml", out_dir=tmp_path)
    ds = precompile.open(tmp_path / "coco.h5")
    names = pv.mask_class_names(ds)["mask"]
    assert names == {k + 1: n for k, n in enumerate(ds.label_names)}
    p = pv.render(tmp_path / "coco.h5", n=3, fields=["mask"])
    legends = [q for q in p.panels if q["caption"] == "legend"]
    assert legends
    i = next(i for i in range(len(ds)) if ds[i]["mask"].any())
    ids = sorted(int(v) for v in np.unique(ds[i]["mask"]) if v)
    panel = pv.legend(ids, names)
    assert panel.caption[1:] == [f"{k}: {ds.label_names[k - 1]}" for k in ids]


@pytest.mark.parametrize("name", ["café", "猫", "Ærø-ß"])
def test_class_names_the_font_lacks_are_not_drawn_as_missing_glyph_boxes(name):
    """Issue 32: a class name with characters Pillow's default font has no glyph for was drawn as a row of
    missing-glyph boxes. Such a character is written as its base letter (é -> e) or its escape (猫 ->
    \\u732b): the tag drawn for the name differs from the one a missing glyph gives, and is legible ASCII."""
    rgb = np.zeros((32, 80, 3), np.uint8)
    boxes = np.array([[1, 1, 78, 30]], np.float32)

    def tag(text):
        return pv.draw_annotations(rgb, boxes, np.array([0]), [text], None, min_side=320)

    missing = "".join("\U0010FFFD" if ord(c) > 127 else c for c in name)   # a code point no font draws
    assert not np.array_equal(tag(name), tag(missing))
    shown = pv._printable(name)
    assert shown.isascii() and shown == {"café": "cafe", "猫": "\\u732b", "Ærø-ß": "\\u00c6r\\u00f8-\\u00df"}[name]
    assert pv._printable("plain ascii 123") == "plain ascii 123"
