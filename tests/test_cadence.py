"""The wall-clock cadence: the core's rules with a fake clock, validation, and real training loops.

The core's unit tests inject the clock; the loops' tests only sleep a few tens of milliseconds at
chosen steps and assert the snapshots those sleeps guarantee (never a timing upper bound).
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
from dir_listing import visible_by_name

from tnt_snapshot_plugin import ConfigError
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.saving.wall_clock import GO_ON, TIME_DUE, WallClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_cadence_combined_with_step_and_epoch_cadences_restarts_after_any_snapshot(tmp_path):
    """Interval 10 s, 4 s per step, one process: the clock restarts at every snapshot, whatever
    cadence took it (steps 3 and 8 by time, step 4's epoch end and step 5 by the other cadences)."""
    clock = FakeClock()
    config = SnapshotConfig.build(
        save_every_n_seconds=10,
        save_every_n_train_steps=5,
        save_every_n_epochs=1,
        async_snapshot=False,
        save_on_train_end=False,
        preemption_signals=[],
    )
    snapshotter = Snapshotter(str(tmp_path), config, clock=clock)
    model = torch.nn.Linear(2, 2)

    def collect(intra_epoch: bool) -> dict[str, torch.nn.Module]:
        return {"model": model}

    snapshotter.train_start(["model"])  # the clock starts: due at 10 s
    for step in range(1, 9):
        clock.now += 4.0
        epoch = 0 if step <= 4 else 1
        snapshotter.step_end(epoch, step, collect)
        if step == 4:
            snapshotter.epoch_end(1, 4, collect)
    snapshotter.train_end(1, 8, collect)
    taken = [(r.epoch, r.step) for r in snapshotter.stats.committed]
    # 12 s: time (due again at 22); 16 s: epoch end (26); 20 s: step 5 (30); 32 s: time
    assert taken == [(0, 3), (1, 4), (1, 5), (1, 8)]


def test_a_delayed_answer_overtaken_by_another_snapshot_is_dropped():
    """Under torch.distributed the answer to rank 0's vote arrives one step later; a snapshot
    taken in between (same step on every rank) restarted the clock, so the request is dropped."""
    clock = FakeClock()
    rank0 = WallClock(10, is_rank0=True, delayed=True, clock=clock)
    rank1 = WallClock(10, is_rank0=False, delayed=True, clock=lambda: pytest.fail("rank 1 read its clock"))
    for wall in (rank0, rank1):
        wall.restart()

    def step(agreed: int) -> tuple[int, list[bool]]:
        votes = [rank0.vote(), rank1.vote()]
        return max(votes), [rank0.due(agreed), rank1.due(agreed)]

    clock.now = 12.0
    votes, due = step(GO_ON)
    assert (votes, due) == (TIME_DUE, [False, False])  # rank 0 asks; nobody snapshots yet
    votes, due = step(votes)
    assert due == [True, True] and votes == GO_ON  # asked once per interval
    for wall in (rank0, rank1):
        wall.restart()  # the time snapshot

    clock.now = 30.0
    votes, due = step(GO_ON)
    assert votes == TIME_DUE
    for wall in (rank0, rank1):
        wall.restart()  # e.g. the step cadence snapshots this very step
    _, due = step(votes)
    assert due == [False, False]  # overtaken: no second snapshot one step later


@pytest.mark.parametrize("value", [0, -1, 0.0, float("inf"), float("nan"), "10", True, [10]])
def test_save_every_n_seconds_must_be_a_positive_finite_number(value):
    with pytest.raises(ConfigError, match="save_every_n_seconds must be a positive"):
        SnapshotConfig.build(save_every_n_seconds=value)


@pytest.mark.frameworks
def test_adapters_validate_their_time_arguments(tmp_path):
    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver
    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver as TnTSaver

    with pytest.raises(ConfigError, match=r"train_time_interval must be a datetime\.timedelta"):
        LightningSaver(str(tmp_path), train_time_interval=30)
    with pytest.raises(ConfigError, match="train_time_interval must be longer than zero"):
        LightningSaver(str(tmp_path), train_time_interval=datetime.timedelta(0))
    with pytest.raises(ConfigError, match="save_every_n_seconds must be a positive"):
        TnTSaver(str(tmp_path), save_every_n_seconds=-5)
    saver = LightningSaver(str(tmp_path), train_time_interval=datetime.timedelta(minutes=30))
    assert saver.snapshotter.config.save_every_n_seconds == 1800.0


SLEEPY_STEPS = (3, 7)
INTERVAL_S = 0.05


@pytest.mark.frameworks
def test_lightning_train_time_interval_in_a_real_fit(tmp_path):
    from lightning_toy import ResumableLoader, ToyModule, make_trainer

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver
    from tnt_snapshot_plugin.demo_data import make_data

    class Sleepy(ToyModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step + 1 in SLEEPY_STEPS:
                time.sleep(INTERVAL_S * 1.5)  # this step alone outlasts the interval
            return super().training_step(batch, batch_idx)

    saver = TorchSnapshotSaver(
        str(tmp_path / "snaps"),
        train_time_interval=datetime.timedelta(seconds=INTERVAL_S),
        save_on_train_end=False,
    )
    make_trainer(tmp_path, [saver], max_epochs=1).fit(Sleepy(), ResumableLoader(make_data(40)))
    # the steps that slept snapshot (others may too, on a slow machine: never asserted)
    assert {f"epoch_0_step_{s}" for s in SLEEPY_STEPS} <= set(visible_by_name(tmp_path / "snaps"))


@pytest.mark.frameworks
def test_torchtnt_save_every_n_seconds_in_a_real_train(tmp_path):
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from toy import StatefulLoader, ToyUnit, make_data

    class Sleepy(ToyUnit):
        def train_step(self, state, data):
            if self.train_progress.num_steps_completed + 1 in SLEEPY_STEPS:
                time.sleep(INTERVAL_S * 1.5)
            super().train_step(state, data)

    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_seconds=INTERVAL_S, save_on_train_end=False)
    train(Sleepy(), StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver])
    assert {f"epoch_0_step_{s}" for s in SLEEPY_STEPS} <= set(visible_by_name(tmp_path))
