"""The Lightning saver's engine, the core :class:`Snapshotter`: made when ``dirpath`` is known
(given, or resolved at ``setup`` as ``ModelCheckpoint`` resolves it), the plugins registered on
it, what a ``strategy="ddp_spawn"`` worker rebuilds it from, and the callback state Lightning
keeps in its own checkpoints."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pluggy
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.hooks import check_plugin, new_plugin_manager
from tnt_snapshot_plugin.saving.saver import Snapshotter

#: Entries that can differ between ranks (per-rank loader positions, callback states).
NEVER_REPLICATED = ("loops", "callbacks")


class SaverEngine(ModelCheckpoint):
    """The engine part of the Lightning ``TorchSnapshotSaver`` (a base of it, never used alone)."""

    _arguments: dict[str, Any]
    _config: SnapshotConfig
    _weights_only: bool
    _io: Optional[Any]
    _monitored_value: Callable[[], Optional[tuple[str, float]]]

    def _init_engine(
        self, dirpath: Any, process_group: Optional[Any], plugin_manager: Optional[pluggy.PluginManager]
    ) -> None:
        self._portable = process_group is None and plugin_manager is None
        self._given_dirpath = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath
        if isinstance(self._given_dirpath, str) and self._given_dirpath.startswith("~"):
            self._given_dirpath = os.path.expanduser(self._given_dirpath)  # as ModelCheckpoint does
        self._process_group = process_group
        self._plugin_manager = plugin_manager if plugin_manager is not None else new_plugin_manager()
        self._engine: Optional[Snapshotter] = None
        self._last_committed: Optional[str] = None
        if self._given_dirpath is not None:
            self._make_engine(self._given_dirpath)

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



def _stop_like_lightning(signum: int) -> None:
    """After the preemption snapshot: stop the run the way Lightning stops on SIGTERM."""
    raise SIGTERMException(128 + int(signum))
