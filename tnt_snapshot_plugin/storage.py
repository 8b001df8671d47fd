"""Where snapshots live: listing, committing and guarded deletion, on local disk and S3.

Two layers:

* :class:`Store` (``LocalStore``, ``S3Store``) works on a snapshot *directory* ``dirpath``: it lists
  the snapshot names in it (in commit order, see retention.py), tells whether one is complete,
  commits one, and deletes one. Deletion only ever removes a child of ``dirpath`` whose name this
  plugin writes *and* that provably holds what the plugin wrote (its index, or its writer marker
  ``.tnt_writer.json``), never follows a symlink, and never touches anything else.
* Writers and the dirpath lock: every write carries its writer's identity (host, pid, a per-run
  id), in its staging name and in the marker written first into it; the live saver holds a lock on
  ``dirpath`` for its run (``fcntl.flock`` on ``.tnt_snapshot.lock`` locally, best effort on S3: a
  lease object), so a second job on the same ``dirpath`` is refused instead of mixing runs. A
  leftover of an interrupted write is removed only when its writer is provably gone (same host and
  its process dead, or the pid now runs another process) or it is older than ``STALE_AFTER_S``.
* The torchsnapshot storage plugins registered under torchsnapshot's ``storage_plugins``
  entry-point group (``tntfs://``, ``tnts3://``) carry the bytes. While a snapshot is written they
  fsync every file, remember its size, hold back ``.snapshot_metadata`` (torchsnapshot's commit
  marker) and record a write error instead of raising it, so every rank reaches the end of the
  write and the ranks can agree whether to commit. The saver then writes the metadata itself, last.

Work-arounds for torchsnapshot-nightly 2024.7.26, both tested in tests/test_storage.py:

* its S3 plugin ignores ``storage_options`` (no endpoint, no credentials; upstream
  ``# TODO: read AWS tokens from storage_options?``) and ``s3://`` cannot be overridden through the
  entry-point group, so ``s3://`` paths are handed to torchsnapshot as ``tnts3://``, served by
  :class:`_S3Plugin` which builds its boto3 client from ``storage_options``;
* its fs plugin never fsyncs, so a "complete" snapshot could be lost by a power cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import mmap
import os
import posixpath
import re
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .errors import (
    ConfigError,
    SnapshotError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    StorageUnavailableError,
)
from .naming import SnapshotName, is_staging_name
from .retention import Listed, commit_order, from_index

METADATA_FNAME = ".snapshot_metadata"
INDEX_FNAME = ".tnt_snapshot_index.json"
#: Written first into every write (staging directory, or the final name on object stores): who
#: writes it ({"host", "pid", "run_id", "started_at"}). Proves the directory is the plugin's.
WRITER_FNAME = ".tnt_writer.json"
#: The lock file (local disk) and lease object (S3) of a dirpath's live saver.
LOCK_FNAME = ".tnt_snapshot.lock"
LEASE_FNAME = ".tnt_snapshot.lease.json"
#: A leftover write whose writer cannot be proven gone (another host) is removed once it is older
#: than this (seconds since its writer started it): no snapshot write takes a day.
STALE_AFTER_S = 24 * 3600.0
#: How long an S3 lease lasts without renewal (it is renewed at every commit and every minute).
LEASE_S = 300.0

S3_OPTION_KEYS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
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


# Large buffers go to the kernel in slices of this size, and after each slice the kernel is asked
# to start writing it back (sync_file_range, Linux): the disk then works while the next slice is
# copied, and the final fdatasync mostly waits for writes already in flight instead of starting
# all of them. Measured on the project's machine (1 GiB in 16 MiB writes, 2 runs): write then
# fdatasync 0.22-0.54 GB/s; with the writeback started after each write 0.45-0.58 GB/s.
_WRITE_SLICE = 8 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the final fdatasync does all the work
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_file_range = _load_sync_file_range()


def _relative_inside(rel: str) -> bool:
    """Whether the relative path ``rel`` stays below its root, read as written (object keys)."""
    norm = posixpath.normpath(rel)
    return not (rel.startswith("/") or norm == ".." or norm.startswith("../"))


def is_inside(root: str, rel: str) -> bool:
    """Whether ``root/rel`` (symlinks resolved) lies inside the directory ``root``."""
    return os.path.realpath(os.path.join(root, rel)).startswith(os.path.join(os.path.realpath(root), ""))


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


_IOV_MAX = 1024


def _write_gathered(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` in order with as few ``writev`` calls as the kernel allows."""
    pending = [v for v in views if v.nbytes]
    first = 0  # pending[first:] is still to write
    done = 0
    since_flush = 0
    while first < len(pending):
        written = os.writev(fd, pending[first:first + _IOV_MAX])
        done += written
        since_flush += written
        while written:  # skip what was written; keep the rest of a buffer written in part
            head = pending[first]
            if written >= head.nbytes:
                written -= head.nbytes
                first += 1
            else:
                pending[first] = head[written:]
                written = 0
        if _sync_file_range is not None and since_flush >= _WRITE_SLICE:
            _sync_file_range(fd, done - since_flush, since_flush, _SYNC_FILE_RANGE_WRITE)
            since_flush = 0


