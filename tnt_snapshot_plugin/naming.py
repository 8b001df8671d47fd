"""Snapshot directory names: formatting, parsing and ordering.

This module is pure string work and imports nothing heavy, so that listing and ordering
snapshots never costs a torch import.

The plugin writes ``epoch_{epoch}_step_{step}``, where ``epoch`` is the number of epochs completed
when the snapshot was taken and ``step`` the number of train steps completed across all epochs.
A snapshot taken after an eval epoch under ``fit()`` is ``epoch_{epoch}_step_{step}_eval_{eval}``
(``eval``: eval steps completed across all eval epochs): it never collides with the train snapshot
of the same step, and orders after it (the eval runs after that train step).
A monitored metric's name and value follow as ``_{name}={value}``; a ``/`` in the name (Lightning's
``val/loss``) is written ``%2F`` there, which no other name character makes.
It also reads the phase-aware names torchtnt's own savers write
(``epoch_E_train_step_T``, ``epoch_E_train_step_T_eval_step_V``, each optionally followed by
``_metric=value``), so a run can resume from snapshots torchtnt wrote; and, where
``restore_from_latest`` lists a dirpath (:meth:`SnapshotName.parse_listed`), torchtitan's
``step-N`` (N: train steps completed; torchtitan counts no epochs, so they order as epoch 0).
Names other tools write are read, never written, and never deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_NAME = re.compile(
    r"^epoch_(?P<epoch>\d+)_"
    r"(?:step_(?P<step>\d+)(?:_eval_(?P<eval>\d+))?"
    r"|train_step_(?P<train_step>\d+)(?:_eval_step_(?P<eval_step>\d+))?)"
    r"(?:_(?P<metric>[A-Za-z_](?:[A-Za-z0-9_.]|%2F)*)=(?P<value>[-+0-9.eE]+|nan|inf|-inf))?$"
)

#: torchtitan's checkpoint directories (``CheckpointManager._create_checkpoint_id``).
_TORCHTITAN = re.compile(r"step-(?P<step>\d+)")

#: Who writes a name: the plugin, torchtnt's savers (phase-aware names), torchtitan.
PLUGIN, TORCHTNT, TORCHTITAN = "plugin", "torchtnt", "torchtitan"

_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./]*")

#: How a ``/`` of a metric's name is written in a directory name.
_SLASH = "%2F"

#: Prefix of the directories the plugin writes before a snapshot is committed.
STAGING_PREFIX = ".tnt_staging."


@dataclass(frozen=True, order=False)
class SnapshotName:
    """A parsed snapshot directory name. Instances order by (epoch, step), never by mtime."""

    epoch: int
    step: int
    eval_step: Optional[int] = None
    metric: Optional[str] = None
    metric_value: Optional[float] = None
    text: str = ""
    #: True for torchtnt's phase-aware names (``..._train_step_T``), which this plugin reads
    #: but never writes (and so never deletes).
    phase_aware: bool = False
    #: who writes names of this form: :data:`PLUGIN` (the plugin's form), :data:`TORCHTNT`
    #: (phase-aware names) or :data:`TORCHTITAN`
    origin: str = PLUGIN

    @classmethod
    def of(
        cls,
        epoch: int,
        step: int,
        eval_step: Optional[int] = None,
        metric: Optional[tuple[str, float]] = None,
    ) -> "SnapshotName":
        """The name the plugin writes for a snapshot after ``epoch`` epochs and ``step`` train
        steps (and, for a snapshot taken after an eval epoch, ``eval_step`` eval steps), with
        ``_{name}={value}`` appended for ``metric`` (name, value), as torchtnt's names carry it."""
        if epoch < 0 or step < 0 or (eval_step is not None and eval_step < 0):
            raise ValueError(
                f"epoch, step and eval_step must be >= 0, got epoch={epoch}, step={step}, "
                f"eval_step={eval_step}"
            )
        text = f"epoch_{epoch}_step_{step}"
        if eval_step is not None:
            text += f"_eval_{eval_step}"
        if metric is None:
            return cls(epoch=epoch, step=step, eval_step=eval_step, text=text)
        metric_name, value = metric
        if not is_metric_name(metric_name):
            raise ValueError(
                f"metric name {metric_name!r} cannot be part of a snapshot's directory name: use "
                "letters, digits, '_', '.' and '/', starting with a letter or '_'"
            )
        value = float(value)
        return cls(
            epoch=epoch,
            step=step,
            eval_step=eval_step,
            metric=metric_name,
            metric_value=value,
            text=f"{text}_{metric_name.replace('/', _SLASH)}={value!r}",
        )

    @classmethod
    def parse(cls, text: str) -> Optional["SnapshotName"]:
        """Parse a directory name (not a path); ``None`` when it is not a snapshot name."""
        # fullmatch: ``$`` would also accept a trailing newline ("epoch_0_step_2\n").
        match = _NAME.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            return None
        step = match["step"] if match["step"] is not None else match["train_step"]
        eval_step = match["eval"] if match["eval"] is not None else match["eval_step"]
        value = match["value"]
        return cls(
            epoch=int(match["epoch"]),
            step=int(step),
            eval_step=int(eval_step) if eval_step is not None else None,
            metric=None if match["metric"] is None else match["metric"].replace(_SLASH, "/"),
            metric_value=float(value) if value is not None else None,
            text=text,
            phase_aware=match["step"] is None,
            origin=TORCHTNT if match["step"] is None else PLUGIN,
        )

    @classmethod
    def parse_listed(cls, text: str) -> Optional["SnapshotName"]:
        """Parse a directory name as ``restore_from_latest`` lists a dirpath: the names
        :meth:`parse` reads, and torchtitan's ``step-N`` (epoch 0, step N). Only restore's
        listing reads torchtitan's names: everything else (retention, the saver, the command
        line) treats them as other tools' directories."""
        parsed = cls.parse(text)
        if parsed is not None or not isinstance(text, str):
            return parsed
        match = _TORCHTITAN.fullmatch(text)
        if match is None:
            return None
        return cls(epoch=0, step=int(match["step"]), text=text, origin=TORCHTITAN)

    @property
    def foreign(self) -> bool:
        """Whether the name is one the plugin reads but never writes (torchtnt's phase-aware
        names, torchtitan's)."""
        return self.phase_aware or self.origin == TORCHTITAN

    @property
    def sort_key(self) -> tuple[int, int, int, str]:
        # A name without eval steps sorts first: the train snapshot of step S is taken before
        # any eval that runs after step S (and torchtnt's names under fit() always carry them).
        return (self.epoch, self.step, -1 if self.eval_step is None else self.eval_step, self.text)

    def __lt__(self, other: "SnapshotName") -> bool:
        return self.sort_key < other.sort_key

    def __str__(self) -> str:
        return self.text


def is_metric_name(text: str) -> bool:
    """Whether ``text`` can be a metric's name in a snapshot's directory name."""
    return isinstance(text, str) and _METRIC_NAME.fullmatch(text) is not None


def is_staging_name(text: str) -> bool:
    """Whether ``text`` names a staging directory this plugin could have created."""
    if not text.startswith(STAGING_PREFIX):
        return False
    rest = text[len(STAGING_PREFIX):]
    name, _, token = rest.rpartition(".")
    return bool(token) and token.isalnum() and SnapshotName.parse(name) is not None


def staging_name(final: str, token: str) -> str:
    """The staging directory name for the snapshot ``final``."""
    return f"{STAGING_PREFIX}{final}.{token}"
