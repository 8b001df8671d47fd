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
  ``best_model_path``, the best complete snapshot by ``monitor`` found in ``dirpath``.
* In ``setup()`` the saver wraps the strategy's ``CheckpointIO`` in a :class:`SnapshotCheckpointIO`,
  which reads a snapshot directory into Lightning's checkpoint dict (and sets the RNG state) and
  hands every other path to the ``CheckpointIO`` it wraps, so ``ModelCheckpoint`` works as before.
  Lightning then restores that dict as it restores its own checkpoints.
"""

from __future__ import annotations

import datetime
import logging
import math
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
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import SIGTERMException
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.app_state import RESERVED_KEYS, RNG_STATE_KEY, RNGState, Value
from tnt_snapshot_plugin.config import SnapshotConfig, positive_int_or_none, resolve_alias
from tnt_snapshot_plugin.distributed import Collectives, is_initialized
from tnt_snapshot_plugin.errors import (
    ConfigError,
    KeyCollisionError,
    SnapshotNotFoundError,
    StateMismatchError,
)
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.plugins import check_plugin, new_plugin_manager
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

#: ``ModelCheckpoint`` arguments that have no meaning for a snapshot saver, and what to do instead.
NOT_APPLICABLE = {
    "filename": (
        "snapshot names are fixed (epoch_{E}_step_{S}, then _<monitor>=<value> when monitor is "
        'set) so that ckpt_path="last", retention and restore can parse them; leave it out'
    ),
    "save_weights_only": (
        "a snapshot always holds the whole training state; leave it out, and load only the "
        "weights with TorchSnapshotSaver.restore(path, model)"
    ),
    "auto_insert_metric_name": (
        "the monitored metric's name is always in the snapshot's name (..._<monitor>=<value>, a "
        "'/' written %2F); leave it out"
    ),
    "enable_version_counter": (
        "snapshot names never collide (a state already saved is not written again); leave it out"
    ),
    "save_on_exception": (
        "on an exception the pending snapshot is finished and every committed snapshot kept; "
        "leave it out, and use preemption_signals for a snapshot when the job is preempted"
    ),
}

_NOT_ASKED = "<not asked>"
#: Lightning's advice when ``ckpt_path="last"`` finds nothing, which names ModelCheckpoint's
#: ``save_last``; the saver says what applies instead (see ``_find_last_checkpoints``).
_LAST_HINT = r'\.\w+\(ckpt_path="last"\) is set, but there is no last checkpoint available'
_log = logging.getLogger(__name__)


class InvalidArgumentError(ConfigError, MisconfigurationException):
    """An argument value that Lightning's ``ModelCheckpoint`` refuses too (with a
    ``MisconfigurationException``, which this error also is)."""


class TorchSnapshotSaver(ModelCheckpoint):
    """Snapshot a Lightning run's whole training state in torchsnapshot's format; resume it exactly.

    Use it when a run must survive crashes and preemption without losing more than a few steps,
    and without stalling training while a checkpoint is written. It takes ``ModelCheckpoint``'s
    arguments with ``ModelCheckpoint``'s meanings (the differences are listed below and in the
    README), so replacing ``ModelCheckpoint(...)`` by ``TorchSnapshotSaver(...)`` is the switch.
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
        save_last: Optional[Union[bool, str]] = None,
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
        **not_applicable: Any,
    ) -> None:
        # ModelCheckpoint.__init__ configures the .ckpt files this class replaces by snapshots.
        Callback.__init__(self)
        refused = sorted(set(not_applicable) & set(NOT_APPLICABLE))
        if refused:
            name = refused[0]
            raise ConfigError(
                f"TorchSnapshotSaver({name}=...): ModelCheckpoint's {name} has no meaning for a "
                f"snapshot saver: {NOT_APPLICABLE[name]}"
            )
        if not_applicable:
            raise TypeError(
                f"TorchSnapshotSaver() got an unexpected keyword argument {sorted(not_applicable)[0]!r}"
            )
        # What a copy in another process is rebuilt from (strategy="ddp_spawn" pickles callbacks).
        self._arguments = dict(
            dirpath=dirpath,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            mode=mode,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            save_every_n_train_steps=save_every_n_train_steps,
            save_every_n_epochs=save_every_n_epochs,
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
        )
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(verbose, bool):
            raise ConfigError(f"verbose must be True or False, got {verbose!r}")
        if save_last not in (None, True, False, "link"):
            raise ConfigError(f"save_last must be None, True, False or 'link', got {save_last!r}")
        if save_on_train_epoch_end not in (None, True, False):
            raise ConfigError(
                f"save_on_train_epoch_end must be None, True or False, got {save_on_train_epoch_end!r}"
            )
        steps = _every("every_n_train_steps", every_n_train_steps, "save_every_n_train_steps", save_every_n_train_steps)
        epochs = _every("every_n_epochs", every_n_epochs, "save_every_n_epochs", save_every_n_epochs)
        if steps is None and epochs is None and train_time_interval is None:
            epochs = 1  # ModelCheckpoint's default: every epoch
        best_k, keep_last_n_snapshots, keep_last_n_checkpoints = _retention(
            monitor, save_top_k, keep_last_n_snapshots, keep_last_n_checkpoints
        )
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._weights_only = weights_only
        self._portable = process_group is None and plugin_manager is None
        self._config = SnapshotConfig.build(
            save_every_n_train_steps=steps or None,
            save_every_n_epochs=epochs or None,
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
            best_k=best_k,
            names={"best_metric": "monitor", "best_mode": "mode", "best_k": "save_top_k"},
        )
        self._given_dirpath = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath
        if isinstance(self._given_dirpath, str) and self._given_dirpath.startswith("~"):
            self._given_dirpath = os.path.expanduser(self._given_dirpath)  # as ModelCheckpoint does
        self._process_group = process_group
        self._plugin_manager = plugin_manager if plugin_manager is not None else new_plugin_manager()
        self._engine: Optional[Snapshotter] = None
        if self._given_dirpath is not None:
            self._make_engine(self._given_dirpath)
        self._trainer: Optional[pl.Trainer] = None
        self._collect: Callable[[bool], dict[str, Value]] = _not_started
        self._warned_unlogged = False
        self._io: Optional[SnapshotCheckpointIO] = None
        self._last_step: Optional[int] = None
        self._last_committed: Optional[str] = None
        self._resolved_last: Optional[str] = _NOT_ASKED
        self._hint_filter: Optional[Any] = None
        #: the snapshot ckpt_path="last" resolved to for this fit (announced at train start)
        self._last_asked: Optional[str] = None
        self._rng_after_first_fetch: Optional[dict[str, Any]] = None
        #: (epoch, step) of the last snapshot this run took (the final one is not taken again)
        self._saved_at: Optional[tuple[int, int]] = None
        self._announced = 0

    def _make_engine(self, dirpath: str) -> Snapshotter:
        self._engine = Snapshotter(
            dirpath,
            self._config,
            process_group=self._process_group,
            plugin_manager=self._plugin_manager,
            never_replicated=NEVER_REPLICATED,
            on_preempted=_stop_like_lightning,
            weights_only=self._weights_only,
            metric=self._monitored_value if self._config.best is not None else None,
        )
        return self._engine

    def _resolve_dirpath(self, trainer: pl.Trainer) -> Snapshotter:
        """The engine, made on first use with ``dirpath`` resolved as ``ModelCheckpoint`` does."""
        if self._engine is None:
            if trainer.loggers:
                first = trainer.loggers[0]
                save_dir = first.save_dir if first.save_dir is not None else trainer.default_root_dir
                version = first.version if isinstance(first.version, str) else f"version_{first.version}"
                path = os.path.join(save_dir, str(first.name), version, "checkpoints")
            else:
                path = os.path.join(trainer.default_root_dir, "checkpoints")
            self._make_engine(path)
        assert self._engine is not None
        return self._engine

    @property
    def _snapshotter(self) -> Snapshotter:
        if self._engine is None:
            raise ConfigError(
                "TorchSnapshotSaver(dirpath=None) has no dirpath until the Trainer's setup "
                "resolves it (under the logger's directory or default_root_dir, as "
                "ModelCheckpoint does); pass dirpath to use it before training"
            )
        return self._engine

    def __getstate__(self) -> dict[str, Any]:
        """What ``strategy="ddp_spawn"`` sends to each new process: the arguments, not the engine."""
        if not self._portable:
            raise TypeError(
                "a TorchSnapshotSaver given its own process_group or plugin_manager (or plugins) cannot be sent "
                'to another process (strategy="ddp_spawn" pickles the callbacks); create it in '
                'the training process, or use strategy="ddp"'
            )
        if (self._engine is not None and self._engine.stats.committed) or self._io is not None:
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
    def dirpath(self) -> Optional[str]:  # type: ignore[override]
        """Parent directory the snapshots are saved to (rank 0's, once training started); None
        until ``setup`` resolves it when none was given."""
        return self._engine.dirpath if self._engine is not None else None

    @dirpath.setter
    def dirpath(self, value: Any) -> None:
        raise AttributeError("TorchSnapshotSaver.dirpath is set by its constructor (or resolved at setup)")

    @property
    def snapshotter(self) -> Snapshotter:
        """The framework-neutral engine (stats, wait(), the plugin manager)."""
        return self._snapshotter

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register a plugin on this saver only, checked at once (:meth:`Snapshotter.register`)."""
        self._portable = False  # a registered plugin would not travel with ddp_spawn's pickle
        if self._engine is not None:
            return self._engine.register(plugin, name)
        return check_plugin(self._plugin_manager, plugin, name)

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver."""
        if self._engine is not None:
            self._engine.unregister(plugin)
        else:
            self._plugin_manager.unregister(plugin)

    @property
    def every_n_epochs(self) -> Optional[int]:  # type: ignore[override]
        """The epoch cadence (None: no epoch snapshots)."""
        return self._config.save_every_n_epochs

    @property
    def ckpt_path(self) -> Optional[str]:
        """The newest complete, undamaged snapshot in ``dirpath``, or None (also while ``dirpath``
        is not resolved yet, and for an ``s3://`` dirpath: pass the snapshot's URL as
        ``ckpt_path`` there). What ``fit(ckpt_path="last")`` resumes from."""
        if self._engine is None:
            return None
        store = open_store(self.dirpath, self._config.storage_options)
        if not isinstance(store, LocalStore):
            return None
        return restoring.latest_snapshot(
            self.dirpath,
            storage_options=self._config.storage_options,
            collectives=Collectives(None),
            verified=True,
        )

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """What Lightning asks each ``ModelCheckpoint`` for ``ckpt_path="last"`` (before any
        ``setup``): the newest complete snapshot, read by each rank itself (``setup`` then checks
        that every rank found the same one)."""
        self._resolve_dirpath(trainer)
        store = open_store(self.dirpath, self._config.storage_options)
        if not isinstance(store, LocalStore):
            warnings.warn(
                f'ckpt_path="last" cannot find snapshots in {self.dirpath}: Lightning only looks at '
                "local files for it; pass ckpt_path=<the snapshot's URL> to resume from one",
                stacklevel=2,
            )
            self._resolved_last = None
            return set()
        path = self.ckpt_path
        self._resolved_last = path
        if path is None:
            rank_zero_info(
                f'TorchSnapshotSaver: ckpt_path="last": no complete snapshot in {self.dirpath} '
                "yet; training starts from the beginning."
            )
            # Lightning's own message for this case advises ModelCheckpoint(save_last=True),
            # which does not apply to snapshots; silenced until setup(), which comes next.
            warnings.filterwarnings("ignore", message=_LAST_HINT)
            self._hint_filter = warnings.filters[0]
            return set()
        return {path}

    def _drop_hint_filter(self) -> None:
        entry, self._hint_filter = self._hint_filter, None
        if entry is not None and entry in warnings.filters:
            warnings.filters.remove(entry)
            warnings._filters_mutated()  # type: ignore[attr-defined]

    @property
    def monitor(self) -> Optional[str]:  # type: ignore[override]
        """The metric that ranks the snapshots (None: none)."""
        best = self._config.best
        return best.metric if best is not None else None

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self._arguments["mode"]

    @property
    def best_model_path(self) -> str:  # type: ignore[override]
        """The best complete snapshot in ``dirpath`` by ``monitor`` ("" if none carries it, or no
        ``monitor`` is set): what Lightning loads for ``ckpt_path="best"``
        (``fit``/``validate``/``test``/``predict``). Read from the directory (the snapshots' names
        and indexes), so it is true in a new process and after a resume too."""
        found = self._best()
        return found[0] if found is not None else ""

    @best_model_path.setter
    def best_model_path(self, value: str) -> None:
        """Ignored (``strategy="ddp_spawn"`` hands the worker's value back): it is read from
        ``dirpath``."""

    @property
    def best_model_score(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        """``monitor``'s value in :attr:`best_model_path` (None if there is none), as a tensor
        like ``ModelCheckpoint``'s; a NaN value reads as +inf (``mode="min"``) or -inf
        (``"max"``), as ``ModelCheckpoint`` reports it."""
        found = self._best()
        return self._score(found[1]) if found is not None else None

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The ``save_top_k`` best complete snapshots in ``dirpath`` (every ranked one for -1),
        best first: path -> ``monitor``'s value, as ``ModelCheckpoint``'s ``best_k_models`` (a NaN
        reads as :attr:`best_model_score` says). Empty without ``monitor``."""
        return {path: self._score(value) for path, value in self._ranked()}

    @property
    def kth_best_model_path(self) -> str:  # type: ignore[override]
        """The worst of :attr:`best_k_models` ("" if none)."""
        ranked = self._ranked()
        return ranked[-1][0] if ranked else ""

    @property
    def last_model_path(self) -> str:  # type: ignore[override]
        """The newest complete snapshot (what ``ckpt_path="last"`` resumes), "" if none."""
        return self.ckpt_path or ""

    @override
    def to_yaml(self, filepath: Optional[Any] = None) -> None:
        """Write :attr:`best_k_models` (path -> value) as YAML to ``filepath`` (default:
        ``dirpath/best_k_models.yaml``, a local ``dirpath`` only), as ``ModelCheckpoint`` does."""
        import yaml

        if filepath is None:
            if self.dirpath is None or not isinstance(
                open_store(self.dirpath, self._config.storage_options), LocalStore
            ):
                raise ConfigError(
                    f"to_yaml() writes into a local dirpath only (dirpath is {self.dirpath!r}); "
                    "pass filepath=<a local file>"
                )
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as f:
            yaml.dump({path: value.item() for path, value in self.best_k_models.items()}, f)

    def _score(self, value: float) -> torch.Tensor:
        if math.isnan(value):
            value = math.inf if self.mode == "min" else -math.inf
        return torch.tensor(value)

    def _ranked(self) -> list[tuple[str, float]]:
        """(path, value) of the best ``save_top_k`` snapshots in ``dirpath``, best first."""
        best = self._config.best
        if best is None or self._engine is None:
            return []
        from tnt_snapshot_plugin import retention

        store = open_store(self.dirpath, self._config.storage_options)
        ranked = retention.ranked(store.listed(), best.metric, best.mode)
        if best.k is not None:
            ranked = ranked[: best.k]
        found = []
        for record in ranked:
            value = record.metric_value(best.metric)
            assert value is not None
            found.append((store.child(record.text), value))
        return found

    def _best(self) -> Optional[tuple[str, float]]:
        ranked = self._ranked()
        return ranked[0] if ranked else None

    def _monitored_value(self) -> Optional[tuple[str, float]]:
        """(monitor, value) from ``trainer.callback_metrics`` now (a snapshot is being taken);
        ``epoch`` and ``step`` are the trainer's unless logged, as in ``ModelCheckpoint``."""
        monitor = self.monitor
        trainer = self._trainer
        assert monitor is not None and trainer is not None
        metrics = dict(trainer.callback_metrics)
        for name, own in (("epoch", trainer.current_epoch), ("step", trainer.global_step)):
            if not isinstance(metrics.get(name), torch.Tensor):
                metrics[name] = torch.tensor(own)
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
        committed = self._engine.stats.committed if self._engine is not None else []
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
        """Resolve ``dirpath`` if none was given, join the process group, install the
        snapshot-reading CheckpointIO (before Lightning loads ``ckpt_path``), check that all
        ranks resolved ``ckpt_path="last"`` alike, and say so when the run resumes from a
        snapshot that ``ckpt_path`` did not name."""
        self._drop_hint_filter()
        self._trainer = trainer
        snapshotter = self._resolve_dirpath(trainer)
        snapshotter.attach()
        _check_strategy_can_resume(trainer)
        self._io = SnapshotCheckpointIO.install(
            trainer,
            storage_options=self._config.storage_options,
            collectives=lambda: self._snapshotter.collectives,
            plugin_manager=snapshotter.plugin_manager,
            weights_only=self._weights_only,
            collective_timeout_s=self._config.collective_timeout_s,
        )
        resolved, self._resolved_last = self._resolved_last, _NOT_ASKED
        # ckpt_path="last" resolved to this snapshot: if it cannot be loaded, the ones before it
        # are tried, as restore_from_latest does.
        self._io.fall_back_from = resolved if resolved != _NOT_ASKED else None
        coll = snapshotter.collectives
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
        self._last_asked = resolved if resolved != _NOT_ASKED else None

    def _announce_resume(self, trainer: pl.Trainer) -> None:
        """Say, in one line, that this fit resumes from the snapshot that ``"last"`` resolved
        to; a warning when ``ckpt_path`` did not ask for it (another OnExceptionCheckpoint made
        Lightning turn ``None`` into ``"last"``)."""
        resolved, self._last_asked = self._last_asked, None
        if resolved is None or trainer.ckpt_path != resolved or not trainer.is_global_zero:
            return
        others = [
            type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)
        ]
        if others:
            warnings.warn(
                f"TorchSnapshotSaver: resuming from snapshot {resolved}, the newest in "
                f'{self.dirpath} (ckpt_path="last", which Lightning also makes of '
                f"fit(ckpt_path=None) when an OnExceptionCheckpoint is present: "
                f"{', '.join(others)}); to start fresh, use a new dirpath or remove that callback",
                stacklevel=3,
            )
        else:
            rank_zero_info(f'TorchSnapshotSaver: ckpt_path="last": resuming from snapshot {resolved}')

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the state keys, watch for preemption, keep the resumed-from snapshot out of
        retention's reach, and (mid-epoch resume) set the RNG again."""
        self._trainer = trainer
        self._collect = self._collector(trainer)  # built once per run, not on every batch
        self._last_step = trainer.global_step
        self._rng_after_first_fetch = None
        self._saved_at = None
        snapshotter = self._snapshotter
        self._announce_resume(trainer)
        snapshotter.train_start(LIGHTNING_KEYS, trainer.current_epoch, trainer.global_step)
        # The staging buffers of asynchronous snapshots, allocated and touched before training, for
        # the bulk of what dump_checkpoint returns (without calling it: it runs the user's hooks).
        snapshotter.prepare(
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

            snapshotter.report_metrics(log_metrics)
        restored = self._io.take_restored() if self._io is not None else None
        # As ModelCheckpoint never removes the checkpoint the Trainer resumed from, retention
        # never deletes the snapshot this run resumed from (if it is one of this dirpath's).
        snapshotter.protected.clear()
        if restored is not None:
            parent, name = split_snapshot_path(restored.path)
            if parent.rstrip("/") == snapshotter.dirpath.rstrip("/"):
                snapshotter.protected.add(name)
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
        """Wait for the pending snapshot; the newest complete snapshot stays intact."""
        self._drop_hint_filter()
        if self._engine is not None:
            self._engine.exception()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep every snapshot."""
        self._drop_hint_filter()

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
        collective_timeout_s: float = 600.0,
    ) -> None:
        """Load snapshot ``path``'s weights into ``module`` (and optimizer / LR scheduler states).

        For evaluation or fine-tuning outside ``fit``; to resume training use
        ``trainer.fit(model, ckpt_path=path)``. ``module`` is the LightningModule (or any module
        with the same ``state_dict`` keys); ``optimizers`` / ``lr_schedulers`` are lists in the
        order ``configure_optimizers`` returns them. The RNG state is restored too. Raises
        SnapshotNotFoundError if ``path`` is not a complete snapshot, StateMismatchError if the
        module or the number of optimizers does not match it. ``weights_only=False`` loads the
        snapshot's objects with full pickle (trusted snapshots only). ``collective_timeout_s``:
        how long a collective of the restore (under torch.distributed) waits for a failed rank.
        """
        app_state = _restore_state(module, optimizers, lr_schedulers)
        timeout = _timeout(collective_timeout_s)
        with Collectives.create(process_group, timeout, for_restore=True) as collectives:
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
        collective_timeout_s: float = 600.0,
    ) -> bool:
        """:meth:`restore` the newest complete snapshot in ``dirpath``.

        Returns True if one was restored, False if ``dirpath`` is missing, empty or holds no
        complete snapshot. A damaged newest snapshot is skipped with a warning and the previous
        one restored (``fallback=False`` raises SnapshotCorruptError instead). ``weights_only``,
        ``collective_timeout_s``: as :meth:`restore`.
        """
        app_state = _restore_state(module, optimizers, lr_schedulers)
        timeout = _timeout(collective_timeout_s)
        with Collectives.create(process_group, timeout, for_restore=True) as collectives:
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
        collective_timeout_s: float = 600.0,
    ) -> None:
        self.checkpoint_io = checkpoint_io
        #: how long a collective of a load waits for a failed rank (when ``collectives`` is None)
        self.collective_timeout_s = _timeout(collective_timeout_s)
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
        collective_timeout_s: float = 600.0,
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
        io.collective_timeout_s = _timeout(collective_timeout_s)
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
            # collective: every rank loads
            self._own_collectives = Collectives.create(None, self.collective_timeout_s)
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


def _every(name: str, value: Any, torchtnt_name: str, torchtnt_value: Any) -> Optional[int]:
    """A cadence given under ModelCheckpoint's ``name`` (None: not given, 0: off, n >= 1) or
    torchtnt's ``torchtnt_name`` (>= 1, checked by the config): the count, 0 (off) or None."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(
                f"{name} must be an int >= 0 (0: no snapshots by it) or None, got {value!r} of "
                f"type {type(value).__name__}"
            )
        if value < 0:
            raise InvalidArgumentError(f"{name} must be >= 0 (0: no snapshots by it) or None, got {value}")
    return resolve_alias(
        name, value, torchtnt_name, positive_int_or_none(torchtnt_name, torchtnt_value), None
    )


