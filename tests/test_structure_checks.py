"""The structure checks of the one reader, one family at a time: pieces that must tile their
tensor (format/structure.py), byte ranges that must stay apart, counts that must be bounded and
agree, names in the index that must stay inside the snapshot and with their rank (index.py), and
tensors torch would reject. Pure checks on crafted manifests; then, on snapshots the real saver
wrote and sealed again after the damage, what verify, restore and the CLI make of each.
tests/test_properties.py draws the same damage at random."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from tnt_snapshot_plugin import (
    SnapshotConfig,
    SnapshotCorruptError,
    SnapshotFallbackWarning,
    Snapshotter,
    restore,
)
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.format import verify
from tnt_snapshot_plugin.format.checksums import record_views, record_whole
from tnt_snapshot_plugin.format.index import parse as parse_index
from tnt_snapshot_plugin.format.index import parse_part, part_bytes, part_entry
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.format.structure import MAX_INT64, overlap_problem, tiling_problem
from tnt_snapshot_plugin.format.torchsnapshot.manifest import (
    MAX_NDIM,
    MAX_WORLD_SIZE,
    parse_metadata,
    rank_number,
)
from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import Groups, RankRegions
from tnt_snapshot_plugin.format.torchsnapshot.world_size import _Comparison
from tnt_snapshot_plugin.stores import LocalStore
from tnt_snapshot_plugin.testing import FaultyStore
from toy import Holder

OLD, NEW = "epoch_0_step_1", "epoch_0_step_2"
METADATA, INDEX = ".snapshot_metadata", ".tnt_snapshot_index.json"


# ---------------------------------------------------------------------------------------------
# Crafted manifests


def raw(location: str, shape: list[int], start: int = 0, dtype: str = "torch.float32") -> dict[str, Any]:
    numel = 1
    for n in shape:
        numel *= n
    size = {"torch.float32": 4, "torch.int8": 1}[dtype] * numel
    return {"type": "Tensor", "location": location, "serializer": "buffer_protocol", "dtype": dtype,
            "shape": shape, "replicated": False, "byte_range": [start, start + size]}


def piece(offsets: list[int], sizes: list[int], location: str, start: int = 0) -> dict[str, Any]:
    return {"offsets": offsets, "sizes": sizes, "tensor": raw(location, sizes, start)}


def metadata(manifest: dict[str, Any], world_size: int = 1) -> bytes:
    return json.dumps({"version": "0.1.0", "world_size": world_size, "manifest": manifest}).encode()


def refused(manifest: dict[str, Any], match: str, world_size: int = 1, **kw: Any) -> None:
    with pytest.raises(SnapshotCorruptError, match=match):
        parse_metadata(metadata(manifest, world_size), "snap", **kw)


def chunked(chunks: list[dict[str, Any]], shape: list[int]) -> dict[str, Any]:
    return {"0/m": {"type": "dict", "keys": ["w"]},
            "0/m/w": {"type": "ChunkedTensor", "dtype": "torch.float32", "shape": shape, "chunks": chunks, "replicated": False}}


def dtensor(shards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "DTensor", "shards": shards, "mesh": [0, 1], "dim_map": [[0], [-1]]}


# -- pieces that do not tile --------------------------------------------------------------------


def test_tiling_finds_a_gap_an_overlap_and_a_piece_outside():
    rows = [((0, 0), (2, 3)), ((2, 0), (2, 3))]
    assert tiling_problem([4, 3], rows, "shards") is None
    assert "missing" in tiling_problem([5, 3], rows, "shards")  # a gap: row 4
    assert "overlap" in tiling_problem([4, 3], [((0, 0), (3, 3)), ((2, 0), (2, 3))], "shards")
    assert "outside" in tiling_problem([4, 3], [*rows, ((4, 0), (0, 3)), ((3, 0), (2, 3))], "shards")
    # an overlap and a gap of the same size: the volumes add up, the sweep finds the overlap
    assert "overlap" in tiling_problem([4, 3], [((0, 0), (2, 3)), ((1, 0), (2, 3))], "shards", exact=False)
    assert "overlap" in tiling_problem([4], [((0,), (2,)), ((1,), (2,))], "chunks")
    # the replicas of a shard (identical boxes) count once; an empty piece at the end is inside
    assert tiling_problem([4, 3], [*rows, rows[1], ((4, 0), (0, 3))], "shards") is None
    # a 2-D grid of pieces (row and column sharding), and shards of some ranks only
    grid = [((r, c), (1, 2)) for r in range(3) for c in (0, 2)]
    assert tiling_problem([3, 4], grid, "shards") is None
    assert tiling_problem([3, 4], grid[:3], "shards", exact=False) is None
    assert "missing" in tiling_problem([3, 4], grid[:3], "shards")
    assert "dimensions" in tiling_problem([3, 4], [((0,), (3,))], "shards")
    assert tiling_problem([0, 5], [((0, 0), (0, 5))], "shards") is None  # an empty tensor
    assert tiling_problem([], [((), ())], "chunks") is None  # a 0-d tensor: one element


def test_chunks_that_do_not_tile_their_shape_are_refused_naming_the_entry():
    whole = [piece([0], [2], "f", 0), piece([2], [2], "f", 8)]
    parse_metadata(metadata(chunked(whole, [4])), "snap")
    refused(chunked(whole, [5]), r"entry '0/m/w': its chunks hold 4 of the 5 elements")
    refused(chunked([piece([0], [3], "f", 0), piece([2], [2], "f", 12)], [4]), "'0/m/w': .*overlap")
    refused(chunked([*whole, piece([4], [1], "f", 16)], [4]), "'0/m/w': .*outside its shape")
    refused(chunked([piece([0], [2], "f", 0), {**piece([2], [2], "g"), "tensor": raw("g", [2], dtype="torch.int8")}], [4]),
            "one of its chunks is torch.int8, the tensor torch.float32")


def test_shards_merged_over_ranks_must_tile_the_shape_the_index_records():
    manifest = {
        "0/m": {"type": "dict", "keys": ["w"]}, "1/m": {"type": "dict", "keys": ["w"]},
        "0/m/w": dtensor([piece([0, 0], [2, 3], "0/w")]),
        "1/m/w": dtensor([piece([2, 0], [2, 3], "1/w")]),
    }
    parse_metadata(metadata(manifest, 2), "snap", shapes={"m/w": [4, 3]})
    refused(manifest, r"entry '0/m/w': its shards over all ranks hold 12 of the 15", 2, shapes={"m/w": [5, 3]})
    refused(manifest, "outside its shape", 2, shapes={"m/w": [3, 3]})
    manifest["1/m/w"] = dtensor([piece([1, 0], [2, 3], "1/w")])  # overlaps rank 0's; a row missing
    refused(manifest, "overlap", 2)
    manifest["1/m/w"] = {**dtensor([]), "type": "ShardedTensor"}
    refused(manifest, "it is a ShardedTensor, and a DTensor under '0/m/w'", 2)
    manifest["1/m/w"] = dtensor([])  # a rank that holds no part of it records no shards
    parse_metadata(metadata(manifest, 2), "snap", shapes={"m/w": [2, 3]})


# -- byte ranges of one file --------------------------------------------------------------------


def test_byte_ranges_of_one_file_must_not_overlap():
    assert overlap_problem("f", [(0, 8, "a", None), (8, 16, "b", None), (4, 4, "empty", None)]) is None
    assert "entries 'a' and 'b' read overlapping bytes of file f (0-8 and 4-12)" in overlap_problem(
        "f", [(4, 12, "b", None), (0, 8, "a", None)]
    )
    assert "overlapping" in overlap_problem("f", [(0, 8, "a", None), (0, 8, "b", None)])  # the same bytes, two tensors
    assert "overlapping" in overlap_problem("f", [(0, 100, "a", None), (10, 20, "b", None), (10, 20, "c", None)])
    replica = ("m/w", ((0,), (2,)))  # one shard recorded by every rank of its replica group
    assert overlap_problem("f", [(0, 8, "0/m/w", replica), (0, 8, "1/m/w", replica)]) is None
    manifest = {"0/m": {"type": "dict", "keys": ["a", "b"]}, "0/m/a": raw("pack", [2]), "0/m/b": raw("pack", [2], start=4)}
    refused(manifest, r"entries '0/m/a' and '0/m/b' read overlapping bytes of file pack \(0-8 and 4-12\)")
    manifest["0/m/b"] = {"type": "object", "location": "pack", "serializer": "torch_save", "byte_range": None}
    refused(manifest, "read overlapping bytes of file pack .0-8 and 0-the end.")
    manifest["0/m/b"] = raw("pack", [2], start=8)
    parse_metadata(metadata(manifest), "snap")


def test_the_replicas_of_a_dtensor_shard_may_name_the_same_file():
    shard = piece([0], [2], "0/m/w/shard_0")
    shard["tensor"]["byte_range"] = None
    manifest = {"0/m/w": dtensor([shard]), "1/m/w": dtensor([json.loads(json.dumps(shard))])}
    assert parse_metadata(metadata(manifest, 2), "snap").world_size == 2
    manifest["1/m/v"] = {**raw("0/m/w/shard_0", [2]), "byte_range": None}  # another tensor: refused
    refused(manifest, "overlapping bytes of file 0/m/w/shard_0", 2)


# -- counts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [0, -1, MAX_WORLD_SIZE + 1, 10**12, 2**64, "2", 1.5, True, None])
def test_world_size_is_bounded_before_anything_is_built_from_it(world_size):
    tracemalloc.start()
    try:
        refused({"0/n": {"type": "int", "serialized_value": "1"}}, "world_size is", world_size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_ranks_dimensions_elements_and_byte_ranges_are_bounded():
    assert [rank_number(t, 4) for t in ("0", "3", "4", "01", "+1", "-0", "\u0661", "", "1" * 8)] == [0, 3] + [None] * 7
    assert rank_number(str(MAX_WORLD_SIZE - 1), MAX_WORLD_SIZE) == MAX_WORLD_SIZE - 1
    refused({"01/n": {"type": "int", "serialized_value": "1"}}, "names no rank below 2", 2)
    refused({"0/w": raw("f", [1] * (MAX_NDIM + 1))}, "its shape is")
    refused({"0/w": {**raw("f", [2]), "shape": [2**40, 2**40], "serializer": "torch_save"}}, "more elements than a tensor can")
    refused({"0/w": {**raw("f", [2]), "shape": [0, 2**70], "serializer": "torch_save"}}, r"its shape is \[0, ")
    refused({"0/w": {**raw("f", [2]), "byte_range": [0, 2**64]}}, "its byte range is")
    refused({"0/w": {**raw("f", [2]), "type": ["Tensor"]}, "0/v": {"type": {"a": 1}}}, "unknown dtype|unknown entry type")
    refused({"0/v": {"type": ["dict"]}}, "unknown entry type")
    refused({"0/w": {**raw("f", [2]), "dtype": ["torch.float32"]}}, "unknown dtype")
    refused(chunked([piece([2**63], [1], "f")], [1]), "its offsets is")


def test_the_index_s_counts_are_bounded_and_agree():
    parse_index(seal_index({"format": 2, "files": {}, "world_size": 2, "parts": [[1, "a"], [1, "b"]]}), "snap")
    for fields, match in [
        ({"world_size": 10**12}, "world_size is"),
        ({"world_size": 0}, "world_size is"),
        ({"world_size": 3, "parts": [[1, "a"], [1, "b"]]}, "it lists 2 parts for a world_size of 3"),
        ({"files": {"0/w": 2**64}}, "'files' is not a mapping"),
    ]:
        with pytest.raises(SnapshotCorruptError, match=match):
            parse_index(seal_index({"format": 1, "files": {}, **fields}), "snap")
    regions = {"regions": [[0, 1, "x"]] * (MAX_WORLD_SIZE + 1), "shapes": {}}
    assert RankRegions.from_index({"ranks": regions}) is None  # more groups than ranks: not used


def test_world_size_comparison_keys_ranks_by_the_entries_there_are():
    class Meta:
        world_size = 10**9
        manifest = {"0/k/n": {"type": "int", "serialized_value": "1"}, "7/k/n": {"type": "int", "serialized_value": "1"}}

    comparison = _Comparison(Meta(), {"k"}, None, None, None)
    assert comparison.per_rank_entries() == {"k/n": {0: Meta.manifest["0/k/n"], 7: Meta.manifest["7/k/n"]}}
    assert comparison.verdict() == ([], ["k/n"], None)  # saved by 2 of 10**9 ranks: differs


def test_a_group_of_records_holds_only_its_own_rank_s_and_lies_inside_the_recorded_shape():
    import xxhash

    def groups(records: list[dict[str, Any]], shapes: dict[str, list[int]]) -> Groups:
        texts = [json.dumps(r)[1:-1].encode() for r in records]
        data, regions = b"", []
        for text in texts:
            regions.append((len(data), len(data) + len(text), xxhash.xxh3_64_hexdigest(text)))
            data += text
        return Groups(lambda a, b: data[a:b], RankRegions(regions, shapes), "snap")

    mine = {"1/m/w": dtensor([piece([2], [2], "1/w")])}
    read = groups([{"0/m": {"type": "dict", "keys": ["w"]}, "0/m/w": dtensor([piece([0], [2], "0/w")])}, mine], {"m/w": [4]})
    read.load(0)
    read.load(1)
    assert read.view(1)["m/w"]["global_shape"] == [4]
    stray = groups([{"0/m": {"type": "dict", "keys": []}}, {"0/m/x": {"type": "int", "serialized_value": "1"}}], {})
    stray.load(0)
    with pytest.raises(SnapshotCorruptError, match="the records of rank 1 hold entry '0/m/x', not one of rank 1"):
        stray.load(1)
    outside = groups([{"0/m": {"type": "dict", "keys": ["w"]}, "0/m/w": dtensor([piece([0], [2], "0/w")])}, mine], {"m/w": [3]})
    outside.load(0)
    outside.load(1)
    with pytest.raises(SnapshotCorruptError, match="outside its shape"):
        outside.view(1)


# -- names in the index -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "/abs", "0/../../x", "0//x", "./0/x", "x\x00", "5/w", "batched/5-0", "notes.txt"])
def test_the_index_names_no_file_outside_the_snapshot_or_of_a_rank_it_does_not_have(name):
    with pytest.raises(SnapshotCorruptError, match="its 'files' names"):
        parse_index(seal_index({"format": 1, "world_size": 2, "files": {"0/w": 8, name: 8}}), "snap")
    if name.startswith(("5/", "batched/5", "notes")):
        return  # a name the index may list where it records no world size
    with pytest.raises(SnapshotCorruptError, match="its 'checksums' names"):
        parse_index(seal_index({"format": 1, "files": {}, "checksums": {name: {}}}), "snap")
    data = part_bytes({"1/w": 8}, {name: {}})
    with pytest.raises(SnapshotCorruptError, match="not a file inside the snapshot that rank 1 wrote"):
        parse_part(data, {"parts": [[0, ""], part_entry(data)]}, 1, "snap")


# ---------------------------------------------------------------------------------------------
# Snapshots the saver wrote, damaged and sealed again


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(3, generator=g), "b": torch.randn(2, 2, generator=g), "c": torch.randn(5, generator=g).to(torch.complex64),
            "obj": (step, "two"), "n": step}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("structure") / "run"
    saver = Snapshotter(str(root), SnapshotConfig.build(async_snapshot=False))
    saver.train_start(["m"], 0, 0)
    for step in (1, 2):
        saver.save(0, step, {"m": Holder(state(step))})
    saver.train_end(0, 2, lambda intra_epoch: {})
    return root


@pytest.fixture
def run(written, tmp_path) -> Path:
    return Path(shutil.copytree(written, tmp_path / "run"))


def doc(snapshot: Path) -> dict[str, Any]:
    return json.loads((snapshot / METADATA).read_bytes())


def reseal(snapshot: Path, metadata_doc: Any = None, payloads: Any = None, index_edit: Any = None) -> None:
    """The metadata (and payloads) written, then their checksums and the index's seal made again."""
    index = json.loads((snapshot / INDEX).read_text())
    index.pop("seal")
    if metadata_doc is not None:
        data = json.dumps(metadata_doc).encode()
        (snapshot / METADATA).write_bytes(data)
        index["checksums"][METADATA] = record_whole([data])
    for rel, data in (payloads or {}).items():
        (snapshot / rel).write_bytes(data)
        index["files"][rel] = len(data)
        index["checksums"][rel] = record_views([memoryview(data)])
    if index_edit is not None:
        index_edit(index)
    (snapshot / INDEX).write_bytes(seal_index(index))


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=True)
    out = result.stdout + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, out)
    assert "Traceback" not in out
    if result.exit_code == 2:
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("tnt-snapshot: error: "), out
    return result.exit_code, out


