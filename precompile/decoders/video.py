"""Video decoding through PyAV (FFmpeg in the wheel): frames in presentation order, (T, H, W, C) uint8.

Frames are counted as they come out of the decoder, from the first packet on:
frame ``i`` is the ``i``-th decoded frame, never a position derived from the
container's frame count (some files claim hundreds of frames more than they
hold) or from an imprecise seek. The claim is only recorded in the metadata.
Each frame's presentation time (seconds, from its pts and the stream's time
base) is recorded too, so variable-frame-rate files can be cut by time.

Two ways to read a file:

- :func:`read_video` decodes the whole video into one array (what the
  ``video`` decoder's ``read`` returns when no ``clips`` step follows), or,
  for ``read_through``, the array after a recipe's leading per-frame steps,
  run on each frame as it is decoded (only their output is held);
- :func:`iter_frames` yields frames one at a time and converts only those a
  caller asks for, which is how the engine streams a video through
  ``clips`` (and a following ``resize``) holding at most the frames of the
  clips being cut (:mod:`precompile.transforms.temporal`).

Both share one frame loop, so the frames, their order and their bytes are the
same either way. A streamed read may also skip ahead: its consumer says which
frame it needs next and the read seeks to the keyframe before it when that is
past the next frame to decode (:class:`Seeker`; frame indices then come from a
:class:`PacketIndex` and are checked frame by frame, so they stay exact). RGB frames come from swscale (``rgb24``;
other pixel formats, e.g. of more than 8 bits per component, and odd sizes as OpenCV converts them, ``bgr24``
with bicubic filtering: :func:`_rgb`); on the project's sample files, the real H.264 test file and 10/16-bit,
4:1:1, 4:1:0 and odd-sized files they equal OpenCV's BGR->RGB frames byte for byte. Gray frames are OpenCV's RGB->gray of those.

The optional audio track (``audio_field``) is decoded whole, mixed to mono if
asked and resampled with soxr exactly as the ``audio`` decoder does; its meta
(rate, start time relative to the first video frame) lets ``clips`` cut the
span of each clip.

Frames are turned (and mirrored) as the container's display matrix says, as a
player shows them: a phone's portrait video is stored landscape with a 90 degree
matrix (``rotate: false`` keeps them as stored). The matrix applied is in the
meta, ``display_matrix`` (a, b, c, d: x' = a x + c y, y' = b x + d y).

Metadata: fps (the stream's average rate), the decoded and claimed frame
counts, width, height (of the frames stored), ``every``, ``pts`` (seconds per kept frame, the first at
seconds from the stream's start time), codec, and ``decode_errors`` (packets the
codec rejected and skipped; FFmpeg conceals what it can).
"""
from __future__ import annotations

import bisect
import math
from fractions import Fraction
from typing import Any, Callable, Iterator, Literal, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..errors import DecodeError
from ..registry import DECODERS
from ..sample import FieldSpec, exact_time
from .base import Decoder, DecoderParams, check_budget

_THREADS = {"count": 0}   # slice threads (0: FFmpeg's choice); workers set 1 (parallelism is across shards)


_SEEK = {"on": True}      # keyframe seeks while streaming sparse clips (Seeker)


def set_seeking(on: bool) -> None:
    """Seek to keyframes past frames no clip needs while streaming (on by default). Off decodes
    through every frame; the frames given are the same either way (benchmarks and tests compare)."""
    _SEEK["on"] = bool(on)


def set_decode_threads(n: int) -> None:
    """Codec (slice) threads per open video (0: FFmpeg's choice). The engine sets 1 in ``-j``
    workers. It changes the speed only, never the frames (:func:`_decoding`)."""
    _THREADS["count"] = max(0, int(n))


def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - av is a hard dependency
        from ..errors import MissingDependencyError

        raise MissingDependencyError("video decoding needs PyAV: pip install av") from e
    return av


def _open(path: str):
    av = _av()
    try:
        container = av.open(path, mode="r")
    except FileNotFoundError:
        raise DecodeError("file not found", path=path) from None
    except (av.error.FFmpegError, OSError, ValueError, UnicodeDecodeError) as e:
        raise DecodeError(f"cannot open as a video: {e}", path=path) from None
    if not container.streams.video:
        kinds = ", ".join(s.type for s in container.streams) or "none"
        container.close()
        raise DecodeError(f"has no video stream (streams: {kinds})", path=path)
    return container


def _seconds(pts: Optional[int], time_base: Optional[Fraction]) -> Optional[float]:
    if pts is None or time_base is None:
        return None
    return float(pts * time_base)


