"""Interop entry kind by entry kind, both directions (issue 11).

What the plugin's torchtnt saver writes (asynchronous and synchronous snapshots) restores bitwise
with stock torchsnapshot (``Snapshot.restore`` into fresh objects, ``read_object`` for single
entries) and with torchtnt 0.2.4's own ``TorchSnapshotSaver.restore``, in a subprocess that never
imports the plugin. What stock ``Snapshot.take`` and torchtnt's own saver write restores bitwise
with the plugin. The kinds: dense float32 (NaN, -0.0, inf), float64, bfloat16 (odd length), int64,
bool, uint8, 0-d, an empty 2-d tensor, the copy of a non-contiguous tensor, 300 small tensors
(packed), a 5.6 MB tensor (a ChunkedTensor when stock writes it), the primitives int, float, str,
bool, bytes, objects (tuple, set, numpy array, a nested dict with int keys and a key holding "/",
an OrderedDict, a list of mixed values, None), an Adam optimizer with state, an LR scheduler, the
train progress and the torch RNG. Sharded kinds: tests/test_fsdp.py. tests/test_interop.py keeps
the resume-level checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from interop_kinds_worker import KindsUnit, batches, differences, unit_state
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

WORKER = os.path.join(os.path.dirname(__file__), "interop_kinds_worker.py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")  # gloo over loopback only
    return env


def _run_worker(*args: str) -> None:
    env = _env()
    done = subprocess.run(
        [sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"worker {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def _only_snapshot(dirpath) -> str:
    names = os.listdir(dirpath)
    assert names == ["epoch_1_step_3"], names
    return str(dirpath / names[0])


def test_stock_torchsnapshot_and_torchtnt_restore_every_kind_the_plugin_wrote(tmp_path):
    unit = KindsUnit(seed=0)
    savers = [
        TorchSnapshotSaver(str(tmp_path / "async"), save_every_n_epochs=1, async_snapshot=True),
        # synchronous, and with every entry but the progress and RNG marked replicated; no signal
        # handler of its own (two savers' handlers would be uninstalled out of order)
        TorchSnapshotSaver(str(tmp_path / "sync"), save_every_n_epochs=1, async_snapshot=False, replicated=["**"],
                           preemption_signals=[]),
    ]
    train(unit, batches(), max_epochs=1, callbacks=savers)
    assert unit.optimizer.state, "the optimizer has state to save"
    snapshots = [_only_snapshot(tmp_path / "async"), _only_snapshot(tmp_path / "sync")]
    ref = tmp_path / "ref.pt"
    torch.save({"state": unit_state(unit), "torch_rng": torch.get_rng_state()}, ref)

    out = tmp_path / "report.json"
    _run_worker("check-plugin-written", str(out), str(ref), *snapshots)
    _report_failures(json.loads(out.read_text()), checks=6)


def _report_failures(report: dict[str, list[str]], checks: int) -> None:
    assert report.pop("plugin modules imported") == [], "the stock side imported the plugin"
    assert len(report) == checks, sorted(report)
    failed = {check: found for check, found in report.items() if found}
    assert not failed, "what stock torchsnapshot / torchtnt restored differs from what was saved:\n" + "\n".join(
        f"[{check}]\n  " + "\n  ".join(found) for check, found in sorted(failed.items())
    )


def test_stock_torchsnapshot_reads_every_rank_of_a_snapshot_two_ranks_wrote(tmp_path):
    """Two gloo ranks save with ``replicated`` (every key but ``per_rank``, progress and RNG):
    stock torchsnapshot, one process without a process group, restores rank 0's view and reads
    each rank's entries, replicated ones included, with ``read_object``."""
    snapshots = tmp_path / "snapshots"
    ranks = [
        subprocess.Popen(
            [sys.executable, WORKER, "write-two-ranks", str(rank), str(tmp_path / "rendezvous"), str(snapshots)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank} failed:\n{output[-5000:]}"
    out = tmp_path / "report.json"
    _run_worker("check-two-ranks", str(out), str(snapshots))
    _report_failures(json.loads(out.read_text()), checks=2)


def test_the_plugin_restores_every_kind_stock_torchsnapshot_and_torchtnt_wrote(tmp_path):
    _run_worker("write-stock", str(tmp_path))
    refs = torch.load(tmp_path / "refs.pt", weights_only=False)
    assert sorted(os.listdir(tmp_path / "torchtnt")) == ["epoch_1_train_step_3", "epoch_2_train_step_6"]
    metadata = (tmp_path / "stock" / ".snapshot_metadata").read_text()
    assert "ChunkedTensor" in metadata, "the stock snapshot holds a chunked tensor"
    failed: dict[str, list[str]] = {}

    fresh = KindsUnit(seed=8, fresh=True, stock_writable=True)
    torch.manual_seed(99)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "torchtnt"), fresh)
    failed["torchtnt's saver -> restore_from_latest"] = differences(
        refs["torchtnt"]["state"], unit_state(fresh)
    ) + differences(refs["torchtnt"]["torch_rng"], torch.get_rng_state(), "torch RNG")

    fresh = KindsUnit(seed=9, fresh=True, stock_writable=True)
    torch.manual_seed(99)
    TorchSnapshotSaver.restore(str(tmp_path / "stock"), fresh)
    failed["Snapshot.take -> restore"] = differences(refs["stock"]["state"], unit_state(fresh)) + differences(
        refs["stock"]["torch_rng"], torch.get_rng_state(), "torch RNG"
    )

    failed = {check: found for check, found in failed.items() if found}
    assert not failed, "what the plugin restored differs from what was saved:\n" + "\n".join(
        f"[{check}]\n  " + "\n  ".join(found) for check, found in sorted(failed.items())
    )
