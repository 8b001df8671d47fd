"""The PyTorch Lightning adapter: one callback, and resume through Lightning's own ``ckpt_path``.

::

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    # ModelCheckpoint's arguments, with ModelCheckpoint's meanings
    saver = TorchSnapshotSaver("/ckpts/run1", monitor="val_loss", save_top_k=2, every_n_epochs=1)
    trainer = Trainer(max_epochs=10, callbacks=[saver])
    trainer.fit(model, datamodule=dm, ckpt_path="last")  # resumes if /ckpts/run1 holds a snapshot

What a snapshot holds: exactly the dict Lightning's own ``ModelCheckpoint`` would write at that
moment (``Trainer._checkpoint_connector.dump_checkpoint()``: weights, optimizers, LR schedulers,
the loops' progress with the train loader's state, every callback's state, the datamodule's and
the precision plugin's state, hyper-parameters, whatever ``on_save_checkpoint`` hooks add), one
entry per top-level key, plus the RNG state of every generator (Python, numpy, torch CPU and CUDA)
that Lightning's checkpoints lack. Each rank saves its own copy unless ``replicated`` says otherwise.

How ``fit(ckpt_path=...)`` reaches a snapshot:

* ``ckpt_path="last"``: Lightning resolves it, before any callback's ``setup``, from the last
  checkpoints that its ``ModelCheckpoint`` callbacks report (``_find_last_checkpoints``) and the
  ``ckpt_path`` of its ``OnExceptionCheckpoint`` callbacks. The saver is a ``ModelCheckpoint``
  (none of whose hooks it inherits); it reports the newest complete snapshot of ``dirpath``
  (damaged ones skipped). When several candidates exist (a ``ModelCheckpoint``'s ``last.ckpt``,
  say), Lightning takes the most recently modified one.
* ``ckpt_path=None`` (the default): training starts from scratch, as with ``ModelCheckpoint``.
  Only when another callback is an ``OnExceptionCheckpoint`` does Lightning turn ``None`` into
  ``"last"``; the saver then warns, in one line, which snapshot the run resumes from.
* ``ckpt_path="best"`` (``fit``, ``validate``, ``test``): Lightning reads the saver's
  ``best_model_path``, the best complete snapshot by ``monitor`` found in ``dirpath`` (without
  ``monitor``, the newest, as ``ModelCheckpoint``'s is then its newest checkpoint).
* In ``setup()`` the saver wraps the strategy's ``CheckpointIO`` in a :class:`SnapshotCheckpointIO`,
  which reads a snapshot directory into Lightning's checkpoint dict (and sets the RNG state) and
  hands every other path to the ``CheckpointIO`` it wraps, so ``ModelCheckpoint`` works as before.
  Lightning then restores that dict as it restores its own checkpoints. At ``teardown`` (or on
  an exception) the strategy's own ``CheckpointIO`` is put back.

This module is the callback itself: Lightning's events mapped onto the core's
:class:`~tnt_snapshot_plugin.saving.saver.Snapshotter`. The rest lives beside it, one job a module:
``lightning_options`` (``ModelCheckpoint``'s arguments, checked and mapped), ``lightning_engine``
(the Snapshotter, ``dirpath`` resolution, pickling for ``ddp_spawn``), ``lightning_best`` (best-k),
``lightning_resume`` (``ckpt_path``, the RNG around a resume), ``lightning_io`` (the CheckpointIO)
and ``lightning_restore`` (restores outside ``fit``).
"""

from __future__ import annotations

import datetime
import signal
from typing import Any, Callable, Iterable, Literal, Optional, Union

