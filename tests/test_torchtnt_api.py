"""torchtnt 0.2.4's whole saver API through the adapter, with real train()/fit() runs.

Constructor arguments (async_checkpoint, knob_options, save_every_n_eval_epochs), the restore
signature (RestoreOptions, knob_options), hooks called without on_train_start, the WORLD_SIZE
check, and errors that tell a misfit, the user's own exception and damaged files apart.
(The DDP idiom, rank 1 passing "", runs in real gloo processes: tests/test_distributed.py.)
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch
from dir_listing import visible_by_name
from torchtnt.framework.callbacks.checkpointer_types import KnobOptions, RestoreOptions
from torchtnt.framework.fit import fit
from torchtnt.framework.state import EntryPoint, PhaseState, State
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    ConfigError,
    SnapshotCorruptError,
    SnapshotFallbackWarning,
    SnapshotsAheadWarning,
    StateMismatchError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.naming import SnapshotName
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights


def optimizer_state(unit: ToyUnit) -> dict:
    return {k: v.clone() for k, v in unit.optimizer.state_dict()["state"][0].items()}


# -- 1. constructor --------------------------------------------------------------------------


def test_async_checkpoint_is_async_snapshot_and_a_contradiction_is_refused(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), async_checkpoint=False, save_every_n_epochs=1)
    assert saver.snapshotter.config.async_snapshot is False
    assert TorchSnapshotSaver(str(tmp_path)).snapshotter.config.async_snapshot is True
    same = TorchSnapshotSaver(str(tmp_path), async_checkpoint=False, async_snapshot=False)
    assert same.snapshotter.config.async_snapshot is False
    with pytest.raises(ConfigError, match="async_snapshot.*async_checkpoint"):
        TorchSnapshotSaver(str(tmp_path), async_checkpoint=True, async_snapshot=False)

    # The synchronous saver writes each snapshot before the hook returns.
    seen = []
    run = tmp_path / "run"

    class Probe(TorchSnapshotSaver):
        def on_train_epoch_end(self, state, unit):
            super().on_train_epoch_end(state, unit)
            seen.append(visible_by_name(run))

    probe = Probe(str(run), async_checkpoint=False, save_every_n_epochs=1)
    train(ToyUnit(), StatefulLoader(make_data(8)), max_epochs=2, callbacks=[probe])
    assert seen == [["epoch_1_step_2"], ["epoch_1_step_2", "epoch_2_step_4"]]


class BigUnit(ToyUnit):
    """ToyUnit plus six 4 MiB tensors, each written to a file of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(6))


def _count_concurrent_writes(faulty) -> dict:
    """Count the payload writes in flight at once (FaultyStore hooks around each write)."""
    lock = threading.Lock()
    seen = {"active": 0, "peak": 0, "env": set()}

    def enter(name, rel):
        with lock:
            seen["active"] += 1
            seen["peak"] = max(seen["peak"], seen["active"])
            seen["env"].add(os.environ.get("TORCHSNAPSHOT_MAX_PER_RANK_IO_CONCURRENCY_OVERRIDE"))
        time.sleep(0.2)  # writes overlap whenever the concurrency allows it

    def leave(name, rel):
        with lock:
            seen["active"] -= 1

    faulty.hook("write_payload", before=enter, after=leave)
    return seen


@pytest.mark.parametrize("limit", [1, 6])
def test_knob_options_max_per_rank_io_concurrency_limits_the_writes_in_flight(tmp_path, faulty_local, limit):
    faulty, dirpath = faulty_local(tmp_path)
    seen = _count_concurrent_writes(faulty)
    saver = TorchSnapshotSaver(
        dirpath,
        save_every_n_epochs=1,
        knob_options=KnobOptions(max_per_rank_io_concurrency=limit, enable_storage_optimization=True),
    )
    unit = BigUnit()
    train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
    if limit == 1:
        assert seen["peak"] == 1
    else:
        assert 4 < seen["peak"] <= limit  # more than the plugin's 4 default I/O threads
    # Scoped to the writer's thread: torchsnapshot's process-wide environment knob is untouched.
    assert seen["env"] == {None}

    fresh = BigUnit()
    TorchSnapshotSaver.restore(
        str(tmp_path / "epoch_1_step_2"), fresh, knob_options=KnobOptions(max_per_rank_io_concurrency=1)
    )
    assert_bitwise_equal(weights(fresh), weights(unit))
    assert torch.equal(fresh.big[5].weight, unit.big[5].weight)


