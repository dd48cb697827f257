"""The image decoder on generated and real awkward files (EXIF, palette, CMYK, 16-bit, truncated)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from precompile.decoders.image import decode_image_file
from precompile.errors import DecodeError

from conftest import REPO, realdata

SAMPLE = REPO / "sample_data" / "images"


def test_exif_orientation_6_jpeg_is_turned_upright():
    p = realdata("images", "hopper_orientation_6.jpg")
    raw = decode_image_file(str(p), "rgb8", exif_transpose=False)
    up = decode_image_file(str(p), "rgb8")
    np.testing.assert_array_equal(up, np.rot90(raw, k=-1))  # orientation 6: turn 90 deg clockwise


def test_png_exif_chunk_orientation_3():
    p = realdata("images", "exif_imagemagick_orientation.png")
    raw = decode_image_file(str(p), "rgb8", exif_transpose=False)
    np.testing.assert_array_equal(decode_image_file(str(p), "rgb8"), raw[::-1, ::-1])


def test_large_camera_photo_with_orientation():
    p = realdata("images", "rommel.jpg")
    a = decode_image_file(str(p), "gray8")
    assert a.shape == (3072, 2304, 1) and a.dtype == np.uint8  # stored 3072 wide, shown portrait


def test_cmyk_matches_pillow_conversion():
    p = realdata("images", "pil_sample_cmyk.jpg")
    with Image.open(p) as im:
        assert im.mode == "CMYK"
        want = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(decode_image_file(str(p), "rgb8"), want)


def test_palette_with_transparency_to_rgb_and_gray():
    p = realdata("images", "pil123p.png")
    rgb = decode_image_file(str(p), "rgb8")
    gray = decode_image_file(str(p), "gray8")
    assert rgb.shape == (150, 162, 3) and gray.shape == (150, 162, 1)
    with Image.open(p) as im:
        np.testing.assert_array_equal(rgb, np.asarray(im.convert("RGBA").convert("RGB")))


def test_16bit_depth_keeps_16_bits():
    p = realdata("images", "TUM_depth.png")
    d = decode_image_file(str(p), "gray16")
    with Image.open(p) as im:
        raw = np.asarray(im)
    assert d.dtype == np.uint16 and d.shape == raw.shape + (1,)
    np.testing.assert_array_equal(d[..., 0], raw.astype(np.uint16))
    assert (d == 0).any()  # missing depth stays 0
    np.testing.assert_array_equal(decode_image_file(str(p), "gray8")[..., 0], (raw.astype(np.uint16) >> 8).astype(np.uint8))


@pytest.mark.parametrize("name", ["truncated_image.png", "truncated_jpeg.jpg"])
def test_truncated_files_are_errors_naming_the_file(name):
    p = realdata("images", name)
    with pytest.raises(DecodeError) as ei:
        decode_image_file(str(p), "rgb8")
    assert str(p) in str(ei.value) and "truncated" in str(ei.value) and ei.value.stage == "decode"


def test_not_an_image_and_missing_file(tmp_path):
    p = tmp_path / "x.jpg"
    p.write_bytes(b"hello, not a jpeg")
    with pytest.raises(DecodeError, match="not an image"):
        decode_image_file(str(p))
    with pytest.raises(DecodeError, match="file not found"):
        decode_image_file(str(tmp_path / "nope.png"))


def test_sample_data_awkward_cases():
    exif = SAMPLE / "beach" / "beach_00_exif6.jpg"
    with Image.open(exif) as im:
        assert im.getexif().get(0x0112) == 6 and im.size == (96, 128)  # stored rotated: 96 wide
    assert decode_image_file(str(exif)).shape == (96, 128, 3)  # shown landscape
    g16 = decode_image_file(str(SAMPLE / "night" / "night_00_gray16.png"), "gray16")
    assert g16.dtype == np.uint16 and g16.max() > 255
    pal = decode_image_file(str(SAMPLE / "forest" / "forest_01_palette.png"), "rgb8")
    assert pal.shape == (96, 128, 3)
    gray = decode_image_file(str(SAMPLE / "forest" / "forest_00_gray.jpg"), "rgb8")
    assert (gray[..., 0] == gray[..., 1]).all()


def test_mode_conversions_agree_with_pillow(tmp_path):
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(arr).save(tmp_path / "a.png")
    from precompile.transforms.kernels.colour import convert_mode

    gray = decode_image_file(str(tmp_path / "a.png"), "gray8")
    np.testing.assert_array_equal(gray[..., 0], np.asarray(Image.fromarray(arr).convert("L")))
    np.testing.assert_array_equal(convert_mode(arr, "gray8"), gray)
    np.testing.assert_array_equal(convert_mode(gray, "gray16")[..., 0], gray[..., 0].astype(np.uint16) * 257)
    np.testing.assert_array_equal(convert_mode(convert_mode(gray, "gray16"), "gray8"), gray)


def test_32_bit_integer_images_are_kept_or_refused_never_guessed(tmp_path):
    """Pillow opens a TIFF of 32-bit integers, and a 16-bit PGM, as mode I. Every mode I image was taken as 16-bit
    grey: a TIFF holding 5..242 came out black in rgb8 (its top byte of 16 bits), and values outside 0..65535 were
    clipped without a word in gray16. A 16-bit PGM (big-endian, maxval 65535) keeps that rule: its top byte, or its
    values in gray16; a 32-bit TIFF keeps its values in gray16 where they fit and is refused otherwise."""
    small = (np.arange(12, dtype=np.int32).reshape(3, 4) * 20 + 5)
    Image.fromarray(small).save(tmp_path / "small.tif")
    with Image.open(tmp_path / "small.tif") as im:
        assert im.mode == "I"
    with pytest.raises(DecodeError, match=r"a 32-bit integer image \(TIFF, values 5..225\) has no known range to "
                                          r"scale to 8 bits: use mode gray16"):
        decode_image_file(str(tmp_path / "small.tif"), "rgb8")
    assert np.array_equal(decode_image_file(str(tmp_path / "small.tif"), "gray16")[..., 0], small)
    Image.fromarray(small - 100).save(tmp_path / "neg.tif")
    with pytest.raises(DecodeError, match=r"a 32-bit integer image with values -95..125, which 16 bits cannot hold"):
        decode_image_file(str(tmp_path / "neg.tif"), "gray16")
    pgm = (np.arange(12).reshape(3, 4) * 5000).astype(">u2")
    (tmp_path / "g.pgm").write_bytes(b"P5\n4 3\n65535\n" + pgm.tobytes())
    with Image.open(tmp_path / "g.pgm") as im:
        assert im.mode == "I"
    assert np.array_equal(decode_image_file(str(tmp_path / "g.pgm"), "gray16")[..., 0], pgm.astype(np.uint16))
    assert np.array_equal(decode_image_file(str(tmp_path / "g.pgm"), "gray8")[..., 0], (pgm >> 8).astype(np.uint8))
