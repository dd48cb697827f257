"""The step interface, deterministic and random: pure kernels live in ``kernels``
(by domain); a step class only declares shapes, draws its parameters and applies them.

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
Annotations (``boxes``, ``keypoints``) are coordinates on the sample's grid: a step
that applies to them gets ``grid=(height, width)`` too, and a box it drops takes the
same row of every field tied to it (``box_labels``, ``keypoints``) with it
(:mod:`precompile.transforms.annotations`).
A step that ends up changing no field is a plan-time error, unless the recipe
says ``fields: []``.

Random steps (:class:`RandomStep`) draw their parameters once per sample from
the generator the engine gives them (``seeding.rng_for(seed, key, copy)``) and
record them, as plain JSON, in ``sample.meta["augment"]`` (``{"step": name,
**params}``, in step order). For the un-augmented original (copy 0 when
``copies > 0`` and ``keep_original``) the engine calls
:meth:`RandomStep.run_original`: the step's *neutral* parameters (no flip, no
jitter, the centred window), so the original has the augmented copies' shape.
:func:`replay` re-runs a recipe's steps from recorded parameters and
reproduces the stored bytes.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import StepError
from ..kinds import ANNOTATIONS, Kind
from ..sample import FieldSpec, Sample
from .annotations import move_annotations
from . import source_map


def in_words(b: int) -> str:
    """``b`` bytes as a budget message says them: ``24000000 bytes (22.9 MiB)``."""
    unit = next(((u, k) for u, k in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)) if b >= k),
                None)
    return f"{b} bytes ({b / unit[1]:.1f} {unit[0]})" if unit else f"{b} bytes"


class StepParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,  # a NaN option is a typo, never a value
                              defer_build=True)  # validators built on first use: only the steps a recipe names
    fields: Optional[list[str]] = None   # restrict the step to these fields (default: every field of a kind it handles)


class Step:
    name: ClassVar[str]
    applies: ClassVar[frozenset[Kind]] = frozenset()   # kinds this step transforms
    refuses: ClassVar[frozenset[Kind]] = frozenset()   # kinds it cannot handle (other kinds are kept)
    random: ClassVar[bool] = False      # draws from the rng (an augmentation)
    expands: ClassVar[bool] = False     # may turn one sample into several
    # maps every video frame alone and the same way (apply_video == the frames' apply, stacked): such a
    # deterministic step commutes with cutting clips, so before ``clips`` it still streams (temporal.stream_plan)
    per_frame: ClassVar[bool] = False
    # changes pixel values only, never where they are (a colour step): an image's map back to its source
    # (:mod:`precompile.transforms.source_map`) stays; a step that moves an image without a ``coord_map`` and
    # without this breaks that map (``Dataset.to_source`` then names it)
    keeps_grid: ClassVar[bool] = False
    Params: ClassVar[type[StepParams]] = StepParams
    #: the per-sample memory budget (the recipe sets it: limits.sample_bytes); a step whose output size the plan
    #: cannot know (it depends on each input) checks it with :meth:`check_output_bytes` before making the output
    max_bytes: int = 1 << 30
    #: the per-input memory budget (the recipe sets it: limits.input_bytes)
    input_bytes: int = 1 << 30

    def outputs(self, sample: Sample, rng: np.random.Generator) -> Iterable[Sample]:
        """The samples :meth:`run` returns, made as they are taken: an expanding step (``windows``, ``clips``,
        ``patches3d``) yields one at a time, so the build can spill them to disk as they come
        (:class:`~precompile.spill.SampleSpill`) instead of holding every one of an input at once."""
        return self.run(sample, rng)

    def check_output_bytes(self, shape: Sequence[int], dtype: Any, field: Optional[str] = None) -> None:
        """Raise StepError when an output of ``shape`` and ``dtype`` would take more than :attr:`max_bytes`
        (counted in Python integers: no overflow), before anything is allocated."""
        dt = np.dtype(dtype)
        n = dt.itemsize
        for d in shape:
            n *= int(d)
        if n > self.max_bytes:
            raise StepError(f"{self.name}: its output {tuple(int(d) for d in shape)} {dt} would take {in_words(n)}, "
                            f"over the per-sample budget of {in_words(self.max_bytes)} (limits.sample_bytes)",
                            field=field)

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

    def fill_values(self) -> dict[str, tuple[float, frozenset[Kind]]]:
        """The constants this step writes into arrays (a padding, a fill), as ``{option: (value, the kinds of
        the fields that get it)}``; only options that may be written with these params. Each must fit the
        field's dtype: checked at plan time against the field's spec and again on the array at apply time
        (:meth:`check_fills`), never wrapped around or cut silently."""
        return {}

    def check_fills(self, field: str, kind: Kind, dtype: Any) -> None:
        """ValueError when a value of :meth:`fill_values` meant for a field of ``kind`` does not fit ``dtype``."""
        for option, (value, to) in self.fill_values().items():
            if kind in to:
                check_fill(option, value, field, dtype)

    def plan(self, specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
        out = dict(specs)
        for f in self.targets(specs):
            if specs[f].kind in ANNOTATIONS:   # moved rows may be dropped: their count is known per sample only
                for g in [f, *(t for t, s in specs.items() if s.of == f and s.kind in ANNOTATIONS)]:
                    out[g] = out[g].with_(shape=(None, *out[g].shape[1:]))
            else:
                self.check_fills(f, specs[f].kind, specs[f].dtype)
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
        new = apply_fields(self, sample, targets, lambda f: params)
        meta = sample.meta
        if self.random and params:
            meta = dict(meta)
            meta["augment"] = [*meta.get("augment", []), {"step": self.name, **params}]
        meta = source_map.track(self, sample, targets, lambda f: params, meta)
        return [sample.replace_fields(new, meta=meta)]


def apply_fields(step: Step, sample: Sample, targets: list[str],
                 params_of: Callable[[str], dict[str, Any]]) -> dict[str, np.ndarray]:
    """``{field: new array}`` for ``targets``: grid fields through ``step.apply(array, kind, **params)``,
    annotation fields (boxes, keypoints) through :func:`~precompile.transforms.annotations.move_annotations`
    (which also drops the rows of fields tied to a dropped box and renumbers a tied instance mask).
    Errors name the step and field."""
    new = {}
    notes = []
    for f in targets:
        if sample.kinds[f] in ANNOTATIONS:
            notes.append(f)
            continue
        try:
            step.check_fills(f, sample.kinds[f], sample.fields[f].dtype)
            new[f] = step.apply(sample.fields[f], sample.kinds[f], **params_of(f))
        except StepError:
            raise
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise StepError(f"{step.name}: {e}", field=f) from e
    if notes:
        new.update(move_annotations(step, sample, notes, params_of, new))
    return new


def value_range(dtype: Any) -> Optional[tuple[Any, Any]]:
    """The least and greatest value a ``dtype`` holds (integers and floats; None for any other)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return int(info.min), int(info.max)
    if dt.kind == "f":
        finfo = np.finfo(dt)
        return finfo.min, finfo.max
    return None


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def check_fill(option: str, value: float, field: str, dtype: Any) -> None:
    """ValueError naming the option, the value, the field and its dtype's range when ``value`` is outside the
    range ``dtype`` holds (stored, it would wrap around: -7 in uint8 is 249)."""
    r = value_range(dtype)
    if r is not None and not float(r[0]) <= value <= float(r[1]):   # Python floats: no cast to the dtype
        raise ValueError(f"{option} {_num(value)} is outside the range of field {field!r}: its dtype "
                         f"{np.dtype(dtype).name} holds {r[0]!s} to {r[1]!s}; give a value in that range")


