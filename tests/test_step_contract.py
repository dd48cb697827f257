"""Shared checks on every registered step, from the case tables in ``tests/step_cases_*.py``.

Each ``step_cases_<family>.py`` defines ``CASES = {step_name: [(params, sample_factory), ...]}``.
For every case: the input sample is not mutated; the output honours the declared
``output_spec`` (shape, None matching anything, and dtype); the same rng seed gives the same
bytes; the step pickles and the unpickled step gives the same bytes; random steps record JSON
parameters, vary with the seed and replay from their record. A registered step with no case
fails :func:`test_every_registered_step_has_a_case`.
"""
from __future__ import annotations

import glob
import hashlib
import importlib
import os
import pickle
import sys

import numpy as np
import pytest

from precompile.formats import names as fmt
from precompile.registry import STEPS, load_builtins
from precompile.sample import FieldSpec, Sample
from precompile.seeding import rng_for
from precompile.transforms.base import RandomStep, replay_step

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

load_builtins()


def _collect() -> tuple[dict[str, list], list[str]]:
    cases: dict[str, list] = {}
    modules = []
    for path in sorted(glob.glob(os.path.join(HERE, "step_cases_*.py"))):
        name = os.path.splitext(os.path.basename(path))[0]
        mod = importlib.import_module(name)
        modules.append(name)
        for step, entries in mod.CASES.items():
            cases.setdefault(step, []).extend(entries)
    return cases, modules


CASES, MODULES = _collect()
PARAMS = [pytest.param(name, params, factory, id=f"{name}-{i}")
          for name, entries in sorted(CASES.items()) for i, (params, factory) in enumerate(entries)]
RANDOM = [p for p in PARAMS if p.values[0] in STEPS and STEPS.get(p.values[0]).random]
REPLAYABLE = [p for p in RANDOM if not STEPS.get(p.values[0]).expands]
NEUTRAL = [p for p in RANDOM if issubclass(STEPS.get(p.values[0]), RandomStep)]


def _make(name: str, params: dict):
    cls = STEPS.get(name)
    return cls(cls.Params.model_validate(params))


def _specs(sample: Sample) -> dict[str, FieldSpec]:
    return sample.specs()   # with the ties (``of``): a step that drops boxes drops their tied rows


def _snapshot(sample: Sample) -> dict:
    return {"key": sample.key, "kinds": dict(sample.kinds), "meta": fmt.dumps(sample.meta), "copy": sample.copy,
            "fields": {f: (a.shape, str(a.dtype), a.tobytes()) for f, a in sample.fields.items()}}


def _digest(samples: list[Sample]) -> list:
    return [_snapshot(s) for s in samples]


def test_case_tables_found():
    assert {"step_cases_planar", "step_cases_random", "step_cases_temporal_audio_volume"} <= set(MODULES)
    assert PARAMS


def _builtin_steps() -> list[str]:
    """Steps the package registers (tests may register throwaway plugin steps of their own)."""
    return [n for n, cls in STEPS.items() if cls.__module__.startswith("precompile.")]


def test_every_registered_step_has_a_case():
    missing = [n for n in _builtin_steps() if not CASES.get(n)]
    assert not missing, f"registered steps with no case in tests/step_cases_*.py: {missing}"


def test_every_registered_step_has_a_case_for_every_kind_it_applies_to():
    """A step that claims a kind must be exercised on it: the shared checks then run on that kind."""
    missing = []
    for n in _builtin_steps():
        covered = {k for _, factory in CASES.get(n, []) for k in factory().kinds.values()}
        lacking = sorted(k.value for k in STEPS.get(n).applies - covered)
        if lacking:
            missing.append(f"{n}: {', '.join(lacking)}")
    assert not missing, "steps with no case for a kind they apply to (tests/step_cases_*.py): " + "; ".join(missing)


def test_every_case_names_a_registered_step():
    unknown = [n for n in CASES if n not in STEPS]
    assert not unknown, f"cases for steps nobody registered: {unknown}"


