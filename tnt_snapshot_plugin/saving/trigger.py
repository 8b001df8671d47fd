"""The training events a saver answers: the step gate, the save decisions at train step, epoch
and eval epoch ends (policies.py), and preemption. A part of
:class:`~tnt_snapshot_plugin.saving.saver.Snapshotter`, which keeps the lifecycle around it."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from tnt_snapshot_plugin import policies
from tnt_snapshot_plugin.distributed import AgreedFlag
from tnt_snapshot_plugin.hooks import PluginManager
from tnt_snapshot_plugin.policies import Moment
from tnt_snapshot_plugin.saving.parts import SaverParts
from tnt_snapshot_plugin.saving.preemption import PreemptionHandler
from tnt_snapshot_plugin.saving.wall_clock import GO_ON, PREEMPTED, TIME_DUE, WallClock

if TYPE_CHECKING:
    pass

logger = logging.getLogger("tnt_snapshot_plugin.saving.saver")

Collect = Callable[[bool], Mapping[str, Any]]

#: The step gate when no step cadence is set: no step count reaches it.
_NEVER = 1 << 62


class SaverEvents(SaverParts):
    """Step, epoch and eval-epoch ends and preemption: what is due, and the step gate that lets
    a step that does not snapshot return at once."""

    def _init_events(self, config: Any, clock: Callable[[], float], on_preempted: Any) -> None:
        """Set up what decides (policies.py) and the step gate; nothing is watched before train start."""
        #: when to snapshot: the cadences and the user's policies (any), then the plugins' word
        self.decisions = policies.save_policies(config)
        self._plugin_decision = policies.PluginDecision(self.plugin_manager)
        self._ask_should = self._plugin_decision.active
        if isinstance(self.plugin_manager, PluginManager):
            self.plugin_manager.on_change(self._plugins_changed)
        #: the wall-clock cadence's interval (EveryNSeconds among the decisions; the shortest)
        self._wall_s = min(
            (p.seconds for p in self.decisions.policies if isinstance(p, policies.EveryNSeconds)), default=None
        )
        #: Step ends from :attr:`last_step` (again) to before this step count need no step_end() call:
        #: nothing is pending or failed, no buffers to prepare, no wall clock, no plugin asking,
        #: no signal received, and neither the step cadence nor (under torch.distributed) the
        #: ranks' next agreement is due before it. 0 (every step) while something needs a look,
        #: and until a step end has told the run's step count. The adapters skip a step end when
        #: ``last_step <= step < step_gate``; it is recomputed after every step_end() that ran,
        #: whenever one of its inputs is assigned (_GateInput), and when a watched signal arrives.
        self.step_gate = 0
        #: The same gate without the wall clock: the step count from which a policy could say
        #: yes by the step counts alone (0: every step). With a wall clock every step end runs
        #: to read it; one before this gate whose clock says "not yet" stops there.
        self._untimed_gate = 0
        #: the step of the last step end that ran (-1: none yet this run). A step count below it
        #: (progress rolled back mid-run by a restore) always reaches step_end().
        self.last_step = -1
        self.__dict__.update(
            _pending=None, _prepare_again=None, _wall=None, _preemption=None
        )
        self._on_preempted = on_preempted
        # The wall-clock cadence (cadence.py, _wall), made at train start; its votes ride on the
        # preemption agreement, or on an agreement of their own when preemption is off.
        self._clock = clock
        self._wall_flag: Optional[AgreedFlag] = None
        # The preemption agreement runs on the training thread while the writer thread
        # may be inside a collective on the saver's collectives: it gets a group of its own.
        self._flag_coll: Optional[Any] = None
        self._regate()

    def _start_watching(self) -> None:
        """Train start: watch the preemption signals and start the wall-clock cadence."""
        if self.config.preemption_signals and self._preemption is None:
            assert self._flag_coll is not None
            self._preemption = PreemptionHandler(
                self.config.preemption_signals, self._flag_coll, on_signal=self._regate, clock=self._clock
            )
            self._preemption.install()
        if self._wall_s is not None:
            assert self._flag_coll is not None
            self._wall = WallClock(
                self._wall_s,
                is_rank0=self.collectives.rank == 0,
                delayed=self._flag_coll.world_size > 1,
                clock=self._clock,
            )
            self._wall.restart()
            if self._flag_coll.world_size > 1 and self._preemption is None:
                # no preemption agreement to ride on
                self._wall_flag = AgreedFlag(self._flag_coll, self._clock)

    def _stop_triggers(self) -> None:
        """Training is over: stop watching for preemption and the wall clock."""
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        if self._wall_flag is not None:
            self._wall_flag.drain()
            self._wall_flag = None
        self._wall = None

    def _regate(self) -> None:
        """Recompute :attr:`step_gate` from its inputs."""
        preemption, last = self._preemption, self.last_step
        if (
            last < 0
            or self._pending is not None
            or self._prepare_again is not None
            or self._ask_should
            or (preemption is not None and preemption.received is not None)
        ):
            self.step_gate = self._untimed_gate = 0
            return
        gate = self.decisions.next_step(last)  # e.g. EveryNSteps: the next multiple of n
        if gate is None:
            gate = _NEVER
        self._untimed_gate = gate  # the clock's agreement is polled before it is looked at
        if preemption is not None and preemption.distributed:  # one process: the signal opens it
            gate = min(gate, preemption.next_poll(last + 1))
        self.step_gate = 0 if self._wall is not None else gate
        if preemption is not None and preemption.received is not None:
            # The signal came while this ran (its handler runs between two bytecodes of it):
            # the handler's own gate of 0 may have just been overwritten above.
            self.step_gate = 0

    def step_end(self, epoch: int, step: int, collect: Collect) -> None:
        # The hot path. A training loop runs it cold (the step's own work has evicted it from
        # the CPU caches), so the common step, which has nothing to do, reads two attributes and
        # returns (step_gate; the adapters check it before calling).
        if self.last_step <= step < self.step_gate:
            return
        try:
            quiet = self._step_end(epoch, step, collect)
        except BaseException:
            self.last_step = step
            self._regate()
            raise
        self.last_step = step
        if not quiet:  # a quiet step end (the clock read, not due) leaves the gates as they are
            self._regate()

    def _step_end(self, epoch: int, step: int, collect: Collect) -> bool:
        """The step end's work; whether it was quiet: only the wall clock read, and no step
        cadence due (nothing the gates depend on changed)."""
        if self._pending is not None:
            self._reap_if_done()
        preemption, wall = self._preemption, self._wall
        agreed = GO_ON
        # In one process every step polls (the vote is the answer); under torch.distributed
        # only the agreement's steps do, the same on every rank (AgreedFlag), and the votes
        # are cast there.
        if preemption is not None:
            if preemption.due(step):
                agreed = preemption.poll(GO_ON if wall is None else wall.vote(), step)
                if agreed == PREEMPTED:
                    self._preempt(epoch, step, collect)
                    return False
        elif wall is not None:
            flag = self._wall_flag
            if flag is None:
                agreed = wall.vote()
            elif flag.due(step):
                agreed = flag.poll(wall.vote(), step)
        time_due = agreed == TIME_DUE and wall is not None and wall.due(agreed)
        if wall is not None and not time_due and self.last_step <= step < self._untimed_gate:
            return True  # the clock says not yet, and no step cadence is due
        self._save_if_due(Moment("step", epoch, step, time_due=time_due), collect, True)
        return False

    def epoch_end(self, epoch: int, step: int, collect: Collect) -> None:
        self._reap_if_done()
        self._save_if_due(Moment("epoch", epoch, step), collect, False)

    def eval_epoch_end(
        self, epoch: int, step: int, eval_epoch: int, eval_step: int, collect: Collect
    ) -> None:
        """An eval epoch ended while training (``eval_epoch`` eval epochs and ``eval_step`` eval
        steps completed): snapshot if the eval cadence (or a plugin) says so. The snapshot is named
        ``epoch_E_step_S_eval_V``: after the train snapshot of the same step, never the same name."""
        self._reap_if_done()
        moment = Moment("eval_epoch", epoch, step, eval_epoch=eval_epoch)
        due = self.decisions.should_save(moment)
        if self._ask_should:
            due = self._plugin_decision.decide(moment, due)
        if due:
            self.save(
                epoch, step, functools.partial(collect, False), event="eval_epoch", eval_step=eval_step
            )

    def _save_if_due(self, moment: Moment, collect: Collect, intra_epoch: bool) -> None:
        due = self.decisions.should_save(moment)
        if self._ask_should:
            due = self._plugin_decision.decide(moment, due)
        if due:
            self._prepare_again = None  # the snapshot staged everything
            self.save(moment.epoch, moment.step, functools.partial(collect, intra_epoch), event=moment.event)
        elif self._prepare_again is not None and self._pending is None:
            again, self._prepare_again = self._prepare_again, None
            self._stage_for_prepare(again)

    def _preempt(self, epoch: int, step: int, collect: Collect) -> None:
        assert self._preemption is not None
        logger.warning("tnt_snapshot_plugin: preemption signal received; snapshotting step %d", step)
        self.save(epoch, step, functools.partial(collect, True), event="preemption")
        self.wait()
        preemption, self._preemption = self._preemption, None
        if self._wall is not None and self._flag_coll is not None and self._flag_coll.world_size > 1:
            # Training may go on (a handler that returns): the time cadence's votes need an
            # agreement of their own now; its first poll comes after the handler's is drained.
            self._wall_flag = AgreedFlag(self._flag_coll, self._clock)
        if self._on_preempted is None:
            preemption.finish()
            return
        signum = preemption.received_signal
        preemption.uninstall()
        self._on_preempted(signum)
