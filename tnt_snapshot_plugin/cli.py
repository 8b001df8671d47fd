"""The ``tnt-snapshot`` command: list, inspect, verify, prune, diff and export snapshots.

Installed with the ``cli`` extra (``pip install 'tnt-snapshot-plugin[cli]'``: click and rich), and
imported only by the console script: the rest of the package never imports this module.

Every command takes a local path, a ``file://`` URL or an ``s3://`` URL. For S3 the connection
comes from ``--endpoint-url`` / ``--region`` and from the environment variables boto3 reads
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, ...).

Exit status: 0 success; 1 something was found damaged or different (``verify``, ``diff``), or a
command refused or failed to act (``prune``); 2 bad input (an unknown option, a path that is not
what the command needs). Errors are one line on stderr.

``ls``, ``inspect`` and ``verify`` read the snapshots' metadata as JSON (YAML for older
torchsnapshot versions) and never import torch; ``diff`` and ``export`` load entries with the
plugin's reader (``format/reader.py``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import click
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.table import Table
from rich.text import Text

from . import retention, verify
from .errors import ConfigError, SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from .format import manifest
from .format.manifest import Metadata
from .naming import SnapshotName, is_staging_name
from .stores import INDEX_FNAME, LEASE_FNAME, LOCK_FNAME, METADATA_FNAME, LocalStore, Store, open_store
from .stores.s3 import S3Store

#: Bumped when a key of the ``--json`` output changes meaning or goes away (keys may be added).
JSON_VERSION = 1

#: The plugin's reserved entries (app_state.RESERVED_KEYS; not imported: that module imports torch).
_RESERVED = ("rng_state", "train_dataloader")

STATUS_COMPLETE = "complete"
STATUS_DAMAGED = "damaged"
STATUS_INCOMPLETE = "incomplete"
STATUS_STAGING = "staging leftover"
STATUS_FOREIGN = "foreign"
STATUS_LOCK = "lock"
_STATUS_STYLE = {
    STATUS_LOCK: "cyan",
    STATUS_COMPLETE: "green",
    STATUS_DAMAGED: "bold red",
    STATUS_INCOMPLETE: "yellow",
    STATUS_STAGING: "yellow",
    STATUS_FOREIGN: "dim",
}


class UsageProblem(click.UsageError):
    """Bad input found after parsing (a path that is not what the command needs): exit 2."""


# --------------------------------------------------------------------------------------------
# What a snapshot directory holds (no torch import below this line until "Loading entries").


@dataclass
class FileInfo:
    size: int
    mtime: float


@dataclass
class Listing:
    """Every object under a directory: subdirectories' files, top-level files, symlinks."""

    dirs: dict[str, dict[str, FileInfo]] = field(default_factory=dict)
    dir_mtimes: dict[str, float] = field(default_factory=dict)
    files: dict[str, FileInfo] = field(default_factory=dict)
    links: set[str] = field(default_factory=set)


def _walk_local(path: str) -> tuple[dict[str, FileInfo], float]:
    """Files below ``path`` (relative, '/'-separated) and the newest mtime; links not followed."""
    found: dict[str, FileInfo] = {}
    newest = os.lstat(path).st_mtime
    for parent, dirs, names in os.walk(path, followlinks=False):
        for d in dirs:
            newest = max(newest, os.lstat(os.path.join(parent, d)).st_mtime)
        for n in names:
            st = os.lstat(os.path.join(parent, n))
            rel = os.path.relpath(os.path.join(parent, n), path).replace(os.sep, "/")
            found[rel] = FileInfo(st.st_size, st.st_mtime)
            newest = max(newest, st.st_mtime)
    return found, newest


def list_directory(store: Store) -> Listing:
    """One pass over ``store``'s directory (one paginated listing on S3)."""
    out = Listing()
    if isinstance(store, LocalStore):
        if not os.path.lexists(store.root):
            raise SnapshotNotFoundError(f"{store.url} does not exist")
        if not os.path.isdir(store.root):
            raise UsageProblem(f"{store.url} is a file, not a directory of snapshots")
        with os.scandir(store.root) as entries:
            for e in entries:
                if e.is_symlink():
                    out.links.add(e.name)
                elif e.is_dir(follow_symlinks=False):
                    out.dirs[e.name], out.dir_mtimes[e.name] = _walk_local(e.path)
                else:
                    st = e.stat(follow_symlinks=False)
                    out.files[e.name] = FileInfo(st.st_size, st.st_mtime)
        return out
    if isinstance(store, S3Store):
        prefix = store.prefix.rstrip("/") + "/" if store.prefix else ""
        for key, info in _s3_objects(store, prefix):
            rel = key[len(prefix):]
            top, sep, rest = rel.partition("/")
            if not sep:
                out.files[top] = info
            elif rest:
                out.dirs.setdefault(top, {})[rest] = info
                out.dir_mtimes[top] = max(out.dir_mtimes.get(top, 0.0), info.mtime)
        return out
    raise ConfigError(f"cannot list {store.url}: unsupported store {type(store).__name__}")


def _s3_objects(store: S3Store, prefix: str) -> Iterator[tuple[str, FileInfo]]:
    for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            yield obj["Key"], FileInfo(int(obj["Size"]), obj["LastModified"].timestamp())


def snapshot_files(store: Store, name: str) -> tuple[dict[str, FileInfo], float]:
    """The files of one child directory of ``store`` and their newest mtime."""
    if isinstance(store, LocalStore):
        path = os.path.join(store.root, name)
        if os.path.islink(path):
            raise UsageProblem(f"{store.child(name)} is a symlink; tnt-snapshot does not follow symlinks")
        if not os.path.isdir(path):
            if os.path.exists(path):
                raise UsageProblem(f"{store.child(name)} is a file, not a snapshot directory")
            raise SnapshotNotFoundError(f"{store.child(name)} does not exist")
        return _walk_local(path)
    assert isinstance(store, S3Store)
    prefix = store._key(name) + "/"
    files = {key[len(prefix):]: info for key, info in _s3_objects(store, prefix)}
    if not files:
        raise SnapshotNotFoundError(f"{store.child(name)} does not exist (no objects under it)")
    return files, max(i.mtime for i in files.values())


