"""One rank of the scale benchmark's validation (tests/test_scale.py): real FSDP2 and Adam.

Every rank builds benchmarks/scale.py's TINY decoder (the same parameter names and shapes as
the Llama configurations it simulates), shards it with ``fully_shard`` over all ranks, takes two
Adam steps and plans two saves with the writer's real code (``format.writer.flatten``/``plan``
over real DTensors); the records go to rank 0 through the real collective
(``Collectives.gather``) as the writer sends them (``coordination.RecordDeltas``), and rank 0
builds the metadata. Each rank records its records and the bytes it sent; rank 0 also times
its commit on the real records and on the simulated ones, in this process.

    python tests/scale_worker.py RANK WORLD RENDEZVOUS OUT
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale  # noqa: E402
from gloo_worker import run_rank  # noqa: E402

from tnt_snapshot_plugin.app_state import RNGState  # noqa: E402
from tnt_snapshot_plugin.distributed import Collectives  # noqa: E402
from tnt_snapshot_plugin.format.checksums import record_views  # noqa: E402
from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases  # noqa: E402
from tnt_snapshot_plugin.format.torchsnapshot import writer as fmt  # noqa: E402
from tnt_snapshot_plugin.format.torchsnapshot.coordination import RecordDeltas  # noqa: E402


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    root = torch.nn.Module()
    for name, shape in scale.TINY.parameters():
        *parents, leaf = name.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    fully_shard(root, mesh=init_device_mesh("cpu", (world,)))
    return root, torch.optim.Adam(root.parameters())  # the defaults, as the simulation's


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = sum((p.to_local() ** 2).sum() for p in model.parameters())
    loss.backward()  # type: ignore[union-attr]
    optimizer.step()
    optimizer.zero_grad()


def plan_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int) -> scale.RankPart:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {
        "model": model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train_progress": scale.progress(step),
        "rng_state": RNGState().state_dict(),
    }
    containers: dict[str, dict] = {}
    leaves: dict[str, Any] = {}
    for key, sd in state.items():
        c, leaf = fmt.flatten(key, sd)
        containers.update(c)
        leaves.update(leaf)
    sizes: dict[str, int] = {}
    sums: dict[str, dict[str, Any]] = {}

    def emit(payload: fmt.Payload) -> None:
        sizes[payload.rel] = sum(v.nbytes for v in payload.views)
        sums[payload.rel] = record_views(payload.views, payload.bounds)

    entries = fmt.plan(containers, leaves, rank=rank, world_size=world, replicated=set(), emit=emit).entries
    return scale.RankPart(entries, sizes, sums)


def commit(parts: list[scale.RankPart], world: int) -> bytes:
    return scale.metadata_of([p.entries for p in parts], world)[0]


def best_of(fn: Any, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def body(rank: int, world: int, record: dict[str, Any], out_dir: str) -> None:
    model, optimizer = build(world)
    coll = Collectives.create(None, 60)
    deltas = RecordDeltas()
    sent: list[int] = []
    real_parts: list[scale.RankPart] = []
    for step in (1, 2):
        train_step(model, optimizer)
        part = plan_save(model, optimizer, step, rank, world)
        outgoing = (deltas.outgoing(part.entries), scale.rank_listing(part, world))  # as saving.writer sends
        sent.append(len(pickle.dumps(outgoing)))
        gathered = coll.gather(part.entries)  # every rank's records, for rank 0's commit
        if gathered is not None:
            real_parts = [scale.RankPart(entries, {}, {}) for entries in gathered]
        deltas.settle()
        if step == 1:
            record["entries"] = part.entries
            record["files"] = len(part.sizes)
    record["sent"] = sent
    if rank == 0:
        record["metadata_bytes"] = len(commit(real_parts, world))
        arena = scale.Arena()
        simulated = [scale.rank_part("fsdp2", scale.TINY, r, world, 2, arena) for r in range(world)]
        record["simulated_metadata_bytes"] = len(commit(simulated, world))
        record["commit_s"] = best_of(lambda: commit(real_parts, world))
        record["simulated_commit_s"] = best_of(lambda: commit(simulated, world))
    coll.close()
    dist.barrier()
    record["by_rank"] = saved_by_rank(model, rank, world, out_dir)


def saved_by_rank(model: torch.nn.Module, rank: int, world: int, out: str) -> dict[str, Any]:
    """Two real snapshots of the FSDP2 model (Snapshotter); this rank's view of the second,
    read by its groups (the index's "ranks"), against its view of the whole metadata."""
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter
    from tnt_snapshot_plugin.format.index import INDEX_FNAME
    from tnt_snapshot_plugin.format.torchsnapshot import manifest as mf
    from tnt_snapshot_plugin.format.torchsnapshot import rank_regions

    dirpath = os.path.join(out, f"run{world}")
    saver = Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=False, collective_timeout_s=60))
    saver.train_start(["model"], 0, 0)
    for step in (1, 2):
        saver.save(0, step, {"model": model})
    saver.train_end(0, 2, lambda intra_epoch: {})
    snapshot = os.path.join(dirpath, "epoch_0_step_2")
    with open(os.path.join(snapshot, INDEX_FNAME), "rb") as f:
        regions = rank_regions.RankRegions.from_index(json.load(f))
    with open(os.path.join(snapshot, mf.METADATA_FNAME), "rb") as f:
        data = f.read()
    assert regions is not None, "the index has no 'ranks'"
    got = rank_regions.read_for_rank(lambda a, b: data[a:b], regions, world, rank, snapshot)
    assert got is not None
    whole = mf.rank_view(mf.parse_metadata(data, snapshot), rank)
    view = got[1]
    records = mesh_aliases.loads(data)["manifest"]

    def agrees(path: str) -> bool:  # a sharded entry holds the shards of the groups read
        mine, theirs = view[path], whole[path]
        if mine["type"] not in mf.SHARDED_TYPES:
            return mine == theirs
        own = records.get(f"{rank}/{path}", {}).get("shards") or []  # this rank's own piece
        return (
            mf.global_shape(mine) == mf.global_shape(theirs)
            and all(shard in theirs["shards"] for shard in mine["shards"])
            and all(shard in mine["shards"] for shard in own)
        )

    same = sorted(view) == sorted(whole) and all(agrees(p) for p in whole)
    return {"same": same, "entries_read": len(got[0].manifest), "entries": len(records)}


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    rendezvous, out = sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    run_rank(rank, world, rendezvous, os.path.join(out, f"scale{world}_rank{rank}.json"),
             lambda record: body(rank, world, record, out))


if __name__ == "__main__":
    main()
