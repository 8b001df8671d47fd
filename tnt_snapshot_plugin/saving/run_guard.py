"""A snapshot directory held by a run: its lock, the leftovers of interrupted writes and the
warning about snapshots ahead of the run's progress (rank 0, at train start), and the name each
snapshot claims in it (:class:`RunGuard`)."""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Callable, Optional

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import CleanupWarning, SnapshotError, SnapshotsAheadWarning
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.policies import retention
from tnt_snapshot_plugin.stores import DirLock, Store
from tnt_snapshot_plugin.stores.ownership import (
    live_runs,
    new_run_id,
    staging_token,
    writer_gone,
    writer_identity,
)

if TYPE_CHECKING:
    from tnt_snapshot_plugin.saving.writer import SnapshotWriter

logger = logging.getLogger("tnt_snapshot_plugin.saving.saver")


def lock(store: Store, run_id: str) -> DirLock:
    """Take ``store``'s dirpath for the run ``run_id`` (ConfigError if another live saver holds it)."""
    holder = {**writer_identity(run_id), "started_at": time.time()}
    return store.lock(holder)


def prepare(store: Store, epoch: Optional[int], step: Optional[int]) -> list[str]:
    """Remove the leftovers of interrupted writes, and name the snapshots ahead of (epoch, step)
    (written by another, longer run; a listing that fails is a warning's worth only)."""
    remove_leftovers(store)
    if epoch is None or step is None:
        return []
    try:
        return [r.text for r in retention.ahead_of(listing.listed(store), epoch, step)]
    except Exception as exc:
        logger.warning("could not list %s: %s", store.url, exc)
        return []


def remove_leftovers(store: Store) -> None:
    """Remove what interrupted writes left, when provably the plugin's and the writer is gone.

    * staging directories holding the plugin's writer marker whose writer is gone, and those
      a retention deletion left (their token starts with ``del``, they hold the index);
    * snapshot-named directories without ``.snapshot_metadata`` (an interrupted write on an
      object store, or a crash) holding the plugin's marker or index, whose writer is gone.

    Nothing else is touched: not another live job's write, not a directory the plugin did
    not write (a look-alike name without the plugin's marker), never a complete snapshot.
    """
    for name in store.list_names():
        why = _abandoned(store, name)
        if why is None:
            continue
        try:
            listing.remove(store, name)
            logger.info("removed %s left by an interrupted snapshot (%s)", name, why)
        except (OSError, SnapshotError) as exc:
            warnings.warn(
                f"could not remove {store.child(name)} left by an interrupted snapshot: "
                f"{exc}; restore ignores it, delete it by hand",
                category=CleanupWarning, stacklevel=5,
            )


def _abandoned(store: Store, name: str) -> Optional[str]:
    """Why ``name`` is an abandoned write of the plugin's (None: it is not, or not provably)."""
    parsed = SnapshotName.parse(name)
    if is_staging_name(name):
        token = name.rsplit(".", 1)[1]
        if token.startswith("del") and listing.provably_ours(store, name):
            return "a deletion was interrupted"
        why = writer_gone(listing.read_writer(store, name) or store.bare_staging_writer(name))
    elif parsed is not None and not parsed.phase_aware and not listing.is_complete(store, name):
        why = writer_gone(listing.read_writer(store, name)) if listing.provably_ours(store, name) else None
    else:
        return None
    if why is None:
        logger.info("leaving %s alone: not provably an abandoned write of the plugin's", name)
    return why


def warn_ahead(dirpath: str, epoch: Optional[int], step: Optional[int], ahead: list[str]) -> None:
    """Warn that ``dirpath`` holds snapshots ahead of this run's progress (once per saver)."""
    warnings.warn(
        f"{dirpath} holds snapshots ahead of this run's progress (epoch {epoch}, "
        f"step {step}): {', '.join(ahead)}. This run's snapshots are ordered after them "
        "(by commit), so restore_from_latest picks this run's newest; with "
        "keep_last_n_snapshots, the older ones are deleted as this run's are committed. "
        "Use a new dirpath to keep runs apart",
        SnapshotsAheadWarning,
        stacklevel=6,  # the framework's hook dispatch (adapter hook -> its _start -> train_start -> start -> here)
    )


