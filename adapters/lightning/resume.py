"""Resuming a Lightning fit from a snapshot: ``ckpt_path="last"`` resolved to the newest
complete snapshot (``ModelCheckpoint._find_last_checkpoints``), or to the newest
``ModelCheckpoint`` ``.ckpt`` file of the dirpath when no snapshot is newer (a run switched to
the saver resumes from it once), the snapshot-reading CheckpointIO installed for the stage and
put back after it, the snapshot resumed from kept out of retention's reach, and the RNG state
set again around a mid-epoch resume's first batch."""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from pytorch_lightning.utilities.rank_zero import rank_zero_info

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.adapters.lightning.engine import Engine
from tnt_snapshot_plugin.adapters.lightning.io import SnapshotCheckpointIO, check_strategy_can_resume
from tnt_snapshot_plugin.app_state import RNGState
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import ConfigError, ImplicitResumeWarning, NothingToRestoreWarning
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.restoring.latest import found_in, warn_passed_over
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.stores import LocalStore, open_store, split_snapshot_path

_NOT_ASKED = "<not asked>"
#: Lightning's advice when ``ckpt_path="last"`` finds nothing, which names ModelCheckpoint's
#: ``save_last``; the saver says what applies instead (see ``_find_last_checkpoints``).
_LAST_HINT = r'\.\w+\(ckpt_path="last"\) is set, but there is no last checkpoint available'
#: The files ``ModelCheckpoint`` writes: ``last.ckpt`` (``last-v1.ckpt``, ...) and its default
#: ``epoch=E-step=S.ckpt`` (and what a ``filename`` template adds after it).
_MODEL_CHECKPOINT = re.compile(r"(last(-v\d+)?|epoch=\d+-step=\d+.*)\.ckpt")


