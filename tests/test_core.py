"""Unit tests of the framework-neutral core: naming, ordering, collisions, replicated globs,
configuration, plugin loading and the core's independence from the frameworks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tnt_snapshot_plugin import ConfigError, KeyCollisionError, SnapshotName
from tnt_snapshot_plugin.app_state import Frozen, check_collisions
from tnt_snapshot_plugin.config import Knobs, SnapshotConfig
from tnt_snapshot_plugin.format.torchsnapshot.encoding import replicated_patterns
from tnt_snapshot_plugin.hooks import adapters, new_plugin_manager
from tnt_snapshot_plugin.naming import is_staging_name, staging_name


def test_name_round_trip():
    name = SnapshotName.of(epoch=2, step=340)
    assert name.text == "epoch_2_step_340"
    assert SnapshotName.parse(name.text) == name


@pytest.mark.parametrize(
    "text, epoch, step, eval_step, metric",
    [
        ("epoch_1_train_step_10", 1, 10, None, None),
        ("epoch_1_train_step_10_eval_step_4", 1, 10, 4, None),
        ("epoch_3_train_step_30_eval_step_9_val_loss=0.125", 3, 30, 9, ("val_loss", 0.125)),
        ("epoch_0_step_5_acc=-1e-3", 0, 5, None, ("acc", -1e-3)),
        ("epoch_1_step_3_eval_2", 1, 3, 2, None),
        ("epoch_1_step_3_eval_2_acc=0.5", 1, 3, 2, ("acc", 0.5)),
    ],
)
def test_parses_torchtnt_phase_aware_and_metric_names(text, epoch, step, eval_step, metric):
    parsed = SnapshotName.parse(text)
    assert parsed is not None
    assert (parsed.epoch, parsed.step, parsed.eval_step) == (epoch, step, eval_step)
    if metric is None:
        assert parsed.metric is None
    else:
        assert (parsed.metric, parsed.metric_value) == metric
    assert parsed.phase_aware == ("train_step" in text)


def test_a_slash_in_a_metric_name_is_written_percent_2f_and_read_back():
    """Lightning's ``val/loss``: a ``/`` in a directory name would make a subdirectory."""
    name = SnapshotName.of(1, 6, None, ("val/loss", 0.25))
    assert name.text == "epoch_1_step_6_val%2Floss=0.25" and "/" not in name.text
    assert SnapshotName.parse(name.text) == name
    assert (name.metric, name.metric_value) == ("val/loss", 0.25)
    assert SnapshotName.parse("epoch_1_step_6_train%2Fepoch%2Facc=1.0").metric == "train/epoch/acc"
    for text in ("epoch_1_step_6_val%loss=0.25", "epoch_1_step_6_val%2floss=0.25", "epoch_1_step_6_val/loss=0.25"):
        assert SnapshotName.parse(text) is None
    with pytest.raises(ValueError, match="letters, digits, '_', '.' and '/'"):
        SnapshotName.of(1, 6, None, ("val loss", 0.25))


def test_eval_name_round_trip_and_order():
    name = SnapshotName.of(epoch=1, step=3, eval_step=2)
    assert name.text == "epoch_1_step_3_eval_2"
    assert SnapshotName.parse(name.text) == name
    names = ["epoch_1_step_4", "epoch_1_step_3_eval_2", "epoch_1_step_3", "epoch_1_step_3_eval_0"]
    assert [n.text for n in sorted(map(SnapshotName.parse, names))] == [
        "epoch_1_step_3",
        "epoch_1_step_3_eval_0",
        "epoch_1_step_3_eval_2",
        "epoch_1_step_4",
    ]


@pytest.mark.parametrize(
    "text", ["epoch_1", "epoch_x_step_1", "step_3", "epoch_1_step_2.tmp", "notes", "epoch_-1_step_2", ""]
)
def test_rejects_other_names(text):
    assert SnapshotName.parse(text) is None


def test_orders_by_epoch_then_step_not_by_text():
    names = ["epoch_10_step_100", "epoch_2_step_20", "epoch_2_step_9", "epoch_1_train_step_10"]
    ordered = sorted(SnapshotName.parse(n) for n in names)
    assert [n.text for n in ordered] == [
        "epoch_1_train_step_10",
        "epoch_2_step_9",
        "epoch_2_step_20",
        "epoch_10_step_100",
    ]


