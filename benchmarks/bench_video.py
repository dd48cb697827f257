"""Video clips at scale: streamed PyAV decode against the old OpenCV whole-video path, same run.

Generates (once, cached in $TMPDIR/precompile-bench-video) 20-, 60- and
120-second 1280x720 30 fps H.264 files (libx264 through PyAV; moving shapes on
a gradient), then builds 16-frame clips resized to 112x112 and prints, with
medians of --repeats runs, wall time, source frames decoded per second, the
ratio against the baseline and peak RSS per process (VmHWM: the build process
for -j1, the largest loky worker for -j2):

  opencv whole, -j1   the previous decoder: OpenCV reads every frame into one
                      (T, H, W, 3) array, then clips, then resize (a decoder
                      registered by this script with the old code, verbatim);
                      on the 20 s file only: it peaks near 5.5 GB per minute
                      of 720p (the frame list plus its stacked copy)
  streamed, -j1       this package: PyAV frames -> resize each -> clips
  streamed, -j2       two copies of the file, one per loky worker
  streamed, 120 s     the file twice as long: memory should not grow
  pyav decode only    the limit: PyAV decoding every frame, no conversion
  pyav decode + rgb   PyAV decoding and converting every frame to RGB
  opencv decode only  cv2.VideoCapture.read of every frame (BGR)

    python benchmarks/bench_video.py [--repeats 3] [--quick]

``--quick`` uses 5/10/20-second files and one repeat. Each contender runs in a
fresh process (``--child``) so its peak RSS is its own.

``--order`` prints two other tables instead (issue 20), at ``--height`` (720 or
480 lines; the width follows at 16:9):

  step order     peak RSS and wall of ``resize`` then ``clips`` and of ``clips``
                 then ``resize`` (16-frame clips at 112x112), on the 60 s and
                 120 s files, against the whole-video path (streaming turned off,
                 what ``resize`` then ``clips`` did before) on the 20 s file
  seeking        ``max_clips: 4`` clips of 16 frames, one every 30 s of a 120 s
                 file (stride 900; a quarter of the file with --quick), with keyframe seeks and decoding through
                 (``set_seeking(False)``): clips per second and wall
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

W, H, FPS = 1280, 720, 30


def make_video(path: Path, seconds: int) -> None:
    """Moving shapes on a drifting gradient, H.264 (libx264, yuv420p, GOP 250)."""
    import av

    tmp = path.with_suffix(".part.mp4")
    c = av.open(str(tmp), "w")
    s = c.add_stream("libx264", rate=FPS, options={"preset": "veryfast", "crf": "23"})
    s.width, s.height, s.pix_fmt = W, H, "yuv420p"
    yy, xx = np.mgrid[0:H, 0:W]
    base = ((xx + yy) // 8).astype(np.uint8)
    for i in range(seconds * FPS):
        img = np.empty((H, W, 3), np.uint8)
        img[..., 0] = base + np.uint8(i % 256)
        img[..., 1] = base[:, ::-1] - np.uint8((2 * i) % 256)
        img[..., 2] = 128
        for k in range(6):
            x = int((W - 160) * (0.5 + 0.5 * np.sin(i / (20 + 7 * k) + k)))
            y = int((H - 120) * (0.5 + 0.5 * np.cos(i / (30 + 5 * k) + 2 * k)))
            img[y:y + 120, x:x + 160] = (40 * k, 255 - 40 * k, (i * 3) % 256)
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    os.replace(tmp, path)


# -- the previous decoder, verbatim (OpenCV, whole video in memory) ----------------------------------
def register_opencv_whole() -> None:
    from precompile.decoders.base import Decoder, DecoderParams
    from precompile.errors import DecodeError
    from precompile.registry import DECODERS
    from precompile.sample import FieldSpec

    def read_video_cv(path: str, mode: str = "rgb8", max_frames: Optional[int] = None, every: int = 1):
        import cv2

        cap = cv2.VideoCapture(path)
        try:
            if not cap.isOpened():
                raise DecodeError("OpenCV cannot open this file as a video", path=path)
            fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
            claimed = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
            frames = []
            n = 0
            while max_frames is None or len(frames) < max_frames:
                ok, fr = cap.read()
                if not ok or fr is None:
                    break
                if n % every == 0:
                    fr = cv2.cvtColor(fr, cv2.COLOR_BGR2RGB)
                    frames.append(np.ascontiguousarray(fr))
                n += 1
        finally:
            cap.release()
        arr = np.stack(frames)
        return arr, {"fps": fps, "decoded_frames": n, "claimed_frames": claimed, "every": every,
                     "width": int(arr.shape[2]), "height": int(arr.shape[1])}

    if "bench_opencv_video" in DECODERS:
        return

    @DECODERS.register()
    class OpenCVWholeVideo(Decoder):
        name = "bench_opencv_video"
        kind = "video"

        class Params(DecoderParams):
            mode: Literal["rgb8", "gray8"] = "rgb8"
            every: int = Field(1, ge=1)

        def spec(self) -> FieldSpec:
            return FieldSpec("video", (None, None, None, 3), "uint8")

        def read(self, path: str):
            return read_video_cv(path, "rgb8", None, self.params.every)


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
            out.extend(_children(int(d)))
    return out


def child(args: argparse.Namespace) -> None:
    """One contender in this fresh process; prints a JSON line."""
    kind, files, jobs = args.child, args.files.split(","), args.jobs
    frames = 0
    t0 = time.perf_counter()
    if kind in ("streamed", "opencv_whole"):
        import precompile
        from precompile.recipe import parse_recipe

        register_opencv_whole()
        root = Path(tempfile.mkdtemp(prefix="bv-in-", dir=args.work))
        for i, f in enumerate(files):
            os.symlink(f, root / f"v{i}.mp4")
        decoder = "video" if kind == "streamed" else "bench_opencv_video"
        recipe = parse_recipe({"name": "clips", "inputs": {"root": str(root), "match": "{name}.mp4",
                                                           "fields": {"video": {"decoder": decoder}}},
                               "steps": [{"clips": {"length": 16}}, {"resize": {"size": [112, 112]}}],
                               "output": {"format": "hdf5", "samples_per_shard": 1}}, base_dir=str(root))
        out = Path(tempfile.mkdtemp(prefix="bv-out-", dir=args.work))
        t0 = time.perf_counter()
        rep = precompile.build(recipe, out_dir=out, n_jobs=jobs)
        wall = time.perf_counter() - t0
        ds = precompile.open(str(out / "clips.h5"))
        n_clips = len(ds)
        frames = int(args.frames) * len(files)
        assert rep["status"] == "ok", rep
        shutil.rmtree(out)
        shutil.rmtree(root)
        workers = [p for p in _children(os.getpid())]
        peak = max([_vm_hwm(p) for p in workers]) if jobs > 1 and workers else _vm_hwm(os.getpid())
        print(json.dumps({"wall": wall, "frames": frames, "rss": peak, "clips": n_clips}))
        return
    import av

    if kind == "pyav_decode":
        for f in files:
            with av.open(f) as c:
                s = c.streams.video[0]
                s.thread_type = "AUTO"
                for _ in c.decode(s):
                    frames += 1
    elif kind == "pyav_rgb":
        for f in files:
            with av.open(f) as c:
                s = c.streams.video[0]
                s.thread_type = "AUTO"
                for fr in c.decode(s):
                    fr.to_ndarray(format="rgb24")
                    frames += 1
    elif kind == "opencv_decode":
        import cv2

        for f in files:
            cap = cv2.VideoCapture(f)
            while True:
                ok, _ = cap.read()
                if not ok:
                    break
                frames += 1
            cap.release()
    wall = time.perf_counter() - t0
    print(json.dumps({"wall": wall, "frames": frames, "rss": _vm_hwm(os.getpid()), "clips": 0}))


def build_steps(files: list[str], steps: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Build ``steps`` over ``files`` at -j1 in this process (``--whole``: streaming off, every video
    decoded whole; ``--no-seek``: decode through); wall, peak RSS, clips, clips/s."""
    import precompile
    import precompile.transforms.temporal as temporal
    from precompile.decoders.video import set_seeking
    from precompile.recipe import parse_recipe

    if args.whole:
        temporal.stream_plan = lambda decoders, steps: None
    set_seeking(not args.no_seek)
    root = Path(tempfile.mkdtemp(prefix="bv-in-", dir=args.work))
    for i, f in enumerate(files):
        os.symlink(f, root / f"v{i}.mp4")
    recipe = parse_recipe({"name": "clips", "inputs": {"root": str(root), "match": "{name}.mp4",
                                                       "fields": {"video": {"decoder": "video"}}},
                           "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 1}}, base_dir=str(root))
    out = Path(tempfile.mkdtemp(prefix="bv-out-", dir=args.work))
    t0 = time.perf_counter()
    rep = precompile.build(recipe, out_dir=out, n_jobs=1)
    wall = time.perf_counter() - t0
    assert rep["status"] == "ok", rep
    ds = precompile.open(str(out / "clips.h5"))
    n_clips = len(ds)
    rss = _vm_hwm(os.getpid())   # the build's peak, before the check below reads the clips back
    digest = hashlib.sha256()
    for i in range(n_clips):
        digest.update(ds[i]["video"].tobytes())
    shutil.rmtree(out)
    shutil.rmtree(root)
    return {"wall": wall, "frames": 0, "rss": rss, "clips": n_clips, "sha": digest.hexdigest()[:12]}


def run_child(work: Path, kind: str, files: list[Path], jobs: int, frames: int, *extra: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--files", ",".join(map(str, files)),
                          "--jobs", str(jobs), "--frames", str(frames), "--work", str(work), *extra],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--files")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--frames", type=int, default=0)
    ap.add_argument("--work")
    ap.add_argument("--order", action="store_true", help="the step-order and seeking tables (issue 20)")
    ap.add_argument("--height", type=int, default=720, help="with --order: 720 or 480 lines")
    ap.add_argument("--steps")
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--no-seek", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    if args.child == "steps":
        print(json.dumps(build_steps(args.files.split(","), json.loads(args.steps), args)))
        return
    if args.child:
        child(args)
        return
    if args.order:
        order_tables(args)
        return
    base_s, short, long_ = (5, 10, 20) if args.quick else (20, 60, 120)
    repeats = 1 if args.quick else args.repeats
    cache = Path(tempfile.gettempdir()) / "precompile-bench-video"
    cache.mkdir(exist_ok=True)
    files = {}
    for s in (base_s, short, long_):
        files[s] = cache / f"h264_{W}x{H}_{FPS}fps_{s}s.mp4"
        if not files[s].exists():
            t = time.perf_counter()
            make_video(files[s], s)
            print(f"generated {files[s].name} ({files[s].stat().st_size / 1e6:.1f} MB) in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
    nb, n1, n2 = base_s * FPS, short * FPS, long_ * FPS
    # the old path holds the whole video twice (frame list + stack): ~5.5 GB per minute of 720p,
    # so it runs on the shorter file; frames/s is per source frame and compares across lengths
    rows = [  # label, kind, files, jobs, source frames per file
        (f"opencv whole (old), {base_s} s, -j1", "opencv_whole", [files[base_s]], 1, nb),
        (f"streamed, {base_s} s, -j1", "streamed", [files[base_s]], 1, nb),
        (f"streamed, {short} s, -j1", "streamed", [files[short]], 1, n1),
        (f"streamed, 2 x {short} s, -j2", "streamed", [files[short], files[short]], 2, n1),
        (f"streamed, {long_} s, -j1", "streamed", [files[long_]], 1, n2),
        (f"pyav decode only, {short} s", "pyav_decode", [files[short]], 1, n1),
        (f"pyav decode + rgb, {short} s", "pyav_rgb", [files[short]], 1, n1),
        (f"opencv decode only, {short} s", "opencv_decode", [files[short]], 1, n1),
    ]
    work = Path(tempfile.mkdtemp(prefix="precompile-bench-video-work-"))
    results: dict[str, list[dict[str, Any]]] = {r[0]: [] for r in rows}
    try:
        for rep in range(repeats):   # contenders take turns, so load from other jobs spreads over all
            for label, kind, fs, jobs, n in rows:
                results[label].append(run_child(work, kind, [str(f) for f in fs], jobs, n))
                print(f"  run {rep + 1}/{repeats}: {label}: {results[label][-1]['wall']:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(r["frames"] / r["wall"] for r in results[rows[0][0]])
    print(f"\n{W}x{H} {FPS} fps H.264; 16-frame clips resized to 112x112; medians of {repeats}; "
          f"{os.cpu_count()} cores (shared machine)\n")
    print(f"| {'contender':34s} | wall s | frames/s | vs old | peak RSS/process | clips |")
    print(f"|{'-' * 36}|--------|----------|--------|------------------|-------|")
    for label, *_ in rows:
        rs = results[label]
        wall = statistics.median(r["wall"] for r in rs)
        fps = statistics.median(r["frames"] / r["wall"] for r in rs)
        rss = statistics.median(r["rss"] for r in rs) / 2 ** 20
        clips = rs[0]["clips"] or ""
        print(f"| {label:34s} | {wall:6.2f} | {fps:8.0f} | {fps / base:5.2f}x | {rss:12.0f} MiB | {clips!s:>5} |")


def video_file(seconds: int) -> Path:
    """The cached generated file of ``seconds`` at the current W x H."""
    cache = Path(tempfile.gettempdir()) / "precompile-bench-video"
    cache.mkdir(exist_ok=True)
    f = cache / f"h264_{W}x{H}_{FPS}fps_{seconds}s.mp4"
    if not f.exists():
        t = time.perf_counter()
        make_video(f, seconds)
        print(f"generated {f.name} ({f.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.0f} s", flush=True)
    return f


def _median_rows(work: Path, rows: list[tuple], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Run every row ``repeats`` times, taking turns; (label, files, steps, extra flags) per row."""
    results: dict[str, list[dict[str, Any]]] = {r[0]: [] for r in rows}
    for rep in range(repeats):
        for label, fs, steps, extra in rows:
            results[label].append(run_child(work, "steps", fs, 1, 0, "--steps", json.dumps(steps), *extra))
            print(f"  run {rep + 1}/{repeats}: {label}: {results[label][-1]['wall']:.2f} s", flush=True)
    return results


def order_tables(args: argparse.Namespace) -> None:
    """Issue 20: steps before clips stream (peak RSS, wall); keyframe seeks for sparse clips."""
    global W, H
    H = args.height
    W = H * 16 // 9 // 2 * 2   # (even: yuv420p)
    repeats = 1 if args.quick else args.repeats
    short, mid, long_ = (5, 10, 20) if args.quick else (20, 60, 120)
    f = {s: str(video_file(s)) for s in (short, mid, long_)}
    clips, resize = {"clips": {"length": 16}}, {"resize": {"size": [112, 112]}}
    rows = [(f"resize+clips, whole video (before), {short} s", [f[short]], [resize, clips], ["--whole"])]
    for s in (mid, long_):
        rows += [(f"resize+clips, streamed, {s} s", [f[s]], [resize, clips], []),
                 (f"clips+resize, streamed, {s} s", [f[s]], [clips, resize], [])]
    sparse = [resize, {"clips": {"length": 16, "stride": long_ // 4 * FPS, "max_clips": 4}}]
    seek_rows = [(f"max_clips 4, decode through, {long_} s", [f[long_]], sparse, ["--no-seek"]),
                 (f"max_clips 4, keyframe seeks, {long_} s", [f[long_]], sparse, [])]
    work = Path(tempfile.mkdtemp(prefix="precompile-bench-video-work-"))
    try:
        res = _median_rows(work, rows + seek_rows, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{W}x{H} {FPS} fps H.264 (GOP 250); 16-frame clips resized to 112x112; -j1; medians of {repeats}; "
          f"{os.cpu_count()} cores (shared machine)\n")
    print(f"| {'recipe':42s} | wall s | peak RSS | vs whole | clips | output sha256 |")
    print(f"|{'-' * 44}|--------|----------|----------|-------|---------------|")
    base = statistics.median(r["rss"] for r in res[rows[0][0]])
    for label, *_ in rows:
        r = res[label]
        rss = statistics.median(x["rss"] for x in r)
        print(f"| {label:42s} | {statistics.median(x['wall'] for x in r):6.2f} | {rss / 2 ** 20:4.0f} MiB | "
              f"{rss / base:7.3f}x | {r[0]['clips']:5d} | {r[0]['sha']} |")
    print(f"\n| {'sparse clips':42s} | wall s | clips/s | vs through | clips | output sha256 |")
    print(f"|{'-' * 44}|--------|---------|------------|-------|---------------|")
    base = statistics.median(x["clips"] / x["wall"] for x in res[seek_rows[0][0]])
    for label, *_ in seek_rows:
        r = res[label]
        cps = statistics.median(x["clips"] / x["wall"] for x in r)
        print(f"| {label:42s} | {statistics.median(x['wall'] for x in r):6.2f} | {cps:7.2f} | {cps / base:9.2f}x | "
              f"{r[0]['clips']:5d} | {r[0]['sha']} |")


if __name__ == "__main__":
    main()
