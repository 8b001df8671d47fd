"""A snapshot's entries for ``inspect``, ``diff``, ``export`` and ``convert``, whatever its format:
the format lists them (``Format.entries``: each entry's kind, dtype, shape, bytes) and reads their
values (``Format.read_entry``, ``Format.read_key``; torch, imported lazily), from a snapshot the
check restore makes (``format.verify.check``) finds intact. A stored object whose format does not
record what it holds (DCP's pickled values) is read to show it: a number, a string or bytes as a
value, a list leaf by leaf (the paths torchsnapshot's format gives its items, so that ``diff``
compares the two formats entry by entry), anything else by its class."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from tnt_snapshot_plugin.cli.app import UsageProblem
from tnt_snapshot_plugin.cli.survey import FileInfo, snapshot_files
from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError, UnrestorableStateError
from tnt_snapshot_plugin.format import verify
from tnt_snapshot_plugin.format.base import EntryInfo
from tnt_snapshot_plugin.format.files import SnapshotFiles
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.stores import Store

#: The plugin's reserved entries (app_state.RESERVED_KEYS; not imported: that module imports torch).
RESERVED = ("rng_state", "train_dataloader")
#: The largest stored object of unknown type that is read to show what it holds.
SMALL_OBJECT_BYTES = 64 * 1024
#: The types shown as values (torchsnapshot's format records these in its metadata).
_PRIMITIVES = (int, float, str, bool, bytes)


class Snapshot:
    """One snapshot as the commands read it: its verdict (format, parsed metadata), its leaf
    entries by path ``RANK/KEY/...``, and its files, read as restore reads them (checksums)."""

    def __init__(self, store: Store, name: str, *, decode_objects: bool = True) -> None:
        self.store, self.name = store, name
        files, _ = snapshot_files(store, name)
        if not any(m in files for m in metadata_files()):
            raise UsageProblem(
                f"{store.child(name)} is not a complete snapshot (it holds no {' or '.join(metadata_files())}: "
                "an interrupted write, or not a snapshot)"
            )
        self.verdict = verify.require_intact(store, name)
        assert self.verdict.format is not None
        self.format = self.verdict.format
        self._files: Optional[SnapshotFiles] = None
        self._values: dict[str, Any] = {}  # the leaves of stored lists (_decoded), by path
        self.entries = self.format.entries(self.verdict)
        if decode_objects:
            self.entries = self._decoded(self.entries)

    @property
    def index(self) -> Optional[dict[str, Any]]:
        return self.verdict.index

    @property
    def world_size(self) -> Optional[int]:
        size = getattr(self.verdict.metadata, "world_size", None)
        return size if type(size) is int else None

    @property
    def files(self) -> SnapshotFiles:
        if self._files is None:  # the index read once, at the first value
            self._files = SnapshotFiles(self.store, self.name, self.store.child(self.name), self.verdict.index)
        return self._files

    def value(self, path: str) -> Any:
        """The value of leaf entry ``path``."""
        if path in self._values:
            return self._values[path]
        return self.format.read_entry(self.files, self.verdict, path)

    def key(self, key: str) -> Any:
        """App-state entry ``key`` whole, as plain data."""
        return self.format.read_key(self.files, self.verdict, key)

    def _decoded(self, entries: dict[str, EntryInfo]) -> dict[str, EntryInfo]:
        """``entries`` with each small object of unknown type read: a value, or its class."""
        out = dict(entries)
        for path, info in entries.items():
            if info.kind != "object" or info.dtype is not None or (info.nbytes or 0) > SMALL_OBJECT_BYTES:
                continue
            try:
                value = self.value(path)
            except UnrestorableStateError:
                continue  # a type this process does not allow-list: an object of unknown type
            if type(value) is list:  # listed leaf by leaf, as torchsnapshot's format stores a list
                del out[path]
                out.update(self._leaves(path, info, value))
            else:
                out[path] = _described(info, value)
        return out

    def _leaves(self, path: str, info: EntryInfo, value: list[Any]) -> dict[str, EntryInfo]:
        """The leaf entries of a stored list, by the paths torchsnapshot's format gives them."""
        from tnt_snapshot_plugin.format.torchsnapshot.writer import flatten

        _, leaves = flatten("list", value)
        out: dict[str, EntryInfo] = {}
        for sub, item in leaves.items():
            leaf = path + sub.removeprefix("list")
            self._values[leaf] = item
            out[leaf] = _described(replace(info, nbytes=None, locations=[]), item)
        return out

    def top_keys(self) -> set[str]:
        return {path.split("/")[1] for path in self.entries if path.startswith("0/")}


def _described(info: EntryInfo, value: Any) -> EntryInfo:
    """``info`` of an object that was read: a primitive as a value, anything else by its class."""
    kind = type(value)
    if kind in _PRIMITIVES:
        return replace(info, kind="value", type=kind.__name__, dtype=kind.__name__, value=value)
    return replace(info, kind="object", type="object", dtype=f"{kind.__module__}.{kind.__qualname__}")


