"""The ``tnt-snapshot`` command line on ``s3://`` snapshot directories, against moto's S3 server on
127.0.0.1 (started as tests/test_s3.py starts it). The snapshots come from a real torchtnt run
writing to S3; the command gets its connection the way users give it: ``--endpoint-url`` or
boto3's environment variables.
"""

from __future__ import annotations

import json
import os
import uuid

import boto3
import pytest
import torch
from click.testing import CliRunner
from test_s3 import BUCKET, _start_moto, _stop
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.restoring import latest_snapshot
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc, url = _start_moto(tmp_path_factory.mktemp("moto") / "moto.log", env)
    try:
        yield url
    finally:
        _stop(proc)


def test_every_command_on_s3(endpoint, tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"endpoint_url": endpoint, "region_name": "us-east-1",
               "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    client = boto3.session.Session().client("s3", **options)
    client.create_bucket(Bucket=BUCKET)
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
