"""A drop-in replacement for torchtnt's ``DistributedCheckpointSaver``: the plugin's saver with
DCP's format (``torch.distributed.checkpoint``) fixed, torchtnt 0.2.4's constructor and its
``restore`` / ``restore_from_latest`` / ``restore_from_best``.

Switch with one import line::

    from tnt_snapshot_plugin.adapters.torchtnt import DistributedCheckpointSaver

    saver = DistributedCheckpointSaver("/ckpts/run1", save_every_n_train_steps=100)
    train(unit, dataloader, max_epochs=10, callbacks=[saver])

    # later, in a new process
    DistributedCheckpointSaver.restore_from_latest("/ckpts/run1", unit, train_dataloader=dataloader)
"""

from __future__ import annotations

import os
import signal
from typing import Any, Iterable, Optional, Union

import pluggy
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.unit import AppStateMixin, EvalUnit, PredictUnit, TrainUnit

from tnt_snapshot_plugin.adapters.torchtnt import restore as torchtnt_restore
from tnt_snapshot_plugin.adapters.torchtnt.saver import TorchSnapshotSaver
from tnt_snapshot_plugin.config import DEFAULT_STORAGE_TIMEOUT_S
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.saving.saver import Snapshotter

__all__ = ["DistributedCheckpointSaver"]


