"""A plugin manager per saver: registration checked at once, late plugins called, savers kept apart.

Real Snapshotters writing to disk. The plugin example a user copies, examples/ema_plugin.py,
runs in tests/test_examples.py.
"""

from __future__ import annotations

import os
import pathlib

import pluggy
import pytest
import torch
from dir_listing import visible_by_name

from tnt_snapshot_plugin import ConfigError, hookimpl, hookspecs
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.hooks import PluginManager, adapters, new_plugin_manager
from tnt_snapshot_plugin.restoring import restore
from tnt_snapshot_plugin.saving.saver import Snapshotter

ROOT = pathlib.Path(__file__).resolve().parent.parent


def saver(dirpath, pm=None, **config):
    config.setdefault("preemption_signals", [])
    return Snapshotter(str(dirpath), SnapshotConfig.build(**config), plugin_manager=pm)


def drive(snap, steps, start=1):
    model = torch.nn.Linear(2, 2)
    state = {"model": model}
    if start == 1:
        snap.train_start(state.keys())
    for step in range(start, start + steps):
        snap.step_end(0, step, lambda intra: state)
    snap.wait()
    return state


def test_an_unknown_hook_name_is_refused_at_register_and_named(tmp_path, pm):
    snap = saver(tmp_path, pm)

    class Misspelt:
        @hookimpl
        def tnt_snapshot_plugin_extra_sate(self, event):
            return {}

    with pytest.raises(ConfigError, match="unknown hook 'tnt_snapshot_plugin_extra_sate'"):
        snap.register(Misspelt())
    assert pm.get_plugins() == set()


def test_a_hook_without_the_marker_or_with_a_foreign_parameter_is_refused(tmp_path, pm):
    snap = saver(tmp_path, pm)

    class Unmarked:
        def tnt_snapshot_plugin_extra_state(self, event):
            return {}

    class WrongParameter:
        @hookimpl
        def tnt_snapshot_plugin_extra_state(self, evnt):
            return {}

    with pytest.raises(ConfigError, match="tnt_snapshot_plugin_extra_state .* not marked with @"):
        snap.register(Unmarked())
    with pytest.raises(ConfigError, match="evnt"):
        snap.register(WrongParameter())
    assert pm.get_plugins() == set()


def test_a_plain_pluggy_manager_is_checked_the_same_way(tmp_path):
    plain = pluggy.PluginManager("tnt_snapshot_plugin")
    plain.add_hookspecs(hookspecs)
    snap = saver(tmp_path, plain)

    class Misspelt:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshott(self):
            return True

    with pytest.raises(ConfigError, match="tnt_snapshot_plugin_should_snapshott"):
        snap.register(Misspelt())
    assert plain.get_plugins() == set()

    class Always:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshot(self):
            return True

    drive(snap, 1)
    snap.register(Always())
    drive(snap, 2, start=2)
    assert visible_by_name(tmp_path) == ["epoch_0_step_2", "epoch_0_step_3"]


def test_should_snapshot_registered_after_construction_and_mid_run_is_called(tmp_path, pm):
    """The README's order: build the saver, then register; and a plugin registered while the step
    gate is closed (cadence 100) opens it at the next step."""
    snap = saver(tmp_path, pm, save_every_n_train_steps=100)
    asked = []

    class Every3:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshot(self, step, default):
            asked.append(step)
            return step % 3 == 0 or None

    drive(snap, 4)  # the gate is now at step 100
    assert snap.trigger.step_gate == 100
    plugin = Every3()
    snap.register(plugin)
    drive(snap, 3, start=5)
    assert asked == [5, 6, 7]
    assert visible_by_name(tmp_path) == ["epoch_0_step_6"]
    snap.unregister(plugin)
    drive(snap, 5, start=8)  # 9 would be due for the plugin: it is gone
    assert asked == [5, 6, 7] and snap.trigger.step_gate == 100
    assert visible_by_name(tmp_path) == ["epoch_0_step_6"]


