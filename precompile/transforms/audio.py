"""Audio steps on (C, N) fields: ``fix_length`` (crop or pad), the expanding ``windows``, and the
random ``random_gain`` and ``time_shift``.

``windows`` cuts one recording into many samples of ``length`` samples every
``hop``; each gets the key ``<key>#w<n>`` and its start offset in
``meta["window"]``. Parameters are computed once per sample from the first
targeted field and applied to every audio field alike.
"""
from __future__ import annotations

from typing import Any, Iterator, Literal, Optional, Union

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..errors import StepError
from ..kinds import Kind, kinds
from ..optschema import checked
from ..registry import STEPS
from ..sample import FieldSpec, Sample
from .base import RandomParams, RandomStep, Step, StepParams, range_param, uniform
from .kernels.audio import apply_gain, fix_length, shift_time
from .kernels.temporal import clip_starts


AUDIO = kinds(Kind.AUDIO)


def _with_meta(meta: dict, name: str, value: Any) -> dict:
    out = dict(meta)
    out[name] = value
    return out


@STEPS.register()
class FixLength(Step):
    """Crop or pad every audio field to ``length`` samples (``align`` start|center|end, pad with ``pad_value``)."""

    name = "fix_length"
    applies = AUDIO

    class Params(StepParams):
        length: int = Field(ge=1, description="samples per channel in the output")
        align: Literal["start", "center", "end"] = Field("start", description="which part is kept when cutting "
                                                         "and where the audio sits when padding")
        pad_value: float = Field(0, description="the value of padded samples")

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(spec.shape[:-1]) + (self.params.length,))

    def fill_values(self):
        return {"pad_value": (self.params.pad_value, AUDIO)}

    def apply_audio(self, a: np.ndarray, **_: Any) -> np.ndarray:
        self.check_output_bytes((*a.shape[:-1], self.params.length), a.dtype)   # channels the plan may not know
        return fix_length(a, self.params.length, self.params.align, self.params.pad_value)[0]


@STEPS.register()
class Windows(Step):
    """Cut audio into windows of ``length`` samples every ``hop``: one recording -> many samples.

    ``short: drop`` skips recordings shorter than one window, ``pad`` pads them to
    one; ``tail: pad`` adds a last, padded window for the samples after the last
    full one (``drop`` leaves them out)."""

    name = "windows"
    applies = AUDIO
    expands = True

    class Params(StepParams):
        length: int = Field(ge=1, description="samples per window")
        hop: int = Field(ge=1, description="samples between window starts")
        short: Literal["drop", "pad"] = Field("drop", description="audio shorter than one window: drop it or pad "
                                              "it to one window")
        tail: Literal["drop", "pad"] = Field("drop", description="a last partial window: drop it or pad it")
        pad_value: float = Field(0, description="the value of padded samples")

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(spec.shape[:-1]) + (self.params.length,))

    def fill_values(self):
        p = self.params
        return {"pad_value": (p.pad_value, AUDIO)} if "pad" in (p.short, p.tail) else {}

    def starts(self, n: int) -> list[int]:
        p = self.params
        s = clip_starts(n, p.length, p.hop, p.short)
        if p.tail == "pad" and n >= p.length and s[-1] + p.length < n:
            s.append(s[-1] + p.hop)
        return s

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        return list(self.outputs(sample, rng))

    def outputs(self, sample: Sample, rng: np.random.Generator) -> Iterator[Sample]:
        """The windows one at a time (the build spills them past a bound: an hour's recording cut every half
        second is 7,200 windows, more than memory should hold at once)."""
        specs = sample.specs()
        targets = self.targets(specs)
        if not targets:
            yield sample
            return
        n = sample.fields[targets[0]].shape[-1]
        for f in targets:
            try:
                self.check_fills(f, sample.kinds[f], sample.fields[f].dtype)
            except ValueError as e:
                raise StepError(f"windows: {e}", field=f) from e
        for f in targets[1:]:
            if sample.fields[f].shape[-1] != n:
                raise StepError(f"windows: audio fields differ in length ({targets[0]}: {n}, "
                                f"{f}: {sample.fields[f].shape[-1]})", field=f)
        for f in targets:   # one window (a short recording padded to it) of a channel count the plan may not know
            a = sample.fields[f]
            self.check_output_bytes((*a.shape[:-1], self.params.length), a.dtype, field=f)
        starts = self.starts(n)
        for i, s in enumerate(starts):
            new = {}
            for f in targets:
                a = sample.fields[f]
                seg = a[..., s:s + self.params.length]
                if seg.shape[-1] < self.params.length:
                    seg = fix_length(seg, self.params.length, "start", self.params.pad_value)[0]
                new[f] = np.array(seg, order="C", copy=True)
            meta = _with_meta(sample.meta, "window", {"index": i, "start": int(s), "length": self.params.length})
            yield sample.replace_fields(new, key=f"{sample.key}#w{i}", meta=meta)


