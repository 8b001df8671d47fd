"""One rank of tests/test_process_writer.py's 2-rank test: a DDP run whose snapshots each rank's
writer process writes (``Knobs(writer="process")``), then new processes restoring the latest.

Run as ``python tests/process_writer_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``; the
run's URL and storage options are in ``OUTDIR/run.json``. Each phase writes what it saw to
``OUTDIR/PHASE_rank{RANK}.json``:

* ``save``: trains one epoch (5 steps), a snapshot every 2 steps and one at the end; records the
  weights, this process's pid, the writer process's pid after each step, and whether the writer
  process still runs once training has ended.
* ``restore``: restores from the latest snapshot into a unit of other weights; records them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from dist_worker import DDPUnit, loader, weights_digest
from gloo_worker import run_rank
from torchtnt.framework.callback import Callback
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.config import Knobs


def phase_save(rank: int, run: dict[str, Any], record: dict[str, Any]) -> None:
    unit = DDPUnit(seed=0)
    saver = TorchSnapshotSaver(
        run["url"], save_every_n_train_steps=2, storage_options=run["options"], collective_timeout_s=60,
        knob_options=Knobs(writer="process"),
    )
    pids: list[Any] = []

    class Pids(Callback):
        def on_train_start(self, state, unit) -> None:
            process = saver.snapshotter.writer.process
            pids.append(process.pid if process is not None and process.alive() else None)

        def on_train_step_end(self, state, unit) -> None:
            process = saver.snapshotter.writer.process
            pids.append(None if process is None else process.pid)

    train(unit, loader(rank), max_epochs=1, callbacks=[saver, Pids()])
    process = saver.snapshotter.writer.process
    record["weights"] = weights_digest(unit)
    record["pid"] = os.getpid()
    record["writer_pids"] = pids
    record["alive_at_end"] = process is not None and process.alive()


def phase_restore(rank: int, run: dict[str, Any], record: dict[str, Any]) -> None:
    unit = DDPUnit(seed=3 + rank)
    record["restored"] = TorchSnapshotSaver.restore_from_latest(
        run["url"], unit, storage_options=run["options"], collective_timeout_s=60
    )
    record["weights"] = weights_digest(unit)
    record["steps"] = unit.train_progress.num_steps_completed


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    with open(os.path.join(out, "run.json")) as f:
        run = json.load(f)
    rank = int(rank_s)
    body = {"save": phase_save, "restore": phase_restore}[phase]
    run_rank(rank, int(world_s), rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: body(rank, run, record))


if __name__ == "__main__":
    main()
