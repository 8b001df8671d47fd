"""The plugin's own engine end to end: what the saver writes (format.writer through the store)
restore reads back bit for bit (format.reader), straight into the target tensors where it can,
each file opened once per key; damage and escaping locations are refused before anything is read.

Entry kinds against stock torchsnapshot and torchtnt: tests/test_interop_kinds.py; the format
modules alone: tests/test_format_writer.py, tests/test_format_reader.py."""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest
import torch

from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import (
    SnapshotCorruptError,
    StateMismatchError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.format.checksums import record_views
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.format.torchsnapshot.common import flat_bytes
from tnt_snapshot_plugin.restoring import restore
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.stores import fileio
from toy import Holder
from varied import assert_identical, varied_state, zeros_like_state


def take(dirpath, state, *, async_snapshot=False) -> str:
    """``{"h": Holder(state)}`` snapshotted by the saver at step 1; the snapshot's path."""
    saver = Snapshotter(str(dirpath), SnapshotConfig.build(async_snapshot=async_snapshot))
    saver.train_start(["h"], 0, 0)
    assert saver.save(0, 1, {"h": Holder(state)})
    saver.train_end(0, 1, lambda intra_epoch: {})
    return str(dirpath / "epoch_0_step_1")


@pytest.mark.parametrize("async_snapshot", [False, True], ids=["sync", "async"])
def test_every_kind_of_entry_restores_bitwise_into_the_targets_tensors(tmp_path, async_snapshot):
    want = varied_state(0)
    path = take(tmp_path, want, async_snapshot=async_snapshot)
    target = zeros_like_state(want)
    in_place = target["big"], target["small"][7], target["transposed"]
    got = Holder(target)
    restore(path, {"h": got})
    assert_identical(got.state, want)
    # loaded into the tensors the stateful held, non-contiguous included
    assert (got.state["big"], got.state["small"][7], got.state["transposed"]) == in_place
    assert not got.state["transposed"].is_contiguous()


@pytest.mark.parametrize("async_snapshot", [False, True], ids=["sync", "async"])
def test_later_snapshots_of_an_unchanged_layout_reuse_the_plan_and_restore_their_own_values(tmp_path, async_snapshot):
    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=async_snapshot))
    saver.train_start(["h"], 0, 0)

    def state(step: int) -> dict:  # the same layout at every step, new values
        g = torch.Generator().manual_seed(step)
        return {
            "small": [torch.randn(64, generator=g) for _ in range(20)],
            "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "big": torch.randn(700_000, generator=g),
            "step": step,
            "objects": {"name": f"run {step}", "set": {step}},
            "layer": {f"w{i}": torch.randn(3, 8 + i, generator=g) for i in range(12)},  # a dict: one arena
        }

    holder = Holder(state(0))
    wanted = {}
    for step in (1, 2, 3):
        holder.state = state(step)
        assert saver.save(0, step, {"h": holder})
        saver.wait()
        wanted[step] = state(step)
    saver.train_end(0, 3, lambda intra_epoch: {})
    plans = saver._writer.encoder.plans
    assert plans.hits == 2 and plans.misses == 1
    # asynchronous: the packed tensors lie end to end in the staging arena, written as one run
    assert plans.runs == (2 if async_snapshot else 0)
    assert plans.gathered == 0  # its packs mix dtypes
    for step, want in wanted.items():
        got = Holder(zeros_like_state(want))
        restore(str(tmp_path / f"epoch_0_step_{step}"), {"h": got})
        assert_identical(got.state, want)


@pytest.mark.parametrize("where", ["local disk", "memory store"])
def test_synchronous_packs_are_gathered_into_one_buffer_only_where_the_store_has_copied_them(tmp_path, where):
    """A synchronous snapshot's packs of model parameters (each its own memory) are copied
    into one reused buffer where the store has taken the bytes before the next pack is planned
    (local disk: into the page cache); a store that reads them later (the memory store writes
    each file on an I/O thread) gets a view a tensor. Either way each snapshot restores its own
    values."""
    import uuid

    from tnt_snapshot_plugin.testing import MemoryStore, register, unregister

    name = f"gather-{uuid.uuid4().hex[:8]}"
    dirpath = str(tmp_path) if where == "local disk" else register(name, MemoryStore())
    try:
        saver = Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=False))
        saver.train_start(["model"], 0, 0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(200)])  # 400 tensors: one pack
        wanted = {}
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            assert saver.save(0, step, {"model": model})
            wanted[step] = {k: v.clone() for k, v in model.state_dict().items()}
        saver.train_end(0, 3, lambda intra_epoch: {})
        plans = saver._writer.encoder.plans
        assert (plans.misses, plans.hits) == (1, 2)
        assert plans.gathered == (2 if where == "local disk" else 0)  # one pack a snapshot
        for step, want in wanted.items():
            target = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(200)])
            restore(f"{dirpath}/epoch_0_step_{step}", {"model": target})
            got = target.state_dict()
            assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        unregister(name)


