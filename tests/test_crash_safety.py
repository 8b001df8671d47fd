"""Crash safety with real torchtnt runs and real torchsnapshot writes to disk.

Restore fallback over damaged snapshots (of each on-disk format); commit-aware retention with
asynchronous snapshots; failures while saving (an I/O error, a full disk, a directory removed
during a save); staging leftovers. Failures come from the real disk where a test can make it fail (a full tmpfs when this
process may mount one, a file the kernel refuses to delete); otherwise from the in-package
``FaultyStore`` around the real local store (the saver opens it through a ``fake://`` dirpath,
``faulty_local`` in conftest.py), raising the error the kernel would raise where the plugin writes
every snapshot file (``Store.write_payload``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import subprocess
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
from dir_listing import complete_in_commit_order, everything_by_name, staging_by_name
from torchtnt.framework.callback import Callback
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    CleanupWarning,
    SnapshotBusyWarning,
    SnapshotCorruptError,
    SnapshotFailedWarning,
    SnapshotFallbackWarning,
    SnapshotWriteError,
    restore_from_latest,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.config import Knobs
from tnt_snapshot_plugin.stores import fileio
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, train_toy, weights

METADATA = ".snapshot_metadata"
INDEX = ".tnt_snapshot_index.json"


class Record(Callback):
    """Keeps each step's weights (placed after the saver)."""

    def __init__(self) -> None:
        self.weights: dict[int, Any] = {}

    def on_train_step_end(self, state, unit) -> None:
        self.weights[unit.train_progress.num_steps_completed] = weights(unit)


def run(dirpath, steps: int, **saver_kwargs) -> tuple[ToyUnit, Record]:
    """Train ToyUnit for ``steps`` steps (one epoch, batches of 4) with an async saver."""
    saver_kwargs.setdefault("save_every_n_train_steps", 1)
    record = Record()
    return train_toy(dirpath, ToyUnit(), steps, callbacks=[record], **saver_kwargs), record


def restored_weights(path_or_dir, latest: bool = True, **kwargs) -> tuple[ToyUnit, Any]:
    fresh = ToyUnit(seed=99)
    if latest:
        result = TorchSnapshotSaver.restore_from_latest(str(path_or_dir), fresh, **kwargs)
    else:
        result = TorchSnapshotSaver.restore(str(path_or_dir), fresh, **kwargs)
    return fresh, result


# ------------------------------------------------------------------------------------------------
# Restore fallback


@pytest.fixture(scope="module", params=["torchsnapshot", "dcp"])
def two_snapshots(tmp_path_factory, request):
    """epoch_0_step_2 and epoch_0_step_4 of a real run, in each on-disk format, and the weights
    at each step."""
    dirpath = tmp_path_factory.mktemp("two_snapshots")
    _, record = run(dirpath, 4, save_every_n_train_steps=2, save_on_train_end=False, format=request.param)
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_2", "epoch_0_step_4"]
    return dirpath, record.weights


@pytest.fixture
def snapshots(two_snapshots, tmp_path):
    source, step_weights = two_snapshots
    dirpath = tmp_path / "snapshots"
    shutil.copytree(source, dirpath)
    return dirpath, step_weights


def metadata_of(snapshot: Path) -> Path:
    """The snapshot's metadata file, in whichever format it was written."""
    return next(p for p in (snapshot / METADATA, snapshot / ".metadata") if p.exists())


