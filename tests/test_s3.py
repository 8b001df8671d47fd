"""s3:// snapshot directories against moto's real S3 server on 127.0.0.1.

Everything reaches S3 through ``storage_options`` alone: every test runs with the AWS environment
variables cleared and with ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` pointing at a closed
loopback port, so a client that read the environment instead of ``storage_options`` would fail,
and no request can leave the machine. (torchsnapshot's own ``s3://`` plugin ignores
``storage_options`` and would go to AWS; the plugin's S3 store, which these tests exercise, builds
its client from them.)
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import boto3
import launching
import pytest
import torch
from dir_listing import complete_in_commit_order
from moto_s3 import BUCKET, DEAD_ENDPOINT, keys_under, names_under, s3_client
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    ConfigError,
    LockWarning,
    NothingToRestoreWarning,
    SnapshotCorruptError,
    SnapshotFailedWarning,
    SnapshotFallbackWarning,
    SnapshotNotFoundError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format import listing, verify
from tnt_snapshot_plugin.format.checksums import record_views
from tnt_snapshot_plugin.format.index import INDEX_FNAME, parse, parse_part, part_rel
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.restoring import latest_snapshot
from tnt_snapshot_plugin.stores import WRITER_FNAME, open_store
from tnt_snapshot_plugin.stores import s3 as s3_mod
from tnt_snapshot_plugin.stores.s3 import S3Store
from toy import (
    Holder,
    StatefulLoader,
    ToyUnit,
    assert_bitwise_equal,
    dead_pid,
    make_data,
    seed_everything,
    weights,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_aws_environment")]


EXPECTED_NAMES = sorted(
    [
        "epoch_0_step_2",
        "epoch_0_step_4",
        "epoch_1_step_5",
        "epoch_1_step_6",
        "epoch_1_step_8",
        "epoch_1_step_10",
        "epoch_2_step_10",
    ]
)


def test_environment_endpoint_is_dead():
    """The guard the other tests rely on: a client built from the environment fails here."""
    import botocore.exceptions

    client = boto3.session.Session().client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    assert client.meta.endpoint_url == DEAD_ENDPOINT
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        client.list_buckets()


def test_train_into_s3_writes_every_snapshot(s3_options, run_url):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(
        run_url, save_every_n_train_steps=2, save_every_n_epochs=1, storage_options=s3_options
    )
    assert saver.dirpath == run_url
    train(unit, StatefulLoader(make_data(20)), max_epochs=2, callbacks=[saver])

    assert names_under(s3_options, run_url) == EXPECTED_NAMES
    keys = keys_under(s3_options, run_url)
    store = open_store(run_url, s3_options)
    assert isinstance(store, S3Store)
    for name in EXPECTED_NAMES:
        assert f"{name}/.snapshot_metadata" in keys
        assert f"{name}/.tnt_snapshot_index.json" in keys
        assert verify.check(store, name).problem is None  # every file present with the size written
    assert complete_in_commit_order(run_url, s3_options) == sorted(
        EXPECTED_NAMES, key=lambda n: (int(n.split("_")[1]), int(n.split("_")[3]))
    )


@pytest.mark.parametrize("async_snapshot", [False, True], ids=["sync", "async"])
def test_restore_from_latest_on_s3_keeps_the_scheme_and_resumes_bitwise(s3_options, run_url, async_snapshot):
    """torchtnt's own restore_from_latest drops the s3:// scheme (fsspec lists "bucket/...") and
    then reads a local path; here the latest snapshot is an s3:// URL and resume is bitwise.
    Asynchronous snapshots after the first write each pack of the model's small tensors from the
    staging arena as one buffer."""
    seed_everything(7)
    reference = ToyUnit(seed=0)
    train(reference, StatefulLoader(make_data(40), seed=3), max_epochs=2)

    seed_everything(7)
    interrupted = ToyUnit(seed=0, fail_at_step=13)
    saver = TorchSnapshotSaver(
        run_url, save_every_n_train_steps=4, storage_options=s3_options, async_snapshot=async_snapshot
    )
    with pytest.raises(RuntimeError, match="injected failure at step 13"):
        train(interrupted, StatefulLoader(make_data(40), seed=3), max_epochs=2, callbacks=[saver])
    assert (saver.snapshotter._writer.encoder.plans.runs > 0) is async_snapshot

    assert latest_snapshot(run_url, storage_options=s3_options) == f"{run_url}/epoch_1_step_12"
    seed_everything(99)
    resumed = ToyUnit(seed=123)
    loader = StatefulLoader(make_data(40), seed=3)
    assert TorchSnapshotSaver.restore_from_latest(
        run_url, resumed, train_dataloader=loader, storage_options=s3_options
    )
    assert resumed.train_progress.num_steps_completed == 12
    train(resumed, loader, max_epochs=2)
    assert_bitwise_equal(weights(resumed), weights(reference))


def test_restore_chosen_s3_snapshot(s3_options, run_url):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(run_url, save_every_n_epochs=1, storage_options=s3_options)
    train(unit, StatefulLoader(make_data(20)), max_epochs=1, callbacks=[saver])
    fresh = ToyUnit(seed=5)
    TorchSnapshotSaver.restore(f"{run_url}/epoch_1_step_5", fresh, storage_options=s3_options)
    assert_bitwise_equal(weights(fresh), weights(unit))
    assert fresh.train_progress.num_steps_completed == 5
    with pytest.raises(SnapshotNotFoundError, match="is a directory of snapshots"):
        TorchSnapshotSaver.restore(run_url, ToyUnit(), storage_options=s3_options)


def test_incomplete_snapshot_on_s3_is_ignored(s3_options, run_url):
    """A newer snapshot whose write never finished (no .snapshot_metadata) is not "latest"."""
    unit = ToyUnit()
    saver = TorchSnapshotSaver(run_url, save_every_n_epochs=1, storage_options=s3_options)
    train(unit, StatefulLoader(make_data(20)), max_epochs=1, callbacks=[saver])
    client = s3_client(s3_options)
    prefix = run_url[len(f"s3://{BUCKET}/"):]
    for rel in ("0/model/0.weight", "0/rng_state/rng_state", "batched/abc"):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/epoch_9_step_99/{rel}", Body=b"partial")
    assert names_under(s3_options, run_url) == ["epoch_1_step_5", "epoch_9_step_99"]

    assert latest_snapshot(run_url, storage_options=s3_options) == f"{run_url}/epoch_1_step_5"
    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(run_url, fresh, storage_options=s3_options)
    assert_bitwise_equal(weights(fresh), weights(unit))
    with pytest.raises(SnapshotNotFoundError, match="not a complete snapshot"):
        TorchSnapshotSaver.restore(f"{run_url}/epoch_9_step_99", ToyUnit(), storage_options=s3_options)

    # S3 has no staging name: the next run's train start clears the interrupted write when its
    # writer marker proves it the plugin's and its writer gone (here: a dead process on this
    # host), and leaves complete snapshots, unmarked writes and other names alone.
    marker = {"host": socket.gethostname(), "pid": dead_pid(), "run_id": "gone", "started_at": time.time()}
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/epoch_9_step_99/{WRITER_FNAME}",
                      Body=json.dumps(marker).encode())
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/epoch_7_step_70/partial", Body=b"no marker")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/notes/readme.txt", Body=b"mine")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/epoch_8_train_step_80/partial", Body=b"torchtnt's")
    saver = TorchSnapshotSaver(run_url, save_every_n_epochs=5, storage_options=s3_options)
    train(fresh, StatefulLoader(make_data(20)), max_epochs=1, callbacks=[saver])
    assert names_under(s3_options, run_url) == [
        "epoch_1_step_5", "epoch_7_step_70", "epoch_8_train_step_80", "notes"
    ]


def test_deleting_an_s3_snapshot_unpublishes_it_first(s3_options, run_url, monkeypatch):
    """Retention removes .snapshot_metadata before the data: a crash part-way never leaves a
    complete-looking snapshot with files missing."""
    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(8)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(run_url, save_every_n_epochs=1, storage_options=s3_options)])
    store = open_store(run_url, s3_options)

    def killed_while_deleting_data(**kwargs):
        raise OSError("process killed while deleting (injected)")

    monkeypatch.setattr(store.client, "delete_objects", killed_while_deleting_data)
    with pytest.raises(OSError, match="injected"):
        listing.remove(store, "epoch_1_step_2")
    remaining = keys_under(s3_options, f"{run_url}/epoch_1_step_2")
    assert remaining and ".snapshot_metadata" not in remaining  # data left, metadata gone
    assert latest_snapshot(run_url, storage_options=s3_options) is None


def test_restore_from_latest_on_empty_s3_prefix_is_false(s3_options, run_url):
    with pytest.warns(NothingToRestoreWarning, match=f"dirpath {run_url} holds no snapshot directories"):
        assert TorchSnapshotSaver.restore_from_latest(run_url, ToyUnit(), storage_options=s3_options) is False


class _FailingPuts:
    """A boto3 client whose uploads fail, as when the bucket's quota is exhausted."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def put_object(self, **kwargs: Any) -> Any:
        raise OSError(f"upload of {kwargs.get('Key')} refused (injected)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_retention_on_s3_deletes_only_after_commit(s3_options, run_url, monkeypatch):
    """keep_last_n_snapshots deletes an old snapshot only once a newer one is committed; when the
    newer writes fail, nothing is deleted and the partial uploads are cleaned up."""
    events: list[tuple[str, str]] = []
    real_commit, real_delete = S3Store.commit, S3Store._delete

    def commit(self: S3Store, staging: str, final: str, **kwargs: Any) -> None:
        real_commit(self, staging, final, **kwargs)
        events.append(("commit", final))

    def delete(self: S3Store, name: str, unpublish: tuple[str, ...]) -> None:
        events.append(("remove", name))
        real_delete(self, name, unpublish)

    monkeypatch.setattr(S3Store, "commit", commit)
    monkeypatch.setattr(S3Store, "_delete", delete)

    unit = ToyUnit()
    loader = StatefulLoader(make_data(20))
    saver = TorchSnapshotSaver(
        run_url, save_every_n_train_steps=2, keep_last_n_snapshots=2, storage_options=s3_options
    )
    train(unit, loader, max_epochs=1, callbacks=[saver])
    assert names_under(s3_options, run_url) == ["epoch_0_step_4", "epoch_1_step_5"]
    removes = [e for e in events if e[0] == "remove"]
    assert removes == [("remove", "epoch_0_step_2")]
    assert events.index(("remove", "epoch_0_step_2")) > events.index(("commit", "epoch_1_step_5"))

    # Every upload of the next epoch fails: nothing is committed, so nothing is deleted.
    real_client = s3_mod.s3_client
    monkeypatch.setattr(s3_mod, "s3_client", lambda *args: _FailingPuts(real_client(*args)))
    events.clear()
    saver = TorchSnapshotSaver(  # the same retention (a smaller one would trim at train start)
        run_url, save_every_n_train_steps=2, keep_last_n_snapshots=2, storage_options=s3_options
    )
    with pytest.warns(LockWarning, match="could not read or write the lease .*injected"):
        with pytest.warns(SnapshotFailedWarning, match="injected"):
            train(unit, loader, max_epochs=2, callbacks=[saver])
    assert unit.train_progress.num_steps_completed == 10  # training went on
    assert not [e for e in events if e[0] == "commit"]
    assert names_under(s3_options, run_url) == ["epoch_0_step_4", "epoch_1_step_5"]
    assert complete_in_commit_order(run_url, s3_options) == [
        "epoch_0_step_4",
        "epoch_1_step_5",
    ]


def test_each_store_owns_its_client_and_its_nested_stores_use_it(s3_options, run_url):
    """No client is shared by the process: a store's client (and what is registered on it) is
    that store's own; a store nested in it uses it, as its settings are the same."""
    one, two = open_store(run_url, s3_options), open_store(run_url, dict(s3_options))
    assert one.client is not two.client
    assert one.nested("epoch_0_step_1").client is one.client
    other = open_store(run_url, dict(s3_options, region_name="eu-west-1"))
    assert other.client.meta.region_name == "eu-west-1" and one.client.meta.region_name != "eu-west-1"


def _write_to_s3(s3_options: dict[str, Any], run_url: str, state: dict) -> str:
    """``{"h": Holder(state)}`` snapshotted by the saver at step 1; the snapshot's URL."""
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    saver = Snapshotter(run_url, SnapshotConfig.build(async_snapshot=False, storage_options=s3_options))
    saver.train_start(["h"], 0, 0)
    assert saver.save(0, 1, {"h": Holder(state)})
    saver.train_end(0, 1, lambda intra_epoch: {})
    return f"{run_url}/epoch_0_step_1"


def test_s3_restore_fetches_each_file_in_few_large_ranged_reads(s3_options, run_url, monkeypatch):
    from tnt_snapshot_plugin.restoring import restore
    from varied import assert_identical, varied_state, zeros_like_state

    want = varied_state(3)
    path = _write_to_s3(s3_options, run_url, want)
    fetched = []
    real = S3Store._fetch

    def spy(self, name, rel, start, end):
        fetched.append((rel, start, end))
        return real(self, name, rel, start, end)

    monkeypatch.setattr(S3Store, "_fetch", spy)
    got = Holder(zeros_like_state(want))
    restore(path, {"h": got}, storage_options=s3_options)
    assert_identical(got.state, want)
    # the packed file (50 small tensors, 10 dtypes, the RNG state...) in one ranged GET per key
    # that reads from it; "big" in one; no byte asked for twice by one key
    files = {rel for rel, _, _ in fetched}
    assert fetched and len(files) <= 4
    assert len(fetched) <= 2 * len(files)


def test_truncated_s3_object_is_an_error_naming_it(s3_options, run_url):
    from tnt_snapshot_plugin.errors import SnapshotCorruptError
    from tnt_snapshot_plugin.restoring import restore
    from varied import zeros_like_state

    want = {"big": torch.randn(700_000)}
    path = _write_to_s3(s3_options, run_url, want)
    bucket, _, prefix = run_url[len("s3://"):].partition("/")
    client = s3_client(s3_options)
    objects = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    key = max(objects, key=lambda o: o["Size"])["Key"]  # the tensor's bytes
    assert not key.endswith(".snapshot_metadata")
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=body[:-100])
    rel = key.partition(path.rpartition("/")[2] + "/")[2]  # the object's file in the snapshot
    with pytest.raises(SnapshotCorruptError, match=rf"file {rel} has \d+ bytes, \d+ were written"):
        restore(path, {"h": Holder(zeros_like_state(want))}, storage_options=s3_options)


