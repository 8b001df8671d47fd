"""The process writer: the payload files of asynchronous snapshots written by a process of the
rank's own, so that their Python (the write loops, the hashing, the I/O threads' bookkeeping)
never holds the training process's GIL.

With ``Knobs(writer="process")`` each rank's saver starts one writer process at train start (a
fresh interpreter, ``python -c`` calling :func:`main`: it imports neither torch nor the training
script, and starts in a fraction of a second) and stops it at train end. Per snapshot:

* **Shared memory.** The staging buffers of asynchronous snapshots (``saving.staging.Stager``)
  are cut from memory files (``os.memfd_create``) that both processes map (:class:`SharedStaging`).
  Each file's descriptor is handed to the writer process once (``SCM_RIGHTS`` over the two
  processes' socket) and stays mapped there while any buffer cut from it lives: while the
  state's layout holds, a snapshot sends nothing but the list of files to write. A buffer
  outside the shared memory (a ``torch.save``'d object, a tensor the stager does not copy) is
  sent in the message, copied.
* **Payloads.** The saver's writer thread encodes the state as the thread writer does and sends
  each payload file as it is complete: its name, where its bytes lie, and the tensors' bounds
  of a pack. The writer process writes it through a store it opened from the same URL and
  storage options (:class:`~tnt_snapshot_plugin.saving.payloads.PayloadWrites`: the same I/O
  threads, checksums and fsyncs as the thread writer) and answers once every file is durable,
  with their sizes and checksums.
* **Commit.** The index parts, the ranks' gather and rank 0's commit run in the training
  process, exactly as with the thread writer (``saving/writer.py``).
* **A crash.** A writer process that ends while a snapshot is written (killed, out of memory)
  fails that snapshot with a SnapshotWriteError naming its pid and how it ended (a
  SnapshotFailedWarning, or raised, as ``on_save_error`` says); nothing is committed, older
  snapshots are intact, and the next snapshot starts a new writer process.

Stores: local disk, ``s3://`` and fsspec URLs open again in the writer process; a store that
cannot (a filesystem in the training process's memory, a store object made in it, such as the
fakes of ``tnt_snapshot_plugin.testing``) is refused with ConfigError when ``writer="process"``
is asked for, and is written by the thread writer by default (:func:`unavailable`).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Optional

from tnt_snapshot_plugin.errors import ConfigError, SnapshotWriteError, causes
from tnt_snapshot_plugin.format.base import Payload
from tnt_snapshot_plugin.saving.payloads import DEFAULT_IO_THREADS, PayloadWrites, io_pool
from tnt_snapshot_plugin.stores.base import Store

logger = logging.getLogger(__name__)

#: Buffers up to this size are cut from shared segments of :data:`SEGMENT_BYTES`; a larger one
#: gets a segment of its own.
SMALL_BUFFER_BYTES = 16 << 20
#: The size of a segment small buffers are cut from (memory is used only where written).
SEGMENT_BYTES = 64 << 20
#: Where each buffer starts in its segment: a multiple of this (a cache line).
ALIGN = 64
#: How long :meth:`WriterProcess.stop` waits for the writer process to end before killing it.
STOP_TIMEOUT_S = 10.0
#: The writer process's niceness, added to the training process's (Linux: per process): the
#: kernel gives the training threads the cores first when both want one.
NICENESS = 0
#: The statement the writer process runs (with the socket's descriptor as its one argument).
_ENTRY = "from tnt_snapshot_plugin.saving.process_writer import main; main()"


def unavailable(store: Store) -> Optional[str]:
    """Why ``store`` cannot be opened again in the writer process (None: it can): the process
    writes through a store of its own, opened from ``store.url`` and the storage options."""
    from tnt_snapshot_plugin.stores.fsspec import FsspecStore
    from tnt_snapshot_plugin.stores.local import LocalStore
    from tnt_snapshot_plugin.stores.s3 import S3Store

    if not hasattr(os, "memfd_create"):
        return "it needs os.memfd_create (Linux) to share the staging buffers with the writer process"
    kind = type(store)
    if kind in (LocalStore, S3Store):
        return None
    if kind is FsspecStore:
        protocols = store.fs.protocol  # type: ignore[attr-defined]
        if "memory" in ((protocols,) if isinstance(protocols, str) else tuple(protocols)):
            return (
                f"{store.url} is an fsspec filesystem in this process's memory, which a writer "
                "process cannot reach"
            )
        return None
    return (
        f"{store.url} is served by {kind.__module__}.{kind.__qualname__}, which the writer process "
        "cannot open again from its URL (only local disk, s3:// and fsspec URLs)"
    )


def process_wanted(config: Any, store: Store, default: str) -> bool:
    """Whether snapshots of ``config`` to ``store`` are written by a writer process:
    ``knobs.writer`` or else ``default`` says "process", snapshots are asynchronous, and the
    store opens in another process. ConfigError when ``knobs.writer="process"`` and it does not."""
    asked = config.knobs.writer
    if (asked or default) != "process" or not config.async_snapshot:
        return False
    reason = unavailable(store)
    if reason is None:
        return True
    if asked == "process":
        raise ConfigError(
            f"knobs.writer='process' writes each rank's payload files in a process of its own, "
            f"through a store opened there again: {reason}. Pass Knobs(writer='thread') for this "
            "dirpath"
        )
    return False


# ================================================================================================
# the training process's side


class _Segment:
    """One memory file shared with the writer process: its descriptor, mapping and address."""

    __slots__ = ("id", "fd", "size", "map", "view", "base", "used", "live")

    def __init__(self, ident: int, size: int) -> None:
        self.id = ident
        self.size = size
        self.fd = os.memfd_create(f"tnt-snapshot-staging-{ident}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)
        import numpy as np  # the training process's side only: the package imports neither

        probe = np.frombuffer(self.map, dtype=np.uint8)
        self.base: int = probe.__array_interface__["data"][0]
        del probe
        #: bytes handed out (from the start); buffers handed out and still alive
        self.used = 0
        self.live = 0

    def close(self) -> bool:
        """Unmap and close it; False while a buffer cut from it is still exported."""
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            return False
        os.close(self.fd)
        return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal, which the enum does not list
        return f"signal {number}"


def _close_segments(segments: dict[int, _Segment]) -> None:
    for segment in list(segments.values()):
        segment.close()


class SharedStaging:
    """Staging buffers in memory shared with the writer process, for one saver.

    :meth:`allocate` is the stager's allocator (``Stager(allocate=...)``); :meth:`locate` tells
    where a buffer lies (segment, offset), for the payloads sent to the writer process; a
    segment none of whose buffers is alive any more is closed at the next :meth:`collect` (the
    writer process is then told to drop it)."""

    def __init__(self) -> None:
        # Re-entrant: a buffer's finalizer (_release) may run in a garbage collection that an
        # allocation under the lock sets off, on the same thread.
        self._lock = threading.RLock()
        self._segments: dict[int, _Segment] = {}
        #: (base address, segment) of every open segment, by address
        self._bases: list[int] = []
        self._by_base: list[_Segment] = []
        #: the segment small buffers are cut from now
        self._small: Optional[_Segment] = None
        self._next = 0
        #: the segments still open when this object goes without close()
        self._finalizer = weakref.finalize(self, _close_segments, self._segments)

    def allocate(self, numel: int, dtype: Any) -> Any:
        """A new flat tensor of ``numel`` elements of ``dtype`` in shared memory (uninitialised)."""
        import torch

        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            segment, offset = self._place(nbytes)
            segment.live += 1
            view = segment.view[offset:offset + nbytes]
        weakref.finalize(view, self._release, segment)
        return torch.frombuffer(view, dtype=dtype, count=numel)

    def _place(self, nbytes: int) -> tuple[_Segment, int]:
        if nbytes > SMALL_BUFFER_BYTES:
            return self._new(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE), 0
        small = self._small
        offset = 0 if small is None else -(-small.used // ALIGN) * ALIGN
        if small is None or offset + nbytes > small.size:
            small = self._small = self._new(SEGMENT_BYTES)
            offset = 0
        small.used = offset + nbytes
        return small, offset

    def _new(self, size: int) -> _Segment:
        segment = _Segment(self._next, size)
        self._next += 1
        self._segments[segment.id] = segment
        at = bisect.bisect(self._bases, segment.base)
        self._bases.insert(at, segment.base)
        self._by_base.insert(at, segment)
        return segment

    def _release(self, segment: _Segment) -> None:
        with self._lock:
            segment.live -= 1
            if segment.live == 0 and segment is self._small:
                segment.used = 0  # cut again from its start

    def locate(self, buffer: Any) -> Optional[tuple[int, int]]:
        """(segment id, offset) of the flat byte buffer ``buffer`` if it lies in a segment."""
        import numpy as np

        if type(buffer) is np.ndarray:
            address = buffer.__array_interface__["data"][0]
        else:
            address = np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]
        nbytes = buffer.nbytes
        with self._lock:
            at = bisect.bisect_right(self._bases, address) - 1
            if at < 0:
                return None
            segment = self._by_base[at]
            if address + nbytes > segment.base + segment.size:
                return None
            return segment.id, address - segment.base

    def collect(self) -> dict[int, tuple[int, int]]:
        """Close the segments none of whose buffers is alive; the open ones: id -> (fd, size)."""
        with self._lock:
            for segment in list(self._segments.values()):
                if segment.live == 0 and segment is not self._small and segment.close():
                    del self._segments[segment.id]
                    at = self._by_base.index(segment)
                    del self._bases[at], self._by_base[at]
            return {s.id: (s.fd, s.size) for s in self._segments.values()}

    def close(self) -> None:
        """Training is over: close every segment none of whose buffers is alive, the one small
        buffers are cut from included; a later :meth:`allocate` maps new ones."""
        with self._lock:
            self._small = None
        self.collect()

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this saver has mapped."""
        with self._lock:
            return sum(s.size for s in self._segments.values())