def targets() -> dict[str, Holder]:
    return {"m": Holder({"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": torch.zeros(5, dtype=torch.complex64), "obj": None, "n": None})}


def test_a_hostile_world_size_is_refused_within_a_small_address_space(run):
    """world_size 10**9 (metadata sealed again): verify and ls, run in a process that may not map
    more than 1 GiB, say the snapshot is damaged and name the world size, promptly and without a
    MemoryError; restore in this process refuses it without allocating more than a few MiB."""
    metadata_doc = doc(run / NEW)
    metadata_doc["world_size"] = 10**9
    reseal(run / NEW, metadata_doc)
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from tnt_snapshot_plugin.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for args, code in ((["verify", str(run / NEW)], 1), (["ls", str(run), "--json"], 0)):
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == code, done.stdout + done.stderr
        assert "world_size is 1000000000" in done.stdout + done.stderr or json.loads(done.stdout)["restore"] == OLD
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotCorruptError, match="world_size is 1000000000"):
            restore(str(run / NEW), targets())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_an_index_name_outside_the_snapshot_is_damage_and_never_asked_about(run):
    """A file of the index renamed '../outside' (sealed again), with a file of that size waiting
    there: verify never asks the storage about the name and calls the snapshot damaged; restore by
    path refuses it; restore_from_latest falls back; verify and ls agree."""
    from tnt_snapshot_plugin import restore_from_latest

    def rename(index: dict[str, Any]) -> None:
        rel = sorted(index["files"])[0]
        index["files"]["../outside"] = index["files"].pop(rel)

    reseal(run / NEW, index_edit=rename)
    (run / "outside").write_bytes(b"\x00" * json.loads((run / NEW / INDEX).read_text())["files"]["../outside"])
    faulty = FaultyStore(LocalStore(str(run)))
    verdict = verify.check(faulty, NEW)
    assert "'../outside'" in verdict.problem
    assert not [call for call in faulty.calls if any("outside" in str(arg) for arg in call[1])]
    with pytest.raises(SnapshotCorruptError, match="damaged.*'../outside'"):
        restore(str(run / NEW), targets())
    restored = targets()
    with pytest.warns(SnapshotFallbackWarning, match=f"skipping damaged snapshot .*{NEW}"):
        assert restore_from_latest(str(run), restored).endswith(OLD)
    assert torch.equal(restored["m"].state["a"], state(1)["a"])
    assert invoke("verify", str(run / NEW))[0] == 1
    assert json.loads(invoke("ls", str(run), "--json")[1])["restore"] == OLD


