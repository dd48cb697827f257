"""Hostile inputs (issue 24): files whose headers declare far more than they hold, or more than the
per-input memory budget (``limits.input_bytes``), fail only that input, with a message naming the file,
the declared size and the budget, before the memory is taken (peak memory measured in a subprocess)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import precompile
from precompile.decoders.audio import AudioDecoder
from precompile.decoders.dicom import DicomDecoder
from precompile.decoders.image import ImageDecoder
from precompile.decoders.video import VideoDecoder
from precompile.errors import DecodeError

from conftest import image_recipe, make_image_tree, write_recipe

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _peak_mb(code: str) -> tuple[float, str]:
    """Run ``code`` (after the imports) in a fresh interpreter; (peak RSS growth in MB, what it printed)."""
    script = ("import resource, sys\nfrom precompile.decoders import image, audio, dicom, video\n"
              "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n" + code +
              "\nprint('PEAK', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    peak = float(out.stdout.split("PEAK")[-1])
    return peak, out.stdout


def _catch(call: str) -> str:
    return (f"try:\n    {call}\n    print('NO ERROR')\n"
            f"except Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n")


def jpeg_bomb(path: Path, side: int = 9000) -> Path:
    """A 64x64 JPEG whose frame header is patched to declare side x side."""
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(b, "JPEG")
    d = bytearray(b.getvalue())
    i = d.find(b"\xff\xc0")
    d[i + 5:i + 9] = side.to_bytes(2, "big") * 2
    path.write_bytes(bytes(d))
    return path


def png_header(path: Path, w: int, h: int, rows_of_zeros: bool = True) -> Path:
    """A valid RGB PNG of w x h black pixels (the zlib stream is made row by row: small on disk)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    z = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * w)
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


def flac_claiming(path: Path, total: int) -> Path:
    """A 1000-sample stereo FLAC whose STREAMINFO claims ``total`` samples."""
    import soundfile as sf

    b = io.BytesIO()
    sf.write(b, np.full((1000, 2), 0.25, np.float32), 16000, format="FLAC", subtype="PCM_16")
    d = bytearray(b.getvalue())
    v = int.from_bytes(d[18:26], "big") & ~((1 << 36) - 1) | total
    d[18:26] = v.to_bytes(8, "big")
    path.write_bytes(bytes(d))
    return path


def h264(path: Path, side: int, frames: int) -> Path:
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=25)
        s.width = s.height = side
        s.pix_fmt = "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "51"}
        for _ in range(frames):
            for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def dicom_rle(path: Path, side: int) -> Path:
    """A 64x64 RLE-compressed DICOM whose header is patched to declare side x side."""
    import pydicom
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, RLELossless

    ds = pydicom.Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = "1.2.3.4.1"
    ds.SOPClassUID, ds.SeriesInstanceUID, ds.Modality = CTImageStorage, "1.2.3.4", "CT"
    ds.Rows = ds.Columns = 64
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated = ds.BitsStored = 16
    ds.HighBit, ds.PixelRepresentation = 15, 0
    ds.PixelData = np.arange(64 * 64, dtype="<u2").tobytes()
    ds.compress(RLELossless)
    ds.Rows = ds.Columns = side
    ds.save_as(path, enforce_file_format=True)
    return path


# -- each hostile file: a per-input DecodeError naming the file, the declared size and the budget ------------

def test_jpeg_header_larger_than_its_scan_is_an_error_not_a_grey_image(tmp_path):
    """A 64x64 JPEG whose header declares 9000x9000: over the default budget it is refused before decoding;
    within a larger one libjpeg-turbo's warning on the scan's early end is the error (issue 32.9: the
    hand-written one-bit-per-block bound this replaced is gone)."""
    p = jpeg_bomb(tmp_path / "bomb.jpg")
    with pytest.raises(DecodeError) as e:
        ImageDecoder().read(str(p))
    n = 9000 * 9000 * (4 + 4 + 6) + p.stat().st_size
    assert str(e.value) == (f"{p}, stage decode: declares 9000x9000 pixels (RGB): decoding it needs {n} bytes "
                            f"(1.1 GiB), over the per-input budget of 1073741824 bytes (1.0 GiB) (limits.input_bytes)")
    dec = ImageDecoder()
    dec.max_bytes = 2 * GiB
    with pytest.raises(DecodeError) as e:
        dec.read(str(p))
    assert str(e.value) == (f"{p}, stage decode: truncated or corrupt JPEG data "
                            f"(libjpeg-turbo: Corrupt JPEG data: premature end of data segment)")
    from PIL import ImageFile
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_sound_jpegs_decode_strictly():
    """Baseline, progressive, every subsampling, flat and noisy, optimised tables: no libjpeg warning, and
    Pillow's pixels."""
    from precompile.decoders.jpeg_strict import decode_jpeg_strict

    rng = np.random.default_rng(3)
    n = 0
    for shape in [(37, 91, 3), (1, 1, 3), (200, 120, 3), (64, 48)]:
        for prog in (False, True):
            for sub in (0, 1, 2):
                for flat in (True, False):
                    a = np.zeros(shape, np.uint8) if flat else rng.integers(0, 255, shape, dtype=np.uint8)
                    b = io.BytesIO()
                    Image.fromarray(a).save(b, "JPEG", quality=1 if flat else 90, progressive=prog,
                                            subsampling=sub, optimize=True)
                    with Image.open(b) as im:
                        want = np.asarray(im)
                        got = decode_jpeg_strict(b.getvalue(), im.size[1], im.size[0], im.mode, 1, "x.jpg")
                    assert got.reshape(want.shape).tobytes() == want.tobytes()
                    n += 1
    assert n == 48


