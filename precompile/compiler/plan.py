"""Recipe -> Plan: inputs matched to items (sample keys), items to shards, every
field's final shape and dtype. Pure: no decoding, no writing.

The match pattern is a relative path with ``{name}`` captures (each matches one
path component or part of one); ``where`` narrows captures with regular
expressions. Items are sorted by key, so the plan's order is the same on every
machine and for every job count.

The plan consumes inputs (:func:`precompile.inputs.read_inputs`: a folder listed and matched folder by
folder, a table read by column, or a COCO file) and holds their items by column (an
:class:`~precompile.inputs.items.ItemTable`); ``Plan.items`` and ``ShardPlan.items`` build
:class:`~precompile.inputs.items.Item` objects when read, and a shard pickled for a worker carries only its
own rows.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ..errors import PlanError, RecipeError, echo
from ..formats.names import check_field_name
from ..inputs import read_inputs
from ..inputs.items import Factors, Item, Items, ItemTable, Rows, Strings, row_index
from ..kinds import Kind
from ..recipe import Recipe
from ..sample import FieldSpec, link_fields


class ShardPlan:
    """One shard: a range (or, with ``split:``, an index array) of rows of the plan's :class:`ItemTable`.
    ``items`` builds its :class:`Item` objects when read; pickled for a worker, a shard carries only its
    own rows (:meth:`ItemTable.take`)."""

    __slots__ = ("index", "table", "rows", "split")

    def __init__(self, index: int, table: ItemTable, rows: Rows, split: Optional[str] = None):
        self.index, self.table, self.rows, self.split = index, table, rows, split

    @property
    def items(self) -> Items:
        return Items(self.table, self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __reduce__(self) -> tuple:
        return ShardPlan, (self.index, self.table.take(self.rows), range(len(self.rows)), self.split)

    def __repr__(self) -> str:
        return f"ShardPlan(index={self.index}, items={len(self.rows)}, split={self.split!r})"


@dataclass
class Plan:
    recipe: Recipe
    items: Items                           # every item in key order (built when read: see inputs/items.py)
    shards: list[ShardPlan]
    specs: dict[str, FieldSpec]            # final field specs, in output order
    label_names: list[str]
    expands: bool                          # a step may turn one sample into several
    attrs: dict[str, Any] = field(default_factory=dict)   # extra index attributes (inputs.coco: categories...)
    pending: Any = field(default=None, repr=False)   # inputs.coco: a parse owed to the output's cache (coco_cache)

    @property
    def table(self) -> ItemTable:
        return self.items.table

    def split_view(self, name: str) -> "Plan":
        """The plan of one split's output: its items (in key order) and its shards."""
        t = self.table
        code = t.split_names.index(name)
        base = self.items.rows
        sel = np.flatnonzero(t.split[row_index(base)] == code)
        sub = sel + base.start if isinstance(base, range) and base.step == 1 else np.asarray(base)[sel]
        return dataclasses.replace(self, items=Items(t, sub), shards=[s for s in self.shards if s.split == name])

    def split_counts(self) -> dict[str, int]:
        """Inputs per split, in output order (empty without ``split:``)."""
        t = self.table
        names = split_names(self.recipe, self.items)
        if not names:
            return {}
        counts = np.bincount(t.split[row_index(self.items.rows)], minlength=len(t.split_names))
        return {n: int(counts[t.split_names.index(n)]) for n in names}

    @property
    def copies_per_item(self) -> int:
        m = self.recipe.model
        return m.copies + (1 if (m.keep_original or m.copies == 0) else 0)

    @property
    def num_samples(self) -> int:
        """Samples written (a lower bound when a step expands samples)."""
        return len(self.items) * self.copies_per_item

    def sample_bytes(self) -> Optional[int]:
        total = 0
        for s in self.specs.values():
            n = s.nbytes()
            if n is None:
                return None
            total += n
        return total

    def data_bytes(self) -> Optional[int]:
        """Bytes of sample data (fixed shapes only; a lower bound when a step expands samples)."""
        per = self.sample_bytes()
        return None if per is None else per * self.num_samples

    def shard_samples(self, shard: ShardPlan) -> int:
        """Samples a shard will hold (a lower bound when a step expands samples)."""
        return len(shard) * self.copies_per_item

    def chunking(self, shard: Optional[ShardPlan] = None) -> dict[str, int]:
        """Rows per chunk of each field in ``shard`` (default: a full shard), as the output format
        decides it (:meth:`precompile.formats.base.Format.chunking`)."""
        from ..registry import WRITERS

        out = self.recipe.model.output
        n = self.shard_samples(shard) if shard is not None else out.samples_per_shard * self.copies_per_item
        return WRITERS.get(out.format).chunking(self.specs, max(1, n), out.chunk_bytes, out.chunk_samples)

    def estimated_bytes(self) -> Optional[int]:
        """What the build will write, in bytes: the data as the output format lays it out (HDF5:
        whole chunks, 4 KiB alignment, per-shard metadata and key/meta columns); None when a field's
        shape is known only after decoding."""
        data = self.data_bytes()
        if data is None:
            return None
        from ..registry import WRITERS

        estimate = getattr(WRITERS.get(self.recipe.model.output.format), "estimate_shard_bytes", None)
        if estimate is None:
            return data
        maps = self.map_meta_bytes()
        return sum(estimate(self.specs, self.shard_samples(s), self.chunking(s),
                            s.table.key_bytes(s.rows) * self.copies_per_item + maps * self.shard_samples(s))
                   for s in self.shards)

    #: what an image field's map back to the source adds to a sample's meta when a step moves the image
    #: (transforms/source_map.py: ``"image":{"source_size":[h,w],"to_source":[[a,b,c],[d,e,f]]}``, its numbers
    #: short or long: about 80 bytes); an unmoved image at its own size records none
    MAP_META_BYTES = 80

    def map_meta_bytes(self) -> int:
        """Estimated meta bytes per sample of the image fields' maps: :data:`MAP_META_BYTES` per image field when
        the recipe has steps (a decode alone records a map only when it reduced or turned the image)."""
        if not self.recipe.steps:
            return 0
        return self.MAP_META_BYTES * sum(1 for s in self.specs.values() if s.kind is Kind.IMAGE)