class DistributedCheckpointSaver(Callback):
    """Periodically snapshot a torchtnt unit's whole training state in DCP's format
    (``torch.distributed.checkpoint``), which ``dcp.load`` and torchtnt's own
    ``DistributedCheckpointSaver.restore`` read.

    torchtnt 0.2.4's ``DistributedCheckpointSaver`` arguments keep their meanings: snapshots of
    the unit's tracked state, its progress and the train dataloader's state are saved to
    ``dirpath/epoch_{epoch}_step_{step}``, synchronously unless ``async_checkpoint=True``.
    Underneath it is :class:`TorchSnapshotSaver` with ``format="dcp"``: the same commit (a
    snapshot becomes visible only once complete), retention, RNG state, fallback and every other
    keyword argument of the plugin's (``save_every_n_seconds``, ``storage_options``,
    ``on_save_error``, ...; see :class:`TorchSnapshotSaver`). docs/torchtnt.md lists where it
    differs from torchtnt's.

    Args:
        dirpath: parent directory of the snapshots (local path, ``file://``, ``s3://`` or an
            fsspec URL). Under torch.distributed only rank 0's counts.
        save_every_n_train_steps: snapshot every N train steps (None: no mid-epoch snapshots).
        save_every_n_epochs: snapshot every N epochs (None: no epoch-end snapshots).
        save_every_n_eval_epochs: under ``fit()``, snapshot after every N eval epochs.
        keep_last_n_checkpoints: keep the N newest snapshots (with ``best_checkpoint_config``:
            the N best), deleting older ones once a newer one is committed.
        best_checkpoint_config: torchtnt's ``BestCheckpointConfig(monitored_metric, mode)``.
        process_group: ranks taking part (default: all); collectives run on a gloo group.
        async_checkpoint: write in the background, training waiting only for an in-memory copy
            (default False, as torchtnt's DCP saver).
        knob_options: torchtnt's ``KnobOptions``: ``max_per_rank_io_concurrency`` caps the
            files one rank writes (and, at restore, reads) at once.
        plugin options: every other keyword argument of :class:`TorchSnapshotSaver`, except
            ``format``.
    """

    #: The file whose presence makes a checkpoint complete (torchtnt's class attribute).
    metadata_fname: Optional[str] = ".metadata"

    def __init__(
        self,
        dirpath: str,
        *,
        save_every_n_train_steps: Optional[int] = None,
        save_every_n_epochs: Optional[int] = None,
        save_every_n_eval_epochs: Optional[int] = None,
        keep_last_n_checkpoints: Optional[int] = None,
        best_checkpoint_config: Optional[Any] = None,
        process_group: Optional[Any] = None,
        async_checkpoint: Optional[bool] = None,
        knob_options: Optional[Any] = None,
        save_every_n_seconds: Optional[float] = None,
        replicated: Optional[list[str]] = None,
        storage_options: Optional[dict[str, Any]] = None,
        keep_last_n_snapshots: Optional[int] = None,
        async_snapshot: Optional[bool] = None,
        save_on_train_end: bool = True,
        on_save_error: str = "warn",
        preemption_signals: Iterable[Union[int, signal.Signals]] = (signal.SIGTERM,),
        collective_timeout_s: float = 600.0,
        storage_timeout_s: float = DEFAULT_STORAGE_TIMEOUT_S,
        plugin_manager: Optional[pluggy.PluginManager] = None,
        metric_logger: Optional[Any] = None,
        weights_only: bool = True,
        save_policies: Optional[Iterable[Any]] = None,
        preservation_policies: Optional[Iterable[Any]] = None,
    ) -> None:
        if async_checkpoint is None and async_snapshot is None:
            async_checkpoint = False  # torchtnt's DCP saver writes synchronously by default
        self._saver = TorchSnapshotSaver(
            dirpath,
            save_every_n_train_steps=save_every_n_train_steps,
            save_every_n_epochs=save_every_n_epochs,
            save_every_n_eval_epochs=save_every_n_eval_epochs,
            keep_last_n_checkpoints=keep_last_n_checkpoints,
            best_checkpoint_config=best_checkpoint_config,
            process_group=process_group,
            async_checkpoint=async_checkpoint,
            knob_options=knob_options,
            save_every_n_seconds=save_every_n_seconds,
            replicated=replicated,
            storage_options=storage_options,
            keep_last_n_snapshots=keep_last_n_snapshots,
            async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end,
            on_save_error=on_save_error,
            preemption_signals=preemption_signals,
            collective_timeout_s=collective_timeout_s,
            storage_timeout_s=storage_timeout_s,
            plugin_manager=plugin_manager,
            metric_logger=metric_logger,
            weights_only=weights_only,
            save_policies=save_policies,
            preservation_policies=preservation_policies,
            format="dcp",
        )

    @property
    def dirpath(self) -> str:
        """Parent directory the snapshots are saved to."""
        return self._saver.dirpath

    @property
    def snapshotter(self) -> Snapshotter:
        """The framework-neutral engine (stats, wait(), the plugin manager)."""
        return self._saver.snapshotter

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register a plugin on this saver only, checked at once (:meth:`Snapshotter.register`)."""
        return self._saver.register(plugin, name)

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver."""
        self._saver.unregister(plugin)

    # -- torchtnt's hooks: the saver's ------------------------------------------------------------

    def on_train_start(self, state: State, unit: TrainUnit[Any]) -> None:
        """Validate there is no key collision in the app state; prepare for preemption."""
        self._saver.on_train_start(state, unit)

    def on_train_step_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Snapshot if the step cadence (or a plugin) says so."""
        self._saver.on_train_step_end(state, unit)

    def on_train_epoch_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Snapshot if the epoch cadence (or a plugin) says so."""
        self._saver.on_train_epoch_end(state, unit)

    def on_eval_epoch_end(self, state: State, unit: EvalUnit[Any]) -> None:
        """Under ``fit()``, snapshot if the eval-epoch cadence (or a plugin) says so."""
        self._saver.on_eval_epoch_end(state, unit)

    def on_train_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Take a final snapshot unless the last state is already saved; wait until it is durable."""
        self._saver.on_train_end(state, unit)

    def on_exception(
        self,
        state: State,
        unit: Union[TrainUnit[Any], EvalUnit[Any], PredictUnit[Any]],
        exc: BaseException,
    ) -> None:
        """Wait for the pending snapshot; the newest complete snapshot stays intact."""
        self._saver.on_exception(state, unit, exc)

    # -- torchtnt's restores -------------------------------------------------------------------

    @staticmethod
    def restore(
        path: str,
        unit: AppStateMixin,
        *,
        planner: Optional[Any] = None,
        storage_reader: Optional[Any] = None,
        **options: Any,
    ) -> None:
        """Restore the snapshot at ``path`` into ``unit`` (torchtnt 0.2.4's signature).

        ``planner``: a DCP ``LoadPlanner`` (DCP's ``DefaultLoadPlanner`` or a subclass) that plans
        the tensor reads (see :meth:`DcpReader.plan_with`); one that overrides ``load_bytes``,
        ``create_global_plan`` or ``finish_plan``, which restore never calls, raises ConfigError.
        ``storage_reader``: restore reads through the plugin's own stores, which check every
        record against the snapshot's index; a stock ``FileSystemReader`` or local
        ``FsspecReader`` of ``path`` itself reads the same files and is accepted, any other
        raises ConfigError (pass ``storage_options`` for S3 instead). Every other argument
        (``train_dataloader``, ``process_group``, ``restore_options``, ``knob_options``,
        ``storage_options``, ``strict``, ...) is :meth:`TorchSnapshotSaver.restore`'s.
        """
        check_storage_reader(storage_reader, path, "restore")
        torchtnt_restore.restore(path, unit, planner=planner, **options)

    @classmethod
    def restore_from_latest(
        cls,
        dirpath: str,
        unit: AppStateMixin,
        *,
        planner: Optional[Any] = None,
        storage_reader: Optional[Any] = None,
        **options: Any,
    ) -> bool:
        """Restore the newest complete snapshot in ``dirpath`` (torchtnt 0.2.4's signature):
        True if one was restored, False (with a NothingToRestoreWarning) if there is none.

        Candidates are the plugin's snapshots and other tools' checkpoints (torchtnt's savers',
        torchtitan's ``step-N``); see :meth:`TorchSnapshotSaver.restore_from_latest`.
        ``planner``: as :meth:`restore`. ``storage_reader`` names one checkpoint and raises
        ConfigError: pass ``storage_options`` for the dirpath's store instead.
        """
        check_storage_reader(storage_reader, None, "restore_from_latest")
        return torchtnt_restore.restore_from_latest(dirpath, unit, planner=planner, **options)

    @classmethod
    def restore_from_best(
        cls,
        dirpath: str,
        unit: AppStateMixin,
        metric_name: str,
        mode: str,
        *,
        planner: Optional[Any] = None,
        storage_reader: Optional[Any] = None,
        **options: Any,
    ) -> bool:
        """Restore the best complete snapshot in ``dirpath`` by ``metric_name`` (``mode`` "min"
        or "max"; torchtnt 0.2.4's signature); see :meth:`TorchSnapshotSaver.restore_from_best`.
        ``planner`` and ``storage_reader``: as :meth:`restore_from_latest`."""
        check_storage_reader(storage_reader, None, "restore_from_best")
        return torchtnt_restore.restore_from_best(dirpath, unit, metric_name, mode, planner=planner, **options)


def check_storage_reader(storage_reader: Any, path: Optional[str], method: str) -> None:
    """ConfigError for a ``storage_reader`` that restore cannot honour: anything but None, or
    (for :meth:`DistributedCheckpointSaver.restore` of ``path``) a stock DCP ``FileSystemReader``
    or local ``FsspecReader`` of ``path`` itself, which reads the files the plugin reads."""
    if storage_reader is None:
        return
    if path is not None and _reads_path(storage_reader, path):
        return
    what = f"a {type(storage_reader).__name__}"
    if path is None:
        raise ConfigError(
            f"storage_reader is not accepted by {method}: a StorageReader names one checkpoint, and "
            f"{method} chooses among the dirpath's; pass the dirpath (with storage_options for S3) "
            f"and storage_reader=None, or restore the checkpoint by path (got {what})"
        )
    raise ConfigError(
        f"storage_reader must be None, or torch's FileSystemReader or local FsspecReader of {path} "
        f"itself: restore reads checkpoints through the plugin's stores, which check every record "
        f"against the checkpoint's index (got {what}); pass the checkpoint's path or URL, with "
        "storage_options for S3, and storage_reader=None"
    )


def _reads_path(reader: Any, path: str) -> bool:
    """Whether ``reader`` is a stock DCP reader of local checkpoint ``path``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if type(reader) is FsspecReader:
        protocol = getattr(getattr(reader.fs, "fs", None), "protocol", None)
        if not (protocol == "file" or (isinstance(protocol, tuple) and "file" in protocol)):
            return False
    elif type(reader) is not FileSystemReader:
        return False
    if not path:
        return True  # a rank other than 0, whose path is rank 0's
    mine, theirs = _local(path), _local(os.fspath(reader.path))
    return mine is not None and mine == theirs


def _local(path: str) -> Optional[str]:
    """A local path (or ``file://`` URL) as its real path; None for any other URL."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif "://" in path:
        return None
    return os.path.realpath(path)
