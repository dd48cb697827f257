"""After clips and any random video step, a stored sample's frames, index field, clip meta and
audio describe the same source frames (issue 27: ``temporal_jitter`` left the index field and the
audio describing the clip before it).

The test video carries its own truth: frame ``i`` shows ``i`` in binary bars, and its PCM audio
track holds sample ``n``'s own number (mod 20000), so every check reads the bytes, not the meta.
"""
from __future__ import annotations

import os
import sys
from fractions import Fraction

import numpy as np
import pytest

import precompile
from precompile.kinds import Kind
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.transforms.temporal import TemporalJitter

sys.path.insert(0, os.path.dirname(__file__))
from conftest import write_recipe  # noqa: E402
from test_video import _bars, _number  # noqa: E402  (the numbered-frame helpers)

load_builtins()
RATE, FPS, WRAP = 16000, 25, 20000
PER_FRAME = RATE // FPS


def write_numbered(path, n: int) -> str:
    """An MKV: ``n`` H.264 frames showing their number, and a PCM s16 track whose sample ``k`` is
    ``k % WRAP - WRAP // 2`` (read back exactly: the decoder gives value / 32768)."""
    import av

    c = av.open(str(path), "w")
    v = c.add_stream("libx264", rate=FPS)
    v.width, v.height, v.pix_fmt = 64, 48, "yuv420p"
    a = c.add_stream("pcm_s16le", rate=RATE)
    a.layout = "mono"
    for i in range(n):
        for p in v.encode(av.VideoFrame.from_ndarray(_bars(i, (64, 48)), format="rgb24")):
            c.mux(p)
    for p in v.encode():
        c.mux(p)
    k = np.arange(int((n / FPS) * RATE))
    x = (k % WRAP - WRAP // 2).astype(np.int16)[None]
    for s in range(0, x.shape[1], 1024):
        fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, s:s + 1024]), format="s16", layout="mono")
        fr.sample_rate, fr.pts = RATE, s
        for p in a.encode(fr):
            c.mux(p)
    for p in a.encode():
        c.mux(p)
    c.close()
    return str(path)


# params for every random step that changes video fields (the test below fails when one is missing)
RANDOM_VIDEO_STEPS = {
    "temporal_jitter": {"length": 4, "strides": [2], "jitter": 0},
    "color_jitter": {"brightness": 0.3},
    "gaussian_noise": {"std": 3, "fields": ["video"]},   # (it would noise the audio too)
    "random_affine": {"degrees": 10},
    "random_crop": {"size": [40, 56]},
    "random_flip": {},
    "random_resized_crop": {"size": [32, 32]},
}


def test_every_random_video_step_is_covered():
    have = {n for n, c in STEPS.items() if c.__module__.startswith("precompile.") and c.random
            and Kind.VIDEO in c.applies}
    assert have == set(RANDOM_VIDEO_STEPS)


def build(tmp_path, clips: dict, steps: list[dict]) -> precompile.Dataset:
    root = tmp_path / "in"
    root.mkdir(exist_ok=True)
    write_numbered(root / "a.mkv", 60)
    recipe = {"name": "v", "seed": 5, "copies": 3,
              "inputs": {"root": str(root), "match": "{name}.mkv",
                         "fields": {"video": {"decoder": "video", "audio_field": "sound"}}},
              "steps": [{"clips": {**clips, "index_field": "idx"}}, *steps],
              "output": {"format": "hdf5"}}
    precompile.build(write_recipe(tmp_path / "r.yaml", recipe), out_dir=str(tmp_path / "o"))
    return precompile.open(str(tmp_path / "o" / "v.h5"))


def check_sample(s: dict, meta: dict, every: int, numbered: bool) -> None:
    """Index field == clip meta frames; frames show those numbers; the audio holds exactly the
    samples from the first kept frame's time to the end of the last kept frame."""
    idx = s["idx"].tolist()
    clip = meta["clip"]
    assert clip["frames"] == idx
    assert len(s["video"]) == len(idx)
    assert clip["pts"] == pytest.approx([i / FPS for i in idx], abs=1e-6)
    if numbered:
        assert [_number(f) for f in s["video"]] == idx
    first, n = clip["audio"]["first_sample"], clip["audio"]["samples"]
    assert first == idx[0] * PER_FRAME
    assert n == (idx[-1] - idx[0] + every) * PER_FRAME
    got = np.rint(s["sound"][0] * 32768).astype(np.int64) + WRAP // 2
    assert got.shape == (n,)
    np.testing.assert_array_equal(got, (first + np.arange(n)) % WRAP)


