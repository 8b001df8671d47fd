"""How a restore reaches one snapshot's files: the reads, file sizes and checksums of its index,
its metadata (checked), and whether the path names a complete snapshot at all."""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple, Optional

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import SnapshotNotFoundError
from tnt_snapshot_plugin.format import holdings
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.stores import INDEX_FNAME, LocalStore, Store


class ReadingIO(NamedTuple):
    """How the reader reaches one snapshot's files (:func:`reading_io`)."""

    read_into: Any
    file_size: Any
    verifier: Any
    #: the plugin's parsed index, or None (a snapshot torchtnt or torchsnapshot wrote)
    snapshot_index: Optional[dict[str, Any]]


def reading_io(
    store: Store, name: str, path: str, concurrency: Optional[int] = None, *, checked: Any = None
) -> ReadingIO:
    """How the reader reaches snapshot ``name``'s files: ``read_into`` reads up to
    ``concurrency`` files at once (None: the store's default).

    File sizes come from the plugin's index where it has one (one read), else from the store
    (snapshots torchtnt or torchsnapshot wrote); the verifier holds the index's checksums (None
    for a snapshot without them). ``checked``: an intact ``verify.Verdict`` on the snapshot,
    whose index is used instead of reading it again."""
    from tnt_snapshot_plugin.format import index as index_file
    from tnt_snapshot_plugin.format.checksums import Verifier

    parsed: Any = None
    if checked is not None:
        parsed = checked.index
    else:
        try:
            index: Optional[bytes] = store.read_file(name, INDEX_FNAME)
        except FileNotFoundError:
            index = None
        if index is not None:
            parsed = index_file.parse(index, path)
    parts = None
    if index_file.parts_of(parsed) is not None:  # several ranks': each part read as its files are
        parts = index_file.Parts(parsed, functools.partial(store.read_optional, name), path)
    listed = parsed.get("files") if isinstance(parsed, dict) else None
    sizes: dict[str, Any] = parts.files if parts is not None else listed if isinstance(listed, dict) else {}
    records = parsed.get("checksums") if isinstance(parsed, dict) else None
    verifier = Verifier(path, records, sizes) if isinstance(records, dict) and records else None

    def with_parts(rels: Any) -> None:
        assert parts is not None
        for files, checksums in parts.load_for(rels):
            if verifier is not None:
                verifier.add(checksums, files)

    def file_size(rel: str) -> Optional[int]:
        if parts is not None:
            with_parts((rel,))
        size = sizes.get(rel)
        return size if isinstance(size, int) else store.file_size(name, rel)

    reading = functools.partial(store.read_into, name, concurrency=concurrency)

    def read_into(reads: Any, *args: Any, **kwargs: Any) -> None:
        with_parts({read[0] for read in reads})
        reading(reads, *args, **kwargs)

    return ReadingIO(
        reading if parts is None else read_into, file_size, verifier, parsed if isinstance(parsed, dict) else None
    )


def metadata_range(store: Store, name: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of snapshot ``name``'s metadata (one ranked group of it)."""
    buf = memoryview(bytearray(end - start))
    store.read_into(name, [(METADATA_FNAME, start, buf)])
    return bytes(buf)


def read_metadata(store: Store, name: str, verifier: Any) -> bytes:
    """Snapshot ``name``'s metadata, checked against its checksum where the index has one
    (``verifier``, from :func:`reading_io`): it holds the primitive values (numbers, strings)
    themselves. SnapshotCorruptError on a mismatch."""
    data = store.read_file(name, METADATA_FNAME)
    if verifier is not None:
        verifier.check(METADATA_FNAME, 0, data)
    return data


def not_a_directory(store: Store) -> Optional[str]:
    """What is wrong with a local ``dirpath`` that exists but is no directory, else None."""
    if isinstance(store, LocalStore) and os.path.lexists(store.root) and not os.path.isdir(store.root):
        return "is a file, not a directory of snapshots"
    return None


def require_complete(store: Store, name: str, path: str, coll: Collectives) -> None:
    def check() -> Optional[str]:
        if store.is_complete(name):
            return None
        if name in store.list_names():
            inner = store.nested(name).complete_snapshots()
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
        return f"snapshot {path} does not exist; {holdings.describe(store)}"

    problem = coll.on_rank0(check)
    if problem is not None:
        raise SnapshotNotFoundError(problem)
