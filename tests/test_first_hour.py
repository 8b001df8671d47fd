"""A new user's first hour: the demo, the messages of a first mistake, and the warnings' categories.

Real demo runs (torchtnt's train(), Lightning's Trainer.fit), real directories on disk.
"""

from __future__ import annotations

import os
import warnings

import pytest

from tnt_snapshot_plugin import demo
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.errors import NothingToRestoreWarning, SnapshotBusyWarning
from tnt_snapshot_plugin.hooks import adapters


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
        warnings.simplefilter("error", SnapshotBusyWarning)
        report = run(str(tmp_path), epochs=3, steps_per_epoch=12, interrupt_at=19)
    assert report["busy_waits"] == 0
    assert len(report["saved"]) >= 3 and report["bitwise_identical"]


def test_busy_waits_are_a_warning_category_users_can_filter():
    assert issubclass(SnapshotBusyWarning, UserWarning)
    import tnt_snapshot_plugin

    assert tnt_snapshot_plugin.SnapshotBusyWarning is SnapshotBusyWarning
    assert "SnapshotBusyWarning" in tnt_snapshot_plugin.__all__


# -- the command line ----------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A real torchtnt run's directory: epoch_1_step_2, epoch_2_step_4, epoch_3_step_6."""
    from torchtnt.framework.train import train

    from toy import StatefulLoader, ToyUnit, make_data

    monkeypatch.chdir(tmp_path)
    train(ToyUnit(), StatefulLoader(make_data(8)), max_epochs=3,
          callbacks=[TorchSnapshotSaver("run1", save_every_n_epochs=1)])
    return tmp_path / "run1"


def _cli(args, capsys) -> tuple[int, str, str]:
    from tnt_snapshot_plugin.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.frameworks
def test_the_cli_says_what_a_path_is(run_dir, capsys):
    # A directory of snapshots given where one snapshot is needed: named as such, with the newest.
    for args in (["inspect", "run1"], ["export", "run1", "model.pt"], ["diff", "run1", "run1/epoch_1_step_2"]):
        code, _, err = _cli(args, capsys)
        assert code == 2, args
        assert "run1 is a directory of snapshots, not a snapshot" in err
        assert "3 complete snapshots" in err and "the newest epoch_3_step_6" in err
        assert "name one, e.g. ./run1/epoch_3_step_6" in err
        assert len(err.strip().splitlines()) == 1
    assert not os.path.exists("model.pt")
    # Missing: says so, and lists what exists beside it (retention may have deleted it).
    code, _, err = _cli(["inspect", "run1/epoch_0_step_1"], capsys)
    assert code == 2
    assert "run1/epoch_0_step_1 does not exist" in err
    assert "epoch_1_step_2, epoch_2_step_4, epoch_3_step_6 (the newest epoch_3_step_6)" in err
    # A missing absolute path is missing, not "a bucket or root".
    code, _, err = _cli(["inspect", str(run_dir.parent / "nowhere")], capsys)
    assert code == 2 and "nowhere does not exist" in err and "bucket" not in err
    # Damaged: the file and the checksum named.
    meta = run_dir / "epoch_3_step_6" / ".snapshot_metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 1
    meta.write_bytes(bytes(data))
    code, _, err = _cli(["inspect", "run1/epoch_3_step_6"], capsys)
    assert code == 2 and ".snapshot_metadata" in err and "damaged" in err
    # Incomplete: no metadata at all.
    meta.unlink()
    code, _, err = _cli(["inspect", "run1/epoch_3_step_6"], capsys)
    assert code == 2 and "is not a complete snapshot" in err


def test_the_cli_prints_its_version(capsys):
    from importlib.metadata import version

    import tnt_snapshot_plugin

    code, out, _ = _cli(["--version"], capsys)
    assert code == 0
    assert out.strip() == f"tnt-snapshot {version('tnt-snapshot-plugin')}"
    assert tnt_snapshot_plugin.__version__ == version("tnt-snapshot-plugin")  # one place: setup.cfg


def test_without_the_cli_extra_the_command_says_in_one_line_how_to_install_it(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['click'] = None  # as if the cli extra were not installed\n"
        "from tnt_snapshot_plugin.cli import main\n"
        "sys.exit(main(['ls', '.']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "tnt-snapshot needs the cli extra (click, rich): pip install 'tnt-snapshot-plugin[cli]' (missing: click)"
    ]


# -- restore ------------------------------------------------------------------------------------


@pytest.mark.frameworks
def test_restore_from_latest_on_a_dirpath_that_does_not_exist_warns_naming_it(tmp_path):
    from toy import ToyUnit

    misspelt = str(tmp_path / "ck" / "run_1")
    with pytest.warns(NothingToRestoreWarning, match=r"restore_from_latest: dirpath .*ck/run_1 does not exist") as seen:
        assert TorchSnapshotSaver.restore_from_latest(misspelt, ToyUnit()) is False
    assert len([w for w in seen if "does not exist" in str(w.message)]) == 1
    # An existing, empty dirpath (the saver's constructor made it, misspelt or not): said too.
    (tmp_path / "ck" / "run_0").mkdir(parents=True)
    with pytest.warns(NothingToRestoreWarning, match=r"dirpath .*ck/run_0 is empty: nothing was restored") as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "ck" / "run_0"), ToyUnit()) is False
    assert len(seen) == 1


@pytest.mark.frameworks
def test_a_snapshot_that_does_not_exist_is_named_with_those_that_do(run_dir):
    from tnt_snapshot_plugin.errors import SnapshotNotFoundError
    from toy import ToyUnit

    # keep_last_n deleted it, or the name is misspelt: the message lists what is there.
    with pytest.raises(SnapshotNotFoundError) as err:
        TorchSnapshotSaver.restore("run1/epoch_0_step_1", ToyUnit())
    message = str(err.value)
    assert "snapshot run1/epoch_0_step_1 does not exist" in message
    assert "3 complete snapshots: epoch_1_step_2, epoch_2_step_4, epoch_3_step_6 (the newest epoch_3_step_6)" in message
    with pytest.raises(SnapshotNotFoundError, match="holds no complete snapshot"):
        TorchSnapshotSaver.restore(str(run_dir.parent / "elsewhere" / "epoch_1_step_2"), ToyUnit())


@pytest.mark.frameworks
def test_resuming_from_an_epoch_end_snapshot_with_a_plain_dataloader_is_quiet(run_dir):
    # Nothing replays: the next epoch starts at its first batch anyway. (A mid-epoch snapshot
    # says how many batches replay: tests/test_silent_start.py.)
    from torch.utils.data import DataLoader, TensorDataset

    from tnt_snapshot_plugin.demo_data import make_data
    from toy import ToyUnit

    plain = DataLoader(TensorDataset(*make_data(8)), batch_size=4, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TorchSnapshotSaver.restore_from_latest("run1", ToyUnit(), train_dataloader=plain)


@pytest.mark.frameworks
def test_diff_says_differs_for_rng_state_not_a_number(run_dir, capsys):
    code, out, _ = _cli(["diff", "run1/epoch_1_step_2", "run1/epoch_2_step_4"], capsys)
    assert code == 1
    rng = [line for line in out.splitlines() if line.startswith("0/rng_state/")]
    assert rng and all(line.split()[1:] == ["changed", "differs"] for line in rng), rng
    weights = [line for line in out.splitlines() if line.startswith("0/model/")]
    assert weights and all("max |a-b| = " in line for line in weights)  # real tensors get a number
