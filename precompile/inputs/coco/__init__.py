"""A COCO annotation file as an input (``inputs.coco``)."""