def test_png_at_pillows_pixel_limit_refused_in_bounded_memory(tmp_path):
    side = int(Image.MAX_IMAGE_PIXELS ** 0.5)   # 9459 x 9459: just under the limit, Pillow would decode it
    p = png_header(tmp_path / "limit.png", side, side)
    assert p.stat().st_size < 1_000_000
    peak, out = _peak_mb(_catch(f"image.ImageDecoder().read({str(p)!r})"))
    n = side * side * (4 + 4 + 6)
    assert (f"DecodeError: {p}, stage decode: declares {side}x{side} pixels (RGB): decoding it needs {n} bytes "
            f"(1.2 GiB), over the per-input budget of 1073741824 bytes (1.0 GiB) (limits.input_bytes)") in out
    assert peak < 100, f"peak memory grew {peak:.0f} MB"


def test_image_budget_is_the_recipe_option(tmp_path):
    p = png_header(tmp_path / "a.png", 600, 400)
    dec = ImageDecoder()
    assert dec.read(str(p)).shape == (400, 600, 3)
    dec.max_bytes = 600 * 400 * 13   # one byte a pixel short of what it needs
    with pytest.raises(DecodeError, match=r"declares 600x400 pixels \(RGB\): decoding it needs 3360000 bytes "
                                          r"\(3.2 MiB\), over the per-input budget of 3120000 bytes"):
        dec.read(str(p))


def test_dicom_rle_declaring_20000_squared_refused_in_bounded_memory(tmp_path):
    p = dicom_rle(tmp_path / "big.dcm", 20000)
    peak, out = _peak_mb(_catch(f"dicom.DicomDecoder().read({str(p)!r})"))
    assert (f"DecodeError: {p}, stage decode: declares 1x20000x20000 pixels: decoding it needs 4000000000 bytes "
            f"(3.7 GiB), over the per-input budget of 1073741824 bytes (1.0 GiB) (limits.input_bytes)") in out
    assert peak < 100, f"peak memory grew {peak:.0f} MB"
    ok = dicom_rle(tmp_path / "ok.dcm", 64)
    assert DicomDecoder().read(str(ok))[0].shape == (1, 64, 64)


def test_flac_claiming_2_36_samples_refused_in_bounded_memory(tmp_path):
    p = flac_claiming(tmp_path / "big.flac", (1 << 36) - 1)
    peak, out = _peak_mb(_catch(f"audio.AudioDecoder().read({str(p)!r})"))
    assert (f"DecodeError: {p}, stage decode: declares 68719476735 samples x 2 channels: decoding it needs "
            f"1649267441640 bytes (1.5 TiB), over the per-input budget of 1073741824 bytes (1.0 GiB)") in out
    assert peak < 100, f"peak memory grew {peak:.0f} MB"
    ok = flac_claiming(tmp_path / "ok.flac", 1000)
    x, meta = AudioDecoder().read(str(ok))
    assert x.shape == (1, 1000) and np.allclose(x, 0.25, atol=1e-4)


def test_audio_budget_counts_the_resampled_length(tmp_path):
    import soundfile as sf

    p = tmp_path / "a.wav"
    sf.write(p, np.zeros((8000, 1), np.float32), 8000, subtype="FLOAT")
    dec = AudioDecoder(AudioDecoder.Params(sample_rate=8_000_000))   # 1000x longer once resampled
    dec.max_bytes = 16 << 20
    with pytest.raises(DecodeError, match=r"declares 8000 samples x 1 channels: decoding it needs 32064000 bytes"):
        dec.read(str(p))
    assert AudioDecoder(AudioDecoder.Params(sample_rate=16000)).read(str(p))[0].shape == (1, 16000)


def test_h264_of_4096_squared_frames_stops_within_the_budget(tmp_path):
    p = h264(tmp_path / "big.mp4", 4096, 12)
    assert p.stat().st_size < 100_000
    peak, out = _peak_mb(_catch(f"video.VideoDecoder().read({str(p)!r})"))
    assert (f"DecodeError: {p}, stage decode: declares more than 10 frames of 4096x4096: decoding it needs "
            f"1107296256 bytes (1.0 GiB), over the per-input budget of 1073741824 bytes (1.0 GiB)") in out
    assert peak < 1400, f"peak memory grew {peak:.0f} MB"


