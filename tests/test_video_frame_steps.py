"""Per-frame steps stream in every case (issue 32.10): a whole video with a per-frame ``resize`` and no
``clips`` is decoded frame by frame through the resize, and only the resized frames are held, so the
per-input budget counts what is held (the output), not the source.

OpenCV's sample vtest.avi (795 frames of 768x576, MPEG-4 in AVI) with ``resize: {size: [48, 64]}`` was
refused by the default 1 GiB budget (its frames take 1.05 GB, held twice) though its output is 7.3 MB.
The tests keep that argument at a size that builds in a second: MPEG-4 AVIs of 40-60 frames of 192x144
(3.3-5 MB of frames, held twice) under ``limits.input_bytes`` of 4 MiB, resized to 48x64 (0.4-0.55 MB)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

import precompile
import precompile.transforms.temporal as temporal

sys.path.insert(0, os.path.dirname(__file__))
from test_video import _bars, _dump, _number, _recipe, _video_tree, _write_av  # noqa: E402

from conftest import realdata  # noqa: E402

pytest.importorskip("av")

BUDGET = 4 << 20
RESIZE = {"resize": {"size": [48, 64]}}


def vtest_like(path: Path, n: int = 60, size: tuple[int, int] = (192, 144)) -> str:
    """vtest.avi's container and codec (MPEG-4 part 2 in AVI) at a smaller size; frame i shows i."""
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height = size
        s.pix_fmt = "yuv420p"
        s.options = {"qscale": "3"}
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(_bars(i, size), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def _avi_recipe(tmp_path, root, steps, **over):
    r = {"inputs": {"root": str(root), "match": "{name}.avi", "fields": {"video": {"decoder": "video"}}}}
    r.update(over)
    return _recipe(tmp_path, root, steps, **r)


def _whole_path(monkeypatch):
    """Decode each video whole and run every step on it: the path before issue 32.10."""
    monkeypatch.setattr(temporal, "stream_plan", lambda decoders, steps: None)
    monkeypatch.setattr(temporal, "frame_steps_plan", lambda decoders, steps: None)


def test_whole_video_resize_streams_within_a_budget_its_source_exceeds(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    for name in ("a", "b"):
        vtest_like(root / f"{name}.avi", 40)
    recipe = _avi_recipe(tmp_path, root, [RESIZE], limits={"input_bytes": BUDGET})
    rep = precompile.build(recipe, out_dir=tmp_path / "j1", n_jobs=1)
    assert rep["failures"] == []
    r = precompile.load_recipe(recipe)
    plan = temporal.frame_steps_plan(r.decoders, r.steps)
    assert plan is not None and plan.field == "video" and [i for i, _ in plan.pre] == [0] and plan.first == 1
    ds = precompile.open(str(tmp_path / "j1" / "v.h5"))
    assert len(ds) == 2 and ds[0]["video"].shape == (40, 48, 64, 3)
    meta = ds.meta(0)["video"]
    assert meta["width"] == 192 and meta["height"] == 144 and meta["decoded_frames"] == 40
    assert meta["pts"] == pytest.approx([i / 10 for i in range(40)])
    assert [_number(f) for f in ds[0]["video"]] == list(range(40))   # the frames, in order, after the resize
    precompile.build(recipe, out_dir=tmp_path / "j2", n_jobs=2)
    got = _dump(tmp_path / "j1" / "v.h5")
    assert _dump(tmp_path / "j2" / "v.h5") == got
    # the old path: whole decode, then the resize; it needs the default budget for these sources
    _whole_path(monkeypatch)
    from precompile.errors import BuildError

    with pytest.raises(BuildError, match=r"every input failed \(2 skipped\).*a\.avi, stage decode, field 'video': "
                                         r"declares more than 25 frames of 192x144: .* over the per-input budget of "
                                         r"4194304 bytes"):
        precompile.build(recipe, out_dir=tmp_path / "refused", n_jobs=1, on_error="skip")
    precompile.build(_avi_recipe(tmp_path, root, [RESIZE]), out_dir=tmp_path / "whole", n_jobs=1)
    assert _dump(tmp_path / "whole" / "v.h5") == got


def test_the_budget_counts_the_frames_held_after_the_steps(tmp_path):
    """One source frame in flight (FFmpeg's picture and the RGB array) plus the resized frames, held twice
    (the list, then the stacked array): refused at the first frame past the budget."""
    from precompile.errors import DecodeError
    from precompile.transforms.geometry import Resize

    root = tmp_path / "in"
    root.mkdir()
    p = vtest_like(root / "a.avi")
    dec = precompile.load_recipe(_avi_recipe(tmp_path, root, [RESIZE])).decoders["video"]
    src, frame = 192 * 144 * (3 + 3), 48 * 64 * 3
    dec.max_bytes = src + 2 * 20 * frame
    step = Resize(Resize.Params(size=[48, 64]))

    def apply(f):
        return step.apply(f[None], "video")[0]

    with pytest.raises(DecodeError) as e:
        dec.read_through(p, "video", apply)
    n = src + 2 * 21 * frame
    assert str(e.value) == (f"{p}, stage decode: declares more than 20 frames of 64x48 after the per-frame steps: "
                            f"decoding it needs {n} bytes ({n / 1024:.1f} KiB), over the per-input budget of "
                            f"{dec.max_bytes} bytes ({dec.max_bytes / 1024:.1f} KiB) (limits.input_bytes)")
    dec.max_bytes = src + 2 * 60 * frame
    arrays, meta = dec.read_through(p, "video", apply)
    assert arrays["video"].shape == (60, 48, 64, 3) and len(meta["pts"]) == 60


def test_audio_and_every_options_describe_the_stored_frames(tmp_path, monkeypatch):
    """A video with an audio track (audio_field), ``every: 2``, then center_crop and convert on each frame:
    the same samples as the whole path, meta (pts, audio) included, at -j1 and -j2."""
    root = _video_tree(tmp_path / "in")
    field = {"decoder": "video", "every": 2, "audio_field": "sound", "audio_rate": 8000, "audio_missing": "silence"}
    steps = [{"resize": {"shorter": 24}}, {"center_crop": {"size": [16, 16]}}, {"convert": {"mode": "gray8"}},
             {"random_flip": {}}]
    recipe = _recipe(tmp_path, root, steps, field, copies=2)
    r = precompile.load_recipe(recipe)
    plan = temporal.frame_steps_plan(r.decoders, r.steps)
    assert [s.name for _, s in plan.pre] == ["resize", "center_crop", "convert"] and plan.first == 3
    precompile.build(recipe, out_dir=tmp_path / "j1", n_jobs=1)
    precompile.build(recipe, out_dir=tmp_path / "j2", n_jobs=2)
    got = _dump(tmp_path / "j1" / "v.h5")
    assert len(got) == 9 and _dump(tmp_path / "j2" / "v.h5") == got
    key, meta, arrays = next(g for g in got if g[0] == "a.mp4")
    assert arrays["video"][1] == (38, 16, 16, 1) and len(meta["video"]["pts"]) == 38
    assert meta["video"]["pts"][:3] == pytest.approx([0, 0.08, 0.16]) and meta["video"]["audio"]["field"] == "sound"
    _whole_path(monkeypatch)
    precompile.build(recipe, out_dir=tmp_path / "whole", n_jobs=1)
    assert _dump(tmp_path / "whole" / "v.h5") == got


def test_steps_before_a_random_step_before_clips_stream_too(tmp_path, monkeypatch):
    """resize, random_flip, clips: the random step keeps one draw per video, so the clips cannot
    stream; the resize before it still runs on each frame as it is decoded."""
    root = _video_tree(tmp_path / "in", audio=False)
    steps = [RESIZE, {"random_flip": {}}, {"clips": {"length": 4, "stride": 6}}]
    recipe = _recipe(tmp_path, root, steps, copies=2)
    r = precompile.load_recipe(recipe)
    assert temporal.stream_plan(r.decoders, r.steps) is None
    assert temporal.frame_steps_plan(r.decoders, r.steps).first == 1
    precompile.build(recipe, out_dir=tmp_path / "s", n_jobs=1)
    got = _dump(tmp_path / "s" / "v.h5")
    _whole_path(monkeypatch)
    precompile.build(recipe, out_dir=tmp_path / "whole", n_jobs=1)
    assert len(got) > 10 and _dump(tmp_path / "whole" / "v.h5") == got


def test_isolated_decoding_streams_the_steps_too(tmp_path, monkeypatch):
    """timeout_s decodes in a helper process: it runs the per-frame steps there, within the budget."""
    root = tmp_path / "in"
    root.mkdir()
    vtest_like(root / "a.avi")
    recipe = _avi_recipe(tmp_path, root, [RESIZE], limits={"input_bytes": BUDGET})
    rep = precompile.build(recipe, out_dir=tmp_path / "iso", timeout_s=60)
    assert rep["failures"] == []
    precompile.build(recipe, out_dir=tmp_path / "inline")
    assert _dump(tmp_path / "iso" / "v.h5") == _dump(tmp_path / "inline" / "v.h5")


def test_real_video(tmp_path, monkeypatch):
    src = realdata("video", "realshort.mp4")
    root = tmp_path / "in"
    root.mkdir()
    shutil.copyfile(src, root / "real.mp4")   # a copy: a link out of the root is refused (inputs.follow_links)
    # 36 frames of 320x240: 8.3 MB of frames, held twice; 2 MiB holds the resized video and one source frame
    recipe = _recipe(tmp_path, root, [{"resize": {"shorter": 32}}], limits={"input_bytes": 2 << 20})
    rep = precompile.build(recipe, out_dir=tmp_path / "s", n_jobs=1)
    assert rep["failures"] == []
    got = _dump(tmp_path / "s" / "v.h5")
    (_, meta, arrays), = got
    assert arrays["video"][1] == (36, 32, 43, 3) and len(meta["video"]["pts"]) == 36
    _whole_path(monkeypatch)
    precompile.build(_recipe(tmp_path, root, [{"resize": {"shorter": 32}}]), out_dir=tmp_path / "whole", n_jobs=1)
    assert _dump(tmp_path / "whole" / "v.h5") == got


def test_a_failing_per_frame_step_names_the_input_and_step_as_the_whole_path(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "big.mp4", 6, size=(128, 96))
    _write_av(root / "small.mp4", 6)
    recipe = _recipe(tmp_path, root, [{"center_crop": {"size": [80, 80]}}], on_error="skip")
    reports = [precompile.build(recipe, out_dir=tmp_path / "s", n_jobs=1)]
    _whole_path(monkeypatch)
    reports.append(precompile.build(recipe, out_dir=tmp_path / "w", n_jobs=1))
    fails = [[(f["path"], f["stage"], f["field"], f["message"]) for f in r["failures"]] for r in reports]
    assert fails[0] == fails[1]
    ((path, stage, field, _),) = fails[0]
    assert path == str(root / "small.mp4") and stage == "steps[0] center_crop" and field == "video"


@pytest.mark.parametrize("steps, image, pre, first", [
    ([RESIZE], False, [0], 1),
    ([RESIZE, {"center_crop": {"size": [32, 32]}}, {"random_flip": {}}, {"convert": {"mode": "gray8"}}], False,
     [0, 1], 2),
    ([{"random_flip": {}}, RESIZE], False, None, None),
    ([{"clips": {"length": 4}}, RESIZE], False, None, None),
    ([RESIZE], True, None, None),   # the resize changes the image field too: not the video alone
    ([{"resize": {"size": [48, 64], "fields": ["video"]}}, {"resize": {"size": [8, 8], "fields": ["still"]}},
      {"resize": {"size": [4, 4], "fields": ["video"]}}], True, [0], 1),
])
def test_which_leading_steps_run_on_each_frame(tmp_path, steps, image, pre, first):
    """Only the leading per-frame steps that change the video field alone; the first other step ends them."""
    fields = {"video": {"decoder": "video"}}
    if image:
        fields["still"] = {"decoder": "image", "path": "{name}.png"}
    r = precompile.load_recipe(_recipe(tmp_path, tmp_path, steps, inputs={
        "root": str(tmp_path), "match": "{name}.mp4", "fields": fields}))
    plan = temporal.frame_steps_plan(r.decoders, r.steps)
    if pre is None:
        assert plan is None
    else:
        assert [i for i, _ in plan.pre] == pre and plan.first == first and plan.field == "video"
