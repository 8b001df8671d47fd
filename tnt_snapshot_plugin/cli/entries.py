"""A snapshot's entries for ``inspect``, ``diff`` and ``export``: read through ``format.manifest``
(the reader restore uses) and, for values, the plugin's format reader (torch, imported lazily)."""

from __future__ import annotations

from typing import Any, Optional

from tnt_snapshot_plugin.cli.app import UsageProblem
from tnt_snapshot_plugin.cli.survey import FileInfo, snapshot_files
from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.format.torchsnapshot import manifest
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.format.torchsnapshot.manifest import Metadata
from tnt_snapshot_plugin.stores import Store

#: The plugin's reserved entries (app_state.RESERVED_KEYS; not imported: that module imports torch).
RESERVED = ("rng_state", "train_dataloader")


# --------------------------------------------------------------------------------------------
# Manifest entries (format.manifest, the one reader restore uses too).


def entry_rows(metadata: Metadata, files: dict[str, FileInfo]) -> list[dict[str, Any]]:
    """One row per leaf entry of the manifest (containers skipped), sorted by path."""
    manifest_ = metadata.manifest
    return [
        entry_row(path, manifest_[path], files)
        for path in sorted(manifest_)
        if manifest_[path]["type"] not in manifest.CONTAINER_TYPES
    ]


def entry_row(path: str, entry: dict, files: dict[str, FileInfo]) -> dict[str, Any]:
    """What ``inspect`` shows of one leaf entry."""
    info = manifest.describe(entry)
    nbytes = info.nbytes
    if nbytes is None:
        nbytes = sum(
            (r[1] - r[0]) if r is not None else (files[rel].size if rel in files else 0)
            for rel, r in info.locations
        )
    rank, _, logical = path.partition("/")
    row: dict[str, Any] = {
        "path": path, "rank": int(rank), "key": logical, "kind": info.kind, "type": info.type,
        "dtype": info.dtype, "shape": info.shape, "bytes": nbytes,
        "replicated": entry.get("replicated") is True,
    }
    if info.kind == "value":
        value = info.value
        row["value"] = f"<{len(value)} bytes>" if isinstance(value, bytes) else value
    return row


def summarize(metadata: Metadata) -> dict[str, Any]:
    """The progress and RNG entries of rank 0, in a few words."""
    summary: dict[str, Any] = {}
    for path, entry in metadata.manifest.items():
        if not path.startswith("0/") or entry["type"] not in manifest.PRIMITIVE_TYPES:
            continue
        parts = path.split("/")
        key = parts[1]
        if key.endswith("progress") and len(parts) == 3:
            summary.setdefault(key, {})[parts[2]] = manifest.primitive_value(entry)
        elif len(parts) == 2 and key in ("epoch", "global_step"):
            summary.setdefault("lightning", {})[key] = manifest.primitive_value(entry)
    rng = metadata.manifest.get("0/rng_state")
    if rng is not None and isinstance(rng.get("keys"), list):
        names = {"rng_state": "torch CPU", "cuda": "torch CUDA", "python": "python", "numpy": "numpy"}
        summary["rng_state"] = [names.get(str(k), str(k)) for k in rng["keys"]]
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
# Loading entries (torch from here on).


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

    def __init__(self, store: Store, name: str) -> None:
        self.store, self.name = store, name
        self.cache: dict[str, bytes] = {}

    def of(self, entry: dict) -> Optional[bytes]:
        """The bytes an entry is stored as (one file or a range of one), or None if several."""
        found = list(manifest.locations(entry))
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


class _Side:
    """One snapshot of a diff: its validated metadata, its payloads and its values."""

    def __init__(self, store: Store, name: str) -> None:
        self.store, self.name = store, name
        self.meta = require_metadata(store, name)
        self.leaves = {p: e for p, e in self.meta.manifest.items() if e["type"] not in manifest.CONTAINER_TYPES}
        self.payloads = _Payloads(store, name)
        self._files: Any = None  # format.files.SnapshotFiles: the index read once, at the first value

    def value(self, path: str) -> Any:
        """The value of manifest entry ``path`` (``RANK/KEY/...``)."""
        from tnt_snapshot_plugin.format.files import SnapshotFiles
        from tnt_snapshot_plugin.format.torchsnapshot import reader as fmt

        if self._files is None:
            self._files = SnapshotFiles.open(self.store, self.name, self.store.child(self.name))
        files = self._files
        return fmt.read_value(self.meta.manifest, path, files.read_into, file_size=files.file_size, verifier=files.verifier)


