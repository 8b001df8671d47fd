"""The process writer (``Knobs(writer="process")``): real torchtnt ``train`` and Lightning
``Trainer.fit`` runs, real writes to disk and to moto's S3, real gloo ranks, and a writer process
killed by its pid in the middle of a snapshot."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import launching
import pytest
import torch
from dir_listing import complete_in_commit_order, staging_by_name
from lightning_toy import ResumableLoader, ToyModule, make_trainer, optimizer_tensors
from lightning_toy import assert_bitwise_equal as assert_same_tensors
from lightning_toy import seed_everything as seed_lightning
from lightning_toy import weights as module_weights
from torchtnt.framework.callback import Callback
from torchtnt.framework.train import train

from tnt_snapshot_plugin import ConfigError, SnapshotFailedWarning
from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.config import Knobs
from tnt_snapshot_plugin.demo_data import make_data as lightning_data
from tnt_snapshot_plugin.saving.process_writer import WriterProcess
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, seed_everything, weights

PROCESS = Knobs(writer="process")


class WriterPids(Callback):
    """The saver's writer process at train start and after each step (placed after the saver)."""

    def __init__(self, saver: TorchSnapshotSaver) -> None:
        self.saver = saver
        self.at_start: Any = None
        self.by_step: dict[int, Any] = {}
        self.weights: dict[int, Any] = {}

    def process(self) -> WriterProcess:
        process = self.saver.snapshotter.writer.process
        assert process is not None
        return process

    def on_train_start(self, state, unit) -> None:
        process = self.process()
        self.at_start = process.pid if process.alive() else None

    def on_train_step_end(self, state, unit) -> None:
        step = unit.train_progress.num_steps_completed
        self.by_step[step] = self.process().pid
        self.weights[step] = weights(unit)


def test_one_writer_process_per_run_started_at_train_start_and_resume_is_bitwise(tmp_path):
    seed_everything(7)
    expected = ToyUnit(seed=0)
    train(expected, StatefulLoader(make_data(40), seed=3), max_epochs=2)

    seed_everything(7)
    unit = ToyUnit(seed=0, fail_at_step=13)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=3, knob_options=PROCESS)
    pids = WriterPids(saver)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(unit, StatefulLoader(make_data(40), seed=3), max_epochs=2, callbacks=[saver, pids])

    # started before the first snapshot, the same process for every snapshot, gone once training ends
    assert pids.at_start is not None and pids.at_start != os.getpid()
    assert set(pids.by_step.values()) == {pids.at_start}
    assert not pids.process().alive()
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_3", "epoch_0_step_6", "epoch_0_step_9", "epoch_1_step_12"]
    assert staging_by_name(tmp_path) == []

    seed_everything(999)
    resumed = ToyUnit(seed=42)
    loader = StatefulLoader(make_data(40), seed=3)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), resumed, train_dataloader=loader)
    train(resumed, loader, max_epochs=2, callbacks=[TorchSnapshotSaver(str(tmp_path), knob_options=PROCESS)])
    assert resumed.train_progress.num_steps_completed == 20
    assert_bitwise_equal(weights(resumed), weights(expected))