@dataclass
class SnapshotInfo:
    """One child of a snapshot directory, as ``ls`` and ``verify`` see it."""

    name: str
    kind: str  # "snapshot", "staging", "lock" (the plugin's lock or lease file), "foreign"
    status: str
    parsed: Optional[SnapshotName] = None
    files: dict[str, FileInfo] = field(default_factory=dict)
    modified_at: Optional[float] = None
    #: ``verify.check``'s verdict (committed snapshots only)
    verdict: Optional[verify.Verdict] = None
    problems: list[str] = field(default_factory=list)
    note: str = ""
    restore: bool = False
    #: whether the payloads' checksums were compared (``verify``, and ``ls``'s pick)
    checksummed: bool = False

    @property
    def index(self) -> Optional[dict[str, Any]]:
        return self.verdict.index if self.verdict is not None else None

    @property
    def metadata(self) -> Optional[Metadata]:
        return self.verdict.metadata if self.verdict is not None else None

    @property
    def writer(self) -> Optional[str]:
        if self.index is not None or self.kind == "lock" or (self.verdict is not None and self.verdict.index_problem):
            return "tnt_snapshot_plugin"
        if self.parsed is not None and self.parsed.phase_aware:
            return "torchtnt"
        return None

    @property
    def world_size(self) -> Optional[int]:
        if self.index is not None and type(self.index.get("world_size")) is int:
            return int(self.index["world_size"])
        return self.metadata.world_size if self.metadata is not None else None

    @property
    def committed_at(self) -> Optional[float]:
        value = (self.index or {}).get("committed_at")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        meta = self.files.get(METADATA_FNAME)
        return meta.mtime if meta is not None and self.kind == "snapshot" else None

    @property
    def seq(self) -> Optional[int]:
        value = (self.index or {}).get("seq")
        return value if type(value) is int else None

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        p = self.parsed
        return {
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "writer": self.writer,
            "epoch": p.epoch if p else None,
            "step": p.step if p else None,
            "eval_step": p.eval_step if p else None,
            "metric": {"name": p.metric, "value": p.metric_value} if p and p.metric else None,
            "world_size": self.world_size,
            "bytes": self.nbytes,
            "files": len(self.files),
            "committed_at": self.committed_at,
            "modified_at": self.modified_at,
            "seq": self.seq,
            "written_by": (self.index or {}).get("writer"),  # {"host", "pid", "run_id"} when recorded
            "restore": self.restore,
            "checksums_checked": self.checksummed,
            "problems": list(self.problems),
            "note": self.note,
        }


def check_snapshot(
    store: Store,
    name: str,
    files: dict[str, FileInfo],
    *,
    checksums: bool = False,
    progress: Optional[Callable[[int], None]] = None,
) -> verify.Verdict:
    """``verify.check`` of a committed snapshot, with the sizes of ``files`` (one listing)."""
    return verify.check(
        store, name, sizes={rel: f.size for rel, f in files.items()}, checksums=checksums, progress=progress
    )


def _listed(info: SnapshotInfo) -> retention.Listed:
    """What the core's retention knows of ``info`` (its name and index)."""
    assert info.parsed is not None
    if info.verdict is not None and info.verdict.index_problem is not None:
        return retention.Listed(info.parsed, problem=info.verdict.index_problem)
    return retention.from_index(info.parsed, None if info.parsed.phase_aware else info.index)


def commit_order(infos: Iterable[SnapshotInfo]) -> list[SnapshotInfo]:
    """Oldest first, in the core's commit order (``retention.commit_order``, which
    ``Store.listed()`` and ``restore_from_latest`` use)."""
    by_name = {i.name: i for i in infos if i.parsed is not None}
    return [by_name[r.text] for r in retention.commit_order(_listed(i) for i in by_name.values())]


def survey(store: Store, *, checksums: bool = False, progress: Optional[Callable[[int], None]] = None) -> list[SnapshotInfo]:
    """Every child of the snapshot directory, classified: snapshots oldest first, then staging
    leftovers, then foreign entries. The snapshot ``restore_from_latest`` would restore is marked
    (``restore_pick``)."""
    listing = list_directory(store)
    snapshots: list[SnapshotInfo] = []
    staging: list[SnapshotInfo] = []
    foreign: list[SnapshotInfo] = []
    for name in sorted(listing.links):
        foreign.append(SnapshotInfo(name, "foreign", STATUS_FOREIGN, note="symlink (never followed)"))
    plugin_files: list[SnapshotInfo] = []
    for name, info in sorted(listing.files.items()):
        if name in (LOCK_FNAME, LEASE_FNAME):
            plugin_files.append(
                SnapshotInfo(name, "lock", STATUS_LOCK, files={"": info}, modified_at=info.mtime,
                             note=_lock_note(store, name))
            )
            continue
        foreign.append(
            SnapshotInfo(name, "foreign", STATUS_FOREIGN, files={"": info}, modified_at=info.mtime, note="file")
        )
    for name, files in sorted(listing.dirs.items()):
        modified = listing.dir_mtimes.get(name)
        parsed = SnapshotName.parse(name)
        if is_staging_name(name):
            staging.append(
                SnapshotInfo(name, "staging", STATUS_STAGING, files=files, modified_at=modified,
                             note="an interrupted write, or one in progress")
            )
        elif parsed is None:
            foreign.append(SnapshotInfo(name, "foreign", STATUS_FOREIGN, files=files, modified_at=modified, note="directory"))
        elif METADATA_FNAME not in files:
            snapshots.append(
                SnapshotInfo(name, "snapshot", STATUS_INCOMPLETE, parsed=parsed, files=files, modified_at=modified,
                             note=f"no {METADATA_FNAME}: an interrupted write, or one in progress")
            )
        else:
            verdict = check_snapshot(store, name, files, checksums=checksums, progress=progress)
            snapshots.append(
                SnapshotInfo(name, "snapshot", STATUS_COMPLETE if verdict.intact else STATUS_DAMAGED, parsed=parsed,
                             files=files, modified_at=modified, verdict=verdict, problems=list(verdict.problems),
                             note="; ".join(verdict.notes), checksummed=checksums)
            )
    pick = restore_pick(store, snapshots, progress=progress)
    if pick is not None:
        pick.restore = True
    # Committed snapshots in commit order; then those never committed (no metadata), by progress.
    committed = [i for i in snapshots if i.status != STATUS_INCOMPLETE]
    never = sorted((i for i in snapshots if i.status == STATUS_INCOMPLETE), key=lambda i: i.parsed.sort_key)  # type: ignore[union-attr]
    return commit_order(committed) + never + staging + plugin_files + foreign


