"""One rank of tests/test_s3.py's 2-rank test: a DDP run snapshotting to moto's S3 server, then
new processes restoring from the latest snapshot there.

Run as ``python tests/s3_ranks_worker.py PHASE RANK WORLD_SIZE RENDEZVOUS OUTDIR``; the run's URL
and storage options are in ``OUTDIR/s3.json``. Each phase writes what it saw to
``OUTDIR/PHASE_rank{RANK}.json``:

* ``save``: trains one epoch (5 steps) with the torchtnt adapter's saver, a snapshot every 2
  steps and one at the end; records the weights and the parts of the index each rank wrote.
* ``restore``: restores from the latest snapshot into a unit of other weights; records them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from dist_worker import DDPUnit, loader, weights_digest
from gloo_worker import run_rank
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.stores.s3 import S3Store


def written_parts() -> list[str]:
    """The files of the index's parts this process writes (``.tnt_snapshot_index/R.json``)."""
    written: list[str] = []
    write_payload = S3Store.write_payload

    def recording(store: S3Store, name: str, rel: str, *args: Any, **kwargs: Any) -> Any:
        if rel.startswith(".tnt_snapshot_index/"):
            written.append(f"{name}/{rel}")
        return write_payload(store, name, rel, *args, **kwargs)

    S3Store.write_payload = recording  # type: ignore[method-assign]
    return written


def phase_save(rank: int, s3: dict[str, Any], record: dict[str, Any]) -> None:
    written = written_parts()
    unit = DDPUnit(seed=0)
    saver = TorchSnapshotSaver(
        s3["url"], save_every_n_train_steps=2, storage_options=s3["options"], collective_timeout_s=60
    )
    train(unit, loader(rank), max_epochs=1, callbacks=[saver])
    record["weights"] = weights_digest(unit)
    record["parts_written"] = written


def phase_restore(rank: int, s3: dict[str, Any], record: dict[str, Any]) -> None:
    unit = DDPUnit(seed=3 + rank)
    record["restored"] = TorchSnapshotSaver.restore_from_latest(
        s3["url"], unit, storage_options=s3["options"], collective_timeout_s=60
    )
    record["weights"] = weights_digest(unit)
    record["steps"] = unit.train_progress.num_steps_completed


def main() -> None:
    phase, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    with open(os.path.join(out, "s3.json")) as f:
        s3 = json.load(f)
    rank = int(rank_s)
    body = {"save": phase_save, "restore": phase_restore}[phase]
    run_rank(rank, int(world_s), rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"),
             lambda record: body(rank, s3, record))


if __name__ == "__main__":
    main()
