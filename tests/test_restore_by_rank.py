"""Restore on the world size a snapshot was taken on: each rank reads rank 0's records and its own
from ``.snapshot_metadata`` (the groups the index locates under ``"ranks"``), not every rank's;
a target that needs other ranks' shards makes that rank read their groups too. Real FSDP2 on 4
gloo processes (tests/by_rank_worker.py); every restore must equal the saved state bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import launching
import pytest

WORKER = Path(__file__).with_name("by_rank_worker.py")
WORLD = 4

pytestmark = pytest.mark.slow


def launch(phase: str, out: Path, world: int = WORLD) -> list[dict[str, Any]]:
    return launching.run_phase(WORKER, phase, world, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("by_rank")
    saved = launch("save", out)
    snapshot = out / "snapshots" / "epoch_0_step_4"
    index = json.loads((snapshot / ".tnt_snapshot_index.json").read_text())
    return {
        "out": out,
        "save": saved,
        "restore": launch("restore", out),
        "world2": launch("world2", out, world=2),
        "regions": [r[:2] for r in index["ranks"]["regions"]],
        "metadata_size": (snapshot / ".snapshot_metadata").stat().st_size,
        "metadata": (snapshot / ".snapshot_metadata").read_bytes(),
    }


def own_groups(regions: list[list[int]], rank: int) -> list[list[int]]:
    """The groups a rank reads: rank 0's, then its own."""
    return [regions[0]] if rank == 0 else [regions[0], regions[rank]]


def test_the_index_locates_every_rank_s_group(runs):
    regions = runs["regions"]
    assert len(regions) == WORLD
    assert all(start < end for start, end in regions)
    assert all(a[1] <= b[0] for a, b in zip(regions, regions[1:], strict=False))  # consecutive, not overlapping
    # each rank writes its mesh once, in its own group, and names it after (format/mesh_aliases.py)
    data = runs["metadata"]
    for rank in range(WORLD):
        start, end = regions[rank]
        group = data[start:end]
        assert group.count(f'"mesh": &m{rank}_0 [0, 1, 2, 3]'.encode()) == 1
        assert group.count(f'"mesh": *m{rank}_0'.encode()) >= 3


def test_an_explicit_restore_reads_only_rank_0_s_and_its_own_records_and_is_bitwise(runs):
    for saved, restored in zip(runs["save"], runs["restore"], strict=True):
        rank = restored["rank"]
        assert restored["explicit_reads"] == own_groups(runs["regions"], rank)
        assert restored["explicit_state"] == saved["at_step_4"]


def test_restore_from_latest_streams_the_metadata_checksum_on_rank_0_and_parses_groups_only(runs):
    """Rank 0 checks the snapshot it picks (verify.check: the metadata against its checksum,
    streamed, not parsed); then every rank reads rank 0's group and its own."""
    for saved, restored in zip(runs["save"], runs["restore"], strict=True):
        rank = restored["rank"]
        streamed = [[0, runs["metadata_size"]]] if rank == 0 else []
        assert restored["latest_reads"] == streamed + own_groups(runs["regions"], rank)
        assert restored["latest_state"] == saved["at_step_4"]


def test_a_whole_tensor_target_makes_the_rank_read_the_groups_holding_its_shards(runs):
    """A plain model needs every shard of each weight: the groups read first do not cover it,
    so the rank reads, by ranged reads, the groups of the ranks whose shards overlap it (here
    every rank's), once each, and never the whole file; the weights are the whole saved ones."""
    for saved, restored in zip(runs["save"], runs["restore"], strict=True):
        rank = restored["rank"]
        own = own_groups(runs["regions"], rank)
        reads = restored["plain_reads"]
        assert reads[: len(own)] == own
        assert sorted(reads) == sorted(runs["regions"])  # every group once, "whole" never
        expected = {k: v for k, v in saved["at_step_4"].items() if k.startswith("model/")}
        assert restored["plain_state"] == expected


def test_a_damaged_group_fails_the_restore_on_every_rank(runs):
    """A byte flipped in rank 2's records: rank 2 finds its group's digest wrong, and every rank
    raises SnapshotCorruptError (restore_from_latest falls back together on it)."""
    for restored in runs["restore"]:
        assert "damaged" in restored, f"rank {restored['rank']} restored a damaged snapshot"
        assert ".snapshot_metadata" in restored["damaged"]
    assert "records of rank 2 differ from the digest" in runs["restore"][2]["damaged"]


def test_restore_from_latest_skips_a_snapshot_whose_metadata_differs_from_its_checksum(runs):
    """The same flipped byte under restore_from_latest: rank 0's streamed checksum finds it, and
    every rank restores the snapshot before it (step 2), warned about the skipped one."""
    for restored in runs["restore"]:
        assert restored["damaged_latest_steps"] == 2
        if restored["rank"] == 0:
            assert any(
                "skipping damaged snapshot" in w and ".snapshot_metadata differs from the checksum" in w
                for w in restored["damaged_latest_warnings"]
            ), restored["damaged_latest_warnings"]


def test_on_2_ranks_rank_1_reads_the_groups_of_the_shards_it_now_holds(runs):
    """Restored on 2 ranks: rank 0 reads the whole metadata (it compares every saved rank's
    per-rank entries); rank 1 reads rank 0's group, saved rank 1's, and those of saved ranks 2
    and 3, whose rows it now holds. Both restore the saved state exactly."""
    regions = runs["regions"]
    zero, one = runs["world2"]
    assert zero["world2_reads"] == ["whole"]
    assert one["world2_reads"] == regions
    for restored in runs["world2"]:
        assert restored["world2_state"] == runs["save"][0]["at_step_4"]