@pytest.mark.parametrize("name,params,factory", PARAMS)
def test_input_not_mutated(name, params, factory):
    step = _make(name, params)
    sample = factory()
    before = _snapshot(sample)
    out = step.run(sample, rng_for(0, sample.key, 1))
    assert out, "a step must return at least one sample"
    assert _snapshot(sample) == before
    for s in out:  # outputs own their arrays: writing to them must not reach the input
        for f, a in s.fields.items():
            if f in sample.fields and a is not sample.fields[f]:
                assert not np.shares_memory(a, sample.fields[f]), f"{name}: output {f!r} is a view of the input"


@pytest.mark.parametrize("name,params,factory", PARAMS)
def test_declared_spec_honoured(name, params, factory):
    step = _make(name, params)
    sample = factory()
    declared = step.plan(_specs(sample))
    for seed in range(3):
        for s in step.run(factory(), rng_for(seed, sample.key, 1)):
            assert set(s.fields) == set(declared), name
            for f, a in s.fields.items():
                d = declared[f]
                assert s.kinds[f] == d.kind
                assert str(a.dtype) == d.dtype, f"{name}: {f} is {a.dtype}, declared {d.dtype}"
                assert a.ndim == len(d.shape) and all(e is None or e == n for e, n in zip(d.shape, a.shape)), \
                    f"{name}: {f} has shape {a.shape}, declared {d.shape}"


@pytest.mark.parametrize("name,params,factory", PARAMS)
def test_same_seed_same_bytes(name, params, factory):
    step = _make(name, params)
    key = factory().key
    a = step.run(factory(), rng_for(7, key, 2))
    b = step.run(factory(), rng_for(7, key, 2))
    assert _digest(a) == _digest(b)


@pytest.mark.parametrize("name,params,factory", PARAMS)
def test_picklable(name, params, factory):
    step = _make(name, params)
    clone = pickle.loads(pickle.dumps(step))
    assert type(clone) is type(step) and clone.params == step.params
    key = factory().key
    assert _digest(clone.run(factory(), rng_for(3, key, 1))) == _digest(step.run(factory(), rng_for(3, key, 1)))


@pytest.mark.parametrize("name,params,factory", RANDOM)
def test_random_step_records_and_varies(name, params, factory):
    step = _make(name, params)
    key = factory().key
    outs = []
    for seed in range(8):
        res = step.run(factory(), rng_for(seed, key, 1))
        for s in res:
            recs = s.meta.get("augment")
            assert recs and recs[-1]["step"] == name, f"{name}: drawn parameters not recorded in meta['augment']"
            assert fmt.loads(fmt.dumps(s.meta)) == s.meta, f"{name}: recorded parameters are not plain JSON"
        outs.append(hashlib.sha256(b"".join(s.fields[f].tobytes() for s in res for f in sorted(s.fields))).hexdigest())
    assert len(set(outs)) > 1, f"{name}: 8 seeds gave the same output; the step ignores its rng"


@pytest.mark.parametrize("name,params,factory", REPLAYABLE)
def test_random_step_replays_from_record(name, params, factory):
    step = _make(name, params)
    key = factory().key
    for seed in range(3):
        (out,) = step.run(factory(), rng_for(seed, key, 1))
        rec = fmt.loads(fmt.dumps(out.meta["augment"][-1]))  # as stored: through JSON
        rec.pop("step")
        again = replay_step(step, factory(), rec)
        assert _snapshot(again) == _snapshot(out)


@pytest.mark.parametrize("name,params,factory", NEUTRAL)
def test_neutral_original_has_the_declared_shape(name, params, factory):
    step = _make(name, params)
    declared = step.plan(_specs(factory()))
    (orig,) = step.run_original(factory())
    for f, a in orig.fields.items():
        assert str(a.dtype) == declared[f].dtype
        assert all(e is None or e == n for e, n in zip(declared[f].shape, a.shape)), (f, a.shape, declared[f].shape)
    assert orig.meta["augment"][-1]["step"] == name
