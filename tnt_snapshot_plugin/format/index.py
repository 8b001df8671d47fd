"""The plugin's index of a snapshot, ``.tnt_snapshot_index.json``: written sealed, read checked.

The index sits next to torchsnapshot's ``.snapshot_metadata`` in every snapshot the plugin
commits. It records what torchsnapshot's format has no room for: the size and checksum of every
file (``files``, ``checksums``), the commit sequence number (``seq``, which orders "latest"),
the writer, the world size and the monitored metric.

:func:`seal` writes it with its own digest (``seal``: xxh3_64 of the sorted JSON of every other
field), so that an index edited or damaged after its commit (a flipped checksum, another ``seq``)
is told apart from an intact one: :func:`parse` refuses it with :class:`SnapshotCorruptError`.
An index written before the seal existed has none, and is read as it is.

**Parts.** A snapshot of several ranks keeps its files and checksums out of the index itself:
each rank writes its own (:func:`part_bytes`) to ``.tnt_snapshot_index/R.json`` with its
payloads, and the index lists each part's size and digest under ``parts`` (rank R's at R), so
that it stays O(world size) and a restoring rank reads only the parts of the files it reads
(:class:`Parts`). The index's own ``files`` then lists no file. A part is checked against its
size and digest and holds only files its rank wrote (``R/...``, ``batched/R-N``: the writer's
naming). :func:`complete` gives the index with every part's files and checksums merged, as a
snapshot of one rank has them.

**Names.** Every file name the index or a part lists is checked before anything asks the
storage about it: a relative path inside the snapshot (``format.manifest.escapes``), and, for
the files of a snapshot whose ``world_size`` the index records, written by one of its ranks
(a part: by its own rank). Counts are bounded (``world_size``, ``parts``:
``format.manifest.MAX_WORLD_SIZE``) and agree with each other.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Optional

import xxhash

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format.structure import MAX_INT64
from tnt_snapshot_plugin.format.torchsnapshot.manifest import MAX_WORLD_SIZE, escapes
from tnt_snapshot_plugin.stores.base import INDEX_FNAME

#: The index file of every snapshot the plugin commits.
#: The field holding the index's own digest.
SEAL_FIELD = "seal"
#: The directory of the index's parts (a snapshot of several ranks).
PARTS_DIR = ".tnt_snapshot_index"
#: The ``format`` of an index whose files are listed in parts.
PARTED_FORMAT = 2


def _digest(fields: dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True).encode())


def seal(fields: dict[str, Any]) -> bytes:
    """The bytes of an index holding ``fields`` and the seal over them (the fields' JSON, made
    once: the seal goes at its end; :func:`parse` reads the fields in any order)."""
    body = json.dumps(fields, sort_keys=True)
    digest = xxhash.xxh3_64_hexdigest(body.encode())
    if not fields:
        return json.dumps({SEAL_FIELD: digest}).encode()
    return f'{body[:-1]}, "{SEAL_FIELD}": "{digest}"}}'.encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """The index of snapshot ``where`` (named in errors) from its bytes, checked: a JSON object
    with ``format``, ``files`` (file -> size) and, where present, ``checksums`` (file -> record)
    and a seal that matches. SnapshotCorruptError otherwise (its ``reason``: the problem in a few
    words, without the snapshot's path)."""
    def damaged(what: str) -> SnapshotCorruptError:
        error = SnapshotCorruptError(
            f"{where}/{INDEX_FNAME}: {what}: the snapshot's index is damaged, so its files cannot be "
            "checked. Restore an older snapshot (restore_from_latest falls back to one by itself)"
        )
        error.reason = f"its index {INDEX_FNAME} is damaged: {what}"  # type: ignore[attr-defined]
        return error

    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise damaged(f"it is not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise damaged("it is not the plugin's index (a JSON object with 'format')")
    if SEAL_FIELD in doc:
        fields = {k: v for k, v in doc.items() if k != SEAL_FIELD}
        if doc[SEAL_FIELD] != _digest(fields):
            raise damaged("its content does not match its seal (the file was changed after the commit)")
    world_size = doc.get("world_size")
    if world_size is not None and (type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE):
        raise damaged(f"its world_size is {world_size!r}, not a number of ranks from 1 to {MAX_WORLD_SIZE}")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and type(v) is int and 0 <= v <= MAX_INT64 for k, v in files.items()
    ):
        raise damaged("its 'files' is not a mapping of file to size")
    stray = _stray(files, world_size)
    if stray is not None:
        raise damaged(f"its 'files' names {stray!r}, {_STRAY}")
    checksums = doc.get("checksums")
    if checksums is not None and not isinstance(checksums, dict):
        raise damaged("its 'checksums' is not a mapping of file to record")
    stray = next((k for k in checksums or () if escapes(k)), None)
    if stray is not None:
        raise damaged(f"its 'checksums' names {stray!r}, not a file inside the snapshot")
    parts = doc.get("parts")
    if parts is not None and not (
        isinstance(parts, list)
        and len(parts) <= MAX_WORLD_SIZE
        and all(
            type(p) is list and len(p) == 2 and type(p[0]) is int and 0 <= p[0] <= MAX_INT64 and type(p[1]) is str
            for p in parts
        )
    ):
        raise damaged("its 'parts' is not a list of [size, digest]")
    if parts is not None and world_size is not None and len(parts) != world_size:
        raise damaged(f"it lists {len(parts)} parts for a world_size of {world_size}")
    return doc


_STRAY = "not a file inside the snapshot that one of its ranks wrote"


def _stray(files: dict[str, Any], world_size: Any, rank: Optional[int] = None) -> Optional[str]:
    """A name of ``files`` that is not a relative path inside the snapshot, or, where
    ``world_size`` is known, not a file a rank below it wrote (``rank``: not one of that rank's);
    None if every name is."""
    for rel in files:
        if escapes(rel):
            return rel
        if rank is not None or type(world_size) is int:
            writer = owner(rel)
            if writer is None or (writer != rank if rank is not None else writer >= world_size):
                return rel
    return None


# -- parts ----------------------------------------------------------------------------------------


def part_rel(rank: int) -> str:
    """The file of rank ``rank``'s part of the index, inside the snapshot."""
    return f"{PARTS_DIR}/{rank}.json"


def owner(rel: str) -> Optional[int]:
    """The rank that wrote payload file ``rel`` (``R/...`` or ``batched/R-N``), or None."""
    head, _, rest = rel.partition("/")
    if head == "batched":
        head = rest.partition("-")[0]
    return int(head) if head.isascii() and head.isdigit() else None


def part_bytes(files: dict[str, int], checksums: dict[str, Any]) -> bytes:
    """The bytes of one rank's part: its files' sizes and checksum records."""
    return json.dumps({"files": files, "checksums": checksums}, sort_keys=True).encode()


def part_entry(data: bytes) -> list[Any]:
    """What the index lists of a part whose bytes are ``data``: [size, digest]."""
    return [len(data), xxhash.xxh3_64_hexdigest(data)]


def parts_of(index: Any) -> Optional[list[list[Any]]]:
    """The parts ``index`` (parsed) lists, or None where its files are in the index itself."""
    parts = index.get("parts") if isinstance(index, dict) else None
    return parts if isinstance(parts, list) else None


def _damaged_part(where: str, rank: int, what: str) -> SnapshotCorruptError:
    error = SnapshotCorruptError(
        f"{where}/{part_rel(rank)}: {what}: rank {rank}'s part of the snapshot's index is damaged, "
        "so its files cannot be checked. Restore an older snapshot (restore_from_latest falls "
        "back to one by itself)"
    )
    error.reason = f"rank {rank}'s part of its index ({part_rel(rank)}) is damaged: {what}"  # type: ignore[attr-defined]
    return error


def parse_part(data: Optional[bytes], index: dict[str, Any], rank: int, where: str) -> tuple[dict[str, int], dict[str, Any]]:
    """Rank ``rank``'s part (``data``; None: missing) of snapshot ``where``'s ``index``: (files,
    checksums), checked against the size and digest the index lists and for files of its rank
    only. SnapshotCorruptError otherwise."""
    parts = parts_of(index) or []
    if not 0 <= rank < len(parts):
        raise _damaged_part(where, rank, f"the index lists {len(parts)} parts")
    if data is None:
        raise _damaged_part(where, rank, "it is missing")
    if part_entry(data) != parts[rank]:
        raise _damaged_part(where, rank, "its bytes differ from the size and digest the index recorded")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise _damaged_part(where, rank, "it is not JSON") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    checksums = doc.get("checksums") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not isinstance(checksums, dict) or not all(
        type(v) is int and 0 <= v <= MAX_INT64 for v in files.values()
    ):
        raise _damaged_part(where, rank, "it is not a mapping of this rank's files to sizes and checksums")
    stray = _stray(files, None, rank)
    if stray is None:
        stray = _stray(checksums, None, rank)
    if stray is not None:
        raise _damaged_part(
            where, rank, f"it is not a mapping of this rank's files to sizes and checksums: it names {stray!r}, not a "
            f"file inside the snapshot that rank {rank} wrote"
        )
    return files, checksums


class Parts:
    """The parts of one snapshot's index, each read when a file of its rank is first asked for
    (``read(rel)``: the bytes of file ``rel`` of the snapshot, None if it is missing). ``files``
    and ``checksums`` hold what the parts read so far list (from any number of threads)."""

    def __init__(self, index: dict[str, Any], read: Callable[[str], Optional[bytes]], where: str) -> None:
        self.index, self.read, self.where = index, read, where
        self.files: dict[str, int] = dict(index.get("files") or {})
        self.checksums: dict[str, Any] = dict(index.get("checksums") or {})
        self.loaded: set[int] = set()
        self._lock = threading.Lock()
        self._count = len(parts_of(index) or [])

    def load(self, rank: int) -> Optional[tuple[dict[str, int], dict[str, Any]]]:
        """Read rank ``rank``'s part, unless it was read: its (files, checksums), or None."""
        with self._lock:
            if rank in self.loaded or not 0 <= rank < self._count:
                return None
            files, checksums = parse_part(self.read(part_rel(rank)), self.index, rank, self.where)
            self.files.update(files)
            self.checksums.update(checksums)
            self.loaded.add(rank)
            return files, checksums

    def load_for(self, rels: Any) -> list[tuple[dict[str, int], dict[str, Any]]]:
        """Read the parts of the ranks that wrote files ``rels``, where not read: what each lists."""
        ranks = sorted({r for r in (owner(rel) for rel in rels if rel not in self.files) if r is not None})
        return [part for part in map(self.load, ranks) if part is not None]

    def load_all(self) -> None:
        for rank in range(self._count):
            self.load(rank)


def complete(index: dict[str, Any], read: Callable[[str], Optional[bytes]], where: str) -> dict[str, Any]:
    """``index`` with every part's files and checksums in ``files`` and ``checksums``, as one
    rank's snapshot lists them (``index`` itself where it has no parts). SnapshotCorruptError
    when a part is missing or damaged."""
    if parts_of(index) is None:
        return index
    parts = Parts(index, read, where)
    parts.load_all()
    return {**index, "files": parts.files, "checksums": parts.checksums}


def read_local(path: str) -> dict[str, Any]:
    """The index of the snapshot in local directory ``path``, checked, with every part's files
    and checksums (:func:`complete`). FileNotFoundError without an index;
    SnapshotCorruptError where it or a part is damaged."""
    import os

    def read(rel: str) -> Optional[bytes]:
        try:
            with open(os.path.join(path, rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    with open(os.path.join(path, INDEX_FNAME), "rb") as f:
        index = parse(f.read(), path)
    return complete(index, read, path)


__all__ = [
    "INDEX_FNAME", "PARTED_FORMAT", "PARTS_DIR", "SEAL_FIELD", "Parts", "complete", "owner", "parse",
    "parse_part", "part_bytes", "part_entry", "part_rel", "parts_of", "read_local", "seal",
]
