"""Tables as inputs: one sample per row of a CSV, TSV, JSON Lines or Parquet file (``inputs.table``).

The table may be a local file, a URL (streamed from the store through its fsspec filesystem, with
``inputs.storage_options``), a glob of either, or a list of such (:func:`table_files`): the rows of every
file, in sorted file order, each row's messages naming its own file and data row.

The table is read with pyarrow (the ``tables`` extra), imported only
when a recipe has a table, and only the columns the recipe names. CSV and TSV cells are read as text (``"00012"``
stays ``"00012"``; numbers are parsed where a field needs them); JSON Lines and
Parquet keep their own types.

Rows are numbered from 1 in messages: *data row* n is the n-th row after the
header (a CSV's line n + 1, a JSON Lines file's line n, a Parquet file's row
n - 1 counted from 0).

``inputs.where`` (an expression over the columns, :mod:`.where`) leaves rows out first: every rule below
sees the kept rows alone (label ids, keys, splits), while messages still name each row's data row in its file.

Per row:

- the input path: ``inputs.path`` (a template over the row's columns, ``{col}``
  or ``{col:06d}`` with a Python format spec) under ``inputs.root``; a field's
  own ``path:`` is a template over the same columns;
- the key: the ``inputs.key`` column's value, or else the row's path;
- column fields (``inputs.columns``): ``label`` (class name -> id),
  ``target`` (float32, a blank cell is NaN, ``map:`` turns values such as -1
  into numbers or NaN), ``text`` (UTF-8; a blank cell is the empty string);
- decoder options given as ``{column: NAME}``: the row's value, checked by the
  decoder's own option model.

Every problem the table itself has (a missing file, an unknown column, a
duplicate key, a cell that is not a number) is a :class:`RecipeError` naming
the table file, the data row and the column, before anything is decoded. A row
whose *input file* is missing is not: it fails at decode like any missing input
(the build report names it; ``on_error`` applies).

Inside, in layers that each import only those below them:

- :mod:`.read` — one file's bytes as a pyarrow Table that holds what Python's ``csv`` and ``json`` modules
  read, or the row at fault named (:class:`~.read.TableError`);
- :mod:`.files` — which files ``inputs.table`` names (:func:`~.files.table_files`), and one of them read
  from a path or a URL (:func:`~.files.read_table`);
- :mod:`.where` — ``inputs.where``: its parser (the recipe checks the expression with it) and its
  evaluation over the columns with pyarrow.compute;
- :mod:`.cells` — the rules for one cell and one row (templates, numbers, blank cells, the row's paths and
  decoder options, the column fields' specs);
- :mod:`.columns` — every row at once, a column at a time, into the plan's
  :class:`~precompile.inputs.items.ItemTable` (:func:`~.columns.table_items`), the per-row rules naming the
  first row at fault.

Splits, which a table's columns may drive, are every input kind's: :mod:`precompile.inputs.splits`.

Nothing is imported here: the plan, the shard task and the recipe import the layer they need, so a recipe
without a table loads none of it.
"""
