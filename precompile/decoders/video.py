"""Video decoding through OpenCV: every frame read sequentially, (T, H, W, C) uint8.

The frame count is the number of frames actually decoded; the container's
claim (``CAP_PROP_FRAME_COUNT``) is only recorded in the metadata, since some
files claim hundreds of frames more than they hold. Clip sampling is a step
(``clips``), so one decoded video gives many samples without decoding twice.
Metadata: fps, the decoded and claimed frame counts, width, height.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field

from ..errors import DecodeError
from ..registry import DECODERS
from ..sample import FieldSpec
from .base import Decoder, DecoderParams


def read_video(path: str, mode: str = "rgb8", max_frames: Optional[int] = None,
               every: int = 1) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode frames 0, every, 2*every, ... (up to ``max_frames`` kept) -> (T, H, W, C) uint8, meta."""
    import cv2

    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            raise DecodeError("OpenCV cannot open this file as a video", path=path)
        fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        claimed = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        frames = []
        n = 0
        shape = None
        while max_frames is None or len(frames) < max_frames:
            ok, fr = cap.read()
            if not ok or fr is None:
                break
            if n % every == 0:
                if fr.ndim == 2:
                    fr = fr[..., None]
                if shape is None:
                    shape = fr.shape
                elif fr.shape != shape:
                    raise DecodeError(f"frame {n} is {fr.shape[1]}x{fr.shape[0]}, earlier frames "
                                      f"{shape[1]}x{shape[0]} (size changes mid-stream)", path=path)
                if mode == "rgb8":
                    fr = cv2.cvtColor(fr, cv2.COLOR_BGR2RGB) if fr.shape[-1] == 3 else np.repeat(fr, 3, -1)
                elif mode == "gray8":
                    fr = cv2.cvtColor(fr, cv2.COLOR_BGR2GRAY)[..., None] if fr.shape[-1] == 3 else fr[..., :1]
                frames.append(np.ascontiguousarray(fr))
            n += 1
    except cv2.error as e:
        raise DecodeError(f"OpenCV failed while decoding: {e}", path=path) from None
    finally:
        cap.release()
    if not frames:
        raise DecodeError("no frame could be decoded (empty, truncated or unsupported codec)", path=path)
    arr = np.stack(frames)
    h, w = arr.shape[1:3]
    meta = {"fps": fps, "decoded_frames": n, "claimed_frames": claimed, "every": every,
            "width": int(w), "height": int(h)}
    return arr, meta


@DECODERS.register()
class VideoDecoder(Decoder):
    """Any video OpenCV reads -> (T, H, W, C) uint8 frames (T = frames decoded, not the header's count).

    ``every: k`` keeps every k-th frame at decode time (saves memory on long
    videos); ``max_frames`` stops after that many kept frames."""

    name = "video"
    kind = "video"

    class Params(DecoderParams):
        mode: Literal["rgb8", "gray8"] = "rgb8"
        every: int = Field(1, ge=1)                    # keep every k-th decoded frame
        max_frames: Optional[int] = Field(None, ge=1)  # stop after this many kept frames

    def spec(self) -> FieldSpec:
        return FieldSpec("video", (None, None, None, 3 if self.params.mode == "rgb8" else 1), "uint8")

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        return read_video(path, p.mode, p.max_frames, p.every)
