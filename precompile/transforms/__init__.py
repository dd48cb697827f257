"""Registered steps. Importing this package registers the built-in ones."""
from __future__ import annotations

from .base import Step, StepParams
from . import geometric  # noqa: F401  (resize, center_crop, convert)

__all__ = ["Step", "StepParams"]