def display_matrix(frame: Any) -> Optional[tuple[int, int, int, int]]:
    """The frame's display matrix (DISPLAYMATRIX side data: a phone video's rotation, maybe a mirror) as the
    integers (a, b, c, d) of ``x' = a x + c y``, ``y' = b x + d y`` (pixel coordinates, y down), or None when it
    has none or it is the identity. A rotation other than a multiple of 90 degrees is a ValueError."""
    side = frame.side_data
    if not len(side):
        return None
    for d in side:
        if getattr(d.type, "name", "") != "DISPLAYMATRIX":
            continue
        raw = np.frombuffer(bytes(d), np.int32)
        if raw.size < 9:
            return None
        m = raw[[0, 1, 3, 4]].astype(np.float64) / 65536.0
        scale = np.hypot(m[0], m[1]) or 1.0
        q = np.rint(m / scale)
        if np.abs(m / scale - q).max() > 1e-3 or abs(q[0] * q[3] - q[1] * q[2]) != 1 or q[0] * q[1] or q[2] * q[3]:
            raise ValueError(f"its display matrix {[round(float(x), 4) for x in m]} turns frames by an angle that is "
                             f"not a multiple of 90 degrees; set rotate: false to read the frames as stored")
        a, b, c, dd = (int(x) for x in q)
        return None if (a, b, c, dd) == (1, 0, 0, 1) else (a, b, c, dd)
    return None


def apply_display(arr: np.ndarray, m: tuple[int, int, int, int]) -> np.ndarray:
    """``arr`` (H, W, C) as a player shows it under the display matrix ``m`` (:func:`display_matrix`):
    the pixel at (x, y) goes to ``(a x + c y, b x + d y)``, shifted so the frame starts at (0, 0)."""
    a, b, c, d = m
    h, w = arr.shape[:2]
    swap = a == 0
    oh, ow = (w, h) if swap else (h, w)
    # each output (x', y') takes the source (x, y) = A^T (x' - ox, y' - oy): A is orthogonal
    ox = min(0, a * (w - 1)) + min(0, c * (h - 1))
    oy = min(0, b * (w - 1)) + min(0, d * (h - 1))
    ys, xs = np.mgrid[0:oh, 0:ow]
    xs, ys = xs + ox, ys + oy
    sx, sy = a * xs + b * ys, c * xs + d * ys
    return np.ascontiguousarray(arr[sy, sx])


# pixel formats whose swscale rgb24 conversion gave OpenCV's bytes at even sizes (tests/test_video_truth_outside.py)
_RGB24_AS_OPENCV = frozenset({"yuv420p", "yuvj420p", "yuv422p", "yuvj422p", "yuv444p", "yuvj444p", "yuva420p",
                              "rgb24", "rgba", "bgr0", "gray"})


def _rgb(frame: Any) -> np.ndarray:
    """The frame as (H, W, 3) uint8 RGB as OpenCV converts it: swscale's bgr24 with bicubic filtering, channels
    flipped. Frames of an even width and height in the formats of ``_RGB24_AS_OPENCV`` take swscale's rgb24 (the
    same bytes, without the bicubic pass and the channel flip). Others differ there: rgb24 darkened frames
    of more than 8 bits per component by about 1% (a 10- or 16-bit grey 255 came out 253, 128 as 126) and was up to
    22 levels from OpenCV at colour edges; 4:1:1 (DV) and 4:1:0 frames, and 4:2:0 / 4:2:2 frames of an odd height,
    came out up to 21 and 25 levels from OpenCV's, further from the source."""
    if frame.format.name in _RGB24_AS_OPENCV and frame.width % 2 == 0 and frame.height % 2 == 0:
        return frame.to_ndarray(format="rgb24")
    bgr = frame.reformat(format="bgr24", interpolation="BICUBIC").to_ndarray()
    return np.ascontiguousarray(bgr[..., ::-1])


def _convert(frame: Any, mode: str, rotate: bool = True) -> np.ndarray:
    rgb = _rgb(frame)
    if rotate:
        m = display_matrix(frame)
        if m is not None:
            rgb = apply_display(rgb, m)
    if mode == "gray8":
        import cv2

        return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)[..., None]
    return rgb


def video_info(container: Any) -> dict[str, Any]:
    s = container.streams.video[0]
    rate = s.average_rate or s.guessed_rate or s.base_rate
    return {"fps": float(rate) if rate else 0.0, "claimed_frames": int(s.frames or 0),
            "codec": s.codec_context.name}


def _decoding(container: Any) -> Any:
    """The video stream, set to decode the same way in any process.

    - Slice threads only. Frame threading (FFmpeg's choice in a process with threads to spare,
      i.e. a ``-j1`` build's parent, while ``-j`` workers ran one thread) handles a damaged
      packet differently: on a cut H.264 file it dropped the frames in flight with the error and
      reported none, so the frames stored depended on the worker count. Slice threading decodes
      exactly what one thread does.
    - ``err_detect: explode``: a frame the codec finds damaged is rejected (a decode error)
      instead of returned half-decoded. A truncated MJPEG frame came back with its missing part
      taken from whatever memory the frame pool handed out (earlier frames' pixels, or not), so
      its bytes depended on how the caller held frames; files without damage decode the same.
    """
    stream = container.streams.video[0]
    stream.thread_type = "SLICE"
    stream.thread_count = _THREADS["count"]
    stream.codec_context.options = {"err_detect": "explode"}
    return stream


