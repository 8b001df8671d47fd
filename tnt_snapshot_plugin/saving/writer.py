"""The background write of one snapshot: format -> store -> agreement -> commit -> retention.

:class:`SnapshotWriter` runs on the saver's writer thread (or on the training thread for a
synchronous snapshot). For each snapshot, on every rank:

1. check that restore could load every object of the state (``format.objects.LoadCheck``; the
   ranks agree);
2. rank 0 marks the staging directory as the plugin's (its writer marker);
3. the snapshot's format encodes the state (``format.base.FormatWriter.encode``) and hands each
   payload file to this writer as soon as it is complete: it is written through the store,
   several files at once, each file's checksum computed from the bytes in hand (``checksums``):
   on this process's I/O threads (``saving/payloads.py``), or, with ``Knobs(writer="process")``,
   by the rank's writer process from staging buffers in shared memory
   (``saving/process_writer.py``);
4. on several ranks, each rank writes its files' sizes and checksums as its part of the index
   (``index.part_bytes``);
5. one collective gathers every rank's records (what the format sends) and outcome, with its
   part's size and digest (one rank: its file sizes and checksums);
6. rank 0 commits: the format's metadata and the plugin's index, by the store's commit strategy
   (a rename on disk, the metadata written last on an object store); then retention deletes
   older snapshots, never before.

A failure on any rank is raised on every rank, and the staging directory is removed: nothing
that restore would pick is left behind. Cadence, staging copies and reaping stay in
``saving/saver.py``.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.distributed import Collectives, raise_if_any_failed
from tnt_snapshot_plugin.errors import (
    CleanupWarning,
    SnapshotError,
    SnapshotWriteError,
    StorageUnavailableError,
    UnrestorableStateError,
    as_write_error,
    causes,
)
from tnt_snapshot_plugin.format import index as index_file
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.format.base import Format
from tnt_snapshot_plugin.format.checksums import record_whole
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.format.objects import LoadCheck
from tnt_snapshot_plugin.format.registry import DEFAULT, get_format
from tnt_snapshot_plugin.policies import preservation, retention
from tnt_snapshot_plugin.policies.retaining import Retention
from tnt_snapshot_plugin.saving.payloads import DEFAULT_IO_THREADS, PayloadWrites, io_pool, writing
from tnt_snapshot_plugin.saving.process_writer import (
    ProcessPayloads,
    SharedStaging,
    WriterProcess,
    process_wanted,
)
from tnt_snapshot_plugin.stores import DirLock, LocalStore, Store
from tnt_snapshot_plugin.stores.commit import buffers
from tnt_snapshot_plugin.stores.ownership import writer_identity

logger = logging.getLogger(__name__)

#: The writer of asynchronous snapshots when ``Knobs(writer=None)``: "thread" or "process"
#: (docs/performance.md, "Step time during a write", says why).
DEFAULT_WRITER = "thread"


class SnapshotWriter:
    """Writes snapshots of one dirpath, one at a time, in the configured format, and commits
    them in order.

    ``last_seq``: the commit sequence number of this run's last snapshot (None until the first
    commit of a run lists the directory); ``committed``: the names this run committed (rank 0).
    The saver calls :meth:`new_run` when a run starts.
    """

    def __init__(self, store: Store, collectives: Collectives, config: SnapshotConfig, load_check: LoadCheck) -> None:
        self.store = store
        self.coll = collectives
        self.config = config
        self.load_check = load_check
        #: the format snapshots are written in, and its writer for this saver
        self.format: Format = get_format(config.format)
        self.encoder = self.format.writer(collectives, config)
        self.last_seq: Optional[int] = None
        self.committed: set[str] = set()
        #: what is deleted after each commit, and early when the storage is full (policies/)
        self.retention = Retention(store, collectives, preservation(config))
        #: the I/O threads, kept from one snapshot to the next (starting them costs milliseconds)
        self._pool: Optional[ThreadPoolExecutor] = None
        #: the run's hold on dirpath (rank 0; RunGuard sets it), checked before each commit
        self.lock: Optional[DirLock] = None
        #: the writer process and the staging buffers it shares (``Knobs(writer="process")``;
        #: ConfigError here for a store it cannot open)
        self.process: Optional[WriterProcess] = None
        self.shared: Optional[SharedStaging] = None
        if process_wanted(config, store, DEFAULT_WRITER):
            self.shared = SharedStaging()
            # A local dirpath as the store resolved it: the writer process may start after a chdir.
            url = store.root if isinstance(store, LocalStore) else store.url
            self.process = WriterProcess(
                url, config.storage_options, config.storage_timeout_s, self._io_threads()
            )

    @property
    def allocate(self) -> Any:
        """The staging buffers' allocator for the saver's stager (``Stager(allocate=...)``): in
        the memory shared with the writer process; None: the stager's own."""
        return None if self.shared is None else self.shared.allocate

    def start(self) -> None:
        """Training starts: the writer process (if any) starts now, not at the first snapshot."""
        if self.process is not None:
            try:
                self.process.start()
            except OSError as exc:  # tried again, and reported, by the first snapshot
                logger.warning("tnt_snapshot_plugin: could not start the writer process: %s", exc)

    @property
    def protected(self) -> set[str]:
        """Names retention never deletes (the saver's ``protected``, shared with it)."""
        return self.retention.protected

    @protected.setter
    def protected(self, names: set[str]) -> None:
        self.retention.protected = names

    def close(self) -> None:
        """Let the I/O threads, the writer process and the format's buffers go (training is
        over); a later snapshot makes them again."""
        self.encoder.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        if self.process is not None:
            self.process.stop()
        if self.shared is not None:
            self.shared.close()  # the buffers the saver let go of

    def new_run(self) -> None:
        """Forget the last run: its next commit lists the directory again."""
        self.last_seq = None
        self.committed = set()
        self.encoder.new_run()
        self.retention.new_run()

    # -- one snapshot -----------------------------------------------------------------------

    def write(self, job: Any, run_id: str, *, locked: bool) -> None:
        """Write and commit ``job`` (``saving.jobs.Job``); raise on every rank if any rank failed.

        ``locked``: this run holds the dirpath lock (no one else commits meanwhile).

        A write that fails for lack of space (ENOSPC, EDQUOT on any rank), with retention set,
        is written once more after the snapshots retention would delete once this one commits
        are deleted (never the newest committed one): room for exactly ``keep_last_n_snapshots``
        snapshots is then enough. If that write fails too, ``job.freed_early`` says which
        snapshots are gone (its failure message reports it).
        """
        try:
            self._write_once(job, run_id, locked=locked)
        except Exception as exc:
            freed = self.retention.free_space_for(job, exc)
            if freed is None:
                raise
            job.freed_early = freed.failed()
            self._write_once(job, run_id, locked=locked)
            job.freed_early = None
            self.retention.note_written_again(job, freed)

    def _write_once(self, job: Any, run_id: str, *, locked: bool) -> None:
        coll, store, encoder = self.coll, self.store, self.encoder
        check_loadable(self.load_check, coll, job)
        writer = writer_identity(run_id)
        coll.on_rank0(lambda: self._begin(job, writer))
        writes = self._payloads(job.staging)
        records, error = encoder.encode(job, writes)
        try:  # every write submitted is waited for, even after a failure (then discarded)
            sizes, sums = writes.finish()
        except Exception as exc:
            sizes, sums = {}, {}
            error = error or as_write_error(exc, f"snapshot {job.name}")
        listing_: Any = (sizes, sums)  # what rank 0 puts in the index for this rank's files
        if error is None and coll.world_size > 1:
            listing_, error = _write_part(store, coll.rank, job, sizes, sums)
        # Every rank's records (what its format sends) and its files' listing, to rank 0, which
        # alone commits: one collective, and no rank but rank 0 holds the others' records.
        gathered: Any = coll.gather((encoder.outgoing(records), listing_) if error is None else None)
        try:
            # the state's own fault on every rank that failed: the same on every rank
            raise_if_any_failed(coll, error, f"writing snapshot {job.name}", together=UnrestorableStateError)
        except SnapshotError as failure:
            encoder.aborted()
            if coll.rank == 0 and self._may_clean_up(failure):
                try:
                    listing.remove(store, job.staging)
                except Exception as exc:  # the failed write stays invisible to restore anyway
                    job.warnings.append((CleanupWarning, f"could not remove the failed write {job.staging}: {exc}"))
            raise

        def commit() -> int:
            assert gathered is not None  # rank 0; no rank failed, so every part is there
            parts = [part for part in gathered if part is not None]
            return self._commit(job, writer, [part[0] for part in parts], [part[1] for part in parts], locked)

        # every rank learns the bytes of all ranks' files with the commit's outcome
        try:
            job.bytes_written = coll.on_rank0(commit)
        except BaseException:
            encoder.aborted()  # raised on every rank (on_rank0)
            raise
        encoder.settled()

    def _begin(self, job: Any, writer: dict[str, Any]) -> None:
        """Rank 0: the staging directory of ``job``, marked as the plugin's; a name a foreign
        directory holds is refused."""
        store = self.store
        occupant = listing.occupant(store, job.name.text)
        if occupant == "foreign":
            raise SnapshotWriteError(
                f"{store.child(job.name.text)} exists and was not written by the plugin (it "
                "holds no index or writer marker of the plugin's); it is left alone and this "
                "snapshot cannot take its name: move it out of dirpath"
            )
        if occupant == "ours" and job.staging == job.name.text:
            listing.remove(store, job.staging)  # written in place (object stores): clear the old first
        store.begin(job.staging, {**writer, "started_at": time.time()})

    def _may_clean_up(self, failure: BaseException) -> bool:
        """Whether to remove what a failed write left, now. Not when the storage did not answer
        and training is waiting (a synchronous snapshot): the removal would make it wait for
        the storage once more. What is left is invisible to restore, and removed at the next
        train start."""
        return self.config.async_snapshot or not any(
            isinstance(e, StorageUnavailableError) for e in causes(failure)
        )

    def _io_threads(self) -> int:
        return self.config.knobs.max_per_rank_io_concurrency or DEFAULT_IO_THREADS

    def _payloads(self, staging: str) -> Union[PayloadWrites, ProcessPayloads]:
        """Where this snapshot's payload files go: the writer process, or this process's I/O threads."""
        if self.process is not None and self.shared is not None:
            return ProcessPayloads(self.process, self.shared, staging)
        if self._pool is None:
            self._pool = io_pool(self._io_threads())
        return PayloadWrites(self.store, self._pool, staging)

    # -- commit (rank 0) ----------------------------------------------------------------------

    def _listed_and_seq(self, job: Any, locked: bool) -> tuple[list[retention.Listed], bool, int]:
        """The directory's snapshots (for retention), whether retention runs, and the commit
        sequence number of ``job``.

        The directory is listed (one read of each index) for retention, and for the first
        commit of a run; while this run holds the dirpath lock no one else commits, so later
        sequence numbers follow from the last one without listing again."""
        store = self.store
        retaining = self.retention.active
        if not (retaining or self.last_seq is None or not locked):
            return [], retaining, self.last_seq + 1
        try:
            listed = listing.listed(store)
            return listed, retaining, retention.next_seq(listed)
        except Exception as exc:
            if self.last_seq is None:
                raise  # no sequence number to follow: not committed, rather than misordered
            # Committed all the same (this run holds the lock: the next number is known);
            # retention waits for a listing that works.
            job.warnings.append((
                CleanupWarning,
                f"could not list {store.url} ({type(exc).__name__}: {exc}); snapshot "
                f"{job.name} is committed, and retention is skipped this time",
            ))
            return [], False, self.last_seq + 1

    def _commit_or_clean_up(self, job: Any, metadata: Any, index: Any, written: dict[str, int]) -> None:
        """Commit ``job`` by the store's strategy; a commit that failed leaves nothing behind."""
        store = self.store
        try:
            if self.lock is not None:
                self.lock.check()  # never commit into a dirpath this run no longer holds
            store.commit(
                job.staging, job.name.text, metadata_file=self.format.metadata_file, metadata=metadata,
                index_file=index_file.INDEX_FNAME, index=index, written=written,
            )
        except Exception as failure:
            if not self._may_clean_up(failure):
                raise
            # Not committed: nothing restore would ever read; do not leave it behind (on an
            # object store it is written under its final name: only if still incomplete).
            try:
                committed = job.staging == job.name.text and listing.is_complete(store, job.staging)
                if not committed and job.staging in store.list_names():
                    listing.remove(store, job.staging)
            except Exception as exc:
                job.warnings.append((CleanupWarning, f"could not remove the failed write {job.staging}: {exc}"))
            raise

    def _commit(self, job: Any, writer: dict[str, Any], records: list[Any], listings: list[Any], locked: bool) -> int:
        """Commit the snapshot of every rank's ``records`` (what its format sent) and
        ``listings`` (each rank's files: (sizes, checksums) on one rank, (part entry, bytes) on
        several); its bytes."""
        made, extra = self.encoder.metadata(records)
        metadata = buffers(made)  # the format's bytes, or its buffers to write one after another
        listed, retaining, seq = self._listed_and_seq(job, locked)
        files, checksums, nbytes = _listed(self.coll.world_size, listings)
        fields: dict[str, Any] = {
            "format": 1 if self.coll.world_size == 1 else index_file.PARTED_FORMAT,
            "epoch": job.name.epoch,
            "step": job.name.step,
            "files": files,
            "seq": seq,
            "committed_at": time.time(),
            "writer": writer,
            "world_size": self.coll.world_size,
            **extra,
        }
        if self.format.name != DEFAULT:
            fields["snapshot_format"] = self.format.name
        if self.coll.world_size > 1:
            fields["parts"] = [listing_[0] for listing_ in listings]
        # the metadata too: it may hold values (torchsnapshot's: numbers, strings) itself
        fields["checksums"] = {**checksums, self.format.metadata_file: record_whole(metadata)}
        if job.name.metric is not None and job.name.metric_value is not None:
            value = job.name.metric_value
            fields["metric"] = {"name": job.name.metric, "value": value if math.isfinite(value) else None}
        # Every file written must still be there at the commit: this rank's files and, on
        # several ranks, each rank's part of the index (written last of its rank's files).
        written = dict(files)
        written.update((index_file.part_rel(r), p[0][0]) for r, p in enumerate(listings) if self.coll.world_size > 1)
        self._commit_or_clean_up(job, metadata, seal_index(fields), written)  # sealed: its own digest
        self.last_seq = seq
        self.committed.add(job.name.text)
        this = retention.Listed(
            job.name,
            seq=seq,
            ours=True,
            writer=writer,
            indexed_metric=(
                (job.name.metric, fields["metric"]["value"])
                if job.name.metric is not None and "metric" in fields
                else None
            ),
            committed_at=fields["committed_at"],
        )
        if retaining:
            self.retention.after_commit(job, [r for r in listed if r.text != job.name.text] + [this])
        return nbytes


