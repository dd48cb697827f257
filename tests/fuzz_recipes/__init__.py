"""A pixel-truth recipe fuzzer (issue 32): random recipes over inputs that carry their own truth.

Modules:

- :mod:`.truth`: inputs whose bytes encode what a correct build must store: 2D scenes (objects painted as
  polygons in unique colours, an instance-id mask and a keypoint-marker mask painted from the same raster,
  the COCO file written from the same polygons), flow pairs from a known warp, videos whose frames show their
  own index and whose audio samples hold their own time, audio ramps, NIfTI and DICOM volumes whose voxels
  hold their own coordinates, tables whose cells name their file and row;
- :mod:`.draw`: a case (inputs + recipe + Loader options) drawn from one integer seed, and
  :data:`.draw.COVERAGE`, the table of how every step, kind, decoder option, output format and Loader device
  step is drawn (``tests/test_recipe_fuzzer.py`` holds it against the registries and the docs);
- :mod:`.reference`: the docs' rules re-implemented independently (EXIF orientations, each step's coordinate
  map and output size, box visibility, clip frame indices, window starts ...);
- :mod:`.oracles`: the checks on a built output; each failure names its oracle;
- :mod:`.known`: defects being fixed elsewhere: a narrow predicate per defect id, excusing only the
  failures of its oracles on the cases it matches;
- :mod:`.runner`: build a case (in-process, ``-j1``; some also ``-j2``), run the oracles, minimise a failing
  recipe, and the explore mode (``python tests/fuzz_recipes/runner.py --explore N``).
"""
