"""Commit order and what retention may delete: which snapshot is "latest", which ranks best by a
metric, and which of the snapshots the preservation policies let go may be deleted.

Pure logic over listed records; it reads and deletes nothing itself (the store does, see
:func:`apply`), and imports nothing heavy. The policies that say what to keep are in
:mod:`tnt_snapshot_plugin.policies.preservation`.

* **Commit order.** The plugin records in each snapshot's index a commit sequence number
  (``seq``: 1 + the largest ``seq`` in ``dirpath`` when it commits). Snapshots are ordered by it;
  snapshots without one (written by torchtnt's own saver, or by older versions of this plugin) come
  first, among themselves by (epoch, step). "Latest" is the last in this order, so a fine-tune that
  restarted its progress at step 0 in a directory of a longer run is still "latest".
* **Retention.** ``keep_last_n`` counts the plugin's own snapshots (those with its index) in commit
  order, keeps the last ``n`` of them, and only ever deletes snapshots committed *before* every
  snapshot it keeps; never the newest snapshot of the directory, never one it did not write.
* **Best-k** (:class:`~tnt_snapshot_plugin.config.Best`): among the plugin's own snapshots that carry the monitored metric
  (in their name, ``..._<metric>=<value>``, or their index's ``metric``), the ``k`` best by it are
  kept (``mode`` "min" or "max"; NaN ranks worst; of equal values the earlier commit ranks first),
  plus the newest ``keep_last_n`` when given, plus always the newest snapshot of the directory.
  A snapshot without a value for the metric is kept by ``keep_last_n`` like any other; without
  ``keep_last_n`` it is never deleted (as torchtnt keeps its untracked checkpoints). Retention
  runs after each commit, so a snapshot is only ever deleted once as many better or newer ones as
  retention keeps are committed; and at train start (retaining.py), which trims what a run killed
  before its retention left, or what a smaller ``keep_last_n`` than the last run's lets go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol

from tnt_snapshot_plugin.config import MODES
from tnt_snapshot_plugin.naming import SnapshotName


@dataclass(frozen=True)
class Listed:
    """One complete snapshot of a directory, as listed: its name and what its index says."""

    name: SnapshotName
    #: the commit sequence number from the plugin's index; None for snapshots without one
    seq: Optional[int] = None
    #: whether the plugin's own index proves the plugin wrote it (only these are ever deleted)
    ours: bool = False
    #: the index's ``writer`` ({"host", "pid", "run_id"}) when it has one
    writer: Optional[dict[str, Any]] = None
    #: the index's ``metric`` as (name, value) when it has one (value None: not finite)
    indexed_metric: Optional[tuple[str, Optional[float]]] = None
    #: the index's ``committed_at`` (seconds since the epoch) when it has one
    committed_at: Optional[float] = None
    #: why its index is damaged (missing while its writer marker is there, unreadable, changed
    #: after the commit); None when it is intact or the plugin did not write the snapshot
    problem: Optional[str] = None

    def metric_value(self, metric: str) -> Optional[float]:
        """This snapshot's value of ``metric`` (its name's, else its index's), or None."""
        name = self.name
        if name.metric == metric and name.metric_value is not None:
            return name.metric_value
        if self.indexed_metric is not None and self.indexed_metric[0] == metric:
            return self.indexed_metric[1]
        return None

    @property
    def text(self) -> str:
        return self.name.text

    @property
    def order_key(self) -> tuple[Any, ...]:
        if self.seq is None:
            return (0, self.name.sort_key)
        return (1, self.seq, self.name.sort_key)