def test_video_frame_over_budget_refused_before_decoding(tmp_path):
    p = h264(tmp_path / "v.mp4", 256, 3)
    dec = VideoDecoder()
    arr, meta = dec.read(str(p))
    assert arr.shape == (3, 256, 256, 3)
    dec.max_bytes = 2 * 256 * 256 * 3 * 2   # two frames fit, the third does not
    with pytest.raises(DecodeError, match="declares more than 2 frames of 256x256"):
        dec.read(str(p))
    dec.max_bytes = 256 * 256 * 6 - 1
    with pytest.raises(DecodeError, match=r"declares 256x256 frames: decoding it needs 393216 bytes"):
        dec.read(str(p))


# -- in a build: only the hostile input is lost ---------------------------------------------------------------

def test_build_loses_only_the_hostile_inputs(tmp_path):
    tree = make_image_tree(tmp_path / "data")
    jpeg_bomb(tree / "cat" / "000.jpg")
    png_header(tree / "dog" / "001.png", 3000, 2000)
    r = image_recipe(tree, on_error="skip", limits={"input_bytes": 64 << 20})
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    fails = {Path(f["path"]).relative_to(tree).as_posix(): f["message"] for f in rep["failures"]}
    assert set(fails) == {"cat/000.jpg", "dog/001.png"}
    # decoded at 1/8 (reduce: auto before the resize), within the budget: libjpeg's warning is the error
    assert fails["cat/000.jpg"].endswith("truncated or corrupt JPEG data (libjpeg-turbo: Corrupt JPEG data: "
                                         "premature end of data segment)")
    assert "declares 3000x2000 pixels (RGB): decoding it needs 84000000 bytes" in fails["dog/001.png"]
    assert "over the per-input budget of 67108864 bytes (64.0 MiB) (limits.input_bytes)" in fails["dog/001.png"]
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    assert len(ds) == 8 and "cat/000.jpg" not in ds.keys


def test_limits_validated_and_default_keeps_hashes(tmp_path):
    tree = make_image_tree(tmp_path / "data", per_class=1)
    from precompile.errors import RecipeError
    from precompile.recipe import load_recipe

    with pytest.raises(RecipeError, match="limits.input_bytes"):
        load_recipe(write_recipe(tmp_path / "a.yaml", image_recipe(tree, limits={"input_bytes": 10})))
    a = load_recipe(write_recipe(tmp_path / "b.yaml", image_recipe(tree)))
    b = load_recipe(write_recipe(tmp_path / "c.yaml", image_recipe(tree, limits={"input_bytes": 1 << 20})))
    assert "limits" not in a.resolved() and b.resolved()["limits"]["input_bytes"] == 1 << 20
    assert a.content_hash() == b.content_hash()
    assert all(d.max_bytes == 1 << 20 for d in b.decoders.values())


# -- bounds before work: sizes and counts have maxima, the plan refuses an oversized sample ---------------------

@pytest.mark.parametrize("over, loc, msg", [
    ({"steps": [{"resize": {"size": [10 ** 9, 10 ** 9]}}]}, "steps[0].resize.size",
     "size 1000000000 is over the maximum side of 32768 pixels"),
    ({"steps": [{"resize": {"shorter": 10 ** 9}}]}, "steps[0].resize.shorter",
     "Input should be less than or equal to 32768"),
    ({"copies": 10 ** 9}, "copies", "Input should be less than or equal to 10000"),
])
def test_absurd_sizes_and_counts_refused_by_validate(tmp_path, over, loc, msg):
    from precompile.errors import RecipeError
    from precompile.recipe import load_recipe

    tree = make_image_tree(tmp_path / "data", per_class=1)
    with pytest.raises(RecipeError) as e:
        load_recipe(write_recipe(tmp_path / "r.yaml", image_recipe(tree, **over)))
    assert loc in str(e.value) and msg in str(e.value)


def test_plan_refuses_a_sample_over_the_budget_with_the_number(tmp_path):
    from precompile.errors import PlanError

    tree = make_image_tree(tmp_path / "data", per_class=1)
    r = image_recipe(tree, steps=[{"resize": {"size": [30000, 30000]}}])  # + an int64 label
    with pytest.raises(PlanError) as e:
        precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    assert ("one sample would take 2700000008 bytes (2.5 GiB) (image: (30000, 30000, 3) uint8), over the "
            "per-sample budget of 1073741824 bytes (1.0 GiB) (limits.sample_bytes)") in str(e.value)
    assert not (tmp_path / "out" / "imgs.h5").exists()
    r["limits"] = {"sample_bytes": 4 << 30}
    from precompile.recipe import load_recipe
    from precompile.compiler.plan import make_plan
    assert make_plan(load_recipe(write_recipe(tmp_path / "r2.yaml", r))).sample_bytes() == 2700000008
