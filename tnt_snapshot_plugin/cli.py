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

import base64
import hashlib
import json
import math
import os
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import click
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.table import Table
from rich.text import Text

from . import retention
from .errors import ConfigError, SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from .naming import SnapshotName, is_staging_name
from .stores import INDEX_FNAME, LEASE_FNAME, LOCK_FNAME, METADATA_FNAME, LocalStore, Store, open_store
from .stores.s3 import S3Store

#: Bumped when a key of the ``--json`` output changes meaning or goes away (keys may be added).
JSON_VERSION = 1

#: Entry types of torchsnapshot's manifest that only hold other entries.
_CONTAINERS = frozenset({"list", "dict", "OrderedDict"})
_TENSORS = frozenset({"Tensor", "ChunkedTensor"})
_SHARDED = frozenset({"ShardedTensor", "DTensor"})
_PRIMITIVES = frozenset({"int", "float", "str", "bool", "bytes"})
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


def parse_metadata(raw: bytes) -> dict[str, Any]:
    """torchsnapshot's ``.snapshot_metadata`` as plain data; ValueError if it is unreadable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc})") from None
    try:
        doc = json.loads(text)
    except ValueError:
        import yaml  # a torchsnapshot dependency; older versions wrote YAML

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"neither JSON nor YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("manifest"), dict):
        raise ValueError("it holds no manifest")
    return doc


def _locations(entry: Any) -> Iterator[tuple[str, Optional[list[int]]]]:
    """(file, byte range) of every file a manifest entry reads."""
    if not isinstance(entry, dict):
        return
    if isinstance(entry.get("location"), str):
        yield entry["location"], entry.get("byte_range")
    for part in list(entry.get("shards") or []) + list(entry.get("chunks") or []):
        if isinstance(part, dict):
            yield from _locations(part.get("tensor"))


@dataclass
class SnapshotInfo:
    """One child of a snapshot directory, as ``ls`` and ``verify`` see it."""

    name: str
    kind: str  # "snapshot", "staging", "lock" (the plugin's lock or lease file), "foreign"
    status: str
    parsed: Optional[SnapshotName] = None
    files: dict[str, FileInfo] = field(default_factory=dict)
    modified_at: Optional[float] = None
    index: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    problems: list[str] = field(default_factory=list)
    note: str = ""
    restore: bool = False

    @property
    def writer(self) -> Optional[str]:
        if self.index is not None or self.kind == "lock":
            return "tnt_snapshot_plugin"
        if self.parsed is not None and self.parsed.phase_aware:
            return "torchtnt"
        return None

    @property
    def world_size(self) -> Optional[int]:
        for doc in (self.index, self.metadata):
            if doc is not None and isinstance(doc.get("world_size"), int):
                return int(doc["world_size"])
        return None

    @property
    def committed_at(self) -> Optional[float]:
        value = (self.index or {}).get("committed_at")
        if isinstance(value, (int, float)):
            return float(value)
        meta = self.files.get(METADATA_FNAME)
        return meta.mtime if meta is not None and self.kind == "snapshot" else None

    @property
    def seq(self) -> Optional[int]:
        value = (self.index or {}).get("seq")
        return value if isinstance(value, int) else None

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
) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]], list[str], list[str]]:
    """(index, metadata, problems, notes) of a snapshot that has ``.snapshot_metadata``.

    Problems (each names its file): the index or the metadata unreadable; a file the index lists
    missing or of another size than written (the rule of ``Store.verify``); a file the metadata
    reads from missing or shorter than the range it reads; with ``checksums``, a file whose
    checksum differs from the index's ``checksums`` record (when the snapshot has one).
    """
    problems: list[str] = []
    notes: list[str] = []
    index: Optional[dict[str, Any]] = None
    if INDEX_FNAME in files:
        try:
            index = json.loads(store.read_file(name, INDEX_FNAME))
            if not isinstance(index, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{INDEX_FNAME} is unreadable ({exc})")
            index = None
    written = (index or {}).get("files")
    if isinstance(written, dict):
        for rel, size in sorted(written.items()):
            found = files.get(rel)
            if found is None:
                problems.append(f"{rel} is missing")
            elif found.size != size:
                problems.append(f"{rel} has {found.size} bytes, {size} were written")
            if progress is not None and not checksums:
                progress(size if isinstance(size, int) else 0)
    metadata: Optional[dict[str, Any]] = None
    try:
        metadata = parse_metadata(store.read_file(name, METADATA_FNAME))
    except ValueError as exc:
        problems.append(f"{METADATA_FNAME} is unreadable: {exc}")
    if metadata is not None:
        reported = {p.split(" ", 1)[0] for p in problems}
        for entry in metadata["manifest"].values():
            for loc, byte_range in _locations(entry):
                if loc in reported:
                    continue
                found = files.get(loc)
                if found is None:
                    problems.append(f"{loc} is missing (the metadata reads it)")
                    reported.add(loc)
                elif isinstance(byte_range, list) and len(byte_range) == 2 and found.size < byte_range[1]:
                    problems.append(
                        f"{loc} is truncated: {found.size} bytes, the metadata reads up to byte {byte_range[1]}"
                    )
                    reported.add(loc)
    if checksums:
        recorded = (index or {}).get("checksums")
        if isinstance(recorded, dict):
            reported = {p.split(" ", 1)[0] for p in problems}
            for rel, record in sorted(recorded.items()):
                if rel in reported or rel not in files:
                    continue
                problem = _check_checksum(store, name, rel, record, progress)
                if problem is not None:
                    (notes if problem.startswith("cannot") else problems).append(problem)
        else:
            notes.append("sizes only; checksums not recorded by this snapshot")
            if progress is not None and isinstance(written, dict):
                progress(sum(s for s in written.values() if isinstance(s, int)))
    return index, metadata, problems, notes


def _hasher(algo: str) -> Optional[Any]:
    """An object with update()/hexdigest() for ``algo``, None if it is not available here."""
    algo = algo.lower()
    if algo == "crc32c":
        try:
            import google_crc32c
        except ImportError:
            return None
        return google_crc32c.Checksum()
    if algo == "crc32":

        class _Crc32:
            value = 0

            def update(self, data: bytes) -> None:
                self.value = zlib.crc32(data, self.value)

            def hexdigest(self) -> str:
                return f"{self.value:08x}"

        return _Crc32()
    if algo.startswith("xxh"):
        try:
            import xxhash
        except ImportError:
            return None
        ctor = getattr(xxhash, algo, None)
        return ctor() if ctor is not None else None
    if algo in hashlib.algorithms_available:
        return hashlib.new(algo)
    return None


_READ_CHUNK = 8 * 1024 * 1024


def _read_chunks(store: Store, name: str, rel: str) -> Iterator[bytes]:
    if isinstance(store, LocalStore):
        with open(os.path.join(store.root, name, rel), "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                yield chunk
        return
    assert isinstance(store, S3Store)
    body = store.client.get_object(Bucket=store.bucket, Key=store._key(name, rel))["Body"]
    try:
        yield from body.iter_chunks(_READ_CHUNK)
    finally:
        body.close()


def _check_checksum(
    store: Store, name: str, rel: str, record: Any, progress: Optional[Callable[[int], None]]
) -> Optional[str]:
    if not isinstance(record, dict) or not isinstance(record.get("algo"), str):
        return f"{rel}: checksum record {record!r} is unreadable"
    algo, expected = record["algo"], str(record.get("value", ""))
    hasher = _hasher(algo)
    if hasher is None:
        return f"cannot check {rel}: checksum algorithm {algo!r} is not available (pip install google-crc32c / xxhash)"
    for chunk in _read_chunks(store, name, rel):
        hasher.update(chunk)
        if progress is not None:
            progress(len(chunk))
    actual = hasher.hexdigest()
    if isinstance(actual, bytes):
        actual = actual.decode()
    if actual.lower() != expected.lower():
        return f"{rel} has {algo} {actual}, {expected} was recorded"
    return None


def _listed(info: SnapshotInfo) -> retention.Listed:
    """What the core's retention knows of ``info`` (its name and index)."""
    assert info.parsed is not None
    return retention.from_index(info.parsed, info.index)


