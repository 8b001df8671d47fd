"""Durable file I/O on local disk: the only module that writes or reads snapshot bytes with syscalls.

* Writes: :func:`write_durably` writes a new file from one buffer or from several buffers end to
  end (``writev``, never copied together), asks the kernel to start writing back every
  :data:`WRITE_SLICE` bytes (``sync_file_range``, Linux), and ``fdatasync``s before it returns.
  :func:`fsync_dir` makes a rename or a new name durable.
* Reads: :func:`preadv_into` (bytes straight into caller-owned buffers, each file in offset
  order, one ``preadv`` per run of adjacent ranges, a few files at once on the caller's
  :class:`ReadThreads`, with the kernel told ahead which ranges follow).
* Read-ahead: :func:`read_ahead` (a hint, early in a restore: the kernel starts reading the
  files that follow while the caller checks and plans).
* Path check: :func:`is_inside` (a local path, symlinks resolved): a file named by a manifest
  never escapes its snapshot.

Nothing here knows about snapshots, manifests or stores; errors are the OS's, except that
:func:`preadv_into` raises the error class it is given for a short file or an escaping path.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

# Large buffers go to the kernel in slices of this size, and after each slice the kernel is asked
# to start writing it back (sync_file_range, Linux): the disk then works while the next slice is
# copied, and the final fdatasync mostly waits for writes already in flight instead of starting
# all of them (``benchmarks/run.py``'s durable time at 1 GiB measures it against the disk's floor).
WRITE_SLICE = 8 * 1024 * 1024
#: ``write_durably``'s ``feed`` gets a single buffer in pieces of this size, each just before it
#: is written (hashed while in the CPU's cache: the bytes cross memory once for both).
FEED_PIECE = 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2
#: The most buffers one ``writev`` takes (Linux's IOV_MAX).
IOV_MAX = 1024
#: :func:`preadv_into` keeps about this many bytes of upcoming reads announced to the kernel
#: (``WILLNEED``), so the disk reads ahead while earlier buffers are being filled.
READ_AHEAD_BYTES = 256 * 1024 * 1024
#: ... and at most this many files ahead of the one being read (each announced file is open).
READ_AHEAD_FILES = 64
#: :func:`read_ahead` announces at most this many bytes: it runs on the caller's thread (the
#: kernel's time to start the reads grows with the bytes announced), early in a restore, so that the disk reads while the metadata is checked and the reads planned.
READ_AHEAD_EARLY_BYTES = 16 * 1024 * 1024
#: :func:`preadv_into` reads up to this many files at once: several reads in flight keep a cold
#: disk busier than one at a time, and reading into the target tensors beats mmap and a copy
#: (``benchmarks/run.py``'s cold restores at 1 GiB, 64 MiB and 10,000 x 4 KiB, and
#: ``benchmarks/restore_phases.py``, measure it).
READ_THREADS = 8
#: The most files :func:`preadv_into` reads at once, whatever ``threads`` asks.
MAX_READ_THREADS = 32
#: ... and only when there are at least this many bytes per reading thread.
PARALLEL_READ_MIN_BYTES = 8 * 1024 * 1024


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


def is_inside(root: str, rel: str, real_root: Optional[str] = None) -> bool:
    """Whether ``root/rel`` (symlinks resolved) lies inside the directory ``root``.
    ``real_root``: ``os.path.realpath(root)``, for a caller that checks many files of one root.
    Only ``rel``'s own components are looked at (one ``lstat`` each, not one for every component
    of the whole path); a ``rel`` that is absolute, holds ``..`` or passes through a symlink is
    resolved whole."""
    if "\x00" in rel:
        return False  # no file has such a name: never looked up
    if real_root is None:
        real_root = os.path.realpath(root)
    parts = rel.split("/")
    if rel.startswith("/") or ".." in parts:
        return _resolves_inside(real_root, rel)
    path = real_root
    for part in parts:
        if part in ("", "."):
            continue
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return True  # missing: the open that follows reports it
        if stat.S_ISLNK(mode):
            return _resolves_inside(real_root, rel)
    return True


def _resolves_inside(real_root: str, rel: str) -> bool:
    return os.path.realpath(os.path.join(real_root, rel)).startswith(os.path.join(real_root, ""))


def byte_views(data: Sequence[Any]) -> list[Any]:
    """Flat unsigned-byte views of the buffers ``data`` (no copy). A flat ``uint8`` numpy array
    (what the format writer hands out for tensors) is one already and is kept as it is: it is
    not tracked by the garbage collector, where a memoryview is."""
    views: list[Any] = []
    for buf in data:
        if is_flat_bytes(buf):
            views.append(buf)
            continue
        view = memoryview(buf)
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


def is_flat_bytes(buf: Any) -> bool:
    """Whether ``buf`` is a flat ``uint8`` numpy array (``format.common.flat_bytes``): a byte
    view already, used as it is. numpy is not imported here: a process that has not imported
    it holds no such array."""
    np = sys.modules.get("numpy")
    return np is not None and type(buf) is np.ndarray and buf.ndim == 1 and buf.dtype.char == "B"


def write_gathered(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` in order with as few ``writev`` calls as the kernel allows."""
    pending = [v for v in views if v.nbytes]
    first = 0  # pending[first:] is still to write
    done = 0
    since_flush = 0
    while first < len(pending):
        written = os.writev(fd, pending[first:first + IOV_MAX])
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
        if _sync_file_range is not None and since_flush >= WRITE_SLICE:
            _sync_file_range(fd, done - since_flush, since_flush, _SYNC_FILE_RANGE_WRITE)
            since_flush = 0


