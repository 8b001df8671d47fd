"""Whether a snapshot is intact: the one answer that restore_from_latest, ``tnt-snapshot ls``,
``verify`` and ``prune`` use.

:func:`check` reads a committed snapshot's index (``index.parse``: sealed, so an edited index is
damage) and its metadata (``format.manifest.parse_metadata``: every entry validated) and finds:

* its index missing (where the writer marker says the plugin wrote it), unreadable or changed,
  or naming a file outside the snapshot or not written by one of its ranks (``index.parse``:
  refused before the storage is asked about any file);
* a file the index lists missing, or of another size than was written;
* the metadata unreadable, invalid (its entries, and whether their pieces form their tensors and
  their byte ranges stay apart: ``format.manifest.parse_metadata``), different from the checksum
  the index records for it, or of another world size or sharded shapes than the index records;
* a file the metadata reads missing, or shorter than the byte range it reads;
* with ``checksums=True``: a payload whose bytes differ from a checksum record of the index, the
  whole file's or one packed tensor's (the records restore verifies as it reads).

restore_from_latest restores the newest snapshot :func:`check` finds intact (without
``checksums``: restore verifies every byte it reads against the same records, and falls back from
a snapshot whose bytes do not match); a restore by path refuses a snapshot it finds damaged
(:func:`damaged`); ``tnt-snapshot ls`` marks the same one, after checking its checksums as the
restore would; ``tnt-snapshot verify`` checks every snapshot with ``checksums``; ``diff`` and
``export`` refuse a snapshot it finds damaged. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError
from tnt_snapshot_plugin.format.index import INDEX_FNAME, part_rel, parts_of
from tnt_snapshot_plugin.format.structure import volume
from tnt_snapshot_plugin.format.torchsnapshot.manifest import (
    CONTAINER_TYPES,
    DTYPE_SIZES,
    METADATA_FNAME,
    PRIMITIVE_TYPES,
    RAW,
    TORCH_SAVE,
    Metadata,
    parse_metadata,
)

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
    #: the parsed metadata, or None (unreadable)
    metadata: Optional[Metadata] = None

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
    file is asked for). ``checksums``: also read every payload with a checksum record and compare;
    ``progress(nbytes)`` is called as bytes are read.

    ``restoring_ranks``: the number of ranks about to restore the snapshot (restore_from_latest
    checks it on rank 0). Where that is more than one (and ``checksums`` False) and the index
    locates the records of that many ranks (``"ranks"``) and records the metadata's checksum, the
    metadata is checked against the checksum as it streams and is not parsed (``metadata`` stays
    None), and of the parts of the index (each rank's files' sizes and checksums) only that each
    is there with its size: each restoring rank validates the records and checks the parts it
    reads, and reads its files at the sizes listed (a damaged part, or a missing or short file,
    fails the restore on every rank, and restore_from_latest falls back).
    ``metadata_checksum=False`` leaves that streamed checksum out too (a restore by path, whose
    ranks each check the digest of every group of records they read): rank 0 then reads none of
    the metadata.
    """
    verdict = Verdict(name)

    def size_of(rel: str) -> Optional[int]:
        if sizes is not None:
            return sizes.get(rel)
        return store.file_size(name, rel)

    index, problem = store.checked_index(name)
    streamed = restoring_ranks > 1 and not checksums and _streamable(index, restoring_ranks)
    if index is not None and not streamed:
        index, problem = store.completed_index(name, index)
    if problem is not None:
        verdict.problems.append(problem)
    verdict.index, verdict.index_problem = index, problem
    files: dict[str, int] = index["files"] if index is not None else {}
    if streamed and index is not None:
        # the restoring ranks each read the parts of the index they need, checked (index.Parts)
        _check_sizes(verdict, {part_rel(r): p[0] for r, p in enumerate(parts_of(index) or [])}, size_of)
        _check_sizes(verdict, files, size_of)
        if metadata_checksum:
            _stream_metadata(store, name, verdict, size_of(METADATA_FNAME))
        return verdict
    _check_sizes(verdict, files, size_of)
    verdict.metadata = _metadata(store, name, verdict)
    if verdict.metadata is None:
        return verdict
    if not verdict.metadata.manifest:
        verdict.problems.append(f"{METADATA_FNAME}: an empty manifest: it holds no entries")
    _check_locations(verdict, files if index is not None else None, size_of)
    if index is not None:
        _check_world(verdict, index)
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


