"""The Lightning adapter under DDP: 2 CPU processes on gloo, started as torchrun would start them.

One launch runs, on each rank (see ``_ddp`` in tests/lightning_toy.py): an uninterrupted
reference fit; a fit that fails mid-epoch 2, with rank 1 naming another dirpath; and a fresh
Trainer with a freshly seeded module resuming with ``ckpt_path="last"``.
"""

from __future__ import annotations

import json

import pytest
from dir_listing import visible_by_name
from lightning_toy import logs, run_script


@pytest.mark.slow
def test_ddp_two_processes_save_and_resume_bitwise(tmp_path):
    codes = run_script("ddp", tmp_path, ranks=2)
    assert codes == [0, 0], logs(tmp_path)
    results = [json.loads((tmp_path / f"result_rank{rank}.json").read_text()) for rank in (0, 1)]

    # rank 0's dirpath won: rank 1 wrote nowhere else, and each rank saved its own state
    assert [r["saver_dirpath"] for r in results] == [str(tmp_path / "snaps")] * 2
    assert not (tmp_path / "rank1_dirpath").exists()
    assert visible_by_name(tmp_path / "snaps") == [
        "epoch_0_step_3",
        "epoch_1_step_5",
        "epoch_1_step_6",  # the latest before the failure at step 8
        "epoch_1_step_9",  # written by the resumed run
        "epoch_2_step_10",
    ]
    assert sorted(p.name for p in (tmp_path / "snaps" / "epoch_1_step_6").iterdir() if p.is_dir()) == [
        ".tnt_snapshot_index",  # each rank's part of the index
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


@pytest.mark.slow
def test_ddp_best_k_and_ckpt_path_best(tmp_path):
    """Best-k under DDP (2 gloo ranks), beside a ModelCheckpoint given the same arguments in the
    same Trainer; then a new Trainer resumes with ckpt_path="best"; then a saver without dirpath
    (see ``_ddp_best``)."""
    codes = run_script("ddp-best", tmp_path, ranks=2)
    assert codes == [0, 0], logs(tmp_path)
    results = [json.loads((tmp_path / f"result_rank{rank}.json").read_text()) for rank in (0, 1)]
    best = str(tmp_path / "snaps" / "epoch_2_step_6_val_loss=0.3")
    for result in results:
        # the best (0.3, the second epoch) and the newest; ModelCheckpoint keeps the best alone
        assert result["kept"] == [
            "epoch_2_step_6_val_loss=0.3",
            "epoch_4_step_12_val_loss=0.6",
        ]
        assert result["mc_kept"] == ["epoch=1-step=6.ckpt"]
        assert result["best_model_path"] == best  # on every rank, rank 0's directory
        assert result["mc_best_model_path"] == str(tmp_path / "mc" / "epoch=1-step=6.ckpt")
        assert result["best_model_score"] == result["mc_best_model_score"] == pytest.approx(0.3)
        # ckpt_path="best" resumed every rank from the best snapshot, not the newest
        assert result["resumed_from"] == best
        assert result["resumed_at"] == [2, 6]
        assert result["global_step"] == 15
        # the resumed run's epochs score 0.4, 0.6, 0.45 by epoch: 0.3 is still the best
        assert result["best_after_resume"] == best
        assert result["kept_after_resume"] == [
            "epoch_2_step_6_val_loss=0.3",
            "epoch_5_step_15_val_loss=0.45",
        ]
        # dirpath=None: <default_root_dir>/checkpoints, as ModelCheckpoint without a logger
        assert result["default_dirpath"] == str(tmp_path / "checkpoints")
        assert result["default_kept"] == ["epoch_1_step_3"]
