"""One rank of the multi-process DCP-format tests in tests/test_dcp_format.py.

Run as ``python tests/dcp_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``, one process per
rank (tests/launching.py), in a gloo group of its own; each writes ``OUTDIR/PHASE_rank{RANK}.json``:

* ``save`` (2 ranks): FSDP2 (``fully_shard`` on CPU) and DDP, each trained 5 steps with the
  torchtnt adapter's saver in DCP's format (snapshots at steps 2 and 4), each rank with its own
  RNG seed and a per-rank tally; records the whole state, this rank's RNG state and tally at
  step 4, the files each rank wrote and (rank 0) the entries of the metadata.
* ``restore`` (2 ranks, new processes): restore_from_latest into freshly built units (other
  seeds): the whole state, the RNG state and the tally of each rank; and torchtnt's own
  ``DistributedCheckpointSaver.restore`` of the FSDP2 snapshot.
* ``world1`` / ``world4`` (1 and 4 ranks): the same restores without the tally (saved per rank
  with different values: refused by name, which ``tally`` records), resharded by DCP's planner;
  on one rank, also stock ``dcp.load`` into an unsharded model.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from fsdp_worker import Unit, digest, loader, whole_state
from gloo_worker import run_rank
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.train import train

from tnt_snapshot_plugin import StateMismatchError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

#: FSDP2 (sharded: DTensor values) and DDP (the model replicated, the optimizer saved per rank)
WRAPPINGS = ("fsdp2", "ddp")


def rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


class Capture(Callback):
    """The whole state, this rank's RNG state and tally after step 4 (before the saver's hook,
    which snapshots them as they are)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def on_train_step_end(self, state: State, unit: Unit) -> None:
        if unit.train_progress.num_steps_completed == 4:
            self.state = {"whole": whole_state(unit), "rng": rng_digest(), "tally": tally(unit)}


def tally(unit: Unit) -> Any:
    return [unit.tally.state["rank"].tolist(), unit.tally.state["note"]] if hasattr(unit, "tally") else None


def phase_save(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping in WRAPPINGS:
        unit = Unit(wrapping, seed=0, per_rank=True)
        torch.manual_seed(100 + rank)  # per-rank RNG states
        capture = Capture()
        saver = TorchSnapshotSaver(
            os.path.join(out, wrapping), save_every_n_train_steps=2, save_on_train_end=False,
            collective_timeout_s=60, format="dcp",
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, loader(rank), max_epochs=1, callbacks=[capture, saver])
        newest = os.path.join(out, wrapping, "epoch_0_step_4")
        record[wrapping] = {
            "at_step_4": capture.state,
            "committed": [os.path.basename(r.path) for r in saver.snapshotter.stats.committed],
            "warnings": [str(w.message) for w in caught if "snapshot" in str(w.message)],
            "files": sorted(os.listdir(os.path.join(newest, str(rank)))),
        }
        if rank == 0:
            import pickle

            with open(os.path.join(newest, ".metadata"), "rb") as f:  # the test's own snapshot
                record[wrapping]["entries"] = sorted(pickle.load(f).state_dict_metadata)


def restore_into(wrapping: str, rank: int, out: str, per_rank: bool) -> dict[str, Any]:
    unit = Unit(wrapping, seed=7 + rank, per_rank=per_rank)
    if per_rank:
        unit.tally.state = {"rank": torch.tensor([-1]), "note": ""}
    torch.manual_seed(999)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result["restored"] = TorchSnapshotSaver.restore_from_latest(
                os.path.join(out, wrapping), unit, collective_timeout_s=60
            )
        except StateMismatchError as exc:
            result["refused"] = str(exc)
            return result
    result["warnings"] = [str(w.message) for w in caught if "snapshot" in str(w.message)]
    result["steps"] = unit.train_progress.num_steps_completed
    result["whole"] = whole_state(unit)
    result["rng"] = rng_digest()
    result["tally"] = tally(unit)
    return result


def phase_restore(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping in WRAPPINGS:
        record[wrapping] = restore_into(wrapping, rank, out, per_rank=True)
    # torchtnt's own DCP restore reads the FSDP2 snapshot (its optimizer state dict is keyed by
    # parameter ids, the plugin saves FSDP2's by names: the optimizer is left out)
    from torchtnt.framework.callbacks.checkpointer_types import RestoreOptions
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver

    unit = Unit("fsdp2", seed=7 + rank, per_rank=True)
    DistributedCheckpointSaver.restore(
        os.path.join(out, "fsdp2", "epoch_0_step_4"), unit, restore_options=RestoreOptions(restore_optimizers=False)
    )
    record["torchtnt"] = {
        "model": {k: v for k, v in whole_state(unit).items() if k.startswith("model/")},
        "steps": unit.train_progress.num_steps_completed,
        "tally": tally(unit),
    }


def phase_other_world(rank: int, out: str, record: dict[str, Any]) -> None:
    record["tally"] = restore_into("fsdp2", rank, out, per_rank=True)
    for wrapping in WRAPPINGS:
        record[wrapping] = restore_into(wrapping, rank, out, per_rank=False)
    if dist.get_world_size() == 1:
        # stock DCP reads the 2-rank snapshot's sharded model into a whole, unsharded one
        import torch.distributed.checkpoint as dcp

        torch.manual_seed(5)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        state = {"app_state": {"model": plain.state_dict()}}
        dcp.load(state, checkpoint_id=os.path.join(out, "fsdp2", "epoch_0_step_4"))
        record["stock"] = {f"model/{k}": digest(v) for k, v in sorted(state["app_state"]["model"].items())}


PHASES: dict[str, Callable[[int, str, dict[str, Any]], None]] = {
    "save": phase_save,
    "restore": phase_restore,
    "world1": phase_other_world,
    "world4": phase_other_world,
}


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    run_rank(rank, world, rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: PHASES[phase](rank, out, record))


if __name__ == "__main__":
    main()
