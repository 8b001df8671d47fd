"""One rank of the FSDP / world-size tests in tests/test_fsdp.py.

Run as ``python tests/fsdp_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``, one process per
rank, meeting through a FileStore at RENDEZVOUS; gloo on the loopback interface only. Each phase
covers every wrapping in one process group and writes what it saw to ``OUTDIR/PHASE_rank{RANK}.json``:

* ``save`` (2 ranks): for each wrapping, train 5 steps with the torchtnt adapter's saver
  (snapshots at steps 2 and 4); record the whole state at step 4 and the weights after step 5.
* ``restore`` (2 ranks, new processes): restore the newest snapshot into freshly built units
  (other seeds), record the whole state, train the remaining step, record the weights.
* ``world1`` (1 rank): the same restores into a world of one process.
* ``world3`` (3 ranks): the same restores into a world of three processes.

``world1`` and ``world3`` also restore a copy of the ``ddp`` snapshots whose newest has a flipped
byte in every file of rank 1's (``ddp_damaged``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from gloo_worker import run_rank
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

from tnt_snapshot_plugin import StateMismatchError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.saving.staging import Stager, local_shards
from toy import Holder, StatefulLoader, make_data

WRAPPINGS = tuple(os.environ.get("FSDP_WORKER_WRAPPINGS", "fsdp1_sharded,fsdp1_full,fsdp2,ddp").split(","))
STEPS = 5


def build_model(wrapping: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if wrapping.startswith("fsdp1"):
        from torch.distributed.fsdp import (
            FullStateDictConfig,
            FullyShardedDataParallel,
            StateDictType,
        )

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        if wrapping == "fsdp1_sharded":
            FullyShardedDataParallel.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        else:
            FullyShardedDataParallel.set_state_dict_type(
                model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)
            )
    elif wrapping == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrapping == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model  # "plain": unwrapped


class Unit(TrainUnit[Any]):
    def __init__(self, wrapping: str, seed: int, per_rank: bool = False) -> None:
        super().__init__()
        self.model = build_model(wrapping, seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05, weight_decay=0.1)
        if per_rank:  # state that differs between ranks by nature (a per-rank tally, say)
            self.tally = Holder({"rank": torch.tensor([dist.get_rank()]), "note": f"rank {dist.get_rank()}"})

    def train_step(self, state: State, data: Any) -> None:
        x, y = data
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def whole_state(unit: Unit) -> dict[str, str]:
    """A digest of every parameter and optimizer state value, gathered whole (a collective)."""
    full = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(unit.model, options=full)
    optim = get_optimizer_state_dict(unit.model, unit.optimizer, options=full)
    out = {}
    for name, value in sorted(model.items()):
        out[f"model/{name}"] = digest(value)
    for name, per_param in sorted(optim["state"].items()):
        for field, value in sorted(per_param.items()):
            out[f"optim/{name}/{field}"] = digest(value)
    return out


def digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        t = value.detach().cpu().contiguous()
        return f"{list(t.shape)}:{hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]}"
    return repr(value)


class Capture(Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.state: dict[str, str] = {}

    def on_train_step_end(self, state: State, unit: Unit) -> None:
        if unit.train_progress.num_steps_completed == self.at_step:
            self.state = whole_state(unit)


def staging_check(unit: Unit) -> dict[str, Any]:
    """Stage the model's state as an asynchronous snapshot does, then change the parameters:
    the staged copy must keep the old values (of this rank's shards) and the tensor types."""
    before = {k: [t.clone() for t in local_shards(v)] for k, v in unit.model.state_dict().items()}
    staged = Stager().stage({"model": unit.model})["model"].state_dict()
    with torch.no_grad():
        for param in unit.model.parameters():
            param.add_(1.0)
    after = unit.model.state_dict()

    def same(a: dict[str, Any]) -> bool:
        return all(
            torch.equal(x, y)
            for k in before
            for x, y in zip(before[k], local_shards(a[k]), strict=True)
        )

    return {
        "types": sorted({type(v).__name__ for v in staged.values()}),
        "staged_kept_values": same(staged),
        "originals_changed": not same(after),
    }


def loader(rank: int) -> StatefulLoader:
    return StatefulLoader(make_data(4 * STEPS, seed=rank), seed=10 * rank)


def phase_save(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping in WRAPPINGS:
        unit = Unit(wrapping, seed=0, per_rank=wrapping == "ddp")
        torch.manual_seed(100 + rank)  # per-rank RNG states
        capture = Capture(at_step=4)
        saver = TorchSnapshotSaver(
            os.path.join(out, wrapping),
            save_every_n_train_steps=2,
            save_on_train_end=False,
            collective_timeout_s=60,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, loader(rank), max_epochs=1, callbacks=[capture, saver])
        record[wrapping] = {
            "at_step_4": capture.state,
            "final": whole_state(unit),
            "warnings": [str(w.message) for w in caught],
            "committed": [os.path.basename(r.path) for r in saver.snapshotter.stats.committed],
            "staging": staging_check(unit),
        }
        if rank == 0:
            from torchsnapshot import Snapshot

            manifest = Snapshot(os.path.join(out, wrapping, "epoch_0_step_4")).metadata.manifest
            record[wrapping]["entry_types"] = sorted(
                {type(e).__name__ for path, e in manifest.items() if path.split("/")[1] in ("model", "optimizer")}
            )
    if rank == 0:
        with open(os.path.join(out, WRAPPINGS[0], "epoch_0_step_4", ".tnt_snapshot_index.json")) as f:
            record["index_world_size"] = json.load(f).get("world_size")


def restore_into(
    wrapping: str, rank: int, out: str, seed: int, with_loader: bool, per_rank: bool = False, dirname: str = ""
) -> dict[str, Any]:
    unit = Unit(wrapping, seed=seed, per_rank=per_rank)
    data = loader(rank)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result["restored"] = TorchSnapshotSaver.restore_from_latest(
                os.path.join(out, dirname or wrapping),
                unit,
                train_dataloader=data if with_loader else None,
                collective_timeout_s=60,
            )
        except StateMismatchError as exc:
            result["error"] = type(exc).__name__
            result["message"] = str(exc)
            return result
    result["warnings"] = [str(w.message) for w in caught]
    result["steps"] = unit.train_progress.num_steps_completed
    result["state"] = whole_state(unit)
    if with_loader:
        train(unit, data, max_epochs=1)
        result["final"] = whole_state(unit)
    return result


def phase_restore(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping in WRAPPINGS:
        record[wrapping] = restore_into(wrapping, rank, out, seed=7 + rank, with_loader=True)
    record["titan_fsdp2"] = restore_titan(rank, out)


def restore_titan(rank: int, out: str) -> dict[str, Any]:
    """A torchtitan-layout checkpoint of an unwrapped model (stock ``dcp.save`` by rank 0: the
    parameters at the top level, ``optimizer`` flattened, ``train_state``), restored into an
    FSDP2 unit on every rank: its whole state, and the saved one."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(out, "titan", "step-3")
    source = Unit("plain", seed=11)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    source.model(x).pow(2).mean().backward()
    source.optimizer.step()
    if rank == 0:
        state: dict[str, Any] = dict(source.model.state_dict())
        state["optimizer"] = get_optimizer_state_dict(
            source.model, source.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        state["train_state"] = {"step": 3, "ntokens_seen": 96}
        dcp.save(state, checkpoint_id=path, no_dist=True)
    dist.barrier()
    unit = Unit("fsdp2", seed=12 + rank)
    TorchSnapshotSaver.restore(path, unit, collective_timeout_s=60)
    return {"expected": whole_state(source), "state": whole_state(unit), "steps": unit.train_progress.num_steps_completed}


def damaged_copy(rank: int, out: str, dirname: str) -> None:
    """Rank 0 copies the ``ddp`` snapshots to ``out/dirname`` and flips a byte in every file of
    rank 1's in the newest (rank 1's copy of the weights, which rank 0 compares with its own on
    another world size); the others wait for it."""
    if rank == 0:
        target = os.path.join(out, dirname)
        shutil.copytree(os.path.join(out, "ddp"), target)
        newest = os.path.join(target, "epoch_0_step_4")
        files = [
            os.path.join(parent, name)
            for parent, _dirs, names in os.walk(newest)
            for name in names
            if os.path.relpath(os.path.join(parent, name), newest).startswith(("1/", "batched/1-"))
        ]
        assert files, f"no file of rank 1 in {newest}"
        for path in files:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()


def phase_world1(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping in WRAPPINGS:
        record[wrapping] = restore_into(wrapping, rank, out, seed=7, with_loader=False)
    # The tally was saved per rank, with different values: it cannot map to one rank.
    record["ddp_per_rank"] = restore_into("ddp", rank, out, seed=7, with_loader=False, per_rank=True)
    damaged_copy(rank, out, "ddp_damaged_world1")
    record["ddp_damaged"] = restore_into("ddp", rank, out, seed=7, with_loader=False, dirname="ddp_damaged_world1")


def phase_world3(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping in WRAPPINGS:
        record[wrapping] = restore_into(wrapping, rank, out, seed=7, with_loader=False)
    record["ddp_per_rank"] = restore_into("ddp", rank, out, seed=7, with_loader=False, per_rank=True)
    damaged_copy(rank, out, "ddp_damaged_world3")
    record["ddp_damaged"] = restore_into("ddp", rank, out, seed=7, with_loader=False, dirname="ddp_damaged_world3")


PHASES: dict[str, Callable[[int, str, dict[str, Any]], None]] = {
    "save": phase_save,
    "restore": phase_restore,
    "world1": phase_world1,
    "world3": phase_world3,
}


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    run_rank(rank, world, rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: PHASES[phase](rank, out, record))


if __name__ == "__main__":
    main()