def follow_flows(specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """Give every ``flow_valid`` spec its flow's grid: (H, W, 1) uint8 of the flow's (H, W)."""
    out = dict(specs)
    for f, s in specs.items():
        if s.kind is Kind.FLOW_VALID and s.of in specs:
            out[f] = s.with_(shape=tuple(specs[s.of].shape[:-1]) + (1,), dtype="uint8")
    return out


def range_param(v: Any, what: str, symmetric_about: float | None = None, lo_min: float | None = None) -> list[float]:
    """A number or [lo, hi] -> [lo, hi]. A number x means [c - x, c + x] about ``symmetric_about``
    (or exactly x when that is None)."""
    if isinstance(v, bool):
        raise ValueError(f"{what}: expected a number or [low, high], got {v!r}")
    if isinstance(v, (int, float)):
        if symmetric_about is None:
            lo = hi = float(v)
        else:
            if v < 0:
                raise ValueError(f"{what}: expected a non-negative number, got {v!r}")
            lo, hi = symmetric_about - float(v), symmetric_about + float(v)
    elif isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in v):
        lo, hi = float(v[0]), float(v[1])
    else:
        raise ValueError(f"{what}: expected a number or [low, high], got {v!r}")
    if lo > hi:
        raise ValueError(f"{what}: low {lo} is above high {hi}")
    if lo_min is not None:
        lo = max(lo, lo_min)
        if hi < lo_min:
            raise ValueError(f"{what}: must be at least {lo_min}")
    return [lo, hi]


def nonnegative_range(v: Any, what: str) -> list[float]:
    """:func:`range_param` for amounts that cannot be negative (a noise std, a displacement)."""
    lo, hi = range_param(v, what)
    if lo < 0:
        raise ValueError(f"{what} must be non-negative")
    return [lo, hi]


