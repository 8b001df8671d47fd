"""The Lightning CheckpointIO that reads snapshots: ``trainer.fit(ckpt_path=<a snapshot>)``
loads a snapshot directory into Lightning's checkpoint dict, every other path goes to the
CheckpointIO it wraps; :meth:`SnapshotCheckpointIO.install` puts one on a Trainer for one stage
and :meth:`SnapshotCheckpointIO.uninstall` puts the Trainer's own back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pluggy
import pytorch_lightning as pl
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.app_state import RNG_STATE_KEY, RNGState
from tnt_snapshot_plugin.config import collective_timeout
from tnt_snapshot_plugin.distributed import Collectives, is_initialized
from tnt_snapshot_plugin.errors import (
    ConfigError,
    SnapshotNotFoundError,
    StateMismatchError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.format.objects import allowed_globals, refusal
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.restoring import RestoreRequest
from tnt_snapshot_plugin.stores import split_snapshot_path


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
    :class:`TorchSnapshotSaver` installs one in ``setup()`` and puts the Trainer's own back at
    ``teardown`` (or on an exception); without the saver, pass one to the
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
        self.collective_timeout_s = collective_timeout(collective_timeout_s)
        self.storage_options = storage_options
        self._collectives = collectives
        self._own_collectives: Optional[Collectives] = None
        self.plugin_manager = plugin_manager
        self.weights_only = weights_only
        #: A snapshot path (ckpt_path="last" resolved to it): if it cannot be loaded, the
        #: snapshots before it in its directory are tried, with a warning naming it.
        self.fall_back_from: Optional[str] = None
        #: A ModelCheckpoint file ckpt_path="last" resolved to: loaded with
        #: ``torch.load(weights_only=True)`` and the plugin's allow-list, whatever the wrapped IO.
        self.model_checkpoint: Optional[str] = None
        self._restored: Optional[Restored] = None
        self._installed = False  # by install(), in place of the Trainer's own

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
        """Wrap ``trainer``'s CheckpointIO in one of these (once), configured as given;
        :meth:`uninstall` puts the wrapped one back."""
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        if not isinstance(io, cls):
            io = cls(io)
            io._installed = True  # uninstall() puts the CheckpointIO it wraps back
            strategy.checkpoint_io = io
        io.storage_options = storage_options
        io._collectives = collectives
        io.plugin_manager = plugin_manager
        io.weights_only = weights_only
        io.collective_timeout_s = collective_timeout(collective_timeout_s)
        io.fall_back_from = None
        io.model_checkpoint = None
        io._restored = None
        return io

    def uninstall(self, trainer: pl.Trainer) -> None:
        """Put back on ``trainer`` the CheckpointIO that :meth:`install` replaced by this one (a
        SnapshotCheckpointIO the Trainer was given itself stays)."""
        strategy = trainer.strategy
        if self._installed and strategy.checkpoint_io is self:
            strategy.checkpoint_io = self.wrapped
            self._installed = False

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
        if snapshot is None and self.model_checkpoint is not None and os.fspath(path) == self.model_checkpoint:
            self.model_checkpoint = None
            return load_model_checkpoint(os.fspath(path), map_location)
        if snapshot is None:
            return self.wrapped.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        checkpoint: dict[str, Any] = {}
        full_pickle = weights_only is False or (weights_only is None and not self.weights_only)
        request = RestoreRequest(
            {}, storage_options=self.storage_options, collectives=self._get_collectives(),
            plugin_manager=self.plugin_manager, rest=checkpoint, weights_only=not full_pickle,
        )
        snapshot, keys = self._restore(request, snapshot)
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

    def _restore(self, request: RestoreRequest, snapshot: str) -> tuple[str, list[str]]:
        """(the snapshot restored, the keys loaded): ``snapshot`` (rank 0's), or the newest
        readable one up to it when ``ckpt_path="last"`` resolved to it."""
        assert request.collectives is not None
        snapshot = request.collectives.broadcast(snapshot)
        fall_back = self.fall_back_from is not None and snapshot == self.fall_back_from
        self.fall_back_from = None
        if not fall_back:
            return snapshot, request.restore(snapshot)
        dirpath, name = split_snapshot_path(snapshot)
        keys: list[str] = []  # the RNG state's only if restored (not on another world size)
        restored = restoring.restore_from_latest(dirpath, request=request, newest=name, loaded_keys=keys)
        if restored is None:
            raise SnapshotNotFoundError(f"snapshot {snapshot} is gone; pass an existing ckpt_path")
        return restored, keys

    def _get_collectives(self) -> Collectives:
        if self._collectives is not None:
            return self._collectives()
        if self._own_collectives is None or (is_initialized() and not self._own_collectives.distributed):
            # collective: every rank loads
            self._own_collectives = Collectives.create(None, self.collective_timeout_s)
        return self._own_collectives



def load_model_checkpoint(path: str, map_location: Optional[Any]) -> dict[str, Any]:
    """A ``ModelCheckpoint`` file, loaded with ``torch.load(weights_only=True)`` and the plugin's
    allow-list (``format.objects``); UnrestorableStateError naming what it refuses."""
    import pickle

    import torch

    with allowed_globals():
        try:
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnrestorableStateError(
                f"ModelCheckpoint file {path} holds an object that torch.load(weights_only=True) and "
                f"the plugin's allow-list refuse: {refusal(exc)}. If that class is safe, allow it "
                "with torch.serialization.add_safe_globals([...]) before fit; if you trust the file "
                f'(you wrote it), pass fit(..., ckpt_path="{path}", weights_only=False)'
            ) from exc
    missing = [key for key in ("state_dict", "pytorch-lightning_version") if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise StateMismatchError(
            f"{path} is not a Lightning checkpoint (no {' or '.join(missing)} in it): move it out of "
            "the saver's dirpath, or pass another ckpt_path"
        )
    return checkpoint


def check_strategy_can_resume(trainer: pl.Trainer) -> None:
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
    if name in metadata_files():
        text = head
        name = head.rpartition("/")[2]
    if SnapshotName.parse(name) is None:
        return None
    if "://" not in text and os.path.isfile(text):
        return None
    return text

