"""What a snapshot directory holds, listed for the tests to assert on: a local dirpath by the
names in it, any dirpath in commit order (the keys under an ``s3://`` URL: tests/moto_s3.py).
Named dir_listing so that it never shadows ``tnt_snapshot_plugin.format.listing`` in a test.

Each helper says its order in its name: ``_by_name`` (strings, as ``sorted`` orders them),
``_by_step`` (oldest first by epoch, step and eval step, as SnapshotName orders snapshot names)
or ``_in_commit_order`` (oldest first as committed, which only the plugin's index records: the
order restore and retention read). A test that means "as written" asks for commit order; one that
means "which ones are there" asks for name or step order.

Imports no framework: the pure-core tests, which tests/test_core.py also runs with torchtnt and
Lightning hidden, use it too.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from tnt_snapshot_plugin import hookimpl
from tnt_snapshot_plugin.format import listing as format_listing
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.naming import STAGING_PREFIX, SnapshotName
from tnt_snapshot_plugin.stores import open_store


def everything_by_name(dirpath: Any) -> list[str]:
    """Every entry of ``dirpath``: snapshots, the lock, staging directories, anything else."""
    return sorted(os.listdir(dirpath))


def visible_by_name(dirpath: Any) -> list[str]:
    """The entries of ``dirpath`` whose names do not start with ".": snapshots, complete or not,
    and whatever else is there; [] when ``dirpath`` does not exist."""
    if not os.path.isdir(dirpath):
        return []
    return sorted(n for n in os.listdir(dirpath) if not n.startswith("."))


def snapshots_by_step(dirpath: Any) -> list[str]:
    """The entries of ``dirpath`` named as snapshots (the plugin's names and torchtnt's),
    complete or not."""
    parsed = (SnapshotName.parse(n) for n in os.listdir(dirpath))
    return [name.text for name in sorted(n for n in parsed if n is not None)]


def complete_by_step(dirpath: Any) -> list[str]:
    """The snapshots in ``dirpath`` that hold their format's metadata file (torchsnapshot's
    ``.snapshot_metadata``, or another registered format's)."""
    return [
        n for n in snapshots_by_step(dirpath)
        if any(os.path.isfile(os.path.join(dirpath, n, meta)) for meta in metadata_files())
    ]


def complete_in_commit_order(dirpath: Any, storage_options: Optional[dict[str, Any]] = None) -> list[str]:
    """The complete snapshots in ``dirpath`` (a local path, or a URL with its ``storage_options``)
    as the plugin orders them for restore and retention."""
    return [name.text for name in format_listing.complete_snapshots(open_store(str(dirpath), storage_options))]


def staging_by_name(dirpath: Any) -> list[str]:
    """The entries of ``dirpath`` named with the staging prefix: snapshots being written, or left
    by a crash (and anything else that looks like one, so that an assertion that there are none
    misses nothing)."""
    return [n for n in everything_by_name(dirpath) if n.startswith(STAGING_PREFIX)]


class CommitRecorder:
    """A plugin that lists ``dirpath`` by name after each commit (retention has run):
    ``seen`` holds (the committed snapshot's name, the visible entries then)."""

    def __init__(self, dirpath: Any) -> None:
        self.dirpath = dirpath
        self.seen: list[tuple[str, list[str]]] = []

    @hookimpl
    def tnt_snapshot_plugin_snapshot_committed(self, path: str) -> None:
        self.seen.append((os.path.basename(path), visible_by_name(self.dirpath)))
