"""One rank of the hybrid-mesh test in tests/test_fsdp.py: DTensors sharded over one dimension of
a 2 x 2 device mesh and replicated over the other (as hybrid sharding, HSDP, lays them out).

Run as ``python tests/hybrid_mesh_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``; gloo on the
loopback interface only. Each phase writes what it saw to ``OUTDIR/PHASE_rank{RANK}.json``:

* ``hybrid_save`` (4 ranks): snapshots of the state at step 1 (synchronous) and step 2
  (asynchronous) with the plugin's core ``Snapshotter``.
* ``hybrid_restore`` (4 ranks, the same mesh), ``hybrid_world2`` (2 ranks, sharded over a 1-D
  mesh) and ``hybrid_world1`` (1 process, plain tensors): ``restore_from_latest`` into zeros;
  each rank records whether every local value equals the step-2 state's.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from gloo_worker import run_rank

from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, restore_from_latest
from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases
from toy import Holder


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The whole values of step ``step``: rows split 4 + 4 and, unevenly, 3 + 2."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 3, generator=g), "b": torch.randn(5, generator=g), "n": torch.randn(2, 2, generator=g)}


def laid_out(values: dict[str, torch.Tensor], world: int) -> dict[str, Any]:
    """``values`` as this world holds them: 4 ranks, a 2 x 2 mesh ("replicate", "shard") with
    (Replicate(), Shard(0)); 2 ranks, Shard(0) over a 1-D mesh; 1 process, plain tensors. ``n``
    stays replicated over the whole mesh."""
    if world == 1:
        return {key: value.clone() for key, value in values.items()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        sharded, whole = [Replicate(), Shard(0)], [Replicate(), Replicate()]
    else:
        mesh = init_device_mesh("cpu", (world,))
        sharded, whole = [Shard(0)], [Replicate()]
    return {
        "w": distribute_tensor(values["w"], mesh, sharded),
        "b": distribute_tensor(values["b"], mesh, sharded),
        "n": distribute_tensor(values["n"], mesh, whole),
    }


def local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def phase_save(rank: int, world: int, out: str, record: dict[str, Any]) -> None:
    dirpath = os.path.join(out, "snapshots")
    savers = {
        step: Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=step == 2, save_on_train_end=False))
        for step in (1, 2)
    }
    for step, saver in savers.items():
        saver.train_start(["model"], 0, step - 1)
        holder = Holder(laid_out(full_state(step), world))
        assert saver.save(0, step, {"model": holder})
        saver.wait()
        saver.train_end(0, step, lambda intra_epoch: {})
    record["local_rows"] = {key: list(local(value).shape) for key, value in holder.state.items()}
    if rank == 0:
        snapshot = os.path.join(dirpath, "epoch_0_step_2")
        with open(os.path.join(snapshot, ".snapshot_metadata"), "rb") as f:
            manifest = mesh_aliases.loads(f.read())["manifest"]
        record["locations"] = {
            path: [shard["tensor"]["location"] for shard in entry["shards"]]
            for path, entry in manifest.items()
            if entry.get("type") == "DTensor"
        }
        record["files"] = sorted(
            os.path.relpath(os.path.join(parent, name), snapshot)
            for parent, _, names in os.walk(snapshot)
            for name in names
        )


def phase_restore(rank: int, world: int, out: str, record: dict[str, Any]) -> None:
    target = Holder(laid_out({k: torch.zeros_like(v) for k, v in full_state(0).items()}, world))
    record["restored"] = restore_from_latest(os.path.join(out, "snapshots"), {"model": target})
    want, before = laid_out(full_state(2), world), laid_out(full_state(1), world)
    record["types"] = sorted({type(value).__name__ for value in target.state.values()})
    record["equal"] = {key: torch.equal(local(target.state[key]), local(want[key])) for key in want}
    record["wrong_before"] = {key: not torch.equal(local(want[key]), local(before[key])) for key in want}


PHASES: dict[str, Callable[[int, int, str, dict[str, Any]], None]] = {
    "hybrid_save": phase_save,
    "hybrid_restore": phase_restore,
    "hybrid_world2": phase_restore,
    "hybrid_world1": phase_restore,
}


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    run_rank(rank, world, rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: PHASES[phase](rank, world, out, record))


if __name__ == "__main__":
    main()
