"""The torch side of the Loader: device choice, batch conversion, seeded batch steps, the CUDA ring.

- :func:`resolve_device` turns ``"auto" | "cpu" | "cuda[:i]"`` into a torch
  device with an explicit index (``cuda`` is the current device), and refuses
  ``cuda`` clearly when torch has no CUDA. :func:`thread_init` makes gather
  threads use that device.
- :class:`Convert` turns a stored field into what training wants, on the
  batch's device: uint8 -> float32/float16/bfloat16 scaled to [0, 1], then
  ``(x - mean) / std`` per channel (last axis), optionally NHWC -> NCHW (a
  permuted view: channels_last memory, free).
- Batch steps (:class:`RandomFlip`, :class:`RandomCrop`) draw their parameters
  with numpy from ``default_rng([seed, epoch, rank, batch, step])`` and apply
  them with torch ops on whatever device the batch is on, so CPU and CUDA get
  the same crops and flips. Draw once per sample, apply to every field the
  step covers (an image and its mask stay aligned). On CUDA the parameters go
  to the device from pinned memory, asynchronously on the side stream.
- :class:`CudaRing` holds the pinned host buffers (allocated once), the side
  stream and one event per slot: host-to-device copies (uint8 over the bus)
  and the conversion run on the side stream while the previous batch trains;
  the consumer's stream waits on an event, and a slot is refilled only after
  its copy's event has completed.

Only the Loader imports this module; torch is never imported by the build.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import PrecompileError

SPATIAL_KINDS = ("image", "mask")
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
    """uint8 (or any) -> ``dtype``; uint8 is scaled by 1/255; then per-channel ``(x - mean) / std``."""

    dtype: torch.dtype
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

    def _coeffs(self, device: torch.device, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, channels)
        c = self._cache.get(key)
        if c is None:
            mean = np.zeros(channels) if self.mean is None else np.atleast_1d(np.asarray(self.mean, np.float64))
            std = np.ones(channels) if self.std is None else np.atleast_1d(np.asarray(self.std, np.float64))
            if mean.size not in (1, channels) or std.size not in (1, channels):
                raise ValueError(f"mean/std have {mean.size}/{std.size} values for {channels} channels")
            a = np.broadcast_to(self.scale / std, (channels,))
            b = np.broadcast_to(-mean / std, (channels,))
            c = (torch.tensor(a, dtype=torch.float32, device=device), torch.tensor(b, dtype=torch.float32, device=device))
            self._cache[key] = c
        return c

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Convert ``x``; ``out`` (float32, ``x``'s shape and device) receives the result if given."""
        a, b = self._coeffs(x.device, x.shape[-1] if x.ndim >= 2 else 1)
        y = (out.copy_(x) if out is not None else x.to(torch.float32)).mul_(a).add_(b)
        if self.dtype != torch.float32:
            y = y.to(self.dtype)
        if self.channels_first and y.ndim == 4:
            y = y.permute(0, 3, 1, 2)  # NHWC storage seen as NCHW: channels_last memory format, no copy
        return y


# -- seeded batch steps ---------------------------------------------------------------------
class BatchStep:
    """A random step on a whole batch: ``draw`` (numpy, seeded) then ``apply`` (torch, any device)."""

    name = "step"

    def __init__(self, fields: Sequence[str] | None = None):
        self.fields = list(fields) if fields is not None else None

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """Choose and check the fields this step covers; returns them."""
        if self.fields is None:
            chosen = [f for f, s in specs.items() if f in shapes and s.get("kind") in SPATIAL_KINDS and len(shapes[f]) == 3]
        else:
            chosen = self.fields
            for f in chosen:
                if f not in shapes:
                    raise ValueError(f"{self.name}: field {f!r} is not loaded (loaded: {', '.join(shapes)})")
                if specs[f].get("kind") not in SPATIAL_KINDS or len(shapes[f]) != 3:
                    raise ValueError(f"{self.name}: field {f!r} is {specs[f].get('kind')} {shapes[f]}; batch steps "
                                     f"apply to (H, W, C) image/mask fields only")
        if not chosen:
            raise ValueError(f"{self.name}: covers no field; batch steps apply to (H, W, C) image/mask fields "
                             f"(loaded: " + ", ".join(f"{f} {specs[f].get('kind')} {shapes[f]}" for f in shapes)
                             + "); name them with fields=[...] or leave the step out")
        hw = {shapes[f][:2] for f in chosen}
        if len(hw) > 1:
            raise ValueError(f"{self.name}: fields {chosen} differ in height/width {sorted(hw)}; one draw must fit all")
        self.bound = chosen
        self.hw = next(iter(hw)) if hw else None
        return chosen

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def apply(self, x: torch.Tensor, **params: Any) -> torch.Tensor:
        raise NotImplementedError

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape


