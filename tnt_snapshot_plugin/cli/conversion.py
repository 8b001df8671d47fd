"""A snapshot converted into another on-disk format (``tnt-snapshot convert --to
torchsnapshot|dcp``): :func:`convert_snapshot`.

Every app-state entry of every saved rank, the plugin's own included (progress, RNG states, the
dataloader's position), is read as restore reads it (the format's reader: every byte checked
against the checksums the plugin's index records, objects loaded under the allow-list), then
written by the plugin's own writer once per saved rank. The ranks of a conversion are threads of
this process, each exchanging with the others what the ranks of a saver exchange
(:class:`ThreadRanks`): a value a rank saved as its own stays that rank's, one saved once for all
ranks is written once. DST is a new snapshot, staged and committed as a saver commits one
(``stores.commit``), with the plugin's index and checksums; a failure leaves no DST.

A snapshot is converted whole or not at all: an entry the reading does not give (torchsnapshot's
sharded tensors, ShardedTensor and DTensor, which restore reads only into a sharded target) is
named in the refusal, before anything is written. The whole state is held in memory meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import unquote

from tnt_snapshot_plugin.app_state import Frozen
from tnt_snapshot_plugin.cli.app import UsageProblem
from tnt_snapshot_plugin.cli.entries import Snapshot
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.distributed import Collectives, is_consequence
from tnt_snapshot_plugin.format.objects import LoadCheck
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.saving.jobs import Job
from tnt_snapshot_plugin.saving.writer import SnapshotWriter
from tnt_snapshot_plugin.stores import Store
from tnt_snapshot_plugin.stores.ownership import live_runs, new_run_id, staging_token


class ThreadRanks:
    """The ranks of one conversion, each a thread of this process: what their collectives
    exchange (:meth:`member`: rank ``rank``'s). Every exchange is made by every rank, as under
    torch.distributed; a rank that fails outside one calls :meth:`abort`, and the others' next
    exchange raises DistributedError instead of waiting ``timeout_s``."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[Any] = [None] * world_size

    def member(self, rank: int) -> Collectives:
        return _ThreadCollectives(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (all ranks call it)."""
        self._slots[rank] = obj
        self._barrier.wait()  # every rank's object is in
        out = list(self._slots)
        self._barrier.wait()  # every rank has read them: the slots may be written again
        return out


class _ThreadCollectives(Collectives):
    """One rank's collectives among the threads of :class:`ThreadRanks`."""

    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        super().__init__(None, ranks.timeout_s)
        self.rank, self.world_size = rank, ranks.world_size
        self._ranks = ranks

    def _exchange(self, what: str, obj: Any) -> list[Any]:
        try:
            return self._ranks.exchange(self.rank, obj)
        except threading.BrokenBarrierError as exc:
            raise self.failed(what, exc) from exc

    def broadcast(self, obj: Any) -> Any:
        return obj if self.alone else self._exchange("broadcast", obj)[0]

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj] if self.alone else self._exchange("all_gather", obj)

    def gather(self, obj: Any) -> Optional[list[Any]]:
        if self.alone:
            return [obj]
        out = self._exchange("gather", obj)
        return out if self.rank == 0 else None

    def barrier(self) -> None:
        if not self.alone:
            self._exchange("barrier", None)


@dataclass
class Converted:
    """A committed conversion: the ranks written, the app-state keys of rank 0, the bytes of
    DST's files, and what the writers warned about (a failed write not cleaned up)."""

    world_size: int
    keys: int
    nbytes: int
    warnings: list[str]


def convert_snapshot(
    snap: Snapshot,
    store: Store,
    name: SnapshotName,
    target: str,
    *,
    advance: Optional[Callable[[int], None]] = None,
    stage: Optional[Callable[[str, Optional[int]], None]] = None,
) -> Converted:
    """Write snapshot ``snap`` as the new snapshot ``name`` of ``store`` in format ``target``
    (see the module docstring); ``advance(nbytes)`` as tensors are read, ``stage(label,
    total)`` when the writing starts. UsageProblem naming the entries the reading does not
    give; the writer's errors (nothing committed) otherwise."""
    states = _read_ranks(snap, advance)
    missing = _not_read(snap, states)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise UsageProblem(
            f"cannot convert {snap.store.child(snap.name)} without losing entries: {', '.join(missing[:8])}{more} "
            "are not read whole from its format (sharded tensors: ShardedTensor, DTensor); nothing was written. "
            "Restore the snapshot on its ranks and save it with SnapshotConfig(format=...) instead"
        )
    if stage is not None:
        stage("writing", None)
    replicas = _replicas(snap, len(states))
    return _write_ranks(states, replicas, store, name, target)


def _read_ranks(snap: Snapshot, advance: Optional[Callable[[int], None]]) -> list[dict[str, Any]]:
    """Every saved rank's app state, as that rank restores it: key -> state dict."""
    fmt, files, verdict = snap.format, snap.files, snap.verdict
    first = fmt.reader(files, Collectives(None), verdict, weights_only=True)
    world = first.world_size
    ranks = ThreadRanks(world, 600.0)
    states: list[dict[str, Any]] = []
    for rank in range(world):
        reader = first if rank == 0 else fmt.reader(files, ranks.member(rank), verdict, weights_only=True)
        state: dict[str, Any] = {}
        for key in sorted(reader.keys()):
            state[key] = reader.read(key, None)
            if advance is not None:
                advance(_tensor_bytes(state[key]))
        states.append(state)
    return states


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


_ABSENT = object()


def _holds(state: Mapping[str, Any], tokens: list[str]) -> bool:
    """Whether ``state`` (key -> state dict) holds a value at ``tokens`` (a path's encoded keys)."""
    value: Any = state
    for token in tokens:
        text = unquote(token)
        if isinstance(value, Mapping):
            found = value.get(text, _ABSENT) if text in value else next(
                (value[k] for k in value if str(k) == text), _ABSENT
            )
            if found is _ABSENT:
                return False
            value = found
        elif isinstance(value, (list, tuple)) and text.isdigit() and int(text) < len(value):
            value = value[int(text)]
        else:
            return False
    return True


def _not_read(snap: Snapshot, states: list[dict[str, Any]]) -> list[str]:
    """The entries of ``snap`` some rank's state read does not hold (by path, sorted)."""
    missing: list[str] = []
    for path, info in sorted(snap.entries.items()):
        rank_text, _, logical = path.partition("/")
        rank = int(rank_text)
        ranks = range(len(states)) if info.replicated and rank == 0 else [rank]
        tokens = logical.split("/")
        if any(r >= len(states) or not _holds(states[r], tokens) for r in ranks):
            missing.append(path)
    return missing


def _glob(path: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def _replicas(snap: Snapshot, world: int) -> tuple[Optional[list[str]], tuple[str, ...], tuple[str, ...]]:
    """What the writer saves once for all ranks (``saving.jobs.Job.replicas``): the keys SRC
    saved once whole, and the paths (and every path below them) of the others' entries saved
    once; nothing on one rank."""
    if world == 1:
        return None, (), ()
    by_key: dict[str, list[bool]] = {}
    leaves: list[str] = []
    for path, info in snap.entries.items():
        rank, _, logical = path.partition("/")
        if rank != "0":
            continue
        key = logical.split("/", 1)[0]
        by_key.setdefault(key, []).append(info.replicated)
        if info.replicated:
            leaves.append(logical)
    whole = {key for key, flags in by_key.items() if all(flags)}
    globs = [g for leaf in leaves if leaf.split("/", 1)[0] not in whole for g in (_glob(leaf), _glob(leaf) + "/*")]
    return globs or None, tuple(sorted(unquote(key) for key in whole)), ()


def _write_ranks(
    states: list[dict[str, Any]], replicas: Any, store: Store, name: SnapshotName, target: str
) -> Converted:
    """Each rank's state written by a writer of its own (threads, on several ranks), committed
    by rank 0's."""
    world = len(states)
    config = SnapshotConfig(format=target)  # no retention: nothing but DST is written or deleted
    run_id = new_run_id()
    staging = store.staging_for(name.text, staging_token(run_id, 1))
    jobs: list[Any] = [None] * world
    errors: list[Optional[BaseException]] = [None] * world
    ranks = ThreadRanks(world, config.collective_timeout_s)

    def write(rank: int) -> None:
        coll = ranks.member(rank) if world > 1 else Collectives(None)
        writer = SnapshotWriter(store, coll, config, LoadCheck(weights_only=True))
        job = jobs[rank] = Job(
            name=name, path=store.child(name.text), staging=staging,
            frozen={key: Frozen(value) for key, value in states[rank].items()}, replicas=replicas,
        )
        try:
            writer.write(job, run_id, locked=False)
        except BaseException as exc:
            errors[rank] = exc
            ranks.abort()  # a rank still waiting in an exchange stops waiting
        finally:
            writer.close()

    try:
        if world == 1:
            write(0)
        else:
            threads = [threading.Thread(target=write, args=(r,), name=f"tnt-snapshot-convert-{r}") for r in range(world)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        live_runs.discard(run_id)
    failed = [e for e in errors if e is not None]
    if failed:
        raise next((e for e in failed if not is_consequence(e)), failed[0])
    return Converted(
        world_size=world, keys=len(states[0]), nbytes=jobs[0].bytes_written,
        warnings=[message for job in jobs for _category, message in job.warnings],
    )


__all__ = ["Converted", "ThreadRanks", "convert_snapshot"]