class RunGuard:
    """One saver's hold on its dirpath: the run it writes for (a run id, renewed for each run),
    the dirpath lock taken at train start (rank 0), the leftovers removed and retention caught up
    then, and each snapshot's name and staging name claimed in it, agreed by the ranks.

    ``writer``: the saver's background writer (its commits, its lock check, its retention);
    ``name(epoch, step, eval_step, metric)``: the snapshot names the saver's hooks give;
    ``metric()``: the monitored metric, read on rank 0 when a snapshot is claimed (None: none)."""

    def __init__(
        self,
        store: Store,
        collectives: Collectives,
        writer: SnapshotWriter,
        name: Callable[..., SnapshotName],
        metric: Optional[Callable[[], Optional[tuple[str, float]]]],
    ) -> None:
        self.store = store
        self.collectives = collectives
        self.writer = writer
        self._name = name
        self._metric = metric
        #: identifies this saver's run in its writes (staging names, markers, the index), so a
        #: leftover can be told from a live write; renewed for each run
        self.run_id = new_run_id()
        #: the dirpath lock of the run (rank 0, from train start to train end)
        self.lock: Optional[DirLock] = None
        self._writes = 0
        self._warned_ahead = False

    @property
    def locked(self) -> bool:
        return self.lock is not None

    def start(self, epoch: Optional[int], step: Optional[int]) -> None:
        """Train start (collective): a new run id unless this run holds dirpath already; on rank 0,
        take the lock, remove leftovers and catch retention up; warn once per saver about
        snapshots ahead of (epoch, step). OSError when the storage cannot be reached."""
        if self.lock is None:
            self._new_run()
        ahead = self.collectives.on_rank0(lambda: self._start_on_rank0(epoch, step))
        if ahead and self.collectives.rank == 0 and not self._warned_ahead:
            self._warned_ahead = True
            warn_ahead(self.store.url, epoch, step, ahead)

    def _start_on_rank0(self, epoch: Optional[int], step: Optional[int]) -> list[str]:
        if self.lock is None:
            self.lock = lock(self.store, self.run_id)
        self.writer.lock = self.lock  # checked at each commit
        ahead = prepare(self.store, epoch, step)
        self.writer.retention.at_start()
        return ahead

    def release(self) -> None:
        """The run is over: let go of dirpath; what the run left behind is a leftover now."""
        if self.lock is None:
            return
        held, self.lock = self.lock, None
        held.release()
        self._new_run()

    def _new_run(self) -> None:
        live_runs.discard(self.run_id)
        self.run_id = new_run_id()
        self.writer.new_run()

    def claim(
        self, name: SnapshotName, epoch: int, step: int, eval_step: Optional[int]
    ) -> Optional[tuple[SnapshotName, str]]:
        """The snapshot's name (rank 0's metric in it) and staging name, agreed by the ranks; None
        when this run saved it already. ConfigError for a metric that cannot name it; any other
        error (the storage unreachable, dirpath lost) propagates, on every rank."""
        # Rank 0 also picks the staging name, which every rank then writes into.
        self._writes += 1
        token = staging_token(self.run_id, self._writes)

        def on_rank0() -> tuple[bool, str, str]:
            if self.lock is not None:
                # dirpath still this run's (SnapshotWriteError if not: nothing is written there)
                self.lock.check()
            # The monitored metric is read on rank 0 only, inside the agreement: a metric that
            # only rank 0 sets works, and its error reaches every rank instead of leaving the
            # others waiting here.
            chosen = name if self._metric is None else self._name(epoch, step, eval_step, self._metric())
            return self._saved_by_this_run(chosen.text), self.store.staging_for(chosen.text, token), chosen.text

        exists, staging, chosen = self.collectives.on_rank0(on_rank0)
        if exists:
            logger.info("snapshot %s already exists; not writing it again", name.text)
            return None
        if chosen != name.text:  # rank 0's metric names the snapshot
            name = SnapshotName.parse(chosen) or name
        return name, staging

    def _saved_by_this_run(self, name: str) -> bool:
        """Whether this run committed snapshot ``name`` already, and it is still there (one read
        of its index, only for a name this run committed: a snapshot's stall does no I/O for
        this). Another run's snapshot of that name is replaced: it is not this run's state."""
        if name not in self.writer.committed:
            return False
        index = listing.read_index(self.store, name)
        writer = index.get("writer") if index is not None else None
        return isinstance(writer, dict) and writer.get("run_id") == self.run_id and listing.is_complete(self.store, name)
