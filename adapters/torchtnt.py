"""The torchtnt adapter: a drop-in replacement for torchtnt's ``TorchSnapshotSaver``.

Switch with one import line::

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

    saver = TorchSnapshotSaver("/ckpts/run1", save_every_n_train_steps=100, save_every_n_epochs=1)
    train(unit, dataloader, max_epochs=10, callbacks=[saver])

    # later, in a new process
    TorchSnapshotSaver.restore_from_latest("/ckpts/run1", unit, train_dataloader=dataloader)
"""

from __future__ import annotations

import signal
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import pluggy
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.unit import AppStateMixin, EvalUnit, PredictUnit, TrainUnit

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.app_state import TRAIN_DATALOADER_KEY, check_collisions, is_stateful
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.snapshotter import Snapshotter

TRAIN_PROGRESS_KEY = "train_progress"
EVAL_PROGRESS_KEY = "eval_progress"


class TorchSnapshotSaver(Callback):
    """Periodically snapshot a torchtnt unit's whole training state with torchsnapshot.

    The snapshot holds the unit's tracked modules, optimizers, LR schedulers, progress (train and,
    under ``fit()``, eval) and other stateful attributes, the RNG state (torch CPU and CUDA,
    Python, numpy), and the train dataloader's state when the loader has
    ``state_dict``/``load_state_dict`` (at epoch ends too, so a loader that reshuffles by epoch
    resumes exactly). Snapshots are written to
    ``dirpath/epoch_{epoch}_step_{step}`` (``step``: train steps completed across all epochs),
    asynchronously by default, and become visible to restore only once complete.

    Args:
        dirpath: parent directory of the snapshots (local path, ``file://`` or ``s3://``).
        save_every_n_train_steps: snapshot every N train steps (None: no mid-epoch snapshots).
        save_every_n_epochs: snapshot every N epochs (None: no epoch-end snapshots).
        replicated: glob patterns of entries identical on every rank (``["**"]``: all but the
            progress, RNG and dataloader entries), saved once instead of once per rank.
        storage_options: options of the storage (for ``s3://``: ``endpoint_url``,
            ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``).
        keep_last_n_snapshots: delete older snapshots once a newer one is committed
            (``keep_last_n_checkpoints`` is accepted as torchtnt's name for it).
        async_snapshot: write in the background; training waits only for an in-memory copy.
        save_on_train_end: take a final snapshot when training ends (unless already saved).
        on_save_error: ``"warn"`` (default: training goes on, every hook warns until a snapshot
            succeeds) or ``"raise"`` (the next hook raises SnapshotWriteError).
        preemption_signals: on these signals, finish the step, snapshot, then exit as the signal
            asks (default ``[SIGTERM]``; ``[]`` disables).
        process_group: ranks taking part (default: all); collectives run on a gloo group of their own.
        collective_timeout_s: how long a checkpoint collective waits for a failed rank.
        plugin_manager: the pluggy manager whose hooks apply (default: the process-wide one).

    Under torch.distributed the constructor is a collective: it broadcasts rank 0's ``dirpath``.
    """

    def __init__(
        self,
        dirpath: str,
        *,
        save_every_n_train_steps: Optional[int] = None,
        save_every_n_epochs: Optional[int] = None,
        replicated: Optional[list[str]] = None,
        storage_options: Optional[dict[str, Any]] = None,
        keep_last_n_snapshots: Optional[int] = None,
        keep_last_n_checkpoints: Optional[int] = None,
        async_snapshot: bool = True,
        save_on_train_end: bool = True,
        on_save_error: str = "warn",
        preemption_signals: Iterable[Union[int, signal.Signals]] = (signal.SIGTERM,),
        process_group: Optional[Any] = None,
        collective_timeout_s: float = 600.0,
        plugin_manager: Optional[pluggy.PluginManager] = None,
    ) -> None:
        config = SnapshotConfig.build(
            save_every_n_train_steps=save_every_n_train_steps,
            save_every_n_epochs=save_every_n_epochs,
            keep_last_n_snapshots=keep_last_n_snapshots,
            keep_last_n_checkpoints=keep_last_n_checkpoints,
            replicated=replicated,
            storage_options=storage_options,
            async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end,
            on_save_error=on_save_error,
            preemption_signals=preemption_signals,
            collective_timeout_s=collective_timeout_s,
        )
        self._snapshotter = Snapshotter(
            dirpath, config, process_group=process_group, plugin_manager=plugin_manager
        )
        self._train_progress: Any = None
        self._collect: Callable[[bool], dict[str, Any]] = _not_started

    @property
    def dirpath(self) -> str:
        """Parent directory the snapshots are saved to."""
        return self._snapshotter.dirpath

    @property
    def snapshotter(self) -> Snapshotter:
        """The framework-neutral engine (stats, wait(), the plugin manager)."""
        return self._snapshotter

    def on_train_start(self, state: State, unit: TrainUnit[Any]) -> None:
        """Validate there is no key collision in the app state; prepare for preemption."""
        # Read once per run, so a step that does not snapshot only reads two counters.
        self._train_progress = unit.train_progress
        self._collect = _collector(state, unit)
        progress = unit.train_progress
        self._snapshotter.train_start(
            _unit_state(unit).keys(), progress.num_epochs_completed, progress.num_steps_completed
        )

    def on_train_step_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Snapshot if the step cadence (or a plugin) says so; a no-op step costs microseconds."""
        progress = self._train_progress
        self._snapshotter.step_end(
            progress.num_epochs_completed, progress.num_steps_completed, self._collect
        )

    def on_train_epoch_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Snapshot if the epoch cadence (or a plugin) says so."""
        progress = unit.train_progress
        self._snapshotter.epoch_end(
            progress.num_epochs_completed, progress.num_steps_completed, _collector(state, unit)
        )

    def on_train_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Take a final snapshot unless the last state is already saved; wait until it is durable."""
        progress = unit.train_progress
        self._snapshotter.train_end(
            progress.num_epochs_completed, progress.num_steps_completed, _collector(state, unit)
        )

    def on_exception(
        self,
        state: State,
        unit: Union[TrainUnit[Any], EvalUnit[Any], PredictUnit[Any]],
        exc: BaseException,
    ) -> None:
        """Wait for the pending snapshot; the newest complete snapshot stays intact."""
        self._snapshotter.exception()

    @staticmethod
    def restore(
        path: str,
        unit: AppStateMixin,
        *,
        train_dataloader: Optional[Any] = None,
        restore_train_progress: bool = True,
        restore_eval_progress: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        process_group: Optional[Any] = None,
        strict: bool = True,
        collective_timeout_s: float = 600.0,
        plugin_manager: Optional[pluggy.PluginManager] = None,
    ) -> None:
        """Restore the snapshot at ``path`` into ``unit`` (and ``train_dataloader``, if given).

        ``restore_train_progress`` / ``restore_eval_progress``: whether to load the progress
        entries. Raises SnapshotNotFoundError if ``path`` is not a complete snapshot, and
        StateMismatchError if the unit's modules do not match it.
        """
        app_state, optional = _restore_state(
            unit, train_dataloader, restore_train_progress, restore_eval_progress
        )
        with Collectives.create(process_group, collective_timeout_s, for_restore=True) as collectives:
            restoring.restore(
                path,
                app_state,
                optional_keys=optional,
                storage_options=storage_options,
                collectives=collectives,
                plugin_manager=plugin_manager,
                strict=strict,
            )

    @staticmethod
    def restore_from_latest(
        dirpath: str,
        unit: AppStateMixin,
        *,
        train_dataloader: Optional[Any] = None,
        restore_train_progress: bool = True,
        restore_eval_progress: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        process_group: Optional[Any] = None,
        strict: bool = True,
        fallback: bool = True,
        collective_timeout_s: float = 600.0,
        plugin_manager: Optional[pluggy.PluginManager] = None,
    ) -> bool:
        """Restore the newest complete snapshot in ``dirpath``.

        Returns True if one was restored, False if ``dirpath`` is missing, empty or holds no
        complete snapshot. A damaged newest snapshot is skipped with a warning and the previous
        one restored (``fallback=False`` raises SnapshotCorruptError instead); if snapshots exist
        but none can be read, SnapshotCorruptError is raised rather than returning False.
        Under torch.distributed rank 0's ``dirpath`` is used and rank 0 picks the snapshot.
        """
        app_state, optional = _restore_state(
            unit, train_dataloader, restore_train_progress, restore_eval_progress
        )
        with Collectives.create(process_group, collective_timeout_s, for_restore=True) as collectives:
            restored = restoring.restore_from_latest(
                dirpath,
                app_state,
                optional_keys=optional,
                storage_options=storage_options,
                collectives=collectives,
                plugin_manager=plugin_manager,
                strict=strict,
                fallback=fallback,
            )
        return restored is not None


def _not_started(intra_epoch: bool) -> dict[str, Any]:
    raise RuntimeError(
        "TorchSnapshotSaver.on_train_start was not called before a snapshot was due; pass the "
        "saver in train()/fit()'s callbacks, which call its hooks in order"
    )


def _unit_state(unit: AppStateMixin) -> dict[str, Any]:
    return dict(unit.app_state())


def _collector(state: State, unit: AppStateMixin) -> Callable[[bool], dict[str, Any]]:
    def collect(intra_epoch: bool) -> dict[str, Any]:
        # The loader's state is saved at epoch ends too (torchtnt's saver only saves it mid-epoch):
        # a loader that reshuffles by epoch would otherwise replay the first epoch's order.
        app_state = _unit_state(unit)
        if state.train_state is not None:
            loader = state.train_state.dataloader
            if is_stateful(loader):
                app_state[TRAIN_DATALOADER_KEY] = loader
        return app_state

    return collect


def _restore_state(
    unit: AppStateMixin,
    train_dataloader: Optional[Any],
    restore_train_progress: bool,
    restore_eval_progress: bool,
) -> tuple[dict[str, Any], tuple[str, ...]]:
    app_state = _unit_state(unit)
    check_collisions(app_state.keys())
    if not restore_train_progress:
        app_state.pop(TRAIN_PROGRESS_KEY, None)
    if not restore_eval_progress:
        app_state.pop(EVAL_PROGRESS_KEY, None)
    optional: tuple[str, ...] = (EVAL_PROGRESS_KEY,)
    if train_dataloader is not None:
        if is_stateful(train_dataloader):
            app_state[TRAIN_DATALOADER_KEY] = train_dataloader
            optional += (TRAIN_DATALOADER_KEY,)
        else:
            warnings.warn(
                "train_dataloader was passed to restore but has no state_dict/load_state_dict; "
                "its position cannot be restored",
                stacklevel=3,
            )
    return app_state, optional

