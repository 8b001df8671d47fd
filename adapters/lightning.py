"""The PyTorch Lightning adapter: one callback, and resume through Lightning's own ``ckpt_path``.

::

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    saver = TorchSnapshotSaver("/ckpts/run1", save_every_n_train_steps=100, save_every_n_epochs=1)
    trainer = Trainer(max_epochs=10, callbacks=[saver])
    trainer.fit(model, datamodule=dm, ckpt_path="last")  # resumes if /ckpts/run1 holds a snapshot

What a snapshot holds: exactly the dict Lightning's own ``ModelCheckpoint`` would write at that
moment (``Trainer._checkpoint_connector.dump_checkpoint()``: weights, optimizers, LR schedulers,
the loops' progress with the train loader's state, every callback's state, the datamodule's and
the precision plugin's state, hyper-parameters, whatever ``on_save_checkpoint`` hooks add), one
entry per top-level key, plus the RNG state of every generator (Python, numpy, torch CPU and CUDA)
that Lightning's checkpoints lack. Each rank saves its own copy unless ``replicated`` says otherwise.

How ``fit(ckpt_path=...)`` reaches a snapshot:

* ``ckpt_path="last"``: Lightning resolves it, before any callback runs, from the ``ckpt_path``
  attribute of its ``OnExceptionCheckpoint`` callbacks and ``ModelCheckpoint``'s last files. The
  saver is an ``OnExceptionCheckpoint``; its ``ckpt_path`` is the newest complete snapshot of
  ``dirpath`` (damaged ones skipped). When several candidates exist (a ``ModelCheckpoint``'s
  ``last.ckpt``, say), Lightning takes the most recently modified one.
* ``ckpt_path="best"`` (``fit``, ``validate``, ``test``): Lightning reads the saver's
  ``best_model_path``, the best complete snapshot by ``monitor`` found in ``dirpath``.
* In ``setup()`` the saver wraps the strategy's ``CheckpointIO`` in a :class:`SnapshotCheckpointIO`,
  which reads a snapshot directory into Lightning's checkpoint dict (and sets the RNG state) and
  hands every other path to the ``CheckpointIO`` it wraps, so ``ModelCheckpoint`` works as before.
  Lightning then restores that dict as it restores its own checkpoints.
"""

from __future__ import annotations

import datetime
import os
import signal
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import pluggy
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import Checkpoint, OnExceptionCheckpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.app_state import RESERVED_KEYS, RNG_STATE_KEY, RNGState, Value
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.distributed import Collectives, is_initialized
from tnt_snapshot_plugin.errors import (
    ConfigError,
    KeyCollisionError,
    SnapshotNotFoundError,
    StateMismatchError,
)
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.snapshotter import Snapshotter
from tnt_snapshot_plugin.stores import METADATA_FNAME, LocalStore, open_store, split_snapshot_path

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
#: Entries that can differ between ranks (per-rank loader positions, callback states).
NEVER_REPLICATED = ("loops", "callbacks")

_NOT_ASKED = "<not asked>"


