"""One rank of the 2-rank writer test in tests/test_format_writer.py.

``python tests/format_writer_worker.py SNAPSHOT OUTDIR RANK WORLD RENDEZVOUS``: saves
``stock_reader.dist_state`` with the plugin's format writer (replicated values, DTensors and
ShardedTensors included): every rank plans and writes its payloads with plain file writes, the
ranks gather their records, rank 0 merges them and writes ``.snapshot_metadata``. Writes what it
did to ``OUTDIR/writer{RANK}.json`` (per snapshot: its records' paths, its files).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from gloo_worker import run_rank
from stock_reader import REPLICATED, dist_state

from tnt_snapshot_plugin.format.torchsnapshot import writer
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME


def write_payloads(root: str, payloads: list[writer.Payload]) -> None:
    for payload in payloads:
        path = os.path.join(root, payload.rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            for view in payload.views:
                f.write(view)


def replicated_dtensor_state() -> dict[str, dict[str, Any]]:
    """A fully replicated DTensor, saved apart: stock torchsnapshot 2024.7.26 cannot restore any
    snapshot holding one (its get_manifest_for_rank raises KeyError), so the test reads it itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    return {"rep": {"dt_rep": distribute_tensor(torch.arange(4, dtype=torch.int32), mesh, [Replicate()])}}


def save(root: str, state: dict[str, dict[str, Any]], rank: int, world: int, record: dict[str, Any]) -> None:
    containers: dict[str, dict] = {}
    leaves: dict[str, Any] = {}
    for key, state_dict in state.items():
        more_containers, more_leaves = writer.flatten(key, state_dict)
        containers.update(more_containers)
        leaves.update(more_leaves)
    mine = writer.replicable(leaves, list(REPLICATED) + ["shard/dt*", "shard/st*", "rep/*"])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    replicated = set.intersection(*(set(paths) for paths in everyone))
    plan = writer.plan(containers, leaves, rank=rank, world_size=world, replicated=replicated, pack_bytes=512)
    write_payloads(root, plan.payloads)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, plan.entries)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, METADATA_FNAME), "wb") as f:
            f.write(writer.metadata_bytes(writer.merge(parts), world))
    dist.barrier()
    record[os.path.basename(root)] = {
        "replicable": sorted(mine),
        "entries": sorted(plan.entries),
        "payloads": [payload.rel for payload in plan.payloads],
    }


def main() -> None:
    root, outdir, rank_s, world_s, rendezvous = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)

    def body(record: dict[str, Any]) -> None:
        save(root, dist_state(rank, fill=True), rank, world, record)
        save(root + "_rep", replicated_dtensor_state(), rank, world, record)

    run_rank(rank, world, rendezvous, os.path.join(outdir, f"writer{rank}.json"), body, timeout_s=60)


if __name__ == "__main__":
    main()
