"""Commit order and retention: which snapshot is "latest", and which ones ``keep_last_n`` deletes.

Pure logic over listed records; it reads and deletes nothing itself (the store does, see
:func:`apply`), and imports nothing heavy.

* **Commit order.** The plugin records in each snapshot's index a commit sequence number
  (``seq``: 1 + the largest ``seq`` in ``dirpath`` when it commits). Snapshots are ordered by it;
  snapshots without one (written by torchtnt's own saver, or by older versions of this plugin) come
  first, among themselves by (epoch, step). "Latest" is the last in this order, so a fine-tune that
  restarted its progress at step 0 in a directory of a longer run is still "latest".
* **Retention.** ``keep_last_n`` counts the plugin's own snapshots (those with its index) in commit
  order, keeps the last ``n`` of them, and only ever deletes snapshots committed *before* every
  snapshot it keeps; never the newest snapshot of the directory, never one it did not write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol

from .naming import SnapshotName


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
    return Listed(name, seq=seq, ours=True, writer=writer if isinstance(writer, dict) else None)


def commit_order(listed: Iterable[Listed]) -> list[Listed]:
    """``listed`` oldest first: by commit sequence number, those without one first by (epoch, step)."""
    return sorted(listed, key=lambda r: r.order_key)


def next_seq(listed: Iterable[Listed]) -> int:
    """The sequence number of the next commit: 1 + the largest one in the directory."""
    return 1 + max((r.seq for r in listed if r.seq is not None), default=0)


def to_delete(listed: Iterable[Listed], keep_last_n: int, protect: Iterable[str] = ()) -> list[Listed]:
    """What ``keep_last_n`` retention deletes from ``listed`` (complete snapshots), oldest first.

    Counts only the plugin's own snapshots, in commit order, and keeps the last ``keep_last_n``;
    deletes only snapshots of the plugin's committed before all of those; never the newest
    snapshot of the directory (whoever wrote it) and never a name in ``protect``.
    """
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1, got {keep_last_n}")
    ordered = commit_order(listed)
    if not ordered:
        return []
    ours = [r for r in ordered if r.ours]
    if len(ours) <= keep_last_n:
        return []
    kept = ours[-keep_last_n:]
    oldest_kept = min(r.order_key for r in kept)
    spared = set(protect) | {ordered[-1].text} | {r.text for r in kept}
    return [r for r in ours[:-keep_last_n] if r.order_key < oldest_kept and r.text not in spared]


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