def commit_order(infos: Iterable[SnapshotInfo]) -> list[SnapshotInfo]:
    """Oldest first, in the core's commit order (``retention.commit_order``, which
    ``Store.listed()`` and ``restore_from_latest`` use): the index's ``seq``; snapshots without
    one (torchtnt's, older ones) first, by (epoch, step)."""
    infos = [i for i in infos if i.parsed is not None]
    return sorted(infos, key=lambda i: _listed(i).order_key)


def survey(store: Store, *, checksums: bool = False, progress: Optional[Callable[[int], None]] = None) -> list[SnapshotInfo]:
    """Every child of the snapshot directory, classified: snapshots oldest first, then staging
    leftovers, then foreign entries. The snapshot ``restore_from_latest`` would restore is marked."""
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
            index, metadata, problems, notes = check_snapshot(store, name, files, checksums=checksums, progress=progress)
            snapshots.append(
                SnapshotInfo(name, "snapshot", STATUS_DAMAGED if problems else STATUS_COMPLETE, parsed=parsed,
                             files=files, modified_at=modified, index=index, metadata=metadata,
                             problems=problems, note="; ".join(notes))
            )
    pick = restore_pick(snapshots)
    if pick is not None:
        pick.restore = True
    # Committed snapshots in commit order; then those never committed (no metadata), by progress.
    committed = [i for i in snapshots if i.status != STATUS_INCOMPLETE]
    never = sorted((i for i in snapshots if i.status == STATUS_INCOMPLETE), key=lambda i: i.parsed.sort_key)  # type: ignore[union-attr]
    return commit_order(committed) + never + staging + plugin_files + foreign