def write_durably(path: str, data: Any, feed: Optional[Callable[[memoryview], Any]] = None) -> None:
    """Write ``data`` to the new file ``path``, durably: fdatasync'd on return.

    ``data``: one buffer; or several, end to end - a list or tuple of buffers, or an object whose
    ``views`` attribute is a list of flat byte views - written with ``writev``
    (:func:`write_gathered`). Missing parent directories are created. ``feed`` is given every
    byte in order, just before it is written: one buffer in pieces of :data:`FEED_PIECE` (still in
    the CPU's cache when the kernel copies them), several buffers one by one.

    Every snapshot file on local disk is written through this function or, in two steps, through
    :func:`start_write`; the stores look them up on this module at each call.
    """
    views = byte_views(data) if isinstance(data, (list, tuple)) else getattr(data, "views", None)
    if views is not None:  # several buffers: start_write's writev pass, then its fdatasync
        if feed is not None:
            for piece in views:
                feed(piece)
        start_write(path, views)()
        return
    fd = _create(path)
    try:
        view = memoryview(data).cast("B")
        total = view.nbytes
        offset = 0
        piece = FEED_PIECE if feed is not None else WRITE_SLICE
        while offset < total:
            start = offset
            end = min(total, offset + WRITE_SLICE)
            while offset < end:
                upper = min(end, offset + piece)
                if feed is not None:
                    feed(view[offset:upper])
                while offset < upper:
                    offset += os.write(fd, view[offset:upper])
            if _sync_file_range is not None and total > WRITE_SLICE:
                _sync_file_range(fd, start, offset - start, _SYNC_FILE_RANGE_WRITE)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def start_write(path: str, data: Sequence[Any]) -> Callable[[], None]:
    """Write the buffers ``data`` end to end to the new file ``path`` now (into the page cache,
    with ``writev``) and start its writeback; returns ``finish()``, which makes the file durable
    (fdatasync) and closes it: call it exactly once, on any thread. If this raises, no file
    descriptor is left open.

    The caller can go on (planning the next file) while the disk writes this one: a thread that
    waits in ``fdatasync`` needs the GIL only to return, where a thread that also had the Python
    of the write to run waited its turn for the GIL at every step while the caller was busy."""
    fd = _create(path)
    try:
        write_gathered(fd, byte_views(data))
        if _sync_file_range is not None:
            _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0 bytes: to the end of the file
    except BaseException:
        os.close(fd)
        raise

    def finish() -> None:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    return finish


