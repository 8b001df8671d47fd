"""Preemption under Lightning: SIGTERM, then a snapshot at the batch end, then the run stops.

Lightning installs its own SIGTERM handler when ``fit`` starts; the saver installs its handler
at ``on_train_start``, after Lightning's, so the signal reaches the saver first. The saver
snapshots at the next batch end (under DDP, at the step all ranks agree on), then raises
Lightning's ``SIGTERMException`` with exit status 128 + SIGTERM, which Lightning handles like its
own: ``on_exception`` hooks, teardown, exit.
"""

from __future__ import annotations

import json
import signal

import pytest
from lightning_toy import (
    ResumableLoader,
    ToyModule,
    assert_bitwise_equal,
    logs,
    make_trainer,
    optimizer_tensors,
    run_script,
    seed_everything,
    snapshot_names,
    weights,
)

from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data

EXIT_SIGTERM = 128 + signal.SIGTERM


@pytest.mark.slow
def test_sigterm_snapshots_at_the_batch_end_exits_and_resumes_bitwise(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # The script snapshots every 2 steps and sends itself SIGTERM during the 4th batch.
    assert run_script("preempt", out) == [EXIT_SIGTERM], logs(out)
    assert json.loads((out / "result_rank0.json").read_text()) == {"started": True}
    assert snapshot_names(out / "snaps") == ["epoch_0_step_2", "epoch_0_step_4"]
    assert "preemption signal received; snapshotting step 4" in logs(out)

    seed_everything(7)
    expected = ToyModule(seed=0)
    reference = make_trainer(tmp_path, [], enable_checkpointing=False)
    reference.fit(expected, ResumableLoader(make_data(40), seed=3))

    seed_everything(123)
    module = ToyModule(seed=9)
    trainer = make_trainer(tmp_path, [TorchSnapshotSaver(str(out / "snaps"), save_every_n_train_steps=2)])
    trainer.fit(module, ResumableLoader(make_data(40), seed=3), ckpt_path="last")
    assert trainer.ckpt_path == str(out / "snaps" / "epoch_0_step_4")
    assert_bitwise_equal(weights(module), weights(expected))
    assert_bitwise_equal(optimizer_tensors(trainer), optimizer_tensors(reference))


@pytest.mark.slow
def test_sigterm_on_one_ddp_rank_stops_both_at_the_same_step(tmp_path):
    # Rank 0 alone receives SIGTERM during the 4th batch; with steps of 0.3 s the ranks agree at
    # every step, and stop one step later (tests/test_distributed.py: every few steps).
    assert run_script("ddp-preempt", tmp_path, ranks=2) == [EXIT_SIGTERM, EXIT_SIGTERM], logs(tmp_path)
    assert snapshot_names(tmp_path / "snaps") == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_5"]
    assert sorted(p.name for p in (tmp_path / "snaps" / "epoch_0_step_5").iterdir() if p.is_dir()) == [
        "0",
        "1",
        "batched",
    ]
