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
from typing import Any, Callable, Iterable, Optional, Union

import pluggy
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import EntryPoint, State
from torchtnt.framework.unit import EvalUnit, PredictUnit, TrainUnit

from tnt_snapshot_plugin.adapters.torchtnt import restore as torchtnt_restore
from tnt_snapshot_plugin.adapters.torchtnt.options import saver_config
from tnt_snapshot_plugin.adapters.torchtnt.restore import (
    EVAL_PROGRESS_KEY,
    TRAIN_PROGRESS_KEY,
    take_restored_rng,
)
from tnt_snapshot_plugin.adapters.torchtnt.state import (
    collector,
    not_started,
    unit_metric,
    unit_metric_logger,
    unit_state,
    warn_progress_only,
)
from tnt_snapshot_plugin.app_state import RNGState
from tnt_snapshot_plugin.config import DEFAULT_STORAGE_TIMEOUT_S
from tnt_snapshot_plugin.distributed import require_process_group
from tnt_snapshot_plugin.saving.saver import Snapshotter

__all__ = ["EVAL_PROGRESS_KEY", "TRAIN_PROGRESS_KEY", "TorchSnapshotSaver"]


class TorchSnapshotSaver(Callback):
    """Periodically snapshot a torchtnt unit's whole training state, in torchsnapshot's format
    (or DCP's: ``format="dcp"``).

    The snapshot holds the unit's tracked modules, optimizers, LR schedulers, progress (train and,
    under ``fit()``, eval) and other stateful attributes, the RNG state (torch CPU and CUDA,
    Python, numpy), and the train dataloader's state when the loader has
    ``state_dict``/``load_state_dict`` (at epoch ends too, so a loader that reshuffles by epoch
    resumes exactly). Snapshots are written to
    ``dirpath/epoch_{epoch}_step_{step}`` (``step``: train steps completed across all epochs;
    after an eval epoch under ``fit()``: ``..._eval_{eval steps completed}``),
    asynchronously by default, and become visible to restore only once complete.

    Every keyword argument of torchtnt 0.2.4's ``TorchSnapshotSaver`` is accepted with its meaning;
    the others are this plugin's.

    Args:
        dirpath: parent directory of the snapshots (local path, ``file://`` or ``s3://``). Under
            torch.distributed only rank 0's counts; the other ranks may pass anything, ``""`` too.
        save_every_n_train_steps: snapshot every N train steps (None: no mid-epoch snapshots).
        save_every_n_epochs: snapshot every N epochs (None: no epoch-end snapshots).
        save_every_n_eval_epochs: under ``fit()``, snapshot after every N eval epochs (None: none).
        keep_last_n_checkpoints: delete older snapshots once a newer one is committed
            (``keep_last_n_snapshots`` is this plugin's name for it). With
            ``best_checkpoint_config``: keep the N best by the metric instead.
        best_checkpoint_config: torchtnt's ``BestCheckpointConfig(monitored_metric, mode)``: the
            unit's attribute ``monitored_metric`` is read when a snapshot is taken (a number or
            one-element tensor; None: the snapshot is saved without it) and the name carries it
            (``epoch_E_step_S_<metric>=<value>``). With ``keep_last_n_checkpoints=N`` the N best
            by it are kept (``mode`` "min" or "max"; NaN ranks worst; an equal value does not
            replace an older one), and the newest snapshot until a newer one is committed;
            snapshots without a value are never deleted. A unit without the attribute, or a
            value that is not a number, raises ConfigError at the first snapshot.
        process_group: ranks taking part (default: all); collectives run on a gloo group of their own.
        async_checkpoint: write in the background; training waits only for an in-memory copy
            (default True; ``async_snapshot`` is this plugin's name for it).
        save_every_n_seconds: snapshot at the first train step end after N seconds of training
            since train start or since the last snapshot of any cadence (rank 0's clock; under
            torch.distributed every rank snapshots a few steps later, together: see docs/torchtnt.md).
            Combines with the step and epoch cadences: any of them due takes a snapshot.
        replicated: glob patterns of entries identical on every rank (``["**"]``: all but the
            progress, RNG and dataloader entries), saved once instead of once per rank.
        storage_options: options of the storage (for ``s3://``: ``endpoint_url``,
            ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``).
        knob_options: torchtnt's ``KnobOptions``: ``max_per_rank_io_concurrency`` caps the file
            writes one rank has in flight (and, at restore, reads);
            ``enable_storage_optimization`` is ignored, as torchtnt 0.2.4 ignores it (a no-op
            reserved for future use there).
        save_on_train_end: take a final snapshot when training ends (unless already saved).
        on_save_error: ``"warn"`` (default: training goes on; a failure warns once per cause until
            a snapshot succeeds, later ones are logged at INFO) or ``"raise"`` (the next hook
            raises SnapshotWriteError).
        preemption_signals: on these signals, finish the step, snapshot, then exit as the signal
            asks (default ``[SIGTERM]``; ``[]`` disables).
        collective_timeout_s: how long a checkpoint collective waits for a failed rank.
        storage_timeout_s: the longest training waits on the storage at a due snapshot (default
            60 s): a step or epoch snapshot whose previous snapshot is still being written after
            that long is skipped (SnapshotSkippedWarning, ``snapshot/skipped`` in the metrics),
            and each request to an object store gives up within it, retries included.
        plugin_manager: the pluggy manager whose hooks apply (default: a new one for this saver,
            with the entry-point plugins; add more with :meth:`register`).
        metric_logger: a torchtnt ``MetricLogger`` (``torchtnt.utils.loggers``) that receives
            each committed snapshot's figures (``snapshot/stall_s``, ``snapshot/durable_s``,
            ``snapshot/bytes_written``, ``snapshot/write_MBps``, ...; see
            :mod:`tnt_snapshot_plugin.metrics`) with ``log_dict`` on rank 0. Default: the unit's
            ``metric_logger`` or ``logger`` attribute, if it has ``log_dict``.
        weights_only: True (default): before each snapshot is written, check that restore can
            load every object in it with ``torch.load(weights_only=True)`` and the plugin's safe
            globals; if not, raise UnrestorableStateError naming the entry and type (whatever
            ``on_save_error`` says). False: no check; restore these snapshots with
            ``weights_only=False`` (full pickle: trusted snapshots only).
        save_policies: more reasons to snapshot, beside the cadences above: objects with
            ``should_save(moment) -> bool`` (:mod:`tnt_snapshot_plugin.policies`: ``EveryNSteps``,
            ``EveryNEpochs``, ``EveryNSeconds``, ... or your own); a snapshot is taken when any
            says so.
        preservation_policies: more snapshots to keep, beside ``keep_last_n_checkpoints`` and
            best-k: objects with ``keep(ours) -> set of names`` (``policies.KeepEveryNSteps(10_000)``,
            ``policies.KeepOnePerNHours(6)``, or your own); a snapshot any policy keeps is kept, and
            retention never deletes the newest snapshot nor one the plugin did not write.
        format: the on-disk format: ``"torchsnapshot"`` (default: what torchsnapshot and torchtnt's
            ``TorchSnapshotSaver`` read) or ``"dcp"`` (``torch.distributed.checkpoint``'s: what
            ``dcp.load`` and torchtnt's ``DistributedCheckpointSaver.restore`` read). Restore reads
            either, whichever this saver writes.

    Under torch.distributed the constructor is a collective: it broadcasts rank 0's ``dirpath``.
    Initialise the process group first: with ``WORLD_SIZE`` > 1 in the environment and none
    initialised, the constructor raises ConfigError.
    """

    def __init__(
        self,
        dirpath: str,
        *,
        save_every_n_train_steps: Optional[int] = None,
        save_every_n_epochs: Optional[int] = None,
        save_every_n_eval_epochs: Optional[int] = None,
        keep_last_n_checkpoints: Optional[int] = None,
        process_group: Optional[Any] = None,
        async_checkpoint: Optional[bool] = None,
        save_every_n_seconds: Optional[float] = None,
        replicated: Optional[list[str]] = None,
        storage_options: Optional[dict[str, Any]] = None,
        knob_options: Optional[Any] = None,
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
        best_checkpoint_config: Optional[Any] = None,
        save_policies: Optional[Iterable[Any]] = None,
        preservation_policies: Optional[Iterable[Any]] = None,
        format: Any = "torchsnapshot",
    ) -> None:
        require_process_group("constructing the saver")
        self._metric_logger = metric_logger
        config = saver_config(
            best_checkpoint_config, keep_last_n_checkpoints, keep_last_n_snapshots,
            save_every_n_train_steps=save_every_n_train_steps, save_every_n_epochs=save_every_n_epochs,
            save_every_n_eval_epochs=save_every_n_eval_epochs, save_every_n_seconds=save_every_n_seconds,
            replicated=replicated, storage_options=storage_options, knob_options=knob_options,
            async_snapshot=async_snapshot, async_checkpoint=async_checkpoint,
            save_on_train_end=save_on_train_end, on_save_error=on_save_error,
            preemption_signals=preemption_signals, collective_timeout_s=collective_timeout_s,
            storage_timeout_s=storage_timeout_s,
            save_policies=save_policies, preservation_policies=preservation_policies,
            format=format,
        )
        self._snapshotter = snapshotter = Snapshotter(
            dirpath,
            config,
            process_group=process_group,
            plugin_manager=plugin_manager,
            weights_only=weights_only,
            metric=self._monitored_value if config.best is not None else None,
        )
        self._trigger = snapshotter.trigger  # read at every train step end
        # What on_train_start prepared, and for which (state, unit): the hooks may also be
        # called directly, without on_train_start (as torchtnt's saver allows).
        self._state: Optional[State] = None
        self._unit: Any = None
        self._train_progress: Any = None
        self._collect: Callable[[bool], dict[str, Any]] = not_started
        self._rng_after_first_fetch: Optional[dict[str, Any]] = None
        self._warned_progress_only = False

    @property
    def dirpath(self) -> str:
        """Parent directory the snapshots are saved to."""
        return self._snapshotter.dirpath

    def _monitored_value(self) -> Optional[tuple[str, float]]:
        """(metric, value) read from the unit now (a snapshot is being taken), or None."""
        best = self._snapshotter.config.best
        assert best is not None
        return unit_metric(self._unit, best.metric)

    @property
    def snapshotter(self) -> Snapshotter:
        """The framework-neutral engine (stats, wait(), the plugin manager)."""
        return self._snapshotter

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register a plugin on this saver only, checked at once (:meth:`Snapshotter.register`)."""
        return self._snapshotter.register(plugin, name)

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver."""
        self._snapshotter.unregister(plugin)

    def on_train_start(self, state: State, unit: TrainUnit[Any]) -> None:
        """Validate there is no key collision in the app state; prepare for preemption."""
        self._start(state, unit)

    def _start(self, state: State, unit: TrainUnit[Any]) -> None:
        # Read once per run, so a step that does not snapshot only reads two counters.
        self._state, self._unit = state, unit
        self._train_progress = unit.train_progress
        self._collect = collector(state, unit)
        progress = unit.train_progress
        keys = unit_state(unit).keys()
        self._snapshotter.train_start(keys, progress.num_epochs_completed, progress.num_steps_completed)
        if not self._warned_progress_only:
            self._warned_progress_only = warn_progress_only(unit, keys, self._snapshotter)
        # the staging buffers of asynchronous snapshots, allocated and touched before training
        self._snapshotter.prepare(lambda: unit_state(unit))
        metric_logger = self._metric_logger if self._metric_logger is not None else unit_metric_logger(unit)
        if metric_logger is not None:
            self._snapshotter.report_metrics(lambda metrics, step: metric_logger.log_dict(metrics, step))
        restored = take_restored_rng(unit)
        if restored is not None and unit.train_progress.num_steps_completed_in_epoch > 0:
            # Resuming mid-epoch: the snapshot's RNG state was captured after a step, when the
            # loader's iterator had long started (and drawn its DataLoader base seed... from the
            # global RNG). torchtnt starts the iterator again after the restore and calls no hook
            # between iter() and the first next(): set the state again after the first fetch.
            self._rng_after_first_fetch = restored
            after_first_fetch(unit, self._reset_rng)

    def _reset_rng(self) -> None:
        """(First batch of a mid-epoch resume) undo the RNG draws of the loader's new iterator."""
        rng, self._rng_after_first_fetch = self._rng_after_first_fetch, None
        if rng is not None:  # None: the run this was for ended before its first batch
            RNGState().load_state_dict(rng)

    def _started(self, state: State, unit: Any) -> None:
        if self._unit is not unit or self._state is not state:
            self._start(state, unit)

    def on_train_step_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Snapshot if the step cadence (or a plugin) says so; a no-op step costs microseconds."""
        if self._unit is not unit or self._state is not state:
            self._start(state, unit)  # called without on_train_start (or for another unit)
        progress = self._train_progress
        step = progress.num_steps_completed
        if self._trigger.quiet(step):
            return  # nothing to do at this step (saving.trigger: the step gate)
        self._snapshotter.step_end(progress.num_epochs_completed, step, self._collect)

    def on_train_epoch_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Snapshot if the epoch cadence (or a plugin) says so."""
        self._started(state, unit)
        progress = unit.train_progress
        self._snapshotter.epoch_end(
            progress.num_epochs_completed, progress.num_steps_completed, self._collect
        )

    def on_eval_epoch_end(self, state: State, unit: EvalUnit[Any]) -> None:
        """Under ``fit()``, snapshot if the eval-epoch cadence (or a plugin) says so.

        An eval run on its own (``evaluate()``) has no training to resume: nothing is saved.
        """
        train_progress = getattr(unit, "train_progress", None)
        if state.entry_point != EntryPoint.FIT or train_progress is None:
            return
        self._started(state, unit)
        eval_progress = unit.eval_progress
        self._snapshotter.eval_epoch_end(
            train_progress.num_epochs_completed,
            train_progress.num_steps_completed,
            eval_progress.num_epochs_completed,
            eval_progress.num_steps_completed,
            self._collect,
        )

    def on_train_end(self, state: State, unit: TrainUnit[Any]) -> None:
        """Take a final snapshot unless the last state is already saved; wait until it is durable."""
        self._started(state, unit)
        progress = unit.train_progress
        try:
            self._snapshotter.train_end(
                progress.num_epochs_completed, progress.num_steps_completed, self._collect
            )
        finally:
            self._state = self._unit = None  # the next run starts afresh
            self._collect = not_started
            self._rng_after_first_fetch = None

    def on_exception(
        self,
        state: State,
        unit: Union[TrainUnit[Any], EvalUnit[Any], PredictUnit[Any]],
        exc: BaseException,
    ) -> None:
        """Wait for the pending snapshot; the newest complete snapshot stays intact."""
        self._rng_after_first_fetch = None
        self._snapshotter.exception()

    restore = staticmethod(torchtnt_restore.restore)
    restore_from_latest = staticmethod(torchtnt_restore.restore_from_latest)
    restore_from_best = staticmethod(torchtnt_restore.restore_from_best)


def after_first_fetch(unit: TrainUnit[Any], then: Callable[[], None]) -> None:
    """Call ``then`` right after ``unit`` fetches its next train batch, once.

    torchtnt dispatches a per-batch hook (``on_train_get_next_batch_end``) to a callback whose
    class overrides it, decided when ``train`` starts, before any hook shows the saver the unit;
    an override would cost every batch of every run a call. Instead the unit's own
    ``get_next_train_batch`` is wrapped, on the instance, until its first call.
    """
    own = unit.__dict__.get("get_next_train_batch")  # an instance attribute of the user's, kept
    fetch = unit.get_next_train_batch

    def fetch_then(state: State, data_iter: Any) -> Any:
        try:
            batch = fetch(state, data_iter)
        finally:
            if own is None:
                unit.__dict__.pop("get_next_train_batch", None)
            else:
                unit.get_next_train_batch = own  # type: ignore[method-assign]
        then()
        return batch

    unit.get_next_train_batch = fetch_then  # type: ignore[method-assign]