def _lock_note(store: Store, name: str) -> str:
    """What a lock or lease file says of its holder (it is the plugin's; never touched)."""
    what = "the dirpath lock of a saver's run" if name == LOCK_FNAME else "the dirpath lease of a saver's run (S3)"
    try:
        holder = json.loads(store.read_file("", name) or b"null")
    except (OSError, ValueError, SnapshotError):
        holder = None
    if isinstance(holder, dict) and holder.get("host") is not None:
        what += f", held by host {holder.get('host')} pid {holder.get('pid')} run {holder.get('run_id')}"
    return what + " (the plugin's own; a leftover of a killed run is harmless)"


def restore_pick(snapshots: list[SnapshotInfo]) -> Optional[SnapshotInfo]:
    """The snapshot ``restore_from_latest`` restores: it tries the complete snapshots newest
    first in commit order (``Store.complete_snapshots``, i.e. ``retention.commit_order``), skips
    those ``Store.verify`` finds damaged and falls back from one that fails to load (unreadable
    metadata)."""
    candidates = commit_order(s for s in snapshots if s.status in (STATUS_COMPLETE, STATUS_DAMAGED))
    for info in reversed(candidates):
        if info.status == STATUS_COMPLETE:
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
# Manifest entries.


def primitive_value(entry: dict[str, Any]) -> Any:
    kind, raw = entry.get("type"), entry.get("serialized_value")
    try:
        if kind == "int":
            return int(raw)  # type: ignore[arg-type]
        if kind == "float":
            return struct.unpack("d", base64.b64decode(raw))[0]  # type: ignore[arg-type]
        if kind == "bool":
            return raw == "True"
        if kind == "bytes":
            return f"<{len(base64.b64decode(raw))} bytes>"  # type: ignore[arg-type]
    except (TypeError, ValueError, struct.error):
        return raw
    return raw


def _shape(entry: dict[str, Any]) -> Optional[list[int]]:
    if isinstance(entry.get("shape"), list):
        return list(entry["shape"])
    shards = entry.get("shards")
    if isinstance(shards, list) and shards:
        dims = [0] * len(shards[0].get("offsets", []))
        for s in shards:
            for i, (o, n) in enumerate(zip(s.get("offsets", []), s.get("sizes", []), strict=False)):
                dims[i] = max(dims[i], o + n)
        return dims
    return None


def _dtype(entry: dict[str, Any]) -> Optional[str]:
    dtype = entry.get("dtype")
    if dtype is None:
        for part in list(entry.get("shards") or []) + list(entry.get("chunks") or []):
            dtype = (part.get("tensor") or {}).get("dtype")
            if dtype:
                break
    return str(dtype).replace("torch.", "") if dtype else None


