"""Snapshot directory names: formatting, parsing and ordering.

This module is pure string work and imports nothing heavy, so that listing and ordering
snapshots never costs a torch import.

The plugin writes ``epoch_{epoch}_step_{step}``, where ``epoch`` is the number of epochs completed
when the snapshot was taken and ``step`` the number of train steps completed across all epochs.
It also reads the phase-aware names torchtnt's own savers write
(``epoch_E_train_step_T``, ``epoch_E_train_step_T_eval_step_V``, each optionally followed by
``_metric=value``), so a run can resume from snapshots torchtnt wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_NAME = re.compile(
    r"^epoch_(?P<epoch>\d+)_"
    r"(?:step_(?P<step>\d+)|train_step_(?P<train_step>\d+)(?:_eval_step_(?P<eval_step>\d+))?)"
    r"(?:_(?P<metric>[A-Za-z_][A-Za-z0-9_.]*)=(?P<value>[-+0-9.eE]+|nan|inf|-inf))?$"
)

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

    @classmethod
    def of(cls, epoch: int, step: int) -> "SnapshotName":
        """The name the plugin writes for a snapshot after ``epoch`` epochs and ``step`` steps."""
        if epoch < 0 or step < 0:
            raise ValueError(f"epoch and step must be >= 0, got epoch={epoch}, step={step}")
        return cls(epoch=epoch, step=step, text=f"epoch_{epoch}_step_{step}")

    @classmethod
    def parse(cls, text: str) -> Optional["SnapshotName"]:
        """Parse a directory name (not a path); ``None`` when it is not a snapshot name."""
        # fullmatch: ``$`` would also accept a trailing newline ("epoch_0_step_2\n").
        match = _NAME.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            return None
        step = match["step"] if match["step"] is not None else match["train_step"]
        value = match["value"]
        return cls(
            epoch=int(match["epoch"]),
            step=int(step),
            eval_step=int(match["eval_step"]) if match["eval_step"] is not None else None,
            metric=match["metric"],
            metric_value=float(value) if value is not None else None,
            text=text,
            phase_aware=match["step"] is None,
        )

    @property
    def sort_key(self) -> tuple[int, int, int, str]:
        return (self.epoch, self.step, self.eval_step or 0, self.text)

    def __lt__(self, other: "SnapshotName") -> bool:
        return self.sort_key < other.sort_key

    def __str__(self) -> str:
        return self.text


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
