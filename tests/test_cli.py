"""The ``tnt-snapshot`` command line against snapshots written by real torchtnt ``train`` runs.

One run writes the snapshots (module fixture); each test copies them and damages the copy the way
crashes, users and disks do: a truncated file, corrupt metadata, a missing metadata file, a user's
directory and file, a staging leftover, a symlink named like a snapshot. The S3 tests run the same
commands against moto's S3 server (tests/test_cli_s3.py); one test runs the installed console
script in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torchtnt.framework.callbacks import TorchSnapshotSaver as TorchtntSaver
from torchtnt.framework.train import train

from tnt_snapshot_plugin import policies
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import PruneCandidate, cli, select_for_pruning
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import retention
from tnt_snapshot_plugin.stores import LOCK_FNAME, WRITER_FNAME, open_store
from tnt_snapshot_plugin.stores.ownership import new_run_id, writer_identity
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights

pytestmark = pytest.mark.slow

NAMES = ["epoch_0_step_4", "epoch_1_step_5", "epoch_1_step_8", "epoch_2_step_10"]
TORCHTNT_NAME = "epoch_1_train_step_5"
STAGING = ".tnt_staging.epoch_2_step_12.0a1b2c3d4e5f"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Snapshots of one real torchtnt run (this plugin) and one of torchtnt's own saver."""
    root = tmp_path_factory.mktemp("written")
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(root / "run"), save_every_n_train_steps=4, save_every_n_epochs=1)
    train(unit, StatefulLoader(make_data(20)), max_epochs=2, callbacks=[saver])
    assert sorted(os.listdir(root / "run")) == sorted(NAMES)
    theirs = ToyUnit(seed=5)
    train(theirs, StatefulLoader(make_data(20)), max_epochs=1,
          callbacks=[TorchtntSaver(str(root / "torchtnt"), save_every_n_epochs=1, async_checkpoint=False)])
    assert os.listdir(root / "torchtnt") == [TORCHTNT_NAME]
    return root, weights(unit)


