"""Colour and intensity steps on images and clips: convert (pixel format), color_jitter,
gaussian_noise (also volumes and audio). They keep every other kind as it is."""
from __future__ import annotations

from typing import Any, Literal, Union

import numpy as np
from pydantic import Field, field_validator

from ..kinds import Kind, kinds
from ..optschema import checked
from ..registry import STEPS
from ..sample import FieldSpec
from .base import RandomParams, RandomStep, Step, StepParams, draw_seed, nonnegative_range, range_param, uniform
from .kernels.colour import add_noise, color_jitter, convert_mode


@STEPS.register()
class Convert(Step):
    """Convert image pixel format: ``mode: rgb8 | gray8 | gray16 | rgba8``."""

    name = "convert"
    keeps_grid = True   # values only: an image's map back to its source stays
    per_frame = True
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(StepParams):
        mode: Literal["rgb8", "gray8", "gray16", "rgba8"] = Field(
            description="the pixel layout to convert to: RGB, gray or RGBA in 8 bits, or gray in 16 bits")

    def output_spec(self, spec: FieldSpec) -> FieldSpec:
        c, dtype = {"rgb8": (3, "uint8"), "gray8": (1, "uint8"), "gray16": (1, "uint16"),
                    "rgba8": (4, "uint8")}[self.params.mode]
        if spec.dtype not in ("uint8", "uint16"):
            raise ValueError(f"convert needs uint8 or uint16 pixels, got {spec.dtype}")
        return spec.with_(shape=tuple(spec.shape[:-1]) + (c,), dtype=dtype)

    def apply_image(self, a: np.ndarray, **_: Any) -> np.ndarray:
        return convert_mode(a, self.params.mode)

    apply_video = apply_image  # per pixel: frames need no loop


@STEPS.register()
class ColorJitter(RandomStep):
    """Random brightness, contrast and saturation factors, each drawn from [1 - x, 1 + x]
    (x given) or [lo, hi], applied in that order to images and clips only (see
    :func:`color_jitter`). Original copy: factors 1."""

    name = "color_jitter"
    keeps_grid = True   # values only: an image's map back to its source stays
    applies = kinds(Kind.IMAGE, Kind.VIDEO)

    class Params(RandomParams):
        brightness: Union[float, list[float]] = Field(0.0, description="brightness factor from [1 - x, 1 + x], "
                                                      "or [low, high]", json_schema_extra=checked(ge=0, item={"ge": 0}))
        contrast: Union[float, list[float]] = Field(0.0, description="contrast factor from [1 - x, 1 + x], "
                                                    "or [low, high]", json_schema_extra=checked(ge=0, item={"ge": 0}))
        saturation: Union[float, list[float]] = Field(0.0, description="saturation factor from [1 - x, 1 + x], "
                                                      "or [low, high]", json_schema_extra=checked(ge=0, item={"ge": 0}))

        @field_validator("brightness", "contrast", "saturation", mode="before")
        @classmethod
        def _f(cls, v: Any, info) -> Any:
            return range_param(v, info.field_name, symmetric_about=1.0, lo_min=0.0)

    def sample_params(self, rng, sample, targets):
        p = self.params
        return {"brightness": uniform(rng, p.brightness), "contrast": uniform(rng, p.contrast),
                "saturation": uniform(rng, p.saturation)}

    def neutral_params(self, sample, targets):
        return {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0}

    def apply_image(self, a, brightness: float, contrast: float, saturation: float, **_):
        return color_jitter(a, False, brightness, contrast, saturation)

    def apply_video(self, a, brightness: float, contrast: float, saturation: float, **_):
        return color_jitter(a, True, brightness, contrast, saturation)


@STEPS.register()
class GaussianNoise(RandomStep):
    """Add gaussian noise with a standard deviation from ``std`` (a number, or [lo, hi] drawn
    uniformly; in the array's units, e.g. 0-255 for uint8) to images, clips, volumes and audio.
    The std is drawn once per sample; every field gets its own noise (a frame pair must not
    share one pattern), from its own recorded seed. Original copy: no noise."""

    name = "gaussian_noise"
    keeps_grid = True   # values only: an image's map back to its source stays
    applies = kinds(Kind.IMAGE, Kind.VIDEO, Kind.VOLUME, Kind.AUDIO)

    class Params(RandomParams):
        std: Union[float, list[float]] = Field(description="noise standard deviation in the array's units: x, "
                                               "or [low, high] drawn per sample",
                                               json_schema_extra=checked(ge=0, item={"ge": 0}))

        @field_validator("std", mode="before")
        @classmethod
        def _s(cls, v: Any) -> Any:
            return nonnegative_range(v, "std")

    def sample_params(self, rng, sample, targets):
        std = uniform(rng, self.params.std)
        return {"std": std, "seed": {f: draw_seed(rng) for f in targets}}

    def neutral_params(self, sample, targets):
        return {"std": 0.0, "seed": {f: 0 for f in targets}}

    def field_params(self, params, field):
        return {"std": params["std"], "seed": params["seed"][field]}

    def apply(self, a, kind, std: float, seed: int, **_):
        """The same kernel for every kind it applies to: noise is elementwise."""
        if Kind.of(kind) not in self.applies:
            raise ValueError(f"{self.name} cannot handle a {Kind.of(kind).value} field")
        return add_noise(a, std, seed)
