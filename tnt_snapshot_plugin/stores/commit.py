"""How a snapshot in a store becomes complete: one small class per strategy, chosen by each store
(``Store.protocol``).

* :class:`AtomicRename` (local disk): written under a staging name, renamed into place.
* :class:`MetadataWrittenLast` (object stores): written under the final name, published by the
  format's metadata file written last.

Both write the plugin's index before the metadata, so a snapshot is complete exactly when its
metadata file is there, and a crash before the commit leaves nothing restore would pick. Called
on the thread that commits (rank 0's writer thread); the payloads are already durable when
``commit`` runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence, Union

from tnt_snapshot_plugin.errors import SnapshotWriteError

if TYPE_CHECKING:
    from tnt_snapshot_plugin.stores.base import Store

Buffer = Union[bytes, bytearray, memoryview]
#: The metadata at a commit: its bytes, or buffers to write one after another.
MetadataBytes = Union[bytes, bytearray, Sequence[Buffer]]


def buffers(metadata: MetadataBytes) -> list[Buffer]:
    """``metadata`` as buffers to write one after another."""
    return [metadata] if isinstance(metadata, (bytes, bytearray, memoryview)) else list(metadata)


class CommitProtocol:
    """How a snapshot is staged and made complete. Called on the thread that commits (rank 0's
    saver thread); the payloads are already durable (``write_payload``) when ``commit`` runs."""

    #: Whether a snapshot is staged under another name and renamed into place on commit.
    renames: bool

    def staging_for(self, final: str, token: str) -> str:
        """Where to write snapshot ``final`` before its commit (``token``: the writer's, alnum)."""
        raise NotImplementedError

    def commit(
        self, store: Store, staging: str, final: str, *, metadata_file: str, metadata: MetadataBytes,
        index_file: str, index: bytes, written: dict[str, int],
    ) -> None:
        """Make ``final`` complete: index, then metadata last (and the rename, where staged)."""
        raise NotImplementedError


class AtomicRename(CommitProtocol):
    """Local disk: a snapshot is written in a staging directory named after its writer
    (``naming.staging_name``), then its index and metadata, then the directory is made durable and
    renamed to its final name (:meth:`Store.publish`). A crash before the rename leaves a staging
    directory, which restore never picks and the next run removes once its writer is gone."""

    renames = True

    def staging_for(self, final: str, token: str) -> str:
        from tnt_snapshot_plugin.naming import staging_name

        return staging_name(final, token)

    def commit(
        self, store: Store, staging: str, final: str, *, metadata_file: str, metadata: MetadataBytes,
        index_file: str, index: bytes, written: dict[str, int],
    ) -> None:
        # Every file written must still be there: a directory removed during the write (and
        # recreated by a later file's write) would otherwise commit a snapshot with holes.
        for rel, size in written.items():
            actual = store.file_size(staging, rel)
            if actual != size:
                raise SnapshotWriteError(
                    f"{os.path.join(store.child(staging), rel)} has {actual} bytes, {size} were "
                    "written (was dirpath removed or changed during the save?); the snapshot was "
                    "not committed"
                )
        store.write_payload(staging, index_file, [index])
        store.write_payload(staging, metadata_file, buffers(metadata))
        store.publish(staging, final)


class MetadataWrittenLast(CommitProtocol):
    """Object stores (no atomic rename): a snapshot is written under its final name and published
    by its format's metadata file, written after everything else. A crash before that leaves an
    incomplete snapshot-named directory, which restore ignores and the next run removes."""

    renames = False

    def staging_for(self, final: str, token: str) -> str:
        # A leftover of the plugin's under the same name is removed before the write begins.
        return final

    def commit(
        self, store: Store, staging: str, final: str, *, metadata_file: str, metadata: MetadataBytes,
        index_file: str, index: bytes, written: dict[str, int],
    ) -> None:
        if staging != final:
            raise SnapshotWriteError(
                f"{store.child(staging)}: an object store writes a snapshot under its final name "
                f"({final}); the snapshot was not committed"
            )
        store.write_payload(final, index_file, [index])
        store.write_payload(final, metadata_file, buffers(metadata))
