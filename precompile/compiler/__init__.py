"""The compiler: recipe -> plan -> shard keys -> shard tasks -> index and build report.

Modules, each owning one part:

- :mod:`.plan`: the plan (inputs matched to items, items to shards, field specs); pure.
- :mod:`.keys`: fingerprints and shard keys (what decides a rebuild), sibling-shard reuse, the
  skipped-inputs sidecar.
- :mod:`.driver`: :func:`build`, the stage sequence (lock, plan, keys, run, finalize, report).
- :mod:`.backends`: running shard tasks inline, on local workers (dead-worker retry; forked from the build
  by :mod:`.forkpool`, or loky) or on dask.
- :mod:`.shard`: one shard task (decode, steps, copies, write) and the isolated decoder.
- :mod:`.results`: failures, shard results and the build report as dataclasses.
- :mod:`.output`: where a build goes: a local folder, or (:mod:`.url_output`) a URL, and its shard task that
  uploads (:mod:`.upload`); the locks, the store and the uploads themselves are :mod:`precompile.storage`'s.

Only :mod:`.driver` (with :mod:`.plan`, :mod:`.keys`) is imported here: a no-op rebuild imports
neither :mod:`.shard` nor joblib, and nothing here imports torch.
"""
from __future__ import annotations

from .driver import build, check_plan, check_recipe, output_paths, with_policy

__all__ = ["build", "check_plan", "check_recipe", "output_paths", "with_policy"]