def _write_durably(path: str, data: Any) -> None:
    """Write ``data`` (any buffer) to the new file ``path``, durably: fdatasync'd on return.

    Every file of a snapshot is written through this function (the tests inject I/O errors
    here). Missing parent directories are created (torchsnapshot writes into subdirectories).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        if isinstance(data, Gathered):
            _write_gathered(fd, data.views)
            os.fdatasync(fd)
            return
        view = memoryview(data).cast("B")
        total = view.nbytes
        hasher = getattr(_active, "hasher", None)  # set by _write_and_sum
        piece = _HASH_PIECE if hasher is not None else _WRITE_SLICE
        offset = 0
        while offset < total:
            start = offset
            end = min(total, offset + _WRITE_SLICE)
            while offset < end:
                upper = min(end, offset + piece)
                if hasher is not None:
                    # hashed just before the kernel copies it: read from memory once, for both
                    hasher.update(view[offset:upper])
                    hasher.fed += upper - offset
                while offset < upper:
                    offset += os.write(fd, view[offset:upper])
            if _sync_file_range is not None and total > _WRITE_SLICE:
                _sync_file_range(fd, start, offset - start, _SYNC_FILE_RANGE_WRITE)
        os.fdatasync(fd)
    finally:
        os.close(fd)


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


#: Reads at least this large map the file instead of copying it into a new buffer.
_MAP_BYTES = 1024 * 1024


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


def _map_file(path: str, byte_range: Optional[tuple[int, int]]) -> Optional[memoryview]:
    """A view of ``byte_range`` (default: all) of ``path``, up to its end; None if too small."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        start, end = (0, size) if byte_range is None else byte_range
        end = min(end, size)
        if end - start < _MAP_BYTES:
            return None
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, end - base, access=mmap.ACCESS_READ, offset=base)
    finally:
        os.close(fd)
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_WILLNEED)  # start reading all of it now, in the background
    return memoryview(mapping)[start - base:]


def _read_file(path: str, byte_range: Optional[tuple[int, int]]) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if byte_range is None:
            start, size = 0, os.fstat(fd).st_size
        else:
            start, size = byte_range[0], byte_range[1] - byte_range[0]
        data = os.pread(fd, size, start)
        if len(data) == size or not data:
            return data
        parts = [data]  # a short read: keep reading until the end of the range or the file
        got = len(data)
        while got < size:
            more = os.pread(fd, size - got, start + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


#: Payloads are hashed in pieces of this size, each just before it is written (in the cache).
_HASH_PIECE = 1024 * 1024


def _write_and_sum(path: str, data: Any) -> dict[str, Any]:
    """``_write_durably`` and the checksum record of what was written (checksums.record):
    a plain buffer is hashed piece by piece as it is written."""
    from .checksums import ALGO, new_hasher, record

    if isinstance(data, Gathered):
        _write_durably(path, data)
        return record(data)
    hasher = _active.hasher = new_hasher()
    try:
        _write_durably(path, data)
    finally:
        _active.hasher = None
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


def s3_client(storage_options: Optional[dict[str, Any]]) -> Any:
    try:
        import boto3
    except ImportError:
        raise ConfigError(
            "s3:// snapshots need boto3: pip install 'tnt-snapshot-plugin[s3]'"
        ) from None
    options = dict(storage_options or {})
    unknown = set(options) - S3_OPTION_KEYS
    if unknown:
        raise ConfigError(
            f"storage_options has keys {sorted(unknown)} that the S3 storage does not know; "
            f"expected some of {sorted(S3_OPTION_KEYS)}"
        )
    # Building a client costs ~0.2 s (botocore loads the service model), and every store and
    # every torchsnapshot plugin instance needs one; clients are thread-safe, so one is shared
    # per process and configuration (the AWS_* environment included: it fills in what the
    # options leave out).
    key = (
        os.getpid(),
        tuple(sorted(options.items())),
        tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))),
    )
    with _s3_clients_lock:
        client = _s3_clients.get(key)
        if client is None:
            client = _s3_clients[key] = boto3.session.Session().client(
                "s3", config=_s3_config(), **options
            )
    return client