def _metadata(store: Any, name: str, verdict: Verdict) -> Optional[Metadata]:
    """The snapshot's metadata, checked against the index's checksum and parsed as restore
    parses it; None, with the problem in ``verdict``, where it cannot be. A storage that does not
    answer is no verdict on the snapshot: its error propagates."""
    index, where = verdict.index, store.child(name)
    try:
        data = store.read_file(name, METADATA_FNAME)
    except SnapshotCorruptError as exc:  # not a regular file inside the snapshot
        verdict.problems.append(f"{METADATA_FNAME} cannot be read ({exc})")
        return None
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        verdict.problems.append(f"{METADATA_FNAME} cannot be read ({exc.strerror or exc})")
        return None
    if index is not None and isinstance((index.get("checksums") or {}).get(METADATA_FNAME), dict):
        from tnt_snapshot_plugin.format.checksums import check_file

        try:
            check_file(where, METADATA_FNAME, index, data)
        except SnapshotError:
            verdict.problems.append(f"{METADATA_FNAME} differs from the checksum recorded when it was written")
            return None
    from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import RankRegions

    regions = RankRegions.from_index(index)
    try:
        return parse_metadata(data, where, regions.shapes if regions is not None else None)
    except SnapshotError as exc:
        verdict.problems.append(f"{METADATA_FNAME}: {getattr(exc, 'reason', exc)}")
        return None


def _check_world(verdict: Verdict, index: dict[str, Any]) -> None:
    """The metadata's world size is the index's, and the number of ranks whose groups of records
    the index locates (the shape of each sharded tensor the index records: ``parse_metadata``)."""
    from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import RankRegions

    assert verdict.metadata is not None
    world_size = verdict.metadata.world_size
    recorded = index.get("world_size")
    if type(recorded) is int and recorded != world_size:
        verdict.problems.append(f"{METADATA_FNAME}: world_size is {world_size}, its index records {recorded}")
    regions = RankRegions.from_index(index)
    if regions is not None and len(regions.regions) != world_size:
        verdict.problems.append(
            f"{METADATA_FNAME}: world_size is {world_size}, its index locates the records of {len(regions.regions)} ranks"
        )


def _streamable(index: Optional[dict[str, Any]], ranks: int) -> bool:
    """Whether ``index`` locates the records of ``ranks`` ranks and holds the metadata's whole-file
    checksum (what :func:`_stream_metadata` checks)."""
    from tnt_snapshot_plugin.format import checksums as sums
    from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import RankRegions

    regions = RankRegions.from_index(index)
    record = ((index or {}).get("checksums") or {}).get(METADATA_FNAME)
    return (
        regions is not None
        and len(regions.regions) == ranks
        and isinstance(record, dict)
        and record.get("algo") == sums.ALGO
        and not sums.packed_ranges(record)
    )


def _stream_metadata(store: Any, name: str, verdict: Verdict, size: Optional[int]) -> None:
    """Check the metadata against the checksum its index records, READ_CHUNK at a time."""
    assert verdict.index is not None
    if size is None:
        verdict.problems.append(f"{METADATA_FNAME} cannot be read (it is missing)")
        return
    try:
        digest = _streamed_digest(store, name, METADATA_FNAME, size, None)
    except SnapshotCorruptError as exc:  # a storage that does not answer propagates
        verdict.problems.append(f"{METADATA_FNAME} cannot be read ({exc})")
        return
    if digest != verdict.index["checksums"][METADATA_FNAME].get("value"):
        verdict.problems.append(f"{METADATA_FNAME} differs from the checksum recorded when it was written")


def check_payloads(store: Any, verdict: Verdict, progress: Optional[Callable[[int], None]] = None) -> Verdict:
    """Add to ``verdict`` (from :func:`check`) the payloads whose bytes differ from the index's
    checksum records, and the ``torch.save``'d payloads restore would refuse once unpickled: what
    ``check(..., checksums=True)`` does, without reading the rest again."""
    if verdict.index is not None:
        _check_checksums(store, verdict, verdict.index.get("checksums") or {}, verdict.index["files"], progress)
    if verdict.metadata is not None:
        _check_pickled(store, verdict)
    return verdict


def _pickled(manifest: dict) -> Iterator[tuple[str, dict]]:
    """(path, entry) of every ``torch.save``'d payload of a manifest: objects, and tensors (whole,
    or a piece of a chunked or sharded one) stored with torch.save."""
    for path, entry in manifest.items():
        kind = entry["type"]
        if kind == "object" or (kind == "Tensor" and entry.get("serializer") == TORCH_SAVE):
            yield path, entry
        elif kind not in CONTAINER_TYPES and kind not in PRIMITIVE_TYPES:
            for piece in entry.get("shards") or entry.get("chunks") or ():
                if piece["tensor"].get("serializer") == TORCH_SAVE:
                    yield path, piece["tensor"]