def _retention(
    monitor: Optional[str], save_top_k: Any, keep_last: Any, keep_last_alias: Any
) -> tuple[Optional[int], Any, Any]:
    """``save_top_k`` as (the core's best-k count, keep_last_n_snapshots, keep_last_n_checkpoints).

    With ``monitor``: k (None for -1: every one); default 1. Without: 1 keeps the newest only
    (``keep_last_n_snapshots=1``), -1 or None every one. Values ModelCheckpoint refuses raise
    InvalidArgumentError; 0 (ModelCheckpoint: save nothing) raises ConfigError.
    """
    if save_top_k is None:
        return (1 if monitor is not None else None), keep_last, keep_last_alias
    if isinstance(save_top_k, bool) or not isinstance(save_top_k, int):
        raise InvalidArgumentError(
            f"save_top_k must be an int (-1: keep every snapshot, k >= 1), got {save_top_k!r}"
        )
    if save_top_k < -1:
        raise InvalidArgumentError(f"save_top_k must be >= -1, got {save_top_k}")
    if save_top_k == 0:
        raise ConfigError(
            "save_top_k=0 (ModelCheckpoint: save nothing) has no meaning for a snapshot saver; "
            "to take no snapshots, leave the saver out of the Trainer's callbacks"
        )
    if monitor is not None:
        return (None if save_top_k == -1 else save_top_k), keep_last, keep_last_alias
    if save_top_k == -1:
        return None, keep_last, keep_last_alias
    if save_top_k == 1:
        given = keep_last if keep_last is not None else keep_last_alias
        if given is not None and given != 1:
            raise ConfigError(
                f"save_top_k=1 without monitor keeps only the newest snapshot, which contradicts "
                f"keep_last_n_snapshots={given!r}; pass one of them"
            )
        return None, 1, None
    raise InvalidArgumentError(
        f"save_top_k={save_top_k} with monitor=None: there is no metric to rank snapshots by; "
        "pass monitor='<a logged metric>', or save_top_k=1 (keep the newest) or -1 (keep every "
        "one), or keep the newest k with keep_last_n_snapshots=k"
    )


def _timeout(seconds: Any) -> float:
    """``collective_timeout_s`` validated as the saver's is (ConfigError otherwise)."""
    return SnapshotConfig.build(collective_timeout_s=seconds, preemption_signals=()).collective_timeout_s


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