def largest_data_file(snapshot: Path) -> Path:
    files = [p for p in snapshot.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def drop_index_and_truncate(path: Path) -> None:
    """As if torchtnt wrote the snapshots (no size index, so no commit order either: ordered by
    epoch and step): the damage shows only when loading."""
    snapshot = next(p for p in path.parents if p.name.startswith("epoch_"))
    for sibling in snapshot.parent.glob("epoch_*"):
        (sibling / INDEX).unlink(missing_ok=True)
        (sibling / ".tnt_writer.json").unlink(missing_ok=True)
    os.truncate(path, path.stat().st_size // 2)


DAMAGE = {
    # what is damaged -> (how, regex the warning must match besides the snapshot's path)
    "truncated data file": (lambda s: truncate(largest_data_file(s)), r"file \S+ has \d+ bytes, \d+ were written"),
    "truncated data file, no size index": (
        lambda s: drop_index_and_truncate(largest_data_file(s)),
        r"file \S+ has \d+ bytes, the metadata reads up to byte \d+",
    ),
    "metadata is not yaml": (
        lambda s: metadata_of(s).write_bytes(b"\x00\xff{[ not: yaml: at all"),
        r"metadata",
    ),
    "truncated metadata": (lambda s: truncate(metadata_of(s)), r"metadata"),
    "metadata emptied": (lambda s: metadata_of(s).write_bytes(b""), r"metadata"),
    "data file missing": (lambda s: largest_data_file(s).unlink(), r"file \S+ is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_snapshot_falls_back_to_previous_with_warning(snapshots, damage):
    dirpath, step_weights = snapshots
    how, why = DAMAGE[damage]
    how(dirpath / "epoch_0_step_4")

    with pytest.warns(SnapshotFallbackWarning, match=rf"skipping damaged snapshot \S*epoch_0_step_4: .*{why}") as caught:
        fresh, restored = restored_weights(dirpath)
    assert restored is True
    assert len(caught) == 1
    assert fresh.train_progress.num_steps_completed == 2
    assert_bitwise_equal(weights(fresh), step_weights[2])


@pytest.mark.parametrize("damage", ["truncated data file", "metadata is not yaml"])
def test_fallback_false_raises_naming_the_damaged_snapshot(snapshots, damage):
    dirpath, _ = snapshots
    DAMAGE[damage][0](dirpath / "epoch_0_step_4")
    before = weights(fresh := ToyUnit(seed=99))
    with pytest.raises(SnapshotCorruptError, match=r"newest snapshot \S*epoch_0_step_4 is damaged.*fallback=True"):
        TorchSnapshotSaver.restore_from_latest(str(dirpath), fresh, fallback=False)
    assert_bitwise_equal(weights(fresh), before)  # nothing was loaded
    # the core function takes the same option
    with pytest.raises(SnapshotCorruptError, match="epoch_0_step_4"):
        restore_from_latest(str(dirpath), {"model": ToyUnit(seed=99).model}, fallback=False)


def test_damaged_older_snapshot_is_not_looked_at_when_the_newest_is_good(snapshots):
    dirpath, step_weights = snapshots
    truncate(largest_data_file(dirpath / "epoch_0_step_2"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh, restored = restored_weights(dirpath)
    assert restored is True
    assert_bitwise_equal(weights(fresh), step_weights[4])


def test_every_snapshot_damaged_raises_instead_of_starting_from_scratch(snapshots):
    dirpath, _ = snapshots
    truncate(largest_data_file(dirpath / "epoch_0_step_4"))
    truncate(metadata_of(dirpath / "epoch_0_step_2"))
    fresh = ToyUnit(seed=123)
    with pytest.warns(SnapshotFallbackWarning, match="skipping damaged snapshot") as caught:
        with pytest.raises(SnapshotCorruptError, match="every snapshot in .* is damaged") as raised:
            TorchSnapshotSaver.restore_from_latest(str(dirpath), fresh)
    assert sorted(str(w.message).split(":")[0] for w in caught) == [
        f"skipping damaged snapshot {dirpath / 'epoch_0_step_2'}",
        f"skipping damaged snapshot {dirpath / 'epoch_0_step_4'}",
    ]
    assert str(dirpath / "epoch_0_step_2") in str(raised.value)
    assert str(dirpath / "epoch_0_step_4") in str(raised.value)
    assert fresh.train_progress.num_steps_completed == 0


# ------------------------------------------------------------------------------------------------
# Retention


class RetentionLog:
    """Watches every commit and deletion the real LocalStore makes (through a FaultyStore's
    hooks), and what was on disk then."""

    def __init__(self, faulty) -> None:
        self.events: list[tuple[str, str, list[str]]] = []
        root = faulty.inner.root
        faulty.hook("commit", after=lambda staging, final: self.events.append(("commit", final, complete_in_commit_order(root))))
        faulty.hook("remove", before=lambda name: self.events.append(("remove", name, complete_in_commit_order(root))))


def plant_foreign_entries(dirpath: Path, outside: Path) -> dict[str, Any]:
    """Things in dirpath that the plugin did not write, and a directory outside it."""
    dirpath.mkdir(parents=True, exist_ok=True)
    outside.mkdir()
    (outside / METADATA).write_text("not ours")
    (outside / "precious.txt").write_text("outside dirpath")
    (dirpath / "README.txt").write_text("my notes")
    (dirpath / "notes").mkdir()
    (dirpath / "notes" / "a.txt").write_text("a")
    torchtnt_style = dirpath / "epoch_0_train_step_1"  # torchtnt's name: read, never deleted
    torchtnt_style.mkdir()
    (torchtnt_style / METADATA).write_text("torchtnt wrote this")
    (dirpath / "epoch_0_step_1").symlink_to(outside, target_is_directory=True)
    incomplete = dirpath / "epoch_9_step_99"  # newest by name, but never committed
    incomplete.mkdir()
    (incomplete / "partial").write_text("x")
    return {
        "README.txt": "my notes",
        "notes/a.txt": "a",
        "epoch_0_train_step_1/" + METADATA: "torchtnt wrote this",
        "epoch_0_step_1/precious.txt": "outside dirpath",
        "epoch_9_step_99/partial": "x",
    }


@pytest.mark.filterwarnings("ignore::tnt_snapshot_plugin.errors.SnapshotsAheadWarning")  # a second, fresh run in the same dirpath is the scenario
@pytest.mark.parametrize("keep", [1, 2])
def test_retention_deletes_only_after_a_newer_commit_and_only_its_own_snapshots(
    tmp_path, faulty_local, keep
):
    dirpath, outside = tmp_path / "snapshots", tmp_path / "outside"
    planted = plant_foreign_entries(dirpath, outside)
    faulty, logged_dirpath = faulty_local(dirpath)
    log = RetentionLog(faulty)

    run(logged_dirpath, 8, save_every_n_train_steps=2, keep_last_n_snapshots=keep)

    ours = ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_6", "epoch_0_step_8", "epoch_1_step_8"]
    assert [name for kind, name, _ in log.events if kind == "commit"] == ours
    removed = [name for kind, name, _ in log.events if kind == "remove"]
    assert removed == ours[:-keep]  # each once, oldest first; the newest `keep` stay
    committed_so_far: list[str] = []
    for kind, name, on_disk in log.events:
        if kind == "commit":
            committed_so_far.append(name)
            continue
        # deleted only once `keep` newer snapshots of ours were committed and on disk
        newer = committed_so_far[committed_so_far.index(name) + 1 :]
        assert len(newer) >= keep and set(newer[-keep:]) <= set(on_disk), (name, on_disk)
        assert on_disk[-1] != name

    assert [n for n in complete_in_commit_order(dirpath) if n.startswith("epoch_") and "train" not in n] == ours[-keep:]
    for rel, text in planted.items():
        assert (dirpath / rel).read_text() == text, rel
    assert (dirpath / "epoch_0_step_1").is_symlink()
    assert staging_by_name(dirpath) == []


def test_retention_alias_keep_last_n_checkpoints(tmp_path):
    run(tmp_path, 4, keep_last_n_checkpoints=2, save_on_train_end=False)
    assert everything_by_name(tmp_path) == ["epoch_0_step_3", "epoch_0_step_4"]


class Undeletable(Callback):
    """After the saver: once snapshot ``name`` is written, the real disk refuses to delete a file
    in it. As root the file is made immutable (``chattr +i``: EPERM), otherwise its directory is
    made read-only (EACCES). ``allow()`` lifts the refusal."""

    def __init__(self, saver: TorchSnapshotSaver, dirpath: Path, name: str) -> None:
        self.saver, self.dirpath, self.snapshot = saver, dirpath, name
        self.target: Path | None = None

    def on_train_step_end(self, state, unit) -> None:
        if self.target is None:
            self.saver.snapshotter.wait()
        if self.target is None and (self.dirpath / self.snapshot).is_dir():
            batched = self.dirpath / self.snapshot / "batched"
            if os.geteuid() == 0:
                self.target = next(batched.iterdir())
                subprocess.run(["chattr", "+i", str(self.target)], check=True)
            else:
                self.target = batched
                batched.chmod(0o555)

    def allow(self) -> None:
        """Lift the refusal wherever the file now is (its snapshot may have been moved)."""
        if self.target is None:
            return
        for path in self.dirpath.rglob(self.target.name):
            if os.geteuid() == 0:
                if path.is_file() and path.parent.name == "batched":
                    subprocess.run(["chattr", "-i", str(path)], check=False)
            elif path.is_dir():
                path.chmod(0o755)


@pytest.mark.filterwarnings("ignore::tnt_snapshot_plugin.errors.SnapshotsAheadWarning")  # a second, fresh run in the same dirpath is the scenario
def test_failed_deletion_warns_and_training_goes_on(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1, keep_last_n_snapshots=2, save_on_train_end=False)
    refuse = Undeletable(saver, tmp_path, "epoch_0_step_1")
    unit = ToyUnit()
    try:
        with pytest.warns(
            CleanupWarning,
            match=r"retention could not delete \S*epoch_0_step_1: .*(Operation not permitted|Permission denied)",
        ):
            train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver, refuse])
        assert unit.train_progress.num_steps_completed == 4
        assert refuse.target is not None
        # The snapshot was unpublished before its files were deleted: what is left is a staging
        # directory, which restore never picks and the next run's train start removes.
        assert complete_in_commit_order(tmp_path) == ["epoch_0_step_3", "epoch_0_step_4"]
        assert len(staging_by_name(tmp_path)) == 1
    finally:
        refuse.allow()
    run(tmp_path, 1, save_every_n_train_steps=None, save_on_train_end=False)
    assert staging_by_name(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# Failures while saving


def fail_writes_of(name: str, faulty, exc: Callable[[str], OSError]) -> list[str]:
    """Make every file write of snapshot ``name`` (through ``faulty``) raise ``exc(path)``;
    returns the paths refused."""
    refused: list[str] = []

    def refuse(staging: str, rel: str) -> None:
        if staging.startswith(f"{name}.") or staging == name or f".{name}." in staging:
            path = os.path.join(faulty.child(staging), rel)
            refused.append(path)
            raise exc(path)

    faulty.hook("write_payload", before=refuse)
    return refused


def eio(path: str) -> OSError:
    return OSError(errno.EIO, "Input/output error (injected)", path)


def test_async_write_error_warns_at_next_hook_with_its_step_and_training_goes_on(tmp_path, faulty_local):
    faulty, dirpath = faulty_local(tmp_path)
    refused = fail_writes_of("epoch_0_step_3", faulty, eio)
    seen: dict[int, list[str]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Count(Callback):  # after the saver: the warnings each step's hook issued
            def on_train_step_end(self, state, unit):
                seen[unit.train_progress.num_steps_completed] = [
                    str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)
                ]
                caught.clear()

        saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, save_on_train_end=False)
        unit = ToyUnit()
        train(unit, StatefulLoader(make_data(24)), max_epochs=1, callbacks=[saver, Count()])

    assert refused
    assert unit.train_progress.num_steps_completed == 6
    # The failure is reported at the next hook, once: later hooks do not repeat it.
    warned = [s for s in sorted(seen) if seen[s]]
    assert warned == [4], seen
    (message,) = seen[4]
    assert "epoch_0_step_3 (epoch 0, step 3) failed and was not committed" in message
    assert "Input/output error (injected)" in message and "Older snapshots are intact" in message
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_5", "epoch_0_step_6"]
    assert staging_by_name(tmp_path) == []  # the failed write was removed


def test_async_write_error_with_raise_policy_stops_at_next_hook_naming_the_step(tmp_path, faulty_local):
    faulty, dirpath = faulty_local(tmp_path)
    fail_writes_of("epoch_0_step_3", faulty, eio)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, on_save_error="raise")
    record = Record()
    unit = ToyUnit()
    with pytest.raises(SnapshotWriteError, match=r"epoch_0_step_3 \(epoch 0, step 3\) failed.*Input/output error"):
        train(unit, StatefulLoader(make_data(24)), max_epochs=1, callbacks=[saver, record])
    assert unit.train_progress.num_steps_completed == 4  # raised at step 4's hook
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_1", "epoch_0_step_2"]
    assert staging_by_name(tmp_path) == []
    fresh, restored = restored_weights(tmp_path)
    assert restored is True
    assert_bitwise_equal(weights(fresh), record.weights[2])


def test_directory_removed_during_a_save_is_not_committed(tmp_path, faulty_local, caplog):
    """Someone deletes dirpath while step 3's files are being written: step 3 must not commit,
    and the run, which no longer holds dirpath (its lock went with it), commits nothing more:
    the first failure is warned, each later one logged (one warning per cause)."""
    dirpath = tmp_path / "snapshots"
    faulty, hooked_dirpath = faulty_local(dirpath)
    removed = []

    def remove_dirpath(staging: str, rel: str) -> None:
        if not removed:
            removed.append(os.path.join(faulty.child(staging), rel))
            # Moved away in one step, then deleted: a plain rmtree races with the other writer
            # threads' new files ("Directory not empty") and fails inside this hook instead.
            gone = tmp_path / "removed"
            os.rename(dirpath, gone)
            shutil.rmtree(gone)

    # after a payload file of step 3 was written (its writer marker is written by begin)
    faulty.hook("write_payload", after=remove_dirpath, match=lambda staging, rel: "epoch_0_step_3." in staging)
    caplog.set_level(logging.INFO, logger="tnt_snapshot_plugin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unit, record = run(hooked_dirpath, 5, save_on_train_end=False)
    assert removed and unit.train_progress.num_steps_completed == 5  # training went on
    warned = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    messages = warned + [r.getMessage() for r in caplog.records if "failed and was not committed" in r.getMessage()]
    others = [w for w in caught if not issubclass(w.category, (SnapshotFailedWarning, SnapshotBusyWarning))]
    assert not others, [str(w.message) for w in others]
    # Step 3 fails at its commit (the run's lock is gone with dirpath) or, when another I/O
    # thread was still writing step 3's files, at that write (its directory is gone); every
    # later snapshot fails: the run no longer holds dirpath.
    lost = r"dirpath \S+ was removed during this run.*commits no more snapshots into it"
    assert re.search(
        r"epoch_0_step_3 \(epoch 0, step 3\) failed.*(" + lost + r"|writing \S+ of \S+epoch_0_step_3\S+ failed: FileNotFoundError)",
        messages[0],
    ), messages
    assert len(warned) == 1, warned
    for step in (4, 5):
        assert any(re.search(rf"epoch_0_step_{step} \(epoch 0, step {step}\) failed.*" + lost, m) for m in messages), messages
    assert not dirpath.exists() or (complete_in_commit_order(dirpath) == [] and staging_by_name(dirpath) == [])


class SmallDisk:
    """A directory on a 2 MiB tmpfs that a test can fill up and free again.

    When this process may mount (root, as on the project's machines) the disk is real: ``fill``
    writes a ballast file until the kernel answers ENOSPC. Otherwise the directory stays on the
    ordinary disk and the saver writes to it through a FaultyStore (``dirpath`` is its
    ``fake://`` name) whose every payload write raises ENOSPC while the disk is "full".
    """

    def __init__(self, root: Path, faulty_local) -> None:
        self.path = root / "small_disk"
        self.path.mkdir()
        self.snapshots = self.path / "snapshots"
        self.full = False
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(self.path)], capture_output=True
        )
        self.real = mounted.returncode == 0
        self.faulty = None
        self.dirpath = str(self.snapshots)  # what the saver and restore are given
        if not self.real:
            self.faulty, self.dirpath = faulty_local(self.snapshots)

    def fill(self) -> None:
        self.full = True
        if not self.real:
            self.faulty.inject("write_payload", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), times=None)
            return
        fd = os.open(self.path / "ballast", os.O_WRONLY | os.O_CREAT)
        try:
            for chunk in (1 << 16, 1 << 12, 1 << 8, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="No space left"):
            fileio.write_durably(str(self.path / "probe"), b"x")

    def free(self) -> None:
        self.full = False
        if self.faulty is not None:
            self.faulty.clear()
        for name in ("ballast", "probe"):
            if (self.path / name).exists():
                (self.path / name).unlink()

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.path)], check=True)


