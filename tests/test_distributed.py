"""torch.distributed: two real gloo processes on 127.0.0.1, plus the single-process async path.

Each scenario of tests/dist_worker.py runs once per module in two fresh processes (start-up costs
seconds), under a hard deadline: a rank that hangs is killed and the test fails with both ranks'
output, so a deadlock never hangs CI. The tests then assert on what each rank recorded.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import launching
import pytest
import torch.distributed as dist
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format.index import read_local
from tnt_snapshot_plugin.naming import SnapshotName
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD_SIZE = 2

pytestmark = pytest.mark.slow


def run_ranks(scenario: str, out: Path) -> list[dict[str, Any]]:
    """Run ``scenario`` on WORLD_SIZE processes; every rank's record, or a test failure."""
    return launching.run_scenario(WORKER, scenario, WORLD_SIZE, out)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def failure(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks("failure", tmp_path_factory.mktemp("failure"))


@pytest.fixture(scope="module")
def idiom(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks("idiom", tmp_path_factory.mktemp("idiom"))


# ------------------------------------------------------------------------------------------------
# torchtnt's DDP idiom: rank 0 passes the directory, rank 1 passes ""


def test_ddp_idiom_other_ranks_may_pass_an_empty_dirpath(idiom):
    run = idiom[0]["dirpath"]
    assert run.endswith("run")
    assert [r["dirpath"] for r in idiom] == [run, run]
    assert idiom[0]["names"] == ["epoch_0_step_2", "epoch_0_step_4", "epoch_1_step_5"]
    for record in idiom:  # restore_from_latest("") and restore("") on rank 1 use rank 0's path
        assert record["latest_found"] is True
        assert record["latest_weights"] == record["weights"]
        assert record["restored_steps"] == 4


def test_best_checkpoint_config_under_ddp_names_snapshots_by_rank0s_metric(idiom):
    """Rank 1's metric differs (by 10): rank 0's value names every snapshot, best-k keeps the best
    (0.2) and the newest, and restore_from_best("") on rank 1 restores rank 0's pick."""
    assert idiom[0]["best_names"] == ["epoch_0_step_2_val_metric=0.2", "epoch_1_step_5_val_metric=0.6"]
    for record in idiom:
        assert record["best_found"] is True
        assert record["best_steps"] == 2


def test_ddp_idiom_a_bad_dirpath_raises_the_same_error_on_every_rank(idiom):
    """A file, a path below a file, and "" on rank 0: a ConfigError on both ranks, not a
    DistributedError after the collective timeout (which a rank left waiting would raise)."""
    for record in idiom:
        for case in ("a_file", "under_a_file", "empty"):
            assert (record["bad_saver"][case] or "").startswith("ConfigError: "), case
        for case in ("a_file", "empty"):
            assert (record["bad_restore"][case] or "").startswith("ConfigError: "), case
        # Nothing to restore below a file: restore_from_latest returns False on both ranks.
        assert record["bad_restore"]["under_a_file"] is None
        assert "is not a directory" in record["bad_saver"]["a_file"]
        assert "cannot be written" in record["bad_saver"]["under_a_file"]


# ------------------------------------------------------------------------------------------------
# DDP with replicated=["**"] through the torchtnt adapter


def test_constructor_broadcasts_rank0_dirpath(ddp):
    """Each rank passes its own dirpath; both save into rank 0's, and rank 1's is never created."""
    rank0_dir = ddp[0]["dirpath"]
    assert rank0_dir.endswith("run_rank0")
    assert [r["dirpath"] for r in ddp] == [rank0_dir, rank0_dir]
    assert ddp[0]["run_dirs"] == {
        "0": [
            "epoch_0_step_2",
            "epoch_0_step_4",
            "epoch_1_step_10",
            "epoch_1_step_5",
            "epoch_1_step_6",
            "epoch_1_step_8",
            "epoch_2_step_10",
        ],
        "1": None,
    }


def test_checkpoint_collectives_run_on_their_own_gloo_group(ddp):
    """Training runs on a backend that is not "gloo" (a stand-in for NCCL on this CPU machine);
    the saver's collectives run on a separate gloo group over all ranks.

    The scenario also takes asynchronous snapshots with the default preemption handling, whose
    per-step agreement runs on the training thread while the background thread writes: before
    they had separate groups, both ranks deadlocked here until the collective timeout.
    """
    for record in ddp:
        assert record["default_backend"] == "trainingbackend"
        assert record["saver_group_backend"] == "gloo"
        assert record["saver_group_is_world"] is False
        assert record["saver_group_ranks"] == [0, 1]


def _leaves(manifest: dict[str, Any], rank: int, key: str) -> dict[str, Any]:
    prefix = f"{rank}/{key}/"
    return {
        k[len(prefix):]: v
        for k, v in manifest.items()
        if k.startswith(prefix) and v["type"] not in ("DictEntry", "OrderedDictEntry", "ListEntry")
    }


def _stored_bytes(manifest: dict[str, Any], keys: tuple[str, ...]) -> int:
    """Bytes of tensor data stored for ``keys`` on all ranks, each stored range counted once."""
    ranges = set()
    for path, entry in manifest.items():
        rank_key = path.split("/", 2)[1] if path.count("/") >= 2 else None
        if entry["type"] == "TensorEntry" and rank_key in keys:
            start, end = entry["byte_range"] or (0, 0)
            ranges.add((entry["location"], start, end))
    return sum(end - start for _location, start, end in ranges)


def test_replicated_entries_are_written_once(ddp):
    """Model, optimizer and LR scheduler are stored once for both ranks; progress, RNG and
    dataloader entries once per rank and never marked replicated."""
    manifest = ddp[0]["manifest"]
    for key in ("model", "optimizer", "lr_scheduler"):
        leaves = _leaves(manifest, 0, key)
        assert leaves and all(v["replicated"] for v in leaves.values()), key
        assert _leaves(manifest, 1, key) == {}, f"rank 1 stored its own copy of {key}"
    for key in ("train_progress", "eval_progress", "rng_state", "train_dataloader"):
        for rank in (0, 1):
            leaves = _leaves(manifest, rank, key)
            assert leaves, f"rank {rank} has no {key}"
            assert not any(v["replicated"] for v in leaves.values()), f"{key} marked replicated"
    assert _leaves(manifest, 0, "model").keys() == {
        "module.0.weight", "module.0.bias", "module.3.weight", "module.3.bias"
    }

    # Files: the optimizer's pickled objects once, not once per rank as in the same state saved
    # without `replicated`; the optimizer's tensor bytes are halved.
    files, baseline = ddp[0]["files"], ddp[0]["baseline_files"]
    baseline_manifest = ddp[0]["baseline_manifest"]
    objects = {"optimizer/param_groups/0/betas", "optimizer/param_groups/0/foreach", "optimizer/param_groups/0/fused"}
    stored = {manifest[f"0/{o}"]["location"] for o in objects}
    assert len(stored) == len(objects) and stored <= files.keys()
    per_rank = {baseline_manifest[f"{r}/{o}"]["location"] for r in (0, 1) for o in objects}
    assert len(per_rank) == 2 * len(objects) and per_rank <= baseline.keys()
    # A DDP-wrapped module is replicated even without the option, as torchtnt's saver does.
    optimizer_bytes = _stored_bytes(manifest, ("optimizer",))
    assert optimizer_bytes > 0
    assert _stored_bytes(baseline_manifest, ("optimizer",)) == 2 * optimizer_bytes
    assert _stored_bytes(baseline_manifest, ("model",)) == _stored_bytes(manifest, ("model",)) > 0


def test_restore_gives_each_rank_its_own_rng_state(ddp):
    """The ranks' RNGs differ at the snapshot; after restoring into fresh units seeded alike,
    each rank has its own generators back (torch, Python, numpy), and the shared weights."""
    captured = [r["captured"] for r in ddp]
    for generator in ("torch", "python", "numpy"):
        assert captured[0]["rng"][generator] != captured[1]["rng"][generator], generator
    for record in ddp:
        assert record["restored"]["rng"] == record["captured"]["rng"], f"rank {record['rank']}"
        assert record["restored"]["weights"] == record["captured"]["weights"]
        assert (record["restored"]["epochs"], record["restored"]["steps"]) == (0, 4)
    assert captured[0]["weights"] == captured[1]["weights"]  # DDP keeps replicas equal


def test_resume_is_bitwise_on_every_rank(ddp):
    """Interrupted mid-epoch 2 (step 7), resumed from the latest snapshot (step 6) into fresh
    units and loaders with other seeds: every rank ends bitwise equal to an uninterrupted run."""
    for record in ddp:
        assert record["interrupted_error"] == "injected failure at step 7"
        assert record["resume_found"] is True
        assert record["resumed_from_step"] == 6
        assert record["resumed_weights"] == record["reference_weights"], f"rank {record['rank']}"


def test_wall_clock_cadence_follows_rank0_and_every_rank_snapshots_the_same_step(ddp):
    """(dist_worker.wall_clock_phase) rank 0's interval elapses at steps 3 and 7; one step later,
    through the per-step agreement, both ranks snapshot; rank 1 never reads its own clock."""
    assert [record["wall_clock_steps"] for record in ddp] == [[4, 8], [4, 8]]


def test_the_ranks_agree_on_preemption_every_few_steps_and_stop_at_the_same_step(ddp):
    """(dist_worker.agreement_phase) the agreement runs every 4 steps at 1/16 s a step (a
    quarter second of training), not every step; a signal on rank 1 alone during step 10 stops
    both ranks at step 15 with a snapshot of it."""
    for record in ddp:
        assert record["agreement"] == {"polls": [1, 2, 3, 7, 11, 15], "preempted_at": [15], "committed": [15]}
    # each rank wrote its own entries, the commit (rank 0) listed them all, and rank 1 knows the total
    [(path, written)] = ddp[0]["agreement_snapshot"]
    assert ddp[1]["agreement_snapshot"] == [[path, written]]  # (JSON: a list)
    files = read_local(path)["files"]  # from each rank's part of the index
    assert written == sum(files.values()) > 0
    assert sorted(files) == ["batched/0-0", "batched/1-0"]  # each rank's small tensors, packed


def test_only_rank0_holds_the_dirpath_lock(ddp):
    """Under torch.distributed only rank 0 takes the dirpath lock for the run (the ranks are one
    job); it is let go when training ends."""
    assert [r["captured"]["holds_lock"] for r in ddp] == [True, False]
    assert [r["captured"]["lock_file"] for r in ddp] == [True, True]  # one shared dirpath
    assert ".tnt_snapshot.lock" not in ddp[0]["run_dirs"]["0"]


def test_ranks_agree_on_the_staging_path(ddp):
    """torchsnapshot warns on every rank whose path differs from rank 0's: rank 0 names it."""
    for record in ddp:
        assert not [m for m in record["torchsnapshot_warnings"] if "specified a path" in m]


# ------------------------------------------------------------------------------------------------
# A failure on one rank reaches every rank, in bounded time (LAUNCH_DEADLINE_S enforces it)


def test_write_error_on_one_rank_warns_on_every_rank(failure):
    """Rank 1's write of step 4 fails: both ranks warn and train on; step 4 is not committed and
    step 2 stays the newest complete snapshot, restorable on both ranks."""
    for record in failure:
        warn = record["warn"]
        assert len(warn["failed_warnings"]) == 1, warn["failed_warnings"]
        assert "epoch_0_step_4" in warn["failed_warnings"][0]
        assert "injected on rank 1" in warn["failed_warnings"][0]
        assert warn["failures"] == 1
        assert warn["steps"] == 5  # training went on
        assert warn["latest_restored"] is True and warn["latest_steps"] == 2
    assert "rank 1" in failure[0]["warn"]["failed_warnings"][0]  # rank 0 names the failed rank
    assert failure[0]["warn"]["dir"] == ["epoch_0_step_2"]  # no staging left, nothing committed


def test_write_error_on_one_rank_raises_on_every_rank(failure):
    for record in failure:
        assert record["raise"]["error"] == "SnapshotWriteError"
        assert "injected on rank 1" in record["raise"]["message"]
        assert "not committed" in record["raise"]["message"]
    assert failure[0]["raise"]["dir"] == ["epoch_0_step_2"]


def test_every_rank_reports_the_rank_where_a_failure_began(failure):
    """Rank 1's own error against rank 0's that only follows from it (a collective that lost
    its peer): both ranks report rank 1's, and rank 0's never."""
    rank0, rank1 = failure[0]["verdict"], failure[1]["verdict"]
    assert rank1["error"] == "OSError"  # its own, as it was raised
    assert rank0["error"] == "DistributedError"
    assert "rank 1: OSError: [Errno 28] No space left on device (injected on rank 1)" in rank0["message"]
    for verdict in (rank0, rank1):
        assert "No space left on device (injected on rank 1)" in verdict["message"]
        assert "Another rank has probably stopped" not in verdict["message"]
        assert "rank 0" not in verdict["message"]


def test_rank_that_leaves_training_does_not_hang_the_others(failure):
    """Rank 1's state_dict raises at a snapshot and it leaves training while staying alive; rank 0
    stops with a typed DistributedError after collective_timeout_s instead of waiting forever."""
    rank0, rank1 = failure[0]["crash"], failure[1]["crash"]
    assert rank1["error"] == "RuntimeError"
    assert "injected on rank 1" in rank1["message"]
    assert rank0["error"] == "DistributedError" and rank0["is_snapshot_error"]
    assert "collective_timeout_s=5s" in rank0["message"]
    assert "Another rank has probably stopped" in rank0["message"]
    assert [n for n in rank0["dir"] if SnapshotName.parse(n) is not None] == []


# ------------------------------------------------------------------------------------------------
# Asynchronous snapshots without a process group


def test_async_snapshots_without_a_process_group(tmp_path, monkeypatch):
    """Async snapshots work in a single process with no process group, written on a thread of
    their own.

    torchsnapshot-nightly's own ``Snapshot.async_take`` fails there on hosts whose localhost
    resolves to IPv4 only (``dist_store.create_store`` unpacks a 2-tuple socket address into four
    values; upstream meta-pytorch/torchsnapshot#178, open). The plugin calls neither it nor
    ``Snapshot.take``: it stages its own copy of the state and writes it on a background thread.
    """
    import torchsnapshot

    from tnt_snapshot_plugin.saving import writer as writer_job

    assert not (dist.is_available() and dist.is_initialized())

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torchsnapshot's take/async_take must not be used")

    monkeypatch.setattr(torchsnapshot.Snapshot, "take", forbidden)
    monkeypatch.setattr(torchsnapshot.Snapshot, "async_take", forbidden)
    writes: list[str] = []
    real_write = writer_job.SnapshotWriter.write

    def recording_write(self: Any, *args: Any, **kwargs: Any) -> None:
        writes.append(threading.current_thread().name)
        real_write(self, *args, **kwargs)

    monkeypatch.setattr(writer_job.SnapshotWriter, "write", recording_write)

    unit = ToyUnit(seed=0)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, save_on_train_end=False)
    assert saver.snapshotter.config.async_snapshot is True  # the default
    train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])

    assert sorted(os.listdir(tmp_path)) == ["epoch_0_step_2", "epoch_0_step_4"]
    assert len(writes) == 2 and threading.main_thread().name not in writes, writes
    fresh = ToyUnit(seed=5)
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_0_step_4"), fresh)
    assert_bitwise_equal(weights(fresh), weights(unit))


