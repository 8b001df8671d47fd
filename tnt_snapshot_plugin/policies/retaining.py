"""Retention around a commit: what the preservation policies (policies.py) let go once a snapshot
is committed (and at train start, caught up after a run killed before its retention), and, when the storage ran out of space, what they would let go deleted early, before
the commit, so the write can be tried again (and, if that fails too, said in its failure: those
snapshots are gone). Rank 0 deletes; retention.py says what may ever be
deleted. Functions of a :class:`~tnt_snapshot_plugin.saving.writer.SnapshotWriter`."""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from tnt_snapshot_plugin.errors import CleanupWarning, OutOfSpaceWarning
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.policies import retention

logger = logging.getLogger("tnt_snapshot_plugin.saving.writer")


@dataclass(frozen=True)
class FreedEarly:
    """Snapshots deleted before a commit to make room for it (:func:`free_early`): ``names``,
    from ``url``, where ``newest``, the newest committed snapshot, was spared."""

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


def free_space_for(writer: Any, job: Any, exc: BaseException) -> Optional[FreedEarly]:
    """After the failed write of ``job`` (failed on every rank): if it ran out of space on some
    rank, rank 0 deletes the snapshots retention would delete once ``job`` commits (collective);
    what it deleted, on every rank (the write may then be tried again), or None."""
    coll = writer.coll
    if writer.preservation is None:
        return None
    no_space = is_no_space(exc)
    if coll.world_size > 1:
        no_space = any(coll.all_gather(no_space))
    if not no_space:
        return None

    def free() -> Optional[FreedEarly]:
        try:
            return free_early(writer, job)
        except Exception as error:  # the write's own failure is the one reported
            job.warnings.append((
                CleanupWarning,
                f"could not make room for snapshot {job.name} in {writer.store.url}: "
                f"{type(error).__name__}: {error}",
            ))
            return None

    return coll.on_rank0(free)


def free_early(writer: Any, job: Any) -> Optional[FreedEarly]:
    """Rank 0: delete what retention would delete once ``job`` commits, sparing the newest
    committed snapshot; what was deleted (None: nothing)."""
    store = writer.store
    listed = [r for r in listing.listed(store) if r.text != job.name.text]
    if not listed:
        return None
    newest = listed[-1]  # commit order: never freed, whatever retention would say
    this = retention.Listed(
        job.name,
        seq=retention.next_seq(listed),
        ours=True,
        indexed_metric=(
            (job.name.metric, job.name.metric_value)
            if job.name.metric is not None and job.name.metric_value is not None
            else None
        ),
        committed_at=time.time(),
    )
    assert writer.preservation is not None
    doomed = writer.preservation.to_delete(listed + [this], protect=[job.name.text, newest.text, *writer.protected])
    if not doomed:
        return None
    problems = retention.apply(listing.Deletions(store), doomed)
    freed = [r.text for r in doomed if r.text not in store.list_names()]
    job.warnings.extend((CleanupWarning, problem) for problem in problems)
    if not freed:
        return None
    return FreedEarly(store.url, tuple(freed), newest.text)


def note_written_again(writer: Any, job: Any, freed: FreedEarly) -> None:
    """Rank 0, once ``job`` written again after :func:`free_early` has committed: a warning the
    first time in a run, then a line at INFO."""
    if writer.coll.rank != 0:
        return
    message = freed.written(job.name)
    if writer._space_warned:
        logger.info("%s", message)
        return
    writer._space_warned = True
    job.warnings.append((
        OutOfSpaceWarning,
        message + ". Later snapshots of this run do the same, logged at INFO; give "
        "dirpath room for one snapshot more than it keeps to write them only once",
    ))


def retain_after_commit(writer: Any, job: Any, listed: list[retention.Listed]) -> None:
    if writer.preservation is None:
        return
    doomed = writer.preservation.to_delete(listed, protect=[job.name.text, *writer.protected])
    job.warnings.extend((CleanupWarning, problem) for problem in retention.apply(listing.Deletions(writer.store), doomed))


def retain_at_start(writer: Any) -> None:
    """Retention caught up at train start (rank 0): a run killed between a commit and its
    retention left one snapshot more than it keeps, and one killed so again would leave more.
    Deletes what retention would delete after a commit now (never the newest, never a protected
    one, only the plugin's own); problems are logged, never raised."""
    if writer.preservation is None:
        return
    try:
        doomed = writer.preservation.to_delete(listing.listed(writer.store), protect=list(writer.protected))
    except Exception as exc:  # a listing that fails: the next commit's retention tries again
        logger.warning("retention at train start could not list %s: %s", writer.store.url, exc)
        return
    for problem in retention.apply(listing.Deletions(writer.store), doomed):
        logger.warning("%s", problem)


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it was raised from is a lack of space (ENOSPC, EDQUOT)."""
    return any(isinstance(e, OSError) and e.errno in _NO_SPACE for e in chain(exc))


_NO_SPACE = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code is not None)
