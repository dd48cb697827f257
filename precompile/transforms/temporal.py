"""Temporal steps on clips: the expanding ``clips`` and the random ``temporal_jitter``.

One decoded video (T, H, W, C) becomes many clips of ``length`` frames taking
every ``every``-th frame, a new clip starting every ``stride`` frames. Each clip
gets the key ``<key>#clip<n>`` and ``meta["clip"]`` = {index, frames (source
frame indices), fps}; ``index_field`` also stores the indices as an int32 (T,)
field. Videos shorter than one clip are dropped or padded (``short``), padding
by repeating the last frame or with black frames (index -1).
"""
from __future__ import annotations

from typing import Literal, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..errors import StepError
from ..kinds import Kind, kinds
from ..registry import STEPS
from ..sample import FieldSpec, Sample
from .base import RandomParams, RandomStep, Step, StepParams
from .kernels.temporal import clip_starts, jitter_indices, take_frames, take_padded


@STEPS.register()
class Clips(Step):
    """Cut videos into clips: ``length`` frames, ``every`` k-th frame, a clip start every ``stride`` frames."""

    name = "clips"
    applies = kinds(Kind.VIDEO)
    expands = True

    class Params(StepParams):
        length: int = Field(ge=1)                 # frames per clip (T)
        every: int = Field(1, ge=1)               # take every k-th frame inside a clip
        stride: Optional[int] = Field(None, ge=1)  # frames between clip starts (default: the clip's span, no overlap)
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

    @property
    def span(self) -> int:
        return (self.params.length - 1) * self.params.every + 1

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=(self.params.length, *spec.shape[1:]))

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        out = super().plan(specs)
        if self.params.index_field is not None:
            if self.params.index_field in specs:
                raise ValueError(f"index_field {self.params.index_field!r} clashes with an existing field")
            out[self.params.index_field] = FieldSpec(Kind.INDEX, (self.params.length,), "int32")
        return out

    def clip_indices(self, n: int) -> list[list[int]]:
        """Per clip, the positions (into the decoded frames) it takes; may run past ``n`` when padding."""
        p = self.params
        stride = p.stride or self.span
        starts = clip_starts(n, self.span, stride, p.short)
        if p.max_clips is not None:
            starts = starts[:p.max_clips]
        return [[s + j * p.every for j in range(p.length)] for s in starts]

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        specs = sample.specs()
        targets = self.targets(specs)
        if not targets:
            return [sample]
        n = len(sample.fields[targets[0]])
        for f in targets[1:]:
            if len(sample.fields[f]) != n:
                raise StepError(f"clips: videos differ in length ({targets[0]}: {n}, {f}: "
                                f"{len(sample.fields[f])} frames)", field=f)
        src_meta = sample.meta.get(targets[0], {}) if isinstance(sample.meta.get(targets[0]), dict) else {}
        dec_every = int(src_meta.get("every", 1))
        fps = src_meta.get("fps")
        out = []
        for ci, idx in enumerate(self.clip_indices(n)):
            new = {}
            src = None
            for f in targets:
                new[f], src = take_padded(sample.fields[f], idx, self.params.pad)
            frames = [i * dec_every if i >= 0 else -1 for i in src]
            if self.params.index_field is not None:
                new[self.params.index_field] = np.asarray(frames, dtype=np.int32)
            kinds = dict(sample.kinds)
            if self.params.index_field is not None:
                kinds[self.params.index_field] = Kind.INDEX
            meta = dict(sample.meta)
            meta["clip"] = {"index": ci, "frames": frames, "fps": fps}
            out.append(sample.replace_fields(new, key=f"{sample.key}#clip{ci}", meta=meta, kinds=kinds))
        return out


@STEPS.register()
class TemporalJitter(RandomStep):
    """Take ``length`` frames from a (T, H, W, C) clip: a random start, a stride drawn from
    ``strides``, and each index moved by up to ``jitter`` frames (kept in order); a clip shorter
    than the span repeats its last frame. The chosen indices are recorded. Every clip field of
    the sample gets the same indices (their frame counts must agree). Original copy: the centred
    span at the first stride, no jitter."""

    name = "temporal_jitter"
    applies = kinds(Kind.VIDEO)

    class Params(RandomParams):
        length: int
        strides: list[int] = [1]
        jitter: int = 0

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

    def apply_video(self, a, indices: list[int], **_):
        if len(indices) != self.params.length:
            raise ValueError(f"expected {self.params.length} frame indices, got {len(indices)}")
        if max(indices) >= len(a) or min(indices) < 0:
            raise ValueError(f"frame index out of range for a clip of {len(a)} frames")
        return take_frames(a, indices)
