"""Plain JPEGs decoded without opening them in Pillow (issue 33: Pillow's Python marker parser cost ~0.1 ms a
file, a tenth of a reduced decode): the header read by ``image._plain_jpeg`` (markers, one EXIF block's
orientation, libjpeg-turbo's size and colour space), everything else exactly as through Pillow.

Truth: the Pillow path of the same decoder (forced by making ``_plain_jpeg`` decline), which the other image
tests hold to Pillow's own pixels; the same arrays byte for byte, the same scale, the same meta, the same
error messages.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import PIL
from PIL import Image, ImageOps

from precompile.decoders import image as I
from precompile.errors import DecodeError
from precompile.recipe import parse_recipe

from test_jpeg_reduce import photo


def _save(path, arr, orientation=None, xmp=None, **kw):
    img = Image.fromarray(arr) if arr.ndim == 2 or arr.shape[2] != 4 else Image.fromarray(arr, "CMYK")
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    img.save(path, "JPEG", quality=90, **kw)
    if xmp is not None:   # an APP1 XMP segment after SOI, by hand (Pillow's save(xmp=) is 11.0's; the floor is 10.3)
        with open(path, "rb") as f:
            data = f.read()
        body = b"http://ns.adobe.com/xap/1.0/\x00" + xmp
        with open(path, "wb") as f:
            f.write(data[:2] + b"\xff\xe1" + (len(body) + 2).to_bytes(2, "big") + body + data[2:])
    return str(path)


def _need(tmp_path, steps):
    r = parse_recipe({"name": "p", "inputs": {"root": str(tmp_path), "match": "{n}.jpg",
                                               "fields": {"image": {"decoder": "image"}}}, "steps": steps},
                     base_dir=str(tmp_path))
    return r.decoders["image"].need


def _both(monkeypatch, path, *args):
    """(array, k, info) through the plain path and through Pillow's."""
    out = []
    for plain in (True, False):
        info: dict = {}
        with monkeypatch.context() as m:
            if not plain:
                m.setattr(I, "_plain_jpeg", lambda data: None)
            a, k = I.decode_image_scaled(path, *args[:3], info=info) if len(args) >= 3 else \
                I.decode_image_scaled(path, *args, info=info)
        out.append((a, k, info))
    return out


FILES = {
    "rgb420": lambda p: _save(p, photo(301, 403, 1)),
    "rgb444": lambda p: _save(p, photo(120, 97, 2), subsampling=0),
    "progressive": lambda p: _save(p, photo(211, 157, 3), progressive=True),
    "gray": lambda p: _save(p, photo(133, 171, 4)[..., 0]),
    "cmyk": lambda p: _save(p, np.concatenate([photo(99, 75, 5), photo(99, 75, 6)[..., :1]], axis=2)),
    "orient6": lambda p: _save(p, photo(150, 202, 7), orientation=6),
    "orient3": lambda p: _save(p, photo(150, 202, 8), orientation=3),
    "orient1": lambda p: _save(p, photo(64, 80, 9), orientation=1),
    "xmp": lambda p: _save(p, photo(90, 70, 10), xmp=b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/>'
                                                       b'</x:xmpmeta>'),
    "tiny": lambda p: _save(p, photo(5, 3, 11)),
}


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("mode", ["rgb8", "gray8", "rgba8", "gray16"])
def test_the_plain_path_gives_pillows_paths_bytes_scale_and_meta(tmp_path, monkeypatch, name, mode):
    path = FILES[name](tmp_path / f"{name}.jpg")
    needs = [None, 2, 4, _need(tmp_path, [{"resize": {"size": [24, 24]}}]),
             _need(tmp_path, [{"random_resized_crop": {"size": 16, "scale": [0.5, 1.0]}}])]
    for reduce in needs:
        for turn in (True, False):
            (a, k, info), (b, kb, info_b) = _both(monkeypatch, path, mode, turn, reduce)
            assert (k, info) == (kb, info_b), (reduce, turn)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (reduce, turn)


def test_a_plain_jpeg_is_not_opened_in_pillow(tmp_path, monkeypatch):
    path = FILES["orient6"](tmp_path / "o.jpg")
    want = I.decode_image_scaled(path, "rgb8", True, 2)[0]

    def refuse(*a, **kw):
        raise AssertionError("Pillow opened the file")

    monkeypatch.setattr(Image, "open", refuse)
    info = {}
    a, k = I.decode_image_scaled(path, "rgb8", True, 2, info=info)
    assert k == 2 and a.tobytes() == want.tobytes() and info == {"orientation": 6, "source_size": [150, 202]}


@pytest.mark.parametrize("name", ["xmp", "tiny"])
def test_what_the_plain_path_declines_goes_through_pillow(tmp_path, monkeypatch, name):
    path = FILES[name](tmp_path / f"{name}.jpg")
    with open(path, "rb") as f:
        data = f.read()
    hdr = I._plain_jpeg(data)
    if name == "xmp":   # Pillow reads an orientation from XMP too: the plain path leaves such files to it
        assert hdr is None
        # Pillow decides: 11+ reads the XMP orientation and turns the image (70 x 90 stored 90 x 70); 10.3 (the
        # floor) reads no XMP here and leaves it; the decode and its meta follow whichever Pillow did
        with Image.open(path) as im:
            want = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
        got = I.decode_image_scaled(path, "rgb8", True, None, info=(info := {}))[0]
        assert got.shape == want.shape and got.tobytes() == want.tobytes()
        assert info == ({"orientation": 6} if want.shape == (70, 90, 3) else {})
        if int(PIL.__version__.split(".")[0]) >= 11:
            assert want.shape == (70, 90, 3)
    else:
        assert hdr is not None and hdr.size == (3, 5)
        assert I.decode_image_scaled(path, "rgb8", True, 4)[1] == 4   # at 1/4 through Pillow (TurboJPEG cannot)


def test_headers_the_plain_path_reads(tmp_path):
    path = FILES["orient6"](tmp_path / "o.jpg")
    with open(path, "rb") as f:
        data = f.read()
    hdr = I._plain_jpeg(data)
    with Image.open(path) as im:
        assert (hdr.size, hdr.mode, hdr.getexif()[0x0112]) == (im.size, im.mode, im.getexif()[0x0112])
    assert I._plain_jpeg(data[:40]) is None                      # cut inside the header
    assert I._plain_jpeg(b"\x89PNG\r\n\x1a\n" + data[8:]) is None   # not a JPEG
    buf = io.BytesIO()
    Image.fromarray(photo(20, 20, 1)).save(buf, "PNG")
    assert I._plain_jpeg(buf.getvalue()) is None


def test_errors_are_the_pillow_paths(tmp_path, monkeypatch):
    """A file cut in its scans: the strict decode's error, whichever path read the header; a file over the
    budget: refused before it is read."""
    path = FILES["rgb420"](tmp_path / "c.jpg")
    with open(path, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(data[:len(data) // 2])
    msgs = []
    for plain in (True, False):
        with monkeypatch.context() as m:
            if not plain:
                m.setattr(I, "_plain_jpeg", lambda d: None)
            with pytest.raises(DecodeError) as e:
                I.decode_image_scaled(str(cut), "rgb8", True, 2)
            msgs.append(str(e.value))
            with pytest.raises(DecodeError) as e:
                I.decode_image_scaled(path, "rgb8", True, None, budget=len(data) - 1)
            msgs.append(str(e.value))
    assert msgs[:2] == msgs[2:], msgs
    assert "truncated or corrupt JPEG data" in msgs[0] and "(limits.input_bytes)" in msgs[1], msgs