def diff_snapshots(
    a: tuple[Store, str], b: tuple[Store, str], storage_options: Optional[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """(differences, number of entries compared) between two snapshots' leaf entries."""
    side_a, side_b = _Side(*a), _Side(*b)
    diffs: list[dict[str, Any]] = []
    sharded_seen: set[str] = set()  # logical paths of sharded entries compared (under any rank)
    paths = sorted(set(side_a.leaves) | set(side_b.leaves))
    for path in paths:
        ea, eb = side_a.leaves.get(path), side_b.leaves.get(path)
        if ea is None or eb is None:
            change, entry = ("added", eb) if ea is None else ("removed", ea)
            assert entry is not None
            diffs.append({"path": path, "change": change, "detail": _describe(entry)})
            continue
        detail = _difference(path, ea, eb, side_a, side_b, sharded_seen)
        if detail is not None:
            diffs.append({"path": path, "change": "changed", "detail": detail})
    return diffs, len(paths)


def _difference(path: str, ea: dict, eb: dict, side_a: _Side, side_b: _Side, sharded_seen: set[str]) -> Optional[str]:
    """How entry ``path`` differs between the two snapshots, or None if it holds the same value."""
    ia, ib = manifest.describe(ea), manifest.describe(eb)
    opaque = path.split("/")[1] in _OPAQUE_KEYS
    if ia.type != ib.type:
        return f"type {ia.type} -> {ib.type}"
    if ia.kind == "value":
        if ea["serialized_value"] == eb["serialized_value"]:
            return None
        return "differs" if opaque else f"{_shown(ia.value)} -> {_shown(ib.value)}"
    if ia.kind in ("tensor", "sharded") and ia.dtype != ib.dtype:
        return f"dtype {ia.dtype} -> {ib.dtype}"
    if ia.kind in ("tensor", "sharded") and ia.shape != ib.shape:
        return f"shape {ia.shape} -> {ib.shape}"
    raw_a, raw_b = side_a.payloads.of(ea), side_b.payloads.of(eb)
    if raw_a is not None and raw_a == raw_b:
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


def _describe(entry: dict) -> str:
    info = manifest.describe(entry)
    if info.kind == "value":
        return f"{info.type} {_shown(info.value)}"
    if info.kind in ("tensor", "sharded"):
        return f"{info.dtype} {info.shape}"
    return str(info.dtype or info.type)


def require_metadata(store: Store, name: str) -> Metadata:
    return checked_metadata(store, name)[0]


def checked_metadata(store: Store, name: str) -> tuple[Metadata, Optional[dict[str, Any]]]:
    """The validated metadata of snapshot ``name`` and its checked index (None for a snapshot
    the plugin did not write), as restore reads them: the metadata checked against the index's
    checksum where it has one. SnapshotCorruptError (exit status 2) if either is damaged."""
    files, _ = snapshot_files(store, name)
    if METADATA_FNAME not in files:
        raise UsageProblem(
            f"{store.child(name)} is not a complete snapshot (it holds no {METADATA_FNAME}: an "
            "interrupted write, or not a snapshot)"
        )
    index, problem = listing.checked_index(store, name, parts=True)
    if problem is not None:
        raise SnapshotCorruptError(f"{store.child(name)}: {problem}; the snapshot is damaged")
    data = store.read_file(name, METADATA_FNAME)
    if index is not None:
        from tnt_snapshot_plugin.format.checksums import check_file

        check_file(store.child(name), METADATA_FNAME, index, data)
    return manifest.parse_metadata(data, store.child(name)), index


def weight_keys(metadata: Metadata) -> list[str]:
    """Top-level keys of rank 0 whose leaf entries are all tensors (a module's state dict)."""
    kinds: dict[str, set[str]] = {}
    for path, entry in metadata.manifest.items():
        parts = path.split("/")
        if parts[0] != "0":
            continue
        etype = entry["type"]
        if etype in manifest.CONTAINER_TYPES:
            kinds.setdefault(parts[1], set())
            continue
        kinds.setdefault(parts[1], set()).add("tensor" if etype in manifest.TENSOR_TYPES else "other")
    return sorted(k for k, found in kinds.items() if found == {"tensor"} and k not in RESERVED)


def load_entry(store: Store, name: str, key: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """Top-level entry ``key`` of a snapshot as plain data (restored into a ``Value`` holder)."""
    from tnt_snapshot_plugin.format.files import SnapshotFiles
    from tnt_snapshot_plugin.format.torchsnapshot import reader as fmt

    files = SnapshotFiles.open(store, name, store.child(name))
    meta = manifest.parse_metadata(files.read_checked(METADATA_FNAME), store.child(name))
    return fmt.read_state_dict(
        manifest.rank_view(meta, 0), key, None, files.read_into, file_size=files.file_size, verifier=files.verifier
    )


def tensor_leaves(obj: Any, prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """The leaves of nested dicts/lists/tuples: the tensors as {"a.b.0": tensor}, and the paths
    of the other values (numbers, strings, objects)."""
    import torch

    tensors: dict[str, Any] = {}
    others: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
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


def tensor_keys(metadata: Metadata) -> list[str]:
    """Top-level keys of rank 0 holding at least one tensor (the reserved ones left out)."""
    return sorted({
        path.split("/")[1]
        for path, entry in metadata.manifest.items()
        if path.startswith("0/") and entry["type"] in manifest.TENSOR_TYPES | manifest.SHARDED_TYPES
    } - set(RESERVED))
