"""The plugin's error hierarchy.

Every error this library raises on purpose is a :class:`SnapshotError`. Each also derives from
the built-in exception that callers of the original torchtnt saver already catch
(``ValueError`` for bad arguments, ``RuntimeError`` for key collisions), so switching to this
plugin does not break existing ``except`` clauses.
"""

from __future__ import annotations

import errno
from typing import Iterator, Optional

#: The ``errno`` values that mean the storage has no room left: a full disk (ENOSPC) or a used-up
#: quota (EDQUOT, where the platform has it).
NO_SPACE_ERRNOS = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code is not None)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is the storage running out of space."""
    return any(isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS for e in causes(exc))


class SnapshotError(Exception):
    """Base class of every error raised by tnt_snapshot_plugin."""


class ConfigError(SnapshotError, ValueError):
    """An argument has a value the plugin cannot work with; raised before any work is done."""


class KeyCollisionError(SnapshotError, RuntimeError):
    """Two entries of the application state would be saved under the same key."""


class SnapshotNotFoundError(SnapshotError, FileNotFoundError):
    """A path given to restore does not exist or holds no complete snapshot."""


class StateMismatchError(SnapshotError, RuntimeError):
    """The objects to restore into do not match what the snapshot holds (keys, shapes, dtypes)."""


class SnapshotCorruptError(SnapshotError, RuntimeError):
    """A committed snapshot could not be read back (a truncated or damaged file)."""


class UnrestorableStateError(ConfigError):
    """The state holds a value that restore could not load (a type torch's ``weights_only``
    unpickler does not allow); raised by the saver before that snapshot is written, whatever
    ``on_save_error`` says."""


class StorageUnavailableError(SnapshotError, ConnectionError):
    """The storage could not be reached or refused the request (an object store's endpoint is
    down, the bucket is missing, the credentials are refused); the message names the URL."""


class SnapshotWriteError(SnapshotError, RuntimeError):
    """Writing a snapshot failed; it was not committed. The message names the first failure and
    what became of older snapshots: intact, unless a full disk with retention set made the save
    delete some early (named then)."""


def as_write_error(exc: BaseException, what: str) -> BaseException:
    """``exc``, met writing ``what`` (a snapshot), as the plugin's error: a SnapshotError as it
    is, anything else as a SnapshotWriteError naming ``what`` and caused by ``exc``."""
    if isinstance(exc, SnapshotError):
        return exc
    error = SnapshotWriteError(f"writing {what} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class DistributedError(SnapshotError, RuntimeError):
    """Another rank failed in a checkpoint collective; raised on every rank instead of hanging."""


class SnapshotWarning(UserWarning):
    """Base class of every warning tnt_snapshot_plugin issues: filter them all with
    ``warnings.filterwarnings("ignore", category=SnapshotWarning)``, or each by its own class."""


class SnapshotFailedWarning(SnapshotWarning):
    """A snapshot failed and was not committed (``on_save_error="warn"``); training goes on and
    older snapshots are intact. Issued once per cause until a snapshot commits again (the storage
    failing - a full disk, an endpoint down or not answering - is one cause; any other error is a
    cause by the type of the error that started it); every later failure is counted
    (``SnapshotStats.failures``) and logged at INFO."""


class SnapshotSkippedWarning(SnapshotFailedWarning):
    """A due snapshot was not taken: the previous one was still being written after training had
    waited ``storage_timeout_s`` for it (the storage answers slowly or not at all). The storage is
    the cause: one warning, for a skip or a failure, until a snapshot commits again; every
    snapshot skipped is counted (``snapshot/skipped`` in the metrics) and logged at INFO."""


class SnapshotBusyWarning(SnapshotWarning):
    """Training has waited for snapshots still being written (snapshots are due more often than
    the storage writes them) more than a user notices: in all more than ``job.BUSY_WARNING_S``
    (1 s) and more than ``job.BUSY_WARNING_SHARE`` (10 %) of the run's time since train start
    (waits for writes that failed, or while the storage is failing, are the failure's).
    Issued at most once per run; every wait is counted (``snapshot/busy_waits``,
    ``snapshot/waited_s`` in the metrics) and logged at DEBUG."""


class SnapshotsAheadWarning(SnapshotWarning):
    """A run starts in a dirpath holding snapshots ahead of its own progress (another, longer
    run's); this run's snapshots are ordered after them by commit. Issued once per saver."""


class NothingToRestoreWarning(SnapshotWarning):
    """A restore of the latest (or best) snapshot found none to restore, so training starts from
    the beginning; the message names the dirpath and what it holds (nothing, no such directory,
    other tools' checkpoints, incomplete snapshots). Issued once per restore, on rank 0."""


class PassedOverWarning(SnapshotWarning):
    """restore_from_latest (or Lightning's ``ckpt_path="last"``) passed over checkpoints of the
    dirpath that it cannot consider: a directory holding a format's metadata file under a name
    that orders nothing (neither the plugin's, torchtnt's nor torchtitan's), or one named as
    another tool's checkpoint without that tool's metadata file (nothing says it is complete)
    that would have been tried before the one restored. One line per restore, on rank 0, naming
    them."""


class SnapshotFallbackWarning(SnapshotWarning):
    """restore_from_latest skipped the newest snapshot (damaged: the file and the problem named)
    and restored an older one; or, after such a fallback, put back an optional entry the older
    snapshot lacks. One line per snapshot skipped."""


class InterruptedCommitWarning(SnapshotFallbackWarning):
    """On an object store, the newest snapshot's commit was interrupted (its index was written,
    its ``.snapshot_metadata`` never was): nothing committed is lost, and the newest complete
    snapshot before it is restored. Local disk leaves nothing visible at the same point."""


class DataLoaderReplayWarning(SnapshotWarning):
    """A mid-epoch snapshot was restored, but the train dataloader's position was not (the loader
    passed has no ``state_dict``/``load_state_dict``): the resumed epoch starts again at its first
    batch; the message says how many batches that adds. Issued after the snapshot is chosen."""


class ProgressOnlyWarning(SnapshotWarning):
    """The unit tracks nothing but its progress (no modules, optimizers, LR schedulers or other
    stateful attributes), so its snapshots cannot resume its training. Issued once per saver."""


class PartialRestoreWarning(SnapshotWarning):
    """A restore loaded less than it was given: an optional entry the snapshot lacks, an entry
    left as it is with ``strict=False``, or the per-rank RNG states of a snapshot restored on
    another world size. The message names what was not restored."""


class CleanupWarning(SnapshotWarning):
    """Something the plugin removes could not be removed, or retention could not list dirpath: a
    failed write, the leftover of an interrupted one, a snapshot retention deletes. No snapshot
    restore picks is affected; the next snapshot or run tries again."""


class OutOfSpaceWarning(SnapshotWarning):
    """dirpath ran out of space writing a snapshot: the snapshots retention deletes once it
    commits were deleted before its commit, and the write was tried again. Issued once per run
    (later ones logged at INFO)."""


class LockWarning(SnapshotWarning):
    """The run's hold on dirpath could not be kept: its S3 lease was taken over or removed, could
    not be read or written, or the store refuses the conditional writes a lease needs. The
    message says what became of the run's snapshots."""


class MetricsWarning(SnapshotWarning):
    """The sink given to report a committed snapshot's figures (a framework's logger) raised;
    training goes on, the figures of that snapshot are not logged."""


class MonitorNotLoggedWarning(SnapshotWarning):
    """(Lightning) ``monitor`` names a metric not logged yet and no validation has run: snapshots
    are saved without its value, unranked, until it is logged. Issued once per saver."""


class ImplicitResumeWarning(SnapshotWarning):
    """(Lightning) ``fit`` resumed from the newest snapshot although ``ckpt_path`` was not given:
    Lightning turns ``ckpt_path=None`` into ``"last"`` when an ``OnExceptionCheckpoint`` callback
    is present. The message names the snapshot."""