def _create(path: str) -> int:
    """A new (truncated) file ``path`` open for writing; missing parent directories are created."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)


def fsync_dir(path: str) -> None:
    """Make the names in directory ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_ahead(root: str, files: Iterable[tuple[str, Optional[int]]], limit: int = READ_AHEAD_EARLY_BYTES) -> int:
    """Ask the kernel to start reading ``files`` of ``root`` (``(file, size)`` each, in the order
    they will be read; size None: the whole file) into the page cache, up to ``limit`` bytes in
    all (a file that does not fit is announced up to the limit); the bytes announced. A hint
    only: a file that is missing, not a regular file or outside ``root`` is skipped, and no
    error is raised (the read that follows reports it)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    announced = 0
    real_root = os.path.realpath(root)
    for location, size in files:
        if announced >= limit:
            break
        if size == 0 or not is_inside(root, location, real_root):
            continue
        try:
            fd = os.open(os.path.join(root, location), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                continue
            length = min(info.st_size if size is None else size, limit - announced)
            advise(fd, 0, length, os.POSIX_FADV_WILLNEED)
            announced += length
        except OSError:
            continue
        finally:
            os.close(fd)
    return announced


def _runs(items: list[tuple[int, memoryview, int]]) -> Iterator[tuple[int, list[memoryview], list[int]]]:
    """Sorted ``(offset, buffer, index)`` reads grouped into runs of adjacent byte ranges (the
    tensors packed end to end in one file), at most IOV_MAX buffers each: one ``preadv`` call a
    run. Yields ``(offset, buffers, indices)``; an empty buffer's index rides with a run."""
    start = end = -1
    run: list[memoryview] = []
    indices: list[int] = []
    for offset, buf, index in items:
        if buf.nbytes and run and (offset != end or len(run) == IOV_MAX):
            yield start, run, indices
            run, indices = [], []
        indices.append(index)
        if not buf.nbytes:
            continue
        if not run:
            start = end = offset
        run.append(buf)
        end += buf.nbytes
    if indices:
        yield start, run, indices


