"""A table as an input (``inputs.table``)."""
