"""JPEGs decode strictly (issue 32.9): a scan that ends early is the input's error, never a grey image,
and the pixels of every sound JPEG are Pillow's, byte for byte, at full size and at each reduced scale."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import precompile
from precompile.decoders.image import ImageDecoder, decode_image_scaled
from precompile.errors import DecodeError

from conftest import image_recipe, make_image_tree, realdata, write_recipe

CUT = "truncated or corrupt JPEG data (libjpeg-turbo: Corrupt JPEG data: premature end of data segment)"


def photo(h: int, w: int, c: int = 3, seed: int = 0) -> np.ndarray:
    """Gradients and a ramp pattern under noise: every 8x8 block costs real bits, as in a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 / w, y * 255 / h, (x + y) % 256, (x * y) % 255], -1)[..., :c]
    return np.clip(a + rng.normal(0, 20, (h, w, c)), 0, 255).astype(np.uint8)


def jpeg_bytes(a: np.ndarray, mode: str | None = None, **kw) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a, mode).save(b, "JPEG", **kw)
    return b.getvalue()


def pillow_decode(path, mode: str, exif_transpose: bool, k: int) -> tuple[np.ndarray, int]:
    """The image decoder's Pillow path (what decoded every JPEG before): draft, load, cover, transpose."""
    from precompile.decoders import image as I

    with Image.open(path) as img:
        return I._decode_pillow(img, str(path), mode, exif_transpose, k, 1 << 30)


# -- 32.9: a cut JPEG with an EOI marker --------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"progressive": True}, {"subsampling": 0}, {"restart_marker_blocks": 4}],
                         ids=["baseline", "progressive", "444", "restarts"])