def test_a_writer_process_killed_mid_snapshot_fails_that_snapshot_and_the_next_gets_a_new_process(
    tmp_path, monkeypatch
):
    killed: list[int] = []
    begin, write = WriterProcess.begin, WriterProcess.write
    writing: list[str] = []

    def note_begin(self: WriterProcess, staging: str, shared: Any) -> None:
        writing.append(staging)
        begin(self, staging, shared)

    def write_then_die(self: WriterProcess, payload: Any, shared: Any) -> None:
        write(self, payload, shared)  # the first file of the snapshot is handed over
        if "epoch_0_step_4" in writing[-1] and not killed:
            assert self.pid is not None
            killed.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)

    monkeypatch.setattr(WriterProcess, "begin", note_begin)
    monkeypatch.setattr(WriterProcess, "write", write_then_die)
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, knob_options=PROCESS)
    pids = WriterPids(saver)
    with pytest.warns(SnapshotFailedWarning) as caught:
        train(unit, StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver, pids])

    (pid,) = killed
    failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert len(failed) == 1, failed
    assert "epoch_0_step_4" in failed[0]
    assert f"writer process of this rank (pid {pid}) was killed by SIGKILL" in failed[0]
    assert unit.train_progress.num_steps_completed == 10  # training went on
    assert pids.by_step[4] == pid
    assert pids.by_step[10] != pid  # the next snapshot started a new writer process
    assert complete_in_commit_order(tmp_path) == [
        "epoch_0_step_2", "epoch_0_step_6", "epoch_0_step_8", "epoch_0_step_10", "epoch_1_step_10",
    ]
    assert staging_by_name(tmp_path) == []
    assert saver.snapshotter.stats.failures == 1
    for step in (2, 6):  # the snapshot before the crash, and the one after it, are whole
        fresh = ToyUnit(seed=99)
        TorchSnapshotSaver.restore(str(tmp_path / f"epoch_0_step_{step}"), fresh)
        assert_bitwise_equal(weights(fresh), pids.weights[step])


def test_process_writer_to_s3_restores_bitwise(s3_options, run_url):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(run_url, save_every_n_train_steps=2, storage_options=s3_options, knob_options=PROCESS)
    pids = WriterPids(saver)
    train(unit, StatefulLoader(make_data(20)), max_epochs=1, callbacks=[saver, pids])
    assert pids.at_start is not None and set(pids.by_step.values()) == {pids.at_start}

    fresh = ToyUnit(seed=99)
    assert TorchSnapshotSaver.restore_from_latest(run_url, fresh, storage_options=s3_options)
    assert fresh.train_progress.num_steps_completed == 5
    assert_bitwise_equal(weights(fresh), weights(unit))
    fresh = ToyUnit(seed=98)
    TorchSnapshotSaver.restore(f"{run_url}/epoch_0_step_4", fresh, storage_options=s3_options)
    assert_bitwise_equal(weights(fresh), pids.weights[4])


def test_lightning_fit_with_process_writer_resumes_bitwise(tmp_path):
    seed_lightning(7)
    reference = ToyModule(seed=0)
    ref_trainer = make_trainer(tmp_path / "ref", [], enable_checkpointing=False)
    ref_trainer.fit(reference, ResumableLoader(lightning_data(40), seed=3))

    dirpath = str(tmp_path / "snaps")
    seed_lightning(7)
    saver = LightningSaver(dirpath, save_every_n_train_steps=6, knobs=PROCESS)
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver]).fit(ToyModule(seed=0, fail_at_step=13), ResumableLoader(lightning_data(40), seed=3))
    assert saver.snapshotter.writer.process is not None
    assert complete_in_commit_order(Path(dirpath)) == ["epoch_0_step_6", "epoch_1_step_12"]

    seed_lightning(999)
    module = ToyModule(seed=42)
    trainer = make_trainer(tmp_path, [LightningSaver(dirpath, save_on_train_end=False, knobs=PROCESS)])
    trainer.fit(module, ResumableLoader(lightning_data(40), seed=3), ckpt_path=os.path.join(dirpath, "epoch_0_step_6"))
    assert trainer.global_step == ref_trainer.global_step == 20
    assert_same_tensors(module_weights(module), module_weights(reference))
    assert_same_tensors(optimizer_tensors(trainer), optimizer_tensors(ref_trainer))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_gloo_ranks_each_with_its_writer_process_resume_bitwise(where, tmp_path, request):
    if where == "s3":
        url, options = request.getfixturevalue("run_url"), request.getfixturevalue("s3_options")
    else:
        url, options = str(tmp_path / "snaps"), None
    (tmp_path / "run.json").write_text(json.dumps({"url": url, "options": options}))
    worker = Path(__file__).with_name("process_writer_worker.py")
    saved = launching.run_phase(worker, "save", 2, tmp_path)
    pids = [record["writer_pids"] for record in saved]
    for rank, record in enumerate(saved):
        assert len(set(pids[rank])) == 1 and pids[rank][0] not in (None, record["pid"])
        assert record["alive_at_end"] is False
    assert pids[0][0] != pids[1][0]  # a writer process per rank
    restored = launching.run_phase(worker, "restore", 2, tmp_path)
    for before, after in zip(saved, restored, strict=True):
        assert after["restored"] is True
        assert after["steps"] == 5 and after["weights"] == before["weights"]


