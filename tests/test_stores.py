"""The store contract (stores/): one set of tests run on local disk, on S3 (moto's real server on
127.0.0.1), on the fsspec store over fsspec's memory filesystem and over s3fs against the same
server, and on the in-process MemoryStore under both commit strategies; then the FaultyStore and
the fake:// registry (tnt_snapshot_plugin.testing) that lets tests run real savers on the fakes."""

from __future__ import annotations

import array
import errno
import json
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from moto_s3 import BUCKET, as_s3fs

from tnt_snapshot_plugin.errors import ConfigError, SnapshotCorruptError, SnapshotError, SnapshotWriteError
from tnt_snapshot_plugin.format import listing, verify
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.stores import LocalStore, Store, open_store
from tnt_snapshot_plugin.stores.commit import AtomicRename, MetadataWrittenLast
from tnt_snapshot_plugin.stores.fsspec import FsspecStore
from tnt_snapshot_plugin.stores.ownership import new_run_id, staging_token, writer_identity
from tnt_snapshot_plugin.stores.s3 import S3Store
from tnt_snapshot_plugin.testing import FaultyStore, MemoryStore, memory_store, register, unregister

KINDS = ["local", "s3", "fsspec-memory", "fsspec-s3", "memory", "memory-metadata-last"]


@pytest.fixture(params=KINDS)
def store(request, tmp_path) -> Store:
    kind = request.param
    if kind == "local":
        return LocalStore(str(tmp_path / "run"))
    if kind == "s3":
        options = request.getfixturevalue("s3_options")
        return S3Store(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/run", options)
    if kind == "fsspec-memory":
        return open_store(f"memory://stores-{uuid.uuid4().hex[:8]}/run")
    if kind == "fsspec-s3":  # s3a:// is s3fs's too; s3:// is the built-in S3 store's
        options = {**as_s3fs(request.getfixturevalue("s3_options")), "skip_instance_cache": True}
        return open_store(f"s3a://{BUCKET}/{uuid.uuid4().hex[:8]}/run", options)
    return MemoryStore(atomic_rename=kind == "memory")


def begin(store: Store, final: str) -> str:
    staging = store.staging_for(final, staging_token(new_run_id(), 1))
    store.begin(staging, {**writer_identity("0123456789ab"), "started_at": 0.0})
    return staging


#: The metadata of a snapshot holding one int, as torchsnapshot writes it.
TINY_METADATA = (
    b'{"version": "0.1.0", "world_size": 1, "manifest": '
    b'{"0/n": {"type": "int", "serialized_value": "1", "replicated": false, "readable": null}}}'
)


def index_of(store: Store, staging: str, rels: list[str]) -> bytes:
    return json.dumps({"format": 1, "files": {r: store.file_size(staging, r) for r in rels}}).encode()


FILES: dict[str, list[Any]] = {
    "0/model/weight": [b"w" * 100],
    "batched/abc": [memoryview(b"0123"), b"", bytearray(b"4567"), memoryview(array.array("i", [1, 2]))],
    "deep/er/still/x": [memoryview(bytes(range(256)) * 40)[10:]],
    "empty": [],
}


def contents(parts: list[Any]) -> bytes:
    return b"".join(memoryview(p).cast("B") for p in parts)


def commit(store: Store, staging: str, final: str, metadata: bytes, index: bytes) -> None:
    """Commit as the saver does: every file the index lists checked, the index, then the metadata."""
    store.commit(
        staging, final, metadata_file=".snapshot_metadata", metadata=metadata, index_file=INDEX_FNAME,
        index=index, written=json.loads(index)["files"],
    )


def write_snapshot(store: Store, final: str = "epoch_0_step_1") -> None:
    staging = begin(store, final)
    for rel, parts in FILES.items():
        store.write_payload(staging, rel, parts)
    commit(store, staging, final, TINY_METADATA, index_of(store, staging, list(FILES)))


# ------------------------------------------------------------------------------------------------
# The contract


def test_strategy_matches_the_store(store):
    assert isinstance(store.protocol, AtomicRename if store.atomic_rename else MetadataWrittenLast)
    if isinstance(store, (LocalStore, S3Store, FsspecStore)):
        assert store.atomic_rename is isinstance(store, LocalStore)
    staging = store.staging_for("epoch_0_step_1", "tok1")
    assert (staging == "epoch_0_step_1") is (not store.atomic_rename)


def test_payloads_round_trip_through_read_into(store):
    write_snapshot(store)
    name = "epoch_0_step_1"
    assert listing.complete_snapshots(store)[0].text == name
    for rel, parts in FILES.items():
        assert store.read_file(name, rel) == contents(parts)
        assert store.file_size(name, rel) == len(contents(parts))
    blob = contents(FILES["deep/er/still/x"])
    dests = [bytearray(5), bytearray(4), bytearray(len(blob) - 7), bytearray(0), bytearray(100)]
    store.read_into(
        name,
        [
            ("batched/abc", 3, memoryview(dests[0])),
            ("batched/abc", 0, memoryview(dests[1])),
            ("deep/er/still/x", 7, memoryview(dests[2])),
            ("empty", 0, memoryview(dests[3])),
            ("0/model/weight", 0, memoryview(dests[4])),
        ],
    )
    assert bytes(dests[0]) == b"34567"
    assert bytes(dests[1]) == b"0123"
    assert bytes(dests[2]) == blob[7:]
    assert bytes(dests[4]) == b"w" * 100


def test_a_started_payload_is_complete_once_its_step_has_run_on_another_thread(store):
    """``start_payload`` begins a write (local disk: the bytes go to the page cache at once) and
    returns the step that makes it durable, which the writer runs on an I/O thread."""
    staging = begin(store, "epoch_0_step_1")
    finishes = [store.start_payload(staging, rel, parts) for rel, parts in FILES.items()]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda finish: finish(), finishes)) == [None] * len(FILES)
    commit(store, staging, "epoch_0_step_1", TINY_METADATA, index_of(store, staging, list(FILES)))
    for rel, parts in FILES.items():
        assert store.read_file("epoch_0_step_1", rel) == contents(parts)


