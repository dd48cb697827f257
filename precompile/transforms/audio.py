"""Audio steps on (C, N) fields: ``fix_length`` (crop or pad) and the expanding ``windows``.

``windows`` cuts one recording into many samples of ``length`` samples every
``hop``; each gets the key ``<key>#w<n>`` and its start offset in
``meta["window"]``. Parameters are computed once per sample from the first
targeted field and applied to every audio field alike.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..errors import StepError
from ..kinds import Kind, kinds
from ..registry import STEPS
from ..sample import FieldSpec, Sample
from . import functional as F
from .base import Step, StepParams

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
        length: int = Field(ge=1)
        align: Literal["start", "center", "end"] = "start"
        pad_value: float = 0

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(spec.shape[:-1]) + (self.params.length,))

    def apply_audio(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return F.fix_length(a, self.params.length, self.params.align, self.params.pad_value)[0]


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
        length: int = Field(ge=1)
        hop: int = Field(ge=1)
        short: Literal["drop", "pad"] = "drop"
        tail: Literal["drop", "pad"] = "drop"
        pad_value: float = 0

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        return spec.with_(shape=tuple(spec.shape[:-1]) + (self.params.length,))

    def starts(self, n: int) -> list[int]:
        p = self.params
        s = F.clip_starts(n, p.length, p.hop, p.short)
        if p.tail == "pad" and n >= p.length and s[-1] + p.length < n:
            s.append(s[-1] + p.hop)
        return s

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        specs = sample.specs()
        targets = self.targets(specs)
        if not targets:
            return [sample]
        n = sample.fields[targets[0]].shape[-1]
        for f in targets[1:]:
            if sample.fields[f].shape[-1] != n:
                raise StepError(f"windows: audio fields differ in length ({targets[0]}: {n}, "
                                f"{f}: {sample.fields[f].shape[-1]})", field=f)
        out = []
        for i, s in enumerate(self.starts(n)):
            new = {}
            for f in targets:
                a = sample.fields[f]
                seg = a[..., s:s + self.params.length]
                if seg.shape[-1] < self.params.length:
                    seg = F.fix_length(seg, self.params.length, "start", self.params.pad_value)[0]
                new[f] = np.array(seg, order="C", copy=True)
            meta = _with_meta(sample.meta, "window", {"index": i, "start": int(s), "length": self.params.length})
            out.append(sample.replace_fields(new, key=f"{sample.key}#w{i}", meta=meta))
        return out
