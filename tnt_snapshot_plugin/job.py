"""One snapshot being written: the job, its background worker, its record, its failure message.

The write runs on one worker thread (:class:`Worker`, a ``concurrent.futures`` executor with one
worker, kept for the run): the training thread submits the job and learns its outcome from the
job's future at the next hook. A synchronous snapshot runs the same function on the training
thread and keeps its outcome in a future too, so both are reaped alike.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .errors import SnapshotError, UnrestorableStateError
from .naming import SnapshotName


@dataclass
class Job:
    """One snapshot being written."""

    name: SnapshotName
    path: str
    staging: str
    frozen: dict[str, Any]
    replicated: list[str]
    #: the write's outcome: its exception, or None once it committed
    future: Optional[Future] = None
    warnings: list[str] = field(default_factory=list)
    stall_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    durable_s: float = 0.0
    waited_s: float = 0.0
    bytes_written: int = 0
    #: the staged state dicts' source tensors, let go of on the writer thread (Stager.take_sources)
    sources: Any = None

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the write is over (at most ``timeout`` seconds); whether it is."""
        assert self.future is not None
        done, _ = concurrent.futures.wait([self.future], timeout=timeout)
        return bool(done)

    @property
    def error(self) -> Optional[BaseException]:
        """Why the write failed (None: committed); only once it is over."""
        assert self.future is not None
        return self.future.exception()


@dataclass(frozen=True)
class SnapshotRecord:
    """One committed snapshot: where, and what it cost."""

    path: str
    epoch: int
    step: int
    #: how long the training thread was blocked taking it
    stall_s: float
    #: from the start of the snapshot until it was committed (durable and visible)
    durable_s: float
    #: bytes of the files written (all ranks; the sum of the index's file sizes)
    bytes_written: int = 0
    #: how long training waited, before taking it, for the previous snapshot to be written
    waited_s: float = 0.0
    #: how many times training has waited for a snapshot still being written (this saver)
    busy_waits: int = 0
    #: how many due snapshots were skipped so far (this saver): the previous one was still being
    #: written after training had waited ``storage_timeout_s`` for it
    skipped: int = 0

    @property
    def write_bytes_per_s(self) -> float:
        """Bytes written per second, from the start of the snapshot until its commit."""
        return self.bytes_written / self.durable_s if self.durable_s > 0 else 0.0


@dataclass
class SnapshotStats:
    """Figures of the snapshots taken so far, for logs, the demo and the benchmark."""

    committed: list[SnapshotRecord] = field(default_factory=list)
    failures: int = 0
    #: times a snapshot was due while the previous one was still being written, and the total wait
    busy_waits: int = 0
    busy_wait_s: float = 0.0
    #: due snapshots skipped: the previous one still being written after ``storage_timeout_s``
    skipped: int = 0


class Worker:
    """Runs the writes of one saver, one at a time: asynchronous ones on its single worker thread
    (started at the first, kept until :meth:`close`), synchronous ones on the calling thread."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, job: Job, write: Callable[[Job], None]) -> None:
        """Start writing ``job`` in the background; its future tells the outcome."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tnt-snapshot-writer")
        job.future = self._pool.submit(_run, job, write)

    def run_here(self, job: Job, write: Callable[[Job], None]) -> None:
        """Write ``job`` now, on this thread; its future holds the outcome, as for :meth:`submit`."""
        future: Future = Future()
        try:
            _run(job, write)
        except BaseException as exc:  # reaped like a background write's
            future.set_exception(exc)
        else:
            future.set_result(None)
        job.future = future

    def close(self) -> None:
        """Let the worker thread go (nothing is pending); a later submit starts a new one."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def _run(job: Job, write: Callable[[Job], None]) -> None:
    try:
        write(job)
    finally:
        job.durable_s = time.perf_counter() - job.started


def failure_message(path: str, name: SnapshotName, exc: BaseException) -> str:
    """What a failed snapshot is reported as (raised or warned, as ``on_save_error`` says)."""
    return (
        f"snapshot {path} (epoch {name.epoch}, step {name.step}) failed and was not committed: "
        f"{type(exc).__name__}: {exc}. Older snapshots are intact."
    )


def uncopyable(name: SnapshotName, entries: Mapping[str, Any], exc: BaseException) -> Optional[UnrestorableStateError]:
    """UnrestorableStateError naming the first value of ``entries`` that cannot be copied for an
    asynchronous snapshot (``copy.deepcopy`` refuses it, as it refused when staging raised
    ``exc``); None if each copies on its own (``exc`` is then not the state's fault)."""
    if isinstance(exc, (SnapshotError, MemoryError)):
        return None
    for key, stateful in entries.items():
        try:
            state = stateful.state_dict()
        except Exception:
            return None  # the stateful's own state_dict() fails: its error is the one to see
        found = _first_uncopyable(key, state)
        if found is not None:
            path, value, cause = found
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            return UnrestorableStateError(
                f"snapshot {name}: the app-state entry {path!r} holds a {kind} that cannot "
                f"be copied for an asynchronous snapshot ({type(cause).__name__}: {cause}). "
                "Nothing was written, and training stops whatever on_save_error says: "
                "every snapshot of this state would fail the same way. Store it as tensors "
                "or plain values (numbers, strings, lists, dicts), or leave it out of the "
                "state_dict"
            )
    return None


def _first_uncopyable(key: str, state: Any) -> Optional[tuple[str, Any, Exception]]:
    """(path, value, error) of the first value under ``state`` that ``copy.deepcopy`` refuses."""
    import copy

    import torch

    stack: list[tuple[str, Any]] = [(key, state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, dict):
            stack.extend((f"{path}/{k}", v) for k, v in value.items())
        elif isinstance(value, list) or (isinstance(value, tuple) and not hasattr(value, "_fields")):
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(value))
        else:
            try:
                copy.deepcopy(value)
            except Exception as cause:
                return path, value, cause
    return None


def is_ddp(obj: Any) -> bool:
    """Whether ``obj`` is a DistributedDataParallel module (its entries are replicated)."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(obj, DistributedDataParallel)