def test_photo_cut_to_a_third_plus_eoi_is_an_error(tmp_path, kw):
    d = jpeg_bytes(photo(600, 800), quality=90, **kw)
    p = tmp_path / "cut.jpg"
    p.write_bytes(d[:len(d) // 3] + b"\xff\xd9")
    with Image.open(p) as im:   # what Pillow makes of it, silently
        im.load()
        pil = np.asarray(im)
    if not kw.get("progressive"):   # the rows past the cut are libjpeg's grey
        assert (np.abs(pil.astype(int) - 128) <= 2).all(-1).mean() > 0.5
    with pytest.raises(DecodeError) as e:
        ImageDecoder().read(str(p))
    assert str(e.value) == f"{p}, stage decode: {CUT}"
    with pytest.raises(DecodeError, match="premature end of data segment"):   # at a reduced scale too
        decode_image_scaled(str(p), "rgb8", True, 4)


def test_cut_photo_is_listed_by_a_build_with_on_error_skip(tmp_path):
    tree = make_image_tree(tmp_path / "data", per_class=2)
    d = jpeg_bytes(photo(600, 800), quality=90)
    (tree / "cat" / "000.jpg").write_bytes(d[:len(d) // 3] + b"\xff\xd9")
    r = image_recipe(tree, on_error="skip")
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    fails = {Path(f["path"]).relative_to(tree).as_posix(): f for f in rep["failures"]}
    assert list(fails) == ["cat/000.jpg"]
    assert fails["cat/000.jpg"]["stage"] == "decode"
    assert fails["cat/000.jpg"]["message"].endswith(CUT)
    assert str(tree / "cat" / "000.jpg") in fails["cat/000.jpg"]["message"]
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    assert sorted(ds.keys) == ["cat/001.png", "dog/000.jpg", "dog/001.png"]


def test_real_truncated_jpeg(tmp_path):
    """Pillow's truncated_jpeg.jpg (progressive, all ten scans) lacks the end of its last scan's padding byte
    and the EOI: libjpeg warns at the end of the file. Cut 8 bytes earlier and closed with an EOI, Pillow
    decodes it without a word; here it is an error. Closed with an EOI as it is, libjpeg needs no bit it
    lacks (the missing bits were padding): it decodes whole, as Pillow does."""
    src = realdata("images", "truncated_jpeg.jpg")
    with pytest.raises(DecodeError) as e:
        ImageDecoder().read(str(src))
    assert str(e.value) == (f"{src}, stage decode: truncated or corrupt JPEG data "
                            f"(libjpeg-turbo: Premature end of JPEG file)")
    data = src.read_bytes()
    for cut in (8, len(data) // 3):
        p = tmp_path / f"cut{cut}.jpg"
        p.write_bytes(data[:-cut] + b"\xff\xd9")
        with Image.open(p) as im:
            im.load()
        with pytest.raises(DecodeError) as e:
            ImageDecoder().read(str(p))
        assert str(e.value) == f"{p}, stage decode: {CUT}"
    closed = tmp_path / "closed.jpg"
    closed.write_bytes(data + b"\xff\xd9")
    with Image.open(closed) as im:
        want = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(ImageDecoder().read(str(closed)), want)


def test_extraneous_bytes_before_eoi_decode_whole(tmp_path):
    """Bytes between the last scan and EOI (some cameras write them): libjpeg warns after a whole decode;
    the image is stored, equal to the same file without them."""
    d = jpeg_bytes(photo(61, 93), quality=90)
    assert d.endswith(b"\xff\xd9")
    p = tmp_path / "pad.jpg"
    p.write_bytes(d[:-2] + b"\x00" * 37 + b"\xff\xd9")
    clean = tmp_path / "clean.jpg"
    clean.write_bytes(d)
    import simplejpeg

    with pytest.raises(ValueError, match=r"Corrupt JPEG data: \d+ extraneous bytes before marker 0xd9"):
        simplejpeg.decode_jpeg(p.read_bytes(), strict=True)
    for k in (None, 2):
        a, ka = decode_image_scaled(str(p), "rgb8", True, k)
        b, kb = decode_image_scaled(str(clean), "rgb8", True, k)
        assert ka == kb and a.tobytes() == b.tobytes()


# -- the same pixels as Pillow ------------------------------------------------------------------------------

def _cases(tmp: Path) -> list[Path]:
    """Grey, RGB at 4:4:4 / 4:2:2 / 4:2:0 (baseline and progressive), 4:4:0 and 4:1:1 (TurboJPEG's encoder),
    an RGB-coded JPEG (Adobe transform 0), CMYK; sizes divisible by 8, not, and tiny; EXIF orientations."""
    import simplejpeg

    out = []

    def put(name: str, data: bytes) -> None:
        out.append(tmp / f"{name}.jpg")
        out[-1].write_bytes(data)

    for h, w in [(96, 128), (61, 93), (5, 5), (3, 7)]:
        a = photo(h, w)
        for sub in (0, 1, 2):
            put(f"rgb{sub}_{h}x{w}", jpeg_bytes(a, quality=90, subsampling=sub))
        put(f"prog_{h}x{w}", jpeg_bytes(a, quality=90, progressive=True, subsampling=2))
        put(f"gray_{h}x{w}", jpeg_bytes(photo(h, w, 1)[..., 0], quality=90))
        put(f"cmyk_{h}x{w}", jpeg_bytes(photo(h, w, 4), "CMYK", quality=90))
        put(f"keeprgb_{h}x{w}", jpeg_bytes(a, quality=90, keep_rgb=True))
        for sub in ("440", "411"):
            put(f"tj{sub}_{h}x{w}", simplejpeg.encode_jpeg(a, 90, "RGB", sub))
        for o in range(1, 9):
            ex = Image.Exif()
            ex[0x0112] = o
            put(f"o{o}_{h}x{w}", jpeg_bytes(a, quality=90, exif=ex))
            if o in (2, 5, 7, 8):
                put(f"grayo{o}_{h}x{w}", jpeg_bytes(photo(h, w, 1)[..., 0], quality=90, exif=ex))
    return out


def _same(path, modes=("rgb8", "gray8", "gray16", "rgba8")) -> int:
    n = 0
    for mode in modes:
        for k in (1, 2, 4, 8):
            for exif in (True, False):
                want, kw = pillow_decode(path, mode, exif, k)
                got, kg = decode_image_scaled(str(path), mode, exif, k if k > 1 else None)
                if kw == 1 and k > 1:   # too small for the scale: both area-resize the full image
                    assert kg == k
                    continue
                assert kg == kw == k, (path, mode, k)
                assert got.dtype == want.dtype and got.shape == want.shape, (path, mode, k)
                assert got.tobytes() == want.tobytes(), (path, mode, k, exif)
                n += 1
    return n


def test_pixels_equal_pillows_at_every_scale(tmp_path):
    n = sum(_same(p) for p in _cases(tmp_path))
    assert n > 600


def test_real_jpegs_equal_pillows_at_every_scale():
    for name, modes in [("hopper_gray.jpg", ("rgb8", "gray8")), ("pil_sample_cmyk.jpg", ("rgb8", "gray8", "rgba8")),
                        ("hopper_orientation_6.jpg", ("rgb8",)), ("rommel.jpg", ("rgb8",))]:
        p = realdata("images", name)
        assert _same(p, modes) > 0
    cmyk = realdata("images", "pil_sample_cmyk.jpg")
    with Image.open(cmyk) as im:
        assert im.mode == "CMYK"
        want = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(ImageDecoder().read(str(cmyk)), want)
    gray = realdata("images", "hopper_gray.jpg")
    with Image.open(gray) as im:
        assert im.mode == "L"
        want = np.asarray(im)
    np.testing.assert_array_equal(ImageDecoder(ImageDecoder.Params(mode="gray8")).read(str(gray))[..., 0], want)


def test_turbo_scale_rule_matches_the_decoder():
    """turbo_scale_is says when TurboJPEG, asked for ceil(h/k) x ceil(w/k), decodes at exactly 1/k: checked
    against Pillow's draft (libjpeg's scale_denom = k) for every size up to 24 x 24."""
    import simplejpeg

    from precompile.decoders.jpeg_strict import turbo_scale_is

    off = []
    for h in range(1, 25):
        for w in range(1, 25):
            d = jpeg_bytes(photo(h, w, seed=h * 31 + w), quality=95, subsampling=0)
            for k in (2, 4, 8):
                if h < k or w < k:
                    continue
                im = Image.open(io.BytesIO(d))
                im.draft(None, (w // k, h // k))
                want = np.asarray(im)
                got = simplejpeg.decode_jpeg(d, "RGB", min_height=-(-h // k), min_width=-(-w // k))
                if turbo_scale_is(h, w, k):
                    assert got.tobytes() == want.tobytes(), (h, w, k)
                else:
                    off.append((h, w, k))
    assert all(h <= 5 and w <= 5 for h, w, _ in off) and (5, 5, 4) in off


def test_mpo_decodes_its_first_frame(tmp_path):
    p = tmp_path / "two.mpo"
    a, b = photo(40, 56), photo(40, 56, seed=1)
    Image.fromarray(a).save(p, "MPO", save_all=True, append_images=[Image.fromarray(b)], quality=90)
    with Image.open(p) as im:
        assert im.format == "MPO"
    assert _same(p, ("rgb8",)) > 0


def test_image_decoder_version_is_in_the_recipe_key(tmp_path):
    """Shards built before JPEG warnings were errors may hold grey images: the decoder's output_version 2
    enters the recipe key, so they rebuild."""
    from precompile.recipe import load_recipe

    tree = make_image_tree(tmp_path / "data", per_class=1)
    r = load_recipe(write_recipe(tmp_path / "r.yaml", image_recipe(tree)))
    assert r.content_dict()["output_versions"]["decoders.image"] >= 2


def test_jpeg_label_maps_are_strict_too_and_their_decoders_versions_move(tmp_path):
    """The mask and flow_mask decoders read through the same strict JPEG path: a cut label map is an error
    naming the file, and both decoders' output_version 2 enters the recipe key (shards that stored it grey
    rebuild)."""
    from precompile.decoders.flo import FlowMaskDecoder
    from precompile.decoders.mask import MaskDecoder
    from precompile.recipe import parse_recipe

    d = jpeg_bytes(photo(600, 800, c=1)[..., 0], quality=90)
    p = tmp_path / "cut.jpg"
    p.write_bytes(d[:len(d) // 3] + b"\xff\xd9")
    for dec in (MaskDecoder(), FlowMaskDecoder()):
        with pytest.raises(DecodeError, match="premature end of data segment"):
            dec.read(str(p))
    r = parse_recipe({"name": "m", "inputs": {"root": str(tmp_path), "match": "{n}.jpg",
                                              "fields": {"m": {"decoder": "mask"}, "v": {"decoder": "flow_mask"}}},
                      "output": {"format": "hdf5"}}, base_dir=str(tmp_path))
    versions = r.content_dict()["output_versions"]
    assert versions["decoders.m"] == 2 and versions["decoders.v"] == 2   # keyed by field
