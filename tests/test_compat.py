"""The plugin's work-arounds for torchsnapshot bugs, each shown against real torchsnapshot."""

from __future__ import annotations

import random

from tnt_snapshot_plugin.app_state import RNGState
from tnt_snapshot_plugin.compat import Snapshot
from toy import Holder


def test_torchsnapshot_no_longer_draws_from_the_global_python_rng(tmp_path):
    # Unpatched, every take/restore called random.randint on the global generator, so a
    # snapshot changed the training's random stream (and an async one did so at a random moment).
    random.seed(3)
    before = random.getstate()
    Snapshot.take(str(tmp_path / "snap"), {"rng": RNGState()})
    assert random.getstate() == before

    random.seed(99)
    Snapshot(str(tmp_path / "snap")).restore({"rng": RNGState()})
    assert random.getstate() == before


# ------------------------------------------------------------------------------------------------
# Speed work-arounds (items 4-6): same snapshots, read by torchsnapshot itself; each file read once


def _varied_state():
    import torch

    return {
        "t": torch.arange(6.0).reshape(2, 3),
        "big": torch.ones(1_100_000),  # over the pack size: a file of its own
        "ints": {0: torch.tensor(3), 1: [1, "two", True, None, 2.5, b"\x00\x01"]},
        "obj": {"a", "b"},
    }


def _assert_same(got, want):
    import torch

    assert got.keys() == want.keys()
    assert torch.equal(got["t"], want["t"]) and torch.equal(got["big"], want["big"])
    assert torch.equal(got["ints"][0], want["ints"][0]) and got["ints"][1] == want["ints"][1]
    assert got["obj"] == want["obj"]


def test_metadata_is_plain_json_that_torchsnapshot_itself_reads(tmp_path):
    import json

    import torchsnapshot

    from tnt_snapshot_plugin.storage import LocalStore

    url = LocalStore(str(tmp_path)).torchsnapshot_url("epoch_0_step_1")
    want = _varied_state()
    Snapshot.take(url, {"h": Holder(want)})
    text = (tmp_path / "epoch_0_step_1" / ".snapshot_metadata").read_text()
    assert json.loads(text)["manifest"]
    by_torchsnapshot = Holder({})
    torchsnapshot.Snapshot(str(tmp_path / "epoch_0_step_1")).restore({"h": by_torchsnapshot})
    _assert_same(by_torchsnapshot.state, want)
    by_plugin = Holder({})
    Snapshot(url).restore({"h": by_plugin})
    _assert_same(by_plugin.state, want)


def test_yaml_metadata_of_other_versions_is_still_read(tmp_path):
    import json

    import torchsnapshot
    import yaml

    want = _varied_state()
    path = tmp_path / "snap"
    torchsnapshot.Snapshot.take(str(path), {"h": Holder(want)})
    meta = path / ".snapshot_metadata"
    meta.write_text(yaml.safe_dump(json.loads(meta.read_text())))  # as YAML, not JSON
    got = Holder({})
    Snapshot(str(path)).restore({"h": got})
    _assert_same(got.state, want)


def test_restore_reads_each_file_once_whatever_the_number_of_keys(tmp_path, monkeypatch):
    import collections

    import torch

    from tnt_snapshot_plugin import storage

    url = "tntfs://" + str(tmp_path / "snap")
    keys = {f"k{i}": Holder({"w": torch.full((300_000,), float(i))}) for i in range(4)}
    Snapshot.take(url, keys)
    reads = collections.Counter()
    real = storage._read_file

    def counting(path, byte_range):
        reads[(path, byte_range)] += 1
        return real(path, byte_range)

    real_map = storage._map_file

    def counting_map(path, byte_range):
        reads[(path, byte_range)] += 1
        return real_map(path, byte_range)

    monkeypatch.setattr(storage, "_read_file", counting)
    monkeypatch.setattr(storage, "_map_file", counting_map)
    # float64 targets for float32 tensors: read by torchsnapshot's reader, not straight into them
    fresh = {f"k{i}": Holder({"w": torch.zeros(300_000, dtype=torch.float64)}) for i in range(4)}
    Snapshot(url).restore(fresh)
    assert all(torch.equal(fresh[k].state["w"], keys[k].state["w"]) for k in keys)
    data_reads = {k: n for k, n in reads.items() if not k[0].endswith(".snapshot_metadata")}
    assert len(data_reads) == 4 and set(data_reads.values()) == {1}, reads  # unpatched: 4 each


