"""Restore reads raw tensors straight into the target tensors (direct_read.py); everything else
goes through torchsnapshot's reader. Both together must give exactly what torchsnapshot gives."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torchsnapshot
from torchsnapshot.manifest import (
    DictEntry,
    ObjectEntry,
    PrimitiveEntry,
    SnapshotMetadata,
    TensorEntry,
)
from torchsnapshot.manifest_ops import get_manifest_for_rank

from tnt_snapshot_plugin import direct_read
from tnt_snapshot_plugin.compat import Snapshot, manifest_for_rank
from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.restoring import restore
from tnt_snapshot_plugin.storage import LocalStore, WriteRecorder, recording
from toy import Holder


def varied_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "dtypes": {
            str(dt): rand(5, 3, dtype=dt)
            for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                       torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
        },
        "scalar": rand(()),  # 0-d
        "empty": rand(0, 4),
        "big": rand(700_000),  # over torchsnapshot's slab threshold: a file of its own
        "small": [rand(64) for _ in range(50)],  # packed together into one file
        "complex": torch.randn(4, generator=g, dtype=torch.complex64),  # stored with torch.save
        "transposed": rand(4, 6).t(),  # a non-contiguous target: torchsnapshot's path
        "objects": {"step": 7, "name": "run", "set": {1, 2}},
    }


def zeros_like_state(state: dict) -> dict:
    def zero(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)  # keeps the layout, so "transposed" stays non-contiguous
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        if isinstance(v, list):
            return [zero(x) for x in v]
        return None

    return zero(state)


def assert_identical(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bool else got,
                           want.view(torch.uint8) if want.dtype == torch.bool else want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_identical(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_identical(a, b)
    else:
        assert got == want


def spy_direct_reads(monkeypatch) -> list:
    reads: list = []
    real = direct_read.read_into

    def spy(root, items, verifier=None):
        items = list(items)
        reads.extend(items)
        return real(root, items, verifier)

    monkeypatch.setattr(direct_read, "read_into", spy)
    return reads


def take(tmp_path, state, name="epoch_0_step_1"):
    """Written as the plugin's saver writes (small tensors gathered, metadata written last)."""
    url = LocalStore(str(tmp_path)).torchsnapshot_url(name)
    with recording(WriteRecorder()) as rec:
        Snapshot.take(url, {"h": Holder(state)})
    assert rec.error is None and rec.metadata
    (tmp_path / name / ".snapshot_metadata").write_bytes(rec.metadata)
    return str(tmp_path / name)


def test_every_kind_of_entry_restores_exactly_as_torchsnapshot_restores_it(tmp_path, monkeypatch):
    want = varied_state(0)
    path = take(tmp_path, want)

    by_torchsnapshot = Holder(zeros_like_state(want))
    torchsnapshot.Snapshot(path).restore({"h": by_torchsnapshot})
    assert_identical(by_torchsnapshot.state, want)

    reads = spy_direct_reads(monkeypatch)
    target = zeros_like_state(want)
    in_place = target["big"]
    got = Holder(target)
    restore(path, {"h": got})
    assert_identical(got.state, want)
    assert got.state["big"] is in_place  # loaded into the tensor the stateful held

    # Direct: the 10 dtypes, the scalar, the empty tensor, "big" and the 50 small ones.
    # Not direct: complex (torch.save), the transposed target, the objects.
    assert len(reads) == 10 + 1 + 1 + 1 + 50


def test_targets_that_differ_from_the_saved_tensor_go_through_torchsnapshot(tmp_path, monkeypatch):
    saved = {"a": torch.arange(12.0), "b": torch.arange(6, dtype=torch.int32)}
    path = take(tmp_path, saved)
    reads = spy_direct_reads(monkeypatch)
    # another dtype, another shape: torchsnapshot's reader allocates what was saved
    got = Holder({"a": torch.zeros(12, dtype=torch.float64), "b": torch.zeros(3, 2, dtype=torch.int32)})
    restore(path, {"h": got})
    assert reads == []
    assert_identical(got.state, saved)


def test_chunked_tensors_restore_through_torchsnapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE", str(64 * 1024))
    want = {"w": torch.randn(100_000)}
    path = take(tmp_path, want)
    monkeypatch.delenv("TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE")
    got = Holder({"w": torch.zeros(100_000)})
    restore(path, {"h": got})
    assert_identical(got.state, want)