def check_loadable(load_check: LoadCheck, coll: Collectives, job: Any) -> None:
    """Refuse to write a snapshot restore could not load (off the training thread; every rank
    agrees before any writes): UnrestorableStateError naming the entry, on every rank."""
    error: Optional[BaseException] = None
    try:
        load_check.check(job.frozen)
    except SnapshotError as exc:
        error = exc
    if error is not None and not str(error).startswith("snapshot "):
        error = UnrestorableStateError(f"snapshot {job.name}: {error}").with_traceback(error.__traceback__)
    if coll.world_size > 1:
        reports = coll.all_gather(None if error is None else str(error))
        failed = [f"rank {rank}: {msg}" for rank, msg in enumerate(reports) if msg is not None]
        if failed and (error is None or len(failed) > 1):
            raise UnrestorableStateError("; ".join(failed)) from error
    if error is not None:
        raise error


def _write_part(
    store: Store, rank: int, job: Any, sizes: dict[str, int], sums: dict[str, dict[str, Any]]
) -> tuple[Any, Optional[BaseException]]:
    """Write rank ``rank``'s part of the index; (what the index lists of it and the bytes of
    the rank's files, error)."""
    data = index_file.part_bytes(sizes, sums)
    rel = index_file.part_rel(rank)
    try:
        with writing(store, job.staging, rel):
            store.write_payload(job.staging, rel, [memoryview(data)])
    except Exception as exc:
        return None, as_write_error(exc, f"snapshot {job.name}")
    return (index_file.part_entry(data), sum(sizes.values())), None


def _listed(world_size: int, listings: list[Any]) -> tuple[dict[str, int], dict[str, dict[str, Any]], int]:
    """(files, checksums, bytes) for the index from each rank's listing: one rank's files; on
    several ranks none (each part lists its rank's), and the sum of every rank's bytes."""
    if world_size == 1:
        files, checksums = listings[0]
        return files, checksums, sum(files.values())
    return {}, {}, sum(listing[1] for listing in listings)


__all__ = ["DEFAULT_IO_THREADS", "DEFAULT_WRITER", "SnapshotWriter"]
