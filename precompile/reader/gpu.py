"""The torch side of the Loader: device choice, batch conversion, seeded batch steps, the CUDA ring.

- :func:`resolve_device` turns ``"auto" | "cpu" | "cuda[:i]"`` into a torch
  device with an explicit index (``cuda`` is the current device), and refuses
  ``cuda`` clearly when torch has no CUDA. :func:`thread_init` makes gather
  threads use that device.
- :class:`Convert` turns a stored field into what training wants, on the
  batch's device: uint8 -> float32/float16/bfloat16 scaled to [0, 1], then
  ``(x - mean) / std`` per channel (last axis), optionally NHWC -> NCHW (a
  permuted view: channels_last memory, free).
- Batch steps (:class:`RandomFlip`, :class:`RandomCrop`) are the build's
  ``random_flip`` and ``random_crop``: the same names, options and per-kind
  rules (flow vectors follow a flip, flow pads with NaN, masks with 0; a field
  of a refused kind is an error). They draw their parameters with numpy from
  ``seeding.stream(seed, epoch, rank, batch, step, 3)`` and apply them with torch
  ops on whatever device the batch is on, so CPU and CUDA get the same crops
  and flips. Draw once per sample, apply to every field the step covers. On
  CUDA the parameters go to the device from pinned memory, asynchronously on
  the side stream. Steps are bound in order (:func:`bind_steps`): each sees the
  shapes the one before it made (a crop's size, then a flip about that grid).
  A box a step drops takes its tied rows along and renumbers a tied instance
  mask (:func:`renumber_masks`, the build's rule). :func:`device_maps` gives
  each sample's map from the batch back to the stored sample (the steps'
  ``coord_map`` for its draws, inverted and composed): what
  ``Loader.batch_maps`` reports for ``Dataset.to_source``.
- :class:`CudaRing` holds the pinned host buffers (allocated once), the side
  stream and one event per slot: host-to-device copies (uint8 over the bus)
  and the conversion run on the side stream while the previous batch trains;
  the consumer's stream waits on an event, and a slot is refilled only after
  its copy's event has completed.

Only the Loader imports this module; torch is never imported by the build.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import torch

from ..errors import PrecompileError, clip, did_you_mean, echo
from ..kinds import ANNOTATIONS, Kind
from ..optschema import refuse_coercion
from ..seeding import stream
from ..transforms import geometry
from .ragged import move_annotations
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without CUDA is a :class:`PrecompileError`."""
    if device is None or device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PrecompileError(
            f"Loader(device={str(device)!r}): this torch ({torch.__version__}) sees no CUDA device; "
            f"use device='cpu' (same batches, no pinning) or device='auto' (CUDA when present)")
    if dev.type not in ("cpu", "cuda"):
        raise PrecompileError(f"Loader(device={str(device)!r}): only 'cpu', 'cuda' and 'auto' are supported")
    if dev.type == "cuda" and dev.index is None:
        # pin the index now: streams, events and copies must all use the device current at construction,
        # not whatever a gather thread or a later torch.cuda.set_device makes current
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def thread_init(device: torch.device) -> dict[str, Any]:
    """``ThreadPoolExecutor`` keyword arguments that make each gather thread use ``device``
    (CUDA's current device is per thread, and new threads start on device 0)."""
    if device.type == "cuda":
        return {"initializer": torch.cuda.set_device, "initargs": (device,)}
    return {}


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array as a tensor on ``device``. On CUDA the copy is asynchronous: the array is
    copied to pinned memory first (a pageable source would make the host wait for the stream);
    PyTorch's pinned-memory allocator keeps that block until the copy's stream has used it."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def torch_dtype(dtype: Any) -> torch.dtype | None:
    """``None`` (keep stored dtype) or a float torch dtype from a name or a torch dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float type, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES)} or a torch float dtype, got {dtype!r}")


def numpy_to_torch_dtype(dt: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dt)).dtype


# -- conversion ---------------------------------------------------------------------------
@dataclass
class Convert:
    """uint8 (or any) -> ``dtype``; uint8 is scaled by 1/255; then per-channel ``(x - mean) / std``;
    ``channels_first``: an NCHW view of a 4-d result. ``dtype`` None converts nothing (the stored dtype,
    only the NCHW view)."""

    dtype: torch.dtype | None
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    channels_first: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std, or neither")
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.std is not None and any(float(s) == 0 for s in np.atleast_1d(self.std)):
            raise ValueError("std must not contain zeros")

    def _coeffs(self, device: torch.device, channels: int, width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 per-channel factor ``a`` and offset ``b``, repeated ``width`` times (for a row of
        ``width`` pixels seen as one axis)."""
        key = (device, channels, width)
        c = self._cache.get(key)
        if c is None:
            mean = np.zeros(channels) if self.mean is None else np.atleast_1d(np.asarray(self.mean, np.float64))
            std = np.ones(channels) if self.std is None else np.atleast_1d(np.asarray(self.std, np.float64))
            if mean.size not in (1, channels) or std.size not in (1, channels):
                raise ValueError(f"mean/std have {mean.size}/{std.size} values for {channels} channels")
            a = np.tile(np.broadcast_to(self.scale / std, (channels,)), width)
            b = np.tile(np.broadcast_to(-mean / std, (channels,)), width)
            c = (torch.tensor(a, dtype=torch.float32, device=device),
                 torch.tensor(b, dtype=torch.float32, device=device))
            self._cache[key] = c
        return c

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Convert ``x``; ``out`` (float32, ``x``'s shape and device) receives the result if given.

        A contiguous (..., W, C) result is scaled as rows of W * C values against the coefficients repeated W
        times (the same products and sums, element for element: the same bits), not against C values broadcast
        along a last axis of 3, which torch's CPU kernels do not vectorise (measured 3-5x slower)."""
        if self.dtype is None:
            y = x
        else:
            c = x.shape[-1] if x.ndim >= 2 else 1
            y = out.copy_(x) if out is not None else x.to(torch.float32)
            w = x.shape[-2] if x.ndim >= 3 and y.is_contiguous() else 1
            a, b = self._coeffs(x.device, c, w)
            (y.view(-1, w * c) if w > 1 else y).mul_(a).add_(b)
            if self.dtype != torch.float32:
                y = y.to(self.dtype)
        if self.channels_first and y.ndim == 4:
            y = y.permute(0, 3, 1, 2)  # NHWC storage seen as NCHW: channels_last memory format, no copy
        return y


# -- seeded batch steps ---------------------------------------------------------------------
class BatchStep:
    """A build step's twin on whole batches: the same name, options and per-kind rules as the
    build's random step (``STEP``), its parameters drawn with numpy per sample (``draw``) and
    applied with torch on whatever device the batch is on (``apply_<kind>``).

    Field choice is the build step's own (:meth:`Step.targets`): a field of a kind the step
    refuses is an error at construction, never skipped. ``flow_valid`` fields move with their
    flow as masks (flips and crops only gather, so validity stays ``isfinite(flow)``)."""

    STEP: ClassVar[type]
    name: ClassVar[str]
    #: moves pixels (a geometric step): a loaded ``flow_valid`` field moves with its flow; a colour step does not
    moves_grid: ClassVar[bool] = True
    #: resamples (a resize, a warp): a ``flow_valid`` field whose flow the step moved is derived again from the
    #: moved flow (``isfinite``), as the build derives it
    resamples: ClassVar[bool] = False

    def __init__(self, **params: Any):
        from pydantic import ValidationError

        model = getattr(self, "Params", None) or self.STEP.Params
        coerced = refuse_coercion(model, params)   # (true as 1.0, "0.5" as 0.5: refused, as in a recipe)
        if coerced is not None:
            raise ValueError(f"{self.name}: {'.'.join(str(x) for x in coerced[0]) or 'options'}: {coerced[1]}")
        try:
            self.params = model.model_validate(params)
        except ValidationError as e:
            errors = e.errors()
            unknown = [err for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]
            if unknown:   # a misspelt option: the close ones, as a recipe's step says (recipe._unknown_key)
                key, known = str(unknown[0]["loc"][0]), list(model.model_fields)
                raise ValueError(f"{self.name}: {clip(key, 80)}: unknown option"
                                 f"{did_you_mean(key, known) or ' (options: ' + ', '.join(known) + ')'}") from None
            raise ValueError(f"{self.name}: " + "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or 'options'}: {err['msg']}" for err in errors)) from None
        self.step = self.STEP(self.params)

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """Choose and check the loaded fields this step covers (stored specs, per-row shapes)."""
        from ..sample import FieldSpec, link_fields

        kinds = {f: Kind.of(specs[f].get("kind")) for f in shapes}
        try:
            links = link_fields(kinds, {f: specs[f]["of"] for f in shapes if specs[f].get("of") in shapes})
        except ValueError:
            links = {}  # a validity field whose flow is not loaded: it still moves as a mask
        self.links = links
        loaded = {f: FieldSpec(kinds[f], tuple(shapes[f]), "uint8", links.get(f)) for f in shapes}
        try:
            chosen = self.step.targets(loaded)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        explicit = self.params.fields is not None
        if self.moves_grid:
            chosen += [f for f, k in kinds.items() if k is Kind.FLOW_VALID and f not in chosen
                       and (not explicit or links.get(f) in chosen)]
        for f in chosen:   # a pad value the stored dtype cannot hold would wrap around (-5 in uint16: 65531)
            if specs[f].get("dtype") is None:
                continue
            try:
                self.step.check_fills(f, kinds[f], specs[f]["dtype"])
            except ValueError as e:
                raise ValueError(f"{self.name}: {e}") from None
        hw = {}
        for f in chosen:
            if kinds[f] in ANNOTATIONS:   # coordinates: moved on the grid of the fields below
                continue
            shape = shapes[f]
            if len(shape) < 3:
                raise ValueError(f"{self.name}: field {f!r} has per-sample shape {shape}, not a 2D grid")
            hw[f] = tuple(shape[-3:-1])
        if len(set(hw.values())) > 1:
            raise ValueError(f"{self.name}: fields differ in height/width ({hw}); one draw must fit all")
        if not hw and any(kinds[f] in ANNOTATIONS for f in chosen):
            raise ValueError(f"{self.name}: boxes and keypoints move on the grid of the image fields the step covers; "
                             f"name one with them in fields")
        self.bound = {f: kinds[f] for f in chosen}
        self.kinds = kinds
        self.hw = next(iter(hw.values())) if hw else None
        return chosen

    def out_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The per-row shapes of the batch after this step (bound first): what the next step sees."""
        return dict(shapes)

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def apply(self, x: torch.Tensor, kind: Kind, **params: Any) -> torch.Tensor:
        if kind is Kind.FLOW:
            return self.apply_flow(x, **params)
        if kind.labels:  # mask, flow_valid: gathered, padded with 0
            return self.apply_mask(x, **params)
        return self.apply_image(x, **params)  # image, and video (every frame at once)


#: torch has no flip, index_copy_ (CPU) or advanced-indexing (CUDA) kernel for these (a COCO instance mask is
#: uint16; seen with torch 2.11 on an H200 and 2.13 on CPU): such a tensor is moved through a view as the
#: signed type of the same width (the same bits)
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _twin_value(value: float, dtype: torch.dtype, twin: torch.dtype) -> int:
    """``value`` as ``dtype`` holds it, read as ``twin``'s bits (a pad value for the signed view)."""
    np_of = {torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64,
             torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
    return int(np.asarray(value).astype(np_of[dtype]).view(np_of[twin]))


def _hw_dims(x: torch.Tensor) -> tuple[int, int]:
    """(height, width) dims of a channel-last batch: (N, H, W, C) or (N, T, H, W, C)."""
    return x.ndim - 3, x.ndim - 2


class RandomFlip(BatchStep):
    """``random_flip``: mirror each sample left-right with probability ``horizontal`` and up-down
    with probability ``vertical``; flow negates u (horizontal) or v (vertical)."""

    name = "random_flip"
    STEP = geometry.RandomFlip

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        return {"horizontal": rng.random(n) < self.params.horizontal,
                "vertical": rng.random(n) < self.params.vertical}

    def apply_image(self, x: torch.Tensor, horizontal: np.ndarray, vertical: np.ndarray) -> torch.Tensor:
        twin = _SIGNED_TWIN.get(x.dtype)
        if twin is not None:
            return self.apply_image(x.view(twin), horizontal, vertical).view(x.dtype)
        dh, dw = _hw_dims(x)
        shape = (-1,) + (1,) * (x.ndim - 1)
        for flip, dim in ((horizontal, dw), (vertical, dh)):
            if flip.any():
                x = torch.where(to_device(flip, x.device).view(shape), x.flip(dim), x)
        return x

    apply_mask = apply_image

    def apply_flow(self, x: torch.Tensor, horizontal: np.ndarray, vertical: np.ndarray) -> torch.Tensor:
        x = self.apply_image(x, horizontal, vertical)
        sign = np.ones((len(horizontal), 2), np.float32)
        sign[horizontal, 0] = -1
        sign[vertical, 1] = -1
        if (sign == 1).all():
            return x
        return x * to_device(sign, x.device).view(-1, *(1,) * (x.ndim - 2), 2).to(x.dtype)


class SizedStep(BatchStep):
    """A step whose grids (images, masks, clips, flow) come out at ``params.size`` (h, w): a crop, a resized
    crop; annotations keep their shapes."""

    def out_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        out = dict(shapes)
        for f, k in self.bound.items():
            if k not in ANNOTATIONS:
                out[f] = (*shapes[f][:-3], *self.params.size, shapes[f][-1])
        return out


class RandomCrop(SizedStep):
    """``random_crop``: a random ``size`` window per sample after ``padding`` on every side (and,
    with ``pad: true``, centred padding up to ``size``); images pad with ``pad_value``, masks
    with 0, flow with NaN."""

    name = "random_crop"
    STEP = geometry.RandomCrop

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        chosen = super().bind(specs, shapes)
        if self.hw is not None:
            try:
                self.padded = self.step._padded(*self.hw)
            except ValueError as e:
                raise ValueError(f"{self.name}: {e}") from None
        return chosen

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        (PH, PW), (h, w) = self.padded, self.params.size
        return {"top": rng.integers(0, PH - h + 1, n), "left": rng.integers(0, PW - w + 1, n)}

    def _crop(self, x: torch.Tensor, top: np.ndarray, left: np.ndarray, value: float) -> torch.Tensor:
        twin = _SIGNED_TWIN.get(x.dtype)
        if twin is not None:
            return self._crop(x.view(twin), top, left, _twin_value(value, x.dtype, twin)).view(x.dtype)
        H, W = self.hw
        PH, PW = self.padded
        p = self.params.padding
        t, l_ = p + (PH - H - 2 * p) // 2, p + (PW - W - 2 * p) // 2
        if (PH, PW) != (H, W):
            x = torch.nn.functional.pad(x, (0, 0, l_, PW - W - l_, t, PH - H - t), value=value)
        video = x.ndim == 5
        if video:
            x = x.permute(0, 2, 3, 1, 4)  # (N, H, W, T, C): one gather moves every frame
        dev, n = x.device, x.shape[0]
        th, tw = self.params.size
        iy = (to_device(top, dev).view(n, 1) + torch.arange(th, device=dev)).view(n, th, 1)
        ix = (to_device(left, dev).view(n, 1) + torch.arange(tw, device=dev)).view(n, 1, tw)
        out = x[torch.arange(n, device=dev).view(n, 1, 1), iy, ix]
        return out.permute(0, 3, 1, 2, 4) if video else out

    def apply_image(self, x: torch.Tensor, top: np.ndarray, left: np.ndarray) -> torch.Tensor:
        return self._crop(x, top, left, self.params.pad_value)

    def apply_mask(self, x: torch.Tensor, top: np.ndarray, left: np.ndarray) -> torch.Tensor:
        return self._crop(x, top, left, 0)

    def apply_flow(self, x: torch.Tensor, top: np.ndarray, left: np.ndarray) -> torch.Tensor:
        return self._crop(x, top, left, float("nan"))


STEP_NAMES: dict[str, Callable[..., BatchStep]] = {"random_flip": RandomFlip, "random_crop": RandomCrop}
_RENAMED = {"flip": "random_flip: {horizontal: p} (or {vertical: p, horizontal: 0})",
            "crop": "random_crop: {size: ..., padding: ...}"}


def parse_steps(steps: Sequence[Any] | None, names: dict[str, Callable[..., BatchStep]] | None = None) -> list[BatchStep]:
    """Batch steps from objects or ``{"random_flip": {...}}`` / ``{"random_crop": {"size": 24}}`` mappings,
    with the build steps' names and options (``names``: the known steps, default :data:`STEP_NAMES`;
    :func:`precompile.reader.augment.parse_steps` passes every device step)."""
    STEP_NAMES_ = STEP_NAMES if names is None else names
    if isinstance(steps, (str, bytes, dict)):   # iterated, a name gives its letters and a mapping its keys
        raise ValueError(f"gpu_steps must be a list of steps, one mapping each ([{{'random_flip': {{...}}}}, ...]), "
                         f"got a {type(steps).__name__} {echo(steps, 80)}")
    out: list[BatchStep] = []
    for i, s in enumerate(steps or []):
        if isinstance(s, BatchStep):
            out.append(s)
            continue
        if not isinstance(s, dict) or len(s) != 1:
            raise ValueError(f"gpu_steps[{i}]: expected a BatchStep or a mapping with one step name, got {s!r}")
        (name, params), = s.items()
        if name in _RENAMED:
            raise ValueError(f"gpu_steps[{i}]: {name!r} is now the build step's twin {_RENAMED[name]}, "
                             f"with the build's options")
        if name not in STEP_NAMES_:
            from ..registry import STEPS, load_builtins

            load_builtins()
            why = "a build step with no device twin" if name in STEPS else "unknown" + did_you_mean(str(name), list(STEP_NAMES_))
            raise ValueError(f"gpu_steps[{i}]: {echo(name, 80)} is {why} (device steps: {', '.join(STEP_NAMES_)})")
        if not isinstance(params, (dict, type(None))):
            raise ValueError(f"gpu_steps[{i}].{name}: options must be a mapping, got {echo(params, 80)}")
        bad = next((k for k in params or {} if not isinstance(k, str)), None)
        if bad is not None:
            raise ValueError(f"gpu_steps[{i}].{name}: option names are strings, got {echo(bad, 80)}")
        out.append(STEP_NAMES_[name](**(params or {})))
    return out


def bind_steps(steps: Sequence[BatchStep], specs: dict[str, dict],
               shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Bind ``steps`` in order to the loaded fields (stored ``specs``, per-row ``shapes``): each step sees
    the shapes the step before it produced, so a flip after a crop mirrors about the crop's grid and a
    second crop draws its window in the first one's. Returns the shapes after the last step."""
    for s in steps:
        s.bind(specs, shapes)
        shapes = s.out_shapes(shapes)
    return shapes


def step_params(steps: Sequence[BatchStep], seed: int, epoch: int, rank: int, batch: int, n: int) -> list[dict]:
    """Every step's parameters for one batch: a function of (seed, epoch, rank, batch) only."""
    return [s.draw(stream(seed, epoch, rank, batch, i, 3), n)
            for i, s in enumerate(steps)]


def param_at(p: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    """Sample ``i``'s drawn parameters as the build step takes them: bool, int or float (one rule for the maps,
    the annotations and the tests)."""
    return {k: (bool(v[i]) if v.dtype == bool else int(v[i]) if v.dtype.kind in "iu" else float(v[i]))
            for k, v in p.items()}


def step_maps(step: BatchStep, p: dict[str, np.ndarray], n: int) -> np.ndarray:
    """(n, 2, 3) float64: each sample's forward map (the build step's ``coord_map``) of one bound step for its
    drawn parameters ``p``, on the grid the step sees (the float64 maps :func:`~precompile.reader.ragged.move_annotations`
    moves boxes with)."""
    return np.stack([step.step.coord_map(step.hw, **param_at(p, i))[0] for i in range(n)]) if n \
        else np.zeros((0, 2, 3))


def device_maps(steps: Sequence[BatchStep], params: Sequence[dict], n: int, field: str | None = None) -> np.ndarray:
    """(n, 2, 3) float64: for each of a batch's ``n`` samples, the map from the batch's pixel coordinates
    (after every device step) back to the stored sample's (before them): the inverse of the steps' forward
    maps, composed in order. Steps that do not move ``field`` (default: every step that moves a grid field)
    are left out; without steps, identities. ``Dataset.to_source(i, ..., device_map=maps[j])`` takes one."""
    from ..transforms.kernels import maps

    out = np.repeat(maps.IDENTITY[None], n, axis=0)
    for step, p in zip(steps, params):
        if step.hw is None or not step.moves_grid or (field is not None and field not in step.bound):
            continue
        forward = step_maps(step, p, n)
        out = np.stack([maps.compose(out[j], maps.invert(forward[j])) for j in range(n)]) if n else out
    return out


def run_steps(batch: dict[str, torch.Tensor], steps: Sequence[BatchStep], params: Sequence[dict],
              pixels: bool = True) -> dict[str, torch.Tensor]:
    """Each step with its drawn ``params`` on the fields it covers, in order; ``pixels`` False: the annotations
    only (boxes, keypoints and their tied rows; the grids already made by :mod:`~precompile.reader.fused`)."""
    for step, p in zip(steps, params):
        for f, kind in step.bound.items():
            if pixels and kind not in ANNOTATIONS:
                batch[f] = step.apply(batch[f], kind, **p)
        if pixels and step.resamples:   # a resampled flow's validity: where the moved flow is known (the build's rule)
            for f, kind in step.bound.items():
                flow = step.links.get(f)
                if kind is Kind.FLOW_VALID and step.bound.get(flow) is Kind.FLOW:
                    batch[f] = torch.isfinite(batch[flow]).all(-1, keepdim=True).to(batch[f].dtype)
        if ANNOTATIONS.intersection(step.bound.values()):
            for f, (rows, ids) in move_annotations(step, batch, p).items():
                batch[f] = renumber_masks(batch[f], rows, ids)
    return batch



def renumber_masks(mask: torch.Tensor, rows: np.ndarray, ids: np.ndarray) -> torch.Tensor:
    """Instance masks of a batch (``mask == i + 1`` is box i of the sample) renumbered after boxes were
    dropped: sample ``rows[r]`` maps id v to ``ids[r, v]`` (:func:`precompile.transforms.annotations.instance_ids`
    per sample); values past the table (the ignore id) stay. On the batch's device; a new tensor."""
    if len(rows) == 0:
        return mask
    dev, k, top = mask.device, len(rows), ids.shape[1] - 1
    sel = to_device(rows.astype(np.int64), dev)
    old = mask.index_select(0, sel).long().reshape(k, -1)
    new = torch.gather(to_device(ids, dev), 1, old.clamp(0, top))
    new = torch.where((old > top) | (old < 0), old, new).reshape((k, *mask.shape[1:])).to(mask.dtype)
    if k == mask.shape[0]:
        return new
    twin = _SIGNED_TWIN.get(mask.dtype)
    out = mask.clone()
    if twin is None:
        out.index_copy_(0, sel, new)
    else:
        out.view(twin).index_copy_(0, sel, new.view(twin))
    return out


# -- the CUDA ring --------------------------------------------------------------------------
class CudaRing:
    """Pinned host slots (allocated once), a side stream, and an event per slot.

    ``host(slot)`` gives the numpy views the gather threads fill (after
    ``wait_free(slot)``); ``launch(slot, n, finish)`` copies the first ``n``
    rows of every field to the device on the side stream, runs ``finish`` (the
    conversion and batch steps) there too, records the slot's event, and
    returns the device tensors with an event the consumer's stream waits on
    (``deliver``).
    """

    def __init__(self, device: torch.device, slots: int, batch_size: int, shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, np.dtype]):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.slots = []
        for _ in range(slots):
            bufs = {f: torch.empty((batch_size, *shapes[f]), dtype=numpy_to_torch_dtype(dtypes[f]), pin_memory=True)
                    for f in shapes}
            self.slots.append(bufs)
        self.np = [{f: t.numpy() for f, t in bufs.items()} for bufs in self.slots]
        self.copied: list[torch.cuda.Event | None] = [None] * slots

    def host(self, slot: int, n: int) -> dict[str, np.ndarray]:
        return {f: a[:n] for f, a in self.np[slot].items()}

    def wait_free(self, slot: int) -> None:
        """Block (in a gather thread, GIL released; a blocking event, so the thread sleeps rather than
        spins) until the slot's last copy has left host memory."""
        ev = self.copied[slot]
        if ev is not None:
            ev.synchronize()

    def launch(self, slot: int, n: int,
               finish: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> tuple[dict, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            dev = {f: t[:n].to(self.device, non_blocking=True) for f, t in self.slots[slot].items()}
            ev = torch.cuda.Event(blocking=True)  # wait_free sleeps on it in a gather thread, no spinning
            ev.record(self.stream)
            self.copied[slot] = ev
            out = finish(dev)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def deliver(self, out: dict[str, torch.Tensor], done: torch.cuda.Event) -> dict[str, torch.Tensor]:
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(done)
        for t in out.values():
            t.record_stream(cur)  # made on the side stream, used on the consumer's: keep the allocator honest
        return out

    def synchronize(self) -> None:
        self.stream.synchronize()
