"""A new user's first hour: the demo, the messages of a first mistake, and the warnings' categories.

Real demo runs (torchtnt's train(), Lightning's Trainer.fit), real directories on disk.
"""

from __future__ import annotations

import os
import warnings

import pytest

from tnt_snapshot_plugin import demo
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.errors import SnapshotBusyWarning
from tnt_snapshot_plugin.plugins import adapters


def _tree(path) -> dict[str, int]:
    """Every file under ``path`` and its size."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


@pytest.mark.slow
@pytest.mark.frameworks
def test_the_demo_refuses_a_directory_that_holds_anything_but_its_own_snapshots(tmp_path, capsys):
    # A real run's snapshots (no demo marker): the demo would have deleted them.
    from torchtnt.framework.train import train

    from toy import StatefulLoader, ToyUnit, make_data

    run = tmp_path / "run1"
    train(ToyUnit(), StatefulLoader(make_data(8)), max_epochs=2,
          callbacks=[TorchSnapshotSaver(str(run), save_every_n_epochs=1)])
    before = _tree(run)
    assert any(name.startswith("epoch_2_step_4/") for name in before)
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--dirpath", str(run)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--dirpath {run} is not empty and was not written by the demo" in err
    assert "epoch_" in err and "new or empty directory" in err
    assert _tree(run) == before  # nothing touched

    # A user's file beside an earlier demo's snapshots: refused too, naming the file.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / demo.DEMO_MARKER).write_text("")
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        demo.main(["--dirpath", str(mine)])
    assert "notes.txt" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"

    # A new directory, then the same one again (it holds only the demo's own snapshots): both run.
    fresh = tmp_path / "demo"
    assert demo.main(["--dirpath", str(fresh), "--epochs", "2", "--steps-per-epoch", "6"]) == 0
    first = sorted(os.listdir(fresh))
    assert demo.DEMO_MARKER in first and any(n.startswith("epoch_") for n in first)
    assert demo.main(["--dirpath", str(fresh), "--epochs", "2", "--steps-per-epoch", "6"]) == 0
    assert "final weights bitwise equal to an uninterrupted run: yes" in capsys.readouterr().out
    # An empty directory is fine too.
    (tmp_path / "empty").mkdir()
    assert demo._refusal(str(tmp_path / "empty")) is None


@pytest.mark.slow
@pytest.mark.frameworks
@pytest.mark.parametrize("framework", ["torchtnt", "lightning"])
def test_the_demos_cadence_never_makes_training_wait_for_its_own_snapshot(tmp_path, framework):
    run = adapters()[framework].load_demo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotBusyWarning)  # setup.cfg ignores it elsewhere
        report = run(str(tmp_path), epochs=3, steps_per_epoch=12, interrupt_at=19)
    assert report["busy_waits"] == 0
    assert len(report["saved"]) >= 3 and report["bitwise_identical"]


def test_busy_waits_are_a_warning_category_users_can_filter():
    assert issubclass(SnapshotBusyWarning, UserWarning)
    import tnt_snapshot_plugin

    assert tnt_snapshot_plugin.SnapshotBusyWarning is SnapshotBusyWarning
    assert "SnapshotBusyWarning" in tnt_snapshot_plugin.__all__
