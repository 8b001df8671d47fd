"""The plugin's error hierarchy.

Every error this library raises on purpose is a :class:`SnapshotError`. Each also derives from
the built-in exception that callers of the original torchtnt saver already catch
(``ValueError`` for bad arguments, ``RuntimeError`` for key collisions), so switching to this
plugin does not break existing ``except`` clauses.
"""

from __future__ import annotations


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
    """Writing a snapshot failed; the snapshot was not committed and older snapshots are intact."""


class DistributedError(SnapshotError, RuntimeError):
    """Another rank failed in a checkpoint collective; raised on every rank instead of hanging."""


class SnapshotFailedWarning(UserWarning):
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


class SnapshotBusyWarning(UserWarning):
    """Training has waited for snapshots still being written (snapshots are due more often than
    the storage writes them) more than a user notices: in all more than ``job.BUSY_WARNING_S``
    (1 s) and more than ``job.BUSY_WARNING_SHARE`` (10 %) of the run's time since train start
    (waits for writes that failed, or while the storage is failing, are the failure's).
    Issued at most once per run; every wait is counted (``snapshot/busy_waits``,
    ``snapshot/waited_s`` in the metrics) and logged at DEBUG."""


class SnapshotsAheadWarning(UserWarning):
    """A run starts in a dirpath holding snapshots ahead of its own progress (another, longer
    run's); this run's snapshots are ordered after them by commit. Issued once per saver."""


class NothingToRestoreWarning(UserWarning):
    """A restore of the latest (or best) snapshot found none to restore, so training starts from
    the beginning; the message names the dirpath and what it holds (nothing, no such directory,
    other tools' checkpoints, incomplete snapshots). Issued once per restore, on rank 0."""


class SnapshotFallbackWarning(UserWarning):
    """restore_from_latest skipped the newest snapshot (damaged: the file and the problem named)
    and restored an older one; or, after such a fallback, put back an optional entry the older
    snapshot lacks. One line per snapshot skipped."""


class InterruptedCommitWarning(SnapshotFallbackWarning):
    """On an object store, the newest snapshot's commit was interrupted (its index was written,
    its ``.snapshot_metadata`` never was): nothing committed is lost, and the newest complete
    snapshot before it is restored. Local disk leaves nothing visible at the same point."""


class DataLoaderReplayWarning(UserWarning):
    """A mid-epoch snapshot was restored, but the train dataloader's position was not (the loader
    passed has no ``state_dict``/``load_state_dict``): the resumed epoch starts again at its first
    batch; the message says how many batches that adds. Issued after the snapshot is chosen."""


class ProgressOnlyWarning(UserWarning):
    """The unit tracks nothing but its progress (no modules, optimizers, LR schedulers or other
    stateful attributes), so its snapshots cannot resume its training. Issued once per saver."""
