"""The framework-neutral engine every adapter drives.

An adapter translates its framework's events into four calls, each given the progress
(``epoch`` = epochs completed, ``step`` = train steps completed across all epochs) and a
``collect(intra_epoch) -> {key: Stateful}`` function that is only called when a snapshot is taken:

* :meth:`Snapshotter.train_start` - collision checks, the dirpath lock for the run (rank 0; a
  second live saver on the dirpath gets ConfigError), cleanup of leftovers whose writer is gone, a
  warning about snapshots ahead of the run's progress, signal handlers;
* :meth:`Snapshotter.step_end` / :meth:`Snapshotter.epoch_end` - cadence, preemption;
* :meth:`Snapshotter.train_end` - the final snapshot, then wait for it;
* :meth:`Snapshotter.exception` - wait for the pending snapshot, keep what is committed.

How a snapshot is taken (asynchronous mode):

1. on the training thread: wait for the previous snapshot (one in flight at most; for the
   cadences' snapshots in one process, at most ``storage_timeout_s`` in all between two commits,
   then the due snapshot is skipped), call every entry's ``state_dict()`` and copy the tensors
   into reused staging buffers. This copy is the whole stall; training then mutates its tensors
   freely.
2. on a background thread: :class:`writer_job.SnapshotWriter` writes the copies in
   torchsnapshot's format under a staging name (every file fsynced and checksummed); the ranks
   agree whether every rank wrote everything; rank 0 commits (the manifest and the index, with
   the commit sequence number, by the store's commit strategy); retention (retention.py)
   deletes older snapshots only then.
3. at the next hook on the training thread: the outcome is reaped - the ``snapshot_committed``
   hook runs, or the failure is reported with its step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Mapping, Optional, TypeVar, Union

import pluggy

from . import policies, run_guard
from .app_state import (
    RESERVED_KEYS,
    RNG_STATE_KEY,
    RNGState,
    Stager,
    check_collisions,
    freeze_without_copy,
    replicated_patterns,
)
from .cadence import GO_ON, PREEMPTED, TIME_DUE, WallClock
from .config import SnapshotConfig
from .distributed import AgreedFlag, Collectives, is_initialized
from .errors import (
    ConfigError,
    SnapshotBusyWarning,
    SnapshotError,
    SnapshotFailedWarning,
    SnapshotSkippedWarning,
    SnapshotWriteError,
    UnrestorableStateError,
)
from .job import Job, SnapshotRecord, SnapshotStats, Worker, failure_message, is_ddp, uncopyable
from .loading import LoadCheck
from .naming import SnapshotName
from .plugins import PluginManager, check_plugin, extra_state_sources, new_plugin_manager
from .policies import Moment
from .preemption import PreemptionHandler
from .stores import DirLock, Store, open_store
from .stores.ownership import live_runs, new_run_id, staging_token
from .writer_job import SnapshotWriter

logger = logging.getLogger(__name__)

Collect = Callable[[bool], Mapping[str, Any]]


T = TypeVar("T")

#: The events whose snapshot is skipped, rather than waited for, when the previous snapshot is
#: still being written after ``storage_timeout_s``: the cadences. A final or preemption snapshot
#: (and one the user asks for) waits for the previous one, however long it takes.
_BOUNDED_EVENTS = frozenset({"step", "epoch", "eval_epoch"})

#: The step gate when no step cadence is set: no step count reaches it.
_NEVER = 1 << 62


class _GateInput(Generic[T]):
    """An attribute of :class:`Snapshotter` that its step gate depends on: each assignment
    recomputes ``Snapshotter.step_gate``. There is no ``__get__`` at run time, so reads come
    straight from the instance dict, as for a plain attribute."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __set__(self, obj: "Snapshotter", value: T) -> None:
        obj.__dict__[self._name] = value
        obj._regate()

    if TYPE_CHECKING:  # what a read returns, for the type checker only

        def __get__(self, obj: "Snapshotter", objtype: Optional[type] = None) -> T: ...