import pluggy
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from tnt_snapshot_plugin.adapters.lightning import restore as lightning_restore
from tnt_snapshot_plugin.adapters.lightning.best import BestSnapshots, MonitorNotFoundError
from tnt_snapshot_plugin.adapters.lightning.engine import NEVER_REPLICATED, Engine
from tnt_snapshot_plugin.adapters.lightning.io import Restored, SnapshotCheckpointIO, snapshot_path
from tnt_snapshot_plugin.adapters.lightning.options import (
    NOT_APPLICABLE,
    InvalidArgumentError,
    refuse_not_applicable,
    saver_config,
)
from tnt_snapshot_plugin.adapters.lightning.resume import Resume
from tnt_snapshot_plugin.app_state import Value, check_collisions
from tnt_snapshot_plugin.saving.saver import Snapshotter

__all__ = [
    "LIGHTNING_KEYS", "NEVER_REPLICATED", "NOT_APPLICABLE", "InvalidArgumentError", "MonitorNotFoundError",
    "Restored", "SnapshotCheckpointIO", "TorchSnapshotSaver", "snapshot_path",
]

#: The keys of every Lightning training checkpoint (others depend on the run).
LIGHTNING_KEYS = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "state_dict",
    "loops",
    "callbacks",
    "optimizer_states",
    "lr_schedulers",
)


