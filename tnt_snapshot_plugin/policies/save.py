"""Save decisions: whether to take a snapshot at a :class:`Moment` (a train step end, an epoch
end, an eval epoch end).

:class:`AnySave` takes a snapshot when any of its policies says so; then a plugin's
``tnt_snapshot_plugin_should_snapshot`` hook (:class:`PluginDecision`) has the last word, as its
first non-None answer overrides the policies' (it may veto). A policy may also tell the first step
count at which it could say yes (:meth:`EveryNSteps.next_step`): the saver's step gate skips every
step end before it, so a step that does not snapshot costs two attribute reads; a policy without
``next_step`` is asked at every step end. Preemption is not a policy: a watched signal always
snapshots and stops, and no policy or plugin can veto it (``saving.preemption``; the time
cadence's agreement is in ``saving.wall_clock``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, runtime_checkable

from tnt_snapshot_plugin.config import positive_number


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


@dataclass(frozen=True)
class EveryNSteps:
    """At the end of every train step whose count is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        positive_number("EveryNSteps.n", self.n)

    def should_save(self, moment: Moment) -> bool:
        return moment.event == "step" and moment.step % self.n == 0

    def next_step(self, last: int) -> Optional[int]:
        return (last // self.n + 1) * self.n


@dataclass(frozen=True)
class EveryNEpochs:
    """At the end of every train epoch whose count is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        positive_number("EveryNEpochs.n", self.n)

    def should_save(self, moment: Moment) -> bool:
        return moment.event == "epoch" and moment.epoch % self.n == 0

    def next_step(self, last: int) -> Optional[int]:
        return None


@dataclass(frozen=True)
class EveryNEvalEpochs:
    """At the end of every eval epoch (while training) whose count is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        positive_number("EveryNEvalEpochs.n", self.n)

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
        positive_number("EveryNSeconds.seconds", self.seconds)

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
