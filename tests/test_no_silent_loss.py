"""No silent loss (issue 10): commit order, retention that never deletes the wrong run or what the
plugin did not write, two jobs on one dirpath, and the smaller holes.

Real torchtnt ``train``, real torchsnapshot writes, real processes for the two-job and SIGKILL
cases. Fakes only in the pure-core tests of retention.py and the writer rules.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from dir_listing import complete_in_commit_order, staging_by_name

import toy
from tnt_snapshot_plugin import (
    ConfigError,
    SnapshotError,
    SnapshotFailedWarning,
    SnapshotFallbackWarning,
    SnapshotNotFoundError,
    SnapshotsAheadWarning,
    hookimpl,
    policies,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import retention
from tnt_snapshot_plugin.restoring import restore_from_latest
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.stores import WRITER_FNAME, LocalStore
from tnt_snapshot_plugin.stores import ownership as writers
from toy import ToyUnit, assert_bitwise_equal, dead_pid, weights

TESTS = Path(__file__).resolve().parent


def index_of(dirpath, name) -> dict:
    return json.loads((Path(dirpath) / name / INDEX_FNAME).read_text())


#: toy.train_toy with no preemption signal handler installed
train_toy = functools.partial(toy.train_toy, preemption_signals=[])


def restored_from_latest(dirpath):
    fresh = ToyUnit(seed=99)
    path = restore_from_latest(str(dirpath), dict(fresh.app_state()), optional_keys=["train_dataloader"])
    return path, fresh


# ------------------------------------------------------------------------------------------------
# Pure core: retention.py and the writer rules


def rec(text, seq=None, ours=True):
    return retention.Listed(SnapshotName.parse(text), seq=seq, ours=ours)


def test_commit_order_puts_sequenced_snapshots_after_the_others_by_seq():
    listed = [
        rec("epoch_2_step_9", seq=1),
        rec("epoch_0_step_1", seq=3),
        rec("epoch_5_train_step_50", ours=False),
        rec("epoch_3_step_30", seq=None),  # an older version of the plugin: no seq
    ]
    order = [r.text for r in retention.commit_order(listed)]
    assert order == ["epoch_3_step_30", "epoch_5_train_step_50", "epoch_2_step_9", "epoch_0_step_1"]
    assert retention.next_seq(listed) == 4
    assert retention.next_seq([rec("epoch_0_step_1", seq=None)]) == 1


def test_keep_last_n_counts_only_ours_in_commit_order_and_spares_newer_and_newest():
    listed = [
        rec("epoch_0_step_1_acc=0.9", ours=False),
        rec("epoch_9_step_90", seq=1),
        rec("epoch_9_step_95", seq=2),
        rec("epoch_0_step_2", seq=3),
        rec("epoch_0_step_4", seq=4),
    ]
    assert [r.text for r in policies.to_delete(listed, 2)] == ["epoch_9_step_90", "epoch_9_step_95"]
    assert [r.text for r in policies.to_delete(listed, 3)] == ["epoch_9_step_90"]
    assert policies.to_delete(listed, 4) == []
    # never the newest of the directory, even when it is not the plugin's own
    foreign_newest = [rec("epoch_0_step_1", seq=1), rec("epoch_0_step_2", seq=2), rec("epoch_7_train_step_7", ours=False)]
    assert [r.text for r in policies.to_delete(foreign_newest, 1)] == ["epoch_0_step_1"]
    assert policies.to_delete(listed, 1, protect=["epoch_9_step_90"])[0].text == "epoch_9_step_95"


def test_a_writer_is_gone_only_when_provably_so():
    host = socket.gethostname()
    now = time.time()
    live_run = writers.new_run_id()
    assert writers.writer_gone({"host": host, "pid": dead_pid(), "run_id": "x", "started_at": now})
    assert writers.writer_gone({"host": "elsewhere", "pid": 1, "run_id": "x", "started_at": now}) is None
    assert writers.writer_gone({"host": "elsewhere", "pid": 1, "run_id": "x", "started_at": now - 2 * writers.STALE_AFTER_S})
    assert writers.writer_gone({"host": host, "pid": os.getpid(), "run_id": live_run, "started_at": now}) is None
    assert writers.writer_gone({"host": host, "pid": os.getpid(), "run_id": "ended0run", "started_at": now})
    # a live pid whose process started after the write began is not the writer (pid reuse)
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert writers.writer_gone({"host": host, "pid": later.pid, "run_id": "x", "started_at": now - 100})
        assert writers.writer_gone({"host": host, "pid": later.pid, "run_id": "x", "started_at": now + 100}) is None
    finally:
        later.kill()
        later.wait()
    assert writers.writer_gone(None) is None


# ------------------------------------------------------------------------------------------------
# Commit order with real runs (defect 2)


def test_a_fine_tune_without_train_progress_is_latest_and_kept_by_retention(tmp_path):
    dirpath = tmp_path / "run"
    train_toy(dirpath, ToyUnit(), 8, save_every_n_train_steps=2, keep_last_n_snapshots=2)
    first_run = complete_in_commit_order(dirpath)
    assert first_run == ["epoch_0_step_8", "epoch_1_step_8"]

    tuned = ToyUnit(seed=7)
    assert TorchSnapshotSaver.restore_from_latest(str(dirpath), tuned, restore_train_progress=False)
    assert tuned.train_progress.num_steps_completed == 0
    with pytest.warns(SnapshotsAheadWarning, match=r"ahead of this run's progress \(epoch 0, step 0\).*epoch_0_step_8, epoch_1_step_8") as seen:
        train_toy(dirpath, tuned, 4, save_every_n_train_steps=2, keep_last_n_snapshots=2)
    assert len([w for w in seen if "ahead of this run" in str(w.message)]) == 1  # once

    # The fine-tune's snapshots have lower (epoch, step) than the first run's, and are the ones kept.
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_4", "epoch_1_step_4"]
    path, fresh = restored_from_latest(dirpath)
    assert path.endswith("epoch_1_step_4")
    assert_bitwise_equal(weights(fresh), weights(tuned))
    index = index_of(dirpath, "epoch_1_step_4")
    assert index["seq"] > index_of(dirpath, "epoch_0_step_4")["seq"] > 4  # after the first run's
    assert index["writer"]["pid"] == os.getpid() and index["writer"]["host"] == socket.gethostname()
    assert isinstance(index["writer"]["run_id"], str) and index["committed_at"] <= time.time()


def test_a_new_run_in_a_dirpath_with_later_snapshots_is_latest_and_replaces_its_names(tmp_path):
    dirpath = tmp_path / "run"
    train_toy(dirpath, ToyUnit(), 8, save_every_n_train_steps=2)
    old = complete_in_commit_order(dirpath)
    assert old == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_6", "epoch_0_step_8", "epoch_1_step_8"]
    old_run = index_of(dirpath, "epoch_0_step_2")["writer"]["run_id"]

    new = ToyUnit(seed=3)
    with pytest.warns(SnapshotsAheadWarning, match="ahead of this run's progress"):
        train_toy(dirpath, new, 2, save_every_n_train_steps=2, save_on_train_end=False)
    # The new run's step 2 replaced the old run's snapshot of that name, and is the latest.
    assert complete_in_commit_order(dirpath)[-1] == "epoch_0_step_2"
    assert index_of(dirpath, "epoch_0_step_2")["writer"]["run_id"] != old_run
    path, fresh = restored_from_latest(dirpath)
    assert path.endswith("epoch_0_step_2")
    assert_bitwise_equal(weights(fresh), weights(new))
    assert set(complete_in_commit_order(dirpath)) == set(old)  # nothing else was deleted
    assert staging_by_name(dirpath) == []


# ------------------------------------------------------------------------------------------------
# Only what the plugin provably wrote is deleted (defect 5)


def test_retention_and_cleanup_never_delete_directories_the_plugin_did_not_write(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    train_toy(elsewhere, ToyUnit(), 1, save_every_n_train_steps=1, save_on_train_end=False)
    dirpath = tmp_path / "run"
    dirpath.mkdir()
    look_alike = dirpath / "epoch_0_step_1_acc=0.9"  # a complete torchsnapshot without our index
    shutil.copytree(elsewhere / "epoch_0_step_1", look_alike)
    (look_alike / INDEX_FNAME).unlink()
    (look_alike / WRITER_FNAME).unlink(missing_ok=True)
    planted = {
        "epoch_0_step_0/user.txt": "a user's file",
        "epoch_0_step_2/user.txt": "in the way of step 2",
        ".tnt_staging.epoch_0_step_3.abc123/notes.txt": "not a staging directory of ours",
    }
    for rel, text in planted.items():
        (dirpath / rel).parent.mkdir(parents=True)
        (dirpath / rel).write_text(text)

    with pytest.warns(UserWarning) as seen:
        train_toy(dirpath, ToyUnit(), 4, save_every_n_train_steps=1, keep_last_n_snapshots=1,
                  save_on_train_end=False)
    messages = [(w.category, str(w.message)) for w in seen]
    assert any(
        c is SnapshotFailedWarning and "epoch_0_step_2 exists and was not written by the plugin" in m
        for c, m in messages
    ), messages
    assert any("ahead of this run's progress (epoch 0, step 0)" in m and look_alike.name in m for _, m in messages)
    for rel, text in planted.items():
        assert (dirpath / rel).read_text() == text, rel
    assert look_alike.is_dir() and (look_alike / ".snapshot_metadata").is_file()
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_1_acc=0.9", "epoch_0_step_4"]

    store = LocalStore(str(dirpath))
    for name in ("epoch_0_step_0", "epoch_0_step_2", look_alike.name, ".tnt_staging.epoch_0_step_3.abc123"):
        with pytest.raises(SnapshotError, match="did not write it"):
            listing.remove(store, name)


# ------------------------------------------------------------------------------------------------
# Two jobs on one dirpath, and a SIGKILLed writer (defect 3): real processes


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the job exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError("the job never reached its write")
        time.sleep(0.2)


@pytest.mark.filterwarnings("ignore::tnt_snapshot_plugin.errors.SnapshotsAheadWarning")  # a second, fresh run in the same dirpath is the scenario
def test_a_second_job_is_refused_and_a_killed_writers_leftover_is_removed(tmp_path):
    dirpath = tmp_path / "run"
    dirpath.mkdir()
    foreign = dirpath / ".tnt_staging.epoch_0_step_9.abc123"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    ready = tmp_path / "ready"
    worker = [sys.executable, str(TESTS / "two_jobs_worker.py")]
    live = subprocess.Popen(worker + ["hang", str(dirpath), str(ready)], cwd=TESTS,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, live)  # the live job is in the middle of writing step 3
        staging = [n for n in staging_by_name(dirpath) if n != foreign.name]
        assert len(staging) == 1, os.listdir(dirpath)
        marker = json.loads((dirpath / staging[0] / WRITER_FNAME).read_text())
        assert marker["pid"] == live.pid and f"p{live.pid}n" in staging[0]

        second = subprocess.run(worker + ["plain", str(dirpath), str(tmp_path / "unused")], cwd=TESTS,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode != 0
        assert "ConfigError" in second.stderr and "is in use by another saver" in second.stderr
        assert f"pid {live.pid} run {marker['run_id']!r}" in second.stderr
        # The refused job removed nothing and wrote nothing.
        assert (dirpath / staging[0] / WRITER_FNAME).is_file()
        assert complete_in_commit_order(dirpath) == ["epoch_0_step_1", "epoch_0_step_2"]
        with pytest.raises(ConfigError, match=f"pid {live.pid}"):  # in this process too
            train_toy(dirpath, ToyUnit(), 1)
    finally:
        live.send_signal(signal.SIGKILL)
        live.communicate()

    # Its writer is gone: the next run removes the leftover, and only that.
    train_toy(dirpath, ToyUnit(), 1, save_every_n_train_steps=None, save_on_train_end=False)
    assert not (dirpath / staging[0]).exists()
    assert (foreign / "notes.txt").read_text() == "mine"
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_1", "epoch_0_step_2"]
    path, _ = restored_from_latest(dirpath)
    assert path.endswith("epoch_0_step_2")


@pytest.mark.filterwarnings("ignore::tnt_snapshot_plugin.errors.SnapshotsAheadWarning")  # a second, fresh run in the same dirpath is the scenario
def test_the_lock_is_let_go_at_train_end_and_on_an_exception(tmp_path):
    with pytest.raises(RuntimeError, match="injected"):
        train_toy(tmp_path, ToyUnit(fail_at_step=1), 2, save_every_n_train_steps=1)
    train_toy(tmp_path, ToyUnit(), 1)
    train_toy(tmp_path, ToyUnit(), 1)
    assert complete_in_commit_order(tmp_path)[-1] == "epoch_1_step_1"


def test_a_live_writers_staging_directory_is_left_alone(tmp_path):
    """A write of another live saver (same host, live pid, started now) is never cleaned up."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        time.sleep(0.5)  # the process has started before the write below claims to
        leftover = tmp_path / ".tnt_staging.epoch_0_step_5.abcp1n1"
        leftover.mkdir()
        writer = {"host": socket.gethostname(), "pid": sleeper.pid, "run_id": "abc", "started_at": time.time()}
        (leftover / WRITER_FNAME).write_text(json.dumps(writer))
        train_toy(tmp_path, ToyUnit(), 1, save_every_n_train_steps=None, save_on_train_end=False)
        assert leftover.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    train_toy(tmp_path, ToyUnit(), 1, save_every_n_train_steps=None, save_on_train_end=False)
    assert not leftover.exists()


