"""Shared fixtures. Plain helpers live beside them: tests/toy.py (training setups, small disks),
tests/dir_listing.py (what a local dirpath holds), tests/moto_s3.py (moto's S3 server) and
tests/launching.py (multi-process runs). Nothing here imports a framework at import time: the
pure-core tests run with torchtnt and Lightning hidden (tests/test_core.py)."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from moto_s3 import BUCKET, DEAD_ENDPOINT, create_bucket, moto_options, start_moto, stop

from tnt_snapshot_plugin.hooks import new_plugin_manager


@pytest.fixture
def pm():
    """A fresh plugin manager with no entry points loaded: tests register tiny plugins on it."""
    return new_plugin_manager(load_entrypoints=False)


@pytest.fixture
def faulty_local():
    """``faulty_local(path) -> (faulty, dirpath)``: a FaultyStore around a real LocalStore at
    ``path``, registered under a fresh ``fake://`` name (forgotten after the test), so real
    savers and restores opened on ``dirpath`` write to and read from the real disk at ``path``
    through faults and hooks the test chooses."""
    from tnt_snapshot_plugin.stores import LocalStore
    from tnt_snapshot_plugin.testing import FaultyStore, register, unregister

    names: list[str] = []

    def make(path):
        faulty = FaultyStore(LocalStore(str(path)))
        names.append(f"local-{uuid.uuid4().hex[:12]}")
        return faulty, register(names[-1], faulty)

    yield make
    for name in names:
        unregister(name)


# -- S3: moto's real server on loopback ----------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory):
    """The URL of moto's S3 server on 127.0.0.1:<free port>, one per test module, stopped after
    it; the module must leave the AWS_* environment as it found it."""
    environ_before = dict(os.environ)
    proc, endpoint = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield endpoint
    finally:
        stop(proc)
    changed = {k for k in set(os.environ) | set(environ_before) if os.environ.get(k) != environ_before.get(k)}
    leaked = sorted(k for k in changed if k.startswith("AWS_"))
    assert not leaked, f"the tests leaked environment changes: {leaked}"


@pytest.fixture
def s3_options(moto_endpoint) -> dict:
    """storage_options for the module's moto server, with dummy credentials; the bucket
    ``moto_s3.BUCKET`` exists."""
    options = moto_options(moto_endpoint)
    create_bucket(options)
    return options


@pytest.fixture
def run_url() -> str:
    """A fresh ``s3://`` prefix per test, in ``moto_s3.BUCKET``."""
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def moto_server(tmp_path):
    """``moto_server(**env) -> (process, endpoint)``: a moto S3 server of the test's own, for a
    test that stops or freezes it, or runs it with ``env`` added to its environment (which has no
    AWS_* variables). Stopped after the test, and continued first should the test have frozen it."""
    procs = []

    def start(**env):
        proc, endpoint = start_moto(tmp_path / f"moto{len(procs)}.log", **env)
        procs.append(proc)
        return proc, endpoint

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # never leave one stopped
        stop(proc)


@pytest.fixture
def no_aws_environment(monkeypatch):
    """No credentials or endpoint from the environment or ~/.aws, and the environment's endpoint a
    closed loopback port: S3 is reached through storage_options alone. Restored after the test."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", DEAD_ENDPOINT)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", DEAD_ENDPOINT)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
