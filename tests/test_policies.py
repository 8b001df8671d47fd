"""Save decisions and preservation policies: each alone, combined with any, and users' own in a
real Snapshotter and a real torchtnt ``train()``."""

from __future__ import annotations

import pytest
import torch
from dir_listing import snapshots_by_step

from tnt_snapshot_plugin import ConfigError, hookimpl
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.hooks import new_plugin_manager
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import (
    AnyPreservation,
    AnySave,
    Best,
    BestN,
    EveryNEpochs,
    EveryNEvalEpochs,
    EveryNSeconds,
    EveryNSteps,
    KeepEveryNSteps,
    KeepOnePerNHours,
    LatestN,
    Listed,
    Moment,
    PluginDecision,
)
from tnt_snapshot_plugin.saving.saver import Snapshotter


def listed(*steps, hours=None, metrics=None):
    """Our snapshots at ``steps``, committed in that order (seq 1, 2, ...)."""
    out = []
    for i, step in enumerate(steps):
        metric = ("loss", metrics[i]) if metrics else None
        out.append(Listed(
            SnapshotName.of(0, step, None, metric), seq=i + 1, ours=True,
            committed_at=None if hours is None else hours[i] * 3600.0,
        ))
    return out


# -- save decisions, each alone -------------------------------------------------------------------


def test_every_n_steps_decides_at_step_ends_only_and_tells_the_next_step():
    policy = EveryNSteps(3)
    assert [s for s in range(1, 10) if policy.should_save(Moment("step", 0, s))] == [3, 6, 9]
    assert not policy.should_save(Moment("epoch", 1, 3))
    assert [policy.next_step(last) for last in (0, 2, 3, 4)] == [3, 3, 6, 6]


def test_every_n_epochs_and_eval_epochs_decide_at_their_own_events():
    assert [e for e in range(1, 7) if EveryNEpochs(2).should_save(Moment("epoch", e, 10 * e))] == [2, 4, 6]
    assert not EveryNEpochs(1).should_save(Moment("step", 1, 4))
    assert EveryNEpochs(1).next_step(5) is None
    evals = [v for v in range(1, 7) if EveryNEvalEpochs(3).should_save(Moment("eval_epoch", 0, 1, eval_epoch=v))]
    assert evals == [3, 6]
    assert not EveryNEvalEpochs(1).should_save(Moment("epoch", 1, 1))


def test_every_n_seconds_reads_the_agreed_clock_at_step_ends():
    policy = EveryNSeconds(30)
    assert policy.should_save(Moment("step", 0, 5, time_due=True))
    assert not policy.should_save(Moment("step", 0, 5))
    assert not policy.should_save(Moment("epoch", 1, 5, time_due=True))
    assert policy.next_step(7) is None  # no step count: the saver reads its clock at every step end


def test_any_save_is_any_and_its_next_step_the_soonest():
    class Custom:  # a user's policy without next_step: asked at every step end
        def should_save(self, moment):
            return moment.step == 5

    combined = AnySave([EveryNSteps(4), Custom()])
    assert [s for s in range(1, 10) if combined.should_save(Moment("step", 0, s))] == [4, 5, 8]
    assert combined.next_step(1) == 2
    assert AnySave([EveryNSteps(4), EveryNSteps(6)]).next_step(4) == 6
    assert AnySave([EveryNEpochs(1)]).next_step(4) is None
    assert not AnySave([]).should_save(Moment("step", 0, 1))


def test_a_plugin_decision_overrides_the_policies_and_may_veto():
    pm = new_plugin_manager(load_entrypoints=False)
    decision = PluginDecision(pm)
    assert not decision.active

    class Veto:
        @hookimpl
        def tnt_snapshot_plugin_should_snapshot(self, step):
            return False if step == 4 else None

    pm.register(Veto())
    assert decision.active
    assert decision.decide(Moment("step", 0, 4), True) is False
    assert decision.decide(Moment("step", 0, 5), True) is True  # None: the policies' word stands


def test_bad_policies_are_refused_with_what_they_need():
    with pytest.raises(ConfigError, match="EveryNSteps.n must be a positive number, got 0"):
        EveryNSteps(0)
    with pytest.raises(ConfigError, match="needs a method should_save"):
        SnapshotConfig.build(save_policies=[object()])
    with pytest.raises(ConfigError, match="needs a method keep"):
        SnapshotConfig.build(preservation_policies=[EveryNSteps(2)])
    with pytest.raises(ConfigError, match="save_policies must be a list"):
        SnapshotConfig.build(save_policies=EveryNSteps(2))


# -- preservation, each alone ---------------------------------------------------------------------


def test_latest_n_keeps_the_last_n():
    assert LatestN(2).keep(listed(1, 2, 3, 4)) == {"epoch_0_step_3", "epoch_0_step_4"}
    assert LatestN(9).keep(listed(1, 2)) == {"epoch_0_step_1", "epoch_0_step_2"}


def test_best_n_keeps_the_best_and_optionally_those_without_the_metric():
    records = listed(1, 2, 3, metrics=[0.5, 0.1, 0.3]) + [
        Listed(SnapshotName.of(0, 4), seq=4, ours=True)
    ]
    assert BestN(Best("loss", "min", 2)).keep(records) == {"epoch_0_step_2_loss=0.1", "epoch_0_step_3_loss=0.3"}
    assert BestN(Best("loss", "max", 1), keep_unscored=True).keep(records) == {"epoch_0_step_1_loss=0.5", "epoch_0_step_4"}


