"""Inputs: what a recipe's ``inputs:`` names, turned into the plan's items.

One small interface, :func:`read_inputs`: a recipe in, an :class:`~.items.Inputs` out (the column table of
items in key order, the label names in id order, the factors of what ``split:`` reads, and the fields and
index attributes the input adds). One module per input kind behind it:

- :mod:`.listing` — a folder: ``inputs.root`` walked (or a store's listing) and matched against ``inputs.match``;
- :mod:`.table` — a table: one sample per row of CSV, TSV, JSON Lines or Parquet files (``inputs.table``);
- :mod:`.coco` — a COCO annotation file: one sample per image, with its boxes, labels, keypoints and mask.

Shared by the kinds and below them: :mod:`.items` (the item types: :class:`~.items.ItemTable`,
:class:`~.items.Item`, :class:`~.items.Inputs`), :mod:`.templates` (``{name}`` captures), :mod:`.paths` (the
path rule: the lexical checks at plan time, :class:`~.paths.InputRoot` in the shard task) and
:mod:`.splits` (which split each input goes to). A new kind (LibriSpeech transcripts, say) is a new module
here and one branch in :func:`read_inputs`.

This room sits below the recipe and the plan: it reads a recipe's attributes (``model.inputs``,
``input_root``, ``source``, ...) but imports neither; the recipe checks its ``inputs:`` with the rules here
(table extensions, templates, the COCO captures), and the plan consumes :class:`~.items.Inputs`.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from .items import Inputs


def read_inputs(recipe: Any, listing: Optional[Iterable[Any]] = None, coco_cache: Optional[str] = None,
                content_hash: bool = False) -> Inputs:
    """The recipe's inputs as the plan's items: a COCO file's images, a table's rows, or the files ``match``
    finds under ``inputs.root`` (``listing``: :class:`~.listing.Listed` batches to match in place of walking
    the root). ``coco_cache``: where the output keeps a parsed COCO file (:mod:`.coco.cache`; the result's
    ``pending`` is then the parse to write there, if it was not read from there), fingerprinted by content
    with ``content_hash``. Each kind is imported when a recipe uses it."""
    inp = recipe.model.inputs
    if inp.coco is not None:
        from .coco import load_coco

        return load_coco(recipe, coco_cache, content_hash)
    if inp.table is not None:
        from .table.columns import table_items

        return table_items(recipe)
    from .listing import read_folder

    return read_folder(recipe, listing)


__all__ = ["Inputs", "read_inputs"]
