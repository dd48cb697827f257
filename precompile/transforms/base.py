"""The step interface: pure kernels live in ``functional``; a step class only
declares shapes, draws its parameters and applies them.

``Step.run`` takes one sample and returns a list of samples: ordinary steps
return one; expanding steps (3D patches, video clips, audio windows) return
many. Parameters are drawn once per sample (``sample_params``) and applied to
every targeted field, so an image pair, its flow and its mask move together.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import StepError
from ..sample import FieldSpec, Sample


class StepParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    fields: Optional[list[str]] = None   # restrict the step to these fields (default: every field of a kind it handles)


class Step:
    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]] = frozenset()
    random: ClassVar[bool] = False      # draws from the rng (an augmentation)
    expands: ClassVar[bool] = False     # may turn one sample into several
    Params: ClassVar[type[StepParams]] = StepParams

    def __init__(self, params: StepParams | None = None):
        self.params = params if params is not None else self.Params()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"

    # -- planning ----------------------------------------------------------------
    def targets(self, specs: dict[str, FieldSpec]) -> list[str]:
        """The fields this step changes; raises ValueError for a bad ``fields`` list."""
        if self.params.fields is not None:
            for f in self.params.fields:
                if f not in specs:
                    raise ValueError(f"no field {f!r} (fields: {', '.join(specs)})")
                if specs[f].kind not in self.kinds:
                    raise ValueError(f"cannot apply to field {f!r} of kind {specs[f].kind!r} "
                                     f"(handles {', '.join(sorted(self.kinds))})")
            return list(self.params.fields)
        return [f for f, s in specs.items() if s.kind in self.kinds]

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        """The spec this step produces from ``spec``; raise ValueError if it cannot apply."""
        return spec

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        out = dict(specs)
        for f in self.targets(specs):
            out[f] = self.output_spec(specs[f])
        return out

    # -- running -----------------------------------------------------------------
    def sample_params(self, rng: np.random.Generator, sample: Sample, targets: list[str]) -> dict[str, Any]:
        """Draw (or compute) this step's parameters for one sample; JSON-able values."""
        return {}

    def apply(self, array: np.ndarray, kind: str, **params: Any) -> np.ndarray:
        raise NotImplementedError

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        specs = sample.specs()
        targets = self.targets(specs)
        if not targets:
            return [sample]
        params = self.sample_params(rng, sample, targets)
        new = {}
        for f in targets:
            try:
                new[f] = self.apply(sample.fields[f], sample.kinds[f], **params)
            except StepError:
                raise
            except (ValueError, TypeError, IndexError) as e:
                raise StepError(f"{self.name}: {e}", field=f) from e
        meta = sample.meta
        if self.random and params:
            meta = dict(meta)
            meta["augment"] = [*meta.get("augment", []), {"step": self.name, **params}]
        return [sample.replace_fields(new, meta=meta)]