def _s3_config() -> Any:
    """Transient errors (connection refused or reset, timeouts, throttling, 5xx) are retried with
    exponential backoff by botocore's "standard" retry mode, 4 attempts in all unless
    ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` say otherwise; a connection is given 10 s."""
    from botocore.config import Config

    retries: dict[str, Any] = {"mode": os.environ.get("AWS_RETRY_MODE", "standard")}
    if "AWS_MAX_ATTEMPTS" not in os.environ:
        retries["total_max_attempts"] = 4
    return Config(retries=retries, connect_timeout=10, read_timeout=60)


_CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403", "InvalidToken"}
)


def s3_error(url: str, exc: BaseException) -> Optional[SnapshotError]:
    """The plugin's error for a botocore exception met at ``url`` (None: not botocore's)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return SnapshotNotFoundError(
                f"{url}: the bucket does not exist ({exc}); check the URL and storage_options"
            )
        if code in ("NoSuchKey", "404", "NotFound"):  # a FileNotFoundError, as for local files
            return SnapshotNotFoundError(f"{url}: no such object ({exc})")
        if code in _CREDENTIAL_CODES:
            return ConfigError(
                f"{url}: the object store refused the credentials ({exc}); check "
                "storage_options (aws_access_key_id, aws_secret_access_key, aws_session_token)"
            )
        return StorageUnavailableError(f"{url}: the object store failed the request ({exc})")
    if isinstance(exc, NoCredentialsError):
        return ConfigError(f"{url}: no credentials ({exc}); pass them in storage_options")
    if isinstance(exc, BotoCoreError):
        return StorageUnavailableError(
            f"{url}: the object store could not be reached ({type(exc).__name__}: {exc}), after "
            "retries; check endpoint_url and the network"
        )
    return None


@contextlib.contextmanager
def s3_errors(url: str) -> Any:
    """Raise botocore's exceptions as the plugin's (``s3_error``), naming ``url``."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as exc:
        mapped = s3_error(url, exc)
        if mapped is None:
            raise
        raise mapped from exc


def _translated(method: Callable[..., Any]) -> Callable[..., Any]:
    """An ``S3Store`` method raising the plugin's errors (``s3_errors``) instead of botocore's."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with s3_errors(self.url):
            return method(self, *args, **kwargs)

    return wrapper


_s3_clients: dict[tuple[Any, ...], Any] = {}
_s3_clients_lock = threading.Lock()


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


# --------------------------------------------------------------------------------------------
# Writers: who writes a snapshot, and whether that writer is provably gone.

#: Run ids of the savers alive in this process (a leftover of this pid with another id is stale).
live_runs: set[str] = set()


def new_run_id() -> str:
    run_id = uuid.uuid4().hex[:12]
    live_runs.add(run_id)
    return run_id


def _host_hash() -> str:
    import hashlib

    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


_TOKEN = re.compile(r"(?P<run_id>[0-9a-f]{12})h(?P<host>[0-9a-f]{8})p(?P<pid>[0-9]+)n[0-9]+|del[0-9a-f]{9}")


def staging_token(run_id: str, count: int) -> str:
    """The writer's part of a staging name: run id, host (hashed), pid, and a count."""
    return f"{run_id}h{_host_hash()}p{os.getpid()}n{count}"


