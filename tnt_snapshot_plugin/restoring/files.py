"""Whether a path a restore is given names a complete snapshot at all (and if not, what it names),
and whether a dirpath is a directory. How a restore reads a snapshot's files:
``format.files.SnapshotFiles``."""

from __future__ import annotations

import os
from typing import Optional

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import SnapshotNotFoundError
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.stores import LocalStore, Store


def not_a_directory(store: Store) -> Optional[str]:
    """What is wrong with a local ``dirpath`` that exists but is no directory, else None."""
    if isinstance(store, LocalStore) and os.path.lexists(store.root) and not os.path.isdir(store.root):
        return "is a file, not a directory of snapshots"
    return None


def require_complete(store: Store, name: str, path: str, coll: Collectives) -> None:
    def check() -> Optional[str]:
        if listing.is_complete(store, name):
            return None
        if name in store.list_names():
            inner = listing.complete_snapshots(store.nested(name))
            if inner:
                return (
                    f"{path} is a directory of snapshots, not a snapshot; pass one of them (the "
                    f"newest is {store.child(name)}/{inner[-1].text}) or use restore_from_latest"
                )
            if SnapshotName.parse(name) is None:
                return (
                    f"{path} is not a snapshot: it holds no .snapshot_metadata and is not named "
                    "epoch_E_step_S; pass a snapshot directory written by the saver"
                )
            return (
                f"{path} is not a complete snapshot (it has no .snapshot_metadata: an interrupted "
                "write?); pass a committed snapshot directory"
            )
        if isinstance(store, LocalStore) and os.path.islink(os.path.join(store.root, name)):
            return (
                f"{path} is a symlink; snapshots are never read through symlinks: pass the "
                f"snapshot directory itself ({os.path.realpath(os.path.join(store.root, name))})"
            )
        if isinstance(store, LocalStore) and os.path.lexists(os.path.join(store.root, name)):
            return f"{path} is a file, not a snapshot directory; pass a directory written by the saver"
        return f"snapshot {path} does not exist; {listing.describe(store)}"

    problem = coll.on_rank0(check)
    if problem is not None:
        raise SnapshotNotFoundError(problem)
