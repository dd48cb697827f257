"""Audio decoding through soundfile (libsndfile): WAV, FLAC, Ogg Vorbis/Opus, AIFF, ...

Output is (C, N) channels first, float32 in [-1, 1) or int16 (16-bit PCM
round-trips exactly: both use the 32768 scale). Options mix down to mono (the
mean of the channels) and resample with soxr, a band-limited resampler that
never drops samples. Metadata: the sample rate, the source rate, channel
count, frame count and container/subtype.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from ..errors import DecodeError
from ..registry import DECODERS
from ..sample import FieldSpec
from ..transforms.kernels.audio import resample_audio, to_int16
from .base import DEFAULT_INPUT_BYTES, Decoder, DecoderParams, check_budget

def _read_within(f: Any, path: str, budget: int, out_rate: Optional[int]) -> np.ndarray:
    """All frames of open SoundFile ``f`` as (N, C) float32, refusing a header whose frame count needs more
    than ``budget`` (the float32 samples, a mixed-down copy, and the output: ``out_rate / rate`` times as
    long when resampled up); a stream whose length is unknown is read in blocks and refused once past it."""
    per_frame = int(int(f.channels) * 4 * (2 + max(1.0, (out_rate or f.samplerate) / max(1, f.samplerate))))
    frames = int(f.frames)
    if f.seekable() and 0 < frames < (1 << 62):
        check_budget(path, f"{frames} samples x {f.channels} channels", frames * per_frame, budget)
        return f.read(dtype="float32", always_2d=True)
    blocks, total = [], 0
    for block in f.blocks(blocksize=1 << 16, dtype="float32", always_2d=True):
        total += block.shape[0]
        check_budget(path, f"at least {total} samples x {f.channels} channels", total * per_frame, budget)
        blocks.append(block.copy())
    return np.concatenate(blocks) if blocks else np.zeros((0, int(f.channels)), np.float32)


def read_audio(path: str, budget: int = DEFAULT_INPUT_BYTES,
               out_rate: Optional[int] = None) -> tuple[np.ndarray, int, dict[str, Any]]:
    """(C, N) float32, sample rate, info; DecodeError for anything soundfile cannot read or a declared
    length whose decoding (resampled to ``out_rate``) needs more than ``budget`` bytes."""
    import soundfile as sf

    try:
        with sf.SoundFile(path) as f:
            rate = int(f.samplerate)
            info = {"format": f.format, "subtype": f.subtype, "source_channels": int(f.channels),
                    "source_rate": rate}
            data = _read_within(f, path, budget, out_rate)
    except FileNotFoundError:
        raise DecodeError("file not found", path=path) from None
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OSError, EOFError) as e:
        raise DecodeError(f"cannot decode audio: {e}", path=path) from None
    if rate <= 0:
        raise DecodeError(f"invalid sample rate {rate}", path=path)
    if not np.isfinite(data).all():
        raise DecodeError("audio holds non-finite samples", path=path)
    info["source_frames"] = int(data.shape[0])
    return np.ascontiguousarray(data.T), rate, info


@DECODERS.register()
class AudioDecoder(Decoder):
    """WAV / FLAC / Ogg -> (C, N) float32 or int16; ``mono``, ``sample_rate`` (soxr), ``channels``."""

    name = "audio"
    kind = "audio"

    class Params(DecoderParams):
        mono: bool = True                          # mix down to one channel (mean of channels)
        channels: Optional[int] = Field(None, ge=1)  # with mono false: require this channel count (fixes the shape)
        sample_rate: Optional[int] = Field(None, ge=1)  # resample to this rate (Hz); default: keep the file's
        dtype: Literal["float32", "int16"] = Field("float32", description="samples as float32 in [-1, 1] or "
                                                   "int16")
        quality: Literal["VHQ", "HQ", "MQ", "LQ", "QQ"] = "HQ"   # soxr quality preset

        @model_validator(mode="after")
        def _channels(self):
            if self.mono and self.channels not in (None, 1):   # was ignored: one channel stored
                raise ValueError(f"channels: {self.channels} asks for {self.channels} channels, but mono: true (the "
                                 f"default) mixes to one: set mono: false to keep {self.channels}")
            return self

    def spec(self) -> FieldSpec:
        c = 1 if self.params.mono else self.params.channels
        return FieldSpec("audio", (c, None), self.params.dtype)

    def read(self, path: str) -> tuple[np.ndarray, dict[str, Any]]:
        p = self.params
        x, rate, info = read_audio(path, self.max_bytes, p.sample_rate)
        if p.mono:
            x = x.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32) if x.shape[0] > 1 else x
        elif p.channels is not None and x.shape[0] != p.channels:
            raise DecodeError(f"has {x.shape[0]} channels, the recipe asks for {p.channels} "
                              f"(set mono: true to mix down)", path=path)
        out_rate = p.sample_rate or rate
        if out_rate != rate:
            x = resample_audio(x, rate, out_rate, p.quality)
        if p.dtype == "int16":
            x = to_int16(x)
        else:
            x = x.astype(np.float32, copy=False)
        info.update(sample_rate=int(out_rate), frames=int(x.shape[-1]), channels=int(x.shape[0]))
        return np.ascontiguousarray(x), info