def _writer_of_token(token: str, started_at: float) -> Optional[dict[str, Any]]:
    """The writer a staging name's token names; None if the plugin writes no such token."""
    match = _TOKEN.fullmatch(token)
    if match is None:
        return None
    if match["run_id"] is None:  # an interrupted deletion's: the process that deleted is unnamed
        return {"started_at": started_at - STALE_AFTER_S - 1.0}
    host = socket.gethostname() if match["host"] == _host_hash() else f"(hash {match['host']})"
    return {"host": host, "pid": int(match["pid"]), "run_id": match["run_id"], "started_at": started_at}


def _staged_by_this_process(name: str) -> bool:
    """Whether ``name`` is a staging name of a live run of this very process (its own write, even
    where its marker was lost, e.g. the directory removed and recreated during the write)."""
    if not is_staging_name(name):
        return False
    match = _TOKEN.fullmatch(name.rsplit(".", 1)[1])
    return (
        match is not None
        and match["run_id"] in live_runs
        and match["host"] == _host_hash()
        and int(match["pid"]) == os.getpid()
    )


def writer_identity(run_id: str) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id}


def _process_start_time(pid: int) -> Optional[float]:
    """When process ``pid`` started (unix seconds), from /proc; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def writer_gone(
    writer: Any, now: Optional[float] = None, stale_after: float = STALE_AFTER_S
) -> Optional[str]:
    """Why the writer of a leftover is provably gone (so the leftover may be removed), or None.

    Gone: started more than ``STALE_AFTER_S`` ago; or on this host, its pid is this process and
    its run is not one of this process's live savers, its pid is dead, or the pid now belongs to a
    process started after the write began (pid reuse).
    """
    if not isinstance(writer, dict):
        return None
    now = time.time() if now is None else now
    started = writer.get("started_at")
    if isinstance(started, (int, float)) and now - started > stale_after:
        return f"started {now - started:.0f}s ago (more than {stale_after:.0f}s)"
    pid = writer.get("pid")
    if writer.get("host") != socket.gethostname() or isinstance(pid, bool) or not isinstance(pid, int):
        return None
    if pid == os.getpid():
        return None if writer.get("run_id") in live_runs else "its run in this process has ended"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its process {pid} is dead"
    except OSError:  # exists (owned by someone else)
        pass
    begun = _process_start_time(pid)
    if begun is not None and isinstance(started, (int, float)) and begun > started + 1.0:
        return f"pid {pid} now belongs to a process started after the write began"
    return None


def _holder_text(holder: Any) -> str:
    if not isinstance(holder, dict):
        return "an unknown process"
    since = holder.get("started_at")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
        if isinstance(since, (int, float))
        else ""
    )
    return f"host {holder.get('host')!r} pid {holder.get('pid')} run {holder.get('run_id')!r}{when}"


def _busy_error(url: str, holder: Any) -> ConfigError:
    return ConfigError(
        f"dirpath {url!r} is in use by another saver ({_holder_text(holder)}): two jobs writing "
        "one dirpath would mix their snapshots and delete each other's. Give each job its own "
        "dirpath, or stop the other job first"
    )


class DirLock:
    """The live saver's hold on a dirpath for its run; :meth:`release` lets go (idempotent)."""

    def release(self) -> None:
        pass


class _FileLock(DirLock):
    """``fcntl.flock`` on ``dirpath/.tnt_snapshot.lock``, held while the run lasts and naming its
    holder. The kernel drops it when the process dies, so a killed job leaves no stale lock; the
    file is removed on release (while still locked), and a taker checks that the file it locked is
    still the one at that path, so a file unlinked under it is never mistaken for the lock."""

    def __init__(self, root: str, url: str, holder: dict[str, Any]) -> None:
        import fcntl

        self._fd: Optional[int] = None
        self._path = os.path.join(root, LOCK_FNAME)
        for _attempt in range(100):
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    other = json.loads(os.pread(fd, 4096, 0) or b"null")
                except ValueError:
                    other = None
                os.close(fd)
                raise _busy_error(url, other) from None
            except OSError:
                os.close(fd)
                raise
            try:
                same = os.stat(self._path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # released and removed by its holder meanwhile: take the new one
        else:
            raise SnapshotError(f"could not lock {self._path}: it keeps being replaced")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)  # let go of the lock: no one could release it otherwise
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            os.close(fd)  # closing the only descriptor drops the flock

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter shutdown; the kernel drops the lock at exit anyway
            pass