@pytest.mark.parametrize("victim", ["big", "packed"])
def test_a_truncated_file_is_an_error_naming_it(tmp_path, victim):
    want = {"big": torch.randn(700_000), "small": [torch.randn(64) for _ in range(20)]}
    path = take(tmp_path, want)
    files = sorted(
        (os.path.join(root, f) for root, _, names in os.walk(path) for f in names
         if not f.startswith(".")),
        key=os.path.getsize,
    )
    doomed = files[-1] if victim == "big" else files[0]
    with open(doomed, "r+b") as f:
        f.truncate(os.path.getsize(doomed) - 8)
    with pytest.raises(SnapshotCorruptError, match="truncated") as info:
        restore(path, {"h": Holder(zeros_like_state(want))})
    assert os.path.basename(doomed) in str(info.value)


def test_each_file_is_opened_once_in_offset_order(tmp_path, monkeypatch):
    want = {"small": [torch.full((256,), float(i)) for i in range(40)]}
    path = take(tmp_path, want)
    opened = collections.Counter()
    real_open = os.open

    def counting_open(p, *args, **kwargs):
        opened[p] += 1
        return real_open(p, *args, **kwargs)

    offsets = []
    real_preadv = os.preadv

    def recording_preadv(fd, bufs, offset):
        offsets.append(offset)
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "preadv", recording_preadv)
    got = Holder(zeros_like_state(want))
    restore(path, {"h": got})
    assert_identical(got.state, want)
    data_files = {p: n for p, n in opened.items() if not os.path.basename(p).startswith(".")}
    assert data_files and set(data_files.values()) == {1}
    assert len(offsets) == 40 and offsets == sorted(offsets)


def _entry(location, replicated=False):
    return TensorEntry(location=location, serializer="buffer_protocol", dtype="torch.float32",
                       shape=[2], replicated=replicated)


def test_manifest_for_rank_matches_torchsnapshots_without_copying_it():
    manifest = {
        "0/m": DictEntry(keys=["w", "r", "n"]),
        "0/m/w": _entry("0/m/w"),
        "0/m/r": _entry("replicated/m/r", replicated=True),
        "0/m/n": PrimitiveEntry.from_object(3),
        "1/m": DictEntry(keys=["w", "r", "n"]),
        "1/m/w": _entry("1/m/w"),
        "1/m/n": PrimitiveEntry.from_object(4),
        "0/o": ObjectEntry(location="0/o", serializer="torch_save", obj_type="set", replicated=False),
        "1/o": ObjectEntry(location="1/o", serializer="torch_save", obj_type="set", replicated=False),
    }
    metadata = SnapshotMetadata(version="0.0.0", world_size=2, manifest=manifest)
    for rank in (0, 1):
        ours = manifest_for_rank(metadata, rank)
        theirs, _ = get_manifest_for_rank(metadata=metadata, rank=rank)
        assert ours == theirs
        assert ours["m/r"] is manifest["0/m/r"]  # shared, not deep-copied
        assert manifest_for_rank(metadata, rank, key="o") == {"o": theirs["o"]}
    assert manifest_for_rank(metadata, 2) is None  # a new rank: torchsnapshot's own handling


def snapshot_pointing_outside(tmp_path, numel: int) -> str:
    """A snapshot of ``{"w": zeros(numel)}`` whose manifest sends "w" to a file beside dirpath."""
    import json

    (tmp_path / "secret.bin").write_bytes(b"\x01" * 4 * numel)
    path = take(tmp_path / "snaps", {"w": torch.zeros(numel)})
    meta_path = tmp_path / "snaps" / "epoch_0_step_1" / ".snapshot_metadata"
    meta = json.loads(meta_path.read_text())
    (entry,) = [e for k, e in meta["manifest"].items() if k.endswith("/w")]
    entry["location"], entry["byte_range"] = "../../secret.bin", None
    meta_path.write_text(json.dumps(meta))
    return path


def test_a_manifest_naming_a_file_outside_the_snapshot_is_refused(tmp_path):
    path = snapshot_pointing_outside(tmp_path, 1024)
    target = torch.full((1024,), 7.0)
    with pytest.raises(SnapshotCorruptError, match="outside the snapshot"):
        restore(path, {"h": Holder({"w": target})})
    assert torch.equal(target, torch.full((1024,), 7.0))  # nothing was read into it


def test_torchsnapshots_own_reader_refuses_a_file_outside_the_snapshot_too(tmp_path):
    path = snapshot_pointing_outside(tmp_path, 16)
    # A float64 target: not read directly, so the file is asked of the storage plugin.
    with pytest.raises(SnapshotCorruptError, match="outside the snapshot"):
        restore(path, {"h": Holder({"w": torch.zeros(16, dtype=torch.float64)})})
