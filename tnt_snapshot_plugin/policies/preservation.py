"""Preservation: which of the plugin's committed snapshots to keep.

A preservation policy answers :meth:`PreservationPolicy.keep`: the names of the plugin's own
snapshots (given oldest first, by commit) it keeps. :class:`AnyPreservation` keeps what any of its
policies keeps; retention deletes the plugin's snapshots that no policy keeps, and
:func:`tnt_snapshot_plugin.policies.retention.deletable` stays the one judge of what may ever be
deleted: never the newest snapshot of the directory, never a protected one, never one the plugin
did not write. :func:`from_settings` is the one place ``keep_last_n`` and best-k become policies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

from tnt_snapshot_plugin.config import Best, positive_number
from tnt_snapshot_plugin.policies.retention import Listed, commit_order, deletable, ranked


@runtime_checkable
class PreservationPolicy(Protocol):
    """Which of the plugin's own snapshots (``ours``, oldest first by commit) to keep: their names."""

    def keep(self, ours: Sequence[Listed]) -> set[str]: ...


@dataclass(frozen=True)
class LatestN:
    """The ``n`` committed last, and any committed after the oldest of them."""

    n: int

    def __post_init__(self) -> None:
        positive_number("LatestN.n", self.n)

    def keep(self, ours: Sequence[Listed]) -> set[str]:
        kept = list(ours[-self.n :])
        if not kept:
            return set()
        oldest = min(r.order_key for r in kept)
        return {r.text for r in kept} | {r.text for r in ours if r.order_key >= oldest}


@dataclass(frozen=True)
class BestN:
    """The ``best.k`` best by ``best.metric`` (every one carrying it when ``k`` is None); with
    ``keep_unscored``, also every snapshot without a value for the metric."""

    best: Best
    keep_unscored: bool = False

    def keep(self, ours: Sequence[Listed]) -> set[str]:
        top = ranked(ours, self.best.metric, self.best.mode)
        kept = {r.text for r in (top if self.best.k is None else top[: self.best.k])}
        if self.keep_unscored:
            kept |= {r.text for r in ours if r.metric_value(self.best.metric) is None}
        return kept


@dataclass(frozen=True)
class KeepEveryNSteps:
    """One snapshot per span of ``n`` train steps (0..n-1, n..2n-1, ...): the first committed in
    each span, e.g. a long run's snapshot of every 10,000 steps beside the newest few."""

    n: int

    def __post_init__(self) -> None:
        positive_number("KeepEveryNSteps.n", self.n)

    def keep(self, ours: Sequence[Listed]) -> set[str]:
        seen: set[int] = set()
        kept = set()
        for record in ours:
            span = record.name.step // self.n
            if span not in seen:
                seen.add(span)
                kept.add(record.text)
        return kept


@dataclass(frozen=True)
class KeepOnePerNHours:
    """The oldest snapshot, then each next one committed at least ``hours`` after the last one
    kept (by the commit time in the plugin's index; snapshots without one are not kept by it)."""

    hours: float

    def __post_init__(self) -> None:
        positive_number("KeepOnePerNHours.hours", self.hours)

    def keep(self, ours: Sequence[Listed]) -> set[str]:
        kept = set()
        last: Optional[float] = None
        for record in ours:
            at = record.committed_at
            if at is not None and (last is None or at - last >= self.hours * 3600):
                kept.add(record.text)
                last = at
        return kept


class AnyPreservation:
    """Keep what any of ``policies`` keeps."""

    def __init__(self, policies: Iterable[PreservationPolicy]) -> None:
        self.policies = tuple(policies)

    def keep(self, ours: Sequence[Listed]) -> set[str]:
        kept: set[str] = set()
        for policy in self.policies:
            kept |= set(policy.keep(ours))
        return kept

    def to_delete(self, listed: Iterable[Listed], protect: Iterable[str] = ()) -> list[Listed]:
        """What retention deletes from ``listed`` (complete snapshots), oldest first: the plugin's
        snapshots no policy keeps, within what :func:`~tnt_snapshot_plugin.policies.retention.deletable` allows."""
        ordered = commit_order(listed)
        return deletable(ordered, self.keep([r for r in ordered if r.ours]), protect)


def from_settings(
    keep_last_n: Optional[int], best: Optional[Best], more: Iterable[PreservationPolicy] = ()
) -> Optional[AnyPreservation]:
    """The preservation of these settings: the last ``keep_last_n`` (:class:`LatestN`), best-k
    (:class:`BestN`; a snapshot without the metric is kept unless ``keep_last_n`` counts it) and
    ``more``; None when nothing is ever deleted. The one place these settings become policies."""
    found: list[PreservationPolicy] = []
    if keep_last_n is not None:
        found.append(LatestN(keep_last_n))
    if best is not None:
        found.append(BestN(best, keep_unscored=keep_last_n is None))
    found.extend(more)
    return AnyPreservation(found) if found else None


def preservation(config: Any) -> Optional[AnyPreservation]:
    """The retention of ``config`` (a SnapshotConfig): ``keep_last_n_snapshots``, best-k and its
    ``preservation_policies``; None when nothing is ever deleted."""
    return from_settings(config.keep_last_n_snapshots, config.best, config.preservation_policies)


def to_delete(
    listed: Iterable[Listed],
    keep_last_n: Optional[int],
    protect: Iterable[str] = (),
    best: Optional[Best] = None,
) -> list[Listed]:
    """What retention deletes from ``listed`` (complete snapshots), oldest first, with
    ``keep_last_n`` and ``best`` (:func:`from_settings`); nothing when both are None.

    Without ``best``: counts only the plugin's own snapshots, in commit order, and keeps the last
    ``keep_last_n``; deletes only snapshots of the plugin's committed before all of those.
    With ``best``: keeps the plugin's ``best.k`` best by ``best.metric``, the last
    ``keep_last_n`` (when not None), and, when ``keep_last_n`` is None, every snapshot without a
    value for the metric; deletes the plugin's others.
    Never the newest snapshot of the directory (whoever wrote it), never a name in ``protect``,
    never a snapshot the plugin did not write (:func:`~tnt_snapshot_plugin.policies.retention.deletable`).
    """
    if keep_last_n is not None and keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1, got {keep_last_n}")
    policy = from_settings(keep_last_n, best)
    return policy.to_delete(listed, protect) if policy is not None else []
