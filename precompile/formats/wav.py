"""WAV shards (``format: wav``): one file per sample for each audio field.

Audio arrays are (C, N), channels first, float32 or int16. ``output.options``:
``subtype`` (``auto``: PCM_16 for int16, FLOAT for float32; or ``PCM_16`` /
``FLOAT``) and ``sample_rate`` (default: the rate the decoder put in the
sample's metadata, ``meta[field]["sample_rate"]``). The WAV bytes are written
here, not by libsndfile, because libsndfile stamps the wall clock into float
files' PEAK chunk and the same recipe must give the same bytes. Float to PCM_16
is ``clip(round(x * 32768), -32768, 32767)``; readers (soundfile included)
divide by 32768, so checksums are taken over those de-quantized values.
Reading back is soundfile's (:func:`read_wav_file`).
"""
from __future__ import annotations

import struct
from typing import Any, Literal, Optional, Sequence

import numpy as np
from pydantic import Field

from ..errors import FormatError
from ..kinds import Kind
from ..transforms.kernels.audio import to_int16
from ..registry import WRITERS
from ..sample import FieldSpec, Sample
from .folder import FolderFormat, FolderOptions

AUDIO_DTYPES = ("float32", "int16")
RATE_KEYS = ("sample_rate", "rate", "sr")


class WavOptions(FolderOptions):
    subtype: Literal["auto", "PCM_16", "FLOAT"] = Field("auto", description="sample encoding (auto: PCM_16 for "
                                                        "int16 audio, FLOAT for float32)")
    sample_rate: Optional[int] = Field(None, ge=1, description="the rate written in the header (default: the "
                                       "audio's own, from the decoder)")


def sample_rate_of(sample: Sample, field: str, options: Any) -> int:
    """The rate to write ``field`` at: the option, else the decoder's metadata; they must agree."""
    found: set[int] = set()
    m = sample.meta.get(field)
    dicts = [m] if isinstance(m, dict) else [v for v in sample.meta.values() if isinstance(v, dict)] + [sample.meta]
    for d in dicts:
        for k in RATE_KEYS:
            v = d.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                found.add(int(v))
                break
    opt = getattr(options, "sample_rate", None)
    if opt is not None:
        if found and found != {opt}:
            raise ValueError(f"field {field!r}: the sample is at {sorted(found)} Hz but output.options.sample_rate is "
                             f"{opt}; resample it in the recipe")
        return int(opt)
    if len(found) == 1:
        return found.pop()
    if not found:
        raise ValueError(f"field {field!r}: no sample rate in the sample's metadata; set output.options.sample_rate")
    raise ValueError(f"field {field!r}: several sample rates {sorted(found)} in the sample's metadata; "
                     f"set output.options.sample_rate")


def write_wav(path: str, audio: np.ndarray, rate: int, subtype: str) -> np.ndarray:
    """Write (C, N) ``audio`` as WAV; returns what a reader gets back in ``audio``'s dtype."""
    c, n = audio.shape
    if subtype == "PCM_16":
        data = audio.astype("<i2") if audio.dtype == np.int16 else to_int16(audio).astype("<i2")
        tag, bits = 1, 16
        back = data.astype(np.int16) if audio.dtype == np.int16 else (data.astype(np.float32) / np.float32(32768.0))
    else:
        if audio.dtype == np.int16:
            raise ValueError("int16 audio is written as PCM_16, not FLOAT")
        data = audio.astype("<f4")
        tag, bits = 3, 32
        back = audio
    block = c * bits // 8
    payload = np.ascontiguousarray(data.T.astype(data.dtype.newbyteorder("<"))).tobytes()
    fmt_chunk = struct.pack("<HHIIHH", tag, c, rate, rate * block, block, bits)
    chunks = b""
    if tag == 3:
        fmt_chunk += struct.pack("<H", 0)
        chunks += b"fact" + struct.pack("<II", 4, n)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk + chunks
    body += b"data" + struct.pack("<I", len(payload)) + payload + (b"\0" if len(payload) % 2 else b"")
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)
    return back


@WRITERS.register()
class WavFormat(FolderFormat):
    name = "wav"
    label = "WAV"
    file_ext = ".wav"
    Options = WavOptions

    def file_field(self, name: str, spec: FieldSpec) -> bool:
        if spec.kind is not Kind.AUDIO:
            return False
        if len(spec.shape) != 2 or spec.dtype not in AUDIO_DTYPES:
            raise ValueError(f"field {name!r} cannot be stored as WAV: it is {spec.describe()}; WAV holds audio "
                             f"(C, N) channels-first arrays of {' or '.join(AUDIO_DTYPES)}")
        return True

    def check_specs(self, specs: dict[str, FieldSpec], options: Any = None) -> None:
        super().check_specs(specs, options)
        if options is not None and options.subtype == "FLOAT":
            for f, s in specs.items():
                if s.kind is Kind.AUDIO and s.dtype == "int16":
                    raise ValueError(f"field {f!r} is int16 audio: write it with output.options.subtype PCM_16 "
                                     f"(or auto), or convert it to float32 in the recipe")

    def check_file(self, field: str, array: np.ndarray, sample: Sample, options: Any) -> None:
        sample_rate_of(sample, field, options)
        if array.shape[0] < 1 or array.shape[0] > 65535:
            raise ValueError(f"field {field!r}: {array.shape[0]} channels cannot go in a WAV file")
        if array.size * 4 > 0xFFFFFFF0:
            raise ValueError(f"field {field!r}: {array.size} samples are too many for one WAV file (4 GiB limit)")
        if array.dtype != np.int16 and options.subtype == "PCM_16":
            nan = np.isnan(array)   # clip(round(x * 32768)) has no value for NaN (numpy's cast made it 0)
            if nan.any():
                c, j = (int(v) for v in np.argwhere(nan)[0])
                raise ValueError(f"field {field!r}: a NaN sample (channel {c}, sample {j}) has no 16-bit PCM value; "
                                 f"write float audio with output.options.subtype FLOAT (or auto), or replace the NaN "
                                 f"samples in the recipe")

    def write_file(self, path: str, field: str, array: np.ndarray, sample: Sample, options: Any) -> np.ndarray:
        self.check_file(field, array, sample, options)
        sub = options.subtype
        if sub == "auto":
            sub = "PCM_16" if array.dtype == np.int16 else "FLOAT"
        return write_wav(path, array, sample_rate_of(sample, field, options), sub)

    @classmethod
    def read_file(cls, path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
        return read_wav_file(path, dtype).reshape(tuple(shape))


def read_wav_file(path: str, dtype: str) -> np.ndarray:
    """A WAV file as a (C, N) channels-first array of ``dtype`` (float32: PCM scaled by 1/32768)."""
    import soundfile as sf

    try:
        data, _ = sf.read(path, dtype=dtype, always_2d=True)
    except (RuntimeError, sf.LibsndfileError) as e:
        raise FormatError(f"{path}: cannot read WAV: {e}") from None
    return np.ascontiguousarray(data.T)
