"""An object store that goes away mid-run: training goes on, restore errors are typed.

moto's S3 server (test_s3.py's fixtures) is reached through a TCP proxy on 127.0.0.1 that the test
cuts (closes its listener and every open connection: requests are refused) and brings back.
botocore is told to try each request twice (``AWS_MAX_ATTEMPTS``), so a cut costs about a second
of backoff per request.
"""

from __future__ import annotations

import socket
import threading
import warnings
from typing import Any, Optional

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from moto_s3 import BUCKET
from torchtnt.framework.state import State
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    ConfigError,
    SnapshotFailedWarning,
    SnapshotNotFoundError,
    StorageUnavailableError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.stores.s3 import s3_error
from toy import StatefulLoader, ToyUnit, make_data, weights

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_aws_environment")]


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``; ``cut()`` refuses and drops every connection
    until ``restore()``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.port = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: Optional[socket.socket] = None
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            doomed, self._sockets = self._sockets, []
        if listener is not None:
            listener.close()
        for sock in doomed:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def proxy(moto_endpoint, s3_options):
    p = CuttableProxy(moto_endpoint)
    yield p
    p.cut()


@pytest.fixture
def few_retries(monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")


class OutageUnit(ToyUnit):
    """Cuts the proxy after step ``cut_at`` and brings it back after step ``back_at``."""

    def __init__(self, proxy: CuttableProxy, cut_at: int, back_at: int) -> None:
        super().__init__()
        self.proxy, self.cut_at, self.back_at = proxy, cut_at, back_at

    def train_step(self, state: State, data: Any) -> None:
        super().train_step(state, data)
        step = self.train_progress.num_steps_completed + 1
        if step == self.cut_at:
            self.saver.snapshotter.wait()  # the snapshot before the outage is committed
            self.proxy.cut()
        elif step == self.back_at:
            self.proxy.restore()


def test_outage_mid_run_warns_and_training_goes_on(proxy, s3_options, few_retries):
    opts = {**s3_options, "endpoint_url": proxy.endpoint}
    url = f"s3://{BUCKET}/outage"
    saver = TorchSnapshotSaver(url, save_every_n_train_steps=2, storage_options=opts)
    unit = OutageUnit(proxy, cut_at=3, back_at=8)
    unit.saver = saver
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(unit, StatefulLoader(make_data(40)), max_epochs=1, callbacks=[saver])  # 10 steps

    assert unit.train_progress.num_steps_completed == 10  # no storage error escaped a hook
    failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert failed, "the outage was not reported"
    assert any("epoch_0_step_4" in m or "epoch_0_step_6" in m for m in failed)
    committed = [r.step for r in saver.snapshotter.stats.committed]
    assert 2 in committed and 10 in committed  # before the outage, and after it ended
    # Step 4's write ran out of retries inside the outage; step 6's, started inside it, may
    # finish once the endpoint is back (its retries span the end of the outage).
    assert 4 not in committed
    assert saver.snapshotter.stats.failures >= 1

    fresh = ToyUnit(seed=1)
    assert TorchSnapshotSaver.restore_from_latest(url, fresh, storage_options=opts)
    assert fresh.train_progress.num_steps_completed == 10
    for key, value in weights(unit).items():
        assert (weights(fresh)[key] == value).all()

    # The endpoint is down for restore: a typed error naming the URL, not botocore's.
    proxy.cut()
    with pytest.raises(StorageUnavailableError, match="s3://snapshots/outage") as info:
        TorchSnapshotSaver.restore_from_latest(url, ToyUnit(), storage_options=opts)
    assert isinstance(info.value.__cause__, EndpointConnectionError)
    with pytest.raises(StorageUnavailableError, match="epoch_0_step_10"):
        TorchSnapshotSaver.restore(f"{url}/epoch_0_step_10", ToyUnit(), storage_options=opts)


def test_restore_from_a_missing_bucket_is_not_found(s3_options):
    url = "s3://no-such-bucket/run"
    with pytest.raises(SnapshotNotFoundError, match="no-such-bucket"):
        TorchSnapshotSaver.restore_from_latest(url, ToyUnit(), storage_options=s3_options)
    with pytest.raises(SnapshotNotFoundError, match="no-such-bucket"):
        TorchSnapshotSaver.restore(f"{url}/epoch_0_step_2", ToyUnit(), storage_options=s3_options)


def test_restore_with_refused_credentials_is_a_config_error(moto_server):
    # A second moto server that checks credentials (moto's IAM mode): the dummy keys are refused.
    _proc, endpoint = moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0")
    opts = {
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": "not-a-key",
        "aws_secret_access_key": "x",
    }
    url = f"s3://{BUCKET}/run"
    with pytest.raises(ConfigError, match="credentials") as info:
        TorchSnapshotSaver.restore(f"{url}/epoch_0_step_2", ToyUnit(), storage_options=opts)
    assert url in str(info.value)
    with pytest.raises(ConfigError, match="credentials"):
        TorchSnapshotSaver.restore_from_latest(url, ToyUnit(), storage_options=opts)


def test_s3_error_mapping():
    def client_error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}}, "GetObject")

    url = "s3://b/run"
    assert isinstance(s3_error(url, client_error("NoSuchBucket")), SnapshotNotFoundError)
    for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
        mapped = s3_error(url, client_error(code))
        assert isinstance(mapped, ConfigError) and "credentials" in str(mapped) and url in str(mapped)
    assert isinstance(s3_error(url, client_error("InternalError")), StorageUnavailableError)
    assert isinstance(
        s3_error(url, EndpointConnectionError(endpoint_url="http://127.0.0.1:1")), StorageUnavailableError
    )
    assert s3_error(url, ValueError("x")) is None