def test_an_int_too_long_for_str_is_refused_before_it_is_written(tmp_path):
    """The format stores an int as its decimal text; Python refuses str() of one over 4300
    digits (sys.get_int_max_str_digits), and torch.load(weights_only=True) cannot read one back
    pickled (LONG4). Such a state is refused with a typed error naming the entry and what to do;
    the older snapshot stays the latest."""
    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=False))
    saver.train_start(["h"], 0, 0)
    assert saver.save(0, 1, {"h": Holder({"n": 10**4000, "small": 12})})  # 4001 digits: fine
    with pytest.raises(UnrestorableStateError, match=r"'h/n' holds an int of about 600\d decimal digits.*to_bytes"):
        saver.save(0, 2, {"h": Holder({"n": 10**6000, "small": 12})})
    assert sorted(os.listdir(tmp_path)) == [".tnt_snapshot.lock", "epoch_0_step_1"]
    got = Holder({"n": 0, "small": 0})
    restore(str(tmp_path / "epoch_0_step_1"), {"h": got})
    assert got.state == {"n": 10**4000, "small": 12}


def test_targets_of_another_shape_get_the_saved_value(tmp_path):
    saved = {"a": torch.arange(12.0), "b": torch.arange(6, dtype=torch.int32)}
    path = take(tmp_path, saved)
    # another shape: the reader allocates what was saved; load_state_dict decides
    got = Holder({"a": torch.zeros(3, 4), "b": torch.zeros(3, 2, dtype=torch.int32)})
    restore(path, {"h": got})
    assert_identical(got.state, saved)


def test_a_target_of_another_dtype_is_a_state_mismatch_and_nothing_is_loaded(tmp_path):
    saved = {"a": torch.arange(12.0), "b": torch.arange(6, dtype=torch.int32)}
    path = take(tmp_path, saved)
    got = Holder({"a": torch.zeros(12, dtype=torch.float64), "b": torch.zeros(6, dtype=torch.int32)})
    with pytest.raises(StateMismatchError, match=r"'h/a'.*torch\.float32.*torch\.float64.*not cast"):
        restore(path, {"h": got})
    assert not got.state["a"].any() and not got.state["b"].any()


@pytest.mark.parametrize("victim", ["big", "packed"])
def test_a_truncated_file_is_an_error_naming_it(tmp_path, victim):
    want = {"big": torch.randn(2_000_000), "small": [torch.randn(64) for _ in range(20)]}
    path = take(tmp_path, want)
    files = sorted(
        (os.path.join(root, f) for root, _, names in os.walk(path) for f in names if not f.startswith(".")),
        key=os.path.getsize,
    )
    doomed = files[-1] if victim == "big" else files[0]
    with open(doomed, "r+b") as f:
        f.truncate(os.path.getsize(doomed) - 8)
    with pytest.raises(SnapshotCorruptError) as info:
        restore(path, {"h": Holder(zeros_like_state(want))})
    assert os.path.relpath(doomed, path) in str(info.value)


def test_each_file_is_opened_once_per_key_and_read_in_offset_order(tmp_path, monkeypatch):
    want = {"small": [torch.full((256,), float(i)) for i in range(40)]}
    path = take(tmp_path, want)
    opened: collections.Counter = collections.Counter()
    real_open = os.open
    offsets: list[int] = []
    real_preadv = os.preadv

    def counting_open(p, *args, **kwargs):
        opened[p] += 1
        return real_open(p, *args, **kwargs)

    def recording_preadv(fd, bufs, offset):
        offsets.append(offset)
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "preadv", recording_preadv)
    got = Holder(zeros_like_state(want))
    restore(path, {"h": got})
    assert_identical(got.state, want)
    data_files = {p: n for p, n in opened.items() if not os.path.basename(p).startswith(".")}
    # One packed file, holding the 40 tensors and the RNG state (restored as a key of its own):
    # opened once to ask the kernel to read it ahead, then once per key, each key's reads in one call.
    assert len(data_files) == 1 and set(data_files.values()) == {3}
    assert offsets and offsets == sorted(offsets)


