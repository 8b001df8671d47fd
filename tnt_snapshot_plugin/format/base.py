"""The format seam: how a snapshot's state becomes files, and comes back, in one on-disk format.

A :class:`Format` (torchsnapshot's, DCP's, a user's) has a name, the file its commit writes last,
and three roles that the saver, restore, verify and the CLI call without knowing which format
they hold:

* writing (:class:`FormatWriter`, one per saver): on every rank, the state's payload files,
  handed to the writer's :class:`PayloadSink` as they are ready, and the records the rank sends
  rank 0; on rank 0, the metadata the commit writes last;
* checking (:meth:`Format.check`, :meth:`Format.check_payloads`): whether what a committed
  snapshot holds adds up, as ``verify`` reports it;
* reading (:class:`FormatReader`, one per restore and rank; :meth:`Format.entries`,
  :meth:`Format.read_entry` and :meth:`Format.read_key` for the command line).

Everything around them is the plugin's, the same for every format: staging names and the commit
(``stores.commit``), the sizes and checksums of every file in the plugin's index, the ranks'
agreements, retention, which snapshot is latest, the fallback from a damaged one, the dirpath
lock. A format reads and writes files only through :class:`~tnt_snapshot_plugin.format.files.
SnapshotFiles` (reading, checksums verified) and the sink (writing, checksums recorded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.format.files import SnapshotFiles
    from tnt_snapshot_plugin.format.verify import Verdict

Buffer = Union[bytes, bytearray, memoryview]
#: The metadata written at a commit: its bytes, or buffers to write one after another.
MetadataBytes = Union[bytes, bytearray, Sequence[Buffer]]


@dataclass
class Payload:
    """One file to write: ``rel`` (relative to the snapshot directory, ``/``-separated) holds the
    concatenation of ``views``: flat byte buffers (``uint8`` numpy arrays over tensors, which keep
    their memory alive, or memoryviews over serialized bytes), each with ``nbytes``.

    A pack's views are its tensors, one each; or, where tensors lie end to end in memory (an
    asynchronous snapshot's staging arena), runs of several, and ``bounds`` then says where each
    tensor ends in the file (``[0, end_1, ..., end_n]``): each is checksummed on its own, so a
    reader verifies what it reads of the file."""

    rel: str
    views: list[Any]
    bounds: Optional[list[int]] = None

    @property
    def packed(self) -> bool:
        """Whether the file holds several tensors (each read, and verified, on its own)."""
        return self.bounds is not None or len(self.views) > 1


class PayloadSink(Protocol):
    """Where a format writer hands its payload files: each is written (durably, checksummed, on
    the writer's I/O threads) as soon as it is submitted."""

    @property
    def failed(self) -> Optional[BaseException]:
        """The storage's failure :meth:`submit` raised, if any (to tell it from the format's own)."""
        ...

    @property
    def copies(self) -> bool:
        """Whether a payload's buffers may be reused once :meth:`submit` returns (it was written,
        or the store copied it)."""
        ...

    def submit(self, payload: Payload) -> None: ...


@dataclass(frozen=True)
class EntryInfo:
    """What one entry of a snapshot holds, in a few typed fields (the command line's view)."""

    #: "container", "tensor", "sharded", "value" (a primitive) or "object"
    kind: str
    #: the entry's type as the format writes it ("Tensor", "int", "object", ...)
    type: str
    #: "float32", ... for tensors; the primitive's type; an object's class
    dtype: Optional[str] = None
    #: the whole tensor's shape (merged over shards)
    shape: Optional[list[int]] = None
    #: bytes stored, where the format says (None: not known)
    nbytes: Optional[int] = None
    #: (file, byte range or None) of every payload the entry reads
    locations: list[tuple[str, Optional[list[int]]]] = field(default_factory=list)
    #: a primitive's decoded value
    value: Any = None
    #: whether the entry was saved once for all ranks
    replicated: bool = False


class FormatWriter(Protocol):
    """One saver's writer of a format (it may keep what it learnt of the state between snapshots).

    Per snapshot, on every rank: :meth:`encode`; then, after the ranks agreed that every rank
    wrote its files, on rank 0 :meth:`metadata` from what each rank's :meth:`outgoing` sent;
    then :meth:`settled` (committed) or :meth:`aborted` (failed on some rank) on every rank."""

    def encode(self, job: Any, sink: PayloadSink) -> tuple[Any, Optional[BaseException]]:
        """Encode ``job.frozen`` (key -> a frozen state dict) into payloads handed to ``sink``;
        (this rank's records, None) or (whatever was made, the error). A collective the format
        makes is made by every rank, after an error too: the error is returned, not raised."""
        ...

    def outgoing(self, records: Any) -> Any:
        """What this rank sends rank 0 of its ``records`` (picklable)."""
        ...

    def metadata(self, gathered: list[Any]) -> tuple[MetadataBytes, dict[str, Any]]:
        """Rank 0: the metadata the commit writes last, from every rank's :meth:`outgoing` (in
        rank order), and the fields the format adds to the plugin's index."""
        ...

    def aborted(self) -> None:
        """The snapshot failed on some rank: forget what it would have kept from it."""
        ...

    def settled(self) -> None:
        """The snapshot committed: keep what the next snapshot builds on."""
        ...

    def new_run(self) -> None:
        """A new run starts: nothing is kept from the last one."""
        ...

    def close(self) -> None:
        """Training is over: let buffers go (a later snapshot makes them again)."""
        ...


class FormatReader(Protocol):
    """One rank's reading of one snapshot for a restore (made by :meth:`Format.reader`)."""

    #: the world size the snapshot was taken on
    world_size: int

    def keys(self) -> set[str]:
        """The app-state keys the snapshot holds for this rank."""
        ...

    def fit_world_size(self, keys: set[str]) -> bool:
        """The snapshot restored on another world size than it was taken on: StateMismatchError
        (on every rank) naming the entries of ``keys`` that do not map onto the ranks now running;
        whether the per-rank RNG states are restored (a collective)."""
        ...

    def check_modules(self, load: Mapping[str, Any]) -> dict[str, Any]:
        """StateMismatchError unless every module of ``load`` has the snapshot's tensors, of its
        shapes; the modules' state dicts (read into next, not asked for twice)."""
        ...

    def read(self, key: str, current: Any) -> Any:
        """The state dict of ``key``, read into ``current`` (the target's own state dict) where it
        can be; SnapshotCorruptError for damaged bytes, StateMismatchError where it does not fit."""
        ...


class Format(Protocol):
    """An on-disk format of snapshots (see the module docstring)."""

    #: what ``SnapshotConfig(format=...)`` names it, and the plugin's index records
    name: str
    #: the file the commit writes last: a snapshot is complete when it is there
    metadata_file: str

    def writer(self, collectives: Collectives, config: Any) -> FormatWriter:
        """A writer for one saver."""
        ...

    def reads_by_rank(self, index: Optional[dict[str, Any]], ranks: int) -> bool:
        """Whether ``ranks`` ranks restoring the snapshot of ``index`` each read and check their
        own parts of its metadata: rank 0's check before restore_from_latest then only streams the
        metadata file against its checksum, without parsing it (False: rank 0 parses it)."""
        ...

    def check(self, files: SnapshotFiles, verdict: Verdict, *, size_of: Callable[[str], Optional[int]]) -> None:
        """Add to ``verdict`` what is damaged in the snapshot's metadata and what it reads (the
        metadata unreadable, invalid or not matching its checksum, a file it reads missing or
        shorter than it reads: ``size_of(rel)``, None for a missing file), and set
        ``verdict.metadata`` to the metadata as the format parsed it (None where it cannot be)."""
        ...

    def check_payloads(self, files: SnapshotFiles, verdict: Verdict) -> None:
        """(A deep check, after the checksums) add to ``verdict`` the payloads restore would refuse
        once decoded (a ``torch.save``'d payload that does not load, or holds what its entry does
        not say)."""
        ...

    def reader(self, files: SnapshotFiles, collectives: Collectives, verdict: Optional[Verdict], *, weights_only: bool) -> FormatReader:
        """A reader of the snapshot for one restore on this rank (``verdict``: rank 0's check of
        it under restore_from_latest, whose parsed metadata is used instead of reading it again)."""
        ...

    def entries(self, verdict: Verdict) -> dict[str, EntryInfo]:
        """Every leaf entry of the snapshot checked by ``verdict`` (its ``metadata`` parsed), by
        path ``RANK/KEY/sub/...`` (rank 0 for an entry saved once for all ranks): what the
        command line lists and compares."""
        ...

    def read_entry(self, files: SnapshotFiles, verdict: Verdict, path: str) -> Any:
        """The value of leaf entry ``path`` (of :meth:`entries`), read without a target."""
        ...

    def read_key(self, files: SnapshotFiles, verdict: Verdict, key: str) -> Any:
        """App-state entry ``key`` whole (every rank's pieces of a sharded tensor put together),
        as plain data: what ``tnt-snapshot export`` writes."""
        ...