def _lock_note(store: Store, name: str) -> str:
    """What a lock or lease file says of its holder (it is the plugin's; never touched)."""
    what = "the dirpath lock of a saver's run" if name == LOCK_FNAME else "the dirpath lease of a saver's run (S3)"
    holder = _lock_holder(store, name)
    if holder is not None:
        what += f", held by host {holder.get('host')} pid {holder.get('pid')} run {holder.get('run_id')}"
    return what + " (the plugin's own; a leftover of a killed run is harmless)"


def _lock_holder(store: Store, name: str) -> Optional[dict[str, Any]]:
    try:
        holder = json.loads(store.read_file("", name) or b"null")
    except (OSError, ValueError, RecursionError, SnapshotError):
        return None
    return holder if isinstance(holder, dict) and holder.get("host") is not None else None


def restore_pick(
    store: Store, snapshots: list[SnapshotInfo], *, progress: Optional[Callable[[int], None]] = None
) -> Optional[SnapshotInfo]:
    """The snapshot ``restore_from_latest`` restores: the newest in commit order that
    ``verify.check`` finds intact and whose payloads match their checksums (restore verifies
    every byte it reads, and falls back from a snapshot that does not). A snapshot found damaged
    on the way is marked so."""
    candidates = commit_order(s for s in snapshots if s.status in (STATUS_COMPLETE, STATUS_DAMAGED))
    for info in reversed(candidates):
        if info.status != STATUS_COMPLETE:
            continue
        if not info.checksummed:
            assert info.verdict is not None
            verify.check_payloads(store, info.verdict, progress)
            info.checksummed = True
            if not info.verdict.intact:
                info.status = STATUS_DAMAGED
                info.problems = list(info.verdict.problems)
                continue
        return info
    return None


# --------------------------------------------------------------------------------------------
# prune: what to delete (the rules of the saver's retention).


@dataclass(frozen=True)
class PruneCandidate:
    """What prune's selection knows of one snapshot-named entry."""

    name: SnapshotName
    #: written by this plugin: its naming (not torchtnt's) and its index
    ours: bool
    #: has ``.snapshot_metadata``
    complete: bool
    #: the index's commit sequence number, when it records one
    seq: Optional[int] = None
    #: the value of the ``--keep-best`` metric (name suffix or the index's ``metric``), if any
    metric: Optional[float] = None


def select_for_pruning(
    candidates: list[PruneCandidate],
    *,
    keep_last: int,
    keep_best: Optional[str] = None,
    mode: str = "min",
    protect: Iterable[str] = (),
) -> dict[str, Optional[str]]:
    """Name -> None (delete) or the reason it is kept: the saver's own retention
    (``retention.to_delete``), so prune deletes exactly what the saver would.

    * only the plugin's own complete snapshots are counted and deleted; anything without the
      plugin's index (torchtnt's, a user's, an interrupted write) is kept;
    * commit order: the core's (``retention.commit_order``: the index's ``seq``; snapshots
      without one first, by (epoch, step));
    * ``keep_last`` newest are kept; with ``keep_best``, the ``keep_last`` best by that metric
      instead (``mode`` "min" or "max"; NaN worst; ties to the earlier commit; snapshots without a
      value for it are kept), as the saver's best-k (``retention.Best``) with that k;
    * the newest complete snapshot, and every name in ``protect``, are always kept.
    """
    if keep_last < 1:
        raise ConfigError(f"--keep-last must be >= 1, got {keep_last}")
    if mode not in ("min", "max"):
        raise ConfigError(f"--mode must be 'min' or 'max', got {mode!r}")
    verdict: dict[str, Optional[str]] = {}
    listed: list[retention.Listed] = []
    for c in candidates:
        if not c.complete:
            verdict[c.name.text] = "incomplete (no .snapshot_metadata): not pruned"
            continue
        if not c.ours:
            verdict[c.name.text] = (
                "written by torchtnt's saver" if c.name.phase_aware else f"no {INDEX_FNAME}: not written by this plugin"
            )
        metric = (keep_best, c.metric) if keep_best is not None and c.metric is not None else None
        listed.append(retention.Listed(c.name, seq=c.seq, ours=c.ours, indexed_metric=metric))
    best = retention.Best(keep_best, mode, keep_last) if keep_best is not None else None
    doomed = {
        r.text
        for r in retention.to_delete(
            listed, None if best is not None else keep_last, protect=protect, best=best
        )
    }
    ordered = retention.commit_order(listed)
    ours = [r for r in ordered if r.ours]
    newest = ordered[-1].text if ordered else None
    if best is None:
        reasons = {r.text: f"one of the last {keep_last}" for r in ours[-keep_last:]}
    else:
        top = retention.ranked(ours, keep_best, mode)[:keep_last]  # type: ignore[arg-type]
        reasons = {
            r.text: f"one of the {keep_last} best by {keep_best} ({r.metric_value(keep_best):g})"  # type: ignore[arg-type]
            for r in top
        }
    protected = set(protect)
    for r in ours:
        if r.text in doomed:
            verdict[r.text] = None
        elif r.text in reasons:
            verdict[r.text] = reasons[r.text]
        elif r.text == newest:
            verdict[r.text] = "the newest complete snapshot"
        elif r.text in protected:
            verdict[r.text] = "the snapshot restore_from_latest would restore"
        elif keep_best is not None and r.metric_value(keep_best) is None:
            verdict[r.text] = f"no value for {keep_best}"
        else:
            verdict[r.text] = "kept by the saver's retention rules"
    return {c.name.text: verdict[c.name.text] for c in candidates}


def _metric_value(info: SnapshotInfo, metric: str) -> Optional[float]:
    p = info.parsed
    if p is not None and p.metric == metric and p.metric_value is not None:
        return p.metric_value
    record = (info.index or {}).get("metric")
    if isinstance(record, dict) and record.get("name") == metric and isinstance(record.get("value"), (int, float)):
        return float(record["value"])
    return None


# --------------------------------------------------------------------------------------------
# Manifest entries (format.manifest, the one reader restore uses too).