def test_a_second_saver_on_a_leased_s3_dirpath_is_refused(s3_options, run_url):
    """On S3 the live saver's lease object names it; a second saver is refused while the lease is
    held, and takes the dirpath once the first run has ended."""
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    config = SnapshotConfig.build(storage_options=s3_options, preemption_signals=[])
    first, second = Snapshotter(run_url, config), Snapshotter(run_url, config)
    first.train_start(["m"])
    assert ".tnt_snapshot.lease.json" in keys_under(s3_options, run_url)
    with pytest.raises(ConfigError, match=rf"in use by another saver \(host .* pid {os.getpid()} run"):
        second.train_start(["m"])
    first.train_end(0, 0, lambda intra: {"m": torch.nn.Linear(2, 2)})
    assert ".tnt_snapshot.lease.json" not in keys_under(s3_options, run_url)
    second.train_start(["m"])
    second.train_end(0, 1, lambda intra: {"m": torch.nn.Linear(2, 2)})
    assert names_under(s3_options, run_url) == ["epoch_0_step_0", "epoch_0_step_1"]


def test_an_s3_manifest_location_outside_the_snapshot_is_refused_before_any_request(s3_options, run_url, monkeypatch):
    from tnt_snapshot_plugin.restoring import restore

    path = _write_to_s3(s3_options, run_url, {"w": torch.zeros(16, dtype=torch.float64)})
    bucket, _, prefix = run_url[len("s3://"):].partition("/")
    client = s3_client(s3_options)
    meta_key = f"{prefix}/epoch_0_step_1/.snapshot_metadata"
    meta = json.loads(client.get_object(Bucket=bucket, Key=meta_key)["Body"].read())
    (entry,) = [e for k, e in meta["manifest"].items() if k.endswith("/w")]
    entry["location"], entry["byte_range"] = "../../elsewhere/secret", None
    body = json.dumps(meta).encode()
    client.put_object(Bucket=bucket, Key=meta_key, Body=body)
    # ... with its checksum recorded to match (a crafted snapshot): the path itself is refused
    index_key = f"{prefix}/epoch_0_step_1/{INDEX_FNAME}"
    index = json.loads(client.get_object(Bucket=bucket, Key=index_key)["Body"].read())
    index["checksums"][".snapshot_metadata"] = record_views([memoryview(body)])
    del index["seal"]
    client.put_object(Bucket=bucket, Key=index_key, Body=seal_index(index))  # sealed again

    requested: list[str] = []
    real_client = s3_mod.s3_client

    def record(params, **kwargs):
        requested.append(params.get("Key", ""))

    def recording_client(*args):  # every client the restore's stores build
        client = real_client(*args)
        client.meta.events.register("provide-client-params.s3.GetObject", record)
        return client

    monkeypatch.setattr(s3_mod, "s3_client", recording_client)
    with pytest.raises(SnapshotCorruptError, match="outside the snapshot"):
        restore(path, {"h": Holder({"w": torch.zeros(16, dtype=torch.float64)})}, storage_options=s3_options)
    assert requested and not [key for key in requested if ".." in key or "elsewhere" in key]


