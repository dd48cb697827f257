"""Storage: where precompile talks to a file system or a store, and nothing else.

- :mod:`.remote` — fsspec URLs: which paths are URLs, a filesystem per URL (the extra to install named),
  listings and globs with fingerprints, a local copy of a remote input, the store's refusals as errors;
- :mod:`.files` — local files: sha256, fsync, the JSON a build writes (atomically), sizes in words;
- :mod:`.owned` — temporary folders owned by a running process (an ``flock``), removed by the next one when
  their process died: a URL build's staging folder, the fetched copies of remote inputs;
- :mod:`.faults` — a local folder's faults (out of space, read-only, vanished) told as they are;
- :mod:`.folder_lock` and :mod:`.url_lock` — the build lock of a local folder (``flock``) and of a URL (an object
  created with a conditional PUT);
- :mod:`.objects` — the objects under a URL prefix (listing, copies, JSON objects, puts, removals, a staging
  folder) and the store's errors as :class:`~precompile.errors.OutputError`; :mod:`.upload` puts files there;
- :mod:`.shard_cache` — the node's verified, size-bounded cache of files read from a URL (its downloads:
  :mod:`.cache_fetch`, its room: :mod:`.cache_room`, its locks between processes: :mod:`.cache_node`);
  :mod:`.remote_source` — a build read from a URL: its index fetched, its shards through that cache.

The compiler, the formats, the reader and the tools call this package; it calls none of them (and knows no file
format: a caller names the files and hands over the bytes). tests/test_import_graph.py keeps it so.
"""
