"""The store interface: a snapshot directory (``dirpath``) on some storage, as files.

:class:`Store` is I/O and nothing else: the children of ``dirpath`` (listed, deleted), the files
of a child (written durably, read whole or by ranges, sized), the start of a write (its writer
marker), the commit of a snapshot by the store's commit strategy (:mod:`.commit`), and the dirpath
lock (:class:`DirLock`: an ``fcntl`` lock locally, a lease object on S3). Which children are
snapshots, whether one is complete, intact, or the plugin's own, is read above the store
(``format.listing``, ``format.verify``).

Who calls what: the saver's thread calls ``begin`` and ``commit`` (rank 0 only for ``commit``),
the writer's I/O threads call ``write_payload`` (thread-safe across files), restore calls
``read_into``; retention and the CLI delete through ``format.listing.remove``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.stores.commit import AtomicRename, CommitProtocol, MetadataBytes

#: Written first into every write (staging directory, or the final name on object stores): who
#: writes it ({"host", "pid", "run_id", "started_at"}). Proves the directory is the plugin's.
WRITER_FNAME = ".tnt_writer.json"
#: The plugin's index of a snapshot (``format.index``), written by its commit just before the
#: metadata. Proves the directory is the plugin's too.
INDEX_FNAME = ".tnt_snapshot_index.json"
#: The files whose presence proves a child of dirpath is the plugin's: deleted last.
PROOF_FNAMES = (INDEX_FNAME, WRITER_FNAME)
#: The lock file (local disk) and lease object (S3) of a dirpath's live saver.
LOCK_FNAME = ".tnt_snapshot.lock"
LEASE_FNAME = ".tnt_snapshot.lease.json"

Buffer = Union[bytes, bytearray, memoryview]
#: One read of :meth:`Store.read_into`: (file relative to the snapshot, offset, destination): the
#: destination is a flat writable byte buffer with ``nbytes`` (a memoryview, or a ``uint8`` numpy
#: array over a tensor: ``format.torchsnapshot.common.flat_bytes``).
Read = tuple[str, int, Any]
#: ``done(indices)``: the reads of those indices are filled (see :meth:`Store.read_into`)
Done = Callable[[list[int]], None]


def escapes(rel: str) -> bool:
    """Whether the relative file path ``rel`` (as a manifest or writer names it) is empty, absolute,
    holds a NUL byte, or has an empty, ``.`` or ``..`` component: such a path is never read or
    written."""
    return not rel or rel.startswith("/") or "\x00" in rel or any(p in ("", ".", "..") for p in rel.split("/"))


def check_child_name(url: str, name: str) -> None:
    """Refuse a child name that is not one plain directory name."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise SnapshotError(f"{name!r} is not a snapshot directory name in {url}")


def check_deletable_name(url: str, name: str) -> None:
    """Refuse to delete a child that is not one plain snapshot or staging directory name."""
    if (
        not name
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or (SnapshotName.parse(name) is None and not is_staging_name(name))
    ):
        raise SnapshotError(
            f"refusing to delete {name!r} in {url}: it is not a snapshot or staging directory "
            "name this plugin writes"
        )


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


class Store:
    """A snapshot directory (``dirpath``) on some storage."""

    url: str
    #: The commit strategy (:mod:`.commit`: :class:`AtomicRename` or :class:`MetadataWrittenLast`).
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

    def read_ahead(self, name: str, files: Sequence[tuple[str, Optional[int]]]) -> None:
        """A hint: files of child ``name`` (``(rel, size)`` each, size None: the whole file) are
        read soon, in that order. A store that can fetch ahead without holding the caller
        starts now (local disk: the kernel reads the first of them into the page cache while
        restore checks the metadata and plans its reads); by default nothing happens. Never
        raises: a file that is missing or outside the snapshot is left to the read itself."""

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

    def delete(self, name: str, *, unpublish: Sequence[str] = ()) -> None:
        """Delete child ``name`` and everything in it: only a name this plugin writes (a snapshot or
        staging directory name), only inside ``dirpath``, never following a symlink; the files of
        ``unpublish`` (the formats' metadata files) first, the proofs that the child is the
        plugin's (:data:`PROOF_FNAMES`) last, so a crash part-way leaves an incomplete child that
        is still provably the plugin's. Whether the child is the plugin's to delete is decided
        above the store (``format.listing.remove``)."""
        check_deletable_name(self.url, name)
        self._delete(name, tuple(unpublish))

    def _delete(self, name: str, unpublish: tuple[str, ...]) -> None:
        raise NotImplementedError

    def bare_staging_writer(self, name: str) -> Optional[dict[str, Any]]:
        """For a staging directory holding nothing but (perhaps) a writer marker still being
        written - a writer killed between creating it and its marker - the writer its name
        names; else None. Such a directory holds nothing anyone could lose."""
        return None

    def holds_proof(self, name: str) -> bool:
        """Whether child ``name`` holds one of the files that prove it the plugin's (its index or
        its writer marker; :data:`PROOF_FNAMES`)."""
        return any(self.has_file(name, proof) for proof in PROOF_FNAMES)

    def commit(
        self, staging: str, final: str, *, metadata_file: str, metadata: MetadataBytes, index_file: str,
        index: bytes, written: dict[str, int],
    ) -> None:
        """Make snapshot ``final`` complete by the store's strategy (:attr:`protocol`): check that
        every file of ``written`` (rel -> size) is there with its size, write ``index`` as
        ``index_file``, then ``metadata`` as ``metadata_file`` last (and, staged, rename the
        staging directory into place). A snapshot of the plugin's already named ``final``
        (another run's) is replaced."""
        self.protocol.commit(
            self, staging, final, metadata_file=metadata_file, metadata=metadata, index_file=index_file,
            index=index, written=written,
        )

    def staging_for(self, final: str, token: str) -> str:
        """Where to write snapshot ``final`` before its commit (``token``: the writer's, alnum)."""
        return self.protocol.staging_for(final, token)

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
