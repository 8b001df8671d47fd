"""The torchtnt saver's arguments mapped onto the core's :class:`SnapshotConfig`, torchtnt
0.2.4's meanings kept: ``best_checkpoint_config`` names the metric, and with it
``keep_last_n_checkpoints`` counts the best N."""

from __future__ import annotations

from typing import Any, Optional

from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import ConfigError


def saver_config(
    best_checkpoint_config: Any,
    keep_last_n_checkpoints: Optional[int],
    keep_last_n_snapshots: Optional[int],
    **settings: Any,
) -> SnapshotConfig:
    """The config of a saver given these arguments (``settings``: the others, by the names
    :meth:`SnapshotConfig.build` takes)."""
    monitored, mode = best_config(best_checkpoint_config)
    if monitored is not None:
        # torchtnt's keep_last_n_checkpoints counts the best N when a metric is monitored
        best_k = keep_last_n_checkpoints if keep_last_n_checkpoints is not None else keep_last_n_snapshots
        keep_last_n_checkpoints = keep_last_n_snapshots = None
    else:
        best_k = None
    return SnapshotConfig.build(
        keep_last_n_snapshots=keep_last_n_snapshots,
        keep_last_n_checkpoints=keep_last_n_checkpoints,
        best_metric=monitored,
        best_mode=mode,
        best_k=best_k,
        names={
            "best_metric": "best_checkpoint_config.monitored_metric",
            "best_mode": "best_checkpoint_config.mode",
            "best_k": "keep_last_n_checkpoints",
        },
        **settings,
    )


def best_config(config: Any) -> tuple[Optional[str], str]:
    """(monitored_metric, mode) of torchtnt's BestCheckpointConfig, or (None, "min")."""
    if config is None:
        return None, "min"
    if not hasattr(config, "monitored_metric") or not hasattr(config, "mode"):
        raise ConfigError(
            "best_checkpoint_config must be a BestCheckpointConfig(monitored_metric, mode) "
            f"(torchtnt.utils.checkpoint) or None, got {config!r}"
        )
    return config.monitored_metric, config.mode

