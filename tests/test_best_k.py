"""Best-k retention: the core's ranking (pure, over listed records), and the torchtnt adapter's
``best_checkpoint_config`` with real ``train()`` runs and ``restore_from_best``.

(The Lightning adapter's ``monitor`` / ``save_top_k`` and ``ckpt_path="best"``:
tests/test_lightning_best.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from dir_listing import CommitRecorder, visible_by_name
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.utils.checkpoint import BestCheckpointConfig

from tnt_snapshot_plugin import ConfigError, NothingToRestoreWarning, policies
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.hooks import get_plugin_manager
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import retention
from toy import StatefulLoader, ToyUnit, make_data

# -- the core's ranking (pure) -----------------------------------------------------------------


def rec(step: int, value=None, *, seq=None, ours=True, metric="loss") -> retention.Listed:
    name = SnapshotName.of(0, step, None, (metric, value) if value is not None else None)
    return retention.Listed(name, seq=seq if seq is not None else step, ours=ours)


def kept(listed, keep_last_n=None, best=None, protect=()):
    doomed = {r.text for r in policies.to_delete(listed, keep_last_n, protect=protect, best=best)}
    return sorted(r.name.step for r in listed if r.text not in doomed)


def test_best_k_keeps_the_k_best_and_the_newest_nan_worst_ties_to_the_earlier_commit():
    listed = [rec(1, 0.5), rec(2, 0.1), rec(3, float("nan")), rec(4, 0.3), rec(5, 0.1), rec(6, 0.9)]
    # min: 0.1 (step 2, earlier than step 5's equal 0.1), 0.1 (step 5), then 0.3; NaN is worst
    assert [r.name.step for r in retention.ranked(listed, "loss", "min")] == [2, 5, 4, 1, 6, 3]
    assert [r.name.step for r in retention.ranked(listed, "loss", "max")] == [6, 1, 4, 2, 5, 3]
    assert kept(listed, best=policies.Best("loss", "min", 2)) == [2, 5, 6]  # 6: the newest
    assert kept(listed, best=policies.Best("loss", "max", 1)) == [6]
    assert kept(listed, best=policies.Best("loss", "min", 1)) == [2, 6]
    # with keep_last_n the newest n are kept too
    assert kept(listed, keep_last_n=3, best=policies.Best("loss", "min", 1)) == [2, 4, 5, 6]
    # k None: every snapshot carrying the metric
    assert kept(listed, best=policies.Best("loss", "min", None)) == [1, 2, 3, 4, 5, 6]
    assert retention.best(listed, "loss", "min").name.step == 2
    assert retention.best(listed, "acc", "min") is None


def test_best_k_never_deletes_what_is_not_ours_and_keeps_unranked_by_keep_last_n_only():
    listed = [
        rec(1, 0.5),
        rec(2, 0.9, ours=False, seq=None),  # torchtnt's or a user's: never deleted
        rec(3),  # no metric value
        rec(4, 0.7),
        rec(5, 0.1, metric="other"),  # another metric: unranked for "loss"
        rec(6, 0.8),
    ]
    best = policies.Best("loss", "min", 1)
    # without keep_last_n, snapshots without a value are never deleted (torchtnt keeps them)
    assert kept(listed, best=best) == [1, 2, 3, 5, 6]
    # with keep_last_n they are kept only among the newest n
    assert kept(listed, keep_last_n=1, best=best) == [1, 2, 6]
    assert kept(listed, keep_last_n=1, best=best, protect=["epoch_0_step_3"]) == [1, 2, 3, 6]


def test_the_index_metric_ranks_when_the_name_lacks_it():
    name = SnapshotName.of(0, 1)
    listed = [
        retention.from_index(name, {"format": 1, "seq": 1, "metric": {"name": "loss", "value": 0.2}}),
        retention.from_index(
            SnapshotName.of(0, 2, None, ("loss", 0.4)),
            {"format": 1, "seq": 2, "metric": {"name": "loss", "value": 0.4}},
        ),
        # a non-finite value is stored as null in the index; the name still says it
        retention.from_index(
            SnapshotName.of(0, 3, None, ("loss", float("-inf"))),
            {"format": 1, "seq": 3, "metric": {"name": "loss", "value": None}},
        ),
    ]
    assert [r.name.step for r in retention.ranked(listed, "loss", "min")] == [3, 1, 2]


# -- torchtnt: best_checkpoint_config ------------------------------------------------------------


class MetricUnit(ToyUnit):
    """Sets ``val_metric`` from a script before each step ends (read by the saver at save time)."""

    def __init__(self, values, attribute: str = "val_metric", seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.values = list(values)
        self.attribute = attribute
        self.reads = 0

    def train_step(self, state: State, data) -> None:
        super().train_step(state, data)
        step = self.train_progress.num_steps_completed  # steps completed before this one
        setattr(self, self.attribute, self.values[step])


def test_best_checkpoint_config_keeps_the_n_best_by_torchtnts_rules_and_restore_from_best(tmp_path):
    values = [0.9, 0.5, 0.7, torch.tensor(0.2, dtype=torch.float64), 0.5, float("nan"), 0.6, 0.1, 0.8, 0.3]
    unit = MetricUnit(values)
    pm = get_plugin_manager()
    recorder = CommitRecorder(tmp_path)
    pm.register(recorder)
    try:
        saver = TorchSnapshotSaver(
            str(tmp_path),
            save_every_n_train_steps=1,
            keep_last_n_checkpoints=2,
            best_checkpoint_config=BestCheckpointConfig("val_metric", "min"),
            async_checkpoint=False,
            save_on_train_end=False,
            plugin_manager=pm,
        )
        train(unit, StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver])
    finally:
        pm.unregister(recorder)

    # Every step's snapshot was written, named with the metric as torchtnt names it; after each
    # commit exactly the 2 best so far and the newest were on disk: a snapshot was deleted only
    # once a better or newer one was committed.
    committed = [name for name, _ in recorder.seen]
    assert committed == [
        SnapshotName.of(0, s + 1, None, ("val_metric", float(v))).text for s, v in enumerate(values)
    ]
    for i, (name, on_disk) in enumerate(recorder.seen):
        so_far = [(float(values[j]), j) for j in range(i + 1)]
        ranked = sorted(so_far, key=lambda vj: (math.isnan(vj[0]), vj[0] if not math.isnan(vj[0]) else 0, vj[1]))
        expected = {committed[j] for _, j in ranked[:2]} | {name}
        assert on_disk == sorted(expected), (i, on_disk)
    # the end: 0.1 (step 8) and 0.2 (step 4) are the best two; step 10 (0.3) is the newest
    assert visible_by_name(tmp_path) == sorted(
        ["epoch_0_step_8_val_metric=0.1", "epoch_0_step_4_val_metric=0.2", "epoch_0_step_10_val_metric=0.3"]
    )
    with open(tmp_path / "epoch_0_step_4_val_metric=0.2" / INDEX_FNAME) as f:
        assert json.load(f)["metric"] == {"name": "val_metric", "value": 0.2}

    fresh = MetricUnit(values, seed=3)
    assert TorchSnapshotSaver.restore_from_best(str(tmp_path), fresh, "val_metric", "min")
    assert fresh.train_progress.num_steps_completed == 8
    fresh = MetricUnit(values, seed=3)
    assert TorchSnapshotSaver.restore_from_best(str(tmp_path), fresh, "val_metric", "max")
    assert fresh.train_progress.num_steps_completed == 10
    with pytest.warns(NothingToRestoreWarning, match="carries the metric 'accuracy'"):
        assert not TorchSnapshotSaver.restore_from_best(str(tmp_path), fresh, "accuracy", "max")
    with pytest.raises(ConfigError, match="mode"):
        TorchSnapshotSaver.restore_from_best(str(tmp_path), fresh, "val_metric", "lowest")


def test_best_checkpoint_config_without_keep_last_n_keeps_all_and_none_saves_without_a_metric(tmp_path):
    values = [None, 2, torch.tensor([0.5]), 0.25]
    unit = MetricUnit(values)
    saver = TorchSnapshotSaver(
        str(tmp_path),
        save_every_n_train_steps=1,
        best_checkpoint_config=BestCheckpointConfig("val_metric", "max"),
    )
    train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])
    assert visible_by_name(tmp_path) == sorted(
        [
            "epoch_0_step_1",
            "epoch_0_step_2_val_metric=2.0",
            "epoch_0_step_3_val_metric=0.5",
            "epoch_0_step_4_val_metric=0.25",
            "epoch_1_step_4_val_metric=0.25",  # the final snapshot at train end
        ]
    )


@pytest.mark.parametrize(
    "value, attribute, match",
    [
        (0.5, "val_loss", r"no attribute 'val_loss'"),
        ("low", "val_metric", r"val_metric is 'low', not a number"),
        (torch.tensor([0.1, 0.2]), "val_metric", r"val_metric is tensor.*not a number"),
    ],
)
def test_a_missing_or_non_numeric_metric_is_a_config_error_at_the_first_save(tmp_path, value, attribute, match):
    unit = MetricUnit([value] * 8)
    saver = TorchSnapshotSaver(
        str(tmp_path),
        save_every_n_train_steps=2,
        best_checkpoint_config=BestCheckpointConfig(attribute, "min"),
    )
    with pytest.raises(ConfigError, match=match):
        train(unit, StatefulLoader(make_data(32)), max_epochs=1, callbacks=[saver])
    assert unit.train_progress.num_steps_completed == 2  # raised at the first snapshot
    assert visible_by_name(tmp_path) == []


def test_best_checkpoint_config_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="best_checkpoint_config.mode must be 'min' or 'max'"):
        TorchSnapshotSaver(str(tmp_path), best_checkpoint_config=BestCheckpointConfig("m", "lowest"))
    with pytest.raises(ConfigError, match="best_checkpoint_config.monitored_metric"):
        TorchSnapshotSaver(str(tmp_path), best_checkpoint_config=BestCheckpointConfig("val loss", "min"))
    with pytest.raises(ConfigError, match="must be a BestCheckpointConfig"):
        TorchSnapshotSaver(str(tmp_path), best_checkpoint_config="val_loss")