def entry_rows(snapshot: Snapshot, files: dict[str, FileInfo]) -> list[dict[str, Any]]:
    """One row per leaf entry, sorted by path."""
    return [entry_row(path, snapshot.entries[path], files) for path in sorted(snapshot.entries)]


def entry_row(path: str, info: EntryInfo, files: dict[str, FileInfo]) -> dict[str, Any]:
    """What ``inspect`` shows of one leaf entry."""
    nbytes = info.nbytes
    if nbytes is None:
        nbytes = sum(
            (r[1] - r[0]) if r is not None else (files[rel].size if rel in files else 0)
            for rel, r in info.locations
        )
    rank, _, logical = path.partition("/")
    row: dict[str, Any] = {
        "path": path, "rank": int(rank), "key": logical, "kind": info.kind, "type": info.type,
        "dtype": info.dtype, "shape": info.shape, "bytes": nbytes, "replicated": info.replicated,
    }
    if info.kind == "value":
        value = info.value
        row["value"] = f"<{len(value)} bytes>" if isinstance(value, bytes) else value
    return row


def summarize(snapshot: Snapshot) -> dict[str, Any]:
    """The progress and RNG entries of rank 0, in a few words."""
    summary: dict[str, Any] = {}
    rng: list[str] = []
    for path, info in snapshot.entries.items():
        parts = path.split("/")
        if parts[0] != "0" or len(parts) < 2:
            continue
        key = parts[1]
        if key == "rng_state" and len(parts) > 2 and parts[2] not in rng:
            rng.append(parts[2])
        if info.kind != "value":
            continue
        if key.endswith("progress") and len(parts) == 3:
            summary.setdefault(key, {})[parts[2]] = info.value
        elif len(parts) == 2 and key in ("epoch", "global_step"):
            summary.setdefault("lightning", {})[key] = info.value
    if rng:
        names = {"rng_state": "torch CPU", "cuda": "torch CUDA", "python": "python", "numpy": "numpy"}
        summary["rng_state"] = [names.get(k, k) for k in rng]
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in summary.items():
        if key == "rng_state":
            lines.append(f"rng_state: {', '.join(value)} generators")
        elif key == "lightning":
            lines.append("lightning: " + ", ".join(f"{k} {v}" for k, v in value.items()))
        else:
            epoch, step = value.get("num_epochs_completed"), value.get("num_steps_completed")
            text = f"{key}: epoch {epoch}, step {step}"
            if "num_steps_completed_in_epoch" in value:
                text += f" ({value['num_steps_completed_in_epoch']} into the epoch)"
            lines.append(text)
    return lines


# --------------------------------------------------------------------------------------------
# Values (torch from here on).


def _max_abs_diff(a: Any, b: Any) -> str:
    import torch

    if a.dtype == torch.bool:
        return f"{int((a != b).sum())} of {a.numel()} elements differ"
    if a.numel() == 0:
        return "empty"
    if a.is_complex():
        diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs().max().item()
    else:
        diff = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()
    return f"max |a-b| = {diff:.6g}"


class _Payloads:
    """The raw bytes of one snapshot's entries, read through the store (inside the snapshot
    only), a few files kept at once."""

    def __init__(self, store: Store, name: str, *, decode_objects: bool = True) -> None:
        self.store, self.name = store, name
        self.cache: dict[str, bytes] = {}

    def of(self, info: EntryInfo) -> Optional[bytes]:
        """The bytes an entry is stored as (one file or a range of one), or None if several."""
        found = info.locations
        if len(found) != 1:
            return None
        rel, byte_range = found[0]
        if byte_range is not None:
            data = memoryview(bytearray(byte_range[1] - byte_range[0]))
            self.store.read_into(self.name, [(rel, byte_range[0], data)])
            return bytes(data)
        if rel not in self.cache:
            if sum(len(v) for v in self.cache.values()) > 512 * 1024 * 1024:
                self.cache.clear()
            size = self.store.file_size(self.name, rel)
            if size is None:
                raise SnapshotCorruptError(f"{self.store.child(self.name)}/{rel} is missing: the snapshot is damaged")
            data = memoryview(bytearray(size))
            self.store.read_into(self.name, [(rel, 0, data)])
            self.cache[rel] = bytes(data)
        return self.cache[rel]


#: App-state keys whose values are opaque state (generators' bytes): told apart only as differing.
_OPAQUE_KEYS = frozenset({"rng_state"})


