"""The step interface: pure kernels live in ``functional``; a step class only
declares shapes, draws its parameters and applies them.

``Step.run`` takes one sample and returns a list of samples: ordinary steps
return one; expanding steps (3D patches, video clips, audio windows) return
many. Parameters are drawn once per sample (``sample_params``) and applied to
every targeted field, so an image pair, its flow and its mask move together.

Kinds (:mod:`precompile.kinds`) decide what a step does to a field, and only
these three class attributes decide it:

- ``applies``: the kinds it transforms. ``apply(array, kind, **params)``
  dispatches to ``apply_<kind>``; families give defaults (a mask uses the image
  kernel with nearest neighbour, a video maps the image kernel over its frames).
- ``refuses``: kinds it cannot handle. A field of such a kind in the sample is
  a plan-time error naming step, field and kind, unless ``fields:`` names the
  fields to change (so leaving one behind is always a written decision).
- every other kind is kept as it is (a colour step keeps masks and flow; any
  step keeps labels).

``flow_valid`` is never transformed: it is derived from its flow field (see
:class:`precompile.sample.Sample`), and its planned shape follows the flow's.
A step that ends up changing no field is a plan-time error, unless the recipe
says ``fields: []``.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import StepError
from ..kinds import Kind
from ..sample import FieldSpec, Sample


class StepParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    fields: Optional[list[str]] = None   # restrict the step to these fields (default: every field of a kind it handles)


class Step:
    name: ClassVar[str]
    applies: ClassVar[frozenset[Kind]] = frozenset()   # kinds this step transforms
    refuses: ClassVar[frozenset[Kind]] = frozenset()   # kinds it cannot handle (other kinds are kept)
    random: ClassVar[bool] = False      # draws from the rng (an augmentation)
    expands: ClassVar[bool] = False     # may turn one sample into several
    Params: ClassVar[type[StepParams]] = StepParams

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        legacy = cls.__dict__.get("kinds")  # a plain set of kind names, as user steps may declare
        if legacy is not None and "applies" not in cls.__dict__:
            cls.applies = frozenset(Kind.of(k) for k in legacy)
        if "refuses" in cls.__dict__:
            cls.refuses = frozenset(Kind.of(k) for k in cls.refuses)

    def __init__(self, params: StepParams | None = None):
        self.params = params if params is not None else self.Params()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"

    @classmethod
    def rule(cls, kind: Kind | str) -> str:
        """What this step does to a field of ``kind``: ``"apply"``, ``"keep"`` or ``"refuse"``."""
        kind = Kind.of(kind)
        if kind in cls.applies:
            return "apply"
        if kind in cls.refuses:
            return "refuse"
        return "keep"

    # -- planning ----------------------------------------------------------------
    def _handles(self) -> str:
        return ", ".join(sorted(k.value for k in self.applies)) or "no kind"

    def targets(self, specs: dict[str, FieldSpec]) -> list[str]:
        """The fields this step changes; raises ValueError for a field it cannot handle, and when it
        would change nothing (unless the recipe says ``fields: []``)."""
        if self.params.fields is not None:
            for f in self.params.fields:
                if f not in specs:
                    raise ValueError(f"no field {f!r} (fields: {', '.join(specs)})")
                k = specs[f].kind
                if k is Kind.FLOW_VALID and k not in self.applies:
                    raise ValueError(f"field {f!r} is a flow_valid field: it is derived from its flow field "
                                     f"{specs[f].of!r}; name that one")
                if k not in self.applies:
                    raise ValueError(f"cannot handle field {f!r} of kind {k.value} (handles {self._handles()})")
            return list(self.params.fields)
        for f, s in specs.items():
            if s.kind in self.refuses:
                raise ValueError(f"cannot handle field {f!r} of kind {s.kind.value} (handles {self._handles()}); "
                                 f"name the fields it should change with fields: [...]")
        out = [f for f, s in specs.items() if s.kind in self.applies]
        if not out:
            have = ", ".join(f"{f} ({s.kind.value})" for f, s in specs.items()) or "none"
            raise ValueError(f"matches no field: it changes {self._handles()} fields and the sample has {have}; "
                             f"remove the step, or say fields: [] to keep it doing nothing")
        return out

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        """The spec this step produces from ``spec``; raise ValueError if it cannot apply."""
        return spec

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        out = dict(specs)
        for f in self.targets(specs):
            out[f] = self.output_spec(specs[f])
        return follow_flows(out)

    # -- running -----------------------------------------------------------------
    def sample_params(self, rng: np.random.Generator, sample: Sample, targets: list[str]) -> dict[str, Any]:
        """Draw (or compute) this step's parameters for one sample; JSON-able values."""
        return {}

    def apply(self, array: np.ndarray, kind: Kind, **params: Any) -> np.ndarray:
        """Apply to one field: dispatches to ``apply_<kind>``."""
        fn = getattr(self, f"apply_{Kind.of(kind).value}", None)
        if fn is None:
            raise ValueError(f"{self.name} cannot handle a {Kind.of(kind).value} field")
        return fn(array, **params)

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        specs = sample.specs()
        try:
            targets = self.targets(specs)
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e
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


def follow_flows(specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """Give every ``flow_valid`` spec its flow's grid: (H, W, 1) uint8 of the flow's (H, W)."""
    out = dict(specs)
    for f, s in specs.items():
        if s.kind is Kind.FLOW_VALID and s.of in specs:
            out[f] = s.with_(shape=tuple(specs[s.of].shape[:-1]) + (1,), dtype="uint8")
    return out
