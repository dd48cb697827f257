"""Tools over built outputs: inspect (and later verify)."""