def snapshot_pointing_outside(tmp_path, numel: int) -> str:
    """A snapshot of ``{"w": zeros(numel)}`` whose manifest sends "w" to a file beside dirpath."""
    (tmp_path / "secret.bin").write_bytes(b"\x01" * 4 * numel)
    path = take(tmp_path / "snaps", {"w": torch.zeros(numel)})
    meta_path = tmp_path / "snaps" / "epoch_0_step_1" / ".snapshot_metadata"
    meta = json.loads(meta_path.read_text())
    (entry,) = [e for k, e in meta["manifest"].items() if k.endswith("/w")]
    entry["location"], entry["byte_range"] = "../../secret.bin", None
    meta_path.write_text(json.dumps(meta))
    # ... with its checksum recorded to match (a crafted snapshot): the path itself is refused
    index_path = meta_path.with_name(INDEX_FNAME)
    index = json.loads(index_path.read_text())
    index["checksums"][".snapshot_metadata"] = record_views([memoryview(meta_path.read_bytes())])
    del index["seal"]
    index_path.write_bytes(seal_index(index))  # sealed again: only the manifest's check is left
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["in-place", "new-tensor"])
def test_a_manifest_naming_a_file_outside_the_snapshot_is_refused(tmp_path, dtype):
    path = snapshot_pointing_outside(tmp_path, 1024)
    target = torch.full((1024,), 7.0, dtype=dtype)
    with pytest.raises(SnapshotCorruptError, match="outside the snapshot"):
        restore(path, {"h": Holder({"w": target})})
    assert torch.equal(target, torch.full((1024,), 7.0, dtype=dtype))  # nothing was read into it


def buffers_over(parts: list[bytes], kind: str, writable: bool = False) -> list:
    """Flat byte buffers holding ``parts``: memoryviews, or (as the format writer and reader
    hand them to the stores) numpy arrays over tensors of several dtypes and shapes."""
    if kind == "memoryview":
        return [memoryview(bytearray(p) if writable else p) for p in parts]
    dtypes = [torch.uint8, torch.bfloat16, torch.int16]
    out = []
    for i, p in enumerate(parts):
        dtype = dtypes[i % 3] if len(p) % 2 == 0 else torch.uint8
        tensor = torch.frombuffer(bytearray(p), dtype=torch.uint8).view(dtype)
        out.append(flat_bytes(tensor.reshape(1, -1) if i % 4 == 0 else tensor))
    return out


BUFFER_KINDS = ["memoryview", "numpy over tensors"]


