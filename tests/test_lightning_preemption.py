"""Preemption under Lightning: SIGTERM, then a snapshot at the batch end, then the run stops.

Lightning installs its own SIGTERM handler when ``fit`` starts; the saver installs its handler
at ``on_train_start``, after Lightning's, so the signal reaches the saver first. The saver
snapshots at the next batch end (under DDP, at the step all ranks agree on), then raises
Lightning's ``SIGTERMException`` with exit status 128 + SIGTERM, which Lightning handles like its
own: ``on_exception`` hooks, teardown, exit.
"""

from __future__ import annotations

import json
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch
from dir_listing import visible_by_name
from lightning_toy import (
    ResumableLoader,
    ToyModule,
    assert_bitwise_equal,
    logs,
    make_trainer,
    optimizer_tensors,
    run_script,
    seed_everything,
    weights,
)

from tnt_snapshot_plugin.adapters.lightning import SnapshotCheckpointIO, TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data

EXIT_SIGTERM = 128 + signal.SIGTERM


@pytest.mark.slow
def test_sigterm_snapshots_at_the_batch_end_exits_and_resumes_bitwise(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # The script snapshots every 2 steps and sends itself SIGTERM during the 4th batch.
    assert run_script("preempt", out) == [EXIT_SIGTERM], logs(out)
    assert json.loads((out / "result_rank0.json").read_text()) == {"started": True}
    assert visible_by_name(out / "snaps") == ["epoch_0_step_2", "epoch_0_step_4"]
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


@pytest.fixture(scope="module")
def ddp_preempted(tmp_path_factory) -> tuple[Path, list[int]]:
    """One 2-rank DDP run that rank 0 alone receives SIGTERM in: (its directory, exit codes)."""
    out = tmp_path_factory.mktemp("ddp_preempt")
    return out, run_script("ddp-preempt", out, ranks=2)


@pytest.mark.slow
def test_sigterm_on_one_ddp_rank_stops_both_at_the_same_step(ddp_preempted):
    # Rank 0 alone receives SIGTERM during the 4th batch; with steps of 0.3 s the ranks agree at
    # every step, and stop one step later (tests/test_distributed.py: every few steps).
    tmp_path, codes = ddp_preempted
    assert codes == [EXIT_SIGTERM, EXIT_SIGTERM], logs(tmp_path)
    assert visible_by_name(tmp_path / "snaps") == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_5"]
    assert sorted(p.name for p in (tmp_path / "snaps" / "epoch_0_step_5").iterdir() if p.is_dir()) == [
        ".tnt_snapshot_index",  # each rank's part of the index
        "0",
        "1",
        "batched",
    ]


@pytest.mark.slow
def test_last_on_one_process_skips_a_ddp_snapshot_damaged_on_rank_1(ddp_preempted, tmp_path):
    """The 2-rank run's snapshots resumed in one process with ``ckpt_path="last"``, the newest
    with a flipped byte in rank 1's copy of the model. On another world size rank 0 compares the
    ranks' copies; it verifies them as it reads: the newest is skipped as damaged (it was refused
    as per-rank values that differ, with no fallback) and the one before it loads. Its RNG states
    are per rank, so not restored; the IO reports none restored (it reported the process's own
    state, which the saver then set again on a mid-epoch resume)."""
    out, codes = ddp_preempted
    assert codes == [EXIT_SIGTERM, EXIT_SIGTERM], logs(out)
    snaps = tmp_path / "snaps"
    shutil.copytree(out / "snaps", snaps)
    newest, previous = snaps / "epoch_0_step_5", snaps / "epoch_0_step_4"
    (packed,) = newest.glob("batched/1-*")  # rank 1's small tensors (its copy of the weights)
    data = bytearray(packed.read_bytes())
    data[len(data) // 2] ^= 0x01
    packed.write_bytes(bytes(data))

    io = SnapshotCheckpointIO()
    io.fall_back_from = str(newest)  # as the saver sets it when ckpt_path="last" resolves to it
    rng_before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint = io.load_checkpoint(str(newest))
    messages = [str(w.message) for w in caught]
    assert [m for m in messages if m.startswith(f"skipping damaged snapshot {newest}") and "checksum" in m], messages
    assert [m for m in messages if f"snapshot {previous} was taken on 2 ranks" in m and "RNG" in m], messages
    assert checkpoint["global_step"] == 4
    restored = io.take_restored()
    assert restored is not None and restored.path == str(previous)
    assert restored.rng_state is None
    assert torch.equal(torch.get_rng_state(), rng_before)

    # A real fit resumes from it the same way (Lightning's ckpt_path keeps naming the snapshot
    # "last" resolved to), and trains on to the end.
    seed_everything(5)
    trainer = make_trainer(tmp_path, [TorchSnapshotSaver(str(snaps), save_every_n_train_steps=2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ToyModule(seed=9), ResumableLoader(make_data(40), seed=3), ckpt_path="last")
    messages = [str(w.message) for w in caught]
    assert [m for m in messages if m.startswith(f"skipping damaged snapshot {newest}")], messages
    assert [m for m in messages if f"snapshot {previous} was taken on 2 ranks" in m], messages
    assert trainer.global_step == 20
