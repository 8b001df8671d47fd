"""The framework-neutral engine every adapter drives: :class:`Snapshotter`.

The saver is built from objects it owns and calls: its hooks (:class:`SaverHooks`, the plugin
manager), a :class:`Trigger` (is this moment due? the step gate), a :class:`JobRunner` (the one
snapshot in flight), a :class:`RunGuard` (the dirpath lock, leftovers, each snapshot's name), a
:class:`Stager` (the staging copies), the background :class:`SnapshotWriter` and the store.

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
2. on a background thread: :class:`~tnt_snapshot_plugin.saving.writer.SnapshotWriter` writes the copies in
   torchsnapshot's format under a staging name (every file fsynced and checksummed; with
   ``Knobs(writer="process")`` the payload files by the rank's writer process, which reads the
   copies from shared memory and is started at train start and stopped at train end); the ranks
   agree whether every rank wrote everything; rank 0 commits (the manifest and the index, with
   the commit sequence number, by the store's commit strategy); retention (retention.py)
   deletes older snapshots only then.
3. at the next hook on the training thread: the outcome is reaped - the ``snapshot_committed``
   hook runs, or the failure is reported with its step.

Constructor arguments beyond ``dirpath``, ``config`` (SnapshotConfig), ``process_group`` and
``plugin_manager`` (default: a new one for this saver, entry-point plugins loaded):
``never_replicated``: entry keys that differ between ranks by nature (beyond the built-in
reserved and ``*_progress`` keys), never marked replicated whatever the ``replicated`` globs
say. ``on_preempted(signum)``: called once the preemption snapshot is durable, instead of
handing the signal to the handler that was installed before the saver's, for frameworks with
their own way to stop on a signal (it may raise to stop training). ``clock``: the time source of
``save_every_n_seconds`` (tests pass a fake one). ``weights_only``: how restore will load this
run's snapshots. True (default): every snapshot is checked to load under
``torch.load(weights_only=True)`` and the plugin's safe globals before it is written
(``format.objects.LoadCheck``; UnrestorableStateError otherwise). False: no check; the snapshots must
then be restored with ``weights_only=False``. ``metric``: the adapter's source of the monitored
metric (best-k retention, ``config.best``): called on the training thread only when a snapshot
is taken, returns (name, value) or None (the snapshot is then saved without a metric); the value
goes into the snapshot's name (``..._<name>=<value>``) and index. It may raise ConfigError (a
metric the framework never produced), which stops training whatever ``on_save_error`` says.
Under torch.distributed rank 0's value names the snapshot.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import pluggy

from tnt_snapshot_plugin.app_state import (
    RESERVED_KEYS,
    RNG_STATE_KEY,
    RNGState,
    check_collisions,
)
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.distributed import Collectives, is_initialized
from tnt_snapshot_plugin.errors import ConfigError, SnapshotFailedWarning, UnrestorableStateError
from tnt_snapshot_plugin.format.objects import LoadCheck
from tnt_snapshot_plugin.format.registry import get_format
from tnt_snapshot_plugin.hooks import new_plugin_manager
from tnt_snapshot_plugin.metrics import MetricsReporter
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.saving.jobs import Job, JobRunner, SnapshotStats, is_ddp, uncopyable
from tnt_snapshot_plugin.saving.run_guard import RunGuard
from tnt_snapshot_plugin.saving.saver_hooks import SaverHooks
from tnt_snapshot_plugin.saving.staging import Stager, freeze_without_copy
from tnt_snapshot_plugin.saving.trigger import STEP_PREEMPTED, STEP_QUIET, STEP_SNAPSHOT, StepOutcome, Trigger
from tnt_snapshot_plugin.saving.writer import SnapshotWriter
from tnt_snapshot_plugin.stores import Store, open_store

logger = logging.getLogger(__name__)

#: ``collect(intra_epoch) -> {key: Stateful}``: the framework's state, collected when a snapshot is taken
Collect = Callable[[bool], Mapping[str, Any]]

#: The events whose snapshot is skipped, rather than waited for, when the previous snapshot is
#: still being written after ``storage_timeout_s``: the cadences. A final or preemption snapshot
#: (and one the user asks for) waits for the previous one, however long it takes.
_BOUNDED_EVENTS = frozenset({"step", "epoch", "eval_epoch"})


class Snapshotter:
    """Cadence, naming, async bookkeeping, commit and retention for one snapshot directory."""

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
        get_format(config.format)  # a name no format answers to is refused before dirpath is made
        self.config = config
        #: the plugin hooks: a manager of this saver's own (entry-point plugins loaded) unless given
        self.hooks = SaverHooks(
            plugin_manager if plugin_manager is not None else new_plugin_manager(), on_change=self._regate
        )
        #: is this moment due? and the step gate the adapters read (:meth:`Trigger.quiet`)
        self.trigger = Trigger(config, self.hooks, clock)
        self._process_group = process_group
        self._never_replicated = tuple(never_replicated)
        self._metric = metric
        self._on_preempted = on_preempted
        # Under torch.distributed only rank 0's dirpath counts (the others may pass anything,
        # "" included): it is opened once broadcast, in attach(), on every rank alike.
        self._dirpath_arg = dirpath
        self._store: Optional[Store] = (
            None if is_initialized() else open_store(dirpath, config.storage_options, timeout_s=config.storage_timeout_s)
        )
        self._coll: Optional[Collectives] = None
        self._flag_coll: Collectives = Collectives(None)
        self._stager = Stager()
        self._load_check = LoadCheck(weights_only=weights_only)
        #: the progress (``epoch_E_step_S[_eval_V]``) of the last snapshot taken: saved once
        self._last_name: Optional[str] = None
        #: prepare()'s second pass, at the run's first step that does not snapshot
        self._prepare_again: Optional[Callable[[], Mapping[str, Any]]] = None
        #: the one snapshot in flight
        self.jobs = JobRunner(config, self._child, self.hooks.committed, on_change=self._regate)
        #: names of snapshots in dirpath that retention never deletes (an adapter adds the one
        #: the run resumed from, as Lightning's ModelCheckpoint keeps it)
        self.protected: set[str] = set()
        self._writer: Optional[SnapshotWriter] = None  # made by attach()
        self._guard: Optional[RunGuard] = None  # made by attach()
        self.attach()

    # -- what the adapters read ----------------------------------------------------------------

    @property
    def dirpath(self) -> str:
        return self.store.url

    @property
    def store(self) -> Store:
        assert self._store is not None
        return self._store

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """This saver's pluggy manager."""
        return self.hooks.manager

    @property
    def stats(self) -> SnapshotStats:
        """The figures of the snapshots taken so far."""
        return self.jobs.stats

    @property
    def collectives(self) -> Collectives:
        self.attach()
        assert self._coll is not None
        return self._coll

    @property
    def guard(self) -> RunGuard:
        self.attach()
        assert self._guard is not None
        return self._guard

    @property
    def writer(self) -> SnapshotWriter:
        self.attach()
        assert self._writer is not None
        return self._writer

    def _child(self, name: str) -> str:
        return self.store.child(name)

    # -- set-up -----------------------------------------------------------------------------

    def attach(self) -> None:
        """Join torch.distributed if it is initialised now (collective); idempotent.

        Creates the checkpoint gloo group, takes rank 0's dirpath, checks it can be written.
        """
        if self._coll is not None and (self._coll.distributed or not is_initialized()):
            return
        self._coll = Collectives.create(self._process_group, self.config.collective_timeout_s)
        if self.trigger.needs_flags:
            self._flag_coll = Collectives.create(self._process_group, self.config.collective_timeout_s)
        own = self._store.url if self._store is not None else self._dirpath_arg
        dirpath = self._coll.broadcast(own)
        if self._store is None or dirpath != self._store.url:
            # Every rank opens rank 0's dirpath: a bad one raises the same error on every rank.
            self._store = open_store(dirpath, self.config.storage_options, timeout_s=self.config.storage_timeout_s)
        self._coll.on_rank0(self._store.check_writable)
        self._writer = SnapshotWriter(self._store, self._coll, self.config, self._load_check)
        self._writer.protected = self.protected
        self._stager = Stager(allocate=self._writer.allocate)  # shared with a writer process, if any
        self._guard = RunGuard(self._store, self._coll, self._writer, self.hooks.name, self._metric)

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register ``plugin`` on this saver only (:meth:`SaverHooks.register`)."""
        return self.hooks.register(plugin, name)

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver."""
        self.hooks.unregister(plugin)

    def report_metrics(self, sink: Optional[Callable[[dict[str, float], int], None]]) -> None:
        """Send each committed snapshot's figures (:func:`metrics.snapshot_metrics`) to
        ``sink(metrics, step)`` on rank 0, until training ends; None stops. Adapters pass the
        framework's logger here."""
        reporter = None if sink is None else MetricsReporter(sink, self.jobs.stats, lambda: self.collectives.rank)
        self.hooks.report_metrics(sink, reporter)

    def _regate(self) -> None:
        """The step gate, from what the saver holds open: a snapshot in flight, buffers to prepare."""
        self.trigger.hold(self.jobs.pending is not None or self._prepare_again is not None)

    def train_start(self, unit_keys: Iterable[str], epoch: Optional[int] = None, step: Optional[int] = None) -> None:
        """Check the app state keys, take the dirpath for this run, clear leftovers of writers
        that are gone, warn once about snapshots ahead of (epoch, step), watch for preemption.

        Raises ConfigError (on every rank) when another live saver holds ``dirpath``.
        """
        self.attach()
        from tnt_snapshot_plugin.format.torchsnapshot import writer  # noqa: F401  (imported now, not during the first snapshot's stall)

        check_collisions(unit_keys, self.hooks.extra_state_sources("train_start", -1, -1))
        self.jobs.start_run()  # waits, warnings and the storage's budget of this run from zero
        try:
            self.guard.start(epoch, step)
        except OSError as exc:  # the storage is unreachable now (StorageUnavailableError is one)
            if self.config.on_save_error == "raise":
                raise
            self.jobs.storage_failing()  # one warning until a snapshot commits
            warnings.warn(
                f"could not prepare {self.dirpath} for snapshots (its lock, the leftovers of "
                f"interrupted snapshots): {type(exc).__name__}: {exc}; snapshots are still attempted "
                "when due, and until one commits their storage failures are logged at INFO",
                SnapshotFailedWarning,
                stacklevel=3,
            )
        self.trigger.start(self._flag_coll, self.collectives.rank)
        self.writer.start()  # the writer process, if any: started once a run, not per snapshot

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
        self._regate()
        self._stage_for_prepare(app_state)

    def _stage_for_prepare(self, app_state: Callable[[], Mapping[str, Any]]) -> None:
        if self.jobs.pending is not None:
            return  # a write is reading the buffers
        try:
            self._stager.stage(app_state())
        except Exception as exc:  # an optimisation only: the snapshot itself will say what is wrong
            logger.debug("tnt_snapshot_plugin: staging buffers not prepared: %s", exc)
        finally:
            self._stager.take_sources()  # let go of the training's tensors (not a snapshot's stall)

    # -- events (the adapters skip a step end whose trigger.quiet(step) is True) -----------------

    def step_end(self, epoch: int, step: int, collect: Collect) -> None:
        """A train step ended: reap a finished write, poll preemption and the clock, snapshot if due."""
        trigger = self.trigger
        if trigger.quiet(step):
            return
        outcome: Optional[StepOutcome] = None
        try:
            if self.jobs.pending is not None:
                self._reap_if_done()
            outcome = trigger.at_step_end(epoch, step)
            if outcome is STEP_QUIET:  # the clock read, not due: the trigger noted the step
                return
            if outcome is STEP_PREEMPTED:
                self._preempt(epoch, step, collect)
            elif outcome is STEP_SNAPSHOT:
                self._take("step", epoch, step, functools.partial(collect, True))
            else:
                self._prepare_if_asked()
        finally:
            if outcome is not STEP_QUIET:
                trigger.ran(step)

    def epoch_end(self, epoch: int, step: int, collect: Collect) -> None:
        """A train epoch ended: snapshot if the epoch cadence (or a plugin) says so."""
        self._reap_if_done()
        from tnt_snapshot_plugin.policies import Moment

        if self.trigger.due(Moment("epoch", epoch, step)):
            self._take("epoch", epoch, step, functools.partial(collect, False))
        else:
            self._prepare_if_asked()

    def eval_epoch_end(self, epoch: int, step: int, eval_epoch: int, eval_step: int, collect: Collect) -> None:
        """An eval epoch ended while training (``eval_epoch`` eval epochs and ``eval_step`` eval
        steps completed): snapshot if the eval cadence (or a plugin) says so. The snapshot is named
        ``epoch_E_step_S_eval_V``: after the train snapshot of the same step, never the same name."""
        self._reap_if_done()
        from tnt_snapshot_plugin.policies import Moment

        if self.trigger.due(Moment("eval_epoch", epoch, step, eval_epoch=eval_epoch)):
            self.save(epoch, step, functools.partial(collect, False), event="eval_epoch", eval_step=eval_step)

    def _take(self, event: str, epoch: int, step: int, app_state: Callable[[], Mapping[str, Any]]) -> None:
        self._prepare_again = None  # the snapshot stages everything
        self.save(epoch, step, app_state, event=event)

    def _prepare_if_asked(self) -> None:
        if self._prepare_again is not None and self.jobs.pending is None:
            again, self._prepare_again = self._prepare_again, None
            self._regate()
            self._stage_for_prepare(again)

    def _preempt(self, epoch: int, step: int, collect: Collect) -> None:
        logger.warning("tnt_snapshot_plugin: preemption signal received; snapshotting step %d", step)
        self.save(epoch, step, functools.partial(collect, True), event="preemption")
        self.wait()
        preemption = self.trigger.preempted()
        assert preemption is not None
        if self._on_preempted is None:
            preemption.finish()
            return
        signum = preemption.received_signal
        preemption.uninstall()
        self._on_preempted(signum)

    def train_end(self, epoch: int, step: int, collect: Collect) -> None:
        """Take the final snapshot unless this state is already saved, and wait for it.

        Already saved: the last snapshot taken has this (epoch, step), whether or not it was
        taken after an eval epoch (``..._eval_V``: an eval epoch takes no optimizer step), as
        torchtnt's saver finds its final snapshot's name taken under ``fit()``."""
        try:
            last = SnapshotName.parse(self._last_name) if self._last_name is not None else None
            saved = last is not None and (last.epoch, last.step) == (epoch, step)
            if self.config.save_on_train_end and not saved:
                self.save(epoch, step, functools.partial(collect, False), event="train_end")
            self.wait()
        finally:
            self._stop()

    def exception(self) -> None:
        """Training failed: let the pending snapshot finish; never raise over the user's error."""
        try:
            self.wait(raise_errors=False)
        finally:
            self._stop()

    def _stop(self) -> None:
        """Training is over (the pending snapshot waited for): stop watching for preemption, let
        go of dirpath, and hand back the staging copy (1x the state), which a later snapshot
        allocates again."""
        if self.jobs.pending is None and self._guard is not None:
            self._guard.release()
        self.trigger.stop()
        self.report_metrics(None)
        self._prepare_again = None
        if self.jobs.pending is None:
            self._stager = Stager(allocate=None if self._writer is None else self._writer.allocate)
            if self._writer is not None:
                self._writer.close()
            self.jobs.close()
        self._regate()

    # -- saving --------------------------------------------------------------------------------

    def wait(self, *, warn_busy: bool = False, raise_errors: bool = True, timeout: Optional[float] = None) -> bool:
        """Block until the pending snapshot (if any) is committed or failed, and reap it
        (:meth:`JobRunner.wait`); False if ``timeout`` passed first."""
        try:
            return self.jobs.wait(warn_busy=warn_busy, raise_errors=raise_errors, timeout=timeout)
        except UnrestorableStateError:
            self._last_name = None
            raise

    def _reap_if_done(self) -> None:
        try:
            self.jobs.reap_if_done()
        except UnrestorableStateError:
            self._last_name = None
            raise

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
        self.trigger.snapshot_taken()
        # The same progress is one state: saved once, whatever the metric says meanwhile (and
        # every rank decides alike, whatever its own metric).
        progress = SnapshotName.of(epoch, step, eval_step).text
        if progress == self._last_name:
            return False
        # Without a metric every rank names it alike; with one, rank 0 reads it (RunGuard.claim).
        name = self.hooks.name(epoch, step, eval_step, None)
        # In one process, the cadences' snapshots wait for the previous ones at most
        # storage_timeout_s in all between two commits; past that, one due while a write is
        # still pending is skipped. Under torch.distributed every rank waits (the ranks would have
        # to agree to skip; each storage request is bounded all the same).
        bounded = event in _BOUNDED_EVENTS and self.collectives.world_size == 1
        if not self.wait(warn_busy=True, timeout=self.config.storage_timeout_s if bounded else None):
            self.jobs.skip(name)
            return False
        self._last_name = progress
        try:
            claimed = self.guard.claim(name, epoch, step, eval_step)
        except ConfigError:
            self._last_name = None
            raise  # a metric missing or not a number: the user must fix it, whatever on_save_error says
        except Exception as exc:  # the storage is unreachable (botocore retried), dirpath lost
            self._last_name = None
            self.jobs.fail(name, exc)
            return False
        if claimed is None:
            return False
        self._start(claimed[0], claimed[1], event, epoch, step, app_state)
        return True

    def _start(
        self,
        name: SnapshotName,
        staging: str,
        event: str,
        epoch: int,
        step: int,
        app_state: Union[Mapping[str, Any], Callable[[], Mapping[str, Any]]],
    ) -> None:
        """Collect and stage the state (the training's stall), then write it: in the background
        (asynchronous) or now."""
        if callable(app_state):
            app_state = app_state()
        # The unit's own keys were checked at train start; the adapter may add reserved entries
        # (the train dataloader), so only plugin entries are checked against everything here.
        extra = self.hooks.extra_state(event, epoch, step, [k for k in app_state if k not in RESERVED_KEYS])
        entries = {**app_state, **extra, RNG_STATE_KEY: RNGState()}
        started = time.perf_counter()
        frozen, sources = self._freeze(name, entries)
        auto = [key for key, obj in app_state.items() if is_ddp(obj)]
        job = Job(
            waited_s=self.jobs.waited_s,
            name=name,
            path=self.store.child(name.text),
            staging=staging,
            frozen=frozen,
            replicas=(self.config.replicated, tuple(auto), self._never_replicated),
            sources=sources,
        )
        del sources
        job.stall_s = time.perf_counter() - started
        try:
            self.jobs.submit(job, self._write, background=self.config.async_snapshot, started=started)
        except UnrestorableStateError:
            self._last_name = None
            raise
        finally:
            logger.debug("snapshot %s: training blocked %.3fs", name.text, job.stall_s)
            self.trigger.snapshot_taken()  # the interval counts training time, not this stall

    def _freeze(self, name: SnapshotName, entries: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """``entries``' state dicts as the write reads them: copied into the staging buffers
        (asynchronous) or as they are; and the tensors copied from, for the writer to let go."""
        if not self.config.async_snapshot:
            return freeze_without_copy(entries), None
        try:
            return self._stager.stage(entries), self._stager.take_sources()
        except Exception as exc:
            self._stager.take_sources()
            refused = uncopyable(name, entries, exc)
            if refused is None:
                raise
            self._last_name = None
            self.jobs.stats.failures += 1
            raise refused from exc

    # -- the background write -----------------------------------------------------------------

    def _write(self, job: Job) -> None:
        # Let go of the GIL at once: the training thread's submit() (which starts the worker
        # thread at the run's first snapshot) returns only when it gets the GIL back, which a
        # thread running Python keeps for the whole switch interval (5 ms).
        time.sleep(0)
        job.sources = None  # the training's tensors copied from: freed here, not in the stall
        guard = self.guard
        self.writer.write(job, guard.run_id, locked=guard.locked)