class TorchSnapshotSaver(OnExceptionCheckpoint):
    """Snapshot a Lightning run's whole training state in torchsnapshot's format; resume it exactly.

    Use it when a run must survive crashes and preemption without losing more than a few steps,
    and without stalling training while a checkpoint is written. Snapshots are written to
    ``dirpath/epoch_{epoch}_step_{step}`` (``epoch``: epochs completed; ``step``:
    ``trainer.global_step``, the optimizer steps taken), asynchronously by default, and become
    visible to restore only once complete. Resume with a new Trainer holding a saver on the same
    ``dirpath``: ``trainer.fit(model, ckpt_path="last")`` (the newest complete snapshot) or
    ``ckpt_path="<dirpath>/epoch_E_step_S"``.

    Args:
        dirpath: parent directory of the snapshots (local path, ``file://`` or ``s3://``).
        save_every_n_train_steps: snapshot when ``trainer.global_step`` reaches a multiple of N
            (None: no mid-epoch snapshots). ``global_step`` counts optimizer steps: with
            ``accumulate_grad_batches=K`` one step per K batches (and one at the end of an epoch
            whose last window is shorter); under manual optimization, every ``optimizer.step()``
            of every optimizer. Snapshots are only taken at batches that stepped the optimizer,
            so no accumulated gradient is ever lost.
        save_every_n_epochs: snapshot at the end of every N-th training epoch.
        train_time_interval: snapshot at the first batch end (that stepped the optimizer) after
            this much training time since the fit started or since the last snapshot of any
            cadence, as ``ModelCheckpoint``'s ``train_time_interval`` (rank 0's clock; under DDP
            every rank snapshots one optimizer step later, together). Unlike
            ``ModelCheckpoint``, it combines with the step and epoch cadences: any of them due
            takes a snapshot.
        replicated: glob patterns of entries identical on every rank, saved once instead of once
            per rank (``["state_dict/**", "optimizer_states/**"]`` under DDP). ``loops``,
            ``callbacks`` and the RNG state are never replicated.
        storage_options: options of the storage (for ``s3://``: ``endpoint_url``,
            ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``).
        keep_last_n_snapshots: delete older snapshots once a newer one is committed
            (``keep_last_n_checkpoints`` is accepted as torchtnt's name for it).
        async_snapshot: write in the background; training waits only for an in-memory copy.
        save_on_train_end: take a final snapshot when training ends (unless already saved).
        on_save_error: ``"warn"`` (training goes on, every hook warns until a snapshot succeeds)
            or ``"raise"`` (the next hook raises SnapshotWriteError).
        preemption_signals: on these signals, finish the batch (with gradient accumulation: up
            to the next optimizer step; under DDP: at the ranks' next agreements, within about
            half a second of training, on every rank at the same step), snapshot, then stop the
            run the way Lightning stops on SIGTERM: raise
            ``SIGTERMException`` (exit status 128 + signal), which runs Lightning's
            ``on_exception`` hooks and teardown. Default ``[SIGTERM]``; ``[]`` leaves the
            signals to Lightning (which finishes the epoch, then exits).
        process_group: ranks taking part (default: all); collectives run on a gloo group of their own.
        collective_timeout_s: how long a checkpoint collective waits for a failed rank.
        plugin_manager: the pluggy manager whose hooks apply (default: the process-wide one).
        monitor: a logged metric (``trainer.callback_metrics``, read when a snapshot is taken)
            that ranks the snapshots, as ``ModelCheckpoint``'s ``monitor``: the name carries it
            (``epoch_E_step_S_<monitor>=<value>``: letters, digits, ``_``, ``.`` and ``/``,
            a ``/`` written ``%2F`` there, as in ``..._val%2Floss=0.25``) and ``best_model_path`` /
            ``best_model_score`` / ``ckpt_path="best"`` follow it. A metric not logged yet when
            a snapshot is taken before any validation ran is warned about and the snapshot saved
            without it; once validation has run, it is a :class:`MonitorNotFoundError`.
        mode: ``"min"`` (default) or ``"max"``: whether a lower or a higher value is better.
        save_top_k: keep the k best snapshots by ``monitor`` (default 1 when ``monitor`` is set;
            -1: keep every one; NaN ranks worst; an equal value does not replace an older one).
            With ``keep_last_n_snapshots`` the newest n are kept too; without it, snapshots
            taken before the metric was logged are never deleted. The newest snapshot is always
            kept until a newer one is committed, so ``ckpt_path="last"`` resumes the newest state.
        weights_only: True (default): before each snapshot is written, check that it loads with
            ``torch.load(weights_only=True)`` and the plugin's safe globals (an
            ``argparse.Namespace`` from ``save_hyperparameters(args)`` does); if not, raise
            UnrestorableStateError naming the entry and type, whatever ``on_save_error`` says.
            False: no check, and ``ckpt_path`` snapshots load with full pickle (trusted
            snapshots only), as ``trainer.fit(..., weights_only=False)`` asks for one fit.

    Each committed snapshot's figures (``snapshot/stall_s``, ``snapshot/durable_s``,
    ``snapshot/bytes_written``, ``snapshot/write_MBps``, ...; see :mod:`tnt_snapshot_plugin.metrics`)
    go to ``trainer.loggers`` with ``log_metrics(metrics, step=<the snapshot's global_step>)``.

    Lightning treats any ``Checkpoint`` callback as "checkpointing configured": with the saver
    alone, ``Trainer(enable_checkpointing=True)`` adds no default ``ModelCheckpoint`` (add one
    yourself to also get ``.ckpt`` files), and ``enable_checkpointing=False`` is refused by
    Lightning. As an ``OnExceptionCheckpoint``, the saver also makes Lightning turn
    ``fit(model)`` without ``ckpt_path`` into ``ckpt_path="last"``: a run whose ``dirpath``
    already holds snapshots resumes from them (Lightning warns); use a new ``dirpath`` per run.
    """

    def __init__(
        self,
        dirpath: str,
        *,
        save_every_n_train_steps: Optional[int] = None,
        save_every_n_epochs: Optional[int] = None,
        train_time_interval: Optional[datetime.timedelta] = None,
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
        monitor: Optional[str] = None,
        mode: str = "min",
        save_top_k: Optional[int] = None,
    ) -> None:
        # OnExceptionCheckpoint.__init__ only sets the .ckpt file this class replaces by snapshots.
        Checkpoint.__init__(self)
        # What a copy in another process is rebuilt from (strategy="ddp_spawn" pickles callbacks).
        self._arguments = dict(
            dirpath=dirpath,
            save_every_n_train_steps=save_every_n_train_steps,
            save_every_n_epochs=save_every_n_epochs,
            train_time_interval=train_time_interval,
            replicated=replicated,
            storage_options=storage_options,
            keep_last_n_snapshots=keep_last_n_snapshots,
            keep_last_n_checkpoints=keep_last_n_checkpoints,
            async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end,
            on_save_error=on_save_error,
            preemption_signals=preemption_signals,
            collective_timeout_s=collective_timeout_s,
            weights_only=weights_only,
            monitor=monitor,
            mode=mode,
            save_top_k=save_top_k,
        )
        self._weights_only = weights_only
        self._portable = process_group is None and plugin_manager is None
        config = SnapshotConfig.build(
            save_every_n_train_steps=save_every_n_train_steps,
            save_every_n_epochs=save_every_n_epochs,
            save_every_n_seconds=_seconds(train_time_interval),
            keep_last_n_snapshots=keep_last_n_snapshots,
            keep_last_n_checkpoints=keep_last_n_checkpoints,
            replicated=replicated,
            storage_options=storage_options,
            async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end,
            on_save_error=on_save_error,
            preemption_signals=preemption_signals,
            collective_timeout_s=collective_timeout_s,
            best_metric=monitor,
            best_mode=mode,
            best_k=_top_k(monitor, save_top_k),
            names={"best_metric": "monitor", "best_mode": "mode", "best_k": "save_top_k"},
        )
        self._given_dirpath = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath
        self._snapshotter = Snapshotter(
            self._given_dirpath,
            config,
            process_group=process_group,
            plugin_manager=plugin_manager,
            never_replicated=NEVER_REPLICATED,
            on_preempted=_stop_like_lightning,
            weights_only=weights_only,
            metric=self._monitored_value if monitor is not None else None,
        )
        self._trainer: Optional[pl.Trainer] = None
        self._collect: Callable[[bool], dict[str, Value]] = _not_started
        self._warned_unlogged = False
        self._io: Optional[SnapshotCheckpointIO] = None
        self._last_step: Optional[int] = None
        self._last_committed: Optional[str] = None
        self._resolved_last: Optional[str] = _NOT_ASKED
        self._rng_after_first_fetch: Optional[dict[str, Any]] = None

    def __getstate__(self) -> dict[str, Any]:
        """What ``strategy="ddp_spawn"`` sends to each new process: the arguments, not the engine."""
        if not self._portable:
            raise TypeError(
                "a TorchSnapshotSaver given its own process_group or plugin_manager cannot be sent "
                'to another process (strategy="ddp_spawn" pickles the callbacks); create it in '
                'the training process, or use strategy="ddp"'
            )
        if self._snapshotter.stats.committed or self._io is not None:
            raise TypeError(
                "a TorchSnapshotSaver that has already trained cannot be sent to another process; "
                "create a new one"
            )
        return {"arguments": self._arguments, "last_committed": self._last_committed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        arguments = dict(state["arguments"])
        self.__init__(arguments.pop("dirpath"), **arguments)  # type: ignore[misc]
        self._last_committed = state["last_committed"]

    # -- what Lightning and users read ----------------------------------------------------------

    @property
    def dirpath(self) -> str:  # type: ignore[override]
        """Parent directory the snapshots are saved to (rank 0's, once training started)."""
        return self._snapshotter.dirpath

    @property
    def snapshotter(self) -> Snapshotter:
        """The framework-neutral engine (stats, wait(), the plugin manager)."""
        return self._snapshotter

    @property
    @override
    def ckpt_path(self) -> Optional[str]:  # type: ignore[override]
        """The newest complete, undamaged snapshot in ``dirpath``, or None.

        This is what Lightning resumes from for ``fit(ckpt_path="last")``. It is read before the
        process group exists, so each rank lists ``dirpath`` itself; ``setup()`` then checks that
        every rank found the same snapshot. An ``s3://`` dirpath gives None (Lightning would need
        s3fs to look at it): pass the snapshot's URL as ``ckpt_path`` instead.
        """
        store = open_store(self.dirpath, self._snapshotter.config.storage_options)
        if not isinstance(store, LocalStore):
            warnings.warn(
                f'ckpt_path="last" cannot find snapshots in {self.dirpath}: Lightning only looks at '
                "local files for it; pass ckpt_path=<the snapshot's URL> to resume from one",
                stacklevel=2,
            )
            path = None
        else:
            path = restoring.latest_snapshot(
                self.dirpath,
                storage_options=self._snapshotter.config.storage_options,
                collectives=Collectives(None),
                verified=True,
            )
        self._resolved_last = path
        return path

    @property
    def monitor(self) -> Optional[str]:
        """The metric that ranks the snapshots (None: none)."""
        best = self._snapshotter.config.best
        return best.metric if best is not None else None

    @property
    def mode(self) -> str:
        best = self._snapshotter.config.best
        return best.mode if best is not None else "min"

    @property
    def best_model_path(self) -> str:
        """The best complete snapshot in ``dirpath`` by ``monitor`` ("" if none carries it, or no
        ``monitor`` is set): what Lightning loads for ``ckpt_path="best"``
        (``fit``/``validate``/``test``/``predict``). Read from the directory (the snapshots' names
        and indexes), so it is true in a new process and after a resume too."""
        found = self._best()
        return found[0] if found is not None else ""

    @property
    def best_model_score(self) -> Optional[torch.Tensor]:
        """``monitor``'s value in :attr:`best_model_path` (None if there is none), as a tensor
        like ``ModelCheckpoint``'s."""
        found = self._best()
        return torch.tensor(found[1]) if found is not None else None

    def _best(self) -> Optional[tuple[str, float]]:
        best = self._snapshotter.config.best
        if best is None:
            return None
        from tnt_snapshot_plugin import retention

        store = open_store(self.dirpath, self._snapshotter.config.storage_options)
        found = retention.best(store.listed(), best.metric, best.mode)
        if found is None:
            return None
        value = found.metric_value(best.metric)
        assert value is not None
        return store.child(found.text), value

    def _monitored_value(self) -> Optional[tuple[str, float]]:
        """(monitor, value) from ``trainer.callback_metrics`` now (a snapshot is being taken)."""
        monitor = self.monitor
        trainer = self._trainer
        assert monitor is not None and trainer is not None
        metrics = trainer.callback_metrics
        if monitor not in metrics:
            message = (
                f"TorchSnapshotSaver(monitor={monitor!r}) could not find the monitored key in the "
                f"logged metrics: {sorted(metrics)}. HINT: did you call `self.log({monitor!r}, "
                "value)` in the LightningModule?"
            )
            val_loop = trainer.fit_loop.epoch_loop.val_loop
            if getattr(val_loop, "_has_run", False):
                raise MonitorNotFoundError(message)
            if not self._warned_unlogged:
                self._warned_unlogged = True
                warnings.warn(
                    f"{message} (No validation has run yet: snapshots are saved without it until "
                    "it is logged, and are not ranked.)",
                    stacklevel=2,
                )
            return None
        value = metrics[monitor]
        try:
            return monitor, _as_float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"TorchSnapshotSaver(monitor={monitor!r}): the logged value {value!r} is not a "
                f"number: {exc}"
            ) from exc

    @property
    @override
    def state_key(self) -> str:
        # From the dirpath given, not the cadence: changing the cadence between runs keeps the
        # state, and two savers on one dirpath (which would race) are refused by Lightning.
        return self._generate_state_key(dirpath=self._given_dirpath)

    @override
    def state_dict(self) -> dict[str, Any]:
        """``dirpath`` and the newest snapshot committed when the state was taken."""
        committed = self._snapshotter.stats.committed
        return {
            "dirpath": self.dirpath,
            "last_committed": committed[-1].path if committed else self._last_committed,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_committed = state_dict.get("last_committed")

    # -- hooks -------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Join the process group, install the snapshot-reading CheckpointIO (before Lightning loads
        ``ckpt_path``) and check that all ranks resolved ``ckpt_path="last"`` alike."""
        self._trainer = trainer
        self._snapshotter.attach()
        _check_strategy_can_resume(trainer)
        self._io = SnapshotCheckpointIO.install(
            trainer,
            storage_options=self._snapshotter.config.storage_options,
            collectives=lambda: self._snapshotter.collectives,
            plugin_manager=self._snapshotter.plugin_manager,
            weights_only=self._weights_only,
        )
        resolved, self._resolved_last = self._resolved_last, _NOT_ASKED
        # ckpt_path="last" resolved to this snapshot: if it cannot be loaded, the ones before it
        # are tried, as restore_from_latest does.
        self._io.fall_back_from = resolved if resolved != _NOT_ASKED else None
        coll = self._snapshotter.collectives
        answers = coll.all_gather(resolved)
        if len(set(answers)) > 1:
            found = "; ".join(
                f"rank {rank}: {answer if answer != _NOT_ASKED else 'not asked'}"
                for rank, answer in enumerate(answers)
            )
            raise ConfigError(
                f'the ranks resolved ckpt_path="last" to different snapshots ({found}); give every '
                "rank the same dirpath on a shared filesystem, or pass an explicit ckpt_path"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the state keys, watch for preemption, and (mid-epoch resume) set the RNG again."""
        self._trainer = trainer
        self._collect = self._collector(trainer)  # built once per run, not on every batch
        self._last_step = trainer.global_step
        self._rng_after_first_fetch = None
        self._snapshotter.train_start(LIGHTNING_KEYS, trainer.current_epoch, trainer.global_step)
        # The staging buffers of asynchronous snapshots, allocated and touched before training, for
        # the bulk of what dump_checkpoint returns (without calling it: it runs the user's hooks).
        self._snapshotter.prepare(
            lambda: {
                "state_dict": Value(pl_module.state_dict()),
                "optimizer_states": Value([opt.state_dict() for opt in trainer.optimizers]),
            }
        )
        loggers = list(trainer.loggers)
        if loggers:  # each committed snapshot's figures, at the global step it was taken

            def log_metrics(metrics: dict[str, float], step: int) -> None:
                for lightning_logger in loggers:
                    lightning_logger.log_metrics(metrics, step=step)

            self._snapshotter.report_metrics(log_metrics)
        restored = self._io.take_restored() if self._io is not None else None
        if restored is not None and restored.rng_state is not None and _resumes_mid_epoch(trainer):
            # The snapshot's RNG state was captured at a batch end: after the loader's iterator
            # had started (and drawn its DataLoader base seed, sampler seed... from the global RNG)
            # and before the next batch was fetched. Resuming, Lightning starts the iterator
            # again after the snapshot was loaded, so those draws must not shift the stream.
            if not _same_rng_state(RNGState().state_dict(), restored.rng_state):
                # An eager loader drew in iter() (Lightning's setup_data): set the state again
                # now, before the next batch is fetched.
                RNGState().load_state_dict(restored.rng_state)
            else:
                # Nothing drew yet: a lazy loader (``__iter__`` a generator) starts its iterator
                # at the first next(), inside the first fetch. Set the state after that fetch.
                self._rng_after_first_fetch = restored.rng_state

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """(First batch of a mid-epoch resume from a lazy loader) undo its iterator's RNG draws."""
        if self._rng_after_first_fetch is not None:
            state, self._rng_after_first_fetch = self._rng_after_first_fetch, None
            if not _same_rng_state(RNGState().state_dict(), state):
                RNGState().load_state_dict(state)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Snapshot if this batch stepped the optimizer and the step cadence (or a plugin) says so."""
        step = trainer.global_step
        if step == self._last_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = step
        snapshotter = self._snapshotter
        if snapshotter.last_step <= step < snapshotter.step_gate:
            return  # nothing to do at this step (Snapshotter.step_gate)
        snapshotter.step_end(trainer.current_epoch, step, self._collect)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Snapshot if the epoch cadence (or a plugin) says so."""
        # Lightning counts the epoch as completed only after this hook; it is processed already.
        # (epoch_progress is a _Progress whose tracker is declared as the base class; the fit
        # loop's is a _ProcessedTracker)
        epochs = trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]
        self._snapshotter.epoch_end(epochs, trainer.global_step, self._collector(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take a final snapshot unless the last state is already saved; wait until it is durable."""
        self._snapshotter.train_end(trainer.current_epoch, trainer.global_step, self._collector(trainer))

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Wait for the pending snapshot; the newest complete snapshot stays intact."""
        self._snapshotter.exception()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep every snapshot (``OnExceptionCheckpoint.teardown`` would delete its file)."""

    def _collector(self, trainer: pl.Trainer) -> Callable[[bool], dict[str, Value]]:
        def collect(intra_epoch: bool) -> dict[str, Value]:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            clash = sorted(set(checkpoint) & set(RESERVED_KEYS))
            if clash:
                raise KeyCollisionError(
                    f"Detected collision for key in app state: the Lightning checkpoint has keys "
                    f"{clash} (added by an on_save_checkpoint hook?) that tnt_snapshot_plugin "
                    f"reserves for its own entries {RESERVED_KEYS}; rename them"
                )
            return {key: Value(value) for key, value in checkpoint.items()}

        return collect

    # -- restore outside fit ---------------------------------------------------------------------

    @staticmethod
    def restore(
        path: str,
        module: Any,
        *,
        optimizers: Optional[Sequence[Any]] = None,
        lr_schedulers: Optional[Sequence[Any]] = None,
        storage_options: Optional[dict[str, Any]] = None,
        process_group: Optional[Any] = None,
        strict: bool = True,
        plugin_manager: Optional[pluggy.PluginManager] = None,
        weights_only: bool = True,
    ) -> None:
        """Load snapshot ``path``'s weights into ``module`` (and optimizer / LR scheduler states).

        For evaluation or fine-tuning outside ``fit``; to resume training use
        ``trainer.fit(model, ckpt_path=path)``. ``module`` is the LightningModule (or any module
        with the same ``state_dict`` keys); ``optimizers`` / ``lr_schedulers`` are lists in the
        order ``configure_optimizers`` returns them. The RNG state is restored too. Raises
        SnapshotNotFoundError if ``path`` is not a complete snapshot, StateMismatchError if the
        module or the number of optimizers does not match it. ``weights_only=False`` loads the
        snapshot's objects with full pickle (trusted snapshots only).
        """
        app_state = _restore_state(module, optimizers, lr_schedulers)
        with Collectives.create(process_group, 600.0, for_restore=True) as collectives:
            restoring.restore(
                path,
                app_state,
                storage_options=storage_options,
                collectives=collectives,
                plugin_manager=plugin_manager,
                strict=strict,
                weights_only=weights_only,
            )
        _raise_mismatch(app_state)

    @staticmethod
    def restore_from_latest(
        dirpath: str,
        module: Any,
        *,
        optimizers: Optional[Sequence[Any]] = None,
        lr_schedulers: Optional[Sequence[Any]] = None,
        storage_options: Optional[dict[str, Any]] = None,
        process_group: Optional[Any] = None,
        strict: bool = True,
        fallback: bool = True,
        plugin_manager: Optional[pluggy.PluginManager] = None,
        weights_only: bool = True,
    ) -> bool:
        """:meth:`restore` the newest complete snapshot in ``dirpath``.

        Returns True if one was restored, False if ``dirpath`` is missing, empty or holds no
        complete snapshot. A damaged newest snapshot is skipped with a warning and the previous
        one restored (``fallback=False`` raises SnapshotCorruptError instead). ``weights_only``:
        as :meth:`restore`.
        """
        app_state = _restore_state(module, optimizers, lr_schedulers)
        with Collectives.create(process_group, 600.0, for_restore=True) as collectives:
            restored = restoring.restore_from_latest(
                dirpath,
                app_state,
                storage_options=storage_options,
                collectives=collectives,
                plugin_manager=plugin_manager,
                strict=strict,
                fallback=fallback,
                weights_only=weights_only,
            )
        _raise_mismatch(app_state)
        return restored is not None


@dataclass(frozen=True)
class Restored:
    """What :class:`SnapshotCheckpointIO` last loaded: the snapshot and its RNG state."""

    path: str
    rng_state: Optional[dict[str, Any]]


class SnapshotCheckpointIO(CheckpointIO):
    """A CheckpointIO that loads snapshot directories and hands every other path on.

    ``load_checkpoint(path)`` of a snapshot directory (``.../epoch_E_step_S``, or its
    ``.snapshot_metadata`` file) reads every entry into Lightning's checkpoint dict and sets the
    RNG state; any other path, and every save and removal, goes to the wrapped CheckpointIO
    (``TorchCheckpointIO`` by default), so ``ModelCheckpoint`` is unaffected.
    :class:`TorchSnapshotSaver` installs one in ``setup()``; without the saver, pass one to the
    Trainer: ``Trainer(plugins=[SnapshotCheckpointIO()])``. Under torch.distributed every rank
    loads rank 0's choice of snapshot, each its own state.
    """

    def __init__(
        self,
        checkpoint_io: Optional[CheckpointIO] = None,
        *,
        storage_options: Optional[dict[str, Any]] = None,
        collectives: Optional[Callable[[], Collectives]] = None,
        plugin_manager: Optional[pluggy.PluginManager] = None,
        weights_only: bool = True,
    ) -> None:
        self.checkpoint_io = checkpoint_io
        self.storage_options = storage_options
        self._collectives = collectives
        self._own_collectives: Optional[Collectives] = None
        self.plugin_manager = plugin_manager
        self.weights_only = weights_only
        #: A snapshot path (ckpt_path="last" resolved to it): if it cannot be loaded, the
        #: snapshots before it in its directory are tried, with a warning naming it.
        self.fall_back_from: Optional[str] = None
        self._restored: Optional[Restored] = None

    @classmethod
    def install(
        cls,
        trainer: pl.Trainer,
        *,
        storage_options: Optional[dict[str, Any]] = None,
        collectives: Optional[Callable[[], Collectives]] = None,
        plugin_manager: Optional[pluggy.PluginManager] = None,
        weights_only: bool = True,
    ) -> "SnapshotCheckpointIO":
        """Wrap ``trainer``'s CheckpointIO in one of these (once), configured as given."""
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        if not isinstance(io, cls):
            io = cls(io)
            strategy.checkpoint_io = io
        io.storage_options = storage_options
        io._collectives = collectives
        io.plugin_manager = plugin_manager
        io.weights_only = weights_only
        io.fall_back_from = None
        io._restored = None
        return io

    @property
    def wrapped(self) -> CheckpointIO:
        if self.checkpoint_io is None:
            self.checkpoint_io = TorchCheckpointIO()
        return self.checkpoint_io

    def take_restored(self) -> Optional[Restored]:
        """The snapshot loaded since the last call (None if none), once."""
        restored, self._restored = self._restored, None
        return restored

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        self.wrapped.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.wrapped.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.wrapped.teardown()

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint dict from snapshot ``path``; other paths go to the wrapped IO.

        ``map_location`` applies to the wrapped IO only: snapshots are read to CPU (Lightning
        then moves the state to the device). ``weights_only`` (``trainer.fit(...,
        weights_only=...)``; None: this IO's own setting, True unless the saver was given False):
        whether a snapshot's objects load with torch's restricted unpickler and the plugin's safe
        globals, or with full pickle (False: trusted snapshots only). A snapshot that
        ``ckpt_path="last"`` resolved to (``fall_back_from``) and that cannot be loaded is skipped
        with a warning naming it, and the one before it loaded, as ``restore_from_latest`` does.
        """
        snapshot = snapshot_path(path)
        if snapshot is None:
            return self.wrapped.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        coll = self._get_collectives()
        snapshot = coll.broadcast(snapshot)
        checkpoint: dict[str, Any] = {}
        full_pickle = weights_only is False or (weights_only is None and not self.weights_only)
        fall_back = self.fall_back_from is not None and snapshot == self.fall_back_from
        self.fall_back_from = None
        if fall_back:
            dirpath, name = split_snapshot_path(snapshot)
            keys: list[str] = []
            restored = restoring.restore_from_latest(
                dirpath,
                {},
                storage_options=self.storage_options,
                collectives=coll,
                plugin_manager=self.plugin_manager,
                weights_only=not full_pickle,
                rest=checkpoint,
                newest=name,
                loaded_keys=keys,  # the RNG state's only if restored (not on another world size)
            )
            if restored is None:
                raise SnapshotNotFoundError(f"snapshot {snapshot} is gone; pass an existing ckpt_path")
            snapshot = restored
        else:
            keys = restoring.restore(
                snapshot,
                {},
                storage_options=self.storage_options,
                collectives=coll,
                plugin_manager=self.plugin_manager,
                rest=checkpoint,
                weights_only=not full_pickle,
            )
        missing = [key for key in ("state_dict", "pytorch-lightning_version") if key not in checkpoint]
        if missing:
            raise StateMismatchError(
                f"snapshot {snapshot} holds no Lightning checkpoint (no {missing} entries; it holds "
                f"{sorted(checkpoint)}): it was not written by the Lightning TorchSnapshotSaver. "
                "Restore it with the adapter of the framework that wrote it"
            )
        rng = RNGState().state_dict() if RNG_STATE_KEY in keys else None
        self._restored = Restored(snapshot, rng)
        return checkpoint

    def _get_collectives(self) -> Collectives:
        if self._collectives is not None:
            return self._collectives()
        if self._own_collectives is None or (is_initialized() and not self._own_collectives.distributed):
            self._own_collectives = Collectives.create(None, 600.0)  # collective: every rank loads
        return self._own_collectives


class MonitorNotFoundError(ConfigError, MisconfigurationException):
    """The saver's ``monitor`` was never logged although validation has run (Lightning's
    ``ModelCheckpoint`` raises a MisconfigurationException there; this is one too)."""


def _as_float(value: Any) -> float:
    """A logged value as a float; a tensor of fewer than 64 bits gives the shortest decimal that
    is that value in float32 (``0.3``, not ``0.30000001192092896``), which orders alike."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.float16, torch.bfloat16):
        import numpy as np

        return float(str(np.float32(value.float().item())))
    return float(value)


def _top_k(monitor: Optional[str], save_top_k: Any) -> Optional[int]:
    """``save_top_k`` as the core's best-k count (None: keep all); ConfigError if meaningless."""
    if monitor is None:
        if save_top_k is not None:
            raise ConfigError(
                f"save_top_k={save_top_k!r} keeps the best snapshots by a monitored metric, but "
                "monitor is None; pass monitor='<a logged metric>', or keep the newest snapshots "
                "with keep_last_n_snapshots"
            )
        return None
    if save_top_k is None:
        return 1  # ModelCheckpoint's default
    if save_top_k == -1:
        return None
    if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < 1:
        raise ConfigError(
            f"save_top_k must be a positive int or -1 (keep every snapshot), got {save_top_k!r}; "
            "ModelCheckpoint's save_top_k=0 (save nothing) has no meaning for a snapshot saver"
        )
    return save_top_k


def _check_strategy_can_resume(trainer: pl.Trainer) -> None:
    """Refuse, on every rank alike, a resume from a snapshot that the strategy cannot read.

    Lightning's ``FSDPStrategy.load_checkpoint`` reads ``ckpt_path`` itself (a DCP directory with
    its ``meta.pt``, or a file) and never asks the CheckpointIO, so a snapshot given as
    ``ckpt_path`` would fail inside Lightning with a message about checkpoint shards.
    """
    from pytorch_lightning.strategies import FSDPStrategy

    path = trainer.ckpt_path
    if path is None or snapshot_path(path) is None or not isinstance(trainer.strategy, FSDPStrategy):
        return
    raise ConfigError(
        f'cannot resume from snapshot {path} under strategy="fsdp": Lightning\'s FSDPStrategy loads '
        "checkpoints itself (a DCP directory or a file) without the CheckpointIO that reads "
        "snapshots; resume FSDP runs from Lightning's own FSDP checkpoints (ModelCheckpoint), or "
        "train FSDP with torchtnt and this plugin's torchtnt adapter"
    )


def snapshot_path(path: Any) -> Optional[str]:
    """``path`` as a snapshot directory if it names one (or its metadata file), else None.

    A local regular file is never a snapshot, whatever its name.
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    text = text.rstrip("/")
    head, _, name = text.rpartition("/")
    if name == METADATA_FNAME:
        text = head
        name = head.rpartition("/")[2]
    if SnapshotName.parse(name) is None:
        return None
    if "://" not in text and os.path.isfile(text):
        return None
    return text


def _resumes_mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether this fit continues an epoch that had consumed batches (Lightning loaded the train
    loader's position and created its iterator before ``on_train_start``)."""
    loop = trainer.fit_loop
    batches = loop.epoch_loop.batch_progress
    return loop.restarting and batches.current.ready > 0 and not batches.is_last_batch


def _seconds(interval: Any) -> Optional[float]:
    """``train_time_interval`` in seconds (None stays None); a ConfigError if it is no timedelta."""
    if interval is None:
        return None
    if not isinstance(interval, datetime.timedelta):
        raise ConfigError(
            f"train_time_interval must be a datetime.timedelta (e.g. timedelta(minutes=30)) or None, "
            f"got {interval!r} of type {type(interval).__name__}"
        )
    if interval <= datetime.timedelta(0):
        raise ConfigError(f"train_time_interval must be longer than zero, got {interval!r}")
    return interval.total_seconds()


def _same_rng_state(a: Any, b: Any) -> bool:
    """Whether two ``RNGState.state_dict()`` values are equal (tensors compared bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu().to(a.dtype))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_rng_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_rng_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _stop_like_lightning(signum: int) -> None:
    """After the preemption snapshot: stop the run the way Lightning stops on SIGTERM."""
    raise SIGTERMException(128 + int(signum))


class _Each:
    """A Stateful over a list of Statefuls (the optimizers, the LR schedulers).

    A count that does not match the snapshot loads none of them and is reported after the
    restore (so that every rank makes the same calls, and the restore fails as a whole).
    """

    def __init__(self, what: str, objects: Sequence[Any]) -> None:
        self.what = what
        self.objects = list(objects)
        self.mismatch: Optional[str] = None

    def state_dict(self) -> list[Any]:
        return [obj.state_dict() for obj in self.objects]

    def load_state_dict(self, states: list[Any]) -> None:
        if len(states) != len(self.objects):
            self.mismatch = (
                f"the snapshot holds {len(states)} {self.what}, {len(self.objects)} were given "
                "(none of them was loaded); pass them all, in the order configure_optimizers returns them"
            )
            return
        for obj, state in zip(self.objects, states, strict=True):
            obj.load_state_dict(state)


def _raise_mismatch(app_state: dict[str, Any]) -> None:
    problems = [e.mismatch for e in app_state.values() if isinstance(e, _Each) and e.mismatch]
    if problems:
        raise StateMismatchError("; ".join(problems))


def _restore_state(
    module: Any, optimizers: Optional[Sequence[Any]], lr_schedulers: Optional[Sequence[Any]]
) -> dict[str, Any]:
    app_state: dict[str, Any] = {"state_dict": module}
    if optimizers is not None:
        app_state["optimizer_states"] = _Each("optimizer states", optimizers)
    if lr_schedulers is not None:
        app_state["lr_schedulers"] = _Each("LR scheduler states", lr_schedulers)
    return app_state


def _not_started(intra_epoch: bool) -> dict[str, Value]:
    raise RuntimeError(
        "TorchSnapshotSaver.on_train_start was not called before a snapshot was due; pass the "
        "saver in Trainer(callbacks=[...]), which calls its hooks in order"
    )
