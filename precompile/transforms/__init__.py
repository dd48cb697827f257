"""Registered steps, grouped by domain. Importing this package registers the built-in ones.

``geometry`` (2D: resize, crops, flips, affine), ``colour`` (convert, jitter,
noise), ``temporal`` (clips, temporal_jitter), ``audio`` (fix_length, windows,
gain, shift) and ``volume`` (the 3D steps: resampling, HU, lung mask, patches,
3D flips, rotations, elastic). Deterministic and random steps of a domain live
side by side; their pure kernels are in ``kernels``.
"""
from __future__ import annotations

from .base import RandomStep, Step, StepParams, replay, replay_step
from . import audio, colour, geometry, temporal, volume  # noqa: F401  (register the built-in steps)

__all__ = ["RandomStep", "Step", "StepParams", "replay", "replay_step"]