def _decoded(container: Any, stream: Any, info: dict[str, Any], path: str,
             seeker: Optional["Seeker"] = None) -> Iterator[Any]:
    """Every frame the codec gives, in order: packets it rejects are counted (``decode_errors``)
    and skipped, a container that breaks ends the stream as in a player (``demux_error``) and
    the decoder is then drained, so every frame that decodes comes out. With a ``seeker``, between
    packets the read may jump ahead to a keyframe (:class:`Seeker`)."""
    av = _av()
    packets = container.demux(stream)
    try:
        while True:
            key = seeker.pending() if seeker is not None else None
            if key is not None:
                seeker.seek(container, stream, key)
            try:
                packet = next(packets)
            except StopIteration:
                return   # (the demuxer's last, empty packet has drained the decoder)
            except av.error.FFmpegError as e:
                info["demux_error"] = str(e)
                break
            try:
                frames = packet.decode()
            except av.error.FFmpegError:
                info["decode_errors"] += 1
                continue
            yield from frames
        try:
            yield from stream.codec_context.decode(None)
        except (av.error.EOFError, av.error.InvalidDataError):
            pass   # nothing held back
    except av.error.FFmpegError as e:
        raise DecodeError(f"FFmpeg failed while decoding frame {info['decoded_frames']}: {e}", path=path) from None


class _Clock:
    """Each kept frame's time in seconds from the stream's start time (else the first frame's pts); a
    frame without a usable pts (none, or not increasing) is placed one nominal frame (``every`` source
    frames) later. Counted as rationals: in floats, 0.24 + 0.04 is 0.27999999999999997, and a next pts of
    0.28 then counted as increasing (two frames 1e-17 s apart)."""

    def __init__(self, stream: Any, fps: float, every: int):
        self.tb = stream.time_base
        self.t0: Optional[Fraction] = Fraction(stream.start_time) * self.tb if stream.start_time is not None else None
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        rate = Fraction(rate) if rate else (_decimal(fps) if fps else None)
        self.exact_step = every / rate if rate else Fraction(0)
        self.step = float(self.exact_step)
        self.exact_last: Optional[Fraction] = None
        self.last: Optional[float] = None

    def __call__(self, frame: Any) -> float:
        pts = frame.pts if frame.pts is not None else frame.dts
        if pts is not None and self.t0 is None:
            self.t0 = Fraction(pts) * self.tb
        t = Fraction(pts) * self.tb - self.t0 if pts is not None and self.t0 is not None else None
        if t is None or (self.exact_last is not None and t <= self.exact_last):
            t = (self.exact_last + self.exact_step) if self.exact_last is not None else Fraction(0)
        self.exact_last = t
        self.last = float(t)
        return self.last


def _getter(frame: Any, i: int, mode: str, shape: list, path: str, rotate: bool = True,
            info: Optional[dict[str, Any]] = None) -> Callable[[], np.ndarray]:
    """Frame ``i``'s pixels on demand (turned as its display matrix says unless ``rotate`` is off; the matrix
    applied goes to ``info["display_matrix"]``); every frame must have the first converted frame's size."""
    def get() -> np.ndarray:
        try:
            arr = _convert(frame, mode, rotate)
        except ValueError as e:
            raise DecodeError(str(e), path=path) from None
        if rotate and info is not None and "display_matrix" not in info:
            m = display_matrix(frame)
            if m is not None:
                info["display_matrix"] = list(m)
        if not shape:
            shape.append(arr.shape)
        elif arr.shape != shape[0]:
            raise DecodeError(f"frame {i} is {arr.shape[1]}x{arr.shape[0]}, earlier frames "
                              f"{shape[0][1]}x{shape[0][0]} (size changes mid-stream)", path=path)
        return arr
    return get


def iter_frames(path: str, mode: str = "rgb8", every: int = 1, max_frames: Optional[int] = None,
                info: Optional[dict[str, Any]] = None, start_s: Optional[float] = None,
                end_s: Optional[float] = None, rotate: bool = True) -> Iterator[tuple[int, float, Callable[[], np.ndarray]]]:
    """Like :func:`_iter_all`, over the frames whose time ``t`` (seconds from the stream's start, as in
    ``pts``) has ``start_s <= t < end_s``, exactly (the frame's time as the rational of its time base, the
    bounds as the decimals written); ``every`` and ``max_frames`` count frames inside that window,
    and decoding stops at the first frame at or after ``end_s``."""
    if start_s is None and end_s is None:
        yield from _iter_all(path, mode, every, max_frames, info, rotate=rotate)
        return
    # compared as the rationals they are: a time base finer than a microsecond puts frames within 1e-6 s of a bound
    lo = _decimal(start_s) if start_s is not None else None
    hi = _decimal(end_s) if end_s is not None else None
    frames = _iter_all(path, mode, 1, None, info, rotate=rotate)
    inside = kept = 0
    try:
        for _, t, get in frames:
            if lo is not None and exact_time(t) < lo:
                continue
            if hi is not None and exact_time(t) >= hi:
                break
            if inside % every == 0:
                if max_frames is not None and kept >= max_frames:
                    break
                yield kept, t, get
                kept += 1
            inside += 1
    finally:
        frames.close()
    if kept == 0:
        raise DecodeError(f"no frame between start_s {start_s} and end_s {end_s} (the video is "
                          f"{(info or {}).get('decoded_frames', 0)} frame(s) long)", path=path)
    if info is not None:
        info["kept_frames"] = kept


