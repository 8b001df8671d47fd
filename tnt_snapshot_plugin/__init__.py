"""tnt_snapshot_plugin: crash-safe, asynchronous checkpoints for torchtnt and Lightning, in torchsnapshot's
format or DCP's (``torch.distributed.checkpoint``).

The core (this package) is framework-neutral: it never imports torchtnt or Lightning. The adapters
live in :mod:`tnt_snapshot_plugin.adapters.torchtnt` and :mod:`tnt_snapshot_plugin.adapters.lightning`.

What users import is here: the core saver (:class:`Snapshotter`, configured by
:class:`SnapshotConfig`), the restores (:class:`RestoreRequest`, :func:`restore`,
:func:`restore_from_latest`, :func:`latest_snapshot`, :func:`best_snapshot`), the save and
preservation policies, the errors and warnings, the ``hookimpl`` marker, the :class:`Store`
protocol with :func:`open_store`, the :class:`Format` protocol with :func:`register_format`, and
the fakes for tests (:mod:`tnt_snapshot_plugin.testing`).

Importing this package is cheap: torch loads only when a saver or restore runs; torchsnapshot never.
"""

from __future__ import annotations

from typing import Any

from tnt_snapshot_plugin.config import Best, Knobs, SnapshotConfig
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
    PassedOverWarning,
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
from tnt_snapshot_plugin.hookspecs import PROJECT_NAME
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import (
    AnyPreservation,
    AnySave,
    BestN,
    EveryNEpochs,
    EveryNEvalEpochs,
    EveryNSeconds,
    EveryNSteps,
    KeepEveryNSteps,
    KeepOnePerNHours,
    LatestN,
    Moment,
    PreservationPolicy,
    SavePolicy,
)

try:  # the version lives in one place, setup.cfg; the installed distribution's metadata carries it
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("tnt-snapshot-plugin")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

#: Names imported when first used: each of their modules imports numpy or torch.
_LAZY = {
    "Snapshotter": ("saving.saver", "Snapshotter"),
    "RestoreRequest": ("restoring", "RestoreRequest"),
    "best_snapshot": ("restoring", "best_snapshot"),
    "latest_snapshot": ("restoring", "latest_snapshot"),
    "restore": ("restoring", "restore"),
    "restore_from_latest": ("restoring", "restore_from_latest"),
    "Store": ("stores", "Store"),
    "open_store": ("stores", "open_store"),
    "Format": ("format.base", "Format"),
    "register_format": ("format.registry", "register_format"),
    "testing": ("testing", None),
}

__all__ = [
    # the core saver and its configuration
    "Snapshotter",
    "SnapshotConfig",
    "Knobs",
    "SnapshotName",
    # restores
    "RestoreRequest",
    "restore",
    "restore_from_latest",
    "latest_snapshot",
    "best_snapshot",
    # save decisions
    "Moment",
    "SavePolicy",
    "EveryNSteps",
    "EveryNEpochs",
    "EveryNEvalEpochs",
    "EveryNSeconds",
    "AnySave",
    # preservation
    "PreservationPolicy",
    "LatestN",
    "Best",
    "BestN",
    "KeepEveryNSteps",
    "KeepOnePerNHours",
    "AnyPreservation",
    # storage
    "Store",
    "open_store",
    # on-disk formats
    "Format",
    "register_format",
    # plugins
    "PROJECT_NAME",
    "hookimpl",
    # fakes for tests
    "testing",
    # errors
    "SnapshotError",
    "ConfigError",
    "DistributedError",
    "KeyCollisionError",
    "SnapshotCorruptError",
    "SnapshotNotFoundError",
    "SnapshotWriteError",
    "StateMismatchError",
    "StorageUnavailableError",
    "UnrestorableStateError",
    # warnings
    "SnapshotWarning",
    "CleanupWarning",
    "DataLoaderReplayWarning",
    "ImplicitResumeWarning",
    "InterruptedCommitWarning",
    "LockWarning",
    "MetricsWarning",
    "MonitorNotLoggedWarning",
    "NothingToRestoreWarning",
    "OutOfSpaceWarning",
    "PartialRestoreWarning",
    "PassedOverWarning",
    "ProgressOnlyWarning",
    "SnapshotBusyWarning",
    "SnapshotFailedWarning",
    "SnapshotFallbackWarning",
    "SnapshotSkippedWarning",
    "SnapshotsAheadWarning",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(f"{__name__}.{module_name}")
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
