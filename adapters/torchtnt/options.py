"""The torchtnt saver's arguments mapped onto the core's :class:`SnapshotConfig`, torchtnt
0.2.4's meanings kept: its names for the plugin's settings (``async_checkpoint``,
``keep_last_n_checkpoints``, ``knob_options``) are resolved here, ``best_checkpoint_config`` names
the metric, and with it ``keep_last_n_checkpoints`` counts the best N."""

from __future__ import annotations

from typing import Any, Optional

from tnt_snapshot_plugin.config import Knobs, SnapshotConfig, positive_int_or_none, resolve_alias
from tnt_snapshot_plugin.errors import ConfigError


def saver_config(
    best_checkpoint_config: Any,
    keep_last_n_checkpoints: Optional[int],
    keep_last_n_snapshots: Optional[int],
    *,
    async_checkpoint: Any = None,
    async_snapshot: Any = None,
    knob_options: Any = None,
    **settings: Any,
) -> SnapshotConfig:
    """The config of a saver given these arguments (``settings``: the others, by the names
    :meth:`SnapshotConfig.build` takes)."""
    async_snapshot = resolve_alias("async_snapshot", async_snapshot, "async_checkpoint", async_checkpoint, True)
    monitored, mode = best_config(best_checkpoint_config)
    best_k = None
    if monitored is not None:
        # torchtnt's keep_last_n_checkpoints counts the best N when a metric is monitored
        best_k = keep_last_n_checkpoints if keep_last_n_checkpoints is not None else keep_last_n_snapshots
        keep_last_n = None
    else:
        keep_last_n = keep_last_n_of(keep_last_n_snapshots, keep_last_n_checkpoints)
    return SnapshotConfig.build(
        keep_last_n_snapshots=keep_last_n,
        async_snapshot=async_snapshot,
        knobs=knobs_of("knob_options", knob_options),
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


def keep_last_n_of(keep_last_n_snapshots: Any, keep_last_n_checkpoints: Any) -> Optional[int]:
    """``keep_last_n_snapshots``, or torchtnt's name for it, ``keep_last_n_checkpoints``; a
    ConfigError naming the one given for a value that is not a positive int, or naming both when
    both are given with different values."""
    keep = resolve_alias(
        "keep_last_n_snapshots", keep_last_n_snapshots, "keep_last_n_checkpoints", keep_last_n_checkpoints, None
    )
    given = "keep_last_n_snapshots" if keep_last_n_checkpoints is None else "keep_last_n_checkpoints"
    return positive_int_or_none(given, keep)


def knobs_of(name: str, options: Any) -> Knobs:
    """torchtnt's ``KnobOptions`` (or any object with its attributes; None: the defaults) as the
    core's :class:`Knobs`; a ConfigError naming ``name`` otherwise."""
    if options is None:
        return Knobs()
    if isinstance(options, Knobs):
        return options
    if not hasattr(options, "max_per_rank_io_concurrency"):
        raise ConfigError(
            f"{name} must be a KnobOptions (torchtnt.framework.callbacks.checkpointer_types) "
            f"or None, got {options!r}"
        )
    flag = getattr(options, "enable_storage_optimization", False)
    if not isinstance(flag, bool):
        raise ConfigError(f"{name}.enable_storage_optimization must be True or False, got {flag!r}")
    return Knobs(
        max_per_rank_io_concurrency=positive_int_or_none(
            f"{name}.max_per_rank_io_concurrency", options.max_per_rank_io_concurrency
        ),
        enable_storage_optimization=flag,
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
