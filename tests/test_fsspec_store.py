"""The fsspec store (stores/fsspec.py) under real torchtnt training, on two fsspec filesystems:
fsspec's memory filesystem (``memory://``) and s3fs against moto's S3 server on 127.0.0.1
(``s3a://``, which fsspec maps to s3fs; ``s3://`` stays the built-in S3 store's).

The same promises as on local disk and S3: snapshots are published by ``.snapshot_metadata``
written last, restore_from_latest resumes bitwise, retention deletes only the plugin's own
snapshots once a newer one is committed, and an interrupted write is never restored.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

import fsspec
import pytest
from dir_listing import complete_in_commit_order
from moto_s3 import BUCKET, as_s3fs
from torchtnt.framework.train import train

from tnt_snapshot_plugin import SnapshotNotFoundError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format import verify
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.restoring import latest_snapshot
from tnt_snapshot_plugin.stores import WRITER_FNAME, open_store
from tnt_snapshot_plugin.stores.fsspec import FsspecStore
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, dead_pid, make_data, seed_everything, weights

pytestmark = pytest.mark.slow


@pytest.fixture
def s3fs_options(s3_options):
    """The storage_options that point s3fs at the module's moto server (its bucket exists)."""
    return as_s3fs(s3_options)


@pytest.fixture(params=["memory", "s3fs"])
def target(request) -> tuple[str, dict[str, Any]]:
    """(a fresh dirpath URL, its storage_options) on each filesystem."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    if request.param == "memory":
        return f"memory://{run}", {}
    return f"s3a://{BUCKET}/{run}", request.getfixturevalue("s3fs_options")


def filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    return fs, root.rstrip("/")


def directories_by_name(url: str, options: dict[str, Any]) -> list[str]:
    """The directories right under ``url``, as the filesystem lists them ([] when it has none)."""
    fs, root = filesystem(url, options)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")


def put(url: str, options: dict[str, Any], rel: str, data: bytes) -> None:
    fs, root = filesystem(url, options)
    fs.pipe_file(f"{root}/{rel}", data)


def test_the_scheme_reaches_the_fsspec_store(target):
    url, options = target
    store = open_store(url, options)
    assert isinstance(store, FsspecStore) and not store.atomic_rename
    assert store.list_names() == []


def test_train_then_restore_from_latest_resumes_bitwise(target):
    """A real torchtnt run writes through the fsspec store and fails at step 13; a fresh unit
    restores the latest snapshot (its URL keeps the scheme) and trains on to the same weights as
    an uninterrupted run."""
    url, options = target
    seed_everything(7)
    reference = ToyUnit(seed=0)
    train(reference, StatefulLoader(make_data(40), seed=3), max_epochs=2)

    seed_everything(7)
    interrupted = ToyUnit(seed=0, fail_at_step=13)
    saver = TorchSnapshotSaver(url, save_every_n_train_steps=4, storage_options=options)
    with pytest.raises(RuntimeError, match="injected failure at step 13"):
        train(interrupted, StatefulLoader(make_data(40), seed=3), max_epochs=2, callbacks=[saver])

    names = directories_by_name(url, options)
    assert names == ["epoch_0_step_4", "epoch_0_step_8", "epoch_1_step_12"]
    fs, root = filesystem(url, options)
    for name in names:  # published by the metadata, next to the plugin's index
        assert fs.exists(f"{root}/{name}/{METADATA_FNAME}") and fs.exists(f"{root}/{name}/{INDEX_FNAME}")
        assert verify.check(open_store(url, options), name).problem is None
    assert latest_snapshot(url, storage_options=options) == f"{url}/epoch_1_step_12"

    seed_everything(99)
    resumed = ToyUnit(seed=123)
    loader = StatefulLoader(make_data(40), seed=3)
    assert TorchSnapshotSaver.restore_from_latest(url, resumed, train_dataloader=loader, storage_options=options)
    assert resumed.train_progress.num_steps_completed == 12
    train(resumed, loader, max_epochs=2)
    assert_bitwise_equal(weights(resumed), weights(reference))


def test_retention_deletes_only_the_plugins_own_snapshots(target):
    url, options = target
    put(url, options, "notes/readme.txt", b"the user's")
    put(url, options, "epoch_7_step_70/partial", b"no writer marker: not provably the plugin's")
    unit = ToyUnit()
    saver = TorchSnapshotSaver(url, save_every_n_train_steps=2, keep_last_n_snapshots=2, storage_options=options)
    train(unit, StatefulLoader(make_data(20)), max_epochs=1, callbacks=[saver])
    assert directories_by_name(url, options) == ["epoch_0_step_4", "epoch_1_step_5", "epoch_7_step_70", "notes"]
    assert complete_in_commit_order(url, options) == ["epoch_0_step_4", "epoch_1_step_5"]
    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(url, fresh, storage_options=options)
    assert_bitwise_equal(weights(fresh), weights(unit))


def test_an_interrupted_write_is_ignored_then_cleared(target):
    """A newer snapshot without ``.snapshot_metadata`` is not "latest" and cannot be restored;
    the next run clears it once its writer marker proves it the plugin's and its writer dead."""
    url, options = target
    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(20)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(url, save_every_n_epochs=1, storage_options=options)])
    for rel in ("0/model/0.weight", "batched/abc"):  # no index, no metadata: not committed
        put(url, options, f"epoch_9_step_99/{rel}", b"partial")
    assert directories_by_name(url, options) == ["epoch_1_step_5", "epoch_9_step_99"]
    assert latest_snapshot(url, storage_options=options) == f"{url}/epoch_1_step_5"
    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(url, fresh, storage_options=options)
    assert_bitwise_equal(weights(fresh), weights(unit))
    with pytest.raises(SnapshotNotFoundError, match="not a complete snapshot"):
        TorchSnapshotSaver.restore(f"{url}/epoch_9_step_99", ToyUnit(), storage_options=options)

    marker = {"host": socket.gethostname(), "pid": dead_pid(), "run_id": "gone", "started_at": time.time()}
    put(url, options, f"epoch_9_step_99/{WRITER_FNAME}", json.dumps(marker).encode())
    train(fresh, StatefulLoader(make_data(20)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(url, save_every_n_epochs=5, storage_options=options)])
    assert directories_by_name(url, options) == ["epoch_1_step_5"]


def test_a_second_saver_on_the_same_dirpath_is_refused_while_the_first_runs(target):
    """The live saver's lease file names it; a second saver is refused while it is held, and
    takes the dirpath once the first run has ended."""
    import torch

    from tnt_snapshot_plugin import ConfigError
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    url, options = target
    config = SnapshotConfig.build(storage_options=options, preemption_signals=[])
    first, second = Snapshotter(url, config), Snapshotter(url, config)
    first.train_start(["m"])
    fs, root = filesystem(url, options)
    assert fs.exists(f"{root}/.tnt_snapshot.lease.json")
    with pytest.raises(ConfigError, match=rf"in use by another saver \(host .* pid {os.getpid()} run"):
        second.train_start(["m"])
    first.train_end(0, 0, lambda intra: {"m": torch.nn.Linear(2, 2)})
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/.tnt_snapshot.lease.json")
    second.train_start(["m"])
    second.train_end(0, 1, lambda intra: {"m": torch.nn.Linear(2, 2)})
    assert directories_by_name(url, options) == ["epoch_0_step_0", "epoch_0_step_1"]