@pytest.mark.parametrize("name", sorted(RANDOM_VIDEO_STEPS))
def test_random_video_step_keeps_index_meta_audio_and_frames_together(tmp_path, name):
    ds = build(tmp_path, {"length": 10, "stride": 10}, [{name: RANDOM_VIDEO_STEPS[name]}])
    assert len(ds) == 6 * 4
    lengths = set()
    for i in range(len(ds)):
        s, m = ds[i], ds.meta(i)
        check_sample(s, m, 1, numbered=name in ("temporal_jitter", "gaussian_noise"))
        lengths.add(len(s["idx"]))
    assert lengths == ({4} if name == "temporal_jitter" else {10})


def test_issue_example_jitter_after_clips(tmp_path):
    """clips length 10 stride 10, temporal_jitter length 4 strides [2]: the original copy keeps
    source frames 1, 3, 5, 7 of the first clip (the centred span); its index field and audio agree."""
    ds = build(tmp_path, {"length": 10, "stride": 10}, [{"temporal_jitter": {"length": 4, "strides": [2]}}])
    i = next(i for i in range(len(ds)) if ds.key(i).endswith("#clip0") and int(ds.copies[i]) == 0)
    s, m = ds[i], ds.meta(i)
    assert s["idx"].tolist() == [1, 3, 5, 7] and m["augment"][-1]["indices"] == [1, 3, 5, 7]
    assert m["clip"]["audio"]["samples"] == 7 * PER_FRAME   # frames 1..7 whole, not the 10-frame clip
    check_sample(s, m, 1, numbered=True)


def test_jitter_with_offsets_and_clip_every(tmp_path):
    """Jitter offsets and clips taking every 2nd frame: the audio spans the kept slots whole."""
    ds = build(tmp_path, {"length": 8, "every": 2, "stride": 16},
               [{"temporal_jitter": {"length": 3, "strides": [1, 2], "jitter": 1}}, {"color_jitter": {"brightness": 0.1}}])
    assert len(ds) == 3 * 4
    for i in range(len(ds)):
        check_sample(ds[i], ds.meta(i), 2, numbered=True)