def test_staging_names_are_recognised_and_distinct_from_snapshots():
    staged = staging_name("epoch_1_step_4", "abc123")
    assert is_staging_name(staged)
    assert SnapshotName.parse(staged) is None
    assert not is_staging_name(".tnt_staging.notes.abc")
    assert not is_staging_name("epoch_1_step_4")


@pytest.mark.parametrize("torchtnt_name", ["keep_last_n_checkpoints", "async_checkpoint", "knob_options"])
def test_the_core_configuration_takes_the_plugins_own_names_only(torchtnt_name):
    """torchtnt's names are the torchtnt adapter's to resolve (adapters/torchtnt/options.py)."""
    assert SnapshotConfig.build(keep_last_n_snapshots=3).keep_last_n_snapshots == 3
    with pytest.raises(TypeError, match=torchtnt_name):
        SnapshotConfig.build(**{torchtnt_name: None})
    with pytest.raises(ConfigError, match="keep_last_n_snapshots must be a positive int"):
        SnapshotConfig.build(keep_last_n_snapshots=0)
    with pytest.raises(ConfigError, match=r"knobs must be a Knobs .* got \{'max_per_rank_io_concurrency': 2\}"):
        SnapshotConfig.build(knobs={"max_per_rank_io_concurrency": 2})
    with pytest.raises(ConfigError, match="max_per_rank_io_concurrency must be a positive int"):
        Knobs(max_per_rank_io_concurrency=0)


def test_collisions_name_the_key_and_its_owners():
    check_collisions(["model", "optimizer"], [("plugin A", ["ema"])])
    with pytest.raises(KeyCollisionError, match="'rng_state' is reserved"):
        check_collisions(["model", "rng_state"])
    with pytest.raises(KeyCollisionError, match="'ema' from plugin B is already used by plugin A"):
        check_collisions(["model"], [("plugin A", ["ema"]), ("plugin B", ["ema"])])
    with pytest.raises(KeyCollisionError, match="'model' from plugin A is already used by the unit"):
        check_collisions(["model"], [("plugin A", ["model"])])


def _frozen(**entries):
    return {key: Frozen(value) for key, value in entries.items()}


def test_replicated_never_marks_rng_progress_or_loader():
    frozen = _frozen(
        model={"w": torch.zeros(2), "b": torch.zeros(1)},
        train_progress={"num_steps_completed": 3},
        rng_state={"torch": torch.zeros(3, dtype=torch.uint8)},
        train_dataloader={"position": 1},
    )
    assert replicated_patterns(["**"], frozen) == ["model/**"]


def test_replicated_partial_match_lists_paths_and_escapes_glob_characters():
    frozen = _frozen(model={"w[0]": torch.zeros(2), "b": torch.zeros(1)}, optim={"lr": torch.zeros(1)})
    assert replicated_patterns(["model/w*"], frozen) == ["model/w[[]0]"]
    assert replicated_patterns(None, frozen) == []
    assert replicated_patterns(None, frozen, auto_replicated=["optim"]) == ["optim/**"]