class RandomFlip(BatchStep):
    """Flip each sample left-right (``axis='horizontal'``) or up-down with probability ``p``."""

    name = "flip"

    def __init__(self, p: float = 0.5, axis: str = "horizontal", fields: Sequence[str] | None = None):
        super().__init__(fields)
        if not 0 <= p <= 1:
            raise ValueError(f"flip: p must be in [0, 1], got {p}")
        if axis not in ("horizontal", "vertical"):
            raise ValueError(f"flip: axis must be 'horizontal' or 'vertical', got {axis!r}")
        self.p, self.axis = float(p), axis

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        return {"flip": rng.random(n) < self.p}

    def apply(self, x: torch.Tensor, flip: np.ndarray) -> torch.Tensor:
        if not flip.any():
            return x
        dim = 2 if self.axis == "horizontal" else 1
        m = to_device(flip, x.device).view(-1, 1, 1, 1)
        return torch.where(m, x.flip(dim), x)


class RandomCrop(BatchStep):
    """A random ``size`` (h, w) window per sample, after zero ``padding`` on every side."""

    name = "crop"

    def __init__(self, size: int | Sequence[int], padding: int = 0, fields: Sequence[str] | None = None):
        super().__init__(fields)
        self.size = (int(size), int(size)) if np.isscalar(size) else tuple(int(s) for s in size)
        if len(self.size) != 2 or min(self.size) < 1 or padding < 0:
            raise ValueError(f"crop: size must be 1 or 2 positive ints and padding >= 0 (got {size}, {padding})")
        self.padding = int(padding)

    def bind(self, specs: dict[str, dict], shapes: dict[str, tuple[int, ...]]) -> list[str]:
        chosen = super().bind(specs, shapes)
        if self.hw is not None:
            h, w = self.hw[0] + 2 * self.padding, self.hw[1] + 2 * self.padding
            if self.size[0] > h or self.size[1] > w:
                raise ValueError(f"crop: size {self.size} is larger than the padded sample ({h}, {w})")
        return chosen

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*self.size, shape[2])

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        h, w = self.hw[0] + 2 * self.padding, self.hw[1] + 2 * self.padding
        return {"top": rng.integers(0, h - self.size[0] + 1, n), "left": rng.integers(0, w - self.size[1] + 1, n)}

    def apply(self, x: torch.Tensor, top: np.ndarray, left: np.ndarray) -> torch.Tensor:
        p = self.padding
        if p:
            x = torch.nn.functional.pad(x, (0, 0, p, p, p, p))
        dev = x.device
        n = x.shape[0]
        th, tw = self.size
        iy = (to_device(top, dev).view(n, 1) + torch.arange(th, device=dev)).view(n, th, 1)
        ix = (to_device(left, dev).view(n, 1) + torch.arange(tw, device=dev)).view(n, 1, tw)
        b = torch.arange(n, device=dev).view(n, 1, 1)
        return x[b, iy, ix]


STEP_NAMES: dict[str, Callable[..., BatchStep]] = {"flip": RandomFlip, "crop": RandomCrop}


def parse_steps(steps: Sequence[Any] | None) -> list[BatchStep]:
    """Batch steps from objects or ``{"flip": {...}}`` / ``{"crop": {"size": [24, 24]}}`` mappings."""
    out: list[BatchStep] = []
    for i, s in enumerate(steps or []):
        if isinstance(s, BatchStep):
            out.append(s)
            continue
        if not isinstance(s, dict) or len(s) != 1:
            raise ValueError(f"gpu_steps[{i}]: expected a BatchStep or a mapping with one step name, got {s!r}")
        (name, params), = s.items()
        if name not in STEP_NAMES:
            raise ValueError(f"gpu_steps[{i}]: unknown batch step {name!r} (known: {', '.join(STEP_NAMES)})")
        try:
            out.append(STEP_NAMES[name](**(params or {})))
        except TypeError as e:
            raise ValueError(f"gpu_steps[{i}].{name}: {e}") from None
    return out


def step_params(steps: Sequence[BatchStep], seed: int, epoch: int, rank: int, batch: int, n: int) -> list[dict]:
    """Every step's parameters for one batch: a function of (seed, epoch, rank, batch) only."""
    return [s.draw(np.random.default_rng([int(seed), int(epoch), int(rank), int(batch), i, 3]), n)
            for i, s in enumerate(steps)]


def run_steps(batch: dict[str, torch.Tensor], steps: Sequence[BatchStep], params: Sequence[dict]) -> dict[str, torch.Tensor]:
    for step, p in zip(steps, params):
        for f in step.bound:
            batch[f] = step.apply(batch[f], **p)
    return batch


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
