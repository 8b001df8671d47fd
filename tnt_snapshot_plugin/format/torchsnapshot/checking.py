"""Whether a committed snapshot in torchsnapshot's format adds up (the format's part of
``format.verify.check``): its ``.snapshot_metadata`` checked against the checksum the index
records and parsed as restore parses it (``manifest.parse_metadata``: every entry validated, the
pieces of a tensor tiling it, byte ranges of one file apart); every file it reads there and long
enough; its world size the index's; and (a deep check) every ``torch.save``'d payload loading to
what its entry says."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError
from tnt_snapshot_plugin.format.files import SnapshotFiles
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
from tnt_snapshot_plugin.format.verify import Verdict


def check(files: SnapshotFiles, verdict: Verdict, size_of: Callable[[str], Optional[int]]) -> None:
    """Parse the metadata into ``verdict.metadata`` and add what is damaged to ``verdict``."""
    verdict.metadata = _metadata(files, verdict)
    if verdict.metadata is None:
        return
    if not verdict.metadata.manifest:
        verdict.problems.append(f"{METADATA_FNAME}: an empty manifest: it holds no entries")
    _check_locations(verdict, files.index["files"] if files.index is not None else None, size_of)
    if files.index is not None:
        _check_world(verdict, files.index)


def reads_by_rank(index: Optional[dict[str, Any]], ranks: int) -> bool:
    """Whether ``ranks`` restoring ranks each read their own groups of records (the index locates
    that many, and records the metadata's whole-file checksum): rank 0 then checks only that
    checksum, streaming, and does not parse the metadata."""
    return _streamable(index, ranks)


def _metadata(files: SnapshotFiles, verdict: Verdict) -> Optional[Metadata]:
    """The snapshot's metadata, checked against the index's checksum and parsed as restore
    parses it; None, with the problem in ``verdict``, where it cannot be. A storage that does not
    answer is no verdict on the snapshot: its error propagates."""
    index, where = verdict.index, files.store.child(files.name)
    try:
        data = files.store.read_file(files.name, METADATA_FNAME)
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


def check_payloads(files: SnapshotFiles, verdict: Verdict) -> None:
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
                    data = files.store.read_file(files.name, rel)
                else:
                    buf = bytearray(byte_range[1] - byte_range[0])
                    files.store.read_into(files.name, [(rel, byte_range[0], memoryview(buf))])
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
                or value.dtype != DTYPES_BY_NAME.get(str(entry.get("dtype")))
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


