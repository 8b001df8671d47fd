"""FSDP1 (sharded and full state dicts), FSDP2 and world-size changes, with real gloo processes.

tests/fsdp_worker.py trains each wrapping with the torchtnt adapter's saver in one 2-process
group (``save``), then restores the snapshots in new processes: 2 of them (``restore``), 1
(``world1``) and 3 (``world3``). Each launch covers every wrapping; the tests assert on what each
rank recorded. The whole state (parameters and Adam's exp_avg, exp_avg_sq and step) is compared
gathered whole, so it means the same on any world size.

tests/hybrid_mesh_worker.py saves DTensors laid out on a 2 x 2 mesh (sharded over one dimension,
replicated over the other) on 4 processes, and restores them on 4, 2 and 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import launching
import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")
HYBRID_WORKER = Path(__file__).with_name("hybrid_mesh_worker.py")
WRAPPINGS = ("fsdp1_sharded", "fsdp1_full", "fsdp2", "ddp")

pytestmark = pytest.mark.slow


def launch(phase: str, world_size: int, out: Path, worker: Path = WORKER) -> list[dict[str, Any]]:
    """Run ``phase`` of ``worker`` on ``world_size`` new processes; every rank's record, or a
    test failure."""
    return launching.run_phase(worker, phase, world_size, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp")
    runs = {"save": launch("save", 2, out)}
    for phase, world_size in (("restore", 2), ("world1", 1), ("world3", 3)):
        runs[phase] = launch(phase, world_size, out)
    return runs


def test_fsdp_saves_during_train_with_sharded_entries(runs):
    """Every wrapping snapshots at steps 2 and 4 during a real train(); FSDP1's sharded state
    dict is stored as ShardedTensor entries and FSDP2's as DTensor entries (not gathered)."""
    for record in runs["save"]:
        for wrapping in WRAPPINGS:
            assert record[wrapping]["committed"] == ["epoch_0_step_2", "epoch_0_step_4"], wrapping
            # a busy wait (SnapshotBusyWarning) depends on the machine's speed, not on FSDP
            failed = [w for w in record[wrapping]["warnings"] if "snapshot" in w and "still being written" not in w]
            assert not failed, wrapping
    rank0 = runs["save"][0]
    assert "ShardedTensorEntry" in rank0["fsdp1_sharded"]["entry_types"]
    assert "DTensorEntry" in rank0["fsdp2"]["entry_types"]
    assert not {"ShardedTensorEntry", "DTensorEntry"} & set(rank0["fsdp1_full"]["entry_types"])


def test_snapshot_index_records_world_size(runs):
    assert runs["save"][0]["index_world_size"] == 2


def test_staging_copies_local_shards(runs):
    """The asynchronous snapshot's staged copy of a ShardedTensor / DTensor state keeps its type
    and the values at staging time, whatever training does to the parameters afterwards."""
    expected_types = {"fsdp1_sharded": ["ShardedTensor"], "fsdp2": ["DTensor"], "fsdp1_full": ["Tensor"]}
    for record in runs["save"]:
        for wrapping, types in expected_types.items():
            staging = record[wrapping]["staging"]
            assert staging == {"types": types, "staged_kept_values": True, "originals_changed": True}


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_restore_in_new_processes_is_bitwise(runs, wrapping):
    """Parameters and optimizer state (Adam's exp_avg, exp_avg_sq, step) restored into freshly
    built models and optimizers equal the state saved at step 4, on each rank."""
    for saved, restored in zip(runs["save"], runs["restore"], strict=True):
        result = restored[wrapping]
        assert result["restored"] is True and result["steps"] == 4
        expected = saved[wrapping]["at_step_4"]
        assert {k.rsplit("/", 1)[-1] for k in expected if k.startswith("optim/")} == {"exp_avg", "exp_avg_sq", "step"}
        assert result["state"] == expected


def test_a_torchtitan_checkpoint_restores_into_an_fsdp2_unit_on_2_ranks(runs):
    """torchtitan's checkpoints hold whole tensors by name; an FSDP2 unit's parameters are
    DTensors sharded over the ranks: each rank takes its shard, the optimizer state too."""
    for restored in runs["restore"]:
        got = restored["titan_fsdp2"]
        assert got["steps"] == 3
        assert got["state"] == got["expected"]


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_next_step_matches_uninterrupted_run(runs, wrapping):
    for saved, restored in zip(runs["save"], runs["restore"], strict=True):
        assert restored[wrapping]["final"] == saved[wrapping]["final"]


@pytest.mark.parametrize("phase", ["world1", "world3"])
@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_restore_on_another_world_size_is_exact(runs, phase, wrapping):
    """Saved on 2 ranks, restored on 1 or 3: sharded entries are resharded, and entries saved per
    rank with equal values (a full state dict, DDP's optimizer state, the progress) map exactly.
    (FSDP1's full state dict restored on 1 rank once gave exp_avg of half a parameter.)"""
    expected = runs["save"][0][wrapping]["at_step_4"]
    for record in runs[phase]:
        result = record[wrapping]
        assert result["restored"] is True and result["steps"] == 4
        assert result["state"] == expected
        # The RNG states were per rank (seeded per rank): not restored, and said so.
        assert [w for w in result["warnings"] if "RNG states are per rank" in w]


