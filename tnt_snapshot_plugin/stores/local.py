"""Snapshot directories on local disk: :class:`LocalStore` and its ``fcntl`` dirpath lock.

Snapshots are staged in a directory named after their writer and renamed into place
(:class:`~.base.AtomicRename`); every file is written durably (``fileio.write_durably``, or
``fileio.start_write`` and its fdatasync step: fdatasync'd before the commit, parent directories
fsynced before the rename). Deletion unpublishes first (one rename into a
staging directory that provably is the plugin's), so a crash part-way never leaves a listed
snapshot with files missing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
import uuid
from typing import Any, Callable, Optional, Sequence

from tnt_snapshot_plugin.errors import (
    ConfigError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotWriteError,
    is_no_space,
)
from tnt_snapshot_plugin.naming import is_staging_name
from tnt_snapshot_plugin.stores import fileio
from tnt_snapshot_plugin.stores.base import (
    INDEX_FNAME,
    LOCK_FNAME,
    PROOF_FNAMES,
    WRITER_FNAME,
    Buffer,
    DirLock,
    Done,
    Read,
    Store,
    check_child_name,
)
from tnt_snapshot_plugin.stores.commit import AtomicRename
from tnt_snapshot_plugin.stores.ownership import busy_error, hold_lost, holder_text, writer_of_token


class FileLock(DirLock):
    """``fcntl.flock`` on ``dirpath/.tnt_snapshot.lock``, held while the run lasts and naming its
    holder. The kernel drops it when the process dies, so a killed job leaves no stale lock; the
    file is removed on release (while still locked, and only while it is still this lock's file),
    and a taker checks that the file it locked is still the one at that path, so a file unlinked
    under it is never mistaken for the lock.

    :meth:`check` compares the lock file at that path, and dirpath itself, with the ones locked
    (device and inode): a dirpath removed during the run (and perhaps created again, by another
    job) or a lock file removed or replaced means this run no longer holds the dirpath."""

    def __init__(self, root: str, url: str, holder: dict[str, Any]) -> None:
        import fcntl

        self._fd: Optional[int] = None
        self._url = url
        self._root = root
        #: why this run no longer holds dirpath (check), once found: it stays lost
        self._lost: Optional[str] = None
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
                raise busy_error(url, other) from None
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
            self._root_id = _identity(os.stat(root))
        except BaseException:
            os.close(fd)  # let go of the lock: no one could release it otherwise
            raise
        self._fd = fd

    def check(self) -> None:
        fd = self._fd
        if fd is None:
            return
        if self._lost is None:
            self._lost = self._why_lost(fd)
        if self._lost is not None:
            raise SnapshotWriteError(self._lost)

    def _why_lost(self, fd: int) -> Optional[str]:
        """Why this run no longer holds dirpath (its message), or None while it does."""
        url = self._url
        try:
            root = _identity(os.stat(self._root))
        except OSError:
            return _lost_message(f"dirpath {url!r} was removed during this run", None)
        try:
            current = _identity(os.stat(self._path, follow_symlinks=False))
        except OSError:
            current = None
        if root != self._root_id:
            what = f"dirpath {url!r} was removed during this run and created again"
        elif current is None:
            what = f"the lock file {self._path} of this run was removed from dirpath {url!r}"
        elif current != _identity(os.fstat(fd)):
            what = f"the lock file {self._path} of this run was replaced in dirpath {url!r}"
        else:
            return None
        return _lost_message(what, None if current is None else _read_holder(self._path))

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                # only this lock's file: after a loss (check) the path may hold another job's
                if _identity(os.stat(self._path, follow_symlinks=False)) == _identity(os.fstat(fd)):
                    os.unlink(self._path)
            except OSError:
                pass
            os.close(fd)  # closing the only descriptor drops the flock

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter shutdown; the kernel drops the lock at exit anyway
            pass


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _read_holder(path: str) -> Any:
    """The holder a lock file names (None if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(4096) or b"null")
    except (OSError, ValueError):
        return None


def _lost_message(what: str, holder: Any) -> str:
    return hold_lost(what if holder is None else f"{what}; its lock file now names {holder_text(holder)}")


class LocalStore(Store):
    protocol = AtomicRename()
    start_payload_copies = True  # written into the page cache before start_payload returns

    def __init__(self, dirpath: str) -> None:
        self.url = dirpath
        self.root = os.path.abspath(dirpath)
        #: directories of the snapshot being written whose real path was checked (write_payload)
        self._inside_dirs: set[str] = set()
        #: this store's reading threads (read_into), started by the first read that needs them
        self._reads = fileio.ReadThreads(fileio.MAX_READ_THREADS)

    def child(self, name: str) -> str:
        return os.path.join(self.url, name)

    def nested(self, name: str) -> Store:
        return LocalStore(self.child(name))


    def list_names(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:
                return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def has_file(self, name: str, rel: str) -> bool:
        # A child that is a symlink holds nothing of ours (listing skips it too): never followed.
        return not os.path.islink(os.path.join(self.root, name)) and os.path.isfile(os.path.join(self.root, name, rel))

    def read_file(self, name: str, rel: str) -> bytes:
        """File ``rel`` of child ``name``: only a regular file inside ``dirpath`` (symlinks
        resolved) is opened; SnapshotCorruptError for anything else (a FIFO, a device, a link
        out of the directory); FileNotFoundError if it is missing."""
        path = os.path.join(self.root, name, rel)
        if not fileio.is_inside(self.root, os.path.join(name, rel)):
            raise SnapshotCorruptError(f"{path} resolves outside {self.url}; it is never read")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SnapshotCorruptError(f"{path} is not a regular file; it is never read")
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
            # A file without a name (O_TMPFILE, where the filesystem has it): a process killed
            # meanwhile leaves nothing in dirpath.
            with tempfile.TemporaryFile(dir=self.root):
                pass
        except OSError as exc:
            raise ConfigError(
                f"dirpath {self.url!r} cannot be written ({exc.strerror or exc}); "
                "pass a directory this process can create files in"
            ) from exc

    def write_payload(
        self, name: str, rel: str, data: Sequence[Buffer], feed: Optional[Callable[[memoryview], Any]] = None
    ) -> None:
        path = self._payload_path(name, rel)
        # looked up on fileio at each call: the one place every local snapshot file is written
        fileio.write_durably(path, data[0] if len(data) == 1 else list(data), feed=feed)

    def start_payload(self, name: str, rel: str, data: Sequence[Buffer]) -> Callable[[], None]:
        # written into the page cache now; fdatasync'd by the step returned
        return fileio.start_write(self._payload_path(name, rel), data)

    def _payload_path(self, name: str, rel: str) -> str:
        """Where file ``rel`` of child ``name`` goes; SnapshotWriteError if that is outside it."""
        self._check_rel(name, rel, SnapshotWriteError)
        path = os.path.join(self.root, name, rel)
        parent = os.path.dirname(path)
        # Symlinks resolved, once per directory of the staging tree (many payloads share one).
        if parent not in self._inside_dirs:
            snapshot = os.path.realpath(os.path.join(self.root, name))
            real = os.path.realpath(parent)
            if real != snapshot and not real.startswith(snapshot + os.sep):
                raise SnapshotWriteError(f"refusing to write {path}: it resolves outside {self.child(name)}")
            self._inside_dirs.add(parent)
        return path

    def read_into(
        self, name: str, reads: Sequence[Read], done: Optional[Done] = None, concurrency: Optional[int] = None
    ) -> None:
        self._check_reads(name, reads)
        root = os.path.join(self.root, name)
        try:
            fileio.preadv_into(
                root, reads, error=SnapshotCorruptError, done=done, threads=concurrency or fileio.READ_THREADS,
                pool=self._reads,
            )
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise SnapshotCorruptError(
                f"{exc.filename or root}: a file the snapshot names cannot be read "
                f"({exc.strerror}); the snapshot is damaged"
            ) from exc

    def read_ahead(self, name: str, files: Sequence[tuple[str, Optional[int]]]) -> None:
        try:
            check_child_name(self.url, name)
        except SnapshotError:
            return  # a hint: the read itself refuses the name
        fileio.read_ahead(os.path.join(self.root, name), files)

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        self._inside_dirs = set()
        path = os.path.join(self.root, staging)
        # dirpath too where it is missing: a saver's run checks its lock first (DirLock.check),
        # so a dirpath removed under a run fails that snapshot instead of being made again here
        os.makedirs(path)
        try:
            fileio.write_durably(os.path.join(path, WRITER_FNAME), json.dumps(writer).encode())
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
        return writer_of_token(name.rsplit(".", 1)[1], started) if is_staging_name(name) else None

    def lock(self, holder: dict[str, Any]) -> DirLock:
        os.makedirs(self.root, exist_ok=True)
        return FileLock(self.root, self.url, holder)

    def publish(self, staging: str, final: str) -> None:
        staged = os.path.join(self.root, staging)
        for parent, _dirs, _files in os.walk(staged, topdown=False):
            fileio.fsync_dir(parent)
        target = os.path.join(self.root, final)
        doomed = None
        if os.path.lexists(target):
            # Another run's snapshot (or an interrupted write) of the plugin's under this name:
            # unpublished first, replaced, then deleted. Anything else is never touched.
            if os.path.islink(target) or not self.holds_proof(final):
                raise SnapshotWriteError(
                    f"{self.child(final)} exists and was not written by the plugin (no "
                    f"{INDEX_FNAME} or {WRITER_FNAME}); move it out of dirpath. The snapshot "
                    "was not committed"
                )
            from tnt_snapshot_plugin.naming import staging_name

            doomed = os.path.join(self.root, staging_name(final, "del" + uuid.uuid4().hex[:9]))
            os.rename(target, doomed)
        os.rename(staged, target)
        fileio.fsync_dir(self.root)
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)

    def _delete(self, name: str, unpublish: tuple[str, ...]) -> None:
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
            from tnt_snapshot_plugin.naming import staging_name

            doomed = os.path.join(self.root, staging_name(name, "del" + uuid.uuid4().hex[:9]))
            os.mkdir(doomed)
            marker = {"deleting": name, "host": socket.gethostname(), "pid": os.getpid()}
            try:
                fileio.write_durably(os.path.join(doomed, WRITER_FNAME), json.dumps(marker).encode())
            except OSError as exc:
                if not is_no_space(exc):
                    raise
                # No room for the marker (the disk is full, which is when deleting matters most):
                # the snapshot's directory itself is renamed to the deletion's staging name; its
                # index, removed last, proves it the plugin's until the end.
                shutil.rmtree(doomed, ignore_errors=True)
                os.rename(path, doomed)
            else:
                os.rename(path, os.path.join(doomed, name))
            fileio.fsync_dir(self.root)
            path = doomed
        rmtree_proof_last(path)



def rmtree_proof_last(path: str) -> None:
    """Delete directory ``path``, its index and writer marker (the proof it is the plugin's) last."""
    proofs = PROOF_FNAMES
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


def open_local(
    url: str, storage_options: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None
) -> LocalStore:
    """The store of a local path or ``file://`` URL (the ``file`` scheme's opener,
    stores/registry.py). ``storage_options`` have no meaning on local disk: ConfigError."""
    if storage_options:
        raise ConfigError(
            f"storage_options {sorted(storage_options)} was given for the local dirpath {url!r}, "
            "where it has no effect; pass storage_options only with s3:// or other object-store URLs"
        )
    return LocalStore(url[len("file://"):] if url.startswith("file://") else url)
