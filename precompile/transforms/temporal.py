"""Temporal steps on clips: the expanding ``clips`` and the random ``temporal_jitter``.

One decoded video (T, H, W, C) becomes many clips. By frame numbers: ``length``
frames taking every ``every``-th frame, a new clip starting every ``stride``
frames. By time (``fps`` set): clips of ``length`` frames (or ``length_s``
seconds) resampled to ``fps`` frames per second, a new clip every ``stride_s``
seconds; clip frame ``j`` of clip ``k`` is the source frame on screen at
``t0 + k * stride_s + j / fps`` (the last frame whose timestamp is not later),
so variable-frame-rate files give evenly timed clips. Each clip gets the key
``<key>#clip<n>`` and ``meta["clip"]`` = {index, frames (source frame
indices), pts (their presentation times, seconds), start (seconds), fps};
``index_field`` also stores the indices as an int32 (T,) field. Videos shorter
than one clip are dropped or padded (``short``), padding by repeating the last
frame or with black frames (index -1, pts null).

A video's audio track (the ``video`` decoder's ``audio_field``) is cut to each
clip's span: from the clip's start time, ``length * every / fps`` seconds
(frame clips, the stream's average fps) or ``length / fps`` (time clips),
zero-padded outside the track.

Clips are cut by :class:`ClipCutter`, which takes frames one at a time and
asks for a frame's pixels only when a clip needs it; the engine feeds it
straight from the decoder (:func:`stream_plan`, ``compiler.shard.stream_item``), so a long video never sits
in memory whole, and :meth:`Clips.run` feeds it from a decoded array. Both
give the same samples, byte for byte. While streaming, the cutter tells the
decoder the next frame a clip needs (:meth:`ClipCutter.ahead`), so sparse clips
seek to keyframes instead of decoding every frame between them; deterministic
per-frame steps before ``clips`` run on each frame as it arrives
(:func:`stream_plan`). A video that is not cut while streaming (no ``clips``,
or a step before it that cannot stream) still runs its leading per-frame
steps on each frame as it is decoded and holds only their output
(:func:`frame_steps_plan`).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Iterable, Iterator, Literal, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..errors import StepError
from ..kinds import Kind, kinds
from ..optschema import checked
from ..registry import STEPS
from ..sample import FieldSpec, Sample, exact_time
from .base import RandomParams, RandomStep, Step, StepParams
from .kernels.temporal import clip_starts, jitter_indices, take_frames

# a frame as the cutter sees it: (position among kept frames, pts seconds, pixels on demand)
FrameIn = tuple[int, float, Callable[[], Any]]
# meta keys of the decoder that describe the whole file; a clip drops them (a streamed
# build may stop decoding after the last clip it needs and never learns them)
_WHOLE_FILE_META = ("pts", "decoded_frames", "decode_errors", "kept_frames", "demux_error")


def _exact(x: float) -> Fraction:
    """The decimal a user wrote (29.97 -> 2997/100), not its binary approximation."""
    return Fraction(repr(float(x)))


@STEPS.register()
class Clips(Step):
    """Cut videos into clips: ``length`` frames, ``every`` k-th frame, a clip start every ``stride``
    frames; or by time: ``fps`` with ``length`` (frames) or ``length_s``, a start every ``stride_s``."""

    name = "clips"
    applies = kinds(Kind.VIDEO)
    expands = True
    # 2: time clips' audio is stored with its fixed length when the decoder fixes the rate; 3: a seek never changes
    # what a clip is cut from (30c7c2a); 4: time clips read frame timestamps as the rationals of their time base
    # (a slot exactly at a frame's pts, 1/12 + 2/8 = 1/3, takes that frame; its float's decimal missed it); 5: a frame
    # time in a time base finer than 1e-9 s is not snapped to a simpler fraction (mp4 timescale 2**31 - 1: frame 15
    # of a 30 fps file, 2.3e-10 s after 0.5, was read as 1/2 and shown at a slot at 0.5 s)
    output_version = 5
    # 3: a streamed clip is never cut from a frame past the decoder's max_frames (a seek landed past it), and
    #    a short video streamed through frame clips is padded with its last frame, not the last one read

    class Params(StepParams):
        length: Optional[int] = Field(None, ge=1)  # frames per clip (T)
        every: int = Field(1, ge=1)               # take every k-th frame inside a clip
        stride: Optional[int] = Field(None, ge=1)  # frames between clip starts (default: the clip's span, no overlap)
        fps: Optional[float] = Field(None, gt=0)   # cut by time: resample clips to this frame rate
        length_s: Optional[float] = Field(None, gt=0)  # with fps: clip length in seconds (T = round(length_s * fps))
        stride_s: Optional[float] = Field(None, gt=0)  # with fps: seconds between clip starts (default: the clip's length)
        short: Literal["drop", "pad"] = "drop"    # videos shorter than one clip span
        pad: Literal["last", "zero"] = "last"     # how to pad: repeat the last frame, or black frames (index -1)
        max_clips: Optional[int] = Field(None, ge=1)  # keep at most this many clips per video (the first ones)
        index_field: Optional[str] = None          # also output the source frame indices as an int32 (T,) field

        @field_validator("index_field")
        @classmethod
        def _name(cls, v: Optional[str]) -> Optional[str]:
            if v is not None and (not v or v.startswith("__")):
                raise ValueError("must be a plain field name")
            return v

        @model_validator(mode="after")
        def _mode(self):
            if self.fps is None:
                for k in ("length_s", "stride_s"):
                    if getattr(self, k) is not None:
                        raise ValueError(f"{k} needs fps (the rate clips are resampled to)")
                if self.length is None:
                    raise ValueError("length is required (or fps with length or length_s, to cut by time)")
            else:
                if (self.length is None) == (self.length_s is None):
                    raise ValueError("with fps, give exactly one of length (frames) or length_s (seconds)")
                if self.stride is not None or self.every != 1:
                    raise ValueError("with fps, clips are cut by time: use stride_s, not stride or every")
                if self.length_s is not None and round(self.length_s * self.fps) < 1:
                    raise ValueError(f"length_s {self.length_s} at fps {self.fps} is less than one frame")
            return self

    @property
    def by_time(self) -> bool:
        return self.params.fps is not None

    @property
    def frames_per_clip(self) -> int:
        p = self.params
        return p.length if p.length is not None else int(round(p.length_s * p.fps))

    @property
    def span(self) -> int:
        return (self.frames_per_clip - 1) * self.params.every + 1

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=(self.frames_per_clip, *spec.shape[1:]))

    def audio_samples(self, rate: int) -> Optional[int]:
        """Samples of a ``rate`` Hz audio track each clip holds when cut by time (``length / fps``
        seconds, whatever the file); None for frame clips (their span depends on the file's fps)."""
        if not self.by_time:
            return None
        return int(round(Fraction(self.frames_per_clip) / _exact(self.params.fps) * rate))

    def audio_spec(self, spec: FieldSpec, rate: Optional[int], video: FieldSpec) -> FieldSpec:
        """The spec of the video's audio track (the decoder's ``audio_field``, at ``rate`` when the decoder
        fixes it) after this step: a fixed length for time clips at a fixed rate, else as it was."""
        n = self.audio_samples(rate) if rate else None
        if n is None or not spec.shape or spec.shape[-1] is not None:
            return spec
        return spec.with_(shape=(*spec.shape[:-1], n))

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        out = super().plan(specs)
        if self.params.index_field is not None:
            if self.params.index_field in specs:
                raise ValueError(f"index_field {self.params.index_field!r} clashes with an existing field")
            out[self.params.index_field] = FieldSpec(Kind.INDEX, (self.frames_per_clip,), "int32")
        return out

    def clip_indices(self, n: int) -> list[list[int]]:
        """Frame clips: per clip, the positions (into the decoded frames) it takes; may run past ``n``
        when padding. (A reference for :class:`ClipCutter`, which cuts the same clips as frames come.)"""
        p = self.params
        stride = p.stride or self.span
        starts = clip_starts(n, self.span, stride, p.short)
        if p.max_clips is not None:
            starts = starts[:p.max_clips]
        return [[s + j * p.every for j in range(self.frames_per_clip)] for s in starts]

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        return list(self.outputs(sample, rng))

    def outputs(self, sample: Sample, rng: np.random.Generator) -> Iterable[Sample]:
        """The clips of a whole decoded video one at a time (a remote or isolated decode: the build spills
        them past a bound, as it does the clips it streams)."""
        specs = sample.specs()
        targets = self.targets(specs)
        if not targets:
            return [sample]
        n = len(sample.fields[targets[0]])
        for f in targets[1:]:
            if len(sample.fields[f]) != n:
                raise StepError(f"clips: videos differ in length ({targets[0]}: {n}, {f}: "
                                f"{len(sample.fields[f])} frames)", field=f)
        m = sample.meta.get(targets[0])
        src_meta = m if isinstance(m, dict) else {}
        pts = src_meta.get("pts")
        if pts is None or len(pts) != n:
            if self.by_time:
                raise StepError("clips: cutting by time (fps) needs the frame timestamps the video decoder "
                                "records (meta pts)", field=targets[0])
            fps, dec_every = src_meta.get("fps"), int(src_meta.get("every", 1))
            pts = [i * dec_every / fps if fps else 0.0 for i in range(n)]
        arrays = [sample.fields[f] for f in targets]
        frames = ((i, float(pts[i]), (lambda i=i: tuple(a[i] for a in arrays))) for i in range(n))
        return self.cut(sample, targets, frames)

    def cut(self, sample: Sample, targets: list[str], frames: Iterable[FrameIn],
            cutter: Optional["ClipCutter"] = None, seek: Optional[Callable[[Any], None]] = None) -> Iterator[Sample]:
        """Clips of ``sample`` from ``frames`` (in order), as samples; ``sample`` gives every other
        field, the kinds and the meta (its ``targets`` fields are replaced by the clips). ``seek``
        (the frame source's ``want``) is told after each frame which frame the clips need next
        (:meth:`ClipCutter.ahead`), so the source may skip the frames between."""
        m = sample.meta.get(targets[0])
        src_meta = m if isinstance(m, dict) else {}
        dec_every = int(src_meta.get("every", 1))
        fps = src_meta.get("fps")
        audio = src_meta.get("audio") if isinstance(src_meta.get("audio"), dict) else None
        if audio is not None and audio.get("field") not in sample.fields:
            audio = None
        cutter = cutter if cutter is not None else ClipCutter(self)
        out_kinds = dict(sample.kinds)
        if self.params.index_field is not None:
            out_kinds[self.params.index_field] = Kind.INDEX
        trimmed = {f: {k: v for k, v in sample.meta[f].items() if k not in _WHOLE_FILE_META}
                   for f in targets if isinstance(sample.meta.get(f), dict)}

        def make(clip: "Clip") -> Sample:
            for k, f in enumerate(targets):   # a short video padded to `length` frames of a size the plan may not know
                first = np.asarray(clip.items[0][k])
                self.check_output_bytes((len(clip.items), *first.shape), first.dtype, field=f)
            new = {f: np.stack([it[k] for it in clip.items]) for k, f in enumerate(targets)}
            src = [i * dec_every if i >= 0 else -1 for i in clip.positions]
            if self.params.index_field is not None:
                new[self.params.index_field] = np.asarray(src, dtype=np.int32)
            meta = dict(sample.meta)
            meta.update(trimmed)
            info: dict[str, Any] = {"index": clip.index, "frames": src, "pts": clip.pts, "start": clip.start,
                                    "fps": self.params.fps if self.by_time else fps}
            if audio is not None:
                x = sample.fields[audio["field"]]
                rate = int(audio["sample_rate"])
                if self.by_time:
                    n = self.audio_samples(rate)
                else:
                    n = int(round(self.frames_per_clip * self.params.every * dec_every * rate / fps)) if fps else 0
                new[audio["field"]], first = cut_audio(x, rate, float(audio.get("start", 0.0)), clip.start, n)
                info["audio"] = {"first_sample": first, "samples": n, "sample_rate": rate}
            meta["clip"] = info
            return sample.replace_fields(new, key=f"{sample.key}#clip{clip.index}", meta=meta, kinds=out_kinds)

        for fr in frames:
            for clip in cutter.push(*fr):
                yield make(clip)
            if cutter.done:
                break
            if seek is not None:
                seek(cutter.ahead())
        for clip in cutter.finish():
            yield make(clip)


def cut_audio(x: np.ndarray, rate: int, track_start: float, t: float, n: int) -> tuple[np.ndarray, int]:
    """``n`` samples of a (C, N) track whose sample 0 plays at ``track_start`` s, from time ``t``;
    zeros outside the track. Returns the array and the index of its first sample in the track."""
    first = int(round((t - track_start) * rate))
    out = np.zeros((x.shape[0], n), x.dtype)
    lo, hi = max(first, 0), min(first + n, x.shape[1])
    if hi > lo:
        out[:, lo - first:hi - first] = x[:, lo:hi]
    return out, first


class Clip:
    """A finished clip: its index, source positions (-1: black padding), pts, start time, frames."""

    __slots__ = ("index", "positions", "pts", "start", "items")

    def __init__(self, index: int, positions: list[int], pts: list[Optional[float]], start: float,
                 items: list[Any]):
        self.index, self.positions, self.pts, self.start, self.items = index, positions, pts, start, items


class ClipCutter:
    """Cuts clips from frames given one at a time, in order, keeping only what open clips need.

    ``push(position, pts, get)`` takes a frame (``get()`` returns its pixels, a tuple with one
    array per clip field, called only for frames some clip takes) and returns the clips it
    completes; ``finish()`` returns the padded clip of a short video. ``done`` turns true once
    ``max_clips`` clips are out (decoding can stop). ``held`` / ``peak_held`` count the frames
    kept in memory (a clip's own frames plus, with overlapping clips, the overlap)."""

    def __init__(self, clips: Clips):
        p = clips.params
        self.L = clips.frames_per_clip
        self.every = p.every
        self.stride = p.stride or clips.span
        self.span = clips.span
        self.short, self.pad = p.short, p.pad
        self.max_clips = p.max_clips if p.max_clips is not None else math.inf
        self.by_time = clips.by_time
        if self.by_time:
            self.fps = _exact(p.fps)
            self.stride_t = _exact(p.stride_s) if p.stride_s is not None else Fraction(self.L) / self.fps
        self.next = 0                         # the first clip not yet out
        self.n = 0                            # frames seen
        self.t0: Optional[Fraction] = None
        self.held: dict[int, tuple[float, Any]] = {}   # frame clips: position -> (pts, pixels)
        self.slots: dict[int, list[Optional[tuple[int, float, Any]]]] = {}  # time clips: clip -> frame per slot
        self.prev: Optional[FrameIn] = None   # the latest frame (pads short videos; time clips: not yet placed)
        self.peak_held = 0

    @property
    def done(self) -> bool:
        return self.next >= self.max_clips

    @property
    def held_frames(self) -> int:
        if not self.by_time:
            return len(self.held)
        return len({id(s[2]) for slots in self.slots.values() for s in slots if s is not None})

    def _note(self) -> None:
        self.peak_held = max(self.peak_held, self.held_frames)

    # -- frame clips ---------------------------------------------------------------------
    def wants(self, pos: int) -> bool:
        """Does an unfinished frame clip take the frame at ``pos``?"""
        lo = max(self.next, -(-(pos - self.span + 1) // self.stride))
        hi = pos // self.stride
        for k in range(lo, hi + 1):
            if k >= self.max_clips:
                return False
            if (pos - k * self.stride) % self.every == 0:
                return True
        return False

    def push(self, pos: int, t: float, get: Callable[[], Any]) -> list[Clip]:
        self.n = pos + 1
        if self.by_time:
            return self._push_time(pos, t, get)
        self.prev = (pos, t, get)
        if self.wants(pos):
            self.held[pos] = (t, get())
            self._note()
        out = []
        while not self.done and self.next * self.stride + self.span - 1 <= pos:
            s = self.next * self.stride
            idx = [s + j * self.every for j in range(self.L)]
            out.append(Clip(self.next, idx, [self.held[i][0] for i in idx], self.held[s][0],
                            [self.held[i][1] for i in idx]))
            self.next += 1
            first = self.next * self.stride
            for i in [i for i in self.held if i < first]:
                del self.held[i]
        return out

    def ahead(self) -> Optional[tuple[str, Any]]:
        """The next frame an unfinished clip needs, when frames before it are needed by none:
        ``("position", p)`` (frame clips: the smallest position a clip takes, past the frames seen),
        ``("time", t)`` (time clips whose next clip has not begun: its first slot takes the last
        frame at or before ``t``); None when the next frame may be needed. Frame clips that pad a
        short video with its last frame (``short: pad``, ``pad: last``) skip nothing until the first
        clip is complete: the video may end before it, and the last frame must then be seen."""
        if self.done or self.prev is None:
            return None
        if not self.by_time and self.next == 0 and self.short == "pad" and self.pad == "last":
            return None
        if self.by_time:
            start = self._start(self.next)
            return ("time", start) if start > exact_time(self.prev[1]) and self.next not in self.slots else None
        need, k = None, self.next
        while k < self.max_clips:
            s = k * self.stride
            if s >= self.n:
                need = s if need is None else min(need, s)
                break   # later clips start later
            j = -(-(self.n - s) // self.every)
            if j < self.L:
                need = s + j * self.every if need is None else min(need, s + j * self.every)
            k += 1
        return ("position", need) if need is not None and need > self.n else None

    # -- time clips ----------------------------------------------------------------------
    def _start(self, k: int) -> Fraction:
        return self.t0 + k * self.stride_t

    def _place(self, until: Fraction, inclusive: bool) -> list[Clip]:
        """Put the previous frame into every slot whose time lies in [its pts, until)."""
        pos, t, get = self.prev
        tf = exact_time(t)
        item = None
        k = self.next
        out = []
        while k < self.max_clips and self._start(k) <= until:
            start = self._start(k)
            lo = max(0, math.ceil((tf - start) * self.fps))
            x = (until - start) * self.fps
            hi = min(self.L - 1, math.floor(x) if inclusive else math.ceil(x) - 1)
            if lo <= hi:
                if item is None:
                    item = (pos, t, get())
                slots = self.slots.setdefault(k, [None] * self.L)
                for j in range(lo, hi + 1):
                    slots[j] = item
            k += 1
        self._note()
        while not self.done and self.next in self.slots and self.slots[self.next][-1] is not None:
            slots = self.slots.pop(self.next)
            out.append(Clip(self.next, [s[0] for s in slots], [s[1] for s in slots],
                            float(self._start(self.next)), [s[2] for s in slots]))
            self.next += 1
        return out

    def _push_time(self, pos: int, t: float, get: Callable[[], Any]) -> list[Clip]:
        out = []
        if self.t0 is None:
            self.t0 = exact_time(t)
        elif self.prev is not None:
            out = self._place(exact_time(t), inclusive=False)
        self.prev = (pos, t, get)
        return out

    # -- end of the video ----------------------------------------------------------------
    def finish(self) -> list[Clip]:
        out = []
        if self.by_time and self.prev is not None and not self.done:
            out = self._place(exact_time(self.prev[1]), inclusive=True)
        if self.next > 0 or self.short != "pad" or self.n == 0 or self.done:
            return out
        pos, t, get = self.prev
        last = (pos, t, get())
        if self.by_time:
            slots = self.slots.get(0, [None] * self.L)
            got = [s for s in slots if s is not None]
            start = float(self.t0)
        else:
            idx = [j * self.every for j in range(self.L)]
            got = [(i, *self.held[i]) for i in idx if i < self.n]
            slots = got + [None] * (self.L - len(got))
            start = 0.0 if not got else got[0][1]
        zero = tuple(np.zeros_like(a) for a in (got[0][2] if got else last[2]))
        filled = [s if s is not None else (last if self.pad == "last" else (-1, None, zero)) for s in slots]
        self.next = 1
        self.slots.clear()
        self.held.clear()
        return out + [Clip(0, [s[0] for s in filled], [s[1] for s in filled], start, [s[2] for s in filled])]


# -- streaming: the engine's path for a recipe with a clips step ---------------------------------
class StreamPlan:
    """How the engine streams one video field: decoder -> the per-frame steps before ``clips``
    (``pre``, each frame as it arrives) -> ``clips`` (``steps[at]``) [-> ``resize`` (``post``, fused:
    each frame as it arrives)] -> the remaining steps (from ``first``), per clip."""

    def __init__(self, field: str, decoder: Any, clips: Clips, resize: Optional[Step], first: int,
                 at: int = 0, pre: Optional[list[tuple[int, Step]]] = None):
        self.field, self.decoder, self.clips, self.resize, self.first = field, decoder, clips, resize, first
        self.at = at
        self.pre = list(pre or [])
        self.post = [(at + 1, resize)] if resize is not None else []
        self.source: Any = None

    def open(self, dec: Any, path: str, field: str) -> tuple[dict[str, np.ndarray], dict[str, Any], Any]:
        """The engine's decode of the streamed field (``compiler.shard.decode_item``): placeholder
        arrays, the meta, and the frame source (``dec.open_stream``)."""
        return dec.open_stream(path, field)

    def frames(self, frames: Iterable[tuple[int, float, Callable[[], np.ndarray]]]) -> Iterator[FrameIn]:
        """The decoder's frames as the cutter takes them: a 1-tuple of pixels, through the per-frame
        steps. A per-frame step on a frame alone is what it does to that frame inside the whole
        video (or a clip), so the bytes agree with the whole-video path."""
        chain = self.pre + self.post
        for pos, t, get in frames:
            if not chain:
                yield pos, t, (lambda get=get: (get(),))
            else:
                yield pos, t, (lambda get=get: (self._apply(get(), chain),))

    def _apply(self, frame: np.ndarray, chain: list[tuple[int, Step]]) -> np.ndarray:
        return _apply_chain(self.field, frame, chain)

    def describe(self) -> str:
        """One line for ``precompile plan``: what streams, and in which order."""
        names = [s.name for _, s in self.pre] + ["clips"] + [s.name for _, s in self.post]
        return f"{self.field}: streamed frame by frame ({' -> '.join(names)}), one clip at a time in memory"


def _apply_chain(field: str, frame: np.ndarray, chain: list[tuple[int, Step]]) -> np.ndarray:
    """Steps ``chain`` ((index, step) pairs) on one (H, W, C) frame, as each does on a video's frames;
    errors name the field and the step."""
    for i, step in chain:
        try:
            frame = step.apply(frame[None], Kind.VIDEO)[0]
        except StepError as e:
            raise e.with_context(field=field, stage=f"steps[{i}] {step.name}") from e.__cause__
        except (ValueError, TypeError, IndexError) as e:
            raise StepError(f"{step.name}: {e}", field=field, stage=f"steps[{i}] {step.name}") from e
    return frame


class FrameSteps:
    """How the engine decodes a video field whose first steps are per-frame steps on it, outside the
    ``clips`` stream (no ``clips``, or a step before it that cannot stream): ``pre`` runs on each frame
    as it is decoded (the decoder's ``read_through``) and only its output is held, so the per-input
    budget counts the video after those steps, not the source; the steps from ``first`` on run on the
    assembled video as without streaming. The bytes are the same (a per-frame step on a frame alone
    is what it does to that frame in the whole video). ``source`` is set by the decode that ran
    ``pre`` (None: it did not, e.g. a URL input decoded whole, and every step runs)."""

    clips = None

    def __init__(self, field: str, decoder: Any, pre: list[tuple[int, Step]], first: int):
        self.field, self.decoder, self.pre, self.first = field, decoder, list(pre), first
        self.source: Any = None

    def open(self, dec: Any, path: str, field: str) -> tuple[dict[str, np.ndarray], dict[str, Any], Any]:
        arrays, meta = dec.read_through(path, field, self.apply)
        return arrays, meta, True

    def apply(self, frame: np.ndarray) -> np.ndarray:
        return _apply_chain(self.field, frame, self.pre)

    def names(self) -> str:
        return ", ".join(s.name for _, s in self.pre)


def _field_specs(decoders: dict[str, Any]) -> tuple[dict[str, FieldSpec], dict[str, str]]:
    """Every decoded field's spec, and the recipe field whose decoder makes it."""
    specs: dict[str, FieldSpec] = {}
    owner: dict[str, str] = {}
    for fname, dec in decoders.items():
        for name, spec in dec.output_specs(fname).items():
            specs[name] = spec
            owner[name] = fname
    return specs, owner


def streams_frames(step: Step) -> bool:
    """May ``step`` run frame by frame before ``clips``? Deterministic, one sample in one out, and
    declared ``per_frame`` (it maps every frame alone, the same way). A random step may not: it
    draws once per video before ``clips`` (every clip of the video shares the draw), so it cannot
    move past the cut, and its recipe decodes whole videos."""
    return step.per_frame and not step.random and not step.expands


def stream_plan(decoders: dict[str, Any], steps: list[Step]) -> Optional[StreamPlan]:
    """A :class:`StreamPlan` when a ``clips`` step on exactly one field, made by a decoder that can
    stream (``open_stream``), is preceded only by per-frame steps on that field
    (:func:`streams_frames`); else None (the engine decodes whole and runs the steps)."""
    at = next((i for i, s in enumerate(steps) if isinstance(s, Clips)), None)
    if at is None or not all(streams_frames(s) for s in steps[:at]):
        return None
    specs, owner = _field_specs(decoders)
    pre_targets, before = [], dict(specs)
    try:
        for step in steps[:at]:
            pre_targets.append(step.targets(before))
            before = step.plan(before)
        targets = steps[at].targets(before)
    except ValueError:
        return None
    if len(targets) != 1 or owner.get(targets[0]) != targets[0] or any(set(t) - {targets[0]} for t in pre_targets):
        return None
    field = targets[0]
    dec = decoders[field]
    if not hasattr(dec, "open_stream"):
        return None
    pre = [(i, s) for i, (s, t) in enumerate(zip(steps[:at], pre_targets)) if t]
    resize = _fused_resize(steps, at, before, field)
    return StreamPlan(field, dec, steps[at], resize, at + (2 if resize is not None else 1), at, pre)


def frame_steps_plan(decoders: dict[str, Any], steps: list[Step]) -> Optional[FrameSteps]:
    """A :class:`FrameSteps` for the leading steps of ``steps`` that are per-frame steps
    (:func:`streams_frames`) on one video field alone, made by a decoder that can run them as it
    decodes (``read_through``); steps that change no field (``fields: []``) may sit among them. None
    when the first step that changes a field is not such a step."""
    specs, owner = _field_specs(decoders)
    pre: list[tuple[int, Step]] = []
    field, first = None, len(steps)
    for i, step in enumerate(steps):
        if step.random or step.expands:
            first = i
            break
        try:
            targets = step.targets(specs)
        except ValueError:
            return None   # the plan reports it
        f = targets[0] if len(targets) == 1 else None
        if targets and not (streams_frames(step) and f is not None and field in (None, f) and owner.get(f) == f
                            and specs[f].kind is Kind.VIDEO and hasattr(decoders[f], "read_through")):
            first = i
            break
        try:
            specs = step.plan(specs)
        except ValueError:
            return None
        if targets:
            field = f
            pre.append((i, step))
    if not pre:
        return None
    return FrameSteps(field, decoders[field], pre, first)


def _fused_resize(steps: list[Step], at: int, specs: dict[str, FieldSpec], field: str) -> Optional[Step]:
    """The ``resize`` right after ``clips``, when it can run on each frame as it arrives."""
    nxt = steps[at + 1] if len(steps) > at + 1 else None
    if nxt is None or nxt.name != "resize" or nxt.random:
        return None
    cp, rp = steps[at].params, nxt.params
    if cp.short == "pad" and cp.pad == "zero" and getattr(rp, "keep_aspect", False) and getattr(rp, "pad_value", 0):
        return None   # a letterboxed black frame is not all zeros: leave resize to the clips, as without streaming
    try:
        return nxt if nxt.targets(steps[at].plan(specs)) == [field] else None
    except ValueError:
        return None


def whole_video_reason(decoders: dict[str, Any], steps: list[Step]) -> Optional[str]:
    """Why a recipe with a video field decodes each video whole (None when it streams or has no video)."""
    specs, _ = _field_specs(decoders)
    if not any(s.kind is Kind.VIDEO for s in specs.values()) or stream_plan(decoders, steps) is not None:
        return None
    at = next((i for i, s in enumerate(steps) if isinstance(s, Clips)), None)
    if at is None:
        return "no clips step: each video is held whole"
    i, bad = next(((i, s) for i, s in enumerate(steps[:at]) if not streams_frames(s)), (None, None))
    if bad is not None and bad.random:
        return (f"steps[{i}] {bad.name} before clips draws once per video (all its clips share the draw; "
                f"it cannot move past clips): each video is held whole")
    if bad is not None:
        return f"steps[{i}] {bad.name} before clips is not a per-frame step: each video is held whole"
    return "clips cuts more than one video field (or one not made by a streaming decoder): each video is held whole"


@STEPS.register()
class TemporalJitter(RandomStep):
    """Take ``length`` frames from a (T, H, W, C) clip: a random start, a stride drawn from
    ``strides``, and each index moved by up to ``jitter`` frames (kept in order); a clip shorter
    than the span repeats its last frame. The chosen indices are recorded. Every clip field of
    the sample gets the same indices (their frame counts must agree), and so does what describes
    the frames: the ``index`` fields with one value per frame (``clips``' ``index_field``),
    ``meta["clip"]`` (frames, pts, start) and the clip's audio, cut to the span of the kept frames
    (first to last, both whole); without ``clips``, the decoder's ``pts`` and audio track.
    Original copy: the centred span at the first stride, no jitter."""

    name = "temporal_jitter"
    applies = kinds(Kind.VIDEO)
    output_version = 3   # 2: the index field, clip meta and audio follow the kept frames
    # 3: a clip's audio holds round(span * N / T) samples, whatever the kept frames' place (it varied by one)

    class Params(RandomParams):
        length: int = Field(description="frames per output clip", json_schema_extra=checked(ge=1))
        strides: list[int] = Field([1], description="frame strides to draw from (1: consecutive frames)",
                                   json_schema_extra={"minItems": 1, "items": {"type": "integer", "minimum": 1}})
        jitter: int = Field(0, description="largest random offset, in frames, of each frame from its stride "
                            "position", json_schema_extra=checked(ge=0))

        @model_validator(mode="after")
        def _v(self):
            if self.length < 1:
                raise ValueError("length must be positive")
            if not self.strides or any(s < 1 for s in self.strides):
                raise ValueError("strides must be a non-empty list of positive integers")
            if self.jitter < 0:
                raise ValueError("jitter must be non-negative")
            return self

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=(self.params.length, *spec.shape[1:]))

    def _frames(self, sample, targets) -> int:
        ts = {f: sample.fields[f].shape[0] for f in targets}
        if len(set(ts.values())) > 1:
            raise ValueError(f"clips differ in length ({ts}); one draw needs one length")
        T = next(iter(ts.values()))
        if T < 1:
            raise ValueError("the clip has no frames")
        for f in targets:   # `length` frames of a size the plan may not know: checked before they are taken
            a = sample.fields[f]
            self.check_output_bytes((self.params.length, *a.shape[1:]), a.dtype, field=f)
        return T

    def sample_params(self, rng, sample, targets):
        T = self._frames(sample, targets)
        p = self.params
        stride = int(p.strides[int(rng.integers(0, len(p.strides)))])
        span = (p.length - 1) * stride + 1
        start = int(rng.integers(0, max(0, T - span) + 1))
        offsets = rng.integers(-p.jitter, p.jitter + 1, p.length) if p.jitter else None
        return {"indices": jitter_indices(T, p.length, stride, start, offsets)}

    def neutral_params(self, sample, targets):
        T = self._frames(sample, targets)
        stride = self.params.strides[0]
        span = (self.params.length - 1) * stride + 1
        return {"indices": jitter_indices(T, self.params.length, stride, max(0, (T - span) // 2))}

    def spans(self, T: Optional[int]) -> Optional[set[int]]:
        """The frame spans (last kept - first kept + 1) the draws may give on a clip of ``T`` frames; None
        when ``T`` is unknown or jitter moves the ends (any span)."""
        p = self.params
        if p.length == 1 or T == 1:
            return {1}
        if T is None or p.jitter:
            return None
        return {min((p.length - 1) * s + 1, T) for s in p.strides}

    def audio_spec(self, spec: FieldSpec, rate: Optional[int], video: FieldSpec) -> FieldSpec:
        """The spec of the clip's audio (the decoder's ``audio_field``) after this step: it spans the kept
        frames (:func:`follow_frames`), so a fixed length stays fixed, at :func:`span_samples`, only when every
        draw spans as many frames; otherwise its length varies with the draw."""
        if not spec.shape or spec.shape[-1] is None:
            return spec
        T = video.shape[0] if video.shape else None
        spans = self.spans(T)
        n = span_samples(next(iter(spans)), spec.shape[-1], T) if spans is not None and len(spans) == 1 else None
        return spec.with_(shape=(*spec.shape[:-1], n))

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        out = super().plan(specs)
        frames = {specs[f].shape[0] for f in self.targets(specs)}
        for f in frame_index_fields({f: s.kind for f, s in specs.items()},
                                    {f: s.shape for f, s in specs.items()}, frames):
            out[f] = specs[f].with_(shape=(self.params.length,))
        return out

    def replay(self, sample: Sample, params: dict[str, Any]) -> Sample:
        """The frames taken, and what describes them taken too: the clip's index field, its
        meta (source frames, pts, start) and its audio, cut to the kept frames' span."""
        out = super().replay(sample, params)
        targets = self._targets(sample)
        if not targets:
            return out
        return follow_frames(out, sample, targets, [int(i) for i in params["indices"]])

    def apply_video(self, a, indices: list[int], **_):
        if len(indices) != self.params.length:
            raise ValueError(f"expected {self.params.length} frame indices, got {len(indices)}")
        if max(indices) >= len(a) or min(indices) < 0:
            raise ValueError(f"frame index out of range for a clip of {len(a)} frames")
        return take_frames(a, indices)


def frame_index_fields(kinds_: dict[str, Kind], shapes: dict[str, tuple], frames: set) -> list[str]:
    """The ``index`` fields that list a clip's frames: one value per frame of the clip (``clips``'
    ``index_field``), i.e. 1-D with as many values as the clip (``frames``) has frames."""
    return [f for f, k in kinds_.items() if Kind.of(k) is Kind.INDEX and len(shapes[f]) == 1
            and shapes[f][0] is not None and shapes[f][0] in frames]


def follow_frames(out: Sample, before: Sample, targets: list[str], idx: list[int]) -> Sample:
    """``out`` (``before`` with the frames ``idx`` of its clip fields taken) with the index fields,
    ``meta["clip"]`` and the audio describing the taken frames; audio spans the kept frames
    ``idx[0]`` .. ``idx[-1]`` (both whole), whatever the stride between them: of a clip of ``T`` frames
    and ``n`` samples, :func:`span_samples` of the span from :func:`span_samples` of ``idx[0]`` (moved back
    when that would run past the end by the rounding), so a span of as many frames gets as many samples
    wherever it sits (:meth:`TemporalJitter.audio_spec` declares that length when every draw spans alike)."""
    T = before.fields[targets[0]].shape[0]
    new: dict[str, np.ndarray] = {}
    for f in frame_index_fields(before.kinds, {f: a.shape for f, a in before.fields.items()}, {T}):
        new[f] = take_frames(before.fields[f], idx)
    meta = dict(out.meta)
    clip = meta.get("clip")
    if isinstance(clip, dict) and len(clip.get("frames", ())) == T:
        clip = {**clip, "frames": [clip["frames"][i] for i in idx], "pts": [clip["pts"][i] for i in idx]}
        if clip["pts"][0] is not None:
            clip["start"] = clip["pts"][0]
        audio = clip.get("audio")
        afield = _audio_field(before, targets)
        if isinstance(audio, dict) and afield is not None:
            n = before.fields[afield].shape[1]
            count = span_samples(idx[-1] - idx[0] + 1, n, T)
            lo = min(span_samples(idx[0], n, T), n - count)
            new[afield] = np.ascontiguousarray(before.fields[afield][:, lo:lo + count])
            clip["audio"] = {**audio, "first_sample": int(audio["first_sample"]) + lo, "samples": count}
        meta["clip"] = clip
    else:
        new.update(_follow_track(before, targets, idx, meta))
    return out.replace_fields(new, meta=meta)


def span_samples(frames: int, n: int, T: int) -> int:
    """Samples of ``frames`` frames of a clip of ``T`` frames holding ``n`` audio samples:
    ``frames * n / T`` rounded half up, exactly (the same count wherever the frames sit in the clip)."""
    return (2 * frames * n + T) // (2 * T)


def _audio_field(sample: Sample, targets: list[str]) -> Optional[str]:
    """The audio field a clip field's decoder meta names (``audio_field``), if the sample has it."""
    for f in targets:
        m = sample.meta.get(f)
        a = m.get("audio") if isinstance(m, dict) else None
        if isinstance(a, dict) and a.get("field") in sample.fields:
            return a["field"]
    return None


def _follow_track(before: Sample, targets: list[str], idx: list[int], meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """A whole decoded video (no ``clips``): its ``pts`` become the kept frames' and its audio
    track is cut from the first kept frame's time to one frame after the last's."""
    new: dict[str, np.ndarray] = {}
    for f in targets:
        m = meta.get(f)
        if not isinstance(m, dict) or len(m.get("pts") or ()) != before.fields[f].shape[0]:
            continue
        pts = [m["pts"][i] for i in idx]
        m = {**m, "pts": pts}
        audio = m.get("audio")
        if isinstance(audio, dict) and audio.get("field") in before.fields and m.get("fps"):
            rate = int(audio["sample_rate"])
            t1 = pts[-1] + int(m.get("every", 1)) / float(m["fps"])   # the last kept frame, whole
            n = int(round((t1 - pts[0]) * rate))
            new[audio["field"]], first = cut_audio(before.fields[audio["field"]], rate,
                                                   float(audio.get("start", 0.0)), pts[0], n)
            m["audio"] = {**audio, "start": pts[0], "frames": n, "first_sample": first}
        meta[f] = m
    return new
