"""DTensor meshes written once per rank (format/mesh_aliases.py): what the writer writes, that
torchsnapshot's YAML loader and the plugin's reader read the same manifest from it, and that
text which only looks like a mesh name is left alone. Multi-rank snapshots: test_format_writer
(2 ranks, read back by stock torchsnapshot), test_restore_by_rank (4 FSDP2 ranks)."""

from __future__ import annotations

import json

import pytest
import yaml

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases, writer
from tnt_snapshot_plugin.format.torchsnapshot.manifest import parse_metadata
from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import RankRegions, read_for_rank


def shards(row: int, name: str) -> list[dict]:
    tensor = {"type": "Tensor", "location": f"{row}/{name}", "serializer": "buffer_protocol", "dtype": "torch.float32",
              "shape": [1, 2], "replicated": False, "byte_range": None}
    return [{"offsets": [row, 0], "sizes": [1, 2], "tensor": tensor}]


def records(rank: int) -> dict[str, str]:
    """Rank ``rank``'s records of three DTensors on a 1-D mesh of 4 and one on a 2 x 2 mesh."""
    builder = writer._Builder(rank, 1 << 20, None)
    for i in range(3):
        builder.dtensor_record(f"{rank}/m/w{i}", shards(rank, f"w{i}"), [0, 1, 2, 3], [[0], [-1]], named=True)
    builder.dtensor_record(f"{rank}/m/h", shards(rank, "h"), [[0, 1], [2, 3]], [[1], [-1]], named=True)
    # a replicated value, recorded alike by every rank that records it
    builder.dtensor_record("0/m/replicated", shards(0, "replicated"), [0, 1, 2, 3], [[-1], [-1]], named=False)
    return builder.entries


def metadata(parts: list[dict[str, str]]) -> bytes:
    return bytes(writer.metadata_bytes(writer.merge(parts), len(parts)))


def test_a_rank_writes_each_mesh_once_then_names_it():
    entries = records(2)
    assert '"mesh": &m2_0 [0, 1, 2, 3]' in entries["2/m/w0"]
    assert entries["2/m/w1"].count('"mesh": *m2_0') == 1 and '"mesh": *m2_0' in entries["2/m/w2"]
    assert '"mesh": &m2_1 [[0, 1], [2, 3]]' in entries["2/m/h"]
    assert '"mesh": [0, 1, 2, 3]' in entries["0/m/replicated"]
    zero = records(0)
    assert '"mesh": &m0_0 [0, 1, 2, 3]' in zero["0/m/w0"] and '"mesh": *m0_0' in zero["0/m/w2"]


def test_the_plugin_reads_what_torchsnapshot_s_yaml_loader_reads():
    data = metadata([records(0), records(1), records(2)])
    ours = mesh_aliases.loads(data)
    assert ours == yaml.load(data, Loader=yaml.CSafeLoader)
    manifest = parse_metadata(data, "snap").manifest
    assert manifest["2/m/w2"]["mesh"] == [0, 1, 2, 3] and manifest["2/m/h"]["mesh"] == [[0, 1], [2, 3]]
    assert manifest["1/m/w1"]["mesh"] is manifest["1/m/w0"]["mesh"]  # one list, not a copy per record


def test_one_rank_s_group_read_alone_holds_the_meshes_it_names():
    from tnt_snapshot_plugin.format.torchsnapshot.coordination import RecordDeltas, grouped_metadata

    parts = [records(0), records(1), records(2)]
    rank0 = RecordDeltas()  # each rank's group, as rank 0 commits them (writer_job)
    zeros = [rank0.incoming(rank, RecordDeltas().outgoing(part)) for rank, part in enumerate(parts)]
    views, ranked = grouped_metadata(zeros, rank0.groups(3), 3)
    data = b"".join(bytes(view) for view in views)
    shapes = {"m/w0": [4, 2], "m/w1": [4, 2], "m/w2": [4, 2], "m/h": [4, 2]}  # as the index records them
    assert ranked is not None
    regions = RankRegions([(start, end, digest) for start, end, digest in ranked], shapes)
    got = read_for_rank(lambda a, b: data[a:b], regions, 3, 2, "snap")
    assert got is not None
    assert got[0].manifest["2/m/w1"]["mesh"] == [0, 1, 2, 3]
    assert "1/m/w0" not in got[0].manifest  # rank 1's group was not read
    assert got[1]["m/w0"]["global_shape"] == [4, 2]  # its whole shape, from the index


def test_a_name_no_record_before_defines_is_damage():
    data = metadata([records(0), records(1)]).replace(b'"mesh": &m1_0 ', b'"mesh": ', 1)
    with pytest.raises(SnapshotCorruptError, match="names mesh 'm1_0', which no record before it defines"):
        parse_metadata(data, "snap")


def test_text_that_looks_like_a_mesh_name_is_kept_as_it_is():
    tricky = '"mesh": *m1_0 and "mesh": &m1_0 ['
    doc = {"version": "0.0.0", "world_size": 2, "manifest": {
        f"1/{tricky}": {"type": "str", "serialized_value": tricky, "readable": tricky, "replicated": False},
    }}
    assert mesh_aliases.loads(json.dumps(doc).encode()) == doc
    # in a file that names meshes too (every record parsed through the substitutions)
    with_names = metadata([records(0), records(1)])[:-2] + b", " + json.dumps(doc["manifest"])[1:-1].encode() + b"}}"
    assert b'"mesh": *m1_0' in with_names
    got = mesh_aliases.loads(with_names)["manifest"]
    assert got[f"1/{tricky}"] == doc["manifest"][f"1/{tricky}"]
