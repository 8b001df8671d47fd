"""The ``tnt-snapshot`` command line on ``s3://`` snapshot directories, against moto's S3 server on
127.0.0.1 (started as tests/test_s3.py starts it). The snapshots come from a real torchtnt run
writing to S3; the command gets its connection the way users give it: ``--endpoint-url`` or
boto3's environment variables.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import torch
from click.testing import CliRunner
from moto_s3 import BUCKET, create_bucket, moto_options, s3_client
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.restoring import latest_snapshot
from tnt_snapshot_plugin.stores import LEASE_FNAME, open_store
from tnt_snapshot_plugin.stores.ownership import new_run_id, writer_identity
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights

pytestmark = pytest.mark.slow


def test_every_command_on_s3(moto_endpoint, tmp_path, no_aws_environment):
    endpoint = moto_endpoint
    options = moto_options(endpoint)
    create_bucket(options)
    client = s3_client(options)
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"

    unit = ToyUnit()
    saver = TorchSnapshotSaver(url, save_every_n_train_steps=4, save_every_n_epochs=1, storage_options=options)
    train(unit, StatefulLoader(make_data(20)), max_epochs=2, callbacks=[saver])

    # What users and crashes leave: an interrupted write (no metadata), their own objects, a
    # truncated file.
    for obj in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/epoch_2_step_10/")["Contents"]:
        rel = obj["Key"].split("/", 2)[2]
        if rel != ".snapshot_metadata":
            client.copy_object(Bucket=BUCKET, Key=f"{prefix}/epoch_3_step_12/{rel}",
                               CopySource={"Bucket": BUCKET, "Key": obj["Key"]})
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/notes/todo.txt", Body=b"look at the loss\n")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/README.txt", Body=b"runs\n")
    index = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/epoch_1_step_5/.tnt_snapshot_index.json")["Body"].read())
    big = max(index["files"], key=index["files"].get)
    body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/epoch_1_step_5/{big}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/epoch_1_step_5/{big}", Body=body[: len(body) // 2])

    # Credentials from boto3's environment variables; the endpoint from the flag, or from the
    # environment too.
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    flag = ["--endpoint-url", endpoint]

    def run(*args: str, expect: int = 0, endpoint_env: bool = False) -> str:
        extra = {"AWS_ENDPOINT_URL_S3": endpoint} if endpoint_env else {}
        result = CliRunner().invoke(cli, list(args) + ([] if endpoint_env else flag), env={**env, **extra},
                                    catch_exceptions=False)
        assert result.exit_code == expect, (args, result.stdout, result.stderr)
        return result.stdout

    listing = json.loads(run("ls", url, "--json", endpoint_env=True))
    status = {e["name"]: e["status"] for e in listing["entries"]}
    assert status == {
        "epoch_0_step_4": "complete",
        "epoch_1_step_5": "damaged",
        "epoch_1_step_8": "complete",
        "epoch_2_step_10": "complete",
        "epoch_3_step_12": "incomplete",
        "README.txt": "foreign",
        "notes": "foreign",
    }
    assert listing["restore"] == "epoch_2_step_10"
    assert latest_snapshot(url, storage_options=options, verified=True) == f"{url}/epoch_2_step_10"
    assert "* restore_from_latest would restore epoch_2_step_10" in run("ls", url)

    doc = json.loads(run("inspect", f"{url}/epoch_1_step_8", "--json"))
    weight = next(e for e in doc["entries"] if e["path"] == "0/model/0.weight")
    assert (weight["shape"], weight["bytes"]) == ([16, 4], 256)
    assert doc["summary"]["train_progress"]["num_steps_completed"] == 8

    out = run("verify", url, expect=1)
    assert f"epoch_1_step_5: file {big} has {len(body) // 2} bytes, {len(body)} were written" in out
    run("verify", f"{url}/epoch_2_step_10")

    doc = json.loads(run("diff", f"{url}/epoch_1_step_8", f"{url}/epoch_2_step_10", "--json", expect=1))
    changes = {d["path"]: d["detail"] for d in doc["differences"]}
    assert changes["0/train_progress/num_steps_completed"] == "8 -> 10"
    assert changes["0/model/0.weight"].startswith("max |a-b| = ")

    out_path = tmp_path / "model.pt"
    run("export", f"{url}/epoch_2_step_10", str(out_path))
    assert_bitwise_equal(torch.load(out_path, weights_only=True), weights(unit))

    # The interrupted write is fresh: a run may still be writing it.
    result = CliRunner().invoke(cli, ["prune", url, "--keep-last", "1", *flag], env=env)
    assert result.exit_code == 1 and "refusing to prune" in result.stderr
    doc = json.loads(run("prune", url, "--keep-last", "1", "--min-staging-age", "0", "--json"))
    assert doc["deleted"] == ["epoch_0_step_4", "epoch_1_step_5", "epoch_1_step_8"]
    left = {o["Key"].split("/")[1] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]}
    assert left == {"epoch_2_step_10", "epoch_3_step_12", "notes", "README.txt"}


def test_cli_edges_on_s3(moto_endpoint, no_aws_environment, monkeypatch):
    """One snapshot's URL lists its files; a live run's lease is shown with its holder and keeps
    prune out (exit 2); a bucket that does not exist is one line naming --endpoint-url, exit 2."""
    endpoint = moto_endpoint
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    options = {"endpoint_url": endpoint, "region_name": "us-east-1"}  # credentials: the environment's
    create_bucket(options)
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    train(ToyUnit(), StatefulLoader(make_data(16)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(url, save_every_n_epochs=1, storage_options=options)])

    def run(*args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(cli, [*args, "--endpoint-url", endpoint], catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    code, out, err = run("ls", f"{url}/epoch_1_step_4")
    assert code == 0, err
    assert out.splitlines()[0].split() == ["FILE", "ROLE", "SIZE", "MODIFIED"] and "foreign" not in out
    assert out.splitlines()[-1].startswith(f"{url}/epoch_1_step_4: complete; ")
    doc = json.loads(run("ls", f"{url}/epoch_1_step_4", "--json")[1])
    assert {f["role"] for f in doc["files"]} == {"metadata", "index", "writer", "payload"}
    code, out, err = run("ls", f"{url}/epoch_9_step_90")  # no objects under it
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{url}/epoch_9_step_90 does not exist" in err and "holds one complete snapshot, epoch_1_step_4" in err

    holder = writer_identity(new_run_id())
    lease = open_store(url, options).lock({**holder, "started_at": time.time()})
    try:
        code, out, _ = run("ls", url)
        row = next(line for line in out.splitlines() if line.startswith(LEASE_FNAME))
        assert code == 0 and f"lock, held by host '{holder['host']}' pid {holder['pid']} run '{holder['run_id']}' since " in row
        code, out, err = run("prune", url, "--keep-last", "1")
        assert code == 2 and out == "" and err.count("\n") == 1 and f"run '{holder['run_id']}'" in err
    finally:
        lease.release()

    code, out, err = run("ls", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "the bucket does not exist" in err and "check the URL and --endpoint-url" in err
    assert "storage_options" not in err
