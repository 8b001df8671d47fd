"""Every bad input gets a typed error that names the parameter and what was expected, before any work.

One table per entry point: the saver's constructor (nothing may be created on disk), ``restore``
and ``restore_from_latest`` (nothing may be loaded into the unit). Each row: the call, the error
type from ``tnt_snapshot_plugin.errors`` and a pattern the message must match.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    ConfigError,
    NothingToRestoreWarning,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
    restore,
    restore_from_latest,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import StatefulLoader, ToyUnit, make_data, weights


def tree(root: Path) -> dict[str, Any]:
    """Every path under ``root`` with its kind and size: to show nothing was created or changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = None if path.is_dir() else path.stat().st_size
    return out


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot create files in.

    A read-only tmpfs when the process may mount one (root, as on the project's machines); else a
    directory without write permission (enough for any other user); as root without mount
    permission, a path under /proc, where nobody can create directories.
    """
    path = tmp_path / "read_only"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode == 0:
        yield path
        subprocess.run(["umount", "-l", str(path)], check=True)
    elif os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
    else:
        yield Path("/proc/tnt_snapshot_plugin_test")


CADENCE_PARAMS = ["save_every_n_train_steps", "save_every_n_epochs", "keep_last_n_snapshots", "keep_last_n_checkpoints"]
BAD_CADENCES = {
    "zero": (0, r"must be a positive int \(>= 1\) or None, got 0"),
    "negative": (-3, r"must be a positive int \(>= 1\) or None, got -3"),
    "bool": (True, r"must be a positive int or None, got True of type bool"),
    "float": (2.0, r"must be a positive int or None, got 2.0 of type float"),
    "fraction": (0.5, r"must be a positive int or None, got 0.5 of type float"),
    "string": ("10", r"must be a positive int or None, got '10' of type str"),
}


@pytest.mark.parametrize("param", CADENCE_PARAMS)
@pytest.mark.parametrize("bad", list(BAD_CADENCES))
def test_bad_cadence_is_refused_before_anything_is_created(tmp_path, param, bad):
    value, message = BAD_CADENCES[bad]
    dirpath = tmp_path / "snapshots"
    with pytest.raises(ConfigError, match=rf"^{param} {message}$"):
        TorchSnapshotSaver(str(dirpath), **{param: value})
    assert not dirpath.exists()


# The saver's other arguments: (kwargs builder, error type, message pattern).
SAVER_CASES: dict[str, tuple[Callable[[Path, Path], dict[str, Any]], type, str]] = {
    "dirpath is a file": (
        lambda tmp, ro: {"dirpath": str(tmp / "a_file")},
        ConfigError,
        r"dirpath '\S+/a_file' exists and is not a directory; pass a directory",
    ),
    "dirpath under a file": (
        lambda tmp, ro: {"dirpath": str(tmp / "a_file" / "snapshots")},
        ConfigError,
        r"dirpath '\S+/a_file/snapshots' cannot be written \(Not a directory\); pass a directory this "
        "process can create files in",
    ),
    "dirpath read-only": (
        lambda tmp, ro: {"dirpath": str(ro / "snapshots")},
        ConfigError,
        r"dirpath '\S+/snapshots' cannot be written \((Read-only file system|Permission denied|No such "
        r"file or directory)\); pass a directory this process can create files in",
    ),
    "dirpath empty": (lambda tmp, ro: {"dirpath": ""}, ConfigError, r"dirpath must be a non-empty path or URL string, got ''"),
    "dirpath None": (lambda tmp, ro: {"dirpath": None}, ConfigError, r"dirpath must be a non-empty path or URL string, got None"),
    "unknown storage protocol": (
        lambda tmp, ro: {"dirpath": "gs2://bucket/run"},
        ConfigError,
        r"dirpath 'gs2://bucket/run' uses storage protocol 'gs2', which tnt_snapshot_plugin does not "
        r"support; use a local path, file:// or s3://, or install a store for it: any fsspec protocol "
        r"through pip install 'tnt-snapshot-plugin\[fsspec\]' .* tnt_snapshot_plugin\.stores",
    ),
    "replicated is a string": (
        lambda tmp, ro: {"replicated": "**"},
        ConfigError,
        r"replicated must be a list of glob strings such as \['\*\*'\], got '\*\*'",
    ),
    "replicated is a set": (
        lambda tmp, ro: {"replicated": {"**"}},
        ConfigError,
        r"replicated must be a list of glob strings such as \['\*\*'\], got \{'\*\*'\}",
    ),
    "replicated holds a non-string": (
        lambda tmp, ro: {"replicated": ["model/**", 3]},
        ConfigError,
        r"replicated must contain only non-empty strings, got \[3\]",
    ),
    "replicated holds an empty string": (
        lambda tmp, ro: {"replicated": [""]},
        ConfigError,
        r"replicated must contain only non-empty strings, got \[''\]",
    ),
    "keep_last alias conflict": (
        lambda tmp, ro: {"keep_last_n_snapshots": 2, "keep_last_n_checkpoints": 3},
        ConfigError,
        r"keep_last_n_checkpoints is another name for keep_last_n_snapshots; pass only one, or the "
        r"same value to both \(got keep_last_n_snapshots=2 and keep_last_n_checkpoints=3\)",
    ),
    "unknown on_save_error": (
        lambda tmp, ro: {"on_save_error": "ignore"},
        ConfigError,
        r"on_save_error must be one of \('warn', 'raise'\), got 'ignore'",
    ),
    "async_snapshot not a bool": (
        lambda tmp, ro: {"async_snapshot": "yes"},
        ConfigError,
        r"async_snapshot must be True or False, got 'yes'",
    ),
    "uncatchable preemption signal": (
        lambda tmp, ro: {"preemption_signals": [9]},
        ConfigError,
        r"preemption_signals: SIGKILL cannot be caught; use e.g. SIGTERM or SIGUSR1",
    ),
    "storage_options not a dict": (
        lambda tmp, ro: {"storage_options": ["endpoint_url"]},
        ConfigError,
        r"storage_options must be a dict or None, got \['endpoint_url'\]",
    ),
}


@pytest.mark.parametrize("case", list(SAVER_CASES))
def test_bad_saver_argument_is_refused_before_anything_is_created(tmp_path, read_only_dir, case):
    build, error, message = SAVER_CASES[case]
    (tmp_path / "a_file").write_text("not a directory")
    kwargs = {"dirpath": str(tmp_path / "snapshots"), **build(tmp_path, read_only_dir)}
    before = tree(tmp_path)
    with pytest.raises(error, match=rf"^{message}$"):
        TorchSnapshotSaver(kwargs.pop("dirpath"), **kwargs)
    assert tree(tmp_path) == before
    assert not os.path.exists("gs2:")


def test_config_errors_are_also_value_errors(tmp_path):
    """Code that caught torchtnt's ValueError keeps working."""
    with pytest.raises(ValueError):
        TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=0)
    assert issubclass(ConfigError, SnapshotError)