# --------------------------------------------------------------------------------------------
# Stores: the snapshot directory.


class Store:
    """A snapshot directory (``dirpath``) on some storage."""

    url: str
    #: Whether a snapshot is staged under another name and renamed into place on commit.
    #: Where not (object stores), it is written under its final name and published by
    #: ``.snapshot_metadata`` written last, so an interrupted write leaves an incomplete
    #: snapshot-named directory behind.
    atomic_rename: bool = True

    def child(self, name: str) -> str:
        """The user-facing path of child ``name``."""
        raise NotImplementedError

    def nested(self, name: str) -> "Store":
        """Child directory ``name`` as a store of its own (same storage, same options)."""
        raise NotImplementedError

    def torchsnapshot_url(self, name: str) -> str:
        """The URL torchsnapshot is given for child ``name`` (served by our plugins)."""
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

    def staging_for(self, final: str, token: str) -> str:
        """Where to write snapshot ``final`` before its commit (``token``: the writer's, alnum)."""
        raise NotImplementedError

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        """Start a write: the writer marker goes in first, so the write is provably ours."""
        raise NotImplementedError

    def commit(self, staging: str, final: str, metadata: bytes, index: bytes) -> None:
        """Make ``final`` complete: index, then metadata last (and the rename, on disk). A
        snapshot of the plugin's already named ``final`` (another run's) is replaced."""
        raise NotImplementedError

    def lock(self, holder: dict[str, Any]) -> DirLock:
        """Take this dirpath for one run; ConfigError naming the holder if another saver has it."""
        return DirLock()

    def _remove(self, name: str) -> None:
        raise NotImplementedError

    # -- shared logic ------------------------------------------------------------------------

    def is_complete(self, name: str) -> bool:
        return self.has_file(name, METADATA_FNAME)

    def _read_json(self, name: str, rel: str) -> Optional[dict[str, Any]]:
        """The JSON object in file ``rel`` of child ``name``; None if missing or not one."""
        try:
            value = json.loads(self.read_file(name, rel))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, UnicodeDecodeError):
            return None
        except Exception as exc:
            # read_file raises the plugin's error (s3_errors), botocore's as its cause
            if _is_missing_key(exc) or _is_missing_key(exc.__cause__):  # type: ignore[arg-type]
                return None
            raise
        return value if isinstance(value, dict) else None

    def read_index(self, name: str) -> Optional[dict[str, Any]]:
        """The plugin's index of child ``name`` (a JSON object with ``format``), or None."""
        index = self._read_json(name, INDEX_FNAME)
        return index if index is not None and "format" in index else None

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
        first): one listing, then one read of each index and one existence check each."""
        found = []
        for text in self.list_names():
            parsed = SnapshotName.parse(text)
            if parsed is not None and self.is_complete(text):
                found.append(from_index(parsed, None if parsed.phase_aware else self.read_index(text)))
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
            not _staged_by_this_process(name)
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
        """Why snapshot ``name`` is damaged (a file missing or of the wrong size), or None.

        Only snapshots this plugin wrote carry the size index; others are trusted as complete.
        """
        if not self.has_file(name, INDEX_FNAME):
            return None
        try:
            index = json.loads(self.read_file(name, INDEX_FNAME))
            files = index["files"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"its index {INDEX_FNAME} is unreadable ({exc})"
        for rel, size in files.items():
            actual = self.file_size(name, rel)
            if actual is None:
                return f"file {rel} is missing"
            if actual != size:
                return f"file {rel} has {actual} bytes, {size} were written"
        # The metadata's checksum (a small file; every rank reads it before loading anything).
        record = (index.get("checksums") or {}).get(METADATA_FNAME) if isinstance(index, dict) else None
        if isinstance(record, dict):
            from .checksums import Verifier

            try:
                Verifier(self.child(name), {METADATA_FNAME: record}, {}).check(
                    METADATA_FNAME, 0, self.read_file(name, METADATA_FNAME)
                )
            except SnapshotError as exc:
                return str(exc)
        return None


class _S3Lease(DirLock):
    """Best effort on S3 (no compare-and-swap): the lease object ``dirpath/.tnt_snapshot.lease.json``
    names the live saver and when its lease expires (``LEASE_S``); a thread renews it every
    minute. A second saver is refused while an unexpired lease of another run is there, unless
    that run's process is provably dead on this host. Two jobs starting within the same second
    can both miss each other's lease; jobs that overlap longer are refused."""

    def __init__(self, store: "S3Store", holder: dict[str, Any]) -> None:
        self._store = store
        self._holder = dict(holder)
        self._stop = threading.Event()
        try:
            current = store._read_json("", LEASE_FNAME)
        except Exception as exc:  # best effort: never stop training over the lease
            _lease_warning(store, exc)
            current = None
        if (
            current is not None
            and current.get("run_id") != holder.get("run_id")
            and isinstance(current.get("expires_at"), (int, float))
            and current["expires_at"] > time.time()
            and writer_gone(current, stale_after=float("inf")) is None
        ):
            raise _busy_error(store.url, current)
        try:
            self._renew()
        except Exception as exc:
            _lease_warning(store, exc)
        self._thread = threading.Thread(target=self._keep, name="tnt-snapshot-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        body = json.dumps({**self._holder, "expires_at": time.time() + LEASE_S}).encode()
        self._store.client.put_object(
            Bucket=self._store.bucket, Key=self._store._key(LEASE_FNAME), Body=body
        )

    def _keep(self) -> None:
        while not self._stop.wait(min(60.0, LEASE_S / 5)):
            try:
                self._renew()
            except Exception:  # best effort; the next renewal tries again
                pass

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            current = self._store._read_json("", LEASE_FNAME)
            if current is not None and current.get("run_id") == self._holder.get("run_id"):
                self._store.client.delete_object(
                    Bucket=self._store.bucket, Key=self._store._key(LEASE_FNAME)
                )
        except Exception:  # it expires by itself
            pass


def _lease_warning(store: "S3Store", exc: BaseException) -> None:
    import warnings

    warnings.warn(
        f"could not read or write the lease {store.child(LEASE_FNAME)} ({type(exc).__name__}: "
        f"{exc}); another job writing {store.url} at the same time would not be detected",
        stacklevel=5,
    )


def _is_missing_key(exc: BaseException) -> bool:
    # S3Store's methods raise the plugin's errors from botocore's (``s3_errors``): look at both
    if isinstance(exc, FileNotFoundError):  # s3_errors maps a missing key to one
        return True
    for error in (exc, exc.__cause__):
        response = getattr(error, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("404", "NoSuchKey", "NotFound"):
            return True
    return False


class LocalStore(Store):
    def __init__(self, dirpath: str) -> None:
        self.url = dirpath
        self.root = os.path.abspath(dirpath)

    def child(self, name: str) -> str:
        return os.path.join(self.url, name)

    def nested(self, name: str) -> Store:
        return LocalStore(self.child(name))

    def torchsnapshot_url(self, name: str) -> str:
        return "tntfs://" + os.path.join(self.root, name)

    def list_names(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:
                return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def has_file(self, name: str, rel: str) -> bool:
        return os.path.isfile(os.path.join(self.root, name, rel))

    def is_complete(self, name: str) -> bool:
        # A symlink named like a snapshot is not one of ours (listing skips it too).
        return not os.path.islink(os.path.join(self.root, name)) and super().is_complete(name)

    def read_file(self, name: str, rel: str) -> bytes:
        with open(os.path.join(self.root, name, rel), "rb") as f:
            return f.read()

    def file_size(self, name: str, rel: str) -> Optional[int]:
        try:
            return os.stat(os.path.join(self.root, name, rel)).st_size
        except FileNotFoundError:
            return None

    def check_writable(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"dirpath {self.url!r} exists and is not a directory; pass a directory")
        try:
            os.makedirs(self.root, exist_ok=True)
            probe = os.path.join(self.root, f".tnt_write_probe.{uuid.uuid4().hex}")
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as exc:
            raise ConfigError(
                f"dirpath {self.url!r} cannot be written ({exc.strerror or exc}); "
                "pass a directory this process can create files in"
            ) from exc

    def staging_for(self, final: str, token: str) -> str:
        from .naming import staging_name

        return staging_name(final, token)

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        path = os.path.join(self.root, staging)
        os.makedirs(path)  # dirpath too, if someone removed it meanwhile
        try:
            _write_durably(os.path.join(path, WRITER_FNAME), json.dumps(writer).encode())
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def bare_staging_writer(self, name: str) -> Optional[dict[str, Any]]:
        path = os.path.join(self.root, name)
        try:
            if os.path.islink(path) or not set(os.listdir(path)) <= {WRITER_FNAME}:
                return None
            started = os.stat(path).st_mtime
        except OSError:
            return None
        return _writer_of_token(name.rsplit(".", 1)[1], started) if is_staging_name(name) else None

    def lock(self, holder: dict[str, Any]) -> DirLock:
        os.makedirs(self.root, exist_ok=True)
        return _FileLock(self.root, self.url, holder)

    def commit(self, staging: str, final: str, metadata: bytes, index: bytes) -> None:
        staged = os.path.join(self.root, staging)
        # Every file written must still be there: a directory removed during the write (and
        # recreated by a later file's write) would otherwise commit a snapshot with holes.
        for rel, size in json.loads(index)["files"].items():
            actual = self.file_size(staging, rel)
            if actual != size:
                raise SnapshotWriteError(
                    f"{os.path.join(staged, rel)} has {actual} bytes, {size} were written (was "
                    "dirpath removed or changed during the save?); the snapshot was not committed"
                )
        _write_durably(os.path.join(staged, INDEX_FNAME), index)
        _write_durably(os.path.join(staged, METADATA_FNAME), metadata)
        for parent, _dirs, _files in os.walk(staged, topdown=False):
            fsync_dir(parent)
        target = os.path.join(self.root, final)
        doomed = None
        if os.path.lexists(target):
            # Another run's snapshot (or an interrupted write) of the plugin's under this name:
            # unpublished first, replaced, then deleted. Anything else is never touched.
            if os.path.islink(target) or not self.provably_ours(final):
                raise SnapshotWriteError(
                    f"{self.child(final)} exists and was not written by the plugin (no "
                    f"{INDEX_FNAME} or {WRITER_FNAME}); move it out of dirpath. The snapshot "
                    "was not committed"
                )
            from .naming import staging_name

            doomed = os.path.join(self.root, staging_name(final, "del" + uuid.uuid4().hex[:9]))
            os.rename(target, doomed)
        os.rename(staged, target)
        fsync_dir(self.root)
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)

    def _remove(self, name: str) -> None:
        path = os.path.join(self.root, name)
        if os.path.islink(path):
            raise SnapshotError(f"refusing to delete {path}: it is a symlink")
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(self.root):
            raise SnapshotError(f"refusing to delete {path}: it resolves outside {self.url}")
        if not os.path.exists(path):
            return
        if not is_staging_name(name):
            # Unpublish atomically first, into a staging directory whose writer marker is written
            # before and removed after everything else: a crash part-way then leaves a staging
            # directory that provably is the plugin's (removed at the next train start), never a
            # listed snapshot with files missing, nor a directory that can no longer be told ours.
            from .naming import staging_name

            doomed = os.path.join(self.root, staging_name(name, "del" + uuid.uuid4().hex[:9]))
            os.mkdir(doomed)
            marker = {"deleting": name, "host": socket.gethostname(), "pid": os.getpid()}
            _write_durably(os.path.join(doomed, WRITER_FNAME), json.dumps(marker).encode())
            os.rename(path, os.path.join(doomed, name))
            fsync_dir(self.root)
            path = doomed
        _rmtree_proof_last(path)


def _rmtree_proof_last(path: str) -> None:
    """Delete directory ``path``, its index and writer marker (the proof it is the plugin's) last."""
    proofs = (WRITER_FNAME, INDEX_FNAME)
    with os.scandir(path) as entries:
        rest = [e for e in entries if e.name not in proofs]
    for entry in rest:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    for proof in proofs:
        try:
            os.unlink(os.path.join(path, proof))
        except FileNotFoundError:
            pass
    os.rmdir(path)


class S3Store(Store):
    atomic_rename = False

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]]) -> None:
        self.url = url.rstrip("/")
        rest = self.url[len("s3://"):]
        self.bucket, _, self.prefix = rest.partition("/")
        if not self.bucket:
            raise ConfigError(f"dirpath {url!r} names no bucket; expected s3://BUCKET/PREFIX")
        self.storage_options = storage_options
        self.client = s3_client(storage_options)

    def _key(self, name: str, rel: str = "") -> str:
        parts = [p for p in (self.prefix, name, rel) if p]
        return "/".join(parts)

    def child(self, name: str) -> str:
        return f"{self.url}/{name}"

    def nested(self, name: str) -> Store:
        return S3Store(self.child(name), self.storage_options)

    def torchsnapshot_url(self, name: str) -> str:
        return f"tnts3://{self.bucket}/{self._key(name)}"

    @_translated
    def list_names(self) -> list[str]:
        prefix = self._key("") + "/" if self.prefix else ""
        names: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, Delimiter="/"
        ):
            for common in page.get("CommonPrefixes", []):
                names.append(common["Prefix"][len(prefix):].rstrip("/"))
        return names

    def has_file(self, name: str, rel: str) -> bool:
        return self.file_size(name, rel) is not None

    @_translated
    def read_file(self, name: str, rel: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name, rel))["Body"].read()

    @_translated
    def file_size(self, name: str, rel: str) -> Optional[int]:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name, rel))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return int(head["ContentLength"])

    def check_writable(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise ConfigError(
                f"dirpath {self.url!r}: bucket {self.bucket!r} is not reachable ({exc}); check "
                "the bucket name and storage_options (endpoint_url, credentials)"
            ) from exc

    def staging_for(self, final: str, token: str) -> str:
        # Object stores cannot rename atomically: write in place, commit by writing the
        # metadata last. A leftover of the plugin's under the same name is removed first.
        return final

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(staging, WRITER_FNAME), Body=json.dumps(writer).encode()
        )

    @_translated
    def commit(self, staging: str, final: str, metadata: bytes, index: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(final, INDEX_FNAME), Body=index)
        self.client.put_object(Bucket=self.bucket, Key=self._key(final, METADATA_FNAME), Body=metadata)

    def lock(self, holder: dict[str, Any]) -> DirLock:
        return _S3Lease(self, holder)

    @_translated
    def _remove(self, name: str) -> None:
        # Unpublish first: a crash part-way then leaves an incomplete snapshot (ignored by
        # restore, cleared at the next train start), never a complete-looking one missing files.
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name, METADATA_FNAME))
        prefix = self._key(name) + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