class TorchSnapshotSaver(ModelCheckpoint):
    """Snapshot a Lightning run's whole training state in torchsnapshot's format; resume it exactly.

    Use it when a run must survive crashes and preemption without losing more than a few steps,
    and without stalling training while a checkpoint is written. It takes ``ModelCheckpoint``'s
    arguments with ``ModelCheckpoint``'s meanings (the differences are listed below and in
    docs/lightning.md), so replacing ``ModelCheckpoint(...)`` by ``TorchSnapshotSaver(...)`` is the switch.
    Snapshots are written to ``dirpath/epoch_{epoch}_step_{step}`` (``epoch``: epochs completed;
    ``step``: ``trainer.global_step``, the optimizer steps taken), asynchronously by default, and
    become visible to restore only once complete. Resume with a new Trainer holding a saver on the
    same ``dirpath``: ``trainer.fit(model, ckpt_path="last")`` (the newest complete snapshot) or
    ``ckpt_path="<dirpath>/epoch_E_step_S"``. ``trainer.fit(model)`` without ``ckpt_path``
    trains from scratch, as with ``ModelCheckpoint``.

    Args:
        dirpath: parent directory of the snapshots (local path, ``file://`` or ``s3://``). None
            (default): as ``ModelCheckpoint``, resolved at ``setup``:
            ``<logger save_dir>/<name>/<version>/checkpoints`` with a logger, else
            ``<trainer.default_root_dir>/checkpoints``.
        monitor: a logged metric (``trainer.callback_metrics``, read when a snapshot is taken)
            that ranks the snapshots, as ``ModelCheckpoint``'s ``monitor``; ``"epoch"`` and
            ``"step"`` are always available (``trainer.current_epoch`` / ``trainer.global_step``
            unless logged). The name carries it (``epoch_E_step_S_<monitor>=<value>``: letters,
            digits, ``_``, ``.`` and ``/``, a ``/`` written ``%2F`` there, as in
            ``..._val%2Floss=0.25``) and ``best_model_path`` / ``best_model_score`` /
            ``ckpt_path="best"`` follow it. A metric not logged yet when a snapshot is taken
            before any validation ran is warned about and the snapshot saved without it; once
            validation has run, it is a :class:`MonitorNotFoundError`.
        verbose: log a line through Lightning's logger for each committed snapshot.
        save_last: accepted for ``ModelCheckpoint`` compatibility (None, True, False or
            ``"link"``): ``ckpt_path="last"`` always resolves to the newest complete snapshot,
            which retention never deletes; no ``last`` copy or link is written.
        save_top_k: with ``monitor``: keep the k best snapshots (default 1; -1: keep every one;
            NaN ranks worst; an equal value does not replace an older one). Without ``monitor``:
            1 keeps the newest snapshot only, -1 (or None, the default) keeps every one. 0
            (``ModelCheckpoint``: save nothing) is refused. With ``keep_last_n_snapshots`` the
            newest n are kept too. The newest snapshot, and the one the run resumed from, are
            always kept.
        mode: ``"min"`` (default) or ``"max"``: whether a lower or a higher value is better.
        every_n_train_steps: snapshot when ``trainer.global_step`` reaches a multiple of N (0 or
            None: no mid-epoch snapshots). ``global_step`` counts optimizer steps: with
            ``accumulate_grad_batches=K`` one step per K batches (and one at the end of an epoch
            whose last window is shorter); under manual optimization, every ``optimizer.step()``
            of every optimizer. Snapshots are only taken at batches that stepped the optimizer,
            so no accumulated gradient is ever lost.
        train_time_interval: snapshot at the first batch end (that stepped the optimizer) after
            this much training time since the fit started or since the last snapshot of any
            cadence (rank 0's clock; under DDP every rank snapshots one optimizer step later,
            together).
        every_n_epochs: snapshot at the end of every N-th training epoch (0: never). When none of
            ``every_n_epochs``, ``every_n_train_steps`` and ``train_time_interval`` is given,
            every epoch, as ``ModelCheckpoint``. Unlike ``ModelCheckpoint``, the cadences
            combine: any of them due takes a snapshot.
        save_on_train_epoch_end: as ``ModelCheckpoint``'s: whether the epoch cadence's snapshots
            are taken at the end of the training epoch (after that epoch's validation) or at the
            end of each validation of a due epoch (also mid-epoch with ``val_check_interval``).
            None (default): at the epoch's end, unless validation runs more than once an epoch,
            by time, or not every epoch (``check_val_every_n_epoch``), as ``ModelCheckpoint``.
        save_every_n_train_steps, save_every_n_epochs: torchtnt's names of
            ``every_n_train_steps`` / ``every_n_epochs`` (>= 1).
        replicated: glob patterns of entries identical on every rank, saved once instead of once
            per rank (``["state_dict/**", "optimizer_states/**"]`` under DDP). ``loops``,
            ``callbacks`` and the RNG state are never replicated.
        storage_options: options of the storage (for ``s3://``: ``endpoint_url``,
            ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``).
        keep_last_n_snapshots: delete older snapshots once a newer one is committed
            (``keep_last_n_checkpoints`` is accepted as torchtnt's name for it).
        async_snapshot: write in the background; training waits only for an in-memory copy.
        save_on_train_end: take a final snapshot when training ends, unless the last optimizer
            step is already saved.
        on_save_error: ``"warn"`` (training goes on; a failure warns once per cause until a snapshot succeeds)
            or ``"raise"`` (the next hook raises SnapshotWriteError).
        preemption_signals: on these signals, finish the batch (with gradient accumulation: up
            to the next optimizer step; under DDP: at the ranks' next agreements, within about
            half a second of training, on every rank at the same step), snapshot, then stop the
            run the way Lightning stops on SIGTERM: raise
            ``SIGTERMException`` (exit status 128 + signal), which runs Lightning's
            ``on_exception`` hooks and teardown. Default ``[SIGTERM]``; ``[]`` leaves the
            signals to Lightning (which finishes the epoch, then exits).
        process_group: ranks taking part (default: all); collectives run on a gloo group of their own.
        collective_timeout_s: how long a checkpoint collective (also those of resuming through
            ``ckpt_path``) waits for a failed rank.
        plugin_manager: the pluggy manager whose hooks apply (default: a new one for this saver,
            with the entry-point plugins; add more with :meth:`register`).
        weights_only: True (default): before each snapshot is written, check that it loads with
            ``torch.load(weights_only=True)`` and the plugin's safe globals (an
            ``argparse.Namespace`` from ``save_hyperparameters(args)`` does); if not, raise
            UnrestorableStateError naming the entry and type, whatever ``on_save_error`` says.
            False: no check, and ``ckpt_path`` snapshots load with full pickle (trusted
            snapshots only), as ``trainer.fit(..., weights_only=False)`` asks for one fit.
        format: the on-disk format: ``"torchsnapshot"`` (default) or ``"dcp"``
            (``torch.distributed.checkpoint``'s, which ``dcp.load`` reads). ``ckpt_path`` resumes
            from either.
        knobs: :class:`~tnt_snapshot_plugin.config.Knobs` (I/O threads per rank; ``writer``:
            ``"thread"`` or ``"process"``, who writes the payload files of asynchronous
            snapshots) or None (the defaults).

    ``ModelCheckpoint``'s ``filename``, ``save_weights_only``, ``auto_insert_metric_name``,
    ``enable_version_counter`` and ``save_on_exception`` have no meaning here: passing one raises
    ConfigError saying what to do instead. A value ``ModelCheckpoint`` refuses (``mode="avg"``,
    ``save_top_k=-2``, ``save_top_k=2`` without ``monitor``, a negative ``every_n_*``) raises
    :class:`InvalidArgumentError`, a ConfigError and a ``MisconfigurationException``.

    Each committed snapshot's figures (``snapshot/stall_s``, ``snapshot/durable_s``,
    ``snapshot/bytes_written``, ``snapshot/write_MBps``, ...; see :mod:`tnt_snapshot_plugin.metrics`)
    go to ``trainer.loggers`` with ``log_metrics(metrics, step=<the snapshot's global_step>)``.

    Lightning treats any ``Checkpoint`` callback as "checkpointing configured": with the saver
    alone, ``Trainer(enable_checkpointing=True)`` adds no default ``ModelCheckpoint`` (add one
    yourself to also get ``.ckpt`` files), and ``enable_checkpointing=False`` is refused by
    Lightning.
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        *,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[Union[bool, Literal["link"]]] = None,
        save_top_k: Optional[int] = None,
        mode: str = "min",
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[datetime.timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
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
        weights_only: bool = True,
        format: Any = "torchsnapshot",
        knobs: Any = None,
        **not_applicable: Any,
    ) -> None:
        # ModelCheckpoint.__init__ configures the .ckpt files this class replaces by snapshots.
        Callback.__init__(self)
        refuse_not_applicable(not_applicable)
        # What a copy in another process is rebuilt from (strategy="ddp_spawn" pickles callbacks).
        self._arguments = dict(
            dirpath=dirpath, monitor=monitor, verbose=verbose, save_last=save_last, save_top_k=save_top_k,
            mode=mode, every_n_train_steps=every_n_train_steps, train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs, save_on_train_epoch_end=save_on_train_epoch_end,
            save_every_n_train_steps=save_every_n_train_steps, save_every_n_epochs=save_every_n_epochs,
            replicated=replicated, storage_options=storage_options, keep_last_n_snapshots=keep_last_n_snapshots,
            keep_last_n_checkpoints=keep_last_n_checkpoints, async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end, on_save_error=on_save_error,
            preemption_signals=preemption_signals, collective_timeout_s=collective_timeout_s,
            weights_only=weights_only, format=format, knobs=knobs,
        )
        self._config = saver_config(self._arguments)
        self.verbose, self.save_last = verbose, save_last
        #: None: no best-k (ModelCheckpoint itself has no None)
        self.save_top_k = save_top_k  # type: ignore[assignment]
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._trainer: Optional[pl.Trainer] = None
        self._collect: Callable[[bool], dict[str, Value]] = _not_started
        self._last_step: Optional[int] = None
        #: (epoch, step) of the last snapshot this run took (the final one is not taken again)
        self._saved_at: Optional[tuple[int, int]] = None
        self._announced = 0
        #: the newest snapshot committed, as Lightning's own checkpoint of this callback says
        self._last_committed: Optional[str] = None
        self._best = BestSnapshots(self._config, mode, lambda: self.dirpath, lambda: self._trainer)
        self._engine = Engine(
            self._config,
            dirpath,
            process_group=process_group,
            plugin_manager=plugin_manager,
            weights_only=weights_only,
            metric=self._best.monitored_value if self._config.best is not None else None,
        )
        self._resume = Resume(self._config, self._engine, weights_only)

    @property
    def every_n_epochs(self) -> Optional[int]:  # type: ignore[override]
        """The epoch cadence (None: no epoch snapshots)."""
        return self._config.save_every_n_epochs

    # -- the engine --------------------------------------------------------------------------------

    @property
    def _snapshotter(self) -> Snapshotter:
        return self._engine.required

    @property
    def snapshotter(self) -> Snapshotter:
        """The framework-neutral engine (stats, wait(), the plugin manager)."""
        return self._engine.required

    @property  # type: ignore[override]
    def dirpath(self) -> Optional[str]:
        """Parent directory the snapshots are saved to (rank 0's, once training started); None
        until ``setup`` resolves it when none was given."""
        return self._engine.dirpath

    @dirpath.setter
    def dirpath(self, value: Any) -> None:
        raise AttributeError("TorchSnapshotSaver.dirpath is set by its constructor (or resolved at setup)")

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register a plugin on this saver only, checked at once (:meth:`Snapshotter.register`)."""
        return self._engine.register(plugin, name)

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver."""
        self._engine.unregister(plugin)

    def __getstate__(self) -> dict[str, Any]:
        """What ``strategy="ddp_spawn"`` sends to each new process: the arguments, not the engine."""
        if not self._engine.portable:
            raise TypeError(
                "a TorchSnapshotSaver given its own process_group or plugin_manager (or plugins) cannot be sent "
                'to another process (strategy="ddp_spawn" pickles the callbacks); create it in '
                'the training process, or use strategy="ddp"'
            )
        engine = self._engine.snapshotter
        if (engine is not None and engine.stats.committed) or self._resume.io is not None:
            raise TypeError(
                "a TorchSnapshotSaver that has already trained cannot be sent to another process; "
                "create a new one"
            )
        return {"arguments": self._arguments, "last_committed": self._last_committed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        arguments = dict(state["arguments"])
        self.__init__(arguments.pop("dirpath"), **arguments)  # type: ignore[misc]
        self._last_committed = state["last_committed"]

    @property
    @override
    def state_key(self) -> str:
        # From the dirpath given, not the cadence: changing the cadence between runs keeps the
        # state, and two savers on one dirpath (which would race) are refused by Lightning.
        return self._generate_state_key(dirpath=self._engine.given_dirpath)

    @override
    def state_dict(self) -> dict[str, Any]:
        """``dirpath`` and the newest snapshot committed when the state was taken."""
        engine = self._engine.snapshotter
        committed = engine.stats.committed if engine is not None else []
        return {"dirpath": self.dirpath, "last_committed": committed[-1].path if committed else self._last_committed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_committed = state_dict.get("last_committed")

    # -- best-k, as ModelCheckpoint's attributes read it -------------------------------------------

    @property
    def monitor(self) -> Optional[str]:  # type: ignore[override]
        """The metric that ranks the snapshots (None: none)."""
        return self._best.monitor

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self._best.mode

    @property
    def best_model_path(self) -> str:  # type: ignore[override]
        """The best complete snapshot in ``dirpath`` by ``monitor`` ("" if none carries it);
        without ``monitor``, the newest complete snapshot ("" if none), as ``ModelCheckpoint``
        without ``monitor`` names the newest checkpoint it saved. What Lightning loads for
        ``ckpt_path="best"`` (``fit``/``validate``/``test``/``predict``). Read from the directory
        (the snapshots' names and indexes), so it is true in a new process and after a resume
        too."""
        return self._best.best_model_path()

    @best_model_path.setter
    def best_model_path(self, value: str) -> None:
        """Ignored (``strategy="ddp_spawn"`` hands the worker's value back): it is read from
        ``dirpath``."""

    @property
    def best_model_score(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        """``monitor``'s value in :attr:`best_model_path` (None if there is none), as a tensor
        like ``ModelCheckpoint``'s; a NaN value reads as +inf (``mode="min"``) or -inf
        (``"max"``), as ``ModelCheckpoint`` reports it."""
        return self._best.best_model_score()

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The ``save_top_k`` best complete snapshots in ``dirpath`` (every ranked one for -1),
        best first: path -> ``monitor``'s value, as ``ModelCheckpoint``'s ``best_k_models``.
        Empty without ``monitor``."""
        return self._best.best_k_models()

    @property
    def kth_best_model_path(self) -> str:  # type: ignore[override]
        """The worst of :attr:`best_k_models` ("" if none); of several equally worst, the one
        committed first, as ``ModelCheckpoint`` picks the first of them it saved."""
        return self._best.kth_best_model_path()

    @override
    def to_yaml(self, filepath: Optional[Any] = None) -> None:
        """Write :attr:`best_k_models` (path -> value) as YAML to ``filepath`` (default:
        ``dirpath/best_k_models.yaml``, a local ``dirpath`` only), as ``ModelCheckpoint`` does."""
        self._best.to_yaml(filepath)

    # -- resuming ----------------------------------------------------------------------------------

    @property
    def ckpt_path(self) -> Optional[str]:
        """The newest complete, undamaged snapshot in ``dirpath``, or None (also while ``dirpath``
        is not resolved yet, and for an ``s3://`` dirpath: pass the snapshot's URL as
        ``ckpt_path`` there). What ``fit(ckpt_path="last")`` resumes from."""
        return self._resume.ckpt_path

    @property
    def last_model_path(self) -> str:  # type: ignore[override]
        """The newest complete snapshot (what ``ckpt_path="last"`` resumes), "" if none."""
        return self._resume.ckpt_path or ""

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """What Lightning asks each ``ModelCheckpoint`` for ``ckpt_path="last"`` (before any
        ``setup``): the newest complete snapshot, read by each rank itself (``setup`` then checks
        that every rank found the same one)."""
        return self._resume.find_last_checkpoints(trainer)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve ``dirpath`` if none was given, join the process group, install the
        snapshot-reading CheckpointIO (before Lightning loads ``ckpt_path``), check that all
        ranks resolved ``ckpt_path="last"`` alike."""
        self._trainer = trainer
        self._resume.setup(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep every snapshot; put the Trainer's own CheckpointIO back."""
        self._resume.leave_stage(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """(First batch of a mid-epoch resume from a lazy loader) undo its iterator's RNG draws."""
        self._resume.at_batch_start()

    # -- hooks -------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the state keys, watch for preemption, keep the resumed-from snapshot out of
        retention's reach, and (mid-epoch resume) set the RNG again."""
        self._trainer = trainer
        self._collect = self._collector(trainer)  # built once per run, not on every batch
        self._last_step = trainer.global_step
        self._saved_at = None
        snapshotter = self._snapshotter
        self._resume.announce(trainer)
        snapshotter.train_start(LIGHTNING_KEYS, trainer.current_epoch, trainer.global_step)
        # The staging buffers of asynchronous snapshots, allocated and touched before training, for
        # the bulk of what dump_checkpoint returns (without calling it: it runs the user's hooks).
        snapshotter.prepare(
            lambda: {
                "state_dict": Value(pl_module.state_dict()),
                "optimizer_states": Value([opt.state_dict() for opt in trainer.optimizers]),
            }
        )
        if trainer.loggers:  # each committed snapshot's figures, at the global step it was taken
            snapshotter.report_metrics(_log_metrics_to(list(trainer.loggers)))
        self._resume.at_train_start(trainer, snapshotter)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Snapshot if this batch stepped the optimizer and the step cadence (or a plugin) says so."""
        step = trainer.global_step
        if step == self._last_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = step
        snapshotter = self._snapshotter
        if snapshotter.trigger.quiet(step):
            return  # nothing to do at this step (saving.trigger: the step gate)
        snapshotter.step_end(trainer.current_epoch, step, self._collect)
        if self.verbose:
            self._announce()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Snapshot if the epoch cadence (or a plugin) says so, unless that cadence runs at the
        end of validation (``save_on_train_epoch_end``, decided as ``ModelCheckpoint`` does)."""
        if not self._should_save_on_train_epoch_end(trainer):
            return
        # Lightning counts the epoch as completed only after this hook; it is processed already.
        # (epoch_progress is a _Progress whose tracker is declared as the base class; the fit
        # loop's is a _ProcessedTracker)
        epochs = trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]
        self._snapshotter.epoch_end(epochs, trainer.global_step, self._collector(trainer, epochs))
        if self.verbose:
            self._announce()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The epoch cadence's snapshot after each validation of a due epoch while fitting, when
        ``save_on_train_epoch_end`` (decided as ``ModelCheckpoint`` decides it: False, or None
        with validation more than once an epoch, by time, or not every epoch) says so."""
        n = self._config.save_every_n_epochs
        if n is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._should_save_on_train_epoch_end(trainer):
            return
        if (trainer.current_epoch + 1) % n != 0:
            return
        last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        epochs = trainer.current_epoch + (1 if last else 0)
        collect = self._collector(trainer, epochs)
        self._snapshotter.save(epochs, trainer.global_step, lambda: collect(not last), event="epoch")
        if self.verbose:
            self._announce()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take a final snapshot unless this run saved the last optimizer step already; wait
        until it is durable."""
        epoch, step = trainer.current_epoch, trainer.global_step
        if self._saved_at is not None and self._saved_at[1] == step:
            # That state is saved (a step snapshot at the epoch's last batch is named by the
            # epoch it ran in): the same name, which the engine does not write again, rather
            # than a copy under the next epoch's number.
            epoch = self._saved_at[0]
        self._snapshotter.train_end(epoch, step, self._collector(trainer, epoch))
        if self.verbose:
            self._announce()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Wait for the pending snapshot; the newest complete snapshot stays intact. The
        Trainer's own CheckpointIO is put back."""
        self._resume.leave_stage(trainer)
        if self._engine.snapshotter is not None:
            self._engine.snapshotter.exception()

    def _announce(self) -> None:
        """(``verbose``) one line through Lightning's logger per snapshot committed since."""
        from tnt_snapshot_plugin.metrics import log_line

        committed = self._snapshotter.stats.committed
        for record in committed[self._announced :]:
            rank_zero_info(f"TorchSnapshotSaver: {log_line(record)}")
        self._announced = len(committed)

    def _collector(
        self, trainer: pl.Trainer, epoch: Optional[int] = None
    ) -> Callable[[bool], dict[str, Value]]:
        """The Lightning checkpoint dict, collected when a snapshot named by ``epoch`` (None:
        ``trainer.current_epoch``) and ``trainer.global_step`` is taken."""

        def collect(intra_epoch: bool) -> dict[str, Value]:
            self._saved_at = (trainer.current_epoch if epoch is None else epoch, trainer.global_step)
            return _checkpoint(trainer)

        return collect

    restore = staticmethod(lightning_restore.restore)
    restore_from_latest = staticmethod(lightning_restore.restore_from_latest)


def _checkpoint(trainer: pl.Trainer) -> dict[str, Value]:
    """The dict Lightning's ``ModelCheckpoint`` would write now, one entry per top-level key."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    # a key the plugin reserves (its RNG state) could come from an on_save_checkpoint hook
    check_collisions((), [("the Lightning checkpoint (an on_save_checkpoint hook's key?)", checkpoint)])
    return {key: Value(value) for key, value in checkpoint.items()}


def _log_metrics_to(loggers: list[Any]) -> Callable[[dict[str, float], int], None]:
    """A metrics reporter that hands each snapshot's figures to every Lightning logger."""

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        for lightning_logger in loggers:
            lightning_logger.log_metrics(metrics, step=step)

    return log_metrics


def _not_started(intra_epoch: bool) -> dict[str, Value]:
    raise RuntimeError(
        "TorchSnapshotSaver.on_train_start was not called before a snapshot was due; pass the "
        "saver in Trainer(callbacks=[...]), which calls its hooks in order"
    )
