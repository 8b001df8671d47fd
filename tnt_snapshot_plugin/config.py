"""Validated configuration shared by every adapter.

All checks run in the constructor, before any I/O or collective, and each message names the
parameter, the value received and what was expected.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from .errors import ConfigError

_SAVE_ERROR_POLICIES = ("warn", "raise")


def positive_int_or_none(name: str, value: Any) -> Optional[int]:
    """``value`` if it is None or an int >= 1; else a ConfigError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{name} must be a positive int or None, got {value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ConfigError(f"{name} must be a positive int (>= 1) or None, got {value}")
    return value


def string_list_or_none(name: str, value: Any) -> Optional[list[str]]:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{name} must be a list of glob strings such as ['**'], got {value!r}"
        )
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise ConfigError(f"{name} must contain only non-empty strings, got {bad!r}")
    return list(value)


def _signals(name: str, value: Any) -> tuple[signal.Signals, ...]:
    if value is None:
        return ()
    if isinstance(value, (int, str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a list of signals such as [signal.SIGTERM], got {value!r}")
    out = []
    for v in value:
        try:
            out.append(signal.Signals(v))
        except (ValueError, TypeError):
            raise ConfigError(f"{name}: {v!r} is not a signal number or signal.Signals") from None
        if out[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"{name}: {out[-1].name} cannot be caught; use e.g. SIGTERM or SIGUSR1")
    return tuple(out)


@dataclass(frozen=True)
class SnapshotConfig:
    """What and when to snapshot. Built by the adapters from their keyword arguments."""

    save_every_n_train_steps: Optional[int] = None
    save_every_n_epochs: Optional[int] = None
    keep_last_n_snapshots: Optional[int] = None
    replicated: Optional[list[str]] = None
    storage_options: Optional[dict[str, Any]] = None
    async_snapshot: bool = True
    save_on_train_end: bool = True
    on_save_error: str = "warn"
    restore_fallback: bool = True
    preemption_signals: tuple[signal.Signals, ...] = field(default=(signal.SIGTERM,))
    collective_timeout_s: float = 600.0

    @classmethod
    def build(
        cls,
        *,
        save_every_n_train_steps: Any = None,
        save_every_n_epochs: Any = None,
        keep_last_n_snapshots: Any = None,
        keep_last_n_checkpoints: Any = None,
        replicated: Any = None,
        storage_options: Any = None,
        async_snapshot: Any = True,
        save_on_train_end: Any = True,
        on_save_error: Any = "warn",
        restore_fallback: Any = True,
        preemption_signals: Any = (signal.SIGTERM,),
        collective_timeout_s: Any = 600.0,
    ) -> "SnapshotConfig":
        if keep_last_n_checkpoints is not None:
            if keep_last_n_snapshots is not None and keep_last_n_snapshots != keep_last_n_checkpoints:
                raise ConfigError(
                    "keep_last_n_checkpoints is an alias of keep_last_n_snapshots; pass only one, "
                    f"got {keep_last_n_snapshots!r} and {keep_last_n_checkpoints!r}"
                )
            keep_last_n_snapshots = keep_last_n_checkpoints
            name_keep = "keep_last_n_checkpoints"
        else:
            name_keep = "keep_last_n_snapshots"
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(f"storage_options must be a dict or None, got {storage_options!r}")
        for name, flag in (
            ("async_snapshot", async_snapshot),
            ("save_on_train_end", save_on_train_end),
            ("restore_fallback", restore_fallback),
        ):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if on_save_error not in _SAVE_ERROR_POLICIES:
            raise ConfigError(
                f"on_save_error must be one of {_SAVE_ERROR_POLICIES}, got {on_save_error!r}"
            )
        if (
            isinstance(collective_timeout_s, bool)
            or not isinstance(collective_timeout_s, (int, float))
            or not math.isfinite(collective_timeout_s)
            or collective_timeout_s <= 0
        ):
            raise ConfigError(
                f"collective_timeout_s must be a positive number of seconds, got {collective_timeout_s!r}"
            )
        return cls(
            save_every_n_train_steps=positive_int_or_none(
                "save_every_n_train_steps", save_every_n_train_steps
            ),
            save_every_n_epochs=positive_int_or_none("save_every_n_epochs", save_every_n_epochs),
            keep_last_n_snapshots=positive_int_or_none(name_keep, keep_last_n_snapshots),
            replicated=string_list_or_none("replicated", replicated),
            storage_options=dict(storage_options) if storage_options is not None else None,
            async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end,
            on_save_error=on_save_error,
            restore_fallback=restore_fallback,
            preemption_signals=_signals("preemption_signals", preemption_signals),
            collective_timeout_s=float(collective_timeout_s),
        )

