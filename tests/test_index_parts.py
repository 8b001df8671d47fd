"""The index's parts (tnt_snapshot_plugin/index.py), as pure functions over bytes: which rank wrote
a file, a part checked against the size and digest the index lists, and parts read only as their
files are asked for. Real snapshots of several ranks: tests/test_restore_by_rank.py (local disk)
and tests/test_s3.py (S3)."""

from __future__ import annotations

import threading
from typing import Optional

import pytest

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format.index import (
    Parts,
    complete,
    owner,
    parse,
    parse_part,
    part_bytes,
    part_entry,
    part_rel,
    read_local,
    seal,
)

RECORD = {"algo": "xxh3_64", "value": "0123456789abcdef"}


def snapshot(world: int) -> tuple[dict, dict[str, bytes]]:
    """(a parsed index of ``world`` ranks, its parts' bytes by file)."""
    parts = {
        part_rel(r): part_bytes({f"{r}/w": 8, f"batched/{r}-0": 16}, {f"{r}/w": RECORD, f"batched/{r}-0": RECORD})
        for r in range(world)
    }
    fields = {"format": 2, "files": {}, "parts": [part_entry(parts[part_rel(r)]) for r in range(world)], "checksums": {}}
    return parse(seal(fields), "snap"), parts


@pytest.mark.parametrize(
    "rel, rank",
    [("3/model/w", 3), ("12/x/shard_0_0", 12), ("batched/7-0", 7), ("batched/0-12", 0),
     (".snapshot_metadata", None), ("batched/x-1", None), ("../0/w", None), ("sharded/w", None), ("\u00b2/w", None)],
)
def test_the_rank_that_wrote_a_file_is_named_by_its_path(rel, rank):
    assert owner(rel) == rank


def test_a_part_is_checked_against_the_size_and_digest_the_index_lists():
    index, parts = snapshot(2)
    files, checksums = parse_part(parts[part_rel(1)], index, 1, "snap")
    assert files == {"1/w": 8, "batched/1-0": 16} and set(checksums) == set(files)
    with pytest.raises(SnapshotCorruptError, match="differ from the size and digest"):
        parse_part(parts[part_rel(0)], index, 1, "snap")  # another rank's part
    with pytest.raises(SnapshotCorruptError, match="it is missing"):
        parse_part(None, index, 1, "snap")
    with pytest.raises(SnapshotCorruptError, match="lists 2 parts"):
        parse_part(parts[part_rel(1)], index, 2, "snap")


def test_a_part_listing_a_file_of_another_rank_or_outside_the_snapshot_is_damage():
    for files in ({"0/w": 8}, {"../1/w": 8}, {"1/w": -1}):
        data = part_bytes(files, {})
        index = {"parts": [[0, ""], part_entry(data)]}
        with pytest.raises(SnapshotCorruptError, match="not a mapping of this rank's files"):
            parse_part(data, index, 1, "snap")


@pytest.mark.parametrize("parts", [{}, [[1]], [["1", "ab"]], [[-1, "ab"]], [[1, 2]]])
def test_an_index_whose_parts_are_not_sizes_and_digests_is_damaged(parts):
    with pytest.raises(SnapshotCorruptError, match="'parts' is not a list"):
        parse(seal({"format": 2, "files": {}, "parts": parts}), "snap")


def test_parts_are_read_once_each_only_for_the_files_asked_for_from_many_threads():
    index, parts = snapshot(4)
    reads: list[str] = []

    def read(rel: str) -> Optional[bytes]:
        reads.append(rel)
        return parts.get(rel)

    view = Parts(index, read, "snap")
    barrier = threading.Barrier(8)

    def ask() -> None:
        barrier.wait()
        view.load_for(["2/w", "batched/2-0", ".snapshot_metadata"])

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads == [part_rel(2)] and view.loaded == {2}
    assert view.files == {"2/w": 8, "batched/2-0": 16}
    assert view.load_for(["2/w"]) == [] and reads == [part_rel(2)]  # listed already: not read again


def test_complete_lists_every_part_s_files_and_a_missing_part_is_damage():
    index, parts = snapshot(3)
    whole = complete(index, parts.get, "snap")
    assert sorted(whole["files"]) == sorted(f"{p}{r}{s}" for r in range(3) for p, s in (("", "/w"), ("batched/", "-0")))
    assert set(whole["checksums"]) == set(whole["files"])
    del parts[part_rel(1)]
    with pytest.raises(SnapshotCorruptError, match=r"1.json: it is missing: rank 1's part"):
        complete(index, parts.get, "snap")


def test_read_local_reads_a_directory_s_index_and_parts(tmp_path):
    index, parts = snapshot(2)
    (tmp_path / ".tnt_snapshot_index").mkdir()
    for rel, data in parts.items():
        (tmp_path / rel).write_bytes(data)
    fields = {k: v for k, v in index.items() if k != "seal"}
    (tmp_path / ".tnt_snapshot_index.json").write_bytes(seal(fields))
    assert read_local(str(tmp_path))["files"] == {"0/w": 8, "batched/0-0": 16, "1/w": 8, "batched/1-0": 16}