def from_index(name: SnapshotName, index: Optional[dict[str, Any]]) -> Listed:
    """The record of snapshot ``name`` given its parsed index (None: no index of the plugin's)."""
    if not isinstance(index, dict) or "format" not in index or name.phase_aware:
        return Listed(name)
    seq = index.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        seq = None
    writer = index.get("writer")
    metric = index.get("metric")
    indexed: Optional[tuple[str, Optional[float]]] = None
    if isinstance(metric, dict) and isinstance(metric.get("name"), str):
        value = metric.get("value")
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        indexed = (metric["name"], float(number) if number is not None else None)
    at = index.get("committed_at")
    return Listed(
        name,
        seq=seq,
        ours=True,
        writer=writer if isinstance(writer, dict) else None,
        indexed_metric=indexed,
        committed_at=float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None,
    )


def _rank_key(value: float, mode: str) -> tuple[int, float]:
    """Sort key, best first: NaN ranks worst whatever the mode."""
    if math.isnan(value):
        return (1, 0.0)
    return (0, value if mode == "min" else -value)


def ranked(listed: Iterable[Listed], metric: str, mode: str) -> list[Listed]:
    """The snapshots of ``listed`` that carry a value of ``metric``, best first (NaN last; of
    equal values, the one committed first ranks first, as a later equal value does not replace
    it in torchtnt's or Lightning's top-k)."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    found = []
    for position, record in enumerate(commit_order(listed)):
        value = record.metric_value(metric)
        if value is not None:
            found.append((*_rank_key(value, mode), position, record))
    found.sort(key=lambda entry: entry[:3])
    return [entry[3] for entry in found]


def best(listed: Iterable[Listed], metric: str, mode: str) -> Optional[Listed]:
    """The best snapshot of ``listed`` by ``metric`` (any writer's), or None if none carries it."""
    found = ranked(listed, metric, mode)
    return found[0] if found else None


def commit_order(listed: Iterable[Listed]) -> list[Listed]:
    """``listed`` oldest first: by commit sequence number, those without one first by (epoch, step).

    A snapshot whose index is damaged (``problem``) has no sequence number to trust: it goes
    right after the last snapshot whose (epoch, step) is not greater than its own, so that the
    newest snapshot of a run is still tried (and found damaged, with a warning) rather than
    passed over for an older one."""
    listed = list(listed)
    ordered = sorted((r for r in listed if r.problem is None), key=lambda r: r.order_key)
    for record in sorted((r for r in listed if r.problem is not None), key=lambda r: r.name.sort_key):
        position = 0
        for i, other in enumerate(ordered):
            if (other.name.epoch, other.name.step) <= (record.name.epoch, record.name.step):
                position = i + 1
        ordered.insert(position, record)
    return ordered


def next_seq(listed: Iterable[Listed]) -> int:
    """The sequence number of the next commit: 1 + the largest one in the directory."""
    return 1 + max((r.seq for r in listed if r.seq is not None), default=0)


def deletable(ordered: list[Listed], kept: Iterable[str], protect: Iterable[str] = ()) -> list[Listed]:
    """The snapshots of ``ordered`` (commit order) that retention may delete when the preservation
    policies keep the names ``kept``: only the plugin's own, never the newest snapshot of the
    directory (whoever wrote it), never a name in ``kept`` or ``protect``."""
    if not ordered:
        return []
    spared = set(protect) | set(kept) | {ordered[-1].text}
    return [r for r in ordered if r.ours and r.text not in spared]


def ahead_of(listed: Iterable[Listed], epoch: int, step: int) -> list[Listed]:
    """Snapshots whose progress is ahead of (epoch, step): written by another, longer run."""
    return [r for r in commit_order(listed) if (r.name.epoch, r.name.step) > (epoch, step)]


class _Deleter(Protocol):
    def remove(self, name: str) -> None: ...

    def child(self, name: str) -> str: ...


def apply(store: _Deleter, doomed: Iterable[Listed]) -> list[str]:
    """Delete ``doomed`` from ``store``; the warnings of deletions that failed (never raises)."""
    problems = []
    for record in doomed:
        try:
            store.remove(record.text)
        except Exception as exc:  # never fail training over a deletion
            problems.append(f"retention could not delete {store.child(record.text)}: {exc}")
    return problems