@pytest.mark.parametrize(("phase", "world_size"), [("world1", 1), ("world3", 3)])
def test_per_rank_state_on_another_world_size_raises_state_mismatch(runs, phase, world_size):
    """An entry saved per rank with different values cannot map: every rank raises the same
    StateMismatchError naming both world sizes and the entries, and nothing hangs."""
    messages = set()
    for record in runs[phase]:
        result = record["ddp_per_rank"]
        assert result["error"] == "StateMismatchError"
        messages.add(result["message"])
    (message,) = messages
    ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
    assert f"on {ranks}: it was taken on 2 ranks" in message
    assert "tally/note, tally/rank" in message


@pytest.mark.parametrize("phase", ["world1", "world3"])
def test_a_damaged_copy_on_another_world_size_falls_back_on_every_rank(runs, phase):
    """The ``ddp`` snapshots with a flipped byte in rank 1's files of the newest, restored on 1
    or 3 ranks: the copies compared across the saved ranks are verified as they are read, so the
    newest is damage (every rank skips it, with a warning naming the checksum), not per-rank
    values that differ (StateMismatchError, no fallback), and every rank restores step 2."""
    for record in runs[phase]:
        result = record["ddp_damaged"]
        assert "error" not in result, result.get("message")
        assert result["restored"] is True and result["steps"] == 2
        skipped = [w for w in result["warnings"] if w.startswith("skipping damaged snapshot")]
        assert len(skipped) == 1 and "epoch_0_step_4" in skipped[0] and "checksum" in skipped[0], skipped


# --- a hybrid mesh: sharded over one mesh dimension, replicated over the other ------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hybrid")
    runs = {"hybrid_save": launch("hybrid_save", 4, out, HYBRID_WORKER)}
    for phase, world_size in (("hybrid_restore", 4), ("hybrid_world2", 2), ("hybrid_world1", 1)):
        runs[phase] = launch(phase, world_size, out, HYBRID_WORKER)
    return runs


def test_a_shard_held_by_a_replica_group_is_written_once_and_every_rank_records_it(hybrid):
    """On a 2 x 2 mesh with (Replicate(), Shard(0)), ranks 0 and 2 hold rows 0-3 of ``w`` and
    ranks 1 and 3 rows 4-7: each shard is written by one rank of its group, and the records of
    both ranks point at that one file. The fully replicated ``n`` is written once, under 0/."""
    assert [r["local_rows"]["w"] for r in hybrid["hybrid_save"]] == [[4, 3]] * 4
    assert [r["local_rows"]["b"] for r in hybrid["hybrid_save"]] == [[3], [2], [3], [2]]  # uneven rows
    rank0 = hybrid["hybrid_save"][0]
    locations = rank0["locations"]
    for key in ("w", "b"):
        per_rank = [locations[f"{rank}/model/{key}"] for rank in range(4)]
        assert per_rank[0] == per_rank[2] and per_rank[1] == per_rank[3] and per_rank[0] != per_rank[1], key
        files = {location for shards in per_rank for location in shards}
        assert len(files) == 2 and files <= set(rank0["files"]), key
    assert [path for path in locations if path.endswith("/model/n")] == ["0/model/n"]
    assert not [f for f in rank0["files"] if f.endswith(".tmp")]


@pytest.mark.parametrize("phase", ["hybrid_restore", "hybrid_world2", "hybrid_world1"])
def test_a_hybrid_mesh_snapshot_restores_exactly_on_the_same_mesh_and_resharded(hybrid, phase):
    """The step-2 snapshot (taken asynchronously) restores into zeros on the same 2 x 2 mesh, on
    2 ranks sharded over a 1-D mesh, and into plain tensors in one process: every local value
    equals step 2's (which differs from step 1's everywhere)."""
    for record in hybrid[phase]:
        assert record["restored"].endswith("epoch_0_step_2")
        assert record["equal"] == {"w": True, "b": True, "n": True}, record
        assert all(record["wrong_before"].values())
        assert record["types"] == (["Tensor"] if phase == "hybrid_world1" else ["DTensor"])


def test_the_cli_diffs_sharded_values_whole_once_each(hybrid):
    """``tnt-snapshot diff`` reads a DTensor whole (every rank's shards) and reports it once, with
    how far apart the two steps' values are; a snapshot against itself has no differences."""
    from click.testing import CliRunner
    from hybrid_mesh_worker import full_state

    from tnt_snapshot_plugin.cli import cli

    newest = Path(hybrid["hybrid_restore"][0]["restored"])
    older = newest.with_name("epoch_0_step_1")
    result = CliRunner().invoke(cli, ["diff", str(older), str(newest), "--json"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    before, after = full_state(1), full_state(2)
    want = {
        f"0/model/{key}": f"max |a-b| = {(before[key].double() - after[key].double()).abs().max().item():.6g}"
        for key in ("b", "n", "w")
    }
    assert {d["path"]: d["detail"] for d in report["differences"]} == want
    assert all(d["change"] == "changed" for d in report["differences"])
    result = CliRunner().invoke(cli, ["diff", str(newest), str(newest), "--json"], catch_exceptions=False)
    assert result.exit_code == 0 and json.loads(result.output)["identical"] is True
