"""Checksums: every payload's xxh3_64 is written into the index, and restore verifies the bytes it
reads. A byte flipped in any kind of entry (the size unchanged) is damage: restore_from_latest
falls back to the previous snapshot with a warning naming the file, and every entry then comes
from that snapshot, bit for bit."""

from __future__ import annotations

import json
import random
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tnt_snapshot_plugin import (
    SnapshotConfig,
    SnapshotCorruptError,
    SnapshotFallbackWarning,
    Snapshotter,
    restore,
    restore_from_latest,
)
from tnt_snapshot_plugin.format.checksums import ALGO, Verifier, record_views
from toy import Holder
from varied import assert_identical
from varied import zeros_like_state as zeros_like

INDEX = ".tnt_snapshot_index.json"


def model_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(2_000_000, generator=g),  # a file of its own, read straight into the target
        "small": [torch.randn(64, generator=g) for _ in range(20)],  # packed into one file
    }


def other_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        # non-contiguous targets: read into new memory, then copied (a packed range; a file of its own)
        "transposed": torch.randn(4, 6, generator=g).t(),
        "transposed_big": torch.randn(1100, 1100, generator=g).t(),  # over 4 MiB: a file of its own
        "object": {seed, seed + 1},  # pickled (torch.save)
        "step": seed,  # a primitive: in the metadata, no payload file
    }


def rng_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def write_two(dirpath: Path) -> tuple:
    """Snapshots epoch_0_step_1 and epoch_0_step_2 (seeds 1 and 2); the RNG states each saved."""
    saver = Snapshotter(str(dirpath), SnapshotConfig.build(async_snapshot=False))
    saver.train_start(["model", "other"], 0, 0)
    saved_rng = {}
    for step in (1, 2):
        seed_all(100 + step)
        saved_rng[step] = rng_states()
        saver.save(0, step, {"model": Holder(model_state(step)), "other": Holder(other_state(step))})
    saver.train_end(0, 2, lambda intra_epoch: {})
    return saved_rng


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    dirpath = tmp_path_factory.mktemp("checksums") / "run"
    saved_rng = write_two(dirpath)
    return dirpath, saved_rng


@pytest.fixture
def copy(written, tmp_path):
    import shutil

    source, saved_rng = written
    dirpath = tmp_path / "run"
    shutil.copytree(source, dirpath)
    return dirpath, saved_rng


def manifest(snapshot: Path) -> dict:
    return json.loads((snapshot / ".snapshot_metadata").read_text())["manifest"]


def payload(snapshot: Path, entry_path: str) -> tuple[Path, int, int]:
    """(file, start, end) of the bytes of manifest entry ``entry_path`` ("0/model/big", ...)."""
    entry = manifest(snapshot)[entry_path]
    location = entry.get("location") or entry["chunks"][0]["tensor"]["location"]
    file = snapshot / location
    start, end = entry.get("byte_range") or (0, file.stat().st_size)
    return file, start, end


def flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x5A
    file.write_bytes(bytes(data))


def restore_fresh(dirpath: Path, **kwargs):
    model = Holder(zeros_like(model_state(0)))
    other = Holder(zeros_like(other_state(0)))
    seed_all(999)
    result = restore_from_latest(str(dirpath), {"model": model, "other": other}, **kwargs)
    return result, model.state, other.state


def test_the_index_records_a_checksum_per_payload_and_one_per_packed_tensor(written):
    dirpath, _ = written
    snapshot = dirpath / "epoch_0_step_2"
    index = json.loads((snapshot / INDEX).read_text())
    sums = index["checksums"]
    assert set(sums) == set(index["files"]) | {".snapshot_metadata"}  # every file, the metadata too
    assert all(rec["algo"] == ALGO for rec in sums.values())
    packed_file, start, end = payload(snapshot, "0/model/small/3")
    record = sums[str(packed_file.relative_to(snapshot))]
    bounds, digests = record["bounds"], record["digests"]
    assert start in bounds and end in bounds and bounds.index(end) == bounds.index(start) + 1
    assert len(bounds) > 2 and len(digests) == 16 * (len(bounds) - 1)