def test_a_local_started_payload_holds_no_file_descriptor_after_its_step_or_a_failure(tmp_path):
    store = LocalStore(str(tmp_path / "run"))
    staging = begin(store, "epoch_0_step_1")
    fds = len(os.listdir("/proc/self/fd"))
    finish = store.start_payload(staging, "batched/0-0", [b"abc", memoryview(b"def")])
    assert (tmp_path / "run" / staging / "batched" / "0-0").read_bytes() == b"abcdef"  # in the page cache
    assert len(os.listdir("/proc/self/fd")) == fds + 1
    finish()
    assert len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(TypeError):  # not a buffer: nothing written, nothing left open
        store.start_payload(staging, "batched/0-1", [b"abc", object()])
    assert len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(SnapshotWriteError, match="not a relative path inside the snapshot"):
        store.start_payload(staging, "../escape", [b"x"])
    assert not (tmp_path / "run" / "escape").exists()


def test_short_and_missing_files_are_corrupt_naming_the_file(store):
    write_snapshot(store)
    name = "epoch_0_step_1"
    with pytest.raises(SnapshotCorruptError, match=r"batched/abc.*(truncated|ends at byte)"):
        store.read_into(name, [("batched/abc", 10, memoryview(bytearray(8)))])
    with pytest.raises(SnapshotCorruptError, match=r"0/model/weight.*truncated"):
        store.read_into(name, [("0/model/weight", 0, memoryview(bytearray(101)))])
    with pytest.raises(SnapshotCorruptError, match=r"batched/abc.*(truncated|ends at byte)"):
        store.read_into(name, [("batched/abc", 100, memoryview(bytearray(4)))])  # past the end
    with pytest.raises(SnapshotCorruptError, match=r"0/model/nope"):
        store.read_into(name, [("0/model/nope", 0, memoryview(bytearray(1)))])


