"""Each pluggy hook, exercised by a tiny plugin against a real Snapshotter and real writes."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
import torch
from dir_listing import visible_by_name

from tnt_snapshot_plugin import ConfigError, KeyCollisionError, hookimpl, hookspecs
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.restoring import restore, restore_from_latest
from tnt_snapshot_plugin.saving.saver import Snapshotter

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Counter:
    """A minimal Stateful a plugin can contribute."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def run(dirpath, pm, steps=4, **config):
    """Drive a Snapshotter through `steps` steps of one epoch with a linear model."""
    config.setdefault("preemption_signals", [])
    snap = Snapshotter(str(dirpath), SnapshotConfig.build(**config), plugin_manager=pm)
    model = torch.nn.Linear(3, 2)
    state = {"model": model}
    snap.train_start(state.keys())
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.fill_(step)
        snap.step_end(0, step, lambda intra: state)
    snap.train_end(0, steps, lambda intra: state)
    return snap, model


def test_extra_state_is_saved_and_restored(tmp_path, pm):
    counter = Counter(41)

    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_extra_state(self, event):
            return {"counter": counter}

    pm.register(Plugin())
    run(tmp_path, pm, save_every_n_train_steps=2)
    counter.value = 0
    restore(str(tmp_path / "epoch_0_step_4"), {"model": torch.nn.Linear(3, 2)}, plugin_manager=pm)
    assert counter.value == 41


def test_extra_state_colliding_with_the_unit_raises_before_writing(tmp_path, pm):
    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_extra_state(self):
            return {"model": Counter()}

    pm.register(Plugin())
    with pytest.raises(KeyCollisionError, match="'model' from tnt_snapshot_plugin_extra_state"):
        run(tmp_path, pm, save_every_n_train_steps=2)
    assert visible_by_name(tmp_path) == []


def test_should_snapshot_overrides_the_cadence(tmp_path, pm):
    asked = []

    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshot(self, event, step, default):
            asked.append((event, step, default))
            return step == 3 or None  # force step 3, defer otherwise

    pm.register(Plugin())
    run(tmp_path, pm, save_every_n_train_steps=2, save_on_train_end=False)
    assert visible_by_name(tmp_path) == ["epoch_0_step_2", "epoch_0_step_3", "epoch_0_step_4"]
    assert ("step", 2, True) in asked and ("step", 1, False) in asked


def test_should_snapshot_can_veto(tmp_path, pm):
    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshot(self):
            return False

    pm.register(Plugin())
    run(tmp_path, pm, save_every_n_train_steps=1, save_on_train_end=False)
    assert visible_by_name(tmp_path) == []


def test_snapshot_name_may_add_a_metric_suffix_and_stays_findable(tmp_path, pm):
    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_snapshot_name(self, step, default):
            return f"{default}_loss={1.0 / step}"

    pm.register(Plugin())
    run(tmp_path, pm, save_every_n_train_steps=2, save_on_train_end=False)
    assert visible_by_name(tmp_path) == ["epoch_0_step_2_loss=0.5", "epoch_0_step_4_loss=0.25"]
    index = (tmp_path / "epoch_0_step_4_loss=0.25" / ".tnt_snapshot_index.json").read_text()
    assert '"metric": {"name": "loss", "value": 0.25}' in index
    model = torch.nn.Linear(3, 2)
    assert restore_from_latest(str(tmp_path), {"model": model}, plugin_manager=pm).endswith("loss=0.25")
    assert torch.all(model.weight == 4)


def test_snapshot_name_that_restore_could_not_find_is_refused(tmp_path, pm):
    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_snapshot_name(self):
            return "final-model"

    pm.register(Plugin())
    with pytest.raises(ConfigError, match="returned 'final-model'"):
        run(tmp_path, pm, save_every_n_train_steps=2)
    assert visible_by_name(tmp_path) == []


def test_snapshot_committed_is_told_after_the_commit(tmp_path, pm):
    seen = []

    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_snapshot_committed(self, path, epoch, step):
            # at this moment the snapshot is complete and visible to restore
            seen.append((os.path.basename(path), epoch, step, os.path.isfile(os.path.join(path, ".snapshot_metadata"))))

    pm.register(Plugin())
    run(tmp_path, pm, save_every_n_train_steps=2)
    assert seen == [("epoch_0_step_2", 0, 2, True), ("epoch_0_step_4", 0, 4, True)]


def test_after_restore_is_told_what_was_loaded(tmp_path, pm):
    seen = []

    class Plugin:
        @hookimpl
        def tnt_snapshot_plugin_after_restore(self, path, keys):
            seen.append((os.path.basename(path), keys))

    pm.register(Plugin())
    run(tmp_path, pm, save_every_n_train_steps=4)
    restore_from_latest(str(tmp_path), {"model": torch.nn.Linear(3, 2)}, plugin_manager=pm)
    assert seen == [("epoch_0_step_4", ["model", "rng_state"])]


@pytest.mark.frameworks
def test_adapters_hook_lists_builtin_and_third_party_adapters():
    from tnt_snapshot_plugin.hooks import AdapterInfo, adapters, new_plugin_manager

    class ThirdParty:
        @hookimpl
        def tnt_snapshot_plugin_adapters(self):
            return AdapterInfo(name="mine", framework="json", saver="json:JSONDecoder")

    pm = new_plugin_manager()
    pm.register(ThirdParty(), name="mine")
    found = adapters(pm)
    assert {name: info.framework for name, info in found.items()} == {
        "torchtnt": "torchtnt",
        "lightning": "pytorch_lightning",
        "mine": "json",
    }
    import json

    assert found["mine"].load_saver() is json.JSONDecoder


def test_a_step_that_does_not_snapshot_collects_nothing(tmp_path, pm):
    snap = Snapshotter(
        str(tmp_path), SnapshotConfig.build(save_every_n_train_steps=10, preemption_signals=[]), plugin_manager=pm
    )
    snap.train_start(["model"])

    def collect(intra):
        raise AssertionError("state collected on a step that does not snapshot")

    for step in range(1, 10):
        snap.step_end(0, step, collect)
    assert visible_by_name(tmp_path) == []


def _hook_names():
    tree = ast.parse(pathlib.Path(hookspecs.__file__).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("tnt_snapshot_plugin_")]


def test_every_hook_is_documented_and_tested():
    hooks = _hook_names()
    assert len(hooks) == 6
    reference = (ROOT / "docs" / "plugins.md").read_text()
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for hook in hooks:
        assert f"`{hook}`" in reference, f"{hook} is not in docs/plugins.md's table of hooks"
        assert f"def {hook}(" in tests, f"no test implements {hook}"