def entry_rows(metadata: Metadata, files: dict[str, FileInfo]) -> list[dict[str, Any]]:
    """One row per leaf entry of the manifest (containers skipped), sorted by path."""
    rows = []
    containers = manifest.CONTAINER_TYPES
    for path in sorted(metadata.manifest):
        entry = metadata.manifest[path]
        kind = entry["type"]
        if kind in containers:
            continue
        rank, _, logical = path.partition("/")
        byte_range = entry.get("byte_range")
        if kind == "Tensor" and byte_range is not None:  # most entries, without an EntryInfo
            rows.append({
                "path": path, "rank": int(rank), "key": logical, "kind": "tensor", "type": kind,
                "dtype": entry["dtype"][6:], "shape": entry["shape"], "bytes": byte_range[1] - byte_range[0],
                "replicated": entry.get("replicated") is True,
            })
            continue
        info = manifest.describe(entry)
        nbytes = info.nbytes
        if nbytes is None:
            nbytes = sum(
                (r[1] - r[0]) if r is not None else (files[rel].size if rel in files else 0)
                for rel, r in info.locations
            )
        row: dict[str, Any] = {
            "path": path, "rank": int(rank), "key": logical, "kind": info.kind, "type": info.type,
            "dtype": info.dtype, "shape": info.shape, "bytes": nbytes,
            "replicated": entry.get("replicated") is True,
        }
        if info.kind == "value":
            value = info.value
            row["value"] = f"<{len(value)} bytes>" if isinstance(value, bytes) else value
        rows.append(row)
    return rows


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


def _summary_lines(summary: dict[str, Any]) -> list[str]:
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


def _read_value(store: Store, name: str, view: dict[str, dict], path: str) -> Any:
    """The value of manifest entry ``path`` (``RANK/KEY/...``) of snapshot ``name``."""
    from .format import reader as fmt
    from .restoring import reading_io

    read_into, file_size, verifier = reading_io(store, name, store.child(name))
    return fmt.read_value(view, path, read_into, file_size=file_size, verifier=verifier)


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