# ------------------------------------------------------------------------------------------------
# Checksums: a damaged file on one rank, every rank falls back together


def test_a_flipped_byte_on_one_rank_makes_every_rank_fall_back_together(tmp_path):
    records = run_ranks("checksum", tmp_path)
    flipped = records[1]["flipped"]
    for record in records:
        assert record["restored"].endswith("epoch_0_step_1"), record
        damaged = [w for w in record["warnings"] if "skipping damaged snapshot" in w]
        assert len(damaged) == 1 and "epoch_0_step_2" in damaged[0]
        assert "rank 1" in damaged[0] and flipped in damaged[0] and "checksum" in damaged[0]
        assert record["values_of_step_1"] and record["rng_of_step_1"]


# ------------------------------------------------------------------------------------------------
# A user's load_state_dict that fails on one rank stops every rank


def test_a_users_load_state_dict_failing_on_one_rank_stops_every_rank(tmp_path):
    """Rank 0 loads everything and rank 1's load_state_dict fails: rank 0 does not return to
    train on alone (and wait in training's first collective for the process group's timeout);
    it raises DistributedError naming rank 1's error, and rank 1 raises its own, as in one
    process."""
    rank0, rank1 = run_ranks("own_error", tmp_path)
    assert (rank1["error"], rank1["message"]) == ("ValueError", "this rank's own load_state_dict failed")
    assert rank0["error"] == "DistributedError", rank0
    assert "rank 1: b.load_state_dict() raised ValueError: this rank's own load_state_dict failed" in rank0["message"]
    assert rank0["after"] == rank1["after"] == [0, 1]