def fresh_copy(written, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(written[0] / "run", run, symlinks=True)
    return run


def messy_copy(written, tmp_path: Path) -> Path:
    """The run's snapshots plus everything else a snapshot directory meets."""
    run = fresh_copy(written, tmp_path)
    shutil.copytree(written[0] / "torchtnt" / TORCHTNT_NAME, run / TORCHTNT_NAME)
    (run / "my_notes").mkdir()
    (run / "my_notes" / "todo.txt").write_text("look at the loss\n")
    (run / "README.txt").write_text("runs of the toy model\n")
    outside = tmp_path / "elsewhere" / "epoch_9_step_90"
    shutil.copytree(run / "epoch_1_step_8", outside)
    os.symlink(outside, run / "epoch_9_step_90")
    shutil.copytree(run / "epoch_2_step_10", run / STAGING)
    age(run / STAGING)
    shutil.copytree(run / "epoch_2_step_10", run / "epoch_3_step_12")
    (run / "epoch_3_step_12" / METADATA_FNAME).unlink()  # an interrupted write
    age(run / "epoch_3_step_12")
    return run


def age(path: Path, seconds: float = 2 * 3600) -> None:
    """Make a directory look last written ``seconds`` ago (a leftover of an old crash)."""
    old = time.time() - seconds
    for parent, dirs, files in os.walk(path):
        for n in dirs + files:
            os.utime(os.path.join(parent, n), (old, old))
    os.utime(path, (old, old))


def index_of(snapshot: Path) -> dict:
    return json.loads((snapshot / INDEX_FNAME).read_text())


def write_index(snapshot: Path, index: dict) -> None:
    """Replace a snapshot's index, sealed again (as the plugin writes it): a deliberate edit."""
    index.pop("seal", None)
    (snapshot / INDEX_FNAME).write_bytes(seal_index(index))


def biggest_file(snapshot: Path) -> str:
    files = index_of(snapshot)["files"]
    return max(files, key=files.get)


def truncate(snapshot: Path) -> str:
    rel = biggest_file(snapshot)
    path = snapshot / rel
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return rel


def run_cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def as_json(*args: str, expect: int = 0) -> dict:
    code, out, err = run_cli(*args, "--json")
    assert code == expect, (code, out, err)
    return json.loads(out)


# -- ls ------------------------------------------------------------------------------------------


def test_ls_shows_every_entry_and_what_restore_from_latest_would_restore(written, tmp_path):
    run = messy_copy(written, tmp_path)
    damaged_file = truncate(run / "epoch_2_step_10")

    listing = as_json("ls", str(run))
    status = {e["name"]: e["status"] for e in listing["entries"]}
    assert status == {
        "epoch_0_step_4": "complete",
        "epoch_1_step_5": "complete",
        TORCHTNT_NAME: "complete",
        "epoch_1_step_8": "complete",
        "epoch_2_step_10": "damaged",
        "epoch_3_step_12": "incomplete",
        STAGING: "staging leftover",
        "README.txt": "foreign",
        "epoch_9_step_90": "foreign",  # a symlink, never followed
        "my_notes": "foreign",
    }
    entries = {e["name"]: e for e in listing["entries"]}
    # Snapshots oldest first in the core's commit order (restore_from_latest's): torchtnt's,
    # which has no commit sequence number, before the plugin's, which are ordered by theirs;
    # then staging leftovers, then foreign entries.
    assert [e["name"] for e in listing["entries"]][:6] == [
        TORCHTNT_NAME, "epoch_0_step_4", "epoch_1_step_5", "epoch_1_step_8", "epoch_2_step_10", "epoch_3_step_12"
    ]
    assert entries[TORCHTNT_NAME]["writer"] == "torchtnt"
    assert entries["epoch_1_step_8"]["writer"] == "tnt_snapshot_plugin"
    assert entries["epoch_1_step_8"]["world_size"] == 1
    assert entries["epoch_1_step_8"]["bytes"] == sum(
        f.stat().st_size for f in (run / "epoch_1_step_8").rglob("*") if f.is_file()
    )
    # every file of the snapshot: torchsnapshot's, the index, and the writer marker the commit
    # protocol keeps in it (the proof that the plugin wrote it)
    on_disk = [f for f in (run / "epoch_1_step_8").rglob("*") if f.is_file()]
    assert entries["epoch_1_step_8"]["files"] == len(on_disk) == 7
    assert {INDEX_FNAME, METADATA_FNAME, WRITER_FNAME} <= {f.name for f in on_disk}
    assert any(damaged_file in p for p in entries["epoch_2_step_10"]["problems"])
    assert listing["restore"] == "epoch_1_step_8"

    # ... which is what restore_from_latest restores (it skips the damaged newest one, and says
    # so of the newer directory that holds an index but no metadata).
    fresh = ToyUnit(seed=9)
    with pytest.warns(UserWarning) as caught:
        assert TorchSnapshotSaver.restore_from_latest(str(run), fresh)
    messages = [str(w.message) for w in caught]
    assert any("skipping damaged snapshot" in m and "epoch_2_step_10" in m for m in messages), messages
    assert any("skipping damaged snapshot" in m and "epoch_3_step_12" in m and "no .snapshot_metadata" in m for m in messages)
    assert fresh.train_progress.num_steps_completed == 8

    code, out, err = run_cli("ls", str(run))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "EPOCH", "STEP", "WORLD", "SIZE", "FILES", "COMMITTED", "STATUS"]
    row = next(line for line in lines if line.startswith("epoch_1_step_8 "))
    assert row.split()[1:4] == ["1", "8", "1"] and row.endswith("complete *")
    assert next(line for line in lines if line.startswith("README.txt")).endswith("foreign")
    assert f"epoch_2_step_10: file {damaged_file} has" in out
    assert "* restore_from_latest would restore epoch_1_step_8" in out
    assert "\x1b[" not in out  # no colour off a terminal
    assert all(line == line.rstrip() for line in lines)