def _lease_of(s3_options: dict[str, Any], url: str) -> dict[str, Any]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return json.loads(s3_client(s3_options).get_object(Bucket=bucket, Key=f"{prefix}/.tnt_snapshot.lease.json")["Body"].read())


def test_of_two_savers_taking_an_s3_lease_at_once_exactly_one_gets_it(s3_options, run_url):
    """The race the lease had no answer for: saver B takes the lease between saver A's read (no
    lease) and A's write. A's write is conditional (If-None-Match), so it fails; A looks again,
    finds B's live lease and is refused, and B's lease is left as it is (A overwrote it)."""
    from tnt_snapshot_plugin.stores.ownership import new_run_id, writer_identity

    store_a, store_b = S3Store(run_url, s3_options), S3Store(run_url, s3_options)
    a_holder, b_holder = writer_identity(new_run_id()), writer_identity(new_run_id())
    leases: list[Any] = []

    def take_b_first(parsed: Any, model: Any, **kwargs: Any) -> None:
        # after A's first read of the lease (none there yet): B takes it before A writes
        if not leases and model.name == "GetObject" and not parsed.get("Body"):
            leases.append(None)
            leases.append(s3_mod.S3Lease(store_b, b_holder))

    client = store_a.client
    client.meta.events.register("after-call.s3.GetObject", take_b_first)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another saver \(.* run {b_holder['run_id']!r}"):
            s3_mod.S3Lease(store_a, a_holder)
    finally:
        client.meta.events.unregister("after-call.s3.GetObject", take_b_first)
    assert len(leases) == 2 and _lease_of(s3_options, run_url)["run_id"] == b_holder["run_id"]
    leases[1].release()
    assert ".tnt_snapshot.lease.json" not in keys_under(s3_options, run_url)


def test_a_renewal_that_finds_the_s3_lease_taken_over_warns_and_lets_it_be(s3_options, run_url):
    """After a stall longer than the lease, another saver took it over: this run's renewal (a
    conditional write on the version it wrote) fails; it warns and no longer renews or deletes."""
    from tnt_snapshot_plugin.stores.ownership import new_run_id, writer_identity

    store = S3Store(run_url, s3_options)
    lease = s3_mod.S3Lease(store, writer_identity(new_run_id()))
    other = {**writer_identity(new_run_id()), "expires_at": time.time() + 300}
    bucket, _, prefix = run_url[len("s3://"):].partition("/")
    s3_client(s3_options).put_object(Bucket=bucket, Key=f"{prefix}/.tnt_snapshot.lease.json", Body=json.dumps(other).encode())
    with pytest.warns(LockWarning, match=rf"was taken over by another saver \(.*run {other['run_id']!r}"):
        lease._renew()
    lease.release()
    assert _lease_of(s3_options, run_url)["run_id"] == other["run_id"]


class _NoConditionalWrites:
    """A boto3 client for an object store that refuses S3's conditional writes (If-None-Match,
    If-Match), as some S3-compatible stores do."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def put_object(self, **kwargs: Any) -> Any:
        if "IfNoneMatch" in kwargs or "IfMatch" in kwargs:
            from botocore.exceptions import ClientError

            raise ClientError(
                {"Error": {"Code": "NotImplemented", "Message": "conditional writes (injected)"},
                 "ResponseMetadata": {"HTTPStatusCode": 501}},
                "PutObject",
            )
        return self._client.put_object(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_an_s3_lease_on_a_store_without_conditional_writes_is_written_plainly_with_a_warning(
    s3_options, run_url, monkeypatch
):
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    real_client = s3_mod.s3_client
    monkeypatch.setattr(s3_mod, "s3_client", lambda *args: _NoConditionalWrites(real_client(*args)))
    config = SnapshotConfig.build(storage_options=s3_options, preemption_signals=[])
    first, second = Snapshotter(run_url, config), Snapshotter(run_url, config)
    with pytest.warns(LockWarning, match="refuses conditional writes .*injected.*within the same second"):
        first.train_start(["m"])
    assert ".tnt_snapshot.lease.json" in keys_under(s3_options, run_url)
    with pytest.raises(ConfigError, match="in use by another saver"):
        second.train_start(["m"])
    first.train_end(0, 0, lambda intra: {"m": torch.nn.Linear(2, 2)})
    assert ".tnt_snapshot.lease.json" not in keys_under(s3_options, run_url)


@pytest.mark.parametrize("entry", ["big", "transposed"])  # a ranged GET into the target; the plugin's read
def test_a_flipped_byte_in_an_s3_object_falls_back_to_the_previous_snapshot(s3_options, run_url, entry):
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, restore_from_latest

    def state(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"big": torch.randn(300_000, generator=g), "transposed": torch.randn(4, 6, generator=g).t()}

    saver = Snapshotter(run_url, SnapshotConfig.build(async_snapshot=False, storage_options=s3_options))
    saver.train_start(["h"], 0, 0)
    for step in (1, 2):
        saver.save(0, step, {"h": Holder(state(step))})
    saver.train_end(0, 2, lambda intra_epoch: {})

    bucket, _, prefix = run_url[len("s3://"):].partition("/")
    client = s3_client(s3_options)
    newest = f"{prefix}/epoch_0_step_2"
    metadata = json.loads(client.get_object(Bucket=bucket, Key=f"{newest}/.snapshot_metadata")["Body"].read())
    record = metadata["manifest"][f"0/h/{entry}"]
    key = f"{newest}/{record['location']}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    start, end = record.get("byte_range") or (0, len(body))
    body[(start + end) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))

    got = Holder({k: torch.zeros_like(v) for k, v in state(0).items()})
    with pytest.warns(SnapshotFallbackWarning, match=rf"skipping damaged snapshot \S*epoch_0_step_2: .*{record['location']}.*checksum"):
        restored = restore_from_latest(run_url, {"h": got}, storage_options=s3_options)
    assert restored == f"{run_url}/epoch_0_step_2".replace("step_2", "step_1")
    for name, value in state(1).items():
        assert torch.equal(got.state[name], value)


@pytest.mark.slow
def test_two_ranks_write_their_parts_of_the_index_to_s3_and_resume_bitwise(s3_options, run_url, tmp_path):
    """2 real gloo ranks (DDP) snapshot to S3: each rank puts its own part of the index; the index
    lists both parts by size and digest and no file itself; every file listed is an object; new
    processes restore from the latest snapshot to the trained weights on every rank."""
    worker = Path(__file__).with_name("s3_ranks_worker.py")
    (tmp_path / "s3.json").write_text(json.dumps({"url": run_url, "options": s3_options}))
    saved = launching.run_phase(worker, "save", 2, tmp_path)
    newest = "epoch_1_step_5"  # the snapshot at the end of training
    for record in saved:
        assert f"{newest}/{part_rel(record['rank'])}" in record["parts_written"]
    assert names_under(s3_options, run_url) == ["epoch_0_step_2", "epoch_0_step_4", newest]
    client, prefix = s3_client(s3_options), f"{run_url[len(f's3://{BUCKET}/'):]}/{newest}"
    body = lambda key: client.get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read()  # noqa: E731
    index = parse(body(INDEX_FNAME), run_url)
    assert index["format"] == 2 and index["files"] == {} and len(index["parts"]) == 2
    keys = set(keys_under(s3_options, run_url))
    for rank in range(2):
        files, checksums = parse_part(body(part_rel(rank)), index, rank, run_url)
        assert files and set(checksums) == set(files)
        assert {f"{newest}/{rel}" for rel in files} <= keys
    restored = launching.run_phase(worker, "restore", 2, tmp_path)
    for before, after in zip(saved, restored, strict=True):
        assert after["restored"] is True
        assert after["steps"] == 5 and after["weights"] == before["weights"]
