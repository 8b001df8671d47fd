"""torchsnapshot's storage plugins of the plugin (``tntfs://``, ``tnts3://``), and what they alone use.

Registered under torchsnapshot's ``storage_plugins`` entry-point group, they carry the bytes of a
snapshot written or restored by torchsnapshot: while a snapshot is written they fsync every file
(``fileio.write_durably``), remember its size and checksum, hold back ``.snapshot_metadata``
(torchsnapshot's commit marker) and record a write error instead of raising it
(:class:`WriteRecorder`, :class:`recording`), so every rank reaches the end of the write and the
ranks can agree whether to commit. The saver then commits through the store (stores/), metadata
last. Also here: :class:`Gathered` (several buffers written as one file with ``writev``) and
:class:`io_concurrency` (a per-thread limit on torchsnapshot's file I/O).

Work-arounds for torchsnapshot-nightly 2024.7.26:

* its S3 plugin ignores ``storage_options`` (no endpoint, no credentials; upstream
  ``# TODO: read AWS tokens from storage_options?``) and ``s3://`` cannot be overridden through the
  entry-point group, so ``s3://`` paths are handed to torchsnapshot as ``tnts3://``, served by
  ``_S3Plugin`` which builds its boto3 client from ``storage_options``;
* its fs plugin never fsyncs, so a "complete" snapshot could be lost by a power cut.

This module goes away when the plugin's own writer and reader replace torchsnapshot's take and
restore. Until then it also re-exports the names other modules and tests import from it (the
stores moved to ``stores/``, the file I/O to ``fileio.py``). Setting ``_write_durably``,
``_write_gathered`` or ``s3_client`` on this module (tests do, with ``monkeypatch.setattr``) sets
it where it is used now too (:class:`_Seams`).
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil  # noqa: F401  (tests patch ``storage.shutil.rmtree``)
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Optional

from . import fileio
from .fileio import fsync_dir, is_inside
from .fileio import map_range as _map_file
from .fileio import read_range as _read_file
from .fileio import relative_inside as _relative_inside
from .fileio import write_durably as _write_durably
from .fileio import write_gathered as _write_gathered
from .stores import open_store, split_snapshot_path
from .stores import s3 as _s3
from .stores.base import (
    INDEX_FNAME,
    LEASE_FNAME,
    LOCK_FNAME,
    METADATA_FNAME,
    WRITER_FNAME,
    DirLock,
    Store,
)
from .stores.base import is_missing_key as _is_missing_key
from .stores.local import FileLock as _FileLock
from .stores.local import LocalStore
from .stores.local import rmtree_proof_last as _rmtree_proof_last
from .stores.s3 import LEASE_S, S3_OPTION_KEYS, S3Store, s3_client, s3_error, s3_errors
from .stores.s3 import S3Lease as _S3Lease
from .stores.s3 import translated as _translated
from .stores.writers import (
    STALE_AFTER_S,
    live_runs,
    new_run_id,
    staging_token,
    writer_gone,
    writer_identity,
)

# --------------------------------------------------------------------------------------------
# The write recorder: how the saver and the torchsnapshot plugins talk during one write.


@dataclass
class WriteRecorder:
    """What one rank's write of one snapshot produced."""

    sizes: dict[str, int] = field(default_factory=dict)
    #: file -> its checksum record (checksums.record), computed from the buffers as written
    checksums: dict[str, dict[str, Any]] = field(default_factory=dict)
    metadata: Optional[bytes] = None
    error: Optional[BaseException] = None
    error_path: Optional[str] = None


_active = threading.local()


class recording:
    """Route the torchsnapshot plugins created on this thread to ``recorder`` while active."""

    def __init__(self, recorder: WriteRecorder) -> None:
        self._recorder = recorder

    def __enter__(self) -> WriteRecorder:
        _active.recorder = self._recorder
        return self._recorder

    def __exit__(self, *exc: object) -> None:
        _active.recorder = None


def _current_recorder() -> Optional[WriteRecorder]:
    return getattr(_active, "recorder", None)