def test_a_plugin_on_one_saver_never_reaches_another_saver_or_its_restore(tmp_path):
    a = saver(tmp_path / "a", save_every_n_train_steps=2)
    b = saver(tmp_path / "b", save_every_n_train_steps=2)
    assert a.plugin_manager is not b.plugin_manager
    seen = []

    class Named:
        @hookimpl
        def tnt_snapshot_plugin_snapshot_name(self, default):
            return f"{default}_loss=0.5"

        @hookimpl
        def tnt_snapshot_plugin_after_restore(self, path):
            seen.append(os.path.basename(path))

    a.register(Named())
    drive(a, 2)
    drive(b, 2)
    assert visible_by_name(tmp_path / "a") == ["epoch_0_step_2_loss=0.5"]
    assert visible_by_name(tmp_path / "b") == ["epoch_0_step_2"]
    restore(str(tmp_path / "b" / "epoch_0_step_2"), {"model": torch.nn.Linear(2, 2)},
            plugin_manager=b.plugin_manager)
    restore(str(tmp_path / "b" / "epoch_0_step_2"), {"model": torch.nn.Linear(2, 2)})
    assert seen == []
    restore(str(tmp_path / "a" / "epoch_0_step_2_loss=0.5"), {"model": torch.nn.Linear(2, 2)},
            plugin_manager=a.plugin_manager)
    assert seen == ["epoch_0_step_2_loss=0.5"]


def test_a_restore_without_a_manager_loads_the_entry_point_plugins_only_for_entries_it_does_not_name(
    tmp_path, monkeypatch
):
    """Loading the entry-point plugins reads every installed distribution (milliseconds): a
    restore given no manager does it only when the snapshot holds an entry the request does not
    name, which a plugin's extra state may claim; never when a manager is passed in."""
    from tnt_snapshot_plugin.restoring import request

    made = []

    def counted():
        made.append(new_plugin_manager())
        return made[-1]

    monkeypatch.setattr(request, "new_plugin_manager", counted)

    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            pass

    class Extra:
        @hookimpl
        def tnt_snapshot_plugin_extra_state(self, event, epoch, step):
            return {"plugin_extra": Counter()}

    plain = saver(tmp_path / "plain", save_every_n_train_steps=1)
    extra = saver(tmp_path / "extra", save_every_n_train_steps=1)
    extra.register(Extra())
    drive(plain, 1)
    drive(extra, 1)
    target = {"model": torch.nn.Linear(2, 2)}
    restore(str(tmp_path / "plain" / "epoch_0_step_1"), target)
    assert made == []
    restore(str(tmp_path / "extra" / "epoch_0_step_1"), target, plugin_manager=extra.plugin_manager)
    assert made == []
    restore(str(tmp_path / "extra" / "epoch_0_step_1"), {**target, "plugin_extra": Counter()})
    assert made == []  # named by the app state: no plugin needed to claim it
    restore(str(tmp_path / "extra" / "epoch_0_step_1"), target)
    assert len(made) == 1 and isinstance(made[0], PluginManager)


@pytest.mark.frameworks
def test_each_new_manager_loads_the_entry_point_plugins_afresh():
    first, second = new_plugin_manager(), new_plugin_manager()
    assert isinstance(first, PluginManager) and first is not second
    assert sorted(adapters(first)) == sorted(adapters(second)) == ["lightning", "torchtnt"]

    class Extra:
        @hookimpl
        def tnt_snapshot_plugin_adapters(self):
            return None

    first.register(Extra())
    assert len(first.get_plugins()) == len(second.get_plugins()) + 1


def test_metrics_go_through_each_savers_own_manager_even_when_shared(tmp_path, pm):
    """Two savers given one manager: each reporter reports its own saver's snapshots only."""
    a = saver(tmp_path / "a", pm, save_every_n_train_steps=1)
    b = saver(tmp_path / "b", pm, save_every_n_train_steps=2)
    got: dict[str, list[int]] = {"a": [], "b": []}
    a.report_metrics(lambda metrics, step: got["a"].append(step))
    b.report_metrics(lambda metrics, step: got["b"].append(step))
    drive(a, 2)
    drive(b, 2)
    assert got == {"a": [1, 2], "b": [2]}
    a.report_metrics(None)
    b.report_metrics(None)
    assert pm.get_plugins() == set()


