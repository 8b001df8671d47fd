"""Retention of one snapshot directory: :class:`Retention` applies the preservation policies
(:mod:`.preservation`) to what the store lists, within what :mod:`.retention` allows to be deleted.

The saver's writer calls it after each commit (:meth:`Retention.after_commit`) and, when a write
ran out of space, to delete early what the policies would let go once that snapshot commits
(:meth:`Retention.free_space_for`), so the write can be tried again (and, if that fails too, said
in its failure: those snapshots are gone). The run guard calls it at train start
(:meth:`Retention.at_start`), which catches up after a run killed before its retention. Rank 0
deletes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from tnt_snapshot_plugin.errors import CleanupWarning, OutOfSpaceWarning, is_no_space
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.policies.preservation import AnyPreservation
from tnt_snapshot_plugin.policies.retention import Listed, apply, next_seq

logger = logging.getLogger("tnt_snapshot_plugin.saving.writer")


@dataclass(frozen=True)
class FreedEarly:
    """Snapshots deleted before a commit to make room for it (:meth:`Retention.free_space_for`):
    ``names``, from ``url``, where ``newest``, the newest committed snapshot, was spared."""

    url: str
    names: tuple[str, ...]
    newest: str

    def _them(self) -> tuple[str, str]:
        """(the names, as a phrase; the pronoun for them)."""
        return ", ".join(self.names), ("it" if len(self.names) == 1 else "them")

    def written(self, snapshot: Any) -> str:
        """What happened, once the write tried again has committed ``snapshot``."""
        names, them = self._them()
        return (
            f"{self.url} ran out of space writing snapshot {snapshot}; deleted {names} before "
            f"its commit (retention deletes {them} once it is committed) and wrote it again"
        )

    def failed(self) -> str:
        """What happened, for the failure of the write tried again (instead of "older snapshots
        are intact": these are not)."""
        names, them = self._them()
        return (
            f"The storage ran out of space, so {names} {'was' if len(self.names) == 1 else 'were'} "
            f"deleted before this snapshot's commit to make room for it (retention deletes {them} "
            "once this snapshot is committed) and the write was tried again, which failed too: "
            f"{names} {'is' if len(self.names) == 1 else 'are'} gone and this snapshot, which "
            f"replaces {them}, is not committed. The newest committed snapshot, {self.newest}, and "
            "the other older snapshots are intact. Give dirpath room for one snapshot more than "
            "it keeps."
        )


class Retention:
    """What one saver deletes from its directory, and when.

    ``store``: the directory (listed and removed from through ``format.listing``); ``collectives``: the saver's ranks
    (rank 0 deletes); ``preservation``: what to keep (None: nothing is ever deleted);
    ``protected``: names never deleted, whatever the policies say (the saver's set, shared: an
    adapter adds the snapshot a run resumed from).
    """

    def __init__(
        self,
        store: Any,
        collectives: Any,
        preservation: Optional[AnyPreservation],
        protected: Optional[set[str]] = None,
    ) -> None:
        self.store = store
        self.coll = collectives
        self.preservation = preservation
        self.protected: set[str] = protected if protected is not None else set()
        #: whether this run has warned that it deleted snapshots early to make room
        self._space_warned = False

    @property
    def active(self) -> bool:
        """Whether anything is ever deleted (some preservation policy is set)."""
        return self.preservation is not None

    def new_run(self) -> None:
        """A run starts: its first early deletion warns again."""
        self._space_warned = False

    def _doomed(self, listed: Iterable[Listed], *spared: str) -> list[Listed]:
        assert self.preservation is not None
        return self.preservation.to_delete(listed, protect=[*spared, *self.protected])

    # -- after a commit, at train start --------------------------------------------------------

    def after_commit(self, job: Any, listed: list[Listed]) -> None:
        """Rank 0, once ``job`` is committed: delete what the policies let go of ``listed`` (the
        directory, ``job`` included), never ``job`` itself; failures become ``job``'s warnings."""
        if self.preservation is None:
            return
        doomed = self._doomed(listed, job.name.text)
        job.warnings.extend((CleanupWarning, problem) for problem in apply(listing.Deletions(self.store), doomed))

    def at_start(self) -> None:
        """Retention caught up at train start (rank 0): a run killed between a commit and its
        retention left one snapshot more than it keeps, and one killed so again would leave more.
        Deletes what retention would delete after a commit now (never the newest, never a protected
        one, only the plugin's own); problems are logged, never raised."""
        if self.preservation is None:
            return
        try:
            doomed = self._doomed(listing.listed(self.store))
        except Exception as exc:  # a listing that fails: the next commit's retention tries again
            logger.warning("retention at train start could not list %s: %s", self.store.url, exc)
            return
        for problem in apply(listing.Deletions(self.store), doomed):
            logger.warning("%s", problem)

    # -- out of space ---------------------------------------------------------------------------

    def free_space_for(self, job: Any, exc: BaseException) -> Optional[FreedEarly]:
        """After the failed write of ``job`` (failed on every rank): if it ran out of space on some
        rank, rank 0 deletes the snapshots retention would delete once ``job`` commits
        (collective); what it deleted, on every rank (the write may then be tried again), or None."""
        coll = self.coll
        if self.preservation is None:
            return None
        no_space = is_no_space(exc)
        if coll.world_size > 1:
            no_space = any(coll.all_gather(no_space))
        if not no_space:
            return None

        def free() -> Optional[FreedEarly]:
            try:
                return self._free_early(job)
            except Exception as error:  # the write's own failure is the one reported
                job.warnings.append((
                    CleanupWarning,
                    f"could not make room for snapshot {job.name} in {self.store.url}: "
                    f"{type(error).__name__}: {error}",
                ))
                return None

        return coll.on_rank0(free)  # type: ignore[no-any-return]

    def _free_early(self, job: Any) -> Optional[FreedEarly]:
        """Rank 0: delete what retention would delete once ``job`` commits, sparing the newest
        committed snapshot; what was deleted (None: nothing)."""
        store = self.store
        listed = [r for r in listing.listed(store) if r.text != job.name.text]
        if not listed:
            return None
        newest = listed[-1]  # commit order: never freed, whatever retention would say
        this = Listed(
            job.name,
            seq=next_seq(listed),
            ours=True,
            indexed_metric=(
                (job.name.metric, job.name.metric_value)
                if job.name.metric is not None and job.name.metric_value is not None
                else None
            ),
            committed_at=time.time(),
        )
        doomed = self._doomed(listed + [this], job.name.text, newest.text)
        if not doomed:
            return None
        problems = apply(listing.Deletions(store), doomed)
        freed = [r.text for r in doomed if r.text not in store.list_names()]
        job.warnings.extend((CleanupWarning, problem) for problem in problems)
        if not freed:
            return None
        return FreedEarly(store.url, tuple(freed), newest.text)

    def note_written_again(self, job: Any, freed: FreedEarly) -> None:
        """Rank 0, once ``job`` written again after :meth:`free_space_for` has committed: a
        warning the first time in a run, then a line at INFO."""
        if self.coll.rank != 0:
            return
        message = freed.written(job.name)
        if self._space_warned:
            logger.info("%s", message)
            return
        self._space_warned = True
        job.warnings.append((
            OutOfSpaceWarning,
            message + ". Later snapshots of this run do the same, logged at INFO; give "
            "dirpath room for one snapshot more than it keeps to write them only once",
        ))

