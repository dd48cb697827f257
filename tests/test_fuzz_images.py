"""Decoders fuzzed with hypothesis: random, truncated and bit-flipped bytes raise only precompile errors.

The image decoder is fuzzed from real PNG/JPEG files (the shared real-data
folder) and freshly encoded PNG/JPEG/BMP/GIF bytes. Decoders for other kinds
(flow, audio, DICOM, video) are fuzzed the same way from their real files.
"""
from __future__ import annotations

import io
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import realdata, realdata_files, realdata_root
from precompile.decoders.image import decode_image_file
from precompile.errors import InputError, PrecompileError
from precompile.registry import DECODERS, load_builtins

MAGIC = [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0", b"BM", b"GIF89a", b"II*\x00", b"RIFF\x00\x00\x00\x00WEBP"]


def _encoded() -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8))
    out = []
    for fmt, kw in (("PNG", {}), ("JPEG", {"quality": 80}), ("BMP", {}), ("GIF", {}),
                    ("PNG", {"bits": 4}), ("JPEG", {"progressive": True})):
        b = io.BytesIO()
        (img.convert("P") if fmt == "GIF" or kw.get("bits") else img).save(b, fmt, **{k: v for k, v in kw.items() if k != "bits"})
        out.append(b.getvalue())
    return out


def _real(patterns: list[str], max_bytes: int = 400_000) -> list[bytes]:
    return [p.read_bytes() for p in realdata_files(*patterns, max_bytes=max_bytes)]


SEEDS = _encoded() + _real(["images/*.png", "images/*.jpg"])


@pytest.fixture
def small_bomb_limit(monkeypatch):
    """A flipped size byte may claim a huge image; keep Pillow's bomb guard at 4 Mpixel so examples stay fast."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1 << 22)


def _check_image(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "x.img")
        with open(p, "wb") as f:
            f.write(data)
        for mode in ("rgb8", "gray16"):
            try:
                a = decode_image_file(p, mode)
            except InputError as e:
                assert e.path == p and e.stage == "decode" and str(e)
            else:
                assert a.ndim == 3 and a.shape[2] in (1, 3) and a.flags.c_contiguous


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@FUZZ
@given(st.sampled_from(MAGIC), st.binary(max_size=3000))
def test_image_random_bytes(small_bomb_limit, magic, body):
    _check_image(magic + body)


@FUZZ
@given(st.sampled_from(range(len(SEEDS))), st.floats(0, 1))
def test_image_truncated(small_bomb_limit, i, frac):
    data = SEEDS[i]
    _check_image(data[:int(len(data) * frac)])


@FUZZ
@given(st.sampled_from(range(len(SEEDS))), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1,
                                                   max_size=8))
def test_image_corrupted_bytes(small_bomb_limit, i, edits):
    data = bytearray(SEEDS[i])
    for pos, val in edits:
        data[min(len(data) - 1, int(pos * len(data)))] = val
    _check_image(bytes(data))


def test_real_truncated_files_are_decode_errors():
    for name in ("truncated_image.png", "truncated_jpeg.jpg"):
        p = str(realdata("images", name))
        with pytest.raises(InputError, match="truncated|corrupt|broken"):
            decode_image_file(p)


# other decoders: name -> real files to seed from
OTHER = {"flo": ["flow/**/*.flo"], "audio": ["audio/*.flac", "audio/*.ogg"],
         "dicom": ["dicom/**/*.dcm", "dicom/**/*"], "video": ["video/*.mp4"]}


@pytest.mark.parametrize("name", sorted(OTHER))
def test_other_decoders_raise_only_precompile_errors(name):
    load_builtins()
    assert name in DECODERS, f"decoder {name!r} is not registered"
    root = realdata_root()
    seeds = _real(OTHER[name], max_bytes=2_000_000)[:3]
    if not seeds:
        pytest.skip(f"no real {name} files under {root}")
    dcls = DECODERS.get(name)
    dec = dcls()
    rng = np.random.default_rng(0)
    cases = [bytes(rng.integers(0, 256, 500, dtype=np.uint8))]
    for s in seeds:
        cases += [s[:n] for n in (0, 10, 100, len(s) // 3, len(s) - 1)]
        flipped = bytearray(s)
        for pos in rng.integers(0, len(s), 6):
            flipped[pos] ^= 0xFF
        cases.append(bytes(flipped))
    with tempfile.TemporaryDirectory() as d:
        for k, data in enumerate(cases):
            target = os.path.join(d, f"c{k}")
            p = target
            if dcls.reads_dirs:
                os.makedirs(target)
                p = os.path.join(target, "x.dcm")
            else:
                target += os.path.splitext(OTHER[name][0])[1]
                p = target
            with open(p, "wb") as f:
                f.write(data)
            try:
                dec.decode(target, "f")
            except PrecompileError:
                pass


def test_interlaced_palette_png_cut_in_half_is_a_decode_error(tmp_path):
    """Found by test_image_truncated: Pillow's PNG decoder setup raises TypeError ("function takes at most 3
    arguments") on the real interlaced palette PNG cut in half; it is the input's DecodeError, not a crash."""
    data = realdata("images", "pil123p.png").read_bytes()
    p = tmp_path / "cut.png"
    p.write_bytes(data[:len(data) // 2])
    with pytest.raises(InputError, match=r"damaged image data \(TypeError"):
        decode_image_file(str(p), "rgb8")