def _read_run(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` from ``fd`` at ``offset`` (``preadv``, again after a short read); the bytes
    read, or ``-(bytes read) - 1`` if the file ends first."""
    got = 0
    first = 0  # bufs[first:] are not full yet; bufs[first] may have its first bytes already
    while first < len(bufs):
        n = os.preadv(fd, bufs[first:], offset + got)
        if n == 0:
            return -got - 1
        got += n
        while first < len(bufs) and n >= bufs[first].nbytes:  # the buffers filled
            n -= bufs[first].nbytes
            first += 1
        if n:  # one filled in part: read the rest into its remainder
            bufs = [*bufs[:first], bufs[first][n:], *bufs[first + 1:]]
    return got


def preadv_into(
    root: str,
    reads: Iterable[tuple[Any, ...]],
    *,
    error: type[Exception],
    done: Optional[Callable[[list[int]], None]] = None,
    threads: int = READ_THREADS,
    pool: Optional[ReadThreads] = None,
) -> int:
    """Fill each buffer from ``root/file`` at its offset; return the bytes read.

    ``reads``: ``(file, offset, buffer)``; each buffer a writable flat byte view. Each file is
    read in offset order, one ``preadv`` per run of adjacent ranges, and up to ``threads`` files
    at once (at most :data:`MAX_READ_THREADS`; fewer when there are fewer files or less than
    :data:`PARALLEL_READ_MIN_BYTES` per thread to read), on ``pool`` (the caller's reading
    threads, e.g. its store's; None: threads of this call's own). Each reading thread tells the kernel
    ahead of time which of its ranges follow (``POSIX_FADV_WILLNEED``, its share of
    :data:`READ_AHEAD_BYTES`), so the disk keeps reading while ``done(indices)`` runs: called on the reading thread after each ``preadv`` with the
    indices (in ``reads``) of the buffers it filled, every index once; an exception it raises
    stops the reading. A file outside ``root`` (symlinks resolved) or ending before a buffer is
    full raises ``error`` naming it; a missing file raises FileNotFoundError.
    """
    by_file: dict[str, list[tuple[int, memoryview, int]]] = {}
    nbytes = 0
    for index, (location, offset, buf) in enumerate(reads):
        by_file.setdefault(location, []).append((offset, buf, index))
        nbytes += buf.nbytes
    real_root = os.path.realpath(root)
    for location in by_file:
        if not is_inside(root, location, real_root):
            raise error(
                f"the manifest of {root} names the file {location!r}, outside the snapshot: "
                "the snapshot is damaged"
            )
    plan = [(loc, sorted(items, key=lambda item: item[0])) for loc, items in sorted(by_file.items())]
    k = min(threads, MAX_READ_THREADS, len(plan), max(1, nbytes // PARALLEL_READ_MIN_BYTES))
    if k <= 1:
        return _read_files(root, plan, error, done, READ_AHEAD_BYTES, None)
    stop: list[bool] = []  # set by a reader that failed: the others stop at their next run
    if pool is None:
        pool = ReadThreads(MAX_READ_THREADS)
    futures = [
        pool.submit(_read_files, root, plan[j::k], error, done, READ_AHEAD_BYTES // k, stop)
        for j in range(k)
    ]
    failed = [e for e in (f.exception() for f in futures) if e is not None]
    if failed:
        raise failed[0]
    return sum(f.result() for f in futures)


#: Seconds a reading thread waits for more reads before it ends: reads close together (the keys
#: of one restore, a fallback to an older snapshot) reuse the threads, and none stays idle longer.
READ_THREAD_IDLE_S = 2.0


class ReadThreads:
    """Reading threads, owned by whoever reads (a local store): started as reads ask for them
    (starting one has a cost of its own), at most ``limit``, each ending
    after :data:`READ_THREAD_IDLE_S` without work, so reads close together (the keys of one
    restore, a fallback to an older snapshot) reuse them. In a forked child, the first read starts
    threads of its own."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._reset()

    def _reset(self) -> None:
        import queue

        self._pid = os.getpid()
        self._queue: Any = queue.SimpleQueue()
        self._empty = queue.Empty
        self._threads = self._idle = self._pending = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        from concurrent.futures import Future

        future: Future[Any] = Future()
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's threads are not here
                self._reset()
            self._pending += 1
            self._queue.put((future, fn, args))
            if self._pending > self._idle and self._threads < self._limit:
                self._threads += 1
                threading.Thread(target=self._work, name=f"tnt-snapshot-read-{self._threads}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                future, fn, args = self._queue.get(timeout=READ_THREAD_IDLE_S)
            except self._empty:
                with self._lock:
                    self._idle -= 1
                    if self._pending == 0:
                        self._threads -= 1
                        return
                continue  # a read came in as the wait ended
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)


def _open_regular(path: str, error: type[Exception]) -> int:
    """A descriptor of the regular file ``path``; ``error`` for anything else (a FIFO would
    block the read forever, a device would read without end)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path} is not a regular file: the snapshot is damaged")
    return fd


def _read_files(
    root: str,
    plan: list[tuple[str, list[tuple[int, memoryview, int]]]],
    error: type[Exception],
    done: Optional[Callable[[list[int]], None]],
    read_ahead: int,
    stop: Optional[list[bool]],
) -> int:
    """Read ``plan``'s files one after the other (see preadv_into); the bytes read."""
    fds: dict[str, int] = {}
    advise = getattr(os, "posix_fadvise", None)
    ahead = 0  # index in plan of the next file not announced yet
    announced = 0  # bytes announced and not read yet
    total = 0
    try:
        for i, (location, items) in enumerate(plan):
            while advise is not None and ahead < len(plan) and (
                ahead <= i or (announced < read_ahead and ahead - i < READ_AHEAD_FILES)
            ):
                loc, its = plan[ahead]
                fd = fds[loc] = _open_regular(os.path.join(root, loc), error)
                first, last = its[0][0], its[-1][0] + its[-1][1].nbytes
                advise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
                announced += last - first
                ahead += 1
            if location not in fds:
                fds[location] = _open_regular(os.path.join(root, location), error)
            fd = fds[location]
            for offset, bufs, indices in _runs(items):
                if stop:
                    return total
                size = _read_run(fd, bufs, offset)
                if size < 0:
                    got = -size - 1
                    raise error(
                        f"{os.path.join(root, location)} ends at byte {offset + got}, before the "
                        f"end of the entries it holds (bytes {offset}-"
                        f"{offset + sum(b.nbytes for b in bufs)}): the file is truncated"
                    )
                total += size
                announced -= size
                if done is not None:
                    done(indices)
            os.close(fds.pop(location))
    except BaseException:
        if stop is not None:
            stop.append(True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


__all__ = [
    "IOV_MAX",
    "READ_AHEAD_BYTES",
    "ReadThreads",
    "WRITE_SLICE",
    "byte_views",
    "fsync_dir",
    "is_inside",
    "preadv_into",
    "read_ahead",
    "write_durably",
    "write_gathered",
]