def test_a_failure_late_in_planning_waits_for_the_files_already_being_written(tmp_path, monkeypatch):
    """Full packs are written while the rest of the state is planned; when the plan then fails
    (a dtype the format cannot hold, last in the state), the snapshot waits for the files already
    being written before it removes its staging directory: none is written into a removed one."""
    real_start = fileio.start_write
    ended = []

    def slow_start(path, data):
        finish = real_start(path, data)

        def slow_finish():
            time.sleep(0.05)
            finish()
            ended.append((time.perf_counter(), os.path.exists(path)))

        return slow_finish

    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=False, on_save_error="raise"))
    saver.train_start(["h"], 0, 0)
    saver.save(0, 1, {"h": Holder({"w": torch.ones(3)})})
    state = {f"t{i}": torch.full((4096,), float(i)) for i in range(3000)}  # 16 KiB each: 12 packs
    state["z"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(fileio, "start_write", slow_start)
    with pytest.raises(UnrestorableStateError, match="float8"):  # the state's fault: never retried
        saver.save(0, 2, {"h": Holder(state)})
    returned = time.perf_counter()
    assert len(ended) >= 1  # packs were written before the plan reached the last tensor
    assert all(at < returned and existed for at, existed in ended)
    assert sorted(os.listdir(tmp_path)) == [".tnt_snapshot.lock", "epoch_0_step_1"]


@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_gathered_writes_survive_short_writes_and_more_buffers_than_iov_max(tmp_path, monkeypatch, kind):
    """Packed tensors are written with writev straight from their memory: the kernel may write
    less than asked (even mid-buffer), and takes at most IOV_MAX buffers per call."""
    parts = [bytes([i % 251]) * (1 + i % 37) for i in range(3000)]
    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):
        calls.append(len(buffers))
        assert len(buffers) <= 1024
        if len(calls) % 2:
            first = memoryview(buffers[0])
            return real_writev(fd, [first[: max(1, first.nbytes // 2)]])
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", short_writev)
    path = tmp_path / "f"
    fileio.write_durably(str(path), buffers_over(parts, kind))
    assert path.read_bytes() == b"".join(parts)
    assert max(calls) == 1024 and len(calls) == 6  # halves and the rest, three times


@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_packed_reads_take_one_preadv_per_run_and_survive_short_reads(tmp_path, monkeypatch, kind):
    """Tensors packed end to end are read with one ``preadv`` per run of adjacent ranges (at
    most IOV_MAX buffers), straight into their targets; the kernel may return less than asked."""
    parts = [bytes([i % 251]) * (1 + i % 37) for i in range(3000)]
    (tmp_path / "f").write_bytes(b"".join(parts))
    bufs = buffers_over([bytes(len(p)) for p in parts], kind, writable=True)
    reads, offset = [], 0
    for buf in bufs:
        reads.append(("f", offset, buf))
        offset += buf.nbytes
    real_preadv = os.preadv
    calls = []

    def short_preadv(fd, buffers, at):
        calls.append(len(buffers))
        assert len(buffers) <= 1024
        if len(calls) % 2:
            first = memoryview(buffers[0])
            return real_preadv(fd, [first[: max(1, first.nbytes // 2)]], at)
        return real_preadv(fd, buffers, at)

    monkeypatch.setattr(os, "preadv", short_preadv)
    fileio.preadv_into(str(tmp_path), reversed(reads), error=SnapshotCorruptError)
    assert b"".join(bytes(b) for b in bufs) == b"".join(parts)
    assert len(calls) == 6 and max(calls) == 1024  # three runs, each a short read and the rest


def test_many_files_are_read_a_few_at_once_and_each_buffer_is_reported_done_once(tmp_path):
    """``preadv_into`` reads up to READ_THREADS files at once (each in offset order) and calls
    ``done`` on the reading thread with the buffers each ``preadv`` filled: every index once,
    its bytes already in place."""
    # enough bytes for READ_THREADS threads (PARALLEL_READ_MIN_BYTES each), more files than that
    files = {f"f{i}": bytes([i]) * (3 * fileio.PARALLEL_READ_MIN_BYTES // 4 + i) for i in range(12)}
    assert len(files) > fileio.READ_THREADS
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    reads = []
    for name, data in files.items():  # each file in two adjacent halves: one run, one preadv
        half = len(data) // 2
        reads += [(name, 0, memoryview(bytearray(half))), (name, half, memoryview(bytearray(len(data) - half)))]
    seen: list[int] = []
    threads = set()

    def done(indices):
        name = threading.current_thread().name
        if name not in threads:
            threads.add(name)
            time.sleep(0.05)  # holds this thread: the other files go to the other threads
        for i in indices:
            name, offset, buf = reads[i]
            assert bytes(buf) == files[name][offset:offset + buf.nbytes]
        seen.extend(indices)

    total = fileio.preadv_into(str(tmp_path), reads, error=SnapshotCorruptError, done=done)
    assert total == sum(map(len, files.values()))
    assert sorted(seen) == list(range(len(reads)))
    assert len(threads) == fileio.READ_THREADS and all(t.startswith("tnt-snapshot-read") for t in threads)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_failed_read_or_done_stops_the_other_reads_and_raises(tmp_path, threads):
    size = fileio.PARALLEL_READ_MIN_BYTES
    for i in range(8):
        (tmp_path / f"f{i}").write_bytes(bytes([i + 1]) * size)
    (tmp_path / "f0").write_bytes(bytes(size - 1))  # truncated: read first

    def reads():
        return [(f"f{i}", 0, memoryview(bytearray(size))) for i in range(8)]

    with pytest.raises(SnapshotCorruptError, match=r"f0 ends at byte \d+, before the end"):
        fileio.preadv_into(str(tmp_path), reads(), error=SnapshotCorruptError, threads=threads)

    class Mismatch(Exception):
        pass

    calls = []

    def done(indices):
        calls.append(indices)
        raise Mismatch(indices)

    (tmp_path / "f0").write_bytes(bytes([1]) * size)
    got = reads()
    with pytest.raises(Mismatch):
        fileio.preadv_into(str(tmp_path), got, error=SnapshotCorruptError, done=done, threads=threads)
    # each reading thread stopped at its first done(): the files after those were never read
    assert 1 <= len(calls) <= threads
    assert sum(1 for _f, _o, buf in got if buf[0]) <= threads


def test_a_restore_leaves_no_reading_threads_behind(tmp_path, monkeypatch):
    want = {f"big{i}": torch.randn(4_000_000) for i in range(4)}
    path = take(tmp_path, want)
    got = Holder(zeros_like_state(want))
    started = []
    real = fileio.ReadThreads.submit
    monkeypatch.setattr(fileio.ReadThreads, "submit", lambda self, *a: started.append(1) or real(self, *a))
    restore(path, {"h": got})
    assert started  # the restore read in parallel
    assert_identical(got.state, want)
    deadline = time.monotonic() + 10
    while any(t.name.startswith("tnt-snapshot-read") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)