def test_damage_only_one_of_2_ranks_reads_fails_the_restore_on_both(runs):
    """Rank 1 reads saved rank 1's group damaged as it opens the snapshot; rank 0 reads the file
    whole and intact. Both raise SnapshotCorruptError naming the damage rank 1 found: rank 0 does
    not go on alone to the world-size change's collective, where it would wait until the
    collective timeout."""
    for restored in runs["world2"]:
        assert "records of rank 1 differ from the digest" in restored.get("world2_damaged", ""), restored["rank"]


def test_each_rank_reads_the_parts_of_the_index_of_the_files_it_reads(runs):
    """Each rank writes its files' sizes and checksums as its own part of the index; a restoring
    rank reads the parts of the ranks whose files it reads, once each: its own for its shards;
    every rank's for whole tensors. Rank 0's check before restore_from_latest reads none."""
    for restored in runs["restore"]:
        rank = restored["rank"]
        assert restored["explicit_parts"] == [rank]
        assert restored["latest_parts"] == [rank]
        assert sorted(restored["plain_parts"]) == list(range(WORLD))
    # on 2 ranks: rank 0 compares every saved rank's per-rank entries, so reads every part;
    # rank 1 reads those of saved ranks 2 and 3 (the rows it now holds) and 0 (the per-rank
    # entries found equal, read from saved rank 0), not saved rank 1's
    zero, one = runs["world2"]
    assert sorted(zero["world2_parts"]) == list(range(WORLD))
    assert sorted(one["world2_parts"]) == [0, 2, 3]


def test_a_damaged_part_of_the_index_fails_the_restore_on_every_rank(runs):
    """A byte flipped in rank 2's part (its size unchanged, so rank 0's check before the restore
    passes): the rank reading it finds its digest wrong, every rank raises, and
    restore_from_latest falls back together to the snapshot before it."""
    for restored in runs["restore"]:
        assert "damaged_part" in restored, f"rank {restored['rank']} restored a damaged snapshot"
        assert restored["damaged_part_latest_steps"] == 2
    assert ".tnt_snapshot_index/2.json" in runs["restore"][2]["damaged_part"]
    assert "differ from the size and digest the index recorded" in runs["restore"][2]["damaged_part"]


def test_a_missing_file_fails_the_restore_on_every_rank_and_latest_falls_back(runs):
    """One of rank 3's payload files removed: rank 0's check before restore_from_latest does not
    read rank 3's part, so rank 3 finds the file missing as it reads; every rank falls back to
    the snapshot before it, and the warning names the file."""
    for restored in runs["restore"]:
        assert "missing_file" in restored, f"rank {restored['rank']} restored a snapshot missing a file"
        assert restored["missing_file_latest_steps"] == 2
    zero = runs["restore"][0]
    removed = zero["missing_file_removed"]
    assert removed.startswith("3/")
    assert any(
        "skipping damaged snapshot" in w and f"epoch_0_step_4/{removed}" in w for w in zero["missing_file_latest_warnings"]
    ), zero["missing_file_latest_warnings"]


def test_tnt_snapshot_verify_reads_every_part_and_names_the_damaged_one(runs):
    """`tnt-snapshot verify` checks every file of every rank against the sizes and checksums the
    parts of the index list: the snapshots are intact; in the copies, the damaged part and the
    missing file are named, and the snapshot before them is intact."""
    from click.testing import CliRunner

    from tnt_snapshot_plugin.cli import cli
    from tnt_snapshot_plugin.format.index import read_local, seal

    def verify(path: Path) -> dict[str, list[str]]:
        result = CliRunner().invoke(cli, ["verify", str(path), "--json"], catch_exceptions=False)
        return {s["name"]: s["problems"] for s in json.loads(result.stdout)["snapshots"]}

    out = runs["out"]
    assert verify(out / "snapshots") == {"epoch_0_step_2": [], "epoch_0_step_4": []}
    files = read_local(str(out / "snapshots" / "epoch_0_step_4"))["files"]
    assert {int(rel.split("/")[0]) for rel in files if not rel.startswith("batched/")} == set(range(WORLD))
    part = verify(out / "damaged_part")
    assert part["epoch_0_step_2"] == []
    assert part["epoch_0_step_4"] == [
        "rank 2's part of its index (.tnt_snapshot_index/2.json) is damaged: its bytes differ from the size "
        "and digest the index recorded"
    ]
    # the layout before the parts (every file in the index itself) still verifies
    old = out / "old_layout"
    shutil.copytree(out / "snapshots", old)
    for snapshot in old.iterdir():
        fields = {k: v for k, v in read_local(str(snapshot)).items() if k not in ("seal", "parts")}
        shutil.rmtree(snapshot / ".tnt_snapshot_index")
        (snapshot / ".tnt_snapshot_index.json").write_bytes(seal({**fields, "format": 1}))
    assert verify(old) == {"epoch_0_step_2": [], "epoch_0_step_4": []}
    missing = verify(out / "missing_file")
    assert missing["epoch_0_step_2"] == []
    assert missing["epoch_0_step_4"] == [f"file {runs['restore'][0]['missing_file_removed']} is missing"]
