"""Follow-ups of the outside review of object storage (tests/test_storage_outside.py): what a verify of a URL
could not check, a cached copy found damaged while another reader holds it, folder inputs whose fetched files
must be the fingerprinted ones, a fetched object that changed since the listing, and HTTP 5xx retries. Every
object is tiny and lives in fsspec's ``memory://`` store or on a loopback HTTP server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_storage_outside import set_entries, tiny_build, upload  # noqa: E402

from precompile.tools.verify_url import verify_url  # noqa: E402


# -- 5. verify of a URL says what it could not check ----------------------------------------------------------
def test_verify_of_a_url_reports_a_shard_entry_without_a_sha256_as_not_checked(tmp_path):
    """An entry without ``sha256`` (or ``bytes``) cannot be checked object by object: verify says so, by name,
    and the build is not reported intact (readers of the URL refuse such an entry too)."""
    index = tiny_build(tmp_path)

    files = []

    def change(shards):
        files.extend(e["file"] for e in shards)
        del shards[0]["sha256"]
        del shards[1]["bytes"]
    set_entries(index, change)
    url = upload(index.parent)
    res = verify_url(f"{url}/t.h5")
    assert not res.ok
    assert res.problems == [
        f"index: shard entry 0 ({files[0]}) records no sha256: its object's bytes could not be checked "
        "(readers of the URL refuse the entry too): build to this URL again",
        f"index: shard entry 1 ({files[1]}) records no size (bytes): its object's size could not be checked "
        "(readers of the URL refuse the entry too): build to this URL again"], res.problems
    assert res.index_damaged and not res.bad_shards
    shard1 = (index.parent / files[1]).stat().st_size
    assert res.bytes_checked == shard1   # entry 1's sha256 is there: its object is still hashed
    quick = verify_url(f"{url}/t.h5", checksums=False)   # --quick asks no sha256: only the size is missing
    assert [p.split(")")[0] for p in quick.problems] == [f"index: shard entry 1 ({files[1]}"], quick.problems