@pytest.mark.parametrize("limit", [1, None])
def test_knob_options_max_per_rank_io_concurrency_limits_the_files_a_restore_reads_at_once(tmp_path, monkeypatch, limit):
    unit = BigUnit()
    train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[TorchSnapshotSaver(str(tmp_path))])
    lock = threading.Lock()
    seen = {"active": 0, "peak": 0}
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        with lock:
            seen["active"] += 1
            seen["peak"] = max(seen["peak"], seen["active"])
        try:
            time.sleep(0.05)  # reads overlap whenever the concurrency allows it
            return real_preadv(fd, buffers, offset)
        finally:
            with lock:
                seen["active"] -= 1

    monkeypatch.setattr(os, "preadv", counting_preadv)
    fresh = BigUnit()
    knobs = None if limit is None else KnobOptions(max_per_rank_io_concurrency=limit)
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_1_step_2"), fresh, knob_options=knobs)
    assert_bitwise_equal(weights(fresh), weights(unit))
    # six 4 MiB files: one at a time, or (default) a few at once
    assert seen["peak"] == 1 if limit == 1 else seen["peak"] > 1


def test_knob_options_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="max_per_rank_io_concurrency"):
        TorchSnapshotSaver(str(tmp_path), knob_options=KnobOptions(max_per_rank_io_concurrency=0))
    with pytest.raises(ConfigError, match="KnobOptions"):
        TorchSnapshotSaver(str(tmp_path), knob_options={"max_per_rank_io_concurrency": 2})


def test_save_every_n_eval_epochs_under_fit_names_and_orders_after_the_train_snapshot(tmp_path):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1, save_every_n_eval_epochs=1)
    fit(
        unit,
        StatefulLoader(make_data(12)),
        StatefulLoader(make_data(8, seed=1)),
        max_epochs=2,
        evaluate_every_n_epochs=1,
        callbacks=[saver],
    )
    # 3 train steps and 2 eval steps per epoch; the eval runs after the epoch-end snapshot.
    names = visible_by_name(tmp_path)
    assert set(names) == {"epoch_1_step_3", "epoch_1_step_3_eval_2", "epoch_2_step_6", "epoch_2_step_6_eval_4"}
    assert [n.text for n in sorted(SnapshotName.parse(n) for n in names)] == [
        "epoch_1_step_3",
        "epoch_1_step_3_eval_2",
        "epoch_2_step_6",
        "epoch_2_step_6_eval_4",
    ]

    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    assert fresh.eval_progress.num_epochs_completed == 2
    assert fresh.eval_progress.num_steps_completed == 4
    assert fresh.train_progress.num_steps_completed == 6
    assert_bitwise_equal(weights(fresh), weights(unit))


def test_eval_snapshot_mid_epoch_never_collides_with_the_train_snapshot_of_its_step(tmp_path):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(
        str(tmp_path), save_every_n_train_steps=2, save_every_n_eval_epochs=1, save_on_train_end=False
    )
    fit(
        unit,
        StatefulLoader(make_data(16)),
        StatefulLoader(make_data(4, seed=1)),
        max_epochs=1,
        evaluate_every_n_steps=2,
        evaluate_every_n_epochs=None,
        callbacks=[saver],
    )
    names = sorted(SnapshotName.parse(n) for n in visible_by_name(tmp_path))
    assert [n.text for n in names] == [
        "epoch_0_step_2",
        "epoch_0_step_2_eval_1",
        "epoch_0_step_4",
        "epoch_0_step_4_eval_2",
    ]
    # A snapshot torchtnt wrote at the same step is read and ordered with them.
    assert SnapshotName.parse("epoch_0_train_step_2_eval_step_1").eval_step == 1
    assert SnapshotName.parse("epoch_0_step_2") < SnapshotName.parse("epoch_0_step_2_eval_0")


# -- 2. restore signature ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A snapshot after 2 epochs of 3 steps, and the unit as it was then."""
    dirpath = tmp_path_factory.mktemp("trained")
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(dirpath), save_every_n_epochs=2)
    train(unit, StatefulLoader(make_data(12)), max_epochs=2, callbacks=[saver])
    return str(dirpath / "epoch_2_step_6"), unit


def _used_unit() -> ToyUnit:
    """A different unit that has taken a step of its own (it has optimizer state)."""
    unit = ToyUnit(seed=9)
    train(unit, StatefulLoader(make_data(4, seed=3)), max_epochs=1)
    return unit


