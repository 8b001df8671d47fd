"""Two jobs on one dirpath (issue 32, point 6): the run's hold on its dirpath is checked, and kept
only while it is really the run's.

* S3: a lease renewal that the store applied but whose answer was lost (a proxy in front of moto
  forwards the PUT and closes the connection) is retried by botocore and answered 412: the lease
  is still this run's own, so renewal goes on and a second job stays refused. A lease really taken
  over, or removed, ends the run's commits into the dirpath. ``S3Store.begin`` raises the plugin's
  errors.
* Local disk: a dirpath removed under a live run (and taken by a second job, a real process) or a
  lock file removed or replaced: the run notices before each snapshot and at each commit, fails
  those snapshots saying what happened, and never commits into a dirpath another job holds.

Real torchtnt ``train``, real disk, moto's real S3 server on loopback, real processes.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import pytest
import torch
from dir_listing import complete_in_commit_order, staging_by_name
from moto_s3 import BUCKET, keys_under, s3_client
from torchtnt.framework.callback import Callback
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    ConfigError,
    LockWarning,
    SnapshotBusyWarning,
    SnapshotConfig,
    SnapshotFailedWarning,
    SnapshotNotFoundError,
    Snapshotter,
    SnapshotWriteError,
    StorageUnavailableError,
    hookimpl,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.hooks import new_plugin_manager
from tnt_snapshot_plugin.naming import is_staging_name
from tnt_snapshot_plugin.stores import LEASE_FNAME, LOCK_FNAME, LocalStore
from tnt_snapshot_plugin.stores import s3 as s3_mod
from tnt_snapshot_plugin.stores.ownership import new_run_id, writer_identity
from tnt_snapshot_plugin.stores.s3 import S3Store
from toy import Holder, StatefulLoader, ToyUnit, make_data

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.usefixtures("no_aws_environment")

#: The lease's length in these tests (renewed every fifth of it), instead of 5 minutes.
SHORT_LEASE_S = 4.0


def wait_until(done: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------
# S3: a proxy in front of moto that loses the answer to one lease renewal


class AnswerDroppingProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint: forwards every request and relays
    every answer, except that, once :meth:`arm` is called, it forwards the next lease renewal (a
    PUT of the lease object with ``If-Match``) and then closes the client's connection without a
    word. The store has applied the write; the client never hears of it and retries.
    ``renewals`` records each renewal's status as the store answered it, and whether it was
    dropped."""

    HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.renewals: list[tuple[int, bool]] = []
        self._armed = False
        self._lock = threading.Lock()
        self._connections: list[Any] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.append(self.connection)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy.forward(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def stop(self) -> None:
        """Stop listening and close the connections kept alive: the endpoint refuses from now on."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def renewals_after_the_drop(self) -> list[int]:
        with self._lock:
            dropped = [i for i, (_, d) in enumerate(self.renewals) if d]
            return [status for status, _ in self.renewals[dropped[0] + 1:]] if dropped else []

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        body = _request_body(handler)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in self.HOP_BY_HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        renewal = (
            handler.command == "PUT"
            and handler.path.split("?", 1)[0].endswith("/" + LEASE_FNAME)
            and "If-Match" in handler.headers
        )
        if renewal:
            with self._lock:
                drop, self._armed = self._armed, False
                self.renewals.append((response.status, drop))
            if drop:  # applied by the store; the client gets a closed connection
                handler.close_connection = True
                return
        handler.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in self.HOP_BY_HOP and key.lower() != "content-length":
                handler.send_header(key, value)
        length = response.getheader("Content-Length") if handler.command == "HEAD" else None
        handler.send_header("Content-Length", length if length is not None else str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)


def _request_body(handler: BaseHTTPRequestHandler) -> Optional[bytes]:
    """The request's body (Content-Length, or chunked transfer encoding), None if it has none."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";", 1)[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = handler.headers.get("Content-Length")
    return handler.rfile.read(int(length)) if length is not None else None


@pytest.fixture
def proxy(s3_options):
    p = AnswerDroppingProxy(s3_options["endpoint_url"])
    yield p
    p.stop()


def lease_of(opts: dict[str, Any], url: str) -> Optional[dict[str, Any]]:
    key = url[len(f"s3://{BUCKET}/"):] + "/" + LEASE_FNAME
    client = s3_client(opts)
    try:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    return json.loads(body)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_renewal_whose_answer_is_lost_is_the_runs_own_and_a_second_job_stays_refused(
    s3_options, run_url, proxy, monkeypatch
):
    """The proxy loses the answer to a renewal the store applied; botocore retries it against
    the version it replaced and gets 412. The lease read then is this run's own: no takeover
    warning, renewals go on past the lease's length, a second job during the run is refused
    naming the first, and the lease is released at train end."""
    monkeypatch.setattr(s3_mod, "LEASE_S", SHORT_LEASE_S)
    saver = TorchSnapshotSaver(
        run_url, save_every_n_train_steps=1, storage_options=dict(s3_options, endpoint_url=proxy.url),
        preemption_signals=[],
    )
    refusals: list[str] = []
    run_ids: list[str] = []

    class SecondJobMidRun(Callback):
        def on_train_step_end(self, state: Any, unit: Any) -> None:
            if unit.train_progress.num_steps_completed != 2:
                return
            run_ids.append(saver.snapshotter.guard.run_id)
            proxy.arm()
            wait_until(lambda: proxy.renewals_after_the_drop(), "the client's retry of the dropped renewal")
            # Well past the lease's length: a lease no longer renewed would have expired.
            time.sleep(1.5 * SHORT_LEASE_S)
            second = Snapshotter(run_url, SnapshotConfig.build(storage_options=s3_options, preemption_signals=[]))
            with pytest.raises(ConfigError, match="in use by another saver") as refused:
                second.train_start(["m"])
            refusals.append(str(refused.value))
            lease = lease_of(s3_options, run_url)
            assert lease is not None and lease["run_id"] == run_ids[0]
            assert lease["expires_at"] > time.time()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ToyUnit(), StatefulLoader(make_data(4 * 4)), max_epochs=1, callbacks=[saver, SecondJobMidRun()])
    unexpected = [str(w.message) for w in caught if not issubclass(w.category, SnapshotBusyWarning)]
    assert unexpected == []  # no takeover warning, no failed snapshot
    # The scenario happened: one renewal's answer was dropped, its retry was answered 412.
    assert [dropped for _, dropped in proxy.renewals].count(True) == 1
    after = proxy.renewals_after_the_drop()
    assert after[0] == 412 and after.count(200) >= 2, after  # and renewal went on
    assert refusals and re.search(rf"host .* pid {os.getpid()} run {run_ids[0]!r}", refusals[0]), refusals
    assert LEASE_FNAME not in keys_under(s3_options, run_url)  # released at train end
    assert "epoch_0_step_4/.snapshot_metadata" in keys_under(s3_options, run_url)