@pytest.fixture
def small_disk(tmp_path, faulty_local):
    disk = SmallDisk(tmp_path, faulty_local)
    yield disk
    disk.close()


class DiskControl(Callback):
    """Before the saver's hook: fill the disk at step 3 (once snapshot 2 is durable), free it at
    step 6 (once snapshot 5 has failed)."""

    def __init__(self, disk: SmallDisk, saver: TorchSnapshotSaver) -> None:
        self.disk, self.saver = disk, saver

    def on_train_step_end(self, state, unit) -> None:
        step = unit.train_progress.num_steps_completed
        if step == 3:
            self.saver.snapshotter.wait()
            self.disk.fill()
        elif step == 6:
            self.saver.snapshotter.wait()  # snapshot 5 fails on the full disk, whatever the timing
            self.disk.free()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_disk_full_warns_once_until_a_snapshot_succeeds(small_disk, caplog, writer):
    caplog.set_level(logging.INFO, logger="tnt_snapshot_plugin")
    dirpath = small_disk.snapshots
    saver = TorchSnapshotSaver(small_disk.dirpath, save_every_n_train_steps=1, knob_options=Knobs(writer=writer))
    by_step: dict[int, list[str]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Count(Callback):
            def on_train_step_end(self, state, unit):
                by_step[unit.train_progress.num_steps_completed] = [
                    str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)
                ]
                caught.clear()

        record = Record()
        unit = ToyUnit()
        train(
            unit,
            StatefulLoader(make_data(32)),
            max_epochs=1,
            callbacks=[DiskControl(small_disk, saver), saver, record, Count()],
        )
        leftover = [w for w in caught if issubclass(w.category, SnapshotFailedWarning)]

    assert unit.train_progress.num_steps_completed == 8  # training went on
    # the full disk is one cause: the failure of step 3 warns once (reaped at step 4); the
    # failures of steps 4 and 5 are counted and logged at INFO until step 6's commit
    warned = [s for s in sorted(by_step) if by_step[s]]
    assert warned == [4], by_step
    assert leftover == []  # nothing at epoch end or train end either
    (message,) = by_step[4]
    assert "epoch_0_step_3 (epoch 0, step 3) failed" in message and "No space left on device" in message
    assert "further failures of this cause are counted and logged at INFO" in message
    info = [r.getMessage() for r in caplog.records if "failed and was not committed" in r.getMessage()]
    assert [r.levelno for r in caplog.records if "failed and was not committed" in r.getMessage()] == [logging.INFO] * 2
    assert "epoch_0_step_4" in info[0] and "(2 failed and 0 skipped since the last commit)" in info[0]
    assert "epoch_0_step_5" in info[1] and "(3 failed and 0 skipped since the last commit)" in info[1]
    assert saver.snapshotter.stats.failures == 3
    assert complete_in_commit_order(dirpath) == [
        "epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_6", "epoch_0_step_7", "epoch_0_step_8", "epoch_1_step_8",
    ]
    assert staging_by_name(dirpath) == []
    # the snapshots from before the disk filled up are intact and restorable
    for step in (1, 2):
        fresh, _ = restored_weights(f"{small_disk.dirpath}/epoch_0_step_{step}", latest=False)
        assert_bitwise_equal(weights(fresh), record.weights[step])


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_disk_full_with_raise_policy_stops_training_and_keeps_older_snapshots(small_disk, writer):
    dirpath = small_disk.snapshots
    saver = TorchSnapshotSaver(
        small_disk.dirpath, save_every_n_train_steps=1, on_save_error="raise", knob_options=Knobs(writer=writer)
    )
    record = Record()
    unit = ToyUnit()
    with pytest.raises(SnapshotWriteError, match=r"epoch_0_step_3 \(epoch 0, step 3\) failed.*No space left on device"):
        train(
            unit,
            StatefulLoader(make_data(32)),
            max_epochs=1,
            callbacks=[DiskControl(small_disk, saver), saver, record],
        )
    assert unit.train_progress.num_steps_completed == 4
    small_disk.free()
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_1", "epoch_0_step_2"]
    assert staging_by_name(dirpath) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh, restored = restored_weights(dirpath)
    assert restored is True
    assert_bitwise_equal(weights(fresh), record.weights[2])