class WriterProcess:
    """One rank's writer process: started when asked (train start, or the first snapshot after
    it ended), stopped at train end. Only the saver's writer thread talks to it while a
    snapshot is written; the training thread starts and stops it while none is."""

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]], timeout_s: float, io_threads: int) -> None:
        self._open = ("open", url, storage_options, timeout_s, io_threads, NICENESS)
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._conn: Optional[Connection] = None
        #: the segments the running process has mapped
        self._mapped: set[int] = set()
        #: the message of how the last process ended, once known
        self._ended: Optional[str] = None
        self._closer: Optional[weakref.finalize] = None

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._conn is not None and self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the writer process unless it runs (it opens its store before the first write)."""
        if self.alive():
            return
        self._let_go()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._closer = weakref.finalize(self, _let_go_of, self._conn, self._proc)
        self._mapped = set()
        self._ended = None
        self._send(self._open)
        logger.debug("tnt_snapshot_plugin: writer process %d started", self._proc.pid)

    def begin(self, staging: str, shared: SharedStaging) -> None:
        """Start writing snapshot staging directory ``staging`` (the process started again if it
        ended): its shared segments mapped, the ones gone dropped."""
        self.start()
        segments = shared.collect()
        for gone in sorted(self._mapped - set(segments)):
            self._send(("drop", gone))
            self._mapped.discard(gone)
        for ident, (fd, size) in sorted(segments.items()):
            if ident not in self._mapped:
                self._send(("segment", ident, size))
                self._call(self._send_fd, fd)
                self._mapped.add(ident)
        self._send(("begin", staging))

    def write(self, payload: Payload, shared: SharedStaging) -> None:
        """Hand payload file ``payload`` over: each buffer by where it lies in shared memory, or
        copied into the message."""
        parts: list[Any] = []
        for view in payload.views:
            where = shared.locate(view)
            parts.append(memoryview(view).tobytes() if where is None else (where[0], where[1], view.nbytes))
        self._send(("write", payload.rel, parts, payload.bounds))

    def finish(self) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        """Wait until every file handed over is durable; their sizes and checksum records. Raises
        the write's failure, or SnapshotWriteError if the process ended meanwhile."""
        self._send(("finish",))
        reply = self._call(self._recv)
        if reply[0] == "done":
            return reply[1], reply[2]
        raise _rebuilt(reply[1])

    def stop(self) -> None:
        """End the writer process (nothing is being written): asked to, killed if it does not."""
        proc, conn = self._proc, self._conn
        if proc is None or conn is None:
            return
        try:
            conn.send(("stop",))
        except OSError:
            pass
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("tnt_snapshot_plugin: writer process %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait()
        self._let_go()
        self._proc = None

    def _let_go(self) -> None:
        """Close the socket and wait for the process (it ends when the socket closes)."""
        if self._closer is not None:
            self._closer()
            self._closer = None
        self._conn = None

    def _recv(self) -> Any:
        assert self._conn is not None
        return self._conn.recv()

    def _send(self, message: Any) -> None:
        self._call(self._sendobj, message)

    def _sendobj(self, message: Any) -> None:
        assert self._conn is not None
        self._conn.send(message)

    def _send_fd(self, fd: int) -> None:
        assert self._conn is not None and self._proc is not None
        send_handle(self._conn, fd, self._proc.pid)

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the socket; SnapshotWriteError saying how the process ended if it did."""
        if self._conn is None:
            raise SnapshotWriteError(self._ended or "the writer process is not running")
        try:
            return fn(*args)
        except (OSError, EOFError) as exc:
            raise self._died() from exc

    def _died(self) -> SnapshotWriteError:
        """The process stopped answering: how it ended, as the snapshot's failure."""
        proc = self._proc
        assert proc is not None
        try:
            code = proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
            how = "closed its socket and was killed"
        else:
            if code < 0:
                how = f"was killed by {_signal_name(-code)}"
            else:
                how = f"exited with status {code}"
        self._ended = (
            f"the writer process of this rank (pid {proc.pid}) {how} while the snapshot was being "
            "written; the next snapshot starts a new one"
        )
        self._let_go()
        return SnapshotWriteError(self._ended)


def _let_go_of(conn: Connection, proc: subprocess.Popen[bytes]) -> None:
    """Close the socket (the writer process then ends) and wait for the process to end; kill
    it if it does not (a saver dropped, or the interpreter ending, without train end)."""
    try:
        conn.close()
    except OSError:
        pass
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ProcessPayloads:
    """The payload sink of one snapshot written by the writer process (``format.base.PayloadSink``).

    Never raises before the format's collectives are made: a process that cannot be started or
    reached fails :meth:`submit` and :meth:`finish` with the reason."""


    def __init__(self, process: WriterProcess, shared: SharedStaging, staging: str) -> None:
        self._process = process
        self._shared = shared
        #: False: the buffers handed over are read by the writer process until finish() returns
        self.copies = False
        self.failed: Optional[BaseException] = None
        self._error: Optional[BaseException] = None
        self._begun = False
        try:
            process.begin(staging, shared)
            self._begun = True
        except Exception as exc:
            self._error = exc

    def submit(self, payload: Payload) -> None:
        try:
            if self._error is not None:
                raise self._error
            self._process.write(payload, self._shared)
        except BaseException as exc:
            self._error = self._error or exc
            self.failed = exc
            raise

    def finish(self) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        if self._error is not None:
            if self._begun:  # the files handed over are finished first: nothing writes into
                try:  # the staging directory once the failed snapshot's cleanup removes it
                    self._process.finish()
                except Exception:
                    pass
            raise self._error
        return self._process.finish()


# -- failures crossing the processes


def _described(exc: BaseException) -> list[tuple[Optional[bytes], str, str, Optional[int]]]:
    """``exc`` and what it was raised from, each as (pickle or None, class name, text, errno)."""
    chain = []
    for error in list(causes(exc))[:8]:
        try:
            pickled = pickle.dumps(error)
            pickle.loads(pickled)
            data: Optional[bytes] = pickled
        except Exception:
            data = None
        kind = f"{type(error).__module__}.{type(error).__qualname__}"
        chain.append((data, kind, str(error), error.errno if isinstance(error, OSError) else None))
    return chain


def _rebuilt(chain: list[tuple[Optional[bytes], str, str, Optional[int]]]) -> BaseException:
    """The exception :func:`_described` describes, each raised from the next (an OSError keeps
    its errno: a full disk is still one)."""
    built: list[BaseException] = []
    for data, kind, text, errno in chain:
        error: Optional[BaseException] = None
        if data is not None:
            try:
                error = pickle.loads(data)
            except Exception:
                error = None
        if not isinstance(error, BaseException):
            error = OSError(errno, text) if errno is not None else SnapshotWriteError(f"{kind}: {text}")
        built.append(error)
    for error, cause in zip(built, built[1:], strict=False):
        error.__cause__ = cause
    return built[0] if built else SnapshotWriteError("the writer process failed without saying why")


# ================================================================================================
# the writer process


class _Child:
    """The writer process's state: its store, I/O threads, mapped segments and current snapshot."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.store: Optional[Store] = None
        #: why the store could not be opened: every snapshot fails with it
        self.broken: Optional[BaseException] = None
        self.pool: Any = None
        self.segments: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self.writes: Optional[PayloadWrites] = None
        #: a failure outside the writes (a buffer that could not be reached): the snapshot's
        self.failure: Optional[BaseException] = None

    def open(self, url: str, options: Optional[dict[str, Any]], timeout_s: float, threads: int, niceness: int) -> None:
        from tnt_snapshot_plugin.stores import open_store

        if niceness:
            try:
                os.nice(niceness)
            except OSError:
                pass
        try:
            self.store = open_store(url, options, timeout_s=timeout_s)
        except Exception as exc:
            self.broken = exc
        self.pool = io_pool(threads)

    def map(self, ident: int, size: int) -> None:
        fd = recv_handle(self.conn)
        try:
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.segments[ident] = (data, memoryview(data))

    def drop(self, ident: int) -> None:
        data, view = self.segments.pop(ident)
        try:
            view.release()
            data.close()
        except BufferError:
            pass  # a write still reads it: unmapped once it is done

    def begin(self, staging: str) -> None:
        self.failure = None
        self.writes = None if self.store is None else PayloadWrites(self.store, self.pool, staging)

    def write(self, rel: str, parts: list[Any], bounds: Optional[list[int]]) -> None:
        if self.writes is None or self.failure is not None:
            return
        try:
            views = [
                memoryview(p) if isinstance(p, bytes) else self.segments[p[0]][1][p[1]:p[1] + p[2]] for p in parts
            ]
        except Exception as exc:
            self.failure = SnapshotWriteError(f"the writer process could not reach the bytes of {rel}: {exc!r}")
            return
        try:
            self.writes.submit(Payload(rel, views, bounds))
        except Exception:
            pass  # kept by the writes: finish() raises the first failure

    def finish(self) -> Any:
        writes, self.writes = self.writes, None
        try:
            if self.broken is not None:
                raise self.broken
            if writes is None:
                raise SnapshotWriteError("the writer process was given no snapshot to write")
            result = writes.finish()
            if self.failure is not None:
                raise self.failure
        except BaseException as exc:
            return ("failed", _described(exc))
        return ("done", *result)


def main() -> None:
    """The writer process: serve the training process on the socket whose descriptor is the one
    argument, until it says stop or closes the socket."""
    # The job's signals are the training process's to handle (a preemption snapshot is written
    # after SIGTERM): this process ends when the training process lets go of the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    child = _Child(conn)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "write":
            child.write(*message[1:])
        elif kind == "begin":
            child.begin(message[1])
        elif kind == "finish":
            try:
                conn.send(child.finish())
            except (EOFError, OSError):
                break
        elif kind == "segment":
            child.map(*message[1:])
        elif kind == "drop":
            child.drop(message[1])
        elif kind == "open":
            child.open(*message[1:])
        elif kind == "stop":
            break
    if child.pool is not None:
        child.pool.shutdown(wait=True)


__all__ = [
    "DEFAULT_IO_THREADS",
    "ProcessPayloads",
    "SharedStaging",
    "WriterProcess",
    "main",
    "process_wanted",
    "unavailable",
]