@pytest.mark.parametrize("what", ["taken over", "removed"])
def test_a_lease_taken_over_or_removed_ends_the_runs_commits(s3_options, run_url, what):
    """After a stall longer than the lease another saver took it over (or someone removed it):
    the renewal warns, and every later snapshot of the run fails saying so; the other saver's
    lease is left as it is."""
    config = SnapshotConfig.build(
        storage_options=s3_options, preemption_signals=[], async_snapshot=False, on_save_error="raise",
        save_on_train_end=False,
    )
    saver = Snapshotter(run_url, config)
    saver.train_start(["h"], 0, 0)
    assert saver.save(0, 1, {"h": Holder({"w": torch.zeros(4)})})
    key = run_url[len(f"s3://{BUCKET}/"):] + "/" + LEASE_FNAME
    other = {**writer_identity(new_run_id()), "expires_at": time.time() + 300}
    if what == "taken over":
        s3_client(s3_options).put_object(Bucket=BUCKET, Key=key, Body=json.dumps(other).encode())
        said = rf"was taken over by another saver \(.*run {other['run_id']!r}"
    else:
        s3_client(s3_options).delete_object(Bucket=BUCKET, Key=key)
        said = "was removed during the run"
    lease = saver.guard.lock
    assert isinstance(lease, s3_mod.S3Lease)
    with pytest.warns(LockWarning, match=said + ".*commits no more snapshots into it"):
        lease._renew()
    for step in (2, 3):  # for good
        with pytest.raises(SnapshotWriteError, match=rf"epoch_0_step_{step} .*failed.*{said}"):
            saver.save(0, step, {"h": Holder({"w": torch.ones(4)})})
    saver.train_end(0, 3, lambda intra_epoch: {})
    assert sorted(k for k in keys_under(s3_options, run_url) if k.endswith(".snapshot_metadata")) == [
        "epoch_0_step_1/.snapshot_metadata"
    ]
    assert lease_of(s3_options, run_url) == (other if what == "taken over" else None)