def test_check_reads_verifies_each_read_of_any_kind_and_names_the_entry_of_a_mismatch():
    """The reader's batch check: numpy reads of one packed tensor (its fast path), a read of
    several tensors, a whole file as a memoryview, and a file the index does not know, each
    verified (or not) as check() would; a flipped byte in any read names its range and entry."""
    import numpy as np

    pieces = [bytes([i]) * (100 + i) for i in range(5)]
    data = b"".join(pieces)
    whole = b"w" * 77
    records = {"f": record_views([memoryview(p) for p in pieces]), "g": record_views([memoryview(whole)])}
    verifier = Verifier("snap", records, {"f": len(data), "g": len(whole)})

    def as_array(b: bytes):
        return np.frombuffer(bytearray(b), dtype=np.uint8)

    reads = [
        ("f", 100, as_array(data[100:201])),  # tensor 1 alone, as the reader reads it
        ("f", 303, as_array(data[303:406])),  # tensor 3 alone
        ("f", 0, as_array(data[:303])),  # tensors 0-2 in one read
        ("g", 0, memoryview(whole)),  # a whole file
        ("h", 0, as_array(b"not indexed")),  # no record: not checked
    ]
    names = ["t1", "t3", "t0-2", "g", "h"]
    assert verifier.check_reads(reads, [0, 1, 2, 3, 4], names) == 101 + 103 + 303 + 77
    assert verifier.check_reads(reads, [], names) == 0
    for i, (rel, start, buf) in enumerate(reads[:4]):
        damaged = bytearray(bytes(buf))
        damaged[len(damaged) // 2] ^= 1
        bad = list(reads)
        bad[i] = (rel, start, as_array(bytes(damaged)) if isinstance(buf, np.ndarray) else memoryview(damaged))
        with pytest.raises(SnapshotCorruptError, match=rf"snap/{rel}\b.*\(entry {names[i]}\)"):
            verifier.check_reads(bad, range(5), names)


@pytest.mark.parametrize("form", ["bounds and digests", "ranges (written before 2026-12)"])
def test_each_packed_tensor_is_verified_on_its_own_in_either_index_form(form):
    pieces = [bytes([i]) * (100 + i) for i in range(5)]  # five tensors packed end to end
    record = record_views([memoryview(p) for p in pieces])
    if form.startswith("ranges"):
        bounds, digests = record.pop("bounds"), record.pop("digests")
        record["ranges"] = [[bounds[i], bounds[i + 1], digests[16 * i:16 * i + 16]] for i in range(5)]
    data = b"".join(pieces)
    verifier = Verifier("snap", {"f": record}, {"f": len(data)})
    verifier.check("f", 100, data[100:201])  # tensor 1 alone
    verifier.check("f", 0, data[:303])  # tensors 0-2 in one read
    assert verifier.verified_bytes == 101 + 303
    damaged = bytearray(data)
    damaged[150] ^= 1  # inside tensor 1
    with pytest.raises(SnapshotCorruptError, match="snap/f: bytes 100-201"):
        verifier.check("f", 100, bytes(damaged[100:201]))
    with pytest.raises(SnapshotCorruptError, match="snap/f: bytes 100-201"):
        verifier.check("f", 0, bytes(damaged[:303]))


def test_a_pack_written_as_runs_of_tensors_gets_the_record_of_one_view_a_tensor():
    """An asynchronous snapshot hands a pack over as a few runs of tensors that lie end to end in
    its staging arena (``bounds`` says where each tensor ends): the record must be the one the
    same tensors give one by one, across runs and across the pieces hashed in the CPU's cache."""
    from tnt_snapshot_plugin.format.checksums import HASH_PIECE

    rng = random.Random(3)
    sizes = [rng.randrange(1, 3 * HASH_PIECE // 2) for _ in range(12)] + [1, 2, 3]
    pieces = [rng.randbytes(n) for n in sizes]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    runs = [b"".join(pieces[:5]), pieces[5], b"".join(pieces[6:])]  # a run, a tensor alone, a run
    got = record_views([memoryview(r) for r in runs], bounds)
    assert got == record_views([memoryview(p) for p in pieces])
    with pytest.raises(ValueError, match="tensors end at byte"):
        record_views([memoryview(r) for r in runs[:2]], bounds)  # views short of the tensors
    with pytest.raises(ValueError, match="do not start where its tensors do"):
        record_views([memoryview(runs[0][:-1]), memoryview(runs[0][-1:] + runs[1])], bounds)


ENTRIES = {
    # entry kind -> manifest path of the entry whose bytes are flipped
    "tensor in a file of its own, read into its target": "0/model/big",
    "packed small tensor, read into its target": "0/model/small/7",
    "packed tensor, non-contiguous target (read, then copied)": "0/other/transposed",
    "tensor in a file of its own, non-contiguous target": "0/other/transposed_big",
    "pickled object": "0/other/object",
    "RNG state": None,  # the RNG state's payload (found below)
}


def test_a_flipped_digit_in_the_metadata_falls_back(copy):
    """Primitive values (here ``step``) live in the metadata itself: it is checksummed too."""
    dirpath, _ = copy
    metadata = dirpath / "epoch_0_step_2" / ".snapshot_metadata"
    text = metadata.read_text()
    assert '"serialized_value": "2"' in text
    metadata.write_text(text.replace('"serialized_value": "2"', '"serialized_value": "7"', 1))
    with pytest.warns(SnapshotFallbackWarning, match=r"skipping damaged snapshot \S*epoch_0_step_2: .*snapshot_metadata.*checksum"):
        result, model, other = restore_fresh(dirpath)
    assert result == str(dirpath / "epoch_0_step_1")
    assert other["step"] == 1


def test_a_flipped_digit_in_the_metadata_is_caught_restoring_by_path(copy):
    """restore(path) checks the metadata's checksum too (it restored step 7 silently)."""
    dirpath, _ = copy
    newest = dirpath / "epoch_0_step_2"
    metadata = newest / ".snapshot_metadata"
    metadata.write_text(metadata.read_text().replace('"serialized_value": "2"', '"serialized_value": "7"', 1))
    other = Holder(zeros_like(other_state(0)))
    with pytest.raises(SnapshotCorruptError, match=r"epoch_0_step_2\b.*\.snapshot_metadata.*checksum"):
        restore(str(newest), {"model": Holder(zeros_like(model_state(0))), "other": other})
    assert_identical(other.state, zeros_like(other_state(0)))  # nothing was loaded


def rng_entry(snapshot: Path) -> str:
    paths = [p for p, e in manifest(snapshot).items() if p.startswith("0/rng_state/") and e.get("location")]
    assert paths, "the RNG state has a payload file"
    return sorted(paths)[0]


@pytest.mark.parametrize("kind", list(ENTRIES))
def test_a_flipped_byte_in_any_entry_falls_back_to_the_previous_snapshot_bitwise(copy, kind):
    dirpath, saved_rng = copy
    newest = dirpath / "epoch_0_step_2"
    entry = ENTRIES[kind] or rng_entry(newest)
    file, start, end = payload(newest, entry)
    size = file.stat().st_size
    flip(file, (start + end) // 2)
    assert file.stat().st_size == size  # the size index alone cannot see it

    rel = str(file.relative_to(newest))
    with pytest.warns(SnapshotFallbackWarning, match=r"skipping damaged snapshot \S*epoch_0_step_2: ") as caught:
        result, model, other = restore_fresh(dirpath)
    damaged = [w for w in caught if "skipping damaged snapshot" in str(w.message)]
    assert len(damaged) == 1 and rel in str(damaged[0].message) and "checksum" in str(damaged[0].message)
    assert result == str(dirpath / "epoch_0_step_1")
    # every entry, the ones loaded before the damage was met included, is the older snapshot's
    assert_identical(model, model_state(1))
    assert_identical(other, other_state(1))
    torch_rng, py_rng, np_rng = rng_states()
    assert torch.equal(torch_rng, saved_rng[1][0])
    assert py_rng == saved_rng[1][1]
    assert np.array_equal(np_rng, saved_rng[1][2])


def test_a_flipped_byte_in_a_pack_an_async_snapshot_wrote_as_one_run_falls_back(tmp_path):
    """Asynchronous snapshots after the first write a pack of a module's small tensors straight
    from the staging arena, as one buffer: each tensor still has its own checksum."""

    def layer(step: int) -> dict:  # a dict of small tensors: staged into one arena
        g = torch.Generator().manual_seed(step)
        return {f"w{i}": torch.randn(8, 8, generator=g) for i in range(40)}

    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=True))
    saver.train_start(["layer"], 0, 0)
    for step in (1, 2, 3):
        assert saver.save(0, step, {"layer": Holder(layer(step))})
        saver.wait()
    saver.train_end(0, 3, lambda intra_epoch: {})
    assert saver._writer.encoder.plans.runs == 2  # steps 2 and 3: one pack each, written as one run
    newest = tmp_path / "epoch_0_step_3"
    file, start, end = payload(newest, "0/layer/w17")
    assert json.loads((newest / INDEX).read_text())["checksums"][str(file.relative_to(newest))]["bounds"][17:19] == [
        start, end
    ]
    flip(file, start + 3)
    got = Holder({k: torch.zeros_like(v) for k, v in layer(0).items()})
    with pytest.warns(SnapshotFallbackWarning, match=r"skipping damaged snapshot \S*epoch_0_step_3: .*checksum"):
        assert restore_from_latest(str(tmp_path), {"layer": got}) == str(tmp_path / "epoch_0_step_2")
    assert_identical(got.state, layer(2))
    with pytest.raises(SnapshotCorruptError, match=rf"batched/0-0 \(entry layer/w17\): bytes {start}-{end} "):
        restore(str(newest), {"layer": Holder({k: torch.zeros_like(v) for k, v in layer(0).items()})})


def test_restoring_a_damaged_snapshot_by_path_names_the_file_and_the_entry(copy):
    dirpath, _ = copy
    newest = dirpath / "epoch_0_step_2"
    file, start, end = payload(newest, "0/model/big")
    flip(file, start + 5)
    with pytest.raises(SnapshotCorruptError) as info:
        restore(str(newest), {"model": Holder(zeros_like(model_state(0))), "other": Holder(zeros_like(other_state(0)))})
    message = str(info.value)
    assert str(file.relative_to(newest)) in message and "model/big" in message


def test_snapshots_without_checksums_still_restore(copy):
    dirpath, _ = copy
    for snapshot in dirpath.glob("epoch_*"):
        index = json.loads((snapshot / INDEX).read_text())
        del index["checksums"], index["seal"]  # as indexes written before either existed
        (snapshot / INDEX).write_text(json.dumps(index))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, model, other = restore_fresh(dirpath)
    assert result == str(dirpath / "epoch_0_step_2")
    assert_identical(model, model_state(2))
    assert_identical(other, other_state(2))


def test_the_cli_verify_finds_the_flipped_file(copy):
    from tnt_snapshot_plugin.cli import check_snapshot, survey
    from tnt_snapshot_plugin.stores import LocalStore

    dirpath, _ = copy
    newest = dirpath / "epoch_0_step_2"
    file, start, _ = payload(newest, "0/model/small/2")
    flip(file, start)
    infos = {i.name: i for i in survey(LocalStore(str(dirpath)), checksums=True)}
    assert not infos["epoch_0_step_1"].problems
    problems = infos["epoch_0_step_2"].problems
    assert any(str(file.relative_to(newest)) in p and ALGO in p for p in problems), problems
    assert check_snapshot  # the function verify runs per snapshot


def test_only_damage_read_while_loading_counts_as_corruption():
    """What restore collects while loading: damaged bytes are corruption, agreed by every rank
    (restore_from_latest falls back); an object store that went away is raised as it is."""
    from tnt_snapshot_plugin import StorageUnavailableError
    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.restoring import agree_on_read_errors as _agree_on_read_errors

    solo = Collectives(None)
    _agree_on_read_errors("p", [], solo)  # nothing failed: nothing raised
    with pytest.raises(SnapshotCorruptError, match="could not load snapshot p: model: EOFError: short") as info:
        _agree_on_read_errors("p", [("model", EOFError("short"))], solo)
    assert info.value.all_ranks is True
    with pytest.raises(StorageUnavailableError, match="endpoint down"):
        _agree_on_read_errors("p", [("model", StorageUnavailableError("endpoint down"))], solo)


def test_after_a_fallback_an_optional_entry_the_older_snapshot_lacks_is_put_back(tmp_path):
    """The damaged snapshot's loader state was loaded before its damaged model was met; the older
    snapshot holds no loader state: the loader is put back as it was before the restore."""
    dirpath = tmp_path / "run"
    saver = Snapshotter(str(dirpath), SnapshotConfig.build(async_snapshot=False))
    saver.train_start(["model", "loader"], 0, 0)
    saver.save(0, 1, {"model": Holder(model_state(1))})  # an epoch-end snapshot: no loader state
    saver.save(0, 2, {"model": Holder(model_state(2)), "loader": Holder({"position": torch.tensor(5)})})
    saver.train_end(0, 2, lambda intra_epoch: {})
    newest = dirpath / "epoch_0_step_2"
    file, start, end = payload(newest, "0/model/big")
    flip(file, start + 1)

    model = Holder(zeros_like(model_state(0)))
    loader = Holder({"position": torch.tensor(0)})
    with pytest.warns(UserWarning) as caught:
        result = restore_from_latest(str(dirpath), {"loader": loader, "model": model}, optional_keys=["loader"])
    assert result == str(dirpath / "epoch_0_step_1")
    assert_identical(model.state, model_state(1))
    assert loader.state == {"position": torch.tensor(0)}
    assert any("loader is not in" in str(w.message) and "put back" in str(w.message) for w in caught)


def test_large_reads_are_verified_on_the_reading_threads_as_each_file_lands(tmp_path, monkeypatch):
    """Files read a few at once (fileio.READ_THREADS) are verified by the thread that read them,
    right after each preadv; a flipped byte in any of them still names its file and entry."""
    from tnt_snapshot_plugin.format import checksums
    from tnt_snapshot_plugin.stores import fileio

    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(fileio.PARALLEL_READ_MIN_BYTES // 4, generator=g) for i in range(4)}
    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=False))
    saver.train_start(["model"], 0, 0)
    saver.save(0, 1, {"model": Holder(state)})
    saver.train_end(0, 1, lambda intra_epoch: {})
    snapshot = tmp_path / "epoch_0_step_1"

    checked: dict[str, str] = {}
    real_check_reads = checksums.Verifier.check_reads

    def spy(self, reads, indices, names):
        indices = list(indices)
        for i in indices:
            checked[reads[i][0]] = threading.current_thread().name
        return real_check_reads(self, reads, indices, names)

    monkeypatch.setattr(checksums.Verifier, "check_reads", spy)
    target = Holder({k: torch.zeros_like(v) for k, v in state.items()})
    restore(str(snapshot), {"model": target})
    assert all(torch.equal(target.state[k], v) for k, v in state.items())
    files = {payload(snapshot, f"0/model/t{i}")[0].relative_to(snapshot).as_posix() for i in range(4)}
    assert files <= set(checked)
    assert all(checked[f].startswith("tnt-snapshot-read") for f in files), checked

    file, start, _end = payload(snapshot, "0/model/t3")
    flip(file, start + 1000)
    with pytest.raises(SnapshotCorruptError) as info:
        restore(str(snapshot), {"model": Holder({k: torch.zeros_like(v) for k, v in state.items()})})
    assert str(file.relative_to(snapshot)) in str(info.value) and "model/t3" in str(info.value)
