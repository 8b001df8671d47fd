"""Worker of tests/test_failure_kinds_distributed.py: one rank of a 2-rank gloo group.

Usage: failure_kinds_worker.py SCENARIO RANK WORLD RENDEZVOUS OUT. Each scenario trains with real
torchtnt ``train()`` on every rank and records what each rank saw.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings
from typing import Any, Callable

import torch.distributed as dist
from gloo_worker import run_rank
from torchtnt.framework.train import train

from tnt_snapshot_plugin import SnapshotFailedWarning, UnrestorableStateError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.stores import LocalStore
from tnt_snapshot_plugin.testing import FaultyStore, register
from toy import Holder, StatefulLoader, ToyUnit, make_data


def local_config() -> Any:
    Config = collections.namedtuple("Config", "lr")  # pickle cannot find it by name
    return Config(0.1)


def scenario_unencodable(rank: int, out: str, record: dict[str, Any]) -> None:
    """Only rank 1's state holds a value pickle refuses: every rank stops at the first snapshot
    with UnrestorableStateError, under on_save_error="warn"."""
    dirpath = os.path.join(out, "run")
    unit = ToyUnit(seed=0)
    unit.extra = Holder({"config": local_config() if rank == 1 else {"lr": 0.1}})
    saver = TorchSnapshotSaver(
        dirpath,
        save_every_n_train_steps=2,
        on_save_error="warn",
        async_snapshot=False,
        preemption_signals=[],
        collective_timeout_s=60,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            train(unit, StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver])
            record["error"] = None
        except Exception as exc:
            record["error"] = type(exc).__name__
            record["is_unrestorable"] = isinstance(exc, UnrestorableStateError)
            record["message"] = str(exc)
    record["steps"] = unit.train_progress.num_steps_completed
    record["failed_warnings"] = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    dist.barrier()
    record["dir"] = sorted(n for n in os.listdir(dirpath) if not n.startswith(".tnt_snapshot"))


def scenario_no_space_on_one_rank(rank: int, out: str, record: dict[str, Any]) -> None:
    """keep_last_n_snapshots=2; rank 1 runs out of space once, writing step 6: the ranks agree,
    rank 0 deletes what retention would delete once step 6 commits, and every rank writes it
    again; every due snapshot commits."""
    dirpath = os.path.join(out, "run")
    faulty = FaultyStore(LocalStore(dirpath))
    if rank == 1:
        faulty.inject(
            "write_payload",
            OSError(28, "No space left on device (injected on rank 1)"),
            times=1,
            match=lambda staging, rel: "epoch_0_step_6" in staging,
        )
    url = register("nospace", faulty)
    unit = ToyUnit(seed=0)
    saver = TorchSnapshotSaver(
        url,
        save_every_n_train_steps=2,
        keep_last_n_snapshots=2,
        save_on_train_end=False,
        preemption_signals=[],
        collective_timeout_s=60,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(unit, StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver])
    stats = saver.snapshotter.stats
    record["committed"] = [r.step for r in stats.committed]
    record["failures"] = stats.failures
    record["failed_warnings"] = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    record["space_warnings"] = [str(w.message) for w in caught if "ran out of space" in str(w.message)]
    dist.barrier()
    record["dir"] = sorted(n for n in os.listdir(dirpath) if SnapshotName.parse(n) is not None)


SCENARIOS: dict[str, Callable[[int, str, dict[str, Any]], None]] = {
    "unencodable": scenario_unencodable,
    "no_space": scenario_no_space_on_one_rank,
}


def main() -> None:
    scenario, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    run_rank(
        rank, world, rendezvous, os.path.join(out, f"rank{rank}.json"),
        lambda record: SCENARIOS[scenario](rank, out, record), timeout_s=90,
    )


if __name__ == "__main__":
    main()
