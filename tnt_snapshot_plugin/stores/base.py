"""The store interface: a snapshot directory (``dirpath``) on some storage, and how a snapshot in
it becomes complete.

* :class:`Store` works on ``dirpath``: it lists the snapshot names in it (in commit order, see
  retention.py), tells whether one is complete, writes and reads its files
  (:meth:`Store.write_payload`, :meth:`Store.read_into`), commits one, and deletes one. Deletion
  only ever removes a child of ``dirpath`` whose name this plugin writes *and* that provably holds
  what the plugin wrote (its index, or its writer marker ``.tnt_writer.json``), never follows a
  symlink, and never touches anything else.
* The commit protocol, one small class per strategy, chosen by each store (``Store.protocol``):
  :class:`AtomicRename` (local disk: written under a staging name, renamed into place) and
  :class:`MetadataWrittenLast` (object stores: written under the final name, published by
  ``.snapshot_metadata`` written last). Both write the index before the metadata, so a snapshot
  is complete exactly when ``.snapshot_metadata`` is there, and a crash before the commit leaves
  nothing restore would pick.
* :class:`DirLock`: the live saver's hold on ``dirpath`` for its run (the stores' subclasses:
  an ``fcntl`` lock locally, a lease object on S3), so a second job on the same ``dirpath`` is
  refused instead of mixing runs.

Who calls what: the saver's thread calls ``staging_for``, ``begin`` and ``commit`` (rank 0 only
for ``commit``), the writer's I/O threads call ``write_payload`` (thread-safe across files),
restore calls ``read_into``; retention and the CLI call ``listed``/``remove``/``verify``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Sequence, Union

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError, SnapshotWriteError
from tnt_snapshot_plugin.format.index import INDEX_FNAME, part_rel, parts_of
from tnt_snapshot_plugin.format.index import complete as complete_index
from tnt_snapshot_plugin.format.index import parse as parse_index
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.policies.retention import Listed, commit_order, from_index
from tnt_snapshot_plugin.stores.ownership import staged_by_this_process

#: torchsnapshot's commit marker: the manifest, written last.
METADATA_FNAME = ".snapshot_metadata"
#: Written first into every write (staging directory, or the final name on object stores): who
#: writes it ({"host", "pid", "run_id", "started_at"}). Proves the directory is the plugin's.
WRITER_FNAME = ".tnt_writer.json"
#: The lock file (local disk) and lease object (S3) of a dirpath's live saver.
LOCK_FNAME = ".tnt_snapshot.lock"
LEASE_FNAME = ".tnt_snapshot.lease.json"

Buffer = Union[bytes, bytearray, memoryview]
#: ``.snapshot_metadata`` at a commit: its bytes, or buffers to write one after another.
MetadataBytes = Union[bytes, bytearray, Sequence[Buffer]]


def buffers(metadata: MetadataBytes) -> list[Buffer]:
    """``metadata`` as buffers to write one after another."""
    return [metadata] if isinstance(metadata, (bytes, bytearray, memoryview)) else list(metadata)
#: One read of :meth:`Store.read_into`: (file relative to the snapshot, offset, destination): the
#: destination is a flat writable byte buffer with ``nbytes`` (a memoryview, or a ``uint8`` numpy
#: array over a tensor: ``format.common.flat_bytes``).
Read = tuple[str, int, Any]
#: ``done(indices)``: the reads of those indices are filled (see :meth:`Store.read_into`)
Done = Callable[[list[int]], None]


def escapes(rel: str) -> bool:
    """Whether the relative file path ``rel`` (as a manifest or writer names it) is empty, absolute,
    or has an empty, ``.`` or ``..`` component: such a path is never read or written."""
    return not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/"))


def check_child_name(url: str, name: str) -> None:
    """Refuse a child name that is not one plain directory name."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise SnapshotError(f"{name!r} is not a snapshot directory name in {url}")