class io_concurrency:
    """Let at most ``limit`` file reads or writes of the torchsnapshot takes and restores run on
    this thread be in flight at once (None: torchsnapshot's default).

    Scoped to the thread, unlike torchsnapshot's own knob (an environment variable, seen by every
    thread of the process): compat.py has torchsnapshot's scheduler ask :func:`current_io_concurrency`
    first, and the file I/O runs on a pool of at least ``limit`` threads.
    """

    def __init__(self, limit: Optional[int]) -> None:
        self._limit = limit
        self._saved: Optional[int] = None

    def __enter__(self) -> None:
        self._saved = getattr(_active, "io_concurrency", None)
        _active.io_concurrency = self._limit

    def __exit__(self, *exc: object) -> None:
        _active.io_concurrency = self._saved


def current_io_concurrency() -> Optional[int]:
    """The limit set by :class:`io_concurrency` on this thread, or None."""
    return getattr(_active, "io_concurrency", None)


class Gathered:
    """Several buffers that make up one file, end to end, *not* copied together: written with
    ``writev`` (compat.py item 10). Only the plugin's own storage plugins receive one."""

    __slots__ = ("views", "nbytes")

    def __init__(self, views: list[memoryview]) -> None:  # contiguous views
        self.views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        self.nbytes = sum(v.nbytes for v in self.views)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        return b"".join(self.views)


def buffer_nbytes(buf: Any) -> int:
    return buf.nbytes if isinstance(buf, Gathered) else memoryview(buf).nbytes


_pools: dict[int, Any] = {}
_pool_pid = -1
_pool_lock = threading.Lock()
_POOL_THREADS = 4


def _io_pool() -> Any:
    """The threads that write and read snapshot files, kept from one snapshot to the next.

    torchsnapshot runs every take and restore on a new event loop, whose default executor would
    start new threads each time (milliseconds each on a busy machine). Four threads, or as many
    as a larger ``io_concurrency`` limit on the calling thread asks for.
    """
    global _pool_pid
    workers = max(_POOL_THREADS, current_io_concurrency() or 0)
    with _pool_lock:
        if _pool_pid != os.getpid():
            _pools.clear()
            _pool_pid = os.getpid()
        pool = _pools.get(workers)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = _pools[workers] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="tnt-snapshot-io"
            )
        return pool


class _Mapped:
    """A read's result for torchsnapshot, which only calls ``getvalue()`` on it: a read-only view
    of the file's pages, so loading a tensor copies from the page cache once, into the tensor,
    instead of into a freshly allocated buffer first (as ``torch.load(mmap=True)`` does; 15-20%
    faster restores in benchmarks/run.py). As with any mapping, a file *truncated* while it is
    being restored would fault; deleting it (retention, rmtree) is harmless, and a file found
    short is reported before it is used (``_check_complete_read``)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def getvalue(self) -> memoryview:
        return self._view


class _RecordingPlugin:
    """Shared write logic of the committing torchsnapshot plugins."""

    def __init__(self) -> None:
        self.recorder = _current_recorder()

    async def _put(self, rel_path: str, buf: Any) -> Optional[dict[str, Any]]:
        """Write ``buf`` to ``rel_path``; its checksum record (``checksums.record``), computed
        on the I/O thread from the buffer in hand."""
        raise NotImplementedError

    _verifier: Any = False  # not loaded yet

    def _load_index(self) -> Optional[bytes]:
        raise NotImplementedError

    def checksum_verifier(self) -> Any:
        """The snapshot's ``checksums.Verifier`` (from its index), None if it records none."""
        if self._verifier is False:
            from .checksums import Verifier

            self._verifier = Verifier.from_index(self._where(), self._load_index())
        return self._verifier

    def _where(self) -> str:
        raise NotImplementedError

    def _verify_read(self, read_io: Any) -> None:
        """Check what ``read`` returned against the snapshot's checksums."""
        verifier = self.checksum_verifier()
        if verifier is not None:
            start = 0 if read_io.byte_range is None else read_io.byte_range[0]
            verifier.check(read_io.path, start, read_io.buf.getvalue())

    async def write(self, write_io: Any) -> None:
        rec = self.recorder
        if rec is None:
            await self._put(write_io.path, write_io.buf)
            return
        if write_io.path == METADATA_FNAME:
            rec.metadata = bytes(write_io.buf)
            return
        if rec.error is not None:
            return  # this rank already failed; the others learn it when the ranks agree
        try:
            checksum = await self._put(write_io.path, write_io.buf)
        except Exception as exc:  # recorded, and raised on every rank by the saver
            rec.error, rec.error_path = exc, write_io.path
            return
        rec.sizes[write_io.path] = buffer_nbytes(write_io.buf)
        if checksum is not None:
            rec.checksums[write_io.path] = checksum


