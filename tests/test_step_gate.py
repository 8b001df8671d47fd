"""The step gate: a step that has nothing to do costs the adapter one call, and nothing is missed.

The adapters skip a step end when ``saver.trigger.quiet(step)``: ``last_step <= step < step_gate``.

``Trigger.step_gate`` is the next step whose end needs a look while nothing else does (the
next multiple of the step cadence, or under torch.distributed the ranks' next agreement if
sooner), and 0 (every step) while something does: a snapshot being written,
prepare()'s second pass, the wall-clock cadence, a plugin asking, a signal received, or a run
whose step count no step end has told yet. These tests drive a real Snapshotter (and a real
torchtnt ``train``) and check that the gate opens for each of them, and that what it opens for
happens at the step it should (tests/test_distributed.py: the agreements under torch.distributed).
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
from dir_listing import complete_in_commit_order

from tnt_snapshot_plugin import hookimpl
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import SnapshotFailedWarning
from tnt_snapshot_plugin.policies import AnySave, EveryNSteps
from tnt_snapshot_plugin.saving.saver import Snapshotter


def gated_steps(snap: Snapshotter, steps, state) -> list[int]:
    """Run step ends as the adapters do (the gate first); the steps that reached step_end()."""
    reached = []
    for step in steps:
        if snap.trigger.quiet(step):
            continue
        reached.append(step)
        snap.step_end(0, step, lambda intra: state)
    return reached


def test_the_gate_is_the_step_cadence_when_nothing_else_needs_a_look(tmp_path):
    snap = Snapshotter(
        str(tmp_path),
        SnapshotConfig.build(save_every_n_train_steps=3, async_snapshot=False, preemption_signals=[]),
    )
    snap.train_start(["model"])
    state = {"model": torch.nn.Linear(2, 2)}
    assert snap.trigger.step_gate == 0  # the first step end tells the run's step count
    assert gated_steps(snap, range(1, 8), state) == [1, 3, 6]
    assert snap.trigger.step_gate == 9
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_3", "epoch_0_step_6"]
    snap.train_start(["model"])  # a new run (resumed at step 100): told again
    assert snap.trigger.step_gate == 0 and gated_steps(snap, range(101, 106), state) == [101, 102, 105]

    no_cadence = Snapshotter(
        str(tmp_path / "none"),
        SnapshotConfig.build(save_every_n_epochs=1, async_snapshot=False, preemption_signals=[]),
    )
    no_cadence.train_start(["model"])
    assert gated_steps(no_cadence, range(1, 1000), state) == [1]


def test_the_gate_opens_while_a_snapshot_is_pending_not_after_a_reported_failure(tmp_path, faulty_local):
    faulty, dirpath = faulty_local(tmp_path)
    snap = Snapshotter(
        dirpath, SnapshotConfig.build(save_every_n_train_steps=3, async_snapshot=True, preemption_signals=[])
    )
    state = {"model": torch.nn.Linear(2, 2)}
    snap.train_start(["model"])
    assert gated_steps(snap, [1, 2, 3], state) == [1, 3]
    assert snap.trigger.step_gate == 0  # step 3's snapshot is being written: a step end reaps it
    snap.wait()
    assert snap.trigger.step_gate == 6 and complete_in_commit_order(tmp_path) == ["epoch_0_step_3"]

    faulty.inject("write_payload", OSError(28, "No space left on device"))
    assert gated_steps(snap, [4, 5, 6], state) == [6]
    with pytest.warns(SnapshotFailedWarning, match="epoch_0_step_6"):
        snap.wait()
    assert snap.trigger.step_gate == 9  # a failure reported once leaves the gate to the cadence
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotFailedWarning)  # reported once, never again at step ends
        assert gated_steps(snap, [7, 8, 9], state) == [9]
    snap.wait()
    assert snap.trigger.step_gate == 12
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_3", "epoch_0_step_9"]
    snap.train_end(0, 9, lambda intra: state)


def test_the_gate_opens_for_the_second_prepare_pass_the_wall_clock_and_a_plugin_asking(tmp_path, pm):
    state = {"model": torch.nn.Linear(2, 2)}
    snap = Snapshotter(
        str(tmp_path / "prepare"),
        SnapshotConfig.build(save_every_n_train_steps=5, async_snapshot=True, preemption_signals=[]),
    )
    snap.train_start(["model"])
    snap.prepare(lambda: state)
    assert snap.trigger.step_gate == 0
    assert gated_steps(snap, [1, 2], state) == [1]  # the second pass ran at step 1
    assert snap.trigger.step_gate == 5
    snap.train_end(0, 2, lambda intra: state)

    timed = Snapshotter(
        str(tmp_path / "timed"),
        SnapshotConfig.build(save_every_n_seconds=3600, save_every_n_train_steps=5, preemption_signals=[]),
    )
    timed.train_start(["model"])
    assert gated_steps(timed, [1, 2, 3], state) == [1, 2, 3]  # every step end looks at the clock
    timed.train_end(0, 0, lambda intra: state)

    class EveryOddStep:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshot(self, event, epoch, step, default):
            return step % 2 == 1

    pm.register(EveryOddStep())
    asked = Snapshotter(
        str(tmp_path / "asked"),
        SnapshotConfig.build(save_every_n_train_steps=100, async_snapshot=False, preemption_signals=[]),
        plugin_manager=pm,
    )
    asked.train_start(["model"])
    assert gated_steps(asked, range(1, 5), state) == [1, 2, 3, 4]
    assert asked.trigger.step_gate == 0
    assert complete_in_commit_order(tmp_path / "asked") == ["epoch_0_step_1", "epoch_0_step_3"]


def test_a_signal_opens_the_gate_at_once_in_a_real_torchtnt_train(tmp_path):
    """Cadence 100 steps (the gate is step 100); SIGUSR1 during step 4: the snapshot is of step 4."""
    from torchtnt.framework.callback import Callback
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from toy import StatefulLoader, ToyUnit, make_data

    handled = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(signum))
    gates = []

    class SignalAtStep4(Callback):
        def on_train_step_end(self, state, unit) -> None:  # runs before the saver's hook
            gates.append(saver._snapshotter.trigger.step_gate)
            if unit.train_progress.num_steps_completed == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
                gates.append(saver._snapshotter.trigger.step_gate)

    try:
        saver = TorchSnapshotSaver(
            str(tmp_path), save_every_n_train_steps=100, save_on_train_end=False,
            preemption_signals=[signal.SIGUSR1],
        )
        train(ToyUnit(), StatefulLoader(make_data(4 * 8)), max_epochs=1, callbacks=[SignalAtStep4(), saver])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # open at step 1 (the step count, and prepare()'s second pass: asynchronous by default),
    # then closed until the cadence's step 100, and open again as soon as the signal came
    assert gates[:5] == [0, 100, 100, 100, 0]
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_4"]
    assert handled == [signal.SIGUSR1]  # handed on to the handler installed before the saver's
    assert gates[5:] == [100] * (len(gates) - 5)  # training went on; the saver stopped watching


def test_a_signal_that_comes_while_the_gate_is_recomputed_still_opens_it(tmp_path):
    """The signal handler runs between two bytecodes of whatever the training thread runs, also
    of the gate's recomputation: its gate of 0 must not be overwritten by the value computed
    from what was read before it came."""

    class SignalsWhenAsked(EveryNSteps):  # the cadence: a signal arrives while the gate asks it
        def next_step(self, last: int) -> int:
            os.kill(os.getpid(), signal.SIGUSR1)
            return super().next_step(last)

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    state = {"model": torch.nn.Linear(2, 2)}
    try:
        snap = Snapshotter(
            str(tmp_path),
            SnapshotConfig.build(
                save_every_n_train_steps=100, async_snapshot=False, save_on_train_end=False,
                preemption_signals=[signal.SIGUSR1],
            ),
        )
        snap.train_start(["model"])
        assert gated_steps(snap, [1], state) == [1] and snap.trigger.step_gate == 100
        snap.trigger.decisions = AnySave([SignalsWhenAsked(100)])
        snap.trigger.regate()
        assert snap.trigger.step_gate == 0
        assert gated_steps(snap, [2], state) == [2]  # the preemption snapshot, at once
        assert complete_in_commit_order(tmp_path) == ["epoch_0_step_2"]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_progress_rolled_back_mid_run_reaches_the_cadence_again(tmp_path):
    """A restore in the middle of a run (back to an earlier step, e.g. after a loss spike) makes
    the step count go down: a step at or below the last one seen always reaches step_end(), so
    the cadence is kept on the new trajectory instead of waiting for the old gate."""
    snap = Snapshotter(
        str(tmp_path),
        SnapshotConfig.build(
            save_every_n_train_steps=3, keep_last_n_snapshots=1, async_snapshot=False,
            save_on_train_end=False, preemption_signals=[],
        ),
    )
    state = {"model": torch.nn.Linear(2, 2)}
    snap.train_start(["model"])
    assert gated_steps(snap, range(1, 9), state) == [1, 3, 6]
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_6"] and snap.trigger.step_gate == 9
    assert gated_steps(snap, range(2, 6), state) == [2, 3]  # rolled back to step 1
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_3"]


def test_a_wall_clock_not_yet_due_keeps_the_step_cadence_and_a_rolled_back_run(tmp_path):
    """With a wall-clock cadence every step end reads the clock; one whose clock says "not yet"
    stops there, and the step cadence still saves at its steps, also after progress rolls back."""
    snap = Snapshotter(
        str(tmp_path),
        SnapshotConfig.build(
            save_every_n_train_steps=3, save_every_n_seconds=1e9, keep_last_n_snapshots=1,
            async_snapshot=False, save_on_train_end=False, preemption_signals=[],
        ),
    )
    state = {"model": torch.nn.Linear(2, 2)}
    snap.train_start(["model"])
    assert gated_steps(snap, range(1, 9), state) == list(range(1, 9))  # the clock is read every step
    assert [os.path.basename(r.path) for r in snap.stats.committed] == ["epoch_0_step_3", "epoch_0_step_6"]
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_6"]
    assert gated_steps(snap, range(2, 6), state) == [2, 3, 4, 5]  # rolled back to step 1
    assert complete_in_commit_order(tmp_path) == ["epoch_0_step_3"]
