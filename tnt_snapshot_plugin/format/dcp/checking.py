"""Whether a committed snapshot in DCP's format adds up (the format's part of
``format.verify.check``): its ``.metadata`` checked against the checksum the index records, read
by the restricted unpickler and validated as restore reads it (``metadata.parse``); every file it
reads there and long enough; and (a deep check) every record loading to what its entry says: a
tensor chunk of the entry's dtype and the chunk's shape, a pickled value under the plugin's
allow-list."""

from __future__ import annotations

from typing import Any, Callable, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError
from tnt_snapshot_plugin.format.files import SnapshotFiles
from tnt_snapshot_plugin.format.registry import BUILTIN_METADATA
from tnt_snapshot_plugin.format.verify import Verdict

METADATA_FNAME = BUILTIN_METADATA["dcp"]


def is_plugins(index: Optional[dict[str, Any]]) -> bool:
    """Whether the snapshot of ``index`` is one the plugin wrote in DCP's format (its per-rank
    layout applies); else a checkpoint of ``dcp.save``."""
    return isinstance(index, dict) and index.get("snapshot_format") == "dcp"


def read_metadata(files: SnapshotFiles) -> Any:
    """The snapshot's validated metadata (``metadata.DcpMetadata``), read and checked against the
    index's checksum; SnapshotCorruptError where it cannot be."""
    from tnt_snapshot_plugin.format.dcp.metadata import parse

    index = files.index
    data = files.read_checked(METADATA_FNAME)
    world_size = index.get("world_size") if index is not None else None
    return parse(data, files.path, plugin=is_plugins(index), world_size=world_size if type(world_size) is int else None)


def check(files: SnapshotFiles, verdict: Verdict, size_of: Callable[[str], Optional[int]]) -> None:
    """Parse the metadata into ``verdict.metadata`` and add what is damaged to ``verdict``."""
    verdict.metadata = _metadata(files, verdict)
    if verdict.metadata is None:
        return
    if not verdict.metadata.entries:
        verdict.problems.append(f"{METADATA_FNAME}: it holds no entries")
    listed = files.index["files"] if files.index is not None else None
    for rel, end in sorted(verdict.metadata.ends.items()):
        size = listed.get(rel) if listed is not None else size_of(rel)
        if size is None:
            what = "the index does not list it" if listed is not None else "it is missing"
            verdict.problems.append(f"the metadata reads file {rel}, but {what}")
        elif size < end:
            verdict.problems.append(f"file {rel} has {size} bytes, the metadata reads up to byte {end}")


def _metadata(files: SnapshotFiles, verdict: Verdict) -> Any:
    """The metadata, or None with the problem in ``verdict``. A storage that does not answer is
    no verdict on the snapshot: its error propagates."""
    try:
        return read_metadata(files)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        verdict.problems.append(f"{METADATA_FNAME} cannot be read ({exc.strerror or exc})")
    except SnapshotCorruptError as exc:
        reason = getattr(exc, "reason", None)
        if reason is not None:
            verdict.problems.append(reason)
        elif "do not match" in str(exc):
            verdict.problems.append(f"{METADATA_FNAME} differs from the checksum recorded when it was written")
        else:
            verdict.problems.append(f"{METADATA_FNAME} cannot be read ({exc})")
    return None


def check_payloads(files: SnapshotFiles, verdict: Verdict) -> None:
    """The problems restore would find decoding the snapshot's records: a tensor chunk that does
    not load as a tensor of its entry's dtype and the chunk's shape, or holds a tensor on the meta
    device; a pickled value that does not load. A value torch's restricted unpickler refuses for
    its types is a note: whether it loads depends on the restoring process's allow-list."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tnt_snapshot_plugin.format.objects import allowed_globals, holds_meta_tensor, load_object

    parsed = verdict.metadata
    reported = {p.split(" ", 2)[1] for p in verdict.problems if p.startswith("file ")}
    with allowed_globals():
        for name, md in parsed.entries.items():
            tensor = type(md) is TensorStorageMetadata
            for chunk in md.chunks if tensor else [None]:
                record = parsed.storage(name, chunk.offsets if chunk is not None else None)
                rel = record.relative_path
                if rel in reported:
                    continue
                try:
                    buf = bytearray(record.length)
                    files.store.read_into(files.name, [(rel, record.offset, memoryview(buf))])
                    value = load_object(buf, weights_only=True)
                except SnapshotError as exc:
                    verdict.problems.append(f"file {rel} cannot be read ({exc})")
                    continue
                except Exception as exc:
                    if "weights_only" in str(exc).lower().replace(" ", "_") and not tensor:
                        verdict.notes.append(f"entry {name}: its value holds types this process does not allow-list")
                    else:
                        verdict.problems.append(f"entry {name}: its record in {rel} cannot be loaded ({type(exc).__name__})")
                    continue
                if holds_meta_tensor(value):
                    verdict.problems.append(f"entry {name}: its record in {rel} holds a tensor on the meta device")
                elif chunk is not None and not (
                    isinstance(value, torch.Tensor)
                    and value.dtype == md.properties.dtype
                    and tuple(value.shape) == tuple(chunk.sizes)
                ):
                    verdict.problems.append(f"entry {name}: its record in {rel} does not hold the chunk its entry describes")