def test_s3_begin_raises_the_plugins_errors(s3_options, run_url, proxy):
    """A missing bucket and a stopped endpoint, met by the write's first request (its writer
    marker), are the plugin's typed errors naming the URL, as at every other S3 call."""
    from botocore.exceptions import BotoCoreError, ClientError

    writer = {**writer_identity(new_run_id()), "started_at": time.time()}
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(SnapshotNotFoundError, match=rf"s3://{bucket}/run/epoch_0_step_1: the bucket does not exist") as missing:
        S3Store(f"s3://{bucket}/run", s3_options).begin("epoch_0_step_1", writer)
    assert isinstance(missing.value.__cause__, ClientError)

    store = S3Store(run_url, dict(s3_options, endpoint_url=proxy.url), timeout_s=2.0)
    store.begin("epoch_0_step_1", writer)  # through the proxy, while it runs
    assert "epoch_0_step_1/.tnt_writer.json" in keys_under(s3_options, run_url)
    proxy.stop()
    with pytest.raises(StorageUnavailableError, match=rf"{run_url}/epoch_0_step_2: the object store could not be reached") as down:
        store.begin("epoch_0_step_2", writer)
    assert isinstance(down.value.__cause__, BotoCoreError)


# ------------------------------------------------------------------------------------------------
# Local disk: the lock file, and dirpath itself, are checked


def remove_tree(path: Path) -> None:
    """Remove ``path`` in one step (then delete it): nothing can be written into it meanwhile."""
    gone = path.with_name(path.name + f".removed-{uuid.uuid4().hex[:6]}")
    os.rename(path, gone)
    shutil.rmtree(gone)


@pytest.mark.parametrize(
    "change, said",
    [
        ("dirpath removed", r"dirpath '\S+' was removed during this run:"),
        ("dirpath taken by another job", r"dirpath '\S+' was removed during this run and created again; its lock file now names host .* run 'other"),
        ("lock file removed", r"the lock file \S+ of this run was removed from dirpath"),
        ("lock file replaced", r"the lock file \S+ of this run was replaced in dirpath .*; its lock file now names .* run 'other"),
    ],
)
def test_the_lock_notices_its_dirpath_or_lock_file_gone_and_stays_lost(tmp_path, change, said):
    dirpath = tmp_path / "run"
    store = LocalStore(str(dirpath))
    lock = store.lock({**writer_identity(new_run_id()), "started_at": time.time()})
    lock.check()  # held
    other = {**writer_identity("other" + uuid.uuid4().hex[:7]), "started_at": time.time()}
    taker = None
    if change == "dirpath removed":
        remove_tree(dirpath)
    elif change == "dirpath taken by another job":
        remove_tree(dirpath)
        taker = LocalStore(str(dirpath)).lock(other)
    elif change == "lock file removed":
        (dirpath / LOCK_FNAME).unlink()
    else:
        (dirpath / LOCK_FNAME).unlink()
        (dirpath / LOCK_FNAME).write_text(json.dumps(other))
    for _ in range(2):  # lost for good
        with pytest.raises(SnapshotWriteError, match=said + ".*commits no more snapshots into it"):
            lock.check()
    if change == "dirpath removed":
        assert not dirpath.exists()  # checking made nothing again
    lock.release()
    lock.check()  # released: nothing to check
    if taker is not None:  # the release left the other job's lock alone: it still holds dirpath
        assert json.loads((dirpath / LOCK_FNAME).read_text())["run_id"] == other["run_id"]
        with pytest.raises(ConfigError, match=f"run {other['run_id']!r}"):
            LocalStore(str(dirpath)).lock({**writer_identity(new_run_id()), "started_at": time.time()})
        taker.release()
    elif change == "lock file replaced":
        assert json.loads((dirpath / LOCK_FNAME).read_text()) == other


