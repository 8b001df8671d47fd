"""The wall-clock cadence: snapshot when ``save_every_n_seconds`` of training have passed.

Every rank must snapshot at the same step, so rank 0's clock decides. Under torch.distributed the
ranks learn rank 0's decision through the agreement they already run for preemption
(:class:`~tnt_snapshot_plugin.distributed.AgreedFlag`: a non-blocking all-reduce every few steps,
whose answer the next one reads), so the time cadence adds no collective of its own and never
waits on one. At each agreement every rank casts a vote (:meth:`WallClock.vote`; in one process:
at every step), the agreement combines the votes with MAX, and every rank reads the combined
answer (:meth:`WallClock.due`)::

    0: go on         1: rank 0's interval has elapsed: snapshot         2: preemption: stop

The rules, on every rank alike:

* The clock starts at train start and restarts whenever a snapshot is taken, whatever the reason
  (step or epoch cadence, preemption, a plugin, the wall clock itself), when training resumes
  after it: the interval is training time between snapshots, never shorter than a snapshot's stall.
* It is checked at train step ends only (as Lightning's ``train_time_interval``), never at epoch
  ends. In one process the snapshot is taken at the step whose end finds the interval elapsed;
  under torch.distributed, at the next agreement (the agreement's delay), on every rank.
* A request that another snapshot has overtaken (taken between rank 0's vote and the agreed
  answer, e.g. by the epoch cadence) is dropped: the clock restarted with that snapshot.
"""

from __future__ import annotations

import math
import time
from typing import Callable

#: The agreed answers (MAX over the ranks' votes).
GO_ON = 0
TIME_DUE = 1
PREEMPTED = 2


class WallClock:
    """One rank's view of the wall-clock cadence (only rank 0 reads its clock)."""

    def __init__(
        self,
        every_s: float,
        *,
        is_rank0: bool,
        delayed: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``delayed``: the agreed answer to a vote arrives at the next agreement (torch.distributed)."""
        self.every_s = every_s
        self._is_rank0 = is_rank0
        self._delayed = delayed
        # Only rank 0 reads its clock; the others' deadline stays infinite.
        self._clock = clock if is_rank0 else _zero
        self._deadline = math.inf
        self._snapshots = 0
        self._at_vote = 0
        self._at_previous_vote = 0

    def restart(self) -> None:
        """A snapshot was taken (or training starts): the interval starts again now."""
        if self._is_rank0:
            self._deadline = self._clock() + self.every_s
        self._snapshots += 1

    def vote(self) -> int:
        """This agreement's vote: TIME_DUE on rank 0 once its interval has elapsed (once per interval)."""
        if self._delayed:
            self._at_previous_vote = self._at_vote
            self._at_vote = self._snapshots
        if self._clock() < self._deadline:
            return GO_ON
        self._deadline = math.inf  # asked once per interval: restart() sets the next deadline
        return TIME_DUE

    def due(self, agreed: int) -> bool:
        """Whether the agreed answer asks for a time snapshot now (same on every rank)."""
        if agreed != TIME_DUE:
            return False
        # Delayed: dropped if a snapshot was taken since the vote it answers (the clock restarted
        # then). In one process the answer is this step's own vote: nothing came in between.
        return not self._delayed or self._snapshots == self._at_previous_vote


def _zero() -> float:
    return 0.0
