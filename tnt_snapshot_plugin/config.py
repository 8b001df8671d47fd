"""Validated configuration shared by every adapter.

All checks run in the constructor, before any I/O or collective, and each message names the
parameter, the value received and what was expected.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.naming import is_metric_name

_SAVE_ERROR_POLICIES = ("warn", "raise")

#: The default of ``storage_timeout_s``: the longest training waits on the storage at a due
#: snapshot, and the time one storage request may take, its retries included.
DEFAULT_STORAGE_TIMEOUT_S = 60.0


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


def positive_seconds_or_none(name: str, value: Any) -> Optional[float]:
    """``value`` as float seconds if it is None or a finite number > 0; else a ConfigError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{name} must be a positive number of seconds or None, got {value!r} of type "
            f"{type(value).__name__}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive, finite number of seconds or None, got {value!r}")
    return float(value)


def positive_number(name: str, value: Any) -> Any:
    """``value`` if it is a finite number > 0; else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
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
class Knobs:
    """Tuning of the snapshot writer and reader.

    ``max_per_rank_io_concurrency``: how many files one rank writes at once (None: 4,
    ``saving.writer.DEFAULT_IO_THREADS``), and at restore reads at once (None: the store's
    default: 8 local files, ``fileio.READ_THREADS``; on S3, ``stores.s3.FETCH_WORKERS`` ranged
    GETs). ``enable_storage_optimization``: accepted and ignored; the files are torchsnapshot's
    format, uncompressed. (The torchtnt adapter maps torchtnt's ``KnobOptions`` onto it.)

    ``writer``: who writes the payload files of asynchronous snapshots. ``"thread"``: I/O threads
    of the training process. ``"process"``: a writer process per rank, started at train start,
    reading the staging buffers from shared memory (``saving/process_writer.py``): its Python never
    holds the training process's GIL. It needs a store the writer process can open again from
    its URL (local disk, ``s3://``, fsspec URLs; ConfigError otherwise) and
    ``async_snapshot=True``. None: ``saving.writer.DEFAULT_WRITER``, where the store allows it.
    """

    max_per_rank_io_concurrency: Optional[int] = None
    enable_storage_optimization: bool = False
    writer: Optional[str] = None

    def __post_init__(self) -> None:
        positive_int_or_none("max_per_rank_io_concurrency", self.max_per_rank_io_concurrency)
        if not isinstance(self.enable_storage_optimization, bool):
            raise ConfigError(
                f"enable_storage_optimization must be True or False, got {self.enable_storage_optimization!r}"
            )
        if self.writer not in WRITERS:
            raise ConfigError(
                f"writer must be 'thread', 'process' or None (the default), got {self.writer!r}"
            )


#: The writers of asynchronous snapshots ``Knobs(writer=...)`` names (None: the default).
WRITERS = (None, "thread", "process")


#: The directions a metric ranks snapshots in: the lowest value is best, or the highest.
MODES = ("min", "max")


@dataclass(frozen=True)
class Best:
    """Best-k retention: keep the ``k`` best snapshots by ``metric`` (``mode`` "min" or "max";
    ``k`` None: every snapshot carrying the metric)."""

    metric: str
    mode: str = "min"
    k: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"k must be an int >= 1 or None, got {self.k!r}")


def _best(metric: Any, mode: Any, k: Any, names: dict[str, str]) -> Optional[Best]:
    metric_name = names.get("best_metric", "best_metric")
    k_name = names.get("best_k", "best_k")
    if metric is None:
        if k is not None:
            raise ConfigError(
                f"{k_name}={k!r} counts the best snapshots by a metric, but no metric is monitored "
                f"({metric_name} is None); set {metric_name}, or keep the newest snapshots with "
                "keep_last_n_snapshots"
            )
        return None
    if not is_metric_name(metric):
        raise ConfigError(
            f"{metric_name} must be a metric name usable in a directory name (letters, digits, "
            f"'_', '.' and '/', starting with a letter or '_'), got {metric!r}"
        )
    if mode not in MODES:
        raise ConfigError(f"{names.get('best_mode', 'best_mode')} must be 'min' or 'max', got {mode!r}")
    return Best(metric, mode, positive_int_or_none(k_name, k))


def resolve_alias(name: str, value: Any, alias: str, alias_value: Any, default: Any) -> Any:
    """One setting given under two names (None: not given): either, or ``default``; a
    ConfigError naming both when both are given with different values."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ConfigError(
            f"{alias} is another name for {name}; pass only one, or the same value to both "
            f"(got {name}={value!r} and {alias}={alias_value!r})"
        )
    if value is not None:
        return value
    return alias_value if alias_value is not None else default


@dataclass(frozen=True)
class SnapshotConfig:
    """What and when to snapshot, in the plugin's own names. Built by the adapters from their
    keyword arguments (:meth:`build`), each adapter mapping its framework's names onto these.

    ``best_metric`` / ``best_mode`` / ``best_k``: best-k retention (:class:`Best`; ``best_k``
    None keeps every snapshot carrying the metric). ``names``: the adapter's names of these three
    settings, for the error messages. ``storage_timeout_s``: the longest training waits on the
    storage at a due snapshot (default 60). ``knobs``: see :class:`Knobs`. ``save_policies``:
    more save decisions (objects with ``should_save(moment)``, e.g.
    ``policies.EveryNSteps(500)`` or a user's own): a snapshot is taken when any policy or
    cadence says so. ``preservation_policies``: more retention rules (objects with
    ``keep(ours)``, e.g. ``policies.KeepOnePerNHours(6)``): a snapshot is kept when any of them,
    or ``keep_last_n_snapshots`` or best-k, keeps it; with none of these, none is deleted.
    """

    save_every_n_train_steps: Optional[int] = None
    save_every_n_epochs: Optional[int] = None
    save_every_n_eval_epochs: Optional[int] = None
    #: wall-clock cadence (rank 0's clock), checked at train step ends; see cadence.py
    save_every_n_seconds: Optional[float] = None
    keep_last_n_snapshots: Optional[int] = None
    replicated: Optional[list[str]] = None
    storage_options: Optional[dict[str, Any]] = None
    async_snapshot: bool = True
    save_on_train_end: bool = True
    on_save_error: str = "warn"
    restore_fallback: bool = True
    preemption_signals: tuple[signal.Signals, ...] = field(default=(signal.SIGTERM,))
    collective_timeout_s: float = 600.0
    #: the longest training waits on the storage at a due snapshot (see Snapshotter.save), and
    #: the time one request to an object store may take, its retries included (stores/s3.py)
    storage_timeout_s: float = DEFAULT_STORAGE_TIMEOUT_S
    knobs: Knobs = field(default_factory=Knobs)
    #: best-k retention (policies/preservation.py): keep the k best snapshots by a metric
    best: Optional[Best] = None
    #: users' own save decisions (policies.SavePolicy), beside the cadences above: any decides
    save_policies: tuple[Any, ...] = ()
    #: users' own preservation policies (policies.PreservationPolicy), beside keep_last_n and
    #: best: retention keeps what any of them keeps
    preservation_policies: tuple[Any, ...] = ()
    #: the on-disk format snapshots are written in: a format's name (``format.registry``) or a
    #: Format object; checked when the saver is made
    format: Any = "torchsnapshot"

    @classmethod
    def build(
        cls,
        *,
        save_every_n_train_steps: Any = None, save_every_n_epochs: Any = None,
        save_every_n_eval_epochs: Any = None, save_every_n_seconds: Any = None,
        keep_last_n_snapshots: Any = None, replicated: Any = None, storage_options: Any = None,
        async_snapshot: Any = True, save_on_train_end: Any = True, on_save_error: Any = "warn",
        restore_fallback: Any = True, preemption_signals: Any = (signal.SIGTERM,),
        collective_timeout_s: Any = 600.0, storage_timeout_s: Any = DEFAULT_STORAGE_TIMEOUT_S,
        knobs: Any = None, best_metric: Any = None, best_mode: Any = "min", best_k: Any = None,
        save_policies: Any = None, preservation_policies: Any = None,
        format: Any = "torchsnapshot", names: Optional[Mapping[str, str]] = None,
    ) -> "SnapshotConfig":
        """The configuration of these keyword arguments, validated (the class docstring says
        what ``names`` and the policies are); ConfigError naming a bad one."""
        _check_plain(
            storage_options,
            {"async_snapshot": async_snapshot, "save_on_train_end": save_on_train_end,
             "restore_fallback": restore_fallback},
            on_save_error,
            collective_timeout_s,
            storage_timeout_s,
        )
        if knobs is not None and not isinstance(knobs, Knobs):
            raise ConfigError(f"knobs must be a Knobs (tnt_snapshot_plugin.config) or None, got {knobs!r}")
        if knobs is not None and knobs.writer == "process" and async_snapshot is False:
            raise ConfigError(
                "knobs.writer='process' writes asynchronous snapshots in a writer process, but "
                "async_snapshot=False writes each snapshot on the training thread; pass one of them"
            )
        return cls(
            best=_best(best_metric, best_mode, best_k, dict(names or {})),
            save_every_n_train_steps=positive_int_or_none("save_every_n_train_steps", save_every_n_train_steps),
            save_every_n_epochs=positive_int_or_none("save_every_n_epochs", save_every_n_epochs),
            save_every_n_eval_epochs=positive_int_or_none("save_every_n_eval_epochs", save_every_n_eval_epochs),
            save_every_n_seconds=positive_seconds_or_none("save_every_n_seconds", save_every_n_seconds),
            keep_last_n_snapshots=positive_int_or_none("keep_last_n_snapshots", keep_last_n_snapshots),
            replicated=string_list_or_none("replicated", replicated),
            storage_options=dict(storage_options) if storage_options is not None else None,
            async_snapshot=async_snapshot,
            save_on_train_end=save_on_train_end,
            on_save_error=on_save_error,
            restore_fallback=restore_fallback,
            preemption_signals=_signals("preemption_signals", preemption_signals),
            collective_timeout_s=float(collective_timeout_s),
            storage_timeout_s=float(storage_timeout_s),
            knobs=knobs if knobs is not None else Knobs(),
            save_policies=policy_list("save_policies", save_policies, "SavePolicy", "should_save(moment)"),
            preservation_policies=policy_list(
                "preservation_policies", preservation_policies, "PreservationPolicy", "keep(ours)"
            ),
            format=_format(format),
        )


def policy_list(name: str, value: Any, kind: str, method: str) -> tuple[Any, ...]:
    """``value`` (None or an iterable of policies) as a tuple; a ConfigError naming ``name`` for
    anything else, or for a policy without the method ``method`` its ``kind`` is asked by."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a list of {kind} objects, got {value!r}")
    out = tuple(value)
    attribute = method.partition("(")[0]
    bad = [p for p in out if not callable(getattr(p, attribute, None))]
    if bad:
        raise ConfigError(f"{name}: {bad[0]!r} is not a {kind} (it needs a method {method})")
    return out


def _check_plain(
    storage_options: Any, flags: Mapping[str, Any], on_save_error: Any, collective_timeout_s: Any, storage_timeout_s: Any
) -> None:
    """ConfigError for the first of these settings with a value the plugin cannot work with."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ConfigError(f"storage_options must be a dict or None, got {storage_options!r}")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}")
    if on_save_error not in _SAVE_ERROR_POLICIES:
        raise ConfigError(f"on_save_error must be one of {_SAVE_ERROR_POLICIES}, got {on_save_error!r}")
    collective_timeout(collective_timeout_s)
    if not _positive_finite(storage_timeout_s):
        raise ConfigError(
            "storage_timeout_s must be a positive, finite number of seconds (the longest "
            f"training waits on the storage at a due snapshot), got {storage_timeout_s!r}"
        )


def _format(value: Any) -> Any:
    """``format``: a non-empty name, or an object with a name and a metadata file (the registry
    checks, when the saver is made, that the name is one it knows)."""
    if isinstance(value, str) and value:
        return value
    if isinstance(getattr(value, "name", None), str) and isinstance(getattr(value, "metadata_file", None), str):
        return value
    raise ConfigError(
        f"format must be the name of an on-disk format ('torchsnapshot', 'dcp', or one registered "
        f"with register_format) or a Format object (tnt_snapshot_plugin.Format), got {value!r}"
    )


def collective_timeout(value: Any) -> float:
    """``collective_timeout_s`` checked (a positive, finite number of seconds), as a float: the
    one check of every saver's and every restore's. ConfigError otherwise."""
    if not _positive_finite(value):
        raise ConfigError(f"collective_timeout_s must be a positive number of seconds, got {value!r}")
    return float(value)


def _positive_finite(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )
