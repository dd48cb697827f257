"""What a build produces besides files: failures, shard results and the build report, as dataclasses.

Owns their JSON form. A :class:`Failure` is one failed input (or a policy note such as "stopped after
max_failures"); it is stored in a shard's ``.skipped.json`` sidecar and in the report. A
:class:`ShardResult` is what a shard task sends back to the parent (it is pickled from loky and dask
workers). A :class:`BuildReport` is what :func:`precompile.build` returns and what is written as
``<output>.report.json``; it reads like the dict it serialises to (``rep["shards"]["built"]``,
``rep.get("up_to_date")``), so callers written against the dict keep working.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

#: the stage timings every shard result and report carries
STAGES = ("decode", "steps", "write")


def zero_timings() -> dict[str, float]:
    return {k: 0.0 for k in STAGES}


@dataclass(frozen=True)
class Failure:
    """One failed input, or (``policy``) a note that the error policy stopped a shard."""

    message: str
    detail: str = ""
    path: Optional[str] = None
    stage: Optional[str] = None
    field: Optional[str] = None
    key: Optional[str] = None
    type: str = ""
    shard: Optional[int] = None
    policy: bool = False
    previous_build: bool = False

    @classmethod
    def from_error(cls, e: Any, shard: Optional[int] = None) -> "Failure":
        """The failure an :class:`~precompile.errors.InputError` describes."""
        return cls(str(e), e.detail, e.path, e.stage, e.field, e.key, getattr(e, "type_name", type(e).__name__),
                   shard)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Failure":
        return cls(d["message"], d.get("detail", ""), d.get("path"), d.get("stage"), d.get("field"), d.get("key"),
                   d.get("type", ""), d.get("shard"), bool(d.get("policy")), bool(d.get("previous_build")))

    def from_previous_build(self) -> "Failure":
        """This failure as recorded by an earlier build of an up-to-date shard."""
        return replace(self, previous_build=True)

    def to_json(self) -> dict[str, Any]:
        """The report's (and the sidecar's) form: optional keys only when they apply."""
        d: dict[str, Any] = {"message": self.message, "detail": self.detail, "path": self.path, "stage": self.stage,
                             "field": self.field, "key": self.key, "type": self.type}
        if self.shard is not None:
            d["shard"] = self.shard
        if self.policy:
            d["policy"] = True
        if self.previous_build:
            d["previous_build"] = True
        return d


def count_inputs(failures: list[Failure]) -> int:
    """Failed inputs (policy notes such as 'stopped after max_failures' are not inputs)."""
    return sum(1 for f in failures if not f.policy)


@dataclass
class ShardResult:
    """What one shard task returns: ``built`` with the writer's info, or ``failed`` (its file is not kept)."""

    index: int
    status: str
    failures: list[Failure]
    timings: dict[str, float]
    wall: float
    num_samples: int = 0
    bytes: int = 0
    checksums: Any = None
    sha256: Optional[str] = None
    #: the shard's share of the index (HDF5: :class:`precompile.formats.hdf5_parts.ShardParts`), so that
    #: finalize need not reopen the shard; None for formats that keep it in the shard (file folders)
    parts: Any = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def info(self, key: str) -> dict[str, Any]:
        """The shard's entry as the index records it (and as ``read_shard_info`` reads it back)."""
        return {"num_samples": self.num_samples, "bytes": self.bytes, "checksums": self.checksums, "key": key,
                "sha256": self.sha256}


@dataclass(eq=False)
class BuildReport(Mapping):
    """The build report. ``to_json()`` is the report file's content, key for key; the report also
    reads as that dict (``rep["shards"]["built"]``, ``rep.get("up_to_date")``, ``"bytes" in rep``)."""

    name: str
    recipe: Optional[str]
    recipe_hash: str
    output: str
    format: str
    jobs: int
    inputs: int
    shards: dict[str, int]
    failures: list[Failure]
    events: list[str]
    on_error: str
    stage_seconds: dict[str, float]
    wall_seconds: float
    precompile_version: str
    status: str = "ok"
    up_to_date: bool = False
    num_samples: Optional[int] = None
    bytes: Optional[int] = None
    #: the rate of the samples this build wrote (``samples_built`` / wall time): an incremental
    #: build's up-to-date and reused shards are left out; 0 when nothing was built
    samples_per_second: Optional[float] = None
    samples_built: Optional[int] = None   # samples in the shards this build wrote
    #: with ``split:``: split -> {inputs, fraction (of inputs), samples, output}
    splits: Optional[dict[str, dict[str, Any]]] = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name, "recipe": self.recipe, "recipe_hash": self.recipe_hash, "output": self.output,
            "format": self.format, "jobs": self.jobs, "inputs": self.inputs, "shards": dict(self.shards),
            "failures": [f.to_json() for f in self.failures], "skipped_inputs": count_inputs(self.failures),
            "events": list(self.events), "on_error": self.on_error, "stage_seconds": dict(self.stage_seconds),
            "wall_seconds": self.wall_seconds, "precompile_version": self.precompile_version, "status": self.status,
        }
        if self.up_to_date:
            d["up_to_date"] = True
        if self.num_samples is not None:
            d["num_samples"] = self.num_samples
            d["bytes"] = self.bytes
            d["samples_per_second"] = self.samples_per_second
            d["samples_built"] = self.samples_built
        if self.splits is not None:
            d["splits"] = {k: dict(v) for k, v in self.splits.items()}
        return d

    def __getitem__(self, k: str) -> Any:
        return self.to_json()[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())

    def __repr__(self) -> str:
        return f"BuildReport({self.to_json()!r})"