def test_ls_shows_a_live_runs_lock_file_as_the_plugins_own(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    holder = writer_identity(new_run_id())
    started = time.time()
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
    lock = open_store(str(run)).lock({**holder, "started_at": started})  # a saver's, live
    try:
        listing = as_json("ls", str(run))
        entry = next(e for e in listing["entries"] if e["name"] == LOCK_FNAME)
        assert entry["kind"] == "lock" and entry["status"] == "lock" and entry["writer"] == "tnt_snapshot_plugin"
        assert f"pid {holder['pid']}" in entry["note"] and holder["run_id"] in entry["note"]
        assert not any(e["status"] == "foreign" for e in listing["entries"])
        assert entry["holder"]["pid"] == holder["pid"] and entry["holder"]["run_id"] == holder["run_id"]
        code, out, _ = run_cli("ls", str(run))
        row = next(line for line in out.splitlines() if line.startswith(LOCK_FNAME))
        assert code == 0 and row.endswith(f"pid {holder['pid']} run '{holder['run_id']}' since {since}")
        assert f"lock, held by host '{holder['host']}'" in row
        # prune leaves it alone (and may not run while a run may be writing anyway)
        doc = as_json("prune", str(run), "--keep-last", "1", "--dry-run")
        assert LOCK_FNAME in doc["untouched"]
    finally:
        lock.release()


def test_ls_of_an_empty_directory_and_bad_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    listing = as_json("ls", f"file://{tmp_path / 'empty'}")
    assert listing["entries"] == [] and listing["restore"] is None
    code, out, err = run_cli("ls", str(tmp_path / "missing"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "f").write_text("x")
    code, _, err = run_cli("ls", str(tmp_path / "f"))
    assert code == 2 and "is a file, not a directory of snapshots" in err and err.count("\n") == 1
    code, _, err = run_cli("ls", "gs://bucket/run")
    assert code == 2 and "gs" in err and err.count("\n") == 1
    code, _, err = run_cli("ls", str(tmp_path), "--colour")
    assert code == 2 and err.startswith("tnt-snapshot: error: No such option") and err.count("\n") == 1
    code, _, err = run_cli("frobnicate")
    assert code == 2 and err.count("\n") == 1
    code, out, err = run_cli()
    assert code == 2 and out == "" and err.startswith("Usage: tnt-snapshot")  # bare: the help, on stderr


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_lists_every_entry_and_summarises_progress_and_rng(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    doc = as_json("inspect", str(run / "epoch_1_step_8"))
    assert (doc["epoch"], doc["step"], doc["world_size"], doc["writer"]) == (1, 8, 1, "tnt_snapshot_plugin")
    assert doc["summary"]["train_progress"] == {
        "num_epochs_completed": 1, "num_steps_completed": 8, "num_steps_completed_in_epoch": 3
    }
    assert doc["summary"]["rng_state"] == ["torch CPU", "python", "numpy"]
    entries = {e["path"]: e for e in doc["entries"]}
    weight = entries["0/model/0.weight"]
    assert (weight["kind"], weight["dtype"], weight["shape"], weight["bytes"], weight["replicated"]) == (
        "tensor", "float32", [16, 4], 16 * 4 * 4, False
    )
    assert entries["0/optimizer/param_groups/0/lr"]["kind"] == "value"
    assert entries["0/optimizer/param_groups/0/betas"]["kind"] == "object"
    assert entries["0/train_progress/num_steps_completed"]["value"] == 8

    code, out, _ = run_cli("inspect", str(run / "epoch_1_step_8"))
    assert code == 0
    assert "train_progress: epoch 1, step 8 (3 into the epoch)" in out
    assert "rng_state: torch CPU, python, numpy generators" in out
    row = next(line for line in out.splitlines() if line.startswith("0/model/0.weight "))
    assert row.split() == ["0/model/0.weight", "tensor", "float32", "16x4", "256", "bytes", "no"]

    # A torchtnt-written snapshot (no index) reads the same way.
    doc = as_json("inspect", str(written[0] / "torchtnt" / TORCHTNT_NAME))
    assert doc["writer"] == "torchtnt" and doc["summary"]["train_progress"]["num_steps_completed"] == 5


def test_inspect_of_incomplete_or_corrupt_snapshots_says_what_is_wrong(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    (run / "epoch_1_step_8" / METADATA_FNAME).unlink()
    code, out, err = run_cli("inspect", str(run / "epoch_1_step_8"))
    assert code == 2 and out == "" and "is not a complete snapshot" in err and err.count("\n") == 1
    (run / "epoch_1_step_5" / METADATA_FNAME).write_text('{"version": "0.1.0", "manif')
    code, _, err = run_cli("inspect", str(run / "epoch_1_step_5"))
    assert code == 2 and ".snapshot_metadata" in err and "damaged" in err and err.count("\n") == 1
    code, _, err = run_cli("inspect", str(run / "epoch_7_step_70"))
    assert code == 2 and "does not exist" in err


def test_inspect_diff_and_export_refuse_metadata_that_fails_its_checksum(written, tmp_path):
    """The metadata holds the primitive values (here the step) themselves: a flipped digit that
    still parses is damage, not a value to show, compare or export."""
    run = fresh_copy(written, tmp_path)
    snap = run / "epoch_1_step_8"
    metadata = snap / METADATA_FNAME
    text = metadata.read_text()
    assert text.count('"serialized_value": "8"') == 1
    metadata.write_text(text.replace('"serialized_value": "8"', '"serialized_value": "9"'))
    for args in (
        ("inspect", str(snap)),
        ("diff", str(run / "epoch_1_step_5"), str(snap)),
        ("export", str(snap), str(tmp_path / "model.pt")),
    ):
        code, out, err = run_cli(*args)
        assert code == 2 and out == "", (args, out, err)
        assert ".snapshot_metadata differs from the checksum recorded" in err, (args, err)
    assert not (tmp_path / "model.pt").exists()


# -- verify --------------------------------------------------------------------------------------


def test_verify_names_each_damaged_file_and_exits_1(written, tmp_path):
    run = messy_copy(written, tmp_path)
    code, out, _ = run_cli("verify", str(run))
    assert code == 0, out
    assert "no checksums in 1 of these snapshots (not written by this plugin)" in out and "all intact" in out
    assert "my_notes" not in out and STAGING not in out  # only snapshots are verified

    truncated = truncate(run / "epoch_1_step_5")
    (run / "epoch_2_step_10" / METADATA_FNAME).write_bytes(b"\x00\x01garbage")
    code, out, _ = run_cli("verify", str(run))
    assert code == 1
    assert f"epoch_1_step_5: file {truncated} has" in out
    assert "epoch_2_step_10: .snapshot_metadata differs from the checksum recorded" in out
    assert "2 damaged" in out
    doc = as_json("verify", str(run), expect=1)
    bad = {s["name"]: s["problems"] for s in doc["snapshots"] if s["status"] == "damaged"}
    assert set(bad) == {"epoch_1_step_5", "epoch_2_step_10"} and doc["ok"] is False

    # One snapshot by path: intact, damaged, incomplete.
    code, out, _ = run_cli("verify", str(run / "epoch_1_step_8"))
    assert code == 0 and "sizes+checksums" in out  # the plugin records checksums
    assert run_cli("verify", str(run / "epoch_1_step_5"))[0] == 1
    code, out, _ = run_cli("verify", str(run / "epoch_3_step_12"))
    assert code == 1 and "incomplete" in out


def test_verify_checks_recorded_checksums(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    snap = run / "epoch_1_step_8"
    code, out, _ = run_cli("verify", str(snap))
    assert code == 0 and "sizes+checksums" in out and "no checksums" not in out

    rel = biggest_file(snap)
    data = bytearray((snap / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only a checksum sees it
    (snap / rel).write_bytes(bytes(data))
    code, out, _ = run_cli("verify", str(snap))
    assert code == 1 and f"file {rel} differs from the xxh3_64 checksum recorded" in out


def test_records_of_an_unknown_algorithm_are_left_unchecked_by_verify_and_restore_alike(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    snap = run / "epoch_2_step_10"
    index = index_of(snap)
    index["checksums"] = {
        rel: {"algo": "sha256", "value": hashlib.sha256((snap / rel).read_bytes()).hexdigest()}
        for rel in index["files"]
    }
    write_index(snap, index)
    code, out, _ = run_cli("verify", str(snap))
    assert code == 0 and "cannot check" in out and "sha256" in out
    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(str(run), fresh)  # no fallback: warnings are errors here
    assert fresh.train_progress.num_steps_completed == 10


# -- prune ---------------------------------------------------------------------------------------


def test_prune_deletes_only_the_plugins_old_snapshots(written, tmp_path):
    run = messy_copy(written, tmp_path)
    before = sorted(os.listdir(run))

    doc = as_json("prune", str(run), "--keep-last", "1", "--dry-run")
    assert doc["delete"] == ["epoch_0_step_4", "epoch_1_step_5", "epoch_1_step_8"]
    assert sorted(os.listdir(run)) == before  # a dry run deletes nothing
    keep = {k["name"]: k["reason"] for k in doc["keep"]}
    assert keep["epoch_2_step_10"] == "one of the last 1"
    assert "torchtnt" in keep[TORCHTNT_NAME] and "incomplete" in keep["epoch_3_step_12"]

    code, out, _ = run_cli("prune", str(run), "--keep-last", "1")
    assert code == 0, out
    assert "deleted 3 snapshots" in out
    after = sorted(os.listdir(run))
    assert after == sorted(set(before) - {"epoch_0_step_4", "epoch_1_step_5", "epoch_1_step_8"})
    # The symlink and the directory it points to are untouched.
    assert os.path.islink(run / "epoch_9_step_90")
    assert (tmp_path / "elsewhere" / "epoch_9_step_90" / METADATA_FNAME).exists()
    assert (run / "my_notes" / "todo.txt").exists()


def test_prune_never_deletes_the_snapshot_restore_would_use(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    truncate(run / "epoch_2_step_10")  # the newest is damaged: restore uses epoch_1_step_8
    doc = as_json("prune", str(run), "--keep-last", "1")
    assert doc["deleted"] == ["epoch_0_step_4", "epoch_1_step_5"]
    assert sorted(os.listdir(run)) == ["epoch_1_step_8", "epoch_2_step_10"]


def test_prune_refuses_while_a_run_may_be_writing(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    shutil.copytree(run / "epoch_2_step_10", run / STAGING)  # fresh: written just now
    code, out, err = run_cli("prune", str(run), "--keep-last", "1")
    assert code == 1 and out == "" and "refusing to prune" in err and err.count("\n") == 1
    assert len(os.listdir(run)) == 5
    code, _, _ = run_cli("prune", str(run), "--keep-last", "1", "--min-staging-age", "0s")
    assert code == 0 and sorted(os.listdir(run)) == sorted([STAGING, "epoch_2_step_10"])


def test_prune_keep_best_reads_the_metric_from_the_index(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    for name, loss in zip(NAMES, [0.5, 0.1, 0.9, 0.7], strict=True):
        index = index_of(run / name)
        index["metric"] = {"name": "loss", "value": loss}
        write_index(run / name, index)
    doc = as_json("prune", str(run), "--keep-last", "2", "--keep-best", "loss", "--mode", "min")
    assert doc["deleted"] == ["epoch_1_step_8"]  # the two best (0.1, 0.5) and the newest stay
    keep = {k["name"]: k["reason"] for k in doc["keep"]}
    assert keep["epoch_2_step_10"] == "the newest complete snapshot"
    code, _, err = run_cli("prune", str(run), "--keep-last", "2", "--keep-best", "loss")
    assert code == 2 and "--keep-best and --mode go together" in err
    code, _, err = run_cli("prune", str(run), "--keep-last", "0")
    assert code == 2 and err.count("\n") == 1


def test_prune_selection_rules():
    def c(text: str, **kw) -> PruneCandidate:
        return PruneCandidate(name=SnapshotName.parse(text), ours=kw.pop("ours", True),
                              complete=kw.pop("complete", True), **kw)

    # Commit order is the index's seq when every snapshot has one, not the name's step.
    verdict = select_for_pruning(
        [c("epoch_0_step_9", seq=1), c("epoch_0_step_2", seq=2), c("epoch_0_step_5", seq=3)], keep_last=1
    )
    assert [n for n, r in verdict.items() if r is None] == ["epoch_0_step_9", "epoch_0_step_2"]
    # Without seq: (epoch, step). Never anything not ours, incomplete, or protected.
    verdict = select_for_pruning(
        [c("epoch_0_step_1"), c("epoch_0_step_2", ours=False), c("epoch_0_train_step_3", ours=False),
         c("epoch_0_step_4"), c("epoch_0_step_5"), c("epoch_0_step_6", complete=False, ours=False)],
        keep_last=1, protect=["epoch_0_step_4"],
    )
    assert [n for n, r in verdict.items() if r is None] == ["epoch_0_step_1"]
    # Best-k: snapshots without the metric are kept; the newest is always kept.
    verdict = select_for_pruning(
        [c("epoch_0_step_1", metric=3.0), c("epoch_0_step_2", metric=1.0), c("epoch_0_step_3"),
         c("epoch_0_step_4", metric=2.0), c("epoch_0_step_5", metric=9.0)],
        keep_last=1, keep_best="acc", mode="max",
    )
    assert sorted(n for n, r in verdict.items() if r is None) == ["epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_4"]


def test_prune_selection_is_the_savers_retention():
    """On random directories, prune's choice is exactly what the saver's retention deletes."""
    rng = random.Random(0)
    for _ in range(300):
        candidates, listed = [], []
        seqs = rng.sample(range(1, 40), 12)
        for i in range(rng.randint(1, 12)):
            ours = rng.random() < 0.8
            phase = not ours and rng.random() < 0.5
            text = f"epoch_0_train_step_{i}" if phase else f"epoch_0_step_{i}"
            seq = seqs[i] if ours and rng.random() < 0.9 else None
            value = rng.choice([None, 0.1, 0.5, 0.5, 0.9, float("nan")])
            complete = rng.random() < 0.9
            c = PruneCandidate(SnapshotName.parse(text), ours=ours, complete=complete, seq=seq, metric=value)
            candidates.append(c)
            if complete:
                listed.append(retention.Listed(c.name, seq=seq, ours=ours,
                                               indexed_metric=("m", value) if value is not None else None))
        keep = rng.randint(1, 4)
        protect = [rng.choice(candidates).name.text] if rng.random() < 0.3 else []
        mode = rng.choice(["min", "max"])
        best = rng.random() < 0.5
        verdict = select_for_pruning(candidates, keep_last=keep, keep_best="m" if best else None, mode=mode,
                                     protect=protect)
        expected = policies.to_delete(listed, None if best else keep, protect=protect,
                                       best=policies.Best("m", mode, keep) if best else None)
        assert sorted(n for n, r in verdict.items() if r is None) == sorted(r.text for r in expected)
        assert all(isinstance(r, str) and r for n, r in verdict.items() if n not in {x.text for x in expected})


def test_prune_of_a_best_k_savers_directory_deletes_nothing_more(tmp_path):
    """A directory written by a best-k saver is already pruned by the same rules."""
    from torchtnt.utils.checkpoint import BestCheckpointConfig

    class Scored(ToyUnit):
        def train_step(self, state, data):
            super().train_step(state, data)
            self.loss = [0.4, 0.2, 0.6, 0.3, 0.5][self.train_progress.num_steps_completed]

    run = tmp_path / "run"
    saver = TorchSnapshotSaver(str(run), save_every_n_train_steps=1, keep_last_n_checkpoints=2,
                               best_checkpoint_config=BestCheckpointConfig("loss", "min"), save_on_train_end=False)
    train(Scored(), StatefulLoader(make_data(20)), max_epochs=1, callbacks=[saver])
    assert sorted(os.listdir(run)) == ["epoch_0_step_2_loss=0.2", "epoch_0_step_4_loss=0.3", "epoch_0_step_5_loss=0.5"]
    doc = as_json("prune", str(run), "--keep-last", "2", "--keep-best", "loss", "--mode", "min")
    assert doc["delete"] == []
    keep = {k["name"]: k["reason"] for k in doc["keep"]}
    assert keep == {
        "epoch_0_step_2_loss=0.2": "one of the 2 best by loss (0.2)",
        "epoch_0_step_4_loss=0.3": "one of the 2 best by loss (0.3)",
        "epoch_0_step_5_loss=0.5": "the newest complete snapshot",
    }
    # ls: the snapshots in commit order, the metric from the name
    listing = as_json("ls", str(run))
    assert [e["name"] for e in listing["entries"]] == sorted(os.listdir(run))
    assert listing["entries"][0]["metric"] == {"name": "loss", "value": 0.2}
    assert listing["restore"] == "epoch_0_step_5_loss=0.5"


# -- diff ----------------------------------------------------------------------------------------


def test_diff_reports_what_moved_between_two_steps(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    a, b = str(run / "epoch_1_step_8"), str(run / "epoch_2_step_10")
    doc = as_json("diff", a, b, expect=1)
    changes = {d["path"]: d for d in doc["differences"]}
    assert changes["0/train_progress/num_steps_completed"]["detail"] == "8 -> 10"
    assert changes["0/model/0.weight"]["change"] == "changed"
    assert changes["0/model/0.weight"]["detail"].startswith("max |a-b| = ")
    assert float(changes["0/model/0.weight"]["detail"].split("= ")[1]) > 0
    assert "0/optimizer/param_groups/0/betas" not in changes  # same pickled object
    code, out, _ = run_cli("diff", a, b)
    assert code == 1 and "identical" in out and "changed" in out

    code, out, _ = run_cli("diff", a, a)
    assert code == 0 and "0 changed" not in out and out.strip().endswith("identical")

    # Added and removed entries: torchtnt's snapshot has no train_dataloader entry... and no index.
    doc = as_json("diff", a, str(written[0] / "torchtnt" / TORCHTNT_NAME), expect=1)
    removed = {d["path"] for d in doc["differences"] if d["change"] == "removed"}
    assert "0/rng_state/numpy/keys" in removed  # the plugin saves numpy's RNG; torchtnt does not


# -- export --------------------------------------------------------------------------------------


def test_export_writes_weights_that_load_without_the_trainer(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    snap = str(run / "epoch_2_step_10")
    expected = written[1]

    out = tmp_path / "model.pt"
    code, text, _ = run_cli("export", snap, str(out))
    assert code == 0 and "exported model (4 tensors" in text
    model = ToyUnit(seed=11).model
    model.load_state_dict(torch.load(out, weights_only=True))
    assert_bitwise_equal(model.state_dict(), expected)

    from safetensors.torch import load_file

    out_st = tmp_path / "model.safetensors"
    doc = as_json("export", snap, str(out_st))
    assert doc["format"] == "safetensors" and doc["key"] == "model" and doc["tensors"] == 4
    assert_bitwise_equal(load_file(out_st), expected)

    one = tmp_path / "w.pt"
    assert run_cli("export", snap, str(one), "--key", "model/0.weight")[0] == 0
    assert torch.equal(torch.load(one, weights_only=True)["0.weight"], expected["0.weight"])

    code, _, err = run_cli("export", snap, str(out))
    assert code == 2 and "exists; pass --force" in err
    code, _, err = run_cli("export", snap, str(tmp_path / "x.pt"), "--key", "nope")
    assert code == 2 and "has no entry 'nope'" in err
    code, _, err = run_cli("export", snap, str(tmp_path / "x.safetensors"), "--key", "optimizer")
    assert code == 2 and "cannot export 'optimizer' as safetensors" in err
    assert not (tmp_path / "x.safetensors").exists()


# -- DCP checkpoints: the plugin's, stock dcp.save's, torchtnt's DCP saver's -------------------------


def test_every_command_reads_dcp_checkpoints_of_the_plugin_stock_dcp_and_torchtnt(written, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver

    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(20)), max_epochs=2,
          callbacks=[TorchSnapshotSaver(str(tmp_path / "ours"), save_every_n_train_steps=4, format="dcp")])
    ours = tmp_path / "ours" / "epoch_2_step_10"
    model = torch.nn.Linear(4, 3)
    with warnings.catch_warnings():  # stock DCP warns that it runs without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"model": model.state_dict(), "step": 7, "lrs": [0.5, 0.25]}, checkpoint_id=str(tmp_path / "stock" / "epoch_0_step_7"))
        theirs = ToyUnit(seed=5)
        train(theirs, StatefulLoader(make_data(16)), max_epochs=1,
              callbacks=[DistributedCheckpointSaver(str(tmp_path / "tnt"), save_every_n_train_steps=4, async_checkpoint=False)])
    stock, tnt = tmp_path / "stock" / "epoch_0_step_7", tmp_path / "tnt" / "epoch_0_train_step_4"

    # inspect: the plugin's DCP snapshot by the same paths as its torchsnapshot original, progress summarised
    code, out, _ = run_cli("inspect", str(ours))
    assert code == 0 and "train_progress: epoch 2, step 10" in out and "rng_state: torch CPU, python, numpy" in out, out
    rows = {r["path"]: r for r in as_json("inspect", str(ours))["entries"]}
    original = {r["path"]: r for r in as_json("inspect", str(written[0] / "run" / "epoch_2_step_10"))["entries"]}
    assert set(rows) == set(original)
    assert rows["0/model/0.weight"]["shape"] == [16, 4] and rows["0/train_progress/num_steps_completed"]["value"] == 10
    rows = {r["path"]: r for r in as_json("inspect", str(stock))["entries"]}
    assert rows["0/step"]["value"] == 7 and [rows[f"0/lrs/{i}"]["value"] for i in (0, 1)] == [0.5, 0.25]
    assert rows["0/model/weight"]["kind"] == "tensor" and rows["0/model/weight"]["dtype"] == "float32"
    assert as_json("inspect", str(tnt))["summary"]["train_progress"]["num_steps_completed"] == 4

    # diff: a DCP snapshot and a torchsnapshot one of the same run, entry by entry
    doc = as_json("diff", str(ours), str(written[0] / "run" / "epoch_2_step_10"), expect=1)
    assert "0/model/0.weight" in {d["path"] for d in doc["differences"]}  # another run's weights
    assert not [d for d in doc["differences"] if d["change"] != "changed"], doc["differences"]
    code, out, _ = run_cli("diff", str(ours), str(ours))
    assert code == 0 and out.strip().endswith("identical")
    doc = as_json("diff", str(tnt), str(tmp_path / "ours" / "epoch_0_step_4"), expect=1)
    assert {d["path"] for d in doc["differences"] if d["change"] == "removed"} == set()  # the plugin's is a superset

    # export: the weights of each, as they were saved
    for snapshot, expected in ((ours, weights(unit)), (stock, model.state_dict()), (tnt, None)):
        code, text, err = run_cli("export", str(snapshot), str(tmp_path / f"{snapshot.parent.name}.pt"))
        assert code == 0 and "exported model" in text, (snapshot, err)
        if expected is not None:
            assert_bitwise_equal(torch.load(tmp_path / f"{snapshot.parent.name}.pt", weights_only=True), expected)

    # ls and verify: the plugin's with checksums; the others say plainly that they hold none
    code, out, _ = run_cli("verify", str(ours))
    assert code == 0 and "sizes+checksums" in out and "no checksums" not in out, out
    for snapshot in (stock, tnt):
        code, out, _ = run_cli("verify", str(snapshot))
        assert code == 0 and "intact" in out, out
        assert ("no checksums: this snapshot was not written by this plugin; its files' sizes and its metadata's "
                "consistency are checked") in out, out
        code, out, _ = run_cli("ls", str(snapshot.parent))
        line = next(line for line in out.splitlines() if line.startswith("no checksums in "))
        assert snapshot.name in line and "(not written by this plugin): verify checks" in line, out
        assert {e["checksums_recorded"] for e in as_json("ls", str(snapshot.parent))["entries"]} == {False}
    assert {e["checksums_recorded"] for e in as_json("ls", str(tmp_path / "ours"))["entries"]} == {True}


# -- the console script, in a process of its own ---------------------------------------------------


def test_console_script_runs_and_the_core_imports_without_the_cli_libraries(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    truncated = truncate(run / "epoch_1_step_5")
    script = Path(sys.executable).with_name("tnt-snapshot")
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.run([str(script), "verify", str(run)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"epoch_1_step_5: file {truncated} has" in proc.stdout
    proc = subprocess.run([str(script), "ls", str(run), "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["restore"] == "epoch_2_step_10"
    proc = subprocess.run([str(script), "ls"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Missing argument" in proc.stderr

    code = (
        "import sys, tnt_snapshot_plugin, tnt_snapshot_plugin.saving.saver, tnt_snapshot_plugin.restoring, "
        "tnt_snapshot_plugin.metrics, tnt_snapshot_plugin.demo\n"
        "bad = sorted(m for m in ('click', 'rich', 'safetensors') if m in sys.modules)\n"
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