# ------------------------------------------------------------------------------------------------
# The smaller items (defect 7)


def test_a_newest_snapshot_with_an_empty_manifest_falls_back(tmp_path):
    unit = train_toy(tmp_path, ToyUnit(), 2, save_every_n_train_steps=1, save_on_train_end=False)
    meta_path = tmp_path / "epoch_0_step_2" / ".snapshot_metadata"
    meta = json.loads(meta_path.read_text())
    meta["manifest"] = {}
    meta_path.write_text(json.dumps(meta))
    # as in a snapshot without checksums (the metadata's would catch the edit first)
    index_path = tmp_path / "epoch_0_step_2" / ".tnt_snapshot_index.json"
    index = json.loads(index_path.read_text())
    del index["checksums"], index["seal"]  # as indexes written before either existed
    index_path.write_text(json.dumps(index))
    with pytest.warns(SnapshotFallbackWarning, match="skipping damaged snapshot .*epoch_0_step_2: .*empty manifest"):
        path, _ = restored_from_latest(tmp_path)
    assert path.endswith("epoch_0_step_1")
    assert unit.train_progress.num_steps_completed == 2


@pytest.mark.filterwarnings("ignore::tnt_snapshot_plugin.errors.SnapshotsAheadWarning")  # a second, fresh run in the same dirpath is the scenario
def test_an_incomplete_snapshot_of_ours_is_cleaned_up_and_its_step_saved_again(tmp_path):
    train_toy(tmp_path, ToyUnit(), 2, save_every_n_train_steps=1, save_on_train_end=False)
    (tmp_path / "epoch_0_step_2" / ".snapshot_metadata").unlink()  # a crash left it incomplete
    train_toy(tmp_path, ToyUnit(), 1, save_every_n_train_steps=None, save_on_train_end=False)
    assert not (tmp_path / "epoch_0_step_2").exists()

    (tmp_path / "epoch_0_step_1" / ".snapshot_metadata").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotFailedWarning)
        unit = train_toy(tmp_path, ToyUnit(seed=4), 2, save_every_n_train_steps=1, save_on_train_end=False)
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_1", "epoch_0_step_2"]
    path, fresh = restored_from_latest(tmp_path)
    assert path.endswith("epoch_0_step_2")
    assert_bitwise_equal(weights(fresh), weights(unit))