def open_store(dirpath: str, storage_options: Optional[dict[str, Any]] = None) -> Store:
    """The store for ``dirpath``: a local path, ``file://`` URL or ``s3://`` URL."""
    if not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath):
        raise ConfigError(f"dirpath must be a non-empty path or URL string, got {dirpath!r}")
    dirpath = os.fspath(dirpath)
    protocol = dirpath.split("://", 1)[0] if "://" in dirpath else "file"
    if protocol == "file" and storage_options:
        raise ConfigError(
            f"storage_options {sorted(storage_options)} was given for the local dirpath "
            f"{dirpath!r}, where it has no effect; pass storage_options only with s3:// paths"
        )
    if "://" not in dirpath:
        return LocalStore(dirpath)
    if protocol == "file":
        return LocalStore(dirpath[len("file://"):])
    if protocol == "s3":
        return S3Store(dirpath, storage_options)
    raise ConfigError(
        f"dirpath {dirpath!r} uses storage protocol {protocol!r}, which tnt_snapshot_plugin does "
        "not support; use a local path, file:// or s3://"
    )


def split_snapshot_path(path: str) -> tuple[str, str]:
    """(dirpath, name) of a snapshot path or URL."""
    path = os.fspath(path).rstrip("/")
    head, _, name = path.rpartition("/")
    if not name:
        raise ConfigError(f"{path!r} is not a snapshot path (expected DIRPATH/epoch_E_step_S)")
    return head or ".", name