@STEPS.register()
class RandomGain(RandomStep):
    """Multiply (C, N) audio by a gain drawn uniformly in decibels from ``db`` (x means [-x, x]);
    ``clip: true`` clips float audio to [-1, 1]. Integer (int16) audio is scaled in float, rounded and
    saturated to its dtype's range (its full scale: what ``clip`` means there). Original copy: 0 dB."""

    name = "random_gain"
    applies = kinds(Kind.AUDIO)
    output_version = 2   # 2: int16 audio scaled in float and saturated (the gain was cast to int16: 0 or 1)

    class Params(RandomParams):
        db: Union[float, list[float]] = Field(6.0, description="gain in decibels: x for [-x, x], or [low, high]",
                                              json_schema_extra=checked(ge=0))
        clip: bool = Field(False, description="clip the result to [-1, 1] (int16 audio: always saturated to "
                           "its full scale, -32768..32767)")

        @field_validator("db", mode="before")
        @classmethod
        def _d(cls, v: Any) -> Any:
            return range_param(v, "db", symmetric_about=0.0)

    def sample_params(self, rng, sample, targets):
        return {"gain_db": uniform(rng, self.params.db)}

    def neutral_params(self, sample, targets):
        return {"gain_db": 0.0}

    def apply_audio(self, a, gain_db: float, **_):
        if gain_db == 0 and not self.params.clip:
            return a.copy()
        return apply_gain(a, gain_db, self.params.clip)


@STEPS.register()
class TimeShift(RandomStep):
    """Shift (C, N) audio in time by a whole number of samples drawn uniformly from
    [-m, m], m = ``max_shift`` samples or ``max_fraction`` of the length; ``mode: roll`` wraps
    around, ``zero`` pads with silence. Original copy: no shift."""

    name = "time_shift"
    applies = kinds(Kind.AUDIO)

    class Params(RandomParams):
        max_shift: Optional[int] = Field(None, description="largest shift in samples (default: max_fraction of "
                                         "the length)", json_schema_extra=checked(ge=0))
        max_fraction: float = Field(0.1, description="largest shift as a fraction of the length",
                                    json_schema_extra=checked(ge=0, le=1))
        mode: Literal["roll", "zero"] = Field("roll", description="roll wraps around; zero pads with silence")

        @model_validator(mode="after")
        def _v(self):
            if self.max_shift is not None and self.max_shift < 0:
                raise ValueError("max_shift must be non-negative")
            if not 0 <= self.max_fraction <= 1:
                raise ValueError("max_fraction must be within [0, 1]")
            return self

    def sample_params(self, rng, sample, targets):
        ns = {f: sample.fields[f].shape[-1] for f in targets}
        n = min(ns.values())
        m = self.params.max_shift if self.params.max_shift is not None else int(self.params.max_fraction * n)
        m = min(m, n)
        return {"shift": int(rng.integers(-m, m + 1))}

    def neutral_params(self, sample, targets):
        return {"shift": 0}

    def apply_audio(self, a, shift: int, **_):
        if abs(shift) > a.shape[-1]:
            raise ValueError(f"shift {shift} is longer than the {a.shape[-1]} samples")
        return shift_time(a, shift, self.params.mode)