def test_keep_every_n_steps_keeps_the_first_of_each_span():
    kept = KeepEveryNSteps(1000).keep(listed(500, 1000, 1500, 2000, 2500, 3100))
    assert kept == {"epoch_0_step_500", "epoch_0_step_1000", "epoch_0_step_2000", "epoch_0_step_3100"}


def test_keep_one_per_n_hours_keeps_the_oldest_then_one_each_interval_by_commit_time():
    records = listed(1, 2, 3, 4, 5, hours=[0.0, 2.0, 6.5, 7.0, 13.0])
    assert KeepOnePerNHours(6).keep(records) == {"epoch_0_step_1", "epoch_0_step_3", "epoch_0_step_5"}
    assert KeepOnePerNHours(6).keep(listed(1, 2)) == set()  # no commit times: not its to keep


def test_any_preservation_deletes_only_what_no_policy_keeps_and_never_the_newest_nor_others():
    records = listed(1000, 1500, 2000, 2500, 3000)
    foreign = Listed(SnapshotName.of(0, 3500))  # not ours, and the newest of the directory
    policy = AnyPreservation([LatestN(1), KeepEveryNSteps(1000)])
    doomed = [r.text for r in policy.to_delete(records + [foreign], protect=["epoch_0_step_2500"])]
    assert doomed == ["epoch_0_step_1500"]
    assert AnyPreservation([]).to_delete(records) == records[:-1]  # the newest is never deleted


# -- users' own policies in real runs -------------------------------------------------------------


def test_a_users_save_policy_combines_with_the_cadence_in_a_real_snapshotter(tmp_path, pm):
    class AtSteps:
        def __init__(self, *steps):
            self.steps = set(steps)

        def should_save(self, moment):
            return moment.event == "step" and moment.step in self.steps

    config = SnapshotConfig.build(
        save_every_n_train_steps=4, save_policies=[AtSteps(3, 7)], preemption_signals=[], save_on_train_end=False
    )
    snap = Snapshotter(str(tmp_path), config, plugin_manager=pm)
    state = {"model": torch.nn.Linear(2, 2)}
    snap.train_start(state.keys())
    for step in range(1, 9):
        snap.step_end(0, step, lambda intra: state)
    snap.train_end(0, 8, lambda intra: state)
    assert snapshots_by_step(tmp_path) == ["epoch_0_step_3", "epoch_0_step_4", "epoch_0_step_7", "epoch_0_step_8"]


@pytest.mark.frameworks
def test_keep_every_n_steps_beside_keep_last_n_in_a_real_train(tmp_path):
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from toy import StatefulLoader, ToyUnit, make_data

    saver = TorchSnapshotSaver(
        str(tmp_path), save_every_n_train_steps=2, keep_last_n_checkpoints=2,
        preservation_policies=[KeepEveryNSteps(6)], save_policies=[EveryNSteps(5)],
    )
    train(ToyUnit(), StatefulLoader(make_data(4 * 14)), max_epochs=1, callbacks=[saver])
    # snapshots at steps 2, 4, 5, 6, 8, 10, 12, 14 and the final one (epoch 1, step 14); spans of
    # 6 steps keep 2 (0-5), 6 (6-11) and 12 (12-17); keep_last_n the two step-14 ones
    assert snapshots_by_step(tmp_path) == [
        "epoch_0_step_2", "epoch_0_step_6", "epoch_0_step_12", "epoch_0_step_14", "epoch_1_step_14"
    ]


def test_retention_applies_its_own_policies_to_its_own_store_and_spares_its_protected_names(tmp_path, pm):
    """Retention owns what it needs (the preservation, the protected names, the store, the ranks):
    at train start it deletes what its policies let go of its directory, never a protected name,
    never the newest; without a policy it deletes nothing."""
    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.policies import from_settings
    from tnt_snapshot_plugin.policies.retaining import Retention
    from tnt_snapshot_plugin.stores import LocalStore

    config = SnapshotConfig.build(async_snapshot=False, preemption_signals=[], save_on_train_end=False)
    snap = Snapshotter(str(tmp_path), config, plugin_manager=pm)
    state = {"model": torch.nn.Linear(2, 2)}
    snap.train_start(state.keys())
    for step in range(1, 6):
        snap.save(0, step, state)
    snap.train_end(0, 5, lambda intra: state)
    assert snapshots_by_step(tmp_path) == [f"epoch_0_step_{s}" for s in range(1, 6)]

    store = LocalStore(str(tmp_path))
    keeping_all = Retention(store, Collectives(None), from_settings(None, None))
    assert not keeping_all.active
    keeping_all.at_start()
    assert len(snapshots_by_step(tmp_path)) == 5

    retention = Retention(store, Collectives(None), from_settings(2, None), protected={"epoch_0_step_2"})
    assert retention.active
    retention.at_start()
    assert snapshots_by_step(tmp_path) == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_5"]
    retention.protected.clear()  # the saver's set, shared: what it protects is read at each call
    retention.at_start()
    assert snapshots_by_step(tmp_path) == ["epoch_0_step_4", "epoch_0_step_5"]
