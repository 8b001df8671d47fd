"""The scale benchmark's model of N ranks (benchmarks/scale.py) against real processes, and
the per-save coordination (``coordination.RecordDeltas``, ``agree_on_paths``).

tests/scale_worker.py runs 2, 4 and 8 real gloo ranks, each with a real FSDP2 decoder and Adam
state, and plans two saves with the writer's real code; the records go to rank 0 through the
real collective. The simulation must make the same records, the same metadata, and what each
rank sends rank 0 and rank 0's commit time must agree within 2x.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import launching
import pytest
import xxhash

from tnt_snapshot_plugin.errors import SnapshotError
from tnt_snapshot_plugin.format.torchsnapshot import manifest as mf
from tnt_snapshot_plugin.format.torchsnapshot import rank_regions
from tnt_snapshot_plugin.format.torchsnapshot import writer as fmt
from tnt_snapshot_plugin.format.torchsnapshot.coordination import (
    RecordDeltas,
    agree_on_paths,
    grouped_metadata,
)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
WORKER = Path(__file__).with_name("scale_worker.py")
sys.path.insert(0, str(BENCHMARKS))

import scale  # noqa: E402


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("scale")
    runs = {}
    for world in (2, 4, 8):
        runs[world] = launching.run_ranks(
            lambda rank, world=world: [str(WORKER), str(rank), str(world), str(out / f"rdv{world}"), str(out)],
            world,
            lambda rank, world=world: out / f"scale{world}_{rank}.log",
            lambda rank, world=world: out / f"scale{world}_rank{rank}.json",
            f"scale {world} ranks",
        )
    return runs


def _comparable(entries: dict[str, str]) -> dict[str, Any]:
    """Records as dicts; the RNG's values (not its layout) differ between processes."""
    out = {}
    for path, record in scale.parsed_records(entries).items():
        if path.split("/")[1] == "rng_state" and "serialized_value" in record:
            record = {k: v for k, v in record.items() if k not in ("serialized_value", "readable")}
        out[path] = record
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_simulated_records_are_the_real_ones(worlds, world):
    arena = scale.Arena()
    for got in worlds[world]:
        simulated = scale.rank_part("fsdp2", scale.TINY, got["rank"], world, 1, arena)
        real, sim = _comparable(got["entries"]), _comparable(simulated.entries)
        assert [p for p in real if real[p] != sim.get(p)] == [], (real, sim)
        assert real == sim
        assert len(simulated.sizes) == got["files"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_real_snapshot_is_read_by_rank_as_a_whole_parse_gives_it(worlds, world):
    for got in worlds[world]:
        assert got["by_rank"]["same"], got["rank"]
        # rank 0's records and its own, not every rank's
        assert got["by_rank"]["entries_read"] <= got["by_rank"]["entries"] * 2 / world


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_simulated_costs_agree_with_real_ranks_within_2x(worlds, world):
    arena = scale.Arena()
    rank0 = worlds[world][0]
    assert rank0["simulated_metadata_bytes"] / rank0["metadata_bytes"] == pytest.approx(1, rel=0.01)
    assert 0.5 <= rank0["simulated_commit_s"] / rank0["commit_s"] <= 2
    for got in worlds[world]:
        deltas = RecordDeltas()
        sent = []
        for step in (1, 2):
            part = scale.rank_part("fsdp2", scale.TINY, got["rank"], world, step, arena)
            sent.append(len(pickle.dumps((deltas.outgoing(part.entries), scale.rank_listing(part, world)))))
            deltas.settle()
        for simulated, real in zip(sent, got["sent"], strict=True):
            assert 0.5 <= simulated / real <= 2, (sent, got["sent"])
        # a later save sends what changed: far less than the first
        assert got["sent"][1] < got["sent"][0] / 2


def test_later_parts_carry_only_changed_records():
    """A rank's 0/ records go as records, its own as its group's text: whole at first, then
    only the byte ranges that changed; rank 0 holds both and applies the changes."""
    deltas = RecordDeltas()
    first = {"0/a": "A", "0/b": "B", "0/c": "C", "1/x": '{"v": 1}', "1/y": '{"v": 2}'}
    zeros, group = deltas.outgoing(first)
    assert zeros == ("all", {"0/a": "A", "0/b": "B", "0/c": "C"})
    assert group[0] == "all" and group[1] == b'"1/x": {"v": 1}, "1/y": {"v": 2}'
    assert deltas.incoming(1, (zeros, group)) == zeros[1]
    deltas.settle()
    second = {"0/a": "A", "0/b": "B2", "0/d": "D", "1/x": first["1/x"], "1/y": '{"v": 30}'}
    zeros, group = deltas.outgoing(second)
    assert zeros == ("changed", {"0/b": "B2", "0/d": "D"}, ["0/c"])
    assert group[0] == "changes" and group[1] == [(17, 32, b'"1/y": {"v": 30}')]
    assert deltas.incoming(1, (zeros, group)) == {"0/a": "A", "0/b": "B2", "0/d": "D"}
    assert bytes(deltas.groups(2)[0][0]) == b'"1/x": {"v": 1}, "1/y": {"v": 30}'
    deltas.settle()
    assert deltas.outgoing(dict(second)) == (("changed", {}, []), ("changes", [], group[2]))


def test_a_change_of_length_while_a_view_of_rank_0_s_copy_is_held_is_applied_to_a_copy():
    sender, rank0 = RecordDeltas(), RecordDeltas()
    rank0.incoming(1, sender.outgoing({"1/x": '"a"', "1/y": '"b"'}))
    held = memoryview(rank0.groups(2)[0][0])  # as a write of the metadata still in flight holds it
    sender.settle()
    rank0.settle()
    rank0.incoming(1, sender.outgoing({"1/x": '"a"', "1/y": '"longer"'}))
    assert bytes(rank0.groups(2)[0][0]) == b'"1/x": "a", "1/y": "longer"'
    assert bytes(held) == b'"1/x": "a", "1/y": "b"'


def test_a_group_whose_records_change_order_or_number_is_sent_whole():
    deltas = RecordDeltas()
    deltas.outgoing({"1/x": "1", "1/y": "2"})
    deltas.settle()
    assert deltas.outgoing({"1/y": "2", "1/x": "1"})[1][0] == "all"


def test_rank0_refuses_changes_that_do_not_make_the_rank_s_text():
    """rank 0's copy of a group checked against the digest of the text the rank built."""
    deltas = RecordDeltas()
    part = deltas.outgoing({"1/x": '"a"'})
    deltas.incoming(1, part)
    deltas.settle()
    zeros, (_, changes, digest) = deltas.outgoing({"1/x": '"b"'})
    with pytest.raises(SnapshotError, match="differs from the rank's"):
        deltas.incoming(1, (zeros, ("changes", [(0, 1, b"x")], digest)))


def test_a_failed_save_sends_everything_again():
    deltas = RecordDeltas()
    deltas.outgoing({"0/a": "A", "1/b": "B"})
    deltas.settle()
    deltas.outgoing({"0/a": "A2", "1/b": "B2"})
    deltas.reset()  # the snapshot failed on some rank: every rank resets
    zeros, group = deltas.outgoing({"0/a": "A3", "1/b": "B3"})
    assert zeros[0] == "all" and group[0] == "all"


def test_a_save_that_ended_unsettled_sends_everything_again():
    deltas = RecordDeltas()
    deltas.outgoing({"0/a": "A"})
    deltas.settle()
    deltas.outgoing({"0/a": "A"})  # neither settled nor reset
    assert deltas.outgoing({"0/a": "A"})[0][0] == "all"


def test_rank0_refuses_changes_to_records_it_does_not_hold():
    with pytest.raises(SnapshotError, match="out of step"):
        RecordDeltas().incoming(3, (("changed", {}, []), None))
    with pytest.raises(SnapshotError, match="out of step"):
        RecordDeltas().incoming(3, (("all", {}), ("changes", [], "0")))


@pytest.mark.parametrize("world", [1, 3])
def test_the_metadata_from_groups_is_the_merged_manifest_s_bytes(world):
    """grouped_metadata writes what metadata_bytes writes for the records in group order (rank
    0's, every 0/ record, each rank's own), non-ASCII escaped alike, at a first save and at a
    later one made of changes; and locates each rank's group with its digest."""
    senders = [RecordDeltas(enabled=world > 1) for _ in range(world)]
    rank0 = RecordDeltas(enabled=world > 1)
    for step in (1, 2):
        ranks = [
            {f"{r}/m/w": '{"type": "Tensor"}', f"{r}/s\u00e9": json.dumps(f"caf\u00e9 \u2028 {step}", ensure_ascii=False),
             "0/rep": '"R"', f"{r}/n": str(r * 10 + step)}
            for r in range(world)
        ]
        zeros = [rank0.incoming(r, senders[r].outgoing(records)) for r, records in enumerate(ranks)]
        views, regions = grouped_metadata(zeros, rank0.groups(world), world)
        for deltas in (*senders, rank0):
            deltas.settle()
    if world > 1:
        assert senders[1].last_sent_records == 2  # the records that changed
    data = b"".join(bytes(v) for v in views)
    ordered = [ranks[0], *({p: t for p, t in r.items() if p.startswith("0/")} for r in ranks[1:]),
               *({p: t for p, t in r.items() if not p.startswith("0/")} for r in ranks[1:])]
    assert data == bytes(fmt.metadata_bytes(fmt.merge(ordered), world))
    assert json.loads(data)["manifest"].keys() == {p for r in ranks for p in r}
    if world == 1:
        assert regions is None
        return
    for rank, (start, end, digest) in enumerate(regions):
        assert xxhash.xxh3_64_hexdigest(data[start:end]) == digest
        assert data[start:end].startswith(f'"{rank}/'.encode())


def test_one_process_sends_every_record_each_time():
    deltas = RecordDeltas(enabled=False)
    deltas.outgoing({"0/a": "A"})
    deltas.settle()
    assert deltas.outgoing({"0/a": "A"}) == (("all", {"0/a": "A"}), None)


class _Gathering:
    """Collectives over simulated ranks: all_gather returns what each rank passes (the pure
    core's unit test; the real collective runs in the gloo tests)."""

    def __init__(self, per_rank: list[Any]) -> None:
        self.world_size = len(per_rank)
        self.per_rank = per_rank
        self.calls: list[list[Any]] = []

    def all_gather(self, obj: Any) -> list[Any]:
        index = len(self.calls) % 2
        got = [self.per_rank[r][index] for r in range(self.world_size)]
        self.calls.append(got)
        return got


def test_equal_paths_agree_by_digest_alone():
    paths = ["model/a", "model/b"]
    from tnt_snapshot_plugin.format.torchsnapshot.coordination import paths_digest

    digest = (2, paths_digest(paths))
    coll = _Gathering([(digest, paths), (digest, paths)])
    assert agree_on_paths(coll, paths) == set(paths)
    assert len(coll.calls) == 1  # no list of paths exchanged


def test_different_paths_agree_on_the_common_ones():
    from tnt_snapshot_plugin.format.torchsnapshot.coordination import paths_digest

    mine, theirs = ["a", "b"], ["b", "c"]
    coll = _Gathering([((2, paths_digest(mine)), mine), ((2, paths_digest(theirs)), theirs)])
    assert agree_on_paths(coll, mine) == {"b"}
    assert len(coll.calls) == 2


def test_benchmark_quick_run_writes_its_table(tmp_path):
    out = tmp_path / "scale.json"
    assert scale.main(["--layouts", "ddp-7b", "fsdp2-7b", "--worlds", "2", "8", "--max-metadata", "8e6",
                       "--out", str(out)]) == 0
    points = json.loads(out.read_text())
    assert {(p["layout"], p["world"]) for p in points} == {(lay, n) for lay in ("ddp-7b", "fsdp2-7b") for n in (2, 8)}
    for p in points:
        assert p["metadata_bytes"] > 0 and p["part_later_bytes"] < p["part_first_bytes"]


def _grouped_snapshot(world: int) -> tuple[bytes, Any, list[Any]]:
    arena = scale.Arena()
    parts = [scale.rank_part("fsdp2", scale.TINY, rank, world, 1, arena) for rank in range(world)]
    data, ranked = scale.metadata_of([p.entries for p in parts], world)
    regions = rank_regions.RankRegions.from_index({"ranks": {"regions": ranked, "shapes": parts[0].shapes}})
    assert regions is not None
    return data, regions, parts


@pytest.mark.parametrize("new_world", [4, 2, 8, 3])
def test_a_rank_reads_its_view_by_groups_as_the_whole_metadata_gives_it(new_world):
    world = 4
    data, regions, _parts = _grouped_snapshot(world)
    full = mf.parse_metadata(data, "snap")
    for rank in range(new_world):
        boxes = None
        if new_world != world:
            boxes = {logical: scale.box(shape, rank, new_world) for logical, shape in regions.shapes.items()}
        got = rank_regions.read_for_rank(lambda a, b: data[a:b], regions, world, rank, "snap", boxes)
        assert got is not None
        meta, view = got
        whole = mf.rank_view(full, rank)
        assert view.keys() == whole.keys()
        for logical, entry in whole.items():
            if entry["type"] in mf.SHARDED_TYPES:
                assert mf.global_shape(view[logical]) == mf.global_shape(entry)
                if boxes is not None:
                    assert scale.overlapping(view[logical], *boxes[logical]) == scale.overlapping(entry, *boxes[logical])
            else:
                assert view[logical] == entry
        if new_world == world and rank > 0:
            assert len(meta.manifest) <= len(full.manifest) * 2 / world  # rank 0's and its own


def test_grouped_metadata_holds_the_same_records():
    parts = [{"0/a": '{"type": "list"}', "0/a/0": '{"type": "int", "serialized_value": "1", "replicated": true}'},
             {"1/b": '{"type": "list"}', "0/c": '{"type": "str", "serialized_value": "x", "replicated": true}'}]
    grouped = mf.parse_metadata(scale.metadata_of(parts, 2)[0], "s").manifest
    plain = mf.parse_metadata(bytes(fmt.metadata_bytes(fmt.merge(parts), 2)), "s").manifest
    assert grouped == plain
    assert list(grouped) == ["0/a", "0/a/0", "0/c", "1/b"]


def test_a_damaged_group_is_corruption():
    from tnt_snapshot_plugin.errors import SnapshotCorruptError

    data, regions, _parts = _grouped_snapshot(2)
    start, end, _digest = regions.regions[1]
    damaged = data[:start] + data[start:end].replace(b"Tensor", b"Tensxr", 1) + data[end:]
    with pytest.raises(SnapshotCorruptError, match="rank 1"):
        rank_regions.read_for_rank(lambda a, b: damaged[a:b], regions, 2, 1, "snap")


def test_groups_that_do_not_cover_a_piece_ask_for_the_whole_metadata():
    data, regions, _parts = _grouped_snapshot(4)
    logical, shape = next(iter(regions.shapes.items()))
    # a piece the Shard(0) chunks do not predict: all of the tensor, on one rank
    boxes = {logical: ([0] * len(shape), list(shape))}
    shifted = rank_regions.RankRegions(regions.regions, regions.shapes)
    got = rank_regions.read_for_rank(lambda a, b: data[a:b], shifted, 4, 1, "snap", boxes)
    assert got is not None  # the chunks of ranks 0-3 are read: covered
    # the index's groups do not match the world size: not used
    assert rank_regions.read_for_rank(lambda a, b: data[a:b], regions, 8, 1, "snap") is None
