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
    """Issued at every hook after a failed snapshot until a snapshot succeeds again."""


class SnapshotSkippedWarning(SnapshotFailedWarning):
    """A due snapshot was not taken: the previous one was still being written after training had
    waited ``storage_timeout_s`` for it (the storage answers slowly or not at all). Issued once
    per stuck write; every snapshot skipped is counted (``snapshot/skipped`` in the metrics)."""


class SnapshotBusyWarning(UserWarning):
    """A snapshot was due while the previous one was still being written, and training waited
    for it: snapshots are due more often than the storage writes them. Issued once per saver and
    run; later waits are counted (``snapshot/busy_waits`` in the metrics) and logged at DEBUG.
    Filter it like any warning: ``warnings.filterwarnings("ignore", category=SnapshotBusyWarning)``."""


class SnapshotsAheadWarning(UserWarning):
    """A run starts in a dirpath holding snapshots ahead of its own progress (another, longer
    run's); this run's snapshots are ordered after them by commit. Issued once per saver."""
