"""Registered steps. Importing this package registers the built-in ones."""
from __future__ import annotations

from .base import Step, StepParams
from . import geometric  # noqa: F401  (resize, center_crop, convert)
from . import audio, temporal, volume  # noqa: F401  (fix_length, windows, clips, lung-CT volume steps)
from . import augment  # noqa: F401  (random_* steps, color_jitter, gaussian_noise, elastic, ...)

__all__ = ["Step", "StepParams"]