def diff_snapshots(
    a: tuple[Store, str], b: tuple[Store, str], storage_options: Optional[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """(differences, number of entries compared) between two snapshots' leaf entries."""
    (store_a, name_a), (store_b, name_b) = a, b
    meta_a = _require_metadata(store_a, name_a)
    meta_b = _require_metadata(store_b, name_b)
    man_a = {p: e for p, e in meta_a.manifest.items() if e["type"] not in manifest.CONTAINER_TYPES}
    man_b = {p: e for p, e in meta_b.manifest.items() if e["type"] not in manifest.CONTAINER_TYPES}
    diffs: list[dict[str, Any]] = []
    bytes_a, bytes_b = _Payloads(store_a, name_a), _Payloads(store_b, name_b)
    sharded_seen: set[str] = set()  # logical paths of sharded entries compared (under any rank)

    def read(side: str, path: str) -> Any:
        if side == "a":
            return _read_value(store_a, name_a, meta_a.manifest, path)
        return _read_value(store_b, name_b, meta_b.manifest, path)

    for path in sorted(set(man_a) | set(man_b)):
        ea, eb = man_a.get(path), man_b.get(path)
        if eb is None:
            diffs.append({"path": path, "change": "removed", "detail": _describe(ea)})
            continue
        if ea is None:
            diffs.append({"path": path, "change": "added", "detail": _describe(eb)})
            continue
        ia, ib = manifest.describe(ea), manifest.describe(eb)
        opaque = path.split("/")[1] in _OPAQUE_KEYS
        if ia.type != ib.type:
            diffs.append({"path": path, "change": "changed", "detail": f"type {ia.type} -> {ib.type}"})
        elif ia.kind == "value":
            if ea["serialized_value"] != eb["serialized_value"]:
                detail = "differs" if opaque else f"{_shown(ia.value)} -> {_shown(ib.value)}"
                diffs.append({"path": path, "change": "changed", "detail": detail})
        elif ia.kind in ("tensor", "sharded"):
            if ia.dtype != ib.dtype:
                diffs.append({"path": path, "change": "changed", "detail": f"dtype {ia.dtype} -> {ib.dtype}"})
            elif ia.shape != ib.shape:
                diffs.append({"path": path, "change": "changed", "detail": f"shape {ia.shape} -> {ib.shape}"})
            else:
                raw_a, raw_b = bytes_a.of(ea), bytes_b.of(eb)
                if raw_a is not None and raw_a == raw_b:
                    continue
                if ia.kind == "sharded":
                    # read whole (every rank's shards), once for all the ranks that record it
                    logical = path.split("/", 1)[-1]
                    if logical in sharded_seen:
                        continue
                    sharded_seen.add(logical)
                ra, rb = read("a", path), read("b", path)
                if ra.equal(rb) if ra.dtype == rb.dtype else False:
                    continue
                detail = "differs" if opaque else _max_abs_diff(ra, rb)
                diffs.append({"path": path, "change": "changed", "detail": detail})
        else:
            raw_a, raw_b = bytes_a.of(ea), bytes_b.of(eb)
            if raw_a is not None and raw_a == raw_b:
                continue
            try:
                same = bool(read("a", path) == read("b", path))
            except SnapshotError:
                raise
            except Exception:  # objects without a usable ==: their stored bytes differ
                same = False
            if not same:
                diffs.append({"path": path, "change": "changed", "detail": "differs"})
    return diffs, len(set(man_a) | set(man_b))


def _shown(value: Any) -> str:
    return f"<{len(value)} bytes>" if isinstance(value, bytes) else repr(value)


def _describe(entry: dict) -> str:
    info = manifest.describe(entry)
    if info.kind == "value":
        return f"{info.type} {_shown(info.value)}"
    if info.kind in ("tensor", "sharded"):
        return f"{info.dtype} {info.shape}"
    return str(info.dtype or info.type)


def _require_metadata(store: Store, name: str) -> Metadata:
    return _checked_metadata(store, name)[0]


def _checked_metadata(store: Store, name: str) -> tuple[Metadata, Optional[dict[str, Any]]]:
    """The validated metadata of snapshot ``name`` and its checked index (None for a snapshot
    the plugin did not write), as restore reads them: the metadata checked against the index's
    checksum where it has one. SnapshotCorruptError (exit status 2) if either is damaged."""
    files, _ = snapshot_files(store, name)
    if METADATA_FNAME not in files:
        raise UsageProblem(
            f"{store.child(name)} is not a complete snapshot (it holds no {METADATA_FNAME}: an "
            "interrupted write, or not a snapshot)"
        )
    index, problem = store.checked_index(name)
    if problem is not None:
        raise SnapshotCorruptError(f"{store.child(name)}: {problem}; the snapshot is damaged")
    data = store.read_file(name, METADATA_FNAME)
    if index is not None:
        from .checksums import check_file

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
    return sorted(k for k, found in kinds.items() if found == {"tensor"} and k not in _RESERVED)


def load_entry(store: Store, name: str, key: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """Top-level entry ``key`` of a snapshot as plain data (restored into a ``Value`` holder)."""
    from .format import reader as fmt
    from .restoring import read_metadata, reading_io

    read_into, file_size, verifier = reading_io(store, name, store.child(name))
    meta = manifest.parse_metadata(read_metadata(store, name, verifier), store.child(name))
    return fmt.read_state_dict(
        manifest.rank_view(meta, 0), key, None, read_into, file_size=file_size, verifier=verifier
    )


def flatten_tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/lists of tensors as {"a.b.0": tensor}; ValueError naming a non-tensor."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        raise ValueError(f"{prefix or 'the entry'} is a {type(obj).__name__}, not a tensor")
    return out


# --------------------------------------------------------------------------------------------
# The command line.


def _opts(endpoint_url: Optional[str], region: Optional[str]) -> Optional[dict[str, Any]]:
    opts = {k: v for k, v in (("endpoint_url", endpoint_url), ("region_name", region)) if v}
    return opts or None


def _open(target: str, storage_options: Optional[dict[str, Any]], what: str = "directory") -> Store:
    try:
        return open_store(target, storage_options if target.startswith("s3://") else None)
    except ConfigError as exc:
        raise UsageProblem(str(exc)) from None


def _split(target: str, storage_options: Optional[dict[str, Any]]) -> tuple[Store, str]:
    text = target.rstrip("/")
    if text.endswith("/" + METADATA_FNAME):
        text = text[: -len(METADATA_FNAME) - 1]
    head, sep, name = text.rpartition("/")
    if not name or name in (".", ".."):
        raise UsageProblem(f"{target!r} does not name a snapshot (expected DIRPATH/epoch_E_step_S)")
    if not sep:
        head = "."
    elif not head or head.endswith(":/"):
        raise UsageProblem(f"{target!r} names a bucket or root, not a snapshot")
    return _open(head, storage_options), name


def _console(err: bool = False) -> Console:
    stream = sys.stderr if err else sys.stdout
    tty = stream.isatty()
    # markup and emoji off: text from a snapshot is printed as it is (escaped by ``safe``)
    return Console(file=stream, highlight=False, markup=False, emoji=False,
                   width=None if tty else 200, soft_wrap=not tty)


#: Characters never printed as they are: C0 and C1 controls, DEL, and the bidirectional
#: overrides and isolates that reorder what a terminal shows.
_UNSAFE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_UNSAFE.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def safe(text: Any) -> str:
    """``text`` as one printable line: control characters (a snapshot's keys and names may hold
    escape sequences) written as ``\\xNN``."""
    text = str(text)
    return text if text.isprintable() else text.translate(_UNSAFE)


class _Table:
    """Rows of cells printed as aligned columns; every cell escaped by :func:`safe`. On a
    terminal a cell may be a rich ``Text`` (a coloured status); elsewhere, and for many rows,
    plain text without trailing spaces."""

    def __init__(self, *columns: str, right: Iterable[str] = ()) -> None:
        self.columns = columns
        self.right = set(right)
        self.rows: list[tuple[Any, ...]] = []

    def add_row(self, *cells: Any) -> None:
        self.rows.append(tuple(
            c if (type(c) is str and c.isprintable()) or isinstance(c, Text) else safe(c) for c in cells
        ))


def _table(*columns: str, right: Iterable[str] = ()) -> _Table:
    return _Table(*columns, right=right)


def _print_table(out: Console, table: _Table) -> None:
    if out.is_terminal and len(table.rows) <= 2000:
        rich_table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
        for col in table.columns:
            rich_table.add_column(col, justify="right" if col in table.right else "left", no_wrap=True)
        for row in table.rows:
            rich_table.add_row(*(c if isinstance(c, Text) else Text(c) for c in row))
        out.print(rich_table)
        return
    rows = [table.columns, *(
        [c.plain if isinstance(c, Text) else c for c in row] if any(type(c) is not str for c in row) else row
        for row in table.rows
    )]
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    line = "  ".join(
        f"{{:{'>' if col in table.right else '<'}{w}}}" for col, w in zip(table.columns, widths, strict=True)
    ).format
    out.file.write("".join([line(*row).rstrip() + "\n" for row in rows]))


def _say(out: Console, text: Any, style: Optional[str] = None) -> None:
    """Print one line (escaped by :func:`safe`)."""
    out.print(Text(safe(text), style=style or ""))


def _when(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts is not None else "-"


def _num(v: Any) -> str:
    return "-" if v is None else str(v)


def _emit_json(payload: dict[str, Any]) -> None:
    click.echo(json.dumps({"version": JSON_VERSION, **payload}, indent=2, sort_keys=False))


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(body) * units[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 90, 90s, 15m, 2h)") from None
    if value < 0 or math.isnan(value):
        raise click.BadParameter(f"{text!r}: a duration must be >= 0")
    return value


def _s3_flags(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--region", default=None, help="S3 region (else AWS_REGION / AWS_DEFAULT_REGION).")(f)
    f = click.option(
        "--endpoint-url", default=None, help="S3 endpoint (else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)."
    )(f)
    return f


_json_flag = click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable keys).")


class _Cli(click.Group):
    """Errors as one line on stderr: exit 2 for bad input, 1 for a failure."""

    def main(self, args: Any = None, prog_name: Optional[str] = None, complete_var: Optional[str] = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        prog = prog_name or "tnt-snapshot"
        try:
            rv = super().main(args, prog, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:  # bare "tnt-snapshot"
                click.echo(exc.ctx.get_help(), err=True)
                code = 2
                if standalone_mode:
                    sys.exit(code)
                return code
            hint = (
                f" (see '{exc.ctx.command_path} --help')"
                if exc.ctx is not None and not isinstance(exc, UsageProblem)
                else ""
            )
            code = _fail(prog, exc.format_message() + hint, 2)
        except click.ClickException as exc:
            code = _fail(prog, exc.format_message(), exc.exit_code)
        except click.Abort:
            code = _fail(prog, "aborted", 1)
        except (ConfigError, SnapshotNotFoundError, SnapshotCorruptError) as exc:
            code = _fail(prog, str(exc), 2)
        except (SnapshotError, OSError) as exc:
            code = _fail(prog, str(exc), 1)
        except Exception as exc:
            if not type(exc).__module__.startswith(("botocore", "boto3")):
                raise
            code = _fail(prog, f"S3: {exc}", 1)
        if standalone_mode:
            sys.exit(code)
        return code


def _fail(prog: str, message: str, code: int) -> int:
    first = " ".join(message.split())
    click.echo(f"{prog}: error: {safe(first)}", err=True)
    return code


@click.group(name="tnt-snapshot", cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Look at tnt_snapshot_plugin snapshot directories: local paths, file:// or s3:// URLs."""


@cli.command("ls")
@click.argument("dirpath")
@_json_flag
@_s3_flags
def ls_command(dirpath: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """One row per entry of DIRPATH, oldest snapshot first.

    Status: complete, damaged (its index, a file or the metadata missing, of the wrong size or
    unreadable; or, for the snapshot restore would pick, a payload that differs from its
    checksum), incomplete (no .snapshot_metadata), staging leftover, or foreign (not a
    snapshot: never touched). '*' marks the snapshot restore_from_latest would restore: the same
    check decides both.
    """
    store = _open(dirpath, _opts(endpoint_url, region))
    infos = survey(store)
    if as_json:
        pick = next((i.name for i in infos if i.restore), None)
        _emit_json({"dirpath": store.url, "restore": pick, "entries": [i.to_json() for i in infos]})
        return 0
    out = _console()
    table = _table("NAME", "EPOCH", "STEP", "WORLD", "SIZE", "FILES", "COMMITTED", "STATUS",
                   right=("EPOCH", "STEP", "WORLD", "SIZE", "FILES"))
    for i in infos:
        p = i.parsed
        status = Text(i.status, style=_STATUS_STYLE[i.status])
        if i.restore:
            status.append(" *", style="bold")
        size = human_size(i.nbytes) if i.kind != "foreign" or i.files else "-"
        table.add_row(
            i.name, _num(p.epoch if p else None), _num(p.step if p else None), _num(i.world_size),
            size, str(len(i.files)) if i.kind != "foreign" or i.files else "-",
            _when(i.committed_at) if i.kind == "snapshot" and i.status != STATUS_INCOMPLETE else "-",
            status,
        )
    _print_table(out, table)
    for i in infos:
        for problem in i.problems:
            _say(out, f"{i.name}: {problem}", style="red")
    counts: dict[str, int] = {}
    for i in infos:
        counts[i.status] = counts.get(i.status, 0) + 1
    total = sum(i.nbytes for i in infos if i.kind == "snapshot")
    parts = [f"{n} {s}" for s, n in counts.items()]
    pick = next((i.name for i in infos if i.restore), None)
    _say(out, f"{', '.join(parts) or 'empty'}; {human_size(total)} in snapshots")
    _say(out, f"* restore_from_latest would restore {pick}" if pick else "restore_from_latest would find nothing to restore")
    return 0


@cli.command("inspect")
@click.argument("snapshot")
@_json_flag
@_s3_flags
def inspect_command(snapshot: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Every entry of SNAPSHOT: key path, kind, dtype, shape, bytes, replicated."""
    store, name = _split(snapshot, _opts(endpoint_url, region))
    files, _ = snapshot_files(store, name)
    metadata, checked = _checked_metadata(store, name)
    index = checked or {}
    rows = entry_rows(metadata, files)
    summary = summarize(metadata)
    parsed = SnapshotName.parse(name)
    head = {
        "snapshot": store.child(name),
        "epoch": index.get("epoch", parsed.epoch if parsed else None),
        "step": index.get("step", parsed.step if parsed else None),
        "world_size": index.get("world_size", metadata.world_size),
        "bytes": sum(f.size for f in files.values()),
        "files": len(files),
        "writer": "tnt_snapshot_plugin" if INDEX_FNAME in files else ("torchtnt" if parsed and parsed.phase_aware else None),
    }
    if as_json:
        _emit_json({**head, "summary": summary, "entries": rows})
        return 0
    out = _console()
    _say(out,
         f"{head['snapshot']}: epoch {_num(head['epoch'])}, step {_num(head['step'])}, world size "
         f"{_num(head['world_size'])}, {human_size(int(head['bytes'] or 0))} in {head['files']} files")
    for line in _summary_lines(summary):
        _say(out, line)
    table = _table("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "BYTES", "REPLICATED", right=("BYTES",))
    shapes: dict[tuple[int, ...], str] = {(): "scalar"}  # a model has few distinct shapes and sizes
    sizes: dict[int, str] = {0: "-"}
    for r in rows:
        if r["shape"] is not None:
            key = tuple(r["shape"])
            shape = shapes.get(key) or shapes.setdefault(key, "x".join(map(str, key)))
        else:
            shape = "=" + repr(r["value"]) if r["kind"] == "value" else ""
        nbytes = r["bytes"]
        size = sizes.get(nbytes) or sizes.setdefault(nbytes, human_size(nbytes))
        table.add_row(r["path"], r["kind"], str(r["dtype"] or ""), shape, size, "yes" if r["replicated"] else "no")
    _print_table(out, table)
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    _say(out, f"{len(rows)} entries: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return 0


@cli.command("verify")
@click.argument("target")
@_json_flag
@_s3_flags
def verify_command(target: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Check every file of a snapshot, or of every snapshot in a directory.

    The check restore makes: the index (sealed) and the sizes it records, the metadata (as
    restore parses it) and the files it reads, and every checksum the snapshot recorded. Exit
    status 1 when anything is damaged (or a snapshot given by path is incomplete), naming each
    damaged file.
    """
    opts = _opts(endpoint_url, region)
    single = SnapshotName.parse(target.rstrip("/").rpartition("/")[2]) is not None or target.rstrip("/").endswith(METADATA_FNAME)
    if not single and "://" not in target and os.path.isfile(os.path.join(target, METADATA_FNAME)):
        single = True
    out = _console()
    err = _console(err=True)
    with _progress(err, enabled=err.is_terminal and not as_json) as advance:
        if single:
            store, name = _split(target, opts)
            files, modified = snapshot_files(store, name)
            parsed = SnapshotName.parse(name)
            if METADATA_FNAME not in files:
                info = SnapshotInfo(name, "snapshot", STATUS_INCOMPLETE, parsed=parsed, files=files, modified_at=modified,
                                    problems=[f"{METADATA_FNAME} is missing: the snapshot is incomplete"])
            else:
                verdict = check_snapshot(store, name, files, checksums=True, progress=advance)
                info = SnapshotInfo(name, "snapshot", STATUS_COMPLETE if verdict.intact else STATUS_DAMAGED,
                                    parsed=parsed, files=files, verdict=verdict, problems=list(verdict.problems),
                                    note="; ".join(verdict.notes), checksummed=True)
            infos = [info]
        else:
            store = _open(target, opts)
            infos = [i for i in survey(store, checksums=True, progress=advance) if i.kind == "snapshot"]
    bad = [i for i in infos if i.status == STATUS_DAMAGED or (single and i.status == STATUS_INCOMPLETE)]

    def checked(i: SnapshotInfo) -> str:
        if i.status == STATUS_INCOMPLETE:
            return "-"
        return "sizes+checksums" if (i.index or {}).get("checksums") else "sizes"

    if as_json:
        _emit_json({
            "target": target,
            "ok": not bad,
            "restore": next((i.name for i in infos if i.restore), None),
            "snapshots": [
                {"name": i.name, "status": i.status, "files": len(i.files), "bytes": i.nbytes,
                 "checked": checked(i), "problems": i.problems, "note": i.note}
                for i in infos
            ],
        })
        return 1 if bad else 0
    table = _table("SNAPSHOT", "FILES", "SIZE", "CHECKED", "STATUS", right=("FILES", "SIZE"))
    for i in infos:
        status = Text("intact" if i.status == STATUS_COMPLETE else i.status, style=_STATUS_STYLE[i.status])
        if i.restore:
            status.append(" *", style="bold")
        table.add_row(i.name, str(len(i.files)), human_size(i.nbytes), checked(i), status)
    _print_table(out, table)
    for i in infos:
        for problem in i.problems:
            _say(out, f"{i.name}: {problem}", style="red")
    for i in infos:
        for note in i.note.split("; ") if i.note and "checksums not recorded" not in i.note else ():
            _say(out, f"{i.name}: {note}")
    unchecked = [i.name for i in infos if "checksums not recorded" in i.note]
    if unchecked:
        _say(out, "sizes only; checksums not recorded by " + ("this snapshot" if len(infos) == 1 else f"{len(unchecked)} of these snapshots"))
    if not infos:
        _say(out, f"no snapshots in {target}")
    if not single:
        pick = next((i.name for i in infos if i.restore), None)
        _say(out, f"* restore_from_latest would restore {pick}" if pick else "restore_from_latest would find nothing to restore")
    _say(out, f"{len(bad)} damaged" if bad else "all intact")
    return 1 if bad else 0


class _progress:
    """A transient progress bar on stderr (terminals only); yields ``advance(nbytes)``."""

    def __init__(self, console: Console, *, enabled: bool) -> None:
        self.enabled = enabled
        self.console = console
        self.bar: Any = None

    def __enter__(self) -> Optional[Callable[[int], None]]:
        if not self.enabled:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.bar = Progress("verifying", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=self.console, transient=True)
        self.bar.start()
        task = self.bar.add_task("verify", total=None)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


@cli.command("prune")
@click.argument("dirpath")
@click.option("--keep-last", type=click.IntRange(min=1), required=True, help="Keep the N newest (or best) snapshots.")
@click.option("--keep-best", "keep_best", default=None, metavar="METRIC",
              help="Keep the N best by METRIC (from the name's _METRIC=value or the index) instead of the newest.")
@click.option("--mode", type=click.Choice(["min", "max"]), default=None, help="With --keep-best: lower or higher is better.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--min-staging-age", default="1h", show_default=True, metavar="DURATION",
              help="Refuse while a staging directory or incomplete snapshot is younger (a run may be writing).")
@click.option("--force", is_flag=True, help="Prune even while a live run holds DIRPATH (its lock or lease).")
@_json_flag
@_s3_flags
def prune_command(dirpath: str, keep_last: int, keep_best: Optional[str], mode: Optional[str], dry_run: bool,
                  min_staging_age: str, force: bool, as_json: bool, endpoint_url: Optional[str],
                  region: Optional[str]) -> int:
    """Delete old snapshots of DIRPATH by the saver's retention rules.

    Only snapshots this plugin wrote (with its index) are deleted, never the newest complete one
    nor the one restore_from_latest would restore; symlinks are never followed; nothing else in
    DIRPATH is touched. Refused (exit status 2, naming the holder) while a live run holds
    DIRPATH: prune takes the run's lock itself, so no run starts while it deletes. --force prunes
    without the lock.
    """
    if (keep_best is None) != (mode is None):
        raise click.UsageError("--keep-best and --mode go together")
    min_age = _duration(min_staging_age)
    store = _open(dirpath, _opts(endpoint_url, region))
    list_directory(store)  # a missing or wrong dirpath: exit 2 before any lock is taken
    lock = None
    if not force and not dry_run:
        lock = _take_lock(store)
    try:
        return _prune(store, keep_last, keep_best, mode, dry_run, min_age, as_json)
    finally:
        if lock is not None:
            lock.release()


def _take_lock(store: Store) -> Any:
    """The dirpath's lock (a saver's run takes the same), or UsageProblem naming its holder."""
    from .stores.ownership import holder_text, writer_identity

    holder = {**writer_identity("tnt-snapshot-prune"), "started_at": time.time()}
    try:
        return store.lock(holder)
    except ConfigError:
        found = _lock_holder(store, LEASE_FNAME if isinstance(store, S3Store) else LOCK_FNAME)
        raise UsageProblem(
            f"refusing to prune {store.url}: a live run holds it ({holder_text(found)}); prune once it "
            "has ended, or pass --force to prune while it runs"
        ) from None


def _prune(store: Store, keep_last: int, keep_best: Optional[str], mode: Optional[str], dry_run: bool,
           min_age: float, as_json: bool) -> int:
    infos = survey(store)
    now = time.time()
    for i in infos:
        writing = i.kind == "staging" or (
            i.kind == "snapshot" and i.status == STATUS_INCOMPLETE and i.parsed is not None and not i.parsed.phase_aware
        )
        age = now - i.modified_at if i.modified_at is not None else None
        if writing and age is not None and age < min_age:
            return _fail(
                "tnt-snapshot",
                f"refusing to prune {store.url}: {i.name} was written to {age:.0f}s ago (younger than "
                f"--min-staging-age {min_age:.0f}s), so a run may be writing; stop it, or pass a smaller "
                "--min-staging-age once no run writes here",
                1,
            )
    candidates = [
        PruneCandidate(
            name=i.parsed,
            ours=i.index is not None and not i.parsed.phase_aware,
            complete=i.status in (STATUS_COMPLETE, STATUS_DAMAGED),
            seq=i.seq,
            metric=_metric_value(i, keep_best) if keep_best else None,
        )
        for i in infos
        if i.kind == "snapshot" and i.parsed is not None
    ]
    pick = [i.name for i in infos if i.restore]
    verdict = select_for_pruning(candidates, keep_last=keep_last, keep_best=keep_best, mode=mode or "min", protect=pick)
    doomed = [name for name, reason in verdict.items() if reason is None]
    deleted: list[str] = []
    failed: list[str] = []
    if not dry_run:
        for name in doomed:
            try:
                store.remove(name)
                deleted.append(name)
            except (OSError, SnapshotError) as exc:
                failed.append(f"{name}: {exc}")
    order = [i.name for i in infos if i.name in verdict]
    if as_json:
        _emit_json({
            "dirpath": store.url,
            "dry_run": dry_run,
            "delete": doomed,
            "deleted": deleted,
            "failed": failed,
            "keep": [{"name": n, "reason": verdict[n]} for n in order if verdict[n] is not None],
            "untouched": [i.name for i in infos if i.name not in verdict],
        })
    else:
        out = _console()
        table = _table("SNAPSHOT", "ACTION", "WHY")
        sizes = {i.name: i.nbytes for i in infos}
        for name in order:
            reason = verdict[name]
            action = Text("keep", style="green") if reason is not None else Text(
                "would delete" if dry_run else ("deleted" if name in deleted else "FAILED"), style="red")
            table.add_row(name, action, reason or f"older than the kept ones ({human_size(sizes[name])})")
        _print_table(out, table)
        others = [i.name for i in infos if i.name not in verdict]
        if others:
            _say(out, f"not snapshots, left alone: {', '.join(others)}")
        freed = sum(sizes[n] for n in (doomed if dry_run else deleted))
        _say(out, f"{'would delete' if dry_run else 'deleted'} {len(doomed) if dry_run else len(deleted)} "
                  f"snapshots, {human_size(freed)}")
        for line in failed:
            _say(out, f"could not delete {line}", style="red")
    return 1 if failed else 0


@cli.command("diff")
@click.argument("a")
@click.argument("b")
@_json_flag
@_s3_flags
def diff_command(a: str, b: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Entries added, removed or changed from snapshot A to snapshot B.

    Tensors are compared by their bytes, and those that differ by max |a-b|; a sharded tensor
    (ShardedTensor, DTensor) whole, once, under the first rank that records it; opaque state (RNG
    generators, objects) as "differs". Exit status 0 when the snapshots hold the same values, 1
    when they differ.
    """
    opts = _opts(endpoint_url, region)
    diffs, compared = diff_snapshots(_split(a, opts), _split(b, opts), opts)
    if as_json:
        _emit_json({"a": a, "b": b, "entries_compared": compared, "identical": not diffs, "differences": diffs})
        return 1 if diffs else 0
    out = _console()
    if diffs:
        table = _table("KEY", "CHANGE", "DETAIL")
        style = {"added": "green", "removed": "red", "changed": "yellow"}
        for d in diffs:
            table.add_row(d["path"], Text(d["change"], style=style[d["change"]]), d["detail"])
        _print_table(out, table)
    counts: dict[str, int] = {}
    for d in diffs:
        counts[d["change"]] = counts.get(d["change"], 0) + 1
    _say(out, f"{compared} entries compared: {compared - len(diffs)} identical"
         + "".join(f", {n} {c}" for c, n in counts.items()))
    return 1 if diffs else 0


@cli.command("export")
@click.argument("snapshot")
@click.argument("out_path", metavar="OUT")
@click.option("--key", default=None, help="The entry to export (default: the one entry holding only tensors).")
@click.option("--format", "fmt", type=click.Choice(["auto", "torch", "safetensors"]), default="auto", show_default=True,
              help="auto: safetensors if OUT ends in .safetensors, else torch.save.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@_json_flag
@_s3_flags
def export_command(snapshot: str, out_path: str, key: Optional[str], fmt: str, force: bool, as_json: bool,
                   endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Write SNAPSHOT's model weights to OUT, for inference without the trainer.

    As a torch.save'd state dict (load with torch.load(OUT) and module.load_state_dict) or as
    safetensors. KEY may name a sub-entry: 'state_dict' or 'model/0.weight'.
    """
    opts = _opts(endpoint_url, region)
    store, name = _split(snapshot, opts)
    if fmt == "auto":
        fmt = "safetensors" if out_path.endswith(".safetensors") else "torch"
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise ConfigError("--format safetensors needs safetensors: pip install 'tnt-snapshot-plugin[cli]'") from None
    if os.path.exists(out_path) and not force:
        raise UsageProblem(f"{out_path} exists; pass --force to overwrite it")
    metadata = _require_metadata(store, name)
    top = {p.split("/")[1] for p in metadata.manifest if p.startswith("0/")}
    if key is None:
        found = weight_keys(metadata)
        if len(found) != 1:
            raise UsageProblem(
                f"{store.child(name)} has {len(found)} entries holding only tensors ({', '.join(found) or 'none'}); "
                f"choose one with --key (entries: {', '.join(sorted(top))})"
            )
        key = found[0]
    head, _, sub = key.strip("/").partition("/")
    if head not in top:
        raise UsageProblem(f"{store.child(name)} has no entry {head!r} (entries: {', '.join(sorted(top))})")
    value = load_entry(store, name, head, opts)
    for part in [p for p in sub.split("/") if p]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise UsageProblem(f"entry {head!r} of {store.child(name)} has no {sub!r}")
    import torch

    if isinstance(value, torch.Tensor):
        value = {key.rstrip("/").rpartition("/")[2]: value}
    try:
        tensors = flatten_tensors(value)
    except ValueError as exc:
        if fmt == "safetensors":
            raise UsageProblem(f"cannot export {key!r} as safetensors: {exc}; choose a key holding only tensors") from None
        tensors = {}
    directory = os.path.dirname(os.path.abspath(out_path))
    tmp = os.path.join(directory, f".{os.path.basename(out_path)}.tmp.{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp,
                      metadata={"source": store.child(name), "key": key})
        else:
            torch.save(value, tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if as_json:
        _emit_json({"snapshot": store.child(name), "key": key, "out": out_path, "format": fmt,
                    "tensors": len(tensors), "bytes": nbytes})
    else:
        _say(_console(), f"exported {key} ({len(tensors)} tensors, {human_size(nbytes)}) from "
                         f"{store.child(name)} to {out_path} ({'safetensors' if fmt == 'safetensors' else 'torch.save'})")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """The console script ``tnt-snapshot``."""
    return int(cli.main(argv, prog_name="tnt-snapshot", standalone_mode=False))


if __name__ == "__main__":
    sys.exit(main())