@pytest.mark.parametrize("rel", ["../escape", "/etc/passwd", "a/../../b", "", "a//b", "./x", "a\x00b"])
def test_a_path_escaping_the_snapshot_is_refused(store, rel, tmp_path):
    write_snapshot(store)
    staging = begin(store, "epoch_0_step_2")
    with pytest.raises(SnapshotWriteError, match="not a relative path inside the snapshot"):
        store.write_payload(staging, rel, [b"x"])
    with pytest.raises(SnapshotCorruptError, match="not a relative path inside the snapshot"):
        store.read_into("epoch_0_step_1", [(rel, 0, memoryview(bytearray(1)))])
    assert not (tmp_path / "escape").exists()
    with pytest.raises(SnapshotError):  # a child name with a slash is not a child
        store.write_payload("../elsewhere", "x", [b"x"])


def test_a_symlink_out_of_a_local_snapshot_is_refused(tmp_path):
    store = LocalStore(str(tmp_path / "run"))
    write_snapshot(store)
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "secret", tmp_path / "run" / "epoch_0_step_1" / "link")
    with pytest.raises(SnapshotCorruptError, match="outside the snapshot"):
        store.read_into("epoch_0_step_1", [("link", 0, memoryview(bytearray(6)))])
    staging = begin(store, "epoch_0_step_2")
    os.symlink(tmp_path, tmp_path / "run" / staging / "out")
    with pytest.raises(SnapshotWriteError, match="resolves outside"):
        store.write_payload(staging, "out/planted", [b"x"])
    assert not (tmp_path / "planted").exists()


def test_is_inside_resolves_the_links_on_the_way_and_nothing_else_leads_out(tmp_path):
    """The check that keeps a manifest's file inside its snapshot: a link (of the file or of a
    folder on the way) is followed, wherever it points; a missing file is inside (its read fails)."""
    from tnt_snapshot_plugin.stores.fileio import is_inside

    real = tmp_path / "real"
    (real / "snap" / "0").mkdir(parents=True)
    (real / "snap" / "0" / "f").write_bytes(b"x")
    (tmp_path / "secret").write_bytes(b"s")
    os.symlink(real, tmp_path / "root")  # the root itself a link: resolved once
    os.symlink(tmp_path / "secret", real / "snap" / "0" / "out")
    os.symlink(tmp_path, real / "snap" / "up")
    os.symlink(real / "snap" / "0" / "f", real / "snap" / "0" / "in")
    root = str(tmp_path / "root" / "snap")
    for rel, inside in [
        ("0/f", True), ("0/in", True), ("0/missing", True), ("./0/f", True),
        ("0/out", False), ("up/secret", False), ("up/real/snap/0/f", True),
        ("../secret", False), ("0/../../secret", False), (str(tmp_path / "secret"), False), ("0/f\x00", False),
    ]:
        assert is_inside(root, rel) is inside, rel
        assert is_inside(root, rel, os.path.realpath(root)) is inside, rel


def test_read_ahead_announces_the_files_inside_up_to_its_limit_and_never_raises(tmp_path):
    """A hint: the bytes announced are those of regular files inside the root, in order, up to
    the limit; a missing file, a FIFO, a link out and a path with ".." are skipped."""
    from tnt_snapshot_plugin.stores.fileio import read_ahead

    root = tmp_path / "snap"
    (root / "0").mkdir(parents=True)
    (root / "0" / "a").write_bytes(b"a" * 1000)
    (root / "0" / "b").write_bytes(b"b" * 3000)
    (tmp_path / "secret").write_bytes(b"s" * 500)
    os.symlink(tmp_path / "secret", root / "out")
    os.mkfifo(root / "fifo")
    files = [("missing", None), ("fifo", None), ("out", None), ("../secret", None), ("0/a", None), ("0/b", 2000)]
    assert read_ahead(str(root), files) == 3000
    assert read_ahead(str(root), files, limit=1500) == 1500
    assert read_ahead(str(root), [("0/a", 0)]) == 0
    store = LocalStore(str(tmp_path))
    store.read_ahead("snap", files)  # the store's hint: nothing raised, for any name
    store.read_ahead("../elsewhere", files)