def test_jitter_on_a_whole_video_moves_pts_and_audio():
    """Without clips: the decoder's pts list and audio track follow the kept frames."""
    T = 12
    video = np.stack([_bars(i, (64, 48)) for i in range(T)])
    audio = ((np.arange(T * PER_FRAME) % WRAP) - WRAP // 2).astype(np.float32)[None] / 32768
    meta = {"video": {"fps": float(FPS), "every": 1, "pts": [i / FPS for i in range(T)],
                      "audio": {"field": "sound", "sample_rate": RATE, "start": 0.0, "frames": T * PER_FRAME}}}
    s = Sample("w", {"video": video, "sound": audio}, {"video": "video", "sound": "audio"}, meta=meta)
    tj = TemporalJitter(TemporalJitter.Params(length=3, strides=[3]))
    out = tj.replay(s, {"indices": [2, 5, 8]})
    assert [_number(f) for f in out.fields["video"]] == [2, 5, 8]
    assert out.meta["video"]["pts"] == [2 / FPS, 5 / FPS, 8 / FPS]
    got = np.rint(out.fields["sound"][0] * 32768).astype(np.int64) + WRAP // 2
    np.testing.assert_array_equal(got, np.arange(2 * PER_FRAME, 9 * PER_FRAME))
    assert out.meta["video"]["audio"]["start"] == pytest.approx(float(Fraction(2, FPS)))


# -- temporal_jitter after clips cut by time, the decoder fixing the audio rate (fuzzer finding N4) ---------------------
def build_timed(tmp_path, clips: dict, jitter: dict) -> precompile.Dataset:
    root = tmp_path / "in"
    root.mkdir(exist_ok=True)
    write_numbered(root / "a.mkv", 60)
    recipe = {"name": "v", "seed": 5, "copies": 3,
              "inputs": {"root": str(root), "match": "{name}.mkv",
                         "fields": {"video": {"decoder": "video", "audio_field": "sound", "audio_rate": RATE}}},
              "steps": [{"clips": {**clips, "index_field": "idx"}}, {"temporal_jitter": jitter}],
              "output": {"format": "hdf5"}}
    precompile.build(write_recipe(tmp_path / "r.yaml", recipe), out_dir=str(tmp_path / "o"))
    return precompile.open(str(tmp_path / "o" / "v.h5"))


def check_timed(s: dict, meta: dict, fps: float, stride_s: float) -> tuple[int, int]:
    """The kept clip slots j0 .. jL (the jitter's recorded indices) play from ``start + j0 / fps`` to
    ``start + (jL + 1) / fps``: the audio holds the track's samples of that time, to the sample; its values
    (each sample holds its own number) say where it was cut from. Returns (slot span, samples)."""
    clip, slots = meta["clip"], meta["augment"][-1]["indices"]
    start = clip["index"] * stride_s
    idx = s["idx"].tolist()
    assert clip["start"] == pytest.approx(idx[0] / FPS, abs=1e-9)   # (the first kept frame's pts)
    assert [_number(f) for f in s["video"]] == idx == clip["frames"]
    assert idx == [int(Fraction(repr(start)) * FPS + Fraction(j) * FPS / Fraction(repr(fps))) for j in slots]
    first, n = clip["audio"]["first_sample"], clip["audio"]["samples"]
    assert abs(first - (start + slots[0] / fps) * RATE) <= 1
    assert abs(first + n - (start + (slots[-1] + 1) / fps) * RATE) <= 1
    got = np.rint(s["sound"][0] * 32768).astype(np.int64) + WRAP // 2
    assert got.shape == (n,)
    np.testing.assert_array_equal(got, (first + np.arange(n)) % WRAP)
    return slots[-1] - slots[0] + 1, n


def test_jitter_after_time_clips_with_a_fixed_audio_rate_keeps_the_kept_frames_audio(tmp_path):
    """The fuzzer's case: time clips of 2 frames at 12.5 fps hold 0.16 s of audio (2,560 samples, declared
    fixed); temporal_jitter with strides [1, 2] and jitter 1 keeps 1 or 2 of their slots, so the audio of the
    kept frames is 1,280 or 2,560 samples: the field is declared variable in length (the write stage failed
    the input: 'shape (1, 1280) differs from the declared (1, 2560)')."""
    ds = build_timed(tmp_path, {"fps": 12.5, "length": 2, "stride_s": 0.5, "max_clips": 3},
                     {"length": 2, "strides": [1, 2], "jitter": 1})
    assert len(ds) == 3 * 4   # (the original and 3 copies of each clip)
    assert ds.field_specs["sound"]["shape"] == [1, None]
    spans = {check_timed(ds[i], ds.meta(i), 12.5, 0.5) for i in range(len(ds))}
    assert spans == {(1, 1280), (2, 2560)}


def test_jitter_after_time_clips_with_one_span_keeps_a_fixed_audio_length(tmp_path):
    """Clips of 3 frames at 7 fps hold round(3 / 7 * 16000) = 6,857 samples, 2,285.67 per frame; a jitter of
    one frame keeps one slot: always round(6857 / 3) = 2,286 samples, wherever the slot (it was 2,286, 2,285 or
    2,286 by slot, against a declared 6,857), so the field is declared (1, 2286) and the Loader batches it."""
    ds = build_timed(tmp_path, {"fps": 7, "length": 3, "stride_s": 0.5, "max_clips": 4},
                     {"length": 1, "strides": [1, 3]})
    assert len(ds) == 4 * 4
    assert ds.field_specs["sound"]["shape"] == [1, 2286]
    got = {check_timed(ds[i], ds.meta(i), 7, 0.5) for i in range(len(ds))}
    assert got == {(1, 2286)}
    assert len({ds.meta(i)["augment"][-1]["indices"][0] for i in range(len(ds))}) > 1   # slots drawn apart
    batch = next(iter(precompile.Loader(str(tmp_path / "o" / "v.h5"), batch_size=4, fields=["sound"])))
    assert tuple(batch["sound"].shape) == (4, 1, 2286)