def entry_rows(metadata: dict[str, Any], files: dict[str, FileInfo]) -> list[dict[str, Any]]:
    """One row per leaf entry of the manifest (containers skipped), sorted by path."""
    rows = []
    for path, entry in sorted(metadata["manifest"].items()):
        if not isinstance(entry, dict) or entry.get("type") in _CONTAINERS:
            continue
        etype = str(entry.get("type"))
        rank, _, logical = path.partition("/")
        nbytes = 0
        for loc, byte_range in _locations(entry):
            if isinstance(byte_range, list) and len(byte_range) == 2:
                nbytes += int(byte_range[1]) - int(byte_range[0])
            elif loc in files:
                nbytes += files[loc].size
        kind = "tensor" if etype in _TENSORS else "sharded" if etype in _SHARDED else "value" if etype in _PRIMITIVES else "object"
        row: dict[str, Any] = {
            "path": path,
            "rank": int(rank) if rank.isdigit() else None,
            "key": logical,
            "kind": kind,
            "type": etype,
            "dtype": _dtype(entry) if kind in ("tensor", "sharded") else (etype if kind == "value" else entry.get("obj_type")),
            "shape": _shape(entry),
            "bytes": nbytes,
            "replicated": bool(entry.get("replicated", False)),
        }
        if kind == "value":
            row["value"] = primitive_value(entry)
        rows.append(row)
    return rows


def summarize(metadata: dict[str, Any]) -> dict[str, Any]:
    """The progress and RNG entries of rank 0, in a few words."""
    manifest = metadata["manifest"]
    summary: dict[str, Any] = {}
    for path, entry in manifest.items():
        parts = path.split("/")
        if parts[0] != "0" or len(parts) < 2 or not isinstance(entry, dict):
            continue
        key = parts[1]
        if key.endswith("progress") and len(parts) == 3 and entry.get("type") in _PRIMITIVES:
            summary.setdefault(key, {})[parts[2]] = primitive_value(entry)
        elif len(parts) == 2 and key in ("epoch", "global_step") and entry.get("type") in _PRIMITIVES:
            summary.setdefault("lightning", {})[key] = primitive_value(entry)
    rng = manifest.get("0/rng_state")
    if isinstance(rng, dict) and isinstance(rng.get("keys"), list):
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


def _read_value(store: Store, name: str, manifest: dict[str, Any], path: str) -> Any:
    """The value of manifest entry ``path`` (``RANK/KEY/...``) of snapshot ``name``."""
    from .format import reader as fmt
    from .restoring import reading_io

    read_into, file_size, verifier = reading_io(store, name, store.child(name))
    return fmt.read_value(manifest, path, read_into, file_size=file_size, verifier=verifier)


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


def _entry_bytes(store: Store, name: str, entry: dict[str, Any], cache: dict[str, bytes]) -> Optional[bytes]:
    """The raw bytes an entry is stored as (one file or a range of one), or None if several."""
    locs = list(_locations(entry))
    if len(locs) != 1:
        return None
    loc, byte_range = locs[0]
    if loc not in cache:
        if sum(len(v) for v in cache.values()) > 512 * 1024 * 1024:
            cache.clear()
        cache[loc] = store.read_file(name, loc)
    data = cache[loc]
    if isinstance(byte_range, list) and len(byte_range) == 2:
        return data[byte_range[0]:byte_range[1]]
    return data