def test_begin_commit_list_verify_remove(store):
    assert listing.complete_snapshots(store) == []
    write_snapshot(store, "epoch_0_step_1")
    write_snapshot(store, "epoch_0_step_2")
    assert [s.text for s in listing.complete_snapshots(store)] == ["epoch_0_step_1", "epoch_0_step_2"]
    assert listing.is_complete(store, "epoch_0_step_2")
    assert store.read_file("epoch_0_step_2", METADATA_FNAME) == TINY_METADATA
    assert listing.read_index(store, "epoch_0_step_2")["files"]["batched/abc"] == 16
    assert listing.read_writer(store, "epoch_0_step_2")["run_id"] == "0123456789ab"
    assert listing.occupant(store, "epoch_0_step_2") == "ours" and listing.occupant(store, "epoch_9_step_9") is None
    assert verify.check(store, "epoch_0_step_2").problem is None
    # a file of the wrong size (the index remembers what was written)
    store.write_payload("epoch_0_step_2", "batched/abc", [b"short"])
    assert verify.check(store, "epoch_0_step_2").problem == "file batched/abc has 5 bytes, 16 were written"
    # a committed snapshot written again under the same name (another run's) is replaced
    write_snapshot(store, "epoch_0_step_2")
    assert verify.check(store, "epoch_0_step_2").problem is None
    listing.remove(store, "epoch_0_step_1")
    assert [s.text for s in listing.complete_snapshots(store)] == ["epoch_0_step_2"]
    assert "epoch_0_step_1" not in store.list_names()
    for bad in ("..", "a/b", "not_a_snapshot", ""):
        with pytest.raises(SnapshotError, match="refusing to delete"):
            listing.remove(store, bad)


def test_a_foreign_directory_is_never_removed_or_replaced(store):
    store.write_payload("epoch_0_step_3", "theirs", [b"not the plugin's"])
    with pytest.raises(SnapshotError, match="neither the plugin's index"):
        listing.remove(store, "epoch_0_step_3")
    assert store.read_file("epoch_0_step_3", "theirs") == b"not the plugin's"
    if store.atomic_rename:
        with pytest.raises(SnapshotWriteError, match="was not written by the plugin"):
            write_snapshot(store, "epoch_0_step_3")
        assert store.read_file("epoch_0_step_3", "theirs") == b"not the plugin's"


def test_a_write_interrupted_before_commit_leaves_nothing_restore_would_pick(store):
    write_snapshot(store, "epoch_0_step_1")
    staging = begin(store, "epoch_0_step_2")
    for rel, parts in FILES.items():
        store.write_payload(staging, rel, parts)
    # the process dies here: no index, no metadata
    assert not listing.is_complete(store, "epoch_0_step_2")
    assert [s.text for s in listing.complete_snapshots(store)] == ["epoch_0_step_1"]
    assert listing.provably_ours(store, staging)  # its writer marker: the next run may clean it up
    if store.atomic_rename:
        assert staging != "epoch_0_step_2" and "epoch_0_step_2" not in store.list_names()
    else:
        assert staging == "epoch_0_step_2"  # written in place, not published
    listing.remove(store, staging)
    assert staging not in store.list_names()
    # the commit itself fails after the index (the metadata is what publishes)
    staging = begin(store, "epoch_0_step_3")
    store.write_payload(staging, "data", [b"payload"])
    store.write_payload(staging, INDEX_FNAME, [index_of(store, staging, ["data"])])
    assert [s.text for s in listing.complete_snapshots(store)] == ["epoch_0_step_1"]


