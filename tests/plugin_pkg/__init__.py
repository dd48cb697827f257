"""A user plugin package for the tests: a custom decoder and a custom step, registered on import
(``imports: [plugin_pkg.steps]`` in a recipe, as a user's own package would be)."""
__version__ = "1.0"