@pytest.mark.frameworks
def test_the_lightning_saver_registers_before_its_dirpath_is_resolved_and_keeps_plugins_to_itself(tmp_path):
    import pickle

    from lightning_toy import ToyModule, make_trainer, plain_loader

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    committed = []

    class Told:
        @hookimpl
        def tnt_snapshot_plugin_snapshot_committed(self, path):
            committed.append(os.path.basename(path))

    saver = TorchSnapshotSaver(every_n_epochs=1, async_snapshot=False)  # dirpath resolved at setup
    with pytest.raises(ConfigError, match="tnt_snapshot_plugin_snapshot_comitted"):

        class Typo:
            @hookimpl
            def tnt_snapshot_plugin_snapshot_comitted(self, path):
                pass

        saver.register(Typo())
    saver.register(Told())
    with pytest.raises(TypeError, match="or plugins"):
        pickle.dumps(saver)  # a registered plugin would not reach ddp_spawn's processes
    other = TorchSnapshotSaver(str(tmp_path / "other"), every_n_epochs=1, async_snapshot=False)
    make_trainer(tmp_path / "a", [saver]).fit(ToyModule(), plain_loader())
    make_trainer(tmp_path / "b", [other]).fit(ToyModule(), plain_loader())
    assert committed == visible_by_name(tmp_path / "a" / "checkpoints")
    assert len(committed) == 2 and visible_by_name(tmp_path / "other")


def test_each_manager_and_each_open_reads_the_installed_entry_points_itself(tmp_path):
    """No process-wide list: a distribution installed while the process runs is seen by the next
    plugin manager and the next open of its scheme; one describing an adapter whose framework is
    missing is blocked, as the built-in ones would be (its AdapterInfo is the one place that
    names the framework)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import importlib, pathlib, sys
        from tnt_snapshot_plugin.errors import ConfigError
        from tnt_snapshot_plugin.hooks import new_plugin_manager
        from tnt_snapshot_plugin.stores import open_store
        site = pathlib.Path({str(tmp_path)!r})
        sys.path.insert(0, str(site))
        before = new_plugin_manager()
        try:
            open_store("late://bucket/run")
        except ConfigError as exc:
            print("refused:", "'late'" in str(exc))
        (site / "late_plugin.py").write_text(
            "from tnt_snapshot_plugin import hookimpl\\n"
            "from tnt_snapshot_plugin.hooks import AdapterInfo\\n"
            "from tnt_snapshot_plugin.testing import MemoryStore\\n"
            "class Late:\\n"
            "    @hookimpl\\n"
            "    def tnt_snapshot_plugin_extra_state(self, event, epoch, step):\\n"
            "        return None\\n"
            "class Ghost:\\n"
            "    @hookimpl\\n"
            "    def tnt_snapshot_plugin_adapters(self):\\n"
            "        return AdapterInfo(name='ghost', framework='no_such_framework_here', saver='x:y')\\n"
            "late, ghost = Late(), Ghost()\\n"
            "def open_late(url, storage_options, timeout_s):\\n"
            "    return MemoryStore(url)\\n"
        )
        info = site / "late_plugin-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\\nName: late-plugin\\nVersion: 1.0\\n")
        (info / "entry_points.txt").write_text(
            "[tnt_snapshot_plugin]\\nlate = late_plugin:late\\nghost = late_plugin:ghost\\n"
            "[tnt_snapshot_plugin.stores]\\nlate = late_plugin:open_late\\n"
        )
        importlib.invalidate_caches()
        after = new_plugin_manager()
        print(before.get_plugin("late") is None, after.get_plugin("late") is not None)
        print(after.is_blocked("ghost"), after.get_plugin("ghost") is None)
        print(type(open_store("late://bucket/run")).__name__)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["refused: True", "True True", "True True", "MemoryStore"]
