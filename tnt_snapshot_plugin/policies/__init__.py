"""Policies: when to take a snapshot, and which committed snapshots to keep.

Both kinds are small objects combined with "any", so the configured cadences and users' own
policies mix freely (``SnapshotConfig.build(save_policies=..., preservation_policies=...)``, the
adapters' ``save_policies`` / ``preservation_policies``).

**Save decisions** answer :meth:`SavePolicy.should_save` for one :class:`Moment` (a train step
end, an epoch end, an eval epoch end). :class:`AnySave` takes a snapshot when any of its policies
says so; then a plugin's ``tnt_snapshot_plugin_should_snapshot`` hook (:class:`PluginDecision`)
has the last word, as its first non-None answer overrides the policies' (it may veto). A policy may
also tell the first step count at which it could say yes (:meth:`EveryNSteps.next_step`): the
saver's step gate skips every step end before it, so a step that does not snapshot costs two
attribute reads; a policy without ``next_step`` is asked at every step end. Preemption is not a
policy: a watched signal always snapshots and stops, and no policy or plugin can veto it
(``Snapshotter`` handles it; the time cadence's agreement is in cadence.py).

**Preservation** policies answer :meth:`PreservationPolicy.keep`: the names of the plugin's own
snapshots (given oldest first, by commit) they keep. Retention deletes the plugin's snapshots that
no policy keeps, and :func:`tnt_snapshot_plugin.policies.retention.deletable` stays the one judge of what may
ever be deleted: never the newest snapshot of the directory, never a protected one, never one the
plugin did not write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.policies import retention
from tnt_snapshot_plugin.policies.retention import Best, Listed

# -- save decisions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Moment:
    """Where training is when a snapshot may be due.

    ``event``: ``"step"`` (a train step end), ``"epoch"`` (a train epoch end) or ``"eval_epoch"``
    (an eval epoch end while training). ``epoch``: epochs completed; ``step``: train steps
    completed across all epochs; ``eval_epoch``: eval epochs completed (-1 outside eval epoch
    ends). ``time_due``: the wall-clock cadence asks for a snapshot now (the ranks agreed on it).
    """

    event: str
    epoch: int
    step: int
    eval_epoch: int = -1
    time_due: bool = False


@runtime_checkable
class SavePolicy(Protocol):
    """Whether to snapshot at a :class:`Moment`. Under torch.distributed it must answer the same
    on every rank. May define ``next_step(last: int) -> Optional[int]``: the first step count
    after ``last`` at whose end it could say yes (None: never at a step end)."""

    def should_save(self, moment: Moment) -> bool: ...


def _positive(name: str, n: Any) -> Any:
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
        raise ConfigError(f"{name} must be a positive number, got {n!r}")
    return n


@dataclass(frozen=True)
class EveryNSteps:
    """At the end of every train step whose count is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _positive("EveryNSteps.n", self.n)

    def should_save(self, moment: Moment) -> bool:
        return moment.event == "step" and moment.step % self.n == 0

    def next_step(self, last: int) -> Optional[int]:
        return (last // self.n + 1) * self.n


@dataclass(frozen=True)
class EveryNEpochs:
    """At the end of every train epoch whose count is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _positive("EveryNEpochs.n", self.n)

    def should_save(self, moment: Moment) -> bool:
        return moment.event == "epoch" and moment.epoch % self.n == 0

    def next_step(self, last: int) -> Optional[int]:
        return None


@dataclass(frozen=True)
class EveryNEvalEpochs:
    """At the end of every eval epoch (while training) whose count is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _positive("EveryNEvalEpochs.n", self.n)

    def should_save(self, moment: Moment) -> bool:
        return moment.event == "eval_epoch" and moment.eval_epoch % self.n == 0

    def next_step(self, last: int) -> Optional[int]:
        return None


@dataclass(frozen=True)
class EveryNSeconds:
    """At the first train step end after ``seconds`` of training since train start or the last
    snapshot (rank 0's clock, agreed by the ranks: :mod:`tnt_snapshot_plugin.saving.wall_clock`). The saver
    runs the clock; this policy reads its answer (``Moment.time_due``)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("EveryNSeconds.seconds", self.seconds)

    def should_save(self, moment: Moment) -> bool:
        return moment.event == "step" and moment.time_due

    def next_step(self, last: int) -> Optional[int]:
        return None  # no step count: the saver reads its clock at every step end (time_due)


class AnySave:
    """Snapshot when any of ``policies`` says so."""

    def __init__(self, policies: Iterable[SavePolicy]) -> None:
        self.policies = tuple(policies)

    def should_save(self, moment: Moment) -> bool:
        return any(policy.should_save(moment) for policy in self.policies)

    def next_step(self, last: int) -> Optional[int]:
        """The first step count after ``last`` at which any policy could say yes (None: none)."""
        steps = []
        for policy in self.policies:
            ask = getattr(policy, "next_step", None)
            step = last + 1 if ask is None else ask(last)
            if step is not None:
                steps.append(step)
        return min(steps, default=None)


class PluginDecision:
    """The plugins' ``tnt_snapshot_plugin_should_snapshot``: the first non-None answer overrides
    the policies' decision (``default``); asked only while some plugin implements the hook."""

    def __init__(self, plugin_manager: Any) -> None:
        self._pm = plugin_manager

    @property
    def active(self) -> bool:
        return bool(self._pm.hook.tnt_snapshot_plugin_should_snapshot.get_hookimpls())

    def decide(self, moment: Moment, default: bool) -> bool:
        answer = self._pm.hook.tnt_snapshot_plugin_should_snapshot(
            event=moment.event, epoch=moment.epoch, step=moment.step, default=default
        )
        return default if answer is None else bool(answer)


def save_policies(config: Any) -> AnySave:
    """The configured cadences of ``config`` (a SnapshotConfig) and its ``save_policies``."""
    found: list[SavePolicy] = []
    if config.save_every_n_train_steps is not None:
        found.append(EveryNSteps(config.save_every_n_train_steps))
    if config.save_every_n_epochs is not None:
        found.append(EveryNEpochs(config.save_every_n_epochs))
    if config.save_every_n_eval_epochs is not None:
        found.append(EveryNEvalEpochs(config.save_every_n_eval_epochs))
    if config.save_every_n_seconds is not None:
        found.append(EveryNSeconds(config.save_every_n_seconds))
    return AnySave([*found, *config.save_policies])


# -- preservation -------------------------------------------------------------------------------


@runtime_checkable
class PreservationPolicy(Protocol):
    """Which of the plugin's own snapshots (``ours``, oldest first by commit) to keep: their names."""

    def keep(self, ours: Sequence[Listed]) -> set[str]: ...


@dataclass(frozen=True)
class LatestN:
    """The ``n`` committed last, and any committed after the oldest of them."""

    n: int

    def __post_init__(self) -> None:
        _positive("LatestN.n", self.n)

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
        top = retention.ranked(ours, self.best.metric, self.best.mode)
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
        _positive("KeepEveryNSteps.n", self.n)

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
        _positive("KeepOnePerNHours.hours", self.hours)

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
        snapshots no policy keeps, within what :func:`retention.deletable` allows."""
        ordered = retention.commit_order(listed)
        return retention.deletable(ordered, self.keep([r for r in ordered if r.ours]), protect)


def preservation(config: Any) -> Optional[AnyPreservation]:
    """The retention of ``config`` (a SnapshotConfig): ``keep_last_n_snapshots``, best-k and its
    ``preservation_policies``; None when nothing is ever deleted."""
    found: list[PreservationPolicy] = []
    if config.keep_last_n_snapshots is not None:
        found.append(LatestN(config.keep_last_n_snapshots))
    if config.best is not None:
        # a snapshot without the metric is kept unless keep_last_n counts it (retention.py)
        found.append(BestN(config.best, keep_unscored=config.keep_last_n_snapshots is None))
    found.extend(config.preservation_policies)
    return AnyPreservation(found) if found else None


def checked(name: str, value: Any, kind: type) -> tuple[Any, ...]:
    """``value`` (None or an iterable of ``kind`` objects) as a tuple; a ConfigError otherwise."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a list of {kind.__name__} objects, got {value!r}")
    out = tuple(value)
    bad = [p for p in out if not isinstance(p, kind)]
    if bad:
        method = "should_save(moment)" if kind is SavePolicy else "keep(ours)"
        raise ConfigError(f"{name}: {bad[0]!r} is not a {kind.__name__} (it needs a method {method})")
    return out