def _decimal(x: float) -> Fraction:
    """The decimal a user wrote (0.1 -> 1/10), not its binary approximation."""
    return Fraction(repr(float(x)))


def _iter_all(path: str, mode: str = "rgb8", every: int = 1, max_frames: Optional[int] = None,
              info: Optional[dict[str, Any]] = None, seeker: Optional["Seeker"] = None, rotate: bool = True,
              ) -> Iterator[tuple[int, float, Callable[[], np.ndarray]]]:
    """Yield ``(position, pts seconds, get)`` for frames 0, every, 2*every, ... in order.

    ``position`` counts kept frames (source frame = position * every); ``get()``
    converts the frame to an (H, W, C) uint8 array (only frames a caller asks
    for pay the conversion). ``info`` (a dict) gets fps/claimed/codec at open and
    decoded_frames/decode_errors as frames come; the container is closed when the
    generator ends or is closed. The frames do not depend on the process or the
    thread count decoding them (see :func:`_decoding`). With a ``seeker``, positions
    no one needs may be skipped (:class:`Seeker`); the others are given as without.
    """
    container = _open(path)
    info = {} if info is None else info
    try:
        stream = _decoding(container)
        info.update(video_info(container), decoded_frames=0, decode_errors=0)
        clock = _Clock(stream, info["fps"], every)
        if seeker is not None:
            seeker.start(clock, every)
        last = -1
        shape: list[Any] = []
        for i, frame in _numbered(_decoded(container, stream, info, path, seeker), seeker):
            info["decoded_frames"] = i + 1
            if i % every:
                continue
            if max_frames is not None and i // every >= max_frames:
                break   # a seek may land past the last frame kept: it is not given
            last = i // every
            yield last, clock(frame), _getter(frame, i, mode, shape, path, rotate, info)
            if max_frames is not None and last + 1 >= max_frames:
                break   # (decode nothing more)
        else:
            if seeker is not None and seeker.seeked and seeker.next < len(seeker.index.pts):
                # a seek that lands past the frames left (MPEG-TS near its end) decodes none: nothing disagreed
                raise _SeekMismatch(f"the stream ended at frame {seeker.next} after a seek; the packet index "
                                    f"holds {len(seeker.index.pts)}")
        if last < 0:
            raise DecodeError("no frame could be decoded (empty, truncated or unsupported codec)", path=path)
        info["kept_frames"] = last + 1
    finally:
        container.close()


def _numbered(frames: Iterator[Any], seeker: Optional["Seeker"]) -> Iterator[tuple[int, Any]]:
    """``(index, frame)``: the i-th decoded frame, or with a seeker its index in the packet index."""
    if seeker is None:
        yield from enumerate(frames)
        return
    for frame in frames:
        i = seeker.number(frame)
        if i is not None:
            yield i, frame


class _SeekMismatch(Exception):
    """After a seek, a frame is not the one the packet index says: read again, decoding through."""


# demuxers whose seeks cannot be checked frame by frame: in an MPEG program stream (.mpg, .vob) the frames decoded
# after a seek carry other pts than in a whole decode (MPEG-2: the frame showing 122 came with frame 123's pts, so a
# clip took frames 137-139 for 138-140 and every check passed); in a transport stream (.ts, .m2ts) most seeks land
# past their keyframe and the read started over (tests/test_video_truth_outside.py)
_NO_SEEK_FORMATS = frozenset({"mpeg", "mpegts", "mpegtsraw", "mpegvideo"})


class PacketIndex:
    """The video stream's packets from one demux pass (no decoding), but those the demuxer marks
    discarded (before an mp4 edit list's start: decoded for the frames after them, never shown) and those
    before the first keyframe (a stream cut mid-GOP; when the codec does show them, the first frame's
    check turns seeking off, as before): ``pts``
    sorted, so frame ``i`` of a clean file is the packet with the ``i``-th smallest pts (which :class:`Seeker` checks on
    every frame it decodes), and ``keys``, the frame indices of keyframes before the first packet
    the demuxer flags corrupt (a cut file's last one). ``ok`` is False (no seeking) when a packet
    has no pts, a pts repeats, the demuxer fails, or the file is an MPEG program or transport stream
    (``_NO_SEEK_FORMATS``)."""

    def __init__(self, path: str):
        av = _av()
        self.pts: list[int] = []
        self.rank: dict[int, int] = {}
        self.keys: list[int] = []
        self.ok = False
        found = []
        container = _open(path)
        if set(container.format.name.split(",")) & _NO_SEEK_FORMATS:
            container.close()
            return
        try:
            keyed = False
            for pk in container.demux(container.streams.video[0]):
                keyed = keyed or (pk.size > 0 and pk.is_keyframe)
                if not keyed:
                    continue   # a stream cut mid-GOP: the decoder shows nothing before the first keyframe
                if pk.size == 0 or pk.is_discard:
                    continue   # the demuxer's last, empty packet; one an edit list hides (it decodes to no frame)
                if pk.pts is None:
                    return
                found.append((int(pk.pts), bool(pk.is_keyframe), bool(pk.is_corrupt)))
        except av.error.FFmpegError:
            return
        finally:
            container.close()
        self.pts = sorted(p for p, _, _ in found)
        self.rank = {p: i for i, p in enumerate(self.pts)}
        bad = min((self.rank[p] for p, _, corrupt in found if corrupt), default=len(found))
        self.keys = sorted(self.rank[p] for p, key, _ in found if key and self.rank[p] < bad)
        self.ok = len(self.rank) == len(found) and bool(self.keys)


