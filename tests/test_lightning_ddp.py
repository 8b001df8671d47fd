"""The Lightning adapter under DDP: 2 CPU processes on gloo, started as torchrun would start them.

One launch runs, on each rank (see ``_ddp`` in tests/lightning_toy.py): an uninterrupted
reference fit; a fit that fails mid-epoch 2, with rank 1 naming another dirpath; and a fresh
Trainer with a freshly seeded module resuming with ``ckpt_path="last"``.
"""

from __future__ import annotations

import json

import pytest
from lightning_toy import logs, run_script, snapshot_names


@pytest.mark.slow
def test_ddp_two_processes_save_and_resume_bitwise(tmp_path):
    codes = run_script("ddp", tmp_path, ranks=2)
    assert codes == [0, 0], logs(tmp_path)
    results = [json.loads((tmp_path / f"result_rank{rank}.json").read_text()) for rank in (0, 1)]

    # rank 0's dirpath won: rank 1 wrote nowhere else, and each rank saved its own state
    assert [r["saver_dirpath"] for r in results] == [str(tmp_path / "snaps")] * 2
    assert not (tmp_path / "rank1_dirpath").exists()
    assert snapshot_names(tmp_path / "snaps") == [
        "epoch_0_step_3",
        "epoch_1_step_5",
        "epoch_1_step_6",  # the latest before the failure at step 8
        "epoch_1_step_9",  # written by the resumed run
        "epoch_2_step_10",
    ]
    assert sorted(p.name for p in (tmp_path / "snaps" / "epoch_1_step_6").iterdir() if p.is_dir()) == [
        "0",
        "1",
        "batched",
    ]

    for result in results:
        assert result["interrupted"] == "injected failure at step 8"
        assert result["resumed_from"] == str(tmp_path / "snaps" / "epoch_1_step_6")
        assert (result["global_step"], result["current_epoch"]) == (10, 2)
        # every rank drew its own dropout masks and numbers: equal only if each restored its own RNG
        assert result["resumed"] == result["reference"]
    assert results[0]["reference"] == results[1]["reference"]
