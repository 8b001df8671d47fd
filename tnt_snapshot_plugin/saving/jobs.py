"""One snapshot being written: the job, the runner that writes, waits for and reaps it, its record,
its failure message.

The write runs on one worker thread (:class:`Worker`, a ``concurrent.futures`` executor with one
worker, kept for the run): the training thread submits the job and learns its outcome from the
job's future at the next hook. A synchronous snapshot runs the same function on the training
thread and keeps its outcome in a future too, so both are reaped alike.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from tnt_snapshot_plugin.errors import (
    SnapshotBusyWarning,
    SnapshotError,
    SnapshotFailedWarning,
    SnapshotSkippedWarning,
    SnapshotWriteError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.naming import SnapshotName

logger = logging.getLogger("tnt_snapshot_plugin.saving.saver")


@dataclass
class Job:
    """One snapshot being written."""

    name: SnapshotName
    path: str
    staging: str
    frozen: dict[str, Any]
    #: which entries are the same on every rank: (the ``replicated`` globs, the keys of DDP
    #: modules, the keys never so), for the format to resolve
    replicas: tuple[Optional[list[str]], tuple[str, ...], tuple[str, ...]]
    #: the write's outcome: its exception, or None once it committed
    future: Optional[Future] = None
    #: what to warn about at the reap, on the training thread: (category, message)
    warnings: list[tuple[type[Warning], str]] = field(default_factory=list)
    stall_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    durable_s: float = 0.0
    waited_s: float = 0.0
    bytes_written: int = 0
    #: the staged state dicts' source tensors, let go of on the writer thread (Stager.take_sources)
    sources: Any = None
    #: set while a write is tried again after older snapshots were deleted early to make room
    #: (retaining.FreedEarly.failed): its failure says so, instead of "Older snapshots are intact"
    freed_early: Optional[str] = None

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


def failure_message(path: str, name: SnapshotName, exc: BaseException, freed_early: Optional[str] = None) -> str:
    """What a failed snapshot is reported as (raised or warned, as ``on_save_error`` says);
    ``freed_early``: what became of the older snapshots deleted to make room for it (Job)."""
    return (
        f"snapshot {path} (epoch {name.epoch}, step {name.step}) failed and was not committed: "
        f"{type(exc).__name__}: {exc}. {freed_early or 'Older snapshots are intact.'}"
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
            if value.is_meta:
                return path, value, NotImplementedError("a tensor on the meta device has no data to save")
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


#: SnapshotBusyWarning's threshold: training's waits for snapshots still being written, added up
#: over the run, are more than this many seconds ...
BUSY_WARNING_S = 1.0
#: ... and more than this share of the run's time since train start (a wait a user notices).
BUSY_WARNING_SHARE = 0.1
#: The cause of a skip, and of a failure whose error (or its cause) is an OSError: the storage.
STORAGE_CAUSE = "storage"


def failure_cause(exc: BaseException) -> str:
    """What a failed snapshot is warned about once per (until a snapshot commits again): the
    storage (a full disk, an endpoint down or not answering: an OSError anywhere in the
    exception's chain), or else the type of the chain's first error."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    root = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return STORAGE_CAUSE
        seen.add(id(current))
        root = current
        current = current.__cause__ or current.__context__
    return f"{type(root).__module__}.{type(root).__qualname__}"


class JobRunner:
    """The saver's one snapshot in flight: submitting it (to the writer thread, or written on the
    spot), waiting for it (bounded by ``storage_timeout_s`` for the cadences' snapshots), skipping
    a due one while it is stuck, reaping its outcome (the ``snapshot_committed`` hook, or the
    failure, raised or warned as ``on_save_error`` says), and the figures of it all (:attr:`stats`).

    Warnings: a failure or skip warns once per cause until a snapshot commits again (later ones
    are counted and logged at INFO); waiting for snapshots still being written warns at most once
    per run, past ``BUSY_WARNING_S`` and ``BUSY_WARNING_SHARE``.

    ``child(name)``: the user-facing path of snapshot ``name``; ``committed(path, epoch, step,
    record)``: called on the training thread for each snapshot committed; ``on_change()``: called
    whenever a snapshot starts or stops being pending."""

    def __init__(
        self,
        config: Any,
        child: Callable[[str], str],
        committed: Callable[[str, int, int, SnapshotRecord], None],
        on_change: Callable[[], None],
    ) -> None:
        self._config = config
        self._child = child
        self._committed = committed
        self._on_change = on_change
        #: the one thread that writes asynchronous snapshots
        self._worker = Worker()
        self.stats = SnapshotStats()
        #: the snapshot being written (None: none)
        self.pending: Optional[Job] = None
        #: how long training waited for the previous snapshot before the next one (Job.waited_s)
        self.waited_s = 0.0
        self.start_run()

    def start_run(self) -> None:
        """A run starts (train start): its waits, warnings and storage budget from zero."""
        self._run_started = time.perf_counter()
        #: training's waits for snapshots still being written in this run, in seconds
        self._run_busy_s = 0.0
        self._busy_warned = False
        #: how long training has waited for writes at due snapshots since the last commit: at
        #: most ``storage_timeout_s`` (then due snapshots are skipped while a write is pending)
        self._blocked_s = 0.0
        self._since_commit_reset()

    def _since_commit_reset(self) -> None:
        """A snapshot committed (or a run starts): failures and skips warn again."""
        #: the causes warned about since the last commit (failure_cause; a skip's is the storage)
        self._warned_causes: set[str] = set()
        self._failed_since_commit = 0
        self._skipped_since_commit = 0

    def _since_commit(self) -> str:
        return f"{self._failed_since_commit} failed and {self._skipped_since_commit} skipped since the last commit"

    def storage_failing(self) -> None:
        """The storage failed outside a snapshot (at train start) and was warned about: its
        failures until a snapshot commits are logged, not warned again."""
        self._warned_causes.add(STORAGE_CAUSE)

    # -- running ------------------------------------------------------------------------------

    def _set_pending(self, job: Optional[Job]) -> None:
        self.pending = job
        self._on_change()

    def submit(self, job: Job, write: Callable[[Job], None], *, background: bool, started: float) -> None:
        """Write ``job``: on the writer thread (``background``), or now, reaping it at once (its
        stall then counts the write too, from ``started``, a ``time.perf_counter()``)."""
        self._set_pending(job)
        if background:
            self._worker.submit(job, write)
        else:
            self._worker.run_here(job, write)
            job.stall_s = time.perf_counter() - started
            self.reap()

    def close(self) -> None:
        """Let the writer thread go (nothing is pending); a later snapshot starts a new one."""
        self._worker.close()

    def skip(self, name: SnapshotName) -> None:
        """The due snapshot ``name`` is not taken: a write is still pending, and training has
        waited ``storage_timeout_s`` for writes since the last commit. The storage is the cause:
        one warning (skip or failure) until a snapshot commits again; every skip is counted
        (``stats.skipped``, ``snapshot/skipped`` in the metrics) and logged at INFO."""
        job = self.pending
        assert job is not None
        self.stats.skipped += 1
        self._skipped_since_commit += 1
        path = self._child(name.text)
        if STORAGE_CAUSE in self._warned_causes:
            logger.info("snapshot %s skipped: snapshot %s is still being written (%s)", path, job.path, self._since_commit())
            return
        self._warned_causes.add(STORAGE_CAUSE)
        warnings.warn(
            f"snapshot {path} (epoch {name.epoch}, step {name.step}) was skipped: snapshot "
            f"{job.path} is still being written ({time.perf_counter() - job.started:.1f}s so far) "
            f"and training has waited {self._blocked_s:.1f}s for the storage since the last "
            f"commit, the most storage_timeout_s={self._config.storage_timeout_s:g} allows; the "
            "storage is slow or not answering. Training goes on: until a snapshot commits again, "
            "a snapshot due while a write is pending is skipped without waiting, and skips and "
            "storage failures are counted (snapshot/skipped in the snapshot metrics) and logged "
            "at INFO, not warned. Older snapshots are intact",
            SnapshotSkippedWarning,
            stacklevel=5,
        )

    def fail(self, name: SnapshotName, exc: BaseException) -> None:
        """Snapshot ``name`` failed before its write started: raise or warn, as ``on_save_error`` says."""
        self._report_failure(failure_message(self._child(name.text), name, exc), exc, stacklevel=6)

    def _report_failure(self, message: str, exc: BaseException, stacklevel: int) -> None:
        """Count a failed snapshot; raise it, or warn once per cause until a snapshot commits
        again (INFO after that), as ``on_save_error`` says."""
        self.stats.failures += 1
        if self._config.on_save_error == "raise":
            raise SnapshotWriteError(message) from exc
        self._failed_since_commit += 1
        cause = failure_cause(exc)
        if cause in self._warned_causes:
            logger.info("%s (%s)", message, self._since_commit())
            return
        self._warned_causes.add(cause)
        warnings.warn(
            f"{message} Until a snapshot commits again, further failures of this cause are "
            "counted and logged at INFO, not warned.",
            SnapshotFailedWarning,
            stacklevel=stacklevel,
        )

    def wait(self, *, warn_busy: bool = False, raise_errors: bool = True, timeout: Optional[float] = None) -> bool:
        """Block until the pending snapshot (if any) is committed or failed, and reap it.

        ``timeout``: wait no longer than that, counting every such wait since the last commit
        (False: it is still being written; nothing is reaped). None: as long as it takes."""
        job = self.pending
        if job is None:
            self.waited_s = 0.0  # nothing to wait for: the next snapshot waited for none
            return True
        busy = warn_busy and not job.done
        started = time.perf_counter()
        if timeout is None:
            job.wait()
        else:
            done = job.wait(max(0.0, timeout - self._blocked_s))
            self._blocked_s += time.perf_counter() - started
            if not done:
                return False
        self.waited_s = 0.0
        if busy:
            self._note_busy_wait(job, time.perf_counter() - started)
        if raise_errors:
            self.reap()
        else:
            try:
                self.reap()
            except SnapshotError as exc:
                logger.error("tnt_snapshot_plugin: %s", exc)
        return True

    def _note_busy_wait(self, job: Job, waited: float) -> None:
        """Training waited for a snapshot still being written: count it every time; warn once per
        run when the run's waits add up to more than BUSY_WARNING_S and BUSY_WARNING_SHARE. A wait
        for a write that failed, or while the storage is failing (warned since the last commit),
        is the failure's to report, not added up here."""
        self.stats.busy_waits += 1
        self.stats.busy_wait_s += waited
        self.waited_s = waited  # recorded with the snapshot about to be taken
        logger.debug("snapshot %s was still being written; training waited %.3fs for it", job.name, waited)
        if job.error is not None or STORAGE_CAUSE in self._warned_causes:
            return
        self._run_busy_s += waited
        elapsed = time.perf_counter() - self._run_started
        if self._busy_warned or self._run_busy_s <= BUSY_WARNING_S or self._run_busy_s <= BUSY_WARNING_SHARE * elapsed:
            return
        self._busy_warned = True
        warnings.warn(
            f"training has waited {self._run_busy_s:.1f}s for snapshots still being written "
            f"({self._run_busy_s / max(elapsed, 1e-9):.0%} of the {elapsed:.1f}s since train "
            f"start; the latest wait, for {job.name}, {waited:.2f}s): snapshots are due more often "
            "than the storage writes them; snapshot less often. Every wait is counted in the "
            "snapshot metrics (snapshot/busy_waits, snapshot/waited_s) and logged at DEBUG",
            SnapshotBusyWarning,
            stacklevel=5,
        )

    def reap_if_done(self) -> None:
        """Reap the pending snapshot if its write is over (its outcome reported as below)."""
        if self.pending is not None and self.pending.done:
            self.reap()

    def reap(self) -> None:
        """The pending snapshot's outcome, its write over: the ``snapshot_committed`` hook and its
        record, or the failure reported (UnrestorableStateError always raised)."""
        job = self.pending
        if job is None:
            return
        self._set_pending(None)
        for category, message in job.warnings:
            warnings.warn(message, category, stacklevel=4)
        error = job.error
        if isinstance(error, UnrestorableStateError):
            # Not a storage failure that a later snapshot may not meet: every snapshot of this
            # state would be unrestorable, so training stops whatever on_save_error says.
            self.stats.failures += 1
            raise error
        if error is not None:
            self._report_failure(failure_message(job.path, job.name, error, job.freed_early), error, stacklevel=5)
            return
        if self._warned_causes:
            logger.info("snapshot %s committed: snapshots succeed again (%s)", job.path, self._since_commit())
        self._blocked_s = 0.0  # the storage answers: a new budget of waits
        self._since_commit_reset()
        record = SnapshotRecord(
            job.path,
            job.name.epoch,
            job.name.step,
            job.stall_s,
            job.durable_s,
            bytes_written=job.bytes_written,
            waited_s=job.waited_s,
            busy_waits=self.stats.busy_waits,
            skipped=self.stats.skipped,
        )
        self.stats.committed.append(record)
        from tnt_snapshot_plugin.metrics import log_line

        logger.info("%s", log_line(record))
        self._committed(job.path, job.name.epoch, job.name.step, record)
