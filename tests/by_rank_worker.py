"""One rank of tests/test_restore_by_rank.py: FSDP2 snapshots of 4 processes restored on 4 and 2,
each rank reading only the records of ``.snapshot_metadata`` it needs.

Run as ``python tests/by_rank_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``; gloo on the
loopback interface only. Each phase writes what it saw to ``OUTDIR/PHASE_rank{RANK}.json``:

* ``save``: trains an FSDP2 model (every parameter and Adam state sharded over the 4 ranks) with
  the torchtnt adapter's saver, a snapshot every 2 steps; records the whole state at step 4.
* ``restore``: new processes restore the step-4 snapshot three ways, recording every read of
  ``.snapshot_metadata`` (ranged and whole) that the local store serves:
  ``TorchSnapshotSaver.restore(path)`` into a new FSDP2 unit; ``restore_from_latest`` into
  another; and ``RestoreRequest.restore(path)`` of the model alone into a plain, unsharded copy
  of it (whole tensors, which need every rank's shards); records too which parts of the index
  each reads. Then copies damaged three ways: a byte of rank 2's records flipped in the
  metadata, a byte flipped in rank 2's part of the index, one of rank 3's files removed.
* ``world2``: 2 new processes restore the step-4 snapshot (another world size).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from fsdp_worker import Capture, Unit, digest, loader, whole_state
from gloo_worker import run_rank
from torchtnt.framework.train import train

from tnt_snapshot_plugin import SnapshotCorruptError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.restoring import RestoreRequest
from tnt_snapshot_plugin.stores.local import LocalStore

METADATA = ".snapshot_metadata"
PARTS = ".tnt_snapshot_index"


def phase_save(rank: int, out: str, record: dict[str, Any]) -> None:
    unit = Unit("fsdp2", seed=0)
    capture = Capture(at_step=4)
    saver = TorchSnapshotSaver(out, save_every_n_train_steps=2, save_on_train_end=False, collective_timeout_s=60)
    train(unit, loader(rank), max_epochs=1, callbacks=[capture, saver])
    record["at_step_4"] = capture.state


class MetadataReads:
    """Every read of ``.snapshot_metadata`` the local store serves in this process: ``[start,
    end]`` of a ranged read, ``"whole"`` for the whole file; and in ``parts``, the rank of each
    part of the index read (``.tnt_snapshot_index/R.json``)."""

    def __init__(self) -> None:
        self.reads: list[Any] = []
        self.parts: list[int] = []
        read_into, read_file = LocalStore.read_into, LocalStore.read_file

        def ranged(store: LocalStore, name: str, reads: Any, *args: Any, **kwargs: Any) -> None:
            self.reads.extend([offset, offset + memoryview(dest).nbytes] for rel, offset, dest in reads if rel == METADATA)
            return read_into(store, name, reads, *args, **kwargs)

        def whole(store: LocalStore, name: str, rel: str) -> bytes:
            if rel == METADATA:
                self.reads.append("whole")
            if rel.startswith(PARTS + "/"):
                self.parts.append(int(rel[len(PARTS) + 1:].removesuffix(".json")))
            return read_file(store, name, rel)

        LocalStore.read_into = ranged  # type: ignore[method-assign]
        LocalStore.read_file = whole  # type: ignore[method-assign]

    def during(self, run: Callable[[], Any]) -> list[Any]:
        self.reads.clear()
        self.parts.clear()
        run()
        return list(self.reads)


def phase_restore(rank: int, out: str, record: dict[str, Any]) -> None:
    reads = MetadataReads()
    path = os.path.join(out, "epoch_0_step_4")

    unit = Unit("fsdp2", seed=7 + rank)
    record["explicit_reads"] = reads.during(lambda: TorchSnapshotSaver.restore(path, unit, collective_timeout_s=60))
    record["explicit_parts"] = list(reads.parts)
    record["explicit_state"] = whole_state(unit)

    unit = Unit("fsdp2", seed=8 + rank)
    record["latest_reads"] = reads.during(
        lambda: TorchSnapshotSaver.restore_from_latest(out, unit, collective_timeout_s=60)
    )
    record["latest_parts"] = list(reads.parts)
    record["latest_state"] = whole_state(unit)

    torch.manual_seed(9 + rank)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def plain_restore() -> None:
        with RestoreRequest({"model": plain}).on_ranks(None, 60) as request:
            request.restore(path)

    record["plain_reads"] = reads.during(plain_restore)
    record["plain_parts"] = list(reads.parts)
    record["plain_state"] = {f"model/{name}": digest(value) for name, value in sorted(plain.state_dict().items())}
    damaged_group(rank, out, record)
    damaged_part(rank, out, record)
    missing_file(rank, out, record)


def damaged_group(rank: int, out: str, record: dict[str, Any]) -> None:
    """A byte flipped in the middle of rank 2's group of the newest snapshot's metadata."""

    def flip(newest: str) -> None:
        import json

        with open(os.path.join(newest, ".tnt_snapshot_index.json")) as f:
            start, end, _digest = json.load(f)["ranks"]["regions"][2]
        with open(os.path.join(newest, METADATA), "r+b") as f:
            f.seek((start + end) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x20]))

    restore_damaged(rank, *damaged_copy(rank, out, "damaged", flip), record, "damaged")


def damaged_copy(rank: int, out: str, kind: str, damage: Callable[[str], None]) -> tuple[str, str]:
    """(a copy of the snapshots, its newest snapshot), ``damage(newest)`` done by rank 0."""
    import shutil

    import torch.distributed as dist

    copy = os.path.join(os.path.dirname(out), kind)
    newest = os.path.join(copy, "epoch_0_step_4")
    if rank == 0:
        shutil.copytree(out, copy)
        damage(newest)
    dist.barrier()
    return copy, newest


def restore_damaged(rank: int, copy: str, newest: str, record: dict[str, Any], kind: str) -> None:
    """Restore ``newest`` (its error in ``record[kind]``), then the latest of ``copy`` (the step
    restored and the warnings)."""
    import warnings

    try:
        TorchSnapshotSaver.restore(newest, Unit("fsdp2", seed=12 + rank), collective_timeout_s=60)
    except SnapshotCorruptError as exc:
        record[kind] = str(exc)
    unit = Unit("fsdp2", seed=13 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TorchSnapshotSaver.restore_from_latest(copy, unit, collective_timeout_s=60)
    record[f"{kind}_latest_steps"] = unit.train_progress.num_steps_completed
    record[f"{kind}_latest_warnings"] = [str(w.message) for w in caught]


def damaged_part(rank: int, out: str, record: dict[str, Any]) -> None:
    """A byte flipped in rank 2's part of the newest snapshot's index (its size unchanged)."""

    def flip(newest: str) -> None:
        with open(os.path.join(newest, PARTS, "2.json"), "r+b") as f:
            data = f.read()
            f.seek(len(data) // 2)
            f.write(bytes([data[len(data) // 2] ^ 0x01]))

    restore_damaged(rank, *damaged_copy(rank, out, "damaged_part", flip), record, "damaged_part")


def missing_file(rank: int, out: str, record: dict[str, Any]) -> None:
    """A payload file rank 3 wrote, removed from the newest snapshot."""

    def remove(newest: str) -> None:
        import json

        with open(os.path.join(newest, PARTS, "3.json")) as f:
            victim = sorted(json.load(f)["files"])[0]
        os.remove(os.path.join(newest, victim))
        record["missing_file_removed"] = victim

    restore_damaged(rank, *damaged_copy(rank, out, "missing_file", remove), record, "missing_file")


def phase_world2(rank: int, out: str, record: dict[str, Any]) -> None:
    """The 4-rank snapshot restored on 2 ranks: rank 0 compares the saved ranks' per-rank entries
    (the whole metadata); rank 1 reads its groups and those holding the shards it now holds."""
    reads = MetadataReads()
    unit = Unit("fsdp2", seed=20 + rank)
    path = os.path.join(out, "epoch_0_step_4")
    record["world2_reads"] = reads.during(lambda: TorchSnapshotSaver.restore(path, unit, collective_timeout_s=60))
    record["world2_parts"] = list(reads.parts)
    record["world2_state"] = whole_state(unit)
    # Rank 1 alone gets its own saved group back with a byte flipped (as from a faulty read on its
    # node), rank 0 reads the file as it is: the rank that finds the damage and the one that does
    # not both raise, and neither waits on the other in a collective.
    if rank == 1:
        flip_in_reads_of_group(path, 1)
    try:
        TorchSnapshotSaver.restore(path, Unit("fsdp2", seed=22 + rank), collective_timeout_s=30)
    except SnapshotCorruptError as exc:
        record["world2_damaged"] = str(exc)


def flip_in_reads_of_group(snapshot: str, group: int) -> None:
    """From now on, this process's ranged reads of ``snapshot``'s metadata come back with a byte
    of saved rank ``group``'s records flipped."""
    import json

    with open(os.path.join(snapshot, ".tnt_snapshot_index.json")) as f:
        start, end, _digest = json.load(f)["ranks"]["regions"][group]
    read_into = LocalStore.read_into

    def flipping(store: LocalStore, name: str, reads: Any, *args: Any, **kwargs: Any) -> None:
        read_into(store, name, reads, *args, **kwargs)
        for rel, offset, dest in reads:
            view = memoryview(dest).cast("B")
            if rel == METADATA and offset <= (start + end) // 2 < offset + view.nbytes:
                view[(start + end) // 2 - offset] ^= 0x20

    LocalStore.read_into = flipping  # type: ignore[method-assign]


PHASES: dict[str, Callable[[int, str, dict[str, Any]], None]] = {
    "save": phase_save, "restore": phase_restore, "world2": phase_world2,
}


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    run_rank(rank, world, rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: PHASES[phase](rank, os.path.join(out, "snapshots"), record))


if __name__ == "__main__":
    main()
