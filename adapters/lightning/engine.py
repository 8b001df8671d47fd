"""The Lightning saver's engine, the core :class:`Snapshotter`: made when ``dirpath`` is known
(given, or resolved at ``setup`` as ``ModelCheckpoint`` resolves it), and the plugins registered
on it."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pluggy
import pytorch_lightning as pl
from pytorch_lightning.utilities.exceptions import SIGTERMException

from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.hooks import check_plugin, new_plugin_manager
from tnt_snapshot_plugin.saving.saver import Snapshotter

#: Entries that can differ between ranks (per-rank loader positions, callback states).
NEVER_REPLICATED = ("loops", "callbacks")


class Engine:
    """The Lightning saver's core :class:`Snapshotter`, made once ``dirpath`` is known: at
    construction when given, else by :meth:`resolve` at ``setup``, as ``ModelCheckpoint``
    resolves it. ``metric``: the saver's monitored value (best-k), or None."""

    def __init__(
        self,
        config: SnapshotConfig,
        dirpath: Any,
        *,
        process_group: Optional[Any],
        plugin_manager: Optional[pluggy.PluginManager],
        weights_only: bool,
        metric: Optional[Callable[[], Optional[tuple[str, float]]]],
    ) -> None:
        self._config = config
        #: whether the saver can be sent to another process (``strategy="ddp_spawn"``): not with
        #: a process group, a plugin manager or plugins of its own
        self.portable = process_group is None and plugin_manager is None
        given = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath
        if isinstance(given, str) and given.startswith("~"):
            given = os.path.expanduser(given)  # as ModelCheckpoint does
        #: the dirpath given (None: resolved at setup)
        self.given_dirpath: Optional[str] = given
        self._process_group = process_group
        self._plugin_manager = plugin_manager if plugin_manager is not None else new_plugin_manager()
        self._weights_only = weights_only
        self._metric = metric
        #: the core saver (None until dirpath is known)
        self.snapshotter: Optional[Snapshotter] = None
        if given is not None:
            self._make(given)

    def _make(self, dirpath: str) -> Snapshotter:
        self.snapshotter = Snapshotter(
            dirpath,
            self._config,
            process_group=self._process_group,
            plugin_manager=self._plugin_manager,
            never_replicated=NEVER_REPLICATED,
            on_preempted=_stop_like_lightning,
            weights_only=self._weights_only,
            metric=self._metric,
        )
        return self.snapshotter

    def resolve(self, trainer: pl.Trainer) -> Snapshotter:
        """The core saver, made on first use with ``dirpath`` resolved as ``ModelCheckpoint``
        does: ``<logger save_dir>/<name>/<version>/checkpoints``, else
        ``<default_root_dir>/checkpoints``."""
        if self.snapshotter is None:
            if trainer.loggers:
                first = trainer.loggers[0]
                save_dir = first.save_dir if first.save_dir is not None else trainer.default_root_dir
                version = first.version if isinstance(first.version, str) else f"version_{first.version}"
                path = os.path.join(save_dir, str(first.name), version, "checkpoints")
            else:
                path = os.path.join(trainer.default_root_dir, "checkpoints")
            self._make(path)
        assert self.snapshotter is not None
        return self.snapshotter

    @property
    def required(self) -> Snapshotter:
        """The core saver; ConfigError while ``dirpath`` is not resolved yet."""
        if self.snapshotter is None:
            raise ConfigError(
                "TorchSnapshotSaver(dirpath=None) has no dirpath until the Trainer's setup "
                "resolves it (under the logger's directory or default_root_dir, as "
                "ModelCheckpoint does); pass dirpath to use it before training"
            )
        return self.snapshotter

    @property
    def dirpath(self) -> Optional[str]:
        return self.snapshotter.dirpath if self.snapshotter is not None else None

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        self.portable = False  # a registered plugin would not travel with ddp_spawn's pickle
        if self.snapshotter is not None:
            return self.snapshotter.register(plugin, name)
        return check_plugin(self._plugin_manager, plugin, name)

    def unregister(self, plugin: Any) -> None:
        if self.snapshotter is not None:
            self.snapshotter.unregister(plugin)
        else:
            self._plugin_manager.unregister(plugin)


def _stop_like_lightning(signum: int) -> None:
    """After the preemption snapshot: stop the run the way Lightning stops on SIGTERM."""
    raise SIGTERMException(128 + int(signum))
