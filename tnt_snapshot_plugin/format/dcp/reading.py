"""DCP's format, read for one restore on one rank: :class:`DcpReader` (the format seam's reader,
``format.base.FormatReader``).

Every rank reads the whole ``.metadata`` (``metadata.parse``: the restricted unpickler, then
every field validated). Each app-state key is read into the target's state dict: DCP's
``DefaultLoadPlanner`` plans the reads of its tensors (each target tensor, or each local shard of
a DTensor or ShardedTensor target, gets the parts of the saved chunks that overlap it: resharding
is DCP's), every record is read through the snapshot's files (checked against the index's
checksum of that record) and loaded with ``torch.load(weights_only=True)``, narrowed and copied
into the target; a pickled value is loaded under the plugin's allow-list
(``format.objects.load_object``), never with full pickle unless ``weights_only=False``. The state
dict is rebuilt from the saved leaves (``layout.assemble``).

A snapshot the plugin wrote on several ranks holds each rank's own values (``per_rank``):
restored on as many ranks, each gets its own; on another number of ranks, rank 0 compares them
(:meth:`DcpReader.fit_world_size`), as torchsnapshot's format does.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tnt_snapshot_plugin.app_state import RNG_STATE_KEY
from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import (
    PartialRestoreWarning,
    SnapshotCorruptError,
    StateMismatchError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.format.dcp.checking import is_plugins, read_metadata
from tnt_snapshot_plugin.format.dcp.layout import Path, assemble, int_keys_of, walk
from tnt_snapshot_plugin.format.dcp.metadata import DcpMetadata
from tnt_snapshot_plugin.format.files import SnapshotFiles
from tnt_snapshot_plugin.format.objects import holds_meta_tensor, load_object, refusal
from tnt_snapshot_plugin.format.structure import volume

#: How many entries a world-size error names before it counts the rest.
_NAMED_ENTRIES = 12


class DcpReader:
    """One rank's reading of one snapshot in DCP's format (``verdict``: rank 0's check of it
    under restore_from_latest, whose parsed metadata is used instead of reading it again)."""

    def __init__(self, files: SnapshotFiles, collectives: Collectives, verdict: Any, *, weights_only: bool) -> None:
        self.files = files
        self.coll = collectives
        self.path = files.path
        self.weights_only = weights_only
        checked = verdict.metadata if verdict is not None else None
        self.parsed: DcpMetadata = checked if isinstance(checked, DcpMetadata) else read_metadata(files)
        if not self.parsed.entries:
            raise SnapshotCorruptError(f"snapshot {self.path} holds no entries (its .metadata is empty)")
        index = files.index
        recorded = index.get("world_size") if index is not None else None
        plugin = is_plugins(index)
        #: tensor records are read without unpickling: the plugin wrote each as torch.save writes a
        #: dense tensor of its chunk's shape, and the index's checksums check every byte read
        self._direct = plugin and files.verifier is not None
        #: the world size the snapshot was taken on (a checkpoint of dcp.save's: this one's)
        self.world_size: int = recorded if plugin and type(recorded) is int else collectives.world_size
        #: the saved rank whose own values this rank restores (None: the snapshot has none)
        self.source: Optional[int] = None
        if self.parsed.layout.ranks:
            self.source = collectives.rank if collectives.rank < self.world_size else 0
        #: the dicts whose keys were ints, as the index records them (None: no index of the plugin's)
        self.int_keys = int_keys_of(index) if plugin else None
        #: the user's LoadPlanner (:meth:`plan_with`); None: DCP's DefaultLoadPlanner
        self._planner: Any = None

    def plan_with(self, planner: Any) -> None:
        """Plan the tensor reads with ``planner`` (a DCP ``LoadPlanner``) instead of DCP's
        default one: for each app-state entry in turn it is set up with that entry's tensors by
        fully qualified name (``app_state.<key>.<...>``, flattened), plans their reads, resolves
        the tensor each read is copied into and is handed it once filled (``commit_tensor``).
        Values that are not tensors load under the plugin's allow-list, never through the
        planner's ``load_bytes``."""
        self._planner = planner

    # -- the seam -------------------------------------------------------------------------

    def keys(self) -> set[str]:
        return self.parsed.layout.keys(self.source)

    def fit_world_size(self, keys: set[str]) -> bool:
        per_rank = self.parsed.layout.per_rank(keys)
        if not per_rank:
            return True  # every value is shared or sharded: DCP's planner reshards
        saved, now = self.world_size, self.coll.world_size
        same, differ, unreadable = self.coll.on_rank0(lambda: self._compare(per_rank))
        if unreadable is not None:
            raise SnapshotCorruptError(
                f"could not read snapshot {self.path}'s per-rank entries to restore it on "
                f"{_ranks(now)} (taken on {_ranks(saved)}): {unreadable}"
            )
        rng_differs = [name for name in differ if name.split("/", 1)[0] == RNG_STATE_KEY]
        differ = [name for name in differ if name.split("/", 1)[0] != RNG_STATE_KEY]
        if differ:
            named = ", ".join(differ[:_NAMED_ENTRIES])
            more = f" and {len(differ) - _NAMED_ENTRIES} more" if len(differ) > _NAMED_ENTRIES else ""
            raise StateMismatchError(
                f"cannot restore {self.path} on {_ranks(now)}: it was taken on {_ranks(saved)}, "
                "and these entries were saved per rank with different values (or not by every rank), "
                f"so they have no value for a world of {_ranks(now)}: {named}{more}. "
                f"Restore on {_ranks(saved)}; or save such state replicated (replicated=[...]) or "
                "sharded (FSDP's SHARDED_STATE_DICT, DTensor); or leave those entries out of the restore"
            )
        if rng_differs:
            warnings.warn(
                f"snapshot {self.path} was taken on {_ranks(saved)} and is restored on {_ranks(now)}: "
                "its RNG states are per rank, so they are not restored (every other entry is)",
                category=PartialRestoreWarning, stacklevel=4,
            )
            return False
        return True

    def check_modules(self, load: Mapping[str, Any]) -> dict[str, Any]:
        problems: list[str] = []
        currents: dict[str, Any] = {}
        entries = self.parsed.entries
        for key, obj in load.items():
            if not isinstance(obj, torch.nn.Module):
                continue
            current = currents[key] = obj.state_dict()
            expected = {name: t for name, t in current.items() if isinstance(t, torch.Tensor)}
            saved: dict[str, tuple[int, ...]] = {}
            for rest, name in self.parsed.layout.view(key, self.source).items():
                md = entries[name]
                if type(md) is TensorStorageMetadata:
                    saved[".".join(map(str, rest))] = tuple(md.size)
            if expected.keys() != saved.keys():
                missing = sorted(set(expected) - set(saved))
                unexpected = sorted(set(saved) - set(expected))
                if missing:
                    problems.append(f"{key}: the module has {missing} that the snapshot lacks")
                if unexpected:
                    problems.append(f"{key}: the snapshot has {unexpected} that the module lacks")
            for name in sorted(n for n, t in expected.items() if n in saved and tuple(t.shape) != saved[n]):
                problems.append(
                    f"{key}.{name}: shape {list(expected[name].shape)} in the module, {list(saved[name])} in the snapshot"
                )
        if problems:
            raise StateMismatchError(f"cannot restore {self.path}: the modules do not match the snapshot: " + "; ".join(problems))
        return currents

    def read(self, key: str, current: Any) -> Any:
        view = self.parsed.layout.view(key, self.source)
        entries = self.parsed.entries
        now = {path[1:]: value for path, value in walk(key, current)[0]} if current is not None else {}
        values: dict[Path, Any] = {}
        targets: dict[str, torch.Tensor] = {}
        pickled: list[tuple[Path, str]] = []
        for rest, name in view.items():
            md = entries[name]
            if type(md) is TensorStorageMetadata:
                targets[name] = values[rest] = self._target(key, rest, md, now.get(rest))
            else:
                pickled.append((rest, name))
        self._read_tensors(targets)
        for rest, name in pickled:
            values[rest] = self._load_value(name)
        return assemble(key, [(rest, values[rest]) for rest in view], current, self.int_keys)

    # -- reading --------------------------------------------------------------------------

    def _target(self, key: str, rest: Path, md: Any, current: Any) -> torch.Tensor:
        """The tensor entry ``key/rest`` is read into: the target's own where it is a tensor of the
        saved shape (StateMismatchError where of another dtype: saved bytes are never cast),
        else a new one."""
        dtype = md.properties.dtype
        if isinstance(current, torch.Tensor) and not current.is_meta and current.layout == torch.strided:
            if current.dtype != dtype:
                raise StateMismatchError(
                    f"entry {'/'.join(map(str, (key, *rest)))!r}: the snapshot holds a {dtype} tensor, "
                    f"the state to restore into a {current.dtype} one; the snapshot's values are not "
                    "cast. Restore into a state of the saved dtypes (convert after restoring), or check "
                    "the snapshot: a dtype that contradicts the state may mean its metadata is damaged"
                )
            if tuple(current.size()) == tuple(md.size):
                return current
        return torch.empty(md.size, dtype=dtype)

    def _read_tensors(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill ``targets`` (fully qualified name -> tensor of the saved shape and dtype) from the
        saved chunks, as DCP's load planner plans the reads."""
        if not targets:
            return
        parsed = self.parsed
        planner = self._planner
        if planner is None:
            planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=False)
        planner.set_up_planner(targets, parsed.meta, self.coll.rank == 0)
        try:
            plan = planner.create_local_plan()
        except (ValueError, RuntimeError) as exc:
            raise StateMismatchError(f"cannot restore {self.path}: DCP's planner cannot plan the reads ({exc})") from exc
        by_record: dict[tuple[str, Optional[tuple[int, ...]]], list[Any]] = {}
        for item in plan.items:
            index = item.storage_index
            offsets = tuple(index.offset) if index.offset is not None else None
            by_record.setdefault((index.fqn, offsets), []).append(item)
        keys = list(by_record)
        records = [parsed.storage(name, offsets) for name, offsets in keys]
        buffers = self._read_records(records, [name for name, _ in keys])
        for (name, offsets), record, buf in zip(keys, records, buffers, strict=True):
            md = parsed.entries[name]
            sizes = next((tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == offsets), None)
            loaded = self._stored(buf, md.properties.dtype, sizes) if self._direct and sizes is not None else None
            if loaded is None:
                try:
                    loaded = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise self._corrupt(record.relative_path, name, f"its chunk cannot be loaded ({type(exc).__name__}: {exc})") from exc
            if not isinstance(loaded, torch.Tensor) or loaded.dtype != md.properties.dtype or tuple(loaded.shape) != sizes:
                raise self._corrupt(record.relative_path, name, "its record does not hold the chunk its entry describes")
            for item in by_record[name, offsets]:
                source = narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise self._corrupt(record.relative_path, name, "a read does not fit its target")
                target.copy_(source)
                if self._planner is not None:
                    self._planner.commit_tensor(item, target)

    @staticmethod
    def _stored(buf: Any, dtype: torch.dtype, sizes: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The chunk a record of the plugin's holds, over the record's bytes (not copied); None
        where the record is not the archive of one dense tensor of ``dtype`` and ``sizes``."""
        if dtype.is_complex or dtype.is_floating_point or dtype in _DIRECT_DTYPES:
            nbytes = volume(sizes) * dtype.itemsize
            at = stored_data(buf, nbytes)
            if at is not None:
                return torch.from_numpy(buf[at:at + nbytes]).view(dtype).reshape(sizes)
        return None

    def _read_records(self, records: list[Any], names: list[str]) -> list[Any]:
        """The bytes of each stored record, read at once and checked against the index's
        checksums where it records them."""
        buffers = [np.empty(record.length, dtype=np.uint8) for record in records]
        reads = [(record.relative_path, record.offset, buf) for record, buf in zip(records, buffers, strict=True)]
        if reads:
            self.files.read_into(reads)
            verifier = self.files.verifier
            if verifier is not None:
                verifier.count(verifier.check_reads(reads, range(len(reads)), names))
        return buffers

    def _load_value(self, name: str) -> Any:
        """The pickled value of entry ``name``, loaded as restore loads objects."""
        record = self.parsed.storage(name)
        [buf] = self._read_records([record], [name])
        try:
            value = load_object(buf, weights_only=self.weights_only)
        except Exception as exc:
            if _is_refusal(exc):
                raise UnrestorableStateError(
                    f"snapshot entry {name!r} holds an object that torch.load(weights_only=True) "
                    f"refuses: {refusal(exc)}. If the type is safe, allow it with "
                    "torch.serialization.add_safe_globals([...]); if you trust this snapshot (you "
                    "wrote it), load it with weights_only=False"
                ) from exc
            raise self._corrupt(record.relative_path, name, f"its value cannot be loaded ({type(exc).__name__}: {exc})") from exc
        if holds_meta_tensor(value):
            raise self._corrupt(record.relative_path, name, "its value holds a tensor on the meta device, which has no data")
        return value

    def value(self, name: str) -> Any:
        """The whole value of entry ``name``, read without a target."""
        md = self.parsed.entries[name]
        if type(md) is TensorStorageMetadata:
            tensor = torch.empty(md.size, dtype=md.properties.dtype)
            self._read_tensors({name: tensor})
            return tensor
        return self._load_value(name)

    def _compare(self, per_rank: dict[tuple[str, Path], dict[int, str]]) -> tuple[list[str], list[str], Optional[str]]:
        """Rank 0: (per-rank entries equal on every saved rank, those that are not, a read error)."""
        from tnt_snapshot_plugin.format.torchsnapshot.world_size import _same_value

        same: list[str] = []
        differ: list[str] = []
        try:
            for (key, rest), by_rank in per_rank.items():
                name = "/".join(map(str, (key, *rest)))
                if len(by_rank) < self.world_size:
                    differ.append(name)
                    continue
                first = self.value(by_rank[0])
                equal = all(_same_value(first, self.value(by_rank[r])) for r in range(1, self.world_size))
                (same if equal else differ).append(name)
        except Exception as exc:  # damaged bytes: every rank raises it as corruption
            return [], [], f"{type(exc).__name__}: {exc}"
        return sorted(same), sorted(differ), None

    def _corrupt(self, rel: str, name: str, what: str) -> SnapshotCorruptError:
        error = SnapshotCorruptError(
            f"{self.path}/{rel} (entry {name}): {what}: the snapshot is damaged. Restore an older "
            "snapshot (restore_from_latest falls back to one by itself)"
        )
        error.reason = what  # type: ignore[attr-defined]
        return error


#: The integer dtypes a record of the plugin's is read as bytes of (quantized ones are unpickled).
_DIRECT_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
})


_EOCD, _EOCD64_LOCATOR, _EOCD64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_CENTRAL, _LOCAL = b"PK\x01\x02", b"PK\x03\x04"
_FULL32, _FULL16 = 0xFFFFFFFF, 0xFFFF
#: The most entries the archive of one tensor holds (torch.save writes seven).
_MAX_ENTRIES = 64


def stored_data(buf: Any, nbytes: int) -> Optional[int]:
    """Where in ``buf``, a ``torch.save`` archive of one tensor (a zip file), its storage's
    ``nbytes`` bytes begin: its one ``<archive>/data/0`` record, stored uncompressed, in this
    machine's byte order. None where the archive is not that (the caller unpickles it instead)."""
    view = memoryview(buf).cast("B")
    try:
        records = _central_directory(view)
        if records is None:
            return None
        data = [r for r in records if r[0].split("/")[1:2] == ["data"]]
        order = [r for r in records if r[0].endswith("/byteorder")]
        if len(data) != 1 or not data[0][0].endswith("/data/0") or len(order) > 1:
            return None
        begin = _stored(view, data[0], nbytes)
        if begin is None:
            return None
        if order:
            text = order[0][2]
            at = _stored(view, order[0], text)
            if at is None or bytes(view[at:at + text]) != sys.byteorder.encode():
                return None
        return begin
    except (struct.error, UnicodeDecodeError, IndexError):
        return None


def _central_directory(view: memoryview) -> Optional[list[tuple[str, int, int, int]]]:
    """(name, method, size, local header offset) of each record of the zip archive ``view``."""
    size = len(view)
    if size < 22 or view[size - 22:size - 18] != _EOCD:
        return None  # torch.save writes no archive comment: the record ends the archive
    count, cd_size, cd_offset = struct.unpack_from("<HII", view, size - 22 + 10)
    if count == _FULL16 or cd_size == _FULL32 or cd_offset == _FULL32:
        locator = size - 22 - 20
        if locator < 0 or view[locator:locator + 4] != _EOCD64_LOCATOR:
            return None
        (at,) = struct.unpack_from("<Q", view, locator + 8)
        if view[at:at + 4] != _EOCD64:
            return None
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", view, at + 32)
    if count > _MAX_ENTRIES or cd_offset + cd_size > size:
        return None
    records = []
    pos = cd_offset
    for _ in range(count):
        if view[pos:pos + 4] != _CENTRAL:
            return None
        method, csize, usize, name_len, extra_len, comment_len = struct.unpack_from("<H8xIIHHH", view, pos + 10)
        (offset,) = struct.unpack_from("<I", view, pos + 42)
        name = bytes(view[pos + 46:pos + 46 + name_len]).decode("utf-8")
        extra = view[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        usize, csize, offset = _zip64(extra, usize, csize, offset)
        if method != 0 or csize != usize:
            return None
        records.append((name, method, usize, offset))
        pos += 46 + name_len + extra_len + comment_len
    return records


def _zip64(extra: memoryview, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """The sizes and offset of a central record, from its zip64 extra field where they are full."""
    pos = 0
    while pos + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, pos)
        if kind == 1:
            at = pos + 4
            values = []
            for full in (usize, csize, offset):
                if full == _FULL32:
                    (value,) = struct.unpack_from("<Q", extra, at)
                    values.append(value)
                    at += 8
                else:
                    values.append(full)
            return values[0], values[1], values[2]
        pos += 4 + length
    return usize, csize, offset


def _stored(view: memoryview, record: tuple[str, int, int, int], nbytes: int) -> Optional[int]:
    """Where the ``nbytes`` bytes of ``record`` begin, from its local header; None if they do not
    lie there."""
    _name, _method, size, offset = record
    if size != nbytes or view[offset:offset + 4] != _LOCAL:
        return None
    name_len, extra_len = struct.unpack_from("<HH", view, offset + 26)
    begin = offset + 30 + name_len + extra_len
    return begin if begin + nbytes <= len(view) else None


def _is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's restricted unpickler refusing a type (not damaged bytes)."""
    return (
        isinstance(exc, pickle.UnpicklingError)
        and "weights_only" in str(exc).lower().replace(" ", "_")
        and "Unsupported operand" not in str(exc)
    )


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


__all__ = ["DcpReader"]