def test_bad_writer_names_the_knob():
    with pytest.raises(ConfigError, match=r"writer must be 'thread', 'process' or None .*got 'fork'"):
        Knobs(writer="fork")


def test_process_writer_with_synchronous_snapshots_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"knobs.writer='process'.*async_snapshot=False"):
        TorchSnapshotSaver(str(tmp_path), async_snapshot=False, knob_options=PROCESS)


def test_a_store_the_writer_process_cannot_open_is_refused_before_any_work():
    unit = ToyUnit()
    with pytest.raises(ConfigError, match=r"knobs.writer='process'.*memory://run.*Knobs\(writer='thread'\)"):
        saver = TorchSnapshotSaver("memory://run", save_every_n_train_steps=1, knob_options=PROCESS)
        train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
    assert unit.train_progress.num_steps_completed == 0


def test_a_buffer_freed_by_a_collection_inside_an_allocation_does_not_deadlock(monkeypatch):
    """A staging buffer caught in a reference cycle is freed by whatever garbage collection
    runs next; one set off by an allocation, under the staging's lock on the same thread, must
    not wait for that lock."""
    import gc
    import threading

    from tnt_snapshot_plugin.saving.process_writer import SharedStaging

    shared = SharedStaging()
    real_place = SharedStaging._place

    def place_after_a_collection(self, nbytes):
        gc.collect()  # stands in for an automatic collection at this point
        return real_place(self, nbytes)

    cycle: list = [shared.allocate(16, torch.float32)]
    cycle.append(cycle)  # only a collection frees it
    del cycle
    monkeypatch.setattr(SharedStaging, "_place", place_after_a_collection)
    done = threading.Event()
    allocated: list = []

    def allocate() -> None:
        allocated.append(shared.allocate(16, torch.float32))
        done.set()

    thread = threading.Thread(target=allocate, daemon=True)
    thread.start()
    assert done.wait(30), "the allocation waited for the lock its own thread holds"
    assert allocated[0].numel() == 16
    monkeypatch.undo()
    allocated.clear()
    shared.close()


def test_close_unmaps_every_segment_none_of_whose_buffers_is_alive():
    from tnt_snapshot_plugin.saving.process_writer import SharedStaging

    def staging_fds() -> int:
        # Distinct memory files: Python's mmap keeps a duplicate of the descriptor it maps.
        return len({link for link in _fd_links() if "tnt-snapshot-staging" in link})

    before = staging_fds()
    shared = SharedStaging()
    small, large = shared.allocate(16, torch.float32), shared.allocate(32 * 1024 * 1024, torch.uint8)
    assert shared.nbytes > 0 and staging_fds() == before + 2
    del small, large
    shared.close()
    assert shared.nbytes == 0 and staging_fds() == before  # the small buffers' segment too
    again = shared.allocate(16, torch.float32)  # a later snapshot maps new ones
    assert again.numel() == 16 and staging_fds() == before + 1
    del again
    shared.close()
    assert staging_fds() == before


def _fd_links() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor that listed the directory, closed by now
            continue
    return links


def test_a_relative_dirpath_is_the_one_the_saver_resolved_after_a_chdir(tmp_path, monkeypatch):
    """The writer process starts at train start: a relative dirpath means the directory it
    named when the saver was made, as for the thread writer, not one under a later cwd."""
    monkeypatch.chdir(tmp_path)
    saver = TorchSnapshotSaver("run", save_every_n_train_steps=2, knob_options=PROCESS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    train(ToyUnit(), StatefulLoader(make_data(4 * 4)), max_epochs=1, callbacks=[saver])
    assert complete_in_commit_order(tmp_path / "run")[-1] == "epoch_1_step_4"
    assert list(elsewhere.iterdir()) == []
