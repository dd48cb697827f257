"""Audio: soundfile decoding (WAV/FLAC/Ogg), mono mixdown, soxr resampling, fix_length and windows."""
from __future__ import annotations

import os

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings, strategies as st

from precompile.decoders.audio import AudioDecoder
from precompile.errors import DecodeError, PrecompileError
from precompile.sample import Sample
from precompile.transforms.audio import FixLength, Windows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from conftest import realdata_root as realdata  # noqa: E402  (skips when ../shared/realdata is absent)


def dec(**kw) -> AudioDecoder:
    return AudioDecoder(AudioDecoder.Params(**kw))


def _pcm(tmp_path, n=1000, ch=2, rate=8000, name="x.wav"):
    rng = np.random.default_rng(0)
    ints = rng.integers(-32768, 32767, (n, ch), dtype=np.int16)
    p = str(tmp_path / name)
    sf.write(p, ints, rate, subtype="PCM_16")
    return p, ints


def test_int16_round_trip_exact_and_float_scale(tmp_path):
    p, ints = _pcm(tmp_path)
    a, meta = dec(mono=False, dtype="int16").read(p)
    assert a.dtype == np.int16 and a.shape == (2, 1000)
    np.testing.assert_array_equal(a, ints.T)
    f, meta = dec(mono=False, channels=2).read(p)
    assert f.dtype == np.float32
    np.testing.assert_array_equal(f, ints.T.astype(np.float32) / 32768)
    assert meta["sample_rate"] == 8000 and meta["source_channels"] == 2 and meta["frames"] == 1000


def test_mono_is_channel_mean_and_channel_check(tmp_path):
    p, ints = _pcm(tmp_path)
    m, _ = dec().read(p)
    assert m.shape == (1, 1000)
    np.testing.assert_allclose(m[0], ints.astype(np.float64).mean(1) / 32768, atol=1e-7)
    with pytest.raises(DecodeError, match="has 2 channels"):
        dec(mono=False, channels=1).read(p)
    assert dec().spec().shape == (1, None) and dec(mono=False).spec().shape == (None, None)


@pytest.mark.parametrize("rate_in, rate_out", [(44100, 16000), (8000, 22050), (48000, 16000)])
def test_resample_keeps_pitch_and_length(tmp_path, rate_in, rate_out):
    n = rate_in  # one second
    t = np.arange(n) / rate_in
    p = str(tmp_path / "tone.flac")
    sf.write(p, 0.5 * np.sin(2 * np.pi * 440 * t), rate_in, subtype="PCM_24")
    a, meta = dec(sample_rate=rate_out).read(p)
    assert meta["sample_rate"] == rate_out and meta["source_rate"] == rate_in
    assert abs(a.shape[1] - rate_out) <= 1          # no samples dropped
    spec = np.abs(np.fft.rfft(a[0] * np.hanning(a.shape[1])))
    peak = np.argmax(spec) * rate_out / a.shape[1]
    assert abs(peak - 440) < 2
    assert abs(np.sqrt(np.mean(a[0, 100:-100] ** 2)) - 0.5 / np.sqrt(2)) < 0.01   # amplitude kept


def test_fix_length_and_windows():
    x = np.arange(10, dtype=np.float32).reshape(1, 10)
    s = Sample("a.wav", {"audio": x}, {"audio": "audio"}, {"audio": {"sample_rate": 8000}})
    rng = np.random.default_rng(0)
    (o,) = FixLength(FixLength.Params(length=4, align="center")).run(s, rng)
    assert o.fields["audio"].tolist() == [[3, 4, 5, 6]]
    (o,) = FixLength(FixLength.Params(length=13)).run(s, rng)
    assert o.fields["audio"][0, 10:].tolist() == [0, 0, 0] and o.fields["audio"][0, :10].tolist() == list(range(10))
    out = Windows(Windows.Params(length=4, hop=3)).run(s, rng)
    assert [o.key for o in out] == ["a.wav#w0", "a.wav#w1", "a.wav#w2"]
    assert [o.fields["audio"][0].tolist() for o in out] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert out[1].meta["window"]["start"] == 3 and out[1].meta["audio"] == {"sample_rate": 8000}
    out = Windows(Windows.Params(length=4, hop=4, tail="pad")).run(s, rng)
    assert [o.fields["audio"][0].tolist() for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert Windows(Windows.Params(length=20, hop=4)).run(s, rng) == []
    (o,) = Windows(Windows.Params(length=20, hop=4, short="pad")).run(s, rng)
    assert o.fields["audio"].shape == (1, 20)
    assert x.tolist() == [list(range(10))]          # input untouched


def test_real_files():
    root = os.path.join(realdata(), "audio")
    expect = {"chinese.flac": (48000, 1), "198-209-0000.ogg": (22050, 1),
              "sorohanro_-_solo-trumpet-06.hq.ogg": (44100, 2)}
    for name, (rate, ch) in expect.items():
        p = os.path.join(root, name)
        if not os.path.exists(p):
            pytest.skip(f"{name} absent")
        info = sf.info(p)
        a, meta = dec(mono=False).read(p)
        assert meta["source_rate"] == rate and a.shape == (ch, info.frames) and a.dtype == np.float32
        assert np.abs(a).max() <= 1.0 and np.abs(a).max() > 0.01
        m, meta = dec(sample_rate=16000, dtype="int16").read(p)
        assert m.shape[0] == 1 and m.dtype == np.int16
        assert abs(m.shape[1] - round(info.frames * 16000 / rate)) <= 1


def test_recipe_builds(tmp_path):
    import precompile
    from precompile import build

    build(os.path.join(REPO, "recipes", "audio.yaml"), out_dir=str(tmp_path))
    ds = precompile.open(str(tmp_path / "audio.h5"))
    assert all(ds[i]["audio"].shape == (1, 8000) for i in range(len(ds)))
    # tone_16k.wav: 1.5 s at 16 kHz -> windows at 0, 4000, 8000, 12000, 16000 (last padded)
    keys = [k for k in ds.keys if k.startswith("tone_16k.wav")]
    assert keys == [f"tone_16k.wav#w{i}" for i in range(5)]
    src, _ = dec(sample_rate=16000).read(os.path.join(REPO, "sample_data", "audio", "tone_16k.wav"))
    np.testing.assert_array_equal(ds[ds.keys.index("tone_16k.wav#w1")]["audio"], src[:, 4000:12000])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), cut=st.integers(0, 300))