@pytest.mark.frameworks
def test_core_never_imports_a_framework_nor_torchsnapshot():
    code = (
        "import sys\n"
        "import tnt_snapshot_plugin, tnt_snapshot_plugin.saving.saver, tnt_snapshot_plugin.restoring\n"
        "import tnt_snapshot_plugin.stores, tnt_snapshot_plugin.stores.s3, tnt_snapshot_plugin.stores.fsspec\n"
        "import tnt_snapshot_plugin.stores.fileio, tnt_snapshot_plugin.saving.writer, tnt_snapshot_plugin.demo, tnt_snapshot_plugin.testing\n"
        "import tnt_snapshot_plugin.format.torchsnapshot.writer, tnt_snapshot_plugin.format.torchsnapshot.reader, tnt_snapshot_plugin.cli\n"
        "from tnt_snapshot_plugin.hooks import get_plugin_manager, adapters\n"
        "assert sorted(adapters(get_plugin_manager())) == ['lightning', 'torchtnt']\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torchtnt', 'pytorch_lightning', 'lightning', 'lightning_fabric', 'torchsnapshot'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_package_does_not_import_torch():
    code = "import sys, tnt_snapshot_plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.frameworks
def test_builtin_adapters_load_through_the_entry_point_group():
    pm = new_plugin_manager()
    assert sorted(name for name, _ in pm.list_name_plugin()) == ["lightning", "torchtnt"]
    found = adapters(pm)
    assert found["torchtnt"].load_saver().__module__ == "tnt_snapshot_plugin.adapters.torchtnt.saver"
    assert found["lightning"].framework == "pytorch_lightning"


@pytest.mark.frameworks
def test_adapter_whose_framework_is_missing_is_blocked_not_broken(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytorch_lightning" else real(name, *a)
    )
    pm = new_plugin_manager()
    assert pm.is_blocked("lightning")
    assert sorted(adapters(pm)) == ["torchtnt"]


@pytest.mark.frameworks
def test_a_plugin_can_be_blocked_by_name():
    pm = new_plugin_manager(blocked=("torchtnt",))
    assert sorted(adapters(pm)) == ["lightning"]


HIDE_FRAMEWORKS = """
import importlib.abc, importlib.util, sys
HIDDEN = ("torchtnt", "pytorch_lightning", "lightning", "lightning_fabric")
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
_real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in HIDDEN else _real_find_spec(name, *a)
"""


@pytest.mark.frameworks
def test_core_unit_tests_pass_with_no_framework_installed(tmp_path):
    """Run this file and the hook tests where torchtnt and Lightning cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_FRAMEWORKS)
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    pytest_exe = os.path.join(os.path.dirname(sys.executable), "pytest")
    out = subprocess.run(
        [pytest_exe, "-q", "-p", "no:cacheprovider", "-m", "not frameworks",
         os.path.join(here, "test_core.py"), os.path.join(here, "test_hooks.py")],
        capture_output=True, text=True, env=env, cwd=os.path.dirname(here),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    hidden = subprocess.run([sys.executable, "-c", "import torchtnt"], capture_output=True, env=env)
    assert hidden.returncode != 0 and b"No module named 'torchtnt'" in hidden.stderr


class _Peers:
    """A stand-in for a process group (pure-core unit tests only): all_gather returns this
    rank's report among the other ranks' reports, given up front."""

    def __init__(self, rank: int, others: dict[int, object]) -> None:
        self.rank, self.others = rank, others
        self.world_size = len(others) + 1

    def all_gather(self, mine: object) -> list[object]:
        return [mine if r == self.rank else self.others[r] for r in range(self.world_size)]


def _report(error: Exception) -> object:
    """What a rank that failed with ``error`` contributes to raise_if_any_failed's all_gather."""
    from tnt_snapshot_plugin.distributed import is_consequence
    from tnt_snapshot_plugin.errors import SnapshotCorruptError

    return (isinstance(error, SnapshotCorruptError), f"{type(error).__name__}: {error}", is_consequence(error))


def test_damage_on_any_rank_is_raised_as_damage_on_every_rank_together():
    """restore's checks: a rank that found damage makes every rank raise SnapshotCorruptError
    marked all_ranks (restore_from_latest then falls back on all of them); a failure of another
    kind on any rank keeps every rank from falling back."""
    from tnt_snapshot_plugin.distributed import raise_if_any_failed
    from tnt_snapshot_plugin.errors import SnapshotCorruptError, StateMismatchError

    damage = SnapshotCorruptError("file 1/x is damaged")
    # rank 0 found nothing wrong; rank 1 found damage
    with pytest.raises(SnapshotCorruptError, match="rank 1: SnapshotCorruptError: file 1/x is damaged") as raised:
        raise_if_any_failed(_Peers(0, {1: _report(damage)}), None, "restoring s", together=SnapshotCorruptError)
    assert raised.value.all_ranks is True
    # rank 1 itself: its own error, marked
    with pytest.raises(SnapshotCorruptError) as raised:
        raise_if_any_failed(_Peers(1, {0: None}), damage, "restoring s", together=SnapshotCorruptError)
    assert raised.value is damage and damage.all_ranks is True
    # damage on rank 0, a misfit on rank 1: no rank is told to fall back
    misfit = StateMismatchError("model.w: shape differs")
    with pytest.raises(SnapshotCorruptError) as raised:
        fresh = SnapshotCorruptError("file 0/x is damaged")
        raise_if_any_failed(_Peers(0, {1: _report(misfit)}), fresh, "restoring s", together=SnapshotCorruptError)
    assert not getattr(raised.value, "all_ranks", False)
    with pytest.raises(StateMismatchError) as raised:
        raise_if_any_failed(_Peers(1, {0: _report(fresh)}), misfit, "restoring s", together=SnapshotCorruptError)
    assert not getattr(raised.value, "all_ranks", False)