class Seeker:
    """Keyframe seeks for one streamed read. The consumer says which frame it needs next
    (``target``: ``("position", p)``, kept-frame position ``p``; or ``("time", t)``, the last frame
    whose time is at or before ``t``, a Fraction of seconds as :class:`_Clock` counts them; None:
    the next frame). Between packets, when a keyframe lies after the next frame to decode and not
    after the frame needed, the read seeks to it instead of decoding the frames between.

    Frame indices stay exact: they come from the :class:`PacketIndex` (pts order), checked against
    each decoded frame's pts. Before the first seek, a frame that disagrees turns seeking off for
    the file (nothing was skipped: decoding through goes on); after a seek it raises
    :class:`_SeekMismatch` and the read starts over, decoding through (:func:`_seeking_frames`), as does
    a stream that ends after a seek short of the frames the index holds (the seek found none).
    A frame decoded after a seek but before the keyframe sought (an earlier keyframe, leading
    frames of an open GOP) is dropped."""

    def __init__(self, path: str):
        self.path = path
        self.on = _SEEK["on"]
        self.index: Optional[PacketIndex] = None
        self.next = 0                    # the index of the next frame to decode
        self.seen: list[Any] = []        # pts of the frames decoded before the index was read
        self.target: Optional[tuple[str, Any]] = None
        self.seeked = False
        self.seeks = 0
        self.clock: Any = None
        self.every = 1

    def start(self, clock: _Clock, every: int) -> None:
        self.clock, self.every = clock, every

    def number(self, frame: Any) -> Optional[int]:
        """The index of a decoded frame (None: drop it, it comes before the keyframe sought)."""
        i = self.next
        if self.index is None:
            if self.on:
                self.seen.append(frame.pts)
        elif self.on or self.seeked:
            r = self.index.rank.get(frame.pts)
            if self.seeked and r is not None and r < i:
                return None
            if r != i:
                if self.seeked:
                    raise _SeekMismatch(f"frame {i}: pts {frame.pts} is frame {r} of the packet index")
                self.on = False
        self.next = i + 1
        return i

    def _needed(self) -> Optional[int]:
        """The index of the frame the consumer needs next."""
        kind, v = self.target
        if kind == "position":
            return int(v) * self.every
        tb, t0 = self.clock.tb, self.clock.t0
        if t0 is None:
            return None
        r = bisect.bisect_right(self.index.pts, v, key=lambda p: exact_time(float(Fraction(p) * tb - t0))) - 1
        return (r // self.every) * self.every if r >= 0 else None

    def pending(self) -> Optional[int]:
        """The keyframe to seek to now, or None (decode the next packet)."""
        if not self.on or self.target is None:
            return None
        kind, v = self.target
        if kind == "position" and v * self.every <= self.next:
            return None
        if self.index is None and kind == "time" and self.clock.last is not None and \
                float(v) - self.clock.last < 2 * self.clock.step:
            return None   # the next frame or the one after: not worth reading the packet index for
        if self.index is None:
            self.index = PacketIndex(self.path)
            self.on = self.index.ok and [self.index.rank.get(p) for p in self.seen] == list(range(len(self.seen)))
            self.seen = []
            if not self.on:
                return None
        need = self._needed()
        if need is None or need <= self.next:
            return None
        k = bisect.bisect_right(self.index.keys, need) - 1
        key = self.index.keys[k] if k >= 0 else -1
        return key if key > self.next else None

    def seek(self, container: Any, stream: Any, key: int) -> None:
        container.seek(self.index.pts[key], stream=stream, backward=True, any_frame=False)
        self.next, self.seeked, self.target = key, True, None
        self.seeks += 1


def _seeking_frames(path: str, mode: str, every: int, max_frames: Optional[int], info: dict[str, Any],
                    seeker: Seeker, rotate: bool = True) -> Iterator[tuple[int, float, Callable[[], np.ndarray]]]:
    """:func:`_iter_all` with keyframe seeks; if the frames after a seek disagree with the packet
    index, the file is read again from the start, decoding through, and goes on after the last
    frame already given."""
    done = -1
    frames = _iter_all(path, mode, every, max_frames, info, seeker, rotate)
    try:
        for pos, t, get in frames:
            done = pos
            yield pos, t, get
        return
    except _SeekMismatch:
        pass
    finally:
        frames.close()
    frames = _iter_all(path, mode, every, max_frames, info, rotate=rotate)
    try:
        for pos, t, get in frames:
            if pos > done:
                yield pos, t, get
    finally:
        frames.close()


class FrameSource:
    """The frames of a streamed read, ``(position, pts seconds, get)``, and ``want(target)``: the
    next frame its consumer needs (see :class:`Seeker`; None: the next one)."""

    def __init__(self, frames: Iterator[tuple[int, float, Callable[[], np.ndarray]]],
                 seeker: Optional[Seeker] = None):
        self.frames, self.seeker = frames, seeker

    def __iter__(self) -> "FrameSource":
        return self

    def __next__(self) -> tuple[int, float, Callable[[], np.ndarray]]:
        return next(self.frames)

    def want(self, target: Optional[tuple[str, Any]]) -> None:
        if self.seeker is not None:
            self.seeker.target = target

    def close(self) -> None:
        self.frames.close()


def has_audio(path: str) -> bool:
    container = _open(path)
    try:
        return bool(container.streams.audio)
    finally:
        container.close()


def read_audio_track(path: str, mono: bool = True, rate: Optional[int] = None, quality: str = "HQ",
                     ) -> tuple[np.ndarray, dict[str, Any]]:
    """The first audio stream of a video file -> (C, N) float32 at ``rate`` (soxr), and its meta.

    ``start`` in the meta is the time of sample 0 relative to the first video
    frame's pts (seconds), so sample ``round((t - start) * rate)`` plays at video time ``t``."""
    from ..transforms.kernels.audio import resample_audio

    av = _av()
    container = _open(path)
    try:
        if not container.streams.audio:
            raise DecodeError("has no audio stream (the recipe asks for audio_field)", path=path)
        a = container.streams.audio[0]
        v = container.streams.video[0]
        chunks: list[np.ndarray] = []
        first_t: Optional[Fraction] = None
        src_rate = None
        resampler = None
        try:
            for packet in container.demux(a):
                try:
                    frames = packet.decode()
                except av.error.InvalidDataError:
                    continue
                for fr in frames:
                    if first_t is None and fr.pts is not None and fr.time_base is not None:
                        first_t = Fraction(fr.pts) * fr.time_base
                    if src_rate is None:
                        src_rate = int(fr.sample_rate)
                        resampler = av.AudioResampler(format="fltp", layout=fr.layout.name, rate=src_rate)
                    for out in resampler.resample(fr):
                        chunks.append(out.to_ndarray().astype(np.float32, copy=False))
            if resampler is not None:
                for out in resampler.resample(None):
                    chunks.append(out.to_ndarray().astype(np.float32, copy=False))
        except av.error.FFmpegError as e:
            raise DecodeError(f"FFmpeg failed while decoding the audio track: {e}", path=path) from None
        if not chunks or src_rate is None:
            raise DecodeError("the audio track holds no samples", path=path)
        v0 = Fraction(v.start_time) * v.time_base if v.start_time is not None and v.time_base else Fraction(0)
        start = float((first_t if first_t is not None else Fraction(0)) - v0)
    finally:
        container.close()
    x = np.concatenate(chunks, axis=1)
    if not np.isfinite(x).all():
        raise DecodeError("the audio track holds non-finite samples", path=path)
    channels = int(x.shape[0])
    if mono and x.shape[0] > 1:
        x = x.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32)
    out_rate = rate or src_rate
    if out_rate != src_rate:
        x = resample_audio(x, src_rate, out_rate, quality)
    meta = {"sample_rate": int(out_rate), "source_rate": int(src_rate), "source_channels": channels,
            "channels": int(x.shape[0]), "frames": int(x.shape[1]), "start": start}
    return np.ascontiguousarray(x, dtype=np.float32), meta