def test_restore_by_path_refuses_what_verify_calls_damaged(run):
    """A file the index lists that restore never reads, removed: verify calls the snapshot
    damaged, so restore by path refuses it too (the same verdict), as diff and export do."""
    (run / NEW / "0" / "m" / "obj").unlink()
    assert "file 0/m/obj is missing" in verify.check(LocalStore(str(run)), NEW).problem
    fresh = {"m": Holder({"a": torch.zeros(3)})}
    with pytest.raises(SnapshotCorruptError, match="is damaged: file 0/m/obj is missing"):
        restore(str(run / NEW), fresh, strict=False)
    assert torch.equal(fresh["m"].state["a"], torch.zeros(3))  # nothing read into the state
    assert invoke("diff", str(run / OLD), str(run / NEW))[0] == 2
    assert invoke("export", str(run / NEW), str(run / "out.pt"), "--key", "m")[0] == 2
    restore(str(run / OLD), targets())  # the intact one restores


def test_tensors_torch_would_reject_are_refused_in_one_line(run):
    """A meta-device tensor inside an object, a torch.save'd tensor payload of another shape
    (both checksummed again), a shape whose elements overflow int64: restore refuses each as
    damage, and export and diff exit with status 2 in one line, never a traceback."""
    entries = doc(run / NEW)["manifest"]
    buffer = io.BytesIO()
    torch.save((torch.empty(2, device="meta"), "two"), buffer)
    reseal(run / NEW, payloads={entries["0/m/obj"]["location"]: buffer.getvalue()})
    with pytest.raises(SnapshotCorruptError, match="'m/obj'.*a tensor on the meta device"):
        restore(str(run / NEW), targets())
    assert invoke("export", str(run / NEW), str(run / "out.pt"), "--key", "m")[0] == 2
    assert invoke("diff", str(run / OLD), str(run / NEW))[0] == 2

    buffer = io.BytesIO()
    torch.save(torch.zeros(6, dtype=torch.complex64), buffer)
    metadata_doc = doc(run / NEW)
    metadata_doc["manifest"]["0/m/c"].update(location="0/m/c_payload", byte_range=None)
    reseal(run / NEW, metadata_doc, payloads={"0/m/c_payload": buffer.getvalue(), "0/m/obj": (run / OLD / "0/m/obj").read_bytes()})
    with pytest.raises(SnapshotCorruptError, match=r"'m/c'.*shape \[6\], its entry says torch.complex64 of shape \[5\]"):
        restore(str(run / NEW), targets())
    assert invoke("export", str(run / NEW), str(run / "out.pt"), "--key", "m", "--force")[0] == 2

    metadata_doc["manifest"]["0/m/c"]["shape"] = [2**62, 4]
    reseal(run / NEW, metadata_doc)
    for args in (["inspect", str(run / NEW)], ["export", str(run / NEW), str(run / "o.pt"), "--key", "m"],
                 ["diff", str(run / OLD), str(run / NEW)]):
        code, out = invoke(*args)
        assert code == 2 and "more elements than a tensor can" in out, (args, out)
    assert invoke("verify", str(run / NEW))[0] == 1
    with pytest.raises(SnapshotCorruptError, match="more elements than a tensor can"):
        restore(str(run / NEW), targets())


def test_the_index_and_metadata_must_agree_on_the_world_size(run):
    reseal(run / NEW, index_edit=lambda index: index.update(world_size=2))
    assert ".snapshot_metadata: world_size is 1, its index records 2" in verify.check(LocalStore(str(run)), NEW).problem
    with pytest.raises(SnapshotCorruptError, match="its index records 2"):
        restore(str(run / NEW), targets())


def test_the_int64_bound_is_torch_s():
    assert MAX_INT64 == torch.iinfo(torch.int64).max