def test_restore_options_leave_unrestored_entries_as_the_unit_had_them(trained):
    path, saved = trained
    unit = _used_unit()
    before_optim = optimizer_state(unit)
    before_lr = unit.lr_scheduler.state_dict()
    TorchSnapshotSaver.restore(
        path,
        unit,
        restore_options=RestoreOptions(
            restore_train_progress=False, restore_optimizers=False, restore_lr_schedulers=False
        ),
    )
    assert_bitwise_equal(weights(unit), weights(saved))
    after = optimizer_state(unit)
    assert after.keys() == before_optim.keys()
    for key in after:
        assert torch.equal(after[key], before_optim[key]), key
    assert unit.lr_scheduler.state_dict() == before_lr
    assert unit.train_progress.num_steps_completed == 1  # its own, not the snapshot's 6

    # The same, restoring everything: the snapshot's values.
    TorchSnapshotSaver.restore_from_latest(
        os.path.dirname(path), unit, restore_options=RestoreOptions(), knob_options=KnobOptions()
    )
    assert unit.train_progress.num_steps_completed == 6
    assert_bitwise_equal(optimizer_state(unit), optimizer_state(saved))


def test_restore_keyword_arguments_keep_working_and_contradictions_are_refused(trained):
    path, saved = trained
    unit = _used_unit()
    TorchSnapshotSaver.restore(path, unit, restore_train_progress=False, restore_optimizers=False)
    assert unit.train_progress.num_steps_completed == 1
    assert_bitwise_equal(weights(unit), weights(saved))
    # The same value twice is no contradiction.
    TorchSnapshotSaver.restore(path, unit, strict=True, restore_options=RestoreOptions(strict=True))
    with pytest.raises(ConfigError, match="strict=True contradicts restore_options.strict=False"):
        TorchSnapshotSaver.restore(path, unit, strict=True, restore_options=RestoreOptions(strict=False))
    with pytest.raises(ConfigError, match="restore_optimizers"):
        TorchSnapshotSaver.restore_from_latest(
            os.path.dirname(path),
            unit,
            restore_optimizers=True,
            restore_options=RestoreOptions(restore_optimizers=False),
        )
    with pytest.raises(ConfigError, match="RestoreOptions"):
        TorchSnapshotSaver.restore(path, unit, restore_options={"strict": False})


# -- 3. hooks called directly ----------------------------------------------------------------


def test_hooks_called_without_on_train_start(tmp_path):
    unit = ToyUnit()
    loader = StatefulLoader(make_data(8))
    state = State(entry_point=EntryPoint.TRAIN, train_state=PhaseState(dataloader=loader, max_epochs=1))
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, save_every_n_epochs=1)
    for _ in range(2):
        unit.train_progress.increment_step()
        saver.on_train_step_end(state, unit)
    unit.train_progress.increment_epoch()
    saver.on_train_epoch_end(state, unit)
    saver.on_train_end(state, unit)
    assert visible_by_name(tmp_path) == ["epoch_0_step_2", "epoch_1_step_2"]

    # A hook for another unit (a new run, again without on_train_start) saves that unit's state.
    other = ToyUnit(seed=4)
    for _ in range(4):
        other.train_progress.increment_step()
    # (its progress, epoch 0 step 4, is behind the first run's epoch_1_step_2: warned once)
    with pytest.warns(SnapshotsAheadWarning, match="ahead of this run's progress"):
        saver.on_train_step_end(state, other)
    saver.on_train_end(state, other)
    fresh = ToyUnit(seed=7)
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_0_step_4"), fresh)
    assert_bitwise_equal(weights(fresh), weights(other))


# -- 4. the WORLD_SIZE check (the DDP idiom itself: tests/test_distributed.py) ---------------------


def test_world_size_without_a_process_group_is_a_clear_error(tmp_path, monkeypatch, trained):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="init_process_group.*before constructing the saver"):
        TorchSnapshotSaver(str(tmp_path))
    with pytest.raises(ConfigError, match="init_process_group.*before restoring"):
        TorchSnapshotSaver.restore(trained[0], ToyUnit())
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        TorchSnapshotSaver.restore_from_latest(str(tmp_path), ToyUnit())
    monkeypatch.setenv("WORLD_SIZE", "1")
    TorchSnapshotSaver(str(tmp_path))


# -- 5. errors that tell the truth -------------------------------------------------------------


@pytest.fixture(scope="module")
def two_snapshots(tmp_path_factory):
    dirpath = tmp_path_factory.mktemp("two")
    unit = ToyUnit()
    unit.extra = Exploding()
    saver = TorchSnapshotSaver(str(dirpath), save_every_n_epochs=1)
    train(unit, StatefulLoader(make_data(8)), max_epochs=2, callbacks=[saver])
    assert visible_by_name(dirpath) == ["epoch_1_step_2", "epoch_2_step_4"]
    return str(dirpath)


