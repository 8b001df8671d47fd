"""One rank of the two-rank tests of ``tnt-snapshot convert`` in tests/test_convert.py.

Run as ``python tests/convert_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``, one process per
rank (tests/launching.py), in a gloo group of its own; each writes ``OUTDIR/PHASE_rank{RANK}.json``:

* ``save`` (2 ranks): a DDP unit (the model replicated, the optimizer, the RNG states and a tally
  saved per rank, each rank's own) trained 5 steps with the torchtnt adapter's saver in
  torchsnapshot's format, and an FSDP2 unit (DTensor values) in DCP's format and in
  torchsnapshot's, each snapshotting at steps 2 and 4; records the state of each at step 4.
* ``restore`` (2 ranks, new processes): each snapshot ``OUTDIR/RESTORE/NAME/epoch_0_step_4`` the
  test wrote by converting, restored by path into a freshly built unit (other seeds): its whole
  state, RNG state and tally.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Callable

import torch
from dcp_worker import Capture, rng_digest, tally
from fsdp_worker import Unit, loader, whole_state
from gloo_worker import run_rank
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

#: (wrapping, format) of each run saved
SAVED = (("ddp", "torchsnapshot"), ("fsdp2", "dcp"), ("fsdp2", "torchsnapshot"))
#: the snapshots the test converted, by name, restored into each wrapping
RESTORE = "restore_from"


def phase_save(rank: int, out: str, record: dict[str, Any]) -> None:
    for wrapping, fmt in SAVED:
        unit = Unit(wrapping, seed=0, per_rank=True)
        torch.manual_seed(100 + rank)  # per-rank RNG states
        capture = Capture()
        saver = TorchSnapshotSaver(
            os.path.join(out, f"{wrapping}_{fmt}"), save_every_n_train_steps=2, save_on_train_end=False,
            collective_timeout_s=60, format=fmt,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, loader(rank), max_epochs=1, callbacks=[capture, saver])
        record[f"{wrapping}_{fmt}"] = {
            "at_step_4": capture.state,
            "warnings": [str(w.message) for w in caught if "snapshot" in str(w.message)],
        }


def phase_restore(rank: int, out: str, record: dict[str, Any]) -> None:
    with open(os.path.join(out, RESTORE, "plan.json")) as f:
        plan = json.load(f)  # name -> wrapping
    for name, wrapping in sorted(plan.items()):
        unit = Unit(wrapping, seed=7 + rank, per_rank=True)
        unit.tally.state = {"rank": torch.tensor([-1]), "note": ""}
        torch.manual_seed(999)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            TorchSnapshotSaver.restore(os.path.join(out, RESTORE, name, "epoch_0_step_4"), unit, collective_timeout_s=60)
        record[name] = {
            "steps": unit.train_progress.num_steps_completed,
            "whole": whole_state(unit),
            "rng": rng_digest(),
            "tally": tally(unit),
            "warnings": [str(w.message) for w in caught if "snapshot" in str(w.message)],
        }


PHASES: dict[str, Callable[[int, str, dict[str, Any]], None]] = {"save": phase_save, "restore": phase_restore}


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    run_rank(rank, world, rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: PHASES[phase](rank, out, record))


if __name__ == "__main__":
    main()
