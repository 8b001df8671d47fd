"""The payload files of one snapshot on one rank, written through a store: each file written as
soon as the format hands it over, several at once on I/O threads, its checksum computed from the
bytes in hand.

:class:`PayloadWrites` is the sink (``format.base.PayloadSink``) of both writers: the thread
writer's, in the training process (``saving/writer.py``), and the process writer's, inside the
writer process (``saving/process_writer.py``). This module imports neither torch nor a format, so
that the writer process starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Optional, TypeVar

from tnt_snapshot_plugin.errors import SnapshotError, SnapshotWriteError
from tnt_snapshot_plugin.format.base import Payload
from tnt_snapshot_plugin.format.checksums import new_hasher, record_views
from tnt_snapshot_plugin.stores.base import Store

T = TypeVar("T")

#: Files written at once by one rank, unless ``max_per_rank_io_concurrency`` says otherwise.
DEFAULT_IO_THREADS = 4

#: One written file: (its name relative to the snapshot, its size, its checksum record).
Written = tuple[str, int, dict[str, Any]]


def io_pool(threads: int) -> Optional[ThreadPoolExecutor]:
    """I/O threads for ``threads`` files at once (None: one at a time, on the calling thread)."""
    if threads <= 1:
        return None
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tnt-snapshot-io")


def write_one(store: Store, staging: str, payload: Payload) -> Written:
    """Write one payload file; (its name, size, checksum record)."""
    # From the bytes in hand: a file of one payload hashed piece by piece as it is written
    # (in the CPU's cache), packed tensors each on its own just before (they are small).
    hasher = None
    if not payload.packed:
        hasher = new_hasher()
    else:
        checksum = record_views(payload.views, payload.bounds)
    with writing(store, staging, payload.rel):
        store.write_payload(staging, payload.rel, payload.views, None if hasher is None else hasher.update)
    if hasher is not None:
        checksum = hasher.record()
    return payload.rel, sum(v.nbytes for v in payload.views), checksum


class PayloadWrites:
    """The payload files of one snapshot on this rank, each written as soon as it is submitted:
    on ``pool``'s I/O threads (several files at once), or at once on the calling thread (None).

    The first write that fails, by the time it fails, is the snapshot's failure: the writes not
    started by then are refused (:class:`NotWritten`), and those refusals are never the error
    reported, whatever order the writes were submitted in."""

    def __init__(self, store: Store, pool: Optional[ThreadPoolExecutor], staging: str) -> None:
        self._store = store
        self._staging = staging
        self.pool = pool
        #: whether nothing reads a payload's buffers once submit() returns: written at once, or
        #: the store's ``start_payload`` has copied them (local disk: into the page cache)
        self.copies = pool is None or store.start_payload_copies
        self._pending: list[Future[Written]] = []
        self._done: list[Written] = []
        #: the exception submit() raised, if any: a failure to store, not to encode
        self.failed: Optional[BaseException] = None
        #: the first write that failed: the writes not started yet are not made (a storage that
        #: stopped answering then costs the writes in flight, not every file of the snapshot)
        self._broken: Optional[BaseException] = None
        self._lock = threading.Lock()


    def submit(self, payload: Payload) -> None:
        try:
            self._check_broken()
            self._submit(payload)
        except BaseException as exc:
            self._note(exc)
            self.failed = exc
            raise

    def _note(self, exc: BaseException) -> None:
        """Keep ``exc`` as the failure of this snapshot's writes unless one failed before it."""
        if isinstance(exc, NotWritten):
            return
        with self._lock:
            if self._broken is None:
                self._broken = exc

    def _check_broken(self) -> None:
        broken = self._broken
        if broken is not None:
            raise NotWritten(
                f"not written: an earlier write of this snapshot failed ({type(broken).__name__})"
            ) from broken

    def _on_pool(self, fn: Callable[..., T], *args: Any, must_run: bool = False) -> Future[T]:
        """``fn(*args)`` on an I/O thread, unless a write has failed by the time it starts
        (``must_run``: even then, it releases what was started)."""

        def run() -> T:
            if not must_run:
                self._check_broken()
            try:
                return fn(*args)
            except BaseException as exc:
                self._note(exc)
                raise

        assert self.pool is not None
        return self.pool.submit(run)

    def _submit(self, payload: Payload) -> None:
        store, staging = self._store, self._staging
        if self.pool is None:
            self._done.append(write_one(store, staging, payload))
        elif payload.packed:
            # A pack (at most pack_bytes of small tensors): hashed and handed to the store here,
            # on the planning thread; an I/O thread only waits for the disk (store.start_payload).
            rel = payload.rel
            checksum = record_views(payload.views, payload.bounds)
            with writing(store, staging, rel):
                finish = store.start_payload(staging, rel, payload.views)
            result = (rel, sum(v.nbytes for v in payload.views), checksum)

            def complete() -> Written:  # holds no buffer of the pack
                with writing(store, staging, rel):
                    finish()
                return result

            # a store that began the write (local disk: an open file) must finish it
            self._pending.append(self._on_pool(complete, must_run=store.start_payload_copies))
        else:  # a file of its own: written (and hashed as it is written) on an I/O thread
            self._pending.append(self._on_pool(write_one, store, staging, payload))

    def finish(self) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        """Wait for every write; the files' sizes and checksum records. Raises the first write
        that failed (by the time it failed), once all writes have ended."""
        wait(self._pending)
        if self._broken is not None:
            raise self._broken
        for future in self._pending:
            self._done.append(future.result())
        sizes: dict[str, int] = {}
        sums: dict[str, dict[str, Any]] = {}
        for rel, size, checksum in self._done:
            sizes[rel] = size
            sums[rel] = checksum
        return sizes, sums


class NotWritten(SnapshotWriteError):
    """A write refused because an earlier write of the same snapshot failed: a consequence,
    never the failure reported (:meth:`PayloadWrites.finish` raises the earlier one)."""

    consequence = True  # distributed.is_consequence


@contextlib.contextmanager
def writing(store: Store, staging: str, rel: str) -> Iterator[None]:
    """A store's failure to write file ``rel`` as a SnapshotWriteError naming it."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotWriteError(
            f"writing {rel} of {store.child(staging)} failed: {type(exc).__name__}: {exc}"
        ) from exc


__all__ = ["DEFAULT_IO_THREADS", "NotWritten", "PayloadWrites", "io_pool", "write_one", "writing"]