def test_storage_options_for_a_local_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="storage_options .* local dirpath"):
        TorchSnapshotSaver(str(tmp_path), storage_options={"endpoint_url": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="only with s3://"):
        restore_from_latest(str(tmp_path), {}, storage_options={"region_name": "x"})


def test_preemption_signals_that_is_not_a_list_gets_a_config_error(tmp_path):
    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    for saver in (TorchSnapshotSaver, LightningSaver):
        with pytest.raises(ConfigError, match=r"preemption_signals must be a list of signals"):
            saver(str(tmp_path), preemption_signals=signal.SIGTERM)
    assert SnapshotConfig.build(preemption_signals=(s for s in [signal.SIGUSR1])).preemption_signals == (signal.SIGUSR1,)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_collective_timeout_is_refused(value):
    with pytest.raises(ConfigError, match="collective_timeout_s must be a positive number"):
        SnapshotConfig.build(collective_timeout_s=value)


@pytest.mark.parametrize("returned", ["epoch_0_step_2\n", "epoch_0_step_2_acc=0.5\n", "epoch_0_step_2\nx"])
def test_a_name_hook_returning_a_name_outside_the_grammar_is_refused(tmp_path, pm, returned):
    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_snapshot_name(self):
            return returned

    pm.register(Plugin())
    snap = Snapshotter(str(tmp_path), SnapshotConfig.build(preemption_signals=[]), plugin_manager=pm)
    with pytest.raises(ConfigError, match="tnt_snapshot_plugin_snapshot_name hook returned"):
        snap.save(0, 2, {"m": torch.nn.Linear(2, 2)})
    assert SnapshotName.parse(returned) is None
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []


def test_restoring_a_symlinked_snapshot_says_it_is_a_symlink(tmp_path):
    train_toy(tmp_path / "real", ToyUnit(), 1, save_every_n_train_steps=1, save_on_train_end=False)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "epoch_0_step_1").symlink_to(tmp_path / "real" / "epoch_0_step_1")
    with pytest.raises(SnapshotNotFoundError, match="is a symlink.*pass the snapshot directory itself") as info:
        TorchSnapshotSaver.restore(str(tmp_path / "links" / "epoch_0_step_1"), ToyUnit())
    assert "is a file" not in str(info.value)