def test_odd_sized_bfloat16_and_empty_tensors_can_be_saved(tmp_path):
    # Unpatched, take() raised on a bfloat16 tensor of an odd number of elements (its bytes were
    # viewed as float32, losing the last two) and on an empty tensor of 2+ dimensions.
    import torch
    import torchsnapshot

    want = {
        "odd": torch.randn(5, 3).to(torch.bfloat16),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    Snapshot.take(str(tmp_path / "snap"), {"h": Holder(want)})
    got = Holder({})  # nothing to load into: torchsnapshot allocates each tensor
    torchsnapshot.Snapshot(str(tmp_path / "snap")).restore({"h": got})
    assert got.state.keys() == want.keys()
    for key, tensor in want.items():
        assert got.state[key].dtype == tensor.dtype and torch.equal(got.state[key], tensor)


def test_plugin_protocols_resolve_without_the_entry_point_scan(monkeypatch):
    import torchsnapshot.storage_plugin as lookup

    from tnt_snapshot_plugin import storage

    def no_scan(*args, **kwargs):
        raise AssertionError("entry points scanned")

    monkeypatch.setattr(lookup, "entry_points", no_scan)
    plugin = lookup.url_to_storage_plugin("tntfs:///tmp/x")
    assert type(plugin).__name__ == "_FSPlugin" and plugin.root == "/tmp/x"
    assert type(lookup.url_to_storage_plugin("/tmp/y")).__name__ == "FSStoragePlugin"
    assert storage.fs_storage_factory  # the factory the entry point names


def test_packed_small_tensors_are_written_from_the_tensors_without_a_slab_copy(tmp_path, monkeypatch):
    # torchsnapshot copies every small tensor into one slab buffer (one asyncio task each) before
    # writing it; the plugin's writes hand the tensors' own bytes to writev.
    import torch
    import torchsnapshot

    from tnt_snapshot_plugin import storage

    gathered = []
    real = storage._write_gathered

    def spy(fd, views):
        gathered.append(len(views))
        return real(fd, views)

    monkeypatch.setattr(storage, "_write_gathered", spy)
    want = {f"p{i}": torch.full((100 + i,), float(i)) for i in range(300)}
    want["bf16"] = torch.randn(7).to(torch.bfloat16)
    url = storage.LocalStore(str(tmp_path)).torchsnapshot_url("snap")
    with storage.recording(storage.WriteRecorder()) as rec:
        Snapshot.take(url, {"h": Holder(want)})
    assert gathered == [301]  # one file, written straight from the 301 tensors
    (tmp_path / "snap" / ".snapshot_metadata").write_bytes(rec.metadata)
    got = Holder({})
    torchsnapshot.Snapshot(str(tmp_path / "snap")).restore({"h": got})
    assert got.state.keys() == want.keys()
    assert all(torch.equal(got.state[k], want[k]) for k in want)


def test_gathered_writes_survive_short_writes_and_more_buffers_than_iov_max(tmp_path, monkeypatch):
    import os

    from tnt_snapshot_plugin import storage

    parts = [bytes([i % 251]) * (1 + i % 37) for i in range(3000)]
    real_writev = os.writev

    calls = []

    def short_writev(fd, buffers):  # the kernel may write less than asked, even mid-buffer
        calls.append(len(buffers))
        assert len(buffers) <= 1024
        if len(calls) % 2:
            first = memoryview(buffers[0])
            return real_writev(fd, [first[: max(1, first.nbytes // 2)]])
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", short_writev)
    path = tmp_path / "f"
    storage._write_durably(str(path), storage.Gathered([memoryview(p) for p in parts]))
    assert path.read_bytes() == b"".join(parts)
    assert max(calls) == 1024 and len(calls) == 6  # halves and the rest, three times


def test_gc_is_paused_while_training_waits_for_a_take_or_restore(tmp_path, monkeypatch):
    import gc

    import torch

    from tnt_snapshot_plugin import compat
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.restoring import restore
    from tnt_snapshot_plugin.snapshotter import Snapshotter

    seen = []

    class Probe(Holder):
        def state_dict(self):
            seen.append(gc.isenabled())
            return super().state_dict()

    assert gc.isenabled()
    with compat.gc_paused():
        with compat.gc_paused():  # nested (a restore while an async write runs)
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()

    # The real saver: its torchsnapshot take runs inside the pause.
    real_take = compat.Snapshot.take.__func__

    def take(cls, *args, **kwargs):
        seen.append(gc.isenabled())
        return real_take(cls, *args, **kwargs)

    monkeypatch.setattr(compat.Snapshot, "take", classmethod(take))
    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=False))
    saver.save(0, 1, {"h": Holder({"w": torch.ones(3)})})
    assert seen == [False] and gc.isenabled()
    # An asynchronous write runs alongside training, possibly for minutes: the collector stays on.
    background = Snapshotter(str(tmp_path / "bg"), SnapshotConfig.build(async_snapshot=True))
    background.save(0, 1, {"h": Holder({"w": torch.ones(3)})})
    background.wait()
    assert seen == [False, True]

    seen.clear()
    restore(str(tmp_path / "epoch_0_step_1"), {"h": Probe({"w": torch.zeros(3)})})
    assert seen and not any(seen) and gc.isenabled()

    gc.disable()  # a user who runs with the collector off keeps it off
    try:
        with compat.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