def diff_snapshots(a: tuple[Store, str], b: tuple[Store, str], storage_options: Optional[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(differences, number of entries compared) between two snapshots' leaf entries."""
    side_a, side_b = Snapshot(*a), Snapshot(*b)
    raw_a, raw_b = _Payloads(*a), _Payloads(*b)
    diffs: list[dict[str, Any]] = []
    sharded_seen: set[str] = set()  # logical paths of sharded entries compared (under any rank)
    paths = sorted(set(side_a.entries) | set(side_b.entries))
    for path in paths:
        ea, eb = side_a.entries.get(path), side_b.entries.get(path)
        if ea is None or eb is None:
            change, entry = ("added", eb) if ea is None else ("removed", ea)
            assert entry is not None
            diffs.append({"path": path, "change": change, "detail": _describe(entry)})
            continue
        detail = _difference(path, ea, eb, (side_a, raw_a), (side_b, raw_b), sharded_seen)
        if detail is not None:
            diffs.append({"path": path, "change": "changed", "detail": detail})
    return diffs, len(paths)


def _difference(
    path: str, ia: EntryInfo, ib: EntryInfo, a: tuple[Snapshot, _Payloads], b: tuple[Snapshot, _Payloads],
    sharded_seen: set[str],
) -> Optional[str]:
    """How entry ``path`` differs between the two snapshots, or None if it holds the same value."""
    (side_a, raw_a), (side_b, raw_b) = a, b
    opaque = path.split("/")[1] in _OPAQUE_KEYS
    if ia.type != ib.type:
        return f"type {ia.type} -> {ib.type}"
    if ia.kind == "value":
        if type(ia.value) is type(ib.value) and (ia.value == ib.value or ia.value != ia.value and ib.value != ib.value):
            return None  # the same value (NaN, which is not == itself, included)
        return "differs" if opaque else f"{_shown(ia.value)} -> {_shown(ib.value)}"
    if ia.kind in ("tensor", "sharded") and ia.dtype != ib.dtype:
        return f"dtype {ia.dtype} -> {ib.dtype}"
    if ia.kind in ("tensor", "sharded") and ia.shape != ib.shape:
        return f"shape {ia.shape} -> {ib.shape}"
    bytes_a, bytes_b = raw_a.of(ia), raw_b.of(ib)
    if bytes_a is not None and bytes_a == bytes_b:
        return None
    if ia.kind == "sharded":  # read whole (every rank's shards), once for all the ranks recording it
        logical = path.split("/", 1)[-1]
        if logical in sharded_seen:
            return None
        sharded_seen.add(logical)
    if ia.kind in ("tensor", "sharded"):
        ra, rb = side_a.value(path), side_b.value(path)
        if ra.dtype == rb.dtype and ra.equal(rb):
            return None
        return "differs" if opaque else _max_abs_diff(ra, rb)
    try:
        same = bool(side_a.value(path) == side_b.value(path))
    except SnapshotError:
        raise
    except Exception:  # objects without a usable ==: their stored bytes differ
        same = False
    return None if same else "differs"


def _shown(value: Any) -> str:
    return f"<{len(value)} bytes>" if isinstance(value, bytes) else repr(value)


def _describe(info: EntryInfo) -> str:
    if info.kind == "value":
        return f"{info.type} {_shown(info.value)}"
    if info.kind in ("tensor", "sharded"):
        return f"{info.dtype} {info.shape}"
    return str(info.dtype or info.type)


def weight_keys(snapshot: Snapshot) -> list[str]:
    """Top-level keys of rank 0 whose leaf entries are all tensors (a module's state dict)."""
    kinds: dict[str, set[str]] = {}
    for path, info in snapshot.entries.items():
        parts = path.split("/")
        if parts[0] != "0":
            continue
        kinds.setdefault(parts[1], set()).add("tensor" if info.kind in ("tensor", "sharded") else "other")
    return sorted(k for k, found in kinds.items() if found == {"tensor"} and k not in RESERVED)


def tensor_leaves(obj: Any, prefix: str = "", *, clashes: Optional[list[str]] = None) -> tuple[dict[str, Any], list[str]]:
    """The leaves of nested dicts/lists/tuples: the tensors as {"a.b.0": tensor}, and the paths
    of the other values (numbers, strings, objects). A name that two tensors' paths join to
    (``{"a.b": x, "a": {"b": y}}``: the first is not in the dict) goes to ``clashes``."""
    import torch

    tensors: dict[str, Any] = {}
    others: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if path in tensors and clashes is not None:
                clashes.append(path)
            tensors[path] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}" if path else str(i))
        else:
            others.append(path)

    walk(obj, prefix)
    return tensors, others


def tensor_keys(snapshot: Snapshot) -> list[str]:
    """Top-level keys of rank 0 holding at least one tensor (the reserved ones left out)."""
    return sorted({
        path.split("/")[1]
        for path, info in snapshot.entries.items()
        if path.startswith("0/") and info.kind in ("tensor", "sharded")
    } - set(RESERVED))