class UsersOwnError(Exception):
    pass


class Exploding:
    """A stateful whose load_state_dict raises when told to."""

    def __init__(self, explode: bool = False) -> None:
        self.explode = explode
        self.value = 1

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if self.explode:
            raise UsersOwnError("the user's own load_state_dict failed")
        self.value = state["value"]


def _no_fallback(record) -> None:
    assert not [w for w in record if "skipping damaged snapshot" in str(w.message)]


def test_a_unit_that_does_not_fit_raises_state_mismatch_without_fallback(two_snapshots):
    unit = ToyUnit()
    unit.extra = Exploding()
    unit.model[0] = torch.nn.Linear(4, 8)  # shapes differ: found before anything is loaded
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(StateMismatchError, match="shape"):
            TorchSnapshotSaver.restore_from_latest(two_snapshots, unit)
    _no_fallback(record)

    # A misfit found only by torch's own loader (the optimizer has another param group layout).
    unit = ToyUnit()
    unit.extra = Exploding()
    unit.optimizer = torch.optim.Adam(
        [{"params": unit.model[0].parameters()}, {"params": unit.model[3].parameters()}], lr=0.01
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(StateMismatchError, match="does not fit optimizer") as info:
            TorchSnapshotSaver.restore_from_latest(two_snapshots, unit)
    assert isinstance(info.value.__cause__, ValueError)
    assert "epoch_2_step_4" in str(info.value)
    _no_fallback(record)


def test_the_users_own_load_state_dict_error_propagates_as_it_is(two_snapshots):
    unit = ToyUnit()
    unit.extra = Exploding(explode=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(UsersOwnError, match="the user's own load_state_dict failed") as info:
            TorchSnapshotSaver.restore_from_latest(two_snapshots, unit)
    assert not isinstance(info.value, SnapshotCorruptError)
    _no_fallback(record)
    with pytest.raises(UsersOwnError):
        TorchSnapshotSaver.restore(os.path.join(two_snapshots, "epoch_1_step_2"), unit)


def test_only_damaged_bytes_count_as_corruption(tmp_path):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)
    train(unit, StatefulLoader(make_data(8)), max_epochs=2, callbacks=[saver])
    # Damage a pickled object of the newest snapshot without changing its size: the size index
    # cannot tell, only decoding it can.
    victim = tmp_path / "epoch_2_step_4" / "0" / "optimizer" / "param_groups" / "0" / "betas"
    victim.write_bytes(b"\xff" * victim.stat().st_size)
    fresh = ToyUnit(seed=3)
    with pytest.warns(SnapshotFallbackWarning, match="skipping damaged snapshot .*epoch_2_step_4"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    assert fresh.train_progress.num_steps_completed == 2


def test_the_rng_a_restore_hands_over_belongs_to_the_unit_restored(tmp_path):
    """A restore leaves the RNG state it set on the unit it restored, for the saver of that unit's
    next run: a saver training another unit meanwhile does not take it, nor does the module
    keep it; the restored unit's own run takes it (mid-epoch: set again after its first batch)."""
    from tnt_snapshot_plugin.adapters.torchtnt import restore as restore_module

    train(ToyUnit(), StatefulLoader(make_data(16)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(str(tmp_path / "a"), save_every_n_train_steps=2, save_on_train_end=False)])
    assert visible_by_name(tmp_path / "a") == ["epoch_0_step_2", "epoch_0_step_4"]
    restored = ToyUnit(seed=3)
    TorchSnapshotSaver.restore(str(tmp_path / "a" / "epoch_0_step_2"), restored)
    handed = vars(restored)[restore_module.RESTORED_RNG_ATTR]
    assert torch.equal(handed["rng_state"], torch.get_rng_state())
    assert not [name for name, value in vars(restore_module).items() if isinstance(value, (dict, set))
                and not name.startswith("__")]  # nothing kept by the module

    other = ToyUnit(seed=4)
    train(other, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[TorchSnapshotSaver(str(tmp_path / "b"))])
    assert vars(restored)[restore_module.RESTORED_RNG_ATTR] is handed  # not another unit's to take

    saver = TorchSnapshotSaver(str(tmp_path / "c"), save_on_train_end=False)
    train(restored, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])
    assert restore_module.RESTORED_RNG_ATTR not in vars(restored)  # taken by its own run, once
    assert restored.train_progress.num_steps_completed == 2 + 4  # resumed at 2; a fresh loader of 4 batches
    assert "rng" not in "".join(restored.app_state())  # never tracked as the unit's state
