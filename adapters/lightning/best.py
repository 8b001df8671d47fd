"""The Lightning saver's best-k bookkeeping: ``monitor``'s value read when a snapshot is
taken, and what Lightning and users read of ``ModelCheckpoint`` (``best_model_path``,
``best_model_score``, ``best_k_models``, ``kth_best_model_path``, ``to_yaml``), read from the
snapshots in ``dirpath`` (their names and indexes), so it holds in a new process too."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException

from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import ConfigError, MonitorNotLoggedWarning
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.stores import LocalStore, open_store


class MonitorNotFoundError(ConfigError, MisconfigurationException):
    """The saver's ``monitor`` was never logged although validation has run (Lightning's
    ``ModelCheckpoint`` raises a MisconfigurationException there; this is one too)."""



class BestSnapshots:
    """Best-k as Lightning and users read it of ``ModelCheckpoint`` (``best_model_path``,
    ``best_model_score``, ``best_k_models``, ``kth_best_model_path``, ``to_yaml``), read from the
    snapshots in the saver's dirpath; and ``monitor``'s value, read when a snapshot is taken.

    ``dirpath()``: the saver's dirpath (None until resolved); ``trainer()``: the Trainer of the
    run (None before ``setup``)."""

    def __init__(
        self,
        config: SnapshotConfig,
        mode: str,
        dirpath: Callable[[], Optional[str]],
        trainer: Callable[[], Optional[pl.Trainer]],
    ) -> None:
        self._config = config
        self.mode = mode
        self._dirpath = dirpath
        self._trainer = trainer
        self._warned_unlogged = False

    @property
    def monitor(self) -> Optional[str]:
        """The metric that ranks the snapshots (None: none)."""
        best = self._config.best
        return best.metric if best is not None else None

    def best_model_path(self) -> str:
        """The best complete snapshot in dirpath by ``monitor`` ("" if none carries it); without
        ``monitor``, the newest complete snapshot ("" if none), as ``ModelCheckpoint`` without
        ``monitor`` names the newest checkpoint it saved."""
        if self.monitor is None:
            return self._newest()
        found = self._best()
        return found[0] if found is not None else ""

    def best_model_score(self) -> Optional[torch.Tensor]:
        """``monitor``'s value in :meth:`best_model_path` (None if there is none), as a tensor
        like ``ModelCheckpoint``'s; a NaN value reads as +inf (``mode="min"``) or -inf (``"max"``)."""
        found = self._best()
        return self._score(found[1]) if found is not None else None

    def best_k_models(self) -> dict[str, torch.Tensor]:
        """The ``save_top_k`` best complete snapshots in dirpath (every ranked one for -1), best
        first: path -> ``monitor``'s value. Empty without ``monitor``."""
        return {path: self._score(value) for path, value in self._ranked()}

    def kth_best_model_path(self) -> str:
        """The worst of :meth:`best_k_models` ("" if none); of several equally worst, the one
        committed first, as ``ModelCheckpoint`` picks the first of them it saved."""
        ranked = self._ranked()
        if not ranked:
            return ""
        worst = self._score(ranked[-1][1])
        return next(path for path, value in ranked if bool(self._score(value) == worst))

    def to_yaml(self, filepath: Optional[Any] = None) -> None:
        """Write :meth:`best_k_models` (path -> value) as YAML to ``filepath`` (default:
        ``dirpath/best_k_models.yaml``, a local dirpath only), as ``ModelCheckpoint`` does."""
        import yaml

        dirpath = self._dirpath()
        if filepath is None:
            if dirpath is None or not isinstance(open_store(str(dirpath), self._config.storage_options), LocalStore):
                raise ConfigError(
                    f"to_yaml() writes into a local dirpath only (dirpath is {dirpath!r}); "
                    "pass filepath=<a local file>"
                )
            filepath = os.path.join(dirpath, "best_k_models.yaml")
        with open(filepath, "w") as f:
            yaml.dump({path: value.item() for path, value in self.best_k_models().items()}, f)

    def _score(self, value: float) -> torch.Tensor:
        if math.isnan(value):
            value = math.inf if self.mode == "min" else -math.inf
        return torch.tensor(value)

    def _ranked(self) -> list[tuple[str, float]]:
        """(path, value) of the best ``save_top_k`` snapshots in dirpath, best first."""
        best, dirpath = self._config.best, self._dirpath()
        if best is None or dirpath is None:
            return []
        from tnt_snapshot_plugin.policies import retention

        store = open_store(str(dirpath), self._config.storage_options)
        ranked = retention.ranked(listing.listed(store), best.metric, best.mode)
        if best.k is not None:
            ranked = ranked[: best.k]
        found = []
        for record in ranked:
            value = record.metric_value(best.metric)
            assert value is not None
            found.append((store.child(record.text), value))
        return found

    def _newest(self) -> str:
        """The newest complete snapshot in dirpath whose index reads, in commit order ("" if none)."""
        dirpath = self._dirpath()
        if dirpath is None:
            return ""
        store = open_store(str(dirpath), self._config.storage_options)
        for record in reversed(listing.listed(store)):
            if record.problem is None:
                return store.child(record.text)
        return ""

    def _best(self) -> Optional[tuple[str, float]]:
        ranked = self._ranked()
        return ranked[0] if ranked else None

    def monitored_value(self) -> Optional[tuple[str, float]]:
        """(monitor, value) from ``trainer.callback_metrics`` now (a snapshot is being taken);
        ``epoch`` and ``step`` are the trainer's unless logged, as in ``ModelCheckpoint``."""
        monitor = self.monitor
        trainer = self._trainer()
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
                    category=MonitorNotLoggedWarning, stacklevel=2,
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


def _as_float(value: Any) -> float:
    """A logged value as a float; a tensor of fewer than 64 bits gives the shortest decimal that
    is that value in float32 (``0.3``, not ``0.30000001192092896``), which orders alike."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.float16, torch.bfloat16):
        import numpy as np

        return float(str(np.float32(value.float().item())))
    return float(value)