def test_a_staging_directory_killed_before_its_marker_is_removed_only_if_its_name_is_ours(tmp_path):
    """A writer killed between creating its staging directory and writing its marker leaves an
    empty directory: removed when its name carries the plugin's writer token of a dead process."""
    token = writers.staging_token("0123456789ab", 1).replace(f"p{os.getpid()}n", f"p{dead_pid()}n")
    ours = tmp_path / f".tnt_staging.epoch_0_step_5.{token}"
    ours.mkdir()
    (ours / WRITER_FNAME).write_text("")  # killed while writing it
    not_ours = tmp_path / ".tnt_staging.epoch_0_step_6.abc123"
    not_ours.mkdir()
    train_toy(tmp_path, ToyUnit(), 1, save_every_n_train_steps=None, save_on_train_end=False)
    assert not ours.exists()
    assert not_ours.is_dir()


def test_a_failed_write_whose_marker_was_lost_is_still_removed_by_its_own_writer(tmp_path, faulty_local):
    """The saver removes its own failed staging directory by its run's name, even when the marker
    inside is gone (the directory was removed and recreated by a later file of the same write)."""
    faulty, dirpath = faulty_local(tmp_path)

    def lose_marker(staging, rel):
        # a data file is there, the marker is not
        (tmp_path / staging / WRITER_FNAME).unlink(missing_ok=True)
        raise OSError(5, "Input/output error (injected)", os.path.join(faulty.child(staging), rel))

    faulty.hook("write_payload", after=lose_marker, match=lambda staging, rel: "epoch_0_step_2." in staging)
    with pytest.warns(SnapshotFailedWarning, match="epoch_0_step_2 .*Input/output error"):
        train_toy(dirpath, ToyUnit(), 3, save_every_n_train_steps=1, save_on_train_end=False)
    assert staging_by_name(tmp_path) == []
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_1", "epoch_0_step_3"]
