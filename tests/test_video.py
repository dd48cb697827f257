"""Video: sequential OpenCV decoding (decoded count, not the header's), clips, per-frame resize."""
from __future__ import annotations

import os

import numpy as np
import pytest

from precompile.decoders.video import VideoDecoder, read_video
from precompile.errors import DecodeError
from precompile.sample import FieldSpec, Sample
from precompile.transforms.kernels import geometry as F
from precompile.transforms.geometry import Resize
from precompile.transforms.temporal import Clips

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "sample_data", "video")


from conftest import realdata_root as realdata  # noqa: E402  (skips when ../shared/realdata is absent)


def _write(path, n, fourcc="MJPG", size=(32, 24)):
    import cv2

    w = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), 10, size)
    for i in range(n):
        fr = np.zeros((size[1], size[0], 3), np.uint8)
        fr[..., 2] = (i * 6) % 256  # red channel (BGR order) encodes the frame number
        fr[..., 1] = 40
        w.write(fr)
    w.release()


def test_decode_frames_in_order_rgb(tmp_path):
    p = str(tmp_path / "ramp.avi")
    _write(p, 30)
    a, meta = read_video(p)
    assert a.shape == (30, 24, 32, 3) and a.dtype == np.uint8
    assert meta["decoded_frames"] == 30 and meta["fps"] == pytest.approx(10)
    red = a[..., 0].mean(axis=(1, 2))
    np.testing.assert_allclose(red, np.arange(30) * 6, atol=3)   # RGB order, frames in order
    assert abs(a[..., 1].mean() - 40) < 3
    g, _ = read_video(p, "gray8")
    assert g.shape == (30, 24, 32, 1)
    k, meta = read_video(p, every=3, max_frames=5)
    assert k.shape[0] == 5 and meta["every"] == 3
    np.testing.assert_allclose(k[..., 0].mean(axis=(1, 2)), np.arange(0, 15, 3) * 6, atol=3)


def test_truncated_file_counts_decoded_frames_not_header(tmp_path):
    import cv2

    p = str(tmp_path / "long.avi")
    _write(p, 60)
    blob = (tmp_path / "long.avi").read_bytes()
    q = str(tmp_path / "cut.avi")
    (tmp_path / "cut.avi").write_bytes(blob[:len(blob) // 2])
    cap = cv2.VideoCapture(q)
    claimed = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    cap.release()
    a, meta = read_video(q)
    assert claimed == 60 and meta["claimed_frames"] == 60
    assert 5 < a.shape[0] < 60 and meta["decoded_frames"] == a.shape[0]
    (tmp_path / "junk.avi").write_bytes(b"\0" * 500)
    with pytest.raises(DecodeError):
        read_video(str(tmp_path / "junk.avi"))
    with pytest.raises(DecodeError):
        read_video(str(tmp_path / "missing.avi"))


def _vid(n, key="v.avi", every=1):
    a = np.zeros((n, 4, 6, 3), np.uint8)
    a[:, 0, 0, 0] = np.arange(n)
    return Sample(key, {"video": a}, {"video": "video"}, {"video": {"fps": 25.0, "every": every}})


def test_clips_indices_stride_every_and_short_policy():
    rng = np.random.default_rng(0)
    c = Clips(Clips.Params(length=3, every=2, stride=4, index_field="frames"))
    out = c.run(_vid(12), rng)
    assert [o.key for o in out] == ["v.avi#clip0", "v.avi#clip1"]   # spans 0-4, 4-8; 8-12 does not fit
    assert [o.fields["frames"].tolist() for o in out] == [[0, 2, 4], [4, 6, 8]]
    assert [o.fields["video"][:, 0, 0, 0].tolist() for o in out] == [[0, 2, 4], [4, 6, 8]]
    assert out[1].meta["clip"] == {"index": 1, "frames": [4, 6, 8], "fps": 25.0}
    assert out[0].kinds["frames"] == "index" and out[0].fields["frames"].dtype == np.int32
    # decode-time every=3 maps positions back to source frame numbers
    out = c.run(_vid(12, every=3), rng)
    assert out[0].fields["frames"].tolist() == [0, 6, 12]
    # short videos: dropped, or padded with the last frame / black frames
    assert Clips(Clips.Params(length=8)).run(_vid(5), rng) == []
    (o,) = Clips(Clips.Params(length=8, short="pad", index_field="i")).run(_vid(5), rng)
    assert o.fields["i"].tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
    (o,) = Clips(Clips.Params(length=4, every=2, short="pad", pad="zero", index_field="i")).run(_vid(5), rng)
    assert o.fields["i"].tolist() == [0, 2, 4, -1] and not o.fields["video"][3].any()
    # declared specs
    specs = c.plan({"video": FieldSpec("video", (None, None, None, 3), "uint8")})
    assert specs["video"].shape == (3, None, None, 3) and specs["frames"] == FieldSpec("index", (3,), "int32")
    assert len(Clips(Clips.Params(length=2, max_clips=2)).run(_vid(20), rng)) == 2


def test_resize_applies_to_every_frame_alike():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 255, (5, 24, 32, 3), dtype=np.uint8)
    s = Sample("v", {"video": a}, {"video": "video"})
    (o,) = Resize(Resize.Params(size=[12, 20])).run(s, rng)
    assert o.fields["video"].shape == (5, 12, 20, 3)
    for t in range(5):
        np.testing.assert_array_equal(o.fields["video"][t], F.resize_hwc(a[t], 12, 20))


def test_real_video():
    p = os.path.join(realdata(), "video", "realshort.mp4")
    if not os.path.exists(p):
        pytest.skip("realshort.mp4 absent")
    a, meta = VideoDecoder().read(p)
    assert a.shape == (36, 240, 320, 3) and a.dtype == np.uint8
    assert meta["decoded_frames"] == 36 and meta["fps"] == pytest.approx(30.02, abs=0.05)
    assert a.std() > 10 and np.abs(np.diff(a.astype(np.int16), axis=0)).mean() > 0.5   # real, moving content
    out = Clips(Clips.Params(length=8, every=2, stride=5)).run(Sample("r", {"video": a}, {"video": "video"}, {"video": meta}),
                                                                np.random.default_rng(0))
    assert len(out) == 5 and out[-1].meta["clip"]["frames"] == list(range(20, 36, 2))   # starts 0..20 by 5


def test_recipe_builds(tmp_path):
    import precompile
    from precompile.build import build

    build(os.path.join(REPO, "recipes", "video.yaml"), out_dir=str(tmp_path))
    ds = precompile.open(str(tmp_path / "video.h5"))
    # squares: 40 frames, span 15, stride 8 -> starts 0, 8, 16, 24; balls 30 -> 0, 8; tiny 6 -> padded
    assert ds.keys == ["balls.mp4#clip0", "balls.mp4#clip1"] + [f"squares.avi#clip{i}" for i in range(4)] \
        + ["tiny.avi#clip0"]
    s = ds[ds.keys.index("squares.avi#clip3")]
    assert s["video"].shape == (8, 32, 32, 3) and s["frames"].tolist() == list(range(24, 40, 2))
    assert ds[len(ds) - 1]["frames"].tolist() == [0, 2, 4, 5, 5, 5, 5, 5]