def test_a_file_lost_during_the_write_stops_the_rename_commit():
    store = MemoryStore()
    staging = begin(store, "epoch_0_step_1")
    store.write_payload(staging, "data", [b"payload"])
    index = index_of(store, staging, ["data"])
    store._tree.files.pop(f"{staging}/data")
    with pytest.raises(SnapshotWriteError, match="has None bytes, 7 were written"):
        commit(store, staging, "epoch_0_step_1", b"{}", index)
    assert listing.complete_snapshots(store) == []


def test_write_payload_is_thread_safe_across_files(store):
    staging = begin(store, "epoch_0_step_1")
    rels = [f"t/{i % 7}/f{i}" for i in range(48)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: store.write_payload(staging, r, [r.encode(), b"|" * 1000]), rels))
    commit(store, staging, "epoch_0_step_1", b"{}", index_of(store, staging, rels))
    dests = {r: bytearray(len(r) + 1000) for r in rels}
    store.read_into("epoch_0_step_1", [(r, 0, memoryview(d)) for r, d in dests.items()])
    assert all(bytes(d) == r.encode() + b"|" * 1000 for r, d in dests.items())


def test_s3_large_payloads_go_up_in_parts(s3_options):
    store = S3Store(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/run", s3_options)
    store.multipart_bytes = 5 * 1024 * 1024  # S3's smallest part
    pieces = [os.urandom(3 * 1024 * 1024 + 17) for _ in range(4)]
    requests: list[str] = []
    store.client.meta.events.register("before-call.s3.*", lambda model, **kw: requests.append(model.name))
    try:
        store.write_payload("epoch_0_step_1", "big", [memoryview(p) for p in pieces])
    finally:
        store.client.meta.events.unregister("before-call.s3.*")
    assert requests.count("UploadPart") == 3 and "CompleteMultipartUpload" in requests
    whole = b"".join(pieces)
    dest = bytearray(len(whole) - 100)
    store.read_into("epoch_0_step_1", [("big", 50, memoryview(dest))])
    assert bytes(dest) == whole[50:-50]


# ------------------------------------------------------------------------------------------------
# Locks


def test_dirpath_lock_refuses_a_second_run_until_released(store):
    one, two = new_run_id(), new_run_id()  # live runs of this process: neither provably gone
    first = store.lock({**writer_identity(one), "started_at": 1.0})
    try:
        with pytest.raises(ConfigError, match="in use by another saver"):
            store.lock({**writer_identity(two), "started_at": 2.0})
    finally:
        first.release()
    store.lock({**writer_identity(two), "started_at": 2.0}).release()


# ------------------------------------------------------------------------------------------------
# The fakes (tnt_snapshot_plugin.testing): FaultyStore and fake:// dirpaths


def test_the_nth_write_fails_with_enospc_and_nothing_is_committed():
    faulty = FaultyStore(MemoryStore())
    fault = faulty.inject("write_payload", OSError(errno.ENOSPC, "No space left on device"), nth=2)
    staging = begin(faulty, "epoch_0_step_1")  # the inner store writes its marker itself
    faulty.write_payload(staging, "a", [b"a"])  # 1st
    with pytest.raises(OSError, match="No space left") as caught:
        faulty.write_payload(staging, "b", [b"b"])  # 2nd
    assert caught.value.errno == errno.ENOSPC and fault.fired == 1
    faulty.write_payload(staging, "b", [b"b"])  # once only (times=1)
    assert listing.complete_snapshots(faulty) == []
    assert ("write_payload", (staging, "b")) in faulty.calls


def test_a_failing_commit_leaves_no_complete_snapshot_on_either_strategy():
    for inner in (MemoryStore(), MemoryStore(atomic_rename=False)):
        faulty = FaultyStore(inner)
        faulty.inject("write_payload", SnapshotWriteError("injected"), match=lambda name, rel: rel == METADATA_FNAME)
        staging = begin(faulty, "epoch_0_step_1")
        faulty.write_payload(staging, "data", [b"x"])
        with pytest.raises(SnapshotWriteError, match="injected"):
            commit(faulty, staging, "epoch_0_step_1", b"{}", index_of(faulty, staging, ["data"]))
        assert listing.complete_snapshots(inner) == [] and listing.complete_snapshots(faulty) == []
        faulty.inject("commit", RuntimeError("commit refused"))
        with pytest.raises(RuntimeError, match="commit refused"):
            commit(faulty, staging, "epoch_0_step_1", b"{}", index_of(faulty, staging, ["data"]))
        commit(faulty, staging, "epoch_0_step_1", b"{}", index_of(faulty, staging, ["data"]))
        assert [s.text for s in listing.complete_snapshots(inner)] == ["epoch_0_step_1"]


def test_faults_on_a_real_local_store(tmp_path):
    faulty = FaultyStore(LocalStore(str(tmp_path)))
    faulty.inject("publish", OSError(errno.EIO, "Input/output error (injected)"))
    staging = begin(faulty, "epoch_0_step_1")
    faulty.write_payload(staging, "data", [b"x" * 10])
    with pytest.raises(OSError, match="injected"):
        commit(faulty, staging, "epoch_0_step_1", b"{}", index_of(faulty, staging, ["data"]))
    assert listing.complete_snapshots(LocalStore(str(tmp_path))) == []
    assert (tmp_path / staging / "data").read_bytes() == b"x" * 10


def test_read_into_short_or_flipped_on_demand():
    faulty = FaultyStore(MemoryStore())
    write_snapshot(faulty)
    faulty.inject("read_into", short_by=3)
    dest = bytearray(8)
    faulty.read_into("epoch_0_step_1", [("batched/abc", 0, memoryview(dest))])
    assert bytes(dest) == b"01234\0\0\0"
    faulty.inject("read_into", flip=True, times=None)
    for _ in range(2):
        faulty.read_into("epoch_0_step_1", [("batched/abc", 0, memoryview(dest))])
        assert bytes(dest) == bytes([ord("0") ^ 0xFF]) + b"1234567"
    faulty.clear()
    faulty.read_into("epoch_0_step_1", [("batched/abc", 0, memoryview(dest))])
    assert bytes(dest) == b"01234567"
    faulty.inject("read_into", SnapshotCorruptError("injected damage"))
    with pytest.raises(SnapshotCorruptError, match="injected damage"):
        faulty.read_into("epoch_0_step_1", [("batched/abc", 0, memoryview(dest))])
    with pytest.raises(ValueError, match="unknown store operation"):
        faulty.inject("frobnicate", OSError())
    with pytest.raises(ValueError, match="needs an error"):
        faulty.inject("commit")


def test_fakes_are_reached_from_a_dirpath():
    try:
        faulty = FaultyStore(MemoryStore())
        dirpath = register("stores-test-b", faulty)
        assert dirpath == "fake://stores-test-b" and open_store(dirpath) is faulty
        assert faulty.url == faulty.inner.url == dirpath
        fresh = open_store("fake://stores-test-a")
        assert isinstance(fresh, MemoryStore) and open_store("fake://stores-test-a") is fresh
        assert memory_store("stores-test-a") is fresh and fresh.url == "fake://stores-test-a"
        write_snapshot(fresh)
        nested = open_store("fake://stores-test-a/inner")
        assert nested.url == "fake://stores-test-a/inner" and nested.list_names() == []
        write_snapshot(nested)
        assert "inner" in fresh.list_names()
        assert [s.text for s in listing.complete_snapshots(open_store("fake://stores-test-a/inner"))] == [
            "epoch_0_step_1"
        ]
        with pytest.raises(ConfigError, match="already registered"):
            register("stores-test-b", MemoryStore())
        with pytest.raises(ConfigError, match="storage_options"):
            open_store(dirpath, {"endpoint_url": "x"})
        with pytest.raises(ConfigError, match="names no fake store"):
            open_store("fake://")
    finally:
        unregister("stores-test-a")
        unregister("stores-test-b")
    assert open_store("fake://stores-test-a").list_names() == []  # forgotten: a new one
    unregister("stores-test-a")


def test_hooks_run_around_chosen_operations_and_can_hold_a_write():
    """``hook``: ``before`` runs on the calling thread and may block until the test releases it;
    ``after`` runs once the operation has finished, also when it raised; ``match`` picks calls."""
    faulty = FaultyStore(MemoryStore())
    staging = begin(faulty, "epoch_0_step_1")
    release, entered = threading.Event(), threading.Event()
    log: list[tuple[str, str]] = []

    def hold(name: str, rel: str) -> None:
        entered.set()
        assert release.wait(30)

    faulty.hook("write_payload", before=hold, match=lambda name, rel: rel == "held")
    hook = faulty.hook("write_payload", after=lambda name, rel: log.append(("after", rel)))
    writer = threading.Thread(target=faulty.write_payload, args=(staging, "held", [b"h"]))
    writer.start()
    assert entered.wait(30)
    assert not faulty.has_file(staging, "held") and log == []  # still held before the write
    faulty.write_payload(staging, "free", [b"f"])  # other files are not held
    assert log == [("after", "free")]
    release.set()
    writer.join(30)
    assert faulty.read_file(staging, "held") == b"h" and log == [("after", "free"), ("after", "held")]

    faulty.inject("write_payload", OSError(errno.EIO, "injected"))
    with pytest.raises(OSError, match="injected"):
        faulty.write_payload(staging, "c", [b"c"])
    assert log[-1] == ("after", "c") and hook.seen == 3  # after ran although the write failed

    faulty.hook("remove", before=lambda name: log.append(("remove", name)))
    listing.remove(faulty, staging)
    assert log[-1] == ("remove", staging)
    faulty.clear()
    faulty.write_payload(begin(faulty, "epoch_0_step_2"), "d", [b"d"])
    assert log[-1] == ("remove", staging)  # cleared: no hook runs any more
    with pytest.raises(ValueError, match="unknown store operation"):
        faulty.hook("frobnicate", before=print)
    with pytest.raises(ValueError, match="needs before or after"):
        faulty.hook("commit")


def test_a_real_saver_runs_on_a_faulty_store_reached_by_its_dirpath(tmp_path):
    """The saver and restore open ``fake://NAME`` like any dirpath; the registered FaultyStore
    (here around a local store, which torchsnapshot can still write to) fails the second commit."""
    import warnings

    import torch

    from tnt_snapshot_plugin import SnapshotConfig, SnapshotFailedWarning, Snapshotter, restore_from_latest
    from toy import Holder

    faulty = FaultyStore(LocalStore(str(tmp_path / "run")))
    dirpath = register("stores-test-saver", faulty)
    try:
        faulty.inject("publish", OSError(errno.EIO, "Input/output error (injected)"), nth=2)
        saver = Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=False))
        saver.train_start(["model"], 0, 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2, 3):
                saver.save(0, step, {"model": Holder({"w": torch.full((4,), float(step))})})
            saver.train_end(0, 3, lambda intra_epoch: {})
        failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
        assert len(failed) == 1 and "epoch_0_step_2 (epoch 0, step 2) failed" in failed[0]
        assert "Input/output error (injected)" in failed[0]
        assert [s.text for s in listing.complete_snapshots(LocalStore(str(tmp_path / "run")))] == [
            "epoch_0_step_1",
            "epoch_0_step_3",
        ]
        target = Holder({"w": torch.zeros(4)})
        assert restore_from_latest(dirpath, {"model": target}).endswith("epoch_0_step_3")
        assert torch.equal(target.state["w"], torch.full((4,), 3.0))
        assert {"lock", "begin", "commit", "publish"} <= {op for op, _ in faulty.calls}
    finally:
        unregister("stores-test-saver")