def diff_snapshots(
    a: tuple[Store, str], b: tuple[Store, str], storage_options: Optional[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """(differences, number of entries compared) between two snapshots' leaf entries."""
    (store_a, name_a), (store_b, name_b) = a, b
    meta_a = _require_metadata(store_a, name_a)
    meta_b = _require_metadata(store_b, name_b)
    man_a = {p: e for p, e in meta_a["manifest"].items() if isinstance(e, dict) and e.get("type") not in _CONTAINERS}
    man_b = {p: e for p, e in meta_b["manifest"].items() if isinstance(e, dict) and e.get("type") not in _CONTAINERS}
    diffs: list[dict[str, Any]] = []
    cache_a: dict[str, bytes] = {}
    cache_b: dict[str, bytes] = {}
    sharded_seen: set[str] = set()  # logical paths of sharded entries compared (under any rank)

    def read(side: str, path: str) -> Any:
        if side == "a":
            return _read_value(store_a, name_a, meta_a["manifest"], path)
        return _read_value(store_b, name_b, meta_b["manifest"], path)

    for path in sorted(set(man_a) | set(man_b)):
        ea, eb = man_a.get(path), man_b.get(path)
        if eb is None:
            diffs.append({"path": path, "change": "removed", "detail": _describe(ea)})
            continue
        if ea is None:
            diffs.append({"path": path, "change": "added", "detail": _describe(eb)})
            continue
        ta, tb = ea.get("type"), eb.get("type")
        if ta != tb:
            diffs.append({"path": path, "change": "changed", "detail": f"type {ta} -> {tb}"})
        elif ta in _PRIMITIVES:
            va, vb = primitive_value(ea), primitive_value(eb)
            if ea.get("serialized_value") != eb.get("serialized_value"):
                diffs.append({"path": path, "change": "changed", "detail": f"{va!r} -> {vb!r}"})
        elif ta in _TENSORS or ta in _SHARDED:
            if _dtype(ea) != _dtype(eb):
                diffs.append({"path": path, "change": "changed", "detail": f"dtype {_dtype(ea)} -> {_dtype(eb)}"})
            elif _shape(ea) != _shape(eb):
                diffs.append({"path": path, "change": "changed", "detail": f"shape {_shape(ea)} -> {_shape(eb)}"})
            else:
                raw_a = _entry_bytes(store_a, name_a, ea, cache_a)
                raw_b = _entry_bytes(store_b, name_b, eb, cache_b)
                if raw_a is not None and raw_a == raw_b:
                    continue
                if ta in _SHARDED:
                    # read whole (every rank's shards), once for all the ranks that record it
                    logical = path.split("/", 1)[-1]
                    if logical in sharded_seen:
                        continue
                    sharded_seen.add(logical)
                ra, rb = read("a", path), read("b", path)
                detail = _max_abs_diff(ra, rb)
                if ra.equal(rb) if ra.dtype == rb.dtype else False:
                    continue
                diffs.append({"path": path, "change": "changed", "detail": detail})
        else:
            raw_a = _entry_bytes(store_a, name_a, ea, cache_a)
            raw_b = _entry_bytes(store_b, name_b, eb, cache_b)
            if raw_a is not None and raw_a == raw_b:
                continue
            try:
                same = bool(read("a", path) == read("b", path))
            except Exception:  # objects without a usable ==: their stored bytes differ
                same = False
            if not same:
                diffs.append({"path": path, "change": "changed", "detail": "object differs"})
    return diffs, len(set(man_a) | set(man_b))


def _describe(entry: Any) -> str:
    etype = entry.get("type")
    if etype in _PRIMITIVES:
        return f"{etype} {primitive_value(entry)!r}"
    if etype in _TENSORS or etype in _SHARDED:
        return f"{_dtype(entry)} {_shape(entry)}"
    return str(entry.get("obj_type") or etype)


def _require_metadata(store: Store, name: str) -> dict[str, Any]:
    files, _ = snapshot_files(store, name)
    if METADATA_FNAME not in files:
        raise UsageProblem(
            f"{store.child(name)} is not a complete snapshot (no {METADATA_FNAME}: an interrupted write?)"
        )
    raw = store.read_file(name, METADATA_FNAME)
    try:
        metadata = parse_metadata(raw)
    except ValueError as exc:
        raise SnapshotError(f"{store.child(name)}: {METADATA_FNAME} is unreadable: {exc}") from None
    if INDEX_FNAME in files:  # it holds the primitive values themselves: checked before they are shown
        from .checksums import check_file

        try:
            index = json.loads(store.read_file(name, INDEX_FNAME))
        except ValueError as exc:
            raise SnapshotCorruptError(
                f"{store.child(name)}: {INDEX_FNAME} is unreadable ({exc}): the snapshot is damaged"
            ) from None
        check_file(store.child(name), METADATA_FNAME, index, raw)
    return metadata


def weight_keys(metadata: dict[str, Any]) -> list[str]:
    """Top-level keys of rank 0 whose leaf entries are all tensors (a module's state dict)."""
    kinds: dict[str, set[str]] = {}
    for path, entry in metadata["manifest"].items():
        parts = path.split("/")
        if parts[0] != "0" or len(parts) < 2 or not isinstance(entry, dict):
            continue
        etype = entry.get("type")
        if etype in _CONTAINERS:
            kinds.setdefault(parts[1], set())
            continue
        kinds.setdefault(parts[1], set()).add("tensor" if etype in _TENSORS else "other")
    return sorted(k for k, found in kinds.items() if found == {"tensor"} and k not in _RESERVED)


def load_entry(store: Store, name: str, key: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """Top-level entry ``key`` of a snapshot as plain data (restored into a ``Value`` holder)."""
    from .format import reader as fmt
    from .restoring import read_metadata, reading_io

    read_into, file_size, verifier = reading_io(store, name, store.child(name))
    meta = fmt.parse_metadata(read_metadata(store, name, verifier), store.child(name))
    return fmt.read_state_dict(
        fmt.rank_view(meta, 0), key, None, read_into, file_size=file_size, verifier=verifier
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
    return Console(file=stream, highlight=False, width=None if tty else 200, soft_wrap=not tty)


def _table(*columns: str, right: Iterable[str] = ()) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for col in columns:
        table.add_column(col, justify="right" if col in set(right) else "left", no_wrap=True)
    return table


def _print_table(out: Console, table: Table) -> None:
    """On a terminal, as rich draws it; elsewhere without the cells' trailing padding."""
    if out.is_terminal:
        out.print(table)
        return
    with out.capture() as captured:
        out.print(table)
    out.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


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
        except (ConfigError, SnapshotNotFoundError) as exc:
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
    click.echo(f"{prog}: error: {first}", err=True)
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

    Status: complete, damaged (a file missing or of the wrong size, unreadable metadata),
    incomplete (no .snapshot_metadata), staging leftover, or foreign (not a snapshot: never
    touched). '*' marks the snapshot restore_from_latest would restore.
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
            out.print(f"{i.name}: {problem}", style="red")
    counts: dict[str, int] = {}
    for i in infos:
        counts[i.status] = counts.get(i.status, 0) + 1
    total = sum(i.nbytes for i in infos if i.kind == "snapshot")
    parts = [f"{n} {s}" for s, n in counts.items()]
    pick = next((i.name for i in infos if i.restore), None)
    out.print(f"{', '.join(parts) or 'empty'}; {human_size(total)} in snapshots")
    out.print(f"* restore_from_latest would restore {pick}" if pick else "restore_from_latest would find nothing to restore")
    return 0


@cli.command("inspect")
@click.argument("snapshot")
@_json_flag
@_s3_flags
def inspect_command(snapshot: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Every entry of SNAPSHOT: key path, kind, dtype, shape, bytes, replicated."""
    store, name = _split(snapshot, _opts(endpoint_url, region))
    files, _ = snapshot_files(store, name)
    metadata = _require_metadata(store, name)
    index: dict[str, Any] = {}
    if INDEX_FNAME in files:
        try:
            loaded = json.loads(store.read_file(name, INDEX_FNAME))
            index = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            index = {}
    rows = entry_rows(metadata, files)
    summary = summarize(metadata)
    parsed = SnapshotName.parse(name)
    head = {
        "snapshot": store.child(name),
        "epoch": index.get("epoch", parsed.epoch if parsed else None),
        "step": index.get("step", parsed.step if parsed else None),
        "world_size": index.get("world_size", metadata.get("world_size")),
        "bytes": sum(f.size for f in files.values()),
        "files": len(files),
        "writer": "tnt_snapshot_plugin" if INDEX_FNAME in files else ("torchtnt" if parsed and parsed.phase_aware else None),
    }
    if as_json:
        _emit_json({**head, "summary": summary, "entries": rows})
        return 0
    out = _console()
    out.print(
        f"{head['snapshot']}: epoch {_num(head['epoch'])}, step {_num(head['step'])}, world size "
        f"{_num(head['world_size'])}, {human_size(int(head['bytes'] or 0))} in {head['files']} files"
    )
    for line in _summary_lines(summary):
        out.print(line)
    table = _table("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "BYTES", "REPLICATED", right=("BYTES",))
    for r in rows:
        shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else ("=" + repr(r["value"]) if r["kind"] == "value" else "")
        if r["shape"] == []:
            shape = "scalar"
        table.add_row(r["path"], r["kind"], str(r["dtype"] or ""), shape, human_size(r["bytes"]) if r["bytes"] else "-",
                      "yes" if r["replicated"] else "no")
    _print_table(out, table)
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    out.print(f"{len(rows)} entries: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return 0


@cli.command("verify")
@click.argument("target")
@_json_flag
@_s3_flags
def verify_command(target: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Check every file of a snapshot, or of every snapshot in a directory.

    Sizes against the snapshot's index, files the metadata reads, and checksums where the
    snapshot recorded them. Exit status 1 when anything is damaged (or a snapshot given by path
    is incomplete), naming each damaged file.
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
                index, metadata, problems, notes = check_snapshot(store, name, files, checksums=True, progress=advance)
                info = SnapshotInfo(name, "snapshot", STATUS_DAMAGED if problems else STATUS_COMPLETE, parsed=parsed,
                                    files=files, index=index, metadata=metadata, problems=problems, note="; ".join(notes))
            infos = [info]
        else:
            store = _open(target, opts)
            infos = [i for i in survey(store, checksums=True, progress=advance) if i.kind == "snapshot"]
    bad = [i for i in infos if i.status == STATUS_DAMAGED or (single and i.status == STATUS_INCOMPLETE)]
    if as_json:
        _emit_json({
            "target": target,
            "ok": not bad,
            "snapshots": [
                {"name": i.name, "status": i.status, "files": len(i.files), "bytes": i.nbytes,
                 "checked": "sizes+checksums" if isinstance((i.index or {}).get("checksums"), dict) else "sizes",
                 "problems": i.problems, "note": i.note}
                for i in infos
            ],
        })
        return 1 if bad else 0
    table = _table("SNAPSHOT", "FILES", "SIZE", "CHECKED", "STATUS", right=("FILES", "SIZE"))
    for i in infos:
        checked = "-" if i.status == STATUS_INCOMPLETE else (
            "sizes+checksums" if isinstance((i.index or {}).get("checksums"), dict) else "sizes")
        status = STATUS_COMPLETE if i.status == STATUS_COMPLETE else i.status
        table.add_row(i.name, str(len(i.files)), human_size(i.nbytes), checked,
                      Text("intact" if status == STATUS_COMPLETE else status, style=_STATUS_STYLE[i.status]))
    _print_table(out, table)
    for i in infos:
        for problem in i.problems:
            out.print(f"{i.name}: {problem}", style="red")
    unchecked = [i.name for i in infos if "checksums not recorded" in i.note]
    if unchecked:
        out.print("sizes only; checksums not recorded by " + ("this snapshot" if len(infos) == 1 else f"{len(unchecked)} of these snapshots"))
    if not infos:
        out.print(f"no snapshots in {target}")
    out.print(f"{len(bad)} damaged" if bad else "all intact")
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
@_json_flag
@_s3_flags
def prune_command(dirpath: str, keep_last: int, keep_best: Optional[str], mode: Optional[str], dry_run: bool,
                  min_staging_age: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Delete old snapshots of DIRPATH by the saver's retention rules.

    Only snapshots this plugin wrote (with its index) are deleted, never the newest complete one
    nor the one restore_from_latest would restore; symlinks are never followed; nothing else in
    DIRPATH is touched.
    """
    if (keep_best is None) != (mode is None):
        raise click.UsageError("--keep-best and --mode go together")
    min_age = _duration(min_staging_age)
    store = _open(dirpath, _opts(endpoint_url, region))
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
            out.print(f"not snapshots, left alone: {', '.join(others)}")
        freed = sum(sizes[n] for n in (doomed if dry_run else deleted))
        out.print(f"{'would delete' if dry_run else 'deleted'} {len(doomed) if dry_run else len(deleted)} "
                  f"snapshots, {human_size(freed)}")
        for line in failed:
            out.print(f"could not delete {line}", style="red")
    return 1 if failed else 0


@cli.command("diff")
@click.argument("a")
@click.argument("b")
@_json_flag
@_s3_flags
def diff_command(a: str, b: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Entries added, removed or changed from snapshot A to snapshot B.

    Tensors are compared by their bytes, and those that differ by max |a-b|; a sharded tensor
    (ShardedTensor, DTensor) whole, once, under the first rank that records it. Exit status 0
    when the snapshots hold the same values, 1 when they differ.
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
    out.print(f"{compared} entries compared: {compared - len(diffs)} identical"
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
    top = {p.split("/")[1] for p in metadata["manifest"] if p.startswith("0/") and "/" in p}
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
        _console().print(f"exported {key} ({len(tensors)} tensors, {human_size(nbytes)}) from "
                         f"{store.child(name)} to {out_path} ({'safetensors' if fmt == 'safetensors' else 'torch.save'})")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """The console script ``tnt-snapshot``."""
    return int(cli.main(argv, prog_name="tnt-snapshot", standalone_mode=False))


if __name__ == "__main__":
    sys.exit(main())