def uniform(rng: np.random.Generator, r: Sequence[float]) -> float:
    return float(r[0]) + 0.0 if r[0] == r[1] else float(rng.uniform(r[0], r[1]))  # + 0.0: no -0.0


def draw_seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2 ** 63 - 1))


class RandomParams(StepParams):
    model_config = ConfigDict(validate_default=True)  # defaults go through the same validators


class _NoRng:
    """Stands in for the generator where none may be used (replaying deterministic steps)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("a deterministic step tried to draw random numbers during replay")


class RandomStep(Step):
    """A step that draws its parameters from the rng; see the module docstring."""

    random = True

    def neutral_params(self, sample: Sample, targets: list[str]) -> dict[str, Any]:
        """The parameters of the un-augmented original (identity, or the centred window)."""
        raise NotImplementedError

    def field_params(self, params: dict[str, Any], field: str) -> dict[str, Any]:
        """The keyword arguments ``apply`` gets for one field (default: all of ``params``)."""
        return params

    def _targets(self, sample: Sample) -> list[str]:
        try:
            return self.targets(sample.specs())
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e

    def replay(self, sample: Sample, params: dict[str, Any]) -> Sample:
        """Apply ``params`` (drawn or recorded) to every target field and record them in meta."""
        targets = self._targets(sample)
        if not targets:
            return sample
        new = apply_fields(self, sample, targets, lambda f: self.field_params(params, f))
        meta = dict(sample.meta)
        meta["augment"] = [*meta.get("augment", []), {"step": self.name, **params}]
        meta = source_map.track(self, sample, targets, lambda f: self.field_params(params, f), meta)
        return sample.replace_fields(new, meta=meta)

    def run(self, sample: Sample, rng: np.random.Generator) -> list[Sample]:
        targets = self._targets(sample)
        if not targets:
            return [sample]
        try:
            params = self.sample_params(rng, sample, targets)
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e
        return [self.replay(sample, params)]

    def run_original(self, sample: Sample) -> list[Sample]:
        """The un-augmented original: the step with its neutral parameters (recorded too)."""
        targets = self._targets(sample)
        if not targets:
            return [sample]
        try:
            params = self.neutral_params(sample, targets)
        except ValueError as e:
            raise StepError(f"{self.name}: {e}") from e
        return [self.replay(sample, params)]


def replay_step(step: Step, sample: Sample, params: dict[str, Any]) -> Sample:
    """Apply one random step's recorded ``params`` (its record without ``"step"``) to ``sample``.

    Steps of this module use :meth:`RandomStep.replay`; any other non-expanding random step is
    replayed the way ``Step.run`` applies parameters: ``apply(array, kind, **params)`` on every
    target field, the record appended to ``meta["augment"]``.
    """
    if isinstance(step, RandomStep):
        return step.replay(sample, params)
    if step.expands:
        raise ValueError(f"step {step.name!r} expands samples and cannot be replayed from records")
    targets = step.targets(sample.specs())
    if not targets:
        return sample
    new = apply_fields(step, sample, targets, lambda f: params)
    meta = dict(sample.meta)
    if params:
        meta["augment"] = [*meta.get("augment", []), {"step": step.name, **params}]
    meta = source_map.track(step, sample, targets, lambda f: params, meta)
    return sample.replace_fields(new, meta=meta)


def replay(steps: Sequence[Step], sample: Sample, records: Sequence[dict[str, Any]]) -> list[Sample]:
    """Re-run ``steps`` on a decoded ``sample`` with the random steps' recorded parameters
    (``meta["augment"]`` of a stored sample) instead of new draws; returns the samples the
    build wrote for that copy. Raises ValueError if the records do not fit the steps."""
    todo = list(records)
    samples = [sample.replace_fields({}, meta=source_map.start(sample))]   # the decode's map, as the build starts
    for step in steps:
        if len(samples) != 1:
            raise ValueError("replay does not follow expanding steps (one sample became several)")
        out: list[Sample] = []
        for s in samples:
            if not step.random:
                out.extend(step.run(s, _NoRng()))  # type: ignore[arg-type]
                continue
            if not step.targets(s.specs()):
                out.append(s)
                continue
            if not todo:
                raise ValueError(f"no record left for step {step.name!r}")
            rec = dict(todo.pop(0))
            name = rec.pop("step", None)
            if name != step.name:
                raise ValueError(f"the next record is for {name!r}, not {step.name!r}")
            out.append(replay_step(step, s, rec))
        samples = out
    if todo:
        raise ValueError(f"{len(todo)} record(s) left over after the last step")
    return [source_map.settle(s) for s in samples]   # as the build's run_steps ends