# ------------------------------------------------------------------------------------------------
# Restore


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A directory with one real snapshot of ToyUnit, epoch_1_step_2."""
    dirpath = tmp_path_factory.mktemp("saved") / "snapshots"
    train(
        ToyUnit(),
        StatefulLoader(make_data(8)),
        max_epochs=1,
        callbacks=[TorchSnapshotSaver(str(dirpath), save_every_n_epochs=1)],
    )
    assert sorted(os.listdir(dirpath)) == ["epoch_1_step_2"]
    return dirpath


@pytest.fixture
def snapshots(saved, tmp_path):
    dirpath = tmp_path / "snapshots"
    shutil.copytree(saved, dirpath)
    (dirpath / "notes").mkdir()
    (dirpath / "epoch_2_step_4").mkdir()  # an interrupted write under a snapshot's name
    (dirpath / "a_file").write_text("x")
    return dirpath


def unit_state(unit: ToyUnit) -> dict[str, Any]:
    return {
        "weights": weights(unit),
        "optimizer": repr(unit.optimizer.state_dict()),
        "lr": unit.lr_scheduler.state_dict(),
        "progress": unit.train_progress.state_dict(),
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    assert (a["optimizer"], a["lr"], a["progress"]) == (b["optimizer"], b["lr"], b["progress"])


def mismatched_unit() -> ToyUnit:
    unit = ToyUnit(seed=5)
    # layer 0 narrower (shapes differ), and an extra layer 4 the snapshot lacks
    unit.model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1), torch.nn.Linear(1, 1)
    )
    return unit


def truncated_unit() -> ToyUnit:
    unit = ToyUnit(seed=5)
    unit.model = torch.nn.Sequential(torch.nn.Linear(4, 16))  # the snapshot has layer 3 too
    return unit


RESTORE_CASES: dict[str, tuple[Callable[[Path, ToyUnit], Any], Callable[[], ToyUnit], type, str]] = {
    "path does not exist": (
        lambda d, u: TorchSnapshotSaver.restore(str(d / "epoch_9_step_99"), u),
        ToyUnit,
        SnapshotNotFoundError,
        r"snapshot \S+/epoch_9_step_99 does not exist; \S+/snapshots holds one complete snapshot, epoch_1_step_2",
    ),
    "parent does not exist": (
        lambda d, u: TorchSnapshotSaver.restore(str(d / "missing" / "epoch_1_step_2"), u),
        ToyUnit,
        SnapshotNotFoundError,
        r"snapshot \S+/missing/epoch_1_step_2 does not exist; \S+/missing holds no complete snapshot",
    ),
    "dir that is not a snapshot": (
        lambda d, u: TorchSnapshotSaver.restore(str(d / "notes"), u),
        ToyUnit,
        SnapshotNotFoundError,
        r"\S+/notes is not a snapshot: it holds no .snapshot_metadata and is not named epoch_E_step_S; "
        r"pass a snapshot directory written by the saver",
    ),
    "the directory of snapshots": (
        lambda d, u: TorchSnapshotSaver.restore(str(d), u),
        ToyUnit,
        SnapshotNotFoundError,
        r"\S+/snapshots is a directory of snapshots, not a snapshot; pass one of them \(the newest is "
        r"\S+/snapshots/epoch_1_step_2\) or use restore_from_latest",
    ),
    "interrupted write": (
        lambda d, u: TorchSnapshotSaver.restore(str(d / "epoch_2_step_4"), u),
        ToyUnit,
        SnapshotNotFoundError,
        r"\S+/epoch_2_step_4 is not a complete snapshot \(it has no .snapshot_metadata: an interrupted "
        r"write\?\); pass a committed snapshot directory",
    ),
    "a file": (
        lambda d, u: TorchSnapshotSaver.restore(str(d / "a_file"), u),
        ToyUnit,
        SnapshotNotFoundError,
        r"\S+/a_file is a file, not a snapshot directory; pass a directory written by the saver",
    ),
    "unknown storage protocol": (
        lambda d, u: TorchSnapshotSaver.restore("gs2://bucket/run/epoch_1_step_2", u),
        ToyUnit,
        ConfigError,
        r"dirpath 'gs2://bucket/run' uses storage protocol 'gs2', which tnt_snapshot_plugin does not "
        r"support; use a local path, file:// or s3://, or install a store for it: any fsspec protocol "
        r"through pip install 'tnt-snapshot-plugin\[fsspec\]' .* tnt_snapshot_plugin\.stores",
    ),
    "latest: dirpath is a file": (
        lambda d, u: TorchSnapshotSaver.restore_from_latest(str(d / "a_file"), u),
        ToyUnit,
        ConfigError,
        r"dirpath '\S+/a_file' is a file, not a directory of snapshots; pass the directory the saver "
        "wrote to",
    ),
    "latest: unknown storage protocol": (
        lambda d, u: TorchSnapshotSaver.restore_from_latest("gs2://bucket/run", u),
        ToyUnit,
        ConfigError,
        r"dirpath 'gs2://bucket/run' uses storage protocol 'gs2'.*; use a local path, file:// or s3://, "
        r"or install a store for it: .*",
    ),
    "modules differ in keys and shapes": (
        lambda d, u: TorchSnapshotSaver.restore(str(d / "epoch_1_step_2"), u),
        mismatched_unit,
        StateMismatchError,
        r"cannot restore \S+/epoch_1_step_2: the modules do not match the snapshot: "
        r"model: the module has \['4.bias', '4.weight'\] that the snapshot lacks; "
        r"model.0.bias: shape \[8\] in the module, \[16\] in the snapshot; "
        r"model.0.weight: shape \[8, 4\] in the module, \[16, 4\] in the snapshot; "
        r"model.3.weight: shape \[1, 8\] in the module, \[1, 16\] in the snapshot",
    ),
    "module lacks keys the snapshot has": (
        lambda d, u: restore_from_latest(str(d), {"model": u.model}),
        truncated_unit,
        StateMismatchError,
        r"cannot restore \S+/epoch_1_step_2: the modules do not match the snapshot: "
        r"model: the snapshot has \['3.bias', '3.weight'\] that the module lacks",
    ),
    "entry missing from the snapshot": (
        lambda d, u: restore(str(d / "epoch_1_step_2"), {"model": u.model, "ema": torch.nn.Linear(1, 1)}),
        ToyUnit,
        StateMismatchError,
        r"snapshot \S+/epoch_1_step_2 holds no entries \['ema'\] \(it holds \[.*'model'.*\]\); restore "
        r"into the same kind of unit that was saved, or pass strict=False to skip them",
    ),
}


@pytest.mark.parametrize("case", list(RESTORE_CASES))
def test_bad_restore_is_refused_before_anything_is_loaded(snapshots, case):
    call, make_unit, error, message = RESTORE_CASES[case]
    unit = make_unit()
    before = unit_state(unit)
    files_before = tree(snapshots)
    with pytest.raises(error, match=rf"^{message}$"):
        call(snapshots, unit)
    assert_same_state(unit_state(unit), before)
    assert tree(snapshots) == files_before


def test_restore_from_latest_of_a_missing_or_empty_dirpath_is_not_an_error(tmp_path):
    """A first run: nothing to restore is not a bad input; it is said, naming the dirpath (which
    may be misspelt), and training starts from the beginning."""
    unit = ToyUnit()
    with pytest.warns(NothingToRestoreWarning, match="missing does not exist"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "missing"), unit) is False
    with pytest.warns(NothingToRestoreWarning, match="is empty"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit) is False
    assert not (tmp_path / "missing").exists()
