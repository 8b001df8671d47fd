"""The Lightning saver's arguments: ``ModelCheckpoint``'s, with ``ModelCheckpoint``'s meanings
and refusals, mapped onto the core's :class:`SnapshotConfig` (cadences, ``save_top_k`` as best-k
or keep-last retention); the ones that have no meaning for snapshots are refused, saying what
to do instead."""

from __future__ import annotations

import datetime
from typing import Any, Optional

from lightning_fabric.utilities.exceptions import MisconfigurationException

from tnt_snapshot_plugin.config import SnapshotConfig, positive_int_or_none, resolve_alias
from tnt_snapshot_plugin.errors import ConfigError

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


class InvalidArgumentError(ConfigError, MisconfigurationException):
    """An argument value that Lightning's ``ModelCheckpoint`` refuses too (with a
    ``MisconfigurationException``, which this error also is)."""



def refuse_not_applicable(not_applicable: dict[str, Any]) -> None:
    """ConfigError for a ``ModelCheckpoint`` argument in :data:`NOT_APPLICABLE`; TypeError for
    any other unknown keyword."""
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


def saver_config(arguments: dict[str, Any]) -> SnapshotConfig:
    """The config of a saver given ``arguments`` (the constructor's, by name), checked as
    ``ModelCheckpoint`` checks them."""
    a = arguments
    if a["mode"] not in ("min", "max"):
        raise InvalidArgumentError(f"mode must be 'min' or 'max', got {a['mode']!r}")
    if not isinstance(a["verbose"], bool):
        raise ConfigError(f"verbose must be True or False, got {a['verbose']!r}")
    if a["save_last"] not in (None, True, False, "link"):
        raise ConfigError(f"save_last must be None, True, False or 'link', got {a['save_last']!r}")
    if a["save_on_train_epoch_end"] not in (None, True, False):
        raise ConfigError(
            f"save_on_train_epoch_end must be None, True or False, got {a['save_on_train_epoch_end']!r}"
        )
    steps = _every("every_n_train_steps", a["every_n_train_steps"], "save_every_n_train_steps", a["save_every_n_train_steps"])
    epochs = _every("every_n_epochs", a["every_n_epochs"], "save_every_n_epochs", a["save_every_n_epochs"])
    if steps is None and epochs is None and a["train_time_interval"] is None:
        epochs = 1  # ModelCheckpoint's default: every epoch
    best_k, keep_last_n_snapshots, keep_last_n_checkpoints = _retention(
        a["monitor"], a["save_top_k"], a["keep_last_n_snapshots"], a["keep_last_n_checkpoints"]
    )
    return SnapshotConfig.build(
        save_every_n_train_steps=steps or None,
        save_every_n_epochs=epochs or None,
        save_every_n_seconds=_seconds(a["train_time_interval"]),
        keep_last_n_snapshots=_keep_last_n(keep_last_n_snapshots, keep_last_n_checkpoints),
        replicated=a["replicated"],
        storage_options=a["storage_options"],
        async_snapshot=a["async_snapshot"],
        save_on_train_end=a["save_on_train_end"],
        on_save_error=a["on_save_error"],
        preemption_signals=a["preemption_signals"],
        collective_timeout_s=a["collective_timeout_s"],
        best_metric=a["monitor"],
        best_mode=a["mode"],
        best_k=best_k,
        names={"best_metric": "monitor", "best_mode": "mode", "best_k": "save_top_k"},
        format=a.get("format", "torchsnapshot"),
        knobs=a.get("knobs"),
    )


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


def _keep_last_n(keep_last_n_snapshots: Any, keep_last_n_checkpoints: Any) -> Optional[int]:
    """``keep_last_n_snapshots``, or torchtnt's name for it, ``keep_last_n_checkpoints``, checked
    under the name given."""
    keep = resolve_alias(
        "keep_last_n_snapshots", keep_last_n_snapshots, "keep_last_n_checkpoints", keep_last_n_checkpoints, None
    )
    given = "keep_last_n_snapshots" if keep_last_n_checkpoints is None else "keep_last_n_checkpoints"
    return positive_int_or_none(given, keep)


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