def test_fuzz_only_project_errors(tmp_path, data, cut):
    p = tmp_path / "good.wav"
    if not p.exists():
        sf.write(str(p), np.zeros((100, 1), np.int16), 8000, subtype="PCM_16")
    good = p.read_bytes()
    for blob in (data, good[:cut], good[:44] + data, b"RIFF" + data):
        q = tmp_path / "f.wav"
        q.write_bytes(blob)
        try:
            a, _ = dec().read(str(q))
        except PrecompileError:
            continue
        assert a.dtype == np.float32 and a.shape[0] == 1


def _gain_build(tmp_path, ints: np.ndarray, gain: dict, fmt: str = "hdf5") -> np.ndarray:
    """Build one int16 WAV through ``random_gain`` (decoder dtype int16) and return the stored (C, N) samples."""
    import precompile

    (tmp_path / "in").mkdir()
    sf.write(str(tmp_path / "in" / "a.wav"), ints.T, 8000, subtype="PCM_16")
    recipe = {"name": "g", "seed": 3, "inputs": {"root": str(tmp_path / "in"), "match": "{name}.wav",
                                                  "fields": {"audio": {"decoder": "audio", "mono": False,
                                                                       "dtype": "int16"}}},
              "steps": [{"random_gain": gain}], "output": {"format": fmt, "samples_per_shard": 1}}
    precompile.build(recipe, out_dir=str(tmp_path / "out"))
    ds = precompile.open(str(tmp_path / "out" / ("g.h5" if fmt == "hdf5" else "g.json")))
    a = ds[0]["audio"]
    assert a.dtype == np.int16 and ds.meta(0)["augment"][0]["step"] == "random_gain"
    return a


@pytest.mark.parametrize("db, clip", [(-6.0, False), (3.0, False), (3.0, True), (12.0, True), (12.0, False)])
def test_random_gain_on_int16_audio_scales_rounds_and_saturates(tmp_path, db, clip):
    """int16 audio: the gain is computed in float, rounded and saturated to [-32768, 32767] (clip or not: an
    int16 cannot hold more); it once cast the gain itself to int16 (0 below 0 dB: silence; 1 from 0 to 6 dB:
    unchanged; clip: [-1, 1])."""
    ints = np.array([[0, 1, -1, 100, -100, 1000, -20000, 20000, 32767, -32768, 12345, -7]], np.int16)
    a = _gain_build(tmp_path, ints, {"db": [db, db], "clip": clip})
    want = np.clip(np.rint(ints.astype(np.float64) * 10 ** (db / 20)), -32768, 32767).astype(np.int16)
    np.testing.assert_array_equal(a, want)
    # the float32 decoder with the same gain gives the same audio, to one PCM step
    ref = ints.astype(np.float64) / 32768 * 10 ** (db / 20)
    ref = np.clip(ref, -1, 32767 / 32768)
    assert np.abs(a / 32768 - ref).max() <= 0.5 / 32768 + 1e-12


def test_random_gain_on_int16_audio_kernel_and_wav_output(tmp_path):
    from precompile.transforms.kernels.audio import apply_gain

    ints = np.array([[-32768, -3, 0, 3, 32767]], np.int16)
    np.testing.assert_array_equal(apply_gain(ints, -6.0), np.rint(ints * 10 ** (-6 / 20)).astype(np.int16))
    np.testing.assert_array_equal(apply_gain(ints, 6.0, clip=True), [[-32768, -6, 0, 6, 32767]])
    assert apply_gain(ints, 6.0).dtype == np.int16
    # through the wav writer: the stored PCM_16 file holds the scaled samples
    rng = np.random.default_rng(5)
    pcm = rng.integers(-20000, 20000, (1, 300)).astype(np.int16)
    a = _gain_build(tmp_path, pcm, {"db": [-3.0, -3.0]}, fmt="wav")
    np.testing.assert_array_equal(a, np.rint(pcm * 10 ** (-3 / 20)).astype(np.int16))
