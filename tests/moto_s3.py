"""moto's S3 server on 127.0.0.1 for the tests, and what they read back from it.

The fixtures built on it live in tests/conftest.py: ``moto_endpoint`` (a server per test module),
``s3_options`` (storage_options for it, with :data:`BUCKET` created), ``run_url`` (a fresh prefix
in it), ``moto_server`` (a server of the test's own, to stop or to configure) and
``no_aws_environment`` (nothing reaches S3 but through ``storage_options``). Every client the
tests build points at loopback; none reads credentials or an endpoint from the environment.

Imports no framework, and boto3 only when called.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

#: The bucket the ``s3_options`` fixture creates.
BUCKET = "snapshots"
#: A loopback port nothing listens on (the discard port): where ``no_aws_environment`` points
#: the environment's endpoint, so a client that read the environment would fail.
DEAD_ENDPOINT = "http://127.0.0.1:9"
SERVER_START_DEADLINE_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # type: ignore[no-any-return]


def _moto_command(port: int) -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def start_moto(log_path: Path, **env: str) -> tuple[subprocess.Popen, str]:
    """moto_server on a free loopback port, answering: (its process, its endpoint URL). Its
    environment is this one without ``AWS_*``, plus ``env``; a port taken meanwhile is retried."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    environment.update(env)
    for _attempt in range(3):
        port = free_port()
        with open(log_path, "a") as log:
            proc = subprocess.Popen(_moto_command(port), stdout=log, stderr=subprocess.STDOUT, env=environment)
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_DEADLINE_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
                continue
            if proc.poll() is None:  # it is our server that answered
                return proc, endpoint
        stop(proc)
    pytest.fail(f"moto_server did not start:\n{log_path.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` (killed if it does not exit within 10 s) and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def moto_options(endpoint: str) -> dict[str, Any]:
    """storage_options for the server at ``endpoint``, with moto's dummy credentials."""
    return {
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }


def as_s3fs(options: dict[str, Any]) -> dict[str, Any]:
    """The same endpoint and credentials as s3fs takes them."""
    return {
        "endpoint_url": options["endpoint_url"],
        "key": options["aws_access_key_id"],
        "secret": options["aws_secret_access_key"],
        "client_kwargs": {"region_name": options["region_name"]},
    }


def s3_client(options: dict[str, Any]) -> Any:
    """A boto3 S3 client built from ``storage_options`` alone."""
    import boto3

    return boto3.session.Session().client("s3", **options)


def create_bucket(options: dict[str, Any], bucket: str = BUCKET) -> None:
    """Create ``bucket``; one this server already holds is left as it is."""
    client = s3_client(options)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


def keys_under(options: dict[str, Any], url: str) -> list[str]:
    """The keys below ``url`` (``s3://bucket/prefix``), relative to it, by name."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/"
    pages = s3_client(options).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", []))


def names_under(options: dict[str, Any], url: str) -> list[str]:
    """The first path component of every key below ``url``, each once, by name: the snapshots,
    complete or not, and whatever else is there."""
    return sorted({key.split("/", 1)[0] for key in keys_under(options, url)})
