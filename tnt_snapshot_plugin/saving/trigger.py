"""Is a snapshot due? The save decisions (policies), the plugins' word, the wall-clock cadence
and preemption, answered at train step, epoch and eval epoch ends; and the step gate that lets a
step end with nothing to do return after one cheap call (:meth:`Trigger.quiet`).

The gate: step ends from :attr:`Trigger.last_step` (again) up to before :attr:`Trigger.step_gate`
need no look. It is 0 (every step) while something needs one: the saver holds it open (a snapshot
is being written, staging buffers are to be prepared again), a plugin decides each snapshot, a
watched signal arrived, or no step end has told the run's step count yet. Otherwise it is the
first step count at which a policy could say yes (``next_step``), or under torch.distributed the
ranks' next agreement on preemption, if sooner. With a wall clock every step end reads the clock
(the gate is 0), and :attr:`Trigger.untimed_gate` keeps the step-count gate.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

from tnt_snapshot_plugin.distributed import AgreedFlag, Collectives
from tnt_snapshot_plugin.policies import EveryNSeconds, Moment, save_policies
from tnt_snapshot_plugin.saving.preemption import PreemptionHandler
from tnt_snapshot_plugin.saving.saver_hooks import SaverHooks
from tnt_snapshot_plugin.saving.wall_clock import GO_ON, PREEMPTED, TIME_DUE, WallClock

#: The step gate when no step cadence is set: no step count reaches it.
_NEVER = 1 << 62


class StepOutcome(enum.Enum):
    """What a step end is due: nothing (and the gates stay as they are), nothing, a snapshot, or
    the preemption snapshot."""

    QUIET = 0
    NOTHING = 1
    SNAPSHOT = 2
    PREEMPTED = 3


# The outcomes as module globals for the step ends' hot path: reading an Enum member through its
# class costs several times a global read (benchmarks/hooks.py, the save_every_n_seconds row).
STEP_QUIET, STEP_NOTHING = StepOutcome.QUIET, StepOutcome.NOTHING
STEP_SNAPSHOT, STEP_PREEMPTED = StepOutcome.SNAPSHOT, StepOutcome.PREEMPTED


class Trigger:
    """One saver's answer to "is this moment due?", and its step gate."""

    def __init__(
        self,
        config: Any,
        hooks: SaverHooks,
        clock: Callable[[], float],
    ) -> None:
        #: when to snapshot: the cadences and the user's policies (any), then the plugins' word
        self.decisions = save_policies(config)
        self._hooks = hooks
        self._signals = tuple(config.preemption_signals)
        self._clock = clock
        #: the wall-clock cadence's interval (EveryNSeconds among the decisions; the shortest)
        self.wall_s: Optional[float] = min(
            (p.seconds for p in self.decisions.policies if isinstance(p, EveryNSeconds)), default=None
        )
        self.step_gate = 0
        self.untimed_gate = 0
        #: the step of the last step end that ran (-1: none yet this run). A step count below it
        #: (progress rolled back mid-run by a restore) always reaches the saver.
        self.last_step = -1
        self._held = False
        self.wall: Optional[WallClock] = None
        self._wall_flag: Optional[AgreedFlag] = None
        self.preemption: Optional[PreemptionHandler] = None
        # The preemption agreement runs on the training thread while the writer thread may be
        # inside a collective on the saver's collectives: it has a group of its own.
        self._flags: Optional[Collectives] = None

    @property
    def needs_flags(self) -> bool:
        """Whether the ranks agree on anything at step ends (preemption, the wall clock)."""
        return bool(self._signals) or self.wall_s is not None

    # -- the gate (the hot path) -------------------------------------------------------------

    def quiet(self, step: int) -> bool:
        """Whether the end of train step ``step`` has nothing to do (the adapters' one check)."""
        return self.last_step <= step < self.step_gate

    def hold(self, held: bool) -> None:
        """The saver has something to look at every step end (``held``), or no longer."""
        self._held = held
        self.regate()

    def regate(self) -> None:
        """Recompute :attr:`step_gate` from its inputs."""
        preemption, last = self.preemption, self.last_step
        if (
            last < 0
            or self._held
            or self._hooks.asks_should
            or (preemption is not None and preemption.received is not None)
        ):
            self.step_gate = self.untimed_gate = 0
            return
        gate = self.decisions.next_step(last)  # e.g. EveryNSteps: the next multiple of n
        if gate is None:
            gate = _NEVER
        self.untimed_gate = gate  # the clock's agreement is polled before it is looked at
        if preemption is not None and preemption.distributed:  # one process: the signal opens it
            gate = min(gate, preemption.next_poll(last + 1))
        self.step_gate = 0 if self.wall is not None else gate
        if preemption is not None and preemption.received is not None:
            # The signal came while this ran (its handler runs between two bytecodes of it):
            # the handler's own gate of 0 may have just been overwritten above.
            self.step_gate = 0

    def _on_signal(self) -> None:
        self.step_gate = 0

    # -- a run --------------------------------------------------------------------------------

    def start(self, flags: Collectives, rank: int) -> None:
        """Train start: watch the preemption signals, start the wall clock; every step end is
        looked at until the first one tells the run's step count."""
        self._flags = flags
        self.last_step = -1
        if self._signals and self.preemption is None:
            self.preemption = PreemptionHandler(self._signals, flags, on_signal=self._on_signal, clock=self._clock)
            self.preemption.install()
        if self.wall_s is not None:
            self.wall = WallClock(self.wall_s, is_rank0=rank == 0, delayed=flags.world_size > 1, clock=self._clock)
            self.wall.restart()
            if flags.world_size > 1 and self.preemption is None:  # no preemption agreement to ride on
                self._wall_flag = AgreedFlag(flags, self._clock)
        self.regate()

    def stop(self) -> None:
        """Training is over: stop watching for preemption and the wall clock."""
        if self.preemption is not None:
            self.preemption.uninstall()
            self.preemption = None
        if self._wall_flag is not None:
            self._wall_flag.drain()
            self._wall_flag = None
        self.wall = None
        self.regate()

    def snapshot_taken(self) -> None:
        """A snapshot was taken (whatever its reason): the wall-clock interval starts again."""
        if self.wall is not None:
            self.wall.restart()

    def ran(self, step: int) -> None:
        """The step end of ``step`` ran, or raised, after :meth:`at_step_end` found it not quiet:
        the gates follow."""
        self.last_step = step
        self.regate()

    # -- decisions ----------------------------------------------------------------------------

    def at_step_end(self, epoch: int, step: int) -> StepOutcome:
        """What the end of train step ``step`` is due (preemption polled, the wall clock read).
        Unless it is QUIET, the caller reports the step end done with :meth:`ran`."""
        preemption, wall = self.preemption, self.wall
        agreed = GO_ON
        # In one process every step polls (the vote is the answer); under torch.distributed only
        # the agreement's steps do, the same on every rank (AgreedFlag), and the votes are cast there.
        if preemption is not None:
            if preemption.due(step):
                agreed = preemption.poll(GO_ON if wall is None else wall.vote(), step)
                if agreed == PREEMPTED:
                    return STEP_PREEMPTED
        elif wall is not None:
            flag = self._wall_flag
            if flag is None:
                agreed = wall.vote()
            elif flag.due(step):
                agreed = flag.poll(wall.vote(), step)
        time_due = agreed == TIME_DUE and wall is not None and wall.due(agreed)
        if wall is not None and not time_due and self.last_step <= step < self.untimed_gate:
            # The clock says not yet, and no step cadence is due: nothing the gates depend on
            # changed, only the step is noted.
            self.last_step = step
            return STEP_QUIET
        due = self.due(Moment("step", epoch, step, time_due=time_due))
        return STEP_SNAPSHOT if due else STEP_NOTHING

    def due(self, moment: Moment) -> bool:
        """Whether the policies, then the plugins, ask for a snapshot at ``moment``."""
        return self._hooks.decide(moment, self.decisions.should_save(moment))

    def preempted(self) -> Optional[PreemptionHandler]:
        """After the preemption snapshot: the handler, no longer watched (training may go on,
        with a handler that returns: the clock's votes then need an agreement of their own)."""
        preemption, self.preemption = self.preemption, None
        if self.wall is not None and self._flags is not None and self._flags.world_size > 1:
            self._wall_flag = AgreedFlag(self._flags, self._clock)
        self.regate()
        return preemption