def _check_pickled(store: Any, verdict: Verdict) -> None:
    """The problems restore would find unpickling the snapshot's ``torch.save``'d payloads: a
    payload that does not load, holds a tensor on the meta device, or (a tensor entry) holds a
    tensor of another dtype or shape than its entry. A payload torch's restricted unpickler
    refuses for its types is a note: whether it loads depends on the restoring process's
    allow-list."""
    import torch

    from tnt_snapshot_plugin.format.objects import allowed_globals, holds_meta_tensor, load_object
    from tnt_snapshot_plugin.format.torchsnapshot.common import DTYPES_BY_NAME

    assert verdict.metadata is not None
    reported = {p.split(" ", 2)[1] for p in verdict.problems if p.startswith("file ")}
    with allowed_globals():
        for path, entry in _pickled(verdict.metadata.manifest):
            rel, byte_range = entry["location"], entry.get("byte_range")
            if rel in reported:
                continue
            try:
                if byte_range is None:
                    data = store.read_file(verdict.name, rel)
                else:
                    buf = bytearray(byte_range[1] - byte_range[0])
                    store.read_into(verdict.name, [(rel, byte_range[0], memoryview(buf))])
                    data = bytes(buf)
                value = load_object(data, weights_only=True)
            except SnapshotCorruptError as exc:
                verdict.problems.append(f"file {rel} cannot be read ({exc})")
                continue
            except Exception as exc:
                if "weights_only" in str(exc).lower().replace(" ", "_"):
                    verdict.notes.append(f"entry {path}: its payload holds types this process does not allow-list")
                else:
                    verdict.problems.append(f"entry {path}: its payload {rel} cannot be loaded ({type(exc).__name__})")
                continue
            if holds_meta_tensor(value):
                verdict.problems.append(f"entry {path}: its payload {rel} holds a tensor on the meta device")
            elif entry.get("type", "Tensor") == "Tensor" and (
                not isinstance(value, torch.Tensor)
                or value.dtype != DTYPES_BY_NAME.get(entry.get("dtype"))
                or list(value.shape) != entry.get("shape")
            ):
                verdict.problems.append(f"entry {path}: its payload {rel} does not hold the tensor its entry describes")


def _check_locations(
    verdict: Verdict, files: Optional[dict[str, int]], size_of: Callable[[str], Optional[int]]
) -> None:
    """Every file the metadata reads is there and long enough (``files``: the index's record of
    them; None: ask the store)."""
    assert verdict.metadata is not None
    needed: dict[str, int] = {}  # file -> the end of the furthest byte range read from it
    get = needed.get
    for entry in verdict.metadata.manifest.values():
        kind = entry["type"]
        if kind == "Tensor" or kind == "object":  # one location: most entries
            rel, byte_range = entry["location"], entry.get("byte_range")
            end = byte_range[1] if byte_range is not None else _whole_file_end(entry)
            if get(rel, -1) < end:
                needed[rel] = end
        elif kind not in CONTAINER_TYPES and kind not in PRIMITIVE_TYPES:
            for piece in entry.get("shards") or entry.get("chunks") or ():
                tensor = piece["tensor"]
                rel, byte_range = tensor["location"], tensor.get("byte_range")
                end = byte_range[1] if byte_range is not None else _whole_file_end(tensor)
                if get(rel, -1) < end:
                    needed[rel] = end
    for rel, end in sorted(needed.items()):
        size = files.get(rel) if files is not None else size_of(rel)
        if size is None:
            what = "the index does not list it" if files is not None else "it is missing"
            verdict.problems.append(f"the metadata reads file {rel}, but {what}")
        elif size < end:
            verdict.problems.append(f"file {rel} has {size} bytes, the metadata reads up to byte {end}")


def _whole_file_end(entry: dict) -> int:
    """The bytes a record without a byte range reads from the start of its file: a raw tensor's
    (its dtype and shape say how many); 0 for a ``torch.save`` payload (read whole, any length)."""
    if entry.get("type", "Tensor") == "Tensor" and entry.get("serializer") == RAW:
        return volume(entry["shape"]) * DTYPE_SIZES[entry["dtype"]]
    return 0


def _check_checksums(
    store: Any, verdict: Verdict, records: dict[str, Any], files: dict[str, int],
    progress: Optional[Callable[[int], None]],
) -> None:
    from tnt_snapshot_plugin.format import checksums as sums

    reported = {p.split(" ", 2)[1] for p in verdict.problems if p.startswith("file ")}
    for rel, record in sorted(records.items()):
        if rel == METADATA_FNAME or rel in reported or rel not in files:
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