def _storage_plugin_base() -> type:
    from torchsnapshot.io_types import StoragePlugin

    return StoragePlugin


def fs_storage_factory(path: str, storage_options: Optional[dict[str, Any]] = None) -> Any:
    """torchsnapshot ``storage_plugins`` entry point ``tntfs``: local files, fsynced."""
    from torchsnapshot.storage_plugins.fs import FSStoragePlugin

    class _FSPlugin(_RecordingPlugin, FSStoragePlugin):  # type: ignore[misc]
        def __init__(self, root: str) -> None:
            FSStoragePlugin.__init__(self, root=root)
            _RecordingPlugin.__init__(self)
            #: compat.Snapshot reads raw tensors from here itself (direct_read.py).
            self.direct_read_root = root

        async def _put(self, rel_path: str, buf: Any) -> Optional[dict[str, Any]]:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(  # type: ignore[no-any-return]
                _io_pool(), _write_and_sum, os.path.join(self.root, rel_path), buf
            )

        def _where(self) -> str:
            return str(self.root)

        def _load_index(self) -> Optional[bytes]:
            try:
                with open(os.path.join(self.root, INDEX_FNAME), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        async def read(self, read_io: Any) -> None:
            path = os.path.join(self.root, read_io.path)
            if not is_inside(self.root, read_io.path):
                raise RuntimeError(
                    f"the manifest of {self.root} names the file {read_io.path!r}, outside the "
                    "snapshot: the snapshot is damaged or was not written by torchsnapshot"
                )
            if read_io.path != METADATA_FNAME:
                view = await asyncio.get_running_loop().run_in_executor(
                    _io_pool(), _map_file, path, read_io.byte_range
                )
                if view is not None:
                    read_io.buf = _Mapped(view)
                    _check_complete_read(read_io)
                    # hashing the mapped pages is what reads them from the disk
                    await asyncio.get_running_loop().run_in_executor(_io_pool(), self._verify_read, read_io)
                    return
            data = await asyncio.get_running_loop().run_in_executor(
                _io_pool(), _read_file, path, read_io.byte_range
            )
            read_io.buf = io.BytesIO(data)  # shares ``data``: getvalue() returns it uncopied
            _check_complete_read(read_io)
            self._verify_read(read_io)

    return _FSPlugin(path)


def _write_and_sum(path: str, data: Any) -> dict[str, Any]:
    """``_write_durably`` and the checksum record of what was written (checksums.record):
    a plain buffer is hashed piece by piece as it is written."""
    from .checksums import ALGO, new_hasher, record

    if isinstance(data, Gathered):
        fileio.write_durably(path, data)
        return record(data)
    hasher = fileio.hashing.hasher = new_hasher()
    try:
        fileio.write_durably(path, data)
    finally:
        fileio.hashing.hasher = None
    if hasher.fed != buffer_nbytes(data):  # not written by the function above (tests replace it)
        return record(data)
    return {"algo": ALGO, "value": hasher.hexdigest()}


def _check_complete_read(read_io: Any) -> None:
    """Raise if a ranged read came back short (a truncated file).

    torchsnapshot reads the tensors packed into one file with one ranged read and then ignores
    the errors of unpacking them (``BatchedBufferConsumer`` awaits its tasks with
    ``asyncio.wait``), so a truncated file would load as a silent, partial restore.
    """
    if read_io.byte_range is None:
        return
    start, end = read_io.byte_range
    got = len(read_io.buf.getvalue())  # getbuffer() would copy the whole buffer
    if got != end - start:
        raise EOFError(
            f"{read_io.path} is truncated: {end - start} bytes expected at offset {start}, "
            f"{got} read"
        )


def s3_storage_factory(path: str, storage_options: Optional[dict[str, Any]] = None) -> Any:
    """torchsnapshot ``storage_plugins`` entry point ``tnts3``: S3 honouring storage_options."""
    base = _storage_plugin_base()
    bucket, _, root = path.partition("/")

    class _S3Plugin(_RecordingPlugin, base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            _RecordingPlugin.__init__(self)
            self.client = s3_client(storage_options)

        def _key(self, rel_path: str) -> str:
            return f"{root}/{rel_path}" if root else rel_path

        def direct_fetch(self, rel_path: str, start: int, end: int) -> bytes:
            """Bytes ``start:end`` of a snapshot file (compat.Snapshot's direct reads)."""
            if not _relative_inside(rel_path):
                raise RuntimeError(
                    f"the manifest of s3://{bucket}/{root} names the file {rel_path!r}, outside the "
                    "snapshot: the snapshot is damaged or was not written by torchsnapshot"
                )
            with s3_errors(f"s3://{bucket}/{self._key(rel_path)}"):
                body = self.client.get_object(
                    Bucket=bucket, Key=self._key(rel_path), Range=f"bytes={start}-{end - 1}"
                )["Body"]
            try:
                return body.read()  # type: ignore[no-any-return]
            finally:
                body.close()

        async def _put(self, rel_path: str, buf: Any) -> Optional[dict[str, Any]]:
            from .checksums import record

            body = buf.tobytes() if isinstance(buf, Gathered) else bytes(buf)

            def put() -> dict[str, Any]:
                self.client.put_object(Bucket=bucket, Key=self._key(rel_path), Body=body)
                return record(buf)

            return await asyncio.get_running_loop().run_in_executor(None, put)  # type: ignore[no-any-return]

        def _where(self) -> str:
            return f"s3://{bucket}/{root}"

        def _load_index(self) -> Optional[bytes]:
            key = self._key(INDEX_FNAME)
            try:
                with s3_errors(f"s3://{bucket}/{key}"):
                    body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
            except FileNotFoundError:  # no index: a snapshot the plugin did not write
                return None
            try:
                return body.read()  # type: ignore[no-any-return]
            finally:
                body.close()

        async def read(self, read_io: Any) -> None:
            if not _relative_inside(read_io.path):  # refused before any request, as on disk
                raise RuntimeError(
                    f"the manifest of s3://{bucket}/{root} names the file {read_io.path!r}, "
                    "outside the snapshot: the snapshot is damaged or was not written by torchsnapshot"
                )
            kwargs: dict[str, Any] = {"Bucket": bucket, "Key": self._key(read_io.path)}
            if read_io.byte_range is not None:
                start, end = read_io.byte_range
                kwargs["Range"] = f"bytes={start}-{end - 1}"

            def get() -> bytes:
                with s3_errors(f"s3://{bucket}/{kwargs['Key']}"):
                    return self.client.get_object(**kwargs)["Body"].read()  # type: ignore[no-any-return]

            read_io.buf = io.BytesIO(await asyncio.get_running_loop().run_in_executor(None, get))
            _check_complete_read(read_io)
            self._verify_read(read_io)

        async def delete(self, path: str) -> None:
            self.client.delete_object(Bucket=bucket, Key=self._key(path))

        async def delete_dir(self, path: str) -> None:
            pass  # S3 has no directories

        async def close(self) -> None:
            pass

    return _S3Plugin()


class _Seams(types.ModuleType):
    """This module's type: setting one of the names below on it (``monkeypatch.setattr(storage,
    "_write_durably", ...)``, as tests written before the split do) sets it, too, on the module
    that now owns and calls it, so the stores see the replacement as they did."""

    _OWNERS = {"_write_durably": (fileio, "write_durably"), "_write_gathered": (fileio, "write_gathered"),
               "s3_client": (_s3, "s3_client")}

    def __setattr__(self, name: str, value: Any) -> None:
        owner = self._OWNERS.get(name)
        if owner is not None:
            setattr(owner[0], owner[1], value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Seams

__all__ = [
    "INDEX_FNAME",
    "LEASE_FNAME",
    "LEASE_S",
    "LOCK_FNAME",
    "METADATA_FNAME",
    "S3_OPTION_KEYS",
    "STALE_AFTER_S",
    "WRITER_FNAME",
    "DirLock",
    "Gathered",
    "LocalStore",
    "S3Store",
    "Store",
    "WriteRecorder",
    "buffer_nbytes",
    "current_io_concurrency",
    "fs_storage_factory",
    "fsync_dir",
    "io_concurrency",
    "is_inside",
    "live_runs",
    "new_run_id",
    "open_store",
    "recording",
    "s3_client",
    "s3_error",
    "s3_errors",
    "s3_storage_factory",
    "split_snapshot_path",
    "staging_token",
    "writer_gone",
    "writer_identity",
    "_FileLock",
    "_S3Lease",
    "_is_missing_key",
    "_map_file",
    "_read_file",
    "_relative_inside",
    "_rmtree_proof_last",
    "_translated",
    "_write_durably",
    "_write_gathered",
]