class Resume:
    """How the Lightning saver resumes a fit: what ``ckpt_path="last"`` resolves to, the
    snapshot-reading CheckpointIO installed for a stage and put back after it, the snapshot
    resumed from kept out of retention's reach, and the RNG set again around a mid-epoch
    resume's first batch."""

    def __init__(self, config: SnapshotConfig, engine: Engine, weights_only: bool) -> None:
        self._config = config
        self._engine = engine
        self._weights_only = weights_only
        #: the CheckpointIO installed for the stage (None outside one)
        self.io: Optional[SnapshotCheckpointIO] = None
        self._resolved_last: Optional[str] = _NOT_ASKED
        self._hint_filter: Optional[Any] = None
        #: the snapshot ckpt_path="last" resolved to for this fit (announced at train start)
        self._last_asked: Optional[str] = None
        #: the ModelCheckpoint file ckpt_path="last" resolved to (None: a snapshot, or nothing)
        self._from_ckpt: Optional[str] = None
        self._rng_after_first_fetch: Optional[dict[str, Any]] = None

    @property
    def dirpath(self) -> Optional[str]:
        return self._engine.dirpath

    @property
    def ckpt_path(self) -> Optional[str]:
        """The newest complete, undamaged snapshot in ``dirpath``, or None (also while ``dirpath``
        is not resolved yet, and for an ``s3://`` dirpath: pass the snapshot's URL as
        ``ckpt_path`` there). What ``fit(ckpt_path="last")`` resumes from."""
        if self.dirpath is None:
            return None
        store = open_store(self.dirpath, self._config.storage_options)
        if not isinstance(store, LocalStore):
            return None
        return restoring.latest_snapshot(
            self.dirpath,
            storage_options=self._config.storage_options,
            collectives=Collectives(None),
            verified=True,
            torchtitan=False,  # torchtitan's checkpoints map onto a torchtnt unit, not a LightningModule
        )

    def find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """What Lightning asks each ``ModelCheckpoint`` for ``ckpt_path="last"`` (before any
        ``setup``): the newest complete snapshot, read by each rank itself (``setup`` then checks
        that every rank found the same one)."""
        self._engine.resolve(trainer)
        assert self.dirpath is not None
        store = open_store(self.dirpath, self._config.storage_options)
        if not isinstance(store, LocalStore):
            if trainer.is_global_zero:
                warnings.warn(
                    f'ckpt_path="last" cannot find snapshots in {self.dirpath}: Lightning only looks '
                    "at local files for it, so training starts from the beginning; pass "
                    "ckpt_path=<the snapshot's URL> to resume from one",
                    NothingToRestoreWarning,
                    stacklevel=2,
                )
            self._resolved_last = None
            return set()
        path = self.ckpt_path
        if trainer.is_global_zero and path is not None:
            warn_passed_over(store, split_snapshot_path(path)[1])
        ckpt = newer_model_checkpoint(store.root, path)
        self._from_ckpt = ckpt
        if ckpt is not None:
            path = ckpt
        self._resolved_last = path
        if path is None:
            found = found_in(store)
            if found.empty:  # a first run: what ckpt_path="last" is for
                rank_zero_info(
                    f'TorchSnapshotSaver: ckpt_path="last": no complete snapshot in {self.dirpath} '
                    "yet; training starts from the beginning."
                )
            elif trainer.is_global_zero:
                warnings.warn(
                    f'ckpt_path="last": dirpath {self.dirpath} {found.text}: nothing was restored '
                    f"and training starts from the beginning; {found.advice}",
                    NothingToRestoreWarning,
                    stacklevel=2,
                )
            # Lightning's own message for this case advises ModelCheckpoint(save_last=True),
            # which does not apply to snapshots; silenced until setup(), which comes next.
            warnings.filterwarnings("ignore", message=_LAST_HINT)
            self._hint_filter = warnings.filters[0]
            return set()
        return {path}

    def drop_hint_filter(self) -> None:
        entry, self._hint_filter = self._hint_filter, None
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
        if entry is not None and entry in filters:
            filters.remove(entry)
            warnings._filters_mutated()  # type: ignore[attr-defined]

    def setup(self, trainer: pl.Trainer) -> None:
        """Resolve ``dirpath`` if none was given, join the process group, install the
        snapshot-reading CheckpointIO (before Lightning loads ``ckpt_path``), check that all
        ranks resolved ``ckpt_path="last"`` alike, and say so when the run resumes from a
        snapshot that ``ckpt_path`` did not name."""
        self.drop_hint_filter()
        snapshotter = self._engine.resolve(trainer)
        snapshotter.attach()
        check_strategy_can_resume(trainer)
        self.io = SnapshotCheckpointIO.install(
            trainer,
            storage_options=self._config.storage_options,
            collectives=lambda: self._engine.required.collectives,
            plugin_manager=snapshotter.plugin_manager,
            weights_only=self._weights_only,
            collective_timeout_s=self._config.collective_timeout_s,
        )
        resolved, self._resolved_last = self._resolved_last, _NOT_ASKED
        # ckpt_path="last" resolved to this snapshot: if it cannot be loaded, the ones before it
        # are tried, as restore_from_latest does; to a ModelCheckpoint file: loaded safely.
        from_ckpt, self._from_ckpt = self._from_ckpt, None
        self.io.fall_back_from = resolved if resolved != _NOT_ASKED and from_ckpt is None else None
        self.io.model_checkpoint = from_ckpt
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

    def announce(self, trainer: pl.Trainer) -> None:
        """Say, in one line, that this fit resumes from the snapshot that ``"last"`` resolved
        to; a warning when ``ckpt_path`` did not ask for it (another OnExceptionCheckpoint made
        Lightning turn ``None`` into ``"last"``)."""
        resolved, self._last_asked = self._last_asked, None
        if resolved is None or trainer.ckpt_path != resolved or not trainer.is_global_zero:
            return
        others = [
            type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)  # type: ignore[attr-defined]
        ]
        if others:
            warnings.warn(
                f"TorchSnapshotSaver: resuming from snapshot {resolved}, the newest in "
                f'{self.dirpath} (ckpt_path="last", which Lightning also makes of '
                f"fit(ckpt_path=None) when an OnExceptionCheckpoint is present: "
                f"{', '.join(others)}); to start fresh, use a new dirpath or remove that callback",
                category=ImplicitResumeWarning, stacklevel=3,
            )
        elif resolved.endswith(".ckpt"):
            rank_zero_info(
                f'TorchSnapshotSaver: ckpt_path="last": resuming from ModelCheckpoint\'s {resolved}, '
                f"newer than every snapshot in {self.dirpath}; snapshots are taken from here on"
            )
        else:
            rank_zero_info(f'TorchSnapshotSaver: ckpt_path="last": resuming from snapshot {resolved}')

    def at_train_start(self, trainer: pl.Trainer, snapshotter: Snapshotter) -> None:
        """Keep the snapshot resumed from out of retention's reach; (mid-epoch resume) set the
        RNG again."""
        restored = self.io.take_restored() if self.io is not None else None
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

    def at_batch_start(self) -> None:
        """(First batch of a mid-epoch resume from a lazy loader) undo its iterator's RNG draws."""
        if self._rng_after_first_fetch is not None:
            state, self._rng_after_first_fetch = self._rng_after_first_fetch, None
            if not _same_rng_state(RNGState().state_dict(), state):
                RNGState().load_state_dict(state)

    def leave_stage(self, trainer: pl.Trainer) -> None:
        """After a stage (its end, or an exception): drop the warning filter and put the
        Trainer's own CheckpointIO back."""
        self.drop_hint_filter()
        if self.io is not None:
            self.io.uninstall(trainer)


def newer_model_checkpoint(dirpath: str, snapshot: Optional[str]) -> Optional[str]:
    """The newest ``ModelCheckpoint`` file in local ``dirpath`` (by modification time) when it is
    newer than ``snapshot`` (the newest snapshot's path, its metadata file's time; None: no
    snapshot), else None."""
    try:
        with os.scandir(dirpath) as entries:
            found = [
                (e.stat(follow_symlinks=False).st_mtime, e.path)
                for e in entries
                if e.is_file(follow_symlinks=False) and _MODEL_CHECKPOINT.fullmatch(e.name)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not found:
        return None
    mtime, newest = max(found)
    if snapshot is not None:
        times = [
            os.stat(os.path.join(snapshot, name)).st_mtime
            for name in metadata_files()
            if os.path.isfile(os.path.join(snapshot, name))
        ]
        if times and max(times) >= mtime:
            return None
    return os.path.normpath(newest)


def _resumes_mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether this fit continues an epoch that had consumed batches (Lightning loaded the train
    loader's position and created its iterator before ``on_train_start``)."""
    loop = trainer.fit_loop
    batches = loop.epoch_loop.batch_progress
    return loop.restarting and batches.current.ready > 0 and not batches.is_last_batch



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