class DirLock:
    """The live saver's hold on a dirpath for its run; :meth:`release` lets go (idempotent)."""

    def check(self) -> None:
        """Raise SnapshotWriteError, saying what happened, if this run no longer holds its dirpath
        (its lock file or the dirpath itself was removed or replaced, its lease was taken over).
        A hold once lost stays lost for the rest of the run: nothing more is committed into that
        dirpath, which another job may hold by then. Cheap (no request to a remote store): the
        saver calls it before each snapshot and at each commit. Nothing to check once released."""

    def release(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# The commit protocol.


class CommitProtocol:
    """How a snapshot is staged and made complete. Called on the thread that commits (rank 0's
    saver thread); the payloads are already durable (``write_payload``) when ``commit`` runs."""

    #: Whether a snapshot is staged under another name and renamed into place on commit.
    renames: bool

    def staging_for(self, final: str, token: str) -> str:
        """Where to write snapshot ``final`` before its commit (``token``: the writer's, alnum)."""
        raise NotImplementedError

    def commit(self, store: Store, staging: str, final: str, metadata: MetadataBytes, index: bytes) -> None:
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

    def commit(self, store: Store, staging: str, final: str, metadata: MetadataBytes, index: bytes) -> None:
        # Every file written must still be there: a directory removed during the write (and
        # recreated by a later file's write) would otherwise commit a snapshot with holes.
        fields = json.loads(index)
        written = dict(fields["files"])  # and on several ranks the index's parts, each written last
        written.update((part_rel(r), p[0]) for r, p in enumerate(parts_of(fields) or []))
        for rel, size in written.items():
            actual = store.file_size(staging, rel)
            if actual != size:
                raise SnapshotWriteError(
                    f"{os.path.join(store.child(staging), rel)} has {actual} bytes, {size} were "
                    "written (was dirpath removed or changed during the save?); the snapshot was "
                    "not committed"
                )
        store.write_payload(staging, INDEX_FNAME, [index])
        store.write_payload(staging, METADATA_FNAME, buffers(metadata))
        store.publish(staging, final)


class MetadataWrittenLast(CommitProtocol):
    """Object stores (no atomic rename): a snapshot is written under its final name and published
    by ``.snapshot_metadata``, written after everything else. A crash before that leaves an
    incomplete snapshot-named directory, which restore ignores and the next run removes."""

    renames = False

    def staging_for(self, final: str, token: str) -> str:
        # A leftover of the plugin's under the same name is removed before the write begins.
        return final

    def commit(self, store: Store, staging: str, final: str, metadata: MetadataBytes, index: bytes) -> None:
        if staging != final:
            raise SnapshotWriteError(
                f"{store.child(staging)}: an object store writes a snapshot under its final name "
                f"({final}); the snapshot was not committed"
            )
        store.write_payload(final, INDEX_FNAME, [index])
        store.write_payload(final, METADATA_FNAME, buffers(metadata))


# --------------------------------------------------------------------------------------------
# The store.


class Store:
    """A snapshot directory (``dirpath``) on some storage."""

    url: str
    #: The commit strategy (:class:`AtomicRename` or :class:`MetadataWrittenLast`).
    protocol: CommitProtocol = AtomicRename()
    #: Whether :meth:`start_payload` is done with the buffers it was given when it returns (it
    #: wrote them, or a copy of them, somewhere of its own): the writer may then reuse them.
    start_payload_copies = False

    @property
    def atomic_rename(self) -> bool:
        """Whether a snapshot is staged under another name and renamed into place on commit.
        Where not (object stores), it is written under its final name and published by
        ``.snapshot_metadata`` written last, so an interrupted write leaves an incomplete
        snapshot-named directory behind."""
        return self.protocol.renames

    def child(self, name: str) -> str:
        """The user-facing path of child ``name``."""
        raise NotImplementedError

    def nested(self, name: str) -> Store:
        """Child directory ``name`` as a store of its own (same storage, same options)."""
        raise NotImplementedError


    def list_names(self) -> list[str]:
        raise NotImplementedError

    def has_file(self, name: str, rel: str) -> bool:
        raise NotImplementedError

    def read_file(self, name: str, rel: str) -> bytes:
        raise NotImplementedError

    def file_size(self, name: str, rel: str) -> Optional[int]:
        raise NotImplementedError

    def check_writable(self) -> None:
        raise NotImplementedError

    def write_payload(
        self, name: str, rel: str, data: Sequence[Buffer], feed: Optional[Callable[[memoryview], Any]] = None
    ) -> None:
        """Write the concatenation of ``data`` as file ``rel`` of child ``name`` (a staging
        directory, or the final name on object stores), durable when this returns. Parent
        directories are created; thread-safe across different ``rel``. A ``rel`` that escapes
        the snapshot (absolute, ``..``) raises SnapshotWriteError. ``feed``: given every byte
        written, in order (a checksum computed on the way); on local disk piece by piece just
        before each piece is written, while it is in the CPU's cache."""
        raise NotImplementedError

    def start_payload(self, name: str, rel: str, data: Sequence[Buffer]) -> Callable[[], None]:
        """Begin :meth:`write_payload` of file ``rel`` (no ``feed``); returns the step that
        completes it, durable when that returns: call it exactly once, on any thread. A store
        whose writes can begin cheaply (local disk: into the page cache) does that part now, so
        that the writer's I/O threads only wait for the disk; by default every part waits for
        the returned step."""
        return lambda: self.write_payload(name, rel, data)

    def read_into(
        self, name: str, reads: Sequence[Read], done: Optional[Done] = None, concurrency: Optional[int] = None
    ) -> None:
        """Fill each ``dest`` of ``reads`` (``(rel, offset, dest)``, ``dest`` a flat writable byte
        buffer, see ``Read``) with bytes ``[offset, offset + dest.nbytes)`` of file ``rel`` of
        child ``name``. A missing or short file, or a ``rel`` outside the snapshot, raises
        SnapshotCorruptError naming it.

        ``done(indices)``, if given, is called with the indices (in ``reads``) of the ``dest``s
        filled so far, every index once, before this returns; a store that reads in pieces calls
        it as each piece lands (on the thread that read it: calls may come from several threads
        at once, never twice for one index), so the caller can check those bytes while they are
        hot in the CPU caches and the rest is still coming. An exception it raises stops the
        reading and propagates. ``concurrency``: at most this many reads in flight at once (None:
        the store's default; ``max_per_rank_io_concurrency``)."""
        raise NotImplementedError

    def publish(self, staging: str, final: str) -> None:
        """:class:`AtomicRename`'s last step: make child ``staging`` durable and rename it to
        ``final``, replacing a snapshot of the plugin's already named ``final`` (never anything
        else: SnapshotWriteError)."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename; it commits by writing metadata last")

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        """Start a write: the writer marker goes in first, so the write is provably ours."""
        raise NotImplementedError

    def lock(self, holder: dict[str, Any]) -> DirLock:
        """Take this dirpath for one run; ConfigError naming the holder if another saver has it."""
        return DirLock()

    def _remove(self, name: str) -> None:
        raise NotImplementedError

    # -- shared logic ------------------------------------------------------------------------

    def staging_for(self, final: str, token: str) -> str:
        """Where to write snapshot ``final`` before its commit (``token``: the writer's, alnum)."""
        return self.protocol.staging_for(final, token)

    def commit(self, staging: str, final: str, metadata: MetadataBytes, index: bytes) -> None:
        """Make ``final`` complete: index, then metadata last (and the rename, on disk). A
        snapshot of the plugin's already named ``final`` (another run's) is replaced."""
        self.protocol.commit(self, staging, final, metadata, index)

    def _check_rel(self, name: str, rel: str, error: type[SnapshotError]) -> None:
        check_child_name(self.url, name)
        if escapes(rel):
            raise error(
                f"refusing the file {rel!r} of {self.child(name)}: it is not a relative path inside "
                "the snapshot (the manifest is damaged, or a writer bug)"
            )

    def _check_reads(self, name: str, reads: Sequence[Read]) -> None:
        checked: set[str] = set()  # many reads share a file (packed tensors): each file once
        for rel, offset, _dest in reads:
            if rel not in checked:
                self._check_rel(name, rel, SnapshotCorruptError)
                checked.add(rel)
            if offset < 0:
                raise SnapshotCorruptError(f"{self.child(name)}/{rel}: negative offset {offset}")

    def is_complete(self, name: str) -> bool:
        return self.has_file(name, METADATA_FNAME)

    def _read_json(self, name: str, rel: str) -> Optional[dict[str, Any]]:
        """The JSON object in file ``rel`` of child ``name``; None if missing or not one."""
        try:
            value = json.loads(self.read_file(name, rel))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, UnicodeDecodeError,
                RecursionError, SnapshotCorruptError):
            return None
        except Exception as exc:
            # read_file raises the plugin's error (s3_errors), botocore's as its cause
            if is_missing_key(exc) or is_missing_key(exc.__cause__):  # type: ignore[arg-type]
                return None
            raise
        return value if isinstance(value, dict) else None

    def read_index(self, name: str) -> Optional[dict[str, Any]]:
        """The plugin's index of child ``name`` (a JSON object with ``format``), or None."""
        index = self._read_json(name, INDEX_FNAME)
        return index if index is not None and "format" in index else None

    def read_optional(self, name: str, rel: str) -> Optional[bytes]:
        """File ``rel`` of child ``name``, or None where it does not exist."""
        try:
            return self.read_file(name, rel)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except SnapshotCorruptError:  # not a regular file inside the snapshot
            raise
        except Exception as exc:
            if not (is_missing_key(exc) or is_missing_key(exc.__cause__)):  # type: ignore[arg-type]
                raise
            return None

    def checked_index(self, name: str, *, parts: bool = False) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """(the index of snapshot ``name``, checked by ``index.parse``; or None, why it is
        damaged): (None, None) for a snapshot the plugin did not write (no index and no writer
        marker: torchtnt's, torchsnapshot's), (None, reason) for one whose index is missing
        while its writer marker says the plugin wrote it, or that is unreadable or changed.
        ``parts``: with every file and checksum of a snapshot of several ranks (``index.complete``:
        each part read and checked), not only the index itself."""
        try:
            data = self.read_optional(name, INDEX_FNAME)
        except SnapshotCorruptError as exc:  # not a regular file inside the snapshot
            return None, f"its index {INDEX_FNAME} cannot be read ({exc})"
        if data is None:
            if self._read_json(name, WRITER_FNAME) is not None:
                return None, (
                    f"its index {INDEX_FNAME} is missing, though its writer marker says this plugin "
                    "wrote it: its files cannot be checked"
                )
            return None, None
        try:
            index = parse_index(data, self.child(name))
        except SnapshotCorruptError as exc:
            return None, getattr(exc, "reason", str(exc))
        return self.completed_index(name, index) if parts else (index, None)

    def completed_index(self, name: str, index: dict[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """``index`` (of snapshot ``name``, checked) with every part's files and checksums
        (``index.complete``); (None, why) where a part is missing or damaged."""
        try:
            return complete_index(index, lambda rel: self.read_optional(name, rel), self.child(name)), None
        except SnapshotCorruptError as exc:
            return None, getattr(exc, "reason", str(exc))

    def read_writer(self, name: str) -> Optional[dict[str, Any]]:
        """Who wrote child ``name``: its writer marker, else its index's ``writer``; or None."""
        marker = self._read_json(name, WRITER_FNAME)
        if marker is not None and "run_id" in marker:
            return marker
        index = self.read_index(name)
        writer = index.get("writer") if index is not None else None
        return writer if isinstance(writer, dict) else None

    def bare_staging_writer(self, name: str) -> Optional[dict[str, Any]]:
        """For a staging directory holding nothing but (perhaps) a writer marker still being
        written - a writer killed between creating it and its marker - the writer its name
        names; else None. Such a directory holds nothing anyone could lose."""
        return None

    def provably_ours(self, name: str) -> bool:
        """Whether child ``name`` holds the plugin's index or writer marker."""
        return self.read_index(name) is not None or self._read_json(name, WRITER_FNAME) is not None

    def listed(self) -> list[Listed]:
        """Complete snapshots in ``dirpath`` with what their indexes say, in commit order (oldest
        first): one listing, then one read of each index and one existence check each. A
        snapshot whose index is damaged is listed with the reason (``Listed.problem``), in its
        place by (epoch, step)."""
        found = []
        for text in self.list_names():
            parsed = SnapshotName.parse(text)
            if parsed is not None and self.is_complete(text):
                if parsed.phase_aware:
                    found.append(from_index(parsed, None))
                    continue
                index, problem = self.checked_index(text)
                found.append(from_index(parsed, index) if problem is None else Listed(parsed, problem=problem))
        return commit_order(found)

    def complete_snapshots(self) -> list[SnapshotName]:
        """Complete snapshots in ``dirpath``, oldest first in commit order (retention.py)."""
        return [r.name for r in self.listed()]

    def occupant(self, name: str) -> Optional[str]:
        """What holds child ``name``: None (nothing), "ours" (provably the plugin's) or "foreign"."""
        if name not in self.list_names():
            return None
        return "ours" if self.provably_ours(name) else "foreign"

    def remove(self, name: str) -> None:
        """Delete child ``name``: only a name this plugin writes, only inside ``dirpath``, and only
        if it provably holds what the plugin wrote (its index or writer marker)."""
        if (
            not name
            or "/" in name
            or "\\" in name
            or name in (".", "..")
            or (SnapshotName.parse(name) is None and not is_staging_name(name))
        ):
            raise SnapshotError(
                f"refusing to delete {name!r} in {self.url}: it is not a snapshot or staging "
                "directory name this plugin writes"
            )
        if (
            not staged_by_this_process(name)
            and not self.provably_ours(name)
            and self.bare_staging_writer(name) is None
            and name in self.list_names()
        ):
            raise SnapshotError(
                f"refusing to delete {self.child(name)}: it holds neither the plugin's index "
                f"{INDEX_FNAME} nor its writer marker {WRITER_FNAME}, so the plugin did not write it"
            )
        self._remove(name)

    def verify(self, name: str) -> Optional[str]:
        """Why snapshot ``name`` is damaged, or None: ``verify.check``'s verdict without reading
        the payloads (what restore_from_latest asks before it restores a snapshot)."""
        from tnt_snapshot_plugin.format.verify import check

        return check(self, name).problem


def is_missing_key(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) says a file or object does not exist."""
    # S3Store's methods raise the plugin's errors from botocore's (``s3_errors``): look at both
    if isinstance(exc, FileNotFoundError):  # s3_errors maps a missing key to one
        return True
    for error in (exc, exc.__cause__):
        response = getattr(error, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("404", "NoSuchKey", "NotFound"):
            return True
    return False