def _add_column_specs(recipe: Recipe, specs: dict[str, FieldSpec]) -> None:
    """The specs of a table's column fields (label, target, text), after the decoders' and steps' fields."""
    if not recipe.model.inputs.columns:
        return
    from ..inputs.table.cells import column_specs

    for name, spec in column_specs(recipe.model.inputs.columns).items():
        if name in specs:
            raise RecipeError(f"column field {name!r} clashes with another field", source=recipe.source,
                              loc=f"inputs.columns.{name}")
        specs[name] = spec


def _make_shards(recipe: Recipe, table: ItemTable, factors: Factors) -> tuple[ItemTable, list[ShardPlan]]:
    """Items to shards in key order; with ``split:``, each split's items in shards of their own. Returns the
    table too: ``item_options`` may make several items of one (:func:`split_items`)."""
    per = recipe.model.output.samples_per_shard
    if recipe.model.split is None:
        table = split_items(recipe, table)
        n = len(table)
        return table, [ShardPlan(i // per, table, range(i, min(i + per, n))) for i in range(0, n, per)]
    from ..inputs.splits import assign_splits

    table = split_items(recipe, assign_splits(recipe, table, factors))   # a file's volumes share its split
    shards: list[ShardPlan] = []
    for name in split_names(recipe, Items(table)):
        mine = np.flatnonzero(table.split == table.split_names.index(name))
        for i in range(0, len(mine), per):
            shards.append(ShardPlan(len(shards), table, mine[i:i + per], split=name))
    return table, shards


def split_names(recipe: Recipe, items: Sequence[Item]) -> list[str]:
    """The split names in output order: the fractions' order, or (by column) sorted."""
    sp = recipe.model.split
    if sp is None:
        return []
    if sp.fractions:
        return list(sp.fractions)
    if isinstance(items, Items):
        t = items.table
        return sorted(t.split_names[c] for c in np.unique(t.split[row_index(items.rows)]))
    return sorted({it.split for it in items})


def check_field_names(recipe: Recipe, specs: dict[str, FieldSpec]) -> None:
    """Every output field (decoded, made by a step, or the label) names a dataset: letters, digits, '_', '.',
    '-', not starting with '__' (a '/' would make an HDF5 group, a '__' clashes with the key and meta columns)."""
    for f in specs:
        try:
            check_field_name(f)
        except ValueError:
            raise RecipeError(f"output field name {f!r} must be letters, digits, '_', '.', '-' and not start with "
                              f"'__' (it names a dataset in the output)", source=recipe.source) from None


def decoder_specs(recipe: Recipe) -> dict[str, FieldSpec]:
    """The decoders' output specs (flow_valid fields tied to their flows); RecipeError names the field."""
    m = recipe.model   # no input is listed here: make_plan lists them once (a second walk was half the plan)
    specs: dict[str, FieldSpec] = {}
    for fname, dec in recipe.decoders.items():
        if m.inputs.fields[fname].path is None and dec.reads_dirs != (m.inputs.kind == "dir"):
            want = "folders (inputs.kind: dir)" if dec.reads_dirs else "files (inputs.kind: file)"
            raise RecipeError(f"decoder {dec.name!r} reads {want}, but inputs.kind is {m.inputs.kind!r}",
                              source=recipe.source, loc=f"inputs.fields.{fname}")
        try:
            outputs = dec.output_specs(fname)
        except ValueError as e:
            raise RecipeError(str(e), source=recipe.source, loc=f"inputs.fields.{fname}") from None
        for name, spec in outputs.items():
            if name in specs:
                raise RecipeError(f"decoder output {name!r} clashes with another field", source=recipe.source,
                                  loc=f"inputs.fields.{fname}")
            specs[name] = spec
    try:
        links = link_fields({f: s.kind for f, s in specs.items()}, {f: s.of for f, s in specs.items() if s.of})
    except ValueError as e:
        raise RecipeError(str(e), source=recipe.source, loc="inputs.fields") from None
    return {f: s.with_(of=links[f]) if f in links else s for f, s in specs.items()}


def plan_specs(recipe: Recipe, extra: Optional[dict[str, FieldSpec]] = None) -> tuple[dict[str, FieldSpec], bool]:
    """Every field's spec after the steps, and whether a step expands samples: the kind rules and
    field matching of every step, without listing an input or decoding one."""
    specs = decoder_specs(recipe)
    if extra:  # inputs.coco: the annotation fields the file gives (boxes, box_labels, keypoints, mask)
        from ..inputs.coco import add_specs

        specs = add_specs(recipe, specs, extra)
    expands = False
    for i, step in enumerate(recipe.steps):
        try:
            specs = _clip_audio(recipe, step, specs, step.plan(specs))
        except ValueError as e:
            raise RecipeError(str(e), source=recipe.source, loc=f"steps[{i}].{step.name}") from None
        expands = expands or step.expands
    label = recipe.model.inputs.label
    if label is not None:
        specs[label.field] = FieldSpec(Kind.LABEL, (), "int64")
    _add_column_specs(recipe, specs)
    check_field_names(recipe, specs)
    return specs, expands


def check_sample_budget(recipe: Recipe, specs: dict[str, FieldSpec]) -> None:
    """PlanError when one stored sample of fixed shape would be larger than ``limits.sample_bytes``."""
    from ..decoders.base import fmt_bytes

    sizes = {k: s.nbytes() for k, s in specs.items()}
    if any(n is None for n in sizes.values()):
        return   # variable shapes: each decoder's input budget bounds them
    total, budget = sum(sizes.values()), recipe.model.limits.sample_bytes
    if total > budget:
        big = max(sizes, key=lambda k: sizes[k])
        raise PlanError(f"one sample would take {fmt_bytes(total)} ({big}: {specs[big].shape} {specs[big].dtype}), "
                        f"over the per-sample budget of {fmt_bytes(budget)} (limits.sample_bytes)")


def split_items(recipe: Recipe, table: ItemTable) -> ItemTable:
    """Items whose file makes several samples (a decoder's ``item_options``: NIfTI ``index: all`` on a 4D
    file) become one item per sample, keyed ``<key>#v<n>``, each with its own decoder options; fields
    that split one item must agree on the count."""
    hooks = {f: d.item_options for f, d in recipe.decoders.items() if callable(getattr(d, "item_options", None))}
    if not hooks:
        return table
    n = len(table)
    keys = table.keys.to_list()
    paths = {f: [table.prefix + p for p in table.paths[f].to_list()] for f in hooks if f in table.paths}
    counts, new_keys, new_opts = np.ones(n, np.int64), [], []
    for i in range(n):
        opts0 = table.options[i] if table.options is not None else {}
        per = {f: opts for f, fn in hooks.items() if f in paths for opts in [fn(paths[f][i])] if opts is not None}
        sizes = {f: len(v) for f, v in per.items()}
        if len(set(sizes.values())) > 1:
            raise PlanError(f"{keys[i]}: fields split into different numbers of samples ({sizes}); "
                            f"index: all needs as many volumes in each")
        if not per:
            new_keys.append(keys[i])
            new_opts.append(opts0)
            continue
        counts[i] = next(iter(sizes.values()))
        for k in range(counts[i]):
            new_keys.append(f"{keys[i]}#v{k}")
            new_opts.append({**opts0, **{f: {**opts0.get(f, {}), **v[k]} for f, v in per.items()}})
    out = table.take(np.repeat(np.arange(n), counts))
    out.keys = Strings.from_list(new_keys)   # the paths keep the file's name (no #v<n>), even where they were the keys
    out.options = new_opts
    return out


def _clip_audio(recipe: Recipe, step: Any, before: dict[str, FieldSpec],
                specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """A video's audio track (the video decoder's ``audio_field``) follows the steps that cut its frames in
    time (their ``audio_spec``): clips cut by time hold exactly ``length / fps`` seconds, so where the decoder
    fixes the rate (``audio_rate``) the audio field's length is known at plan time and stored fixed (readers,
    the Loader, take it without a ``fix_length``); ``temporal_jitter`` keeps the kept frames' span, fixed only
    when every draw spans as many frames."""
    audio_spec = getattr(step, "audio_spec", None)
    if audio_spec is None:
        return specs
    for f in step.targets(before):
        p = getattr(recipe.decoders.get(f), "params", None)
        afield = getattr(p, "audio_field", None)
        spec = specs.get(afield) if afield else None
        if spec is not None:
            specs[afield] = audio_spec(spec, getattr(p, "audio_rate", None), before[f])
    return specs


def make_plan(recipe: Recipe, listing: Optional[Iterable[Any]] = None, coco_cache: Optional[str] = None,
              content_hash: bool = False) -> Plan:
    """Read the inputs and work out every shape; raises RecipeError/PlanError before any decoding.
    ``listing``: batches of names to match in place of walking ``inputs.root``; ``coco_cache``: where the
    output keeps the parsed ``inputs.coco`` file (the plan's ``pending`` is then the parse to write there, if
    it was not read from there), fingerprinted by content with ``content_hash``
    (:func:`precompile.inputs.read_inputs`)."""
    m = recipe.model
    inputs = read_inputs(recipe, listing, coco_cache, content_hash)
    specs, expands = plan_specs(recipe, inputs.specs or None)
    if not len(inputs.table):
        if m.inputs.table is not None:
            kept = f" that inputs.where keeps ({echo(m.inputs.where)})" if isinstance(m.inputs.where, str) else ""
            raise PlanError(f"table {m.inputs.table!r} has no rows{kept}")
        raise PlanError(f"no inputs under {recipe.input_root!r} match {m.inputs.match!r}"
                        + (f" with {m.inputs.where}" if m.inputs.where else ""))
    check_sample_budget(recipe, specs)
    table, shards = _make_shards(recipe, inputs.table, inputs.factors)
    return Plan(recipe=recipe, items=Items(table), shards=shards, specs=specs, label_names=inputs.label_names,
                expands=expands, attrs=inputs.attrs, pending=inputs.pending)


def video_reads(plan: Plan, limit: int = 100) -> list[str]:
    """How the build reads each video field, for ``precompile plan``: streamed (one clip at a time in
    memory), or whole, with the memory one video needs: frames x H x W x C from the largest of the
    first ``limit`` inputs' container headers (the declared size; "unknown" where none declares it)."""
    from ..storage.remote import is_url
    from ..transforms.temporal import frame_steps_plan, stream_plan, whole_video_reason

    recipe = plan.recipe
    stream = stream_plan(recipe.decoders, recipe.steps)
    if stream is not None:
        return [stream.describe()]
    reason = whole_video_reason(recipe.decoders, recipe.steps)
    if reason is None:
        return []
    frames = frame_steps_plan(recipe.decoders, recipe.steps)
    out = []
    for fname, dec in recipe.decoders.items():
        if not hasattr(dec, "declared_shape"):
            continue
        items = [it for it in plan.items[:limit] if not is_url(it.paths[fname])]
        shapes = [recipe.decoder_for(fname, it.options.get(fname)).declared_shape(it.paths[fname]) for it in items]
        why = reason
        if frames is not None and frames.field == fname:   # held after its per-frame steps: their output's size
            why = f"{reason} after {frames.names()} (run on each frame as it is decoded)"
            memo: dict[tuple[int, int, int], tuple[int, ...]] = {}
            shapes = [_after_frame_steps(frames, s, memo) for s in shapes]
        known = [s for s in shapes if s is not None]
        if not known:
            out.append(f"{fname}: {why}, memory unknown (no container header of {len(items)} probed "
                       f"input(s) declares a frame count)")
            continue
        t, h, w, c = max(known, key=lambda s: s[0] * s[1] * s[2] * s[3])
        unknown = f"; {len(shapes) - len(known)} declare no frame count" if len(known) < len(shapes) else ""
        out.append(f"{fname}: {why}, up to {t} x {h} x {w} x {c} = {t * h * w * c:,} bytes per video "
                   f"(largest header of {len(items)} input(s){unknown})")
    return out


def _after_frame_steps(frames: Any, shape: Optional[tuple[int, int, int, int]],
                       memo: dict[tuple[int, int, int], tuple[int, ...]]) -> Optional[tuple[int, int, int, int]]:
    """A declared (T, H, W, C) after ``frames``' per-frame steps (run on one black frame of that size,
    once per size: ``memo``); the declared shape when they fail on it (the build reports that input)."""
    if shape is None:
        return None
    t, h, w, c = shape
    if (h, w, c) not in memo:
        from ..errors import InputError

        try:
            memo[h, w, c] = frames.apply(np.zeros((h, w, c), np.uint8)).shape
        except InputError:
            memo[h, w, c] = (h, w, c)
    return (t, *memo[h, w, c])