def test_a_lock_file_removed_during_a_write_fails_its_commit_and_every_later_snapshot(tmp_path, faulty_local, caplog):
    """The lock file is removed while step 2's files are written (after the snapshot started,
    so the check before it passed): its commit refuses, and so does every later snapshot (the
    first failure warned, the later ones of the same cause logged)."""
    dirpath = tmp_path / "run"
    faulty, hooked = faulty_local(dirpath)
    removed: list[str] = []

    def remove_lock(staging: str, rel: str) -> None:
        if not removed:
            removed.append(rel)
            (dirpath / LOCK_FNAME).unlink()

    faulty.hook("write_payload", after=remove_lock, match=lambda staging, rel: "epoch_0_step_2." in staging)
    saver = TorchSnapshotSaver(hooked, save_every_n_train_steps=1, preemption_signals=[])
    unit = ToyUnit()
    caplog.set_level(logging.INFO, logger="tnt_snapshot_plugin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(unit, StatefulLoader(make_data(4 * 4)), max_epochs=1, callbacks=[saver])
    # step 2 had started (its files were being written) when the lock file went: its commit refused
    assert removed and unit.train_progress.num_steps_completed == 4
    warned = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert len(warned) == 1, warned
    failures = warned + _logged_failures(caplog)
    assert all(issubclass(w.category, (SnapshotFailedWarning, SnapshotBusyWarning)) for w in caught)
    lost = r"the lock file \S+ of this run was removed from dirpath .*commits no more snapshots into it"
    for step in (2, 3, 4):
        assert any(re.search(rf"epoch_0_step_{step} \(epoch 0, step {step}\) failed.*{lost}", m) for m in failures), failures
    assert complete_in_commit_order(dirpath) == ["epoch_0_step_1"]
    assert staging_by_name(dirpath) == []  # the refused write removed


class ReportCommits:
    def __init__(self) -> None:
        self.steps: list[int] = []

    @hookimpl
    def tnt_snapshot_plugin_snapshot_committed(self, path: str, epoch: int, step: int) -> None:
        self.steps.append(step)


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the second job exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError("the second job never reached its write")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_dirpath_removed_under_a_live_run_is_never_shared_with_the_job_that_takes_it(tmp_path, caplog):
    """Job 1 trains into dirpath; at step 3 dirpath is removed and job 2 (a real process) starts
    on it, commits steps 1 and 2 and, live, writes step 3. Job 1 goes on training: each of its
    snapshots from step 3 on fails, saying dirpath was removed and naming job 2 as the lock's
    holder; it commits nothing into job 2's dirpath, deletes none of job 2's snapshots (it keeps
    2 snapshots itself), and its release at train end leaves job 2's lock in place."""
    dirpath = tmp_path / "run"
    ready = tmp_path / "ready"
    second: list[subprocess.Popen] = []
    commits = ReportCommits()
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(commits)

    class RemoveAndStartAnother(Callback):  # before the saver: step 3's snapshot comes after
        def on_train_step_end(self, state: Any, unit: Any) -> None:
            if unit.train_progress.num_steps_completed != 3:
                return
            remove_tree(dirpath)
            job = subprocess.Popen(
                [sys.executable, str(TESTS / "two_jobs_worker.py"), "hang", str(dirpath), str(ready)],
                cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            second.append(job)
            _wait_for_file(ready, job)  # job 2 holds dirpath: steps 1, 2 committed, 3 being written

    saver = TorchSnapshotSaver(
        str(dirpath), save_every_n_train_steps=1, keep_last_n_snapshots=2, async_snapshot=False,
        preemption_signals=[], plugin_manager=pm,
    )
    unit = ToyUnit()
    caplog.set_level(logging.INFO, logger="tnt_snapshot_plugin")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, StatefulLoader(make_data(4 * 6)), max_epochs=1, callbacks=[RemoveAndStartAnother(), saver])
        (job,) = second
        assert job.poll() is None  # job 2 is still live, in the middle of its write
        assert unit.train_progress.num_steps_completed == 6  # job 1 trained on
        assert commits.steps == [1, 2]  # nothing after the removal
        failures = [str(w.message) for w in caught]
        assert all(issubclass(w.category, SnapshotFailedWarning) for w in caught), failures
        assert len(failures) == 1, failures  # one warning per cause, the later failures logged
        failures += _logged_failures(caplog)
        said = (
            rf"dirpath '{re.escape(str(dirpath))}' was removed during this run and created again; its "
            rf"lock file now names host .* pid {job.pid} run .*commits no more snapshots into it"
        )
        for step in (3, 4, 5, 6):  # every later snapshot, the final one too
            assert any(re.search(rf"epoch_0_step_{step} \(epoch 0, step {step}\) failed.*{said}", m) for m in failures), failures
        # dirpath holds job 2's snapshots (retention of job 1 deleted none), its write and its lock
        names = sorted(os.listdir(dirpath))
        assert [n for n in names if not is_staging_name(n)] == [LOCK_FNAME, "epoch_0_step_1", "epoch_0_step_2"]
        for name in ("epoch_0_step_1", "epoch_0_step_2"):
            assert json.loads((dirpath / name / INDEX_FNAME).read_text())["writer"]["pid"] == job.pid
        (staging,) = [n for n in names if is_staging_name(n)]
        assert f"p{job.pid}n" in staging
        assert json.loads((dirpath / LOCK_FNAME).read_text())["pid"] == job.pid  # job 1 left it
        with pytest.raises(ConfigError, match=f"pid {job.pid}"):  # job 2 still holds it
            LocalStore(str(dirpath)).lock({**writer_identity(new_run_id()), "started_at": time.time()})
    finally:
        for job in second:
            job.send_signal(signal.SIGKILL)
            job.communicate()


def _logged_failures(caplog) -> list[str]:
    """The failed snapshots logged at INFO (after the first of their cause was warned)."""
    return [r.getMessage() for r in caplog.records if "failed and was not committed" in r.getMessage()]