def frame_budget(path: str, mode: str, budget: int) -> tuple[int, int, int]:
    """(W, H, the most frames one decode may hold within ``budget``): a frame as its header declares it
    (FFmpeg's decoded picture plus the converted array) over ``budget`` is refused before any decoding;
    the frames kept are held twice (the list, then the stacked array)."""
    container = _open(path)
    try:
        cc = container.streams.video[0].codec_context
        w, h = int(cc.width or 0), int(cc.height or 0)
    finally:
        container.close()
    c = 3 if mode == "rgb8" else 1
    check_budget(path, f"{w}x{h} frames", w * h * (3 + c), budget)
    return w, h, max(1, budget // max(1, 2 * w * h * c))


def read_video(path: str, mode: str = "rgb8", max_frames: Optional[int] = None,
               every: int = 1, start_s: Optional[float] = None,
               end_s: Optional[float] = None, apply: Optional[Callable[[np.ndarray], np.ndarray]] = None,
               hold: Optional[Callable[[int, np.ndarray], None]] = None,
               rotate: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode frames 0, every, 2*every, ... (up to ``max_frames`` kept; of the frames in
    [``start_s``, ``end_s``) when given) -> (T, H, W, C) uint8, meta.

    ``apply`` maps each frame as it is decoded (the per-frame steps of a recipe): only its output is
    held, and stacked. ``hold(n, frame)`` is told of each frame kept (n of them so far) and may raise
    (a budget). The meta describes the source frames (width, height) and the kept ones (pts)."""
    info: dict[str, Any] = {}
    frames, pts = [], []
    size = None
    it = iter_frames(path, mode, every, max_frames, info=info, start_s=start_s, end_s=end_s, rotate=rotate)
    try:
        for _, t, get in it:
            frame = get()
            if apply is not None:
                size = size or frame.shape[:2]
                frame = apply(frame)
                if frame.base is not None:   # a view (a crop) would keep the whole decoded frame alive
                    frame = frame.copy()
            frames.append(frame)
            pts.append(t)
            if hold is not None:
                hold(len(frames), frame)
    finally:
        it.close()
    arr = np.stack(frames)
    h, w = size or arr.shape[1:3]
    meta = {"fps": info["fps"], "decoded_frames": info["decoded_frames"], "claimed_frames": info["claimed_frames"],
            "every": every, "width": int(w), "height": int(h), "codec": info["codec"], "pts": pts,
            "decode_errors": info["decode_errors"]}
    if "display_matrix" in info:
        meta["display_matrix"] = info["display_matrix"]
    return arr, meta


@DECODERS.register()
class VideoDecoder(Decoder):
    """Any video FFmpeg reads -> (T, H, W, C) uint8 frames (T = frames decoded, not the header's count).

    ``every: k`` keeps every k-th decoded frame; ``max_frames`` stops after that
    many kept frames. ``start_s``/``end_s`` keep only the frames whose time (seconds
    from the stream's start, as in the ``pts`` meta) is in [start_s, end_s): a
    clip of a longer video (per table row: ``start_s: {column: time_start}``);
    ``every`` and ``max_frames`` then count inside that window. ``audio_field: name`` also outputs the file's audio track
    as a (C, N) float32 field ``name`` (``audio_rate``, ``audio_mono``), which
    ``clips`` cuts to each clip's time span (``audio_missing: silence`` gives
    files without audio a silent track). Followed by ``clips``, the engine
    streams the file instead of calling ``read`` (see the module docstring)."""

    name = "video"
    kind = "video"
    # 2: damaged files decode alike in any process (slice threads, err_detect explode); 3: frames are turned as the
    # container's display matrix says (a phone's portrait video came out on its side); 4: start_s / end_s compare
    # exactly (a frame 1 us before start_s was kept, one 1 us before end_s dropped, in a microsecond time base), and
    # a frame whose pts does not increase is placed one frame later counting in rationals (floats put two frames of
    # an AVI with B-frames 1e-17 s apart), and frames of more than 8 bits, 4:1:1, 4:1:0 or an odd size are converted
    # as OpenCV does (swscale's rgb24 path darkened 10-bit frames by about 1%), and a streamed read whose seek found
    # no frame (MPEG-TS near its end) decodes through instead of silently losing the clips after it, and MPEG program
    # and transport streams are never sought in (a clip of a .mpg/.vob took the frames before the ones it names)
    output_version = 4

    class Params(DecoderParams):
        mode: Literal["rgb8", "gray8"] = Field("rgb8", description="frames as 8-bit RGB or gray")
        every: int = Field(1, ge=1)                    # keep every k-th decoded frame
        max_frames: Optional[int] = Field(None, ge=1)  # stop after this many kept frames
        audio_field: Optional[str] = None              # also output the audio track as this field
        audio_rate: Optional[int] = Field(None, ge=1)  # resample the audio track to this rate (Hz)
        audio_mono: bool = True                        # mix the audio track down to one channel
        audio_quality: Literal["VHQ", "HQ", "MQ", "LQ", "QQ"] = Field(
            "HQ", description="soxr quality preset when the audio track is resampled")
        audio_missing: Literal["error", "silence"] = "error"  # a file without audio: an error, or silence
        start_s: Optional[float] = Field(None, ge=0)   # keep frames from this time (s from the stream's start)
        end_s: Optional[float] = Field(None, gt=0)     # ... up to (not including) this time
        rotate: bool = Field(True, description="turn (and mirror) frames as the container's display matrix says, "
                             "as players show them (a phone's portrait video); false: as stored")

        @model_validator(mode="after")
        def _silence_rate(self):
            if self.audio_missing == "silence" and self.audio_rate is None:
                raise ValueError("audio_missing: silence needs audio_rate (the rate of the silent track)")
            if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
                raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
            if self.audio_field is not None and (self.start_s is not None or self.end_s is not None):
                raise ValueError("start_s/end_s cut the frames only: not with audio_field (use clips to cut both)")
            return self

        @field_validator("audio_field")
        @classmethod
        def _name(cls, v: Optional[str]) -> Optional[str]:
            if v is not None and (not v or v.startswith("__")):
                raise ValueError("must be a plain field name")
            return v

    def spec(self) -> FieldSpec:
        return FieldSpec("video", (None, None, None, 3 if self.params.mode == "rgb8" else 1), "uint8")

    def output_specs(self, field: str) -> dict[str, FieldSpec]:
        out = {field: self.spec()}
        if self.params.audio_field is not None:
            if self.params.audio_field == field:
                raise ValueError(f"audio_field {field!r} clashes with the video field")
            out[self.params.audio_field] = FieldSpec("audio", (1 if self.params.audio_mono else None, None), "float32")
        return out

    def declared_shape(self, path: str) -> Optional[tuple[int, int, int, int]]:
        """(T, H, W, C) of the whole array ``read`` would return, from the container's header (its
        declared frame count, which may be wrong: the decode counts frames); None when the header
        declares no frame count or the file does not open."""
        p = self.params
        try:
            container = _open(path)
        except DecodeError:
            return None
        try:
            s = container.streams.video[0]
            n, h, w = int(s.frames or 0), int(s.codec_context.height or 0), int(s.codec_context.width or 0)
            fps = video_info(container)["fps"]
        finally:
            container.close()
        if p.start_s is not None or p.end_s is not None:
            end = p.end_s if p.end_s is not None else (n / fps if fps else 0.0)
            n = min(n, math.ceil((end - (p.start_s or 0.0)) * fps)) if fps else 0
        n = -(-n // p.every)
        if p.max_frames is not None:
            n = min(n, p.max_frames)
        if n <= 0 or h <= 0 or w <= 0:
            return None
        return n, h, w, 3 if p.mode == "rgb8" else 1

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        w, h, cap = frame_budget(path, p.mode, self.max_bytes)
        limit = cap + 1 if p.max_frames is None else min(p.max_frames, cap + 1)
        arr, meta = read_video(path, p.mode, limit, p.every, p.start_s, p.end_s, rotate=p.rotate)
        if len(arr) > cap:
            check_budget(path, f"more than {cap} frames of {w}x{h}", 2 * arr[:cap + 1].nbytes, self.max_bytes)
        return arr, meta

    def read_through(self, path: str, field: str, apply: Callable[[np.ndarray], np.ndarray],
                     ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``decode`` with ``apply`` (a recipe's leading per-frame steps, see
        :func:`precompile.transforms.temporal.frame_steps_plan`) run on each frame as it is decoded:
        only its output is held. The budget counts what is held: the frames kept after ``apply``,
        twice (the list, then the stacked array), and one decoded frame in flight; a source frame
        alone over the budget is refused before decoding. The arrays and meta are ``decode``'s with
        ``apply`` run on the video afterwards (a per-frame step maps each frame alone)."""
        p = self.params
        w, h, _ = frame_budget(path, p.mode, self.max_bytes)
        flight = w * h * (3 + (3 if p.mode == "rgb8" else 1))

        def hold(n: int, frame: np.ndarray) -> None:
            need = flight + 2 * n * frame.nbytes
            if need > self.max_bytes:
                check_budget(path, f"more than {n - 1} frames of {frame.shape[1]}x{frame.shape[0]} after the "
                             f"per-frame steps", need, self.max_bytes)

        arr, meta = read_video(path, p.mode, p.max_frames, p.every, p.start_s, p.end_s, apply, hold, p.rotate)
        out = {field: arr}
        if p.audio_field is not None:
            out[p.audio_field], meta["audio"] = self.read_audio(path)
            meta["audio"]["field"] = p.audio_field
        return out, meta

    def read_audio(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        if p.audio_missing == "silence" and not has_audio(path):
            return np.zeros((1, 0), np.float32), {"sample_rate": p.audio_rate, "channels": 1, "frames": 0,
                                                  "start": 0.0, "missing": True}
        return read_audio_track(path, p.audio_mono, p.audio_rate, p.audio_quality)

    def open_stream(self, path: str, field: str) -> tuple[dict[str, np.ndarray], dict[str, Any], FrameSource]:
        """Like ``decode``, but the video field is an empty placeholder (0, 1, 1, C) and the frames
        come from the returned :func:`iter_frames` generator. The meta has the keys ``decode``
        gives a clip (the whole-file counts are filled in only as frames come)."""
        p = self.params
        frame_budget(path, p.mode, self.max_bytes)   # a frame over the budget is refused before decoding
        info: dict[str, Any] = {}
        seeker = None
        if p.start_s is None and p.end_s is None:
            seeker = Seeker(path)
            frames = _seeking_frames(path, p.mode, p.every, p.max_frames, info, seeker, p.rotate)
        else:
            frames = iter_frames(path, p.mode, p.every, p.max_frames, info=info, start_s=p.start_s, end_s=p.end_s,
                                 rotate=p.rotate)
        try:
            first = next(frames)
        except BaseException:
            frames.close()
            raise
        h, w = first[2]().shape[:2]   # opens the file, checks it has a frame; the size for the meta

        def chain() -> Iterator[tuple[int, float, Callable[[], np.ndarray]]]:
            try:
                yield first
                yield from frames
            finally:
                frames.close()

        meta = {"fps": info["fps"], "claimed_frames": info["claimed_frames"], "every": p.every, "width": int(w),
                "height": int(h), "codec": info["codec"]}
        if "display_matrix" in info:
            meta["display_matrix"] = info["display_matrix"]
        out = {field: np.zeros((0, 1, 1, 3 if p.mode == "rgb8" else 1), np.uint8)}
        if p.audio_field is not None:
            try:
                out[p.audio_field], meta["audio"] = self.read_audio(path)
            except BaseException:
                frames.close()
                raise
            meta["audio"]["field"] = p.audio_field
        return out, meta, FrameSource(chain(), seeker)

    def decode(self, path: str, field: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arr, meta = self.read(path)
        out = {field: arr}
        if self.params.audio_field is not None:
            out[self.params.audio_field], meta["audio"] = self.read_audio(path)
            meta["audio"]["field"] = self.params.audio_field
        return out, meta
