"""Whether a snapshot is intact: the one answer that restore, restore_from_latest,
``tnt-snapshot ls``, ``verify``, ``prune``, ``diff`` and ``export`` use.

:func:`check` reads a committed snapshot's index (``index.parse``: sealed, so an edited index is
damage), finds its format (``format.registry.format_of``) and has the format check its metadata
(``Format.check``; torchsnapshot's: ``format.torchsnapshot.checking``), and finds:

* its index missing (where the writer marker says the plugin wrote it), unreadable or changed,
  or naming a file outside the snapshot or not written by one of its ranks (``index.parse``:
  refused before the storage is asked about any file);
* a file the index lists missing, or of another size than was written;
* no metadata of a format this version reads;
* (the format's checks) the metadata unreadable, invalid, different from the checksum the index
  records for it, or of another world size than the index records; a file the metadata reads
  missing, or shorter than the byte range it reads;
* with ``checksums=True``: a payload whose bytes differ from a checksum record of the index, the
  whole file's or one packed tensor's (the records restore verifies as it reads), and what the
  format finds decoding its payloads (``Format.check_payloads``).

restore_from_latest restores the newest snapshot :func:`check` finds intact (without
``checksums``: restore verifies every byte it reads against the same records, and falls back from
a snapshot whose bytes do not match); a restore by path refuses a snapshot it finds damaged
(:func:`damaged`); ``tnt-snapshot ls`` marks the same one, after checking its checksums as the
restore would; ``tnt-snapshot verify`` checks every snapshot with ``checksums``; ``diff`` and
``export`` refuse a snapshot it finds damaged. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.format.files import SnapshotFiles
from tnt_snapshot_plugin.format.index import INDEX_FNAME, part_rel, parts_of
from tnt_snapshot_plugin.format.registry import format_of

if TYPE_CHECKING:
    from tnt_snapshot_plugin.format.base import Format

#: Bytes read at once when a payload's checksum is computed.
READ_CHUNK = 16 << 20


@dataclass
class Verdict:
    """What :func:`check` found of one snapshot."""

    name: str
    #: what is damaged, each naming its file; empty: intact
    problems: list[str] = field(default_factory=list)
    #: what could not be checked (a snapshot without an index, an unknown checksum algorithm)
    notes: list[str] = field(default_factory=list)
    #: the checked index, or None (none, or damaged)
    index: Optional[dict[str, Any]] = None
    #: why the index is damaged (``Store.checked_index``), or None
    index_problem: Optional[str] = None
    #: the snapshot's format (None: none this version reads)
    format: Optional[Format] = None
    #: the metadata as its format parsed it (torchsnapshot's: ``manifest.Metadata``), or None
    #: (unreadable, or left to the restoring ranks)
    metadata: Any = None

    @property
    def intact(self) -> bool:
        return not self.problems

    @property
    def problem(self) -> Optional[str]:
        """The problems in one line, or None when intact."""
        return "; ".join(self.problems) if self.problems else None


def check(
    store: Any,
    name: str,
    *,
    sizes: Optional[dict[str, int]] = None,
    checksums: bool = False,
    progress: Optional[Callable[[int], None]] = None,
    restoring_ranks: int = 1,
    metadata_checksum: bool = True,
) -> Verdict:
    """The verdict on committed snapshot ``name`` of ``store``.

    ``sizes``: the snapshot's files and sizes from a listing the caller already made (else each
    file is asked for). ``checksums``: also read every payload with a checksum record and compare,
    and let the format decode what restore would decode (:meth:`Format.check_payloads`);
    ``progress(nbytes)`` is called as bytes are read.

    ``restoring_ranks``: the number of ranks about to restore the snapshot (restore_from_latest
    checks it on rank 0). Where that is more than one (and ``checksums`` False) and the format
    has those ranks read their own parts of its metadata (:meth:`Format.reads_by_rank`), the
    metadata is checked against the checksum the index records as it streams and is not parsed
    (``metadata`` stays None), and of the parts of the index (each rank's files' sizes and
    checksums) only that each is there with its size: each restoring rank validates what it
    reads (a damaged part, or a missing or short file, fails the restore on every rank, and
    restore_from_latest falls back). ``metadata_checksum=False`` leaves that streamed checksum
    out too (a restore by path, whose ranks each check the digest of every group of records
    they read): rank 0 then reads none of the metadata.
    """
    verdict = Verdict(name)

    def size_of(rel: str) -> Optional[int]:
        if sizes is not None:
            return sizes.get(rel)
        return store.file_size(name, rel)

    index, problem = listing.checked_index(store, name)
    fmt = verdict.format = format_of(store, name, index)
    streamed = (
        restoring_ranks > 1 and not checksums and fmt is not None and fmt.reads_by_rank(index, restoring_ranks)
    )
    if index is not None and not streamed:
        index, problem = listing.completed_index(store, name, index)
    if problem is not None:
        verdict.problems.append(problem)
    verdict.index, verdict.index_problem = index, problem
    files: dict[str, int] = index["files"] if index is not None else {}
    if streamed and index is not None and fmt is not None:
        # the restoring ranks each read the parts of the index they need, checked (index.Parts)
        _check_sizes(verdict, {part_rel(r): p[0] for r, p in enumerate(parts_of(index) or [])}, size_of)
        _check_sizes(verdict, files, size_of)
        if metadata_checksum:
            _stream_metadata(store, name, verdict, fmt.metadata_file, size_of(fmt.metadata_file))
        return verdict
    _check_sizes(verdict, files, size_of)
    if fmt is None:
        recorded = (index or {}).get("snapshot_format")
        verdict.problems.append(
            f"its index records the format {recorded!r}, which this version does not read"
            if recorded is not None else "it holds the metadata of no format this version reads"
        )
        return verdict
    fmt.check(SnapshotFiles(store, name, store.child(name), index), verdict, size_of=size_of)
    if index is None and problem is None:
        verdict.notes.append(f"no {INDEX_FNAME}: not written by this plugin; sizes and checksums not recorded")
    if checksums:
        check_payloads(store, verdict, progress)
    return verdict


def _check_sizes(verdict: Verdict, files: dict[str, int], size_of: Callable[[str], Optional[int]]) -> None:
    """Each of ``files`` is there with the size listed."""
    for rel, size in files.items():
        actual = size_of(rel)
        if actual is None:
            verdict.problems.append(f"file {rel} is missing")
        elif actual != size:
            verdict.problems.append(f"file {rel} has {actual} bytes, {size} were written")


def _stream_metadata(store: Any, name: str, verdict: Verdict, metadata: str, size: Optional[int]) -> None:
    """Check the metadata file against the checksum its index records, READ_CHUNK at a time."""
    assert verdict.index is not None
    if size is None:
        verdict.problems.append(f"{metadata} cannot be read (it is missing)")
        return
    try:
        digest = _streamed_digest(store, name, metadata, size, None)
    except SnapshotCorruptError as exc:  # a storage that does not answer propagates
        verdict.problems.append(f"{metadata} cannot be read ({exc})")
        return
    if digest != verdict.index["checksums"][metadata].get("value"):
        verdict.problems.append(f"{metadata} differs from the checksum recorded when it was written")


def check_payloads(store: Any, verdict: Verdict, progress: Optional[Callable[[int], None]] = None) -> Verdict:
    """Add to ``verdict`` (from :func:`check`) the payloads whose bytes differ from the index's
    checksum records, and the ``torch.save``'d payloads restore would refuse once unpickled: what
    ``check(..., checksums=True)`` does, without reading the rest again."""
    if verdict.index is not None:
        _check_checksums(store, verdict, verdict.index.get("checksums") or {}, verdict.index["files"], progress)
    if verdict.format is not None and verdict.metadata is not None:
        verdict.format.check_payloads(SnapshotFiles(store, verdict.name, store.child(verdict.name), verdict.index), verdict)
    return verdict


def _check_checksums(
    store: Any, verdict: Verdict, records: dict[str, Any], files: dict[str, int],
    progress: Optional[Callable[[int], None]],
) -> None:
    from tnt_snapshot_plugin.format import checksums as sums

    reported = {p.split(" ", 2)[1] for p in verdict.problems if p.startswith("file ")}
    for rel, record in sorted(records.items()):
        if rel in reported or rel not in files:
            continue
        if not isinstance(record, dict) or record.get("algo") != sums.ALGO:
            verdict.notes.append(f"cannot check {rel}: checksum record {record!r} is not one this version knows")
            continue
        verifier = sums.Verifier(verdict.name, {rel: record}, {rel: files[rel]})
        ranges = sums.packed_ranges(record)
        try:
            if ranges:  # a pack of small tensors: each checked as restore reads it, then the whole
                data = memoryview(bytearray(files[rel]))
                store.read_into(verdict.name, [(rel, 0, data)])
                digest = sums.digest
                if any(digest(data[start:end]) != expected for start, end, expected in ranges):
                    raise sums.mismatch(verdict.name, rel)
                verifier.check(rel, 0, data)
                if progress is not None:
                    progress(len(data))
            else:
                if _streamed_digest(store, verdict.name, rel, files[rel], progress) != record.get("value"):
                    verdict.problems.append(f"file {rel} differs from the {sums.ALGO} checksum recorded when it was written")
        except SnapshotCorruptError as exc:  # a storage that does not answer propagates
            text = str(exc)
            verdict.problems.append(
                f"file {rel} differs from the {sums.ALGO} checksum recorded when it was written"
                if "do not match" in text else f"file {rel} cannot be read ({text})"
            )


def _streamed_digest(store: Any, name: str, rel: str, size: int, progress: Optional[Callable[[int], None]]) -> str:
    """The checksum value of file ``rel``, read ``READ_CHUNK`` at a time."""
    from tnt_snapshot_plugin.format import checksums as sums

    streaming = sums.new_hasher()
    for chunk in _chunks(store, name, rel, size):
        streaming.update(chunk)
        if progress is not None:
            progress(len(chunk))
    return streaming.record()["value"]


def _chunks(store: Any, name: str, rel: str, size: int) -> Iterator[memoryview]:
    """The bytes of file ``rel``, ``READ_CHUNK`` at a time."""
    buf = bytearray(min(READ_CHUNK, size))
    view = memoryview(buf)
    offset = 0
    while offset < size:
        n = min(READ_CHUNK, size - offset)
        store.read_into(name, [(rel, offset, view[:n])])
        yield view[:n]
        offset += n


def damaged(where: str, problem: str) -> SnapshotCorruptError:
    """The error of a restore by path (or a command reading values) refusing snapshot ``where``,
    which :func:`check` finds damaged (``problem``: its verdict's)."""
    error = SnapshotCorruptError(
        f"snapshot {where} is damaged: {problem}. Restore an older snapshot (restore_from_latest "
        "falls back to one by itself)"
    )
    error.reason = problem  # type: ignore[attr-defined]
    return error


def require_intact(store: Any, name: str) -> Verdict:
    """:func:`check`'s verdict on snapshot ``name`` of ``store``; :func:`damaged` where it finds
    a problem."""
    verdict = check(store, name)
    if verdict.problem is not None:
        raise damaged(store.child(name), verdict.problem)
    return verdict


def pick(store: Any, names_newest_first: list[str], *, checksums: bool = False) -> tuple[Optional[str], dict[str, Verdict]]:
    """The snapshot restore_from_latest restores among ``names_newest_first`` (the store's
    complete snapshots, newest first in commit order): the first intact one; and the verdicts
    of those checked on the way."""
    verdicts: dict[str, Verdict] = {}
    for name in names_newest_first:
        verdict = verdicts[name] = check(store, name, checksums=checksums)
        if verdict.intact:
            return name, verdicts
    return None, verdicts


__all__ = ["Verdict", "check", "damaged", "pick", "require_intact"]
