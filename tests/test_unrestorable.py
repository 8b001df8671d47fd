"""A state that cannot be encoded stops training at the first snapshot with UnrestorableStateError.

Values pickle cannot encode (a namedtuple class defined inside a function, a lambda) fail every
snapshot the same way: it is the state's fault, not the storage's. Real torchtnt ``train()`` runs
on real disk show that the first snapshot raises UnrestorableStateError naming the entry and the
type, whatever ``on_save_error`` says, asynchronous or not, and that no SnapshotFailedWarning
is issued at the hooks after it.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
from typing import Any

import pytest
import torch
from torchtnt.framework.train import train

from tnt_snapshot_plugin import SnapshotFailedWarning, UnrestorableStateError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import Holder, StatefulLoader, ToyUnit, make_data, train_toy

STEPS = 10  # one epoch of 10 batches (make_data(40), batch size 4)
EVERY = 2


def local_config() -> Any:
    """A namedtuple whose class lives in this function: pickle cannot find it by name."""
    Config = collections.namedtuple("Config", "lr depth")
    return Config(0.1, 3)


def entries(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if not n.startswith(".tnt_snapshot"))


def run(tmp_path, extra: Any, **saver_kwargs: Any) -> tuple[ToyUnit, pytest.ExceptionInfo, list]:
    unit = ToyUnit()
    unit.extra = Holder(extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UnrestorableStateError) as info:
            train_toy(tmp_path, unit, 10, save_every_n_train_steps=EVERY, on_save_error="warn", **saver_kwargs)
    return unit, info, caught


@pytest.mark.parametrize("async_snapshot", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("weights_only", [True, False], ids=["weights_only", "full_pickle"])
def test_local_namedtuple_stops_training_at_the_first_snapshot(tmp_path, async_snapshot, weights_only):
    unit, info, caught = run(
        tmp_path,
        {"config": local_config(), "scale": torch.ones(3)},
        async_snapshot=async_snapshot,
        weights_only=weights_only,
    )
    message = str(info.value)
    assert "'extra/config'" in message, message  # the entry's path
    assert "test_unrestorable.Config" in message, message  # its type
    assert "epoch_0_step_2" in message  # the first snapshot failed, not a later one
    assert "on_save_error" in message
    # Training stopped: an asynchronous write is reaped at the next hooks, a synchronous one at once.
    done = unit.train_progress.num_steps_completed
    assert done == EVERY if not async_snapshot else EVERY <= done <= 2 * EVERY, done
    assert done < STEPS
    failed = [w for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert not failed, [str(w.message) for w in failed]
    # Nothing committed and nothing left behind
    assert entries(tmp_path) == []


def test_lambda_in_a_stateful_dict_is_named(tmp_path):
    unit, info, caught = run(tmp_path, {"hooks": [torch.zeros(2), lambda x: x + 1]}, weights_only=False)
    message = str(info.value)
    assert "'extra/hooks/1'" in message, message
    assert "builtins.function" in message, message
    assert unit.train_progress.num_steps_completed < STEPS
    assert not [w for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert entries(tmp_path) == []


@pytest.mark.parametrize("async_snapshot", [True, False], ids=["async", "sync"])
def test_a_lock_that_cannot_be_copied_nor_pickled_is_named(tmp_path, async_snapshot):
    """An asynchronous snapshot copies the state on the training thread (copy.deepcopy refuses
    a lock); a synchronous one pickles it (pickle refuses it): the same error either way."""
    unit, info, caught = run(
        tmp_path, {"guard": threading.Lock(), "scale": torch.ones(2)}, async_snapshot=async_snapshot
    )
    message = str(info.value)
    assert "'extra/guard'" in message, message
    assert "_thread.lock" in message, message
    assert unit.train_progress.num_steps_completed == EVERY  # stopped at the first snapshot
    assert not [w for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert entries(tmp_path) == []


def test_picklable_state_still_trains_to_the_end(tmp_path):
    """The control: the same run with a value pickle can encode commits every snapshot."""
    unit = ToyUnit()
    unit.extra = Holder({"config": {"lr": 0.1, "depth": 3}, "scale": torch.ones(3)})
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=EVERY, on_save_error="warn")
    train(unit, StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver])
    assert unit.train_progress.num_steps_completed == STEPS
    expected = {f"epoch_0_step_{s}" for s in range(EVERY, STEPS + 1, EVERY)} | {"epoch_1_step_10"}
    assert set(entries(tmp_path)) == expected
    for name in expected:
        assert (tmp_path / name / ".snapshot_metadata").is_file()


@pytest.mark.parametrize("async_snapshot", [True, False], ids=["async", "sync"])
def test_an_object_holding_a_meta_tensor_stops_training_before_anything_is_written(tmp_path, async_snapshot):
    """Restore refuses a payload holding a tensor on the meta device (it has no data): the saver
    refuses to write one, naming the entry, at the first snapshot."""
    unit, info, caught = run(
        tmp_path, {"shapes": (torch.empty(3, device="meta"), 2)}, async_snapshot=async_snapshot
    )
    assert "extra/shapes" in str(info.value) and "meta device" in str(info.value)
    assert unit.train_progress.num_steps_completed == EVERY
    assert entries(tmp_path) == []  # nothing committed, nothing left
    assert not [w for w in caught if issubclass(w.category, SnapshotFailedWarning)]