class Snapshotter:
    """Cadence, naming, async bookkeeping, commit and retention for one snapshot directory."""

    # What makes a step end more than a cadence check (see step_gate): the snapshot being
    # written and the last failure (reaped or reported at the next hook), prepare()'s second pass
    # (at the run's first step that does not snapshot), the wall-clock cadence, the signal handler.
    _pending: _GateInput[Optional[Job]] = _GateInput()
    _failure: _GateInput[Optional[str]] = _GateInput()
    _prepare_again: _GateInput[Optional[Callable[[], Mapping[str, Any]]]] = _GateInput()
    _wall: _GateInput[Optional[WallClock]] = _GateInput()
    _preemption: _GateInput[Optional[PreemptionHandler]] = _GateInput()

    def __init__(
        self,
        dirpath: str,
        config: SnapshotConfig,
        *,
        process_group: Optional[Any] = None,
        plugin_manager: Optional[pluggy.PluginManager] = None,
        never_replicated: Iterable[str] = (),
        on_preempted: Optional[Callable[[int], None]] = None,
        clock: Callable[[], float] = time.monotonic,
        weights_only: bool = True,
        metric: Optional[Callable[[], Optional[tuple[str, float]]]] = None,
    ) -> None:
        """``never_replicated``: entry keys that differ between ranks by nature (beyond the
        built-in reserved and ``*_progress`` keys), never marked replicated whatever the
        ``replicated`` globs say. ``on_preempted(signum)``: called once the preemption snapshot is
        durable, instead of handing the signal to the handler that was installed before the saver's,
        for frameworks with their own way to stop on a signal (it may raise to stop training).
        ``clock``: the time source of ``save_every_n_seconds`` (tests pass a fake one).
        ``weights_only``: how restore will load this run's snapshots. True (default): every
        snapshot is checked to load under ``torch.load(weights_only=True)`` and the plugin's safe
        globals before it is written (``loading.LoadCheck``; UnrestorableStateError otherwise).
        False: no check; the snapshots must then be restored with ``weights_only=False``.
        ``metric``: the adapter's source of the monitored metric (best-k retention,
        ``config.best``): called on the training thread only when a snapshot is taken, returns
        (name, value) or None (the snapshot is then saved without a metric); the value goes into
        the snapshot's name (``..._<name>=<value>``) and index. It may raise ConfigError (a
        metric the framework never produced), which stops training whatever ``on_save_error``
        says. Under torch.distributed rank 0's value names the snapshot.
        """
        self.config = config
        #: this saver's hooks: a manager of its own (entry-point plugins loaded) unless one is given
        self.plugin_manager = plugin_manager if plugin_manager is not None else new_plugin_manager()
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
        #: the step of the last step end that ran (-1: none yet this run). A step count below it
        #: (progress rolled back mid-run by a restore) always reaches step_end().
        self.last_step = -1
        self.__dict__.update(
            _pending=None, _failure=None, _prepare_again=None, _wall=None, _preemption=None
        )
        self._regate()
        self._process_group = process_group
        self._never_replicated = tuple(never_replicated)
        self._on_preempted = on_preempted
        self._metric = metric
        # Under torch.distributed only rank 0's dirpath counts (the others may pass anything,
        # "" included): it is opened once broadcast, in attach(), on every rank alike.
        self._dirpath_arg = dirpath
        self._store: Store = (
            None  # type: ignore[assignment]
            if is_initialized()
            else open_store(dirpath, config.storage_options, timeout_s=config.storage_timeout_s)
        )
        self._coll: Optional[Collectives] = None
        # The preemption agreement runs on the training thread while the writer thread
        # may be inside a collective on self._coll: it gets a group of its own.
        self._flag_coll: Optional[Collectives] = None
        self._stager = Stager()
        #: the one thread that writes asynchronous snapshots (job.py)
        self._worker = Worker()
        self._load_check = LoadCheck(weights_only=weights_only)
        self._last_name: Optional[str] = None
        # The wall-clock cadence (cadence.py, _wall), made at train start; its votes ride on the
        # preemption agreement, or on an agreement of their own when preemption is off.
        self._clock = clock
        self._wall_flag: Optional[AgreedFlag] = None
        self.stats = SnapshotStats()
        self._busy_warned = False
        self._waited_s = 0.0
        #: how long training has waited for writes at due snapshots since the last commit: at
        #: most ``storage_timeout_s`` (then due snapshots are skipped while a write is pending)
        self._blocked_s = 0.0
        #: whether a skip was warned about since the last commit (one warning per outage)
        self._skip_warned = False
        self._metrics: Optional[Any] = None
        #: identifies this saver's run in its writes (staging names, markers, the index), so a
        #: leftover can be told from a live write; renewed at each train start
        self._run_id = new_run_id()
        self._lock: Optional[DirLock] = None
        self._warned_ahead = False
        self._writes = 0
        self._writer: SnapshotWriter = None  # type: ignore[assignment]  # made by attach()
        #: names of snapshots in dirpath that retention never deletes (an adapter adds the one
        #: the run resumed from, as Lightning's ModelCheckpoint keeps it)
        self.protected: set[str] = set()
        self.attach()

    # -- plugins ------------------------------------------------------------------------------

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register ``plugin`` on this saver only (its ``@hookimpl`` methods apply from the next
        hook on) and return its name. Raises ConfigError, registering nothing, when a
        ``tnt_snapshot_plugin_*`` attribute is not a known hook (a misspelling), lacks the
        ``@hookimpl`` marker, or takes a parameter its hook does not have."""
        pm = self.plugin_manager
        if isinstance(pm, PluginManager):
            return pm.register(plugin, name)  # checked, and tells _plugins_changed
        registered = check_plugin(pm, plugin, name)
        self._plugins_changed()
        return registered

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver; its hooks are not called from then on."""
        self.plugin_manager.unregister(plugin)
        if not isinstance(self.plugin_manager, PluginManager):
            self._plugins_changed()

    def _plugins_changed(self) -> None:
        """A plugin came or went: read again which optional hooks are implemented."""
        self._ask_should = self._plugin_decision.active
        self._regate()

    # -- set-up -----------------------------------------------------------------------------

    @property
    def dirpath(self) -> str:
        return self._store.url

    @property
    def collectives(self) -> Collectives:
        self.attach()
        assert self._coll is not None
        return self._coll

    def attach(self) -> None:
        """Join torch.distributed if it is initialised now (collective); idempotent.

        Creates the checkpoint gloo group, takes rank 0's dirpath, checks it can be written.
        """
        if self._coll is not None and (self._coll.distributed or not is_initialized()):
            return
        self._coll = Collectives.create(self._process_group, self.config.collective_timeout_s)
        self._flag_coll = (
            Collectives.create(self._process_group, self.config.collective_timeout_s)
            if self.config.preemption_signals or self._wall_s is not None
            else Collectives(None)
        )
        own = self._store.url if self._store is not None else self._dirpath_arg
        dirpath = self._coll.broadcast(own)
        if self._store is None or dirpath != self._store.url:
            # Every rank opens rank 0's dirpath: a bad one raises the same error on every rank.
            self._store = open_store(
                dirpath, self.config.storage_options, timeout_s=self.config.storage_timeout_s
            )
        self._coll.on_rank0(self._store.check_writable)
        self._writer = SnapshotWriter(self._store, self._coll, self.config, self._load_check)
        self._writer.protected = self.protected

    def train_start(
        self, unit_keys: Iterable[str], epoch: Optional[int] = None, step: Optional[int] = None
    ) -> None:
        """Check the app state keys, take the dirpath for this run, clear leftovers of writers
        that are gone, warn once about snapshots ahead of (epoch, step), watch for preemption.

        Raises ConfigError (on every rank) when another live saver holds ``dirpath``.
        """
        self.attach()
        from .format import writer  # noqa: F401  (imported now, not during the first snapshot's stall)

        check_collisions(unit_keys, self._extra_state_sources("train_start", -1, -1))
        self._busy_warned = False  # the busy-wait warning is given once per run
        self._blocked_s, self._skip_warned = 0.0, False  # a new budget of waits for the storage
        self.last_step = -1  # the run's first step end tells its step count (step_gate)
        self._regate()
        if self._lock is None:
            live_runs.discard(self._run_id)
            self._run_id = new_run_id()
            self._writer.new_run()
        try:
            ahead = self.collectives.on_rank0(functools.partial(self._start_on_rank0, epoch, step))
        except OSError as exc:  # the storage is unreachable now (StorageUnavailableError is one)
            if self.config.on_save_error == "raise":
                raise
            warnings.warn(
                f"could not prepare {self.dirpath} for snapshots (its lock, the leftovers of "
                f"interrupted snapshots): {type(exc).__name__}: {exc}; the snapshots will say "
                "whether the storage comes back",
                SnapshotFailedWarning,
                stacklevel=3,
            )
            ahead = []
        if ahead and self.collectives.rank == 0 and not self._warned_ahead:
            self._warned_ahead = True
            run_guard.warn_ahead(self.dirpath, epoch, step, ahead)
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

    def prepare(self, app_state: Callable[[], Mapping[str, Any]]) -> None:
        """Allocate and touch the staging buffers of asynchronous snapshots now, for the state
        ``app_state()`` returns (key -> Stateful, as a snapshot gets it): the first snapshot of
        the run then stalls training no longer than the later ones (new memory costs a page
        fault per page when first written). Nothing is written. Run once now and once more at
        the run's first step that does not snapshot (an optimizer's state appears at its first
        step). No-op for synchronous snapshots; the buffers are released at train end, as ever.
        """
        if not self.config.async_snapshot:
            return
        self._prepare_again = app_state
        self._stage_for_prepare(app_state)

    def _stage_for_prepare(self, app_state: Callable[[], Mapping[str, Any]]) -> None:
        if self._pending is not None:
            return  # a write is reading the buffers
        try:
            self._stager.stage(app_state())
        except Exception as exc:  # an optimisation only: the snapshot itself will say what is wrong
            logger.debug("tnt_snapshot_plugin: staging buffers not prepared: %s", exc)
        finally:
            self._stager.take_sources()  # let go of the training's tensors (not a snapshot's stall)

    def _start_on_rank0(self, epoch: Optional[int], step: Optional[int]) -> list[str]:
        if self._lock is None:
            self._lock = run_guard.lock(self._store, self._run_id)
        return run_guard.prepare(self._store, epoch, step)

    # -- events (the hot path: a step that does not snapshot costs a few attribute reads) ----

    def _regate(self) -> None:
        """Recompute :attr:`step_gate` from its inputs."""
        preemption, last = self._preemption, self.last_step
        if (
            last < 0
            or self._pending is not None
            or self._failure is not None
            or self._prepare_again is not None
            or self._wall is not None
            or self._ask_should
            or (preemption is not None and preemption.received is not None)
        ):
            self.step_gate = 0
            return
        gate = self.decisions.next_step(last)  # e.g. EveryNSteps: the next multiple of n
        if gate is None:
            gate = _NEVER
        if preemption is not None and preemption.distributed:  # one process: the signal opens it
            gate = min(gate, preemption.next_poll(last + 1))
        self.step_gate = gate
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
            self._step_end(epoch, step, collect)
        finally:
            self.last_step = step
            self._regate()

    def _step_end(self, epoch: int, step: int, collect: Collect) -> None:
        if self._pending is not None or self._failure is not None:
            self._reap_or_warn(step)
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
                    return
        elif wall is not None:
            flag = self._wall_flag
            if flag is None:
                agreed = wall.vote()
            elif flag.due(step):
                agreed = flag.poll(wall.vote(), step)
        time_due = agreed == TIME_DUE and wall is not None and wall.due(agreed)
        self._save_if_due(Moment("step", epoch, step, time_due=time_due), collect, True)

    def epoch_end(self, epoch: int, step: int, collect: Collect) -> None:
        self._reap_or_warn(step)
        self._save_if_due(Moment("epoch", epoch, step), collect, False)

    def eval_epoch_end(
        self, epoch: int, step: int, eval_epoch: int, eval_step: int, collect: Collect
    ) -> None:
        """An eval epoch ended while training (``eval_epoch`` eval epochs and ``eval_step`` eval
        steps completed): snapshot if the eval cadence (or a plugin) says so. The snapshot is named
        ``epoch_E_step_S_eval_V``: after the train snapshot of the same step, never the same name."""
        self._reap_or_warn(step)
        moment = Moment("eval_epoch", epoch, step, eval_epoch=eval_epoch)
        due = self.decisions.should_save(moment)
        if self._ask_should:
            due = self._plugin_decision.decide(moment, due)
        if due:
            self.save(
                epoch, step, functools.partial(collect, False), event="eval_epoch", eval_step=eval_step
            )

    def _reap_or_warn(self, step: int) -> None:
        """Reap a finished snapshot, or keep warning about the last failure."""
        if self._pending is not None and self._pending.done:
            self._reap()  # a failure just reaped has warned already
        elif self._failure is not None:
            self._warn_failure(step)

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

    def train_end(self, epoch: int, step: int, collect: Collect) -> None:
        """Take the final snapshot unless this state is already saved, and wait for it."""
        try:
            if self.config.save_on_train_end:
                self.save(epoch, step, functools.partial(collect, False), event="train_end")
            self.wait()
        finally:
            self._stop_watching()

    def exception(self) -> None:
        """Training failed: let the pending snapshot finish; never raise over the user's error."""
        try:
            self.wait(raise_errors=False)
        finally:
            self._stop_watching()

    def _stop_watching(self) -> None:
        """Training is over (the pending snapshot waited for): stop watching for preemption, let
        go of dirpath, and hand back the staging copy (1x the state), which a later snapshot
        allocates again."""
        if self._lock is not None and self._pending is None:
            lock, self._lock = self._lock, None
            lock.release()
            # this run is over: what it left behind is a leftover now
            live_runs.discard(self._run_id)
            self._run_id = new_run_id()
            self._writer.new_run()
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        if self._wall_flag is not None:
            self._wall_flag.drain()
            self._wall_flag = None
        self._wall = None
        self.report_metrics(None)
        self._prepare_again = None
        if self._pending is None:
            self._stager = Stager()
            self._writer.close()
            self._worker.close()

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

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        epoch: int,
        step: int,
        app_state: Union[Mapping[str, Any], Callable[[], Mapping[str, Any]]],
        *,
        event: str = "manual",
        eval_step: Optional[int] = None,
    ) -> bool:
        """Snapshot ``app_state`` as of (epoch, step). False if that name is already saved.

        ``eval_step``: for a snapshot taken after an eval epoch, the eval steps completed (it
        goes into the name).

        ``app_state`` may be a function returning it, called only when the snapshot is taken
        (collecting a framework's state can be costly or run user hooks).
        """
        if self._wall is not None:
            self._wall.restart()
        # The same progress is one state: saved once, whatever the metric says meanwhile (and
        # every rank decides alike, whatever its own metric).
        progress = SnapshotName.of(epoch, step, eval_step).text
        if progress == self._last_name:
            return False
        # Without a metric every rank names it alike; with one, rank 0 reads it (below).
        name = self._name(epoch, step, eval_step, None)
        # In one process, the cadences' snapshots wait for the previous ones at most
        # storage_timeout_s in all between two commits; past that, one due while a write is
        # still pending is skipped. Under torch.distributed every rank waits (the ranks would have
        # to agree to skip; each storage request is bounded all the same).
        bounded = event in _BOUNDED_EVENTS and self.collectives.world_size == 1
        if not self.wait(warn_busy=True, timeout=self.config.storage_timeout_s if bounded else None):
            self._skip(name)
            return False
        self._last_name = progress
        # Rank 0 also picks the staging name, which every rank then writes into.
        self._writes += 1
        token = staging_token(self._run_id, self._writes)

        def on_rank0() -> tuple[bool, str, str]:
            # The monitored metric is read on rank 0 only, inside the agreement: a metric that
            # only rank 0 sets works, and its error reaches every rank instead of leaving the
            # others waiting here.
            chosen = name if self._metric is None else self._name(epoch, step, eval_step, self._metric())
            return (
                self._saved_by_this_run(chosen.text),
                self._store.staging_for(chosen.text, token),
                chosen.text,
            )

        try:
            exists, staging, chosen = self.collectives.on_rank0(on_rank0)
        except ConfigError:
            self._last_name = None
            raise  # a metric missing or not a number: the user must fix it, whatever on_save_error says
        except Exception as exc:  # the storage is unreachable (botocore retried already)
            self._last_name = None
            self._fail(name, self._store.child(name.text), exc)
            return False
        if exists:
            logger.info("snapshot %s already exists; not writing it again", name.text)
            return False
        if chosen != name.text:  # rank 0's metric names the snapshot
            name = SnapshotName.parse(chosen) or name
        if callable(app_state):
            app_state = app_state()
        # The unit's own keys were checked at train start; the adapter may add reserved entries
        # (the train dataloader), so only plugin entries are checked against everything here.
        extra = self._extra_state(
            event, epoch, step, [k for k in app_state if k not in RESERVED_KEYS]
        )
        entries = {**app_state, **extra, RNG_STATE_KEY: RNGState()}

        started = time.perf_counter()
        sources = None
        if self.config.async_snapshot:
            try:
                frozen = self._stager.stage(entries)
            except Exception as exc:
                refused = uncopyable(name, entries, exc)
                if refused is None:
                    raise
                self._last_name = None
                self.stats.failures += 1
                raise refused from exc
            finally:
                sources = self._stager.take_sources()
        else:
            frozen = freeze_without_copy(entries)
        auto = [key for key, obj in app_state.items() if is_ddp(obj)]
        job = Job(
            waited_s=self._waited_s,
            name=name,
            path=self._store.child(name.text),
            staging=staging,
            frozen=frozen,
            replicated=replicated_patterns(
                self.config.replicated, frozen, auto, self._never_replicated
            ),
            sources=sources,
        )
        del sources
        job.stall_s = time.perf_counter() - started
        self._pending = job
        if self.config.async_snapshot:
            self._worker.submit(job, self._write)
        else:
            self._worker.run_here(job, self._write)
            job.stall_s = time.perf_counter() - started
            self._reap()
        logger.debug("snapshot %s: training blocked %.3fs", name.text, job.stall_s)
        if self._wall is not None:
            self._wall.restart()  # the interval counts training time, not this stall
        return True

    def _skip(self, name: SnapshotName) -> None:
        """The due snapshot ``name`` is not taken: a write is still pending, and training has
        waited ``storage_timeout_s`` for writes since the last commit. One warning until a
        snapshot commits again; every skip is counted (``stats.skipped``, ``snapshot/skipped``
        in the metrics)."""
        job = self._pending
        assert job is not None
        self.stats.skipped += 1
        path = self._store.child(name.text)
        if self._skip_warned:
            logger.info("snapshot %s skipped: snapshot %s is still being written", path, job.path)
            return
        self._skip_warned = True
        warnings.warn(
            f"snapshot {path} (epoch {name.epoch}, step {name.step}) was skipped: snapshot "
            f"{job.path} is still being written ({time.perf_counter() - job.started:.1f}s so far) "
            f"and training has waited {self._blocked_s:.1f}s for the storage since the last "
            f"commit, the most storage_timeout_s={self.config.storage_timeout_s:g} allows; the "
            "storage is slow or not answering. Training goes on: until a snapshot commits again, "
            "a snapshot due while a write is pending is skipped without waiting (each counted "
            "as snapshot/skipped in the snapshot metrics, logged at INFO). Older snapshots are "
            "intact",
            SnapshotSkippedWarning,
            stacklevel=4,
        )

    def _fail(self, name: SnapshotName, path: str, exc: BaseException) -> None:
        """A snapshot failed before its write started: raise or warn, as ``on_save_error`` says."""
        self._report_failure(failure_message(path, name, exc), exc, stacklevel=5)

    def _report_failure(self, message: str, exc: BaseException, stacklevel: int) -> None:
        """Count a failed snapshot; raise it or keep warning about it, as ``on_save_error`` says."""
        self.stats.failures += 1
        if self.config.on_save_error == "raise":
            raise SnapshotWriteError(message) from exc
        self._failure = message
        warnings.warn(message, SnapshotFailedWarning, stacklevel=stacklevel)

    def _saved_by_this_run(self, name: str) -> bool:
        """Whether this run committed snapshot ``name`` already, and it is still there (one read
        of its index, only for a name this run committed: a snapshot's stall does no I/O for
        this). Another run's snapshot of that name is replaced: it is not this run's state."""
        if name not in self._writer.committed:
            return False
        index = self._store.read_index(name)
        writer = index.get("writer") if index is not None else None
        return (
            isinstance(writer, dict)
            and writer.get("run_id") == self._run_id
            and self._store.is_complete(name)
        )

    def wait(
        self, *, warn_busy: bool = False, raise_errors: bool = True, timeout: Optional[float] = None
    ) -> bool:
        """Block until the pending snapshot (if any) is committed or failed, and reap it.

        ``timeout``: wait no longer than that, counting every such wait since the last commit
        (False: it is still being written; nothing is reaped). None: as long as it takes."""
        job = self._pending
        if job is None:
            self._waited_s = 0.0  # nothing to wait for: the next snapshot waited for none
            return True
        busy = warn_busy and not job.done
        started = time.perf_counter()
        if timeout is None:
            job.wait()
        else:
            done = job.wait(max(0.0, timeout - self._blocked_s))
            self._blocked_s += time.perf_counter() - started
            if not done:
                return False
        self._waited_s = 0.0
        if busy:
            self._note_busy_wait(job, time.perf_counter() - started)
        if raise_errors:
            self._reap()
        else:
            try:
                self._reap()
            except SnapshotError as exc:
                logger.error("tnt_snapshot_plugin: %s", exc)
        return True

    def _note_busy_wait(self, job: Job, waited: float) -> None:
        """Training waited for a snapshot still being written: warn once per run, count every time."""
        self.stats.busy_waits += 1
        self.stats.busy_wait_s += waited
        self._waited_s = waited  # recorded with the snapshot about to be taken
        if self._busy_warned:
            logger.debug("snapshot %s was still being written; training waited %.3fs for it", job.name, waited)
            return
        self._busy_warned = True
        warnings.warn(
            f"snapshot {job.name} was still being written when the next one was due; training "
            f"waited {waited:.3f}s for it (consider snapshotting less often). Further waits in this "
            "run are counted in the snapshot metrics and logged at DEBUG",
            SnapshotBusyWarning,
            stacklevel=4,
        )

    def report_metrics(self, sink: Optional[Callable[[dict[str, float], int], None]]) -> None:
        """Send each committed snapshot's figures (:func:`metrics.snapshot_metrics`) to
        ``sink(metrics, step)`` on rank 0, until training ends; None stops. Adapters pass the
        framework's logger here."""
        from .metrics import MetricsReporter

        if self._metrics is not None:
            with contextlib.suppress(ValueError):
                self.plugin_manager.unregister(self._metrics)
            self._metrics = None
        if sink is not None:
            self._metrics = MetricsReporter(sink, self)
            self.plugin_manager.register(self._metrics)

    def _name(
        self,
        epoch: int,
        step: int,
        eval_step: Optional[int] = None,
        metric: Optional[tuple[str, float]] = None,
    ) -> SnapshotName:
        try:
            default = SnapshotName.of(epoch, step, eval_step, metric)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the monitored metric {metric!r} cannot name a snapshot: {exc}") from exc
        chosen = self.plugin_manager.hook.tnt_snapshot_plugin_snapshot_name(
            epoch=epoch, step=step, default=default.text
        )
        if chosen is None or chosen == default.text:
            return default
        parsed = SnapshotName.parse(chosen) if isinstance(chosen, str) else None
        if (
            parsed is None
            or parsed.phase_aware
            or (parsed.epoch, parsed.step, parsed.eval_step) != (epoch, step, eval_step)
        ):
            raise ConfigError(
                f"a tnt_snapshot_plugin_snapshot_name hook returned {chosen!r}; it must be "
                f"{default.text!r}, optionally followed by '_metric=value', so restore can find it"
            )
        return parsed

    def _extra_state_sources(self, event: str, epoch: int, step: int) -> list[tuple[str, dict[str, Any]]]:
        return extra_state_sources(self.plugin_manager, event, epoch, step)

    def _extra_state(self, event: str, epoch: int, step: int, unit_keys: Iterable[str]) -> dict[str, Any]:
        sources = self._extra_state_sources(event, epoch, step)
        check_collisions(unit_keys, sources)
        merged: dict[str, Any] = {}
        for _source, entries in sources:
            merged.update(entries)
        return merged

    # -- the background write -----------------------------------------------------------------

    def _write(self, job: Job) -> None:
        # Let go of the GIL at once: the training thread's submit() (which starts the worker
        # thread at the run's first snapshot) returns only when it gets the GIL back, which a
        # thread running Python keeps for the whole switch interval (5 ms).
        time.sleep(0)
        job.sources = None  # the training's tensors copied from: freed here, not in the stall
        self._writer.write(job, self._run_id, locked=self._lock is not None)

    def _reap(self) -> None:
        job, self._pending = self._pending, None
        if job is None:
            return
        for message in job.warnings:
            warnings.warn(message, stacklevel=3)
        error = job.error
        if isinstance(error, UnrestorableStateError):
            # Not a storage failure that a later snapshot may not meet: every snapshot of this
            # state would be unrestorable, so training stops whatever on_save_error says.
            self.stats.failures += 1
            self._last_name = None
            raise error
        if error is not None:
            self._report_failure(failure_message(job.path, job.name, error), error, stacklevel=4)
            return
        self._failure = None
        self._blocked_s = 0.0  # the storage answers: a new budget of waits
        self._skip_warned = False
        record = SnapshotRecord(
            job.path,
            job.name.epoch,
            job.name.step,
            job.stall_s,
            job.durable_s,
            bytes_written=job.bytes_written,
            waited_s=job.waited_s,
            busy_waits=self.stats.busy_waits,
            skipped=self.stats.skipped,
        )
        self.stats.committed.append(record)
        from .metrics import log_line

        logger.info("%s", log_line(record))
        self.plugin_manager.hook.tnt_snapshot_plugin_snapshot_committed(
            path=job.path, epoch=job.name.epoch, step=job.name.step, record=record
        )

    def _warn_failure(self, step: int) -> None:
        warnings.warn(
            f"{self._failure} No snapshot has succeeded since; training is at step {step}.",
            SnapshotFailedWarning,
            stacklevel=3,
        )

