"""tnt_snapshot_plugin: crash-safe, asynchronous checkpoints in torchsnapshot's format for torchtnt and Lightning.

The core (this package) is framework-neutral: it never imports torchtnt or Lightning. The adapters
live in :mod:`tnt_snapshot_plugin.adapters.torchtnt` and :mod:`tnt_snapshot_plugin.adapters.lightning`.

Importing this package is cheap: torch loads only when a saver or restore runs; torchsnapshot never.
"""

from __future__ import annotations

from typing import Any

from tnt_snapshot_plugin.errors import (
    CleanupWarning,
    ConfigError,
    DataLoaderReplayWarning,
    DistributedError,
    ImplicitResumeWarning,
    InterruptedCommitWarning,
    KeyCollisionError,
    LockWarning,
    MetricsWarning,
    MonitorNotLoggedWarning,
    NothingToRestoreWarning,
    OutOfSpaceWarning,
    PartialRestoreWarning,
    ProgressOnlyWarning,
    SnapshotBusyWarning,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotFailedWarning,
    SnapshotFallbackWarning,
    SnapshotNotFoundError,
    SnapshotsAheadWarning,
    SnapshotSkippedWarning,
    SnapshotWarning,
    SnapshotWriteError,
    StateMismatchError,
    StorageUnavailableError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.hooks import hookimpl
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.plugins_name import PROJECT_NAME

try:  # the version lives in one place, setup.cfg; the installed distribution's metadata carries it
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("tnt-snapshot-plugin")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CleanupWarning",
    "ImplicitResumeWarning",
    "LockWarning",
    "MetricsWarning",
    "MonitorNotLoggedWarning",
    "OutOfSpaceWarning",
    "PartialRestoreWarning",
    "SnapshotWarning",
    "PROJECT_NAME",
    "ConfigError",
    "DataLoaderReplayWarning",
    "DistributedError",
    "InterruptedCommitWarning",
    "KeyCollisionError",
    "NothingToRestoreWarning",
    "ProgressOnlyWarning",
    "SnapshotConfig",
    "SnapshotCorruptError",
    "SnapshotBusyWarning",
    "SnapshotError",
    "SnapshotFailedWarning",
    "SnapshotFallbackWarning",
    "SnapshotSkippedWarning",
    "SnapshotsAheadWarning",
    "SnapshotName",
    "SnapshotNotFoundError",
    "SnapshotWriteError",
    "Snapshotter",
    "StateMismatchError",
    "StorageUnavailableError",
    "UnrestorableStateError",
    "hookimpl",
    "latest_snapshot",
    "restore",
    "restore_from_latest",
]

_LAZY = {
    "SnapshotConfig": ("config", "SnapshotConfig"),
    "Snapshotter": ("saving.saver", "Snapshotter"),
    "latest_snapshot": ("restoring", "latest_snapshot"),
    "restore": ("restoring", "restore"),
    "restore_from_latest": ("restoring", "restore_from_latest"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