# ------------------------------------------------------------------------------------------------
# Staging leftovers


@pytest.mark.filterwarnings("ignore::tnt_snapshot_plugin.errors.SnapshotsAheadWarning")  # a second, fresh run in the same dirpath is the scenario
def test_staging_leftovers_are_never_restored_and_only_ours_are_removed_at_train_start(snapshots, tmp_path):
    dirpath, step_weights = snapshots
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    # A write killed after its metadata was written but before the rename: complete-looking,
    # newer than everything committed, and still never restored.
    leftover = dirpath / f".tnt_staging.epoch_0_step_9.{uuid.uuid4().hex[:12]}"
    shutil.copytree(dirpath / "epoch_0_step_4", leftover)
    (leftover / "escape").symlink_to(outside, target_is_directory=True)
    not_ours = {
        ".tnt_staging.epoch_0_step_9": "dir",  # no token
        ".tnt_staging.notes.abc123": "dir",  # not a snapshot name
        ".tnt_staging.epoch_0_step_8.def456": "file",
        ".tnt_staging.epoch_0_step_7.fff000": "symlink",
    }
    for name, kind in not_ours.items():
        if kind == "dir":
            (dirpath / name).mkdir()
        elif kind == "file":
            (dirpath / name).write_text("x")
        else:
            (dirpath / name).symlink_to(outside, target_is_directory=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh, restored = restored_weights(dirpath)
    assert restored is True
    assert fresh.train_progress.num_steps_completed == 4
    assert_bitwise_equal(weights(fresh), step_weights[4])

    run(dirpath, 1, save_every_n_train_steps=None, save_on_train_end=False)  # train start cleans up
    assert not leftover.exists()
    for name in not_ours:
        assert os.path.lexists(dirpath / name), name
    assert (outside / "precious.txt").read_text() == "keep me"
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_2", "epoch_0_step_4"]


def test_a_symlink_named_like_a_snapshot_is_never_followed(tmp_path):
    """A symlink ``epoch_0_step_2`` pointing at a complete snapshot elsewhere is not taken as
    "already saved", is never restored from, and its target is never touched."""
    elsewhere = tmp_path / "elsewhere"
    run(elsewhere, 2, save_every_n_train_steps=2, save_on_train_end=False)
    target = elsewhere / "epoch_0_step_2"
    before = sorted(p.name for p in target.rglob("*"))
    dirpath = tmp_path / "run"
    dirpath.mkdir()
    (dirpath / "epoch_0_step_2").symlink_to(target, target_is_directory=True)

    # The step-2 snapshot cannot be published under a name a symlink occupies: it fails loudly
    # (never silently "already there"), and training goes on.
    with pytest.warns(SnapshotFailedWarning, match="epoch_0_step_2"):
        run(dirpath, 3, save_every_n_train_steps=1, save_on_train_end=False)
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_1", "epoch_0_step_3"]
    assert (dirpath / "epoch_0_step_2").is_symlink()
    assert sorted(p.name for p in target.rglob("*")) == before
    fresh, restored = restored_weights(dirpath)
    assert restored is True and fresh.train_progress.num_steps_completed == 3


@pytest.fixture
def world_of_one():
    """torch.distributed initialised with a single process (as torchrun --nproc-per-node=1 does)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_a_world_of_one_process_falls_back_and_restores_share_one_group(snapshots, world_of_one, monkeypatch):
    # With a process group of one initialised, restores share one gloo group (none made and
    # destroyed each time), and a damaged newest snapshot falls back as without a group.
    dirpath, step_weights = snapshots
    drop_index_and_truncate(largest_data_file(dirpath / "epoch_0_step_4"))
    made = []
    real = world_of_one.new_group

    def counting(*args, **kwargs):
        made.append(kwargs.get("ranks"))
        return real(*args, **kwargs)

    monkeypatch.setattr(world_of_one, "new_group", counting)
    with pytest.warns(SnapshotFallbackWarning, match=r"skipping damaged snapshot \S*epoch_0_step_4: file \S+ has \d+ bytes, the metadata reads"):
        fresh, restored = restored_weights(dirpath)
    assert restored is True and fresh.train_progress.num_steps_completed == 2
    assert_bitwise_equal(weights(fresh), step_weights[2])
    again = ToyUnit(seed=7)
    TorchSnapshotSaver.restore(str(dirpath / "epoch_0_step_2"), again)
    assert_bitwise_equal(weights(again), step_weights[2])
    assert made == [[0]]  # one group for both restores, kept for the next


@pytest.mark.parametrize("async_snapshot", [True, False])
def test_a_world_of_one_process_saves_and_restores_without_object_collectives(tmp_path, world_of_one, monkeypatch,
                                                                               async_snapshot):
    """Under torchrun --nproc-per-node=1 there is no other rank to exchange with: a real torchtnt
    run's snapshots and a restore_from_latest run every step the plugin would run on several
    ranks, but none of torch.distributed's object collectives (0.2-0.5 ms each on gloo)."""
    called: list[str] = []
    for name in ("broadcast_object_list", "all_gather_object", "gather_object", "barrier", "all_reduce"):
        real = getattr(world_of_one, name)

        def recording(*args, _name=name, _real=real, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(world_of_one, name, recording)
    unit, record = run(tmp_path, steps=3, async_snapshot=async_snapshot)
    assert complete_in_commit_order(tmp_path)[:3] == ["epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_3"]  # + train end's
    fresh, restored = restored_weights(tmp_path)
    assert restored is True and fresh.train_progress.num_steps_completed == 3
    assert_bitwise_equal(weights(fresh), record.weights[3])
    assert called == []
